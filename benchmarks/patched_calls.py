"""Host cost of one patched layer call with the launches stubbed: our Python alone.

Times a tiny 4-bit Muse Glimmer's ``o_proj`` (one row) and MLP forward, mlx's own and
patched by the matmul part (:class:`dflash.kernel_patch.KernelPatch`), uncompiled,
replayed through ``mx.compile`` (``DFLASH_COMPILE``) and compiled as whole MLP blocks
(``DFLASH_COMPILED_BLOCKS``; only the MLP row differs there), with every custom-kernel
launch replaced by lazy zeros as CUDA would take it
(:func:`benchmarks.launch_cost.stubbed_launches`; so mlx's binding of a real launch,
which compiled replay also skips, is in neither). Runs on any machine, the CPU too; the
fastest of ``--repeat`` batches of ``--calls`` calls, µs per call.

Run from the repository root::

    python -m benchmarks.patched_calls --json patched.json
"""

from __future__ import annotations

import argparse
import json
import timeit
from typing import Callable, Optional, Sequence

import mlx.core as mx

from dflash.bench.scale_target import build_target
from dflash.kernel_patch import COMPILED_BLOCKS_ENV, KernelPatch
from dflash.metal.backend import COMPILE_ENV

from .common import write_json
from .launch_cost import stubbed_launches
from .round_profile import env_value


def fastest_us(call: Callable[[], object], calls: int, repeat: int) -> float:
    """µs per call: the fastest of ``repeat`` batches of ``calls`` calls."""
    return min(timeit.repeat(call, number=calls, repeat=repeat)) / calls * 1e6


def measure(calls: int, repeat: int) -> dict:
    """mlx's and the patched ``o_proj`` and MLP calls, µs each."""
    model = build_target("tiny", "4bit", seed=0)
    layer = model.layers[0]
    o_proj, mlp = layer.self_attn.o_proj, layer.mlp
    x_o = mx.zeros((1, 1, o_proj.weight.shape[1] * 32 // o_proj.bits), mx.bfloat16)
    x_mlp = mx.zeros((1, 1, model.args.hidden_size), mx.bfloat16)
    mx.eval(x_o, x_mlp)
    rows = {
        "mlx o_proj": fastest_us(lambda: o_proj(x_o), calls, repeat),
        "mlx mlp": fastest_us(lambda: mlp(x_mlp), calls, repeat),
    }
    arms = (("0", "0", ""), ("1", "0", " compiled"), ("1", "1", " compiled block"))
    for compiled, blocks, suffix in arms:
        with (
            env_value(COMPILE_ENV, compiled),
            env_value(COMPILED_BLOCKS_ENV, blocks),
            stubbed_launches(),
            KernelPatch(model, attention=False, matmul=True),
        ):
            rows["ours o_proj" + suffix] = fastest_us(
                lambda: o_proj(x_o), calls, repeat
            )
            rows["ours mlp" + suffix] = fastest_us(lambda: mlp(x_mlp), calls, repeat)
    return {name: round(us, 2) for name, us in rows.items()}


def main(argv: Optional[Sequence[str]] = None) -> dict:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.patched_calls")
    parser.add_argument("--calls", type=int, default=5000, help="calls per batch")
    parser.add_argument("--repeat", type=int, default=7, help="batches")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    if args.calls < 1 or args.repeat < 1:
        parser.error("--calls and --repeat must be >= 1")
    rows = measure(args.calls, args.repeat)
    print(json.dumps(rows))
    write_json(args.json, rows)
    return rows


if __name__ == "__main__":
    main()
