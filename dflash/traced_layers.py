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
   an array; where the fused launch stores its members as blocks (the tensor-core
   form), the head prep reads q, k and v in place in its output, and the gated fold
   below the gate, at the members' offsets (:func:`fused_offsets`): no view of a
   member, each a graph node every replay builds and encodes;
2. the plane's bookkeeping in Python: the block is handed to
   ``update_and_fetch_block`` (held back under a checkpoint, written otherwise) and the
   attention's plan is made, as the route makes it (once a step for each attention kind:
   the other layers of the kind look it up in the step memo, below);
3. one replay of the **post-attention trace**: the attention's chunk pass and gated
   fold over the plane in place (their integers an input), the output projection, the
   post-attention norm and residual, the MLP with its norms, and the last residual.
   With the residual norms (on CUDA by default), those are two launches, and the last
   also norms the output for the next traced layer, which then skips its input norm
   (the hand-off, below).

Each trace is ``mx.compile`` of the same Python the eager route runs, so it adds the
same launches with the same inputs: the same bits (the CUDA tests compare the two
bit for bit). A trace is kept per input geometry (the plan's launch shapes included),
at most :data:`MAX_TRACES` a layer, and dropped when any array of the layer is
replaced. Launches that need zeroed counters (the matmul's merged K split) take them
from one counters array per replay, cut from the pool outside the trace
(:class:`dflash.metal.groups.CounterFeed`), so no fill runs inside a replay and no two
replays share a counter.

The host's work around the replays (the head prep's scalars, the attention's plan, form
and scalars, the trace's geometry) is the same for a step's layers of one attention
kind, so it is memoised on every input it reads (session 36: a traced layer took the
H200's host 148-185 µs, the two replays 61-72 of it; with the memo, DFlash decoding at
4-bit was 1.06-1.11 times faster in 4 of 4 alternated pairs,
``docs/benchmarks/h200-2026-12-03-s36``).

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

import functools
import itertools
import threading
from dataclasses import dataclass, field
from functools import partial
from operator import is_
from typing import Any, Callable, Dict, List, Optional, Tuple

import mlx.core as mx
import mlx.nn as nn

from . import fused_projections, residual_layers
from .cache.plane import RingPlane
from .metal import attention, backend, groups, heads, prefetch, tensor_qmm
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


def _after_attention(
    layer: nn.Module,
    x: mx.array,
    attended: mx.array,
    residual_norms: bool = False,
    use_kernel: Optional[bool] = None,
    l2: Optional[prefetch.Prefetch] = None,
) -> mx.array:
    """The post-attention norm and residual, then the MLP with its norms and residual;
    with ``residual_norms``, each norm-add(-norm) group as one launch
    (:func:`dflash.residual_layers.after_attention`, ``use_kernel`` and the MLP's
    prefetch ``l2`` passed on).

    Shapes: x, attended ``(B, L, H)``; returns ``(B, L, H)``.
    """
    if residual_norms:
        return residual_layers.after_attention(
            layer, x, attended, use_kernel, prefetch=l2
        )[0]
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


# The attention's projections one fused set must hold, in this order, for the head
# prep and the gated fold to read them in place.
FUSED_MEMBERS = ("q_proj", "k_proj", "v_proj", "gate_proj")


@dataclass(frozen=True)
class _Fused:
    """The attention's q / k / v / gate projections served by one member-major fused
    launch, read in place: its set, the kernel choice its members' calls pass, and
    each member's element offset in its output (:func:`fused_offsets`)."""

    group: fused_projections.FusedProjections
    use_kernel: Optional[bool]
    offsets: Tuple[int, int, int, int]
    # The launch also prepares the heads where it can (tensor_qmm.prepared_heads).
    prepared: bool = False


def fused_offsets(
    layer: nn.Module, x: mx.array, handed: bool, use_kernel: Optional[bool]
) -> Optional[Tuple[int, int, int, int]]:
    """Where q, k, v and the gate start in the one fused output of ``layer``'s
    attention projections for the pre-attention trace's input ``x`` (elements), or
    None where the trace takes the projections one call each: they are not exactly
    one fused set of :data:`FUSED_MEMBERS` in that order, each member still served by
    it, whose launch for the projections' input is member-major
    (:meth:`~dflash.fused_projections.FusedProjections.member_offsets`), with each
    member as wide as its heads.

    Args:
        layer: A layer :func:`serves` takes.
        x: The trace's input: the layer's input, or with ``handed`` the rows the
            previous layer normed for it (the projections' input itself).
        handed: See ``x``.
        use_kernel: The route's choice, which the members' patched calls pass.

    Returns:
        ``(q, k, v, gate)`` element offsets, or None.

    Shapes: x ``(B, L, H)``.
    """
    attn = layer.self_attn
    members = [getattr(attn, name, None) for name in FUSED_MEMBERS]
    slot = getattr(members[0], "__dict__", {}).get(fused_projections.MEMBER_SLOT)
    if slot is None:
        return None
    group = slot.group
    if len(group.members) != len(members):
        return None
    # Each member called alone would take its columns of this set's launch.
    for index, (member, held) in enumerate(zip(members, group.members)):
        own = getattr(member, "__dict__", {}).get(fused_projections.MEMBER_SLOT)
        if (
            member is not held
            or own is None
            or own.group is not group
            or own.index != index
            or not group.serves(index, member)
        ):
            return None
    # The projections see the input norm's rows: x's shape, and x's dtype where the
    # norm's weight has it (else the members' calls see another dtype than x's).
    weight = getattr(layer.input_layernorm, "weight", None)
    if not handed and (weight is None or weight.dtype != x.dtype):
        return None
    q_width, kv_width = attn.n_heads * attn.head_dim, attn.n_kv_heads * attn.head_dim
    widths = tuple(stop - start for start, stop in group.bounds)
    if widths != (q_width, kv_width, kv_width, q_width):
        return None
    offsets = group.member_offsets(x, use_kernel)
    return None if offsets is None else tuple(offsets)


def _pre_attention(
    layer: nn.Module,
    prep: heads.Prep,
    handed: bool,
    fused: Optional[_Fused],
    x: mx.array,
    prep_ints: mx.array,
) -> Tuple[mx.array, mx.array, mx.array]:
    """The input norm, the projections and the head prep (the prepared attention's
    first half, in its order); with ``handed``, ``x`` is the input already normed (the
    previous layer's hand-off).

    With ``fused``, the projections are the one launch of their fused set, whose
    member-major output the head prep reads q, k and v from in place (at the offsets
    ``prep_ints`` carries: :func:`_pre_call`) and which stands for the gate too: no
    view of any member is made (one graph node each, every replay). With
    ``fused.prepared``, that launch also prepares the heads where its prepared form
    serves (:func:`_prepared`): no head prep launch.

    Shapes: x ``(B, L, H)``; returns queries ``(B, L, Hq, D)``, the stacked block
    ``(2, B, Hkv, L, D)`` and the gate ``(B, L, Hq * D)``, or with ``fused`` the fused
    output ``(B * L * N,)`` (the gate from ``fused.offsets[3]`` on).
    """
    attn = layer.self_attn
    h = x if handed else layer.input_layernorm(x)
    if fused is not None and fused.prepared:
        prepared = _prepared(attn, fused, h, prep, prep_ints)
        if prepared is not None:
            return prepared
    if fused is not None:
        made = fused.group.fused_output(h, fused.use_kernel)
        if made is None or made[1] != fused.offsets:
            raise RuntimeError(
                f"the fused projections' output for {h.shape} {h.dtype} is not the "
                f"one planned (offsets {fused.offsets}, now "
                f"{None if made is None else made[1]})"
            )
        y = made[0]
        batch, length, _ = h.shape
        queries, block = heads.launch_head_prep(
            y, y, prep, prep_ints, y, attn.head_dim,
            offsets=fused.offsets[:3],
            geometry=(batch, length, attn.n_heads, attn.n_kv_heads),
        )  # fmt: skip
        return queries, block, y
    # The head prep takes the projections with their heads merged: no reshapes.
    queries, block = heads.launch_head_prep(
        attn.q_proj(h), attn.k_proj(h), prep, prep_ints, attn.v_proj(h), attn.head_dim
    )
    return queries, block, attn.gate_proj(h)


def _prepared(
    attn: nn.Module,
    fused: _Fused,
    h: mx.array,
    prep: heads.Prep,
    prep_ints: mx.array,
) -> Optional[Tuple[mx.array, mx.array, mx.array]]:
    """The projections and the head prep as one launch (the fused matmul's prepared
    form), or None where it does not serve: the queries and the stacked block are
    views of its output (the k and v members, stored head-major, lie side by side).

    Shapes: h ``(B, L, H)``; returns queries ``(B, L, Hq, D)``, the block ``(2, B,
    Hkv, L, D)`` and the fused output ``(B * L * N,)``.
    """
    inputs = heads.prepared_inputs(prep, prep_ints, h.dtype)
    y = fused.group.prepared_output(h, fused.use_kernel, inputs)
    if y is None:
        return None
    offsets = fused.group.member_offsets(h, fused.use_kernel)
    if offsets != fused.offsets:
        raise RuntimeError(
            f"the prepared projections' output for {h.shape} {h.dtype} is not the "
            f"one planned (offsets {fused.offsets}, now {offsets})"
        )
    batch, length, _ = h.shape
    q_at, k_at, _, gate_at = fused.offsets
    dim = attn.head_dim
    queries = y[q_at:k_at].reshape(batch, length, attn.n_heads, dim)
    block = y[k_at:gate_at].reshape(2, batch, attn.n_kv_heads, length, dim)
    return queries, block, y


def _post_attention(
    layer: nn.Module,
    form: attention.KernelForm,
    residual_norms: Tuple[bool, Optional[bool]],
    next_norm: Optional[nn.Module],
    l2: Optional[prefetch.Prefetch],
    x: mx.array,
    queries: mx.array,
    gate: mx.array,
    *arrays: mx.array,
) -> Any:
    """The gated attention over the plane in place, the output projection and the rest
    of the layer.

    Args:
        layer, form: What the trace is of.
        residual_norms: ``(on, use_kernel)`` of :func:`_after_attention`'s residual
            norms.
        next_norm: With the residual norms on, the next layer's input norm, which the
            last launch also takes (the hand-off): the trace then returns the output
            and the output normed by it. None: the output alone.
        l2: With the residual norms on, what the first of them also asks into the
            L2 (the MLP's first weights: :mod:`dflash.metal.prefetch`), or None. Its
            arrays are the trace's constants, not inputs: the MLP's own launch
            captures the same weights, and mlx refuses a trace whose input is also
            one of its constants.
        x: The layer's input (the residual).
        queries: The prepared queries.
        gate: The output gate, as its projection gives it, or the fused q / k / v /
            gate output it lies in (from ``form.gate_offset`` on: the fold reads it
            in place).
        *arrays: :func:`dflash.metal.attention.launch_attention`'s arrays after the
            queries: the bound plane and block, then the integer and float scalars.

    Shapes: x ``(B, L, H)``; queries ``(B, L, Hq, D)``; gate ``(B, L, Hq * D)`` (or
    the fused ``(B * L * N,)``); returns ``(B, L, H)``.

    Besides the launches, the trace holds only one view per member of the MLP's fused
    gate / up and at most one split of the counters: each view is one more array that
    every replay builds and mlx's encode visits (session 61: 22.25 graph nodes a verify
    layer, from 38.25; the attention's q / k / v / gate read in place, 18.25;
    ``benchmarks.graph_nodes``).
    """
    attn = layer.self_attn
    batch, length, _ = x.shape
    # The fold reads the gate and stores its result with the heads merged, as the
    # output projection takes it: no view between the launches.
    stored = (batch, length, attn.n_heads * attn.head_dim)
    out = attention.launch_attention(form, queries, *arrays, gate, stored)
    if next_norm is not None:
        return residual_layers.after_attention(
            layer, x, attn.o_proj(out), residual_norms[1], next_norm, l2
        )
    return _after_attention(layer, x, attn.o_proj(out), *residual_norms, l2)


class _Replay:
    """One trace of a layer half: its compiled function and the counters a call takes.

    The first call runs the half eagerly and counts the counters its launches take
    (each launch's region); later calls replay the trace with one fresh pool region of
    that many, which the trace cuts by those regions.
    """

    __slots__ = ("function", "compiled", "counters", "regions")

    def __init__(self, function: Callable) -> None:
        self.function = function
        self.compiled: Optional[Callable] = None
        self.counters = 0
        self.regions: Tuple[int, ...] = ()

    def __call__(self, *inputs: mx.array) -> Any:
        if self.compiled is None:
            with groups.counter_feed(groups.CounterFeed()) as feed:
                out = self.function(*inputs)
            self.counters, self.regions = feed.taken, tuple(feed.sizes)
            self.compiled = backend.compile_traced(self._fed)
            return out
        # A half whose launches take no counters gets a placeholder: no region cut
        # (a lock and a slice) for an input its trace never reads.
        counters = (
            groups.COUNTER_POOL.take(self.counters) if self.counters else _no_counters()
        )
        return self.compiled(counters, *inputs)

    def _fed(self, counters: mx.array, *inputs: mx.array) -> Any:
        # Cut by the regions counted: one split (or none) instead of a slice a launch.
        with groups.counter_feed(groups.CounterFeed(counters, self.regions)):
            return self.function(*inputs)


@functools.lru_cache(maxsize=None)
def _no_counters() -> mx.array:
    """The counters input of a replay whose launches take none (its own array: one a
    launch binds inside the trace must not also be the trace's input)."""
    return mx.array([0], dtype=mx.int32)


@dataclass
class LayerTraces:
    """A layer's traces and the arrays its modules held when they were made.

    Attributes:
        modules, names, arrays: Every array of the layer then, as
            ``modules[i][names[i]] is arrays[i]``.
        sizes: Each module of the layer and its number of entries then.
        kind: The interned :func:`_attention_kind` of the layer's attention then (its
            settings are read when the traces are made, as the traces capture them).
        fused: :func:`fused_offsets` per pre-attention input (shape, dtype, whether
            handed): worked out once while the layer holds these arrays.
        pre: Pre-attention replays per input shape and dtype, hand-off and fused
            offsets.
        post: Post-attention replays per interned geometry (input shapes, the
            attention form) and residual-norm choice.
    """

    modules: List[nn.Module]
    names: List[str]
    arrays: List[mx.array]
    sizes: Tuple[List[nn.Module], List[int]]
    kind: int
    fused: Dict[tuple, Optional[Tuple[int, ...]]] = field(default_factory=dict)
    pre: Dict[tuple, _Replay] = field(default_factory=dict)
    post: Dict[tuple, _Replay] = field(default_factory=dict)

    @classmethod
    def of(cls, layer: nn.Module, kind: Optional[int] = None) -> "LayerTraces":
        """The layer's arrays now (with its successor's input norm's, which a hand-off
        captures), and no traces; ``kind`` None: the interned :func:`_attention_kind` of
        its (Glimmer) attention."""
        next_norm = successor_norm(layer)
        every = layer.modules() + ([] if next_norm is None else next_norm.modules())
        held = [
            (module, name, value)
            for module in every
            for name, value in module.items()
            if isinstance(value, mx.array)
        ]
        modules, names, arrays = (list(column) for column in zip(*held))
        if kind is None:
            kind = _interned(_KINDS, _attention_kind(layer.self_attn), MAX_MEMO)
        return cls(modules, names, arrays, (every, list(map(len, every))), kind)

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


def _attention_kind(attn: nn.Module) -> tuple:
    """What the host's work for a call reads of an attention besides the call's own
    shapes and positions: heads, dtype, norm, RoPE and scale."""
    rope = (attn.rope.base, attn.rope.scale) if attn.use_rope else None
    return (
        attn.n_heads, attn.n_kv_heads, attn.head_dim, _projection_dtype(attn.q_proj),
        attn.eps, attn.qk_scale_factor, rope, float(attn.scale),
    )  # fmt: skip


# ------------------------------------------------------------------ the step memo
#
# A step's layers of one kind (one attention kind over planes at the same position
# and bookkeeping) ask the host for the same things: the head prep's scalars, the
# attention's plan, form and scalars, the post trace's geometry. Worked out by the
# first layer of a kind and looked up by the others (one key each): the pieces a hit
# skips took the H200's host ~32 µs a layer (session 36). Keys hold every input they
# read, so a hit gives what the miss would have computed (a plan the route refuses
# raises at each miss and is never memoised).

# Memo entries kept (a step adds a few; old positions are never asked again), and
# geometries numbered (each a trace of every layer: kept far longer).
MAX_MEMO = 256
MAX_GEOMETRIES = 4096
_KINDS: Dict[tuple, int] = {}
_GEOMETRIES: Dict[tuple, int] = {}
_NEXT_ID = itertools.count()


def _interned(table: Dict[tuple, int], key: tuple, limit: int) -> int:
    """A number for ``key`` that no other key ever gets (the table is cleared at
    ``limit`` keys: a key seen again then gets a new number, never another key's)."""
    number = table.get(key)
    if number is None:
        if len(table) >= limit:
            table.clear()
        number = table[key] = next(_NEXT_ID)
    return number


@dataclass(frozen=True)
class _PreCall:
    """The pre-attention half's host work at one position: the head prep and its
    integer scalars."""

    prep: heads.Prep
    ints: mx.array


@dataclass(frozen=True)
class _PostCall:
    """The post-attention half's host work for one plan: the plan (validated), its
    kernel form, the float scalars and the interned geometry of the trace."""

    plan: attention.Plan
    form: attention.KernelForm
    floats: mx.array
    geometry: int


_PRE_CALLS: Dict[tuple, _PreCall] = {}
_POST_CALLS: Dict[tuple, _PostCall] = {}


def _memo(table: Dict[tuple, Any], key: tuple, make: Callable[[], Any]) -> Any:
    """``table[key]``, made by ``make`` on a miss (stored only if it returns)."""
    entry = table.get(key)
    if entry is None:
        entry = make()  # may raise: nothing is stored then
        if len(table) >= MAX_MEMO:
            table.clear()
        table[key] = entry
    return entry


def _pre_call(
    attn: nn.Module,
    x: mx.array,
    start: int,
    offsets: Optional[Tuple[int, ...]] = None,
) -> _PreCall:
    """The head prep of a call at ``start`` (a memo miss); with ``offsets`` (the
    fused q / k / v / gate output's, :func:`fused_offsets`), reading q, k and v in
    place there."""
    prep = prep_of(attn, start)
    batch, length, _ = x.shape
    q_shape = (batch, length, attn.n_heads, attn.head_dim)
    if offsets is None:
        ints = heads.head_prep_ints(q_shape, attn.n_kv_heads, prep, True)
    else:
        ints = heads.head_prep_ints(
            q_shape, attn.n_kv_heads, prep, True, offsets=tuple(offsets[:3])
        )
    return _PreCall(prep, ints)


def _post_call(
    attn: nn.Module,
    x: mx.array,
    queries: mx.array,
    sources: Tuple[attention.KeyPlane, Optional[mx.array], Optional[mx.array]],
    window: Optional[int],
    chunk: int,
    start: int,
    gate_offset: int = 0,
) -> _PostCall:
    """The attention's plan, form and scalars and the trace's geometry (a memo miss);
    the gated fold reads its gate from element ``gate_offset`` on (of the fused
    projections' output, or 0: the gate's own array).

    Raises:
        ValueError: The route refuses the call (:func:`attention.make_plan`).
    """
    plane, block_keys, block_values = sources
    plan = attention.make_plan(
        queries.transpose(0, 2, 1, 3), plane, block_keys, block_values,
        window=window, causal=True, query_start=start, chunk=chunk,
    )  # fmt: skip
    form = attention.kernel_form(plan, queries.dtype, True, gate_offset)
    bound = attention.bound_arrays(plan, plane, block_keys, block_values)
    launch = form.launch
    geometry = (form.spec, launch.chunk_shapes, launch.chunk_groups, launch.out_shape)
    geometry += (launch.fold_groups, form.dtype, x.shape, x.dtype, gate_offset)
    geometry += tuple((array.shape, array.dtype) for array in bound)
    floats = groups.float_params(float(attn.scale), 0.0)
    return _PostCall(
        plan, form, floats, _interned(_GEOMETRIES, geometry, MAX_GEOMETRIES)
    )


def _post_key(
    kind: int,
    x: mx.array,
    sources: Tuple[attention.KeyPlane, Optional[mx.array], Optional[mx.array]],
    window: Optional[int],
    chunk: int,
    start: int,
    gate_offset: int = 0,
) -> tuple:
    """Every input :func:`_post_call` reads, as a key (the queries follow from ``x``
    and the kind)."""
    plane, block_keys, _ = sources
    keys = plane.keys
    block = None if block_keys is None else (block_keys.shape, block_keys.dtype)
    return (
        kind, x.shape, x.dtype, keys.shape, keys.dtype, plane.values.shape,
        plane.length, plane.origin_logical, plane.origin_physical, block, window,
        chunk, start, gate_offset,
    )  # fmt: skip


# ------------------------------------------------------------------ the forward


def layer_forward(
    layer: nn.Module,
    x: mx.array,
    cache: Any,
    chunk: int,
    key_source: Callable,
    slot: str,
    residual_norms: bool = False,
    use_kernel: Optional[bool] = None,
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
        residual_norms: The post-attention trace runs the layer's norm-add(-norm)
            groups as :func:`dflash.metal.norms.residual_norm` launches
            (:mod:`dflash.residual_layers`), ``use_kernel`` passed to them.
        use_kernel: See ``residual_norms``.

    Shapes: x ``(B, L, H)``; returns ``(B, L, H)``.
    """
    traces = _traces(layer, slot)
    attn = layer.self_attn
    length = x.shape[1]
    start = cache.offset
    handed = _handed(layer, x)
    source = x if handed is None else handed
    # Whether the projections are one member-major launch read in place (once per
    # input geometry while the layer holds its arrays).
    fused_key = (source.shape, source.dtype, handed is not None)
    offsets = traces.fused.get(fused_key, _UNSET)
    if offsets is _UNSET:
        offsets = fused_offsets(layer, source, handed is not None, use_kernel)
        traces.fused[fused_key] = offsets
    pre_call = _memo(
        _PRE_CALLS,
        (traces.kind, x.shape, start, offsets),
        lambda: _pre_call(attn, x, start, offsets),
    )
    pre = _replay(
        traces.pre,
        (x.shape, x.dtype, handed is not None, offsets),
        lambda: partial(
            _pre_attention, layer, pre_call.prep, handed is not None,
            _fused(attn, offsets, use_kernel),
        ),
    )  # fmt: skip
    # With offsets, ``gate`` is the fused output, the gate from offsets[3] on.
    queries, block, gate = pre(source, pre_call.ints)
    gate_offset = 0 if offsets is None else offsets[3]

    fetched = cache.update_and_fetch_block(block, fetch=False)
    keys, values = (None, None) if fetched is None else fetched
    window = cache.window if isinstance(cache, RingPlane) else None
    sources = key_source(cache, keys, values, length, window)
    query_start = cache.offset - length
    post_call = _memo(
        _POST_CALLS,
        _post_key(traces.kind, x, sources, window, chunk, query_start, gate_offset),
        lambda: _post_call(
            attn, x, queries, sources, window, chunk, query_start, gate_offset
        ),
    )
    form = post_call.form
    bound = attention.bound_arrays(post_call.plan, *sources)
    residual = (residual_norms, use_kernel)
    successor = layer.__dict__.get(SUCCESSOR) if residual_norms else None
    next_norm = None if successor is None else successor.input_layernorm
    l2 = mlp_prefetch(layer, x, use_kernel) if residual_norms else None
    # The plan is kept on the layer (and by the trace): its id names it.
    post = _replay(
        traces.post,
        (post_call.geometry,) + residual + (id(next_norm), id(l2)),
        lambda: partial(_post_attention, layer, form, residual, next_norm, l2),
    )
    launch = form.launch
    out = post(
        x, queries, gate, *bound, launch.ints, post_call.floats, launch.fold_ints
    )
    if next_norm is None:
        return out
    _HANDOFF.value = (out[0], out[1], successor)
    return out[0]


# An entry not worked out yet (None is one).
_UNSET = object()


def _fused(
    attn: nn.Module, offsets: Optional[Tuple[int, ...]], use_kernel: Optional[bool]
) -> Optional[_Fused]:
    """The :class:`_Fused` a pre-attention trace with ``offsets`` takes (None: none)."""
    if offsets is None:
        return None
    slot = attn.q_proj.__dict__[fused_projections.MEMBER_SLOT]
    prepared = attn.head_dim == tensor_qmm.COLUMNS and tensor_qmm.prepared_heads()
    return _Fused(slot.group, use_kernel, tuple(offsets), prepared)


# ------------------------------------------------------------------ the hand-off
#
# With the residual norms on, a traced layer whose next decoder layer is traced too
# (the kernel patch links it as ``SUCCESSOR``) has its last launch also take the next
# layer's input norm of its output: one launch a layer fewer, the same bits (the
# norm's kernel gives mlx's ``rms_norm``'s). The next layer takes the normed rows only
# when its input is that very output; any other call clears them.

SUCCESSOR = "_dflash_successor"
_HANDOFF = threading.local()


def successor_norm(layer: nn.Module) -> Optional[nn.Module]:
    """The input norm of the layer linked as ``layer``'s successor, or None."""
    successor = layer.__dict__.get(SUCCESSOR)
    return None if successor is None else successor.input_layernorm


def _handed(layer: nn.Module, x: mx.array) -> Optional[mx.array]:
    """The rows the previous layer normed for ``layer`` if ``x`` is its output (the
    hand-off is cleared either way)."""
    handed = getattr(_HANDOFF, "value", None)
    if handed is None:
        return None
    _HANDOFF.value = None
    output, normed, successor = handed
    return normed if output is x and successor is layer else None


# ------------------------------------------------------------------ the L2 prefetch
#
# With the residual norms on, the kernel patch links a traced layer whose MLP's gate /
# up is one fused launch to that group (``MLP_GROUP``, with the megabytes to ask for):
# the post-attention residual norm then also asks the group's first weights into the
# L2 (dflash.metal.prefetch), which the MLP's first matmul reads next. A prefetch
# changes no result; only the launch's grid and inputs differ.

MLP_GROUP = "_dflash_mlp_group"
# A layer's plan (kept across installs while it plans the arrays its MLP reads).
L2_PLAN = "_dflash_l2_plan"


def mlp_prefetch(
    layer: nn.Module, x: mx.array, use_kernel: Optional[bool]
) -> Optional[prefetch.Prefetch]:
    """The prefetch of ``layer``'s MLP's fused gate / up for inputs like ``x`` (the
    layer's input: the MLP's has its shape and dtype), or None: not linked, not the
    tensor-core form, or nothing to ask for. The launch is bound here if the MLP has
    not bound it yet, so the first trace made already carries the prefetch.

    The plan is kept on the layer across installs while it plans the very arrays the
    launch reads: the post trace's key names it, so a later install takes back the
    traces an earlier one kept.

    Shapes: x ``(B, L, H)``.
    """
    linked = layer.__dict__.get(MLP_GROUP)
    if linked is None:
        return None
    group, megabytes = linked
    reads = group.reads_for(x, use_kernel)
    if not reads:
        return None
    kept: Optional[prefetch.Prefetch] = layer.__dict__.get(L2_PLAN)
    if kept is not None and kept.plans(reads, megabytes):
        return kept
    plan = prefetch.plan(reads, megabytes)
    layer.__dict__[L2_PLAN] = plan
    return plan
