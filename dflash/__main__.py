"""``python -m dflash <subcommand> [flags]``: see :mod:`dflash.cli`."""

from dflash.cli import main

if __name__ == "__main__":
    main()
