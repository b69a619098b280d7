"""The round profilers: host phases of a real tiny generation, device-timeline arithmetic."""

from __future__ import annotations

import argparse
import json
import os

import mlx.core as mx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from benchmarks import common, round_profile, round_timeline
from dflash import kernel_patch
from dflash.folded_attention import FOLDED_ENV
from dflash.fused_projections import FUSED_ENV
from dflash.held_norms import HELD_NORMS_ENV, held_norms_wanted
from dflash.kernel_patch import COMPILED_BLOCKS_ENV, VERIFY_KERNELS_ENV
from dflash.metal import prefetch, tensor_qmm
from dflash.prepared_heads import HEAD_PREP_ENV, head_prep_wanted
from dflash.residual_layers import RESIDUAL_NORMS_ENV, residual_norms_wanted
from dflash.traced_drafts import DRAFTER_TRACED_ENV


def test_round_profile_times_every_phase_of_a_lossless_tiny_run(tmp_path):
    args = argparse.Namespace(
        scale="tiny",
        quant="bf16",
        context=48,
        tau=[3],
        max_tokens=40,
        runs=1,
        skip=2,
        start_early="both",
        folded="both",
        kernels=["default"],
        profile=5,
        json=None,
    )
    before = os.environ.get(FOLDED_ENV)
    report = round_profile.run(args)
    arms = [(r["start_early"], r["folded"]) for r in report["runs"]]
    assert arms == [(True, True), (True, False), (False, True), (False, False)]
    assert os.environ.get(FOLDED_ENV) == before
    for result in report["runs"]:
        assert result["lossless"]
        assert result["rounds"] >= 5
        for phase in round_profile.PHASES:
            assert result[phase] is not None and result[phase] >= 0
        # Host time outside the sync is made of the timed phases plus a small rest.
        assert result["round"] >= result["wait"]
        assert result["host_not_waiting"] >= result["verify_graph"]
    assert list(report["profile"]) == ["default"]
    assert "ncalls" in report["profile"]["default"]
    json.dumps(report)


def test_round_profile_kernel_arms_are_lossless_against_their_own_plain_decoding(
    monkeypatch,
):
    """Each ``--kernels`` arm installs its parts and equals its own plain decoding."""
    args = argparse.Namespace(
        scale="tiny", quant="bf16", context=40, tau=[4], max_tokens=24, runs=1,
        skip=1, start_early="on", folded=None,
        kernels=["off", "attention", "all", "all-unfused", "attention-projections"],
        profile=0, json=None, plain_time=True, profile_plain=4, device_time=True,
    )  # fmt: skip
    before = os.environ.get(VERIFY_KERNELS_ENV)
    # A fake CUPTI: one 5 us kernel per call of the traced run.
    monkeypatch.setattr(
        round_profile, "cupti_trace", lambda run: ([("k", 0.0, 5.0)] * run(), [])
    )
    seen = []
    real = kernel_patch.KernelPatch.install

    def install(self):
        seen.append((self.attention, self.matmul, self.fuse, self.projections))
        return real(self)

    kernel_patch.KernelPatch.install = install
    try:
        report = round_profile.run(args)
    finally:
        kernel_patch.KernelPatch.install = real
    assert os.environ.get(VERIFY_KERNELS_ENV) == before
    arms = ["off", "attention", "all", "all-unfused", "attention-projections"]
    assert [r["kernels"] for r in report["runs"]] == arms
    assert all(r["lossless"] for r in report["runs"])
    assert {(a, m, p) for a, m, _, p in seen} == {
        (True, False, False),
        (True, True, False),
        (True, False, True),
    }
    assert {f for _, m, f, _ in seen if m} == {True, False}
    # Each arm's own plain decoding, compared with mlx-lm's (on the CPU they agree).
    assert report["plain_equals_mlx_lm"] == dict.fromkeys(arms, True)
    assert report["plain_divergences"] == {}
    assert os.environ.get(FUSED_ENV) is None
    walls = report["plain_wall"]
    assert [(r["run"], r.get("kernels")) for r in walls] == [("mlx-lm plain", None)] + [
        ("ours plain", arm) for arm in arms
    ]
    assert all(r["ms_per_token"] > 0 for r in walls)
    # Device rows keep their arm apart from the kernel count.
    device = report["device_time"]
    assert [(r["run"][:4], r.get("arm")) for r in device] == [("mlx-", None)] + [
        (run, arm) for arm in arms for run in ("dfla", "ours")
    ]
    assert all(isinstance(r["kernels"], float) for r in device)
    # One cProfile table of our plain decoding per arm; the routed arms show the route.
    assert list(report["plain_profile"]) == arms
    assert all("ncalls" in text for text in report["plain_profile"].values())


def test_unheld_arms_turn_the_held_norms_off_for_their_block(monkeypatch):
    monkeypatch.delenv(HELD_NORMS_ENV, raising=False)
    for arm, verify, held in (
        ("off-unheld", "0", False),
        ("default-unheld", None, False),
        ("off", "0", True),
    ):
        with round_profile.kernel_arm(arm):
            assert os.environ.get(VERIFY_KERNELS_ENV) == verify
            assert held_norms_wanted() is held
        assert HELD_NORMS_ENV not in os.environ
    for arm, blocks in (("default-unblocked", "0"), ("default-blocked", "1")):
        with round_profile.kernel_arm(arm):
            assert os.environ.get(COMPILED_BLOCKS_ENV) == blocks
        assert COMPILED_BLOCKS_ENV not in os.environ
    with round_profile.kernel_arm("default-folded"):
        assert tensor_qmm.fold_q4_offset()
    assert tensor_qmm.FOLDED_OFFSET_ENV not in os.environ
    with round_profile.kernel_arm("default-waves"):
        assert tensor_qmm.wave_split()
    assert tensor_qmm.WAVE_SPLIT_ENV not in os.environ
    with round_profile.kernel_arm("default-unprepared"):
        assert not head_prep_wanted()
    assert head_prep_wanted() and HEAD_PREP_ENV not in os.environ
    with round_profile.kernel_arm("default-residual"):
        assert residual_norms_wanted()
    with round_profile.kernel_arm("default-unresidual"):
        assert not residual_norms_wanted(traced=True)
    assert not residual_norms_wanted() and RESIDUAL_NORMS_ENV not in os.environ
    monkeypatch.delenv(prefetch.PREFETCH_ENV, raising=False)
    with round_profile.kernel_arm("default-unfetched"):
        assert prefetch.megabytes_wanted() == 0
    with round_profile.kernel_arm("default-fetched32"):
        assert prefetch.megabytes_wanted() == 32
    assert prefetch.megabytes_wanted() == prefetch.DEFAULT_MEGABYTES
    monkeypatch.delenv(tensor_qmm.SCALED_B_ENV, raising=False)
    with round_profile.kernel_arm("default-unscaled"):
        assert not tensor_qmm.scaled_b(4) and not tensor_qmm.scaled_b(8)
    assert tensor_qmm.scaled_b(4) and tensor_qmm.SCALED_B_ENV not in os.environ
    monkeypatch.delenv(tensor_qmm.DENORMAL_IN_PLACE_ENV, raising=False)
    with round_profile.kernel_arm("default-shifted"):
        assert not tensor_qmm.denormal_in_place(4)
    with round_profile.kernel_arm("default-inplace"):
        assert tensor_qmm.denormal_in_place(4)
    assert tensor_qmm.denormal_in_place(4)  # the default since session 52
    assert tensor_qmm.DENORMAL_IN_PLACE_ENV not in os.environ


def test_matmul_form_arms_rebuild_the_forms_for_their_block_only(monkeypatch):
    """``-paired`` / ``-lean`` / ``-pairedlean`` rebuild the matmul's forms with the
    paired stage and / or the lean issue for the block (what a bind plans is then
    those texts), set their switches so kept traces are the arm's own, and leave the
    shipped spec objects and environment as they were."""
    for name in (tensor_qmm.PAIRED_STAGE_ENV, tensor_qmm.LEAN_ISSUE_ENV):
        monkeypatch.delenv(name, raising=False)
    key = (2, (4, 1), 64)
    shipped = dict(tensor_qmm.DENORMAL_SPECS)
    settings = kernel_patch.dflash_settings()
    for arm, paired, lean in (
        ("default-paired", True, False),
        ("default-lean", False, True),
        ("default-pairedlean", True, True),
        ("default", False, False),
    ):
        with round_profile.kernel_arm(arm):
            assert tensor_qmm.PAIRED_STAGE is paired and tensor_qmm.LEAN_ISSUE is lean
            plan = tensor_qmm.launch_plan(
                16, 4096, 6656, 4, 64, True, False, True, 2, scaled=True, denormal=True
            )
            assert plan.spec is tensor_qmm.DENORMAL_SPECS[key]
            assert ("dfl_interleaved_load" in plan.spec.body) is paired
            assert ("dfl_cp16" in plan.spec.body) is lean
            assert (kernel_patch.dflash_settings() != settings) is (paired or lean)
        assert not tensor_qmm.PAIRED_STAGE and not tensor_qmm.LEAN_ISSUE
        assert tensor_qmm.DENORMAL_SPECS == shipped
        assert all(tensor_qmm.DENORMAL_SPECS[k] is v for k, v in shipped.items())
        assert kernel_patch.dflash_settings() == settings
    plan = tensor_qmm.launch_plan(
        16, 4096, 6656, 4, 64, True, False, True, 2, scaled=True, denormal=True
    )
    assert plan.spec is shipped[key] and "dfl_cp16" not in plan.spec.body


def test_unit_arm_builds_the_unit_scale_forms_for_its_block() -> None:
    """``-unit`` rebuilds the scaled 4-bit forms with unit scales for its block and
    sets their switch (a kept trace is keyed by it); the shipped forms come back."""
    key = (2, (4, 1), 64)
    shipped = tensor_qmm.IN_PLACE_SPECS[key]
    settings = kernel_patch.dflash_settings()
    with round_profile.kernel_arm("default-unit"):
        assert tensor_qmm.UNIT_SCALES is True
        assert "dfl_copy_span" in tensor_qmm.IN_PLACE_SPECS[key].body
        assert kernel_patch.dflash_settings() != settings
    assert tensor_qmm.UNIT_SCALES is False
    assert tensor_qmm.IN_PLACE_SPECS[key] is shipped
    assert kernel_patch.dflash_settings() == settings


def test_rowmajor_arm_builds_the_row_major_forms_for_its_block() -> None:
    """``-rowmajor`` rebuilds the scaled forms to read the scales as mlx lays them
    out for its block and sets their switch off; the shipped (chunk-major) forms come
    back."""
    key = (2, (4, 1), 64)
    shipped = tensor_qmm.IN_PLACE_SPECS[key]
    assert tensor_qmm.reads_interleaved(shipped)  # chunk-major, interleaved (s56)
    settings = kernel_patch.dflash_settings()
    with round_profile.kernel_arm("default-rowmajor"):
        assert tensor_qmm.CHUNK_MAJOR_SCALES is False
        assert not tensor_qmm.reads_chunk_major(tensor_qmm.IN_PLACE_SPECS[key])
        assert not tensor_qmm.reads_interleaved(tensor_qmm.IN_PLACE_SPECS[key])
        # The bind's check passes: the interleaved default yields (session 56).
        assert tensor_qmm.interleaved_scales() is False
        assert (
            tensor_qmm.CHUNK_MAJOR_SCALES_ENV,
            "0",
        ) in kernel_patch.dflash_settings()
    assert tensor_qmm.CHUNK_MAJOR_SCALES is True
    assert tensor_qmm.IN_PLACE_SPECS[key] is shipped
    assert kernel_patch.dflash_settings() == settings


def test_ileave_arm_names_the_default_interleaved_forms_and_only_them(monkeypatch):
    """``-ileave`` takes interleaved scales (the default since session 56) for its block
    and sets their switch, and nothing else; the shipped forms come back."""
    monkeypatch.delenv(tensor_qmm.INTERLEAVED_SCALES_ENV, raising=False)
    key = (2, (4, 1), 64)
    shipped = tensor_qmm.IN_PLACE_SPECS[key]
    assert tensor_qmm.reads_interleaved(shipped)
    settings = kernel_patch.dflash_settings()
    with round_profile.kernel_arm("default-ileave"):
        assert tensor_qmm.INTERLEAVED_SCALES is True
        assert tensor_qmm.reads_interleaved(tensor_qmm.IN_PLACE_SPECS[key])
        changed = set(kernel_patch.dflash_settings()) - set(settings)
        # Its switch and nothing else (session 55's "-interleaved" also turned the
        # member-major store off, the older arm of that name).
        assert changed == {(tensor_qmm.INTERLEAVED_SCALES_ENV, "1")}
    assert tensor_qmm.INTERLEAVED_SCALES is True
    assert tensor_qmm.IN_PLACE_SPECS[key] is shipped
    assert kernel_patch.dflash_settings() == settings


def test_cmajor_arm_builds_chunk_major_forms_without_the_interleaving() -> None:
    """``-cmajor`` (the A arm since interleaved scales became the default, session
    56) takes chunk-major scales without the interleaving for its block; the shipped
    interleaved forms come back."""
    key = (2, (4, 1), 64)
    shipped = tensor_qmm.IN_PLACE_SPECS[key]
    with round_profile.kernel_arm("default-cmajor"):
        spec = tensor_qmm.IN_PLACE_SPECS[key]
        assert tensor_qmm.reads_chunk_major(spec)
        assert not tensor_qmm.reads_interleaved(spec)
        assert tensor_qmm.INTERLEAVED_SCALES is False
    assert tensor_qmm.IN_PLACE_SPECS[key] is shipped
    assert tensor_qmm.reads_interleaved(shipped)


def test_persist_arm_sets_the_persistent_switch_and_only_it(monkeypatch) -> None:
    """``-persist`` turns the persistent matmul on (read at each bind: no forms
    rebuilt) for its block, and nothing else; it is off after."""
    monkeypatch.delenv(tensor_qmm.PERSISTENT_ENV, raising=False)
    settings = kernel_patch.dflash_settings()
    with round_profile.kernel_arm("default-persist"):
        assert tensor_qmm.persistent() is True
        changed = set(kernel_patch.dflash_settings()) - set(settings)
        assert changed == {(tensor_qmm.PERSISTENT_ENV, "1")}
    assert tensor_qmm.persistent() is False
    assert kernel_patch.dflash_settings() == settings


def test_every_arm_suffix_names_one_table_entry() -> None:
    """No suffix is in two of the arm tables (both would apply: session 55's
    ``-interleaved`` set interleaved scales and member-major off at once)."""
    tables = (
        round_profile.ARM_SUFFIXES,
        round_profile.ARM_SUFFIX_SETS,
        round_profile.ARM_MATMUL_FORMS,
    )
    names = [name for table in tables for name in table]
    assert len(names) == len(set(names))
    with round_profile.kernel_arm("default-interleaved"):
        # Member-major off; the scale layout left as it is (interleaved, the default).
        assert tensor_qmm.INTERLEAVED_SCALES is tensor_qmm.INTERLEAVED_SCALES_DEFAULT
        assert not tensor_qmm.member_major()


def test_drafter_arms_turn_on_their_drafter_switches_for_their_block(monkeypatch):
    """``-drafterqkv`` / ``-drafterheads`` / ``-draftermlx`` / ``-drafterkernel`` set
    one switch each,
    ``-drafter`` the first two, ``-draftertraced`` the head prep and the traced layers,
    ``-drafterall`` all four; each is unset after."""
    switches = (
        kernel_patch.DRAFTER_QKV_ENV,
        kernel_patch.DRAFTER_HEAD_PREP_ENV,
        kernel_patch.DRAFTER_DENSE_ENV,
        DRAFTER_TRACED_ENV,
    )
    for name in switches:
        monkeypatch.delenv(name, raising=False)
    for arm, qkv, heads, dense, traced in (
        ("default-drafterqkv", True, False, False, False),
        ("all-drafterheads", False, True, False, False),
        ("default-drafter", True, True, False, False),
        ("all-draftermlx", False, False, False, False),
        ("default-drafterkernel", False, False, True, False),
        ("default-draftertraced", False, True, False, True),
        ("default-drafterall", True, True, False, True),
        ("default", False, False, False, False),
    ):
        with round_profile.kernel_arm(arm):
            assert kernel_patch.drafter_qkv_wanted() is qkv
            assert kernel_patch.drafter_head_prep_wanted() is heads
            assert kernel_patch.drafter_dense_wanted() is dense
            assert kernel_patch.drafter_traced_wanted() is traced
        assert not any(name in os.environ for name in switches)


def test_round_profile_refuses_an_unknown_kernel_arm():
    with pytest.raises(argparse.ArgumentTypeError, match="qmm"):
        round_profile._kernel_arms("off,qmm")


intervals = st.lists(
    st.tuples(st.integers(0, 1000), st.integers(0, 50)).map(
        lambda p: (p[0], p[0] + p[1])
    ),
    max_size=30,
)


@settings(max_examples=200, deadline=None)
@given(intervals)
def test_busy_time_is_the_measure_of_the_union_and_gaps_fill_the_span(spans):
    spans = sorted(spans)
    busy, gaps = round_timeline.union_busy(spans)
    covered = set()
    for start, end in spans:
        covered.update(range(start, end))
    assert busy == len(covered)
    if spans:
        span = max(e for _, e in spans) - spans[0][0]
        assert busy + sum(gaps) == span
        assert all(g > 0 for g in gaps)


def test_kernel_intervals_keep_device_work_only_and_rank_kernels():
    trace = {
        "traceEvents": [
            {"ph": "X", "cat": "kernel", "ts": 5, "dur": 2, "name": "gemm"},
            {"ph": "X", "cat": "cpu_op", "ts": 0, "dur": 9, "name": "host"},
            {"ph": "X", "cat": "gpu_memcpy", "ts": 1, "dur": 1, "name": "copy"},
            {"ph": "X", "cat": "kernel", "ts": 9, "dur": 3, "name": "gemm"},
            {"ph": "i", "cat": "kernel", "ts": 3, "name": "marker"},
        ]
    }
    kernels = round_timeline.kernel_intervals(trace)
    assert kernels == [("copy", 1.0, 2.0), ("gemm", 5.0, 7.0), ("gemm", 9.0, 12.0)]
    top = round_timeline.top_kernels(kernels, 1)
    assert top == [{"name": "gemm", "total_us": 5.0, "calls": 2}]


def test_busy_time_counts_overlapping_kernels_once():
    kernels = [("a", 0.0, 10.0), ("b", 5.0, 10.0), ("c", 30.0, 1.0), ("d", 2.0, 1.0)]
    assert common.busy_us(kernels) == 16.0
    assert common.busy_us([]) == 0.0


def test_per_unit_is_the_steady_state_difference_of_two_runs(monkeypatch):
    # A fake CUPTI: a run of n units launches a 100 us prefill kernel and, per unit,
    # two kernels of 3 us and 1 us back to back, one graph launch and, every other
    # unit, a graph instantiation of 40 us.
    def fake_trace(run):
        units = run()
        events = [("prefill", 0.0, 100.0)]
        api = [("cudaGraphInstantiate", 0.0, 40.0), ("cudaMalloc", 0.0, 9.0)]
        for unit in range(units):
            start = 200.0 + 10.0 * unit
            events += [("matmul", start, 3.0), ("norm", start + 3.0, 1.0)]
            api.append(("cudaGraphLaunch", start, 2.0))
            if unit % 2:
                api.append(("cudaGraphInstantiate", start, 40.0))
        return events, api

    monkeypatch.setattr(round_profile, "cupti_trace", fake_trace)
    row = round_profile.per_unit(lambda units: iter(range(units + 1)), 5, 11)
    assert row["units"] == 6
    assert row["kernels"] == 2.0
    assert row["busy_ms"] == 0.004 and row["kernel_ms"] == 0.004
    assert row["top"] == {"matmul": 1.0, "norm": 1.0, "prefill": 0.0}
    # Device time per unit by kernel, most first; the prefill cancels.
    assert row["top_us"] == {"matmul": 3.0, "norm": 1.0, "prefill": 0.0}
    assert list(row["top_us"]) == ["matmul", "norm", "prefill"]
    assert row["graph_api"] == {
        "cudaGraphInstantiate": {"calls": 0.5, "host_us": 20.0},
        "cudaGraphLaunch": {"calls": 1.0, "host_us": 2.0},
    }
    # Every API call counts in api_top (the prefill's cancel), most host time first.
    assert list(row["api_top"]) == [
        "cudaGraphInstantiate",
        "cudaGraphLaunch",
        "cudaMalloc",
    ]
    assert row["api_top"]["cudaMalloc"] == {"calls": 0.0, "host_us": 0.0}
    assert row["api_host_ms"] == 0.022


@settings(max_examples=30, deadline=None)
@given(
    prefills=st.lists(st.floats(1.0, 1e4), min_size=2, max_size=2),
    skip=st.integers(1, 3),
    short=st.integers(4, 8),
    extra=st.integers(1, 8),
)
def test_per_unit_traces_each_run_past_its_prefill_and_first_units(
    prefills, skip, short, extra
):
    """The trace starts after the prefill and the first ``skip`` units of each run, so
    a prefill whose duration differs between the short and the long run (as a real
    one's does) adds nothing per unit; the units counted are those traced."""
    clock = {"now": 0.0, "on": False, "events": []}

    def emit(name, duration):
        if clock["on"]:
            clock["events"].append((name, clock["now"], duration))
        clock["now"] += duration

    def generation(units, prefill_us):
        emit("prefill", prefill_us)
        for unit in range(units):
            emit("matmul", 3.0)
            emit("norm", 1.0)
            yield unit

    def fake_trace(run):
        clock["on"], clock["events"] = True, []
        run()
        clock["on"] = False
        return list(clock["events"]), []

    def per_unit(skip):
        durations = iter(prefills)
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(round_profile, "cupti_trace", fake_trace)
            return round_profile.per_unit(
                lambda units: generation(units, next(durations)),
                short,
                short + extra,
                skip=skip,
            )

    row = per_unit(skip)
    assert row["units"] == extra
    assert row["top_us"] == {"matmul": 3.0, "norm": 1.0}
    assert row["busy_ms"] == pytest.approx(0.004) and row["kernels"] == 2.0
    # Negative control: traced from the start (the window before session 52), the
    # prefills' difference lands in the per-unit time.
    whole = per_unit(0)
    gap = round((prefills[1] - prefills[0]) / extra, 1)
    assert whole["top_us"].get("prefill", 0.0) == gap


def test_launch_cost_times_every_op_and_refuses_an_unknown_one(tmp_path, capsys):
    from benchmarks import launch_cost

    out = tmp_path / "launch.json"
    argv = ["--small", "--calls", "3", "--reps", "1", "--json", str(out)]
    assert launch_cost.main(argv + ["--cprofile", "ours small_row_matmul"]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [row["op"] for row in rows] == list(launch_cost.make_ops(True))
    for row in rows:
        assert row["build_us"] > 0 and row["eval_us"] >= 0
        assert row["total_us"] == pytest.approx(row["build_us"] + row["eval_us"])
    assert "ncalls" in capsys.readouterr().out
    assert launch_cost.main(["--small", "--cprofile", "no such op"]) == 2
    assert "no op 'no such op'" in capsys.readouterr().err
    assert launch_cost.main(["--small", "--ops", "mlx add,no such op"]) == 2
    argv += ["--ops", "mlx add,ours small_row_matmul 1 row"]
    assert launch_cost.main(argv) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [row["op"] for row in rows] == ["mlx add", "ours small_row_matmul 1 row"]


def test_launch_costs_bare_kernels_are_included_or_forced_inline(monkeypatch, tmp_path):
    """On a GPU backend the padded bare kernel is built twice: as the switch says
    (an ``#include`` line by default) and forced inline; the switch is restored."""
    from benchmarks import launch_cost
    from dflash.metal import backend, kernel_files

    handed = {}

    def fake_kernel(**fields):
        handed[fields["name"]] = fields["source"]
        return lambda **launch: [mx.zeros((1,))]

    monkeypatch.setattr(mx.fast, "cuda_kernel", fake_kernel)
    monkeypatch.setattr(backend, "BACKEND", "cuda")
    monkeypatch.setenv(kernel_files.TEXT_DIR_ENV, str(tmp_path))
    monkeypatch.delenv(kernel_files.INCLUDED_TEXTS_ENV, raising=False)
    ops = launch_cost.bare_kernel_ops(mx.zeros((1, 4)))
    assert sorted(ops) == [
        "custom kernel 12 KB inline source",
        "custom kernel 12 KB source",
        "custom kernel short source",
    ]
    sources = sorted(handed.values(), key=len)
    assert [s.startswith("#include") for s in sources] == [True, True, False]
    assert len(sources[-1]) > 12000
    assert kernel_files.INCLUDED_TEXTS_ENV not in os.environ


def test_stubbed_launches_take_our_kernel_path_and_restore_everything():
    from benchmarks import launch_cost
    from dflash.metal import backend, groups
    from dflash.metal.attention import KeyPlane, small_query_attention

    launched = []
    real = groups.launch_groups
    before = (backend.BACKEND, backend.use_kernel_path)
    with launch_cost.stubbed_launches():
        stub = groups.launch_groups
        groups.launch_groups = lambda *a: launched.append(a[0].base) or stub(*a)
        try:
            plane = KeyPlane(mx.zeros((1, 2, 64, 16)), mx.zeros((1, 2, 64, 16)), 40)
            out = small_query_attention(mx.zeros((1, 4, 1, 16)), plane, scale=0.25)
        finally:
            groups.launch_groups = stub
    # The kernel path's two launches ran as stand-ins of the right shape.
    assert launched == ["attend_chunks", "fold_chunks"] and out.shape == (1, 4, 1, 16)
    assert groups.launch_groups is real
    assert (backend.BACKEND, backend.use_kernel_path) == before


def test_compare_arms_pairs_each_run_with_the_first_arms_run_of_its_pass():
    def run(kernels, ms, tau=6):
        return {"tau": tau, "start_early": True, "folded": None, "kernels": kernels,
                "round": ms}  # fmt: skip

    runs = [run("off", 30.0), run("attention", 27.0), run("off", 45.0),
            run("attention", 47.0), run("off", 31.0), run("attention", 29.0),
            run("off", 20.0, tau=2)]  # fmt: skip
    off, attention, other_tau = round_profile.compare_arms(runs)
    assert off == {"tau": 6, "start_early": True, "folded": None, "kernels": "off",
                   "runs": 3, "round_median": 31.0, "round_min": 30.0}  # fmt: skip
    assert attention["round_median"] == 29.0 and attention["round_min"] == 27.0
    assert attention["vs"] == "off" and attention["faster_in"] == "2/3"
    assert attention["ratio_median"] == round(29.0 / 31.0, 3)
    # Another tau starts its own comparison (its first arm has nothing to face).
    assert "vs" not in other_tau and other_tau["runs"] == 1


def test_compare_arms_leaves_out_runs_too_short_to_time():
    def run(kernels, ms):
        return {"tau": 6, "start_early": True, "folded": None, "kernels": kernels,
                "round": ms}  # fmt: skip

    rows = round_profile.compare_arms([run("off", None), run("all", None)])
    assert rows == []
    off, all_ = round_profile.compare_arms(
        [run("off", 30.0), run("all", 20.0), run("off", None), run("all", 24.0)]
    )
    assert off["runs"] == 1 and all_["runs"] == 2 and "vs" not in all_


def test_plain_divergences_name_the_first_parted_token_and_mlx_lms_margin():
    """Arms whose plain tokens equal mlx-lm's are left out; a parted arm gets its first
    differing index, both tokens there and mlx-lm's top-2 margin at that step."""
    from dflash.bench.scale import build_scale_pair, scale_prompts
    from dflash.greedy import greedy_reference_with_margins

    model, _ = build_scale_pair("tiny", "bf16", seed=0)
    prompt = scale_prompts(model, 32, 1, seed=0)[0]
    continuation, margins = greedy_reference_with_margins(model, prompt, 10)
    assert round_profile.plain_divergences(model, prompt, continuation, {}) == {}
    same = {"off": list(continuation), "short": continuation[:6]}
    assert round_profile.plain_divergences(model, prompt, continuation, same) == {}
    for index in (0, 4, 9):
        parted = list(continuation)
        parted[index] = (parted[index] + 1) % 97
        found = round_profile.plain_divergences(
            model, prompt, continuation, {"same": continuation, "all": parted}
        )
        assert found == {
            "all": {"index": index, "ours": parted[index],
                    "mlx_lm": continuation[index],
                    "mlx_lm_margin": round(float(margins[index]), 6)}
        }  # fmt: skip


def test_plain_phases_splits_each_token_and_counts_our_launches(tmp_path):
    """Every arm's token time is build + encode + rest; the kernel arms launch ours
    (stubbed here), off and mlx-lm none; compiled, every launch is replayed by mlx (the
    attention's inside the traced layers); everything it patched is put back."""
    import importlib

    from benchmarks import plain_phases
    from dflash.metal import groups

    generate_module = importlib.import_module("mlx_lm.generate")
    out = tmp_path / "phases.json"
    argv = ["--tokens", "10", "--skip", "2", "--passes", "1", "--stub-launches"]
    arms = "off,matmul-uncompiled,all-uncompiled,all-compiled"
    plain_phases.main(argv + ["--kernels", arms, "--json", str(out)])
    report = json.loads(out.read_text())
    rows = {row["arm"]: row for row in report["passes"][0]["rows"]}
    assert list(rows) == ["mlx-lm", *arms.split(",")]
    for row in rows.values():
        assert row["tokens"] == 10
        parts = row["build_ms"] + row["encode_ms"] + row["rest_ms"]
        assert parts == pytest.approx(row["wall_ms"], abs=2e-3)
    assert rows["mlx-lm"]["launches"] == rows["off"]["launches"] == 0
    matmul, every = rows["matmul-uncompiled"], rows["all-uncompiled"]
    assert 0 < matmul["launches"] < every["launches"]
    # Compiled, every launch is replayed: the matmuls' and the head prep's by their own
    # traces, the attention's (whose offsets change every step) inside the traced layers,
    # which take those offsets as arrays.
    assert rows["all-compiled"]["launches"] == 0
    per_launch = {row["arm"]: row for row in report["passes"][0]["per_launch"]}
    # Per extra launch: only the arms that launch through our Python.
    assert set(per_launch) == {"matmul-uncompiled", "all-uncompiled"}
    assert per_launch["all-uncompiled"]["extra_launches"] == every["launches"]
    assert generate_module.mx is mx
    assert groups.launch_groups.__module__ == groups.__name__
    with pytest.raises(SystemExit):
        plain_phases.parse_args(["--tokens", "4", "--skip", "4"])


def test_plain_phases_splits_the_device_timeline_at_the_sampler(monkeypatch):
    """Per token: the span between the sampler's argmax kernels and the busy time in it;
    no marker found is reported, not guessed."""
    from benchmarks import plain_phases

    def fake_trace(run):
        tokens = run()
        kernels = [("prefill", 0.0, 500.0)]
        for index in range(tokens + 1):  # mlx-lm computes one step past the last
            start = 1000.0 + 40.0 * index
            kernels += [("matmul", start, 20.0), ("matmul", start + 10.0, 15.0)]
            kernels.append(("arg_reduce<ArgMax>", start + 30.0, 2.0))
        return kernels, []

    monkeypatch.setattr(plain_phases, "cupti_trace", fake_trace)
    model = common_model()
    prompt = mx.array([1, 2, 3, 4])
    device = plain_phases.device_tokens(model, prompt, "mlx-lm", 8, 2)
    assert device["marker"] == "arg_reduce<ArgMax>"
    assert device["per_token_ms"]["span"] == [0.04] * 6
    # matmuls 0-25 us after the token starts and the argmax at 30-32: 27 us busy.
    assert device["per_token_ms"]["busy"] == [0.027] * 6
    monkeypatch.setattr(
        plain_phases, "cupti_trace", lambda run: ([("k", 0.0, 1.0)] * 2 * run(), [])
    )
    assert plain_phases.device_tokens(model, prompt, "mlx-lm", 8, 2)["marker"] is None


def common_model():
    from dflash.bench.scale_target import build_target

    return build_target("tiny", "bf16", seed=0)


def test_patched_calls_times_mlx_and_the_patched_layers(tmp_path):
    """Eight timings (ours uncompiled, compiled, compiled as a block), the stubs and
    the compile switches gone afterwards, bad counts refused."""
    from benchmarks import patched_calls
    from dflash.metal import backend, groups

    out = tmp_path / "patched.json"
    switch = os.environ.get(backend.COMPILE_ENV)
    rows = patched_calls.main(["--calls", "3", "--repeat", "1", "--json", str(out)])
    ours = {"ours o_proj", "ours mlp"}
    assert set(rows) == {
        "mlx o_proj",
        "mlx mlp",
        *ours,
        *(f"{n} compiled" for n in ours),
        *(f"{n} compiled block" for n in ours),
    }
    assert os.environ.get(backend.COMPILE_ENV) == switch
    assert COMPILED_BLOCKS_ENV not in os.environ
    assert all(us > 0 for us in rows.values())
    assert json.loads(out.read_text()) == rows
    assert groups.launch_groups.__module__ == groups.__name__
    assert backend.BACKEND == backend._detect_backend()
    with pytest.raises(SystemExit):
        patched_calls.main(["--calls", "0"])
