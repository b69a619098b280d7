"""Drop-in replacements for mlx-lm's generators, built on dflash's exact-rollback caches.

``generate_step``, ``speculative_generate_step``, ``stream_generate`` and ``generate`` take the
same arguments as mlx-lm's and yield the same tuples / ``GenerationResponse`` objects. The
speculative generator verifies each draft block inside a ``SpeculativeCheckpoint``, so rejected
draft rows leave the cache exactly, sliding-window rings included.
"""

import time
from dataclasses import dataclass, field
from typing import Any, Callable, Generator, List, Optional, Sequence, Tuple, Union

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.generate import DEFAULT_QUANTIZED_KV_START, GenerationResponse
from mlx_lm.generate import generate_step as _mlx_generate_step
from mlx_lm.generate import generation_stream, wired_limit
from mlx_lm.models.cache import RotatingKVCache
from mlx_lm.sample_utils import greedy_sampler
from mlx_lm.tokenizer_utils import TokenizerWrapper

from .cache import SpeculativeCheckpoint, check_prompt_cache, make_prompt_cache
from .cache.errors import IncompatibleCache
from .verify.acceptance import acceptance_histogram, greedy_accept

Sampler = Callable[[mx.array], mx.array]
LogitsProcessor = Callable[[mx.array, mx.array], mx.array]
ProgressCallback = Callable[[int, int], None]
Stream = Union[mx.Stream, mx.ThreadLocalStream]


@dataclass
class GenerationStats:
    """Per-generation statistics of a speculative (or plain) run.

    Plain decoding counts each token as a round with no drafts (``block_size`` 1).

    Attributes:
        block_size: Block size ``B`` (``B - 1`` drafts per round).
        rounds: Verify forwards of the target after prefill.
        accepted: Drafts accepted in each round.
    """

    block_size: int
    rounds: int = 0
    accepted: List[int] = field(default_factory=list)

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

    def record(self, accepted: int) -> None:
        """Count one round that kept ``accepted`` drafts."""
        self.rounds += 1
        self.accepted.append(accepted)


def vocab_size(model: nn.Module) -> Optional[int]:
    """Rows of the model's token embedding (``None`` when it cannot be found)."""
    for owner in (
        model,
        getattr(model, "model", None),
        getattr(model, "language_model", None),
    ):
        table = getattr(owner, "embed_tokens", None) if owner is not None else None
        if table is None and owner is not None:
            inner = getattr(owner, "model", None)
            table = getattr(inner, "embed_tokens", None) if inner is not None else None
        if table is not None:
            rows = getattr(table, "num_embeddings", None)
            if rows is None and getattr(table, "weight", None) is not None:
                rows = table.weight.shape[0]
            if rows is not None:
                return int(rows)
    size = getattr(getattr(model, "args", None), "vocab_size", None)
    return int(size) if isinstance(size, int) else None


def check_token_ids(prompt: mx.array, *models: nn.Module) -> None:
    """Refuse token ids outside ``[0, vocab)`` before any forward could read them.

    Shapes:
        prompt: ``(P,)`` integer ids.
    """
    if prompt.size == 0:
        return
    low, high = mx.min(prompt).item(), mx.max(prompt).item()
    for model in models:
        size = vocab_size(model)
        if size is None:
            continue
        bad = low if low < 0 else high if high >= size else None
        if bad is not None:
            raise ValueError(
                f"prompt token id {bad} is outside the vocabulary: ids must be in "
                f"[0, {size}) for a model with vocabulary size {size}"
            )


def as_prompt_array(
    prompt: Union[mx.array, Sequence[int]], *models: nn.Module
) -> mx.array:
    """A non-empty 1-D ``uint32`` token array, or a ``ValueError`` naming the problem.

    Args:
        prompt: Token ids.
        models: Models whose vocabulary every id must fit.

    Shapes:
        prompt: ``(P,)``.
    """
    prompt = mx.array(prompt) if not isinstance(prompt, mx.array) else prompt
    if prompt.ndim != 1:
        raise ValueError(
            f"prompt must be a 1-D array of token ids, got shape {prompt.shape}"
        )
    if prompt.size == 0:
        raise ValueError("prompt is empty: at least one token is needed to generate")
    if not mx.issubdtype(prompt.dtype, mx.integer):
        raise ValueError(
            f"prompt must hold integer token ids, got dtype {prompt.dtype}"
        )
    check_token_ids(prompt, *models)
    return prompt.astype(mx.uint32)


def check_cache_options(
    model: nn.Module, kv_bits: Optional[int] = None, max_kv_size: Optional[int] = None
) -> None:
    """Refuse mlx-lm cache options that dflash caches cannot honour.

    ``kv_bits`` (a quantized KV cache) is refused: rolled-back rows must be exact.
    ``max_kv_size``: mlx-lm ignores it for a model that builds its own caches (every sliding
    window model); here it is accepted as the same no-op when it is at least every sliding
    window, and refused when smaller (the model's windows cannot be cut). For a model without
    ``make_cache`` mlx-lm would turn every layer into a ring with 4 attention-sink rows that
    evicts context, which dflash caches never do: refused (bound the context with
    ``max_context`` instead).
    """
    if kv_bits is not None:
        raise ValueError(
            f"kv_bits={kv_bits} is not supported: dflash caches keep exact rows so rejected "
            "drafts can be rolled back (leave kv_bits as None)"
        )
    if max_kv_size is None:
        return
    if not hasattr(model, "make_cache"):
        raise ValueError(
            f"max_kv_size={max_kv_size} is not supported for this model: mlx-lm would evict "
            "old context into a 4-token-sink ring, and dflash caches never evict (leave it "
            "None; max_context bounds the context instead)"
        )
    windows = [c.max_size for c in model.make_cache() if isinstance(c, RotatingKVCache)]
    if windows and max_kv_size < max(windows):
        raise ValueError(
            f"max_kv_size={max_kv_size} is smaller than the model's sliding window "
            f"{max(windows)}: the window cannot be cut (leave max_kv_size as None)"
        )


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
            :func:`check_cache_options`).
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
    for token, logprobs in steps:
        if stats is not None:
            stats.record(0)
        yield token, logprobs


def prefill(
    model: nn.Module,
    cache: Sequence[Any],
    tokens: mx.array,
    step: int,
    progress: Optional[ProgressCallback] = None,
    total: int = 0,
) -> None:
    """Run ``tokens`` through ``model`` in chunks of ``step``, filling ``cache``.

    Args:
        model: The model.
        cache: Its caches.
        tokens: Prompt tokens to write.
        step: Tokens per forward.
        progress: Called with ``(processed, total)`` after each chunk.
        total: The prompt length reported to ``progress``.

    Shapes:
        tokens: ``(T,)``.
    """
    for first in range(0, tokens.size, step):
        model(tokens[first : first + step][None], cache=cache)
        mx.eval([c.state for c in cache])
        if progress is not None:
            progress(min(first + step, tokens.size), total)


class _Sampling:
    """Samples tokens from logits, applying logits processors over a token history."""

    def __init__(self, sampler, processors, history: mx.array):
        self.sampler = sampler or greedy_sampler
        params = getattr(self.sampler, "params", None)
        self.greedy = self.sampler is greedy_sampler or getattr(params, "greedy", False)
        self.processors = processors or []
        # The history is kept only when a processor needs it.
        self.history = list(history.tolist()) if self.processors else []

    def processed_logprobs(
        self, logits: mx.array, inputs: Sequence[int] = ()
    ) -> mx.array:
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

    def sample(
        self, logits: mx.array, inputs: Sequence[int] = ()
    ) -> Tuple[mx.array, mx.array]:
        """Sample one token per row of ``logits`` (see :meth:`processed_logprobs`).

        Shapes:
            logits: ``(N, V)``; returns tokens ``(N,)`` and logprobs ``(N, V)``.
        """
        logprobs = self.processed_logprobs(logits, inputs)
        return self.sample_rows(logprobs), logprobs

    def sample_rows(self, logprobs: mx.array) -> mx.array:
        """One sampler call per row, as sequential decoding makes them.

        A sampler may draw one random number per call for the whole batch (mlx-lm's XTC
        does), so rows sampled together would not be independent samples.

        Shapes:
            logprobs: ``(N, V)``; returns ``(N,)``.
        """
        if self.greedy or logprobs.shape[0] == 1:
            return self.sampler(logprobs)
        return mx.concatenate(
            [self.sampler(logprobs[i : i + 1]) for i in range(logprobs.shape[0])]
        )

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
    ``max_kv_size`` / ``prompt_progress_callback`` (as :func:`generate_step`), ``max_context``
    and ``stats``. Each round the draft model proposes ``num_draft_tokens`` tokens; the target
    verifies ``[last token, drafts...]`` in one forward inside a ``SpeculativeCheckpoint``,
    keeps the longest prefix of drafts equal to its own sampled tokens plus its own next token,
    and commits exactly those rows in both caches. With the same ``sampler`` for both models
    the output is distributed as the target's own (at temperature 0, equal to its greedy
    output).

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
            place; built if ``None``.
        prefill_step_size: Prompt tokens per prefill forward.
        kv_bits: Must be ``None``: dflash caches are not quantized.
        kv_group_size: Unused (only with ``kv_bits``).
        quantized_kv_start: Unused (only with ``kv_bits``).
        max_kv_size: As in :func:`generate_step`.
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
    sampling = _Sampling(sampler, logits_processors, prompt[:-1])

    with mx.stream(stream):
        progress(0, prompt.size)
        prefill(
            model, target_cache, prompt[:-1], prefill_step_size, progress, prompt.size
        )
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
                with SpeculativeCheckpoint.begin(
                    draft_cache, written
                ) as draft_checkpoint:
                    drafts = _draft_block(
                        draft_model, draft_cache, draft_pending, count, sampling
                    )
                    targets, logprobs, accepted = _verify_block(
                        model, target_cache, [last] + drafts, sampling
                    )
                    draft_checkpoint.commit(
                        len(draft_pending) + min(accepted, count - 1)
                    )
                # A fully accepted block leaves the last draft unseen by the draft model.
                draft_pending = drafts[-1:] if accepted == count else []
            else:
                drafts = []
                targets, logprobs, accepted = _verify_block(
                    model, target_cache, [last], sampling
                )
            stats.record(accepted)
            if progress is not None:
                progress(prompt.size, prompt.size)
                progress = None
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
        kwargs: Passed to ``dflash_generate_step``, :func:`speculative_generate_step` or
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
        from .block_decode import dflash_generate_step

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

    Stops at the first end-of-sequence token or after ``max_tokens``, closing ``tokens``.
    """
    detokenizer = tokenizer.detokenizer
    detokenizer.reset()
    try:
        yield from _responses(
            tokens, tokenizer, detokenizer, prompt_size, max_tokens, model, stream
        )
    finally:
        # Closing the token generator now (not at garbage collection) settles its caches.
        close = getattr(tokens, "close", None)
        if close is not None:
            close()


def _responses(tokens, tokenizer, detokenizer, prompt_size, max_tokens, model, stream):
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
            f"Prompt: {response.prompt_tokens} tokens, {response.prompt_tps:.3f} tokens-per-sec"
        )
        print(
            f"Generation: {response.generation_tokens} tokens, "
            f"{response.generation_tps:.3f} tokens-per-sec"
        )
        print(f"Peak memory: {response.peak_memory:.3f} GB")
    return text
