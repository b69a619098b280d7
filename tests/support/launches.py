"""Launch counting on a lazy mlx graph."""

from __future__ import annotations

import io
import re
from collections import Counter

import mlx.core as mx

# Primitives that only reinterpret an existing buffer (no kernel launch).
VIEW_PRIMITIVES = frozenset(
    {
        "AsStrided",
        "Broadcast",
        "BroadcastAxes",
        "Depends",
        "ExpandDims",
        "Flatten",
        "Reshape",
        "Slice",
        "Split",
        "Squeeze",
        "StopGradient",
        "Transpose",
        "Unflatten",
        "View",
    }
)


def graph_launches(*arrays: mx.array) -> Counter:
    """Count the unevaluated graph nodes behind ``arrays`` that launch work.

    Args:
        arrays: Lazy outputs (evaluated inputs are leaves and not counted).

    Returns:
        Primitive name -> node count, view primitives excluded.
    """
    sink = io.StringIO()
    mx.export_to_dot(sink, *arrays)
    names = re.findall(r'label ="([A-Za-z0-9_]+)"', sink.getvalue())
    return Counter(n for n in names if n not in VIEW_PRIMITIVES)
