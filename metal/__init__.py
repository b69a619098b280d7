"""Custom GPU kernels for the DFlash KV cache.

Each operation has one contract and three forms: a Metal body
(``mx.fast.metal_kernel``), its CUDA twin (``mx.fast.cuda_kernel``, same body,
same index arithmetic) and a pure-MLX reference. Wrappers dispatch on
``mx.metal.is_available()`` / ``mx.cuda.is_available()``; ``use_kernel=False``
forces the reference, ``use_kernel=True`` the kernel, ``None`` (default) picks
per operation (see ``docs/metal.md``).
"""

from .backend import kernel_backend
from .checkpoint import restore_rows, retain_rows
from .ring import ring_store, stage_shadow, wrapped_rows

__all__ = [
    "kernel_backend",
    "restore_rows",
    "retain_rows",
    "ring_store",
    "stage_shadow",
    "wrapped_rows",
]
