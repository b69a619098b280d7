import json, sys
d = json.load(open(sys.argv[1]))
for e in d.get("device_time", []):
    top = e.get("top_us", {})
    mm = sum(v for k, v in top.items() if "tensor_q4" in k or "tensor_dense" in k or "tensor_bf" in k)
    rn = sum(v for k, v in top.items() if "residual_norm" in k)
    print(e.get("run"), e.get("arm"), e.get("unit"), "kernels", e.get("kernels"), "busy_ms", e.get("busy_ms"), "matmul_us", round(mm, 1), "rnorm_us", round(rn, 1))
for k in ("plain_equals_mlx_lm",):
    print(k, d.get(k))
