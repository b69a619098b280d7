"""Smoke runs of ``benchmarks.cache_round`` and ``cache_forward`` at tiny sizes on the CPU."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from support.compile_check import find_compiler

from benchmarks import cache_forward, cache_round
from dflash.metal import backend

TINY = ["--window", "256", "--sliding", "3", "--full", "1", "--heads", "2"]
TINY += ["--dim", "64", "--block", "4", "--reps", "2", "--warmup", "1"]
PLANE_BYTES = 256 * 2 * 64 * 2  # one K or V ring plane


def _run(tmp_path: Path, *extra: str, geometry=TINY) -> dict:
    out = tmp_path / "bench.json"
    assert cache_round.main(["--json", str(out), *geometry, *extra]) == 0
    assert (tmp_path / "bench.md").read_text().startswith("# benchmarks.cache_round")
    return json.loads(out.read_text())


def test_bench_rounds_and_launch_counts(tmp_path: Path) -> None:
    report = _run(tmp_path, "--contexts", "300", "700", "--skip-verify")
    assert report["meta"]["geometry"]["window"] == 256
    rings, growing, block = 3, 1, 4
    for result in report["ops"]:
        for row in result["per_kept"]:
            # K and V planes: gathers + stack, one store per plane, one restore per ring.
            restore = 2 * rings if row["kept"] < block else 0
            assert row["launches"] == 2 * rings + 1 + 2 * (rings + growing) + restore
            assert row["allocated_bytes"] < PLANE_BYTES  # in place: under one plane
    for result in report["cache"]:
        assert result["mode"] == "reference"
        for row in result["per_kept"]:
            # Per ring: stack K/V + one concatenate of the live rows' runs and the chunk
            # (the shadow); per growing plane: stack + store. The commit stores the kept
            # rows: one launch per ring.
            assert row["fetch_launches"] == 2 * rings + 2 * growing
            assert row["commit_launches"] == (rings if row["kept"] else 0)
            assert row["plain_launches"] == 2 * rings + 2 * growing + rings
            assert row["allocated_bytes"] < PLANE_BYTES  # the commit stores in place
        assert [r["kept"] for r in result["per_kept"]] == list(range(block + 1))


def test_bench_small_runs_every_section(tmp_path: Path) -> None:
    report = _run(tmp_path, "--small", "--contexts", "64", geometry=[])
    assert [r["mode"] for r in report["cache"]] == ["reference"]
    assert report["meta"]["skipped_modes"] == ["kernels"]
    (verify,) = report["verify"]
    assert verify["forward_launches"] > 0 and verify["plain_forward_ms"]["median"] > 0


def test_bench_refuses_context_below_window(tmp_path: Path) -> None:
    with pytest.raises(SystemExit, match="rings not full"):
        _run(tmp_path, "--contexts", "10")


@pytest.mark.skipif(find_compiler("g++") is None, reason="g++ not installed")
def test_bench_kernel_mode_on_emulated_metal(tmp_path: Path) -> None:
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(backend, "BACKEND", backend.BACKEND)
        patch.setattr(backend, "launch", backend.launch)
        report = _run(
            tmp_path,
            "--contexts",
            "300",
            "--skip-ops",
            "--skip-verify",
            "--emulate-metal",
            str(tmp_path / "emu"),
        )
    assert [r["mode"] for r in report["cache"]] == ["reference", "kernels"]
    assert report["meta"]["emulated_metal"]


def test_bench_forward_pairs_every_route_with_the_cache_free_forward(
    tmp_path: Path,
) -> None:
    out = tmp_path / "forward.json"
    assert cache_forward.main(["--json", str(out), "--small", "--contexts", "96"]) == 0
    report = json.loads(out.read_text())
    assert (
        (tmp_path / "forward.md").read_text().startswith("# benchmarks.cache_forward")
    )
    (result,) = report["contexts"]
    routes = result["routes"]
    assert {"none", "mlx-lm", "reference"} <= set(routes)
    assert "cache_ms" not in routes["none"]
    assert all("cache_ms" in routes[r] for r in ("mlx-lm", "reference"))
    rings, growing = 6, 2  # the --small model: 8 layers, one full in four
    none, ref = routes["none"]["launches"], routes["reference"]["launches"]
    # Per ring: stack + concatenate (the shadow); per growing plane: stack + store; the
    # commit (kept = B) stores once per ring. The mask is memoised.
    assert ref["forward"] - none["forward"] == 2 * rings + 2 * growing
    assert ref["commit"] == rings and none["commit"] == 0
