"""Rollback cost on the Muse Glimmer cache geometry: checkpoint vs whole-cache copies.

39 ring planes of 2,048 rows + 13 growing planes, 2 KV heads x 128, float16, at several context
lengths. Per 16-token verify round it measures what ``SpeculativeCheckpoint`` retains and how
long ``begin`` + ``commit`` take, against the two alternatives: copying the whole cache, and
re-ordering every window into time order (what mlx-lm's multi-token ring update does).

Run: ``python -m benchmarks.rollback --json docs/rollback.json --markdown docs/rollback.md``
"""

import argparse
import json
import platform
import statistics
import sys
import time
from datetime import date

import mlx.core as mx

from dflash.cache import GrowingPlane, KvPlane, RingPlane, SpeculativeCheckpoint
from dflash.cache.plane import PlaneMeta

RING_LAYERS, FULL_LAYERS, WINDOW, HEADS, HEAD_DIM = 39, 13, 2048, 2, 128


def plane_at(context: int, window, block: int) -> KvPlane:
    """A plane in exactly the state sequential appends of ``context`` rows leave it in."""
    plane = RingPlane(window) if window else GrowingPlane()
    rows = min(context, window) if window else context
    capacity = window if window else -(-(context + block) // 256) * 256
    shape = (1, HEADS, capacity, HEAD_DIM)
    plane.set_buffers(
        mx.random.normal(shape).astype(mx.float16),
        mx.random.normal(shape).astype(mx.float16),
    )
    origin = context - rows
    plane.set_meta(
        PlaneMeta(capacity, rows, origin, origin % capacity if window else 0)
    )
    return plane


def muse_glimmer_cache(context: int, block: int):
    cache = [plane_at(context, WINDOW, block) for _ in range(RING_LAYERS)]
    cache += [plane_at(context, None, block) for _ in range(FULL_LAYERS)]
    mx.eval([p.keys for p in cache] + [p.values for p in cache])
    return cache


def timed(fn, repeats: int) -> float:
    """Median wall time of ``fn`` in milliseconds (``fn`` evaluates its own work)."""
    samples = []
    for _ in range(repeats):
        tic = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - tic) * 1e3)
    return statistics.median(samples)


def checkpoint_round(cache, block: int, accepted: int):
    """begin -> write the block -> commit(accepted); returns (retained bytes, ms of begin+commit).

    The block is written with ``KvPlane.write`` (not staged), so the checkpoint retains the
    rows it overwrites; that retention, which the first write triggers, is timed with
    ``begin``. (A staged verify block written by ``update_and_fetch`` retains nothing: see
    ``python -m benchmarks.cache_round``.)
    """
    rows = mx.random.normal((1, HEADS, block, HEAD_DIM)).astype(mx.float16)
    mx.eval(rows)
    tic = time.perf_counter()
    checkpoint = SpeculativeCheckpoint.begin(cache, block)
    checkpoint.retain_untouched()
    overhead = time.perf_counter() - tic
    for plane in cache:
        plane.write(plane.offset, rows, rows)
    mx.eval([p.keys for p in cache] + [p.values for p in cache])
    tic = time.perf_counter()
    checkpoint.commit(accepted)
    mx.eval([p.keys for p in cache] + [p.values for p in cache])
    overhead += time.perf_counter() - tic
    return checkpoint.retained_bytes, overhead * 1e3


def copy_whole_cache(cache):
    copies = [mx.array(p.keys) + 0 for p in cache] + [
        mx.array(p.values) + 0 for p in cache
    ]
    mx.eval(copies)


def reorder_windows(cache):
    ordered = []
    for plane in cache[:RING_LAYERS]:
        keys, values = plane.logical_rows()
        ordered += [mx.contiguous(keys), mx.contiguous(values)]
    mx.eval(ordered)


def measure(context: int, block: int, repeats: int) -> dict:
    cache = muse_glimmer_cache(context, block)
    retained, times = set(), []
    for accepted in range(block + 1):
        for _ in range(repeats):
            retained_bytes, ms = checkpoint_round(cache, block, accepted)
            retained.add(retained_bytes)
            times.append(ms)
    ring_bytes = sum(p.nbytes for p in cache[:RING_LAYERS])
    return {
        "context": context,
        "retained_bytes": sorted(retained),
        "checkpoint_ms": statistics.median(times),
        "copy_cache_bytes": sum(p.nbytes for p in cache),
        "copy_cache_ms": timed(lambda: copy_whole_cache(cache), repeats),
        "reorder_bytes": ring_bytes,
        "reorder_ms": timed(lambda: reorder_windows(cache), repeats),
    }


def markdown(results, command: str) -> str:
    lines = [
        f"Measured {date.today().isoformat()} on {platform.machine()} "
        f"({platform.system()}, mlx {mx.__version__}, device {mx.default_device()}).",
        f"Command: `{command}`",
        "",
        "| context | retained bytes / round | begin+commit (ms) | copy whole cache: bytes | ms "
        "| re-order windows: bytes | ms |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        retained = ", ".join(f"{b:,}" for b in r["retained_bytes"])
        lines.append(
            f"| {r['context']:,} | {retained} | {r['checkpoint_ms']:.3f} "
            f"| {r['copy_cache_bytes']:,} | {r['copy_cache_ms']:.2f} "
            f"| {r['reorder_bytes']:,} | {r['reorder_ms']:.2f} |"
        )
    return "\n".join(lines) + "\n"


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--contexts", type=int, nargs="+", default=[4096, 32768, 131072]
    )
    parser.add_argument("--block", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", help="write the results as JSON here")
    parser.add_argument("--markdown", help="write the table as Markdown here")
    args = parser.parse_args(argv)
    results = [measure(context, args.block, args.repeats) for context in args.contexts]
    command = "python -m benchmarks.rollback " + " ".join(argv or sys.argv[1:])
    table = markdown(results, command)
    print(table)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "date": date.today().isoformat(),
                    "command": command,
                    "results": results,
                },
                f,
                indent=2,
            )
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write("# Rollback cost, Muse Glimmer cache geometry\n\n" + table)


if __name__ == "__main__":
    main()
