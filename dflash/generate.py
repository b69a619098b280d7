"""``dflash-generate`` / ``python -m dflash.generate``: mlx-lm's generate CLI with DFlash.

Flags follow ``mlx_lm.generate`` where they apply, plus ``--drafter`` / ``--block-size`` (DFlash)
and ``--draft-model`` / ``--num-draft-tokens`` (a classic draft model). Any failure prints one
line and exits non-zero.
"""

import argparse
import sys
import types
from typing import List, Optional

import mlx.core as mx

DESCRIPTION = (
    "Generate text with DFlash speculative decoding (lossless) on mlx-lm models."
)


class _Parser(argparse.ArgumentParser):
    """An argument parser whose errors are one line, not usage plus a message."""

    def error(self, message: str) -> None:
        self.exit(2, f"dflash-generate: error: {message}\n")


def _positive(kind):
    def parse(text: str):
        value = kind(text)
        if value <= 0:
            raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
        return value

    return parse


def _non_negative(kind):
    def parse(text: str):
        value = kind(text)
        if value < 0:
            raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
        return value

    return parse


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="dflash-generate", description=DESCRIPTION)
    parser.add_argument(
        "--model",
        help="local path or Hugging Face repo of the target model "
        "(default: the bundled demo pair, target and drafter)",
    )
    parser.add_argument(
        "--prompt",
        "-p",
        default=None,
        help="the prompt ('-' reads stdin; default 'hello', or a function "
        "signature and docstring for the demo code model)",
    )
    parser.add_argument(
        "--system-prompt", default=None, help="system prompt for the chat template"
    )
    parser.add_argument(
        "--ignore-chat-template",
        action="store_true",
        help="use the raw prompt without the tokenizer's chat template",
    )
    parser.add_argument("--max-tokens", "-m", type=_positive(int), default=100)
    parser.add_argument(
        "--temp", type=_non_negative(float), default=0.0, help="sampling temperature"
    )
    parser.add_argument("--top-p", type=float, default=1.0, help="sampling top-p")
    parser.add_argument(
        "--top-k", type=_non_negative(int), default=0, help="sampling top-k"
    )
    parser.add_argument("--min-p", type=float, default=0.0, help="sampling min-p")
    parser.add_argument("--seed", type=int, default=None, help="PRNG seed")
    parser.add_argument(
        "--verbose",
        type=lambda t: t.lower() in ("true", "t", "1"),
        default=True,
        help="'True' prints statistics, 'False' only the text",
    )
    parser.add_argument(
        "--drafter", help="path or repo of a DFlash drafter for --model"
    )
    parser.add_argument(
        "--block-size",
        type=_positive(int),
        default=None,
        help="DFlash block size (default: the drafter's)",
    )
    parser.add_argument("--draft-model", help="a classic draft model (same tokenizer)")
    parser.add_argument(
        "--num-draft-tokens",
        type=_non_negative(int),
        default=3,
        help="draft tokens per round with --draft-model",
    )
    parser.add_argument("--prefill-step-size", type=_positive(int), default=2048)
    return parser


DEFAULT_PROMPT = "hello"  # mlx_lm.generate's default
DEMO_PROMPT = 'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n'


def _prompt_text(args) -> str:
    if args.prompt == "-":
        return sys.stdin.read()
    if args.prompt is None:
        return DEMO_PROMPT if args.model is None else DEFAULT_PROMPT
    return args.prompt


def _prompt_tokens(tokenizer, args) -> List[int]:
    text = _prompt_text(args)
    if args.ignore_chat_template or tokenizer.chat_template is None:
        return tokenizer.encode(text)
    messages = (
        []
        if args.system_prompt is None
        else [{"role": "system", "content": args.system_prompt}]
    )
    messages.append({"role": "user", "content": text})
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True)


def _histogram_line(stats) -> str:
    return " ".join(f"{n}:{count}" for n, count in enumerate(stats.histogram) if count)


def _load_models(args):
    """``(model, tokenizer, drafter or None)`` from the flags; the demo pair without --model."""
    from mlx_lm import load

    from .loader import load_drafter

    if args.model is None:
        return _load_demo_pair(args)
    model, tokenizer = load(args.model)
    drafter = load_drafter(args.drafter, model) if args.drafter else None
    return model, tokenizer, drafter


def _load_demo_pair(args):
    """The bundled demo target and drafter, announced in one line on stderr."""
    from . import demo

    for flag, value in (
        ("--draft-model", args.draft_model),
        ("--drafter", args.drafter),
    ):
        if value:
            raise ValueError(
                f"{flag} needs --model (without --model the bundled demo pair "
                "is used)"
            )
    model, tokenizer, drafter = demo.load_demo()
    print(
        f"dflash-generate: no --model given; using the bundled demo pair "
        f"({demo.DEMO_DESCRIPTION}, {demo.DEMO_DIR})",
        file=sys.stderr,
    )
    return model, tokenizer, drafter


def run(args) -> None:
    """Load the models, stream the text, print the statistics."""
    from mlx_lm import load

    from .generation import stream_generate
    from .sampling import SamplingParams, make_sampler
    from .stats import GenerationStats

    if args.drafter and args.draft_model:
        raise ValueError("use --drafter (DFlash) or --draft-model, not both")
    SamplingParams(
        temp=args.temp, top_p=args.top_p, min_p=args.min_p, top_k=args.top_k
    )  # validates the settings
    if args.seed is not None:
        mx.random.seed(args.seed)
    model, tokenizer, drafter = _load_models(args)
    kwargs = {
        "sampler": make_sampler(
            temp=args.temp, top_p=args.top_p, min_p=args.min_p, top_k=args.top_k
        ),
        "prefill_step_size": args.prefill_step_size,
    }
    stats = None
    if drafter is not None:
        kwargs["drafter"] = drafter
        stats = GenerationStats(args.block_size or drafter.config.block_size)
        kwargs.update(block_size=args.block_size, stats=stats)
    elif args.draft_model:
        kwargs["draft_model"], _ = load(args.draft_model)
        kwargs["num_draft_tokens"] = args.num_draft_tokens
    prompt = _prompt_tokens(tokenizer, args)
    response = None
    for response in stream_generate(
        model, tokenizer, prompt, max_tokens=args.max_tokens, **kwargs
    ):
        print(response.text, end="", flush=True)
    print()
    if args.verbose and response is not None:
        print("=" * 10)
        print(
            f"Prompt: {response.prompt_tokens} tokens, {response.prompt_tps:.3f} tokens-per-sec"
        )
        print(
            f"Generation: {response.generation_tokens} tokens, "
            f"{response.generation_tps:.3f} tokens-per-sec"
        )
        if stats is not None:
            print(
                f"DFlash: {stats.rounds} rounds, tau {stats.tau:.2f} tokens/round, "
                f"block {stats.block_size}"
            )
            print(f"Accepted drafts per round (n:rounds): {_histogram_line(stats)}")
        print(f"Peak memory: {response.peak_memory:.3f} GB")


def main(argv: Optional[List[str]] = None) -> None:
    """Entry point of ``dflash-generate``: one line and a non-zero exit on any failure."""
    args = build_parser().parse_args(argv)
    try:
        run(args)
    except KeyboardInterrupt:
        sys.exit(130)
    except Exception as error:  # the CLI's contract: one clear line, no traceback
        message = (
            str(error).strip().splitlines()[0]
            if str(error).strip()
            else type(error).__name__
        )
        print(f"dflash-generate: error: {message}", file=sys.stderr)
        sys.exit(1)


class _CallableModule(types.ModuleType):
    """Importing ``dflash.generate`` rebinds the package attribute ``dflash.generate`` (the
    function, as in mlx-lm) to this module; calling the module still generates."""

    def __call__(self, *args, **kwargs):
        from .generation import generate

        return generate(*args, **kwargs)


sys.modules[__name__].__class__ = _CallableModule

if __name__ == "__main__":
    main()
