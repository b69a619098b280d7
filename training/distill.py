"""The target's own greedy continuations of corpus prompts: the drafter's training data.

``python -m training.distill --data data --target out/target --out data/distill``
writes ``train.npy`` (uint16, (n, prompt_len + new_tokens)) from training-split prompts
for at most ``--seconds``, ``heldout.npy`` from held-out prompts, and ``meta.json``.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import List, Optional

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import make_prompt_cache

from .shards import write_json
from .train_target import sample_windows


def greedy_continue(model, prompts: np.ndarray, new_tokens: int) -> np.ndarray:
    """Append the target's greedy continuation to each prompt (no early stop).

    Args:
        model: An mlx-lm model.
        prompts: Equal-length prompts.
        new_tokens: Tokens to generate per prompt.

    Returns:
        Prompts followed by their continuations.

    Shapes: prompts (b, P) -> (b, P + new_tokens) uint16.
    """
    cache = make_prompt_cache(model)
    logits = model(mx.array(prompts.astype(np.int32)), cache=cache)
    token = mx.argmax(logits[:, -1], axis=-1)
    out = [token]
    for _ in range(new_tokens - 1):
        logits = model(token[:, None], cache=cache)
        token = mx.argmax(logits[:, -1], axis=-1)
        mx.async_eval(token)
        out.append(token)
    generated = np.array(mx.stack(out, axis=1)).astype(np.uint16)
    return np.concatenate([prompts.astype(np.uint16), generated], axis=1)


def distill(
    model,
    tokens: np.ndarray,
    prompt_len: int,
    new_tokens: int,
    batch: int,
    max_rows: int,
    seconds: float,
    seed: int,
) -> np.ndarray:
    """Continue random corpus windows until ``max_rows`` rows or ``seconds`` pass.

    Shapes: tokens (N,) -> (rows, prompt_len + new_tokens) uint16.
    """
    rows: List[np.ndarray] = []
    start = time.perf_counter()
    step = 0
    while (
        sum(len(r) for r in rows) < max_rows and time.perf_counter() - start < seconds
    ):
        prompts = sample_windows(tokens, step, batch, prompt_len, seed)
        rows.append(greedy_continue(model, prompts, new_tokens))
        step += 1
    return np.concatenate(rows)[:max_rows]


def main(argv: Optional[List[str]] = None) -> None:
    from mlx_lm import load

    parser = argparse.ArgumentParser(prog="python -m training.distill")
    parser.add_argument("--data", type=Path, default=Path("data"))
    parser.add_argument("--target", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--prompt-len", type=int, default=192)
    parser.add_argument("--new-tokens", type=int, default=320)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--max-rows", type=int, default=65536)
    parser.add_argument("--heldout-rows", type=int, default=128)
    parser.add_argument("--seconds", type=float, default=120.0)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    model, _ = load(str(args.target))
    args.out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    train = distill(
        model,
        np.load(args.data / "train.npy"),
        args.prompt_len,
        args.new_tokens,
        args.batch,
        args.max_rows,
        args.seconds,
        args.seed,
    )
    train_seconds = time.perf_counter() - started
    heldout = distill(
        model,
        np.load(args.data / "heldout.npy"),
        args.prompt_len,
        args.new_tokens,
        min(args.batch, args.heldout_rows),
        args.heldout_rows,
        float("inf"),
        args.seed + 1,
    )
    np.save(args.out / "train.npy", train)
    np.save(args.out / "heldout.npy", heldout)
    meta = {
        "prompt_len": args.prompt_len,
        "new_tokens": args.new_tokens,
        "train_rows": int(train.shape[0]),
        "heldout_rows": int(heldout.shape[0]),
        "seed": args.seed,
        "train_seconds": round(train_seconds, 1),
        "target": str(args.target),
    }
    write_json(args.out / "meta.json", meta)
    print(meta)


if __name__ == "__main__":
    main()
