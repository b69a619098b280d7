"""benchmarks.layer_stack on the CPU: every arm runs, compiled layers give the eager
bits, and bad flags are refused with one line."""

from __future__ import annotations

import json

import mlx.core as mx
import pytest

from benchmarks import layer_stack


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
    assert all(row["build_us"] > 0 and row["wall_us"] > 0 for row in result["runs"])
    assert result["bitwise"] == {
        "mlx-compiled == mlx": True,
        "ours-compiled == ours": True,
    }
    assert json.loads(out.read_text())["runs"] == result["runs"]


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
