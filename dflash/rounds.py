"""The speculative round, written once for DFlash and the classic draft model.

A *round* drafts up to ``B - 1`` tokens after the last committed token, runs the target once
over ``[last, d1 .. d_{B-1}]`` inside a :class:`~dflash.cache.SpeculativeCheckpoint`, judges
the drafts (:meth:`dflash.sampling.Sampling.accept`) and keeps the rows of what it emits. A
*speculator* (``dflash.dflash_round``, ``dflash.speculative``) supplies the drafting and
whatever it keeps beside the target's caches (the drafter's context, the draft model's
caches); :func:`emit_rounds` drives it and yields the tokens.
"""

import time
from typing import Any, Callable, Generator, List, Optional, Protocol, Sequence, Tuple

import mlx.core as mx
import mlx.nn as nn

from .cache import SpeculativeCheckpoint
from .inputs import ProgressCallback
from .metal.layout import leading_view
from .sampling import Sampling
from .stats import GenerationStats


def prefill(
    model: nn.Module,
    cache: Sequence[Any],
    tokens: mx.array,
    step: int,
    progress: Optional[ProgressCallback] = None,
    total: int = 0,
    after_chunk: Optional[Callable[[int], None]] = None,
) -> None:
    """Run ``tokens`` through ``model`` in chunks of ``step``, filling ``cache``.

    Args:
        model: The model.
        cache: Its caches.
        tokens: Prompt tokens to write.
        step: Tokens per forward.
        progress: Called with ``(processed, total)`` after each chunk.
        total: The prompt length reported to ``progress``.
        after_chunk: Called with the chunk's length after its forward (DFlash feeds the
            drafter the chunk's target features there).

    Shapes:
        tokens: ``(T,)``.
    """
    for first in range(0, tokens.size, step):
        chunk = tokens[first : first + step]
        model(chunk[None], cache=cache)
        if after_chunk is not None:
            after_chunk(chunk.size)
        mx.eval([c.state for c in cache])
        if progress is not None:
            progress(first + chunk.size, total)


class VerifyRound:
    """One verify forward of the target over ``[last, d1 .. dk]`` inside a checkpoint.

    The constructor builds the forward and the acceptance rule as one graph and starts it
    (``mx.async_eval``) without waiting: the drafts arrive as device arrays, and the host is
    free to build more while the device runs. :meth:`judge` is the round's one host sync.
    If building the graph raises, the checkpoint is rolled back.

    Args:
        model: The target model.
        cache: The target's caches.
        block: ``[last, d1 .. dk]`` (``last`` is not in the cache yet).
        q: The drafts' log-distributions under rejection sampling, else ``None``.
        sampling: The generation's sampling state.

    Shapes:
        block: ``(k + 1,)``; q: ``(k, V)``.

    Attributes:
        position: Absolute position of ``last``.
        logprobs: The target's processed ``(k + 1, V)`` log-probabilities.
        tokens: After :meth:`judge`, the emitted tokens (kept drafts, then the target's).
    """

    def __init__(
        self,
        model: nn.Module,
        cache: Sequence[Any],
        block: mx.array,
        q: Optional[mx.array],
        sampling: Sampling,
    ):
        self.position = cache[0].offset
        self.block = block
        self.tokens: Optional[List[int]] = None
        self.checkpoint = SpeculativeCheckpoint.begin(cache, block.shape[0])
        try:
            logits = leading_view(model(block[None], cache=cache), 0)
            self.after_forward()
            self.packed, self.logprobs = sampling.accept(logits, block, q)
        except BaseException:
            self.checkpoint.rollback()
            raise
        mx.async_eval(self.packed, self.logprobs)

    def after_forward(self) -> None:
        """Collect what the forward produced besides logits (nothing here)."""

    def judge(self) -> Tuple[int, List[int], mx.array]:
        """Wait for the round: ``(accepted, tokens to emit, target log-probabilities)``."""
        values = self.packed.tolist()  # the round's one host sync
        accepted = values[0]
        self.tokens = values[1 : accepted + 2]
        return accepted, self.tokens, self.logprobs

    def keep(self, rows: int) -> None:
        """Commit the block's first ``rows`` rows (``rows >= 1``: ``last`` and kept drafts)."""
        self.checkpoint.commit(rows)


class Speculator(Protocol):
    """Drafts and verifies rounds for :func:`emit_rounds`.

    Attributes:
        full_blocks: Drafting a whole block costs what drafting fewer rows does (one
            drafter forward), so rounds near ``max_tokens`` keep the full block (see
            :func:`round_size`), bounded by :meth:`room`. A draft model pays per
            draft: False.
    """

    full_blocks: bool

    def launch(self, last: int, size: int) -> Any:
        """Draft ``size - 1`` tokens after ``last`` and verify ``[last, drafts]``."""

    def settle(self, round_: Any, rows: int) -> None:
        """Keep the round's first ``rows`` block rows in every cache; close the round."""

    def close(self) -> None:
        """Bring every cache beside the target's to the target's position."""

    def room(self) -> Optional[int]:
        """Rows the target's caches still take (None: no limit); asked when
        ``full_blocks``."""


def round_size(
    block_size: int,
    max_tokens: int,
    emitted: int,
    full: bool = False,
    room: Optional[int] = None,
) -> int:
    """Block rows of the next round: ``block_size``, or fewer near ``max_tokens``.

    With ``n`` tokens left to emit a round needs at most ``n`` drafts: if all are accepted
    the generation ends on the last draft (the target's token after it is never emitted);
    with none left (``n = 0``) the round only writes ``last``, the final emitted token.

    A ``full`` round keeps ``block_size`` rows while the caches have ``room`` for them:
    its rows past the emitted ones are rolled back as a rejected draft's are, so the
    caches end as they would have. Every round then has one shape, and none near the
    end traces or binds new forwards (on an H200 the three shrinking tail rounds of a
    96-token generation took 42-77 ms against 20, session 28).

    Args:
        block_size: The largest block.
        max_tokens: Tokens the generation emits (``-1``: no limit).
        emitted: Tokens emitted so far, ``last`` included.
        full: Keep the whole block where the caches have room.
        room: Rows the target's caches still take (None: no limit).

    Returns:
        The next round's block size, at least 1.
    """
    if max_tokens < 0:
        return block_size
    needed = max(1, min(block_size, max_tokens - emitted + 1))
    if not full:
        return needed
    return block_size if room is None else max(needed, min(block_size, room))


def cache_room(cache: Sequence[Any]) -> Optional[int]:
    """Rows every layer cache of ``cache`` still takes before its ``max_context``.

    Returns:
        The smallest room, or None when no layer cache has a limit.
    """
    rooms = [
        layer.max_context - layer.offset
        for layer in cache
        if getattr(layer, "max_context", None) is not None
    ]
    return min(rooms) if rooms else None


def _next_size(
    speculator: Speculator, block_size: int, max_tokens: int, emitted: int
) -> int:
    """:func:`round_size` of the next round for ``speculator``."""
    full = speculator.full_blocks
    room = speculator.room() if full else None
    return round_size(block_size, max_tokens, emitted, full, room)


def emit_rounds(
    speculator: Speculator,
    last: int,
    max_tokens: int,
    block_size: int,
    stats: GenerationStats,
    on_first_token: Callable[[], None],
) -> Generator[Tuple[int, mx.array, bool], None, None]:
    """Run rounds until ``max_tokens`` tokens are emitted (``-1``: forever).

    The caches follow mlx-lm's ``generate_step``: when a token is yielded it is already in
    the caches, and whenever the generation ends (``max_tokens``, or the consumer closing it
    after any token, e.g. at an end-of-sequence token) they hold exactly the prompt and every
    yielded token, nothing more. So a round's checkpoint stays open while its accepted drafts
    are yielded (closing after ``k`` of them keeps ``1 + k`` rows), and the next round, whose
    block starts with the target's own token, is launched before that token is yielded
    (closing then keeps that one row).

    Args:
        speculator: The drafting side.
        last: The last prompt token (the first round's block starts with it).
        max_tokens: Tokens to emit.
        block_size: Most rows a round verifies.
        stats: Filled with each judged round's accepted count and sync timing.
        on_first_token: Called once the first token is known.

    Yields:
        ``(token, logprobs, from_draft)``.
    """
    emitted = 0
    live, kept = None, 0  # the round whose checkpoint is open; its rows already yielded
    try:
        size = _next_size(speculator, block_size, max_tokens, 0)
        live, kept = speculator.launch(last, size), 1
        if max_tokens == 0:
            # As mlx-lm's generators: the whole prompt is written, nothing is emitted.
            on_first_token()
            return
        while True:
            started = time.perf_counter()
            accepted, tokens, logprobs = live.judge()
            # A full block near the end may accept more drafts than are emitted.
            left = max_tokens - emitted if max_tokens >= 0 else accepted
            stats.record(min(accepted, left), started)
            if emitted == 0:
                on_first_token()
            for index in range(accepted):
                kept, emitted = kept + 1, emitted + 1
                yield tokens[index], logprobs[index], True
                if emitted == max_tokens:
                    return
            speculator.settle(live, kept)
            live, emitted = None, emitted + 1
            size = _next_size(speculator, block_size, max_tokens, emitted)
            live, kept = speculator.launch(tokens[accepted], size), 1
            yield tokens[accepted], logprobs[accepted], False
            if emitted == max_tokens:
                return
    finally:
        if live is not None:
            speculator.settle(live, kept)
        speculator.close()
