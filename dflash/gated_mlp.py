"""A gated MLP's ``silu(gate_proj(x)) * up_proj(x)`` as the fused gate / up launch.

mlx-lm's SwiGLU MLPs (Muse Glimmer, Llama, Qwen 3) run, after the one launch that
:mod:`dflash.fused_projections` makes of ``gate_proj`` and ``up_proj``, two more kernels
a layer: ``nn.silu`` (one compiled kernel) and the product with ``up``. The tensor-core
matmul's SwiGLU form (:func:`dflash.metal.tensor_qmm.bind_tensor_core` with
``swiglu=True``) applies both in its last step and stores ``(rows, N / 2)``: two
kernels fewer a layer, and the gate / up outputs never leave the launch.

**The same bits.** The form's column sums are the plain form's, and on CUDA its
activation is mlx's own ``Sigmoid`` functor and ``T * T`` products, each step in the
dtype as mlx's compiled ``nn.silu`` keeps it. Two probes guard that before a module is
taken: :func:`forward_matches` (the class's own forward against
``down_proj(nn.silu(gate_proj(x)) * up_proj(x))``, bit for bit, once per class and
dtype) and :func:`kernel_matches` (the SwiGLU launch against the plain launch followed
by mlx's ``nn.silu`` and ``*``, once per backend and dtype; an mlx whose functor
differs, or a form that does not build, keeps the two kernels).

Calls the form does not serve (prefill chunks, other backends, geometries it refuses)
keep the module's own forward.

**Opt-in** (``DFLASH_SWIGLU=1`` or ``KernelPatch(swiglu=True)``). On an H200 (session
23, ``docs/benchmarks/h200-2026-12-02-s23``) its bits are mlx's (the ``cuda`` tests,
both K-group forms; 8 full-size layers bit-equal) and it takes a 4-bit verify layer
from 15.25 kernels to 13.25, but nothing measured faster: the device's busy time is
the same (288.7-299.6 µs a layer either way), the layer stack's wall was lower in 1 of
3 reps, and DFlash rounds with the traced layers were faster in 3 of 6 pairs (median
ratio 0.98). The kernel probe keeps mlx's two kernels wherever its bits differ.
"""

from __future__ import annotations

from functools import partial
from typing import Dict, Optional, Tuple, Type

import mlx.core as mx
import mlx.nn as nn

from .metal import backend, tensor_qmm

SWIGLU_ENV = "DFLASH_SWIGLU"

# The probes' verdicts: per (class, dtype), per (backend, dtype).
_FORWARD_VERDICTS: Dict[Tuple[type, mx.Dtype], bool] = {}
_KERNEL_VERDICTS: Dict[Tuple[Optional[str], mx.Dtype], bool] = {}


def swiglu_wanted(use_swiglu: Optional[bool] = None) -> bool:
    """Whether the kernel patch runs gated MLPs' activation inside the gate / up launch:
    the argument decides, else ``DFLASH_SWIGLU``, else off (same bits, not measured
    faster; module docstring).

    Raises:
        ValueError: ``DFLASH_SWIGLU`` is set to something that is not a switch value.
    """
    return backend.strict_switch(SWIGLU_ENV, use_swiglu, default=False)


def serves(module: nn.Module) -> bool:
    """Whether ``module`` has the ``gate_proj`` / ``up_proj`` / ``down_proj`` linear
    layers a SwiGLU MLP forward reads."""
    linear = (nn.Linear, nn.QuantizedLinear)
    return all(
        isinstance(getattr(module, name, None), linear)
        for name in ("gate_proj", "up_proj", "down_proj")
    )


def activation_dtype(module: nn.Module) -> mx.Dtype:
    """The dtype the module's projections compute in (their scales' or weight's)."""
    projection = module.gate_proj
    return getattr(projection, "scales", projection.weight).dtype


def reference_forward(module: nn.Module, x: mx.array) -> mx.array:
    """``down_proj(nn.silu(gate_proj(x)) * up_proj(x))``: what a module is taken for.

    Shapes: x ``(..., H)``; returns ``(..., H)``.
    """
    return module.down_proj(nn.silu(module.gate_proj(x)) * module.up_proj(x))


def forward_matches(module: nn.Module, base: Type[nn.Module]) -> bool:
    """Whether ``base``'s own forward gives :func:`reference_forward`'s bits on a probe
    input for ``module`` (cached per class and dtype)."""
    dtype = activation_dtype(module)
    key = (base, dtype)
    if key not in _FORWARD_VERDICTS:
        hidden = module.down_proj.weight.shape[0]  # down_proj's outputs
        probe = mx.random.normal((1, 3, hidden), key=mx.random.key(0)).astype(dtype)
        own = base.__call__(module, probe)
        ours = reference_forward(module, probe)
        _FORWARD_VERDICTS[key] = own.dtype == ours.dtype and bool(
            mx.array_equal(own, ours)
        )
    return _FORWARD_VERDICTS[key]


def form_available(use_kernel: Optional[bool]) -> bool:
    """Whether the SwiGLU form can run here: CUDA (its tensor-core matmul) with the
    kernel path on (``use_kernel`` None or True)."""
    return (
        use_kernel is not False
        and backend.BACKEND == tensor_qmm.CUDA
        and backend.use_kernel_path(use_kernel, True)
    )


def kernel_matches(dtype: mx.Dtype, use_kernel: Optional[bool]) -> bool:
    """Whether the SwiGLU launch gives mlx's bits for ``dtype`` here: probed once per
    backend and dtype where :func:`form_available`, False where the form cannot even
    be built (or is not available)."""
    if not form_available(use_kernel):
        return False
    return backend.probed(
        _KERNEL_VERDICTS, (backend.BACKEND, dtype), partial(_kernel_probe, dtype)
    )


def _kernel_probe(dtype: mx.Dtype) -> bool:
    """The SwiGLU launch against the plain one, then ``nn.silu`` and ``*``, bit for
    bit: 4-bit (group 64) gate and up of 128 columns each over K = 256, 3 rows."""
    keys = mx.random.split(mx.random.key(1), 2)
    x = mx.random.normal((3, 256), key=keys[0]).astype(dtype)
    dense = (0.3 * mx.random.normal((256, 256), key=keys[1])).astype(dtype)
    weight, scales, biases = mx.quantize(dense, group_size=64, bits=4)
    if not tensor_qmm.swiglu_takes(dtype, 3, 256, 256, 4):
        return False

    def launch(swiglu: bool) -> mx.array:
        call = tensor_qmm.bind_tensor_core(
            3, 256, weight, scales, biases, 4, 64, dtype, swiglu=swiglu
        )
        return call(x)

    plain = launch(False)
    want = nn.silu(plain[:, :128]) * plain[:, 128:]
    return bool(mx.array_equal(launch(True), want))
