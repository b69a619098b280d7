"""Session 28 probe: per-round durations of replay-tau6 generations, run after run (full 4-bit, 4k)."""
import json, os, sys, time
import mlx.core as mx
from dflash.bench.scale import build_scale_pair, scale_prompts
from dflash.bench.runs import replay_mode, plain_mode, timed_run
from dflash.greedy import greedy_reference_with_margins
from dflash import kernel_patch

out = sys.argv[1]
target, drafter = build_scale_pair("full", "4bit", 0)
prompt = scale_prompts(target, 4096, 1, 0)[0]
tokens, _ = greedy_reference_with_margins(target, prompt, 96, set())
sequence = prompt.tolist() + tokens
result = {"runs": []}
replay = replay_mode(target, drafter, 16, 6)
modes = [("plain", plain_mode(target))] * 2 + [("replay", replay)] * 4 + [("replay-held", replay)] * 4
held = None
for name, mode in modes:
    if name == "replay-held" and held is None:
        held = kernel_patch.verify_kernels(target, drafter)
        print("held patch:", held.__enter__() is not None, flush=True)
    t0 = time.perf_counter()
    record = timed_run(mode, prompt, 96, set(), sequence)
    rounds = [round(1000 * r, 2) for r in record.round_seconds]
    row = {"mode": name, "first_round_ms": round(1000 * (record.round_ends[0] - record.start), 1),
           "decode_ms": round(1000 * record.decode_seconds, 1), "tokens": len(record.tokens),
           "rounds_ms": rounds, "wall_ms": round(1000 * (time.perf_counter() - t0), 1)}
    result["runs"].append(row)
    print(name, row["first_round_ms"], row["decode_ms"], rounds[:6], "...", sorted(rounds)[len(rounds) // 2], max(rounds), flush=True)
    json.dump(result, open(out, "w"), indent=1)
