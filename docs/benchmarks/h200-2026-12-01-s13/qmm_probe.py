"""Session 13: mlx's own quantized_matmul on CUDA against dequantize + float32 matmul,
at small K (the fused test's geometries) and a model-like K."""
import itertools, json, sys, time
import mlx.core as mx, numpy as np
CASES = {"a": (["bfloat16", "float32"], [4, 8], [64, 128], [128, 512], [16, 17, 32]),
         "b": (["bfloat16", "float32"], [4], [128], [128, 256], [1, 8, 16])}
cases = list(itertools.product(*CASES[sys.argv[1] if len(sys.argv) > 1 else "a"]))
for dtype_name, bits, gs, depth, rows in cases:
    t = time.time()
    dtype = getattr(mx, dtype_name)
    mx.random.seed(1)
    w = (mx.random.normal((96, depth)) * 0.05).astype(dtype)
    wq, s, b = mx.quantize(w, gs, bits)
    x = mx.random.normal((rows, depth)).astype(dtype)
    y = mx.quantized_matmul(x, wq, s, b, transpose=True, group_size=gs, bits=bits)
    ref = x.astype(mx.float32) @ mx.dequantize(wq, s, b, gs, bits).astype(mx.float32).T
    y, ref = np.asarray(y.astype(mx.float32)), np.asarray(ref)
    err = float(np.nanmax(np.abs(y - ref))) if np.isfinite(y).all() else float("nan")
    zero_even = bool((y[:, 0::2] == 0).all())
    print(json.dumps(dict(dtype=dtype_name, bits=bits, group_size=gs, K=depth, M=rows, max_err=err,
                          ref_max=float(np.abs(ref).max()), even_columns_zero=zero_even,
                          ok=bool(err <= 0.08 * float(np.abs(ref).max())), s=round(time.time() - t, 2))), flush=True)
