"""How mlx's CUDA backend hands kernels to the GPU: its CUDA graphs or direct launches.

mlx 0.32's CUDA backend records the kernels of an evaluation into CUDA graphs by
default: it adds a graph node per kernel, builds a key string of the graph's topology,
and at each commit (every ~1 GB of inputs or 100 kernels) updates a cached executable
graph and launches it. A DFlash round at 4-bit is paced by the host's build and encode of
the verify forward (~470 launches), and on an H100 (session 62) the same rounds with
``MLX_USE_CUDA_GRAPHS=0`` (each kernel launched as it is encoded) took a median of
17.5 ms against 22.2 ms, and 96-token generations a median of 301 ms against 354 ms
(5 and 4 processes over two leases; faster in 3 of 4 alternated pairs), every run
lossless. mlx-lm's own plain decoding was ~6 %
slower that way, so the choice is ours to make only where our loop runs.

mlx reads ``MLX_USE_CUDA_GRAPHS`` once, at its first GPU evaluation in the process, so
the choice must be made before that. The ``dflash`` generate, chat and server commands
make it at their start; a library caller may call :func:`prefer_direct_launches` first
thing. A value the user set is always kept. On Metal and the CPU the variable is not
read, and nothing changes.
"""

from __future__ import annotations

import os
from typing import MutableMapping, Optional

GRAPHS_ENV = "MLX_USE_CUDA_GRAPHS"


def prefer_direct_launches(environ: Optional[MutableMapping[str, str]] = None) -> bool:
    """Ask mlx's CUDA backend for direct kernel launches unless the user chose.

    Call it before the process's first GPU evaluation: mlx reads the variable once.

    Args:
        environ: The environment to set (default ``os.environ``).

    Returns:
        True where this call set ``MLX_USE_CUDA_GRAPHS=0``; False where the variable
        was already set (by the user, or by an earlier call), which is kept as it is.
    """
    environ = os.environ if environ is None else environ
    if GRAPHS_ENV in environ:
        return False
    environ[GRAPHS_ENV] = "0"
    return True
