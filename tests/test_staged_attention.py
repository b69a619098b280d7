"""Staged ("attend before overwrite") attention equals a full-history window-masked oracle."""

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dflash.cache import RingKVCache, staged_window_mask
from dflash.verify.reference import ReferenceKVCache, reference_attention


def attend(queries, keys, values, mask, scale):
    return mx.fast.scaled_dot_product_attention(
        queries, keys, values, scale=scale, mask=mask
    )


@settings(max_examples=150)
@given(
    window=st.integers(1, 48),
    chunks=st.lists(st.integers(1, 40), min_size=1, max_size=6),
    seed=st.integers(0, 2**16),
)
def test_staged_chunks_match_the_full_history_oracle(window, chunks, seed):
    rng = np.random.default_rng(seed)
    ring, oracle = RingKVCache(window), ReferenceKVCache(window)
    scale = 0.25
    for count in chunks:
        shape = (1, 2, count, 8)
        queries = mx.array(rng.standard_normal((1, 4, count, 8)).astype(np.float32))
        keys = mx.array(rng.standard_normal(shape).astype(np.float32))
        values = mx.array(rng.standard_normal(shape).astype(np.float32))
        start = ring.offset
        mask = ring.make_mask(count, window_size=window)
        got = attend(queries, *ring.update_and_fetch(keys, values), mask, scale)
        full_keys, full_values = oracle.update_and_fetch(keys, values)
        positions = mx.arange(start, start + count)
        want = reference_attention(
            queries, full_keys, full_values, positions, window, scale
        )
        np.testing.assert_allclose(np.array(got), np.array(want), rtol=2e-5, atol=2e-5)
        assert ring.keys.shape[2] == min(window, ring.capacity)


def test_staged_mask_is_the_documented_band():
    # A full ring of W = 4 about to take S = 3 rows: query i sees shadow columns i+1 .. W+i.
    mask = np.array(staged_window_mask(3, 4, 4))
    for i in range(3):
        assert [j for j in range(7) if mask[i, j]] == list(range(i + 1, 4 + i + 1))


@settings(max_examples=60)
@given(
    queries=st.integers(1, 80),
    old_len=st.integers(0, 90),
    window=st.integers(1, 64),
)
def test_staged_mask_is_the_band_whether_memoised_or_not(queries, old_len, window):
    mask = np.array(staged_window_mask(queries, old_len, window))
    i = np.arange(queries)[:, None] + old_len
    j = np.arange(old_len + queries)[None]
    assert np.array_equal(mask, (j <= i) & (j > i - window))
    # Verify-sized masks are memoised (one upload serves every round); prefill-sized are not.
    again = staged_window_mask(queries, old_len, window)
    assert (again is staged_window_mask(queries, old_len, window)) == (queries <= 64)


def test_seam_crossing_chunk_is_staged_and_ring_stays_at_capacity():
    ring = RingKVCache(8)
    rows = mx.ones((1, 1, 6, 2))
    ring.update_and_fetch(rows, rows)
    mask = ring.make_mask(5)
    keys, _ = ring.update_and_fetch(mx.ones((1, 1, 5, 2)), mx.ones((1, 1, 5, 2)))
    assert mask.shape == (5, 11) and keys.shape[2] == 11  # shadow: 6 old rows + 5 new
    assert ring.keys.shape[2] == 8 and ring.len == 8 and ring.origin_physical == 3


def test_mask_for_another_window_is_refused():
    with pytest.raises(ValueError, match="window"):
        RingKVCache(8).make_mask(4, window_size=16)
