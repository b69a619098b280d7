"""What a generation pays to trace its layers again: kept traces on and off, run by run.

Every generation installs the kernel patch and uninstalls it at its end. Before session
38 the uninstall dropped the traced layers' traces, so each generation (each chat turn)
traced all of them again at its first verify block and its first one-row step. Now the
next install with the same options takes them back (``DFLASH_KEEP_TRACES``, default
on). Each arm runs ``--runs`` generations in a row (the first of an arm after the other
arm traces in both); the later ones are what a user's later turns cost. Our plain
decoding (``dflash.generate_step``) and DFlash rounds (replayed at ``--tau``) are timed
alike; every run is checked lossless against the target's greedy continuation.

Run (from the repository root)::

    python -m benchmarks.kept_traces --scale full --quant 4bit --context 1024 \\
        --tokens 32 --reps 3 --json docs/.../kept_traces.json
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any, Dict, Iterator, List, Optional, Sequence

import mlx.core as mx

from dflash.bench.report import environment
from dflash.bench.runs import Mode, replay_mode, timed_run
from dflash.generation import generate_step
from dflash.kernel_patch import KEEP_TRACES_ENV

from .common import (
    check_scale_run_args,
    scale_run_main,
    scale_run_parser,
    scale_run_setup,
)
from .round_profile import env_value

ARMS = ("keep", "drop")


def our_plain_mode(model: Any) -> Mode:
    """Our plain decoding (the kernel patch installed for the generation)."""

    def steps(prompt: mx.array, max_tokens: int) -> Iterator:
        return generate_step(prompt, model, max_tokens=max_tokens)

    return Mode("ours-plain", "dflash.generate_step", steps, 0)


def run(args: argparse.Namespace, command: str) -> Dict[str, Any]:
    """Build the pair, then alternate the arms; the report (times in ms)."""
    started = time.time()
    target, drafter, prompt, tokens, sequence = scale_run_setup(args)
    modes = {
        "plain": our_plain_mode(target),
        "dflash": replay_mode(target, drafter, args.block_size, args.tau),
    }
    report: Dict[str, Any] = {
        "environment": environment(command),
        "ms": {m: {arm: [] for arm in ARMS} for m in modes},
        "lossless": {m: True for m in modes},
    }
    for rep in range(args.reps):
        for name, mode in modes.items():
            order = ARMS if rep % 2 == 0 else ARMS[::-1]
            for arm in order:
                with env_value(KEEP_TRACES_ENV, "1" if arm == "keep" else "0"):
                    runs: List[float] = []
                    for _ in range(args.runs):
                        record = timed_run(mode, prompt, args.tokens, set(), sequence)
                        runs.append(round(1000 * (record.end - record.start), 1))
                        report["lossless"][name] &= list(record.tokens) == tokens
                report["ms"][name][arm].append(runs)
            print(rep, name, {a: report["ms"][name][a][-1] for a in ARMS}, flush=True)
    # The later runs of each arm: what a later turn costs.
    report["median_later_ms"] = {
        name: {
            arm: statistics.median(ms for runs in by_arm[arm] for ms in runs[1:])
            for arm in ARMS
        }
        for name, by_arm in report["ms"].items()
    }
    report["total_s"] = round(time.time() - started, 1)
    return report


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    parser = scale_run_parser("python -m benchmarks.kept_traces", tokens=16, reps=3)
    parser.add_argument("--runs", type=int, default=2, help="generations an arm")
    args = check_scale_run_args(parser, parser.parse_args(argv))
    if args.runs < 2:
        parser.error("--runs must be at least 2 (the first of an arm traces in both)")
    return args


def main(argv: Optional[Sequence[str]] = None) -> None:
    keys = ("median_later_ms", "lossless")
    scale_run_main("benchmarks.kept_traces", argv, parse_args, run, keys)


if __name__ == "__main__":
    main()
