"""mlx-lm's speculative decoding vs dflash's on a tiny sliding-window model.

Builds a random-weight Muse Glimmer (8 layers, window 32) as the target and a smaller one as
the draft model, then generates greedily three ways: the target alone, mlx-lm's
``speculative_generate_step`` and ``dflash.speculative_generate_step``. mlx-lm's output leaves
the target's once a verify block crosses the window; dflash's does not.

Run: ``python examples/divergence.py [--window 32] [--tokens 100]``
"""

import argparse
import importlib
import sys

import mlx.core as mx
from mlx_lm.models import muse_glimmer

import dflash


def tiny_glimmer(seed: int, layers: int, window: int) -> muse_glimmer.Model:
    mx.random.seed(seed)
    args = muse_glimmer.ModelArgs(
        hidden_size=64,
        num_hidden_layers=layers,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        vocab_size=256,
        sliding_window=window,
    )
    model = muse_glimmer.Model(args)
    model.set_dtype(mx.float32)
    mx.eval(model.parameters())
    return model


def first_difference(a, b):
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--window", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=100)
    parser.add_argument("--num-draft-tokens", type=int, default=4)
    args = parser.parse_args()
    importlib.import_module("mlx_lm.generate")
    mlx_generate = sys.modules[
        "mlx_lm.generate"
    ]  # the package attribute is the function

    target = tiny_glimmer(0, 8, args.window)
    draft = tiny_glimmer(1, 4, args.window)
    prompt = mx.random.randint(0, 256, (19,))

    greedy = [
        t for t, _ in mlx_generate.generate_step(prompt, target, max_tokens=args.tokens)
    ]
    theirs = mlx_generate.speculative_generate_step(
        prompt,
        target,
        draft,
        num_draft_tokens=args.num_draft_tokens,
        max_tokens=args.tokens,
    )
    theirs = [t for t, _, _ in theirs]
    ours = dflash.speculative_generate_step(
        prompt,
        target,
        draft,
        num_draft_tokens=args.num_draft_tokens,
        max_tokens=args.tokens,
    )
    ours = [t for t, _, _ in ours]

    print(
        f"target: muse_glimmer, 8 layers, sliding window {args.window}; prompt 19 tokens"
    )
    for name, tokens in (
        ("target greedy", greedy),
        ("mlx-lm speculative", theirs),
        ("dflash speculative", ours),
    ):
        print(f"{name:>20}: {' '.join(map(str, tokens[:24]))} ...")
    for name, tokens in (("mlx-lm", theirs), ("dflash", ours)):
        index = first_difference(greedy, tokens)
        verdict = (
            "equal to the target's greedy output"
            if index is None
            else (f"leaves the target's greedy output at generated token {index}")
        )
        print(f"{name}: {verdict}")


if __name__ == "__main__":
    main()
