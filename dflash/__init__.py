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

from .block_decode import GenerationStats, dflash_generate_step
from .cache import SpeculativeCheckpoint, make_prompt_cache
from .demo import demo_available, load_demo
from .drafter import DFlashDrafter, DrafterConfig, DrafterContext, DraftProposal
from .generation import generate, generate_step, speculative_generate_step, stream_generate
from .loader import DrafterLoadError, load_drafter, save_drafter
from .taps import TargetTaps
from .verify.acceptance import SamplingParams, make_sampler

__all__ = [
    "DFlashDrafter",
    "DraftProposal",
    "DrafterConfig",
    "DrafterContext",
    "DrafterLoadError",
    "GenerationStats",
    "SamplingParams",
    "SpeculativeCheckpoint",
    "TargetTaps",
    "demo_available",
    "dflash_generate_step",
    "generate",
    "generate_step",
    "load_demo",
    "load_drafter",
    "make_prompt_cache",
    "make_sampler",
    "save_drafter",
    "speculative_generate_step",
    "stream_generate",
]
