"""``python -m dflash.bench``."""

from .cli import main

if __name__ == "__main__":
    main()
