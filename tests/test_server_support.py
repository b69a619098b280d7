"""Helpers of the server tests: a real dflash-server in a subprocess (or in this process on a
thread), the test chat template, and in-process reference generation. No tests here."""

import socket
import threading
import time
from typing import List, Optional

import pytest
from support.server_process import (  # noqa: F401 (re-exported to the tests)
    ServerProcess,
)

import dflash
from dflash import demo

needs_demo = pytest.mark.skipif(
    not demo.demo_available(), reason="demo pair not installed"
)

# A small real chat template: system, user, assistant (with tool calls) and tool messages.
CHAT_TEMPLATE = (
    "{%- for m in messages -%}"
    "{%- if m.role == 'system' -%}# system: {{ m.content }}\n"
    "{%- elif m.role == 'user' -%}# user: {{ m.content }}\n"
    "{%- elif m.role == 'assistant' -%}# assistant:\n{{ m.content }}"
    "{%- for c in m.tool_calls or [] -%}"
    "\n# call {{ c.function.name }}({{ c.function.arguments | tojson }})"
    "{%- endfor -%}<|endoftext|>\n"
    "{%- elif m.role == 'tool' -%}# result: {{ m.content }}\n"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}# assistant:\n{%- endif -%}"
)


class InProcessServer:
    """The app on a uvicorn thread in this process (tests that reach into the worker).

    Args:
        argv: dflash-server flags (the models are loaded here).
    """

    def __init__(self, argv: List[str]):
        import uvicorn

        from dflash.server.app import create_app
        from dflash.server.cli import build_parser, build_state

        self.state = build_state(build_parser().parse_args(argv))
        self.worker = self.state.worker
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        config = uvicorn.Config(create_app(self.state), log_level="warning")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(
            target=self.server.run, kwargs={"sockets": [sock]}, daemon=True
        )
        self.thread.start()
        while not self.server.started:
            time.sleep(0.02)

    def close(self) -> None:
        self.server.should_exit = True
        self.thread.join(30)


def with_template(tokenizer, template: str = CHAT_TEMPLATE):
    """Give a tokenizer the test chat template (as --chat-template does)."""
    tokenizer._tokenizer.chat_template = template
    tokenizer.has_chat_template = True
    return tokenizer


def demo_pair():
    """The bundled demo pair, its tokenizer given the test chat template.

    Returns:
        ``(model, tokenizer, drafter)``.
    """
    model, tokenizer, drafter = dflash.load_demo()
    return model, with_template(tokenizer), drafter


def chat_tokens(tokenizer, messages, tools=None) -> List[int]:
    """The prompt the server renders for ``messages`` (with the test template); tool-call
    arguments sent as JSON text reach the template as objects, as in mlx_lm.server."""
    from dflash.server.protocol import normalize_message

    messages = [normalize_message(message, i) for i, message in enumerate(messages)]
    return list(
        tokenizer.apply_chat_template(
            messages, tools=tools, add_generation_prompt=True, tokenize=True
        )
    )


def reference(model, tokenizer, tokens, max_tokens: int, **kwargs) -> str:
    """What a fresh server answers at temperature 0: one generation from an empty cache."""
    return dflash.generate(
        model, tokenizer, list(tokens), max_tokens=max_tokens, **kwargs
    )


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def snapshot_sessions(pool) -> list:
    """Every session's identity, tokens, epoch and cache bytes (bitwise comparison)."""
    import mlx.core as mx
    import numpy as np

    def object_state(obj):
        meta, arrays = {}, {}
        for key, value in sorted(vars(obj).items()):
            if isinstance(value, (int, float, bool, str, type(None))):
                meta[key] = value
            elif hasattr(value, "shape") and hasattr(value, "dtype"):
                exact = (
                    value.astype(mx.float32) if value.dtype == mx.bfloat16 else value
                )
                arrays[key] = (value.shape, str(value.dtype), np.array(exact).tobytes())
        return meta, arrays

    def part_state(part):
        planes = getattr(part, "planes", None) or []
        return object_state(part), [object_state(plane) for plane in planes]

    state = []
    for session in pool.sessions:
        parts = list(session.cache)
        context = getattr(session.cache, "drafter_context", None)
        if context is not None:
            parts.append(context)
        state.append(
            (
                id(session),
                id(session.cache),
                list(session.tokens),
                session.epoch,
                [part_state(part) for part in parts],
            )
        )
    return state


def wait_idle(url: str, timeout: float = 60.0) -> dict:
    """Poll /health until the worker has nothing queued or running."""
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        body = httpx.get(url + "/health").json()
        if not body.get("busy") and body.get("queued") == 0:
            return body
        time.sleep(0.05)
    raise TimeoutError("the server stayed busy")


def first_line(text: Optional[str]) -> str:
    return (text or "").strip().splitlines()[0] if (text or "").strip() else ""
