"""Host cost of one op call: building its graph, then dispatching it, vs its device time.

A verify round on a fast GPU can be bound by the host: every op costs Python time to
build (our wrappers' checks plus mlx's binding) and mlx's time to dispatch it at
evaluation (on CUDA: a graph node per kernel). This times, per call of each op:

* ``build_us``: building ``--calls`` independent calls (nothing evaluated);
* ``eval_us``: the one ``mx.eval`` of all of them (dispatch, and the device's time when
  the device is the slower side);
* ``device_us`` (``--device-time``, CUDA with PyTorch): the kernels' own time (CUPTI).

``--cprofile OP`` prints where the build time of that op goes. ``--stub-launches``
replaces every custom-kernel launch by lazy zeros of its output shapes and forces our
kernel path as CUDA takes it (tensor-core forms included), so ``build_us`` of our ops is
our wrappers' own Python on any machine (the CPU too); mlx's binding of the launch and
everything after it are not in it.

Run from the repository root, e.g. with ``MLX_USE_CUDA_GRAPHS=0`` to compare mlx's
direct launches with its CUDA graphs::

    python -m benchmarks.launch_cost --device-time --json docs/.../launch.json
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import json
import os
import platform
import pstats
import statistics
import sys
import time
from contextlib import contextmanager
from datetime import datetime, timezone
from functools import partial
from typing import Callable, Iterator, Optional, Sequence
from unittest import mock

import mlx.core as mx

from dflash import prepared_heads
from dflash.metal import backend, groups, kernel_files
from dflash.metal.attention import KeyPlane, small_query_attention
from dflash.metal.heads import Prep, head_prep, reference_head_prep
from dflash.metal.norms import reference_residual_norm, residual_norm
from dflash.metal.qmm import small_row_matmul

from .verify_kernels import device_time

Op = Callable[[], mx.array]


def make_ops(small: bool) -> dict[str, Op]:
    """The ops timed, by name: mlx's and ours on the same verify-sized inputs."""
    dtype = mx.float32 if small else mx.bfloat16
    width, columns, context, heads, kv_heads, dim = (
        (128, 96, 300, 4, 2, 32) if small else (6656, 4096, 4096, 32, 2, 128)
    )
    rows = 8 if small else 16
    x = mx.random.normal((rows, width)).astype(dtype)
    weight, scales, biases = mx.quantize(
        (0.02 * mx.random.normal((columns, width))).astype(dtype), group_size=64, bits=4
    )
    queries = mx.random.normal((1, heads, rows, dim)).astype(dtype)
    capacity = -(-(context + rows) // 256) * 256
    keys = mx.random.normal((1, kv_heads, capacity, dim)).astype(dtype)
    values = mx.random.normal((1, kv_heads, capacity, dim)).astype(dtype)
    block_k, block_v = keys[:, :, context : context + rows], values[:, :, context:]
    block_v = block_v[:, :, :rows]
    contiguous_k, contiguous_v = (
        keys[:, :, : context + rows],
        values[:, :, : context + rows],
    )
    mx.eval(x, weight, scales, biases, queries, keys, values, block_k, block_v)
    mx.eval(contiguous_k, contiguous_v)
    plane = KeyPlane(keys, values, context, 0, 0)
    scale = dim**-0.5
    # A decode step: one row, one query over the plane's live rows.
    x1, q1 = x[:1], queries[:, :, :1]
    step_plane = KeyPlane(keys, values, context + 1, 0, 0)
    step_k, step_v = keys[:, :, : context + 1], values[:, :, : context + 1]
    mx.eval(x1, q1, step_k, step_v)
    return {
        "mlx add": lambda: x + 1,
        "mlx quantized_matmul": lambda: mx.quantized_matmul(
            x, weight, scales, biases, transpose=True, group_size=64, bits=4
        ),
        "ours small_row_matmul": lambda: small_row_matmul(
            x, weight, scales, biases, bits=4, group_size=64
        ),
        "mlx sdpa": lambda: mx.fast.scaled_dot_product_attention(
            queries, contiguous_k, contiguous_v, scale=scale, mask="causal"
        ),
        "ours small_query_attention": lambda: small_query_attention(
            queries, plane, block_k, block_v, scale=scale
        ),
        "mlx quantized_matmul 1 row": lambda: mx.quantized_matmul(
            x1, weight, scales, biases, transpose=True, group_size=64, bits=4
        ),
        "ours small_row_matmul 1 row": lambda: small_row_matmul(
            x1, weight, scales, biases, bits=4, group_size=64
        ),
        "mlx sdpa 1 query": lambda: mx.fast.scaled_dot_product_attention(
            q1, step_k, step_v, scale=scale
        ),
        "ours small_query_attention 1 query": lambda: small_query_attention(
            q1, step_plane, scale=scale
        ),
        **norm_ops(x, heads, kv_heads, dim),
        **bare_kernel_ops(x1),
    }


def norm_ops(x: mx.array, heads: int, kv_heads: int, dim: int) -> dict[str, Op]:
    """mlx's small ops around a Glimmer attention and our launches that stand for them:
    head prep (five ops) and the residual norm (three), ours launched through the
    replayed trace where ``DFLASH_COMPILE`` says so (CUDA by default)."""
    rows, width = x.shape
    residual = mx.random.normal(x.shape).astype(x.dtype)
    weight = (1.0 + 0.1 * mx.random.normal((width,))).astype(x.dtype)
    q = mx.random.normal((1, rows, heads, dim)).astype(x.dtype)
    k = mx.random.normal((1, rows, kv_heads, dim)).astype(x.dtype)
    mx.eval(residual, weight, q, k)
    prep = dict(eps=1e-5, q_scale=3.87, rope_base=500000.0, start=4096)

    # Each op returns one of its outputs; the others are built, and evaluated with it
    # where the graph joins (a lone unevaluated output would not be dispatched).
    return {
        "mlx rms_norm": lambda: mx.fast.rms_norm(x, weight, 1e-5),
        "mlx head prep (5 ops)": lambda: reference_head_prep(q, k, Prep(**prep))[0],
        "ours head_prep": lambda: head_prep(q, k, **prep)[0],
        "mlx residual + norms (3 ops)": lambda: reference_residual_norm(
            x, residual, weight, 1e-8, weight, 1e-5
        )[1],
        "ours residual_norm": lambda: residual_norm(
            x, residual, weight, 1e-8, next_weight=weight, next_eps=1e-5
        )[1],
    }


# A one-element copy: what mlx's custom-kernel path costs a launch, apart from our
# wrappers and the work. The padded form carries statements as long as our tensor-core
# bodies (mlx assembles the source at every call and hashes it at every evaluation;
# comments would be compacted away), handed to mlx inline or, as the process's
# switch says, as an ``#include`` line (``metal/kernel_files.py``).
BARE_BODIES = {
    backend.CUDA: "int i = blockIdx.x * blockDim.x + threadIdx.x;\n"
    "if (i < 1) { out[i] = a[i]; }\n",
    backend.METAL: "uint i = thread_position_in_grid.x;\nif (i < 1) { out[i] = a[i]; }\n",
}
BARE_PADDING = 12 * 1024
_PAD = "(void)0;\n"


def bare_kernel_ops(x: mx.array) -> dict[str, Op]:
    """``custom kernel`` ops of a short and a padded source, the padded one also with
    its text forced inline (none without a GPU)."""
    if backend.BACKEND not in BARE_BODIES:
        return {}
    ops = {}
    arms = (("short", 0, {}), ("12 KB", BARE_PADDING, {}))
    arms += (("12 KB inline", BARE_PADDING, {kernel_files.INCLUDED_TEXTS_ENV: "0"}),)
    for label, padding, environment in arms:
        source = _PAD * (padding // len(_PAD)) + BARE_BODIES[backend.BACKEND]
        with mock.patch.dict(os.environ, environment):
            kernel = backend.make_kernel(
                backend.BACKEND,
                name=f"dflash_bare_{padding}_{label.replace(' ', '_')}",
                input_names=["a"],
                output_names=["out"],
                source=source,
            )
        ops[f"custom kernel {label} source"] = partial(_bare_launch, kernel, x)
    return ops


def _bare_launch(kernel, x: mx.array) -> mx.array:
    return kernel(
        inputs=[x],
        output_shapes=[(1,)],
        output_dtypes=[x.dtype],
        grid=(32, 1, 1),
        threadgroup=(32, 1, 1),
        stream=mx.gpu,
    )[0]


@contextmanager
def stubbed_launches() -> Iterator[None]:
    """Our kernel path forced as on CUDA, each launch replaced by lazy zeros of its
    outputs that depend on its inputs.

    What is left of an op's build is our wrappers' Python (checks, plans, parameter
    arrays) and mlx's graph ops around the launch, not the launch's binding.
    """

    def launch_groups(spec, inputs, output_shapes, output_dtypes, count, dtype):
        # Tied to the inputs (one ``Depends`` node, as a launch is one node): a stand-in
        # with no inputs would let ``mx.compile`` drop every op that feeds a launch.
        zeros = [mx.zeros(shape, dt) for shape, dt in zip(output_shapes, output_dtypes)]
        return mx.depends(zeros, list(inputs))

    def use_kernel_path(use_kernel: Optional[bool], auto: bool) -> bool:
        return use_kernel is not False

    saved = groups.launch_groups, backend.use_kernel_path, backend.BACKEND
    verdicts, replays = prepared_heads._GATED_VERDICTS, groups._REPLAYS
    groups.launch_groups, backend.use_kernel_path = launch_groups, use_kernel_path
    backend.BACKEND = "cuda"  # only the stub launches, so nothing is built for it
    prepared_heads._GATED_VERDICTS = {}  # a probe of stand-ins must not outlive them
    groups._REPLAYS = (
        {}
    )  # nor a replayed trace of them (nor real ones replay stand-ins)
    try:
        yield
    finally:
        groups.launch_groups, backend.use_kernel_path, backend.BACKEND = saved
        prepared_heads._GATED_VERDICTS, groups._REPLAYS = verdicts, replays


def time_calls(op: Op, calls: int, reps: int) -> dict:
    """Median per-call build and eval time over ``reps`` batches of ``calls`` calls."""
    mx.eval(op())
    build, dispatch = [], []
    for _ in range(reps):
        start = time.perf_counter()
        outputs = [op() for _ in range(calls)]
        built = time.perf_counter()
        mx.eval(outputs)
        done = time.perf_counter()
        build.append((built - start) / calls)
        dispatch.append((done - built) / calls)
    return {
        "build_us": 1e6 * statistics.median(build),
        "eval_us": 1e6 * statistics.median(dispatch),
        "total_us": 1e6 * (statistics.median(build) + statistics.median(dispatch)),
    }


def profile_build(op: Op, calls: int, top: int) -> str:
    """cProfile's table of the build of ``calls`` calls of ``op`` (by own time)."""
    mx.eval(op())
    profiler = cProfile.Profile()
    profiler.enable()
    outputs = [op() for _ in range(calls)]
    profiler.disable()
    mx.eval(outputs)
    lines: list[str] = []

    class Sink:
        def write(self, text: str) -> None:
            lines.append(text)

    stats = pstats.Stats(profiler, stream=Sink())
    stats.sort_stats("tottime").print_stats(top)
    return "".join(lines)


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.launch_cost")
    parser.add_argument("--calls", type=int, default=200, help="calls per batch")
    parser.add_argument("--reps", type=int, default=7, help="batches per op")
    parser.add_argument("--small", action="store_true", help="tiny shapes (CPU smoke)")
    parser.add_argument("--device-time", action="store_true", help="CUPTI device time")
    parser.add_argument("--cprofile", metavar="OP", help="profile the build of one op")
    parser.add_argument(
        "--ops", metavar="OP[,OP]", help="time only these ops (default: every op)"
    )
    parser.add_argument(
        "--stub-launches",
        action="store_true",
        help="force our kernel path with every launch stubbed: our Python alone",
    )
    parser.add_argument("--json", help="write the rows here")
    args = parser.parse_args(argv)
    if args.calls < 1 or args.reps < 1:
        parser.error("--calls and --reps must be >= 1")
    return args


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    ops = make_ops(args.small)
    wanted = [args.cprofile] if args.cprofile is not None else []
    wanted += args.ops.split(",") if args.ops else []
    unknown = [name for name in wanted if name not in ops]
    if unknown:
        print(
            f"launch_cost: no op {unknown[0]!r}; ops: {', '.join(ops)}",
            file=sys.stderr,
        )
        return 2
    if args.ops:
        ops = {name: op for name, op in ops.items() if name in args.ops.split(",")}
    meta = {
        "when": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "mlx": mx.__version__,
        "backend": backend.kernel_backend(),
        "host": platform.node(),
        "argv": list(sys.argv[1:] if argv is None else argv),
        "env": {
            k: v for k, v in os.environ.items() if k.startswith(("MLX_", "DFLASH_"))
        },
    }
    meta["stub_launches"] = args.stub_launches
    rows = []
    with stubbed_launches() if args.stub_launches else contextlib.nullcontext():
        for name, op in ops.items():
            row = {"op": name, **time_calls(op, args.calls, args.reps)}
            if args.device_time and not args.stub_launches:
                timing = device_time(op, args.calls)
                row["device_us"] = timing["device_us"]
                row["kernels_per_call"] = timing["kernels_per_call"]
            rows.append(row)
            print(json.dumps(row), flush=True)
        if args.cprofile:
            print(profile_build(ops[args.cprofile], args.calls, 25))
    if args.json:
        with open(args.json, "w") as handle:
            json.dump({"meta": meta, "rows": rows}, handle, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
