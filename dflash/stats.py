"""What a generation reports about its rounds: τ, the acceptance histogram and curve."""

import time
from dataclasses import dataclass, field
from typing import List, Optional

from .verify.acceptance import acceptance_histogram


@dataclass
class GenerationStats:
    """Per-generation statistics of a speculative (or plain) run.

    Plain decoding counts each token as a round with no drafts (``block_size`` 1).

    Attributes:
        block_size: Block size ``B`` (``B - 1`` drafts per round).
        rounds: Verify forwards of the target after prefill.
        accepted: Drafts accepted in each round.
        synced_at: ``time.perf_counter()`` when each round's result reached the host; the
            differences are the wall time of a round inside the real loop.
        waited: Seconds the host waited for each round's result: the device time the host
            did not cover with work of its own (0 while the host is the bottleneck).
    """

    block_size: int
    rounds: int = 0
    accepted: List[int] = field(default_factory=list)
    synced_at: List[float] = field(default_factory=list)
    waited: List[float] = field(default_factory=list)

    @property
    def committed(self) -> int:
        """Tokens committed by the rounds (accepted drafts plus one target token each)."""
        return sum(self.accepted) + self.rounds

    @property
    def tau(self) -> float:
        """Mean tokens committed per round (DFlash's τ)."""
        return self.committed / self.rounds if self.rounds else 0.0

    @property
    def histogram(self) -> List[int]:
        """``histogram[n]``: rounds that accepted exactly ``n`` drafts."""
        return acceptance_histogram(self.accepted, self.block_size)

    @property
    def position_acceptance(self) -> List[float]:
        """Fraction of rounds whose draft at block position ``i`` (1-based) was accepted."""
        if not self.rounds:
            return [0.0] * (self.block_size - 1)
        return [
            sum(n >= i for n in self.accepted) / self.rounds
            for i in range(1, self.block_size)
        ]

    def record(self, accepted: int, waited_since: Optional[float] = None) -> None:
        """Count one round that kept ``accepted`` drafts.

        Args:
            accepted: Drafts the round kept.
            waited_since: ``time.perf_counter()`` when the host started waiting for the
                round (``None``: no timing).
        """
        self.rounds += 1
        self.accepted.append(accepted)
        if waited_since is not None:
            now = time.perf_counter()
            self.synced_at.append(now)
            self.waited.append(now - waited_since)
