"""dflash.metal.prefetch: launches that also ask the next matmul's first weights into
the L2. The walk's ranges cover exactly the first columns' weights and those columns'
scales in every chunk (walked as the CUDA text walks them), the launches carrying it
compile for sm_90, its switch refuses bad values, and a plan hands the kernel the
arrays the matmul's own launch reads (the scales as a uint32 view, no copy)."""

from __future__ import annotations

import re
from pathlib import Path

import mlx.core as mx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from support.compilers import NVCC, needs_nvcc
from support.group_emulator import check_cuda
from support.prefetch_walk import LINE, walked_lines

from dflash.metal import norms, prefetch, tensor_qmm
from dflash.metal.groups import GroupKernelSpec
from dflash.metal.sources import METAL

MB = 2**20


@needs_nvcc
def test_the_residual_norm_carrying_prefetch_ctas_compiles_for_sm90(
    tmp_path: Path,
) -> None:
    spec = prefetch.with_prefetch(norms.RESIDUAL_NORM)
    result = check_cuda(
        [spec],
        tmp_path,
        NVCC,
        dtypes=(mx.bfloat16, mx.float16, mx.float32),
        flags=("-Xptxas", "-v"),
    )
    assert result.ok, f"{result.command}\n{result.log}"
    assert "spill" not in result.log.replace("0 bytes spill", "")


def test_with_prefetch_appends_its_inputs_and_walks_before_the_body() -> None:
    spec = prefetch.with_prefetch(norms.RESIDUAL_NORM)
    assert prefetch.with_prefetch(norms.RESIDUAL_NORM) is spec  # built once
    assert spec.input_names == norms.RESIDUAL_NORM.input_names + prefetch.INPUT_NAMES
    assert spec.body.endswith(norms.RESIDUAL_NORM.body)
    assert spec.body.index("prefetch.global.L2") < spec.body.index(
        norms.RESIDUAL_NORM.body
    )
    assert spec.base != norms.RESIDUAL_NORM.base and spec.backends == ("cuda",)
    metal_only = GroupKernelSpec(
        base="m", input_names=(), input_types=(), output_names=(), output_types=(),
        helpers="", body="", threads=32, backends=(METAL,),
    )  # fmt: skip
    with pytest.raises(ValueError, match="no CUDA form"):
        prefetch.with_prefetch(metal_only)


@settings(max_examples=40, deadline=None)
@given(
    columns=st.integers(1, 600).map(lambda n: 8 * n),
    chunks=st.integers(1, 30),
    group=st.sampled_from([32, 64, 128]),
    megabytes=st.integers(1, 8),
    fetchers=st.integers(1, 40),
)
def test_prefix_ranges_cover_the_first_columns_weights_and_their_scales_exactly(
    columns: int, chunks: int, group: int, megabytes: int, fetchers: int
) -> None:
    """The lines walked are the first ``taken`` columns' weight rows (whole columns, at
    most ``megabytes``) and, in each chunk of the chunk-major repack, the same columns'
    scales and biases; nothing else."""
    depth = 256 * chunks
    row_bytes = depth // 2
    weight_bytes = columns * row_bytes
    per_column = 2 * (256 // group) * 2  # scales and biases side by side, bf16
    scales_shape = (chunks, columns, 2 * (256 // group))
    scales_bytes = chunks * columns * per_column
    ranges = prefetch.prefix_ranges(
        (columns, depth // 8), weight_bytes, scales_shape, scales_bytes, megabytes
    )
    taken = min(weight_bytes, megabytes * MB) // row_bytes
    got = walked_lines(prefetch.params_of(ranges, fetchers), threads=64)
    assert got[0].tolist() == list(range(taken * row_bytes // LINE))
    scales = set(got[1].tolist())
    want = set()
    if taken * per_column % 16 == 0 and columns * per_column % 16 == 0:
        for chunk in range(chunks):
            first = chunk * columns * per_column
            want.update(range(first // LINE, -(-(first + taken * per_column) // LINE)))
    assert scales == want
    assert taken * row_bytes <= megabytes * MB


def test_prefix_ranges_take_mlx_layout_scales_as_a_prefix_and_none_when_too_small():
    ranges = prefetch.prefix_ranges((64, 128), 64 * 512, (64, 16), 64 * 32, 1)
    assert ranges == [(0, 0, 64 * 512, 0, 1), (1, 0, 64 * 32, 0, 1)]
    # Less than a column's row asked for: nothing.
    assert prefetch.prefix_ranges((4, 2**20), 4 * 2**22, None, 0, 1) == []


def test_params_refuse_unaligned_ranges_and_values_past_int32() -> None:
    with pytest.raises(ValueError, match="not 16-byte aligned"):
        prefetch.params_of([(0, 8, 16, 0, 1)], 4)
    with pytest.raises(ValueError, match="int32"):
        prefetch.params_of([(0, 0, 2**36, 0, 1)], 4)
    assert prefetch.params_of([(1, 32, 64, 16, 3)], 4, bulk=True) == [
        4, 1, 1, 1, 2, 4, 1, 3,
    ]  # fmt: skip


def test_the_switch_takes_whole_megabytes_and_refuses_the_rest(monkeypatch) -> None:
    monkeypatch.delenv(prefetch.PREFETCH_ENV, raising=False)
    assert prefetch.megabytes_wanted() == prefetch.DEFAULT_MEGABYTES
    assert prefetch.megabytes_wanted(0) == 0
    monkeypatch.setenv(prefetch.PREFETCH_ENV, "24")
    assert prefetch.megabytes_wanted() == 24
    assert prefetch.megabytes_wanted(3) == 3  # the argument decides
    for bad in ("1.5", "lots", "-1", "2000"):
        monkeypatch.setenv(prefetch.PREFETCH_ENV, bad)
        with pytest.raises(ValueError, match=prefetch.PREFETCH_ENV):
            prefetch.megabytes_wanted()


def test_a_plan_hands_the_matmuls_own_arrays_and_the_scales_as_words_unchanged():
    weight = mx.random.randint(0, 2**30, (512, 256 // 8)).astype(mx.uint32)
    repack = mx.random.normal((1, 512, 8)).astype(mx.bfloat16)
    mx.eval(weight, repack)
    before = mx.get_active_memory()
    plan = prefetch.plan((weight, repack), 1)
    assert plan.weight is weight and plan.fetchers == prefetch.FETCHERS
    assert plan.scales.dtype == mx.uint32 and plan.scales.nbytes == repack.nbytes
    assert mx.array_equal(mx.view(plan.scales, mx.bfloat16), repack).item()
    # A view of the repack's buffer, not a copy (the params are a few words).
    assert mx.get_active_memory() - before < 4096
    assert plan.params.tolist()[:3] == [prefetch.FETCHERS, 0, 2]
    assert plan.inputs == [plan.weight, plan.scales, plan.params]
    # It plans those very arrays, at that size: not equal copies, not another size.
    assert plan.plans((weight, repack), 1)
    assert not plan.plans((weight, repack), 2)
    assert not plan.plans((weight, mx.array(repack)), 1)
    assert not plan.plans((weight,), 1)
    assert prefetch.plan((weight, repack), 0) is None
    assert prefetch.plan((), 4) is None
    # Scales whose rows are no whole words: the weights alone, the weights again.
    odd = mx.zeros((1, 512, 3), dtype=mx.bfloat16)
    alone = prefetch.plan((weight, odd), 1)
    assert alone.scales is weight and alone.params.tolist()[2] == 1


cuda = pytest.mark.skipif(not mx.cuda.is_available(), reason="needs mlx's CUDA backend")


@pytest.mark.cuda
@cuda
@pytest.mark.parametrize("rows", [1, 16])
def test_cuda_a_norm_carrying_prefetch_ctas_gives_its_own_bits(rows: int) -> None:
    """The residual norm with 32 prefetch CTAs over a gate / up-sized weight and its
    chunk-major repack gives the plain launch's outputs bit for bit (the CTAs only
    issue prefetches), with and without the next norm; the words are a view."""
    dim, columns, chunks = 6656, 8192, 26
    weight = mx.random.randint(0, 2**30, (columns, dim // 8)).astype(mx.uint32)
    repack = mx.random.normal((chunks, columns, 8)).astype(mx.bfloat16)
    mx.eval(weight, repack)
    before = mx.get_active_memory()
    plan = prefetch.plan((weight, repack), 16)
    assert mx.get_active_memory() - before < 2**16
    key = mx.random.key(rows)
    branch, residual = mx.random.normal((2, 1, rows, dim), key=key).astype(mx.bfloat16)
    norm_weight = (1 + 0.1 * mx.random.normal((dim,))).astype(mx.bfloat16)
    next_weight = (1 + 0.1 * mx.random.normal((dim,))).astype(mx.bfloat16)
    for nxt in (None, next_weight):
        eps_next = None if nxt is None else 1e-6
        plain = norms.kernel_residual_norm(
            branch, residual, norm_weight, 1e-6, nxt, eps_next
        )
        carried = norms.kernel_residual_norm(
            branch, residual, norm_weight, 1e-6, nxt, eps_next, plan
        )
        mx.eval(plain, carried)
        assert mx.array_equal(plain[0], carried[0]).item()
        if nxt is not None:
            assert mx.array_equal(plain[1], carried[1]).item()


def _shipped_matmul_forms() -> list:
    """The tensor-core matmul kernels Glimmer's verify calls launch by default (the
    two-K-group forms: 4-bit groups of 64 in place, denormal and scaled, and dense),
    at both row tiles."""
    keys = [(4, 1), (4, 2)]
    return (
        [tensor_qmm.IN_PLACE_SPECS[(2, key, 64)] for key in keys]
        + [tensor_qmm.DENORMAL_SPECS[(2, key, 64)] for key in keys]
        + [tensor_qmm.SCALED_SPECS[(2, key, 64)] for key in keys]
        + [tensor_qmm.FORM_SPECS[(False, 2)][(0, rows)] for rows in (1, 2)]
    )


@needs_nvcc
def test_matmuls_carrying_prefetch_ctas_compile_for_sm90_without_spills(
    tmp_path: Path,
) -> None:
    """Each shipped matmul form carrying prefetch CTAs compiles within its launch
    bounds (at most 128 registers a thread, no spill): the walk must not push the
    body's registers."""
    specs = [tensor_qmm.carrier_spec(spec) for spec in _shipped_matmul_forms()]
    result = check_cuda(
        specs, tmp_path, NVCC, dtypes=(mx.bfloat16,), flags=("-Xptxas", "-v")
    )
    assert result.ok, f"{result.command}\n{result.log}"
    spills = re.findall(
        r"(\d+) bytes spill stores, (\d+) bytes spill loads", result.log
    )
    assert spills and all(a == "0" and b == "0" for a, b in spills), result.log
    registers = [int(r) for r in re.findall(r"Used (\d+) registers", result.log)]
    assert len(registers) >= len(specs) and max(registers) <= 128, result.log


def test_a_carrier_keeps_the_body_and_refuses_cluster_and_persistent_forms() -> None:
    form = tensor_qmm.IN_PLACE_SPECS[(2, (4, 2), 64)]
    carrier = tensor_qmm.carrier_spec(form)
    assert carrier.body.endswith(form.body)
    assert carrier.shared_memory == form.shared_memory
    assert carrier.input_names == form.input_names + prefetch.INPUT_NAMES
    with pytest.raises(ValueError, match="cluster-sum or persistent"):
        tensor_qmm.carrier_spec(tensor_qmm.cluster_spec(form, 2))
    persistent = tensor_qmm.persistent_spec(tensor_qmm.SCALED_SPECS[(2, (4, 2), 64)])
    with pytest.raises(ValueError, match="cluster-sum or persistent"):
        tensor_qmm.carrier_spec(persistent)


@pytest.mark.cuda
@cuda
@pytest.mark.parametrize("rows", [1, 16])
def test_cuda_a_matmul_carrying_prefetch_ctas_gives_its_own_bits(
    monkeypatch, rows: int
) -> None:
    """An o_proj-sized 4-bit matmul whose launch carries 32 prefetch CTAs over the
    first 16 MB of a gate / up-sized weight gives the plain launch's bits."""
    # A cluster-sum form (the default where launches are direct) carries none.
    monkeypatch.setenv(tensor_qmm.CLUSTER_SUM_ENV, "0")
    depth, columns = 4096, 6656
    dense = (0.02 * mx.random.normal((columns, depth))).astype(mx.bfloat16)
    weight, scales, biases = mx.quantize(dense, group_size=64, bits=4)
    other = mx.random.randint(0, 2**30, (8192, 6656 // 8)).astype(mx.uint32)
    repack = mx.random.normal((26, 8192, 8)).astype(mx.bfloat16)
    x = mx.random.normal((rows, depth)).astype(mx.bfloat16)
    mx.eval(weight, scales, biases, other, repack, x)
    launch = tensor_qmm.bind_tensor_core(
        rows, depth, weight, scales, biases, 4, 64, mx.bfloat16
    )
    plan = prefetch.plan((other, repack), 16)
    plain, carried = launch(x), launch(x, prefetch=plan)
    mx.eval(plain, carried)
    assert mx.array_equal(plain, carried).item()
