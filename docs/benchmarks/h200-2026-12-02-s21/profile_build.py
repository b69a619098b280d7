import cProfile, pstats, sys, time
import mlx.core as mx
from benchmarks import layer_stack as ls
from benchmarks.launch_cost import stubbed_launches

model = ls.build_layers("tiny", "4bit", 8)
cache = ls.prefill(model, 64)
h = (mx.random.normal((1, 16, model.args.hidden_size)) * 0.5).astype(mx.bfloat16)
mx.eval(h)
arm = sys.argv[1] if len(sys.argv) > 1 else "ours"
with stubbed_launches():
    with ls.arm_context(model, arm, attention=True):
        fwd = ls.verify_forward_of(model, cache)
        for _ in range(20):
            mx.eval(fwd(h))
        n = 200
        t = time.perf_counter()
        for _ in range(n):
            out = fwd(h)
        build = (time.perf_counter() - t) / n / 8 * 1e6
        mx.eval(out)
        print(arm, "build us/layer", round(build, 1))
        pr = cProfile.Profile()
        pr.enable()
        for _ in range(n):
            out = fwd(h)
        pr.disable()
        mx.eval(out)
st = pstats.Stats(pr)
st.sort_stats("tottime").print_stats(40)
