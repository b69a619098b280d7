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


@pytest.fixture(scope="module")
def emulator(tmp_path_factory):
    specs = list(heads.SPECS) + list(MUTANTS.values()) + list(STACK_MUTANTS.values())
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
