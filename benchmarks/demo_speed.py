"""Wall-clock decoding speed of the demo pair: mlx-lm's ``generate_step`` vs DFlash.

Both generate ``--max-tokens`` greedy tokens for each of the first ``--limit`` held-out
prompts, one after the other, in passes that alternate the two generators; the first pass
pays mlx's kernel compilation, so compare later passes. Speed only means something on a GPU
(on mlx's CPU backend a 16-token forward costs 10-14x a 1-token one).

Run: ``python -m benchmarks.demo_speed --limit 16 --json speed.json``
"""

import argparse
import json
import platform
import sys
import time
from datetime import datetime, timezone

import mlx.core as mx
from mlx_lm.generate import generate_step

import dflash
from dflash import dflash_generate_step
from dflash.bench import default_prompts_path, read_prompts


def plain_tokens(model, prompt: mx.array, max_tokens: int) -> int:
    """Tokens mlx-lm's own greedy ``generate_step`` yields."""
    return sum(1 for _ in generate_step(prompt, model, max_tokens=max_tokens))


def dflash_tokens(model, drafter, prompt: mx.array, max_tokens: int) -> int:
    """Tokens DFlash's greedy ``dflash_generate_step`` yields."""
    steps = dflash_generate_step(prompt, model, drafter, max_tokens=max_tokens)
    return sum(1 for _ in steps)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.demo_speed")
    parser.add_argument("--limit", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--passes", type=int, default=2)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    model, tokenizer, drafter = dflash.load_demo()
    prompts = [
        mx.array(tokenizer.encode(text))
        for text in read_prompts(default_prompts_path(), args.limit)
    ]
    generators = {
        "mlx_lm.generate_step": lambda p: plain_tokens(model, p, args.max_tokens),
        "dflash_generate_step": lambda p: dflash_tokens(
            model, drafter, p, args.max_tokens
        ),
    }
    passes = []
    for index in range(args.passes):
        for name, generate in generators.items():
            tic = time.perf_counter()
            tokens = sum(generate(prompt) for prompt in prompts)
            seconds = time.perf_counter() - tic
            passes.append(
                {
                    "pass": index,
                    "generator": name,
                    "tokens": tokens,
                    "seconds": round(seconds, 2),
                    "tokens_per_second": round(tokens / seconds, 1),
                }
            )
            print(json.dumps(passes[-1]))
    report = {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join(["python -m benchmarks.demo_speed"] + sys.argv[1:]),
        "machine": f"{platform.platform()}, mlx {mx.__version__}, {mx.default_device()}",
        "prompts": len(prompts),
        "max_tokens": args.max_tokens,
        "passes": passes,
    }
    if args.json:
        with open(args.json, "w") as out:
            json.dump(report, out, indent=1)


if __name__ == "__main__":
    main()
