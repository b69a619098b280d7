"""Session 40: the fold with held chunks (shipped) against its plain loops (the form that ran
through session 39, same bits), CUPTI device time of every kernel of an attention call,
arms alternating call batch by call batch in one process. Queries are handed as the model
hands them (a (B, S, Hq, D) buffer seen as (B, Hq, S, D)), so no copy kernel runs.
argv: out.json rounds reps
"""
import dataclasses, json, statistics, sys

import mlx.core as mx

from benchmarks.common import cupti_kernel_events
from benchmarks.verify_kernels import GLIMMER, _attention_inputs
from dflash.metal import attention
from dflash.metal.attention import small_query_attention

out_path, rounds, reps = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
SHIPPED = attention.FOLD_CHUNKS
LOOPS = dataclasses.replace(
    SHIPPED, base="fold_chunks_loops",
    body=SHIPPED.body.replace(attention.FOLD_CHUNKS_BODY, attention.fold_body(0)))
ARMS = {"held": SHIPPED, "loops": LOOPS}
CASES = [(4096, "growing", 16), (4096, "ring", 16), (4096, "growing", 1),
         (7936, "growing", 16), (8192, "growing", 16), (32768, "growing", 16)]


def model_queries(queries):
    # The model's queries: the transpose of a (B, S, Hq, D) buffer.
    stored = mx.contiguous(queries.transpose(0, 2, 1, 3))
    mx.eval(stored)
    return stored.transpose(0, 2, 1, 3)


def call_fn(inputs, ring):
    queries, plane, block_k, block_v = inputs
    return lambda: small_query_attention(
        queries, plane, block_k, block_v, scale=GLIMMER.dim ** -0.5,
        window=GLIMMER.window if ring else None, use_kernel=True)


inputs = {}
for context, kind, count in CASES:
    q, plane, bk, bv = _attention_inputs(GLIMMER, context, count, kind == "ring")
    inputs[(context, kind, count)] = ((model_queries(q), plane, bk, bv), kind == "ring")

results = {}
same = {}
for (context, kind, count), (args, ring) in inputs.items():
    fn = call_fn(args, ring)
    outs = {}
    for arm, spec in ARMS.items():
        attention.FOLD_CHUNKS = spec
        outs[arm] = fn()
        mx.eval(outs[arm])
    attention.FOLD_CHUNKS = SHIPPED
    chunks = -(-context // 256) + 1
    same[f"{context}-{kind}-{count}"] = {
        "chunks": chunks, "same_bits": bool(mx.array_equal(outs["held"], outs["loops"]).item())}
    print("case", context, kind, count, same[f"{context}-{kind}-{count}"], flush=True)

for r in range(rounds):
    order = list(ARMS) if r % 2 == 0 else list(ARMS)[::-1]
    for (context, kind, count), (args, ring) in inputs.items():
        fn = call_fn(args, ring)
        for arm in order:
            attention.FOLD_CHUNKS = ARMS[arm]
            mx.eval(fn())
            def calls():
                for _ in range(reps):
                    mx.eval(fn())
            events = cupti_kernel_events(calls)
            by = {}
            for name, _, d in events:
                key = "fold" if "fold" in name else ("chunk" if "attend" in name else name[:50])
                by.setdefault(key, []).append(d)
            row = {k: statistics.median(v) for k, v in by.items()}
            row["total"] = sum(d for _, _, d in events) / reps
            results.setdefault(f"{context}-{kind}-{count}", {}).setdefault(arm, []).append(row)
            print(json.dumps({"round": r, "case": f"{context}-{kind}-{count}", "arm": arm,
                              **{k: round(v, 2) for k, v in row.items()}}), flush=True)
attention.FOLD_CHUNKS = SHIPPED
summary = {}
for case, arms in results.items():
    summary[case] = {arm: {k: round(statistics.median(r[k] for r in rows), 2) for k in rows[0]}
                     for arm, rows in arms.items()}
    print("median", case, json.dumps(summary[case]), flush=True)
json.dump({"same": same, "summary": summary, "rows": results}, open(out_path, "w"), indent=1)
