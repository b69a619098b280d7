"""KV planes, drop-in mlx-lm caches and the speculative checkpoint (``dflash.cache``)."""

from .caches import GrowingKVCache, RingKVCache, staged_window_mask
from .checkpoint import PlaneCheckpoint, SpeculativeCheckpoint
from .errors import (
    CacheDiscontinuity,
    CacheError,
    ContextOverflow,
    IncompatibleCache,
    RollbackError,
    SnapshotError,
)
from .plane import GrowingPlane, KvPlane, PlaneMeta, RingPlane, WriteGuard
from .prompt_cache import PromptCache, check_prompt_cache, make_prompt_cache
from .snapshot import load_prompt_cache, save_prompt_cache

__all__ = [
    "CacheDiscontinuity",
    "CacheError",
    "ContextOverflow",
    "GrowingKVCache",
    "GrowingPlane",
    "IncompatibleCache",
    "KvPlane",
    "PlaneCheckpoint",
    "PlaneMeta",
    "PromptCache",
    "RingKVCache",
    "RingPlane",
    "RollbackError",
    "SnapshotError",
    "SpeculativeCheckpoint",
    "WriteGuard",
    "check_prompt_cache",
    "load_prompt_cache",
    "make_prompt_cache",
    "save_prompt_cache",
    "staged_window_mask",
]
