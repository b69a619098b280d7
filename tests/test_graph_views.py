"""The one-node views the traced route builds each forward (session 61), and the
counters feed that cuts a replay's regions with one split.

Every graph node is host work each time a forward is built, replayed and encoded,
so these views replace a slice and a reshape (or squeeze) by one node: they must
read exactly the elements the two-node forms read, whatever the input's layout (a
strided input is copied first, never misread).
"""

from __future__ import annotations

import re
from collections import Counter

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dflash.metal import groups
from dflash.metal.layout import (
    contiguous_view,
    leading_view,
    row_major_strides,
    stacked_halves,
)


def _nodes(tmp_path, *arrays: mx.array) -> Counter:
    """The primitives of the graph that makes ``arrays``, by name."""
    dot = tmp_path / "graph.dot"
    mx.export_to_dot(str(dot), *arrays)
    return Counter(re.findall(r'label ="([A-Za-z_0-9]+)"', dot.read_text()))


@settings(max_examples=60, deadline=None)
@given(shape=st.lists(st.integers(1, 6), min_size=1, max_size=5))
def test_row_major_strides_are_numpys(shape) -> None:
    want = np.zeros(shape, dtype=np.int8).strides
    assert row_major_strides(tuple(shape)) == tuple(want)


@settings(max_examples=60, deadline=None)
@given(
    shape=st.lists(st.integers(1, 5), min_size=4, max_size=4),
    dtype=st.sampled_from([mx.bfloat16, mx.float16, mx.float32]),
    transposed=st.booleans(),
)
def test_stacked_halves_are_the_leading_halves(shape, dtype, transposed) -> None:
    """Any stacked ``(2, B, ...)`` array, row-contiguous or not (a transposed one is
    copied first, never misread)."""
    kv = mx.random.normal((2, *shape)).astype(dtype)
    if transposed:
        kv = kv.transpose(0, 1, 2, 4, 3)
    keys, values = stacked_halves(kv)
    for got, index in ((keys, 0), (values, 1)):
        want = leading_view(kv, index)
        assert got.shape == want.shape and got.dtype == want.dtype
        assert mx.array_equal(got, want).item()


def test_stacked_halves_are_two_nodes_for_both_halves(tmp_path) -> None:
    """One reshape and one split where the leading views make a slice and a squeeze
    a half."""
    kv = mx.zeros((2, 1, 2, 8, 4))
    mx.eval(kv)
    assert _nodes(tmp_path, *stacked_halves(kv)) == Counter(Reshape=1, Split=1)
    both = (leading_view(kv, 0), leading_view(kv, 1))
    assert _nodes(tmp_path, *both) == Counter(Slice=2, Squeeze=2)


@settings(max_examples=80, deadline=None)
@given(
    lead=st.lists(st.integers(1, 4), min_size=1, max_size=3),
    width=st.integers(1, 7),
    before=st.integers(0, 9),
    after=st.integers(0, 9),
)
def test_contiguous_view_is_the_slice_reshaped(lead, width, before, after) -> None:
    """``prod(shape)`` elements from ``offset`` of a flat buffer, as the slice and
    reshape it replaces read them (one node, a view)."""
    count = int(np.prod(lead)) * width
    flat = mx.arange(before + count + after, dtype=mx.int32)
    got = contiguous_view(flat, (*lead, width), before)
    want = flat[before : before + count].reshape(*lead, width)
    assert got.shape == want.shape and mx.array_equal(got, want).item()


def test_contiguous_view_of_a_strided_array_reads_its_logical_elements() -> None:
    """mlx flattens the input first (a copy where it is not row-contiguous), so the
    view reads the logical row-major elements of any layout, never the buffer's."""
    square = mx.arange(16, dtype=mx.int32).reshape(4, 4).T
    got = contiguous_view(square, (2, 4), 4)
    assert got.tolist() == square.reshape(-1)[4:12].reshape(2, 4).tolist()


def test_contiguous_view_is_one_node(tmp_path) -> None:
    flat = mx.arange(24, dtype=mx.int32)
    mx.eval(flat)
    assert _nodes(tmp_path, contiguous_view(flat, (2, 3), 6)) == Counter(AsStrided=1)


# ------------------------------------------------------------------ counters feed


@settings(max_examples=40, deadline=None)
@given(sizes=st.lists(st.integers(1, 6), min_size=1, max_size=5))
def test_a_counted_feed_hands_out_the_counted_regions_in_order(sizes) -> None:
    """Given the sizes a counting pass recorded, the regions are consecutive and
    cover the array (a lone region is the array itself)."""
    source = mx.arange(sum(sizes), dtype=mx.int32)
    feed = groups.CounterFeed(source, sizes)
    with groups.counter_feed(feed):
        regions = [groups.launch_counters(size) for size in sizes]
    assert feed.taken == sum(sizes)
    start = 0
    for size, region in zip(sizes, regions):
        assert region.tolist() == list(range(start, start + size))
        start += size
    if len(sizes) == 1:
        assert regions[0] is source


def test_a_counting_feed_records_each_regions_size() -> None:
    counting = groups.CounterFeed()
    with groups.counter_feed(counting):
        for size in (3, 1, 4):
            groups.launch_counters(size)
        groups.launch_counters(0)  # the placeholder: no region
    assert counting.sizes == [3, 1, 4] and counting.taken == 8


def test_a_counted_feed_refuses_a_call_that_launches_otherwise() -> None:
    """A region of another size than counted, one more than counted, or an array
    that does not hold the counted regions: an error, never an overlap."""
    feed = groups.CounterFeed(mx.arange(7, dtype=mx.int32), [3, 4])
    with groups.counter_feed(feed):
        groups.launch_counters(3)
        with pytest.raises(RuntimeError, match="counted as regions"):
            groups.launch_counters(2)
        assert feed.taken == 3  # the refused call took nothing
        groups.launch_counters(4)
        with pytest.raises(RuntimeError, match="counter feed of 7"):
            groups.launch_counters(1)
    short = groups.CounterFeed(mx.arange(6, dtype=mx.int32), [3, 4])
    with groups.counter_feed(short), pytest.raises(RuntimeError, match="was given"):
        groups.launch_counters(3)


def test_a_counted_feed_cuts_with_one_split(tmp_path) -> None:
    source = mx.arange(9, dtype=mx.int32)
    mx.eval(source)
    feed = groups.CounterFeed(source, [2, 3, 4])
    with groups.counter_feed(feed):
        regions = [groups.launch_counters(size) for size in (2, 3, 4)]
    assert _nodes(tmp_path, *regions) == Counter(Split=1)


@settings(max_examples=50, deadline=None)
@given(
    size=st.integers(1, 40),
    counts=st.lists(st.integers(1, 12), min_size=1, max_size=30),
)
def test_pool_regions_are_cut_ahead_and_never_shared(size, counts) -> None:
    """Regions of each size come from one split of a fill, in order; no counter is
    handed out twice, and each region reads zeros."""
    pool = groups.CounterPool(size)
    cells = set()
    for count in counts:
        fill, start, region = pool.take_located(count)
        assert region.shape == (count,) and not region.any().item()
        if count <= size:
            assert 0 <= start and start + count <= size
            mine = {(fill, start + i) for i in range(count)}
            assert not mine & cells
            cells |= mine


@pytest.mark.parametrize("takes", [1, 5, 8, 9, 20])
def test_pool_regions_cost_a_quarter_node_each(tmp_path, takes) -> None:
    """Regions are cut eight at a time (one slice of the fill, one split), so a
    replay's region is a quarter of a node where a slice a region was one."""
    pool = groups.CounterPool(256)
    regions = [pool.take(4) for _ in range(takes)]
    nodes = _nodes(tmp_path, *regions)
    cuts = -(-takes // groups.REGIONS_A_CUT)
    assert nodes["Split"] == cuts and nodes["Slice"] <= cuts, nodes
    assert pool.fills == 1


# ------------------------------------------------------------------ the count tool


def test_graph_nodes_counts_a_verify_layer_without_shape_only_views() -> None:
    """``benchmarks.graph_nodes`` at the tensor-core widths: nine launches a layer,
    one view a member of the MLP's fused gate / up, none of the attention's q / k / v
    / gate (the head prep and the gated fold read them in place in the fused output),
    none of the planes' and blocks' halves (bound stacked), no reshape, squeeze or
    transpose, one split (the counters') (session 61: 22.25 nodes a layer, from 38.25;
    with the members read in place, 18.25; with the planes bound stacked, 14.75)."""
    from benchmarks import graph_nodes

    result = graph_nodes.main(["--geometry", "wide", "--layers", "2"])
    per_layer = result["by_primitive_per_layer"]
    assert result["launches_per_layer"] == 9
    assert per_layer["AsStrided"] == 2  # the MLP's gate / up
    assert not {"Squeeze", "Transpose", "Reshape"} & set(per_layer), per_layer
    assert per_layer.get("Slice", 0) <= 0.5, per_layer  # the pool's, cut ahead
    assert per_layer.get("Split", 0) <= 1.5, per_layer
    assert result["nodes_per_layer"] <= 16, per_layer


def test_planes_bound_as_halves_take_a_reshape_and_split_each(monkeypatch) -> None:
    """With ``DFLASH_STACKED_KV=0`` the plane's buffer and the held-back block are
    handed over as views of their halves: two more nodes each (18.25 a layer)."""
    from benchmarks import graph_nodes

    monkeypatch.setenv("DFLASH_STACKED_KV", "0")
    result = graph_nodes.main(["--geometry", "wide", "--layers", "2"])
    per_layer = result["by_primitive_per_layer"]
    assert result["launches_per_layer"] == 9
    assert per_layer["Reshape"] >= 1.5 and per_layer["Split"] >= 2.5, per_layer
    assert result["nodes_per_layer"] <= 20, per_layer
