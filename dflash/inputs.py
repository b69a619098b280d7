"""Checks every generator runs on its inputs before the first forward: the prompt's token ids
and the mlx-lm cache options dflash caches can or cannot honour."""

from typing import Any, Callable, Optional, Sequence, Union

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import RotatingKVCache

ProgressCallback = Callable[[int, int], None]
Stream = Union[mx.Stream, mx.ThreadLocalStream]


def vocab_size(model: nn.Module) -> Optional[int]:
    """Rows of the model's token embedding (``None`` when it cannot be found).

    Args:
        model: An mlx-lm model.

    Returns:
        The number of token ids the model can embed.
    """
    owners = [
        model,
        getattr(model, "model", None),
        getattr(model, "language_model", None),
    ]
    owners.append(getattr(owners[-1], "model", None))
    for owner in owners:
        table = getattr(owner, "embed_tokens", None) if owner is not None else None
        if table is None:
            continue
        rows = getattr(table, "num_embeddings", None)
        if rows is None and getattr(table, "weight", None) is not None:
            rows = table.weight.shape[0]
        if rows is not None:
            return int(rows)
    size = getattr(getattr(model, "args", None), "vocab_size", None)
    return int(size) if isinstance(size, int) else None


def check_token_ids(prompt: mx.array, *models: nn.Module) -> None:
    """Refuse token ids outside ``[0, vocab)`` before any forward could read them.

    Args:
        prompt: Integer token ids.
        models: Models whose vocabulary every id must fit.

    Shapes:
        prompt: ``(P,)``.
    """
    if prompt.size == 0:
        return
    low, high = mx.min(prompt).item(), mx.max(prompt).item()
    for model in models:
        size = vocab_size(model)
        bad = (
            None if size is None else low if low < 0 else high if high >= size else None
        )
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

    Returns:
        The prompt as ``uint32``.
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

    Args:
        model: The model the caches serve.
        kv_bits: mlx-lm's KV quantization bits.
        max_kv_size: mlx-lm's KV size limit.
    """
    if kv_bits is not None:
        raise ValueError(
            f"kv_bits={kv_bits} is not supported: dflash caches keep exact rows so "
            "rejected drafts can be rolled back (leave kv_bits as None)"
        )
    if max_kv_size is None:
        return
    if not hasattr(model, "make_cache"):
        raise ValueError(
            f"max_kv_size={max_kv_size} is not supported for this model: mlx-lm would "
            "evict old context into a 4-token-sink ring, and dflash caches never evict "
            "(leave it None; max_context bounds the context instead)"
        )
    windows = [c.max_size for c in model.make_cache() if isinstance(c, RotatingKVCache)]
    if windows and max_kv_size < max(windows):
        raise ValueError(
            f"max_kv_size={max_kv_size} is smaller than the model's sliding window "
            f"{max(windows)}: the window cannot be cut (leave max_kv_size as None)"
        )


def resolve_block_size(
    block_size: Optional[int], drafter: Any, name: str = "block_size"
) -> int:
    """The DFlash block size to use: one rule for the generator, the CLIs and the bench.

    A drafter was trained for blocks of at most its own size, and a block of 1 drafts nothing
    but is still a valid (plain) round: ``1 <= block_size <= drafter.config.block_size``.

    Args:
        block_size: The requested size, or ``None`` for the drafter's.
        drafter: A DFlash drafter.
        name: How the size is called in the message (``--block-size`` for a CLI).

    Returns:
        The block size.

    Raises:
        ValueError: not an integer, or outside ``1..drafter.config.block_size``.
    """
    limit = int(drafter.config.block_size)
    if block_size is None:
        return limit
    if isinstance(block_size, bool) or not isinstance(block_size, int):
        raise ValueError(f"{name} must be an integer, got {block_size!r}")
    if not 1 <= block_size <= limit:
        raise ValueError(
            f"{name} {block_size} is outside 1..{limit} (this drafter serves blocks of at "
            f"most {limit} tokens)"
        )
    return block_size
