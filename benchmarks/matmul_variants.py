"""Device time of the tensor-core small-row matmul under layout variants (CUDA).

Each variant changes one or more of the form's knobs for the time of its rows:

* ``target``: CTAs a launch aims for before K is split (``tensor_qmm.TARGET_GROUPS``;
  the ``target*`` variants also turn the wave-aware split off, which ignores it);
* ``budget``: shared memory a stage ring may take (``tensor_qmm.SHARED_BUDGET``),
  which sets the pipeline depth and how many CTAs fit an SM; ``max_stages``: the
  deepest ring (``tensor_qmm.MAX_STAGES``); ``x_stride``: bytes an x row takes in a
  stage (0 drops the x rows from the stage: only with ``nox`` at 16 rows, diagnostics);
* ``plain_mma``: the mma helper as a non-volatile ``asm`` (the compiler may move it);
* ``merged`` / ``unmerged``: a K split's partials summed by the matmul launch
  itself (``tensor_qmm.MERGE_SPLIT_SUM``, the default since session 13) or by a second,
  reduce launch;
* ``waves`` / ``target``: the wave-aware K split (``tensor_qmm.WAVE_SPLIT``) or the
  ``TARGET_GROUPS`` rule; ``waves132``: the wave rule counting 132 resident CTAs
  (``tensor_qmm.RESIDENT_CTAS``) instead of 264;
* ``kgroups2`` / ``kgroups1``: each chunk's K split between two warp groups of a CTA
  (``tensor_qmm.K_GROUPS``: 256 threads, the same shared memory; the default since
  session 18) or one;
* ``folded`` / ``unfolded``: the 4-bit bfloat16 form with the ``128 + q`` offset folded
  into each group's bias (``tensor_qmm.FOLD_Q4_OFFSET``) or not;
* ``scaled``: the scaled-weight form (``tensor_qmm.SCALED_B``);
* ``constant_group``: the scaled forms' group size a compile-time constant (as
  shipped since session 28) or a launch parameter;
* ``cluster``: a K split of 2 to 4 ways summed inside a thread-block cluster
  (``tensor_qmm.CLUSTER_SUM``; refused while mlx records CUDA graphs: run with
  ``MLX_USE_CUDA_GRAPHS=0``);
* ``edits``: text edits of the kernels (:data:`EDITS`): L2 prefetch hints, and the
  diagnostics ``memonly`` / ``computeonly`` / ``contig`` / ``nox`` (wrong results).

Each call is bound once (``qmm.bind_matmul``), as a patched layer runs it; a merged
call's kernels include the fill of its fresh counters. For every variant, projection
shape and row count it reports the device time per call (CUPTI, through
``torch.profiler``), the kernels per call, the time over the
bandwidth bound of the bytes read, the largest difference from mlx's
``quantized_matmul`` (a variant that changes the K split changes the summation
order, so its bits, within tolerance), and whether its output has ``current``'s bits
(when ``current`` ran first: a same-bits variant's claim checked on the device).
mlx's own time is one row per shape. With
``--dense`` the weights are dense bf16 (a bf16 target's and the drafter's projections)
and mlx's row is its ``matmul`` (cuBLAS on CUDA).

By default every timed call reads the same weights, so a projection smaller than the
L2 cache (50 MB on an H100 / H200: ``o_proj``, ``mlp down``, the fused q / k / v / gate)
is timed with its weights in the L2, which a round's forward never has (a layer's
weights are read once a forward). ``--cold-bytes N`` times calls in turn over enough
copies of the weights (each bound apart, as each layer's are) to span ``N`` bytes, so
each call reads its weights from device memory; the same-bits and difference columns
use the first copy.

GPU (torch's interpreter, for CUPTI)::

    python -m benchmarks.matmul_variants --json docs/benchmarks/.../variants.json

The CPU has no tensor-core form: it exits with a one-line error.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import sys
from functools import partial
from typing import Callable, Iterator, List, Optional, Sequence

import mlx.core as mx

from dflash.metal import tensor_qmm
from dflash.metal.qmm import bind_matmul

from .common import write_json
from .verify_kernels import (
    GLIMMER,
    _weights,
    add_bandwidth_argument,
    device_time,
    per_call_meta,
    run_on_cuda,
)

VARIANTS = {
    "current": {},
    "target132": {"target": 132, "waves": False},
    "target528": {"target": 528, "waves": False},
    "target1056": {"target": 1056, "waves": False},
    "budget70k": {"budget": 70 * 1024},
    "budget70k-target528": {"budget": 70 * 1024, "target": 528, "waves": False},
    "plain_mma": {"plain_mma": True},
    "merged": {"merged": True},
    "unmerged": {"merged": False},
    "folded": {"folded": True},
    "unfolded": {"folded": False},
    "waves": {"waves": True},
    "target": {"waves": False},
    # The wave rule with one resident CTA an SM: CTAs sharing an SM share its issue
    # slots, so an SM's load is its CTAs' chunks (session 17's per-call data fit it).
    "waves132": {"waves": True, "resident": 132},
    # Each chunk's K split between two warp groups of a CTA (256 threads).
    "kgroups2": {"k_groups": 2},
    "kgroups1": {"k_groups": 1},
    # Three CTAs an SM (a 70 KB stage ring) with the wave rule counting them.
    "budget70k-waves396": {"budget": 70 * 1024, "waves": True, "resident": 396},
    # Session 41, what paces the copies (diagnostics, 16 rows; results wrong): the
    # launch, prologue and epilogue alone (no copies past the prologue, no arithmetic);
    # the weights' copies with no x rooms in the stages, so more stages fit (4 at two
    # CTAs an SM; 5 with a deeper cap); one CTA an SM with 6 to 8 stages.
    "skeleton": {"edits": ("memonly", "computeonly")},
    "empty": {"edits": ("empty",)},
    "prologue": {"edits": ("memonly", "computeonly", "noepilogue")},
    "noepilogue": {"edits": ("noepilogue",)},
    "memonly-nox-x0": {"x_stride": 0, "edits": ("memonly", "nox")},
    "memonly-nox-x0-s6": {"x_stride": 0, "max_stages": 6, "edits": ("memonly", "nox")},
    "memonly-1cta-s6": {
        "budget": 220 * 1024, "max_stages": 6, "waves": True, "resident": 132,
        "edits": ("memonly",),
    },  # fmt: skip
    "memonly-nox-x0-1cta-s8": {
        "budget": 220 * 1024, "max_stages": 8, "x_stride": 0, "waves": True,
        "resident": 132, "edits": ("memonly", "nox"),
    },  # fmt: skip
    "1cta-s4": {"budget": 130 * 1024, "waves": True, "resident": 132},
    "1cta-s6": {"budget": 220 * 1024, "max_stages": 6, "waves": True, "resident": 132},
    # The wave rule with a CTA's fixed cost counted as 2 (before session 41), 3, 4 (as
    # shipped) or 20 chunks.
    "overhead2": {"overhead": 2},
    "overhead3": {"overhead": 3},
    "overhead4": {"overhead": 4},
    "overhead20": {"overhead": 20},
    # The same for dense weights (``--dense``): 8 chunks as shipped since session 46
    # (2 before), 1 or 4 (a dense chunk is 64 elements of K, a quarter of an affine
    # one's).
    "dense-overhead1": {"dense_overhead": 1},
    "dense-overhead2": {"dense_overhead": 2},
    "dense-overhead4": {"dense_overhead": 4},
    "dense-overhead8": {"dense_overhead": 8},
    # Dense weights loaded straight into registers (``--dense``; session 46, untimed;
    # affine forms unchanged): see EDITS["wdirect-load"].
    "wdirect": {"edits": ("wdirect", "wdirect-load")},
    # The direct 4-bit form (tensor_qmm.DIRECT_Q4): each lane's weight words loaded from
    # global memory into registers a chunk ahead, no staging; with one K group (a lane
    # then holds both half chunks: 168-174 registers). Session 47 (16 rows): 11-41 %
    # slower than current on every Glimmer shape; one row within 5 %.
    "direct4": {"direct": True},
    "direct4-k1": {"direct": True, "k_groups": 1},
    "direct4-cluster": {"direct": True, "cluster": True},
    # Its words loaded at the top of the chunk that sums them (no register buffer
    # ahead: fewer registers, the load's latency behind the x barrier only), and its
    # loads as ld.global.nc with no L1 allocation (weights are read once). Same bits.
    "direct4-noahead": {
        "direct": True,
        "edits": ("direct-noahead", "direct-noprologue"),
    },
    "direct4-nc": {"direct": True, "edits": ("direct-nc",)},
    # The direct form with nothing staged (session 47, untimed): x's pieces and the
    # scales also read by each lane from global memory (L2) where it uses them, so the
    # chunk loop has no cp.async wait and no CTA barrier; the same bits as direct4. With
    # two K groups ptxas spills 48 bytes at the 128-register cap (one K group: 208, none).
    "direct4-nobarrier": {
        "direct": True,
        "edits": (
            "direct-nostage-prologue", "direct-nostage-loop", "direct-nostage-issue",
            "direct-nostage-index", "direct-nostage-base", "direct-x-global",
            "direct-scales-global", "direct-x-helper",
        ),
    },  # fmt: skip
    # A K split's merge with its loads batched (the same bits; tried in session 41).
    "batchedmerge": {"edits": ("batchedmerge",)},
    # The vector merge (tensor_qmm.VECTOR_MERGE; session 48): 4 outputs of a row a
    # thread, every split's 16-byte load in flight (2 round trips to L2 at 16 rows with
    # two K groups, where the merge before makes one per 256 outputs: 8), then each
    # output summed in split order (the same bits). On the H200 in session 48 (16
    # rows): 4-10 % faster on the four 4-bit Glimmer projections (the LM head even),
    # 2-13 % on the six bf16 ones.
    "vecmerge": {"edits": ("vecmerge",)},
    # The scaled 4-bit form decoding each nibble as a subnormal (session 48):
    # q at the mantissa's top bits with a zero exponent is q 2^-130 in bfloat16 (q 2^-18
    # in float16), exactly, and the group's scale, its exponent raised by 130 (18), is
    # s 2^130; fma(q 2^-130, s 2^130, b) rounds q s + b once, as the shipped form's
    # (128 + q) - 128 then fma(q, s, b) does. One fma a pair instead of two (a shift
    # more on the first nibble): 12 instructions a weight word instead of 15. Exact only
    # while every scale is a normal number below 0.25 (the random benchmark weights'
    # are ~0.005): the same bits as current there (the same-bits column checks that the
    # device keeps subnormal operands). 4-bit only: its scale edit also reaches the
    # 8-bit forms, whose results are then wrong. On the H200 (session 48): the shipped
    # bits on every Glimmer shape, 4-6 % faster with one row, 3-5 % with 16. The same
    # kernel body as tensor_qmm.DENORMAL_SPECS (DFLASH_QMM_DENORMAL_Q4), built after;
    # the default since session 51, so "current" takes it too unless the switch is 0.
    "denorm4": {"edits": ("denorm-helpers", "denorm-q4", "denorm-scale")},
    # The denormal decode with its nibble pairs in place (tensor_qmm.DENORMAL_IN_PLACE;
    # session 51): in bfloat16 a pair left where it lies is q 2^-133 or q 2^-129, so a
    # weight word's four pairs are 4 masks and one shift, against 4 and 4, with the
    # group's scale raised twice. Bound where every scale is below 2^-5 (the benchmark
    # weights' are ~0.005); the same bits. The default since session 52 (on an H100,
    # 0.6-2.5 % less device time a call than "shifted"), so "current" takes it too.
    "denorm04": {"in_place": True},
    # The denormal decode with every pair shifted down (the default of session 51).
    "shifted": {"in_place": False},
    # The paired stage (tensor_qmm.PAIRED_STAGE; sessions 49-50; 4-bit forms): each
    # thread rewrites the x pieces of rows r and r + 8 (and, with a constant group of
    # 64 or 128, the scales and biases) it copied into the mma's operand order, before
    # the chunk's barrier, so the chunk loop needs no permutes. Same bits. With the
    # denormal decode on (the default since session 51), "current" and this both
    # take the denormal forms.
    "paired": {"paired": True},
    # The lean issue (tensor_qmm.LEAN_ISSUE; session 49): each weight row's source
    # worked out once, 32-bit shared addresses, one aligned-copy branch a chunk, the
    # ring's slots as counters (session 48's profile: ~9 instructions a 16-byte copy).
    # Same bits.
    "lean": {"lean": True},
    "paired-lean": {"paired": True, "lean": True},
    # Session 70: the 8-bit forms' pairs made exact without float32 (same bits; the
    # default since session 71, so "current" takes it too), and the float32 decode.
    "leanbytes": {"lean_bytes": True},
    "floatbytes": {"lean_bytes": False},
    # Session 53: the scales and biases a unit of chunks a copy (UNIT_SCALES; same bits).
    # (With the other two scale-layout switches named: see "cmajor" below.)
    "unit": {"unit": True, "cmajor": False, "interleaved": False},
    # The merge before session 43: each split's load waited for by its add (same bits).
    "mergeloop": {"edits": ("mergeloop",)},
    # Diagnostics of the epilogue (results wrong): no merge; no merge and no fences.
    "nolast": {"edits": ("nolast",)},
    "nolast-nofence": {"edits": ("nolast", "nofence")},
    # Session 42: a K split summed inside a thread-block cluster (tensor_qmm.CLUSTER_SUM;
    # the same bits), or by the last CTA as before; with the wave rule's fixed cost
    # lowered, as a cheaper epilogue may ask. Each needs mlx's CUDA graphs off
    # (MLX_USE_CUDA_GRAPHS=0), else the form is refused and the rows are the merge's;
    # tilemajor: the merge with a column tile's splits as consecutive CTAs.
    "cluster": {"cluster": True},
    "nocluster": {"cluster": False},
    "cluster-overhead2": {"cluster": True, "overhead": 2},
    "cluster-overhead3": {"cluster": True, "overhead": 3},
    "tilemajor": {"edits": ("tilemajor",)},
    # L2 prefetch hints on the 16-byte copies (weights and x rows): the L2 fetches the
    # 128 or 256 bytes around each access, so a column's next chunk may already be there.
    "prefetch128": {"edits": ("prefetch128",)},
    "prefetch256": {"edits": ("prefetch256",)},
    # Diagnostics, not forms (their results are wrong): the copies alone (no arithmetic
    # after each chunk's wait and barrier), and the arithmetic alone (no copies after the
    # pipeline's first stages). Against "current" they say which side paces the call.
    "memonly": {"edits": ("memonly",)},
    "memonly-prefetch256": {"edits": ("memonly", "prefetch256")},
    "computeonly": {"edits": ("computeonly",)},
    # Each CTA's chunk read as one contiguous 16 KB block (the bytes of a weight repacked
    # tile by tile): the time a repacked layout would take (results wrong here).
    "contig": {"edits": ("contig",)},
    "memonly-contig": {"edits": ("memonly", "contig")},
    # The copies of the weights, scales and biases alone: no x rows copied either.
    "memonly-nox": {"edits": ("memonly", "nox")},
    # Session 53: what the scales' and biases' copies cost (wrong results, time only).
    "noscales": {"edits": ("noscales", "nobiases")},
    "memonly-noscales": {"edits": ("memonly", "noscales", "nobiases")},
    "memonly-nox-noscales": {"edits": ("memonly", "nox", "noscales", "nobiases")},
    # Session 54: the scales' and biases' copies as a chunk-major repack would lie
    # (the addresses only: wrong results), the form that reads such a repack
    # (CHUNK_MAJOR_SCALES, the default since; same bits) and the one before it.
    "contigscales": {"edits": ("contigscales",)},
    # Each scale-layout variant names all three layout switches, so that it means one
    # layout whatever DFLASH_QMM_* the process was started with (session 55).
    "cmajor": {"cmajor": True, "unit": False, "interleaved": False},
    "rowmajor": {"cmajor": False, "unit": False, "interleaved": False},
    # A chunk's scales and biases of a column side by side: one copy (INTERLEAVED_SCALES,
    # groups of 64 and 128; same bits).
    "interleaved": {"interleaved": True, "cmajor": True, "unit": False},
    # Session 56: calls of more items than resident CTAs on that many CTAs, each
    # taking items in turn, the next item's copies in flight during an item's
    # epilogue (tensor_qmm.PERSISTENT; same bits). Only multi-wave calls change:
    # the fused gate / up measured 13-15 % slower, the LM head within 1 %.
    "persistent": {"persistent": True},
    # The scaled-weight form (``tensor_qmm.SCALED_B``): s * q + b in x's dtype before
    # the mma, no sums of x, no per-group float32 step; the default since session 26
    # (with its launch bounds), "unscaled" the form before it.
    "scaled": {"scaled": True},
    "unscaled": {"scaled": False},
    "scaled-computeonly": {"scaled": True, "edits": ("computeonly",)},
    "folded-computeonly": {"folded": True, "edits": ("computeonly",)},
    # __launch_bounds__(256, N) on the kernel (its header redefines __global__): ptxas
    # then keeps registers within N CTAs an SM (the scaled form took 142: one CTA). Run
    # in session 26 before the scaled form carried its own bounds (two CTAs).
    "lb2": {"edits": ("bounds2",)},
    "scaled-lb2": {"scaled": True, "edits": ("bounds2",)},
    # Session 28: the scaled form's one-lop3 pairs against session 26's two, and its
    # group size as a launch parameter against a compile-time constant; both: the
    # scaled form as session 26 ran it (the same code; its helpers also carry the
    # unused one-lop3 helper).
    "twolop": {"edits": ("twolop",)},
    "groupparam": {"constant_group": False},
    "scaled-s26": {"constant_group": False, "edits": ("twolop",)},
    "budget70k-lb3": {
        "budget": 70 * 1024,
        "waves": True,
        "resident": 396,
        "edits": ("bounds3",),
    },
    "scaled-budget70k-lb3": {
        "scaled": True,
        "budget": 70 * 1024,
        "waves": True,
        "resident": 396,
        "edits": ("bounds3",),
    },
}


def _bounds(blocks: int) -> tuple[str, str, str]:
    """An edit of the helpers that puts ``__launch_bounds__(256, blocks)`` on the kernel
    (mlx writes ``__global__ void name(``; the header comes first)."""
    first = "// m16n8k16 mma, float32 accumulate"
    return ("helpers", first, tensor_qmm.launch_bounds(256, blocks) + first)


# A K split's merge as shipped (session 43: every split's load of an output in flight,
# then added in split order), the loop before it (each split's load waited for by its
# add) and session 41's try: the loads of 8 outputs a thread in flight per split. Same
# bits; on the H200 (session 42, 16 rows) o_proj took 16.5 us shipped, 18.1 with the
# loop and 20.9 batched.
# The merge the forms carry (tensor_qmm.VECTOR_MERGE picks it at import).
_MERGE = (
    tensor_qmm._MERGE_BLOCK if tensor_qmm.VECTOR_MERGE else tensor_qmm._SCALAR_MERGE
)
_MERGE_LOOP = """      for (int p = int(lid); p < n_rows * COLUMNS; p += THREADS) {
        const int n = col0 + p % COLUMNS;
        if (n < n_cols) {
          const size_t e = size_t(p / COLUMNS) * size_t(n_cols) + size_t(n);
          float sum = __ldcg(partial + e);
          for (int k = 1; k < splits; ++k) {
            sum = __fadd_rn(sum, __ldcg(partial + size_t(k) * total + e));
          }
          y[out_base + size_t(p / COLUMNS) * out_width + (n - out_lo)] = T(sum);
        }
      }
"""
_MERGE_BATCHED = """      constexpr int EACH = XROWS * COLUMNS / THREADS;
      constexpr int BATCH = EACH < 8 ? EACH : 8;
      for (int j0 = 0; j0 < EACH; j0 += BATCH) {
        float sums[BATCH] = {};
        for (int k = 0; k < splits; ++k) {
          #pragma unroll
          for (int j = 0; j < BATCH; ++j) {
            const int p = int(lid) + (j0 + j) * THREADS;
            const int n = col0 + p % COLUMNS;
            if (p < n_rows * COLUMNS && n < n_cols) {
              const float part = __ldcg(partial + size_t(k) * total +
                                        size_t(p / COLUMNS) * size_t(n_cols) + size_t(n));
              sums[j] = k == 0 ? part : __fadd_rn(sums[j], part);
            }
          }
        }
        #pragma unroll
        for (int j = 0; j < BATCH; ++j) {
          const int p = int(lid) + (j0 + j) * THREADS;
          const int n = col0 + p % COLUMNS;
          if (p < n_rows * COLUMNS && n < n_cols) {
            const float sum = sums[j];
            y[out_base + size_t(p / COLUMNS) * out_width + (n - out_lo)] = T(sum);
          }
        }
      }
"""

# The scaled helpers' last function (the denormal decode's helpers follow it).
_SCALED_TAIL = tensor_qmm._SCALED_HELPERS[
    tensor_qmm._SCALED_HELPERS.index(
        "DFL_FN uint32_t dfl_scaled(uint32_t q, uint32_t s, uint32_t b, const __half*)"
    ) :
]

# Text edits of the kernels by name: (``"helpers"`` or ``"body"``, old, new).
EDITS = {
    "bounds2": _bounds(2),
    "bounds3": _bounds(3),
    "prefetch128": (
        "helpers",
        'asm volatile("cp.async.cg.shared.global [%0], [%1], 16;',
        'asm volatile("cp.async.cg.shared.global.L2::128B [%0], [%1], 16;',
    ),
    "prefetch256": (
        "helpers",
        'asm volatile("cp.async.cg.shared.global [%0], [%1], 16;',
        'asm volatile("cp.async.cg.shared.global.L2::256B [%0], [%1], 16;',
    ),
    # The launch alone: every CTA returns at once (rows are never above 32).
    "empty": (
        "body",
        "  const int n_rows = params[0];\n",
        "  const int n_rows = params[0];\n  if (n_rows <= 32) return;\n",
    ),
    # No stores, split partials or merge after the chunks.
    "noepilogue": (
        "body",
        "  // c0, c1: row gid",
        "  if (n_rows <= 32) return;\n  // c0, c1: row gid",
    ),
    "batchedmerge": ("body", _MERGE, _MERGE_BATCHED),
    "vecmerge": ("body", _MERGE, tensor_qmm._MERGE_BLOCK),
    "denorm-helpers": (
        "scaled_helpers",
        _SCALED_TAIL,
        _SCALED_TAIL + tensor_qmm._DENORMAL_HELPERS,
    ),
    "denorm-q4": ("scaled_q4", "dfl_q4_lop3", "dfl_q4_denorm"),
    "denorm-scale": ("open_scaled", *tensor_qmm._DENORMAL_SCALE),
    "mergeloop": ("body", _MERGE, _MERGE_LOOP),
    # The epilogue taken apart: no CTA counts itself last (no merge), no fences.
    "nolast": (
        "body",
        "atomicAdd(counter, 1) == splits - 1",
        "atomicAdd(counter, 1) == splits",
    ),
    "nofence": ("body", "__threadfence();", "(void)0;"),
    # A column tile's splits as consecutive CTAs (the cluster form's order; same bits).
    "tilemajor": ("body", *tensor_qmm._CLUSTER_EDITS[0]),
    # Rows are never above 32: the arithmetic is skipped, yet still compiled.
    "memonly": (
        "body",
        "    dfl_commit();\n    const unsigned char* base",
        "    dfl_commit();\n    if (n_rows <= 32) continue;\n    const unsigned char* base",
    ),
    "contig": (
        "body",
        "w_chunk + size_t(n) * row_bytes, fast);",
        "w_chunk + (size_t(tile) * chunks * COLUMNS + size_t(c) * (COLUMNS - 1) + cl)"
        " * CW, fast);\n      (void)n;\n      (void)row_bytes;",
    ),
    # No scale / bias copies (each column's 8 bytes a chunk at a 208-byte stride).
    "noscales": (
        "issue_scales",
        "      dfl_copy_small(base + S_OFF",
        "      if (n_rows > 32) dfl_copy_small(base + S_OFF",
    ),
    # Each column's 8 bytes a chunk read where a chunk-major repack ([chunks, N, 4]:
    # a warp's copies 256 contiguous bytes) would hold them: wrong results, the time only.
    "contigscales": (
        "issue_scales",
        "const size_t e = size_t(n) * size_t(groups_k) + size_t(c) * per_chunk;",
        "const size_t e = (size_t(c) * size_t(n_cols) + size_t(n)) * per_chunk;",
    ),
    "nobiases": (
        "issue_scales",
        "      dfl_copy_small(base + B_OFF",
        "      if (n_rows > 32) dfl_copy_small(base + B_OFF",
    ),
    "nox": (
        "body",
        "for (int r = x_first; r < n_rows; r += X_STEP) {",
        "for (int r = x_first; r < n_rows && n_rows > 32; r += X_STEP) {",
    ),
    # The scaled form's 4-bit pairs as session 26 ran them: mask and magic as C++
    # (NVRTC: two LOP3s a pair) instead of one lop3.
    "twolop": ("scaled_q4", "dfl_q4_lop3", "dfl_q4"),
    # The direct form (session 47): its words loaded at use, or through the
    # non-coherent path without L1 allocation (see VARIANTS["direct4-noahead"]).
    "direct-noahead": (
        "direct",
        "    if (c + 1 < c_end) {\n      load_words(c + 1, wq[pp ^ 1]);\n    }\n",
        "    load_words(c, wq[pp]);\n",
    ),
    "direct-noprologue": (
        "direct",
        "  if (c_begin < c_end) {\n    load_words(c_begin, wq[0]);\n  }\n",
        "",
    ),
    # direct4-nobarrier: edits after the direct form's own (``direct_extra``).
    "direct-nostage-prologue": (
        "direct_extra",
        "  for (int i = 0; i < STAGES - 1; ++i) {\n    if (c_begin + i < c_end) {\n"
        "      issue(c_begin + i, i);\n    }\n    dfl_commit();\n  }\n",
        "  issue(-1, 0);  // nothing: x and the scales are read where they are used\n",
    ),
    "direct-nostage-issue": (
        "direct_extra",
        "  auto issue = [&](int c, int buf) {\n",
        "  auto issue = [&](int c, int buf) {\n    if (c < 0) {\n      return;\n    }\n",
    ),
    "direct-nostage-index": ("direct_extra", "    const int i = c - c_begin;\n", ""),
    "direct-nostage-base": (
        "direct_extra",
        "    const unsigned char* base = smem + (i % STAGES) * STAGE_BYTES;\n"
        "    (void)base;\n",
        "",
    ),
    "direct-nostage-loop": (
        "direct_extra",
        "    dfl_wait<STAGES - 2>();\n    DFL_BARRIER();\n"
        "    // The buffer refilled here was read in the previous round (all threads are"
        " past it).\n    if (c + STAGES - 1 < c_end) {\n"
        "      issue(c + STAGES - 1, (i + STAGES - 1) % STAGES);\n    }\n"
        "    dfl_commit();\n",
        "",
    ),
    "direct-x-global": (
        "direct_extra",
        "        const unsigned char* row = base + X_OFF + (16 * mt + gid) * SX + (SUB * sc"
        " + 8 * tig) * 2;\n"
        "        dfl_pairs(*reinterpret_cast<const uint4*>(row), lo[mt]);\n"
        "        dfl_pairs(*reinterpret_cast<const uint4*>(row + 8 * SX), hi[mt]);\n",
        "        const size_t at = size_t(c) * CHUNK + 8 * (16 * (sc >> 2) + 4 * tig + (sc"
        " & 3));\n"
        "        dfl_pairs(dfl_x_piece(x, 16 * mt + gid, n_rows, depth, at, fast), lo[mt]);"
        "\n"
        "        dfl_pairs(dfl_x_piece(x, 16 * mt + gid + 8, n_rows, depth, at, fast),"
        " hi[mt]);\n",
    ),
    "direct-scales-global": (
        "direct_extra",
        "          const uint32_t s = *reinterpret_cast<const unsigned short*>(base + S_OFF"
        " + cl * 16 + 2 * gl);\n"
        "          const uint32_t bias = *reinterpret_cast<const unsigned short*>(base +"
        " B_OFF + cl * 16 + 2 * gl);\n",
        "          const int n_group = col0 + cl < n_cols ? col0 + cl : n_cols - 1;\n"
        "          const size_t g_at = size_t(n_group) * size_t(groups_k) + size_t(c) *"
        " per_chunk + gl;\n"
        "          const uint32_t s = *reinterpret_cast<const unsigned short*>(scales +"
        " g_at);\n"
        "          const uint32_t bias = *reinterpret_cast<const unsigned short*>(biases +"
        " g_at);\n",
    ),
    "direct-x-helper": (
        "direct_helpers",
        "// Word s (0..3) of a lane's 16 bytes;",
        "// x's 16 bytes at element e of row r (zeros past the call's rows).\n"
        "template <typename X>\n"
        "DFL_FN uint4 dfl_x_piece(const X* x, int r, int rows, int depth, size_t e, bool"
        " fast) {\n"
        "  if (r >= rows) {\n    uint4 zeros = {0u, 0u, 0u, 0u};\n    return zeros;\n"
        "  }\n"
        "  return dfl_direct_load(reinterpret_cast<const unsigned char*>(x + size_t(r) *"
        " size_t(depth) + e), fast);\n}\n"
        "// Word s (0..3) of a lane's 16 bytes;",
    ),
    "direct-nc": (
        "direct_helpers",
        "    v = *reinterpret_cast<const uint4*>(p);\n",
        '    asm("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];\\n"\n'
        '        : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));\n',
    ),
    # Dense weights straight from global memory into the fragment registers (session
    # 46, not yet timed): one 16-byte load a lane, sub-chunk and column (the 4 lanes of
    # a column read 64 contiguous bytes), no cp.async copy or shared-memory round trip;
    # x still staged. The same operands in the same order, so the same bits. Affine
    # forms keep their copies (the guards are compile-time constants of each form).
    "wdirect": (
        "body",
        "      dfl_copy16(base + w_shared + W_STEP * i * SW, w_chunk + size_t(n) * "
        "row_bytes, fast);\n",
        "      if ({bits_per_element} != 16) {\n"
        "        dfl_copy16(base + w_shared + W_STEP * i * SW, w_chunk + size_t(n) * "
        "row_bytes, fast);\n      }\n",
    ),
    "wdirect-load": (
        "body",
        "        const unsigned char* col = wsm + (8 * t + gid) * SW;\n"
        "        uint32_t b[4];\n{load_b}",
        """        uint32_t b[4];
        if ({bits_per_element} == 16) {
          const int n_direct = col0 + warp * 32 + 8 * t + gid;
          const unsigned char* source = reinterpret_cast<const unsigned char*>(weight) +
              size_t(n_direct < n_cols ? n_direct : n_cols - 1) * row_bytes +
              size_t(c) * CW + (SUB * sc + 8 * tig) * 2;
          uint4 pieces;
          if (fast) {
            pieces = *reinterpret_cast<const uint4*>(source);
          } else {  // 16-bit loads where some pointer is not 16-byte aligned
            const unsigned short* halves = reinterpret_cast<const unsigned short*>(source);
            unsigned short* into = reinterpret_cast<unsigned short*>(&pieces);
            for (int e = 0; e < 8; ++e) {
              into[e] = halves[e];
            }
          }
          dfl_pairs(pieces, b);
        } else {
          const unsigned char* col = wsm + (8 * t + gid) * SW;
{load_b}
        }""",
    ),
    "computeonly": (
        "body",
        "    if (c + STAGES - 1 < c_end) {\n      issue(",
        "    if (n_rows > 32 && c + STAGES - 1 < c_end) {\n      issue(",
    ),
}
# Muse Glimmer's projections and LM head (the verify forward's and the drafter's: 16
# rows a round each), as verify_kernels names them.
SHAPES = {
    name: (depth, columns)
    for name, depth, columns in GLIMMER.projections
    if name
    in (
        "mlp gate / up",
        "mlp down",
        "q_proj / gate_proj (attn)",
        "o_proj",
        "attn q/k/v/gate fused",
        "mlp gate+up fused",
        "lm_head",
    )
}
# The drafter's own shapes (its MLP and q / o projections are the target's): k / v of 8
# KV heads; q/k/v as one launch, a what-if (the patch fuses only the drafter's MLPs: its
# attention reads two inputs); its context projection fc.
SHAPES.update(
    {
        "drafter k / v": (6656, 1024),
        "drafter q/k/v fused": (6656, 6144),
        "drafter fc": (5 * 6656, 6656),
    }
)


@contextlib.contextmanager
def variant(
    target: Optional[int] = None,
    budget: Optional[int] = None,
    plain_mma: bool = False,
    merged: Optional[bool] = None,
    folded: Optional[bool] = None,
    waves: Optional[bool] = None,
    resident: Optional[int] = None,
    k_groups: Optional[int] = None,
    scaled: Optional[bool] = None,
    constant_group: bool = True,
    max_stages: Optional[int] = None,
    x_stride: Optional[int] = None,
    overhead: Optional[int] = None,
    dense_overhead: Optional[int] = None,
    cluster: Optional[bool] = None,
    direct: Optional[bool] = None,
    paired: Optional[bool] = None,
    lean: Optional[bool] = None,
    in_place: Optional[bool] = None,
    unit: Optional[bool] = None,
    cmajor: Optional[bool] = None,
    interleaved: Optional[bool] = None,
    persistent: Optional[bool] = None,
    lean_bytes: Optional[bool] = None,
    edits: Sequence[str] = (),
) -> Iterator[None]:
    """Rebuild the tensor-core specs with the given knobs, restoring them after.

    Args:
        target: ``TARGET_GROUPS`` (None: unchanged).
        budget: ``SHARED_BUDGET`` in bytes (None: unchanged).
        plain_mma: Drop ``volatile`` from the mma helper's ``asm``.
        merged: ``MERGE_SPLIT_SUM`` (None: unchanged).
        folded: ``FOLD_Q4_OFFSET`` (None: unchanged).
        waves: ``WAVE_SPLIT`` (None: unchanged).
        resident: ``RESIDENT_CTAS`` (None: unchanged).
        k_groups: ``K_GROUPS`` (None: unchanged).
        scaled: ``SCALED_B`` (None: unchanged).
        constant_group: The scaled forms with their group size as a compile-time
            constant (as shipped) or read from the launch's parameters.
        max_stages: ``MAX_STAGES`` (None: unchanged).
        x_stride: Bytes an x row takes in a stage (None: the layout's own).
        overhead: ``CTA_OVERHEAD_CHUNKS``, affine weights' (None: unchanged).
        dense_overhead: ``DENSE_CTA_OVERHEAD_CHUNKS`` (None: unchanged).
        cluster: ``CLUSTER_SUM`` (None: unchanged).
        direct: ``DIRECT_Q4`` (None: unchanged); True also rebuilds the direct forms
            with ``edits`` (an edit their text lacks raises).
        paired: ``PAIRED_STAGE`` (None: unchanged; off where ``edits`` are given,
            as they are written against the shipped texts); the denormal forms are
            rebuilt with it too.
        lean: ``LEAN_ISSUE`` (None: unchanged; off where ``edits`` are given).
        in_place: ``DENORMAL_IN_PLACE`` (None: unchanged): bound where the scales allow.
        unit: ``UNIT_SCALES`` (None: unchanged; off where ``edits`` are given).
        cmajor: ``CHUNK_MAJOR_SCALES`` (None: unchanged; off where ``edits`` are
            given).
        interleaved: ``INTERLEAVED_SCALES`` (None: unchanged; off where ``edits``
            are given).
        persistent: ``PERSISTENT`` (None: unchanged; ``DFLASH_QMM_PERSISTENT``,
            read at each bind, wins where set).
        lean_bytes: ``LEAN_BYTES`` (None: unchanged): the 8-bit forms' byte decode.
        edits: Names of :data:`EDITS` to apply to the kernels' text.
    """
    knobs = {
        "TARGET_GROUPS": target,
        "SHARED_BUDGET": budget,
        "MERGE_SPLIT_SUM": merged,
        "FOLD_Q4_OFFSET": folded,
        "WAVE_SPLIT": waves,
        "RESIDENT_CTAS": resident,
        "K_GROUPS": k_groups,
        "SCALED_B": scaled,
        "MAX_STAGES": max_stages,
        "CTA_OVERHEAD_CHUNKS": overhead,
        "DENSE_CTA_OVERHEAD_CHUNKS": dense_overhead,
        "CLUSTER_SUM": cluster,
        "DIRECT_Q4": direct,
        "PAIRED_STAGE": False if edits and paired is None else paired,
        "LEAN_ISSUE": False if edits and lean is None else lean,
        # Text edits are written against the shifted form's text: where they are given,
        # the in-place forms (not rebuilt) must not bind, or the edit would not run.
        "DENORMAL_IN_PLACE": False if edits and in_place is None else in_place,
        "UNIT_SCALES": False if edits and unit is None else unit,
        "CHUNK_MAJOR_SCALES": False if edits and cmajor is None else cmajor,
        "INTERLEAVED_SCALES": False if edits and interleaved is None else interleaved,
        "PERSISTENT": persistent,
        "LEAN_BYTES": lean_bytes,
    }
    texts = (
        "_HELPERS", "_BODY", "_SCALED_Q4_HELPER", "_DIRECT_HELPERS", "_DIRECT_EDITS",
        "_SCALED_HELPERS", "_OPEN_SCALED", "_ISSUE_SCALES",
    )  # fmt: skip
    saved = {name: getattr(tensor_qmm, name) for name in (*knobs, *texts)}
    tables = {form: dict(specs) for form, specs in tensor_qmm.FORM_SPECS.items()}
    scaled_specs = dict(tensor_qmm.SCALED_SPECS)
    direct_specs = dict(tensor_qmm.DIRECT_SPECS)
    denormal_specs = dict(tensor_qmm.DENORMAL_SPECS)
    in_place_specs = dict(tensor_qmm.IN_PLACE_SPECS)
    swiglu_specs = dict(tensor_qmm.SWIGLU_SCALED_SPECS)
    swiglu_denormal_specs = dict(tensor_qmm.SWIGLU_DENORMAL_SPECS)
    swiglu_in_place_specs = dict(tensor_qmm.SWIGLU_IN_PLACE_SPECS)
    layout_x_stride = tensor_qmm.Layout.x_stride
    try:
        if x_stride is not None:
            tensor_qmm.Layout.x_stride = property(lambda self: x_stride)
        for name, value in knobs.items():
            if value is not None:
                setattr(tensor_qmm, name, value)
        if plain_mma:
            helpers = tensor_qmm._HELPERS.replace(
                'asm volatile(\n      "mma', 'asm(\n      "mma'
            )
            if helpers == tensor_qmm._HELPERS:
                raise RuntimeError("the mma helper's text has changed")
            tensor_qmm._HELPERS = helpers
        for edit in edits:
            _edit(*EDITS[edit])
        _rebuild(constant_group, direct=bool(direct), in_place=not edits)
        yield
    finally:
        tensor_qmm.Layout.x_stride = layout_x_stride
        for name, value in saved.items():
            setattr(tensor_qmm, name, value)
        for form, specs in tables.items():
            tensor_qmm.FORM_SPECS[form].update(specs)
        tensor_qmm.SCALED_SPECS.update(scaled_specs)
        tensor_qmm.DIRECT_SPECS.update(direct_specs)
        tensor_qmm.DENORMAL_SPECS.update(denormal_specs)
        tensor_qmm.IN_PLACE_SPECS.update(in_place_specs)
        tensor_qmm.SWIGLU_SCALED_SPECS.update(swiglu_specs)
        tensor_qmm.SWIGLU_DENORMAL_SPECS.update(swiglu_denormal_specs)
        tensor_qmm.SWIGLU_IN_PLACE_SPECS.update(swiglu_in_place_specs)
        tensor_qmm.launch_plan.cache_clear()
        tensor_qmm._wave_split.cache_clear()


def _edit(part: str, old: str, new: str) -> None:
    if part == "direct_extra":  # one more edit after the direct form's own
        tensor_qmm._DIRECT_EDITS = tensor_qmm._DIRECT_EDITS + ((old, new),)
        return
    if part == "direct":  # the new texts of the direct form's edits
        edits = tensor_qmm._DIRECT_EDITS
        if not any(old in after for _, after in edits):
            raise RuntimeError(f"the direct form's text has changed: {old[:60]!r}")
        tensor_qmm._DIRECT_EDITS = tuple(
            (before, after.replace(old, new)) for before, after in edits
        )
        return
    parts = {
        "helpers": "_HELPERS",
        "body": "_BODY",
        "scaled_q4": "_SCALED_Q4_HELPER",
        "direct_helpers": "_DIRECT_HELPERS",
        "scaled_helpers": "_SCALED_HELPERS",
        "open_scaled": "_OPEN_SCALED",
        "issue_scales": "_ISSUE_SCALES",
    }
    name = parts[part]
    text = getattr(tensor_qmm, name)
    if old not in text:
        raise RuntimeError(f"the kernel's text has changed: {old[:60]!r}")
    setattr(tensor_qmm, name, text.replace(old, new))


def _rebuild(
    constant_group: bool = True, direct: bool = False, in_place: bool = True
) -> None:
    # In place: MATMUL_SPECS and the other names are these very dicts. The pairs-in-place
    # forms are rebuilt unless text edits are given (theirs are written against the
    # shipped texts, which an edit of the scale loads changes).
    if direct:
        for groups, size in tensor_qmm.DIRECT_SPECS:
            tensor_qmm.DIRECT_SPECS[(groups, size)] = tensor_qmm._spec(
                tensor_qmm.Layout(4, 1, direct=True),
                k_groups=groups,
                scaled=True,
                group_size=size,
            )
    for (folded, groups), specs in tensor_qmm.FORM_SPECS.items():
        specs.update(tensor_qmm.form_specs(folded, groups))
    for groups, key, size in tensor_qmm.SCALED_SPECS:
        layout = tensor_qmm.LAYOUTS[key]
        tensor_qmm.SCALED_SPECS[(groups, key, size)] = tensor_qmm._spec(
            layout,
            k_groups=groups,
            scaled=True,
            group_size=size if constant_group else None,
        )
    # The scaled SwiGLU and denormal forms, keyed (K groups, layout key, group size).
    tables = [
        (tensor_qmm.SWIGLU_SCALED_SPECS, {"swiglu": True}),
        (tensor_qmm.DENORMAL_SPECS, {"denormal": True}),
        (tensor_qmm.SWIGLU_DENORMAL_SPECS, {"swiglu": True, "denormal": True}),
    ]
    if in_place:
        tables.append((tensor_qmm.IN_PLACE_SPECS, {"denormal": True, "in_place": True}))
        tables.append(
            (
                tensor_qmm.SWIGLU_IN_PLACE_SPECS,
                {"swiglu": True, "denormal": True, "in_place": True},
            )
        )
    for table, form in tables:
        for groups, key, size in table:
            table[(groups, key, size)] = tensor_qmm._spec(
                tensor_qmm.LAYOUTS[key],
                k_groups=groups,
                scaled=True,
                group_size=size,
                **form,
            )
    tensor_qmm.launch_plan.cache_clear()
    tensor_qmm._wave_split.cache_clear()


def weight_copies(nbytes: int, cold_bytes: int) -> int:
    """How many copies of a projection's weights (``nbytes`` each) span ``cold_bytes``
    (at least one: ``cold_bytes`` 0 times the same weights at every call)."""
    return max(1, -(-cold_bytes // nbytes))


def in_turn(calls: Sequence[Callable[[], mx.array]]) -> Callable[[], mx.array]:
    """A call that runs ``calls`` one after another, round and round."""
    turn = itertools.cycle(calls)
    return lambda: next(turn)()


def run(args: argparse.Namespace) -> dict:
    """Every variant x shape x row count; rows are printed and kept in the result."""
    bits = None if args.dense else args.bits
    group_size = None if args.dense else 64
    result = {
        "meta": per_call_meta(args, bits=bits, group_size=group_size),
        "rows": [],
    }
    for shape in args.shapes:
        depth, columns = SHAPES[shape]
        first = _weights(GLIMMER, depth, columns, bits)
        nbytes = first[3]
        sets: List[tuple] = [first[:3]] + [
            _weights(GLIMMER, depth, columns, bits)[:3]
            for _ in range(weight_copies(nbytes, args.cold_bytes) - 1)
        ]
        bound_us = 1e6 * nbytes / args.bandwidth
        for rows in args.rows:
            x = mx.random.normal((rows, depth)).astype(mx.bfloat16)
            mx.eval(x)
            shipped = None  # "current"'s output, for the same-bits column
            theirs = [partial(mlx_matmul, x, *weights, bits) for weights in sets]
            expected = theirs[0]().astype(mx.float32)
            timed = device_time(in_turn(theirs), args.reps)
            _add(result, shape, rows, "mlx", timed, bound_us, 0.0, copies=len(sets))
            for name in args.variants:
                try:
                    with variant(**VARIANTS[name]):
                        # Bound once per copy, as a patched layer runs it.
                        ours = [
                            partial(
                                bind_matmul(
                                    x.shape, x.dtype, *weights, bits=bits,
                                    group_size=group_size, use_kernel=True,
                                ),
                                x,
                            )
                            for weights in sets
                        ]  # fmt: skip
                        native = ours[0]()
                        got = native.astype(mx.float32)
                        diff = float(mx.abs(got - expected).max())
                        same = same_bits(native, shipped)
                        shipped = native if name == "current" else shipped
                        timed = device_time(in_turn(ours), args.reps)
                except Exception as error:  # a variant the device refuses: go on
                    print(json.dumps({"variant": name, "error": str(error)[:300]}))
                    result.setdefault("errors", []).append([shape, rows, name])
                    continue
                _add(result, shape, rows, name, timed, bound_us, diff, same, len(sets))
                write_json(args.json, result)
    return result


def mlx_matmul(
    x: mx.array,
    weight: mx.array,
    scales: Optional[mx.array],
    biases: Optional[mx.array],
    bits: Optional[int],
) -> mx.array:
    """mlx's own ``x @ W.T``: ``quantized_matmul`` (groups of 64) or, dense, ``matmul``.

    Shapes:
        x: ``(M, K)``; weight: ``(N, K)`` dense or packed; result ``(M, N)``.
    """
    if bits is None:
        return x @ weight.T
    return mx.quantized_matmul(
        x, weight, scales, biases, transpose=True, group_size=64, bits=bits
    )


def same_bits(ours: mx.array, shipped: Optional[mx.array]) -> Optional[bool]:
    """Whether a variant's output has the shipped form's bits (None: no "current" row
    ran before it for this shape and row count)."""
    if shipped is None:
        return None
    return bool(mx.array_equal(ours, shipped).item())


def _add(result, shape, rows, name, timed, bound_us, diff, same=None, copies=1) -> None:
    row = {
        "projection": shape,
        "rows": rows,
        "variant": name,
        "device_us": round(timed["device_us"], 2),
        "kernels_per_call": timed["kernels_per_call"],
        "over_bound": round(timed["device_us"] / bound_us, 2),
        "bound_us": round(bound_us, 2),
        "max_abs_diff_vs_mlx": diff,
        "same_bits_as_current": same,
        "weight_copies": copies,
    }
    result["rows"].append(row)
    print(json.dumps(row), flush=True)


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.matmul_variants")
    parser.add_argument("--json", help="write results here (after every variant)")
    parser.add_argument("--reps", type=int, default=20, help="timed calls per row")
    parser.add_argument("--bits", type=int, choices=(4, 8), default=4)
    parser.add_argument(
        "--dense",
        action="store_true",
        help="dense bf16 weights (the bf16 target's and the drafter's) instead of --bits",
    )
    add_bandwidth_argument(parser)
    parser.add_argument(
        "--cold-bytes",
        type=int,
        default=0,
        help="time calls in turn over copies of the weights spanning this many bytes "
        "(e.g. 268435456: past the L2, as in a round); 0: the same weights every call",
    )
    parser.add_argument(
        "--rows",
        type=lambda text: [int(t) for t in text.split(",")],
        default=[1, 16],
        help="row counts (comma list, 1..32)",
    )
    parser.add_argument(
        "--variants",
        type=lambda text: text.split(","),
        default=list(VARIANTS),
        help=f"comma list of: {', '.join(VARIANTS)}",
    )
    parser.add_argument(
        "--shapes",
        type=lambda text: text.split(";"),
        default=list(SHAPES),
        help=f"semicolon list of: {'; '.join(SHAPES)}",
    )
    args = parser.parse_args(argv)
    unknown = [name for name in args.variants if name not in VARIANTS]
    unknown += [name for name in args.shapes if name not in SHAPES]
    if unknown:
        parser.error(f"unknown variant or shape: {', '.join(unknown)}")
    if args.reps < 1 or any(not 1 <= rows <= 32 for rows in args.rows):
        parser.error("--reps must be >= 1 and --rows within 1..32")
    if args.cold_bytes < 0:
        parser.error("--cold-bytes must be >= 0")
    return args


def main(argv: Optional[Sequence[str]] = None) -> int:
    return run_on_cuda("matmul_variants", parse_args(argv), run)


if __name__ == "__main__":
    sys.exit(main())
