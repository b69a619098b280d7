"""Retain / restore of block rows across many ring planes at once.

Before a verify block overwrites live ring rows, :func:`retain_rows` gathers the
rows it will overwrite from every plane passed (K and V of every sliding layer
may go together) into one ``(P, ...)`` block; :func:`restore_rows` puts chosen
rows of such a block back. ``dflash.cache.checkpoint`` decides when.

Default paths (``use_kernel=None``) on a GPU: retain is the custom kernel (one
launch for all planes on CUDA; on Metal one per 28 planes, the most a launch
can bind); restore is one mlx scatter per plane, which runs in place when mlx
can donate the plane buffer, so it moves only the restored rows. The restore
kernel (one launch, but a fresh ``C``-row output per plane) runs with
``use_kernel=True``; ``docs/metal.md`` has the numbers.
"""

from __future__ import annotations

from typing import Optional, Sequence

import mlx.core as mx

from . import backend, first_use
from .backend import max_planes, params, use_kernel_path
from .layout import (
    RowGeometry,
    as_words,
    check_dests,
    check_launch_size,
    from_words,
    plane_geometry,
    word_dtype,
    words_per_row,
)
from .sources import restore_spec, retain_spec


def _chunks(count: int, size: int) -> list[tuple[int, int]]:
    return [(lo, min(lo + size, count)) for lo in range(0, count, size)]


def _block_shape(planes: int, geom: RowGeometry, n: int) -> tuple[int, ...]:
    return (planes,) + geom.with_rows(n)


# -------------------------------------------------------------------- retain


def _plane(x: mx.array, p: int) -> mx.array:
    # A slice + squeeze is a view; integer indexing would launch a gather.
    return mx.squeeze(x[p : p + 1], axis=0)


def _retain_rows_ops(
    buffers: Sequence[mx.array], dests: mx.array, geom: RowGeometry
) -> mx.array:
    gathered = [
        mx.take(buffer, _plane(dests, p), axis=geom.row_axis)
        for p, buffer in enumerate(buffers)
    ]
    return mx.stack(gathered)


def _retain_rows_kernel(
    buffers: Sequence[mx.array], dests: mx.array, geom: RowGeometry
) -> mx.array:
    n = dests.shape[1]
    word = word_dtype(geom)
    words = words_per_row(geom, word)
    parts = []
    for lo, hi in _chunks(len(buffers), max_planes("retain")):
        planes = hi - lo
        total = planes * geom.outer * n * words
        check_launch_size(total, "retain_rows")
        inputs = [as_words(b, geom, word) for b in buffers[lo:hi]]
        inputs += [dests[lo:hi], params(total, geom.outer, geom.capacity, words, n)]
        (out,) = backend.launch(
            retain_spec(planes), inputs, [(planes, geom.outer, n, words)], word, total
        )
        parts.append(out)
    block = parts[0] if len(parts) == 1 else mx.concatenate(parts, axis=0)
    return block.view(geom.dtype).reshape(_block_shape(len(buffers), geom, n))


def retain_rows(
    buffers: Sequence[mx.array],
    dests: mx.array,
    *,
    head_major: bool = True,
    use_kernel: Optional[bool] = None,
) -> mx.array:
    """Gather the rows a block will overwrite from every plane into one block.

    Shapes: each buffer ``(B, H, C, D)`` / ``(B, C, H, D)`` (all alike); dests
    ``(P, n)``; returns ``(P, B, H, n, D)`` / ``(P, B, n, H, D)``.

    Args:
        buffers: ``P`` plane buffers sharing shape and dtype.
        dests: int32 physical rows per plane, each in ``[0, C)`` and distinct
            within a plane. Read on the host for validation.
        head_major: Layout of the buffers.
        use_kernel: None (default) picks the custom kernel on a GPU (one launch
            for all planes on CUDA, ``ceil(P / 28)`` on Metal) and ``P`` gathers
            plus a stack elsewhere; True / False force one form.

    Returns:
        The retained rows, plane by plane, in ``dests`` order.

    Raises:
        ValueError: On mismatched planes, a bad ``dests`` shape/dtype, an index
            outside ``[0, C)`` or a row repeated within a plane.
    """
    geom = plane_geometry(buffers, head_major, "buffers")
    check_dests(dests, len(buffers), geom.capacity, "dests")
    n = dests.shape[1]
    if n == 0:
        return mx.zeros(_block_shape(len(buffers), geom, 0), dtype=geom.dtype)
    if use_kernel_path(use_kernel, auto=True):
        return first_use.kernel_form(
            use_kernel,
            ("retain_rows", word_dtype(geom), len(buffers)),
            _retain_rows_kernel,
            _retain_rows_ops,
            (list(buffers), dests, geom),
        )
    return _retain_rows_ops(buffers, dests, geom)


# ------------------------------------------------------------------- restore


def _restore_rows_ops(
    buffers: Sequence[mx.array], dests: mx.array, rows: mx.array, geom: RowGeometry
) -> list[mx.array]:
    n = dests.shape[1]
    return [
        mx.put_along_axis(
            buffer,
            _plane(dests, p).reshape(geom.index_shape(n)),
            _plane(rows, p),
            axis=geom.row_axis,
        )
        for p, buffer in enumerate(buffers)
    ]


def _restore_rows_kernel(
    buffers: Sequence[mx.array], dests: mx.array, rows: mx.array, geom: RowGeometry
) -> list[mx.array]:
    n = dests.shape[1]
    word = word_dtype(geom)
    words = words_per_row(geom, word)
    restored: list[mx.array] = []
    for lo, hi in _chunks(len(buffers), max_planes("restore")):
        planes = hi - lo
        total = planes * geom.outer * geom.capacity * words
        check_launch_size(total, "restore_rows")
        # ``rows`` is usually a slice of a retained block along n (the rejected
        # tail): make the copy explicit (a no-op when already contiguous).
        block = mx.contiguous(rows[lo:hi])
        block = block.reshape(planes, geom.outer, n, geom.width).view(word)
        inputs = [as_words(b, geom, word) for b in buffers[lo:hi]]
        inputs += [
            dests[lo:hi],
            block,
            params(total, geom.outer, geom.capacity, words, n),
        ]
        shapes = [(geom.outer, geom.capacity, words)] * planes
        outs = backend.launch(restore_spec(planes), inputs, shapes, word, total)
        restored += [from_words(out, geom, geom.capacity) for out in outs]
    return restored


def restore_rows(
    buffers: Sequence[mx.array],
    dests: mx.array,
    rows: mx.array,
    *,
    head_major: bool = True,
    use_kernel: Optional[bool] = None,
) -> list[mx.array]:
    """Put retained rows back at their physical rows in every plane.

    Shapes: each buffer ``(B, H, C, D)`` / ``(B, C, H, D)`` (all alike); dests
    ``(P, n)``; rows ``(P, B, H, n, D)`` / ``(P, B, n, H, D)`` (as returned by
    :func:`retain_rows`, possibly sliced along ``n``); returns ``P`` buffers.

    Args:
        buffers: ``P`` plane buffers sharing shape and dtype.
        dests: int32 physical rows per plane, each in ``[0, C)`` and distinct
            within a plane. Read on the host for validation.
        rows: The rows to put back, ``rows[p][..., j, ...]`` at ``dests[p, j]``.
        head_major: Layout of the buffers and rows.
        use_kernel: None (default) picks one mlx scatter per plane, in place
            when the caller drops its references to the old buffers before they
            are evaluated (``n`` rows moved per plane); True forces the custom
            kernel (one launch, fresh ``C``-row outputs); False forces the
            scatters.

    Returns:
        The restored buffers, in order. The inputs are not modified.

    Raises:
        ValueError: On mismatched planes, a bad ``dests`` or ``rows`` shape or
            dtype, an index outside ``[0, C)`` or a row repeated within a plane.
    """
    geom = plane_geometry(buffers, head_major, "buffers")
    check_dests(dests, len(buffers), geom.capacity, "dests")
    n = dests.shape[1]
    expected = _block_shape(len(buffers), geom, n)
    if not isinstance(rows, mx.array):
        raise ValueError(f"rows must be an mx.array, got {type(rows).__name__}")
    if rows.dtype != geom.dtype or tuple(rows.shape) != expected:
        raise ValueError(
            f"rows must be {expected} {geom.dtype}, "
            f"got {tuple(rows.shape)} {rows.dtype}"
        )
    if n == 0:
        return list(buffers)
    if use_kernel_path(use_kernel, auto=False):
        return _restore_rows_kernel(list(buffers), dests, rows, geom)
    return _restore_rows_ops(buffers, dests, rows, geom)
