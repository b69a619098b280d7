"""Thread-block clusters on the CPU emulator, and the matmul's cluster-sum form.

``tensor_qmm.cluster_spec`` runs a column tile's K splits as one cluster: each CTA
leaves its float32 partial in its own shared memory, and after a cluster barrier
every CTA sums its share of the outputs over all ranks' partials (``mapa``). The
emulator runs a cluster's CTAs together (each with its own poisoned, guarded copy
of the shared memory), so these tests hold the body text itself to the merged
split sum's bits, and show the emulator catching the slips a cluster invites:
reading a partial before its CTA wrote it, summing in another order, leaving
early, barriers that never meet, a rank outside the cluster, a launch that does
not fill its clusters.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support import cluster_bits
from support.attention_cases import bits as raw_bits
from support.compilers import built_emulator
from support.tensor_emulator import TensorEmulator, pretend_cluster_device

from dflash.metal import tensor_qmm

GROUP_SIZE = 64
CHUNK = tensor_qmm.Layout(4, 1).chunk


def _bf16(spec):
    """``spec`` in bfloat16 alone (half the units to build)."""
    return dataclasses.replace(spec, dtypes=(mx.bfloat16,))


# The forms the plan picks, by name: (spec table, its key, the switches picking it,
# the rows it serves). The scaled two-K-group forms are the shipped ones; the plain
# one-K-group form takes the other edit path (it settles its copies first).
FORMS = {
    "scaled_m1": (
        tensor_qmm.SCALED_SPECS,
        (2, (4, 1), GROUP_SIZE),
        {tensor_qmm.SCALED_B_ENV: "1", tensor_qmm.TWO_K_GROUPS_ENV: "1"},
        (1, 16),
    ),
    "scaled_m2": (
        tensor_qmm.SCALED_SPECS,
        (2, (4, 2), GROUP_SIZE),
        {tensor_qmm.SCALED_B_ENV: "1", tensor_qmm.TWO_K_GROUPS_ENV: "1"},
        (17, 32),
    ),
    "plain_m2": (
        tensor_qmm.FORM_SPECS[(False, 1)],
        (4, 2),
        {tensor_qmm.SCALED_B_ENV: "0", tensor_qmm.TWO_K_GROUPS_ENV: "0"},
        (17, 32),
    ),
}
BASES = {name: _bf16(table[key]) for name, (table, key, _, _) in FORMS.items()}
CLUSTERS = {
    (name, size): tensor_qmm.cluster_spec(spec, size)
    for name, spec in BASES.items()
    for size in range(2, tensor_qmm.MAX_CLUSTER + 1)
}
SCALED_C4 = CLUSTERS[("scaled_m1", 4)]


def _mutant(spec, suffix: str, old: str, new: str):
    """``spec`` with the first ``old`` in its body made ``new``."""
    assert old in spec.body, old
    return dataclasses.replace(
        spec, base=f"{spec.base}_{suffix}", body=spec.body.replace(old, new, 1)
    )


_SYNC = "dfl_cluster_sync();"
_LAST_SYNC = "    // No CTA leaves while another may still read its shared memory.\n"
# Negative controls, each a cluster text with one slip.
NO_FIRST_SYNC = _mutant(SCALED_C4, "no_first_sync", _SYNC, "")
REVERSED = {
    size: _mutant(
        CLUSTERS[("scaled_m1", size)],
        "reversed",
        "v[k] = parts[k][e];",
        "v[k] = parts[CLUSTER - 1 - k][e];",
    )
    for size in (3, 4)
}
SCHEDULER_SLIPS = {
    # Rank 0 leaves while the others wait at the second cluster barrier.
    "CTAs of a cluster ended before a cluster barrier": _mutant(
        SCALED_C4,
        "rank0_leaves",
        _LAST_SYNC + "    " + _SYNC,
        _LAST_SYNC + "    if (split != 0) {\n      " + _SYNC + "\n    }",
    ),
    # One thread of each CTA waits at its CTA's barrier, the rest at the cluster's.
    "threads of a CTA wait at its barrier and at the cluster's": _mutant(
        SCALED_C4,
        "split_barriers",
        _SYNC,
        "if (lid == 0) {\n      DFL_BARRIER();\n    }\n    " + _SYNC,
    ),
    # mapa to a rank past the cluster.
    "dfl_cluster_map to rank 4 of a cluster of 4": _mutant(
        SCALED_C4,
        "rank_past",
        "dfl_cluster_map(dfl_part, k)",
        "dfl_cluster_map(dfl_part, k + 1)",
    ),
    # The last rank writes one byte past its shared memory (its own guard bytes).
    "shared memory written past its end": _mutant(
        SCALED_C4,
        "past_end",
        _LAST_SYNC,
        f"    if (split == CLUSTER - 1 && lid == 0) {{\n"
        f"      smem[{SCALED_C4.shared_memory}] = 0;\n    }}\n" + _LAST_SYNC,
    ),
}


@pytest.fixture(scope="module")
def cluster_emulator(tmp_path_factory):
    """The bfloat16 forms, their cluster texts and the controls, built once."""
    specs = (
        tuple(BASES.values())
        + tuple(CLUSTERS.values())
        + (NO_FIRST_SYNC,)
        + tuple(REVERSED.values())
        + tuple(SCHEDULER_SLIPS.values())
    )
    return built_emulator(TensorEmulator, tmp_path_factory, "cluster_emulator", specs)


@pytest.fixture
def emulated(cluster_emulator, monkeypatch):
    """bind_tensor_core on a pretend CUDA device with clusters (graphs off), its
    launches run by the emulator, the plan's forms the bfloat16 copies built here."""
    copies = [(table, key, BASES[name]) for name, (table, key, _, _) in FORMS.items()]
    yield from pretend_cluster_device(cluster_emulator, monkeypatch, copies)


def _case(rows: int, splits: int, columns: int, seed: int) -> tuple:
    """bfloat16 x and a 4-bit weight of ``splits`` chunks of K (the wave rule splits
    K once a chunk while the column tiles fill one wave)."""
    rng = np.random.default_rng(seed)
    depth = CHUNK * splits
    dense = mx.array(rng.standard_normal((columns, depth)).astype(np.float32))
    x = mx.array(rng.standard_normal((rows, depth)).astype(np.float32))
    weight, scales, biases = mx.quantize(
        dense.astype(mx.bfloat16), group_size=GROUP_SIZE, bits=4
    )
    return x.astype(mx.bfloat16), weight, scales, biases


def _cancelling_case(rows: int, splits: int, columns: int, seed: int) -> tuple:
    """A case whose first two K splits' partials cancel exactly and dwarf the rest:
    the same weights in both chunks, x's second chunk the first negated, both 2^12
    times the others. Split order sums them to 0 first (the rest then exact);
    another order rounds the small ones at the large ones' scale."""
    rng = np.random.default_rng(seed)
    depth = CHUNK * splits
    dense = rng.standard_normal((columns, depth)).astype(np.float32)
    dense[:, CHUNK : 2 * CHUNK] = dense[:, :CHUNK]
    x = rng.standard_normal((rows, depth)).astype(np.float32)
    x[:, :CHUNK] *= 2.0**12
    x[:, CHUNK : 2 * CHUNK] = -x[:, :CHUNK]
    weight, scales, biases = mx.quantize(
        mx.array(dense).astype(mx.bfloat16), group_size=GROUP_SIZE, bits=4
    )
    return mx.array(x).astype(mx.bfloat16), weight, scales, biases


def _bound_call(emulator, form: str, case, cluster: bool) -> tuple[np.ndarray, str]:
    """The call's bits and the spec it launched, the cluster sum on or off."""
    x, weight, scales, biases = case
    with pytest.MonkeyPatch.context() as patch:
        for name, value in FORMS[form][2].items():
            patch.setenv(name, value)
        patch.setenv(tensor_qmm.CLUSTER_SUM_ENV, "1" if cluster else "0")
        assert tensor_qmm.cluster_sum() is cluster
        call = tensor_qmm.bind_tensor_core(
            x.shape[0], x.shape[1], weight, scales, biases, 4, GROUP_SIZE, x.dtype
        )
        before = emulator.launches
        y = call(x)
        mx.eval(y)
    assert emulator.launches == before + 1
    return raw_bits(y), emulator.launched[-1]


def _direct(emulator, spec, case, groups_count=None) -> np.ndarray:
    """One launch of a cluster text of the scaled 4-bit form (``spec``) with the
    cluster plan's scalars and CTAs (``groups_count`` in place of them); its scales
    repacked as the bind repacks them."""
    x, weight, scales, biases = case
    scales, biases = tensor_qmm.scale_arrays(spec, scales, biases, GROUP_SIZE)
    rows, depth = x.shape
    columns = weight.shape[0]
    plan = tensor_qmm.launch_plan(
        rows, depth, columns, 4, GROUP_SIZE, True, False, True, 2, (), False, True, True
    )  # fmt: skip
    assert plan.spec.cluster == spec.cluster
    y, _ = emulator.launch(
        spec,
        [x, weight, scales, biases, plan.params, mx.zeros((1,), mx.int32)],
        plan.shapes,
        [x.dtype, mx.float32],
        plan.groups if groups_count is None else groups_count,
        x.dtype,
    )
    return raw_bits(y)


_FIXTURES = [HealthCheck.function_scoped_fixture]


@st.composite
def cluster_cases(draw, form: str, splits: int):
    """A case of ``form`` whose K splits ``splits`` ways, rows the form serves; random
    values, or ones whose sum's bits depend on its order."""
    low, high = FORMS[form][3]
    rows = draw(st.integers(low, high))
    columns = draw(st.integers(1, 300))
    seed = draw(st.integers(0, 2**16))
    make = _cancelling_case if draw(st.booleans()) else _case
    return make(rows, splits, columns, seed)


@pytest.mark.parametrize("form, splits", sorted(CLUSTERS))
@settings(max_examples=4, deadline=None, suppress_health_check=_FIXTURES)
@given(data=st.data(), late=st.booleans(), eager=st.booleans())
def test_cluster_sum_gives_the_merged_split_sum_bits(
    emulated, form, splits, data, late, eager
):
    """The cluster-sum body (a column tile's K splits one cluster, partials summed
    through distributed shared memory) gives every output the merged split sum's
    bits: scaled two-K-group forms of one and two m-tiles and the plain one-K-group
    form, clusters of 2, 3 and 4, copies landing at issue or at their wait, warps
    moving together or each running ahead, on values where another summation order
    would show (see the reverse-order control)."""
    case = data.draw(cluster_cases(form, splits))
    emulated.late = late
    emulated.eager = eager
    x, weight, _, _ = case
    assert tensor_qmm.split_plan(x.shape[1], weight.shape[0], 4, True)[1] == splits
    merged, merged_spec = _bound_call(emulated, form, case, cluster=False)
    clustered, cluster_spec = _bound_call(emulated, form, case, cluster=True)
    assert merged_spec == BASES[form].base
    assert cluster_spec == CLUSTERS[(form, splits)].base
    assert np.array_equal(clustered, merged)


def _float(bits: np.ndarray) -> np.ndarray:
    """bfloat16 bits as float32 values."""
    return (bits.astype(np.uint32) << 16).view(np.float32)


@pytest.mark.parametrize("late", [False, True])
@pytest.mark.parametrize("eager", [False, True])
def test_cluster_sum_without_its_first_sync_is_caught(emulated, late, eager):
    """Negative control: a CTA that reads the ranks' partials without the cluster
    barrier reads some before their CTAs wrote them (poison or stale bytes), in
    either schedule; the intact text gives the merged bits on the same call."""
    emulated.late = late
    emulated.eager = eager
    case = _case(7, 4, 300, seed=3)
    merged, _ = _bound_call(emulated, "scaled_m1", case, cluster=False)
    assert np.array_equal(_direct(emulated, SCALED_C4, case), merged)
    assert NO_FIRST_SYNC.body.count(_SYNC) == 1
    try:
        slipped = _direct(emulated, NO_FIRST_SYNC, case)
    except RuntimeError:
        return
    assert not np.array_equal(slipped, merged)
    wrong = slipped != merged
    assert wrong.mean() > 0.5 or np.isnan(_float(slipped)).any()


@pytest.mark.parametrize("size", sorted(REVERSED))
def test_cluster_sum_in_reverse_rank_order_changes_bits(emulated, size):
    """Negative control: summing the ranks' partials last rank first (the same sum,
    rounded in another order) changes outputs' bits where the order matters (the
    first two partials cancel), so the bit test above holds the split order; the
    merged sum, in split order, keeps the intact text's bits."""
    case = _cancelling_case(16, size, 300, seed=5)
    good = _direct(emulated, CLUSTERS[("scaled_m1", size)], case)
    merged, _ = _bound_call(emulated, "scaled_m1", case, cluster=False)
    assert np.array_equal(good, merged)
    reversed_ = _direct(emulated, REVERSED[size], case)
    assert not np.array_equal(reversed_, good)
    assert np.allclose(_float(reversed_), _float(good), rtol=2**-6, atol=1e-2)


def test_a_launch_that_does_not_fill_clusters_fails(emulated):
    """A grid of CTAs that is not a whole number of clusters is refused, by the
    launch (as ``groups.launch_groups`` refuses it) and by the driver itself."""
    spec = CLUSTERS[("scaled_m1", 3)]
    case = _case(5, 3, 100, seed=1)
    with pytest.raises(ValueError, match="4 threadgroups do not fill clusters of 3"):
        _direct(emulated, spec, case, groups_count=4)
    key = emulated.key(spec, mx.bfloat16)
    argv = [str(emulated.binary), key, "4", str(spec.threads), "0", "0"]
    done = subprocess.run(argv, capture_output=True, text=True)
    assert done.returncode == 8
    assert "4 groups do not fill clusters of 3" in done.stderr


@pytest.mark.parametrize("message", sorted(SCHEDULER_SLIPS))
def test_emulator_reports_cluster_slips(emulated, message):
    """Negative controls of the emulator's cluster: a CTA leaving while the others
    wait at the cluster barrier, a CTA's threads split between its barrier and the
    cluster's, a ``mapa`` to a rank past the cluster, and a write into one rank's
    guard bytes each fail the run with their own message."""
    case = _case(9, 4, 200, seed=2)
    with pytest.raises(RuntimeError, match=message):
        _direct(emulated, SCHEDULER_SLIPS[message], case)


@pytest.mark.cuda
@pytest.mark.skipif(not mx.cuda.is_available(), reason="needs mlx's CUDA backend")
def test_cluster_sum_gives_the_merge_bits_on_the_device_with_graphs_off() -> None:
    """On the GPU, in a process of its own with mlx's CUDA graphs off (the only way
    the cluster sum is taken): every planned cluster launch gives the merge's bits
    (``support/cluster_bits.py``; session 42 ran the same check as a script)."""
    tests = Path(__file__).resolve().parent
    path = os.pathsep.join(
        [str(tests), str(tests.parent), os.environ.get("PYTHONPATH", "")]
    )
    env = dict(os.environ, MLX_USE_CUDA_GRAPHS="0", PYTHONPATH=path)
    done = subprocess.run(
        [sys.executable, "-m", "support.cluster_bits"],
        cwd=tests,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert done.returncode == 0, (done.stdout[-4000:], done.stderr[-4000:])


def test_the_device_check_compares_a_cluster_launch_with_the_merge(
    emulated, monkeypatch
) -> None:
    """``support/cluster_bits``' own comparison, run on the emulator: a 3-way split
    bound with the cluster sum launches its cluster form and gives the merge's bits."""
    monkeypatch.setenv(tensor_qmm.CLUSTER_SUM_ENV, "0")  # restored after the script's
    x, weight, scales, biases = _case(5, 3, 100, 0)
    case = (4, x.shape[1], 5, x, weight, scales, biases)
    merged, merge_specs = cluster_bits._bound(case, cluster=False)
    clustered, cluster_specs = cluster_bits._bound(case, cluster=True)
    assert not any(name.endswith("_c3") for name in merge_specs)
    assert any(name.endswith("_c3") for name in cluster_specs)
    assert np.array_equal(raw_bits(merged), raw_bits(clustered))
