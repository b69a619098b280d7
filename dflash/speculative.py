"""Classic speculative decoding with a draft model, exact on sliding-window models.

Each round the draft model proposes tokens one at a time (its own writes inside a
``SpeculativeCheckpoint``), the target verifies ``[last, drafts]`` in one forward inside
another, and both caches keep exactly the rows of what is emitted.
"""

from typing import Any, Generator, List, Optional, Tuple

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.generate import DEFAULT_QUANTIZED_KV_START, generation_stream

from .cache import SpeculativeCheckpoint, check_prompt_cache, make_prompt_cache
from .cache.errors import IncompatibleCache
from .held_norms import held_norms
from .inputs import ProgressCallback, Stream, as_prompt_array, check_cache_options
from .kernel_patch import attention_route, verify_kernels
from .rounds import VerifyRound, emit_rounds, prefill
from .sampling import LogitsProcessor, Sampler, Sampling
from .stats import GenerationStats


class DraftRound(VerifyRound):
    """A verify round plus the draft model's checkpoint over its own writes.

    Attributes:
        feed: Tokens the draft model wrote first (its pending tokens, then ``last``).
        draft_checkpoint: The draft caches' checkpoint (``None`` when nothing was drafted).
    """

    def __init__(self, model, cache, block, q, sampling, feed, draft_checkpoint):
        self.feed = feed
        self.draft_checkpoint = draft_checkpoint
        try:
            super().__init__(model, cache, block, q, sampling)
        except BaseException:
            if draft_checkpoint is not None:
                draft_checkpoint.rollback()
            raise


class DraftModelSpeculator:
    """Drafts autoregressively with a small model that shares the target's tokenizer.

    Args:
        model: The target model.
        draft_model: The draft model.
        target_cache: The target's caches.
        draft_cache: The draft model's caches, at the same position.
        sampling: The generation's sampling state.

    Attributes:
        pending: Committed tokens the draft caches have not seen yet (before ``last``).
    """

    # Each draft is a forward of its own: rounds near the end draft only what they can
    # emit (rounds.round_size).
    full_blocks = False

    def __init__(self, model, draft_model, target_cache, draft_cache, sampling):
        self.model = model
        self.draft_model = draft_model
        self.target_cache = target_cache
        self.draft_cache = draft_cache
        self.sampling = sampling
        self.pending: List[int] = []

    def draft(self, feed: List[int], count: int) -> Tuple[mx.array, Optional[mx.array]]:
        """Draft ``count`` tokens after ``feed`` (written to the draft caches first).

        Each draft token feeds the next step as a device array; nothing is read back.

        Returns:
            ``(drafts, q)``: ``(count,)`` ``uint32`` tokens and, under rejection sampling,
            their ``(count, V)`` log-distributions.
        """
        inputs = mx.array(feed, mx.uint32)
        seen = inputs[-1:]
        tokens, qs = [], []
        for _ in range(count):
            logits = self.draft_model(inputs[None], cache=self.draft_cache)[0, -1:]
            logprobs = self.sampling.processed_logprobs(logits, seen)
            token, q = self.sampling.propose(logprobs)
            # The device runs this step while the host builds the next one.
            mx.async_eval(token)
            tokens.append(token)
            qs.extend([] if q is None else [q])
            inputs = token
            seen = mx.concatenate([seen, token]) if self.sampling.processors else seen
        return mx.concatenate(tokens), mx.concatenate(qs) if qs else None

    def launch(self, last: int, size: int) -> DraftRound:
        """Draft ``size - 1`` tokens and verify ``[last, drafts]``; nothing waits."""
        feed, count, block = (
            self.pending + [last],
            size - 1,
            mx.array([last], mx.uint32),
        )
        if count == 0:
            return DraftRound(
                self.model, self.target_cache, block, None, self.sampling, feed, None
            )
        # The draft writes its pending tokens, then count - 1 of its own drafts.
        checkpoint = SpeculativeCheckpoint.begin(
            self.draft_cache, len(feed) + count - 1
        )
        try:
            drafts, q = self.draft(feed, count)
        except BaseException:
            checkpoint.rollback()
            raise
        block = mx.concatenate([block, drafts])
        return DraftRound(
            self.model, self.target_cache, block, q, self.sampling, feed, checkpoint
        )

    def settle(self, round_: DraftRound, rows: int) -> None:
        """Keep ``rows`` block rows in the target and the matching rows in the draft."""
        round_.keep(rows)
        kept, count = rows - 1, round_.block.shape[0] - 1
        if round_.draft_checkpoint is None:
            self.pending = round_.feed
        else:
            round_.draft_checkpoint.commit(len(round_.feed) + min(kept, count - 1))
            # The last draft is never written by the draft model: keep it pending. All
            # drafts were kept, so the round was judged and its tokens are on the host.
            self.pending = round_.tokens[count - 1 : count] if kept == count else []
        self.sampling.extend(round_.block[:rows])

    def close(self) -> None:
        """Write the pending tokens to the draft caches: both caches end at one position."""
        if self.pending:
            tokens = mx.array(self.pending, mx.uint32)[None]
            self.draft_model(tokens, cache=self.draft_cache)
            self.pending = []


def speculative_generate_step(
    prompt: mx.array,
    model: nn.Module,
    draft_model: nn.Module,
    stream: Stream = generation_stream,
    *,
    num_draft_tokens: int = 2,
    max_tokens: int = 256,
    sampler: Optional[Sampler] = None,
    logits_processors: Optional[List[LogitsProcessor]] = None,
    prompt_cache: Optional[Any] = None,
    prefill_step_size: int = 512,
    kv_bits: Optional[int] = None,
    kv_group_size: int = 64,
    quantized_kv_start: int = DEFAULT_QUANTIZED_KV_START,
    max_kv_size: Optional[int] = None,
    prompt_progress_callback: Optional[ProgressCallback] = None,
    max_context: Optional[int] = None,
    stats: Optional[GenerationStats] = None,
) -> Generator[Tuple[int, mx.array, bool], None, None]:
    """Speculative decoding with a draft model, exact on sliding-window models.

    mlx-lm's ``speculative_generate_step`` arguments in mlx-lm's order, plus
    ``max_kv_size`` / ``prompt_progress_callback`` (as ``dflash.generate_step``),
    ``max_context`` and ``stats``. Each round the draft model proposes ``num_draft_tokens``
    tokens; the target verifies ``[last token, drafts...]`` in one forward inside a
    ``SpeculativeCheckpoint`` and keeps the drafts its acceptance rule accepts (the longest
    prefix equal to its own samples, or lossless rejection sampling with
    ``dflash.make_sampler`` at temperature > 0) plus its own next token, committing exactly
    those rows in both caches. The output is distributed as the target's own (at temperature
    0, equal to its greedy output).

    Args:
        prompt: The prompt tokens.
        model: The target model.
        draft_model: The draft model (same tokenizer).
        stream: The stream the generation runs on.
        num_draft_tokens: Draft tokens per round (``>= 0``).
        max_tokens: Tokens to generate (``-1``: no limit).
        sampler: Picks a token from log-probabilities (default greedy).
        logits_processors: Functions ``(tokens, logits) -> logits``.
        prompt_cache: The target's dflash caches followed by the draft model's, updated in
            place; built if ``None``. After the generation both hold the prompt and every
            yielded token (mlx-lm's plain ``generate_step`` semantics), at one position.
        prefill_step_size: Prompt tokens per prefill forward.
        kv_bits: Must be ``None``: dflash caches are not quantized.
        kv_group_size: Unused (only with ``kv_bits``).
        quantized_kv_start: Unused (only with ``kv_bits``).
        max_kv_size: As in ``dflash.generate_step``.
        prompt_progress_callback: Called with ``(processed, total)`` prompt tokens.
        max_context: Context limit of caches built here.
        stats: A :class:`GenerationStats` to fill in (rounds and accepted drafts).

    Shapes:
        prompt: ``(P,)``.

    Yields:
        ``(token, logprobs, from_draft)``: a token id, the target's ``(V,)`` log-probabilities
        for it, and whether it was an accepted draft token.
    """
    if num_draft_tokens < 0:
        raise ValueError(f"num_draft_tokens must be >= 0, got {num_draft_tokens}")
    check_cache_options(model, kv_bits, max_kv_size)
    check_cache_options(draft_model, None, max_kv_size)
    prompt = as_prompt_array(prompt, model, draft_model)
    if prompt_cache is None:
        target_cache = make_prompt_cache(model, max_context=max_context)
        draft_cache = make_prompt_cache(draft_model, max_context=max_context)
    else:
        target_cache = prompt_cache[: len(model.layers)]
        draft_cache = prompt_cache[len(model.layers) :]
    start = check_prompt_cache(model, target_cache, "target")
    if check_prompt_cache(draft_model, draft_cache, "draft") != start:
        raise IncompatibleCache(
            "the target and draft prompt caches are at different positions"
        )
    stats = stats if stats is not None else GenerationStats(num_draft_tokens + 1)
    stats.block_size = num_draft_tokens + 1
    progress = prompt_progress_callback or (lambda *_: None)
    sampling = Sampling(sampler, logits_processors, prompt[:-1])
    speculator = DraftModelSpeculator(
        model, draft_model, target_cache, draft_cache, sampling
    )
    # The target's verify kernels as our plain decoding installs them (the same bits).
    with (
        mx.stream(stream),
        verify_kernels(model),
        attention_route(model),
        held_norms(model, draft_model),
    ):
        progress(0, prompt.size)
        prefill(
            model, target_cache, prompt[:-1], prefill_step_size, progress, prompt.size
        )
        prefill(draft_model, draft_cache, prompt[:-1], prefill_step_size)
        yield from emit_rounds(
            speculator,
            prompt[-1].item(),
            max_tokens,
            num_draft_tokens + 1,
            stats,
            lambda: progress(prompt.size, prompt.size),
        )
