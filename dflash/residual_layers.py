"""Muse Glimmer's decoder layer with its post-norms, residual adds and pre-norm fused.

mlx-lm's Glimmer decoder layer (a sandwich of four centered RMS norms) runs, after the
attention's output projection, ``rms_norm``, the residual ``add`` and the MLP's
``rms_norm``, and after the MLP ``rms_norm`` and ``add``: five kernels.
:func:`layer_forward` is that forward with each group as one
:func:`dflash.metal.norms.residual_norm` launch (two), for the calls the kernel
route serves (at most ``max_queries`` tokens: decode steps and verify blocks); longer
calls keep mlx-lm's forward.

Traced layers (:mod:`dflash.traced_layers`, on by default) run the same two launches
inside their post-attention trace (:func:`after_attention`) when the residual norms
are on and every traced layer is one this module serves; the second launch then also
takes the next traced layer's input norm (``next_norm``: the hand-off).

The kernel's reference is mlx's own ops in mlx-lm's order, so on the CPU (and with
``use_kernel=False``) the forward gives the original's bits. Before a class is taken,
:func:`forward_matches` checks that: this forward (reference form) against the class's
own on a probe input, bit for bit, once per (class, dtype). An mlx-lm whose Glimmer
layer computes something else keeps its own forward. Only a layer of exactly the
re-stated class is taken (a tapped layer, whose class records its output, is not: its
recording would be skipped).

**On by default inside CUDA's traced layers only** (session 58, below);
``DFLASH_RESIDUAL_NORMS=1`` or ``KernelPatch(residual_norms=True)`` also puts it in eager
layers, ``0`` / ``False`` turns it off everywhere. Measured on an H200 (session 21, ``docs/benchmarks/h200-2026-12-02-s21``):
the kernel gives mlx's bits and cuts a 4-bit verify layer from 19.25 to 16.25 kernels,
but costs more than the five ops it replaces, on both sides:

* host: a custom-kernel launch costs 9-13 µs of build in the host's fast state (mlx's
  binding writes the kernel's whole source at every call; a compiled replay ~9.5) and
  6-8 µs of encode, against 0.6-0.7 and 4-4.5 for one of mlx's own ops (twice all of
  that in its slow state), so two launches cost more than three norms and two adds
  (15.9 + 17.0 against 12.7 + 8.7 µs);
* device: 27.2 µs a layer against 23.9 for mlx's norms and adds (one row a threadgroup
  of scalar loads, against mlx's vector loads).

The layer stack with it on was slower in 7 of 8 pairs across two runs.

Session 57 (an H100, ``docs/benchmarks/h100-2026-12-06-s57``) gave the CUDA form
16-byte vector copies of its four inputs and had the traced layers take it: mlx's bits
still, but 7.6-8.4 µs a launch against 3.4-4.4 for mlx's ``rms_norm``, and a tau = 6
round's device busy time 14.25 ms against 14.13 without it.

Session 58 (an H100, ``docs/benchmarks/h100-2026-12-06-s58``) summed each warp by xor
shuffles (no local memory, one barrier a sum) and loaded the epsilons at the start:
5.9-7.7 µs a launch, mlx's bits. With the hand-off, a verify layer's six norm and add
kernels became two, and tau = 6 rounds took 1.3-3.0 % less device time (4-bit and bf16,
faster in 6 of 7 adjacent pairs, lossless): the traced layers' default since.
"""

from __future__ import annotations

from typing import Any, Dict, Optional, Tuple

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from .held_norms import centered_scale, is_centered
from .metal import backend
from .metal.norms import reference_residual_norm, residual_norm
from .metal.prefetch import Prefetch

RESIDUAL_NORMS_ENV = "DFLASH_RESIDUAL_NORMS"
# (module, class name) of the decoder-layer forwards this module re-states (mlx-lm
# 0.32.2).
RESIDUAL_CLASSES = frozenset({("mlx_lm.models.muse_glimmer", "DecoderLayer")})
NORMS = (
    "input_layernorm",
    "post_attention_layernorm",
    "pre_feedforward_layernorm",
    "post_feedforward_layernorm",
)

# The probe's verdict per (class, dtype, layer geometry).
_VERDICTS: Dict[Tuple[type, mx.Dtype, tuple], bool] = {}


def residual_norms_wanted(
    use_residual_norms: Optional[bool] = None, traced: bool = False
) -> bool:
    """Whether the kernel patch fuses the layers' residual norms: the argument decides,
    else ``DFLASH_RESIDUAL_NORMS``, else on inside traced layers on CUDA (``traced``;
    measured faster there, with the hand-off, in session 58) and off for eager layers
    (measured slower; module docstring).

    Raises:
        ValueError: ``DFLASH_RESIDUAL_NORMS`` is set to something that is not a switch
            value.
    """
    default = traced and backend.BACKEND == "cuda"
    return backend.strict_switch(RESIDUAL_NORMS_ENV, use_residual_norms, default)


def serves(layer: nn.Module) -> bool:
    """Whether :func:`layer_forward` can stand for ``layer``'s own forward: exactly a
    class of :data:`RESIDUAL_CLASSES`, with the attention, MLP and four centered norms
    it reads."""
    base = type(layer)
    if (base.__module__, base.__name__) not in RESIDUAL_CLASSES:
        return False
    if not all(hasattr(layer, name) for name in ("self_attn", "mlp") + NORMS):
        return False
    return all(is_centered(getattr(layer, name)) for name in NORMS)


def _dtype(layer: nn.Module) -> mx.Dtype:
    """The dtype the layer's norms hold (its activations')."""
    return layer.post_attention_layernorm.weight.dtype


def layer_geometry(layer: nn.Module) -> tuple:
    """What a layer's probe verdict depends on besides its class and dtype: every
    parameter's name, shape and dtype (widths, quantization) and the attention's head
    counts and RoPE use. A verdict of one geometry does not carry over to another (on
    CUDA, mlx's kernels for a small head width do not give a re-stated forward's bits).
    """
    attn = layer.self_attn
    heads = tuple(
        getattr(attn, name, None) for name in ("n_heads", "n_kv_heads", "use_rope")
    )
    params = tuple(
        (name, tuple(value.shape), value.dtype)
        for name, value in tree_flatten(layer.parameters())
    )
    return heads + params


def layer_forward(
    layer: nn.Module, x: mx.array, mask: Any, cache: Any, use_kernel: Optional[bool]
) -> mx.array:
    """Glimmer's decoder-layer forward with each norm-add(-norm) group as one launch.

    Args:
        layer: The Glimmer decoder layer.
        x: The layer's input.
        mask: As mlx-lm passes it.
        cache: The layer's cache (or None).
        use_kernel: Passed to :func:`residual_norm`.

    Shapes: x ``(B, L, H)``; returns ``(B, L, H)``.
    """
    attended = layer.self_attn(layer.input_layernorm(x), mask, cache)
    return after_attention(layer, x, attended, use_kernel)[0]


def after_attention(
    layer: nn.Module,
    x: mx.array,
    attended: mx.array,
    use_kernel: Optional[bool],
    next_norm: Optional[nn.Module] = None,
    prefetch: Optional[Prefetch] = None,
) -> Tuple[mx.array, Optional[mx.array]]:
    """The layer after its attention: the post-attention norm, residual and
    pre-feedforward norm as one launch, the MLP, then its norm and residual as another
    (also the post-attention half of :mod:`dflash.traced_layers`' traces, with the
    residual norms on).

    Args:
        layer, x, attended: The layer, its input (the residual) and its attention's
            output projection.
        use_kernel: Passed to :func:`residual_norm`.
        next_norm: The next layer's input norm, taken by the last launch too (the
            traced layers' hand-off), or None.
        prefetch: The MLP's first weights, for the first launch to ask into the L2
            (:mod:`dflash.metal.prefetch`), or None.

    Shapes: x, attended ``(B, L, H)``; returns ``(B, L, H)`` twice (the second, the
    layer's output normed by ``next_norm``, None without it).
    """
    h, normed = _residual(
        attended,
        x,
        layer.post_attention_layernorm,
        layer.pre_feedforward_layernorm,
        use_kernel,
        prefetch,
    )
    return _residual(
        layer.mlp(normed), h, layer.post_feedforward_layernorm, next_norm, use_kernel
    )


def _residual(
    branch: mx.array,
    residual: mx.array,
    norm: nn.Module,
    next_norm: Optional[nn.Module],
    use_kernel: Optional[bool],
    prefetch: Optional[Prefetch] = None,
) -> Tuple[mx.array, Optional[mx.array]]:
    """``residual + norm(branch)`` and ``next_norm`` of it: one launch when the arrays
    share a dtype (carrying ``prefetch``), else mlx's ops (what the layer's own forward
    computes then).

    Shapes: branch, residual ``(B, L, H)``; returns ``(B, L, H)`` twice (the second None
    without ``next_norm``).
    """
    weight = centered_scale(norm)
    next_weight = None if next_norm is None else centered_scale(next_norm)
    next_eps = None if next_norm is None else next_norm.eps
    given = (branch, residual, weight) + (() if next_weight is None else (next_weight,))
    if len({array.dtype for array in given}) > 1:
        return reference_residual_norm(
            branch, residual, weight, norm.eps, next_weight, next_eps
        )
    return residual_norm(
        branch,
        residual,
        weight,
        norm.eps,
        next_weight=next_weight,
        next_eps=next_eps,
        use_kernel=use_kernel,
        prefetch=prefetch,
    )


def forward_matches(layer: nn.Module, base: type) -> bool:
    """Whether :func:`layer_forward` (reference form) gives ``base``'s own forward's
    bits on a probe input for ``layer`` (cached per class, dtype and
    :func:`layer_geometry`)."""
    dtype = _dtype(layer)
    verdict = (base, dtype, layer_geometry(layer))
    if verdict not in _VERDICTS:
        hidden = layer.post_attention_layernorm.weight.shape[0]
        probe = mx.random.normal((1, 3, hidden), key=mx.random.key(0)).astype(dtype)
        own = base.__call__(layer, probe, None, None)
        # :func:`layer_forward` with the hand-off: its next norm must give what the
        # class's own input norm gives the output (the layer's own input norm stands in
        # for the next layer's: the same class).
        attended = layer.self_attn(layer.input_layernorm(probe), None, None)
        ours, normed = after_attention(
            layer, probe, attended, False, layer.input_layernorm
        )
        _VERDICTS[verdict] = (
            own.dtype == ours.dtype
            and bool(mx.array_equal(own, ours))
            and bool(mx.array_equal(normed, layer.input_layernorm(own)))
        )
    return _VERDICTS[verdict]
