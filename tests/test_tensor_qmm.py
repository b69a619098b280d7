"""The CUDA tensor-core small-row matmul (``dflash.metal.tensor_qmm``).

On any machine: the bodies compile for sm_90 (nvcc + ptxas, no spills), the
host-side plan and layouts hold their invariants, and a lane-by-lane numpy model
of the body's registers, fragment layout and summation order matches the
float64 oracle within the tolerance of ``test_verify_kernels`` (and a model with
mismatched A/B pairs does not). On CUDA: the kernel itself against the oracle,
bit-for-bit batch invariance, Muse Glimmer's shapes, and the scalar kernel kept
reachable on CUDA.
"""

from __future__ import annotations

import dataclasses
import gc
import os
import re
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support import tensor_qmm_model as model
from support.attention_cases import bits as raw_bits
from support.compilers import GXX, NVCC, needs_nvcc
from support.group_emulator import (
    assert_within_bounds,
    check_cuda,
    entry_registers,
    type_suffix,
)
from support.tensor_emulator import TensorEmulator
from test_verify_kernels import (
    _close_to_matmul_oracle,
    _matmul_oracle,
    _scaled_oracle_close,
)

from benchmarks import matmul_variants, round_profile
from dflash.fused_projections import FusedProjections
from dflash.metal import backend, qmm, tensor_qmm
from dflash.metal.qmm import small_row_matmul
from dflash.metal.tensor_qmm import Layout, member_views, physical_k, split_plan

cuda = pytest.mark.skipif(not mx.cuda.is_available(), reason="needs mlx's CUDA backend")
HALF = (mx.bfloat16, mx.float16)
# Opt-in forms measured and kept off (the staging variants, unit scales): ptxas checks
# them in bfloat16 alone. Their float16 texts differ only in the conversions and mma
# type, which the shipped forms compile in both types.
OPT_IN_COMPILED = (mx.bfloat16,)
SUB = tensor_qmm.SUB
GLIMMER = ((6656, 4096), (6656, 256), (4096, 6656), (6656, 19968), (19968, 6656))
LM_HEAD = (6656, 202048)


@st.composite
def served_cases(draw, max_rows: int = 32, max_chunks: int = 4, max_columns: int = 300):
    """(x, weight, scales, biases, bits, group_size) that the tensor-core form serves."""
    bits = draw(st.sampled_from([4, 8, None]))
    group = draw(st.sampled_from([32, 64, 128])) if bits else None
    chunk = Layout(bits or 0, 1).chunk
    depth = chunk * draw(st.integers(1, max_chunks))
    rows = draw(st.integers(1, max_rows))
    columns = draw(st.integers(1, max_columns))
    dtype = draw(st.sampled_from(HALF))
    seed = draw(st.integers(0, 2**16))
    return _fixed_case(rows, depth, columns, bits, group, dtype, seed)


def _fixed_case(rows, depth, columns, bits, group, dtype, seed):
    """One served case of the given geometry (dense weights when ``bits`` is None)."""
    rng = np.random.default_rng(seed)
    x = mx.array(rng.standard_normal((rows, depth)).astype(np.float32)).astype(dtype)
    dense = mx.array(rng.standard_normal((columns, depth)).astype(np.float32))
    dense = dense.astype(dtype)
    if bits is None:
        return x, dense, None, None, None, None
    weight, scales, biases = mx.quantize(dense, group_size=group, bits=bits)
    return x, weight, scales, biases, bits, group


# ================================================================ compile check


@needs_nvcc
def test_tensor_bodies_compile_for_sm90_without_spills(tmp_path: Path) -> None:
    """Every matmul form in bfloat16 and float16 (ptxas checks the mma PTX) and the
    split sum in every dtype; no form spills registers to local memory (the scaled
    forms within their launch bounds: at most 128 registers)."""
    specs = (
        list(tensor_qmm.MATMUL_SPECS.values())
        + list(tensor_qmm.FOLDED_SPECS.values())
        + list(K2_SPECS.values())
        + list(tensor_qmm.K2_FOLDED_SPECS.values())
        + list(tensor_qmm.SCALED_SPECS.values())
    )
    forms = check_cuda(
        specs,
        tmp_path / "forms",
        NVCC,
        dtypes=HALF,
        flags=("-Xptxas", "-v"),
    )
    assert forms.ok, f"{forms.command}\n{forms.log}"
    entries = re.findall(r"Compiling entry function", forms.log)
    assert len(entries) == 2 * len(specs)
    spills = re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", forms.log)
    # One line per entry, and one per copy of the out-of-line plain-copy function.
    assert len(spills) >= len(entries)
    assert all(a == "0" and b == "0" for a, b in spills), forms.log
    # The two-K-group scaled forms (256 threads, two CTAs an SM): 128 registers at most.
    used = entry_registers(forms.log)
    bounded = [
        used[f"unit{specs.index(spec)}_{type_suffix(dtype)}"]
        for (groups, _, _), spec in tensor_qmm.SCALED_SPECS.items()
        if groups == 2
        for dtype in HALF
    ]
    assert bounded and max(bounded) <= 128, forms.log
    reduce = check_cuda([tensor_qmm.REDUCE_SPEC], tmp_path / "reduce", NVCC)
    assert reduce.ok, f"{reduce.command}\n{reduce.log}"


@needs_nvcc
def test_direct_dense_loads_compile_for_sm90_without_spills(tmp_path: Path) -> None:
    """``wdirect``'s dense forms (one and two row tiles, two K groups) compile for
    sm_90 with no spills: the weights' registers fit beside the accumulators."""
    with matmul_variants.variant(**matmul_variants.VARIANTS["wdirect"]):
        specs = [
            spec
            for (bits, _), spec in tensor_qmm.FORM_SPECS[(False, 2)].items()
            if bits == 0
        ]
    assert len(specs) == 2
    forms = check_cuda(specs, tmp_path, NVCC, dtypes=HALF, flags=("-Xptxas", "-v"))
    assert forms.ok, f"{forms.command}\n{forms.log}"
    spills = re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", forms.log)
    assert spills and all(a == "0" and b == "0" for a, b in spills), forms.log


@needs_nvcc
def test_denormal_decode_compiles_for_sm90_within_the_bounds(tmp_path: Path) -> None:
    """The denormal decode's forms, pairs in place or not, compile for sm_90 with no
    spills, the two-K-group ones within their launch bounds' 128 registers."""
    specs = list(DENORM_SPECS.values()) + [
        s for k, s in tensor_qmm.IN_PLACE_SPECS.items() if k[0] == 2
    ]
    one_group = [
        s
        for table in (tensor_qmm.DENORMAL_SPECS, tensor_qmm.IN_PLACE_SPECS)
        for k, s in table.items()
        if k[0] == 1
    ]
    single = check_cuda(
        one_group, tmp_path / "k1", NVCC, dtypes=HALF, flags=("-Xptxas", "-v")
    )
    assert single.ok and "bytes spill stores" in single.log, single.log
    assert not re.search(r"[1-9]\d* bytes spill stores", single.log), single.log
    forms = check_cuda(specs, tmp_path, NVCC, dtypes=HALF, flags=("-Xptxas", "-v"))
    assert forms.ok, f"{forms.command}\n{forms.log}"
    spills = re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", forms.log)
    assert spills and all(a == "0" and b == "0" for a, b in spills), forms.log
    registers = [int(r) for r in re.findall(r"Used (\d+) registers", forms.log)]
    assert len(registers) >= 2 * len(specs) and max(registers) <= 128, forms.log


@needs_nvcc
@pytest.mark.parametrize("variant", ["paired", "lean", "paired-lean"])
def test_staging_variants_compile_for_sm90_within_the_bounds(
    tmp_path: Path, variant: str
) -> None:
    """The paired stage's, the lean issue's and both's two-K-group forms (dense and
    4-bit: unscaled, scaled, denormal) compile for sm_90 (``OPT_IN_COMPILED``) with
    no spills, the scaled
    ones within their launch bounds' 128 registers (no SwiGLU form is compiled here:
    its text has unused variables, which -Werror refuses; NVRTC builds it)."""
    tables = STAGING[variant]
    _assert_opt_in_forms_compile(list(tables["form"].values()), tmp_path / "u", 255)
    scaled = [*tables["scaled"].values(), *tables["denormal"].values()]
    _assert_opt_in_forms_compile(scaled, tmp_path / "s", 128)


def _assert_opt_in_forms_compile(specs: list, workdir: Path, cap: int) -> None:
    """``specs`` compile for sm_90 in ``OPT_IN_COMPILED`` with no spills and at most
    ``cap`` registers each."""
    forms = check_cuda(
        specs, workdir, NVCC, dtypes=OPT_IN_COMPILED, flags=("-Xptxas", "-v")
    )
    assert forms.ok, f"{forms.command}\n{forms.log}"
    found = r"(\d+) bytes spill stores, (\d+) bytes spill loads"
    spills = re.findall(found, forms.log)
    assert len(spills) >= len(specs), forms.log
    assert all(a == "0" and b == "0" for a, b in spills), forms.log
    registers = [int(r) for r in re.findall(r"Used (\d+) registers", forms.log)]
    assert len(registers) >= len(specs) and max(registers) <= cap, forms.log


# The two-K-group forms (the default since the H200 ran them in session 18): compiled,
# emulated.
K2_SPECS = tensor_qmm.K2_SPECS


# Negative control: the second group's sums never reach the first's.
K2_DROPPED = dataclasses.replace(
    K2_SPECS[(4, 1)],
    base=K2_SPECS[(4, 1)].base + "_dropped",
    body=K2_SPECS[(4, 1)].body.replace(
        "exchange[16 * mt + 4 * t + i] = acc[mt][t][i];",
        "exchange[16 * mt + 4 * t + i] = 0.0f * acc[mt][t][i];",
    ),
)


def test_two_k_group_forms_are_edits_of_the_shipped_text() -> None:
    """256 threads on the same shared memory; the one-group text (what ran on the
    H200) is untouched by building them; a third group is refused."""
    for key, spec in K2_SPECS.items():
        one = tensor_qmm.MATMUL_SPECS[key]
        assert spec.threads == 2 * one.threads == 256
        assert spec.shared_memory == one.shared_memory
        assert _unlean(spec.base) == _unlean(one.base) + "_k2"
        assert "kgroup" in spec.body
        assert "kgroup" not in one.body
    with pytest.raises(ValueError, match="k_groups must be 1 or 2"):
        tensor_qmm._spec(Layout(4, 1), k_groups=3)


def test_the_two_k_group_switch_is_read_at_each_bind(monkeypatch) -> None:
    """``DFLASH_QMM_TWO_K_GROUPS`` decides when set, else :data:`K_GROUPS`; a plan with
    two groups takes the two-group spec of its form."""
    monkeypatch.delenv(tensor_qmm.TWO_K_GROUPS_ENV, raising=False)
    assert tensor_qmm.k_groups() == tensor_qmm.K_GROUPS == 2
    for value, expected in (("1", 2), ("0", 1), ("", 2)):
        monkeypatch.setenv(tensor_qmm.TWO_K_GROUPS_ENV, value)
        assert tensor_qmm.k_groups() == expected
    for bits, folded, table in (
        (4, False, tensor_qmm.K2_SPECS),
        (8, True, tensor_qmm.K2_SPECS),
        (4, True, tensor_qmm.K2_FOLDED_SPECS),
    ):
        plan = tensor_qmm.launch_plan(16, 6656, 4096, bits, 64, True, folded, True, 2)
        assert plan.spec is table[(bits, 1)]
    with round_profile.kernel_arm("default-kgroups2"):
        assert tensor_qmm.k_groups() == 2


def test_tensor_specs_are_cuda_only() -> None:
    for spec in tensor_qmm.SPECS:
        assert spec.backends == ("cuda",)
    for layout, spec in zip(
        tensor_qmm.LAYOUTS.values(), tensor_qmm.MATMUL_SPECS.values()
    ):
        assert spec.shared_memory == layout.shared_memory


# ============================================================== host-side logic


def test_physical_k_partitions_each_sub_chunk() -> None:
    """Each mma step takes 16 distinct elements, the two steps all 32 of the sub-chunk."""
    seen = []
    for step in range(2):
        elements = [
            physical_k(step, 2 * tig + 8 * second + half, tig)
            for tig in range(4)
            for second in range(2)
            for half in range(2)
        ]
        assert len(set(elements)) == 16
        seen += elements
    assert sorted(seen) == list(range(32))
    with pytest.raises(ValueError):
        physical_k(0, 2, 0)


def test_lane_registers_follow_physical_k() -> None:
    """The body's register pairs put element ``physical_k`` at each logical k, for x
    and for 4-bit, 8-bit and dense weights alike (so A and B agree)."""
    rng = np.random.default_rng(1)
    dense = mx.array(rng.standard_normal((8, 256)).astype(np.float32)).astype(
        mx.bfloat16
    )
    element_bits = np.asarray(dense.view(mx.uint16))
    for bits in (4, 8, None):
        if bits is None:
            weight, values = dense, element_bits
        else:
            weight, _, _ = mx.quantize(dense, group_size=32, bits=bits)
            values = _quantized_integers(weight, bits, 256)
        regs = model.weight_registers(weight, bits)
        for step in range(2):
            logical = model.logical_operand(regs, step)
            for k in range(16):
                tig = (k % 8) // 2
                want = values.reshape(8, -1, SUB)[:, :, physical_k(step, k, tig)]
                assert np.array_equal(logical[..., k], want), (bits, step, k)


def _quantized_integers(weight: mx.array, bits: int, depth: int) -> np.ndarray:
    """mlx's packing read the documented way: element k in word k*bits/32, low bits first."""
    packed = np.asarray(weight).astype(np.uint64)
    k = np.arange(depth)
    per_word = 32 // bits
    shift = ((k % per_word) * bits).astype(np.uint64)
    return (packed[:, k // per_word] >> shift) & ((1 << bits) - 1)


@settings(max_examples=200, deadline=None)
@given(
    depth=st.integers(1, 400).map(lambda c: 64 * c),
    columns=st.integers(1, 250_000),
    bits=st.sampled_from([4, 8, None]),
)
def test_split_plan_covers_k_in_nonempty_splits(depth, columns, bits) -> None:
    """A function of (K, N) only; every split holds a chunk; together they hold K once;
    K is split only while the column tiles are fewer than the target."""
    chunk = Layout(bits or 0, 1).chunk
    if depth % chunk:
        return
    tiles, splits, per_split = split_plan(depth, columns, bits, waves=False)
    chunks = depth // chunk
    assert tiles * tensor_qmm.COLUMNS >= columns > (tiles - 1) * tensor_qmm.COLUMNS
    assert (splits - 1) * per_split < chunks <= splits * per_split
    if tiles >= tensor_qmm.TARGET_GROUPS:
        assert splits == 1
    else:
        assert tiles * splits < tensor_qmm.TARGET_GROUPS + tiles


@settings(max_examples=200, deadline=None)
@given(
    depth=st.integers(1, 400).map(lambda c: 256 * c),
    columns=st.integers(1, 250_000),
    bits=st.sampled_from([4, 8, None]),
)
def test_wave_split_covers_k_and_finishes_no_later(depth, columns, bits) -> None:
    """The wave-aware split: a function of (K, N) only, every split holds a chunk and
    together they hold K once; its modelled time (waves of resident CTAs, each as
    long as a CTA's chunks plus the fixed cost) is no worse than the target rule's or
    any other split's, and no split is added for nothing."""
    chunk = Layout(bits or 0, 1).chunk
    tiles, splits, per_split = split_plan(depth, columns, bits, waves=True)
    chunks = depth // chunk
    assert (splits - 1) * per_split < chunks <= splits * per_split

    def cost(splits_, per_):
        waves = -(-tiles * splits_ // tensor_qmm.RESIDENT_CTAS)
        return waves * (per_ + tensor_qmm.cta_overhead_chunks(bits))

    mine = cost(splits, per_split)
    assert mine <= cost(*split_plan(depth, columns, bits, False)[1:])
    for per in range(1, chunks + 1):
        other = -(-chunks // per)
        assert mine < cost(other, per) or (mine == cost(other, per) and splits <= other)


def test_the_fixed_cost_of_a_cta_is_measured_per_form() -> None:
    """Affine weights count a CTA's fixed cost as 4 chunks since session 41 (the fused
    gate / up: 3 splits to 2, measured faster on the H200 at 4 and 8 bits); dense
    weights 8 since session 46 (the bf16 fused q/k/v/gate: 7 splits to 3, one wave,
    measured faster; the fused gate / up 5 to 4, even); no other shape of the default
    (fused) bf16 target or drafter moves."""
    assert tensor_qmm.cta_overhead_chunks(4) == tensor_qmm.cta_overhead_chunks(8) == 4
    assert tensor_qmm.cta_overhead_chunks(None) == 8
    assert split_plan(6656, 39936, 4, waves=True) == (312, 2, 13)
    assert split_plan(6656, 39936, 8, waves=True) == (312, 2, 13)
    assert split_plan(6656, 39936, None, waves=True) == (312, 4, 26)
    assert split_plan(6656, 8704, None, waves=True) == (68, 3, 35)
    with matmul_variants.variant(overhead=2):
        assert split_plan(6656, 39936, 4, waves=True) == (312, 3, 9)
        assert split_plan(6656, 39936, None, waves=True) == (312, 4, 26)
    with matmul_variants.variant(dense_overhead=2):  # the dense knob moves dense only
        assert split_plan(6656, 39936, 4, waves=True) == (312, 2, 13)
        assert split_plan(6656, 39936, None, waves=True) == (312, 5, 21)
        assert split_plan(6656, 8704, None, waves=True) == (68, 7, 15)
        # The others, apart from the unfused gate or up (fusion off: 5 splits to 3,
        # not timed), keep their plan under either.
        # The drafter's: q/k/v stacked, k / v, the k / v tail, fc.
        drafter = ((6656, 6144), (6656, 1024), (6656, 2048), (5 * 6656, 6656))
        for depth, columns in GLIMMER[:3] + GLIMMER[4:] + drafter:
            plan = split_plan(depth, columns, None, waves=True)
            with matmul_variants.variant(dense_overhead=8):
                assert split_plan(depth, columns, None, waves=True) == plan
    assert tensor_qmm.cta_overhead_chunks(None) == 8
    for depth, columns in GLIMMER + (LM_HEAD, (6656, 8704)):
        for bits in (4, 8):
            plan = split_plan(depth, columns, bits, waves=True)
            with matmul_variants.variant(overhead=2):
                assert split_plan(depth, columns, bits, waves=True) == plan


def test_wave_split_of_glimmer_shapes_fits_one_wave() -> None:
    """On Muse Glimmer's split projections (4-bit) the wave-aware split keeps every
    CTA in one wave of an H200 where the target rule spilled into a second."""
    for depth, columns in ((6656, 4096), (4096, 6656), (19968, 6656), (6656, 8704)):
        tiles, splits, _ = split_plan(depth, columns, 4, waves=False)
        assert tiles * splits > tensor_qmm.RESIDENT_CTAS
        tiles, splits, _ = split_plan(depth, columns, 4, waves=True)
        assert tiles * splits <= tensor_qmm.RESIDENT_CTAS, (depth, columns)


@pytest.mark.parametrize("waves", [False, True])
def test_split_plan_of_glimmer_shapes(waves) -> None:
    """At least a CTA per SM of an H200 on every Glimmer projection at 4 bits, or
    (k/v_proj: 26 chunks, 2 column tiles) one chunk per CTA, under either rule."""
    for depth, columns in GLIMMER + (LM_HEAD,):
        tiles, splits, per_split = split_plan(depth, columns, 4, waves)
        assert tiles * splits >= 132 or per_split == 1, (depth, columns, tiles, splits)


def test_the_merged_split_sum_switch_is_read_at_each_bind(monkeypatch) -> None:
    """``DFLASH_MERGED_SPLIT_SUM`` decides when set (either way), else the module
    default; round_profile's ``-merged`` arms set it for their block only."""
    monkeypatch.delenv(tensor_qmm.MERGED_SPLIT_SUM_ENV, raising=False)
    for default in (False, True):
        monkeypatch.setattr(tensor_qmm, "MERGE_SPLIT_SUM", default)
        assert tensor_qmm.merge_split_sum() is default
        for value, expected in (("1", True), ("0", False), ("", default)):
            monkeypatch.setenv(tensor_qmm.MERGED_SPLIT_SUM_ENV, value)
            assert tensor_qmm.merge_split_sum() is expected
        monkeypatch.delenv(tensor_qmm.MERGED_SPLIT_SUM_ENV)
    monkeypatch.setattr(tensor_qmm, "MERGE_SPLIT_SUM", False)
    with round_profile.kernel_arm("all-merged"):
        assert tensor_qmm.merge_split_sum()
    with round_profile.kernel_arm("all"):
        assert not tensor_qmm.merge_split_sum()
    assert tensor_qmm.MERGED_SPLIT_SUM_ENV not in os.environ


def test_variant_same_bits_column_compares_every_bit_with_current() -> None:
    """benchmarks.matmul_variants' same-bits column: None before a ``current`` row,
    True only for an identical output (a one-ulp change in one element is False)."""
    shipped = mx.array([[1.0, -2.5, 3.25]], dtype=mx.bfloat16)
    assert matmul_variants.same_bits(shipped, None) is None
    assert matmul_variants.same_bits(mx.array(shipped), shipped) is True
    bits = np.array(shipped.view(mx.uint16)).copy()
    bits[0, 2] += 1  # the next bfloat16 above 3.25
    nudged = mx.array(bits).view(mx.bfloat16)
    assert matmul_variants.same_bits(nudged, shipped) is False


@settings(max_examples=40, deadline=None)
@given(nbytes=st.integers(1, 2**30), cold_bytes=st.integers(0, 2**31))
def test_cold_weight_copies_span_the_asked_bytes_with_the_fewest_copies(
    nbytes: int, cold_bytes: int
) -> None:
    """``--cold-bytes``: the copies of a projection's weights span at least the asked
    bytes, one copy fewer would not, and 0 keeps one copy (the warm timing)."""
    copies = matmul_variants.weight_copies(nbytes, cold_bytes)
    assert copies >= 1
    assert copies * nbytes >= cold_bytes
    assert copies == 1 or (copies - 1) * nbytes < cold_bytes


def test_cold_calls_take_each_copy_in_turn_and_refuse_negative_bytes() -> None:
    """The timed call runs the copies' calls one after another, round and round (each
    copy's weights read once a cycle); a negative ``--cold-bytes`` is refused."""
    seen = []
    calls = [lambda i=i: seen.append(i) for i in range(3)]
    call = matmul_variants.in_turn(calls)
    for _ in range(7):
        call()
    assert seen == [0, 1, 2, 0, 1, 2, 0]
    assert matmul_variants.parse_args(["--cold-bytes", "268435456"]).cold_bytes == 2**28
    assert matmul_variants.parse_args([]).cold_bytes == 0
    with pytest.raises(SystemExit):
        matmul_variants.parse_args(["--cold-bytes", "-1"])


def test_vector_merge_switch_picks_the_merge_text_at_import() -> None:
    """``DFLASH_QMM_VECTOR_MERGE`` (read at import) decides which merge the forms carry:
    on by default since its `cuda` tests ran (session 49); the vector text is the one
    before it with only the merge replaced; a bad value leaves the import working and
    fails the next bind with the switch's name; the direct form never takes it."""
    assert tensor_qmm.VECTOR_MERGE is tensor_qmm.VECTOR_MERGE_DEFAULT is True
    assert tensor_qmm._BODY == tensor_qmm.merge_body(True)
    vector, scalar = tensor_qmm.merge_body(True), tensor_qmm.merge_body(False)
    assert "float4" in vector and "float4" not in scalar
    assert vector.replace(tensor_qmm._MERGE_BLOCK, tensor_qmm._SCALAR_MERGE) == scalar
    assert all("float4" not in spec.body for spec in tensor_qmm.DIRECT_SPECS.values())
    code = (
        "import dflash.metal.tensor_qmm as t; "
        "print(t.VECTOR_MERGE, 'float4' in t.SCALED_SPECS[(2, (4, 1), 64)].body)"
    )
    for value, expected in (("1", "True True"), ("0", "False False")):
        env = dict(os.environ, DFLASH_QMM_VECTOR_MERGE=value)
        done = subprocess.run(
            [sys.executable, "-c", code], env=env, capture_output=True, text=True
        )
        assert done.returncode == 0 and done.stdout.split() == expected.split()
    # A bad value: the import keeps the default; binding a matmul raises, naming it.
    code += "; t.vector_merge()"
    env = dict(os.environ, DFLASH_QMM_VECTOR_MERGE="yes please")
    done = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True
    )
    assert done.stdout.split() == ["True", "True"] and done.returncode != 0
    assert "DFLASH_QMM_VECTOR_MERGE must be 0 or 1" in done.stderr


def test_variant_knobs_apply_inside_and_are_restored_after() -> None:
    """benchmarks.matmul_variants: a variant's knobs reach the plan, the layouts and
    the mma helper's text while it runs, and everything is as before afterwards (also
    when the body raises)."""
    before = dict(tensor_qmm.MATMUL_SPECS)
    plan = split_plan(6656, 19968, 4, waves=False)
    merged = tensor_qmm.MERGE_SPLIT_SUM
    folded = tensor_qmm.FOLD_Q4_OFFSET
    waves = split_plan(6656, 39936, 4, waves=True)
    with matmul_variants.variant(
        target=1056, budget=70 * 1024, plain_mma=True, merged=not merged,
        folded=not folded, resident=132, overhead=2,
    ):  # fmt: skip
        assert tensor_qmm.MERGE_SPLIT_SUM is not merged
        assert tensor_qmm.fold_q4_offset() is not folded
        assert split_plan(6656, 39936, 4, waves=True) == (312, 2, 13)
        assert split_plan(6656, 19968, 4, waves=False) == (156, 7, 4)
        assert Layout(4, 1).stages == 2
        spec = tensor_qmm.MATMUL_SPECS[(4, 1)]
        assert (
            'asm(\n      "mma' in spec.helpers
            and 'asm volatile(\n      "mma' not in spec.helpers
        )
    with matmul_variants.variant(overhead=2, max_stages=2, x_stride=0):
        assert split_plan(6656, 39936, 4, waves=True) == (312, 3, 9) != waves
        assert Layout(4, 1).stages == 2 and Layout(4, 1).x_stride == 0
    with pytest.raises(KeyError):
        with matmul_variants.variant(target=528):
            raise KeyError("inside")
    assert tensor_qmm.MATMUL_SPECS == before
    assert tensor_qmm.MERGE_SPLIT_SUM is merged
    assert tensor_qmm.FOLD_Q4_OFFSET is folded
    assert split_plan(6656, 39936, 4, waves=True) == waves == (312, 2, 13)
    assert split_plan(6656, 19968, 4, waves=False) == plan and Layout(4, 1).stages == 3
    assert Layout(4, 1).x_stride == 512 + 64
    assert tensor_qmm.launch_plan(16, 6656, 19968, 4, 64).groups == plan[0] * plan[1]


def test_every_variant_applies_to_the_shipped_texts_and_is_undone() -> None:
    """Each of matmul_variants' variants still finds the text it edits (a kernel
    change that moves it fails here, not on the GPU), a variant with text edits
    renames the shipped 4-bit scaled kernel (they took effect), and every name is back
    afterwards (the direct forms' variants: their kernel)."""
    key = (2, (4, 1), 64)

    def names() -> dict:
        tables = {"scaled": tensor_qmm.SCALED_SPECS, "direct": tensor_qmm.DIRECT_SPECS}
        return {
            (table, k): spec.name("cuda")
            for table, specs in tables.items()
            for k, spec in specs.items()
        }

    shipped = names()
    for name, knobs in matmul_variants.VARIANTS.items():
        with matmul_variants.variant(**knobs):
            # (vecmerge is the shipped text itself when the switch took it at import.)
            if knobs.get("edits") and not (
                name == "vecmerge" and tensor_qmm.VECTOR_MERGE
            ):
                table, changed = ("direct", (2, 64)) if knobs.get("direct") else (
                    "scaled", key
                )  # fmt: skip
                now = names()[(table, changed)]
                assert now != shipped[(table, changed)], name
        assert names() == shipped, name


def test_variant_with_text_edits_binds_the_form_it_edited(monkeypatch) -> None:
    """Text edits are written against the shifted denormal form, and the pairs-in-place
    forms are not rebuilt with them: a variant with edits must turn the pairs in place
    off, or a bfloat16 4-bit bind takes the unedited in-place kernel (session 53's first
    memonly / computeonly / skeleton rows timed the shipped kernel, unedited)."""
    monkeypatch.delenv(tensor_qmm.DENORMAL_IN_PLACE_ENV, raising=False)
    assert tensor_qmm.denormal_in_place(4)
    for name in ("memonly", "computeonly", "skeleton", "prologue", "noepilogue"):
        with matmul_variants.variant(**matmul_variants.VARIANTS[name]):
            assert not tensor_qmm.denormal_in_place(4), name
        assert tensor_qmm.denormal_in_place(4), name
    with matmul_variants.variant(**matmul_variants.VARIANTS["current"]):
        assert tensor_qmm.denormal_in_place(4)


def test_variants_benchmark_baseline_is_mlx_own_product() -> None:
    """The benchmark's mlx row: ``x @ W.T`` dense, ``quantized_matmul`` quantized."""
    x = mx.random.normal((3, 256), key=mx.random.key(1))
    dense = mx.random.normal((8, 256), key=mx.random.key(2))
    got = matmul_variants.mlx_matmul(x, dense, None, None, None)
    assert np.array_equal(np.asarray(got), np.asarray(mx.matmul(x, dense.T)))
    packed, scales, biases = mx.quantize(dense, group_size=64, bits=4)
    got = matmul_variants.mlx_matmul(x, packed, scales, biases, 4)
    want = mx.quantized_matmul(x, packed, scales, biases, transpose=True, group_size=64)
    assert np.array_equal(np.asarray(got), np.asarray(want))
    assert not np.array_equal(
        np.asarray(got), np.asarray(mx.matmul(x, dense.T))
    )  # quantized: not the dense product


def test_variants_benchmark_refuses_bad_flags_and_the_cpu(capsys) -> None:
    with pytest.raises(SystemExit):
        matmul_variants.parse_args(["--variants", "current,fastest"])
    assert "unknown variant or shape: fastest" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        matmul_variants.parse_args(["--rows", "0"])
    assert "--rows within 1..32" in capsys.readouterr().err
    dense = matmul_variants.parse_args(["--dense", "--shapes", "drafter fc"])
    assert dense.dense and dense.shapes == ["drafter fc"]
    if qmm.backend.BACKEND != "cuda":
        assert matmul_variants.main([]) == 1
        assert (
            capsys.readouterr().err.strip()
            == "matmul_variants: needs mlx's CUDA backend"
        )


@settings(max_examples=100, deadline=None)
@given(
    rows=st.integers(1, 32),
    chunks=st.integers(1, 80),
    columns=st.integers(1, 30_000),
    bits=st.sampled_from([4, 8, None]),
    merged=st.booleans(),
    waves=st.booleans(),
    members=st.booleans(),
)
def test_launch_plan_is_the_split_plan_kept_per_geometry(
    rows, chunks, columns, bits, merged, waves, members
):
    """The memoised plan launches what split_plan says: a split K gets the reduce
    launch, or (merged) the result, the partials and a counter per column tile in
    one launch; member edges follow in both launches' scalars; one object per
    geometry and setting."""
    depth = chunks * Layout(bits or 0, 1).chunk
    group_size = None if bits is None else 64
    edges = tensor_qmm.member_edges((tensor_qmm.COLUMNS,) * members, columns)
    plan = tensor_qmm.launch_plan(
        rows, depth, columns, bits, group_size, merged, False, waves, 1, edges
    )
    tiles, splits, per_split = split_plan(depth, columns, bits, waves)
    assert plan.spec is tensor_qmm.MATMUL_SPECS[(bits or 0, 1 if rows <= 16 else 2)]
    shift = 6 if bits else 0
    merges = merged and splits > 1
    want = [rows, columns, depth, group_size or 0, tiles, splits, per_split, shift]
    assert plan.params.tolist() == want + [int(merges), len(edges), *edges]
    assert plan.groups == tiles * splits and plan.columns == columns
    if splits == 1:
        assert plan.shapes == ((rows, columns), (1,)) and plan.reduce_params is None
        assert plan.counters == 0
    elif merges:
        assert plan.shapes == ((rows, columns), (splits, rows, columns))
        assert plan.reduce_params is None and plan.reduce_groups == 0
        assert plan.counters == tiles
    else:
        assert plan.shapes == ((1,), (splits, rows, columns))
        assert plan.reduce_params.tolist() == [
            rows * columns,
            splits,
            columns,
            len(edges),
            *edges,
        ]
        assert plan.reduce_groups * tensor_qmm.REDUCE_THREADS >= rows * columns
        assert plan.counters == 0
    again = tensor_qmm.launch_plan(
        rows, depth, columns, bits, group_size, merged, False, waves, 1, edges
    )
    assert again is plan


def test_a_rejected_geometry_is_rejected_on_every_call() -> None:
    """Validation is memoised per geometry, but only successes are kept."""
    x = mx.zeros((4, 256), dtype=mx.bfloat16)
    weight = mx.zeros((8, 32), dtype=mx.uint32)
    scales = mx.zeros((8, 3), dtype=mx.bfloat16)  # K / 64 = 4 groups, not 3
    for _ in range(2):
        with pytest.raises(ValueError, match="scales must have shape"):
            small_row_matmul(x, weight, scales, scales, bits=4, group_size=64)
    good = mx.zeros((8, 4), dtype=mx.bfloat16)
    y = small_row_matmul(x, weight, good, good, bits=4, group_size=64, use_kernel=False)
    assert y.shape == (4, 8)
    with pytest.raises(ValueError, match="scales are mlx.core.bfloat16, x is"):
        small_row_matmul(
            x.astype(mx.float16), weight, good, good, bits=4, group_size=64
        )


def test_layouts_fit_shared_memory() -> None:
    """Every form fits an SM (227 KB per block); the 16-row forms leave room for two."""
    for (bits, mtiles), layout in tensor_qmm.LAYOUTS.items():
        assert 2 <= layout.stages <= 4
        assert layout.shared_memory <= 227 * 1024
        if mtiles == 1:
            assert 2 * (layout.shared_memory + 1024) <= 228 * 1024, (bits, layout)
        assert layout.w_stride % 16 == 0 and layout.x_stride % 16 == 0


def _banks(addresses: list[int], width: int) -> bool:
    """Whether accesses of ``width`` bytes by these lanes hit distinct banks per phase
    (phases of 128 bytes: 32, 16 or 8 lanes)."""
    lanes_per_phase = 128 // width
    for first in range(0, 32, lanes_per_phase):
        banks = []
        for address in addresses[first : first + lanes_per_phase]:
            banks += [(address // 4 + i) % 32 for i in range(width // 4)]
        if len(set(banks)) != len(banks):
            return False
    return True


def test_shared_memory_reads_are_conflict_free() -> None:
    """The lanes' weight and x reads of every form (padded strides), and a negative
    control: unpadded strides conflict."""
    for bits, width in ((4, 4), (8, 8), (0, 16)):
        layout = Layout(bits, 1)
        for sc in range(layout.chunk // SUB):
            for stride, pad_ok in (
                (layout.w_stride, True),
                (layout.column_bytes, False),
            ):
                offset = {4: 4 * (4 * sc), 8: 4 * (8 * sc), 0: 2 * SUB * sc}[bits]
                lane_offset = {4: 4, 8: 8, 0: 16}[bits]
                addresses = [
                    (lane // 4) * stride + offset + (lane % 4) * lane_offset
                    for lane in range(32)
                ]
                assert _banks(addresses, width) == pad_ok, (bits, sc, stride)
            for stride, pad_ok in ((layout.x_stride, True), (2 * layout.chunk, False)):
                addresses = [
                    (lane // 4) * stride + 2 * (SUB * sc + 8 * (lane % 4))
                    for lane in range(32)
                ]
                assert _banks(addresses, 16) == pad_ok, (bits, sc, stride)


@pytest.mark.parametrize(
    "dtype, rows, depth, columns, bits, served",
    [
        (mx.bfloat16, 16, 6656, 19968, 4, True),
        (mx.float16, 1, 256, 1, 8, True),
        (mx.bfloat16, 32, 64, 8, None, True),
        (mx.bfloat16, 33, 256, 8, 4, False),
        (mx.float32, 16, 256, 8, 4, False),
        (mx.bfloat16, 16, 128, 8, 4, False),
        (mx.bfloat16, 16, 320, 8, 8, False),
        (mx.bfloat16, 16, 96, 8, None, False),
        (mx.bfloat16, 16, 256, 0, 4, False),
    ],
)
def test_tensor_core_serves(dtype, rows, depth, columns, bits, served) -> None:
    assert tensor_qmm.tensor_core_serves(dtype, rows, depth, columns, bits) is served


def test_small_row_matmul_picks_the_tensor_form_only_on_cuda(monkeypatch) -> None:
    assert qmm.uses_tensor_cores(mx.bfloat16, 16, 256, 8, 4) is (
        qmm.backend.BACKEND == "cuda"
    )
    monkeypatch.setattr(qmm.backend, "BACKEND", "cuda")
    assert qmm.uses_tensor_cores(mx.bfloat16, 16, 256, 8, 4)
    assert not qmm.uses_tensor_cores(mx.float32, 16, 256, 8, 4)
    monkeypatch.setattr(qmm, "TENSOR_CORES", False)
    assert not qmm.uses_tensor_cores(mx.bfloat16, 16, 256, 8, 4)
    monkeypatch.setattr(qmm, "TENSOR_CORES", True)
    monkeypatch.setattr(qmm.backend, "BACKEND", "metal")
    assert not qmm.uses_tensor_cores(mx.bfloat16, 16, 256, 8, 4)


# ================================================================ numpy model


@settings(max_examples=30, deadline=None)
@given(case=served_cases(max_chunks=3, max_columns=40))
def test_model_of_the_body_matches_oracle(case) -> None:
    """The body's registers, fragment layout and summation order, with a pessimistic
    tensor-core rounding, stay within the oracle's tolerance."""
    assert _close_to_matmul_oracle(case, model.model_matmul(*case))


@settings(max_examples=15, deadline=None)
@given(case=served_cases(max_rows=16, max_chunks=4, max_columns=32))
def test_model_float32_sums_are_within_the_sum_tolerance(case) -> None:
    """Before the output rounding (which dominates the tolerance), the model's float32
    sums are within the tolerance's float32-sum term, ``1e-6 * |x| @ |W|.T``."""
    want, magnitude = _matmul_oracle(*case)
    got = np.asarray(model.model_matmul(*case, keep_float32=True), np.float64)
    assert np.all(np.abs(got - want) <= 1e-6 * magnitude + 1e-30)


@settings(max_examples=25, deadline=None)
@given(case=served_cases(max_chunks=3, max_columns=40))
def test_model_of_the_folded_offset_form_matches_oracle(case) -> None:
    """The folded-offset 4-bit form (bfloat16 mma on ``128 + q``, the offset in the
    bias) stays within the oracle's tolerance; its float32 sums lose at most the
    offset's share, ``1e-6 * 256 * |x| @ |scale|.T`` more than the plain form's."""
    x, weight, scales, biases, bits, group = case
    got = model.model_matmul(*case, folded=True)
    assert _close_to_matmul_oracle(case, got)
    if bits != 4 or x.dtype != mx.bfloat16:
        assert np.array_equal(raw_bits(got), raw_bits(model.model_matmul(*case)))
        return
    want, magnitude = _matmul_oracle(*case)
    wide = np.repeat(np.abs(np.asarray(scales.astype(mx.float32))), group, axis=1)
    offset_share = np.abs(np.asarray(x.astype(mx.float32), np.float64)) @ wide.T
    sums = model.model_matmul(*case, keep_float32=True, folded=True)
    error = np.abs(np.asarray(sums, np.float64) - want)
    assert np.all(error <= 1e-6 * (magnitude + 256 * offset_share) + 1e-30)


@settings(max_examples=10, deadline=None)
@given(case=served_cases(max_rows=20, max_chunks=2, max_columns=24))
def test_model_rows_do_not_depend_on_the_batch(case) -> None:
    together = model.model_matmul(*case)
    x = case[0]
    for row in range(x.shape[0]):
        alone = model.model_matmul(x[row : row + 1], *case[1:])
        assert np.array_equal(raw_bits(alone), raw_bits(together[row : row + 1]))


def test_model_with_mismatched_pairs_misses_oracle() -> None:
    """Negative control: B paired differently from A is a different product."""
    rng = np.random.default_rng(3)
    for bits in (4, 8, None):
        dense = mx.array(rng.standard_normal((16, 256)).astype(np.float32))
        dense = dense.astype(mx.bfloat16)
        x = mx.array(rng.standard_normal((4, 256)).astype(np.float32))
        x = x.astype(mx.bfloat16)
        if bits is None:
            case = (x, dense, None, None, None, None)
        else:
            case = (x, *mx.quantize(dense, group_size=64, bits=bits), bits, 64)
        assert _close_to_matmul_oracle(case, model.model_matmul(*case))
        wrong = model.wrong_pairs(case[1], bits)
        assert not _close_to_matmul_oracle(
            case, model.model_matmul(*case, weight_regs=wrong)
        )


def test_model_rounding_is_no_better_than_exact_sums() -> None:
    """The pessimistic tensor-core sum loses against exact sums (the model bites)."""
    rng = np.random.default_rng(4)
    dense = mx.array(rng.standard_normal((64, 512)).astype(np.float32))
    dense = dense.astype(mx.bfloat16)
    x = mx.array(rng.standard_normal((16, 512)).astype(np.float32)).astype(mx.bfloat16)
    case = (x, dense, None, None, None, None)
    want, _ = _matmul_oracle(*case)
    errors = {}
    for name, step in (("tc", model.tensor_core_step), ("exact", model.exact_step)):
        got = model.model_matmul(*case, step=step).astype(mx.float32)
        errors[name] = np.abs(np.asarray(got, np.float64) - want).sum()
    assert errors["tc"] >= errors["exact"]


# ===================================================== the body, emulated on the CPU

# Deliberate slips, each caught by one landing mode of the emulated cp.async.
_WAIT = "dfl_wait<STAGES - 2>();"
# (The ring's write slot as the lean issue names it, DFLASH_QMM_LEAN_ISSUE=1.)
_SLOT = "write_slot" if tensor_qmm.LEAN_ISSUE else "(i + STAGES - 1) % STAGES"
_ISSUE_AFTER_BARRIER = f"""    DFL_BARRIER();
    // The buffer refilled here was read in the previous round (all threads are past it).
    if (c + STAGES - 1 < c_end) {{
      issue(c + STAGES - 1, {_SLOT});
    }}
"""
_ISSUE_BEFORE_BARRIER = f"""    if (c + STAGES - 1 < c_end) {{
      issue(c + STAGES - 1, {_SLOT});
    }}
    DFL_BARRIER();
"""
_A_STEP0 = "lo[mt][0], hi[mt][0], lo[mt][1], hi[mt][1], b[0], b[1]"


def _mutant(name: str, old: str, new: str):
    spec = tensor_qmm.MATMUL_SPECS[(4, 1)]
    assert old in spec.body
    return dataclasses.replace(
        spec, base=f"{spec.base}_{name}", body=spec.body.replace(old, new)
    )


MUTANTS = {
    # Computes on a chunk before its copies land: only late landing shows it.
    "early_read": _mutant("early_read", _WAIT, "dfl_wait<STAGES - 1>();"),
    # Refills the previous buffer while slower threads still read its scales: only
    # landing at issue shows it.
    "early_refill": _mutant(
        "early_refill", _ISSUE_AFTER_BARRIER, _ISSUE_BEFORE_BARRIER
    ),
    # Swaps A's k halves against B's: wrong in every mode.
    "fragments": _mutant(
        "fragments", _A_STEP0, "lo[mt][1], hi[mt][1], lo[mt][0], hi[mt][0], b[0], b[1]"
    ),
    # Merged split sum: no CTA ever counts itself last, so no one writes the result.
    "never_last": _mutant(
        "never_last",
        "atomicAdd(counter, 1) == splits - 1",
        "atomicAdd(counter, 1) == splits",
    ),
    # Folded offset: the mma takes 128 + q but the bias is not moved by 128 scales.
    "unfolded_bias": dataclasses.replace(
        tensor_qmm.FOLDED_SPECS[(4, 1)],
        base=tensor_qmm.FOLDED_SPECS[(4, 1)].base + "_unfolded_bias",
        helpers=tensor_qmm.FOLDED_SPECS[(4, 1)].helpers.replace(
            "return fmaf(-128.0f, s, bias);", "return bias;"
        ),
    ),
    # Member-major store: both stores write the plain layout whatever the edges say.
    "plain_member_store": dataclasses.replace(
        tensor_qmm.MATMUL_SPECS[(4, 1)],
        base=tensor_qmm.MATMUL_SPECS[(4, 1)].base + "_plain_member_store",
        body=tensor_qmm.MATMUL_SPECS[(4, 1)]
        .body.replace(
            "y[out_base + size_t(r) * out_width + (n - out_lo)]",
            "y[size_t(r) * n_cols + n]",
        )
        .replace("y[out_base + size_t(p / COLUMNS) * out_width + (n - out_lo)]", "y[e]")
        .replace(
            "y[out_base + size_t(r) * out_width + (n + j - out_lo)]",
            "y[size_t(r) * n_cols + n + j]",
        ),
    ),
    # Member-major store: the separate split sum writes the plain layout.
    "plain_member_sum": dataclasses.replace(
        tensor_qmm.REDUCE_SPEC,
        base=tensor_qmm.REDUCE_SPEC.base + "_plain_member_sum",
        body=tensor_qmm.REDUCE_SPEC.body.replace(
            "y[size_t(lo) * size_t(total / n_cols) + size_t(i / n_cols) * (hi - lo) + "
            "(n - lo)]",
            "y[i]",
        ),
    ),
    # Merged split sum: the first split's partial left out of the sum, of up to 8
    # splits (their loads unrolled: 4 outputs a thread, or one where N is not a
    # multiple of 4) or of more (the loop).
    "first_split_dropped": dataclasses.replace(
        _mutant("first_split_dropped", "sum = v[0];", "sum = 0.0f * v[0];"),
        body=_mutant(
            "first_split_dropped", "sum = v[0];", "sum = 0.0f * v[0];"
        ).body.replace(
            "float sum = lane4(v[0], j);", "float sum = 0.0f * lane4(v[0], j);"
        ),
    ),
    "first_split_dropped_past_eight": _mutant(
        "first_split_dropped_past_eight",
        "sum = __ldcg(partial + e);",
        "sum = 0.0f * __ldcg(partial + e);",
    ),
}


def _swiglu_wrong_half():
    spec = tensor_qmm.SWIGLU_SPECS[(2, (4, 1))]
    old = "(cl < COLUMNS / 2 ? 0 : n_cols / 2 - COLUMNS / 2)"
    assert old in spec.body
    return dataclasses.replace(
        spec, base=spec.base + "_wrong_half", body=spec.body.replace(old, "0")
    )


SWIGLU_WRONG_HALF = _swiglu_wrong_half()

# The unscaled two-K-group forms (the emulated fixture's) with another merge of the
# same order: session 41's batched merge, and the loop shipped before session 43 (each
# split's load waited for by its add; the shipped merge holds every split's in flight).
MERGE_VARIANTS = {}
for _name in ("batchedmerge", "mergeloop", "vecmerge"):
    with matmul_variants.variant(**matmul_variants.VARIANTS[_name]):
        MERGE_VARIANTS[_name] = dict(tensor_qmm.FORM_SPECS[(False, 2)])
# The same forms with the dense weights loaded straight into registers (session 46's
# ``wdirect``); every variant here must keep the shipped bits.
SAME_BITS_VARIANTS = dict(MERGE_VARIANTS)
with matmul_variants.variant(**matmul_variants.VARIANTS["wdirect"]):
    SAME_BITS_VARIANTS["wdirect"] = dict(tensor_qmm.FORM_SPECS[(False, 2)])
# Its negative control: each lane loads its neighbour's 8 elements of the sub-chunk.
SAME_BITS_VARIANTS["wdirect-crossed"] = {
    key: dataclasses.replace(
        spec,
        base=spec.base + "_crossed",
        body=spec.body.replace(
            "size_t(c) * CW + (SUB * sc + 8 * tig) * 2;",
            "size_t(c) * CW + (SUB * sc + 8 * (tig ^ 1)) * 2;",
        ),
    )
    for key, spec in SAME_BITS_VARIANTS["wdirect"].items()
}

# The vector merge's negative control: its 16-byte path sums the splits in reverse
# order (the same terms, so only the rounding tells it from the shipped merge).
_VEC_SUM = """              float sum = lane4(v[0], j);
              #pragma unroll
              for (int k = 1; k < 8; ++k) {
                sum = k < splits ? __fadd_rn(sum, lane4(v[k], j)) : sum;
              }
"""
_VEC_SUM_REVERSED = """              float sum = lane4(v[splits - 1], j);
              for (int k = splits - 2; k >= 0; --k) {
                sum = __fadd_rn(sum, lane4(v[k], j));
              }
"""
SAME_BITS_VARIANTS["merge-reversed"] = {
    key: dataclasses.replace(
        spec,
        base=spec.base + "_reversed",
        body=spec.body.replace(_VEC_SUM, _VEC_SUM_REVERSED),
    )
    for key, spec in SAME_BITS_VARIANTS["vecmerge"].items()
}
assert all(
    _VEC_SUM_REVERSED in spec.body
    for spec in SAME_BITS_VARIANTS["merge-reversed"].values()
)


def _unlean(base: str) -> str:
    """A form's name less the lean byte decode's ``_lbytes`` (the 8-bit default since
    session 71), which comes after the suffixes the name checks look for."""
    return base[: -len("_lbytes")] if base.endswith("_lbytes") else base


def _eight_bit_forms(lean_bytes: bool) -> dict:
    """The 8-bit two-K-group forms, unscaled and scaled at every group size, one and
    two m-tiles, built with the lean byte decode or the float32 one (the shipped
    objects themselves where the switch already says so: the emulator builds a form
    once a spec object)."""
    if tensor_qmm.LEAN_BYTES is not lean_bytes:
        with matmul_variants.variant(lean_bytes=lean_bytes):
            return _eight_bit_forms(lean_bytes)
    return {
        "form": {
            key: spec
            for key, spec in tensor_qmm.FORM_SPECS[(False, 2)].items()
            if key[0] == 8
        },
        "scaled": {
            key: spec
            for key, spec in tensor_qmm.SCALED_SPECS.items()
            if key[0] == 2 and key[1][0] == 8
        },
    }


# The lean byte decode's forms (tensor_qmm.LEAN_BYTES: session 70, the default since
# session 71) and the float32 decode's, which they are checked against.
LEAN_BYTES = _eight_bit_forms(True)
FLOAT_BYTES = _eight_bit_forms(False)
assert all(
    spec.base.endswith("_lbytes")
    for table in LEAN_BYTES.values()
    for spec in table.values()
)
assert not any(
    "_lbytes" in spec.base for table in FLOAT_BYTES.values() for spec in table.values()
)


def _unsigned_selectors(spec):
    """Negative control: the sign selectors without their sign bits (a byte's top bit
    is then read off the byte itself, not replicated)."""
    body = spec.body
    for p in range(4):
        spread, sign = tensor_qmm.lean_byte_selectors(p)
        body = body.replace(f"0x{sign:04X}u, tag", f"0x{spread:04X}u, tag")
    assert body != spec.body
    return dataclasses.replace(spec, base=spec.base + "_unsigned", body=body)


# (Only the forms the every-byte case launches: 16 rows, groups of 32 and 128.)
LEAN_BYTES_UNSIGNED = {
    table: {
        key: _unsigned_selectors(spec)
        for key, spec in specs.items()
        if key == (8, 1) or key in ((2, (8, 1), 32), (2, (8, 1), 128))
    }
    for table, specs in LEAN_BYTES.items()
}
assert [len(specs) for specs in LEAN_BYTES_UNSIGNED.values()] == [1, 2]

# The denormal decode's two-K-group forms (tensor_qmm.DENORMAL_Q4: each nibble decoded
# as a subnormal, the scale's exponent raised), one and two m-tiles, every group size.
DENORM_SPECS = {
    key: spec for key, spec in tensor_qmm.DENORMAL_SPECS.items() if key[0] == 2
}
# The denormal decode with its nibble pairs in place (tensor_qmm.DENORMAL_IN_PLACE,
# session 51; bfloat16: q 2^-133 and q 2^-129, the scale raised twice): one m-tile at
# every group size and two at 64. Its negative control: the high pairs take the low
# pairs' scale (16 times too large in bfloat16; float16 raises both alike).
IN_PLACE_SPECS = {
    key: tensor_qmm.IN_PLACE_SPECS[key]
    for key in [(2, (4, 1), size) for size in tensor_qmm.GROUP_SIZES]
    + [(2, (4, 2), 64)]
}
IN_PLACE_ONE_SCALE = dataclasses.replace(
    IN_PLACE_SPECS[(2, (4, 1), 64)],
    base=IN_PLACE_SPECS[(2, (4, 1), 64)].base + "_onescale",
    body=IN_PLACE_SPECS[(2, (4, 1), 64)].body.replace(
        "(p & 1) ? s2h[t] : s2[t]", "s2[t]"
    ),
)
assert IN_PLACE_ONE_SCALE.body != IN_PLACE_SPECS[(2, (4, 1), 64)].body


# The paired stage (tensor_qmm.PAIRED_STAGE, matmul_variants' ``paired``): the default
# (two-K-group) 4-bit and dense forms, scaled (scales paired at groups of 64 and 128,
# x only at 32), denormal and unscaled, each built with it; and its negative controls:
# x's pieces left unpaired, and the scale pair read as the bias pair.
def _staging_tables(name: str) -> dict:
    """The default (two-K-group) dense and 4-bit forms, unscaled, scaled, denormal (its
    pairs shifted and in place) and scaled SwiGLU, built under a ``matmul_variants``
    variant: table name to {key: spec}."""
    with matmul_variants.variant(**matmul_variants.VARIANTS[name]):
        tables = {
            "form": {
                key: spec
                for key, spec in tensor_qmm.FORM_SPECS[(False, 2)].items()
                if key[0] != 8
            }
        }
        for table, specs in (
            ("scaled", tensor_qmm.SCALED_SPECS),
            ("denormal", tensor_qmm.DENORMAL_SPECS),
            ("inplace", tensor_qmm.IN_PLACE_SPECS),
            ("swiglu", tensor_qmm.SWIGLU_SCALED_SPECS),
        ):
            tables[table] = {
                key: spec
                for key, spec in specs.items()
                if key[:2] in ((2, (4, 1)), (2, (4, 2)))
            }
    return tables


# The staging variants of session 49, each the shipped bits: the paired stage
# (tensor_qmm.PAIRED_STAGE; scales paired at groups of 64 and 128, x only at 32), the
# lean issue (tensor_qmm.LEAN_ISSUE) and both; and their negative controls: x's pieces
# left unpaired, the scale and bias pairs crossed, the ring's read slot never advanced.
STAGING = {name: _staging_tables(name) for name in ("paired", "lean", "paired-lean")}
PAIRED = STAGING["paired"]
_PAIRED_SLIPS = {
    "unpaired-x": ("dfl_interleave(low, low + 8 * SX, r + 8 < n_rows);", "(void)low;"),
    "crossed-scales": ("s2[t] = pair.x;\n          b2[t] = pair.y;", "s2[t] = pair.y;\n          b2[t] = pair.x;"),
}  # fmt: skip
PAIRED_SLIPS = {
    name: {
        key: dataclasses.replace(
            spec, base=spec.base + "_" + name, body=spec.body.replace(old, new)
        )
        for key, spec in PAIRED["scaled"].items()
        if key[2] == 64
    }
    for name, (old, new) in _PAIRED_SLIPS.items()
}
_READ_ADVANCE = "    read_slot = read_slot == STAGES - 1 ? 0 : read_slot + 1;\n"
PAIRED_SLIPS["stuck-ring"] = {
    key: dataclasses.replace(
        spec,
        base=spec.base + "_stuck_ring",
        body=spec.body.replace(_READ_ADVANCE, ""),
    )
    for key, spec in STAGING["lean"]["scaled"].items()
    if key[2] == 64 and _READ_ADVANCE in spec.body  # (lean: not everywhere)
}
assert PAIRED_SLIPS["stuck-ring"]
# The same slip in the paired SwiGLU forms: x's pieces left as copied.
SWIGLU_UNPAIRED = {
    key: dataclasses.replace(
        spec,
        base=spec.base + "_unpaired_x",
        body=spec.body.replace(*_PAIRED_SLIPS["unpaired-x"]),
    )
    for key, spec in PAIRED["swiglu"].items()
}
assert all(
    spec.body != PAIRED["swiglu"][key].body for key, spec in SWIGLU_UNPAIRED.items()
)
assert all(
    spec.body != STAGING[name]["scaled"][key].body
    for name, slips in (
        ("paired", PAIRED_SLIPS["unpaired-x"]),
        ("paired", PAIRED_SLIPS["crossed-scales"]),
        ("lean", PAIRED_SLIPS["stuck-ring"]),
    )
    for key, spec in slips.items()
)

# Negative control of the scaled-weight form: the group's bias never reaches the weights.
SCALED_G64 = tensor_qmm.SCALED_SPECS[(2, (4, 1), 64)]
SCALED_NO_BIAS = dataclasses.replace(
    SCALED_G64,
    base=SCALED_G64.base + "_no_bias",
    body=SCALED_G64.body.replace(
        "b2[t] = __byte_perm(bias, bias, 0x1010);", "b2[t] = 0u * bias;"
    ).replace(  # the paired stage's (DFLASH_QMM_PAIRED_STAGE=1)
        "b2[t] = pair.y;", "b2[t] = 0u * pair.y;"
    ),
)
assert SCALED_NO_BIAS.body != SCALED_G64.body


def _scaled_tables() -> dict:
    """The scaled 4-bit forms (plain, denormal, in place) of two K groups, one and two
    m-tiles and every group size, by table name, as the tables hold them now."""
    return {
        table: {
            key: spec
            for key, spec in specs.items()
            if key[0] == 2 and key[1] in ((4, 1), (4, 2))
        }
        for table, specs in (
            ("scaled", tensor_qmm.SCALED_SPECS),
            ("denormal", tensor_qmm.DENORMAL_SPECS),
            ("inplace", tensor_qmm.IN_PLACE_SPECS),
        )
    }


# Unit scales (tensor_qmm.UNIT_SCALES, matmul_variants' ``unit``): the scaled 4-bit
# forms (plain, denormal, in place) at one and two m-tiles and every group size, built
# with it; and two slips: every chunk reads its unit's first chunk's scales (the offset
# within the unit dropped), and the units share one slot (a unit's copy lands over the
# one still being read).
with matmul_variants.variant(**matmul_variants.VARIANTS["unit"]):
    UNIT = _scaled_tables()
assert all("_unit" in s.base for specs in UNIT.values() for s in specs.values())
_UNIT_OFFSET = (
    "STAGE_BYTES +\n                                 (c & (unit_chunks - 1)) * per_chunk * 2;",
    "STAGE_BYTES;",
)
_UNIT_SLIPS = {
    "unit-offset": (_UNIT_OFFSET,),
    "one-slot": (
        ("(c >> unit_shift) % STAGES)", "(c >> unit_shift) % 1)"),
        ("(c_begin >> unit_shift) % STAGES;", "(c_begin >> unit_shift) % 1;"),
        ("unit_slot = unit_slot == STAGES - 1 ? 0 : unit_slot + 1;", "unit_slot = 0;"),
    ),
}
UNIT_SLIPS = {}
for _slip, _edits in _UNIT_SLIPS.items():
    _spec0 = UNIT["scaled"][(2, (4, 1), 64)]
    _body = _spec0.body
    for _old, _new in _edits:
        assert _old in _body, _slip
        _body = _body.replace(_old, _new)
    UNIT_SLIPS[_slip] = dataclasses.replace(
        _spec0, base=_spec0.base + "_" + _slip.replace("-", "_"), body=_body
    )


# Chunk-major scales (tensor_qmm.CHUNK_MAJOR_SCALES, the default since session 54): the
# scaled forms that read a repack of the scales and biases, (K / 256, N, 256 / group),
# and the same forms reading mlx's layout (``DFLASH_QMM_CHUNK_MAJOR_SCALES=0``). 4-bit
# plain, denormal and in place at one and two m-tiles and every group size.
with matmul_variants.variant(**matmul_variants.VARIANTS["cmajor"]):
    CMAJOR = _scaled_tables()
with matmul_variants.variant(**matmul_variants.VARIANTS["rowmajor"]):
    ROW_MAJOR = _scaled_tables()
assert all(
    tensor_qmm.reads_chunk_major(s) for specs in CMAJOR.values() for s in specs.values()
)
assert not any(
    tensor_qmm.reads_chunk_major(s)
    for specs in ROW_MAJOR.values()
    for s in specs.values()
)
assert all(len(specs) == 6 for specs in CMAJOR.values())
# Interleaved scales (tensor_qmm.INTERLEAVED_SCALES, opt-in): the same forms at groups
# of 64 and 128, reading a chunk's scales and biases side by side.
with matmul_variants.variant(**matmul_variants.VARIANTS["interleaved"]):
    ILEAVE = {
        table: {key: spec for key, spec in specs.items() if key[2] != 32}
        for table, specs in _scaled_tables().items()
    }
assert all(
    tensor_qmm.reads_interleaved(s) for specs in ILEAVE.values() for s in specs.values()
)
assert all(len(specs) == 4 for specs in ILEAVE.values())


# The variants whose emulated tests run them in bfloat16 alone (fixed cases): the
# emulator builds them at that type only.
BFLOAT16_VARIANTS = (
    *(
        spec
        for tables in STAGING.values()
        for specs in tables.values()
        for spec in specs.values()
    ),
    *(spec for specs in PAIRED_SLIPS.values() for spec in specs.values()),
    *SWIGLU_UNPAIRED.values(),
    *(spec for specs in UNIT.values() for spec in specs.values()),
    *UNIT_SLIPS.values(),
    *(spec for specs in CMAJOR.values() for spec in specs.values()),
    *(spec for specs in ROW_MAJOR.values() for spec in specs.values()),
    *(spec for specs in ILEAVE.values() for spec in specs.values()),
)


@pytest.fixture(scope="module")
def tensor_emulator(tmp_path_factory):
    if GXX is None:
        pytest.skip("g++ not installed")
    wide = (
        tuple(tensor_qmm.SPECS)
        + tuple(MUTANTS.values())
        + tuple(K2_SPECS.values())
        + tuple(tensor_qmm.K2_FOLDED_SPECS.values())
        + (K2_DROPPED, SWIGLU_WRONG_HALF)
        + tuple(tensor_qmm.SCALED_SPECS.values())
        + (SCALED_NO_BIAS,)
        + tuple(DENORM_SPECS.values())
        + tuple(IN_PLACE_SPECS.values())
        + (IN_PLACE_ONE_SCALE,)
        + tuple(
            spec for specs in SAME_BITS_VARIANTS.values() for spec in specs.values()
        )
        + tuple(
            spec
            for tables in (LEAN_BYTES, LEAN_BYTES_UNSIGNED, FLOAT_BYTES)
            for specs in tables.values()
            for spec in specs.values()
        )
    )
    # A variant's table may hold a shipped form as it is: that one keeps both types.
    shared = {id(spec) for spec in wide}
    emulator = TensorEmulator(
        tmp_path_factory.mktemp("tensor_emulator"),
        wide + BFLOAT16_VARIANTS,
        GXX,
        bfloat16_only=[s for s in BFLOAT16_VARIANTS if id(s) not in shared],
    )
    assert emulator.build.ok, emulator.build.log
    return emulator


def _launches(splits: int) -> int:
    """Launches of one call: two when K is split and the sum is a launch of its own."""
    return 2 if splits > 1 and not tensor_qmm.merge_split_sum() else 1


@pytest.fixture
def emulated(tensor_emulator, monkeypatch):
    """small_row_matmul on a pretend CUDA backend whose launches run the emulator
    (on the host, so not inside an ``mx.compile`` trace: compiled replay off)."""
    monkeypatch.setattr(qmm.backend, "BACKEND", "cuda")
    monkeypatch.setenv(qmm.backend.COMPILE_ENV, "0")
    # The unscaled form (the scaled one, the default since session 26, has its own
    # tests and oracle below; the launch geometry they share is tested here).
    monkeypatch.setenv(tensor_qmm.SCALED_B_ENV, "0")
    monkeypatch.setattr(qmm.groups, "launch_groups", tensor_emulator.launch)
    tensor_emulator.late = False
    yield tensor_emulator
    tensor_emulator.late = False


_FIXTURES = [HealthCheck.function_scoped_fixture]


@settings(max_examples=25, deadline=None, suppress_health_check=_FIXTURES)
@given(
    case=served_cases(max_chunks=3, max_columns=200),
    late=st.booleans(),
    folded=st.booleans(),
    waves=st.booleans(),
)
def test_emulated_body_matches_oracle(
    emulated, monkeypatch, case, late, folded, waves
) -> None:
    """The body text itself (helpers emulated) against the float64 oracle, through
    small_row_matmul (launch geometry, K split and its sum included), in the plain and
    the folded-offset 4-bit forms, with either K-split rule."""
    monkeypatch.setattr(tensor_qmm, "FOLD_Q4_OFFSET", folded)
    monkeypatch.setattr(tensor_qmm, "WAVE_SPLIT", waves)
    emulated.late = late
    before = emulated.launches
    x, weight, _, _, bits, _ = case
    _, splits, _ = split_plan(x.shape[1], weight.shape[0], bits, waves)
    assert _close_to_matmul_oracle(case, _kernel(case))
    assert emulated.launches == before + _launches(splits)


@pytest.mark.parametrize("variant", sorted(MERGE_VARIANTS))
@settings(max_examples=6, deadline=None, suppress_health_check=_FIXTURES)
@given(case=served_cases(max_chunks=9, max_columns=200), late=st.booleans())
def test_emulated_merge_variants_give_the_shipped_merge_bits(
    emulated, variant, case, late
) -> None:
    """matmul_variants' ``batchedmerge`` (session 41's try: a split's loads of 8 outputs
    a thread in flight) and ``mergeloop`` (the merge before session 43: each split's load
    waited for by its add) sum a K split's partials in the shipped merge's order, so
    every output keeps its bits (the emulated body, whatever the split)."""
    emulated.late = late
    _assert_merge_variant_bits(emulated, variant, case)


def _assert_merge_variant_bits(emulated, variant: str, case) -> None:
    """The variant's output bits (:data:`SAME_BITS_VARIANTS`) equal the shipped
    form's for ``case``."""
    shipped = raw_bits(_kernel(case))
    assert np.array_equal(_variant_bits(emulated, variant, case), shipped)


def _variant_bits(emulated, variant: str, case) -> np.ndarray:
    """``case``'s output bits under the variant's forms (one of them launched)."""
    return _bits_with_specs(emulated, case, {"form": SAME_BITS_VARIANTS[variant]})


@settings(max_examples=16, deadline=None, suppress_health_check=_FIXTURES)
@given(
    case=served_cases(max_chunks=6, max_columns=200),
    late=st.booleans(),
    misaligned=st.booleans(),
)
def test_emulated_direct_dense_loads_give_the_shipped_bits(
    emulated, case, late, misaligned
) -> None:
    """matmul_variants' ``wdirect``: dense weights loaded from global memory straight
    into the fragment registers (16 bytes a lane, or 16-bit copies when a pointer is
    not 16-byte aligned) feed the mma the same operands in the same order, so every
    output keeps the shipped bits; affine forms keep their staged copies."""
    emulated.late, emulated.misaligned = late, misaligned
    try:
        _assert_merge_variant_bits(emulated, "wdirect", case)
    finally:
        emulated.misaligned = False


@pytest.mark.parametrize("rows", [1, 16, 32])
@pytest.mark.parametrize("misaligned", [False, True])
def test_emulated_direct_dense_loads_on_fixed_dense_calls(
    emulated, rows, misaligned
) -> None:
    """``wdirect`` on dense calls of one and two row tiles, K split or not: the
    shipped bits; a form whose lanes load their neighbours' elements does not."""
    emulated.misaligned = misaligned
    try:
        for depth, columns in ((64 * 5, 200), (64 * 40, 130)):
            case = _fixed_case(rows, depth, columns, None, None, mx.bfloat16, rows)
            _assert_merge_variant_bits(emulated, "wdirect", case)
        crossed = _variant_bits(emulated, "wdirect-crossed", case)
        assert not np.array_equal(crossed, raw_bits(_kernel(case)))
    finally:
        emulated.misaligned = False


@pytest.mark.parametrize("chunks, splits", [(3, 3), (8, 8), (10, 10)])
def test_emulated_unrolled_merge_keeps_bits_on_both_sides_of_eight_splits(
    emulated, chunks, splits
) -> None:
    """The shipped merge holds up to 8 splits' loads unrolled and loops past that: both
    paths give the bits of the merge before it (``mergeloop``; a 4-bit call of one
    column tile splits K into one chunk a CTA)."""
    case = _fixed_case(5, 256 * chunks, 100, 4, 64, mx.bfloat16, chunks)
    assert split_plan(256 * chunks, 100, 4, True)[1] == splits
    _assert_merge_variant_bits(emulated, "mergeloop", case)


def _cancelling_case(rows: int, columns: int, seed: int):
    """A 4-bit call of three chunks whose K split (one chunk a split) leaves partials
    P, -P and a small Q: x's second chunk is the first one negated (x 1e6 times the
    third's scale) over the same weights, so split order shows in bfloat16 ((P - P) + Q
    is Q; (Q - P) + P keeps a few of Q's bits)."""
    rng = np.random.default_rng(seed)
    big = rng.standard_normal((rows, 256)).astype(np.float32) * 1e6
    x = np.concatenate([big, -big, rng.standard_normal((rows, 256))], axis=1)
    first = rng.standard_normal((columns, 256)).astype(np.float32)
    dense = np.concatenate([first, first, rng.standard_normal((columns, 256))], axis=1)
    x = mx.array(x.astype(np.float32)).astype(mx.bfloat16)
    weight, scales, biases = mx.quantize(
        mx.array(dense.astype(np.float32)).astype(mx.bfloat16), group_size=64, bits=4
    )
    return x, weight, scales, biases, 4, 64


@pytest.mark.parametrize("rows", [1, 16, 32])
def test_emulated_vector_merge_keeps_bits_on_every_path(emulated, rows) -> None:
    """The vector merge (``vecmerge``, tensor_qmm.VECTOR_MERGE: 4 outputs of a row a
    thread, every split's 16-byte load in flight) gives the shipped merge's bits (one
    output a thread) on its 16-byte path (N a multiple of 4) and its fallbacks (N not
    a multiple of 4; more than 8 splits). Negative control: on partials that cancel,
    the 16-byte path summing the splits in reverse changes bits (so it ran, in
    order)."""
    for chunks, columns in ((3, 128), (3, 100), (3, 130), (10, 100)):
        case = _fixed_case(rows, 256 * chunks, columns, 4, 64, mx.bfloat16, chunks)
        assert split_plan(256 * chunks, columns, 4, True)[1] == chunks
        _assert_merge_variant_bits(emulated, "vecmerge", case)
    for columns in (128, 100):
        case = _cancelling_case(rows, columns, columns)
        assert split_plan(3 * 256, columns, 4, True)[1] == 3
        _assert_merge_variant_bits(emulated, "vecmerge", case)
        reversed_bits = _variant_bits(emulated, "merge-reversed", case)
        assert not np.array_equal(reversed_bits, raw_bits(_kernel(case)))


# A bf16 target's fused projections whose plan the dense CTA cost of 8 chunks chose
# (session 46): (K, N of the full call, rows).
DENSE_GLIMMER_PLANS = [(6656, 8704, 16), (6656, 8704, 1), (6656, 39936, 16)]


@pytest.mark.parametrize("depth, full_columns, rows", DENSE_GLIMMER_PLANS)
def test_emulated_dense_glimmer_plans_match_the_oracle_row_by_row(
    emulated, monkeypatch, depth, full_columns, rows
) -> None:
    """The K split a bf16 Glimmer call gets (the fused q/k/v/gate: 3 splits of 35, 35
    and 34 chunks; the fused gate / up: 4 of 26), run on the emulator over two of its
    column tiles at Glimmer's K: close to the oracle, each row with its batch bits."""
    splits, per_split = split_plan(depth, full_columns, None, True)[1:]
    shipped = tensor_qmm.split_plan

    def glimmer_split(depth_, columns, bits, waves=None):
        if (depth_, bits) == (depth, None):
            return (-(-columns // tensor_qmm.COLUMNS), splits, per_split)
        return shipped(depth_, columns, bits, waves)

    grids, launch = [], emulated.launch

    def recorded(spec, inputs, shapes, dtypes, groups, dtype):
        grids.append(groups)
        return launch(spec, inputs, shapes, dtypes, groups, dtype)

    tensor_qmm.launch_plan.cache_clear()
    monkeypatch.setattr(tensor_qmm, "split_plan", glimmer_split)
    monkeypatch.setattr(qmm.groups, "launch_groups", recorded)
    try:
        case = _fixed_case(rows, depth, 2 * tensor_qmm.COLUMNS, None, None, HALF[0], 7)
        assert _close_to_matmul_oracle(case, _kernel(case))
        assert grids == [2 * splits]  # the plan ran, its sum merged in the launch
        if rows > 1:
            _assert_batch_invariant(case)
    finally:
        tensor_qmm.launch_plan.cache_clear()


def test_emulated_fused_projections_give_each_member_its_columns(emulated) -> None:
    """Sibling projections stacked into one launch (the tensor-core body, emulated):
    each member's slice matches the oracle of its own weights, and only the first
    member's call launches."""
    mx.random.seed(7)
    layers = []
    for width in (40, 72, 24):
        dense = nn.Linear(256, width, bias=False)
        dense.set_dtype(mx.bfloat16)
        layers.append(nn.QuantizedLinear.from_linear(dense, group_size=64, bits=4))
    mx.eval([layer.parameters() for layer in layers])
    x = mx.random.normal((5, 256)).astype(mx.bfloat16)
    group = FusedProjections(layers)
    _, splits, _ = split_plan(256, 40 + 72 + 24, 4)
    before = emulated.launches
    for index, layer in enumerate(layers):
        out = group.output(index, x, use_kernel=True)
        mx.eval(out)
        case = (x, layer["weight"], layer["scales"], layer["biases"], 4, 64)
        assert _close_to_matmul_oracle(case, out), index
        assert emulated.launches == before + _launches(splits)


def _member_layers(widths, depth: int, seed: int) -> list:
    """4-bit (group 64) projections of ``depth`` inputs, one per width."""
    mx.random.seed(seed)
    layers = []
    for width in widths:
        dense = nn.Linear(depth, width, bias=False)
        dense.set_dtype(mx.bfloat16)
        layers.append(nn.QuantizedLinear.from_linear(dense, group_size=64, bits=4))
    mx.eval([layer.parameters() for layer in layers])
    return layers


def _member_case(x, layer) -> tuple:
    return (x, layer["weight"], layer["scales"], layer["biases"], 4, 64)


@pytest.mark.parametrize("merged", [True, False])
def test_emulated_member_major_members_have_the_plain_bits(
    emulated, monkeypatch, merged
) -> None:
    """Fused members whose edges are multiples of the column tile are stored one block
    each (the tensor-core body, emulated, K split 4 ways): every member matches the
    oracle of its own weights and has the plain layout's bits, with the split's sum
    merged into the launch or a launch of its own."""
    monkeypatch.setattr(tensor_qmm, "MERGE_SPLIT_SUM", merged)
    layers = _member_layers((128, 256, 128), 1024, 3)
    x = mx.random.normal((5, 1024)).astype(mx.bfloat16)
    assert split_plan(1024, 512, 4)[1] == 4
    taken = []
    edges_of = tensor_qmm.member_edges

    def spy(edges, columns):
        taken.append(edges_of(edges, columns))
        return taken[-1]

    monkeypatch.setattr(tensor_qmm, "member_edges", spy)
    results = {}
    for switch in ("1", "0"):
        monkeypatch.setenv(tensor_qmm.MEMBER_MAJOR_ENV, switch)
        group = FusedProjections(layers)
        outs = [group.output(index, x, use_kernel=True) for index in range(3)]
        mx.eval(outs)
        for layer, out in zip(layers, outs):
            assert _close_to_matmul_oracle(_member_case(x, layer), out)
        results[switch] = [raw_bits(out) for out in outs]
    assert taken == [(128, 384), ()]
    assert all(map(np.array_equal, results["1"], results["0"]))


def test_emulated_tails_launch_reads_the_stack_from_its_calling_member(
    emulated, monkeypatch
) -> None:
    """A tails set (the drafter's q / k / v) through the tensor-core body, emulated: a
    call of member 1 launches once over members 1 and 2's rows (a view of the stack at
    an offset, stored member by member), and each member matches the oracle of its own
    weights; member 0 with the same input launches again, over the whole stack."""
    layers = _member_layers((256, 128, 128), 512, 5)
    x = mx.random.normal((5, 512)).astype(mx.bfloat16)
    taken = []
    edges_of = tensor_qmm.member_edges

    def spy(edges, columns):
        taken.append((tuple(edges), columns))
        return edges_of(edges, columns)

    monkeypatch.setattr(tensor_qmm, "member_edges", spy)
    group = FusedProjections(layers, tails=True)
    before = emulated.launches
    outs = {index: group.output(index, x, use_kernel=True) for index in (1, 2)}
    mx.eval(list(outs.values()))
    once = emulated.launches - before
    assert once > 0 and taken == [((128,), 256)]
    outs[0] = group.output(0, x, use_kernel=True)
    mx.eval(outs[0])
    assert taken[1:] == [((256, 384), 512)] and emulated.launches > before + once
    for index, layer in enumerate(layers):
        assert _close_to_matmul_oracle(_member_case(x, layer), outs[index]), index


@pytest.mark.parametrize("merged", [True, False])
def test_emulated_matmul_with_a_leading_shape_launches_on_x_as_it_is(
    emulated, monkeypatch, merged
) -> None:
    """Bound with ``lead=(1, 5)`` (a layer's ``(B, L)``), the tensor-core form hands
    the launch ``x`` itself and declares the result ``(1, 5, N)``: no reshape on either
    side, the bits of the ``(5, K)`` call (K split 4 ways, its sum merged or a launch of
    its own). Fused member-major members come as ``(1, 5, width)`` views of one flat
    buffer."""
    monkeypatch.setattr(tensor_qmm, "MERGE_SPLIT_SUM", merged)
    layers = _member_layers((128, 256, 128), 1024, 5)
    x = mx.random.normal((5, 1024), key=mx.random.key(4)).astype(mx.bfloat16)
    x3 = x.reshape(1, 5, 1024)
    seen = []
    launch = qmm.groups.launch_groups

    def spy(spec, inputs, output_shapes, *rest):
        seen.append((inputs[0].shape, tuple(map(tuple, output_shapes))))
        return launch(spec, inputs, output_shapes, *rest)

    monkeypatch.setattr(qmm.groups, "launch_groups", spy)
    layer = layers[1]
    weights = (layer["weight"], layer["scales"], layer["biases"])
    options = dict(bits=4, group_size=64, use_kernel=True)
    flat = qmm.bind_matmul((5, 1024), mx.bfloat16, *weights, **options)(x)
    seen.clear()
    shaped = qmm.bind_matmul((5, 1024), mx.bfloat16, *weights, **options, lead=(1, 5))
    got = shaped(x3)
    mx.eval(flat, got)
    assert got.shape == (1, 5, 256)
    assert np.array_equal(raw_bits(got), raw_bits(flat.reshape(1, 5, 256)))
    assert seen[0][0] == (1, 5, 1024)  # the matmul launch reads x as it is
    assert seen[-1][1][0] == (1, 5, 256)  # the last launch declares the result
    monkeypatch.setenv(tensor_qmm.MEMBER_MAJOR_ENV, "1")
    group = FusedProjections(layers)
    plain = [group.output(index, x, use_kernel=True) for index in range(3)]
    members = [group.output(index, x3, use_kernel=True) for index in range(3)]
    mx.eval(plain, members)
    for width, a, b in zip((128, 256, 128), plain, members):
        assert b.shape == (1, 5, width)
        assert np.array_equal(raw_bits(b), raw_bits(a.reshape(1, 5, width)))


def test_a_leading_shape_must_hold_the_rows() -> None:
    """``lead`` whose extents do not multiply to the rows is refused by the bind (the
    reference form too), and the reference form gives ``(*lead, N)``."""
    layer = _member_layers((64,), 256, 1)[0]
    weights = (layer["weight"], layer["scales"], layer["biases"])
    options = dict(bits=4, group_size=64)
    with pytest.raises(ValueError, match="leading shape"):
        qmm.bind_matmul((6, 256), mx.bfloat16, *weights, **options, lead=(2, 2))
    with pytest.raises(ValueError, match="leading shape"):
        tensor_qmm.bind_tensor_core(6, 256, *weights, 4, 64, mx.bfloat16, lead=(4,))
    x = mx.random.normal((6, 256), key=mx.random.key(2)).astype(mx.bfloat16)
    options["use_kernel"] = False
    flat = qmm.bind_matmul((6, 256), mx.bfloat16, *weights, **options)(x)
    bound = qmm.bind_matmul((6, 256), mx.bfloat16, *weights, **options, lead=(2, 3))
    shaped = bound(x.reshape(2, 3, 256))
    assert shaped.shape == (2, 3, 64)
    assert np.array_equal(raw_bits(shaped), raw_bits(flat.reshape(2, 3, 64)))


@settings(max_examples=30, deadline=None)
@given(
    lead=st.lists(st.integers(1, 4), min_size=1, max_size=3),
    widths=st.lists(st.integers(1, 5), min_size=1, max_size=4),
)
def test_member_views_are_each_members_block_in_turn(lead, widths) -> None:
    """A member-major buffer, flat or ``(rows, N)``, read as ``(*lead, width)`` per
    member: member m's element (r, c) is the buffer's ``edge_m * rows + r * width + c``.
    """
    rows = int(np.prod(lead))
    columns = sum(widths)
    buffer = mx.arange(rows * columns, dtype=mx.int32)
    edges = tuple(np.cumsum(widths)[:-1].tolist())
    for y in (buffer, buffer.reshape(rows, columns)):
        views = member_views(y, edges, lead)
        start = 0
        for width, view in zip(widths, views):
            assert view.shape == (*lead, width)
            want = np.arange(start * rows, (start + width) * rows).reshape(*lead, width)
            assert np.array_equal(np.asarray(view), want)
            start += width


def test_member_edges_take_only_tile_aligned_inner_edges(monkeypatch) -> None:
    columns = tensor_qmm.COLUMNS
    assert tensor_qmm.member_edges((columns, 3 * columns), 4 * columns) == (
        columns,
        3 * columns,
    )
    for edges in [
        (),
        (64,),
        (columns, columns),
        (4 * columns,),
        (2 * columns, columns),
    ]:
        assert tensor_qmm.member_edges(edges, 4 * columns) == (), edges
    monkeypatch.setenv(tensor_qmm.MEMBER_MAJOR_ENV, "0")
    assert tensor_qmm.member_edges((columns,), 2 * columns) == ()


@pytest.mark.parametrize(
    "depth, store", [(256, "direct"), (512, "merged"), (512, "reduce")]
)
def test_emulator_catches_a_plain_store_of_member_major_members(
    tensor_emulator, depth, store
) -> None:
    """Negative control: a store that writes the plain layout while the plan gives
    member edges (the matmul's own store without a K split or with the merged sum,
    the separate sum launch's) leaves a member's view holding other columns; the good
    bodies meet every member's oracle."""
    layers = _member_layers((128, 256), depth, 4)
    stacked = [
        mx.concatenate([layer[name] for layer in layers])
        for name in ("weight", "scales", "biases")
    ]
    x = mx.random.normal((6, depth)).astype(mx.bfloat16)
    plan = tensor_qmm.launch_plan(
        6, depth, 384, 4, 64, store == "merged", False, tensor_qmm.wave_split(), 1,
        (128,),
    )  # fmt: skip
    assert plan.shapes[1][0] == (1 if store == "direct" else 2)  # the K split
    assert (plan.reduce_params is not None) == (store == "reduce")
    good_specs = (tensor_qmm.MATMUL_SPECS[(4, 1)], tensor_qmm.REDUCE_SPEC)
    if store == "reduce":
        bad_specs = (good_specs[0], MUTANTS["plain_member_sum"])
    else:
        bad_specs = (MUTANTS["plain_member_store"], good_specs[1])
    cases = [_member_case(x, layer) for layer in layers]
    good = _launch_with_sum(tensor_emulator, good_specs, plan, x, stacked)
    bad = _launch_with_sum(tensor_emulator, bad_specs, plan, x, stacked)
    assert all(map(_close_to_matmul_oracle, cases, member_views(good, (128,))))
    assert not all(map(_close_to_matmul_oracle, cases, member_views(bad, (128,))))


def _launch_with_sum(emulator, specs, plan, x, weights) -> mx.array:
    """One call of ``plan`` with ``specs`` (the matmul, the reduce launch when the plan
    has one)."""
    counters = mx.zeros((max(plan.counters, 1),), mx.int32)
    y, partial = emulator.launch(
        specs[0],
        [x, *weights, plan.params, counters],
        plan.shapes,
        [x.dtype, mx.float32],
        plan.groups,
        x.dtype,
    )
    if plan.reduce_params is None:
        return y
    (y,) = emulator.launch(
        specs[1],
        [partial, plan.reduce_params],
        [(x.shape[0], plan.columns)],
        [x.dtype],
        plan.reduce_groups,
        x.dtype,
    )
    return y


@settings(max_examples=15, deadline=None, suppress_health_check=_FIXTURES)
@given(
    case=served_cases(max_rows=20, max_chunks=4, max_columns=300),
    late=st.booleans(),
)
def test_emulated_merged_split_sum_gives_the_two_launch_bits(
    emulated, monkeypatch, case, late
) -> None:
    """The split sum merged into the matmul launch (its last CTA per column tile) gives
    every element the bits of the separate reduce launch, in one launch instead of two.
    """
    emulated.late = late
    x, weight, _, _, bits, _ = case
    _, splits, _ = split_plan(x.shape[1], weight.shape[0], bits)
    counts = {}
    results = {}
    for merged in (False, True):
        monkeypatch.setattr(tensor_qmm, "MERGE_SPLIT_SUM", merged)
        before = emulated.launches
        results[merged] = raw_bits(_kernel(case))
        counts[merged] = emulated.launches - before
    assert np.array_equal(results[True], results[False])
    assert counts == {False: 1 if splits == 1 else 2, True: 1}


@pytest.mark.parametrize("columns", [100, 300])  # one column tile, three
def test_each_merged_launch_gets_its_own_zeroed_counters(
    emulated, monkeypatch, columns
) -> None:
    """Two launches of one bound call never share counters: mlx may run independent
    launches concurrently, and shared counters would mix their partials. A one-tile
    call gets its own too (not the never-written placeholder)."""
    rng = np.random.default_rng(5)
    dense = mx.array(rng.standard_normal((columns, 1024)).astype(np.float32))
    x = mx.array(rng.standard_normal((3, 1024)).astype(np.float32)).astype(mx.bfloat16)
    weight, scales, biases = mx.quantize(
        dense.astype(mx.bfloat16), group_size=64, bits=4
    )
    tiles, splits, _ = split_plan(1024, columns, 4)
    assert splits > 1
    monkeypatch.setattr(tensor_qmm, "MERGE_SPLIT_SUM", True)
    counters = []
    launch = qmm.groups.launch_groups

    def spy(spec, inputs, *rest):
        counters.append(inputs[-1])
        return launch(spec, inputs, *rest)

    monkeypatch.setattr(qmm.groups, "launch_groups", spy)
    bound = qmm.bind_matmul(
        x.shape, x.dtype, weight, scales, biases, bits=4, group_size=64,
        use_kernel=True,
    )  # fmt: skip
    outs = [bound(x), bound(-x)]
    mx.eval(outs)
    assert len(counters) == 2 and counters[0] is not counters[1]
    assert counters[0] is not qmm.groups.launch_counters(0)
    assert all(c.shape == (tiles,) and c.dtype == mx.int32 for c in counters)
    for out, sign in zip(outs, (1, -1)):
        case = (x * sign, weight, scales, biases, 4, 64)
        assert _close_to_matmul_oracle(case, out)


class _NumberedPool(qmm.groups.CounterPool):
    """A pool whose fills hold distinct numbers, so a region shows where it was cut
    (the pool counts the fill before making it)."""

    def _fill(self) -> mx.array:
        return mx.arange(self.fills * self.size, (self.fills + 1) * self.size)


@settings(max_examples=60, deadline=None)
@given(
    size=st.integers(1, 48),
    counts=st.lists(st.integers(1, 60), min_size=1, max_size=25),
)
def test_counter_regions_are_never_handed_out_twice(size, counts) -> None:
    """Every region has the length asked for, and no counter is in two regions; one
    longer than the pool is an array of its own."""
    pool = _NumberedPool(size)
    seen = []
    for count in counts:
        region = pool.take(count)
        assert region.shape == (count,) and region.dtype in (mx.int32, mx.int64)
        if count <= size:
            seen += region.tolist()
        else:
            assert not region.any().item()  # zeros of its own
    assert len(seen) == len(set(seen))
    assert pool.fills <= sum(count <= size for count in counts)
    assert all(
        qmm.groups.CounterPool().take(count).tolist() == [0] * count for count in (1, 7)
    )


def test_a_compiled_trace_makes_its_own_counters(monkeypatch) -> None:
    """Inside a trace ``launch_counters`` makes a fill of its own (a pool region the
    trace captured would be shared by every replay); outside, it cuts from the pool."""
    pool = _NumberedPool(16)
    monkeypatch.setattr(qmm.groups, "COUNTER_POOL", pool)
    assert not qmm.backend.tracing()
    inside = []

    def forward(x: mx.array) -> mx.array:
        inside.append(qmm.backend.tracing())
        return x + qmm.groups.launch_counters(5).sum()

    compiled = qmm.backend.compile_traced(forward)
    assert [compiled(mx.array(i)).item() for i in range(3)] == [0, 1, 2]
    assert inside == [True] and not qmm.backend.tracing()
    assert pool.fills == 0
    assert qmm.groups.launch_counters(5).tolist() == [16, 17, 18, 19, 20]


@pytest.mark.parametrize("compiled", [False, True])
def test_a_compiled_matmul_takes_fresh_counters_at_every_call(
    monkeypatch, compiled
) -> None:
    """``compile_around`` hands a matmul that takes counters a new pool region at
    every call, compiled or not (the trace runs once; the regions differ each call)."""
    monkeypatch.setenv(qmm.backend.COMPILE_ENV, "1" if compiled else "0")
    pool = _NumberedPool(64)
    monkeypatch.setattr(qmm.groups, "COUNTER_POOL", pool)
    got, traces = [], []

    def matmul(x: mx.array, counters=None) -> mx.array:
        return x * 2

    matmul.counters = 3

    def forward(x: mx.array, counters) -> mx.array:
        traces.append(1)
        got.append(counters)
        return matmul(x, counters) + counters.sum() * 0

    run = qmm.compile_around(matmul, forward)
    outs = [run(mx.array([1.0, 2.0])) for _ in range(4)]
    assert all(out.tolist() == [2.0, 4.0] for out in outs)
    assert pool.fills == 1 and pool.take_located(3)[:2] == (1, 12)
    assert len(traces) == (1 if compiled else 4)
    if not compiled:
        assert [c.tolist() for c in got] == [
            [64 + 3 * i + j for j in range(3)] for i in range(4)
        ]
    plain = qmm.compile_around(lambda x, _=None: x, lambda x, counters: x + 1)
    assert plain(mx.array(1)).item() == 2 and pool.take_located(3)[:2] == (1, 15)


def _run_merged(emulator, spec, case) -> mx.array:
    """One launch of ``spec`` on a merged plan of ``case`` (K split)."""
    x, weight, scales, biases, bits, group = case
    plan = tensor_qmm.launch_plan(
        *x.shape, weight.shape[0], bits, group, True, False, tensor_qmm.wave_split()
    )
    assert plan.reduce_params is None and plan.counters > 0
    y, _ = emulator.launch(
        spec,
        [x, weight, scales, biases, plan.params, mx.zeros((plan.counters,), mx.int32)],
        plan.shapes,
        [x.dtype, mx.float32],
        plan.groups,
        x.dtype,
    )
    return y


def test_emulator_catches_merged_sum_slips(tensor_emulator, monkeypatch) -> None:
    """Negative controls of the merged split sum: a tile no CTA sums, or a sum that
    leaves a split out, misses the oracle (the good body meets it with the reduce
    launch's bits)."""
    rng = np.random.default_rng(11)
    depth, columns = 1024, 300  # 4 chunks split 4 ways, 3 column tiles
    dense = mx.array(rng.standard_normal((columns, depth)).astype(np.float32))
    x = mx.array(rng.standard_normal((7, depth)).astype(np.float32))
    x = x.astype(mx.bfloat16)
    case = (x, *mx.quantize(dense.astype(mx.bfloat16), group_size=64, bits=4), 4, 64)
    assert split_plan(depth, columns, 4)[1] > 2
    good = _run_merged(tensor_emulator, tensor_qmm.MATMUL_SPECS[(4, 1)], case)
    assert _close_to_matmul_oracle(case, good)
    monkeypatch.setattr(tensor_qmm, "MERGE_SPLIT_SUM", False)
    monkeypatch.setattr(qmm.backend, "BACKEND", "cuda")
    monkeypatch.setenv(tensor_qmm.SCALED_B_ENV, "0")
    monkeypatch.setattr(qmm.groups, "launch_groups", tensor_emulator.launch)
    assert np.array_equal(raw_bits(good), raw_bits(_kernel(case)))
    assert not _close_to_matmul_oracle(
        case, _run_merged(tensor_emulator, MUTANTS["never_last"], case)
    )
    assert not _close_to_matmul_oracle(
        case, _run_merged(tensor_emulator, MUTANTS["first_split_dropped"], case)
    )
    # Past 8 splits the merge loops: its own mutant, on a call of 10 splits.
    case = _fixed_case(5, 256 * 10, 100, 4, 64, mx.bfloat16, 10)
    assert split_plan(256 * 10, 100, 4)[1] == 10
    good = _run_merged(tensor_emulator, tensor_qmm.MATMUL_SPECS[(4, 1)], case)
    assert _close_to_matmul_oracle(case, good)
    # (The unrolled path's mutant is not taken there: it keeps the good bits.)
    unrolled_mutant = _run_merged(tensor_emulator, MUTANTS["first_split_dropped"], case)
    assert np.array_equal(raw_bits(good), raw_bits(unrolled_mutant))
    assert not _close_to_matmul_oracle(
        case,
        _run_merged(tensor_emulator, MUTANTS["first_split_dropped_past_eight"], case),
    )


@pytest.fixture
def two_k_groups(emulated, monkeypatch):
    """The emulated matmul with the two-K-group forms picked at bind (the switch)."""
    monkeypatch.setenv(tensor_qmm.TWO_K_GROUPS_ENV, "1")
    yield emulated


@settings(max_examples=8, deadline=None, suppress_health_check=_FIXTURES)
@given(
    case=served_cases(max_rows=32, max_chunks=3, max_columns=160),
    late=st.booleans(),
    folded=st.booleans(),
)
def test_emulated_two_k_group_form_matches_oracle_and_is_batch_invariant(
    two_k_groups, monkeypatch, case, late, folded
) -> None:
    """Each chunk's K split between two warp groups (256 threads; 4-bit, plain or
    folded, 8-bit and dense, one or two m-tiles, K split or not): within the oracle's
    tolerance, and each row alone gets the bits it gets in the batch."""
    monkeypatch.setattr(tensor_qmm, "FOLD_Q4_OFFSET", folded)
    two_k_groups.late = late
    before = len(two_k_groups.launched)
    assert _close_to_matmul_oracle(case, _kernel(case))
    assert _unlean(two_k_groups.launched[before]).endswith("_k2")
    _assert_batch_invariant(case)


def test_emulated_two_k_group_form_sums_a_split_k_once(two_k_groups) -> None:
    """A K split over CTAs (merged sum) on top of the groups' own split: the oracle
    holds for a Glimmer-like depth, and the two groups' sums both count (dropping the
    second group's misses the oracle)."""
    rng = np.random.default_rng(9)
    depth, columns = 2048, 300
    dense = mx.array(rng.standard_normal((columns, depth)).astype(np.float32))
    x = mx.array(rng.standard_normal((16, depth)).astype(np.float32))
    case = (
        x.astype(mx.bfloat16),
        *mx.quantize(dense.astype(mx.bfloat16), group_size=64, bits=4),
        4,
        64,
    )
    assert split_plan(depth, columns, 4)[1] > 1
    assert _close_to_matmul_oracle(case, _kernel(case))
    assert K2_DROPPED.body != K2_SPECS[(4, 1)].body
    assert _slip_shows(two_k_groups, K2_DROPPED, case)


@settings(max_examples=6, deadline=None, suppress_health_check=_FIXTURES)
@given(case=served_cases(max_rows=20, max_chunks=2, max_columns=140))
def test_emulated_body_is_batch_invariant(emulated, monkeypatch, case) -> None:
    monkeypatch.setattr(
        tensor_qmm, "FOLD_Q4_OFFSET", bool(case[4] == 4 and case[0].size % 2)
    )
    emulated.late = True
    _assert_batch_invariant(case)


@settings(max_examples=6, deadline=None, suppress_health_check=_FIXTURES)
@given(case=served_cases(max_chunks=2, max_columns=140))
def test_emulated_body_gives_misaligned_inputs_the_same_bits(emulated, case) -> None:
    """Inputs off a 16-byte boundary take plain copies instead of cp.async (which
    would fault): the same bytes land, so the same bits come out."""
    aligned = raw_bits(_kernel(case))
    emulated.misaligned = True
    try:
        assert np.array_equal(raw_bits(_kernel(case)), aligned)
    finally:
        emulated.misaligned = False


def _run_spec(emulator, spec, case) -> mx.array:
    """One launch of a 4-bit, 16-row form straight through ``spec``, K unsplit (the
    ring of stages wraps when K holds more chunks than stages)."""
    chunks = case[0].shape[1] // Layout(4, 1).chunk
    return _run_split(emulator, spec, case, 1, chunks)


def _slip_shows(emulator, spec, case) -> bool:
    """Whether a mutant body misses the oracle or the emulator refuses its run (e.g.
    copies never waited for)."""
    try:
        return not _close_to_matmul_oracle(case, _run_spec(emulator, spec, case))
    except RuntimeError:
        return True


@pytest.mark.parametrize(
    "name, caught_early, caught_late",
    [
        ("early_read", False, True),
        ("early_refill", True, False),
        ("fragments", True, True),
    ],
)
def test_emulator_catches_slips(
    tensor_emulator, name, caught_early, caught_late
) -> None:
    """Negative controls: each deliberate slip in the body fails the oracle in the
    landing mode meant to catch it; the body itself passes in both."""
    rng = np.random.default_rng(6)
    depth, columns = 1024, 300  # 4 chunks (the ring wraps), 3 column tiles
    dense = mx.array(rng.standard_normal((columns, depth)).astype(np.float32))
    x = mx.array(rng.standard_normal((16, depth)).astype(np.float32)).astype(
        mx.bfloat16
    )
    case = (x, *mx.quantize(dense.astype(mx.bfloat16), group_size=64, bits=4), 4, 64)
    for late, caught in ((False, caught_early), (True, caught_late)):
        tensor_emulator.late = late
        good = _run_spec(tensor_emulator, tensor_qmm.MATMUL_SPECS[(4, 1)], case)
        assert _close_to_matmul_oracle(case, good)
        assert _slip_shows(tensor_emulator, MUTANTS[name], case) is caught, (name, late)
    tensor_emulator.late = False


def test_emulated_folded_offset_form_is_its_own_kernel_and_bites(
    tensor_emulator,
) -> None:
    """The folded-offset form passes the oracle through its own spec (bfloat16 and
    float16), and a negative control that leaves the bias unmoved misses it."""
    rng = np.random.default_rng(8)
    dense = mx.array(rng.standard_normal((300, 1024)).astype(np.float32))
    for dtype in HALF:
        x = mx.array(rng.standard_normal((16, 1024)).astype(np.float32)).astype(dtype)
        case = (x, *mx.quantize(dense.astype(dtype), group_size=64, bits=4), 4, 64)
        folded = tensor_qmm.FOLDED_SPECS[(4, 1)]
        assert folded.base != tensor_qmm.MATMUL_SPECS[(4, 1)].base
        assert _close_to_matmul_oracle(case, _run_spec(tensor_emulator, folded, case))
        # float16 keeps q and its bias, so the mutant changes nothing there.
        slip = _slip_shows(tensor_emulator, MUTANTS["unfolded_bias"], case)
        assert slip is (dtype == mx.bfloat16)


def test_the_folded_offset_switch_is_read_at_each_bind(monkeypatch) -> None:
    """``DFLASH_QMM_FOLDED_OFFSET`` decides when set, else the module default; a
    4-bit plan takes the folded spec only then, other bits never; 8-bit refuses it."""
    monkeypatch.delenv(tensor_qmm.FOLDED_OFFSET_ENV, raising=False)
    for default in (False, True):
        monkeypatch.setattr(tensor_qmm, "FOLD_Q4_OFFSET", default)
        assert tensor_qmm.fold_q4_offset() is default
        for value, expected in (("1", True), ("0", False), ("", default)):
            monkeypatch.setenv(tensor_qmm.FOLDED_OFFSET_ENV, value)
            assert tensor_qmm.fold_q4_offset() is expected
        monkeypatch.delenv(tensor_qmm.FOLDED_OFFSET_ENV)
    for rows, mtiles in ((16, 1), (32, 2)):
        plan = tensor_qmm.launch_plan(rows, 6656, 19968, 4, 64, True, True)
        assert plan.spec is tensor_qmm.FOLDED_SPECS[(4, mtiles)]
        plan = tensor_qmm.launch_plan(rows, 6656, 19968, 8, 64, True, True)
        assert plan.spec is tensor_qmm.MATMUL_SPECS[(8, mtiles)]
    with pytest.raises(ValueError, match="4-bit only"):
        tensor_qmm._spec(Layout(8, 1), folded=True)


# ================================================================= on CUDA


def _form_close(case, out, slack: float = 1.0) -> bool:
    """The oracle of the form a call runs in now: the rounded-weight one for the
    scaled-weight form (affine calls while its switch is on), else the exact one."""
    if case[4] is not None and tensor_qmm.scaled_b(case[4]):
        return _scaled_oracle_close(case, out, slack)
    return _close_to_matmul_oracle(case, out, slack)


def _kernel(case, rows=slice(None)) -> mx.array:
    x, weight, scales, biases, bits, group = case
    out = small_row_matmul(
        x[rows], weight, scales, biases, bits=bits, group_size=group, use_kernel=True
    )
    mx.eval(out)
    return out


def _assert_batch_invariant(case) -> None:
    """Each row alone, the middle rows, and the rows reversed (every row in another
    slot) give each row the bits it gets in the whole batch."""
    together = raw_bits(_kernel(case))
    rows = case[0].shape[0]
    for row in range(rows):
        assert np.array_equal(
            raw_bits(_kernel(case, slice(row, row + 1))), together[row : row + 1]
        ), row
    if rows > 2:
        assert np.array_equal(
            raw_bits(_kernel(case, slice(1, rows - 1))), together[1 : rows - 1]
        )
    flipped = (case[0][::-1],) + tuple(case[1:])
    assert np.array_equal(raw_bits(_kernel(flipped)), together[::-1])


@pytest.mark.cuda
@cuda
@settings(max_examples=120, deadline=None)
@given(case=served_cases())
def test_cuda_tensor_matmul_matches_oracle(case) -> None:
    x, weight, _, _, bits, _ = case
    assert qmm.uses_tensor_cores(x.dtype, x.shape[0], x.shape[1], weight.shape[0], bits)
    assert _form_close(case, _kernel(case))


@pytest.mark.cuda
@cuda
@settings(max_examples=40, deadline=None)
@given(case=served_cases(max_columns=200))
def test_cuda_tensor_matmul_is_batch_invariant(case) -> None:
    _assert_batch_invariant(case)


@pytest.mark.cuda
@cuda
@settings(max_examples=40, deadline=None)
@given(case=served_cases(max_columns=300))
def test_cuda_merged_split_sum_gives_the_two_launch_bits_on_every_call(case) -> None:
    """On the GPU: one bound call with the merged split sum gives the two-launch bits
    on every call, also when mlx may run several of its launches concurrently (three
    independent inputs evaluated together)."""
    x, weight, scales, biases, bits, group = case
    inputs = [x, -x, x * 0.5]
    saved = tensor_qmm.MERGE_SPLIT_SUM
    try:
        tensor_qmm.MERGE_SPLIT_SUM = False
        want = [raw_bits(_kernel((row, *case[1:]))) for row in inputs]
        tensor_qmm.MERGE_SPLIT_SUM = True
        bound = qmm.bind_matmul(
            x.shape, x.dtype, weight, scales, biases, bits=bits, group_size=group,
            use_kernel=True,
        )  # fmt: skip
        for _ in range(2):
            assert np.array_equal(raw_bits(bound(x)), want[0])
        together = [bound(row) for row in inputs]
        mx.eval(together)
        for got, expected in zip(together, want):
            assert np.array_equal(raw_bits(got), expected)
    finally:
        tensor_qmm.MERGE_SPLIT_SUM = saved


@pytest.mark.cuda
@cuda
@settings(max_examples=40, deadline=None)
@given(case=served_cases(max_chunks=3, max_columns=120))
def test_cuda_both_kernel_forms_match_oracle(case) -> None:
    """The tensor-core form and the scalar kernel (forced) both hold on CUDA."""
    tensor = _kernel(case)
    qmm.TENSOR_CORES = False
    try:
        scalar = _kernel(case)
    finally:
        qmm.TENSOR_CORES = True
    assert _form_close(case, tensor)
    assert _close_to_matmul_oracle(case, scalar)


@pytest.mark.cuda
@cuda
def test_cuda_tensor_matmul_unaligned_views_give_the_same_bits() -> None:
    """Inputs whose data start off a 16-byte boundary take the plain-copy path: the
    same bytes reach shared memory, so the same bits come out."""
    rng = np.random.default_rng(5)
    rows, depth, columns = 16, 512, 200
    dense = mx.array(rng.standard_normal((columns, depth)).astype(np.float32))
    dense = dense.astype(mx.bfloat16)
    x = mx.array(rng.standard_normal((rows, depth)).astype(np.float32)).astype(
        mx.bfloat16
    )
    weight, scales, biases = mx.quantize(dense, group_size=64, bits=4)
    aligned = (x, weight, scales, biases, 4, 64)
    shifted = mx.concatenate([mx.zeros((1,), x.dtype), x.reshape(-1)])[1:].reshape(
        rows, depth
    )
    s_shift = mx.concatenate([mx.zeros((1,), x.dtype), scales.reshape(-1)])[1:]
    unaligned = (shifted, weight, s_shift.reshape(scales.shape), biases, 4, 64)
    assert np.array_equal(raw_bits(_kernel(aligned)), raw_bits(_kernel(unaligned)))
    assert _form_close(aligned, _kernel(unaligned))


def _glimmer_case(depth, columns, rows, bits, dtype=mx.bfloat16, spread=1.0, group=64):
    """A Glimmer-shaped case; ``spread``: the weights' standard deviation (a trained
    model's are ~0.02, so its 4-bit scales lie far below 0.25; 1.0 gives ~0.4);
    ``group``: the quantization's group size."""
    key = mx.random.key(depth + columns)
    k1, k2 = mx.random.split(key)
    dense = (spread * mx.random.normal((columns, depth), key=k1)).astype(dtype)
    x = mx.random.normal((rows, depth), key=k2).astype(dtype)
    if bits is None:
        return x, dense, None, None, None, None
    return (x, *mx.quantize(dense, group_size=group, bits=bits), bits, group)


def _close_on_columns(case, out, columns) -> bool:
    """The oracle on a subset of the columns (the full lm_head is too big for numpy)."""
    x, weight, scales, biases, bits, group = case
    index = mx.array(columns)
    part = (
        x,
        weight[index],
        None if scales is None else scales[index],
        None if biases is None else biases[index],
        bits,
        group,
    )
    return _form_close(part, out[:, index], slack=4.0)


# (rows, bits) per shape; no dense lm_head (2.7 GB in bf16, the oracle's float64 twice).
GLIMMER_FORMS = [
    (shape, rows, bits)
    for shape in GLIMMER + (LM_HEAD,)
    for rows, bits in ((1, 4), (16, 4), (16, 8), (16, None))
    if not (shape == LM_HEAD and bits is None)
] + [
    # The fused launches (attention q/k/v/gate, MLP gate+up), quantized: the gate+up's
    # K split is the one the wave rule's fixed cost changed (session 41).
    (shape, rows, bits)
    for shape in ((6656, 8704), (6656, 39936))
    for rows, bits in ((1, 4), (16, 4), (16, 8))
]


@pytest.mark.cuda
@cuda
@pytest.mark.parametrize("shape, rows, bits", GLIMMER_FORMS)
def test_cuda_tensor_matmul_glimmer_shapes(shape, rows, bits) -> None:
    """Every Glimmer projection (K, N) at 1 and 16 rows, bf16, group 64: close to the
    oracle (on 2,048 columns for the lm_head) and row 0 alone has its batch bits."""
    depth, columns = shape
    case = _glimmer_case(depth, columns, rows, bits)
    assert qmm.uses_tensor_cores(mx.bfloat16, rows, depth, columns, bits)
    out = _kernel(case)
    if shape == LM_HEAD:
        picked = list(range(1024)) + list(range(columns - 1024, columns))
        assert _close_on_columns(case, out, picked)
    else:
        assert _form_close(case, out, slack=4.0)
    alone = _kernel(case, slice(0, 1))
    assert np.array_equal(raw_bits(alone), raw_bits(out[0:1]))


def _attention_members(bits, seed: int) -> list:
    """An attention's q / k / v / gate projections, narrower (K 2048; 1024, 128, 128,
    1024 columns), bf16 or affine ``bits`` in groups of 64."""
    mx.random.seed(seed)
    layers = []
    for width in (1024, 128, 128, 1024):
        dense = nn.Linear(2048, width, bias=False)
        dense.set_dtype(mx.bfloat16)
        if bits is not None:
            dense = nn.QuantizedLinear.from_linear(dense, group_size=64, bits=bits)
        layers.append(dense)
    mx.eval([layer.parameters() for layer in layers])
    return layers


@pytest.mark.cuda
@cuda
@pytest.mark.parametrize("rows", [1, 16])
@pytest.mark.parametrize("bits", [4, None])
@pytest.mark.parametrize("merged", [True, False])
def test_cuda_a_leading_shape_keeps_the_flat_bits(monkeypatch, rows, bits, merged):
    """On the GPU: a matmul bound with ``lead=(1, rows)`` (launched on ``x`` as it is,
    its result declared ``(1, rows, N)``) and fused member-major members read as
    ``(1, rows, width)`` give the ``(rows, K)`` calls' bits."""
    monkeypatch.setattr(tensor_qmm, "MERGE_SPLIT_SUM", merged)
    layers = _attention_members(bits, seed=rows + (bits or 0))
    x = mx.random.normal((rows, 2048)).astype(mx.bfloat16)
    x3 = x.reshape(1, rows, 2048)
    layer = layers[0]
    weights = (layer["weight"], layer.get("scales"), layer.get("biases"))
    options = dict(bits=bits, group_size=64 if bits else None, use_kernel=True)
    flat = qmm.bind_matmul((rows, 2048), mx.bfloat16, *weights, **options)(x)
    bound = qmm.bind_matmul(
        (rows, 2048), mx.bfloat16, *weights, **options, lead=x3.shape[:-1]
    )
    shaped = bound(x3)
    group = FusedProjections(layers)
    plain = [group.output(index, x, use_kernel=True) for index in range(4)]
    members = [group.output(index, x3, use_kernel=True) for index in range(4)]
    mx.eval(flat, shaped, plain, members)
    assert np.array_equal(raw_bits(shaped), raw_bits(flat.reshape(1, rows, 1024)))
    for a, b in zip(plain, members):
        assert b.shape == (1, *a.shape)
        assert np.array_equal(raw_bits(b), raw_bits(a.reshape(b.shape)))


@pytest.mark.cuda
@cuda
@pytest.mark.parametrize("rows", [1, 16])
@pytest.mark.parametrize("bits", [4, 8, None])
@pytest.mark.parametrize("merged", [True, False])
def test_cuda_member_major_members_have_the_plain_bits(
    monkeypatch, rows, bits, merged
) -> None:
    """On the GPU: an attention's fused q / k / v / gate (narrower, same pattern) stored
    member by member gives every member the plain layout's bits and its own oracle,
    also with several inputs evaluated together."""
    layers = _attention_members(bits, seed=rows + (bits or 0))
    monkeypatch.setattr(tensor_qmm, "MERGE_SPLIT_SUM", merged)
    inputs = [mx.random.normal((rows, 2048)).astype(mx.bfloat16) for _ in range(3)]
    results = {}
    for switch in ("0", "1"):
        monkeypatch.setenv(tensor_qmm.MEMBER_MAJOR_ENV, switch)
        group = FusedProjections(layers)
        results[switch] = [
            [group.output(index, x, use_kernel=True) for index in range(4)]
            for x in inputs
        ]
        mx.eval(results[switch])
    for plain, blocks in zip(results["0"], results["1"]):
        assert all(map(np.array_equal, map(raw_bits, plain), map(raw_bits, blocks)))
    for layer, out in zip(layers, results["1"][0]):
        weights = (layer["weight"], layer.get("scales"), layer.get("biases"))
        case = (inputs[0], *weights, bits, 64 if bits else None)
        assert _form_close(case, out, slack=4.0)


# ====================================================== the SwiGLU form


@st.composite
def swiglu_cases(draw, max_rows: int = 20, max_chunks: int = 3, max_halves: int = 2):
    """A stacked ``[gate; up]`` call the SwiGLU form takes: N a multiple of 128."""
    bits = draw(st.sampled_from([4, 8, None]))
    group = draw(st.sampled_from([32, 64, 128])) if bits else None
    depth = Layout(bits or 0, 1).chunk * draw(st.integers(1, max_chunks))
    rows = draw(st.integers(1, max_rows))
    columns = 2 * (tensor_qmm.COLUMNS // 2) * draw(st.integers(1, max_halves)) * 2
    dtype = draw(st.sampled_from(HALF))
    rng = np.random.default_rng(draw(st.integers(0, 2**16)))
    x = mx.array(rng.standard_normal((rows, depth)).astype(np.float32)).astype(dtype)
    dense = mx.array(rng.standard_normal((columns, depth)).astype(np.float32) * 0.3)
    dense = dense.astype(dtype)
    if bits is None:
        return x, dense, None, None, None, None
    weight, scales, biases = mx.quantize(dense, group_size=group, bits=bits)
    return x, weight, scales, biases, bits, group


def _bound(case, swiglu: bool):
    x, weight, scales, biases, bits, group = case
    rows, depth = x.shape
    call = tensor_qmm.bind_tensor_core(
        rows, depth, weight, scales, biases, bits, group, x.dtype, swiglu=swiglu
    )
    out = call(x)
    mx.eval(out)
    return out


@settings(max_examples=20, deadline=None, suppress_health_check=_FIXTURES)
@given(
    case=swiglu_cases(),
    late=st.booleans(),
    groups=st.sampled_from([1, 2]),
    waves=st.booleans(),
)
def test_emulated_swiglu_form_gives_silu_of_its_gate_times_its_up(
    emulated, monkeypatch, case, late, groups, waves
) -> None:
    """The SwiGLU form (the body text, helpers emulated): tile t's gate columns
    [64 t, 64 t + 64) meet the up columns N / 2 + the same, and the result is the
    activation of the plain form's own gate and up bits, split in K or not."""
    monkeypatch.setattr(tensor_qmm, "K_GROUPS", groups)
    monkeypatch.setattr(tensor_qmm, "WAVE_SPLIT", waves)
    monkeypatch.setattr(tensor_qmm, "MERGE_SPLIT_SUM", True)
    emulated.late = late
    x, weight = case[0], case[1]
    columns = weight.shape[0]
    assert tensor_qmm.swiglu_takes(x.dtype, x.shape[0], x.shape[1], columns, case[4])
    plain = _bound(case, swiglu=False)
    half = columns // 2
    want = model.emulated_swiglu(plain[:, :half], plain[:, half:])
    got = _bound(case, swiglu=True)
    assert got.shape == (x.shape[0], half)
    np.testing.assert_array_equal(np.array(got.astype(mx.float32)), want)


def test_emulated_swiglu_form_with_a_tile_of_the_wrong_half_fails(
    emulated, monkeypatch
) -> None:
    """Negative control: up columns read from the gate's half of the stack."""
    monkeypatch.setattr(tensor_qmm, "K_GROUPS", 2)
    monkeypatch.setitem(tensor_qmm.SWIGLU_SPECS, (2, (4, 1)), SWIGLU_WRONG_HALF)
    tensor_qmm.launch_plan.cache_clear()
    try:
        rng = np.random.default_rng(5)
        x = mx.array(rng.standard_normal((3, 256)).astype(np.float32))
        dense = mx.array(rng.standard_normal((256, 256)).astype(np.float32) * 0.3)
        weight, scales, biases = mx.quantize(dense.astype(mx.bfloat16), 64, 4)
        case = (x.astype(mx.bfloat16), weight, scales, biases, 4, 64)
        plain = _bound(case, swiglu=False)
        want = model.emulated_swiglu(plain[:, :128], plain[:, 128:])
        got = np.array(_bound(case, swiglu=True).astype(mx.float32))
        assert not np.array_equal(got, want)
    finally:
        tensor_qmm.launch_plan.cache_clear()


def test_swiglu_form_refuses_what_it_cannot_take() -> None:
    assert tensor_qmm.swiglu_serves(256, 1, False)
    assert tensor_qmm.swiglu_serves(256, 3, True)
    assert not tensor_qmm.swiglu_serves(256, 3, False)  # a second launch sums
    assert not tensor_qmm.swiglu_serves(192, 1, True)  # half a tile
    assert not tensor_qmm.swiglu_serves(256, 1, True, (128,))  # member edges
    with pytest.raises(ValueError, match="SwiGLU"):
        tensor_qmm.launch_plan(4, 256, 192, 4, 64, True, swiglu=True)


# ====================================================== the scaled-weight form


@pytest.fixture
def scaled(emulated, monkeypatch):
    """The emulated matmul with the scaled-weight form picked at bind (the switch)."""
    monkeypatch.setenv(tensor_qmm.SCALED_B_ENV, "1")
    yield emulated


@settings(max_examples=10, deadline=None, suppress_health_check=_FIXTURES)
@given(
    case=served_cases(max_rows=32, max_chunks=3, max_columns=160),
    late=st.booleans(),
    groups=st.sampled_from(["0", "1"]),
)
def test_emulated_scaled_form_matches_the_rounded_weight_oracle(
    scaled, monkeypatch, case, late, groups
) -> None:
    """The scaled-weight form (4- and 8-bit, groups of 32 / 64 / 128, one or two
    m-tiles and K groups, K split or not): within the oracle's tolerance of the
    weights rounded once to x's dtype, and batch-invariant; dense calls keep their
    form."""
    monkeypatch.setenv(tensor_qmm.TWO_K_GROUPS_ENV, groups)
    scaled.late = late
    before = len(scaled.launched)
    out = _kernel(case)
    assert ("_scaled" in scaled.launched[before]) is (case[4] is not None)
    if case[4] is None:
        assert _form_close(case, out)
        return
    assert _scaled_oracle_close(case, out)
    _assert_batch_invariant(case)


def test_emulated_scaled_form_needs_its_bias(tensor_emulator) -> None:
    """Negative control: dropping the group's bias from the weights misses the
    oracle, which the form itself passes (bfloat16 and float16)."""
    rng = np.random.default_rng(11)
    dense = mx.array(rng.standard_normal((300, 1024)).astype(np.float32))
    for dtype in HALF:
        x = mx.array(rng.standard_normal((16, 1024)).astype(np.float32)).astype(dtype)
        case = (x, *mx.quantize(dense.astype(dtype), group_size=64, bits=4), 4, 64)
        good = _run_spec(tensor_emulator, SCALED_G64, case)
        assert _scaled_oracle_close(case, good)
        bad = _run_spec(tensor_emulator, SCALED_NO_BIAS, case)
        assert not _scaled_oracle_close(case, bad)


@settings(max_examples=28, deadline=None, suppress_health_check=_FIXTURES)
@given(
    in_place=st.booleans(),
    rows=st.sampled_from([1, 5, 16, 32]),
    dtype=st.sampled_from(HALF),
    size=st.sampled_from(tensor_qmm.GROUP_SIZES),
    seed=st.integers(0, 2**16),
)
def test_emulated_denormal_decode_gives_the_scaled_form_bits(
    tensor_emulator, in_place, rows, dtype, size, seed
) -> None:
    """The denormal decode (``DENORMAL_SPECS``, as ``matmul_variants``' ``denorm4``
    ran on the H200) and its pairs left where they lie (``IN_PLACE_SPECS``): while
    every scale is a normal number below the form's limit (0.25; 2^-5 for the pairs in
    place in bfloat16, where s 2^133 must fit; float16 keeps the denormal decode's
    place and limit), decoding each nibble as a subnormal with the scale's exponent
    raised gives the shipped scaled form's bits exactly; with scales past it, it does
    not (negative control: the raised exponent no longer fits). Weights of ~0.02,
    ~0.1 (as in models) and ~4 put the scales on both sides of each limit."""
    mtiles = 1 if rows <= 16 else 2
    if in_place and mtiles == 2:
        size = 64  # the pairs in place's two-m-tile form here is built at groups of 64
    table = IN_PLACE_SPECS if in_place else DENORM_SPECS
    spec = table[(2, (4, mtiles), size)]
    shipped = tensor_qmm.SCALED_SPECS[(2, (4, mtiles), size)]
    limit = 2.0**-5 if in_place and dtype == mx.bfloat16 else 0.25
    rng = np.random.default_rng(seed)
    dense = rng.standard_normal((200, 512)).astype(np.float32)
    x = mx.array(rng.standard_normal((rows, 512)).astype(np.float32)).astype(dtype)
    for weight_scale in (0.02, 0.1, 4.0):
        weights = mx.quantize(
            mx.array(dense * weight_scale).astype(dtype), group_size=size, bits=4
        )
        scales = np.abs(np.array(weights[1].astype(mx.float32)))
        exact = bool(scales.max() < limit)
        assert scales.min() > 2**-14 and exact is (weight_scale < limit)
        case = (x, *weights, 4, size)
        same = np.array_equal(
            raw_bits(_run_spec(tensor_emulator, spec, case)),
            raw_bits(_run_spec(tensor_emulator, shipped, case)),
        )
        assert same is exact, (weight_scale, dtype)


@pytest.mark.parametrize("dtype", HALF)
def test_emulated_denormal_pairs_in_place_need_both_scales(
    tensor_emulator, dtype
) -> None:
    """The negative control of the pairs in place: with the high pairs on the low
    pairs' scale, bfloat16 loses the shipped bits (those weights come out 16 times too
    large); float16 raises both alike, so it keeps them."""
    rng = np.random.default_rng(51)
    dense = mx.array(rng.standard_normal((200, 512)).astype(np.float32) * 0.02)
    x = mx.array(rng.standard_normal((16, 512)).astype(np.float32)).astype(dtype)
    case = (x, *mx.quantize(dense.astype(dtype), group_size=64, bits=4), 4, 64)
    expected = raw_bits(
        _run_spec(tensor_emulator, tensor_qmm.SCALED_SPECS[(2, (4, 1), 64)], case)
    )
    in_place = raw_bits(
        _run_spec(tensor_emulator, IN_PLACE_SPECS[(2, (4, 1), 64)], case)
    )
    one_scale = raw_bits(_run_spec(tensor_emulator, IN_PLACE_ONE_SCALE, case))
    assert np.array_equal(in_place, expected)
    assert np.array_equal(one_scale, expected) is (dtype == mx.float16)


def test_denormal_scale_verdict_is_kept_while_the_array_lives(monkeypatch) -> None:
    """A scales array's verdict costs one reduction (a host sync) the first time only;
    the entry goes with the array, so a new array at a reused id is checked afresh."""
    reductions = []
    real_all = mx.all
    monkeypatch.setattr(mx, "all", lambda a: reductions.append(1) or real_all(a))
    good = mx.array([[0.01, -0.2]]).astype(mx.bfloat16)
    assert tensor_qmm.denormal_scales(good) and tensor_qmm.denormal_scales(good)
    assert len(reductions) == 1
    key = id(good)
    assert key in tensor_qmm._SCALE_VERDICTS
    del good
    gc.collect()
    assert key not in tensor_qmm._SCALE_VERDICTS
    for _ in range(20):  # a later array, the same id or not, gets its own verdict
        bad = mx.array([[0.01, 0.3]]).astype(mx.bfloat16)
        assert not tensor_qmm.denormal_scales(bad)
        del bad
    assert len(reductions) == 21


def test_denormal_decode_is_bound_only_where_it_is_exact(monkeypatch) -> None:
    """``DFLASH_QMM_DENORMAL_Q4`` (read at each bind) takes the denormal form for a
    scaled 4-bit call whose scales are all normal numbers below 0.25; scales at or
    above it, a subnormal or zero scale, 8 bits, SwiGLU and the switch off keep the
    scaled form; a bad value names the switch."""
    monkeypatch.delenv(tensor_qmm.DENORMAL_Q4_ENV, raising=False)
    assert tensor_qmm.DENORMAL_Q4 and tensor_qmm.denormal_q4(4)
    monkeypatch.setenv(tensor_qmm.DENORMAL_Q4_ENV, "0")
    assert not tensor_qmm.denormal_q4(4)
    monkeypatch.setenv(tensor_qmm.DENORMAL_Q4_ENV, "1")
    assert tensor_qmm.denormal_q4(4) and not tensor_qmm.denormal_q4(8)
    for dtype in HALF:
        good = mx.array([[0.01, -0.2], [2**-10, 0.249]]).astype(dtype)
        assert tensor_qmm.denormal_scales(good)
        for bad in (0.25, -0.3, 0.0, 2**-130 if dtype == mx.bfloat16 else 2**-20):
            scales = mx.array([[0.01, bad]]).astype(dtype)
            assert not tensor_qmm.denormal_scales(scales), (dtype, bad)
    assert not tensor_qmm.denormal_scales(mx.array([[0.01]], dtype=mx.float32))
    # Scales traced by mx.compile cannot be checked: the scaled form, not an error.
    traced = mx.compile(lambda s: mx.array(tensor_qmm.denormal_scales(s)))
    assert not traced(mx.array([[0.01]]).astype(mx.bfloat16)).item()
    for rows, mtiles in ((16, 1), (32, 2)):
        plan = tensor_qmm.launch_plan(
            rows, 1024, 300, 4, 64, True, False, True, 2, scaled=True, denormal=True
        )
        assert plan.spec is tensor_qmm.DENORMAL_SPECS[(2, (4, mtiles), 64)]
        plan = tensor_qmm.launch_plan(
            rows, 1024, 300, 8, 64, True, False, True, 2, scaled=True, denormal=True
        )
        assert plan.spec is tensor_qmm.SCALED_SPECS[(2, (8, mtiles), 64)]
    monkeypatch.setenv(tensor_qmm.DENORMAL_Q4_ENV, "sometimes")
    with pytest.raises(ValueError, match=tensor_qmm.DENORMAL_Q4_ENV):
        tensor_qmm.denormal_q4(4)
    with pytest.raises(ValueError, match="denormal"):
        tensor_qmm._spec(Layout(8, 1), scaled=True, group_size=64, denormal=True)


@pytest.mark.parametrize("weight_scale, taken", [(0.1, True), (4.0, False)])
def test_emulated_denormal_switch_keeps_the_bits_through_bind(
    scaled, monkeypatch, weight_scale, taken
) -> None:
    """Through ``small_row_matmul`` on the emulator: with the switch on, a 4-bit call
    whose scales allow it launches the denormal form, and one whose scales do not
    keeps the scaled form; either way the output has the switch-off bits."""
    monkeypatch.setenv(tensor_qmm.TWO_K_GROUPS_ENV, "1")
    rng = np.random.default_rng(5)
    dense = mx.array(rng.standard_normal((200, 512)).astype(np.float32) * weight_scale)
    x = mx.array(rng.standard_normal((16, 512)).astype(np.float32)).astype(mx.bfloat16)
    case = (x, *mx.quantize(dense.astype(mx.bfloat16), group_size=64, bits=4), 4, 64)
    monkeypatch.setenv(tensor_qmm.DENORMAL_Q4_ENV, "0")
    off = raw_bits(_kernel(case))
    monkeypatch.setenv(tensor_qmm.DENORMAL_Q4_ENV, "1")
    before = len(scaled.launched)
    on = raw_bits(_kernel(case))
    assert ("_denorm" in scaled.launched[before]) is taken
    assert np.array_equal(on, off)


def test_pairs_in_place_are_bound_only_where_exact(monkeypatch) -> None:
    """``DFLASH_QMM_DENORMAL_IN_PLACE`` (read at each bind; on by default since session
    52, ``0`` turns it off) asks for the pairs-in-place form of a 4-bit denormal call; its scale test is the denormal one
    with the limit 2^-5 (one reduction serves both limits); a bad value names the
    switch; the form is the denormal decode's only."""
    monkeypatch.delenv(tensor_qmm.DENORMAL_IN_PLACE_ENV, raising=False)
    assert tensor_qmm.DENORMAL_IN_PLACE and tensor_qmm.denormal_in_place(4)
    monkeypatch.setenv(tensor_qmm.DENORMAL_IN_PLACE_ENV, "0")
    assert not tensor_qmm.denormal_in_place(4)
    monkeypatch.setenv(tensor_qmm.DENORMAL_IN_PLACE_ENV, "1")
    assert tensor_qmm.denormal_in_place(4) and not tensor_qmm.denormal_in_place(8)
    limit = tensor_qmm.IN_PLACE_SCALE_LIMIT
    below = mx.array([[0.01, -0.031]]).astype(mx.bfloat16)
    between = mx.array([[0.01, 0.04]]).astype(mx.bfloat16)
    assert tensor_qmm.denormal_scales(below, limit)
    assert tensor_qmm.denormal_scales(between) and not tensor_qmm.denormal_scales(
        between, limit
    )
    # The bind's one verdict: both limits, and bfloat16 only for the pairs in place.
    assert tensor_qmm.scale_decode(below) == "in_place"
    assert tensor_qmm.scale_decode(between) == "denormal"
    assert tensor_qmm.scale_decode(below.astype(mx.float16)) == "denormal"
    assert tensor_qmm.scale_decode(mx.array([[0.01, 0.3]], dtype=mx.bfloat16)) == (
        "scaled"
    )
    for rows, mtiles in ((16, 1), (32, 2)):
        plan = tensor_qmm.launch_plan(
            rows, 1024, 300, 4, 64, True, False, True, 2,
            scaled=True, denormal=True, in_place=True,
        )  # fmt: skip
        assert plan.spec is tensor_qmm.IN_PLACE_SPECS[(2, (4, mtiles), 64)]
    monkeypatch.setenv(tensor_qmm.DENORMAL_IN_PLACE_ENV, "sometimes")
    with pytest.raises(ValueError, match=tensor_qmm.DENORMAL_IN_PLACE_ENV):
        tensor_qmm.denormal_in_place(4)
    with pytest.raises(ValueError, match="denormal"):
        tensor_qmm._spec(Layout(4, 1), scaled=True, group_size=64, in_place=True)


@pytest.mark.parametrize(
    "dtype, weight_scale, in_place",
    [(mx.bfloat16, 0.02, True), (mx.bfloat16, 0.1, False), (mx.float16, 0.02, False)],
)
def test_emulated_pairs_in_place_keep_the_bits_through_bind(
    scaled, monkeypatch, dtype, weight_scale, in_place
) -> None:
    """Through ``small_row_matmul`` on the emulator with the switch on: a bfloat16
    4-bit call whose scales are all below 2^-5 launches the pairs in place; scales
    between 2^-5 and 0.25, and float16, keep the denormal decode; either way the
    output has the switch-off bits."""
    monkeypatch.setenv(tensor_qmm.TWO_K_GROUPS_ENV, "1")
    monkeypatch.setenv(tensor_qmm.DENORMAL_Q4_ENV, "1")
    rng = np.random.default_rng(7)
    dense = mx.array(rng.standard_normal((200, 512)).astype(np.float32) * weight_scale)
    x = mx.array(rng.standard_normal((16, 512)).astype(np.float32)).astype(dtype)
    case = (x, *mx.quantize(dense.astype(dtype), group_size=64, bits=4), 4, 64)
    monkeypatch.setenv(tensor_qmm.DENORMAL_IN_PLACE_ENV, "0")
    off = raw_bits(_kernel(case))
    monkeypatch.setenv(tensor_qmm.DENORMAL_IN_PLACE_ENV, "1")
    before = len(scaled.launched)
    on = raw_bits(_kernel(case))
    assert "_denorm" in scaled.launched[before]
    assert ("_inplace" in scaled.launched[before]) is in_place
    assert np.array_equal(on, off)


def _bits_with_specs(emulated, case, tables: dict) -> np.ndarray:
    """``case``'s output bits with the given specs in place of the shipped ones
    (``tables``: table name to {key: spec}); asserts that one of them launched. The
    emulator holds the specs built at import (a spec is known by identity)."""
    shipped = {
        "form": tensor_qmm.FORM_SPECS[(False, 2)],
        "scaled": tensor_qmm.SCALED_SPECS,
        "denormal": tensor_qmm.DENORMAL_SPECS,
        "inplace": tensor_qmm.IN_PLACE_SPECS,
    }
    with pytest.MonkeyPatch.context() as patch:
        for table, specs in tables.items():
            for key, spec in specs.items():
                patch.setitem(shipped[table], key, spec)
        tensor_qmm.launch_plan.cache_clear()
        launched = []

        def launch(spec, *args, **kwargs):
            launched.append(spec)
            return emulated.launch(spec, *args, **kwargs)

        patch.setattr(qmm.groups, "launch_groups", launch)
        bits = raw_bits(_kernel(case))
        mine = [spec for specs in tables.values() for spec in specs.values()]
        assert any(spec in mine for spec in launched)
    tensor_qmm.launch_plan.cache_clear()
    return bits


@pytest.mark.parametrize("rows", [1, 16, 32])
@pytest.mark.parametrize("form", ["scaled", "denormal", "inplace", "unscaled", "dense"])
@pytest.mark.parametrize("variant", ["paired", "lean", "paired-lean"])
def test_emulated_staging_variants_give_the_shipped_bits(
    emulated, monkeypatch, variant, rows, form
) -> None:
    """The paired stage (:data:`tensor_qmm.PAIRED_STAGE`: each thread rewrites the x
    pieces, and scales and biases, that it copied into the lanes' order before the
    chunk's barrier) and the lean issue (:data:`tensor_qmm.LEAN_ISSUE`: the copies'
    sources worked out once, 32-bit shared addresses, the ring's slots as counters),
    alone and together, feed the mma the same operands: every output keeps the shipped
    bits, K split or not, at every group size (scales paired at 64 and 128, x only at
    32), one or two m-tiles, copies landing early or late, and misaligned inputs taking
    the plain copies. Negative controls: x left unpaired, the scale and bias pairs
    crossed, the ring's read slot never advanced: each changes the bits. The denormal
    decode runs with its pairs shifted and in place (weights small enough for it)."""
    monkeypatch.setenv(tensor_qmm.SCALED_B_ENV, "0" if form == "unscaled" else "1")
    denormal = form in ("denormal", "inplace")
    monkeypatch.setenv(tensor_qmm.DENORMAL_Q4_ENV, "1" if denormal else "0")
    in_place = "1" if form == "inplace" else "0"
    monkeypatch.setenv(tensor_qmm.DENORMAL_IN_PLACE_ENV, in_place)
    weight_scale = 0.01 if form == "inplace" else 0.05  # in place: scales below 2^-5
    emulated.late = rows == 16  # copies landing at their wait, or at their issue
    # The plain copies (every input 2 bytes off a 16-byte boundary); restored after.
    monkeypatch.setattr(emulated, "misaligned", rows == 32)
    tables = STAGING[variant]
    rng = np.random.default_rng(rows)
    bits = None if form == "dense" else 4
    for chunks, columns, group in ((3, 200, 64), (2, 130, 128), (1, 100, 32)):
        depth = chunks * (64 if bits is None else 256)
        dense = rng.standard_normal((columns, depth)).astype(np.float32) * weight_scale
        x = rng.standard_normal((rows, depth)).astype(np.float32)
        x, dense = mx.array(x).astype(mx.bfloat16), mx.array(dense).astype(mx.bfloat16)
        if bits is None:
            case = (x, dense, None, None, None, None)
        else:
            case = (x, *mx.quantize(dense, group_size=group, bits=4), 4, group)
        shipped = raw_bits(_kernel(case))
        table = "form" if form in ("unscaled", "dense") else form
        got = _bits_with_specs(emulated, case, {table: tables[table]})
        assert np.array_equal(got, shipped)
    monkeypatch.setattr(emulated, "misaligned", False)
    slips = {"paired": ("unpaired-x", "crossed-scales"), "lean": ("stuck-ring",)}
    if form == "scaled" and variant in slips:
        # One launch, K unsplit: 5 chunks through a ring of fewer stages.
        case = _fixed_case(rows, 1280, 200, 4, 64, mx.bfloat16, rows)
        key = (2, (4, 1 if rows <= 16 else 2), 64)
        shipped = raw_bits(_run_spec(emulated, tables["scaled"][key], case))
        assert np.array_equal(
            shipped, raw_bits(_run_spec(emulated, tensor_qmm.SCALED_SPECS[key], case))
        )
        for slip in slips[variant]:
            if key not in PAIRED_SLIPS[slip]:  # (a form the variant leaves alone)
                continue
            got = raw_bits(_run_spec(emulated, PAIRED_SLIPS[slip][key], case))
            assert not np.array_equal(got, shipped), slip


@needs_nvcc
def test_unit_scale_forms_compile_for_sm90_within_the_bounds(tmp_path: Path) -> None:
    """Every unit-scale form (scaled 4-bit: plain, denormal, in place; one and two
    m-tiles; every group size) compiles for sm_90 (``OPT_IN_COMPILED``) with no
    spills within its launch bounds' 128 registers."""
    specs = [spec for table in UNIT.values() for spec in table.values()]
    assert_within_bounds(specs, tmp_path, NVCC, OPT_IN_COMPILED)


def _chunk_major_case(case: tuple) -> tuple:
    """``case`` with its scales and biases repacked chunk-major."""
    x, weight, scales, biases, bits, group = case
    repacked = (tensor_qmm.chunk_major(a, group) for a in (scales, biases))
    return (x, weight, *repacked, bits, group)


def _run_split(
    emulator, spec, case, splits: int, per_split: int, as_given: bool = False
) -> mx.array:
    """One launch of ``spec`` over ``case`` (4-bit) with K in ``splits`` CTAs of
    ``per_split`` chunks a column tile (the last takes the rest), summed by the last
    CTA's merge: CTA ranges that start and end inside a unit of chunks. A form that
    reads chunk-major or interleaved scales gets them repacked, as the bind does,
    unless ``as_given``."""
    x, weight, scales, biases, _, group = case
    if not as_given:
        scales, biases = tensor_qmm.scale_arrays(spec, scales, biases, group)
    tiles = -(-weight.shape[0] // tensor_qmm.COLUMNS)
    chunks = x.shape[1] // Layout(4, 1).chunk
    shift = group.bit_length() - 1
    rows, columns = x.shape[0], weight.shape[0]
    ints = mx.array(
        [rows, columns, x.shape[1], group, tiles, splits, per_split, shift, 1, 0],
        mx.int32,  # ..., merged, member edges (none)
    )
    assert (splits - 1) * per_split < chunks <= splits * per_split
    y, _ = emulator.launch(
        spec,
        [x, weight, scales, biases, ints, mx.zeros((tiles,), mx.int32)],
        [(rows, columns), (splits * rows * columns,)],
        [x.dtype, mx.float32],
        tiles * splits,
        x.dtype,
    )
    return y


def _small_case(rows: int, chunks: int, group: int) -> tuple:
    """A 4-bit bfloat16 case of ``chunks`` chunks of K and 200 columns whose small
    weights take the denormal decode and its pairs in place."""
    case = _fixed_case(rows, chunks * 256, 200, None, None, mx.bfloat16, rows)
    dense = case[1] * 0.01
    return (case[0], *mx.quantize(dense, group_size=group, bits=4), 4, group)


def _bound_case(monkeypatch, rows: int, form: str) -> tuple:
    """The switches that bind ``form`` (``scaled``, ``denormal`` or ``inplace``) and a
    4-bit case of 3 chunks (groups of 64) whose scales allow it."""
    monkeypatch.setenv(tensor_qmm.SCALED_B_ENV, "1")
    monkeypatch.setenv(tensor_qmm.DENORMAL_Q4_ENV, "0" if form == "scaled" else "1")
    in_place = "1" if form == "inplace" else "0"
    monkeypatch.setenv(tensor_qmm.DENORMAL_IN_PLACE_ENV, in_place)
    rng = np.random.default_rng(rows)
    dense = rng.standard_normal((200, 3 * 256)).astype(np.float32) * 0.01
    x = rng.standard_normal((rows, 3 * 256)).astype(np.float32)
    x, dense = mx.array(x).astype(mx.bfloat16), mx.array(dense).astype(mx.bfloat16)
    return (x, *mx.quantize(dense, group_size=64, bits=4), 4, 64)


@pytest.mark.parametrize("rows", [1, 16, 32])
@pytest.mark.parametrize("form", ["scaled", "denormal", "inplace"])
def test_emulated_unit_scales_give_the_shipped_bits(
    emulated, monkeypatch, rows, form
) -> None:
    """Unit scales (:data:`tensor_qmm.UNIT_SCALES`: a column's scales and biases copied
    16 bytes, a unit of chunks, at a time into a ring of slots of their own) feed the
    same scales to the same arithmetic: the shipped bits at every group size (units of
    1, 2 and 4 chunks, 16- and 8-byte), one and two m-tiles, K unsplit and split into CTA ranges that
    start and end inside a unit (odd starts, a unit cut short), copies landing early or
    late, misaligned inputs taking the plain copies; and through the bind. Negative
    controls (copies landing early): the chunk's offset in its unit dropped, and the
    units sharing one slot."""
    emulated.late = rows == 16
    monkeypatch.setattr(emulated, "misaligned", rows == 32)
    key_tiles = (4, 1 if rows <= 16 else 2)
    # Units of a row's scales: 8 chunks make 16-byte rows at groups of 64 and 32-byte
    # ones at 128 (units of 2 and 4 chunks); 6 chunks make 24-byte rows at 128 (8-byte
    # units of 2 chunks); groups of 32 take a chunk a unit.
    for chunks, group, plans in (
        (8, 64, ((1, 8), (3, 3))),
        (8, 128, ((1, 8), (3, 3), (2, 5))),
        (6, 128, ((2, 3),)),
        (6, 32, ((2, 3),)),
    ):
        case = _small_case(rows, chunks, group)
        key = (2, key_tiles, group)
        shipped_spec = {
            "scaled": tensor_qmm.SCALED_SPECS,
            "denormal": tensor_qmm.DENORMAL_SPECS,
            "inplace": tensor_qmm.IN_PLACE_SPECS,
        }[form][key]
        for splits, per_split in plans:
            shipped = raw_bits(
                _run_split(emulated, shipped_spec, case, splits, per_split)
            )
            got = raw_bits(
                _run_split(emulated, UNIT[form][key], case, splits, per_split)
            )
            assert np.array_equal(got, shipped), (group, splits)
    # Through the bind (the plan's own split, the switch's forms in the tables).
    case = _bound_case(monkeypatch, rows, form)
    shipped = raw_bits(_kernel(case))
    assert np.array_equal(_bits_with_specs(emulated, case, {form: UNIT[form]}), shipped)
    monkeypatch.setattr(emulated, "misaligned", False)
    emulated.late = False
    if form == "scaled":
        case = _fixed_case(rows, 8 * 256, 200, 4, 64, mx.bfloat16, rows)
        spec = tensor_qmm.SCALED_SPECS[(2, key_tiles, 64)]
        if key_tiles == (4, 1):
            shipped = raw_bits(_run_split(emulated, spec, case, 3, 3))
            for slip, wrong in UNIT_SLIPS.items():
                got = raw_bits(_run_split(emulated, wrong, case, 3, 3))
                assert not np.array_equal(got, shipped), slip


@pytest.mark.parametrize("rows", [1, 16, 32])
@pytest.mark.parametrize("form", ["scaled", "denormal", "inplace"])
@pytest.mark.parametrize("layout", ["chunk-major", "interleaved"])
def test_emulated_repacked_scales_give_the_row_major_bits(
    emulated, monkeypatch, rows, form, layout
) -> None:
    """Scales read from a repack give the row-major forms' bits.

    Chunk-major (:data:`tensor_qmm.CHUNK_MAJOR_SCALES`, the default): each chunk's
    scale and bias copies read (K / 256, N, 256 / group). Interleaved
    (:data:`tensor_qmm.INTERLEAVED_SCALES`, groups of 64 and 128): one copy a column
    and chunk of its scales and biases side by side, the biases read from the slot's
    second half. At every group size each takes, one and two m-tiles, K unsplit and
    split into CTA ranges, copies landing early or late, misaligned inputs; and
    through the bind, which repacks. Negative controls: the chunk-major form given the
    arrays as mlx lays them out, the interleaved one given the two chunk-major
    arrays."""
    emulated.late = rows == 16
    monkeypatch.setattr(emulated, "misaligned", rows == 32)
    key_tiles = (4, 1 if rows <= 16 else 2)
    forms = CMAJOR if layout == "chunk-major" else ILEAVE
    cases = [(8, 64, ((1, 8), (3, 3))), (6, 128, ((2, 3),)), (5, 32, ((2, 3),))]
    for chunks, group, plans in cases[: 3 if layout == "chunk-major" else 2]:
        case = _small_case(rows, chunks, group)
        wrong_arrays = case if layout == "chunk-major" else _chunk_major_case(case)
        key = (2, key_tiles, group)
        for splits, per_split in plans:
            row_major = ROW_MAJOR[form][key]
            shipped = raw_bits(_run_split(emulated, row_major, case, splits, per_split))
            spec = forms[form][key]
            got = raw_bits(_run_split(emulated, spec, case, splits, per_split))
            assert np.array_equal(got, shipped), (group, splits)
            wrong = _run_split(
                emulated, spec, wrong_arrays, splits, per_split, as_given=True
            )
            assert not np.array_equal(raw_bits(wrong), shipped), (group, splits)
    # Through the bind (the plan's own split, the switch's forms in the tables).
    case = _bound_case(monkeypatch, rows, form)
    shipped = _bits_with_specs(emulated, case, {form: ROW_MAJOR[form]})
    got = _bits_with_specs(emulated, case, {form: forms[form]})
    assert np.array_equal(got, shipped)


def test_chunk_major_repack_is_each_chunks_groups_column_by_column() -> None:
    """``tensor_qmm.chunk_major``: element ``[c, n, j]`` is group ``c * 256 / g + j``
    of column ``n``; made once while its source lives (the same array again), for
    each group size asked, until ``forget_chunk_major`` drops it; a shape without
    whole chunks is refused by name."""
    scales = mx.array(np.arange(7 * 16, dtype=np.float32).reshape(7, 16))
    for group, per_chunk in ((64, 4), (128, 2), (32, 8)):
        got = tensor_qmm.chunk_major(scales, group)
        assert got.shape == (16 // per_chunk, 7, per_chunk)
        want = (
            np.array(scales).reshape(7, 16 // per_chunk, per_chunk).transpose(1, 0, 2)
        )
        np.testing.assert_array_equal(np.array(got), want)
        assert np.array(got)[1, 3, 0] == 3 * 16 + per_chunk  # column 3, chunk 1
    assert tensor_qmm.chunk_major(scales, 64) is tensor_qmm.chunk_major(scales, 64)
    other = mx.ones((3, 8))
    tensor_qmm.chunk_major(other, 64)
    assert tensor_qmm.forget_chunk_major([other, mx.zeros((3, 8))]) == 1
    assert id(other) not in tensor_qmm._CHUNK_MAJOR
    key = id(scales)
    assert key in tensor_qmm._CHUNK_MAJOR
    del scales
    gc.collect()
    assert key not in tensor_qmm._CHUNK_MAJOR
    with pytest.raises(ValueError, match="whole chunks of 8 groups"):
        tensor_qmm.chunk_major(mx.zeros((3, 12)), 32)
    with pytest.raises(ValueError, match="chunk-major scales take"):
        tensor_qmm.chunk_major(mx.zeros((12,)), 64)


@needs_nvcc
def test_repacked_scale_forms_compile_for_sm90_within_the_bounds(tmp_path: Path):
    """Every chunk-major and interleaved-scale form built for the tests compiles for
    sm_90 with no spills within its launch bounds' 128 registers (the shipped ones
    among them, the same texts, are compiled with the same bounds above)."""
    shipped = {
        spec.name("cuda")
        for table in _scaled_tables().values()
        for spec in table.values()
    }
    tables = [*CMAJOR.values(), *ILEAVE.values()]
    specs = [spec for table in tables for spec in table.values()]
    others = [spec for spec in specs if spec.name("cuda") not in shipped]
    assert 0 < len(others) < len(specs)
    assert_within_bounds(others, tmp_path, NVCC, HALF)


def test_chunk_major_switch_is_on_and_yields_to_unit_scales(monkeypatch) -> None:
    """``DFLASH_QMM_CHUNK_MAJOR_SCALES`` (read at import; on): every shipped scaled
    4-bit form reads chunk-major scales, no other (not 8-bit, not direct); unit
    scales take the scale copy where on, and both set on is refused by name, as is a
    bad word; off builds the row-major forms."""
    assert tensor_qmm.CHUNK_MAJOR_SCALES is tensor_qmm.CHUNK_MAJOR_SCALES_DEFAULT
    assert tensor_qmm.CHUNK_MAJOR_SCALES is True
    tables = (
        tensor_qmm.SCALED_SPECS,
        tensor_qmm.SWIGLU_SCALED_SPECS,
        tensor_qmm.DENORMAL_SPECS,
        tensor_qmm.IN_PLACE_SPECS,
        tensor_qmm.SWIGLU_DENORMAL_SPECS,
        tensor_qmm.SWIGLU_IN_PLACE_SPECS,
    )
    scaled = [s for t in tables for key, s in t.items() if key[1][0] == 4]
    assert len(scaled) == 6 * 2 * 2 * len(tensor_qmm.GROUP_SIZES)
    # (Groups of 64 and 128 read the interleaved repack, the default since session 56.)
    assert all(
        tensor_qmm.reads_chunk_major(spec) or tensor_qmm.reads_interleaved(spec)
        for spec in scaled
    )
    assert any(tensor_qmm.reads_chunk_major(spec) for spec in scaled)
    others = [spec for spec in tensor_qmm.SPECS if spec not in scaled]
    assert others and not any(
        tensor_qmm.reads_chunk_major(s) or tensor_qmm.reads_interleaved(s)
        for s in others
    )
    assert not any(
        tensor_qmm.reads_chunk_major(s) for s in tensor_qmm.DIRECT_SPECS.values()
    )
    assert tensor_qmm.chunk_major_scales() is True
    monkeypatch.setattr(tensor_qmm, "UNIT_SCALES", True)
    assert tensor_qmm.chunk_major_scales() is True  # (the unit forms take the copy)
    monkeypatch.setenv(tensor_qmm.CHUNK_MAJOR_SCALES_ENV, "1")
    with pytest.raises(ValueError, match="DFLASH_QMM_UNIT_SCALES"):
        tensor_qmm.chunk_major_scales()
    monkeypatch.setattr(tensor_qmm, "UNIT_SCALES", False)
    monkeypatch.setenv(tensor_qmm.CHUNK_MAJOR_SCALES_ENV, "perhaps")
    with pytest.raises(ValueError, match="DFLASH_QMM_CHUNK_MAJOR_SCALES"):
        tensor_qmm.chunk_major_scales()
    monkeypatch.delenv(tensor_qmm.CHUNK_MAJOR_SCALES_ENV)
    with matmul_variants.variant(**matmul_variants.VARIANTS["unit"]):
        assert not any(
            tensor_qmm.reads_chunk_major(s)
            for key, s in tensor_qmm.SCALED_SPECS.items()
            if key[1][0] == 4
        )
    with matmul_variants.variant(**matmul_variants.VARIANTS["rowmajor"]):
        rebuilt = [
            *tensor_qmm.SCALED_SPECS.values(),
            *tensor_qmm.IN_PLACE_SPECS.values(),
        ]
        assert not any(tensor_qmm.reads_chunk_major(s) for s in rebuilt)
        assert not any(tensor_qmm.reads_interleaved(s) for s in rebuilt)
    assert all(
        tensor_qmm.reads_chunk_major(spec) or tensor_qmm.reads_interleaved(spec)
        for spec in scaled
    )


def test_interleaved_copy_is_a_chunks_scales_then_its_biases() -> None:
    """``tensor_qmm.interleaved``: ``[c, n, :g']`` are column ``n``'s scales of chunk
    ``c`` and ``[c, n, g':]`` its biases (``g' = 256 / group``); made once while the
    scales and the biases live (no chunk-major copies kept on the way), until
    ``forget_chunk_major`` drops it; scales and biases of other shapes are refused by
    name."""
    scales = mx.array(np.arange(5 * 8, dtype=np.float32).reshape(5, 8))
    biases = -scales
    both = tensor_qmm.interleaved(scales, biases, 64)
    assert both.shape == (2, 5, 8)
    want = np.array(scales).reshape(5, 2, 4).transpose(1, 0, 2)
    np.testing.assert_array_equal(np.array(both[:, :, :4]), want)
    np.testing.assert_array_equal(np.array(both[1, 2, 4:]), -np.arange(20, 24))
    assert tensor_qmm.interleaved(scales, biases, 64) is both
    assert id(biases) not in tensor_qmm._CHUNK_MAJOR
    assert tensor_qmm.forget_chunk_major([scales]) == 1
    assert id(scales) not in tensor_qmm._INTERLEAVED
    tensor_qmm.interleaved(scales, biases, 64)
    assert id(scales) in tensor_qmm._INTERLEAVED
    del biases  # either source gone: the copy goes
    gc.collect()
    assert id(scales) not in tensor_qmm._INTERLEAVED
    with pytest.raises(ValueError, match="scales and biases of one shape"):
        tensor_qmm.interleaved(scales, mx.zeros((5, 4)), 64)


def test_interleaved_switch_is_on_and_refuses_what_it_cannot_join(monkeypatch):
    """``DFLASH_QMM_INTERLEAVED_SCALES`` (read at import; on since session 56): the
    shipped scaled 4-bit forms of groups of 64 and 128 read interleaved scales, no
    other; the default yields to the paired stage, unit scales and chunk-major scales
    off, and set on explicitly with any of them the bind's check refuses it, as it
    refuses a bad word, naming the switches; off, no form reads them."""
    assert tensor_qmm.INTERLEAVED_SCALES is tensor_qmm.INTERLEAVED_SCALES_DEFAULT
    assert tensor_qmm.INTERLEAVED_SCALES is True
    reading = {
        key
        for key, spec in tensor_qmm.SCALED_SPECS.items()
        if tensor_qmm.reads_interleaved(spec)
    }
    assert reading == {
        key
        for key in tensor_qmm.SCALED_SPECS
        if key[1][0] == 4 and key[2] in tensor_qmm.INTERLEAVED_GROUP_SIZES
    }
    assert tensor_qmm.interleaved_scales() is True
    # The default yields to the forms that replace its copy; set on, it is refused.
    for explicit in (False, True):
        if explicit:
            monkeypatch.setenv(tensor_qmm.INTERLEAVED_SCALES_ENV, "1")
        for name in ("PAIRED_STAGE", "UNIT_SCALES"):
            monkeypatch.setattr(tensor_qmm, name, True)
            if explicit:
                with pytest.raises(ValueError, match="INTERLEAVED_SCALES needs"):
                    tensor_qmm.interleaved_scales()
            else:
                assert tensor_qmm.interleaved_scales() is False
            monkeypatch.setattr(tensor_qmm, name, False)
        monkeypatch.setattr(tensor_qmm, "CHUNK_MAJOR_SCALES", False)
        if explicit:
            with pytest.raises(ValueError, match="DFLASH_QMM_CHUNK_MAJOR_SCALES on"):
                tensor_qmm.interleaved_scales()
        else:
            assert tensor_qmm.interleaved_scales() is False
        monkeypatch.setattr(tensor_qmm, "CHUNK_MAJOR_SCALES", True)
        assert tensor_qmm.interleaved_scales() is True
    monkeypatch.setenv(tensor_qmm.INTERLEAVED_SCALES_ENV, "often")
    with pytest.raises(ValueError, match="DFLASH_QMM_INTERLEAVED_SCALES"):
        tensor_qmm.interleaved_scales()
    monkeypatch.delenv(tensor_qmm.INTERLEAVED_SCALES_ENV)
    tables = (
        tensor_qmm.SCALED_SPECS,
        tensor_qmm.SWIGLU_SCALED_SPECS,
        tensor_qmm.DENORMAL_SPECS,
        tensor_qmm.IN_PLACE_SPECS,
    )
    with matmul_variants.variant(**matmul_variants.VARIANTS["cmajor"]):
        assert not any(
            tensor_qmm.reads_interleaved(spec) for t in tables for spec in t.values()
        )
    built = {
        key: tensor_qmm.reads_interleaved(spec)
        for key, spec in tensor_qmm.SCALED_SPECS.items()
    }
    assert tensor_qmm.reads_interleaved(
        tensor_qmm.SWIGLU_SCALED_SPECS[(2, (4, 1), 128)]
    )
    assert all(took is (k[1][0] == 4 and k[2] != 32) for k, took in built.items())


def test_unit_scales_switch_refuses_the_staging_variants(monkeypatch) -> None:
    """``DFLASH_QMM_UNIT_SCALES`` (read at import; off) does not combine with the
    paired stage or the lean issue: the bind's check names the switches; a bad word
    names its switch; the forms it builds are the scaled 4-bit ones only."""
    assert tensor_qmm.UNIT_SCALES is tensor_qmm.UNIT_SCALES_DEFAULT is False
    assert not any("_unit" in spec.base for spec in tensor_qmm.SPECS)
    assert tensor_qmm.unit_scales() is False
    monkeypatch.setattr(tensor_qmm, "UNIT_SCALES", True)
    assert tensor_qmm.unit_scales() is True
    monkeypatch.setattr(tensor_qmm, "PAIRED_STAGE", True)
    with pytest.raises(ValueError, match="DFLASH_QMM_UNIT_SCALES does not combine"):
        tensor_qmm.unit_scales()
    monkeypatch.setattr(tensor_qmm, "PAIRED_STAGE", False)
    monkeypatch.setattr(tensor_qmm, "LEAN_ISSUE", True)
    with pytest.raises(ValueError, match="DFLASH_QMM_LEAN_ISSUE"):
        tensor_qmm.unit_scales()
    monkeypatch.setattr(tensor_qmm, "LEAN_ISSUE", False)
    monkeypatch.setenv(tensor_qmm.UNIT_SCALES_ENV, "sometimes")
    with pytest.raises(ValueError, match="DFLASH_QMM_UNIT_SCALES"):
        tensor_qmm.unit_scales()
    monkeypatch.delenv(tensor_qmm.UNIT_SCALES_ENV)
    with matmul_variants.variant(**matmul_variants.VARIANTS["unit"]):
        built = [
            spec.base
            for table in (tensor_qmm.SCALED_SPECS, tensor_qmm.FORM_SPECS[(False, 2)])
            for spec in table.values()
        ]
    assert {"_unit" in b for b in built} == {True, False}
    assert all(("_unit" in b) == ("scaled" in b and "q4" in b) for b in built)


@pytest.mark.parametrize("rows", [1, 16, 32])
@pytest.mark.parametrize("variant", ["paired", "lean", "paired-lean"])
def test_emulated_staging_variants_give_the_shipped_swiglu_bits(
    scaled, variant, rows
) -> None:
    """The scaled SwiGLU forms (``DFLASH_SWIGLU``, opt-in) take the staging variants
    too (the switches are read when the forms are built): with them, the activation
    keeps the shipped bits at one and two m-tiles, with a merged K split or none, at
    every group size; copies landing late at 16 rows. Negative control (paired): x's
    pieces left as copied change the bits."""
    scaled.late = rows == 16
    rng = np.random.default_rng(100 + rows)
    slips = {"paired": SWIGLU_UNPAIRED}.get(variant)
    for staged in (STAGING[variant]["swiglu"], slips):
        if staged is not None:
            _check_staged_swiglu(scaled, rng, rows, staged, same=staged is not slips)


def _check_staged_swiglu(scaled, rng, rows: int, staged: dict, same: bool) -> None:
    """Three SwiGLU calls with ``staged`` in place of the scaled forms (the denormal
    decode off, so the bind takes that table): their bits equal the scaled forms'
    (``same``) or differ from them."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(tensor_qmm.DENORMAL_Q4_ENV, "0")
        _check_staged_swiglu_calls(scaled, rng, rows, staged, same)


def _check_staged_swiglu_calls(scaled, rng, rows, staged, same) -> None:
    for chunks, group in ((3, 64), (1, 128), (2, 32)):
        depth = chunks * 256
        x = rng.standard_normal((rows, depth)).astype(np.float32)
        dense = rng.standard_normal((2 * tensor_qmm.COLUMNS, depth)) * 0.05
        x = mx.array(x).astype(mx.bfloat16)
        dense = mx.array(dense.astype(np.float32)).astype(mx.bfloat16)
        case = (x, *mx.quantize(dense, group_size=group, bits=4), 4, group)
        shipped = raw_bits(_bound(case, swiglu=True))
        launched = []

        def launch(spec, *args, **kwargs):
            launched.append(spec)
            return scaled.launch(spec, *args, **kwargs)

        with pytest.MonkeyPatch.context() as patch:
            for key, spec in staged.items():
                patch.setitem(tensor_qmm.SWIGLU_SCALED_SPECS, key, spec)
            patch.setattr(qmm.groups, "launch_groups", launch)
            tensor_qmm.launch_plan.cache_clear()
            got = raw_bits(_bound(case, swiglu=True))
        tensor_qmm.launch_plan.cache_clear()
        assert any(spec in staged.values() for spec in launched)
        assert all(
            spec not in tensor_qmm.SWIGLU_SCALED_SPECS.values() for spec in launched
        )
        assert np.array_equal(got, shipped) == same, (chunks, group)


def test_staging_switches_build_the_texts_at_import() -> None:
    """``DFLASH_QMM_PAIRED_STAGE`` and ``DFLASH_QMM_LEAN_ISSUE`` (read at import; off
    by default) build the forms they serve with their edits, and only those (the
    paired stage 4-bit only, the lean issue not 8-bit, neither direct); a
    bad value keeps the import working and fails the switch's check with its name."""
    assert tensor_qmm.PAIRED_STAGE is tensor_qmm.PAIRED_STAGE_DEFAULT is False
    assert tensor_qmm.LEAN_ISSUE is tensor_qmm.LEAN_ISSUE_DEFAULT is False
    assert not any(
        "dfl_interleave" in spec.body or "dfl_cp16" in spec.body
        for spec in tensor_qmm.SPECS
    )
    probes = (
        "'dfl_interleaved_load' in t.SCALED_SPECS[(2, (4, 1), 64)].body",
        "'pair.y' in t.DENORMAL_SPECS[(2, (4, 1), 64)].body",
        "'pair.y' in t.SCALED_SPECS[(2, (4, 1), 32)].body",
        "'dfl_interleave' in t.SCALED_SPECS[(2, (8, 1), 64)].body",
        "'dfl_interleave' in t.DIRECT_SPECS[(2, 64)].body",
        "'dfl_interleave' in t.K2_SPECS[(0, 1)].body",
        "'dfl_cp16' in t.SCALED_SPECS[(2, (4, 1), 64)].body",
        "'dfl_cp16' in t.SCALED_SPECS[(2, (4, 2), 64)].body",
        "'dfl_cp16' in t.SCALED_SPECS[(2, (8, 1), 64)].body",
        "'dfl_cp16' in t.DIRECT_SPECS[(2, 64)].body",
        "'dfl_cp16' in t.K2_SPECS[(0, 2)].body",
    )
    code = (
        "import dflash.metal.tensor_qmm as t; "
        f"print(t.PAIRED_STAGE, t.LEAN_ISSUE, {', '.join(probes)})"
    )
    cases = {
        ("1", "0"): "True False True True False False False False" + " False" * 5,
        ("0", "1"): "False True" + " False" * 6 + " True True False False True",
        ("1", "1"): "True True True True False False False False"
        + " True True False False True",
        ("0", "0"): "False False" + " False" * 11,
    }
    for (paired, lean), expected in cases.items():
        env = dict(
            os.environ, DFLASH_QMM_PAIRED_STAGE=paired, DFLASH_QMM_LEAN_ISSUE=lean
        )
        done = subprocess.run(
            [sys.executable, "-c", code], env=env, capture_output=True, text=True
        )
        assert done.returncode == 0, done.stderr
        assert done.stdout.split() == expected.split(), (paired, lean)
    for switch, check in (
        ("DFLASH_QMM_PAIRED_STAGE", "t.paired_stage()"),
        ("DFLASH_QMM_LEAN_ISSUE", "t.lean_issue()"),
    ):
        env = dict(os.environ, **{switch: "maybe"})
        done = subprocess.run(
            [sys.executable, "-c", code + "; " + check],
            env=env,
            capture_output=True,
            text=True,
        )
        assert done.stdout.split()[:2] == ["False", "False"] and done.returncode != 0
        assert f"{switch} must be 0 or 1" in done.stderr


def test_emulated_scaled_form_is_built_for_its_group_size(tensor_emulator) -> None:
    """Each scaled kernel has its group size as a constant: a plan takes the kernel of
    its call's size, and the 64-element kernel given groups of 128 (negative control)
    misses the oracle that its own size's kernel meets."""
    for size in tensor_qmm.GROUP_SIZES:
        for bits in (4, 8):
            plan = tensor_qmm.launch_plan(
                16, 1024, 300, bits, size, True, False, True, 2, scaled=True
            )
            assert plan.spec is tensor_qmm.SCALED_SPECS[(2, (bits, 1), size)]
            assert f"_scaled_g{size}" in plan.spec.base
    rng = np.random.default_rng(12)
    dense = mx.array(rng.standard_normal((300, 1024)).astype(np.float32))
    x = mx.array(rng.standard_normal((16, 1024)).astype(np.float32)).astype(mx.bfloat16)
    weights = mx.quantize(dense.astype(mx.bfloat16), group_size=128, bits=4)
    case = (x, *weights, 4, 128)
    own = _run_spec(tensor_emulator, tensor_qmm.SCALED_SPECS[(2, (4, 1), 128)], case)
    assert _scaled_oracle_close(case, own)
    assert not _scaled_oracle_close(case, _run_spec(tensor_emulator, SCALED_G64, case))


def test_the_scaled_weight_switch_is_read_at_each_bind(monkeypatch) -> None:
    """``DFLASH_QMM_SCALED_B`` decides when set, else the module default; an affine
    plan then takes the scaled spec (over the folded one), a dense plan never; the
    form refuses dense and folded layouts."""
    monkeypatch.delenv(tensor_qmm.SCALED_B_ENV, raising=False)
    for default in (False, True):
        monkeypatch.setattr(tensor_qmm, "SCALED_B", default)
        assert tensor_qmm.scaled_b(4) is default
        for value, expected in (("1", True), ("0", False), ("", default)):
            monkeypatch.setenv(tensor_qmm.SCALED_B_ENV, value)
            assert tensor_qmm.scaled_b(4) is expected
            assert tensor_qmm.scaled_b(8) is expected
            assert not tensor_qmm.scaled_b(None)  # dense: never
        monkeypatch.delenv(tensor_qmm.SCALED_B_ENV)
    for rows, mtiles in ((16, 1), (32, 2)):
        for bits in (4, 8):
            plan = tensor_qmm.launch_plan(
                rows, 6656, 19968, bits, 64, True, False, True, 2, scaled=True
            )
            assert plan.spec is tensor_qmm.SCALED_SPECS[(2, (bits, mtiles), 64)]
        plan = tensor_qmm.launch_plan(
            rows, 6656, 19968, None, None, True, False, True, 2, scaled=True
        )
        assert plan.spec is K2_SPECS[(0, mtiles)]
    with pytest.raises(ValueError, match="affine and not folded"):
        tensor_qmm._spec(Layout(0, 1), scaled=True)
    with pytest.raises(ValueError, match="affine and not folded"):
        tensor_qmm._spec(Layout(4, 1), folded=True, scaled=True)
    with pytest.raises(ValueError, match="constant group size"):
        tensor_qmm._spec(Layout(4, 1), scaled=True, group_size=48)
    with pytest.raises(ValueError, match="constant group size"):
        tensor_qmm._spec(Layout(0, 1), group_size=64)


@pytest.mark.cuda
@cuda
@settings(max_examples=60, deadline=None, suppress_health_check=_FIXTURES)
@given(case=served_cases(), groups=st.sampled_from(["0", "1"]))
def test_cuda_scaled_form_matches_the_rounded_weight_oracle(
    monkeypatch, case, groups
) -> None:
    """On the GPU: the scaled-weight form within the rounded-weight oracle's
    tolerance and batch-invariant (dense calls: the plain oracle)."""
    monkeypatch.setenv(tensor_qmm.SCALED_B_ENV, "1")
    monkeypatch.setenv(tensor_qmm.TWO_K_GROUPS_ENV, groups)
    out = _kernel(case)
    if case[4] is None:
        assert _close_to_matmul_oracle(case, out)
        return
    assert _scaled_oracle_close(case, out)
    _assert_batch_invariant(case)


@pytest.mark.cuda
@cuda
@pytest.mark.parametrize("groups", ["0", "1"])
@pytest.mark.parametrize("rows", [5, 23])
@pytest.mark.parametrize("group", tensor_qmm.GROUP_SIZES)
@pytest.mark.parametrize("bits", [4, 8])
def test_cuda_every_scaled_kernel_meets_the_oracle(
    monkeypatch, bits, group, rows, groups
) -> None:
    """Each of the 24 scaled kernels (bits x group size x one or two m-tiles x one or
    two K groups) once on the GPU: within the rounded-weight oracle's tolerance and
    batch-invariant (the hypothesis test above draws them, not each surely)."""
    monkeypatch.setenv(tensor_qmm.SCALED_B_ENV, "1")
    monkeypatch.setenv(tensor_qmm.TWO_K_GROUPS_ENV, groups)
    dtype = HALF[rows % 2]
    case = _fixed_case(rows, 512, 200, bits, group, dtype, seed=rows + group + bits)
    plan = tensor_qmm.launch_plan(
        rows, 512, 200, bits, group, True, False, True, int(groups) + 1, scaled=True
    )
    assert f"_g{group}" in plan.spec.base
    assert _scaled_oracle_close(case, _kernel(case))
    _assert_batch_invariant(case)


@pytest.mark.cuda
@cuda
@pytest.mark.parametrize("shape", GLIMMER)
@pytest.mark.parametrize("rows, bits", [(1, 4), (16, 4), (32, 4), (16, 8)])
def test_cuda_scaled_form_glimmer_shapes(monkeypatch, shape, rows, bits) -> None:
    """Every Glimmer projection in the scaled-weight form: close to the rounded-weight
    oracle, row 0 alone has its batch bits."""
    monkeypatch.setenv(tensor_qmm.SCALED_B_ENV, "1")
    case = _glimmer_case(*shape, rows, bits)
    out = _kernel(case)
    assert _scaled_oracle_close(case, out, slack=4.0)
    assert np.array_equal(raw_bits(_kernel(case, slice(0, 1))), raw_bits(out[0:1]))


def _unclustered(base: str) -> str:
    """A form's name less the cluster sum's ``_c{size}`` (session 68: with mlx's graphs
    off the cluster sum is the default, and a name check that ignored it failed)."""
    return re.sub(r"_c\d+$", "", base)


def _scale_layout(group_size: int) -> str:
    """The name suffix of the scale layout a scaled 4-bit form of ``group_size`` reads
    under the switches as they are: unit scales, interleaved (groups of 64 and 128),
    chunk-major, or none (as mlx lays them out). Session 56: this test asked for
    ``_cmajor`` whatever the switches, so under ``DFLASH_QMM_INTERLEAVED_SCALES=1`` it
    failed before comparing any bits."""
    if tensor_qmm.unit_scales():
        return "_unit"
    if tensor_qmm.interleaved_scales() and group_size in (
        tensor_qmm.INTERLEAVED_GROUP_SIZES
    ):
        return "_ileave"
    return "_cmajor" if tensor_qmm.chunk_major_scales() else ""


@pytest.mark.cuda
@cuda
@pytest.mark.parametrize("shape", GLIMMER)
@pytest.mark.parametrize("rows", [1, 16, 32])
@pytest.mark.parametrize("in_place", [False, True], ids=["denorm", "inplace"])
@pytest.mark.parametrize("group", tensor_qmm.GROUP_SIZES)
def test_cuda_denormal_form_gives_the_scaled_bits(
    monkeypatch, shape, rows, in_place, group
) -> None:
    """Every 4-bit Glimmer projection with ``DFLASH_QMM_DENORMAL_Q4=1`` (and, for
    ``inplace``, ``DFLASH_QMM_DENORMAL_IN_PLACE=1``), in each group size: the denormal
    form, its pairs in place or not, is bound (the weights' scales allow it) and gives
    the scaled form's bits, so the device keeps subnormal fma operands; row 0 alone has
    its batch bits. The weights are spread as a trained model's (unit-normal ones give
    scales of ~0.4, past the decode's limit: session 49's first run on the device failed
    there; at sigma 0.02 they lie below the pairs in place's 2^-5 too, in groups of 32
    to 128). Groups of 32 / 128 take these forms by default since session 74 (a trained
    model's scales); this test ran at those groups in session 76 (an H100, 90 passed;
    recorded in ``tests/test_tensor_attention.py``)."""
    monkeypatch.setenv(tensor_qmm.SCALED_B_ENV, "1")
    monkeypatch.setenv(tensor_qmm.DENORMAL_IN_PLACE_ENV, "1" if in_place else "0")
    case = _glimmer_case(*shape, rows, 4, spread=0.02, group=group)
    limit = tensor_qmm.IN_PLACE_SCALE_LIMIT if in_place else 0.25
    assert tensor_qmm.denormal_scales(case[2], limit)
    monkeypatch.setenv(tensor_qmm.DENORMAL_Q4_ENV, "0")
    scaled_bits = raw_bits(_kernel(case))
    monkeypatch.setenv(tensor_qmm.DENORMAL_Q4_ENV, "1")
    planned, plan = [], tensor_qmm.launch_plan

    def recorded(*args, **kwargs):
        planned.append(plan(*args, **kwargs).spec.base)
        return plan(*args, **kwargs)

    monkeypatch.setattr(tensor_qmm, "launch_plan", recorded)
    out = _kernel(case)
    suffix = ("_denorm_inplace" if in_place else "_denorm") + _scale_layout(case[5])
    assert planned and all(_unclustered(base).endswith(suffix) for base in planned)
    assert np.array_equal(raw_bits(out), scaled_bits)
    assert np.array_equal(raw_bits(_kernel(case, slice(0, 1))), raw_bits(out[0:1]))


def test_emulated_scaled_form_fused_members_and_merged_split(scaled) -> None:
    """The scaled-weight form through the launch geometry it shares with the unscaled
    one: a K split summed in the launch (unmerged: the same bits) and member-major
    fused siblings, each member's slice within its own rounded-weight oracle."""
    rng = np.random.default_rng(12)
    depth, columns = 1024, 300
    dense = mx.array(rng.standard_normal((columns, depth)).astype(np.float32))
    x = mx.array(rng.standard_normal((7, depth)).astype(np.float32)).astype(mx.bfloat16)
    case = (x, *mx.quantize(dense.astype(mx.bfloat16), group_size=64, bits=4), 4, 64)
    assert split_plan(depth, columns, 4)[1] > 1
    merged = _kernel(case)
    assert "_scaled" in scaled.launched[-1]
    assert _scaled_oracle_close(case, merged)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(tensor_qmm, "MERGE_SPLIT_SUM", False)
        assert np.array_equal(raw_bits(merged), raw_bits(_kernel(case)))
    _assert_members_meet_their_oracles(x, scaled.launched, "_scaled")


def _assert_members_meet_their_oracles(x, launched: list, marker: str) -> None:
    """Two fused 4-bit siblings (128 and 256 columns, group 64) over ``x``: each
    member's result, from a launch whose name holds ``marker``, within its own
    rounded-weight oracle."""
    layers = []
    for width in (128, 256):
        linear = nn.Linear(x.shape[-1], width, bias=False)
        linear.set_dtype(mx.bfloat16)
        layers.append(nn.QuantizedLinear.from_linear(linear, group_size=64, bits=4))
    mx.eval([layer.parameters() for layer in layers])
    group = FusedProjections(layers)
    for index, layer in enumerate(layers):
        out = group.output(index, x, use_kernel=True)
        mx.eval(out)
        assert marker in launched[-1]
        member = (x, layer["weight"], layer["scales"], layer["biases"], 4, 64)
        assert _scaled_oracle_close(member, out), index


def test_emulated_scaled_swiglu_form_matches_its_gate_and_up(scaled) -> None:
    """The SwiGLU form under the scaled switch runs its scaled kernel and gives the
    emulated SwiGLU of the scaled form's own gate and up results."""
    rng = np.random.default_rng(13)
    x = mx.array(rng.standard_normal((3, 256)).astype(np.float32)).astype(mx.bfloat16)
    dense = mx.array(rng.standard_normal((256, 256)).astype(np.float32) * 0.3)
    weight, scales, biases = mx.quantize(dense.astype(mx.bfloat16), 64, 4)
    case = (x, weight, scales, biases, 4, 64)
    plain = _bound(case, swiglu=False)
    got = np.array(_bound(case, swiglu=True).astype(mx.float32))
    assert "_scaled" in scaled.launched[-1] and "swiglu" in scaled.launched[-1]
    assert np.array_equal(got, model.emulated_swiglu(plain[:, :128], plain[:, 128:]))


# ====================================================== the cluster sum (session 42)

# The forms a cluster sum serves: the two-K-group scaled forms (as shipped) and the
# unscaled ones (dense included), one- and two-row-tile layouts.
CLUSTER_BASES = [
    tensor_qmm.SCALED_SPECS[(2, (4, 1), 64)],
    tensor_qmm.SCALED_SPECS[(2, (8, 2), 32)],
    K2_SPECS[(4, 2)],
    K2_SPECS[(0, 1)],
]


@needs_nvcc
def test_cluster_forms_compile_for_sm90_without_spills(tmp_path: Path) -> None:
    """Every cluster size of the served forms compiles (the cluster barrier and
    ``mapa`` PTX checked by ptxas) without spills, the scaled forms within their
    launch bounds (128 registers)."""
    specs = [
        tensor_qmm.cluster_spec(base, size)
        for base in CLUSTER_BASES
        for size in range(2, tensor_qmm.MAX_CLUSTER + 1)
    ]
    result = check_cuda(
        specs, tmp_path / "clusters", NVCC, dtypes=HALF, flags=("-Xptxas", "-v")
    )
    assert result.ok, f"{result.command}\n{result.log}"
    spills = re.findall(
        r"(\d+) bytes spill stores, (\d+) bytes spill loads", result.log
    )
    assert spills and all(a == "0" and b == "0" for a, b in spills), result.log
    registers = re.findall(
        r"custom_kernel_(\w+?)_[0-9a-f]{10}_\w+'[^\n]*\n(?:.*\n){2}.*Used (\d+) registers",
        result.log,
    )
    bounded = [int(r) for name, r in registers if "_scaled" in name]
    assert len(bounded) == 2 * 2 * (tensor_qmm.MAX_CLUSTER - 1), result.log
    assert max(bounded) <= 128, result.log


@pytest.mark.parametrize("base", CLUSTER_BASES, ids=lambda spec: spec.base)
@pytest.mark.parametrize("size", range(2, tensor_qmm.MAX_CLUSTER + 1))
def test_cluster_form_is_the_merge_with_its_partials_in_shared_memory(base, size):
    """The cluster form: its own name and cluster size, the attribute in its header
    (after the launch bounds where the form has them), its column tile's splits as
    consecutive CTAs, and no global partials, fence or counter left."""
    spec = tensor_qmm.cluster_spec(base, size)
    assert spec.cluster == size and spec.base == f"{base.base}_c{size}"
    assert spec.name("cuda") != base.name("cuda")
    assert spec.helpers.count("__cluster_dims__") == 1
    assert f"__cluster_dims__({size}, 1, 1)" in spec.helpers
    bounded = base.helpers.startswith(tensor_qmm.launch_bounds(base.threads))
    assert ("__launch_bounds__" in spec.helpers) == bounded
    assert spec.helpers.endswith(tensor_qmm.CLUSTER_HELPERS)
    assert f"constexpr int CLUSTER = {size};" in spec.body
    assert "const int split = int(group) % splits;" in spec.body
    for gone in ("atomicAdd", "__threadfence", "partial[", "__ldcg"):
        assert gone in base.body and gone not in spec.body, gone
    assert spec.body.count("dfl_cluster_sync();") == 2
    assert tensor_qmm.cluster_spec(base, size) is spec
    # The name checks of the device tests see through the cluster's suffix.
    assert _unclustered(spec.base) == base.base


def test_cluster_spec_refuses_what_it_cannot_build() -> None:
    base = CLUSTER_BASES[0]
    for size in (0, 1, tensor_qmm.MAX_CLUSTER + 1):
        with pytest.raises(ValueError, match="cluster holds"):
            tensor_qmm.cluster_spec(base, size)
    swiglu = tensor_qmm.SWIGLU_SCALED_SPECS[(2, (4, 1), 64)]
    with pytest.raises(RuntimeError, match="body has changed"):
        tensor_qmm.cluster_spec(swiglu, 2)
    small = dataclasses.replace(base, shared_memory=4096)
    with pytest.raises(ValueError, match="shared memory"):
        tensor_qmm.cluster_spec(small, 2)


@settings(max_examples=60, deadline=None)
@given(
    chunks=st.integers(1, 80),
    columns=st.integers(1, 40000),
    rows=st.sampled_from([1, 7, 16, 17, 32]),
    bits=st.sampled_from([4, 8, None]),
)
def test_cluster_plan_takes_splits_of_two_to_four(chunks, columns, rows, bits) -> None:
    """With the cluster sum a split of 2 to MAX_CLUSTER ways launches its cluster form
    (same scalars and CTAs, no partials, no counters, no second launch); any other
    split plans exactly as without it."""
    depth = chunks * Layout(bits or 0, 1).chunk
    group = 64 if bits else None
    scaled = bits is not None
    args = (rows, depth, columns, bits, group, True, False, True, 2, (), False, scaled)
    plain = tensor_qmm.launch_plan(*args)
    clustered = tensor_qmm.launch_plan(*args, cluster=True)
    tiles, splits, _ = split_plan(depth, columns, bits, True)
    if 2 <= splits <= tensor_qmm.MAX_CLUSTER:
        assert clustered.spec is tensor_qmm.cluster_spec(plain.spec, splits)
        assert clustered.groups == plain.groups == tiles * splits
        assert clustered.shapes == ((rows, columns), (1,))
        assert clustered.counters == 0 and clustered.reduce_params is None
        assert np.array_equal(np.array(clustered.params), np.array(plain.params))
    else:
        assert clustered == plain


def test_cluster_sum_is_refused_while_mlx_records_cuda_graphs(monkeypatch) -> None:
    """On by default only where direct launches are known (the graphs' variable off
    before anything was evaluated); with its switch, wherever mlx's CUDA graphs are
    off now; never with them on (mlx 0.32.4 updates a graph's kernel node without its
    cluster shape), nor on a device without clusters."""
    monkeypatch.setattr(tensor_qmm, "device_clusters", lambda: True)
    monkeypatch.delenv(tensor_qmm.CLUSTER_SUM_ENV, raising=False)
    monkeypatch.setenv("MLX_USE_CUDA_GRAPHS", "0")
    assert tensor_qmm.CLUSTER_SUM is True
    for known in (False, True):
        monkeypatch.setattr(backend, "direct_launches_known", lambda: known)
        assert tensor_qmm.cluster_sum() is known
    monkeypatch.setenv(tensor_qmm.CLUSTER_SUM_ENV, "0")
    assert not tensor_qmm.cluster_sum()
    monkeypatch.setattr(backend, "direct_launches_known", lambda: False)
    monkeypatch.setenv(tensor_qmm.CLUSTER_SUM_ENV, "1")
    assert tensor_qmm.cluster_sum()
    for graphs in (None, "1", "true"):
        if graphs is None:
            monkeypatch.delenv("MLX_USE_CUDA_GRAPHS")
        else:
            monkeypatch.setenv("MLX_USE_CUDA_GRAPHS", graphs)
        assert tensor_qmm.mlx_cuda_graphs() and not tensor_qmm.cluster_sum()
    for off in ("0", "false", "OFF"):
        monkeypatch.setenv("MLX_USE_CUDA_GRAPHS", off)
        assert not tensor_qmm.mlx_cuda_graphs() and tensor_qmm.cluster_sum()
    monkeypatch.setattr(tensor_qmm, "device_clusters", lambda: False)
    assert not tensor_qmm.cluster_sum()


@pytest.mark.parametrize(
    "info, expected",
    [
        ({"compute_capability_major": 9, "architecture": "sm_90"}, True),
        ({"compute_capability_major": 10}, True),
        ({"compute_capability_major": 8, "architecture": "sm_90"}, False),
        ({"architecture": "sm_90a"}, True),
        ({"architecture": "sm_86"}, False),
        ({"architecture": "x86_64"}, False),
        ({}, False),
    ],
)
def test_device_clusters_reads_the_compute_capability(monkeypatch, info, expected):
    monkeypatch.setattr(tensor_qmm.backend, "BACKEND", "cuda")
    monkeypatch.setattr(tensor_qmm.mx, "device_info", lambda: info)
    tensor_qmm.device_clusters.cache_clear()
    try:
        assert tensor_qmm.device_clusters() is expected
    finally:
        tensor_qmm.device_clusters.cache_clear()


def test_device_clusters_is_off_without_cuda() -> None:
    tensor_qmm.device_clusters.cache_clear()
    if tensor_qmm.backend.BACKEND != "cuda":
        assert not tensor_qmm.device_clusters()


def test_a_launch_must_fill_whole_clusters() -> None:
    spec = tensor_qmm.cluster_spec(CLUSTER_BASES[0], 3)
    with pytest.raises(ValueError, match="do not fill clusters of 3"):
        qmm.groups.launch_groups(spec, [], [(1,)], [mx.float32], 4, mx.bfloat16)


# ================================================================ lean byte decode


def test_the_lean_byte_decode_makes_every_byte_exact() -> None:
    """The arithmetic of ``dfl_q8_lean`` (tensor_qmm.LEAN_BYTES) for every byte in
    every position of both words: bf16's 0x4300 | (q & 127) is 128 + (q & 127), and
    less 128 where the top bit is clear it is q, exact; float16's 0x6400 | q less
    1024 is q. The selectors pick byte p of each word (the sign ones its top bit)."""
    rng = np.random.default_rng(70)
    for p in range(4):
        spread, sign = tensor_qmm.lean_byte_selectors(p)
        lo, hi = (int(v) for v in rng.integers(0, 2**32, 2, dtype=np.uint64))
        pool = lo | hi << 32
        picked = [(pool >> 8 * (spread >> 4 * i & 7)) & 0xFF for i in range(4)]
        assert picked == [lo >> 8 * p & 0xFF] * 2 + [hi >> 8 * p & 0xFF] * 2
        assert all(sign >> 4 * i & 8 for i in range(4))
        assert sign & 0x7777 == spread
    for q in range(256):
        bf16 = np.array([(0x4300 | (q & 0x7F)) << 16], np.uint32).view(np.float32)[0]
        assert bf16 == 128 + (q & 0x7F)
        addend = 0.0 if q & 0x80 else -128.0  # 0xC300 where the top bit is clear
        assert np.array([0xC300 << 16], np.uint32).view(np.float32)[0] == -128.0
        assert bf16 + addend == q
        f16 = np.array([0x6400 | q], np.uint16).view(np.float16)[0]
        assert float(f16) - 1024.0 == q


@st.composite
def eight_bit_cases(draw, max_rows: int = 32, max_chunks: int = 4):
    """Served 8-bit cases (x, weight, scales, biases, 8, group_size)."""
    group = draw(st.sampled_from(tensor_qmm.GROUP_SIZES))
    depth = Layout(8, 1).chunk * draw(st.integers(1, max_chunks))
    rows = draw(st.integers(1, max_rows))
    columns = draw(st.integers(1, 200))
    dtype = draw(st.sampled_from(HALF))
    return _fixed_case(
        rows, depth, columns, 8, group, dtype, draw(st.integers(0, 2**16))
    )


def _every_byte_case(dtype, group: int, rows: int = 16) -> tuple:
    """An 8-bit case whose weight bytes take every value at every byte of every word
    (each column runs through 0..255 from its own start)."""
    rng = np.random.default_rng(group)
    depth, columns = 512, 136
    q = (np.arange(depth)[None, :] + 37 * np.arange(columns)[:, None]) % 256
    weight = mx.array(
        q.astype(np.uint8).reshape(columns, depth // 4, 4).view(np.uint32)[..., 0]
    )
    side = (columns, depth // group)
    scales = mx.array(rng.uniform(0.001, 0.02, side).astype(np.float32)).astype(dtype)
    biases = mx.array(rng.uniform(-1, 1, side).astype(np.float32)).astype(dtype)
    x = mx.array(rng.standard_normal((rows, depth)).astype(np.float32)).astype(dtype)
    return x, weight, scales, biases, 8, group


def _lean_bytes_bits(emulated, monkeypatch, case, scaled: bool, tables=LEAN_BYTES):
    """``case``'s output bits with the lean byte decode's forms (``tables``), and with
    the float32 decode's."""
    monkeypatch.setenv(tensor_qmm.SCALED_B_ENV, "1" if scaled else "0")
    table = "scaled" if scaled else "form"
    lean = _bits_with_specs(emulated, case, {table: tables[table]})
    return lean, _bits_with_specs(emulated, case, {table: FLOAT_BYTES[table]})


@pytest.mark.parametrize("scaled", [False, True])
@settings(max_examples=6, deadline=None, suppress_health_check=_FIXTURES)
@given(case=eight_bit_cases(), late=st.booleans())
def test_emulated_lean_byte_decode_gives_the_float_decodes_bits(
    emulated, monkeypatch, scaled, case, late
) -> None:
    """The lean byte decode (``DFLASH_QMM_LEAN_BYTES``) feeds the mma the same exact
    pairs as ``dfl_q8``'s float32 decode: every output of the 8-bit forms, unscaled and
    scaled, keeps its bits, whatever the rows, K, columns, group size and half type."""
    emulated.late = late
    lean, floated = _lean_bytes_bits(emulated, monkeypatch, case, scaled)
    assert np.array_equal(lean, floated)


@pytest.mark.parametrize("scaled", [False, True])
@pytest.mark.parametrize("dtype", HALF)
def test_emulated_lean_byte_decode_over_every_byte_and_its_negative_control(
    emulated, monkeypatch, scaled, dtype
) -> None:
    """Every byte value at every position: the lean forms keep the float32 decode's
    bits, and with the sign selectors' sign bits dropped (negative control) bfloat16's
    bits change (float16's decode takes no sign selector, so there they hold)."""
    for group in (32, 128):
        case = _every_byte_case(dtype, group)
        lean, floated = _lean_bytes_bits(emulated, monkeypatch, case, scaled)
        assert np.array_equal(lean, floated)
        slip, _ = _lean_bytes_bits(
            emulated, monkeypatch, case, scaled, tables=LEAN_BYTES_UNSIGNED
        )
        assert np.array_equal(slip, floated) is (dtype == mx.float16)


@needs_nvcc
def test_float_byte_forms_compile_for_sm90_within_the_bounds(tmp_path: Path) -> None:
    """The float32 byte decode's 8-bit forms (``DFLASH_QMM_LEAN_BYTES=0``; the shipped
    lean ones are compiled with every shipped form above) compile for sm_90 with no
    spills, the scaled ones within their launch bounds' 128 registers (bfloat16, as the
    other opt-in forms)."""
    _assert_opt_in_forms_compile(
        list(FLOAT_BYTES["form"].values()), tmp_path / "u", 255
    )
    _assert_opt_in_forms_compile(
        list(FLOAT_BYTES["scaled"].values()), tmp_path / "s", 128
    )


def test_lean_byte_decode_is_on_by_default_and_its_switch_fails_closed(
    monkeypatch,
) -> None:
    """``DFLASH_QMM_LEAN_BYTES`` is on (session 71): every shipped 8-bit form but
    SwiGLU's (opt-in, not run with it) carries the decode, no other form does; a value
    that is not an on/off word fails the next bind, naming it."""
    assert tensor_qmm.LEAN_BYTES is tensor_qmm.LEAN_BYTES_DEFAULT is True
    shipped = list(tensor_qmm.SPECS) + list(tensor_qmm.SCALED_SPECS.values())
    eight = [spec for spec in shipped if spec.base.startswith("tensor_q8")]
    assert eight and all(
        spec.base.endswith("_lbytes") is ("_swiglu" not in spec.base) for spec in eight
    )
    assert not any("_lbytes" in s.base for s in shipped if s not in eight)
    assert tensor_qmm.lean_bytes() is True
    monkeypatch.setenv(tensor_qmm.LEAN_BYTES_ENV, "sometimes")
    with pytest.raises(ValueError, match="DFLASH_QMM_LEAN_BYTES"):
        tensor_qmm.lean_bytes()


def test_the_lean_byte_decode_touches_only_the_8_bit_forms() -> None:
    """Built with it, the 4-bit and dense forms keep their texts and names."""
    with matmul_variants.variant(lean_bytes=True):
        built = {
            key: (spec.base, spec.body)
            for key, spec in tensor_qmm.SCALED_SPECS.items()
            if key[1][0] == 4
        }
        dense = tensor_qmm.FORM_SPECS[(False, 2)][(0, 1)].body
    for key, (base, body) in built.items():
        assert (base, body) == (
            tensor_qmm.SCALED_SPECS[key].base,
            tensor_qmm.SCALED_SPECS[key].body,
        )
    assert dense == tensor_qmm.FORM_SPECS[(False, 2)][(0, 1)].body
    with pytest.raises(ValueError, match="bytes 0 to 3"):
        tensor_qmm.lean_byte_selectors(4)


@pytest.mark.cuda
@cuda
@pytest.mark.parametrize("shape", GLIMMER)
@pytest.mark.parametrize("rows", [1, 16, 32])
@pytest.mark.parametrize("scaled", [False, True], ids=["unscaled", "scaled"])
@pytest.mark.parametrize("group", [32, 64, 128])
def test_cuda_lean_byte_decode_gives_the_shipped_bits(
    monkeypatch, shape, rows, scaled, group
) -> None:
    """Every 8-bit Glimmer projection with the lean byte decode, groups of 32, 64 and
    128 (passed on an H100: groups of 64 in session 71, all three in session 75): its
    forms are the ones launched and they give the float32 decode's bits; row 0 alone
    has its batch bits."""
    monkeypatch.setenv(tensor_qmm.SCALED_B_ENV, "1" if scaled else "0")
    case = _glimmer_case(*shape, rows, 8, group=group)
    with matmul_variants.variant(lean_bytes=False):
        floated = raw_bits(_kernel(case))
    launched, launch = [], qmm.groups.launch_groups

    def recorded(spec, *args, **kwargs):
        launched.append(spec.base)
        return launch(spec, *args, **kwargs)

    monkeypatch.setattr(qmm.groups, "launch_groups", recorded)
    with matmul_variants.variant(lean_bytes=True):
        out = _kernel(case)
        alone = _kernel(case, slice(0, 1))
    matmuls = [base for base in launched if base.startswith("tensor_q8")]
    assert matmuls and all("_lbytes" in base for base in matmuls)
    assert np.array_equal(raw_bits(out), floated)
    assert np.array_equal(raw_bits(alone), raw_bits(out[0:1]))


def _ptx_function(text: str, half: str) -> list[tuple[str, list, list]]:
    """The ``asm`` statements of ``dfl_q8_lean``'s ``half`` overload in ``text``:
    (instruction, outputs, inputs), each operand as written (``=r``/``+r``/``r``/``n``
    with its expression)."""
    start = text.index(f"const {half}*) {{")
    body = text[start : text.index("\n}\n", start)]
    operand = re.compile(r'"([=+]?[rn])"\(([^()]+)\)')
    statements = []
    for line in body.splitlines():
        line = line.strip()
        if not line.startswith("asm("):
            continue
        instruction = line[line.index('"') + 1 : line.index(r"\n")]
        outs, ins = line[line.index(r'\n"') + 3 :].split(":")[1:3]
        statements.append((instruction, operand.findall(outs), operand.findall(ins)))
    return statements


def _ptx_half_value(word: int, half: str) -> float:
    if half == "__nv_bfloat16":
        return float(np.array([word << 16], np.uint32).view(np.float32)[0])
    return float(np.array([word], np.uint16).view(np.float16)[0])


def _ptx_half_word(value: float, half: str) -> int:
    """``value`` as a 16-bit word (exact values only: the decode's sums are)."""
    if half == "__nv_bfloat16":
        bits = int(np.array([value], np.float32).view(np.uint32)[0])
        assert bits & 0xFFFF == 0, value  # exact in bf16
        return bits >> 16
    word = int(np.array([value], np.float16).view(np.uint16)[0])
    assert _ptx_half_value(word, half) == value
    return word


def _run_ptx(statements, values: dict, half: str) -> dict:
    """Interpret the statements: ``prmt.b32`` (default mode: a selector nibble's bit 3
    replicates the byte's sign), ``lop3.b32`` (result bit = LUT bit a·4 + b·2 + c),
    ``fma.rn.{bf16,f16}x2`` (per half, exact values here)."""
    values = dict(values)
    for instruction, outs, ins in statements:
        names = [name for _, name in outs]
        operands = [values[name] for kind, name in outs if kind == "+r"]
        for kind, expr in ins:
            expr = expr.strip()
            operands.append(
                values[expr] if expr in values else int(expr.rstrip("u"), 0)
            )
        op, args = instruction.split(" ", 1)
        immediate = args.split(",")[-1].strip().rstrip(";")
        if op == "prmt.b32":
            lo, hi, selector = operands
            pool, out = lo | hi << 32, 0
            for i in range(4):
                nibble = selector >> 4 * i & 0xF
                byte = pool >> 8 * (nibble & 7) & 0xFF
                if nibble & 8:
                    byte = 0xFF if byte & 0x80 else 0
                out |= byte << 8 * i
        elif op == "lop3.b32":
            a, b, c = operands
            lut = int(immediate, 0)
            out = 0
            for i in range(32):
                index = (a >> i & 1) << 2 | (b >> i & 1) << 1 | (c >> i & 1)
                out |= (lut >> index & 1) << i
        elif op in ("fma.rn.bf16x2", "fma.rn.f16x2"):
            x, y, z = operands
            out = 0
            for shift in (0, 16):
                value = _ptx_half_value(x >> shift & 0xFFFF, half) * _ptx_half_value(
                    y >> shift & 0xFFFF, half
                ) + _ptx_half_value(z >> shift & 0xFFFF, half)
                out |= _ptx_half_word(value, half) << shift
        else:
            raise AssertionError(f"no interpretation of {op}")
        values[names[0]] = out
    return values


@pytest.mark.parametrize("half", ["__nv_bfloat16", "__half"])
def test_the_lean_byte_decodes_own_ptx_makes_every_byte_exact(half) -> None:
    """``dfl_q8_lean``'s inline PTX as written (its selectors, ``lop3`` truth tables
    and constants), interpreted instruction by instruction: for every byte value at
    every byte of both words, the pair is the two bytes, exact, lo's in the low half.
    (The emulator stands its own C++ in for the PTX; this reads the PTX itself.)"""
    statements = _ptx_function(tensor_qmm._LEAN_BYTES_HELPERS, half)
    assert [s[0].split(" ")[0] for s in statements][-1].startswith("fma.rn")
    rng = np.random.default_rng(71)
    for p in range(4):
        spread, sign = tensor_qmm.lean_byte_selectors(p)
        for q in range(256):
            other = int(rng.integers(0, 256))
            filler = [int(v) for v in rng.integers(0, 256, 8)]
            lo_bytes, hi_bytes = filler[:4], filler[4:]
            lo_bytes[p], hi_bytes[p] = q, other
            lo = int.from_bytes(bytes(lo_bytes), "little")
            hi = int.from_bytes(bytes(hi_bytes), "little")
            start = {"lo": lo, "hi": hi, "spread": spread, "sign": sign}
            r = _run_ptx(statements, start, half)["r"]
            assert _ptx_half_value(r & 0xFFFF, half) == q
            assert _ptx_half_value(r >> 16, half) == other
