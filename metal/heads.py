"""Heads prepared for attention in one launch: RMS norm, scale and RoPE of q and k.

Models with a norm on each head (Muse Glimmer, Qwen 3, Gemma 3, the DFlash drafter)
spend five small kernels a decoder layer between the q/k projections and the
attention: ``rms_norm`` of the queries and of the keys, a multiply by the query scale,
``rope`` of each. A verify layer is paced by the host (each launch costs its Python,
mlx's graph node and its encode), so :func:`head_prep` does all of it in one launch.

**The same arithmetic as mlx's three ops**, step by step, so that on CUDA its bits can
equal ``mx.fast.rms_norm``, ``* scale`` and ``mx.fast.rope`` (mlx 0.32.4; checked by
the ``cuda`` tests):

* the sum of squares of a head is cut as mlx's small RMS-norm kernel cuts it: vectors
  of ``16 / itemsize`` elements, each summed in order with fused multiply-adds; the
  first 32 vectors' sums are added by a halving tree (the order of a warp's xor
  butterfly: ``s[i] += s[i + m]`` for ``m`` = 16, 8, 4, 2, 1), the next 32 likewise,
  and the two added; then ``rsqrt(sum / D + eps)``;
* each element: ``T(x * normalizer)``, times the weight in ``T`` when the norm has
  one, times ``T(scale)`` in ``T`` (a product of two 8- or 11-bit significands is
  exact in float32, so one rounding, as ``T * T``);
* RoPE (mlx's default, non-traditional form over the whole head): element ``i`` of
  the first half pairs with ``i + D/2``; ``theta = (rope_scale * position) *
  exp2(-(i / (D/2)) * log2(base))``, ``x1 cos - x2 sin`` and ``x1 sin + x2 cos`` in
  float32, rounded to ``T``.

**Batch invariance**: every head of every token is prepared from its own elements and
its position alone, so a 16-token verify gives each row the bits of a one-token step.

Three forms, one contract: the pure-MLX reference (:func:`reference_head_prep`:
mlx's own ops in mlx-lm's order, hence bit-equal to the model's unpatched forward on
every backend), and one body (:data:`HEAD_PREP`) for the Metal kernel and its CUDA
twin. The Metal form is compiled and emulated on the CPU only (never run on a Mac).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import math
from dataclasses import dataclass
from typing import Any, Optional, Tuple

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from . import backend, groups
from .groups import GroupKernelSpec, float_params, int_params
from .layout import MAX_LAUNCH_WORDS, checked_offset

THREADS = 256
LANES = 32
ROWS_PER_GROUP = THREADS // LANES
# mlx's small RMS-norm kernel: 64 threads of one 16-byte vector each covers a head.
MAX_VECTORS = 2 * LANES
MAX_DIM = 256
DTYPES = (mx.bfloat16, mx.float16, mx.float32)

# Flags (params[7]).
Q_WEIGHT = 1
K_WEIGHT = 2
ROPE = 4
# The keys and the copied values stored as one head-major (2, B, Hkv, S, D) block.
STACK_KV = 8

# Per-backend float maths the body needs beyond groups.HEADERS (kept here: the shared
# headers are hashed into every kernel's name).
HEAD_PREP_HELPERS = """
#ifdef __CUDACC__
#define DFL_RSQRT(x) rsqrtf(x)
#define DFL_EXP2(x) exp2f(x)
#define DFL_COS(x) cosf(x)
#define DFL_SIN(x) sinf(x)
#else
#define DFL_RSQRT(x) rsqrt(x)
#define DFL_EXP2(x) exp2(x)
#define DFL_COS(x) precise::cos(x)
#define DFL_SIN(x) precise::sin(x)
#endif
"""

# One row (a head of a token, q rows first, then k rows, then, with STACK_KV, the v rows
# to copy) per 32 threads; lane l holds vectors l and l + 32 of the row.
# params: q_rows, k_rows, dim, q_heads, k_heads, seq, start, flags, then the element
# offsets q_offset, k_offset, v_offset at which q, k and v start in their inputs (0 but
# where the three are one fused, member-major projection output, handed over whole so
# that no view of a member is a graph node).
# fparams: q_eps, k_eps, q_scale, k_scale, log2(rope base), rope scale.
HEAD_PREP_BODY = f"""
  const int ROWS = {ROWS_PER_GROUP};
  const int LANES = {LANES};
  const int q_rows = params[0];
  const int k_rows = params[1];
  const int dim = params[2];
  const int q_heads = params[3];
  const int k_heads = params[4];
  const int seq = params[5];
  const int start = params[6];
  const int flags = params[7];
  const int q_offset = params[8];
  const int k_offset = params[9];
  const int v_offset = params[10];
  const int VEC = int(16 / sizeof(T));
  const bool stacked = (flags & {STACK_KV}) != 0;
  const int slot = int(lid) / LANES;
  const int lane = int(lid) % LANES;
  const int row = int(group) * ROWS + slot;
  const bool is_q = row < q_rows;
  const bool is_v = stacked && row >= q_rows + k_rows;
  // Copied value rows are not normed: no sum of squares is read for them.
  const bool live = row < q_rows + k_rows;
  const bool stored = live || (is_v && row < q_rows + 2 * k_rows);
  const int r = is_q ? row : (is_v ? row - q_rows - k_rows : row - q_rows);
  const int heads = is_q ? q_heads : k_heads;
  const bool weighted = (flags & (is_q ? {Q_WEIGHT} : {K_WEIGHT})) != 0;
  DFL_SHARED float partial[{ROWS_PER_GROUP}][{MAX_VECTORS}];
  DFL_SHARED float normed[{ROWS_PER_GROUP}][{MAX_DIM}];

  // Sum of squares, vector by vector as mlx's RMS norm cuts a head.
  for (int half = 0; half < 2; ++half) {{
    const int vector = lane + half * LANES;
    float sum = 0.0f;
    if (live && vector * VEC < dim) {{
      for (int j = 0; j < VEC; ++j) {{
        const int e = vector * VEC + j;
        const float t = is_q ? float(q[q_offset + r * dim + e])
                              : float(k[k_offset + r * dim + e]);
        sum = DFL_FMA(t, t, sum);
      }}
    }}
    partial[slot][vector] = sum;
  }}
  DFL_BARRIER();

  // The warps' xor-butterfly order as a halving tree, twice, then the two added.
  float warp_sum[2];
  for (int half = 0; half < 2; ++half) {{
    float tree[LANES];
    for (int i = 0; i < LANES; ++i) {{
      tree[i] = partial[slot][half * LANES + i];
    }}
    for (int m = LANES / 2; m > 0; m /= 2) {{
      for (int i = 0; i < m; ++i) {{
        tree[i] = tree[i] + tree[i + m];
      }}
    }}
    warp_sum[half] = tree[0];
  }}
  const float total = warp_sum[0] + warp_sum[1];
  const float eps = is_q ? fparams[0] : fparams[1];
  const float normalizer = DFL_RSQRT(total / float(dim) + eps);
  const T scale = T(is_q ? fparams[2] : fparams[3]);

  for (int half = 0; half < 2; ++half) {{
    const int vector = lane + half * LANES;
    if (live && vector * VEC < dim) {{
      for (int j = 0; j < VEC; ++j) {{
        const int e = vector * VEC + j;
        const float x = is_q ? float(q[q_offset + r * dim + e])
                              : float(k[k_offset + r * dim + e]);
        T value = T(x * normalizer);
        if (weighted) {{
          const float w = is_q ? float(q_weight[e]) : float(k_weight[e]);
          value = T(w * float(value));
        }}
        value = T(float(value) * float(scale));
        normed[slot][e] = float(value);
      }}
    }}
  }}
  DFL_BARRIER();

  if (!stored) {{
    return;
  }}
  // Head-major stacked block: row r = (b, s, h) goes to (b, h, s); values after keys.
  const int token = (r / heads) % seq;
  const int out_row = stacked
      ? (is_v ? k_rows : 0) + ((r / (heads * seq)) * heads + r % heads) * seq + token
      : r;
  const int position = start + token;
  const int pairs = dim / 2;
  for (int half = 0; half < 2; ++half) {{
    const int vector = lane + half * LANES;
    if (vector * VEC >= dim) {{
      continue;
    }}
    for (int j = 0; j < VEC; ++j) {{
      const int e = vector * VEC + j;
      if (is_v) {{
        k_out[out_row * dim + e] = v[v_offset + r * dim + e];
        continue;
      }}
      float value = normed[slot][e];
      if ((flags & {ROPE}) != 0) {{
        const int i = e < pairs ? e : e - pairs;
        const float d = float(i) / float(pairs);
        const float inv_freq = DFL_EXP2(-d * fparams[4]);
        const float at = fparams[5] * float(position);
        const float theta = at * inv_freq;
        const float costheta = DFL_COS(theta);
        const float sintheta = DFL_SIN(theta);
        const float x1 = normed[slot][i];
        const float x2 = normed[slot][i + pairs];
        if (e < pairs) {{
          value = x1 * costheta - x2 * sintheta;
        }} else {{
          value = x1 * sintheta + x2 * costheta;
        }}
      }}
      if (is_q) {{
        q_out[r * dim + e] = T(value);
      }} else {{
        k_out[out_row * dim + e] = T(value);
      }}
    }}
  }}
"""

HEAD_PREP = GroupKernelSpec(
    base="head_prep",
    input_names=("q", "k", "v", "q_weight", "k_weight", "params", "fparams"),
    input_types=("T", "T", "T", "T", "T", "int32", "float32"),
    output_names=("q_out", "k_out"),
    output_types=("T", "T"),
    helpers=HEAD_PREP_HELPERS,
    body=HEAD_PREP_BODY,
    threads=THREADS,
)
SPECS = (HEAD_PREP,)


@functools.lru_cache(maxsize=None)
def _libm_log2f():
    """libm's ``log2f`` (what mlx's RoPE calls on the host), or None where not found."""
    name = ctypes.util.find_library("m")
    if name is None:
        return None
    try:
        function = ctypes.CDLL(name).log2f
    except (OSError, AttributeError):
        return None
    function.restype = ctypes.c_float
    function.argtypes = [ctypes.c_float]
    return function


@functools.lru_cache(maxsize=64)
def log2_base(base: float) -> float:
    """``log2(base)`` in float32 as mlx's RoPE hands it to its kernels
    (``std::log2`` of the float base)."""
    function = _libm_log2f()
    if function is not None:
        return float(function(float(np.float32(base))))
    return float(np.float32(math.log2(float(np.float32(base)))))


def vector_width(dtype: mx.Dtype) -> int:
    """Elements of one 16-byte vector of ``dtype`` (mlx's RMS norm reads)."""
    return 16 // dtype.size


def kernel_serves(dim: int, dtype: mx.Dtype) -> bool:
    """Whether the kernel takes heads of ``dim`` elements of ``dtype``."""
    width = vector_width(dtype)
    return dim <= MAX_DIM and dim % width == 0 and dim // width <= MAX_VECTORS


def rope_served(rope: Any, dim: int) -> bool:
    """Whether ``rope`` is the RoPE the head prep computes: mlx's ``nn.RoPE`` in its
    default (non-traditional) form over the whole head of ``dim`` elements."""
    return (
        type(rope) is nn.RoPE
        and rope.dims == dim
        and not rope.traditional
        and rope.base is not None
    )


@dataclass(frozen=True, eq=False)
class Prep:
    """What one :func:`head_prep` call does (its keyword arguments).

    Attributes:
        eps: The queries' norm epsilon (also the keys' unless ``k_eps``).
        k_eps: The keys' norm epsilon.
        q_weight: The queries' norm weight ``(D,)`` (None: no weight).
        k_weight: The keys' norm weight ``(D,)`` (None: no weight).
        q_scale: Multiplies the normed queries (in their dtype, as ``x * scale``).
        k_scale: Multiplies the normed keys.
        rope_base: RoPE's base over the whole head (mlx's non-traditional form);
            None: no RoPE.
        rope_scale: RoPE's position scale.
        start: Position of the first token (``S`` consecutive positions).
    """

    eps: float
    k_eps: Optional[float] = None
    q_weight: Optional[mx.array] = None
    k_weight: Optional[mx.array] = None
    q_scale: float = 1.0
    k_scale: float = 1.0
    rope_base: Optional[float] = None
    rope_scale: float = 1.0
    start: int = 0

    def norms(self) -> tuple:
        """``(weight, eps, scale)`` of the queries, then of the keys."""
        k_eps = self.eps if self.k_eps is None else self.k_eps
        return (
            (self.q_weight, self.eps, self.q_scale),
            (self.k_weight, k_eps, self.k_scale),
        )


def _check(
    queries: mx.array, keys: mx.array, prep: Prep, values: Optional[mx.array] = None
) -> None:
    """Raise ValueError for arguments :func:`head_prep` cannot take."""
    if queries.ndim != 4 or keys.ndim != 4:
        raise ValueError(
            f"queries and keys must be (B, S, H, D), got {queries.shape} and "
            f"{keys.shape}"
        )
    if queries.shape[:2] != keys.shape[:2] or queries.shape[3] != keys.shape[3]:
        raise ValueError(
            f"queries {queries.shape} and keys {keys.shape} must share B, S and D"
        )
    if queries.dtype != keys.dtype or queries.dtype not in DTYPES:
        raise ValueError(
            f"queries and keys must share one of {DTYPES}, got {queries.dtype} and "
            f"{keys.dtype}"
        )
    if queries.shape[3] % 2:
        raise ValueError(f"head dim must be even for RoPE, got {queries.shape[3]}")
    for name, weight in (("q_weight", prep.q_weight), ("k_weight", prep.k_weight)):
        if weight is not None and (
            weight.shape != (queries.shape[3],) or weight.dtype != queries.dtype
        ):
            raise ValueError(
                f"{name} must be ({queries.shape[3]},) {queries.dtype}, got "
                f"{weight.shape} {weight.dtype}"
            )
    start = prep.start
    if isinstance(start, bool) or not isinstance(start, int) or start < 0:
        raise ValueError(f"start must be an int >= 0, got {start!r}")
    if values is not None and (
        values.shape != keys.shape or values.dtype != keys.dtype
    ):
        raise ValueError(
            f"values must have the keys' shape and dtype {keys.shape} {keys.dtype}, "
            f"got {values.shape} {values.dtype}"
        )


def reference_head_prep(
    queries: mx.array,
    keys: mx.array,
    prep: Prep,
    values: Optional[mx.array] = None,
) -> Tuple[mx.array, mx.array]:
    """mlx's own ops in mlx-lm's order: ``rms_norm``, ``* scale``, ``rope``; with
    ``values``, the keys and values then stacked as :func:`stack_block` does.

    Shapes: queries ``(B, S, Hq, D)``, keys and values ``(B, S, Hkv, D)``; returns the
    queries' shape, and the keys' shape or, with ``values``, ``(2, B, Hkv, S, D)``.
    """
    prepared = []
    for given, (weight, eps, scale) in zip((queries, keys), prep.norms()):
        out = mx.fast.rms_norm(given, weight, eps)
        if scale != 1.0:
            out = out * scale
        if prep.rope_base is not None:
            # RoPE's positions run along the second-to-last axis: (B, H, S, D).
            out = mx.fast.rope(
                out.transpose(0, 2, 1, 3),
                out.shape[3],
                traditional=False,
                base=prep.rope_base,
                scale=prep.rope_scale,
                offset=prep.start,
            ).transpose(0, 2, 1, 3)
        prepared.append(out)
    if values is not None:
        return prepared[0], stack_block(prepared[1], values)
    return prepared[0], prepared[1]


def stack_block(keys: mx.array, values: mx.array) -> mx.array:
    """mlx's ops for the head-major stacked block a KV plane stores (what
    ``mx.stack`` of the transposed keys and values gives).

    Shapes: keys, values ``(B, S, Hkv, D)``; returns ``(2, B, Hkv, S, D)``.
    """
    return mx.stack([keys.transpose(0, 2, 1, 3), values.transpose(0, 2, 1, 3)])


@functools.lru_cache(maxsize=256)
def _float_params(eps, k_eps, q_scale, k_scale, rope_base, rope_scale) -> mx.array:
    """The launch's float scalars (one array per layer's constants, memoised)."""
    return float_params(
        float(eps),
        float(eps if k_eps is None else k_eps),
        float(q_scale),
        float(k_scale),
        log2_base(rope_base) if rope_base is not None else 0.0,
        float(rope_scale),
    )


def kernel_head_prep(
    queries: mx.array,
    keys: mx.array,
    prep: Prep,
    values: Optional[mx.array] = None,
) -> Tuple[mx.array, mx.array]:
    """One launch of :data:`HEAD_PREP`.

    Shapes: queries ``(B, S, Hq, D)``, keys and values ``(B, S, Hkv, D)``; returns the
    queries' shape and the keys' shape, or with ``values`` the stacked block
    ``(2, B, Hkv, S, D)``.
    """
    ints = head_prep_ints(queries.shape, keys.shape[2], prep, values is not None)
    return launch_head_prep(queries, keys, prep, ints, values)


# No offsets: each of q, k and v starts its own input.
NO_OFFSETS = (0, 0, 0)


def _check_offsets(offsets: Tuple[int, ...]) -> Tuple[int, int, int]:
    """``offsets`` as a tuple of three ints >= 0 that an int32 index holds.

    Raises:
        ValueError: anything else.
    """
    if not isinstance(offsets, (tuple, list)) or len(offsets) != 3:
        raise ValueError(
            f"offsets must be (q_offset, k_offset, v_offset), got {offsets!r}"
        )
    names = ("q_offset", "k_offset", "v_offset")
    return tuple(map(checked_offset, names, offsets))


def head_prep_ints(
    q_shape: Tuple[int, ...],
    k_heads: int,
    prep: Prep,
    stacked: bool,
    offsets: Tuple[int, int, int] = NO_OFFSETS,
) -> mx.array:
    """The launch's integer scalars (memoised: :func:`~dflash.metal.groups.int_params`
    keeps one array per set of values): the runtime part of a head prep,
    ``prep.start`` among them, which :func:`launch_head_prep` reads as an array.

    Args:
        q_shape: The queries' heads ``(B, S, Hq, D)``.
        k_heads: The keys' (and values') head count ``Hkv``.
        prep: The head prep.
        stacked: Whether the values come too (the stacked block).
        offsets: ``(q_offset, k_offset, v_offset)``: the element at which the
            queries', keys' and values' heads start in their inputs (see
            :func:`launch_head_prep`'s ``offsets``; the same ones).

    Returns:
        The 11 int32 scalars: the 8 of the geometry, start and flags, then the
        offsets.

    Shapes: q_shape ``(B, S, Hq, D)``; returns ``(11,)``.

    Raises:
        ValueError: an offset is not an int in ``[0, 2**31 - 1]``.
    """
    # The default skips the check: every unfused call takes it.
    q_offset, k_offset, v_offset = (
        NO_OFFSETS if offsets is NO_OFFSETS else _check_offsets(offsets)
    )
    batch, seq, q_heads, dim = q_shape
    flags = (
        (Q_WEIGHT if prep.q_weight is not None else 0)
        | (K_WEIGHT if prep.k_weight is not None else 0)
        | (ROPE if prep.rope_base is not None else 0)
        | (STACK_KV if stacked else 0)
    )
    q_rows, k_rows = batch * seq * q_heads, batch * seq * k_heads
    return int_params(
        q_rows, k_rows, dim, q_heads, k_heads, seq, prep.start, flags,
        q_offset, k_offset, v_offset,
    )  # fmt: skip


def _check_fused_reads(
    arrays: Tuple[Tuple[str, Optional[mx.array], int, int], ...], dim: int
) -> None:
    """Raise ValueError unless each named input holds its heads from its offset on.

    Args:
        arrays: ``(name, input, offset, rows)`` per read input (None: not read).
        dim: The head dim.
    """
    for name, given, offset, rows in arrays:
        if given is None:
            continue
        stop = offset + rows * dim
        if stop > given.size or stop > MAX_LAUNCH_WORDS:
            raise ValueError(
                f"{name}_offset {offset} reads {rows} heads of {dim} up to element "
                f"{stop}, past the {given.size} elements of {name} (or int32)"
            )


def launch_head_prep(
    queries: mx.array,
    keys: mx.array,
    prep: Prep,
    ints: mx.array,
    values: Optional[mx.array] = None,
    head_dim: Optional[int] = None,
    offsets: Optional[Tuple[int, int, int]] = None,
    geometry: Optional[Tuple[int, int, int, int]] = None,
) -> Tuple[mx.array, mx.array]:
    """:func:`kernel_head_prep` with its integer scalars given (:func:`head_prep_ints`
    of these shapes and ``prep``; ``prep.start`` is not read here), so that a traced
    caller can take them as an input.

    Args:
        queries, keys, prep, values: As :func:`kernel_head_prep`.
        ints: :func:`head_prep_ints` of the call (with ``offsets``: of the same
            offsets).
        head_dim: Given, the inputs come with their heads merged on the last axis,
            as the projections give them (the kernel reads the same row-major
            elements, so the caller's reshapes, a graph node each, are not needed);
            the outputs are shaped as without it.
        offsets: ``(q_offset, k_offset, v_offset)``, with ``head_dim`` and
            ``geometry``: the queries', keys' and values' heads are read from those
            elements of their inputs on, each row-major ``(B, S, H * D)`` there. So
            one member-major fused projection output can stand for all three (the
            same array given as ``queries``, ``keys`` and ``values``: each member a
            block at its offset), and no view of a member is made. Checked here (the
            kernel reads them from ``ints``).
        geometry: ``(B, S, Hq, Hkv)`` of the heads, with ``offsets`` (the inputs'
            shapes then tell nothing of them).

    Shapes: as :func:`kernel_head_prep`, or with ``head_dim`` queries ``(B, S, Hq *
    D)`` and keys and values ``(B, S, Hkv * D)``, or with ``offsets`` any arrays that
    hold their heads from the offsets on; ints ``(11,)``; the outputs as without
    ``head_dim``.

    Returns:
        ``(queries, keys)`` prepared, or ``(queries, block)`` with ``values``.

    Raises:
        ValueError: ``offsets`` without ``head_dim`` and ``geometry`` (or these
            without ``offsets``), an offset that is not an int >= 0, a read past the
            end of its input, or inputs of different dtypes.
    """
    if offsets is None and geometry is None:
        if head_dim is None:
            batch, seq, q_heads, dim = queries.shape
            k_heads = keys.shape[2]
        else:
            (batch, seq, q_width), dim = queries.shape, head_dim
            q_heads, k_heads = q_width // dim, keys.shape[2] // dim
    else:
        batch, seq, q_heads, k_heads, dim = _fused_geometry(
            queries, keys, values, head_dim, offsets, geometry
        )
    q_rows, k_rows = batch * seq * q_heads, batch * seq * k_heads
    _, fparams, q_weight, k_weight = prepared_inputs(prep, ints, queries.dtype)
    blank = groups.unused_input(queries.dtype)
    if values is None:
        k_shape, rows = (batch, seq, k_heads, dim), q_rows + k_rows
    else:
        k_shape, rows = (2, batch, k_heads, seq, dim), q_rows + 2 * k_rows
    q_out, k_out = groups.launch_replayed(
        HEAD_PREP,
        [
            queries,
            keys,
            blank if values is None else values,
            q_weight,
            k_weight,
            ints,
            fparams,
        ],
        [(batch, seq, q_heads, dim), k_shape],
        [queries.dtype, queries.dtype],
        -(-rows // ROWS_PER_GROUP),
        queries.dtype,
    )
    return q_out, k_out


def prepared_inputs(
    prep: Prep, ints: mx.array, dtype: mx.Dtype
) -> Tuple[mx.array, mx.array, mx.array, mx.array]:
    """The head prep's scalars and weights as its kernel takes them (what
    :func:`launch_head_prep` hands it), and so the ``heads`` inputs of the fused
    q / k / v / gate matmul's prepared form
    (:func:`dflash.metal.tensor_qmm.prepared_spec`), which does the same arithmetic.

    Args:
        prep: The head prep.
        ints: :func:`head_prep_ints` of the call (``stacked``; its seq, start and
            flags are what the matmul reads).
        dtype: The projections' dtype (a missing weight's placeholder's).

    Returns:
        ``(ints, float scalars, q weight, k weight)``.
    """
    fparams = _float_params(
        prep.eps,
        prep.k_eps,
        prep.q_scale,
        prep.k_scale,
        prep.rope_base,
        prep.rope_scale,
    )
    blank = groups.unused_input(dtype)
    return (
        ints,
        fparams,
        blank if prep.q_weight is None else prep.q_weight,
        blank if prep.k_weight is None else prep.k_weight,
    )


def _fused_geometry(
    queries: mx.array,
    keys: mx.array,
    values: Optional[mx.array],
    head_dim: Optional[int],
    offsets: Optional[Tuple[int, int, int]],
    geometry: Optional[Tuple[int, int, int, int]],
) -> Tuple[int, int, int, int, int]:
    """``(B, S, Hq, Hkv, D)`` of a :func:`launch_head_prep` call with ``offsets``,
    checked.

    Raises:
        ValueError: as :func:`launch_head_prep`.
    """
    if offsets is None or geometry is None or head_dim is None:
        raise ValueError(
            "offsets, geometry and head_dim go together: got offsets "
            f"{offsets!r}, geometry {geometry!r}, head_dim {head_dim!r}"
        )
    q_offset, k_offset, v_offset = _check_offsets(offsets)
    if (
        not isinstance(geometry, (tuple, list))
        or len(geometry) != 4
        or any(
            isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 1
            for n in geometry
        )
    ):
        raise ValueError(
            f"geometry must be (B, S, Hq, Hkv) of ints >= 1, got {geometry!r}"
        )
    dim = head_dim
    if isinstance(dim, bool) or not isinstance(dim, (int, np.integer)) or dim < 1:
        raise ValueError(f"head_dim must be an int >= 1, got {head_dim!r}")
    dtypes = {queries.dtype, keys.dtype} | (
        {values.dtype} if values is not None else set()
    )
    if len(dtypes) != 1:
        raise ValueError(
            f"queries, keys and values must share a dtype, got {sorted(map(str, dtypes))}"
        )
    batch, seq, q_heads, k_heads = (int(n) for n in geometry)
    q_rows, k_rows = batch * seq * q_heads, batch * seq * k_heads
    _check_fused_reads(
        (
            ("q", queries, q_offset, q_rows),
            ("k", keys, k_offset, k_rows),
            ("v", values, v_offset, k_rows),
        ),
        int(dim),
    )
    return batch, seq, q_heads, k_heads, int(dim)


def head_prep(
    queries: mx.array,
    keys: mx.array,
    *,
    eps: float,
    k_eps: Optional[float] = None,
    q_weight: Optional[mx.array] = None,
    k_weight: Optional[mx.array] = None,
    q_scale: float = 1.0,
    k_scale: float = 1.0,
    rope_base: Optional[float] = None,
    rope_scale: float = 1.0,
    start: int = 0,
    values: Optional[mx.array] = None,
    use_kernel: Optional[bool] = None,
) -> Tuple[mx.array, mx.array]:
    """RMS-normed, scaled and rotated queries and keys, in one launch on a GPU.

    Args:
        queries: The q projection's heads.
        keys: The k projection's heads.
        eps, k_eps, q_weight, k_weight, q_scale, k_scale, rope_base, rope_scale,
            start: As the attributes of :class:`Prep`.
        values: The v projection's heads: if given, the prepared keys and these
            values come back as the head-major block a KV plane stores
            (:func:`stack_block`'s bits), written by the same launch instead of two
            copies.
        use_kernel: None: the kernel on a GPU backend, the reference elsewhere;
            True / False force one form (the reference also where the kernel does
            not take the head dim).

    Shapes: queries ``(B, S, Hq, D)``, keys and values ``(B, S, Hkv, D)``; returns
    the queries' shape, and the keys' shape or, with ``values``, ``(2, B, Hkv, S, D)``.

    Returns:
        ``(queries, keys)`` prepared, or ``(queries, block)`` with ``values``.

    Raises:
        ValueError: shapes, dtypes, weights or ``start`` that do not fit.
    """
    prep = Prep(
        eps, k_eps, q_weight, k_weight, q_scale, k_scale, rope_base, rope_scale, start
    )
    _check(queries, keys, prep, values)
    if backend.use_kernel_path(use_kernel, True) and kernel_serves(
        queries.shape[3], queries.dtype
    ):
        return kernel_head_prep(queries, keys, prep, values)
    return reference_head_prep(queries, keys, prep, values)
