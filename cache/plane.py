"""KV planes: one layer's K/V buffers plus explicit ring bookkeeping.

A plane is either a **ring** (sliding-window layers: fixed capacity ``min(window, max_context)``,
rotation kept as state in ``origin_physical``) or **growing** (full / NoPE layers: storage grows in
chunks, ``origin_logical`` and ``origin_physical`` stay 0 and the ring arithmetic switches itself
off). Physical placement is never derived from an absolute position.

Layouts: head-major buffers are ``(B, H, capacity, D)`` (mlx-lm's layout); token-major buffers are
``(B, capacity, H, D)``. One *row* is one token position across all heads.
"""

from dataclasses import dataclass
from typing import Optional, Tuple

import mlx.core as mx

from .errors import CacheDiscontinuity, CacheError, ContextOverflow

GROWTH_STEP = 256


def row_axis(head_major: bool) -> int:
    """Axis of the token rows: 2 for ``(B, H, T, D)``, 1 for ``(B, T, H, D)``."""
    return 2 if head_major else 1


def take_rows(buffer: mx.array, rows, head_major: bool) -> mx.array:
    """Rows of ``buffer`` at ``rows`` (a slice or an index array), in that order."""
    if head_major:
        return buffer[:, :, rows, :]
    return buffer[:, rows]


def put_rows(buffer: mx.array, rows, values: mx.array, head_major: bool) -> None:
    """Write ``values`` into ``buffer`` at ``rows`` (a slice or an index array), in place."""
    if head_major:
        buffer[:, :, rows, :] = values
    else:
        buffer[:, rows] = values


def ring_indices(origin_physical: int, first_logical: int, count: int, capacity: int):
    """Physical rows of logical rows ``first_logical .. first_logical + count - 1``.

    Returns a slice when the rows do not cross the seam, else an ``int32`` index array.
    """
    first = (origin_physical + first_logical) % capacity
    if first + count <= capacity:
        return slice(first, first + count)
    return (mx.arange(first, first + count, dtype=mx.int32) % capacity).astype(mx.int32)


@dataclass(frozen=True)
class PlaneMeta:
    """The bookkeeping of a plane: everything but the buffers."""

    capacity: int
    len: int
    origin_logical: int
    origin_physical: int


class KvPlane:
    """One layer's K/V storage with explicit origins.

    Args:
        window: Sliding window of the layer (``None`` for a growing plane).
        max_context: Largest absolute position + 1 the plane accepts (``None``: unbounded).
        head_major: ``True`` for ``(B, H, T, D)`` buffers, ``False`` for ``(B, T, H, D)``.
        layer: Layer index, used in error messages.
    """

    def __init__(
        self,
        window: Optional[int] = None,
        max_context: Optional[int] = None,
        head_major: bool = True,
        layer: Optional[int] = None,
    ):
        if window is not None and window < 1:
            raise CacheError(f"sliding window must be >= 1, got {window}")
        if max_context is not None and max_context < 1:
            raise CacheError(f"max_context must be >= 1, got {max_context}")
        self.window = window
        self.max_context = max_context
        self.head_major = head_major
        self.layer = layer
        if window is not None:
            self.capacity = window if max_context is None else min(window, max_context)
        else:
            self.capacity = 0
        self.len = 0
        self.origin_logical = 0
        self.origin_physical = 0
        self.keys: Optional[mx.array] = None
        self.values: Optional[mx.array] = None
        # Set by a SpeculativeCheckpoint while a verify block is in flight.
        self.speculation = None

    # ----------------------------------------------------------------- bookkeeping
    @property
    def is_ring(self) -> bool:
        return self.window is not None

    @property
    def offset(self) -> int:
        """Absolute position of the next row (``origin_logical + len``)."""
        return self.origin_logical + self.len

    @property
    def meta(self) -> PlaneMeta:
        return PlaneMeta(self.capacity, self.len, self.origin_logical, self.origin_physical)

    def set_meta(self, meta: PlaneMeta) -> None:
        self.capacity = meta.capacity
        self.len = meta.len
        self.origin_logical = meta.origin_logical
        self.origin_physical = meta.origin_physical

    def check_continuity(self, start: int, count: int) -> None:
        """Raise before any change if a write of ``count`` rows at ``start`` is refused."""
        if start != self.offset:
            raise CacheDiscontinuity(self.layer, self.offset, start)
        if count < 0:
            raise CacheError(f"cannot write a negative number of rows ({count})")
        if self.max_context is not None and start + count > self.max_context:
            raise ContextOverflow(
                f"KV cache for layer {self.layer}: writing {count} rows at position "
                f"{start} exceeds max_context {self.max_context}"
            )

    def append_batch(self, start: int, count: int) -> Tuple[int, int]:
        """Reserve ``count`` rows starting at logical position ``start``.

        Only the bookkeeping changes; the caller stores the rows. A growing plane just grows
        ``len`` (its storage must already hold ``len + count`` rows). A ring that overflows
        advances both origins by the overflow and saturates ``len``.

        Args:
            start: Absolute position of the chunk's first row; must equal ``offset``.
            count: Number of rows in the chunk.

        Returns:
            ``(source_first, source_count)``: which rows of the chunk are still inside the
            window (all of them unless the chunk is wider than the ring).
        """
        self.check_continuity(start, count)
        total = self.len + count
        if not self.is_ring:
            if total > self.capacity:
                raise CacheError(
                    f"growing plane of layer {self.layer} holds {self.capacity} rows; "
                    f"reserve storage before appending {count} rows"
                )
            self.len = total
            return 0, count
        if total <= self.capacity:
            self.len = total
        else:
            overflow = total - self.capacity
            self.origin_logical += overflow
            self.origin_physical = (self.origin_physical + overflow) % self.capacity
            self.len = self.capacity
        source_first = max(0, self.origin_logical - start)
        return source_first, count - source_first

    # ----------------------------------------------------------------- storage
    def _check_rows(self, keys: mx.array, values: mx.array) -> int:
        """Validate a chunk against the plane's layout; return its row count."""
        axis = row_axis(self.head_major)
        if keys.ndim != 4 or values.ndim != 4:
            raise CacheError(
                f"layer {self.layer}: keys and values must be 4-D, got {keys.shape} "
                f"and {values.shape}"
            )
        count = keys.shape[axis]
        if values.shape[axis] != count:
            raise CacheError(
                f"layer {self.layer}: keys hold {count} rows but values hold "
                f"{values.shape[axis]}"
            )
        if self.keys is not None:
            for name, new, old in (("keys", keys, self.keys), ("values", values, self.values)):
                want = old.shape[:axis] + old.shape[axis + 1 :]
                got = new.shape[:axis] + new.shape[axis + 1 :]
                if want != got or new.dtype != old.dtype:
                    raise CacheError(
                        f"layer {self.layer}: {name} of shape {new.shape} ({new.dtype}) do "
                        f"not fit a cache holding rows of shape {want} ({old.dtype}); is "
                        "this prompt cache from another model?"
                    )
        return count

    def _allocate(self, keys: mx.array, values: mx.array, rows: int) -> None:
        """Make the buffers hold at least ``rows`` rows (growing) or ``capacity`` (ring)."""
        axis = row_axis(self.head_major)

        def shaped(like: mx.array, n: int) -> mx.array:
            shape = list(like.shape)
            shape[axis] = n
            return mx.zeros(shape, like.dtype)

        if self.is_ring:
            if self.keys is None:
                self.keys = shaped(keys, self.capacity)
                self.values = shaped(values, self.capacity)
            return
        if self.keys is not None and rows <= self.capacity:
            return
        steps = -(-rows // GROWTH_STEP)
        new_capacity = steps * GROWTH_STEP
        if self.max_context is not None:
            new_capacity = min(new_capacity, self.max_context)
        extra = new_capacity - self.capacity
        if self.keys is None:
            self.keys, self.values = shaped(keys, extra), shaped(values, extra)
        else:
            self.keys = mx.concatenate([self.keys, shaped(keys, extra)], axis=axis)
            self.values = mx.concatenate([self.values, shaped(values, extra)], axis=axis)
        self.capacity = new_capacity

    def write(self, start: int, keys: mx.array, values: mx.array) -> None:
        """Store a chunk of rows at logical position ``start`` (fail-closed, then write).

        Args:
            start: Absolute position of the chunk's first row; must equal ``offset``.
            keys: The chunk's keys in the plane's layout.
            values: The chunk's values in the plane's layout.

        Shapes:
            keys, values: ``(B, H, S, D)`` head-major or ``(B, S, H, D)`` token-major.
        """
        count = self._check_rows(keys, values)
        self.check_continuity(start, count)
        if self.speculation is not None:
            self.speculation.admit(self, start, keys, values)
        self._allocate(keys, values, self.len + count)
        source_first, source_count = self.append_batch(start, count)
        if source_count == 0:
            return
        first_logical = self.len - source_count
        dest = ring_indices(self.origin_physical, first_logical, source_count, self.capacity)
        if source_first:
            keys = take_rows(keys, slice(source_first, count), self.head_major)
            values = take_rows(values, slice(source_first, count), self.head_major)
        put_rows(self.keys, dest, keys, self.head_major)
        put_rows(self.values, dest, values, self.head_major)

    def logical_rows(self) -> Tuple[mx.array, mx.array]:
        """The live rows in logical (time) order.

        Returns:
            ``(keys, values)`` holding ``len`` rows, oldest first.
        """
        if self.keys is None:
            raise CacheError(f"layer {self.layer}: the plane is empty")
        rows = ring_indices(self.origin_physical, 0, self.len, max(self.capacity, 1))
        return (
            take_rows(self.keys, rows, self.head_major),
            take_rows(self.values, rows, self.head_major),
        )

    def attention_rows(self) -> Tuple[mx.array, mx.array]:
        """The rows attention reads after a write: a full ring in physical order, else logical.

        A full ring is read in place (its rows are exactly the window, whatever the order);
        anything else is the live prefix ``[0, len)`` in time order.
        """
        if self.is_ring and self.len == self.capacity:
            return self.keys, self.values
        if self.origin_physical == 0:
            rows = slice(0, self.len)
            return (
                take_rows(self.keys, rows, self.head_major),
                take_rows(self.values, rows, self.head_major),
            )
        return self.logical_rows()

    @property
    def nbytes(self) -> int:
        if self.keys is None:
            return 0
        return self.keys.nbytes + self.values.nbytes

    @property
    def row_bytes(self) -> int:
        """Bytes of one K+V row across all heads (0 while the plane is empty)."""
        if self.keys is None or self.capacity == 0:
            return 0
        return self.nbytes // self.capacity
