"""Session 31, call C: does the chunk pass wait on its host-written parameter arrays?

argv: mode (reuse|fresh|both), calls, [timed]. `reuse`: every call the same plan, so the
memoised launch's int arrays (written by the host once) are reused; `fresh`: the memo
cleared before each call, so each call's int arrays are new host-written buffers (mlx
allocates host-created arrays in CUDA managed memory), as a decode step's new plan does.
With `timed`: wall time of 64 calls enqueued then evaluated once, medians of 7 (no ncu).
"""
import statistics
import sys
import time

import mlx.core as mx

from benchmarks.verify_kernels import GLIMMER, _attention_inputs
from dflash.metal import attention
from dflash.metal.attention import small_query_attention

mode, calls = sys.argv[1], int(sys.argv[2])
timed = len(sys.argv) > 3
queries, plane, block_k, block_v = _attention_inputs(GLIMMER, 4096, 16, False)


def call():
    return small_query_attention(queries, plane, block_k, block_v, scale=GLIMMER.dim ** -0.5,
                                 window=None, chunk=attention.CHUNK)


modes = ["reuse", "fresh"] if mode == "both" else [mode]
for m in modes:
    for _ in range(calls):
        if m == "fresh":
            attention._launch.cache_clear()
        mx.eval(call())
    print("mode", m, "ran", calls, flush=True)
if timed:
    for m in ["reuse", "fresh", "reuse", "fresh"]:
        walls = []
        for _ in range(7):
            outs = []
            mx.synchronize()
            t0 = time.perf_counter()
            for _ in range(64):
                if m == "fresh":
                    attention._launch.cache_clear()
                outs.append(call())
            mx.eval(outs)
            mx.synchronize()
            walls.append((time.perf_counter() - t0) / 64 * 1e6)
        print("timed", m, "us/call median", round(statistics.median(walls), 1), "all", [round(w, 1) for w in walls], flush=True)
