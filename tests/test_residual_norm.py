"""Residual norm (a branch's post-norm, the residual add and the next pre-norm in one
launch): reference, Metal body, CUDA twin.

What is proven where:

* CPU (CI): the Metal body compiles (g++ against the Metal shim) and the CUDA twin to
  PTX (nvcc, when installed). The emulated Metal body equals, bit for bit, a NumPy
  oracle of the documented arithmetic (tests/support/residual_norm_oracle.py) over
  dtypes, row widths of every branch of mlx's dispatch rule, rows, weights and
  epsilons, with and without the next norm; each row gets the bits it gets alone; the
  results are close to float64 maths; two mutants (mlx's block size ignored, the next
  norm reading the branch) fail. Bad arguments raise before anything runs.
* CUDA (tests marked ``cuda``): the kernel gives the bits of mlx's own ops (the
  reference: ``residual + rms_norm``, ``rms_norm``) and is batch-invariant.
"""

from __future__ import annotations

import dataclasses
import functools
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support.compilers import GXX, NVCC, built_emulator, needs_gxx, needs_nvcc
from support.group_emulator import GroupEmulator, check_cuda, check_metal
from support.residual_norm_oracle import oracle_residual_norm
from support.tensor_emulator import TensorEmulator, route_launches_to

from dflash.metal import backend, groups
from dflash.metal import norms as rn

cuda = pytest.mark.skipif(not mx.cuda.is_available(), reason="needs mlx's CUDA backend")
_SHARED = [HealthCheck.function_scoped_fixture]


def _mutant(name: str, old: str, new: str):
    spec = rn.RESIDUAL_NORM
    assert old in spec.body
    return dataclasses.replace(
        spec, base=f"{spec.base}_{name}", body=spec.body.replace(old, new)
    )


MUTANTS = {
    # Every row cut as 128 threads, whatever block mlx takes for the width.
    "block": _mutant("block", "const int block = params[1];", "const int block = 128;"),
    # The next norm reads the branch instead of the sum.
    "next": _mutant("next", "values[s] = float(sum_value);", "(void)sum_value;"),
}


@pytest.fixture(scope="module")
def emulator(tmp_path_factory):
    specs = list(rn.SPECS) + list(MUTANTS.values())
    return built_emulator(GroupEmulator, tmp_path_factory, "residual_norm_emu", specs)


@pytest.fixture
def metal_on_cpu(emulator, monkeypatch):
    monkeypatch.setattr(backend, "BACKEND", "metal")
    monkeypatch.setattr(groups, "launch_groups", emulator.launch)
    return emulator


# Widths that take each branch of mlx's dispatch rule (for 8-element vectors: one
# chunk of 64 threads; 128-thread chunks; 64-thread chunks; 128 threads rounded up,
# Muse Glimmer's 6,656 among them), some not whole vectors.
DIMS = (24, 100, 512, 1024, 1536, 2048, 3000, 3072, 5000, 6656)


@dataclasses.dataclass(frozen=True)
class Case:
    dtype: mx.Dtype
    dim: int
    rows: int
    next: bool
    eps: float
    next_eps: float
    seed: int

    def arrays(self):
        keys = mx.random.split(mx.random.key(self.seed), 4)
        shape = (1, self.rows, self.dim)
        branch = (mx.random.normal(shape, key=keys[0]) * 3.0).astype(self.dtype)
        residual = (mx.random.normal(shape, key=keys[1]) * 2.0).astype(self.dtype)
        weight = (1.0 + 0.3 * mx.random.normal((self.dim,), key=keys[2])).astype(
            self.dtype
        )
        next_weight = (1.0 + 0.3 * mx.random.normal((self.dim,), key=keys[3])).astype(
            self.dtype
        )
        return branch, residual, weight, next_weight if self.next else None

    def call(self, use_kernel, branch=None, residual=None):
        given_branch, given_residual, weight, next_weight = self.arrays()
        return rn.residual_norm(
            given_branch if branch is None else branch,
            given_residual if residual is None else residual,
            weight,
            self.eps,
            next_weight=next_weight,
            next_eps=self.next_eps if self.next else None,
            use_kernel=use_kernel,
        )


@st.composite
def cases(draw, dims=DIMS, max_rows=5):
    dtype = draw(st.sampled_from(rn.DTYPES))
    dim = draw(st.sampled_from([d for d in dims if rn.kernel_serves(d, dtype)]))
    return Case(
        dtype,
        dim,
        draw(st.integers(1, max_rows)),
        draw(st.booleans()),
        draw(st.sampled_from([1e-5, 1e-6, 1e-8])),
        draw(st.sampled_from([1e-5, 1e-8])),
        draw(st.integers(0, 2**16)),
    )


def _bits(array: mx.array) -> np.ndarray:
    return np.array(array.astype(mx.float32))


def _same_bits(got, want) -> bool:
    return all(
        (g is None and w is None)
        or np.array_equal(_bits(g) if isinstance(g, mx.array) else g, _bits(w))
        for g, w in zip(got, want)
    )


def assert_each_row_gets_its_bits_alone(case: Case) -> None:
    """Each row of a block, run through the kernel, equals that row run alone."""
    branch, residual, _, _ = case.arrays()
    together = case.call(True)
    for row in range(case.rows):
        alone = case.call(True, branch[:, row : row + 1], residual[:, row : row + 1])
        part = [t[:, row : row + 1] if t is not None else None for t in together]
        assert _same_bits(alone, part), (case, row)


# ------------------------------------------------------------------ compile


@needs_gxx
def test_metal_body_compiles(tmp_path: Path) -> None:
    result = check_metal(rn.SPECS, tmp_path, GXX)
    assert result.ok, f"{result.command}\n{result.log}"


@needs_nvcc
def test_cuda_body_compiles(tmp_path: Path) -> None:
    result = check_cuda(rn.SPECS, tmp_path, NVCC)
    assert result.ok, f"{result.command}\n{result.log}"


def test_geometry_is_mlxs_dispatch_rule() -> None:
    """(block, chunks) per width as mlx 0.32.4's rms_norm dispatch picks them."""
    bf16 = mx.bfloat16
    assert rn.norm_geometry(512, bf16) == (64, 1)  # <= 64 vectors
    assert rn.norm_geometry(2048, bf16) == (128, 2)  # 256 vectors: 128 x 2
    assert rn.norm_geometry(1536, bf16) == (64, 3)  # 192 vectors: 64 x 3
    assert rn.norm_geometry(6656, bf16) == (128, 7)  # 832: neither, 128 rounded up
    assert rn.norm_geometry(8192, bf16) == (128, 8)
    assert rn.norm_geometry(8200, bf16) is None  # mlx's 1,024-thread kernel
    assert rn.norm_geometry(4096, mx.float32) == (128, 8)
    assert rn.norm_geometry(6656, mx.float32) is None
    assert not rn.kernel_serves(6656, mx.float32)


# ----------------------------------------------------------- emulated body


@settings(max_examples=40, deadline=None, suppress_health_check=_SHARED)
@given(case=cases())
def test_emulated_kernel_gives_the_oracle_bits(metal_on_cpu, case: Case) -> None:
    branch, residual, weight, next_weight = case.arrays()
    got = case.call(True)
    want = oracle_residual_norm(
        branch, residual, weight, case.eps, next_weight, case.next_eps
    )
    assert got[1] is None if not case.next else got[1].shape == branch.shape
    assert all(
        w is None or np.array_equal(_bits(g), w) for g, w in zip(got, want)
    ), case


@settings(max_examples=15, deadline=None, suppress_health_check=_SHARED)
@given(case=cases(dims=(100, 1536, 6656), max_rows=4))
def test_each_row_of_a_block_gets_the_bits_it_gets_alone(
    metal_on_cpu, case: Case
) -> None:
    assert_each_row_gets_its_bits_alone(case)


def _float64_norm(rows: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    scale = 1.0 / np.sqrt((rows * rows).mean(axis=-1, keepdims=True) + eps)
    return rows * scale * weight


@settings(max_examples=20, deadline=None, suppress_health_check=_SHARED)
@given(case=cases())
def test_emulated_kernel_is_close_to_float64_maths(metal_on_cpu, case: Case) -> None:
    branch, residual, weight, next_weight = case.arrays()
    h, normed = case.call(True)
    as64 = lambda a: np.array(a.astype(mx.float32)).astype(np.float64)  # noqa: E731
    want_h = as64(residual) + _float64_norm(as64(branch), as64(weight), case.eps)
    ulp = {mx.bfloat16: 2.0**-7, mx.float16: 2.0**-10, mx.float32: 2.0**-22}
    tolerance = 4 * ulp[case.dtype] * (np.abs(want_h) + np.abs(as64(residual)) + 1)
    assert np.all(np.abs(as64(h) - want_h) <= tolerance), case
    if case.next:
        want = _float64_norm(as64(h), as64(next_weight), case.next_eps)
        assert np.all(
            np.abs(as64(normed) - want) <= 4 * ulp[case.dtype] * (np.abs(want) + 1)
        ), case


# The CUDA copies' negative control: the residual's vectors past the first copied one
# vector early.
CUDA_MUTANT = _mutant(
    "late",
    "residual_copy[i] = *reinterpret_cast<const uint4*>(residual + base + v * VEC);",
    "residual_copy[i] = *reinterpret_cast<const uint4*>(residual + base + (v - (v > 0)) * VEC);",
)


def _butterfly(name: str, levels) -> str:
    return "\n".join(
        f"    {name} = {name} + __shfl_xor_sync(0xffffffffu, {name}, {m});"
        for m in levels
    )


# The warps' shuffle trees' negative control: the lanes' butterfly in rising order
# (pairs lanes 1 apart first: another association than mlx's halving tree).
CUDA_RISING = _mutant(
    "rising",
    _butterfly("lanes", (16, 8, 4, 2, 1)),
    _butterfly("lanes", (1, 2, 4, 8, 16)),
)


@pytest.fixture(scope="module")
def cuda_emulator(tmp_path_factory):
    with_branches = functools.partial(TensorEmulator, cuda_branches=True)
    specs = list(rn.SPECS) + [CUDA_MUTANT, CUDA_RISING]
    return built_emulator(with_branches, tmp_path_factory, "residual_norm_cuda", specs)


@pytest.fixture
def cuda_on_cpu(cuda_emulator, monkeypatch):
    """The CUDA text run on the CPU (its 16-byte copies; misaligned: its element reads)."""
    route_launches_to(cuda_emulator, monkeypatch)
    cuda_emulator.misaligned = False
    yield cuda_emulator
    cuda_emulator.misaligned = False


@settings(max_examples=30, deadline=None, suppress_health_check=_SHARED)
@given(case=cases(), misaligned=st.booleans())
def test_emulated_cuda_text_gives_the_oracle_bits_copied_or_read_by_element(
    cuda_on_cpu, case: Case, misaligned: bool
) -> None:
    """The CUDA form's vector copies (rows of whole 16-byte vectors) and its element
    reads (other widths, or inputs off a 16-byte boundary) give the same bits."""
    cuda_on_cpu.misaligned = misaligned
    branch, residual, weight, next_weight = case.arrays()
    got = case.call(True)
    want = oracle_residual_norm(
        branch, residual, weight, case.eps, next_weight, case.next_eps
    )
    assert all(
        w is None or np.array_equal(_bits(g), w) for g, w in zip(got, want)
    ), case


def test_cuda_copies_mutant_fails_copied_and_not_read_by_element(
    cuda_on_cpu, monkeypatch
) -> None:
    """Negative control: a slip in the 16-byte copies shows on aligned rows (so the
    test above runs them) and not where the element reads serve."""
    monkeypatch.setattr(rn, "RESIDUAL_NORM", CUDA_MUTANT)
    case = Case(mx.bfloat16, 1024, 2, True, 1e-6, 1e-5, 3)
    branch, residual, weight, next_weight = case.arrays()
    want = oracle_residual_norm(
        branch, residual, weight, case.eps, next_weight, case.next_eps
    )
    for misaligned, differs in ((False, True), (True, False)):
        cuda_on_cpu.misaligned = misaligned
        got = case.call(True)
        same = all(np.array_equal(_bits(g), w) for g, w in zip(got, want))
        assert same != differs, misaligned


def test_cuda_rising_butterfly_mutant_fails_the_oracle(
    cuda_on_cpu, monkeypatch
) -> None:
    """Negative control: the shuffle trees' order shows in the bits (so the oracle test
    above checks that the CUDA text adds a warp's sums in mlx's order)."""
    monkeypatch.setattr(rn, "RESIDUAL_NORM", CUDA_RISING)
    case = Case(mx.float32, 768, 16, True, 1e-8, 1e-5, 11)
    branch, residual, weight, next_weight = case.arrays()
    want = oracle_residual_norm(
        branch, residual, weight, case.eps, next_weight, case.next_eps
    )
    got = case.call(True)
    assert not all(np.array_equal(_bits(g), w) for g, w in zip(got, want))


@pytest.mark.parametrize("name", sorted(MUTANTS))
def test_mutants_fail_the_oracle(metal_on_cpu, monkeypatch, name: str) -> None:
    """Negative controls: the oracle test would catch a wrong cut or a wrong input."""
    monkeypatch.setattr(rn, "RESIDUAL_NORM", MUTANTS[name])
    # float32 keeps the normalizer's last bits (bf16 rounding may hide a reordering).
    case = Case(mx.float32, 768, 16, True, 1e-8, 1e-5, 11)
    branch, residual, weight, next_weight = case.arrays()
    got = case.call(True)
    want = oracle_residual_norm(
        branch, residual, weight, case.eps, next_weight, case.next_eps
    )
    assert not all(np.array_equal(_bits(g), w) for g, w in zip(got, want))


# ---------------------------------------------------------- the wrapper


def test_reference_is_mlx_lms_ops_in_order() -> None:
    case = Case(mx.bfloat16, 256, 3, True, 1e-8, 1e-5, 5)
    branch, residual, weight, next_weight = case.arrays()
    h, normed = case.call(False)
    want_h = residual + mx.fast.rms_norm(branch, weight, 1e-8)
    assert _same_bits(
        [h, normed], [want_h, mx.fast.rms_norm(want_h, next_weight, 1e-5)]
    )
    alone = rn.residual_norm(branch, residual, weight, 1e-8, use_kernel=False)
    assert alone[1] is None and _same_bits([alone[0]], [want_h])


def test_cpu_takes_the_reference_unless_told(monkeypatch) -> None:
    monkeypatch.setattr(backend, "BACKEND", None)
    calls = []
    monkeypatch.setattr(groups, "launch_groups", lambda *a, **k: calls.append(a))
    x, w = mx.zeros((1, 2, 64)), mx.ones((64,))
    rn.residual_norm(x, x, w, 1e-5)
    assert not calls
    with pytest.raises(RuntimeError, match="use_kernel=True"):
        rn.residual_norm(x, x, w, 1e-5, use_kernel=True)


@pytest.mark.parametrize(
    "branch, residual, weight, extra, message",
    [
        ((1, 2, 64), (1, 3, 64), (64,), {}, "share one shape"),
        ((1, 2, 64), (1, 2, 64), (32,), {}, "weight must be"),
        ((1, 2, 64), (1, 2, 64), (64,), {"next_weight": (63,)}, "next_weight must"),
        ((1, 2, 64), (1, 2, 64), (64,), {"next_weight": (64,)}, "next_eps"),
        ((1, 2, 64), (1, 2, 64), None, {}, "weight is required"),
    ],
)
def test_bad_arguments_raise_before_anything_runs(
    monkeypatch, branch, residual, weight, extra, message
) -> None:
    calls = []
    monkeypatch.setattr(groups, "launch_groups", lambda *a, **k: calls.append(a))
    arguments = dict(extra)
    if "next_weight" in arguments:
        arguments["next_weight"] = mx.ones(arguments["next_weight"])
    with pytest.raises(ValueError, match=message):
        rn.residual_norm(
            mx.zeros(branch),
            mx.zeros(residual),
            None if weight is None else mx.ones(weight),
            1e-5,
            use_kernel=True,
            **arguments,
        )
    assert not calls


def test_mismatched_dtypes_raise() -> None:
    with pytest.raises(ValueError, match="share one of"):
        rn.residual_norm(
            mx.zeros((1, 1, 32), mx.bfloat16),
            mx.zeros((1, 1, 32)),
            mx.ones((32,)),
            1e-5,
        )


# --------------------------------------------------------------------- CUDA


@pytest.mark.cuda
@cuda
@settings(max_examples=60, deadline=None)
@given(case=cases(max_rows=17))
def test_cuda_kernel_gives_mlxs_bits(case: Case) -> None:
    assert _same_bits(case.call(True), case.call(False)), case


@pytest.mark.cuda
@cuda
@pytest.mark.parametrize("rows", [1, 16])
@pytest.mark.parametrize("next", [False, True])
@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float16])
def test_cuda_kernel_gives_mlxs_bits_at_glimmer_shapes(rows, next, dtype) -> None:
    for seed in range(4):
        case = Case(dtype, 6656, rows, next, 1e-8, 1e-5, seed)
        assert _same_bits(case.call(True), case.call(False)), case


@pytest.mark.cuda
@cuda
@settings(max_examples=20, deadline=None)
@given(case=cases(max_rows=16))
def test_cuda_kernel_is_batch_invariant(case: Case) -> None:
    assert_each_row_gets_its_bits_alone(case)


# ------------------------------------------------------- replayed launches


def test_replayed_launch_traces_once_per_geometry_and_gives_the_direct_outputs(
    monkeypatch,
) -> None:
    """With compiling on, a launch's Python (mlx's binding included) runs once per
    geometry; later calls replay it with their own inputs, so their outputs are the
    direct launch's. A geometry seen before is not traced again."""
    traced = []

    def fake_launch(spec, inputs, output_shapes, output_dtypes, groups_count, dtype):
        traced.append(tuple(output_shapes[0]))
        branch, residual = inputs[0], inputs[1]
        return [branch * 2 + residual, residual - branch]

    monkeypatch.setenv(backend.COMPILE_ENV, "1")
    monkeypatch.setattr(groups, "launch_groups", fake_launch)
    monkeypatch.setattr(groups, "_REPLAYS", {})
    spec = rn.RESIDUAL_NORM
    for step in range(4):
        for rows in (1, 16):
            a = mx.random.normal((rows, 8), key=mx.random.key(step))
            b = mx.random.normal((rows, 8), key=mx.random.key(step + 100))
            got = groups.launch_replayed(
                spec, [a, b], [(rows, 8), (rows, 8)], [a.dtype] * 2, rows, a.dtype
            )
            assert mx.array_equal(got[0], a * 2 + b) and mx.array_equal(got[1], b - a)
    assert traced == [(1, 8), (16, 8)]
    monkeypatch.setenv(backend.COMPILE_ENV, "0")
    groups.launch_replayed(spec, [a, b], [(16, 8), (16, 8)], [a.dtype] * 2, 16, a.dtype)
    assert traced == [(1, 8), (16, 8), (16, 8)]  # not compiled: the direct launch
