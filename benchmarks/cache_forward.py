"""What the KV cache costs *inside* the verify forward: paired, interleaved timings.

``benchmarks.cache_round`` times the cache's work on its own (every launch paid in full,
nothing to overlap with). A model forward interleaves those launches with its own ~1,700, so
this benchmark measures the cache where it runs: the 16-token verify forward of Muse Glimmer
(mlx-lm ``muse_glimmer``, default ``ModelArgs``, bfloat16 random weights; ``--small``: a tiny
one) at one context, driven through four routes, interleaved round-robin (the order rotates
every repetition) so drift and clocks hit every route alike:

* ``none``: no cache work at all. Every layer still computes its keys and values, then is
  handed, ready-made, exactly the keys, values and mask the wired cache would give it (the
  staging shadow on sliding layers), so attention does the same arithmetic; this is the
  forward a free cache would cost.
* ``mlx-lm``: mlx-lm's own ``make_cache()`` (``RotatingKVCache`` / ``KVCache``) at the same
  context and rotation: what a plain 16-token mlx-lm forward pays its cache (it cannot roll
  back a wrapped ring, so it is a baseline, not an alternative).
* ``reference`` / ``kernels``: the wired cache (``use_kernel=False`` / ``True``) in a real
  verify round: ``SpeculativeCheckpoint.begin`` -> forward -> ``commit(kept)``, with ``kept``
  cycling through ``0..B`` over the repetitions. As in ``dflash_generate_step``, the commit's
  stores are left lazy and run inside the next forward of the route (its staging shadows read
  the rings), so every timed forward carries one commit.

The cache's cost of a route is the paired difference ``route - none`` of each repetition
(median and p10/p90 over repetitions); launches are counted on the lazy graphs (views
excluded), the commit's apart.

``python -m benchmarks.cache_forward --json OUT`` (from the repository root) writes JSON and a
markdown table (``OUT`` with ``.md``) after every context. Recorded runs before the move name
it ``python -m dflash.metal.bench_forward``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Callable, Optional, Sequence

import mlx.core as mx
from mlx_lm.models.cache import RotatingKVCache

from dflash.cache import SpeculativeCheckpoint
from dflash.metal import kernel_backend
from tests.support.launches import graph_launches

from . import common

ROUTES: tuple[str, ...] = ("none", "mlx-lm", "reference", "kernels")
KERNEL_ROUTES = {"reference": False, "kernels": True}


class FixedKV:
    """A layer cache that does no work: it hands back ready-made keys, values and mask.

    Args:
        keys: What ``update_and_fetch`` returns as keys.
        values: What it returns as values.
        mask: What ``make_mask`` returns.
        offset: The absolute position RoPE reads.
    """

    def __init__(self, keys: mx.array, values: mx.array, mask, offset: int):
        self.keys, self.values, self.mask, self.offset = keys, values, mask, offset

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        # ``depends`` keeps the layer's K/V projections in the graph (they are real work
        # of the forward) without copying anything.
        return tuple(mx.depends([self.keys, self.values], [keys, values]))

    def make_mask(
        self, N: int, window_size: Optional[int] = None, return_array: bool = False
    ):
        return self.mask


def fixed_cache(model, geom: common.Geometry, context: int) -> list[FixedKV]:
    """The ``none`` route: per layer, what the wired cache returns for a verify block."""
    cache = common.make_cache(geom, False, model=model)
    common.fill_cache(cache, geom, context)
    fixed = []
    for index, plane in enumerate(cache):
        mask = plane.make_mask(geom.block, window_size=plane.window)
        shape = (1, geom.heads, geom.block, geom.dim)
        rows = mx.random.normal(shape, key=mx.random.key(index)).astype(geom.mx_dtype)
        offset = plane.offset
        keys, values = plane.update_and_fetch(rows, rows)
        mx.eval(keys, values, mask if isinstance(mask, mx.array) else [])
        fixed.append(FixedKV(keys, values, mask, offset))
    return fixed


class MlxLmCache:
    """mlx-lm's own caches for ``model`` at ``context``, restorable after every forward.

    Rings (``RotatingKVCache``) are full and rotated as sequential single-token steps
    leave them; ``KVCache`` layers hold ``context`` rows with room for the block.
    """

    def __init__(self, model, geom: common.Geometry, context: int):
        self.layers = model.make_cache()
        for layer in self.layers:
            rotating = isinstance(layer, RotatingKVCache)
            rows = (
                layer.max_size if rotating else -(-(context + geom.block) // 256) * 256
            )
            shape = (1, geom.heads, rows, geom.dim)
            layer.keys = mx.random.normal(shape).astype(geom.mx_dtype)
            layer.values = mx.random.normal(shape).astype(geom.mx_dtype)
            layer.offset = context
            if rotating:
                layer._idx = context % layer.max_size
            mx.eval(layer.keys, layer.values)
        self.saved = [dict(vars(layer)) for layer in self.layers]

    def restore(self) -> None:
        """Put every layer's attributes back (a forward rebinds, never mutates, rings)."""
        for layer, saved in zip(self.layers, self.saved):
            vars(layer).update(saved)


def route_steps(
    model, geom: common.Geometry, context: int, routes: Sequence[str]
) -> dict:
    """One timed step per route, each leaving its cache as it found it."""
    tokens = mx.random.randint(0, 256, (1, geom.block), key=mx.random.key(1))
    mx.eval(tokens)
    steps: dict[str, Callable[[int], None]] = {}
    if "none" in routes:
        fixed = fixed_cache(model, geom, context)
        steps["none"] = lambda kept: mx.eval(model(tokens, cache=fixed))
    if "mlx-lm" in routes:
        plain = MlxLmCache(model, geom, context)

        def mlx_lm(kept: int) -> None:
            mx.eval(model(tokens, cache=plain.layers))
            plain.restore()

        steps["mlx-lm"] = mlx_lm
    for route, use_kernel in KERNEL_ROUTES.items():
        if route in routes:
            steps[route] = _verify_step(model, geom, context, tokens, use_kernel)
    return steps


def _verify_step(model, geom, context, tokens, use_kernel) -> Callable[[int], None]:
    cache = common.make_cache(geom, use_kernel, model=model)
    common.fill_cache(cache, geom, context)
    metas = [plane.meta for plane in cache]

    def verify(kept: int) -> None:
        # As in dflash_generate_step, the commit's stores are not evaluated on their own:
        # they run inside the next forward (whose shadows read the rings), so each timed
        # forward carries the previous round's commit.
        checkpoint = SpeculativeCheckpoint.begin(cache, geom.block)
        mx.eval(model(tokens, cache=cache))
        checkpoint.commit(kept)
        common.rewind(cache, metas)

    verify.cache = cache
    return verify


def count_launches(model, geom: common.Geometry, context: int, route: str) -> dict:
    """Launches of one lazy forward of ``route`` (and of its commit, kept = B)."""
    tokens = mx.zeros((1, geom.block), dtype=mx.int32)
    if route == "none":
        logits = model(tokens, cache=fixed_cache(model, geom, context))
        return {"forward": sum(graph_launches(logits).values()), "commit": 0}
    if route == "mlx-lm":
        logits = model(tokens, cache=MlxLmCache(model, geom, context).layers)
        return {"forward": sum(graph_launches(logits).values()), "commit": 0}
    cache = common.make_cache(geom, KERNEL_ROUTES[route], model=model)
    common.fill_cache(cache, geom, context)
    checkpoint = SpeculativeCheckpoint.begin(cache, geom.block)
    logits = model(tokens, cache=cache)
    forward = sum(graph_launches(logits).values())
    mx.eval(logits)
    checkpoint.commit(geom.block)
    commit = sum(graph_launches(*[plane.kv for plane in cache]).values())
    return {"forward": forward, "commit": commit}


def bench_context(model, geom: common.Geometry, context: int, args) -> dict:
    """Interleaved repetitions of every route at one context."""
    routes = [r for r in args.routes if r in ROUTES]
    steps = route_steps(model, geom, context, routes)
    times: dict[str, list[float]] = {route: [] for route in routes}
    for rep in range(args.warmup + args.reps):
        kept = rep % (geom.block + 1)
        order = routes[rep % len(routes) :] + routes[: rep % len(routes)]
        for route in order:
            elapsed = common.sync_time(lambda: steps[route](kept))[1]
            if rep >= args.warmup:
                times[route].append(elapsed)
    result = {"context": context, "routes": {}}
    for route in routes:
        row = {"forward_ms": common.stats(times[route])}
        row["launches"] = count_launches(model, geom, context, route)
        if "none" in times and route != "none":
            paired = [t - n for t, n in zip(times[route], times["none"])]
            row["cache_ms"] = common.stats(paired)
        result["routes"][route] = row
    return result


def _share(result: dict, route: str) -> str:
    row = result["routes"].get(route, {})
    if "cache_ms" not in row:
        return "—"
    none = result["routes"]["none"]["forward_ms"]["median"]
    return f"{100 * row['cache_ms']['median'] / none:.1f} %"


def markdown(report: dict) -> str:
    """The report as a markdown table, plus the kernels-vs-reference ratios."""
    meta = report["meta"]
    lines = [
        f"# benchmarks.cache_forward — {meta['date']}",
        "",
        f"`{meta['command']}`",
        "",
        f"mlx {meta['mlx']}, kernel backend `{meta['backend']}`, device "
        f"`{meta['device']}`; {report['model']}; verify block B = "
        f"{meta['geometry']['block']}; {meta['reps']} interleaved repetitions after "
        f"{meta['warmup']} warm-up, kept cycling 0..B.",
        "",
        "Cache work = the route's forward minus the `none` forward of the same "
        "repetition (median, p10–p90); share = that over the `none` forward.",
        "",
        "| context | route | forward ms | cache work ms | p10 – p90 | share of the "
        "forward | launches: forward + commit | cache launches |",
        "|---:|---|---:|---:|---:|---:|---:|---:|",
    ]
    for result in report["contexts"]:
        base = result["routes"].get("none", {}).get("launches", {}).get("forward")
        for route, row in result["routes"].items():
            launches = row["launches"]
            total = launches["forward"] + launches["commit"]
            cache = "—" if base is None else str(total - base)
            work = row.get("cache_ms")
            spread = "—" if work is None else f"{work['p10']:.2f} – {work['p90']:.2f}"
            lines.append(
                f"| {result['context']:,} | {route} | "
                f"{row['forward_ms']['median']:.2f} | "
                f"{'—' if work is None else format(work['median'], '.2f')} | {spread} | "
                f"{_share(result, route)} | {launches['forward']} + {launches['commit']} "
                f"| {cache} |"
            )
    return "\n".join(lines) + "\n"


def parse_args(argv: Optional[Sequence[str]]) -> argparse.Namespace:
    """Command-line options."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", required=True, help="write results here")
    parser.add_argument("--markdown", help="markdown here (default: JSON path, .md)")
    parser.add_argument("--small", action="store_true", help="tiny model, CPU-sized")
    parser.add_argument("--contexts", type=int, nargs="+")
    parser.add_argument("--routes", nargs="+", choices=ROUTES, default=list(ROUTES))
    parser.add_argument("--reps", type=int, default=60)
    parser.add_argument("--warmup", type=int, default=4)
    for name in ("sliding", "full", "window", "heads", "dim", "block"):
        parser.add_argument(f"--{name}", type=int)
    parser.add_argument("--dtype", choices=["float16", "bfloat16", "float32"])
    args = parser.parse_args(argv)
    args.emulate_metal, args.verify_reps = None, args.reps
    if args.small:
        args.reps, args.warmup = min(args.reps, 6), min(args.warmup, 1)
    return args


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run the benchmark; write JSON and markdown."""
    args = parse_args(argv)
    if kernel_backend() is None and "kernels" in args.routes:
        args.routes = [r for r in args.routes if r != "kernels"]
        print("no Metal/CUDA backend: skipping the kernels route")
    geom = common.geometry(args)
    contexts = args.contexts or ([96, 160] if args.small else [4096, 32768])
    tic = time.perf_counter()
    model, model_args = common.random_glimmer(geom, args.small)
    geom = common.verify_geometry(model_args, geom)
    for context in contexts:
        if context < geom.window:
            raise SystemExit(
                f"context {context} < window {geom.window}: rings not full"
            )
    report = {
        "meta": common.run_meta("cache_forward", args, argv, geom, contexts, []),
        "model": f"muse_glimmer {'tiny' if args.small else 'default ModelArgs'}: "
        f"{model_args.num_hidden_layers} layers, hidden {model_args.hidden_size}, "
        f"{geom.dtype} random weights (built in {time.perf_counter() - tic:.1f} s)",
        "contexts": [],
    }
    markdown_path = args.markdown or str(Path(args.json).with_suffix(".md"))
    for context in contexts:
        result = bench_context(model, geom, context, args)
        report["contexts"].append(result)
        for route, row in result["routes"].items():
            work = row.get("cache_ms", {}).get("median")
            print(
                f"context {context} {route:9s} forward {row['forward_ms']['median']:8.2f} ms"
                + ("" if work is None else f"  cache work {work:7.2f} ms")
                + f"  launches {row['launches']}"
            )
        Path(args.json).write_text(json.dumps(report, indent=1))
        Path(markdown_path).write_text(markdown(report))
    print(f"wrote {args.json} and {markdown_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
