"""KV planes: one layer's K/V buffer plus explicit ring bookkeeping.

A plane is either a :class:`RingPlane` (sliding-window layers: fixed capacity
``min(window, max_context)``, rotation kept as state in ``origin_physical``) or a
:class:`GrowingPlane` (full / NoPE layers: storage grows in chunks, ``origin_logical`` and
``origin_physical`` stay 0 and the ring arithmetic switches itself off). Physical placement is
never derived from an absolute position.

Every store goes through the plane's :class:`WriteGuard` (``plane.guard``): the one door between a
plane and a speculative checkpoint. Outside a checkpoint it is :data:`OPEN_GUARD`, which stores at
once; ``SpeculativeCheckpoint.begin`` installs a guard that makes the writes undoable.

Layouts: head-major keys/values are ``(B, H, capacity, D)`` (mlx-lm's layout); token-major are
``(B, capacity, H, D)``. One *row* is one token position across all heads. The plane keeps K and V
stacked in one buffer ``kv`` of shape ``(2, ...)``, so storing a chunk is one launch per layer and
one staging-shadow launch builds both K and V; ``keys`` / ``values`` are views of its halves.
"""

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Optional, Tuple

import mlx.core as mx

from ..metal.backend import BACKEND, env_switch
from ..metal.layout import leading_view
from ..metal.ring import ShadowStager, ring_write
from ..metal.sources import CUDA
from . import gate
from .errors import (
    CacheDiscontinuity,
    CacheError,
    ContextOverflow,
    RollbackError,
    SnapshotError,
)

GROWTH_STEP = 256

# Bucketed keys: attention reads key lengths rounded up to whole buckets of this many rows.
KEY_BUCKET = GROWTH_STEP
# Forwards of BUCKET_MIN_QUERIES .. BUCKET_MAX_QUERIES queries are bucketed (see
# resolve_bucket_keys for both bounds).
BUCKET_MIN_QUERIES = 2
BUCKET_MAX_QUERIES = 64
# ``DFLASH_BUCKET_KEYS=0`` / ``=1`` overrides the default below (an explicit argument wins).
BUCKET_KEYS_ENV = "DFLASH_BUCKET_KEYS"


def _bucket_keys_by_default() -> bool:
    told = env_switch(BUCKET_KEYS_ENV)
    return BACKEND == CUDA if told is None else told


BUCKET_KEYS_BY_DEFAULT: bool = _bucket_keys_by_default()


def resolve_bucket_keys(bucket_keys: Optional[bool] = None) -> bool:
    """Whether attention reads bucketed key lengths (``None``: the default, decided here).

    Bucketed keys: a small forward (a verify or draft block) reads the keys up to the end of
    the current :data:`KEY_BUCKET`-row bucket, with an explicit mask that hides the rows
    past the live ones, so the key length repeats from round to round instead of growing
    by a block every round. The default is on with CUDA only, by measurement
    (``DESIGN.md`` §6; standalone probe ``docs/slow-mode/repro_sdpa_key_length.py``: 16
    queries, 32/2 heads x 128, bf16, 13 calls a round, one H200, mlx 0.32.4): mlx's cuDNN
    attention builds a plan per new key length (its plan cache is keyed by the q/k/v/mask
    shapes and strides), so keys growing by 16 rows a round cost 64 ms a round against
    1.3 ms at a fixed length and 1.4 ms bucketed with a mask (with
    ``MLX_CUDA_USE_CUDNN_SDPA=0``: 2.3-2.5 ms growing, 1.8 ms bucketed); inside the
    DFlash loop this is the slow mode of rounds of 120-177 ms after ~16 rounds. Elsewhere
    (CPU, Metal) nothing was measured, so the live rows are read unless bucketing is
    forced. ``DFLASH_BUCKET_KEYS=0/1`` overrides the default. Other docstrings refer here.

    Which forwards: from :data:`BUCKET_MIN_QUERIES` to :data:`BUCKET_MAX_QUERIES` queries
    (verify blocks, draft blocks). A single query (a decode step) is left alone: mlx's CUDA
    backend serves it with its vector kernel, which builds no plan per key length but
    takes no array mask; a mask would send it to the unfused fallback
    (``supports_sdpa_vector`` / ``use_cudnn_for_decoding`` in mlx's
    ``backend/cuda/scaled_dot_product_attention.cpp``, read at 0.32.2). Longer chunks
    (prompt prefill) read the live rows: their ``(queries, keys)`` mask array would cost
    more than one plan per chunk.

    Args:
        bucket_keys: ``True`` / ``False`` force bucketing on / off; ``None`` takes the
            default (:data:`BUCKET_KEYS_BY_DEFAULT`).

    Returns:
        The switch as a ``bool``.
    """
    return BUCKET_KEYS_BY_DEFAULT if bucket_keys is None else bool(bucket_keys)


def bucketable(query_count: int) -> bool:
    """Whether a forward of ``query_count`` queries is one that bucketed keys serve."""
    return BUCKET_MIN_QUERIES <= query_count <= BUCKET_MAX_QUERIES


def bucket_end(rows: int) -> int:
    """``rows`` rounded up to a whole :data:`KEY_BUCKET`."""
    return -(-rows // KEY_BUCKET) * KEY_BUCKET


def row_axis(head_major: bool) -> int:
    """Axis of the token rows: 2 for ``(B, H, T, D)``, 1 for ``(B, T, H, D)``."""
    return 2 if head_major else 1


def take_rows(buffer: mx.array, rows, head_major: bool) -> mx.array:
    """Rows of ``buffer`` at ``rows`` (a slice or an index array), in that order."""
    if head_major:
        return buffer[:, :, rows, :]
    return buffer[:, rows]


def kv_halves(kv: mx.array) -> Tuple[mx.array, mx.array]:
    """The keys and values halves of a stacked ``(2, ...)`` array, as views."""
    return leading_view(kv, 0), leading_view(kv, 1)


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


class WriteGuard:
    """The one door between a plane and a speculative checkpoint.

    A plane validates a write (row shapes, continuity), then hands it to its guard at defined
    points: :meth:`admit` (may refuse, before any change), then :meth:`store` for a chunk stored
    in place or :meth:`stage` for a ring chunk that must be attended before it overwrites live
    rows; :meth:`settle` runs before anything reads the buffers directly. This base class is
    the open guard (:data:`OPEN_GUARD`): it stores at once. A checkpoint's guard decides, per
    write, whether to hold the rows back, retain what they overwrite, or just store them.
    """

    def admit(self, plane: "KvPlane", start: int, count: int) -> None:
        """Refuse (raise) a write of ``count`` rows at ``start`` before anything changes."""

    def store(self, plane: "KvPlane", start: int, kv: mx.array) -> None:
        """Store a validated, stacked chunk in ``plane``.

        Shapes:
            kv: ``(2, B, H, S, D)`` head-major or ``(2, B, S, H, D)`` token-major.
        """
        plane._store(start, kv)

    def stage(
        self, plane: "RingPlane", start: int, keys: mx.array, values: mx.array
    ) -> mx.array:
        """Store a validated chunk that must be staged; return its staging shadow.

        Shapes:
            keys, values: ``(B, H, S, D)``; returns ``(2, B, H, len + S, D)`` (the live rows in
            logical order, then the chunk).
        """
        shadow, kv = plane.shadow_pair(keys, values)
        self.store(plane, start, kv)
        return shadow

    def stage_block(
        self, plane: "RingPlane", start: int, kv: mx.array, shadow: bool = True
    ) -> Optional[mx.array]:
        """:meth:`stage` of a validated chunk that comes stacked.

        ``shadow=False`` lets a guard that holds the chunk back (the ring keeps every
        row the chunk's queries read) return None instead of building the shadow. A
        chunk stored at once always gets its shadow: it is the only copy of the rows
        the chunk overwrites.

        Shapes:
            kv: ``(2, B, H, S, D)``; returns ``(2, B, H, len + S, D)``.
        """
        staged = plane.shadow(kv)
        self.store(plane, start, kv)
        return staged

    def settle(self, plane: "KvPlane") -> None:
        """Make ``plane``'s buffers hold every row its bookkeeping counts."""


# The guard of every plane outside a checkpoint (stateless, so one serves all planes).
OPEN_GUARD = WriteGuard()


class KvPlane(ABC):
    """One layer's K/V storage with explicit origins (base of :class:`RingPlane` and
    :class:`GrowingPlane`).

    Args:
        max_context: Largest absolute position + 1 the plane accepts (``None``: unbounded).
        head_major: ``True`` for ``(B, H, T, D)`` buffers, ``False`` for ``(B, T, H, D)``.
        layer: Layer index, used in error messages.
        use_kernel: Custom-kernel switch of the staging shadow (``None``: the backend's
            default, see :mod:`dflash.metal.backend`).
        bucket_keys: Bucketed-keys switch (``None``: the default, see
            :func:`resolve_bucket_keys`).
    """

    # Whether rows are evicted once the window is full (informative; no code path tests it).
    is_ring: bool = False
    kind: str = ""
    window: Optional[int] = None
    # The model type whose ``make_prompt_cache`` built the plane (``None``: built by hand).
    model_type: Optional[str] = None

    def __init__(
        self,
        max_context: Optional[int] = None,
        head_major: bool = True,
        layer: Optional[int] = None,
        use_kernel: Optional[bool] = None,
        bucket_keys: Optional[bool] = None,
    ):
        if max_context is not None and max_context < 1:
            raise CacheError(f"max_context must be >= 1, got {max_context}")
        self.max_context = max_context
        self.head_major = head_major
        self.layer = layer
        self.capacity = 0
        self.len = 0
        self.origin_logical = 0
        self.origin_physical = 0
        self.init_runtime(use_kernel, bucket_keys)

    def init_runtime(
        self, use_kernel: Optional[bool] = None, bucket_keys: Optional[bool] = None
    ) -> None:
        """Set the attributes that are not bookkeeping (also used by ``from_state``)."""
        # K and V stacked: (2, B, H, capacity, D) head-major, (2, B, capacity, H, D) token-major.
        self.kv: Optional[mx.array] = None
        self.use_kernel = use_kernel
        self.stager: Optional[ShadowStager] = None
        self.guard: WriteGuard = OPEN_GUARD
        self.bucket_keys = resolve_bucket_keys(bucket_keys)

    # ----------------------------------------------------------------- the guard
    @property
    def checkpointed(self) -> bool:
        """Whether a speculative checkpoint guards this plane's writes."""
        return self.guard is not OPEN_GUARD

    def attach_guard(self, guard: WriteGuard) -> None:
        """Route every later write through ``guard`` (a checkpoint's, until released)."""
        if self.checkpointed:
            raise RollbackError(f"layer {self.layer} already has an open checkpoint")
        self.guard = guard

    def release_guard(self) -> None:
        """Store at once again (the checkpoint is closed)."""
        self.guard = OPEN_GUARD

    # ----------------------------------------------------------------- bookkeeping
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

    @abstractmethod
    def meta_after(self, meta: PlaneMeta, count: int) -> PlaneMeta:
        """Bookkeeping after appending ``count`` rows to this kind of plane at ``meta``."""

    @staticmethod
    @abstractmethod
    def check_meta(meta: gate.Meta, where: str) -> None:
        """Refuse (``SnapshotError``) bookkeeping that sequential appends cannot produce."""

    def where(self) -> str:
        """How refusals name this plane."""
        return gate.where_layer(self.layer)

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

    def check_room(self, count: int) -> None:
        """Raise if the storage cannot take ``count`` more rows (a ring always can)."""

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
        self.check_room(count)
        self.set_meta(self.meta_after(self.meta, count))
        source_first = max(0, self.origin_logical - start)
        return source_first, count - source_first

    # ----------------------------------------------------------------- buffers
    @property
    def keys(self) -> Optional[mx.array]:
        """The keys buffer (a view of ``kv[0]``), every row of the storage."""
        self.settle()
        return None if self.kv is None else leading_view(self.kv, 0)

    @property
    def values(self) -> Optional[mx.array]:
        """The values buffer (a view of ``kv[1]``), every row of the storage."""
        self.settle()
        return None if self.kv is None else leading_view(self.kv, 1)

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
        other = (
            mx.zeros_like(rows) if self.kv is None else leading_view(self.kv, 1 - half)
        )
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
        self.guard.settle(self)

    # ----------------------------------------------------------------- storage
    def _check_rows(self, keys: mx.array, values: mx.array) -> int:
        """Validate a chunk against the plane's layout; return its row count."""
        if keys.ndim != 4 or values.ndim != 4:
            raise CacheError(
                f"layer {self.layer}: keys and values must be 4-D, got {keys.shape} "
                f"and {values.shape}"
            )
        if values.shape != keys.shape or values.dtype != keys.dtype:
            raise CacheError(
                f"layer {self.layer}: keys {keys.shape} ({keys.dtype}) and values "
                f"{values.shape} ({values.dtype}) must have one shape and dtype"
            )
        return self._check_fit(keys.shape, keys.dtype)

    def _check_block(self, kv: mx.array) -> int:
        """Validate a stacked chunk ``(2, ...)`` against the plane's layout; return its
        row count."""
        if kv.ndim != 5 or kv.shape[0] != 2:
            raise CacheError(
                f"layer {self.layer}: a stacked chunk must be (2, B, H, S, D) or "
                f"(2, B, S, H, D), got {kv.shape}"
            )
        return self._check_fit(kv.shape[1:], kv.dtype)

    def _check_fit(self, shape: Tuple[int, ...], dtype: mx.Dtype) -> int:
        """Whether rows of ``shape`` / ``dtype`` (one half of a chunk) fit the buffers
        held (CacheError if not); their row count."""
        axis = row_axis(self.head_major)
        count = shape[axis]
        if self.kv is not None:
            want = self.kv.shape[1 : axis + 1] + self.kv.shape[axis + 2 :]
            got = tuple(shape[:axis]) + tuple(shape[axis + 1 :])
            if want != got or dtype != self.kv.dtype:
                raise CacheError(
                    f"layer {self.layer}: keys of shape {tuple(shape)} ({dtype}) do "
                    f"not fit a cache holding rows of shape {want} ({self.kv.dtype}); is "
                    "this prompt cache from another model?"
                )
        return count

    def _empty_rows(self, like: mx.array, rows: int) -> mx.array:
        """Zeros shaped like the stacked chunk ``like`` with ``rows`` rows."""
        shape = list(like.shape)
        shape[self.kv_axis] = rows
        return mx.zeros(shape, like.dtype)

    @abstractmethod
    def _allocate(self, kv: mx.array, rows: int) -> None:
        """Make the storage (shaped like the chunk ``kv``) able to hold ``rows`` rows."""

    def _store(self, start: int, kv: mx.array) -> None:
        """The unchecked store: bookkeeping, then one in-place store (no checks, no guard).

        Only the plane's guards call it, after the plane validated the chunk.

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
        """Store a chunk of rows at logical position ``start`` (fail-closed, then guarded).

        Args:
            start: Absolute position of the chunk's first row; must equal ``offset``.
            keys: The chunk's keys in the plane's layout.
            values: The chunk's values in the plane's layout.

        Shapes:
            keys, values: ``(B, H, S, D)`` head-major or ``(B, S, H, D)`` token-major.
        """
        count = self._check_rows(keys, values)
        self.check_continuity(start, count)
        self.guard.admit(self, start, count)
        self.guard.store(self, start, mx.stack([keys, values]))

    def write_block(self, start: int, kv: mx.array) -> None:
        """:meth:`write` of a chunk whose keys and values come stacked (a producer that
        lays them out so saves the two copies of ``mx.stack``).

        Shapes:
            kv: ``(2, B, H, S, D)`` head-major or ``(2, B, S, H, D)`` token-major.
        """
        count = self._check_block(kv)
        self.check_continuity(start, count)
        self.guard.admit(self, start, count)
        self.guard.store(self, start, kv)

    def shadow(self, kv: mx.array) -> mx.array:
        """Live rows in logical order followed by the chunk ``kv`` (one launch with kernels).

        Shapes:
            kv: ``(2, B, H, S, D)``; returns ``(2, B, H, len + S, D)`` (token-major alike).
        """
        if self.len == 0:
            return kv
        return self._stager()(self.kv, kv, self.origin_physical, self.len)

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
        return self._stager().pair(
            self.kv, keys, values, self.origin_physical, self.len
        )

    def _stager(self) -> ShadowStager:
        """The staging-shadow builder for the current buffer (rebuilt when it changes)."""
        if self.stager is None or not self.stager.serves(self.kv):
            self.stager = ShadowStager.for_buffer(
                self.kv, head_major=self.head_major, use_kernel=self.use_kernel
            )
        return self.stager

    def install_cut(self, position: int, keys: mx.array, values: mx.array) -> None:
        """Install a snapshot's logical-order cut at ``position`` into this new, empty plane.

        The rows are laid where sequential appends of ``position`` rows would have put them:
        attention sums rows in physical order and float addition is not associative, so a
        ring comes back rotated by ``origin_logical % capacity``, never packed at 0.

        Args:
            position: The absolute position right after the cut's newest row.
            keys: The cut's keys, oldest first.
            values: The cut's values, oldest first.

        Shapes:
            keys, values: ``(B, H, rows, D)`` (token-major alike), ``rows`` as
            :func:`~dflash.cache.gate.cut_rows` says.
        """
        where = self.where()
        if self.kv is not None or self.offset != 0 or self.checkpointed:
            raise SnapshotError(where, "plane", "a cut installs only into a new plane")
        gate.check_int(where, "position", position)
        count = self._check_rows(keys, values)
        want = self.meta_after(PlaneMeta(self.capacity, 0, 0, 0), position).len
        if count != want:
            raise SnapshotError(
                where, "rows", f"a cut at position {position} holds {want}, got {count}"
            )
        if self.max_context is not None and position > self.max_context:
            raise SnapshotError(
                where, "position", f"{position} exceeds max_context {self.max_context}"
            )
        if count == 0:
            return
        kv = mx.stack([keys, values])
        self._allocate(kv, count)
        meta = self.meta_after(PlaneMeta(self.capacity, 0, 0, 0), position)
        self.kv = ring_write(self.kv, kv, meta.origin_physical, self.kv_axis)
        self.set_meta(meta)

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
        """The rows attention reads after a write: the live prefix ``[0, len)`` in time order."""
        if self.origin_physical == 0:
            return self.prefix_rows(self.len)
        return self.logical_rows()

    def prefix_rows(self, rows: int) -> Tuple[mx.array, mx.array]:
        """Physical rows ``[0, rows)`` as views: the live rows, then (bucketed) padding."""
        return kv_halves(take_kv_rows(self.kv, slice(0, rows), self.head_major))

    # ----------------------------------------------------------------- bucketed keys
    def bucketed(self, count: int) -> bool:
        """Whether a write of ``count`` rows at ``offset`` is attended over bucketed keys.

        See :func:`resolve_bucket_keys` for which forwards are, and why.
        """
        return self.bucket_keys and bucketable(count)

    @abstractmethod
    def key_rows(self, count: int) -> int:
        """How many key rows attention reads after a write of ``count`` rows at ``offset``.

        Asked before the write by both ``make_mask`` and ``update_and_fetch``, so the mask
        always matches the keys (mlx-lm builds masks before any layer writes).
        """

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


class RingPlane(KvPlane):
    """A sliding-window layer's plane: a ring of ``min(window, max_context)`` rows.

    Once full, each appended row evicts the oldest: both origins advance, the physical one
    modulo the capacity.

    Args:
        window: The layer's sliding window.
        max_context: Largest absolute position + 1 the plane accepts (``None``: unbounded).
        head_major: ``True`` for ``(B, H, T, D)`` buffers, ``False`` for ``(B, T, H, D)``.
        layer: Layer index, used in error messages.
        use_kernel: Custom-kernel switch of the staging shadow (``None``: the backend's
            default, see :mod:`dflash.metal.backend`).
        bucket_keys: Bucketed-keys switch while the ring is not yet full (``None``: the
            default, see :func:`resolve_bucket_keys`).
    """

    is_ring = True
    kind = "ring"
    check_meta = staticmethod(gate.check_ring_meta)

    def __init__(
        self,
        window: int,
        max_context: Optional[int] = None,
        head_major: bool = True,
        layer: Optional[int] = None,
        use_kernel: Optional[bool] = None,
        bucket_keys: Optional[bool] = None,
    ):
        if window is None or window < 1:
            raise CacheError(f"sliding window must be >= 1, got {window}")
        super().__init__(max_context, head_major, layer, use_kernel, bucket_keys)
        self.window = window
        self.capacity = window if max_context is None else min(window, max_context)

    def meta_after(self, meta: PlaneMeta, count: int) -> PlaneMeta:
        total = meta.len + count
        if total <= meta.capacity:
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

    def _allocate(self, kv: mx.array, rows: int) -> None:
        if self.kv is None:
            self.kv = self._empty_rows(kv, self.capacity)

    def is_staged(self, count: int) -> bool:
        """Whether a ``count``-row chunk must be attended before it overwrites live rows."""
        return count > 1 and self.len + count > self.capacity

    def stage(self, keys: mx.array, values: mx.array) -> mx.array:
        """Store a staged chunk at ``offset`` (fail-closed, then guarded); its shadow.

        Args:
            keys: The chunk's keys.
            values: The chunk's values.

        Shapes:
            keys, values: ``(B, H, S, D)``; returns ``(2, B, H, len + S, D)``: the live rows
            in logical order, then the chunk (token-major alike).
        """
        count = self._check_rows(keys, values)
        start = self.offset
        self.check_continuity(start, count)
        self.guard.admit(self, start, count)
        return self.guard.stage(self, start, keys, values)

    def stage_block(self, kv: mx.array, shadow: bool = True) -> Optional[mx.array]:
        """:meth:`stage` of a chunk whose keys and values come stacked.

        ``shadow=False``: None where a checkpoint holds the chunk back (see
        :meth:`WriteGuard.stage_block`).

        Shapes:
            kv: ``(2, B, H, S, D)``; returns ``(2, B, H, len + S, D)`` (token-major
            alike).
        """
        count = self._check_block(kv)
        start = self.offset
        self.check_continuity(start, count)
        self.guard.admit(self, start, count)
        return self.guard.stage_block(self, start, kv, shadow)

    def attention_rows(self) -> Tuple[mx.array, mx.array]:
        """A full ring in physical order (its rows are exactly the window), else the prefix."""
        if self.len == self.capacity:
            return kv_halves(self.kv)
        return super().attention_rows()

    def bucketed(self, count: int) -> bool:
        # Only a ring that is not yet full grows; once full its length is the capacity.
        return (
            super().bucketed(count)
            and self.origin_physical == 0
            and self.len + count <= self.capacity
        )

    def key_rows(self, count: int) -> int:
        if self.is_staged(count):
            return self.len + count
        if self.bucketed(count):
            return min(bucket_end(self.len + count), self.capacity)
        return min(self.len + count, self.capacity)


class GrowingPlane(KvPlane):
    """A full-attention (or NoPE) layer's plane: rows from position 0, grown in chunks.

    ``origin_logical`` and ``origin_physical`` stay 0: the ring arithmetic switches itself off.

    Args:
        max_context: Largest absolute position + 1 the plane accepts (``None``: unbounded).
        head_major: ``True`` for ``(B, H, T, D)`` buffers, ``False`` for ``(B, T, H, D)``.
        layer: Layer index, used in error messages.
        use_kernel: Accepted for symmetry with :class:`RingPlane` (a growing plane never
            stages, so it launches no custom kernel).
        bucket_keys: Bucketed-keys switch (``None``: the default, see
            :func:`resolve_bucket_keys`).
    """

    kind = "growing"
    check_meta = staticmethod(gate.check_growing_meta)

    def meta_after(self, meta: PlaneMeta, count: int) -> PlaneMeta:
        return PlaneMeta(
            meta.capacity, meta.len + count, meta.origin_logical, meta.origin_physical
        )

    def check_room(self, count: int) -> None:
        if self.len + count > self.capacity:
            raise CacheError(
                f"growing plane of layer {self.layer} holds {self.capacity} rows; "
                f"reserve storage before appending {count} rows"
            )

    def key_rows(self, count: int) -> int:
        live = self.len + count
        if not self.bucketed(count):
            return live
        return min(bucket_end(live), self._capacity_for(live))

    def _capacity_for(self, rows: int) -> int:
        """The capacity after making room for ``rows`` rows."""
        if self.kv is not None and rows <= self.capacity:
            return self.capacity
        new_capacity = -(-rows // GROWTH_STEP) * GROWTH_STEP
        if self.max_context is not None:
            new_capacity = min(new_capacity, self.max_context)
        return new_capacity

    def _allocate(self, kv: mx.array, rows: int) -> None:
        if self.kv is not None and rows <= self.capacity:
            return
        new_capacity = self._capacity_for(rows)
        extra = self._empty_rows(kv, new_capacity - self.capacity)
        if self.kv is None:
            self.kv = extra
        else:
            self.kv = mx.concatenate([self.kv, extra], axis=self.kv_axis)
        self.capacity = new_capacity
