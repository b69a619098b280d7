"""Ring store with wrap and the staging shadow.

Two operations on one ring plane buffer (head-major ``(..., H, C, D)`` or
token-major ``(..., C, H, D)``), each with a custom-kernel form and a pure-MLX
reference beside it:

* :func:`ring_store` writes ``S <= C`` rows at physical ``(dest_start + i) % C``;
* :func:`stage_shadow` un-rotates the live rows into logical order and appends a
  chunk's rows, giving the contiguous span staged attention reads;
* :func:`stage_shadow_kv` does the same for a ring whose K and V are stacked in
  one ``(2, ...)`` buffer, taking the chunk's keys and values as they come out
  of the model and also returning them stacked (the block a checkpoint holds
  back), so a staged layer costs one launch instead of a stack plus a shadow.

Default paths (``use_kernel=None``) on a GPU: the store is one mlx op (a slice
update, or one scatter over host-built wrapped indices when the rows cross the
seam; it runs in place when mlx can donate the buffer, so it moves ``S`` rows,
not ``C``); the shadow is the custom kernel on Metal (its output is a new array
anyway) and the reference on CUDA, where that measured at least as fast.
``docs/metal.md`` has the byte counts behind that choice.

The KV cache calls two prevalidated entry points on its hot path:
:func:`ring_write` (the in-place store, one launch, never split at the seam) and
:class:`ShadowStager` (the shadow, geometry checked once per plane).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Optional

import mlx.core as mx
import numpy as np

from . import backend
from .backend import kernel_for, params, use_kernel_path
from .layout import (
    RowGeometry,
    as_words,
    block_rows,
    buffer_geometry,
    check_launch_size,
    check_ring_index,
    from_words,
    word_dtype,
    words_per_row,
)
from .sources import RING_STORE, STAGE_SHADOW, STAGE_SHADOW_KV

# Built once at import (None without a GPU backend).
kernel_for(RING_STORE)
kernel_for(STAGE_SHADOW)
kernel_for(STAGE_SHADOW_KV)


def wrapped_rows(start: int, count: int, capacity: int) -> np.ndarray:
    """Physical rows ``(start + i) % capacity`` for ``i < count``.

    Args:
        start: First physical row.
        count: Number of rows.
        capacity: Ring capacity ``C``.

    Returns:
        int32 numpy array of shape ``(count,)``.
    """
    return ((start + np.arange(count, dtype=np.int64)) % capacity).astype(np.int32)


@functools.lru_cache(maxsize=64)
def wrapped_index(start: int, count: int, capacity: int) -> mx.array:
    """:func:`wrapped_rows` as an ``mx.array``, memoised.

    Every layer of a round stores or stages at the same ring position, so one
    host-to-device copy of the index serves them all (``mx.array`` is
    immutable, so sharing it is safe).

    Returns:
        int32 array of shape ``(count,)``.
    """
    return mx.array(wrapped_rows(start, count, capacity))


# --------------------------------------------------------------------- store


def ring_write(
    buffer: mx.array, rows: mx.array, dest_start: int, axis: int
) -> mx.array:
    """Store rows at physical ``(dest_start + i) % C``: one mlx launch, never split.

    The pure-MLX store, prevalidated (the caller guarantees ``rows`` matches
    ``buffer`` off ``axis``, ``S <= C`` and ``0 <= dest_start < C``): a slice
    update when the rows do not cross the seam, else one scatter over a
    memoised wrapped index. Either runs in place when mlx can donate ``buffer``
    (no other reference to it is alive when the op is evaluated).

    Shapes: buffer ``(..., C, ...)`` with rows on ``axis``; rows the same with
    ``S`` rows; returns the buffer's shape.

    Args:
        buffer: Ring (or growing) buffer.
        rows: Rows to store.
        dest_start: Physical row of ``rows``' first row.
        axis: Row axis (non-negative).

    Returns:
        The updated buffer; the ``buffer`` object itself is left as it was.
    """
    count = rows.shape[axis]
    capacity = buffer.shape[axis]
    if dest_start + count <= capacity:
        # ``[...]`` is a new handle on the same array (no graph node), so the
        # in-place ``__setitem__`` below rebinds it, never the caller's object.
        out = buffer[...]
        out[(slice(None),) * axis + (slice(dest_start, dest_start + count),)] = rows
        return out
    shape = [1] * buffer.ndim
    shape[axis] = count
    index = wrapped_index(dest_start, count, capacity).reshape(shape)
    return mx.put_along_axis(buffer, index, rows, axis=axis)


def _ring_store_ops(
    buffer: mx.array, rows: mx.array, start: int, geom: RowGeometry
) -> mx.array:
    return ring_write(buffer, rows, start, geom.row_axis)


def _ring_store_kernel(
    buffer: mx.array, rows: mx.array, start: int, geom: RowGeometry
) -> mx.array:
    count = rows.shape[geom.row_axis]
    word = word_dtype(geom)
    words = words_per_row(geom, word)
    total = geom.outer * geom.capacity * words
    check_launch_size(total, "ring_store")
    scalars = params(total, geom.outer, geom.capacity, words, count, start)
    (out,) = backend.launch(
        RING_STORE,
        [as_words(buffer, geom, word), as_words(rows, geom, word), scalars],
        [(geom.outer, geom.capacity, words)],
        word,
        total,
    )
    return from_words(out, geom, geom.capacity)


def ring_store(
    buffer: mx.array,
    rows: mx.array,
    dest_start: int,
    *,
    head_major: bool = True,
    use_kernel: Optional[bool] = None,
) -> mx.array:
    """Write a block of rows into a ring at wrapped physical positions.

    Row ``i`` of ``rows`` lands at physical row ``(dest_start + i) % C``, across
    the seam in one operation (never split into two slice updates).

    Shapes: buffer ``(B, H, C, D)`` / ``(B, C, H, D)``; rows ``(B, H, S, D)`` /
    ``(B, S, H, D)`` with ``S <= C``; returns the buffer's shape.

    Args:
        buffer: The ring plane buffer (float16, bfloat16 or float32).
        rows: ``S`` rows in the same layout and dtype.
        dest_start: Physical row of the first written row, ``0 <= dest_start < C``.
        head_major: Layout of ``buffer`` and ``rows``.
        use_kernel: None (default) picks the mlx scatter, which runs in place
            when the caller holds no other reference to ``buffer``; True forces
            the custom kernel (one launch, writes a fresh ``C``-row buffer);
            False forces the scatter.

    Returns:
        The updated buffer. ``buffer`` itself is not modified.

    Raises:
        ValueError: On a shape/dtype mismatch, ``S > C`` or ``dest_start``
            outside ``[0, C)``.
    """
    geom = buffer_geometry(buffer, head_major, "buffer")
    count = block_rows(geom, rows, "rows")
    if count > geom.capacity:
        raise ValueError(
            f"rows holds S={count} rows, more than capacity C={geom.capacity}"
        )
    start = check_ring_index(dest_start, geom.capacity, "dest_start")
    if count == 0:
        return buffer
    if use_kernel_path(use_kernel, auto=False):
        return _ring_store_kernel(buffer, rows, start, geom)
    return _ring_store_ops(buffer, rows, start, geom)


# -------------------------------------------------------------------- shadow


def _stage_shadow_ops(
    buffer: mx.array, rows: mx.array, origin: int, length: int, geom: RowGeometry
) -> mx.array:
    if length == 0:
        return rows
    # The live rows are at most two runs of the ring ([origin, C) then [0, ...)): slicing
    # them into one concatenate with the chunk is a plain copy, where a gather is not.
    axis, cap = geom.row_axis, geom.capacity
    lead = (slice(None),) * axis
    first = min(length, cap - origin)
    parts = [buffer[lead + (slice(origin, origin + first),)]]
    if length > first:
        parts.append(buffer[lead + (slice(0, length - first),)])
    if rows.shape[axis] > 0:
        parts.append(rows)
    if len(parts) == 1:
        return mx.contiguous(parts[0])
    return mx.concatenate(parts, axis=axis)


def _stage_shadow_kernel(
    buffer: mx.array, rows: mx.array, origin: int, length: int, geom: RowGeometry
) -> mx.array:
    count = rows.shape[geom.row_axis]
    word = word_dtype(geom)
    words = words_per_row(geom, word)
    span = length + count
    total = geom.outer * span * words
    check_launch_size(total, "stage_shadow")
    scalars = params(total, geom.outer, geom.capacity, words, length, count, origin)
    (out,) = backend.launch(
        STAGE_SHADOW,
        [as_words(buffer, geom, word), as_words(rows, geom, word), scalars],
        [(geom.outer, span, words)],
        word,
        total,
    )
    return from_words(out, geom, span)


def _check_length(length: int, capacity: int) -> int:
    if isinstance(length, bool) or not isinstance(length, (int, np.integer)):
        raise ValueError(f"length must be an int, got {type(length).__name__}")
    if not 0 <= int(length) <= capacity:
        raise ValueError(f"length={int(length)} outside [0, {capacity}]")
    return int(length)


def stage_shadow(
    buffer: mx.array,
    rows: mx.array,
    origin_physical: int,
    length: int,
    *,
    head_major: bool = True,
    use_kernel: Optional[bool] = None,
) -> mx.array:
    """Build the staging shadow: live ring rows in logical order, then a chunk.

    Logical row ``k < length`` of the ring lives at physical
    ``(origin_physical + k) % C``; the shadow holds those rows in order
    followed by the chunk's ``S`` rows, so staged attention reads one
    contiguous span before the chunk overwrites anything.

    Shapes: buffer ``(B, H, C, D)`` / ``(B, C, H, D)``; rows ``(B, H, S, D)`` /
    ``(B, S, H, D)`` (any ``S``, a prefill chunk may be wider than the window);
    returns ``(B, H, length + S, D)`` / ``(B, length + S, H, D)``.

    Args:
        buffer: The ring plane buffer (float16, bfloat16 or float32).
        rows: The chunk's rows in the same layout and dtype.
        origin_physical: Physical row of logical row 0, ``0 <= origin < C``.
        length: Live rows, ``0 <= length <= C``.
        head_major: Layout of ``buffer`` and ``rows``.
        use_kernel: None (default) picks the custom kernel on Metal (one
            launch) and the reference (slices + one concatenate) on CUDA, where it
            measured at least as fast, and on the CPU; True / False force one form.

    Returns:
        A new array holding the shadow.

    Raises:
        ValueError: On a shape/dtype mismatch or an origin/length out of range.
    """
    geom = buffer_geometry(buffer, head_major, "buffer")
    count = block_rows(geom, rows, "rows")
    origin = check_ring_index(origin_physical, geom.capacity, "origin_physical")
    length = _check_length(length, geom.capacity)
    if length + count == 0:
        return mx.zeros(geom.with_rows(0), dtype=geom.dtype)
    if use_kernel_path(use_kernel, auto=backend.shadow_kernel_by_default()):
        return _stage_shadow_kernel(buffer, rows, origin, length, geom)
    return _stage_shadow_ops(buffer, rows, origin, length, geom)


def _pair_geometry(kv: mx.array, head_major: bool) -> RowGeometry:
    geom = buffer_geometry(kv, head_major, "kv")
    if kv.ndim < 5 or kv.shape[0] != 2:
        raise ValueError(
            f"kv must stack K and V on a leading axis of 2, got shape {tuple(kv.shape)}"
        )
    return geom


@functools.lru_cache(maxsize=256)
def _half_geometry(geom: RowGeometry) -> RowGeometry:
    """Geometry of one half (K or V) of a stacked ``(2, ...)`` buffer."""
    return RowGeometry(geom.shape[1:], geom.head_major, geom.dtype)


def _stage_shadow_kv_ops(
    kv: mx.array,
    keys: mx.array,
    values: mx.array,
    origin: int,
    length: int,
    geom: RowGeometry,
) -> tuple[mx.array, mx.array]:
    block = mx.stack([keys, values])
    return _stage_shadow_ops(kv, block, origin, length, geom), block


def _stage_shadow_kv_kernel(
    kv: mx.array,
    keys: mx.array,
    values: mx.array,
    origin: int,
    length: int,
    geom: RowGeometry,
) -> tuple[mx.array, mx.array]:
    count = keys.shape[geom.row_axis - 1]  # keys lack kv's leading axis of 2
    word = word_dtype(geom)
    words = words_per_row(geom, word)
    span = length + count
    total = geom.outer * span * words
    check_launch_size(total, "stage_shadow_kv")
    half = _half_geometry(geom)
    scalars = params(total, geom.outer, geom.capacity, words, length, count, origin)
    shadow, block = backend.launch(
        STAGE_SHADOW_KV,
        [
            as_words(kv, geom, word),
            as_words(keys, half, word),
            as_words(values, half, word),
            scalars,
        ],
        [(geom.outer, span, words), (geom.outer, count, words)],
        word,
        total,
    )
    return from_words(shadow, geom, span), from_words(block, geom, count)


def stage_shadow_kv(
    kv: mx.array,
    keys: mx.array,
    values: mx.array,
    origin_physical: int,
    length: int,
    *,
    head_major: bool = True,
    use_kernel: Optional[bool] = None,
) -> tuple[mx.array, mx.array]:
    """Staging shadow of a stacked K/V ring, from the chunk's separate keys and values.

    Equal to ``stage_shadow(kv, mx.stack([keys, values]), origin_physical,
    length)`` together with that stacked chunk, in one launch with the kernel
    (the reference stacks, then concatenates the ring's live runs and the block).

    Shapes: kv ``(2, B, H, C, D)`` / ``(2, B, C, H, D)``; keys and values
    ``(B, H, S, D)`` / ``(B, S, H, D)``; returns the shadow ``(2, B, H, length
    + S, D)`` / ``(2, B, length + S, H, D)`` and the block ``(2, B, H, S, D)`` /
    ``(2, B, S, H, D)``.

    Args:
        kv: The ring's K and V buffers stacked on a leading axis of 2.
        keys: The chunk's keys (same layout and dtype, any ``S``).
        values: The chunk's values.
        origin_physical: Physical row of logical row 0, ``0 <= origin < C``.
        length: Live rows, ``0 <= length <= C``.
        head_major: Layout.
        use_kernel: As for :func:`stage_shadow`.

    Returns:
        ``(shadow, block)``: the shadow and the chunk stacked as ``(2, ...)``.

    Raises:
        ValueError: On a shape/dtype mismatch or an origin/length out of range.
    """
    geom = _pair_geometry(kv, head_major)
    half = _half_geometry(geom)
    count = block_rows(half, keys, "keys")
    if block_rows(half, values, "values") != count:
        raise ValueError(
            f"keys {tuple(keys.shape)} and values {tuple(values.shape)} differ"
        )
    origin = check_ring_index(origin_physical, geom.capacity, "origin_physical")
    length = _check_length(length, geom.capacity)
    if (
        use_kernel_path(use_kernel, auto=backend.shadow_kernel_by_default())
        and length
        and count
    ):
        return _stage_shadow_kv_kernel(kv, keys, values, origin, length, geom)
    return _stage_shadow_kv_ops(kv, keys, values, origin, length, geom)


@dataclass(frozen=True)
class ShadowStager:
    """:func:`stage_shadow` for one ring geometry, checked once, called per chunk.

    The cache builds one per ring buffer; each call then skips the argument
    checks of :func:`stage_shadow` (the cache guarantees them: ``rows`` in the
    buffer's layout and dtype, ``0 <= origin < C``, ``0 <= length <= C``) and
    runs the same kernel or reference body.

    Attributes:
        geom: Geometry of the ring buffers this stager serves.
        use_kernel: As for :func:`stage_shadow` (resolved per call, so
            ``DFLASH_KERNELS`` and the default device are honoured).
    """

    geom: RowGeometry
    use_kernel: Optional[bool] = None

    @classmethod
    def for_buffer(
        cls,
        buffer: mx.array,
        *,
        head_major: bool = True,
        use_kernel: Optional[bool] = None,
    ) -> "ShadowStager":
        """Validate ``buffer`` once and build its stager.

        Args:
            buffer: A ring buffer ``(..., H, C, D)`` / ``(..., C, H, D)``.
            head_major: Layout of the buffer.
            use_kernel: Kernel switch of every call.

        Returns:
            The stager.
        """
        geom = buffer_geometry(buffer, head_major, "buffer")
        word_dtype(geom)  # refuses rows that are not whole 2-byte words
        return cls(geom, use_kernel)

    def serves(self, buffer: mx.array) -> bool:
        """Whether ``buffer`` has this stager's shape and dtype."""
        return (
            tuple(buffer.shape) == self.geom.shape and buffer.dtype == self.geom.dtype
        )

    def __call__(
        self, buffer: mx.array, rows: mx.array, origin_physical: int, length: int
    ) -> mx.array:
        """The shadow: ``length`` live rows from ``origin_physical`` on, then ``rows``.

        Shapes: buffer as ``geom``; rows ``(..., H, S, D)`` / ``(..., S, H, D)``;
        returns the same with ``length + S`` rows.
        """
        if use_kernel_path(self.use_kernel, auto=backend.shadow_kernel_by_default()):
            return _stage_shadow_kernel(
                buffer, rows, origin_physical, length, self.geom
            )
        return _stage_shadow_ops(buffer, rows, origin_physical, length, self.geom)

    def pair(
        self,
        kv: mx.array,
        keys: mx.array,
        values: mx.array,
        origin_physical: int,
        length: int,
    ) -> tuple[mx.array, mx.array]:
        """:func:`stage_shadow_kv` for a stacked ``(2, ...)`` ring of this geometry.

        Shapes: kv as ``geom``; keys, values ``(B, H, S, D)`` / ``(B, S, H, D)``;
        returns the shadow with ``length + S`` rows and the stacked block.
        """
        if length and use_kernel_path(
            self.use_kernel, auto=backend.shadow_kernel_by_default()
        ):
            return _stage_shadow_kv_kernel(
                kv, keys, values, origin_physical, length, self.geom
            )
        return _stage_shadow_kv_ops(
            kv, keys, values, origin_physical, length, self.geom
        )
