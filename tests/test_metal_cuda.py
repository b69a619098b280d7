"""CUDA twin of every kernel, bit-identical to the pure-MLX reference.

Needs mlx's CUDA backend (an NVIDIA GPU); skipped elsewhere. Same properties
as the CPU reference tests, plus the full Muse Glimmer ring geometry, the
checkpoint round trip through all four kernels, the launch counts, and what
``use_kernel=None`` picks on a GPU.
"""

from __future__ import annotations

import dataclasses

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from support.kernel_cases import (
    OPS,
    Case,
    case_strategy,
    check_case,
    check_round_trip,
    glimmer_cases,
)
from support.launches import graph_launches
from support.scalar_bits import assert_scalars_keep_bits
from support.validated import (
    checked_ring_write,
    checked_stage_shadow,
    checked_stage_shadow_kv,
)

from dflash.metal import backend, kernel_backend, restore_rows, retain_rows

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not mx.cuda.is_available(), reason="needs mlx's CUDA backend"),
]

EXAMPLES = 100


def test_backend_is_cuda() -> None:
    assert kernel_backend() == "cuda"


@pytest.mark.parametrize("op", OPS)
def test_cuda_matches_reference(op: str) -> None:
    @settings(max_examples=EXAMPLES, deadline=None)
    @given(case_strategy(op))
    def check(case: Case) -> None:
        assert check_case(case, "kernel") is None, case

    check()


@pytest.mark.parametrize("op", OPS)
def test_gpu_reference_matches_numpy(op: str) -> None:
    @settings(max_examples=30, deadline=None)
    @given(case_strategy(op))
    def check(case: Case) -> None:
        assert check_case(case, "reference") is None, case

    check()


@pytest.mark.parametrize("op", ["retain_rows", "restore_rows"])
def test_cuda_many_planes(op: str) -> None:
    @settings(max_examples=20, deadline=None)
    @given(case_strategy(op, max_capacity=40, max_planes=140))
    def check(case: Case) -> None:
        assert check_case(case, "kernel") is None, case

    check()


@pytest.mark.parametrize("case", glimmer_cases(), ids=lambda c: c.op)
def test_cuda_glimmer_geometry(case: Case) -> None:
    assert check_case(case, "kernel") is None


def test_cuda_round_trip() -> None:
    @settings(max_examples=EXAMPLES, deadline=None)
    @given(case_strategy("restore_rows"), st.data())
    def check(case: Case, data: st.DataObject) -> None:
        case = dataclasses.replace(case, scattered=False)
        accepted = data.draw(st.integers(0, case.count))
        assert check_round_trip(case, accepted, use_kernel=True) is None

    check()


def _planes(count: int) -> list[mx.array]:
    planes = [
        mx.random.normal((1, 2, 64, 16)).astype(mx.bfloat16) for _ in range(count)
    ]
    mx.eval(planes)
    return planes


def test_one_launch_for_all_glimmer_planes(monkeypatch: pytest.MonkeyPatch) -> None:
    # The op's own launches: scalars host-made (their packing has its own tests).
    monkeypatch.setenv(backend.RESIDENT_ENV, "0")
    backend.clear_launch_scalars()  # sets made before keep their route
    planes = _planes(78)
    dests = mx.array(np.tile(np.arange(60, 76) % 64, (78, 1)).astype(np.int32))
    block = retain_rows(planes, dests, use_kernel=True)
    assert graph_launches(block)["CustomKernel"] == 1
    mx.eval(block)
    restored = restore_rows(planes, dests, block, use_kernel=True)
    assert graph_launches(*restored)["CustomKernel"] == 1


def test_auto_picks_the_measured_defaults_on_cuda(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(backend.RESIDENT_ENV, "0")
    backend.clear_launch_scalars()  # sets made before keep their route
    (plane,) = _planes(1)
    rows = mx.zeros((1, 2, 16, 16), dtype=mx.bfloat16)
    dests = mx.array(np.arange(16, dtype=np.int32)[None])
    mx.eval(rows, dests)
    # Shadows: the reference (slices + one concatenate), CUDA's measured default
    # (dflash.metal.backend).
    shadow = graph_launches(checked_stage_shadow(plane, rows, 5, 64))
    assert shadow["CustomKernel"] == 0 and shadow["Gather"] == 0
    forced = graph_launches(checked_stage_shadow(plane, rows, 5, 64, use_kernel=True))
    assert forced["CustomKernel"] == 1
    kv = mx.stack([plane, plane])
    mx.eval(kv)
    pair = graph_launches(*checked_stage_shadow_kv(kv, rows, rows, 5, 64))
    assert pair["CustomKernel"] == 0 and sum(pair.values()) == 2  # stack + concatenate
    pair = graph_launches(
        *checked_stage_shadow_kv(kv, rows, rows, 5, 64, use_kernel=True)
    )
    assert sum(pair.values()) == 1 and pair["CustomKernel"] == 1
    assert graph_launches(retain_rows([plane], dests))["CustomKernel"] == 1
    store = graph_launches(checked_ring_write(plane, rows, 60))
    assert store["CustomKernel"] == 0 and store["ScatterAxis"] == 1
    restore = graph_launches(*restore_rows([plane], dests, rows[None]))
    assert restore["CustomKernel"] == 0 and restore["ScatterAxis"] == 1


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.integers(-(2**31), 2**31 - 1), min_size=1, max_size=40),
    st.lists(st.floats(width=32, allow_nan=False), min_size=1, max_size=40),
)
def test_packed_launch_scalars_keep_every_bit(ints: list, floats: list) -> None:
    """Scalars gathered into device memory equal the host's words bit for bit (signed
    zeros and infinities included), for every count up to and past the packing limit."""
    assert_scalars_keep_bits(ints, mx.int32)
    assert_scalars_keep_bits(floats, mx.float32)


def test_fresh_scalars_cost_one_pack_launch(monkeypatch: pytest.MonkeyPatch) -> None:
    """A new scalar set is one packing launch (reading mlx's host pool), scheduled when
    it is made (so a trace captures its value, not the gather) and memoised: the same
    set again is the same array, no launch."""
    packs = []
    pack_launch = backend.pack_launch

    def counted(words):
        packed = pack_launch(words)
        packs.append(graph_launches(packed))
        return packed

    monkeypatch.setattr(backend, "pack_launch", counted)
    values = (11, 22, 33, 44, 55)
    backend.clear_launch_scalars()
    first = backend.launch_scalars(values)
    assert (
        len(packs) == 1
        and packs[0]["CustomKernel"] == 1
        and sum(packs[0].values()) == 1
    )
    # Already scheduled: its graph is a leaf, nothing left for a reader to launch.
    assert graph_launches(first)["CustomKernel"] == 0
    assert first.tolist() == list(values)
    again = backend.launch_scalars(values)
    assert again is first and len(packs) == 1


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(0, 2**31 - 1), min_size=1, max_size=2 * backend.PACK_SLOTS))
def test_resident_token_ids_are_one_pack_launch(tokens: list) -> None:
    """A block's token ids reach device memory through one packing launch, exact."""
    ids = backend.resident_array(tokens, mx.uint32)
    assert graph_launches(ids)["CustomKernel"] == 1
    assert ids.dtype == mx.uint32 and ids.tolist() == tokens
