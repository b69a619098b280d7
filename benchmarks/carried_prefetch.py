"""Whether the matmul *before* a gap can ask the next matmul's first weights into the
L2 for free (CUDA).

Session 59 put prefetch CTAs in the residual norm before a verify layer's MLP: the
fused gate / up took ~7.5 µs less, but the norm's launch stayed open ~5 µs longer
while its CTAs issued 18 MB (at the memory's rate). A matmul launch has room the norm
has not: o_proj's 208 CTAs leave 56 of the 264 resident slots free for its whole
~15 µs (its fixed costs dominate, its memory is not busy), and the fused gate / up's
624 CTAs end in a third wave of 96, so CTAs past its own are dispatched into its
tail. This probe times, per pair ``carrier -> gap -> target`` (one evaluation, one
CUDA graph, weights cold: copies spanning ``--cold-bytes``, called in turn):

* ``none``: no prefetch;
* ``norm``: the gap launch (one CTA waits ``--gaps`` µs, 16 copy the carrier's output
  into the target's input) carries the prefetch CTAs (session 59's placement);
* ``carried``: the carrier matmul's launch carries them
  (``bind_tensor_core``'s ``prefetch=``).

Each asks the target's first ``--megabytes`` (whole columns and their scales:
``dflash.metal.prefetch.plan``) with ``--fetchers`` CTAs. Pairs: ``o_proj>gate_up``
(the norm between them) and ``gate_up>down`` (mlx's SwiGLU between them). It reports
the medians of each launch's device time (CUPTI) and their sum, and checks both
matmuls' bits against the first arm's (``none`` by default).

GPU (torch's interpreter, for CUPTI)::

    python -m benchmarks.carried_prefetch --json F

The CPU has no CUDA backend: it exits with a one-line error.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from typing import Optional, Sequence

import mlx.core as mx

from dflash.metal import prefetch, qmm
from dflash.metal.groups import launch_groups

from .common import cupti_kernel_events, write_json
from .l2_prefetch import COPIERS, GAP_SPEC, cold_weight_sets, gap_params
from .matmul_variants import SHAPES
from .verify_kernels import add_bandwidth_argument, per_call_meta, run_on_cuda

PAIRS = {
    "o_proj>gate_up": ("o_proj", "mlp gate+up fused"),
    "gate_up>down": ("mlp gate+up fused", "mlp down"),
}
ARMS = ("none", "norm", "carried")
GAP_NAME = GAP_SPEC.base
MATMUL_NAME = "tensor_q"


class Side:
    """One side of a pair: its weight copies bound for ``rows`` rows, and its input."""

    def __init__(self, shape: str, rows: int, cold_bytes: int) -> None:
        sets, self.nbytes = cold_weight_sets(shape, cold_bytes)
        self.x = mx.random.normal((rows, SHAPES[shape][0])).astype(mx.bfloat16)
        mx.eval(self.x)
        self.bound = [
            qmm.bind_matmul(
                self.x.shape, self.x.dtype, w, s, b, bits=4, group_size=64,
                use_kernel=True,
            )  # fmt: skip
            for w, s, b in sets
        ]


def pair_events(kernels: list) -> list[tuple[float, float, float]]:
    """``(carrier, gap, target)`` device µs per timed pair: each gap launch with the
    matmul launches just before and just after it (in start order)."""
    ordered = sorted(
        (k for k in kernels if GAP_NAME in k[0] or MATMUL_NAME in k[0]),
        key=lambda kernel: kernel[1],
    )
    found = []
    for i in range(1, len(ordered) - 1):
        before, gap, after = ordered[i - 1 : i + 2]
        if GAP_NAME in gap[0] and MATMUL_NAME in before[0] and MATMUL_NAME in after[0]:
            found.append((before[2], gap[2], after[2]))
    return found


def run(args: argparse.Namespace) -> dict:
    """Every pair x rows x gap x fetchers x arm; rows printed and kept."""
    result = {"meta": per_call_meta(args, megabytes=args.megabytes), "rows": []}
    for name in args.pairs:
        carrier_shape, target_shape = PAIRS[name]
        for rows in args.rows:
            carrier = Side(carrier_shape, rows, args.cold_bytes)
            target = Side(target_shape, rows, args.cold_bytes)
            reference = None
            for gap in args.gaps:
                for fetchers in args.fetchers:
                    plans = [
                        prefetch.plan(call.reads, args.megabytes, fetchers)
                        for call in target.bound
                    ]
                    for arm in args.arms:
                        row, outs = _time_arm(args, carrier, target, plans, gap, arm)
                        row.update(pair=name, rows=rows, fetchers=fetchers)
                        if reference is None:
                            reference = outs
                        row["same_bits"] = all(
                            bool(mx.array_equal(a, b)) for a, b in zip(outs, reference)
                        )
                        result["rows"].append(row)
                        print(json.dumps(row), flush=True)
                        write_json(args.json, result)
    return result


def _time_arm(args, carrier: Side, target: Side, plans: list, gap: float, arm: str):
    """One arm's medians, and the last pair's two matmul outputs."""
    x_count = target.x.size
    own = mx.array(gap_params(gap, x_count), dtype=mx.int32)
    idle = mx.array(prefetch.params_of([], 0), dtype=mx.int32)
    mx.eval(own, idle)

    def pair(i: int) -> tuple[mx.array, mx.array]:
        plan = plans[i % len(plans)]
        carried = plan if arm == "carried" else None
        first = carrier.bound[i % len(carrier.bound)](carrier.x, prefetch=carried)
        asks = plan.inputs if arm == "norm" else [plan.weight, plan.weight, idle]
        fetchers = plan.fetchers if arm == "norm" else 0
        (between,) = launch_groups(
            GAP_SPEC,
            [first.reshape(-1), own, *asks],
            [target.x.shape],
            [target.x.dtype],
            1 + COPIERS + fetchers,
            target.x.dtype,
        )
        return first, target.bound[i % len(target.bound)](between)

    outs = pair(0)
    mx.eval(outs)

    def calls() -> None:
        for rep in range(args.reps):
            mx.eval(pair(rep))

    timed = pair_events(cupti_kernel_events(calls))
    medians = [statistics.median(column) for column in zip(*timed)] or [
        float("nan")
    ] * 3
    return {
        "arm": arm,
        "gap_us": gap,
        "carrier_device_us": round(medians[0], 2),
        "gap_device_us": round(medians[1], 2),
        "target_device_us": round(medians[2], 2),
        "sum_device_us": round(sum(medians), 2),
        "pairs_timed": len(timed),
        "target_bound_us": round(1e6 * target.nbytes / args.bandwidth, 2),
        "copies": [len(carrier.bound), len(target.bound)],
    }, outs


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.carried_prefetch")
    parser.add_argument(
        "--pairs",
        type=lambda text: text.split(","),
        default=list(PAIRS),
        help=f"comma list of: {', '.join(PAIRS)}",
    )
    parser.add_argument(
        "--rows", type=lambda text: [int(r) for r in text.split(",")], default=[16, 1]
    )
    parser.add_argument(
        "--gaps",
        type=lambda text: [float(g) for g in text.split(",")],
        default=[3.0],
        help="microseconds the gap launch's first CTA waits",
    )
    parser.add_argument(
        "--fetchers", type=lambda text: [int(f) for f in text.split(",")], default=[32]
    )
    parser.add_argument("--arms", type=lambda text: text.split(","), default=list(ARMS))
    parser.add_argument("--megabytes", type=int, default=prefetch.DEFAULT_MEGABYTES)
    parser.add_argument("--reps", type=int, default=40)
    parser.add_argument("--cold-bytes", type=int, default=512 * 2**20)
    add_bandwidth_argument(parser)
    parser.add_argument("--json", help="write results here (after every row)")
    args = parser.parse_args(argv)
    bad = [p for p in args.pairs if p not in PAIRS] + [
        a for a in args.arms if a not in ARMS
    ]
    if bad or min(args.fetchers) < 1 or min(args.gaps) < 0 or args.megabytes < 1:
        parser.error(
            f"unknown pairs or arms {bad}, or fetchers < 1, a negative gap or "
            "megabytes < 1"
        )
    return args


def main(argv: Optional[Sequence[str]] = None) -> int:
    return run_on_cuda("carried_prefetch", parse_args(argv), run)


if __name__ == "__main__":
    sys.exit(main())
