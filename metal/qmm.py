"""Small-row matmul ``y = x @ W.T`` for 1 to 32 rows, with mlx's affine-quantized weights.

A verify forward multiplies 16 rows, a decode step one, by every weight of the
model: both should cost about one read of the weights. :func:`small_row_matmul`
reads each weight once for all rows of a 16-row block, for mlx's affine
quantization (``mx.quantize``: 4 or 8 bits packed in ``uint32`` words, low bits
first, one scale and bias per ``group_size`` of 32, 64 or 128 elements;
``W[n, k] = scale * q + bias``) and for dense float weights.

**Batch invariance.** Every output element is summed in one fixed order that
depends only on ``K``: each of 32 lanes sums its own elements ``k = 256 c + 8 l +
i`` (chunks ``c`` ascending, ``i`` ascending) with fused multiply-adds, then the 32
lane sums are added in lane order. No step depends on the number of rows or on a
row's slot, so a 16-row verify gives every row the bits of a one-row step.

Three forms: the pure-MLX reference (:func:`reference_matmul`: ``W`` in float32,
one matmul call per row, so every row runs the very same call), and one body (:data:`SMALL_ROW_AFFINE`, :data:`SMALL_ROW_DENSE`) for the
Metal kernel and its CUDA twin: a threadgroup of 8 warps covers 32 output columns
and 16 rows; it stages 256-element chunks of the rows in threadgroup memory as
float32, each lane dequantizes 8 weights of 4 columns and multiplies them into
all rows. Weights are dequantized in float32 (``fma(scale, q, bias)``) and sums
kept in float32. The forms are not bit-equal to each other or to
``mx.quantized_matmul`` (whose kernels group the sums differently, and on the CPU
lose precision in bfloat16); each is batch-invariant.
"""

from __future__ import annotations

import functools
from typing import Callable, Optional, Sequence

import mlx.core as mx

from . import backend, groups, tensor_qmm
from .groups import GroupKernelSpec, int_params
from .sources import CUDA

MAX_ROWS = 32
ROW_BLOCK = 16
THREADS = 256
WARPS = THREADS // 32
COLUMNS_PER_WARP = 4
COLUMNS = WARPS * COLUMNS_PER_WARP
CHUNK = 256
BITS = (4, 8)
GROUP_SIZES = tensor_qmm.GROUP_SIZES  # one scaled tensor-core kernel per size
DTYPES = (mx.bfloat16, mx.float16, mx.float32)
# On CUDA the kernel path takes the tensor-core form (:mod:`dflash.metal.tensor_qmm`)
# for the calls it serves; tests set this False to run the scalar kernel there too.
TENSOR_CORES = True


# ----------------------------------------------------------------- contract


def arrays_served(
    dtype: mx.Dtype,
    weight: mx.array,
    scales: Optional[mx.array],
    biases: Optional[mx.array],
    bits: Optional[int],
    group_size: Optional[int],
) -> bool:
    """Whether the kernel path takes inputs of ``dtype`` against these arrays: a
    dtype it takes, and the weights' own (dense), or affine scales and biases of
    that dtype with bits and a group size it has a form for. The one rule a patched
    layer and a fused set both ask (their calls must agree on who launches)."""
    if dtype not in DTYPES:
        return False
    if scales is None:
        return weight.dtype == dtype
    return (
        bits in BITS
        and group_size in GROUP_SIZES
        and biases is not None
        and scales.dtype == dtype
        and biases.dtype == dtype
    )


def _geometry_key(array: Optional[mx.array]) -> Optional[tuple]:
    return None if array is None else (tuple(array.shape), array.dtype)


@functools.lru_cache(maxsize=1024)
def _check_geometry(
    x_shape, x_dtype, w_shape, w_dtype, scales, biases, bits, group_size
) -> tuple[int, int, int]:
    """Validate a call from its shapes and dtypes; return ``(rows, N, K)``.

    ``scales`` / ``biases`` are ``(shape, dtype)`` or None. Memoised: each geometry is
    validated once (a failing one raises every time, nothing is cached).

    Raises:
        ValueError: On any inconsistent argument.
    """
    x = _Geometry(x_shape, x_dtype)
    weight = _Geometry(w_shape, w_dtype)
    scales = None if scales is None else _Geometry(*scales)
    biases = None if biases is None else _Geometry(*biases)
    if x.ndim != 2:
        raise ValueError(f"x must be (M, K), got shape {x.shape}")
    if x.dtype not in DTYPES:
        raise ValueError(f"x dtype {x.dtype} is not bfloat16, float16 or float32")
    rows, depth = x.shape
    if not 1 <= rows:
        raise ValueError("x holds no row")
    if weight.ndim != 2:
        raise ValueError(f"weight must be 2-D, got shape {weight.shape}")
    if bits is None:
        if scales is not None or biases is not None or group_size is not None:
            raise ValueError("dense weights take no scales, biases or group_size")
        if weight.dtype != x.dtype or weight.shape[1] != depth:
            raise ValueError(
                f"dense weight {weight.shape} ({weight.dtype}) does not fit x {x.shape} ({x.dtype})"
            )
        return rows, weight.shape[0], depth
    if bits not in BITS:
        raise ValueError(f"bits must be one of {BITS}, got {bits}")
    if group_size not in GROUP_SIZES:
        raise ValueError(f"group_size must be one of {GROUP_SIZES}, got {group_size}")
    if scales is None or biases is None:
        raise ValueError("affine-quantized weights need scales and biases")
    if weight.dtype != mx.uint32:
        raise ValueError(f"quantized weight must be uint32, got {weight.dtype}")
    columns = weight.shape[0]
    if depth % group_size or weight.shape[1] * 32 // bits != depth:
        raise ValueError(
            f"weight {weight.shape} at {bits} bits holds {weight.shape[1] * 32 // bits} "
            f"elements per row, x has K={depth} (a multiple of group_size={group_size})"
        )
    want = (columns, depth // group_size)
    for name, array in (("scales", scales), ("biases", biases)):
        if tuple(array.shape) != want:
            raise ValueError(f"{name} must have shape {want}, got {array.shape}")
        if array.dtype != x.dtype:
            raise ValueError(f"{name} are {array.dtype}, x is {x.dtype}")
    return rows, columns, depth


class _Geometry:
    """The shape and dtype of an array (what :func:`_check_geometry` reads)."""

    __slots__ = ("shape", "dtype", "ndim")

    def __init__(self, shape: tuple[int, ...], dtype: mx.Dtype) -> None:
        self.shape, self.dtype, self.ndim = shape, dtype, len(shape)


# ---------------------------------------------------------------- reference


def float32_weight(
    weight: mx.array,
    scales: Optional[mx.array],
    biases: Optional[mx.array],
    bits: Optional[int],
    group_size: Optional[int],
) -> mx.array:
    """``W`` in float32: dequantized with float32 scales and biases, or converted.

    Shapes: returns ``(N, K)``.
    """
    if bits is None:
        return weight.astype(mx.float32)
    return mx.dequantize(
        weight,
        scales.astype(mx.float32),
        biases.astype(mx.float32),
        group_size=group_size,
        bits=bits,
    )


def reference_matmul(
    x: mx.array,
    weight: mx.array,
    scales: Optional[mx.array],
    biases: Optional[mx.array],
    bits: Optional[int],
    group_size: Optional[int],
) -> mx.array:
    """The pure-MLX form: ``W`` in float32, one float32 matmul call per row.

    Every row runs the very same call (one row times ``W.T``), so a row's bits do not
    depend on the other rows. Weights and sums in float32, like the kernel.

    Shapes: x ``(M, K)``; returns ``(M, N)``.
    """
    transposed = float32_weight(weight, scales, biases, bits, group_size).T
    rows = x.astype(mx.float32)
    out = [rows[row : row + 1] @ transposed for row in range(x.shape[0])]
    out = out[0] if len(out) == 1 else mx.concatenate(out, axis=0)
    return out.astype(x.dtype)


# ------------------------------------------------------------------ kernels

_LOAD_AFFINE = """
        // 8 weights of column n from element k: one 4-bit word or two 8-bit words.
        const int g = (k0 + kk) / group_size;
        const float s = float(scales[n * groups_k + g]);
        const float b = float(biases[n * groups_k + g]);
        const int first = (k0 + kk) * bits / 32;
        const size_t row = size_t(n) * size_t(words);
        for (int i = 0; i < 8; ++i) {
          const int bit = i * bits;
          const uint32_t word = weight[row + size_t(first + bit / 32)];
          const uint32_t q = (word >> uint32_t(bit % 32)) & uint32_t((1 << bits) - 1);
          wv[c][i] = DFL_FMA(s, float(q), b);
        }
"""

_LOAD_DENSE = """
        // 64-bit row offset: N * K passes 2^31 for large vocabularies.
        const size_t row = size_t(n) * size_t(depth);
        for (int i = 0; i < 8; ++i) {
          wv[c][i] = float(weight[row + size_t(k0 + kk + i)]);
        }
"""

_BODY = """
  DFL_SHARED float smem[{rows} * {chunk}];
  const int n_rows = params[0];
  const int n_cols = params[1];
  const int depth = params[2];
  const int bits = params[3];
  const int group_size = params[4];
  const int col_tiles = params[5];
  const int words = params[6];
  const int groups_k = params[7];
  const int tile = int(group) % col_tiles;
  const int rb = int(group) / col_tiles;
  const int warp = int(lid) / 32;
  const int lane = int(lid) % 32;
  const int row0 = rb * {rows};
  const int block_rows = n_rows - row0 < {rows} ? n_rows - row0 : {rows};
  (void)bits;
  (void)group_size;
  (void)words;
  (void)groups_k;

  float acc[{cpw}][{rows}];
  for (int c = 0; c < {cpw}; ++c) {
    for (int m = 0; m < {rows}; ++m) {
      acc[c][m] = 0.0f;
    }
  }
  float wv[{cpw}][8];
  for (int k0 = 0; k0 < depth; k0 += {chunk}) {
    const int len = depth - k0 < {chunk} ? depth - k0 : {chunk};
    // The block's rows, elements k0 .. k0 + len, as float32.
    DFL_BARRIER();
    // Only the block's rows: the products below never read past them.
    for (int idx = int(lid); idx < block_rows * {chunk}; idx += {threads}) {
      const int m = idx / {chunk};
      const int k = idx % {chunk};
      smem[idx] = k < len ? float(x[(row0 + m) * depth + k0 + k]) : 0.0f;
    }
    DFL_BARRIER();
    const int kk = 8 * lane;
    if (kk < len) {
      for (int c = 0; c < {cpw}; ++c) {
        const int n = tile * {columns} + warp * {cpw} + c;
        for (int i = 0; i < 8; ++i) {
          wv[c][i] = 0.0f;
        }
        if (n < n_cols) {
{load}
        }
      }
      for (int m = 0; m < {rows}; ++m) {
        if (m < block_rows) {
          for (int i = 0; i < 8; ++i) {
            const float xv = smem[m * {chunk} + kk + i];
            for (int c = 0; c < {cpw}; ++c) {
              acc[c][m] = DFL_FMA(xv, wv[c][i], acc[c][m]);
            }
          }
        }
      }
    }
  }
  // Lane sums added in lane order, one column at a time.
  for (int c = 0; c < {cpw}; ++c) {
    DFL_BARRIER();
    for (int m = 0; m < {rows}; ++m) {
      smem[(warp * 32 + lane) * {rows} + m] = acc[c][m];
    }
    DFL_BARRIER();
    const int n = tile * {columns} + warp * {cpw} + c;
    if (lane < block_rows && n < n_cols) {
      float total = 0.0f;
      for (int j = 0; j < 32; ++j) {
        total += smem[(warp * 32 + j) * {rows} + lane];
      }
      y[(row0 + lane) * n_cols + n] = T(total);
    }
  }
"""


def _body(load: str) -> str:
    text = _BODY
    for key, value in (
        ("{rows}", ROW_BLOCK),
        ("{chunk}", CHUNK),
        ("{cpw}", COLUMNS_PER_WARP),
        ("{columns}", COLUMNS),
        ("{threads}", THREADS),
    ):
        text = text.replace(key, str(value))
    return text.replace("{load}", load)


SMALL_ROW_AFFINE = GroupKernelSpec(
    base="small_row_affine",
    input_names=("x", "weight", "scales", "biases", "params"),
    input_types=("T", "uint32", "T", "T", "int32"),
    output_names=("y",),
    output_types=("T",),
    helpers="",
    body=_body(_LOAD_AFFINE),
    threads=THREADS,
)
SMALL_ROW_DENSE = GroupKernelSpec(
    base="small_row_dense",
    input_names=("x", "weight", "params"),
    input_types=("T", "T", "int32"),
    output_names=("y",),
    output_types=("T",),
    helpers="",
    body=_body(_LOAD_DENSE),
    threads=THREADS,
)
SPECS = (SMALL_ROW_AFFINE, SMALL_ROW_DENSE)


def kernel_matmul(
    x: mx.array,
    weight: mx.array,
    scales: Optional[mx.array],
    biases: Optional[mx.array],
    bits: Optional[int],
    group_size: Optional[int],
) -> mx.array:
    """The custom-kernel form (one launch).

    Shapes: x ``(M, K)``; returns ``(M, N)``.
    """
    rows, depth = x.shape
    columns = weight.shape[0]
    col_tiles = -(-columns // COLUMNS)
    row_blocks = -(-rows // ROW_BLOCK)
    ints = int_params(
        rows, columns, depth, bits or 0, group_size or 0, col_tiles,
        weight.shape[1], depth // group_size if group_size else 0,
    )  # fmt: skip
    if bits is None:
        spec, inputs = SMALL_ROW_DENSE, [x, weight, ints]
    else:
        spec, inputs = SMALL_ROW_AFFINE, [x, weight, scales, biases, ints]
    (y,) = groups.launch_groups(
        spec, inputs, [(rows, columns)], [x.dtype], col_tiles * row_blocks, x.dtype
    )
    return y


def small_row_matmul(
    x: mx.array,
    weight: mx.array,
    scales: Optional[mx.array] = None,
    biases: Optional[mx.array] = None,
    *,
    bits: Optional[int] = None,
    group_size: Optional[int] = None,
    use_kernel: Optional[bool] = None,
) -> mx.array:
    """``x @ W.T`` for a few rows, batch-invariant; ``W`` dense or affine-quantized.

    With ``bits`` set this is ``mx.quantized_matmul(x, weight, scales, biases,
    transpose=True, group_size=group_size, bits=bits)``; without, ``x @ weight.T``.

    Args:
        x: The rows (bfloat16, float16 or float32).
        weight: Dense ``(N, K)`` in x's dtype, or ``uint32`` ``(N, K * bits / 32)``.
        scales: Per-group scales ``(N, K / group_size)`` in x's dtype (quantized only).
        biases: Per-group biases, same shape.
        bits: 4 or 8 for quantized weights, None for dense.
        group_size: 32, 64 or 128 (quantized only).
        use_kernel: None picks the kernel on a GPU backend for at most 32 rows
            (``DFLASH_KERNELS`` not 0), else the reference; True / False force a form.
            On CUDA the kernel is the tensor-core form for the calls it serves
            (:func:`uses_tensor_cores`), the scalar kernel otherwise.

    Returns:
        ``(M, N)`` in x's dtype.

    Shapes: x ``(M, K)``; returns ``(M, N)``.

    Raises:
        ValueError: On any inconsistent argument (nothing is launched).
        RuntimeError: ``use_kernel=True`` without Metal or CUDA.
    """
    bound = bind_matmul(
        x.shape, x.dtype, weight, scales, biases,
        bits=bits, group_size=group_size, use_kernel=use_kernel,
    )  # fmt: skip
    return bound(x)


# ``(x, counters=None) -> x @ W.T``; see :func:`compile_around` for ``counters``.
BoundMatmul = Callable[..., mx.array]


def bind_matmul(
    x_shape: Sequence[int],
    x_dtype: mx.Dtype,
    weight: mx.array,
    scales: Optional[mx.array] = None,
    biases: Optional[mx.array] = None,
    *,
    bits: Optional[int] = None,
    group_size: Optional[int] = None,
    use_kernel: Optional[bool] = None,
    members: Sequence[int] = (),
    lead: Optional[Sequence[int]] = None,
) -> BoundMatmul:
    """:func:`small_row_matmul` with everything but ``x`` fixed: checked, routed and
    planned once.

    A caller that multiplies the same weights by inputs of one geometry many times (a
    patched layer, one decode step after another) keeps the result per geometry; each
    call then costs only its launches' Python. The form (kernel or reference) is
    chosen here, once.

    Args:
        x_shape: The shape every ``x`` given to the result will have, ``(M, K)``.
        x_dtype: Their dtype.
        weight, scales, biases, bits, group_size, use_kernel: As
            :func:`small_row_matmul`.
        members: For stacked sibling weights, the first row of each member after
            the first: the tensor-core form may then store the members as blocks
            (``member_edges`` on the result; see
            :func:`~dflash.metal.tensor_qmm.bind_tensor_core`).
        lead: The leading shape of every ``x`` and result (its extents multiply to
            ``M``; default ``(M,)``): ``x`` is then ``(*lead, K)`` and the result
            ``(*lead, N)``. The tensor-core form takes and declares them so without
            a reshape (a member-major result stays flat, for
            :func:`~dflash.metal.tensor_qmm.member_views`); the others reshape.

    Returns:
        ``x -> x @ W.T`` for ``x`` of exactly ``(*lead, K)`` and ``x_dtype`` (not
        checked again).

    Raises:
        ValueError: On any inconsistent argument.
        RuntimeError: ``use_kernel=True`` without Metal or CUDA.
    """
    rows, _, depth = _check_geometry(
        tuple(x_shape), x_dtype, tuple(weight.shape), weight.dtype,
        _geometry_key(scales), _geometry_key(biases), bits, group_size,
    )  # fmt: skip
    # Each lane reads 8 consecutive elements of a row (affine K is a multiple of 32).
    serves = depth % 8 == 0
    if use_kernel is None:
        use_kernel = (
            serves and rows <= MAX_ROWS and backend.use_kernel_path(None, auto=True)
        )
    elif use_kernel:
        backend.use_kernel_path(True, auto=True)
        if not serves:
            raise ValueError(
                f"the small-row kernel needs K to be a multiple of 8, got {depth}"
            )
    lead = tensor_qmm.leading_shape(rows, lead)
    if use_kernel and uses_tensor_cores(x_dtype, rows, depth, weight.shape[0], bits):
        return tensor_qmm.bind_tensor_core(
            rows, depth, weight, scales, biases, bits, group_size, x_dtype, members,
            lead=lead,
        )  # fmt: skip
    form = kernel_matmul if use_kernel else reference_matmul
    shapes = ((rows, depth), (*lead, weight.shape[0]))
    return functools.partial(
        _bound_form, form, weight, scales, biases, bits, group_size, shapes
    )


def _bound_form(
    form, weight, scales, biases, bits, group_size, shapes, x: mx.array, counters=None
):
    # The reference and scalar forms elect no threadgroup: ``counters`` is never given.
    # They take x as (M, K); a reshape to the shape it has is no op (mlx returns it).
    flat, out_shape = shapes
    y = form(x.reshape(flat), weight, scales, biases, bits, group_size)
    return y.reshape(out_shape)


def compile_around(matmul: BoundMatmul, forward: Callable) -> Callable:
    """``forward`` (``(x, counters) -> ...``, calling ``matmul(..., counters)``) as a
    function of ``x``, compiled where ``backend.compile_bound`` says so.

    A matmul whose launch takes zeroed counters (``matmul.counters``, a merged K split)
    gets a fresh region of the counter pool at every call, outside the trace: a region
    captured by the trace would be shared by every replay, so by two replays mlx runs
    at once.
    """
    count = getattr(matmul, "counters", 0)
    if not count:
        return backend.compile_bound(functools.partial(forward, counters=None))
    compiled = backend.compile_bound(forward)

    def run(x: mx.array):
        return compiled(x, groups.launch_counters(count))

    return run


def uses_tensor_cores(
    dtype: mx.Dtype, rows: int, depth: int, columns: int, bits: Optional[int]
) -> bool:
    """Whether the kernel path of a (validated) call runs the tensor-core form: on CUDA,
    with :data:`TENSOR_CORES` on, for the calls
    :func:`~dflash.metal.tensor_qmm.tensor_core_serves` takes (same arguments)."""
    return (
        TENSOR_CORES
        and backend.BACKEND == CUDA
        and tensor_qmm.tensor_core_serves(dtype, rows, depth, columns, bits)
    )
