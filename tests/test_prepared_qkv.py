"""The fused q / k / v / gate matmul's prepared form (``tensor_qmm.prepared_spec``): the
head prep as the launch's last step, on the CPU emulator.

The prepared launch's member-major result must hold, bit for bit, what the plain
launch's result gives after the head prep (the NumPy oracle of ``heads``' kernel,
itself held to the kernel elsewhere): the queries prepared in place, the keys
prepared and the values as they are in the stacked head-major block, the gate as it
is. Over rows, batches, positions, norms with and without weights, RoPE or none, K
split or not, the merged split sum and thread-block clusters of 2 to 4, copies
landing early or late. Negative controls: a pass that reads the wrong half of a RoPE
pair, a butterfly one step short, and cluster ranks that sum other rows than the ones
they prepare.
"""

from __future__ import annotations

import dataclasses
import re

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support.compilers import NVCC, built_emulator, needs_nvcc
from support.group_emulator import check_cuda, entry_registers
from support.head_prep_oracle import oracle_head_prep
from support.tensor_emulator import TensorEmulator, pretend_cluster_device

from dflash.metal import heads, tensor_qmm

GROUP_SIZE = 64
CHUNK = tensor_qmm.Layout(4, 1).chunk
DIM = tensor_qmm.COLUMNS
Q_HEADS, KV_HEADS = 2, 1
WIDTHS = (Q_HEADS * DIM, KV_HEADS * DIM, KV_HEADS * DIM, Q_HEADS * DIM)
EDGES = tuple(int(e) for e in np.cumsum(WIDTHS)[:-1])
COLUMNS = sum(WIDTHS)


def _bf16(spec):
    return dataclasses.replace(spec, dtypes=(mx.bfloat16,))


# (table, key, switches): the shipped scaled two-K-group form of one m-tile and the
# plain one-K-group form (the other staging path: it settles its copies first).
FORMS = {
    "scaled_k2": (
        tensor_qmm.SCALED_SPECS,
        (2, (4, 1), GROUP_SIZE),
        {tensor_qmm.SCALED_B_ENV: "1", tensor_qmm.TWO_K_GROUPS_ENV: "1"},
    ),
    "plain_k1": (
        tensor_qmm.FORM_SPECS[(False, 1)],
        (4, 1),
        {tensor_qmm.SCALED_B_ENV: "0", tensor_qmm.TWO_K_GROUPS_ENV: "0"},
    ),
}
BASES = {name: _bf16(table[key]) for name, (table, key, _) in FORMS.items()}
PREPARED = {name: tensor_qmm.prepared_spec(spec) for name, spec in BASES.items()}
PREPARED_CLUSTERS = {
    size: tensor_qmm.prepared_spec(tensor_qmm.cluster_spec(BASES["scaled_k2"], size))
    for size in range(2, tensor_qmm.MAX_CLUSTER + 1)
}


def _mutant(spec, suffix: str, old: str, new: str):
    assert old in spec.body, old
    return dataclasses.replace(
        spec, base=f"{spec.base}_{suffix}", body=spec.body.replace(old, new, 1)
    )


# Negative controls: RoPE's pair read the wrong way round; a cluster's ranks each
# summing the next rank's rows while preparing their own.
SWAPPED_PAIR = _mutant(
    PREPARED["scaled_k2"],
    "swapped",
    "const float x1 = hp_x[0];\n            const float x2 = hp_x[1];",
    "const float x1 = hp_x[1];\n            const float x2 = hp_x[0];",
)
# ... and a butterfly that stops one step short (each lane then holds half the sum).
SHORT_BUTTERFLY = _mutant(
    PREPARED["scaled_k2"],
    "short",
    "for (int m = 16; m > 0; m /= 2) {",
    "for (int m = 16; m > 1; m /= 2) {",
)
OTHER_ROWS = _mutant(
    PREPARED_CLUSTERS[3],
    "otherrows",
    "if (r % CLUSTER == split && col0 + c < n_cols) {",
    "if (r % CLUSTER == (split + 1) % CLUSTER && col0 + c < n_cols) {",
)


@pytest.fixture(scope="module")
def prepared_emulator(tmp_path_factory):
    specs = (
        tuple(BASES.values())
        + tuple(PREPARED.values())
        + tuple(PREPARED_CLUSTERS.values())
        + (SWAPPED_PAIR, SHORT_BUTTERFLY, OTHER_ROWS)
    )
    return built_emulator(TensorEmulator, tmp_path_factory, "prepared_emulator", specs)


@pytest.fixture
def emulated(prepared_emulator, monkeypatch):
    """bind_tensor_core on a pretend CUDA device with clusters (graphs off), its
    launches run by the emulator, the plan's forms the bfloat16 copies built here."""
    copies = [(table, key, BASES[name]) for name, (table, key, _) in FORMS.items()]
    yield from pretend_cluster_device(prepared_emulator, monkeypatch, copies)


@dataclasses.dataclass
class Case:
    x: mx.array
    weight: mx.array
    scales: mx.array
    biases: mx.array
    batch: int
    seq: int
    prep: heads.Prep


@st.composite
def cases(draw, max_splits: int = 4):
    batch = draw(st.sampled_from([1, 1, 2]))
    seq = draw(st.integers(1, 16 // batch))
    splits = draw(st.integers(1, max_splits))
    rng = np.random.default_rng(draw(st.integers(0, 2**16)))
    depth = CHUNK * splits
    dense = mx.array(rng.standard_normal((COLUMNS, depth)).astype(np.float32))
    x = mx.array(rng.standard_normal((batch * seq, depth)).astype(np.float32))
    weight, scales, biases = mx.quantize(
        dense.astype(mx.bfloat16), group_size=GROUP_SIZE, bits=4
    )

    def norm_weight():
        if not draw(st.booleans()):
            return None
        values = rng.uniform(0.5, 1.5, DIM).astype(np.float32)
        return mx.array(values).astype(mx.bfloat16)

    prep = heads.Prep(
        eps=draw(st.sampled_from([1e-6, 1e-5])),
        k_eps=draw(st.sampled_from([None, 1e-5])),
        q_weight=norm_weight(),
        k_weight=norm_weight(),
        q_scale=draw(st.sampled_from([1.0, DIM**-0.5])),
        k_scale=1.0,
        rope_base=draw(st.sampled_from([None, 10000.0, 1e6])),
        rope_scale=draw(st.sampled_from([1.0, 0.25])),
        start=draw(st.integers(0, 40000)),
    )
    return Case(x.astype(mx.bfloat16), weight, scales, biases, batch, seq, prep)


def _bind(case: Case, prepared: bool):
    x = case.x
    return tensor_qmm.bind_tensor_core(
        x.shape[0], x.shape[1], case.weight, case.scales, case.biases, 4,
        GROUP_SIZE, x.dtype, members=EDGES, prepared=prepared,
    )  # fmt: skip


def _heads(case: Case):
    ints = heads.head_prep_ints(
        (case.batch, case.seq, Q_HEADS, DIM), KV_HEADS, case.prep, True
    )
    return heads.prepared_inputs(case.prep, ints, mx.bfloat16)


def _expected(case: Case, plain: mx.array) -> np.ndarray:
    """The plain launch's members after the oracle's head prep, laid out as the
    prepared launch stores them (float32 values)."""
    rows = case.batch * case.seq
    flat = np.array(plain.astype(mx.float32))
    starts = [0, *[e * rows for e in EDGES], COLUMNS * rows]
    q, k, v, gate = (flat[a:b] for a, b in zip(starts[:-1], starts[1:]))
    shape = lambda h: (case.batch, case.seq, h, DIM)  # noqa: E731
    as_mx = lambda a, h: mx.array(a.reshape(shape(h))).astype(mx.bfloat16)  # noqa
    arguments = dataclasses.asdict(case.prep)
    queries, keys = oracle_head_prep(as_mx(q, Q_HEADS), as_mx(k, KV_HEADS), **arguments)
    head_major = lambda a: a.reshape(shape(KV_HEADS)).transpose(0, 2, 1, 3)  # noqa
    return np.concatenate(
        [
            queries.reshape(-1),
            head_major(keys).reshape(-1),
            head_major(v).reshape(-1),
            gate,
        ]
    )


def _run(emulator, case: Case, cluster: bool, form: str = "scaled_k2"):
    with pytest.MonkeyPatch.context() as patch:
        for name, value in FORMS[form][2].items():
            patch.setenv(name, value)
        # The plain launch merges its split (the cluster sum's bits: test_tensor_cluster).
        patch.setenv(tensor_qmm.CLUSTER_SUM_ENV, "0")
        before = emulator.launches
        plain = _bind(case, False)(case.x)
        patch.setenv(tensor_qmm.CLUSTER_SUM_ENV, "1" if cluster else "0")
        y = _bind(case, True)(case.x, heads=_heads(case))
        mx.eval(plain, y)
    assert emulator.launches == before + 2
    return np.array(y.astype(mx.float32)), _expected(case, plain), emulator.launched[-1]


_FIXTURES = [HealthCheck.function_scoped_fixture]


@pytest.mark.parametrize("form", sorted(FORMS))
@settings(max_examples=12, deadline=None, suppress_health_check=_FIXTURES)
@given(case=cases(), late=st.booleans())
def test_the_prepared_launch_gives_the_head_preps_bits(emulated, form, case, late):
    """No K split, or one summed by the launch's last CTA: every element of the
    prepared result equals the plain launch's after the head prep."""
    emulated.late = late
    got, want, launched = _run(emulated, case, cluster=False, form=form)
    assert launched.endswith(tensor_qmm.PREPARED_SUFFIX)
    assert np.array_equal(got, want)


@settings(max_examples=16, deadline=None, suppress_health_check=_FIXTURES)
@given(case=cases(), late=st.booleans())
def test_the_prepared_cluster_launch_gives_the_head_preps_bits(emulated, case, late):
    """A K split of 2 to 4 summed in a cluster, each rank preparing its own rows."""
    emulated.late = late
    splits = tensor_qmm.split_plan(case.x.shape[1], COLUMNS, 4, True)[1]
    got, want, launched = _run(emulated, case, cluster=True)
    if splits > 1:
        assert launched == PREPARED_CLUSTERS[splits].base
    assert np.array_equal(got, want)


def _forced(emulator, spec, case: Case) -> np.ndarray:
    """One launch of ``spec`` in place of the prepared form the plan picks."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(tensor_qmm.CLUSTER_SUM_ENV, "1" if spec.cluster > 1 else "0")
        for name, value in FORMS["scaled_k2"][2].items():
            patch.setenv(name, value)
        patch.setattr(tensor_qmm, "prepared_spec", lambda _: spec)
        y = _bind(case, True)(case.x, heads=_heads(case))
        mx.eval(y)
    return np.array(y.astype(mx.float32))


def _fixed_case(splits: int, rope: bool, seq: int = 5) -> Case:
    rng = np.random.default_rng(7)
    depth = CHUNK * splits
    dense = mx.array(rng.standard_normal((COLUMNS, depth)).astype(np.float32))
    weight, scales, biases = mx.quantize(
        dense.astype(mx.bfloat16), group_size=GROUP_SIZE, bits=4
    )
    x = mx.array(rng.standard_normal((seq, depth)).astype(np.float32))
    prep = heads.Prep(eps=1e-6, rope_base=10000.0 if rope else None, start=300)
    return Case(x.astype(mx.bfloat16), weight, scales, biases, 1, seq, prep)


def test_a_swapped_rope_pair_is_caught(emulated) -> None:
    case = _fixed_case(1, rope=True)
    got = _forced(emulated, SWAPPED_PAIR, case)
    _, want, _ = _run(emulated, case, cluster=False)
    assert not np.array_equal(got, want)


def test_a_short_butterfly_is_caught(emulated) -> None:
    case = _fixed_case(1, rope=False)
    got = _forced(emulated, SHORT_BUTTERFLY, case)
    _, want, _ = _run(emulated, case, cluster=False)
    assert not np.array_equal(got, want)


def test_a_cluster_rank_preparing_rows_it_did_not_sum_is_caught(emulated) -> None:
    case = _fixed_case(3, rope=False)
    assert tensor_qmm.split_plan(case.x.shape[1], COLUMNS, 4, True)[1] == 3
    got = _forced(emulated, OTHER_ROWS, case)
    _, want, _ = _run(emulated, case, cluster=True)
    assert not np.array_equal(got, want)


def test_the_prepared_form_refuses_what_it_cannot_take(emulated) -> None:
    case = _fixed_case(1, rope=False)
    x = case.x
    with pytest.raises(ValueError, match="three member edges"):
        tensor_qmm.bind_tensor_core(
            x.shape[0], x.shape[1], case.weight, case.scales, case.biases, 4,
            GROUP_SIZE, x.dtype, members=EDGES[:2], prepared=True,
        )  # fmt: skip
    call = _bind(case, True)
    with pytest.raises(ValueError, match="heads="):
        call(x)
    swiglu = tensor_qmm.SWIGLU_SPECS[(1, (4, 1))]
    assert not tensor_qmm.prepared_serves(swiglu)
    with pytest.raises(ValueError, match="no prepared-heads form"):
        tensor_qmm.prepared_spec(swiglu)


def _compiled_forms() -> list:
    """The prepared forms the default switches can pick for a q / k / v / gate stack
    of up to 16 rows: two K groups, one m-tile, 4-bit (scaled, denormal, pairs in
    place) in every group size and dense; each plain and in a cluster of 3 (full-size
    Glimmer's split), and clusters of 2 and 4 of the scaled groups of 64."""
    bases = [
        table[(2, (4, 1), size)]
        for table in (
            tensor_qmm.SCALED_SPECS,
            tensor_qmm.DENORMAL_SPECS,
            tensor_qmm.IN_PLACE_SPECS,
        )
        for size in tensor_qmm.GROUP_SIZES
    ]
    bases.append(tensor_qmm.FORM_SPECS[(False, 2)][(0, 1)])
    forms = [tensor_qmm.prepared_spec(spec) for spec in bases]
    forms += [tensor_qmm.prepared_spec(tensor_qmm.cluster_spec(s, 3)) for s in bases]
    scaled = tensor_qmm.SCALED_SPECS[(2, (4, 1), GROUP_SIZE)]
    forms += [
        tensor_qmm.prepared_spec(tensor_qmm.cluster_spec(scaled, size))
        for size in (2, 4)
    ]
    return forms


@needs_nvcc
def test_the_prepared_forms_compile_for_sm90_within_their_bounds(tmp_path) -> None:
    """No spills, and at most the two-K-group forms' 128 registers (their launch
    bounds: two CTAs an SM), in bfloat16 (float16 differs in the conversions only)."""
    forms = _compiled_forms()
    built = check_cuda(
        forms, tmp_path, NVCC, dtypes=(mx.bfloat16,), flags=("-Xptxas", "-v")
    )
    assert built.ok, f"{built.command}\n{built.log}"
    assert len(re.findall(r"Compiling entry function", built.log)) == len(forms)
    spills = re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", built.log)
    assert len(spills) >= len(forms)
    assert all(a == "0" and b == "0" for a, b in spills), built.log
    used = entry_registers(built.log)
    assert len(used) == len(forms) and max(used.values()) <= 128, used


def test_eight_bit_direct_and_two_tile_forms_have_no_prepared_form() -> None:
    """The forms whose prepared texts spill are not served (see prepared_serves)."""
    refused = [
        s
        for s in tensor_qmm.SPECS + tuple(tensor_qmm.DIRECT_SPECS.values())
        if s.base.startswith(("tensor_q8", "tensor_q4_m2", "tensor_dense_m2"))
        or "_direct" in s.base
    ]
    assert refused and not any(tensor_qmm.prepared_serves(s) for s in refused)
    served = [s for s in tensor_qmm.SPECS if tensor_qmm.prepared_serves(s)]
    assert served and all(s.output_names == ("y", "partial") for s in served)


# --- On the device (mlx's CUDA backend) ------------------------------------------------

cuda = pytest.mark.skipif(not mx.cuda.is_available(), reason="needs mlx's CUDA backend")
GLIMMER_WIDTHS = (4096, 256, 256, 4096)
GLIMMER_DEPTH = 6656


@cuda
@pytest.mark.cuda
@pytest.mark.parametrize("rows", [1, 5, 16])
@pytest.mark.parametrize("group_size", [64, 128])
def test_the_prepared_launch_gives_the_head_prep_kernels_bits_on_the_device(
    rows, group_size
) -> None:
    """Full-size Glimmer's fused q / k / v / gate (4-bit): the prepared launch's
    queries, stacked block and gate equal, bit for bit, the plain launch's output
    after the head prep kernel (which the ``cuda`` tests of test_head_prep hold to
    mlx's own ops). Whichever split sum the process takes (the cluster's with mlx's
    graphs off, the merge's with them on)."""
    rng = np.random.default_rng(rows)
    columns = sum(GLIMMER_WIDTHS)
    edges = tuple(int(e) for e in np.cumsum(GLIMMER_WIDTHS)[:-1])
    dense = rng.standard_normal((columns, GLIMMER_DEPTH)).astype(np.float32) * 0.02
    weight, scales, biases = mx.quantize(
        mx.array(dense).astype(mx.bfloat16), group_size=group_size, bits=4
    )
    x = mx.array(rng.standard_normal((1, rows, GLIMMER_DEPTH)).astype(np.float32))
    x = x.astype(mx.bfloat16)
    norm = lambda: mx.array(rng.uniform(0.5, 1.5, DIM).astype(np.float32))  # noqa
    prep = heads.Prep(
        eps=1e-6,
        q_weight=norm().astype(mx.bfloat16),
        k_weight=norm().astype(mx.bfloat16),
        q_scale=DIM**-0.5,
        rope_base=1e6,
        start=5000,
    )
    bind = lambda prepared: tensor_qmm.bind_tensor_core(  # noqa: E731
        rows, GLIMMER_DEPTH, weight, scales, biases, 4, group_size, x.dtype,
        members=edges, lead=(1, rows), prepared=prepared,
    )  # fmt: skip
    plain = bind(False)(x)
    offsets = (0, *[e * rows for e in edges])
    q_heads, kv_heads = GLIMMER_WIDTHS[0] // DIM, GLIMMER_WIDTHS[1] // DIM
    ints = heads.head_prep_ints(
        (1, rows, q_heads, DIM), kv_heads, prep, True, offsets=offsets[:3]
    )
    queries, block = heads.launch_head_prep(
        plain, plain, prep, ints, plain, DIM, offsets=offsets[:3],
        geometry=(1, rows, q_heads, kv_heads),
    )  # fmt: skip
    prepared = bind(True)(x, heads=heads.prepared_inputs(prep, ints, x.dtype))
    mx.eval(plain, queries, block, prepared)
    bits = lambda a: np.array(a.reshape(-1).view(mx.uint16))  # noqa: E731
    got = bits(prepared)
    assert np.array_equal(got[: offsets[1]], bits(queries))
    assert np.array_equal(got[offsets[1] : offsets[3]], bits(block))
    assert np.array_equal(got[offsets[3] :], bits(plain)[offsets[3] :])
