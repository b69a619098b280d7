"""The DFlash round: one drafter forward drafts a block, one target forward verifies it.

Per round: the block ``[last committed token, mask, ..., mask]`` goes through the drafter,
which sees the target only through tapped hidden states of committed tokens; its ``B - 1``
proposals are verified by the target in one forward inside a ``SpeculativeCheckpoint``; the
kept rows are committed, and the drafter's context grows by the target features of exactly
those rows.
"""

import contextlib
import os
from typing import Any, Generator, Iterator, List, Optional, Tuple

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.generate import DEFAULT_QUANTIZED_KV_START, generation_stream

from .cache import PromptCache, check_prompt_cache, make_prompt_cache
from .cache.errors import IncompatibleCache
from .held_norms import held_norms
from .inputs import (
    ProgressCallback,
    Stream,
    as_prompt_array,
    check_cache_options,
    resolve_block_size,
)
from .kernel_patch import attention_route, dflash_settings, verify_kernels
from .metal.backend import resident_array, strict_switch
from .metal.layout import leading_view
from .pacing import RoundPacer, pacing_choice
from .rounds import VerifyRound, cache_room, emit_rounds, prefill
from .sampling import LogitsProcessor, Sampler, Sampling, log_normalize
from .stats import GenerationStats
from .taps import TargetTaps

EVAL_EVERY_ENV = "DFLASH_EVAL_EVERY"
# A verify forward's layers also start on the device every this many layers, not only
# at the taps (0: the taps only). Opt-in: on an H200 (session 37,
# docs/benchmarks/h200-2026-12-04-s37) every 4 layers made 4-bit rounds faster on one
# machine lease (15 of 18 alternated runs, medians 277-279 ms against 304-348) and slower
# on two others (7 of 24, medians 347-371 against 328-357): each start commits a graph,
# which costs a slow host more than the device's earlier start saves.
DEFAULT_EVAL_EVERY = 0


EVAL_TAIL_ENV = "DFLASH_EVAL_TAIL"


def eval_tail() -> bool:
    """Whether ``DFLASH_EVAL_EVERY`` paces only the verify forward's last two gaps
    between starts (:class:`TargetTaps`' ``eval_tail``; ``DFLASH_EVAL_TAIL``, default
    off). On Glimmer with its drafter's taps and every 4 that starts layers 41 and 45:
    faster in 7 of 11 runs on an H200 lease where every 4 throughout was slower
    (session 37, as a benchmark patch); not measured on other leases yet.

    Raises:
        ValueError: ``DFLASH_EVAL_TAIL`` is not an on/off value.
    """
    return strict_switch(EVAL_TAIL_ENV, None, default=False)


AUTO_EVAL_EVERY = 4
# ``DFLASH_EVAL_EVERY=auto`` paces every this many layers or not, as the process's first
# full rounds measure (``auto:N`` names another count).


def eval_pacing() -> Tuple[int, bool]:
    """How often the verify forward's layers are started on the device as they are
    built (:class:`TargetTaps`' ``eval_every``), and whether that pacing is chosen at
    run time (:mod:`dflash.pacing`): ``DFLASH_EVAL_EVERY`` as ``N``, ``auto`` (every
    :data:`AUTO_EVAL_EVERY`, chosen at run time) or ``auto:N``; unset
    :data:`DEFAULT_EVAL_EVERY`.

    Returns:
        ``(every, auto)``.

    Raises:
        ValueError: ``DFLASH_EVAL_EVERY`` is none of those forms (N a non-negative
            integer; positive after ``auto:``).
    """
    text = os.environ.get(EVAL_EVERY_ENV, "").strip().lower()
    if not text:
        return DEFAULT_EVAL_EVERY, False
    if text == "auto":
        return AUTO_EVAL_EVERY, True
    auto = text.startswith("auto:")
    count = text[len("auto:") :] if auto else text
    if not count.isdigit() or (auto and int(count) == 0):
        raise ValueError(
            f"{EVAL_EVERY_ENV} must be a non-negative layer count N, auto or auto:N "
            f"(N > 0), got {text!r}"
        )
    return int(count), auto


def eval_every() -> int:
    """The layer count of :func:`eval_pacing` (whether or not chosen at run time).

    Raises:
        ValueError: ``DFLASH_EVAL_EVERY`` is not a valid setting.
    """
    return eval_pacing()[0]


def round_pacer(
    model: nn.Module, drafter: nn.Module, taps: TargetTaps, block_size: int
) -> RoundPacer:
    """The pacer of a generation under ``DFLASH_EVAL_EVERY=auto``.

    The choice it feeds is kept on ``model`` per drafter, block size and ``DFLASH_*``
    settings (the kernel route and pacing switches change the round's host work).
    """
    key = (id(drafter), block_size, dflash_settings())
    return RoundPacer(taps, pacing_choice(model, key), block_size)


class DFlashRound(VerifyRound):
    """A verify round that also holds the target features of its block rows.

    Shapes:
        features: ``(1, k + 1, len(target_layer_ids) * H)``.
    """

    def __init__(self, model, cache, taps: TargetTaps, block, q, sampling):
        self.taps = taps
        super().__init__(model, cache, block, q, sampling)

    def after_forward(self) -> None:
        """Take the tapped target features of the block (lazy, like the logits)."""
        self.features = self.taps.pop()


class DFlashSpeculator:
    """Drafts with a DFlash drafter from the target features of committed tokens.

    One drafter forward drafts the whole block, so rounds keep it to the end
    (``full_blocks``, see :func:`~dflash.rounds.round_size`).

    Args:
        model: The target model.
        drafter: A drafter bound to ``model``.
        cache: The target's caches.
        context: The drafter's context, at the cache's position.
        taps: Taps on the target layers the drafter reads (attached).
        sampling: The generation's sampling state.
        pacer: Sets and times each round's pacing (``DFLASH_EVAL_EVERY=auto``), or
            ``None``.
    """

    full_blocks = True

    def __init__(
        self,
        model,
        drafter,
        cache,
        context,
        taps: TargetTaps,
        sampling,
        pacer: Optional[RoundPacer] = None,
    ):
        self.model = model
        self.drafter = drafter
        self.cache = cache
        self.context = context
        self.taps = taps
        self.sampling = sampling
        self.pacer = pacer
        # A settled round whose target rows are committed after the next draft is started.
        self.unsettled: Optional[Tuple[DFlashRound, int]] = None

    def prefill(self, tokens: mx.array, step: int, progress, total: int) -> None:
        """Write prompt tokens to the target's caches and their features to the context.

        Shapes:
            tokens: ``(T,)``.
        """

        def feed_drafter(count: int) -> None:
            start = self.cache[0].offset - count
            self.drafter.append_context(self.context, self.taps.pop(), start)

        prefill(self.model, self.cache, tokens, step, progress, total, feed_drafter)

    def draft(self, last: int, size: int) -> Tuple[mx.array, Optional[mx.array]]:
        """``size - 1`` drafts after ``last`` and, under rejection sampling, their ``q``.

        Without a candidate selector the greedy drafts are the argmax of
        ``drafter(block, context)[0, 1:]`` with ``block = [[last] + [mask] * (size - 1)]``
        (benchmarks replay chosen proposals by overriding ``__call__``).

        Returns:
            ``(drafts, q)``: ``(size - 1,)`` ``uint32`` device tokens and ``(size - 1, V)``
            log-distributions or ``None``; nothing is read back.
        """
        config = self.drafter.config
        # New ids every round: made without a page migration at the embedding (CUDA).
        ids = [last] + [config.mask_token_id] * (size - 1)
        block = resident_array(ids, mx.uint32)[None]
        if getattr(config, "has_candidate_selector", False):
            # DFlash2 re-ranks candidates given the previous pick: drafts are not a row argmax.
            proposal = self.drafter.propose(
                block, self.context, temperature=self.sampling.temperature
            )
            rejection = self.sampling.rejection
            q = mx.log(leading_view(proposal.probs, 0)) if rejection else None
            return leading_view(proposal.tokens, 0).astype(mx.uint32), q
        logprobs = log_normalize(self.drafter(block, self.context)[0, 1:])
        return self.sampling.propose(logprobs)

    def launch(self, last: int, size: int) -> DFlashRound:
        """Draft ``size - 1`` tokens and verify ``[last, drafts]``; nothing waits."""
        if self.pacer is not None:
            self.pacer.start_round(size)
        block, q = mx.array([last], mx.uint32), None
        try:
            if size > 1:
                drafts, q = self.draft(last, size)
                # The drafter runs while the host commits and builds the verify graph.
                mx.async_eval(drafts if q is None else [drafts, q])
                block = mx.concatenate([block, drafts])
        finally:
            self.commit_target()
        return DFlashRound(self.model, self.cache, self.taps, block, q, self.sampling)

    def settle(self, round_: DFlashRound, rows: int) -> None:
        """Keep ``rows`` block rows: the drafter's context now, the target's at launch.

        The drafter reads only its context, so the next draft can start before the
        target's commit; :meth:`launch` (or :meth:`close`) commits it right after.
        """
        self.commit_target()  # a round settled twice without a launch between
        features = round_.features[:, :rows]
        self.drafter.append_context(self.context, features, round_.position)
        # The append runs while the host builds the draft (session 37: 4-bit rounds
        # faster in 12 of 17 runs alternated with it not started; medians 0.86-1.00).
        mx.async_eval(self.context.buffers())
        self.sampling.extend(round_.block[:rows])
        self.unsettled = (round_, rows)

    def commit_target(self) -> None:
        """Commit the target rows of the last settled round, if not done yet."""
        if self.unsettled is not None:
            round_, rows = self.unsettled
            self.unsettled = None
            round_.keep(rows)

    def close(self) -> None:
        """Commit what :meth:`settle` left for the target's caches."""
        self.commit_target()

    def room(self) -> Optional[int]:
        """Rows the target's caches still take (None: no limit)."""
        return cache_room(self.cache)


def round_taps(model: nn.Module, drafter) -> Tuple[TargetTaps, bool]:
    """The drafter's taps on ``model`` as the rounds take them (started early, paced as
    ``DFLASH_EVAL_EVERY`` asks, read once so the taps and the pacer agree), and whether
    the pacing is chosen per round (``auto``)."""
    every, auto = eval_pacing()
    taps = TargetTaps(
        model,
        drafter.config.target_layer_ids,
        start_early=True,
        eval_every=every,
        eval_tail=eval_tail(),
    )
    return taps, auto


@contextlib.contextmanager
def round_context(model: nn.Module, drafter, taps: TargetTaps) -> Iterator[None]:
    """What a DFlash generation holds around its rounds, in this order: the verify
    kernels (before the taps: a tapped layer keeps mlx-lm's forward), the taps, the
    norms' ``1 + weight`` held and the folded block route (benchmarks that time a
    round's parts hold the same)."""
    with (
        verify_kernels(model, drafter),
        taps,
        held_norms(model, drafter),
        attention_route(model),
    ):
        yield


def session_context(drafter, prompt_cache) -> Any:
    """The drafter context that continues ``prompt_cache``'s session (made if it is new).

    A cache at position 0 without a context gets a fresh one, attached to it when it is a
    :class:`~dflash.cache.PromptCache` so the next turn continues it. A cache that already
    holds tokens must carry the context built alongside them.

    Args:
        drafter: The DFlash drafter.
        prompt_cache: The target's checked caches.

    Returns:
        The drafter context at the cache's position.
    """
    position = prompt_cache[0].offset if len(prompt_cache) else 0
    context = getattr(prompt_cache, "drafter_context", None)
    if context is None:
        if position != 0:
            raise ValueError(
                f"the prompt cache holds {position} tokens but no drafter context, so the "
                "drafter cannot see them: build it with "
                "dflash.make_prompt_cache(model, drafter=drafter) and use it for every turn"
            )
        context = drafter.make_context()
        if isinstance(prompt_cache, PromptCache):
            prompt_cache.drafter_context = context
    elif context.offset != position:
        raise IncompatibleCache(
            f"the prompt cache's drafter context is at position {context.offset} but its "
            f"target caches are at {position}: a turn ran without the drafter; rebuild the "
            "session with dflash.make_prompt_cache(model, drafter=drafter)"
        )
    return context


def dflash_generate_step(
    prompt: mx.array,
    model: nn.Module,
    drafter: nn.Module,
    stream: Stream = generation_stream,
    *,
    block_size: Optional[int] = None,
    max_tokens: int = 256,
    sampler: Optional[Sampler] = None,
    logits_processors: Optional[List[LogitsProcessor]] = None,
    prompt_cache: Optional[Any] = None,
    prefill_step_size: int = 2048,
    kv_bits: Optional[int] = None,
    kv_group_size: int = 64,
    quantized_kv_start: int = DEFAULT_QUANTIZED_KV_START,
    max_kv_size: Optional[int] = None,
    prompt_progress_callback: Optional[ProgressCallback] = None,
    max_context: Optional[int] = None,
    stats: Optional[GenerationStats] = None,
) -> Generator[Tuple[int, mx.array, bool], None, None]:
    """DFlash speculative decoding: lossless, one target forward per drafted block.

    Takes mlx-lm's ``speculative_generate_step`` arguments in the same order (the drafter in
    the draft model's place), with ``block_size`` instead of ``num_draft_tokens``.

    Args:
        prompt: The prompt tokens.
        model: The target mlx-lm model.
        drafter: A DFlash drafter bound to ``model`` (see ``dflash.load_drafter``).
        stream: The stream the generation runs on.
        block_size: Block size ``B`` (``B - 1`` drafts per round); default the drafter's.
        max_tokens: Tokens to generate (``-1``: no limit).
        sampler: ``None`` (greedy), ``dflash.make_sampler(...)`` (lossless rejection
            sampling at temperature > 0), or any mlx-lm sampler (lossless sample-match rule).
        logits_processors: Functions ``(tokens, logits) -> logits`` applied to the target.
        prompt_cache: The session to continue (``dflash.make_prompt_cache(model,
            drafter)``: the target's caches and the drafter's context, updated in place);
            built if ``None``. After the generation it holds the prompt and every yielded
            token, as mlx-lm's cache does, so the next turn passes only its new tokens.
        prefill_step_size: Prompt tokens per prefill forward.
        kv_bits: Must be ``None``: dflash caches are not quantized.
        kv_group_size: Unused (only with ``kv_bits``).
        quantized_kv_start: Unused (only with ``kv_bits``).
        max_kv_size: As in ``dflash.generate_step``.
        prompt_progress_callback: Called with ``(processed, total)`` prompt tokens.
        max_context: Context limit of a cache built here.
        stats: A :class:`GenerationStats` to fill in (rounds, τ, acceptance).

    Shapes:
        prompt: ``(P,)``.

    Yields:
        ``(token, logprobs, from_draft)`` as mlx-lm's speculative generator does.
    """
    block_size = resolve_block_size(block_size, drafter)
    check_cache_options(model, kv_bits, max_kv_size)
    prompt = as_prompt_array(prompt, model)
    if prompt_cache is None:
        prompt_cache = make_prompt_cache(model, drafter, max_context=max_context)
    check_prompt_cache(model, prompt_cache)
    context = session_context(drafter, prompt_cache)
    stats = stats if stats is not None else GenerationStats(block_size)
    stats.block_size = block_size
    progress = prompt_progress_callback or (lambda *_: None)
    sampling = Sampling(sampler, logits_processors, prompt[:-1])
    taps, auto = round_taps(model, drafter)
    pacer = round_pacer(model, drafter, taps, block_size) if auto else None
    with mx.stream(stream), round_context(model, drafter, taps):
        speculator = DFlashSpeculator(
            model, drafter, prompt_cache, context, taps, sampling, pacer
        )
        progress(0, prompt.size)
        speculator.prefill(prompt[:-1], prefill_step_size, progress, prompt.size)
        yield from emit_rounds(
            speculator,
            prompt[-1].item(),
            max_tokens,
            block_size,
            stats,
            lambda: progress(prompt.size, prompt.size),
        )
