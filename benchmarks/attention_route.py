"""Block attention: mlx's fused attention against the folded GEMM form, per key length.

One call is what a verify (or draft) block runs in one layer: ``S`` queries of Muse
Glimmer's geometry (32 query / 2 KV heads x 128, bf16) over keys read as a slice of a
larger plane buffer, with the bucketed key length and boolean mask the dflash cache
gives the GPU. Each timing evaluates ``--calls`` independent calls at once (as a
forward's layers do) and reports the median time per call; both forms run interleaved
in one process. This is the measurement behind
:data:`dflash.folded_attention.FOLDED_BY_DEFAULT` and ``MIN_KEYS``.

Run::

    python -m benchmarks.attention_route --json results/attention-route.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any, Dict, List

import mlx.core as mx

from dflash.bench.report import environment
from dflash.cache.plane import KEY_BUCKET, bucket_end
from dflash.folded_attention import causal_block_mask, folded_attention


def plane_slices(heads_kv: int, rows: int, dim: int, calls: int, dtype):
    """``calls`` key/value pairs, each the first ``rows`` rows of a larger plane buffer."""
    capacity = bucket_end(rows + KEY_BUCKET)
    out = []
    for _ in range(calls):
        kv = mx.random.normal((2, 1, heads_kv, capacity, dim)).astype(dtype)
        out.append((kv[0, :, :, :rows], kv[1, :, :, :rows]))
    mx.eval(out)
    return out


def time_form(form, queries, kv, scale, mask, reps: int) -> float:
    """Median microseconds per call over ``reps`` evaluations of all calls at once."""

    def run():
        outs = [form(q, k, v, scale, mask) for q, (k, v) in zip(queries, kv)]
        mx.eval(outs)

    for _ in range(3):
        run()
    samples = []
    for _ in range(reps):
        start = time.perf_counter()
        run()
        samples.append((time.perf_counter() - start) * 1e6 / len(queries))
    return statistics.median(samples)


def fused(q, k, v, scale, mask):
    return mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask)


def measure(args: argparse.Namespace) -> List[Dict[str, Any]]:
    dtype = mx.bfloat16
    rows_out = []
    for live in args.keys:
        for count in args.queries:
            rows = bucket_end(live)
            kv = plane_slices(args.kv_heads, rows, args.dim, args.calls, dtype)
            queries = [
                mx.random.normal((1, args.heads, count, args.dim)).astype(dtype)
                for _ in range(args.calls)
            ]
            mask = causal_block_mask(count, live, rows)
            mx.eval(queries, mask)
            scale = args.dim**-0.5
            a = folded_attention(queries[0], *kv[0], scale, mask)
            b = fused(queries[0], *kv[0], scale, mask)
            diff = float(mx.abs(a.astype(mx.float32) - b.astype(mx.float32)).max())
            times = {"fused": [], "folded": []}
            for _ in range(args.rounds):
                times["fused"].append(time_form(fused, queries, kv, scale, mask, 5))
                times["folded"].append(
                    time_form(folded_attention, queries, kv, scale, mask, 5)
                )
            row = {
                "live_keys": live,
                "key_rows": rows,
                "queries": count,
                "fused_us": statistics.median(times["fused"]),
                "folded_us": statistics.median(times["folded"]),
                "max_abs_diff": diff,
            }
            row["speedup"] = row["fused_us"] / row["folded_us"]
            rows_out.append(row)
            print(
                f"keys {live:6d} S {count:2d}: fused {row['fused_us']:8.1f} us  "
                f"folded {row['folded_us']:8.1f} us  x{row['speedup']:.2f}  "
                f"diff {diff:.2e}",
                flush=True,
            )
    return rows_out


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="attention_route", description=__doc__)
    parser.add_argument(
        "--keys", type=lambda s: [int(x) for x in s.split(",")],
        default=[512, 1024, 2064, 4096, 8192, 16384, 32768],
    )  # fmt: skip
    parser.add_argument(
        "--queries", type=lambda s: [int(x) for x in s.split(",")], default=[16]
    )
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--calls", type=int, default=13)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    rows = measure(args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "environment": environment("python -m benchmarks.attention_route"),
                    "rows": rows,
                },
                f,
                indent=1,
            )


if __name__ == "__main__":
    main()
