"""Custom GPU kernels for the DFlash KV cache.

Each operation has one contract and three forms: a Metal body
(``mx.fast.metal_kernel``), its CUDA twin (``mx.fast.cuda_kernel``, same body,
same index arithmetic) and a pure-MLX reference. One public entry per operation,
each with ``use_kernel=``: False forces the reference, True the kernel, None
(default) picks per operation, and ``DFLASH_KERNELS=0`` makes None pick the
reference (see ``docs/metal.md``):

* :func:`ring_write`: store rows into a ring at wrapped positions;
* :class:`ShadowStager`: the staging shadow (``stager(...)``), and the same for
  a stacked K/V ring from the model's separate keys and values
  (``stager.pair(...)``);
* :func:`retain_rows` / :func:`restore_rows`: gather the rows a block will
  overwrite from many planes in one launch, and put them back;
* :func:`small_query_attention`: 1 to 32 queries over a plane's live rows read
  in place (a wrapped ring in logical order) plus a held-back block, window and
  causal limits from positions, batch-invariant (:mod:`dflash.metal.attention`);
* :func:`small_row_matmul`: ``x @ W.T`` for 1 to 32 rows, dense or mlx's
  affine-quantized weights, batch-invariant (:mod:`dflash.metal.qmm`);
* :func:`head_prep`: the RMS norms, scale and RoPE of a layer's queries and keys
  in one launch, with mlx's arithmetic (:mod:`dflash.metal.heads`);
* :func:`residual_norm`: a branch's RMS norm, the residual add and the next RMS
  norm in one launch, with mlx's arithmetic (:mod:`dflash.metal.norms`).

The verify kernels (the last five) cooperate inside threadgroups; their shared
bodies, per-backend headers and prologues are described in :mod:`dflash.metal.groups`.

The kernels take arrays, never cache objects: ``dflash.cache`` runs them on its
hot path. What ``use_kernel=None`` picks for the shadow on each backend, and the
measurement behind it, is in :mod:`dflash.metal.backend`.
"""

from .attention import KeyPlane, small_query_attention
from .backend import kernel_backend
from .heads import head_prep
from .norms import residual_norm
from .qmm import small_row_matmul
from .retain import restore_rows, retain_rows
from .ring import ShadowStager, ring_write, wrapped_rows

__all__ = [
    "KeyPlane",
    "ShadowStager",
    "head_prep",
    "kernel_backend",
    "residual_norm",
    "restore_rows",
    "retain_rows",
    "ring_write",
    "small_query_attention",
    "small_row_matmul",
    "wrapped_rows",
]
