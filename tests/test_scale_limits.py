"""benchmarks.scale_limits: which 4-bit weight arrays the denormal decode and its pairs
in place can serve, by the bind's own verdict; and its command line."""

from __future__ import annotations

import json

import mlx.core as mx
import mlx.nn as nn
import pytest
from conftest import save_target, tiny_model
from hypothesis import given, settings
from hypothesis import strategies as st

from benchmarks import scale_limits
from dflash.metal import tensor_qmm

# Weight spreads whose 4-bit group scales land below 2^-5, between 2^-5 and 0.25, and
# past 0.25 (a group's scale is about its range / 15).
SMALL, MEDIUM, LARGE = 0.004, 0.3, 3.0


def _quantized_glimmer(dtype: mx.Dtype, spreads: dict) -> nn.Module:
    """A tiny Muse Glimmer whose linear weights have spread ``SMALL`` unless named in
    ``spreads`` (a layer path to its spread), quantized to 4 bits in groups of 32."""
    model = tiny_model("muse_glimmer")
    mx.random.seed(3)
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear):
            spread = spreads.get(name, SMALL)
            module.weight = spread * mx.random.normal(module.weight.shape)
    model.set_dtype(dtype)
    nn.quantize(model, group_size=32, bits=4)
    mx.eval(model.parameters())
    return model


def test_each_array_takes_the_decode_its_largest_scale_allows() -> None:
    """Per layer: small scales take the pairs in place (bfloat16), medium ones the
    denormal decode, large ones the scaled form; float16 never takes the pairs in
    place; the summary counts every 4-bit array once, with byte shares summing to 1."""
    medium, large = "model.layers.0.self_attn.o_proj", "model.layers.1.mlp.down_proj"
    spreads = {medium: MEDIUM, large: LARGE}
    for dtype, small_decode in ((mx.bfloat16, "in_place"), (mx.float16, "denormal")):
        census = scale_limits.scale_census(_quantized_glimmer(dtype, spreads))
        decodes = {layer["name"]: layer["decode"] for layer in census["layers"]}
        assert decodes[medium] == "denormal" and decodes[large] == "scaled"
        others = set(decodes) - {medium, large}
        assert others and {decodes[name] for name in others} == {small_decode}
        summary = census["summary"]
        assert sum(row["arrays"] for row in summary.values()) == len(decodes)
        assert sum(row["byte_share"] for row in summary.values()) == pytest.approx(
            1.0, abs=1e-3
        )
        assert summary["scaled"]["arrays"] == 1


@settings(max_examples=25, deadline=None)
@given(
    spread=st.floats(1e-3, 1.0),
    half=st.sampled_from(["bfloat16", "float16"]),
    seed=st.integers(0, 2**16),
)
def test_decode_verdict_follows_both_scale_limits(spread, half, seed) -> None:
    """Whatever the weights' spread: the pairs in place exactly where the scales are
    bfloat16 normal numbers below 2^-5, the denormal decode where they are below 0.25,
    else the scaled form (the largest scale reported is the array's)."""
    dtype = getattr(mx, half)
    mx.random.seed(seed)
    layer = nn.Linear(128, 48, bias=False)
    layer.weight = spread * mx.random.normal(layer.weight.shape)
    layer.set_dtype(dtype)
    quantized = nn.QuantizedLinear.from_linear(layer, group_size=32, bits=4)
    row = scale_limits.array_decode(quantized)
    magnitude = mx.abs(quantized.scales.astype(mx.float32))
    largest = mx.max(magnitude).item()
    normal = mx.all(magnitude >= (2.0**-126 if half == "bfloat16" else 2.0**-14)).item()
    assert row["largest_scale"] == largest
    if not normal or largest >= 0.25:
        assert row["decode"] == "scaled"
    elif half == "bfloat16" and largest < tensor_qmm.IN_PLACE_SCALE_LIMIT:
        assert row["decode"] == "in_place"
    else:
        assert row["decode"] == "denormal"


def test_command_line_reports_a_saved_model_and_refuses_a_missing_one(
    tmp_path, capsys
) -> None:
    """On a saved 4-bit model folder: one summary line and the per-layer JSON; on a
    folder that is not there: one line on stderr and a non-zero exit, no traceback."""
    model = _quantized_glimmer(mx.bfloat16, {"model.layers.0.mlp.gate_proj": LARGE})
    folder = tmp_path / "model"
    save_target(model, folder)
    config = json.loads((folder / "config.json").read_text())
    config["quantization"] = {"group_size": 32, "bits": 4}
    (folder / "config.json").write_text(json.dumps(config))
    out = tmp_path / "scales.json"
    assert scale_limits.main(["--model", str(folder), "--json", str(out)]) == 0
    line = capsys.readouterr().out.strip()
    assert "4-bit arrays" in line and "scaled 1 " in line and "\n" not in line
    layers = json.loads(out.read_text())["layers"]
    scaled = [layer["name"] for layer in layers if layer["decode"] == "scaled"]
    assert scaled == ["model.layers.0.mlp.gate_proj"]
    assert scale_limits.main(["--model", str(tmp_path / "absent")]) == 1
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.count("\n") == 1
    assert "scale_limits: cannot load" in captured.err
