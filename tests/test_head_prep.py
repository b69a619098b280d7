"""Head prep (RMS norm, scale and RoPE of q and k in one launch): reference, Metal body,
CUDA twin.

What is proven where:

* CPU (CI): the Metal body compiles (g++ against the Metal shim) and the CUDA twin to
  a cubin (nvcc, when installed). The emulated Metal body equals, bit for bit, a NumPy
  oracle of the documented arithmetic (tests/support/head_prep_oracle.py) over
  dtypes, head dims, head counts, tokens, positions, weights, scales and RoPE bases;
  each token of a block gets the bits of that token alone at its position; the
  results are close to float64 maths; two mutants (a position off by one, the keys'
  head count used for the queries) fail. Bad arguments raise before anything runs.
* CUDA (tests marked ``cuda``): the kernel gives the bits of mlx's own ops (the
  reference: ``rms_norm``, ``* scale``, ``rope``) and is batch-invariant.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support.compilers import GXX, NVCC, built_emulator, needs_gxx, needs_nvcc
from support.group_emulator import GroupEmulator, check_cuda, check_metal
from support.head_prep_oracle import oracle_head_prep

from dflash.metal import backend, groups, heads

cuda = pytest.mark.skipif(not mx.cuda.is_available(), reason="needs mlx's CUDA backend")
_SHARED = [HealthCheck.function_scoped_fixture]


def _mutant(name: str, old: str, new: str):
    spec = heads.HEAD_PREP
    assert old in spec.body
    return dataclasses.replace(
        spec, base=f"{spec.base}_{name}", body=spec.body.replace(old, new)
    )


MUTANTS = {
    # Every token rotated as if one position later.
    "position": _mutant(
        "position",
        "const int position = start + token;",
        "const int position = start + 1 + token;",
    ),
    # The queries' tokens counted with the keys' head count.
    "heads": _mutant(
        "heads",
        "const int heads = is_q ? q_heads : k_heads;",
        "const int heads = k_heads;",
    ),
}
STACK_MUTANTS = {
    # The stacked block laid out token-major, as the projections give it.
    "token_major": _mutant(
        "token_major",
        "((r / (heads * seq)) * heads + r % heads) * seq + token",
        "((r / (heads * seq)) * seq + token) * heads + r % heads",
    ),
    # The values copied over the keys' half.
    "values_over_keys": _mutant("values_over_keys", "(is_v ? k_rows : 0) + ", "0 + "),
}


# The queries and keys read from the start of their inputs, whatever their offsets.
OFFSET_MUTANTS = {
    "offsets_ignored": dataclasses.replace(
        heads.HEAD_PREP,
        base="head_prep_offsets_ignored",
        body=heads.HEAD_PREP.body.replace("q[q_offset + ", "q[").replace(
            "k[k_offset + ", "k["
        ),
    ),
}
assert OFFSET_MUTANTS["offsets_ignored"].body.count("_offset + r") == 1  # v's only


@pytest.fixture(scope="module")
def emulator(tmp_path_factory):
    specs = list(heads.SPECS) + list(MUTANTS.values()) + list(STACK_MUTANTS.values())
    specs += list(OFFSET_MUTANTS.values())
    return built_emulator(GroupEmulator, tmp_path_factory, "head_prep_emulator", specs)


@pytest.fixture
def metal_on_cpu(emulator, monkeypatch):
    monkeypatch.setattr(backend, "BACKEND", "metal")
    monkeypatch.setattr(groups, "launch_groups", emulator.launch)
    return emulator


@dataclasses.dataclass(frozen=True)
class Case:
    dtype: mx.Dtype
    dim: int
    batch: int
    seq: int
    q_heads: int
    k_heads: int
    start: int
    rope_base: object
    q_weight: bool
    k_weight: bool
    q_scale: float
    eps: float
    seed: int

    def values(self):
        """The v projection's heads for :func:`heads.head_prep`'s stacked form."""
        shape = (self.batch, self.seq, self.k_heads, self.dim)
        given = 2 * mx.random.normal(shape, key=mx.random.key(self.seed + 1))
        return given.astype(self.dtype)

    def arrays(self):
        key = mx.random.key(self.seed)
        parts = mx.random.split(key, 4)
        shape = (self.batch, self.seq)
        queries = 4 * mx.random.normal(shape + (self.q_heads, self.dim), key=parts[0])
        keys = mx.random.normal(shape + (self.k_heads, self.dim), key=parts[1])
        weights = [
            (1 + 0.5 * mx.random.normal((self.dim,), key=parts[i])).astype(self.dtype)
            for i in (2, 3)
        ]
        return queries.astype(self.dtype), keys.astype(self.dtype), weights

    def arguments(self, weights):
        return dict(
            eps=self.eps,
            k_eps=self.eps * 10,
            q_weight=weights[0] if self.q_weight else None,
            k_weight=weights[1] if self.k_weight else None,
            q_scale=self.q_scale,
            rope_base=self.rope_base,
            start=self.start,
        )


@st.composite
def cases(draw, dims=(16, 32, 64, 128, 256), max_seq=17):
    dtype = draw(st.sampled_from(heads.DTYPES))
    dim = draw(st.sampled_from([d for d in dims if heads.kernel_serves(d, dtype)]))
    return Case(
        dtype=dtype,
        dim=dim,
        batch=draw(st.integers(1, 2)),
        seq=draw(st.integers(1, max_seq)),
        q_heads=draw(st.integers(1, 5)),
        k_heads=draw(st.integers(1, 3)),
        start=draw(st.one_of(st.integers(0, 64), st.integers(0, 1 << 17))),
        rope_base=draw(st.sampled_from([None, 10000.0, 500000.0, 1000000.0])),
        q_weight=draw(st.booleans()),
        k_weight=draw(st.booleans()),
        q_scale=draw(st.sampled_from([1.0, 3.87, 0.125])),
        eps=draw(st.sampled_from([1e-5, 1e-6])),
        seed=draw(st.integers(0, 1 << 20)),
    )


def _bits(array: mx.array) -> np.ndarray:
    return np.array(array.astype(mx.float32))


def _same_bits(got, want) -> bool:
    return all(
        np.array_equal(_bits(g) if isinstance(g, mx.array) else g, _bits(w))
        for g, w in zip(got, want)
    )


def assert_each_token_gets_its_bits_alone(case: Case) -> None:
    """Each token of a block, run through the kernel, equals that token run alone at
    its position, bit for bit."""
    queries, keys, weights = case.arrays()
    arguments = case.arguments(weights)
    together = heads.head_prep(queries, keys, use_kernel=True, **arguments)
    for s in range(case.seq):
        alone = heads.head_prep(
            queries[:, s : s + 1],
            keys[:, s : s + 1],
            use_kernel=True,
            **{**arguments, "start": case.start + s},
        )
        assert _same_bits(alone, [t[:, s : s + 1] for t in together]), (case, s)


def oracle_stacked(queries, keys, values, **arguments):
    """The oracle's queries, and its keys stacked head-major with the values."""
    q, k = oracle_head_prep(queries, keys, **arguments)
    v = _bits(values)
    return q, np.stack([k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)])


def assert_each_token_of_the_block_gets_its_bits_alone(case: Case) -> None:
    """The stacked form: each token's queries and block rows equal that token run
    alone at its position, bit for bit."""
    queries, keys, weights = case.arrays()
    values = case.values()
    arguments = case.arguments(weights)
    q, block = heads.head_prep(
        queries, keys, values=values, use_kernel=True, **arguments
    )
    for s in range(case.seq):
        alone = heads.head_prep(
            queries[:, s : s + 1],
            keys[:, s : s + 1],
            values=values[:, s : s + 1],
            use_kernel=True,
            **{**arguments, "start": case.start + s},
        )
        assert _same_bits(alone, [q[:, s : s + 1], block[:, :, :, s : s + 1]]), (
            case,
            s,
        )


# ------------------------------------------------------------------ compile


@needs_gxx
def test_metal_body_compiles(tmp_path: Path) -> None:
    result = check_metal(heads.SPECS, tmp_path, GXX)
    assert result.ok, f"{result.command}\n{result.log}"


@needs_nvcc
def test_cuda_body_compiles(tmp_path: Path) -> None:
    result = check_cuda(heads.SPECS, tmp_path, NVCC)
    assert result.ok, f"{result.command}\n{result.log}"


def test_kernel_serves_the_heads_mlx_norms_in_one_pass() -> None:
    assert heads.kernel_serves(128, mx.bfloat16)
    assert heads.kernel_serves(256, mx.float32)
    assert not heads.kernel_serves(512, mx.bfloat16)
    assert not heads.kernel_serves(20, mx.bfloat16)  # not whole 16-byte vectors
    assert heads.vector_width(mx.float16) == 8


def test_log2_base_is_the_float32_log2_of_the_float32_base() -> None:
    for base in (10000.0, 500000.0, 1000000.0, 1e4 + 0.3):
        want = math.log2(float(np.float32(base)))
        assert abs(heads.log2_base(base) - want) <= 2 * np.spacing(np.float32(want))


# ----------------------------------------------------------- emulated body


@settings(max_examples=60, deadline=None, suppress_health_check=_SHARED)
@given(case=cases())
def test_emulated_kernel_gives_the_oracle_bits(metal_on_cpu, case: Case) -> None:
    queries, keys, weights = case.arrays()
    arguments = case.arguments(weights)
    got = heads.head_prep(queries, keys, use_kernel=True, **arguments)
    want = oracle_head_prep(queries, keys, **arguments)
    assert got[0].shape == queries.shape and got[1].shape == keys.shape
    for g, w in zip(got, want):
        np.testing.assert_array_equal(_bits(g), w, err_msg=str(case))


@settings(max_examples=40, deadline=None, suppress_health_check=_SHARED)
@given(case=cases())
def test_emulated_stacked_block_gives_the_oracle_bits(metal_on_cpu, case: Case) -> None:
    """With values, the keys and the copied values land head-major in one block."""
    queries, keys, weights = case.arrays()
    values = case.values()
    arguments = case.arguments(weights)
    got = heads.head_prep(queries, keys, values=values, use_kernel=True, **arguments)
    want = oracle_stacked(queries, keys, values, **arguments)
    assert got[1].shape == (2, case.batch, case.k_heads, case.seq, case.dim)
    for g, w in zip(got, want):
        np.testing.assert_array_equal(_bits(g), w, err_msg=str(case))


@settings(max_examples=15, deadline=None, suppress_health_check=_SHARED)
@given(case=cases(dims=(64, 128), max_seq=9))
def test_each_token_of_a_stacked_block_gets_the_bits_it_gets_alone(
    metal_on_cpu, case: Case
) -> None:
    assert_each_token_of_the_block_gets_its_bits_alone(case)


def launch_merged_and_split(case: Case, stacked: bool):
    """One launch of ``case`` with the heads split ``(B, S, H, D)`` and one with them
    merged ``(B, S, H * D)`` as the projections give them (``head_dim``)."""
    queries, keys, weights = case.arrays()
    values = case.values() if stacked else None
    arguments = case.arguments(weights)
    prep = heads.Prep(
        arguments["eps"], arguments["k_eps"], arguments["q_weight"],
        arguments["k_weight"], arguments["q_scale"], 1.0, arguments["rope_base"],
        1.0, arguments["start"],
    )  # fmt: skip
    ints = heads.head_prep_ints(queries.shape, case.k_heads, prep, stacked)
    split = heads.launch_head_prep(queries, keys, prep, ints, values)

    def merge(array):
        return None if array is None else array.reshape(case.batch, case.seq, -1)

    merged = heads.launch_head_prep(
        merge(queries), merge(keys), prep, ints, merge(values), head_dim=case.dim
    )
    return merged, split


@settings(max_examples=40, deadline=None, suppress_health_check=_SHARED)
@given(case=cases(), stacked=st.booleans())
def test_emulated_merged_heads_give_the_split_heads_outputs(
    metal_on_cpu, case: Case, stacked: bool
) -> None:
    """A traced layer hands the head prep its projections with the heads merged
    (no reshapes): the launch reads the same elements, so it gives the same shapes
    and bits as with the heads split."""
    merged, split = launch_merged_and_split(case, stacked)
    assert [a.shape for a in merged] == [a.shape for a in split], case
    assert _same_bits(merged, split), case


@pytest.mark.parametrize("name", sorted(STACK_MUTANTS))
def test_stacked_block_mutants_fail_the_oracle(
    metal_on_cpu, monkeypatch, name: str
) -> None:
    """Negative controls: a block laid out token-major, or values over the keys."""
    monkeypatch.setattr(heads, "HEAD_PREP", STACK_MUTANTS[name])
    case = Case(mx.bfloat16, 64, 1, 3, 2, 2, 9, 10000.0, False, False, 3.87, 1e-5, 5)
    queries, keys, weights = case.arrays()
    values = case.values()
    arguments = case.arguments(weights)
    got = heads.head_prep(queries, keys, values=values, use_kernel=True, **arguments)
    want = oracle_stacked(queries, keys, values, **arguments)
    np.testing.assert_array_equal(_bits(got[0]), want[0])
    assert not np.array_equal(_bits(got[1]), want[1])


def test_stacked_reference_is_the_plane_stack_of_the_prepared_keys() -> None:
    """The reference block is ``mx.stack`` of the prepared keys and the values, each
    transposed to ``(B, H, S, D)``: what a plane's ``write`` stacks."""
    case = Case(mx.float16, 32, 2, 3, 2, 1, 5, 10000.0, True, False, 1.0, 1e-6, 11)
    queries, keys, weights = case.arrays()
    values = case.values()
    arguments = case.arguments(weights)
    q, k = heads.head_prep(queries, keys, use_kernel=False, **arguments)
    got = heads.head_prep(queries, keys, values=values, use_kernel=False, **arguments)
    want = mx.stack([k.transpose(0, 2, 1, 3), values.transpose(0, 2, 1, 3)])
    assert _same_bits(got, [q, want])


@settings(max_examples=25, deadline=None, suppress_health_check=_SHARED)
@given(case=cases(dims=(64, 128), max_seq=9))
def test_each_token_of_a_block_gets_the_bits_it_gets_alone(
    metal_on_cpu, case: Case
) -> None:
    assert_each_token_gets_its_bits_alone(case)


def _float64_maths(given, weight, eps, scale, rope_base, start) -> np.ndarray:
    x = np.array(given.astype(mx.float32)).astype(np.float64)
    y = x / np.sqrt((x * x).mean(axis=-1, keepdims=True) + eps)
    if weight is not None:
        y = y * np.array(weight.astype(mx.float32))
    y = y * scale
    if rope_base is None:
        return y
    pairs = x.shape[-1] // 2
    positions = start + np.arange(x.shape[1], dtype=np.float64)
    theta = positions[:, None] * rope_base ** (-np.arange(pairs) / pairs)
    cos, sin = np.cos(theta)[None, :, None], np.sin(theta)[None, :, None]
    x1, x2 = y[..., :pairs], y[..., pairs:]
    return np.concatenate([x1 * cos - x2 * sin, x1 * sin + x2 * cos], axis=-1)


@settings(max_examples=25, deadline=None, suppress_health_check=_SHARED)
@given(case=cases())
def test_emulated_kernel_is_close_to_float64_maths(metal_on_cpu, case: Case) -> None:
    """Guards the oracle too: a step it shared with the kernel wrongly would show."""
    queries, keys, weights = case.arrays()
    arguments = case.arguments(weights)
    got = heads.head_prep(queries, keys, use_kernel=True, **arguments)
    for g, given_heads, weight, eps, scale in (
        (got[0], queries, arguments["q_weight"], case.eps, case.q_scale),
        (got[1], keys, arguments["k_weight"], case.eps * 10, 1.0),
    ):
        exact = _float64_maths(
            given_heads, weight, eps, scale, case.rope_base, case.start
        )
        top = np.abs(exact).max()
        ulp = {mx.bfloat16: 2.0**-7, mx.float16: 2.0**-10, mx.float32: 2.0**-23}
        # A few roundings in the dtype, and float32's angle at large positions.
        tolerance = top * (4 * ulp[case.dtype] + (case.start + case.seq) * 2.0**-21)
        assert np.abs(_bits(g) - exact).max() <= tolerance, case


@pytest.mark.parametrize("name", sorted(MUTANTS))
def test_mutants_fail_the_oracle(metal_on_cpu, monkeypatch, name: str) -> None:
    """Negative controls: the oracle test would catch a one-position or head error."""
    monkeypatch.setattr(heads, "HEAD_PREP", MUTANTS[name])
    case = Case(mx.bfloat16, 128, 1, 4, 3, 2, 40, 10000.0, False, True, 3.87, 1e-5, 7)
    queries, keys, weights = case.arrays()
    arguments = case.arguments(weights)
    got = heads.head_prep(queries, keys, use_kernel=True, **arguments)
    want = oracle_head_prep(queries, keys, **arguments)
    assert not all(np.array_equal(_bits(g), w) for g, w in zip(got, want))


# ------------------------------------------- q / k / v read in place at offsets


@dataclasses.dataclass(frozen=True)
class Fused:
    """A member-major fused projection output holding ``case``'s queries, keys and
    values (and a gate) as blocks, in ``order``, ``gaps`` elements before each block
    (other members' columns, or anything: never read)."""

    case: Case
    stacked: bool
    order: tuple
    gaps: tuple

    def arrays(self):
        """``(y, offsets, copies)``: the fused output, the q / k / v offsets in it, and
        the queries, keys and values as separate arrays with the heads merged."""
        case = self.case
        queries, keys, _ = case.arrays()
        merged = {
            "q": queries.reshape(case.batch, case.seq, -1),
            "k": keys.reshape(case.batch, case.seq, -1),
            "v": case.values().reshape(case.batch, case.seq, -1),
            "gate": mx.random.normal(
                queries.shape, key=mx.random.key(case.seed + 2)
            ).astype(case.dtype),
        }
        parts, offsets, at = [], {}, 0
        for index, (name, gap) in enumerate(zip(self.order, self.gaps)):
            filler = 8 * mx.random.normal((gap,), key=mx.random.key(index))
            parts.append(filler.astype(case.dtype))
            offsets[name] = at + gap
            block = merged[name].reshape(-1)
            parts.append(block)
            at += gap + block.size
        # The fused output holds copies of the separate arrays (a concatenation).
        y = mx.concatenate(parts)
        copies = [merged[name] for name in "qkv"]
        mx.eval(y, copies)
        return y, (offsets["q"], offsets["k"], offsets["v"]), copies


@st.composite
def fused_cases(draw, dims=(16, 32, 64, 128, 256), max_seq=9):
    return Fused(
        case=draw(cases(dims=dims, max_seq=max_seq)),
        stacked=draw(st.booleans()),
        order=tuple(draw(st.permutations(["q", "k", "v", "gate"]))),
        gaps=tuple(draw(st.lists(st.integers(0, 70), min_size=4, max_size=4))),
    )


def _prep(case: Case, weights) -> heads.Prep:
    arguments = case.arguments(weights)
    return heads.Prep(
        arguments["eps"], arguments["k_eps"], arguments["q_weight"],
        arguments["k_weight"], arguments["q_scale"], 1.0, arguments["rope_base"],
        1.0, arguments["start"],
    )  # fmt: skip


def launch_in_place_and_copied(fused: Fused, offsets=None):
    """One launch reading q, k and v in place in the fused output at their offsets
    (``offsets``: these instead, for the launch's integers only), and one reading
    the copied arrays (heads merged, no offsets)."""
    case = fused.case
    y, at, copies = fused.arrays()
    prep = _prep(case, case.arrays()[2])
    q_shape = (case.batch, case.seq, case.q_heads, case.dim)
    ints = heads.head_prep_ints(
        q_shape, case.k_heads, prep, fused.stacked, offsets=offsets or at
    )
    geometry = (case.batch, case.seq, case.q_heads, case.k_heads)
    in_place = heads.launch_head_prep(
        y, y, prep, ints, y if fused.stacked else None, case.dim,
        offsets=at, geometry=geometry,
    )  # fmt: skip
    plain_ints = heads.head_prep_ints(q_shape, case.k_heads, prep, fused.stacked)
    queries, keys, values = copies
    copied = heads.launch_head_prep(
        queries, keys, prep, plain_ints, values if fused.stacked else None, case.dim
    )
    return in_place, copied


@settings(max_examples=40, deadline=None, suppress_health_check=_SHARED)
@given(fused=fused_cases())
def test_emulated_offsets_read_a_fused_output_as_the_copied_arrays(
    metal_on_cpu, fused: Fused
) -> None:
    """The head prep handed one member-major fused output (q, k, v and a gate as
    blocks, in any order, anything between them) with the members' offsets gives the
    shapes and bits it gives the three arrays copied out of it."""
    in_place, copied = launch_in_place_and_copied(fused)
    assert [a.shape for a in in_place] == [a.shape for a in copied], fused
    assert _same_bits(in_place, copied), fused


def test_emulated_offsets_default_to_the_bits_without_them(metal_on_cpu) -> None:
    """Every caller that gives no offsets reads its inputs from their start, as the
    kernel did before the offsets (zeros among its integers)."""
    case = Case(mx.bfloat16, 64, 1, 3, 2, 1, 9, 10000.0, True, False, 3.87, 1e-5, 4)
    queries, keys, weights = case.arrays()
    prep = _prep(case, weights)
    ints = heads.head_prep_ints(queries.shape, case.k_heads, prep, False)
    assert np.array(ints).tolist()[8:11] == [0, 0, 0]
    zero = heads.head_prep_ints(
        queries.shape, case.k_heads, prep, False, offsets=(0, 0, 0)
    )
    assert zero is ints  # memoised: the same array
    got = heads.launch_head_prep(queries, keys, prep, ints)
    want = oracle_head_prep(queries, keys, **case.arguments(weights))
    for g, w in zip(got, want):
        np.testing.assert_array_equal(_bits(g), w)


@pytest.mark.parametrize("slip", ["q_one_head_on", "k_at_v", "offsets_ignored"])
def test_a_wrong_offset_gives_other_bits(metal_on_cpu, monkeypatch, slip) -> None:
    """Negative controls: the queries read one head later, the keys read at the
    values' offset, or a body that ignores the offsets: other bits than the copies'."""
    case = Case(mx.bfloat16, 64, 1, 4, 3, 2, 17, 10000.0, False, True, 3.87, 1e-5, 8)
    fused = Fused(case, True, ("q", "k", "v", "gate"), (5, 0, 3, 1))
    _, (q, k, v), _ = fused.arrays()
    if slip == "offsets_ignored":
        monkeypatch.setattr(heads, "HEAD_PREP", OFFSET_MUTANTS[slip])
        offsets = None
    else:
        offsets = (q + case.dim, k, v) if slip == "q_one_head_on" else (q, v, v)
    in_place, copied = launch_in_place_and_copied(fused, offsets)
    assert not _same_bits(in_place, copied)


@pytest.mark.parametrize(
    "offsets, message",
    [
        ((0, -1, 0), "k_offset must be an int"),
        ((0, 0, 1.5), "v_offset must be an int"),
        ((True, 0, 0), "q_offset must be an int"),
        ((2**31, 0, 0), "q_offset must be an int"),
        ((0, 0), r"offsets must be \(q_offset, k_offset, v_offset\)"),
        ([0, 0, 0, 0], r"offsets must be \(q_offset, k_offset, v_offset\)"),
    ],
)
def test_bad_offsets_are_refused_before_anything_is_made(
    monkeypatch, offsets, message
) -> None:
    calls = []
    monkeypatch.setattr(groups, "launch_groups", lambda *a, **k: calls.append(a))
    monkeypatch.setattr(groups, "launch_replayed", lambda *a, **k: calls.append(a))
    made = []
    real = groups.int_params
    monkeypatch.setattr(heads, "int_params", lambda *v: made.append(v) or real(*v))
    prep = heads.Prep(1e-5)
    y = mx.zeros((4096,))
    with pytest.raises(ValueError, match=message):
        heads.head_prep_ints((1, 2, 2, 32), 1, prep, True, offsets=offsets)
    with pytest.raises(ValueError, match=message):
        heads.launch_head_prep(
            y, y, prep, real(0), y, 32, offsets=offsets, geometry=(1, 2, 2, 1)
        )
    assert not calls and not made


@pytest.mark.parametrize(
    "change, message",
    [
        # 2 * 2 * 32 = 128 query elements from 4000 on: past the 4096.
        (
            dict(offsets=(4000, 0, 0)),
            "q_offset 4000 reads 4 heads of 32 up to element 4128",
        ),
        (dict(offsets=(0, 4090, 0)), "k_offset 4090 reads 2 heads"),
        (dict(offsets=(0, 0, 4033)), "v_offset 4033 reads 2 heads"),
        (dict(geometry=None), "offsets, geometry and head_dim go together"),
        (dict(offsets=None), "offsets, geometry and head_dim go together"),
        (dict(head_dim=None), "offsets, geometry and head_dim go together"),
        (dict(geometry=(1, 2, 0, 1)), r"geometry must be \(B, S, Hq, Hkv\)"),
        (dict(geometry=(1, 2, 2)), r"geometry must be \(B, S, Hq, Hkv\)"),
        (dict(keys=mx.zeros((4096,), mx.float16)), "must share a dtype"),
    ],
)
def test_offsets_that_read_past_their_input_are_refused(
    monkeypatch, change, message
) -> None:
    """A launch with offsets checks every read lies inside its input (and the
    arguments that go with them) before anything is launched."""
    calls = []
    monkeypatch.setattr(groups, "launch_groups", lambda *a, **k: calls.append(a))
    monkeypatch.setattr(groups, "launch_replayed", lambda *a, **k: calls.append(a))
    y = mx.zeros((4096,))
    arguments = dict(
        queries=y, keys=y, prep=heads.Prep(1e-5), ints=groups.int_params(0),
        values=y, head_dim=32, offsets=(0, 128, 192), geometry=(1, 2, 2, 1),
    )  # fmt: skip
    arguments.update(change)
    with pytest.raises(ValueError, match=message):
        heads.launch_head_prep(**arguments)
    assert not calls


def test_offsets_read_up_to_the_last_element(monkeypatch) -> None:
    """The bounds are exact: a block that ends on the input's last element is taken."""
    calls = []
    monkeypatch.setattr(
        groups, "launch_replayed", lambda *a, **k: calls.append(a) or [None, None]
    )
    y = mx.zeros((4096,))
    # q: 128 elements, k and v: 64 each.
    heads.launch_head_prep(
        y, y, heads.Prep(1e-5), groups.int_params(0), y, 32,
        offsets=(4096 - 128, 4096 - 64, 4096 - 64), geometry=(1, 2, 2, 1),
    )  # fmt: skip
    assert len(calls) == 1


# ---------------------------------------------------------- the wrapper


def test_reference_is_mlx_lms_ops_in_order() -> None:
    """The reference is bit for bit ``rms_norm(x) * scale`` then ``rope`` on (B, H, S, D)."""
    case = Case(mx.bfloat16, 64, 1, 5, 4, 2, 123, 500000.0, False, False, 3.87, 1e-5, 3)
    queries, keys, weights = case.arrays()
    got = heads.head_prep(
        queries,
        keys,
        eps=1e-5,
        q_scale=3.87,
        rope_base=500000.0,
        start=123,
        use_kernel=False,
    )
    q = (mx.fast.rms_norm(queries, None, 1e-5) * 3.87).transpose(0, 2, 1, 3)
    k = mx.fast.rms_norm(keys, None, 1e-5).transpose(0, 2, 1, 3)
    rope = dict(traditional=False, base=500000.0, scale=1.0, offset=123)
    want = [mx.fast.rope(t, 64, **rope).transpose(0, 2, 1, 3) for t in (q, k)]
    assert _same_bits(got, want)


def test_cpu_takes_the_reference_unless_told(monkeypatch) -> None:
    monkeypatch.setattr(backend, "BACKEND", None)
    calls = []
    monkeypatch.setattr(groups, "launch_groups", lambda *a, **k: calls.append(a))
    q, k = mx.zeros((1, 2, 2, 32)), mx.zeros((1, 2, 1, 32))
    heads.head_prep(q, k, eps=1e-5)
    assert not calls
    with pytest.raises(RuntimeError, match="use_kernel=True"):
        heads.head_prep(q, k, eps=1e-5, use_kernel=True)


@pytest.mark.parametrize(
    "queries, keys, extra, message",
    [
        ((2, 4, 32), (1, 2, 1, 32), {}, r"\(B, S, H, D\)"),
        ((1, 2, 2, 32), (1, 3, 1, 32), {}, "share B, S and D"),
        ((1, 2, 2, 32), (1, 2, 1, 16), {}, "share B, S and D"),
        ((1, 2, 2, 30), (1, 2, 1, 30), {}, None),
        ((1, 2, 2, 31), (1, 2, 1, 31), {}, "even"),
        ((1, 2, 2, 32), (1, 2, 1, 32), {"q_weight": (16,)}, "q_weight"),
        ((1, 2, 2, 32), (1, 2, 1, 32), {"start": -1}, "start"),
        ((1, 2, 2, 32), (1, 2, 1, 32), {"start": 2.0}, "start"),
        ((1, 2, 2, 32), (1, 2, 1, 32), {"values": (1, 2, 2, 32)}, "values"),
        ((1, 2, 2, 32), (1, 2, 1, 32), {"values": (1, 1, 1, 32)}, "values"),
    ],
)
def test_bad_arguments_raise_before_anything_runs(
    monkeypatch, queries, keys, extra, message
) -> None:
    calls = []
    monkeypatch.setattr(groups, "launch_groups", lambda *a, **k: calls.append(a))
    arguments = dict(extra)
    for name in ("q_weight", "values"):
        if name in arguments:
            arguments[name] = mx.ones(arguments[name])
    call = lambda: heads.head_prep(  # noqa: E731
        mx.zeros(queries), mx.zeros(keys), eps=1e-5, use_kernel=False, **arguments
    )
    if message is None:
        call()  # a dim the kernel does not take runs the reference
    else:
        with pytest.raises(ValueError, match=message):
            call()
    assert not calls


def test_mismatched_dtypes_raise() -> None:
    with pytest.raises(ValueError, match="share one of"):
        heads.head_prep(
            mx.zeros((1, 1, 2, 32), mx.bfloat16), mx.zeros((1, 1, 1, 32)), eps=1e-5
        )
    with pytest.raises(ValueError, match="values must have"):
        heads.head_prep(
            mx.zeros((1, 1, 2, 32)),
            mx.zeros((1, 1, 1, 32)),
            values=mx.zeros((1, 1, 1, 32), mx.float16),
            eps=1e-5,
        )


# --------------------------------------------------------------------- CUDA


@pytest.mark.cuda
@cuda
@settings(max_examples=60, deadline=None)
@given(case=cases())
def test_cuda_kernel_gives_mlxs_bits(case: Case) -> None:
    queries, keys, weights = case.arrays()
    arguments = case.arguments(weights)
    got = heads.head_prep(queries, keys, use_kernel=True, **arguments)
    want = heads.head_prep(queries, keys, use_kernel=False, **arguments)
    assert _same_bits(got, want), case


@pytest.mark.cuda
@cuda
@pytest.mark.parametrize("seq", [1, 16])
@pytest.mark.parametrize("start", [0, 4096, 32768])
@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float16])
def test_cuda_kernel_gives_mlxs_bits_at_glimmer_shapes(seq, start, dtype) -> None:
    case = Case(dtype, 128, 1, seq, 32, 2, start, 500000.0, False, False, 3.87, 1e-5, 1)
    queries, keys, weights = case.arrays()
    arguments = case.arguments(weights)
    got = heads.head_prep(queries, keys, use_kernel=True, **arguments)
    want = heads.head_prep(queries, keys, use_kernel=False, **arguments)
    assert _same_bits(got, want)


@pytest.mark.cuda
@cuda
@pytest.mark.parametrize("seq", [1, 16])
@pytest.mark.parametrize("start", [0, 4096, 32768])
@pytest.mark.parametrize("q_heads", [32, 8])
def test_cuda_kernel_gives_mlxs_bits_at_the_drafters_shapes(
    seq, start, q_heads
) -> None:
    """The Muse Glimmer drafter's heads (32 query and 8 key heads of 128, both norms
    weighted, RoPE base 500000): a draft block, and a context append, whose keys stand
    in the queries' slot too (8 heads in both)."""
    case = Case(
        mx.bfloat16, 128, 1, seq, q_heads, 8, start, 500000.0, True, True, 1.0, 1e-5, 3
    )
    queries, keys, weights = case.arrays()
    arguments = case.arguments(weights)
    got = heads.head_prep(queries, keys, use_kernel=True, **arguments)
    want = heads.head_prep(queries, keys, use_kernel=False, **arguments)
    assert _same_bits(got, want)


@pytest.mark.cuda
@cuda
@settings(max_examples=20, deadline=None)
@given(case=cases(dims=(64, 128), max_seq=16))
def test_cuda_kernel_is_batch_invariant(case: Case) -> None:
    assert_each_token_gets_its_bits_alone(case)


@pytest.mark.cuda
@cuda
@settings(max_examples=40, deadline=None)
@given(case=cases())
def test_cuda_stacked_block_gives_mlxs_bits(case: Case) -> None:
    queries, keys, weights = case.arrays()
    values = case.values()
    arguments = case.arguments(weights)
    got = heads.head_prep(queries, keys, values=values, use_kernel=True, **arguments)
    want = heads.head_prep(queries, keys, values=values, use_kernel=False, **arguments)
    assert _same_bits(got, want), case


@pytest.mark.cuda
@cuda
@pytest.mark.parametrize("seq", [1, 16])
@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float16])
def test_cuda_stacked_block_gives_mlxs_bits_at_glimmer_shapes(seq, dtype) -> None:
    case = Case(dtype, 128, 1, seq, 32, 2, 4096, 500000.0, False, False, 3.87, 1e-5, 2)
    queries, keys, weights = case.arrays()
    values = case.values()
    arguments = case.arguments(weights)
    got = heads.head_prep(queries, keys, values=values, use_kernel=True, **arguments)
    want = heads.head_prep(queries, keys, values=values, use_kernel=False, **arguments)
    assert _same_bits(got, want)


@pytest.mark.cuda
@cuda
@settings(max_examples=15, deadline=None)
@given(case=cases(dims=(64, 128), max_seq=16))
def test_cuda_stacked_block_is_batch_invariant(case: Case) -> None:
    assert_each_token_of_the_block_gets_its_bits_alone(case)


@pytest.mark.cuda
@cuda
@settings(max_examples=30, deadline=None)
@given(case=cases(), stacked=st.booleans())
def test_cuda_merged_heads_give_the_split_heads_outputs(case: Case, stacked) -> None:
    merged, split = launch_merged_and_split(case, stacked)
    assert [a.shape for a in merged] == [a.shape for a in split], case
    assert _same_bits(merged, split), case


@pytest.mark.cuda
@cuda
@settings(max_examples=40, deadline=None)
@given(fused=fused_cases(max_seq=17))
def test_cuda_offsets_read_a_fused_output_as_the_copied_arrays(fused: Fused) -> None:
    in_place, copied = launch_in_place_and_copied(fused)
    assert [a.shape for a in in_place] == [a.shape for a in copied], fused
    assert _same_bits(in_place, copied), fused


@pytest.mark.cuda
@cuda
@pytest.mark.parametrize("seq", [1, 16])
@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float16])
def test_cuda_offsets_give_mlxs_bits_at_glimmer_shapes(seq, dtype) -> None:
    """Glimmer's fused q / k / v / gate output (32 query and 2 key heads of 128,
    member-major, gaps of nothing): the launch reading it in place gives the copies'
    bits, which are mlx's own ops' (the reference)."""
    case = Case(dtype, 128, 1, seq, 32, 2, 4096, 500000.0, False, False, 3.87, 1e-5, 6)
    fused = Fused(case, True, ("q", "k", "v", "gate"), (0, 0, 0, 0))
    in_place, copied = launch_in_place_and_copied(fused)
    assert _same_bits(in_place, copied)
    queries, keys, weights = case.arrays()
    want = heads.head_prep(
        queries, keys, values=case.values(), use_kernel=False, **case.arguments(weights)
    )
    assert _same_bits(in_place, want)
