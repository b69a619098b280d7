"""benchmarks.copy_probe: its kernels compile for sm_90, its plan is the matmul's, and
its command line refuses bad flags and the CPU (the timings need the GPU)."""

from __future__ import annotations

from pathlib import Path

import pytest
from support.compilers import NVCC, needs_nvcc
from support.group_emulator import check_cuda

from benchmarks import copy_probe
from benchmarks.matmul_variants import SHAPES
from dflash.metal import backend, tensor_qmm


@needs_nvcc
def test_probe_kernels_compile_for_sm90_with_their_copy_instructions(
    tmp_path: Path,
) -> None:
    """ptxas takes every form's inline PTX (cp.async, the bulk copies, the mbarrier)."""
    specs = copy_probe.probe_specs()
    result = check_cuda(
        [*specs.values(), copy_probe.ADDRESS_SPEC],
        tmp_path,
        NVCC,
        flags=("-Xptxas", "-v"),
    )
    assert result.ok, f"{result.command}\n{result.log}"
    assert "spill" not in result.log.replace("0 bytes spill", "")
    assert "cp.async.bulk" in specs["bulk-tile"].body
    assert "cp.async.cg" in specs["cpasync-tile"].body
    assert "cp.async.cg" in specs["cpasync-slab"].body
    # The slab form reads the repack, not the rows as they lie.
    assert "row_bytes + size_t(c)" in specs["cpasync-tile"].body
    assert "row_bytes + size_t(c)" not in specs["cpasync-slab"].body
    assert "cp.async.bulk.tensor.2d" in specs["tma-tile"].body
    assert specs["tma-tile"].input_names[-1] == "tensor_map"


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_probe_runs_the_matmuls_grid_over_the_whole_array(shape: str) -> None:
    depth, columns = SHAPES[shape]
    params, groups = copy_probe.probe_params(depth, columns, 1056)
    tiles, splits, per_split = tensor_qmm.split_plan(depth, columns, 4)
    assert groups == tiles * splits
    n_cols, row_bytes, chunks, p_tiles, p_splits, p_per, pieces = params
    assert (n_cols, p_tiles, p_splits, p_per) == (columns, tiles, splits, per_split)
    assert row_bytes * 2 == depth and chunks * copy_probe.CHUNK_BYTES == row_bytes
    assert pieces * 16 == columns * depth // 2
    # Every chunk of every column tile is some CTA's.
    assert splits * per_split >= chunks > (splits - 1) * per_split
    assert tiles * copy_probe.COLUMNS >= columns


def test_probe_refuses_bad_flags_and_the_cpu(capsys) -> None:
    with pytest.raises(SystemExit):
        copy_probe.parse_args(["--forms", "stream,teleport"])
    assert "unknown form or shape: teleport" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        copy_probe.parse_args(["--cold-bytes", "-1"])
    assert "--cold-bytes >= 0" in capsys.readouterr().err
    args = copy_probe.parse_args(["--forms", "bulk-slab", "--shapes", "o_proj"])
    assert args.forms == ["bulk-slab"] and args.shapes == ["o_proj"]
    if backend.BACKEND != "cuda":
        assert copy_probe.main([]) == 1
        assert capsys.readouterr().err.strip() == "copy_probe: needs mlx's CUDA backend"
