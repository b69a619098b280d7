"""What a Glimmer layer's norm-and-residual groups cost the device: mlx's ops against
one :func:`dflash.metal.norms.residual_norm` launch each.

A Muse Glimmer decoder layer runs, after the attention's output projection, ``rms_norm``,
``add`` and ``rms_norm`` (group ``post``: the post-attention norm, the residual, the
pre-feedforward norm), and after the MLP ``rms_norm`` and ``add`` (group ``last``).
For each row count this times, with CUPTI (through PyTorch), every kernel of each group
in both forms, ``--reps`` independent calls of each in one evaluation, and reports the
median device time a kernel and their sum a group. It also runs ``--chain`` layers' worth
of groups as one dependent chain (each group reads the last one's sum), as a forward
does, and reports the chain's busy time and span (first kernel's start to last one's
end) a layer; and the chain with the hand-off, where the last group also norms the
sum for the next layer's input (``post``'s ops: mlx's ``rms_norm``, ``add``,
``rms_norm``, or one launch) and the next layer reads that. Every kernel output is
compared with mlx's ops bit for bit.

Needs mlx's CUDA backend and PyTorch with CUDA. Run (from the repository root)::

    python -m benchmarks.norm_cost --rows 1,16 --json docs/benchmarks/.../norm-cost.json
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections import defaultdict
from typing import Callable, Dict, Tuple

import mlx.core as mx

from dflash.bench.report import environment
from dflash.metal import norms

from .common import busy_us, cupti_kernel_events, write_json

EPS = 1e-6
FORMS = ("mlx", "kernel")


def _inputs(rows: int, dim: int, dtype: mx.Dtype, seed: int) -> Tuple[mx.array, ...]:
    """A branch, a residual and two norm weights (centered: ``1 + w``)."""
    keys = mx.random.split(mx.random.key(seed), 4)
    branch = (3.0 * mx.random.normal((1, rows, dim), key=keys[0])).astype(dtype)
    residual = (2.0 * mx.random.normal((1, rows, dim), key=keys[1])).astype(dtype)
    weight = (1.0 + 0.3 * mx.random.normal((dim,), key=keys[2])).astype(dtype)
    following = (1.0 + 0.3 * mx.random.normal((dim,), key=keys[3])).astype(dtype)
    mx.eval(branch, residual, weight, following)
    return branch, residual, weight, following


def group_call(form: str, group: str) -> Callable[..., Tuple[mx.array, ...]]:
    """One group (``post``: norm, add, norm; ``last``: norm, add) in one form."""
    use_kernel = form == "kernel"

    def call(branch, residual, weight, following):
        if group == "post":
            h, normed = norms.residual_norm(
                branch, residual, weight, EPS,
                next_weight=following, next_eps=EPS, use_kernel=use_kernel,
            )  # fmt: skip
            return h, normed
        h, _ = norms.residual_norm(branch, residual, weight, EPS, use_kernel=use_kernel)
        return (h,)

    return call


def per_kernel(form: str, group: str, arrays, reps: int) -> Dict[str, float]:
    """Device µs a call of each kernel name: the median of ``reps`` independent calls'
    launches of it, times the launches a call makes of it (mlx's ``post`` group runs
    ``rms_norm`` twice)."""
    call = group_call(form, group)
    mx.eval(call(*arrays))  # compile and warm up outside the capture
    kernels = cupti_kernel_events(
        lambda: mx.eval([out for _ in range(reps) for out in call(*arrays)])
    )
    durations = defaultdict(list)
    for name, _, duration in kernels:
        durations[name].append(duration)
    return {
        name: statistics.median(values) * len(values) / reps
        for name, values in durations.items()
    }


def chain(form: str, arrays, layers: int, handoff: bool = False) -> Dict[str, float]:
    """Busy time and span a layer of ``layers`` layers' groups run as one chain (with
    ``handoff``, the last group also norms its sum for the next layer, whose ``post``
    group then reads that)."""
    branch, residual, weight, following = arrays
    post, last = group_call(form, "post"), group_call(form, "last")

    def run():
        h, handed = residual, branch
        for _ in range(layers):
            h, normed = post(handed if handoff else branch, h, weight, following)
            if handoff:
                h, handed = post(normed, h, weight, following)
            else:
                (h,) = last(normed, h, weight, following)
        mx.eval(h)

    run()
    kernels = cupti_kernel_events(run)
    first = min(start for _, start, _ in kernels)
    last_end = max(start + duration for _, start, duration in kernels)
    return {
        "kernels": len(kernels) / layers,
        "busy_us": busy_us(kernels) / layers,
        "span_us": (last_end - first) / layers,
    }


def same_bits(arrays) -> bool:
    """Both groups' kernel outputs equal mlx's ops' bit for bit."""
    for group in ("post", "last"):
        want = group_call("mlx", group)(*arrays)
        got = group_call("kernel", group)(*arrays)
        if not all(mx.array_equal(a, b).item() for a, b in zip(want, got)):
            return False
    return True


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.norm_cost")
    parser.add_argument("--rows", default="1,16")
    parser.add_argument("--dim", type=int, default=6656)
    parser.add_argument("--reps", type=int, default=64)
    parser.add_argument("--layers", type=int, default=52)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    try:
        rows_list = [int(r) for r in args.rows.split(",")]
    except ValueError:
        rows_list = []
    if not rows_list or min(rows_list) < 1 or args.reps < 1 or args.layers < 1:
        print(
            f"norm_cost: --rows takes positive integers (got {args.rows!r}), --reps "
            "and --layers positive counts",
            file=sys.stderr,
        )
        return 2
    if not norms.kernel_serves(args.dim, mx.bfloat16):
        print(
            f"norm_cost: the kernel does not take rows of {args.dim}", file=sys.stderr
        )
        return 2
    if not mx.cuda.is_available():
        print("norm_cost: needs mlx's CUDA backend", file=sys.stderr)
        return 2
    results = []
    for rows in rows_list:
        arrays = _inputs(rows, args.dim, mx.bfloat16, rows)
        row = {"rows": rows, "dim": args.dim, "same_bits": same_bits(arrays)}
        for form in FORMS:
            for group in ("post", "last"):
                kernels = per_kernel(form, group, arrays, args.reps)
                row[f"{form}_{group}_kernels"] = kernels
                row[f"{form}_{group}_us"] = sum(kernels.values())
            row[f"{form}_chain"] = chain(form, arrays, args.layers)
            row[f"{form}_chain_handoff"] = chain(form, arrays, args.layers, True)
        results.append(row)
        print(
            f"rows {rows}: same bits {row['same_bits']}; a layer's groups, device µs "
            f"(sum of kernel medians): mlx {row['mlx_post_us'] + row['mlx_last_us']:.2f}"
            f" kernel {row['kernel_post_us'] + row['kernel_last_us']:.2f}; chain busy / "
            f"span a layer: mlx {row['mlx_chain']['busy_us']:.2f} / "
            f"{row['mlx_chain']['span_us']:.2f}, kernel "
            f"{row['kernel_chain']['busy_us']:.2f} / {row['kernel_chain']['span_us']:.2f}"
        )
        print(
            "  with the hand-off, chain busy / span a layer: "
            + ", ".join(
                f"{form} {row[f'{form}_chain_handoff']['busy_us']:.2f} / "
                f"{row[f'{form}_chain_handoff']['span_us']:.2f}"
                for form in FORMS
            )
        )
        for form in FORMS:
            for group in ("post", "last"):
                for name, us in row[f"{form}_{group}_kernels"].items():
                    print(f"  {form:6s} {group:4s} {us:7.2f}  {name[:90]}")
    command = " ".join(["python -m benchmarks.norm_cost"] + sys.argv[1:])
    write_json(args.json, {"environment": environment(command), "results": results})
    return 0


if __name__ == "__main__":
    sys.exit(main())
