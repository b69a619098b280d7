"""Per-round KV-cache cost of a speculative verify round: the wired cache vs reference ops.

Geometry (defaults): Muse Glimmer's cache, 39 ring layers of 2,048 rows and 13 growing layers
in its [sliding, sliding, sliding, full] order, 2 KV heads x 128, bfloat16, B=1, a 16-token
verify block, at 4k and 32k context (rings full and rotated as sequential appends leave them).

Three measurements, each per context:

* ``ops``: the **reference ops** of a round as the cache ran them before it was wired (the
  numbers issue #3 started from): gather the block's rows from all 78 K/V ring planes + stack,
  store the block in all 104 planes, put the rejected rows back, each phase ending in
  ``mx.eval`` (the old ``begin`` synced the host).
* ``cache``: the **wired cache** (``RingKVCache`` / ``GrowingKVCache`` from ``dflash.cache``)
  driven as a model forward drives it, per mode (``reference``: ``use_kernel=False``;
  ``kernels``: ``use_kernel=True``). A checkpoint round is ``begin`` ->
  ``update_and_fetch`` in every layer (K/V handed over as mlx-lm's transposed views) ->
  evaluate what attention reads -> ``commit(kept)`` -> evaluate the buffers; a plain round is
  the same forward with no checkpoint (what a non-speculative 16-token forward costs the
  cache). ``checkpoint_ms`` = round - plain is what speculation adds.
* ``verify`` (unless ``--skip-verify``): the 16-token verify forward of Muse Glimmer
  (mlx-lm ``muse_glimmer``, default ``ModelArgs``, bfloat16 random weights; ``--small``: a
  tiny one) on the wired cache at the same context, inside a checkpoint, per mode.

Every kept count ``0..block`` (rollback .. full acceptance) is timed; launches are the graph
nodes that launch work (views excluded) of one lazy round, counted before evaluation;
``allocated_bytes`` is peak minus resident memory over the commit (the ops round: over the
round): a ring copied instead of updated in place shows here.

``python -m benchmarks.cache_round --json OUT`` (from the repository root) writes JSON and a
markdown table (``OUT`` with ``.md``) after every result, so a run cut short keeps what it
measured. ``--small`` is a CPU-sized geometry (and model) that runs every code path in
seconds; ``--emulate-metal DIR`` runs the kernel mode on the CPU through the Metal bodies
(code paths only). Recorded runs before the move name it ``python -m dflash.metal.bench``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional, Sequence

import mlx.core as mx
import numpy as np

from dflash.cache import SpeculativeCheckpoint
from dflash.metal import (
    backend,
    kernel_backend,
    restore_rows,
    retain_rows,
    ring_write,
    wrapped_rows,
)
from tests.support.launches import graph_launches

from .common import (
    SMALL_CONTEXTS,
    Allocation,
    Geometry,
    block_kv,
    cache_fetch,
    fill_cache,
    geometry,
    make_cache,
    median_int,
    random_glimmer,
    rewind,
    run_meta,
    stats,
    sync_time,
    verify_geometry,
)

CACHE_MODES: dict[str, bool] = {"reference": False, "kernels": True}


# ----------------------------------------------------------- reference ops


@dataclass
class OpsState:
    """Raw K and V plane buffers at one context (the pre-wiring, per-plane layout)."""

    rings: list[mx.array]
    growing: list[mx.array]
    ring_origin: int
    growing_len: int


def make_ops_state(geom: Geometry, context: int) -> OpsState:
    """Full rings rotated as ``context`` sequential appends leave them."""

    def plane(rows: int) -> mx.array:
        return mx.random.normal((1, geom.heads, rows, geom.dim)).astype(geom.mx_dtype)

    rings = [plane(geom.window) for _ in range(2 * geom.sliding)]
    growing = [plane(context + geom.block) for _ in range(2 * geom.full)]
    mx.eval(rings, growing)
    return OpsState(rings, growing, context % geom.window, context)


OPS_PHASES = ("retain", "store", "restore")


def ops_round(
    geom: Geometry, state: OpsState, rows: mx.array, kept: int, count: bool = False
) -> dict:
    """Retain -> store -> put back the rejected rows, with pure-MLX ops per plane.

    Each phase ends in ``mx.eval`` and a device sync, as the cache did before it was wired
    (its ``begin`` evaluated the retained rows).

    Args:
        geom: Geometry.
        state: Buffers, replaced by the round's outputs.
        rows: The block's rows (one plane's worth, stored in every plane).
        kept: Rows of the block kept.
        count: Count each phase's launches (on its lazy graph) instead of timing it.

    Returns:
        Phase name -> ms, or -> launches (a ``Counter``) when ``count``.
    """
    out: dict = {}
    clock = [time.perf_counter()]

    def finish(phase: str, outputs: list[mx.array]) -> None:
        """End a phase: count its launches, or evaluate it and record its wall time."""
        if count:
            out[phase] = graph_launches(*outputs)
            mx.eval(outputs)
            return
        mx.eval(outputs)
        mx.synchronize()
        now = time.perf_counter()
        out[phase] = (now - clock[-1]) * 1e3
        clock.append(now)

    dests = mx.array(
        np.tile(
            wrapped_rows(state.ring_origin, geom.block, geom.window),
            (2 * geom.sliding, 1),
        )
    )
    retained = retain_rows(state.rings, dests, use_kernel=False)
    finish("retain", [retained])
    state.rings = [
        ring_write(p, rows, state.ring_origin, 2, use_kernel=False) for p in state.rings
    ]
    state.growing = [
        ring_write(p, rows, state.growing_len, 2, use_kernel=False)
        for p in state.growing
    ]
    finish("store", state.rings + state.growing)
    if kept < geom.block:
        state.rings = restore_rows(
            state.rings, dests[:, kept:], retained[:, :, :, kept:, :], use_kernel=False
        )
    finish("restore", state.rings)
    if not count:
        out["round"] = (clock[-1] - clock[0]) * 1e3
    return out


def bench_ops(geom: Geometry, context: int, args: argparse.Namespace) -> dict:
    """Every kept count of the reference-ops round at one context."""
    state = make_ops_state(geom, context)
    rows = mx.random.normal((1, geom.heads, geom.block, geom.dim)).astype(geom.mx_dtype)
    mx.eval(rows)
    per_kept = []
    for kept in range(geom.block + 1):
        launches = ops_round(geom, state, rows, kept, count=True)
        samples, allocated = [], []
        for _ in range(args.warmup + args.reps):
            mx.synchronize()
            with Allocation() as alloc:
                samples.append(ops_round(geom, state, rows, kept))
            allocated.append(alloc.bytes)
        samples = samples[args.warmup :]
        total = sum(launches.values(), Counter())
        row = {"kept": kept, "round_ms": stats([s["round"] for s in samples])}
        for phase in OPS_PHASES:
            row[f"{phase}_ms"] = stats([s[phase] for s in samples])
            row[f"{phase}_launches"] = sum(launches[phase].values())
        row.update(
            launches=sum(total.values()),
            launches_by_primitive=dict(total),
            allocated_bytes=median_int(allocated[args.warmup :]),
        )
        per_kept.append(row)
    return {"context": context, "mode": "ops-reference", "per_kept": per_kept}


# ------------------------------------------------------------- wired cache


@dataclass
class RoundSample:
    """Wall times (ms) and allocations (bytes) of one checkpoint round."""

    fetch_ms: float
    commit_ms: float
    fetch_bytes: int
    commit_bytes: int


def cache_round(cache: list, rows: list, kept: int, block: int) -> RoundSample:
    """One checkpoint round, timed by phase; the bookkeeping is rewound afterwards.

    Rewinding keeps every round at the same ring rotation and the growing planes inside
    their storage, so no round pays for a reallocation.
    """
    metas = [plane.meta for plane in cache]

    def fetch():
        checkpoint = SpeculativeCheckpoint.begin(cache, block)
        mx.eval(cache_fetch(cache, rows))
        return checkpoint

    with Allocation() as fetch_alloc:
        checkpoint, fetch_ms = sync_time(fetch)

    def commit():
        checkpoint.commit(kept)
        mx.eval([plane.kv for plane in cache])

    with Allocation() as commit_alloc:
        commit_ms = sync_time(commit)[1]
    rewind(cache, metas)
    return RoundSample(fetch_ms, commit_ms, fetch_alloc.bytes, commit_alloc.bytes)


def plain_round(cache: list, rows: list) -> float:
    """The same forward with no checkpoint (rows stored as it runs); rewound after."""
    metas = [plane.meta for plane in cache]

    def step():
        mx.eval(cache_fetch(cache, rows))
        mx.eval([plane.kv for plane in cache])

    elapsed = sync_time(step)[1]
    rewind(cache, metas)
    return elapsed


def count_cache_round(cache: list, rows: list, kept: int, block: int) -> dict:
    """Launches of one checkpoint round and of one plain round, counted lazily."""
    metas = [plane.meta for plane in cache]
    checkpoint = SpeculativeCheckpoint.begin(cache, block)
    seen = cache_fetch(cache, rows)
    fetch = graph_launches(*seen)
    mx.eval(seen)
    checkpoint.commit(kept)
    buffers = [plane.kv for plane in cache]
    commit = graph_launches(*buffers)
    mx.eval(buffers)
    rewind(cache, metas)
    seen = cache_fetch(cache, rows)
    plain = graph_launches(*seen)
    mx.eval(seen)
    buffers = [plane.kv for plane in cache]
    plain += graph_launches(*buffers)
    mx.eval(buffers)
    rewind(cache, metas)
    total = fetch + commit
    return {
        "launches": sum(total.values()),
        "fetch_launches": sum(fetch.values()),
        "commit_launches": sum(commit.values()),
        "plain_launches": sum(plain.values()),
        "launches_by_primitive": dict(total),
    }


def bench_cache(
    geom: Geometry, context: int, mode: str, args: argparse.Namespace
) -> dict:
    """Every kept count of the wired-cache round at one context, one mode."""
    cache = make_cache(geom, CACHE_MODES[mode])
    fill_cache(cache, geom, context)
    rows = block_kv(geom, len(cache))
    per_kept = []
    for kept in range(geom.block + 1):
        counts = count_cache_round(cache, rows, kept, geom.block)
        samples, plain = [], []
        for _ in range(args.warmup + args.reps):
            samples.append(cache_round(cache, rows, kept, geom.block))
            plain.append(plain_round(cache, rows))
        samples, plain = samples[args.warmup :], plain[args.warmup :]
        rounds = [sample.fetch_ms + sample.commit_ms for sample in samples]
        per_kept.append(
            {
                "kept": kept,
                "round_ms": stats(rounds),
                "fetch_ms": stats([sample.fetch_ms for sample in samples]),
                "commit_ms": stats([sample.commit_ms for sample in samples]),
                "plain_ms": stats(plain),
                "checkpoint_ms": stats([r - p for r, p in zip(rounds, plain)]),
                "fetch_allocated_bytes": median_int(s.fetch_bytes for s in samples),
                "allocated_bytes": median_int(s.commit_bytes for s in samples),
                **counts,
            }
        )
    return {"context": context, "mode": mode, "per_kept": per_kept}


# ------------------------------------------------------------------ verify


def bench_verify(
    model, model_args, geom: Geometry, context: int, mode: str, args
) -> dict:
    """The verify forward inside a checkpoint (and without one), per kept count.

    Every run starts from the same bookkeeping (rewound after it), so the ring rotation and
    the growing planes' length stay those of ``context``.
    """
    cache = make_cache(geom, CACHE_MODES[mode], model=model)
    fill_cache(cache, geom, context)
    metas = [plane.meta for plane in cache]
    tokens = mx.random.randint(
        0, model_args.vocab_size, (1, geom.block), key=mx.random.key(1)
    )
    mx.eval(tokens)
    checkpoint = SpeculativeCheckpoint.begin(cache, geom.block)
    logits = model(tokens, cache=cache)
    launches = graph_launches(logits)
    mx.eval(logits)
    checkpoint.rollback()
    results = {
        "context": context,
        "mode": mode,
        "forward_launches": sum(launches.values()),
    }
    for kept in (1, geom.block):

        def verify() -> None:
            checkpoint = SpeculativeCheckpoint.begin(cache, geom.block)
            mx.eval(model(tokens, cache=cache))
            checkpoint.commit(kept)
            mx.eval([plane.kv for plane in cache])

        results[f"verify_ms_kept_{kept}"] = _repeat(verify, cache, metas, args)

    def plain() -> None:
        mx.eval(model(tokens, cache=cache))
        mx.eval([plane.kv for plane in cache])

    results["plain_forward_ms"] = _repeat(plain, cache, metas, args)
    return results


def _repeat(step: Callable[[], None], cache: list, metas: list, args) -> dict:
    """Time ``step`` after warm-up, rewinding the bookkeeping after every run."""
    times = []
    for _ in range(args.verify_warmup + args.verify_reps):
        times.append(sync_time(step)[1])
        rewind(cache, metas)
    return stats(times[args.verify_warmup :])


# ------------------------------------------------------------------ report


def _median_of(rows: list[dict], key: str) -> float:
    """Median over kept counts of each row's median ``key``."""
    return statistics.median(row[key]["median"] for row in rows)


def _max_of(rows: list[dict], key: str) -> float:
    """Largest over kept counts of each row's median ``key``."""
    return max(row[key]["median"] for row in rows)


# Each table: its header and alignment rows.
_CHECKPOINT_HEADER = (
    "| context | route | checkpoint ms, median over kept | max over kept | "
    "checkpoint launches (kept 0 / 1 / B) |",
    "|---:|---|---:|---:|---|",
)
_ROUND_HEADER = (
    "| context | route | round ms kept=0 | kept=1 | kept=B | max over kept | "
    "plain forward's cache work | launches kept=0 / 1 / B | commit alloc MiB |",
    "|---:|---|---:|---:|---:|---:|---:|---|---:|",
)
_VERIFY_HEADER = (
    "| context | mode | verify kept=1 | verify kept=B | plain forward | forward "
    "launches | checkpoint (max over kept) / verify | cache round (max) / verify |",
    "|---:|---|---:|---:|---:|---:|---:|---:|",
)


def _over_kept(rows: list[dict], block: int, cell, sep: str = " / ") -> str:
    """``cell(row)`` at kept = 0, 1 and the whole block, joined by ``sep``."""
    return sep.join(cell(rows[k]) for k in (0, 1, block))


def _checkpoint_rows(report: dict) -> list[str]:
    """What undoing a block costs per round: the old ops vs the wired checkpoint."""
    block = report["meta"]["geometry"]["block"]
    body = []
    for result in report["ops"]:
        rows = result["per_kept"]
        cost = [r["retain_ms"]["median"] + r["restore_ms"]["median"] for r in rows]
        launches = _over_kept(
            rows, block, lambda r: str(r["retain_launches"] + r["restore_launches"])
        )
        body.append(
            f"| {result['context']:,} | reference ops: retain + restore, host sync "
            f"| {statistics.median(cost):.3f} | {max(cost):.3f} | {launches} |"
        )
    for result in report["cache"]:
        rows = result["per_kept"]
        launches = _over_kept(
            rows, block, lambda r: str(r["launches"] - r["plain_launches"])
        )
        body.append(
            f"| {result['context']:,} | wired cache, {result['mode']}: round - plain "
            f"| {_median_of(rows, 'checkpoint_ms'):.3f} | {_max_of(rows, 'checkpoint_ms'):.3f} "
            f"| {launches} |"
        )
    return [*_CHECKPOINT_HEADER, *body]


def _round_row(result: dict, block: int) -> str:
    """One route's round: its time at each kept count, launches and allocation."""
    rows = result["per_kept"]
    plain = f"{_median_of(rows, 'plain_ms'):.3f}" if "plain_ms" in rows[0] else "—"
    launches = _over_kept(rows, block, lambda r: str(r["launches"]))
    alloc = max(r["allocated_bytes"] for r in rows) / 2**20
    times = _over_kept(rows, block, lambda r: f"{r['round_ms']['median']:.3f}", " | ")
    return (
        f"| {result['context']:,} | {result['mode']} | {times} | "
        f"{_max_of(rows, 'round_ms'):.3f} | {plain} | {launches} | {alloc:.2f} |"
    )


def _round_rows(report: dict) -> list[str]:
    """All the cache work of a round."""
    block = report["meta"]["geometry"]["block"]
    results = report["ops"] + report["cache"]
    return [*_ROUND_HEADER, *(_round_row(result, block) for result in results)]


def _verify_rows(report: dict) -> list[str]:
    """The verify forward, and the cache round as a share of it."""
    block = report["meta"]["geometry"]["block"]
    body = []
    for result in report["verify"]:
        verify = result[f"verify_ms_kept_{block}"]["median"]
        cache = [
            c
            for c in report["cache"]
            if c["context"] == result["context"] and c["mode"] == result["mode"]
        ]
        shares = ["—", "—"]
        if cache:
            rows = cache[0]["per_kept"]
            shares = [
                f"{100 * _max_of(rows, key) / verify:.1f} %"
                for key in ("checkpoint_ms", "round_ms")
            ]
        body.append(
            f"| {result['context']:,} | {result['mode']} | "
            f"{result['verify_ms_kept_1']['median']:.2f} | {verify:.2f} | "
            f"{result['plain_forward_ms']['median']:.2f} | {result['forward_launches']} | "
            f"{shares[0]} | {shares[1]} |"
        )
    return [*_VERIFY_HEADER, *body]


def markdown(report: dict) -> str:
    """The report as markdown tables."""
    meta = report["meta"]
    geom = meta["geometry"]
    lines = [
        f"# benchmarks.cache_round — {meta['date']}",
        "",
        f"`{meta['command']}`",
        "",
        f"mlx {meta['mlx']}, kernel backend `{meta['backend']}`"
        + (" (Metal bodies emulated on the CPU)" if meta["emulated_metal"] else "")
        + f", device `{meta['device']}`; {geom['sliding']} ring layers x {geom['window']} "
        f"rows + {geom['full']} growing, {geom['heads']} KV heads x {geom['dim']}, "
        f"{geom['dtype']}, block B = {geom['block']}; medians of {meta['reps']} rounds "
        f"after {meta['warmup']} warm-up, every kept count 0..B (0 = rollback).",
        "",
        "## What undoing a block costs",
        "",
        "Reference ops: the old checkpoint's retain (gathers + stack, then `mx.eval`) and "
        "restore phases. Wired cache: a checkpoint round minus the same forward without a "
        "checkpoint. Launches counted on the lazy graph (views excluded).",
        "",
        *_checkpoint_rows(report),
        "",
        "## All cache work of a round",
        "",
        "Reference ops: retain + store + restore. Wired cache: begin + `update_and_fetch` "
        "in every layer (staging shadows included) + commit, evaluated.",
        "",
        *_round_rows(report),
    ]
    if meta["emulated_metal"]:
        lines += [
            "",
            "Emulated Metal: kernels run eagerly in a CPU subprocess, so kernel-mode "
            "launch counts omit them and times mean nothing.",
        ]
    if report["verify"]:
        lines += [
            "",
            f"## Verify forward ({report['verify_model']})",
            "",
            *_verify_rows(report),
        ]
    return "\n".join(lines) + "\n"


def _print(result: dict, title: str) -> None:
    print(f"\n{title}: context {result['context']}  mode {result['mode']}")
    print(
        "  kept  round ms  launches  allocated MiB"
        + ("  plain ms  ckpt ms" if "plain_ms" in result["per_kept"][0] else "")
    )
    for row in result["per_kept"]:
        extra = ""
        if "plain_ms" in row:
            extra = f" {row['plain_ms']['median']:9.3f} {row['checkpoint_ms']['median']:8.3f}"
        print(
            f"  {row['kept']:4d} {row['round_ms']['median']:9.3f} {row['launches']:9d}"
            f" {row['allocated_bytes'] / 2**20:14.2f}{extra}"
        )


# --------------------------------------------------------------------- main


def parse_args(argv: Optional[Sequence[str]]) -> argparse.Namespace:
    """Command-line options."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", required=True, help="write results here")
    parser.add_argument(
        "--markdown", help="markdown table here (default: JSON path, .md)"
    )
    parser.add_argument(
        "--small", action="store_true", help="CPU-sized geometry and model"
    )
    parser.add_argument("--contexts", type=int, nargs="+")
    parser.add_argument(
        "--modes", nargs="+", choices=list(CACHE_MODES), default=list(CACHE_MODES)
    )
    parser.add_argument(
        "--skip-ops", action="store_true", help="skip the reference-ops baseline"
    )
    parser.add_argument(
        "--skip-verify", action="store_true", help="skip the model forward"
    )
    parser.add_argument("--sliding", type=int)
    parser.add_argument("--full", type=int)
    parser.add_argument("--window", type=int)
    parser.add_argument("--heads", type=int)
    parser.add_argument("--dim", type=int)
    parser.add_argument("--dtype", choices=["float16", "bfloat16", "float32"])
    parser.add_argument("--block", type=int)
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--verify-reps", type=int, default=5)
    parser.add_argument("--verify-warmup", type=int, default=2)
    parser.add_argument(
        "--emulate-metal",
        metavar="DIR",
        help="no GPU: compile the Metal bodies with g++ in DIR and run the kernel mode on the "
        "CPU through them (checks the code path, not speed)",
    )
    args = parser.parse_args(argv)
    if args.small:
        args.reps = min(args.reps, 3)
        args.warmup = min(args.warmup, 1)
        args.verify_reps = min(args.verify_reps, 2)
        args.verify_warmup = min(args.verify_warmup, 1)
    return args


def _emulate_metal(workdir: str) -> None:
    from tests.support.compile_check import check_specs, find_compiler
    from tests.support.metal_emulator import MetalEmulator

    compiler = find_compiler("g++")
    if compiler is None:
        raise SystemExit("--emulate-metal needs g++")
    Path(workdir).mkdir(parents=True, exist_ok=True)
    emulator = MetalEmulator(Path(workdir), check_specs(), compiler)
    if not emulator.build.ok:
        raise SystemExit(f"emulator build failed:\n{emulator.build.log}")
    backend.BACKEND = "metal"
    backend.launch = emulator.launch


def _save(report: dict, args: argparse.Namespace) -> str:
    """Write the JSON and markdown (after every result, so a cut-short run keeps them)."""
    with open(args.json, "w") as out:
        json.dump(report, out, indent=1)
    markdown_path = args.markdown or str(Path(args.json).with_suffix(".md"))
    Path(markdown_path).write_text(markdown(report))
    return markdown_path


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run the benchmark; write JSON and markdown."""
    args = parse_args(argv)
    if args.emulate_metal:
        _emulate_metal(args.emulate_metal)
    geom = geometry(args)
    contexts = args.contexts or (list(SMALL_CONTEXTS) if args.small else [4096, 32768])
    for context in contexts:
        if context < geom.window:
            raise SystemExit(
                f"context {context} < window {geom.window}: rings not full"
            )
    modes = [
        m for m in args.modes if kernel_backend() is not None or not CACHE_MODES[m]
    ]
    skipped = sorted(set(args.modes) - set(modes))
    report = {"ops": [], "cache": [], "verify": [], "verify_model": None}
    report["meta"] = run_meta("cache_round", args, argv, geom, contexts, skipped)
    for context in contexts:
        for mode in modes:
            result = bench_cache(geom, context, mode, args)
            _print(result, "wired cache")
            report["cache"].append(result)
            _save(report, args)
        if not args.skip_ops:
            result = bench_ops(geom, context, args)
            _print(result, "reference ops")
            report["ops"].append(result)
            _save(report, args)
    if not args.skip_verify:
        tic = time.perf_counter()
        model, model_args = random_glimmer(geom, args.small)
        vgeom = verify_geometry(model_args, geom)
        report["verify_model"] = (
            f"muse_glimmer {'tiny' if args.small else 'default ModelArgs'}: "
            f"{model_args.num_hidden_layers} layers, hidden {model_args.hidden_size}, "
            f"{geom.dtype} random weights, built in {time.perf_counter() - tic:.1f} s"
        )
        print(f"\n{report['verify_model']}")
        for context in contexts:
            for mode in modes:
                result = bench_verify(model, model_args, vgeom, context, mode, args)
                print(
                    f"verify: context {context} mode {mode}: "
                    f"{result[f'verify_ms_kept_{vgeom.block}']['median']:.2f} ms "
                    f"(plain {result['plain_forward_ms']['median']:.2f} ms)"
                )
                report["verify"].append(result)
                _save(report, args)
        del model
    report["meta"]["date"] = run_meta(
        "cache_round", args, argv, geom, contexts, skipped
    )["date"]
    markdown_path = _save(report, args)
    print(
        f"\nwrote {args.json} and {markdown_path}"
        + (f" (skipped without a GPU: {skipped})" if skipped else "")
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
