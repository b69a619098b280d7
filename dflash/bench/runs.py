"""Benchmark modes and one timed run of a mode.

Every mode is a generator at the level of ``generate_step``: no detokenizing, greedy.

* ``plain``: mlx-lm's own ``generate_step`` on mlx-lm's own cache (the yardstick).
* ``dflash``: ``dflash.dflash_generate_step`` with the real drafter.
* ``classic``: ``dflash.speculative_generate_step`` with ``--draft-model``.
* ``mlx-spec``: mlx-lm's own ``speculative_generate_step`` with ``--draft-model`` (its cache
  trim is not exact on sliding-window rings, so it may diverge there: reported, not hidden).
* ``replay-tauN``: DFlash with a :class:`ReplayDrafter` (REPLAY, profile ``tau = N``).

Timing rule (the same for every mode). A run yields ``(token, ..., from_draft)``; a token
with ``from_draft`` false ends a round (plain decoding: every token). The first round
carries the prefill, so decode speed is the tokens after the first round divided by the
time from the end of the first round to the last token. The per-token bookkeeping is an
append and, once a round, a clock read.
"""

import time
from dataclasses import dataclass, field
from typing import Any, Callable, Collection, Iterator, List, Optional, Sequence

import mlx.core as mx
import mlx.nn as nn

from .. import dflash_generate_step, speculative_generate_step
from ..greedy import mlx_lm_generate_module
from .replay import ReplayDrafter

PLAIN, DFLASH, CLASSIC, MLX_SPEC = "plain", "dflash", "classic", "mlx-spec"
BASE_MODES = (PLAIN, DFLASH, CLASSIC, MLX_SPEC)
NEEDS_DRAFT_MODEL = (CLASSIC, MLX_SPEC)
REPLAY_PREFIX = "replay-tau"

Steps = Callable[[mx.array, int], Iterator]


def replay_name(tau: int) -> str:
    """The mode name of replay profile ``tau``."""
    return f"{REPLAY_PREFIX}{tau}"


@dataclass
class Mode:
    """One way of generating, benchmarked side by side with the others.

    Attributes:
        name: Short name (``plain``, ``dflash``, ``classic``, ``mlx-spec``, ``replay-tauN``).
        label: What it is, as printed.
        steps: ``steps(prompt, max_tokens)`` returns a fresh generator.
        drafts_per_round: Most drafts a round verifies (0 for plain decoding).
        replay: The replay drafter whose ``sequence`` is set before each run, if any.
        tolerate_errors: An exception is reported as the mode's result instead of raised.
    """

    name: str
    label: str
    steps: Steps
    drafts_per_round: int = 0
    replay: Optional[ReplayDrafter] = None
    tolerate_errors: bool = False

    @property
    def speculative(self) -> bool:
        """Whether rounds verify drafts (τ and acceptance are meaningful)."""
        return self.drafts_per_round > 0


def plain_mode(model: nn.Module) -> Mode:
    """mlx-lm's ``generate_step`` with mlx-lm's cache and its default (argmax) sampler."""
    generate = mlx_lm_generate_module()

    def steps(prompt: mx.array, max_tokens: int) -> Iterator:
        from mlx_lm.models.cache import make_prompt_cache

        cache = make_prompt_cache(model)
        return generate.generate_step(
            prompt, model, max_tokens=max_tokens, prompt_cache=cache
        )

    return Mode(PLAIN, "plain decoding (mlx-lm generate_step)", steps)


def dflash_mode(model: nn.Module, drafter: Any, block_size: int) -> Mode:
    """DFlash with the real drafter."""

    def steps(prompt: mx.array, max_tokens: int) -> Iterator:
        return dflash_generate_step(
            prompt, model, drafter, block_size=block_size, max_tokens=max_tokens
        )

    return Mode(DFLASH, f"DFlash, block {block_size}", steps, block_size - 1)


def replay_mode(model: nn.Module, drafter: Any, block_size: int, tau: int) -> Mode:
    """DFlash whose drafter forward runs for real and whose proposals follow ``tau``."""
    replay = ReplayDrafter(drafter, tau)

    def steps(prompt: mx.array, max_tokens: int) -> Iterator:
        return dflash_generate_step(
            prompt, model, replay, block_size=block_size, max_tokens=max_tokens
        )

    label = f"REPLAY tau={tau}: real drafter forward, replayed proposals, block {block_size}"
    return Mode(replay_name(tau), label, steps, block_size - 1, replay=replay)


def classic_mode(model: nn.Module, draft_model: nn.Module, num_draft: int) -> Mode:
    """dflash's speculative decoding with a draft model."""

    def steps(prompt: mx.array, max_tokens: int) -> Iterator:
        return speculative_generate_step(
            prompt,
            model,
            draft_model,
            num_draft_tokens=num_draft,
            max_tokens=max_tokens,
        )

    label = (
        f"classic draft model, {num_draft} drafts (dflash speculative_generate_step)"
    )
    return Mode(CLASSIC, label, steps, num_draft)


def mlx_spec_mode(model: nn.Module, draft_model: nn.Module, num_draft: int) -> Mode:
    """mlx-lm's own speculative decoding (its caches, its trim)."""
    generate = mlx_lm_generate_module()

    def steps(prompt: mx.array, max_tokens: int) -> Iterator:
        return generate.speculative_generate_step(
            prompt,
            model,
            draft_model,
            num_draft_tokens=num_draft,
            max_tokens=max_tokens,
        )

    label = f"mlx-lm speculative_generate_step, {num_draft} drafts"
    return Mode(MLX_SPEC, label, steps, num_draft, tolerate_errors=True)


@dataclass
class RunRecord:
    """One timed run of one mode on one prompt.

    Attributes:
        tokens: Generated tokens (ending after a stop token or at ``max_tokens``).
        drafted: ``from_draft`` of each token.
        round_ends: Clock at each round-ending token.
        start: Clock before the generator was first resumed.
        end: Clock after the last token.
        peak_memory: ``mx.get_peak_memory()`` after the run (reset before it).
        prefill_rounds: Leading rounds that drafted nothing by design (a loop whose first
            response is the prefill's own token); left out of τ and acceptance.
    """

    tokens: List[int]
    drafted: List[bool]
    round_ends: List[float]
    start: float
    end: float
    peak_memory: int = 0
    prefill_rounds: int = 0
    accepted: List[int] = field(init=False)

    def __post_init__(self) -> None:
        self.accepted = accepted_per_round(self.drafted)

    @property
    def first_round_tokens(self) -> int:
        """Tokens the first round (which carries the prefill) committed."""
        return self.accepted[0] + 1 if self.round_ends else len(self.tokens)

    @property
    def decode_tokens(self) -> int:
        """Tokens committed after the first round."""
        return len(self.tokens) - self.first_round_tokens

    @property
    def decode_seconds(self) -> float:
        """Time from the end of the first round to the last token."""
        return self.end - self.round_ends[0] if self.round_ends else 0.0

    @property
    def round_seconds(self) -> List[float]:
        """Duration of each complete round after the first."""
        ends = self.round_ends
        return [b - a for a, b in zip(ends, ends[1:])]


def accepted_per_round(drafted: Sequence[bool]) -> List[int]:
    """Accepted drafts of each round from the ``from_draft`` flags.

    A round is its accepted drafts followed by the target's own token; a trailing run of
    drafts (a round cut by ``max_tokens``) counts as a round of that many.

    Args:
        drafted: ``from_draft`` of each yielded token.

    Returns:
        Accepted drafts per round.
    """
    out, run = [], 0
    for flag in drafted:
        if flag:
            run += 1
        else:
            out.append(run)
            run = 0
    if run:
        out.append(run)
    return out


def consume(steps: Iterator, max_tokens: int, stop: Collection[int]):
    """Drain a generator the way the bench times it (the bench's per-token bookkeeping).

    Args:
        steps: Yields ``(token, logprobs)`` or ``(token, logprobs, from_draft)``.
        max_tokens: Stop after this many tokens.
        stop: Stop after a token in this set (it is kept).

    Returns:
        ``(tokens, drafted, round_ends, start, end)``.
    """
    clock = time.perf_counter
    tokens, drafted, round_ends = [], [], []
    start = clock()
    for item in steps:
        token = item[0]
        tokens.append(token)
        from_draft = len(item) > 2 and item[2]
        drafted.append(from_draft)
        if not from_draft:
            round_ends.append(clock())
        if len(tokens) >= max_tokens or token in stop:
            break
    end = clock()
    return tokens, drafted, round_ends, start, end


def close(steps: Iterator) -> None:
    """Close a generator left mid-way (its ``finally`` blocks run now, untimed)."""
    closer = getattr(steps, "close", None)
    if closer is not None:
        closer()


def timed_run(
    mode: Mode,
    prompt: mx.array,
    max_tokens: int,
    stop: Collection[int],
    sequence: Optional[Sequence[int]] = None,
) -> RunRecord:
    """Run ``mode`` once on ``prompt``, timing it and measuring its peak memory.

    Args:
        mode: The mode.
        prompt: Prompt tokens.
        max_tokens: Tokens to generate at most.
        stop: Stop tokens.
        sequence: Prompt plus the target's greedy continuation (for a replay mode).

    Returns:
        The record.

    Shapes:
        prompt: ``(P,)``.
    """
    if mode.replay is not None:
        mode.replay.sequence = sequence
    mx.synchronize()
    mx.clear_cache()
    mx.reset_peak_memory()
    steps = mode.steps(prompt, max_tokens)
    try:
        tokens, drafted, ends, start, end = consume(steps, max_tokens, stop)
    finally:
        close(steps)
    mx.synchronize()
    record = RunRecord([int(t) for t in tokens], drafted, ends, start, end)
    record.peak_memory = mx.get_peak_memory()
    return record
