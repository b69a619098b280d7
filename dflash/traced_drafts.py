"""The drafter's decoder layer as two compiled replays around its attention (opt-in).

A DFlash round drafts through five bf16 layers whose host work is not traced: on the
H200 a held-patch draft layer took 0.30 ms of the host's time against ~0.74 ms wall
(session 29), ~1.4 ms a round, beside ~0.15 ms a traced target layer. The Python of a
draft layer does the same thing every round; only the position and the context
plane's rows change. So, as :mod:`dflash.traced_layers` does for the target, a served
call of a :class:`~dflash.drafter.DraftDecoderLayer` runs as:

1. one replay of the **pre-attention trace**: the input norm, the q / k / v
   projections (one launch when they share a stack) and the q / k norms and RoPE as
   one :func:`~dflash.metal.heads.launch_head_prep`, whose integers (the position
   among them) come in as an array;
2. the attention over the context plane and the block in place, eager (its plan
   follows the plane's rows, which grow every round): :func:`attend`;
3. one replay of the **post-attention trace**: the output projection and residual,
   the post-attention norm, the MLP and the last residual.

Each trace is ``mx.compile`` of the Python the eager patched layer runs (with the
drafter's head prep), so it makes the same launches with the same inputs. Served:
layers without DFlash2's dynamic convolutions, blocks of at most the route's rows,
heads :func:`prep_arguments` serves. Off unless asked (``DFLASH_DRAFTER_TRACED=1`` or
``KernelPatch(drafter_traced=True)``): on the H200 (session 47) the draft's device
time with it and the head prep was 2.09 ms against 2.10 without either, so it stays
opt-in.
"""

from __future__ import annotations

from functools import partial
from typing import Any, Dict, Optional

import mlx.core as mx
import mlx.nn as nn

from .metal import heads
from .metal.attention import KeyPlane, small_query_attention
from .traced_layers import LayerTraces, _replay

DRAFTER_TRACED_ENV = "DFLASH_DRAFTER_TRACED"


def prep_arguments(
    module: nn.Module,
    rope: nn.Module,
    queries: Optional[mx.array],
    keys: mx.array,
    max_rows: int,
) -> Optional[Dict[str, Any]]:
    """:func:`~dflash.metal.heads.head_prep`'s norm and RoPE arguments for a draft
    attention's heads, or None where they keep the module's own ops: more rows than
    ``max_rows`` (a prefill), or heads :func:`heads_served` refuses. With no queries (a
    context append) the keys' norm stands in both slots.

    Shapes: queries ``(b, n, n_heads, D)`` or None, keys ``(b, n, n_kv, D)``.
    """
    dtypes = {keys.dtype} | ({queries.dtype} if queries is not None else set())
    if not (
        keys.shape[1] <= max_rows
        and len(dtypes) == 1
        and heads_served(module, rope, keys.dtype)
    ):
        return None
    return _norms_and_rope(
        module, rope, module.k_norm if queries is None else module.q_norm
    )


def _norms_and_rope(
    module: nn.Module, rope: nn.Module, query_norm: nn.Module
) -> Dict[str, Any]:
    """The head prep's keyword arguments: ``query_norm`` in the queries' slot, the
    module's ``k_norm`` in the keys', and ``rope``'s base and scale."""
    return {
        "eps": query_norm.eps,
        "k_eps": module.k_norm.eps,
        "q_weight": query_norm.weight,
        "k_weight": module.k_norm.weight,
        "rope_base": rope.base,
        "rope_scale": rope.scale,
    }


def heads_served(module: nn.Module, rope: nn.Module, dtype: mx.Dtype) -> bool:
    """Whether a draft attention's heads of ``dtype`` can take the head prep: its q / k
    norms are ``nn.RMSNorm`` with a weight in ``dtype`` and its RoPE mlx's default
    form over the whole head."""
    return heads.rope_served(rope, module.head_dim) and all(
        type(norm) is nn.RMSNorm and norm.weight.dtype == dtype
        for norm in (module.q_norm, module.k_norm)
    )


def attend(
    module: nn.Module,
    queries: mx.array,
    block_keys: mx.array,
    block_values: mx.array,
    plane: Any,
    start: int,
    chunk: int,
    use_kernel: Optional[bool],
) -> mx.array:
    """A draft attention's block over its context plane and its own keys, in place.

    Shapes: queries ``(b, n_heads, B, D)``, block keys and values ``(b, n_kv, B, D)``;
    returns ``(b, n_heads, B, D)``.
    """
    if plane.keys is None:
        context = KeyPlane(block_keys[:, :, :0], block_values[:, :, :0], 0, start, 0)
    else:
        context = KeyPlane(
            plane.keys, plane.values, plane.rows, start - plane.rows, plane.begin
        )
    return small_query_attention(
        queries,
        context,
        block_keys,
        block_values,
        scale=module.scale,
        window=module.window,
        causal=module.causal,
        query_start=start,
        chunk=chunk,
        use_kernel=use_kernel,
    )


def serves(layer: nn.Module, rope: nn.Module) -> bool:
    """Whether :func:`layer_forward` can stand for ``layer``'s calls: a draft layer
    without dynamic convolutions whose projections compute in its norms' dtype, with
    heads :func:`heads_served` and the head-prep kernel take."""
    attn = getattr(layer, "self_attn", None)
    if getattr(layer, "has_conv", True) or attn is None:
        return False
    dtype = attn.q_norm.weight.dtype
    projections = (attn.q_proj, attn.k_proj, attn.v_proj)
    return (
        all(getattr(p, "scales", p.weight).dtype == dtype for p in projections)
        and heads_served(attn, rope, dtype)
        and heads.kernel_serves(attn.head_dim, dtype)
    )


def takes(layer: nn.Module, h: mx.array, max_rows: int) -> bool:
    """Whether a call of a layer :func:`serves` takes the traced form: a block of at
    most ``max_rows`` rows in the layer's dtype."""
    return (
        h.ndim == 3
        and 0 < h.shape[0] * h.shape[1] <= max_rows
        and h.dtype == layer.self_attn.q_norm.weight.dtype
    )


def _pre_attention(
    layer: nn.Module, prep: heads.Prep, h: mx.array, prep_ints: mx.array
) -> tuple:
    """The input norm, the projections and the head prep.

    Shapes: h ``(b, B, H)``; returns queries ``(b, n_heads, B, D)``, keys and values
    ``(b, n_kv, B, D)``.
    """
    attn = layer.self_attn
    x = layer.input_layernorm(h)
    queries = attn.split_heads(attn.q_proj, x, attn.n_heads)
    keys = attn.split_heads(attn.k_proj, x, attn.n_kv_heads)
    values = attn.split_heads(attn.v_proj, x, attn.n_kv_heads)
    queries, keys = heads.launch_head_prep(queries, keys, prep, prep_ints)
    return (
        queries.transpose(0, 2, 1, 3),
        keys.transpose(0, 2, 1, 3),
        values.transpose(0, 2, 1, 3),
    )


def _post_attention(layer: nn.Module, h: mx.array, attended: mx.array) -> mx.array:
    """The output projection and residual, the post-attention norm, the MLP and the
    last residual.

    Shapes: h ``(b, B, H)``, attended ``(b, n_heads, B, D)``; returns ``(b, B, H)``.
    """
    batch, block, _ = h.shape
    merged = attended.transpose(0, 2, 1, 3).reshape(batch, block, -1)
    h = h + layer.self_attn.o_proj(merged)
    return h + layer.mlp(layer.post_attention_layernorm(h))


def layer_forward(
    layer: nn.Module,
    h: mx.array,
    plane: Any,
    rope: nn.Module,
    start: int,
    chunk: int,
    use_kernel: Optional[bool],
    slot: str,
) -> mx.array:
    """A served draft-layer call as two replays and the attention between them.

    Args:
        layer: The draft layer (its projections patched); :func:`serves` took it.
        h: The layer's input; at most the route's rows.
        plane: The layer's context plane (``keys`` None before any append).
        rope: The drafter's rotary embedding.
        start: The block's first position.
        chunk: Keys per chunk of the attention's reduction order.
        use_kernel: The attention's ``use_kernel``.
        slot: Where the layer keeps its :class:`~dflash.traced_layers.LayerTraces`.

    Shapes: h ``(b, B, H)``; returns ``(b, B, H)``.
    """
    traces = _draft_traces(layer, slot)
    attn = layer.self_attn
    batch, block, _ = h.shape
    q_shape = (batch, block, attn.n_heads, attn.head_dim)
    at_start = _prep_of(attn, rope, start)
    ints = heads.head_prep_ints(q_shape, attn.n_kv_heads, at_start, False)
    # The trace reads the position from ``ints``; its prep's own start is not read.
    pre = _replay(
        traces.pre,
        (h.shape, h.dtype, rope.base, rope.scale),
        lambda: partial(_pre_attention, layer, _prep_of(attn, rope, 0)),
    )
    queries, keys, values = pre(h, ints)
    attended = attend(attn, queries, keys, values, plane, start, chunk, use_kernel)
    post = _replay(
        traces.post,
        (h.shape, h.dtype, attended.shape),
        lambda: partial(_post_attention, layer),
    )
    return post(h, attended)


def _prep_of(attn: nn.Module, rope: nn.Module, start: int) -> heads.Prep:
    """The head prep of a draft attention's block at position ``start``."""
    return heads.Prep(**_norms_and_rope(attn, rope, attn.q_norm), start=start)


def _draft_traces(layer: nn.Module, slot: str) -> LayerTraces:
    """The layer's traces, made again when any of its arrays was replaced."""
    traces: Optional[LayerTraces] = layer.__dict__.get(slot)
    if traces is None or not traces.holds():
        traces = layer.__dict__[slot] = LayerTraces.of(layer, kind=-1)
    return traces
