"""The tensor-core chunk pass of the small-query attention, run on the CPU emulator.

``tests/test_tensor_attention.py`` proves the CUDA bodies on a GPU (tests marked
``cuda``); CI has none. Here the very body text of both layouts (``stream`` and
``split``) runs under :class:`support.tensor_emulator.TensorEmulator` (helpers with
inline PTX emulated from the PTX ISA: ``mma``, ``ldmatrix`` and its transpose,
``cp.async`` landing at issue or at its wait, warp shuffles), together with the
fold it launches with (``attention.FOLD_CHUNKS`` in its CUDA form), through the
public wrapper ``small_query_attention(..., use_kernel=True)`` on a pretend CUDA
backend. Proven here, with copies landing at issue or at their wait and warps
moving together or one running ahead: close to the float64 oracle, batch-invariant
and seam-blind bit for bit; and deliberate slips in the bodies (fragment registers,
ldmatrix row addresses, a shuffle, lanes skipping a shuffle, reads before the wait,
a buffer reused too early) fail in the modes that can show them.
"""

from __future__ import annotations

import dataclasses
import functools

import mlx.core as mx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support.attention_cases import Case, build, cases, close_to_oracle
from support.compilers import built_emulator
from support.tensor_emulator import TensorEmulator
from test_verify_kernels import (
    assert_batch_invariant,
    assert_seamless,
    assert_stacked_gives_the_halves_bits,
)

from dflash.metal import attention, groups, tensor_attention
from dflash.metal.groups import GroupKernelSpec

DIMS = (16, 32, 64)
HALF = (mx.bfloat16, mx.float16)
LAYOUTS = sorted(tensor_attention.LAYOUTS)
_FIXTURES = [HealthCheck.function_scoped_fixture]

# Slips, each a (old, new) edit of a body's text; both layouts share most lines.
_K_MMA = "dfl_mma(s[j], q_frag[ks], kf[0], kf[1], queries);"
_K_ROW = "const int d = ks * 16 + (mi & 1) * 8;"
_V_ROW = "const int key = kk * 16 + (mi & 1) * 8 + (lane & 7);"
_SHARED_SLIPS = {
    # The two B registers of the scores' mma swapped.
    "fragments": (_K_MMA, _K_MMA.replace("kf[0], kf[1]", "kf[1], kf[0]")),
    # ldmatrix rows of the keys at the wrong head-dim half.
    "ldmatrix_row": (_K_ROW, _K_ROW.replace("(mi & 1)", "(mi >> 1)")),
    # ldmatrix.trans rows of the values from the wrong key half.
    "trans_row": (_V_ROW, _V_ROW.replace("(mi & 1)", "(mi >> 1)")),
}
_LAYOUT_SLIPS = {
    "stream": {
        # Row sums gathered across rows (xor 4 crosses to the next row's quad).
        "row_sum_shuffle": (
            "row_sum[i] += __shfl_xor_sync(0xffffffffu, row_sum[i], 2);",
            "row_sum[i] += __shfl_xor_sync(0xffffffffu, row_sum[i], 4);",
        ),
        # Half the lanes skip a warp collective.
        "divergent_shuffle": (
            "tile_max[i] = fmaxf(tile_max[i], __shfl_xor_sync(0xffffffffu, tile_max[i], 1));",
            "if (tig < 2) tile_max[i] = fmaxf(tile_max[i], "
            "__shfl_xor_sync(0xffffffffu, tile_max[i], 1));",
        ),
        # Computes on a tile before its copies are waited for.
        "early_read": ("dfl_cp_async_wait<1>();", "dfl_cp_async_wait<2>();"),
        # Refills a stage while slower warps still read it (no barrier after a tile).
        "early_refill": (
            "    __syncthreads();\n  }\n\n  // The chunk's statistics",
            "  }\n\n  // The chunk's statistics",
        ),
    },
    "pair": {
        # (Its shuffles and its wait read as stream's: the slips below the dict. No refill
        # slip: at chunks of up to 256 keys its two stages hold the chunk.)
        # Group 0 reads the exchange before the other groups have written it.
        "early_exchange": (
            "  __syncthreads();\n  if (key_group > 0 || !warp_active) {",
            "  if (key_group > 0 || !warp_active) {",
        ),
        # The groups' states combined without rescaling group 0's own.
        "unscaled_own": ("    l_run[i] *= own;\n", ""),
    },
    "wide": {
        # Its queries' fragments are ldmatrix'd into `qa` at each k-step.
        "fragments": (
            "dfl_mma(s[j], qa, kf[0], kf[1], queries);",
            "dfl_mma(s[j], qa, kf[1], kf[0], queries);",
        ),
        # (Its shuffles and its wait read as split's: the slips below the dict.)
        "early_reuse": (
            "  __syncthreads();  // the tiles are read: their memory holds the exchange now\n",
            "",
        ),
        "early_exchange": (
            "  __syncthreads();\n  if (key_tile > 0 || !warp_active) {",
            "  if (key_tile > 0 || !warp_active) {",
        ),
        # The queries' A fragments with rows and head-dim halves crossed.
        "query_rows": (
            "(((lane >> 3) & 1) * 8 + (lane & 7)) * PITCH",
            "((lane >> 4) * 8 + (lane & 7)) * PITCH",
        ),
    },
    "split": {
        "row_sum_shuffle": (
            "l_tile[i] += __shfl_xor_sync(0xffffffffu, l_tile[i], 2);",
            "l_tile[i] += __shfl_xor_sync(0xffffffffu, l_tile[i], 4);",
        ),
        "divergent_shuffle": (
            "m_tile[i] = fmaxf(m_tile[i], __shfl_xor_sync(0xffffffffu, m_tile[i], 1));",
            "if (tig < 2) m_tile[i] = fmaxf(m_tile[i], "
            "__shfl_xor_sync(0xffffffffu, m_tile[i], 1));",
        ),
        # Reads the tiles without waiting for their copies.
        "no_wait": (
            "  dfl_cp_async_wait<0>();\n  __syncthreads();\n",
            "  __syncthreads();\n",
        ),
        # Waits for its own copies only after the barrier: a warp running ahead reads
        # tiles whose other copies have not landed.
        "wait_after_barrier": (
            "  dfl_cp_async_wait<0>();\n  __syncthreads();\n",
            "  __syncthreads();\n  dfl_cp_async_wait<0>();\n",
        ),
        # Writes the warps' partials over the tiles while other warps still read them.
        "early_reuse": (
            "  __syncthreads();  // the tiles are read; their memory holds the warps' "
            "partials now\n",
            "",
        ),
    },
}
_PAIR_AS_STREAM = ("row_sum_shuffle", "divergent_shuffle", "early_read")
_LAYOUT_SLIPS["pair"].update(
    {slip: _LAYOUT_SLIPS["stream"][slip] for slip in _PAIR_AS_STREAM}
)
_WIDE_AS_SPLIT = (
    "row_sum_shuffle",
    "divergent_shuffle",
    "no_wait",
    "wait_after_barrier",
)
_LAYOUT_SLIPS["wide"].update(
    {slip: _LAYOUT_SLIPS["split"][slip] for slip in _WIDE_AS_SPLIT}
)
# The emulator's modes: (copies land at their wait, not at issue; each warp runs as far
# as it goes before the next, not all in turn).
MODES = ((False, False), (True, False), (False, True), (True, True))
# (layout, slip) -> whether each mode catches it.
EVERYWHERE = (True, True, True, True)
CAUGHT = {
    **{(name, slip): EVERYWHERE for name in LAYOUTS for slip in _SHARED_SLIPS},
    **{(name, "row_sum_shuffle"): EVERYWHERE for name in LAYOUTS},
    **{(name, "divergent_shuffle"): EVERYWHERE for name in LAYOUTS},
    # Late landing: the tile is still poison when read.
    ("stream", "early_read"): (False, True, False, True),
    ("split", "no_wait"): (False, True, False, True),
    # Only a warp running ahead with copies landing late reads the others' too soon.
    ("split", "wait_after_barrier"): (False, False, False, True),
    # Only idle warps running ahead with copies landing at issue refill too soon.
    ("stream", "early_refill"): (True, False, False, False),
    ("split", "early_reuse"): EVERYWHERE,
    ("pair", "early_read"): (False, True, False, True),
    ("pair", "early_exchange"): EVERYWHERE,
    ("pair", "unscaled_own"): EVERYWHERE,
    ("wide", "no_wait"): (False, True, False, True),
    ("wide", "wait_after_barrier"): (False, False, False, True),
    ("wide", "early_reuse"): EVERYWHERE,
    ("wide", "early_exchange"): EVERYWHERE,
    ("wide", "query_rows"): EVERYWHERE,
}
SLIP_DIM = 16
# How the emulator refuses a run (any other failure is an emulator or test fault).
REFUSALS = (
    "meet at different warp collectives",
    "cp.async copies never waited for",
)


def _mutant(layout: str, slip: str) -> GroupKernelSpec:
    """The layout's spec at ``SLIP_DIM`` with one slip in its body (bfloat16 only)."""
    spec = tensor_attention.attend_spec(SLIP_DIM, tensor_attention.LAYOUTS[layout])
    old, new = {**_SHARED_SLIPS, **_LAYOUT_SLIPS[layout]}[slip]
    assert spec.body.count(old) == 1, (layout, slip)
    return dataclasses.replace(
        spec,
        base=f"{spec.base}_{slip}",
        body=spec.body.replace(old, new),
        dtypes=(mx.bfloat16,),
    )


MUTANTS = {key: _mutant(*key) for key in CAUGHT}


# The passes over stacked planes and blocks (bfloat16 cases only).
STACKED = [
    tensor_attention.attend_spec(dim, tensor_attention.LAYOUTS[name], True)
    for name in LAYOUTS
    for dim in DIMS
]


@pytest.fixture(scope="module")
def tensor_emulator(tmp_path_factory) -> TensorEmulator:
    specs = [
        tensor_attention.attend_spec(dim, tensor_attention.LAYOUTS[name])
        for name in LAYOUTS
        for dim in DIMS
    ]
    specs += [attention.FOLD_CHUNKS, *MUTANTS.values(), *STACKED]
    make = functools.partial(TensorEmulator, bfloat16_only=STACKED)
    return built_emulator(make, tmp_path_factory, "attention_emulator", specs)


@pytest.fixture(params=LAYOUTS)
def emulated(request, tensor_emulator, monkeypatch) -> TensorEmulator:
    """small_query_attention on a pretend CUDA backend, tensor cores in the layout
    ``request.param``, whose launches run the emulator."""
    monkeypatch.setattr(attention.backend, "BACKEND", "cuda")
    monkeypatch.setattr(attention, "TENSOR_CORES", True)
    monkeypatch.setattr(
        attention, "TENSOR_LAYOUT", tensor_attention.LAYOUTS[request.param]
    )
    monkeypatch.setattr(groups, "launch_groups", tensor_emulator.launch)
    yield tensor_emulator
    tensor_emulator.late = tensor_emulator.eager = False


def emulated_cases(max_queries: int = 6, **kwargs):
    """Served scenarios, kept small (each call is an emulated launch)."""
    return cases(
        max_queries=max_queries, dims=DIMS, dtypes=HALF, chunks=(64, 256), **kwargs
    ).map(lambda c: dataclasses.replace(c, kv_heads=min(c.kv_heads, 2)))


def _tensor_launches(emulator: TensorEmulator, since: int, dim: int) -> list[str]:
    """The spec bases launched since ``since``; the tensor pass and the fold each time."""
    spec = tensor_attention.attend_spec(dim, attention.TENSOR_LAYOUT)
    launched = emulator.launched[since:]
    assert launched == [spec.base, attention.FOLD_CHUNKS.base] * (len(launched) // 2)
    return launched


@settings(max_examples=40, deadline=None, suppress_health_check=_FIXTURES)
@given(case=emulated_cases(), mode=st.sampled_from(MODES))
def test_emulated_tensor_form_matches_oracle(emulated, case: Case, mode) -> None:
    """Through the wrapper (launch geometry, the fold included), in every mode."""
    emulated.late, emulated.eager = mode
    before = len(emulated.launched)
    built = build(case)
    assert close_to_oracle(built, built.attend(True)), case
    assert len(_tensor_launches(emulated, before, case.dim)) == 2


@settings(max_examples=12, deadline=None, suppress_health_check=_FIXTURES)
@given(
    case=emulated_cases(allow_non_causal=False).filter(lambda c: c.block == c.queries),
    mode=st.sampled_from(MODES),
)
def test_emulated_tensor_form_is_batch_invariant(emulated, case: Case, mode) -> None:
    """Every row of a verify call has the bits of that query alone, later."""
    emulated.late, emulated.eager = mode
    before = len(emulated.launched)
    assert_batch_invariant(case, True)
    assert len(_tensor_launches(emulated, before, case.dim)) == 2 * (
        1 + 2 * case.queries
    )


@settings(max_examples=16, deadline=None, suppress_health_check=_FIXTURES)
@given(
    case=emulated_cases().map(lambda c: dataclasses.replace(c, dtype=mx.bfloat16)),
    mode=st.sampled_from(MODES),
)
def test_emulated_tensor_form_reads_stacked_planes_and_blocks_as_their_halves(
    emulated, case: Case, mode
) -> None:
    """The stacked pass of each layout (values at the launch's offsets) gives the bits
    of the plain pass over the halves given apart."""
    emulated.late, emulated.eager = mode
    before = len(emulated.launched)
    assert_stacked_gives_the_halves_bits(case, True)
    passes = [
        tensor_attention.attend_spec(case.dim, attention.TENSOR_LAYOUT, stacked).base
        for stacked in (True, False)
    ]
    assert emulated.launched[before:][::2] == passes


@settings(max_examples=12, deadline=None, suppress_health_check=_FIXTURES)
@given(case=emulated_cases(), turn=st.integers(1, 200))
def test_emulated_tensor_form_does_not_see_the_seam(
    emulated, case: Case, turn: int
) -> None:
    assert_seamless(case, turn, True)


def _slip_case() -> Case:
    """Two chunks of four tiles (stages refilled), six rows (idle warps run ahead)."""
    return Case(
        batch=1, kv_heads=1, group=2, dim=SLIP_DIM, dtype=mx.bfloat16, ring=False,
        capacity=420, history=410, block=3, queries=3, origin_physical=0, window=None,
        causal=True, softcap=None, chunk=256, seed=11,
    )  # fmt: skip


def _slip_shows(spec: GroupKernelSpec, built) -> bool:
    """Whether the wrapper running ``spec`` misses the oracle or the emulator refuses
    the run (lanes diverging at a warp collective, copies never waited for)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(tensor_attention, "attend_spec", lambda *_: spec)
        try:
            return not close_to_oracle(built, built.attend(True))
        except RuntimeError as error:
            if not any(refusal in str(error) for refusal in REFUSALS):
                raise
            return True


@pytest.mark.parametrize("layout, slip", sorted(CAUGHT))
def test_emulator_catches_slips(
    tensor_emulator, monkeypatch, layout: str, slip: str
) -> None:
    """Negative controls: each slip fails in the modes meant to catch it (and passes
    where it is harmless: the emulator is not merely strict); the body itself passes
    in every mode."""
    monkeypatch.setattr(attention.backend, "BACKEND", "cuda")
    monkeypatch.setattr(attention, "TENSOR_CORES", True)
    monkeypatch.setattr(attention, "TENSOR_LAYOUT", tensor_attention.LAYOUTS[layout])
    monkeypatch.setattr(groups, "launch_groups", tensor_emulator.launch)
    built = build(_slip_case())
    try:
        for (late, eager), caught in zip(MODES, CAUGHT[(layout, slip)]):
            tensor_emulator.late, tensor_emulator.eager = late, eager
            assert close_to_oracle(built, built.attend(True)), (layout, late, eager)
            shown = _slip_shows(MUTANTS[(layout, slip)], built)
            assert shown is caught, (layout, slip, late, eager)
    finally:
        tensor_emulator.late = tensor_emulator.eager = False
