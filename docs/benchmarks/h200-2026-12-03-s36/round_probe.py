"""Session 36: where a 4-bit (argv) tau-6 round's host time goes: the traced layers' pieces timed,
full-size Glimmer + bf16 drafter, 4k, 96 tokens, REPLAY tau = 6, default patch. argv: out.json quant"""
import cProfile, io, json, os, pstats, statistics, sys, time
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import mlx.core as mx
from dflash import kernel_patch
from dflash.bench.runs import plain_mode, replay_mode, timed_run
from dflash.bench.scale import build_scale_pair, scale_prompts
from dflash.greedy import greedy_reference_with_margins
import timers
from timers import acc

out, quant = sys.argv[1], sys.argv[2]
SCALE = os.environ.get("S36_SCALE", "full")
t0 = time.time()
target, drafter = build_scale_pair(SCALE, quant, 0)
prompt = scale_prompts(target, 4096 if SCALE == "full" else 64, 1, 0)[0]
tokens, _ = greedy_reference_with_margins(target, prompt, 96, set())
sequence = prompt.tolist() + tokens
plain = plain_mode(target)
replay = replay_mode(target, drafter, 16 if SCALE == "full" else 8, 6)
print("setup", round(time.time() - t0, 1), flush=True)
timers.install(target, drafter)
result = {"quant": quant, "runs": []}
rec = timed_run(plain, prompt, 96, set(), sequence)
result["plain_ms"] = round(1000 * rec.decode_seconds, 1)
with kernel_patch.verify_kernels(target, drafter):
    for _ in range(2):
        timed_run(replay, prompt, 96, set(), sequence)
    for profile in (None, None, None, cProfile.Profile()):
        acc.clear()
        if profile is not None:
            profile.enable()
        rec = timed_run(replay, prompt, 96, set(), sequence)
        if profile is not None:
            profile.disable()
        n = len(rec.round_seconds)
        row = {k: round(v / n * 1e3, 3) for k, v in sorted(acc.items())}
        row.update(decode_ms=round(1000 * rec.decode_seconds, 1), rounds=n,
                   lossless=list(rec.tokens) == tokens[: len(rec.tokens)],
                   round_median_ms=round(1e3 * statistics.median(rec.round_seconds), 2))
        result["runs"].append(row)
        print(json.dumps(row), flush=True)
text = io.StringIO()
pstats.Stats(profile, stream=text).sort_stats("tottime").print_stats(45)
result["cprofile_tottime"] = text.getvalue()
print(text.getvalue()[:7000])
json.dump(result, open(out, "w"), indent=1)
