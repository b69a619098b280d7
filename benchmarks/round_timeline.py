"""The device's own timeline of DFlash rounds: busy time, idle gaps and the costliest kernels.

Host timers cannot tell whether the device idles inside a round. This benchmark runs the
loop of :mod:`benchmarks.round_profile` (scale pair, REPLAY profile) under CUPTI activity
tracing, taken through ``torch.profiler`` (which records every CUDA kernel in the process,
mlx's included), and reports per round: wall time, device busy time (the union of kernel
intervals), idle time, kernel count, the largest idle gaps, and the kernels that take the
most device time. CUDA only; needs PyTorch with CUDA in the same interpreter.

Run (from the repository root, on the GPU machine)::

    python -m benchmarks.round_timeline --scale full --quant bf16 --context 4096 \\
        --tau 6 --max-tokens 160 --json docs/benchmarks/round-timeline.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from collections import defaultdict
from typing import Any, Dict, List, Sequence, Tuple

from benchmarks.round_profile import scale_parser, scale_run
from dflash.bench.replay import ReplayDrafter
from dflash.bench.report import environment
from dflash.dflash_round import dflash_generate_step

Interval = Tuple[float, float]


def kernel_intervals(trace: Dict[str, Any]) -> List[Tuple[str, float, float]]:
    """``(name, start_us, end_us)`` of every device kernel and memcpy/memset in a trace."""
    out = []
    for event in trace.get("traceEvents", []):
        if event.get("ph") != "X":
            continue
        if event.get("cat") not in ("kernel", "gpu_memcpy", "gpu_memset"):
            continue
        start = float(event["ts"])
        out.append(
            (event.get("name", "?"), start, start + float(event.get("dur", 0.0)))
        )
    out.sort(key=lambda item: item[1])
    return out


def union_busy(intervals: Sequence[Interval]) -> Tuple[float, List[float]]:
    """Busy time of sorted intervals (overlaps counted once) and the idle gaps between."""
    busy, gaps = 0.0, []
    current_start = current_end = None
    for start, end in intervals:
        if current_end is None:
            current_start, current_end = start, end
        elif start > current_end:
            busy += current_end - current_start
            gaps.append(start - current_end)
            current_start, current_end = start, end
        else:
            current_end = max(current_end, end)
    if current_end is not None:
        busy += current_end - current_start
    return busy, gaps


def top_kernels(kernels, count: int) -> List[Dict[str, Any]]:
    """The ``count`` kernel names with the most device time."""
    totals: Dict[str, List[float]] = defaultdict(lambda: [0.0, 0])
    for name, start, end in kernels:
        totals[name][0] += end - start
        totals[name][1] += 1
    ranked = sorted(totals.items(), key=lambda item: -item[1][0])[:count]
    return [
        {"name": name[:160], "total_us": round(total, 1), "calls": int(calls)}
        for name, (total, calls) in ranked
    ]


def run(args: argparse.Namespace) -> Dict[str, Any]:
    import torch
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.init()
    model, drafter, prompt, continuation = scale_run(args)
    block = drafter.config.block_size
    replay = ReplayDrafter(drafter, args.tau)
    replay.sequence = prompt.tolist() + continuation
    judged: List[float] = []

    def generate() -> List[int]:
        judged.clear()
        tokens = []
        steps = dflash_generate_step(
            prompt, model, replay, block_size=block, max_tokens=args.max_tokens
        )
        for token, _, from_draft in steps:
            tokens.append(token)
            if not from_draft:
                judged.append(time.perf_counter())
        return tokens

    generate()  # warm-up
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        start = time.perf_counter()
        tokens = generate()
        wall = time.perf_counter() - start
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as handle:
            trace = json.load(handle)
    kernels = kernel_intervals(trace)
    rounds = max(1, len(judged) - 1)
    # Keep the decode rounds: from the first judged round to the last one.
    decode_s = judged[-1] - judged[0] if len(judged) > 1 else wall
    first, last = kernels[0][1], kernels[-1][2]
    span = [(s, e) for _, s, e in kernels]
    busy, _ = union_busy(span)
    # The prefill is one long busy stretch at the start; measure the decode tail only.
    tail_start = last - 1e6 * decode_s
    tail = [(s, e) for s, e in span if s >= tail_start]
    tail_busy, tail_gaps = union_busy(tail)
    tail_kernels = [k for k in kernels if k[1] >= tail_start]
    report = {
        "environment": environment("python -m benchmarks.round_timeline"),
        "scale": args.scale,
        "quant": args.quant,
        "context": args.context,
        "tau": args.tau,
        "max_tokens": args.max_tokens,
        "lossless": tokens == continuation[: len(tokens)],
        "decode_rounds": rounds,
        "round_ms_wall": round(1e3 * decode_s / rounds, 3),
        "round_ms_device_busy": round(tail_busy / 1e3 / rounds, 3),
        "round_ms_device_idle": round((1e6 * decode_s - tail_busy) / 1e3 / rounds, 3),
        "kernels_per_round": round(len(tail_kernels) / rounds, 1),
        "largest_gaps_us": [round(g, 1) for g in sorted(tail_gaps, reverse=True)[:12]],
        "gaps_over_50us_per_round": round(
            sum(1 for g in tail_gaps if g > 50) / rounds, 2
        ),
        "idle_in_gaps_over_50us_ms_per_round": round(
            sum(g for g in tail_gaps if g > 50) / 1e3 / rounds, 3
        ),
        "median_gap_us": round(statistics.median(tail_gaps), 2) if tail_gaps else None,
        "whole_trace_busy_ms": round(busy / 1e3, 1),
        "whole_trace_span_ms": round((last - first) / 1e3, 1),
        "top_kernels_decode": top_kernels(tail_kernels, args.top),
    }
    return report


def main() -> None:
    parser = scale_parser("python -m benchmarks.round_timeline", "full", 4096, 160)
    parser.add_argument("--tau", type=int, default=6)
    parser.add_argument("--top", type=int, default=25)
    args = parser.parse_args()
    report = run(args)
    text = json.dumps(report, indent=1)
    print(text)
    if args.json:
        with open(args.json, "w") as handle:
            handle.write(text)


if __name__ == "__main__":
    main()
