"""The cluster sum's bits against the merge's, on a CUDA device with mlx's graphs off.

Run as ``python -m support.cluster_bits`` from ``tests/`` with ``MLX_USE_CUDA_GRAPHS=0``
(:func:`dflash.metal.tensor_qmm.cluster_sum` refuses the cluster forms while mlx
records CUDA graphs, so this cannot run inside a pytest process that has them on).
For Glimmer's projections whose K split is 2 to 4 ways, and a few other shapes, at 4
and 8 bits and dense, 1 to 32 rows: each call bound with the cluster sum must launch a
cluster form and give the merge's bits. Prints one line a case; exits 0 only if every
case launched its cluster form and matched, 2 where the cluster sum cannot run.
"""

from __future__ import annotations

import os
import sys

import mlx.core as mx

from dflash.metal import tensor_qmm

SHAPES = ((6656, 8704), (4096, 6656), (6656, 39936), (1024, 2304), (512, 300))
ROWS = (1, 5, 16, 17, 32)


def _bound(case, cluster: bool) -> tuple[mx.array, list]:
    """The call bound with the cluster sum on or off, and the specs it launched."""
    bits, depth, rows, x, weight, scales, biases = case
    os.environ[tensor_qmm.CLUSTER_SUM_ENV] = "1" if cluster else "0"
    launched, launch = [], tensor_qmm.groups.launch_groups

    def recorded(spec, *args, **kwargs):
        launched.append(spec.base)
        return launch(spec, *args, **kwargs)

    tensor_qmm.groups.launch_groups = recorded
    try:
        group = 64 if bits else None
        call = tensor_qmm.bind_tensor_core(
            rows, depth, weight, scales, biases, bits, group, mx.bfloat16
        )
        out = call(x)
        mx.eval(out)
    finally:
        tensor_qmm.groups.launch_groups = launch
    return out, launched


def main() -> int:
    os.environ[tensor_qmm.CLUSTER_SUM_ENV] = "1"
    if not tensor_qmm.cluster_sum():
        print("the cluster sum cannot run here (no CUDA clusters, or mlx's graphs on)")
        return 2
    failures = checked = 0
    for bits in (4, 8, None):
        for depth, columns in SHAPES:
            splits = tensor_qmm.split_plan(depth, columns, bits, True)[1]
            if not 2 <= splits <= tensor_qmm.MAX_CLUSTER:
                continue
            weight = (mx.random.normal((columns, depth)) * 0.02).astype(mx.bfloat16)
            scales = biases = None
            if bits:
                weight, scales, biases = mx.quantize(weight, group_size=64, bits=bits)
            for rows in ROWS:
                x = mx.random.normal((rows, depth)).astype(mx.bfloat16)
                case = (bits, depth, rows, x, weight, scales, biases)
                merged, _ = _bound(case, cluster=False)
                clustered, specs = _bound(case, cluster=True)
                took = any(f"_c{splits}" in name for name in specs)
                same = bool(mx.array_equal(merged, clustered).item())
                failures += not (took and same)
                checked += 1
                print(
                    f"bits={bits} K={depth} N={columns} rows={rows} splits={splits} "
                    f"cluster_form={took} same_bits={same}"
                )
    print(f"{failures} of {checked} cases failed")
    return 1 if failures or not checked else 0


if __name__ == "__main__":
    sys.exit(main())
