"""benchmarks.layer_stack on the CPU: every arm runs, compiled layers give the eager
bits, and bad flags are refused with one line."""

from __future__ import annotations

import json

import mlx.core as mx
import mlx.nn as nn
import pytest

from benchmarks import layer_stack
from dflash.bench.scale_target import QUANT_FORMS


def test_layer_stack_runs_every_arm_and_compiled_layers_keep_the_bits(tmp_path):
    out = tmp_path / "stack.json"
    result = layer_stack.main(
        [
            "--geometry", "tiny", "--quant", "4bit", "--layers", "2", "--forwards",
            "3", "--passes", "1", "--reps", "2", "--json", str(out),
        ]
    )  # fmt: skip
    arms = [row["arm"] for row in result["runs"]]
    assert arms == list(layer_stack.ARMS) * 2
    assert all(
        row["build_us"] > 0 and row["encode_us"] > 0 and row["wall_us"] > 0
        for row in result["runs"]
    )
    assert result["bitwise"] == {
        "mlx-compiled == mlx": True,
        "ours-compiled == ours": True,
        "ours-unprepared == ours": True,
        "ours-residual == ours": True,
        "ours-ungated == ours": True,
        "ours-blocked == ours": True,
        "ours-unstacked == ours": True,
        "ours-swiglu == ours": True,
        "ours-traced == ours": True,
        "ours-untraced == ours": True,
    }
    assert json.loads(out.read_text())["runs"] == result["runs"]


@pytest.mark.parametrize(
    "arm", ["mlx", "ours", "ours-unprepared", "ours-residual", "ours-blocked"]
)
def test_verify_forwards_over_a_context_leave_the_planes_as_they_were(arm):
    """With --context each forward is a rolled-back verify block: the planes keep their
    offsets, and the same block again gives the same bits (a ring that wrapped, a
    growing plane; our attention route for ``ours``)."""
    model = layer_stack.build_layers("tiny", "4bit", 4)
    cache = layer_stack.prefill(model, 70)
    offsets = [plane.offset for plane in cache]
    block = mx.random.normal((1, 16, model.args.hidden_size)).astype(mx.bfloat16)
    with layer_stack.arm_context(model, arm, attention=True):
        forward = layer_stack.verify_forward_of(model, cache)
        first = forward(block)
        mx.eval(first)
        assert [plane.offset for plane in cache] == offsets == [70] * 4
        again = forward(block)
        mx.eval(again)
    assert mx.array_equal(first, again).item()
    assert [plane.offset for plane in cache] == offsets


def test_layer_stack_runs_verify_blocks_over_a_context():
    result = layer_stack.main(
        [
            "--geometry", "tiny", "--layers", "2", "--context", "40", "--arms",
            "mlx,ours", "--forwards", "2", "--passes", "1",
        ]
    )  # fmt: skip
    assert [row["arm"] for row in result["runs"]] == ["mlx", "ours"]


def test_stubbed_launches_time_the_cuda_route_and_are_undone(monkeypatch):
    """--stub-launches takes our kernel path as CUDA would (every launch a stand-in, so
    the attention route's Python runs on the CPU too) and restores the backend after."""
    from dflash.metal import attention, backend

    calls = []
    route = attention.kernel_attention
    monkeypatch.setattr(
        attention, "kernel_attention", lambda *a: calls.append(1) or route(*a)
    )
    before = backend.BACKEND
    result = layer_stack.main(
        [
            "--geometry", "tiny", "--layers", "2", "--context", "40", "--arms",
            "ours,ours-ungated", "--forwards", "2", "--passes", "1", "--stub-launches",
        ]
    )  # fmt: skip
    assert calls and result["runs"][0]["build_us"] > 0
    assert result["bitwise"] == {}  # stand-ins' zeros are not compared
    assert backend.BACKEND == before


def test_layer_stack_leaves_the_model_unpatched_after_each_arm():
    model = layer_stack.build_layers("tiny", "bf16", 1)
    classes = [type(m) for m in model.modules()]
    with layer_stack.arm_context(model, "ours"):
        assert [type(m) for m in model.modules()] != classes
    assert [type(m) for m in model.modules()] == classes


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--arms", "mlx,fast"], "unknown arm(s) fast"),
        (["--layers", "0"], "--layers must be >= 1"),
        (["--quant", "3bit"], "invalid choice"),
        (["--context", "-1"], "--context must be >= 0"),
        (["--context", "64"], "--context takes the eager arms only"),
        (["--trace", "--stub-launches"], "--trace times real launches"),
        pytest.param(
            ["--trace"],
            "--trace needs mlx's CUDA backend",
            marks=pytest.mark.skipif(mx.cuda.is_available(), reason="CPU only"),
        ),
    ],
)
def test_layer_stack_refuses_bad_flags(argv, message, capsys):
    with pytest.raises(SystemExit):
        layer_stack.parse_args(argv)
    assert message in capsys.readouterr().err


def test_kernel_sequence_is_the_middle_forward_in_launch_order():
    """Three forwards of two kernels, listed out of order: the middle one's, by start."""
    kernels = [
        ("void ns::copy_g_nd<__nv_bfloat16, int, 3, 8>(float const*)", 12.0, 1.0),
        ("ns::custom_kernel_dflash_fold_chunks_abc(float const*)", 2.0, 1.0),
        ("void ns::copy_g_nd<__nv_bfloat16, int, 2, 8>(float const*)", 1.0, 1.0),
        ("ns::custom_kernel_dflash_fold_chunks_abc(float const*)", 21.0, 1.0),
        ("void ns::rms_norm_small<__nv_bfloat16, 64, 1>(float const*)", 11.0, 1.0),
        ("ns::custom_kernel_dflash_fold_chunks_abc(float const*)", 22.0, 1.0),
    ]
    assert layer_stack.kernel_sequence(kernels, 3) == [
        "rms_norm_small<64,1>",
        "copy_g_nd<3,8>",
    ]


@pytest.mark.parametrize("quant", ["4bit-g128", "8bit-g32"])
def test_layers_are_quantized_as_the_scale_target_names_them(quant):
    """The stack takes the scale target's group-size names (``-gN``) as it does."""
    model = layer_stack.build_layers("tiny", quant, 2)
    layers = [m for _, m in model.named_modules() if isinstance(m, nn.QuantizedLinear)]
    assert layers and {(m.bits, m.group_size) for m in layers} == {QUANT_FORMS[quant]}
