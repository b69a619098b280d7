"""CUDA tensor-core form of the small-row matmul ``y = x @ W.T`` (1 to 32 rows).

The scalar kernel of :mod:`dflash.metal.qmm` spends 16 float32 multiply-adds per
weight on CUDA cores: about 1 TFLOP for a 16-row verify of a 52-layer model. This
form feeds the products to the tensor cores (``mma.sync.m16n8k16``, bfloat16 or
float16 inputs, float32 accumulation, inline PTX) and is used on CUDA for
bfloat16 / float16 rows; everything else keeps the scalar kernel.

**Served** (:func:`tensor_core_serves`): x bfloat16 or float16, 1 to 32 rows; 4- or
8-bit affine weights (groups of 32, 64 or 128, scales and biases in x's dtype)
with ``K % 256 == 0``, or dense weights in x's dtype with ``K % 64 == 0``; any
``N``. Muse Glimmer's K (4,096, 6,656, 19,968) are all multiples of 256.

**Arithmetic.** The quantized integers ``q`` (0..15, 0..255) are exact in both
half types, so per group the mma computes ``dot = sum x * q`` and, with a ones
operand, ``xsum = sum x`` (float32 accumulation); then, in float32 and in a
fixed order, ``acc = fma(scale, dot, fma(bias, xsum, acc))``. Dense weights go
straight to the mma, the 64-element partial sums added into ``acc``. The output
is rounded to x's dtype once. This is not bit-equal to the reference (which
dequantizes ``W`` to float32 and sums element by element) nor to the scalar
kernel: the tensor cores add 16 products at a time with their own alignment and
rounding; the results agree within the tolerance of ``tests/test_verify_kernels``.

**Fragments** (PTX m16n8k16 ``.row.col``; lane = 4 gid + tig). A 32-element
sub-chunk of K is two mma steps. Lane ``tig`` holds the 8 consecutive elements
``8 tig .. 8 tig + 7`` of the sub-chunk (one 32-bit word of 4-bit weights, two of
8-bit, sixteen bytes of dense or of x) and pairs them as registers
``r_p = (e_p, e_{p+4})``, ``p = 0..3`` (low half first). Step 0 uses ``r_0, r_1``
as ``b0, b1`` (and the same pairs of x rows ``gid`` / ``gid + 8`` as ``a0..a3``),
step 1 uses ``r_2, r_3``. So logical k ``2 tig + h`` of step ``s`` is physical
element ``8 tig + 2 s + 4 h`` and logical ``2 tig + 8 + h`` is ``8 tig + 2 s + 1 + 4 h``
(:func:`physical_k`). The dot product's order of terms is free as long as A and
B agree, and both come from the same map. A sub-chunk never straddles a group
(groups are multiples of 32), so every mma step is within one group.

**Batch invariance.** Rows are padded to 16-row m-tiles with zeros (32 rows: two
m-tiles, the same per-tile sequence); a row's output depends only on its own A
rows (each mma output element is its own dot product). The K split (chunks per
CTA), the order of chunks, sub-chunks and groups, and the fixed-order sum of the
split partials are functions of ``K`` and ``N`` only. The one atomic (a counter per
column tile) only elects which CTA does that sum, never its order. So each row gets
the same bits alone as in any batch, in any slot.

**Tiling.** A warp group of 4 warps (128 threads) covers 128 columns (32 per warp:
four n8 tiles) and every row, over a contiguous range of 256-element chunks of K
(64 for dense); a CTA holds :data:`K_GROUPS` such groups, each taking its half of
every chunk's sub-chunks, the second group's sums added to the first's once at the
end. Each chunk's weights (128 bytes per column at 4 bits and dense,
256 at 8), x rows, scales and biases are copied to shared memory with 16-byte
``cp.async`` (one 4-, 8- or 16-byte copy per column for its scales, as many for
its biases; the scaled 4-bit forms read them from a chunk-major copy made at the bind,
:data:`CHUNK_MAJOR_SCALES`), coalesced (8 lanes per 128-byte column run),
through a ring of 2 to 4 stages (:class:`Layout`; the 16-row forms take 95 to
110 KB, two CTAs per SM); lanes then read their words conflict-free (padded
strides). Each thread copies the same 16-byte piece of its columns and x rows every
chunk, so its sources are worked out once; x rows past the call's are zeroed once
per stage and never copied (a 1-row call copies one row). Each weight byte is read
from HBM once per call for all rows; x is re-read from L2 per column tile (half the
weight bytes at 4 bits). K is split over CTAs where that makes the call finish
sooner: two CTAs fit an SM, so an H200 runs :data:`RESIDENT_CTAS` at once, and the
split is the one with the fewest waves times chunks per CTA (:func:`split_plan`;
before session 17, K was split until the CTAs reached :data:`TARGET_GROUPS`, which
often spilled a few CTAs into a second wave). The last CTA of each column tile to
finish sums the float32 partials in split order (:func:`merge_split_sum`; else a
second small launch does). ptxas: 96 / 114 / 88 registers (4-bit / 8-bit / dense,
16 rows), no spills.

**Cost model** (4-bit, group 64, 16 rows): per warp and 32-element sub-chunk
(512 weight bytes) about 110 issued instructions: 10 mma, 44 for dequantizing,
10 for the x fragments, ~40 for the scale-and-bias step every other sub-chunk.
On an H200 (132 SMs x 4 schedulers, ~1.98 GHz) that is ~14 us of issue for
gate/up (66 MB of weights), about the HBM time of the same bytes: issue and
memory are balanced, so the 1.6x-bound target is plausible, not certain; a
measurement decides (the group step is the first thing to trim).

**Measured** (H200, device time). Session 8 (``docs/benchmarks/h200-2026-12-01-s8``):
4-bit, 16 rows: gate/up 117.5 us (7.5x the bound; mlx 115.0), down 113.5 us (mlx
266.5), q 39.4 (mlx 80.7); bf16 dense 3x the bound where mlx's cuBLAS is at 1.3x.
Nsight Compute then showed the form issue-bound, not memory-bound: 58 warp
instructions per 128 weight bytes, half of them in the copy loops' index
arithmetic. With the copy path above (``docs/benchmarks/h200-2026-12-01-s12``):
30.4M -> 22.3M instructions for gate/up; gate/up 108.7 -> 70.6 us with 16 rows and
66.1 with 1 (mlx 114.0 / 74.5), down 108.9 -> 71.3 and 66.1 (mlx 265.5 / 86.2).
Still 4.2-4.6x the bound. The split sum merged into the matmul launch (session 13,
``docs/benchmarks/h200-2026-12-01-s13``): 156 fewer launches a plain token; device
time per call 2-16 % lower on 7 of 8 projection shapes, 6 % higher on q_proj with one
row; see ``docs/verify-kernels-analysis.md``. The wave-aware split (session 17,
``docs/benchmarks/h200-2026-12-02-s17``): down 79.2 -> 60.4 us with 16 rows and
65.3 -> 51.5 with 1, gate 75.0 -> 69.4 and 64.6 -> 56.9, o 28.0 -> 26.9 and
19.3 -> 18.1, q 20.98 -> 17.8 with 1 row but 27.6 -> 30.3 with 16. The folded offset
(:data:`FOLD_Q4_OFFSET`, off): 1-2 % less on every shape. Two K groups (session 18,
``docs/benchmarks/h200-2026-12-02-s18``): 10-20 % less with 16 rows on all six
Glimmer shapes (q 30.3 -> 24.2 us, down 60.3 -> 54.5), 0.7-6 % with 1 row.
Session 25 (``docs/benchmarks/h200-2026-12-02-s25``): a tile-contiguous layout and L2
prefetch hints change nothing; copies alone cost 2.0-2.3x the bound, arithmetic alone
~3x. The scaled-weight form with launch bounds (session 26,
``docs/benchmarks/h200-2026-12-03-s26``), 4-bit, 16 rows: gate/up 113.2 -> 107.3 us
(3.4x the bound), down 50.7 -> 47.7, q/k/v/gate 32.0 -> 30.5, o 20.3 -> 19.5; 32 rows
16-24 % less; 8-bit 0.4-2.7 % less (same run). One lop3 a 4-bit pair and the group size
a constant of each scaled kernel (session 28, ``docs/benchmarks/h200-2026-12-03-s28``):
8-13 % less again, gate/up 107.9 -> 98.3 us with 16 rows (3.16x the bound) and
91.3 -> 80.3 with 1; 8-bit 1.5-7.5 % less (same run). Session 41
(``docs/benchmarks/h200-2026-12-04-s41``): a one-wave launch spends ~11 us outside its
arithmetic and copies (the epilogue 6-7 us at 16 rows); with a CTA's fixed cost priced
as 4 chunks (:func:`cta_overhead_chunks`) the fused gate/up takes 2 K splits, not 3:
98.1 -> 85.9 us with 16 rows (2.76x the bound), 80.6 -> 73.6 with 1. Session 42
(``docs/benchmarks/h200-2026-12-04-s42``): the split summed inside a thread-block
cluster (:func:`cluster_spec`, the same bits) takes o_proj 18.0 -> 13.4 us with 16
rows, but mlx's CUDA graphs lose its cluster shape, so it was off until session 64
(``docs/benchmarks/h100-2026-12-06-s64``: the 4-bit verify forward 11.23 -> 10.60 ms of
device time on an H100), and is now on where launches are known to be direct
(:data:`CLUSTER_SUM`).
Dense weights price a CTA at 8 chunks since session 46, from session 44's per-call
times (``docs/benchmarks/h200-2026-12-04-s44``): the bf16 fused q/k/v/gate 44.9 -> 38.7
us with 16 rows, every other bf16 shape of the target and drafter even.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import re
import weakref
from dataclasses import dataclass
from typing import Callable, Optional, Sequence, Tuple

import mlx.core as mx

from . import backend, groups
from .groups import GroupKernelSpec, int_params
from .layout import contiguous_view
from .prefetch import Prefetch, with_prefetch
from .sources import CUDA

THREADS = 128
WARPS = THREADS // 32
COLUMNS_PER_WARP = 32
COLUMNS = WARPS * COLUMNS_PER_WARP
SUB = 32
MAX_ROWS = 32
DTYPES = (mx.bfloat16, mx.float16)
# Affine group sizes served (also ``qmm.GROUP_SIZES``); one scaled kernel each.
GROUP_SIZES = (32, 64, 128)
# CTAs a launch aims for before K is split (an H200 has 132 SMs; two CTAs fit each).
TARGET_GROUPS = 264
# The wave-aware K split: CTAs resident at once (two an SM on an H200: each form takes
# 82 to 110 KB of shared memory), and a CTA's fixed cost (pipeline fill, partial
# writes and their merge) in chunks. On since the H200 measured it (session 17: 7 of 8
# projection calls faster, Glimmer's down projection by a quarter);
# ``DFLASH_QMM_WAVE_SPLIT=0`` keeps the TARGET_GROUPS rule. Read at each bind. For
# affine weights the fixed cost is 4 chunks since session 41: an H200 launch's
# epilogue (partials, their merge) measured ~6 us, ~2.5 chunks of a 16-row call,
# beside the fill; of Glimmer's shapes only the fused gate / up changes (3 splits to
# 2: 98.1 -> 85.9 us with 16 rows, 80.6 -> 73.6 with 1 at 4 bits; 151.6 -> 137.6 and
# 131.6 -> 122.0 at 8). Dense weights count 8 since session 46: session 44 timed
# every bf16 Glimmer and drafter shape with 8 against 2 (same run) and only the fused
# q/k/v/gate moved (68 x 7 CTAs to 68 x 3, one wave: 44.9 -> 38.7 us with 16 rows,
# 37.2 -> 34.7 with 1); the gate / up's new plan (5 splits to 4) was even. Only an
# unfused gate or up (fusion off) takes a plan not timed (5 splits to 3).
RESIDENT_CTAS = 264
CTA_OVERHEAD_CHUNKS = 4
DENSE_CTA_OVERHEAD_CHUNKS = 8
WAVE_SPLIT = True
WAVE_SPLIT_ENV = "DFLASH_QMM_WAVE_SPLIT"
SHARED_BUDGET = 113 * 1024
# The deepest stage ring a form takes (benchmarks.matmul_variants varies it).
MAX_STAGES = 4
REDUCE_THREADS = 256
# A K split's partials summed inside a thread-block cluster (session 42): a column
# tile's splits run as one cluster (rank = split), each CTA leaves its float32 partial
# in its own shared memory, and after a cluster barrier every CTA sums its share of
# the tile's outputs over the ranks' partials in split order through distributed
# shared memory: the merge's order and bits, without the global partials, the fence,
# the counter or one CTA's serial sum. Splits of 2 to MAX_CLUSTER on devices with
# clusters (compute capability 9.0 on); other calls keep the merge. MAX_CLUSTER is 4,
# as measured on the H200 (16 rows, graphs off): o_proj 18.0 -> 13.4 us (4 splits),
# q/k/v/gate 27.2 -> 23.3 (3), gate / up 85.7 -> 80.5 (2), but down 42.4 -> 59.3 (5;
# probably clusters of 5 leave CTA slots of a GPC idle). Never while mlx records CUDA
# graphs: mlx 0.32.4 updates a cached graph's kernel node to a new kernel without its
# compile-time cluster shape (its own check covers captured child graphs only), and
# the H200 then ran cluster kernels, and kernels after them, wrongly (session 42).
# With ``MLX_USE_CUDA_GRAPHS=0`` every launch is direct and keeps the shape. On by
# default since session 64, where direct launches are known
# (:func:`dflash.launch_mode.direct_launches_known`: the variable off before anything
# was evaluated, as the dflash commands set it): on an H100 the 4-bit 16-token verify
# forward took 10.60 ms of device time against 11.23 (its matmuls 7.84 against 8.48
# ms), bf16 23.15 against 23.75, the loop lossless and the cluster bits equal to the
# merge's. ``DFLASH_QMM_CLUSTER_SUM`` (on/off) decides when set (on: wherever the
# variable is off now); read at each bind.
CLUSTER_SUM = True
CLUSTER_SUM_ENV = "DFLASH_QMM_CLUSTER_SUM"
MAX_CLUSTER = 4
# Sum a K split's partials in the matmul launch (its last CTA per column tile) rather
# than in a second launch: the same bits, half the launches of a split call. On since
# the H200 ran it (session 13); ``DFLASH_MERGED_SPLIT_SUM=0`` keeps the reduce launch.
MERGE_SPLIT_SUM = True
# Which merge a K split's last CTA runs (see ``_MERGE_BLOCK``): the vector merge, on
# since session 49 ran the `cuda` tests with it (an H100: 238 passed; the 15 failures
# were the test fixture of the denormal decode, then opt-in; see
# docs/benchmarks/h100-2026-12-05-s49).
# ``DFLASH_QMM_VECTOR_MERGE=0`` / ``=1`` picks one for the process (read at import:
# the forms' texts are built then).
VECTOR_MERGE_DEFAULT = True
VECTOR_MERGE_ENV = "DFLASH_QMM_VECTOR_MERGE"
MERGED_SPLIT_SUM_ENV = "DFLASH_MERGED_SPLIT_SUM"
# 4-bit bfloat16: feed the mma ``128 + q`` (the bits the magic-number load makes) and fold
# the offset into the group's bias (``bias - 128 * scale``), dropping a pair fma per two
# weights. Float16 keeps ``q`` (its offset, 1024, would cost too much float32 headroom).
# ``DFLASH_QMM_FOLDED_OFFSET`` (on/off) decides when set; read at each bind.
FOLD_Q4_OFFSET = False
FOLDED_OFFSET_ENV = "DFLASH_QMM_FOLDED_OFFSET"
# Scaled weights (the Marlin order): each pair of integers becomes ``s * q + b`` in x's
# dtype (one rounding) before the mma, which then sums straight into the float32
# accumulators; no sums of x, no per-group float32 step, a third fewer accumulator
# registers. Other bits than the unscaled form (the weights are rounded to x's dtype,
# as mlx's ``dequantize`` does), within the same tolerance of that rounding. Its
# kernels carry ``__launch_bounds__`` (two CTAs an SM, :data:`LAUNCH_BOUNDS`): without
# them NVRTC gave the 4-bit form 142 registers, one CTA an SM, and it was 12-23 %
# slower; with them it is 4-7 % faster than the unscaled form with 1 and 16 rows and
# 16-24 % with 32 on all four Glimmer projections, 8-bit 0.4-2.7 % (H200, session 26).
# On for the bit widths in :data:`SCALED_B_BITS`; ``DFLASH_QMM_SCALED_B`` (on/off) decides when set;
# read at each bind.
SCALED_B = True
SCALED_B_BITS = frozenset({4, 8})
SCALED_B_ENV = "DFLASH_QMM_SCALED_B"
# Warp groups splitting each chunk's sub-chunks (K) within a CTA: 2 runs 256 threads on
# the same shared memory, twice the warps an SM has to hide latency with, and adds the
# second group's sums to the first's once at the end. 2 since the H200 measured it
# (session 18: all 12 Glimmer projection calls of 1 and 16 rows faster, 16 rows by
# 10-20 %); ``DFLASH_QMM_TWO_K_GROUPS=0`` picks the one-group form at bind.
K_GROUPS = 2
TWO_K_GROUPS_ENV = "DFLASH_QMM_TWO_K_GROUPS"
# Sibling projections fused into one launch (q / k / v / gate): each member's columns
# stored as one contiguous block, so its result is a view that mlx-lm's reshape and
# RMS norm take as it is (row-interleaved members cost mlx a copy kernel each).
# ``DFLASH_QMM_MEMBER_MAJOR=0`` keeps the plain layout; read at each bind.
MEMBER_MAJOR = True
MEMBER_MAJOR_ENV = "DFLASH_QMM_MEMBER_MAJOR"
# The direct 4-bit form (session 47; off: measured slower): each lane loads its own
# weight words from global memory straight into registers, a chunk ahead, with no
# cp.async copy or shared-memory round trip for the weights (session 25 had timed the
# copies alone at 2.0-2.3x the bound). On the H200 its cuda tests pass, but with 16 rows
# it took 11-41 % longer than the staged form on every Glimmer shape (the fused gate /
# up 121.4 us against 86.2) and within 5 % with one row: the copies were not what held
# the staged form back. A lane's words are contiguous (16 bytes a column and half
# chunk, the 4 lanes of a column 64 bytes), so sub-chunk ``4 h + s`` takes word
# ``16 h + 4 tig + s`` and x is staged in that order (:func:`direct_word`); each lane's
# 32 elements of a half chunk lie in one group, so it takes its scale once a half
# chunk. Other sums than the staged form (the mma adds other elements together), each
# row's still its own.
# The scaled 4-bit forms only (others keep their staging); ``DFLASH_QMM_DIRECT_Q4``
# (on/off) decides when set; read at each bind.
DIRECT_Q4 = False
DIRECT_Q4_ENV = "DFLASH_QMM_DIRECT_Q4"
# The denormal 4-bit decode (session 48; ``DFLASH_QMM_DENORMAL_Q4=1``, read at each
# bind): each nibble at the top of the mantissa with a zero exponent is the subnormal
# q 2^-130 in bfloat16 (q 2^-18 in float16, at bits 6-9), exactly, and the group's scale
# with its exponent raised by 130 (18) is s 2^130, so one fma a pair, fma(q 2^-130,
# s 2^130, b), rounds q s + b once: the scaled form's weights, bit for bit, with one
# fma a pair fewer (12 instructions a weight word instead of 15). Exact only while every
# scale is a normal number below DENORMAL_SCALE_LIMIT (the raised exponent must fit), so
# a call binds it only when its weight's scales all are (one reduction at bind); others
# keep the scaled form, with the same bits. On the H200 (session 48, as
# ``matmul_variants``' ``denorm4``): the scaled form's bits on every Glimmer shape, 4-6 %
# less device time with one row, 3-5 % with 16; on an H100 (session 49) a tau = 6
# round's device time 15.36 -> 14.81 ms. On since session 51, when its `cuda` tests
# passed on an H100; ``DFLASH_QMM_DENORMAL_Q4=0`` keeps the scaled form.
DENORMAL_Q4 = True
DENORMAL_Q4_ENV = "DFLASH_QMM_DENORMAL_Q4"
DENORMAL_SCALE_LIMIT = 0.25
# The denormal decode with its nibble pairs in place (session 51; on since session 52,
# ``DFLASH_QMM_DENORMAL_IN_PLACE=0`` turns it off; read at each bind; bfloat16 only). A float's value
# is linear in its bits while the exponent field is 0 or 1, so a bfloat16 nibble pair
# left where it lies is q 2^-133 (bits 0-3 of each half) or q 2^-129 (bits 4-7), exactly:
# a weight word's four pairs are 4 masks and one shift (by 8) instead of 4 masks and 4
# shifts, with the group's scale raised by 133 for the low pairs and by 129 for the high
# ones (a second scale register an n8 tile). Exact while every scale is a normal number
# below IN_PLACE_SCALE_LIMIT (s 2^133 must fit); a call whose scales are not keeps the
# denormal decode. By the SASS census the chunk loop's tail 338 -> 298 instructions a
# warp (one m-tile), 409 -> 369 (two). On an H100 (session 52): the same bits as the
# denormal decode on every Glimmer shape at 1 / 16 / 32 rows and its `cuda` tests
# passed; 0.6-2.5 % less device time a call with the weights past the L2, and a tau = 6
# round's 4-bit matmuls 9372 / 9440 -> 9324 / 9346 us.
DENORMAL_IN_PLACE = True
DENORMAL_IN_PLACE_ENV = "DFLASH_QMM_DENORMAL_IN_PLACE"
IN_PLACE_SCALE_LIMIT = 2.0**-5
# The smallest normal number of each half type (a subnormal scale's exponent cannot be
# raised by an integer add).
_SMALLEST_NORMAL = {mx.bfloat16: 2.0**-126, mx.float16: 2.0**-14}


def merge_split_sum() -> bool:
    """Whether a call bound now sums its K split in the matmul launch.

    ``DFLASH_MERGED_SPLIT_SUM`` (on/off) decides when set, else :data:`MERGE_SPLIT_SUM`.
    It is read at each bind, so one process can run both forms (A/B arms).
    """
    switch = backend.env_switch(MERGED_SPLIT_SUM_ENV)
    return MERGE_SPLIT_SUM if switch is None else switch


def cluster_sum() -> bool:
    """Whether a call bound now sums a K split of 2 to :data:`MAX_CLUSTER` inside a
    thread-block cluster (see :data:`CLUSTER_SUM`): ``DFLASH_QMM_CLUSTER_SUM`` when
    set (never while ``MLX_USE_CUDA_GRAPHS`` is on), else the default where direct
    launches are known (:func:`dflash.launch_mode.direct_launches_known`); never on a
    device without clusters."""
    switch = backend.env_switch(CLUSTER_SUM_ENV)
    if switch is None:
        wanted = CLUSTER_SUM and backend.direct_launches_known()
    else:
        wanted = switch and not mlx_cuda_graphs()
    return wanted and device_clusters()


def mlx_cuda_graphs() -> bool:
    """Whether mlx records CUDA graphs in this process (``MLX_USE_CUDA_GRAPHS``, which
    mlx reads once: on unless set to 0 / false / off)."""
    return not backend.cuda_graphs_off(os.environ.get("MLX_USE_CUDA_GRAPHS"))


@functools.lru_cache(maxsize=1)
def device_clusters() -> bool:
    """Whether the default device runs thread-block clusters: a CUDA device of compute
    capability 9.0 or later, by the ``architecture`` mlx reports (unknown: no)."""
    if backend.BACKEND != CUDA:
        return False
    try:
        info = mx.device_info()
    except (AttributeError, RuntimeError, ValueError):
        return False
    major = info.get("compute_capability_major")
    if isinstance(major, int):
        return major >= 9
    found = re.fullmatch(r"sm_(\d+)\w*", str(info.get("architecture", "")))
    return found is not None and int(found.group(1)) >= 90


def wave_split() -> bool:
    """Whether a call bound now takes the wave-aware K split (:func:`split_plan`):
    ``DFLASH_QMM_WAVE_SPLIT`` when set, else :data:`WAVE_SPLIT`."""
    switch = backend.env_switch(WAVE_SPLIT_ENV)
    return WAVE_SPLIT if switch is None else switch


def k_groups() -> int:
    """Warp groups a call bound now splits K between: 2 with ``DFLASH_QMM_TWO_K_GROUPS``
    on, 1 with it off, else :data:`K_GROUPS`."""
    switch = backend.env_switch(TWO_K_GROUPS_ENV)
    return K_GROUPS if switch is None else 2 if switch else 1


def member_major() -> bool:
    """Whether a fused call bound now stores its members as blocks (see
    :data:`MEMBER_MAJOR`): ``DFLASH_QMM_MEMBER_MAJOR`` when set, else the default."""
    switch = backend.env_switch(MEMBER_MAJOR_ENV)
    return MEMBER_MAJOR if switch is None else switch


def member_edges(edges: Sequence[int], columns: int) -> tuple[int, ...]:
    """The member edges (first column of each member after the first) a member-major
    store takes: all of them when each is a multiple of the column tile, strictly
    increasing inside ``(0, columns)`` (a tile then lies in one member), and
    :func:`member_major` is on; else ``()``, the plain layout."""
    edges = tuple(int(edge) for edge in edges)
    if not edges or edges[0] <= 0 or edges[-1] >= columns:
        return ()
    if any(a >= b for a, b in zip(edges, edges[1:])) or any(e % COLUMNS for e in edges):
        return ()
    return edges if member_major() else ()


def scaled_b(bits: Optional[int]) -> bool:
    """Whether a ``bits``-wide affine call bound now takes the scaled-weight form (see
    :data:`SCALED_B`): ``DFLASH_QMM_SCALED_B`` when set, else the default; only for
    :data:`SCALED_B_BITS` (dense calls: never)."""
    if bits not in SCALED_B_BITS:
        return False
    switch = backend.env_switch(SCALED_B_ENV)
    return SCALED_B if switch is None else switch


def direct_q4(bits: Optional[int]) -> bool:
    """Whether a ``bits``-wide affine call bound now in the scaled-weight form takes
    the direct form (see :data:`DIRECT_Q4`): ``DFLASH_QMM_DIRECT_Q4`` when set, else
    the default; 4-bit only."""
    if bits != 4:
        return False
    switch = backend.env_switch(DIRECT_Q4_ENV)
    return DIRECT_Q4 if switch is None else switch


def denormal_q4(bits: Optional[int]) -> bool:
    """Whether a ``bits``-wide affine call bound now in the scaled-weight form may take
    the denormal decode (see :data:`DENORMAL_Q4`): ``DFLASH_QMM_DENORMAL_Q4`` when set,
    else the default; 4-bit only."""
    if bits != 4:
        return False
    return backend.strict_switch(DENORMAL_Q4_ENV, None, DENORMAL_Q4)


def denormal_in_place(bits: Optional[int]) -> bool:
    """Whether a ``bits``-wide call that takes the denormal decode may leave its nibble
    pairs in place (see :data:`DENORMAL_IN_PLACE`): ``DFLASH_QMM_DENORMAL_IN_PLACE``
    when set, else the default; 4-bit only (the caller checks bfloat16 and the scales).
    """
    if bits != 4:
        return False
    return backend.strict_switch(DENORMAL_IN_PLACE_ENV, None, DENORMAL_IN_PLACE)


# What denormal_scales found for each scales array, by its id, while it lives (an mlx
# array never changes, so neither does this): whether every scale is a normal number,
# and the largest magnitude. A caller of small_row_matmul binds at every call, and each
# look costs a reduction and a host sync.
_SCALE_VERDICTS: dict = {}


def denormal_scales(scales: mx.array, limit: float = DENORMAL_SCALE_LIMIT) -> bool:
    """Whether a denormal decode is exact for these scales: every one a normal number
    of magnitude below ``limit`` (:data:`DENORMAL_SCALE_LIMIT`, or
    :data:`IN_PLACE_SCALE_LIMIT` for the pairs in place). One reduction the first time
    an array is asked about; what it found is kept while the array lives.

    Shapes: scales ``(N, K / group_size)`` in bfloat16 or float16.
    """
    if scales.dtype not in _SMALLEST_NORMAL:
        return False
    key = id(scales)
    kept = _SCALE_VERDICTS.get(key)
    if kept is None or kept[0]() is not scales:
        magnitude = mx.abs(scales.astype(mx.float32))
        normal = mx.all(magnitude >= _SMALLEST_NORMAL[scales.dtype])
        largest = mx.max(magnitude)
        try:
            mx.eval(normal, largest)
        except ValueError:  # scales being traced (mx.compile): cannot tell, not exact
            return False

        def forget(ref: weakref.ref) -> None:
            if _SCALE_VERDICTS.get(key, (None,))[0] is ref:
                del _SCALE_VERDICTS[key]

        kept = (weakref.ref(scales, forget), bool(normal.item()), largest.item())
        _SCALE_VERDICTS[key] = kept
    return kept[1] and kept[2] < limit


def scale_decode(scales: mx.array) -> str:
    """The fastest exact 4-bit decode these scales allow: ``"in_place"`` (bfloat16,
    every scale a normal number below :data:`IN_PLACE_SCALE_LIMIT`), ``"denormal"``
    (below :data:`DENORMAL_SCALE_LIMIT`) or ``"scaled"``. One reduction the first time
    (see :func:`denormal_scales`).

    Shapes: scales ``(N, K / group_size)``.
    """
    if not denormal_scales(scales):
        return "scaled"
    if scales.dtype == mx.bfloat16 and denormal_scales(scales, IN_PLACE_SCALE_LIMIT):
        return "in_place"
    return "denormal"


def fold_q4_offset() -> bool:
    """Whether a 4-bit call bound now uses the folded-offset form (see
    :data:`FOLD_Q4_OFFSET`): ``DFLASH_QMM_FOLDED_OFFSET`` when set, else the default."""
    switch = backend.env_switch(FOLDED_OFFSET_ENV)
    return FOLD_Q4_OFFSET if switch is None else switch


@dataclass(frozen=True)
class Layout:
    """Shared-memory geometry of one form (``bits`` 4, 8 or 0 for dense).

    Attributes:
        bits: 4, 8, or 0 (dense weights in x's dtype).
        mtiles: 16-row m-tiles (1 for up to 16 rows, 2 for up to 32).
        direct: The direct 4-bit form's stages: x rows, scales and biases only.
    """

    bits: int
    mtiles: int
    direct: bool = False

    @property
    def chunk(self) -> int:
        """Elements of K per stage (128 weight bytes per column for 4-bit and dense)."""
        return 64 if self.bits == 0 else 256

    @property
    def column_bytes(self) -> int:
        """Weight bytes of one column per stage."""
        return self.chunk * (16 if self.bits == 0 else self.bits) // 8

    @property
    def w_stride(self) -> int:
        """Bytes between columns in shared memory (padded: conflict-free reads)."""
        return self.column_bytes + {4: 16, 8: 32, 0: 64}[self.bits]

    @property
    def x_stride(self) -> int:
        """Bytes between x rows in shared memory (padded: conflict-free 16-byte reads)."""
        return self.chunk * 2 + 64

    @property
    def rows(self) -> int:
        """Rows staged per chunk (zeros past the call's rows)."""
        return 16 * self.mtiles

    @property
    def weight_bytes(self) -> int:
        """Bytes of a stage's weights (none in the direct form, whose lanes load their
        words into registers: :data:`DIRECT_Q4`)."""
        return 0 if self.direct else COLUMNS * self.w_stride

    @property
    def stage_bytes(self) -> int:
        """Bytes of one pipeline stage: weights, x rows, scales and biases."""
        scales = 0 if self.bits == 0 else 2 * COLUMNS * 16
        return self.weight_bytes + self.rows * self.x_stride + scales

    @property
    def stages(self) -> int:
        """Pipeline depth: the most stages (2 to :data:`MAX_STAGES`) within
        :data:`SHARED_BUDGET`."""
        return max(2, min(MAX_STAGES, SHARED_BUDGET // self.stage_bytes))

    @property
    def shared_memory(self) -> int:
        """Dynamic shared memory of the launch."""
        return self.stages * self.stage_bytes


def direct_word(sub_chunk: int, tig: int) -> int:
    """The 32-bit word of a chunk's column (8 elements at 4 bits) that lane ``tig``
    holds for ``sub_chunk`` in the direct form (:data:`DIRECT_Q4`): half chunk
    ``h = sub_chunk // 4`` is the lane's 16 bytes at word ``16 h + 4 tig``, one word a
    sub-chunk. The staged form's lane holds word ``4 sub_chunk + tig``; the direct form
    stages x's 16-byte pieces so that slot ``4 sub_chunk + tig`` holds this word's
    elements (``dfl_direct_slot``), and the lanes read x as before.

    Returns:
        The word ``0..31``.
    """
    if not (0 <= sub_chunk < 8 and 0 <= tig < 4):
        raise ValueError(f"no word for sub-chunk {sub_chunk}, lane {tig}")
    return 16 * (sub_chunk // 4) + 4 * tig + sub_chunk % 4


def physical_k(step: int, logical: int, tig: int) -> int:
    """The sub-chunk element that the mma's logical ``k`` stands for.

    Args:
        step: The mma step within the 32-element sub-chunk (0 or 1).
        logical: The m16n8k16 k index of the lane's value (``2 tig``, ``2 tig + 1``,
            ``2 tig + 8`` or ``2 tig + 9``).
        tig: The lane's index within its quad (``lane % 4``).

    Returns:
        The element ``0..31`` of the sub-chunk.
    """
    second = logical >= 8
    half = (logical - 8 * second) - 2 * tig
    if half not in (0, 1):
        raise ValueError(f"lane {tig} holds no logical k {logical}")
    return 8 * tig + 2 * step + int(second) + 4 * half


# ------------------------------------------------------------------ helpers

_HELPERS = r"""
// m16n8k16 mma, float32 accumulate: d += A * B (A rows x k, B k x columns).
DFL_FN void dfl_mma(float* d, uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                    uint32_t b0, uint32_t b1, const __nv_bfloat16*) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
      "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}
DFL_FN void dfl_mma(float* d, uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                    uint32_t b0, uint32_t b1, const __half*) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
      "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// A pair of ones (the mma operand that sums x).
DFL_FN uint32_t dfl_ones(const __nv_bfloat16*) { return 0x3F803F80u; }
DFL_FN uint32_t dfl_ones(const __half*) { return 0x3C003C00u; }

// The 4-bit integers at bits 0-3 and 16-19 of v as an exact pair: 128 + q, less 128.
DFL_FN uint32_t dfl_q4(uint32_t v, const __nv_bfloat16*) {
  uint32_t r = (v & 0x000F000Fu) | 0x43004300u;
  asm("fma.rn.bf16x2 %0, %0, %1, %2;\n" : "+r"(r) : "r"(0x3F803F80u), "r"(0xC300C300u));
  return r;
}
// The same in float16: 1024 + q, less 1024.
DFL_FN uint32_t dfl_q4(uint32_t v, const __half*) {
  uint32_t r = (v & 0x000F000Fu) | 0x64006400u;
  asm("fma.rn.f16x2 %0, %0, %1, %2;\n" : "+r"(r) : "r"(0x3C003C00u), "r"(0xE400E400u));
  return r;
}

// Two bytes (lo in the low half) as an exact pair, through float32 (2^23 + q, less 2^23).
DFL_FN float dfl_byte(uint32_t q) {
  return __fsub_rn(__uint_as_float(0x4B000000u | q), 8388608.0f);
}
DFL_FN uint32_t dfl_q8(uint32_t lo, uint32_t hi, const __nv_bfloat16*) {
  uint32_t r;
  asm("cvt.rn.bf16x2.f32 %0, %1, %2;\n" : "=r"(r) : "f"(dfl_byte(hi)), "f"(dfl_byte(lo)));
  return r;
}
DFL_FN uint32_t dfl_q8(uint32_t lo, uint32_t hi, const __half*) {
  uint32_t r;
  asm("cvt.rn.f16x2.f32 %0, %1, %2;\n" : "=r"(r) : "f"(dfl_byte(hi)), "f"(dfl_byte(lo)));
  return r;
}

// The shared-state-space address of a generic pointer into shared memory.
DFL_FN uint32_t dfl_shared_address(const void* p) {
  uint32_t address;
  asm("{\n .reg .u64 a;\n cvta.to.shared.u64 a, %1;\n cvt.u32.u64 %0, a;\n}\n"
      : "=r"(address) : "l"(p));
  return address;
}

// The plain copy of n 16-bit elements (the sources are not 16-byte aligned). Not
// inlined: inlined, the compiler predicates it into every fast copy's issue slots.
__device__ __noinline__ void dfl_copy_plain(unsigned char* dst, const unsigned char* src,
                                            int n) {
  unsigned short* d = reinterpret_cast<unsigned short*>(dst);
  const unsigned short* s = reinterpret_cast<const unsigned short*>(src);
  for (int i = 0; i < n; ++i) {
    d[i] = s[i];
  }
}

// 16 bytes into shared memory: cp.async, or plain 16-bit copies when some pointer is
// not 16-byte aligned (same bytes, so the same results).
DFL_FN void dfl_copy16(unsigned char* dst, const unsigned char* src, bool fast) {
  if (fast) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n"
                 :: "r"(dfl_shared_address(dst)), "l"(src) : "memory");
  } else {
    dfl_copy_plain(dst, src, 8);
  }
}
// 4, 8 or 16 bytes (uniform over the warp): cp.async, or 16-bit copies when !fast.
DFL_FN void dfl_copy_small(unsigned char* dst, const unsigned char* src, int bytes, bool fast) {
  if (fast) {
    const uint32_t address = dfl_shared_address(dst);
    if (bytes == 16) {
      asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n"
                   :: "r"(address), "l"(src) : "memory");
    } else if (bytes == 8) {
      asm volatile("cp.async.ca.shared.global [%0], [%1], 8;\n"
                   :: "r"(address), "l"(src) : "memory");
    } else {
      asm volatile("cp.async.ca.shared.global [%0], [%1], 4;\n"
                   :: "r"(address), "l"(src) : "memory");
    }
  } else {
    dfl_copy_plain(dst, src, bytes / 2);
  }
}
DFL_FN void dfl_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int PENDING>
DFL_FN void dfl_wait() { asm volatile("cp.async.wait_group %0;\n" :: "n"(PENDING) : "memory"); }

// Lane registers (e_p, e_{p+4}) from 16 bytes of eight 16-bit elements e_0..e_7.
DFL_FN void dfl_pairs(uint4 v, uint32_t* r) {
  r[0] = __byte_perm(v.x, v.z, 0x5410);
  r[1] = __byte_perm(v.x, v.z, 0x7632);
  r[2] = __byte_perm(v.y, v.w, 0x5410);
  r[3] = __byte_perm(v.y, v.w, 0x7632);
}
"""

# Helpers of the folded-offset 4-bit form only (plain C++ over the helpers above).
_FOLDED_HELPERS = r"""
// Folded-offset form: bfloat16 keeps 128 + q (exact) and the group's bias takes the
// offset, in float32 (s * 128 is exact); float16 keeps q itself and its bias.
DFL_FN uint32_t dfl_q4_offset(uint32_t v, const __nv_bfloat16*) {
  return (v & 0x000F000Fu) | 0x43004300u;
}
DFL_FN uint32_t dfl_q4_offset(uint32_t v, const __half* tag) { return dfl_q4(v, tag); }
DFL_FN float dfl_folded_bias(float bias, float s, const __nv_bfloat16*) {
  return fmaf(-128.0f, s, bias);
}
DFL_FN float dfl_folded_bias(float bias, float, const __half*) { return bias; }
"""

# Helpers of the scaled-weight form only: a pair of exact integers as ``s * q + b``,
# rounded once to the half type (fma.rn on both halves).
_SCALED_HELPERS = r"""
// dfl_q4's pair with its mask and magic in one lop3, (v & 0x000F000F) | magic: written
// in C++, NVRTC gave two LOP3s a pair (LOP3s were a fifth of the instructions, session 26).
DFL_FN uint32_t dfl_q4_lop3(uint32_t v, const __nv_bfloat16*) {
  uint32_t r;
  asm("lop3.b32 %0, %1, %2, %3, 0xEA;\n" : "=r"(r) : "r"(v), "n"(0x000F000F), "n"(0x43004300));
  asm("fma.rn.bf16x2 %0, %0, %1, %2;\n" : "+r"(r) : "r"(0x3F803F80u), "r"(0xC300C300u));
  return r;
}
DFL_FN uint32_t dfl_q4_lop3(uint32_t v, const __half*) {
  uint32_t r;
  asm("lop3.b32 %0, %1, %2, %3, 0xEA;\n" : "=r"(r) : "r"(v), "n"(0x000F000F), "n"(0x64006400));
  asm("fma.rn.f16x2 %0, %0, %1, %2;\n" : "+r"(r) : "r"(0x3C003C00u), "r"(0xE400E400u));
  return r;
}
DFL_FN uint32_t dfl_scaled(uint32_t q, uint32_t s, uint32_t b, const __nv_bfloat16*) {
  asm("fma.rn.bf16x2 %0, %0, %1, %2;\n" : "+r"(q) : "r"(s), "r"(b));
  return q;
}
DFL_FN uint32_t dfl_scaled(uint32_t q, uint32_t s, uint32_t b, const __half*) {
  asm("fma.rn.f16x2 %0, %0, %1, %2;\n" : "+r"(q) : "r"(s), "r"(b));
  return q;
}
"""

# Helpers of the denormal 4-bit decode only (plain C++; see DENORMAL_Q4).
_DENORMAL_HELPERS = r"""
// A nibble pair (bits 0-3, 16-19 of v) as subnormals at the top of the mantissa, zero
// exponent: q 2^-130 in bfloat16 (bits 3-6), q 2^-18 in float16 (bits 6-9), exact.
DFL_FN uint32_t dfl_q4_denorm(uint32_t v, const __nv_bfloat16*) {
  return (v << 3) & 0x00780078u;
}
DFL_FN uint32_t dfl_q4_denorm(uint32_t v, const __half*) {
  return (v << 6) & 0x03C003C0u;
}
// A (normal, below 0.25) scale pair's exponents raised by 130 (bfloat16) or 18
// (float16): s 2^130, s 2^18, exact.
DFL_FN uint32_t dfl_denorm_scale(uint32_t s, const __nv_bfloat16*) {
  return s + 0x41004100u;
}
DFL_FN uint32_t dfl_denorm_scale(uint32_t s, const __half*) {
  return s + 0x48004800u;
}
"""
_DENORMAL_SCALE = (
    "s2[t] = __byte_perm(s, s, 0x1010);",
    "s2[t] = dfl_denorm_scale(__byte_perm(s, s, 0x1010), tag);",
)
# The pairs in place (see DENORMAL_IN_PLACE): helpers, and edits of the weight loads,
# the group's scale, the registers and the fma (old, new).
_IN_PLACE_HELPERS = r"""
// Pairs (bits 0-3, 16-19) and (bits 4-7, 20-23) of v as they lie: in bfloat16 q 2^-133
// and q 2^-129 (exponent field 0 or 1: the value is the bits times 2^-133), exact; in
// float16 each moved to bits 6-9, q 2^-18, as the denormal decode has it.
DFL_FN uint32_t dfl_q4_low(uint32_t v, const __nv_bfloat16*) { return v & 0x000F000Fu; }
DFL_FN uint32_t dfl_q4_high(uint32_t v, const __nv_bfloat16*) { return v & 0x00F000F0u; }
DFL_FN uint32_t dfl_q4_low(uint32_t v, const __half*) { return (v << 6) & 0x03C003C0u; }
DFL_FN uint32_t dfl_q4_high(uint32_t v, const __half*) { return (v << 2) & 0x03C003C0u; }
// A scale pair's exponents raised to match: bfloat16 by 133 (low) and 129 (high),
// float16 by 18 for both.
DFL_FN uint32_t dfl_scale_low(uint32_t s, const __nv_bfloat16*) { return s + 0x42804280u; }
DFL_FN uint32_t dfl_scale_high(uint32_t s, const __nv_bfloat16*) { return s + 0x40804080u; }
DFL_FN uint32_t dfl_scale_low(uint32_t s, const __half*) { return s + 0x48004800u; }
DFL_FN uint32_t dfl_scale_high(uint32_t s, const __half*) { return s + 0x48004800u; }
"""
_IN_PLACE_LOADS = (
    """        b[0] = dfl_q4(w, tag);
        b[1] = dfl_q4(w >> 4, tag);
        b[2] = dfl_q4(w >> 8, tag);
        b[3] = dfl_q4(w >> 12, tag);
""",
    """        b[0] = dfl_q4_low(w, tag);
        b[1] = dfl_q4_high(w, tag);
        b[2] = dfl_q4_low(w >> 8, tag);
        b[3] = dfl_q4_high(w >> 8, tag);
""",
)
_IN_PLACE_FMA = (
    "b[p] = dfl_scaled(b[p], s2[t], b2[t], tag);",
    "b[p] = dfl_scaled(b[p], (p & 1) ? s2h[t] : s2[t], b2[t], tag);",
)
_IN_PLACE_SCALE = (
    "s2[t] = __byte_perm(s, s, 0x1010);",
    "s2[t] = dfl_scale_low(__byte_perm(s, s, 0x1010), tag);\n"
    "          s2h[t] = dfl_scale_high(__byte_perm(s, s, 0x1010), tag);",
)
_IN_PLACE_REGISTERS = ("  uint32_t s2[4];\n", "  uint32_t s2[4];\n  uint32_t s2h[4];\n")

# Helpers of the direct 4-bit form only (plain C++; see DIRECT_Q4).
_DIRECT_HELPERS = r"""
// x's 16-byte piece p of a chunk (elements 8 p .. 8 p + 7, those of weight word p) goes
// to the slot a lane reads for it: word 16 h + 4 tig + s is slot 16 h + 4 s + tig.
DFL_FN int dfl_direct_slot(int p) { return (p & 16) | ((p & 3) << 2) | ((p >> 2) & 3); }
// A lane's 16 bytes of weight words: one load, or 16-bit loads when some pointer is not
// 16-byte aligned (the same bytes).
DFL_FN uint4 dfl_direct_load(const unsigned char* p, bool fast) {
  uint4 v;
  if (fast) {
    v = *reinterpret_cast<const uint4*>(p);
  } else {
    const unsigned short* halves = reinterpret_cast<const unsigned short*>(p);
    unsigned short* into = reinterpret_cast<unsigned short*>(&v);
    for (int e = 0; e < 8; ++e) {
      into[e] = halves[e];
    }
  }
  return v;
}
// Word s (0..3) of a lane's 16 bytes; s is a constant where it is used (selects, never
// an indexed register array, which would go to local memory).
DFL_FN uint32_t dfl_direct_word(uint4 v, int s) {
  return s == 0 ? v.x : s == 1 ? v.y : s == 2 ? v.z : v.w;
}
"""

# The direct form as edits of a filled one-K-group scaled 4-bit text: (old, new).
# ``{halves}`` is the half chunks a lane sums (1 with two K groups, else 2).
_DIRECT_EDITS = (
    # A stage holds x rows, scales and biases: no weights.
    (
        "  constexpr int SW = {w_stride};\n",
        "",
    ),
    (
        "  constexpr int X_OFF = COLUMNS * SW;\n",
        "  constexpr int X_OFF = 0;\n",
    ),
    (
        """  constexpr int W_PIECES = CW / 16;
  constexpr int W_STEP = THREADS / W_PIECES;
""",
        "",
    ),
    (
        """  const unsigned char* w_source =
      reinterpret_cast<const unsigned char*>(weight) + (int(lid) % W_PIECES) * 16;
  const int w_shared = (int(lid) / W_PIECES) * SW + (int(lid) % W_PIECES) * 16;
""",
        "",
    ),
    # x's pieces in the order the lanes' words take them (see dfl_direct_slot).
    (
        "  const int x_shared = X_OFF + x_first * SX + (int(lid) % X_PIECES) * 16;\n",
        "  const int x_shared = X_OFF + x_first * SX + dfl_direct_slot(int(lid) % X_PIECES)"
        " * 16;\n",
    ),
    # No weight copies.
    (
        """    const unsigned char* w_chunk = w_source + size_t(c) * CW;
    #pragma unroll
    for (int i = 0; i < COLUMNS / W_STEP; ++i) {
      const int cl = int(lid) / W_PIECES + W_STEP * i;
      // Columns past N repeat the last one (never stored).
      const int n = col0 + cl < n_cols ? col0 + cl : n_cols - 1;
      dfl_copy16(base + w_shared + W_STEP * i * SW, w_chunk + size_t(n) * row_bytes, fast);
    }
""",
        "",
    ),
    # Each lane's words of its four columns (n8 tiles), the next chunk's loaded while
    # this one is summed: two register buffers, taken in turn by an unrolled pair.
    (
        "  for (int i = 0; i < STAGES - 1; ++i) {\n",
        """  constexpr int HALVES = {halves};
  const int first_half = HALVES == 1 ? int(lid) / 128 : 0;
  const int n_lane = col0 + warp * 32 + gid;
  const unsigned char* w_lane =
      reinterpret_cast<const unsigned char*>(weight) + 64 * first_half + 16 * tig;
  uint4 wq[2][HALVES][4];
  auto load_words = [&](int c, uint4 (&into)[HALVES][4]) {
    #pragma unroll
    for (int t = 0; t < 4; ++t) {
      // Columns past N repeat the last one (never stored).
      const int n = n_lane + 8 * t < n_cols ? n_lane + 8 * t : n_cols - 1;
      const unsigned char* column = w_lane + size_t(n) * row_bytes + size_t(c) * CW;
      #pragma unroll
      for (int h = 0; h < HALVES; ++h) {
        into[h][t] = dfl_direct_load(column + 64 * h, fast);
      }
    }
  };
  if (c_begin < c_end) {
    load_words(c_begin, wq[0]);
  }
  for (int i = 0; i < STAGES - 1; ++i) {
""",
    ),
    (
        "  for (int c = c_begin; c < c_end; ++c) {\n    const int i = c - c_begin;\n",
        """  for (int c_pair = c_begin; c_pair < c_end; c_pair += 2) {
  #pragma unroll
  for (int pp = 0; pp < 2; ++pp) {
    const int c = c_pair + pp;
    if (c >= c_end) {
      break;
    }
    const int i = c - c_begin;
    if (c + 1 < c_end) {
      load_words(c + 1, wq[pp ^ 1]);
    }
""",
    ),
    ("    const unsigned char* wsm = base + warp * 32 * SW;\n", ""),
    ("        const unsigned char* col = wsm + (8 * t + gid) * SW;\n", ""),
    (
        "        const uint32_t w = *reinterpret_cast<const uint32_t*>(col + (4 * sc + tig)"
        " * 4);\n",
        "        const uint32_t w = dfl_direct_word(wq[pp][HALVES == 1 ? 0 : sc >> 2][t],"
        " sc & 3);\n",
    ),
    # A lane's scale opens each half chunk: its 32 elements there lie in one group.
    (
        "      if (((SUB * sc) & (group_size - 1)) == 0) {\n"
        "        const int gl = (SUB * sc) >> group_shift;\n",
        "      if ((sc & 3) == 0) {\n"
        "        const int gl = (4 * SUB * (sc >> 2) + SUB * tig) >> group_shift;\n",
    ),
    # The pair's loop closes with the chunks'.
    (
        "  }\n\n  // c0, c1: row gid, columns 2 tig, 2 tig + 1; c2, c3: row gid + 8.\n",
        "  }\n  }\n\n  // c0, c1: row gid, columns 2 tig, 2 tig + 1; c2, c3: row gid + 8.\n",
    ),
)


# The scaled form's 4-bit pair helper (benchmarks.matmul_variants swaps in dfl_q4).
_SCALED_Q4_HELPER = "dfl_q4_lop3"

# The scaled-weight kernels' launch bounds: mlx's JIT writes ``__global__ void name(``
# after the header, so redefining ``__global__`` there puts the attribute on the kernel
# (the module holds no other). Two CTAs an SM keep ptxas within 128 registers.
LAUNCH_BOUNDS = r"""
#undef __global__
#define __global__ __attribute__((global)) __launch_bounds__({threads}, {blocks})
"""


def launch_bounds(threads: int, blocks: int = 2) -> str:
    """The header text that bounds a kernel of ``threads`` threads to ``blocks`` CTAs
    an SM (the scaled forms: two)."""
    return LAUNCH_BOUNDS.replace("{threads}", str(threads)).replace(
        "{blocks}", str(blocks)
    )


# A cluster's barrier (every thread of its CTAs, shared-memory writes released before
# and acquired after) and the address of a shared element in another CTA of the
# cluster (``mapa``: a generic address, read with plain loads).
CLUSTER_HELPERS = r"""
DFL_FN void dfl_cluster_sync() {
  asm volatile("barrier.cluster.arrive.release.aligned;\n"
               "barrier.cluster.wait.acquire.aligned;\n" ::: "memory");
}
DFL_FN const float* dfl_cluster_map(const float* p, uint32_t rank) {
  const float* q;
  asm volatile("mapa.u64 %0, %1, %2;\n" : "=l"(q) : "l"(p), "r"(rank));
  return q;
}
"""
# Floats a row of a cluster partial takes in shared memory: a column tile and 8 more,
# so the fragment stores (rows gid, columns 2 tig + j) meet 2-way bank conflicts, not 8.
PART_STRIDE = COLUMNS + 8


# Scaled-weight form: the lane's column of each n8 tile (gid) takes its group's scale
# and bias as pairs (s, s), (b, b) when a group opens (every group starts a sub-chunk).
_DECLARE_SCALED = """
  uint32_t s2[4];
  uint32_t b2[4];
"""
_OPEN_SCALED = """
      if (((SUB * sc) & (group_size - 1)) == 0) {
        const int gl = (SUB * sc) >> group_shift;
        #pragma unroll
        for (int t = 0; t < 4; ++t) {
          const int cl = warp * 32 + 8 * t + gid;
          const uint32_t s = *reinterpret_cast<const unsigned short*>(base + S_OFF + cl * 16 + 2 * gl);
          const uint32_t bias = *reinterpret_cast<const unsigned short*>(base + B_OFF + cl * 16 + 2 * gl);
          s2[t] = __byte_perm(s, s, 0x1010);
          b2[t] = __byte_perm(bias, bias, 0x1010);
        }
      }
"""

# The lane's weight registers r_0..r_3 for n8 tile t of the sub-chunk, per form.
_LOAD_B = {
    4: """
        const uint32_t w = *reinterpret_cast<const uint32_t*>(col + (4 * sc + tig) * 4);
        b[0] = dfl_q4(w, tag);
        b[1] = dfl_q4(w >> 4, tag);
        b[2] = dfl_q4(w >> 8, tag);
        b[3] = dfl_q4(w >> 12, tag);
""",
    8: """
        const uint2 w = *reinterpret_cast<const uint2*>(col + (8 * sc + 2 * tig) * 4);
        #pragma unroll
        for (int p = 0; p < 4; ++p) {
          b[p] = dfl_q8((w.x >> (8 * p)) & 0xFFu, (w.y >> (8 * p)) & 0xFFu, tag);
        }
""",
    0: """
        dfl_pairs(*reinterpret_cast<const uint4*>(col + (SUB * sc + 8 * tig) * 2), b);
""",
}

_ISSUE_SCALES = """
    // Scales and biases of the chunk's groups: one copy of each per column (a thread
    // per column; 4, 8 or 16 bytes, aligned as K is a multiple of 256).
    {
      static_assert(THREADS == COLUMNS, "one thread per column's scales");
      const int cl = int(lid);
      const int n = col0 + cl < n_cols ? col0 + cl : n_cols - 1;
      const size_t e = size_t(n) * size_t(groups_k) + size_t(c) * per_chunk;
      dfl_copy_small(base + S_OFF + cl * 16, reinterpret_cast<const unsigned char*>(scales + e),
                     per_chunk * 2, fast);
      dfl_copy_small(base + B_OFF + cl * 16, reinterpret_cast<const unsigned char*>(biases + e),
                     per_chunk * 2, fast);
    }
"""

# Affine: sums of x (ones operand) per step; the group's terms into acc at its end.
_XSUM = """
      #pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
        dfl_mma(xs[mt], lo[mt][0], hi[mt][0], lo[mt][1], hi[mt][1], ones, ones, tag);
        dfl_mma(xs[mt], lo[mt][2], hi[mt][2], lo[mt][3], hi[mt][3], ones, ones, tag);
      }
"""

# Affine: the sums of x of the open group (rows gid, gid + 8 in c0/c2), and the ones.
_DECLARE_XS = """
  float xs[MT][4];
  #pragma unroll
  for (int mt = 0; mt < MT; ++mt) {
    #pragma unroll
    for (int i = 0; i < 4; ++i) {
      xs[mt][i] = 0.0f;
    }
  }
  const uint32_t ones = dfl_ones(tag);
"""

_CLOSE_AFFINE = """
      // Chunks start on group boundaries; groups are powers of two (shift, mask).
      if (((SUB * (sc + 1)) & (group_size - 1)) == 0) {
        const int gl = (SUB * sc) >> group_shift;
        #pragma unroll
        for (int t = 0; t < 4; ++t) {
          #pragma unroll
          for (int j = 0; j < 2; ++j) {
            const int cl = warp * 32 + 8 * t + 2 * tig + j;
            const float s = float(reinterpret_cast<const T*>(base + S_OFF + cl * 16)[gl]);
            const float bias = {bias_of}(float(reinterpret_cast<const T*>(base + B_OFF + cl * 16)[gl]){bias_args});
            #pragma unroll
            for (int mt = 0; mt < MT; ++mt) {
              #pragma unroll
              for (int h = 0; h < 2; ++h) {
                float& a = acc[mt][t][2 * h + j];
                a = fmaf(s, d[mt][t][2 * h + j], fmaf(bias, xs[mt][2 * h], a));
                d[mt][t][2 * h + j] = 0.0f;
              }
            }
          }
        }
        #pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
          #pragma unroll
          for (int i = 0; i < 4; ++i) {
            xs[mt][i] = 0.0f;
          }
        }
      }
"""

_CLOSE_DENSE = """
      if (sc == SUBS - 1) {
        #pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
          #pragma unroll
          for (int t = 0; t < 4; ++t) {
            #pragma unroll
            for (int i = 0; i < 4; ++i) {
              acc[mt][t][i] = __fadd_rn(acc[mt][t][i], d[mt][t][i]);
              d[mt][t][i] = 0.0f;
            }
          }
        }
      }
"""

_BODY = r"""
  extern __shared__ uint4 dfl_tc_smem[];
  unsigned char* smem = reinterpret_cast<unsigned char*>(dfl_tc_smem);
  constexpr int MT = {mtiles};
  constexpr int STAGES = {stages};
  constexpr int CHUNK = {chunk};
  constexpr int SUB = {sub};
  constexpr int SUBS = CHUNK / SUB;
  constexpr int THREADS = {threads};
  constexpr int COLUMNS = {columns};
  constexpr int CW = {column_bytes};
  constexpr int SW = {w_stride};
  constexpr int SX = {x_stride};
  constexpr int XROWS = 16 * MT;
  constexpr int X_OFF = COLUMNS * SW;
  constexpr int S_OFF = X_OFF + XROWS * SX;
  constexpr int B_OFF = S_OFF + COLUMNS * 16;
  constexpr int STAGE_BYTES = {stage_bytes};
  (void)B_OFF;
  const T* tag = nullptr;
  const int n_rows = params[0];
  const int n_cols = params[1];
  const int depth = params[2];
  const int group_size = params[3];
  const int col_tiles = params[4];
  const int splits = params[5];
  const int per_split = params[6];
  const int group_shift = params[7];
  const int merged = params[8];
  (void)group_shift;
  const int tile = int(group) % col_tiles;
  const int split = int(group) / col_tiles;
  const int chunks = depth / CHUNK;
  const int c_begin = split * per_split;
  const int c_end = c_begin + per_split < chunks ? c_begin + per_split : chunks;
  const int warp = int(lid) / 32;
  const int lane = int(lid) % 32;
  const int gid = lane / 4;
  const int tig = lane % 4;
  const int col0 = tile * COLUMNS;
  // Member-major output: params[9] member edges follow (multiples of COLUMNS), and
  // each member's columns are stored as one contiguous (rows, width) block, so its
  // result is a view; with none, the plain (rows, n_cols) layout.
  int out_lo = 0;
  int out_hi = n_cols;
  for (int j = 0; j < params[9]; ++j) {
    const int edge = params[10 + j];
    out_lo = edge <= col0 ? edge : out_lo;
    out_hi = edge > col0 && edge < out_hi ? edge : out_hi;
  }
  const size_t out_base = size_t(out_lo) * size_t(n_rows);
  const int out_width = out_hi - out_lo;
  const size_t row_bytes = size_t(depth) * size_t({bits_per_element}) / 8;
  const int groups_k = group_size > 0 ? depth / group_size : 0;
  const int per_chunk = group_size > 0 ? CHUNK / group_size : 0;
  (void)groups_k;
  (void)per_chunk;
  // cp.async needs 16-byte aligned sources (every offset below is a multiple of 16).
  const bool fast = ((size_t(x) | size_t(weight){extra_pointers}) & size_t(15)) == 0;

  // Each thread copies the same 16-byte piece of its columns and rows every chunk, so
  // its sources are worked out once (per-copy index arithmetic cost as much as the mma).
  constexpr int W_PIECES = CW / 16;
  constexpr int W_STEP = THREADS / W_PIECES;
  constexpr int X_PIECES = CHUNK * 2 / 16;
  constexpr int X_STEP = THREADS / X_PIECES;
  const unsigned char* w_source =
      reinterpret_cast<const unsigned char*>(weight) + (int(lid) % W_PIECES) * 16;
  const int w_shared = (int(lid) / W_PIECES) * SW + (int(lid) % W_PIECES) * 16;
  const unsigned char* x_source =
      reinterpret_cast<const unsigned char*>(x) + (int(lid) % X_PIECES) * 16;
  const int x_first = int(lid) / X_PIECES;
  const int x_shared = X_OFF + x_first * SX + (int(lid) % X_PIECES) * 16;
  const size_t x_row_bytes = size_t(depth) * 2;
  // Rows past the call's are zeros in every stage: written once here, never copied.
  const uint4 zeros = {0u, 0u, 0u, 0u};
  for (int p = int(lid); p < STAGES * (XROWS - n_rows) * X_PIECES; p += THREADS) {
    const int stage = p / ((XROWS - n_rows) * X_PIECES);
    const int r = n_rows + (p / X_PIECES) % (XROWS - n_rows);
    *reinterpret_cast<uint4*>(smem + stage * STAGE_BYTES + X_OFF + r * SX +
                              (p % X_PIECES) * 16) = zeros;
  }

  auto issue = [&](int c, int buf) {
    unsigned char* base = smem + buf * STAGE_BYTES;
    const unsigned char* w_chunk = w_source + size_t(c) * CW;
    #pragma unroll
    for (int i = 0; i < COLUMNS / W_STEP; ++i) {
      const int cl = int(lid) / W_PIECES + W_STEP * i;
      // Columns past N repeat the last one (never stored).
      const int n = col0 + cl < n_cols ? col0 + cl : n_cols - 1;
      dfl_copy16(base + w_shared + W_STEP * i * SW, w_chunk + size_t(n) * row_bytes, fast);
    }
    const unsigned char* x_chunk = x_source + size_t(c) * CHUNK * 2;
    for (int r = x_first; r < n_rows; r += X_STEP) {
      dfl_copy16(base + x_shared + (r - x_first) * SX, x_chunk + size_t(r) * x_row_bytes, fast);
    }
{issue_scales}
  };

  float acc[MT][4][4];
  float d[MT][4][4];
{declare_xs}
  #pragma unroll
  for (int mt = 0; mt < MT; ++mt) {
    #pragma unroll
    for (int i = 0; i < 4; ++i) {
      #pragma unroll
      for (int t = 0; t < 4; ++t) {
        acc[mt][t][i] = 0.0f;
        d[mt][t][i] = 0.0f;
      }
    }
  }

  for (int i = 0; i < STAGES - 1; ++i) {
    if (c_begin + i < c_end) {
      issue(c_begin + i, i);
    }
    dfl_commit();
  }
  for (int c = c_begin; c < c_end; ++c) {
    const int i = c - c_begin;
    dfl_wait<STAGES - 2>();
    DFL_BARRIER();
    // The buffer refilled here was read in the previous round (all threads are past it).
    if (c + STAGES - 1 < c_end) {
      issue(c + STAGES - 1, (i + STAGES - 1) % STAGES);
    }
    dfl_commit();
    const unsigned char* base = smem + (i % STAGES) * STAGE_BYTES;
    (void)base;
    const unsigned char* wsm = base + warp * 32 * SW;
    #pragma unroll
    for (int sc = 0; sc < SUBS; ++sc) {
      // x rows gid and gid + 8 of each m-tile as pairs (e_p, e_{p+4}).
      uint32_t lo[MT][4];
      uint32_t hi[MT][4];
      #pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
        const unsigned char* row = base + X_OFF + (16 * mt + gid) * SX + (SUB * sc + 8 * tig) * 2;
        dfl_pairs(*reinterpret_cast<const uint4*>(row), lo[mt]);
        dfl_pairs(*reinterpret_cast<const uint4*>(row + 8 * SX), hi[mt]);
      }
{xsum}
      #pragma unroll
      for (int t = 0; t < 4; ++t) {
        const unsigned char* col = wsm + (8 * t + gid) * SW;
        uint32_t b[4];
{load_b}
        #pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
          dfl_mma(d[mt][t], lo[mt][0], hi[mt][0], lo[mt][1], hi[mt][1], b[0], b[1], tag);
          dfl_mma(d[mt][t], lo[mt][2], hi[mt][2], lo[mt][3], hi[mt][3], b[2], b[3], tag);
        }
      }
{close}
    }
  }

  // c0, c1: row gid, columns 2 tig, 2 tig + 1; c2, c3: row gid + 8.
  #pragma unroll
  for (int mt = 0; mt < MT; ++mt) {
    #pragma unroll
    for (int t = 0; t < 4; ++t) {
      #pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int r = 16 * mt + gid + 8 * (i / 2);
        const int n = col0 + warp * 32 + 8 * t + 2 * tig + i % 2;
        if (r < n_rows && n < n_cols) {
          if (splits == 1) {
            y[out_base + size_t(r) * out_width + (n - out_lo)] = T(acc[mt][t][i]);
          } else {
            partial[(size_t(split) * n_rows + r) * n_cols + n] = acc[mt][t][i];
          }
        }
      }
    }
  }
  if (splits > 1 && merged) {
    // The last CTA of this column tile to finish sums the tile's partials in split
    // order (the reduce launch's arithmetic, so the same bits).
    __threadfence();
    DFL_BARRIER();
    int* last = reinterpret_cast<int*>(smem);
    if (lid == 0) {
      int* counter = const_cast<int*>(counters) + tile;
      *last = atomicAdd(counter, 1) == splits - 1;
    }
    DFL_BARRIER();
    if (*last) {
      __threadfence();
      const size_t total = size_t(n_rows) * size_t(n_cols);
      if ((n_cols & 3) == 0 && splits <= 8 && (size_t(partial) & 15) == 0) {
        // 4 consecutive outputs of a row a thread (each split's rows start 16-byte
        // aligned as N is a multiple of 4): every split's 16-byte load in flight at
        // once, then each output summed in split order (the same sums as below, with
        // 4x fewer round trips to L2: 2 at 16 rows, against 8).
        const float4 none = {0.0f, 0.0f, 0.0f, 0.0f};
        auto lane4 = [](const float4& v, int i) {
          return i == 0 ? v.x : i == 1 ? v.y : i == 2 ? v.z : v.w;
        };
        const size_t split_step = total / 4;
        for (int p = int(lid); p < n_rows * (COLUMNS / 4); p += THREADS) {
          const int r = p / (COLUMNS / 4);
          const int n = col0 + 4 * (p % (COLUMNS / 4));
          if (n < n_cols) {
            const float4* source = reinterpret_cast<const float4*>(
                partial + size_t(r) * size_t(n_cols) + size_t(n));
            float4 v[8];
            #pragma unroll
            for (int k = 0; k < 8; ++k) {
              v[k] = k < splits ? __ldcg(source + size_t(k) * split_step) : none;
            }
            #pragma unroll
            for (int j = 0; j < 4; ++j) {
              float sum = lane4(v[0], j);
              #pragma unroll
              for (int k = 1; k < 8; ++k) {
                sum = k < splits ? __fadd_rn(sum, lane4(v[k], j)) : sum;
              }
              y[out_base + size_t(r) * out_width + (n + j - out_lo)] = T(sum);
            }
          }
        }
      } else {
        // Every split's load of an output is issued before the first add (up to 8
        // splits; a loop past that), then added in split order: the same sum.
        for (int p = int(lid); p < n_rows * COLUMNS; p += THREADS) {
          const int n = col0 + p % COLUMNS;
          if (n < n_cols) {
            const size_t e = size_t(p / COLUMNS) * size_t(n_cols) + size_t(n);
            float sum;
            if (splits <= 8) {
              float v[8];
              #pragma unroll
              for (int k = 0; k < 8; ++k) {
                v[k] = k < splits ? __ldcg(partial + size_t(k) * total + e) : 0.0f;
              }
              sum = v[0];
              #pragma unroll
              for (int k = 1; k < 8; ++k) {
                sum = k < splits ? __fadd_rn(sum, v[k]) : sum;
              }
            } else {
              sum = __ldcg(partial + e);
              for (int k = 1; k < splits; ++k) {
                sum = __fadd_rn(sum, __ldcg(partial + size_t(k) * total + e));
              }
            }
            y[out_base + size_t(p / COLUMNS) * out_width + (n - out_lo)] = T(sum);
          }
        }
      }
      // Dead (each launch's counters are fresh) but kept: without this store ptxas
      // gives the 4-bit two-row-tile form 196 registers, not 165 (3 CTAs an SM to 2).
      if (lid == 0) {
        const_cast<int*>(counters)[tile] = 0;
      }
    }
  }
"""

# The K split's merge (the last CTA of a column tile sums the partials): the vector
# merge of session 48 (4 outputs of a row a thread, every split's 16-byte load in
# flight: 2 round trips to L2 at 16 rows) and the merge before it (one output a thread,
# every split's load of it in flight: one round trip per 256 outputs, 8 at 16 rows).
# The same sums in the same order, so the same bits (emulated; on the H200 in session
# 48 on every Glimmer shape, 4-bit and bf16, 1 and 16 rows). The vector merge measured
# 4-10 % faster with 16 rows (the fused gate / up 86.0 -> 81.0 us, o_proj 16.5 -> 15.0)
# and even with one; :data:`VECTOR_MERGE` says which one the forms carry. The direct
# form always keeps the merge before (the vector one spills its two-K-group kernels 4
# bytes at the 128-register cap).
_MERGE_BLOCK = _BODY[
    _BODY.index("      if ((n_cols & 3) == 0 && splits <= 8") : _BODY.index(
        "      // Dead (each launch's counters are fresh)"
    )
]
_SCALAR_MERGE = "\n".join(
    line[2:] if line.startswith("  ") else line
    for line in _MERGE_BLOCK[
        _MERGE_BLOCK.index("      } else {\n")
        + len("      } else {\n") : -len("      }\n")
    ].split("\n")
)


def _import_switch(name: str, default: bool) -> bool:
    """A switch read at import (the forms' texts are built then), where a bad value
    cannot fail closed without breaking the import: it is ``default`` there, and the
    next bind raises on it (:func:`_checked_import_switch`)."""
    value = backend.env_switch(name)
    return default if value is None else value


def _checked_import_switch(name: str, value: bool) -> bool:
    """``value`` (a switch taken at import) once ``name``'s setting is an on/off word.

    Raises:
        ValueError: ``name`` is set to something that is not an on/off word.
    """
    backend.strict_switch(name, None)
    return value


VECTOR_MERGE = _import_switch(VECTOR_MERGE_ENV, VECTOR_MERGE_DEFAULT)


def vector_merge() -> bool:
    """Which merge the forms carry (:data:`VECTOR_MERGE`, taken at import; raises on a
    bad ``DFLASH_QMM_VECTOR_MERGE``)."""
    return _checked_import_switch(VECTOR_MERGE_ENV, VECTOR_MERGE)


# The paired stage (sessions 49-50; ``DFLASH_QMM_PAIRED_STAGE=1``, read at import: the
# forms' texts are built then; off): after a chunk's copies land, each thread rewrites
# the pieces it copied itself into the order the lanes read them, before the barrier
# that publishes the stage (its own cp.async copies are the ones its wait covered), so
# the chunk loop's reads need no permutes:
# * x: a thread copies the same piece of rows r and r + 8 of an m-tile (4-bit: 32
#   pieces a row, so 4 or 8 rows between a thread's copies); it writes the lanes' pairs
#   (e_p, e_{p+4}) of both as the mma's A operands, (p0, q0, p1, q1) at row r's place
#   and (p2, q2, p3, q3) at row r + 8's, so a lane reads each mma's four operand
#   registers with one 16-byte load. (Session 49's first version kept each row's pairs
#   in its own place: nvcc then paid ~109 register moves a chunk to put them in the
#   operands' order, more than the 48 permutes it removed; benchmarks.sass_census.)
#   The loop over a thread's m-tiles is not unrolled: unrolled, the two-row-tile forms
#   spill.
# * with a constant group of 64 or 128 (the scaled forms), each column's scales and
#   biases as the pairs (s, s), (b, b) of a group side by side, so a lane takes both
#   with one 8-byte load when a group opens (with the denormal decode's exponent
#   raised there too), where it made two 16-bit loads and two permutes.
# A high row past the call's rows is not copied: its place takes the low row's pairs
# (its own zeros are then never read), so the zeros written at the start are followed
# by a barrier. The same values reach the mma, so the same bits. 4-bit only (the dense
# forms' rows r and r + 8 are copied by threads of different warps), not the direct
# form (its own staging). Session 51 (an H100): its `cuda` tests pass and with the lean
# issue a call is 1-4 % faster on all but one shape; whole rounds seemed ~6 % slower,
# which session 52 traced to the round measure (the rounds' matmuls were faster with
# both). Session 53, beside the pairs in place: with the lean issue 0.4-4 % faster a
# call on most shapes but 4 % slower on the one-row gate / up; a round's matmul 0.6 %
# less, its busy time unmoved, a plain token's matmul 1 % more. Off.
PAIRED_STAGE_DEFAULT = False
PAIRED_STAGE_ENV = "DFLASH_QMM_PAIRED_STAGE"
PAIRED_STAGE = _import_switch(PAIRED_STAGE_ENV, PAIRED_STAGE_DEFAULT)


def paired_stage() -> bool:
    """Whether the forms carry the paired stage (:data:`PAIRED_STAGE`, taken at import;
    raises on a bad ``DFLASH_QMM_PAIRED_STAGE``)."""
    return _checked_import_switch(PAIRED_STAGE_ENV, PAIRED_STAGE)


# The lean issue (session 49; ``DFLASH_QMM_LEAN_ISSUE=1``, read at import; off): the
# copy issue's work a chunk cut to the copies. Session 48's per-instruction profile of
# the 4-bit form showed each 16-byte copy taking ~9 instructions: the source built from
# the weight's base, the row's offset and the chunk's (two 64-bit adds), the shared
# address as a 64-bit generic pointer converted back, a branch on the aligned-copy test
# and a move; the ring's slots found by a division by STAGES twice a chunk. Here each
# weight row's source pointer is worked out once, the shared addresses are 32-bit from
# one conversion, the aligned test is taken once a chunk around all copies, x's copies
# are a loop of compile-time bound, each predicated (no loop to set up; nvcc then puts
# a chunk's copies in one run, so ptxas's three never-executed `@!PT LDS` come once a
# run, not once a copy), and the ring's read and write slots are counters. The same
# copies of the same bytes, so the same bits. Not the direct form (its own staging),
# not 8-bit (its two-row-tile forms spill at 128 registers). Off, with the paired stage
# (timed together in session 53: see above).
LEAN_ISSUE_DEFAULT = False
LEAN_ISSUE_ENV = "DFLASH_QMM_LEAN_ISSUE"
LEAN_ISSUE = _import_switch(LEAN_ISSUE_ENV, LEAN_ISSUE_DEFAULT)


def lean_issue() -> bool:
    """Whether the forms carry the lean issue (:data:`LEAN_ISSUE`, taken at import;
    raises on a bad ``DFLASH_QMM_LEAN_ISSUE``)."""
    return _checked_import_switch(LEAN_ISSUE_ENV, LEAN_ISSUE)


# The lean byte decode (session 70; ``DFLASH_QMM_LEAN_BYTES``, read at import; on):
# the 8-bit forms' pair of weights made exact without float32. ``dfl_q8`` puts each
# byte under float32's 2^23 exponent, subtracts 2^23 and packs the pair (~7
# instructions a pair: the census's LOP3 / SHF / FADD / F2FP). Here one ``prmt`` puts
# the two bytes at the two halves' low bytes and one ``lop3`` keeps their low 7 bits
# under bf16's 2^7 exponent (0x4300 | t = 128 + t, exact); a sign-replicating
# ``prmt`` and one ``lop3`` make -128 where a byte's top bit is clear and 0 where it
# is set, and one bf16x2 fma adds it (exact: t, or 128 + t, is the byte). float16
# holds 1024 + q for every byte, so there the 4-bit way serves (3 instructions). The
# same exact pair, so the same bits after. 8-bit forms only, not SwiGLU's (opt-in; not
# run with it). On by default since session 71 (an H100, full-size Muse Glimmer, 8
# bits, groups of 64): the same bits as the float32 decode in every cuda test case;
# the 16-token verify forward's device time 16.4 against 17.3 ms; 96-token DFlash
# generations 329.6 against 340.7 ms with mlx's graphs (2 and 4 processes) and 360 against
# 374-380 ms without (3 and 3), all lossless (docs/benchmarks/h100-2026-12-07-s71).
# ``DFLASH_QMM_LEAN_BYTES=0`` gives the float32 decode back.
LEAN_BYTES_DEFAULT = True
LEAN_BYTES_ENV = "DFLASH_QMM_LEAN_BYTES"
LEAN_BYTES = _import_switch(LEAN_BYTES_ENV, LEAN_BYTES_DEFAULT)


def lean_bytes() -> bool:
    """Whether the 8-bit forms carry the lean byte decode (:data:`LEAN_BYTES`, taken
    at import; raises on a bad ``DFLASH_QMM_LEAN_BYTES``)."""
    return _checked_import_switch(LEAN_BYTES_ENV, LEAN_BYTES)


def lean_byte_selectors(p: int) -> Tuple[int, int]:
    """The ``prmt`` selectors of byte ``p`` of two words (``lo``: bytes 0-3 of the
    pool, ``hi``: 4-7): the pair's bytes at each half's low byte (and again at its high
    byte, masked off after), and the same with the sign-replicate bit set.

    Args:
        p: The byte of each word (0 to 3).

    Returns:
        ``(spread, sign)``.
    """
    if not 0 <= p < 4:
        raise ValueError(f"a word has bytes 0 to 3, got {p}")
    spread = p | p << 4 | (4 + p) << 8 | (4 + p) << 12
    return spread, spread | 0x8888


_LEAN_BYTES_HELPERS = r"""
// Byte p of lo and of hi as an exact pair (lo's in the low half), without float32 (see
// LEAN_BYTES): 128 + (q & 127) under bf16's 2^7 exponent, less 128 where q < 128.
DFL_FN uint32_t dfl_q8_lean(uint32_t lo, uint32_t hi, uint32_t spread, uint32_t sign,
                            const __nv_bfloat16*) {
  uint32_t r, m, c;
  asm("prmt.b32 %0, %1, %2, %3;\n" : "=r"(r) : "r"(lo), "r"(hi), "r"(spread));
  asm("lop3.b32 %0, %1, %2, %3, 0xEA;\n" : "=r"(r) : "r"(r), "n"(0x007F007F), "n"(0x43004300));
  asm("prmt.b32 %0, %1, %2, %3;\n" : "=r"(m) : "r"(lo), "r"(hi), "r"(sign));
  asm("lop3.b32 %0, %1, %2, %3, 0x0C;\n" : "=r"(c) : "r"(m), "n"(0xC300C300), "n"(0));
  asm("fma.rn.bf16x2 %0, %0, %1, %2;\n" : "+r"(r) : "r"(0x3F803F80u), "r"(c));
  return r;
}
// float16 holds 1024 + q for every byte: the 4-bit way.
DFL_FN uint32_t dfl_q8_lean(uint32_t lo, uint32_t hi, uint32_t spread, uint32_t,
                            const __half*) {
  uint32_t r;
  asm("prmt.b32 %0, %1, %2, %3;\n" : "=r"(r) : "r"(lo), "r"(hi), "r"(spread));
  asm("lop3.b32 %0, %1, %2, %3, 0xEA;\n" : "=r"(r) : "r"(r), "n"(0x00FF00FF), "n"(0x64006400));
  asm("fma.rn.f16x2 %0, %0, %1, %2;\n" : "+r"(r) : "r"(0x3C003C00u), "r"(0xE400E400u));
  return r;
}
"""
# The 8-bit load with the lean byte decode, its selectors written in as constants.
_LEAN_BYTES_LOAD = """
        const uint2 w = *reinterpret_cast<const uint2*>(col + (8 * sc + 2 * tig) * 4);
""" + "".join(
    "        b[{}] = dfl_q8_lean(w.x, w.y, 0x{:04X}u, 0x{:04X}u, tag);\n".format(
        p, *lean_byte_selectors(p)
    )
    for p in range(4)
)


def merge_body(vector: bool) -> str:
    """The matmul body with the vector merge or the merge before it (see
    :data:`VECTOR_MERGE`)."""
    body = _BODY_VECTOR_MERGE
    return body if vector else body.replace(_MERGE_BLOCK, _SCALAR_MERGE)


_BODY_VECTOR_MERGE = _BODY
_BODY = merge_body(VECTOR_MERGE)

_REDUCE = r"""
  // y = the split partials summed in split order, rounded once, stored in the
  // matmul's output layout (params[3] member edges from params[4]; see the matmul).
  const int total = params[0];
  const int splits = params[1];
  const int n_cols = params[2];
  const int i = int(group) * {threads} + int(lid);
  if (i < total) {
    float s = partial[i];
    for (int k = 1; k < splits; ++k) {
      s = __fadd_rn(s, partial[size_t(k) * total + i]);
    }
    const int n = i % n_cols;
    int lo = 0;
    int hi = n_cols;
    for (int j = 0; j < params[3]; ++j) {
      const int edge = params[4 + j];
      lo = edge <= n ? edge : lo;
      hi = edge > n && edge < hi ? edge : hi;
    }
    y[size_t(lo) * size_t(total / n_cols) + size_t(i / n_cols) * (hi - lo) + (n - lo)] =
        T(s);
  }
"""


def _fill(text: str, values: dict) -> str:
    for key, value in values.items():
        text = text.replace("{" + key + "}", str(value))
    return text


def _replaced(text: str, old: str, new: str) -> str:
    """``text`` with its one ``old`` made ``new`` (raises if ``old`` is not there once:
    an edit written against a text that has since changed)."""
    if text.count(old) != 1:
        raise RuntimeError(f"the matmul body has changed: {old.strip()[:60]}")
    return text.replace(old, new)


def _constant_group(group_size: int) -> tuple[tuple[str, str], ...]:
    """Edits of the body that make ``group_size`` a compile-time constant.

    With the size known, the unrolled sub-chunk loop resolves each group-open test
    and each scale's index at compile time: no branch a sub-chunk, and ptxas counts
    8 % fewer instructions in the 4-bit two-K-group scaled form (session 28).
    """
    shift = group_size.bit_length() - 1
    return (
        (
            "  const int group_size = params[3];\n",
            f"  constexpr int group_size = {group_size};\n",
        ),
        (
            "  const int group_shift = params[7];\n",
            f"  constexpr int group_shift = {shift};\n",
        ),
    )


_SCALED_LOAD = """
        #pragma unroll
        for (int p = 0; p < 4; ++p) {
          b[p] = dfl_scaled(b[p], s2[t], b2[t], tag);
        }
"""
# The scaled-weight form's edits of the body: the mma sums into the accumulators.
_SCALED_EDITS = (
    ("  float d[MT][4][4];\n", ""),
    ("        d[mt][t][i] = 0.0f;\n", ""),
    ("dfl_mma(d[mt][t], lo[mt][0]", "dfl_mma(acc[mt][t], lo[mt][0]"),
    ("dfl_mma(d[mt][t], lo[mt][2]", "dfl_mma(acc[mt][t], lo[mt][2]"),
)


# The paired stage (see PAIRED_STAGE): helpers, and edits of the body (old, new).
_PAIRED_HELPERS = r"""
// A thread's own pieces of x rows r (low) and r + 8 (high) of an m-tile rewritten as
// the mma's A operands: with p, q the lanes' pairs of each (dfl_pairs), (p0, q0, p1, q1)
// at the low row's place and (p2, q2, p3, q3) at the high row's. A high row past the
// call's rows is zeros (its place is not read: it may hold an earlier chunk's pairs).
DFL_FN void dfl_interleave(unsigned char* low, unsigned char* high, bool has_high) {
  uint32_t p[4];
  uint32_t q[4] = {0u, 0u, 0u, 0u};
  dfl_pairs(*reinterpret_cast<const uint4*>(low), p);
  if (has_high) {
    dfl_pairs(*reinterpret_cast<const uint4*>(high), q);
  }
  const uint4 a = {p[0], q[0], p[1], q[1]};
  const uint4 b = {p[2], q[2], p[3], q[3]};
  *reinterpret_cast<uint4*>(low) = a;
  *reinterpret_cast<uint4*>(high) = b;
}
// A lane's x operands of an m-tile from the interleaved rows (one 16-byte load each).
DFL_FN void dfl_interleaved_load(const unsigned char* low, const unsigned char* high,
                                 uint32_t* lo, uint32_t* hi) {
  const uint4 a = *reinterpret_cast<const uint4*>(low);
  const uint4 b = *reinterpret_cast<const uint4*>(high);
  lo[0] = a.x;
  hi[0] = a.y;
  lo[1] = a.z;
  hi[1] = a.w;
  lo[2] = b.x;
  hi[2] = b.y;
  lo[3] = b.z;
  hi[3] = b.w;
}
"""
_PAIRED_WAIT = "    dfl_wait<STAGES - 2>();\n    DFL_BARRIER();\n"
_PAIRED_X = """    dfl_wait<STAGES - 2>();
    {
      // This thread's own x pieces of the chunk (the copies its wait covered; it copies
      // rows r and r + 8 of a tile both) as the mma's operands; the barrier below
      // publishes them.
      static_assert(8 % X_STEP == 0, "a thread copies rows r and r + 8 both");
      unsigned char* pieces = smem + (i % STAGES) * STAGE_BYTES + x_shared;
      #pragma unroll 1
      for (int t = 0; t < MT; ++t) {
        #pragma unroll
        for (int j = 0; j < 8 / X_STEP; ++j) {
          const int r = 16 * t + x_first + j * X_STEP;  // a low row of tile t
          if (r < n_rows) {
            unsigned char* low = pieces + (16 * t + j * X_STEP) * SX;
            dfl_interleave(low, low + 8 * SX, r + 8 < n_rows);
          }
        }
      }
    }
{pair_scales}    DFL_BARRIER();
"""
_PAIRED_EDITS = (
    (
        "        dfl_pairs(*reinterpret_cast<const uint4*>(row), lo[mt]);\n"
        "        dfl_pairs(*reinterpret_cast<const uint4*>(row + 8 * SX), hi[mt]);\n",
        "        dfl_interleaved_load(row, row + 8 * SX, lo[mt], hi[mt]);\n",
    ),
    (
        # A high row past the call's rows takes its low row's pairs at the first chunk:
        # every thread's zeros must be down before (they would overwrite them).
        "                              (p % X_PIECES) * 16) = zeros;\n  }\n",
        "                              (p % X_PIECES) * 16) = zeros;\n  }\n"
        "  DFL_BARRIER();\n",
    ),
)
# A column's (s, s), (b, b) pairs of group g at byte 8 g of the column's 32 bytes of
# scales and biases rooms (groups 0-1 in the scales', 2-3 in the biases'): up to 4
# groups a chunk, so a constant group of 64 or 128.
_PAIR_SCALES = """    if (int(lid) < COLUMNS) {
      // This thread's column's scales and biases of the chunk (its own copies) as the
      // pairs (s, s), (b, b) of each group side by side.
      unsigned char* column = smem + (i % STAGES) * STAGE_BYTES + int(lid) * 16;
      static_assert(CHUNK / group_size <= 4, "a chunk's pairs fill its rooms");
      uint32_t s[4];
      uint32_t b[4];
      #pragma unroll
      for (int g = 0; g < CHUNK / group_size; ++g) {
        s[g] = *reinterpret_cast<const unsigned short*>(column + S_OFF + 2 * g);
        b[g] = *reinterpret_cast<const unsigned short*>(column + B_OFF + 2 * g);
      }
      #pragma unroll
      for (int g = 0; g < CHUNK / group_size; ++g) {
        const uint2 pair = {{pair_scale}, __byte_perm(b[g], b[g], 0x1010)};
        *reinterpret_cast<uint2*>(column + (g < 2 ? S_OFF : B_OFF) + (g & 1) * 8) = pair;
      }
    }
"""
_PAIR_SCALE = "__byte_perm(s[g], s[g], 0x1010)"
_OPEN_PAIRED = """
      if (((SUB * sc) & (group_size - 1)) == 0) {
        const int gl = (SUB * sc) >> group_shift;
        const unsigned char* pairs = base + (gl < 2 ? S_OFF : B_OFF) + (gl & 1) * 8;
        #pragma unroll
        for (int t = 0; t < 4; ++t) {
          const uint2 pair = *reinterpret_cast<const uint2*>(pairs + (warp * 32 + 8 * t + gid) * 16);
          s2[t] = pair.x;
          b2[t] = pair.y;
        }
      }
"""


# The lean issue (see LEAN_ISSUE): helpers and edits of the body (old, new).
_LEAN_HELPERS = r"""
// 16 bytes into shared memory at a shared-state-space address (cp.async; the caller
// has checked that every pointer is 16-byte aligned).
DFL_FN void dfl_cp16(uint32_t dst, const unsigned char* src) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" :: "r"(dst), "l"(src) : "memory");
}
"""
_LEAN_ISSUE_OLD = """  auto issue = [&](int c, int buf) {
    unsigned char* base = smem + buf * STAGE_BYTES;
    const unsigned char* w_chunk = w_source + size_t(c) * CW;
    #pragma unroll
    for (int i = 0; i < COLUMNS / W_STEP; ++i) {
      const int cl = int(lid) / W_PIECES + W_STEP * i;
      // Columns past N repeat the last one (never stored).
      const int n = col0 + cl < n_cols ? col0 + cl : n_cols - 1;
      dfl_copy16(base + w_shared + W_STEP * i * SW, w_chunk + size_t(n) * row_bytes, fast);
    }
    const unsigned char* x_chunk = x_source + size_t(c) * CHUNK * 2;
    for (int r = x_first; r < n_rows; r += X_STEP) {
      dfl_copy16(base + x_shared + (r - x_first) * SX, x_chunk + size_t(r) * x_row_bytes, fast);
    }
"""
_LEAN_ISSUE_NEW = """  // Each weight row's source and x's first row, worked out once (columns past N
  // repeat the last one, never stored); shared addresses from one conversion.
  const unsigned char* w_rows[COLUMNS / W_STEP];
  #pragma unroll
  for (int i = 0; i < COLUMNS / W_STEP; ++i) {
    const int cl = int(lid) / W_PIECES + W_STEP * i;
    const int n = col0 + cl < n_cols ? col0 + cl : n_cols - 1;
    w_rows[i] = w_source + size_t(n) * row_bytes;
  }
  const unsigned char* x_rows = x_source + size_t(x_first) * x_row_bytes;
  const size_t x_step = size_t(X_STEP) * x_row_bytes;
  const uint32_t smem_at = dfl_shared_address(smem);
  auto issue = [&](int c, int buf) {
    unsigned char* base = smem + buf * STAGE_BYTES;
    const unsigned char* x_row = x_rows + size_t(c) * CHUNK * 2;
    if (fast) {
      const uint32_t at = smem_at + uint32_t(buf * STAGE_BYTES);
      #pragma unroll
      for (int i = 0; i < COLUMNS / W_STEP; ++i) {
        dfl_cp16(at + w_shared + W_STEP * i * SW, w_rows[i] + size_t(c) * CW);
      }
      // A bound known at compile time, each copy predicated: no loop to set up.
      #pragma unroll
      for (int k = 0; k < (XROWS + X_STEP - 1) / X_STEP; ++k, x_row += x_step) {
        if (x_first + k * X_STEP < n_rows) {
          dfl_cp16(at + x_shared + k * X_STEP * SX, x_row);
        }
      }
    } else {
      #pragma unroll
      for (int i = 0; i < COLUMNS / W_STEP; ++i) {
        dfl_copy_plain(base + w_shared + W_STEP * i * SW, w_rows[i] + size_t(c) * CW, 8);
      }
      for (int r = x_first; r < n_rows; r += X_STEP, x_row += x_step) {
        dfl_copy_plain(base + x_shared + (r - x_first) * SX, x_row, 8);
      }
    }
"""
# The lean issue's edits of the unfilled body: (old, new, once). The ring's slots
# become counters, not divisions by STAGES; the stage base is read in one place or
# more (the paired stage adds its own), every other text occurs once.
_LEAN_EDITS = (
    (_LEAN_ISSUE_OLD, _LEAN_ISSUE_NEW, True),
    (
        "  for (int c = c_begin; c < c_end; ++c) {\n    const int i = c - c_begin;\n",
        "  int read_slot = 0;\n  int write_slot = STAGES - 1;\n"
        "  for (int c = c_begin; c < c_end; ++c) {\n    const int i = c - c_begin;\n"
        "    (void)i;\n",
        True,
    ),
    (
        "      issue(c + STAGES - 1, (i + STAGES - 1) % STAGES);\n",
        "      issue(c + STAGES - 1, write_slot);\n",
        True,
    ),
    ("smem + (i % STAGES) * STAGE_BYTES", "smem + read_slot * STAGE_BYTES", False),
    (
        "{close}\n    }\n  }\n",
        "{close}\n    }\n"
        "    read_slot = read_slot == STAGES - 1 ? 0 : read_slot + 1;\n"
        "    write_slot = write_slot == STAGES - 1 ? 0 : write_slot + 1;\n  }\n",
        True,
    ),
)


def _lean(body: str) -> str:
    """A non-direct form's unfilled body with the lean issue (:data:`LEAN_ISSUE`)."""
    for old, new, once in _LEAN_EDITS:
        found = body.count(old)
        if found == 0 or (once and found != 1):
            raise RuntimeError(f"the matmul body has changed: {old.strip()[:60]}")
        body = body.replace(old, new)
    return body


def _paired(body: str, scales: Optional[str]) -> str:
    """A non-direct form's body with the paired stage (:data:`PAIRED_STAGE`);
    ``scales``: the scale pair's expression where the scales are paired too (None:
    x only)."""
    if body.count(_PAIRED_WAIT) != 1:
        raise RuntimeError("the matmul body has changed: its chunk wait")
    pair_scales = "" if scales is None else _PAIR_SCALES.replace("{pair_scale}", scales)
    body = body.replace(_PAIRED_WAIT, _PAIRED_X.replace("{pair_scales}", pair_scales))
    for old, new in _PAIRED_EDITS:
        body = _replaced(body, old, new)
    return body


# Unit scales (session 53; ``DFLASH_QMM_UNIT_SCALES=1``, read at import; off until a
# device times it): a column's scales and biases copied a unit of chunks at a time
# rather than a chunk at a time. On an H100 the per-chunk copies (one of 8 bytes each
# a column and chunk for groups of 64, at the row's 208-byte stride: a quarter of a
# 32-byte sector, 256 small copies a chunk beside the weights' 1024) cost ~9 us of the
# 16-row fused gate / up's 83, ~2.5 of it their bytes (matmul_variants' noscales).
# Here the copy for chunk c, where c opens a unit (or the CTA's chunk range), takes the
# scales of every chunk of c's unit in the range: 16 bytes (two chunks at groups of 64,
# four at 128, one at 32) where the row's stride keeps them 16-byte aligned, else 8 or
# 4. They land in the scale region of stage slot (c / unit) % STAGES, no longer written
# by the chunks' own copies; a unit's slot is refilled only after its last chunk is
# read (the refill is issued STAGES - 1 chunks ahead, after the barrier that follows
# the reads, and units span at least one chunk). The same scales reach the same
# arithmetic, so the same bits. The scaled 4-bit forms (the shipped ones; nvcc spills
# the unscaled and 8-bit two-row-tile forms with it), not direct; not with the paired
# stage (its scale pairs) or the lean issue (its issue text).
UNIT_SCALES_DEFAULT = False
UNIT_SCALES_ENV = "DFLASH_QMM_UNIT_SCALES"
UNIT_SCALES = _import_switch(UNIT_SCALES_ENV, UNIT_SCALES_DEFAULT)


def unit_scales() -> bool:
    """Whether the affine forms copy their scales a unit of chunks at a time
    (:data:`UNIT_SCALES`, taken at import).

    Raises:
        ValueError: ``DFLASH_QMM_UNIT_SCALES`` is not an on/off word, or it is on with
            the paired stage or the lean issue (their texts do not combine).
    """
    value = _checked_import_switch(UNIT_SCALES_ENV, UNIT_SCALES)
    if value and (paired_stage() or lean_issue()):
        raise ValueError(
            f"{UNIT_SCALES_ENV} does not combine with {PAIRED_STAGE_ENV} or "
            f"{LEAN_ISSUE_ENV}"
        )
    return value


_UNIT_HELPERS = r"""
// bytes (a multiple of 4) from src to dst, in the largest aligned pieces of 16, 8, 4.
DFL_FN void dfl_copy_span(unsigned char* dst, const unsigned char* src, int bytes, bool fast) {
  while (bytes > 0) {
    const int align = int((size_t(dst) | size_t(src)) & size_t(15));
    const int piece = bytes >= 16 && align == 0 ? 16 : bytes >= 8 && (align & 7) == 0 ? 8 : 4;
    dfl_copy_small(dst, src, piece, fast);
    dst += piece;
    src += piece;
    bytes -= piece;
  }
}
"""
_UNIT_ISSUE_SCALES = """
    // Scales and biases of the chunks of c's unit from c on (see UNIT_SCALES), when c
    // opens a unit or the CTA's range: into the unit's slot.
    {
      static_assert(THREADS == COLUMNS, "one thread per column's scales");
      if (c == c_begin || (c & (unit_chunks - 1)) == 0) {
        const int cl = int(lid);
        const int n = col0 + cl < n_cols ? col0 + cl : n_cols - 1;
        const int unit_end = ((c >> unit_shift) + 1) << unit_shift;
        const int bytes = ((unit_end < c_end ? unit_end : c_end) - c) * per_chunk * 2;
        unsigned char* slot = smem + ((c >> unit_shift) % STAGES) * STAGE_BYTES +
                              (c & (unit_chunks - 1)) * per_chunk * 2;
        const size_t e = size_t(n) * size_t(groups_k) + size_t(c) * per_chunk;
        const unsigned char* s_from = reinterpret_cast<const unsigned char*>(scales + e);
        const unsigned char* b_from = reinterpret_cast<const unsigned char*>(biases + e);
        if (bytes == unit_bytes) {  // a whole unit: one aligned copy of each
          dfl_copy_small(slot + S_OFF + cl * 16, s_from, unit_bytes, fast);
          dfl_copy_small(slot + B_OFF + cl * 16, b_from, unit_bytes, fast);
        } else {  // a unit cut by the CTA's range: its chunks' bytes in aligned pieces
          dfl_copy_span(slot + S_OFF + cl * 16, s_from, bytes, fast);
          dfl_copy_span(slot + B_OFF + cl * 16, b_from, bytes, fast);
        }
      }
    }
"""
# The unit's size and the chunk's scales in the loop (old, new).
_UNIT_EDITS = (
    (
        "  (void)per_chunk;\n",
        "  (void)per_chunk;\n"
        "  // Chunks a scale copy covers: 16 bytes of a column's scales where its row's\n"
        "  // stride keeps them aligned, else 8 or 4 (a whole chunk's at least).\n"
        "  int unit_bytes = 16;\n"
        "  while (unit_bytes > per_chunk * 2 && ((2 * groups_k) & (unit_bytes - 1)) != 0) {\n"
        "    unit_bytes >>= 1;\n"
        "  }\n"
        "  const int unit_chunks = unit_bytes / (per_chunk * 2);\n"
        "  const int unit_shift = (unit_chunks >= 2) + (unit_chunks >= 4);  // (1, 2 or 4)\n"
        "  // The slot of the unit being read: (c >> unit_shift) % STAGES, as a counter.\n"
        "  int unit_slot = (c_begin >> unit_shift) % STAGES;\n",
    ),
    (
        "    const unsigned char* base = smem + (i % STAGES) * STAGE_BYTES;\n"
        "    (void)base;\n",
        "    const unsigned char* base = smem + (i % STAGES) * STAGE_BYTES;\n"
        "    (void)base;\n"
        "    if (c != c_begin && (c & (unit_chunks - 1)) == 0) {\n"
        "      unit_slot = unit_slot == STAGES - 1 ? 0 : unit_slot + 1;\n"
        "    }\n"
        "    const unsigned char* sbase = smem + unit_slot * STAGE_BYTES +\n"
        "                                 (c & (unit_chunks - 1)) * per_chunk * 2;\n",
    ),
)


def _unit_scales(body: str) -> str:
    """A filled affine body with :data:`UNIT_SCALES`: the unit's size, and every read
    of a chunk's scales and biases from its unit's slot."""
    for old, new in _UNIT_EDITS:
        body = _replaced(body, old, new)
    reads = body.count("base + S_OFF") + body.count("base + B_OFF")
    if reads < 2:
        raise RuntimeError("the matmul body has changed: no scale reads found")
    return body.replace("base + S_OFF", "sbase + S_OFF").replace(
        "base + B_OFF", "sbase + B_OFF"
    )


# Chunk-major scales (session 54; on, ``DFLASH_QMM_CHUNK_MAJOR_SCALES=0`` turns them off;
# read at import). mlx stores a column's scales as one row, (N, K / group): the copy of
# a chunk's 8 bytes (groups of 64) for 32 columns touches 32 sectors a quarter used.
# Read from a repack, (K / 256, N, 256 / group), a warp's copies are 256 contiguous
# bytes. On an H100 each 4-bit Glimmer call took 1.4-7.8 % less (the 16-row fused gate
# / up 83.0 -> 81.8 us, mlp down 42.6 -> 39.6), same bits; whole 4-bit rounds 2.5-3.4 %
# less device time, our plain token 0.8-1.1 %. The same scales reach the same shared
# memory, so the same bits. The cost is memory: the bind keeps a repacked copy of each
# bound array's scales and biases (1/8 of the 4-bit weights' bytes) while the array
# lives, as mlx's own matmul (prefill, more than 32 rows) reads the originals. The
# scaled 4-bit forms, not direct (8-bit: its two-m-tile cluster form spills with it).
# Unit scales, where on, take the scale copy instead (both set on: refused).
CHUNK_MAJOR_SCALES_DEFAULT = True
CHUNK_MAJOR_SCALES_ENV = "DFLASH_QMM_CHUNK_MAJOR_SCALES"
CHUNK_MAJOR_SCALES = _import_switch(CHUNK_MAJOR_SCALES_ENV, CHUNK_MAJOR_SCALES_DEFAULT)
# The scale copy's element offset, row-major (old) and chunk-major (new).
_CHUNK_MAJOR_ADDRESS = (
    "const size_t e = size_t(n) * size_t(groups_k) + size_t(c) * per_chunk;",
    "const size_t e = (size_t(c) * size_t(n_cols) + size_t(n)) * per_chunk;",
)
# Repacked arrays by id of their source, held while the source lives (_kept_copy).
_CHUNK_MAJOR: dict = {}


def chunk_major_scales() -> bool:
    """Whether the scaled forms read chunk-major scales and biases
    (:data:`CHUNK_MAJOR_SCALES`, taken at import).

    Raises:
        ValueError: ``DFLASH_QMM_CHUNK_MAJOR_SCALES`` is not an on/off word, or it is
            set on beside unit scales (both rewrite the scale copy; by default unit
            scales, where on, take it).
    """
    value = _checked_import_switch(CHUNK_MAJOR_SCALES_ENV, CHUNK_MAJOR_SCALES)
    if value and unit_scales() and backend.env_switch(CHUNK_MAJOR_SCALES_ENV):
        raise ValueError(
            f"{CHUNK_MAJOR_SCALES_ENV} does not combine with {UNIT_SCALES_ENV}"
        )
    return value


def reads_chunk_major(spec: GroupKernelSpec) -> bool:
    """Whether ``spec`` takes its scales and biases chunk-major (see
    :func:`chunk_major`)."""
    return "_cmajor" in spec.base


def _chunk_major_view(values: mx.array, group_size: int) -> mx.array:
    """``values`` (N, K / group) as (K / 256, N, 256 / group), not yet copied.

    Raises:
        ValueError: ``values`` is not 2-D, or its groups do not fill whole chunks.
    """
    per_chunk = Layout(4, 1).chunk // group_size
    if values.ndim != 2 or values.shape[1] % per_chunk:
        raise ValueError(
            f"chunk-major scales take (N, K / group) with whole chunks of "
            f"{per_chunk} groups, got {tuple(values.shape)}"
        )
    columns, groups_k = values.shape
    grouped = values.reshape(columns, groups_k // per_chunk, per_chunk)
    return grouped.transpose(1, 0, 2)


def _kept_copy(
    kept_copies: dict,
    sources: tuple,
    group_size: int,
    make: Callable[[], mx.array],
) -> mx.array:
    """``make()``, made and evaluated once while every one of ``sources`` lives, kept
    in ``kept_copies`` under the first source's id. Under a trace (``mx.compile``) it
    cannot be evaluated: returned unevaluated and not kept (correct, but the trace
    would redo it at each replay)."""
    key = id(sources[0])
    kept = kept_copies.get(key)
    if (
        kept is not None
        and kept[1] == group_size
        and all(ref() is a for ref, a in zip(kept[0], sources))
    ):
        return kept[2]
    made = make()
    try:
        mx.eval(made)
    except ValueError:  # being traced: cannot be kept
        return made

    def forget(ref: weakref.ref) -> None:
        entry = kept_copies.get(key)
        if entry is not None and any(r is ref for r in entry[0]):
            del kept_copies[key]

    refs = tuple(weakref.ref(a, forget) for a in sources)
    kept_copies[key] = (refs, group_size, made)
    return made


def chunk_major(values: mx.array, group_size: int) -> mx.array:
    """A scaled form's chunk-major copy of ``values`` (scales or biases): a chunk's
    groups of every column in turn, made and evaluated once while ``values`` lives
    (see :func:`_kept_copy`).

    Shapes: values ``(N, K / group_size)``; returns ``(K / 256, N, 256 / group_size)``.

    Raises:
        ValueError: ``values`` is not 2-D, or its groups do not fill whole chunks.
    """

    def make() -> mx.array:
        return mx.contiguous(_chunk_major_view(values, group_size))

    return _kept_copy(_CHUNK_MAJOR, (values,), group_size, make)


def forget_chunk_major(arrays: Sequence[mx.array]) -> int:
    """Drop the chunk-major and interleaved copies kept for ``arrays`` (launches
    bound to them keep theirs until they go); returns how many were dropped."""
    dropped = 0
    for values in arrays:
        for kept_copies in (_CHUNK_MAJOR, _INTERLEAVED):
            kept = kept_copies.get(id(values))
            if kept is not None and kept[0][0]() is values:
                del kept_copies[id(values)]
                dropped += 1
    return dropped


# Interleaved scales (session 54; on since session 56, when every matmul `cuda` test
# passed with them on an H100; ``DFLASH_QMM_INTERLEAVED_SCALES=0`` turns them off,
# read at import). Chunk-major scales took about half of what the scale
# copies cost (session 54: the 16-row fused gate / up 83.0 -> 81.8 us, 74.6 with no
# scale copies at all); the rest is two copies a column and chunk. Here a chunk's scales
# and biases of a column lie side by side, (K / 256, N, 2 * 256 / group), and one copy
# (16 bytes at groups of 64, 8 at 128) lands them in the column's scale slot; the
# biases are read from the slot's second half. The same values reach the same
# arithmetic: the same bits. The scaled 4-bit forms of groups of 64 and 128 with
# chunk-major scales (groups of 32 keep them: 32 bytes a column, two copies either
# way); not with the paired stage (its own scale reads) or unit scales, to which the
# default yields (set on explicitly with either, or with chunk-major scales off, the
# bind refuses it). The bind keeps the interleaved copy in place of the two
# chunk-major ones (the same memory).
INTERLEAVED_SCALES_DEFAULT = True
INTERLEAVED_SCALES_ENV = "DFLASH_QMM_INTERLEAVED_SCALES"
INTERLEAVED_SCALES = _import_switch(INTERLEAVED_SCALES_ENV, INTERLEAVED_SCALES_DEFAULT)
INTERLEAVED_GROUP_SIZES = (64, 128)
_INTERLEAVED_ISSUE_SCALES = """
    // A chunk's scales and biases of the column, side by side in the interleaved copy:
    // one copy (16 bytes at groups of 64, 8 at 128) into its scale slot.
    {
      static_assert(THREADS == COLUMNS, "one thread per column's scales");
      const int cl = int(lid);
      const int n = col0 + cl < n_cols ? col0 + cl : n_cols - 1;
      const size_t e = (size_t(c) * size_t(n_cols) + size_t(n)) * (2 * per_chunk);
      dfl_copy_small(base + S_OFF + cl * 16, reinterpret_cast<const unsigned char*>(scales + e),
                     per_chunk * 4, fast);
    }
"""
# The bias read of the interleaved forms: the slot's second half (old, new).
_INTERLEAVED_BIAS = (
    "base + B_OFF + cl * 16 + 2 * gl",
    "base + S_OFF + cl * 16 + 2 * per_chunk + 2 * gl",
)
# Interleaved arrays by id of their scales, held while scales and biases live.
_INTERLEAVED: dict = {}


def interleaved_scales() -> bool:
    """Whether the scaled 4-bit forms of groups of 64 and 128 read interleaved scales
    and biases (:data:`INTERLEAVED_SCALES`, taken at import). The default (on) yields
    to the paired stage, unit scales and chunk-major scales off, as the forms built at
    import do.

    Raises:
        ValueError: ``DFLASH_QMM_INTERLEAVED_SCALES`` is not an on/off word, or it is
            set on with the paired stage, unit scales, or chunk-major scales off.
    """
    value = _checked_import_switch(INTERLEAVED_SCALES_ENV, INTERLEAVED_SCALES)
    if value and (paired_stage() or unit_scales() or not chunk_major_scales()):
        if backend.env_switch(INTERLEAVED_SCALES_ENV):
            raise ValueError(
                f"{INTERLEAVED_SCALES_ENV} needs {CHUNK_MAJOR_SCALES_ENV} on and does "
                f"not combine with {PAIRED_STAGE_ENV} or {UNIT_SCALES_ENV}"
            )
        return False
    return value


def reads_interleaved(spec: GroupKernelSpec) -> bool:
    """Whether ``spec`` takes its scales and biases interleaved (see
    :func:`interleaved`); it is then given the one array for both."""
    return "_ileave" in spec.base


def interleaved(scales: mx.array, biases: mx.array, group_size: int) -> mx.array:
    """The interleaved copy of ``scales`` and ``biases``: a chunk's scales and then its
    biases for every column in turn, made and evaluated once while both live (see
    :func:`_kept_copy`; no chunk-major copies are kept on the way).

    Shapes: scales, biases ``(N, K / group_size)``; returns
    ``(K / 256, N, 2 * 256 / group_size)``.

    Raises:
        ValueError: the two differ in shape, or as :func:`chunk_major`.
    """
    if scales.shape != biases.shape:
        raise ValueError(
            f"interleaved scales take scales and biases of one shape, got "
            f"{tuple(scales.shape)} and {tuple(biases.shape)}"
        )

    def make() -> mx.array:
        views = [_chunk_major_view(a, group_size) for a in (scales, biases)]
        return mx.concatenate(views, axis=2)

    return _kept_copy(_INTERLEAVED, (scales, biases), group_size, make)


def _spec(
    layout: Layout,
    folded: bool = False,
    k_groups: int = 1,
    swiglu: bool = False,
    scaled: bool = False,
    group_size: Optional[int] = None,
    denormal: bool = False,
    in_place: bool = False,
) -> GroupKernelSpec:
    """The matmul kernel of ``layout`` (``folded``: the folded-offset 4-bit form;
    ``k_groups``: warp groups splitting K in a CTA, see :data:`K_GROUPS`; ``swiglu``:
    the gated-MLP activation as its last step, see :data:`SWIGLU_HELPERS`; ``scaled``:
    the scaled-weight form of an affine layout, see :data:`SCALED_B`; ``group_size``:
    an affine kernel for that group size only, a compile-time constant, see
    :func:`_constant_group`; None: any, read from the launch's parameters). A
    ``layout.direct`` layout gives the direct form (:data:`DIRECT_Q4`): scaled 4-bit
    with a constant group size, not SwiGLU. ``denormal``: the scaled 4-bit form with
    the denormal decode (:data:`DENORMAL_Q4`), not direct; ``in_place``: with its nibble
    pairs in place (:data:`DENORMAL_IN_PLACE`)."""
    if k_groups not in (1, 2):
        raise ValueError(f"k_groups must be 1 or 2, got {k_groups}")
    if layout.direct and not (
        layout.bits == 4 and scaled and group_size and not swiglu
    ):
        raise ValueError(
            "the direct form is the scaled 4-bit form with a constant group size, "
            "not SwiGLU"
        )
    if denormal and not (layout.bits == 4 and scaled and not layout.direct):
        raise ValueError("the denormal decode is the scaled 4-bit form's, not direct")
    if in_place and not denormal:
        raise ValueError("the pairs in place are a form of the denormal decode")
    affine = layout.bits != 0
    if folded and layout.bits != 4:
        raise ValueError(f"the folded-offset form is 4-bit only, got {layout.bits}")
    if scaled and (folded or not affine):
        raise ValueError("the scaled-weight form is affine and not folded")
    if group_size is not None and (not affine or group_size not in GROUP_SIZES):
        raise ValueError(f"a constant group size is affine, one of {GROUP_SIZES}")
    lean_bytes = LEAN_BYTES and layout.bits == 8 and not swiglu
    load_b = (_LEAN_BYTES_LOAD if lean_bytes else _LOAD_B[layout.bits]) + (
        _SCALED_LOAD if scaled else ""
    )
    if in_place:
        load_b = _replaced(_replaced(load_b, *_IN_PLACE_LOADS), *_IN_PLACE_FMA)
    if folded:
        load_b = load_b.replace("dfl_q4(", "dfl_q4_offset(")
    if scaled:
        helper = "dfl_q4_denorm" if denormal else _SCALED_Q4_HELPER
        load_b = load_b.replace("dfl_q4(", helper + "(")
    open_scaled = _OPEN_SCALED.replace(*_DENORMAL_SCALE) if denormal else _OPEN_SCALED
    if in_place:
        open_scaled = _replaced(_OPEN_SCALED, *_IN_PLACE_SCALE)
    # (4-bit only: there a thread copies rows r and r + 8 of a tile both.)
    paired = PAIRED_STAGE and not layout.direct and layout.bits == 4
    # (The pairs in place keep their own scale loads: two raised scales a group.)
    pair_scales = paired and scaled and group_size in (64, 128) and not in_place
    if pair_scales:
        open_scaled = _OPEN_PAIRED
    close = _CLOSE_AFFINE if affine else _CLOSE_DENSE
    close = _fill(
        close,
        {
            "bias_of": "dfl_folded_bias" if folded else "",
            "bias_args": ", s, tag" * folded,
        },
    )
    body = merge_body(False) if layout.direct else _BODY
    if paired:
        scale = _PAIR_SCALE
        if denormal:
            scale = f"dfl_denorm_scale({scale}, tag)"
        body = _paired(body, scale if pair_scales else None)
    # (Not 8-bit either: its two-row-tile forms spill with it.)
    lean = LEAN_ISSUE and not layout.direct and layout.bits != 8
    if lean:  # (after the paired stage: its slot arithmetic is made a counter too)
        body = _lean(body)
    # (Scaled 4-bit only: the unscaled and 8-bit two-row-tile forms spill with it.)
    unit = UNIT_SCALES and scaled and layout.bits == 4 and not layout.direct
    unit = unit and not paired and not lean
    # (4-bit only: the 8-bit two-m-tile cluster form spills with it.)
    cmajor = CHUNK_MAJOR_SCALES and scaled and layout.bits == 4 and not layout.direct
    cmajor = cmajor and not unit
    ileave = INTERLEAVED_SCALES and cmajor and group_size in INTERLEAVED_GROUP_SIZES
    ileave = ileave and not paired
    edits = (_SCALED_EDITS if scaled else ()) + (
        _constant_group(group_size) if group_size else ()
    )
    for old, new in edits:
        body = _replaced(body, old, new)
    body = _fill(
        body,
        {
            "issue_scales": (
                (
                    _UNIT_ISSUE_SCALES
                    if unit
                    else (
                        _INTERLEAVED_ISSUE_SCALES
                        if ileave
                        else (
                            _replaced(_ISSUE_SCALES, *_CHUNK_MAJOR_ADDRESS)
                            if cmajor
                            else _ISSUE_SCALES
                        )
                    )
                )
                if affine
                else ""
            ),
            "xsum": (open_scaled if scaled else _XSUM) if affine else "",
            "declare_xs": (
                ((_DECLARE_SCALED if scaled else _DECLARE_XS) if affine else "")
                if not in_place
                else _replaced(_DECLARE_SCALED, *_IN_PLACE_REGISTERS)
            ),
            "close": "" if scaled else close,
            "load_b": load_b,
            "extra_pointers": " | size_t(scales) | size_t(biases)" if affine else "",
            "bits_per_element": layout.bits or 16,
            "mtiles": layout.mtiles,
            "stages": layout.stages,
            "chunk": layout.chunk,
            "sub": SUB,
            "threads": THREADS * k_groups,
            "columns": COLUMNS,
            "column_bytes": layout.column_bytes,
            "w_stride": layout.w_stride,
            "x_stride": layout.x_stride,
            "stage_bytes": layout.stage_bytes,
        },
    )
    if unit:
        body = _unit_scales(body)
    if ileave:  # (every bias read: the scaled forms read them in one place)
        body = _replaced(body, *_INTERLEAVED_BIAS)
    if layout.direct:
        halves = {"halves": 1 if k_groups == 2 else 2}
        for old, new in _DIRECT_EDITS:
            old = _fill(old, {"w_stride": layout.w_stride})
            body = _replaced(body, old, _fill(new, halves))
    if k_groups == 2:
        body = _two_k_groups(body, affine)
    if swiglu:
        body = _swiglu(body)
    name = f"tensor_{'dense' if not affine else f'q{layout.bits}'}_m{layout.mtiles}"
    name += "_folded" * folded + "_scaled" * scaled
    name += f"_g{group_size}" if group_size else ""
    name += "_k2" * (k_groups == 2) + "_swiglu" * swiglu + "_direct" * layout.direct
    name += "_denorm" * denormal + "_inplace" * in_place + "_unit" * unit
    name += "_ileave" if ileave else "_cmajor" * cmajor
    name += "_lbytes" * lean_bytes
    if affine:
        inputs = ("x", "weight", "scales", "biases", "params", "counters")
        types = ("T", "uint32", "T", "T", "int32", "int32")
    else:
        inputs = ("x", "weight", "params", "counters")
        types = ("T", "T", "int32", "int32")
    return GroupKernelSpec(
        base=name,
        input_names=inputs,
        input_types=types,
        output_names=("y", "partial"),
        output_types=("T", "float32"),
        helpers=(launch_bounds(THREADS * k_groups) if scaled else "")
        + _HELPERS
        + (_FOLDED_HELPERS if folded else "")
        + (_SCALED_HELPERS if scaled else "")
        + (_DIRECT_HELPERS if layout.direct else "")
        + (_PAIRED_HELPERS if paired else "")
        + (_LEAN_HELPERS if lean else "")
        + (_LEAN_BYTES_HELPERS if lean_bytes else "")
        + (_UNIT_HELPERS if unit else "")
        + (_DENORMAL_HELPERS if denormal and not in_place else "")
        + (_IN_PLACE_HELPERS if in_place else "")
        + (SWIGLU_HELPERS if swiglu else ""),
        body=body,
        threads=THREADS * k_groups,
        backends=(CUDA,),
        shared_memory=layout.shared_memory,
        dtypes=(mx.bfloat16, mx.float16),
    )


# The two-K-group form as edits of the one-group text (which stays as the H200 ran it),
# each with the forms it applies to ("affine", "dense" or both).
_K2_EDITS = (
    # Scales: still one thread per column (the first 128 threads).
    (
        """    {
      static_assert(THREADS == COLUMNS, "one thread per column's scales");
""",
        """    if (int(lid) < COLUMNS) {
""",
        ("affine",),
    ),
    # Warp w covers columns 32 (w % 4) .. and K group w / 4.
    (
        "  const int warp = int(lid) / 32;\n",
        "  const int warp = (int(lid) / 32) % 4;\n  const int kgroup = int(lid) / 128;\n",
        ("affine", "dense"),
    ),
    # Each group takes its half of a chunk's sub-chunks (group boundaries: a group
    # of K is 32, 64 or 128 elements, a half chunk 128 (affine) or 32 (dense)).
    (
        "    for (int sc = 0; sc < SUBS; ++sc) {\n",
        "    for (int half_sc = 0; half_sc < SUBS / 2; ++half_sc) {\n"
        "      const int sc = kgroup * (SUBS / 2) + half_sc;\n",
        ("affine", "dense"),
    ),
    # Dense closes per chunk: each group at the end of its half.
    (
        "      if (sc == SUBS - 1) {\n",
        "      if (half_sc == SUBS / 2 - 1) {\n",
        ("dense",),
    ),
    # The second group's sums join the first's, in that order, once.
    (
        "  // c0, c1: row gid, columns 2 tig, 2 tig + 1; c2, c3: row gid + 8.\n",
        """  dfl_wait<0>();
  DFL_BARRIER();
  {
    float* exchange = reinterpret_cast<float*>(smem) + (int(lid) % 128) * (MT * 16);
    #pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
      #pragma unroll
      for (int t = 0; t < 4; ++t) {
        #pragma unroll
        for (int i = 0; i < 4; ++i) {
          if (kgroup == 1) {
            exchange[16 * mt + 4 * t + i] = acc[mt][t][i];
          }
        }
      }
    }
    DFL_BARRIER();
    #pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
      #pragma unroll
      for (int t = 0; t < 4; ++t) {
        #pragma unroll
        for (int i = 0; i < 4; ++i) {
          acc[mt][t][i] = __fadd_rn(acc[mt][t][i], exchange[16 * mt + 4 * t + i]);
        }
      }
    }
  }
  // c0, c1: row gid, columns 2 tig, 2 tig + 1; c2, c3: row gid + 8.
""",
        ("affine", "dense"),
    ),
    (
        "        if (r < n_rows && n < n_cols) {\n",
        "        if (kgroup == 0 && r < n_rows && n < n_cols) {\n",
        ("affine", "dense"),
    ),
)


# The gated MLP's activation as the fused gate / up launch's last step (the SwiGLU
# form): column tile t reads gate columns [64 t, 64 t + 64) and the up columns
# N / 2 + the same (the member-major stack [gate; up], N a multiple of 128), stages
# their T results in shared memory and stores ``silu(gate) * up`` as ``(rows, N / 2)``.
# On CUDA the sigmoid is mlx's own functor (the header its JIT hands over) and both
# products are ``T * T``: the bits of mlx's ``nn.silu`` (its compiled kernel keeps
# each step in T) then ``*``. Elsewhere (the CPU emulation) a float32 formula.
SWIGLU_HELPERS = """
#ifdef __CUDACC__
#include "mlx/backend/cuda/device/unary_ops.cuh"
#define DFL_SWIGLU(g, u) (((g) * ::mlx::core::cu::Sigmoid{}(g)) * (u))
#else
DFL_FN float dfl_swiglu_sigmoid(float x) {
  const float y = 1.0f / (1.0f + exp(fabs(x)));
  return x < 0.0f ? y : 1.0f - y;
}
#define DFL_SWIGLU(g, u) \\
  T(float(T(float(g) * float(T(dfl_swiglu_sigmoid(float(g)))))) * float(u))
#endif
"""
_SWIGLU_PASS = """
    for (int p = int(lid); p < n_rows * (COLUMNS / 2); p += THREADS) {
      const int r = p / (COLUMNS / 2);
      const int j = p % (COLUMNS / 2);
      const T g = dfl_stage[r * COLUMNS + j];
      const T u = dfl_stage[r * COLUMNS + COLUMNS / 2 + j];
      y[size_t(r) * size_t(n_cols / 2) + size_t(col0 / 2 + j)] = DFL_SWIGLU(g, u);
    }
"""
# Edits of a form's text (one or two K groups) into its SwiGLU form: (old, new, count);
# count None: one or more, 0: none or one.
_SWIGLU_EDITS = (
    # Tile t's first half is gate columns, its second half the matching up columns.
    (
        "const int n = col0 + cl < n_cols ? col0 + cl : n_cols - 1;",
        "const int n = (cl < COLUMNS / 2 ? 0 : n_cols / 2 - COLUMNS / 2) + col0 / 2 + cl;",
        None,
    ),
    # The stage lies past the two-group exchange; every warp is done with the stages.
    (
        "  // c0, c1: row gid, columns 2 tig, 2 tig + 1; c2, c3: row gid + 8.\n",
        "  T* dfl_stage = reinterpret_cast<T*>(smem + 128 * MT * 16 * 4);\n"
        "  dfl_wait<0>();\n"
        "  DFL_BARRIER();\n"
        "  // c0, c1: row gid, columns 2 tig, 2 tig + 1; c2, c3: row gid + 8.\n",
        1,
    ),
    (
        "            y[out_base + size_t(r) * out_width + (n - out_lo)] = T(acc[mt][t][i]);\n",
        "            dfl_stage[r * COLUMNS + (n - col0)] = T(acc[mt][t][i]);\n",
        1,
    ),
    (
        "  if (splits > 1 && merged) {\n",
        "  if (splits == 1) {\n    DFL_BARRIER();\n" + _SWIGLU_PASS + "  }\n"
        "  if (splits > 1 && merged) {\n",
        1,
    ),
    # The merge's sums go to the stage (either path), and the pass follows it.
    (
        "y[out_base + size_t(p / COLUMNS) * out_width + (n - out_lo)] = T(sum);\n",
        "dfl_stage[p] = T(sum);\n",
        1,
    ),
    (  # the vector merge's store (0: the merge before it)
        "y[out_base + size_t(r) * out_width + (n + j - out_lo)] = T(sum);\n",
        "dfl_stage[r * COLUMNS + (n + j - col0)] = T(sum);\n",
        0,
    ),
    (
        "      // Dead (each launch's counters are fresh)",
        "      DFL_BARRIER();\n"
        + _SWIGLU_PASS
        + "      // Dead (each launch's counters are fresh)",
        1,
    ),
)


def _swiglu(body: str) -> str:
    """A matmul body (either K-group form) as its SwiGLU form (:data:`SWIGLU_HELPERS`)."""
    for old, new, count in _SWIGLU_EDITS:
        found = body.count(old)
        if (found == 0 and count != 0) or (count and found != count):
            raise RuntimeError(f"the matmul body has changed: {old.strip()[:60]}")
        body = body.replace(old, new)
    return body


# The head prep as the fused q / k / v / gate launch's last step (the prepared form,
# session 79, opt-in: :func:`prepared_heads`; not run on a GPU yet): the launch that
# writes a column tile (one head: the head dim is COLUMNS) stages its T results in
# shared memory, as the SwiGLU form does, and then prepares them as
# ``dflash.metal.heads``' head prep would from the same T values, step for step (a
# warp a row: lane v sums vector v's squares in mlx's order, the warp's xor butterfly
# adds them as mlx's halving tree does, then each lane makes its four elements, the
# pairs ``i`` and ``i + 64`` of RoPE among them): the queries normed, weighted, scaled
# and rotated in place (token-major, ``(B, S, Hq, D)``), the keys likewise and the
# values as they are, both head-major, so the k and v members' blocks together are the
# stacked ``(2, B, Hkv, S, D)`` block a KV plane stores; the gate as it is. One
# launch a layer less (session 77's budget: 280 us of an H100's 4-bit forward).
# Members: q, k, v, gate (three edges). Extra inputs: the head prep's integer and
# float scalars (``heads.head_prep_ints`` / its float scalars: seq [5], start [6],
# flags [7]; q_eps, k_eps, q_scale, k_scale, log2 base, rope scale) and the q / k
# norms' weights.
PREPARED_HEADS_DEFAULT = False
PREPARED_HEADS_ENV = "DFLASH_QMM_PREPARED_HEADS"
PREPARED_SUFFIX = "_hprep"
PREPARED_INPUTS = ("hparams", "hfparams", "q_weight", "k_weight")
PREPARED_INPUT_TYPES = ("int32", "float32", "T", "T")
# Elements of a 16-byte vector (mlx's RMS-norm read; T is a 16-bit type here).
_PREP_VECTOR = 8
_PREPARED_PASS = """
    {
      const int hp_seq = hparams[5];
      const int hp_start = hparams[6];
      const int hp_flags = hparams[7];
      int hp_member = 0;
      for (int j = 0; j < params[9]; ++j) {
        hp_member += params[10 + j] <= col0 ? 1 : 0;
      }
      const bool hp_normed = hp_member < 2;
      const bool hp_is_q = hp_member == 0;
      const bool hp_head_major = hp_member == 1 || hp_member == 2;
      const int hp_head = (col0 - out_lo) / COLUMNS;
      const int hp_heads = out_width / COLUMNS;
      const bool hp_weighted = (hp_flags & (hp_is_q ? 1 : 2)) != 0;
      const float hp_eps = hp_is_q ? hfparams[0] : hfparams[1];
      const T hp_scale = T(hp_is_q ? hfparams[2] : hfparams[3]);
      const T* hp_weight = hp_is_q ? q_weight : k_weight;
      constexpr int HP_VEC = {vector};
      constexpr int HP_PAIRS = COLUMNS / 2;
      for (int r = {first} + (int(lid) / 32) * {step}; r < n_rows; r += (THREADS / 32) * {step}) {
        const T* hp_row = {stage} + r * COLUMNS;
        float hp_normalizer = 0.0f;
        if (hp_normed) {
          // Sum of squares as mlx's RMS norm cuts a head: lane v sums vector v in order
          // with fused multiply-adds (lanes past the head's 16 vectors: +0), then the
          // warp's xor butterfly. Lane i < m adds lane i + m's sum: the halving tree's
          // very adds, so every lane ends with the tree's sum (operands swapped at
          // most: the same bits).
          static_assert(COLUMNS / HP_VEC == 16, "a head is 16 vectors");
          float total = 0.0f;
          if (int(lid) % 32 < 16) {
            #pragma unroll
            for (int j = 0; j < HP_VEC; ++j) {
              const float t = float(hp_row[(int(lid) % 32) * HP_VEC + j]);
              total = DFL_FMA(t, t, total);
            }
          }
          #pragma unroll
          for (int m = 16; m > 0; m /= 2) {
            total = total + __shfl_xor_sync(0xffffffffu, total, m);
          }
          hp_normalizer = rsqrtf(total / float(COLUMNS) + hp_eps);
        }
        const int hp_token = r % hp_seq;
        const size_t hp_at = hp_head_major
            ? out_base + (size_t((r / hp_seq) * hp_heads + hp_head) * size_t(hp_seq) +
                          size_t(hp_token)) * COLUMNS
            : out_base + size_t(r) * out_width + size_t(col0 - out_lo);
        #pragma unroll
        for (int k = 0; k < 2; ++k) {
          const int i = int(lid) % 32 + 32 * k;
          float hp_x[2];
          #pragma unroll
          for (int h = 0; h < 2; ++h) {
            const int e = i + HP_PAIRS * h;
            float value = float(hp_row[e]);
            if (hp_normed) {
              T normed = T(value * hp_normalizer);
              if (hp_weighted) {
                normed = T(float(hp_weight[e]) * float(normed));
              }
              normed = T(float(normed) * float(hp_scale));
              value = float(normed);
            }
            hp_x[h] = value;
          }
          float first = hp_x[0];
          float second = hp_x[1];
          if (hp_normed && (hp_flags & 4) != 0) {
            const float d = float(i) / float(HP_PAIRS);
            const float inv_freq = exp2f(-d * hfparams[4]);
            const float at = hfparams[5] * float(hp_start + hp_token);
            const float theta = at * inv_freq;
            const float costheta = cosf(theta);
            const float sintheta = sinf(theta);
            const float x1 = hp_x[0];
            const float x2 = hp_x[1];
            first = x1 * costheta - x2 * sintheta;
            second = x1 * sintheta + x2 * costheta;
          }
          if (col0 + i < n_cols) {
            y[hp_at + i] = T(first);
          }
          if (col0 + i + HP_PAIRS < n_cols) {
            y[hp_at + i + HP_PAIRS] = T(second);
          }
        }
      }
    }
"""
_STAGE_OFFSET = "128 * MT * 16 * 4"


def _prepared_pass(stage: str, first: str, step: str) -> str:
    return _fill(
        _PREPARED_PASS,
        {"vector": _PREP_VECTOR, "stage": stage, "first": first, "step": step},
    )


# Edits of a form's text (one or two K groups, no cluster) into its prepared form: the
# SwiGLU form's staging (its results to a T stage past the two-group exchange), then
# the pass where the SwiGLU form runs its own.
def _prepared_edits() -> tuple:
    whole = _prepared_pass("dfl_stage", "0", "1")
    edits = []
    for old, new, count in _SWIGLU_EDITS[1:]:
        new = new.replace(_SWIGLU_PASS, whole)
        edits.append((old, new, count))
    return tuple(edits)


# The cluster sum's loop (each CTA its share of the tile's outputs) as the prepared
# form's: each CTA sums whole rows (rows split, split + CLUSTER, ...) into a T stage of
# its own past its partial (which the other CTAs read until the last cluster barrier),
# then prepares them.
_CLUSTER_LOOP_OLD = (
    "    for (int p = split * THREADS + int(lid); p < n_rows * COLUMNS; "
    "p += CLUSTER * THREADS) {\n"
)
_CLUSTER_LOOP_END = (
    "    // No CTA leaves while another may still read its shared memory.\n"
)
# A cluster sum's output ``e`` of a row's partials, over the ranks in split order (the
# merge's arithmetic), read where they lie (``parts``: each rank's partial, mapped).
_CLUSTER_OUTPUT_SUM = """        float v[CLUSTER];
        #pragma unroll
        for (int k = 0; k < CLUSTER; ++k) {
          v[k] = parts[k][e];
        }
        float sum = v[0];
        #pragma unroll
        for (int k = 1; k < CLUSTER; ++k) {
          sum = __fadd_rn(sum, v[k]);
        }
"""
_CLUSTER_PREPARED = (
    """    T* dfl_hp_stage = reinterpret_cast<T*>(smem + {stage_offset} + XROWS * PART * 4);
    for (int p = int(lid); p < n_rows * COLUMNS; p += THREADS) {
      const int r = p / COLUMNS;
      const int c = p % COLUMNS;
      if (r % CLUSTER == split && col0 + c < n_cols) {
        const int e = r * PART + c;
"""
    + _CLUSTER_OUTPUT_SUM
    + """        dfl_hp_stage[r * COLUMNS + c] = T(sum);
      }
    }
    DFL_BARRIER();
{pass}"""
)


def prepared_heads() -> bool:
    """Whether the traced layers take the fused q / k / v / gate launch's prepared form
    where it serves (the head prep in that launch, see :func:`prepared_spec`):
    ``DFLASH_QMM_PREPARED_HEADS`` when set, else off. Read when a layer's
    pre-attention trace is made.

    Raises:
        ValueError: ``DFLASH_QMM_PREPARED_HEADS`` is not an on/off word.
    """
    return backend.strict_switch(PREPARED_HEADS_ENV, None, PREPARED_HEADS_DEFAULT)


def prepared_serves(spec: GroupKernelSpec) -> bool:
    """Whether a matmul form has a prepared form (:func:`prepared_spec`): a 4-bit or
    dense matmul of one m-tile (up to 16 rows: a verify block), plain or scaled (one
    or two K groups), not SwiGLU, persistent, carrying prefetch CTAs or already
    prepared. Not 8-bit, direct (opt-in) nor two m-tiles: with the pass some of their
    two-K-group forms spill (4-20 bytes) at their 128-register bound."""
    return (
        spec.base.startswith("tensor_")
        and not spec.base.startswith("tensor_q8")
        and "_direct" not in spec.base
        and "constexpr int MT = 1;" in spec.body
        and spec.output_names == ("y", "partial")
        and "dfl_stage" not in spec.body
        and PREPARED_SUFFIX not in spec.base
        and not spec.base.endswith(PERSISTENT_SUFFIX)
        and "prefetch" not in spec.input_names
        and spec.dtypes
        and all(dtype in DTYPES for dtype in spec.dtypes)
    )


@functools.lru_cache(maxsize=None)
def prepared_spec(spec: GroupKernelSpec) -> GroupKernelSpec:
    """The prepared form of a matmul spec (see :func:`prepared_heads`): its launch takes
    :data:`PREPARED_INPUTS` after its own and leaves the q / k / v / gate members
    prepared for the attention. ``spec`` may be a cluster-sum form
    (:func:`cluster_spec`).

    Raises:
        ValueError: a form without a prepared form (:func:`prepared_serves`), or one
            whose shared memory cannot hold the stage.
    """
    if not prepared_serves(spec):
        raise ValueError(f"{spec.base} has no prepared-heads form")
    mtiles = 2 if "constexpr int MT = 2;" in spec.body else 1
    stage = 16 * mtiles * COLUMNS * 2
    needed = 128 * mtiles * 16 * 4 + stage
    body = spec.body
    if spec.cluster > 1:
        needed += 16 * mtiles * PART_STRIDE * 4
        start = body.index(_CLUSTER_LOOP_OLD)
        stop = body.index(_CLUSTER_LOOP_END)
        pass_text = _prepared_pass("dfl_hp_stage", "split", "CLUSTER")
        body = (
            body[:start]
            + _fill(
                _CLUSTER_PREPARED, {"stage_offset": _STAGE_OFFSET, "pass": pass_text}
            )
            + body[stop:]
        )
    else:
        for old, new, count in _prepared_edits():
            found = body.count(old)
            if (found == 0 and count != 0) or (count and found != count):
                raise RuntimeError(f"the matmul body has changed: {old.strip()[:60]}")
            body = body.replace(old, new)
    if spec.shared_memory < needed:
        raise ValueError(f"{spec.base}: {spec.shared_memory} bytes of shared memory, "
                         f"the prepared form needs {needed}")  # fmt: skip
    return dataclasses.replace(
        spec,
        base=spec.base + PREPARED_SUFFIX,
        input_names=spec.input_names + PREPARED_INPUTS,
        input_types=spec.input_types + PREPARED_INPUT_TYPES,
        body=body,
    )


def _two_k_groups(body: str, affine: bool) -> str:
    """The body with K split between two warp groups of a CTA (see :data:`K_GROUPS`)."""
    form = "affine" if affine else "dense"
    for old, new, forms in _K2_EDITS:
        if form not in forms:
            continue
        body = _replaced(body, old, new)
    return body


_MERGE_TAIL = "  if (splits > 1 && merged) {\n"
_MERGE_TAILS = tuple(
    body[body.index(_MERGE_TAIL) :] for body in (merge_body(True), merge_body(False))
)
# A matmul form's text (one or two K groups, not SwiGLU) as its cluster-sum form (see
# :data:`CLUSTER_SUM`): (old, new). ``{cluster}`` is the cluster's size.
_CLUSTER_EDITS = (
    # A column tile's splits are consecutive CTAs: one cluster, rank = split.
    (
        "  const int tile = int(group) % col_tiles;\n"
        "  const int split = int(group) / col_tiles;\n",
        "  const int tile = int(group) / splits;\n"
        "  const int split = int(group) % splits;\n"
        "  (void)col_tiles;\n",
    ),
    # The split's partial stays in shared memory, past the two-group exchange (every
    # warp is done with the stages).
    (
        "  // c0, c1: row gid, columns 2 tig, 2 tig + 1; c2, c3: row gid + 8.\n",
        "  constexpr int CLUSTER = {cluster};\n"
        "  constexpr int PART = {part_stride};\n"
        "  float* dfl_part = reinterpret_cast<float*>(smem + 128 * MT * 16 * 4);\n"
        "{settle}"
        "  // c0, c1: row gid, columns 2 tig, 2 tig + 1; c2, c3: row gid + 8.\n",
    ),
    (
        "            partial[(size_t(split) * n_rows + r) * n_cols + n] = acc[mt][t][i];\n",
        "            dfl_part[r * PART + (n - col0)] = acc[mt][t][i];\n",
    ),
    (
        _MERGE_TAIL,  # from the merge's test to the body's end, whichever merge
        r"""  if (splits > 1) {
    // Each CTA sums its share of the tile's outputs over the cluster's partials in
    // split order (the merge's arithmetic, so its bits), reading them where they lie.
    dfl_cluster_sync();
    const float* parts[CLUSTER];
    #pragma unroll
    for (int k = 0; k < CLUSTER; ++k) {
      parts[k] = dfl_cluster_map(dfl_part, k);
    }
    for (int p = split * THREADS + int(lid); p < n_rows * COLUMNS; p += CLUSTER * THREADS) {
      const int n = col0 + p % COLUMNS;
      if (n < n_cols) {
        const int e = (p / COLUMNS) * PART + p % COLUMNS;
"""
        + _CLUSTER_OUTPUT_SUM
        + r"""        y[out_base + size_t(p / COLUMNS) * out_width + (n - out_lo)] = T(sum);
      }
    }
    // No CTA leaves while another may still read its shared memory.
    dfl_cluster_sync();
  }
  (void)merged;
""",
    ),
)


def _cluster_sum(body: str, cluster: int) -> str:
    """A matmul body (either K-group form, not SwiGLU) as its cluster-sum form for
    clusters of ``cluster`` CTAs (see :data:`CLUSTER_SUM`)."""
    # The two-group form has waited for its copies and met at a barrier already.
    settled = "float* exchange" in body
    values = {
        "cluster": cluster,
        "part_stride": PART_STRIDE,
        "settle": "" if settled else "  dfl_wait<0>();\n  DFL_BARRIER();\n",
    }
    for old, new in _CLUSTER_EDITS:
        if old is _MERGE_TAIL:  # the merge of either text, to the body's end
            old = next((t for t in _MERGE_TAILS if body.endswith(t)), _MERGE_TAILS[0])
        body = _replaced(body, old, _fill(new, values))
    return body


@functools.lru_cache(maxsize=None)
def cluster_spec(spec: GroupKernelSpec, cluster: int) -> GroupKernelSpec:
    """The cluster-sum form of a matmul spec (not SwiGLU) for a K split of ``cluster``
    ways, 2 to :data:`MAX_CLUSTER` (see :data:`CLUSTER_SUM`): the same arithmetic and
    bits, one cluster per column tile.

    Raises:
        ValueError: ``cluster`` outside 2 .. MAX_CLUSTER, or a spec whose shared
            memory cannot hold the exchange and a 32-row partial.
    """
    if not 2 <= cluster <= MAX_CLUSTER:
        raise ValueError(f"a cluster holds 2 to {MAX_CLUSTER} CTAs, got {cluster}")
    mtiles = 2 if "constexpr int MT = 2;" in spec.body else 1
    needed = 128 * mtiles * 16 * 4 + 16 * mtiles * PART_STRIDE * 4
    if spec.shared_memory < needed:
        raise ValueError(f"{spec.base}: {spec.shared_memory} bytes of shared memory, "
                         f"the cluster sum needs {needed}")  # fmt: skip
    # The cluster attribute joins the launch bounds' redefinition of ``__global__``
    # where the form has one (see LAUNCH_BOUNDS), else a redefinition of its own.
    bounds = launch_bounds(spec.threads)
    helpers = spec.helpers
    if helpers.startswith(bounds):
        helpers = helpers[len(bounds) :]
    else:
        bounds = "\n#undef __global__\n#define __global__ __attribute__((global))\n"
    attributes = bounds.rstrip("\n") + f" __cluster_dims__({cluster}, 1, 1)\n"
    return dataclasses.replace(
        spec,
        base=f"{spec.base}_c{cluster}",
        helpers=attributes + helpers + CLUSTER_HELPERS,
        body=_cluster_sum(spec.body, cluster),
        cluster=cluster,
    )


# The persistent form (``DFLASH_QMM_PERSISTENT=1``, read at each bind; off): a call of
# more (column tile, K split) items than :data:`RESIDENT_CTAS` launches that many CTAs,
# and each takes items ``group``, ``group + grid``, ... (the plain form's CTA numbering).
# A CTA's chunks, item after item, are one stream through the stage ring, so the next
# item's first chunks are in flight while an item's epilogue runs (the two K groups'
# exchange, the stores, the fence, the counter and the last CTA's merge: 6-7 us a wave
# at 16 rows, session 41), where the plain form's next CTA starts its copies only once
# an SM has room for it. Each item's sums are the plain form's, in its order, over the
# same split: the same bits. The epilogue's shared scratch (the exchange and the
# merge's flag) is the slot of the item's last chunk, the one slot that no copy in
# flight targets. Two K groups, scaled or dense weights (:func:`persistent_serves`).
# Session 56 (an H100): the plain form's bits, but the fused gate / up 13-15 % slower
# (16 rows 76.6 -> 88.4 us), the LM head within 1 %: the CTA scheduler already overlaps
# one CTA's epilogue with the next CTA's copies, and the item stream costs instructions
# at every chunk (the copy issue 244 -> 320, static). Off, kept as the measured try.
PERSISTENT = False
PERSISTENT_ENV = "DFLASH_QMM_PERSISTENT"
PERSISTENT_SUFFIX = "_persist"
# Bytes of the scratch slot past the two K groups' exchange: the merge's flag.
_FLAG_BYTES = 16


def persistent() -> bool:
    """Whether a call bound now takes the persistent form where it has more items than
    resident CTAs (see :data:`PERSISTENT`): ``DFLASH_QMM_PERSISTENT`` when set, else
    the default.

    Raises:
        ValueError: ``DFLASH_QMM_PERSISTENT`` is not an on/off word.
    """
    return backend.strict_switch(PERSISTENT_ENV, None, PERSISTENT)


def exchange_bytes(mtiles: int) -> int:
    """Shared bytes the two K groups' exchange takes (128 threads' sums of ``mtiles``
    m-tiles, 16 floats each)."""
    return 128 * mtiles * 16 * 4


# The item block: the column tile's output edges, cut from the kernel's head into the
# item's epilogue.
_ITEM_FIRST = "  const int col0 = tile * COLUMNS;\n"
_ITEM_LAST = "  const int out_width = out_hi - out_lo;\n"
_PERSISTENT_HEAD = (
    """  const int tile = int(group) % col_tiles;
  const int split = int(group) / col_tiles;
  const int chunks = depth / CHUNK;
  const int c_begin = split * per_split;
  const int c_end = c_begin + per_split < chunks ? c_begin + per_split : chunks;
""",
    """  const int chunks = depth / CHUNK;
  // Items (column tile, K split) group, group + grid, ...: item = split * col_tiles +
  // tile, the plain form's CTA numbering.
  const int items = col_tiles * splits;
  const int grid = params[10 + params[9]];
""",
)
_PERSISTENT_ISSUE = (
    "  auto issue = [&](int c, int buf) {\n",
    "  auto issue = [&](int col0, int c, int buf) {\n",
)
# The plain chunk loop's head (the prologue's fills to the refill's commit), as the
# body has it, and the persistent form's in its place.
_PERSISTENT_LOOP = (
    _BODY[
        _BODY.index("  for (int i = 0; i < STAGES - 1; ++i) {\n") : _BODY.index(
            "    const unsigned char* base = smem + (i % STAGES) * STAGE_BYTES;\n"
        )
    ],
    """  // The CTA's chunks, item after item, as one stream through the ring: the next
  // item's first chunks are in flight during an item's epilogue.
  // (The cursor's divisions run once an item, not once a chunk.)
  int next_item = int(group);
  int next_c = 0;
  int next_end = 0;
  int next_col0 = 0;
  auto open_next = [&]() {
    next_c = (next_item / col_tiles) * per_split;
    next_end = next_c + per_split < chunks ? next_c + per_split : chunks;
    next_col0 = (next_item % col_tiles) * COLUMNS;
  };
  open_next();
  auto issue_next = [&](int buf) {
    if (next_item < items) {
      issue(next_col0, next_c, buf);
      if (++next_c == next_end) {
        next_item += grid;
        open_next();
      }
    }
  };
  for (int i = 0; i < STAGES - 1; ++i) {
    issue_next(i);
    dfl_commit();
  }
  int consumed = 0;
  for (int item = int(group); item < items; item += grid) {
  const int c_begin = (item / col_tiles) * per_split;
  const int c_end = c_begin + per_split < chunks ? c_begin + per_split : chunks;
  #pragma unroll
  for (int mt = 0; mt < MT; ++mt) {
    #pragma unroll
    for (int t = 0; t < 4; ++t) {
      #pragma unroll
      for (int i = 0; i < 4; ++i) {
        acc[mt][t][i] = 0.0f;
      }
    }
  }
  for (int c = c_begin; c < c_end; ++c, ++consumed) {
    const int i = consumed;
    dfl_wait<STAGES - 2>();
    DFL_BARRIER();
    // The buffer refilled here was read in the previous round (all threads are past it).
    issue_next((i + STAGES - 1) % STAGES);
    dfl_commit();
""",
)
# The item's epilogue: its column tile's output edges (worked out here, not held
# through the chunk loop), and the slot of its last chunk (no copy in flight targets
# it) as scratch.
_SCRATCH = (
    "  const int tile = item % col_tiles;\n"
    "  const int split = item / col_tiles;\n"
    "{item_block}"
    "  unsigned char* scratch = smem + ((consumed + STAGES - 1) % STAGES) * STAGE_BYTES;\n"
)
# Every warp is past the last chunk's reads before the exchange writes the slot.
_PERSISTENT_EXCHANGE = (
    "  dfl_wait<0>();\n  DFL_BARRIER();\n  {\n"
    "    float* exchange = reinterpret_cast<float*>(smem)",
    _SCRATCH
    + "  DFL_BARRIER();\n  {\n    float* exchange = reinterpret_cast<float*>(scratch)",
)
_PERSISTENT_FLAG = (
    "    int* last = reinterpret_cast<int*>(smem);\n",
    "    int* last = reinterpret_cast<int*>(scratch + {exchange});\n",
)


def _persistent(body: str, mtiles: int) -> str:
    """A two-K-group matmul body (either merge) as its persistent form (see
    :data:`PERSISTENT`).

    Raises:
        RuntimeError: The body lacks a text the edits rewrite (a form they do not take).
    """
    start, end = body.find(_ITEM_FIRST), body.find(_ITEM_LAST)
    if start < 0 or end < start:
        raise RuntimeError("the matmul body has changed: its column tile's edges")
    item_block = body[start : end + len(_ITEM_LAST)]
    body = body[:start] + body[end + len(_ITEM_LAST) :]
    body = _replaced(body, *_PERSISTENT_HEAD)
    body = _replaced(body, *_PERSISTENT_ISSUE)
    body = _replaced(body, *_PERSISTENT_LOOP)
    old, new = _PERSISTENT_EXCHANGE
    body = _replaced(body, old, new.replace("{item_block}", item_block))
    flag = _PERSISTENT_FLAG[1].replace("{exchange}", str(exchange_bytes(mtiles)))
    body = _replaced(body, _PERSISTENT_FLAG[0], flag)
    return body + "  }\n  dfl_wait<0>();\n"


def persistent_serves(spec: GroupKernelSpec) -> bool:
    """Whether ``spec`` has a persistent form (:func:`persistent_spec`): the two-K-group
    scaled and dense forms (the ones the default switches bind; by nvcc, theirs keep
    within 128 registers with no spills, where some one-group and unscaled two-m-tile
    forms spill), not SwiGLU, direct or unit scales, nor with the paired stage or the
    lean issue."""
    refused = ("_swiglu", "_direct", "_unit")
    # (Already persistent; the paired stage's loads; the lean issue's slots.)
    texts = ("issue_next", "dfl_interleaved_load", "write_slot")
    kind = "_scaled" in spec.base or spec.base.startswith("tensor_dense")
    return (
        spec.base.startswith("tensor_")
        and "_k2" in spec.base
        and kind
        and not any(part in spec.base for part in refused)
        and spec.cluster == 1
        and not any(text in spec.body for text in texts)
        and _ITEM_FIRST in spec.body
    )


@functools.lru_cache(maxsize=None)
def persistent_spec(spec: GroupKernelSpec) -> GroupKernelSpec:
    """The persistent form of a matmul spec (see :data:`PERSISTENT`): the same sums
    and bits, its CTAs taking items in turn (the grid is the launch's last integer).

    Raises:
        ValueError: A form with no persistent form (:func:`persistent_serves`), or a
            slot too small for the exchange and the flag below its x rows.
    """
    if not persistent_serves(spec):
        raise ValueError(f"{spec.base} has no persistent form")
    mtiles = 2 if "constexpr int MT = 2;" in spec.body else 1
    stride = re.search(r"constexpr int SW = (\d+);", spec.body)
    weight_bytes = COLUMNS * int(stride.group(1)) if stride else 0
    if exchange_bytes(mtiles) + _FLAG_BYTES > weight_bytes:
        raise ValueError(f"{spec.base}: a stage slot's weights hold {weight_bytes} "
                         "bytes, fewer than the exchange and the flag")  # fmt: skip
    # Its grid counts on two CTAs an SM: bounded, as the scaled forms are.
    bounds = launch_bounds(spec.threads)
    helpers = spec.helpers if spec.helpers.startswith(bounds) else bounds + spec.helpers
    return dataclasses.replace(
        spec,
        base=spec.base + PERSISTENT_SUFFIX,
        helpers=helpers,
        body=_persistent(spec.body, mtiles),
    )


LAYOUTS = {(bits, m): Layout(bits, m) for bits in (4, 8, 0) for m in (1, 2)}


def form_specs(folded: bool, k_groups: int) -> dict:
    """The matmul specs of one form by layout key (the folded forms: 4-bit only)."""
    return {
        key: _spec(layout, folded, k_groups)
        for key, layout in LAYOUTS.items()
        if key[0] == 4 or not folded
    }


# Every form's specs by (folded, k_groups). SPECS holds the forms run on the H200 (all
# but the two-K-group folded ones; the scaled forms, plain and SwiGLU, since session 27).
FORM_SPECS = {
    (folded, groups): form_specs(folded, groups)
    for folded in (False, True)
    for groups in (1, 2)
}
# The SwiGLU forms (not folded) by (k_groups, layout key).
SWIGLU_SPECS = {
    (groups, key): _spec(layout, False, groups, swiglu=True)
    for groups in (1, 2)
    for key, layout in LAYOUTS.items()
}
# The scaled-weight forms (affine layouts) by (k_groups, layout key, group size),
# plain and SwiGLU: the group size is a constant of each kernel (session 28).
SCALED_SPECS = {
    (groups, key, size): _spec(layout, k_groups=groups, scaled=True, group_size=size)
    for groups in (1, 2)
    for key, layout in LAYOUTS.items()
    if key[0] != 0
    for size in GROUP_SIZES
}
SWIGLU_SCALED_SPECS = {
    (groups, key, size): _spec(
        layout, k_groups=groups, swiglu=True, scaled=True, group_size=size
    )
    for groups in (1, 2)
    for key, layout in LAYOUTS.items()
    if key[0] != 0
    for size in GROUP_SIZES
}
# The direct 4-bit forms (:data:`DIRECT_Q4`) by (k_groups, group size), one m-tile (up
# to 16 rows: with two, the two-K-group form spills past its 128 registers); not in
# SPECS (the forms the default switches can take).
DIRECT_SPECS = {
    (groups, size): _spec(
        Layout(4, 1, direct=True), k_groups=groups, scaled=True, group_size=size
    )
    for groups in (1, 2)
    for size in GROUP_SIZES
}
# The denormal decode's forms (scaled 4-bit; see DENORMAL_Q4), by (K groups, layout
# key, group size) as SCALED_SPECS.
DENORMAL_SPECS = {
    (groups, (4, mtiles), size): _spec(
        LAYOUTS[(4, mtiles)],
        k_groups=groups,
        scaled=True,
        group_size=size,
        denormal=True,
    )
    for groups in (1, 2)
    for mtiles in (1, 2)
    for size in GROUP_SIZES
}
# The denormal decode's forms with the pairs in place (see DENORMAL_IN_PLACE), keyed as
# DENORMAL_SPECS.
IN_PLACE_SPECS = {
    key: _spec(
        spec_layout,
        k_groups=key[0],
        scaled=True,
        group_size=key[2],
        denormal=True,
        in_place=True,
    )
    for key, spec_layout in ((k, LAYOUTS[k[1]]) for k in DENORMAL_SPECS)
}


def swiglu_decode_specs(in_place: bool) -> dict:
    """The SwiGLU forms with the denormal decode (``in_place``: its pairs in place),
    keyed as :data:`DENORMAL_SPECS`."""
    return {
        key: _spec(
            LAYOUTS[key[1]],
            k_groups=key[0],
            swiglu=True,
            scaled=True,
            group_size=key[2],
            denormal=True,
            in_place=in_place,
        )
        for key in DENORMAL_SPECS
    }


# The SwiGLU forms with the denormal decode (session 64): the gate / up launch keeps the
# plain launch's decode, so DFLASH_SWIGLU=1 no longer gives it up (by the SASS census
# the scaled SwiGLU form ran 383 instructions a warp a chunk, the pairs in place 298,
# SwiGLU with them 301). Keyed as DENORMAL_SPECS; the same bits as the scaled SwiGLU
# forms (the decode is exact); their `cuda` tests passed on an H100 (session 64).
SWIGLU_DENORMAL_SPECS = swiglu_decode_specs(False)
SWIGLU_IN_PLACE_SPECS = swiglu_decode_specs(True)
MATMUL_SPECS = FORM_SPECS[(False, 1)]
FOLDED_SPECS = FORM_SPECS[(True, 1)]
K2_SPECS = FORM_SPECS[(False, 2)]
K2_FOLDED_SPECS = FORM_SPECS[(True, 2)]
REDUCE_SPEC = GroupKernelSpec(
    base="tensor_split_sum",
    input_names=("partial", "params"),
    input_types=("float32", "int32"),
    output_names=("y",),
    output_types=("T",),
    helpers="",
    body=_fill(_REDUCE, {"threads": REDUCE_THREADS}),
    threads=REDUCE_THREADS,
    backends=(CUDA,),
)
SPECS = (
    tuple(MATMUL_SPECS.values())
    + tuple(FOLDED_SPECS.values())
    + tuple(K2_SPECS.values())
    + tuple(SWIGLU_SPECS.values())
    + tuple(SCALED_SPECS.values())
    + tuple(DENORMAL_SPECS.values())
    + tuple(IN_PLACE_SPECS.values())
    + tuple(SWIGLU_SCALED_SPECS.values())
    + tuple(SWIGLU_DENORMAL_SPECS.values())
    + tuple(SWIGLU_IN_PLACE_SPECS.values())
    + (REDUCE_SPEC,)
)


# ------------------------------------------------------------------- host side


@functools.lru_cache(maxsize=1024)
def tensor_core_serves(
    dtype: mx.Dtype, rows: int, depth: int, columns: int, bits: Optional[int]
) -> bool:
    """Whether the tensor-core form takes a (validated) call.

    Args:
        dtype: x's dtype.
        rows: Rows of x.
        depth: K.
        columns: N.
        bits: 4 or 8 (affine), None (dense).

    Returns:
        True for bfloat16 / float16 x, 1 to 32 rows, at least one column, and K
        a positive multiple of the chunk (256 affine, 64 dense).
    """
    if dtype not in DTYPES or not 1 <= rows <= MAX_ROWS or columns < 1:
        return False
    chunk = Layout(bits or 0, 1).chunk
    return depth >= chunk and depth % chunk == 0


def split_plan(
    depth: int, columns: int, bits: Optional[int], waves: Optional[bool] = None
) -> tuple[int, int, int]:
    """``(column tiles, K splits, chunks per split)`` of a call: a function of K and N.

    By default K is split over CTAs only when the column tiles alone give fewer than
    :data:`TARGET_GROUPS` CTAs. With ``waves`` the split is the one whose CTAs finish
    soonest when :data:`RESIDENT_CTAS` run at a time: ``ceil(CTAs / resident)`` waves,
    each as long as a CTA's chunks plus its fixed cost (:func:`cta_overhead_chunks`;
    ties: fewer splits). ``waves`` None: the rule in force (:func:`wave_split`). Every
    split holds at least one chunk.
    """
    chunks = depth // Layout(bits or 0, 1).chunk
    tiles = -(-columns // COLUMNS)
    if wave_split() if waves is None else waves:
        return (tiles,) + _wave_split(chunks, tiles, cta_overhead_chunks(bits))
    want = min(chunks, max(1, -(-TARGET_GROUPS // tiles)))
    per_split = -(-chunks // want)
    return tiles, -(-chunks // per_split), per_split


def cta_overhead_chunks(bits: Optional[int]) -> int:
    """A CTA's fixed cost in chunks for the wave rule: :data:`CTA_OVERHEAD_CHUNKS` for
    affine weights (``bits`` 4 or 8), :data:`DENSE_CTA_OVERHEAD_CHUNKS` for dense."""
    return CTA_OVERHEAD_CHUNKS if bits else DENSE_CTA_OVERHEAD_CHUNKS


@functools.lru_cache(maxsize=1024)
def _wave_split(chunks: int, tiles: int, overhead: int) -> tuple[int, int]:
    """``(splits, chunks per split)`` of the wave-aware rule (see :func:`split_plan`),
    a CTA's fixed cost ``overhead`` chunks."""
    best = None
    for per_split in range(chunks, 0, -1):  # fewest splits first: ties keep them
        splits = -(-chunks // per_split)
        waves = -(-tiles * splits // RESIDENT_CTAS)
        cost = waves * (per_split + overhead)
        if best is None or cost < best[0]:
            best = (cost, splits, per_split)
    return best[1], best[2]


def bind_tensor_core(
    rows: int,
    depth: int,
    weight: mx.array,
    scales: Optional[mx.array],
    biases: Optional[mx.array],
    bits: Optional[int],
    group_size: Optional[int],
    dtype: mx.Dtype,
    members: Sequence[int] = (),
    swiglu: bool = False,
    lead: Optional[Sequence[int]] = None,
    prepared: bool = False,
) -> Callable[[mx.array], mx.array]:
    """The tensor-core form (one launch; two when K is split and the split sum is not
    merged) with everything but ``x`` fixed (see ``qmm.bind_matmul``, which has
    validated the call and checked :func:`tensor_core_serves`): its launches' inputs,
    shapes and counts are worked out once.

    With :func:`merge_split_sum` and a K split, each launch gets its own zeroed counter
    per column tile: a region of ``groups.COUNTER_POOL`` (one fill for many launches,
    far cheaper than the reduce launch). Counters kept by the bound call would be
    shared by two of its launches that mlx runs concurrently (two independent forwards
    evaluated together), and the last-CTA election would then mix their partials.

    Returns:
        ``(x, counters=None) -> x @ W.T`` for ``x`` of shape ``(*lead, depth)``
        (``lead`` defaults to ``(rows,)``; its extents multiply to ``rows``) and
        ``dtype``, the result declared ``(*lead, N)``: the kernels index by their
        scalars, never by shapes, so no reshape is needed on either side (each would
        be one more array to build and encode at every call); its ``counters``
        attribute is how many zeroed counters a launch takes (0: none); its
        ``reads`` attribute, the arrays its weight stream reads (the weights, then
        the scales and biases as repacked for it, each once).
        ``counters=None`` takes them from the pool; a caller that compiles the call
        passes them in (:func:`~dflash.metal.qmm.compile_around`), as a region
        captured by a trace would be reused by every replay.

        ``prefetch`` (:class:`~dflash.metal.prefetch.Prefetch`, CUDA only): the
        launch also carries that many CTAs past its own that ask another launch's
        weights into the L2 and exit (:func:`carrier_spec`); the result's bits are
        the same.

        ``members`` (the first column of each sibling after the first, of a fused
        call) asks for the member-major store: where :func:`member_edges` takes them,
        the launch's ``member_edges`` attribute holds them and the result is the flat
        buffer ``(rows * N,)`` holding each member's ``(rows, width)`` block in turn:
        read it through :func:`member_views`.

        ``swiglu`` (a stacked ``[gate; up]`` weight): the result is
        ``silu(x @ gate.T) * (x @ up.T)``, ``(*lead, N / 2)``, in one launch (see
        :data:`SWIGLU_HELPERS`; the caller checks :func:`swiglu_serves`).

        ``prepared`` (a q / k / v / gate stack with ``members``, head dim
        :data:`COLUMNS`): the launch is the prepared form (:func:`prepared_spec`) and
        takes ``heads=(hparams, hfparams, q_weight, k_weight)`` (the head prep's
        scalars and norm weights); its member-major result holds the prepared
        queries, the stacked ``(2, B, Hkv, S, D)`` block and the gate (the caller
        checks :func:`prepared_takes`).

    Raises:
        ValueError: ``lead``'s extents do not multiply to ``rows``; ``prepared`` for
            a call the prepared form does not take.
    """
    lead = leading_shape(rows, lead)
    edges = () if swiglu else member_edges(members, weight.shape[0])
    vector_merge()  # a bad switch value fails the bind that would use the forms
    paired_stage()
    lean_issue()
    lean_bytes()
    unit_scales()
    chunk_major_scales()
    interleaved_scales()
    scaled = scaled_b(bits)
    decode = scale_decode(scales) if scaled and denormal_q4(bits) else "scaled"
    denormal = decode != "scaled"
    in_place = decode == "in_place" and denormal_in_place(bits)
    plan = launch_plan(
        rows, depth, weight.shape[0], bits, group_size, merge_split_sum(),
        fold_q4_offset() and not swiglu and not scaled, wave_split(), k_groups(),
        edges, swiglu, scaled, cluster_sum(), scaled and direct_q4(bits), denormal,
        in_place, persistent(),
    )  # fmt: skip
    if prepared:
        if swiglu or len(edges) != 3 or plan.reduce_params is not None:
            raise ValueError(
                "the prepared form takes a q / k / v / gate stack (three member edges) "
                "whose K split, if any, is summed in its launch"
            )
        plan = dataclasses.replace(plan, spec=prepared_spec(plan.spec))
    if bits is not None:
        scales, biases = scale_arrays(plan.spec, scales, biases, group_size)
    weights = [weight] if bits is None else [weight, scales, biases]
    weights.append(plan.params)
    out_dtypes = [dtype, mx.float32]
    width = plan.columns // 2 if swiglu else plan.columns
    out_shape = (rows * width,) if edges else (*lead, width)
    shapes = (out_shape if plan.reduce_params is None else (1,), plan.shapes[1])
    reduce_shapes = [out_shape]

    def launch(
        x: mx.array,
        counters: Optional[mx.array] = None,
        prefetch: Optional[Prefetch] = None,
        heads: Optional[Sequence[mx.array]] = None,
    ) -> mx.array:
        if counters is None:
            counters = groups.launch_counters(plan.counters)
        spec, ctas, inputs = plan.spec, plan.groups, [x, *weights, counters]
        if prepared:
            if heads is None or len(heads) != len(PREPARED_INPUTS):
                raise ValueError(f"the prepared form takes heads={PREPARED_INPUTS}")
            inputs += list(heads)
        if prefetch is not None:
            spec, ctas = carrier_spec(spec), ctas + prefetch.fetchers
            inputs += prefetch.inputs
        y, partial = groups.launch_groups(spec, inputs, shapes, out_dtypes, ctas, dtype)
        if plan.reduce_params is None:
            return y
        (y,) = groups.launch_groups(
            REDUCE_SPEC,
            [partial, plan.reduce_params],
            reduce_shapes,
            [dtype],
            plan.reduce_groups,
            dtype,
        )
        return y

    launch.counters = plan.counters
    launch.member_edges = edges
    # The arrays its weight stream reads (the scales / biases as repacked for it).
    launch.reads = tuple({id(a): a for a in weights[:-1]}.values())
    return launch


def carrier_spec(spec: GroupKernelSpec) -> GroupKernelSpec:
    """A matmul kernel carrying prefetch CTAs
    (:func:`dflash.metal.prefetch.with_prefetch`): CTAs past its own, which its body
    never sees (it indexes its work by ``group`` and its scalars, never by the grid).

    Raises:
        ValueError: ``spec`` is a cluster-sum or persistent form: both opt-in, their
            grids planned for their own CTAs alone, and not tested carrying others.
    """
    if spec.cluster > 1 or spec.base.endswith(PERSISTENT_SUFFIX):
        raise ValueError(
            f"{spec.base} cannot carry prefetch CTAs (a cluster-sum or "
            "persistent form)"
        )
    return with_prefetch(spec)


def scale_arrays(
    spec: GroupKernelSpec, scales: mx.array, biases: mx.array, group_size: int
) -> tuple[mx.array, mx.array]:
    """The scales and biases ``spec`` is handed, as the bind hands them: the
    interleaved repack in both places (:func:`interleaved`), each chunk-major
    (:func:`chunk_major`), or as mlx lays them out.

    Shapes: scales, biases ``(N, K / group_size)``.
    """
    if reads_interleaved(spec):
        both = interleaved(scales, biases, group_size)
        return both, both
    if reads_chunk_major(spec):
        return chunk_major(scales, group_size), chunk_major(biases, group_size)
    return scales, biases


def leading_shape(rows: int, lead: Optional[Sequence[int]]) -> tuple[int, ...]:
    """``lead`` as a tuple (None: ``(rows,)``), checked to hold ``rows`` rows.

    Raises:
        ValueError: ``lead``'s extents do not multiply to ``rows``.
    """
    lead = (rows,) if lead is None else tuple(lead)
    if math.prod(lead) != rows:
        raise ValueError(f"leading shape {lead} does not hold the {rows} rows of x")
    return lead


def member_views(
    y: mx.array, edges: Sequence[int], lead: Optional[Sequence[int]] = None
) -> list[mx.array]:
    """Each member's ``(*lead, width)`` result in a member-major ``y`` (one view node
    each: :func:`~dflash.metal.layout.contiguous_view` of the launch's row-contiguous
    output).

    Shapes: y ``(rows * N,)`` (or ``(rows, N)``), members stored as blocks at
    ``edges``; ``lead`` multiplies to ``rows`` (default: ``y``'s first extent);
    returns ``(*lead, width)`` per member.
    """
    lead = (y.shape[0],) if lead is None else tuple(lead)
    rows = math.prod(lead)
    bounds = (0, *edges, y.size // rows)
    return [
        contiguous_view(y, (*lead, hi - lo), lo * rows)
        for lo, hi in zip(bounds, bounds[1:])
    ]


@dataclass(frozen=True)
class LaunchPlan:
    """Everything about a call's launches that follows from its geometry.

    Attributes:
        spec: The matmul kernel.
        columns: N.
        params: The matmul launch's integer scalars.
        shapes: Its output shapes (the result and the K-split partials; one is a
            one-element placeholder when K is not split, or when the sum is a second
            launch).
        groups: Its CTAs.
        counters: Length of the zeroed counters each launch gets (the column tiles)
            when the split sum is merged, else 0 (a one-element placeholder goes in,
            never written).
        reduce_params: The reduce launch's scalars (None: no second launch).
        reduce_groups: The reduce launch's CTAs (0: none).
    """

    spec: GroupKernelSpec
    columns: int
    params: mx.array
    shapes: tuple[tuple[int, ...], tuple[int, ...]]
    groups: int
    counters: int
    reduce_params: Optional[mx.array]
    reduce_groups: int


@functools.lru_cache(maxsize=512)
def launch_plan(
    rows: int,
    depth: int,
    columns: int,
    bits: Optional[int],
    group_size: Optional[int],
    merged: bool = False,
    folded: bool = False,
    waves: bool = False,
    k_groups: int = 1,
    edges: tuple[int, ...] = (),
    swiglu: bool = False,
    scaled: bool = False,
    cluster: bool = False,
    direct: bool = False,
    denormal: bool = False,
    in_place: bool = False,
    persistent: bool = False,
) -> LaunchPlan:
    """The launch plan of a validated call, built once per geometry (host time).

    ``merged``: a K split's partials are summed by the matmul launch's last CTA per
    column tile instead of a second launch (same order, same bits). ``folded``: a
    4-bit call takes the folded-offset form (:data:`FOLD_Q4_OFFSET`). ``waves``: the
    wave-aware K split (:func:`split_plan`). ``k_groups``: 2 takes the two-K-group form
    (:data:`K_GROUPS`). ``edges``: the member-major store's member edges (validated by
    :func:`member_edges`; ``()``: the plain layout). ``swiglu``: the SwiGLU form (see
    :func:`swiglu_serves`; its result is ``(rows, columns / 2)``). ``scaled``: an
    affine call takes the scaled-weight form (:data:`SCALED_B`; not with ``folded``).
    ``cluster``: a split of 2 to :data:`MAX_CLUSTER` ways is summed inside a
    thread-block cluster (:func:`cluster_spec`), with no partials array and no
    counters; a SwiGLU plan keeps its merge. ``direct``: a scaled 4-bit call of up
    to 16 rows takes the direct form (:data:`DIRECT_Q4`; others keep their form).
    ``denormal``: a scaled 4-bit call (not direct) takes the denormal decode
    (:data:`DENORMAL_Q4`), with its nibble pairs in place where ``in_place``
    (:data:`DENORMAL_IN_PLACE`); the caller has checked the scales
    (:func:`scale_decode`). ``persistent``: a call of more (column tile, split) items
    than :data:`RESIDENT_CTAS` launches that many CTAs of the persistent form where
    the form has one (:data:`PERSISTENT`; not with a cluster sum).

    Raises:
        ValueError: ``swiglu`` for a call :func:`swiglu_serves` refuses.
    """
    key = (bits or 0, 1 if rows <= 16 else 2)
    tiles, splits, per_split = split_plan(depth, columns, bits, waves)
    if swiglu:
        if not swiglu_serves(columns, splits, merged, edges):
            raise ValueError(
                f"the SwiGLU form takes N a multiple of {COLUMNS} with a merged or no K "
                f"split and no member edges, got N={columns}, {splits} splits"
            )
        if denormal and scaled and bits == 4:
            table = SWIGLU_IN_PLACE_SPECS if in_place else SWIGLU_DENORMAL_SPECS
            spec = table[(k_groups, key, group_size)]
        elif scaled and bits is not None:
            spec = SWIGLU_SCALED_SPECS[(k_groups, key, group_size)]
        else:
            spec = SWIGLU_SPECS[(k_groups, key)]
        return _swiglu_plan(
            spec, rows, depth, columns, group_size,
            (tiles, splits, per_split),
        )  # fmt: skip
    if direct and scaled and bits == 4 and key[1] == 1:
        spec = DIRECT_SPECS[(k_groups, group_size)]
    elif denormal and scaled and bits == 4:
        table = IN_PLACE_SPECS if in_place else DENORMAL_SPECS
        spec = table[(k_groups, key, group_size)]
    elif scaled and bits is not None:
        spec = SCALED_SPECS[(k_groups, key, group_size)]
    else:
        spec = FORM_SPECS[(folded and bits == 4, k_groups)][key]
    shift = (group_size or 1).bit_length() - 1
    merged = merged and splits > 1
    clustered = cluster and 1 < splits <= MAX_CLUSTER
    ctas = tiles * splits
    grid = ()
    if persistent and ctas > RESIDENT_CTAS and not clustered:
        if persistent_serves(spec):
            spec, ctas = persistent_spec(spec), RESIDENT_CTAS
            grid = (ctas,)
    params = int_params(
        rows, columns, depth, group_size or 0, tiles, splits, per_split, shift,
        int(merged), len(edges), *edges, *grid,
    )  # fmt: skip
    if splits == 1:
        return LaunchPlan(
            spec, columns, params, ((rows, columns), (1,)), ctas, 0, None, 0
        )
    if clustered:
        return LaunchPlan(
            cluster_spec(spec, splits), columns, params, ((rows, columns), (1,)),
            tiles * splits, 0, None, 0,
        )  # fmt: skip
    partials = (splits, rows, columns)
    if merged:
        return LaunchPlan(
            spec, columns, params, ((rows, columns), partials), ctas, tiles, None, 0
        )  # fmt: skip
    total = rows * columns
    return LaunchPlan(
        spec,
        columns,
        params,
        ((1,), partials),
        ctas,
        0,
        int_params(total, splits, columns, len(edges), *edges),
        -(-total // REDUCE_THREADS),
    )


def swiglu_serves(
    columns: int, splits: int, merged: bool, edges: tuple[int, ...] = ()
) -> bool:
    """Whether the SwiGLU form takes a fused gate / up call of ``columns`` columns
    split ``splits`` ways: whole column tiles (each half of a tile is 64 gate or 64 up
    columns), the split summed in the launch (or none), no member-major edges."""
    return columns % COLUMNS == 0 and (splits == 1 or merged) and not edges


def _swiglu_plan(
    spec: GroupKernelSpec,
    rows: int,
    depth: int,
    columns: int,
    group_size: Optional[int],
    split: tuple[int, int, int],
) -> LaunchPlan:
    """The plan of a SwiGLU launch (checked by :func:`swiglu_serves`)."""
    tiles, splits, per_split = split
    shift = (group_size or 1).bit_length() - 1
    params = int_params(
        rows, columns, depth, group_size or 0, tiles, splits, per_split, shift,
        int(splits > 1), 0,
    )  # fmt: skip
    partials = (splits, rows, columns) if splits > 1 else (1,)
    return LaunchPlan(
        spec,
        columns,
        params,
        ((rows, columns // 2), partials),
        tiles * splits,
        tiles if splits > 1 else 0,
        None,
        0,
    )


def swiglu_takes(
    dtype: mx.Dtype, rows: int, depth: int, columns: int, bits: Optional[int]
) -> bool:
    """Whether a fused gate / up call (validated, ``columns`` = 2 x the hidden width)
    runs in the SwiGLU form on this backend with the switches as they are now."""
    if not (
        backend.BACKEND == CUDA
        and tensor_core_serves(dtype, rows, depth, columns, bits)
    ):
        return False
    splits = split_plan(depth, columns, bits, wave_split())[1]
    return swiglu_serves(columns, splits, merge_split_sum())
