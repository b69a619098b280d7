"""``dflash-cache-prompt`` (``python -m dflash cache-prompt``): ``mlx_lm.cache_prompt`` for
dflash caches.

Prefills a (long) prompt once and saves the prompt cache as a session file
(:mod:`dflash.cli.session`); ``dflash-generate --prompt-cache-file FILE`` and ``dflash-chat
--load-session FILE`` continue from it, prefilling only what comes after. With a drafter (the
bundled demo pair by default) the file also carries the drafter's context, so the continuation
is DFlash-decoded. As in mlx-lm, with a chat template the prompt is the user message left open
(``continue_final_message``), so a later prompt completes it.
"""

import argparse
import time
from typing import List

import mlx.core as mx

from .common import (
    OneLineParser,
    add_cache_flags,
    add_model_flag,
    add_prefill_flag,
    check_cache_flags,
    entry_point,
    load_models,
    read_prompt,
)
from .session import new_session, save_session

PROG = "dflash-cache-prompt"
DESCRIPTION = (
    "Prefill a prompt once and save its cache for dflash-generate --prompt-cache-file "
    "(or dflash-chat --load-session)."
)


def build_parser() -> argparse.ArgumentParser:
    """The ``dflash-cache-prompt`` argument parser (mlx-lm's flags, plus ``--drafter``).

    Returns:
        The parser.
    """
    parser = OneLineParser(prog=PROG, description=DESCRIPTION)
    add_model_flag(parser)
    add_cache_flags(parser)
    parser.add_argument(
        "--prompt-cache-file",
        required=True,
        help="the file to save the prompt cache in",
    )
    parser.add_argument(
        "--prompt", required=True, help="the prompt to cache ('-' reads stdin)"
    )
    parser.add_argument(
        "--drafter", help="a DFlash drafter for --model: its context is cached too"
    )
    add_prefill_flag(parser)
    return parser


def cached_prompt_tokens(tokenizer, text: str) -> List[int]:
    """The tokens to cache: the user message left open under a chat template, else raw.

    Args:
        tokenizer: mlx-lm's ``TokenizerWrapper``.
        text: The prompt.

    Returns:
        Token ids.
    """
    if tokenizer.has_chat_template:
        messages = [{"role": "user", "content": text}]
        return list(
            tokenizer.apply_chat_template(
                messages, add_generation_prompt=False, continue_final_message=True
            )
        )
    return tokenizer.encode(text)


class Progress:
    """mlx-lm's prefill progress line, rewritten in place on stdout."""

    def __init__(self):
        self.start = time.perf_counter()
        self.width = 0

    def __call__(self, processed: int, total: int) -> None:
        speed = processed / max(time.perf_counter() - self.start, 1e-9)
        line = f"\rProcessed {processed:6d} tokens ({speed:6.2f} tok/s)"
        self.width = max(self.width, len(line))
        print(line.ljust(self.width), end="", flush=True)


def prefill(models, session, tokens: List[int], step: int) -> None:
    """Run ``tokens`` into the session's cache (and the drafter's context) and record them.

    The generators are asked for no token (``max_tokens=0``), which leaves the cache holding
    the prompt, or all of it but the last token; what is not cached stays ``pending``.

    Args:
        models: The loaded models.
        session: A new session.
        tokens: The prompt.
        step: Prompt tokens per forward.
    """
    from .. import dflash_generate_step, generate_step

    prompt = mx.array(tokens, mx.uint32)
    common = dict(
        max_tokens=0,
        prompt_cache=session.cache,
        prefill_step_size=step,
        prompt_progress_callback=Progress(),
    )
    if models.drafter is not None:
        steps = dflash_generate_step(prompt, models.model, models.drafter, **common)
    else:
        steps = generate_step(prompt, models.model, **common)
    for _ in steps:  # max_tokens=0 yields nothing (mlx-lm's contract): refuse otherwise
        raise RuntimeError(
            "the generator produced a token with max_tokens=0; the prompt was not cached"
        )
    print()
    session.tokens = list(tokens[: session.position])
    session.pending = list(tokens[session.position :])
    session.check()


def run(args: argparse.Namespace) -> None:
    """Load the models, prefill the prompt, save the cache.

    Args:
        args: Parsed ``dflash-cache-prompt`` flags.
    """
    models = load_models(PROG, args.model, args.drafter)
    check_cache_flags(args, models.model)
    tokens = cached_prompt_tokens(models.tokenizer, read_prompt(args.prompt))
    session = new_session(models)
    models.announce()
    prefill(models, session, tokens, args.prefill_step_size)
    print(f"Peak memory: {mx.get_peak_memory() / 1e9:.3f} GB")
    print("Saving...")
    save_session(args.prompt_cache_file, session, models)


main = entry_point(PROG, build_parser, run)


if __name__ == "__main__":
    main()
