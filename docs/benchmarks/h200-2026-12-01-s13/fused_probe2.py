"""Session 13: the fused test's body, draw by draw, on the GPU: which (form, quant, dtype,
rows, widths) miss, whether the member's own product ("want") or the fused one ("got")
holds the garbage, and whether mlx's quantized_matmul agrees with dequantize + matmul."""
import random, sys, json
import mlx.core as mx, mlx.nn as nn, numpy as np
sys.path.insert(0, "tests")
from test_fused_projections import _linears, _alone, _np
from dflash.fused_projections import FusedProjections

def reference(layer, x):
    """Float32 dequantize + matmul (no mlx quantized op)."""
    if isinstance(layer, nn.QuantizedLinear):
        w = mx.dequantize(layer["weight"], layer["scales"], layer["biases"], layer.group_size, layer.bits)
    else:
        w = layer["weight"]
    return np.asarray((x.astype(mx.float32) @ w.astype(mx.float32).T))

def bad(a, b):
    return not np.allclose(a, b, rtol=0.1, atol=0.1)

order = sys.argv[1] if len(sys.argv) > 1 else "mixed"
rng = random.Random(0)
quants = [(None, None), (4, 32), (8, 64), (4, 128)]
fails = []
n = int(sys.argv[2]) if len(sys.argv) > 2 else 300
draws = []
for i in range(n):
    draws.append(dict(widths=[32 * rng.randint(1, 5) for _ in range(rng.randint(2, 4))], rows=rng.randint(1, 20),
                      quant=rng.choice(quants), dtype=rng.choice(["float32", "bfloat16"]),
                      form=rng.choice(["kernel", "mlx"]), seed=rng.randint(0, 2**16)))
if order == "sorted":
    draws.sort(key=lambda d: (d["dtype"], d["form"]))
for i, d in enumerate(draws):
    if i % 10 == 0:
        print(json.dumps({"done": i, "fails": len(fails)}), flush=True)
    bits, group = d["quant"]; dtype = getattr(mx, d["dtype"])
    layers = _linears(d["widths"], 128, bits, group, dtype, d["seed"])
    x = mx.random.normal((1, d["rows"], 128)).astype(dtype)
    own = _alone if d["form"] == "kernel" else (lambda layer, x: layer(x))
    want = [_np(own(layer, x)) for layer in layers]
    ref = [reference(layer, x.reshape(-1, 128)).reshape(want[j].shape) for j, layer in enumerate(layers)]
    group_ = FusedProjections(layers, d["form"])
    for index in reversed(range(len(layers))):
        got = _np(group_.output(index, x, use_kernel=None))
        w_bad, g_bad = bad(want[index], ref[index]), bad(got, ref[index])
        if w_bad or g_bad:
            row = dict(i=i, **{k: v for k, v in d.items()}, index=index, want_bad=w_bad, got_bad=g_bad,
                       want_nan=bool(np.isnan(want[index]).any()), got_sample=got.ravel()[:6].tolist(), want_sample=want[index].ravel()[:6].tolist())
            # again, the member alone
            again = _np(own(layers[index], x))
            row["again_bad"] = bad(again, ref[index])
            print(json.dumps(row), flush=True)
            fails.append(row)
            break
print(json.dumps({"order": order, "draws": n, "fails": len(fails)}), flush=True)
