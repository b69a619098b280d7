"""Per-round KV-cache overhead of a DFlash round: kernels vs reference ops.

Geometry (defaults): Muse Glimmer's cache, 39 ring planes of 2,048 rows plus 13
growing planes, 2 KV heads x 128, bfloat16, B=1; K and V are separate planes,
so a round touches 78 ring buffers and 26 growing buffers. At each context
(default 4k and 32k) the rings are full and rotated as sequential appends
leave them, the growing planes hold ``context`` rows.

One round, for every accepted count ``a`` in ``0..block``:

1. **retain**: gather the ``block`` rows the verify block will overwrite from
   all 78 ring buffers (:func:`retain_rows`);
2. **store**: write the block into every plane (:func:`ring_store`; ring
   planes at their origin, across the seam; growing planes at their end);
3. **commit(a)**: put the ``block - a`` rejected rows back in every ring
   buffer (:func:`restore_rows`); growing planes rewind by metadata only.

Each phase ends in ``mx.eval`` (a real round evaluates the verify forward
before it can accept), then ``mx.synchronize``. Modes: ``reference`` (pure-MLX
ops everywhere), ``kernels`` (every op in its custom-kernel form),
``auto`` (the wrappers' defaults). Reported per mode, context and ``a``:
median / p10 / p90 wall time of the round and of each phase, kernel launches
(graph nodes that launch work, views excluded), bytes the round allocates
(peak minus resident before the round: ~0 for an in-place scatter, one plane
per fresh output), and modelled bytes read + written. The staging shadow
(78 ``stage_shadow`` calls, what staged attention reads) is timed apart.

``python -m dflash.metal.bench --json OUT`` on the GPU; for a CPU smoke run
shrink it, e.g. ``--contexts 96 --window 64 --sliding 2 --full 1 --dim 16
--block 4 --reps 2 --warmup 1``.
"""

from __future__ import annotations

import argparse
import io
import json
import platform
import re
import statistics
import sys
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Callable, Optional, Sequence

import mlx.core as mx
import numpy as np

from .backend import kernel_backend, use_kernel_path
from .checkpoint import restore_rows, retain_rows
from .ring import ring_store, stage_shadow, wrapped_rows

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

MODES: dict[str, Optional[bool]] = {"reference": False, "kernels": True, "auto": None}


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


@dataclass(frozen=True)
class Geometry:
    """Cache geometry of the benchmark.

    Attributes:
        sliding: Sliding (ring) layers; K and V each are one plane.
        full: Full-attention (growing) layers.
        window: Ring capacity ``C``.
        heads: KV heads.
        dim: Head dim.
        dtype: Element dtype name.
        block: Verify block rows.
    """

    sliding: int = 39
    full: int = 13
    window: int = 2048
    heads: int = 2
    dim: int = 128
    dtype: str = "bfloat16"
    block: int = 16

    @property
    def mx_dtype(self) -> mx.Dtype:
        """The mlx dtype."""
        return getattr(mx, self.dtype)

    @property
    def plane_row_bytes(self) -> int:
        """Bytes of one row of one K or V plane (B = 1)."""
        return self.heads * self.dim * self.mx_dtype.size


@dataclass
class CacheState:
    """Buffers and bookkeeping of the simulated cache at one context."""

    rings: list[mx.array]
    growing: list[mx.array]
    ring_origin: int
    growing_len: int


def make_state(geom: Geometry, context: int) -> CacheState:
    """Full rings rotated as ``context`` sequential appends leave them."""

    def plane(rows: int) -> mx.array:
        return mx.random.normal((1, geom.heads, rows, geom.dim)).astype(geom.mx_dtype)

    rings = [plane(geom.window) for _ in range(2 * geom.sliding)]
    growing = [plane(context + geom.block) for _ in range(2 * geom.full)]
    mx.eval(rings, growing)
    return CacheState(rings, growing, context % geom.window, context)


@dataclass
class Samples:
    """Wall times (ms) of repeated rounds."""

    total: list[float] = field(default_factory=list)
    retain: list[float] = field(default_factory=list)
    store: list[float] = field(default_factory=list)
    commit: list[float] = field(default_factory=list)
    allocated: list[int] = field(default_factory=list)


def _timed(step: Callable[[], list[mx.array]]) -> tuple[list[mx.array], float]:
    start = time.perf_counter()
    outputs = step()
    mx.eval(outputs)
    mx.synchronize()
    return outputs, (time.perf_counter() - start) * 1e3


def _dests(geom: Geometry, state: CacheState) -> mx.array:
    row = wrapped_rows(state.ring_origin, geom.block, geom.window)
    return mx.array(np.tile(row, (2 * geom.sliding, 1)))


def _block_slice(retained: mx.array, accepted: int) -> mx.array:
    return retained[:, :, :, accepted:, :]


def _phase_retain(
    state: CacheState, dests: mx.array, flag: Optional[bool]
) -> list[mx.array]:
    return [retain_rows(state.rings, dests, use_kernel=flag)]


def _phase_store(
    state: CacheState, rows: mx.array, flag: Optional[bool]
) -> list[mx.array]:
    state.rings = [
        ring_store(p, rows, state.ring_origin, use_kernel=flag) for p in state.rings
    ]
    state.growing = [
        ring_store(p, rows, state.growing_len, use_kernel=flag) for p in state.growing
    ]
    return state.rings + state.growing


def _phase_commit(
    geom: Geometry,
    state: CacheState,
    dests: mx.array,
    retained: mx.array,
    accepted: int,
    flag: Optional[bool],
) -> list[mx.array]:
    if accepted < geom.block:
        state.rings = restore_rows(
            state.rings,
            dests[:, accepted:],
            _block_slice(retained, accepted),
            use_kernel=flag,
        )
    return state.rings


def run_round(
    geom: Geometry,
    state: CacheState,
    rows: mx.array,
    accepted: int,
    flag: Optional[bool],
    samples: Samples,
) -> None:
    """One timed round; the state keeps the rotation so rounds repeat."""
    dests = _dests(geom, state)
    mx.synchronize()
    mx.reset_peak_memory()
    resident = mx.get_active_memory()
    (retained,), t_retain = _timed(lambda: _phase_retain(state, dests, flag))
    # Keep no reference to a phase's outputs beyond ``state``: an extra one
    # would stop mlx from donating the planes to the next in-place scatter.
    t_store = _timed(lambda: _phase_store(state, rows, flag))[1]
    t_commit = _timed(
        lambda: _phase_commit(geom, state, dests, retained, accepted, flag)
    )[1]
    samples.allocated.append(int(mx.get_peak_memory() - resident))
    samples.retain.append(t_retain)
    samples.store.append(t_store)
    samples.commit.append(t_commit)
    samples.total.append(t_retain + t_store + t_commit)


def count_round(
    geom: Geometry,
    state: CacheState,
    rows: mx.array,
    accepted: int,
    flag: Optional[bool],
) -> Counter:
    """Launches of one round, phase by phase, on a copy of the state.

    Each phase's graph is counted, then evaluated so the next phase's graph
    holds only its own nodes. ``state`` keeps references to its buffers, so
    nothing here can donate (overwrite) them.
    """
    copy = CacheState(
        list(state.rings), list(state.growing), state.ring_origin, state.growing_len
    )
    dests = _dests(geom, copy)
    (retained,) = _phase_retain(copy, dests, flag)
    counts = graph_launches(retained)
    mx.eval(retained)
    stored = _phase_store(copy, rows, flag)
    counts += graph_launches(*stored)
    mx.eval(stored)
    if accepted < geom.block:
        counts += graph_launches(
            *_phase_commit(geom, copy, dests, retained, accepted, flag)
        )
    return counts


def model_bytes(geom: Geometry, context: int, accepted: int, mode: str) -> int:
    """Bytes read + written by one round under the chosen forms (model).

    In place (scatter, donated): a store moves ``block`` rows per plane and a
    restore ``block - a``; a fresh-output kernel reads and writes a whole
    plane. Retain reads and writes ``block`` rows per ring plane (twice in
    the reference: per-plane gathers, then the stack copies them again).
    """
    row = geom.plane_row_bytes
    rings, growing = 2 * geom.sliding, 2 * geom.full
    fresh = mode == "kernels"
    retain = rings * 2 * geom.block * row * (2 if mode == "reference" else 1)
    ring_store_bytes = rings * (
        2 * geom.window * row if fresh else 2 * geom.block * row
    )
    grow_rows = context + geom.block
    grow_store = growing * (2 * grow_rows * row if fresh else 2 * geom.block * row)
    rejected = geom.block - accepted
    if rejected == 0:
        restore = 0
    elif fresh:
        restore = rings * 2 * geom.window * row
    else:
        restore = rings * 2 * rejected * row
    return retain + ring_store_bytes + grow_store + restore


def _stats(values: Sequence[float]) -> dict[str, float]:
    ordered = sorted(values)

    def pick(q: float) -> float:
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))]

    return {
        "median": statistics.median(ordered),
        "p10": pick(0.1),
        "p90": pick(0.9),
    }


def bench_stage(
    geom: Geometry,
    state: CacheState,
    rows: mx.array,
    flag: Optional[bool],
    reps: int,
    warmup: int,
) -> dict:
    """Time building all ring shadows of one staged verify (78 calls)."""

    def step() -> list[mx.array]:
        return [
            stage_shadow(p, rows, state.ring_origin, geom.window, use_kernel=flag)
            for p in state.rings
        ]

    launches = graph_launches(*step())
    times = [_timed(step)[1] for _ in range(warmup + reps)][warmup:]
    return {"ms": _stats(times), "launches": dict(launches)}


def bench_mode(
    geom: Geometry, context: int, mode: str, args: argparse.Namespace
) -> dict:
    """All accepted counts of one mode at one context."""
    flag = MODES[mode]
    # Without a GPU the auto path is the reference; model what actually runs.
    modelled = "reference" if flag is None and not use_kernel_path(None, True) else mode
    state = make_state(geom, context)
    rows = mx.random.normal((1, geom.heads, geom.block, geom.dim)).astype(geom.mx_dtype)
    mx.eval(rows)
    per_accept = []
    for accepted in range(geom.block + 1):
        launches = count_round(geom, state, rows, accepted, flag)
        samples = Samples()
        for rep in range(args.warmup + args.reps):
            run_round(geom, state, rows, accepted, flag, samples)
        keep = slice(args.warmup, None)
        per_accept.append(
            {
                "accepted": accepted,
                "round_ms": _stats(samples.total[keep]),
                "retain_ms": _stats(samples.retain[keep]),
                "store_ms": _stats(samples.store[keep]),
                "commit_ms": _stats(samples.commit[keep]),
                "launches": sum(launches.values()),
                "launches_by_primitive": dict(launches),
                "allocated_bytes": int(statistics.median(samples.allocated[keep])),
                "model_bytes": model_bytes(geom, context, accepted, modelled),
            }
        )
    stage = bench_stage(geom, state, rows, flag, args.reps, args.warmup)
    return {"context": context, "mode": mode, "per_accept": per_accept, "stage": stage}


def _print_result(result: dict) -> None:
    print(f"\ncontext {result['context']}  mode {result['mode']}")
    print("  a  round ms  retain  store  commit  launches  alloc MiB  model MiB")
    for row in result["per_accept"]:
        print(
            f"{row['accepted']:3d} {row['round_ms']['median']:9.3f}"
            f" {row['retain_ms']['median']:7.3f} {row['store_ms']['median']:6.3f}"
            f" {row['commit_ms']['median']:7.3f} {row['launches']:9d}"
            f" {row['allocated_bytes'] / 2**20:10.2f} {row['model_bytes'] / 2**20:10.2f}"
        )
    stage = result["stage"]
    print(
        f"  stage shadows: {stage['ms']['median']:.3f} ms, "
        f"{sum(stage['launches'].values())} launches"
    )


def parse_args(argv: Optional[Sequence[str]]) -> argparse.Namespace:
    """Command-line options."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", required=True, help="write results here")
    parser.add_argument("--contexts", type=int, nargs="+", default=[4096, 32768])
    parser.add_argument("--modes", nargs="+", choices=list(MODES), default=list(MODES))
    parser.add_argument("--sliding", type=int, default=Geometry.sliding)
    parser.add_argument("--full", type=int, default=Geometry.full)
    parser.add_argument("--window", type=int, default=Geometry.window)
    parser.add_argument("--heads", type=int, default=Geometry.heads)
    parser.add_argument("--dim", type=int, default=Geometry.dim)
    parser.add_argument(
        "--dtype", default=Geometry.dtype, choices=["float16", "bfloat16", "float32"]
    )
    parser.add_argument("--block", type=int, default=Geometry.block)
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    return parser.parse_args(argv)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run the benchmark and write JSON."""
    args = parse_args(argv)
    geom = Geometry(
        args.sliding,
        args.full,
        args.window,
        args.heads,
        args.dim,
        args.dtype,
        args.block,
    )
    backend = kernel_backend()
    modes = [m for m in args.modes if backend is not None or MODES[m] is not True]
    skipped = sorted(set(args.modes) - set(modes))
    results = []
    for context in args.contexts:
        if context < geom.window:
            raise SystemExit(
                f"context {context} < window {geom.window}: rings not full"
            )
        for mode in modes:
            result = bench_mode(geom, context, mode, args)
            _print_result(result)
            results.append(result)
    report = {
        "meta": {
            "mlx": mx.__version__,
            "backend": backend,
            "default_device": str(mx.default_device()),
            "python": platform.python_version(),
            "geometry": asdict(geom),
            "plane_row_bytes": geom.plane_row_bytes,
            "reps": args.reps,
            "warmup": args.warmup,
            "skipped_modes": skipped,
        },
        "results": results,
    }
    with open(args.json, "w") as out:
        json.dump(report, out, indent=1)
    print(
        f"\nwrote {args.json}"
        + (f" (skipped without a GPU: {skipped})" if skipped else "")
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
