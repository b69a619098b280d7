"""Session 40: what the server's warm-up moves out of a process's first request. One process
an arm (`warm` or `cold`), as the server's worker does it: the kernel patch held for the
process, then (warm only) one greedy generation from a 54-token prompt (WARM_UP_TEXT's
length in a BPE vocabulary, ~6 x 9) of 2 x 16 + 1 tokens on a fresh cache and the pacing
choice forgotten, then the requests: 1,024-token prompt, then 4,608 (the folded attention
route starts at 4,096 keys), then 1,024 again, 32 tokens each, DFlash at replayed tau 6
with the real drafter forward. Each request timed whole (prefill included) and checked
against the target's greedy tokens.
argv: warm|cold out.json [full|tiny]
"""
import json, sys, time

import mlx.core as mx

started = time.perf_counter()
from dflash import kernel_patch
from dflash.bench.runs import replay_mode, timed_run
from dflash.bench.scale import build_scale_pair, scale_prompts
from dflash.greedy import greedy_reference_with_margins
from dflash.pacing import forget_pacing

arm, out_path = sys.argv[1], sys.argv[2]
geometry = sys.argv[3] if len(sys.argv) > 3 else "full"
target, drafter = build_scale_pair(geometry, "4bit", 0)
built = time.perf_counter()


def case(context, tokens, seed):
    prompt = scale_prompts(target, context, 1, seed)[0]
    reference, _ = greedy_reference_with_margins(target, prompt, tokens, set())
    return prompt, reference, prompt.tolist() + reference


warm_case = case(54, 33, 1)
requests = [("first_1024", case(1024, 32, 2)), ("then_4608", case(4608, 32, 3)),
            ("again_1024", case(1024, 32, 4))]
refs = time.perf_counter()
block = 16 if geometry == "full" else 8
mode = replay_mode(target, drafter, block, 6)
report = {"arm": arm, "build_s": round(built - started, 1), "references_s": round(refs - built, 1)}
with kernel_patch.verify_kernels(target, drafter):
    if arm == "warm":
        prompt, reference, sequence = warm_case
        t = time.perf_counter()
        record = timed_run(mode, prompt, 33, set(), sequence)
        forget_pacing(target)
        report["warm_up_s"] = round(time.perf_counter() - t, 3)
        report["warm_up_lossless"] = list(record.tokens) == reference
    for name, (prompt, reference, sequence) in requests:
        record = timed_run(mode, prompt, 32, set(), sequence)
        report[name + "_ms"] = round(1000 * (record.end - record.start), 1)
        report[name + "_lossless"] = list(record.tokens) == reference
print(json.dumps(report), flush=True)
json.dump(report, open(out_path, "w"), indent=1)
