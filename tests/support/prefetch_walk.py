"""The 128-byte lines a launch's prefetch CTAs touch, walked as
``dflash.metal.prefetch.WALK`` walks ``l2_params`` (its index arithmetic in Python)."""

from __future__ import annotations

from typing import Sequence

from dflash.metal import prefetch

LINE = prefetch.LINE


def walked_lines(l2_params: Sequence[int], threads: int = 256) -> set[tuple[int, int]]:
    """``(array, line)`` for every line some prefetch CTA's piece covers (a line
    prefetch, the line its address lies in; a bulk piece, every line it spans); array
    0 is ``l2_weight``, 1 ``l2_scales``.

    Every piece ``p`` of a range goes to CTA ``(p // threads) % fetchers``: the pieces
    of all CTAs together are each range's pieces exactly once.
    """
    fetchers, bulk, count = l2_params[: prefetch.HEAD_WORDS]
    assert fetchers >= 1
    piece = prefetch.BULK_BYTES if bulk else LINE
    lines: set[tuple[int, int]] = set()
    for r in range(count):
        at0 = prefetch.HEAD_WORDS + prefetch.RANGE_WORDS * r
        which, start, length, stride, repeats = l2_params[
            at0 : at0 + prefetch.RANGE_WORDS
        ]
        start, length, stride = 16 * start, 16 * length, 16 * stride
        per_run = -(-(length + LINE - 1) // piece)
        taken = []
        for fetcher in range(fetchers):
            p = fetcher * threads
            while p < per_run * repeats:
                taken.extend(range(p, min(p + threads, per_run * repeats)))
                p += fetchers * threads
        assert sorted(taken) == list(range(per_run * repeats))
        for p in taken:
            run, within = divmod(p, per_run)
            low = start + run * stride
            offset = low - low % LINE + within * piece
            end = low + length
            if offset >= end:
                continue
            size = min(piece, end - offset) if bulk else 1
            lines.update(
                (which, i) for i in range(offset // LINE, -(-(offset + size) // LINE))
            )
    return lines
