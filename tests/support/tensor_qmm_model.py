"""A numpy model of the tensor-core matmul (``dflash.metal.tensor_qmm``), lane by lane.

It rebuilds what each lane of the CUDA body holds, with the body's own bit
operations (``__byte_perm`` pairs of x and dense weights, nibble / byte
extraction of packed words), places the registers into the m16n8k16 A and B
matrices by PTX's fragment layout, and runs the kernel's sequence: per mma step
a tensor-core sum, per group ``fma(scale, dot, fma(bias, xsum, acc))`` (dense:
``acc + dot`` per chunk), the K split of :func:`~dflash.metal.tensor_qmm.split_plan`
and the split partials added in order, one rounding to x's dtype.

The tensor-core sum is modelled pessimistically after the published behaviour of
NVIDIA's float32-accumulating mma (Fasi et al. 2021): products exact, every term
truncated to the 24-bit window of the largest one, the sum truncated to float32.
"""

from __future__ import annotations

from typing import Callable, Optional

import mlx.core as mx
import numpy as np

from dflash.metal import tensor_qmm

SUB = tensor_qmm.SUB
U32 = np.uint32


def byte_perm(a: np.ndarray, b: np.ndarray, selector: int) -> np.ndarray:
    """CUDA's ``__byte_perm(a, b, s)``: result byte i is byte ``s >> 4i & 7`` of ``b:a``."""
    pool = [(a >> U32(8 * i)) & U32(0xFF) for i in range(4)]
    pool += [(b >> U32(8 * i)) & U32(0xFF) for i in range(4)]
    out = np.zeros_like(a, dtype=U32)
    for i in range(4):
        out |= pool[(selector >> (4 * i)) & 7] << U32(8 * i)
    return out


def pairs(halves: np.ndarray) -> np.ndarray:
    """``dfl_pairs``: eight 16-bit elements (last axis) -> registers ``(e_p, e_{p+4})``."""
    e = halves.astype(U32)
    v = [e[..., 2 * i] | (e[..., 2 * i + 1] << U32(16)) for i in range(4)]
    regs = [
        byte_perm(v[0], v[2], 0x5410),
        byte_perm(v[0], v[2], 0x7632),
        byte_perm(v[1], v[3], 0x5410),
        byte_perm(v[1], v[3], 0x7632),
    ]
    return np.stack(regs, axis=-1)


def halves_of(regs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Low and high 16-bit halves of 32-bit registers."""
    return regs & U32(0xFFFF), regs >> U32(16)


def x_registers(x: mx.array) -> np.ndarray:
    """Each row's lane registers: ``(rows, sub-chunks, tig, 4)`` of ``(e_p, e_{p+4})``."""
    raw = np.asarray(x.view(mx.uint16))
    rows, depth = raw.shape
    return pairs(raw.reshape(rows, depth // SUB, 4, 8))


def weight_registers(weight: mx.array, bits: Optional[int]) -> np.ndarray:
    """Each column's lane registers ``(N, sub-chunks, tig, 4)``, as the body extracts them.

    4-bit: word ``4 sc + tig``, ``r_p`` = the 4-bit fields at bits ``4p`` and
    ``4p + 16``. 8-bit: words ``8 sc + 2 tig`` and the next, ``r_p`` = byte ``p`` of
    each. Dense: ``dfl_pairs`` of the 8 elements ``8 tig ..``. The halves hold
    integers ``q`` (affine) or element bits (dense).
    """
    if bits is None:
        return x_registers(weight)
    packed = np.asarray(weight).astype(U32)
    columns = packed.shape[0]
    if bits == 4:
        words = packed.reshape(columns, -1, 4)
        regs = [
            ((words >> U32(4 * p)) & U32(0xF))
            | (((words >> U32(4 * p + 16)) & U32(0xF)) << U32(16))
            for p in range(4)
        ]
    else:
        words = packed.reshape(columns, -1, 4, 2)
        regs = [
            ((words[..., 0] >> U32(8 * p)) & U32(0xFF))
            | (((words[..., 1] >> U32(8 * p)) & U32(0xFF)) << U32(16))
            for p in range(4)
        ]
    return np.stack(regs, axis=-1)


def logical_operand(regs: np.ndarray, step: int) -> np.ndarray:
    """The 16 logical k of one mma step from lane registers, by PTX's layout.

    A (per row) and B (per column) alike: the lane's first register of the step
    (``r_{2 step}``) holds logical ``k = 2 tig, 2 tig + 1`` (low, high half), the
    second (``r_{2 step + 1}``) ``2 tig + 8, 2 tig + 9``.

    Shapes: regs ``(..., sub-chunks, 4 tig, 4)``; returns ``(..., sub-chunks, 16)``
    of 16-bit words.
    """
    out = np.zeros(regs.shape[:-2] + (16,), dtype=U32)
    for tig in range(4):
        for which in range(2):
            low, high = halves_of(regs[..., tig, 2 * step + which])
            out[..., 2 * tig + 8 * which] = low
            out[..., 2 * tig + 8 * which + 1] = high
    return out


def to_float(words: np.ndarray, dtype: mx.Dtype) -> np.ndarray:
    """16-bit words of ``dtype`` as float64."""
    if dtype == mx.float16:
        return words.astype(np.uint16).view(np.float16).astype(np.float64)
    return (words.astype(U32) << U32(16)).view(np.float32).astype(np.float64)


def _toward_zero(values: np.ndarray) -> np.ndarray:
    """float64 -> float32, truncated."""
    out = values.astype(np.float32)
    over = np.abs(out.astype(np.float64)) > np.abs(values)
    out[over] = np.nextafter(out[over], np.float32(0))
    return out


def tensor_core_step(c: np.ndarray, a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """``c + a @ b.T`` the way the model's tensor core adds (see the module docstring).

    Shapes: c ``(R, N)`` float32; a ``(R, 16)``; b ``(N, 16)``; returns ``(R, N)``.
    """
    terms = a[:, None, :] * b[None, :, :]
    terms = np.concatenate([terms, c.astype(np.float64)[..., None]], axis=-1)
    biggest = np.max(np.abs(terms), axis=-1, keepdims=True)
    _, exponent = np.frexp(np.where(biggest > 0, biggest, 1.0))
    unit = np.ldexp(1.0, exponent - 24)
    return _toward_zero(np.sum(np.trunc(terms / unit) * unit, axis=-1))


def exact_step(c: np.ndarray, a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """``c + a @ b.T`` summed exactly, rounded once (an ideal tensor core)."""
    return (c.astype(np.float64) + a @ b.T).astype(np.float32)


def fma32(a, b, c) -> np.ndarray:
    """float32 fused multiply-add (float32 products are exact in float64)."""
    return (
        np.asarray(a, np.float64) * np.asarray(b, np.float64)
        + np.asarray(c, np.float64)
    ).astype(np.float32)


def model_matmul(
    x: mx.array,
    weight: mx.array,
    scales: Optional[mx.array],
    biases: Optional[mx.array],
    bits: Optional[int],
    group_size: Optional[int],
    step: Callable = tensor_core_step,
    weight_regs: Optional[np.ndarray] = None,
    keep_float32: bool = False,
    folded: bool = False,
) -> mx.array:
    """The tensor-core form's result for a served call, per the module docstring.

    Args:
        x, weight, scales, biases, bits, group_size: The call.
        step: One mma step's sum (:func:`tensor_core_step` or :func:`exact_step`).
        weight_regs: Lane registers to use for B instead of the body's extraction
            (a negative control passes wrong ones).
        keep_float32: Return the float32 sums (before the rounding to x's dtype).
        folded: The folded-offset 4-bit form: in bfloat16 the mma takes ``128 + q``
            and each group's bias is ``fma(-128, scale, bias)`` (float16 is unchanged).

    Shapes: x ``(M, K)``; returns ``(M, N)`` in x's dtype.
    """
    rows, depth = x.shape
    columns = weight.shape[0]
    dtype = x.dtype
    a_regs = x_registers(x)
    b_regs = weight_registers(weight, bits) if weight_regs is None else weight_regs
    a = [to_float(logical_operand(a_regs, s), dtype) for s in range(2)]
    if bits is None:
        b = [to_float(logical_operand(b_regs, s), dtype) for s in range(2)]
        close_every = tensor_qmm.Layout(0, 1).chunk
    else:
        offset = 128.0 if folded and bits == 4 and dtype == mx.bfloat16 else 0.0
        b = [logical_operand(b_regs, s).astype(np.float64) + offset for s in range(2)]
        s_all = np.asarray(scales.astype(mx.float32))
        b_all = np.asarray(biases.astype(mx.float32))
        if offset:
            b_all = fma32(-offset, s_all, b_all)
        close_every = group_size
    ones = np.ones((1, 16))
    chunk = tensor_qmm.Layout(bits or 0, 1).chunk
    _, splits, per_split = tensor_qmm.split_plan(depth, columns, bits)
    total = None
    for split in range(splits):
        first = split * per_split * chunk
        last = min(depth, first + per_split * chunk)
        acc = np.zeros((rows, columns), np.float32)
        dot = np.zeros((rows, columns), np.float32)
        xsum = np.zeros((rows, 1), np.float32)
        for k0 in range(first, last, SUB):
            sc = k0 // SUB
            for s in range(2):
                if bits is not None:
                    xsum = step(xsum, a[s][:, sc], ones)
                dot = step(dot, a[s][:, sc], b[s][:, sc])
            if (k0 + SUB) % close_every:
                continue
            if bits is None:
                acc = (acc.astype(np.float64) + dot).astype(np.float32)
            else:
                g = k0 // group_size
                acc = fma32(s_all[None, :, g], dot, fma32(b_all[None, :, g], xsum, acc))
                xsum = np.zeros_like(xsum)
            dot = np.zeros_like(dot)
        total = (
            acc
            if total is None
            else (total.astype(np.float64) + acc).astype(np.float32)
        )
    return mx.array(total) if keep_float32 else mx.array(total).astype(dtype)


def wrong_pairs(weight: mx.array, bits: Optional[int]) -> np.ndarray:
    """B registers paired ``(e_p, e_{p+1})``-style (the plain layout): a negative control."""
    regs = weight_registers(weight, bits)
    low, high = halves_of(regs)
    # Swap the high halves of r_0 <-> r_1 and r_2 <-> r_3: k order no longer matches A.
    high = high[..., [1, 0, 3, 2]]
    return low | (high << U32(16))


def emulated_swiglu(gate: mx.array, up: mx.array) -> np.ndarray:
    """The SwiGLU form's activation as the CPU emulation computes it (float32 sigmoid
    ``1 / (1 + exp|g|)`` mirrored for g >= 0, each step rounded to the dtype), float32.

    Shapes: gate, up ``(..., N)``; returns the same.
    """
    dtype = gate.dtype
    g = np.array(gate.astype(mx.float32))
    y = (1.0 / (1.0 + np.exp(np.abs(g)))).astype(np.float32)
    sig = np.where(g < 0, y, np.float32(1) - y).astype(np.float32)

    def rounded(values: np.ndarray) -> np.ndarray:
        return np.array(mx.array(values).astype(dtype).astype(mx.float32))

    return rounded(rounded(g * rounded(sig)) * np.array(up.astype(mx.float32)))
