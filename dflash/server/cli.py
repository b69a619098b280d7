"""``dflash-server``: flags, model loading and the HTTP server (uvicorn).

Flags follow ``mlx_lm.server`` where they apply, plus ``--drafter`` / ``--block-size`` (DFlash),
``--max-context`` / ``--context-policy`` / ``--raw-keep-tokens`` (the context policy),
``--queue-size`` (overload) and ``--no-warmup``. Without ``--model`` the bundled demo pair is
served. A failure to start prints one line and exits non-zero.
"""

import argparse
import json
import logging
import re
import socket
import sys
from pathlib import Path
from typing import List, Optional

from ..cli.common import (
    OneLineParser,
    add_cache_flags,
    add_prefill_flag,
    check_block_size,
    check_cache_flags,
    integer,
    load_models,
    model_identity,
    number,
    run_cli,
    target_prefers_direct_launches,
)
from ..launch_mode import prefer_direct_launches
from .policy import POLICIES, SHIFT

PROG = "dflash-server"


def parse_size(text: str) -> int:
    """Bytes from ``"123"``, ``"64MB"``, ``"8G"``, ``"1.5GiB"`` (decimal or binary units)."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([kmgt]?)(i?)b?\s*", text.lower())
    if not match:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 512MB, 8GB)")
    number, unit, binary = match.groups()
    base = 1024 if binary else 1000
    return int(float(number) * base ** " kmgt".index(unit or " "))


def _json_object(text: str) -> dict:
    try:
        value = json.loads(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(f"not JSON: {error}")
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("must be a JSON object")
    return value


def build_parser() -> argparse.ArgumentParser:
    """The command-line flags."""
    parser = OneLineParser(
        prog=PROG,
        description="An OpenAI-compatible server with lossless DFlash "
        "speculative decoding, prompt-cache reuse and a context policy.",
    )
    add = parser.add_argument
    add(
        "--model",
        help="path or Hugging Face repo of the target model (default: the bundled "
        "demo pair, target and DFlash drafter)",
    )
    add("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1)")
    add(
        "--port",
        type=integer(0),
        default=8080,
        help="port to listen on (default: 8080; 0 picks a free one)",
    )
    add(
        "--allowed-origins",
        type=lambda text: text.split(","),
        default=["*"],
        help="comma-separated CORS origins (default: *)",
    )
    add("--drafter", help="path or repo of a DFlash drafter for --model")
    add(
        "--no-drafter",
        action="store_true",
        help="serve without DFlash even when a drafter is available (the demo pair's)",
    )
    add(
        "--block-size",
        type=integer(1),
        default=None,
        help="DFlash block size (default: the drafter's)",
    )
    add("--draft-model", help="a classic draft model for speculative decoding")
    add(
        "--num-draft-tokens",
        type=integer(0),
        default=3,
        help="draft tokens per round with --draft-model (default: 3)",
    )
    add(
        "--trust-remote-code",
        action="store_true",
        help="trust remote code of the tokenizer",
    )
    add(
        "--log-level",
        default="INFO",
        choices=["DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"],
    )
    add(
        "--chat-template",
        default="",
        help="a chat template (Jinja text) for the tokenizer",
    )
    add(
        "--use-default-chat-template",
        action="store_true",
        help="use the tokenizer's default chat template when it has none",
    )
    add(
        "--chat-template-args",
        type=_json_object,
        default={},
        help="JSON object of extra chat template arguments, e.g. '{\"enable_thinking\":false}'",
    )
    add("--temp", type=number(0.0), default=0.0, help="default temperature (0.0)")
    add("--top-p", type=number(0.0), default=1.0, help="default top-p (1.0)")
    add("--top-k", type=integer(0), default=0, help="default top-k (0: off)")
    add("--min-p", type=number(0.0), default=0.0, help="default min-p (0.0: off)")
    add(
        "--max-tokens",
        type=integer(1),
        default=512,
        help="default maximum tokens to generate (512)",
    )
    add_prefill_flag(parser, "prompt tokens per prefill forward (2048)")
    add(
        "--prompt-cache-size",
        type=integer(1),
        default=10,
        help="conversations (sessions) whose caches are kept for reuse (10)",
    )
    add(
        "--prompt-cache-bytes",
        type=parse_size,
        default=None,
        help="most bytes of session caches kept (e.g. 8GB; default: no limit)",
    )
    add(
        "--max-context",
        type=integer(2),
        default=None,
        help="context limit in tokens (default: the model's max_position_embeddings)",
    )
    add(
        "--context-policy",
        choices=POLICIES,
        default=SHIFT,
        help="shift: drop the oldest whole turns (chat) or the middle of the prompt (raw) "
        "until the request fits; error: refuse a request that does not fit (default: shift)",
    )
    add(
        "--raw-keep-tokens",
        type=integer(0),
        default=0,
        help="leading tokens a shifted raw prompt always keeps (0)",
    )
    add(
        "--queue-size",
        type=integer(1),
        default=64,
        help="requests that may wait for the worker before new ones get HTTP 429 (64)",
    )
    add(
        "--no-warmup",
        action="store_true",
        help="serve without first generating once from a short prompt (the warm-up "
        "compiles the kernels and traces the layers before the first request)",
    )
    add_cache_flags(parser)
    return parser


def model_max_context(model, model_path: Optional[str] = None) -> Optional[int]:
    """The model's ``max_position_embeddings`` (from its args, else its config.json)."""
    value = getattr(getattr(model, "args", None), "max_position_embeddings", None)
    if value is None and model_path is not None:
        config = Path(model_path) / "config.json"
        if config.is_file():
            data = json.loads(config.read_text())
            value = data.get("max_position_embeddings") or (
                data.get("text_config") or {}
            ).get("max_position_embeddings")
    return int(value) if value else None


def _set_chat_template(tokenizer, args) -> None:
    template = args.chat_template
    if (
        not template
        and args.use_default_chat_template
        and tokenizer.chat_template is None
    ):
        template = getattr(tokenizer, "default_chat_template", None)
        if not template:
            raise ValueError(
                "--use-default-chat-template: the tokenizer has no default template"
            )
    if template:
        tokenizer._tokenizer.chat_template = template
        tokenizer.has_chat_template = True


def load_engine(args):
    """Load the models the flags name (the demo pair without ``--model``).

    Returns:
        ``(engine, model names, draft names)``: the names each model answers to, its id first.
    """
    import mlx.core as mx

    from .worker import Engine

    tokenizer_config = {"trust_remote_code": args.trust_remote_code}
    models = load_models(
        PROG, args.model, args.drafter, args.draft_model, tokenizer_config
    )
    names = [models.model_name]
    if args.model is not None and args.model != models.model_name:
        names.append(args.model)
    drafter = None if args.no_drafter else models.drafter
    block_size = check_block_size(args.block_size, drafter) if drafter else None
    draft_names = []
    if args.draft_model:
        draft_names = [model_identity(args.draft_model), args.draft_model]
    _set_chat_template(models.tokenizer, args)
    max_context = args.max_context or model_max_context(models.model, args.model)
    # Parameters loaded lazily on this thread must be materialized before the worker uses them.
    loaded = (models.model, drafter, models.draft_model)
    mx.eval([model.parameters() for model in loaded if model is not None])
    engine = Engine(
        models.model,
        models.tokenizer,
        drafter,
        models.draft_model,
        names[0],
        draft_names[0] if draft_names else None,
        max_context,
        block_size,
        args.prefill_step_size,
    )
    return engine, names, draft_names


def build_state(args):
    """Load everything and build the app's shared state (the worker is not started)."""
    from .app import ServerState
    from .prompts import Prompter
    from .protocol import Defaults
    from .worker import Worker

    engine, names, draft_names = load_engine(args)
    check_cache_flags(args, engine.model)
    vocab = getattr(getattr(engine.model, "args", None), "vocab_size", None) or (
        1 << 31
    )
    defaults = Defaults(
        args.max_tokens,
        args.temp,
        args.top_p,
        args.top_k,
        args.min_p,
        args.num_draft_tokens,
        vocab,
    )
    prompter = Prompter(
        engine.tokenizer,
        engine.max_context,
        args.context_policy,
        args.raw_keep_tokens,
        args.chat_template_args,
    )
    worker = Worker(
        engine,
        args.queue_size,
        args.prompt_cache_size,
        args.prompt_cache_bytes,
        warm_up=not args.no_warmup,
    )
    return ServerState(
        worker, prompter, defaults, names, draft_names, args.allowed_origins
    )


def _check_sampling(args) -> None:
    from .. import make_sampler

    make_sampler(temp=args.temp, top_p=args.top_p, min_p=args.min_p, top_k=args.top_k)


def _server_stack():
    """uvicorn and the app, or an error naming the extra that brings them."""
    try:
        import uvicorn

        from .app import create_app
    except ImportError as error:
        raise RuntimeError(
            f"{error.name} is not installed: the server needs pip install 'mlx-dflash[server]'"
        ) from error
    return uvicorn, create_app


def serve(args) -> None:
    """Load the models, bind the port, and serve until interrupted."""
    uvicorn, create_app = _server_stack()

    # Before any GPU evaluation: mlx reads it once.
    prefer_direct_launches(host_paced=target_prefers_direct_launches(args.model))
    _check_sampling(args)
    logging.basicConfig(
        level=args.log_level, format="%(asctime)s %(levelname)s %(message)s"
    )
    state = build_state(args)
    family = socket.AF_INET6 if ":" in args.host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((args.host, args.port))
    host, port = sock.getsockname()[:2]
    config = uvicorn.Config(
        create_app(state), log_level=args.log_level.lower(), timeout_graceful_shutdown=5
    )
    server = uvicorn.Server(config)
    policy = (
        f"max context {state.worker.engine.max_context}, policy {args.context_policy}"
    )
    mode = (
        "DFlash"
        if state.worker.engine.drafter is not None
        else "draft model" if state.worker.engine.draft_model is not None else "plain"
    )
    print(
        f"{PROG}: serving {state.model_id} ({mode}; {policy}) at http://{host}:{port}",
        file=sys.stderr,
        flush=True,
    )
    server.run(sockets=[sock])


def main(argv: Optional[List[str]] = None) -> None:
    """Entry point of ``dflash-server``: one line and a non-zero exit on a failure to start."""
    run_cli(PROG, serve, build_parser().parse_args(argv))
