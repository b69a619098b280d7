"""Row layout of a KV plane buffer, argument validation and word views.

A plane buffer is head-major ``(..., H, C, D)`` (mlx-lm's layout) or token-major
``(..., C, H, D)``; one *row* is one token position across all heads. Every kernel
in this package works on the same canonical view of such a buffer,
``(A, C, E)``: ``A`` outer slices (all leading dims, and ``H`` when head-major),
``C`` rows, ``E`` contiguous elements of one row inside one outer slice (``D``
head-major, ``H * D`` token-major). Element ``(a, r, e)`` sits at flat offset
``(a * C + r) * E + e`` in both layouts, so one index formula serves both.

The kernels only copy bits, so they see the buffer reinterpreted as unsigned
words (``uint16``/``uint32``/``uint64``, the widest that divides a row): fewer
threads, wider loads, and bit-exact by construction.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Sequence

import mlx.core as mx
import numpy as np


def leading_view(array: mx.array, index: int) -> mx.array:
    """``array[index]`` (an index on the first axis) as a view.

    A lone integer index is a gather in mlx, i.e. a copy of the whole slice (a plane
    half, a block's logits) on every call; a one-wide slice squeezed is a view.
    """
    return mx.squeeze(array[index : index + 1], axis=0)


@functools.lru_cache(maxsize=1024)
def row_major_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    """Element strides of a row-contiguous array of ``shape``."""
    strides = [1] * len(shape)
    for axis in range(len(shape) - 2, -1, -1):
        strides[axis] = strides[axis + 1] * shape[axis + 1]
    return tuple(strides)


def contiguous_view(array: mx.array, shape: Sequence[int], offset: int = 0) -> mx.array:
    """``prod(shape)`` consecutive elements of ``array`` from flat element ``offset``,
    as one row-contiguous view of ``shape`` (one graph node).

    A slice then a reshape (or a squeeze) is two nodes, and every node of a forward
    is host work each time it is built, replayed and encoded (session 61). mlx
    flattens ``array`` first: nothing for a 1-D array (a launch's flat output), a
    view of a row-contiguous one, a copy of a strided one (its logical elements are
    read either way), one node more for any of more than one axis.
    """
    shape = tuple(shape)
    return mx.as_strided(array, shape, row_major_strides(shape), offset)


def stacked_halves(kv: mx.array) -> tuple[mx.array, mx.array]:
    """``kv[0]`` and ``kv[1]`` of a stacked ``(2, ...)`` array, as two graph nodes for
    both halves: the stack axis merged into the next (a view of a row-contiguous
    ``kv``, as a plane buffer or a launch's stacked output is; a copy otherwise), then
    one split. :func:`leading_view` makes two nodes a half.

    Shapes: kv ``(2, B, *S)``; returns ``(B, *S)`` twice.
    """
    shape = kv.shape
    merged = kv.reshape(2 * shape[1], *shape[2:])
    keys, values = mx.split(merged, 2)
    return keys, values


ROW_DTYPES: tuple[mx.Dtype, ...] = (mx.float16, mx.bfloat16, mx.float32)

# Kernel indices are 32-bit: one launch may touch at most this many words.
MAX_LAUNCH_WORDS = 2**31 - 1


def checked_offset(name: str, offset: object) -> int:
    """``offset`` as an element offset a kernel reads its input from: an int >= 0
    that a 32-bit index holds.

    Raises:
        ValueError: anything else, naming ``name``.
    """
    if (
        isinstance(offset, bool)
        or not isinstance(offset, (int, np.integer))
        or not 0 <= offset <= MAX_LAUNCH_WORDS
    ):
        raise ValueError(
            f"{name} must be an int >= 0 that a 32-bit index holds (at most "
            f"{MAX_LAUNCH_WORDS}), got {offset!r}"
        )
    return int(offset)


@dataclass(frozen=True)
class RowGeometry:
    """Shape of a plane buffer seen as rows.

    Attributes:
        shape: Full buffer shape.
        head_major: True for ``(..., H, C, D)``, False for ``(..., C, H, D)``.
        dtype: Element dtype.

    The derived sizes are cached on the instance: the cache's hot path launches with one
    geometry per ring, and recomputing them cost more host time than the launch itself.
    """

    shape: tuple[int, ...]
    head_major: bool
    dtype: mx.Dtype

    @functools.cached_property
    def row_axis(self) -> int:
        """Axis (non-negative) that indexes rows."""
        return len(self.shape) - (2 if self.head_major else 3)

    @functools.cached_property
    def capacity(self) -> int:
        """Number of rows ``C``."""
        return self.shape[self.row_axis]

    @functools.cached_property
    def outer(self) -> int:
        """Number of outer slices ``A`` of the canonical ``(A, C, E)`` view."""
        return int(np.prod(self.shape[: self.row_axis], dtype=np.int64))

    @functools.cached_property
    def width(self) -> int:
        """Elements ``E`` of one row inside one outer slice."""
        return int(np.prod(self.shape[self.row_axis + 1 :], dtype=np.int64))

    def with_rows(self, count: int) -> tuple[int, ...]:
        """Shape of a block of ``count`` rows in this layout."""
        shape = list(self.shape)
        shape[self.row_axis] = count
        return tuple(shape)

    def index_shape(self, count: int) -> tuple[int, ...]:
        """Shape that broadcasts ``count`` row indices along the row axis."""
        shape = [1] * len(self.shape)
        shape[self.row_axis] = count
        return tuple(shape)


def layout_name(head_major: bool) -> str:
    """The layout a ``head_major`` flag names, for error messages."""
    return "head-major (..., H, C, D)" if head_major else "token-major (..., C, H, D)"


def buffer_geometry(buffer: mx.array, head_major: bool, name: str) -> RowGeometry:
    """Validate a plane buffer and describe its rows.

    Args:
        buffer: A plane's K or V buffer.
        head_major: Layout flag.
        name: Argument name used in error messages.

    Returns:
        The buffer's row geometry.

    Raises:
        ValueError: If the buffer is not an ``mx.array`` of a supported dtype
            with at least 4 non-empty dims.
    """
    if not isinstance(buffer, mx.array):
        raise ValueError(f"{name} must be an mx.array, got {type(buffer).__name__}")
    if buffer.dtype not in ROW_DTYPES:
        raise ValueError(
            f"{name} dtype must be float16, bfloat16 or float32, got {buffer.dtype}"
        )
    if buffer.ndim < 4:
        raise ValueError(
            f"{name} must be {layout_name(head_major)} with at least 4 dims, "
            f"got shape {tuple(buffer.shape)}"
        )
    if min(buffer.shape) < 1:
        raise ValueError(f"{name} has an empty dim: shape {tuple(buffer.shape)}")
    return RowGeometry(tuple(buffer.shape), head_major, buffer.dtype)


def plane_geometry(
    buffers: Sequence[mx.array], head_major: bool, name: str
) -> RowGeometry:
    """Validate that all planes share one shape and dtype.

    Args:
        buffers: Plane buffers.
        head_major: Layout flag.
        name: Argument name used in error messages.

    Returns:
        The common geometry.

    Raises:
        ValueError: If the sequence is empty or the planes differ.
    """
    if isinstance(buffers, mx.array) or len(buffers) == 0:
        raise ValueError(f"{name} must be a non-empty sequence of mx.array planes")
    geom = buffer_geometry(buffers[0], head_major, f"{name}[0]")
    for index, buffer in enumerate(buffers[1:], start=1):
        other = buffer_geometry(buffer, head_major, f"{name}[{index}]")
        if other != geom:
            raise ValueError(
                f"{name}[{index}] is {other.shape} {other.dtype}, "
                f"but {name}[0] is {geom.shape} {geom.dtype}: all planes must match"
            )
    return geom


def check_dests(dests: mx.array, planes: int, capacity: int, name: str) -> np.ndarray:
    """Validate per-plane physical destinations.

    The values are read on the host (``dests`` is a few dozen int32s, normally
    built on the host already), so an out-of-range index is refused before any
    launch.

    Args:
        dests: ``(P, n)`` int32 physical rows, one row of ``n`` per plane.
        planes: Expected ``P``.
        capacity: Ring capacity ``C``.
        name: Argument name used in error messages.

    Returns:
        The destinations as a numpy array.

    Raises:
        ValueError: On a wrong dtype, shape, an index outside ``[0, C)`` or a
            row repeated within one plane.
    """
    if not isinstance(dests, mx.array):
        raise ValueError(f"{name} must be an mx.array, got {type(dests).__name__}")
    if dests.dtype != mx.int32:
        raise ValueError(f"{name} dtype must be int32, got {dests.dtype}")
    if dests.ndim != 2 or dests.shape[0] != planes:
        raise ValueError(
            f"{name} must have shape (P={planes}, n), got {tuple(dests.shape)}"
        )
    host = np.asarray(dests)
    if host.size and (host.min() < 0 or host.max() >= capacity):
        raise ValueError(
            f"{name} holds rows outside [0, {capacity}): "
            f"min {int(host.min())}, max {int(host.max())}"
        )
    for plane, row in enumerate(host):
        if len(np.unique(row)) != len(row):
            raise ValueError(f"{name}[{plane}] repeats a row: {row.tolist()}")
    return host


WORD_DTYPES: tuple[tuple[int, mx.Dtype], ...] = (
    (8, mx.uint64),
    (4, mx.uint32),
    (2, mx.uint16),
)


@functools.lru_cache(maxsize=256)
def word_dtype(geom: RowGeometry) -> mx.Dtype:
    """Widest unsigned word that divides one row of one outer slice."""
    slice_bytes = geom.width * geom.dtype.size
    for size, dtype in WORD_DTYPES:
        if slice_bytes % size == 0:
            return dtype
    raise ValueError(f"row of {slice_bytes} bytes is not a multiple of 2 bytes")


def words_per_row(geom: RowGeometry, word: mx.Dtype) -> int:
    """Words ``W`` in one row of one outer slice."""
    return geom.width * geom.dtype.size // word.size


def as_words(x: mx.array, geom: RowGeometry, word: mx.Dtype) -> mx.array:
    """View ``x`` (buffer-shaped, any row count) as ``(A, rows, W)`` words."""
    rows = x.shape[geom.row_axis]
    return x.reshape(geom.outer, rows, geom.width).view(word)


def from_words(words: mx.array, geom: RowGeometry, rows: int) -> mx.array:
    """Inverse of :func:`as_words`: ``(..., W)`` words back to layout rows."""
    return words.view(geom.dtype).reshape(geom.with_rows(rows))


def check_launch_size(words: int, what: str) -> None:
    """Refuse a launch whose word count overflows 32-bit kernel indices."""
    if words > MAX_LAUNCH_WORDS:
        raise ValueError(
            f"{what} would touch {words} words in one launch; "
            f"the kernels index with 32 bits (max {MAX_LAUNCH_WORDS})"
        )
