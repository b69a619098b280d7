"""The tensor-core form of the small-query attention (CUDA, bfloat16 / float16).

Same contract as :func:`dflash.metal.attention.small_query_attention` and the same
two-launch structure as its scalar kernel: one launch writes every (query row,
chunk) pair's softmax statistics and weighted values in the format
:data:`dflash.metal.attention.FOLD_CHUNKS` folds, the fold is the scalar form's.
What differs is how a chunk is attended, because the scalar body cannot meet the
issue's goal (16 queries x 16 query heads per KV head over 4k keys is ~1 GFLOP,
18 us at the H200's float32 peak; ``docs/verify-kernels-analysis.md``):

* rows are the grouped query heads of a KV head, so a staged key serves all of
  them; positions outside the live range are staged as zeros, rows are read where
  they lie in the ring or the held-back block (``cp.async``);
* scores ``Q K^T`` and weighted values ``P V`` come from ``mma.sync`` m16n8k16
  (bfloat16 / float16 inputs, float32 accumulators); ``K`` and ``V`` fragments
  from ``ldmatrix`` (``V`` transposed on the fly); weights are rounded to the input
  type for ``P V`` and the row sums add the rounded weights, so the normalisation
  matches what was multiplied.

Four layouts, which sum in different orders (one per process, ``DFLASH_TENSOR_LAYOUT``):

* ``wide`` (default since session 30): a threadgroup of 16 warps = 4 row tiles x 4 key
  tiles, one tile each, the chunk and the queries staged at once (ldmatrix gives the
  queries' fragments), bounded to 128 registers; the tiles' states meet in shared
  memory, combined in tile order; a row's chunk state is stored two floats at a time
  (session 40: the pass 16.4 -> 13.5 us at 4k keys and 16 queries);
* ``pair``: ``stream``'s rows with the chunk's tiles dealt to two groups of 4 warps,
  each folding its own, combined at the end;
* ``stream``: a threadgroup of 4 warps x 16 rows streams the chunk's 64-key tiles
  through two buffers; each warp folds them in order (online softmax);
* ``split``: a threadgroup of 8 warps = 2 row tiles x 4 key tiles, one tile per
  warp, the whole chunk staged at once; the tile partials meet in shared memory
  and are combined in tile order against their maximum, as the fold combines chunks.

``wide`` and ``pair`` also skip tiles no row sees (neither loaded nor attended: such a
tile's weights are exact zeros and its rescale is by exactly 1, so no bit changes),
skip the mask on tiles every row of a warp sees whole, keep scores in log2 units
(``exp2f``; the statistics are stored in natural units for the fold) and wrap the
ring with one compare.

Device time on an H200 (Nsight Compute, session 30, cycles; ``docs/verify-kernels-analysis.md``):
16 queries over 4k keys, the chunk pass 49.8k (``wide``), 53.3k (``pair``), 67.3k
(``stream``); one query 26.2k against 44.1k; over a 2,048-row ring 39.3k against
57.8k. All are latency-bound at low occupancy.

**Batch invariance.** A row's result is produced by the same instruction sequence
whatever the other rows are: the chunk's tiles are fixed by absolute position and
all of them are processed (``wide`` / ``pair`` skip a tile only where every row of the
warp sees none of it, which leaves each row's state exactly as processing it would),
the tensor core computes each output element from its own row and column only, the
row maxima and sums are reduced in a fixed order inside a quad (thread-local in key
order, then lanes ``xor 1``, ``xor 2``), the tiles of a chunk are folded (``stream``,
and ``pair`` within a group) or combined (``split``, ``wide``, ``pair``'s groups) in
tile order, and the chunks are folded by the shared fold. Rows of the tile that hold no query
are zeros and written nowhere. So a 16-query verify gives each row the bits of a
one-query step through this form. It is not bit-equal to the scalar kernel or the
reference (different summation grouping, weights rounded for ``P V``); it is
within the dtype's tolerance of them.

Served: CUDA, bfloat16 / float16, head dim a multiple of 16 up to 128, a chunk
that is a multiple of 64 keys (``split`` and ``wide``: at most 256; the default chunk
is 256). Everything else takes the
scalar kernel. There is no Metal body (``simdgroup_matrix`` would be its
counterpart); Metal keeps the scalar kernel.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from typing import Optional

import mlx.core as mx

from . import tensor_qmm
from .groups import GroupKernelSpec, indent
from .sources import CUDA

TILE = 64
# split: a threadgroup is 32 query rows (two m16 tiles) x one chunk of up to KEY_SPLIT
# tiles; one warp per (row tile, key tile), so 8 warps and one tile each.
KEY_SPLIT = 4
# stream: a threadgroup is 64 query rows (4 warps x one m16 tile) streaming the chunk's
# tiles through STAGES buffers, each warp folding them in order (online softmax).
STAGES = 2
# pair: stream's 64 rows, with the chunk's tiles dealt to PAIR_GROUPS groups of 4 warps
# (tile t to group t % PAIR_GROUPS), each folding its own tiles; the groups' states meet
# in shared memory at the end, combined in group order. Half of stream's chain a warp,
# twice its warps an SM.
PAIR_GROUPS = 2
# wide: 64 rows x a chunk of up to WIDE_GROUPS tiles, one warp a (row tile, key tile):
# 16 warps, one tile each, bounded to 128 registers (one CTA an SM).
WIDE_GROUPS = 4


@dataclass(frozen=True)
class Layout:
    """How a threadgroup of the chunk pass is cut.

    Attributes:
        name: ``"split"`` or ``"stream"``.
        rows: Query rows per threadgroup.
        threads: Threads per threadgroup.
        max_chunk: Largest chunk (keys) it takes.
    """

    name: str
    rows: int
    threads: int
    max_chunk: int


SPLIT = Layout("split", 32, 32 * 2 * KEY_SPLIT, KEY_SPLIT * TILE)
STREAM = Layout("stream", 64, 32 * 4, 1 << 30)
PAIR = Layout("pair", 64, 32 * 4 * PAIR_GROUPS, 1 << 30)
WIDE = Layout("wide", 64, 32 * 4 * WIDE_GROUPS, WIDE_GROUPS * TILE)
LAYOUTS = {layout.name: layout for layout in (SPLIT, STREAM, PAIR, WIDE)}
# The two layouts sum in different orders (different bits, each batch-invariant), so a
# process uses one: ``DFLASH_TENSOR_LAYOUT`` or the measured default.
LAYOUT_ENV = "DFLASH_TENSOR_LAYOUT"
DEFAULT_LAYOUT = "wide"


def layout_from_env() -> Layout:
    """The layout ``DFLASH_TENSOR_LAYOUT`` names, else :data:`DEFAULT_LAYOUT`.

    Raises:
        ValueError: The variable names no layout.
    """
    name = os.environ.get(LAYOUT_ENV, "").strip().lower() or DEFAULT_LAYOUT
    if name not in LAYOUTS:
        raise ValueError(
            f"{LAYOUT_ENV}={name!r}: expected one of {', '.join(sorted(LAYOUTS))}"
        )
    return LAYOUTS[name]


# Shared-memory row pitch: 8 elements of padding keep ldmatrix's eight 16-byte rows
# on distinct banks and every row 16-byte aligned for cp.async.
PAD = 8
MAX_DIM = 128
DTYPES = (mx.bfloat16, mx.float16)

# Inline PTX and the per-type overloads (the header precedes ``using T``).
TENSOR_HELPERS = r"""
DFL_FN uint32_t dfl_smem_address(const void* pointer) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(pointer));
}

// 16 bytes global -> shared, asynchronously; zero-filled when `fill` is false.
DFL_FN void dfl_cp_async16(void* shared, const void* global, bool fill) {
  const int bytes = fill ? 16 : 0;
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n"
               :: "r"(dfl_smem_address(shared)), "l"(global), "r"(bytes));
}

DFL_FN void dfl_cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }

template <int N>
DFL_FN void dfl_cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" :: "n"(N));
}

// Four 8x8 16-bit matrices; lane L gives the address of row L % 8 of matrix L / 8.
DFL_FN void dfl_ldmatrix_x4(uint32_t (&r)[4], const void* row) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(dfl_smem_address(row)));
}

DFL_FN void dfl_ldmatrix_x4_trans(uint32_t (&r)[4], const void* row) {
  asm volatile(
      "ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
      : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
      : "r"(dfl_smem_address(row)));
}

// D = A B + D, m16n8k16, float32 accumulators.
DFL_FN void dfl_mma(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1,
                    const __nv_bfloat16*) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
      "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

DFL_FN void dfl_mma(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1,
                    const __half*) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
      "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Two floats rounded to the 16-bit type, packed (first in the low half); `lo`/`hi`
// receive the rounded values back in float.
DFL_FN uint32_t dfl_pack(float a, float b, float& lo, float& hi,
                         const __nv_bfloat16*) {
  const __nv_bfloat162 pair = __floats2bfloat162_rn(a, b);
  lo = __low2float(pair);
  hi = __high2float(pair);
  return *reinterpret_cast<const uint32_t*>(&pair);
}

DFL_FN uint32_t dfl_pack(float a, float b, float& lo, float& hi, const __half*) {
  const __half2 pair = __floats2half2_rn(a, b);
  lo = __low2float(pair);
  hi = __high2float(pair);
  return *reinterpret_cast<const uint32_t*>(&pair);
}
"""


# The chunk pass's launch parameters and its threadgroup's place in the grid, shared
# with the scalar chunk pass (``attention.ATTEND_CHUNKS_BODY``); ``dim`` is read apart.
CHUNK_PARAMS = """\
  const int n_heads = params[1];
  const int n_kv = params[2];
  const int n_queries = params[3];
  const int cap = params[5];
  const int n_block = params[6];
  const int query_start = params[7];
  const int origin_logical = params[8];
  const int origin_physical = params[9];
  const int ring_len = params[10];
  const int window = params[11];
  const int causal = params[12];
  const int chunk = params[13];
  const int chunk_first = params[14];
  const int n_chunks = params[15];
  const int row_blocks = params[16];
  const float scale = fparams[0];
  const float softcap = fparams[1];

  const int group_size = n_heads / n_kv;
  const int head_rows = group_size * n_queries;
  int rest = int(group);
  const int rb = rest % row_blocks;
  rest = rest / row_blocks;
  const int u = rest % n_chunks;
  rest = rest / n_chunks;
  const int h = rest % n_kv;
  const int b = rest / n_kv;
  const int bh = b * n_kv + h;
  const int chunk_start = (chunk_first + u) * chunk;
  const int ring_end = origin_logical + ring_len;
  const int key_end = ring_end + n_block;
"""
_PARAMS = CHUNK_PARAMS

# Body text both layouts share, at a base indent of 2 (``_indent`` adds more).
# @TILE@: the warp's row-tile index; @LIVE@: an extra condition for loading queries;
# @MAX@: the variable receiving the tile's row maxima.
# Where the row at absolute position ``pos`` lies (plane or block), and whether it is live.
_ROW_SOURCES = """\
  const bool live = pos >= origin_logical && pos < key_end;
  const T* k_src = keys;
  const T* v_src = values;
  if (live) {
    const int off = dfl_row_offset(pos, bh, DIM, cap, n_block, origin_logical,
                                   origin_physical, ring_end);
    k_src = (pos < ring_end ? keys : block_keys) + off + c;
    v_src = (pos < ring_end ? values : block_values) + off + c;
  }
"""
# The thread's warp, lane, fragment row group (gid) and thread in group (tig).
_LANES = """\
  const int warp = int(lid) / 32;
  const int lane = int(lid) % 32;
  const int gid = lane >> 2;
  const int tig = lane & 3;
"""
_ROWS = """\
  int row[2];
  bool row_ok[2];
  int first[2];
  int last[2];
  for (int i = 0; i < 2; ++i) {
    row[i] = rb * ROWS + @TILE@ * 16 + gid + 8 * i;
    row_ok[i] = row[i] < head_rows;
    const int r = row_ok[i] ? row[i] : 0;
    first[i] = 1;
    last[i] = 0;
    if (row_ok[i]) {
      const int qpos = query_start + r % n_queries;
      first[i] = dfl_first_key(qpos, window);
      last[i] = dfl_last_key(qpos, window, causal, key_end);
    }
  }
"""
_QUERY_FRAGMENTS = """\
  uint32_t q_frag[KSTEPS][4];
  for (int ks = 0; ks < KSTEPS; ++ks) {
    for (int j = 0; j < 4; ++j) {
      const int i = j & 1;
      const int d = ks * 16 + tig * 2 + (j >> 1) * 8;
      // Queries come (B, S, Hq, D) (see attention.kernel_attention).
      const int r = row_ok[i] ? row[i] : 0;
      const int qsrc =
          (b * n_queries + r % n_queries) * n_heads + h * group_size + r / n_queries;
      q_frag[ks][j] = @LIVE@row_ok[i]
          ? *reinterpret_cast<const uint32_t*>(queries + qsrc * DIM + d)
          : 0u;
    }
  }

"""
_ACCUMULATORS = """\
  float acc[DIM_TILES][4];
  for (int dt = 0; dt < DIM_TILES; ++dt) {
    for (int j = 0; j < 4; ++j) {
      acc[dt][j] = 0.0f;
    }
  }
"""
# Scores of the warp's 16 rows against its 64 keys.
_SCORES = """\
  float s[KEY_TILES][4];
  for (int j = 0; j < KEY_TILES; ++j) {
    for (int e = 0; e < 4; ++e) {
      s[j][e] = 0.0f;
    }
  }
  for (int ks = 0; ks < KSTEPS; ++ks) {
    for (int j = 0; j < KEY_TILES; j += 2) {
      // Matrices: keys j*8.. x dims lo/hi, keys (j+1)*8.. x dims lo/hi.
      const int mi = lane >> 3;
      const int key = (j + (mi >> 1)) * 8 + (lane & 7);
      const int d = ks * 16 + (mi & 1) * 8;
      uint32_t kf[4];
      dfl_ldmatrix_x4(kf, k_tile + key * PITCH + d);
      dfl_mma(s[j], q_frag[ks], kf[0], kf[1], queries);
      dfl_mma(s[j + 1], q_frag[ks], kf[2], kf[3], queries);
    }
  }
"""
# Scale, soft-cap, hide what a row does not see; the tile's row maxima.
_MASK = """\
  for (int j = 0; j < KEY_TILES; ++j) {
    for (int e = 0; e < 4; ++e) {
      const int i = e >> 1;
      const int pos = tile_start + j * 8 + tig * 2 + (e & 1);
      float score = s[j][e] * scale;
      if (softcap > 0.0f) {
        score = softcap * tanhf(score / softcap);
      }
      const bool seen = pos >= first[i] && pos <= last[i];
      s[j][e] = seen ? score : NEG_INF;
      @MAX@[i] = fmaxf(@MAX@[i], s[j][e]);
    }
  }
"""
_WEIGHTED_VALUES = """\
  // Weighted values: 16 keys per k-step; V fragments transposed by ldmatrix.
  for (int kk = 0; kk < TILE / 16; ++kk) {
    const uint32_t p_a[4] = {p_frag[2 * kk][0], p_frag[2 * kk][1],
                             p_frag[2 * kk + 1][0], p_frag[2 * kk + 1][1]};
    for (int dt = 0; dt < DIM_TILES; dt += 2) {
      // Matrices: keys lo/hi x dims dt*8.., keys lo/hi x dims (dt+1)*8...
      const int mi = lane >> 3;
      const int key = kk * 16 + (mi & 1) * 8 + (lane & 7);
      const int d = (dt + (mi >> 1)) * 8;
      uint32_t vf[4];
      dfl_ldmatrix_x4_trans(vf, v_tile + key * PITCH + d);
      dfl_mma(acc[dt], p_a, vf[0], vf[1], queries);
      dfl_mma(acc[dt + 1], p_a, vf[2], vf[3], queries);
    }
  }
"""


# A thread's rows' chunk statistics (@STAT_M@, @STAT_L@) and weighted values, stored
# for the fold.
_PARTIAL_STORES = r"""  for (int i = 0; i < 2; ++i) {
    if (!row_ok[i]) {
      continue;
    }
    const int qrow = (b * n_heads + h * group_size + row[i] / n_queries) * n_queries
        + row[i] % n_queries;
    const int at = qrow * n_chunks + u;
    if (tig == 0) {
      part_stats[at * 2] = @STAT_M@;
      part_stats[at * 2 + 1] = @STAT_L@;
    }
    for (int dt = 0; dt < DIM_TILES; ++dt) {
      const int d = dt * 8 + tig * 2;
      part_values[at * DIM + d] = acc[dt][2 * i];
      part_values[at * DIM + d + 1] = acc[dt][2 * i + 1];
    }
  }
"""


def _partial_stores(stat_m: str, stat_l: str) -> str:
    return _PARTIAL_STORES.replace("@STAT_M@", stat_m).replace("@STAT_L@", stat_l)


def _constants(dim: int, layout: Layout, name: str, value: int) -> str:
    """A body's compile-time constants and the derived tile counts.

    ``name`` / ``value``: the layout's own constant (``KEY_SPLIT`` or ``STAGES``).
    """
    return (
        f"""
  constexpr int DIM = {dim};
  constexpr int ROWS = {layout.rows};
  constexpr int THREADS = {layout.threads};
  constexpr int TILE = {TILE};
  constexpr int {name} = {value};
  constexpr int PITCH = DIM + {PAD};
"""
        + r"""
  constexpr int KSTEPS = DIM / 16;     // k-steps of the scores over the head dim
  constexpr int KEY_TILES = TILE / 8;  // n-tiles of the scores (8 keys each)
  constexpr int DIM_TILES = DIM / 8;   // n-tiles of the weighted values
  constexpr int VECTORS = DIM / 8;     // 16-byte vectors per key row
  const float NEG_INF = -cuda::std::numeric_limits<float>::infinity();

"""
    )


def _split_body(dim: int) -> str:
    """The ``split`` layout's body for head dim ``dim`` (a compile-time constant)."""
    return (
        _constants(dim, SPLIT, "KEY_SPLIT", KEY_SPLIT)
        + _PARAMS
        + r"""  const int n_tiles = chunk / TILE;

  extern __shared__ __align__(16) unsigned char dfl_smem[];
  T* k_tiles = reinterpret_cast<T*>(dfl_smem);
  T* v_tiles = k_tiles + KEY_SPLIT * TILE * PITCH;

  // Stage the chunk's keys and values (zeros outside the live positions).
  for (int idx = int(lid); idx < n_tiles * TILE * VECTORS; idx += THREADS) {
    const int r = idx / VECTORS;
    const int c = (idx % VECTORS) * 8;
    const int pos = chunk_start + r;
"""
        + indent(_ROW_SOURCES, 2)
        + r"""    dfl_cp_async16(k_tiles + r * PITCH + c, k_src, live);
    dfl_cp_async16(v_tiles + r * PITCH + c, v_src, live);
  }
  dfl_cp_async_commit();

  // Warp w: rows (w % 2) * 16 .. of the block, keys (w / 2) * TILE .. of the chunk.
"""
        + _LANES
        + r"""  const int row_tile = warp % 2;
  const int key_tile = warp / 2;
"""
        + _ROWS.replace("@TILE@", "row_tile")
        + r"""  const bool warp_active =
      rb * ROWS + row_tile * 16 < head_rows && key_tile < n_tiles;

  // Query fragments (A of the scores), zero for rows that hold no query; loaded
  // while the chunk streams in.
"""
        + _QUERY_FRAGMENTS.replace("@LIVE@", "warp_active && ")
        + r"""  float m_tile[2] = {NEG_INF, NEG_INF};
  float l_tile[2] = {0.0f, 0.0f};
"""
        + _ACCUMULATORS
        + r"""
  dfl_cp_async_wait<0>();
  __syncthreads();
  if (warp_active) {
    const T* k_tile = k_tiles + key_tile * TILE * PITCH;
    const T* v_tile = v_tiles + key_tile * TILE * PITCH;
    // Scores of the warp's 16 rows against its 64 keys.
"""
        + indent(_SCORES, 2)
        + r"""    // Scale, soft-cap, hide what a row does not see; the tile's row maxima.
    const int tile_start = chunk_start + key_tile * TILE;
"""
        + indent(_MASK.replace("@MAX@", "m_tile"), 2)
        + r"""    for (int i = 0; i < 2; ++i) {
      m_tile[i] = fmaxf(m_tile[i], __shfl_xor_sync(0xffffffffu, m_tile[i], 1));
      m_tile[i] = fmaxf(m_tile[i], __shfl_xor_sync(0xffffffffu, m_tile[i], 2));
    }
    // Weights, rounded to T (A of the weighted values); row sums of the rounded ones.
    uint32_t p_frag[KEY_TILES][2];
    for (int j = 0; j < KEY_TILES; ++j) {
      for (int i = 0; i < 2; ++i) {
        float w[2];
        for (int e = 0; e < 2; ++e) {
          const float x = s[j][2 * i + e];
          w[e] = x == NEG_INF ? 0.0f : expf(x - m_tile[i]);
        }
        float lo, hi;
        p_frag[j][i] = dfl_pack(w[0], w[1], lo, hi, queries);
        l_tile[i] += lo;
        l_tile[i] += hi;
      }
    }
    for (int i = 0; i < 2; ++i) {
      l_tile[i] += __shfl_xor_sync(0xffffffffu, l_tile[i], 1);
      l_tile[i] += __shfl_xor_sync(0xffffffffu, l_tile[i], 2);
    }
"""
        + indent(_WEIGHTED_VALUES, 2)
        + r"""  }
  __syncthreads();  // the tiles are read; their memory holds the warps' partials now

  // Each warp's tile partial: statistics and weighted values of its 16 rows.
  float* part_acc = reinterpret_cast<float*>(dfl_smem);
  float* part_stat = part_acc + 2 * KEY_SPLIT * 16 * DIM;
  for (int i = 0; i < 2; ++i) {
    const int at = warp * 16 + gid + 8 * i;
    if (tig == 0) {
      part_stat[at * 2] = m_tile[i];
      part_stat[at * 2 + 1] = l_tile[i];
    }
    for (int dt = 0; dt < DIM_TILES; ++dt) {
      const int d = dt * 8 + tig * 2;
      part_acc[at * DIM + d] = acc[dt][2 * i];
      part_acc[at * DIM + d + 1] = acc[dt][2 * i + 1];
    }
  }
  __syncthreads();

  // The chunk's partial per row: key tiles combined in ascending order against their
  // maximum (a tile the row does not see adds an exact zero).
  for (int idx = int(lid); idx < ROWS * DIM; idx += THREADS) {
    const int local = idx / DIM;
    const int d = idx % DIM;
    const int r = rb * ROWS + local;
    if (r >= head_rows) {
      continue;
    }
    const int tile_row = local % 16;
    const int rows_warp = local / 16;
    float top = NEG_INF;
    for (int k = 0; k < n_tiles; ++k) {
      top = fmaxf(top, part_stat[((k * 2 + rows_warp) * 16 + tile_row) * 2]);
    }
    float l = 0.0f;
    float a = 0.0f;
    for (int k = 0; k < n_tiles; ++k) {
      const int at = (k * 2 + rows_warp) * 16 + tile_row;
      const float l_k = part_stat[at * 2 + 1];
      const float w = l_k > 0.0f ? expf(part_stat[at * 2] - top) : 0.0f;
      l = fmaf(l_k, w, l);
      a = fmaf(part_acc[at * DIM + d], w, a);
    }
    const int q = (b * n_heads + h * group_size + r / n_queries) * n_queries + r % n_queries;
    const int at = q * n_chunks + u;
    part_values[at * DIM + d] = a;
    if (d == 0) {
      part_stats[at * 2] = top;
      part_stats[at * 2 + 1] = l;
    }
  }
"""
    )


def _stream_body(dim: int) -> str:
    """The ``stream`` layout's body for head dim ``dim`` (a compile-time constant)."""
    return (
        _constants(dim, STREAM, "STAGES", STAGES)
        + _PARAMS
        + r"""
  extern __shared__ __align__(16) unsigned char dfl_smem[];
  T* k_tiles = reinterpret_cast<T*>(dfl_smem);
  T* v_tiles = k_tiles + STAGES * TILE * PITCH;

  // Stage tile t's keys and values (zeros outside the live positions).
  auto load_tile = [&](int t, int stage) {
    const int tile_start = chunk_start + t * TILE;
    for (int idx = int(lid); idx < TILE * VECTORS; idx += THREADS) {
      const int r = idx / VECTORS;
      const int c = (idx % VECTORS) * 8;
      const int pos = tile_start + r;
"""
        + indent(_ROW_SOURCES, 4)
        + r"""      const int at = (stage * TILE + r) * PITCH + c;
      dfl_cp_async16(k_tiles + at, k_src, live);
      dfl_cp_async16(v_tiles + at, v_src, live);
    }
    dfl_cp_async_commit();
  };

  const int n_tiles = chunk / TILE;
  load_tile(0, 0);

"""
        + _LANES
        + r"""  // This thread's two rows of the warp's m16 tile: gid and gid + 8.
"""
        + _ROWS.replace("@TILE@", "warp")
        + r"""  const bool warp_active = rb * ROWS + warp * 16 < head_rows;

  // Query fragments (A of the scores), zero for rows that hold no query.
"""
        + _QUERY_FRAGMENTS.replace("@LIVE@", "")
        + r"""  float m_run[2] = {NEG_INF, NEG_INF};
  float l_run[2] = {0.0f, 0.0f};
"""
        + _ACCUMULATORS
        + r"""
  for (int t = 0; t < n_tiles; ++t) {
    if (t + 1 < n_tiles) {
      load_tile(t + 1, (t + 1) % STAGES);
      dfl_cp_async_wait<1>();
    } else {
      dfl_cp_async_wait<0>();
    }
    __syncthreads();
    const T* k_tile = k_tiles + (t % STAGES) * TILE * PITCH;
    const T* v_tile = v_tiles + (t % STAGES) * TILE * PITCH;
    if (warp_active) {
      // Scores of the warp's 16 rows against the tile's 64 keys.
"""
        + indent(_SCORES, 4)
        + r"""      // Scale, soft-cap, hide what a row does not see; the tile's row maxima.
      const int tile_start = chunk_start + t * TILE;
      float tile_max[2] = {NEG_INF, NEG_INF};
"""
        + indent(_MASK.replace("@MAX@", "tile_max"), 4)
        + r"""      float alpha[2];
      for (int i = 0; i < 2; ++i) {
        tile_max[i] = fmaxf(tile_max[i], __shfl_xor_sync(0xffffffffu, tile_max[i], 1));
        tile_max[i] = fmaxf(tile_max[i], __shfl_xor_sync(0xffffffffu, tile_max[i], 2));
        const float top = fmaxf(m_run[i], tile_max[i]);
        // Nothing seen yet (top is -inf): keep the state as it is.
        alpha[i] = top == NEG_INF ? 1.0f : expf(m_run[i] - top);
        m_run[i] = top;
      }
      // Weights, rounded to T (A of the weighted values); row sums of the rounded ones.
      uint32_t p_frag[KEY_TILES][2];
      float row_sum[2] = {0.0f, 0.0f};
      for (int j = 0; j < KEY_TILES; ++j) {
        for (int i = 0; i < 2; ++i) {
          float w[2];
          for (int e = 0; e < 2; ++e) {
            const float x = s[j][2 * i + e];
            w[e] = m_run[i] == NEG_INF || x == NEG_INF ? 0.0f : expf(x - m_run[i]);
          }
          float lo, hi;
          p_frag[j][i] = dfl_pack(w[0], w[1], lo, hi, queries);
          row_sum[i] += lo;
          row_sum[i] += hi;
        }
      }
      for (int i = 0; i < 2; ++i) {
        row_sum[i] += __shfl_xor_sync(0xffffffffu, row_sum[i], 1);
        row_sum[i] += __shfl_xor_sync(0xffffffffu, row_sum[i], 2);
        l_run[i] = l_run[i] * alpha[i] + row_sum[i];
      }
      for (int dt = 0; dt < DIM_TILES; ++dt) {
        acc[dt][0] *= alpha[0];
        acc[dt][1] *= alpha[0];
        acc[dt][2] *= alpha[1];
        acc[dt][3] *= alpha[1];
      }
"""
        + indent(_WEIGHTED_VALUES, 4)
        + r"""    }
    __syncthreads();
  }

  // The chunk's statistics and weighted values of this thread's rows.
"""
        + _partial_stores("m_run[i]", "l_run[i]")
    )


# Helpers only the pair and wide layouts' texts carry (stream's and split's texts, and so their
# kernel names, stay as they ran).
PAIR_HELPERS = r"""
// Element offset of row `pos` like dfl_row_offset, without the modulo: the plan keeps
// origin_physical < cap and pos - origin_logical < ring_len <= cap, so one wrap at most.
DFL_FN int dfl_row_offset_wrap(int pos, int bh, int dim, int cap, int n_block,
                               int origin_logical, int origin_physical, int ring_end) {
  if (pos < ring_end) {
    int row = origin_physical + (pos - origin_logical);
    row = row >= cap ? row - cap : row;
    return (bh * cap + row) * dim;
  }
  return (bh * n_block + (pos - ring_end)) * dim;
}
"""


# Two adjacent floats in one 8-byte store (``at`` 8-byte aligned); elsewhere (the CPU
# emulation) two stores of the same values.
STORE2_HELPER = r"""
DFL_FN void dfl_store2(float* at, float first, float second) {
#ifdef __CUDACC__
  *reinterpret_cast<float2*>(at) = make_float2(first, second);
#else
  at[0] = first;
  at[1] = second;
#endif
}
"""

# Helper text by layout (stream's and split's texts stay as they ran).
_LAYOUT_HELPERS = {
    "pair": PAIR_HELPERS,
    "wide": PAIR_HELPERS
    + STORE2_HELPER
    + tensor_qmm.launch_bounds(32 * 4 * WIDE_GROUPS, 1),
}


# Text both two-level layouts (``pair``, ``wide``) share. Row sources as _ROW_SOURCES's,
# the ring wrapped by one compare (``dfl_row_offset_wrap``).
_WRAP_ROW_SOURCES = _ROW_SOURCES.replace(
    "dfl_row_offset(pos", "dfl_row_offset_wrap(pos"
).replace("\n" + " " * 35 + "origin_physical", "\n" + " " * 40 + "origin_physical")
# The keys any query of the call sees: a tile outside them is neither loaded nor attended.
_CALL_KEYS = """  // Keys any query of the call sees (first and last keys grow with the position).
  const int call_first = dfl_first_key(query_start, window);
  const int call_last =
      dfl_last_key(query_start + n_queries - 1, window, causal, key_end);
"""
# Scores in log2 units (exp2f); statistics back in natural units for the fold.
_LOG2_UNITS = """  constexpr float LOG2E = 1.4426950408889634f;
  constexpr float LN2 = 0.6931471805599453f;
"""
# The key limits of the warp's rows.
_KEY_LIMITS = """  // The warp's rows' key limits: any row (skip) and every row (no mask).
  const int big = cuda::std::numeric_limits<int>::max();
  const int small = cuda::std::numeric_limits<int>::min();
  int first_min = big, first_max = small, last_min = big, last_max = small;
  for (int i = 0; i < 2; ++i) {
    if (row_ok[i]) {
      first_min = first[i] < first_min ? first[i] : first_min;
      first_max = first[i] > first_max ? first[i] : first_max;
      last_min = last[i] < last_min ? last[i] : last_min;
      last_max = last[i] > last_max ? last[i] : last_max;
    }
  }
  first_min = __reduce_min_sync(0xffffffffu, first_min);
  first_max = __reduce_max_sync(0xffffffffu, first_max);
  last_min = __reduce_min_sync(0xffffffffu, last_min);
  last_max = __reduce_max_sync(0xffffffffu, last_max);
"""
# The groups' states meet in shared memory and group 0 combines them in group order, then
# writes the chunk's statistics (natural units) and weighted values. @COMMENT@, @KEY@
# (the warp's key group), @M@ / @L@ (its state), @UNROLL_I@ / @UNROLL_G@ (pragma lines).
_COMBINED_GROUPS = r"""@COMMENT@  constexpr int VALUES = DIM_TILES * 4 + 4;
  float* exchange = reinterpret_cast<float*>(dfl_smem);
  if (@KEY@ > 0) {
    float* mine = exchange + ((@KEY@ - 1) * 4 + row_tile) * VALUES * 32 + lane;
    for (int dt = 0; dt < DIM_TILES; ++dt) {
      for (int j = 0; j < 4; ++j) {
        mine[(dt * 4 + j) * 32] = acc[dt][j];
      }
    }
    for (int i = 0; i < 2; ++i) {
      mine[(DIM_TILES * 4 + i) * 32] = @M@[i];
      mine[(DIM_TILES * 4 + 2 + i) * 32] = @L@[i];
    }
  }
  __syncthreads();
  if (@KEY@ > 0 || !warp_active) {
    return;
  }
@UNROLL_I@  for (int i = 0; i < 2; ++i) {
    float top = @M@[i];
    for (int g = 1; g < GROUPS; ++g) {
      const float* theirs = exchange + ((g - 1) * 4 + row_tile) * VALUES * 32 + lane;
      top = fmaxf(top, theirs[(DIM_TILES * 4 + i) * 32]);
    }
    // A state that saw nothing (-inf) weighs exactly 0; all -inf stays (-inf, 0, 0).
    const float own = @M@[i] == NEG_INF ? 0.0f : exp2f(@M@[i] - top);
    @L@[i] *= own;
    for (int dt = 0; dt < DIM_TILES; ++dt) {
      acc[dt][2 * i] *= own;
      acc[dt][2 * i + 1] *= own;
    }
@UNROLL_G@    for (int g = 1; g < GROUPS; ++g) {
      const float* theirs = exchange + ((g - 1) * 4 + row_tile) * VALUES * 32 + lane;
      const float m_g = theirs[(DIM_TILES * 4 + i) * 32];
      const float w = m_g == NEG_INF ? 0.0f : exp2f(m_g - top);
      @L@[i] = fmaf(theirs[(DIM_TILES * 4 + 2 + i) * 32], w, @L@[i]);
      for (int dt = 0; dt < DIM_TILES; ++dt) {
        for (int e = 0; e < 2; ++e) {
          acc[dt][2 * i + e] = fmaf(theirs[(dt * 4 + 2 * i + e) * 32], w, acc[dt][2 * i + e]);
        }
      }
    }
    @M@[i] = top;
  }

  // The chunk's statistics (natural units, as the fold reads them) and weighted values.
""" + _partial_stores("@M@[i] * LN2", "@L@[i]")
_PAIR_NAMES = (
    "  // The groups' states meet in shared memory (the tiles are read): group g > 0"
    " writes\n  // its warp's fragments lane-major, group 0 combines them in group"
    " order.\n",
    "key_group",
    "m_run",
    "l_run",
    "",
    "",
)
_WIDE_NAMES = (
    "  // Key tiles 1.. write their states lane-major; tile 0's warp combines them in"
    " order.\n",
    "key_tile",
    "m_tile",
    "l_tile",
    "  // Unrolled whole: an accumulator indexed at run time would live in local"
    " memory.\n#pragma unroll\n",
    "#pragma unroll\n",
)


def _combined_groups(
    comment: str, key: str, m: str, l: str, unroll_i: str, unroll_g: str
) -> str:
    """:data:`_COMBINED_GROUPS` with a layout's names (its text as it ran on the H200)."""
    return (
        _COMBINED_GROUPS.replace("@COMMENT@", comment)
        .replace("@KEY@", key)
        .replace("@M@", m)
        .replace("@L@", l)
        .replace("@UNROLL_I@", unroll_i)
        .replace("@UNROLL_G@", unroll_g)
    )


def _pair_body(dim: int) -> str:
    """The ``pair`` layout's body for head dim ``dim`` (a compile-time constant).

    Against ``stream``: tiles no query of the call sees are neither loaded nor
    attended (an unseen tile changes no bit of a row's state: its weights are exact
    zeros and its rescale is by exactly 1), tiles every row of a warp sees whole skip
    the mask, scores are kept in log2 units (``exp2f``; the statistics are stored in
    natural units for the shared fold), and the ring's wrap is one compare.
    """
    return (
        _constants(dim, PAIR, "GROUPS", PAIR_GROUPS)
        + _PARAMS
        + f"  constexpr int STAGES = {STAGES};\n"
        + _LOG2_UNITS
        + r"""  extern __shared__ __align__(16) unsigned char dfl_smem[];
  T* k_tiles = reinterpret_cast<T*>(dfl_smem);
  T* v_tiles = k_tiles + STAGES * GROUPS * TILE * PITCH;

  const int n_tiles = chunk / TILE;
  const int n_steps = (n_tiles + GROUPS - 1) / GROUPS;
"""
        + _CALL_KEYS
        + r"""
  // Stage step `step`'s tiles (tile step * GROUPS + g for group g) into `stage`;
  // a tile no query sees is skipped, positions outside the live ones are zeros.
  auto load_step = [&](int step, int stage) {
    for (int idx = int(lid); idx < GROUPS * TILE * VECTORS; idx += THREADS) {
      const int g = idx / (TILE * VECTORS);
      const int r = (idx / VECTORS) % TILE;
      const int c = (idx % VECTORS) * 8;
      const int t = step * GROUPS + g;
      const int tile_start = chunk_start + t * TILE;
      if (t >= n_tiles || tile_start > call_last || tile_start + TILE - 1 < call_first) {
        continue;
      }
      const int pos = tile_start + r;
"""
        + indent(_WRAP_ROW_SOURCES, 4)
        + r"""      const int at = ((stage * GROUPS + g) * TILE + r) * PITCH + c;
      dfl_cp_async16(k_tiles + at, k_src, live);
      dfl_cp_async16(v_tiles + at, v_src, live);
    }
    dfl_cp_async_commit();
  };
  load_step(0, 0);

"""
        + _LANES
        + r"""  const int row_tile = warp % 4;
  const int key_group = warp / 4;
  // This thread's two rows of the warp's m16 tile: gid and gid + 8.
"""
        + _ROWS.replace("@TILE@", "row_tile")
        + r"""  const bool warp_active = rb * ROWS + row_tile * 16 < head_rows;
"""
        + _KEY_LIMITS
        + r"""  const float scale_log2 = scale * LOG2E;
  const float softcap_log2 = softcap * LOG2E;

  // Query fragments (A of the scores), zero for rows that hold no query.
"""
        + _QUERY_FRAGMENTS.replace("@LIVE@", "warp_active && ")
        + r"""  // Running state in log2 units.
  float m_run[2] = {NEG_INF, NEG_INF};
  float l_run[2] = {0.0f, 0.0f};
"""
        + _ACCUMULATORS
        + r"""
  for (int step = 0; step < n_steps; ++step) {
    if (step + 1 < n_steps) {
      load_step(step + 1, (step + 1) % STAGES);
      dfl_cp_async_wait<1>();
    } else {
      dfl_cp_async_wait<0>();
    }
    __syncthreads();
    const int t = step * GROUPS + key_group;
    const int tile_start = chunk_start + t * TILE;
    const bool seen =
        t < n_tiles && tile_start <= last_max && tile_start + TILE - 1 >= first_min;
    if (warp_active && seen) {
      const T* k_tile = k_tiles + ((step % STAGES) * GROUPS + key_group) * TILE * PITCH;
      const T* v_tile = v_tiles + ((step % STAGES) * GROUPS + key_group) * TILE * PITCH;
      // Scores of the warp's 16 rows against the tile's 64 keys.
"""
        + indent(_SCORES, 4)
        + r"""      // Scale (to log2 units), soft-cap, hide what a row does not see; row maxima.
      const bool whole = first_max <= tile_start && last_min >= tile_start + TILE - 1;
      float tile_max[2] = {NEG_INF, NEG_INF};
      for (int j = 0; j < KEY_TILES; ++j) {
        for (int e = 0; e < 4; ++e) {
          const int i = e >> 1;
          float score = s[j][e] * scale_log2;
          if (softcap > 0.0f) {
            score = softcap_log2 * tanhf(s[j][e] * scale / softcap);
          }
          if (!whole) {
            const int pos = tile_start + j * 8 + tig * 2 + (e & 1);
            score = pos >= first[i] && pos <= last[i] ? score : NEG_INF;
          }
          s[j][e] = score;
          tile_max[i] = fmaxf(tile_max[i], score);
        }
      }
      float alpha[2];
      float m_use[2];
      for (int i = 0; i < 2; ++i) {
        tile_max[i] = fmaxf(tile_max[i], __shfl_xor_sync(0xffffffffu, tile_max[i], 1));
        tile_max[i] = fmaxf(tile_max[i], __shfl_xor_sync(0xffffffffu, tile_max[i], 2));
        const float top = fmaxf(m_run[i], tile_max[i]);
        // Nothing seen yet (top is -inf): keep the state as it is.
        alpha[i] = top == NEG_INF ? 1.0f : exp2f(m_run[i] - top);
        m_run[i] = top;
        // A row that has seen nothing has only -inf scores: exp2(-inf - 0) = 0.
        m_use[i] = top == NEG_INF ? 0.0f : top;
      }
      // Weights, rounded to T (A of the weighted values); row sums of the rounded ones.
      uint32_t p_frag[KEY_TILES][2];
      float row_sum[2] = {0.0f, 0.0f};
      for (int j = 0; j < KEY_TILES; ++j) {
        for (int i = 0; i < 2; ++i) {
          float lo, hi;
          p_frag[j][i] = dfl_pack(exp2f(s[j][2 * i] - m_use[i]),
                                  exp2f(s[j][2 * i + 1] - m_use[i]), lo, hi, queries);
          row_sum[i] += lo;
          row_sum[i] += hi;
        }
      }
      for (int i = 0; i < 2; ++i) {
        row_sum[i] += __shfl_xor_sync(0xffffffffu, row_sum[i], 1);
        row_sum[i] += __shfl_xor_sync(0xffffffffu, row_sum[i], 2);
        l_run[i] = l_run[i] * alpha[i] + row_sum[i];
      }
      for (int dt = 0; dt < DIM_TILES; ++dt) {
        acc[dt][0] *= alpha[0];
        acc[dt][1] *= alpha[0];
        acc[dt][2] *= alpha[1];
        acc[dt][3] *= alpha[1];
      }
"""
        + indent(_WEIGHTED_VALUES, 4)
        + r"""    }
    __syncthreads();
  }

"""
        + _combined_groups(*_PAIR_NAMES)
    )


def _wide_chunk_body(dim: int) -> str:
    """The ``wide`` layout's body for head dim ``dim`` (a compile-time constant).

    One warp a (row tile, key tile) of the chunk, 16 warps: each attends its one tile
    (no online rescale), the queries are staged once in shared memory for the four
    key tiles (ldmatrix gives the A fragments, so they hold no registers between
    uses), and the tiles' states meet in shared memory, combined in tile order.
    Unseen tiles, unmasked whole tiles, log2 scores and the ring's one-compare wrap
    as in ``pair``.
    """
    return (
        _constants(dim, WIDE, "GROUPS", WIDE_GROUPS)
        + _PARAMS
        + _LOG2_UNITS
        + r"""  extern __shared__ __align__(16) unsigned char dfl_smem[];
  T* k_tiles = reinterpret_cast<T*>(dfl_smem);
  T* v_tiles = k_tiles + GROUPS * TILE * PITCH;
  T* q_rows = v_tiles + GROUPS * TILE * PITCH;

  const int n_tiles = chunk / TILE;
"""
        + _CALL_KEYS
        + r"""
  // Stage the block's query rows (zeros for rows that hold none) and the chunk's
  // tiles that some query sees (zeros outside the live positions), all at once.
  for (int idx = int(lid); idx < ROWS * VECTORS; idx += THREADS) {
    const int r = idx / VECTORS;
    const int c = (idx % VECTORS) * 8;
    const int row = rb * ROWS + r;
    const bool ok = row < head_rows;
    // Queries come (B, S, Hq, D) (see attention.kernel_attention).
    const int qsrc = ok
        ? (b * n_queries + row % n_queries) * n_heads + h * group_size + row / n_queries
        : 0;
    dfl_cp_async16(q_rows + r * PITCH + c, queries + qsrc * DIM + c, ok);
  }
  for (int idx = int(lid); idx < GROUPS * TILE * VECTORS; idx += THREADS) {
    const int g = idx / (TILE * VECTORS);
    const int r = (idx / VECTORS) % TILE;
    const int c = (idx % VECTORS) * 8;
    const int tile_start = chunk_start + g * TILE;
    if (g >= n_tiles || tile_start > call_last || tile_start + TILE - 1 < call_first) {
      continue;
    }
    const int pos = tile_start + r;
"""
        + indent(_WRAP_ROW_SOURCES, 2)
        + r"""    dfl_cp_async16(k_tiles + (g * TILE + r) * PITCH + c, k_src, live);
    dfl_cp_async16(v_tiles + (g * TILE + r) * PITCH + c, v_src, live);
  }
  dfl_cp_async_commit();

"""
        + _LANES
        + r"""  const int row_tile = warp % 4;
  const int key_tile = warp / 4;
  // This thread's two rows of the warp's m16 tile: gid and gid + 8.
"""
        + _ROWS.replace("@TILE@", "row_tile")
        + r"""  const bool warp_active = rb * ROWS + row_tile * 16 < head_rows;
"""
        + _KEY_LIMITS
        + r"""  const int tile_start = chunk_start + key_tile * TILE;
  const bool seen =
      key_tile < n_tiles && tile_start <= last_max && tile_start + TILE - 1 >= first_min;

  // The tile's state in log2 units.
  float m_tile[2] = {NEG_INF, NEG_INF};
  float l_tile[2] = {0.0f, 0.0f};
"""
        + _ACCUMULATORS
        + r"""
  dfl_cp_async_wait<0>();
  __syncthreads();
  if (warp_active && seen) {
    const T* k_tile = k_tiles + key_tile * TILE * PITCH;
    const T* v_tile = v_tiles + key_tile * TILE * PITCH;
    const T* q_tile = q_rows + row_tile * 16 * PITCH;
    // Scores of the warp's 16 rows against its 64 keys; A fragments by ldmatrix
    // (matrices: rows lo/hi x dims lo, rows lo/hi x dims hi).
    float s[KEY_TILES][4];
    for (int j = 0; j < KEY_TILES; ++j) {
      for (int e = 0; e < 4; ++e) {
        s[j][e] = 0.0f;
      }
    }
    for (int ks = 0; ks < KSTEPS; ++ks) {
      uint32_t qa[4];
      dfl_ldmatrix_x4(qa, q_tile + (((lane >> 3) & 1) * 8 + (lane & 7)) * PITCH
                              + ks * 16 + (lane >> 4) * 8);
      for (int j = 0; j < KEY_TILES; j += 2) {
        // Matrices: keys j*8.. x dims lo/hi, keys (j+1)*8.. x dims lo/hi.
        const int mi = lane >> 3;
        const int key = (j + (mi >> 1)) * 8 + (lane & 7);
        const int d = ks * 16 + (mi & 1) * 8;
        uint32_t kf[4];
        dfl_ldmatrix_x4(kf, k_tile + key * PITCH + d);
        dfl_mma(s[j], qa, kf[0], kf[1], queries);
        dfl_mma(s[j + 1], qa, kf[2], kf[3], queries);
      }
    }
    // Scale (to log2 units), soft-cap, hide what a row does not see; row maxima.
    const bool whole = first_max <= tile_start && last_min >= tile_start + TILE - 1;
    const float scale_log2 = scale * LOG2E;
    for (int j = 0; j < KEY_TILES; ++j) {
      for (int e = 0; e < 4; ++e) {
        const int i = e >> 1;
        float score = s[j][e] * scale_log2;
        if (softcap > 0.0f) {
          score = softcap * LOG2E * tanhf(s[j][e] * scale / softcap);
        }
        if (!whole) {
          const int pos = tile_start + j * 8 + tig * 2 + (e & 1);
          score = pos >= first[i] && pos <= last[i] ? score : NEG_INF;
        }
        s[j][e] = score;
        m_tile[i] = fmaxf(m_tile[i], score);
      }
    }
    float m_use[2];
    for (int i = 0; i < 2; ++i) {
      m_tile[i] = fmaxf(m_tile[i], __shfl_xor_sync(0xffffffffu, m_tile[i], 1));
      m_tile[i] = fmaxf(m_tile[i], __shfl_xor_sync(0xffffffffu, m_tile[i], 2));
      // A row that sees nothing here has only -inf scores: exp2(-inf - 0) = 0.
      m_use[i] = m_tile[i] == NEG_INF ? 0.0f : m_tile[i];
    }
    // Weights, rounded to T (A of the weighted values); row sums of the rounded ones.
    uint32_t p_frag[KEY_TILES][2];
    for (int j = 0; j < KEY_TILES; ++j) {
      for (int i = 0; i < 2; ++i) {
        float lo, hi;
        p_frag[j][i] = dfl_pack(exp2f(s[j][2 * i] - m_use[i]),
                                exp2f(s[j][2 * i + 1] - m_use[i]), lo, hi, queries);
        l_tile[i] += lo;
        l_tile[i] += hi;
      }
    }
    for (int i = 0; i < 2; ++i) {
      l_tile[i] += __shfl_xor_sync(0xffffffffu, l_tile[i], 1);
      l_tile[i] += __shfl_xor_sync(0xffffffffu, l_tile[i], 2);
    }
"""
        + indent(_WEIGHTED_VALUES, 2)
        + r"""  }
  __syncthreads();  // the tiles are read: their memory holds the exchange now

"""
        + _combined_groups(*_WIDE_NAMES)
    )


# ``wide`` stores a row's chunk state two floats at a time (session 40 on an H200: the
# chunk pass 13.5 us against 16.4 for 16 queries over 4k keys; the last warps' scalar
# stores held the LSU queue). The same values reach the same addresses.
_WIDE_STORES = (
    (
        """      part_stats[at * 2] = m_tile[i] * LN2;
      part_stats[at * 2 + 1] = l_tile[i];
""",
        "      dfl_store2(part_stats + at * 2, m_tile[i] * LN2, l_tile[i]);\n",
    ),
    (
        """      part_values[at * DIM + d] = acc[dt][2 * i];
      part_values[at * DIM + d + 1] = acc[dt][2 * i + 1];
""",
        "      dfl_store2(part_values + at * DIM + d, acc[dt][2 * i], acc[dt][2 * i + 1]);\n",
    ),
)


def _wide_body(dim: int) -> str:
    """``wide``'s body: :func:`_wide_chunk_body` with its stores two floats at a time."""
    body = _wide_chunk_body(dim)
    for old, new in _WIDE_STORES:
        if body.count(old) != 1:
            raise AssertionError(f"expected one {old!r} in the body")
        body = body.replace(old, new)
    return body


def shared_bytes(dim: int, layout: Layout) -> int:
    """Dynamic shared memory of one threadgroup.

    ``split``: a whole chunk of keys and values (the warps' partials reuse it);
    ``stream``: ``STAGES`` tiles of keys and values; ``pair``: ``STAGES`` steps of
    ``PAIR_GROUPS`` tiles each (the groups' exchange at the end reuses them).
    """
    if layout is SPLIT:
        tiles = 2 * KEY_SPLIT * TILE * (dim + PAD) * 2
        partials = 4 * (layout.threads // 32) * 16 * (dim + 2)
        return max(tiles, partials)
    if layout is PAIR:
        return 2 * STAGES * PAIR_GROUPS * TILE * (dim + PAD) * 2
    if layout is WIDE:
        return (2 * WIDE_GROUPS * TILE + layout.rows) * (dim + PAD) * 2
    return 2 * STAGES * TILE * (dim + PAD) * 2


_BODIES = {
    "split": _split_body,
    "stream": _stream_body,
    "pair": _pair_body,
    "wide": _wide_body,
}


# Stacked planes and blocks: a ``(2, ...)`` K/V buffer bound whole as both ``keys`` and
# ``values`` (no view of its halves in the graph), the values read from an element
# offset the launch passes (0 for a container that is not stacked).
STACKED_PARAMS = """\
  const int plane_value_offset = params[17];
  const int block_value_offset = params[18];
"""
# Each chunk pass's value sources, read at those offsets (scalar and tensor-core).
_STACKED_READS = (
    (
        "    v_src = (pos < ring_end ? values : block_values) + off + c;\n",
        "    v_src = (pos < ring_end ? values + plane_value_offset\n"
        "                            : block_values + block_value_offset) + off + c;\n",
    ),
    (
        "    auto value = pos < ring_end ? values + off : block_values + off;\n",
        "    auto value = pos < ring_end ? values + plane_value_offset + off\n"
        "                                : block_values + block_value_offset + off;\n",
    ),
)


def stacked_body(body: str) -> str:
    """``body`` (a chunk pass) reading the values at the launch's value offsets
    (:data:`STACKED_PARAMS`, declared after the last of ``CHUNK_PARAMS``' ints).

    Raises:
        AssertionError: ``body`` has no value source this knows, or no params.
    """
    anchor = "  const int row_blocks = params[16];\n"
    if body.count(anchor) != 1:
        raise AssertionError("expected the chunk pass's params once in the body")
    body = body.replace(anchor, anchor + STACKED_PARAMS)
    replaced = 0
    for old, new in _STACKED_READS:
        replaced += body.count(old)
        body = body.replace(old, new)
    if not replaced:
        raise AssertionError("found no value source in the body")
    return body


def attend_spec(
    dim: int, layout: Layout = STREAM, stacked: bool = False
) -> GroupKernelSpec:
    """The chunk pass for head dim ``dim`` in ``layout`` (built once, one object
    however the arguments are passed); ``stacked``: its values read at the launch's
    offsets (:func:`stacked_body`)."""
    return _attend_spec(dim, layout, bool(stacked))


@functools.lru_cache(maxsize=None)
def _attend_spec(dim: int, layout: Layout, stacked: bool) -> GroupKernelSpec:
    """:func:`attend_spec`, memoised."""
    from .attention import ATTENTION_HELPERS

    body = _BODIES[layout.name](dim)
    return GroupKernelSpec(
        base=f"attend_chunks_{layout.name}{dim}" + "_stacked" * stacked,
        input_names=(
            "queries", "keys", "values", "block_keys", "block_values", "params",
            "fparams",
        ),
        input_types=("T", "T", "T", "T", "T", "int32", "float32"),
        output_names=("part_stats", "part_values"),
        output_types=("float32", "float32"),
        helpers=ATTENTION_HELPERS + TENSOR_HELPERS + _LAYOUT_HELPERS.get(layout.name, ""),
        body=stacked_body(body) if stacked else body,
        threads=layout.threads,
        small_inputs=("fparams",),
        backends=(CUDA,),
        shared_memory=shared_bytes(MAX_DIM, layout),
        dtypes=DTYPES,
    )  # fmt: skip


def tensor_serves(
    dim: int,
    chunk: int,
    dtype: mx.Dtype,
    backend_name: Optional[str],
    layout: Layout = STREAM,
) -> bool:
    """Whether the tensor-core form takes a call of this shape on ``backend_name``."""
    return (
        backend_name == CUDA
        and dtype in DTYPES
        and dim % 16 == 0
        and 16 <= dim <= MAX_DIM
        and chunk % TILE == 0
        and chunk <= layout.max_chunk
    )
