"""Encode cost of a custom kernel launch against the length of its source (session 24)."""
import time, statistics
import mlx.core as mx

BODY = """
    uint i = threadIdx.x + blockIdx.x * blockDim.x;
    if (i < 256) { out[i] = inp[i] + 1.0f; }
"""

def kernel(pad_kb):
    pad = ("// " + "x" * 77 + "\n") * (pad_kb * 1024 // 80)
    return mx.fast.cuda_kernel(
        name=f"pad{pad_kb}", input_names=["inp"], output_names=["out"],
        source=BODY, header=pad)

def chain(k, x, n):
    for _ in range(n):
        x = k(inputs=[x], output_shapes=[x.shape], output_dtypes=[x.dtype],
              grid=(256, 1, 1), threadgroup=(256, 1, 1))[0]
    return x

x = mx.zeros((256,), mx.float32); mx.eval(x)
n = 400
for rep in range(3):
    for pad in (0, 4, 16, 64):
        k = kernel(pad)
        mx.eval(chain(k, x, 4))
        builds, encodes = [], []
        for _ in range(5):
            t0 = time.perf_counter(); y = chain(k, x, n); t1 = time.perf_counter()
            mx.async_eval(y); t2 = time.perf_counter(); mx.eval(y)
            builds.append((t1 - t0) / n * 1e6); encodes.append((t2 - t1) / n * 1e6)
        print(f"rep {rep} pad {pad:3d} KB: build {statistics.median(builds):.2f} us encode {statistics.median(encodes):.2f} us per launch", flush=True)
