"""Speculative checkpoint: exact, O(block) rollback of a verify block, no host sync in ``begin``.

``SpeculativeCheckpoint.begin(prompt_cache, token_count)`` before a forward that writes up to
``token_count`` rows; ``commit(accepted)`` keeps the first ``accepted`` rows of the block and
leaves every plane exactly as sequential appends of those rows would have left it;
``rollback()`` is ``commit(0)``. ``begin`` only records bookkeeping (Python ints): it launches
nothing and never waits for the device.

While the checkpoint is open, each plane's :class:`~dflash.cache.plane.WriteGuard` is its
:class:`PlaneCheckpoint`, so every write the forward makes passes through it. How each plane is
undone:

- **Growing plane**: the block lands in unused rows past ``len``; rewinding is three integers.
- **Ring plane, staged block** (the verify block of a speculative round: a multi-token chunk
  that overwrites live rows, written by one ``update_and_fetch``): attention reads the staging
  shadow, never the ring, so the block is *held back*: the forward does not write the ring at
  all, ``commit(n)`` appends the block's first ``n`` rows (one store per plane, in place) and
  ``rollback()`` writes nothing. Nothing is retained or restored.
- **Ring plane, any other write** under the checkpoint (a single-token decode step at a full
  ring, a block written in several chunks, ``KvPlane.write``): before the first such write, the
  rows the block will overwrite are retained (at most ``token_count`` per plane) for every ring
  plane not yet written, one ``retain_rows`` launch per buffer geometry, and evaluated once so
  the in-place stores after it can reuse their buffers; ``commit`` puts back the rows still live.
"""

from abc import ABC, abstractmethod
from typing import List, Optional, Sequence, Tuple

import mlx.core as mx
import numpy as np

from ..metal import retain_rows, ring_write, wrapped_rows
from ..metal.layout import leading_view
from .errors import CacheError, RollbackError
from .plane import (
    KvPlane,
    PlaneMeta,
    RingPlane,
    WriteGuard,
    take_kv_rows,
)

UNTOUCHED = "untouched"  # nothing written under the checkpoint yet
DEFERRED = "deferred"  # one staged block held back from the ring
RETAINED = "retained"  # overwritten rows retained; writes go to the ring


class PlaneCheckpoint(WriteGuard, ABC):
    """What one plane needs to undo a block; while open it is the plane's write guard.

    Args:
        plane: The plane.
        owner: The checkpoint this belongs to.
        token_count: Most rows the block may write.

    Attributes:
        start: Absolute position of the block's first row.
        meta: The plane's bookkeeping before the block.
    """

    def __init__(
        self, plane: KvPlane, owner: "SpeculativeCheckpoint", token_count: int
    ):
        self.plane = plane
        self.owner = owner
        self.start = plane.offset
        self.token_count = token_count
        self.meta = plane.meta

    @property
    def written(self) -> int:
        """Rows written so far under the checkpoint."""
        return self.plane.offset - self.start

    def admit(self, plane: KvPlane, start: int, count: int) -> None:
        """Refuse (before any change) a write that exceeds the checkpointed block."""
        if start - self.start + count > self.token_count:
            raise RollbackError(
                f"layer {plane.layer}: writing {count} rows at position {start} exceeds "
                f"the checkpointed block of {self.token_count} rows from {self.start}"
            )

    @abstractmethod
    def commit(self, accepted: int) -> None:
        """Leave the plane as sequential appends of the block's first ``accepted`` rows."""


class GrowingPlaneCheckpoint(PlaneCheckpoint):
    """A growing plane's undo: the block lands in unused rows past ``len`` (stored at once)."""

    def commit(self, accepted: int) -> None:
        plane = self.plane
        plane.release_guard()
        final = plane.meta_after(self.meta, accepted)
        # Storage may have grown during the block; the grown rows are simply unused.
        plane.set_meta(PlaneMeta(plane.capacity, final.len, 0, 0))


class RingPlaneCheckpoint(PlaneCheckpoint):
    """A ring's undo: hold a staged block back, or retain the rows a write overwrites.

    Attributes:
        mode: ``"untouched"``, ``"deferred"`` (a staged block held back) or ``"retained"``.
        pending: The held-back block, K and V stacked (``deferred`` only).
        retained_count: Live rows retained before being overwritten (oldest first).
        journal: The chunks written to the ring under this checkpoint, for blocks wider than
            the ring.
    """

    def __init__(
        self, plane: RingPlane, owner: "SpeculativeCheckpoint", token_count: int
    ):
        super().__init__(plane, owner, token_count)
        self.mode = UNTOUCHED
        self.pending: Optional[mx.array] = None
        self.retained_block: Optional[mx.array] = None
        self.retained_slot = 0
        self.retained_count = 0
        self.journal: List[Tuple[int, mx.array]] = []

    @property
    def overwritten(self) -> int:
        """Live rows of the ring the whole block overwrites."""
        if self.plane.kv is None:
            return 0
        meta = self.meta
        return min(meta.len, max(0, meta.len + self.token_count - meta.capacity))

    @property
    def retained_bytes(self) -> int:
        """Bytes of the K and V rows retained for this plane."""
        return self.retained_count * self.plane.row_bytes

    # ----------------------------------------------------------------- writes
    def stage(
        self, plane: RingPlane, start: int, keys: mx.array, values: mx.array
    ) -> mx.array:
        """The first write is held back (attention reads the shadow); later ones retain."""
        if self.mode == UNTOUCHED:
            shadow, kv = plane.shadow_pair(keys, values)
            self._hold_back(start, kv)
            return shadow
        return self.stage_block(plane, start, mx.stack([keys, values]))

    def stage_block(
        self, plane: RingPlane, start: int, kv: mx.array, shadow: bool = True
    ) -> Optional[mx.array]:
        """:meth:`stage` of a chunk that comes stacked (held back as it is). Held back,
        ``shadow=False`` returns None where the ring has a buffer: the kernel route
        reads the ring and the held-back block in place."""
        if self.mode == UNTOUCHED:
            staged = plane.shadow(kv) if shadow or plane.kv is None else None
            self._hold_back(start, kv)
            return staged
        # Retaining needs the stacked block before the shadow reads the ring.
        self._make_undoable(start, kv)
        shadow = plane.shadow(kv)
        plane._store(start, kv)
        return shadow

    def store(self, plane: RingPlane, start: int, kv: mx.array) -> None:
        """Retain what the chunk overwrites (or flush a held-back block), then store it."""
        self._make_undoable(start, kv)
        plane._store(start, kv)

    def settle(self, plane: RingPlane) -> None:
        """Write a held-back block to the ring (a reader needs the buffers to be current)."""
        if self.mode == DEFERRED:
            self._flush()

    def _hold_back(self, start: int, kv: mx.array) -> None:
        """Hold a staged chunk back: bookkeeping advances, the ring is not written.

        Shapes:
            kv: ``(2, B, H, S, D)`` head-major or ``(2, B, S, H, D)`` token-major.
        """
        self.plane.append_batch(start, kv.shape[self.plane.kv_axis])
        self.pending = kv
        self.mode = DEFERRED

    def _make_undoable(self, start: int, kv: mx.array) -> None:
        """Before a store to the ring: retain (or flush) first, then journal the chunk."""
        if self.mode == UNTOUCHED:
            self.owner.retain_untouched()
        elif self.mode == DEFERRED:
            self._flush()
        self.journal.append((start, kv))

    def _flush(self) -> None:
        """Retain what the held-back block overwrites, then store it in the ring."""
        kv, self.pending = self.pending, None
        self.owner.retain([self])
        self.plane.set_meta(self.meta)
        self.plane._store(self.start, kv)
        self.journal.append((self.start, kv))

    # ----------------------------------------------------------------- commit
    def commit(self, accepted: int) -> None:
        plane = self.plane
        written = self.written
        final = plane.meta_after(self.meta, accepted)
        plane.release_guard()
        if self.mode == DEFERRED:
            kv, self.pending = self.pending, None
            plane.set_meta(self.meta)
            if accepted:
                kept = take_kv_rows(kv, slice(0, accepted), plane.head_major)
                plane._store(self.start, kept)
            return
        if self.mode == RETAINED and written:
            self._restore(accepted, final, written)
        plane.set_meta(final)

    def _restore(self, accepted: int, final: PlaneMeta, written: int) -> None:
        """Put back every retained row still live after ``accepted`` rows; re-lay lost ones."""
        plane, meta = self.plane, self.meta
        if self.retained_count:
            # Retained row k sits at logical position meta.origin_logical + k.
            first_live = max(0, final.origin_logical - meta.origin_logical)
            if first_live < self.retained_count:
                rows = take_kv_rows(
                    leading_view(self.retained_block, self.retained_slot),
                    slice(first_live, self.retained_count),
                    plane.head_major,
                )
                dest = (meta.origin_physical + first_live) % meta.capacity
                plane.kv = ring_write(plane.kv, rows, dest, plane.kv_axis)
        # Accepted rows overwritten later in the same block (only when it is wider than the ring).
        first = max(0, accepted - meta.capacity)
        last = min(accepted, written - meta.capacity)
        if first < last:
            block = mx.concatenate([kv for _, kv in self.journal], axis=plane.kv_axis)
            rows = take_kv_rows(block, slice(first, last), plane.head_major)
            logical = self.start + first - final.origin_logical
            dest = (final.origin_physical + logical) % final.capacity
            plane.kv = ring_write(plane.kv, rows, dest, plane.kv_axis)


class SpeculativeCheckpoint:
    """A transaction over every KV plane of a prompt cache for one verify block.

    Use ``try/finally`` (or ``with``): an exception mid-round rolls back.

    Example:
        >>> ckpt = SpeculativeCheckpoint.begin(prompt_cache, len(block))
        >>> logits = model(block[None], cache=prompt_cache)
        >>> ckpt.commit(accepted + 1)
    """

    def __init__(self, token_count: int, use_kernel: Optional[bool] = None):
        self._planes: List[PlaneCheckpoint] = []
        self._rings: List[RingPlaneCheckpoint] = []
        self.token_count = token_count
        self.use_kernel = use_kernel
        self.closed = False

    @classmethod
    def begin(
        cls, prompt_cache: Sequence, token_count: int, use_kernel: Optional[bool] = None
    ) -> "SpeculativeCheckpoint":
        """Open a checkpoint before a forward writes up to ``token_count`` rows.

        Launches nothing and does not wait for the device: it records each plane's
        bookkeeping (Python ints).

        Args:
            prompt_cache: The caches (KV planes) of every layer that the forward writes.
            token_count: Most rows the forward will write into each plane.
            use_kernel: Switch of the retain kernel, if rows must be retained (``None``: each
                plane's own ``use_kernel``).

        Returns:
            The open checkpoint.
        """
        if token_count < 0:
            raise CacheError(f"token_count must be >= 0, got {token_count}")
        planes = list(prompt_cache)
        for index, plane in enumerate(planes):
            if not isinstance(plane, KvPlane):
                raise CacheError(
                    f"cache {index} is a {type(plane).__name__}, not a dflash KV plane; "
                    "build the cache with dflash.cache.make_prompt_cache"
                )
            if plane.checkpointed:
                raise RollbackError(
                    f"layer {plane.layer} already has an open checkpoint"
                )
        checkpoint = cls(token_count, use_kernel)
        for plane in planes:
            # The plane's kind is decided once, here; its guard does the rest.
            if isinstance(plane, RingPlane):
                ckpt = RingPlaneCheckpoint(plane, checkpoint, token_count)
                checkpoint._rings.append(ckpt)
            else:
                ckpt = GrowingPlaneCheckpoint(plane, checkpoint, token_count)
            checkpoint._planes.append(ckpt)
        for ckpt in checkpoint._planes:
            ckpt.plane.attach_guard(ckpt)
        return checkpoint

    @property
    def retained_bytes(self) -> int:
        """Bytes of K/V rows this checkpoint holds (ring rows only; growing planes hold none).

        Zero for a staged block (held back, nothing retained); at most ``token_count`` rows
        per ring plane otherwise.
        """
        return sum(ckpt.retained_bytes for ckpt in self._rings)

    def retain_untouched(self) -> None:
        """Retain the overwritten rows of every ring plane nothing was written to yet."""
        self.retain([c for c in self._rings if c.mode == UNTOUCHED])

    def retain(self, ckpts: Sequence[RingPlaneCheckpoint]) -> None:
        """Retain the rows the block overwrites in ``ckpts``' rings (still as at ``begin``).

        Planes of one buffer geometry share one :func:`~dflash.metal.retain_rows`
        call (its launch count per backend is documented there).
        """
        groups = {}
        for ckpt in ckpts:
            ckpt.mode = RETAINED
            count = ckpt.overwritten
            if count == 0:
                continue
            plane = ckpt.plane
            flag = self.use_kernel if self.use_kernel is not None else plane.use_kernel
            key = (plane.kv.shape, str(plane.kv.dtype), plane.head_major, count, flag)
            groups.setdefault(key, []).append(ckpt)
        blocks = []
        for (_, _, head_major, count, flag), members in groups.items():
            dests = np.stack(
                [
                    wrapped_rows(c.meta.origin_physical, count, c.meta.capacity)
                    for c in members
                ]
            )
            block = retain_rows(
                [c.plane.kv for c in members],
                mx.array(dests),
                head_major=head_major,
                use_kernel=flag,
            )
            for slot, ckpt in enumerate(members):
                ckpt.retained_block, ckpt.retained_slot = block, slot
                ckpt.retained_count = count
            blocks.append(block)
        if blocks:
            # The in-place stores that follow can reuse (donate) a ring buffer only once no
            # pending reader holds it, so the retained rows are materialised here.
            mx.eval(blocks)

    def commit(self, accepted: int) -> None:
        """Keep the first ``accepted`` rows of the block in every plane; undo the rest.

        Args:
            accepted: Rows to keep, ``0 <= accepted <= token_count`` and no more than each
                plane has written.
        """
        if self.closed:
            raise RollbackError("this checkpoint was already committed or rolled back")
        if not 0 <= accepted <= self.token_count:
            raise RollbackError(
                f"cannot keep {accepted} rows of a {self.token_count}-row block"
            )
        for ckpt in self._planes:
            if ckpt.written < accepted:
                raise RollbackError(
                    f"layer {ckpt.plane.layer} wrote {ckpt.written} rows but {accepted} "
                    "were to be kept"
                )
        for ckpt in self._planes:
            ckpt.commit(accepted)
        self.closed = True

    def rollback(self) -> None:
        """Undo the whole block (``commit(0)``)."""
        self.commit(0)

    def __enter__(self) -> "SpeculativeCheckpoint":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if not self.closed:
            self.rollback()
