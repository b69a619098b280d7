"""Speculative checkpoint: exact, O(block) rollback of a verify block.

``SpeculativeCheckpoint.begin(prompt_cache, token_count)`` before a forward that writes up to
``token_count`` rows; ``commit(accepted)`` keeps the first ``accepted`` rows of the block and
leaves every plane exactly as sequential appends of those rows would have left it;
``rollback()`` is ``commit(0)``.

- A growing plane's block lands in unused rows past ``len``: rewinding is three integers.
- A ring at steady state has no unused rows: the block overwrites its oldest live rows, so the
  checkpoint keeps exactly those rows (at most ``token_count`` per plane, never the window).
"""

from dataclasses import dataclass, field
from typing import List, Optional, Sequence

import mlx.core as mx

from .errors import CacheError, RollbackError
from .plane import KvPlane, PlaneMeta, put_rows, ring_indices, row_axis, take_rows


@dataclass
class PlaneCheckpoint:
    """What one plane needs to undo a block.

    Attributes:
        plane: The plane.
        start: Absolute position of the block's first row.
        token_count: Most rows the block may write.
        meta: The plane's bookkeeping before the block.
        retained_count: Number of live rows the block will overwrite (oldest first).
        retained_keys, retained_values: Those rows, in logical order (``None`` if none).
        journal: The chunks written under this checkpoint, for blocks wider than the ring.
    """

    plane: KvPlane
    start: int
    token_count: int
    meta: PlaneMeta
    retained_count: int = 0
    retained_keys: Optional[mx.array] = None
    retained_values: Optional[mx.array] = None
    journal: List[tuple] = field(default_factory=list)

    @property
    def written(self) -> int:
        return self.plane.offset - self.start

    def admit(self, plane: KvPlane, start: int, keys: mx.array, values: mx.array) -> None:
        """Refuse (before any change) a write that exceeds the checkpointed block."""
        count = keys.shape[row_axis(plane.head_major)]
        if start - self.start + count > self.token_count:
            raise RollbackError(
                f"layer {plane.layer}: writing {count} rows at position {start} exceeds the "
                f"checkpointed block of {self.token_count} rows from {self.start}"
            )
        self.journal.append((start, keys, values))

    @property
    def retained_bytes(self) -> int:
        if self.retained_keys is None:
            return 0
        return self.retained_keys.nbytes + self.retained_values.nbytes


def _meta_after(meta: PlaneMeta, is_ring: bool, count: int) -> PlaneMeta:
    """Bookkeeping after appending ``count`` rows to a plane with bookkeeping ``meta``."""
    total = meta.len + count
    if not is_ring or total <= meta.capacity:
        return PlaneMeta(meta.capacity, total, meta.origin_logical, meta.origin_physical)
    overflow = total - meta.capacity
    return PlaneMeta(
        meta.capacity,
        meta.capacity,
        meta.origin_logical + overflow,
        (meta.origin_physical + overflow) % meta.capacity,
    )


def _begin_plane(plane: KvPlane, token_count: int) -> PlaneCheckpoint:
    meta = plane.meta
    ckpt = PlaneCheckpoint(plane, plane.offset, token_count, meta)
    if plane.is_ring and plane.keys is not None:
        # The block overwrites the oldest live rows once it runs past the free slots.
        overwritten = min(meta.len, max(0, meta.len + token_count - meta.capacity))
        if overwritten:
            # An index array (not a slice) makes a real copy, not a view of the ring.
            rows = (mx.arange(overwritten) + meta.origin_physical) % meta.capacity
            ckpt.retained_count = overwritten
            ckpt.retained_keys = take_rows(plane.keys, rows, plane.head_major)
            ckpt.retained_values = take_rows(plane.values, rows, plane.head_major)
    return ckpt


def _journal_rows(ckpt: PlaneCheckpoint, first: int, last: int):
    """Block rows ``first .. last - 1`` (block-relative) from the chunks written."""
    head_major = ckpt.plane.head_major
    axis = row_axis(head_major)
    keys = mx.concatenate([k for _, k, _ in ckpt.journal], axis=axis)
    values = mx.concatenate([v for _, _, v in ckpt.journal], axis=axis)
    rows = slice(first, last)
    return take_rows(keys, rows, head_major), take_rows(values, rows, head_major)


def _commit_ring_rows(ckpt: PlaneCheckpoint, accepted: int, final: PlaneMeta) -> None:
    """Put back every retained row still live after ``accepted`` rows; re-lay lost ones."""
    plane, meta = ckpt.plane, ckpt.meta
    written = ckpt.written
    if written == 0:
        return
    if ckpt.retained_count:
        # Retained row k sits at logical position meta.origin_logical + k.
        first_live = max(0, final.origin_logical - meta.origin_logical)
        if first_live < ckpt.retained_count:
            count = ckpt.retained_count - first_live
            dest = ring_indices(meta.origin_physical, first_live, count, meta.capacity)
            tail = slice(first_live, ckpt.retained_count)
            put_rows(plane.keys, dest, take_rows(ckpt.retained_keys, tail, plane.head_major), plane.head_major)
            put_rows(plane.values, dest, take_rows(ckpt.retained_values, tail, plane.head_major), plane.head_major)
    # Accepted rows overwritten later in the same block (only when it is wider than the ring).
    first = max(0, accepted - meta.capacity)
    last = min(accepted, written - meta.capacity)
    if first < last:
        keys, values = _journal_rows(ckpt, first, last)
        logical = ckpt.start + first - final.origin_logical
        dest = ring_indices(final.origin_physical, logical, last - first, final.capacity)
        put_rows(plane.keys, dest, keys, plane.head_major)
        put_rows(plane.values, dest, values, plane.head_major)


def _commit_plane(ckpt: PlaneCheckpoint, accepted: int) -> None:
    plane = ckpt.plane
    final = _meta_after(ckpt.meta, plane.is_ring, accepted)
    if plane.is_ring:
        _commit_ring_rows(ckpt, accepted, final)
    else:
        # Storage may have grown during the block; the grown rows are simply unused.
        final = PlaneMeta(plane.capacity, final.len, 0, 0)
    plane.set_meta(final)
    plane.speculation = None


class SpeculativeCheckpoint:
    """A transaction over every KV plane of a prompt cache for one verify block.

    Use ``try/finally`` (or ``with``): an exception mid-round rolls back.

    Example:
        >>> ckpt = SpeculativeCheckpoint.begin(prompt_cache, len(block))
        >>> logits = model(block[None], cache=prompt_cache)
        >>> ckpt.commit(accepted + 1)
    """

    def __init__(self, planes: List[PlaneCheckpoint], token_count: int):
        self._planes = planes
        self.token_count = token_count
        self.closed = False

    @classmethod
    def begin(cls, prompt_cache: Sequence, token_count: int) -> "SpeculativeCheckpoint":
        """Open a checkpoint before a forward writes up to ``token_count`` rows.

        Args:
            prompt_cache: The caches (KV planes) of every layer that the forward writes.
            token_count: Most rows the forward will write into each plane.

        Returns:
            The open checkpoint; its retained rows are already evaluated.
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
            if plane.speculation is not None:
                raise RollbackError(f"layer {plane.layer} already has an open checkpoint")
        checkpoints = [_begin_plane(plane, token_count) for plane in planes]
        retained = [
            array
            for ckpt in checkpoints
            if ckpt.retained_keys is not None
            for array in (ckpt.retained_keys, ckpt.retained_values)
        ]
        # Materialise the retained rows now so the block's in-place writes cannot alias them.
        if retained:
            mx.eval(retained)
        for ckpt in checkpoints:
            ckpt.plane.speculation = ckpt
        return cls(checkpoints, token_count)

    @property
    def retained_bytes(self) -> int:
        """Bytes of K/V rows this checkpoint holds (ring rows only; growing planes hold none)."""
        return sum(ckpt.retained_bytes for ckpt in self._planes)

    @property
    def planes(self) -> List[PlaneCheckpoint]:
        return list(self._planes)

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
            _commit_plane(ckpt, accepted)
        self.closed = True

    def rollback(self) -> None:
        """Undo the whole block (``commit(0)``)."""
        self.commit(0)

    def __enter__(self) -> "SpeculativeCheckpoint":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if not self.closed:
            self.rollback()
