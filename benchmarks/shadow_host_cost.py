"""Host and device cost of 39 staging shadows (one verify round's sliding layers), per form.

Builds the fused K/V shadow of 39 Muse Glimmer rings (2 KV heads x 128 x 2,048 rows,
bfloat16, 16-token chunk at origin 1,000) through ``ShadowStager.pair``, as the cache does,
with the custom kernel and with the pure-MLX reference, for K/V handed over as mlx-lm's
transposed views and as contiguous arrays, and prints the median host time of building the
graph and of build + evaluate. Then the bare launch cost: 39 trivial custom kernels against
39 trivial mlx adds.

    python -m benchmarks.shadow_host_cost        # needs mlx's Metal or CUDA backend

This is the measurement behind caching the derived geometry sizes in
``dflash.metal.layout.RowGeometry`` (the kernel path spent ~50 us of host time per launch in
``np.prod`` before).
"""

from __future__ import annotations

import sys

import mlx.core as mx

from dflash.metal import ShadowStager, kernel_backend

from .common import host_and_total_ms

LAYERS, HEADS, CAPACITY, DIM, CHUNK = 39, 2, 2048, 128, 16


def main() -> int:
    if kernel_backend() is None:
        print("shadow_host_cost: needs mlx's Metal or CUDA backend")
        return 1
    rings = [
        mx.random.normal((2, 1, HEADS, CAPACITY, DIM)).astype(mx.bfloat16)
        for _ in range(LAYERS)
    ]
    transposed = []
    for _ in range(LAYERS):
        pair = mx.random.normal((2, 1, CHUNK, HEADS, DIM)).astype(mx.bfloat16)
        mx.eval(pair)
        transposed.append(tuple(pair[i].transpose(0, 2, 1, 3) for i in (0, 1)))
    contiguous = [tuple(mx.contiguous(x) for x in kv) for kv in transposed]
    mx.eval(rings, contiguous)
    forms = [
        (name, ShadowStager.for_buffer(rings[0], use_kernel=use_kernel).pair)
        for name, use_kernel in (("reference", False), ("kernel", True))
    ]
    for chunk_name, chunks in (("transposed", transposed), ("contiguous", contiguous)):
        for form_name, form in forms:
            host, total = host_and_total_ms(
                lambda: [
                    form(ring, keys, values, 1000, CAPACITY)
                    for ring, (keys, values) in zip(rings, chunks)
                ],
                reps=30,
                warmup=3,
            )
            print(
                f"{form_name:9s} {chunk_name:10s} K/V: build {host:6.3f} ms, "
                f"build + eval {total:6.3f} ms"
            )
    if kernel_backend() != "cuda":
        return 0
    source = "uint32_t i = blockIdx.x * blockDim.x + threadIdx.x; if (i < 16) out[i] = inp[i];"
    kernel = mx.fast.cuda_kernel(
        name="bare_copy", input_names=["inp"], output_names=["out"], source=source
    )
    x = mx.zeros((16,), dtype=mx.uint32)
    mx.eval(x)

    def bare_kernels():
        return [
            kernel(
                inputs=[x],
                output_shapes=[(16,)],
                output_dtypes=[mx.uint32],
                grid=(16, 1, 1),
                threadgroup=(16, 1, 1),
                template=[("T", mx.uint32)],
            )[0]
            for _ in range(LAYERS)
        ]

    def bare_adds():
        return [x + i for i in range(LAYERS)]

    for name, step in (("custom kernels", bare_kernels), ("mlx adds", bare_adds)):
        print(f"39 bare {name}: {host_and_total_ms(step, reps=30, warmup=3)[1]:.3f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
