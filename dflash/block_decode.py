"""The DFlash draft/verify loop: one drafter forward drafts a block, one target forward verifies it.

Per round: the block ``[last committed token, mask, ..., mask]`` goes through the drafter, which
sees the target only through tapped hidden states of committed tokens; its ``B - 1`` proposals
are verified by the target in one forward inside a ``SpeculativeCheckpoint``; the accepted rows
plus the target's own next token are committed, and the drafter's context grows by the target
features of exactly those committed tokens.
"""

from typing import Any, Generator, List, Optional, Tuple

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.generate import DEFAULT_QUANTIZED_KV_START, generation_stream
from mlx_lm.sample_utils import greedy_sampler

from .cache import SpeculativeCheckpoint, check_prompt_cache, make_prompt_cache
from .generation import (
    GenerationStats,
    ProgressCallback,
    Sampler,
    Stream,
    _Sampling,
    as_prompt_array,
    check_cache_options,
)
from .taps import TargetTaps
from .verify.acceptance import (
    ParamSampler,
    greedy_accept,
    rejection_sample,
    sampling_logprobs,
)

__all__ = ["GenerationStats", "dflash_generate_step"]


def _draft(drafter, context, last: int, block_size: int, sampling: _Sampling):
    """Draft ``block_size - 1`` tokens after ``last``.

    Returns:
        ``(drafts, draft_logprobs)``: the tokens, and when sampling with known settings the
        ``(B - 1, V)`` log-distribution each was drawn from (the ``q`` of rejection sampling).
    """
    block = mx.array(
        [[last] + [drafter.config.mask_token_id] * (block_size - 1)], mx.uint32
    )
    params = _params(sampling)
    sampled = params is not None and not params.greedy
    if getattr(drafter.config, "has_candidate_selector", False):
        # DFlash2 re-ranks candidates given the previous pick: drafts are not a row argmax.
        proposal = drafter.propose(
            block, context, temperature=params.temp if sampled else 0.0
        )
        draft_logprobs = mx.log(proposal.probs[0]) if sampled else None
        return proposal.tokens[0].tolist(), draft_logprobs
    logits = drafter(block, context)[0, 1:]
    logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    if sampled:
        draft_logprobs = sampling_logprobs(logprobs, params)
        return mx.random.categorical(draft_logprobs).tolist(), draft_logprobs
    if params is None and sampling.sampler is not greedy_sampler:
        # An opaque sampler: any proposal is lossless under the sample-match rule.
        return sampling.sample_rows(logprobs).tolist(), None
    return mx.argmax(logprobs, axis=-1).tolist(), None


def _params(sampling: _Sampling):
    """The sampler's settings when it exposes a distribution (``dflash.make_sampler``)."""
    if (
        isinstance(sampling.sampler, ParamSampler)
        and sampling.sampler.params.expressible
    ):
        return sampling.sampler.params
    return None


def _accept(
    sampling: _Sampling, logits: mx.array, block: List[int], drafts, draft_logprobs
):
    """Apply the acceptance rule; returns ``(accepted, bonus, target logprobs)``."""
    params = _params(sampling)
    if params is not None and not params.greedy:
        logprobs = sampling.processed_logprobs(logits, block)
        target_logprobs = sampling_logprobs(logprobs, params)
        accepted, bonus = rejection_sample(target_logprobs, draft_logprobs, drafts)
        return accepted, bonus, logprobs
    # Greedy, or an opaque sampler: keep a draft only where the target's own sample equals it.
    tokens, logprobs = sampling.sample(logits, block)
    targets = tokens.tolist()
    accepted = greedy_accept(drafts, targets)
    return accepted, targets[accepted], logprobs


def _prefill(
    model, cache, taps: TargetTaps, drafter, context, tokens, step, progress, total
):
    """Run prompt tokens through the target in chunks; feed their features to the drafter."""
    for first in range(0, tokens.size, step):
        chunk = tokens[first : first + step]
        model(chunk[None], cache=cache)
        drafter.append_context(
            context, taps.pop(), start_position=cache[0].offset - chunk.size
        )
        mx.eval([c.state for c in cache])
        progress(first + chunk.size, total)


def dflash_generate_step(
    prompt: mx.array,
    model: nn.Module,
    drafter: nn.Module,
    stream: Stream = generation_stream,
    *,
    block_size: Optional[int] = None,
    max_tokens: int = 256,
    sampler: Optional[Sampler] = None,
    logits_processors: Optional[list] = None,
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
        prompt_cache: The target's dflash caches (updated in place); built if ``None``.
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
    block_size = drafter.config.block_size if block_size is None else block_size
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    check_cache_options(model, kv_bits, max_kv_size)
    prompt = as_prompt_array(prompt, model)
    if prompt_cache is None:
        prompt_cache = make_prompt_cache(model, max_context=max_context)
    elif check_prompt_cache(model, prompt_cache) != 0:
        raise ValueError(
            "dflash_generate_step needs an empty prompt cache (the drafter "
            "must see the target features of every prompt token)"
        )
    stats = stats if stats is not None else GenerationStats(block_size)
    stats.block_size = block_size
    progress = prompt_progress_callback or (lambda *_: None)
    sampling = _Sampling(sampler, logits_processors, prompt[:-1])
    context = drafter.make_context()
    with TargetTaps(model, drafter.config.target_layer_ids) as taps, mx.stream(stream):
        progress(0, prompt.size)
        _prefill(
            model,
            prompt_cache,
            taps,
            drafter,
            context,
            prompt[:-1],
            prefill_step_size,
            progress,
            prompt.size,
        )
        last = prompt[-1].item()
        emitted = 0
        while max_tokens < 0 or emitted < max_tokens:
            left = max_tokens - emitted if max_tokens >= 0 else block_size
            size = max(1, min(block_size, left))
            drafts, draft_logprobs = (
                _draft(drafter, context, last, size, sampling)
                if size > 1
                else ([], None)
            )
            block = [last] + drafts
            position = prompt_cache[0].offset
            with SpeculativeCheckpoint.begin(prompt_cache, len(block)) as checkpoint:
                logits = model(mx.array(block, mx.uint32)[None], cache=prompt_cache)[0]
                features = taps.pop()
                accepted, bonus, logprobs = _accept(
                    sampling, logits, block, drafts, draft_logprobs
                )
                checkpoint.commit(accepted + 1)
            drafter.append_context(
                context, features[:, : accepted + 1], start_position=position
            )
            stats.record(accepted)
            if emitted == 0:
                progress(prompt.size, prompt.size)
            sampling.extend(block[: accepted + 1])
            last = bonus
            for index, token in enumerate(drafts[:accepted] + [bonus]):
                yield token, logprobs[index], index < accepted
                emitted += 1
                if emitted == max_tokens:
                    return
