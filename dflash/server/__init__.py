"""``dflash-server``: an OpenAI-compatible HTTP server with DFlash, prompt-cache reuse and a
server-owned context policy (shift with a staging swap, or error).

Needs the ``server`` extra (``pip install 'mlx-dflash[server]'``). Start it with
``dflash-server`` or ``python -m dflash.server``; :func:`main` takes the same flags as a list.
"""

from .cli import build_parser, main
from .policy import ContextTooLong, chat_turns, drop_turns, shift_chat, shift_raw

__all__ = [
    "ContextTooLong",
    "build_parser",
    "chat_turns",
    "drop_turns",
    "main",
    "shift_chat",
    "shift_raw",
]
