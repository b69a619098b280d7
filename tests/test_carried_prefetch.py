"""benchmarks.carried_prefetch: each arm hands the prefetch CTAs to the launch it
names (none, the gap launch, or the carrier matmul), the timed triples are found among
other launches, and the command line refuses bad flags and the CPU."""

from __future__ import annotations

import mlx.core as mx
import pytest

from benchmarks import carried_prefetch
from dflash.metal import backend, prefetch


class _Side:
    """A stand-in side: one bound call recording the prefetch it was handed."""

    def __init__(self, rows: int, depth: int, handed: list) -> None:
        self.x = mx.ones((rows, depth), dtype=mx.bfloat16)
        self.nbytes = 1024

        def call(x: mx.array, prefetch=None) -> mx.array:
            handed.append(prefetch)
            return x

        self.bound = [call]


@pytest.mark.parametrize("arm", carried_prefetch.ARMS)
def test_each_arm_hands_the_prefetch_ctas_to_the_launch_it_names(
    arm: str, monkeypatch
) -> None:
    handed, gaps = [], []

    def launch(spec, inputs, shapes, dtypes, ctas, dtype):
        source, own, weight, words, asks = inputs
        gaps.append((own.tolist(), asks.tolist(), ctas, shapes))
        return [source[: 2 * 64].reshape(shapes[0])]

    monkeypatch.setattr(carried_prefetch, "launch_groups", launch)
    monkeypatch.setattr(
        carried_prefetch, "cupti_kernel_events", lambda run: run() or []
    )
    args = carried_prefetch.parse_args(["--reps", "2"])
    args.bandwidth = 1e12
    carrier = _Side(2, 64, handed)
    target = _Side(2, 64, [])
    weight = mx.zeros((64, 256), dtype=mx.uint32)
    plan = prefetch.plan((weight,), 1, fetchers=8)
    assert plan is not None and plan.fetchers == 8
    row, outs = carried_prefetch._time_arm(args, carrier, target, [plan], 3.0, arm)
    assert row["pairs_timed"] == 0 and len(outs) == 2
    copies = 1 + carried_prefetch.COPIERS
    own = [3000, 2 * 64]
    if arm == "norm":
        want_gap, want_carrier = (own, plan.params.tolist(), copies + 8), None
    else:
        want_gap = (own, [0, 0, 0], copies)
        want_carrier = plan if arm == "carried" else None
    assert [g[:3] for g in gaps] == [want_gap] * 3  # the first pair and two timed
    assert all(h is want_carrier for h in handed) and len(handed) == 3
    assert all(g[3] == [(2, 64)] for g in gaps)


def test_pairs_are_the_matmuls_on_either_side_of_each_gap() -> None:
    gap, mm, fill = "dflash_l2_prefetch_gap_1", "dflash_tensor_q4_m2_x", "fill"
    kernels = [
        (mm, 0.0, 10.0),
        (fill, 5.0, 1.0),  # a counter fill between: not a matmul, skipped
        (gap, 12.0, 3.0),
        (mm, 16.0, 20.0),
        (mm, 40.0, 11.0),
        (gap, 52.0, 4.0),
        (mm, 57.0, 21.0),
        (gap, 80.0, 5.0),  # no matmul after it
    ]
    assert carried_prefetch.pair_events(list(reversed(kernels))) == [
        (10.0, 3.0, 20.0),
        (11.0, 4.0, 21.0),
    ]


def test_probe_refuses_bad_flags_and_the_cpu(capsys) -> None:
    for flags in (
        ["--pairs", "o_proj>lm_head"],
        ["--arms", "none,telepathy"],
        ["--fetchers", "0"],
        ["--megabytes", "0"],
    ):
        with pytest.raises(SystemExit):
            carried_prefetch.parse_args(flags)
    assert "telepathy" in capsys.readouterr().err
    args = carried_prefetch.parse_args(
        ["--pairs", "gate_up>down", "--fetchers", "32,64"]
    )
    assert args.pairs == ["gate_up>down"] and args.fetchers == [32, 64]
    if backend.BACKEND != "cuda":
        assert carried_prefetch.main([]) == 1
        assert (
            capsys.readouterr().err.strip()
            == "carried_prefetch: needs mlx's CUDA backend"
        )
