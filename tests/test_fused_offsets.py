"""Members of a fused projection read in place: the gated fold's gate at an offset,
and the fused output with its members' offsets (``FusedProjections.fused_output``).

A traced verify layer hands the head prep and the gated fold the one member-major
output of its fused q / k / v / gate launch, with each member's element offset,
instead of a view per member (a graph node each, every replay). The head prep's reads
are tested in tests/test_head_prep.py, the traced layers' use in
tests/test_traced_layers.py.

What is proven where:

* CPU (CI): the emulated gated fold reading its gate at an offset inside a larger
  buffer gives the bits it gives the gate as its own array, over attention cases and
  offsets; a wrong offset and a body that ignores the offset give other bits
  (negative controls); bad offsets raise before anything is launched. The fused
  output is the very buffer the members' views are cut from, at the offsets given,
  with no view of its own; the forms it does not serve give None.
* CUDA (tests marked ``cuda``): the gate read in place gives the bits of the gate as
  its own array, at Glimmer's shapes too.
"""

from __future__ import annotations

import dataclasses
import re
from collections import Counter

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support.attention_cases import Case, bits, build, cases
from support.compilers import built_emulator
from support.group_emulator import GroupEmulator

from dflash.fused_projections import FusedProjections
from dflash.metal import attention, backend, groups, tensor_qmm

cuda = pytest.mark.skipif(not mx.cuda.is_available(), reason="needs mlx's CUDA backend")
_SHARED = [HealthCheck.function_scoped_fixture]
_SMALL = dict(dims=(16, 24, 64, 128), chunks=(3, 16, 64, 256))

# The gate read from the buffer's start, whatever the offset.
_OFFSET_IGNORED = dataclasses.replace(
    attention.FOLD_GATED,
    base="fold_gated_offset_ignored",
    body=attention.FOLD_GATED.body.replace("gate[at]", "gate[stored]"),
)
assert _OFFSET_IGNORED.body != attention.FOLD_GATED.body


@pytest.fixture(scope="module")
def emulator(tmp_path_factory):
    specs = list(attention.SPECS) + [_OFFSET_IGNORED]
    return built_emulator(GroupEmulator, tmp_path_factory, "gate_offset", specs)


@pytest.fixture
def metal_on_cpu(emulator, monkeypatch):
    monkeypatch.setattr(backend, "BACKEND", "metal")
    monkeypatch.setattr(groups, "launch_groups", emulator.launch)
    return emulator


def _gate(built) -> mx.array:
    """A gate of the output's ``(B, S, Hq * D)`` layout, spanning the sigmoid's range."""
    batch, heads, count, dim = built.queries.shape
    gate = 4.0 * mx.random.normal(
        (batch, count, heads * dim), key=mx.random.key(built.case.seed)
    )
    return gate.astype(built.case.dtype)


def _in_buffer(gate: mx.array, before: int, after: int, seed: int) -> mx.array:
    """``gate``'s elements in order from element ``before`` of a flat buffer, other
    values around them (as another member's columns lie around the gate's)."""
    noise = 8.0 * mx.random.normal((before + after,), key=mx.random.key(seed + 1))
    noise = noise.astype(gate.dtype)
    buffer = mx.concatenate([noise[:before], gate.reshape(-1), noise[before:]])
    mx.eval(buffer)
    return buffer


def launch_gated(built, gate: mx.array, gate_offset: int = 0, form_offset=None):
    """:func:`attention.launch_attention` of ``built`` with the fold's buffer stored
    ``(B, S, Hq * D)`` (the traced layers' form), the gate read from ``gate_offset``
    on (``form_offset``: the offset the form, and so the fold's integers, carry
    instead)."""
    c = built.case
    plan = attention.make_plan(
        built.queries, built.plane, built.block_keys, built.block_values,
        window=c.window, causal=c.causal, query_start=None, chunk=c.chunk,
    )  # fmt: skip
    carried = gate_offset if form_offset is None else form_offset
    form = attention.kernel_form(plan, c.dtype, True, carried)
    if form_offset is not None:
        # The form checks its reads against the offset it carries: hand it the one
        # given, so that only the fold's integers differ.
        form = dataclasses.replace(form, gate_offset=gate_offset)
    arrays = attention.bound_arrays(
        plan, built.plane, built.block_keys, built.block_values
    )
    floats = groups.float_params(float(c.scale), float(c.softcap or 0.0))
    batch, heads, count, dim = built.queries.shape
    out = attention.launch_attention(
        form, built.queries.transpose(0, 2, 1, 3), *arrays, form.launch.ints,
        floats, form.launch.fold_ints, gate, (batch, count, heads * dim),
    )  # fmt: skip
    mx.eval(out)
    return out


# ------------------------------------------------------------ emulated fold


@settings(max_examples=20, deadline=None, suppress_health_check=_SHARED)
@given(
    case=cases(max_queries=12, **_SMALL),
    before=st.integers(0, 3000),
    after=st.integers(0, 40),
)
def test_emulated_gate_at_an_offset_gives_the_gates_own_bits(
    metal_on_cpu, case: Case, before: int, after: int
) -> None:
    """The gated fold reading its gate from element ``before`` of a larger buffer
    (the fused projections' output) gives, bit for bit, what it gives the gate as its
    own array."""
    built = build(case)
    gate = _gate(built)
    buffer = _in_buffer(gate, before, after, case.seed)
    in_place = launch_gated(built, buffer, before)
    own = launch_gated(built, gate)
    assert in_place.shape == own.shape
    assert np.array_equal(bits(in_place), bits(own)), case


def _fixed_case() -> Case:
    return Case(
        1, 2, 2, 64, mx.bfloat16, False, 40, 30, 5, 5, 0, None, True, None, 16, 3
    )


@pytest.mark.parametrize("slip", ["one_element_on", "one_head_back", "offset_ignored"])
def test_a_wrong_gate_offset_gives_other_bits(
    metal_on_cpu, monkeypatch, slip: str
) -> None:
    """Negative controls: the fold's integers one element past the gate, or one head
    before it, or a body that reads the gate from the buffer's start."""
    built = build(_fixed_case())
    gate = _gate(built)
    before = 200
    buffer = _in_buffer(gate, before, 200, 3)
    own = launch_gated(built, gate)
    if slip == "offset_ignored":
        monkeypatch.setattr(attention, "FOLD_GATED", _OFFSET_IGNORED)
        got = launch_gated(built, buffer, before)
    else:
        shifted = before + 1 if slip == "one_element_on" else before - 64
        got = launch_gated(built, buffer, before, form_offset=shifted)
    assert not np.array_equal(bits(got), bits(own))


def test_the_offset_ends_the_folds_integers_and_zero_is_the_default() -> None:
    built = build(_fixed_case())
    plan = attention.make_plan(
        built.queries, built.plane, built.block_keys, built.block_values,
        window=None, causal=True, query_start=None, chunk=16,
    )  # fmt: skip
    plain = attention.kernel_form(plan, mx.bfloat16, True)
    at = attention.kernel_form(plan, mx.bfloat16, True, 777)
    assert plain.gate_offset == 0 and at.gate_offset == 777
    assert np.array(plain.launch.fold_ints).tolist()[5] == 0
    assert np.array(at.launch.fold_ints).tolist()[5] == 777
    # Only the fold's integers differ; an ungated form's are the gated one's.
    assert at.launch.ints is plain.launch.ints
    assert attention.kernel_form(plan, mx.bfloat16, False).launch is plain.launch


@pytest.mark.parametrize(
    "gated, offset, message",
    [
        (True, -1, "gate_offset must be an int >= 0"),
        (True, 2.0, "gate_offset must be an int >= 0"),
        (True, True, "gate_offset must be an int >= 0"),
        (True, 2**31 - 10, "inside int32"),
        (False, 64, "ungated fold"),
    ],
)
def test_bad_gate_offsets_are_refused(gated, offset, message) -> None:
    built = build(_fixed_case())
    plan = attention.make_plan(
        built.queries, built.plane, built.block_keys, built.block_values,
        window=None, causal=True, query_start=None, chunk=16,
    )  # fmt: skip
    with pytest.raises(ValueError, match=message):
        attention.kernel_form(plan, mx.bfloat16, gated, offset)


@pytest.mark.parametrize("short", [1, 64])
def test_a_gate_read_past_its_buffer_is_refused_before_any_launch(
    monkeypatch, short: int
) -> None:
    """The form's offset with the gate's elements after it must lie in the buffer
    handed over: checked before the chunk pass is launched. A buffer that holds them
    exactly is taken."""
    calls = []

    def recorded(spec, inputs, shapes, dtypes, count, dtype):
        calls.append(spec.base)
        return [mx.zeros(shape, dt) for shape, dt in zip(shapes, dtypes)]

    monkeypatch.setattr(groups, "launch_groups", recorded)
    built = build(_fixed_case())
    gate = _gate(built)
    buffer = _in_buffer(gate, 100, 0, 3)
    with pytest.raises(ValueError, match="past the"):
        launch_gated(built, buffer[:-short], 100)
    assert not calls
    launch_gated(built, buffer, 100)
    assert calls == ["attend_chunks", "fold_gated"]


# ------------------------------------------------------------ the fused output


def pattern_launch(spec, inputs, output_shapes, output_dtypes, count, dtype):
    """A stand-in launch: each output holds its elements' indices (modulo 251), after
    every input (so a member's view shows which elements of the buffer it reads)."""
    outs = []
    for shape, out_dtype in zip(output_shapes, output_dtypes):
        size = int(np.prod(shape))
        pattern = (mx.arange(size, dtype=mx.int32) % 251).astype(out_dtype)
        outs.append(pattern.reshape(shape))
    arrays = [array for array in inputs if isinstance(array, mx.array)]
    return mx.depends(outs, arrays)


@pytest.fixture
def tensor_cores_on_cpu(monkeypatch):
    """The kernel path taken as on CUDA (the tensor-core matmul for K >= 256)."""
    monkeypatch.setattr(groups, "launch_groups", pattern_launch)
    monkeypatch.setattr(groups, "_REPLAYS", {})
    monkeypatch.setattr(backend, "use_kernel_path", lambda use, auto: use is not False)
    monkeypatch.setattr(backend, "BACKEND", "cuda")
    monkeypatch.delenv(tensor_qmm.MEMBER_MAJOR_ENV, raising=False)


def _attention_members(seed: int = 0, dtype=mx.bfloat16):
    """Glimmer-like q / k / v / gate projections: 4 and 2 heads of 128, K 256, 4-bit."""
    mx.random.seed(seed)
    layers = []
    for width in (512, 256, 256, 512):
        layer = nn.Linear(256, width, bias=False)
        layer.set_dtype(dtype)
        layers.append(nn.QuantizedLinear.from_linear(layer, group_size=64, bits=4))
    mx.eval([layer.parameters() for layer in layers])
    return layers


def _nodes(tmp_path, *arrays: mx.array) -> Counter:
    dot = tmp_path / "graph.dot"
    mx.export_to_dot(str(dot), *arrays)
    return Counter(re.findall(r'label ="([A-Za-z_0-9]+)"', dot.read_text()))


@pytest.mark.parametrize("lead", [(1, 16), (2, 3), (1, 1)])
def test_the_fused_output_is_the_buffer_the_members_views_are_cut_from(
    tensor_cores_on_cpu, tmp_path, lead
) -> None:
    """Each member's own output is its block of the fused output, from the offset
    given: ``(rows, width)`` row-contiguous. The fused output holds no view; the
    members' outputs one each."""
    group = FusedProjections(_attention_members())
    x = mx.random.normal((*lead, 256)).astype(mx.bfloat16)
    rows = int(np.prod(lead))
    y, offsets = group.fused_output(x, None)
    assert offsets == (0, rows * 512, rows * 768, rows * 1024)
    assert y.shape == (rows * 1536,) and y.dtype == mx.bfloat16
    assert group.member_offsets(x, None) == offsets
    members = [group.output(index, x, None) for index in range(4)]
    # Counted before anything is evaluated (an evaluated array is a leaf).
    assert _nodes(tmp_path, y)["AsStrided"] == 0
    assert _nodes(tmp_path, *members)["AsStrided"] == 4
    for member, offset, (start, stop) in zip(members, offsets, group.bounds):
        width = stop - start
        assert member.shape == (*lead, width)
        block = y[offset : offset + rows * width].reshape(*lead, width)
        assert np.array_equal(bits(member), bits(block))


def test_the_fused_output_serves_only_the_member_major_kernel_form(
    tensor_cores_on_cpu, monkeypatch
) -> None:
    """None (nothing launched) for the mlx form, a tails set, a launch that stores
    the plain layout (``DFLASH_QMM_MEMBER_MAJOR=0``, or K below the tensor-core
    form's), and an input of another dtype than the stack's (the members' patched
    calls do not hand it to the set's launch)."""
    x = mx.random.normal((1, 16, 256)).astype(mx.bfloat16)
    assert (
        FusedProjections(_attention_members(), form="mlx").fused_output(x, None) is None
    )
    tails = FusedProjections(_attention_members(1), tails=True)
    assert tails.fused_output(x, None) is None
    group = FusedProjections(_attention_members(2))
    assert group.fused_output(x.astype(mx.float32), None) is None
    assert group.fused_output(x, False) is None  # the reference matmul
    monkeypatch.setenv(tensor_qmm.MEMBER_MAJOR_ENV, "0")
    plain = FusedProjections(_attention_members(3))
    assert plain.fused_output(x, None) is None
    assert plain.member_offsets(x, None) is None


# --------------------------------------------------------------------- CUDA


@pytest.mark.cuda
@cuda
@settings(max_examples=30, deadline=None)
@given(
    case=cases(max_queries=16, dtypes=(mx.bfloat16, mx.float16), **_SMALL),
    before=st.integers(0, 5000),
    after=st.integers(0, 40),
)
def test_cuda_gate_at_an_offset_gives_the_gates_own_bits(
    case: Case, before: int, after: int
) -> None:
    built = build(case)
    gate = _gate(built)
    buffer = _in_buffer(gate, before, after, case.seed)
    in_place = launch_gated(built, buffer, before)
    own = launch_gated(built, gate)
    assert np.array_equal(bits(in_place), bits(own)), case


@pytest.mark.cuda
@cuda
@pytest.mark.parametrize("queries", [1, 16])
@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float16])
def test_cuda_gate_at_an_offset_gives_the_gates_own_bits_at_glimmer_shapes(
    queries: int, dtype
) -> None:
    """Glimmer's gate after q / k / v in the fused output: 32 query and 2 key heads of
    128, so the gate starts at element ``rows * (32 + 2 * 2) * 128``."""
    case = Case(
        1, 2, 16, 128, dtype, True, 1024, 3000, queries, queries, 17, 1024, True,
        None, 256, 5,
    )  # fmt: skip
    built = build(case)
    gate = _gate(built)
    before = queries * (32 + 2 * 2) * 128
    buffer = _in_buffer(gate, before, 0, 5)
    in_place = launch_gated(built, buffer, before)
    own = launch_gated(built, gate)
    assert np.array_equal(bits(in_place), bits(own))
