"""Host vs device time of one verify round's cache work, against mlx-lm's own caches.

A round at Muse Glimmer geometry (39 ring + 13 growing layers, 2 KV heads x 128, bfloat16,
16-token block, rings full and rotated) is split into four timed parts:

* fetch, host: ``SpeculativeCheckpoint.begin`` + ``update_and_fetch`` in every layer (Python
  and mlx graph building, nothing evaluated);
* fetch, eval: ``mx.eval`` of what attention would read, then a device sync;
* commit, host: ``commit(kept)`` (lazy);
* commit, eval: evaluating the ring buffers.

The same split is printed for mlx-lm's ``RotatingKVCache`` / ``KVCache`` taking the same
block (no commit: they cannot roll back a wrapped ring). Medians of ``--reps`` rounds.

    python -m benchmarks.cache_split            # full geometry (GPU host)
    python -m benchmarks.cache_split --small    # 6 ring + 2 growing layers of 256 rows (CPU)

The kernels route runs only with mlx's Metal or CUDA backend.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Callable

import mlx.core as mx
from mlx_lm.models.cache import KVCache, RotatingKVCache

from dflash.cache import SpeculativeCheckpoint
from dflash.metal import kernel_backend

from .common import Geometry, block_kv, cache_fetch, fill_cache, make_cache, rewind


def split(begin_fetch: Callable, finish: Callable, reps: int, warmup: int = 5) -> str:
    """Median host/eval ms of the fetch and commit halves of ``reps`` rounds."""
    parts: list[list[float]] = [[], [], [], []]
    for rep in range(warmup + reps):
        mx.synchronize()
        t0 = time.perf_counter()
        state, seen = begin_fetch()
        t1 = time.perf_counter()
        mx.eval(seen)
        mx.synchronize()
        t2 = time.perf_counter()
        del seen  # a live view would keep the buffers from being updated in place
        pending = finish(state)
        t3 = time.perf_counter()
        mx.eval(pending)
        mx.synchronize()
        t4 = time.perf_counter()
        del pending
        if rep >= warmup:
            for part, elapsed in zip(parts, (t1 - t0, t2 - t1, t3 - t2, t4 - t3)):
                part.append(elapsed * 1e3)
    fetch_host, fetch_eval, commit_host, commit_eval = map(statistics.median, parts)
    return (
        f"fetch: host {fetch_host:6.3f} eval {fetch_eval:6.3f} | "
        f"commit: host {commit_host:6.3f} eval {commit_eval:6.3f} ms"
    )


def ours(geom: Geometry, context: int, use_kernel: bool, kept: int, reps: int) -> str:
    cache = make_cache(geom, use_kernel)
    fill_cache(cache, geom, context)
    metas = [plane.meta for plane in cache]
    rows = block_kv(geom, geom.layers)

    def begin_fetch():
        checkpoint = SpeculativeCheckpoint.begin(cache, geom.block)
        return checkpoint, cache_fetch(cache, rows)

    def finish(checkpoint):
        checkpoint.commit(kept)
        buffers = [plane.kv for plane in cache]
        rewind(cache, metas)
        return buffers

    return split(begin_fetch, finish, reps)


def mlx_lm(geom: Geometry, context: int, reps: int) -> str:
    layers = []
    for index in range(geom.layers):
        if index in geom.full_layers():
            layer, rows = KVCache(), -(-(context + geom.block) // 256) * 256
        else:
            layer, rows = RotatingKVCache(max_size=geom.window), geom.window
        shape = (1, geom.heads, rows, geom.dim)
        layer.keys = mx.random.normal(shape).astype(geom.mx_dtype)
        layer.values = mx.random.normal(shape).astype(geom.mx_dtype)
        layer.offset = context
        if isinstance(layer, RotatingKVCache):
            layer._idx = context % geom.window
        mx.eval(layer.keys, layer.values)
        layers.append(layer)
    saved = [dict(vars(layer)) for layer in layers]
    rows = block_kv(geom, geom.layers)

    def begin_fetch():
        pairs = zip(layers, rows)
        return None, [a for c, (k, v) in pairs for a in c.update_and_fetch(k, v)]

    def finish(_):
        for layer, attributes in zip(layers, saved):
            vars(layer).update(attributes)
        return []

    return split(begin_fetch, finish, reps)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--small", action="store_true", help="CPU-sized geometry")
    parser.add_argument("--contexts", type=int, nargs="+", default=[4096, 32768])
    parser.add_argument("--reps", type=int, default=30)
    args = parser.parse_args()
    geom = Geometry(window=256, sliding=6, full=2) if args.small else Geometry()
    modes = [("reference", False)] + ([("kernels", True)] if kernel_backend() else [])
    print(f"mlx {mx.__version__}, {mx.default_device()}, kernels: {kernel_backend()}")
    for context in args.contexts:
        for mode, use_kernel in modes:
            for kept in (0, 1, geom.block):
                result = ours(geom, context, use_kernel, kept, args.reps)
                print(f"{context:6d} {mode:9s} kept {kept:2d}  {result}")
        print(f"{context:6d} mlx-lm caches     {mlx_lm(geom, context, args.reps)}")


if __name__ == "__main__":
    main()
