"""Muse Glimmer's decoder layer as two compiled replays a call.

A 4-bit verify layer launches ~15 kernels, but the host pays far more for building
them than the device for running them: on the H200's host ~200-350 µs of Python a
layer (the patched projections' wrappers, the head prep, the attention route) and
~150-250 µs of encode, against ~290 µs of device time (sessions 18-22). Most of that
Python does the same thing at every step; only the cache's bookkeeping and a few
integers change. So for the calls the kernel route serves (decode steps and verify
blocks over a dflash KV plane), :func:`layer_forward` runs a layer as:

1. one replay of the **pre-attention trace**: the input norm, the fused q/k/v/gate
   launch and the head prep, whose integers (the RoPE position among them) come in as
   an array;
2. the plane's bookkeeping in Python: the block is handed to
   ``update_and_fetch_block`` (held back under a checkpoint, written otherwise) and the
   attention's plan is made, as the route makes it;
3. one replay of the **post-attention trace**: the attention's chunk pass and gated
   fold over the plane in place (their integers an input), the output projection, the
   post-attention norm and residual, the MLP with its norms, and the last residual.

Each trace is ``mx.compile`` of the same Python the eager route runs, so it adds the
same launches with the same inputs: the same bits (the CUDA tests compare the two
bit for bit). A trace is kept per input geometry (the plan's launch shapes included),
at most :data:`MAX_TRACES` a layer, and dropped when any array of the layer is
replaced. Launches that need zeroed counters (the matmul's merged K split) take them
from one counters array per replay, cut from the pool outside the trace
(:class:`dflash.metal.groups.CounterFeed`), so no fill runs inside a replay and no two
replays share a counter.

Only layers of exactly the re-stated class are taken, and only after
:func:`forward_matches` shows that the re-statement (:func:`reference_forward`) gives
the class's own bits. The traces need the kernel path and ``mx.compile``
(:func:`dflash.metal.backend.compile_wanted`: CUDA by default); calls they do not
serve (prefill chunks, other caches, masks the route refuses) run the layer's own
forward, the patched attention and projections included.

On by default wherever the kernel patch can serve it (``DFLASH_TRACED_LAYERS=0`` or
``KernelPatch(traced_layers=False)`` turns it off). Measured on an H200 (session 23,
``docs/benchmarks/h200-2026-12-02-s23``), full-size 4-bit Glimmer over a 4k context:
the same bits as the eager layers (8 layers, and the ``cuda`` tests over moving
positions), 14.25 kernels a verify layer against 15.25 (``mx.compile`` fuses the
MLP's ``nn.silu`` with its product by ``up``), the host's build of a verify layer 206-241 µs against 329-353, and
DFlash rounds at tau = 6 faster in 10 of 12 pairs (median ratios 0.85 and 0.74),
lossless in every run.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial
from operator import is_
from typing import Any, Callable, Dict, List, Optional, Tuple

import mlx.core as mx
import mlx.nn as nn

from .cache.plane import RingPlane
from .metal import attention, backend, groups, heads
from .residual_layers import NORMS, layer_geometry

TRACED_LAYERS_ENV = "DFLASH_TRACED_LAYERS"
# (module, class name) of the decoder-layer forwards this module re-states (mlx-lm
# 0.32.2).
TRACED_CLASSES = frozenset({("mlx_lm.models.muse_glimmer", "DecoderLayer")})
# Traces kept a layer (a full layer's plan changes shape every chunk of keys).
MAX_TRACES = 16

# The probe's verdict per (class, dtype, layer geometry).
_VERDICTS: Dict[Tuple[type, mx.Dtype, tuple], bool] = {}


def traced_layers_wanted(use_traced_layers: Optional[bool] = None) -> bool:
    """Whether the kernel patch runs served decoder-layer calls as two compiled
    replays: the argument decides, else ``DFLASH_TRACED_LAYERS``, else on (measured
    faster on the H200; module docstring).

    Raises:
        ValueError: ``DFLASH_TRACED_LAYERS`` is set to something that is not a switch
            value.
    """
    return backend.strict_switch(TRACED_LAYERS_ENV, use_traced_layers)


def serves(layer: nn.Module) -> bool:
    """Whether :func:`layer_forward` can stand for ``layer``'s forward: exactly a class
    of :data:`TRACED_CLASSES` with the attention, MLP and four norms it reads."""
    base = type(layer)
    if (base.__module__, base.__name__) not in TRACED_CLASSES:
        return False
    return all(hasattr(layer, name) for name in ("self_attn", "mlp") + NORMS)


def kernels_take(layer: nn.Module, chunk: int) -> bool:
    """Whether the traces' launches take ``layer``'s calls as the eager route would
    take them with the kernel path on: the head prep and the attention kernels serve
    its heads (and ``chunk``), and the output gate comes out in the queries' dtype (the
    eager route's condition for the gated fold).

    Args:
        layer: A layer :func:`serves` takes.
        chunk: Keys per chunk of the route's attention.
    """
    attn = layer.self_attn
    dtypes = {_projection_dtype(attn.q_proj), _projection_dtype(attn.gate_proj)}
    dim = attn.head_dim
    return (
        len(dtypes) == 1
        and heads.kernel_serves(dim, dtypes.pop())
        and 8 <= dim <= attention.KERNEL_MAX_DIM
        and 1 <= chunk <= attention.KERNEL_MAX_CHUNK
    )


def _projection_dtype(projection: nn.Module) -> mx.Dtype:
    """The dtype a projection computes in (its scales' or weight's)."""
    return getattr(projection, "scales", projection.weight).dtype


def reference_forward(
    layer: nn.Module, x: mx.array, mask: Any = None, cache: Any = None
) -> mx.array:
    """The Glimmer layer as this module splits it: the attention, then
    :func:`_after_attention`. What :func:`forward_matches` holds to the class's own.

    Shapes: x ``(B, L, H)``; returns ``(B, L, H)``.
    """
    return _after_attention(
        layer, x, layer.self_attn(layer.input_layernorm(x), mask, cache)
    )


def _after_attention(layer: nn.Module, x: mx.array, attended: mx.array) -> mx.array:
    """The post-attention norm and residual, then the MLP with its norms and residual.

    Shapes: x, attended ``(B, L, H)``; returns ``(B, L, H)``.
    """
    h = x + layer.post_attention_layernorm(attended)
    return h + layer.post_feedforward_layernorm(
        layer.mlp(layer.pre_feedforward_layernorm(h))
    )


def forward_matches(layer: nn.Module, base: type) -> bool:
    """Whether :func:`reference_forward` gives ``base``'s own forward's bits on a probe
    input for ``layer`` (cached per class, dtype and geometry: a verdict found on one
    model's layers must not decide for another's)."""
    dtype = layer.post_attention_layernorm.weight.dtype
    verdict = (base, dtype, layer_geometry(layer))
    if verdict not in _VERDICTS:
        hidden = layer.post_attention_layernorm.weight.shape[0]
        probe = mx.random.normal((1, 3, hidden), key=mx.random.key(0)).astype(dtype)
        own = base.__call__(layer, probe, None, None)
        ours = reference_forward(layer, probe)
        _VERDICTS[verdict] = own.dtype == ours.dtype and bool(mx.array_equal(own, ours))
    return _VERDICTS[verdict]


# ------------------------------------------------------------------ the traces


def _pre_attention(
    layer: nn.Module, prep: heads.Prep, x: mx.array, prep_ints: mx.array
) -> Tuple[mx.array, mx.array, mx.array]:
    """The input norm, the projections and the head prep (the prepared attention's
    first half, in its order).

    Shapes: x ``(B, L, H)``; returns queries ``(B, L, Hq, D)``, the stacked block
    ``(2, B, Hkv, L, D)`` and the gate ``(B, L, Hq * D)``.
    """
    attn = layer.self_attn
    batch, length, _ = x.shape
    h = layer.input_layernorm(x)
    queries = attn.q_proj(h).reshape(batch, length, attn.n_heads, attn.head_dim)
    keys = attn.k_proj(h).reshape(batch, length, attn.n_kv_heads, attn.head_dim)
    values = attn.v_proj(h).reshape(batch, length, attn.n_kv_heads, attn.head_dim)
    queries, block = heads.launch_head_prep(queries, keys, prep, prep_ints, values)
    return queries, block, attn.gate_proj(h)


def _post_attention(
    layer: nn.Module,
    form: attention.KernelForm,
    x: mx.array,
    queries: mx.array,
    gate: mx.array,
    *arrays: mx.array,
) -> mx.array:
    """The gated attention over the plane in place, the output projection and the rest
    of the layer.

    Args:
        layer, form: What the trace is of.
        x: The layer's input (the residual).
        queries: The prepared queries.
        gate: The output gate, as its projection gives it.
        *arrays: :func:`dflash.metal.attention.launch_attention`'s arrays after the
            queries: the bound plane and block, then the integer and float scalars.

    Shapes: x ``(B, L, H)``; queries ``(B, L, Hq, D)``; gate ``(B, L, Hq * D)``;
    returns ``(B, L, H)``.

    Besides the launches, the trace holds only the views the matmuls' counters and
    the fused projections' members need: each view is one more array that every
    replay builds and mlx's encode visits.
    """
    attn = layer.self_attn
    batch, length, _ = x.shape
    # The fold reads the gate and stores its result with the heads merged, as the
    # output projection takes it: no view between the launches.
    stored = (batch, length, attn.n_heads * attn.head_dim)
    out = attention.launch_attention(form, queries, *arrays, gate, stored)
    return _after_attention(layer, x, attn.o_proj(out))


class _Replay:
    """One trace of a layer half: its compiled function and the counters a call takes.

    The first call runs the half eagerly and counts the counters its launches take;
    later calls replay the trace with one fresh pool region of that many.
    """

    __slots__ = ("function", "compiled", "counters")

    def __init__(self, function: Callable) -> None:
        self.function = function
        self.compiled: Optional[Callable] = None
        self.counters = 0

    def __call__(self, *inputs: mx.array) -> Any:
        if self.compiled is None:
            with groups.counter_feed(groups.CounterFeed()) as feed:
                out = self.function(*inputs)
            self.counters = feed.taken
            self.compiled = backend.compile_traced(self._fed)
            return out
        counters = groups.COUNTER_POOL.take(max(self.counters, 1))
        return self.compiled(counters, *inputs)

    def _fed(self, counters: mx.array, *inputs: mx.array) -> Any:
        with groups.counter_feed(groups.CounterFeed(counters)):
            return self.function(*inputs)


@dataclass
class LayerTraces:
    """A layer's traces and the arrays its modules held when they were made.

    Attributes:
        modules, names, arrays: Every array of the layer then, as
            ``modules[i][names[i]] is arrays[i]``.
        sizes: Each module of the layer and its number of entries then.
        pre: Pre-attention replays per input shape and dtype.
        post: Post-attention replays per geometry (input shapes, the attention form).
    """

    modules: List[nn.Module]
    names: List[str]
    arrays: List[mx.array]
    sizes: Tuple[List[nn.Module], List[int]]
    pre: Dict[tuple, _Replay] = field(default_factory=dict)
    post: Dict[tuple, _Replay] = field(default_factory=dict)

    @classmethod
    def of(cls, layer: nn.Module) -> "LayerTraces":
        every = layer.modules()
        held = [
            (module, name, value)
            for module in every
            for name, value in module.items()
            if isinstance(value, mx.array)
        ]
        modules, names, arrays = (list(column) for column in zip(*held))
        return cls(modules, names, arrays, (every, list(map(len, every))))

    def holds(self) -> bool:
        """Whether every module still holds the very arrays traced, and no module
        gained or lost an entry (one C-level pass: this runs at every layer call)."""
        every, sizes = self.sizes
        return all(map(is_, map(dict.get, self.modules, self.names), self.arrays)) and (
            list(map(len, every)) == sizes
        )


def _traces(layer: nn.Module, slot: str) -> LayerTraces:
    traces: Optional[LayerTraces] = layer.__dict__.get(slot)
    if traces is None or not traces.holds():
        traces = layer.__dict__[slot] = LayerTraces.of(layer)
    return traces


def _replay(table: Dict[tuple, _Replay], key: tuple, make: Callable) -> _Replay:
    replay = table.get(key)
    if replay is None:
        if len(table) >= MAX_TRACES:
            table.clear()  # plans of long-gone positions
        replay = table[key] = _Replay(make())
    return replay


# ------------------------------------------------------------------ the forward


def prep_of(attn: nn.Module, start: int) -> heads.Prep:
    """The head prep Glimmer's attention asks for at position ``start``."""
    rope = attn.rope if attn.use_rope else None
    return heads.Prep(
        attn.eps,
        q_scale=attn.qk_scale_factor,
        rope_base=None if rope is None else rope.base,
        rope_scale=1.0 if rope is None else rope.scale,
        start=start if rope is not None else 0,
    )


def layer_forward(
    layer: nn.Module,
    x: mx.array,
    cache: Any,
    chunk: int,
    key_source: Callable,
    slot: str,
) -> mx.array:
    """A served Glimmer decoder-layer call as two replays (module docstring).

    The caller has checked that the call is served (:func:`dflash.kernel_patch`'s
    traced class): at most ``max_queries`` tokens, a head-major dflash plane with a
    buffer, a mask the route derives from positions, the kernel path and compile on.

    Args:
        layer: The Glimmer decoder layer (its attention and projections patched).
        x: The layer's input.
        cache: The layer's dflash plane.
        chunk: Keys per chunk of the attention's reduction order (the route's).
        key_source: The route's ``(plane, keys, values, count, window) -> (KeyPlane,
            block_keys, block_values)``.
        slot: Where the layer keeps its :class:`LayerTraces`.

    Shapes: x ``(B, L, H)``; returns ``(B, L, H)``.
    """
    traces = _traces(layer, slot)
    attn = layer.self_attn
    batch, length, _ = x.shape
    prep = prep_of(attn, cache.offset)
    q_shape = (batch, length, attn.n_heads, attn.head_dim)
    prep_ints = heads.head_prep_ints(q_shape, attn.n_kv_heads, prep, True)
    pre = _replay(
        traces.pre, (x.shape, x.dtype), lambda: partial(_pre_attention, layer, prep)
    )
    queries, block, gate = pre(x, prep_ints)

    fetched = cache.update_and_fetch_block(block, fetch=False)
    keys, values = (None, None) if fetched is None else fetched
    window = cache.window if isinstance(cache, RingPlane) else None
    plane, block_keys, block_values = key_source(cache, keys, values, length, window)
    plan = attention.make_plan(
        queries.transpose(0, 2, 1, 3), plane, block_keys, block_values,
        window=window, causal=True, query_start=cache.offset - length, chunk=chunk,
    )  # fmt: skip
    form = attention.kernel_form(plan, queries.dtype, gated=True)
    bound = attention.bound_arrays(plan, plane, block_keys, block_values)
    floats = groups.float_params(float(attn.scale), 0.0)
    launch = form.launch
    geometry = (form.spec, launch.chunk_shapes, launch.chunk_groups, launch.out_shape)
    geometry += (launch.fold_groups, form.dtype, x.shape, x.dtype)
    geometry += tuple((array.shape, array.dtype) for array in bound)
    post = _replay(traces.post, geometry, lambda: partial(_post_attention, layer, form))
    return post(x, queries, gate, *bound, launch.ints, floats, launch.fold_ints)
