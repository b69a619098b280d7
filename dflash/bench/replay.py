"""REPLAY: a drafter whose forward runs for real but whose proposals follow a set profile.

Speed at scale is measured separately from drafter quality: the real drafter forward runs
every round (its logits stay in the graph), then its proposals are replaced by the target's
own greedy continuation cut to an acceptance profile: ``tau - 1`` right drafts, then a wrong
one, so every round commits exactly ``tau`` tokens when the loop is lossless.

Contract with the DFlash loop: for a drafter without a candidate selector, greedy drafts
are the argmax of ``drafter(block, context)[0, 1:]`` with the block's first token at
absolute position ``context.offset``.
"""

from typing import Any, Optional, Sequence

import mlx.core as mx

from ..drafter import DraftProposal
from .scale_target import replay_logits, replay_tokens


class ReplayDrafter:
    """Wraps a DFlash drafter; everything but the proposals is the drafter's own.

    Attributes:
        drafter: The wrapped drafter (run in full every round).
        tau: Tokens committed per round in the profile (``>= 1``).
        sequence: Prompt plus the target's greedy continuation; set before each run.
    """

    def __init__(self, drafter: Any, tau: int) -> None:
        """Wrap ``drafter`` with profile ``tau``.

        Args:
            drafter: A DFlash drafter bound to its target.
            tau: Tokens committed per round (``1 <= tau <= block size``).
        """
        if not 1 <= tau <= drafter.config.block_size:
            raise ValueError(
                f"a replay tau must be in 1..{drafter.config.block_size} (the drafter's "
                f"block size), got {tau}"
            )
        self.drafter = drafter
        self.tau = tau
        self.sequence: Optional[Sequence[int]] = None

    def __getattr__(self, name: str) -> Any:
        # Only reached for names this class does not define: config, contexts, taps.
        if name == "drafter":
            raise AttributeError(name)
        return getattr(self.drafter, name)

    def __call__(self, block_tokens: mx.array, context: Any) -> mx.array:
        """The real drafter logits, boosted so each row's argmax is the replay proposal.

        Args:
            block_tokens: ``[last committed token, mask, ...]``.
            context: The drafter context; its ``offset`` is the block's position.

        Returns:
            Logits whose rows ``1..`` pick the profile's drafts.

        Shapes:
            block_tokens: ``(1, B)``; returns ``(1, B, V)``.
        """
        if self.sequence is None:
            raise RuntimeError("ReplayDrafter.sequence is not set")
        real = self.drafter(block_tokens, context)
        drafts = replay_tokens(
            self.sequence,
            int(context.offset),
            block_tokens.shape[1] - 1,
            self.tau,
            real.shape[-1],
        )
        return replay_logits(real, drafts, first_row=1)

    def propose(
        self,
        block_tokens: mx.array,
        context: Any,
        temperature: float = 0.0,
        key: Optional[mx.array] = None,
    ) -> DraftProposal:
        """Greedy replay drafts for loops that ask for a proposal (never sampled).

        Args:
            block_tokens: ``[last committed token, mask, ...]``.
            context: The drafter context.
            temperature: Must be 0: a replay is a greedy profile.
            key: Unused.

        Returns:
            The replay drafts, ``probs`` ``None``.

        Shapes:
            block_tokens: ``(1, B)``; tokens ``(1, B - 1)``.
        """
        if temperature > 0:
            raise ValueError("a replay drafter proposes greedily (temperature 0)")
        logits = self(block_tokens, context)[:, 1:]
        return DraftProposal(mx.argmax(logits, axis=-1).astype(mx.int32), None)
