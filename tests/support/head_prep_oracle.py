"""A step-by-step NumPy oracle of the head-prep kernel's arithmetic (float32, the
kernel's summation tree and roundings), with the C library's ``exp2f`` / ``cosf`` /
``sinf`` (what the emulated Metal body calls), so the emulated kernel can be held to
it bit for bit where the arithmetic is exact."""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
from typing import Optional, Tuple

import mlx.core as mx
import numpy as np

from dflash.metal import heads


@functools.lru_cache(maxsize=None)
def _libm():
    library = ctypes.CDLL(ctypes.util.find_library("m"))
    functions = {}
    for name in ("exp2f", "cosf", "sinf"):
        function = getattr(library, name)
        function.restype = ctypes.c_float
        function.argtypes = [ctypes.c_float]
        functions[name] = function
    return functions


def _apply(name: str, values: np.ndarray) -> np.ndarray:
    function = _libm()[name]
    flat = [function(float(v)) for v in values.reshape(-1)]
    return np.asarray(flat, np.float32).reshape(values.shape)


def round_to(values: np.ndarray, dtype: mx.Dtype) -> np.ndarray:
    """float32 values rounded to ``dtype`` (nearest even), as float32."""
    if dtype == mx.float32:
        return values.astype(np.float32)
    return np.array(
        mx.array(values.astype(np.float32)).astype(dtype).astype(mx.float32)
    )


def _sum_of_squares(rows: np.ndarray, width: int) -> np.ndarray:
    """Per row: vectors of ``width`` summed in order, the halving trees, the halves."""
    count, dim = rows.shape
    vectors = np.zeros((count, heads.MAX_VECTORS), np.float32)
    for v in range(dim // width):
        total = np.zeros(count, np.float32)
        for j in range(width):
            t = rows[:, v * width + j].astype(np.float64)
            # A fused multiply-add: one rounding of t * t + total.
            total = (t * t + total.astype(np.float64)).astype(np.float32)
        vectors[:, v] = total
    halves = []
    for half in range(2):
        tree = vectors[:, half * heads.LANES : (half + 1) * heads.LANES].copy()
        m = heads.LANES // 2
        while m:
            tree[:, :m] = tree[:, :m] + tree[:, m : 2 * m]
            m //= 2
        halves.append(tree[:, 0])
    return halves[0] + halves[1]


def _prepare(
    given: mx.array,
    weight: Optional[mx.array],
    eps: float,
    scale: float,
    rope_base: Optional[float],
    rope_scale: float,
    start: int,
) -> np.ndarray:
    dtype = given.dtype
    batch, seq, count, dim = given.shape
    rows = np.array(given.astype(mx.float32)).reshape(-1, dim)
    total = _sum_of_squares(rows, heads.vector_width(dtype))
    inner = (total / np.float32(dim) + np.float32(eps)).astype(np.float32)
    normalizer = (np.float32(1.0) / np.sqrt(inner)).astype(np.float32)
    values = round_to(rows * normalizer[:, None], dtype)
    if weight is not None:
        values = round_to(np.array(weight.astype(mx.float32))[None] * values, dtype)
    values = round_to(values * round_to(np.float32([scale]), dtype)[0], dtype)
    if rope_base is not None:
        pairs = dim // 2
        d = (np.arange(pairs, dtype=np.float32) / np.float32(pairs)).astype(np.float32)
        inv_freq = _apply("exp2f", (-d * np.float32(heads.log2_base(rope_base))))
        positions = start + (np.arange(rows.shape[0]) // count) % seq
        at = (np.float32(rope_scale) * positions.astype(np.float32)).astype(np.float32)
        theta = (at[:, None] * inv_freq[None]).astype(np.float32)
        cos, sin = _apply("cosf", theta), _apply("sinf", theta)
        x1, x2 = values[:, :pairs], values[:, pairs:]
        first = (x1 * cos).astype(np.float32) - (x2 * sin).astype(np.float32)
        second = (x1 * sin).astype(np.float32) + (x2 * cos).astype(np.float32)
        values = round_to(np.concatenate([first, second], axis=1), dtype)
    return values.reshape(batch, seq, count, dim)


def oracle_head_prep(
    queries: mx.array, keys: mx.array, **arguments
) -> Tuple[np.ndarray, np.ndarray]:
    """The kernel's arithmetic in NumPy (keyword arguments as ``head_prep``'s), float32
    arrays."""
    prep = heads.Prep(**arguments)
    rope = (prep.rope_base, prep.rope_scale, prep.start)
    (q_weight, q_eps, q_scale), (k_weight, k_eps, k_scale) = prep.norms()
    return (
        _prepare(queries, q_weight, q_eps, q_scale, *rope),
        _prepare(keys, k_weight, k_eps, k_scale, *rope),
    )
