"""Scenarios for the small-query attention tests: a plane, a block, an oracle.

A :class:`Case` describes a layer's keys/values history, how the plane holds it
(a ring at some fill level and rotation, or a growing plane), the block after it,
and the queries. :func:`build` lays it out (dead physical rows hold NaN, so a
read of a wrong row shows), :func:`oracle` is a plain float64 softmax over the
visible keys, and :func:`advanced` appends rows the way a cache commits them, for
the one-query-at-a-time routes of the batch-invariance properties.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional

import mlx.core as mx
import numpy as np
from hypothesis import strategies as st

from dflash.metal.attention import KeyPlane, small_query_attention

DTYPES = (mx.float32, mx.bfloat16, mx.float16)
HEAD_DIMS = (16, 24, 32, 48, 64, 80, 128)
CHUNKS = (1, 3, 4, 16, 64, 256)
# Output tolerance against the float64 oracle, per dtype (a few ulps of the output type).
TOLERANCE = {mx.float32: 2e-5, mx.float16: 4e-3, mx.bfloat16: 3e-2}


@dataclass(frozen=True)
class Case:
    """One attention scenario.

    Attributes:
        batch, kv_heads, group, dim: Shapes (``Hq = kv_heads * group``).
        dtype: Element type of queries, keys and values.
        ring: Ring plane (True) or growing plane (False).
        capacity: Rows of the plane buffer.
        history: Positions before the block (the plane holds the newest of them).
        block: Rows of the held-back block.
        queries: Number of queries (the last ``queries`` key positions).
        origin_physical: Physical row of the plane's oldest live row (ring).
        window: Sliding window (None: none).
        causal: Whether queries see no later key.
        softcap: Logit soft-cap (None: none).
        chunk: Keys per chunk.
        seed: Data seed.
        skew: Pulls keys and queries apart along one direction, so scores are
            mostly negative (0: plain normal data).
    """

    batch: int
    kv_heads: int
    group: int
    dim: int
    dtype: mx.Dtype
    ring: bool
    capacity: int
    history: int
    block: int
    queries: int
    origin_physical: int
    window: Optional[int]
    causal: bool
    softcap: Optional[float]
    chunk: int
    seed: int
    skew: float = 0.0

    @property
    def heads(self) -> int:
        return self.kv_heads * self.group

    @property
    def length(self) -> int:
        """Live plane rows."""
        return min(self.history, self.capacity) if self.ring else self.history

    @property
    def origin_logical(self) -> int:
        return self.history - self.length

    @property
    def key_end(self) -> int:
        return self.history + self.block

    @property
    def query_start(self) -> int:
        return self.key_end - self.queries

    @property
    def scale(self) -> float:
        return self.dim**-0.5


@st.composite
def cases(
    draw,
    *,
    max_queries: int = 32,
    dims=HEAD_DIMS,
    dtypes=DTYPES,
    chunks=CHUNKS,
    allow_non_causal: bool = True,
) -> Case:
    """Scenarios the contract admits: every needed key is live in the plane or block."""
    ring = draw(st.booleans())
    causal = draw(st.booleans()) if allow_non_causal else True
    queries = draw(st.integers(1, max_queries))
    # A verify holds its block back (block == queries); a decode step may write first.
    written_first = queries == 1 and draw(st.booleans())
    block = 0 if written_first else queries
    if ring:
        window = draw(st.integers(1, 48))
        capacity = window + draw(st.sampled_from([0, 0, 0, 1, 5]))
        history = draw(st.integers(1 if written_first else 0, 3 * capacity + 40))
        origin_physical = draw(st.integers(0, capacity - 1))
    else:
        window = draw(st.one_of(st.none(), st.integers(1, 48)))
        history = draw(st.integers(1 if written_first else 0, 120))
        capacity = history + draw(st.integers(0, 9))
        origin_physical = 0
    if not causal and window is None and ring:
        causal = True
    return Case(
        batch=draw(st.integers(1, 2)),
        kv_heads=draw(st.integers(1, 3)),
        group=draw(st.sampled_from([1, 2, 4])),
        dim=draw(st.sampled_from(dims)),
        dtype=draw(st.sampled_from(dtypes)),
        ring=ring,
        capacity=max(capacity, 1),
        history=history,
        block=block,
        queries=queries,
        origin_physical=origin_physical if capacity else 0,
        window=window,
        causal=causal,
        softcap=draw(st.sampled_from([None, None, 5.0])),
        chunk=draw(st.sampled_from(chunks)),
        seed=draw(st.integers(0, 2**16)),
        skew=draw(st.sampled_from([0.0, 1.5])),
    )


@dataclass
class Built:
    """A laid-out scenario.

    Attributes:
        case: The scenario.
        keys, values: Every key/value by position, float64 of the dtype-rounded values.
        queries: The queries (mx, case dtype).
        plane: The plane as the kernel sees it.
        block_keys, block_values: The block (mx) or None.
    """

    case: Case
    keys: np.ndarray
    values: np.ndarray
    queries: mx.array
    plane: KeyPlane
    block_keys: Optional[mx.array]
    block_values: Optional[mx.array]

    def attend(self, use_kernel: Optional[bool] = False, **overrides) -> mx.array:
        """Run :func:`small_query_attention` on this layout."""
        c = self.case
        kwargs = dict(
            scale=c.scale,
            window=c.window,
            causal=c.causal,
            softcap=c.softcap,
            chunk=c.chunk,
            use_kernel=use_kernel,
        )
        kwargs.update(overrides)
        out = small_query_attention(
            self.queries, self.plane, self.block_keys, self.block_values, **kwargs
        )
        mx.eval(out)
        return out


def _rounded(array: np.ndarray, dtype: mx.Dtype) -> mx.array:
    return mx.array(array.astype(np.float32)).astype(dtype)


def lay_out(
    case: Case,
    keys: mx.array,
    values: mx.array,
    queries: mx.array,
    history: int,
    block: int,
) -> Built:
    """Place positions ``[0, history)`` in the case's plane and ``[history, +block)`` in a block.

    Shapes: keys, values ``(B, Hkv, N, D)`` with ``N >= history + block``; queries
    ``(B, Hq, S, D)``.
    """
    c = dataclasses.replace(case, history=history, block=block)
    length, start = c.length, c.origin_logical
    garbage = mx.full(
        (c.batch, c.kv_heads, c.capacity, c.dim), float("nan"), dtype=c.dtype
    )
    phys = (c.origin_physical + np.arange(length)) % c.capacity
    order = np.full(c.capacity, -1)
    order[phys] = start + np.arange(length)
    live = mx.array(order >= 0)[None, None, :, None]
    index = mx.array(np.maximum(order, 0).astype(np.int32))
    plane_k = mx.where(live, keys[:, :, index], garbage)
    plane_v = mx.where(live, values[:, :, index], garbage)
    plane = KeyPlane(plane_k, plane_v, length, start, c.origin_physical)
    block_keys = keys[:, :, history : history + block] if block else None
    block_values = values[:, :, history : history + block] if block else None
    as64 = lambda a: np.asarray(a.astype(mx.float32)).astype(np.float64)  # noqa: E731
    return Built(c, as64(keys), as64(values), queries, plane, block_keys, block_values)


def build(case: Case) -> Built:
    """Lay out ``case`` with random data (normal keys/values/queries)."""
    rng = np.random.default_rng(case.seed)
    shape = (case.batch, case.kv_heads, case.key_end, case.dim)
    direction = case.skew * rng.standard_normal(case.dim)
    keys = _rounded(rng.standard_normal(shape) + direction, case.dtype)
    values = _rounded(rng.standard_normal(shape), case.dtype)
    queries = 2.0 * rng.standard_normal(
        (case.batch, case.heads, case.queries, case.dim)
    )
    queries = _rounded(queries - direction, case.dtype)
    return lay_out(case, keys, values, queries, case.history, case.block)


def stacked(built: Built) -> Built:
    """``built`` with its plane and its block as stacked ``(2, ...)`` buffers, each
    given whole as both keys and values (``KeyPlane.from_kv(..., stacked=True)``):
    the same rows where they were."""
    plane = built.plane
    kv = mx.stack([plane.keys, plane.values])
    plane = KeyPlane.from_kv(
        kv, plane.length, plane.origin_logical, plane.origin_physical, stacked=True
    )
    block = None
    if built.block_keys is not None:
        block = mx.stack([built.block_keys, built.block_values])
    return dataclasses.replace(built, plane=plane, block_keys=block, block_values=block)


def oracle(built: Built, window: Optional[int] = None) -> np.ndarray:
    """Float64 softmax attention over the visible keys (``window`` overrides the case's).

    Returns:
        ``(B, Hq, S, D)`` float64.
    """
    c = built.case
    width = c.window if window is None else window
    q = np.asarray(built.queries.astype(mx.float32)).astype(np.float64)
    out = np.zeros(q.shape)
    for s in range(c.queries):
        pos = c.query_start + s
        first = max(pos - width + 1, 0) if width else 0
        last = pos if c.causal else (pos + width - 1 if width else c.key_end - 1)
        last = min(last, c.key_end - 1)
        for h in range(c.heads):
            k = built.keys[:, h // c.group, first : last + 1]
            v = built.values[:, h // c.group, first : last + 1]
            scores = np.einsum("bd,bnd->bn", q[:, h, s], k) * c.scale
            if c.softcap:
                scores = c.softcap * np.tanh(scores / c.softcap)
            w = np.exp(scores - scores.max(axis=-1, keepdims=True))
            w /= w.sum(axis=-1, keepdims=True)
            out[:, h, s] = np.einsum("bn,bnd->bd", w, v)
    return out


def close_to_oracle(built: Built, out: mx.array, window: Optional[int] = None) -> bool:
    """Whether ``out`` matches :func:`oracle` within the dtype's tolerance."""
    want = oracle(built, window)
    got = np.asarray(out.astype(mx.float32)).astype(np.float64)
    tol = TOLERANCE[built.case.dtype]
    return bool(np.all(np.abs(got - want) <= tol * (1.0 + np.abs(want))))


def one_query_routes(built: Built, index: int) -> dict[str, Built]:
    """Query ``index`` of a verify block, alone, as later single steps would see it.

    ``held``: rows ``0 .. index-1`` of the block committed to the plane, row ``index``
    held back as a one-row block. ``written``: rows ``0 .. index`` committed, no block
    (a decode step that stores before it attends). Positions are the same as in the
    verify call; the plane has advanced (ring rows evicted, origins moved).
    """
    c = built.case
    keys = _rounded(built.keys, c.dtype)
    values = _rounded(built.values, c.dtype)
    query = built.queries[:, :, index : index + 1]
    single = dataclasses.replace(c, queries=1)
    routes = {}
    for name, committed, block in (("held", index, 1), ("written", index + 1, 0)):
        history = c.history + committed
        advanced = advance_origin(single, c.history, history)
        routes[name] = lay_out(advanced, keys, values, query, history, block)
    return routes


def advance_origin(case: Case, before: int, after: int) -> Case:
    """The case's plane after appending rows ``before .. after-1`` one at a time.

    A ring that is full advances ``origin_physical`` by one per appended row.
    """
    if not case.ring:
        return dataclasses.replace(case, capacity=max(case.capacity, after))
    full_before = min(before, case.capacity)
    overflow = max(0, full_before + (after - before) - case.capacity)
    origin = (case.origin_physical + overflow) % case.capacity
    return dataclasses.replace(case, origin_physical=origin)


def bits(array: mx.array) -> np.ndarray:
    """The raw bits of ``array`` (for bit-for-bit comparisons)."""
    word = {2: mx.uint16, 4: mx.uint32}[array.dtype.size]
    return np.asarray(array.view(word))
