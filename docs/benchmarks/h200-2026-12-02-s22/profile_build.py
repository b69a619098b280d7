"""cProfile of a 4-bit verify forward's build (real launches) on this host: 8 full-size
Muse Glimmer layers over a 4k context, 16 rows, ours (the shipped defaults). Each
forward is built, evaluated and synchronised, so only the build is profiled."""
import cProfile, io, pstats, sys, time
import mlx.core as mx
from benchmarks import layer_stack as ls

layers = 8
model = ls.build_layers("full", "4bit", layers)
cache = ls.prefill(model, 4096)
h = (mx.random.normal((1, 16, model.args.hidden_size)) * 0.5).astype(mx.bfloat16)
mx.eval(h)
arm = sys.argv[1] if len(sys.argv) > 1 else "ours"
with ls.arm_context(model, arm, attention=True):
    fwd = ls.verify_forward_of(model, cache)
    for _ in range(10):
        mx.eval(fwd(h))
    builds = []
    profile = cProfile.Profile()
    for i in range(60):
        t = time.perf_counter()
        if i >= 20:
            profile.enable()
        out = fwd(h)
        if i >= 20:
            profile.disable()
        builds.append((time.perf_counter() - t) / layers * 1e6)
        mx.eval(out)
        mx.synchronize()
builds.sort()
print(arm, "build us/layer median", round(builds[len(builds) // 2], 1), "min", round(builds[0], 1))
for key in ("tottime", "cumulative"):
    stream = io.StringIO()
    pstats.Stats(profile, stream=stream).sort_stats(key).print_stats(45)
    print(stream.getvalue())
