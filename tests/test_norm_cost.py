"""benchmarks.norm_cost: its groups are a Glimmer layer's norm-add(-norm) ops in both
forms, and its command line refuses bad flags and the CPU in one line (the timings need
the GPU)."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from benchmarks import norm_cost


@pytest.mark.parametrize(
    "argv",
    [["--rows", "0"], ["--rows", "a,b"], ["--reps", "0"], ["--dim", "9000"], []],
)
def test_bad_flags_and_the_cpu_fail_in_one_line(argv, capsys) -> None:
    if not argv and mx.cuda.is_available():
        pytest.skip("the CPU refusal is for machines without CUDA")
    assert norm_cost.main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("norm_cost: ")


def test_the_mlx_groups_are_the_layers_ops_in_order() -> None:
    branch, residual, weight, following = norm_cost._inputs(3, 256, mx.bfloat16, 1)
    h, normed = norm_cost.group_call("mlx", "post")(branch, residual, weight, following)
    want_h = residual + mx.fast.rms_norm(branch, weight, norm_cost.EPS)
    want = mx.fast.rms_norm(want_h, following, norm_cost.EPS)
    assert np.array_equal(
        np.array(h.astype(mx.float32)), np.array(want_h.astype(mx.float32))
    )
    assert np.array_equal(
        np.array(normed.astype(mx.float32)), np.array(want.astype(mx.float32))
    )
    (last,) = norm_cost.group_call("mlx", "last")(branch, residual, weight, following)
    assert np.array_equal(
        np.array(last.astype(mx.float32)), np.array(want_h.astype(mx.float32))
    )
