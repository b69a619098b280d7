"""The verify forward's device time against the bound of the bytes it reads.

Issue 16's goal is stated on this number: the 16-token verify forward of full-size Muse
Glimmer at most 1.6x the time of reading its bytes once at the device's peak bandwidth.
Sessions 47-62 inferred it from a whole round (the round's device time less the draft's);
this measures it directly, as the loop runs it: after a prefill of ``--context`` tokens on
the scale pair (dflash caches; the loop's context: the verify kernels, the drafter's taps
attached and started early, the norms' scales held, the folded block route), each
forward opens a :class:`~dflash.cache.SpeculativeCheckpoint`, runs the target over
``--rows`` tokens under the verify kernels of the arm, takes the tapped features and
commits ``--commit`` rows (a round's kept rows: the commit's stores then run inside the
next forward, as in the loop). Per arm it reports:

* ``wall_ms``: a synced forward's wall time (median; the host's build and encode are in it);
* ``first_forward_ms``: the arm's first forward (a warm-up one where there is any), which
  carries the first compile of every kernel it launches that mlx has not cached on disk
  (NVRTC on CUDA: 12-55 s a form on an H100, session 73), beside ``build_s`` and
  ``prefill_s``, the scale pair's build and the prefill;
* with ``--device`` (a GPU, PyTorch in the interpreter for CUPTI): ``busy_ms`` (the time in
  which at least one kernel ran, per forward), ``kernels`` per forward, the costliest
  kernel names, and ``busy_ms`` over the bound (``bound_ms``: the weights once, one
  embedding row, and the KV rows the planes hold, at ``--bandwidth`` or the device's peak);
  and the goal's budget (session 77): the projections' matmul launches
  (:data:`MATMUL_NAMES`) against every other launch, each as summed time and launches a
  forward, and ``room_for_matmuls_ms``, what :data:`GOAL_OVER_BOUND` times the bound
  leaves the matmuls once the other launches have run (below the time their weights take
  at the peak, the goal cannot be met by a faster matmul alone).

Arms (``--kernels``: :data:`benchmarks.round_profile.KERNEL_ARMS`) alternate forward by
forward, the order reversed every other repetition. ``--rows 1 --commit 1`` times a plain
decode step the same way.

Run (from the repository root)::

    python -m benchmarks.verify_forward --scale full --quant 4bit --context 4096 \\
        --kernels default,off --device --json docs/benchmarks/.../verify-forward.json
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import statistics
import sys
import time
from collections import Counter
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence

import mlx.core as mx
import numpy as np
from mlx_lm.generate import generation_stream

from dflash import dflash_round
from dflash.bench.measure import _prefill_dflash
from dflash.bench.report import environment
from dflash.bench.scale import build_scale_pair, scale_prompts
from dflash.bench.scale_target import QUANTS, step_read_bytes
from dflash.cache import SpeculativeCheckpoint
from dflash.metal import kept_modules
from dflash.taps import TargetTaps

from .common import busy_us, cupti_trace, write_json
from .round_profile import _kernel_arms, kernel_arm
from .verify_kernels import add_bandwidth_argument, resolve_bandwidth

# Kernel names listed per arm with ``--device`` (the costliest by summed time).
TOP_KERNELS = 16
# Issue 16's goal: the verify forward's device time at most this many times its bound.
GOAL_OVER_BOUND = 1.6
# Parts of a kernel's name that make it a projection's matmul: dflash's tensor-core and
# small-row matmuls and their split sums, mlx's quantized and dense matmuls, and the
# cuBLAS / cuBLASLt / CUTLASS GEMMs mlx calls (with their split-K reductions).
MATMUL_NAMES = (
    "dflash_tensor_q",
    "dflash_tensor_dense",
    "dflash_tensor_split_sum",
    "dflash_small_row_",
    "qmv",
    "qmm",
    "gemv",
    "gemm",
    "nvjet",
    "cublas",
    "cutlass",
    "splitKreduce",
)


def kv_bytes(cache: Sequence[Any]) -> int:
    """Bytes of the K / V rows the planes hold (what a forward's attention reads)."""
    total = 0
    for plane in cache:
        if plane.kv is None:
            continue
        rows = plane.kv.shape[plane.kv_axis]
        total += plane.kv.nbytes // rows * plane.len
    return total


@contextlib.contextmanager
def loop_context(target, drafter) -> Iterator[TargetTaps]:
    """What ``dflash_generate_step`` holds around its rounds
    (:func:`dflash.dflash_round.round_context`: the verify kernels, the taps, the
    norms' ``1 + weight`` held, without which each of Glimmer's four norms a layer adds
    it again, and the folded block route), with its taps
    (:func:`~dflash.dflash_round.round_taps`; ``auto``'s per-round pacing is not
    chosen here). Yields the taps."""
    taps, _ = dflash_round.round_taps(target, drafter)
    with dflash_round.round_context(target, drafter, taps):
        yield taps


def forward_call(
    model, cache: Sequence[Any], taps: TargetTaps, block: mx.array, commit: int
) -> Callable[[], None]:
    """One verify forward as the loop runs it: checkpoint, forward, taps, commit.

    Shapes: block ``(1, rows)``.
    """

    def call() -> mx.array:
        checkpoint = SpeculativeCheckpoint.begin(cache, block.shape[1])
        try:
            logits = model(block, cache=cache)
            features = taps.pop()
            mx.eval(logits, features)
        except BaseException:
            checkpoint.rollback()
            raise
        checkpoint.commit(commit)
        return logits

    return call


def logits_digest(logits: mx.array) -> str:
    """SHA-256 of ``logits``' bytes (as float32): the same digest in two processes
    means the same bits, whichever process compiled the kernels."""
    return hashlib.sha256(np.array(logits.astype(mx.float32)).tobytes()).hexdigest()


def is_matmul(name: str) -> bool:
    """Whether the kernel ``name`` is a projection's matmul (:data:`MATMUL_NAMES`)."""
    return any(part in name for part in MATMUL_NAMES)


def split_budget(
    kernels: Sequence[tuple[str, float, float]], forwards: int
) -> Dict[str, float]:
    """The matmul launches against every other launch, per forward: summed device
    time (ms) and launches of each side.

    Args:
        kernels: CUPTI's ``(name, start_us, duration_us)`` events over ``forwards``.
        forwards: How many forwards the events cover.
    """
    summed = {True: 0.0, False: 0.0}
    counted = {True: 0, False: 0}
    for name, _, duration in kernels:
        side = is_matmul(name)
        summed[side] += duration
        counted[side] += 1
    return {
        "matmul_ms": round(summed[True] / forwards / 1e3, 4),
        "matmul_kernels": round(counted[True] / forwards, 1),
        "other_ms": round(summed[False] / forwards / 1e3, 4),
        "other_kernels": round(counted[False] / forwards, 1),
    }


def device_profile(call: Callable[[], None], forwards: int) -> Dict[str, Any]:
    """Kernels, busy time, the costliest names and the matmuls' share per forward over
    ``forwards`` calls (CUPTI)."""

    def run() -> None:
        for _ in range(forwards):
            call()
        mx.synchronize()

    kernels = cupti_trace(run)[0]
    summed: Counter = Counter()
    counts: Counter = Counter()
    for name, _, duration in kernels:
        summed[name[:100]] += duration
        counts[name[:100]] += 1
    return {
        "forwards": forwards,
        "kernels": round(len(kernels) / forwards, 1),
        "busy_ms": round(busy_us(kernels) / forwards / 1e3, 4),
        "sum_ms": round(sum(summed.values()) / forwards / 1e3, 4),
        "top_us": [
            [name, round(counts[name] / forwards, 2), round(us / forwards, 1)]
            for name, us in summed.most_common(TOP_KERNELS)
        ],
        **split_budget(kernels, forwards),
    }


def progress(began: float, text: str) -> None:
    """One progress line on stderr, seconds since ``began`` first: a run stopped by a
    time limit still says how far it got (the first forward of an arm includes the
    first compiles of its kernels)."""
    print(f"[{time.time() - began:7.1f} s] {text}", file=sys.stderr, flush=True)


def run(args: argparse.Namespace, command: str) -> Dict[str, Any]:
    """Prefill, then alternate the arms forward by forward; the report (times in ms)."""
    began = time.time()
    target, drafter = build_scale_pair(args.scale, args.quant, 0)
    built = time.time()
    progress(began, f"built the {args.scale} {args.quant} pair")
    prompt = scale_prompts(target, args.context + args.rows, 1, 0)[0]
    walls: Dict[str, List[float]] = {arm: [] for arm in args.kernels}
    first: Dict[str, float] = {}
    first_digest = ""
    device: Dict[str, Any] = {}
    with mx.stream(generation_stream):
        cache, _ = _prefill_dflash(target, drafter, prompt[: args.context])
        prefilled = time.time()
        progress(began, f"prefilled {args.context} tokens")
        block = prompt[args.context :][None]
        bound_bytes = step_read_bytes(target, kv_bytes(cache))
        for rep in range(args.warmup + args.reps):
            order = args.kernels if rep % 2 == 0 else args.kernels[::-1]
            took = {}
            for arm in order:
                with kernel_arm(arm), loop_context(target, drafter) as taps:
                    call = forward_call(target, cache, taps, block, args.commit)
                    mx.synchronize()
                    start = time.perf_counter()
                    logits = call()
                    took[arm] = 1e3 * (time.perf_counter() - start)
                    if not first:
                        first_digest = logits_digest(logits)
                    first.setdefault(arm, took[arm])
                    if rep >= args.warmup:
                        walls[arm].append(took[arm])
            shown = {arm: round(ms, 2) for arm, ms in took.items()}
            progress(began, f"forward {rep} ms: {shown}")
        if args.device:
            for arm in args.kernels:
                with kernel_arm(arm), loop_context(target, drafter) as taps:
                    call = forward_call(target, cache, taps, block, args.commit)
                    call()  # this arm's traces made before the capture
                    device[arm] = device_profile(call, args.device_forwards)
                progress(began, f"{arm}: device busy {device[arm]['busy_ms']} ms")
    bound_ms = 1e3 * bound_bytes / args.bandwidth
    report: Dict[str, Any] = {
        "environment": environment(command),
        "rows": args.rows,
        "commit": args.commit,
        "bound_bytes": bound_bytes,
        "device_name": args.device_name,
        "bandwidth": args.bandwidth,
        "bound_ms": round(bound_ms, 3),
        "context_start": args.context,
        "context_end": cache[0].offset,
        "build_s": round(built - began, 1),
        "prefill_s": round(prefilled - built, 1),
        "first_forward_ms": {arm: round(ms, 3) for arm, ms in first.items()},
        "first_logits_sha256": first_digest,
        "kept_modules": kept_modules.report(),
        "wall_ms": {
            arm: {
                "median": round(statistics.median(times), 3),
                "min": round(min(times), 3),
            }
            for arm, times in walls.items()
        },
    }
    for arm, profile in device.items():
        profile["over_bound"] = round(profile["busy_ms"] / bound_ms, 2)
        room = GOAL_OVER_BOUND * bound_ms - profile["other_ms"]
        profile["room_for_matmuls_ms"] = round(room, 3)
    if device:
        report["device"] = device
    report["total_s"] = round(time.time() - began, 1)
    return report


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.verify_forward")
    parser.add_argument("--scale", choices=("full", "tiny"), default="tiny")
    parser.add_argument("--quant", choices=QUANTS, default="4bit")
    parser.add_argument("--context", type=int, default=64, help="prompt tokens")
    parser.add_argument("--rows", type=int, default=16, help="tokens a forward takes")
    parser.add_argument("--commit", type=int, default=7, help="rows a forward keeps")
    parser.add_argument("--kernels", type=_kernel_arms, default=["default", "off"])
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument(
        "--device", action="store_true", help="CUPTI kernels per forward, per arm"
    )
    parser.add_argument(
        "--device-forwards", type=int, default=8, help="forwards traced per arm"
    )
    add_bandwidth_argument(parser)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    for name, least in (
        ("context", 2),
        ("rows", 1),
        ("commit", 1),
        ("reps", 1),
        ("warmup", 0),
        ("device_forwards", 1),
    ):
        if getattr(args, name) < least:
            parser.error(f"--{name.replace('_', '-')} must be at least {least}")
    if args.commit > args.rows:
        parser.error(f"--commit {args.commit} is more than --rows {args.rows}")
    if len(set(args.kernels)) != len(args.kernels):
        parser.error(f"an arm repeats in --kernels {','.join(args.kernels)}")
    resolve_bandwidth(args)
    return args


def main(argv: Optional[Sequence[str]] = None) -> None:
    args = parse_args(argv)
    given = sys.argv[1:] if argv is None else argv
    command = " ".join(["python -m benchmarks.verify_forward", *given])
    report = run(args, command)
    write_json(args.json, report)
    print(
        f"rows {report['rows']}, bound {report['bound_ms']} ms "
        f"({report['bound_bytes'] / 1e9:.2f} GB at {report['bandwidth'] / 1e12:.2f} TB/s)",
        flush=True,
    )
    print(
        f"build {report['build_s']} s, prefill {report['prefill_s']} s, first logits "
        f"{report['first_logits_sha256'][:16]}, kept modules {report['kept_modules']}",
        flush=True,
    )
    for arm, wall in report["wall_ms"].items():
        line = (
            f"{arm}: wall {wall['median']} ms (min {wall['min']}; "
            f"first {report['first_forward_ms'][arm]})"
        )
        profile = report.get("device", {}).get(arm)
        if profile:
            line += (
                f"; device busy {profile['busy_ms']} ms, {profile['over_bound']}x the "
                f"bound, {profile['kernels']} kernels; matmuls {profile['matmul_ms']} "
                f"ms in {profile['matmul_kernels']}, the rest {profile['other_ms']} ms "
                f"in {profile['other_kernels']}, so {GOAL_OVER_BOUND}x the bound leaves "
                f"the matmuls {profile['room_for_matmuls_ms']} ms"
            )
        print(line, flush=True)


if __name__ == "__main__":
    main()
