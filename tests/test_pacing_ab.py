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
    tmp_path, monkeypatch
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
    arms = "0,2,3t,auto"
    argv = ["--context", "24", "--tokens", "30", "--arms", arms, "--reps", "2"]
    pacing_ab.main([*argv, "--json", str(out)])
    report = json.loads(out.read_text())
    assert report["all_lossless"]
    assert set(report["median_ms"]) == {"0", "2", "3t", "auto"}
    assert all(len(runs) == 2 for runs in report["ms"].values())
    assert all(rounds and min(rounds) >= 1 for rounds in report["rounds"].values())
    # Each run's round times, one per counted round; their pooled medians per arm.
    for arm, runs in report["round_ms"].items():
        assert [len(times) for times in runs] == report["rounds"][arm]
        assert all(ms > 0 for times in runs for ms in times)
    assert set(report["round_median_ms"]) == set(report["ms"])
    assert len(report["plain_ms"]) == 1  # every other repetition
    assert set(report["wins_vs_first"]) == {"2", "3t", "auto"}
    # Warm-ups and timed runs: each arm's switches, as the generator read them.
    assert sorted(set(seen)) == [(0, False), (2, False), (3, True), (4, False)]
    assert len(seen) == 4 * 3
    # The auto arm's choice (one setup), with the rounds it timed per arm.
    (choice,) = report["auto_choices"]
    assert set(choice["rounds"]) == {"False", "True"}
    assert sum(choice["rounds"].values()) >= 1
    assert EVAL_EVERY_ENV not in os.environ and os.environ[EVAL_TAIL_ENV] == "1"


@pytest.mark.parametrize(
    "text", ["0,x", "4,4", "t", "-1", "4tt", "0t", "00t", "autox", "auto4", "auto,auto"]
)
def test_a_bad_arm_list_is_refused(text):
    with pytest.raises(argparse.ArgumentTypeError):
        pacing_ab.parse_arms(text)


def test_round_medians_leave_out_each_runs_first_round():
    runs = {"0": [[100.0, 1.0, 2.0], [50.0, 3.0]], "4": [[9.0]], "auto": []}
    assert pacing_ab.round_medians(runs) == {"0": 2.0, "4": None, "auto": None}


def test_bad_numbers_exit_with_one_line(capsys):
    with pytest.raises(SystemExit) as raised:
        pacing_ab.parse_args(["--tau", "9"])
    assert raised.value.code == 2
    assert "--tau must be in 1..8" in capsys.readouterr().err
