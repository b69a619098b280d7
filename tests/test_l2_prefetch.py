"""benchmarks.l2_prefetch: its gap kernel compiles for sm_90, its arms ask for the bytes
they name (the pieces the kernel walks, enumerated here as it walks them), and its
command line refuses bad flags and the CPU (the timings need the GPU)."""

from __future__ import annotations

import argparse
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from support.compilers import NVCC, needs_nvcc
from support.group_emulator import check_cuda
from support.prefetch_walk import walked_lines

from benchmarks import l2_prefetch
from benchmarks.matmul_variants import SHAPES
from dflash.metal import backend, prefetch, tensor_qmm

LINE = l2_prefetch.CHUNK_BYTES


@needs_nvcc
def test_gap_kernel_compiles_for_sm90_with_both_prefetch_instructions(
    tmp_path: Path,
) -> None:
    result = check_cuda([l2_prefetch.GAP_SPEC], tmp_path, NVCC, flags=("-Xptxas", "-v"))
    assert result.ok, f"{result.command}\n{result.log}"
    assert "spill" not in result.log.replace("0 bytes spill", "")
    body = l2_prefetch.GAP_SPEC.body
    assert "cp.async.bulk.prefetch.L2.global" in body and "prefetch.global.L2" in body


@pytest.mark.parametrize("shape", ["o_proj", "attn q/k/v/gate fused", "mlp down"])
@settings(max_examples=12, deadline=None)
@given(lead=st.integers(1, 4), bulk=st.booleans())
def test_heads_arm_asks_for_each_ctas_first_chunks_of_every_column(
    shape: str, lead: int, bulk: bool
) -> None:
    depth, columns = SHAPES[shape]
    weight_bytes = columns * depth // 2
    scale_bytes = weight_bytes // 8
    ranges = l2_prefetch.byte_ranges(
        l2_prefetch.Arm("heads", lead), weight_bytes, scale_bytes, depth, columns, 0
    )
    got = walked_lines(prefetch.params_of(ranges, 8, bulk))
    _, splits, per_split = tensor_qmm.split_plan(depth, columns, 4)
    chunks, row_lines = depth // 256, depth // 2 // LINE
    scale_lines = scale_bytes // chunks // LINE
    want: dict[int, set[int]] = {0: set(), 1: set()}
    for split in range(splits):
        for chunk in range(split * per_split, min(split * per_split + lead, chunks)):
            want[0].update(column * row_lines + chunk for column in range(columns))
            want[1].update(chunk * scale_lines + i for i in range(scale_lines))
    for which in (0, 1):
        assert got[which].tolist() == sorted(want[which])


@settings(max_examples=20, deadline=None)
@given(megabytes=st.floats(0.5, 200.0), bulk=st.booleans())
def test_linear_arm_asks_for_a_prefix_of_each_array_within_it(
    megabytes: float, bulk: bool
) -> None:
    depth, columns = SHAPES["mlp gate+up fused"]
    weight_bytes = columns * depth // 2
    scale_bytes = weight_bytes // 8
    arm = l2_prefetch.Arm("linear", megabytes)
    ranges = l2_prefetch.byte_ranges(arm, weight_bytes, scale_bytes, depth, columns, 0)
    got = walked_lines(prefetch.params_of(ranges, 4, bulk))
    weights = got[0]
    assert np.array_equal(weights, np.arange(len(weights)))
    assert len(weights) * LINE <= min(weight_bytes, megabytes * 2**20)
    assert len(weights) * LINE > min(weight_bytes, megabytes * 2**20) - LINE
    assert int(got[1].max()) * LINE < scale_bytes


def test_all_arm_only_where_the_bytes_fit_the_l2() -> None:
    depth, columns = SHAPES["o_proj"]
    weight_bytes = columns * depth // 2
    arm = l2_prefetch.Arm("all")
    assert (
        l2_prefetch.byte_ranges(arm, weight_bytes, 8, depth, columns, weight_bytes)
        is None
    )
    assert l2_prefetch.byte_ranges(arm, weight_bytes, 8, depth, columns, 2**30) == [
        (0, 0, weight_bytes, 0, 1),
        (1, 0, 8, 0, 1),
    ]


def test_probe_refuses_bad_flags_and_the_cpu(capsys) -> None:
    for text in ("heads:1.5", "linear:-2", "teleport", "all:3", "columns:2.5"):
        with pytest.raises(argparse.ArgumentTypeError):
            l2_prefetch.parse_arm(text)
    with pytest.raises(SystemExit):
        l2_prefetch.parse_args(["--methods", "line,psychic"])
    assert "placements ['psychic']" in capsys.readouterr().err
    args = l2_prefetch.parse_args(["--arms", "none,heads:2", "--shapes", "o_proj"])
    assert [a.label for a in args.arms] == ["none", "heads:2"]
    if backend.BACKEND != "cuda":
        assert l2_prefetch.main([]) == 1
        assert (
            capsys.readouterr().err.strip() == "l2_prefetch: needs mlx's CUDA backend"
        )


@pytest.mark.parametrize("placement", ["fused", "separate"])
def test_each_placement_hands_its_launches_the_wait_and_the_prefetch_ctas(
    placement: str, monkeypatch
) -> None:
    """Fused: one gap launch that waits and carries the prefetch CTAs. Separate: a
    launch of the prefetch CTAs alone (no wait), then the waiting launch without
    them. Every launch reads the weights and the repack as words."""
    launched = []

    def launch(spec, inputs, shapes, dtypes, ctas, dtype):
        source, own, weight, words, asks = inputs
        launched.append((own.tolist(), asks.tolist()[0], ctas, weight, words.dtype))
        return [source]

    monkeypatch.setattr(l2_prefetch, "launch_groups", launch)
    monkeypatch.setattr(l2_prefetch, "cupti_kernel_events", lambda run: run() or [])
    args = l2_prefetch.parse_args(["--reps", "2", "--prefetch-ctas", "8"])
    args.bandwidth = 1e12
    x = mx.ones((2, 256), dtype=mx.bfloat16)
    weight = mx.zeros((16, 32), dtype=mx.uint32)
    repack = mx.zeros((1, 16, 8), dtype=mx.bfloat16)
    ranges = [(0, 0, 128, 0, 1)]
    row = l2_prefetch._time_arm(
        args, "o_proj", 2, x, [(weight, None, None)], [lambda y: y], [repack], 5.0,
        l2_prefetch.Arm("linear", 1), "line", placement, ranges, weight.nbytes,
    )  # fmt: skip
    copies = 1 + l2_prefetch.COPIERS
    if placement == "fused":
        want = [([5000, 512], 8, copies + 8)]
    else:
        want = [([0, 512], 8, copies + 8), ([5000, 512], 0, copies)]
    got = [(own, fetchers, ctas) for own, fetchers, ctas, _, _ in launched]
    assert got == want * 3  # the first pair, then each of the two timed
    assert all(w is weight and dt == mx.uint32 for _, _, _, w, dt in launched)
    assert row["placement"] == placement and row["prefetch_ctas"] == 8
