"""Small-query attention over a KV plane as it lies, plus a held-back block.

A verify forward runs ``S`` (1 to 32) queries at consecutive positions
``p .. p+S-1``. Their keys and values are a plane's live rows (a sliding layer's
wrapped ring, read in logical order through ``origin_physical``, or a growing
plane's rows ``[0, len)``) followed by the block's own rows, which a checkpoint
holds back from the ring. :func:`small_query_attention` reads both where they
are (no staging copy) and computes which keys a query sees from positions (no
mask tensor): query ``q`` sees ``[q - W + 1, q]`` (mlx-lm's window) or ``[0, q]``
without a window; with ``causal=False`` (the drafter's block) it also sees keys
after it, up to ``q + W - 1``.

**Batch invariance.** Each query's result depends only on that query, the keys
it sees and their absolute positions, never on how many queries share the call,
which container (plane or block) holds a key, or where the ring's seam is. So a
16-query verify gives every row the same bits as 16 one-query steps through the
same form. The reduction order is fixed by absolute key position: keys are cut
into chunks ``[c * chunk, (c + 1) * chunk)``; within a chunk the softmax
statistics are exact maxima and sums in key order; chunks are folded
sequentially in ascending order (online softmax), chunks a query does not see
being skipped exactly. Both forms follow this structure; they are not bit-equal
to each other (their sums are grouped differently), each is batch-invariant.

Three forms, one contract:

* the pure-MLX reference (:func:`reference_attention`): what the CPU runs, built
  from elementwise ops and last-axis sums, whose per-element order does not
  depend on the other axes;
* the Metal body and its CUDA twin (:data:`ATTEND_CHUNKS`, :data:`FOLD_CHUNKS`):
  one threadgroup per (batch, KV head, chunk, 16 query rows) writes the chunk's
  softmax statistics and weighted values; a second launch folds the chunks.
  All index arithmetic (:data:`ATTENTION_HELPERS` and the bodies) is shared.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass, fields
from typing import Optional

import mlx.core as mx
import numpy as np

from . import backend, groups, tensor_attention
from .groups import GroupKernelSpec, float_params, indent, int_params
from .layout import MAX_LAUNCH_WORDS, checked_offset, stacked_halves

# Keys per chunk: the unit of the fixed reduction order (absolute positions).
CHUNK = 256
# Kernel limits (threadgroup-memory sizes are compile-time constants).
KERNEL_MAX_CHUNK = 256
KERNEL_MAX_DIM = 128
ROWS = 16
THREADS = 256
KEY_LANES = THREADS // ROWS
PAIRS = ROWS * KERNEL_MAX_DIM // THREADS
# Chunks the reference evaluates at once (bounds its temporary memory).
REFERENCE_SLAB = 8

DTYPES = (mx.bfloat16, mx.float16, mx.float32)


# ----------------------------------------------------------------- contract


def stacked_pair_halves(keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
    """``keys[0]`` and ``values[1]`` of a stacked pair (one view for both halves when
    they are one buffer, as a plane's or a block's is).

    Shapes: keys, values ``(2, B, Hkv, N, D)``; returns ``(B, Hkv, N, D)`` twice.
    """
    if keys is values:
        return stacked_halves(keys)
    return stacked_halves(keys)[0], stacked_halves(values)[1]


@dataclass(frozen=True)
class KeyPlane:
    """A layer's earlier keys and values as they lie in a plane buffer.

    Logical row ``j < length`` (absolute position ``origin_logical + j``) sits at
    physical row ``(origin_physical + j) % C``. A growing plane has both origins 0.

    The buffers are either two arrays or **stacked**: one ``(2, B, Hkv, C, D)`` buffer
    given as both, the keys read from its first half and the values from its second
    (:meth:`from_kv`). The kernels bind a stacked buffer as it is, at an element
    offset, so a plane costs no view of its halves in the graph.

    Attributes:
        keys: Keys buffer, head-major (stacked: the keys are ``keys[0]``).
        values: Values buffer, same shape and dtype (stacked: ``values[1]``).
        length: Live rows.
        origin_logical: Absolute position of logical row 0.
        origin_physical: Physical row of logical row 0.

    Shapes: keys, values ``(B, Hkv, C, D)``, or both ``(2, B, Hkv, C, D)``.
    """

    keys: mx.array
    values: mx.array
    length: int
    origin_logical: int = 0
    origin_physical: int = 0

    @classmethod
    def from_kv(
        cls,
        kv: mx.array,
        length: int,
        origin_logical: int = 0,
        origin_physical: int = 0,
        stacked: bool = False,
    ) -> "KeyPlane":
        """A plane over a stacked K/V buffer as it lies: ``stacked``, the buffer
        itself as both (no view; the kernels read the values at an offset), else
        its halves as views (two graph nodes). ``kv`` must be row-contiguous, as a
        plane's buffer is (mlx would copy it before a launch).

        Shapes: kv ``(2, B, Hkv, C, D)``.
        """
        if kv.ndim != 5 or kv.shape[0] != 2:
            raise ValueError(f"kv must have shape (2, B, Hkv, C, D), got {kv.shape}")
        keys, values = (kv, kv) if stacked else stacked_halves(kv)
        return cls(keys, values, length, origin_logical, origin_physical)

    @property
    def stacked(self) -> bool:
        """Whether the keys and values are halves of stacked buffers."""
        return self.keys.ndim == 5

    def halves(self) -> tuple[mx.array, mx.array]:
        """The keys and the values as ``(B, Hkv, C, D)`` arrays (views of a stacked
        buffer's halves: two graph nodes)."""
        if not self.stacked:
            return self.keys, self.values
        return stacked_pair_halves(self.keys, self.values)

    @property
    def end(self) -> int:
        """Absolute position just after the plane's last live row."""
        return self.origin_logical + self.length


@dataclass(frozen=True)
class Plan:
    """Host-side geometry of one call: who sees what, chunk range.

    Attributes:
        batch, heads, kv_heads, queries, dim: Shapes.
        capacity: Rows of the plane buffer.
        block: Rows of the held-back block.
        query_start: Position of query 0.
        origin_logical, origin_physical, length: The plane's bookkeeping.
        window: Sliding window (0: none).
        causal: Whether a query sees no key after it.
        chunk: Keys per chunk.
        chunk_first: Index of the first chunk any query sees.
        chunks: Number of chunks from ``chunk_first`` on that some query sees.
        plane_stacked, block_stacked: Whether the plane's (the block's) keys and
            values are the halves of one ``(2, ...)`` buffer given as both.
    """

    batch: int
    heads: int
    kv_heads: int
    queries: int
    dim: int
    capacity: int
    block: int
    query_start: int
    origin_logical: int
    origin_physical: int
    length: int
    window: int
    causal: bool
    chunk: int
    chunk_first: int
    chunks: int
    plane_stacked: bool = False
    block_stacked: bool = False

    def __hash__(self) -> int:
        # Hashed once: a plan keys its launch's memo on every call that shares it.
        cached = self.__dict__.get("_hash")
        if cached is None:
            cached = hash(tuple(self.__dict__[name] for name in _PLAN_FIELDS))
            object.__setattr__(self, "_hash", cached)
        return cached

    @property
    def ring_end(self) -> int:
        return self.origin_logical + self.length

    @property
    def key_end(self) -> int:
        return self.ring_end + self.block

    def bounds(self, position: int) -> tuple[int, int]:
        """First and last key position (inclusive) the query at ``position`` sees."""
        return visible_bounds(position, self.window, self.causal, self.key_end)


def visible_bounds(
    position: int, window: int, causal: bool, key_end: int
) -> tuple[int, int]:
    """Keys ``[first, last]`` a query at ``position`` sees (``window`` 0: none).

    mlx-lm's window: ``[q - W + 1, q]``; without a window ``[0, q]``. Not causal:
    the last key is ``q + W - 1`` (or the last key there is), capped at ``key_end - 1``.
    """
    first = max(position - window + 1, 0) if window else 0
    if causal:
        last = position
    else:
        last = position + window - 1 if window else key_end - 1
    return first, min(last, key_end - 1)


def _check_int(value, name: str, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise ValueError(f"{name} must be an int, got {type(value).__name__}")
    if int(value) < low:
        raise ValueError(f"{name}={int(value)} must be >= {low}")
    return int(value)


Shape = tuple[int, ...]
# One array's part of a plan's key: its shape and dtype (None: no such array).
ArrayKey = Optional[tuple[Shape, mx.Dtype]]


def _array_key(array: Optional[mx.array]) -> ArrayKey:
    return None if array is None else (tuple(array.shape), array.dtype)


def _check_arrays(
    queries: tuple[Shape, mx.Dtype],
    keys: tuple[Shape, mx.Dtype],
    values: tuple[Shape, mx.Dtype],
    block_keys: ArrayKey,
    block_values: ArrayKey,
) -> None:
    """Shapes and dtypes of one call (each array as its ``(shape, dtype)``; a stacked
    pair's shapes are checked as its halves')."""
    (q_shape, q_dtype), (k_shape, k_dtype), (v_shape, v_dtype) = queries, keys, values
    if len(q_shape) != 4:
        raise ValueError(f"queries must be (B, Hq, S, D), got shape {q_shape}")
    if q_dtype not in DTYPES:
        raise ValueError(f"queries dtype {q_dtype} is not bfloat16, float16 or float32")
    if k_shape != v_shape or not (
        len(k_shape) == 4 or (len(k_shape) == 5 and k_shape[0] == 2)
    ):
        raise ValueError(
            f"plane keys {k_shape} and values {v_shape} must be one (B, Hkv, C, D) "
            "shape, or one stacked (2, B, Hkv, C, D) shape"
        )
    k_shape = k_shape[-4:]
    batch, heads, count, dim = q_shape
    if k_shape[0] != batch or k_shape[3] != dim:
        raise ValueError(f"plane {k_shape} does not fit queries {q_shape}")
    if count < 1:
        raise ValueError("queries hold no query (S = 0)")
    if k_shape[1] < 1 or heads % k_shape[1]:
        raise ValueError(
            f"{heads} query heads are not a multiple of {k_shape[1]} KV heads"
        )
    for name, dtype in (("keys", k_dtype), ("values", v_dtype)):
        if dtype != q_dtype:
            raise ValueError(f"plane {name} are {dtype}, queries {q_dtype}")
    if (block_keys is None) != (block_values is None):
        raise ValueError("block_keys and block_values must be given together")
    if block_keys is not None:
        block_shape = block_keys[0]
        stacked = len(block_shape) == 5 and block_shape[0] == 2
        rows = block_shape[-2] if len(block_shape) == 4 or stacked else -1
        want = (2,) * stacked + (batch, k_shape[1], rows, dim)
        for name, (shape, dtype) in (
            ("block_keys", block_keys),
            ("block_values", block_values),
        ):
            if shape != want:
                raise ValueError(f"{name} must have shape {want}, got {shape}")
            if dtype != q_dtype:
                raise ValueError(f"{name} are {dtype}, queries {q_dtype}")


def make_plan(
    queries: mx.array,
    plane: KeyPlane,
    block_keys: Optional[mx.array],
    block_values: Optional[mx.array],
    *,
    window: Optional[int],
    causal: bool,
    query_start: Optional[int],
    chunk: int,
) -> Plan:
    """Validate a call and work out its geometry (fail closed: nothing launched yet).

    Memoised on the shapes, dtypes and integers (a decode step's layers of one kind
    share a geometry), so a routed call costs one lookup; a call holding integers of
    other types (numpy's, bools) is checked afresh, and a refused one raises each time.

    Shapes: queries ``(B, Hq, S, D)``; plane ``(B, Hkv, C, D)``; block ``(B, Hkv, NB, D)``.

    Raises:
        ValueError: A shape, dtype or bookkeeping value is out of range, or some
            query would need a key that is neither live in the plane nor in the block.
    """
    ints = (plane.length, plane.origin_logical, plane.origin_physical)
    ints += (window, query_start, chunk)
    arrays = (queries, plane.keys, plane.values, block_keys, block_values)
    geometry = (tuple(map(_array_key, arrays)), *ints, causal)
    if all(type(v) is int or v is None for v in ints) and type(causal) is bool:
        return _cached_plan(*geometry)
    return _plan(*geometry)


def _plan(
    arrays: tuple[ArrayKey, ...],
    length,
    origin_logical,
    origin_physical,
    window,
    query_start,
    chunk,
    causal,
) -> Plan:
    """:func:`make_plan` on a call's shapes, dtypes and integers (``arrays``: the
    queries, plane keys and values, block keys and values as ``(shape, dtype)``)."""
    _check_arrays(*arrays)
    (q_shape, _), (k_shape, _), _, block_keys, _ = arrays
    batch, heads, count, dim = q_shape
    capacity = k_shape[-2]
    length = _check_int(length, "length", 0)
    origin_logical = _check_int(origin_logical, "origin_logical", 0)
    origin_physical = _check_int(origin_physical, "origin_physical", 0)
    if length > capacity:
        raise ValueError(f"length={length} exceeds the plane's {capacity} rows")
    if capacity and origin_physical >= capacity:
        raise ValueError(f"origin_physical={origin_physical} outside [0, {capacity})")
    width = 0 if window is None else _check_int(window, "window", 1)
    chunk = _check_int(chunk, "chunk", 1)
    block = 0 if block_keys is None else block_keys[0][-2]
    key_end = origin_logical + length + block
    start = (
        key_end - count
        if query_start is None
        else _check_int(query_start, "query_start", 0)
    )
    if start < 0 or start + count > key_end:
        raise ValueError(
            f"queries at positions {start}..{start + count - 1} need keys up to "
            f"{start + count - 1}, but the plane and block end at {key_end - 1}"
        )
    first, _ = visible_bounds(start, width, causal, key_end)
    if first < origin_logical:
        raise ValueError(
            f"the query at position {start} sees keys from {first} on, but the plane's "
            f"oldest live row is at {origin_logical} (evicted or never written)"
        )
    # The last visible key never decreases with the query's position.
    _, last = visible_bounds(start + count - 1, width, causal, key_end)
    chunk_first = first // chunk
    return Plan(
        batch, heads, k_shape[-3], count, dim, capacity, block, start,
        origin_logical, origin_physical, length, width, bool(causal), chunk,
        chunk_first, last // chunk - chunk_first + 1, len(k_shape) == 5,
        block_keys is not None and len(block_keys[0]) == 5,
    )  # fmt: skip


_cached_plan = functools.lru_cache(maxsize=1024)(_plan)
_PLAN_FIELDS = tuple(field.name for field in fields(Plan))


# ---------------------------------------------------------------- reference


def _key_rows(plan: Plan, plane: KeyPlane, block_keys, block_values):
    """Plane rows, block rows and one zero row in one buffer each (the reference's source).

    Shapes: returns two ``(B, Hkv, C + NB + 1, D)`` arrays.
    """
    zero = mx.zeros((plan.batch, plan.kv_heads, 1, plan.dim), dtype=plane.keys.dtype)
    plane_keys, plane_values = plane.halves()
    parts_k = [plane_keys, zero]
    parts_v = [plane_values, zero]
    if plan.block:
        if plan.block_stacked:
            block_keys, block_values = stacked_pair_halves(block_keys, block_values)
        parts_k.insert(1, block_keys)
        parts_v.insert(1, block_values)
    return mx.concatenate(parts_k, axis=2), mx.concatenate(parts_v, axis=2)


def _row_index(plan: Plan, positions: np.ndarray) -> mx.array:
    """Rows of :func:`_key_rows` holding absolute ``positions`` (the zero row if none).

    Plane rows through the wrapped physical index, block rows after the plane's
    ``C`` rows, the zero row for positions outside ``[origin_logical, key_end)``.

    Shapes: positions ``(N,)``; returns int32 ``(N,)``.
    """
    index = np.full(positions.shape, plan.capacity + plan.block, dtype=np.int64)
    logical = positions - plan.origin_logical
    in_plane = (logical >= 0) & (logical < plan.length)
    index[in_plane] = (plan.origin_physical + logical[in_plane]) % max(plan.capacity, 1)
    in_block = (positions >= plan.ring_end) & (positions < plan.key_end)
    index[in_block] = plan.capacity + positions[in_block] - plan.ring_end
    return mx.array(index.astype(np.int32))


def _chunk_partials(plan, queries32, keys, values, visible, scale, softcap):
    """Per-chunk softmax statistics of every query over ``U`` chunks.

    Only elementwise ops and last-axis sums/maxima: each output element is reduced
    in key order from its own inputs, whatever the other axes hold.

    Shapes: queries32 ``(B, Hkv, G, S, 1, 1, D)``; keys, values ``(B, Hkv, U*chunk, D)``;
    visible ``(S, U, chunk)`` bool. Returns max and sum ``(B, Hkv, G, S, U)``, the
    weighted values ``(B, Hkv, G, S, U, D)`` and which chunks each query sees ``(S, U)``.
    """
    batch, kv_heads, dim = plan.batch, plan.kv_heads, plan.dim
    count = visible.shape[1]
    shape = (batch, kv_heads, 1, 1, count, plan.chunk, dim)
    keys = keys.reshape(shape)
    # (B, Hkv, 1, 1, U, D, chunk): values with keys on the last axis, for a last-axis sum.
    values_t = values.reshape(shape).swapaxes(-1, -2)
    scores = (queries32 * keys).sum(axis=-1) * scale
    if softcap:
        scores = mx.tanh(scores / softcap) * softcap
    seen = mx.array(visible)
    masked = mx.where(seen, scores, -mx.inf)
    peak = masked.max(axis=-1)
    weights = mx.where(seen, mx.exp(masked - peak[..., None]), 0.0)
    total = weights.sum(axis=-1)
    weighted = (weights[..., None, :] * values_t).sum(axis=-1)
    return peak, total, weighted, mx.array(visible.any(axis=-1))


def reference_attention(
    queries: mx.array,
    plane: KeyPlane,
    block_keys: Optional[mx.array],
    block_values: Optional[mx.array],
    plan: Plan,
    scale: float,
    softcap: Optional[float],
    gate: Optional[mx.array] = None,
) -> mx.array:
    """The pure-MLX form of :func:`small_query_attention` (batch-invariant).

    Args:
        queries: Queries at positions ``plan.query_start ..``.
        plane: Earlier keys/values.
        block_keys: The block's keys (or None).
        block_values: The block's values (or None).
        plan: The validated geometry (:func:`make_plan`).
        scale: Score scale.
        softcap: Logit soft-cap (None or 0: none).
        gate: Output gate: the result times ``mx.sigmoid(gate)`` (None: none).

    Returns:
        Attention output in the queries' dtype.

    Shapes: queries ``(B, Hq, S, D)``; gate ``(B, S, Hq, D)``; returns
    ``(B, Hq, S, D)``.
    """
    batch, heads, count, dim = queries.shape
    group = heads // plan.kv_heads
    queries32 = queries.astype(mx.float32).reshape(
        batch, plan.kv_heads, group, count, 1, 1, dim
    )
    bounds = np.array([plan.bounds(plan.query_start + i) for i in range(count)])
    state_shape = (batch, plan.kv_heads, group, count)
    peak = mx.full(state_shape, -mx.inf)
    total = mx.zeros(state_shape)
    acc = mx.zeros(state_shape + (dim,))
    started = mx.zeros((count,), dtype=mx.bool_)
    all_keys, all_values = _key_rows(plan, plane, block_keys, block_values)
    for first in range(0, plan.chunks, REFERENCE_SLAB):
        used = min(REFERENCE_SLAB, plan.chunks - first)
        base = (plan.chunk_first + first) * plan.chunk
        positions = base + np.arange(used * plan.chunk)
        rows = _row_index(plan, positions)
        keys = all_keys[:, :, rows].astype(mx.float32)
        values = all_values[:, :, rows].astype(mx.float32)
        grid = positions.reshape(1, used, plan.chunk)
        visible = (grid >= bounds[:, 0, None, None]) & (
            grid <= bounds[:, 1, None, None]
        )
        peaks, totals, weighted, sees = _chunk_partials(
            plan, queries32, keys, values, visible, scale, softcap
        )
        for u in range(used):
            peak, total, acc, started = _fold(
                (peak, total, acc, started),
                peaks[..., u],
                totals[..., u],
                weighted[..., u, :],
                sees[:, u],
            )
    out = acc / total[..., None]
    out = out.reshape(batch, heads, count, dim).astype(queries.dtype)
    if gate is None:
        return out
    # mlx-lm's order: the output back in (B, S, Hq, D), times the gate's sigmoid.
    return (out.transpose(0, 2, 1, 3) * mx.sigmoid(gate)).transpose(0, 2, 1, 3)


def _fold(state, peak_u, total_u, acc_u, sees_u):
    """Fold one chunk into the running (max, sum, weighted values); skip where unseen.

    The first chunk a query sees is taken as it is; later ones rescale both sides
    to the larger maximum. Queries that do not see the chunk keep their state
    exactly (a select, no arithmetic).
    """
    peak, total, acc, started = state
    top = mx.maximum(peak, peak_u)
    alpha = mx.where(started, mx.exp(peak - top), 0.0)
    beta = mx.exp(peak_u - top)
    new_total = mx.where(started, total * alpha + total_u * beta, total_u)
    new_acc = mx.where(
        started[..., None], acc * alpha[..., None] + acc_u * beta[..., None], acc_u
    )
    new_peak = mx.where(started, top, peak_u)
    keep = sees_u
    return (
        mx.where(keep, new_peak, peak),
        mx.where(keep, new_total, total),
        mx.where(keep[..., None], new_acc, acc),
        started | sees_u,
    )


# ------------------------------------------------------------------ kernels

# Shared helpers: positions -> visibility and physical rows. No pointers, so the
# same text is valid Metal, CUDA and (for the CPU emulation) C++.
ATTENTION_HELPERS = """
// First key position the query at qpos sees (window 0: no window).
DFL_FN int dfl_first_key(int qpos, int window) {
  const int first = window > 0 ? qpos - window + 1 : 0;
  return first > 0 ? first : 0;
}

// Last key position (inclusive) the query at qpos sees, capped at the last key.
DFL_FN int dfl_last_key(int qpos, int window, int causal, int key_end) {
  int last = key_end - 1;
  if (causal != 0) {
    last = qpos;
  } else if (window > 0) {
    last = qpos + window - 1;
  }
  return last < key_end - 1 ? last : key_end - 1;
}

// Element offset of row `pos` (absolute position) of KV head `bh` (= b * Hkv + h):
// in the plane (pos < ring_end) or in the block after it.
DFL_FN int dfl_row_offset(int pos, int bh, int dim, int cap, int n_block,
                          int origin_logical, int origin_physical, int ring_end) {
  if (pos < ring_end) {
    const int row = (origin_physical + (pos - origin_logical)) % cap;
    return (bh * cap + row) * dim;
  }
  return (bh * n_block + (pos - ring_end)) * dim;
}
"""

_CONSTANTS = f"""
  const int ROWS = {ROWS};
  const int THREADS = {THREADS};
  const int KEY_LANES = {KEY_LANES};
  const int PAIRS = {PAIRS};
"""

# Pass 1: one threadgroup per (batch b, KV head h, chunk u, block of ROWS query rows).
# A query row is (g, s): query head h * G + g at position query_start + s.
# Writes, per row and chunk: the max score and the sum of exp(score - max) over the
# keys the row sees (sum 0: it sees none), and the exp-weighted sum of their values.
ATTEND_CHUNKS_BODY = (
    _CONSTANTS
    + f"""
  DFL_SHARED float q_tile[{ROWS}][{KERNEL_MAX_DIM + 1}];
  DFL_SHARED float scores[{ROWS}][{KERNEL_MAX_CHUNK + 1}];
  DFL_SHARED float lane_max[{ROWS}][{KEY_LANES}];
  DFL_SHARED float lane_sum[{ROWS}][{KEY_LANES}];
  DFL_SHARED int lane_seen[{ROWS}][{KEY_LANES}];
  DFL_SHARED float row_max[{ROWS}];
"""
    + """
  const int dim = params[4];
"""
    + tensor_attention.CHUNK_PARAMS
    + """
  // Stage the block's query rows in float.
  for (int idx = int(lid); idx < ROWS * dim; idx += THREADS) {
    const int r = idx / dim;
    const int d = idx % dim;
    const int row = rb * ROWS + r;
    float value = 0.0f;
    if (row < head_rows) {
      // Queries come (B, S, Hq, D): see kernel_attention.
      const int qsrc = (b * n_queries + row % n_queries) * n_heads + h * group_size
          + row / n_queries;
      value = float(queries[qsrc * dim + d]);
    }
    q_tile[r][d] = value;
  }
  DFL_BARRIER();

  // Scores: thread (r, lane) takes keys lane, lane + KEY_LANES, ... of the chunk.
  const int r = int(lid) % ROWS;
  const int lane = int(lid) / ROWS;
  const int row = rb * ROWS + r;
  const bool row_ok = row < head_rows;
  const int qpos = query_start + (row_ok ? row % n_queries : 0);
  const int first = dfl_first_key(qpos, window);
  const int last = dfl_last_key(qpos, window, causal, key_end);
  float local_max = 0.0f;
  int seen = 0;
  for (int k = lane; k < chunk; k += KEY_LANES) {
    const int pos = chunk_start + k;
    if (!row_ok || pos < first || pos > last) {
      continue;
    }
    const int off = dfl_row_offset(pos, bh, dim, cap, n_block, origin_logical,
                                   origin_physical, ring_end);
    auto key = pos < ring_end ? keys + off : block_keys + off;
    float dot = 0.0f;
    for (int d = 0; d < dim; ++d) {
      dot = DFL_FMA(q_tile[r][d], float(key[d]), dot);
    }
    float score = dot * scale;
    if (softcap > 0.0f) {
      score = softcap * DFL_TANH(score / softcap);
    }
    scores[r][k] = score;
    local_max = seen != 0 ? DFL_FMAX(local_max, score) : score;
    seen = 1;
  }
  lane_max[r][lane] = local_max;
  lane_seen[r][lane] = seen;
  DFL_BARRIER();

  // Row maxima (a max is exact in any order).
  if (int(lid) < ROWS) {
    float m = 0.0f;
    int any = 0;
    for (int j = 0; j < KEY_LANES; ++j) {
      if (lane_seen[lid][j] != 0) {
        m = any != 0 ? DFL_FMAX(m, lane_max[lid][j]) : lane_max[lid][j];
        any = 1;
      }
    }
    row_max[lid] = m;
  }
  DFL_BARRIER();

  // Weights exp(score - max), in place; per-lane sums in key order.
  float local_sum = 0.0f;
  for (int k = lane; k < chunk; k += KEY_LANES) {
    const int pos = chunk_start + k;
    if (!row_ok || pos < first || pos > last) {
      continue;
    }
    const float w = DFL_EXP(scores[r][k] - row_max[r]);
    scores[r][k] = w;
    local_sum += w;
  }
  lane_sum[r][lane] = local_sum;
  DFL_BARRIER();

  // Row statistics: lanes summed in lane order (a fixed tree for every row).
  if (int(lid) < ROWS && rb * ROWS + int(lid) < head_rows) {
    const int srow = rb * ROWS + int(lid);
    float total = 0.0f;
    int any = 0;
    for (int j = 0; j < KEY_LANES; ++j) {
      total += lane_sum[lid][j];
      any = any | lane_seen[lid][j];
    }
    const int qrow = (b * n_heads + h * group_size + srow / n_queries) * n_queries
        + srow % n_queries;
    part_stats[(qrow * n_chunks + u) * 2] = row_max[lid];
    part_stats[(qrow * n_chunks + u) * 2 + 1] = any != 0 ? total : 0.0f;
  }

  // Weighted values: thread takes (row, dim) pairs lid, lid + THREADS, ...; each
  // pair sums its keys in key order.
  float acc[PAIRS];
  int pair_first[PAIRS];
  int pair_last[PAIRS];
  for (int i = 0; i < PAIRS; ++i) {
    acc[i] = 0.0f;
    const int idx = int(lid) + THREADS * i;
    const int prow = rb * ROWS + idx / dim;
    pair_first[i] = 1;
    pair_last[i] = 0;
    if (idx < ROWS * dim && prow < head_rows) {
      const int ppos = query_start + prow % n_queries;
      pair_first[i] = dfl_first_key(ppos, window);
      pair_last[i] = dfl_last_key(ppos, window, causal, key_end);
    }
  }
  // Keys some pair of this thread sees (no address is formed for any other).
  int span_first = key_end;
  int span_last = -1;
  for (int i = 0; i < PAIRS; ++i) {
    if (pair_first[i] <= pair_last[i]) {
      span_first = pair_first[i] < span_first ? pair_first[i] : span_first;
      span_last = pair_last[i] > span_last ? pair_last[i] : span_last;
    }
  }
  const int k_first = span_first > chunk_start ? span_first - chunk_start : 0;
  for (int k = k_first; k < chunk; ++k) {
    const int pos = chunk_start + k;
    if (pos > span_last) {
      break;
    }
    const int off = dfl_row_offset(pos, bh, dim, cap, n_block, origin_logical,
                                   origin_physical, ring_end);
    auto value = pos < ring_end ? values + off : block_values + off;
    for (int i = 0; i < PAIRS; ++i) {
      if (pos >= pair_first[i] && pos <= pair_last[i]) {
        const int idx = int(lid) + THREADS * i;
        acc[i] = DFL_FMA(scores[idx / dim][k], float(value[idx % dim]), acc[i]);
      }
    }
  }
  for (int i = 0; i < PAIRS; ++i) {
    const int idx = int(lid) + THREADS * i;
    const int prow = rb * ROWS + idx / dim;
    if (idx < ROWS * dim && prow < head_rows) {
      const int qrow = (b * n_heads + h * group_size + prow / n_queries) * n_queries
          + prow % n_queries;
      part_values[(qrow * n_chunks + u) * dim + idx % dim] = acc[i];
    }
  }
"""
)

# Pass 2: one thread per output element (row, d): the chunks' maximum M over the ones the
# row sees (sum > 0), then sum and weighted values rescaled by exp(m_u - M), added in
# ascending chunk order; a chunk the row does not see adds an exact zero. The output is
# stored (B, S, Hq, D), so the model's transpose back to (B, S, Hq * D) is a view, not a
# copy. params: total, dim, n_chunks, n_heads, n_queries, and the gated fold's
# gate_offset (the element its gate starts at; 0 in every other call).
#
# Up to FOLD_HELD chunks (a call over fewer than ~8k keys), every load is issued first
# into registers: one wait on memory, not one per unrolled batch of eight in each pass.
# More chunks take each pass in batches of half as many. On an H200 (session 40): 5.7 -> 4.4
# us at 17 chunks, 43.7 -> 29.1 at 129. Every form does the same arithmetic in the same
# order, so they give the same bits.
FOLD_HELD = 32

_FOLD_PROLOGUE = """
  const int total_threads = fold_params[0];
  const int dim = fold_params[1];
  const int n_chunks = fold_params[2];
  const int n_heads = fold_params[3];
  const int n_queries = fold_params[4];
  const int gid = int(group) * THREADS + int(lid);
  if (gid >= total_threads) {
    return;
  }
  const int qrow = gid / dim;
  const int d = gid % dim;
  const int base = qrow * n_chunks;
  float top = 0.0f;
  int seen = 0;
  float l = 0.0f;
  float acc = 0.0f;
"""
# One chunk's step of each pass, on (m_u, l_u, a_u) however they were read.
_FOLD_TOP = """const bool take = l_u > 0.0f;
top = take ? (seen != 0 ? DFL_FMAX(top, m_u) : m_u) : top;
seen = seen | int(take);
"""
_FOLD_SUM = """const float w = l_u > 0.0f ? DFL_EXP(m_u - top) : 0.0f;
l = DFL_FMA(l_u, w, l);
acc = DFL_FMA(a_u, w, acc);
"""
_FOLD_READ = """const float m_u = part_stats[(base + u) * 2];
const float l_u = part_stats[(base + u) * 2 + 1];
"""
_FOLD_READ_VALUE = "const float a_u = part_values[(base + u) * dim + d];\n"
_HELD = {"m": "held_m", "l": "held_l", "a": "held_a"}


def _declare(names: str, size: str) -> str:
    """Register arrays for the named values (``m``, ``l``, ``a``) of ``size`` chunks."""
    return "".join(f"float {_HELD[n]}[{size}];\n" for n in names)


def _hold(names: str, index: str) -> str:
    """Keep the named values just read in their arrays at ``index``."""
    return "".join(f"{_HELD[n]}[{index}] = {n}_u;\n" for n in names)


def _take(names: str, index: str) -> str:
    """The named values back from their arrays at ``index``."""
    return "".join(f"const float {n}_u = {_HELD[n]}[{index}];\n" for n in names)


def _unrolled(size: str, index: str, head: str, done: str, body: str) -> str:
    """A loop of ``size`` copies, fully unrolled (so ``index`` is a constant in each and
    the held arrays stay in registers), left once ``done`` holds (a uniform branch: a
    short call issues no work for the copies past its chunks)."""
    return (
        "DFL_UNROLL_ALL\n"
        f"for (int {index} = 0; {index} < {size}; ++{index}) {{\n"
        + indent(head + f"if ({done}) {{\n  break;\n}}\n" + body, 2)
        + "}\n"
    )


# Up to FOLD_HELD chunks: every load first, then both passes on the held values.
_FOLD_HELD = (
    _declare("mla", "FOLD_HELD")
    + _unrolled(
        "FOLD_HELD", "u", "", "u >= n_chunks",
        _FOLD_READ + _FOLD_READ_VALUE + _hold("mla", "u"),
    )
    + _unrolled("FOLD_HELD", "u", "", "u >= n_chunks", _take("ml", "u") + _FOLD_TOP)
    + _unrolled("FOLD_HELD", "u", "", "u >= n_chunks", _take("mla", "u") + _FOLD_SUM)
)  # fmt: skip
# The passes straight from memory (the reference form; no longer launched).
_FOLD_LOOPS = (
    "DFL_UNROLL8\nfor (int u = 0; u < n_chunks; ++u) {\n"
    + indent(_FOLD_READ + _FOLD_TOP, 2)
    + "}\nDFL_UNROLL8\nfor (int u = 0; u < n_chunks; ++u) {\n"
    + indent(_FOLD_READ + _FOLD_READ_VALUE + _FOLD_SUM, 2)
    + "}\n"
)


def _batched_pass(names: str, reads: str, step: str) -> str:
    """One pass over every chunk (more than FOLD_HELD), FOLD_BATCH at a time: the
    batch's ``names`` all read before ``step`` runs on each in order (one wait a batch;
    half of FOLD_HELD keeps the kernel's registers at the held path's, two threadgroups
    an SM)."""
    loads = _unrolled(
        "FOLD_BATCH", "i", "const int u = first + i;\n", "u >= n_chunks",
        reads + _hold(names, "i"),
    )  # fmt: skip
    steps = _unrolled(
        "FOLD_BATCH", "i", "", "first + i >= n_chunks", _take(names, "i") + step
    )
    return (
        "for (int first = 0; first < n_chunks; first += FOLD_BATCH) {\n"
        + indent(_declare(names, "FOLD_BATCH") + loads + steps, 2)
        + "}\n"
    )


_FOLD_BATCHED = _batched_pass("ml", _FOLD_READ, _FOLD_TOP) + _batched_pass(
    "mla", _FOLD_READ + _FOLD_READ_VALUE, _FOLD_SUM
)
_FOLD_EPILOGUE = """  const int b = qrow / (n_heads * n_queries);
  const int h = (qrow / n_queries) % n_heads;
  const int s = qrow % n_queries;
  out[((b * n_queries + s) * n_heads + h) * dim + d] = T(acc / l);
"""


def fold_body(held: int = FOLD_HELD) -> str:
    """The fold's body: up to ``held`` chunks held in registers, more in batches of
    half as many; 0: the plain loops (the reference form, same bits)."""
    if held <= 0:
        return _FOLD_PROLOGUE + indent(_FOLD_LOOPS, 2) + _FOLD_EPILOGUE
    return (
        _FOLD_PROLOGUE
        + f"  constexpr int FOLD_HELD = {held};\n"
        + f"  constexpr int FOLD_BATCH = {max(held // 2, 1)};\n"
        + "  if (n_chunks <= FOLD_HELD) {\n"
        + indent(_FOLD_HELD, 4)
        + "  } else {\n"
        + indent(_FOLD_BATCHED, 4)
        + "  }\n"
        + _FOLD_EPILOGUE
    )


FOLD_CHUNKS_BODY = fold_body()
# Unroll the next loop whole where the compiler takes the hint (the held passes).
FOLD_HELPERS = """
#ifdef __CUDACC__
#define DFL_UNROLL_ALL _Pragma("unroll")
#else
#define DFL_UNROLL_ALL
#endif
"""

ATTEND_CHUNKS = GroupKernelSpec(
    base="attend_chunks",
    input_names=(
        "queries", "keys", "values", "block_keys", "block_values", "params", "fparams"
    ),
    input_types=("T", "T", "T", "T", "T", "int32", "float32"),
    output_names=("part_stats", "part_values"),
    output_types=("float32", "float32"),
    helpers=ATTENTION_HELPERS,
    body=ATTEND_CHUNKS_BODY,
    threads=THREADS,
    small_inputs=("fparams",),
)  # fmt: skip
# The same pass over stacked planes and blocks (tensor_attention.stacked_body).
ATTEND_CHUNKS_STACKED = dataclasses.replace(
    ATTEND_CHUNKS,
    base="attend_chunks_stacked",
    body=tensor_attention.stacked_body(ATTEND_CHUNKS_BODY),
)
FOLD_CHUNKS = GroupKernelSpec(
    base="fold_chunks",
    input_names=("part_stats", "part_values", "fold_params"),
    input_types=("float32", "float32", "int32"),
    output_names=("out",),
    output_types=("T",),
    helpers=FOLD_HELPERS,
    body=f"  const int THREADS = {THREADS};\n" + FOLD_CHUNKS_BODY,
    threads=THREADS,
    small_inputs=("fold_params",),
)

# The fold with Glimmer's output gate as its epilogue: ``out * sigmoid(gate)``, with the
# gate (B, S, Hq * D) laid out as the output. On CUDA it is mlx's own ``Sigmoid`` and
# ``Multiply`` functors (the header mlx's kernels use), so the bits are those of
# ``mx.sigmoid`` and ``*`` after the plain fold; the Metal form computes the sigmoid in
# float32 as mlx's Metal formula writes it, rounded to ``T`` (emulated only).
FOLD_GATE_HELPERS = FOLD_HELPERS + """
#ifdef __CUDACC__
#include "mlx/backend/cuda/device/unary_ops.cuh"
#define DFL_GATED(value, gate) (T(value) * ::mlx::core::cu::Sigmoid{}(gate))
#else
DFL_FN float dfl_sigmoid(float x) {
  const float y = 1.0f / (1.0f + exp(fabs(x)));
  return x < 0.0f ? y : 1.0f - y;
}
#define DFL_GATED(value, gate) \\
  static_cast<T>(float(T(value)) * float(T(dfl_sigmoid(float(gate)))))
#endif
"""
FOLD_STORE = "  out[((b * n_queries + s) * n_heads + h) * dim + d] = T(acc / l);\n"
# The gate is read from element fold_params[5] on (0 but where it is a member of one
# fused, member-major projection output handed over whole: no view of it is made).
FOLD_GATED_STORE = (
    "  const int stored = ((b * n_queries + s) * n_heads + h) * dim + d;\n"
    "  const int at = fold_params[5] + stored;\n"
    "  out[stored] = DFL_GATED(acc / l, gate[at]);\n"
)
FOLD_GATED = GroupKernelSpec(
    base="fold_gated",
    input_names=("part_stats", "part_values", "fold_params", "gate"),
    input_types=("float32", "float32", "int32", "T"),
    output_names=("out",),
    output_types=("T",),
    helpers=FOLD_GATE_HELPERS,
    body=FOLD_CHUNKS.body.replace(FOLD_STORE, FOLD_GATED_STORE),
    threads=THREADS,
    small_inputs=("fold_params",),
)
SPECS = (ATTEND_CHUNKS, FOLD_CHUNKS, FOLD_GATED, ATTEND_CHUNKS_STACKED)


# ``DFLASH_TENSOR_CORES=0`` keeps CUDA on the scalar body (for comparisons); otherwise
# the tensor-core form takes every call it serves (:mod:`.tensor_attention`).
TENSOR_CORES_ENV = "DFLASH_TENSOR_CORES"
TENSOR_CORES: bool = backend.env_switch(TENSOR_CORES_ENV) is not False
# Which tensor-core layout this process runs: ``DFLASH_TENSOR_LAYOUT``, read on first
# use and kept (None: not read yet), so a bad value fails the first call, not the import.
TENSOR_LAYOUT: Optional[tensor_attention.Layout] = None


def tensor_layout() -> tensor_attention.Layout:
    """The process's tensor-core layout (resolved once).

    Raises:
        ValueError: ``DFLASH_TENSOR_LAYOUT`` names no layout.
    """
    global TENSOR_LAYOUT
    if TENSOR_LAYOUT is None:
        TENSOR_LAYOUT = tensor_attention.layout_from_env()
    return TENSOR_LAYOUT


def uses_tensor_cores(plan: Plan, dtype: mx.Dtype) -> bool:
    """Whether the kernel form of ``plan`` runs the tensor-core chunk pass."""
    return TENSOR_CORES and tensor_attention.tensor_serves(
        plan.dim, plan.chunk, dtype, backend.BACKEND, tensor_layout()
    )


def kernel_serves(plan: Plan) -> bool:
    """Whether the kernel's compile-time limits cover ``plan``."""
    # head_dim >= 8 keeps every T array at 8+ elements: mlx binds smaller inputs in
    # Metal's constant address space, which the body's pointer selects do not expect.
    return (
        8 <= plan.dim <= KERNEL_MAX_DIM
        and plan.chunk <= KERNEL_MAX_CHUNK
        and container_words(plan) <= MAX_LAUNCH_WORDS
    )


def container_words(plan: Plan) -> int:
    """Elements of the larger container's keys (a stacked buffer's half: its values'
    offset), which the kernels' 32-bit indices must hold."""
    return plan.batch * plan.kv_heads * plan.dim * max(plan.capacity, plan.block)


@dataclass(frozen=True)
class Launch:
    """The two launches of one plan: parameter arrays, shapes, group counts (the
    fold's integers end with the gate's offset, 0 but for a gate read in place)."""

    ints: mx.array
    chunk_shapes: tuple[Shape, Shape]
    chunk_groups: int
    fold_ints: mx.array
    out_shape: Shape
    fold_groups: int


@functools.lru_cache(maxsize=1024)
def _launch(plan: Plan, rows_per_group: int, gate_offset: int = 0) -> Launch:
    """:class:`Launch` of ``plan`` when a chunk pass group takes ``rows_per_group``
    query rows and a gated fold reads its gate from element ``gate_offset`` on
    (memoised: a step's layers of one kind share it)."""
    group = plan.heads // plan.kv_heads
    row_blocks = -(-group * plan.queries // rows_per_group)
    ints = int_params(
        plan.batch, plan.heads, plan.kv_heads, plan.queries, plan.dim,
        max(plan.capacity, 1), plan.block, plan.query_start, plan.origin_logical,
        plan.origin_physical, plan.length, plan.window, int(plan.causal), plan.chunk,
        plan.chunk_first, plan.chunks, row_blocks, *value_offsets(plan),
    )  # fmt: skip
    rows = (plan.batch, plan.heads, plan.queries)
    total = plan.batch * plan.heads * plan.queries * plan.dim
    return Launch(
        ints=ints,
        chunk_shapes=(rows + (plan.chunks, 2), rows + (plan.chunks, plan.dim)),
        chunk_groups=plan.batch * plan.kv_heads * plan.chunks * row_blocks,
        fold_ints=int_params(
            total, plan.dim, plan.chunks, plan.heads, plan.queries, gate_offset
        ),
        out_shape=(plan.batch, plan.queries, plan.heads, plan.dim),
        fold_groups=-(-total // THREADS),
    )


def value_offsets(plan: Plan) -> tuple[int, int]:
    """Where the plane's and the block's values start in the arrays the chunk pass
    binds as ``values`` and ``block_values`` (elements): a stacked buffer's second
    half, else 0 (and 0 for a container no position falls in)."""
    row_words = plan.batch * plan.kv_heads * plan.dim  # a position's, all heads
    plane = row_words * plan.capacity if plan.plane_stacked and plan.capacity else 0
    block = row_words * plan.block if plan.block_stacked and plan.block else 0
    return plane, block


def kernel_attention(
    queries: mx.array,
    plane: KeyPlane,
    block_keys: Optional[mx.array],
    block_values: Optional[mx.array],
    plan: Plan,
    scale: float,
    softcap: Optional[float],
    gate: Optional[mx.array] = None,
) -> mx.array:
    """The custom-kernel form (two launches); same contract as the reference.

    The chunk pass is the tensor-core one where it serves (CUDA, 16-bit types, see
    :func:`uses_tensor_cores`), else the scalar body; the fold is shared.

    Shapes: queries ``(B, Hq, S, D)``; gate ``(B, S, Hq, D)``; returns
    ``(B, Hq, S, D)``, a transposed view of the ``(B, S, Hq, D)`` buffer the fold stores.
    """
    form = kernel_form(plan, queries.dtype, gate is not None)
    keys, values, block_keys, block_values = bound_arrays(
        plan, plane, block_keys, block_values
    )
    # The kernels read queries (B, S, Hq, D): mlx-lm's attention hands them over as the
    # transpose of such an array (RoPE and scaling keep that layout), so this is a view
    # and mlx copies nothing before the launch; a (B, Hq, S, D) array is copied once.
    return launch_attention(
        form,
        queries.transpose(0, 2, 1, 3),
        keys,
        values,
        block_keys,
        block_values,
        form.launch.ints,
        float_params(float(scale), float(softcap or 0.0)),
        form.launch.fold_ints,
        gate,
    )


@dataclass(frozen=True)
class KernelForm:
    """What the two launches of a plan are, apart from their arrays: the chunk pass's
    spec, the geometry (:class:`Launch`, with the plan's integer scalars), whether
    the fold applies a gate and the element of its input the gate starts at. Calls of
    equal forms differ only in their inputs."""

    spec: GroupKernelSpec
    launch: Launch
    dtype: mx.Dtype
    gated: bool
    gate_offset: int = 0


def kernel_form(
    plan: Plan, dtype: mx.Dtype, gated: bool, gate_offset: int = 0
) -> KernelForm:
    """The :class:`KernelForm` of ``plan`` for ``dtype`` queries.

    Args:
        plan: The call's plan.
        dtype: The queries' dtype.
        gated: Whether the fold applies an output gate.
        gate_offset: With ``gated``, the element of the gate's input at which the gate
            starts (its ``(B, S, Hq * D)`` elements follow in order there): a fused
            projection's member-major output can be handed over whole, no view of
            the gate made. It is carried in ``launch.fold_ints``.

    Returns:
        The form (its launch memoised per plan, group rows and gate offset).

    Raises:
        ValueError: the kernel's compile-time limits do not cover ``plan``, or
            ``gate_offset`` is not an int >= 0 (0 without a gate) that an int32
            index holds with the gate after it.
    """
    _check_gate_offset(plan, gated, gate_offset)
    if not kernel_serves(plan):
        raise ValueError(
            f"the attention kernel serves 8 <= head_dim <= {KERNEL_MAX_DIM}, chunk <= "
            f"{KERNEL_MAX_CHUNK} and containers of at most {MAX_LAUNCH_WORDS} "
            f"elements, got head_dim {plan.dim}, chunk {plan.chunk} and "
            f"{container_words(plan)}"
        )
    layout = tensor_layout() if uses_tensor_cores(plan, dtype) else None
    launch = _launch(plan, layout.rows if layout is not None else ROWS, gate_offset)
    stacked = plan.plane_stacked or plan.block_stacked
    if layout is None:
        spec = ATTEND_CHUNKS_STACKED if stacked else ATTEND_CHUNKS
    else:
        spec = tensor_attention.attend_spec(plan.dim, layout, stacked)
    return KernelForm(spec, launch, dtype, bool(gated), gate_offset)


def _check_gate_offset(plan: Plan, gated: bool, gate_offset: int) -> None:
    """Raise ValueError for a ``gate_offset`` :func:`kernel_form` cannot take."""
    if gate_offset == 0 and type(gate_offset) is int:
        return  # every call but a gate read in place
    checked_offset("gate_offset", gate_offset)
    total = plan.batch * plan.heads * plan.queries * plan.dim
    if gate_offset + total > MAX_LAUNCH_WORDS:
        raise ValueError(
            f"gate_offset {gate_offset}: its {total} gate elements after it are not "
            "inside int32"
        )
    if not gated:
        raise ValueError(f"gate_offset {gate_offset} given for an ungated fold")


def bound_arrays(
    plan: Plan,
    plane: KeyPlane,
    block_keys: Optional[mx.array],
    block_values: Optional[mx.array],
) -> tuple[mx.array, mx.array, mx.array, mx.array]:
    """The plane's and the block's arrays as the chunk pass binds them: an absent
    container is never read (no position falls in it), so any array stands for it."""
    keys, values = plane.keys, plane.values
    if plan.block == 0:
        block_keys, block_values = keys, values
    if plan.capacity == 0:
        keys, values = block_keys, block_values
    return keys, values, block_keys, block_values


def launch_attention(
    form: KernelForm,
    queries: mx.array,
    keys: mx.array,
    values: mx.array,
    block_keys: mx.array,
    block_values: mx.array,
    ints: mx.array,
    floats: mx.array,
    fold_ints: mx.array,
    gate: Optional[mx.array] = None,
    stored_shape: Optional[tuple[int, ...]] = None,
) -> mx.array:
    """The chunk pass and the fold of ``form`` over these arrays (every runtime value
    an input, so a traced caller replays it for any plan of the same form).

    Args:
        form: :func:`kernel_form` of the call's plan.
        queries: The queries as the kernels read them.
        keys, values, block_keys, block_values: :func:`bound_arrays` of the call.
        ints: The chunk pass's integer scalars (``form.launch.ints`` of the call's plan).
        floats: ``(scale, softcap or 0)`` as float32.
        fold_ints: The fold's (``form.launch.fold_ints``: the gate's offset among
            them).
        gate: The output gate, given exactly when ``form.gated``: read from element
            ``form.gate_offset`` of it on.
        stored_shape: Given, the shape the fold's ``(B, S, Hq, D)`` buffer is
            declared in and returned as it is (a caller that merges the heads, as
            ``(B, S, Hq * D)``, then needs no transpose or reshape; the fold indexes
            by its scalars, not by shapes).

    Shapes: queries ``(B, S, Hq, D)``; gate ``(B, S, Hq, D)`` or any shape of its
    elements in that order (from ``form.gate_offset`` on: any array holding them
    there); returns ``(B, Hq, S, D)``, a transposed view of the ``(B, S, Hq, D)``
    buffer the fold stores (``stored_shape``: that buffer).

    Raises:
        ValueError: a gate read in place (``form.gate_offset``) whose elements run
            past the end of ``gate``.
    """
    launch = form.launch
    if form.gate_offset:
        # A gate handed over whole: its reads must stay inside it (checked before
        # anything is launched).
        stop = form.gate_offset + math.prod(launch.out_shape)
        if gate is None or stop > gate.size:
            raise ValueError(
                f"gate_offset {form.gate_offset} reads the gate up to element {stop}, "
                f"past the {None if gate is None else gate.size} elements given"
            )
    out_shape = launch.out_shape if stored_shape is None else tuple(stored_shape)
    stats, weighted = groups.launch_groups(
        form.spec,
        [queries, keys, values, block_keys, block_values, ints, floats],
        launch.chunk_shapes,
        [mx.float32, mx.float32],
        launch.chunk_groups,
        form.dtype,
    )
    fold_inputs = [stats, weighted, fold_ints]
    (out,) = groups.launch_groups(
        FOLD_GATED if form.gated else FOLD_CHUNKS,
        fold_inputs + [gate] if form.gated else fold_inputs,
        [out_shape],
        [form.dtype],
        launch.fold_groups,
        form.dtype,
    )
    if stored_shape is not None:
        return out
    # Stored (B, S, Hq, D): this view is (B, Hq, S, D), and transposing it back is free.
    return out.transpose(0, 2, 1, 3)


# ------------------------------------------------------------------- public


def small_query_attention(
    queries: mx.array,
    plane: KeyPlane,
    block_keys: Optional[mx.array] = None,
    block_values: Optional[mx.array] = None,
    *,
    scale: float,
    window: Optional[int] = None,
    causal: bool = True,
    softcap: Optional[float] = None,
    query_start: Optional[int] = None,
    chunk: int = CHUNK,
    gate: Optional[mx.array] = None,
    use_kernel: Optional[bool] = None,
) -> mx.array:
    """Attention of a few queries over a plane's live rows and a held-back block.

    Keys, in position order, are the plane's ``length`` live rows (positions
    ``origin_logical ..``, read through the wrap in place) then the block's rows.
    Queries sit at ``query_start .. query_start + S - 1`` (default: the last ``S``
    key positions). Which keys a query sees follows from positions alone (see the
    module docstring); the result is batch-invariant.

    Args:
        queries: Queries (mlx-lm layout), bfloat16, float16 or float32.
        plane: The plane's buffers and bookkeeping.
        block_keys: Keys of the rows after the plane (None: no block).
        block_values: Their values.
        scale: Score scale (``q . k * scale``).
        window: Sliding window ``W`` (None: every earlier key).
        causal: Whether a query sees no key after its own position.
        softcap: Logit soft-cap ``c``: scores become ``c * tanh(score / c)``.
        query_start: Position of query 0.
        chunk: Keys per chunk of the fixed reduction order (the kernel takes at
            most 256); results are batch-invariant for any fixed ``chunk``.
        gate: An output gate (Muse Glimmer's): the result is multiplied by
            ``mx.sigmoid(gate)``, as mlx-lm does after the attention, inside the
            kernel's last pass (None: no gate).
        use_kernel: None picks the kernel on a GPU backend (default device GPU,
            ``DFLASH_KERNELS`` not 0, shape within the kernel's limits), else the
            reference; True forces the kernel, False the reference.

    Returns:
        The attention output, in the queries' dtype.

    Shapes: queries ``(B, Hq, S, D)``; plane ``(B, Hkv, C, D)``; block
    ``(B, Hkv, NB, D)``; gate ``(B, S, Hq * D)`` (or any shape of that row-major
    order and size); returns ``(B, Hq, S, D)``.

    Raises:
        ValueError: On any inconsistent argument (nothing is launched).
        RuntimeError: ``use_kernel=True`` without Metal or CUDA.
    """
    if not (isinstance(scale, (int, float)) and math.isfinite(scale)):
        raise ValueError(f"scale must be a finite number, got {scale!r}")
    if softcap is not None and not (isinstance(softcap, (int, float)) and softcap >= 0):
        raise ValueError(f"softcap must be None or >= 0, got {softcap!r}")
    plan = make_plan(
        queries, plane, block_keys, block_values,
        window=window, causal=causal, query_start=query_start, chunk=chunk,
    )  # fmt: skip
    if use_kernel is None:
        use_kernel = kernel_serves(plan) and backend.use_kernel_path(None, auto=True)
    elif use_kernel:
        backend.use_kernel_path(True, auto=True)
    if gate is not None:
        gate = _gate_rows(gate, queries)
    form = kernel_attention if use_kernel else reference_attention
    return form(queries, plane, block_keys, block_values, plan, scale, softcap, gate)


def _gate_rows(gate: mx.array, queries: mx.array) -> mx.array:
    """``gate`` as ``(B, S, Hq, D)`` (a view of a row-major array).

    Raises:
        ValueError: its size or dtype does not match the queries'.
    """
    batch, heads, count, dim = queries.shape
    if gate.size != batch * count * heads * dim or gate.dtype != queries.dtype:
        raise ValueError(
            f"gate must hold B * S * Hq * D = {batch * count * heads * dim} "
            f"{queries.dtype} elements, got {gate.shape} {gate.dtype}"
        )
    return gate.reshape(batch, count, heads, dim)
