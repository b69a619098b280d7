"""Session 27 diagnostic: do eager verify runs repeat their own bits, and do traced runs give them, with the
scaled-weight matmul form on and off? (tests/test_traced_layers.py's cuda cases failed with it on.)"""
import os
import sys

sys.path.insert(0, "tests")
import mlx.core as mx  # noqa: E402

from benchmarks import layer_stack  # noqa: E402
from test_traced_layers import verify_run, wide_heads_stack  # noqa: E402


def compare(tag, got, want):
    diffs = [mx.abs(g.astype(mx.float32) - w.astype(mx.float32)).max().item() for g, w in zip(got, want)]
    same = [bool(mx.array_equal(g, w).item()) for g, w in zip(got, want)]
    print(tag, "same per block", same, "max diff", [round(d, 6) for d in diffs], flush=True)


for scaled in sys.argv[1].split(","):
    os.environ["DFLASH_QMM_SCALED_B"] = scaled
    for name, model, accepted, context in (
        ("wide", wide_heads_stack(4), [16, 3, 9, 1, 16], 100),
        ("glimmer", layer_stack.build_layers("full", "4bit", 2), [16, 3, 16, 7, 1], 2100),
    ):
        eager, _ = verify_run(model, False, accepted, context=context)
        eager2, _ = verify_run(model, False, accepted, context=context)
        traced, _ = verify_run(model, True, accepted, context=context)
        traced2, _ = verify_run(model, True, accepted, context=context)
        compare(f"scaled={scaled} {name} eager vs eager", eager2, eager)
        compare(f"scaled={scaled} {name} traced vs traced", traced2, traced)
        compare(f"scaled={scaled} {name} traced vs eager", traced, eager)
