"""mlx-dflash: lossless speculative decoding for mlx-lm with exact, O(block) cache rollback."""

import os as _os

# Installed, the root folders cache/, metal/, verify/ become dflash.cache, ... (setuptools
# package-dir). Imported straight from a source checkout (the repo root on sys.path, as with
# ``python -m pytest``), the same mapping is had by searching the repo root for subpackages.
_here = _os.path.dirname(_os.path.abspath(__file__))
_root = _os.path.dirname(_here)
if not _os.path.isdir(_os.path.join(_here, "cache")) and _os.path.isfile(
    _os.path.join(_root, "cache", "__init__.py")
):
    __path__.append(_root)

from .cache import SpeculativeCheckpoint, make_prompt_cache
from .generation import (
    generate,
    generate_step,
    speculative_generate_step,
    stream_generate,
)

__all__ = [
    "SpeculativeCheckpoint",
    "generate",
    "generate_step",
    "make_prompt_cache",
    "speculative_generate_step",
    "stream_generate",
]
