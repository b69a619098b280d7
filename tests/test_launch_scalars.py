"""Launch scalars: host-made or gathered into device memory, the same words either way.

On CUDA a launch's runtime scalars are gathered by one small kernel from mlx's host
pool into device memory (:func:`dflash.metal.backend.launch_scalars`); elsewhere, and
inside ``mx.compile`` traces, they are host-made. Here the gather runs as its reference
(the kernel itself is compile-checked in ``test_metal_compile`` and run on the H200 in
``test_metal_cuda``).
"""

from __future__ import annotations

import contextlib
import io
import math
from typing import Iterator

import mlx.core as mx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from support.scalar_bits import assert_scalars_keep_bits

from dflash.metal import backend, groups


@contextlib.contextmanager
def cuda_route() -> Iterator[list]:
    """The CUDA route with the gather replaced by its reference (each gather's words
    recorded), the switch unset and fresh memos; everything restored after."""
    launched = []

    def pack(words):
        assert len(words) % 2 == 0 and len(words) <= 2 * backend.PACK_SLOTS
        launched.append(tuple(words))
        return backend.reference_pack(words)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(backend, "BACKEND", backend.CUDA)
        patch.setattr(backend, "NATIVE_BACKEND", backend.CUDA)
        patch.delenv(backend.RESIDENT_ENV, raising=False)
        patch.setattr(backend, "pack_launch", pack)
        backend.clear_launch_scalars()
        try:
            yield launched
        finally:
            backend.clear_launch_scalars()


@pytest.fixture
def resident():
    """:func:`cuda_route` for one test."""
    with cuda_route() as launched:
        yield launched


@settings(max_examples=40, deadline=None)
@given(
    st.lists(st.integers(-(2**31), 2**31 - 1), min_size=1, max_size=40),
    st.lists(st.floats(width=32), min_size=1, max_size=40),
)
def test_gathered_scalars_keep_every_bit(ints: list, floats: list) -> None:
    """Every count (odd, even, past the gather's limit) and every float (signed zeros,
    infinities, NaN) comes back with the host's exact words, dtype and length."""
    with cuda_route():
        assert_scalars_keep_bits(ints, mx.int32)
        assert_scalars_keep_bits(floats, mx.float32)


@settings(max_examples=40, deadline=None)
@given(
    st.lists(st.integers(-(2**31), 2**31 - 1), min_size=1, max_size=20),
    st.lists(st.floats(-1e6, 1e6, width=32), min_size=1, max_size=20),
)
def test_launch_scalars_are_never_a_small_pool_array(ints: list, floats: list) -> None:
    """A launch's scalar arrays hold at least 16 bytes (mlx's CUDA allocator puts
    host-made arrays of at most 8 bytes in a pool of host memory every warp would read
    in place), their values first, in order, then zeros."""
    for values, make, dtype in (
        (ints, groups.int_params, mx.int32),
        (floats, groups.float_params, mx.float32),
    ):
        array = make(*values)
        assert array.dtype == dtype and array.nbytes >= 16
        assert array.tolist()[: len(values)] == values
        assert array.tolist()[len(values) :] == [0] * (array.size - len(values))


def _pending_ops(array: mx.array) -> list:
    """The ops still to run to make ``array`` (none once it is scheduled)."""
    dot = io.StringIO()
    mx.export_to_dot(dot, array)
    return [line for line in dot.getvalue().splitlines() if "shape=rectangle" in line]


def test_gathered_sets_are_scheduled_when_made(resident: list) -> None:
    """A gathered set is scheduled as it is made: an ``mx.compile`` trace that captures
    the memoised array (a bound launch plan) holds its value, not the gather, which a
    lazy capture would run again at every replay."""
    ints, floats = groups.int_params(3, 1, 4, 1, 5), groups.float_params(9.0, 2.0)
    assert resident and _pending_ops(ints) == [] and _pending_ops(floats) == []
    host = mx.array([1, 2, 3])[:2]  # the check itself sees a lazy array's ops
    assert _pending_ops(host)


def test_memoised_stand_ins_are_scheduled_when_made() -> None:
    groups.unused_input.cache_clear()
    assert _pending_ops(groups.unused_input(mx.float16)) == []


def test_one_gather_per_distinct_scalar_set(resident: list) -> None:
    first = groups.int_params(1, 2, 3)
    assert groups.int_params(1, 2, 3) is first
    assert resident == [(1, 2, 3, 0)]  # padded to MIN_PARAMS
    groups.int_params(1, 2, 4)
    assert len(resident) == 2


def test_signed_zeros_are_distinct_scalar_sets(resident: list) -> None:
    """Memo keys are the words: ``-0.0`` never gets ``0.0``'s array (as equal values
    would)."""
    plus, minus = groups.float_params(0.0), groups.float_params(-0.0)
    assert plus is not minus
    assert math.copysign(1.0, minus.tolist()[0]) == -1.0
    assert math.copysign(1.0, plus.tolist()[0]) == 1.0


def test_long_sets_stay_host_made(resident: list) -> None:
    values = list(range(2 * backend.PACK_SLOTS + 1))
    assert backend.launch_scalars(values).tolist() == values
    assert resident == []


def test_switch_off_and_traces_get_host_made_scalars(
    resident: list, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(backend.RESIDENT_ENV, "0")
    assert groups.int_params(5, 6).tolist() == [5, 6, 0, 0]
    monkeypatch.delenv(backend.RESIDENT_ENV)
    # The route is decided when a set is made: the memoised host-made set stays.
    assert groups.int_params(5, 6).tolist() == [5, 6, 0, 0]

    def traced(x):
        assert backend.tracing()
        return x + groups.int_params(7, 8)

    out = backend.compile_traced(traced)(mx.zeros((4,), mx.int32))
    assert out.tolist() == [7, 8, 0, 0]
    assert resident == []  # neither the switch's nor the trace's scalars were gathered
    assert groups.int_params(7, 8).tolist() == [7, 8, 0, 0]  # outside: its own set
    assert resident == [(7, 8, 0, 0)]


def test_bad_switch_and_dtype_fail_closed(
    resident: list, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(backend.RESIDENT_ENV, "maybe")
    with pytest.raises(ValueError, match=backend.RESIDENT_ENV):
        groups.int_params(1)
    monkeypatch.delenv(backend.RESIDENT_ENV)
    with pytest.raises(ValueError, match="int32 or float32"):
        backend.launch_scalars([1], mx.float16)
    assert resident == []


def test_routes_faked_as_cuda_never_gather(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without mlx's CUDA backend nothing gathers, even where tests and host-cost stubs
    route as on CUDA (the gather would be a real launch)."""
    if backend.NATIVE_BACKEND == backend.CUDA:
        pytest.skip("on CUDA the gather is the point")
    monkeypatch.setattr(backend, "BACKEND", backend.CUDA)
    assert not backend.resident_wanted()
    assert groups.int_params(9).tolist() == [9, 0, 0, 0]


@settings(max_examples=40, deadline=None)
@given(
    st.lists(st.integers(0, 2**31 - 1), max_size=40),
    st.lists(st.integers(-(2**31), 2**31 - 1), max_size=40),
)
def test_resident_arrays_keep_every_value(tokens: list, signed: list) -> None:
    """Token ids (uint32) and signed rows (int32) come back exact, in order, with their
    dtype and length, gathered (at most ``2 * PACK_SLOTS``) or host-made (longer)."""
    with cuda_route() as launched:
        for values, dtype in ((tokens, mx.uint32), (signed, mx.int32)):
            array = backend.resident_array(values, dtype)
            assert array.dtype == dtype and array.shape == (len(values),)
            assert array.tolist() == values
        fits = [v for v in (tokens, signed) if 0 < len(v) <= 2 * backend.PACK_SLOTS]
        assert len(launched) == len(fits)


def test_resident_arrays_are_not_memoised(resident: list) -> None:
    """Each call is its own gather (block ids change every round; a memo would only
    grow), and never a launch-scalar memo entry."""
    first = backend.resident_array([5, 7, 7])
    again = backend.resident_array([5, 7, 7])
    assert first is not again and resident == [(5, 7, 7, 0), (5, 7, 7, 0)]
    assert backend._scalars.cache_info().currsize == 0


def test_resident_arrays_fail_closed(resident: list) -> None:
    with pytest.raises(ValueError, match="do not fit"):
        backend.resident_array([1, 2**31], mx.uint32)
    with pytest.raises(ValueError, match="do not fit"):
        backend.resident_array([-1], mx.uint32)
    with pytest.raises(ValueError, match="uint32 or int32"):
        backend.resident_array([1], mx.float32)
    assert resident == []


def test_resident_arrays_off_the_gather_route_are_host_made(
    resident: list, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(backend.RESIDENT_ENV, "0")
    assert backend.resident_array([3, 4]).tolist() == [3, 4]
    monkeypatch.delenv(backend.RESIDENT_ENV)

    def traced(x):
        return x + backend.resident_array([1, 2], mx.int32)

    out = backend.compile_traced(traced)(mx.zeros((2,), mx.int32))
    assert out.tolist() == [1, 2] and resident == []
