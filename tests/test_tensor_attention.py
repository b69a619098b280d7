"""The tensor-core chunk pass of the small-query attention (CUDA, 16-bit types).

What is proven where:

* CPU (CI): the body compiles to a cubin for every served head dim (nvcc + ptxas, so
  the inline PTX is checked too) and a wrong tensor-core instruction fails that check
  (negative control); which calls the form serves; the launch geometry (one
  threadgroup per batch x KV head x chunk x 64 query rows) and that the fold is the
  scalar form's; the spec is never built for Metal.
* CUDA (tests marked ``cuda``, on an NVIDIA GPU): against the float64 oracle and the
  reference over random shapes, 16-bit dtypes, ring rotations and fill levels, windows
  and soft-caps; batch-invariant and seam-blind bit for bit; Muse Glimmer's shapes;
  the scalar CUDA body still right with the tensor cores switched off.
"""

from __future__ import annotations

import dataclasses
import hashlib
from pathlib import Path

import mlx.core as mx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from support.attention_cases import Case, build, cases, close_to_oracle
from support.compilers import NVCC, needs_nvcc
from support.group_emulator import check_cuda
from test_verify_kernels import (
    assert_batch_invariant,
    assert_kernel_near_oracle_and_reference,
    assert_seamless,
)

from dflash.metal import (
    attention,
    groups,
    heads,
    norms,
    tensor_attention,
    tensor_qmm,
)
from dflash.metal.groups import build_group_kernel

cuda = pytest.mark.skipif(not mx.cuda.is_available(), reason="needs mlx's CUDA backend")

SERVED_DIMS = (16, 32, 48, 64, 80, 128)
SERVED_CHUNKS = (64, 256)
SERVED_DTYPES = (mx.bfloat16, mx.float16)


def served_cases(**kwargs):
    return cases(dims=SERVED_DIMS, dtypes=SERVED_DTYPES, chunks=SERVED_CHUNKS, **kwargs)


def glimmer_case(ring: bool, queries: int = 16) -> Case:
    """32 query / 2 KV heads x 128, bf16: a full 2,048 ring or a 4k growing plane."""
    if ring:
        return Case(1, 2, 16, 128, mx.bfloat16, True, 2048, 4096, queries, queries,
                    777, 2048, True, None, 256, 1)  # fmt: skip
    return Case(1, 2, 16, 128, mx.bfloat16, False, 4352, 4096, queries, queries, 0,
                None, True, None, 256, 2)  # fmt: skip


# ------------------------------------------------------------------ CPU (CI)


LAYOUTS = sorted(tensor_attention.LAYOUTS)


@pytest.fixture(params=LAYOUTS)
def layout(request, monkeypatch):
    """Each tensor-core layout in turn, as the process's layout."""
    chosen = tensor_attention.LAYOUTS[request.param]
    monkeypatch.setattr(attention, "TENSOR_LAYOUT", chosen)
    return chosen


@needs_nvcc
@pytest.mark.parametrize("name", LAYOUTS)
def test_bodies_compile_for_every_served_dim(tmp_path: Path, name: str) -> None:
    layout = tensor_attention.LAYOUTS[name]
    specs = [tensor_attention.attend_spec(dim, layout) for dim in SERVED_DIMS]
    result = check_cuda(specs, tmp_path, NVCC)
    assert result.ok, f"{result.command}\n{result.log}"


@needs_nvcc
def test_a_wrong_tensor_core_instruction_fails_the_check(tmp_path: Path) -> None:
    """Negative control: ptxas sees the inline PTX (an m16n8k15 mma does not exist)."""
    spec = tensor_attention.attend_spec(64, tensor_attention.SPLIT)
    helpers = spec.helpers.replace(
        "m16n8k16.row.col.f32.bf16", "m16n8k15.row.col.f32.bf16"
    )
    assert helpers != spec.helpers
    broken = dataclasses.replace(spec, helpers=helpers)
    assert not check_cuda([broken], tmp_path, NVCC).ok


@pytest.mark.parametrize(
    "dim, chunk, dtype, backend_name, served",
    [
        (128, 256, mx.bfloat16, "cuda", True),
        (128, 64, mx.float16, "cuda", True),
        (16, 256, mx.bfloat16, "cuda", True),
        (128, 256, mx.float32, "cuda", False),
        (24, 256, mx.bfloat16, "cuda", False),
        (256, 256, mx.bfloat16, "cuda", False),
        (128, 16, mx.bfloat16, "cuda", False),
        (128, 96, mx.bfloat16, "cuda", False),
        (128, 512, mx.bfloat16, "cuda", False),  # split: 4 tiles at most
        (128, 256, mx.bfloat16, "metal", False),
        (128, 256, mx.bfloat16, None, False),
    ],
)
def test_which_calls_the_tensor_cores_serve(dim, chunk, dtype, backend_name, served):
    split = tensor_attention.SPLIT
    assert (
        tensor_attention.tensor_serves(dim, chunk, dtype, backend_name, split) is served
    )


def test_the_stream_layout_takes_longer_chunks() -> None:
    assert tensor_attention.tensor_serves(128, 512, mx.bfloat16, "cuda")
    assert not tensor_attention.tensor_serves(128, 480, mx.bfloat16, "cuda")


@pytest.mark.parametrize("name", LAYOUTS)
def test_the_spec_is_cuda_only(name: str) -> None:
    layout = tensor_attention.LAYOUTS[name]
    spec = tensor_attention.attend_spec(128, layout)
    assert spec.backends == ("cuda",) and spec.threads == layout.threads
    assert build_group_kernel(spec, "metal") is None
    assert spec.shared_memory == tensor_attention.shared_bytes(128, layout) > 48 * 1024


def test_a_bad_layout_fails_the_first_call_not_the_import(monkeypatch) -> None:
    monkeypatch.setenv(tensor_attention.LAYOUT_ENV, "tiles")
    monkeypatch.setattr(attention, "TENSOR_LAYOUT", None)
    monkeypatch.setattr(attention.backend, "BACKEND", "cuda")
    with pytest.raises(ValueError, match="DFLASH_TENSOR_LAYOUT='tiles'"):
        build(glimmer_case(ring=False, queries=2)).attend(True)


def test_the_layout_comes_from_the_env(monkeypatch) -> None:
    monkeypatch.delenv(tensor_attention.LAYOUT_ENV, raising=False)
    default = tensor_attention.LAYOUTS[tensor_attention.DEFAULT_LAYOUT]
    assert tensor_attention.layout_from_env() is default
    monkeypatch.setenv(tensor_attention.LAYOUT_ENV, "Split")
    assert tensor_attention.layout_from_env() is tensor_attention.SPLIT
    monkeypatch.setenv(tensor_attention.LAYOUT_ENV, "tiles")
    with pytest.raises(ValueError, match="DFLASH_TENSOR_LAYOUT='tiles'"):
        tensor_attention.layout_from_env()


def _captured_launches(monkeypatch, case: Case, switch: bool = True) -> list:
    """Run ``case`` through the kernel wrapper as CUDA would, recording each launch."""
    launches = []

    def fake(spec, inputs, shapes, dtypes, count, dtype):
        launches.append((spec, count, [tuple(s) for s in shapes]))
        return [mx.zeros(s, dtype=d) for s, d in zip(shapes, dtypes)]

    monkeypatch.setattr(attention.backend, "BACKEND", "cuda")
    monkeypatch.setattr(attention, "TENSOR_CORES", switch)
    monkeypatch.setattr(groups, "launch_groups", fake)
    build(case).attend(True)
    return launches


def test_launch_geometry_at_glimmer_shapes(monkeypatch, layout) -> None:
    """16 queries x 16 grouped heads = 256 rows in blocks of the layout's rows, 17 chunks."""
    launches = _captured_launches(monkeypatch, glimmer_case(ring=False))
    (spec, count, shapes), (fold, _, _) = launches
    assert spec is tensor_attention.attend_spec(128, layout)
    plan_chunks = shapes[0][3]
    assert plan_chunks == 17
    assert count == 1 * 2 * plan_chunks * (256 // layout.rows)
    assert fold is attention.FOLD_CHUNKS


def test_switch_off_keeps_the_scalar_body(monkeypatch) -> None:
    launches = _captured_launches(monkeypatch, glimmer_case(ring=False), switch=False)
    assert launches[0][0] is attention.ATTEND_CHUNKS
    assert launches[0][1] == 1 * 2 * 17 * 16  # 16-row blocks


# ------------------------------------------------------------------ CUDA (GPU)


def _each_layout(check):
    """Run ``check`` once per layout (hypothesis tests cannot take fixtures)."""
    saved = attention.tensor_layout()
    try:
        for layout in tensor_attention.LAYOUTS.values():
            attention.TENSOR_LAYOUT = layout
            check()
    finally:
        attention.TENSOR_LAYOUT = saved


@pytest.mark.cuda
@cuda
@settings(max_examples=80, deadline=None)
@given(case=served_cases())
def test_cuda_tensor_form_matches_oracle_and_reference(case: Case) -> None:
    _each_layout(lambda: _matches_oracle_and_reference(case))


def _matches_oracle_and_reference(case: Case) -> None:
    layout = attention.tensor_layout()
    assert tensor_attention.tensor_serves(
        case.dim, case.chunk, case.dtype, "cuda", layout
    )
    assert_kernel_near_oracle_and_reference(case)


@pytest.mark.cuda
@cuda
@settings(max_examples=40, deadline=None)
@given(case=served_cases(allow_non_causal=False).filter(lambda c: c.block == c.queries))
def test_cuda_tensor_form_is_batch_invariant(case: Case) -> None:
    _each_layout(lambda: assert_batch_invariant(case, True))


@pytest.mark.cuda
@cuda
@settings(max_examples=25, deadline=None)
@given(served_cases(), st.integers(1, 200))
def test_cuda_tensor_form_does_not_see_the_seam(case: Case, turn: int) -> None:
    _each_layout(lambda: assert_seamless(case, turn, True))


@pytest.mark.cuda
@cuda
@pytest.mark.parametrize("ring", [True, False])
def test_cuda_tensor_form_at_glimmer_shapes(ring: bool, layout) -> None:
    case = glimmer_case(ring)
    built = build(case)
    assert close_to_oracle(built, built.attend(True))
    assert_batch_invariant(case, True)


@pytest.mark.cuda
@cuda
@settings(max_examples=40, deadline=None)
@given(case=served_cases())
def test_cuda_scalar_body_still_matches_the_oracle(case: Case) -> None:
    saved = attention.TENSOR_CORES
    attention.TENSOR_CORES = False
    try:
        built = build(case)
        assert close_to_oracle(built, built.attend(True)), case
    finally:
        attention.TENSOR_CORES = saved


# The kernels whose `cuda` tests passed on the H200, by the session that ran their text
# (docs/benchmarks/). A spec's name hashes its header and body, so any edit to a body
# changes it: then run the `cuda` tests on a GPU again and record the new names here
# (README "What ran where" must stay true).
RAN_ON_THE_H200 = {
    # Session 21 (docs/benchmarks/h200-2026-12-02-s21, calls E-F): the residual norm
    # (10 `cuda` tests, mlx's bits; opt-in). Call G: the gated fold (3 `cuda` tests,
    # mlx's sigmoid and multiply bits; 8 full-size layers bit-equal to the ungated).
    "dflash_residual_norm_2b66ef2ad0",
    # (Its text then: dflash_fold_gated_e567aac492; changed in session 40, below.)
    # Session 22 (docs/benchmarks/h200-2026-12-02-s22, call B): head prep that also
    # writes the stacked K/V block (20 `cuda` tests, mlx's bits and the stack's; 8
    # full-size layers bit-equal to the unstacked).
    "dflash_head_prep_01ffae6b5c",
    # Session 20 (docs/benchmarks/h200-2026-12-02-s20, calls H-I): both attention layouts
    # read (B, S, Hq, D) queries (32 `cuda` attention tests, 92 route tests); the opt-in
    # matmul forms, one K group and the folded offset, through the 42 `cuda` matmul tests
    # each with their switch set. Calls J-L: head prep (15 `cuda` tests, mlx's bits;
    # its text has changed since, see session 22).
    "dflash_attend_chunks_stream128_f6bed75984",
    "dflash_attend_chunks_split128_56623e56c5",
    # (The one-K-group and folded matmul forms' texts then changed in session 43, below.)
    # Session 19 (call D: 32 `cuda` attention tests, 42 `cuda` matmul tests, the route's
    # tests, all with the default switches): the fold stores (B, S, Hq, D); the matmul
    # forms take member edges (the member-major store of fused siblings).
    # (Its text then: dflash_fold_chunks_c01c9dc4da; changed in session 40, below.)
    "dflash_tensor_split_sum_4ed96840a0",
    # (The two-K-group matmul forms' texts then changed in session 43, below.)
}
# Forms whose text changed, or new forms, that have not run on a GPU. A form
# listed here must be named in the README's "What ran where".
NOT_RUN_SINCE_CHANGED: set = set()
# Session 57 (an H100, docs/benchmarks/h100-2026-12-06-s57, call 1): the residual norm's
# CUDA form copies whole 16-byte vectors (its 10 `cuda` tests, mlx's bits; the traced
# layers with it, 2, bit-equal to the traced layers without it).
RAN_ON_THE_H200.discard("dflash_residual_norm_2b66ef2ad0")
RAN_ON_THE_H200.add("dflash_residual_norm_2ff67c66d1")
# Session 58 (an H100, docs/benchmarks/h100-2026-12-06-s58, call 1): the residual
# norm's warps sum by xor shuffles and its epsilons load with its params (its 10 `cuda`
# tests, mlx's bits; the traced layers with it and the hand-off, 2, bit-equal to the
# traced layers without it).
RAN_ON_THE_H200.discard("dflash_residual_norm_2ff67c66d1")
RAN_ON_THE_H200.add("dflash_residual_norm_a0ca420760")
# Session 30 (docs/benchmarks/h200-2026-12-03-s30): call A, the pair layout; call C, the
# wide layout (each: the 11 `cuda` attention tests with the layouts in turn, hypothesis
# over oracle, batch invariance and seam included); call D, the kernel patch's bitwise
# plain / classic / DFlash agreement with DFLASH_TENSOR_LAYOUT=wide (9 passed).
RAN_ON_THE_H200 |= {
    "dflash_attend_chunks_pair128_46ceffda7a",
    # (Its text then: dflash_attend_chunks_wide128_abf31eb030; changed in session 40.)
}
# The matmul forms' history: session 23 (docs/benchmarks/h200-2026-12-02-s23) ran the
# SwiGLU forms, sessions 28-29 (h200-2026-12-03-s28, -s29) the scaled forms; the one-K-
# group SwiGLU scaled forms had never run. Session 43 (h200-2026-12-04-s43) changed the
# merge of every form (every split's load of an output in flight, then added in split
# order: the same bits) and so renamed them all, and ran each: call B the matmul's
# `cuda` tests with the default switches (75), each of the 24 scaled kernels once, and
# with the scaled form off for two K groups, one K group and the folded offset (54
# each), test_verify_kernels' 15; call C the gated-MLP `cuda` tests of the SwiGLU forms,
# scaled and unscaled, with two and one K groups (16, 15, 15, 15: the one-K-group scaled
# forms for the first time), the 16 bitwise kernel-patch tests, the traced layers' 2,
# and 624 of 624 cases bit-identical to the loop merge the texts had before. The set is
# computed, so the names as they ran are pinned by a digest in the test below.
# Session 49 (docs/benchmarks/h100-2026-12-05-s49, call A, on an H100) made the vector
# merge the default, which renamed every form but the split sum, and ran the `cuda`
# tests with the default switches (and DFLASH_QMM_DENORMAL_Q4=1) in parallel
# processes: the matmul's (every scaled kernel of one and two K groups, the dense and scaled forms on every Glimmer shape,
# member-major, leading shapes, the merged split), the scaled SwiGLU forms' 16, the
# cluster form's, test_verify_kernels', the traced layers', the wired cache's and the
# 20 bitwise kernel-patch tests: 238 passed, and none failed but the denormal decode's
# own test (its fixture's unit-normal weights had scales past the decode's limit; an
# opt-in form). The forms those switches launch are the ones recorded as run; the
# opt-in forms they do not launch (unscaled affine, folded offset, one-K-group dense,
# unscaled and one-K-group SwiGLU) ran with the merge before (session 43) and wait for
# a GPU with the vector merge's texts.
# Session 51 (docs/benchmarks/h100-2026-12-05-s51, on an H100) made the denormal decode
# the default. Its form for up to 16 rows, two K groups and groups of 64 (the one a
# Glimmer 4-bit verify and decode step take) ran in this text in whole DFlash rounds
# at full size (sessions 49 and 51, five processes, lossless, our plain output equal to
# mlx-lm's); its other forms ran only in the paired-stage / lean-issue texts (call E:
# the denormal decode's own `cuda` test, 1 / 16 / 32 rows on every Glimmer shape), so
# they stay recorded as not run in this text. Call F ran the opt-in forms (unscaled,
# folded offset, one K group, unscaled SwiGLU) with the vector merge, also in the
# paired-stage / lean-issue texts.
# Session 52 (docs/benchmarks/h100-2026-12-05-s52, call K, on an H100) ran the denormal
# decode's own `cuda` test and its pairs-in-place cases in this text (paired stage and
# lean issue off), with two K groups and with one (DFLASH_QMM_TWO_K_GROUPS=0): 1 / 16 /
# 32 rows on every Glimmer shape (groups of 64), so both forms' one- and two-m-tile
# kernels of one and two K groups ran (38 and 30 passed), then made the pairs in place
# the default. Their forms for groups of 32 and 128 are emulated only.
# Session 54 (docs/benchmarks/h100-2026-12-05-s54, on an H100) made chunk-major scales
# the default, which renamed every scaled 4-bit form (the 8-bit ones keep their text).
# In that text: call Z1 (the switch set) the denormal decode's own test and the leading
# shapes (38 passed), the matmul on every Glimmer shape (29), the bitwise kernel-patch
# tests (5), every call of matmul_variants bit-identical to the row-major form, and
# whole rounds lossless (Z2); call Z3 (the default) the matmul's hypothesis, batch-
# invariance, merged-split, unaligned and member-major tests and each of the 24 scaled
# kernels (44 passed before its time limit, none failed); call Z4 the scaled SwiGLU
# forms at every group size (15). The denormal decode's forms ran with two K groups
# only in this text; session 55 (docs/benchmarks/h100-2026-12-05-s55, call A, file
# a5) ran its own `cuda` test with one K group (DFLASH_QMM_TWO_K_GROUPS=0) in this
# text: 30 passed, so both forms' one-K-group kernels of one and two m-tiles ran too.
# Session 56 (docs/benchmarks/h100-2026-12-05-s56, on an H100) made interleaved scales
# the default, which renamed the scaled 4-bit forms of groups of 64 and 128. In that
# text (the switch set for each process): every scaled kernel once, and the scaled
# form on every Glimmer shape (a3, 25), the matmul on every Glimmer shape (a2, 29), the
# bitwise kernel-patch tests (a4, 5), the traced layers (a5, 2), the denormal decode's
# own test and the leading shapes with two K groups (call 7, 38; the first run, a1,
# failed at the test's name check, before any bits), the matmul's other `cuda` tests
# (call 8: 37), test_verify_kernels' (15), the gated MLP's and fused projections' (16);
# session 55 (call A, a4) the scaled SwiGLU forms at every group size (15). The denormal
# decode's one-K-group forms have not run in this text: recorded as not run.
# Session 57 (h100-2026-12-06-s57, A/a3): the one-K-group forms too, interleaved
# (the denormal test with DFLASH_QMM_TWO_K_GROUPS=0: 30 passed).
# Session 71 (docs/benchmarks/h100-2026-12-07-s71, call V, on an H100) made the lean
# byte decode the 8-bit default, which renamed every 8-bit form but SwiGLU's
# (``_lbytes``). In that text: its own `cuda` test (30 passed: every Glimmer shape, 1 /
# 16 / 32 rows, unscaled and scaled, groups of 64, two K groups, so both m-tiles) and
# whole 8-bit rounds, lossless. Its forms of groups of 32 and 128 and of one K group
# are emulated and compiled only: recorded as not run. Session 74
# (docs/benchmarks/h100-2026-12-07-s74, an H100) ran those of groups of 32 / 128 with two
# K groups in whole rounds (lossless) and plain decoding (our 64 tokens equal to
# mlx-lm's), which made them default. Session 75 (docs/benchmarks/h100-2026-12-07-s75,
# T/, an H100) ran their own `cuda` test in this text with graphs off: every 8-bit
# Glimmer projection, 1 / 16 / 32 rows, unscaled and scaled, groups of 32, 64 and 128
# (90 passed: the lean forms launched, the float32 decode's bits, row 0's batch bits).
# Their one-K-group forms are still emulated and compiled only.
# Session 76 found the denormal forms of groups of 32 / 128 unrecorded: default for a
# trained 4-bit target in those groups since session 74 (the scale target's scales take
# them too, so they ran inside its rounds and loops), but their own `cuda` test had run
# only at groups of 64. Parametrized by group size, it then ran on an H100
# (docs/benchmarks/h100-2026-12-07-s76, U/, graphs off): every 4-bit Glimmer projection,
# 1 / 16 / 32 rows, pairs in place or not, groups of 32, 64 and 128, 90 passed (the
# denormal forms launched, the scaled form's bits, row 0's batch bits). Two K groups;
# their one-K-group forms at groups of 32 / 128 are emulated and compiled only.
_DENORMAL_RAN = [(k, (4, m), 64) for k in (1, 2) for m in (1, 2)] + [
    (2, (4, m), group) for m in (1, 2) for group in (32, 128)
]
_LEAN_BYTES_RAN = [
    tensor_qmm.SCALED_SPECS[(2, (8, m), group)]
    for m in (1, 2)
    for group in (32, 64, 128)
] + [tensor_qmm.K2_SPECS[(8, m)] for m in (1, 2)]
_DEFAULT_LAUNCHED = (
    [tensor_qmm.K2_SPECS[(0, 1)], tensor_qmm.K2_SPECS[(0, 2)]]
    + [s for s in tensor_qmm.SCALED_SPECS.values() if "_lbytes" not in s.base]
    + _LEAN_BYTES_RAN
    + [s for k, s in tensor_qmm.SWIGLU_SCALED_SPECS.items() if k[0] == 2]
    + [tensor_qmm.DENORMAL_SPECS[key] for key in _DENORMAL_RAN]
    + [tensor_qmm.IN_PLACE_SPECS[key] for key in _DENORMAL_RAN]
)
MATMUL_RAN = {spec.name("cuda") for spec in _DEFAULT_LAUNCHED}
# Session 75: the lean 8-bit forms of two K groups at every group size. Session 76: the
# denormal 4-bit forms of two K groups at groups of 32 and 128.
RAN_DIGESTS = {"matmul": "b69775237fc72c55"}
RAN_ON_THE_H200 |= MATMUL_RAN
NOT_RUN_SINCE_CHANGED |= (
    {spec.name("cuda") for spec in tensor_qmm.SPECS}
    - MATMUL_RAN
    - {tensor_qmm.REDUCE_SPEC.name("cuda")}
)

# Session 40 (docs/benchmarks/h200-2026-12-04-s40): the fold holds up to FOLD_HELD
# chunks' loads in registers, more in batches (same arithmetic, same order); the wide
# layout stores a row's chunk state two floats at a time. Call D: the 15 `cuda` tests of
# test_verify_kernels (the held fold's bits equal to the loops' among them), the 12 of
# this file, the traced layers' 2 and the kernel patch's bitwise plain / classic /
# DFlash agreement (15 passed); calls E-G: full-size loops lossless.
RAN_ON_THE_H200 |= {
    attention.FOLD_CHUNKS.name("cuda"),
    "dflash_fold_gated_3e95804992",
    tensor_attention.attend_spec(128, tensor_attention.WIDE).name("cuda"),
}
# Session 62 (an H100, docs/benchmarks/h100-2026-12-06-s62, T/): the head prep reads
# q, k and v at element offsets (its params 11 ints) and the gated fold its gate at one
# (fold_params' sixth), so that a traced layer hands them the fused q / k / v / gate
# output whole. In these texts: the head prep's and the offsets' `cuda` tests (43,
# mlx's bits and the copied arrays' bits), the traced layers' (4, the eager bits at
# Glimmer's width) and the folds' (5).
RAN_ON_THE_H200 -= {"dflash_head_prep_01ffae6b5c", "dflash_fold_gated_3e95804992"}
RAN_ON_THE_H200 |= {"dflash_head_prep_f571d7ee08", "dflash_fold_gated_9673575981"}
# Session 66 (an H100, docs/benchmarks/h100-2026-12-06-s66, S/): the chunk passes over
# stacked planes and blocks (DFLASH_STACKED_KV, on since), new texts. Their `cuda` tests:
# the stacked calls' bits equal to the halves' (60 cases each under the four layouts, the
# scalar form in the float32 cases), the traced layers over stacked planes against the
# eager layers over the halves (Glimmer's width and head-128 wrapping rings: 2).
RAN_ON_THE_H200 |= {
    tensor_attention.attend_spec(128, layout, True).name("cuda")
    for layout in tensor_attention.LAYOUTS.values()
}


def names_digest(names: set) -> str:
    """A short digest of a set of kernel names (each hashes its own text)."""
    return hashlib.sha256("\n".join(sorted(names)).encode()).hexdigest()[:16]


def test_the_shipped_tensor_kernels_are_the_ones_run_on_the_h200() -> None:
    # The computed sets are the texts that ran: a changed text changes its digest.
    assert names_digest(MATMUL_RAN) == RAN_DIGESTS["matmul"]
    shipped = {
        tensor_attention.attend_spec(128, layout, stacked).name("cuda")
        for layout in tensor_attention.LAYOUTS.values()
        for stacked in (False, True)
    }
    shipped.add(attention.FOLD_CHUNKS.name("cuda"))
    shipped.add(attention.FOLD_GATED.name("cuda"))
    shipped.add(heads.HEAD_PREP.name("cuda"))
    shipped.add(norms.RESIDUAL_NORM.name("cuda"))
    shipped.update(spec.name("cuda") for spec in tensor_qmm.SPECS)
    assert shipped == RAN_ON_THE_H200 | NOT_RUN_SINCE_CHANGED
    # Every form the default switches launch ran: dense and scaled, two K groups.
    defaults = {spec.name("cuda") for spec in tensor_qmm.K2_SPECS.values()}
    defaults = {name for name in defaults if "_dense_" in name} | {
        spec.name("cuda")
        for (groups, _, _), spec in tensor_qmm.SCALED_SPECS.items()
        if groups == 2
    }
    assert len(defaults) == 14 and defaults <= RAN_ON_THE_H200
    assert tensor_qmm.K_GROUPS == 2 and tensor_qmm.VECTOR_MERGE
    default_layout = tensor_attention.LAYOUTS[tensor_attention.DEFAULT_LAYOUT]
    for stacked in (False, True):
        spec = tensor_attention.attend_spec(128, default_layout, stacked)
        assert spec.name("cuda") in RAN_ON_THE_H200
    scaled = {spec.name("cuda") for spec in tensor_qmm.SCALED_SPECS.values()}
    assert tensor_qmm.SCALED_B and tensor_qmm.LEAN_BYTES
    # Every scaled form ran but the lean 8-bit ones of one K group (no default takes).
    assert all(
        name.startswith("dflash_tensor_q8_")
        and "_lbytes" in name
        and "_k2_" not in name
        for name in scaled - RAN_ON_THE_H200
    )
    # The forms a Glimmer 4-bit verify or decode step takes by default ran in their
    # text: the pairs in place where its scales allow, else the denormal decode, at
    # every group size (two K groups, both m-tiles; session 76 for groups of 32 / 128).
    assert tensor_qmm.DENORMAL_Q4 and tensor_qmm.DENORMAL_IN_PLACE
    assert not tensor_qmm.PAIRED_STAGE
    for table in (tensor_qmm.DENORMAL_SPECS, tensor_qmm.IN_PLACE_SPECS):
        for (k_groups, _, _), spec in table.items():
            assert k_groups == 1 or spec.name("cuda") in RAN_ON_THE_H200, spec.base
    assert not tensor_qmm.FOLD_Q4_OFFSET
