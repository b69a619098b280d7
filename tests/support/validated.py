"""Argument-checking forms of the kernel entries, for tests that call them on their own.

:func:`dflash.metal.ring_write` and :class:`dflash.metal.ShadowStager` trust their
arguments: the cache guarantees them on its hot path. The wrappers here check every
argument first (``ValueError`` naming the problem), then call those same entries with
the same ``use_kernel`` switch, so a test can drive each operation at any geometry,
layout and wrap position, and assert the refusals.
"""

from __future__ import annotations

from typing import Optional

import mlx.core as mx
import numpy as np

from dflash.metal import ShadowStager, backend, ring_write
from dflash.metal.layout import RowGeometry, buffer_geometry, layout_name


def block_rows(geom: RowGeometry, block: mx.array, name: str) -> int:
    """Validate a block of rows against a buffer geometry.

    Shapes: block as the buffer of ``geom``, any row count.

    Args:
        geom: Geometry of the buffer the block belongs to.
        block: Rows in the same layout.
        name: Argument name used in error messages.

    Returns:
        The block's row count.

    Raises:
        ValueError: On a dtype, rank or non-row dim mismatch.
    """
    if not isinstance(block, mx.array):
        raise ValueError(f"{name} must be an mx.array, got {type(block).__name__}")
    if block.dtype != geom.dtype:
        raise ValueError(f"{name} dtype {block.dtype} != buffer dtype {geom.dtype}")
    if block.ndim != len(geom.shape):
        raise ValueError(
            f"{name} must have {len(geom.shape)} dims like the buffer, "
            f"got shape {tuple(block.shape)}"
        )
    count = block.shape[geom.row_axis]
    if tuple(block.shape) != geom.with_rows(count):
        raise ValueError(
            f"{name} shape {tuple(block.shape)} does not match buffer shape "
            f"{geom.shape} outside the row axis {geom.row_axis} "
            f"({layout_name(geom.head_major)})"
        )
    return count


def check_row_count(
    value: int, capacity: int, name: str, *, inclusive: bool = False
) -> int:
    """Validate an integer ``0 <= value < capacity`` (``<= capacity`` if ``inclusive``).

    A physical row index lies in ``[0, C)``, a count of live rows in ``[0, C]``.

    Args:
        value: The index or count.
        capacity: Ring capacity ``C``.
        name: Argument name used in error messages.
        inclusive: Whether ``capacity`` itself is allowed.

    Returns:
        The value as a Python int.

    Raises:
        ValueError: If it is not an integer in range.
    """
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise ValueError(f"{name} must be an int, got {type(value).__name__}")
    if not 0 <= int(value) < capacity + inclusive:
        bracket = "]" if inclusive else ")"
        raise ValueError(f"{name}={int(value)} outside [0, {capacity}{bracket}")
    return int(value)


def checked_ring_write(
    buffer: mx.array,
    rows: mx.array,
    dest_start: int,
    *,
    head_major: bool = True,
    use_kernel: Optional[bool] = None,
) -> mx.array:
    """:func:`dflash.metal.ring_write` with every argument checked first.

    Row ``i`` of ``rows`` lands at physical row ``(dest_start + i) % C``.

    Shapes: buffer ``(B, H, C, D)`` / ``(B, C, H, D)``; rows ``(B, H, S, D)`` /
    ``(B, S, H, D)`` with ``S <= C``; returns the buffer's shape.

    Args:
        buffer: The ring buffer (float16, bfloat16 or float32).
        rows: ``S`` rows in the same layout and dtype.
        dest_start: Physical row of the first written row, ``0 <= dest_start < C``.
        head_major: Layout of ``buffer`` and ``rows``.
        use_kernel: As for :func:`dflash.metal.ring_write`.

    Returns:
        The updated buffer (``buffer`` itself when ``S = 0``).

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
    start = check_row_count(dest_start, geom.capacity, "dest_start")
    if count == 0:
        return buffer
    return ring_write(buffer, rows, start, geom.row_axis, use_kernel=use_kernel)


def checked_stage_shadow(
    buffer: mx.array,
    rows: mx.array,
    origin_physical: int,
    length: int,
    *,
    head_major: bool = True,
    use_kernel: Optional[bool] = None,
) -> mx.array:
    """The staging shadow (:class:`dflash.metal.ShadowStager`), arguments checked first.

    Shapes: buffer ``(B, H, C, D)`` / ``(B, C, H, D)``; rows ``(B, H, S, D)`` /
    ``(B, S, H, D)`` (any ``S``, a prefill chunk may be wider than the window);
    returns ``(B, H, length + S, D)`` / ``(B, length + S, H, D)``.

    Args:
        buffer: The ring buffer (float16, bfloat16 or float32).
        rows: The chunk's rows in the same layout and dtype.
        origin_physical: Physical row of logical row 0, ``0 <= origin < C``.
        length: Live rows, ``0 <= length <= C``.
        head_major: Layout of ``buffer`` and ``rows``.
        use_kernel: As for :class:`dflash.metal.ShadowStager`.

    Returns:
        A new array holding the shadow.

    Raises:
        ValueError: On a shape/dtype mismatch or an origin/length out of range.
    """
    geom = buffer_geometry(buffer, head_major, "buffer")
    count = block_rows(geom, rows, "rows")
    origin = check_row_count(origin_physical, geom.capacity, "origin_physical")
    length = check_row_count(length, geom.capacity, "length", inclusive=True)
    if length + count == 0:
        return mx.zeros(geom.with_rows(0), dtype=geom.dtype)
    return ShadowStager(geom, use_kernel)(buffer, rows, origin, length)


def checked_stage_shadow_kv(
    kv: mx.array,
    keys: mx.array,
    values: mx.array,
    origin_physical: int,
    length: int,
    *,
    head_major: bool = True,
    use_kernel: Optional[bool] = None,
) -> tuple[mx.array, mx.array]:
    """:meth:`dflash.metal.ShadowStager.pair`, arguments checked first.

    Equal to ``checked_stage_shadow(kv, mx.stack([keys, values]), origin_physical,
    length)`` together with that stacked chunk. An empty chunk or no live rows
    takes the reference form (nothing for the kernel to fuse).

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
        use_kernel: As for :class:`dflash.metal.ShadowStager`.

    Returns:
        ``(shadow, block)``: the shadow and the chunk stacked as ``(2, ...)``.

    Raises:
        ValueError: On a shape/dtype mismatch or an origin/length out of range.
    """
    geom = buffer_geometry(kv, head_major, "kv")
    if kv.ndim < 5 or kv.shape[0] != 2:
        raise ValueError(
            f"kv must stack K and V on a leading axis of 2, got shape {tuple(kv.shape)}"
        )
    half = RowGeometry(geom.shape[1:], geom.head_major, geom.dtype)
    count = block_rows(half, keys, "keys")
    if block_rows(half, values, "values") != count:
        raise ValueError(
            f"keys {tuple(keys.shape)} and values {tuple(values.shape)} differ"
        )
    origin = check_row_count(origin_physical, geom.capacity, "origin_physical")
    length = check_row_count(length, geom.capacity, "length", inclusive=True)
    kernel = backend.use_kernel_path(use_kernel, backend.shadow_kernel_by_default())
    stager = ShadowStager(geom, use_kernel=kernel and count > 0)
    return stager.pair(kv, keys, values, origin, length)
