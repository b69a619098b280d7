"""The command-line tools, and ``python -m dflash <subcommand>`` (mlx-lm's ``python -m mlx_lm``).

Each subcommand is a module with a ``main()``; it is imported only when asked for, so a
subcommand whose module is not installed fails alone, with one line.
"""

import importlib
import sys
from typing import List, Optional

PROG = "dflash"

# mlx-lm spells its subcommands with underscores (``cache_prompt``); both spellings work.
SUBCOMMANDS = {
    "generate": "dflash.cli.generate",
    "chat": "dflash.cli.chat",
    "cache-prompt": "dflash.cli.cache_prompt",
    "bench": "dflash.bench",
    "server": "dflash.server",
}

USAGE = (
    f"usage: python -m dflash {{{','.join(SUBCOMMANDS)}}} [flags]\n"
    "Each subcommand is also a command of its own (dflash-generate, dflash-chat, ...);\n"
    "pass --help to a subcommand for its flags, e.g. python -m dflash generate --help"
)


def _fail(message: str, code: int = 2) -> None:
    print(f"{PROG}: error: {message}", file=sys.stderr)
    sys.exit(code)


def _entry_point(name: str):
    """The ``main`` of subcommand ``name``, or one line and exit 1 if its module is absent."""
    module_name = SUBCOMMANDS[name]
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as error:
        if error.name is not None and module_name.startswith(error.name):
            _fail(
                f"the {name!r} subcommand is not available: {module_name} is not installed",
                1,
            )
        _fail(f"the {name!r} subcommand needs a missing module: {error.name}", 1)
    return module.main


def main(argv: Optional[List[str]] = None) -> None:
    """Dispatch ``python -m dflash <subcommand> [flags]`` to the subcommand's ``main``.

    Args:
        argv: ``[subcommand, *flags]``; default ``sys.argv[1:]``.
    """
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv:
        _fail(f"a subcommand is required: one of {', '.join(SUBCOMMANDS)}")
    name, flags = argv[0].replace("_", "-"), argv[1:]
    if name in ("-h", "--help"):
        print(USAGE)
        return
    if name not in SUBCOMMANDS:
        _fail(
            f"unknown subcommand {argv[0]!r}: expected one of {', '.join(SUBCOMMANDS)}"
        )
    entry = _entry_point(name)
    # Subcommands read sys.argv (some record the command line), so hand them theirs.
    sys.argv = [f"{PROG} {name}", *flags]
    entry()
