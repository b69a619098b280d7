"""Where a DFlash round's host time goes, measured inside the real loop.

Runs ``dflash_generate_step`` on the scale pair (random Muse Glimmer target, full-size
random drafter) under a REPLAY profile and time-stamps each round's host phases:

* ``wait``: inside :meth:`VerifyRound.judge` (the one host sync: the device is busy);
* ``settle``: commit of the kept rows, drafter context append, sampling history;
* ``draft``: building the drafter graph; ``draft_launch``: starting it (``mx.async_eval``);
* ``verify_graph``: the target forward's Python (52 layers, caches, taps);
* ``verify_accept``: the acceptance rule's graph;
* ``verify_launch``: ``mx.async_eval`` of the verify (on CUDA this encodes every kernel);
* ``other``: the rest of the round (yields, stats, the consumer).

The device runs the drafter from the end of ``draft`` and the verify after it, so the host
work not hidden by the device is ``round - wait``. With ``--profile N`` the run is also put
under cProfile and the ``N`` costliest functions (own time) are listed.

Run (from the repository root)::

    python -m benchmarks.round_profile --scale full --quant bf16 --context 4096 \\
        --tau 2,6 --max-tokens 160 --json docs/benchmarks/round-profile.json
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import importlib
import io
import itertools
import json
import os
import pstats
import statistics
import time
from collections import Counter
from contextlib import AbstractContextManager, contextmanager
from functools import partial
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

import mlx.core as mx

from dflash import dflash_round, rounds
from dflash.bench.replay import ReplayDrafter
from dflash.bench.report import environment
from dflash.bench.scale import build_scale_pair, scale_prompts
from dflash.bench.scale_target import QUANTS
from dflash.dflash_round import DFlashSpeculator, dflash_generate_step
from dflash.folded_attention import FOLDED_ENV
from dflash.fused_projections import FUSED_ENV
from dflash.gated_mlp import SWIGLU_ENV
from dflash.generation import generate_step
from dflash.greedy import greedy_reference, greedy_reference_with_margins
from dflash.held_norms import HELD_NORMS_ENV
from dflash.kernel_patch import (
    COMPILED_BLOCKS_ENV,
    DRAFTER_DENSE_ENV,
    DRAFTER_HEAD_PREP_ENV,
    DRAFTER_QKV_ENV,
    STACKED_KV_ENV,
    VERIFY_KERNELS_ENV,
)
from dflash.metal.backend import COMPILE_ENV
from dflash.metal.prefetch import PREFETCH_ENV
from dflash.metal.tensor_qmm import (
    CHUNK_MAJOR_SCALES_ENV,
    CLUSTER_SUM_ENV,
    PREPARED_HEADS_ENV,
    DENORMAL_IN_PLACE_ENV,
    FOLDED_OFFSET_ENV,
    INTERLEAVED_SCALES_ENV,
    LEAN_BYTES_ENV,
    LEAN_ISSUE_ENV,
    MEMBER_MAJOR_ENV,
    MERGED_SPLIT_SUM_ENV,
    PAIRED_STAGE_ENV,
    PERSISTENT_ENV,
    SCALED_B_ENV,
    TWO_K_GROUPS_ENV,
    UNIT_SCALES_ENV,
    WAVE_SPLIT_ENV,
)
from dflash.prepared_heads import GATE_EPILOGUE_ENV, HEAD_PREP_ENV, KV_BLOCK_ENV
from dflash.residual_layers import RESIDUAL_NORMS_ENV
from dflash.taps import TargetTaps
from dflash.traced_drafts import DRAFTER_TRACED_ENV
from dflash.traced_layers import TRACED_LAYERS_ENV

from . import matmul_variants
from .common import busy_us, cupti_trace

PHASES = (
    "wait",
    "settle",
    "draft",
    "draft_launch",
    "verify_graph",
    "verify_accept",
    "verify_launch",
)


class PhaseClock:
    """Accumulates host seconds per phase for the current round."""

    def __init__(self) -> None:
        self.current: Dict[str, float] = {}
        self.rounds: List[Dict[str, float]] = []
        self.round_start: float = 0.0

    def add(self, phase: str, seconds: float) -> None:
        self.current[phase] = self.current.get(phase, 0.0) + seconds

    def next_round(self) -> None:
        now = time.perf_counter()
        if self.round_start:
            self.current["round"] = now - self.round_start
            self.rounds.append(self.current)
        self.current, self.round_start = {}, now


def _timed(clock: PhaseClock, phase: str, function):
    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return function(*args, **kwargs)
        finally:
            clock.add(phase, time.perf_counter() - start)

    return wrapper


@contextmanager
def instrumented(clock: PhaseClock, model) -> Iterator[None]:
    """Wrap the loop's phases with timers; everything is restored on exit."""
    saved = []

    def patch(owner, name, replacement):
        saved.append((owner, name, owner.__dict__[name]))
        setattr(owner, name, replacement)

    judge = rounds.VerifyRound.judge

    def timed_judge(self):
        clock.next_round()  # a round runs from one judge to the next
        start = time.perf_counter()
        out = judge(self)
        clock.add("wait", time.perf_counter() - start)
        return out

    patch(rounds.VerifyRound, "judge", timed_judge)
    patch(DFlashSpeculator, "settle", _timed(clock, "settle", DFlashSpeculator.settle))
    patch(DFlashSpeculator, "draft", _timed(clock, "draft", DFlashSpeculator.draft))
    model_type = type(model)
    patch(model_type, "__call__", _timed(clock, "verify_graph", model_type.__call__))
    sampling_type = dflash_round.Sampling
    patch(
        sampling_type,
        "accept",
        _timed(clock, "verify_accept", sampling_type.accept),
    )
    rounds.mx = _Proxy(mx, async_eval=_timed(clock, "verify_launch", mx.async_eval))
    dflash_round.mx = _Proxy(
        mx, async_eval=_timed(clock, "draft_launch", mx.async_eval)
    )
    try:
        yield
    finally:
        rounds.mx = dflash_round.mx = mx
        for owner, name, value in reversed(saved):
            setattr(owner, name, value)


@contextmanager
def taps_starting_early(start_early: bool) -> Iterator[None]:
    """Make the DFlash loop's taps start tapped outputs early (or not) for A/B runs."""

    class Taps(TargetTaps):
        def __init__(self, model, layer_ids, **_ignored):
            super().__init__(model, layer_ids, start_early=start_early)

    dflash_round.TargetTaps = Taps
    try:
        yield
    finally:
        dflash_round.TargetTaps = TargetTaps


# ``--kernels`` arms and the ``DFLASH_VERIFY_KERNELS`` value each sets (None: the default);
# the ``-unfused`` arms also set ``DFLASH_FUSED_PROJECTIONS=0`` (a launch per projection),
# the ``-merged`` arms ``DFLASH_MERGED_SPLIT_SUM=1`` (a K split summed in the matmul launch),
# the ``-compiled`` / ``-uncompiled`` arms ``DFLASH_COMPILE=1`` / ``=0`` (bound matmuls
# replayed by ``mx.compile`` or not; the other arms take the backend's default).
KERNEL_ARMS = {
    "default": None,
    "off": "0",
    "attention": "attention",
    "matmul": "matmul",
    "all": "1",
    "matmul-unfused": "matmul",
    "all-unfused": "1",
    "matmul-merged": "matmul",
    "all-merged": "1",
    "all-compiled": "1",
    "default-compiled": None,
    "matmul-uncompiled": "matmul",
    "all-uncompiled": "1",
    "default-uncompiled": None,
    "default-unheld": None,
    "default-unblocked": None,
    "default-blocked": None,
    "default-folded": None,
    "default-waves": None,
    "default-kgroups2": None,
    "default-kgroups1": None,
    "default-interleaved": None,
    "default-unprepared": None,
    "default-residual": None,
    "default-unresidual": None,
    "default-unfetched": None,
    "default-fetched32": None,
    "default-ungated": None,
    "default-unstacked": None,
    "default-swiglu": None,
    "default-unscaled": None,
    "default-scaled": None,
    "default-traced": None,
    "default-untraced": None,
    "all-traced": "1",
    "all-untraced": "1",
    "default-drafterqkv": None,
    "all-drafterqkv": "1",
    "default-drafterheads": None,
    "all-drafterheads": "1",
    "default-drafter": None,
    "all-drafter": "1",
    "default-draftermlx": None,
    "all-draftermlx": "1",
    "default-drafterkernel": None,
    "all-drafterkernel": "1",
    "default-drafterall": None,
    "all-drafterall": "1",
    "default-draftertraced": None,
    "all-draftertraced": "1",
    "default-paired": None,
    "default-lean": None,
    "default-pairedlean": None,
    # (The lean byte decode is the 8-bit default since session 71: all-floatbytes
    # against all is the A / B; all-leanbytes names it under a switch set to 1.)
    "all-leanbytes": "1",
    "matmul-leanbytes": "matmul",
    "all-floatbytes": "1",
    "matmul-floatbytes": "matmul",
    "default-inplace": None,
    "default-shifted": None,
    "default-unit": None,
    "default-rowmajor": None,
    "default-ileave": None,
    "default-cmajor": None,
    "default-persist": None,
    "default-cluster": None,
    "default-uncluster": None,
    "default-wholekv": None,
    "default-qkvprep": None,
    "default-clusterqkvprep": None,
    "off-unheld": "0",
    "projections": "projections",
    "attention-projections": "attention,projections",
}


@contextmanager
def env_value(name: str, value: Optional[str]) -> Iterator[None]:
    """Set environment variable ``name`` to ``value`` for the block (None: leave it)."""
    saved = os.environ.get(name)
    if value is not None:
        os.environ[name] = value
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = saved


# An arm's suffix (after its last "-") and the switch it sets for the arm's block.
ARM_SUFFIXES = {
    "unfused": (FUSED_ENV, "0"),  # a launch per projection
    "merged": (MERGED_SPLIT_SUM_ENV, "1"),  # a K split summed in the matmul launch
    "compiled": (COMPILE_ENV, "1"),  # bound matmuls replayed by mx.compile
    "uncompiled": (COMPILE_ENV, "0"),
    "unheld": (HELD_NORMS_ENV, "0"),  # norms add one to their weight every call
    "blocked": (COMPILED_BLOCKS_ENV, "1"),  # each MLP block as one compiled trace
    "unblocked": (COMPILED_BLOCKS_ENV, "0"),
    "folded": (FOLDED_OFFSET_ENV, "1"),  # 4-bit matmuls with the offset in the bias
    "waves": (WAVE_SPLIT_ENV, "1"),  # the wave-aware K split
    "kgroups2": (TWO_K_GROUPS_ENV, "1"),  # the matmul's two-K-group form (the default)
    "kgroups1": (TWO_K_GROUPS_ENV, "0"),  # one warp group a CTA
    "interleaved": (MEMBER_MAJOR_ENV, "0"),  # fused members' columns row by row
    "unprepared": (HEAD_PREP_ENV, "0"),  # q/k norms, scale and RoPE as mlx's five ops
    "residual": (
        RESIDUAL_NORMS_ENV,
        "1",
    ),  # post-norms, adds, pre-norm fused (eager too)
    "unresidual": (RESIDUAL_NORMS_ENV, "0"),  # mlx's norms and adds (before session 58)
    "unfetched": (
        PREFETCH_ENV,
        "0",
    ),  # no L2 prefetch of the MLP's weights (before s59)
    "fetched32": (PREFETCH_ENV, "32"),  # 32 MB of them asked for instead of 16
    "ungated": (GATE_EPILOGUE_ENV, "0"),  # Glimmer's gate as mlx's ops after attention
    "unstacked": (KV_BLOCK_ENV, "0"),  # the plane stacks k and v (two copies a layer)
    "swiglu": (SWIGLU_ENV, "1"),  # the MLP's silu and product in the gate/up launch
    "scaled": (SCALED_B_ENV, "1"),  # matmul weights as q * scale + bias (the default)
    "unscaled": (SCALED_B_ENV, "0"),  # x · q then the group's scale and bias terms
    "traced": (TRACED_LAYERS_ENV, "1"),  # served layer calls as two compiled replays
    "untraced": (TRACED_LAYERS_ENV, "0"),  # the eager layers
    "drafterqkv": (DRAFTER_QKV_ENV, "1"),  # the drafter's q / k / v as one stack
    "drafterheads": (DRAFTER_HEAD_PREP_ENV, "1"),  # its q / k norms and RoPE: a launch
    "draftermlx": (DRAFTER_DENSE_ENV, "0"),  # its bf16 projections on mlx's matmul
    "drafterkernel": (DRAFTER_DENSE_ENV, "1"),  # on our small-row kernel (before s47)
    "drafterreplay": (DRAFTER_TRACED_ENV, "1"),  # its layers as compiled replays
    "inplace": (DENORMAL_IN_PLACE_ENV, "1"),  # the denormal decode's pairs in place
    "shifted": (DENORMAL_IN_PLACE_ENV, "0"),  # its pairs shifted (before session 52)
    "persist": (PERSISTENT_ENV, "1"),  # multi-wave matmuls on resident CTAs (s56)
    "cluster": (CLUSTER_SUM_ENV, "1"),  # a K split summed in a cluster (graphs off)
    "uncluster": (CLUSTER_SUM_ENV, "0"),
    "wholekv": (STACKED_KV_ENV, "1"),  # planes and blocks bound stacked (session 66)
    # The head prep in the fused q / k / v / gate launch (session 79).
    "qkvprep": (PREPARED_HEADS_ENV, "1"),
}
# Suffixes that set several switches (each pair as above).
ARM_SUFFIX_SETS = {
    # The prepared q / k / v / gate launch with its split summed in a cluster.
    "clusterqkvprep": (ARM_SUFFIXES["cluster"], ARM_SUFFIXES["qkvprep"]),
    "drafter": (ARM_SUFFIXES["drafterqkv"], ARM_SUFFIXES["drafterheads"]),
    # The traced draft layers need the drafter's head prep.
    "draftertraced": (ARM_SUFFIXES["drafterheads"], ARM_SUFFIXES["drafterreplay"]),
    "drafterall": (
        ARM_SUFFIXES["drafterqkv"],
        ARM_SUFFIXES["drafterheads"],
        ARM_SUFFIXES["draftermlx"],
        ARM_SUFFIXES["drafterreplay"],
    ),
}


# Suffixes whose matmul forms are rebuilt for the arm's block (switches read at import,
# made in-process as matmul_variants does, so one process can alternate them): the
# ``matmul_variants.variant`` knobs each sets. Each knob's switch is set beside it (a
# kept trace is keyed by the DFLASH_* settings, so the arm's traces are its own).
ARM_MATMUL_FORMS = {
    "paired": {"paired": True},
    "lean": {"lean": True},
    "pairedlean": {"paired": True, "lean": True},
    # The 8-bit forms' byte decode without float32 (session 70; same bits).
    "leanbytes": {"lean_bytes": True},
    "floatbytes": {"lean_bytes": False},  # the float32 byte decode (before session 71)
    "unit": {"unit": True},  # the scales a unit of chunks a copy (session 53)
    # The scales as mlx lays them out (chunk-major, the default since session 54, off).
    "rowmajor": {"cmajor": False},
    # One scale copy a column (session 54). Not "-interleaved": that suffix already
    # named member-major off, and session 55's rounds under it set both.
    "ileave": {"interleaved": True},
    # Chunk-major scales without the interleaving: the A arm once interleaved scales are
    # the default (until then the default's forms, with its own traces).
    "cmajor": {"cmajor": True, "interleaved": False},
}
# Each suffix names one thing: a suffix in two tables would set both tables' switches.
_SHARED_SUFFIXES = (
    set(ARM_SUFFIXES) & set(ARM_SUFFIX_SETS)
    | set(ARM_SUFFIXES) & set(ARM_MATMUL_FORMS)
    | set(ARM_SUFFIX_SETS) & set(ARM_MATMUL_FORMS)
)
if _SHARED_SUFFIXES:
    raise RuntimeError(f"arm suffixes in two tables: {sorted(_SHARED_SUFFIXES)}")
MATMUL_KNOB_SWITCHES = {
    "paired": PAIRED_STAGE_ENV,
    "lean": LEAN_ISSUE_ENV,
    "lean_bytes": LEAN_BYTES_ENV,
    "unit": UNIT_SCALES_ENV,
    "cmajor": CHUNK_MAJOR_SCALES_ENV,
    "interleaved": INTERLEAVED_SCALES_ENV,
}


@contextmanager
def kernel_arm(arm: str) -> Iterator[None]:
    """The environment of ``--kernels`` arm ``arm`` for the block."""
    name = arm.rsplit("-", 1)[-1] if "-" in arm else None
    pairs = ARM_SUFFIX_SETS.get(name) or (
        (ARM_SUFFIXES[name],) if name in ARM_SUFFIXES else ()
    )
    with contextlib.ExitStack() as stack:
        stack.enter_context(env_value(VERIFY_KERNELS_ENV, KERNEL_ARMS[arm]))
        for pair in pairs:
            stack.enter_context(env_value(*pair))
        knobs = ARM_MATMUL_FORMS.get(name, {})
        for knob, on in knobs.items():
            stack.enter_context(env_value(MATMUL_KNOB_SWITCHES[knob], "01"[on]))
        if knobs:
            stack.enter_context(matmul_variants.variant(**knobs))
        yield


def folded_route(folded: Optional[bool]) -> AbstractContextManager:
    """Force the folded block attention on or off (None: the default) for A/B runs."""
    return env_value(FOLDED_ENV, None if folded is None else "1" if folded else "0")


def our_plain_tokens(model, prompt: mx.array, max_tokens: int) -> List[int]:
    """Our own plain greedy decoding (the verify kernels the environment asks for)."""
    steps = generate_step(prompt, model, max_tokens=max_tokens)
    return [int(token) for token, _ in steps]


class _Proxy:
    """``mlx.core`` with some attributes replaced (only the rounds module sees it)."""

    def __init__(self, module, **overrides) -> None:
        self._module = module
        self._overrides = overrides

    def __getattr__(self, name: str) -> Any:
        if name in self._overrides:
            return self._overrides[name]
        return getattr(self._module, name)


def summarize(rounds_: List[Dict[str, float]], skip: int) -> Dict[str, Any]:
    """Median milliseconds per phase over the rounds after ``skip`` warm-up rounds."""
    kept = rounds_[skip:]
    out: Dict[str, Any] = {"rounds": len(kept)}
    for phase in PHASES + ("round",):
        values = [1e3 * r.get(phase, 0.0) for r in kept]
        out[phase] = round(statistics.median(values), 3) if values else None
    if kept:
        host = [1e3 * (r["round"] - r.get("wait", 0.0)) for r in kept]
        known = [1e3 * sum(r.get(p, 0.0) for p in PHASES if p != "wait") for r in kept]
        out["host_not_waiting"] = round(statistics.median(host), 3)
        out["other"] = round(statistics.median(h - k for h, k in zip(host, known)), 3)
    return out


def scale_parser(prog: str, scale: str, context: int, max_tokens: int):
    """The flags both round profilers take: the scale pair, the prompt, the budget."""
    parser = argparse.ArgumentParser(prog=prog)
    parser.add_argument("--scale", choices=("full", "tiny"), default=scale)
    parser.add_argument("--quant", choices=QUANTS, default="bf16")
    parser.add_argument("--context", type=int, default=context)
    parser.add_argument("--max-tokens", type=int, default=max_tokens)
    parser.add_argument("--json", default=None)
    return parser


def scale_run(args: argparse.Namespace):
    """The scale pair, one seeded prompt and the target's greedy continuation of it.

    Returns:
        ``(model, drafter, prompt, continuation)``.
    """
    model, drafter = build_scale_pair(args.scale, args.quant, seed=0)
    prompt = scale_prompts(model, args.context, 1, seed=0)[0]
    continuation = greedy_reference(model, prompt, args.max_tokens)
    return model, drafter, prompt, continuation


def plain_divergences(
    model, prompt: mx.array, continuation: List[int], plain: Dict[str, List[int]]
) -> Dict[str, Dict[str, Any]]:
    """Where each arm's plain tokens first part from mlx-lm's, with mlx-lm's top-2 logit
    margin at that step (a near-tie when small); arms that agree are left out."""
    firsts = {
        arm: next(
            (i for i, (a, b) in enumerate(zip(tokens, continuation)) if a != b), None
        )
        for arm, tokens in plain.items()
    }
    parted = {arm: index for arm, index in firsts.items() if index is not None}
    if not parted:
        return {}
    # mlx-lm's greedy run again, with margins, only as far as the last parting.
    _, margins = greedy_reference_with_margins(model, prompt, max(parted.values()) + 1)
    return {
        arm: {
            "index": index,
            "ours": plain[arm][index],
            "mlx_lm": continuation[index],
            "mlx_lm_margin": round(float(margins[index]), 6),
        }
        for arm, index in parted.items()
    }


def run(args: argparse.Namespace) -> Dict[str, Any]:
    model, drafter, prompt, continuation = scale_run(args)
    block = drafter.config.block_size
    report: Dict[str, Any] = {
        "environment": environment("python -m benchmarks.round_profile"),
        "scale": args.scale,
        "quant": args.quant,
        "context": args.context,
        "taus": args.tau,
        "block_size": block,
        "max_tokens": args.max_tokens,
        "runs": [],
    }

    def generate(replay) -> List[int]:
        steps = dflash_generate_step(
            prompt, model, replay, block_size=block, max_tokens=args.max_tokens
        )
        return [token for token, _, _ in steps]

    arms = {"on": [True], "off": [False], "both": [True, False], None: [None]}
    variants = list(
        itertools.product(arms[args.start_early], arms[args.folded], args.kernels)
    )
    # Each kernel arm's own plain decoding (the default arm's too: the default installs
    # the kernels in plain decoding where it does in DFlash decoding): what its
    # speculative output must equal; each is also compared with mlx-lm's.
    plain = {}
    for kernels in args.kernels:
        with kernel_arm(kernels):
            plain[kernels] = our_plain_tokens(model, prompt, args.max_tokens)
    report["plain_equals_mlx_lm"] = {
        arm: tokens == continuation for arm, tokens in plain.items()
    }
    report["plain_divergences"] = plain_divergences(model, prompt, continuation, plain)
    for tau in args.tau:
        replay = ReplayDrafter(drafter, tau)
        for _, folded, kernels in variants:
            replay.sequence = prompt.tolist() + plain[kernels]
            with (
                folded_route(folded),
                kernel_arm(kernels),
            ):
                generate(replay)  # warm-up (kernels, graphs, attention plans)
        for _, (early, folded, kernels) in itertools.product(
            range(args.runs), variants
        ):
            clock = PhaseClock()
            replay.sequence = prompt.tolist() + plain[kernels]
            with (
                instrumented(clock, model),
                taps_starting_early(early),
                folded_route(folded),
                kernel_arm(kernels),
            ):
                tokens = generate(replay)
            result = {"tau": tau, "start_early": early, "folded": folded}
            result["kernels"] = kernels
            result.update(summarize(clock.rounds, args.skip))
            result["lossless"] = tokens == plain[kernels][: len(tokens)]
            report["runs"].append(result)
            print(json.dumps(result), flush=True)
    report["arms"] = compare_arms(report["runs"])
    for row in report["arms"]:
        print(json.dumps(row), flush=True)
    if getattr(args, "plain_time", False):
        report["plain_wall"] = plain_wall(args, model, prompt)
        for row in report["plain_wall"]:
            print(json.dumps(row), flush=True)
    if getattr(args, "device_time", False):
        report["device_time"] = device_report(args, model, prompt, replay, plain, block)
        for row in report["device_time"]:
            print(json.dumps({k: v for k, v in row.items() if k != "top"}), flush=True)
    if args.profile:
        # One generation per kernel arm, under that arm's switches (its own plain
        # continuation drives the replay, as in the timed runs).
        report["profile"] = {}
        for kernels in args.kernels:
            replay.sequence = prompt.tolist() + plain[kernels]
            with kernel_arm(kernels):
                report["profile"][kernels] = cprofile_text(
                    partial(generate, replay), args.profile
                )
    if getattr(args, "profile_plain", 0):
        report["plain_profile"] = {}
        for kernels in args.kernels:
            with kernel_arm(kernels):
                report["plain_profile"][kernels] = cprofile_text(
                    partial(our_plain_tokens, model, prompt, args.max_tokens),
                    args.profile_plain,
                )
    return report


def compare_arms(runs: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """Per variant (tau, start-early, folded, kernel arm), its runs' round medians.

    The host of a shared GPU machine drifts between runs by a third, so one run per
    arm decides nothing: the arms alternate run by run, and each row gives the
    median and the fastest of its runs' medians, and the ratio of its run to the
    first arm's run of the same pass, as a median and a count of wins.
    """
    keys = ("tau", "start_early", "folded", "kernels")
    grouped: Dict[tuple, List[float]] = {}
    for run_row in runs:
        # A run too short to time a round (``round`` None) decides nothing.
        if run_row["round"] is not None:
            key = tuple(run_row[k] for k in keys)
            grouped.setdefault(key, []).append(run_row["round"])
    rows, first = [], None
    for key, rounds_ms in grouped.items():
        row = dict(zip(keys, key))
        row.update(
            runs=len(rounds_ms),
            round_median=round(statistics.median(rounds_ms), 3),
            round_min=round(min(rounds_ms), 3),
        )
        if first is None or first[0][0] != key[0]:
            first = (key, rounds_ms)
        elif len(first[1]) == len(rounds_ms):
            ratios = [ours / base for ours, base in zip(rounds_ms, first[1])]
            row["vs"] = first[0][3]
            row["ratio_median"] = round(statistics.median(ratios), 3)
            row["faster_in"] = f"{sum(r < 1 for r in ratios)}/{len(ratios)}"
        rows.append(row)
    return rows


def cprofile_text(run: Callable[[], object], top: int) -> str:
    """cProfile's table of one call of ``run``: the ``top`` functions by own time."""
    profiler = cProfile.Profile()
    profiler.enable()
    run()
    profiler.disable()
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(top)
    return text.getvalue()


# Units (rounds or tokens) a device trace leaves out at the start of each run: the
# prefill and the first unit run, and the device drains, before the trace starts.
STEADY_SKIP = 1


def profiled(units: Iterator[object], skip: int) -> Tuple[int, list, list]:
    """The units of ``units`` past its first ``skip``, their device kernels and their
    CUDA API calls.

    The first ``skip`` units (and the prefill before them) run and the device drains
    before the trace starts: a one-off kernel's duration (the prefill's many-row
    matmuls and attention) varies from run to run, and in a difference of two runs
    divided by a few units it swamped the per-unit time (session 52).
    """
    for _ in itertools.islice(units, skip):
        pass
    mx.synchronize()
    box: Dict[str, int] = {}

    def rest() -> int:
        box["units"] = sum(1 for _ in units)
        mx.synchronize()
        return box["units"]

    kernels, api = cupti_trace(rest)
    return box["units"], kernels, api


def per_unit(
    run: Callable[[int], Iterator[object]],
    short: int,
    long: int,
    skip: int = STEADY_SKIP,
) -> Dict[str, Any]:
    """Kernels, device time and CUDA-graph API calls per unit: the difference of a
    short and a long run (``run(max_tokens)`` yields once a unit), each traced past its
    first ``skip`` units (steady state: the prefill is not traced, and the last units,
    shaped by ``max_tokens``, are in both runs).

    ``graph_api`` counts the graph calls per unit (instantiation, update, launch) and
    their host µs: a graph that fails to update is instantiated again. ``api_top`` is
    the twelve CUDA runtime / driver calls with the most host µs per unit, and
    ``api_host_ms`` the host time of all of them (what the host spends inside CUDA).
    ``top`` is the thirty kernel names launched most per unit and ``top_us`` the
    thirty with the most device µs per unit (where a switch's time went).
    """
    units_short, short_events, short_api = profiled(run(short), skip)
    units_long, long_events, long_api = profiled(run(long), skip)
    units = max(1, units_long - units_short)
    names = Counter(name[:90] for name, _, _ in long_events)
    names.subtract(name[:90] for name, _, _ in short_events)
    device_us: Counter = Counter()
    for events, sign in ((long_events, 1), (short_events, -1)):
        for name, _, duration in events:
            device_us[name[:90]] += sign * duration
    kernel_us = sum(device_us.values())
    api_calls: Dict[str, List[float]] = {}
    for events, sign in ((long_api, 1), (short_api, -1)):
        for name, _, duration in events:
            entry = api_calls.setdefault(name, [0.0, 0.0])
            entry[0] += sign
            entry[1] += sign * duration
    per_call = {
        name: {"calls": round(c / units, 2), "host_us": round(us / units, 1)}
        for name, (c, us) in sorted(api_calls.items())
    }
    by_host = sorted(per_call, key=lambda name: -per_call[name]["host_us"])
    return {
        "units": units,
        "kernels": round((len(long_events) - len(short_events)) / units, 1),
        "busy_ms": round(
            (busy_us(long_events) - busy_us(short_events)) / units / 1e3, 3
        ),
        "kernel_ms": round(kernel_us / units / 1e3, 3),
        "graph_api": {name: row for name, row in per_call.items() if "Graph" in name},
        "api_top": {name: per_call[name] for name in by_host[:12]},
        "api_host_ms": round(sum(row["host_us"] for row in per_call.values()) / 1e3, 3),
        "top": {n: round(c / units, 2) for n, c in names.most_common(30)},
        "top_us": {n: round(us / units, 1) for n, us in device_us.most_common(30)},
    }


def wall_ms_per_token(run: Callable[[int], int], short: int, long: int) -> float:
    """Wall milliseconds per token: the difference of a short and a long run (the
    prefill cancels), the smaller of two tries."""
    per_token = []
    for _ in range(2):
        start = time.perf_counter()
        short_tokens = run(short)
        middle = time.perf_counter()
        long_tokens = run(long)
        end = time.perf_counter()
        extra = max(1, long_tokens - short_tokens)
        per_token.append(1e3 * ((end - middle) - (middle - start)) / extra)
    return round(min(per_token), 3)


def _plain_runs(
    model, prompt
) -> Tuple[Callable[[int], Iterator], Callable[[int], Iterator]]:
    """mlx-lm's and our plain decoding of ``prompt``: ``max_tokens ->`` its steps (one
    a token)."""
    mlx_lm_generate = importlib.import_module("mlx_lm.generate")

    def mlx_lm_plain(max_tokens: int) -> Iterator:
        return mlx_lm_generate.generate_step(prompt, model, max_tokens=max_tokens)

    def ours_plain(max_tokens: int) -> Iterator:
        return generate_step(prompt, model, max_tokens=max_tokens)

    return mlx_lm_plain, ours_plain


def plain_wall(args, model, prompt) -> List[Dict[str, Any]]:
    """Plain decoding's wall time per token: mlx-lm's, and ours under each kernel arm.

    The median interval between tokens of one ``--max-tokens`` generation, past the
    first few (the difference of two whole generations, :func:`wall_ms_per_token`, is
    swamped by the variance of their prefills when the host sets the pace).
    """
    mlx_lm_steps, our_steps = _plain_runs(model, prompt)
    ms = yield_ms_per_token(mlx_lm_steps, args.max_tokens)
    rows = [{"run": "mlx-lm plain", "ms_per_token": ms}]
    for kernels in args.kernels:
        with kernel_arm(kernels):
            ms = yield_ms_per_token(our_steps, args.max_tokens)
        rows.append({"run": "ours plain", "kernels": kernels, "ms_per_token": ms})
    return rows


def yield_ms_per_token(steps: Callable[[int], Iterator], max_tokens: int) -> float:
    """Median ms between consecutive tokens of one generation, leaving out the first
    :data:`PLAIN_SKIP` intervals (fewer when the generation is short)."""
    stamps = [time.perf_counter() for _ in steps(max_tokens)]
    intervals = [b - a for a, b in zip(stamps, stamps[1:])]
    steady = intervals[PLAIN_SKIP:] or intervals
    return round(1e3 * statistics.median(steady), 3) if steady else 0.0


# Leading token intervals a plain-time median leaves out (the first launches).
PLAIN_SKIP = 3


def device_report(args, model, prompt, replay, plain, block) -> List[Dict[str, Any]]:
    """Device kernels per round (DFlash) and per token (plain), per kernel arm (CUPTI).

    ``replay`` is the REPLAY drafter of the last ``--tau``.
    """
    short, long = max(1, args.max_tokens // 2), args.max_tokens
    tau = replay.tau

    def dflash_rounds(kernels: str, max_tokens: int) -> Iterator[None]:
        """Yields at each round's end (its target-made token)."""
        replay.sequence = prompt.tolist() + plain[kernels]
        steps = dflash_generate_step(
            prompt, model, replay, block_size=block, max_tokens=max_tokens
        )
        return (None for _, _, from_draft in steps if not from_draft)

    mlx_lm_plain, ours_plain = _plain_runs(model, prompt)
    rows = [
        {"run": "mlx-lm plain", "unit": "token", **per_unit(mlx_lm_plain, short, long)}
    ]
    for kernels in args.kernels:
        with kernel_arm(kernels):
            for name, unit, run in (
                (f"dflash tau {tau}", "round", partial(dflash_rounds, kernels)),
                ("ours plain", "token", ours_plain),
            ):
                # "kernels" is per_unit's kernel count; the arm goes under "arm".
                row = {"run": name, "arm": kernels, "unit": unit}
                rows.append({**row, **per_unit(run, short, long)})
    return rows


def _kernel_arms(text: str) -> List[str]:
    arms = [arm.strip() for arm in text.split(",")]
    unknown = [arm for arm in arms if arm not in KERNEL_ARMS]
    if unknown:
        raise argparse.ArgumentTypeError(
            f"unknown kernel arm(s) {', '.join(unknown)}; choose from {', '.join(KERNEL_ARMS)}"
        )
    return arms


def main() -> None:
    parser = scale_parser("python -m benchmarks.round_profile", "tiny", 64, 96)
    parser.add_argument(
        "--tau", type=lambda text: [int(t) for t in text.split(",")], default=[6]
    )
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument("--skip", type=int, default=3, help="warm-up rounds per run")
    parser.add_argument("--start-early", choices=("on", "off", "both"), default="on")
    parser.add_argument(
        "--folded",
        choices=("on", "off", "both"),
        default=None,
        help="folded block attention (default: the backend's default)",
    )
    parser.add_argument(
        "--kernels",
        type=_kernel_arms,
        default=["default"],
        help="comma list of verify-kernel arms: " + ", ".join(KERNEL_ARMS),
    )
    parser.add_argument(
        "--profile",
        type=int,
        default=0,
        metavar="N",
        help="cProfile one DFlash generation under each kernel arm (top N by own time)",
    )
    parser.add_argument(
        "--profile-plain",
        type=int,
        default=0,
        metavar="N",
        help="cProfile our plain decoding under each kernel arm (top N by own time)",
    )
    parser.add_argument(
        "--plain-time",
        action="store_true",
        help="plain decoding's wall ms per token (median interval between tokens): "
        "mlx-lm's and ours per kernel arm",
    )
    parser.add_argument(
        "--device-time",
        action="store_true",
        help="kernels and device ms per round / token per arm (CUPTI; CUDA with torch)",
    )
    args = parser.parse_args()
    report = run(args)
    for arm, text in report.get("profile", {}).items():
        print(f"# DFlash rounds, kernels {arm}\n{text}")
    for arm, text in report.get("plain_profile", {}).items():
        print(f"# our plain decoding, kernels {arm}\n{text}")
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(report, handle, indent=1)


if __name__ == "__main__":
    main()
