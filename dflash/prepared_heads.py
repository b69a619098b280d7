"""Muse Glimmer's attention forward with its heads prepared in one launch.

mlx-lm's Glimmer attention runs five small kernels between its q/k projections and the
attention: a scaleless RMS norm of the queries and of the keys, the queries' multiply
by ``qk_scale_factor``, and RoPE of each (on sliding layers). :func:`attention_forward`
is that forward with those five replaced by one :func:`dflash.metal.heads.head_prep`
launch, for the calls the kernel route serves (at most ``max_queries`` tokens: decode
steps and verify blocks); longer calls keep mlx-lm's forward.

The head prep's reference is mlx's own ops in mlx-lm's order, so on the CPU (and with
``use_kernel=False``) the forward gives the original's bits. Before a class is taken,
:func:`forward_matches` checks that: this forward (reference form) against the class's
own on a probe input, bit for bit, once per (class, RoPE or not, dtype). An mlx-lm
whose Glimmer attention computes something else keeps its own forward.

The output gate (``out * sigmoid(gate_proj(x))``) is handed to the kernel route, which
applies it in the attention's last pass (the fold's epilogue, mlx's own ``Sigmoid`` and
``Multiply`` on CUDA): two kernels fewer a layer. A call the route does not serve runs
mlx-lm's attention and gate, and so does every call where :func:`gated_fold_matches`'
probe (once per backend and dtype, at install) does not show mlx's bits.

With a dflash KV plane (head-major) as the cache, the head prep also lays the keys and
the values out as the stacked block the plane stores, and hands it over with
``update_and_fetch_block``: the plane's ``mx.stack`` (two copy kernels a layer) is gone,
and the block's bits are the stack's.

Switches: ``DFLASH_HEAD_PREP=0`` keeps mlx-lm's forward (routed as before);
``DFLASH_GATE_EPILOGUE=0`` keeps the gate as mlx's two ops; ``DFLASH_HEAD_PREP_BLOCK=0``
keeps the plane's stack. All default on wherever the kernel patch routes attention.
"""

from __future__ import annotations

import sys
from functools import partial
from typing import Any, Callable, Dict, Optional, Tuple

import mlx.core as mx
import mlx.nn as nn

from .metal import backend
from .metal.attention import KeyPlane, small_query_attention
from .metal.heads import head_prep, rope_served

HEAD_PREP_ENV = "DFLASH_HEAD_PREP"
GATE_EPILOGUE_ENV = "DFLASH_GATE_EPILOGUE"
KV_BLOCK_ENV = "DFLASH_HEAD_PREP_BLOCK"
# (module, class name) of the attention forwards this module re-states (mlx-lm 0.32.2).
PREPARED_CLASSES = frozenset({("mlx_lm.models.muse_glimmer", "Attention")})

# The probe's verdict per (class, uses RoPE, dtype, head geometry): mlx's kernels for
# one head width may round where another's do not.
_VERDICTS: Dict[Tuple[type, bool, mx.Dtype, tuple], bool] = {}


def head_prep_wanted(use_head_prep: Optional[bool] = None) -> bool:
    """Whether the kernel patch prepares heads in one launch: ``use_head_prep`` decides,
    else ``DFLASH_HEAD_PREP``, else on.

    Raises:
        ValueError: ``DFLASH_HEAD_PREP`` is set to something that is not a switch value.
    """
    return backend.strict_switch(HEAD_PREP_ENV, use_head_prep)


def gate_epilogue_wanted(use_gate_epilogue: Optional[bool] = None) -> bool:
    """Whether prepared attention hands its output gate to the kernel route (applied in
    the attention's last pass): the argument decides, else ``DFLASH_GATE_EPILOGUE``,
    else on.

    Raises:
        ValueError: ``DFLASH_GATE_EPILOGUE`` is set to something that is not a switch
            value.
    """
    return backend.strict_switch(GATE_EPILOGUE_ENV, use_gate_epilogue)


def kv_block_wanted(use_kv_block: Optional[bool] = None) -> bool:
    """Whether prepared attention has its head prep lay the keys and values out as the
    block a dflash KV plane stores (one launch instead of the two copies of the plane's
    ``mx.stack``): the argument decides, else ``DFLASH_HEAD_PREP_BLOCK``, else on.

    Raises:
        ValueError: ``DFLASH_HEAD_PREP_BLOCK`` is set to something that is not a switch
            value.
    """
    return backend.strict_switch(KV_BLOCK_ENV, use_kv_block)


# The gated fold's verdict per (backend, dtype): its bits against the plain fold and
# mlx's sigmoid and multiply on a tiny call (False where it cannot even be built).
_GATED_VERDICTS: Dict[Tuple[Optional[str], mx.Dtype], bool] = {}


def gated_fold_matches(dtype: mx.Dtype, use_kernel: Optional[bool]) -> bool:
    """Whether the route's gated fold gives mlx's bits for ``dtype`` here.

    The reference form is mlx's ops (True). The kernel form is probed once per backend
    and dtype: the fold with the gate against the plain fold, then ``* mx.sigmoid``. On
    CUDA the epilogue is mlx's own functor from a header its JIT provides; an mlx whose
    header differs, or lacks it, keeps mlx-lm's two ops rather than failing mid-run.
    """
    if use_kernel is False or not backend.use_kernel_path(use_kernel, True):
        return True
    return backend.probed(
        _GATED_VERDICTS, (backend.BACKEND, dtype), partial(_gated_fold_probe, dtype)
    )


def _gated_fold_probe(dtype: mx.Dtype) -> bool:
    """The gated fold against the plain fold times ``mx.sigmoid(gate)``, bit for bit,
    on 2 queries of 2 heads of 128 (the width of Glimmer's heads) over a 5-row plane."""
    keys = mx.random.split(mx.random.key(0), 3)
    queries = mx.random.normal((1, 2, 2, 128), key=keys[0]).astype(dtype)
    rows = mx.random.normal((2, 1, 1, 8, 128), key=keys[1]).astype(dtype)
    gate = (4.0 * mx.random.normal((1, 2, 256), key=keys[2])).astype(dtype)
    plane = KeyPlane(rows[0], rows[1], 5, 0, 0)
    block_keys, block_values = rows[0][:, :, 5:7], rows[1][:, :, 5:7]
    call = partial(
        small_query_attention, queries, plane, block_keys, block_values, scale=0.25
    )
    gated = call(gate=gate, use_kernel=True).transpose(0, 2, 1, 3).reshape(1, 2, -1)
    plain = call(use_kernel=True).transpose(0, 2, 1, 3).reshape(1, 2, -1)
    want = plain * mx.sigmoid(gate)
    return bool(mx.array_equal(gated, want))


def activation_dtype(module: nn.Module) -> mx.Dtype:
    """The dtype the module's projections compute in (their scales' or weight's)."""
    projection = module.q_proj
    return getattr(projection, "scales", projection.weight).dtype


def serves(module: nn.Module) -> bool:
    """Whether :func:`attention_forward` can stand for ``module``'s own forward: a class
    of :data:`PREPARED_CLASSES` with the attributes it reads and mlx's default RoPE over
    the whole head."""
    base = type(module)
    if (base.__module__, base.__name__) not in PREPARED_CLASSES:
        return False
    names = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "n_heads")
    names += ("n_kv_heads", "head_dim", "scale", "qk_scale_factor", "eps", "use_rope")
    if not all(hasattr(module, name) for name in names):
        return False
    if not module.use_rope:
        return True
    return rope_served(getattr(module, "rope", None), module.head_dim)


def attention_forward(
    module: nn.Module,
    x: mx.array,
    mask: Any,
    cache: Any,
    attend: Callable,
    use_kernel: Optional[bool],
    gated_attend: Optional[Callable] = None,
    kv_block: bool = False,
    rows_in_place: bool = False,
) -> mx.array:
    """Glimmer's attention forward, q/k norm, scale and RoPE in one launch.

    Args:
        module: The Glimmer attention module.
        x: The layer's input.
        mask: As mlx-lm passes it.
        cache: The layer's cache (or None).
        attend: The model module's ``scaled_dot_product_attention`` (hooked or not).
        use_kernel: Passed to :func:`head_prep`.
        gated_attend: The kernel route's attention taking the output gate (it returns
            None for a call it does not serve; then ``attend`` and mlx-lm's gate run).
        kv_block: Where the cache is a head-major dflash plane, have the head prep
            write the keys and values as the stacked block the plane stores
            (``update_and_fetch_block``): the same bits, two copies fewer.
        rows_in_place: The caller's word that ``gated_attend`` serves this call
            whatever the plane (its mask and length are ones the route takes): with
            ``kv_block``, the plane is then not asked for the rows the route reads in
            place (no shadow or views built for nothing).

    Shapes: x ``(B, L, H)``; returns ``(B, L, H)``.
    """
    batch, length, _ = x.shape
    queries = module.q_proj(x).reshape(batch, length, module.n_heads, module.head_dim)
    keys = module.k_proj(x).reshape(batch, length, module.n_kv_heads, module.head_dim)
    values = module.v_proj(x).reshape(batch, length, module.n_kv_heads, module.head_dim)
    rope = module.rope if module.use_rope else None
    block = (
        kv_block
        and getattr(cache, "head_major", False)
        and hasattr(cache, "update_and_fetch_block")
    )
    queries, keys = head_prep(
        queries,
        keys,
        eps=module.eps,
        q_scale=module.qk_scale_factor,
        rope_base=None if rope is None else rope.base,
        rope_scale=1.0 if rope is None else rope.scale,
        start=cache.offset if cache is not None and rope is not None else 0,
        values=values if block else None,
        use_kernel=use_kernel,
    )
    queries = queries.transpose(0, 2, 1, 3)
    gate = module.gate_proj(x)
    gated = gated_attend is not None and gate.dtype == queries.dtype
    if block:  # keys is the stacked (2, B, Hkv, L, D) block
        fetched = cache.update_and_fetch_block(
            keys, fetch=not (gated and rows_in_place)
        )
        keys, values = (None, None) if fetched is None else fetched
    else:
        keys = keys.transpose(0, 2, 1, 3)
        values = values.transpose(0, 2, 1, 3)
        if cache is not None:
            keys, values = cache.update_and_fetch(keys, values)
    out = None
    if gated:
        out = gated_attend(queries, keys, values, cache, module.scale, mask, gate)
    if out is not None:  # gated inside the attention's last pass
        return module.o_proj(out.transpose(0, 2, 1, 3).reshape(batch, length, -1))
    if keys is None:
        raise RuntimeError(
            "the kernel route declined an attention call whose rows it was to read in "
            "place (rows_in_place was given for a call it does not serve)"
        )
    out = attend(queries, keys, values, cache=cache, scale=module.scale, mask=mask)
    out = out.transpose(0, 2, 1, 3).reshape(batch, length, -1)
    out = out * mx.sigmoid(gate)
    return module.o_proj(out)


def model_attention(base: type) -> Callable:
    """The ``scaled_dot_product_attention`` of ``base``'s model module, as it is now
    (the kernel patch's dispatcher while installed)."""
    return sys.modules[base.__module__].scaled_dot_product_attention


def forward_matches(module: nn.Module, base: type) -> bool:
    """Whether :func:`attention_forward` (reference form) gives ``base``'s own forward's
    bits on a probe input for ``module`` (cached per class, RoPE use, dtype and heads).
    """
    dtype = activation_dtype(module)
    geometry = (module.n_heads, module.n_kv_heads, module.head_dim)
    verdict = (base, bool(module.use_rope), dtype, geometry)
    if verdict not in _VERDICTS:
        hidden = module.o_proj.weight.shape[0]  # o_proj's outputs, packed or not
        probe = mx.random.normal((1, 3, hidden), key=mx.random.key(0)).astype(dtype)
        own = base.__call__(module, probe, mask=None, cache=None)
        ours = attention_forward(
            module, probe, None, None, model_attention(base), use_kernel=False
        )
        _VERDICTS[verdict] = own.dtype == ours.dtype and bool(mx.array_equal(own, ours))
    return _VERDICTS[verdict]
