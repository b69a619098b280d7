"""Install the verify kernels into a target (and drafter) without editing mlx-lm.

:class:`KernelPatch` routes a model's attention to
:func:`dflash.metal.attention.small_query_attention` and its ``nn.Linear`` /
``nn.QuantizedLinear`` layers to :func:`dflash.metal.qmm.small_row_matmul`, reversibly:

* **Target attention.** Each decoder layer's attention module has its class swapped
  for a subclass of its own class (as :mod:`dflash.taps` does) that marks the call
  as routed; the model module's ``scaled_dot_product_attention`` (the one mlx-lm's
  attention code calls) is replaced, while any patched model of that architecture is
  installed, by a dispatcher that takes the kernel route only inside a routed call,
  with a dflash KV plane as ``cache``, no attention sinks, a causal (or window) mask
  and at most ``max_queries`` queries, and otherwise calls mlx-lm's function
  unchanged. The route reads the plane where it lies: a verify block held back by
  a :class:`~dflash.cache.SpeculativeCheckpoint` is read from the checkpoint beside
  the ring (the staging shadow ``update_and_fetch`` returned is left unevaluated; on
  Metal the fused shadow kernel still runs, as it also builds the held-back block),
  a written chunk from the plane; a staging shadow is read only when the ring was
  overwritten already (a staged chunk outside a checkpoint).
* **Prepared heads** (Muse Glimmer; ``head_prep``, ``DFLASH_HEAD_PREP=0`` off): the
  target's attention forward runs its q/k RMS norms, the query scale and RoPE as one
  :func:`dflash.metal.heads.head_prep` launch for the calls the route serves
  (:mod:`dflash.prepared_heads`; the class is taken only after a probe shows the
  re-stated forward gives the class's own bits), and hands its output gate to the
  route, whose fold applies it (``DFLASH_GATE_EPILOGUE=0`` off).
* **Residual norms** (Muse Glimmer; on inside traced layers on CUDA, measured faster
  there in session 58; for eager layers opt-in, measured slower: ``residual_norms``,
  ``DFLASH_RESIDUAL_NORMS``, :mod:`dflash.residual_layers`): each decoder layer runs its
  post-attention norm, residual add and pre-feedforward norm as one
  :func:`dflash.metal.norms.residual_norm` launch, and its post-feedforward norm and
  add as another, for the calls the route serves (probed as the prepared heads are; a
  tapped layer is left alone, so the generators install the patch before the taps);
  traced layers run the two launches inside their post-attention trace, the second also
  taking the next traced layer's input norm (the hand-off).
* **Traced layers** (Muse Glimmer; ``traced_layers``, ``DFLASH_TRACED_LAYERS=0`` off;
  with the prepared heads, the gate epilogue, the stacked block, the kernel path and
  ``mx.compile``): each decoder layer's served calls run as two compiled replays, the
  plane's bookkeeping and the attention's plan in Python between them
  (:mod:`dflash.traced_layers`; probed as the prepared heads are; the same launches and
  bits, a fraction of the host's Python).
* **Drafter attention.** Each :class:`~dflash.drafter.DraftAttention` gets a
  subclass whose forward attends the context plane and the block's own keys in
  place (the block is not copied into the plane's scratch rows). With
  ``drafter_head_prep`` (or ``DFLASH_DRAFTER_HEAD_PREP=1``; off by default, not yet
  measured on a GPU) its q / k norms and RoPE are one ``head_prep`` launch, with the
  drafter's own bits.
* **Matmuls.** Every ``nn.Linear`` and affine ``nn.QuantizedLinear`` (4 / 8 bits,
  groups 32 / 64 / 128) of the target and the drafter gets a subclass that sends
  calls of at most ``max_queries`` rows to the small-row matmul (prefill chunks
  keep mlx's). Tied embeddings used as the LM head (``as_linear``) are not routed.
  Sibling projections that read one input (q / k / v / gate, an MLP's gate / up) run
  as one launch over their stacked weights (:mod:`dflash.fused_projections`). With
  ``drafter_qkv`` (or ``DFLASH_DRAFTER_FUSED_QKV=1``; off by default, not yet measured
  on a GPU) the drafter's q / k / v share a stack too: its block is one launch and its
  committed context's k / v another.
* **MLP blocks** (``compile_blocks=True`` or ``DFLASH_COMPILED_BLOCKS=1``; off by
  default): with ``matmul``, each MLP whose projections are all routed runs as one
  ``mx.compile`` trace per input geometry.
* **Projections alone** (``projections=True`` without ``matmul``): those sibling
  sets run as one mlx ``matmul`` / ``quantized_matmul`` each, with mlx's kernels
  (fewer, wider launches; nothing else routed). Not batch-invariant beyond what
  mlx's own matmuls are.

Both routes are batch-invariant, so our plain decoding (one query a step) and
DFlash decoding (verify blocks) give every token the same logits bit for bit, as
long as the forward's other ops are batch-invariant too (norms, RoPE and
elementwise ops are row-wise).

``uninstall()`` (or leaving the ``with`` block) restores every class and module
function; nothing else about the model changes (same objects, same parameters), except
that a traced layer keeps its traces in its instance dictionary for the next install with
the same options (``DFLASH_KEEP_TRACES=0`` off; :func:`forget_traces` frees them).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import os
import sys
from dataclasses import dataclass
from functools import partial
from operator import is_
from typing import Any, Callable, Dict, FrozenSet, Iterator, List, Optional, Tuple

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from . import folded_attention as folded
from . import gated_mlp, prepared_heads, residual_layers, traced_drafts
from . import traced_layers as traced_layers_module
from .cache.checkpoint import DEFERRED, RingPlaneCheckpoint
from .cache.plane import KvPlane, RingPlane
from .fused_projections import (
    MEMBER_SLOT,
    FusedProjections,
    MemberSlot,
    fuse_wanted,
    sibling_sets,
)
from .metal import backend, heads, prefetch, qmm, tensor_qmm
from .metal.attention import KeyPlane, small_query_attention, visible_bounds
from .metal.layout import stacked_halves
from .metal.qmm import bind_matmul, compile_around
from .taps import target_layers

# mlx-lm architectures whose attention calls base.scaled_dot_product_attention with the
# layer's cache and a mask from cache.make_mask (checked against their source, tested).
SUPPORTED_ARCHITECTURES = ("muse_glimmer", "llama", "qwen3", "gemma3_text", "cohere2")

# Marks a patched subclass; its value is the class it replaced.
_ORIGINAL_CLASS = "_dflash_kernel_original_class"
# A fused member's MemberSlot (plain attribute of the layer; the traced layers read it).
_FUSED_SLOT = MEMBER_SLOT
# A matmul layer's (or block's) bound forwards by input geometry (plain attribute, while
# installed).
_BOUND = "_dflash_bound"
# Where a traced decoder layer keeps its traces while the patch is installed.
_TRACES = "_dflash_traces"
# Where it keeps them after: (the options they were made under, the traces), for the
# next install with the same options (each generation installs the patch again).
_KEPT_TRACES = "_dflash_kept_traces"
KEEP_TRACES_ENV = "DFLASH_KEEP_TRACES"
# Part of every kept trace's options: :func:`forget_traces` replaces it, so traces kept
# before are never taken again.
_trace_epoch = object()
# Switch for whole MLP blocks through mx.compile (default off: measured slower).
COMPILED_BLOCKS_ENV = "DFLASH_COMPILED_BLOCKS"
# Switch for the drafter's unquantized projections through our small-row kernel
# (off since session 47: on mlx's matmul the H200 ran the draft in 12 % less device
# time, its host share 38 % lower; ``DFLASH_DRAFTER_DENSE_KERNEL=1`` takes the kernel).
DRAFTER_DENSE_ENV = "DFLASH_DRAFTER_DENSE_KERNEL"
# Switch for the drafter's q / k / v as one stack (default off: the H200 measured the
# draft's device time 2 % lower with it in session 47, within what one run separates).
DRAFTER_QKV_ENV = "DFLASH_DRAFTER_FUSED_QKV"
STACKED_KV_ENV = "DFLASH_STACKED_KV"
# Switch for the drafter's q / k norms and RoPE as one launch (default off: likewise,
# 2.4 % lower).
DRAFTER_HEAD_PREP_ENV = "DFLASH_DRAFTER_HEAD_PREP"

# The route of the attention call in progress (None: not a patched call).
_ACTIVE: contextvars.ContextVar[Optional["AttentionRoute"]] = contextvars.ContextVar(
    "dflash_kernel_route", default=None
)


@dataclass(frozen=True)
class AttentionRoute:
    """How a routed attention call runs.

    Attributes:
        use_kernel: Passed to :func:`small_query_attention` (None: kernel on a GPU).
        max_queries: Calls with more queries (prefill chunks) keep mlx's attention.
        chunk: Keys per chunk of the fixed reduction order.
        gate_epilogue: Prepared Glimmer attention hands its output gate to the route,
            which applies it in the attention's last pass.
        kv_block: Prepared Glimmer attention has its head prep write the stacked K/V
            block a dflash plane stores.
        swiglu: Gated MLPs run their activation inside the fused gate / up launch.
        draft_head_prep: The drafter's attention prepares its heads (q / k norms and
            RoPE) in one launch.
        residual_norms: Traced Glimmer layers run their norm-add(-norm) groups as
            residual-norm launches (:mod:`dflash.residual_layers`).
        stacked_kv: The attention binds a plane's stacked K/V buffer and a held-back
            block whole, its values at an offset (:func:`stacked_kv_wanted`).
    """

    use_kernel: Optional[bool] = None
    max_queries: int = 32
    chunk: int = 256
    gate_epilogue: bool = True
    kv_block: bool = True
    swiglu: bool = False
    draft_head_prep: bool = False
    residual_norms: bool = False
    stacked_kv: bool = True

    @property
    def key_source(self) -> Callable:
        """The ``(plane, keys, values, count, window) -> (KeyPlane, block_keys,
        block_values)`` of this route's calls."""
        return _stacked_key_source if self.stacked_kv else _key_source

    def takes(self, cache: Any, count: int, mask: Any) -> bool:
        """Whether the route serves ``count`` queries over ``cache`` with ``mask``: a
        head-major dflash plane with a buffer, at most ``max_queries`` queries, a mask
        of positions (:func:`_plain_mask`)."""
        return (
            isinstance(cache, KvPlane)
            and cache.head_major
            and cache.kv is not None
            and count <= self.max_queries
            and _plain_mask(mask, count)
        )

    def attend(
        self,
        queries: mx.array,
        keys: mx.array,
        values: mx.array,
        cache: Any,
        scale: float,
        mask: Any,
        gate: Optional[mx.array] = None,
    ) -> Optional[mx.array]:
        """The routed attention, or None when this call must keep mlx's.

        ``keys`` / ``values`` are what ``cache.update_and_fetch`` returned; they are read
        only when the plane no longer holds the rows (a staged chunk outside a checkpoint).
        ``gate``: multiply the result by ``mx.sigmoid(gate)`` (inside the kernel).

        Shapes: queries ``(B, Hq, S, D)``; gate ``(B, S, Hq * D)``; returns
        ``(B, Hq, S, D)``.
        """
        count = queries.shape[2]
        if not self.takes(cache, count, mask):
            return None
        window = cache.window if isinstance(cache, RingPlane) else None
        plane, block_keys, block_values = self.key_source(
            cache, keys, values, count, window
        )
        return small_query_attention(
            queries,
            plane,
            block_keys,
            block_values,
            scale=float(scale),
            window=window,
            causal=True,
            query_start=cache.offset - count,
            chunk=self.chunk,
            gate=gate,
            use_kernel=self.use_kernel,
        )


def _plain_mask(mask: Any, count: int) -> bool:
    """Whether ``mask`` is one a dflash cache makes: causal (plus window) and nothing else.

    Those are None (one query), ``"causal"``, or a 2-D boolean ``(S, keys)`` array (the
    staged window mask, an explicit causal mask); the kernel derives the same limits
    from positions. Anything else (padding masks, additive masks) keeps mlx's route.
    """
    if mask is None or (isinstance(mask, str) and mask == "causal"):
        return True
    return (
        isinstance(mask, mx.array)
        and mask.dtype == mx.bool_
        and mask.ndim == 2
        and mask.shape[0] == count
    )


def _key_source(
    cache: KvPlane,
    keys: mx.array,
    values: mx.array,
    count: int,
    window,
    stacked: bool = False,
):
    """Where the keys of the ``count`` newest positions' queries are, without copying.

    ``stacked``: the plane's buffer and a held-back block are handed over whole, as
    both keys and values (:class:`KeyPlane`), not as views of their halves.

    Returns:
        ``(plane, block_keys, block_values)`` for :func:`small_query_attention`.
    """
    guard = cache.guard
    start = cache.offset - count
    if (
        isinstance(guard, RingPlaneCheckpoint)
        and guard.mode == DEFERRED
        and guard.start == start
        and guard.pending.shape[cache.kv_axis] == count
    ):
        # A verify block held back: the ring as it was before the block, then the block
        # (its halves two graph nodes: ``stacked_halves``, unless bound whole).
        meta = guard.meta
        plane = KeyPlane.from_kv(
            cache.kv, meta.len, meta.origin_logical, meta.origin_physical, stacked
        )
        if stacked:
            return plane, guard.pending, guard.pending
        return (plane, *stacked_halves(guard.pending))
    first, _ = visible_bounds(start, window or 0, True, cache.offset)
    if first >= cache.origin_logical:
        # The chunk was written and nothing a query needs was evicted.
        plane = KeyPlane.from_kv(
            cache.kv, cache.len, cache.origin_logical, cache.origin_physical, stacked
        )
        return plane, None, None
    # A staged chunk stored at once: ``keys`` is its shadow (live rows then the chunk).
    rows = keys.shape[2]
    return KeyPlane(keys, values, rows, cache.offset - rows, 0), None, None


def _stacked_key_source(
    cache: KvPlane, keys: mx.array, values: mx.array, count: int, window
):
    """:func:`_key_source` with the plane and the block handed over stacked."""
    return _key_source(cache, keys, values, count, window, stacked=True)


# ------------------------------------------------------------ module dispatch


class _ModuleHook:
    """The dispatcher installed as a model module's ``scaled_dot_product_attention``.

    A routed call (inside a :class:`KernelPatch`) tries the kernel route first; then,
    while some :func:`attention_route` holds the module, a block forward the folded
    form serves takes it; everything else calls mlx-lm's function unchanged.
    """

    def __init__(self, original: Callable) -> None:
        self.original = original
        self.users = 0
        self.folded_users = 0

    def __call__(self, queries, keys, values, cache, scale, mask, sinks=None):
        route = _ACTIVE.get()
        if route is not None and sinks is None:
            out = route.attend(queries, keys, values, cache, scale, mask)
            if out is not None:
                return out
        if self.folded_users and folded.serves(queries, keys, values, mask, sinks):
            return folded.folded_attention(queries, keys, values, scale, mask)
        return self.original(
            queries, keys, values, cache=cache, scale=scale, mask=mask, sinks=sinks
        )


_HOOKS: Dict[str, _ModuleHook] = {}


def _hook_module(name: str, folded_route: bool = False) -> None:
    module = sys.modules[name]
    hook = _HOOKS.get(name)
    if hook is None:
        hook = _ModuleHook(module.scaled_dot_product_attention)
        _HOOKS[name] = hook
        module.scaled_dot_product_attention = hook
    if folded_route:
        hook.folded_users += 1
    else:
        hook.users += 1


def _unhook_module(name: str, folded_route: bool = False) -> None:
    hook = _HOOKS[name]
    if folded_route:
        hook.folded_users -= 1
    else:
        hook.users -= 1
    if hook.users == 0 and hook.folded_users == 0:
        sys.modules[name].scaled_dot_product_attention = hook.original
        del _HOOKS[name]


# ------------------------------------------------------------- class swaps

_SUBCLASSES: Dict[tuple, type] = {}


def _swapped_class(kind: str, base: type, call, **methods: Callable) -> type:
    """The subclass of ``base`` whose ``__call__`` is ``call`` (and whose ``methods``
    are these), built once per pair."""
    key = (kind, base)
    if key not in _SUBCLASSES:
        _SUBCLASSES[key] = type(
            f"Kernel{base.__name__}",
            (base,),
            {"__call__": call, **methods, _ORIGINAL_CLASS: base},
        )
    return _SUBCLASSES[key]


def _routed_class(base: type) -> type:
    """A subclass of ``base`` whose calls run with this module's route active."""

    def __call__(self, *args, **kwargs):
        token = _ACTIVE.set(self._dflash_route)
        try:
            return base.__call__(self, *args, **kwargs)
        finally:
            _ACTIVE.reset(token)

    return _swapped_class("routed", base, __call__)


def _prepared_class(base: type) -> type:
    """A subclass of ``base`` (a class :mod:`dflash.prepared_heads` re-states) whose
    served calls prepare their heads in one launch, with this module's route active."""

    def __call__(self, x, mask=None, cache=None):
        route = self._dflash_route
        token = _ACTIVE.set(route)
        try:
            if x.shape[1] > route.max_queries:
                return base.__call__(self, x, mask, cache)
            attend = prepared_heads.model_attention(base)
            gated = route.attend if route.gate_epilogue else None
            return prepared_heads.attention_forward(
                self,
                x,
                mask,
                cache,
                attend,
                route.use_kernel,
                gated,
                route.kv_block,
                rows_in_place=_plain_mask(mask, x.shape[1]),
            )
        finally:
            _ACTIVE.reset(token)

    return _swapped_class("prepared", base, __call__)


def _residual_class(base: type) -> type:
    """A subclass of ``base`` (a decoder layer :mod:`dflash.residual_layers` re-states)
    whose served calls run each post-norm, residual add and pre-norm as one launch."""

    def __call__(self, x, mask=None, cache=None):
        route = self._dflash_route
        if x.size // x.shape[-1] > route.max_queries:
            return base.__call__(self, x, mask, cache)
        return residual_layers.layer_forward(self, x, mask, cache, route.use_kernel)

    return _swapped_class("residual", base, __call__)


def _traced_class(base: type) -> type:
    """A subclass of ``base`` (a decoder layer :mod:`dflash.traced_layers` re-states)
    whose served calls run as two compiled replays."""

    def __call__(self, x, mask=None, cache=None):
        route: AttentionRoute = self._dflash_route
        if not _traced_serves(route, x, mask, cache):
            return base.__call__(self, x, mask, cache)
        return traced_layers_module.layer_forward(
            self, x, cache, route.chunk, route.key_source, _TRACES,
            route.residual_norms, route.use_kernel,
        )  # fmt: skip

    return _swapped_class("traced", base, __call__)


def _traced_serves(route: "AttentionRoute", x: mx.array, mask: Any, cache: Any) -> bool:
    """Whether a decoder-layer call takes the traced form: what the prepared attention
    hands to the kernel route in place (a head-major plane with a buffer and the
    block write, a mask of positions, at most ``max_queries`` tokens). Compile was on at
    install, and the traces keep that decision (as the bound matmuls keep theirs)."""
    return (
        x.ndim == 3
        and 0 < x.shape[0] * x.shape[1] <= route.max_queries
        and route.takes(cache, x.shape[1], mask)
    )


def _draft_class(base: type) -> type:
    """A subclass of the drafter's attention that attends its planes in place (and, as
    the route asks, prepares its heads in one launch)."""
    return _swapped_class("draft", base, _draft_attention, rotate=_draft_rotate)


def _draft_attention(self, x: mx.array, plane, rope: nn.Module, start: int) -> mx.array:
    """DraftAttention's forward with the context plane and the block read in place.

    Shapes: x ``(b, B, H)``; returns ``(b, B, H)``.
    """
    batch, block, _ = x.shape
    route: AttentionRoute = self._dflash_route
    if block > route.max_queries:
        return getattr(type(self), _ORIGINAL_CLASS).__call__(
            self, x, plane, rope, start
        )
    queries, block_keys, block_values = self.block_heads(x, rope, start)
    out = traced_drafts.attend(
        self, queries, block_keys, block_values, plane, start, route.chunk,
        route.use_kernel,
    )  # fmt: skip
    return self.o_proj(out.transpose(0, 2, 1, 3).reshape(batch, block, -1))


def _draft_rotate(
    self,
    queries: Optional[mx.array],
    keys: mx.array,
    rope: nn.Module,
    start: int,
) -> Tuple[Optional[mx.array], mx.array]:
    """DraftAttention's q / k norms and RoPE as one :func:`~dflash.metal.heads.head_prep`
    launch where the route asks for it and
    :func:`~dflash.traced_drafts.prep_arguments` serves the call (with no queries, the
    keys go in both slots), else the class's own ops.

    Shapes: as ``DraftAttention.rotate``.
    """
    route: AttentionRoute = self._dflash_route
    prep = None
    if route.draft_head_prep:
        prep = traced_drafts.prep_arguments(
            self, rope, queries, keys, route.max_queries
        )
    if prep is None:
        own = getattr(type(self), _ORIGINAL_CLASS).rotate
        return own(self, queries, keys, rope, start)
    given = keys if queries is None else queries
    prepared_queries, prepared_keys = heads.head_prep(
        given, keys, **prep, start=start, use_kernel=route.use_kernel
    )
    prepared_keys = prepared_keys.transpose(0, 2, 1, 3)
    if queries is None:
        return None, prepared_keys
    return prepared_queries.transpose(0, 2, 1, 3), prepared_keys


def _traced_draft_class(base: type) -> type:
    """A subclass of a draft decoder layer whose served calls run as two compiled
    replays around the attention (:mod:`dflash.traced_drafts`)."""

    def __call__(self, h, plane, rope, start):
        route: AttentionRoute = self._dflash_route
        if not traced_drafts.takes(self, h, route.max_queries):
            return base.__call__(self, h, plane, rope, start)
        return traced_drafts.layer_forward(
            self, h, plane, rope, start, route.chunk, route.use_kernel, _TRACES
        )

    return _swapped_class("traced_draft", base, __call__)


def _matmul_class(base: type) -> type:
    """A subclass of ``nn.Linear`` / ``nn.QuantizedLinear`` using the small-row matmul."""
    return _swapped_class("matmul", base, _linear_call)


def _linear_call(self, x: mx.array) -> mx.array:
    """``Linear`` / ``QuantizedLinear`` forward through :func:`small_row_matmul`.

    Calls with more rows than the route's ``max_queries``, other quantization modes,
    widths or dtypes than the kernel serves keep the layer's own forward. What a call
    runs is worked out once per input shape and dtype and kept on the layer while the
    patch is installed (dropped if any of the layer's arrays is replaced).

    Shapes: x ``(..., K)``; returns ``(..., N)``.
    """
    bound: Dict[tuple, _BoundLinear] = self.__dict__[_BOUND]
    key = (x.shape, x.dtype)
    entry = bound.get(key)
    if entry is None or not entry.holds(self):
        entry = bound[key] = _BoundLinear(self, _bind_linear(self, x))
    return entry.run(x)


class _BoundLinear:
    """What a patched layer runs for one input geometry, and the arrays it was bound to."""

    __slots__ = ("arrays", "run")

    def __init__(self, layer: nn.Module, run: Callable[[mx.array], mx.array]) -> None:
        self.arrays = tuple(layer.values())
        self.run = run

    def holds(self, layer: nn.Module) -> bool:
        """Whether ``layer`` still holds the very arrays this was bound to."""
        arrays = tuple(layer.values())
        return len(arrays) == len(self.arrays) and all(map(is_, arrays, self.arrays))


def _bind_linear(layer: nn.Module, x: mx.array) -> Callable[[mx.array], mx.array]:
    """The forward of ``layer`` for inputs of ``x``'s shape and dtype (see
    :func:`_linear_call`)."""
    route: AttentionRoute = layer._dflash_route
    depth = x.shape[-1]
    rows = x.size // depth if depth else 0
    args = _matmul_args(layer, x.dtype) if 0 < rows <= route.max_queries else None
    if args is None or depth % 8:
        return partial(getattr(type(layer), _ORIGINAL_CLASS).__call__, layer)
    slot: Optional[MemberSlot] = layer.__dict__.get(_FUSED_SLOT)
    if slot is not None and slot.group.serves(slot.index, layer):
        return partial(slot.group.output, slot.index, use_kernel=route.use_kernel)
    weight, scales, biases, bits, group_size = args
    matmul = bind_matmul(
        (rows, depth), x.dtype, weight, scales, biases,
        bits=bits, group_size=group_size, use_kernel=route.use_kernel,
        lead=x.shape[:-1],
    )  # fmt: skip
    bias = layer["bias"] if "bias" in layer else None

    def run(x: mx.array, counters: Optional[mx.array]) -> mx.array:
        y = matmul(x, counters)
        return y if bias is None else y + bias

    return compile_around(matmul, run)


def _projection_class(base: type) -> type:
    """A subclass of ``nn.Linear`` / ``nn.QuantizedLinear`` served by its fused set."""
    return _swapped_class("projection", base, _projection_call)


def _projection_call(self, x: mx.array) -> mx.array:
    """A fused member's forward: its columns of the set's one mlx matmul.

    Calls with more rows than the route's ``max_queries`` (prefill chunks) keep the
    layer's own forward, so the prompt's cache is what mlx-lm's would be; so does a
    member given a new array since it was stacked.

    Shapes: x ``(..., K)``; returns ``(..., N)``.
    """
    route: AttentionRoute = self._dflash_route
    depth = x.shape[-1]
    rows = x.size // depth if depth else 0
    slot: Optional[MemberSlot] = self.__dict__.get(_FUSED_SLOT)
    if (
        slot is None
        or not 0 < rows <= route.max_queries
        or not slot.group.serves(slot.index, self)
    ):
        return getattr(type(self), _ORIGINAL_CLASS).__call__(self, x)
    return slot.group.output(slot.index, x, None)


def _gated_mlp_class(base: type) -> type:
    """A subclass of a SwiGLU MLP whose served calls take ``silu(gate) * up`` from the
    fused gate / up launch (see :mod:`dflash.gated_mlp`)."""
    return _swapped_class("gated_mlp", base, _gated_mlp_call)


def _gated_mlp_call(self, x: mx.array) -> mx.array:
    """``down_proj(silu(gate_proj(x)) * up_proj(x))`` with the activation applied by
    the gate / up launch; calls it does not serve run the module's own forward.

    Shapes: x ``(..., H)``; returns ``(..., H)``.
    """
    route: AttentionRoute = self._dflash_route
    depth = x.shape[-1]
    rows = x.size // depth if depth else 0
    slot: Optional[MemberSlot] = self.gate_proj.__dict__.get(_FUSED_SLOT)
    if route.swiglu and slot is not None and 0 < rows <= route.max_queries:
        hidden = slot.group.activated(self.gate_proj, self.up_proj, x, route.use_kernel)
        if hidden is not None:
            return self.down_proj(hidden)
    return getattr(type(self), _ORIGINAL_CLASS).__call__(self, x)


def _block_class(base: type) -> type:
    """A subclass of an MLP module run as one compiled forward per input geometry."""
    return _swapped_class("block", base, _block_call)


def _block_call(self, x: mx.array) -> mx.array:
    """An MLP's forward as one ``mx.compile`` trace per input shape and dtype.

    Its projections are our patched (batch-invariant) matmuls; the trace runs their
    Python, the activation and the product once, and mlx replays the launches (the
    activation and product fused into one elementwise kernel). Calls with more rows
    than the route's ``max_queries`` (prefill chunks) keep the module's own forward.
    The trace is dropped when any array of the block is replaced.

    Shapes: x ``(..., H)``; returns ``(..., H)``.
    """
    forward = getattr(type(self), _ORIGINAL_CLASS).__call__
    depth = x.shape[-1]
    rows = x.size // depth if depth else 0
    if not 0 < rows <= self._dflash_route.max_queries:
        return forward(self, x)
    bound: Dict[tuple, _BoundBlock] = self.__dict__[_BOUND]
    key = (x.shape, x.dtype)
    entry = bound.get(key)
    if entry is None or not entry.holds():
        entry = bound[key] = _BoundBlock(
            self, backend.compile_traced(partial(forward, self))
        )
    return entry.run(x)


class _BoundBlock:
    """A block's compiled forward and the arrays of each of its modules when traced."""

    __slots__ = ("held", "run")

    def __init__(self, block: nn.Module, run: Callable[[mx.array], mx.array]) -> None:
        self.held = [(m, _arrays(m)) for m in block.modules()]
        self.run = run

    def holds(self) -> bool:
        """Whether every module of the block still holds the very arrays traced."""
        for module, arrays in self.held:
            now = _arrays(module)
            if len(now) != len(arrays) or not all(map(is_, now, arrays)):
                return False
        return True


def _arrays(module: nn.Module) -> tuple:
    return tuple(v for v in module.values() if isinstance(v, mx.array))


def compiled_blocks_wanted() -> bool:
    """Whether :class:`KernelPatch` compiles whole MLP blocks: ``DFLASH_COMPILED_BLOCKS``
    (``0`` / ``1``), else off. Off by default: on the H200 (session 16) 4-bit rounds with
    them were slower than without in 2 of 3 pairs (median ratio 1.30)."""
    return bool(backend.env_switch(COMPILED_BLOCKS_ENV))


def drafter_dense_wanted(value: Optional[bool] = None) -> bool:
    """Whether :class:`KernelPatch` routes the drafter's unquantized projections through
    the small-row kernel: ``value`` if given, else ``DFLASH_DRAFTER_DENSE_KERNEL``
    (``0`` / ``1``), else off. The drafter needs no batch invariance (its drafts are only
    proposals), so mlx's own matmul serves it, each sibling set one matmul over its
    stack: on the H200 (session 47, 4-bit Glimmer pair at 4k, arms alternated part by
    part) the draft took 1.85 ms of device time against 2.10 with the kernel, and 3.04
    ms of host against 4.89.

    Raises:
        ValueError: ``DFLASH_DRAFTER_DENSE_KERNEL`` is set to something that is not a
            switch value.
    """
    return backend.strict_switch(DRAFTER_DENSE_ENV, value, default=False)


def stacked_kv_wanted(value: Optional[bool] = None) -> bool:
    """Whether routed attention binds a plane's stacked K/V buffer and a held-back
    block whole (the chunk pass reads the values at an offset): four graph nodes
    fewer a verify layer, the same bits. ``value`` if given, else
    ``DFLASH_STACKED_KV`` (``0`` / ``1``), else on (session 66, an H100: the verify
    graph's host time 0.1-0.9 ms lower in 10 of 10 alternated rounds, device time
    within its noise, every stacked chunk pass's `cuda` test passed).

    Raises:
        ValueError: ``DFLASH_STACKED_KV`` is set to something that is not a switch
            value.
    """
    return backend.strict_switch(STACKED_KV_ENV, value, default=True)


def drafter_qkv_wanted(value: Optional[bool] = None) -> bool:
    """Whether :class:`KernelPatch` stacks the drafter's q / k / v: ``value`` if given,
    else ``DFLASH_DRAFTER_FUSED_QKV`` (``0`` / ``1``), else off (the H200 measured the
    draft's device time 2 % lower with it in session 47, too little to separate from
    one run's noise; ``benchmarks/drafter_forward.py`` measures it).

    Raises:
        ValueError: ``DFLASH_DRAFTER_FUSED_QKV`` is set to something that is not a
            switch value.
    """
    return backend.strict_switch(DRAFTER_QKV_ENV, value, default=False)


def drafter_head_prep_wanted(value: Optional[bool] = None) -> bool:
    """Whether :class:`KernelPatch` prepares the drafter's heads in one launch: ``value``
    if given, else ``DFLASH_DRAFTER_HEAD_PREP`` (``0`` / ``1``), else off (the H200
    measured the draft's device time 2.4 % lower with it in session 47, too little to
    separate from one run's noise; ``benchmarks/drafter_forward.py`` measures it).

    Raises:
        ValueError: ``DFLASH_DRAFTER_HEAD_PREP`` is set to something that is not a
            switch value.
    """
    return backend.strict_switch(DRAFTER_HEAD_PREP_ENV, value, default=False)


def drafter_traced_wanted(value: Optional[bool] = None) -> bool:
    """Whether :class:`KernelPatch` runs the drafter's layers as compiled replays:
    ``value`` if given, else ``DFLASH_DRAFTER_TRACED`` (``0`` / ``1``), else off (not
    measured on a GPU; ``benchmarks/drafter_forward.py`` measures it).

    Raises:
        ValueError: ``DFLASH_DRAFTER_TRACED`` is set to something that is not a switch
            value.
    """
    return backend.strict_switch(traced_drafts.DRAFTER_TRACED_ENV, value, default=False)


def _matmul_args(layer: nn.Module, dtype: mx.Dtype):
    """``(weight, scales, biases, bits, group_size)`` of ``layer``, or None if unserved."""
    weight = layer["weight"]
    if isinstance(layer, nn.QuantizedLinear):
        if getattr(layer, "mode", "affine") != "affine":
            return None
        args = (weight, layer["scales"], layer.get("biases"), layer.bits)
        args += (layer.group_size,)
    else:
        args = (weight, None, None, None, None)
    return args if qmm.arrays_served(dtype, *args) else None


def _children(module: nn.Module) -> List[nn.Module]:
    """``module``'s direct child modules (not the module's arrays)."""
    return [
        child
        for _, child in tree_flatten(
            module.children(), is_leaf=lambda value: isinstance(value, nn.Module)
        )
        if isinstance(child, nn.Module)
    ]


def _swap(module: nn.Module, cls: type, route: AttentionRoute) -> None:
    if hasattr(type(module), _ORIGINAL_CLASS):
        raise RuntimeError(f"{type(module).__name__} already has kernels installed")
    module.__class__ = cls
    module._dflash_route = route
    module.__dict__[_BOUND] = {}


def _unswap(module: nn.Module, trace_options: Optional[tuple] = None) -> None:
    """Restore ``module``'s class; its traces are kept under ``trace_options`` (None:
    dropped)."""
    original = getattr(type(module), _ORIGINAL_CLASS, None)
    if original is not None:
        module.__class__ = original
    module.__dict__.pop("_dflash_route", None)
    module.__dict__.pop(_BOUND, None)
    module.__dict__.pop(traced_layers_module.SUCCESSOR, None)
    module.__dict__.pop(traced_layers_module.MLP_GROUP, None)
    traces = module.__dict__.pop(_TRACES, None)
    if traces is not None and trace_options is not None:
        # On the layer itself, so they go with it (a table would keep the layer alive).
        module.__dict__[_KEPT_TRACES] = (trace_options, traces)


def _link_successors(order: List[nn.Module], traced: List[nn.Module]) -> None:
    """Link each traced layer to the next decoder layer in ``order`` where that one is
    traced too (the residual norms' hand-off, :mod:`dflash.traced_layers`). In the
    instance dict: an attribute holding a module would make it a child."""
    ids = {id(layer) for layer in traced}
    for layer, successor in zip(order, order[1:]):
        if id(layer) in ids and id(successor) in ids:
            layer.__dict__[traced_layers_module.SUCCESSOR] = successor


def _link_mlp_groups(traced: List[nn.Module], megabytes: int) -> None:
    """Link each traced layer whose MLP's gate / up is one fused kernel launch of
    quantized weights to that group, for its post-attention residual norm to ask
    ``megabytes`` of the group's first weights into the L2
    (:func:`dflash.traced_layers.mlp_prefetch`); none with ``megabytes`` 0. Dense
    (bf16) groups are not linked: the gain was measured on 4-bit weights only
    (session 59)."""
    if megabytes <= 0:
        return
    for layer in traced:
        mlp = getattr(layer, "mlp", None)
        gate, up = getattr(mlp, "gate_proj", None), getattr(mlp, "up_proj", None)
        slot: Optional[MemberSlot] = getattr(gate, "__dict__", {}).get(_FUSED_SLOT)
        if (
            slot is not None
            and slot.group.form == "kernel"
            and slot.group.bits is not None
            and len(slot.group.members) == 2
            and slot.group.members[0] is gate
            and slot.group.members[1] is up
        ):
            layer.__dict__[traced_layers_module.MLP_GROUP] = (slot.group, megabytes)


def _take_kept_traces(layer: nn.Module, trace_options: Optional[tuple]) -> None:
    """Give ``layer`` back the traces an earlier install kept, if they were made under
    ``trace_options`` (None: take none) and the layer still holds the arrays they
    captured; other kept traces are dropped (they hold arrays and compiled graphs)."""
    kept = layer.__dict__.pop(_KEPT_TRACES, None)
    if kept is not None and kept[0] == trace_options and kept[1].holds():
        layer.__dict__[_TRACES] = kept[1]


def keep_traces_wanted() -> bool:
    """Whether an uninstall keeps the traced layers' traces for the next install with
    the same options: ``DFLASH_KEEP_TRACES``, else on.

    Raises:
        ValueError: ``DFLASH_KEEP_TRACES`` is set to something that is not a switch value.
    """
    return backend.strict_switch(KEEP_TRACES_ENV, None, True)


def forget_traces(model: Optional[nn.Module] = None) -> None:
    """Never take back traces kept so far; with ``model``, also free its kept traces now.

    Kept traces hold the arrays they captured: a model whose weights were replaced
    keeps the old ones alive until its next install drops them (or until this). With
    ``model``, the chunk-major copies of its scales and biases are dropped too
    (:func:`~dflash.metal.tensor_qmm.chunk_major`), and its layers' L2 prefetch plans
    (:func:`dflash.traced_layers.mlp_prefetch`), which hold the arrays they ask for.
    """
    global _trace_epoch
    _trace_epoch = object()
    if model is not None:
        for module in model.modules():
            module.__dict__.pop(_KEPT_TRACES, None)
            module.__dict__.pop(traced_layers_module.L2_PLAN, None)
        arrays = [a for _, a in tree_flatten(model.parameters())]
        tensor_qmm.forget_chunk_major(arrays)


def dflash_settings() -> tuple:
    """Every ``DFLASH_*`` environment setting, as sorted pairs: a trace fixes what its
    switches said (and a run-time pacing choice is made under them)."""
    return tuple(
        sorted((k, v) for k, v in os.environ.items() if k.startswith("DFLASH_"))
    )


# ------------------------------------------------------------------ public


def architecture(model: nn.Module) -> str:
    """The mlx-lm module name of ``model``'s architecture (e.g. ``"muse_glimmer"``)."""
    return type(model).__module__.rsplit(".", 1)[-1]


def supports(model: nn.Module) -> bool:
    """Whether :class:`KernelPatch` can route ``model``'s attention."""
    return architecture(model) in SUPPORTED_ARCHITECTURES


class KernelPatch:
    """Route a target's (and a drafter's) attention through the verify kernels.

    Use as a context manager, or :meth:`install` / :meth:`uninstall`.

    Args:
        model: The target mlx-lm model.
        drafter: A DFlash drafter to patch too (optional).
        use_kernel: None: the custom kernel on a GPU backend (unless
            ``DFLASH_KERNELS=0``), the pure-MLX reference on the CPU; True / False
            force one form. Both forms are batch-invariant.
        max_queries: Attention calls with more queries, and matmuls with more rows,
            keep mlx's ops.
        chunk: Keys per chunk of the fixed reduction order.
        attention: Route attention (target and drafter).
        matmul: Route ``nn.Linear`` / ``nn.QuantizedLinear`` (target and drafter)
            through :func:`dflash.metal.qmm.small_row_matmul`.
        fuse: With ``matmul``, run sibling projections that read one input as one
            launch (:mod:`dflash.fused_projections`; their weights become views of
            the stacked copy). None reads ``DFLASH_FUSED_PROJECTIONS`` (default on).
        projections: Without ``matmul``, run those sibling sets as one mlx
            ``matmul`` / ``quantized_matmul`` each (mlx's kernels, fewer launches)
            for calls of at most ``max_queries`` rows.
        compile_blocks: With ``matmul``, run each MLP block whose projections are all
            routed as one ``mx.compile`` trace per input geometry (its Python once, the
            activation and product fused). None: :func:`compiled_blocks_wanted`.
        head_prep: With ``attention``, run the q/k norms, scale and RoPE of the
            target's attention classes :mod:`dflash.prepared_heads` re-states as one
            launch. None: :func:`dflash.prepared_heads.head_prep_wanted`.
        residual_norms: With ``attention``, run the target's decoder layers that
            :mod:`dflash.residual_layers` re-states with their norm-add(-norm) groups
            as one launch each (in the traced layers, the last one also taking the next
            layer's input norm). None:
            :func:`dflash.residual_layers.residual_norms_wanted` (on inside traced
            layers on CUDA, off for eager layers).
        gate_epilogue: With ``head_prep``, apply Muse Glimmer's output gate in the
            attention's last pass (two kernels fewer a layer). None:
            :func:`dflash.prepared_heads.gate_epilogue_wanted`.
        kv_block: With ``head_prep``, have the head prep write the keys and values as
            the stacked block a dflash plane stores (two copies fewer a layer). None:
            :func:`dflash.prepared_heads.kv_block_wanted`.
        swiglu: With ``matmul`` and ``fuse``, run each SwiGLU MLP's activation in its
            fused gate / up launch (CUDA's tensor-core form; two kernels fewer a layer)
            where :mod:`dflash.gated_mlp`'s probes pass. None:
            :func:`dflash.gated_mlp.swiglu_wanted` (off unless ``DFLASH_SWIGLU=1``: the
            same bits on the H200, not measured faster).
        traced_layers: With ``head_prep``, the gate epilogue and ``kv_block``, run the
            target's decoder layers :mod:`dflash.traced_layers` re-states as two
            compiled replays a served call (takes precedence over
            ``residual_norms``). None: :func:`dflash.traced_layers.traced_layers_wanted`.
        drafter_dense: With ``matmul``, route the drafter's unquantized projections
            too (False: they keep mlx's matmul, with ``fuse`` each sibling set of them
            stacked as one mlx matmul; the target's are always routed, for batch
            invariance). None: :func:`drafter_dense_wanted`.
        drafter_qkv: With ``matmul`` and ``fuse``, stack each draft attention's q / k /
            v (all routed): its block's projections become one launch, its context's
            k / v another (a ``tails`` set of :mod:`dflash.fused_projections`). None:
            :func:`drafter_qkv_wanted`.
        drafter_head_prep: With ``attention`` and ``head_prep``, run each draft
            attention's q / k norms and RoPE as one :func:`~dflash.metal.heads.head_prep`
            launch (the block's queries and keys together, the context's keys alone)
            for calls of at most ``max_queries`` rows. None:
            :func:`drafter_head_prep_wanted`.
        drafter_traced: With the drafter's head prep, compile on and the kernel path,
            run each draft layer :mod:`dflash.traced_drafts` serves as two compiled
            replays around its attention. None: :func:`drafter_traced_wanted`.
        l2_prefetch: Megabytes of each traced layer's MLP fused gate / up weights
            (quantized ones) that its post-attention residual norm asks into the L2
            on CUDA (with the traced layers' residual norms; 0: none;
            :mod:`dflash.metal.prefetch`). None:
            :func:`dflash.metal.prefetch.megabytes_wanted`.
        stacked_kv: With ``attention``, bind each plane's stacked K/V buffer and a
            held-back block whole (no views of their halves; the same bits). None:
            :func:`stacked_kv_wanted`.

    Raises:
        ValueError: ``model``'s architecture is not one whose attention can be routed.
    """

    def __init__(
        self,
        model: nn.Module,
        drafter: Optional[nn.Module] = None,
        *,
        use_kernel: Optional[bool] = None,
        max_queries: int = 32,
        chunk: int = 256,
        attention: bool = True,
        matmul: bool = True,
        fuse: Optional[bool] = None,
        projections: bool = False,
        compile_blocks: Optional[bool] = None,
        head_prep: Optional[bool] = None,
        residual_norms: Optional[bool] = None,
        gate_epilogue: Optional[bool] = None,
        kv_block: Optional[bool] = None,
        swiglu: Optional[bool] = None,
        traced_layers: Optional[bool] = None,
        drafter_dense: Optional[bool] = None,
        drafter_qkv: Optional[bool] = None,
        drafter_head_prep: Optional[bool] = None,
        drafter_traced: Optional[bool] = None,
        l2_prefetch: Optional[int] = None,
        stacked_kv: Optional[bool] = None,
    ) -> None:
        if attention and not supports(model):
            raise ValueError(
                f"kernel attention supports {', '.join(SUPPORTED_ARCHITECTURES)}; "
                f"{architecture(model)} is not one of them"
            )
        if not 1 <= max_queries:
            raise ValueError(f"max_queries must be >= 1, got {max_queries}")
        self.model = model
        self.drafter = drafter
        self._gate_epilogue = prepared_heads.gate_epilogue_wanted(gate_epilogue)
        self.head_prep = bool(attention) and prepared_heads.head_prep_wanted(head_prep)
        self.route = AttentionRoute(
            use_kernel,
            max_queries,
            chunk,
            self._gate_epilogue,
            prepared_heads.kv_block_wanted(kv_block),
            gated_mlp.swiglu_wanted(swiglu),
            self.head_prep and drafter_head_prep_wanted(drafter_head_prep),
            stacked_kv=stacked_kv_wanted(stacked_kv),
        )
        self.attention = attention
        self.matmul = matmul
        self.fuse = fuse_wanted() if fuse is None else bool(fuse)
        self.drafter_dense = drafter_dense_wanted(drafter_dense)
        self.drafter_qkv = drafter_qkv_wanted(drafter_qkv)
        self.drafter_traced = drafter_traced_wanted(drafter_traced)
        self.projections = bool(projections) and not matmul
        self.compile_blocks = bool(matmul) and (
            compiled_blocks_wanted() if compile_blocks is None else bool(compile_blocks)
        )
        # Eager layers take the residual norms only when asked; traced ones by default
        # on CUDA (residual_norms_wanted).
        self.residual_norms = bool(attention) and residual_layers.residual_norms_wanted(
            residual_norms
        )
        self.traced_residual_norms = bool(
            attention
        ) and residual_layers.residual_norms_wanted(residual_norms, traced=True)
        wanted = traced_layers_module.traced_layers_wanted(traced_layers)
        self.traced_layers = bool(attention) and wanted
        self.l2_prefetch = prefetch.megabytes_wanted(l2_prefetch)
        self._groups: List[FusedProjections] = []
        self._patched: List[nn.Module] = []
        self._trace_options: Optional[tuple] = None
        self._modules: List[str] = []

    @property
    def installed(self) -> bool:
        """Whether the patch is in place."""
        return bool(self._patched)

    def attention_modules(self) -> List[nn.Module]:
        """The target's attention modules and the drafter's (what :meth:`install` swaps)."""
        found = [layer.self_attn for layer in target_layers(self.model)]
        if self.drafter is not None:
            from .drafter import DraftAttention

            found += [
                m for m in self.drafter.modules() if isinstance(m, DraftAttention)
            ]
        return found

    def matmul_modules(self) -> List[nn.Module]:
        """Every ``nn.Linear`` / ``nn.QuantizedLinear`` of the target and the drafter
        (less the drafter's own unquantized ones without ``drafter_dense``)."""
        owners = [self.model] + ([self.drafter] if self.drafter is not None else [])
        found, seen = [], set()
        for owner in owners:
            for module in owner.modules():
                if (
                    isinstance(module, (nn.Linear, nn.QuantizedLinear))
                    and id(module) not in seen
                ):
                    seen.add(id(module))
                    dense = not isinstance(module, nn.QuantizedLinear)
                    if owner is self.model or self.drafter_dense or not dense:
                        found.append(module)
        return found

    def sibling_parents(self) -> List[nn.Module]:
        """Modules whose sibling projections may fuse: the target's attention and MLP
        modules and the drafter's MLPs (its attention: :meth:`drafter_qkv_parents`)."""
        found = [
            getattr(layer, "self_attn", None) for layer in target_layers(self.model)
        ]
        return [m for m in found if isinstance(m, nn.Module)] + self._mlps()

    def drafter_qkv_parents(self) -> List[nn.Module]:
        """The drafter's attention modules whose q / k / v may share a stack (with
        ``drafter_qkv``): it projects its block through all three, its committed context
        through k / v alone, so their stack serves from the calling member on."""
        if self.drafter is None or not self.drafter_qkv:
            return []
        from .drafter import DraftAttention

        return [m for m in self.drafter.modules() if isinstance(m, DraftAttention)]

    def drafter_mlx_sets(self, matmul: List[nn.Module]) -> List[Tuple[list, bool]]:
        """The drafter's sibling sets that keep mlx's matmul (without ``drafter_dense``,
        none of their members in ``matmul``), stacked as one mlx matmul each with
        ``matmul`` and ``fuse``: its MLPs' gate / up, and with ``drafter_qkv`` its
        attention's q / k / v (a tails set). Pairs ``(members, tails)``."""
        if not (self.matmul and self.fuse and self.drafter is not None):
            return []
        if self.drafter_dense:
            return []
        from .drafter import DraftMLP

        routed = {id(m) for m in matmul}
        mlps = [m for m in self.drafter.modules() if isinstance(m, DraftMLP)]
        found = [(s, False) for s in sibling_sets(mlps)]
        found += [(s, True) for s in sibling_sets(self.drafter_qkv_parents())]
        return [(s, tails) for s, tails in found if not {id(m) for m in s} & routed]

    def traced_draft_modules(self) -> List[nn.Module]:
        """The drafter's decoder layers :meth:`install` runs as compiled replays: with
        ``drafter_traced``, the drafter's head prep, compile on and the kernel path,
        the layers :func:`dflash.traced_drafts.serves` takes."""
        route = self.route
        if not (
            self.drafter is not None
            and self.drafter_traced
            and route.draft_head_prep
            and backend.compile_wanted()
            and backend.use_kernel_path(route.use_kernel, True)
        ):
            return []
        from .drafter import DraftDecoderLayer

        rope = getattr(self.drafter, "_rope", None)
        return [
            layer
            for layer in self.drafter.modules()
            if isinstance(layer, DraftDecoderLayer)
            and traced_drafts.serves(layer, rope)
        ]

    def _mlps(self) -> List[nn.Module]:
        """The target's decoder-layer MLP modules and the drafter's."""
        found = [getattr(layer, "mlp", None) for layer in target_layers(self.model)]
        if self.drafter is not None:
            from .drafter import DraftMLP

            found += [m for m in self.drafter.modules() if isinstance(m, DraftMLP)]
        return [m for m in found if isinstance(m, nn.Module)]

    def mlp_blocks(self, matmul: List[nn.Module]) -> List[nn.Module]:
        """The target's and the drafter's MLP modules whose every child is a layer in
        ``matmul`` (what :meth:`install` compiles whole with ``compile_blocks``)."""
        routed = {id(m) for m in matmul}
        return [
            block
            for block in self._mlps()
            if block.children()
            and all(id(child) in routed for child in _children(block))
        ]

    def gated_mlps(self, blocks: List[nn.Module]) -> List[nn.Module]:
        """The target's and the drafter's SwiGLU MLPs :meth:`install` has take their
        activation from the gate / up launch: with ``matmul`` and ``fuse``, not
        compiled whole (``blocks``), whose forward and kernel probes pass (none where
        the form cannot run: off CUDA, the kernel path off)."""
        if not (
            self.route.swiglu
            and self.matmul
            and self.fuse
            and gated_mlp.form_available(self.route.use_kernel)
        ):
            return []
        compiled = {id(block) for block in blocks}
        return [
            mlp
            for mlp in self._mlps()
            if id(mlp) not in compiled
            and gated_mlp.serves(mlp)
            and gated_mlp.forward_matches(mlp, type(mlp))
            and gated_mlp.kernel_matches(
                gated_mlp.activation_dtype(mlp), self.route.use_kernel
            )
        ]

    def residual_layers(self) -> List[nn.Module]:
        """The target's decoder layers :meth:`install` runs with fused residual norms
        (served classes whose probe passes; empty without the residual norms, eager
        or traced)."""
        if not (self.residual_norms or self.traced_residual_norms):
            return []
        return [
            layer
            for layer in target_layers(self.model)
            if residual_layers.serves(layer)
            and residual_layers.forward_matches(layer, type(layer))
        ]

    def traced_layer_modules(self, prepared: set) -> List[nn.Module]:
        """The target's decoder layers :meth:`install` runs as compiled replays: with
        ``traced_layers``, the kernel path and compile on, the route's gate epilogue and
        stacked block, a prepared attention (``prepared``: their ids) whose heads the
        kernels take, of a re-stated class whose probe passes."""
        route = self.route
        if not (
            self.traced_layers
            and route.gate_epilogue
            and route.kv_block
            and backend.compile_wanted()
            and backend.use_kernel_path(route.use_kernel, True)
        ):
            return []
        return [
            layer
            for layer in target_layers(self.model)
            if traced_layers_module.serves(layer)
            and id(layer.self_attn) in prepared
            and traced_layers_module.kernels_take(layer, route.chunk)
            and traced_layers_module.forward_matches(layer, type(layer))
        ]

    def trace_options(self) -> tuple:
        """What a traced layer's traces fix when they are made: the route, this patch's
        parts, the backend and default device, the ``DFLASH_*`` switches and
        :func:`forget_traces`'s epoch. An install takes back kept traces only under equal
        options."""
        parts = (self.attention, self.matmul, self.fuse, self.projections)
        parts += (self.compile_blocks, self.head_prep, self.residual_norms)
        parts += (self.traced_residual_norms, self.l2_prefetch)
        # The drafter's own parts (a traced draft layer captures their launches).
        parts += (self.drafter_dense, self.drafter_qkv, self.drafter_traced)
        where = (backend.BACKEND, str(mx.default_device()))
        return (self.route, parts, where, dflash_settings(), _trace_epoch)

    def install(self) -> "KernelPatch":
        """Swap the classes and hook the model module (all or nothing).

        Raises:
            RuntimeError: some module already has kernels installed.
        """
        if self.installed:
            return self
        from .drafter import DraftAttention

        attention = self.attention_modules() if self.attention else []
        matmul = self.matmul_modules() if self.matmul else []
        sets = sibling_sets(self.sibling_parents()) if self.projections else []
        members = [m for members in sets for m in members]
        drafter_stacks = self.drafter_mlx_sets(matmul)
        members += [m for stack, _ in drafter_stacks for m in stack]
        blocks = self.mlp_blocks(matmul) if self.compile_blocks else []
        layers = self.residual_layers()
        mlps = self.gated_mlps(blocks)
        drafts = self.traced_draft_modules() if self.attention else []
        busy = [
            m
            for m in attention + matmul + members + blocks + layers + mlps + drafts
            if hasattr(type(m), _ORIGINAL_CLASS)
        ]
        if busy:
            raise RuntimeError(f"{len(busy)} modules already have kernels installed")
        # Probed before anything is swapped (the probe runs the module's own forward).
        prepared = {
            id(module)
            for module in attention
            if self.head_prep
            and prepared_heads.serves(module)
            and prepared_heads.forward_matches(module, type(module))
        }
        # The gate goes to the fold only where a probe shows the fold gives mlx's bits.
        dtypes = {
            prepared_heads.activation_dtype(m) for m in attention if id(m) in prepared
        }
        gate = self._gate_epilogue and all(
            prepared_heads.gated_fold_matches(dtype, self.route.use_kernel)
            for dtype in dtypes
        )
        self.route = dataclasses.replace(self.route, gate_epilogue=gate)
        traced = self.traced_layer_modules(prepared)
        # A traced layer runs the residual norms inside its trace where every traced
        # layer is one the residual norms serve (and have probed).
        residual_ids = {id(m) for m in layers}
        self.route = dataclasses.replace(
            self.route,
            residual_norms=self.traced_residual_norms
            and bool(traced)
            and all(id(m) in residual_ids for m in traced),
        )
        eager = layers if self.residual_norms else []
        layers = [m for m in eager if all(m is not t for t in traced)]
        self._trace_options = self.trace_options() if keep_traces_wanted() else None
        for module in attention:
            base = type(module)
            if isinstance(module, DraftAttention):
                cls = _draft_class(base)
            elif id(module) in prepared:
                cls = _prepared_class(base)
            else:
                cls = _routed_class(base)
            _swap(module, cls, self.route)
            self._patched.append(module)
            if (
                not isinstance(module, DraftAttention)
                and base.__module__ not in self._modules
            ):
                _hook_module(base.__module__)
                self._modules.append(base.__module__)
        swaps = (
            (matmul, _matmul_class),
            (members, _projection_class),
            (blocks, _block_class),
            (layers, _residual_class),
            (traced, _traced_class),
            (mlps, _gated_mlp_class),
            (drafts, _traced_draft_class),
        )
        for modules, subclass in swaps:
            for module in modules:
                _swap(module, subclass(type(module)), self.route)
                self._patched.append(module)
        try:
            if self.matmul and self.fuse:
                routed = {id(m) for m in matmul}
                self._fuse_siblings(sibling_sets(self.sibling_parents()), routed)
                drafter_sets = sibling_sets(self.drafter_qkv_parents())
                self._fuse_siblings(drafter_sets, routed, tails=True)
                for stack, tails in drafter_stacks:
                    ids = {id(m) for m in stack}
                    self._fuse_siblings([stack], ids, form="mlx", tails=tails)
            elif sets:
                self._fuse_siblings(sets, {id(m) for m in members}, form="mlx")
            # After the fusion: the traces captured its views of the stacked weights.
            for layer in traced + drafts:
                _take_kept_traces(layer, self._trace_options)
            if self.route.residual_norms:
                _link_successors(target_layers(self.model), traced)
                if backend.BACKEND == "cuda":
                    _link_mlp_groups(traced, self.l2_prefetch)
        except BaseException:
            self.uninstall()  # all or nothing (members keep equal-valued views)
            raise
        return self

    def _fuse_siblings(
        self, sets: list, routed: set, form: str = "kernel", tails: bool = False
    ) -> None:
        """Stack each sibling set whose members are all routed; mark the members."""
        for members in sets:
            if all(id(m) in routed for m in members):
                group = FusedProjections(members, form, tails)
                self._groups.append(group)
                for index, member in enumerate(members):
                    setattr(member, _FUSED_SLOT, MemberSlot(group, index))

    def uninstall(self) -> None:
        """Restore every swapped class and hooked module function."""
        for group in self._groups:
            group.release()
            for member in group.members:
                member.__dict__.pop(_FUSED_SLOT, None)
        self._groups.clear()
        for module in self._patched:
            _unswap(module, self._trace_options)
        for name in self._modules:
            _unhook_module(name)
        self._patched.clear()
        self._modules.clear()

    def __enter__(self) -> "KernelPatch":
        return self.install()

    def __exit__(self, *exc: Any) -> None:
        self.uninstall()


# Which parts of the verify kernels the generators install when nobody says
# (``use_kernel=None``), per backend: off until a GPU run of ``benchmarks/verify_kernels.py``
# and the round profile (``--kernels``) shows a part faster there; the CPU never installs
# them by default (its reference forms only serve tests).
VERIFY_KERNEL_PARTS: Tuple[str, ...] = ("attention", "matmul", "projections")
VERIFY_KERNELS_BY_DEFAULT: Dict[str, Tuple[str, ...]] = {"metal": (), "cuda": ()}
# Plain, classic speculative and DFlash decoding of a target whose every projection has one
# affine quantized form, by (backend, architecture, bits, group size), only where measured
# on an H200 with full-size Muse Glimmer in 4-bit groups of 64: DFlash rounds at tau = 6
# took 0.72-0.83 of kernels-off, faster in 18 of 19 pairs over sessions 9, 10, 13 and 14
# (docs/benchmarks/h200-2026-12-01-s14); since the traced layers (session 23), plain
# tokens took a median 0.81 of kernels-off, faster in 5 of 7 passes
# (docs/benchmarks/h200-2026-12-02-s24; classic rounds not measured). One rule for all
# three keeps their log-probabilities bit-identical.
# 8 bits, groups of 64, on an H100 (session 71): 96-token DFlash generations at tau = 6
# took 340-342 ms with every part against 587 ms with mlx's matmuls (both with mlx's
# graphs, every run lossless), and the 8-bit verify forward's device time 18.0 ms against
# 33.2 (docs/benchmarks/h100-2026-12-07-s71; plain tokens not measured at 8 bits).
# Groups of 32 and 128, on an H100 (session 74, one process a form, 4-bit with direct
# launches, 8-bit with mlx's graphs): tau = 6 rounds took 21.9-23.9 ms with every part
# against 67.4-73.4 at 4 bits and 25.0-28.3 against 37.3-44.2 at 8, all lossless; our plain
# tokens equal mlx-lm's with and without the kernels and took 13.9-18.7 ms against
# 16.9-26.2; 96-token 4-bit loops (graphs on) 280-337 ms, 5.8-6.7x mlx-lm's plain
# decoding, lossless (docs/benchmarks/h100-2026-12-07-s74).
KERNELS_BY_QUANTIZATION: Dict[Tuple[str, str, int, int], Tuple[str, ...]] = {
    ("cuda", "muse_glimmer", 4, 64): VERIFY_KERNEL_PARTS,
    ("cuda", "muse_glimmer", 8, 64): VERIFY_KERNEL_PARTS,
    ("cuda", "muse_glimmer", 4, 32): VERIFY_KERNEL_PARTS,
    ("cuda", "muse_glimmer", 4, 128): VERIFY_KERNEL_PARTS,
    ("cuda", "muse_glimmer", 8, 32): VERIFY_KERNEL_PARTS,
    ("cuda", "muse_glimmer", 8, 128): VERIFY_KERNEL_PARTS,
}
# Where DFlash rounds measured faster with direct launches (mlx's CUDA graphs off) than
# with mlx's graphs while dflash's matmul runs, by the same key: 4-bit rounds are paced by
# the host (sessions 62 and 70: 245 against 300 ms at 4k on an H100). 8-bit ones are not:
# 340-342 ms with the graphs against 374-380 without (session 71, 7 processes). 4-bit
# groups of 32 and 128 are not here: with the graphs their loops took 280-337 ms at 4k
# (session 74, lossless); at groups of 128 direct launches took 298 and 361 ms against
# 325 and 379 with the graphs (session 75), not separated; at groups of 32 269-295 ms
# against 286-322 (session 76, 4 processes each, lower in 5 of 5 adjacent comparisons
# but the repetitions overlap: medians 289.0 against 295.8 ms), not separated either;
# at groups of 128 again, 6 processes an arm (session 77): 258-281 ms direct against
# 250-310 with the graphs, p = 0.24, not separated.
DIRECT_LAUNCHES_BY_QUANTIZATION: FrozenSet[Tuple[str, str, int, int]] = frozenset(
    {("cuda", "muse_glimmer", 4, 64)}
)
# The same rule for a target whose every projection is dense in one dtype, by (backend,
# architecture, dtype name). bf16 Muse Glimmer on an H200, tau = 6: DFlash decoding ran at
# 4.04-4.50x mlx-lm's plain decoding with them against 3.00-3.64x without, 5 of 5 process
# pairs at 4k over sessions 35, 40 and 44, and 4.33x against 3.50x at 32k; since session
# 43's included texts our plain tokens take 1.02-1.08 of kernels-off (17.1 against 15.9-16.8
# ms; 1.11-1.26 in session 35), the price of plain and speculative decoding sharing the
# kernels and the bits (docs/benchmarks/h200-2026-12-04-s44).
KERNELS_BY_DENSE_DTYPE: Dict[Tuple[str, str, str], Tuple[str, ...]] = {
    ("cuda", "muse_glimmer", "bfloat16"): VERIFY_KERNEL_PARTS,
}
VERIFY_KERNELS_ENV = "DFLASH_VERIFY_KERNELS"


def projection_form(model: nn.Module) -> Optional[Tuple[Any, ...]]:
    """The one form every projection (``nn.Linear`` / ``nn.QuantizedLinear``) of
    ``model`` has, found in one walk of its modules.

    Args:
        model: An mlx-lm model.

    Returns:
        ``("affine", bits, group_size)`` when every projection is quantized in mlx's
        affine mode with those bits and group size; ``("dense", dtype_name)`` when every
        projection is dense with weights of that dtype (``"bfloat16"``); None when the
        projections mix forms or dtypes, are quantized in another mode, or there is none.
    """
    forms = set()
    for module in model.modules():
        if isinstance(module, nn.QuantizedLinear):
            mode = getattr(module, "mode", "affine")
            forms.add(
                ("affine", module.bits, module.group_size) if mode == "affine" else None
            )
        elif isinstance(module, nn.Linear):
            forms.add(("dense", str(module.weight.dtype).rsplit(".", 1)[-1]))
        if len(forms) > 1:
            return None
    return forms.pop() if forms else None


def quantized_form(model: nn.Module) -> Optional[Tuple[int, int]]:
    """The one affine ``(bits, group_size)`` of every projection of ``model``.

    Args:
        model: An mlx-lm model.

    Returns:
        ``(bits, group_size)`` when every ``nn.Linear`` / ``nn.QuantizedLinear`` in the
        model is quantized, in mlx's affine mode, with the same bits and group size;
        None when some projection is dense, the forms differ, or there is none.
    """
    form = projection_form(model)
    return form[1:] if form is not None and form[0] == "affine" else None


def dense_dtype(model: nn.Module) -> Optional[str]:
    """The one dtype of every projection's weight of a dense ``model``.

    Args:
        model: An mlx-lm model.

    Returns:
        The dtype's name (``"bfloat16"``) when every projection is an ``nn.Linear`` and
        their weights share one dtype; None when some projection is quantized, the dtypes
        differ, or there is none.
    """
    form = projection_form(model)
    return form[1] if form is not None and form[0] == "dense" else None


def _env_parts() -> Optional[Tuple[str, ...]]:
    """``DFLASH_VERIFY_KERNELS``: ``1`` every part, ``0`` none, or a comma list of parts.

    Returns:
        The parts, or None when the variable is unset or empty.

    Raises:
        ValueError: The value is neither an on/off word nor a list of known parts.
    """
    switch = backend.env_switch(VERIFY_KERNELS_ENV)
    if switch is not None:
        return VERIFY_KERNEL_PARTS if switch else ()
    text = os.environ.get(VERIFY_KERNELS_ENV, "").strip().lower()
    if not text:
        return None
    parts = tuple(part.strip() for part in text.split(","))
    unknown = [part for part in parts if part not in VERIFY_KERNEL_PARTS]
    if unknown:
        raise ValueError(
            f"{VERIFY_KERNELS_ENV}={text!r}: expected 0, 1 or a comma list of "
            f"{', '.join(VERIFY_KERNEL_PARTS)}"
        )
    return tuple(part for part in VERIFY_KERNEL_PARTS if part in parts)


def wanted_parts(
    model: nn.Module, use_kernel: Optional[bool] = None
) -> Tuple[str, ...]:
    """Which verify-kernel parts :func:`verify_kernels` installs for ``model``.

    Plain, classic speculative and DFlash decoding ask alike, so by default they run the
    same kernels (and give the same log-probabilities bit for bit).

    Args:
        model: The target.
        use_kernel: True (every part) / False (none) decide; None asks
            ``DFLASH_VERIFY_KERNELS``, then ``DFLASH_KERNELS=0`` (none), then (with
            the GPU as the default device) :data:`KERNELS_BY_QUANTIZATION` for a
            target in a measured quantized form, :data:`KERNELS_BY_DENSE_DTYPE` for
            a dense one in a measured dtype, else :data:`VERIFY_KERNELS_BY_DEFAULT`
            for this backend.

    Returns:
        A sub-tuple of :data:`VERIFY_KERNEL_PARTS` (empty for an architecture
        :func:`supports` refuses).

    Raises:
        ValueError: ``DFLASH_VERIFY_KERNELS`` holds something else.
    """
    if not supports(model):
        return ()
    if use_kernel is not None:
        return VERIFY_KERNEL_PARTS if use_kernel else ()
    parts = _env_parts()
    if parts is not None:
        return parts
    if not (
        backend.KERNELS_ENABLED
        and backend.BACKEND is not None
        and backend.gpu_is_default()
    ):
        return ()
    return default_parts(architecture(model), projection_form(model), backend.BACKEND)


def default_parts(
    architecture_name: Optional[str],
    form: Optional[Tuple[Any, ...]],
    backend_name: Optional[str],
) -> Tuple[str, ...]:
    """The parts installed when no ``use_kernel`` is given, on a GPU that takes them,
    for a target of this architecture and projection form: known before the model
    loads (the commands' launch mode reads them off ``config.json``).

    Args:
        architecture_name: The mlx-lm module name (:func:`architecture`).
        form: As :func:`projection_form` gives it (None: mixed or unknown).
        backend_name: ``"cuda"`` or ``"metal"``.

    Returns:
        Nothing for an architecture :func:`supports` refuses; else what
        ``DFLASH_VERIFY_KERNELS`` asks for; else :func:`measured_parts`.

    Raises:
        ValueError: ``DFLASH_VERIFY_KERNELS`` holds something else.
    """
    if architecture_name not in SUPPORTED_ARCHITECTURES:
        return ()
    parts = _env_parts()
    if parts is not None:
        return parts
    return measured_parts(backend_name, architecture_name, form)


def measured_parts(
    backend_name: Optional[str], architecture_name: str, form: Optional[Tuple[Any, ...]]
) -> Tuple[str, ...]:
    """The parts installed by default where measured faster, with nobody saying.

    Args:
        backend_name: ``"cuda"`` or ``"metal"``.
        architecture_name: The mlx-lm module name (:func:`architecture`).
        form: As :func:`projection_form` gives it (None: mixed or unknown).

    Returns:
        :data:`KERNELS_BY_QUANTIZATION` or :data:`KERNELS_BY_DENSE_DTYPE`'s entry for
        a measured form, else :data:`VERIFY_KERNELS_BY_DEFAULT`'s for the backend.
    """
    parts = VERIFY_KERNELS_BY_DEFAULT.get(backend_name, ())
    if form is None:
        return parts
    measured = (backend_name, architecture_name, *form[1:])
    table = KERNELS_BY_QUANTIZATION if form[0] == "affine" else KERNELS_BY_DENSE_DTYPE
    return table.get(measured, parts)


def prefers_direct_launches(
    architecture_name: Optional[str],
    form: Optional[Tuple[Any, ...]],
    backend_name: Optional[str],
) -> bool:
    """Whether a target of this architecture and projection form runs its DFlash rounds
    faster with direct launches than with mlx's CUDA graphs, as measured: dflash's
    matmul is installed (:func:`default_parts`) and the form is in
    :data:`DIRECT_LAUNCHES_BY_QUANTIZATION`. Elsewhere (dense, mlx's matmuls, a form
    not measured) mlx's graphs are kept.

    Args:
        architecture_name: The mlx-lm module name (:func:`architecture`).
        form: As :func:`projection_form` gives it (None: mixed or unknown).
        backend_name: ``"cuda"`` or ``"metal"``.

    Returns:
        True where direct launches measured faster.

    Raises:
        ValueError: ``DFLASH_VERIFY_KERNELS`` holds something else.
    """
    if form is None or form[0] != "affine":
        return False
    if "matmul" not in default_parts(architecture_name, form, backend_name):
        return False
    key = (backend_name, architecture_name, *form[1:])
    return key in DIRECT_LAUNCHES_BY_QUANTIZATION


def wanted(model: nn.Module, use_kernel: Optional[bool] = None) -> bool:
    """Whether :func:`verify_kernels` installs any part for ``model`` (see :func:`wanted_parts`)."""
    return bool(wanted_parts(model, use_kernel))


def is_patched(model: nn.Module) -> bool:
    """Whether some :class:`KernelPatch` is installed on ``model`` (any part)."""
    return any(hasattr(type(module), _ORIGINAL_CLASS) for module in model.modules())


@dataclass
class _HeldPatch:
    """A patch :func:`verify_kernels` installed and how many ``with`` blocks hold it."""

    patch: KernelPatch
    holders: int = 1


# Held patches by ``id`` of their model. Generators on one model can interleave (each
# keeps its block open between tokens); the patch stays until the last of them ends, so
# none finishes its tokens on other kernels than it began with.
_HELD_PATCHES: Dict[int, _HeldPatch] = {}


@contextlib.contextmanager
def verify_kernels(
    model: nn.Module,
    drafter: Optional[nn.Module] = None,
    use_kernel: Optional[bool] = None,
) -> Iterator[Optional[KernelPatch]]:
    """Install :class:`KernelPatch` for the ``with`` block when :func:`wanted` says so.

    What the generators use (plain, classic speculative and DFlash decoding alike, so
    their log-probabilities agree bit for bit): by default for a target in a measured
    quantized form (:data:`KERNELS_BY_QUANTIZATION`), or as ``DFLASH_VERIFY_KERNELS``
    says. A model already patched by the caller is left as it is. A block entered while
    another block's patch is installed on the model shares it: the patch is removed when
    the last block holding it ends.

    Args:
        model: The target.
        drafter: The drafter to patch with it (DFlash decoding).
        use_kernel: As for :func:`wanted`; when installing, True runs the kernel forms,
            None the backend's default form.

    Yields:
        The installed patch, or None when this block installed nothing.
    """
    held = _HELD_PATCHES.get(id(model))
    if held is not None:
        held.holders += 1
        try:
            yield None
        finally:
            _release_patch(model)
        return
    parts = () if is_patched(model) else wanted_parts(model, use_kernel)
    if not parts:
        yield None
        return
    patch = KernelPatch(
        model,
        drafter,
        use_kernel=use_kernel or None,
        attention="attention" in parts,
        matmul="matmul" in parts,
        projections="projections" in parts,
    ).install()
    _HELD_PATCHES[id(model)] = _HeldPatch(patch)
    try:
        yield patch
    finally:
        _release_patch(model)


def _release_patch(model: nn.Module) -> None:
    """One block fewer holds ``model``'s patch; the last one uninstalls it."""
    held = _HELD_PATCHES[id(model)]
    held.holders -= 1
    if held.holders == 0:
        del _HELD_PATCHES[id(model)]
        held.patch.uninstall()


def folded_wanted(model: nn.Module, use_folded: Optional[bool] = None) -> bool:
    """Whether :func:`attention_route` installs the folded route for ``model``.

    Args:
        model: The target (or draft model).
        use_folded: True / False decide; None asks ``DFLASH_FOLDED_ATTENTION``, then
            :data:`dflash.folded_attention.FOLDED_BY_DEFAULT` for this backend (with the
            GPU as the default device).

    Returns:
        The decision (False for an architecture :func:`supports` refuses).
    """
    if not supports(model):
        return False
    if use_folded is not None:
        return bool(use_folded)
    return folded.wanted(backend.BACKEND if backend.gpu_is_default() else None)


@contextlib.contextmanager
def attention_route(
    model: nn.Module, use_folded: Optional[bool] = None
) -> Iterator[bool]:
    """Send ``model``'s block forwards to :func:`~dflash.folded_attention.folded_attention`.

    While the ``with`` block runs, ``model``'s architecture module calls go through the
    dispatcher: attention of 2 to 32 queries over at least
    :data:`~dflash.folded_attention.MIN_KEYS` keys (verify and draft blocks) takes the
    folded form; decode steps and prompt chunks keep mlx-lm's. Leaving restores the
    module function (unless a :class:`KernelPatch` still holds it).

    Args:
        model: The target.
        use_folded: As for :func:`folded_wanted`.

    Yields:
        Whether the route is installed.
    """
    if not folded_wanted(model, use_folded):
        yield False
        return
    attention = type(target_layers(model)[0].self_attn)
    name = getattr(attention, _ORIGINAL_CLASS, attention).__module__
    _hook_module(name, folded_route=True)
    try:
        yield True
    finally:
        _unhook_module(name, folded_route=True)
