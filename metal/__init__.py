"""Custom GPU kernels for the DFlash KV cache.

Each operation has one contract and three forms: a Metal body
(``mx.fast.metal_kernel``), its CUDA twin (``mx.fast.cuda_kernel``, same body,
same index arithmetic) and a pure-MLX reference. Wrappers dispatch on
``mx.metal.is_available()`` / ``mx.cuda.is_available()``; ``use_kernel=False``
forces the reference, ``use_kernel=True`` the kernel, ``None`` (default) picks
per operation, and ``DFLASH_KERNELS=0`` makes ``None`` pick the reference (see
``docs/metal.md``). ``dflash.cache`` runs them on its hot path: the staging
shadow (:class:`ShadowStager`, built from the model's separate keys and values by
:func:`stage_shadow_kv`), the in-place store (:func:`ring_write`) and,
for non-staged writes under a checkpoint, :func:`retain_rows`. On CUDA the
shadow's default is the reference form, which measured at least as fast there.
"""

from .backend import kernel_backend
from .checkpoint import restore_rows, retain_rows
from .ring import (
    ShadowStager,
    ring_store,
    ring_write,
    stage_shadow,
    stage_shadow_kv,
    wrapped_index,
    wrapped_rows,
)

__all__ = [
    "ShadowStager",
    "kernel_backend",
    "restore_rows",
    "retain_rows",
    "ring_store",
    "ring_write",
    "stage_shadow",
    "stage_shadow_kv",
    "wrapped_index",
    "wrapped_rows",
]
