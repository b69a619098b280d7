"""benchmarks.drafter_forward: every part timed in every arm, the arm's patch as asked."""

from __future__ import annotations

import json
import os

import pytest

from benchmarks import drafter_forward
from dflash.kernel_patch import DRAFTER_QKV_ENV, VERIFY_KERNELS_ENV


def test_every_part_is_timed_in_every_arm_under_the_arms_patch(tmp_path, capsys):
    out = tmp_path / "drafter.json"
    arms = [
        "off", "all", "all-drafterqkv", "all-drafter", "all-drafterkernel",
        "all-drafterall",
    ]  # fmt: skip
    argv = ["--kernels", ",".join(arms), "--reps", "2", "--warmup", "1"]
    drafter_forward.main([*argv, "--json", str(out)])
    report = json.loads(out.read_text())
    assert report["environment"]["command"].endswith(
        " ".join(argv + ["--json", str(out)])
    )
    assert list(report["ms"]) == arms
    for by_part in report["ms"].values():
        assert list(by_part) == list(drafter_forward.PARTS)
        assert all(
            0 < t["host_ms"] and t["wall_min_ms"] <= t["wall_ms"]
            for t in by_part.values()
        )
    patch = report["patch"]
    assert patch["off"] == {"installed": False}
    assert patch["all"]["installed"] and patch["all"]["drafter_qkv_sets"] == 0
    assert patch["all"]["fused_sets"] > 0 and not patch["all"]["drafter_head_prep"]
    # The tiny drafter's two layers, each one q / k / v stack.
    assert patch["all-drafterqkv"]["drafter_qkv_sets"] == 2
    assert not patch["all-drafterqkv"]["drafter_head_prep"]
    assert patch["all-drafter"]["drafter_qkv_sets"] == 2
    assert patch["all-drafter"]["drafter_head_prep"]
    # The drafter's dense projections on mlx's matmul by default (session 47): each
    # layer's MLP gate / up and, stacked, q / k / v one mlx matmul; on our kernel none.
    assert not patch["all"]["drafter_dense_kernel"]
    assert patch["all"]["drafter_mlx_sets"] == 2
    assert not patch["all-drafter"]["drafter_dense_kernel"]
    assert patch["all-drafter"]["drafter_mlx_sets"] == 4
    assert patch["all-drafterkernel"]["drafter_dense_kernel"]
    assert patch["all-drafterkernel"]["drafter_mlx_sets"] == 0
    # On mlx's matmul: each layer's MLP gate / up and q / k / v one mlx matmul.
    assert not patch["all-drafterall"]["drafter_dense_kernel"]
    assert patch["all-drafterall"]["drafter_mlx_sets"] == 4
    # The CPU does not compile by default, so no draft layer is traced here.
    assert patch["all-drafterall"]["drafter_traced_layers"] == 0
    assert VERIFY_KERNELS_ENV not in os.environ and DRAFTER_QKV_ENV not in os.environ
    printed = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in printed] == arms


def test_device_lists_each_parts_kernels_per_arm(monkeypatch, tmp_path, capsys):
    """``--device``: per arm and part, the kernels of one call (a stand-in CUPTI trace
    whose kernels overlap, so busy, summed and spanned time differ)."""
    trace = [("gemm", 0.0, 10.0), ("norm", 5.0, 10.0), ("gemm", 30.0, 4.0)]
    calls = []

    def fake_trace(run):
        calls.append(run())
        return trace, []

    monkeypatch.setattr(drafter_forward, "cupti_trace", fake_trace)
    out = tmp_path / "drafter.json"
    arms = ["off", "all-drafter"]
    argv = ["--kernels", ",".join(arms), "--reps", "1", "--warmup", "0", "--device"]
    drafter_forward.main([*argv, "--json", str(out)])
    report = json.loads(out.read_text())
    assert list(report["device"]) == arms
    for by_part in report["device"].values():
        assert list(by_part) == list(drafter_forward.PARTS)
        for kernels in by_part.values():
            assert kernels["kernels"] == 3
            assert (kernels["busy_us"], kernels["sum_us"]) == (19.0, 24.0)
            assert kernels["span_us"] == 34.0
            assert kernels["top"] == [["gemm", 2, 14.0], ["norm", 1, 10.0]]
    assert len(calls) == len(arms) * len(drafter_forward.PARTS)
    assert "device (kernels, busy us, span us)" in capsys.readouterr().out


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--reps", "0"], "--reps must be at least 1"),
        (["--context", "1"], "--context must be at least 2"),
        (["--kernels", "off,off"], "an arm repeats"),
        (["--kernels", "sideways"], "unknown kernel arm"),
    ],
)
def test_bad_arguments_are_one_line(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        drafter_forward.parse_args(argv)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err
