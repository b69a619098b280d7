"""Sibling projections that read one input, run as one matmul launch.

A verify forward on a fast GPU is bound by the host: every custom-kernel launch costs
tens of microseconds of Python and mlx dispatch. A Muse Glimmer layer reads its attention
input through four projections (``q_proj``, ``k_proj``, ``v_proj`` and the output gate
``gate_proj``) and its MLP input through two (``gate_proj``, ``up_proj``). Fused, each
set is one matmul over the members' rows stacked along ``N``: six launches (and their
K-split sums) become two.

The stacked weights are built once; each member's own weight becomes a row slice (a
view) of the stack, so memory does not grow and the member still works alone (mlx's
own forward, prefill chunks, an input the group did not see).

The stacked product runs in one of two forms: ``"kernel"``, our batch-invariant
:func:`~dflash.metal.qmm.small_row_matmul` (the matmul part of the verify kernels), or
``"mlx"``, mlx's own ``matmul`` / ``quantized_matmul`` on the stack (the ``projections``
part: fewer, wider launches without our kernels; on CUDA a 16-row bf16 matmul is a
cuBLAS call captured into a child graph, so the host saves four captures per layer).

At call time the first member to see an input computes every member's columns and keeps
them until each member has taken its own; a member called with another input object
computes alone. So a module that feeds its siblings different inputs stays correct (it
only wastes the columns nobody takes). A set built with ``tails=True`` computes only the
columns from the calling member on: the drafter's attention projects its block through
``q_proj`` / ``k_proj`` / ``v_proj`` but the committed context through ``k_proj`` /
``v_proj`` alone, so one stack serves both as one launch each, and the context's launch
reads no ``q_proj`` weight. In the kernel form, results are a function of
the input rows and the stacked weights only: batch-invariant like
:func:`~dflash.metal.qmm.small_row_matmul`, and the same in plain decoding and in a
verify block. The mlx form is as batch-invariant as mlx's own matmuls (a one-row
step and a 16-row block may take different kernels, as they do unfused).
"""

from __future__ import annotations

import itertools
import weakref
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import mlx.core as mx
import mlx.nn as nn

from .metal import backend, groups, qmm, tensor_qmm
from .metal.qmm import BoundMatmul, bind_matmul, compile_around
from .metal.tensor_qmm import member_views

# Member names per parent: an attention module's input projections, an MLP's gate / up.
SIBLINGS = (("q_proj", "k_proj", "v_proj", "gate_proj"), ("gate_proj", "up_proj"))
# ``DFLASH_FUSED_PROJECTIONS=0`` keeps every projection a launch of its own.
FUSED_ENV = "DFLASH_FUSED_PROJECTIONS"
# How the stacked product is computed: our small-row kernel, or mlx's own matmul.
FORMS = ("kernel", "mlx")
# The attribute (in the instance dict) holding a member's MemberSlot, as the kernel
# patch sets it.
MEMBER_SLOT = "_dflash_fused"
# An answer not worked out yet (None is one).
_UNSET = object()


def fuse_wanted() -> bool:
    """Whether the matmul part fuses sibling projections (``DFLASH_FUSED_PROJECTIONS``)."""
    return backend.env_switch(FUSED_ENV) is not False


def _signature(module: nn.Module) -> Optional[tuple]:
    """What members must share to stack: kind, K, dtype, quantization; None: unfusable."""
    if "bias" in module:
        return None
    weight = module["weight"]
    if isinstance(module, nn.QuantizedLinear):
        if getattr(module, "mode", "affine") != "affine" or "biases" not in module:
            return None
        dtype = module["scales"].dtype
        if module["biases"].dtype != dtype:
            return None
        return ("affine", weight.shape[1], dtype, module.bits, module.group_size)
    if isinstance(module, nn.Linear):
        return ("dense", weight.shape[1], weight.dtype)
    return None


def sibling_sets(parents: Sequence[nn.Module]) -> List[List[nn.Module]]:
    """The member lists to fuse: per parent, its first :data:`SIBLINGS` set that fits.

    A set fits when at least two of its names are linear layers of the parent that
    share a :func:`_signature`; members keep the set's order.
    """
    found = []
    for parent in parents:
        for names in SIBLINGS:
            members = [parent[name] for name in names if name in parent]
            members = [
                m for m in members if isinstance(m, (nn.Linear, nn.QuantizedLinear))
            ]
            signatures = {_signature(m) for m in members}
            if len(members) >= 2 and len(signatures) == 1 and None not in signatures:
                found.append(members)
                break
    return found


class FusedProjections:
    """Members' weights stacked along ``N``; each member's weight a view into the stack.

    Args:
        members: Linear layers of one signature (see :func:`sibling_sets`).
        form: ``"kernel"`` (:func:`small_row_matmul`) or ``"mlx"`` (mlx's own op).
        tails: A member called with a new input computes the columns of itself and the
            members after it only (False: every member's columns).

    Attributes:
        members: The layers, in column order.
        form: How the stacked product is computed.
        tails: Whether a launch starts at its calling member's columns.
        bounds: ``(start, stop)`` columns of each member in the stacked output.
        weight, scales, biases: The stacked arrays (scales / biases None if dense).
        bits, group_size: Quantization (None for dense).
    """

    def __init__(
        self, members: Sequence[nn.Module], form: str = "kernel", tails: bool = False
    ) -> None:
        if form not in FORMS:
            raise ValueError(f"form must be one of {', '.join(FORMS)}, got {form!r}")
        self.form = form
        self.tails = bool(tails)
        self.members = list(members)
        quantized = isinstance(self.members[0], nn.QuantizedLinear)
        names = ("weight", "scales", "biases") if quantized else ("weight",)
        rows = [m["weight"].shape[0] for m in self.members]
        edges = [0] + list(itertools.accumulate(rows))
        self.bounds = list(zip(edges[:-1], edges[1:]))
        self.splits = edges[1:-1]
        stacked = _kept_stack(self.members)
        if stacked is None:
            stacked = _stack(self.members, names, self.bounds)
        # Each member's views of the stack (what it holds while it is served by it).
        self.views = _STACKS[id(self.members[0])].views
        self.weight = stacked["weight"]
        self.scales = stacked.get("scales")
        self.biases = stacked.get("biases")
        self.bits = self.members[0].bits if quantized else None
        self.group_size = self.members[0].group_size if quantized else None
        self._source: Optional[mx.array] = None
        self._outputs: Dict[int, mx.array] = {}
        # The stack's rows from member i on, by i (made on first use, as views).
        self._tails: Dict[int, _Rows] = {
            0: _Rows(self.weight, self.scales, self.biases, self.splits)
        }
        # The kernel form's members' columns per input (shape, dtype, use_kernel) and
        # first member launched, planned once (compiled where backend.compile_bound
        # says so); the whole fused output per input, where asked for.
        self._bound: Dict[tuple, Callable[[mx.array], List[mx.array]]] = {}
        # The launch each of those wraps (bound once, shared by both).
        self._matmuls: Dict[tuple, BoundMatmul] = {}
        # member_offsets' answer per input (shape, dtype, use_kernel).
        self._offsets: Dict[tuple, Optional[Tuple[int, ...]]] = {}
        # The arrays the whole stack's tensor-core launch streams (its ``reads``:
        # the weights, then the scales repack), once one is bound; what a launch
        # before it may ask into the L2 (dflash.metal.prefetch).
        self.reads: Optional[tuple] = None

    def serves(self, index: int, member: nn.Module) -> bool:
        """Whether ``member`` (member ``index``) still holds its views of the stack; one
        given a new array since is no longer what the stack computes."""
        return all(member.get(name) is view for name, view in self.views[index].items())

    def output(self, index: int, x: mx.array, use_kernel: Optional[bool]) -> mx.array:
        """Member ``index``'s projection of ``x`` (one launch for all members per input).

        Shapes: x ``(..., K)``; returns ``(..., N_index)``.
        """
        waiting = self._outputs if x is self._source else {}
        out = waiting.pop(index, None)
        if out is None:
            waiting = self._project(x, use_kernel, index if self.tails else 0)
            self._source, self._outputs = x, waiting
            out = waiting.pop(index)
        if not waiting:
            self.release()
        return out

    def _project(
        self, x: mx.array, use_kernel: Optional[bool], first: int = 0
    ) -> Dict[int, mx.array]:
        """Members ``first`` on: their columns of ``x @ stack.T``, by member index (one
        launch)."""
        if self.form == "mlx":
            rows = self._rows_from(first)
            product = mx.split(self._mlx_product(x, rows), rows.splits, axis=-1)
        else:
            product = self._bound_for(x, use_kernel, first)(x)
        return dict(enumerate(product, start=first))

    def _bound_for(
        self, x: mx.array, use_kernel: Optional[bool], first: int
    ) -> Callable[[mx.array], List[mx.array]]:
        """The kernel form's launch of members ``first`` on for inputs like ``x``,
        bound on first use."""
        key = (x.shape, x.dtype, use_kernel, first)
        bound = self._bound.get(key)
        if bound is None:
            rows = self._rows_from(first)
            matmul = self._matmul_for(x, use_kernel, first, rows)
            bound = self._bound[key] = self._bind(x, matmul, rows)
        return bound

    def _matmul_for(
        self,
        x: mx.array,
        use_kernel: Optional[bool],
        first: int,
        rows: Optional["_Rows"] = None,
    ) -> BoundMatmul:
        """The kernel form's launch of members ``first`` on (their stacked ``rows``,
        looked up if not given) for inputs like ``x`` (bound on first use; host work
        only)."""
        key = (x.shape, x.dtype, use_kernel, first)
        matmul = self._matmuls.get(key)
        if matmul is None:
            rows = self._rows_from(first) if rows is None else rows
            matmul = self._matmuls[key] = self._bind_matmul(x, use_kernel, rows)
        return matmul

    def member_offsets(
        self, x: mx.array, use_kernel: Optional[bool]
    ) -> Optional[Tuple[int, ...]]:
        """Where each member's columns of ``x`` start in the whole stack's fused
        output (:meth:`fused_output`), in elements: member ``i``'s ``(rows, N_i)``
        block is row-contiguous from there (``rows`` the rows of ``x``). None where
        that output is not member-major: the mlx form, a set built with ``tails``,
        a launch that is not the tensor-core form or stores the plain layout, or an
        input the members' own patched calls would not hand to this set's launch
        (its dtype not the stack's, or one the kernels do not take). Binds the
        launch if it is not yet (host work only); memoised per input geometry.

        Args:
            x: An input like those to come (its shape and dtype are what count).
            use_kernel: The kernel choice the members' calls pass.

        Returns:
            One element offset a member, in member order, or None.

        Shapes: x ``(..., K)``.
        """
        key = (x.shape, x.dtype, use_kernel)
        offsets = self._offsets.get(key, _UNSET)
        if offsets is _UNSET:
            offsets = self._offsets[key] = self._member_offsets(x, use_kernel)
        return offsets

    def _member_offsets(
        self, x: mx.array, use_kernel: Optional[bool]
    ) -> Optional[Tuple[int, ...]]:
        """:meth:`member_offsets` worked out (a memo miss)."""
        if self.form != "kernel" or self.tails or not self._takes(x):
            return None
        edges = getattr(self._matmul_for(x, use_kernel, 0), "member_edges", ())
        if not edges:
            return None
        rows = x.size // x.shape[-1]
        return tuple(first * rows for first in (0, *edges))

    def _takes(self, x: mx.array) -> bool:
        """Whether each member's patched call hands ``x`` to this set's launch (the
        kernel patch's matmul arguments: a dtype the kernels take and the stack's
        own, a quantization they take, K a multiple of 8)."""
        depth = x.shape[-1] if x.ndim else 0
        if depth % 8 or x.size // max(depth, 1) < 1:
            return False
        return qmm.arrays_served(
            x.dtype, self.weight, self.scales, self.biases, self.bits, self.group_size
        )

    def fused_output(
        self, x: mx.array, use_kernel: Optional[bool]
    ) -> Optional[Tuple[mx.array, Tuple[int, ...]]]:
        """The whole stack's output for ``x`` as its one launch stores it, and each
        member's element offset in it (:meth:`member_offsets`), with no view of any
        member: for kernels that read the members in place (the head prep, the gated
        fold). The same launch and bits as the members' own calls (which take views
        of this output); None where :meth:`member_offsets` is None.

        Args:
            x: The members' input.
            use_kernel: The kernel choice the members' calls pass.

        Returns:
            ``(y, offsets)``, or None (nothing launched).

        Shapes: x ``(..., K)``; y the flat ``(rows * N,)`` output, member ``i`` its
        ``(rows, N_i)`` block from ``offsets[i]`` on.
        """
        offsets = self.member_offsets(x, use_kernel)
        if offsets is None:
            return None
        key = (x.shape, x.dtype, use_kernel, "fused")
        run = self._bound.get(key)
        if run is None:
            matmul = self._matmul_for(x, use_kernel, 0)
            run = self._bound[key] = compile_around(matmul, matmul)
        return run(x), offsets

    def prepared_output(
        self,
        x: mx.array,
        use_kernel: Optional[bool],
        heads: Sequence[mx.array],
    ) -> Optional[mx.array]:
        """The whole stack's output with the attention's heads prepared in the same
        launch (the tensor-core matmul's prepared form,
        :func:`~dflash.metal.tensor_qmm.prepared_spec`), or None where that form does
        not serve: not a member-major q / k / v / gate set of this launch, more than
        16 rows, or a geometry or form it does not take (bound once per input
        geometry; host work only).

        Args:
            x: The members' input.
            use_kernel: The kernel choice the members' calls pass.
            heads: The head prep's inputs
                (:func:`~dflash.metal.heads.prepared_inputs`).

        Returns:
            The flat member-major output: the prepared queries ``(B, S, Hq, D)`` from
            :meth:`member_offsets`' first offset, the stacked block ``(2, B, Hkv, S,
            D)`` from its second, the gate from its fourth; or None.

        Shapes: x ``(B, S, K)``; returns ``(B * S * N,)``.
        """
        key = (x.shape, x.dtype, use_kernel, "prepared")
        if key not in self._bound:
            self._bound[key] = self._bind_prepared(x, use_kernel)
        run = self._bound[key]
        return None if run is None else run(x, *heads)

    def _bind_prepared(self, x: mx.array, use_kernel: Optional[bool]):
        """The prepared launch for inputs of ``x``'s shape and dtype, or None."""
        offsets = self.member_offsets(x, use_kernel)
        depth = x.shape[-1]
        rows = x.size // depth if depth else 0
        if offsets is None or len(offsets) != 4 or not 0 < rows <= 16:
            return None
        edges = self._matmul_for(x, use_kernel, 0).member_edges
        tails = self._tails[0]
        try:
            matmul = tensor_qmm.bind_tensor_core(
                rows, depth, tails.weight, tails.scales, tails.biases, self.bits,
                self.group_size, x.dtype, members=edges, lead=x.shape[:-1],
                prepared=True,
            )  # fmt: skip
        except ValueError:  # a form or split the prepared form does not take
            return None
        count = matmul.counters

        def forward(x: mx.array, *inputs: mx.array) -> mx.array:
            counters, heads = (inputs[0], inputs[1:]) if count else (None, inputs)
            return matmul(x, counters, heads=heads)

        compiled = backend.compile_bound(forward)
        if not count:
            return compiled
        return lambda x, *heads: compiled(x, groups.launch_counters(count), *heads)

    def reads_for(self, x: mx.array, use_kernel: Optional[bool]) -> Optional[tuple]:
        """The arrays the whole stack's launch for inputs like ``x`` streams (its
        ``reads``), binding that launch now if it is not yet (host work only: the call
        itself binds it otherwise); None for the mlx form or a launch that is not the
        tensor-core form.

        Shapes: x ``(..., K)``.
        """
        if self.form != "kernel":
            return None
        self._matmul_for(x, use_kernel, 0)
        return self.reads

    def _rows_from(self, first: int) -> "_Rows":
        """The stack's rows of members ``first`` on (views, evaluated once: a trace
        that captured a lazy slice would run it again at every replay)."""
        rows = self._tails.get(first)
        if rows is None:
            start = self.bounds[first][0]
            arrays = [a if a is None else a[start:] for a in self._tails[0].arrays()]
            mx.eval([a for a in arrays if a is not None])
            splits = [edge - start for edge in self.splits[first:]]
            rows = self._tails[first] = _Rows(*arrays, splits)
        return rows

    def _bind_matmul(
        self, x: mx.array, use_kernel: Optional[bool], rows: "_Rows"
    ) -> BoundMatmul:
        """The launch of ``x @ rows.T`` for inputs of ``x``'s shape and dtype (the
        members' edges asked for the member-major store)."""
        depth = x.shape[-1]
        matmul = bind_matmul(
            (x.size // depth, depth), x.dtype, rows.weight, rows.scales, rows.biases,
            bits=self.bits, group_size=self.group_size, use_kernel=use_kernel,
            members=rows.splits, lead=x.shape[:-1],
        )  # fmt: skip
        if rows is self._tails[0] and getattr(matmul, "reads", None):
            self.reads = matmul.reads
        return matmul

    def _bind(self, x: mx.array, matmul: BoundMatmul, rows: "_Rows"):
        """``x -> columns of x @ rows.T`` per member through ``matmul``, for inputs of
        ``x``'s shape and dtype."""
        lead = x.shape[:-1]
        splits = rows.splits
        # Stored member by member (the tensor-core form): each member is a view.
        edges = getattr(matmul, "member_edges", ())

        def product(x: mx.array, counters: Optional[mx.array]) -> List[mx.array]:
            y = matmul(x, counters)
            if edges:
                return member_views(y, edges, lead)
            return mx.split(y, splits, axis=-1)

        return compile_around(matmul, product)

    def activated(
        self, gate: nn.Module, up: nn.Module, x: mx.array, use_kernel: Optional[bool]
    ) -> Optional[mx.array]:
        """``silu(gate(x)) * up(x)`` in one launch (the tensor-core matmul's SwiGLU
        form), or None where that form does not serve: this set is not exactly
        ``[gate, up]`` still holding their views, the kernel path is off, or the call's
        geometry is one :func:`~dflash.metal.tensor_qmm.swiglu_takes` refuses.

        Shapes: x ``(..., K)``; returns ``(..., N_gate)``.
        """
        if (
            self.form != "kernel"
            or len(self.members) != 2
            or self.members[0] is not gate
            or self.members[1] is not up
            or not (self.serves(0, gate) and self.serves(1, up))
        ):
            return None
        key = (x.shape, x.dtype, use_kernel, "swiglu")
        if key not in self._bound:
            self._bound[key] = self._bind_activated(x, use_kernel)
        product = self._bound[key]
        return None if product is None else product(x)

    def _bind_activated(self, x: mx.array, use_kernel: Optional[bool]):
        """The SwiGLU launch for inputs of ``x``'s shape and dtype, or None."""
        depth = x.shape[-1]
        rows = x.size // depth if depth else 0
        columns = self.weight.shape[0]
        if not (
            0 < rows <= tensor_qmm.MAX_ROWS
            and backend.use_kernel_path(use_kernel, auto=True)
            and tensor_qmm.swiglu_takes(x.dtype, rows, depth, columns, self.bits)
        ):
            return None
        matmul = tensor_qmm.bind_tensor_core(
            rows, depth, self.weight, self.scales, self.biases, self.bits,
            self.group_size, x.dtype, swiglu=True, lead=x.shape[:-1],
        )  # fmt: skip
        return compile_around(matmul, matmul)

    def _mlx_product(self, x: mx.array, rows: "_Rows") -> mx.array:
        """``x @ rows.T`` by mlx's own op, as each member's layer computes its own."""
        if rows.scales is None:
            return x @ rows.weight.T
        return mx.quantized_matmul(
            x,
            rows.weight,
            scales=rows.scales,
            biases=rows.biases,
            transpose=True,
            group_size=self.group_size,
            bits=self.bits,
        )

    def release(self) -> None:
        """Drop the outputs still waiting for a member (and the input they came from)."""
        self._source, self._outputs = None, {}


@dataclass(frozen=True, eq=False)
class _Rows:
    """A run of the stack's rows (whole members) and the members' splits inside it."""

    weight: mx.array
    scales: Optional[mx.array]
    biases: Optional[mx.array]
    splits: List[int]

    def arrays(self) -> List[Optional[mx.array]]:
        return [self.weight, self.scales, self.biases]


# The stacks built so far, by their first member (weakly: a dropped model drops its
# stacks). A later patch of the same layers reuses a stack while every member still
# holds the views cut from it, so a generation per call does not copy the weights again.
_STACKS: Dict[int, "_Stack"] = {}


class _Stack:
    """A stack and the views its members were given (members held weakly)."""

    def __init__(self, members: List[nn.Module], stacked: dict, views: list) -> None:
        self.members = [weakref.ref(m) for m in members]
        self.stacked = stacked
        self.views = views

    def holds(self, members: List[nn.Module]) -> bool:
        """Whether these are the stack's members, each still holding its views."""
        alive = [ref() for ref in self.members]
        if len(alive) != len(members) or any(
            a is not m for a, m in zip(alive, members)
        ):
            return False
        return all(
            all(member.get(name) is view for name, view in views.items())
            for member, views in zip(members, self.views)
        )


def _stack(members: List[nn.Module], names: tuple, bounds: list) -> dict:
    """Stack the members' arrays along N and give each member its views of them."""
    stacked = {
        name: mx.concatenate([m[name] for m in members], axis=0) for name in names
    }
    mx.eval(list(stacked.values()))
    views = [{name: stacked[name][a:b] for name in names} for a, b in bounds]
    mx.eval([list(view.values()) for view in views])
    for member, view in zip(members, views):
        member.update(view)
    key = id(members[0])
    if key not in _STACKS:  # the entry goes when its first member does
        weakref.finalize(members[0], _STACKS.pop, key, None)
    _STACKS[key] = _Stack(members, stacked, views)
    return stacked


def _kept_stack(members: List[nn.Module]) -> Optional[dict]:
    """The stack an earlier patch built for ``members``, if they still hold its views."""
    kept = _STACKS.get(id(members[0]))
    return kept.stacked if kept is not None and kept.holds(members) else None


class MemberSlot:
    """A member's place in its group (kept on the layer as a plain attribute, named
    :data:`MEMBER_SLOT`)."""

    def __init__(self, group: FusedProjections, index: int) -> None:
        self.group = group
        self.index = index
