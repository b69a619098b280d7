"""mlx-dflash: lossless speculative decoding for mlx-lm with exact, O(block) cache rollback."""

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
