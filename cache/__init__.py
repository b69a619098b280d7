"""KV planes, drop-in mlx-lm caches and the speculative checkpoint (``dflash.cache``)."""

from .caches import GrowingKVCache, RingKVCache, staged_window_mask
from .checkpoint import PlaneCheckpoint, SpeculativeCheckpoint
from .errors import (
    CacheDiscontinuity,
    CacheError,
    ContextOverflow,
    IncompatibleCache,
    RollbackError,
)
from .plane import KvPlane, PlaneMeta
from .prompt_cache import PromptCache, check_prompt_cache, make_prompt_cache

__all__ = [
    "CacheDiscontinuity",
    "CacheError",
    "ContextOverflow",
    "GrowingKVCache",
    "IncompatibleCache",
    "KvPlane",
    "PlaneCheckpoint",
    "PlaneMeta",
    "PromptCache",
    "RingKVCache",
    "RollbackError",
    "SpeculativeCheckpoint",
    "check_prompt_cache",
    "make_prompt_cache",
    "staged_window_mask",
]
