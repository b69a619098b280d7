"""Session 30 probe: replay-tau6 DFlash generations (full 4-bit Glimmer, 4k prompt, 96 tokens)
inside one held kernel patch, alternating the attention's forms: stream + plain fold (the
shipped default before), pair + row fold, stream + row fold. mlx-lm's plain decoding for scale.
Every run's tokens are checked against the target's greedy continuation.

argv: out.json [quant]
"""
import json, statistics, sys, time
import mlx.core as mx
from dflash.bench.scale import build_scale_pair, scale_prompts
from dflash.bench.runs import replay_mode, plain_mode, timed_run
from dflash.greedy import greedy_reference_with_margins
from dflash import kernel_patch
from dflash.metal import attention, tensor_attention

out = sys.argv[1]
quant = sys.argv[2] if len(sys.argv) > 2 else "4bit"
target, drafter = build_scale_pair("full", quant, 0)
prompt = scale_prompts(target, 4096, 1, 0)[0]
tokens, _ = greedy_reference_with_margins(target, prompt, 96, set())
sequence = prompt.tolist() + tokens
result = {"quant": quant, "runs": []}
plain = plain_mode(target)
replay = replay_mode(target, drafter, 16, 6)
import os
ARMS = {"stream+fold": ("stream", False), "pair+rowfold": ("pair", True), "stream+rowfold": ("stream", True)}
if os.environ.get("S30_ARMS") == "wide":
    ARMS = {"stream": ("stream", None), "wide": ("wide", None)}


def run(name, mode):
    record = timed_run(mode, prompt, 96, set(), sequence)
    rounds = sorted(1000 * r for r in record.round_seconds)
    row = {"arm": name, "decode_ms": round(1000 * record.decode_seconds, 1), "tokens": len(record.tokens),
           "lossless": list(record.tokens) == tokens[: len(record.tokens)],
           "round_median_ms": round(rounds[len(rounds) // 2], 2) if rounds else None,
           "round_max_ms": round(rounds[-1], 2) if rounds else None}
    result["runs"].append(row)
    print(row, flush=True)
    json.dump(result, open(out, "w"), indent=1)
    return row


for _ in range(2):
    run("mlx-lm plain", plain)
held = kernel_patch.verify_kernels(target, drafter)
held.__enter__()
order = list(ARMS) * 5
for i, name in enumerate(order):
    layout, row_fold = ARMS[name]
    attention.TENSOR_LAYOUT = tensor_attention.LAYOUTS[layout]
    if row_fold is not None:
        attention.ROW_FOLD = row_fold
    run(name + (" (warm-up)" if i < len(ARMS) else ""), replay)
held.__exit__(None, None, None)
for _ in range(2):
    run("mlx-lm plain", plain)
summary = {}
plain_ms = statistics.median(r["decode_ms"] for r in result["runs"] if r["arm"] == "mlx-lm plain")
for name in ARMS:
    sel = [r["decode_ms"] for r in result["runs"] if r["arm"] == name]
    summary[name] = {"decode_ms_median": statistics.median(sel), "all": sel,
                     "tok_s_over_plain": round(plain_ms / statistics.median(sel), 2)}
summary["mlx-lm plain decode_ms_median"] = plain_ms
summary["all_lossless"] = all(r["lossless"] for r in result["runs"] if r["arm"] != "mlx-lm plain")
result["summary"] = summary
print(json.dumps(summary, indent=1), flush=True)
json.dump(result, open(out, "w"), indent=1)
