"""Session 36: one arm of the A/B of the step memo (the tree on PYTHONPATH decides the arm).
Full-size random Glimmer (argv quant) + full-size bf16 drafter, 4k prompt, 96 tokens, REPLAY tau=6,
default kernel patch. mlx-lm plain decodes interleaved with ours (3 blocks of: 1 plain, 3 ours) after
two warm-ups; ratio = median plain / median ours, in this process.
argv: out.json quant arm"""
import json, os, statistics, sys, time
import mlx.core as mx
import dflash
from dflash import kernel_patch
from dflash.bench.runs import plain_mode, replay_mode, timed_run
from dflash.bench.scale import build_scale_pair, scale_prompts
from dflash.greedy import greedy_reference_with_margins

out, quant, arm = sys.argv[1], sys.argv[2], sys.argv[3]
t0 = time.time()
SCALE = os.environ.get("S36_SCALE", "full")
target, drafter = build_scale_pair(SCALE, quant, 0)
prompt = scale_prompts(target, 4096 if SCALE == "full" else 64, 1, 0)[0]
tokens, _ = greedy_reference_with_margins(target, prompt, 96, set())
sequence = prompt.tolist() + tokens
plain = plain_mode(target)
replay = replay_mode(target, drafter, 16 if SCALE == "full" else 8, 6)
result = {"arm": arm, "quant": quant, "tree": os.path.dirname(dflash.__file__), "setup_s": round(time.time() - t0, 1),
          "plain_ms": [], "ours_ms": [], "lossless": [], "rounds": []}
print("setup", result["setup_s"], result["tree"], flush=True)
with kernel_patch.verify_kernels(target, drafter):
    for _ in range(2):
        timed_run(replay, prompt, 96, set(), sequence)
for block in range(3):
    rec = timed_run(plain, prompt, 96, set(), sequence)
    result["plain_ms"].append(round(1000 * rec.decode_seconds, 1))
    with kernel_patch.verify_kernels(target, drafter):
        for _ in range(3):
            rec = timed_run(replay, prompt, 96, set(), sequence)
            result["ours_ms"].append(round(1000 * rec.decode_seconds, 1))
            result["lossless"].append(list(rec.tokens) == tokens[: len(rec.tokens)] and len(rec.tokens) == 96)
            result["rounds"].append(len(rec.round_seconds))
    print(block, result["plain_ms"][-1], result["ours_ms"][-3:], flush=True)
result["plain_median_ms"] = statistics.median(result["plain_ms"])
result["ours_median_ms"] = statistics.median(result["ours_ms"])
result["x_plain"] = round(result["plain_median_ms"] / result["ours_median_ms"], 2)
result["total_s"] = round(time.time() - t0, 1)
print("summary", arm, quant, result["plain_median_ms"], result["ours_median_ms"], result["x_plain"], all(result["lossless"]), flush=True)
json.dump(result, open(out, "w"), indent=1)
