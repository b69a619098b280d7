"""The direct 4-bit matmul form (``tensor_qmm.DIRECT_Q4``, session 47; off: on the H200
its ``cuda`` tests below passed, but it measured slower than the staged form).

Each lane loads its own weight words from global memory into registers a chunk ahead,
so the weights skip the ``cp.async`` staging and the shared-memory round trip. A
lane's words are contiguous (``tensor_qmm.direct_word``), x is staged in their order
(``dfl_direct_slot``), and a lane's scale opens once a half chunk. These tests hold
the word map, the slot helper's C++ text, the compiled forms' registers, the plan's
choice, and the body text itself on the CPU emulator: the rounded-weight oracle,
batch invariance, misaligned inputs, a K split summed three ways, fused members;
each planted slip misses the oracle.
"""

from __future__ import annotations

import dataclasses
import re
import subprocess
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support.attention_cases import bits as raw_bits
from support.compilers import GXX, NVCC, built_emulator, needs_gxx, needs_nvcc
from support.group_emulator import check_cuda, entry_registers, type_suffix
from support.tensor_emulator import TensorEmulator
from test_tensor_qmm import (
    _assert_batch_invariant,
    _assert_members_meet_their_oracles,
    _close_on_columns,
    _fixed_case,
    _glimmer_case,
    _kernel,
)
from test_verify_kernels import _scaled_oracle_close

from benchmarks import matmul_variants
from dflash.metal import qmm, tensor_qmm
from dflash.metal.groups import int_params
from dflash.metal.tensor_qmm import DIRECT_SPECS, Layout, direct_word, split_plan

cuda = pytest.mark.skipif(not mx.cuda.is_available(), reason="needs mlx's CUDA backend")
HALF = (mx.bfloat16, mx.float16)
# An opt-in form measured slower (session 47): compile-checked in bfloat16 alone. Its
# float16 text differs in the conversions and mma type the shipped forms compile in
# both; the emulator runs it in both.
COMPILED = (mx.bfloat16,)
CHUNK = Layout(4, 1).chunk
_FIXTURES = [HealthCheck.function_scoped_fixture]


# ============================================================== the word map


def test_direct_words_tile_each_half_chunk_in_lane_order() -> None:
    """Sub-chunks 4 h .. 4 h + 3 take words 16 h .. 16 h + 15 once each; a lane's
    words of a half chunk are 16 contiguous, aligned bytes, the four lanes of a column
    64; and a lane's 32 elements of a half chunk lie in one group of 32 (so of any
    served size): its scale is one a half chunk."""
    for half in (0, 1):
        words = [direct_word(4 * half + s, tig) for s in range(4) for tig in range(4)]
        assert sorted(words) == list(range(16 * half, 16 * half + 16))
        for tig in range(4):
            lane = [direct_word(4 * half + s, tig) for s in range(4)]
            assert lane == list(range(lane[0], lane[0] + 4)) and lane[0] % 4 == 0
            elements = [8 * word + e for word in lane for e in range(8)]
            assert len({element // 32 for element in elements}) == 1
        starts = sorted(direct_word(4 * half, tig) for tig in range(4))
        assert starts == list(range(starts[0], starts[0] + 16, 4))
    for bad in ((8, 0), (-1, 0), (0, 4)):
        with pytest.raises(ValueError, match="no word"):
            direct_word(*bad)


@needs_gxx
def test_direct_slot_helper_puts_each_word_where_its_lane_reads_it(
    tmp_path: Path,
) -> None:
    """The kernel's own ``dfl_direct_slot`` (its C++ text, built by g++) sends x's
    piece ``direct_word(sc, tig)`` to slot ``4 sc + tig``, the slot that lane reads
    for sub-chunk ``sc``: a permutation of the chunk's 32 pieces."""
    source = tmp_path / "slot.cpp"
    source.write_text(
        "#include <cstdio>\n#include <cstdint>\n#define DFL_FN inline\n"
        "struct uint4 { uint32_t x, y, z, w; };\n"
        + tensor_qmm._DIRECT_HELPERS
        + "int main() {\n  for (int p = 0; p < 32; ++p) {\n"
        '    std::printf("%d\\n", dfl_direct_slot(p));\n  }\n}\n'
    )
    binary = tmp_path / "slot"
    built = subprocess.run(
        [GXX, "-std=c++17", str(source), "-o", str(binary)],
        capture_output=True,
        text=True,
    )
    assert built.returncode == 0, built.stderr
    slots = [int(line) for line in subprocess.check_output([binary]).split()]
    assert sorted(slots) == list(range(32))
    for sc in range(8):
        for tig in range(4):
            assert slots[direct_word(sc, tig)] == 4 * sc + tig


# ========================================================== compile and plan


@needs_nvcc
def test_direct_forms_compile_for_sm90_without_spills(tmp_path: Path) -> None:
    """Every direct form (one and two K groups, groups of 32 / 64 / 128) and the
    cluster forms of the two-K-group one compile for sm_90 (in bfloat16: ``COMPILED``)
    with no spills and no stack; the two-K-group forms within their launch bounds
    (128 registers: two CTAs of 256 threads an SM)."""
    clusters = [
        tensor_qmm.cluster_spec(DIRECT_SPECS[(2, 64)], size)
        for size in range(2, tensor_qmm.MAX_CLUSTER + 1)
    ]
    specs = list(DIRECT_SPECS.values()) + clusters
    built = check_cuda(specs, tmp_path, NVCC, dtypes=COMPILED, flags=("-Xptxas", "-v"))
    assert built.ok, f"{built.command}\n{built.log}"
    entries = re.findall(r"Compiling entry function", built.log)
    assert len(entries) == len(COMPILED) * len(specs)
    spills = re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", built.log)
    assert spills and all(a == "0" and b == "0" for a, b in spills), built.log
    frames = re.findall(r"(\d+) bytes stack frame", built.log)
    assert frames and all(frame == "0" for frame in frames), built.log
    variants = list(NO_AHEAD.values()) + list(NON_COHERENT.values())
    checked = check_cuda(
        variants, tmp_path / "variants", NVCC, dtypes=COMPILED, flags=("-Xptxas", "-v")
    )
    assert checked.ok, f"{checked.command}\n{checked.log}"
    assert "ld.global.nc.L1::no_allocate.v4.u32" in NON_COHERENT[(2, 64)].helpers
    spills = re.findall(r"(\d+) bytes spill stores", checked.log)
    assert spills and set(spills) == {"0"}, checked.log
    # Nothing staged: x's loads held ahead cost registers; two K groups spill a little
    # at the cap (a what-if to time, not a form a switch takes).
    unstaged = check_cuda(
        list(NO_BARRIER.values()), tmp_path / "nobarrier", NVCC, dtypes=COMPILED,
        flags=("-Xptxas", "-v"),
    )  # fmt: skip
    assert unstaged.ok, f"{unstaged.command}\n{unstaged.log}"
    spilled = re.findall(r"(\d+) bytes spill stores", unstaged.log)
    assert spilled and max(int(n) for n in spilled) <= 64, unstaged.log
    used = entry_registers(built.log)
    bounded = [
        used[f"unit{specs.index(spec)}_{type_suffix(dtype)}"]
        for (groups, _), spec in DIRECT_SPECS.items()
        if groups == 2
        for dtype in COMPILED
    ]
    assert bounded and max(bounded) <= 128, built.log


def test_direct_form_is_the_staged_text_less_its_weight_copies() -> None:
    """The direct form is edits of the scaled form's filled text: no weight region
    in a stage (smaller stages), no weight copies, its own name; it refuses what it
    cannot be (8-bit, dense, unscaled, a group size read at launch, SwiGLU). (It reads
    the scales as mlx lays them out: the staged form it is compared with too.)"""
    with matmul_variants.variant(**matmul_variants.VARIANTS["rowmajor"]):
        row_major = dict(tensor_qmm.SCALED_SPECS)
    for (groups, size), spec in DIRECT_SPECS.items():
        staged = row_major[(groups, (4, 1), size)]
        assert spec.base == staged.base + "_direct"
        assert "dfl_copy16(base + w_shared" in staged.body
        assert "w_shared" not in spec.body and "dfl_direct_load" in spec.body
        assert spec.shared_memory < staged.shared_memory
        assert spec.threads == staged.threads
    layout = Layout(4, 1, direct=True)
    assert layout.weight_bytes == 0 and Layout(4, 1).weight_bytes > 0
    assert layout.stage_bytes == Layout(4, 1).stage_bytes - Layout(4, 1).weight_bytes
    for bits, options in (
        (8, dict(scaled=True, group_size=64)),
        (0, {}),
        (4, dict(group_size=64)),
        (4, dict(scaled=True)),
        (4, dict(scaled=True, group_size=64, swiglu=True)),
    ):
        with pytest.raises(ValueError, match="direct form"):
            tensor_qmm._spec(Layout(bits, 1, direct=True), **options)


def test_the_direct_switch_is_read_at_each_bind(monkeypatch) -> None:
    """Off by default; ``DFLASH_QMM_DIRECT_Q4`` decides at each bind; only scaled
    4-bit calls of up to 16 rows take it (32 rows, 8-bit, dense, the unscaled and the
    SwiGLU forms keep theirs), with the split plan of the staged form."""
    assert tensor_qmm.DIRECT_Q4 is False
    monkeypatch.delenv(tensor_qmm.DIRECT_Q4_ENV, raising=False)
    assert not tensor_qmm.direct_q4(4)
    monkeypatch.setenv(tensor_qmm.DIRECT_Q4_ENV, "1")
    assert tensor_qmm.direct_q4(4) and not tensor_qmm.direct_q4(8)
    assert not tensor_qmm.direct_q4(None)
    for groups in (1, 2):
        for rows in (1, 16):
            plan = tensor_qmm.launch_plan(
                rows, 6656, 4096, 4, 64, True, False, True, groups,
                scaled=True, direct=True,
            )  # fmt: skip
            staged = tensor_qmm.launch_plan(
                rows, 6656, 4096, 4, 64, True, False, True, groups, scaled=True
            )
            assert plan.spec is DIRECT_SPECS[(groups, 64)]
            assert (plan.groups, plan.counters) == (staged.groups, staged.counters)
    for rows, bits, options in (
        (17, 4, dict(scaled=True)),
        (16, 8, dict(scaled=True)),
        (16, None, dict(scaled=True)),
        (16, 4, {}),
    ):
        plan = tensor_qmm.launch_plan(
            rows, 6656, 4096, bits, 64 if bits else None, True, False, True, 2,
            direct=True, **options,
        )  # fmt: skip
        assert "_direct" not in plan.spec.base, (rows, bits, options)
    swiglu = tensor_qmm.launch_plan(
        4, 256, 256, 4, 64, True, swiglu=True, scaled=True, direct=True
    )
    assert "_swiglu" in swiglu.spec.base and "_direct" not in swiglu.spec.base


# ============================================================ the emulator


def _mutant(suffix: str, old: str, new: str):
    """The two-K-group group-64 direct form in bfloat16 with ``old`` made ``new``."""
    spec = DIRECT_SPECS[(2, 64)]
    assert spec.body.count(old) == 1, old
    return dataclasses.replace(
        spec,
        base=f"{spec.base}_{suffix}",
        body=spec.body.replace(old, new),
        dtypes=(mx.bfloat16,),
    )


# Negative controls, each one slip of the direct text.
MUTANTS = {
    # x staged in the staged form's order: each lane's x is not its words' elements.
    "staged_slot": _mutant(
        "staged_slot",
        "dfl_direct_slot(int(lid) % X_PIECES)",
        "(int(lid) % X_PIECES)",
    ),
    # Every lane takes the scale of its half chunk's first group.
    "shared_group": _mutant(
        "shared_group",
        "(4 * SUB * (sc >> 2) + SUB * tig) >> group_shift",
        "(4 * SUB * (sc >> 2)) >> group_shift",
    ),
    # The next chunk's words loaded over the ones being summed.
    "same_buffer": _mutant(
        "same_buffer", "load_words(c + 1, wq[pp ^ 1]);", "load_words(c + 1, wq[pp]);"
    ),
}
CLUSTERS = {
    size: tensor_qmm.cluster_spec(DIRECT_SPECS[(2, 64)], size)
    for size in range(2, tensor_qmm.MAX_CLUSTER + 1)
}


def _variant_specs(name: str) -> dict:
    """The direct forms under one of matmul_variants' variants (built at import)."""
    with matmul_variants.variant(**matmul_variants.VARIANTS[name]):
        return dict(DIRECT_SPECS)


# Timing variants whose bits must be the direct form's: words loaded at use (no
# register buffer ahead), and loaded through the non-coherent path (PTX: compiled only).
NO_AHEAD = _variant_specs("direct4-noahead")
NON_COHERENT = _variant_specs("direct4-nc")
# x and the scales read from global memory where they are used: no stage, no barrier.
NO_BARRIER = _variant_specs("direct4-nobarrier")
SAME_BITS = {"direct4-noahead": NO_AHEAD, "direct4-nobarrier": NO_BARRIER}


@pytest.fixture(scope="module")
def direct_emulator(tmp_path_factory):
    specs = (
        tuple(DIRECT_SPECS.values())
        + tuple(CLUSTERS.values())
        + tuple(MUTANTS.values())
        + tuple(NO_AHEAD.values())
        + tuple(NO_BARRIER.values())
        + (tensor_qmm.REDUCE_SPEC,)
    )
    return built_emulator(TensorEmulator, tmp_path_factory, "direct_emulator", specs)


@pytest.fixture
def direct(direct_emulator, monkeypatch):
    """small_row_matmul on a pretend CUDA backend (launches run by the emulator) with
    the scaled and direct forms picked at bind."""
    monkeypatch.setattr(qmm.backend, "BACKEND", "cuda")
    monkeypatch.setenv(qmm.backend.COMPILE_ENV, "0")
    monkeypatch.setenv(tensor_qmm.SCALED_B_ENV, "1")
    monkeypatch.setenv(tensor_qmm.DIRECT_Q4_ENV, "1")
    monkeypatch.setenv(tensor_qmm.FOLDED_OFFSET_ENV, "0")
    monkeypatch.setattr(qmm.groups, "launch_groups", direct_emulator.launch)
    tensor_qmm.launch_plan.cache_clear()
    direct_emulator.late = False
    direct_emulator.eager = False
    yield direct_emulator
    tensor_qmm.launch_plan.cache_clear()
    tensor_qmm._wave_split.cache_clear()
    direct_emulator.late = False
    direct_emulator.eager = False
    direct_emulator.misaligned = False


@st.composite
def direct_cases(draw, max_chunks: int = 5, max_columns: int = 300):
    """A 4-bit call the direct form takes: 1 to 16 rows, groups of 32, 64 or 128."""
    depth = CHUNK * draw(st.integers(1, max_chunks))
    rows = draw(st.integers(1, 16))
    columns = draw(st.integers(1, max_columns))
    group = draw(st.sampled_from(tensor_qmm.GROUP_SIZES))
    dtype = draw(st.sampled_from(HALF))
    return _fixed_case(
        rows, depth, columns, 4, group, dtype, draw(st.integers(0, 2**16))
    )


def _resident(monkeypatch, resident: int) -> None:
    """The wave rule with ``resident`` CTAs at a time: 1 leaves K unsplit (each CTA
    then sums every chunk, through both register buffers), 3 splits it partly."""
    monkeypatch.setenv(tensor_qmm.WAVE_SPLIT_ENV, "1")
    monkeypatch.setattr(tensor_qmm, "RESIDENT_CTAS", resident)
    tensor_qmm._wave_split.cache_clear()
    tensor_qmm.launch_plan.cache_clear()


@settings(max_examples=16, deadline=None, suppress_health_check=_FIXTURES)
@given(
    case=direct_cases(),
    groups=st.sampled_from(["0", "1"]),
    late=st.booleans(),
    eager=st.booleans(),
    resident=st.sampled_from([1, 3, tensor_qmm.RESIDENT_CTAS]),
)
def test_emulated_direct_form_matches_the_oracle_and_is_batch_invariant(
    direct, monkeypatch, case, groups, late, eager, resident
) -> None:
    """The direct body text (one or two K groups, every group size; K unsplit, split
    partly or fully, so a CTA sums 1 to 5 chunks through its two register buffers;
    partial column tiles; x copies landing at issue or at their wait; warps together
    or each running ahead): within the rounded-weight oracle's tolerance, and each row
    alone, the middle rows and the rows reversed give each row its batch bits."""
    monkeypatch.setenv(tensor_qmm.TWO_K_GROUPS_ENV, groups)
    _resident(monkeypatch, resident)
    direct.late, direct.eager = late, eager
    before = len(direct.launched)
    out = _kernel(case)
    assert direct.launched[before].endswith("_direct")
    assert _scaled_oracle_close(case, out)
    _assert_batch_invariant(case)


def test_emulated_direct_form_sums_every_chunk_count_of_an_unsplit_k(
    direct, monkeypatch
) -> None:
    """K unsplit, 1 to 6 chunks a CTA (the register buffers' pairs, whole and with
    one left over), both K groups: within the oracle, rows batch-invariant."""
    _resident(monkeypatch, 1)
    for chunks in range(1, 7):
        case = _fixed_case(5, CHUNK * chunks, 130, 4, 32, mx.bfloat16, seed=chunks)
        assert split_plan(CHUNK * chunks, 130, 4, True)[1] == 1
        assert _scaled_oracle_close(case, _kernel(case)), chunks
        assert direct.launched[-1].endswith("_direct")
    _assert_batch_invariant(case)


@settings(max_examples=5, deadline=None, suppress_health_check=_FIXTURES)
@given(case=direct_cases(max_chunks=3, max_columns=140))
def test_emulated_direct_form_gives_misaligned_inputs_the_same_bits(
    direct, case
) -> None:
    """Inputs off a 16-byte boundary take 16-bit loads and copies: the same bytes, so
    the same bits."""
    aligned = raw_bits(_kernel(case))
    direct.misaligned = True
    assert np.array_equal(raw_bits(_kernel(case)), aligned)


@pytest.mark.parametrize("splits", [2, 3, 4])
def test_emulated_direct_split_sums_agree_bit_for_bit(
    direct, monkeypatch, splits
) -> None:
    """A K split of the direct form summed by its last CTA, by a reduce launch and
    inside a thread-block cluster gives the same bits, close to the oracle."""
    monkeypatch.setenv(tensor_qmm.WAVE_SPLIT_ENV, "1")
    monkeypatch.setattr(tensor_qmm, "device_clusters", lambda: True)
    monkeypatch.setenv("MLX_USE_CUDA_GRAPHS", "0")
    case = _fixed_case(9, CHUNK * splits, 300, 4, 64, mx.bfloat16, seed=splits)
    assert split_plan(CHUNK * splits, 300, 4, True)[1] == splits
    results = {}
    for arm, merged, cluster in (
        ("merged", "1", "0"),
        ("reduce", "0", "0"),
        ("cluster", "1", "1"),
    ):
        monkeypatch.setenv(tensor_qmm.MERGED_SPLIT_SUM_ENV, merged)
        monkeypatch.setenv(tensor_qmm.CLUSTER_SUM_ENV, cluster)
        tensor_qmm.launch_plan.cache_clear()
        before = len(direct.launched)
        results[arm] = raw_bits(_kernel(case))
        launched = direct.launched[before:]
        assert launched[0].startswith(DIRECT_SPECS[(2, 64)].base), arm
        assert launched[0].endswith(f"_c{splits}") is (arm == "cluster")
        assert len(launched) == (2 if arm == "reduce" else 1)
    assert np.array_equal(results["reduce"], results["merged"])
    assert np.array_equal(results["cluster"], results["merged"])
    assert _scaled_oracle_close(case, _kernel(case))


def test_emulated_direct_fused_members_meet_their_own_oracles(direct) -> None:
    """Member-major fused siblings (two widths, K split) in the direct form: each
    member's result within its own rounded-weight oracle."""
    rng = np.random.default_rng(21)
    x = mx.array(rng.standard_normal((11, 1024)).astype(np.float32)).astype(mx.bfloat16)
    _assert_members_meet_their_oracles(x, direct.launched, "_direct")


def _launch(emulator, spec, case) -> mx.array:
    """One launch of ``spec`` over ``case`` with K unsplit (each CTA sums every
    chunk)."""
    x, weight, scales, biases, _, group = case
    (rows, depth), columns = x.shape, weight.shape[0]
    tiles = -(-columns // tensor_qmm.COLUMNS)
    shift = group.bit_length() - 1
    params = int_params(
        rows, columns, depth, group, tiles, 1, depth // CHUNK, shift, 0, 0
    )
    y, _ = emulator.launch(
        spec,
        [x, weight, scales, biases, params, mx.zeros((1,), mx.int32)],
        [(rows, columns), (1,)],
        [x.dtype, mx.float32],
        tiles,
        x.dtype,
    )
    mx.eval(y)
    return y


@pytest.mark.parametrize("variant", sorted(SAME_BITS))
@settings(max_examples=6, deadline=None, suppress_health_check=_FIXTURES)
@given(
    case=direct_cases(),
    group_count=st.sampled_from(["0", "1"]),
    resident=st.sampled_from([1, tensor_qmm.RESIDENT_CTAS]),
    misaligned=st.booleans(),
)
def test_emulated_direct_variants_give_the_same_bits(
    direct, monkeypatch, variant, case, group_count, resident, misaligned
) -> None:
    """``direct4-noahead`` (each chunk's words loaded at its own top, no register
    buffer ahead) and ``direct4-nobarrier`` (x and the scales read from global memory
    where they are used, nothing staged) feed the mma the same operands in the same
    order: the direct form's bits, inputs aligned or not."""
    monkeypatch.setenv(tensor_qmm.TWO_K_GROUPS_ENV, group_count)
    _resident(monkeypatch, resident)
    direct.misaligned = misaligned
    shipped = raw_bits(_kernel(case))
    specs = SAME_BITS[variant]
    for key, spec in specs.items():
        monkeypatch.setitem(DIRECT_SPECS, key, spec)
    tensor_qmm.launch_plan.cache_clear()
    before = len(direct.launched)
    got = raw_bits(_kernel(case))
    assert direct.launched[before] in {spec.base for spec in specs.values()}
    assert np.array_equal(got, shipped)


@pytest.mark.parametrize("slip", sorted(MUTANTS))
def test_emulator_catches_direct_slips(direct, slip) -> None:
    """Negative controls: x staged in the staged form's order, every lane on its half
    chunk's first group, or the next chunk's words over the ones being summed, each
    misses the oracle the intact text meets on the same call (3 chunks unsplit,
    group 64)."""
    case = _fixed_case(16, 3 * CHUNK, 200, 4, 64, mx.bfloat16, seed=7)
    assert _scaled_oracle_close(case, _launch(direct, DIRECT_SPECS[(2, 64)], case))
    assert not _scaled_oracle_close(case, _launch(direct, MUTANTS[slip], case))


# ================================================================ on the GPU


@pytest.mark.cuda
@cuda
@settings(max_examples=60, deadline=None, suppress_health_check=_FIXTURES)
@given(case=direct_cases(), groups=st.sampled_from(["0", "1"]))
def test_cuda_direct_form_matches_the_oracle_and_is_batch_invariant(
    monkeypatch, case, groups
) -> None:
    """On the GPU: the direct form within the rounded-weight oracle's tolerance and
    batch-invariant, one and two K groups, every group size."""
    monkeypatch.setenv(tensor_qmm.SCALED_B_ENV, "1")
    monkeypatch.setenv(tensor_qmm.DIRECT_Q4_ENV, "1")
    monkeypatch.setenv(tensor_qmm.TWO_K_GROUPS_ENV, groups)
    assert _scaled_oracle_close(case, _kernel(case))
    _assert_batch_invariant(case)


@pytest.mark.cuda
@cuda
@pytest.mark.parametrize(
    "shape",
    [(6656, 4096), (6656, 256), (4096, 6656), (6656, 19968), (19968, 6656),
     (6656, 8704), (6656, 39936), (6656, 202048)],
)  # fmt: skip
@pytest.mark.parametrize("rows", [1, 16])
def test_cuda_direct_form_glimmer_shapes(monkeypatch, shape, rows) -> None:
    """Every Glimmer projection, the fused launches and the LM head in the direct
    form: close to the rounded-weight oracle (2,048 columns of the LM head), and row 0
    alone has its batch bits."""
    monkeypatch.setenv(tensor_qmm.SCALED_B_ENV, "1")
    monkeypatch.setenv(tensor_qmm.DIRECT_Q4_ENV, "1")
    depth, columns = shape
    case = _glimmer_case(depth, columns, rows, 4)
    out = _kernel(case)
    if columns > 100_000:
        picked = list(range(1024)) + list(range(columns - 1024, columns))
        assert _close_on_columns(case, out, picked)
    else:
        assert _scaled_oracle_close(case, out, slack=4.0)
    alone = _kernel(case, slice(0, 1))
    assert np.array_equal(raw_bits(alone), raw_bits(out[0:1]))
