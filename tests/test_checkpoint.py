"""Speculative checkpoint: begin -> write block -> commit(n) equals appending only n rows."""

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dflash.cache import (
    GrowingPlane,
    RingKVCache,
    RingPlane,
    RollbackError,
    SpeculativeCheckpoint,
)
from dflash.cache.plane import ring_indices, take_rows


def random_rows(rng, count, head_major, dtype):
    shape = (1, 2, count, 3) if head_major else (1, count, 2, 3)
    return mx.array(rng.standard_normal(shape).astype(np.float32)).astype(dtype)


def random_history(rng, rows, head_major, dtype, longest):
    """``rows`` rows as chunks of 1 to ``longest - 1`` rows (keys equal values): varied
    chunks put a ring at arbitrary rotations before the block."""
    history = []
    while rows:
        count = int(min(rows, rng.integers(1, longest)))
        history.append((random_rows(rng, count, head_major, dtype),) * 2)
        rows -= count
    return history


def build(capacity, ring, head_major, history):
    plane = (
        RingPlane(capacity, head_major=head_major)
        if ring
        else GrowingPlane(head_major=head_major)
    )
    position = 0
    for keys, values in history:
        plane.write(position, keys, values)
        position = plane.offset
    return plane


def live_bits(plane):
    """The live window's rows as they sit physically (uint8 view), plus all metadata."""
    if plane.keys is None:
        return plane.meta, None, None
    rows = ring_indices(plane.origin_physical, 0, plane.len, max(plane.capacity, 1))
    keys = take_rows(plane.keys, rows, plane.head_major)
    values = take_rows(plane.values, rows, plane.head_major)
    as_bits = lambda a: np.array(
        a.view(mx.uint8) if a.dtype != mx.bfloat16 else a.view(mx.uint16)
    )
    return plane.meta, as_bits(keys), as_bits(values)


def split_block(block, cut, head_major):
    """The block as one or two chunks (the draft model writes its block in pieces)."""
    if cut is None:
        return [block]
    first = take_rows(block, slice(0, cut), head_major)
    second = take_rows(block, slice(cut, None), head_major)
    return [first, second]


@settings(max_examples=400)
@given(
    capacity=st.integers(1, 64),
    head_major=st.booleans(),
    ring=st.booleans(),
    start_len=st.integers(0, 140),
    block=st.integers(1, 20),
    cut=st.one_of(st.none(), st.integers(1, 19)),
    dtype=st.sampled_from([mx.float32, mx.float16, mx.bfloat16]),
    seed=st.integers(0, 2**16),
)
def test_commit_equals_sequential_append_of_the_accepted_rows(
    capacity, head_major, ring, start_len, block, cut, dtype, seed
):
    rng = np.random.default_rng(seed)
    history = random_history(rng, start_len, head_major, dtype, 40)
    block_keys = random_rows(rng, block, head_major, dtype)
    block_values = random_rows(rng, block, head_major, dtype)
    if cut is not None and cut >= block:
        cut = None
    for accepted in range(block + 1):
        plane = build(capacity, ring, head_major, history)
        checkpoint = SpeculativeCheckpoint.begin([plane], block)
        if ring:
            assert checkpoint.retained_bytes <= min(block, capacity) * plane.row_bytes
        else:
            assert checkpoint.retained_bytes == 0
        start = plane.offset
        for keys, values in zip(
            split_block(block_keys, cut, head_major),
            split_block(block_values, cut, head_major),
        ):
            plane.write(plane.offset, keys, values)
        checkpoint.commit(accepted)

        expected = build(capacity, ring, head_major, history)
        if accepted:
            rows = slice(0, accepted)
            expected.write(
                start,
                take_rows(block_keys, rows, head_major),
                take_rows(block_values, rows, head_major),
            )
        got_meta, got_keys, got_values = live_bits(plane)
        want_meta, want_keys, want_values = live_bits(expected)
        if ring:
            assert got_meta == want_meta
        else:
            # A growing plane's storage may have grown for the block; the rows did not.
            assert (
                got_meta.len,
                got_meta.origin_logical,
                got_meta.origin_physical,
            ) == (want_meta.len, 0, 0)
        np.testing.assert_array_equal(got_keys, want_keys)
        np.testing.assert_array_equal(got_values, want_values)


def muse_like_planes(window=32, rings=3):
    planes = [RingPlane(window, layer=i) for i in range(rings)]
    planes.append(GrowingPlane(layer=rings))
    rows = mx.ones((1, 2, 70, 4))
    for plane in planes:
        plane.write(0, rows, rows)
    return planes


def test_retained_bytes_are_block_rows_of_rings_only():
    planes = muse_like_planes()
    checkpoint = SpeculativeCheckpoint.begin(planes, 16)
    assert checkpoint.retained_bytes == 0  # begin records bookkeeping only
    rows = mx.zeros((1, 2, 16, 4))
    planes[0].write(
        planes[0].offset, rows, rows
    )  # the first write retains for every ring
    row = 2 * 4 * 4 * 2  # heads x dim x float32 x (K and V)
    assert checkpoint.retained_bytes == 3 * 16 * row
    checkpoint.rollback()


def test_a_staged_block_is_held_back_and_retains_nothing():
    planes = [RingKVCache(32, layer=i) for i in range(3)]
    rows = mx.ones((1, 2, 70, 4))
    for plane in planes:
        plane.update_and_fetch(rows, rows)
    before = [live_bits(plane) for plane in planes]
    checkpoint = SpeculativeCheckpoint.begin(planes, 16)
    block = mx.full((1, 2, 16, 4), 3.0)
    for plane in planes:
        plane.update_and_fetch(block, block)
    assert checkpoint.retained_bytes == 0
    assert all(plane.guard.mode == "deferred" for plane in planes)
    checkpoint.rollback()
    for plane, (meta, keys, values) in zip(planes, before):
        got = live_bits(plane)
        assert got[0] == meta
        np.testing.assert_array_equal(got[1], keys)
        np.testing.assert_array_equal(got[2], values)


def test_writing_past_the_checkpointed_block_is_refused_before_any_change():
    planes = muse_like_planes()
    checkpoint = SpeculativeCheckpoint.begin(planes, 4)
    rows = mx.zeros((1, 2, 5, 4))
    before = planes[0].meta
    with pytest.raises(RollbackError, match="exceeds the checkpointed block"):
        planes[0].write(planes[0].offset, rows, rows)
    assert planes[0].meta == before
    checkpoint.rollback()


def test_commit_refuses_more_rows_than_written_and_a_second_commit():
    planes = muse_like_planes()
    checkpoint = SpeculativeCheckpoint.begin(planes, 4)
    rows = mx.zeros((1, 2, 2, 4))
    for plane in planes:
        plane.write(plane.offset, rows, rows)
    with pytest.raises(RollbackError, match="wrote 2 rows but 3"):
        checkpoint.commit(3)
    assert all(plane.offset == 72 for plane in planes)  # nothing changed
    checkpoint.commit(2)
    with pytest.raises(RollbackError, match="already committed"):
        checkpoint.rollback()


def test_an_exception_mid_round_rolls_back():
    planes = muse_like_planes()
    before = [live_bits(plane) for plane in planes]
    rows = mx.full((1, 2, 3, 4), 7.0)
    with pytest.raises(RuntimeError):
        with SpeculativeCheckpoint.begin(planes, 3):
            planes[0].write(planes[0].offset, rows, rows)
            planes[1].write(planes[1].offset, rows, rows)
            raise RuntimeError("forward failed half way")
    for plane, (meta, keys, values) in zip(planes, before):
        got = live_bits(plane)
        assert got[0] == meta
        np.testing.assert_array_equal(got[1], keys)
        np.testing.assert_array_equal(got[2], values)
        assert not plane.checkpointed


def test_begin_refuses_foreign_caches_and_nested_checkpoints():
    from mlx_lm.models.cache import KVCache

    with pytest.raises(ValueError, match="not a dflash KV plane"):
        SpeculativeCheckpoint.begin([KVCache()], 2)
    planes = muse_like_planes()
    checkpoint = SpeculativeCheckpoint.begin(planes, 2)
    with pytest.raises(RollbackError, match="already has an open checkpoint"):
        SpeculativeCheckpoint.begin(planes, 2)
    checkpoint.rollback()


def fetched_bits(pair):
    return [np.array(a.astype(mx.float32)) for a in pair]


@settings(max_examples=200, deadline=None)
@given(
    window=st.integers(1, 40),
    ring=st.booleans(),
    start_len=st.integers(0, 90),
    block=st.integers(1, 20),
    cut=st.one_of(st.none(), st.integers(1, 19)),
    checkpointed=st.booleans(),
    fetch=st.booleans(),
    dtype=st.sampled_from([mx.float32, mx.bfloat16]),
    seed=st.integers(0, 2**16),
)
def test_a_stacked_block_writes_and_fetches_what_its_halves_do(
    window, ring, start_len, block, cut, checkpointed, fetch, dtype, seed
):
    """``update_and_fetch_block(stack([k, v]))`` (what the head prep hands a plane)
    returns the rows ``update_and_fetch(k, v)`` returns and leaves the same cache, staged
    or written, held back or retained, at every accepted count. With ``fetch=False``
    it returns None only where the rows stay in the buffer or the held-back block,
    and the cache ends the same."""
    from dflash.cache import GrowingKVCache

    rng = np.random.default_rng(seed)
    history = random_history(rng, start_len, True, dtype, 30)
    block_keys = random_rows(rng, block, True, dtype)
    block_values = random_rows(rng, block, True, dtype)
    if cut is not None and cut >= block:
        cut = None
    chunks = list(
        zip(split_block(block_keys, cut, True), split_block(block_values, cut, True))
    )

    def run(stacked, accepted):
        cache = RingKVCache(window) if ring else GrowingKVCache()
        for keys, values in history:
            cache.update_and_fetch(keys, values)
        checkpoint = (
            SpeculativeCheckpoint.begin([cache], block) if checkpointed else None
        )
        fetched = []
        for keys, values in chunks:
            staged = ring and cache.is_staged(keys.shape[2])
            if stacked:
                pair = cache.update_and_fetch_block(
                    mx.stack([keys, values]), fetch=fetch
                )
            else:
                pair = cache.update_and_fetch(keys, values)
            if pair is None:
                # Nothing gathered: the rows the queries read are still in place.
                held = getattr(cache.guard, "pending", None) is not None
                assert not fetch and cache.kv is not None and (held or not staged)
            fetched.append(None if pair is None else fetched_bits(pair))
        if checkpoint is not None:
            checkpoint.commit(accepted)
        return fetched, live_bits(cache)

    for accepted in range(block + 1) if checkpointed else [block]:
        got_fetched, (got_meta, got_keys, got_values) = run(True, accepted)
        want_fetched, (want_meta, want_keys, want_values) = run(False, accepted)
        assert got_meta == want_meta
        np.testing.assert_array_equal(got_keys, want_keys)
        np.testing.assert_array_equal(got_values, want_values)
        for got, want in zip(got_fetched, want_fetched):
            for g, w in zip(got or want, want):
                np.testing.assert_array_equal(g, w)


@pytest.mark.parametrize("ring", [True, False])
def test_a_stacked_block_of_the_wrong_shape_is_refused_before_any_change(ring):
    from dflash.cache import CacheError, GrowingKVCache

    cache = RingKVCache(8) if ring else GrowingKVCache()
    rows = mx.ones((1, 2, 5, 4))
    cache.update_and_fetch(rows, rows)
    before = live_bits(cache)
    for bad in (
        mx.ones((1, 2, 3, 4)),  # not stacked
        mx.ones((3, 1, 2, 3, 4)),  # three halves
        mx.ones((2, 1, 3, 3, 4)),  # another head count
        mx.ones((2, 1, 2, 3, 4), mx.float16),  # another dtype
    ):
        with pytest.raises(CacheError):
            cache.update_and_fetch_block(bad)
        after = live_bits(cache)
        assert after[0] == before[0]
        np.testing.assert_array_equal(after[1], before[1])


def test_a_held_back_block_is_not_gathered_unless_asked():
    """``fetch=False`` on a ring with a buffer: the held-back block returns None (the
    route reads the ring and the block in place); without a checkpoint the staged chunk
    is stored at once and its shadow comes back (the only copy of the evicted rows)."""
    rows = mx.ones((1, 2, 8, 4))
    block = mx.stack([mx.zeros((1, 2, 4, 4))] * 2)
    cache = RingKVCache(8)
    cache.update_and_fetch(rows, rows)
    checkpoint = SpeculativeCheckpoint.begin([cache], 4)
    assert cache.update_and_fetch_block(block, fetch=False) is None
    checkpoint.rollback()
    keys, values = cache.update_and_fetch_block(block, fetch=False)
    assert keys.shape == (1, 2, 12, 4)
