"""Whether a 4-bit matmul runs faster when its weights were fetched into the L2 during
the latency-bound kernel before it (CUDA).

Between a verify layer's matmuls run kernels that barely use the device's memory: the
norms (one CTA a row), the head prep, the attention's chunk pass and fold. The
matmul after each then starts its weight stream cold. This probe asks what a
matmul gains if those kernels' idle SMs had already asked the L2 for its weights.
Before each matmul call runs a *gap* kernel: one CTA waits ``--gaps`` microseconds
(reading ``%globaltimer``, touching no memory), :data:`COPIERS` CTAs copy the matmul's
input ``x`` through, so the matmul waits on the launch as on a real predecessor, and
``--prefetch-ctas`` more CTAs ask the L2 for some of the matmul's weight bytes and exit.
Arms (which bytes are asked for):

* ``none``: no prefetch CTA (the baseline);
* ``all``: every byte of the weights and of the scales / biases repack the bound call
  reads (only where they fit ``--l2-bytes``);
* ``linear:F``: the first ``F`` MB of the weights, and the same share of the scales;
* ``columns:F``: the first columns' rows of the weights up to ``F`` MB and the same
  columns' scales in every chunk: what the shipped launches ask for
  (``dflash.metal.prefetch.prefix_ranges``);
* ``heads:L``: the first ``L`` chunks (128 weight bytes a column) of every CTA's K
  range, for every column, and those chunks' scales: what each CTA of the first wave
  reads first.

and two ways of asking (``--methods``): ``line`` (one ``prefetch.global.L2`` a 128-byte
line, spread over the prefetch CTAs' threads) and ``bulk``
(``cp.async.bulk.prefetch.L2.global`` of up to 4 KB a thread). The weight copies span
``--cold-bytes`` and are called in turn, so no call finds its weights in the L2 from an
earlier call. Every timed pair is ``gap -> matmul`` in one evaluation (one CUDA graph,
back to back). It reports, per shape, row count, gap, arm and method, the medians of
the matmul's and the gap's device time (CUPTI), their sum, and the bytes asked for,
and checks the matmul's bits against the ``none`` arm's (a prefetch is a hint: the
bits cannot move).

GPU (torch's interpreter, for CUPTI)::

    python -m benchmarks.l2_prefetch --json F

The CPU has no CUDA backend: it exits with a one-line error.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from dataclasses import dataclass
from typing import Optional, Sequence

import mlx.core as mx

from dflash.metal import prefetch, qmm, tensor_qmm
from dflash.metal.groups import GroupKernelSpec, launch_groups
from dflash.metal.sources import CUDA

from .common import cupti_kernel_events, write_json
from .matmul_variants import SHAPES, weight_copies
from .verify_kernels import (
    GLIMMER,
    _weights,
    add_bandwidth_argument,
    per_call_meta,
    run_on_cuda,
)

THREADS = 256
# A weight chunk: 256 four-bit weights of a column, 128 bytes (one L2 line).
CHUNK_BYTES = prefetch.LINE
# CTAs of the gap kernel that copy x through (the first only waits).
COPIERS = 16

# params: spin_ns, x elements. The prefetch CTAs (the launch's last, l2_params[0] of
# them) walk l2_params' ranges as the shipped launches' do (dflash.metal.prefetch).
_BODY = r"""
  const long long spin_ns = params[0];
  const int x_count = params[1];
  if (group == 0) {
    if (lid == 0 && spin_ns > 0) {
      unsigned long long t0, t;
      asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
      do {
        __nanosleep(100);
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
      } while ((long long)(t - t0) < spin_ns);
    }
    return;
  }
  if (int(group) <= COPIERS) {
    // x through to y, spread over COPIERS CTAs (a few microseconds at most).
    for (int i = (int(group) - 1) * THREADS + int(lid); i < x_count;
         i += COPIERS * THREADS) {
      y[i] = x[i];
    }
    return;
  }
"""

GAP_SPEC = GroupKernelSpec(
    base="l2_prefetch_gap",
    input_names=("x", "params") + prefetch.INPUT_NAMES,
    input_types=("T", "int32") + prefetch.INPUT_TYPES,
    output_names=("y",),
    output_types=("T",),
    helpers="",
    body=f"  constexpr int THREADS = {THREADS};\n"
    f"  constexpr int COPIERS = {COPIERS};\n"
    + prefetch.WALK_CONSTANTS
    + _BODY
    + prefetch.WALK,
    threads=THREADS,
    backends=(CUDA,),
    dtypes=(mx.bfloat16,),
)

ARM_KINDS = ("none", "all", "linear", "heads", "columns")


@dataclass(frozen=True)
class Arm:
    """Which of a call's bytes are asked for: ``kind`` of :data:`ARM_KINDS`, ``amount``
    the MB of ``linear`` or the chunks of ``heads``."""

    kind: str
    amount: float = 0.0

    @property
    def label(self) -> str:
        return (
            self.kind
            if self.kind in ("none", "all")
            else f"{self.kind}:{self.amount:g}"
        )


def parse_arm(text: str) -> Arm:
    """``none``, ``all``, ``linear:F`` (MB) or ``heads:L`` (chunks).

    Raises:
        argparse.ArgumentTypeError: Not one of those forms.
    """
    kind, _, amount = text.partition(":")
    if kind in ("none", "all") and not amount:
        return Arm(kind)
    try:
        value = float(amount)
    except ValueError:
        value = -1.0
    if kind not in ("linear", "heads", "columns") or value <= 0:
        raise argparse.ArgumentTypeError(
            "an arm is none, all, linear:MB, columns:MB or heads:CHUNKS (positive), "
            f"got {text!r}"
        )
    if kind == "columns" and value != int(value):
        raise argparse.ArgumentTypeError(f"columns takes whole megabytes, got {text!r}")
    if kind == "heads" and value != int(value):
        raise argparse.ArgumentTypeError(f"heads takes whole chunks, got {text!r}")
    return Arm(kind, value)


def byte_ranges(
    arm: Arm,
    weight_bytes: int,
    scale_bytes: int,
    depth: int,
    columns: int,
    l2_bytes: int,
) -> Optional[list[tuple[int, int, int, int, int]]]:
    """The ``(array, start, length, stride, repeats)`` byte ranges ``arm`` asks for
    (array 0: the weights, ``(N, K / 2)`` bytes; 1: the scales repack, chunk-major:
    chunk ``c``'s scales for every column adjacent); ``repeats`` runs of ``length``
    bytes every ``stride``. None: ``all`` does not fit ``l2_bytes``.

    ``heads``: for each CTA's K range (``tensor_qmm.split_plan``), its first chunks in
    every column (a run a column) and their scales.
    """
    chunks = depth // 256
    if arm.kind == "none":
        return []
    if arm.kind == "all":
        if weight_bytes + scale_bytes > l2_bytes:
            return None
        return [(0, 0, weight_bytes, 0, 1), (1, 0, scale_bytes, 0, 1)]
    if arm.kind == "columns":  # what the shipped launches ask for
        chunks_shape = (chunks, columns, scale_bytes // (chunks * columns) // 2)
        return prefetch.prefix_ranges(
            (columns, depth // 8), weight_bytes, chunks_shape, scale_bytes,
            int(arm.amount),
        )  # fmt: skip
    if arm.kind == "linear":
        share = min(1.0, arm.amount * 2**20 / weight_bytes)
        return [
            (0, 0, prefetch.whole_lines(int(share * weight_bytes)), 0, 1),
            (1, 0, prefetch.whole_lines(int(share * scale_bytes)), 0, 1),
        ]
    _, splits, per_split = tensor_qmm.split_plan(depth, columns, 4)
    lead = min(int(arm.amount), per_split)
    row_bytes = depth // 2
    scale_chunk = scale_bytes // chunks
    ranges = []
    for split in range(splits):
        first = split * per_split
        count = min(lead, chunks - first)
        if count > 0:
            ranges.append(
                (0, first * CHUNK_BYTES, count * CHUNK_BYTES, row_bytes, columns)
            )
            ranges.append((1, first * scale_chunk, count * scale_chunk, 0, 1))
    return ranges


def gap_params(spin_us: float, x_count: int) -> list[int]:
    """The gap kernel's own scalars (its prefetch's are ``prefetch.params_of``)."""
    return [int(spin_us * 1000), x_count]


def _durations(kernels: list, key: str) -> list[float]:
    return [d for name, _, d in kernels if key in name]


def run(args: argparse.Namespace) -> dict:
    """Every shape x rows x gap x arm x method; rows printed and kept."""
    result = {"meta": per_call_meta(args, l2_bytes=args.l2_bytes), "rows": []}
    for shape in args.shapes:
        depth, columns = SHAPES[shape]
        sets, nbytes = cold_weight_sets(shape, args.cold_bytes)
        for rows in args.rows:
            x = mx.random.normal((rows, depth)).astype(mx.bfloat16)
            mx.eval(x)
            bound = [
                qmm.bind_matmul(
                    x.shape, x.dtype, w, s, b, bits=4, group_size=64, use_kernel=True
                )
                for w, s, b in sets
            ]
            # The scales / biases as the bound call reads them (one repack, or two).
            repacks = [call.reads[1] for call in bound]
            scale_bytes = repacks[0].nbytes
            weight_bytes = sets[0][0].nbytes
            reference = None
            for gap in args.gaps:
                for arm in args.arms:
                    ranges = byte_ranges(
                        arm, weight_bytes, scale_bytes, depth, columns, args.l2_bytes
                    )
                    if ranges is None:
                        continue
                    for method, placement in _ways(args, ranges):
                        row = _time_arm(
                            args, shape, rows, x, sets, bound, repacks, gap, arm,
                            method, placement, ranges, nbytes,
                        )  # fmt: skip
                        if reference is None:
                            reference = row.pop("_out")
                            row["same_bits"] = True
                        else:
                            out = row.pop("_out")
                            row["same_bits"] = bool(mx.array_equal(out, reference))
                        result["rows"].append(row)
                        print(json.dumps(row), flush=True)
                        write_json(args.json, result)
    return result


def cold_weight_sets(shape: str, cold_bytes: int) -> tuple[list, int]:
    """Random 4-bit weights of a Glimmer projection (:data:`SHAPES`) as copies spanning
    ``cold_bytes``, so that calls taking them in turn find none in the L2; returns the
    ``(weight, scales, biases)`` copies and one copy's bytes."""
    depth, columns = SHAPES[shape]
    first = _weights(GLIMMER, depth, columns, 4)
    nbytes = first[3]
    sets = [first[:3]] + [
        _weights(GLIMMER, depth, columns, 4)[:3]
        for _ in range(weight_copies(nbytes, cold_bytes) - 1)
    ]
    return sets, nbytes


def _ways(args: argparse.Namespace, ranges: list) -> list[tuple[str, str]]:
    """``(method, placement)`` pairs an arm is timed in (one for ``none``)."""
    if not ranges:
        return [("-", "-")]
    return [(m, p) for p in args.placements for m in args.methods]


def _time_arm(
    args, shape, rows, x, sets, bound, repacks, gap, arm, method, placement, ranges,
    nbytes,
) -> dict:  # fmt: skip
    fetchers = args.prefetch_ctas if ranges else 0
    separate = placement == "separate"
    bulk = method == "bulk"
    # The waiting launch's scalars and ranges; a separate launch's (no wait, all the
    # prefetch CTAs) before it.
    waiting = [gap_params(gap, x.size)]
    waiting.append(prefetch.params_of(ranges, 0 if separate else fetchers, bulk))
    alone = [gap_params(0.0, x.size), prefetch.params_of(ranges, fetchers, bulk)]
    waiting, alone = (
        [mx.array(v, dtype=mx.int32) for v in p] for p in (waiting, alone)
    )
    words = [mx.view(r, mx.uint32) for r in repacks]
    mx.eval(waiting, alone, words)

    def gap_launch(source: mx.array, i: int, params: list, ctas: int) -> mx.array:
        own, asks = params
        (y,) = launch_groups(
            GAP_SPEC,
            [source, own, sets[i][0], words[i], asks],
            [x.shape],
            [x.dtype],
            1 + COPIERS + ctas,
            x.dtype,
        )
        return y

    def pair(i: int) -> mx.array:
        source = gap_launch(x, i, alone, fetchers) if separate else x
        return bound[i](gap_launch(source, i, waiting, 0 if separate else fetchers))

    out = pair(0)
    mx.eval(out)

    def calls() -> None:
        for rep in range(args.reps):
            mx.eval(pair(rep % len(sets)))

    kernels = cupti_kernel_events(calls)
    gaps = _durations(kernels, "l2_prefetch_gap")
    matmuls = _durations(kernels, "tensor_q4")
    # A separate prefetch launch is every other gap kernel: their medians add.
    launches = 2 if separate else 1
    gap_us = (
        sum(statistics.median(gaps[k::launches]) for k in range(launches))
        if gaps
        else float("nan")
    )
    matmul_us = statistics.median(matmuls) if matmuls else float("nan")
    asked = sum(length * repeats for _, _, length, _, repeats in ranges)
    return {
        "shape": shape,
        "rows": rows,
        "gap_us": gap,
        "arm": arm.label,
        "method": method,
        "placement": placement,
        "prefetch_ctas": fetchers,
        "asked_mb": round(asked / 2**20, 2),
        "ranges": len(ranges),
        "matmul_device_us": round(matmul_us, 2),
        "gap_device_us": round(gap_us, 2),
        "pair_device_us": round(matmul_us + gap_us, 2),
        "bound_us": round(1e6 * nbytes / args.bandwidth, 2),
        "copies": len(sets),
        "_out": out,
    }


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.l2_prefetch")
    parser.add_argument(
        "--shapes",
        type=lambda text: text.split(";"),
        default=["o_proj", "attn q/k/v/gate fused", "mlp gate+up fused", "mlp down"],
        help=f"semicolon list of: {'; '.join(SHAPES)}",
    )
    parser.add_argument(
        "--rows", type=lambda text: [int(r) for r in text.split(",")], default=[16]
    )
    parser.add_argument(
        "--gaps",
        type=lambda text: [float(g) for g in text.split(",")],
        default=[5.0, 12.0, 25.0],
        help="microseconds the gap kernel's first CTA waits",
    )
    parser.add_argument(
        "--arms",
        type=lambda text: [parse_arm(a) for a in text.split(",")],
        default=[parse_arm(a) for a in ("none", "all", "linear:16", "heads:2")],
    )
    parser.add_argument(
        "--methods",
        type=lambda text: text.split(","),
        default=["line", "bulk"],
    )
    parser.add_argument(
        "--placements",
        type=lambda text: text.split(","),
        default=["fused", "separate"],
        help="fused: the gap kernel's own extra CTAs ask; separate: a launch of its "
        "own before the gap kernel",
    )
    parser.add_argument("--prefetch-ctas", type=int, default=32)
    parser.add_argument("--l2-bytes", type=int, default=40 * 2**20)
    parser.add_argument("--reps", type=int, default=40)
    parser.add_argument("--cold-bytes", type=int, default=512 * 2**20)
    add_bandwidth_argument(parser)
    parser.add_argument("--json", help="write results here (after every row)")
    args = parser.parse_args(argv)
    unknown = [s for s in args.shapes if s not in SHAPES]
    bad = [m for m in args.methods if m not in ("line", "bulk")] + [
        p for p in args.placements if p not in ("fused", "separate")
    ]
    if unknown or bad or args.prefetch_ctas < 1 or min(args.gaps) < 0:
        parser.error(
            f"unknown shapes {unknown} or methods / placements {bad}, or prefetch "
            "CTAs < 1 or a negative gap"
        )
    return args


def main(argv: Optional[Sequence[str]] = None) -> int:
    return run_on_cuda("l2_prefetch", parse_args(argv), run)


if __name__ == "__main__":
    sys.exit(main())
