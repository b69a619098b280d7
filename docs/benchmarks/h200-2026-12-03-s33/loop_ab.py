"""Session 33 probe: full-size 4-bit Glimmer, replay tau = 6, 4k prompt, 96 tokens, one held
kernel patch. Arms alternate in one process:
  host-ids:     the drafter's block ids and the replay's row ids made on the host (as before)
  resident-ids: both gathered into device memory (backend.resident_array, the new default)
  mlx-drafter:  resident-ids, the drafter's bf16 projections on mlx's matmul (cuBLAS) instead
                of our dense kernel (KernelPatch(drafter_dense=False))
  nocache:      resident-ids with mx.set_cache_limit(0) (CUPTI only; diagnostic: no recycled
                buffers)
Each run: wall, per-round host phases (benchmarks.round_profile's clock). Then CUPTI runs:
decode device time, busy, span, idle gaps, and every outlier kernel with its context.
argv: out.json
"""
import json, os, statistics, sys, time

import mlx.core as mx

from benchmarks.round_profile import PhaseClock, instrumented, summarize
from dflash import dflash_round, kernel_patch
from dflash.bench import scale_target
from dflash.bench.runs import plain_mode, replay_mode, timed_run
from dflash.bench.scale import build_scale_pair, scale_prompts
from dflash.greedy import greedy_reference_with_margins
from dflash.metal import backend

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
resident = backend.resident_array


def host_array(values, dtype=mx.uint32):
    return mx.array([int(v) for v in values], dtype)


PATCHES = {}
state = {"held": None}


def set_arm(name):
    """Returns True when the patch changed (the next run traces again: a warm-up)."""
    make = host_array if name == "host-ids" else resident
    dflash_round.resident_array = make
    scale_target.resident_array = make
    mx.set_cache_limit(0 if name == "nocache" else default_limit)
    want = "mlx" if name == "mlx-drafter" else "kernel"
    if state["held"] == want:
        return False
    if state["held"] is not None:
        PATCHES[state["held"]].uninstall()
    PATCHES[want].install()
    state["held"] = want
    return True


default_limit = mx.set_cache_limit(1 << 40)
mx.set_cache_limit(default_limit)


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
parts = kernel_patch.wanted_parts(target)
print("parts", parts, flush=True)
for key, dense in (("kernel", True), ("mlx", False)):
    PATCHES[key] = kernel_patch.KernelPatch(
        target, drafter, attention="attention" in parts, matmul="matmul" in parts,
        projections="projections" in parts, drafter_dense=dense)
print("drafter dense routed:", PATCHES["kernel"].drafter_dense, PATCHES["mlx"].drafter_dense, flush=True)
ARMS = ["host-ids", "resident-ids", "mlx-drafter"]
for i in range(5):
    for name in ARMS:
        if set_arm(name) or i == 0:
            run(name + " (warm-up)", replay)
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
           "outlier_names": sorted(((k, sum(1 for x in rows if x[0] == k), round(sum(x[1] - x[2] for x in rows if x[0] == k), 1)) for k in {x[0] for x in rows}), key=lambda x: -x[2])[:12],
           "outlier_sample": rows[:60],
           "top_kernels_ms": sorted(((k, round(sum(v) / 1000, 2), len(v)) for k, v in by.items()), key=lambda x: -x[1])[:15]}
    result["cupti"].append(row)
    print("cupti", json.dumps({k: v for k, v in row.items() if k not in ("top_kernels_ms", "outlier_sample")}), flush=True)
    json.dump(result, open(out, "w"), indent=1)


for rep in range(2 if SCALE == "full" else 0):
    for name in ARMS + ["nocache"]:
        if set_arm(name):
            run(name + " (warm-up)", replay)
        box = {}
        events = cupti_kernel_events(lambda: box.setdefault("r", timed_run(replay, prompt, 96, set(), sequence)))
        analyse(name, rep, events, 1000 * box["r"].decode_seconds)
set_arm("resident-ids")
PATCHES[state["held"]].uninstall()
summary = {}
plain_ms = statistics.median(r["decode_ms"] for r in result["runs"] if r["arm"] == "mlx-lm plain")
for name in ARMS:
    sel = [r for r in result["runs"] if r["arm"] == name]
    summary[name] = {"decode_ms_median": statistics.median(r["decode_ms"] for r in sel), "all": [r["decode_ms"] for r in sel],
                     "round_ms_median": [r["phases"]["round"] for r in sel], "wait_ms_median": [r["phases"]["wait"] for r in sel],
                     "verify_graph_ms": [r["phases"]["verify_graph"] for r in sel], "verify_launch_ms": [r["phases"]["verify_launch"] for r in sel],
                     "draft_ms": [r["phases"]["draft"] for r in sel], "host_not_waiting_ms": [r["phases"]["host_not_waiting"] for r in sel],
                     "x_plain": round(plain_ms / statistics.median(r["decode_ms"] for r in sel), 2)}
summary["plain_ms"] = plain_ms
summary["all_lossless"] = all(r["lossless"] for r in result["runs"] if r["arm"] != "mlx-lm plain")
result["summary"] = summary
print(json.dumps(summary, indent=1), flush=True)
json.dump(result, open(out, "w"), indent=1)
print("total_s", round(time.time() - t0, 1))
