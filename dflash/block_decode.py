"""The DFlash generator's former import path, kept for callers that still use it.

New code imports ``dflash.dflash_generate_step`` / ``dflash.GenerationStats`` (or
:mod:`dflash.dflash_round` and :mod:`dflash.stats`).
"""

from .dflash_round import dflash_generate_step
from .stats import GenerationStats

__all__ = ["GenerationStats", "dflash_generate_step"]
