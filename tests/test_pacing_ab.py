"""benchmarks.pacing_ab: pacing arms alternated in one process, each run checked lossless."""

from __future__ import annotations

import argparse
import json
import os

import pytest

from benchmarks import pacing_ab
from dflash import dflash_round
from dflash.dflash_round import EVAL_EVERY_ENV, EVAL_TAIL_ENV


def test_every_arm_reaches_the_generation_and_every_run_is_lossless(
    tmp_path, monkeypatch, capsys
):
    monkeypatch.delenv(EVAL_EVERY_ENV, raising=False)
    monkeypatch.setenv(EVAL_TAIL_ENV, "1")  # restored after each arm
    seen = []
    taps = dflash_round.TargetTaps

    class RecordingTaps(taps):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            seen.append((kwargs["eval_every"], kwargs["eval_tail"]))

    monkeypatch.setattr(dflash_round, "TargetTaps", RecordingTaps)
    out = tmp_path / "pacing.json"
    arms = "0,2,3t,auto,2/b"
    argv = ["--context", "24", "--tokens", "30", "--arms", arms, "--reps", "2"]
    pacing_ab.main([*argv, "--json", str(out)])
    report = json.loads(out.read_text())
    assert report["all_lossless"]
    # On the CPU mlx's CUDA graphs mean nothing, and the record says so.
    assert report["cuda_graphs"] is None
    # Each repetition's line says its times, mlx-lm's plain (every other one) and
    # whether its runs were lossless, before the summary.
    lines = [
        line
        for line in capsys.readouterr().out.splitlines()
        if line[:2] in ("0 ", "1 ")
    ]
    assert lines[0].startswith("0 {'0': ") and " plain " in lines[0]
    assert lines[1].startswith("1 {'0': ") and " plain " not in lines[1]
    assert all(line.endswith("lossless True") for line in lines)
    assert set(report["median_ms"]) == {"0", "2", "3t", "auto", "2/b"}
    assert all(len(runs) == 2 for runs in report["ms"].values())
    assert all(rounds and min(rounds) >= 1 for rounds in report["rounds"].values())
    # Each run's round times, one per counted round; their pooled medians per arm.
    for arm, runs in report["round_ms"].items():
        assert [len(times) for times in runs] == report["rounds"][arm]
        assert all(ms > 0 for times in runs for ms in times)
    assert set(report["round_median_ms"]) == set(report["ms"])
    assert len(report["plain_ms"]) == 1  # every other repetition
    assert set(report["wins_vs_first"]) == {"2", "3t", "auto", "2/b"}
    # The copy is an A/A control against its original.
    (pair,) = report["controls"].items()
    assert pair[0] == "2/b vs 2" and pair[1]["runs"] == 2
    # Warm-ups and timed runs: each arm's switches, as the generator read them.
    assert sorted(set(seen)) == [(0, False), (2, False), (3, True), (4, False)]
    assert len(seen) == 5 * 3
    # The auto arm's choice (one setup), with the rounds it timed per arm.
    (choice,) = report["auto_choices"]
    assert set(choice["rounds"]) == {"False", "True"}
    assert sum(choice["rounds"].values()) >= 1
    assert EVAL_EVERY_ENV not in os.environ and os.environ[EVAL_TAIL_ENV] == "1"


@pytest.mark.parametrize(
    "text",
    [
        "0,x", "4,4", "t", "-1", "4tt", "0t", "00t", "autox", "auto4", "auto,auto",
        "0,4/b", "4,4/b,4/b", "4,4/", "4,4/b/c", "0t/b", "4,4/-",
    ],
)  # fmt: skip
def test_a_bad_arm_list_is_refused(text):
    with pytest.raises(argparse.ArgumentTypeError):
        pacing_ab.parse_arms(text)


def test_copies_are_arms_with_their_originals_switches():
    assert pacing_ab.parse_arms("0,4,4/b,auto,auto/x") == [
        "0",
        "4",
        "4/b",
        "auto",
        "auto/x",
    ]
    assert pacing_ab.arm_setting("4t/b") == "4t"
    with pacing_ab.arm_switches("4t/b"):
        assert os.environ[EVAL_EVERY_ENV] == "4" and os.environ[EVAL_TAIL_ENV] == "1"


def test_controls_compare_each_copy_with_its_original():
    runs = {"0": [5.0, 5.0], "4": [10.0, 12.0, 14.0], "4/b": [11.0, 11.0, 13.0]}
    got = pacing_ab.controls(runs, ["0", "4", "4/b"])
    assert got == {
        "4/b vs 4": {"wins": 2, "runs": 3, "median_ratio": round(11 / 12, 4)}
    }
    assert pacing_ab.controls(runs, ["0", "4"]) == {}


def test_round_medians_leave_out_each_runs_first_round():
    runs = {"0": [[100.0, 1.0, 2.0], [50.0, 3.0]], "4": [[9.0]], "auto": []}
    assert pacing_ab.round_medians(runs) == {"0": 2.0, "4": None, "auto": None}


def test_bad_numbers_exit_with_one_line(capsys):
    with pytest.raises(SystemExit) as raised:
        pacing_ab.parse_args(["--tau", "9"])
    assert raised.value.code == 2
    assert "--tau must be in 1..8" in capsys.readouterr().err


@pytest.mark.parametrize(
    "quant, direct",
    [("4bit", True), ("8bit", False), ("4bit-g32", False), ("bf16", False)],
)
def test_the_commands_launch_mode_is_theirs_and_mlxs_is_left_alone(quant, direct):
    """``--launch-mode commands`` asks for direct launches exactly where the ``dflash``
    commands would for that target (4-bit groups of 64 today); ``mlx`` changes nothing,
    and a value already set is kept."""
    from benchmarks.common import apply_launch_mode

    environ = {}
    assert apply_launch_mode("mlx", quant, environ) is False and environ == {}
    assert apply_launch_mode("commands", quant, environ) is direct
    assert environ == ({"MLX_USE_CUDA_GRAPHS": "0"} if direct else {})
    chosen = {"MLX_USE_CUDA_GRAPHS": "1"}
    assert apply_launch_mode("commands", quant, chosen) is False
    assert chosen == {"MLX_USE_CUDA_GRAPHS": "1"}


def test_an_unknown_launch_mode_is_refused_in_one_line(capsys):
    with pytest.raises(SystemExit) as stopped:
        pacing_ab.parse_args(["--launch-mode", "graphs"])
    assert stopped.value.code == 2
    assert "--launch-mode" in capsys.readouterr().err
