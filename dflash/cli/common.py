"""What the command-line tools share: one-line errors, flag types, model loading, statistics.

The CLI contract: any failure prints exactly one line ``<prog>: error: <message>`` on stderr and
exits non-zero, without a traceback; a closed output pipe (``dflash-generate | head``) ends the
run quietly.
"""

import argparse
import json
import math
import os
import sys
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, List, Optional, Tuple

# The name a session or prompt-cache file records for the bundled demo pair (a resolved
# local path always starts with "/" and a hub repo id always holds one "/": no clash).
DEMO_NAME = "demo"
EXIT_ERROR = 1
EXIT_USAGE = 2
EXIT_BROKEN_PIPE = 128 + 13  # what a shell reports for a tool ended by SIGPIPE
EXIT_INTERRUPTED = 128 + 2


class OneLineParser(argparse.ArgumentParser):
    """An argument parser whose errors are one line, not usage plus a message."""

    def error(self, message: str) -> None:
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message}\n")


def flag_type(
    convert: Callable[[str], Any],
    wanted: str,
    accept: Optional[Callable[[Any], bool]] = None,
) -> Callable[[str], Any]:
    """An argparse type whose error says what was expected: ``expected <wanted>, got ...``.

    Args:
        convert: Turns the text into the value (``ValueError`` for text it cannot read).
        wanted: What the flag takes, e.g. ``"an integer >= 1"``.
        accept: Whether a converted value is in range (default: every value).

    Returns:
        The parse function.
    """

    def parse(text: str) -> Any:
        try:
            value = convert(text)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"expected {wanted}, got {text!r}"
            ) from None
        if accept is not None and not accept(value):
            raise argparse.ArgumentTypeError(f"expected {wanted}, got {text}")
        return value

    return parse


def integer(minimum: int) -> Callable[[str], int]:
    """An argparse type: an integer ``>= minimum``, with a message saying what was expected.

    Args:
        minimum: The smallest accepted value.

    Returns:
        The parse function.
    """
    return flag_type(int, f"an integer >= {minimum}", lambda value: value >= minimum)


def number(minimum: Optional[float] = None) -> Callable[[str], float]:
    """An argparse type: a finite number, ``>= minimum`` when one is given.

    Args:
        minimum: The smallest accepted value, or ``None``.

    Returns:
        The parse function.
    """
    if minimum is None:
        return flag_type(float, "a number", math.isfinite)
    wanted = f"a number >= {minimum:g}"
    return flag_type(float, wanted, lambda v: math.isfinite(v) and v >= minimum)


def one_line(error: BaseException) -> str:
    """The first line of an error's message (its type name when the message is empty).

    Args:
        error: Any exception.

    Returns:
        One line of text.
    """
    text = str(error).strip()
    if isinstance(error, KeyError) and text:
        return f"missing key {text}"
    return text.splitlines()[0] if text else type(error).__name__


def _quiet_stdout() -> None:
    """Point stdout at /dev/null so Python's exit-time flush does not hit the closed pipe."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())


def run_cli(prog: str, function: Callable[[argparse.Namespace], Any], args) -> None:
    """Run a CLI body under the CLI contract (one line and a non-zero exit on any failure).

    Args:
        prog: The program name for the error line.
        function: The body, called with ``args``.
        args: The parsed flags.
    """
    try:
        function(args)
        sys.stdout.flush()
    except BrokenPipeError:
        _quiet_stdout()
        sys.exit(EXIT_BROKEN_PIPE)
    except KeyboardInterrupt:
        sys.exit(EXIT_INTERRUPTED)
    except Exception as error:  # the contract: one clear line, no traceback
        print(f"{prog}: error: {one_line(error)}", file=sys.stderr)
        sys.exit(EXIT_ERROR)


def entry_point(
    prog: str,
    build_parser: Callable[[], argparse.ArgumentParser],
    function: Callable[[argparse.Namespace], Any],
) -> Callable[[Optional[List[str]]], None]:
    """The ``main(argv=None)`` of a CLI: parse the flags, then :func:`run_cli` the body.

    Args:
        prog: The program name for the error line.
        build_parser: Makes the CLI's parser.
        function: The body, called with the parsed flags.

    Returns:
        ``main``, whose ``argv`` defaults to ``sys.argv[1:]``.
    """

    def main(argv: Optional[List[str]] = None) -> None:
        args = build_parser().parse_args(sys.argv[1:] if argv is None else argv)
        run_cli(prog, function, args)

    main.__doc__ = (
        f"Entry point of ``{prog}``: one line and a non-zero exit on any failure.\n\n"
        "Args:\n    argv: The flags (default ``sys.argv[1:]``).\n"
    )
    return main


# -- models -------------------------------------------------------------------------------


def check_model_name(flag: str, name: str) -> None:
    """Refuse a name that can only be a local path when that path is not a directory.

    A name that is valid as a Hugging Face repo id (``org/model``) is left to the hub.

    Args:
        flag: The flag that gave the name (for the message).
        name: A local directory or a hub repo id.

    Raises:
        FileNotFoundError: the path does not exist, or is not a directory.
    """
    path = Path(name).expanduser()
    if path.exists():
        if not path.is_dir():
            raise FileNotFoundError(f"{flag} {name}: not a directory")
        return
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    try:
        validate_repo_id(name)
    except HFValidationError:
        raise FileNotFoundError(f"{flag} {name}: no such directory") from None


def model_identity(name: str) -> str:
    """The name a saved file records for a model: a local directory's absolute path, else the
    repo id as given.

    Args:
        name: A local directory or a hub repo id.

    Returns:
        The name to record and compare.
    """
    path = Path(name).expanduser()
    return str(path.resolve()) if path.is_dir() else name


def _hub_unreachable(error: BaseException) -> str:
    from huggingface_hub.errors import OfflineModeIsEnabled

    causes = [error.__cause__, error.__context__]
    if any(isinstance(cause, OfflineModeIsEnabled) for cause in causes):
        return "the Hugging Face hub is off (HF_HUB_OFFLINE is set)"
    return "the Hugging Face hub cannot be reached"


@contextmanager
def hub_errors(flag: str, name: str) -> Iterator[None]:
    """Turn a failed hub look-up while loading ``name`` into one line that says what failed.

    Args:
        flag: The flag that gave the name.
        name: The repo id being loaded.

    Raises:
        FileNotFoundError: the hub is unreachable (or off) and the model is not in the local
            cache, or the hub has no such repository.
    """
    from huggingface_hub import constants
    from huggingface_hub.errors import (
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    try:
        yield
    except LocalEntryNotFoundError as error:
        raise FileNotFoundError(
            f"{flag} {name}: not a local directory; {_hub_unreachable(error)} and {name} is "
            f"not in the local Hugging Face cache ({constants.HF_HUB_CACHE})"
        ) from error
    except (RepositoryNotFoundError, RevisionNotFoundError) as error:
        raise FileNotFoundError(
            f"{flag} {name}: not a local directory, and the Hugging Face hub has no "
            "such model (or it is private or gated)"
        ) from error


def load_target(flag: str, name: str, tokenizer_config: Optional[dict] = None):
    """``mlx_lm.load`` with one-line errors for a missing path or an unreachable hub.

    Args:
        flag: The flag that gave the name.
        name: A local model directory or a hub repo id.
        tokenizer_config: Passed to ``mlx_lm.load``.

    Returns:
        ``(model, tokenizer)``.
    """
    from mlx_lm import load

    check_model_name(flag, name)
    with hub_errors(flag, name):
        return load(name, tokenizer_config=tokenizer_config)


def names_of(model: Optional[str], drafter: Optional[str]) -> Tuple[str, Optional[str]]:
    """The names saved files record for ``--model`` / ``--drafter`` (before loading them).

    Args:
        model: ``--model``, or ``None`` for the bundled demo pair.
        drafter: ``--drafter``, or ``None``.

    Returns:
        ``(model name, drafter name or None)``; the demo pair is ``(DEMO_NAME, DEMO_NAME)``.
    """
    if model is None:
        return DEMO_NAME, DEMO_NAME
    return model_identity(model), model_identity(drafter) if drafter else None


@dataclass
class Models:
    """What a CLI run generates with.

    Attributes:
        model: The target model.
        tokenizer: Its tokenizer (mlx-lm's ``TokenizerWrapper``).
        drafter: The DFlash drafter, or ``None``.
        draft_model: The classic draft model, or ``None``.
        model_name: The target's name for saved files (:data:`DEMO_NAME` for the demo pair).
        drafter_name: The drafter's name for saved files, or ``None``.
        notice: A line for stderr once the run is set to go (the demo pair's announcement):
            printed late, so that a refused setting is still the only line on stderr.
    """

    model: Any
    tokenizer: Any
    drafter: Any = None
    draft_model: Any = None
    model_name: str = DEMO_NAME
    drafter_name: Optional[str] = None
    notice: Optional[str] = None

    def announce(self) -> None:
        """Print :attr:`notice` (once) on stderr."""
        if self.notice:
            print(self.notice, file=sys.stderr)
            self.notice = None


def target_prefers_direct_launches(model: Optional[str]) -> bool:
    """Whether ``--model``'s DFlash rounds measured faster with direct launches than
    with mlx's CUDA graphs, read from its ``config.json`` before anything loads (what
    :func:`dflash.prefer_direct_launches` needs, before mlx's first GPU evaluation).

    They are where the round is paced by the host: dflash's own quantized matmul runs
    on CUDA (by default, or as ``DFLASH_VERIFY_KERNELS`` asks) in a form where direct
    launches measured faster (:data:`dflash.kernel_patch.
    DIRECT_LAUNCHES_BY_QUANTIZATION`: 4-bit, groups of 64, Muse Glimmer). Elsewhere
    mlx's graphs measured faster: a bf16 target (session 69), an 8-bit one with mlx's
    matmuls (session 70) and with dflash's (session 71), all on an H100; other forms
    keep them: 4-bit groups of 128 and of 32 were not separated from them (sessions
    75-77), and the rest are not measured.

    A local directory, or a hub model whose config is already in the local cache, is
    read; nothing is downloaded. A config not at hand or not readable, or a
    ``DFLASH_VERIFY_KERNELS`` that is not a valid value, gives True (direct launches,
    the commands' choice before session 69): the load that follows reports what is
    wrong.

    Args:
        model: ``--model``, or ``None`` for the bundled demo pair.

    Returns:
        True where the target's rounds measured faster with direct launches, or where
        its config is unknown.
    """
    from .. import kernel_patch

    config_file = _target_config_file(model)
    if config_file is None:
        return True
    try:
        config = json.loads(config_file.read_bytes())
    except (OSError, ValueError, RecursionError):
        return True
    if not isinstance(config, dict):
        return True
    form = config_projection_form(config)
    try:
        return kernel_patch.prefers_direct_launches(
            config_architecture(config), form, "cuda"
        )
    except ValueError:  # a bad DFLASH_VERIFY_KERNELS: the load reports it
        return True


def config_projection_form(config: dict) -> Optional[Tuple[Any, ...]]:
    """The projection form a model's ``config.json`` gives mlx-lm's load, as
    :func:`dflash.kernel_patch.projection_form` reads it off the loaded model.

    Args:
        config: The parsed ``config.json``.

    Returns:
        ``("affine", bits, group_size)`` when mlx-lm quantizes every projection in that
        one affine form (its ``quantization`` entry, per-layer entries agreeing, the
        embedding's aside);
        ``("dense", None)`` with no quantization entry; None for anything else (a layer
        left dense or quantized otherwise, another mode, a legacy
        ``quantization_config`` that mlx-lm converts). A layer that mlx-lm's
        ``quantize_model`` left dense without naming it is not seen: the load decides
        that from the weights, which are not read here.
    """
    quantization = config.get("quantization")
    if quantization is None:
        legacy = config.get("quantization_config")
        text_config = config.get("text_config")
        if legacy is None and isinstance(text_config, dict):
            legacy = text_config.get("quantization_config")
        return ("dense", None) if legacy is None else None
    if not isinstance(quantization, dict):
        return None
    form = _affine_form(quantization)
    for key, entry in quantization.items():
        # The embedding is no projection: its own form changes no matmul.
        if key in ("group_size", "bits", "mode") or key.endswith("embed_tokens"):
            continue
        if entry is False or (isinstance(entry, dict) and _affine_form(entry) != form):
            return None
    return form


def _affine_form(entry: dict) -> Optional[Tuple[Any, ...]]:
    """``("affine", bits, group_size)`` of one quantization entry, None if not affine."""
    bits, group_size = entry.get("bits"), entry.get("group_size")
    if entry.get("mode", "affine") != "affine":
        return None
    if not all(
        isinstance(v, int) and not isinstance(v, bool) for v in (bits, group_size)
    ):
        return None
    return ("affine", bits, group_size)


def config_architecture(config: dict) -> Optional[str]:
    """The mlx-lm module a ``config.json`` loads as (``model_type`` remapped the way
    mlx-lm's load remaps it), the name :func:`dflash.kernel_patch.architecture` gives.
    """
    from mlx_lm import utils as mlx_lm_utils

    model_type = config.get("model_type")
    if not isinstance(model_type, str):
        return None
    architectures = config.get("architectures") or ()
    if isinstance(architectures, str):
        architectures = (architectures,)
    by_architecture = getattr(mlx_lm_utils, "MODEL_ARCHITECTURE_REMAPPING", {})
    for name in architectures if isinstance(architectures, (list, tuple)) else ():
        if isinstance(name, str) and (model_type, name) in by_architecture:
            return by_architecture[(model_type, name)]
    return mlx_lm_utils.MODEL_REMAPPING.get(model_type, model_type)


def _target_config_file(model: Optional[str]) -> Optional[Path]:
    """Where ``--model``'s ``config.json`` is on this machine, without downloading."""
    if model is None:
        from ..demo import DEMO_DIR

        return DEMO_DIR / "target" / "config.json"
    path = Path(model).expanduser()
    if path.is_dir():
        return path / "config.json"
    from huggingface_hub import try_to_load_from_cache

    try:
        cached = try_to_load_from_cache(model, "config.json")
    except ValueError:  # not a repo id: the load refuses it with its own message
        return None
    return Path(cached) if isinstance(cached, str) else None


def load_models(
    prog: str,
    model: Optional[str],
    drafter: Optional[str] = None,
    draft_model: Optional[str] = None,
    tokenizer_config: Optional[dict] = None,
) -> Models:
    """Load the target and its drafter or draft model; the demo pair when ``model`` is ``None``.

    Every name is checked before anything is loaded, so a typo fails at once.

    Args:
        prog: The program name (for the demo pair's announcement, :attr:`Models.notice`).
        model: ``--model``, or ``None`` for the bundled demo pair.
        drafter: ``--drafter``.
        draft_model: ``--draft-model``.
        tokenizer_config: Passed to ``mlx_lm.load`` for the target.

    Returns:
        The loaded :class:`Models`.
    """
    if drafter and draft_model:
        raise ValueError("use --drafter (DFlash) or --draft-model, not both")
    if model is None:
        return _load_demo_pair(prog, drafter, draft_model)
    for flag, name in (
        ("--model", model),
        ("--drafter", drafter),
        ("--draft-model", draft_model),
    ):
        if name:
            check_model_name(flag, name)
    target, tokenizer = load_target("--model", model, tokenizer_config)
    model_name, drafter_name = names_of(model, drafter)
    loaded = Models(target, tokenizer, model_name=model_name, drafter_name=drafter_name)
    if drafter:
        from .. import load_drafter

        with hub_errors("--drafter", drafter):
            loaded.drafter = load_drafter(drafter, target)
    if draft_model:
        loaded.draft_model, draft_tokenizer = load_target("--draft-model", draft_model)
        if draft_tokenizer.vocab_size != tokenizer.vocab_size:
            raise ValueError(
                f"--draft-model {draft_model} has a tokenizer of {draft_tokenizer.vocab_size} "
                f"tokens, the target's has {tokenizer.vocab_size}: they must match"
            )
    return loaded


def _load_demo_pair(
    prog: str, drafter: Optional[str], draft_model: Optional[str]
) -> Models:
    from .. import demo

    for flag, value in (("--draft-model", draft_model), ("--drafter", drafter)):
        if value:
            raise ValueError(
                f"{flag} needs --model (without --model the bundled demo pair is used)"
            )
    model, tokenizer, drafter_model = demo.load_demo()
    notice = (
        f"{prog}: no --model given; using the bundled demo pair "
        f"({demo.DEMO_DESCRIPTION}, {demo.DEMO_DIR})"
    )
    return Models(
        model, tokenizer, drafter_model, drafter_name=DEMO_NAME, notice=notice
    )


def check_block_size(block_size: Optional[int], drafter: Any) -> int:
    """``--block-size`` under the generator's rule (:func:`dflash.inputs.resolve_block_size`).

    Args:
        block_size: The requested size, or ``None`` for the drafter's.
        drafter: A DFlash drafter.

    Returns:
        The block size.
    """
    from ..inputs import resolve_block_size

    return resolve_block_size(block_size, drafter, "--block-size")


def make_cli_sampler(args: argparse.Namespace, tokenizer: Any = None):
    """``dflash.make_sampler`` from the sampling flags, called as mlx-lm's CLIs call it.

    Called once without a tokenizer before any model loads (so a bad setting fails at once),
    then with the tokenizer, whose newline and end-of-sequence ids XTC never removes.

    Args:
        args: Flags with ``temp``, ``top_p``, ``xtc_probability``, ``xtc_threshold`` and
            optionally ``min_p``, ``top_k``, ``min_tokens_to_keep``.
        tokenizer: mlx-lm's ``TokenizerWrapper``, or ``None``.

    Returns:
        The sampler.
    """
    from .. import make_sampler

    special = None
    if tokenizer is not None:
        special = tokenizer.encode("\n") + list(tokenizer.eos_token_ids)
    return make_sampler(
        args.temp,
        args.top_p,
        getattr(args, "min_p", 0.0),
        getattr(args, "min_tokens_to_keep", 1),
        top_k=getattr(args, "top_k", 0),
        xtc_probability=args.xtc_probability,
        xtc_threshold=args.xtc_threshold,
        xtc_special_tokens=special,
    )


def add_sampling_flags(parser: argparse.ArgumentParser, full: bool = True) -> None:
    """The sampling flags of mlx-lm's CLIs (``full``: generate's set, else chat's).

    Args:
        parser: The parser to extend.
        full: Also add ``--min-p``, ``--top-k`` and ``--min-tokens-to-keep``.
    """
    parser.add_argument(
        "--temp", type=number(0.0), default=0.0, help="sampling temperature"
    )
    parser.add_argument("--top-p", type=number(0.0), default=1.0, help="sampling top-p")
    if full:
        parser.add_argument(
            "--min-p", type=number(0.0), default=0.0, help="sampling min-p"
        )
        parser.add_argument(
            "--top-k", type=integer(0), default=0, help="sampling top-k"
        )
    parser.add_argument(
        "--xtc-probability",
        type=number(0.0),
        default=0.0,
        help="probability of XTC sampling at each token (drafts are then checked by the "
        "sample-match rule, still lossless)",
    )
    parser.add_argument(
        "--xtc-threshold",
        type=number(0.0),
        default=0.1,
        help="XTC's probability threshold",
    )
    if full:
        parser.add_argument(
            "--min-tokens-to-keep",
            type=integer(1),
            default=1,
            help="minimum tokens to keep for min-p sampling",
        )


def add_model_flag(
    parser: argparse.ArgumentParser,
    text: str = "local path or Hugging Face repo of the model (default: the bundled demo pair)",
) -> None:
    """``--model``: the target, a local directory or a hub repo id (none: the demo pair).

    Args:
        parser: The parser to extend.
        text: The flag's help text.
    """
    parser.add_argument("--model", help=text)


def add_drafter_flags(parser: argparse.ArgumentParser) -> None:
    """``--drafter`` and ``--block-size``: the DFlash drafter and its block size.

    Args:
        parser: The parser to extend.
    """
    parser.add_argument(
        "--drafter", help="path or repo of a DFlash drafter for --model"
    )
    parser.add_argument(
        "--block-size",
        type=integer(1),
        default=None,
        help="DFlash block size, 1 up to the drafter's (default: the drafter's)",
    )


def add_prefill_flag(
    parser: argparse.ArgumentParser, text: str = "prompt tokens per forward"
) -> None:
    """``--prefill-step-size`` (mlx-lm's default, 2048).

    Args:
        parser: The parser to extend.
        text: The flag's help text.
    """
    parser.add_argument("--prefill-step-size", type=integer(1), default=2048, help=text)


def add_cache_flags(parser: argparse.ArgumentParser) -> None:
    """mlx-lm's KV-cache flags, checked by :func:`check_cache_flags`."""
    parser.add_argument(
        "--max-kv-size",
        type=integer(1),
        default=None,
        help="accepted at or above the model's sliding windows (a no-op, as in mlx-lm for "
        "such models); dflash caches never evict context",
    )
    parser.add_argument(
        "--kv-bits",
        type=integer(1),
        default=None,
        help="not supported: dflash caches keep exact rows",
    )


def check_cache_flags(args: argparse.Namespace, model: Any) -> None:
    """``--max-kv-size`` / ``--kv-bits`` under the generators' own rule
    (``dflash.inputs.check_cache_options``).

    Args:
        args: The parsed flags.
        model: The target model.
    """
    from ..inputs import check_cache_options

    check_cache_options(model, args.kv_bits, args.max_kv_size)


# -- prompts ------------------------------------------------------------------------------


def read_prompt(text: str) -> str:
    """A prompt flag's text: ``-`` reads stdin; ``\\n`` and ``\\t`` escapes are expanded (as
    mlx-lm's generate does).

    Args:
        text: The flag's value.

    Returns:
        The prompt text.
    """
    text = text.replace("\\n", "\n").replace("\\t", "\t")
    return sys.stdin.read() if text == "-" else text


# -- statistics ---------------------------------------------------------------------------


class DraftRounds:
    """Rounds and accepted drafts of a classic draft-model run, rebuilt from ``from_draft``.

    A round emits its accepted drafts (``from_draft=True``) and then the target's own token;
    a round cut short by an end-of-sequence draft still counts.

    Args:
        num_draft_tokens: Drafts per round.
    """

    def __init__(self, num_draft_tokens: int):
        from .. import GenerationStats

        self.stats = GenerationStats(num_draft_tokens + 1)
        self._run = 0

    def add(self, from_draft: bool) -> None:
        """Count one emitted token."""
        if from_draft:
            self._run += 1
            return
        self._close_round()

    def finish(self) -> None:
        """Count a last round that ended on a draft token."""
        if self._run:
            self._close_round()

    def _close_round(self) -> None:
        self.stats.rounds += 1
        self.stats.accepted.append(self._run)
        self._run = 0


def histogram_line(stats: Any) -> str:
    """``n:rounds`` pairs of the rounds that accepted exactly ``n`` drafts (zeros left out).

    Args:
        stats: A ``dflash.GenerationStats``.

    Returns:
        The pairs, space-separated.
    """
    return " ".join(f"{n}:{count}" for n, count in enumerate(stats.histogram) if count)


def acceptance_lines(stats: Any, kind: str) -> List[str]:
    """The acceptance statistics of a speculative run, as ``dflash-generate`` prints them.

    Args:
        stats: A ``dflash.GenerationStats``.
        kind: ``"dflash"`` or ``"draft-model"``.

    Returns:
        Two lines.
    """
    if kind == "dflash":
        head = (
            f"DFlash: {stats.rounds} rounds, tau {stats.tau:.2f} tokens/round, "
            f"block {stats.block_size}"
        )
    else:
        head = (
            f"Draft model: {stats.rounds} rounds, tau {stats.tau:.2f} tokens/round, "
            f"{stats.block_size - 1} draft tokens/round"
        )
    return [head, f"Accepted drafts per round (n:rounds): {histogram_line(stats)}"]
