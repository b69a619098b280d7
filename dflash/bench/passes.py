"""Interleaved passes over modes and prompts, and what they add up to.

Order: the target's greedy reference for every prompt (untimed: it carries the top-2
margins), a warm-up pass (every mode on the first prompt, not counted), then ``passes``
counted passes, each running every mode on every prompt (prompt-major; the mode order
rotates by one each pass so no mode always runs first). Speed-ups compare modes measured in
the same pass: the headline is the ratio of the median tokens/s over passes, the spread is
the min..max of the per-pass ratios.
"""

import statistics
import time
from typing import Any, Callable, Collection, Dict, List, Optional, Sequence

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.generate import generation_stream, wired_limit

from ..greedy import greedy_reference_with_margins
from ..inputs import resolve_block_size
from . import measure
from .prompts import check_prompt_set, encode_prompt, stop_tokens
from .runs import (
    BASE_MODES,
    CLASSIC,
    DFLASH,
    MLX_SPEC,
    NEEDS_DRAFT_MODEL,
    PLAIN,
    Mode,
    RunRecord,
    classic_mode,
    dflash_mode,
    mlx_spec_mode,
    plain_mode,
    replay_mode,
    timed_run,
)

DEFAULT_PASSES = 3
DEFAULT_SPLIT_REPS = 10
EDGE_ROUNDS = 20


def check_block_size(block_size: int, drafter: Any) -> int:
    """The bench's block size under the generator's rule (:func:`dflash.inputs.resolve_block_size`).

    Args:
        block_size: Requested block size ``B``.
        drafter: The DFlash drafter.

    Returns:
        ``block_size``.
    """
    return resolve_block_size(block_size, drafter, "block size")


def first_divergence(
    prompt_index: int,
    reference: Sequence[int],
    margins: Sequence[float],
    output: Sequence[int],
) -> Optional[Dict[str, Any]]:
    """The first position where ``output`` leaves ``reference``, if any.

    A length mismatch after an equal common prefix is a divergence at the end of
    the shorter one (the missing side is ``None``).

    Args:
        prompt_index: Index of the prompt in the set (copied into the record).
        reference: The target's greedy tokens.
        margins: The reference's top-2 logit margin at each of its positions.
        output: The tokens under test.

    Returns:
        ``{prompt_index, position, expected, got, margin}`` or ``None``.
    """
    common = min(len(reference), len(output))
    position = next(
        (i for i in range(common) if reference[i] != output[i]),
        None if len(reference) == len(output) else common,
    )
    if position is None:
        return None

    def at(values: Sequence, index: int):
        return values[index] if index < len(values) else None

    return {
        "prompt_index": prompt_index,
        "position": position,
        "expected": at(reference, position),
        "got": at(output, position),
        "margin": at(margins, position),
    }


def build_modes(
    model: nn.Module,
    drafter: Any,
    block_size: int,
    names: Sequence[str],
    replay_taus: Sequence[int] = (),
    draft_model: Optional[nn.Module] = None,
    num_draft_tokens: int = 3,
) -> List[Mode]:
    """The modes to run, plain decoding first.

    Args:
        model: The target.
        drafter: The DFlash drafter.
        block_size: DFlash block size.
        names: Base modes among ``plain``, ``dflash``, ``classic``, ``mlx-spec``.
        replay_taus: REPLAY profiles to add.
        draft_model: The classic draft model (``classic`` and ``mlx-spec`` need it).
        num_draft_tokens: Drafts per classic round.

    Returns:
        The modes.

    Raises:
        ValueError: an unknown or repeated mode, a draft-model mode without one, a
            replay tau outside ``1..block_size``, ``num_draft_tokens < 1``.
    """
    unknown = [n for n in names if n not in BASE_MODES]
    if unknown or len(set(names)) != len(names) or not names:
        raise ValueError(
            f"modes must be distinct names among {', '.join(BASE_MODES)}, got "
            f"{', '.join(names) or 'none'}"
        )
    needs = [n for n in names if n in NEEDS_DRAFT_MODEL]
    if needs and draft_model is None:
        raise ValueError(f"mode {needs[0]} needs a draft model (--draft-model)")
    if needs and num_draft_tokens < 1:
        raise ValueError(f"num_draft_tokens must be >= 1, got {num_draft_tokens}")
    bad = [t for t in replay_taus if not 1 <= t <= block_size]
    if bad or len(set(replay_taus)) != len(replay_taus):
        raise ValueError(
            f"replay taus must be distinct values in 1..{block_size} (the block size), "
            f"got {list(replay_taus)}"
        )
    makers: Dict[str, Callable[[], Mode]] = {
        PLAIN: lambda: plain_mode(model),
        DFLASH: lambda: dflash_mode(model, drafter, block_size),
        CLASSIC: lambda: classic_mode(model, draft_model, num_draft_tokens),
        MLX_SPEC: lambda: mlx_spec_mode(model, draft_model, num_draft_tokens),
    }
    ordered = [n for n in BASE_MODES if n in names]
    modes = [makers[n]() for n in ordered]
    modes += [replay_mode(model, drafter, block_size, tau) for tau in replay_taus]
    return modes


class _Progress:
    """A tqdm bar over runs on stderr, or nothing."""

    def __init__(self, total: int, enabled: bool) -> None:
        self.bar = None
        if enabled:
            import sys

            from tqdm import tqdm

            self.bar = tqdm(
                total=total, desc="dflash-bench", unit="run", file=sys.stderr
            )

    def step(self, text: str) -> None:
        if self.bar is not None:
            self.bar.set_postfix_str(text, refresh=False)
            self.bar.update(1)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def run_bench(
    model: nn.Module,
    tokenizer: Any,
    drafter: Any,
    prompts: Sequence[Any],
    *,
    max_tokens: int,
    block_size: Optional[int] = None,
    progress: bool = False,
    modes: Sequence[str] = (PLAIN, DFLASH),
    replay_taus: Sequence[int] = (),
    draft_model: Optional[nn.Module] = None,
    num_draft_tokens: int = 3,
    passes: int = DEFAULT_PASSES,
    split_reps: int = DEFAULT_SPLIT_REPS,
    bandwidth_tbs: float = measure.DEFAULT_BANDWIDTH_TBS,
    overhead_reps: int = 0,
    record_prompts: bool = True,
) -> Dict[str, Any]:
    """Benchmark the modes against each other and against the target's greedy output.

    Args:
        model: The target mlx-lm model.
        tokenizer: Its tokenizer (text prompts are encoded raw, no chat template; its
            end-of-sequence ids stop a run); ``None`` for token-id prompts.
        drafter: A DFlash drafter bound to ``model``.
        prompts: Prompt texts or token-id lists (a list, never a file name).
        max_tokens: Tokens to generate per run at most.
        block_size: DFlash block size; default the drafter's.
        progress: Show a progress bar on stderr.
        modes: Base modes (see :func:`build_modes`).
        replay_taus: REPLAY profiles (each a ``replay-tauN`` mode).
        draft_model: Draft model of ``classic`` / ``mlx-spec``.
        num_draft_tokens: Drafts per classic round.
        passes: Counted passes (a warm-up pass runs first).
        split_reps: Repetitions of each eval-timed round part (0: skip the split).
        bandwidth_tbs: Memory bandwidth for the plain step's bound, TB/s.
        overhead_reps: Pairs of bare vs bench-drained runs for the A/B overhead check
            (0: skip it).
        record_prompts: Put the prompts' token ids in the report (``prompt_token_ids``),
            so another process can run the very same prompts.

    Returns:
        A JSON-serialisable report (see ``docs/benchmarks/README.md``).

    Raises:
        TypeError: ``prompts`` is a string or path.
        ValueError: empty prompt set or prompt, ``max_tokens < 1``, ``passes < 1``, a
            block size the drafter cannot serve, bad modes.
    """
    check_prompt_set(prompts)
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be > 0, got {max_tokens}")
    if passes < 1:
        raise ValueError(f"passes must be >= 1, got {passes}")
    block_size = check_block_size(
        drafter.config.block_size if block_size is None else block_size, drafter
    )
    mode_list = build_modes(
        model,
        drafter,
        block_size,
        list(modes),
        list(replay_taus),
        draft_model,
        num_draft_tokens,
    )
    encoded = [encode_prompt(tokenizer, p, i) for i, p in enumerate(prompts)]
    stop = stop_tokens(tokenizer) if tokenizer is not None else set()
    total = len(encoded) + len(mode_list) * (1 + passes * len(encoded))
    bar = _Progress(total, progress)
    try:
        with wired_limit(model, [generation_stream]):
            state = _Runner(model, mode_list, encoded, max_tokens, stop, bar)
            state.references()
            state.warm_up()
            for index in range(passes):
                state.one_pass(index)
    finally:
        bar.close()
    report = summarize_runs(state, block_size, max_tokens, passes, num_draft_tokens)
    report["stop_tokens"] = sorted(stop)
    if record_prompts:
        report["prompt_token_ids"] = [p.tolist() for p in encoded]
    _measure(report, state, model, drafter, block_size, split_reps, bandwidth_tbs)
    if overhead_reps > 0:
        report["overhead"]["ab"] = _ab(state, overhead_reps)
    return report


class _Runner:
    """The runs of one bench, kept by mode and pass."""

    def __init__(self, model, modes, prompts, max_tokens, stop, bar) -> None:
        self.model = model
        self.modes: List[Mode] = modes
        self.prompts: List[mx.array] = prompts
        self.max_tokens = max_tokens
        self.stop: Collection[int] = stop
        self.bar = bar
        self.refs: List[List[int]] = []
        self.margins: List[List[float]] = []
        self.reference_seconds = 0.0
        self.records: Dict[str, List[List[RunRecord]]] = {m.name: [] for m in modes}
        self.errors: Dict[str, str] = {}

    def references(self) -> None:
        for prompt in self.prompts:
            start = time.perf_counter()
            tokens, margins = greedy_reference_with_margins(
                self.model, prompt, self.max_tokens, self.stop
            )
            self.reference_seconds += time.perf_counter() - start
            self.refs.append(tokens)
            self.margins.append(margins)
            self.bar.step("reference")

    @property
    def prompt_sizes(self) -> List[int]:
        return [int(p.size) for p in self.prompts]

    def sequence(self, index: int) -> List[int]:
        return self.prompts[index].tolist() + self.refs[index]

    def run(self, mode: Mode, index: int) -> Optional[RunRecord]:
        if mode.name in self.errors:
            return None
        try:
            record = timed_run(
                mode,
                self.prompts[index],
                self.max_tokens,
                self.stop,
                self.sequence(index),
            )
        except Exception as error:  # noqa: BLE001 (reported as the mode's result)
            if not mode.tolerate_errors:
                raise
            self.errors[mode.name] = f"{type(error).__name__}: {error}".splitlines()[0]
            return None
        finally:
            self.bar.step(mode.name)
        return record

    def warm_up(self) -> None:
        for mode in self.modes:
            self.run(mode, 0)

    def one_pass(self, index: int) -> None:
        shift = index % len(self.modes)
        order = self.modes[shift:] + self.modes[:shift]
        runs: Dict[str, List[RunRecord]] = {m.name: [] for m in self.modes}
        for prompt_index in range(len(self.prompts)):
            for mode in order:
                record = self.run(mode, prompt_index)
                if record is not None:
                    runs[mode.name].append(record)
        for name, records in runs.items():
            if len(records) == len(self.prompts):
                self.records[name].append(records)


def _tokens_per_s(records: Sequence[RunRecord]) -> Optional[float]:
    tokens = sum(r.decode_tokens for r in records)
    seconds = sum(r.decode_seconds for r in records)
    return tokens / seconds if tokens > 0 and seconds > 0 else None


def _spread(values: Sequence[Optional[float]]) -> Dict[str, Any]:
    kept = [v for v in values if v is not None]
    if not kept:
        return {"median": None, "min": None, "max": None, "per_pass": list(values)}
    return {
        "median": statistics.median(kept),
        "min": min(kept),
        "max": max(kept),
        "per_pass": list(values),
    }


def _acceptance(mode: Mode, records: Sequence[RunRecord]) -> Dict[str, Any]:
    accepted = [n for r in records for n in r.accepted[r.prefill_rounds :]]
    tokens = sum(
        len(r.tokens) - sum(n + 1 for n in r.accepted[: r.prefill_rounds])
        for r in records
    )
    rounds = len(accepted)
    width = mode.drafts_per_round
    histogram = [0] * (width + 1)
    for n in accepted:
        histogram[min(n, width)] += 1
    curve = [
        sum(n >= i for n in accepted) / rounds if rounds else 0.0
        for i in range(1, width + 1)
    ]
    return {
        "rounds": rounds,
        "tau": tokens / rounds if rounds else 0.0,
        "histogram": histogram,
        "position_acceptance": curve,
    }


def _round_ms(records: Sequence[RunRecord]) -> Dict[str, Optional[float]]:
    every = [s for r in records for s in r.round_seconds]
    early = [s for r in records for s in r.round_seconds[:EDGE_ROUNDS]]
    late = [s for r in records for s in r.round_seconds[-EDGE_ROUNDS:]]

    def med(values):
        return 1e3 * statistics.median(values) if values else None

    return {"median": med(every), "first_20": med(early), "last_20": med(late)}


def _mode_report(state: Any, mode: Mode, plain_tps: List[Optional[float]]):
    passes = state.records[mode.name]
    tps = [_tokens_per_s(records) for records in passes]
    out: Dict[str, Any] = {"label": mode.label, "error": state.errors.get(mode.name)}
    out["tokens_per_s"] = _spread(tps)
    if plain_tps and mode.name != PLAIN:
        ratios = [
            t / p if t is not None and p else None for t, p in zip(tps, plain_tps)
        ]
        spread = _spread(ratios)
        plain_median = _spread(plain_tps)["median"]
        mine = out["tokens_per_s"]["median"]
        spread["ratio_of_medians"] = (
            mine / plain_median if mine is not None and plain_median else None
        )
        out["speedup"] = spread
    every = [r for records in passes for r in records]
    out["peak_memory_gb"] = max((r.peak_memory for r in every), default=0) / 1e9
    out["round_ms"] = _round_ms(every)
    first = passes[0] if passes else []
    out["generated_tokens"] = sum(len(r.tokens) for r in first)
    if mode.speculative:
        out.update(_acceptance(mode, first))
    divergences = []
    for pass_index, records in enumerate(passes):
        for index, record in enumerate(records):
            found = first_divergence(
                index, state.refs[index], state.margins[index], record.tokens
            )
            if found is not None:
                divergences.append(dict(found, pass_index=pass_index))
    out["divergences"] = divergences
    out["divergence_count"] = len(divergences)
    out["prompts_diverging"] = len({d["prompt_index"] for d in divergences})
    return out


def summarize_runs(
    state: Any, block_size: int, max_tokens: int, passes: int, num_draft: int
) -> Dict[str, Any]:
    """The report of a set of runs (also used for runs recorded in another process).

    Args:
        state: Has ``modes`` (:class:`Mode`), ``records`` (mode name -> per-pass lists of
            :class:`RunRecord`), ``errors``, ``refs`` and ``margins`` (per prompt),
            ``prompt_sizes`` and ``reference_seconds``.
        block_size: DFlash block size.
        max_tokens: Token budget per run.
        passes: Counted passes.
        num_draft: Drafts per classic round.

    Returns:
        The report without the measurements of :func:`run_bench`'s last steps.
    """
    plain = state.records.get(PLAIN)
    plain_tps = [_tokens_per_s(r) for r in plain] if plain else []
    modes = {m.name: _mode_report(state, m, plain_tps) for m in state.modes}
    report: Dict[str, Any] = {
        "prompts": len(state.prompt_sizes),
        "mean_prompt_tokens": sum(state.prompt_sizes) / len(state.prompt_sizes),
        "reference_tokens": sum(len(r) for r in state.refs),
        "reference_seconds": state.reference_seconds,
        "block_size": block_size,
        "max_tokens": max_tokens,
        "passes": passes,
        "num_draft_tokens": num_draft,
        "mode_order": [m.name for m in state.modes],
        "modes": modes,
    }
    if DFLASH in modes:
        # The τ / losslessness fields dflash-bench has always reported (DFlash mode).
        dflash = modes[DFLASH]
        for key in ("rounds", "tau", "histogram", "position_acceptance"):
            report[key] = dflash[key]
        report["generated_tokens"] = dflash["generated_tokens"]
        report["divergences"] = dflash["divergences"]
        report["divergence_count"] = dflash["divergence_count"]
    return report


def _measure(report, state, model, drafter, block_size, split_reps, bandwidth_tbs):
    """Round split, plain step vs the bandwidth bound, and the bench's own overhead."""
    taus = [m.replay.tau for m in state.modes if m.replay is not None]
    split = None
    if split_reps > 0:
        split = measure.round_split(
            model,
            drafter,
            state.prompts[0],
            state.refs[0],
            block_size,
            split_reps,
            replay_tau=taus[0] if taus else None,
        )
        rounds = {}
        for mode in state.modes:
            loop = report["modes"][mode.name]["round_ms"]["median"]
            if mode.name in (DFLASH,) or mode.replay is not None:
                rounds[mode.name] = {
                    "round_ms": loop,
                    "rest_ms": (
                        None
                        if loop is None
                        else loop - split["drafter_ms"] - split["verify_ms"]
                    ),
                }
        split["rounds"] = rounds
        report["bandwidth"] = measure.bandwidth_bound(
            model, split["kv_bytes"], bandwidth_tbs
        )
        plain = report["modes"].get(PLAIN)
        if plain is not None:
            report["bandwidth"]["plain_decode_ms"] = plain["round_ms"]["median"]
        report["bandwidth"]["plain_step_ms"] = split["plain_step_ms"]
    report["split"] = split
    report["overhead"] = _overhead(report, split)


def _overhead(report, split) -> Dict[str, Any]:
    per_token_us = measure.bookkeeping_us_per_token()
    fastest = [
        1e6 / m["tokens_per_s"]["median"]
        for m in report["modes"].values()
        if m["tokens_per_s"]["median"]
    ]
    out: Dict[str, Any] = {
        "bookkeeping_us_per_token": per_token_us,
        "bookkeeping_fraction": per_token_us / min(fastest) if fastest else None,
    }
    if split is not None and split.get("drafter_replay_ms") is not None:
        extra = max(0.0, split["drafter_replay_ms"] - split["drafter_ms"])
        rounds = [
            r["round_ms"]
            for name, r in split["rounds"].items()
            if name.startswith("replay") and r["round_ms"]
        ]
        out["replay_ms_per_round"] = extra
        out["replay_fraction"] = extra / min(rounds) if rounds else None
    return out


def _ab(state: _Runner, reps: int) -> Dict[str, Any]:
    out = {}
    for mode in state.modes:
        if mode.name not in (PLAIN, DFLASH) or mode.name in state.errors:
            continue
        prompt = state.prompts[0]
        out[mode.name] = measure.ab_overhead(
            lambda: mode.steps(prompt, state.max_tokens), state.max_tokens, (), reps
        )
    return out
