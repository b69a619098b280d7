"""Session 32 probe: replay-tau6 DFlash generations (full-size Glimmer, 4k prompt, 96 tokens)
inside one held kernel patch, alternating how launch scalars are made: host-made (read by the
kernels from managed memory) against device-made copies (DFLASH_RESIDENT_PARAMS). The scalar
memos are cleared before every run, so each run's scalar sets are new, as in a fresh prompt.
mlx-lm's plain decoding for scale; every run's tokens checked against the greedy continuation.

argv: out.json [quant]
"""
import json, os, statistics, sys

import mlx.core as mx

from dflash import kernel_patch
from dflash.bench.runs import plain_mode, replay_mode, timed_run
from dflash.bench.scale import build_scale_pair, scale_prompts
from dflash.greedy import greedy_reference_with_margins
from dflash.metal import attention, backend, heads, norms

out = sys.argv[1]
quant = sys.argv[2] if len(sys.argv) > 2 else "4bit"
target, drafter = build_scale_pair("full", quant, 0)
prompt = scale_prompts(target, 4096, 1, 0)[0]
tokens, _ = greedy_reference_with_margins(target, prompt, 96, set())
sequence = prompt.tolist() + tokens
result = {"quant": quant, "runs": []}
plain = plain_mode(target)
replay = replay_mode(target, drafter, 16, 6)


def clear():
    backend._host_scalars.cache_clear()
    backend._resident_scalars.cache_clear()
    attention._launch.cache_clear()
    attention._cached_plan.cache_clear()
    norms._float_params.cache_clear()
    heads._float_params.cache_clear()


def run(name, mode):
    clear()
    record = timed_run(mode, prompt, 96, set(), sequence)
    rounds = sorted(1000 * r for r in record.round_seconds)
    row = {"arm": name, "decode_ms": round(1000 * record.decode_seconds, 1), "tokens": len(record.tokens),
           "lossless": list(record.tokens) == tokens[: len(record.tokens)],
           "round_median_ms": round(rounds[len(rounds) // 2], 2) if rounds else None,
           "round_max_ms": round(rounds[-1], 2) if rounds else None}
    result["runs"].append(row)
    print(row, flush=True)
    json.dump(result, open(out, "w"), indent=1)


ARMS = {"host": "0", "resident": "1"}
for _ in range(2):
    run("mlx-lm plain", plain)
held = kernel_patch.verify_kernels(target, drafter)
held.__enter__()
order = list(ARMS) * 5
for i, name in enumerate(order):
    os.environ[backend.RESIDENT_ENV] = ARMS[name]
    run(name + (" (warm-up)" if i < len(ARMS) else ""), replay)
from benchmarks.common import busy_us, cupti_kernel_events
for rep in range(2):
    for name in ARMS:
        os.environ[backend.RESIDENT_ENV] = ARMS[name]
        clear()
        box = {}
        events = cupti_kernel_events(lambda: box.setdefault("r", timed_run(replay, prompt, 96, set(), sequence)))
        # Decode = every kernel after the prefill's last mlx qmm (the rounds use our matmuls).
        last = max(i for i, e in enumerate(events) if "qmm_sm80" in e[0])
        decode = events[last + 1:]
        by = {}
        for kname, _, d in decode:
            by.setdefault(kname[:70], []).append(d)
        med = {k: statistics.median(v) for k, v in by.items()}
        slow = [(k[:70], round(d, 1), round(med[k[:70]], 1)) for k, _, d in decode if d > 15 and d > 3 * med[k[:70]]]
        span = decode[-1][1] + decode[-1][2] - decode[0][1]
        row = {"arm": name, "rep": rep, "decode_kernels": len(decode), "decode_device_ms": round(sum(d for _, _, d in decode) / 1000, 2),
               "decode_busy_ms": round(busy_us(decode) / 1000, 2), "decode_span_ms": round(span / 1000, 2),
               "wall_decode_ms": round(1000 * box["r"].decode_seconds, 1), "rounds": len(box["r"].round_seconds),
               "outliers": len(slow), "outlier_excess_ms": round(sum(d - m for _, d, m in slow) / 1000, 2),
               "outlier_names": sorted(((k, sum(1 for x in slow if x[0] == k)) for k in {x[0] for x in slow}), key=lambda x: -x[1])[:12],
               "top_kernels_ms": sorted(((k, round(sum(v) / 1000, 2), len(v)) for k, v in by.items()), key=lambda x: -x[1])[:15]}
        result.setdefault("cupti", []).append(row)
        print("cupti", json.dumps({k: v for k, v in row.items() if k not in ("top_kernels_ms",)}), flush=True)
        json.dump(result, open(out, "w"), indent=1)
held.__exit__(None, None, None)
summary = {}
plain_ms = statistics.median(r["decode_ms"] for r in result["runs"] if r["arm"] == "mlx-lm plain")
for name in ARMS:
    sel = [r["decode_ms"] for r in result["runs"] if r["arm"] == name]
    rnd = [r["round_median_ms"] for r in result["runs"] if r["arm"] == name]
    summary[name] = {"decode_ms_median": statistics.median(sel), "all": sel, "round_median_ms": rnd,
                     "tok_s_over_plain": round(plain_ms / statistics.median(sel), 2)}
summary["mlx-lm plain decode_ms_median"] = plain_ms
summary["all_lossless"] = all(r["lossless"] for r in result["runs"] if r["arm"] != "mlx-lm plain")
result["summary"] = summary
print(json.dumps(summary, indent=1), flush=True)
json.dump(result, open(out, "w"), indent=1)
