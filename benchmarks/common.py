"""What the benchmarks share: geometry, timing, a filled cache, a random Muse Glimmer.

Run the benchmarks from the repository root as ``python -m benchmarks.<name>``.
"""

from __future__ import annotations

import argparse
import importlib
import json
import platform
import statistics
import sys
import time
from dataclasses import asdict, dataclass, replace
from datetime import datetime, timezone
from typing import Callable, MutableMapping, Optional, Sequence

import mlx.core as mx

from dflash import kernel_patch
from dflash.bench.scale import build_scale_pair, scale_prompts
from dflash.bench.scale_target import QUANT_FORMS, QUANTS
from dflash.cache import GrowingKVCache, PlaneMeta, RingKVCache, make_prompt_cache
from dflash.greedy import greedy_reference_with_margins
from dflash.launch_mode import prefer_direct_launches
from dflash.metal import kernel_backend


@dataclass(frozen=True)
class Geometry:
    """Cache geometry of the benchmark (and of the verify model).

    Attributes:
        sliding: Sliding (ring) layers; K and V of each are one stacked plane.
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
    def layers(self) -> int:
        """Decoder layers."""
        return self.sliding + self.full

    def full_layers(self) -> frozenset[int]:
        """Muse Glimmer's order: every fourth layer is full; any others come last."""
        slots = [i for i in range(self.layers) if i % 4 == 3][: self.full]
        rest = [i for i in reversed(range(self.layers)) if i not in slots]
        return frozenset(slots + rest[: self.full - len(slots)])


SMALL = Geometry(sliding=6, full=2, window=64, heads=2, dim=32, block=8)


SMALL_CONTEXTS = (96, 160)


def geometry(args: argparse.Namespace) -> Geometry:
    """Defaults (or ``--small``) overridden by explicit flags."""
    geom = SMALL if args.small else Geometry()
    overrides = {
        name: getattr(args, name)
        for name in ("sliding", "full", "window", "heads", "dim", "dtype", "block")
        if getattr(args, name) is not None
    }
    return replace(geom, **overrides)


# ------------------------------------------------------------------ timing


def stats(values: Sequence[float]) -> dict[str, float]:
    """Median, 10th and 90th percentile."""
    ordered = sorted(values)

    def pick(q: float) -> float:
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))]

    return {"median": statistics.median(ordered), "p10": pick(0.1), "p90": pick(0.9)}


def median_int(values) -> int:
    """Median of integers, as an int."""
    return int(statistics.median(list(values)))


def sync_time(step: Callable[[], object]) -> tuple[object, float]:
    """Run ``step`` (which evaluates its own work), then wait for the device; ms."""
    mx.synchronize()
    start = time.perf_counter()
    out = step()
    mx.synchronize()
    return out, (time.perf_counter() - start) * 1e3


def host_and_total_ms(
    step: Callable[[], object], reps: int = 50, warmup: int = 5
) -> tuple[float, float]:
    """Medians over ``reps`` runs of building ``step()``'s graph, and of building + evaluating it.

    Args:
        step: Builds (lazily) and returns what to evaluate.
        reps: Timed runs, after ``warmup`` untimed ones.
        warmup: Untimed runs first (compilation, allocation).

    Returns:
        ``(host_ms, total_ms)``: graph building alone, and until the device is done.
    """
    host, total = [], []
    for rep in range(warmup + reps):
        mx.synchronize()
        start = time.perf_counter()
        outputs = step()
        built = time.perf_counter()
        mx.eval(outputs)
        mx.synchronize()
        if rep >= warmup:
            host.append((built - start) * 1e3)
            total.append((time.perf_counter() - start) * 1e3)
    return statistics.median(host), statistics.median(total)


class Allocation:
    """Peak minus resident device memory over a span (bytes)."""

    def __enter__(self) -> "Allocation":
        mx.synchronize()
        mx.reset_peak_memory()
        self.resident = mx.get_active_memory()
        self.bytes = 0
        return self

    def __exit__(self, *exc) -> None:
        mx.synchronize()
        self.bytes = max(0, int(mx.get_peak_memory() - self.resident))


# ------------------------------------------------------------ cache setup


def make_cache(geom: Geometry, use_kernel: Optional[bool], model=None) -> list:
    """The wired cache: a model's ``make_prompt_cache`` or planes in Glimmer's layer order."""
    if model is not None:
        return make_prompt_cache(model, use_kernel=use_kernel)
    full = geom.full_layers()
    return [
        (
            GrowingKVCache(layer=i, use_kernel=use_kernel)
            if i in full
            else RingKVCache(geom.window, layer=i, use_kernel=use_kernel)
        )
        for i in range(geom.layers)
    ]


def fill_cache(cache: list, geom: Geometry, context: int) -> None:
    """Put every plane where ``context`` sequential appends leave it (random rows).

    Rings: full, rotated by ``context % C``; growing planes: ``context`` rows, room for a
    block past them (so no round reallocates).
    """
    for plane in cache:
        if plane.is_ring:
            rows, capacity = plane.capacity, plane.capacity
            meta = PlaneMeta(
                capacity, rows, context - rows, (context - rows) % capacity
            )
        else:
            capacity = -(-(context + geom.block) // 256) * 256
            meta = PlaneMeta(capacity, context, 0, 0)
        shape = (1, geom.heads, capacity, geom.dim)
        keys = mx.random.normal(shape).astype(geom.mx_dtype)
        values = mx.random.normal(shape).astype(geom.mx_dtype)
        plane.set_buffers(keys, values)
        plane.set_meta(meta)
        mx.eval(plane.kv)


def block_kv(
    geom: Geometry, layers: int, seed: int = 0
) -> list[tuple[mx.array, mx.array]]:
    """Per layer, a block's keys and values as mlx-lm hands them over (transposed views)."""
    out = []
    for layer in range(layers):
        pair = mx.random.normal(
            (2, 1, geom.block, geom.heads, geom.dim), key=mx.random.key(seed + layer)
        ).astype(geom.mx_dtype)
        keys, values = (mx.squeeze(pair[i : i + 1], 0) for i in (0, 1))
        mx.eval(keys, values)  # views of one evaluated buffer, laid out (B, S, H, D)
        out.append((keys.transpose(0, 2, 1, 3), values.transpose(0, 2, 1, 3)))
    return out


def cache_fetch(cache: list, rows: list) -> list[mx.array]:
    """``update_and_fetch`` in every layer (lazy); the arrays attention would read."""
    return [
        a for plane, (k, v) in zip(cache, rows) for a in plane.update_and_fetch(k, v)
    ]


def rewind(cache: list, metas: list) -> None:
    """Put every plane's bookkeeping back (Python ints only)."""
    for plane, meta in zip(cache, metas):
        plane.set_meta(meta)


# ------------------------------------------------------------------- model


def glimmer_args(geom: Geometry, small: bool):
    """mlx-lm ``muse_glimmer`` ModelArgs: the default (full size) or a tiny one."""
    module = importlib.import_module("mlx_lm.models.muse_glimmer")
    if not small:
        return module, module.ModelArgs()
    return module, module.ModelArgs(
        hidden_size=64,
        num_hidden_layers=geom.layers,
        intermediate_size=128,
        num_attention_heads=2 * geom.heads,
        num_key_value_heads=geom.heads,
        head_dim=geom.dim,
        vocab_size=256,
        sliding_window=geom.window,
    )


def random_glimmer(geom: Geometry, small: bool):
    """Muse Glimmer with random weights in ``geom``'s dtype (no float32 copy is made)."""
    from mlx.utils import tree_flatten, tree_unflatten

    module, model_args = glimmer_args(geom, small)
    model = module.Model(model_args)
    names = [name for name, _ in tree_flatten(model.parameters())]
    shapes = dict(tree_flatten(model.parameters()))
    for start in range(0, len(names), 16):
        chunk = []
        for index, name in enumerate(names[start : start + 16], start=start):
            weight = mx.random.normal(
                shapes[name].shape,
                dtype=geom.mx_dtype,
                key=mx.random.key(index),
            )
            chunk.append((name, weight * 0.02))
        model.update(tree_unflatten(chunk))
        mx.eval([w for _, w in chunk])
    return model, model_args


def verify_geometry(model_args, geom: Geometry) -> Geometry:
    """The cache geometry the model implies."""
    sliding = sum(t == "sliding_attention" for t in model_args.layer_types)
    return replace(
        geom,
        sliding=sliding,
        full=model_args.num_hidden_layers - sliding,
        window=model_args.sliding_window,
        heads=model_args.num_key_value_heads,
        dim=model_args.head_dim,
    )


# ------------------------------------------------------------------ report


def run_meta(
    module: str, args: argparse.Namespace, argv, geom: Geometry, contexts, skipped
) -> dict:
    """What a report records about its run: versions, device, geometry, the command."""
    return {
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "mlx": mx.__version__,
        "backend": kernel_backend(),
        "emulated_metal": bool(args.emulate_metal),
        "device": str(mx.default_device()),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "geometry": asdict(geom),
        "contexts": list(contexts),
        "reps": args.reps,
        "warmup": args.warmup,
        "verify_reps": args.verify_reps,
        "skipped_modes": skipped,
        "command": " ".join(
            [f"python -m benchmarks.{module}"]
            + list(sys.argv[1:] if argv is None else argv)
        ),
    }


Event = tuple[str, float, float]


def scale_run_parser(prog: str, tokens: int, reps: int) -> argparse.ArgumentParser:
    """The arguments of a benchmark that generates with a scale pair at a replayed tau:
    ``--scale --quant --context --tokens --tau --block-size --reps --json``."""
    parser = argparse.ArgumentParser(prog=prog)
    parser.add_argument("--scale", choices=("full", "tiny"), default="tiny")
    parser.add_argument("--quant", choices=QUANTS, default="4bit")
    parser.add_argument("--context", type=int, default=64, help="prompt tokens")
    parser.add_argument("--tokens", type=int, default=tokens, help="tokens a run")
    parser.add_argument("--tau", type=int, default=6, help="replayed tokens a round")
    parser.add_argument("--block-size", type=int, default=None)
    parser.add_argument("--reps", type=int, default=reps, help="repetitions")
    parser.add_argument("--json", default=None)
    parser.add_argument(
        "--launch-mode",
        choices=LAUNCH_MODES,
        default="mlx",
        help="mlx: leave MLX_USE_CUDA_GRAPHS as found (mlx's default: graphs on); "
        "commands: choose as the dflash commands do for this target (mlx-lm's plain "
        "decoding here then runs in that mode too)",
    )
    return parser


# A benchmark leaves mlx's launch mode alone unless asked to run as the commands do.
LAUNCH_MODES = ("mlx", "commands")


def apply_launch_mode(
    mode: str, quant: str, environ: Optional[MutableMapping[str, str]] = None
) -> bool:
    """Choose mlx's CUDA launch mode for the scale target of ``quant`` as ``mode`` says,
    before anything is evaluated: ``"commands"`` asks for direct launches where the
    ``dflash`` commands would (:func:`dflash.kernel_patch.prefers_direct_launches`, a
    value already set kept); ``"mlx"`` changes nothing.

    Args:
        mode: One of :data:`LAUNCH_MODES`.
        quant: The scale target's form (``--quant``: ``"bf16"`` or a
            :data:`~dflash.bench.scale_target.QUANT_FORMS` name).
        environ: The environment to set (default ``os.environ``).

    Returns:
        True where this call set ``MLX_USE_CUDA_GRAPHS=0``.
    """
    if mode == "mlx":
        return False
    dense = ("dense", "bfloat16")
    form = ("affine", *QUANT_FORMS[quant]) if quant in QUANT_FORMS else dense
    host_paced = kernel_patch.prefers_direct_launches("muse_glimmer", form, "cuda")
    return prefer_direct_launches(environ, host_paced=host_paced)


def check_scale_run_args(
    parser: argparse.ArgumentParser, args: argparse.Namespace
) -> argparse.Namespace:
    """The block size for the scale (16 full, 8 tiny) unless given, and the counts in
    range; a bad value exits through ``parser.error`` (one line, status 2)."""
    if args.block_size is None:
        args.block_size = 16 if args.scale == "full" else 8
    for name in ("context", "tokens", "reps", "tau"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be at least 1")
    if not 1 <= args.tau <= args.block_size:
        parser.error(f"--tau must be in 1..{args.block_size} (the block size)")
    return args


def scale_run_setup(args: argparse.Namespace) -> tuple:
    """The scale pair of ``args``, one prompt of ``args.context`` tokens and the target's
    greedy continuation of ``args.tokens``: ``(target, drafter, prompt, tokens,
    sequence)``, ``sequence`` the prompt's ids then the continuation (what a replay
    drafter follows)."""
    target, drafter = build_scale_pair(args.scale, args.quant, 0)
    prompt = scale_prompts(target, args.context, 1, 0)[0]
    tokens, _ = greedy_reference_with_margins(target, prompt, args.tokens, set())
    return target, drafter, prompt, tokens, prompt.tolist() + tokens


def scale_run_main(
    module: str,
    argv: Optional[Sequence[str]],
    parse_args: Callable[[Optional[Sequence[str]]], argparse.Namespace],
    run: Callable[[argparse.Namespace, str], dict],
    summary_keys: Sequence[str],
) -> None:
    """A scale-run benchmark's ``main``: parse, run with its command line recorded, write
    ``--json``, print the ``summary_keys`` of the report."""
    args = parse_args(argv)
    command = " ".join([f"python -m {module}", *(argv or sys.argv[1:])])
    apply_launch_mode(args.launch_mode, args.quant)
    report = run(args, command)
    write_json(args.json, report)
    print("summary", {key: report[key] for key in summary_keys}, flush=True)


def write_json(path: Optional[str], data: object) -> None:
    """Write a benchmark's result as indented JSON (nothing when ``path`` is None)."""
    if path:
        with open(path, "w") as handle:
            json.dump(data, handle, indent=1)


def cupti_trace(run: Callable[[], object]) -> tuple[list[Event], list[Event]]:
    """The device kernels ``run`` launches and the CUDA API calls it makes, from CUPTI
    (through ``torch.profiler``).

    Needs PyTorch with CUDA in this interpreter; ``run`` must wait for its own work
    (``mx.eval`` or a host read) so that every kernel ends inside the capture.

    Returns:
        ``(kernels, api_calls)``: ``(name, start_us, duration_us)`` each, in start
        order; the API calls are the runtime's and the driver's (graph instantiation
        and update among them).
    """
    import os
    import tempfile

    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        run()
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as handle:
            events = json.load(handle).get("traceEvents", [])
    found: dict[str, list[Event]] = {"kernel": [], "api": []}
    for e in events:
        category = e.get("cat")
        if e.get("ph") != "X" or category not in (
            "kernel",
            "cuda_runtime",
            "cuda_driver",
        ):
            continue
        row = (
            str(e.get("name", "?")),
            float(e.get("ts", 0.0)),
            float(e.get("dur", 0.0)),
        )
        found["kernel" if category == "kernel" else "api"].append(row)
    order = lambda event: event[1]  # noqa: E731
    return sorted(found["kernel"], key=order), sorted(found["api"], key=order)


def cupti_kernel_events(run: Callable[[], object]) -> list[Event]:
    """The device kernels ``run`` launches (see :func:`cupti_trace`)."""
    return cupti_trace(run)[0]


def busy_us(kernels: Sequence[tuple[str, float, float]]) -> float:
    """Microseconds in which at least one of ``kernels`` ran (overlaps counted once)."""
    total, end = 0.0, float("-inf")
    for _, start, duration in sorted(kernels, key=lambda kernel: kernel[1]):
        stop = start + duration
        if stop > end:
            total += stop - max(start, end)
            end = stop
    return total
