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

A dense target is the other way round. In bf16 the same rounds are paced by the device
(reading 55.7 GB of weights), and the graphs' shorter gaps between kernels win: on an
H100 (session 69) 96-token generations took 441–447 ms with the graphs against 472–475 ms
without (3 alternated pairs, all lossless), and mlx-lm's plain decoding 2.00 s against
2.31–2.33 s. So is a target quantized in a form whose matmuls are mlx's own: on an
H100 (session 70) 96-token 8-bit generations took 604–620 ms with the graphs against
878–937 ms without (7 processes, all lossless), and the 8-bit verify forward's device
time fell from 47.7 ms to 33.8 ms with the same 1,709 kernels. And so, unlike 4-bit, is
an 8-bit target with dflash's matmul (session 71, an H100): 340–342 ms with the graphs
against 374–380 ms without. So direct launches are asked for only where they measured
faster: a target whose quantized matmuls run dflash's kernel at 4 bits in groups of 64
(:data:`dflash.kernel_patch.DIRECT_LAUNCHES_BY_QUANTIZATION`; without the graphs
groups of 128 and of 32 were not separated from them in sessions 75-77).

mlx reads ``MLX_USE_CUDA_GRAPHS`` once, at its first GPU evaluation in the process, so
the choice must be made before that. The ``dflash`` generate, chat and server commands
make it at their start; a library caller may call :func:`prefer_direct_launches` first
thing. A value the user set is always kept. On Metal and the CPU the variable is not
read, and nothing changes.

:func:`direct_launches_known` says whether the variable is known to have reached mlx
off (off before anything was evaluated). The cluster-sum matmul, which gives wrong bits
under mlx's graphs, is the default only then (session 64).
"""

from __future__ import annotations

import os
from typing import MutableMapping, Optional

import mlx.core as mx

GRAPHS_ENV = "MLX_USE_CUDA_GRAPHS"

# What the process had when dflash was imported (this module is the package's first
# import): the variable, and whether mlx had allocated anything yet (a GPU evaluation
# allocates its outputs, so a zero peak means mlx cannot have read the variable).
_GRAPHS_AT_IMPORT = os.environ.get(GRAPHS_ENV)
_NOTHING_ALLOCATED_BEFORE_IMPORT = mx.get_peak_memory() == 0
# The peak once dflash's own modules are imported (:func:`note_imported`), and whether
# :func:`prefer_direct_launches` set the variable with nothing allocated since.
_peak_after_import: Optional[int] = None
_set_before_use = False


def note_imported() -> None:
    """Once the package is imported (its constants allocated, nothing evaluated):
    record the peak memory, which :func:`prefer_direct_launches` compares against, and
    hand :func:`direct_launches_known` to the kernel layer, which cannot import it."""
    global _peak_after_import
    from .metal import backend

    backend.set_direct_launches_probe(direct_launches_known)
    if _peak_after_import is None:
        _peak_after_import = mx.get_peak_memory()


def prefer_direct_launches(
    environ: Optional[MutableMapping[str, str]] = None, *, host_paced: bool = True
) -> bool:
    """Ask mlx's CUDA backend for direct kernel launches unless the user chose.

    Call it before the process's first GPU evaluation: mlx reads the variable once.

    Args:
        environ: The environment to set (default ``os.environ``).
        host_paced: Whether the target's rounds are paced by the host: its quantized
            matmuls run dflash's kernel at 4 bits (groups of 64, Muse Glimmer: see
            :func:`dflash.cli.common.target_prefers_direct_launches`, which reads a
            model's config). False keeps mlx's graphs, measured faster for a dense
            target (bf16) and for an 8-bit one.

    Returns:
        True where this call set ``MLX_USE_CUDA_GRAPHS=0``; False where the variable
        was already set (by the user, or by an earlier call), which is kept as it is,
        or where ``host_paced`` is False.
    """
    global _set_before_use
    environ = os.environ if environ is None else environ
    if GRAPHS_ENV in environ or not host_paced:
        return False
    environ[GRAPHS_ENV] = "0"
    if environ is os.environ:
        _set_before_use = _nothing_evaluated()
    return True


def _nothing_evaluated() -> bool:
    """Whether mlx can have evaluated nothing yet: nothing was allocated before dflash
    was imported, and nothing since beyond the package's own constants."""
    return (
        _NOTHING_ALLOCATED_BEFORE_IMPORT
        and _peak_after_import is not None
        and mx.get_peak_memory() <= _peak_after_import
    )


def direct_launches_known() -> bool:
    """Whether mlx launches every kernel directly in this process, for certain.

    True when ``MLX_USE_CUDA_GRAPHS`` is off now and either was already off when
    dflash was imported (the user's setting, made before any evaluation as mlx
    requires) or :func:`prefer_direct_launches` set it before anything was evaluated.
    A setting made later is not known to have reached mlx (it reads the variable at
    its first GPU evaluation), so this is False: what depends on direct launches (the
    cluster-sum matmul, :data:`dflash.metal.tensor_qmm.CLUSTER_SUM`) is then not
    taken by default.
    """
    # Imported here: this module is the package's first import, before the kernel layer.
    from .metal.backend import cuda_graphs_off

    if not cuda_graphs_off(os.environ.get(GRAPHS_ENV)):
        return False
    return cuda_graphs_off(_GRAPHS_AT_IMPORT) or _set_before_use
