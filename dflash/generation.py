"""Drop-in replacements for mlx-lm's generators, built on dflash's exact-rollback caches.

``generate_step``, ``speculative_generate_step``, ``stream_generate`` and ``generate`` take the
same arguments as mlx-lm's and yield the same tuples / ``GenerationResponse`` objects. The
speculative generator verifies each draft block inside a ``SpeculativeCheckpoint``, so rejected
draft rows leave the cache exactly, sliding-window rings included.
"""

import time
from typing import Any, Callable, Generator, List, Optional, Sequence, Tuple, Union

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.generate import GenerationResponse
from mlx_lm.generate import generate_step as _mlx_generate_step
from mlx_lm.generate import generation_stream, wired_limit
from mlx_lm.sample_utils import greedy_sampler
from mlx_lm.tokenizer_utils import TokenizerWrapper

from .cache import SpeculativeCheckpoint, check_prompt_cache, make_prompt_cache
from .cache.errors import IncompatibleCache
from .verify.acceptance import greedy_accept

Sampler = Callable[[mx.array], mx.array]
LogitsProcessor = Callable[[mx.array, mx.array], mx.array]


def as_prompt_array(prompt: Union[mx.array, Sequence[int]]) -> mx.array:
    """A non-empty 1-D ``uint32`` token array, or a ``ValueError`` naming the problem."""
    prompt = mx.array(prompt) if not isinstance(prompt, mx.array) else prompt
    if prompt.ndim != 1:
        raise ValueError(f"prompt must be a 1-D array of token ids, got shape {prompt.shape}")
    if prompt.size == 0:
        raise ValueError("prompt is empty: at least one token is needed to generate")
    return prompt.astype(mx.uint32)


def generate_step(
    prompt: mx.array,
    model: nn.Module,
    *,
    max_tokens: int = 256,
    sampler: Optional[Sampler] = None,
    logits_processors: Optional[List[LogitsProcessor]] = None,
    prompt_cache: Optional[Any] = None,
    prefill_step_size: int = 2048,
    max_context: Optional[int] = None,
    **kwargs,
) -> Generator[Tuple[int, mx.array], None, None]:
    """mlx-lm's ``generate_step`` over dflash KV planes.

    Args:
        prompt: The prompt tokens.
        model: The model.
        max_tokens: Tokens to generate (``-1``: no limit).
        sampler: Picks a token from log-probabilities (default greedy).
        logits_processors: Functions ``(tokens, logits) -> logits``.
        prompt_cache: One dflash cache per layer (updated in place); built if ``None``.
        prefill_step_size: Prompt tokens per prefill forward.
        max_context: Context limit of a cache built here.
        kwargs: Passed to mlx-lm's ``generate_step`` (``prompt_progress_callback``,
            ``input_embeddings``). ``kv_bits`` and ``max_kv_size`` are refused: dflash
            planes are neither quantized nor truncating.

    Shapes:
        prompt: ``(P,)``.

    Yields:
        ``(token, logprobs)``: one token id and the ``(V,)`` log-probabilities it came from.
    """
    for refused in ("kv_bits", "max_kv_size"):
        if kwargs.get(refused) is not None:
            raise ValueError(f"{refused} is not supported by dflash caches")
        kwargs.pop(refused, None)
    if kwargs.get("input_embeddings") is None:
        prompt = as_prompt_array(prompt)
    if prompt_cache is None:
        prompt_cache = make_prompt_cache(model, max_context=max_context)
    else:
        check_prompt_cache(model, prompt_cache)
    yield from _mlx_generate_step(
        prompt,
        model,
        max_tokens=max_tokens,
        sampler=sampler,
        logits_processors=logits_processors,
        prompt_cache=prompt_cache,
        prefill_step_size=prefill_step_size,
        **kwargs,
    )


def prefill(model: nn.Module, cache: Sequence[Any], tokens: mx.array, step: int) -> None:
    """Run ``tokens`` through ``model`` in chunks of ``step``, filling ``cache``.

    Shapes:
        tokens: ``(T,)``.
    """
    for first in range(0, tokens.size, step):
        model(tokens[first : first + step][None], cache=cache)
        mx.eval([c.state for c in cache])


class _Sampling:
    """Samples tokens from logits, applying logits processors over a token history."""

    def __init__(self, sampler, processors, history: mx.array):
        self.sampler = sampler or greedy_sampler
        self.processors = processors or []
        # The history is kept only when a processor needs it.
        self.history = list(history.tolist()) if self.processors else []

    def processed_logprobs(self, logits: mx.array, inputs: Sequence[int] = ()) -> mx.array:
        """Log-probabilities of ``logits`` after the logits processors.

        Row ``i`` of ``N`` follows the history plus ``inputs[: len(inputs) - N + i + 1]``.

        Shapes:
            logits: ``(N, V)``; returns ``(N, V)``.
        """
        if self.processors:
            rows = []
            for i in range(logits.shape[0]):
                upto = len(inputs) - logits.shape[0] + i + 1
                seen = mx.array(self.history + list(inputs[:upto]), mx.uint32)
                row = logits[i : i + 1]
                for processor in self.processors:
                    row = processor(seen, row)
                rows.append(row)
            logits = mx.concatenate(rows, axis=0)
        return logits - mx.logsumexp(logits, axis=-1, keepdims=True)

    def sample(self, logits: mx.array, inputs: Sequence[int] = ()) -> Tuple[mx.array, mx.array]:
        """Sample one token per row of ``logits`` (see :meth:`processed_logprobs`).

        Shapes:
            logits: ``(N, V)``; returns tokens ``(N,)`` and logprobs ``(N, V)``.
        """
        logprobs = self.processed_logprobs(logits, inputs)
        return self.sampler(logprobs), logprobs

    def extend(self, tokens: Sequence[int]) -> None:
        if self.processors:
            self.history.extend(tokens)


def _draft_block(draft_model, draft_cache, pending: List[int], count: int, sampling):
    """Draft ``count`` tokens autoregressively after the not-yet-cached ``pending`` tokens."""
    drafts: List[mx.array] = []
    inputs = mx.array(pending, mx.uint32)
    for _ in range(count):
        logits = draft_model(inputs[None], cache=draft_cache)[0, -1:]
        seen = pending[-1:]
        if sampling.processors and drafts:
            seen = seen + mx.concatenate(drafts).tolist()
        token, _ = sampling.sample(logits, seen)
        mx.async_eval(token)
        drafts.append(token)
        inputs = token
    return mx.concatenate(drafts).tolist() if drafts else []


def _verify_block(model, target_cache, block: List[int], sampling):
    """Run the target over ``block`` inside a checkpoint; commit what it accepts.

    Returns:
        ``(targets, logprobs, accepted)``: the target's own token after each block position,
        their ``(len(block), V)`` log-probabilities, and how many drafts matched.
    """
    with SpeculativeCheckpoint.begin(target_cache, len(block)) as checkpoint:
        logits = model(mx.array(block, mx.uint32)[None], cache=target_cache)[0]
        tokens, logprobs = sampling.sample(logits, block)
        targets = tokens.tolist()
        accepted = greedy_accept(block[1:], targets)
        checkpoint.commit(accepted + 1)
    return targets, logprobs, accepted


def speculative_generate_step(
    prompt: mx.array,
    model: nn.Module,
    draft_model: nn.Module,
    *,
    num_draft_tokens: int = 3,
    max_tokens: int = 256,
    sampler: Optional[Sampler] = None,
    logits_processors: Optional[List[LogitsProcessor]] = None,
    prompt_cache: Optional[Any] = None,
    prefill_step_size: int = 512,
) -> Generator[Tuple[int, mx.array, bool], None, None]:
    """Speculative decoding with a draft model, exact on sliding-window models.

    Each round the draft model proposes ``num_draft_tokens`` tokens; the target verifies
    ``[last token, drafts...]`` in one forward inside a ``SpeculativeCheckpoint``, keeps the
    longest prefix of drafts equal to its own sampled tokens plus its own next token, and
    commits exactly those rows in both caches. With the same ``sampler`` for both models the
    output is distributed as the target's own (at temperature 0, equal to its greedy output).

    Args:
        prompt: The prompt tokens.
        model: The target model.
        draft_model: The draft model (same tokenizer).
        num_draft_tokens: Draft tokens per round (``>= 0``).
        max_tokens: Tokens to generate (``-1``: no limit).
        sampler: Picks a token from log-probabilities (default greedy).
        logits_processors: Functions ``(tokens, logits) -> logits``.
        prompt_cache: The target's dflash caches followed by the draft model's, updated in
            place; built if ``None``.
        prefill_step_size: Prompt tokens per prefill forward.

    Shapes:
        prompt: ``(P,)``.

    Yields:
        ``(token, logprobs, from_draft)``: a token id, the target's ``(V,)`` log-probabilities
        for it, and whether it was an accepted draft token.
    """
    if num_draft_tokens < 0:
        raise ValueError(f"num_draft_tokens must be >= 0, got {num_draft_tokens}")
    prompt = as_prompt_array(prompt)
    if prompt_cache is None:
        target_cache, draft_cache = make_prompt_cache(model), make_prompt_cache(draft_model)
    else:
        target_cache = prompt_cache[: len(model.layers)]
        draft_cache = prompt_cache[len(model.layers) :]
    start = check_prompt_cache(model, target_cache, "target")
    if check_prompt_cache(draft_model, draft_cache, "draft") != start:
        raise IncompatibleCache("the target and draft prompt caches are at different positions")
    sampling = _Sampling(sampler, logits_processors, prompt[:-1])

    with mx.stream(generation_stream):
        prefill(model, target_cache, prompt[:-1], prefill_step_size)
        prefill(draft_model, draft_cache, prompt[:-1], prefill_step_size)
        last = prompt[-1].item()
        draft_pending = [last]  # committed tokens the draft cache has not seen yet
        emitted = 0
        while max_tokens < 0 or emitted < max_tokens:
            left = max_tokens - emitted if max_tokens >= 0 else num_draft_tokens + 1
            count = min(num_draft_tokens, left - 1)
            if count > 0:
                # The draft writes its pending tokens, then count - 1 of its own drafts.
                written = len(draft_pending) + count - 1
                with SpeculativeCheckpoint.begin(draft_cache, written) as draft_checkpoint:
                    drafts = _draft_block(draft_model, draft_cache, draft_pending, count, sampling)
                    targets, logprobs, accepted = _verify_block(
                        model, target_cache, [last] + drafts, sampling
                    )
                    draft_checkpoint.commit(len(draft_pending) + min(accepted, count - 1))
                # A fully accepted block leaves the last draft unseen by the draft model.
                draft_pending = drafts[-1:] if accepted == count else []
            else:
                drafts = []
                targets, logprobs, accepted = _verify_block(model, target_cache, [last], sampling)
            sampling.extend([last] + drafts[:accepted])
            last = targets[accepted]
            draft_pending = draft_pending + [last]
            for position, token in enumerate(drafts[:accepted] + [last]):
                yield token, logprobs[position], position < accepted
                emitted += 1
                if emitted == max_tokens:
                    return


def _encode_prompt(tokenizer: TokenizerWrapper, prompt) -> mx.array:
    if isinstance(prompt, str):
        bos = tokenizer.bos_token
        add_special = bos is None or not prompt.startswith(bos)
        prompt = tokenizer.encode(prompt, add_special_tokens=add_special)
    return as_prompt_array(prompt)


def stream_generate(
    model: nn.Module,
    tokenizer,
    prompt: Union[str, mx.array, List[int]],
    max_tokens: int = 256,
    draft_model: Optional[nn.Module] = None,
    drafter: Optional[nn.Module] = None,
    **kwargs,
) -> Generator[GenerationResponse, None, None]:
    """mlx-lm's ``stream_generate`` over dflash caches and speculative decoding.

    Args:
        model: The target model.
        tokenizer: Its tokenizer (wrapped in mlx-lm's ``TokenizerWrapper`` if needed).
        prompt: A string or token ids.
        max_tokens: Tokens to generate (``-1``: no limit; ``0`` is refused as in mlx-lm).
        draft_model: A draft model for speculative decoding (``None``: plain decoding).
        drafter: A DFlash drafter (``dflash.load_drafter``): DFlash block decoding. Pass
            ``stats=dflash.GenerationStats(...)`` to collect rounds, τ and acceptance.
        kwargs: Passed to ``dflash_generate_step``, :func:`speculative_generate_step` or
            :func:`generate_step`.

    Yields:
        mlx-lm ``GenerationResponse`` objects, one per token; the last has ``finish_reason``
        ``"stop"`` (end of sequence) or ``"length"``.
    """
    if max_tokens == 0:
        raise ValueError("Maximum number of tokens must be non-zero (use -1 for no limit).")
    if not isinstance(tokenizer, TokenizerWrapper):
        tokenizer = TokenizerWrapper(tokenizer)
    prompt = _encode_prompt(tokenizer, prompt)
    if drafter is not None and draft_model is not None:
        raise ValueError("pass either drafter (DFlash) or draft_model, not both")
    if drafter is not None:
        from .block_decode import dflash_generate_step

        kwargs.pop("num_draft_tokens", None)
        tokens = dflash_generate_step(prompt, model, drafter, max_tokens=max_tokens, **kwargs)
    elif draft_model is None:
        kwargs.pop("num_draft_tokens", None)
        steps = generate_step(prompt, model, max_tokens=max_tokens, **kwargs)
        tokens = ((token, logprobs, False) for token, logprobs in steps)
    else:
        kwargs.pop("block_size", None)
        tokens = speculative_generate_step(
            prompt, model, draft_model, max_tokens=max_tokens, **kwargs
        )
    yield from responses(tokens, tokenizer, prompt.size, max_tokens, model)


def responses(tokens, tokenizer: TokenizerWrapper, prompt_size: int, max_tokens: int, model):
    """Turn ``(token, logprobs, from_draft)`` tuples into ``GenerationResponse`` objects."""
    detokenizer = tokenizer.detokenizer
    detokenizer.reset()
    with wired_limit(model, [generation_stream]):
        tic = time.perf_counter()
        prompt_tps = 0.0
        for count, (token, logprobs, from_draft) in enumerate(tokens, start=1):
            if count == 1:
                prompt_tps = prompt_size / (time.perf_counter() - tic)
                tic = time.perf_counter()
            finish_reason = None
            if token in tokenizer.eos_token_ids:
                finish_reason = "stop"
            else:
                detokenizer.add_token(token)
                if count == max_tokens:
                    finish_reason = "length"
            if finish_reason:
                detokenizer.finalize()
            yield GenerationResponse(
                text=detokenizer.last_segment,
                token=token,
                logprobs=logprobs,
                from_draft=from_draft,
                prompt_tokens=prompt_size,
                prompt_tps=prompt_tps,
                generation_tokens=count,
                generation_tps=count / max(time.perf_counter() - tic, 1e-9),
                peak_memory=mx.get_peak_memory() / 1e9,
                finish_reason=finish_reason,
            )
            if finish_reason:
                return


def generate(
    model: nn.Module,
    tokenizer,
    prompt: Union[str, List[int]],
    verbose: bool = False,
    **kwargs,
) -> str:
    """Generate a complete response (mlx-lm's ``generate``); see :func:`stream_generate`.

    Args:
        model: The target model.
        tokenizer: Its tokenizer.
        prompt: A string or token ids.
        verbose: Print the text as it streams and the speeds at the end.
        kwargs: Passed to :func:`stream_generate`.

    Returns:
        The generated text.
    """
    text = ""
    response = None
    if verbose:
        print("=" * 10)
    for response in stream_generate(model, tokenizer, prompt, **kwargs):
        if verbose:
            print(response.text, end="", flush=True)
        text += response.text
    if verbose and response is not None:
        print()
        print("=" * 10)
        print(f"Prompt: {response.prompt_tokens} tokens, {response.prompt_tps:.3f} tokens-per-sec")
        print(
            f"Generation: {response.generation_tokens} tokens, "
            f"{response.generation_tps:.3f} tokens-per-sec"
        )
        print(f"Peak memory: {response.peak_memory:.3f} GB")
    return text
