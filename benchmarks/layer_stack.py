"""What a 16-row decoder layer costs the device and the host, per kernel arm.

A stack of Muse Glimmer decoder layers (the scale target's geometry, random weights,
4-bit / 8-bit / bf16) runs 16-row forwards. With no ``--context`` there is no cache
(mlx's causal attention over the block), so every arm does the same work as a verify
forward's layers apart from the attention over the context. With ``--context N`` each
forward is a verify block over dflash planes holding ``N`` earlier rows (a sliding
layer's ring, a full layer's growing plane), inside a checkpoint rolled back after it,
and the ``ours`` arms route the attention too. Per layer it reports:

* ``build_us``: the Python that builds a forward's graph;
* ``encode_us``: the host's ``mx.async_eval`` of it (on CUDA: encoding every kernel);
* ``wall_us``: forwards pipelined through ``mx.async_eval`` with one sync at the end,
  so the slower of host and device sets it (on an H200 at 16 rows, the device);
* with ``--stub-launches`` (any machine): our kernel path forced as on CUDA, every launch
  replaced by lazy zeros, so ``build_us`` is the CUDA route's host Python (``encode_us`` and
  ``wall_us`` then time the stand-ins, not a GPU, and the arms' outputs are not compared:
  mlx's binding of a real launch is not in it either);
* with ``--trace`` (CUDA, needs PyTorch for CUPTI): each forward evaluated alone,
  the kernels per layer, the device's busy time and span per layer, and the kernels
  with the most device time.

Arms: ``mlx`` (mlx-lm's layers as they are) and ``ours`` (our matmul part through
:class:`dflash.kernel_patch.KernelPatch`, with ``--context`` the attention part too; held
norms), each also with every layer compiled as one ``mx.compile`` trace (``-compiled``;
without ``--context`` only). The compiled and eager outputs
of each family are compared bit for bit. ``DFLASH_*`` switches (the K-split rule, the
folded offset) apply as set in the environment.

Run (from the repository root)::

    python -m benchmarks.layer_stack --quant 4bit --arms mlx,ours --trace \\
        --json docs/benchmarks/.../layer-stack.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import time
from collections import defaultdict
from functools import partial
from typing import Callable, Dict, List, Optional, Sequence

import mlx.core as mx
from mlx_lm.models import muse_glimmer
from mlx_lm.models.base import create_attention_mask

from dflash.bench.report import environment
from dflash.bench.scale_target import (
    BRANCH_SCALE,
    GEOMETRIES,
    QUANT_FORMS,
    QUANTS,
    quantize_as,
    randomize,
)
from dflash.cache import make_prompt_cache
from dflash.cache.checkpoint import SpeculativeCheckpoint
from dflash.held_norms import held_norms
from dflash.kernel_patch import KernelPatch

from .common import write_json
from .launch_cost import stubbed_launches

# ``ours-unprepared``: ours with Glimmer's q/k norms, scale and RoPE as mlx's five ops;
# ``ours-residual``: ours with the post-norms, residual adds and pre-norm fused (opt-in);
# ``ours-ungated``: ours with Glimmer's output gate as mlx's two ops after the attention;
# ``ours-blocked``: ours with each MLP block one compiled trace (opt-in compile_blocks);
# ``ours-unstacked``: ours with the plane stacking k and v (head prep writes them apart);
# ``ours-swiglu``: ours with the MLP's silu and product in the gate / up launch (opt-in);
# ``ours-traced`` / ``ours-untraced``: ours with each served layer call two compiled
# replays (the default) / the eager layers.
ARMS = (
    "mlx",
    "mlx-compiled",
    "ours",
    "ours-compiled",
    "ours-unprepared",
    "ours-residual",
    "ours-ungated",
    "ours-blocked",
    "ours-unstacked",
    "ours-swiglu",
    "ours-traced",
    "ours-untraced",
)
Forward = Callable[[mx.array], mx.array]


def build_layers(geometry: str, quant: str, layers: int, seed: int = 0):
    """A Muse Glimmer model of ``layers`` decoder layers (small vocabulary), quantized
    as the scale target is."""
    args = muse_glimmer.ModelArgs(
        **{**GEOMETRIES[geometry], "num_hidden_layers": layers, "vocab_size": 512}
    )
    model = muse_glimmer.Model(args)
    randomize(model, seed, mx.bfloat16, branch_scale=BRANCH_SCALE)
    if quant in QUANT_FORMS:
        quantize_as(model, quant)
    mx.eval(model.parameters())
    model.eval()
    return model


def prefill(model, context: int, chunk: int = 512) -> list:
    """dflash planes for ``model``'s layers holding ``context`` rows of random hidden
    states (written chunk by chunk, as a prompt's prefill is)."""
    cache = make_prompt_cache(model)
    key = mx.random.key(2)
    for start in range(0, context, chunk):
        rows = min(chunk, context - start)
        key, draw = mx.random.split(key)
        hidden = mx.random.normal((1, rows, model.args.hidden_size), key=draw)
        run_layers(model, (hidden * 0.5).astype(mx.bfloat16), cache)
        mx.eval([plane.kv for plane in cache])
    return cache


def run_layers(model, h: mx.array, cache: list) -> mx.array:
    """The layers over ``h`` with ``cache``, each with the mask mlx-lm's model makes."""
    for layer, plane in zip(model.layers, cache):
        sliding = layer.self_attn.layer_type == "sliding_attention"
        window = model.args.sliding_window if sliding else None
        h = layer(h, create_attention_mask(h, plane, window_size=window), plane)
    return h


def verify_forward_of(model, cache: list) -> Forward:
    """A verify block's forward over ``cache``: written inside a checkpoint, rolled back
    after (lazily, as a round that keeps no draft does)."""

    def forward(h: mx.array) -> mx.array:
        checkpoint = SpeculativeCheckpoint.begin(cache, h.shape[1])
        try:
            return run_layers(model, h, cache)
        finally:
            checkpoint.rollback()

    return forward


def forward_of(model, compiled: bool) -> Forward:
    """The layers' 16-row forward, eager or with each layer one compiled trace."""
    steps = [
        partial(layer.__call__, mask="causal", cache=None) for layer in model.layers
    ]
    if compiled:
        steps = [mx.compile(step) for step in steps]

    def forward(h: mx.array) -> mx.array:
        for step in steps:
            h = step(h)
        return h

    return forward


def time_forward(
    forward: Forward, inputs: List[mx.array], layers: int, forwards: int, passes: int
) -> Dict[str, float]:
    """Median per-layer ``build_us``, ``encode_us`` and ``wall_us`` over ``passes`` passes.

    ``encode_us`` is the host's ``mx.async_eval`` of a built forward (on CUDA it encodes
    and launches every kernel); ``build_us + encode_us`` above ``wall_us``'s device share
    means the host paces the layers.
    """
    # Two calls first: a traced layer's first call of a geometry runs eagerly (counting
    # its counters) and its second traces, so no timed pass pays for a trace.
    for _ in range(2):
        mx.eval(forward(inputs[0]))
    per_layer = 1e6 / forwards / layers
    builds, encodes, walls = [], [], []
    for _ in range(passes):
        build = encode = 0.0
        start = time.perf_counter()
        for index in range(forwards):
            begin = time.perf_counter()
            out = forward(inputs[index % len(inputs)])
            built = time.perf_counter()
            mx.async_eval(out)
            build += built - begin
            encode += time.perf_counter() - built
        mx.eval(out)
        walls.append((time.perf_counter() - start) * per_layer)
        builds.append(build * per_layer)
        encodes.append(encode * per_layer)
    return {
        "build_us": round(statistics.median(builds), 1),
        "encode_us": round(statistics.median(encodes), 1),
        "wall_us": round(statistics.median(walls), 1),
        "wall_min_us": round(min(walls), 1),
    }


def trace_forward(
    forward: Forward, inputs: List[mx.array], layers: int, top: int = 15
) -> dict:
    """CUPTI kernels of three forwards, each evaluated alone (none overlap), per layer."""
    from .common import busy_us, cupti_kernel_events

    def run() -> None:
        for index in range(3):
            mx.eval(forward(inputs[index % len(inputs)]))

    run()
    kernels = cupti_kernel_events(run)
    per_layer = 3 * layers
    totals: Dict[str, List[float]] = defaultdict(lambda: [0.0, 0])
    for name, _, duration in kernels:
        totals[name[:100]][0] += duration / per_layer
        totals[name[:100]][1] += 1
    span = kernels[-1][1] + kernels[-1][2] - kernels[0][1] if kernels else 0.0
    ranked = sorted(totals.items(), key=lambda item: -item[1][0])[:top]
    return {
        "sequence": kernel_sequence(kernels, 3),
        "kernels_per_layer": round(len(kernels) / per_layer, 2),
        "busy_us_per_layer": round(busy_us(kernels) / per_layer, 1),
        "span_us_per_layer": round(span / per_layer, 1),
        "top": [
            {"name": name, "us_per_layer": round(us, 1), "calls": calls}
            for name, (us, calls) in ranked
        ],
    }


def kernel_sequence(kernels: Sequence[tuple], forwards: int) -> List[str]:
    """The middle forward's kernels in launch order, each name without its template
    arguments or parameter list (where a copy or a norm sits between two launches)."""
    ordered = sorted(kernels, key=lambda kernel: kernel[1])
    per_forward = len(ordered) // forwards if forwards else 0
    middle = ordered[per_forward * (forwards // 2) : per_forward * (forwards // 2 + 1)]
    return [short_kernel_name(name) for name, _, _ in middle]


def short_kernel_name(name: str) -> str:
    """``name`` without its return type, template arguments and parameters, keeping the
    template's arity (``copy_g_nd<..3..>`` tells a 3-D copy from a 2-D one)."""
    head = name.split("(", 1)[0]
    base, _, template = head.partition("<")
    base = base.split(" ")[-1].split("::")[-1]
    dims = [part.strip() for part in template.rstrip(">").split(",") if part.strip()]
    numbers = [part for part in dims if part.isdigit()]
    return base + (f"<{','.join(numbers)}>" if numbers else "")


@contextlib.contextmanager
def arm_context(model, arm: str, attention: bool = False):
    """Our matmul part (``attention``: and the attention part) and held norms for the
    ``ours`` arms; nothing for ``mlx``."""
    if not arm.startswith("ours"):
        yield
        return
    with (
        held_norms(model, None, True),
        KernelPatch(
            model,
            attention=attention,
            matmul=True,
            head_prep=False if arm.endswith("-unprepared") else None,
            residual_norms=True if arm.endswith("-residual") else None,
            gate_epilogue=False if arm.endswith("-ungated") else None,
            compile_blocks=True if arm.endswith("-blocked") else None,
            kv_block=False if arm.endswith("-unstacked") else None,
            swiglu=True if arm.endswith("-swiglu") else None,
            traced_layers=(
                True
                if arm.endswith("-traced")
                else False if arm.endswith("-untraced") else None
            ),
        ),
    ):
        yield


def run_arm(args, model, cache, inputs, arm: str, rep: int, result, outputs) -> dict:
    """One arm's timings (its first output kept in ``outputs``, its CUPTI trace in
    ``result`` on the first rep)."""
    with arm_context(model, arm, attention=cache is not None):
        if cache is None:
            forward = forward_of(model, arm.endswith("-compiled"))
        else:
            forward = verify_forward_of(model, cache)
        timed = time_forward(forward, inputs, args.layers, args.forwards, args.passes)
        if arm not in outputs:
            outputs[arm] = forward(inputs[0])
            mx.eval(outputs[arm])
        if args.trace and rep == 0:
            result["traces"][arm] = trace_forward(forward, inputs, args.layers)
    return timed


def run(args: argparse.Namespace) -> dict:
    """Every arm, ``--reps`` times in turn; the result as printed rows."""
    model = build_layers(args.geometry, args.quant, args.layers)
    cache = prefill(model, args.context) if args.context else None
    hidden = model.args.hidden_size
    keys = mx.random.split(mx.random.key(1), 4)
    inputs = [
        (mx.random.normal((1, args.rows, hidden), key=key) * 0.5).astype(mx.bfloat16)
        for key in keys
    ]
    mx.eval(inputs)
    result = {
        "meta": environment("python -m benchmarks.layer_stack " + " ".join(args.argv)),
        "runs": [],
        "traces": {},
        "bitwise": {},
    }
    outputs: Dict[str, mx.array] = {}
    with stubbed_launches() if args.stub_launches else contextlib.nullcontext():
        for rep in range(args.reps):
            for arm in args.arms:
                row = {"rep": rep, "arm": arm}
                row.update(
                    run_arm(args, model, cache, inputs, arm, rep, result, outputs)
                )
                result["runs"].append(row)
                print(json.dumps(row), flush=True)
    # Stand-in launches return zeros, so arms launching different kernels would differ.
    for arm, out in outputs.items() if not args.stub_launches else ():
        family = arm.split("-")[0]
        if family in outputs and arm != family:
            same = bool(mx.array_equal(out, outputs[family]).item())
            result["bitwise"][f"{arm} == {family}"] = same
    print(json.dumps({"bitwise": result["bitwise"]}), flush=True)
    for arm, trace in result["traces"].items():
        print(json.dumps({"trace": arm, **trace}), flush=True)
    return result


def _arms(text: str) -> List[str]:
    arms = [arm for arm in text.split(",") if arm]
    unknown = [arm for arm in arms if arm not in ARMS]
    if unknown or not arms:
        raise argparse.ArgumentTypeError(
            f"unknown arm(s) {', '.join(unknown) or '(none)'}; choose from {', '.join(ARMS)}"
        )
    return arms


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.layer_stack")
    parser.add_argument("--geometry", choices=sorted(GEOMETRIES), default="full")
    parser.add_argument("--quant", choices=QUANTS, default="4bit")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument(
        "--context", type=int, default=0, help="earlier rows in dflash planes (0: none)"
    )
    parser.add_argument("--forwards", type=int, default=40, help="forwards per pass")
    parser.add_argument("--passes", type=int, default=3)
    parser.add_argument("--reps", type=int, default=1, help="rounds of every arm")
    parser.add_argument("--arms", type=_arms, default=list(ARMS))
    parser.add_argument("--trace", action="store_true", help="CUPTI (CUDA, PyTorch)")
    parser.add_argument(
        "--stub-launches",
        action="store_true",
        help="our kernel path as on CUDA with every launch replaced by lazy zeros: "
        "build_us is then the CUDA route's host Python on any machine",
    )
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    for name in ("layers", "rows", "forwards", "passes", "reps"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be >= 1")
    if args.context < 0:
        parser.error("--context must be >= 0")
    if args.context and any(arm.endswith("-compiled") for arm in args.arms):
        parser.error("--context takes the eager arms only (mlx, ours): a cache write")
    if args.trace and args.stub_launches:
        parser.error("--trace times real launches; --stub-launches replaces them")
    if args.trace and not mx.cuda.is_available():
        parser.error("--trace needs mlx's CUDA backend (CUPTI through PyTorch)")
    return args


def main(argv: Optional[Sequence[str]] = None) -> dict:
    args = parse_args(argv)
    result = run(args)
    write_json(args.json, result)
    return result


if __name__ == "__main__":
    main()
