"""mlx-lm's generation API over dflash's exact-rollback caches: the drop-in entry points.

``generate_step``, ``speculative_generate_step``, ``stream_generate`` and ``generate`` take the
arguments of mlx-lm 0.32.2's functions of the same names, in the same order, and yield the same
tuples / ``GenerationResponse`` objects; ``dflash_generate_step`` is DFlash's generator (see
:mod:`dflash.dflash_round`), reached from ``stream_generate`` with ``drafter=``.
"""

import time
from typing import Any, Generator, List, Optional, Tuple, Union

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.generate import DEFAULT_QUANTIZED_KV_START, GenerationResponse
from mlx_lm.generate import generate_step as _mlx_generate_step
from mlx_lm.generate import generation_stream, wired_limit
from mlx_lm.tokenizer_utils import TokenizerWrapper

from .cache import check_prompt_cache, make_prompt_cache
from .dflash_round import dflash_generate_step
from .held_norms import held_norms
from .inputs import ProgressCallback, Stream, as_prompt_array, check_cache_options
from .kernel_patch import verify_kernels
from .sampling import LogitsProcessor, Sampler
from .speculative import speculative_generate_step
from .stats import GenerationStats

__all__ = [
    "GenerationStats",
    "dflash_generate_step",
    "generate",
    "generate_step",
    "speculative_generate_step",
    "stream_generate",
]


def generate_step(
    prompt: mx.array,
    model: nn.Module,
    stream: Stream = generation_stream,
    *,
    max_tokens: int = 256,
    sampler: Optional[Sampler] = None,
    logits_processors: Optional[List[LogitsProcessor]] = None,
    max_kv_size: Optional[int] = None,
    prompt_cache: Optional[Any] = None,
    prefill_step_size: int = 2048,
    kv_bits: Optional[int] = None,
    kv_group_size: int = 64,
    quantized_kv_start: int = DEFAULT_QUANTIZED_KV_START,
    prompt_progress_callback: Optional[ProgressCallback] = None,
    input_embeddings: Optional[mx.array] = None,
    max_context: Optional[int] = None,
    stats: Optional[GenerationStats] = None,
) -> Generator[Tuple[int, mx.array], None, None]:
    """mlx-lm's ``generate_step`` (same arguments, same order) over dflash KV planes.

    Args:
        prompt: The prompt tokens.
        model: The model.
        stream: The stream the generation runs on.
        max_tokens: Tokens to generate (``-1``: no limit).
        sampler: Picks a token from log-probabilities (default greedy).
        logits_processors: Functions ``(tokens, logits) -> logits``.
        max_kv_size: Accepted as mlx-lm's no-op when at least every sliding window of a
            model that builds its own caches; refused otherwise (see
            :func:`dflash.inputs.check_cache_options`).
        prompt_cache: One dflash cache per layer (updated in place); built if ``None``.
        prefill_step_size: Prompt tokens per prefill forward.
        kv_bits: Must be ``None``: dflash caches are not quantized.
        kv_group_size: Unused (only with ``kv_bits``).
        quantized_kv_start: Unused (only with ``kv_bits``).
        prompt_progress_callback: Called with ``(processed, total)`` prompt tokens.
        input_embeddings: Embeddings used instead of or with the prompt tokens.
        max_context: Context limit of a cache built here.
        stats: A :class:`GenerationStats` to fill in (each token is a round with no drafts).

    Shapes:
        prompt: ``(P,)``; input_embeddings: ``(P, H)``.

    Yields:
        ``(token, logprobs)``: one token id and the ``(V,)`` log-probabilities it came from.
    """
    check_cache_options(model, kv_bits, max_kv_size)
    if input_embeddings is None or len(prompt) > 0:
        prompt = as_prompt_array(prompt, model)
    if prompt_cache is None:
        prompt_cache = make_prompt_cache(model, max_context=max_context)
    else:
        check_prompt_cache(model, prompt_cache)
    if stats is not None:
        stats.block_size = 1
    steps = _mlx_generate_step(
        prompt,
        model,
        stream,
        max_tokens=max_tokens,
        sampler=sampler,
        logits_processors=logits_processors,
        prompt_cache=prompt_cache,
        prefill_step_size=prefill_step_size,
        prompt_progress_callback=prompt_progress_callback,
        input_embeddings=input_embeddings,
    )
    # The verify kernels, where installed, serve our plain decoding too (bitwise agreement).
    with verify_kernels(model), held_norms(model):
        for token, logprobs in steps:
            if stats is not None:
                stats.record(0)
            yield token, logprobs


def _encode_prompt(tokenizer: TokenizerWrapper, prompt) -> mx.array:
    if isinstance(prompt, str):
        bos = tokenizer.bos_token
        add_special = bos is None or not prompt.startswith(bos)
        prompt = tokenizer.encode(prompt, add_special_tokens=add_special)
    return prompt if isinstance(prompt, mx.array) else mx.array(prompt)


def stream_generate(
    model: nn.Module,
    tokenizer,
    prompt: Union[str, mx.array, List[int]],
    max_tokens: int = 256,
    draft_model: Optional[nn.Module] = None,
    stream: Stream = generation_stream,
    *,
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
        stream: The stream the generation runs on.
        drafter: A DFlash drafter (``dflash.load_drafter``): DFlash block decoding. Pass
            ``stats=dflash.GenerationStats(...)`` to collect rounds, τ and acceptance.
        kwargs: Passed to :func:`dflash_generate_step`, :func:`speculative_generate_step` or
            :func:`generate_step`; every keyword mlx-lm's ``stream_generate`` takes is
            accepted (``num_draft_tokens`` is dropped without a draft model, and
            ``input_embeddings`` must be ``None`` with one, as in mlx-lm).

    Yields:
        mlx-lm ``GenerationResponse`` objects, one per token; the last has ``finish_reason``
        ``"stop"`` (end of sequence) or ``"length"``.
    """
    if max_tokens == 0:
        raise ValueError(
            "Maximum number of tokens must be non-zero (use -1 for no limit)."
        )
    if not isinstance(tokenizer, TokenizerWrapper):
        tokenizer = TokenizerWrapper(tokenizer)
    prompt = _encode_prompt(tokenizer, prompt)
    if drafter is not None and draft_model is not None:
        raise ValueError("pass either drafter (DFlash) or draft_model, not both")
    if draft_model is not None or drafter is not None:
        if kwargs.pop("input_embeddings", None) is not None:
            raise ValueError("Speculative decoding does not support input embeddings.")
    if drafter is not None:
        kwargs.pop("num_draft_tokens", None)
        tokens = dflash_generate_step(
            prompt, model, drafter, stream, max_tokens=max_tokens, **kwargs
        )
    elif draft_model is None:
        kwargs.pop("num_draft_tokens", None)
        kwargs.pop("block_size", None)
        steps = generate_step(prompt, model, stream, max_tokens=max_tokens, **kwargs)
        tokens = ((token, logprobs, False) for token, logprobs in steps)
    else:
        kwargs.pop("block_size", None)
        tokens = speculative_generate_step(
            prompt, model, draft_model, stream, max_tokens=max_tokens, **kwargs
        )
    yield from responses(tokens, tokenizer, prompt.size, max_tokens, model, stream)


def responses(
    tokens,
    tokenizer: TokenizerWrapper,
    prompt_size: int,
    max_tokens: int,
    model: nn.Module,
    stream: Stream = generation_stream,
) -> Generator[GenerationResponse, None, None]:
    """Turn ``(token, logprobs, from_draft)`` tuples into ``GenerationResponse`` objects.

    Stops at the first end-of-sequence token or after ``max_tokens`` and closes ``tokens``
    right away, so its caches settle before the caller continues.

    Args:
        tokens: A generator of ``(token, logprobs, from_draft)``.
        tokenizer: The tokenizer (its detokenizer is reset).
        prompt_size: Prompt tokens, for the speed report.
        max_tokens: Tokens to emit at most (``-1``: no limit).
        model: The target model (for mlx-lm's wired memory limit).
        stream: The generation stream.

    Yields:
        One ``GenerationResponse`` per token.
    """
    detokenizer = tokenizer.detokenizer
    detokenizer.reset()
    try:
        with wired_limit(model, [stream]):
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
    finally:
        close = getattr(tokens, "close", None)
        if close is not None:
            close()


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
    if verbose:
        print()
        print("=" * 10)
        if response is None or not text:
            print("No text generated for this prompt")
            return text
        print(
            f"Prompt: {response.prompt_tokens} tokens, "
            f"{response.prompt_tps:.3f} tokens-per-sec"
        )
        print(
            f"Generation: {response.generation_tokens} tokens, "
            f"{response.generation_tps:.3f} tokens-per-sec"
        )
        print(f"Peak memory: {response.peak_memory:.3f} GB")
    return text
