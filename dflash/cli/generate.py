"""``dflash-generate`` (``python -m dflash generate``): mlx-lm's generate CLI with DFlash.

Flags follow ``mlx_lm.generate`` where they apply, plus ``--drafter`` / ``--block-size`` (DFlash)
beside ``--draft-model`` / ``--num-draft-tokens`` (a classic draft model). Without ``--model``
the bundled demo pair runs. With ``--verbose`` (the default) the prompt is echoed above a
``==========`` rule, the generated text follows, and mlx-lm's statistics lines close the run,
with the acceptance statistics of a speculative run before ``Peak memory``.
"""

import argparse
import itertools
from typing import List, Optional

import mlx.core as mx

from ..launch_mode import prefer_direct_launches
from .common import (
    DEMO_NAME,
    DraftRounds,
    Models,
    OneLineParser,
    acceptance_lines,
    add_cache_flags,
    add_drafter_flags,
    add_model_flag,
    add_prefill_flag,
    add_sampling_flags,
    check_block_size,
    check_cache_flags,
    entry_point,
    integer,
    load_models,
    make_cli_sampler,
    names_of,
    read_prompt,
    target_prefers_direct_launches,
)
from .session import check_names, load_session, read_metadata

PROG = "dflash-generate"
DESCRIPTION = (
    "Generate text with DFlash speculative decoding (lossless) on mlx-lm models."
)
DEFAULT_PROMPT = "hello"  # mlx_lm.generate's default
DEMO_PROMPT = 'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n'
RULE = "=" * 10


def _verbose(text: str) -> bool:
    """mlx-lm's reading of ``--verbose``: anything but ``false`` / ``f`` is true."""
    return text.lower() not in ("false", "f")


def build_parser() -> argparse.ArgumentParser:
    """The ``dflash-generate`` argument parser (mlx-lm's flag names, in its order).

    Returns:
        The parser.
    """
    parser = OneLineParser(prog=PROG, description=DESCRIPTION)
    add_model_flag(
        parser,
        "local path or Hugging Face repo of the target model "
        "(default: the bundled demo pair, target and drafter)",
    )
    parser.add_argument(
        "--extra-eos-token",
        default=(),
        nargs="+",
        help="add tokens to the list of end-of-sequence tokens",
    )
    parser.add_argument(
        "--system-prompt", default=None, help="system prompt for the chat template"
    )
    parser.add_argument(
        "--prompt",
        "-p",
        default=None,
        help="the prompt ('-' reads stdin; default 'hello', or a function "
        "signature and docstring for the demo code model)",
    )
    parser.add_argument(
        "--max-tokens",
        "-m",
        type=integer(1),
        default=100,
        help="tokens to generate at most",
    )
    add_sampling_flags(parser)
    parser.add_argument("--seed", type=integer(0), default=None, help="PRNG seed")
    parser.add_argument(
        "--ignore-chat-template",
        action="store_true",
        help="use the raw prompt without the tokenizer's chat template",
    )
    parser.add_argument(
        "--verbose",
        type=_verbose,
        default=True,
        help="'True' echoes the prompt and prints statistics, 'False' only the text",
    )
    add_prefill_flag(parser)
    parser.add_argument(
        "--prompt-cache-file",
        default=None,
        help="continue from a file of dflash-cache-prompt (or a dflash-chat session); "
        "without --model, its model and drafter are used",
    )
    add_cache_flags(parser)
    parser.add_argument("--draft-model", help="a classic draft model (same tokenizer)")
    parser.add_argument(
        "--num-draft-tokens",
        type=integer(0),
        default=3,
        help="draft tokens per round with --draft-model",
    )
    add_drafter_flags(parser)
    return parser


def _prompt_text(args: argparse.Namespace) -> str:
    if args.prompt is None:
        return DEMO_PROMPT if args.model is None else DEFAULT_PROMPT
    return read_prompt(args.prompt)


def prompt_tokens(
    tokenizer, text: str, args: argparse.Namespace, continuing: bool = False
) -> List[int]:
    """The prompt's token ids: the chat template over the system prompt and ``text`` when the
    tokenizer has one (and it is not ignored), else ``text`` encoded raw.

    Continuing a cached prompt (``dflash-cache-prompt`` left the user message open), the
    template's text from the message on completes it, as in mlx-lm; a raw prompt then gets
    no special tokens (they are at the start of the cache already).

    Args:
        tokenizer: mlx-lm's ``TokenizerWrapper``.
        text: The user's prompt.
        args: Flags with ``ignore_chat_template`` and ``system_prompt``.
        continuing: Whether the prompt continues a prompt cache.

    Returns:
        The token ids.
    """
    if args.ignore_chat_template or not tokenizer.has_chat_template:
        return tokenizer.encode(text, add_special_tokens=not continuing)
    messages = []
    if args.system_prompt is not None:
        messages.append({"role": "system", "content": args.system_prompt})
    messages.append({"role": "user", "content": text})
    rendered = tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True
    )
    if continuing:
        messages[-1]["content"] = "<query>"
        probe = tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True
        )
        rendered = rendered[probe.index("<query>") :]
    return tokenizer.encode(rendered, add_special_tokens=False)


def _names_from_cache_file(args: argparse.Namespace) -> None:
    """Take the model (and drafter) of ``--prompt-cache-file`` when ``--model`` is absent, and
    refuse other names before anything loads."""
    path = args.prompt_cache_file
    metadata = read_metadata(path)
    if args.draft_model:
        raise ValueError(
            "--prompt-cache-file continues a plain or DFlash cache; it takes no --draft-model"
        )
    if args.model is None and metadata.get("model") != DEMO_NAME:
        args.model = metadata.get("model")
        args.drafter = args.drafter or metadata.get("drafter") or None
    # (A --drafter without --model is refused when the models load.)
    check_names(path, metadata, *names_of(args.model, args.drafter))


def _check_flags(args: argparse.Namespace) -> None:
    if args.drafter and args.draft_model:
        raise ValueError("use --drafter (DFlash) or --draft-model, not both")


def _generation_kwargs(args: argparse.Namespace, models: Models, sampler):
    """Keyword arguments of ``stream_generate`` and the statistics to print afterwards."""
    from .. import GenerationStats

    kwargs = {
        "sampler": sampler,
        "prefill_step_size": args.prefill_step_size,
        "max_kv_size": args.max_kv_size,
    }
    if models.drafter is not None:
        block_size = check_block_size(args.block_size, models.drafter)
        stats = GenerationStats(block_size)
        kwargs.update(drafter=models.drafter, block_size=block_size, stats=stats)
        return kwargs, stats
    if args.block_size is not None:
        raise ValueError("--block-size needs a DFlash drafter (--drafter)")
    if models.draft_model is not None:
        kwargs.update(
            draft_model=models.draft_model, num_draft_tokens=args.num_draft_tokens
        )
    return kwargs, None


def _print_statistics(response, stats, rounds: Optional[DraftRounds]) -> None:
    print(RULE)
    print(
        f"Prompt: {response.prompt_tokens} tokens, {response.prompt_tps:.3f} tokens-per-sec"
    )
    print(
        f"Generation: {response.generation_tokens} tokens, "
        f"{response.generation_tps:.3f} tokens-per-sec"
    )
    if stats is not None:
        print("\n".join(acceptance_lines(stats, "dflash")))
    elif rounds is not None:
        rounds.finish()
        print("\n".join(acceptance_lines(rounds.stats, "draft-model")))
    print(f"Peak memory: {response.peak_memory:.3f} GB")


def run(args: argparse.Namespace) -> None:
    """Load the models, stream the text, print the statistics.

    Args:
        args: Parsed ``dflash-generate`` flags.
    """
    from .. import stream_generate

    # Before any GPU evaluation: mlx reads it once.
    prefer_direct_launches(host_paced=target_prefers_direct_launches(args.model))
    _check_flags(args)
    make_cli_sampler(args)  # refuses bad settings before any model loads
    if args.seed is not None:
        mx.random.seed(args.seed)
    if args.prompt_cache_file:
        _names_from_cache_file(args)
    models = load_models(PROG, args.model, args.drafter, args.draft_model)
    for token in args.extra_eos_token:
        models.tokenizer.add_eos_token(token)
    check_cache_flags(args, models.model)
    sampler = make_cli_sampler(args, models.tokenizer)
    kwargs, stats = _generation_kwargs(args, models, sampler)
    text = _prompt_text(args)
    prompt = prompt_tokens(
        models.tokenizer, text, args, args.prompt_cache_file is not None
    )
    if args.prompt_cache_file:
        session = load_session(args.prompt_cache_file, models)
        prompt = session.pending + prompt
        kwargs["prompt_cache"] = session.cache
    rounds = DraftRounds(args.num_draft_tokens) if models.draft_model else None
    responses = stream_generate(
        models.model, models.tokenizer, prompt, max_tokens=args.max_tokens, **kwargs
    )
    # The prefill and first token: a refused prompt fails here, before any output.
    first = next(responses, None)
    models.announce()
    if args.verbose:
        print(text, end="" if text.endswith("\n") else "\n")
        print(RULE, flush=True)
    response = None
    for response in itertools.chain([first] if first else [], responses):
        print(response.text, end="", flush=True)
        if rounds is not None:
            rounds.add(response.from_draft)
    print()
    if args.verbose and response is not None:
        _print_statistics(response, stats, rounds)


main = entry_point(PROG, build_parser, run)


if __name__ == "__main__":
    main()
