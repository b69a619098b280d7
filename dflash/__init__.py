"""mlx-dflash: lossless speculative decoding for mlx-lm with exact, O(block) cache rollback."""

# First: it records what the process had before dflash allocated anything.
from . import launch_mode  # isort: skip
from .cache import (
    SpeculativeCheckpoint,
    load_prompt_cache,
    make_prompt_cache,
    save_prompt_cache,
)
from .demo import demo_available, load_demo
from .dflash_round import dflash_generate_step
from .drafter import DFlashDrafter, DrafterConfig, DrafterContext, DraftProposal
from .generation import generate, generate_step, stream_generate
from .launch_mode import prefer_direct_launches
from .loader import DrafterLoadError, load_drafter, save_drafter
from .sampling import SamplingParams, make_sampler
from .speculative import speculative_generate_step
from .stats import GenerationStats
from .taps import TargetTaps

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
    "load_prompt_cache",
    "make_prompt_cache",
    "make_sampler",
    "prefer_direct_launches",
    "save_drafter",
    "save_prompt_cache",
    "speculative_generate_step",
    "stream_generate",
]

launch_mode.note_imported()
