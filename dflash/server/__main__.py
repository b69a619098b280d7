"""``python -m dflash.server``."""

from .cli import main

if __name__ == "__main__":
    main()
