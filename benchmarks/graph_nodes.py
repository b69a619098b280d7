"""How many graph nodes a verify forward's layers build, by primitive, on any machine.

The round is the host's (session 60): mlx's encode, the replays' ``compile_replace``
and our Python each pay per array of the graph, views included, not only per
kernel. This counts them. A stack of Muse Glimmer layers (random weights, 4-bit)
holds ``--context`` rows in dflash planes; one 16-row verify forward runs inside a
checkpoint with our kernel route forced as on CUDA, each launch replaced by zeros of
its outputs that depend on its inputs (one ``Depends`` node for the launch:
:func:`benchmarks.launch_cost.stubbed_launches`), after warm-up forwards so the
traced layers replay. The graph of its output and of every plane's arrays is
exported (``mx.export_to_dot``) and its nodes counted, less the stand-ins' zeros.

Geometries: ``tiny`` (the tests' Glimmer), ``wide`` (head width 128, widths of
1,024 and 2,048: the tensor-core matmul forms of the full model, built in seconds on
a CPU) and ``full`` (the scale target's; slow to build on a CPU). Sliding layers get
``--window`` rows, so a small context already fills their rings (the verify block
is then held back, as at 4k in the full model).

Run (from the repository root)::

    python -m benchmarks.graph_nodes --geometry wide --layers 4 --json F
"""

from __future__ import annotations

import argparse
import re
import sys
import tempfile
from collections import Counter
from pathlib import Path
from typing import Dict, List, Optional, Sequence

import mlx.core as mx

from dflash.bench.report import environment
from dflash.cache.checkpoint import SpeculativeCheckpoint

from . import layer_stack
from .common import write_json
from .launch_cost import stubbed_launches

WIDE = dict(
    hidden_size=1024,
    intermediate_size=2048,
    num_attention_heads=8,
    num_key_value_heads=2,
    head_dim=128,
)
GEOMETRIES = ("tiny", "wide", "full")
# What a stand-in launch's zeros add per output (not part of the route's graph).
STAND_IN = ("Broadcast", "Full")


def build(geometry: str, layers: int, window: int):
    """The stack for ``geometry`` with sliding windows of ``window`` rows."""
    base = {**layer_stack.GEOMETRIES["full" if geometry == "wide" else geometry]}
    base.update(WIDE if geometry == "wide" else {})
    base["sliding_window"] = window
    name = f"_graph_nodes_{geometry}"
    layer_stack.GEOMETRIES[name] = base
    try:
        return layer_stack.build_layers(name, "4bit", layers)
    finally:
        del layer_stack.GEOMETRIES[name]


def plane_arrays(cache: list) -> List[mx.array]:
    """Every array the planes hold after a forward (their writes are graph nodes no
    hidden state depends on)."""
    arrays = []
    for plane in cache:
        if getattr(plane, "kv", None) is not None:
            arrays.append(plane.kv)
        pending = getattr(getattr(plane, "guard", None), "pending", None)
        if pending is not None:
            arrays.append(pending)
    return arrays


def count_nodes(arrays: Sequence[mx.array]) -> Counter:
    """The primitives of the graph that makes ``arrays``, by name."""
    with tempfile.TemporaryDirectory() as folder:
        dot = Path(folder) / "graph.dot"
        mx.export_to_dot(str(dot), *arrays)
        return Counter(re.findall(r'label ="([A-Za-z_0-9]+)"', dot.read_text()))


def verify_nodes(model, cache: list, rows: int, warmups: int = 3) -> Dict[str, object]:
    """The node counts of one verify forward after ``warmups`` (each rolled back).

    Every ``Full`` node (with the ``Broadcast`` of its scalar) is taken as a
    stand-in's zeros: the route itself fills nothing in a verify forward.
    """
    hidden = (mx.random.normal((1, rows, model.args.hidden_size)) * 0.5).astype(
        mx.bfloat16
    )
    mx.eval(hidden)
    with stubbed_launches(), layer_stack.arm_context(model, "ours", attention=True):
        for forward in range(warmups + 1):
            checkpoint = SpeculativeCheckpoint.begin(cache, rows)
            out = layer_stack.run_layers(model, hidden, cache)
            arrays = [out] + plane_arrays(cache)
            if forward == warmups:
                counts = count_nodes(arrays)
            mx.eval(arrays)
            checkpoint.rollback()
    layers = len(model.layers)
    stand_ins = counts["Full"]
    route = Counter({name: n for name, n in counts.items() if name not in STAND_IN})
    route["Broadcast"] = counts["Broadcast"] - stand_ins
    route = +route  # drop what is left at zero
    total = sum(route.values())
    return {
        "layers": layers,
        "nodes": total,
        "nodes_per_layer": round(total / layers, 2),
        "launches_per_layer": round(route["Depends"] / layers, 2),
        "by_primitive_per_layer": {
            name: round(count / layers, 2) for name, count in route.most_common()
        },
    }


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.graph_nodes")
    parser.add_argument("--geometry", choices=GEOMETRIES, default="wide")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--window", type=int, default=16)
    parser.add_argument(
        "--context", type=int, default=24, help="rows in the planes before the block"
    )
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    for name in ("layers", "window", "context", "rows"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be >= 1")
    return args


def main(argv: Optional[Sequence[str]] = None) -> dict:
    args = parse_args(argv)
    model = build(args.geometry, args.layers, args.window)
    cache = layer_stack.prefill(model, args.context)
    result = {
        "meta": environment("python -m benchmarks.graph_nodes " + " ".join(args.argv)),
        **verify_nodes(model, cache, args.rows),
    }
    print(
        f"{result['nodes_per_layer']} nodes a layer "
        f"({result['launches_per_layer']} launches): "
        + ", ".join(f"{k} {v}" for k, v in result["by_primitive_per_layer"].items()),
        flush=True,
    )
    write_json(args.json, result)
    return result


if __name__ == "__main__":
    main()
