"""Session 17 probe: what mx.compile of whole decoder layers saves on this host.

A stack of Muse Glimmer decoder layers (full or tiny geometry, random weights, 4-bit or
bf16), 16 rows, no cache (mlx's causal attention over the block), timed per forward:
``build`` (the Python that builds the graph) and ``wall`` (forwards pipelined through
``mx.async_eval``, one sync at the end), for mlx's own layers and our patched matmuls
(held norms too), each eager and with every layer compiled as one trace.
"""
import argparse, json, statistics, sys, time
from functools import partial

import mlx.core as mx
from mlx_lm.models import muse_glimmer

from dflash.bench.scale_target import GEOMETRIES, randomize, QUANT_BITS_BY_NAME
from dflash.held_norms import held_norms
from dflash.kernel_patch import KernelPatch

p = argparse.ArgumentParser()
p.add_argument("--geometry", default="full")
p.add_argument("--quant", default="4bit")
p.add_argument("--layers", type=int, default=8)
p.add_argument("--rows", type=int, default=16)
p.add_argument("--forwards", type=int, default=40)
p.add_argument("--passes", type=int, default=5)
p.add_argument("--cpu", action="store_true")
p.add_argument("--json")
p.add_argument("--trace", action="store_true", help="CUPTI kernels of 3 forwards per arm")
p.add_argument("--arms", default="mlx,mlx-compiled,ours,ours-compiled")
p.add_argument("--reps", type=int, default=2)
a = p.parse_args()
if a.cpu:
    mx.set_default_device(mx.cpu)
args = muse_glimmer.ModelArgs(**{**GEOMETRIES[a.geometry], "num_hidden_layers": a.layers, "vocab_size": 512})
model = muse_glimmer.Model(args)
randomize(model, 0, mx.bfloat16, branch_scale=0.05)
if a.quant in QUANT_BITS_BY_NAME:
    from mlx_lm.utils import quantize_model
    quantize_model(model, {}, 64, QUANT_BITS_BY_NAME[a.quant])
mx.eval(model.parameters())
layers = model.model.layers
inputs = [mx.random.normal((1, a.rows, args.hidden_size)).astype(mx.bfloat16) * 0.5 for _ in range(4)]
mx.eval(inputs)


def eager(h):
    for layer in layers:
        h = layer(h, "causal", None)
    return h


def make_compiled():
    steps = [mx.compile(partial(layer.__call__, mask="causal", cache=None)) for layer in layers]

    def run(h):
        for step in steps:
            h = step(h)
        return h

    return run


def time_forward(forward):
    mx.eval(forward(inputs[0]))
    builds, walls = [], []
    for _ in range(a.passes):
        build = 0.0
        start = time.perf_counter()
        for i in range(a.forwards):
            t = time.perf_counter()
            out = forward(inputs[i % 4])
            build += time.perf_counter() - t
            mx.async_eval(out)
        mx.eval(out)
        walls.append((time.perf_counter() - start) / a.forwards * 1e6 / a.layers)
        builds.append(build / a.forwards * 1e6 / a.layers)
    return {"build_us_per_layer": round(statistics.median(builds), 1),
            "wall_us_per_layer": round(statistics.median(walls), 1),
            "wall_min": round(min(walls), 1)}, out


def trace(forward):
    from collections import defaultdict
    from benchmarks.common import busy_us, cupti_kernel_events

    def run():
        # One forward at a time: no two forwards' kernels overlap.
        for i in range(3):
            mx.eval(forward(inputs[i % 4]))

    run()
    kernels = cupti_kernel_events(run)
    per = defaultdict(lambda: [0.0, 0])
    for name, _, duration in kernels:
        per[name[:90]][0] += duration / (3 * a.layers)
        per[name[:90]][1] += 1
    span = kernels[-1][1] + kernels[-1][2] - kernels[0][1]
    busy = busy_us(kernels)
    ranked = sorted(per.items(), key=lambda item: -item[1][0])
    report = {"kernels_per_layer": round(len(kernels) / (3 * a.layers), 2),
              "busy_us_per_layer": round(busy / (3 * a.layers), 1),
              "span_us_per_layer": round(span / (3 * a.layers), 1),
              "top": [(n, round(t, 1), c) for n, (t, c) in ranked[:25]]}
    print(json.dumps(report, indent=0), flush=True)
    return report


results, outs = {}, {}
traces = {}
for rep in range(a.reps):
    for arm in a.arms.split(","):
        ctx = []
        if arm.startswith("ours"):
            ctx.append(held_norms(model, None, True))
            ctx[-1].__enter__()
            patch = KernelPatch(model, attention=False, matmul=True).install()
        forward = make_compiled() if arm.endswith("compiled") else eager
        r, out = time_forward(forward)
        if a.trace and rep == 0:
            traces[arm] = trace(forward)
        outs.setdefault(arm, mx.array(out))
        if arm.startswith("ours"):
            patch.uninstall(); ctx[-1].__exit__(None, None, None)
        results.setdefault(arm, []).append(r)
        print(rep, arm, r, flush=True)
same = {arm: bool(mx.array_equal(outs[arm], outs[arm.split("-")[0]]).item()) for arm in outs}
print("compiled equals eager bitwise:", same)
if a.json:
    json.dump({"args": vars(a), "results": results, "traces": traces, "bitwise": same, "device": str(mx.default_device())}, open(a.json, "w"), indent=1)
