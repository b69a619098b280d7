"""KV planes: one layer's K/V buffer plus explicit ring bookkeeping.

A plane is either a **ring** (sliding-window layers: fixed capacity ``min(window, max_context)``,
rotation kept as state in ``origin_physical``) or **growing** (full / NoPE layers: storage grows in
chunks, ``origin_logical`` and ``origin_physical`` stay 0 and the ring arithmetic switches itself
off). Physical placement is never derived from an absolute position.

Layouts: head-major keys/values are ``(B, H, capacity, D)`` (mlx-lm's layout); token-major are
``(B, capacity, H, D)``. One *row* is one token position across all heads. The plane keeps K and V
stacked in one buffer ``kv`` of shape ``(2, ...)``, so storing a chunk is one launch per layer and
one staging-shadow launch builds both K and V; ``keys`` / ``values`` are views of its halves.
"""

from dataclasses import dataclass
from typing import Optional, Tuple

import mlx.core as mx

from ..metal.ring import ShadowStager, ring_write
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


def kv_half(kv: mx.array, index: int) -> mx.array:
    """``kv[index]`` as a view (an integer index would launch a gather, i.e. a copy)."""
    return mx.squeeze(kv[index : index + 1], axis=0)


def kv_halves(kv: mx.array) -> Tuple[mx.array, mx.array]:
    """The keys and values halves of a stacked ``(2, ...)`` array, as views."""
    return kv_half(kv, 0), kv_half(kv, 1)


def take_kv_rows(kv: mx.array, rows: slice, head_major: bool) -> mx.array:
    """Rows ``rows`` (a slice) of a stacked ``(2, ...)`` K/V array (a view)."""
    index = (slice(None),) * (row_axis(head_major) + 1) + (rows,)
    return kv[index]


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


def meta_after(meta: PlaneMeta, is_ring: bool, count: int) -> PlaneMeta:
    """Bookkeeping after appending ``count`` rows to a plane with bookkeeping ``meta``."""
    total = meta.len + count
    if not is_ring or total <= meta.capacity:
        return PlaneMeta(
            meta.capacity, total, meta.origin_logical, meta.origin_physical
        )
    overflow = total - meta.capacity
    return PlaneMeta(
        meta.capacity,
        meta.capacity,
        meta.origin_logical + overflow,
        (meta.origin_physical + overflow) % meta.capacity,
    )


class KvPlane:
    """One layer's K/V storage with explicit origins.

    Args:
        window: Sliding window of the layer (``None`` for a growing plane).
        max_context: Largest absolute position + 1 the plane accepts (``None``: unbounded).
        head_major: ``True`` for ``(B, H, T, D)`` buffers, ``False`` for ``(B, T, H, D)``.
        layer: Layer index, used in error messages.
        use_kernel: Custom-kernel switch of the staging shadow (``None``: the kernel on a
            Metal GPU unless ``DFLASH_KERNELS=0``, else the pure-MLX reference, which
            measured at least as fast on CUDA).
    """

    def __init__(
        self,
        window: Optional[int] = None,
        max_context: Optional[int] = None,
        head_major: bool = True,
        layer: Optional[int] = None,
        use_kernel: Optional[bool] = None,
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
        self.init_runtime(use_kernel)

    def init_runtime(self, use_kernel: Optional[bool] = None) -> None:
        """Set the attributes that are not bookkeeping (also used by ``from_state``)."""
        # K and V stacked: (2, B, H, capacity, D) head-major, (2, B, capacity, H, D) token-major.
        self.kv: Optional[mx.array] = None
        self.use_kernel = use_kernel
        self.stager: Optional[ShadowStager] = None
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
        return PlaneMeta(
            self.capacity, self.len, self.origin_logical, self.origin_physical
        )

    def set_meta(self, meta: PlaneMeta) -> None:
        self.capacity = meta.capacity
        self.len = meta.len
        self.origin_logical = meta.origin_logical
        self.origin_physical = meta.origin_physical

    @property
    def kv_axis(self) -> int:
        """Row axis of the stacked ``kv`` buffer."""
        return row_axis(self.head_major) + 1

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
        if not self.is_ring and self.len + count > self.capacity:
            raise CacheError(
                f"growing plane of layer {self.layer} holds {self.capacity} rows; "
                f"reserve storage before appending {count} rows"
            )
        self.set_meta(meta_after(self.meta, self.is_ring, count))
        source_first = max(0, self.origin_logical - start)
        return source_first, count - source_first

    # ----------------------------------------------------------------- buffers
    @property
    def keys(self) -> Optional[mx.array]:
        """The keys buffer (a view of ``kv[0]``), every row of the storage."""
        self.settle()
        return None if self.kv is None else kv_half(self.kv, 0)

    @property
    def values(self) -> Optional[mx.array]:
        """The values buffer (a view of ``kv[1]``), every row of the storage."""
        self.settle()
        return None if self.kv is None else kv_half(self.kv, 1)

    @keys.setter
    def keys(self, keys: Optional[mx.array]) -> None:
        self._set_half(0, keys)

    @values.setter
    def values(self, values: Optional[mx.array]) -> None:
        self._set_half(1, values)

    def _set_half(self, half: int, rows: Optional[mx.array]) -> None:
        """Replace the keys (``half=0``) or values (``half=1``) buffer; not a hot path."""
        self.settle()
        if rows is None:
            self.set_buffers(None, None)
            return
        other = mx.zeros_like(rows) if self.kv is None else kv_half(self.kv, 1 - half)
        pair = (rows, other) if half == 0 else (other, rows)
        self.set_buffers(*pair)

    def set_buffers(self, keys: Optional[mx.array], values: Optional[mx.array]) -> None:
        """Replace the storage with ``keys`` / ``values`` (``None``: empty); meta unchanged."""
        self.kv = None if keys is None else mx.stack([keys, values])
        self.stager = None

    def settle(self) -> None:
        """Make the buffers hold every row the bookkeeping counts.

        A checkpoint may hold a staged block back from the ring until it knows how many rows
        to keep; anything that reads the buffers directly first has it written here.
        """
        if self.speculation is not None:
            self.speculation.settle()

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
        if values.shape != keys.shape or values.dtype != keys.dtype:
            raise CacheError(
                f"layer {self.layer}: keys {keys.shape} ({keys.dtype}) and values "
                f"{values.shape} ({values.dtype}) must have one shape and dtype"
            )
        if self.kv is not None:
            want = self.kv.shape[1 : axis + 1] + self.kv.shape[axis + 2 :]
            got = keys.shape[:axis] + keys.shape[axis + 1 :]
            if want != got or keys.dtype != self.kv.dtype:
                raise CacheError(
                    f"layer {self.layer}: keys of shape {keys.shape} ({keys.dtype}) do "
                    f"not fit a cache holding rows of shape {want} ({self.kv.dtype}); is "
                    "this prompt cache from another model?"
                )
        return count

    def _allocate(self, kv: mx.array, rows: int) -> None:
        """Make ``kv`` hold at least ``rows`` rows (growing) or ``capacity`` (ring)."""
        axis = self.kv_axis

        def shaped(n: int) -> mx.array:
            shape = list(kv.shape)
            shape[axis] = n
            return mx.zeros(shape, kv.dtype)

        if self.is_ring:
            if self.kv is None:
                self.kv = shaped(self.capacity)
            return
        if self.kv is not None and rows <= self.capacity:
            return
        steps = -(-rows // GROWTH_STEP)
        new_capacity = steps * GROWTH_STEP
        if self.max_context is not None:
            new_capacity = min(new_capacity, self.max_context)
        extra = new_capacity - self.capacity
        if self.kv is None:
            self.kv = shaped(extra)
        else:
            self.kv = mx.concatenate([self.kv, shaped(extra)], axis=axis)
        self.capacity = new_capacity

    def store_chunk(self, start: int, kv: mx.array) -> None:
        """Append a stacked chunk: bookkeeping, then one in-place store (no checks, no hooks).

        The caller has validated the chunk (``check_continuity`` and the row shapes).

        Shapes:
            kv: ``(2, B, H, S, D)`` head-major or ``(2, B, S, H, D)`` token-major.
        """
        count = kv.shape[self.kv_axis]
        self._allocate(kv, self.len + count)
        source_first, source_count = self.append_batch(start, count)
        if source_count == 0:
            return
        if source_first:
            kv = take_kv_rows(kv, slice(source_first, count), self.head_major)
        first = (self.origin_physical + self.len - source_count) % self.capacity
        self.kv = ring_write(self.kv, kv, first, self.kv_axis)

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
        kv = mx.stack([keys, values])
        if self.speculation is not None:
            self.speculation.admit(start, count)
            self.speculation.prepare_store(start, kv)
        self.store_chunk(start, kv)

    def shadow(self, kv: mx.array) -> mx.array:
        """Live rows in logical order followed by the chunk ``kv`` (one launch with kernels).

        Shapes:
            kv: ``(2, B, H, S, D)``; returns ``(2, B, H, len + S, D)`` (token-major alike).
        """
        if self.len == 0:
            return kv
        if self.stager is None or not self.stager.serves(self.kv):
            self.stager = ShadowStager.for_buffer(
                self.kv, head_major=self.head_major, use_kernel=self.use_kernel
            )
        return self.stager(self.kv, kv, self.origin_physical, self.len)

    def shadow_pair(
        self, keys: mx.array, values: mx.array
    ) -> Tuple[mx.array, mx.array]:
        """The staging shadow of a chunk given as separate keys and values, and the chunk.

        One launch with the kernels (it also stacks the chunk); the reference stacks, gathers
        and concatenates.

        Shapes:
            keys, values: ``(B, H, S, D)``; returns the shadow ``(2, B, H, len + S, D)`` and
            the stacked chunk ``(2, B, H, S, D)`` (token-major alike).

        Returns:
            ``(shadow, kv)``.
        """
        if self.len == 0:
            kv = mx.stack([keys, values])
            return kv, kv
        if self.stager is None or not self.stager.serves(self.kv):
            self.stager = ShadowStager.for_buffer(
                self.kv, head_major=self.head_major, use_kernel=self.use_kernel
            )
        return self.stager.pair(self.kv, keys, values, self.origin_physical, self.len)

    def logical_rows(self) -> Tuple[mx.array, mx.array]:
        """The live rows in logical (time) order.

        Returns:
            ``(keys, values)`` holding ``len`` rows, oldest first.
        """
        self.settle()
        if self.kv is None:
            raise CacheError(f"layer {self.layer}: the plane is empty")
        rows = ring_indices(self.origin_physical, 0, self.len, max(self.capacity, 1))
        keys, values = kv_halves(self.kv)
        return take_rows(keys, rows, self.head_major), take_rows(
            values, rows, self.head_major
        )

    def attention_rows(self) -> Tuple[mx.array, mx.array]:
        """The rows attention reads after a write: a full ring in physical order, else logical.

        A full ring is read in place (its rows are exactly the window, whatever the order);
        anything else is the live prefix ``[0, len)`` in time order.
        """
        if self.is_ring and self.len == self.capacity:
            return kv_halves(self.kv)
        if self.origin_physical == 0:
            rows = take_kv_rows(self.kv, slice(0, self.len), self.head_major)
            return kv_halves(rows)
        return self.logical_rows()

    @property
    def nbytes(self) -> int:
        if self.kv is None:
            return 0
        return self.kv.nbytes

    @property
    def row_bytes(self) -> int:
        """Bytes of one K+V row across all heads (0 while the plane is empty)."""
        if self.kv is None or self.capacity == 0:
            return 0
        return self.nbytes // self.capacity
