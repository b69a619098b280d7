"""``dflash-bench`` (``python -m dflash.bench``): τ and a losslessness check.

For each prompt (tokenized raw, no chat template) the target's own greedy output is
computed with mlx-lm's plain machinery (``mlx_lm.generate.generate_step`` on mlx-lm's
own prompt cache, argmax sampler), then DFlash generates the same number of tokens at
temperature 0. Both stop after ``max_tokens`` tokens or after an end-of-sequence token
(kept as the last token). The outputs are compared token by token; the first mismatch
of a prompt (or a length mismatch) is a divergence, reported with the reference's
top-2 logit margin there. Wall-clock times are informational only.

Any failure prints one line ``dflash-bench: error: ...`` and exits non-zero.
"""

import argparse
import datetime
import json
import platform
import shlex
import sys
import time
from pathlib import Path
from typing import Any, Callable, Collection, Dict, List, Optional, Sequence, Tuple

import mlx.core as mx
import mlx.nn as nn

from . import demo
from .block_decode import GenerationStats, dflash_generate_step
from .reference import greedy_reference_with_margins

PROG = "dflash-bench"
DESCRIPTION = (
    "Measure DFlash acceptance (tau) on a prompt set and check the output equals the "
    "target's own greedy output."
)
DEFAULT_MAX_TOKENS = 256
PACKAGED_PROMPTS = "bench-prompts.jsonl"
REPO_PROMPTS = Path("configs") / "bench" / "heldout.jsonl"


def default_prompts_path() -> Path:
    """The default prompt set: the packaged copy if installed, else the repo's file.

    Returns:
        ``dflash/demo/bench-prompts.jsonl`` when present, else
        ``<repo root>/configs/bench/heldout.jsonl`` (which may not exist).
    """
    packaged = demo.DEMO_DIR / PACKAGED_PROMPTS
    if packaged.is_file():
        return packaged
    return Path(__file__).resolve().parent.parent / REPO_PROMPTS


def read_prompts(path: Path, limit: Optional[int] = None) -> List[str]:
    """Read the ``prompt`` field of each JSON line of ``path``.

    Blank lines are skipped; other fields are ignored.

    Args:
        path: A JSON-lines file.
        limit: Keep only the first ``limit`` prompts.

    Returns:
        The prompt texts, in file order.

    Raises:
        FileNotFoundError: ``path`` is not a file.
        ValueError: a line is not JSON or has no ``prompt`` string (the message
            names the line), or the file holds no prompts.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"prompts file not found: {path}")
    prompts = []
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        if line.strip():
            prompts.append(_parse_prompt_line(path, number, line))
    if not prompts:
        raise ValueError(f"{path} holds no prompts")
    return prompts[:limit] if limit is not None else prompts


def _parse_prompt_line(path: Path, number: int, line: str) -> str:
    try:
        record = json.loads(line)
    except json.JSONDecodeError as err:
        raise ValueError(f"{path}:{number}: not valid JSON ({err.msg})") from err
    prompt = record.get("prompt") if isinstance(record, dict) else None
    if not isinstance(prompt, str):
        raise ValueError(f"{path}:{number}: no 'prompt' string field")
    return prompt


def stop_tokens(tokenizer: Any) -> Collection[int]:
    """The end-of-sequence token ids of an mlx-lm or Hugging Face tokenizer.

    Args:
        tokenizer: ``mlx_lm``'s ``TokenizerWrapper`` or a Hugging Face tokenizer.

    Returns:
        The ids that end a generation (possibly none).
    """
    ids = getattr(tokenizer, "eos_token_ids", None)
    if ids is None:
        ids = getattr(tokenizer, "eos_token_id", None)
    if ids is None:
        return set()
    return {int(ids)} if isinstance(ids, int) else {int(i) for i in ids}


def _take(tokens, max_tokens: int, stop: Collection[int]) -> List[int]:
    """The first ``max_tokens`` tokens, ending after the first stop token."""
    out: List[int] = []
    for token in tokens:
        out.append(int(token))
        if len(out) == max_tokens or out[-1] in stop:
            break
    return out


def dflash_tokens(
    model: nn.Module,
    drafter: nn.Module,
    prompt: mx.array,
    *,
    max_tokens: int,
    block_size: int,
    stats: GenerationStats,
    stop: Collection[int] = (),
) -> List[int]:
    """DFlash's greedy output under the bench's stopping rule.

    Args:
        model: The target model.
        drafter: A DFlash drafter bound to ``model``.
        prompt: The prompt tokens.
        max_tokens: Tokens to generate at most.
        block_size: DFlash block size.
        stats: Statistics shared across prompts (rounds and acceptance are added).
        stop: End-of-sequence ids; the stop token is kept as the last token.

    Returns:
        The generated tokens.

    Shapes:
        prompt: ``(P,)``.
    """
    steps = dflash_generate_step(
        prompt,
        model,
        drafter,
        block_size=block_size,
        max_tokens=max_tokens,
        stats=stats,
    )
    return _take((token for token, _, _ in steps), max_tokens, stop)


def _first_mismatch(reference: Sequence[int], output: Sequence[int]) -> Optional[int]:
    common = min(len(reference), len(output))
    for index in range(common):
        if reference[index] != output[index]:
            return index
    return None if len(reference) == len(output) else common


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
    position = _first_mismatch(reference, output)
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


def _check_settings(prompts: Sequence[str], max_tokens: int, block_size: int) -> None:
    if not prompts:
        raise ValueError("the prompt set is empty")
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be > 0, got {max_tokens}")
    if block_size < 2:
        raise ValueError(f"block_size must be >= 2, got {block_size}")


def _encode(tokenizer: Any, text: str, index: int) -> mx.array:
    tokens = tokenizer.encode(text)
    if len(tokens) == 0:
        raise ValueError(f"prompt {index} encodes to no tokens")
    return mx.array(tokens, mx.uint32)


def _timed(function: Callable, *args, **kwargs):
    start = time.perf_counter()
    result = function(*args, **kwargs)
    return result, time.perf_counter() - start


def _progress(items: Sequence, enabled: bool):
    if not enabled:
        return items
    from tqdm import tqdm

    return tqdm(items, desc=PROG, unit="prompt", file=sys.stderr)


def run_bench(
    model: nn.Module,
    tokenizer: Any,
    drafter: nn.Module,
    prompts: Sequence[str],
    *,
    max_tokens: int,
    block_size: Optional[int] = None,
    progress: bool = False,
) -> Dict[str, Any]:
    """Run the target's greedy reference and DFlash on each prompt and compare them.

    Args:
        model: The target mlx-lm model.
        tokenizer: Its tokenizer (prompts are encoded raw, no chat template).
        drafter: A DFlash drafter bound to ``model``.
        prompts: Prompt texts.
        max_tokens: Tokens to generate per prompt at most.
        block_size: DFlash block size; default the drafter's.
        progress: Show a progress bar over prompts on stderr.

    Returns:
        A JSON-serialisable report: ``prompts``, ``mean_prompt_tokens``,
        ``generated_tokens``, ``reference_tokens``, ``rounds``, ``tau``,
        ``histogram``, ``position_acceptance``, ``divergences``,
        ``divergence_count``, ``block_size``, ``max_tokens``,
        ``reference_seconds``, ``dflash_seconds``.

    Raises:
        ValueError: empty prompt set or prompt, ``max_tokens < 1``,
            ``block_size < 2``.
    """
    block_size = drafter.config.block_size if block_size is None else block_size
    _check_settings(prompts, max_tokens, block_size)
    stop = stop_tokens(tokenizer)
    stats = GenerationStats(block_size)
    divergences: List[Dict[str, Any]] = []
    totals = {"prompt": 0, "reference": 0, "dflash": 0}
    seconds = {"reference": 0.0, "dflash": 0.0}
    for index, text in enumerate(_progress(prompts, progress)):
        prompt = _encode(tokenizer, text, index)
        (reference, margins), ref_time = _timed(
            greedy_reference_with_margins, model, prompt, max_tokens, stop
        )
        output, dflash_time = _timed(
            dflash_tokens,
            model,
            drafter,
            prompt,
            max_tokens=max_tokens,
            block_size=block_size,
            stats=stats,
            stop=stop,
        )
        divergence = first_divergence(index, reference, margins, output)
        if divergence is not None:
            divergences.append(divergence)
        totals["prompt"] += prompt.size
        totals["reference"] += len(reference)
        totals["dflash"] += len(output)
        seconds["reference"] += ref_time
        seconds["dflash"] += dflash_time
    return {
        "prompts": len(prompts),
        "mean_prompt_tokens": totals["prompt"] / len(prompts),
        "generated_tokens": totals["dflash"],
        "reference_tokens": totals["reference"],
        "rounds": stats.rounds,
        "tau": stats.tau,
        "histogram": stats.histogram,
        "position_acceptance": stats.position_acceptance,
        "divergences": divergences,
        "divergence_count": len(divergences),
        "block_size": block_size,
        "max_tokens": max_tokens,
        "reference_seconds": seconds["reference"],
        "dflash_seconds": seconds["dflash"],
    }


def format_summary(report: Dict[str, Any]) -> str:
    """A short human-readable summary of a :func:`run_bench` report.

    Args:
        report: The report.

    Returns:
        A few lines of text (no trailing newline).
    """
    histogram = " ".join(f"{n}:{c}" for n, c in enumerate(report["histogram"]) if c)
    curve = " ".join(f"{rate:.2f}" for rate in report["position_acceptance"])
    lines = [
        f"{report['prompts']} prompts (mean {report['mean_prompt_tokens']:.1f} "
        f"prompt tokens), {report['generated_tokens']} generated tokens, "
        f"block {report['block_size']}",
        f"tau {report['tau']:.3f} tokens/round over {report['rounds']} rounds",
        f"accepted drafts per round (n:rounds): {histogram}",
        f"acceptance by draft position 1..{report['block_size'] - 1}: {curve}",
        f"divergences from the target's greedy output: {report['divergence_count']}",
    ]
    lines += [_divergence_line(record) for record in report["divergences"]]
    lines.append(
        f"wall clock (informational): reference {report['reference_seconds']:.2f} s, "
        f"dflash {report['dflash_seconds']:.2f} s"
    )
    return "\n".join(lines)


def _divergence_line(record: Dict[str, Any]) -> str:
    margin = record["margin"]
    shown = "n/a" if margin is None else f"{margin:.3g}"
    return (
        f"  prompt {record['prompt_index']}, position {record['position']}: expected "
        f"{record['expected']}, got {record['got']} (top-2 margin {shown})"
    )


class _Parser(argparse.ArgumentParser):
    """An argument parser whose errors are one line, not usage plus a message."""

    def error(self, message: str) -> None:
        self.exit(2, f"{PROG}: error: {message}\n")


def _at_least(minimum: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be >= {minimum}, got {text}")
        return value

    return parse


def build_parser() -> argparse.ArgumentParser:
    """The ``dflash-bench`` argument parser.

    Returns:
        The parser.
    """
    parser = _Parser(prog=PROG, description=DESCRIPTION)
    parser.add_argument(
        "--model", help="target model path or repo (default: the bundled demo target)"
    )
    parser.add_argument(
        "--drafter",
        help="DFlash drafter for --model (required with --model; default: the demo's)",
    )
    parser.add_argument(
        "--prompts",
        type=Path,
        default=None,
        help="JSON lines with a 'prompt' field (default: the held-out demo set)",
    )
    parser.add_argument("--limit", type=_at_least(1), help="use the first N prompts")
    parser.add_argument("--max-tokens", type=_at_least(1), default=DEFAULT_MAX_TOKENS)
    parser.add_argument(
        "--block-size", type=_at_least(2), help="default: the drafter's block size"
    )
    parser.add_argument("--json", type=Path, help="write the report to this file")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    return parser


def _pair_names(args: argparse.Namespace) -> Tuple[str, str]:
    """The target and drafter the flags name (the demo pair's without --model)."""
    if args.model is None:
        if args.drafter is not None:
            raise ValueError(
                "--drafter needs --model (without --model the demo pair is used)"
            )
        root = demo.check_demo_files()
        return str(root / "target"), str(root / "drafter")
    if args.drafter is None:
        raise ValueError("--drafter is required with --model")
    return args.model, args.drafter


def _load_pair(args: argparse.Namespace):
    """``(model, tokenizer, drafter)`` from the flags; the demo pair without --model."""
    if args.model is None:
        pair = demo.load_demo()
        print(
            f"{PROG}: no --model given; using the bundled demo pair "
            f"({demo.DEMO_DESCRIPTION}, {demo.DEMO_DIR})",
            file=sys.stderr,
        )
        return pair
    from mlx_lm import load

    from .loader import load_drafter

    model, tokenizer = load(args.model)
    return model, tokenizer, load_drafter(args.drafter, model)


def _machine() -> str:
    return (
        f"{platform.platform()} ({platform.machine()}), mlx {mx.__version__}, "
        f"default device {mx.default_device()}"
    )


def run(args: argparse.Namespace) -> Dict[str, Any]:
    """Read the prompts, load the pair, bench it, print and optionally save a report.

    Args:
        args: Parsed ``dflash-bench`` flags.

    Returns:
        The report as written with ``--json``.
    """
    model_name, drafter_name = _pair_names(args)
    prompts_path = args.prompts or default_prompts_path()
    prompts = read_prompts(prompts_path, args.limit)
    if args.json is not None and not args.json.resolve().parent.is_dir():
        raise FileNotFoundError(f"--json folder does not exist: {args.json.parent}")
    model, tokenizer, drafter = _load_pair(args)
    report = run_bench(
        model,
        tokenizer,
        drafter,
        prompts,
        max_tokens=args.max_tokens,
        block_size=args.block_size,
        progress=not args.quiet,
    )
    report.update(
        date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        command=args.command,
        machine=_machine(),
        model=model_name,
        drafter=drafter_name,
        prompts_file=str(prompts_path),
    )
    if args.json is not None:
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    print(format_summary(report))
    return report


def _one_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


def main(argv: Optional[List[str]] = None) -> None:
    """Entry point of ``dflash-bench``: one line and a non-zero exit on any failure.

    Args:
        argv: The flags (default ``sys.argv[1:]``).
    """
    args = build_parser().parse_args(argv)
    args.command = shlex.join([PROG, *(sys.argv[1:] if argv is None else argv)])
    try:
        run(args)
    except KeyboardInterrupt:
        sys.exit(130)
    except Exception as error:  # the CLI's contract: one clear line, no traceback
        print(f"{PROG}: error: {_one_line(error)}", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
