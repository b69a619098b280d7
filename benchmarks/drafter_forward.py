"""Where the drafter's forward goes, per kernel arm: the draft, its parts, the context's k / v.

The issue's drafter goal is its forward at most 2x the bound of the bytes it reads. This
times, after a prefill of ``--context`` tokens on the scale pair, synced, medians of
``--reps`` calls (after ``--warmup``), each with the host's share beside it (the call and
``mx.async_eval`` returning: graph build and encode):

* ``draft``: the block's layers, the target's LM head and the argmax (what a round
  drafts);
* ``layers``, ``head``: those two alone;
* ``layer0``, ``attention0``, ``mlp0``: the first draft layer and its two halves over
  a block of random hidden states;
* ``context_kv``: a round's context projection: ``fc`` and ``hidden_norm`` over
  ``--tau`` + 1 tapped rows, then every layer's k / v of them (what
  ``append_context`` computes before it writes the planes).

With ``--device`` (a GPU, PyTorch in the interpreter for CUPTI) each arm also lists the
device kernels of one call of each part: how many, the time in which one ran (``busy``),
their summed time, the span from the first start to the last end (``span``: ``busy``
plus the device's idle gaps), and the costliest kernel names.

Each ``--kernels`` arm (:data:`benchmarks.round_profile.KERNEL_ARMS`) holds
:func:`dflash.kernel_patch.verify_kernels` and the norms' held scales
(:func:`dflash.held_norms.held_norms`, since session 63) around its calls, as the loop
does: ``off``,
``default``, and the drafter's opt-in parts ``default-drafterqkv`` (its q / k / v as one
stack), ``default-drafterheads`` (its q / k norms and RoPE as one launch),
``default-draftermlx`` (its bf16 projections on mlx's matmul, each sibling set one
matmul over its stack: the default since session 47), ``default-drafterkernel`` (on
our small-row kernel instead, the default before), ``default-draftertraced`` (its
layers as two compiled replays around the attention, with the head prep),
``default-drafter`` (the q / k / v stack and the head prep) and ``default-drafterall``
(all four). Arms alternate part by part, the order reversed every other repetition, so
a host's drift reaches every arm alike.

Run (from the repository root)::

    python -m benchmarks.drafter_forward --scale full --quant 4bit --context 4096 \\
        --kernels off,default,default-drafter --reps 20 --json docs/.../drafter.json
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from typing import Any, Callable, Dict, List, Optional, Sequence

import mlx.core as mx
from mlx_lm.generate import generation_stream

from dflash import kernel_patch
from dflash.bench.measure import _prefill_dflash
from dflash.bench.report import environment
from dflash.bench.scale import build_scale_pair, scale_prompts
from dflash.bench.scale_target import QUANTS
from dflash.held_norms import held_norms

from .common import busy_us, cupti_trace, write_json
from .round_profile import _kernel_arms, kernel_arm

PARTS = ("draft", "layers", "head", "layer0", "attention0", "mlp0", "context_kv")
# Kernel names listed per part with ``--device`` (the costliest by summed time).
TOP_KERNELS = 12


def drafter_parts(drafter, context, anchor: int, tau: int) -> Dict[str, Callable]:
    """The timed calls over a filled ``context`` (each returns what it computes).

    Shapes: the block is ``(1, B)``, ``[anchor, mask, ...]``; the hidden states and the
    tapped rows are random, ``(1, B, H)`` and ``(1, tau + 1, taps * H)``.
    """
    config = drafter.config
    block = mx.array([[anchor] + [config.mask_token_id] * (config.block_size - 1)])
    dtype = drafter.layers[0].self_attn.o_proj.weight.dtype
    hidden = mx.random.normal((1, config.block_size, config.hidden_size)).astype(dtype)
    taps = len(config.target_layer_ids) * config.hidden_size
    tapped = mx.random.normal((1, tau + 1, taps)).astype(dtype)
    layer, plane, start = drafter.layers[0], context.planes[0], context.offset
    mx.eval(hidden, tapped)

    def context_kv() -> List[mx.array]:
        stream = drafter.hidden_norm(drafter.fc(tapped))
        return [
            array
            for draft_layer in drafter.layers
            for array in draft_layer.self_attn.project_kv(stream, drafter._rope, start)
        ]

    return {
        "draft": lambda: mx.argmax(drafter(block, context)[0, 1:], axis=-1),
        "layers": lambda: drafter.hidden_states(block, context),
        "head": lambda: mx.argmax(drafter.logits(hidden), axis=-1),
        "layer0": lambda: layer(hidden, plane, drafter._rope, start),
        "attention0": lambda: layer.self_attn(hidden, plane, drafter._rope, start),
        "mlp0": lambda: layer.mlp(hidden),
        "context_kv": context_kv,
    }


def timed_call(call: Callable[[], Any]) -> tuple:
    """``(wall_ms, host_ms)`` of one synced call: the host's share ends when
    ``mx.async_eval`` returns."""
    mx.synchronize()
    start = time.perf_counter()
    out = call()
    mx.async_eval(out)
    enqueued = time.perf_counter()
    mx.eval(out)
    end = time.perf_counter()
    return 1e3 * (end - start), 1e3 * (enqueued - start)


def run(args: argparse.Namespace, command: str) -> Dict[str, Any]:
    """Prefill, then alternate the arms part by part; the report (times in ms)."""
    began = time.time()
    target, drafter = build_scale_pair(args.scale, args.quant, 0)
    prompt = scale_prompts(target, args.context, 1, 0)[0]
    samples = {arm: {part: [] for part in PARTS} for arm in args.kernels}
    patched = {}
    with mx.stream(generation_stream):
        _, context = _prefill_dflash(target, drafter, prompt[:-1])
        parts = drafter_parts(drafter, context, int(prompt[-1]), args.tau)
        for rep in range(args.warmup + args.reps):
            order = args.kernels if rep % 2 == 0 else args.kernels[::-1]
            for arm in order:
                with (
                    kernel_arm(arm),
                    kernel_patch.verify_kernels(target, drafter) as patch,
                    held_norms(target, drafter),
                ):
                    patched[arm] = _patch_summary(patch)
                    for part in PARTS:
                        times = timed_call(parts[part])
                        if rep >= args.warmup:
                            samples[arm][part].append(times)
        device = {}
        if args.device:
            for arm in args.kernels:
                with (
                    kernel_arm(arm),
                    kernel_patch.verify_kernels(target, drafter),
                    held_norms(target, drafter),
                ):
                    device[arm] = {part: device_kernels(parts[part]) for part in PARTS}
    report: Dict[str, Any] = {"environment": environment(command), "patch": patched}
    if device:
        report["device"] = device
    report["ms"] = {
        arm: {part: _medians(times) for part, times in by_part.items()}
        for arm, by_part in samples.items()
    }
    report["total_s"] = round(time.time() - began, 1)
    return report


def device_kernels(call: Callable[[], Any]) -> Dict[str, Any]:
    """The device kernels of one ``call`` (CUPTI): count, busy, summed and spanned
    microseconds, and the :data:`TOP_KERNELS` costliest names with their counts."""
    kernels = cupti_trace(lambda: mx.eval(call()))[0]
    by_name: Dict[str, List[float]] = {}
    for name, _, duration in kernels:
        by_name.setdefault(name[:120], []).append(duration)
    top = sorted(by_name.items(), key=lambda item: -sum(item[1]))[:TOP_KERNELS]
    span = 0.0
    if kernels:
        span = max(s + d for _, s, d in kernels) - min(s for _, s, _ in kernels)
    return {
        "kernels": len(kernels),
        "busy_us": round(busy_us(kernels), 1),
        "sum_us": round(sum(d for _, _, d in kernels), 1),
        "span_us": round(span, 1),
        "top": [[name, len(times), round(sum(times), 1)] for name, times in top],
    }


def _patch_summary(patch: Optional[kernel_patch.KernelPatch]) -> Dict[str, Any]:
    """What an arm's patch installed: none, or its parts and fused sets by kind."""
    if patch is None:
        return {"installed": False}
    return {
        "installed": True,
        "matmul": patch.matmul,
        "fused_sets": sum(not group.tails for group in patch._groups),
        "drafter_qkv_sets": sum(group.tails for group in patch._groups),
        "drafter_head_prep": patch.route.draft_head_prep,
        "drafter_dense_kernel": patch.drafter_dense,
        "drafter_mlx_sets": sum(group.form == "mlx" for group in patch._groups),
        "drafter_traced_layers": len(patch.traced_draft_modules()),
    }


def _medians(times: Sequence[tuple]) -> Dict[str, float]:
    walls = [wall for wall, _ in times]
    hosts = [host for _, host in times]
    return {
        "wall_ms": round(statistics.median(walls), 3),
        "host_ms": round(statistics.median(hosts), 3),
        "wall_min_ms": round(min(walls), 3),
    }


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.drafter_forward")
    parser.add_argument("--scale", choices=("full", "tiny"), default="tiny")
    parser.add_argument("--quant", choices=QUANTS, default="4bit")
    parser.add_argument("--context", type=int, default=64, help="prompt tokens")
    parser.add_argument("--tau", type=int, default=6, help="tokens a round commits")
    parser.add_argument("--kernels", type=_kernel_arms, default=["off", "default"])
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument(
        "--device", action="store_true", help="CUPTI kernels of each part, per arm"
    )
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    for name, least in (("context", 2), ("tau", 1), ("reps", 1), ("warmup", 0)):
        if getattr(args, name) < least:
            parser.error(f"--{name} must be at least {least}")
    if len(set(args.kernels)) != len(args.kernels):
        parser.error(f"an arm repeats in --kernels {','.join(args.kernels)}")
    return args


def main(argv: Optional[Sequence[str]] = None) -> None:
    args = parse_args(argv)
    given = sys.argv[1:] if argv is None else argv
    command = " ".join(["python -m benchmarks.drafter_forward", *given])
    report = run(args, command)
    write_json(args.json, report)
    for arm, by_part in report["ms"].items():
        walls = {part: times["wall_ms"] for part, times in by_part.items()}
        print(arm, patched_text(report["patch"][arm]), walls, flush=True)
    for arm, by_part in report.get("device", {}).items():
        counts = {
            p: (k["kernels"], k["busy_us"], k["span_us"]) for p, k in by_part.items()
        }
        print(arm, "device (kernels, busy us, span us)", counts, flush=True)


def patched_text(summary: Dict[str, Any]) -> str:
    """One line's word for an arm's patch."""
    if not summary["installed"]:
        return "(no patch)"
    heads = ", drafter head prep" if summary["drafter_head_prep"] else ""
    mlx = "" if summary["drafter_dense_kernel"] else ", drafter on mlx's matmul"
    traced = summary["drafter_traced_layers"]
    mlx += f", {traced} traced drafter layers" if traced else ""
    sets, stacks = summary["fused_sets"], summary["drafter_qkv_sets"]
    return f"(patch: {sets} sets, {stacks} drafter q/k/v stacks{heads}{mlx})"


if __name__ == "__main__":
    main()
