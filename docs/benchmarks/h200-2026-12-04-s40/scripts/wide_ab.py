"""Session 40: the attention call, old texts against new, CUPTI device time of every kernel,
arms alternating in one process. Queries as the model hands them (no copy kernel).
  old:      session 39's wide text (scalar stores, one chunk a group) + the loop fold
  store:    session 39's wide text with the two-float stores only + the held fold
  new1:     the new wide text (two-float stores) + the held fold, no chunk merged
  new:      as shipped: new1 with the light last chunk merged where it removes a partial wave
argv: out.json rounds reps
"""
import dataclasses, json, statistics, sys

import mlx.core as mx

from benchmarks.common import cupti_kernel_events
from benchmarks.verify_kernels import GLIMMER, _attention_inputs
from dflash.metal import attention, tensor_attention as ta
from dflash.metal.attention import small_query_attention

out_path, rounds, reps = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
old = json.load(open(".sweep/s40/old_wide128.json"))
SHIPPED_SPEC = ta.attend_spec(128, ta.WIDE)
OLD_SPEC = dataclasses.replace(SHIPPED_SPEC, base="attend_chunks_wide128_s39",
                               body=old["body"], helpers=old["helpers"])
SHIPPED_FOLD = attention.FOLD_CHUNKS
LOOPS = dataclasses.replace(SHIPPED_FOLD, base="fold_chunks_loops",
                            body=SHIPPED_FOLD.body.replace(attention.FOLD_CHUNKS_BODY, attention.fold_body(0)))
store_body = old["body"]
for before, after in ta._WIDE_STORES:
    assert store_body.count(before) == 1
    store_body = store_body.replace(before, after)
STORE_SPEC = dataclasses.replace(SHIPPED_SPEC, base="attend_chunks_wide128_store2", body=store_body)
original_attend_spec = ta.attend_spec
SMS = attention.sm_count()
print("sm_count", SMS, "shipped", SHIPPED_SPEC.name("cuda"), SHIPPED_FOLD.name("cuda"), flush=True)


def use(arm):
    attention._launch.cache_clear()
    if arm in ("old", "store"):
        spec = OLD_SPEC if arm == "old" else STORE_SPEC
        ta.attend_spec = lambda dim, layout=ta.STREAM: spec if layout is ta.WIDE and dim == 128 else original_attend_spec(dim, layout)
        attention.FOLD_CHUNKS = LOOPS if arm == "old" else SHIPPED_FOLD
        attention.sm_count = lambda: 1 << 30
    else:
        ta.attend_spec = original_attend_spec
        attention.FOLD_CHUNKS = SHIPPED_FOLD
        attention.sm_count = (lambda: 1 << 30) if arm == "new1" else (lambda: SMS)


ARMS = ("old", "store", "new1", "new")
CASES = [(4096, "growing", 16), (4096, "ring", 16), (4096, "growing", 1),
         (4096, "growing", 8), (7936, "growing", 16), (8192, "growing", 16), (32768, "growing", 16)]
attention.TENSOR_LAYOUT = ta.WIDE
inputs = {}
for context, kind, count in CASES:
    q, plane, bk, bv = _attention_inputs(GLIMMER, context, count, kind == "ring")
    stored = mx.contiguous(q.transpose(0, 2, 1, 3))
    mx.eval(stored)
    inputs[f"{context}-{kind}-{count}"] = ((stored.transpose(0, 2, 1, 3), plane, bk, bv), kind == "ring")


def fn_of(args, ring):
    queries, plane, bk, bv = args
    return lambda: small_query_attention(queries, plane, bk, bv, scale=GLIMMER.dim ** -0.5,
                                         window=GLIMMER.window if ring else None, use_kernel=True)


same, merged = {}, {}
for case, (args, ring) in inputs.items():
    outs = {}
    for arm in ARMS:
        use(arm)
        outs[arm] = fn_of(args, ring)()
        mx.eval(outs[arm])
    same[case] = {arm: bool(mx.array_equal(outs[arm], outs["old"]).item()) for arm in ARMS}
    print("case", case, "same_bits_as_old", same[case], flush=True)

results = {}
for r in range(rounds):
    order = ARMS if r % 2 == 0 else ARMS[::-1]
    for case, (args, ring) in inputs.items():
        fn = fn_of(args, ring)
        for arm in order:
            use(arm)
            mx.eval(fn())
            def calls():
                for _ in range(reps):
                    mx.eval(fn())
            events = cupti_kernel_events(calls)
            by = {}
            for name, _, d in events:
                key = "fold" if "fold" in name else ("chunk" if "attend" in name else name[:40])
                by.setdefault(key, []).append(d)
            row = {k: statistics.median(v) for k, v in by.items()}
            row["total"] = sum(d for _, _, d in events) / reps
            row["launches"] = len(events) / reps
            results.setdefault(case, {}).setdefault(arm, []).append(row)
            print(json.dumps({"round": r, "case": case, "arm": arm, **{k: round(v, 2) for k, v in row.items()}}), flush=True)
use("new")
summary = {case: {arm: {k: round(statistics.median(x[k] for x in rows), 2) for k in rows[0]}
                  for arm, rows in arms.items()} for case, arms in results.items()}
for case, arms in summary.items():
    print("median", case, json.dumps(arms), flush=True)
json.dump({"sm_count": SMS, "same_bits_as_old": same, "summary": summary, "rows": results,
           "shipped": [SHIPPED_SPEC.name("cuda"), SHIPPED_FOLD.name("cuda")]},
          open(out_path, "w"), indent=1)
