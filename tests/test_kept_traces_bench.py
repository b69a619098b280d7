"""benchmarks.kept_traces: kept traces on and off, each arm's runs in a row, lossless."""

from __future__ import annotations

import json
import os

import pytest

from benchmarks import kept_traces
from dflash.kernel_patch import KEEP_TRACES_ENV


def test_each_arm_runs_its_generations_under_its_switch(tmp_path, monkeypatch):
    monkeypatch.setenv(KEEP_TRACES_ENV, "1")  # restored after each arm
    seen = []
    timed_run = kept_traces.timed_run

    def recording(mode, *args):
        seen.append((mode.name, os.environ.get(KEEP_TRACES_ENV)))
        return timed_run(mode, *args)

    monkeypatch.setattr(kept_traces, "timed_run", recording)
    out = tmp_path / "kept.json"
    argv = ["--context", "24", "--tokens", "10", "--reps", "2", "--runs", "2"]
    kept_traces.main([*argv, "--json", str(out)])
    report = json.loads(out.read_text())
    assert report["lossless"] == {"plain": True, "dflash": True}
    for by_arm in report["ms"].values():
        assert all(
            len(reps) == 2 and all(len(r) == 2 for r in reps)
            for reps in by_arm.values()
        )
    assert set(report["median_later_ms"]["dflash"]) == {"keep", "drop"}
    # Rep 0: keep then drop, rep 1 reversed; each arm's two runs in a row.
    plain = [flag for name, flag in seen if name == "ours-plain"]
    assert plain == ["1", "1", "0", "0", "0", "0", "1", "1"]
    assert len(seen) == 16 and os.environ[KEEP_TRACES_ENV] == "1"


def test_one_run_an_arm_is_refused(capsys):
    with pytest.raises(SystemExit) as raised:
        kept_traces.parse_args(["--runs", "1"])
    assert raised.value.code == 2
    assert "--runs must be at least 2" in capsys.readouterr().err
