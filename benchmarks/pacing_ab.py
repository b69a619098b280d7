"""When a DFlash round's verify layers start on the device: pacing arms run by run.

A DFlash verify forward reaches the device where it is evaluated: at the drafter's taps
and at the round's end, or also every ``N`` layers (``DFLASH_EVAL_EVERY=N``), or every
``N`` layers in the last two gaps between starts only (with ``DFLASH_EVAL_TAIL=1``).
Which is fastest depends on the host (session 37: every 4 won on one H200 lease and lost
on two others), so arms are compared inside one process, alternated run by run (the
order reversed every other repetition), each against mlx-lm's plain decoding in the same
process. Both switches are read at each generation, so one process can alternate them.

Arms: ``0`` (the taps only), ``N`` (every N layers), ``Nt`` (every N in the tail),
``auto`` / ``autot`` (every 4 layers or the taps only, as :mod:`dflash.pacing` chooses
from the process's first rounds; its choice and evidence are reported). Any arm may be
given again under a copy label, ``ARM/LABEL`` (``0,4,4/b``): the same switches as a
separate arm, an A/A control whose spread against its original (``controls``: runs won
and median ratio) is what one process's noise alone gives. Every run is checked lossless
against the target's greedy continuation.

Run (from the repository root)::

    python -m benchmarks.pacing_ab --scale full --quant 4bit --context 4096 \\
        --tokens 96 --tau 6 --arms 0,4,auto,4/b --reps 6 --json docs/.../pacing.json
"""

from __future__ import annotations

import argparse
import re
import statistics
import time
from contextlib import contextmanager
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

from dflash import kernel_patch
from dflash.bench.report import environment
from dflash.bench.runs import plain_mode, replay_mode, timed_run
from dflash.dflash_round import EVAL_EVERY_ENV, EVAL_TAIL_ENV
from dflash.pacing import pacing_choices

from .common import (
    check_scale_run_args,
    scale_run_main,
    scale_run_parser,
    scale_run_setup,
)
from .round_profile import env_value

ARM_PATTERN = re.compile(r"(\d+|auto)(t?)(?:/(\w+))?")


def arm_setting(arm: str) -> str:
    """The switches an arm names: ``arm`` without its copy label (``4/b`` -> ``4``)."""
    return arm.split("/", 1)[0]


def parse_arms(text: str) -> List[str]:
    """A comma list of arms (``0``, ``N``, ``Nt``, ``auto``, ``autot``, each optionally
    ``/LABEL``, a copy for an A/A control), each once.

    Raises:
        argparse.ArgumentTypeError: an arm is not of that form, repeats, or is a copy
            of an arm not given.
    """
    arms = [arm.strip() for arm in text.split(",")]
    bad = [
        arm
        for arm in arms
        if not ARM_PATTERN.fullmatch(arm)
        or (arm_setting(arm)[:-1].isdigit() and int(arm_setting(arm)[:-1]) == 0)
    ]
    if bad:
        raise argparse.ArgumentTypeError(
            f"arms must be 0, N, Nt, auto or autot (N a layer count, Nt with N > 0), "
            f"each optionally /LABEL, got {bad}"
        )
    orphans = [a for a in arms if a != arm_setting(a) and arm_setting(a) not in arms]
    if orphans:
        raise argparse.ArgumentTypeError(
            f"a copy needs its original among the arms: {orphans}"
        )
    if len(set(arms)) != len(arms):
        raise argparse.ArgumentTypeError(f"an arm repeats in {arms}")
    return arms


@contextmanager
def arm_switches(arm: str) -> Iterator[None]:
    """``DFLASH_EVAL_EVERY`` / ``DFLASH_EVAL_TAIL`` set as ``arm`` says, then restored."""
    every, tail, _ = ARM_PATTERN.fullmatch(arm).groups()
    with (
        env_value(EVAL_EVERY_ENV, every),
        env_value(EVAL_TAIL_ENV, "1" if tail else "0"),
    ):
        yield


def wins_against_first(runs: Dict[str, List[float]], arms: Sequence[str]) -> Dict:
    """Per arm after the first: repetitions in which it was faster than the first arm."""
    first = runs[arms[0]]
    return {arm: sum(a < b for a, b in zip(runs[arm], first)) for arm in arms[1:]}


def controls(runs: Dict[str, List[float]], arms: Sequence[str]) -> Dict[str, Dict]:
    """Each copy against its original (an A/A pair): repetitions the copy was faster in,
    and the ratio of its median run to the original's."""
    pairs = {}
    for arm in arms:
        original = arm_setting(arm)
        if arm == original:
            continue
        mine, theirs = runs[arm], runs[original]
        pairs[f"{arm} vs {original}"] = {
            "wins": sum(a < b for a, b in zip(mine, theirs)),
            "runs": min(len(mine), len(theirs)),
            "median_ratio": round(
                statistics.median(mine) / statistics.median(theirs), 4
            ),
        }
    return pairs


def round_medians(round_ms: Dict[str, List[List[float]]]) -> Dict[str, Optional[float]]:
    """Per arm: the median round (ms) over every run, each run's first timed round left
    out as ``dflash.pacing`` leaves it out (whole runs keep the host's stalls; medians of
    rounds shed them, which is what a run-time rule sees)."""
    pooled = {
        arm: [ms for run in runs for ms in run[1:]] for arm, runs in round_ms.items()
    }
    return {arm: statistics.median(v) if v else None for arm, v in pooled.items()}


def rep_line(
    rep: int, report: Dict[str, Any], arms: Sequence[str], plain_ms: Optional[float]
) -> str:
    """One repetition's line: each arm's ms and whether its run was lossless, and
    mlx-lm's plain ms where this repetition ran it (a process its time limit stops
    before the summary still says how fast and whether lossless)."""
    shown = {arm: report["ms"][arm][-1] for arm in arms}
    lossless = all(report["lossless"][arm][-1] for arm in arms)
    plain = "" if plain_ms is None else f" plain {plain_ms}"
    return f"{rep} {shown}{plain} lossless {lossless}"


def run(args: argparse.Namespace, command: str) -> Dict[str, Any]:
    """Build the pair, then alternate the arms; the report (times in ms)."""
    started = time.time()
    target, drafter, prompt, tokens, sequence = scale_run_setup(args)
    plain = plain_mode(target)
    replay = replay_mode(target, drafter, args.block_size, args.tau)
    report: Dict[str, Any] = {
        "environment": environment(command),
        "arms": args.arms,
        "plain_ms": [],
        "ms": {arm: [] for arm in args.arms},
        "lossless": {arm: [] for arm in args.arms},
        "rounds": {arm: [] for arm in args.arms},
        "round_ms": {arm: [] for arm in args.arms},
    }

    def decode(arm: str) -> Tuple[float, bool, List[float]]:
        with arm_switches(arm):
            record = timed_run(replay, prompt, args.tokens, set(), sequence)
        lossless = list(record.tokens) == tokens
        return 1000 * record.decode_seconds, lossless, record.round_seconds

    # One held patch: each generation would otherwise install the kernels again.
    with kernel_patch.verify_kernels(target, drafter):
        for arm in args.arms:
            decode(arm)  # warm-up: traces and binds every shape
    for rep in range(args.reps):
        rep_plain_ms = None
        if rep % 2 == 0:
            record = timed_run(plain, prompt, args.tokens, set(), sequence)
            rep_plain_ms = round(1000 * record.decode_seconds, 1)
            report["plain_ms"].append(rep_plain_ms)
        order = args.arms if rep % 2 == 0 else args.arms[::-1]
        with kernel_patch.verify_kernels(target, drafter):
            for arm in order:
                ms, lossless, rounds = decode(arm)
                report["ms"][arm].append(round(ms, 1))
                report["lossless"][arm].append(lossless)
                report["rounds"][arm].append(len(rounds))
                report["round_ms"][arm].append([round(1000 * r, 2) for r in rounds])
        print(rep_line(rep, report, args.arms, rep_plain_ms), flush=True)
    plain_ms = statistics.median(report["plain_ms"])
    medians = {arm: statistics.median(v) for arm, v in report["ms"].items()}
    report["median_ms"] = medians
    report["x_plain"] = {arm: round(plain_ms / ms, 2) for arm, ms in medians.items()}
    report["wins_vs_first"] = wins_against_first(report["ms"], args.arms)
    report["controls"] = controls(report["ms"], args.arms)
    report["round_median_ms"] = round_medians(report["round_ms"])
    report["all_lossless"] = all(all(v) for v in report["lossless"].values())
    report["cuda_graphs"] = report["environment"]["cuda_graphs"]
    report["auto_choices"] = [c.summary() for c in pacing_choices(target).values()]
    report["total_s"] = round(time.time() - started, 1)
    return report


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    parser = scale_run_parser("python -m benchmarks.pacing_ab", tokens=32, reps=4)
    parser.add_argument("--arms", type=parse_arms, default=["0", "4", "4t"])
    return check_scale_run_args(parser, parser.parse_args(argv))


def main(argv: Optional[Sequence[str]] = None) -> None:
    keys = (
        "median_ms",
        "x_plain",
        "wins_vs_first",
        "controls",
        "round_median_ms",
        "all_lossless",
        "auto_choices",
        "cuda_graphs",
    )
    scale_run_main("benchmarks.pacing_ab", argv, parse_args, run, keys)


if __name__ == "__main__":
    main()
