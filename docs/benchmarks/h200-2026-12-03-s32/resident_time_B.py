"""Session 32, call B (as it ran; `mul` was then the shipped `_resident_scalars`: the memoised
`host * 1`; `stack` is not memoised, so its `reused` rows are fresh scalar sets too): what a launch's scalar arrays cost the chunk pass + fold (CUPTI device time, all
kernels of a call, no profiler replay) by how they are made, reused (memoised) and fresh (a new
scalar set every call, as a decode step's new positions give):
  host:    mx.array(list) (managed memory, host-written), read by the kernels;
  mul:     host * 1 (one device op; the kernels read its device-allocated output);
  stack:   mx.stack of 4-byte scalars (each in mlx's small AccessedBy pool, no migration);
  host8:   host-made, unpadded (the 8-byte fparams in the small pool; session 31's shipped form).
argv: out.json rounds
"""
import json, os, statistics, sys

import mlx.core as mx

from benchmarks.verify_kernels import GLIMMER, _attention_inputs, time_op
from benchmarks.common import cupti_kernel_events
from dflash.metal import attention, backend, groups, heads, norms
from dflash.metal.attention import small_query_attention

out, rounds = sys.argv[1], int(sys.argv[2])
cases = {}
for context, kind, count in ((4096, "growing", 16), (4096, "ring", 16), (4096, "growing", 1)):
    cases[f"attn-{context}-{kind}-{count}"] = (_attention_inputs(GLIMMER, context, count, kind == "ring"), kind == "ring")
hidden = 6656
branch = mx.random.normal((1, 16, hidden)).astype(mx.bfloat16)
residual = mx.random.normal((1, 16, hidden)).astype(mx.bfloat16)
weight = mx.random.normal((hidden,)).astype(mx.bfloat16)
mx.eval(branch, residual, weight)
shipped_resident = backend._resident_scalars


def stack_scalars(values, dtype_name):
    dtype = getattr(mx, dtype_name)
    return mx.stack([mx.array(v, dtype) for v in values])


def clear():
    backend._host_scalars.cache_clear()
    shipped_resident.cache_clear()
    attention._launch.cache_clear()
    norms._float_params.cache_clear()
    heads._float_params.cache_clear()


def use(mode):
    groups.MIN_PARAMS = 1 if mode == "host8" else 4
    os.environ[backend.RESIDENT_ENV] = "0" if mode in ("host", "host8") else "1"
    backend._resident_scalars = stack_scalars if mode == "stack" else shipped_resident
    clear()


def attn_fn(inputs, ring, fresh):
    queries, plane, block_k, block_v = inputs

    def fn():
        if fresh:
            clear()
        return small_query_attention(queries, plane, block_k, block_v, scale=GLIMMER.dim ** -0.5,
                                     window=GLIMMER.window if ring else None, use_kernel=True)
    return fn


def norm_fn(fresh):
    def fn():
        if fresh:
            clear()
        return mx.concatenate([a.reshape(-1) for a in norms.residual_norm(
            branch, residual, weight, 1e-6, next_weight=weight, next_eps=1e-6, use_kernel=True)])
    return fn


def per_call(fn, reps):
    mx.eval(fn())
    def calls():
        for _ in range(reps):
            mx.eval(fn())
    events = cupti_kernel_events(calls)
    by = {}
    for name, _, d in events:
        by.setdefault(name[:60], []).append(d)
    return sum(d for _, _, d in events) / reps, {k: [round(statistics.median(v), 2), len(v) // reps] for k, v in by.items()}


rows = []
for r in range(rounds):
    for mode in ("host", "mul", "stack", "host8"):
        use(mode)
        for fresh in (False, True):
            fns = {name: attn_fn(*args, fresh) for name, args in cases.items()}
            fns["residual-norm-16x6656"] = norm_fn(fresh)
            for name, fn in fns.items():
                total, kernels = per_call(fn, 30)
                t = time_op(fn, 30, 16)
                row = {"round": r, "mode": mode, "fresh": fresh, "case": name, "device_us": round(total, 2),
                       "kernels": kernels, "pipelined_us": round(t["pipelined_us"], 1)}
                rows.append(row)
                print(json.dumps(row), flush=True)
summary = {}
for row in rows:
    key = f"{row['case']} {row['mode']} {'fresh' if row['fresh'] else 'reused'}"
    summary.setdefault(key, []).append(row["device_us"])
summary = {k: {"median_us": statistics.median(v), "all": v} for k, v in summary.items()}
for k, v in summary.items():
    print(f"{k:48s} {v['median_us']:8.2f}  {v['all']}")
json.dump({"rows": rows, "summary": summary}, open(out, "w"), indent=1)
