"""KV planes: append arithmetic, fail-closed writes, ring contents in logical order."""

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from dflash.cache import (
    CacheDiscontinuity,
    ContextOverflow,
    GrowingPlane,
    KvPlane,
    RingPlane,
)
from dflash.cache.plane import row_axis


def make_plane(window, **kwargs) -> KvPlane:
    """A ring of ``window`` rows, or a growing plane for ``window=None``."""
    return RingPlane(window, **kwargs) if window else GrowingPlane(**kwargs)


def chunk(first: int, count: int, head_major: bool, heads: int = 2, dim: int = 3):
    """Rows whose every element encodes its absolute position (and head / dim)."""
    pos = np.arange(first, first + count, dtype=np.float32)[:, None, None]
    data = (
        pos * 100 + np.arange(heads)[None, :, None] * 10 + np.arange(dim)[None, None, :]
    )
    data = data[None]  # (1, S, H, D): token-major
    if head_major:
        data = data.transpose(0, 2, 1, 3)
    return mx.array(data)


def logical_positions(plane: KvPlane) -> list:
    keys, _ = plane.logical_rows()
    axis = row_axis(plane.head_major)
    rows = np.array(keys).take(0, axis=0)  # drop batch
    rows = rows if axis == 1 else rows.transpose(1, 0, 2)
    return [int(round(r[0, 0] / 100)) for r in rows]


@given(
    capacity=st.integers(1, 64),
    ring=st.booleans(),
    chunks=st.lists(st.integers(1, 80), min_size=1, max_size=8),
)
def test_append_batch_matches_a_window_of_positions(capacity, ring, chunks):
    plane = make_plane(capacity if ring else None)
    if not ring:
        plane.capacity = (
            10_000  # storage reserved up front; only bookkeeping is tested here
        )
    written = 0
    for count in chunks:
        source_first, source_count = plane.append_batch(written, count)
        written += count
        live = min(written, capacity) if ring else written
        assert plane.len == live
        assert plane.origin_logical == written - live
        assert plane.offset == written
        assert plane.origin_physical == (plane.origin_logical % capacity if ring else 0)
        # The surviving rows of the chunk are exactly those inside the window.
        assert source_first == max(0, count - live)
        assert source_first + source_count == count


@given(
    capacity=st.integers(1, 40),
    head_major=st.booleans(),
    chunks=st.lists(st.integers(1, 50), min_size=1, max_size=6),
)
def test_ring_holds_the_last_window_in_logical_order(capacity, head_major, chunks):
    plane = RingPlane(capacity, head_major=head_major)
    written = 0
    for count in chunks:
        plane.write(
            written,
            chunk(written, count, head_major),
            chunk(written, count, head_major),
        )
        written += count
        assert (
            plane.keys.shape[row_axis(head_major)] == capacity
        )  # never grows past capacity
        assert logical_positions(plane) == list(
            range(max(0, written - capacity), written)
        )


@given(
    head_major=st.booleans(),
    chunks=st.lists(st.integers(1, 300), min_size=1, max_size=4),
)
def test_growing_plane_keeps_every_row_from_zero(head_major, chunks):
    plane = GrowingPlane(head_major=head_major)
    written = 0
    for count in chunks:
        plane.write(
            written,
            chunk(written, count, head_major),
            chunk(written, count, head_major),
        )
        written += count
    assert plane.origin_logical == 0 and plane.origin_physical == 0
    assert logical_positions(plane) == list(range(written))
    assert plane.capacity % 256 == 0 and plane.capacity >= written


@pytest.mark.parametrize("ring", [True, False])
@pytest.mark.parametrize("start", [3, 5, 0])
def test_discontinuous_write_is_refused_before_any_change(ring, start):
    plane = make_plane(8 if ring else None)
    plane.write(0, chunk(0, 4, True), chunk(0, 4, True))
    before = (plane.meta, np.array(plane.keys))
    with pytest.raises(CacheDiscontinuity) as error:
        plane.write(start, chunk(start, 2, True), chunk(start, 2, True))
    assert error.value.expected == 4 and error.value.got == start
    assert "expected logical position 4" in str(error.value)
    assert plane.meta == before[0]
    np.testing.assert_array_equal(np.array(plane.keys), before[1])


def test_write_past_max_context_is_refused():
    plane = GrowingPlane(max_context=10)
    plane.write(0, chunk(0, 8, True), chunk(0, 8, True))
    with pytest.raises(ContextOverflow):
        plane.write(8, chunk(8, 3, True), chunk(8, 3, True))
    assert plane.len == 8


def test_mismatched_rows_are_refused():
    plane = RingPlane(8)
    plane.write(0, chunk(0, 2, True), chunk(0, 2, True))
    with pytest.raises(ValueError, match="another model"):
        plane.write(2, chunk(2, 2, True, heads=3), chunk(2, 2, True, heads=3))
    assert plane.offset == 2
