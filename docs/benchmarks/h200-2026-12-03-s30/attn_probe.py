"""Session 30 probe: the attention call (Glimmer's heads, bf16) per layout and fold,
pipelined (N independent calls, one eval: per-call time near the device's when the
device paces) and eager (each call evaluated alone), plus the outputs' agreement.

argv: out.json
"""
import json, statistics, sys, time
import mlx.core as mx
from benchmarks.verify_kernels import GLIMMER, _attention_inputs
from dflash.metal import attention, tensor_attention
from dflash.metal.attention import small_query_attention

out_path = sys.argv[1]
result = {"rows": []}
N = 64


def timed(fn, reps):
    times = []
    for _ in range(reps):
        mx.synchronize()
        t0 = time.perf_counter()
        outs = [fn() for _ in range(N)]
        mx.eval(outs)
        mx.synchronize()
        times.append((time.perf_counter() - t0) / N * 1e6)
    return statistics.median(times), min(times)


cases = [(4096, False, 16), (4096, False, 1), (4096, True, 16), (4096, True, 1), (32768, False, 16), (32768, True, 16)]
for context, ring, count in cases:
    queries, plane, block_k, block_v = _attention_inputs(GLIMMER, context, count, ring)
    kwargs = dict(scale=GLIMMER.dim ** -0.5, window=GLIMMER.window if ring else None, chunk=attention.CHUNK, use_kernel=True)
    outs = {}
    for layout in ("stream", "pair"):
        for row_fold in (False, True):
            attention.TENSOR_LAYOUT = tensor_attention.LAYOUTS[layout]
            attention.ROW_FOLD = row_fold
            fn = lambda: small_query_attention(queries, plane, block_k, block_v, **kwargs)
            outs[(layout, row_fold)] = fn()
            mx.eval(outs[(layout, row_fold)])
            timed(fn, 2)
    rows = []
    for rep in range(3):  # interleaved, the host drifts
        for (layout, row_fold) in outs:
            attention.TENSOR_LAYOUT = tensor_attention.LAYOUTS[layout]
            attention.ROW_FOLD = row_fold
            fn = lambda: small_query_attention(queries, plane, block_k, block_v, **kwargs)
            med, best = timed(fn, 5)
            rows.append({"context": context, "plane": "ring" if ring else "growing", "queries": count,
                         "layout": layout, "row_fold": row_fold, "rep": rep, "us_median": round(med, 2), "us_min": round(best, 2)})
    # cuDNN / mlx sdpa on the same keys, pipelined, for scale
    ref = outs[("stream", False)].astype(mx.float32)
    diffs = {f"{k[0]}-{int(k[1])}": float(mx.abs(v.astype(mx.float32) - ref).max()) for k, v in outs.items()}
    same_bits_fold = {layout: bool(mx.array_equal(outs[(layout, True)], outs[(layout, False)]).item()) for layout in ("stream", "pair")}
    for r in rows:
        print(r, flush=True)
    summary = {}
    for (layout, row_fold) in outs:
        sel = [r["us_median"] for r in rows if r["layout"] == layout and r["row_fold"] == row_fold]
        summary[f"{layout}-fold{int(row_fold)}"] = round(statistics.median(sel), 2)
    print(context, "ring" if ring else "growing", count, summary, "max|diff| vs stream", diffs, "row fold same bits", same_bits_fold, flush=True)
    result["rows"] += rows
    result.setdefault("summary", []).append({"context": context, "ring": ring, "queries": count, "median_us": summary, "max_abs_diff_vs_stream": diffs, "row_fold_same_bits": same_bits_fold})
    json.dump(result, open(out_path, "w"), indent=1)
