"""The DFlash training objective for a :class:`dflash.DFlashDrafter`.

A training sequence of ``L`` tokens comes with the target's tapped features at every
position. ``A`` anchors ``a_j`` are drawn per sequence; block ``j`` is
``[token[a_j], mask, ..., mask]`` at positions ``a_j .. a_j + B - 1`` and must predict
``token[a_j + 1 .. a_j + B - 1]``. All blocks of a sequence run in one attention call:
each block query sees the context rows before its anchor (inside the window, on sliding
layers) and the rows of its own block, exactly what :meth:`DFlashDrafter.__call__` sees at
inference with ``a_j`` committed tokens. Position ``k`` of a block is weighted by
``exp(-(k - 1) / decay)`` in the cross-entropy.
"""

from __future__ import annotations

from typing import Optional, Tuple

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from dflash.drafter import DFlashDrafter, DraftDecoderLayer


def rope_at(x: mx.array, positions: mx.array, base: float) -> mx.array:
    """Rotary embedding (non-interleaved halves) at explicit per-row positions.

    Args:
        x: Heads-first rows.
        positions: Absolute position of every row.
        base: RoPE base.

    Returns:
        The rotated rows, in ``x``'s dtype.

    Shapes: x (b, h, n, d), positions (b, n) -> (b, h, n, d).
    """
    half = x.shape[-1] // 2
    inverse = mx.power(base, -mx.arange(0, half, dtype=mx.float32) * 2 / x.shape[-1])
    angles = positions.astype(mx.float32)[:, None, :, None] * inverse
    cos, sin = mx.cos(angles), mx.sin(angles)
    first, second = x[..., :half].astype(mx.float32), x[..., half:].astype(mx.float32)
    out = mx.concatenate(
        [first * cos - second * sin, first * sin + second * cos], axis=-1
    )
    return out.astype(x.dtype)


def block_positions(anchors: mx.array, block_size: int) -> mx.array:
    """Absolute position of every block row, blocks laid end to end.

    Shapes: anchors (b, A) -> (b, A * block_size).
    """
    offsets = mx.arange(block_size)
    return (anchors[:, :, None] + offsets).reshape(anchors.shape[0], -1)


def block_mask(
    anchors: mx.array,
    context_length: int,
    block_size: int,
    window: Optional[int],
    causal: bool = False,
) -> mx.array:
    """Which keys each block query sees: ``[context rows ‖ all block rows]``.

    Args:
        anchors: Anchor position of each block.
        context_length: Number of context rows (the sequence length).
        block_size: Rows per block.
        window: Sliding window of the layer, ``None`` for full attention.
        causal: Causal attention inside a block.

    Returns:
        A boolean mask.

    Shapes: anchors (b, A) -> (b, 1, A*B, context_length + A*B).
    """
    batch, count = anchors.shape
    query_anchor = mx.repeat(anchors, block_size, axis=1)[:, :, None]
    query_position = block_positions(anchors, block_size)[:, :, None]
    context = mx.arange(context_length)[None, None, :]
    visible = context < query_anchor
    if window is not None:
        visible = visible & (query_position - context < window)
    block_of = mx.arange(count * block_size) // block_size
    row_in_block = mx.arange(count * block_size) % block_size
    same = block_of[:, None] == block_of[None, :]
    if causal:
        same = same & (row_in_block[None, :] <= row_in_block[:, None])
    same = mx.broadcast_to(same[None], (batch,) + same.shape)
    return mx.concatenate([visible, same], axis=-1)[:, None]


def _project(attention, x: mx.array, positions: mx.array, base: float):
    batch, rows, _ = x.shape
    keys = attention.k_proj(x).reshape(
        batch, rows, attention.n_kv_heads, attention.head_dim
    )
    values = attention.v_proj(x).reshape(
        batch, rows, attention.n_kv_heads, attention.head_dim
    )
    keys = rope_at(attention.k_norm(keys).transpose(0, 2, 1, 3), positions, base)
    return keys, values.transpose(0, 2, 1, 3)


def _layer(
    layer: DraftDecoderLayer,
    h: mx.array,
    stream: mx.array,
    positions: Tuple[mx.array, mx.array],
    mask: mx.array,
    base: float,
) -> mx.array:
    attention = layer.self_attn
    context_positions, query_positions = positions
    x = layer.input_layernorm(h)
    batch, rows, _ = x.shape
    queries = attention.q_proj(x).reshape(
        batch, rows, attention.n_heads, attention.head_dim
    )
    queries = rope_at(
        attention.q_norm(queries).transpose(0, 2, 1, 3), query_positions, base
    )
    block_keys, block_values = _project(attention, x, query_positions, base)
    context_keys, context_values = _project(attention, stream, context_positions, base)
    keys = mx.concatenate([context_keys, block_keys], axis=2)
    values = mx.concatenate([context_values, block_values], axis=2)
    out = mx.fast.scaled_dot_product_attention(
        queries, keys, values, scale=attention.scale, mask=mask
    )
    h = h + attention.o_proj(out.transpose(0, 2, 1, 3).reshape(batch, rows, -1))
    return h + layer.mlp(layer.post_attention_layernorm(h))


def block_logits(
    drafter: DFlashDrafter, features: mx.array, tokens: mx.array, anchors: mx.array
) -> mx.array:
    """Drafter logits of every block, all anchors of a sequence in one pass.

    Args:
        drafter: A bound drafter without DFlash2 convs.
        features: The target's tapped features of the whole sequence.
        tokens: The sequence.
        anchors: Anchor positions, ``anchor + block_size <= L``.

    Returns:
        Logits; row ``[b, j, i]`` is the drafter's distribution for
        ``tokens[b, anchors[b, j] + i]`` (row 0 sits on the anchor).

    Shapes: features (b, L, k*H), tokens (b, L), anchors (b, A) -> (b, A, B, V).
    """
    config = drafter.config
    if config.has_dynamic_conv:
        raise ValueError("the training objective does not cover DFlash2 convs")
    size = config.block_size
    batch, length = tokens.shape
    positions = block_positions(anchors, size)
    first = mx.take_along_axis(tokens, anchors, axis=1)[:, :, None]
    offsets = mx.arange(size)[None, None, :]
    block = mx.where(offsets == 0, first, config.mask_token_id).reshape(batch, -1)
    stream = drafter.hidden_norm(drafter.fc(features))
    context_positions = mx.broadcast_to(mx.arange(length)[None], (batch, length))
    masks = {}
    h = drafter.embed(block)
    for index, layer in enumerate(drafter.layers):
        window = config.sliding_window if config.is_sliding(index) else None
        key = (window, config.block_causal(index))
        if key not in masks:
            masks[key] = block_mask(anchors, length, size, *key)
        h = _layer(
            layer,
            h,
            stream,
            (context_positions, positions),
            masks[key],
            config.rope_theta,
        )
    logits = drafter.logits(drafter.norm(h))
    return logits.reshape(batch, anchors.shape[1], size, -1)


def position_weights(block_size: int, decay: float = 7.0) -> mx.array:
    """Loss weight of each block row: 0 for the anchor, ``exp(-(k-1)/decay)`` after."""
    k = mx.arange(block_size, dtype=mx.float32)
    return mx.where(k == 0, 0.0, mx.exp(-(k - 1) / decay))


def dflash_loss(
    drafter: DFlashDrafter,
    features: mx.array,
    tokens: mx.array,
    anchors: mx.array,
    decay: float = 7.0,
) -> mx.array:
    """Position-weighted cross-entropy of the drafter's blocks.

    Shapes: features (b, L, k*H), tokens (b, L), anchors (b, A) -> scalar.
    """
    size = drafter.config.block_size
    logits = block_logits(drafter, features, tokens, anchors).astype(mx.float32)
    positions = block_positions(anchors, size).reshape(anchors.shape + (size,))
    labels = mx.take_along_axis(tokens, positions.reshape(tokens.shape[0], -1), axis=1)
    labels = labels.reshape(positions.shape)
    losses = nn.losses.cross_entropy(logits, labels, reduction="none")
    weights = position_weights(size, decay)
    return (losses * weights).sum() / (weights.sum() * anchors.size)


def sample_anchors(
    rng: np.random.Generator, batch: int, count: int, low: int, high: int
) -> np.ndarray:
    """``count`` distinct anchors per row drawn uniformly from ``[low, high]``, sorted.

    Shapes: -> (batch, count) int32.
    """
    if high - low + 1 < count:
        raise ValueError(f"cannot draw {count} distinct anchors from [{low}, {high}]")
    rows = [
        np.sort(rng.choice(np.arange(low, high + 1), size=count, replace=False))
        for _ in range(batch)
    ]
    return np.stack(rows).astype(np.int32)
