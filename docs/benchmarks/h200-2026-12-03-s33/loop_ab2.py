"""Session 33 probe B: full-size 4-bit Glimmer, replay tau = 6, 4k prompt, 96 tokens.
Arms (alternating; each switch: patch uninstalled, array memos cleared, patch installed, one
warm-up run):
  lazy:      gathered launch-scalar sets left lazy when made (the tree before this fix): a
             trace that captures one (a bound plan) runs its gather at every replay
  scheduled: each gathered set scheduled (mx.async_eval) when made (the fix)
Each run: wall, per-round host phases. Then CUPTI runs: decode kernels, pack launches,
device time, busy, span, outliers.
argv: out.json
"""
import json, os, statistics, sys, time

import mlx.core as mx

from benchmarks.round_profile import PhaseClock, instrumented, summarize
from dflash import kernel_patch
from dflash.bench.runs import plain_mode, replay_mode, timed_run
from dflash.bench.scale import build_scale_pair, scale_prompts
from dflash.greedy import greedy_reference_with_margins
from dflash.metal import attention, backend, heads, norms, tensor_qmm

out = sys.argv[1]
t0 = time.time()
SCALE = os.environ.get("S33_SCALE", "full")
target, drafter = build_scale_pair(SCALE, "4bit", 0)
prompt = scale_prompts(target, 4096 if SCALE == "full" else 300, 1, 0)[0]
tokens, _ = greedy_reference_with_margins(target, prompt, 96, set())
sequence = prompt.tolist() + tokens
result = {"runs": [], "cupti": [], "setup_s": round(time.time() - t0, 1)}
print("setup", result["setup_s"], flush=True)
plain = plain_mode(target)
replay = replay_mode(target, drafter, 16 if SCALE == "full" else 8, 6)
shipped = backend._resident_scalars


def lazy_resident(words, dtype_name):
    padded = words + (0,) * (len(words) % 2)
    if len(padded) > 2 * backend.PACK_SLOTS:
        return backend._host_scalars(words, dtype_name)
    packed = backend.pack_launch(padded)[: len(words)]
    return packed if dtype_name == "int32" else packed.view(mx.float32)


def clear_memos():
    backend.clear_launch_scalars()
    for memo in (tensor_qmm.launch_plan, attention._launch, attention._cached_plan,
                 heads._float_params, norms._float_params):
        memo.cache_clear()


parts = kernel_patch.wanted_parts(target)
patch = kernel_patch.KernelPatch(target, drafter, attention="attention" in parts,
                                 matmul="matmul" in parts, projections="projections" in parts)
state = {"arm": None}


def set_arm(name):
    if state["arm"] == name:
        return False
    if patch.installed:
        patch.uninstall()
    backend._resident_scalars = lazy_resident if name == "lazy" else shipped
    clear_memos()
    patch.install()
    state["arm"] = name
    return True


def run(name, mode, phases=True):
    clock = PhaseClock()
    ctx = instrumented(clock, target) if phases else None
    if ctx:
        ctx.__enter__()
    try:
        record = timed_run(mode, prompt, 96, set(), sequence)
    finally:
        if ctx:
            ctx.__exit__(None, None, None)
    row = {"arm": name, "decode_ms": round(1000 * record.decode_seconds, 1), "tokens": len(record.tokens),
           "lossless": list(record.tokens) == tokens[: len(record.tokens)], "rounds": len(record.round_seconds)}
    if phases:
        row["phases"] = summarize(clock.rounds, 1)
        row["round_ms_all"] = [round(1e3 * r["round"], 1) for r in clock.rounds]
    result["runs"].append(row)
    print(json.dumps({k: v for k, v in row.items() if k != "round_ms_all"}), flush=True)
    json.dump(result, open(out, "w"), indent=1)


for _ in range(2):
    run("mlx-lm plain", plain, phases=False)
ARMS = ["lazy", "scheduled"]
for i in range(3):
    for name in ARMS:
        set_arm(name)
        run(name + " (warm-up)", replay)
        run(name, replay)
        run(name, replay)

from benchmarks.common import busy_us, cupti_kernel_events


def analyse(name, rep, events, wall):
    last = max(i for i, e in enumerate(events) if "qmm_sm80" in e[0])
    decode = events[last + 1:]
    by = {}
    for kname, _, d in decode:
        by.setdefault(kname[:60], []).append(d)
    med = {k: statistics.median(v) for k, v in by.items()}
    gaps, rows, since, seg_gap = [], [], 0, 0.0
    prev_end = None
    for kname, start, d in decode:
        gap = 0.0 if prev_end is None else start - prev_end
        if gap > 100:
            since, seg_gap = 0, gap
        gaps.append(gap)
        k = kname[:60]
        if d > 15 and d > 3 * med[k]:
            rows.append((k, round(d, 1), round(med[k], 1), round(gap, 1), since, round(seg_gap, 1)))
        since += 1
        prev_end = max(prev_end or 0, start + d)
    span = decode[-1][1] + decode[-1][2] - decode[0][1]
    idle = [g for g in gaps if g > 0]
    first5 = sum(1 for r in rows if r[4] < 5)
    after_gap = sum(1 for r in rows if r[3] > 20)
    row = {"arm": name, "rep": rep, "wall_decode_ms": round(wall, 1), "decode_kernels": len(decode),
           "decode_device_ms": round(sum(d for _, _, d in decode) / 1000, 2),
           "decode_busy_ms": round(busy_us(decode) / 1000, 2), "decode_span_ms": round(span / 1000, 2),
           "idle_ms_gaps_over_100us": round(sum(g for g in idle if g > 100) / 1000, 2),
           "idle_ms_gaps_20_100us": round(sum(g for g in idle if 20 < g <= 100) / 1000, 2),
           "idle_ms_gaps_under_20us": round(sum(g for g in idle if g <= 20) / 1000, 2),
           "gaps_over_100us": sum(1 for g in idle if g > 100),
           "outliers": len(rows), "outlier_excess_ms": round(sum(d - m for _, d, m, *_ in rows) / 1000, 2),
           "outliers_in_first5_after_idle": first5, "outliers_right_after_gap_over_20us": after_gap,
           "pack_launches": sum(1 for k, _, _ in decode if "pack_scalars" in k), "outlier_names": sorted(((k, sum(1 for x in rows if x[0] == k), round(sum(x[1] - x[2] for x in rows if x[0] == k), 1)) for k in {x[0] for x in rows}), key=lambda x: -x[2])[:12],
           "outlier_sample": rows[:60],
           "top_kernels_ms": sorted(((k, round(sum(v) / 1000, 2), len(v)) for k, v in by.items()), key=lambda x: -x[1])[:15]}
    result["cupti"].append(row)
    print("cupti", json.dumps({k: v for k, v in row.items() if k not in ("top_kernels_ms", "outlier_sample")}), flush=True)
    json.dump(result, open(out, "w"), indent=1)


for rep in range(2 if SCALE == "full" else 0):
    for name in ARMS:
        if set_arm(name):
            run(name + " (warm-up)", replay)
        box = {}
        events = cupti_kernel_events(lambda: box.setdefault("r", timed_run(replay, prompt, 96, set(), sequence)))
        analyse(name, rep, events, 1000 * box["r"].decode_seconds)
backend._resident_scalars = shipped
summary = {}
plain_ms = statistics.median(r["decode_ms"] for r in result["runs"] if r["arm"] == "mlx-lm plain")
for name in ARMS:
    sel = [r for r in result["runs"] if r["arm"] == name]
    summary[name] = {"decode_ms_median": statistics.median(r["decode_ms"] for r in sel), "all": [r["decode_ms"] for r in sel],
                     "round_ms_median": [r["phases"]["round"] for r in sel], "verify_graph_ms": [r["phases"]["verify_graph"] for r in sel],
                     "draft_ms": [r["phases"]["draft"] for r in sel], "draft_launch_ms": [r["phases"]["draft_launch"] for r in sel],
                     "wait_ms": [r["phases"]["wait"] for r in sel], "x_plain": round(plain_ms / statistics.median(r["decode_ms"] for r in sel), 2)}
summary["plain_ms"] = plain_ms
summary["all_lossless"] = all(r["lossless"] for r in result["runs"] if r["arm"] != "mlx-lm plain")
result["summary"] = summary
print(json.dumps(summary, indent=1), flush=True)
json.dump(result, open(out, "w"), indent=1)
print("total_s", round(time.time() - t0, 1))

# Host diagnostics with the fix in place (same process): host-made arrays at full scale,
# the host cost of small arrays, the main thread pinned or not, cProfile of a generation.
import collections, cProfile, io, pstats, traceback
set_arm("scheduled")
run("scheduled (warm-up)", replay)
# 1. host-made arrays at full scale
sites = collections.Counter()
real = mx.array


class _Meta(type):
    def __instancecheck__(cls, obj):
        return isinstance(obj, real)

    def __call__(cls, *args, **kwargs):
        out = real(*args, **kwargs)
        if args and not isinstance(args[0], real) and out.nbytes > 8:
            frames = [f for f in traceback.extract_stack()[:-1] if "/dflash/" in f.filename or "/metal/" in f.filename]
            sites[(";".join(f"{f.filename.split('/')[-1]}:{f.lineno}" for f in frames[-3:]), out.nbytes)] += 1
        return out


class HookedArray(metaclass=_Meta):
    pass


class Proxy:
    def __getattr__(self, name):
        return HookedArray if name == "array" else getattr(mx, name)


hooked = []
for name, module in list(sys.modules.items()):
    if (name.startswith("dflash") or name.startswith("metal") or name.startswith("benchmarks")) and getattr(module, "mx", None) is mx:
        module.mx = Proxy()
        hooked.append(module)
record = timed_run(replay, prompt, 96, set(), sequence)
for module in hooked:
    module.mx = mx
result["host_made"] = {"rounds": len(record.round_seconds), "sites": [[w, n, k] for (w, n), k in sorted(sites.items(), key=lambda x: -x[1])]}
print("host-made arrays, one generation:", json.dumps(result["host_made"])[:3000], flush=True)
json.dump(result, open(out, "w"), indent=1)

# 2. the host cost of making small arrays on CUDA
def make_cost(kind, count=200):
    x = mx.zeros((16,), mx.int32)
    mx.eval(x)
    outs = []
    start = time.perf_counter()
    for i in range(count):
        vals = [i + j for j in range(16)]
        if kind == "host64":
            a = mx.array(vals, mx.int32)
        elif kind == "pool8":
            a = mx.array(vals[:2], mx.int32)
        elif kind == "gathered64" and backend.BACKEND == "cuda":
            a = backend.resident_array(vals, mx.int32)
        else:
            a = mx.array(vals, mx.int32)
        y = a.sum()
        mx.async_eval(y)
        outs.append(y)
    built = time.perf_counter()
    mx.eval(outs)
    done = time.perf_counter()
    return {"kind": kind, "host_us_each": round(1e6 * (built - start) / count, 1), "total_us_each": round(1e6 * (done - start) / count, 1)}


result["make_cost"] = []
for rep in range(3):
    for kind in ("host64", "pool8", "gathered64"):
        row = make_cost(kind)
        row["rep"] = rep
        result["make_cost"].append(row)
        print("make", row, flush=True)
json.dump(result, open(out, "w"), indent=1)

# 3. pinned vs unpinned main thread
cpus = sorted(os.sched_getaffinity(0))
result["cpus"] = cpus
print("cpus", cpus, flush=True)
for rep in range(3):
    os.sched_setaffinity(0, set(cpus))
    run("unpinned", replay)
    os.sched_setaffinity(0, {cpus[min(2, len(cpus) - 1)]})
    run("pinned1", replay)
    os.sched_setaffinity(0, set(cpus[2:6]) or set(cpus))
    run("pinned4", replay)
os.sched_setaffinity(0, set(cpus))

# 4. cProfile of one generation
profiler = cProfile.Profile()
profiler.enable()
record = timed_run(replay, prompt, 96, set(), sequence)
profiler.disable()
for key in ("tottime", "cumtime"):
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats(key).print_stats(45)
    open(os.path.join(os.path.dirname(out), f"B-cprofile-{key}.txt"), "w").write(text.getvalue())
print("cprofile decode_ms", round(1000 * record.decode_seconds, 1), "rounds", len(record.round_seconds), flush=True)

pin = {}
for arm in ("unpinned", "pinned1", "pinned4"):
    sel = [r for r in result["runs"] if r["arm"] == arm]
    pin[arm] = {"decode_ms": [r["decode_ms"] for r in sel], "round": [r["phases"]["round"] for r in sel],
                "verify_graph": [r["phases"]["verify_graph"] for r in sel]}
result["pinning"] = pin
print(json.dumps(pin), flush=True)
patch.uninstall()
json.dump(result, open(out, "w"), indent=1)
print("total_s", round(time.time() - t0, 1))
