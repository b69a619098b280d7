"""Ring store with wrap and the staging shadow.

Two operations on a ring buffer (rows on one axis, head-major ``(..., H, C, D)``
or token-major ``(..., C, H, D)``), each with a custom-kernel form and a pure-MLX
reference beside it:

* :func:`ring_write` stores ``S <= C`` rows at physical ``(dest_start + i) % C``;
* :class:`ShadowStager` builds the staging shadow: the live rows un-rotated into
  logical order followed by a chunk's rows, the contiguous span staged attention
  reads. Its :meth:`~ShadowStager.pair` does the same for a ring whose K and V
  are stacked in one ``(2, ...)`` buffer, taking the chunk's keys and values as
  the model hands them over and also returning them stacked (the block a
  checkpoint holds back), so a staged layer costs one launch with the kernel.

Both are prevalidated: the cache calls them on its hot path and guarantees their
arguments (the stager checks its ring geometry once). Defaults
(``use_kernel=None``): the store is one mlx op (a slice update, or one scatter
over a memoised wrapped index when the rows cross the seam; in place when mlx
can donate the buffer, so it moves ``S`` rows, not ``C``); the shadow's default
per backend is :data:`dflash.metal.backend.SHADOW_KERNEL_BY_DEFAULT` (the module
docstring of :mod:`dflash.metal.backend` gives the measurement).
``docs/metal.md`` has the byte counts behind these choices.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Callable, Optional

import mlx.core as mx
import numpy as np

from . import backend, first_use
from .backend import kernel_for, params, use_kernel_path
from .layout import (
    RowGeometry,
    as_words,
    buffer_geometry,
    check_launch_size,
    from_words,
    word_dtype,
    words_per_row,
)
from .sources import RING_WRITE, STAGE_SHADOW, STAGE_SHADOW_KV

# Built once at import (None without a GPU backend).
kernel_for(RING_WRITE)
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
    buffer: mx.array,
    rows: mx.array,
    dest_start: int,
    axis: int,
    *,
    use_kernel: Optional[bool] = None,
) -> mx.array:
    """Store rows at physical ``(dest_start + i) % C``: one launch, never split at the seam.

    Prevalidated: the caller guarantees that ``rows`` matches ``buffer`` off
    ``axis`` in shape and dtype, ``S <= C`` and ``0 <= dest_start < C``.

    Shapes: buffer ``(..., C, ...)`` with rows on ``axis``; rows the same with
    ``S`` rows; returns the buffer's shape.

    Args:
        buffer: Ring (or growing) buffer.
        rows: Rows to store.
        dest_start: Physical row of ``rows``' first row.
        axis: Row axis (non-negative).
        use_kernel: None (default) and False run the mlx op: a slice update when
            the rows do not cross the seam, else one scatter over a memoised
            wrapped index; either runs in place when mlx can donate ``buffer``
            (no other reference to it is alive when the op is evaluated). True
            launches the custom kernel, which writes a fresh ``C``-row buffer
            and needs the row axis at ``-2`` (head-major) or ``-3``
            (token-major).

    Returns:
        The updated buffer; the ``buffer`` object itself is left as it was.

    Raises:
        RuntimeError: ``use_kernel=True`` without Metal or CUDA.
        ValueError: ``use_kernel=True`` with the row axis elsewhere.
    """
    if use_kernel_path(use_kernel, auto=False):
        geom = _axis_geometry(tuple(buffer.shape), axis, buffer.dtype)
        return _ring_write_kernel(buffer, rows, dest_start, geom)
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


@functools.lru_cache(maxsize=256)
def _axis_geometry(shape: tuple[int, ...], axis: int, dtype: mx.Dtype) -> RowGeometry:
    geom = RowGeometry(shape, axis == len(shape) - 2, dtype)
    if geom.row_axis != axis:
        raise ValueError(
            f"the ring_write kernel needs rows on axis -2 (head-major) or -3 "
            f"(token-major), got axis {axis} of shape {shape}"
        )
    return geom


def _ring_write_kernel(
    buffer: mx.array, rows: mx.array, start: int, geom: RowGeometry
) -> mx.array:
    count = rows.shape[geom.row_axis]
    word = word_dtype(geom)
    words = words_per_row(geom, word)
    total = geom.outer * geom.capacity * words
    check_launch_size(total, "ring_write")
    scalars = params(total, geom.outer, geom.capacity, words, count, start)
    (out,) = backend.launch(
        RING_WRITE,
        [as_words(buffer, geom, word), as_words(rows, geom, word), scalars],
        [(geom.outer, geom.capacity, words)],
        word,
        total,
    )
    return from_words(out, geom, geom.capacity)


# -------------------------------------------------------------------- shadow


def _shadow_ops(
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


def _shadow_kernel(
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


@functools.lru_cache(maxsize=256)
def _half_geometry(geom: RowGeometry) -> RowGeometry:
    """Geometry of one half (K or V) of a stacked ``(2, ...)`` buffer."""
    return RowGeometry(geom.shape[1:], geom.head_major, geom.dtype)


def _shadow_kv_ops(
    kv: mx.array,
    keys: mx.array,
    values: mx.array,
    origin: int,
    length: int,
    geom: RowGeometry,
) -> tuple[mx.array, mx.array]:
    block = mx.stack([keys, values])
    return _shadow_ops(kv, block, origin, length, geom), block


def _shadow_kv_kernel(
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


@dataclass(frozen=True)
class ShadowStager:
    """The staging shadow for one ring geometry, checked once, called per chunk.

    Logical row ``k < length`` of a ring lives at physical ``(origin + k) % C``;
    the shadow holds those rows in order followed by the chunk's ``S`` rows, so
    staged attention reads one contiguous span before the chunk overwrites
    anything. The cache builds one stager per ring buffer; each call trusts its
    arguments (``rows`` in the buffer's layout and dtype, ``0 <= origin < C``,
    ``0 <= length <= C``).

    Attributes:
        geom: Geometry of the ring buffers this stager serves.
        use_kernel: None (default) picks per backend
            (:data:`dflash.metal.backend.SHADOW_KERNEL_BY_DEFAULT`), and the
            reference on the CPU; True / False force the kernel / the reference.
            Resolved per call, so ``DFLASH_KERNELS`` and the default device are
            honoured.
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

        Shapes: buffer ``(..., H, C, D)`` / ``(..., C, H, D)``.

        Args:
            buffer: A ring buffer.
            head_major: Layout of the buffer.
            use_kernel: Kernel switch of every call.

        Returns:
            The stager.

        Raises:
            ValueError: If the buffer is not a float16/bfloat16/float32 array
                of at least 4 non-empty dims.
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

        Args:
            buffer: The ring buffer.
            rows: The chunk's rows.
            origin_physical: Physical row of logical row 0.
            length: Live rows.

        Returns:
            A new array holding the shadow.
        """
        arguments = (buffer, rows, origin_physical, length, self.geom)
        return self._staged("stage_shadow", _shadow_kernel, _shadow_ops, arguments)

    def pair(
        self,
        kv: mx.array,
        keys: mx.array,
        values: mx.array,
        origin_physical: int,
        length: int,
    ) -> tuple[mx.array, mx.array]:
        """The shadow of a stacked ``(2, ...)`` K/V ring, from the chunk's keys and values.

        Equal to ``self(kv, mx.stack([keys, values]), origin_physical, length)``
        together with that stacked chunk, in one launch with the kernel (the
        reference stacks, then concatenates the ring's live runs and the block).

        Shapes: kv ``(2, B, H, C, D)`` / ``(2, B, C, H, D)`` as ``geom``; keys and
        values ``(B, H, S, D)`` / ``(B, S, H, D)``; returns the shadow with
        ``length + S`` rows and the block ``(2, B, H, S, D)`` / ``(2, B, S, H, D)``.

        Args:
            kv: The ring's K and V buffers stacked on a leading axis of 2.
            keys: The chunk's keys.
            values: The chunk's values.
            origin_physical: Physical row of logical row 0.
            length: Live rows.

        Returns:
            ``(shadow, block)``: the shadow and the chunk stacked as ``(2, ...)``.
        """
        arguments = (kv, keys, values, origin_physical, length, self.geom)
        if not length:  # the block alone: no live rows to un-rotate
            return _shadow_kv_ops(*arguments)
        return self._staged(
            "stage_shadow_kv", _shadow_kv_kernel, _shadow_kv_ops, arguments
        )

    def _staged(
        self, name: str, kernel: Callable, reference: Callable, arguments: tuple
    ) -> Any:
        """``kernel(*arguments)`` where this stager's switch takes the kernel (checked
        at its first default use: :mod:`.first_use`), else ``reference(*arguments)``."""
        if not use_kernel_path(
            self.use_kernel, auto=backend.shadow_kernel_by_default()
        ):
            return reference(*arguments)
        return first_use.kernel_form(
            self.use_kernel, (name, word_dtype(self.geom)), kernel, reference, arguments
        )
