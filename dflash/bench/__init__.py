"""``dflash-bench``: speed, τ and losslessness of DFlash beside plain and classic decoding.

``run_bench`` runs interleaved passes over modes and prompts and returns a JSON-ready
report; ``python -m dflash.bench`` / ``dflash-bench`` is the command line. The scale mode's
random target lives in :mod:`dflash.bench.scale_target` (mlx and mlx-lm only).
"""

from .cli import build_parser, main
from .passes import check_block_size, first_divergence, run_bench
from .prompts import default_prompts_path, read_prompts, stop_tokens
from .replay import ReplayDrafter
from .report import format_summary

__all__ = [
    "ReplayDrafter",
    "build_parser",
    "check_block_size",
    "default_prompts_path",
    "first_divergence",
    "format_summary",
    "main",
    "read_prompts",
    "run_bench",
    "stop_tokens",
]
