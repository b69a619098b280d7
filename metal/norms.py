"""A branch's post-norm, the residual add and the next pre-norm in one launch.

Sandwich-norm decoder layers (Muse Glimmer, Gemma 2 / 3) end each branch with
``h = residual + norm(branch)`` and start the next branch with ``norm(h)``: three
kernels (``rms_norm``, ``add``, ``rms_norm``) between the attention's output
projection and the MLP's input projections, two (``rms_norm``, ``add``) after the MLP.
A verify layer is paced by the host (each launch costs its Python, mlx's graph node
and its encode), so :func:`residual_norm` does each group in one launch.

**The same arithmetic as mlx's ops**, step by step, so that on CUDA its bits can equal
``residual + mx.fast.rms_norm(branch, weight, eps)`` and ``mx.fast.rms_norm(h, ...)``
(mlx 0.32.4's small-row RMS norm; checked by the ``cuda`` tests):

* a row's sum of squares is cut as mlx's ``rms_norm_small`` cuts it: ``block`` threads
  (64 or 128, mlx's dispatch rule, :func:`norm_geometry`), thread ``t`` reading
  vectors ``t``, ``t + block``, ... of ``16 / itemsize`` elements, each element
  added with a fused multiply-add in that order; each warp's 32 sums added by a
  halving tree (the order of its xor butterfly), and the warps' sums by the same
  tree (``(w0 + w2) + (w1 + w3)``); then ``rsqrt(sum / D + eps)`` (the CUDA form adds
  both trees by xor shuffles: the same adds, no local memory);
* each element: ``weight * T(x * normalizer)`` (one rounding: the product of two
  8- or 11-bit significands is exact in float32);
* the add in ``T`` as mlx's ``Add`` does it: ``T``'s own ``+`` on CUDA (one rounding
  for bf16 / f16); on Metal ``T(float + float)`` (mlx's bfloat16 add; for half, a
  second rounding that the Metal tests' oracle models);
* the next norm reads the sum as written (its own thread's stores) in the same order.

**Batch invariance**: every row is computed from its own elements alone, so a
16-token verify gives each row the bits of a one-token step.

Three forms, one contract: the pure-MLX reference (:func:`reference_residual_norm`:
mlx's own ops in mlx-lm's order, bit-equal to the layer's unpatched forward on every
backend) and one body (:data:`RESIDUAL_NORM`) for the Metal kernel and its CUDA twin.
The Metal form is compiled and emulated on the CPU only (never run on a Mac); it keeps
CUDA's summation order, so on a Mac it is batch-invariant but not bit-equal to mlx's
Metal ``rms_norm``.
"""

from __future__ import annotations

import functools
from typing import Optional, Tuple

import mlx.core as mx

from . import backend, groups
from .groups import GroupKernelSpec, float_params, int_params
from .heads import vector_width
from .prefetch import Prefetch, with_prefetch

THREADS = 128
LANES = 32
WARPS = THREADS // LANES
# mlx's small RMS-norm kernel takes rows of at most 128 threads x 8 vectors.
MAX_CHUNKS = 8
DTYPES = (mx.bfloat16, mx.float16, mx.float32)

# Flags (params[3]).
NEXT = 1

RESIDUAL_NORM_HELPERS = """
#ifdef __CUDACC__
#define DFL_RSQRT(x) rsqrtf(x)
#define DFL_MUL_RN(a, b) __fmul_rn(a, b)
#define DFL_ADD_T(a, b) ((a) + (b))
#define DFL_UNROLL _Pragma("unroll")
// Element j of vector i: from the thread's 16-byte copy where the rows are whole
// vectors (`whole`), else from memory; stores likewise (the vector written after).
#define DFL_ELEMENT(copy, source, index) \
  (whole ? reinterpret_cast<const T*>(&copy[i])[j] : source[index])
#define DFL_PUT(copy, target, index, value)      \
  if (whole) {                                   \
    reinterpret_cast<T*>(&copy)[j] = value;      \
  } else {                                       \
    target[index] = value;                       \
  }
#else
#define DFL_ELEMENT(copy, source, index) source[index]
#define DFL_PUT(copy, target, index, value) target[index] = value;
#define DFL_RSQRT(x) rsqrt(x)
#define DFL_MUL_RN(a, b) ((a) * (b))
#define DFL_ADD_T(a, b) static_cast<T>(float(a) + float(b))
#define DFL_UNROLL
#endif
"""

# Register slots a thread holds: MAX_CHUNKS vectors of at most 8 elements.
SLOTS = MAX_CHUNKS * 8


def _block_sum(value: str, shared: str, warp_sums: str, total: str) -> str:
    """Body text setting ``float total`` to the block's sum of each thread's ``value``
    as mlx's block reduce adds them: each warp's 32 by a halving tree (the order of
    its xor butterfly), then the warps' sums by the same tree over 32 slots (zeros
    past the warps).

    CUDA runs both trees as xor shuffles: lane ``i < m`` adds lane ``i + m``'s value to
    its own, the tree's very adds, so lane 0 holds the tree's sum and every other lane
    the same sum with its operands swapped (the same bits). Metal keeps the tree in one
    thread a warp through ``shared`` (one partial sum a thread)."""
    butterfly = "\n".join(
        f"    {{name}} = {{name}} + __shfl_xor_sync(0xffffffffu, {{name}}, {m});"
        for m in (16, 8, 4, 2, 1)
    )
    return f"""
#ifdef __CUDACC__
  {{
    float lanes = {value};
{butterfly.format(name="lanes")}
    if (t % {LANES} == 0) {{
      {warp_sums}[t / {LANES}] = lanes;
    }}
  }}
  DFL_BARRIER();
  float {total} = t % {LANES} < {WARPS} ? {warp_sums}[t % {LANES}] : 0.0f;
{butterfly.format(name=total)}
#else
  {shared}[t] = {value};
  DFL_BARRIER();
  if (t < {WARPS}) {{
    float tree[{LANES}];
    DFL_UNROLL
    for (int i = 0; i < {LANES}; ++i) {{
      tree[i] = {shared}[t * {LANES} + i];
    }}
    DFL_UNROLL
    for (int m = {LANES} / 2; m > 0; m /= 2) {{
      DFL_UNROLL
      for (int i = 0; i < m; ++i) {{
        tree[i] = tree[i] + tree[i + m];
      }}
    }}
    {warp_sums}[t] = tree[0];
  }}
  DFL_BARRIER();
  float {total};
  {{
    float tree[{LANES}];
    DFL_UNROLL
    for (int i = 0; i < {LANES}; ++i) {{
      tree[i] = i < {WARPS} ? {warp_sums}[i] : 0.0f;
    }}
    DFL_UNROLL
    for (int m = {LANES} / 2; m > 0; m /= 2) {{
      DFL_UNROLL
      for (int i = 0; i < m; ++i) {{
        tree[i] = tree[i] + tree[i + m];
      }}
    }}
    {total} = tree[0];
  }}
#endif
"""


def _each_element(statements: str, after: str = "") -> str:
    """Body text running ``statements`` for each element slot ``s`` of this thread
    (vector ``v = block * i + t``, element ``j``; ``e`` its index in the row, ``live``
    whether mlx's thread reads it), unrolled so every load is issued up front, and
    ``after`` once a vector (``v``, ``live_vector``, its elements in ``stored``; CUDA
    only)."""
    declare = (
        "#ifdef __CUDACC__\n    uint4 stored = {0u, 0u, 0u, 0u};\n#endif\n"
        if after
        else ""
    )
    return f"""
  DFL_UNROLL
  for (int i = 0; i < {MAX_CHUNKS}; ++i) {{
    const int v = block * i + t;
    const bool live_vector = reads && i < chunks && v * VEC < dim;
    (void)live_vector;
{declare}    DFL_UNROLL
    for (int j = 0; j < VEC; ++j) {{
      const int s = i * 8 + j;
      const int e = v * VEC + j;
      const bool live = live_vector && e < dim;
{statements}
    }}
#ifdef __CUDACC__
{after}
#endif
  }}
"""


# The vector store after a vector's elements (CUDA, rows of whole vectors).
def _store(target: str) -> str:
    return f"""    if (whole && live_vector) {{
      *reinterpret_cast<uint4*>({target} + base + v * VEC) = stored;
    }}"""


# The three passes over a thread's elements (see RESIDUAL_NORM_BODY).
_LOAD = """
      values[s] = live ? float(DFL_ELEMENT(branch_copy, x, base + e)) : 0.0f;
      sum = DFL_FMA(values[s], values[s], sum);"""
_SUM = """
      if (live) {
        const T scaled = T(DFL_MUL_RN(values[s], normalizer));
        const T normed = T(DFL_MUL_RN(float(DFL_ELEMENT(weight_copy, weight, e)), float(scaled)));
        const T sum_value = DFL_ADD_T(DFL_ELEMENT(residual_copy, residual, base + e), normed);
        DFL_PUT(stored, h, base + e, sum_value)
        values[s] = float(sum_value);
      } else {
        values[s] = 0.0f;
      }
      sum_next = DFL_FMA(values[s], values[s], sum_next);"""
_NEXT = """
      if (live) {
        const T scaled = T(DFL_MUL_RN(values[s], normalizer_next));
        const T normed = T(DFL_MUL_RN(float(DFL_ELEMENT(next_copy, next_weight, e)), float(scaled)));
        DFL_PUT(stored, normed_next, base + e, normed)
      }"""

# CUDA: where every row is whole 16-byte vectors, each thread copies all its vectors
# of the four inputs first (one round trip; the weights do not wait for the sums). The
# arithmetic is the same element by element, so the same bits as the scalar reads.
_CUDA_COPIES = f"""
#ifdef __CUDACC__
  const bool whole = dim % VEC == 0 &&
      ((size_t(x) | size_t(residual) | size_t(weight) | size_t(next_weight) |
        size_t(h) | size_t(normed_next)) & size_t(15)) == 0;
  uint4 branch_copy[{MAX_CHUNKS}];
  uint4 residual_copy[{MAX_CHUNKS}];
  uint4 weight_copy[{MAX_CHUNKS}];
  uint4 next_copy[{MAX_CHUNKS}];
  DFL_UNROLL
  for (int i = 0; i < {MAX_CHUNKS}; ++i) {{
    const int v = block * i + t;
    if (whole && reads && i < chunks && v * VEC < dim) {{
      branch_copy[i] = *reinterpret_cast<const uint4*>(x + base + v * VEC);
      residual_copy[i] = *reinterpret_cast<const uint4*>(residual + base + v * VEC);
      weight_copy[i] = *reinterpret_cast<const uint4*>(weight + v * VEC);
      if (next) {{
        next_copy[i] = *reinterpret_cast<const uint4*>(next_weight + v * VEC);
      }}
    }}
  }}
#endif
"""


# One row a threadgroup. params: dim, block, chunks, flags. fparams: eps, next eps.
# Products are rounded before any add (DFL_MUL_RN), as mlx's separate kernels round
# them: a fused multiply-add would skip that rounding in float32.
RESIDUAL_NORM_BODY = f"""
  const int dim = params[0];
  const int block = params[1];
  const int chunks = params[2];
  const bool next = (params[3] & {NEXT}) != 0;
  const int VEC = int(16 / sizeof(T));
  const int t = int(lid);
  const bool reads = t < block;
  const int base = int(group) * dim;
  // Both epsilons now: their loads wait beside the params', not after a sum.
  const float eps = fparams[0];
  const float eps_next = fparams[1];
#ifndef __CUDACC__
  DFL_SHARED float partial[{THREADS}];
  DFL_SHARED float partial_next[{THREADS}];
#endif
  DFL_SHARED float warp_sums[{WARPS}];
  DFL_SHARED float warp_sums_next[{WARPS}];
  float values[{SLOTS}];
{_CUDA_COPIES}
  // The branch, and its sum of squares as mlx's thread t of `block` threads adds it
  // (a padded element adds fma(0, 0, sum) == sum).
  float sum = 0.0f;
{_each_element(_LOAD)}
{_block_sum("sum", "partial", "warp_sums", "total")}
  const float normalizer = DFL_RSQRT(total / float(dim) + eps);

  // h = residual + weight * T(x * normalizer); its squares summed in the same order.
  float sum_next = 0.0f;
{_each_element(_SUM, _store("h"))}
  if (!next) {{
    return;
  }}
{_block_sum("sum_next", "partial_next", "warp_sums_next", "total_next")}
  const float normalizer_next = DFL_RSQRT(total_next / float(dim) + eps_next);
{_each_element(_NEXT, _store("normed_next"))}
"""

RESIDUAL_NORM = GroupKernelSpec(
    base="residual_norm",
    input_names=("x", "residual", "weight", "next_weight", "params", "fparams"),
    input_types=("T", "T", "T", "T", "int32", "float32"),
    output_names=("h", "normed_next"),
    output_types=("T", "T"),
    helpers=RESIDUAL_NORM_HELPERS,
    body=RESIDUAL_NORM_BODY,
    threads=THREADS,
)
SPECS = (RESIDUAL_NORM,)


def norm_geometry(dim: int, dtype: mx.Dtype) -> Optional[Tuple[int, int]]:
    """``(block, chunks)`` of mlx's small-row RMS norm for rows of ``dim`` elements of
    ``dtype`` (its dispatch rule, read in mlx 0.32.4's ``rms_norm.cu``), or None where
    mlx takes its 1,024-thread kernel (a different summation order)."""
    width = vector_width(dtype)
    if dim < 1 or dim > width * THREADS * MAX_CHUNKS:
        return None
    vectors = -(-dim // width)
    if dim <= width * 64:
        return 64, 1
    if vectors % 128 == 0 and vectors // 128 <= MAX_CHUNKS:
        return 128, vectors // 128
    if vectors % 64 == 0 and vectors // 64 <= MAX_CHUNKS:
        return 64, vectors // 64
    return 128, -(-vectors // 128)


def kernel_serves(dim: int, dtype: mx.Dtype) -> bool:
    """Whether the kernel takes rows of ``dim`` elements of ``dtype``."""
    return dtype in DTYPES and norm_geometry(dim, dtype) is not None


def _check(
    branch: mx.array,
    residual: mx.array,
    weight: mx.array,
    next_weight: Optional[mx.array],
) -> None:
    """Raise ValueError for arguments :func:`residual_norm` cannot take."""
    if branch.ndim < 1 or branch.shape != residual.shape:
        raise ValueError(
            f"branch {branch.shape} and residual {residual.shape} must share one shape"
        )
    if branch.dtype != residual.dtype or branch.dtype not in DTYPES:
        raise ValueError(
            f"branch and residual must share one of {DTYPES}, got {branch.dtype} and "
            f"{residual.dtype}"
        )
    dim = branch.shape[-1]
    for name, given in (("weight", weight), ("next_weight", next_weight)):
        if given is not None and (given.shape != (dim,) or given.dtype != branch.dtype):
            raise ValueError(
                f"{name} must be ({dim},) {branch.dtype}, got {given.shape} "
                f"{given.dtype}"
            )
    if weight is None:
        raise ValueError("weight is required")


def reference_residual_norm(
    branch: mx.array,
    residual: mx.array,
    weight: mx.array,
    eps: float,
    next_weight: Optional[mx.array] = None,
    next_eps: Optional[float] = None,
) -> Tuple[mx.array, Optional[mx.array]]:
    """mlx's own ops in mlx-lm's order: ``residual + rms_norm(branch)``, then
    ``rms_norm`` of the sum.

    Shapes: branch, residual ``(..., D)``; weights ``(D,)``; returns ``(..., D)`` twice
    (the second None without ``next_weight``).
    """
    h = residual + mx.fast.rms_norm(branch, weight, eps)
    if next_weight is None:
        return h, None
    return h, mx.fast.rms_norm(h, next_weight, next_eps)


@functools.lru_cache(maxsize=256)
def _float_params(eps: float, next_eps: float) -> mx.array:
    """The launch's float scalars (memoised per layer's constants)."""
    return float_params(float(eps), float(next_eps))


def kernel_residual_norm(
    branch: mx.array,
    residual: mx.array,
    weight: mx.array,
    eps: float,
    next_weight: Optional[mx.array] = None,
    next_eps: Optional[float] = None,
    prefetch: Optional[Prefetch] = None,
) -> Tuple[mx.array, Optional[mx.array]]:
    """One launch of :data:`RESIDUAL_NORM` (with ``prefetch``, of its form carrying
    prefetch CTAs: :func:`dflash.metal.prefetch.with_prefetch`, CUDA only).

    Shapes: as :func:`reference_residual_norm`.
    """
    dim = branch.shape[-1]
    rows = branch.size // dim
    block, chunks = norm_geometry(dim, branch.dtype)
    has_next = next_weight is not None
    ints = int_params(dim, block, chunks, NEXT if has_next else 0)
    fparams = _float_params(eps, next_eps if has_next else 0.0)
    inputs = [
        branch,
        residual,
        weight,
        next_weight if has_next else groups.unused_input(branch.dtype),
        ints,
        fparams,
    ]
    spec, ctas = RESIDUAL_NORM, rows
    if prefetch is not None:
        spec, ctas = with_prefetch(RESIDUAL_NORM), rows + prefetch.fetchers
        inputs += prefetch.inputs
    h, normed = groups.launch_replayed(
        spec,
        inputs,
        [branch.shape, branch.shape if has_next else (1,)],
        [branch.dtype, branch.dtype],
        ctas,
        branch.dtype,
    )
    return h, normed if has_next else None


def residual_norm(
    branch: mx.array,
    residual: mx.array,
    weight: mx.array,
    eps: float,
    *,
    next_weight: Optional[mx.array] = None,
    next_eps: Optional[float] = None,
    use_kernel: Optional[bool] = None,
    prefetch: Optional[Prefetch] = None,
) -> Tuple[mx.array, Optional[mx.array]]:
    """``residual + rms_norm(branch, weight, eps)`` and, given ``next_weight``, the RMS
    norm of that sum, in one launch on a GPU.

    Args:
        branch: The branch's output (normed, then added).
        residual: The residual stream it is added to.
        weight: The branch norm's weight (for a centered norm, its ``1 + weight``).
        eps: The branch norm's epsilon.
        next_weight: The next pre-norm's weight (None: no next norm).
        next_eps: The next pre-norm's epsilon.
        use_kernel: None: the kernel on a GPU backend, the reference elsewhere;
            True / False force one form (the reference also where the kernel does
            not take the row width).
        prefetch: Another launch's bytes for the kernel's launch to ask into the L2
            as well (:mod:`dflash.metal.prefetch`; CUDA's kernel only, ignored
            elsewhere: it changes no result).

    Shapes: branch, residual ``(..., D)``; weights ``(D,)``; returns ``(..., D)`` twice.

    Returns:
        ``(h, normed)``: the sum, and its next norm (None without ``next_weight``).

    Raises:
        ValueError: shapes, dtypes or weights that do not fit, or ``next_weight``
            without ``next_eps``.
    """
    _check(branch, residual, weight, next_weight)
    if next_weight is not None and next_eps is None:
        raise ValueError("next_eps is required with next_weight")
    if (
        backend.use_kernel_path(use_kernel, True)
        and kernel_serves(branch.shape[-1], branch.dtype)
        and branch.size > 0
    ):
        if backend.BACKEND != "cuda":
            prefetch = None
        return kernel_residual_norm(
            branch, residual, weight, eps, next_weight, next_eps, prefetch
        )
    return reference_residual_norm(branch, residual, weight, eps, next_weight, next_eps)
