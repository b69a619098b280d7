"""benchmarks.verify_forward: the loop's verify forward timed per arm, its bound counted."""

from __future__ import annotations

import ast
import json

import pytest

from benchmarks import verify_forward
from dflash.bench.scale import build_scale_pair
from dflash.bench.scale_target import embedding_bytes, parameter_bytes
from dflash.cache import RingPlane, make_prompt_cache


def test_each_arm_times_every_forward_and_each_forward_commits_its_rows(
    tmp_path, capsys
):
    out = tmp_path / "verify.json"
    argv = ["--kernels", "off,default", "--reps", "2", "--warmup", "1", "--commit", "5"]
    verify_forward.main([*argv, "--json", str(out)])
    report = json.loads(out.read_text())
    # Progress on stderr as it goes (a run its time limit stops still says how far it
    # got): the build, the prefill, then every forward's arms, warm-up included.
    captured = capsys.readouterr()
    progress = captured.err.splitlines()
    assert "built the tiny 4bit pair" in progress[0]
    assert "prefilled 64 tokens" in progress[1]
    forwards = [line for line in progress if "] forward " in line]
    assert [line.split("] forward ")[1].split(" ")[0] for line in forwards] == [
        "0",
        "1",
        "2",
    ]
    assert all("'off'" in line and "'default'" in line for line in forwards)
    assert report["environment"]["command"].endswith(
        " ".join(argv + ["--json", str(out)])
    )
    assert list(report["wall_ms"]) == ["off", "default"]
    assert all(0 < t["min"] <= t["median"] for t in report["wall_ms"].values())
    # Each arm's first forward (the warm-up one: where first compiles land) is kept
    # apart from the timed ones, and is the one its progress line showed.
    first_shown = ast.literal_eval(forwards[0].split(" ms: ")[1])
    for arm in ("off", "default"):
        first = report["first_forward_ms"][arm]
        assert first > 0 and first == pytest.approx(first_shown[arm], abs=0.006)
    assert report["build_s"] >= 0 and report["prefill_s"] >= 0
    summary = captured.out.splitlines()
    for arm in ("off", "default"):
        line = next(text for text in summary if text.startswith(f"{arm}: wall "))
        assert f"first {report['first_forward_ms'][arm]})" in line
    # Three repetitions of two arms, each forward keeping 5 of its 16 rows.
    assert (report["rows"], report["commit"]) == (16, 5)
    assert report["context_end"] == report["context_start"] + 3 * 2 * 5
    assert report["bound_ms"] == pytest.approx(
        1e3 * report["bound_bytes"] / report["bandwidth"], abs=1e-3
    )
    assert "device" not in report


def test_the_bound_reads_the_weights_once_and_the_rows_the_planes_hold():
    target, _ = build_scale_pair("tiny", "4bit", 0)
    cache = make_prompt_cache(target)
    assert verify_forward.kv_bytes(cache) == 0
    target(verify_forward.mx.arange(40)[None], cache=cache)
    verify_forward.mx.eval([c.state for c in cache])
    config = target.args
    row = 2 * config.num_key_value_heads * config.head_dim * 2  # keys and values, bf16
    # A sliding layer's ring holds at most its window; a full layer every row.
    expected = sum(
        row * (min(40, plane.window) if isinstance(plane, RingPlane) else 40)
        for plane in cache
    )
    assert any(isinstance(plane, RingPlane) for plane in cache)
    assert verify_forward.kv_bytes(cache) == expected
    table = embedding_bytes(target)
    rows = target.model.embed_tokens.weight.shape[0]
    assert verify_forward.step_read_bytes(target, expected) == (
        parameter_bytes(target) - table + table // rows + expected
    )


def test_device_reports_per_forward_kernels_and_the_ratio(monkeypatch, tmp_path):
    """``--device``: a stand-in CUPTI trace whose kernels overlap (busy and summed time
    differ), divided by the forwards it covered."""
    trace = [("gemm", 0.0, 10.0), ("norm", 5.0, 10.0), ("gemm", 30.0, 4.0)]
    seen = []

    def fake_trace(run):
        seen.append(run())
        return trace, []

    monkeypatch.setattr(verify_forward, "cupti_trace", fake_trace)
    out = tmp_path / "verify.json"
    argv = ["--kernels", "default", "--reps", "1", "--warmup", "0", "--device"]
    argv += ["--device-forwards", "2", "--bandwidth", "1e9"]
    verify_forward.main([*argv, "--json", str(out)])
    report = json.loads(out.read_text())
    profile = report["device"]["default"]
    assert (profile["forwards"], profile["kernels"]) == (2, 1.5)
    assert (profile["busy_ms"], profile["sum_ms"]) == (0.0095, 0.012)
    assert profile["top_us"] == [["gemm", 1.0, 7.0], ["norm", 0.5, 5.0]]
    assert profile["over_bound"] == round(0.0095 / report["bound_ms"], 2)
    # The budget: "gemm" is a matmul (14 us over two forwards), "norm" the rest (10 us).
    assert (profile["matmul_ms"], profile["matmul_kernels"]) == (0.007, 1.0)
    assert (profile["other_ms"], profile["other_kernels"]) == (0.005, 0.5)
    room = verify_forward.GOAL_OVER_BOUND * report["bound_ms"] - 0.005
    assert profile["room_for_matmuls_ms"] == round(room, 3)
    assert len(seen) == 1
    # One warm-up forward of the arm and the two traced ones, 7 rows kept each.
    assert report["context_end"] == report["context_start"] + (1 + 1 + 2) * 7


@pytest.mark.parametrize(
    "name, matmul",
    [
        # Names as CUPTI gave them (sessions 60 and 64, an H200 and an H100), cut to
        # 80 characters; the split sum's and the small-row form's digests made up.
        (
            "mlx::core::cu::custom_kernel_dflash_tensor_q4_m1_scaled_g64_k2_denorm_inpla",
            True,
        ),
        (
            "mlx::core::cu::custom_kernel_dflash_tensor_q4_m1_scaled_g64_k2_swiglu_denor",
            True,
        ),
        (
            "mlx::core::cu::custom_kernel_dflash_tensor_split_sum_0a1b2c3d4e_bfloat16_t",
            True,
        ),
        (
            "mlx::core::cu::custom_kernel_dflash_small_row_affine_0a1b2c3d4e_bfloat16_t",
            True,
        ),
        (
            "void mlx::core::cu::qmv_kernel<8, 16, 64, true, false, cutlass::bfloat16_t, ",
            True,
        ),
        ("nvjet_sm90_tst_192x16_64x8_4x1_v_bz_TNT", True),
        (
            "void cublasLt::splitKreduce_kernel<32, 16, int, float, __nv_bfloat16, float",
            True,
        ),
        (
            "mlx::core::cu::custom_kernel_dflash_attend_chunks_wide128_05701b4585_bfloat",
            False,
        ),
        (
            "mlx::core::cu::custom_kernel_dflash_residual_norm_l2_47b1d4380d_bfloat16_t(",
            False,
        ),
        (
            "mlx::core::cu::custom_kernel_dflash_head_prep_f571d7ee08_bfloat16_t(__nv_bf",
            False,
        ),
        (
            "mlx::core::cu::custom_kernel_dflash_fold_gated_9673575981_bfloat16_t(float ",
            False,
        ),
        (
            "void mlx::core::cu::CV2ISigmoidADV2IMultiplyACEV2OMultiplyDB_VV_V2V2_614250",
            False,
        ),
        (
            "void mlx::core::cu::copy_gg_nd<__nv_bfloat16, __nv_bfloat16, int, 2, 4>(__nv",
            False,
        ),
        (
            "cudnn_generated_fort_native_sdpa_sm80_flash_fprop_wmma_f16_knob_35_16x128x1",
            False,
        ),
        (
            "void mlx::core::cu::rms_norm_small<__nv_bfloat16, 128, 7, false, 8>(__nv_bf",
            False,
        ),
    ],
)
def test_the_budget_counts_projection_matmuls_and_nothing_else(name, matmul):
    assert verify_forward.is_matmul(name) is matmul
    budget = verify_forward.split_budget([(name, 0.0, 8.0), ("x", 0.0, 2.0)], 2)
    expected = (0.004, 0.5, 0.001, 0.5) if matmul else (0.0, 0.0, 0.005, 1.0)
    assert tuple(budget.values()) == expected


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--reps", "0"], "--reps must be at least 1"),
        (["--rows", "4", "--commit", "5"], "--commit 5 is more than --rows 4"),
        (["--device-forwards", "0"], "--device-forwards must be at least 1"),
        (["--kernels", "off,off"], "an arm repeats"),
        (["--kernels", "sideways"], "unknown kernel arm"),
    ],
)
def test_bad_arguments_are_one_line(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        verify_forward.parse_args(argv)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_the_forward_runs_in_the_loops_context_with_the_norms_held():
    """The loop holds each Gemma-style norm's ``1 + weight`` (``held_norms``); a harness
    without it adds it again at every norm (208 kernels a full-size forward)."""
    target, drafter = build_scale_pair("tiny", "4bit", 0)
    norm = target.model.layers[0].input_layernorm
    own = type(norm)
    with verify_forward.loop_context(target, drafter) as taps:
        assert type(norm) is not own and isinstance(norm, own)
        assert taps.layer_ids == tuple(drafter.config.target_layer_ids)
    assert type(norm) is own


def test_the_loops_pacing_reaches_the_taps(monkeypatch):
    """``DFLASH_EVAL_EVERY=3`` paces the harness's taps as it paces the loop's: more
    decoder layers start their output early (their class swapped while held)."""
    target, drafter = build_scale_pair("tiny", "4bit", 0)
    layers = target.model.layers
    own = [type(layer) for layer in layers]

    def swapped() -> int:
        with verify_forward.loop_context(target, drafter):
            return sum(type(layer) is not cls for layer, cls in zip(layers, own))

    monkeypatch.delenv("DFLASH_EVAL_EVERY", raising=False)
    taps_only = swapped()
    monkeypatch.setenv("DFLASH_EVAL_EVERY", "3")
    assert swapped() > taps_only >= len(set(drafter.config.target_layer_ids))
    assert [type(layer) for layer in layers] == own
