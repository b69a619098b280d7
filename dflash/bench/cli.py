"""``dflash-bench`` (``python -m dflash.bench``): speed, τ and losslessness, side by side.

Pair mode (the bundled demo pair, or ``--model`` + ``--drafter``): prompts from a JSON-lines
file. Scale mode (``--scale full|tiny``): a random-weight Muse Glimmer target (bf16 or
4-bit) and a random drafter, random prompts of ``--context`` tokens, and REPLAY profiles.
Any failure prints one line ``dflash-bench: error: ...`` and exits non-zero.
"""

import argparse
import json
import shlex
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Callable, Dict, List, Optional, Sequence

from ..cli.common import OneLineParser, flag_type, integer, run_cli
from . import plots, scale_target
from .measure import DEFAULT_BANDWIDTH_TBS
from .passes import DEFAULT_PASSES, DEFAULT_SPLIT_REPS, check_block_size, run_bench
from .prompts import default_prompts_path, read_prompts
from .report import environment, format_summary
from .runs import BASE_MODES, DFLASH, NEEDS_DRAFT_MODEL, PLAIN

PROG = "dflash-bench"
DESCRIPTION = (
    "Benchmark DFlash against plain decoding (and classic speculative decoding): "
    "tokens/s, speed-up, tau, acceptance, peak memory, and divergences from the "
    "target's own greedy output."
)
DEFAULT_MAX_TOKENS = 256
SCALE_MAX_TOKENS = {"full": 256, "tiny": 32}
SCALE_REPLAY_TAUS = (2, 4, 6, 8)
SCALE_ONLY = ("quant", "context", "num_prompts", "seed")
PAIR_ONLY = ("model", "drafter", "prompts", "limit", "draft_model")


# A bandwidth may be any number above 0; the replay taus are a comma-separated list.
_positive_float = flag_type(float, "a number > 0", lambda value: value > 0)
_integers = flag_type(
    lambda text: [int(part) for part in text.split(",")],
    "comma-separated integers such as 2,4,6,8",
)


def _modes(text: str) -> List[str]:
    names = [part.strip() for part in text.split(",")]
    if not names or any(name not in BASE_MODES for name in names):
        raise argparse.ArgumentTypeError(
            f"expected comma-separated modes among {','.join(BASE_MODES)}, got {text!r}"
        )
    return names


def build_parser() -> argparse.ArgumentParser:
    """The ``dflash-bench`` argument parser.

    Returns:
        The parser.
    """
    parser = OneLineParser(prog=PROG, description=DESCRIPTION)
    pair = parser.add_argument_group("pair mode (default: the bundled demo pair)")
    pair.add_argument("--model", help="target model path or repo")
    pair.add_argument("--drafter", help="DFlash drafter for --model (required with it)")
    pair.add_argument(
        "--draft-model", help="classic draft model (modes classic, mlx-spec)"
    )
    pair.add_argument(
        "--prompts",
        type=Path,
        help="JSON lines with a 'prompt' field (default: the held-out demo set)",
    )
    pair.add_argument("--limit", type=integer(1), help="use the first N prompts")
    scale = parser.add_argument_group("scale mode (random weights, no download)")
    scale.add_argument(
        "--scale",
        choices=sorted(scale_target.GEOMETRIES),
        help="full-size Muse Glimmer (52 layers) or a tiny one for CPU checks",
    )
    scale.add_argument("--quant", choices=scale_target.QUANTS, help="default bf16")
    scale.add_argument(
        "--context", type=integer(2), help="prompt tokens (default 4096; tiny 64)"
    )
    scale.add_argument(
        "--num-prompts", type=integer(1), help="random prompts (default 1)"
    )
    scale.add_argument(
        "--seed", type=integer(0), help="weight and prompt seed (default 0)"
    )
    run = parser.add_argument_group("what to run")
    run.add_argument(
        "--modes",
        type=_modes,
        help="comma-separated among plain,dflash,classic,mlx-spec (default plain,dflash; "
        "with --draft-model also classic,mlx-spec; scale mode: plain)",
    )
    run.add_argument(
        "--replay-tau",
        type=_integers,
        help="REPLAY profiles, e.g. 2,4,6,8 (default in scale mode: 2,4,6,8)",
    )
    run.add_argument("--max-tokens", type=integer(1), help="default 256; tiny scale 32")
    run.add_argument("--block-size", type=integer(1), help="default: the drafter's")
    run.add_argument("--num-draft-tokens", type=integer(1), default=3)
    run.add_argument("--passes", type=integer(1), default=DEFAULT_PASSES)
    run.add_argument(
        "--split-reps",
        type=integer(0),
        default=DEFAULT_SPLIT_REPS,
        help="repetitions of each eval-timed round part (0: no split)",
    )
    run.add_argument(
        "--overhead-reps",
        type=integer(0),
        default=0,
        help="pairs of bare vs bench-drained runs (A/B overhead check; 0: off)",
    )
    run.add_argument(
        "--bandwidth-tbs",
        type=_positive_float,
        default=DEFAULT_BANDWIDTH_TBS,
        help=f"memory bandwidth for the plain step's bound (default {DEFAULT_BANDWIDTH_TBS})",
    )
    out = parser.add_argument_group("output")
    out.add_argument("--json", type=Path, help="write the report to this file")
    out.add_argument(
        "--plot", type=Path, help="write PNGs into this folder (matplotlib)"
    )
    out.add_argument(
        "--save-drafter",
        type=Path,
        help="also save the drafter in the public DFlash layout here (for the peer)",
    )
    out.add_argument("--quiet", action="store_true", help="no progress bar")
    return parser


def _check_flags(args: argparse.Namespace) -> None:
    """Refuse flag combinations that cannot mean anything, before loading anything."""
    if args.scale is not None:
        given = [n for n in PAIR_ONLY if getattr(args, n) is not None]
        if given:
            raise ValueError(
                f"--{given[0].replace('_', '-')} does not apply to --scale"
            )
    else:
        given = [n for n in SCALE_ONLY if getattr(args, n) is not None]
        if given:
            raise ValueError(f"--{given[0].replace('_', '-')} needs --scale")
        if args.model is None and args.drafter is not None:
            raise ValueError(
                "--drafter needs --model (without --model the demo pair is used)"
            )
        if args.model is not None and args.drafter is None:
            raise ValueError("--drafter is required with --model")
    modes = args.modes or []
    needs = [m for m in modes if m in NEEDS_DRAFT_MODEL]
    if needs and args.draft_model is None:
        raise ValueError(f"mode {needs[0]} needs --draft-model")
    for flag in ("json", "save_drafter"):
        path = getattr(args, flag)
        if path is not None and not path.resolve().parent.is_dir():
            raise FileNotFoundError(
                f"--{flag.replace('_', '-')} folder does not exist: {path.parent}"
            )
    if args.plot is not None:
        plots.require_matplotlib()
    for flag in ("model", "drafter", "draft_model"):
        _check_local_path(flag, getattr(args, flag))


def _check_local_path(flag: str, name: Optional[str]) -> None:
    """A name that can only be a local path must exist (else: not a hub repo id)."""
    if name is None or Path(name).expanduser().exists():
        return
    hub_like = name.count("/") <= 1 and not name.startswith(("/", ".", "~"))
    if not hub_like:
        raise FileNotFoundError(
            f"--{flag.replace('_', '-')} path does not exist: {name}"
        )


def _mode_names(args: argparse.Namespace) -> List[str]:
    if args.modes is not None:
        return args.modes
    if args.scale is not None:
        # A random drafter's own proposals are all but never accepted (tau ~ 1): at scale
        # the REPLAY modes run its forward; add dflash with --modes plain,dflash.
        return [PLAIN]
    names = [PLAIN, DFLASH]
    return names + list(NEEDS_DRAFT_MODEL) if args.draft_model is not None else names


def _load_pair(args: argparse.Namespace) -> Dict[str, Any]:
    """Target, tokenizer, drafter, prompts and a description, from the flags."""
    if args.scale is not None:
        return _load_scale(args)
    from .. import demo

    if args.model is None:
        root = demo.check_demo_files()
        prompts_path = args.prompts or default_prompts_path()
        prompts = read_prompts(prompts_path, args.limit)
        model, tokenizer, drafter = demo.load_demo()
        print(
            f"{PROG}: no --model given; using the bundled demo pair "
            f"({demo.DEMO_DESCRIPTION}, {demo.DEMO_DIR})",
            file=sys.stderr,
        )
        names = (str(root / "target"), str(root / "drafter"))
    else:
        prompts_path = args.prompts or default_prompts_path()
        prompts = read_prompts(prompts_path, args.limit)
        from mlx_lm import load

        from ..loader import load_drafter

        model, tokenizer = load(args.model)
        drafter = load_drafter(args.drafter, model)
        names = (args.model, args.drafter)
    if args.block_size is not None:
        check_block_size(args.block_size, drafter)
    pair = {
        "model": model,
        "tokenizer": tokenizer,
        "drafter": drafter,
        "prompts": prompts,
        "describe": f"{names[0]} + drafter {names[1]}",
        "info": {
            "model": names[0],
            "drafter": names[1],
            "prompts_file": str(prompts_path),
        },
    }
    if args.draft_model is not None:
        from mlx_lm import load

        pair["draft_model"] = load(args.draft_model)[0]
        pair["info"]["draft_model"] = args.draft_model
    return pair


def _load_scale(args: argparse.Namespace) -> Dict[str, Any]:
    from .scale import (
        DEFAULT_CONTEXT,
        build_scale_pair,
        drafter_block_size,
        scale_prompts,
    )

    if args.block_size is not None:
        # Checked before the (large) drafter is built, under the generator's rule.
        limit = SimpleNamespace(
            config=SimpleNamespace(block_size=drafter_block_size(args.scale))
        )
        check_block_size(args.block_size, limit)
    quant, seed = args.quant or "bf16", args.seed or 0
    context = args.context or DEFAULT_CONTEXT[args.scale]
    model, drafter = build_scale_pair(args.scale, quant, seed)
    prompts = scale_prompts(model, context, args.num_prompts or 1, seed)
    info = {"scale": args.scale, "quant": quant, "context": context, "seed": seed}
    describe = (
        f"SCALE {args.scale} Muse Glimmer, random {quant} weights (seed {seed}), random "
        f"drafter; {context}-token random prompts"
    )
    return {
        "model": model,
        "tokenizer": None,
        "drafter": drafter,
        "prompts": prompts,
        "describe": describe,
        "info": info,
    }


def save_public_drafter(drafter: Any, model: Any, path: Path) -> Path:
    """Save ``drafter`` in the public DFlash layout, target-derived fields filled in.

    The public loader needs ``vocab_size`` and ``num_target_layers`` and applies the logit
    multiplier and soft-cap only when the config names them; fields the drafter leaves to
    its target are set from ``model.args`` (the same values the bound drafter uses).

    Args:
        drafter: The bound drafter.
        model: Its target.
        path: Output folder.

    Returns:
        The folder.
    """
    from dataclasses import replace

    from ..loader import save_drafter
    from ..taps import target_layers

    cfg, args = drafter.config, getattr(model, "args", None)
    filled = {
        "vocab_size": cfg.vocab_size or getattr(args, "vocab_size", None),
        "num_target_layers": cfg.num_target_layers or len(target_layers(model)),
        "output_multiplier": drafter.logit_multiplier,
        "final_logit_softcapping": drafter.logit_softcap,
    }
    drafter.config = replace(cfg, **{k: v for k, v in filled.items() if v is not None})
    try:
        return save_drafter(drafter, path, format="dflash")
    finally:
        drafter.config = cfg


def run(args: argparse.Namespace) -> Dict[str, Any]:
    """Load, bench, print and optionally save the report, plots and drafter.

    Args:
        args: Parsed ``dflash-bench`` flags.

    Returns:
        The report as written with ``--json``.
    """
    _check_flags(args)
    pair = _load_pair(args)
    replay = args.replay_tau
    if replay is None:
        replay = list(SCALE_REPLAY_TAUS) if args.scale is not None else []
    max_tokens = args.max_tokens
    if max_tokens is None:
        max_tokens = SCALE_MAX_TOKENS[args.scale] if args.scale else DEFAULT_MAX_TOKENS
    if args.save_drafter is not None:
        save_public_drafter(pair["drafter"], pair["model"], args.save_drafter)
    report = run_bench(
        pair["model"],
        pair["tokenizer"],
        pair["drafter"],
        pair["prompts"],
        max_tokens=max_tokens,
        block_size=args.block_size,
        progress=not args.quiet,
        modes=_mode_names(args),
        replay_taus=replay,
        draft_model=pair.get("draft_model"),
        num_draft_tokens=args.num_draft_tokens,
        passes=args.passes,
        split_reps=args.split_reps,
        bandwidth_tbs=args.bandwidth_tbs,
        overhead_reps=args.overhead_reps,
        record_prompts=args.scale is None,
    )
    from .scale import geometry_summary

    report.update(pair["info"])
    report["pair"] = pair["describe"]
    report["kind"] = "scale" if args.scale else "pair"
    report["geometry"] = geometry_summary(pair["model"])
    report["environment"] = environment(args.command)
    if args.json is not None:
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    if args.plot is not None:
        plots.write_plots(report, args.plot)
    print(format_summary(report))
    return report


def main(argv: Optional[Sequence[str]] = None) -> None:
    """Entry point of ``dflash-bench``: one line and a non-zero exit on any failure.

    Args:
        argv: The flags (default ``sys.argv[1:]``).
    """
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser().parse_args(argv)
    args.command = shlex.join([PROG, *argv])
    run_cli(PROG, run, args)
