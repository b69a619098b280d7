"""Pacing chosen at run time: whether a verify forward starts more layers than its taps.

A DFlash verify forward reaches the device where it is evaluated: at the drafter's taps,
at the round's end and, paced, every ``N`` layers (``DFLASH_EVAL_EVERY=N``). Pacing lets
the device follow the host's graph building more closely but costs the host a graph
commit per start, and which of the two wins depends on the machine: on H200 leases every
4 layers won 20 of 24 alternated 4-bit runs on one lease and 5 of 25 on another
(sessions 37-38, docs/verify-kernels-analysis.md). ``DFLASH_EVAL_EVERY=auto`` lets each
process find out: the first full rounds alternate the two arms (paced, not paced) in an
``ABBA`` order, each round's wall time is recorded, and once each arm has
:data:`SAMPLES_PER_ARM` rounds the arm with the lower median is kept for every later
round of that model, drafter and settings. Only when work starts changes, never the
values, so every arm gives the same tokens.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Hashable, List, Optional, Tuple

import mlx.nn as nn

# Rounds timed per arm before the choice is made (about two 96-token generations at
# tau = 6); a wrong choice costs a few percent, not correctness.
SAMPLES_PER_ARM = 12
# The first rounds of each generation are not timed: they may trace layers or compile
# kernels for shapes the process has not seen.
SKIPPED_PER_GENERATION = 2
# The exploring order, repeated: A B B A cancels a steady drift between the arms.
EXPLORE_ORDER = (False, True, True, False)

_STORE = "_dflash_pacing_choices"


@dataclass
class PacingChoice:
    """The run-time choice between pacing a verify forward and not, for one model setup.

    Attributes:
        seconds: Wall seconds of each timed full round, per arm (``True``: paced).
        paced: The chosen arm, ``None`` while exploring.
        launched: Rounds handed an exploring arm so far (the position in the order).
    """

    seconds: Dict[bool, List[float]] = field(
        default_factory=lambda: {False: [], True: []}
    )
    paced: Optional[bool] = None
    launched: int = 0

    def next_arm(self) -> bool:
        """The arm of the next round: the chosen one, else the next in the order."""
        if self.paced is not None:
            return self.paced
        arm = EXPLORE_ORDER[self.launched % len(EXPLORE_ORDER)]
        self.launched += 1
        return arm

    def observe(self, paced: bool, seconds: float) -> None:
        """Record one full round's wall time; choose once both arms have enough."""
        if self.paced is not None:
            return
        self.seconds[paced].append(seconds)
        if min(len(v) for v in self.seconds.values()) >= SAMPLES_PER_ARM:
            medians = self.medians()
            self.paced = medians[True] < medians[False]

    def medians(self) -> Dict[bool, Optional[float]]:
        """Median timed round (seconds) per arm, ``None`` for an arm not timed yet."""
        return {
            arm: statistics.median(v) if v else None for arm, v in self.seconds.items()
        }

    def summary(self) -> Dict[str, Any]:
        """The choice and its evidence, for reports (times in ms)."""
        medians = self.medians()
        return {
            "paced": self.paced,
            "rounds": {str(arm): len(v) for arm, v in self.seconds.items()},
            "median_ms": {
                str(arm): None if m is None else round(1000 * m, 2)
                for arm, m in medians.items()
            },
        }


def pacing_choice(model: nn.Module, key: Hashable) -> PacingChoice:
    """The choice kept on ``model`` for ``key`` (made when first asked).

    The choice lives in the model's instance dict, so it goes with the model. ``key``
    names what the round time depends on besides the machine (the drafter, block size,
    pacing and kernel settings).
    """
    choices = model.__dict__.setdefault(_STORE, {})
    if key not in choices:
        choices[key] = PacingChoice()
    return choices[key]


def pacing_choices(model: nn.Module) -> Dict[Hashable, PacingChoice]:
    """Every choice kept on ``model``, by key (empty when none)."""
    return dict(model.__dict__.get(_STORE, {}))


def forget_pacing(model: nn.Module) -> None:
    """Drop ``model``'s kept choices: the next ``auto`` generation explores again."""
    model.__dict__.pop(_STORE, None)


class RoundPacer:
    """Sets each round's arm on the taps and times the round for a :class:`PacingChoice`.

    One per generation. A round's wall time runs from its launch to the next launch, so
    it holds the round's draft and verify building, the host's wait for its result, the
    tokens' hand-over and its settle; only full blocks are timed (a last short round
    builds another graph).

    Args:
        taps: The generation's :class:`~dflash.taps.TargetTaps` (its ``paced`` is set).
        choice: The shared choice.
        block_size: The generation's block size (full rounds have this many rows).
        clock: Seconds, as ``time.perf_counter`` (tests hand a fake one).
    """

    def __init__(
        self,
        taps: Any,
        choice: PacingChoice,
        block_size: int,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.taps = taps
        self.clock = clock
        self.choice = choice
        self.block_size = block_size
        self.rounds = 0
        self.previous: Optional[Tuple[bool, int, float]] = None
        # The prefill runs with the chosen arm (unpaced while exploring); it is not timed:
        # timing starts at the first launch.
        taps.paced = bool(choice.paced)

    def start_round(self, size: int) -> None:
        """Close the previous round's timing and set the arm of a round of ``size`` rows."""
        now = self.clock()
        if self.previous is not None:
            arm, previous_size, started = self.previous
            self.rounds += 1
            if (
                previous_size == self.block_size
                and self.rounds > SKIPPED_PER_GENERATION
            ):
                self.choice.observe(arm, now - started)
        arm = self.choice.next_arm()
        self.taps.paced = arm
        self.previous = (arm, size, now)
