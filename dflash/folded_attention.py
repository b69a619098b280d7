"""Attention of a verify or draft block as one matrix product per KV head.

A verify block has ``S`` (2 to 32) queries per head and reads every key of the
layer. With grouped-query attention the ``G = Hq / Hkv`` query heads of a KV head
all read the same keys, so their ``G * S`` query rows can share one product with
the keys: ``scores = (q * scale) @ K^T`` is a single ``(G*S, D) x (D, L)`` GEMM per
KV head, then a softmax and ``P @ V``. That reads ``K`` and ``V`` once, on the
GPU's matrix units.

mlx's fused attention on CUDA serves 16 queries through cuDNN, which parallelises
over (head, query tile) only: 32 query heads of one 16-query tile each walk all
``L`` keys, so one call over 32k keys costs far more than the bytes it reads. The
folded form is the route :func:`dflash.kernel_patch.attention_route` installs on CUDA for the block
forwards where it measured faster (:data:`FOLDED_BY_DEFAULT`,
``benchmarks/attention_route.py``, ``docs/benchmarks/``). It is plain mlx ops: the
CPU runs the same code in tests.

Numerics: the scores are rounded to the queries' dtype before a precise (float32)
softmax, as mlx's own unfused attention does; the result is not bit-identical to
cuDNN's (nor is cuDNN's to mlx-lm's one-query decode kernel), so on the GPU a
verify may differ from plain decoding only where two logits nearly tie, as before.
"""

from __future__ import annotations

from typing import Any, Optional

import mlx.core as mx

from .metal.backend import count_switch, env_switch

# Block forwards the route serves: verify and draft blocks, not decode steps (mlx's
# vector kernel) nor prompt chunks.
MIN_QUERIES = 2
MAX_QUERIES = 32
# Shortest key length routed. One H200, 16 queries, 13 calls at once, per call: folded /
# fused 83 / 69 us at 2,064 keys, 77 / 84 at 4,096, 192 / 364 at 32,768
# (docs/benchmarks/h200-2026-12-01-s7/attention-route.json). ``DFLASH_FOLDED_MIN_KEYS``
# overrides it (read at import).
MIN_KEYS = count_switch("DFLASH_FOLDED_MIN_KEYS", 4096)

# Whether attention_route installs the folded route when nobody says, per backend.
# CUDA: measured faster for 16 queries from 4k keys on (one H200, mlx 0.32.4; see
# MIN_KEYS). Metal and the CPU: not measured, so mlx's fused attention stays.
FOLDED_BY_DEFAULT = {"cuda": True, "metal": False}
FOLDED_ENV = "DFLASH_FOLDED_ATTENTION"


def _mask_fits(shape: tuple, batch: int, heads: int, count: int, length: int) -> bool:
    """Whether a mask of ``shape`` broadcasts to ``(B, Hq, S, L)`` in a way the fold keeps.

    mlx-lm's masks: 2-D ``(S, L)``; 3-D ``(H, S, L)``; 4-D ``(B, H, S, L)``; with ``H`` 1
    or ``Hq`` (numpy broadcasting, sizes 1 allowed). Other ranks keep mlx's attention.
    """
    if not 2 <= len(shape) <= 4:
        return False
    if shape[-1] not in (1, length) or shape[-2] not in (1, count):
        return False
    if len(shape) >= 3 and shape[-3] not in (1, heads):
        return False
    return len(shape) < 4 or shape[0] in (1, batch)


def _mask_5d(mask: mx.array, heads: int, kv_heads: int) -> mx.array:
    """A mask :func:`_mask_fits` accepts, broadcastable to scores ``(B, Hkv, G, S, L)``."""
    if mask.ndim <= 2:
        return mask
    if mask.ndim == 3:
        mask = mask[None]
    if mask.shape[1] == 1:
        return mask[:, :, None]
    group = heads // kv_heads
    return mask.reshape(mask.shape[0], kv_heads, group, *mask.shape[2:])


def causal_block_mask(count: int, live: int, rows: int) -> mx.array:
    """Queries at the last ``count`` of ``live`` positions over ``rows >= live`` key rows.

    Query ``i`` sits at position ``live - count + i`` and sees keys up to it; rows past
    ``live`` (a bucket's tail) are hidden. mlx-lm's ``"causal"`` is ``live == rows``.

    Shapes: returns bool ``(S, rows)``.
    """
    positions = mx.arange(live - count, live)[:, None]
    return mx.arange(rows)[None] <= positions


def serves(
    queries: mx.array,
    keys: mx.array,
    values: mx.array,
    mask: Any,
    sinks: Any = None,
    min_keys: Optional[int] = None,
) -> bool:
    """Whether :func:`folded_attention` takes this call.

    Args:
        queries, keys, values, mask, sinks: The attention call's arguments.
        min_keys: Shortest key length served (None: :data:`MIN_KEYS`, read per call).

    Returns:
        True for 2 to 32 queries over at least ``min_keys`` keys, no sinks, matching
        dtypes and head counts, and a mask :func:`folded_attention` takes.

    Shapes: queries ``(B, Hq, S, D)``; keys, values ``(B, Hkv, L, D)``.
    """
    min_keys = MIN_KEYS if min_keys is None else min_keys
    if sinks is not None or queries.ndim != 4 or keys.ndim != 4:
        return False
    batch, heads, count, dim = queries.shape
    if not (MIN_QUERIES <= count <= MAX_QUERIES) or keys.shape[2] < min_keys:
        return False
    if keys.shape != values.shape or keys.shape[0] != batch or keys.shape[3] != dim:
        return False
    if keys.shape[1] < 1 or heads % keys.shape[1]:
        return False
    if keys.dtype != queries.dtype or values.dtype != queries.dtype:
        return False
    if mask is None or (isinstance(mask, str) and mask == "causal"):
        return True
    return isinstance(mask, mx.array) and _mask_fits(
        tuple(mask.shape), batch, heads, count, keys.shape[2]
    )


def folded_attention(
    queries: mx.array,
    keys: mx.array,
    values: mx.array,
    scale: float,
    mask: Any = None,
) -> mx.array:
    """``softmax(q k^T * scale + mask) v`` with each KV head's query heads in one GEMM.

    Same contract as ``mx.fast.scaled_dot_product_attention`` for the calls
    :func:`serves` accepts: ``mask`` None, ``"causal"`` (queries at the last ``S``
    key positions), a boolean array (True: the key is seen) or an additive array,
    broadcastable to ``(B, Hq, S, L)``.

    Args:
        queries: Queries.
        keys: Keys (grouped-query: ``Hq`` a multiple of ``Hkv``).
        values: Values.
        scale: Score scale.
        mask: The attention mask.

    Returns:
        The attention output in the queries' dtype.

    Shapes: queries ``(B, Hq, S, D)``; keys, values ``(B, Hkv, L, D)``; returns
    ``(B, Hq, S, D)``.
    """
    batch, heads, count, dim = queries.shape
    kv_heads, length = keys.shape[1], keys.shape[2]
    group = heads // kv_heads
    # (B, Hkv, G*S, D): the G query heads of a KV head share one product with its keys.
    rows = (queries * mx.array(scale, queries.dtype)).reshape(
        batch, kv_heads, group * count, dim
    )
    scores = (rows @ keys.swapaxes(-1, -2)).reshape(
        batch, kv_heads, group, count, length
    )
    if isinstance(mask, str):
        mask = causal_block_mask(count, length, length)
    if mask is not None:
        mask = _mask_5d(mask, heads, kv_heads)
        if mask.dtype == mx.bool_:
            floor = mx.array(mx.finfo(scores.dtype).min, scores.dtype)
            scores = mx.where(mask, scores, floor)
        else:
            scores = scores + mask.astype(scores.dtype)
    weights = mx.softmax(scores, axis=-1, precise=True)
    out = weights.reshape(batch, kv_heads, group * count, length) @ values
    return out.reshape(batch, heads, count, dim)


def wanted(backend_name: Optional[str], use_folded: Optional[bool] = None) -> bool:
    """Whether :func:`~dflash.kernel_patch.attention_route` installs the folded route.

    Args:
        backend_name: ``"cuda"``, ``"metal"`` or None (CPU).
        use_folded: True / False decide; None asks ``DFLASH_FOLDED_ATTENTION``
            (``1`` / ``0``), then :data:`FOLDED_BY_DEFAULT` for the backend.

    Returns:
        The decision.
    """
    if use_folded is not None:
        return bool(use_folded)
    told = env_switch(FOLDED_ENV)
    return FOLDED_BY_DEFAULT.get(backend_name or "", False) if told is None else told
