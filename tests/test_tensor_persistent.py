"""The tensor-core matmul's persistent form (``tensor_qmm.PERSISTENT``).

A call of more (column tile, K split) items than resident CTAs launches only those
CTAs, each taking items ``group``, ``group + grid``, ... with its chunks as one
stream through the stage ring, so the next item's copies are in flight during an
item's epilogue. Each item's sums are the plain form's, so every output keeps its
bits. On the CPU: the body text itself on the emulator against the plain form, bit
for bit, over forms, row tiles, splits, grids and copy landings, through the bind
too; negative controls for the ring's scratch slot, the item stride and the
accumulators' reset; nvcc's registers and spills. On CUDA: the same against the
plain form on the device.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support.attention_cases import bits as raw_bits
from support.compilers import NVCC, built_emulator, needs_nvcc
from support.group_emulator import assert_within_bounds
from support.tensor_emulator import TensorEmulator
from test_compact_text import directives, tokens

from dflash.metal import qmm, tensor_qmm
from dflash.metal.groups import int_params
from dflash.metal.sources import compact_text

cuda = pytest.mark.skipif(not mx.cuda.is_available(), reason="needs mlx's CUDA backend")
HALF = (mx.bfloat16, mx.float16)

# The plain forms under test: the in-place denormal form (the default 4-bit one), at
# each group size and both m-tile counts; the denormal and scaled 4-bit, scaled 8-bit
# and dense texts (two K groups: the forms with a persistent form).
FORMS = {
    "inplace": tensor_qmm.IN_PLACE_SPECS[(2, (4, 1), 64)],
    "inplace-m2": tensor_qmm.IN_PLACE_SPECS[(2, (4, 2), 128)],
    "inplace-g32": tensor_qmm.IN_PLACE_SPECS[(2, (4, 1), 32)],
    "denormal": tensor_qmm.DENORMAL_SPECS[(2, (4, 1), 64)],
    "scaled": tensor_qmm.SCALED_SPECS[(2, (4, 1), 64)],
    "scaled-q8-m2": tensor_qmm.SCALED_SPECS[(2, (8, 2), 128)],
    "dense": tensor_qmm.FORM_SPECS[(False, 2)][(0, 1)],
    "dense-m2": tensor_qmm.FORM_SPECS[(False, 2)][(0, 2)],
}
PERSISTENT = {name: tensor_qmm.persistent_spec(spec) for name, spec in FORMS.items()}
# (bits, group size) each form is given.
WEIGHTS = {
    "inplace": (4, 64),
    "inplace-m2": (4, 128),
    "inplace-g32": (4, 32),
    "denormal": (4, 64),
    "scaled": (4, 64),
    "scaled-q8-m2": (8, 128),
    "dense": (None, None),
    "dense-m2": (None, None),
}


def _slip(name: str, old: str, new: str):
    """The persistent in-place form with one text edit (a negative control)."""
    spec = PERSISTENT["inplace"]
    assert spec.body.count(old) == 1, name
    return dataclasses.replace(
        spec, base=f"{spec.base}_{name}", body=spec.body.replace(old, new)
    )


# Negative controls: the epilogue's scratch in a slot copies in flight target; the
# next item one past, not a grid past; the accumulators carried from item to item.
SLIPS = {
    "scratch": _slip(
        "scratch",
        "smem + ((consumed + STAGES - 1) % STAGES) * STAGE_BYTES",
        "smem + (consumed % STAGES) * STAGE_BYTES",
    ),
    "stride": _slip(
        "stride", "        next_item += grid;\n", "        next_item += 1;\n"
    ),
    "reset": _slip(
        "reset",
        "  #pragma unroll\n  for (int mt = 0; mt < MT; ++mt) {\n    #pragma unroll\n"
        "    for (int t = 0; t < 4; ++t) {\n      #pragma unroll\n"
        "      for (int i = 0; i < 4; ++i) {\n        acc[mt][t][i] = 0.0f;\n"
        "      }\n    }\n  }\n  for (int c = c_begin;",
        "  for (int c = c_begin;",
    ),
}


@pytest.fixture(scope="module")
def emulator(tmp_path_factory):
    specs = (
        tuple(FORMS.values())
        + tuple(PERSISTENT.values())
        + tuple(SLIPS.values())
        + (tensor_qmm.REDUCE_SPEC,)
    )
    built = built_emulator(TensorEmulator, tmp_path_factory, "persistent", specs)
    built.late = False
    return built


def _case(rows: int, chunks: int, columns: int, form: str, dtype, seed: int):
    """x and the weight arrays of ``form`` (small weights: the in-place decode's
    scales), with K of ``chunks`` chunks; scales repacked as the form reads them
    (interleaved or chunk-major)."""
    bits, group = WEIGHTS[form]
    chunk = tensor_qmm.Layout(bits or 0, 1).chunk
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((rows, chunks * chunk)).astype(np.float32)
    dense = rng.standard_normal((columns, chunks * chunk)).astype(np.float32) * 0.01
    x, dense = mx.array(x).astype(dtype), mx.array(dense).astype(dtype)
    if bits is None:
        return x, [dense]
    weight, scales, biases = mx.quantize(dense, group_size=group, bits=bits)
    scales, biases = tensor_qmm.scale_arrays(FORMS[form], scales, biases, group)
    return x, [weight, scales, biases]


def _launch(
    emulator, spec, form: str, x, weights, columns, splits, per_split, grid, merged
):
    """One call of ``spec`` with K in ``splits`` ranges of ``per_split`` chunks;
    ``grid`` CTAs for the persistent form (None: one per item, the plain form);
    ``merged``: the last CTA of a tile sums the split, else the reduce launch."""
    bits, group = WEIGHTS[form]
    rows, depth = x.shape
    tiles = -(-columns // tensor_qmm.COLUMNS)
    shift = (group or 1).bit_length() - 1
    merged = merged and splits > 1
    extra = () if grid is None else (grid,)
    params = int_params(rows, columns, depth, group or 0, tiles, splits, per_split,
                        shift, int(merged), 0, *extra)  # fmt: skip
    y, partial = emulator.launch(
        spec,
        [x, *weights, params, mx.zeros((tiles,), mx.int32)],
        [(rows, columns), (splits * rows * columns,)],
        [x.dtype, mx.float32],
        tiles * splits if grid is None else grid,
        x.dtype,
    )
    if merged or splits == 1:
        return y
    (y,) = emulator.launch(
        tensor_qmm.REDUCE_SPEC,
        [partial, int_params(rows * columns, splits, columns, 0)],
        [(rows, columns)],
        [x.dtype],
        -(-rows * columns // tensor_qmm.REDUCE_THREADS),
        x.dtype,
    )
    return y


def _plain_and_persistent(emulator, form, case, columns, split, grid, merged=True):
    x, weights = case
    splits, per_split = split
    plain = _launch(emulator, FORMS[form], form, x, weights, columns, splits,
                    per_split, None, merged)  # fmt: skip
    ours = _launch(emulator, PERSISTENT[form], form, x, weights, columns, splits,
                   per_split, grid, merged)  # fmt: skip
    return raw_bits(plain), raw_bits(ours)


_FIXTURES = [HealthCheck.function_scoped_fixture]


@settings(max_examples=60, deadline=None, suppress_health_check=_FIXTURES)
@given(
    form=st.sampled_from(sorted(FORMS)),
    rows=st.integers(1, 32),
    chunks=st.integers(1, 6),
    columns=st.integers(1, 300),
    splits=st.integers(1, 4),
    grid_cut=st.integers(1, 8),
    dtype=st.sampled_from(HALF),
    landing=st.sampled_from(["early", "late", "eager", "misaligned"]),
    merged=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_persistent_form_gives_the_plain_bits(
    emulator, form, rows, chunks, columns, splits, grid_cut, dtype, landing, merged,
    seed,
) -> None:  # fmt: skip
    """Every form, 1 to 32 rows (one and two m-tiles), K split 1 to 4 ways (the last
    range shorter), grids of 1 CTA to one fewer than the items, copies landing early
    or late, warps in lockstep or each as far as it goes, misaligned inputs (the
    plain copies), the split merged or summed by the reduce launch: each output's
    bits are the plain form's."""
    splits = min(splits, chunks)
    per_split = -(-chunks // splits)
    splits = -(-chunks // per_split)
    tiles = -(-columns // tensor_qmm.COLUMNS)
    items = tiles * splits
    grid = max(1, items - grid_cut) if items > 1 else 1
    if "constexpr int MT = 1;" in FORMS[form].body:
        rows = min(rows, 16)  # a one-m-tile form serves up to 16 rows
    emulator.late = landing == "late"
    emulator.eager = landing == "eager"
    emulator.misaligned = landing == "misaligned"
    case = _case(rows, chunks, columns, form, dtype, seed)
    try:
        plain, ours = _plain_and_persistent(
            emulator, form, case, columns, (splits, per_split), grid, merged
        )
    finally:
        emulator.eager = emulator.misaligned = False
    assert np.array_equal(ours, plain)


@pytest.mark.parametrize("form", sorted(FORMS))
def test_one_cta_streams_every_item_of_a_call(emulator, form) -> None:
    """One CTA takes all 9 items of a call (3 column tiles, K in 3 ranges of 2, 2
    and 1 chunks: items shorter than the ring), copies landing early: the stream
    crosses items mid-ring, and the bits are the plain form's."""
    emulator.late = False
    rows = 32 if "m2" in form else 16
    case = _case(rows, 5, 300, form, mx.bfloat16, 7)
    plain, ours = _plain_and_persistent(emulator, form, case, 300, (3, 2), 1)
    assert np.array_equal(ours, plain)


@pytest.mark.parametrize("slip", sorted(SLIPS))
def test_slips_in_the_stream_change_the_bits(emulator, slip) -> None:
    """Negative controls, each on a call whose CTAs take several items with copies
    landing early: scratch in a slot the next item's copies fill, the next item
    one past instead of a grid past, the accumulators not reset between items."""
    emulator.late = False
    case = _case(16, 6, 300, "inplace", mx.bfloat16, 3)
    plain, _ = _plain_and_persistent(emulator, "inplace", case, 300, (3, 2), 4)
    x, weights = case
    wrong = _launch(emulator, SLIPS[slip], "inplace", x, weights, 300, 3, 2, 4, True)
    assert not np.array_equal(raw_bits(wrong), plain)


def _bound(monkeypatch, emulator, persistent: bool, resident: int):
    """small_row_matmul on a pretend CUDA backend whose launches run the emulator,
    with ``resident`` CTAs resident and the persistent switch as given; returns the
    specs launched and the result's bits for a 4-bit case of 3 column tiles."""
    monkeypatch.setattr(qmm.backend, "BACKEND", "cuda")
    monkeypatch.setenv(qmm.backend.COMPILE_ENV, "0")
    monkeypatch.setenv(tensor_qmm.PERSISTENT_ENV, "1" if persistent else "0")
    monkeypatch.setattr(tensor_qmm, "RESIDENT_CTAS", resident)
    tensor_qmm.launch_plan.cache_clear()
    tensor_qmm._wave_split.cache_clear()
    launched = []

    def launch(spec, inputs, shapes, dtypes, groups, dtype):
        launched.append((spec, groups))
        return emulator.launch(spec, inputs, shapes, dtypes, groups, dtype)

    monkeypatch.setattr(qmm.groups, "launch_groups", launch)
    rng = np.random.default_rng(5)
    x = mx.array(rng.standard_normal((16, 6 * 256)).astype(np.float32))
    dense = rng.standard_normal((300, 6 * 256)).astype(np.float32) * 0.01
    x, dense = x.astype(mx.bfloat16), mx.array(dense).astype(mx.bfloat16)
    weight, scales, biases = mx.quantize(dense, group_size=64, bits=4)
    try:
        out = qmm.small_row_matmul(
            x, weight, scales, biases, bits=4, group_size=64, use_kernel=True
        )
        return launched, raw_bits(out)
    finally:
        tensor_qmm.launch_plan.cache_clear()
        tensor_qmm._wave_split.cache_clear()


def test_the_bind_takes_the_persistent_form_only_past_the_resident_ctas(
    emulator, monkeypatch
) -> None:
    """Through the bind (the default 4-bit form, its own split): with the switch on
    and fewer resident CTAs than items, one launch of the persistent form with the
    resident count as its grid, and the plain form's bits; with as many resident as
    items, or the switch off, the plain form."""
    emulator.late = True
    plain, bits = _bound(monkeypatch, emulator, False, 2)
    assert [spec for spec, _ in plain] == [FORMS["inplace"]]
    items = plain[0][1]
    assert items > 2
    ours, ours_bits = _bound(monkeypatch, emulator, True, 2)
    assert ours == [(PERSISTENT["inplace"], 2)]
    assert np.array_equal(ours_bits, bits)
    roomy, _ = _bound(monkeypatch, emulator, True, items)
    assert roomy == plain


def test_persistent_switch_is_read_at_each_bind_and_refuses_bad_words(
    monkeypatch,
) -> None:
    """``DFLASH_QMM_PERSISTENT``: off by default, on / off at each bind, a bad word
    refused by name."""
    monkeypatch.delenv(tensor_qmm.PERSISTENT_ENV, raising=False)
    assert tensor_qmm.PERSISTENT is False and tensor_qmm.persistent() is False
    monkeypatch.setenv(tensor_qmm.PERSISTENT_ENV, "on")
    assert tensor_qmm.persistent() is True
    monkeypatch.setenv(tensor_qmm.PERSISTENT_ENV, "maybe")
    with pytest.raises(ValueError, match="DFLASH_QMM_PERSISTENT"):
        tensor_qmm.persistent()


def test_launch_plan_grid_is_the_resident_ctas_and_the_launch_last_integer() -> None:
    """The plan of a call with more items than resident CTAs (the fused gate / up
    at 4 bits): RESIDENT_CTAS CTAs of the persistent form, the grid as the last
    launch integer; a one-wave call (o_proj) and a cluster sum keep the plain plan."""
    args = (16, 6656, 39936, 4, 64, True, False, True, 2, (), False, True)
    plain = tensor_qmm.launch_plan(*args)
    ours = tensor_qmm.launch_plan(*args, persistent=True)
    assert plain.groups > tensor_qmm.RESIDENT_CTAS
    assert ours.groups == tensor_qmm.RESIDENT_CTAS
    assert ours.spec is tensor_qmm.persistent_spec(plain.spec)
    assert np.array(ours.params).tolist() == [
        *np.array(plain.params).tolist(),
        tensor_qmm.RESIDENT_CTAS,
    ]
    assert (ours.shapes, ours.counters) == (plain.shapes, plain.counters)
    one_wave = (16, 4096, 6656, 4, 64, True, False, True, 2, (), False, True)
    assert tensor_qmm.launch_plan(*one_wave, persistent=True) == (
        tensor_qmm.launch_plan(*one_wave)
    )


def test_forms_without_a_persistent_form_are_refused_by_name() -> None:
    """One K group, unscaled weights, SwiGLU, direct and cluster forms have none
    (refused naming the form), nor has a persistent form; every two-K-group scaled
    and dense form of the shipped tables has one."""
    refused = [
        tensor_qmm.SCALED_SPECS[(1, (4, 1), 64)],
        tensor_qmm.FORM_SPECS[(False, 2)][(4, 1)],
        tensor_qmm.FORM_SPECS[(False, 1)][(0, 1)],
        tensor_qmm.SWIGLU_SCALED_SPECS[(2, (4, 1), 64)],
        tensor_qmm.DIRECT_SPECS[(2, 64)],
        tensor_qmm.cluster_spec(FORMS["scaled"], 2),
        PERSISTENT["inplace"],
    ]
    for spec in refused:
        assert not tensor_qmm.persistent_serves(spec)
        with pytest.raises(ValueError, match=re.escape(spec.base)):
            tensor_qmm.persistent_spec(spec)
    tables = (
        tensor_qmm.SCALED_SPECS,
        tensor_qmm.DENORMAL_SPECS,
        tensor_qmm.IN_PLACE_SPECS,
    )
    served = [spec for table in tables for key, spec in table.items() if key[0] == 2]
    served += [tensor_qmm.FORM_SPECS[(False, 2)][(0, m)] for m in (1, 2)]
    assert len(served) == 12 + 6 + 6 + 2
    assert all(tensor_qmm.persistent_serves(spec) for spec in served)


def test_persistent_texts_keep_their_tokens_when_compacted() -> None:
    """The text mlx is handed (comments and indentation dropped) keeps every token
    and directive of each persistent form."""
    for spec in PERSISTENT.values():
        for text in (spec.helpers, spec.body):
            small = compact_text(text)
            assert tokens(small) == tokens(text)
            assert directives(small) == directives(text)


@needs_nvcc
def test_persistent_forms_compile_for_sm90_within_the_bounds(tmp_path: Path) -> None:
    """Every persistent form of the shipped forms compiles for sm_90 (bfloat16) with
    no spills within 128 registers (two CTAs an SM, as the plain forms)."""
    specs = [
        tensor_qmm.persistent_spec(spec)
        for spec in tensor_qmm.SPECS
        if tensor_qmm.persistent_serves(spec)
    ]
    assert len(specs) == 26
    # An opt-in form measured slower (session 56): compile-checked in bfloat16 alone
    # (its float16 conversions are the shipped forms'; the emulator runs both types).
    assert_within_bounds(specs, tmp_path, NVCC, [mx.bfloat16])


@pytest.mark.cuda
@cuda
@pytest.mark.parametrize("rows", [1, 16])
@pytest.mark.parametrize("shape", [(6656, 39936), (6656, 202048)])
def test_persistent_glimmer_calls_give_the_plain_bits_on_the_device(
    monkeypatch, rows, shape
) -> None:
    """On the device: Muse Glimmer's multi-wave 4-bit calls (the fused gate / up, the
    LM head; weights that take the in-place decode) through the bind, persistent
    against plain, bit for bit, the persistent launch on RESIDENT_CTAS CTAs."""
    depth, columns = shape
    key_x, key_w = mx.random.split(mx.random.key(rows))
    x = mx.random.normal((rows, depth), dtype=mx.bfloat16, key=key_x)
    dense = mx.random.normal((columns, depth), dtype=mx.bfloat16, key=key_w) * 0.01
    weight, scales, biases = mx.quantize(dense, group_size=64, bits=4)
    del dense
    launched = []
    real_launch = qmm.groups.launch_groups

    def launch(spec, inputs, shapes, dtypes, groups, dtype):
        launched.append((spec.base, groups))
        return real_launch(spec, inputs, shapes, dtypes, groups, dtype)

    monkeypatch.setattr(qmm.groups, "launch_groups", launch)
    # The plain form, not the cluster sum (the default where launches are direct,
    # e.g. with mlx's graphs off), which the persistent form does not serve.
    monkeypatch.setenv(tensor_qmm.CLUSTER_SUM_ENV, "0")
    results = {}
    for persistent in (False, True):
        monkeypatch.setenv(tensor_qmm.PERSISTENT_ENV, "1" if persistent else "0")
        out = qmm.small_row_matmul(x, weight, scales, biases, bits=4, group_size=64)
        results[persistent] = raw_bits(out)
    assert np.array_equal(results[True], results[False])
    (plain, plain_groups), (ours, groups) = launched
    assert ours == f"{plain}_persist" and "_inplace" in plain
    assert groups == tensor_qmm.RESIDENT_CTAS < plain_groups
