"""The 128-byte lines a launch's prefetch CTAs touch, walked as
``dflash.metal.prefetch.WALK`` walks ``l2_params`` (its index arithmetic in numpy)."""

from __future__ import annotations

from typing import Sequence

import numpy as np

from dflash.metal import prefetch

LINE = prefetch.LINE


def _pieces_taken(fetchers: int, threads: int, pieces: int) -> np.ndarray:
    """Every piece index the kernel's loop hands some thread: CTA ``fetcher``'s thread
    ``t`` takes ``fetcher * threads + t``, then steps by ``fetchers * threads``."""
    lanes = np.arange(threads)
    taken = []
    for fetcher in range(fetchers):
        starts = np.arange(fetcher * threads, pieces, fetchers * threads)
        ids = (starts[:, None] + lanes[None, :]).ravel()
        taken.append(ids[ids < pieces])
    return np.concatenate(taken) if taken else np.zeros(0, dtype=np.int64)


def _lines_of_range(
    start: int, length: int, stride: int, repeats: int, bulk: bool, taken: np.ndarray
) -> np.ndarray:
    """The lines the pieces ``taken`` of one range cover (byte values, not 16-byte
    units): a line prefetch the line its address lies in, a bulk piece every line
    it spans."""
    piece = prefetch.BULK_BYTES if bulk else LINE
    per_run = -(-(length + LINE - 1) // piece)
    run, within = np.divmod(taken, per_run)
    low = start + run * stride
    offset = low - low % LINE + within * piece
    end = low + length
    keep = offset < end
    offset, end = offset[keep], end[keep]
    size = np.minimum(piece, end - offset) if bulk else np.ones_like(offset)
    first = offset // LINE
    counts = -(-(offset + size) // LINE) - first
    # Each piece's lines first .. first + count - 1, laid out flat.
    step = np.arange(counts.sum()) - np.repeat(np.cumsum(counts) - counts, counts)
    return np.repeat(first, counts) + step


def walked_lines(l2_params: Sequence[int], threads: int = 256) -> dict[int, np.ndarray]:
    """The sorted distinct lines some prefetch CTA's piece covers, by array: 0 is
    ``l2_weight``, 1 ``l2_scales`` (both keys always present).

    Every piece ``p`` of a range goes to CTA ``(p // threads) % fetchers``: the pieces
    of all CTAs together are each range's pieces exactly once (checked here).
    """
    fetchers, bulk, count = l2_params[: prefetch.HEAD_WORDS]
    assert fetchers >= 1
    piece = prefetch.BULK_BYTES if bulk else LINE
    found: dict[int, list[np.ndarray]] = {0: [], 1: []}
    for r in range(count):
        at0 = prefetch.HEAD_WORDS + prefetch.RANGE_WORDS * r
        which, start, length, stride, repeats = l2_params[
            at0 : at0 + prefetch.RANGE_WORDS
        ]
        start, length, stride = 16 * start, 16 * length, 16 * stride
        pieces = -(-(length + LINE - 1) // piece) * repeats
        taken = _pieces_taken(fetchers, threads, pieces)
        assert np.array_equal(
            np.bincount(taken, minlength=pieces), np.ones(pieces, int)
        )
        found[which].append(
            _lines_of_range(start, length, stride, repeats, bool(bulk), taken)
        )
    return {which: _distinct(parts) for which, parts in found.items()}


def _distinct(parts: list[np.ndarray]) -> np.ndarray:
    """The sorted distinct values of ``parts`` (non-negative), by a mark per value."""
    if not parts or not sum(len(p) for p in parts):
        return np.zeros(0, dtype=np.int64)
    values = np.concatenate(parts)
    marks = np.zeros(int(values.max()) + 1, dtype=bool)
    marks[values] = True
    return np.flatnonzero(marks)
