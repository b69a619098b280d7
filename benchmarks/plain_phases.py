"""Where one plain decoding token's host time goes, per verify-kernel arm.

Plain decoding (mlx-lm's ``generate_step`` loop, ours over dflash planes) overlaps the
host's work on token ``t + 1`` with the device's on token ``t``, so a token costs the
larger of the two. This splits each token's wall time on the host into:

* ``build``: the model's Python forward (the lazy graph, our wrappers, mlx's bindings);
* ``encode``: ``mx.async_eval`` of the step (mlx encodes every kernel there; on CUDA it
  adds the graph nodes and launches the CUDA graphs);
* ``rest``: everything else, mostly the wait for the previous token (``.item()``).

It also counts our custom-kernel launches per token (``launches``), so the difference of
an arm's ``build`` + ``encode`` from ``off``'s, divided by its extra launches, is the
host cost of one of our launches in the real loop (``host_us_per_extra_launch``).

``--stub-launches`` replaces each of our launches by lazy zeros and forces our kernel
path as CUDA takes it, so on any machine (the CPU too) ``build`` is our wrappers' Python
without mlx's binding of the launch; the tokens are then not the model's.

Run (from the repository root; with ``MLX_USE_CUDA_GRAPHS=0`` in another process to see
what mlx's CUDA graphs cost)::

    python -m benchmarks.plain_phases --scale full --quant 4bit --context 4096 \\
        --kernels off,attention,matmul,all --json docs/.../plain-phases.json
"""

from __future__ import annotations

import argparse
import importlib
import json
import statistics
import time
from collections import Counter
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any, Dict, Iterator, List, Optional, Sequence

import mlx.core as mx

from dflash.bench.report import environment
from dflash.bench.scale_target import QUANTS, build_target, random_prompt
from dflash.generation import generate_step
from dflash.metal import backend, groups

from .common import busy_us, cupti_trace, write_json
from .launch_cost import stubbed_launches
from .round_profile import KERNEL_ARMS, _kernel_arms, kernel_arm, wall_ms_per_token

PHASES = ("build", "encode", "rest")
MLX_LM_ARM = "mlx-lm"
# The module (``mlx_lm.generate`` as an attribute is the function of that name).
mlx_lm_generate = importlib.import_module("mlx_lm.generate")


def plain_step(arm: str):
    """The ``generate_step`` an arm runs: mlx-lm's for ``"mlx-lm"``, else ours."""
    return mlx_lm_generate.generate_step if arm == MLX_LM_ARM else generate_step


class PhaseClock:
    """Per-token host phases of one plain generation (seconds, appended per event)."""

    def __init__(self) -> None:
        self.build: List[float] = []
        self.encode: List[float] = []
        self.launches = 0
        self.launch_marks: List[int] = []


class _TimedMx:
    """``mlx.core`` as mlx-lm's generate module sees it, with ``async_eval`` timed."""

    def __init__(self, clock: PhaseClock) -> None:
        self._clock = clock

    def async_eval(self, *args: Any) -> None:
        start = time.perf_counter()
        mx.async_eval(*args)
        self._clock.encode.append(time.perf_counter() - start)

    def __getattr__(self, name: str) -> Any:
        return getattr(mx, name)


@contextmanager
def timed(model, clock: PhaseClock, stubbed: bool = False) -> Iterator[None]:
    """Time the model's forwards and mlx-lm's ``async_eval``; count our launches
    (with ``stubbed``, the stub launches that stand in for them)."""
    model_class = type(model)
    forward = model_class.__call__
    owner, attribute = (
        (groups, "launch_groups") if stubbed else (backend, "call_kernel")
    )
    launch = getattr(owner, attribute)

    def timed_forward(self, *args: Any, **kwargs: Any):
        start = time.perf_counter()
        out = forward(self, *args, **kwargs)
        clock.build.append(time.perf_counter() - start)
        clock.launch_marks.append(clock.launches)
        return out

    def counted_launch(*args: Any, **kwargs: Any):
        clock.launches += 1
        return launch(*args, **kwargs)

    model_class.__call__ = timed_forward
    setattr(owner, attribute, counted_launch)
    mlx_lm_generate.mx = _TimedMx(clock)
    try:
        yield
    finally:
        model_class.__call__ = forward
        setattr(owner, attribute, launch)
        mlx_lm_generate.mx = mx


def one_run(
    model, prompt: mx.array, arm: str, tokens: int, skip: int, stubbed: bool = False
) -> Dict[str, Any]:
    """Time ``tokens`` plain tokens of ``arm``; medians over the steady tokens.

    Args:
        model: The target.
        prompt: The prompt.
        arm: A ``--kernels`` arm of our plain decoding, or ``"mlx-lm"`` (mlx-lm's own
            ``generate_step`` and cache).
        tokens: Tokens generated.
        skip: Leading tokens left out (the prefill, the first launches).
        stubbed: Our launches are stubbed (:func:`benchmarks.launch_cost.stubbed_launches`).

    Returns:
        The arm's medians (ms) per token: wall, each phase, and launches per token.
    """
    clock = PhaseClock()
    step = plain_step(arm)
    stamps: List[float] = []
    with timed(model, clock, stubbed):
        for _ in step(prompt, model, max_tokens=tokens):
            stamps.append(time.perf_counter())
    # The prefill's forwards come first; the last forward of each token is its step.
    builds, encodes = clock.build[-tokens:], clock.encode[-tokens:]
    marks = clock.launch_marks[-tokens:]
    walls = [b - a for a, b in zip(stamps, stamps[1:])]
    keep = slice(skip, tokens - 1)
    ms = lambda values: round(1e3 * statistics.median(values[keep]), 3)  # noqa: E731
    build, encode, wall = ms(builds), ms(encodes), ms(walls)
    launches = [b - a for a, b in zip(marks, marks[1:])]
    steady = sorted(walls[keep])
    return {
        "arm": arm,
        "tokens": len(stamps),
        "wall_ms": wall,
        "build_ms": build,
        "encode_ms": encode,
        "rest_ms": round(wall - build - encode, 3),
        "launches": statistics.median(launches[skip:]) if launches[skip:] else 0,
        # A median hides slow tokens that come now and then; the mean does not.
        "wall_mean_ms": round(1e3 * statistics.mean(steady), 3),
        "wall_max_ms": round(1e3 * steady[-1], 3),
        "per_token_ms": {
            name: [round(1e3 * v, 3) for v in values[keep]]
            for name, values in (
                ("wall", walls),
                ("build", builds),
                ("encode", encodes),
            )
        },
    }


def per_launch(rows: Sequence[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """Each arm's host ms over ``off``'s, per extra launch (same pass)."""
    base = next((row for row in rows if row["arm"] == "off"), None)
    out = []
    for row in rows:
        extra = row["launches"] - (base["launches"] if base else 0)
        if base is None or row is base or extra <= 0:
            continue
        host = row["build_ms"] + row["encode_ms"] - base["build_ms"] - base["encode_ms"]
        build = row["build_ms"] - base["build_ms"]
        out.append(
            {
                "arm": row["arm"],
                "extra_launches": extra,
                "host_us_per_extra_launch": round(1e3 * host / extra, 2),
                "build_us_per_extra_launch": round(1e3 * build / extra, 2),
                "encode_us_per_extra_launch": round(1e3 * (host - build) / extra, 2),
            }
        )
    return out


def difference_ms(model, prompt: mx.array, arm: str, args: argparse.Namespace) -> float:
    """Wall ms per token as ``round_profile --plain-time`` measures it: two whole
    generations (``--tokens`` / 2 and ``--tokens``), their difference per extra token.
    """
    step = plain_step(arm)

    def tokens(max_tokens: int) -> int:
        return sum(1 for _ in step(prompt, model, max_tokens=max_tokens))

    return wall_ms_per_token(tokens, args.tokens // 2, args.tokens)


def device_tokens(model, prompt: mx.array, arm: str, tokens: int, skip: int) -> dict:
    """Each token's device span and busy time (CUPTI; CUDA with PyTorch).

    Kernels are split into tokens at a kernel that runs once a token (the sampler's
    argmax: the first kernel name whose count is the token count or one more, preferring one
    named like an arg-reduction). A token whose span is about its busy time had the
    device working all along: the device, not the host, set its pace.

    Returns:
        ``marker`` (the kernel used) and medians and per-token lists (ms) of ``span``
        and ``busy``; ``None`` values when no marker was found.
    """
    step = plain_step(arm)
    kernels, _ = cupti_trace(
        lambda: sum(1 for _ in step(prompt, model, max_tokens=tokens))
    )
    counts = Counter(name for name, _, _ in kernels)
    # The step after the last yielded token is computed too (mlx-lm's pipelining).
    candidates = [name for name, count in counts.items() if 0 <= count - tokens <= 1]
    candidates.sort(key=lambda name: "arg" not in name.lower())
    if not candidates:
        near = {n[:80]: c for n, c in counts.items() if abs(c - tokens) <= 3}
        return {"marker": None, "span_ms": None, "busy_ms": None, "near": near}
    marker = candidates[0]
    ends = [start + length for name, start, length in kernels if name == marker]
    span, busy = [], []
    for first, last in zip(ends[skip:], ends[skip + 1 :]):
        inside = [k for k in kernels if first <= k[1] < last]
        span.append(round((last - first) / 1e3, 3))
        busy.append(round(busy_us(inside) / 1e3, 3))
    return {
        "marker": marker[:80],
        "span_ms": statistics.median(span),
        "busy_ms": statistics.median(busy),
        "per_token_ms": {"span": span, "busy": busy},
    }


def stubs(args: argparse.Namespace) -> AbstractContextManager:
    """Stubbed launches with ``--stub-launches``, else nothing."""
    return stubbed_launches() if args.stub_launches else nullcontext()


def run(args: argparse.Namespace) -> Dict[str, Any]:
    """Every pass runs every arm once (arms alternate: the host drifts between runs)."""
    model = build_target(args.scale, args.quant, seed=0)
    prompt = random_prompt(model.args.vocab_size, args.context, 0)
    report: Dict[str, Any] = {
        "environment": environment("python -m benchmarks.plain_phases"),
        "scale": args.scale,
        "quant": args.quant,
        "context": args.context,
        "tokens": args.tokens,
        "stub_launches": args.stub_launches,
        "passes": [],
    }
    arms = [MLX_LM_ARM] + list(args.kernels)
    for index in range(args.passes):
        rows = []
        for arm in arms:
            with kernel_arm("off" if arm == MLX_LM_ARM else arm), stubs(args):
                rows.append(
                    one_run(
                        model, prompt, arm, args.tokens, args.skip, args.stub_launches
                    )
                )
                if args.difference:
                    rows[-1]["difference_ms"] = difference_ms(model, prompt, arm, args)
                if args.device_time:
                    rows[-1]["device"] = device_tokens(
                        model, prompt, arm, args.tokens, args.skip
                    )
            shown = {k: v for k, v in rows[-1].items() if k != "per_token_ms"}
            if "device" in shown:
                shown["device"] = {
                    k: v for k, v in shown["device"].items() if k != "per_token_ms"
                }
            print(json.dumps({"pass": index, **shown}), flush=True)
        report["passes"].append({"rows": rows, "per_launch": per_launch(rows)})
        for row in report["passes"][-1]["per_launch"]:
            print(json.dumps({"pass": index, **row}), flush=True)
    return report


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.plain_phases")
    parser.add_argument("--scale", choices=("full", "tiny"), default="tiny")
    parser.add_argument("--quant", choices=QUANTS, default="bf16")
    parser.add_argument("--context", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=32, help="tokens per run")
    parser.add_argument("--skip", type=int, default=4, help="leading tokens left out")
    parser.add_argument("--passes", type=int, default=2)
    parser.add_argument(
        "--kernels",
        type=_kernel_arms,
        default=["off", "all"],
        help="comma list of verify-kernel arms: " + ", ".join(KERNEL_ARMS),
    )
    parser.add_argument(
        "--device-time",
        action="store_true",
        help="each token's device span and busy time per arm (CUPTI; CUDA with torch)",
    )
    parser.add_argument(
        "--difference",
        action="store_true",
        help="also each arm's wall ms per token from two whole generations (as "
        "round_profile --plain-time)",
    )
    parser.add_argument(
        "--stub-launches",
        action="store_true",
        help="our launches as lazy zeros, our kernel path forced as on CUDA (any machine)",
    )
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    if args.tokens < args.skip + 3:
        parser.error(f"--tokens must be at least --skip + 3 ({args.skip + 3})")
    return args


def main(argv: Optional[Sequence[str]] = None) -> None:
    args = parse_args(argv)
    report = run(args)
    write_json(args.json, report)


if __name__ == "__main__":
    main()
