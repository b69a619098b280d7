"""Verify kernels: small-query attention over the planes (reference, Metal body, CUDA twin).

What is proven where:

* CPU (CI): the pure-MLX reference against a float64 softmax oracle over random
  shapes, dtypes, ring rotations and fill levels, windows, growing planes and query
  counts; the reference is batch-invariant bit for bit (a verify call vs each query
  alone with the plane advanced, the block held back or already written) and does
  not see the ring's seam; a window off by one fails the oracle (negative control);
  bad arguments raise before anything runs.
* Metal: the body compiles (g++ against a Metal shim, ``-Werror``) inside the
  signature mlx generates, and runs on the CPU (threadgroups as coroutines) through
  the public wrapper: close to the reference, and batch-invariant bit for bit.
* CUDA: the twin compiles to PTX (nvcc, when installed). Tests marked ``cuda`` run it
  on an NVIDIA GPU: against the oracle and the reference, batch-invariant and
  seam-blind bit for bit, at Muse Glimmer's shapes too.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import dataclasses
import functools
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support.attention_cases import (
    TOLERANCE,
    Case,
    bits,
    build,
    cases,
    close_to_oracle,
    one_query_routes,
    stacked,
)
from support.compilers import GXX, NVCC, built_emulator, needs_gxx, needs_nvcc
from support.group_emulator import GroupEmulator, check_cuda, check_metal

from dflash.metal import attention, backend, groups
from dflash.metal.attention import KeyPlane, small_query_attention

cuda = pytest.mark.skipif(not mx.cuda.is_available(), reason="needs mlx's CUDA backend")


def _verify_cases(**kwargs):
    """Verify-shaped cases (the block holds every query), causal."""
    return cases(allow_non_causal=False, **kwargs).filter(
        lambda c: c.block == c.queries
    )


def assert_batch_invariant(case: Case, use_kernel) -> None:
    """Every row of a verify call equals, bit for bit, that query run alone later."""
    built = build(case)
    together = built.attend(use_kernel)
    for index in range(case.queries):
        for name, route in one_query_routes(built, index).items():
            alone = route.attend(use_kernel)
            want = bits(together[:, :, index : index + 1])
            assert np.array_equal(bits(alone), want), (name, index, case)


def assert_stacked_gives_the_halves_bits(case: Case, use_kernel) -> mx.array:
    """The plane and the block stacked, each bound whole as keys and values, give the
    bits of their halves given apart (returns the stacked call's output)."""
    built = build(case)
    together = stacked(built)
    plan = attention.make_plan(
        together.queries, together.plane, together.block_keys, together.block_values,
        window=case.window, causal=case.causal, query_start=None, chunk=case.chunk,
    )  # fmt: skip
    assert plan.plane_stacked and plan.block_stacked == (case.block > 0)
    out = together.attend(use_kernel)
    assert np.array_equal(bits(out), bits(built.attend(use_kernel))), case
    return out


def assert_near_reference(built, kernel: mx.array) -> None:
    """``kernel`` is within the dtype's tolerance of the reference route's output."""
    got = np.asarray(kernel.astype(mx.float32))
    want = np.asarray(built.attend(False).astype(mx.float32))
    tolerance = TOLERANCE[built.case.dtype] * (1 + np.abs(want))
    assert np.all(np.abs(got - want) <= tolerance), built.case


def assert_kernel_near_oracle_and_reference(case: Case) -> None:
    """The kernel form is within tolerance of the float64 oracle and of the reference."""
    built = build(case)
    kernel = built.attend(True)
    assert close_to_oracle(built, kernel), case
    with mx.stream(mx.cpu):
        assert_near_reference(built, kernel)


def assert_seamless(case: Case, turn: int, use_kernel) -> None:
    """The same logical rows with the ring turned by ``turn`` give the same bits."""
    origin = (case.origin_physical + turn) % case.capacity
    rotated = build(dataclasses.replace(case, origin_physical=origin))
    want = bits(build(case).attend(use_kernel))
    assert np.array_equal(want, bits(rotated.attend(use_kernel)))


# ------------------------------------------------------------- reference (CPU)


@settings(max_examples=80, deadline=None)
@given(cases())
def test_reference_matches_float_oracle(case: Case) -> None:
    built = build(case)
    assert close_to_oracle(built, built.attend(False)), case


@settings(max_examples=40, deadline=None)
@given(_verify_cases(max_queries=20))
def test_reference_is_batch_invariant(case: Case) -> None:
    assert_batch_invariant(case, False)


@settings(max_examples=30, deadline=None)
@given(cases(), st.integers(1, 200))
def test_reference_does_not_see_the_seam(case: Case, turn: int) -> None:
    """The same logical rows at another rotation give the same bits."""
    assert_seamless(case, turn, False)


@pytest.mark.parametrize("shift", [-1, 1])
@pytest.mark.parametrize("seed", range(4))
def test_window_off_by_one_fails_the_oracle(shift: int, seed: int) -> None:
    """Negative control: the oracle tells a window one key too wide or narrow apart."""
    case = Case(
        batch=1, kv_heads=2, group=2, dim=32, dtype=mx.float32, ring=True, capacity=12,
        history=40, block=6, queries=6, origin_physical=5, window=12, causal=True,
        softcap=None, chunk=4, seed=seed,
    )  # fmt: skip
    built = build(case)
    out = built.attend(False)
    assert close_to_oracle(built, out)
    assert not close_to_oracle(built, out, window=case.window + shift)


def test_chunk_changes_bits_not_values() -> None:
    """Different chunk sizes are different (fixed) orders: close, each invariant."""
    case = Case(
        1, 2, 4, 64, mx.float32, True, 64, 300, 16, 16, 7, 64, True, None, 16, 3
    )
    built = build(case)
    small = built.attend(False, chunk=4)
    large = built.attend(False, chunk=256)
    assert close_to_oracle(built, small) and close_to_oracle(built, large)


def _plane(c=8, d=16, dtype=mx.float32):
    return KeyPlane(
        mx.zeros((1, 2, c, d), dtype), mx.zeros((1, 2, c, d), dtype), 4, 10, 3
    )


_Q = mx.zeros((1, 4, 2, 16))
_BK = mx.zeros((1, 2, 2, 16))
_KV = mx.zeros((2, 1, 2, 8, 16))


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda: small_query_attention(_Q[0], _plane(), scale=1.0), "queries must be"),
        (lambda: small_query_attention(_Q, _plane(d=8), scale=1.0), "does not fit"),
        (
            lambda: small_query_attention(_Q.astype(mx.int32), _plane(), scale=1.0),
            "dtype",
        ),
        (
            lambda: small_query_attention(_Q, _plane(dtype=mx.float16), scale=1.0),
            "float16",
        ),
        (
            lambda: small_query_attention(mx.zeros((1, 3, 2, 16)), _plane(), scale=1.0),
            "multiple",
        ),
        (lambda: small_query_attention(_Q, _plane(), _BK, scale=1.0), "together"),
        (
            lambda: small_query_attention(_Q, _plane(), _BK, _BK[:, :1], scale=1.0),
            "shape",
        ),
        (
            lambda: small_query_attention(
                _Q, KeyPlane(_KV, _KV[0], 4, 10, 3), scale=1.0
            ),
            "must be one",
        ),
        (
            lambda: small_query_attention(
                _Q,
                KeyPlane(mx.zeros((3, 1, 2, 8, 16)), mx.zeros((3, 1, 2, 8, 16)), 4),
                scale=1.0,
            ),
            "stacked",
        ),
        (
            lambda: small_query_attention(
                _Q, _plane(), mx.stack([_BK, _BK]), _BK, scale=1.0
            ),
            "block_values must have shape",
        ),
        (lambda: small_query_attention(_Q, _plane(), scale=float("nan")), "scale"),
        (
            lambda: small_query_attention(_Q, _plane(), scale=1.0, softcap=-1.0),
            "softcap",
        ),
        (lambda: small_query_attention(_Q, _plane(), scale=1.0, window=0), "window"),
        (lambda: small_query_attention(_Q, _plane(), scale=1.0, chunk=0), "chunk"),
        (
            lambda: small_query_attention(
                _Q, dataclasses.replace(_plane(), length=9), scale=1.0
            ),
            "exceeds",
        ),
        (
            lambda: small_query_attention(
                _Q, dataclasses.replace(_plane(), origin_physical=8), scale=1.0
            ),
            "origin_physical",
        ),
        (
            lambda: small_query_attention(_Q, _plane(), scale=1.0, query_start=13),
            "end at 13",
        ),
        # No window: the query needs every key from 0, but the plane starts at 10.
        (lambda: small_query_attention(_Q, _plane(), scale=1.0), "oldest live row"),
        (
            lambda: small_query_attention(_Q, _plane(), scale=1.0, window=4),
            "oldest live row",
        ),
    ],
)
def test_bad_arguments_raise(call, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        call()
    with pytest.raises(ValueError, match=message):  # a refusal is never memoised
        call()


def test_the_kernel_serves_only_containers_its_32_bit_indices_hold() -> None:
    """A plane or block past int32 elements (a stacked half: the values' offset)
    takes the reference, and the kernel form refuses it by name."""
    plan = attention.make_plan(
        _Q, _plane(), None, None, window=2, causal=True, query_start=12, chunk=256
    )
    assert attention.kernel_serves(plan)
    rows = (attention.MAX_LAUNCH_WORDS // (2 * 16)) + 1
    for field in ("capacity", "block"):
        huge = dataclasses.replace(plan, **{field: rows})
        assert attention.container_words(huge) > attention.MAX_LAUNCH_WORDS
        assert not attention.kernel_serves(huge)
        with pytest.raises(ValueError, match="containers of at most"):
            attention.kernel_form(huge, mx.float32, False)


def test_memoised_plans_keep_every_check() -> None:
    """A plan is looked up by geometry; an integer of another type is checked afresh
    (a bool equal to a cached int is still refused), a numpy int gets the same plan."""
    plane = _plane()
    plan = attention.make_plan(
        _Q, plane, None, None, window=2, causal=True, query_start=None, chunk=256
    )
    again = attention.make_plan(
        _Q, _plane(), None, None, window=2, causal=True, query_start=None, chunk=256
    )
    assert again is plan
    numpy_int = attention.make_plan(
        _Q, plane, None, None, window=np.int64(2), causal=True, query_start=None,
        chunk=256,
    )  # fmt: skip
    assert numpy_int == plan
    attention.make_plan(
        _Q, plane, None, None, window=2, causal=True, query_start=None, chunk=1
    )
    with pytest.raises(ValueError, match="chunk must be an int"):
        attention.make_plan(
            _Q, plane, None, None, window=2, causal=True, query_start=None, chunk=True
        )
    other = attention.make_plan(
        _Q, plane, None, None, window=2, causal=False, query_start=None, chunk=256
    )
    assert other != plan and not other.causal


def test_use_kernel_true_without_gpu_raises(monkeypatch) -> None:
    monkeypatch.setattr(backend, "BACKEND", None)
    with pytest.raises(RuntimeError, match="use_kernel=True"):
        small_query_attention(_Q, _plane(), scale=1.0, window=3, use_kernel=True)


def test_default_on_cpu_is_the_reference(monkeypatch) -> None:
    calls = []
    monkeypatch.setattr(groups, "launch_groups", lambda *a, **k: calls.append(a))
    case = Case(1, 1, 2, 16, mx.float32, True, 8, 20, 3, 3, 2, 8, True, None, 4, 0)
    built = build(case)
    if backend.BACKEND is None or not backend.gpu_is_default():
        built.attend(None)
        assert calls == []


# ------------------------------------------------------------- Metal, on the CPU


def _broken():
    body = attention.ATTEND_CHUNKS.body.replace(
        "scores[r][k] = w;", "scores[r][k] = ww;"
    )
    assert body != attention.ATTEND_CHUNKS.body
    return dataclasses.replace(attention.ATTEND_CHUNKS, body=body)


@needs_gxx
def test_broken_body_fails_the_metal_check(tmp_path: Path) -> None:
    assert not check_metal([_broken()], tmp_path, GXX).ok


@needs_nvcc
def test_broken_body_fails_the_cuda_check(tmp_path: Path) -> None:
    assert not check_cuda([_broken()], tmp_path, NVCC).ok


def test_backends_share_one_body() -> None:
    for spec in attention.SPECS:
        for name in ("metal", "cuda"):
            assert spec.source(name) == groups.PROLOGUES[name] + spec.body
            assert spec.header(name) == groups.HEADERS[name] + spec.helpers
    # Prologues name the thread and group index only; headers hold macros only.
    for prologue in groups.PROLOGUES.values():
        assert prologue.count(";") == 2 and "params" not in prologue
    for header in groups.HEADERS.values():
        assert all(line.startswith("#define") for line in header.strip().splitlines())


def _route_groups(monkeypatch, emulator: GroupEmulator) -> GroupEmulator:
    """Route the wrappers' threadgroup kernel paths through the emulated Metal bodies."""
    monkeypatch.setattr(backend, "BACKEND", "metal")
    monkeypatch.setattr(groups, "launch_groups", emulator.launch)
    return emulator


@pytest.fixture(scope="module")
def emulator(tmp_path_factory):
    return built_emulator(
        GroupEmulator, tmp_path_factory, "group_emulator", attention.SPECS
    )


@pytest.fixture
def metal_on_cpu(emulator, monkeypatch):
    return _route_groups(monkeypatch, emulator)


_SMALL = dict(dims=(16, 24, 64, 128), chunks=(3, 16, 64, 256))
# The emulator fixture is shared on purpose: it only swaps the launch function.
_SHARED = [HealthCheck.function_scoped_fixture]


@settings(max_examples=25, deadline=None, suppress_health_check=_SHARED)
@given(case=cases(max_queries=12, **_SMALL))
def test_metal_body_matches_reference(metal_on_cpu, case: Case) -> None:
    built = build(case)
    before = metal_on_cpu.launches
    kernel = built.attend(True)
    assert metal_on_cpu.launches == before + 2
    assert_near_reference(built, kernel)
    assert close_to_oracle(built, kernel), case


@settings(max_examples=12, deadline=None, suppress_health_check=_SHARED)
@given(case=_verify_cases(max_queries=8, **_SMALL))
def test_metal_body_is_batch_invariant(metal_on_cpu, case: Case) -> None:
    assert_batch_invariant(case, True)


# Windows whose start crosses chunk boundaries inside the block, negative scores: the
# verify call folds chunks that some of its queries do not see; each must be skipped
# exactly (a rescale by a chunk's max of 0 would change bits, not values).
_CROSSING = [
    Case(1, 2, 2, 16, dtype, True, 10, 57, 8, 8, 4, 10, True, None, 4, seed, skew=1.5)
    for seed, dtype in enumerate((mx.float32, mx.bfloat16, mx.float16))
]


@settings(max_examples=30, deadline=None)
@given(case=cases(max_queries=12))
def test_reference_reads_stacked_planes_and_blocks_as_their_halves(case: Case) -> None:
    assert_stacked_gives_the_halves_bits(case, False)


@settings(max_examples=20, deadline=None, suppress_health_check=_SHARED)
@given(case=cases(max_queries=8, **_SMALL))
def test_metal_body_reads_stacked_planes_and_blocks_as_their_halves(
    metal_on_cpu, case: Case
) -> None:
    before = len(metal_on_cpu.launched)
    assert_stacked_gives_the_halves_bits(case, True)
    passes = [attention.ATTEND_CHUNKS_STACKED.base, attention.ATTEND_CHUNKS.base]
    assert metal_on_cpu.launched[before:][::2] == passes


@pytest.mark.parametrize("wrong", ["plane", "block"])
def test_a_stacked_pass_reading_values_at_the_wrong_offset_fails(
    metal_on_cpu, monkeypatch, wrong: str
) -> None:
    """Negative control: with the plane's (the block's) values read from element 0
    of its buffer, which holds the keys, the bits are not the halves'."""
    case = Case(1, 2, 2, 16, mx.float32, True, 24, 60, 6, 6, 5, 20, True, None, 16, 3)
    built = build(case)
    want = bits(built.attend(True))
    right = attention.value_offsets

    def offsets(plan):
        plane, block = right(plan)
        return (0, block) if wrong == "plane" else (plane, 0)

    monkeypatch.setattr(attention, "value_offsets", offsets)
    attention._launch.cache_clear()
    try:
        got = bits(stacked(built).attend(True))
    finally:
        attention._launch.cache_clear()
    assert not np.array_equal(got, want)


def test_the_route_binding_planes_stacked_keeps_every_tokens_bits(metal_on_cpu) -> None:
    """End to end through the emulated Metal body: our plain and DFlash decoding with
    the planes and held-back blocks bound stacked (``stacked_kv``) give every token
    the logits they give with the halves bound apart."""
    from conftest import tiny_model
    from test_dflash_loop import random_drafter

    from dflash import dflash_generate_step
    from dflash.generation import generate_step
    from dflash.kernel_patch import KernelPatch

    target = tiny_model("muse_glimmer", seed=1, window=16)
    target.set_dtype(mx.bfloat16)
    drafter = random_drafter(target, seed=11, block_size=8)
    drafter.set_dtype(mx.bfloat16)
    prompt = mx.random.randint(0, 250, (19,), key=mx.random.key(5))
    runs = {}
    for stacked_kv in (False, True):
        before = len(metal_on_cpu.launched)
        options = dict(use_kernel=True, matmul=False, head_prep=False)
        with KernelPatch(target, drafter, stacked_kv=stacked_kv, **options):
            plain = [bits(y) for _, y in generate_step(prompt, target, max_tokens=24)]
            spec = dflash_generate_step(prompt, target, drafter, max_tokens=24)
            runs[stacked_kv] = plain, [bits(y) for _, y, _ in spec]
        passes = set(metal_on_cpu.launched[before:])
        stacked_pass = attention.ATTEND_CHUNKS_STACKED.base
        # (The drafter's context and a staged chunk are not planes: separate arrays.)
        assert (stacked_pass in passes) is stacked_kv
    logits = [rows for run in runs.values() for rows in run]
    assert all(len(rows) == 24 for rows in logits)
    for rows in logits[1:]:
        assert all(np.array_equal(a, b) for a, b in zip(rows, logits[0]))


@pytest.mark.parametrize("case", _CROSSING)
def test_reference_batch_invariant_across_chunk_edges(case: Case) -> None:
    assert_batch_invariant(case, False)


@pytest.mark.parametrize("case", _CROSSING)
def test_metal_body_batch_invariant_across_chunk_edges(
    metal_on_cpu, case: Case
) -> None:
    assert_batch_invariant(case, True)


def test_metal_body_sees_no_dead_row(metal_on_cpu) -> None:
    """Dead ring rows hold NaN: a read of one would poison the output."""
    case = Case(2, 2, 4, 32, mx.bfloat16, True, 24, 100, 9, 9, 17, 20, True, 5.0, 8, 5)
    built = build(case)
    out = built.attend(True)
    assert not np.isnan(np.asarray(out.astype(mx.float32))).any()
    assert close_to_oracle(built, out)


# ------------------------------------------------------------------ the gated fold


def _gate_for(built) -> mx.array:
    """A gate of the output's (B, S, Hq * D) layout, spanning the sigmoid's range."""
    c = built.case
    batch, heads, count, dim = built.queries.shape
    gate = 4.0 * mx.random.normal(
        (batch, count, heads * dim), key=mx.random.key(c.seed)
    )
    return gate.astype(c.dtype)


@functools.lru_cache(maxsize=None)
def _libm_expf():
    function = ctypes.CDLL(ctypes.util.find_library("m")).expf
    function.restype, function.argtypes = ctypes.c_float, [ctypes.c_float]
    return function


def _metal_gated(out: mx.array, gate: mx.array) -> mx.array:
    """The Metal form's epilogue in NumPy: ``T(T(out) * T(sigmoid(gate)))``, the sigmoid
    as mlx's Metal formula in float32 (libm's expf, what the emulated body calls)."""
    dtype = out.dtype
    batch, heads, count, dim = out.shape
    flat = np.asarray(out.transpose(0, 2, 1, 3).astype(mx.float32)).reshape(-1)
    g = np.asarray(gate.astype(mx.float32)).reshape(-1)
    expf = _libm_expf()
    e = np.array([expf(float(abs(v))) for v in g], np.float32)
    y = (np.float32(1.0) / (np.float32(1.0) + e)).astype(np.float32)
    sig = np.where(g < 0, y, (np.float32(1.0) - y).astype(np.float32))
    sig = np.asarray(mx.array(sig).astype(dtype).astype(mx.float32))
    gated = mx.array((flat * sig).astype(np.float32)).astype(dtype)
    return gated.reshape(batch, count, heads, dim).transpose(0, 2, 1, 3)


@settings(max_examples=25, deadline=None, suppress_health_check=_SHARED)
@given(case=cases(**_SMALL))
def test_metal_gated_fold_is_the_fold_times_the_gates_sigmoid(
    metal_on_cpu, case: Case
) -> None:
    """The gated fold's epilogue on the fold's own output, bit for bit (emulated)."""
    built = build(case)
    gate = _gate_for(built)
    plain = built.attend(True)
    gated = built.attend(True, gate=gate)
    assert np.array_equal(bits(gated), bits(_metal_gated(plain, gate))), case


# Negative control: the gate read in the fold's thread order (b, h, s) instead of the
# output's (b, s, h) layout.
_GATE_MUTANT = dataclasses.replace(
    attention.FOLD_GATED,
    base="fold_gated_thread_order",
    body=attention.FOLD_GATED.body.replace("gate[at]", "gate[gid]"),
)


@pytest.fixture(scope="module")
def gate_mutant_emulator(tmp_path_factory):
    specs = (attention.ATTEND_CHUNKS, attention.FOLD_CHUNKS, _GATE_MUTANT)
    return built_emulator(GroupEmulator, tmp_path_factory, "gate_mutant", specs)


def test_a_gate_read_in_the_wrong_order_fails(
    gate_mutant_emulator, monkeypatch
) -> None:
    _route_groups(monkeypatch, gate_mutant_emulator)
    monkeypatch.setattr(attention, "FOLD_GATED", _GATE_MUTANT)
    case = Case(1, 1, 2, 16, mx.bfloat16, False, 1, 0, 3, 3, 0, None, False, 5.0, 64, 1)
    built = build(case)
    gate = _gate_for(built)
    got = built.attend(True, gate=gate)
    assert not np.array_equal(bits(got), bits(_metal_gated(built.attend(True), gate)))


# ------------------------------------------------------- the fold's held chunks

# The fold with no chunk held in registers (its loops read memory), and a planted slip
# in the held path: the maximum taken from chunk 1 on, so chunk 0 is weighed against
# the wrong top.
_FOLD_LOOPS = dataclasses.replace(
    attention.FOLD_CHUNKS,
    base="fold_chunks_loops",
    body=attention.FOLD_CHUNKS.body.replace(
        attention.FOLD_CHUNKS_BODY, attention.fold_body(0)
    ),
)
_HELD_TOP = "const bool take = l_u > 0.0f;"
assert attention.FOLD_CHUNKS.body.count(_HELD_TOP) == 2
_FOLD_SKIPS_CHUNK_0 = dataclasses.replace(
    attention.FOLD_CHUNKS,
    base="fold_chunks_skips_0",
    body=attention.FOLD_CHUNKS.body.replace(
        _HELD_TOP, "const bool take = u > 0 && l_u > 0.0f;", 1
    ),
)
_FOLD_SPECS = (attention.FOLD_CHUNKS, _FOLD_LOOPS, _FOLD_SKIPS_CHUNK_0)


@dataclasses.dataclass(frozen=True)
class FoldCase:
    """Chunk partials of ``rows`` query rows: ``chunks`` chunks of ``dim`` each."""

    batch: int
    heads: int
    queries: int
    dim: int
    chunks: int
    dtype: mx.Dtype
    unseen: float
    seed: int


@st.composite
def fold_cases(draw, max_chunks: int = 2 * attention.FOLD_HELD + 8) -> FoldCase:
    return FoldCase(
        batch=draw(st.integers(1, 2)),
        heads=draw(st.integers(1, 4)),
        queries=draw(st.integers(1, 5)),
        dim=draw(st.sampled_from((8, 16, 24, 64))),
        chunks=draw(st.integers(1, max_chunks)),
        dtype=draw(st.sampled_from((mx.float32, mx.bfloat16, mx.float16))),
        unseen=draw(st.sampled_from((0.0, 0.3, 0.9))),
        seed=draw(st.integers(0, 2**16)),
    )


def _fold_inputs(case: FoldCase) -> list:
    """What a chunk pass leaves: per (row, chunk) its maximum and sum (a chunk the row
    does not see: -inf and 0) and weighted values, exact zeros of either sign among
    them; then the fold's scalars."""
    rng = np.random.default_rng(case.seed)
    rows = case.batch * case.heads * case.queries
    shape = (rows, case.chunks)
    unseen = rng.random(shape) < case.unseen
    unseen[:, rng.integers(case.chunks)] = False  # every row sees some chunk
    peak = np.where(unseen, -np.inf, rng.normal(0.0, 4.0, shape)).astype(np.float32)
    total = np.where(unseen, 0.0, rng.uniform(0.5, 20.0, shape)).astype(np.float32)
    values = rng.normal(0.0, 3.0, shape + (case.dim,)).astype(np.float32)
    zeros = rng.random(values.shape) < 0.05
    values[zeros] = np.copysign(0.0, rng.normal(size=int(zeros.sum())))
    stats = np.stack([peak, total], axis=-1)
    total_threads = rows * case.dim
    scalars = groups.int_params(
        total_threads, case.dim, case.chunks, case.heads, case.queries
    )
    return [mx.array(stats), mx.array(values), scalars]


def _fold(launch, spec, case: FoldCase) -> mx.array:
    """One fold launch of ``spec`` over :func:`_fold_inputs` of ``case``."""
    total = case.batch * case.heads * case.queries * case.dim
    (out,) = launch(
        spec,
        _fold_inputs(case),
        [(case.batch, case.queries, case.heads, case.dim)],
        [case.dtype],
        -(-total // attention.THREADS),
        case.dtype,
    )
    mx.eval(out)
    return out


@pytest.fixture(scope="module")
def fold_emulator(tmp_path_factory):
    return built_emulator(GroupEmulator, tmp_path_factory, "fold_held", _FOLD_SPECS)


@settings(max_examples=30, deadline=None, suppress_health_check=_SHARED)
@given(case=fold_cases())
def test_metal_fold_held_chunks_give_the_loops_bits(fold_emulator, case) -> None:
    """Up to FOLD_HELD chunks held in registers, or read in the loops: the same bits."""
    held = _fold(fold_emulator.launch, attention.FOLD_CHUNKS, case)
    loops = _fold(fold_emulator.launch, _FOLD_LOOPS, case)
    assert np.array_equal(bits(held), bits(loops)), case


def test_a_held_fold_that_skips_chunk_0_fails(fold_emulator) -> None:
    """Negative control: the slip changes bits in some of a fixed set of calls."""
    differ = 0
    for seed in range(6):
        case = FoldCase(1, 2, 3, 16, 3 + 5 * seed, mx.float32, 0.3, seed)
        slipped = _fold(fold_emulator.launch, _FOLD_SKIPS_CHUNK_0, case)
        loops = _fold(fold_emulator.launch, _FOLD_LOOPS, case)
        differ += not np.array_equal(bits(slipped), bits(loops))
    assert differ > 0


def test_the_fold_holds_every_verify_call_up_to_8k_keys() -> None:
    """A verify call's chunks over 7,936 keys and its block's chunk are held."""
    assert attention.FOLD_HELD * 256 >= 7936 + 256
    assert "n_chunks <= FOLD_HELD" in attention.FOLD_CHUNKS.body
    assert attention.FOLD_GATED.body.count("held_a[u]") == 2


def _launch_gated(built, gate: mx.array, stored_shape=None) -> mx.array:
    """:func:`attention.launch_attention` of ``built`` as the kernel form runs it."""
    c = built.case
    plan = attention.make_plan(
        built.queries, built.plane, built.block_keys, built.block_values,
        window=c.window, causal=c.causal, query_start=None, chunk=c.chunk,
    )  # fmt: skip
    form = attention.kernel_form(plan, c.dtype, True)
    arrays = attention.bound_arrays(
        plan, built.plane, built.block_keys, built.block_values
    )
    floats = groups.float_params(float(c.scale), float(c.softcap or 0.0))
    out = attention.launch_attention(
        form, built.queries.transpose(0, 2, 1, 3), *arrays, form.launch.ints,
        floats, form.launch.fold_ints, gate, stored_shape,
    )  # fmt: skip
    mx.eval(out)
    return out


def _assert_stored_with_the_heads_merged(case: Case) -> None:
    """The fold's buffer declared ``(B, S, Hq * D)`` (the gate given so) against the
    default call's transposed view, reshaped: the same bits."""
    built = build(case)
    gate = _gate_for(built)
    batch, heads, count, dim = built.queries.shape
    merged = (batch, count, heads * dim)
    plain = _launch_gated(built, gate.reshape(batch, count, heads, dim))
    stored = _launch_gated(built, gate, merged)
    assert stored.shape == merged
    want = plain.transpose(0, 2, 1, 3).reshape(merged)
    assert np.array_equal(bits(stored), bits(want)), case


@settings(max_examples=10, deadline=None, suppress_health_check=_SHARED)
@given(case=cases(max_queries=12, **_SMALL))
def test_metal_fold_stored_with_the_heads_merged_has_the_same_bits(
    metal_on_cpu, case: Case
) -> None:
    """The traced layers' form: the fold's buffer declared ``(B, S, Hq * D)`` and
    returned as it is, the gate given in that layout too, holds the bits of the
    transposed view's ``(B, S, Hq * D)`` reshape (the kernels index by their scalars,
    not by shapes)."""
    _assert_stored_with_the_heads_merged(case)


def test_reference_gate_is_mlx_lms_multiply() -> None:
    case = Case(1, 2, 4, 32, mx.bfloat16, True, 24, 100, 9, 9, 17, 20, True, None, 8, 5)
    built = build(case)
    gate = _gate_for(built)
    plain = built.attend(False)
    batch, heads, count, dim = plain.shape
    want = plain.transpose(0, 2, 1, 3).reshape(batch, count, -1) * mx.sigmoid(gate)
    got = built.attend(False, gate=gate).transpose(0, 2, 1, 3).reshape(batch, count, -1)
    assert np.array_equal(bits(got), bits(want))


def test_a_gate_of_the_wrong_size_or_dtype_raises() -> None:
    case = Case(1, 2, 4, 32, mx.bfloat16, True, 24, 100, 9, 9, 17, 20, True, None, 8, 5)
    built = build(case)
    gate = _gate_for(built)
    with pytest.raises(ValueError, match="gate must hold"):
        built.attend(False, gate=gate[..., 1:])
    with pytest.raises(ValueError, match="gate must hold"):
        built.attend(False, gate=gate.astype(mx.float32))


@pytest.mark.cuda
@cuda
@settings(max_examples=40, deadline=None)
@given(case=cases())
def test_cuda_gated_fold_gives_mlxs_sigmoid_and_multiply(case: Case) -> None:
    """On CUDA the epilogue is mlx's own functors: the bits of ``out * mx.sigmoid(g)``
    after the plain fold."""
    built = build(case)
    gate = _gate_for(built)
    plain = built.attend(True)
    batch, heads, count, dim = plain.shape
    want = plain.transpose(0, 2, 1, 3).reshape(batch, count, -1) * mx.sigmoid(gate)
    got = built.attend(True, gate=gate).transpose(0, 2, 1, 3).reshape(batch, count, -1)
    assert np.array_equal(bits(got), bits(want)), case


@pytest.mark.cuda
@cuda
@settings(max_examples=20, deadline=None)
@given(case=cases())
def test_cuda_fold_stored_with_the_heads_merged_has_the_same_bits(case: Case) -> None:
    """The traced layers' form on the GPU: the fold's buffer declared
    ``(B, S, Hq * D)``, the gate given so, holds the transposed view's bits."""
    _assert_stored_with_the_heads_merged(case)


@pytest.mark.cuda
@cuda
@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float16])
def test_cuda_gated_fold_at_glimmer_shapes(dtype) -> None:
    case = Case(1, 2, 16, 128, dtype, True, 2048, 4096, 16, 16, 777, 2048, True,
                None, 256, 1)  # fmt: skip
    built = build(case)
    gate = _gate_for(built)
    plain = built.attend(True)
    want = plain.transpose(0, 2, 1, 3).reshape(1, 16, -1) * mx.sigmoid(gate)
    got = built.attend(True, gate=gate).transpose(0, 2, 1, 3).reshape(1, 16, -1)
    assert np.array_equal(bits(got), bits(want))


@pytest.mark.cuda
@cuda
@settings(max_examples=60, deadline=None)
@given(case=fold_cases())
def test_cuda_fold_held_chunks_give_the_loops_bits(case) -> None:
    held = _fold(groups.launch_groups, attention.FOLD_CHUNKS, case)
    loops = _fold(groups.launch_groups, _FOLD_LOOPS, case)
    assert np.array_equal(bits(held), bits(loops)), case


# ------------------------------------------------------------------ CUDA (GPU)


@pytest.mark.cuda
@cuda
@settings(max_examples=150, deadline=None)
@given(case=cases())
def test_cuda_matches_oracle_and_reference(case: Case) -> None:
    assert_kernel_near_oracle_and_reference(case)


@pytest.mark.cuda
@cuda
@settings(max_examples=60, deadline=None)
@given(case=_verify_cases())
def test_cuda_is_batch_invariant(case: Case) -> None:
    assert_batch_invariant(case, True)


@pytest.mark.cuda
@cuda
@settings(max_examples=40, deadline=None)
@given(cases(), st.integers(1, 200))
def test_cuda_does_not_see_the_seam(case: Case, turn: int) -> None:
    assert_seamless(case, turn, True)


@pytest.mark.cuda
@cuda
@settings(max_examples=60, deadline=None)
@given(case=cases())
def test_cuda_reads_stacked_planes_and_blocks_as_their_halves(case: Case) -> None:
    out = assert_stacked_gives_the_halves_bits(case, True)
    assert close_to_oracle(build(case), out), case


@pytest.mark.cuda
@cuda
@pytest.mark.parametrize("ring", [True, False])
def test_cuda_glimmer_shapes(ring: bool) -> None:
    """16 queries, 32/2 heads x 128, bf16: a full 2,048 ring and a 4k growing plane."""
    if ring:
        case = Case(1, 2, 16, 128, mx.bfloat16, True, 2048, 4096, 16, 16, 777, 2048, True,
                    None, 256, 1)  # fmt: skip
    else:
        case = Case(1, 2, 16, 128, mx.bfloat16, False, 4352, 4096, 16, 16, 0, None, True,
                    None, 256, 2)  # fmt: skip
    built = build(case)
    out = built.attend(None)
    assert close_to_oracle(built, out)
    assert_batch_invariant(dataclasses.replace(case, queries=4, block=4), None)


# ============================================================ small-row matmul

from dflash.metal import qmm, tensor_qmm  # noqa: E402
from dflash.metal.qmm import small_row_matmul  # noqa: E402

_UNIT_ROUNDOFF = {mx.float32: 2.0**-24, mx.float16: 2.0**-11, mx.bfloat16: 2.0**-8}


@st.composite
def matmul_cases(draw, max_rows: int = 32, max_groups: int = 12, max_columns: int = 80):
    """(x, weight, scales, biases, bits, group_size) in mlx's affine format, or dense."""
    bits = draw(st.sampled_from([4, 8, None]))
    group = draw(st.sampled_from([32, 64, 128])) if bits else None
    depth = (group or 8) * draw(st.integers(1, max_groups))
    rows = draw(st.integers(1, max_rows))
    columns = draw(st.integers(1, max_columns))
    dtype = draw(st.sampled_from(DTYPES_))
    rng = np.random.default_rng(draw(st.integers(0, 2**16)))
    x = mx.array(rng.standard_normal((rows, depth)).astype(np.float32)).astype(dtype)
    dense = mx.array(rng.standard_normal((columns, depth)).astype(np.float32)).astype(
        dtype
    )
    if bits is None:
        return x, dense, None, None, None, None
    weight, scales, biases = mx.quantize(dense, group_size=group, bits=bits)
    return x, weight, scales, biases, bits, group


DTYPES_ = (mx.float32, mx.bfloat16, mx.float16)


def _matmul_oracle(x, weight, scales, biases, bits, group) -> np.ndarray:
    """Float64 ``x @ W.T`` with ``W`` dequantized exactly (``scale * q + bias``)."""
    xs = np.asarray(x.astype(mx.float32)).astype(np.float64)
    if bits is None:
        w = np.asarray(weight.astype(mx.float32)).astype(np.float64)
    else:
        packed = np.asarray(weight).astype(np.uint64)
        per_word = 32 // bits
        k = np.arange(x.shape[1])
        q = (packed[:, k // per_word] >> ((k % per_word) * bits).astype(np.uint64)) & (
            (1 << bits) - 1
        )
        s = np.asarray(scales.astype(mx.float32)).astype(np.float64)
        b = np.asarray(biases.astype(mx.float32)).astype(np.float64)
        w = q * np.repeat(s, group, axis=1) + np.repeat(b, group, axis=1)
    return xs @ w.T, np.abs(xs) @ np.abs(w.T)


def _close_to_matmul_oracle(case, out, slack: float = 1.0) -> bool:
    want, magnitude = _matmul_oracle(*case)
    got = np.asarray(out.astype(mx.float32)).astype(np.float64)
    # Output rounding (half an ulp, doubled) plus float32 sums over K terms.
    tol = 2 * _UNIT_ROUNDOFF[case[0].dtype] * np.abs(want) + 1e-6 * magnitude * slack
    return bool(np.all(np.abs(got - want) <= tol + 1e-30))


def _round_to(values: np.ndarray, dtype: mx.Dtype) -> np.ndarray:
    """Float64 values correctly rounded to ``dtype`` (round-to-odd to float32 first,
    then mlx's round-to-nearest-even: no double rounding)."""
    f = values.astype(np.float32)
    inexact = f.astype(np.float64) != values
    toward_zero = np.where(
        np.abs(f) > np.abs(values), np.nextafter(f, np.float32(0)), f
    )
    odd = (toward_zero.view(np.uint32) | np.uint32(1)).view(np.float32)
    f = np.where(inexact, odd, f)
    return np.asarray(mx.array(f).astype(dtype).astype(mx.float32)).astype(np.float64)


def _scaled_oracle_close(case, out, slack: float = 1.0) -> bool:
    """Within the oracle's tolerance of ``x @ W.T`` with each weight ``s * q + b``
    rounded once to x's dtype (the scaled-weight form's contract, and the weights
    mlx's ``dequantize`` gives)."""
    x, weight, scales, biases, bits, group = case
    packed = np.asarray(weight).astype(np.uint64)
    per_word = 32 // bits
    k = np.arange(x.shape[1])
    shifts = ((k % per_word) * bits).astype(np.uint64)
    q = (packed[:, k // per_word] >> shifts) & np.uint64((1 << bits) - 1)
    s = np.repeat(np.asarray(scales.astype(mx.float32)).astype(np.float64), group, 1)
    b = np.repeat(np.asarray(biases.astype(mx.float32)).astype(np.float64), group, 1)
    w = _round_to(q.astype(np.float64) * s + b, x.dtype)
    xs = np.asarray(x.astype(mx.float32)).astype(np.float64)
    want, magnitude = xs @ w.T, np.abs(xs) @ np.abs(w.T)
    got = np.asarray(out.astype(mx.float32)).astype(np.float64)
    tol = 2 * _UNIT_ROUNDOFF[x.dtype] * np.abs(want) + 1e-6 * magnitude * slack
    return bool(np.all(np.abs(got - want) <= tol + 1e-30))


def _close_to_form_oracle(case, out, slack: float = 1.0) -> bool:
    """The oracle of the form ``small_row_matmul`` runs the call in here: the
    rounded-weight one for the CUDA scaled-weight form, else the exact one."""
    x, weight, _, _, bits, _ = case
    scaled = (
        bits is not None
        and qmm.uses_tensor_cores(x.dtype, *x.shape, weight.shape[0], bits)
        and tensor_qmm.scaled_b(bits)
    )
    if scaled:
        return _scaled_oracle_close(case, out, slack)
    return _close_to_matmul_oracle(case, out, slack)


def _matmul(case, use_kernel, rows=slice(None)):
    x, weight, scales, biases, bits, group = case
    out = small_row_matmul(
        x[rows],
        weight,
        scales,
        biases,
        bits=bits,
        group_size=group,
        use_kernel=use_kernel,
    )
    mx.eval(out)
    return out


def assert_matmul_batch_invariant(case, use_kernel) -> None:
    together = _matmul(case, use_kernel)
    rows = case[0].shape[0]
    for row in range(rows):
        alone = _matmul(case, use_kernel, slice(row, row + 1))
        assert np.array_equal(bits(alone), bits(together[row : row + 1])), row
    if rows > 2:
        middle = _matmul(case, use_kernel, slice(1, rows - 1))
        assert np.array_equal(bits(middle), bits(together[1 : rows - 1]))


@settings(max_examples=60, deadline=None)
@given(matmul_cases())
def test_matmul_reference_matches_float_oracle(case) -> None:
    assert _close_to_matmul_oracle(case, _matmul(case, False))


@settings(max_examples=40, deadline=None)
@given(matmul_cases())
def test_matmul_reference_is_close_to_mlx(case) -> None:
    """mlx's own ``quantized_matmul`` / matmul: the same product (its sums differ)."""
    x, weight, scales, biases, bits, group = case
    if bits is None:
        want = x @ weight.T
    else:
        want = mx.quantized_matmul(
            x, weight, scales, biases, transpose=True, group_size=group, bits=bits
        )
    got = np.asarray(_matmul(case, False).astype(mx.float32))
    want = np.asarray(want.astype(mx.float32))
    scale = np.abs(want).max() + 1.0
    # mlx's CPU kernels lose a few ulps in half precision; this bounds them loosely.
    assert np.abs(got - want).max() <= 16 * _UNIT_ROUNDOFF[x.dtype] * scale


@settings(max_examples=30, deadline=None)
@given(matmul_cases(max_rows=20))
def test_matmul_reference_is_batch_invariant(case) -> None:
    assert_matmul_batch_invariant(case, False)


@pytest.fixture(scope="module")
def matmul_emulator(tmp_path_factory):
    return built_emulator(GroupEmulator, tmp_path_factory, "qmm_emulator", qmm.SPECS)


@pytest.fixture
def matmul_on_cpu(matmul_emulator, monkeypatch):
    return _route_groups(monkeypatch, matmul_emulator)


@settings(max_examples=25, deadline=None, suppress_health_check=_SHARED)
@given(case=matmul_cases(max_groups=10, max_columns=70))
def test_metal_matmul_matches_oracle(matmul_on_cpu, case) -> None:
    before = matmul_on_cpu.launches
    out = _matmul(case, True)
    assert matmul_on_cpu.launches == before + 1
    assert _close_to_matmul_oracle(case, out)


@settings(max_examples=10, deadline=None, suppress_health_check=_SHARED)
@given(case=matmul_cases(max_rows=20, max_groups=9, max_columns=40))
def test_metal_matmul_is_batch_invariant(matmul_on_cpu, case) -> None:
    assert_matmul_batch_invariant(case, True)


# Both kernel families, each in mlx's generated signature (Metal as C++, CUDA to PTX).
FAMILIES = {"attention": attention.SPECS, "matmul": qmm.SPECS}


@needs_gxx
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_metal_bodies_compile(tmp_path: Path, family: str) -> None:
    result = check_metal(FAMILIES[family], tmp_path, GXX)
    assert result.ok, f"{result.command}\n{result.log}"


@needs_nvcc
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_cuda_bodies_compile(tmp_path: Path, family: str) -> None:
    result = check_cuda(FAMILIES[family], tmp_path, NVCC)
    assert result.ok, f"{result.command}\n{result.log}"


def test_matmul_backends_share_one_body() -> None:
    for spec in qmm.SPECS:
        for name in ("metal", "cuda"):
            assert spec.source(name) == groups.PROLOGUES[name] + spec.body


_X = mx.zeros((2, 64))
_W, _S, _B = mx.quantize(mx.zeros((8, 64)), group_size=32, bits=4)


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda: small_row_matmul(_X[0], _W, _S, _B, bits=4, group_size=32), "x must be"),
        (lambda: small_row_matmul(_X, _W, _S, _B, bits=3, group_size=32), "bits"),
        (lambda: small_row_matmul(_X, _W, _S, _B, bits=4, group_size=16), "group_size"),
        (lambda: small_row_matmul(_X, _W, _S, None, bits=4, group_size=32), "biases"),
        (lambda: small_row_matmul(_X, _W, _S, _B, bits=8, group_size=32), "elements"),
        (lambda: small_row_matmul(_X, _W, _S[:, :1], _B, bits=4, group_size=32), "scales"),
        (lambda: small_row_matmul(_X, _W, _S, _B.astype(mx.float16), bits=4, group_size=32),
         "biases"),
        (lambda: small_row_matmul(_X, _W.astype(mx.int32), _S, _B, bits=4, group_size=32),
         "uint32"),
        (lambda: small_row_matmul(_X, mx.zeros((8, 32)), None, None), "does not fit"),
        (lambda: small_row_matmul(_X, mx.zeros((8, 64)), _S, None), "no scales"),
        (lambda: small_row_matmul(_X.astype(mx.int32), mx.zeros((8, 64))), "dtype"),
    ],
)  # fmt: skip
def test_matmul_bad_arguments_raise(call, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        call()


@pytest.mark.cuda
@cuda
@settings(max_examples=150, deadline=None)
@given(case=matmul_cases())
def test_cuda_matmul_matches_oracle(case) -> None:
    assert _close_to_form_oracle(case, _matmul(case, True))


@pytest.mark.cuda
@cuda
@settings(max_examples=60, deadline=None)
@given(case=matmul_cases())
def test_cuda_matmul_is_batch_invariant(case) -> None:
    assert_matmul_batch_invariant(case, True)


@pytest.mark.cuda
@cuda
@pytest.mark.parametrize("width", [4, 8, None])
def test_cuda_matmul_glimmer_shapes(width) -> None:
    """Hidden 6,656 -> 6,656 (o_proj) at 1 and 16 rows, bf16, group 64."""
    rng = np.random.default_rng(0)
    dense = mx.array(rng.standard_normal((6656, 6656)).astype(np.float32)).astype(
        mx.bfloat16
    )
    x = mx.array(rng.standard_normal((16, 6656)).astype(np.float32)).astype(mx.bfloat16)
    if width is None:
        case = (x, dense, None, None, None, None)
    else:
        case = (x, *mx.quantize(dense, group_size=64, bits=width), width, 64)
    assert _close_to_form_oracle(case, _matmul(case, True), slack=4.0)
    together = _matmul(case, True)
    alone = _matmul(case, True, slice(5, 6))
    assert np.array_equal(bits(alone), bits(together[5:6]))


# ================================================================== benchmark


def test_benchmark_runs_on_the_cpu_with_tiny_shapes(tmp_path: Path) -> None:
    """The CI smoke test of benchmarks/verify_kernels.py (every code path, tiny shapes)."""
    import json

    from benchmarks import verify_kernels

    path = tmp_path / "verify.json"
    assert verify_kernels.main(["--small", "--json", str(path), "--reps", "1"]) == 0
    data = json.loads(path.read_text())
    assert len(data["attention"]) == 16 and len(data["matmul"]) == 24
    for row in data["attention"] + data["matmul"]:
        assert row["sync_us"] > 0 and row["pipelined_us"] > 0
        assert row["max_abs_diff_vs_mlx"] < 1e-3
    assert {r["impl"] for r in data["matmul"]} == {"reference", "mlx"}


@pytest.mark.parametrize(
    "name, expected",
    [
        ("NVIDIA H200", 4.8e12),
        ("NVIDIA H100 80GB HBM3", 3.35e12),
        ("NVIDIA H100 NVL", 3.9e12),
        ("NVIDIA H100 PCIe", 2.0e12),
        ("Apple M3 Max", 4.8e12),
    ],
)
def test_bound_uses_the_named_devices_bandwidth(name: str, expected: float) -> None:
    """An H100's bound is its own 3.35 TB/s, not the H200's 4.8 (sessions 49-52's H100
    tables divided by 4.8); an unknown device keeps the H200's figure."""
    from benchmarks import verify_kernels

    assert verify_kernels.device_bandwidth(name) == (name, expected)


def test_benchmark_records_the_bandwidth_its_bound_used(tmp_path: Path) -> None:
    """``--bandwidth`` overrides the device's figure, and the result names both."""
    import argparse

    from benchmarks import verify_kernels

    args = argparse.Namespace(bandwidth=None)
    verify_kernels.resolve_bandwidth(args)
    assert args.bandwidth == verify_kernels.device_bandwidth(args.device_name)[1]
    args = argparse.Namespace(bandwidth=1e12)
    verify_kernels.resolve_bandwidth(args)
    assert args.bandwidth == 1e12 and isinstance(args.device_name, str)
    args.cold_bytes = 2**28
    meta = verify_kernels.per_call_meta(args, bits=4)
    assert (meta["bandwidth"], meta["cold_bytes"], meta["bits"]) == (1e12, 2**28, 4)
    assert meta["device"] == args.device_name
