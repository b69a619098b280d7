"""Standalone reproduction: mlx's CUDA attention slows down when the key length changes every call.

Only mlx is needed (no mlx-lm, no dflash), so it can go to an upstream report as is. It times
"rounds" shaped like a speculative-decoding verify: 13 calls of
``mx.fast.scaled_dot_product_attention`` with 16 queries (32 query heads, 2 KV heads, head
dim 128, bfloat16), once per round, under three key-length schedules:

- ``growing``: the key length grows by 16 rows every round (what a plain KV cache returns);
- ``fixed``: the same key length every round;
- ``bucketed``: the key length rounded up to a multiple of 256 rows, the tail masked out.

Run: ``python repro_sdpa_key_length.py [--rounds 60] [--start 4096]`` on a CUDA machine, once
with the default settings and once with ``MLX_CUDA_USE_CUDNN_SDPA=0``. It prints the median and
the worst round of each schedule, for the first and the last third of the rounds.
"""

import argparse
import json
import os
import platform
import statistics
import time

import mlx.core as mx

QUERIES, HEADS, KV_HEADS, HEAD_DIM, CALLS = 16, 32, 2, 128, 13
BUCKET = 256


def attention_round(keys, values, queries, key_length: int, masked_from: int):
    """13 attention calls over ``key_length`` rows; rows at or past ``masked_from`` are masked."""
    k = keys[:, :, :key_length]
    v = values[:, :, :key_length]
    mask = None
    if masked_from < key_length:
        # Causal within the block, nothing past the live rows.
        query_pos = mx.arange(masked_from - QUERIES, masked_from)[:, None]
        key_pos = mx.arange(key_length)[None]
        mask = key_pos <= query_pos
    outputs = []
    for _ in range(CALLS):
        outputs.append(
            mx.fast.scaled_dot_product_attention(
                queries, k, v, scale=HEAD_DIM**-0.5, mask=mask if mask is not None else "causal"
            )
        )
    return outputs


def run(schedule: str, rounds: int, start: int):
    key_cap = start + QUERIES * (rounds + 1) + BUCKET
    keys = mx.random.normal((1, KV_HEADS, key_cap, HEAD_DIM)).astype(mx.bfloat16)
    values = mx.random.normal((1, KV_HEADS, key_cap, HEAD_DIM)).astype(mx.bfloat16)
    queries = mx.random.normal((1, HEADS, QUERIES, HEAD_DIM)).astype(mx.bfloat16)
    mx.eval(keys, values, queries)
    times = []
    for r in range(rounds):
        live = start + QUERIES * (r + 1)
        if schedule == "growing":
            length, masked_from = live, live
        elif schedule == "fixed":
            length, masked_from = start + QUERIES, start + QUERIES
        else:
            length, masked_from = -(-live // BUCKET) * BUCKET, live
        tic = time.perf_counter()
        mx.eval(attention_round(keys, values, queries, length, masked_from))
        times.append((time.perf_counter() - tic) * 1e3)
    third = max(1, rounds // 3)
    first, last = times[:third], times[-third:]
    return {
        "first_third_median_ms": round(statistics.median(first), 3),
        "last_third_median_ms": round(statistics.median(last), 3),
        "worst_ms": round(max(times), 3),
        "rounds": rounds,
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=60)
    parser.add_argument("--start", type=int, default=4096)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    report = {
        "mlx": mx.__version__,
        "device": str(mx.default_device()),
        "cuda": bool(getattr(mx, "cuda", None) and mx.cuda.is_available()),
        "MLX_CUDA_USE_CUDNN_SDPA": os.environ.get("MLX_CUDA_USE_CUDNN_SDPA", "(unset)"),
        "machine": platform.node(),
        "shape": f"{QUERIES} queries, {HEADS}/{KV_HEADS} heads x {HEAD_DIM}, bf16, {CALLS} calls a round",
        "start_keys": args.start,
    }
    # Warm up every schedule once so first-call compilation is not counted.
    for schedule in ("growing", "fixed", "bucketed"):
        run(schedule, 3, args.start)
    for schedule in ("growing", "fixed", "bucketed"):
        report[schedule] = run(schedule, args.rounds, args.start)
    print(json.dumps(report, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
