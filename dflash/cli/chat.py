"""``dflash-chat`` (``python -m dflash chat``): mlx-lm's chat REPL, DFlash underneath.

One prompt cache lives for the whole session: each turn prefills only its own new tokens, and
after a reply the cache holds every token of the conversation (prompts and replies, as
emitted). With a drafter (the bundled demo pair by default) replies are DFlash-decoded; the
cache then also carries the drafter's context.

Turn text. A tokenizer with a chat template gets, each turn, the template over the new user
message (preceded by the system prompt on the first turn of a session: later turns find it in
the cache). A tokenizer without one (the demo code model is a base model) gets the plain-text
fallback :func:`plain_turn_text`: the system prompt and a blank line before the first turn,
each user message on its own line, the reply continuing the text after it.

Commands: ``q`` quits, ``r`` resets the session, ``h`` shows them; Ctrl-D quits too. Ctrl-C
during a reply stops it after the token being emitted: the session keeps that reply exactly as
far as it was shown. A second Ctrl-C in the same reply, or Ctrl-C at the prompt, quits.
``--save-session FILE`` writes the session when the chat ends (not after a forced quit);
``--load-session FILE`` continues a saved one (same model and drafter, by name).
"""

import argparse
import signal
import sys
from contextlib import contextmanager
from typing import Any, Iterator, List, Optional

import mlx.core as mx

from ..launch_mode import prefer_direct_launches
from .common import (
    DEMO_NAME,
    Models,
    OneLineParser,
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
    target_prefers_direct_launches,
)
from .session import (
    Session,
    check_names,
    load_session,
    new_session,
    read_metadata,
    save_session,
)

PROG = "dflash-chat"
DESCRIPTION = (
    "Chat with an mlx-lm model, DFlash speculative decoding underneath (lossless)."
)
DEFAULT_MAX_TOKENS = 256  # mlx_lm.chat's defaults
DEFAULT_SEED = 0
PROMPT_MARK = ">> "
HELP = "commands: q quit, r reset, h help (Ctrl-C stops a reply)"


def build_parser() -> argparse.ArgumentParser:
    """The ``dflash-chat`` argument parser (mlx-lm's chat flags, plus DFlash and sessions).

    Returns:
        The parser.
    """
    parser = OneLineParser(prog=PROG, description=DESCRIPTION)
    add_model_flag(parser)
    add_sampling_flags(parser, full=False)
    parser.add_argument(
        "--seed", type=integer(0), default=DEFAULT_SEED, help="PRNG seed"
    )
    add_cache_flags(parser)
    add_prefill_flag(parser)
    parser.add_argument(
        "--max-tokens",
        "-m",
        type=integer(1),
        default=DEFAULT_MAX_TOKENS,
        help="tokens to generate at most per reply",
    )
    parser.add_argument(
        "--system-prompt",
        default=None,
        help="system prompt, sent once at the session start",
    )
    add_drafter_flags(parser)
    parser.add_argument(
        "--load-session", metavar="FILE", help="continue a saved session"
    )
    parser.add_argument(
        "--save-session",
        metavar="FILE",
        help="save the session here when the chat ends",
    )
    return parser


def plain_turn_text(query: str, system_prompt: Optional[str], first: bool) -> str:
    """The plain-text fallback for a tokenizer without a chat template.

    The session reads as one text: ``system prompt + blank line`` before the first message,
    then each message on a line of its own, each reply continuing right after it::

        <system prompt>\\n\\n<message 1>\\n<reply 1>\\n<message 2>\\n<reply 2>...

    Args:
        query: The user's message.
        system_prompt: The system prompt, or ``None``.
        first: Whether this is the first turn of the session.

    Returns:
        The text this turn adds.
    """
    if not first:
        return f"\n{query}\n"
    head = f"{system_prompt}\n\n" if system_prompt else ""
    return f"{head}{query}\n"


def turn_tokens(
    tokenizer: Any, query: str, system_prompt: Optional[str], first: bool
) -> List[int]:
    """The tokens one turn adds to the session.

    Args:
        tokenizer: mlx-lm's ``TokenizerWrapper``.
        query: The user's message.
        system_prompt: The system prompt, or ``None``.
        first: Whether this is the first turn of the session.

    Returns:
        Token ids: the chat template over the message (and the system prompt on the first
        turn), or :func:`plain_turn_text` encoded (special tokens only on the first turn).
    """
    if tokenizer.has_chat_template:
        messages = []
        if first and system_prompt is not None:
            messages.append({"role": "system", "content": system_prompt})
        messages.append({"role": "user", "content": query})
        return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True))
    text = plain_turn_text(query, system_prompt, first)
    return tokenizer.encode(text, add_special_tokens=first)


class StopRequest:
    """Ctrl-C during a reply: the first press asks the reply to stop at the next token, the
    second raises ``KeyboardInterrupt``. A process started with Ctrl-C ignored (``trap ''
    INT``, a background job of a script) keeps ignoring it, as Python itself does."""

    def __init__(self):
        self.requested = False

    def _handle(self, signum, frame) -> None:
        if self.requested:
            raise KeyboardInterrupt
        self.requested = True

    @contextmanager
    def armed(self) -> Iterator["StopRequest"]:
        """Install the handler for the duration of one reply."""
        self.requested = False
        if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
            yield self
            return
        previous = signal.signal(signal.SIGINT, self._handle)
        try:
            yield self
        finally:
            signal.signal(signal.SIGINT, previous)


class Chat:
    """The REPL: reads messages, streams replies, keeps the session.

    Args:
        models: The loaded models.
        args: The parsed flags.
        session: The session to continue.
    """

    def __init__(self, models: Models, args: argparse.Namespace, session: Session):
        self.models = models
        self.args = args
        self.session = session
        self.sampler = make_cli_sampler(args, models.tokenizer)
        self.block_size = (
            check_block_size(args.block_size, models.drafter)
            if models.drafter
            else None
        )
        self.stop = StopRequest()
        self.consistent = True  # False while a reply is being written into the session

    def header(self) -> str:
        """The first line the chat prints."""
        model = (
            "the bundled demo pair"
            if self.models.model_name == DEMO_NAME
            else self.models.model_name
        )
        mode = (
            f"DFlash, block {self.block_size}" if self.models.drafter else "no drafter"
        )
        text = f"{PROG}: {model} ({mode}), max tokens {self.args.max_tokens:,}"
        if self.session.tokens:
            text += f", session of {len(self.session.tokens)} tokens"
        return f"{text}; {HELP}"

    def _kwargs(self):
        from .. import GenerationStats

        kwargs = {
            "sampler": self.sampler,
            "prefill_step_size": self.args.prefill_step_size,
            "prompt_cache": self.session.cache,
        }
        stats = None
        if self.models.drafter is not None:
            stats = GenerationStats(self.block_size)
            kwargs.update(
                drafter=self.models.drafter, block_size=self.block_size, stats=stats
            )
        return kwargs, stats

    def reply(self, query: str) -> None:
        """One turn: the message's tokens in, the reply streamed out, the session updated.

        Args:
            query: The user's message.
        """
        from .. import stream_generate

        first = not self.session.tokens
        prompt = turn_tokens(
            self.models.tokenizer, query, self.args.system_prompt, first
        )
        kwargs, stats = self._kwargs()
        self.consistent = False
        tokens: List[int] = []
        response = None
        generator = stream_generate(
            self.models.model,
            self.models.tokenizer,
            prompt,
            self.args.max_tokens,
            **kwargs,
        )
        with self.stop.armed():
            try:
                for response in generator:
                    tokens.append(response.token)
                    print(response.text, end="", flush=True)
                    if self.stop.requested:
                        break
            finally:
                generator.close()  # the cache keeps the emitted tokens, nothing more
        if (
            self.stop.requested
            and response is not None
            and response.finish_reason is None
        ):
            print(self._held_back_text(), end="", flush=True)
        self.session.record(prompt, tokens)
        self.consistent = True
        print()
        print(self._turn_line(response, stats, len(prompt)), flush=True)

    def _held_back_text(self) -> str:
        """The text of emitted tokens a streaming detokenizer still holds (a cut reply shows
        every token it keeps)."""
        detokenizer = self.models.tokenizer.detokenizer
        detokenizer.finalize()
        return detokenizer.last_segment

    def _turn_line(self, response, stats, prompt_size: int) -> str:
        mark = "  [interrupted] " if self.stop.requested else "  "
        if response is None:
            return f"{mark}no tokens"
        parts = [
            f"{response.generation_tokens} tokens",
            f"{response.generation_tps:.1f} tok/s",
            f"prompt {prompt_size} tokens, {response.prompt_tps:.1f} tok/s",
        ]
        if stats is not None:
            parts.append(f"tau {stats.tau:.2f}")
        parts.append(f"peak {response.peak_memory:.2f} GB")
        return mark + " · ".join(parts)

    def loop(self) -> None:
        """Read and answer messages until ``q``, end of input or Ctrl-C at the prompt."""
        while True:
            try:
                query = input(PROMPT_MARK)
            except EOFError:
                print()
                return
            if query == "q":
                return
            if query == "r":
                self.session = new_session(self.models)
                print("  reset: context cleared", flush=True)
            elif query == "h":
                print(f"  {HELP}", flush=True)
            else:
                self.reply(query)


def run(args: argparse.Namespace) -> None:
    """Load the models (and a saved session), chat, save the session at the end.

    Args:
        args: Parsed ``dflash-chat`` flags.
    """
    # Before any GPU evaluation: mlx reads it once.
    prefer_direct_launches(host_paced=target_prefers_direct_launches(args.model))
    make_cli_sampler(args)  # refuses bad settings before any model loads
    mx.random.seed(args.seed)
    if args.load_session:  # a file for other models is refused before they load
        metadata = read_metadata(args.load_session)
        check_names(args.load_session, metadata, *names_of(args.model, args.drafter))
    models = load_models(PROG, args.model, args.drafter)
    check_cache_flags(args, models.model)
    if args.block_size is not None and models.drafter is None:
        raise ValueError("--block-size needs a DFlash drafter (--drafter)")
    session = (
        load_session(args.load_session, models)
        if args.load_session
        else new_session(models)
    )
    chat = Chat(models, args, session)
    models.announce()
    print(chat.header(), flush=True)
    try:
        chat.loop()
    except KeyboardInterrupt:
        print()
        _save(args, chat)
        raise
    _save(args, chat)


def _save(args: argparse.Namespace, chat: Chat) -> None:
    """Save the session if asked to, unless a forced quit left a reply half-recorded."""
    if args.save_session and not chat.consistent:
        print(
            f"{PROG}: session not saved: a forced quit cut a reply short",
            file=sys.stderr,
        )
    elif args.save_session:
        save_session(args.save_session, chat.session, chat.models)
        print(f"{PROG}: session saved to {args.save_session}", file=sys.stderr)


main = entry_point(PROG, build_parser, run)


if __name__ == "__main__":
    main()
