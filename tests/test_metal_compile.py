"""Compile checks of every kernel body, and the Metal bodies run on the CPU.

* g++ syntax-checks every Metal body inside the signature mlx generates
  (``-Wall -Wextra -Werror``), against ``tests/support/shim_metal.h``;
* nvcc compiles every CUDA body to PTX inside the signature mlx generates;
* a deliberately broken body must fail both, so the checks cannot pass vacuously;
* the Metal translation units are compiled for real and driven thread by
  thread (grid rounded up to whole threadgroups, canaries past every output),
  plugged into the wrappers' kernel paths, and compared bit for bit with the
  references over random geometries, including Metal's per-launch plane limit.

Each test skips when its compiler is absent.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Iterator

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from support.compile_check import (
    CUDA_CHECK_PLANES,
    check_cuda,
    check_metal,
    check_specs,
)
from support.compilers import GXX, NVCC, built_emulator, needs_gxx, needs_nvcc
from support.kernel_cases import (
    OPS,
    Case,
    case_strategy,
    check_case,
    check_round_trip,
    glimmer_cases,
)
from support.metal_emulator import MetalEmulator

from dflash.metal import backend, restore_rows, retain_rows
from dflash.metal.sources import BACKENDS, PROLOGUES, RING_WRITE, restore_spec

EXAMPLES = 40


def _broken_spec():
    body = RING_WRITE.body.replace("out[gid] = ring[gid];", "out[gid] = rign[gid];")
    assert body != RING_WRITE.body
    return dataclasses.replace(RING_WRITE, body=body)


def test_backends_share_one_body() -> None:
    for spec in check_specs():
        for name in BACKENDS:
            assert spec.source(name) == PROLOGUES[name] + spec.body
    # The prologues only name the thread index: no row, wrap or plane math.
    for prologue in PROLOGUES.values():
        assert prologue.count(";") == 1 and "gid" in prologue
        assert "%" not in prologue and "params" not in prologue


def test_kernel_names_track_source() -> None:
    spec = restore_spec(3)
    assert spec.name("metal") != spec.name("cuda")
    assert _broken_spec().name("cuda") != RING_WRITE.name("cuda")


@needs_gxx
def test_metal_bodies_compile(tmp_path: Path) -> None:
    result = check_metal(check_specs(), tmp_path, GXX)
    assert result.ok, f"{result.command}\n{result.log}"


@needs_nvcc
def test_cuda_bodies_compile(tmp_path: Path) -> None:
    result = check_cuda(check_specs(CUDA_CHECK_PLANES), tmp_path, NVCC)
    assert result.ok, f"{result.command}\n{result.log}"


@needs_gxx
def test_broken_metal_body_fails(tmp_path: Path) -> None:
    result = check_metal([_broken_spec()], tmp_path, GXX)
    assert not result.ok and "rign" in result.log


@needs_nvcc
def test_broken_cuda_body_fails(tmp_path: Path) -> None:
    result = check_cuda([_broken_spec()], tmp_path, NVCC)
    assert not result.ok and "rign" in result.log


# ------------------------------------------------------------------ emulator


@pytest.fixture(scope="module")
def emulator(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MetalEmulator]:
    """Route the wrappers' kernel paths through the Metal bodies on the CPU."""
    emu = built_emulator(MetalEmulator, tmp_path_factory, "metal_emu", check_specs())
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(backend, "BACKEND", "metal")
        patch.setattr(backend, "launch", emu.launch)
        yield emu


@pytest.mark.parametrize("op", OPS)
def test_emulated_metal_matches_reference(emulator: MetalEmulator, op: str) -> None:
    @settings(max_examples=EXAMPLES, deadline=None)
    @given(case_strategy(op))
    def check(case: Case) -> None:
        assert check_case(case, "kernel") is None, case

    check()


def test_emulated_metal_round_trip(emulator: MetalEmulator) -> None:
    @settings(max_examples=EXAMPLES, deadline=None)
    @given(case_strategy("restore_rows"), st.data())
    def check(case: Case, data: st.DataObject) -> None:
        case = dataclasses.replace(case, scattered=False)
        accepted = data.draw(st.integers(0, case.count))
        assert check_round_trip(case, accepted, use_kernel=True) is None

    check()


def test_emulated_metal_glimmer_geometry(emulator: MetalEmulator) -> None:
    for case in glimmer_cases():
        small = dataclasses.replace(case, planes=min(case.planes, 30))
        assert check_case(small, "kernel") is None, small


@pytest.mark.parametrize(
    "planes, retain_launches, restore_launches", [(3, 1, 1), (30, 2, 3)]
)
def test_metal_plane_limit_chunks_launches(
    emulator: MetalEmulator, planes: int, retain_launches: int, restore_launches: int
) -> None:
    rng = np.random.default_rng(planes)
    buffers = [
        mx.array(rng.standard_normal((1, 2, 6, 4)).astype(np.float16))
        for _ in range(planes)
    ]
    dests = mx.array(
        np.stack([rng.permutation(6)[:2] for _ in range(planes)]).astype(np.int32)
    )
    before = emulator.launches
    block = retain_rows(buffers, dests, use_kernel=True)
    assert emulator.launches - before == retain_launches
    before = emulator.launches
    restore_rows(buffers, dests, block, use_kernel=True)
    assert emulator.launches - before == restore_launches
