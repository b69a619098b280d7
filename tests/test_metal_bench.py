"""Smoke runs of ``python -m dflash.metal.bench`` at tiny sizes on the CPU."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dflash.metal import backend, bench
from dflash.metal.compile_check import MetalEmulator, check_specs, find_compiler

TINY = ["--window", "256", "--sliding", "2", "--full", "1", "--heads", "2"]
TINY += ["--dim", "64", "--block", "4", "--reps", "2", "--warmup", "1"]


def _run(tmp_path: Path, *extra: str) -> dict:
    out = tmp_path / "bench.json"
    assert bench.main(["--json", str(out), *TINY, *extra]) == 0
    return json.loads(out.read_text())


def test_bench_reference_round(tmp_path: Path) -> None:
    report = _run(tmp_path, "--contexts", "300", "700", "--modes", "reference")
    assert report["meta"]["geometry"]["window"] == 256
    rings, growing, block = 4, 2, 4
    plane_bytes = 256 * 2 * 64 * 2
    for result in report["results"]:
        rows = result["per_accept"]
        assert [r["accepted"] for r in rows] == list(range(block + 1))
        for row in rows:
            restore = rings if row["accepted"] < block else 0
            # rings gathers + 1 stack, one scatter per plane, one per restore.
            assert row["launches"] == rings + 1 + rings + growing + restore
            # The scatters ran in place: the round allocates less than a plane.
            assert row["allocated_bytes"] < plane_bytes
        assert result["stage"]["launches"] == {"Gather": rings, "Concatenate": rings}


def test_bench_refuses_context_below_window(tmp_path: Path) -> None:
    with pytest.raises(SystemExit, match="rings not full"):
        _run(tmp_path, "--contexts", "100", "--modes", "reference")


@pytest.mark.skipif(find_compiler("g++") is None, reason="g++ not installed")
def test_bench_kernel_modes_on_emulated_metal(tmp_path: Path) -> None:
    emu = MetalEmulator(tmp_path, check_specs(planes=(4,)))
    assert emu.build.ok, emu.build.log
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(backend, "BACKEND", "metal")
        patch.setattr(backend, "launch", emu.launch)
        report = _run(tmp_path, "--contexts", "300", "--modes", "kernels", "auto")
    assert [r["mode"] for r in report["results"]] == ["kernels", "auto"]
    assert emu.launches > 0
    kernels, auto = report["results"]
    # Fresh-output stores/restores move whole planes; the auto path does not.
    assert (
        kernels["per_accept"][0]["model_bytes"] > auto["per_accept"][0]["model_bytes"]
    )
