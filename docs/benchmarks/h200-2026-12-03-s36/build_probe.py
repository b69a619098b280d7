"""Session 36: where one plain token's host build goes, verify kernels on ("all") against off,
full-size Muse Glimmer (bf16 or 4-bit), 4k prompt. Timers wrap the traced layer's pieces; then
cProfile over the same tokens for the C calls. argv: out.json quant [scale]"""
import cProfile, io, json, os, pstats, statistics, sys, time
import mlx.core as mx
from benchmarks.plain_phases import plain_step
from benchmarks.round_profile import kernel_arm
from dflash.bench.scale_target import build_target, random_prompt
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

out, quant = sys.argv[1], sys.argv[2]
scale = sys.argv[3] if len(sys.argv) > 3 else "full"
stub = os.environ.get("S36_STUB") == "1"
t0 = time.time()
model = build_target(scale, quant, seed=0)
prompt = random_prompt(model.args.vocab_size, 4096 if scale == "full" else 64, 0)
mx.eval(model.parameters())
print("setup", round(time.time() - t0, 1), flush=True)
import timers
from timers import acc
timers.install(model)


def measure(arm, tokens=40, skip=8, profile=None):
    with kernel_arm("off" if arm == "mlx-lm" else arm):
        if stub:
            from benchmarks.launch_cost import stubbed_launches
            ctx = stubbed_launches()
        else:
            import contextlib
            ctx = contextlib.nullcontext()
        with ctx:
            walls = []
            for i, _ in enumerate(plain_step(arm)(prompt, model, max_tokens=tokens)):
                walls.append(time.perf_counter())
                if i == skip:
                    acc.clear()
                    if profile is not None:
                        profile.enable()
            if profile is not None:
                profile.disable()
    n = len(walls) - 1 - skip
    row = {k: round(v / n * 1e3, 3) for k, v in sorted(acc.items())}
    steps = [b - a for a, b in zip(walls[skip:], walls[skip + 1:])]
    row["wall_median"] = round(1e3 * statistics.median(steps), 3)
    row["wall_mean"] = round(1e3 * (walls[-1] - walls[skip]) / n, 3)
    return row


result = {"quant": quant, "scale": scale, "stub": stub, "passes": []}
for p in range(2):
    rows = {}
    for arm in ("mlx-lm", "off", "all"):
        rows[arm] = measure(arm)
        print(p, arm, json.dumps(rows[arm]), flush=True)
    result["passes"].append(rows)
prof = cProfile.Profile()
row = measure("all", profile=prof)
result["profiled_all"] = row
text = io.StringIO()
stats = pstats.Stats(prof, stream=text).sort_stats("tottime")
stats.print_stats(45)
text2 = io.StringIO()
pstats.Stats(prof, stream=text2).sort_stats("cumulative").print_stats(45)
result["cprofile_tottime"] = text.getvalue()
result["cprofile_cumulative"] = text2.getvalue()
print(text.getvalue()[:9000])
json.dump(result, open(out, "w"), indent=1)
