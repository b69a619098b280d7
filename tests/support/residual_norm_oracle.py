"""A step-by-step NumPy oracle of the residual-norm kernel's arithmetic (float32, mlx's
small-row RMS norm's summation order and roundings, the Metal form's add), so the
emulated kernel can be held to it bit for bit."""

from __future__ import annotations

from typing import Optional, Tuple

import mlx.core as mx
import numpy as np

from dflash.metal import norms as rn

from .head_prep_oracle import round_to


def _tree(values: np.ndarray) -> np.ndarray:
    """Per row, a halving tree over the last axis (32 slots): ``s[i] += s[i + m]``."""
    tree = values.copy()
    m = tree.shape[1] // 2
    while m:
        tree[:, :m] = tree[:, :m] + tree[:, m : 2 * m]
        m //= 2
    return tree[:, 0]


def sum_of_squares(rows: np.ndarray, dtype: mx.Dtype) -> np.ndarray:
    """Per row: each of mlx's threads' fused multiply-adds in order, each warp's tree,
    then the tree over the warps' sums."""
    count, dim = rows.shape
    width = rn.vector_width(dtype)
    block, chunks = rn.norm_geometry(dim, dtype)
    partial = np.zeros((count, rn.THREADS), np.float32)
    for thread in range(block):
        total = np.zeros(count, np.float32)
        for chunk in range(chunks):
            for j in range(width):
                e = (block * chunk + thread) * width + j
                if e < dim:
                    t = rows[:, e].astype(np.float64)
                    # A fused multiply-add: one rounding of t * t + total.
                    total = (t * t + total.astype(np.float64)).astype(np.float32)
        partial[:, thread] = total
    warps = np.zeros((count, rn.LANES), np.float32)
    for warp in range(rn.WARPS):
        warps[:, warp] = _tree(partial[:, warp * rn.LANES : (warp + 1) * rn.LANES])
    return _tree(warps)


def _norm(rows: np.ndarray, weight: np.ndarray, eps: float, dtype) -> np.ndarray:
    dim = rows.shape[1]
    inner = (sum_of_squares(rows, dtype) / np.float32(dim) + np.float32(eps)).astype(
        np.float32
    )
    normalizer = (np.float32(1.0) / np.sqrt(inner)).astype(np.float32)
    return round_to(weight[None] * round_to(rows * normalizer[:, None], dtype), dtype)


def oracle_residual_norm(
    branch: mx.array,
    residual: mx.array,
    weight: mx.array,
    eps: float,
    next_weight: Optional[mx.array] = None,
    next_eps: Optional[float] = None,
) -> Tuple[np.ndarray, Optional[np.ndarray]]:
    """The kernel's (Metal form's) arithmetic in NumPy: float32 arrays of ``branch``'s
    shape."""
    dtype = branch.dtype
    dim = branch.shape[-1]
    rows = np.array(branch.astype(mx.float32)).reshape(-1, dim)
    stream = np.array(residual.astype(mx.float32)).reshape(-1, dim)
    normed = _norm(rows, np.array(weight.astype(mx.float32)), eps, dtype)
    h = round_to(stream + normed, dtype)
    if next_weight is None:
        return h.reshape(branch.shape), None
    following = _norm(h, np.array(next_weight.astype(mx.float32)), next_eps, dtype)
    return h.reshape(branch.shape), following.reshape(branch.shape)
