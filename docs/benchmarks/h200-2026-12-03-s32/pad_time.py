"""Session 32: device time (CUPTI, kernels only) of the chunk pass + fold and of the residual
norm with launch scalar arrays padded to 16 bytes (groups.MIN_PARAMS = 4, shipped) against
unpadded (1), alternating in one process; and host-timed pipelined calls.

argv: out.json rounds
"""
import json, statistics, sys

import mlx.core as mx

from benchmarks.verify_kernels import GLIMMER, _attention_inputs, device_time, time_op
from dflash.metal import attention, groups, norms
from dflash.metal.attention import small_query_attention

out, rounds = sys.argv[1], int(sys.argv[2])
cases = {}
for context, kind, count in ((4096, "growing", 16), (4096, "ring", 16), (4096, "growing", 1), (32768, "growing", 16)):
    cases[f"attn-{context}-{kind}-{count}"] = (_attention_inputs(GLIMMER, context, count, kind == "ring"), kind == "ring")
hidden = 6656
branch = mx.random.normal((1, 16, hidden)).astype(mx.bfloat16)
residual = mx.random.normal((1, 16, hidden)).astype(mx.bfloat16)
weight = mx.random.normal((hidden,)).astype(mx.bfloat16)
mx.eval(branch, residual, weight)


def use(pad):
    groups.MIN_PARAMS = pad
    groups.int_params.cache_clear()
    groups.float_params.cache_clear()
    attention._launch.cache_clear()
    norms._float_params.cache_clear()


def attn_fn(inputs, ring):
    queries, plane, block_k, block_v = inputs
    return lambda: small_query_attention(queries, plane, block_k, block_v, scale=GLIMMER.dim ** -0.5,
                                         window=GLIMMER.window if ring else None, use_kernel=True)


def norm_fn():
    return lambda: mx.concatenate([a.reshape(-1) for a in norms.residual_norm(
        branch, residual, weight, 1e-6, next_weight=weight, next_eps=1e-6, use_kernel=True)])


rows = []
for r in range(rounds):
    for pad in (4, 1):
        use(pad)
        fns = {name: attn_fn(*args) for name, args in cases.items()}
        fns["residual-norm-16x6656"] = norm_fn()
        for name, fn in fns.items():
            d = device_time(fn, 40)
            t = time_op(fn, 40, 32)
            row = {"round": r, "pad": pad, "case": name, "device_us": round(d["device_us"], 2),
                   "kernels": d["device_kernels_us"], "sync_us": round(t["sync_us"], 1),
                   "pipelined_us": round(t["pipelined_us"], 1)}
            rows.append(row)
            print(json.dumps(row), flush=True)
summary = {}
for name in fns:
    for pad in (4, 1):
        sel = [x["device_us"] for x in rows if x["case"] == name and x["pad"] == pad]
        pip = [x["pipelined_us"] for x in rows if x["case"] == name and x["pad"] == pad]
        summary[f"{name} pad{pad}"] = {"device_us_median": statistics.median(sel), "all": sel,
                                       "pipelined_us_median": statistics.median(pip)}
print(json.dumps(summary, indent=1))
json.dump({"rows": rows, "summary": summary}, open(out, "w"), indent=1)
