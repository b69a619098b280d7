"""Verify kernels against mlx's own ops: attention over the planes, small-row matmuls.

* **attention**: 16 queries (and 1) over a growing plane of 4k / 32k keys and over a
  full 2,048-row ring at the same positions, 32 query / 2 KV heads x 128, bfloat16:
  :func:`dflash.metal.attention.small_query_attention` (reading the plane in place,
  the block held back) against ``mx.fast.scaled_dot_product_attention`` over
  contiguous keys (growing) or over the staging shadow the cache builds (ring: the
  shadow's concatenate is timed with it, as the cache pays it).
* **matmul**: :func:`dflash.metal.qmm.small_row_matmul` against
  ``mx.quantized_matmul`` / ``x @ W.T`` at Muse Glimmer's projection shapes
  (hidden 6,656), 1 and 16 rows, bfloat16 weights and 4- / 8-bit (group 64), with
  the weight bytes and the time reading them would take at ``--bandwidth``.

Each op is timed two ways: ``sync`` (one call, then wait for it: median over
``--reps``) and ``pipelined`` (``--batch`` calls queued, one wait, per call).
Results go to ``--json`` after every row, so a run cut short keeps what it measured.

GPU: ``python -m benchmarks.verify_kernels --json docs/benchmarks/verify-kernels-h200.json``.
CPU smoke test (tiny shapes, the reference forms): add ``--small``.
"""

from __future__ import annotations

import argparse
import functools
import json
import platform
import statistics
import sys
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Callable, Optional, Sequence

import mlx.core as mx

from dflash.metal import attention, backend, qmm, tensor_attention
from dflash.metal.attention import KeyPlane, small_query_attention
from dflash.metal.qmm import small_row_matmul

from .common import cupti_kernel_events

H200_BANDWIDTH = 4.8e12

# Peak memory bandwidth (bytes/s) by the start of the device's name, for the bound a
# call is compared with: an H100 run divided by the H200's figure reads 1.43x too far
# from its own bound. (No name here starts another, so the order does not matter.)
KNOWN_BANDWIDTH = {
    "NVIDIA H200": 4.8e12,
    "NVIDIA H100 NVL": 3.9e12,
    "NVIDIA H100 PCIe": 2.0e12,
    "NVIDIA H100 80GB HBM3": 3.35e12,
}


def device_bandwidth(name: Optional[str] = None) -> tuple[str, float]:
    """The GPU's name and peak memory bandwidth in bytes/s (the H200's when unknown).

    Args:
        name: A device name (``None``: the default device's, from ``mx.device_info``).

    Returns:
        ``(name, bytes_per_second)``; the name is ``"unknown"`` where none is reported.
    """
    if name is None:
        try:
            name = str(mx.device_info().get("device_name", "unknown"))
        except Exception:  # older mlx, or a backend that reports nothing
            name = "unknown"
    for prefix, bandwidth in KNOWN_BANDWIDTH.items():
        if name.startswith(prefix):
            return name, bandwidth
    return name, H200_BANDWIDTH


def add_bandwidth_argument(parser: argparse.ArgumentParser) -> None:
    """``--bandwidth``: bytes/s for the bound, default the device's peak
    (:func:`resolve_bandwidth` fills it in)."""
    parser.add_argument(
        "--bandwidth",
        type=float,
        default=None,
        help="bytes/s for the bound (default: the device's peak, the H200's if unknown)",
    )


def run_on_cuda(name: str, args: argparse.Namespace, run: Callable) -> int:
    """A CUDA-only benchmark's main: one line and 1 without mlx's CUDA backend, else
    ``run(args)`` with the bandwidth resolved, and 0."""
    if backend.kernel_backend() != "cuda":
        print(f"{name}: needs mlx's CUDA backend", file=sys.stderr)
        return 1
    resolve_bandwidth(args)
    run(args)
    return 0


def per_call_meta(args: argparse.Namespace, **more) -> dict:
    """What a per-call device table records about its run (``more`` added): when,
    mlx's version, the host, the command line, the device and the bandwidth its bound
    used, and ``--cold-bytes``."""
    return {
        "when": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "mlx": mx.__version__,
        "host": platform.node(),
        "argv": sys.argv[1:],
        "device": getattr(args, "device_name", "unknown"),
        "bandwidth": args.bandwidth,
        "cold_bytes": args.cold_bytes,
        **more,
    }


def resolve_bandwidth(args: argparse.Namespace) -> None:
    """Fills ``args.bandwidth`` (``None``: the device's, :func:`device_bandwidth`) and
    sets ``args.device_name``, so each result names the figure its bound used."""
    name, bandwidth = device_bandwidth()
    args.device_name = name
    if args.bandwidth is None:
        args.bandwidth = bandwidth


@dataclass(frozen=True)
class Setup:
    """Shapes of one run.

    Attributes:
        heads, kv_heads, dim: Attention heads and head dim.
        contexts: Key positions before the block.
        window: Ring capacity (the sliding window).
        queries: Query counts.
        projections: ``(name, K, N)`` matmul shapes.
        rows: Matmul row counts.
        dtype: Element dtype.
    """

    heads: int
    kv_heads: int
    dim: int
    contexts: tuple[int, ...]
    window: int
    queries: tuple[int, ...]
    projections: tuple[tuple[str, int, int], ...]
    rows: tuple[int, ...]
    dtype: mx.Dtype = mx.bfloat16


GLIMMER = Setup(
    heads=32,
    kv_heads=2,
    dim=128,
    contexts=(4096, 32768),
    window=2048,
    queries=(16, 1),
    projections=(
        ("q_proj / gate_proj (attn)", 6656, 4096),
        ("k_proj / v_proj", 6656, 256),
        ("o_proj", 4096, 6656),
        ("mlp gate / up", 6656, 19968),
        ("mlp down", 19968, 6656),
        # What the matmul part launches with fused sibling projections.
        ("attn q/k/v/gate fused", 6656, 8704),
        ("mlp gate+up fused", 6656, 39936),
        ("lm_head", 6656, 202048),
    ),
    rows=(1, 16),
)
SMALL = Setup(
    heads=4,
    kv_heads=2,
    dim=32,
    contexts=(96, 300),
    window=64,
    queries=(8, 1),
    projections=(("small in", 128, 96), ("small out", 192, 128)),
    rows=(1, 8),
    dtype=mx.float32,
)


def time_op(fn: Callable[[], mx.array], reps: int, batch: int) -> dict:
    """Median sync latency and pipelined per-call time of ``fn``, in microseconds."""
    for _ in range(3):
        mx.eval(fn())
    sync = []
    for _ in range(reps):
        start = time.perf_counter()
        mx.eval(fn())
        sync.append(time.perf_counter() - start)
    piped = []
    for _ in range(max(1, reps // 4)):
        start = time.perf_counter()
        mx.eval([fn() for _ in range(batch)])
        piped.append((time.perf_counter() - start) / batch)
    return {
        "sync_us": 1e6 * statistics.median(sync),
        "sync_p10_us": 1e6 * sorted(sync)[len(sync) // 10],
        "pipelined_us": 1e6 * statistics.median(piped),
    }


def device_time(fn: Callable[[], mx.array], reps: int) -> dict:
    """Device time per call from CUPTI (through ``torch.profiler``): kernels only.

    Host overhead (Python, mlx's graph, launches) is not in it, unlike ``pipelined``.
    Needs PyTorch with CUDA in this interpreter.
    """
    mx.eval(fn())

    def calls() -> None:
        for _ in range(reps):
            mx.eval(fn())

    kernels: dict = {}
    for name, _, duration in cupti_kernel_events(calls):
        kernels.setdefault(name[:80], []).append(duration)
    total = sum(sum(d) for d in kernels.values())
    return {
        "device_us": total / reps,
        "kernels_per_call": sum(len(d) for d in kernels.values()) / reps,
        "device_kernels_us": {
            name: round(statistics.median(d), 2) for name, d in kernels.items()
        },
    }


class Report:
    """Rows of results, written to JSON after every one."""

    def __init__(self, path: Optional[str], meta: dict) -> None:
        self.path = path
        self.data = {"meta": meta, "attention": [], "matmul": []}

    def add(self, section: str, row: dict) -> None:
        self.data[section].append(row)
        print(json.dumps(row), flush=True)
        if self.path:
            with open(self.path, "w") as handle:
                json.dump(self.data, handle, indent=1)


def _form(use_kernel: Optional[bool]) -> str:
    if use_kernel is False:
        return "reference"
    if use_kernel or backend.use_kernel_path(None, auto=True):
        return "kernel"
    return "reference"


# ----------------------------------------------------------------- attention


def _attention_inputs(setup: Setup, context: int, count: int, ring: bool):
    """Queries, the plane (ring or growing) and the held-back block at ``context``."""
    shape = (1, setup.kv_heads)
    dtype = setup.dtype
    block_k = mx.random.normal(shape + (count, setup.dim)).astype(dtype)
    block_v = mx.random.normal(shape + (count, setup.dim)).astype(dtype)
    queries = mx.random.normal((1, setup.heads, count, setup.dim)).astype(dtype)
    if ring:
        rows = setup.window
        start = context - rows
        origin = start % rows
    else:
        rows = -(-(context + count) // 256) * 256
        start, origin = 0, 0
    keys = mx.random.normal(shape + (rows, setup.dim)).astype(dtype)
    values = mx.random.normal(shape + (rows, setup.dim)).astype(dtype)
    length = setup.window if ring else context
    plane = KeyPlane(keys, values, length, start, origin)
    mx.eval(queries, keys, values, block_k, block_v)
    return queries, plane, block_k, block_v


def _mlx_attention(
    setup: Setup, queries, plane: KeyPlane, block_k, block_v, ring: bool
):
    """mlx's routes: ``(name, timed, exact)``.

    ``exact`` computes the same attention as ours (for the difference column);
    ``timed`` is what the cache hands mlx: contiguous keys and ``"causal"`` for a
    growing plane; for a ring, the staging shadow plus a window mask for a block, and
    the whole ring in physical order with no mask for one query (a decode step
    writes first, so the ring holds exactly its window: one row differs from ours).
    """
    count = queries.shape[2]
    scale = setup.dim**-0.5
    if not ring:
        # The block's rows sit after the plane's (as the cache writes them).
        keys = mx.concatenate([plane.keys[:, :, : plane.length], block_k], axis=2)
        values = mx.concatenate([plane.values[:, :, : plane.length], block_v], axis=2)
        mx.eval(keys, values)

        def contiguous():
            return mx.fast.scaled_dot_product_attention(
                queries, keys, values, scale=scale, mask="causal"
            )

        return "mlx sdpa", contiguous, contiguous
    live, origin = plane.length, plane.origin_physical
    query = mx.arange(live, live + count)[:, None]
    key = mx.arange(live + count)[None]
    mask = (key <= query) & (key > query - setup.window)
    mx.eval(mask)

    def staged():
        def shadow(buffer, block):
            parts = [buffer[:, :, origin:], buffer[:, :, :origin], block]
            return mx.concatenate(parts, axis=2)

        return mx.fast.scaled_dot_product_attention(
            queries,
            shadow(plane.keys, block_k),
            shadow(plane.values, block_v),
            scale=scale,
            mask=mask,
        )

    if count > 1:
        return "mlx sdpa + shadow", staged, staged

    def whole_ring():
        return mx.fast.scaled_dot_product_attention(
            queries, plane.keys, plane.values, scale=scale, mask=None
        )

    return "mlx sdpa (ring in place)", whole_ring, staged


def bench_attention(setup: Setup, report: Report, args) -> None:
    for context in setup.contexts:
        for ring in (False, True):
            for count in setup.queries:
                queries, plane, block_k, block_v = _attention_inputs(
                    setup, context, count, ring
                )
                kwargs = dict(
                    scale=setup.dim**-0.5,
                    window=setup.window if ring else None,
                    use_kernel=args.use_kernel,
                )

                def ours(chunk=attention.CHUNK):
                    return small_query_attention(
                        queries, plane, block_k, block_v, chunk=chunk, **kwargs
                    )

                name, theirs, exact = _mlx_attention(
                    setup, queries, plane, block_k, block_v, ring
                )
                diff = mx.abs(
                    ours().astype(mx.float32) - exact().astype(mx.float32)
                ).max()
                keys = min(context, setup.window) if ring else context
                rows = keys + count
                base = {
                    "context": context,
                    "plane": "ring" if ring else "growing",
                    "queries": count,
                    "keys_read": rows,
                    "kv_bytes": 2
                    * setup.kv_heads
                    * rows
                    * setup.dim
                    * setup.dtype.size,
                    "max_abs_diff_vs_mlx": float(diff),
                }
                # Our arms: (label, tensor cores on, layout, chunk); mlx's arm last.
                arms = [
                    (_form(args.use_kernel), True, attention.tensor_layout(), chunk)
                    for chunk in args.chunks
                ]
                plan = attention.make_plan(
                    queries, plane, block_k, block_v, window=kwargs["window"],
                    causal=True, query_start=None, chunk=attention.CHUNK,
                )  # fmt: skip
                if args.use_kernel is not False and attention.uses_tensor_cores(
                    plan, setup.dtype
                ):
                    arms = [
                        (f"kernel (tensor, {layout.name})", True, layout, chunk)
                        for layout in tensor_attention.LAYOUTS.values()
                        for chunk in args.chunks
                    ]
                    if not args.skip_scalar:
                        scalar = (
                            "kernel (scalar body)",
                            False,
                            attention.tensor_layout(),
                        )
                        arms.append(scalar + (attention.CHUNK,))
                arms.append((name, None, None, None))
                for impl, tensor_cores, layout, chunk in arms:
                    fn = (
                        theirs
                        if tensor_cores is None
                        else functools.partial(ours, chunk)
                    )
                    saved = attention.TENSOR_CORES, attention.tensor_layout()
                    if tensor_cores is not None:
                        attention.TENSOR_CORES = tensor_cores
                        attention.TENSOR_LAYOUT = layout
                    try:
                        timing = time_op(fn, args.reps, args.batch)
                        if args.device_time:
                            timing.update(device_time(fn, args.reps))
                    finally:
                        attention.TENSOR_CORES, attention.TENSOR_LAYOUT = saved
                    row = {**base, "impl": impl, "chunk": chunk, **timing}
                    report.add("attention", row)


# -------------------------------------------------------------------- matmul


def _weights(setup: Setup, depth: int, columns: int, bits: Optional[int]):
    dense = (0.02 * mx.random.normal((columns, depth))).astype(setup.dtype)
    if bits is None:
        mx.eval(dense)
        return dense, None, None, dense.nbytes
    weight, scales, biases = mx.quantize(dense, group_size=64, bits=bits)
    del dense
    mx.eval(weight, scales, biases)
    return weight, scales, biases, weight.nbytes + scales.nbytes + biases.nbytes


def _dtype_name(dtype: mx.Dtype) -> str:
    return str(dtype).rsplit(".", 1)[-1]


def bench_matmul(setup: Setup, report: Report, args) -> None:
    for name, depth, columns in setup.projections:
        if args.skip_lm_head and name == "lm_head":
            continue
        if args.match and not any(text in name for text in args.match):
            continue
        for bits in args.bits:
            weight, scales, biases, nbytes = _weights(setup, depth, columns, bits)
            for rows in setup.rows:
                x = mx.random.normal((rows, depth)).astype(setup.dtype)
                mx.eval(x)
                ours = lambda: small_row_matmul(  # noqa: E731
                    x, weight, scales, biases, bits=bits,
                    group_size=64 if bits else None, use_kernel=args.use_kernel,
                )  # fmt: skip
                if bits is None:
                    theirs = lambda: x @ weight.T  # noqa: E731
                else:
                    theirs = lambda: mx.quantized_matmul(  # noqa: E731
                        x,
                        weight,
                        scales,
                        biases,
                        transpose=True,
                        group_size=64,
                        bits=bits,
                    )
                diff = mx.abs(
                    ours().astype(mx.float32) - theirs().astype(mx.float32)
                ).max()
                base = {
                    "projection": name,
                    "K": depth,
                    "N": columns,
                    "rows": rows,
                    "weights": (
                        _dtype_name(setup.dtype) if bits is None else f"{bits}-bit g64"
                    ),
                    "weight_bytes": nbytes,
                    "bound_us": 1e6 * nbytes / args.bandwidth,
                    "max_abs_diff_vs_mlx": float(diff),
                }
                for impl, fn in ((_form(args.use_kernel), ours), ("mlx", theirs)):
                    timing = time_op(fn, args.reps, args.batch)
                    if args.device_time:
                        timing.update(device_time(fn, args.reps))
                    ratio = timing["pipelined_us"] / base["bound_us"]
                    report.add("matmul", {**base, "impl": impl, **timing,
                                          "pipelined_over_bound": ratio})  # fmt: skip


# ---------------------------------------------------------------------- main


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.verify_kernels")
    parser.add_argument("--json", help="write results here (after every row)")
    parser.add_argument(
        "--small", action="store_true", help="tiny shapes (CPU smoke test)"
    )
    parser.add_argument("--reps", type=int, default=30, help="timed calls per op")
    parser.add_argument(
        "--batch", type=int, default=20, help="calls per pipelined wait"
    )
    add_bandwidth_argument(parser)
    parser.add_argument(
        "--skip-lm-head", action="store_true", help="skip the 202k-column head"
    )
    parser.add_argument("--only", choices=("attention", "matmul"), help="one section")
    parser.add_argument(
        "--chunks",
        type=lambda text: [int(t) for t in text.split(",")],
        default=None,
        help="attention: keys per chunk to time our kernel at (comma list; default:"
        " the library's)",
    )
    parser.add_argument(
        "--bits",
        type=lambda text: [None if t == "dense" else int(t) for t in text.split(",")],
        default=[None, 4, 8],
        help="matmul: weight forms to time (comma list of dense, 4, 8)",
    )
    parser.add_argument(
        "--match",
        type=lambda text: text.split(","),
        default=None,
        help="matmul: only projections whose name contains one of these (comma list)",
    )
    parser.add_argument(
        "--skip-scalar",
        action="store_true",
        help="attention: leave out the scalar-body arm where tensor cores serve",
    )
    parser.add_argument(
        "--device-time",
        action="store_true",
        help="also the kernels' device time per call (CUPTI via torch.profiler; CUDA)",
    )
    parser.add_argument(
        "--use-kernel",
        choices=("auto", "kernel", "reference"),
        default="auto",
        help="form of our ops (auto: the kernel on a GPU, the reference on the CPU)",
    )
    args = parser.parse_args(argv)
    args.use_kernel = {"auto": None, "kernel": True, "reference": False}[
        args.use_kernel
    ]
    if args.reps < 1 or args.batch < 1:
        parser.error("--reps and --batch must be >= 1")
    if args.chunks is None:
        args.chunks = [attention.CHUNK]
    if any(not 1 <= chunk <= attention.KERNEL_MAX_CHUNK for chunk in args.chunks):
        parser.error(f"--chunks must lie in 1..{attention.KERNEL_MAX_CHUNK}")
    return args


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    resolve_bandwidth(args)
    setup = SMALL if args.small else GLIMMER
    if args.small:
        args.reps, args.batch = min(args.reps, 3), min(args.batch, 2)
    meta = {
        "when": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "mlx": mx.__version__,
        "backend": backend.kernel_backend(),
        "device": str(mx.default_device()),
        "device_name": args.device_name,
        "bandwidth": args.bandwidth,
        "host": platform.node(),
        "setup": "small" if args.small else "glimmer",
        "argv": list(sys.argv[1:] if argv is None else argv),
        "attention_chunk": attention.CHUNK,
        "matmul_row_block": qmm.ROW_BLOCK,
    }
    report = Report(args.json, meta)
    try:
        if args.only in (None, "attention"):
            bench_attention(setup, report, args)
        if args.only in (None, "matmul"):
            bench_matmul(setup, report, args)
    except (RuntimeError, ValueError) as error:
        print(f"verify_kernels: {error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
