"""Which of a model's 4-bit weight arrays the fast 4-bit decodes can serve (any machine).

The 4-bit matmul decodes each weight nibble as a subnormal against its group's scale
raised by 2^130 (the denormal decode, :data:`dflash.metal.tensor_qmm.DENORMAL_Q4`), and
in bfloat16 leaves the nibble pairs where they lie against scales raised by 2^133 and
2^129 (the pairs in place, :data:`~dflash.metal.tensor_qmm.DENORMAL_IN_PLACE`). Each is
exact only while every scale of the array is a normal number below its limit (0.25,
2^-5), and is bound per array, with the same verdict as here
(:func:`~dflash.metal.tensor_qmm.scale_decode`); an array past a limit keeps the
slower form with the same bits. This reads only the scales (the model is loaded lazily)
and reports, per ``QuantizedLinear``, its largest scale and which decode it takes, and
the share of the 4-bit weight bytes each decode serves.

Run::

    python -m benchmarks.scale_limits --model path/to/mlx-model [--json scales.json]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

import mlx.core as mx
import mlx.nn as nn

from dflash.metal import tensor_qmm


def array_decode(module: nn.QuantizedLinear) -> Dict[str, Any]:
    """One 4-bit layer's largest scale and the decode its scales allow: ``"in_place"``
    (bfloat16, every scale normal and below 2^-5), ``"denormal"`` (normal and below
    0.25) or ``"scaled"`` (neither)."""
    scales = module.scales
    largest = mx.max(mx.abs(scales.astype(mx.float32))).item()
    decode = tensor_qmm.scale_decode(scales)
    nbytes = module.weight.nbytes + scales.nbytes + module.biases.nbytes
    return {"largest_scale": largest, "decode": decode, "bytes": nbytes}


def scale_census(model: nn.Module) -> Dict[str, Any]:
    """Per 4-bit affine ``QuantizedLinear`` of ``model``, its decode (see
    :func:`array_decode`), and the count and weight-byte share of each decode."""
    layers: List[Dict[str, Any]] = []
    for name, module in model.named_modules():
        if not isinstance(module, nn.QuantizedLinear) or module.bits != 4:
            continue
        if getattr(module, "mode", "affine") != "affine":
            continue
        layers.append({"name": name, "dtype": str(module.scales.dtype)})
        layers[-1].update(array_decode(module))
    total = sum(layer["bytes"] for layer in layers) or 1
    summary = {
        decode: {
            "arrays": sum(layer["decode"] == decode for layer in layers),
            "byte_share": round(
                sum(layer["bytes"] for layer in layers if layer["decode"] == decode)
                / total,
                4,
            ),
        }
        for decode in ("in_place", "denormal", "scaled")
    }
    return {"layers": layers, "summary": summary}


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.scale_limits")
    parser.add_argument("--model", required=True, help="an mlx-lm model folder")
    parser.add_argument("--json", help="write the per-layer table here")
    return parser.parse_args(argv)


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    from mlx_lm.utils import load_model

    try:
        model, _ = load_model(Path(args.model), lazy=True)
    except (OSError, ValueError, KeyError) as error:
        print(f"scale_limits: cannot load {args.model}: {error}", file=sys.stderr)
        return 1
    census = scale_census(model)
    if args.json:
        Path(args.json).write_text(json.dumps(census, indent=1))
    parts = ", ".join(
        f"{decode} {row['arrays']} ({100 * row['byte_share']:.1f} % of bytes)"
        for decode, row in census["summary"].items()
    )
    print(f"{len(census['layers'])} 4-bit arrays: {parts}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
