"""How fast a 4-bit projection's weights can be read, by each way of copying them (CUDA).

The tensor-core matmul's copies alone (``matmul_variants``' ``memonly``) took 2.0-2.3x
the H200's bound on the large projections (session 25), and more stages or CTAs did not
move them (session 41); an H100 and an H200 time the whole call alike, so the limit is
not the memory's. This probe reads the same bytes (a projection's ``(N, K / 8)``
``uint32`` weights, copies spanning ``--cold-bytes`` as in ``matmul_variants``) with
nothing else in the kernel, seven ways:

* ``stream``: a grid-stride loop of 16-byte ``ld.global.cg`` loads over the whole array
  (four a thread in flight): what the device's memory gives a plain read;
* ``ldg-tile``: the matmul's plan and pattern (a CTA a column tile and K split; each
  chunk 128 columns x 128 bytes, a thread's four 16-byte pieces), loaded to registers;
* ``cpasync-tile``: the same through the matmul's three-stage ``cp.async`` ring into
  shared memory (its padded column stride; what the shipped form does);
* ``cpasync-slab``: the same ring reading a tile-contiguous repack (each chunk's
  128 x 128 bytes adjacent, as ``bulk-slab``): the layout's part apart from the copy
  engine's;
* ``bulk-tile``: the same ring filled by ``cp.async.bulk`` (one 128-byte bulk copy a
  column and chunk, completing on the stage's mbarrier): the copy engine without a
  tensor map;
* ``bulk-slab``: one 16 KB bulk copy a stage from a tile-contiguous layout (each
  chunk's 128 x 128 bytes adjacent): the copy engine's best case (a repacked layout);
* ``tma-tile``: one 2D tensor-map box copy a stage (128 bytes x 128 columns of the
  weights as they lie; the map made once by the driver's ``cuTensorMapEncodeTiled``
  through ctypes, the array's device address read by a one-thread kernel): the copy
  side of the Next steps' tensor-copy route, without repacking.

Every form but ``stream`` runs the matmul's grid (``tensor_qmm.split_plan``) with its
dynamic shared memory (two CTAs an SM). Each kernel folds what it read into one word
and stores it only if it equals a key it never does, so no load is dropped.

GPU (torch's interpreter, for CUPTI)::

    python -m benchmarks.copy_probe --cold-bytes 268435456 --json F

The CPU has no CUDA backend: it exits with a one-line error.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Optional, Sequence

import mlx.core as mx

from dflash.metal import tensor_qmm
from dflash.metal.groups import GroupKernelSpec, launch_groups
from dflash.metal.sources import CUDA

from .common import write_json
from .matmul_variants import SHAPES, in_turn, weight_copies
from .verify_kernels import (
    add_bandwidth_argument,
    device_time,
    per_call_meta,
    run_on_cuda,
)

# The matmul's geometry: a chunk is 128 weight bytes of a column, a tile 128 columns.
CHUNK_BYTES = 128
COLUMNS = tensor_qmm.COLUMNS
STAGES = 3
THREADS = 256
# Never a fold of real data in practice: the store that keeps the loads alive.
KEY = 0x9E3779B9

_HELPERS = r"""
DFL_FN uint32_t dfl_fold(uint4 v) { return v.x ^ v.y ^ v.z ^ v.w; }
DFL_FN uint32_t dfl_smem(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}
"""

# params: n_cols, row_bytes, chunks, tiles, splits, per_split, pieces (16-byte).
_PLAN = r"""
  const int n_cols = params[0];
  const int row_bytes = params[1];
  const int chunks = params[2];
  const int tiles = params[3];
  const int per_split = params[5];
  const int tile = int(group) % tiles;
  const int split = int(group) / tiles;
  const int c_begin = split * per_split;
  const int c_end = c_begin + per_split < chunks ? c_begin + per_split : chunks;
  uint32_t fold = 0u;
  (void)n_cols; (void)row_bytes;
"""

_BYTES = (
    "  const unsigned char* bytes = reinterpret_cast<const unsigned char*>(weight);\n"
)

_KEEP = r"""
  if (fold == {key}u) {{
    sink[0] = fold;
  }}
"""

_STREAM = r"""
  const uint4* pieces = reinterpret_cast<const uint4*>(weight);
  const long long total = params[6];
  const long long stride = (long long)gridDim.x * THREADS;
  uint32_t fold = 0u;
  long long p = (long long)group * THREADS + lid;
  for (; p + 3 * stride < total; p += 4 * stride) {
    const uint4 a = __ldcg(pieces + p);
    const uint4 b = __ldcg(pieces + p + stride);
    const uint4 c = __ldcg(pieces + p + 2 * stride);
    const uint4 d = __ldcg(pieces + p + 3 * stride);
    fold ^= dfl_fold(a) ^ dfl_fold(b) ^ dfl_fold(c) ^ dfl_fold(d);
  }
  for (; p < total; p += stride) {
    fold ^= dfl_fold(__ldcg(pieces + p));
  }
"""

# A thread's pieces: piece lid % 8 of columns lid / 8 + 32 i (i < 4), as the matmul's.
_LDG_TILE = r"""
  const unsigned char* source = bytes + (int(lid) % 8) * 16;
  #pragma unroll 2
  for (int c = c_begin; c < c_end; ++c) {
    #pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int col = tile * COLUMNS + int(lid) / 8 + 32 * i;
      const int n = col < n_cols ? col : n_cols - 1;
      fold ^= dfl_fold(__ldcg(reinterpret_cast<const uint4*>(
          source + size_t(n) * row_bytes + size_t(c) * CHUNK_BYTES)));
    }
  }
"""

# The matmul's ``cp.async`` ring; ``{address}`` is where piece ``i`` of chunk ``c`` is read.
_CPASYNC_RING = r"""
  extern __shared__ uint4 dfl_probe_smem[];
  unsigned char* smem = reinterpret_cast<unsigned char*>(dfl_probe_smem);
  const unsigned char* source = bytes + (int(lid) % 8) * 16;
  const int shared_at = (int(lid) / 8) * SW + (int(lid) % 8) * 16;
  auto issue = [&](int c, int stage) {{
    #pragma unroll
    for (int i = 0; i < 4; ++i) {{
{address}
      asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::
                   "r"(dfl_smem(smem + stage * STAGE_BYTES + shared_at + 32 * i * SW)),
                   "l"(at) : "memory");
    }}
  }};
  for (int i = 0; i < STAGES - 1; ++i) {{
    if (c_begin + i < c_end) {{
      issue(c_begin + i, i);
    }}
    asm volatile("cp.async.commit_group;\n" ::: "memory");
  }}
  for (int c = c_begin; c < c_end; ++c) {{
    const int i = c - c_begin;
    asm volatile("cp.async.wait_group %0;\n" :: "n"(STAGES - 2) : "memory");
    __syncthreads();
    if (c + STAGES - 1 < c_end) {{
      issue(c + STAGES - 1, (i + STAGES - 1) % STAGES);
    }}
    asm volatile("cp.async.commit_group;\n" ::: "memory");
    fold ^= dfl_fold(*reinterpret_cast<const uint4*>(
        smem + (i % STAGES) * STAGE_BYTES + shared_at));
  }}
"""

# The weights as they lie: column ``n``'s row, 128 bytes a chunk.
_CPASYNC_TILE_ADDRESS = r"""      const int col = tile * COLUMNS + int(lid) / 8 + 32 * i;
      const int n = col < n_cols ? col : n_cols - 1;
      const unsigned char* at = source + size_t(n) * row_bytes + size_t(c) * CHUNK_BYTES;"""

# A tile-contiguous repack, as ``bulk-slab`` reads it: chunk ``c`` of tile ``tile`` is
# one 16 KB slab, its columns' 128 bytes side by side (a warp's copies: 512 bytes in a
# row), the last tile of an N not a multiple of 128 reading the array's end.
_CPASYNC_SLAB_ADDRESS = r"""      const size_t slab = size_t(COLUMNS) * CHUNK_BYTES;
      const size_t last = size_t(n_cols) * row_bytes - slab;
      size_t base = (size_t(tile) * chunks + c) * slab;
      base = base < last ? base : last;
      const unsigned char* at =
          source + base + size_t(int(lid) / 8 + 32 * i) * CHUNK_BYTES;"""

# Bulk copies into a ring of STAGES stages of 16 KB (dense columns), each stage's
# mbarrier expecting its 16 KB; ``{issue}`` fills stage ``stage`` with chunk ``c``.
_BULK_RING = r"""
  extern __shared__ uint4 dfl_probe_smem[];
  __shared__ alignas(8) unsigned long long dfl_full[STAGES];
  // Tensor copies land at 128-byte aligned shared addresses (the launch has 128 spare).
  unsigned char* smem = reinterpret_cast<unsigned char*>(
      (reinterpret_cast<size_t>(dfl_probe_smem) + 127) & ~size_t(127));
  if (lid == 0) {{
    for (int s = 0; s < STAGES; ++s) {{
      asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;\n" ::
                   "r"(dfl_smem(&dfl_full[s])) : "memory");
    }}
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }}
  __syncthreads();
  auto issue = [&](int c, int stage) {{
    const uint32_t bar = dfl_smem(&dfl_full[stage]);
    unsigned char* into = smem + stage * STAGE_BYTES;
    if (lid == 0) {{
      asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::
                   "r"(bar), "r"(COLUMNS * CHUNK_BYTES) : "memory");
    }}
{issue}
  }};
  auto wait = [&](int stage, int parity) {{
    const uint32_t bar = dfl_smem(&dfl_full[stage]);
    uint32_t done = 0;
    while (!done) {{
      asm volatile("{{\n .reg .pred p;\n"
                   " mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
                   " selp.u32 %0, 1, 0, p;\n}}\n"
                   : "=r"(done) : "r"(bar), "r"(parity) : "memory");
    }}
  }};
  for (int i = 0; i < STAGES - 1; ++i) {{
    if (c_begin + i < c_end) {{
      issue(c_begin + i, i);
    }}
  }}
  for (int c = c_begin; c < c_end; ++c) {{
    const int i = c - c_begin;
    // Every thread is past the stage refilled here (it was read in round i - 1).
    __syncthreads();
    if (c + STAGES - 1 < c_end) {{
      issue(c + STAGES - 1, (i + STAGES - 1) % STAGES);
    }}
    wait(i % STAGES, (i / STAGES) & 1);
    fold ^= dfl_fold(*reinterpret_cast<const uint4*>(
        smem + (i % STAGES) * STAGE_BYTES + int(lid) * 16));
  }}
"""

# One 128-byte bulk copy a column (threads 0..127, one column each).
_BULK_TILE_ISSUE = r"""    if (lid < COLUMNS) {
      const int col = tile * COLUMNS + int(lid);
      const int n = col < n_cols ? col : n_cols - 1;
      asm volatile(
          "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes"
          " [%0], [%1], %2, [%3];\n" ::
          "r"(dfl_smem(into + int(lid) * CHUNK_BYTES)),
          "l"(bytes + size_t(n) * row_bytes + size_t(c) * CHUNK_BYTES),
          "r"(CHUNK_BYTES), "r"(bar) : "memory");
    }
"""

# One 16 KB bulk copy a stage: tile ``tile``'s chunk ``c`` lies at (tile * chunks + c)
# slabs (the last tile of an N that is not a multiple of 128 reads the array's end).
_BULK_SLAB_ISSUE = r"""    if (lid == 0) {
      const size_t slab = size_t(COLUMNS) * CHUNK_BYTES;
      const size_t last = size_t(n_cols) * row_bytes - slab;
      size_t at = (size_t(tile) * chunks + c) * slab;
      at = at < last ? at : last;
      asm volatile(
          "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes"
          " [%0], [%1], %2, [%3];\n" ::
          "r"(dfl_smem(into)), "l"(bytes + at), "r"(int(slab)), "r"(bar) : "memory");
    }
"""


# One 2D tensor-map box a stage (128 bytes x 128 columns of the weights as they lie),
# the map made on the host (:func:`weight_tensor_map`) and read from global memory.
_TMA_TILE_ISSUE = r"""    if (lid == 0) {
      asm volatile(
          "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
          " [%0], [%1, {%2, %3}], [%4];\n" ::
          "r"(dfl_smem(into)), "l"(tmap), "r"(c * CHUNK_BYTES), "r"(tile * COLUMNS),
          "r"(bar) : "memory");
    }
"""

# The tensor map was written by the host (generic proxy): acquired once before use.
_TMA_ACQUIRE = r"""
  const unsigned char* tmap = reinterpret_cast<const unsigned char*>(tensor_map);
  if (lid == 0) {
    asm volatile("fence.proxy.tensormap::generic.acquire.gpu [%0], 128;\n" ::
                 "l"(tmap) : "memory");
  }
"""

_ADDRESS_BODY = r"""
  if (lid == 0 && group == 0) {
    const unsigned long long at = reinterpret_cast<unsigned long long>(weight);
    address[0] = uint32_t(at & 0xffffffffull);
    address[1] = uint32_t(at >> 32);
  }
"""

ADDRESS_SPEC = GroupKernelSpec(
    base="copy_probe_address",
    input_names=("weight",),
    input_types=("uint32",),
    output_names=("address",),
    output_types=("uint32",),
    helpers="",
    body=_ADDRESS_BODY,
    threads=32,
    backends=(CUDA,),
    dtypes=(mx.bfloat16,),
)


def device_address(array: mx.array) -> int:
    """The device address of ``array``'s data (a one-thread kernel reads its pointer)."""
    (words,) = launch_groups(ADDRESS_SPEC, [array], [(2,)], [mx.uint32], 1, mx.bfloat16)
    low, high = (int(word) for word in words.tolist())
    return low | (high << 32)


# cuda.h's enumerators for cuTensorMapEncodeTiled.
_UINT8, _NO_INTERLEAVE, _NO_SWIZZLE, _L2_256B, _NO_OOB_FILL = 0, 0, 0, 3, 0


def weight_tensor_map(weight: mx.array, columns: int, row_bytes: int) -> mx.array:
    """A CUtensorMap (128 bytes, as 32 ``uint32``) over ``weight``'s bytes as a
    ``(columns, row_bytes)`` uint8 matrix, boxes of 128 x 128, by the driver.

    Raises:
        RuntimeError: The driver refused the map (its CUresult is named).
    """
    import ctypes

    driver = ctypes.CDLL("libcuda.so.1")
    buffer = ctypes.create_string_buffer(128 + 64)
    aligned = (ctypes.addressof(buffer) + 63) // 64 * 64
    code = driver.cuTensorMapEncodeTiled(
        ctypes.c_void_p(aligned),
        _UINT8,
        ctypes.c_uint32(2),
        ctypes.c_void_p(device_address(weight)),
        (ctypes.c_uint64 * 2)(row_bytes, columns),
        (ctypes.c_uint64 * 1)(row_bytes),
        (ctypes.c_uint32 * 2)(CHUNK_BYTES, COLUMNS),
        (ctypes.c_uint32 * 2)(1, 1),
        _NO_INTERLEAVE,
        _NO_SWIZZLE,
        _L2_256B,
        _NO_OOB_FILL,
    )
    if code != 0:
        raise RuntimeError(f"cuTensorMapEncodeTiled refused the map (CUresult {code})")
    raw = ctypes.string_at(aligned, 128)
    return mx.array(list(memoryview(raw).cast("I")), dtype=mx.uint32)


def _constants(shared_stride: int) -> str:
    return (
        f"  constexpr int THREADS = {THREADS};\n"
        f"  constexpr int COLUMNS = {COLUMNS};\n"
        f"  constexpr int CHUNK_BYTES = {CHUNK_BYTES};\n"
        f"  constexpr int STAGES = {STAGES};\n"
        f"  constexpr int SW = {shared_stride};\n"
        f"  constexpr int STAGE_BYTES = {COLUMNS * shared_stride};\n"
        "  (void)THREADS; (void)SW; (void)STAGE_BYTES; (void)CHUNK_BYTES;\n"
        "  (void)COLUMNS; (void)STAGES;\n"
    )


def _spec(name: str, body: str, shared_stride: int, shared: int) -> GroupKernelSpec:
    tma = name.startswith("tma")
    plan = "" if name == "stream" else _PLAN + ("" if tma else _BYTES)
    return GroupKernelSpec(
        base=f"copy_probe_{name.replace('-', '_')}",
        input_names=("weight", "params") + (("tensor_map",) if tma else ()),
        input_types=("uint32", "int32") + (("uint32",) if tma else ()),
        output_names=("sink",),
        output_types=("uint32",),
        helpers=_HELPERS,
        body=_constants(shared_stride)
        + plan
        + (_TMA_ACQUIRE if tma else "")
        + body
        + _KEEP.format(key=KEY),
        threads=THREADS,
        backends=(CUDA,),
        shared_memory=shared,
        dtypes=(mx.bfloat16,),
    )


def probe_specs(shared: Optional[int] = None) -> dict[str, GroupKernelSpec]:
    """The probe's kernels by form; ``shared``: the ring forms' dynamic shared memory
    (default: the 16-row 4-bit matmul's, so as many CTAs an SM)."""
    if shared is None:
        shared = tensor_qmm.Layout(4, 1).shared_memory
    padded = tensor_qmm.Layout(4, 1).w_stride
    return {
        "stream": _spec("stream", _STREAM, CHUNK_BYTES, 0),
        "ldg-tile": _spec("ldg-tile", _LDG_TILE, CHUNK_BYTES, shared),
        "cpasync-tile": _spec(
            "cpasync-tile",
            _CPASYNC_RING.format(address=_CPASYNC_TILE_ADDRESS),
            padded,
            shared,
        ),
        "cpasync-slab": _spec(
            "cpasync-slab",
            _CPASYNC_RING.format(address=_CPASYNC_SLAB_ADDRESS),
            padded,
            shared,
        ),
        "bulk-tile": _spec(
            "bulk-tile",
            _BULK_RING.format(issue=_BULK_TILE_ISSUE),
            CHUNK_BYTES,
            shared,
        ),
        "bulk-slab": _spec(
            "bulk-slab",
            _BULK_RING.format(issue=_BULK_SLAB_ISSUE),
            CHUNK_BYTES,
            shared,
        ),
        "tma-tile": _spec(
            "tma-tile",
            _BULK_RING.format(issue=_TMA_TILE_ISSUE),
            CHUNK_BYTES,
            shared,
        ),
    }


FORMS = tuple(probe_specs(0))


def probe_params(depth: int, columns: int, stream_ctas: int) -> tuple[list[int], int]:
    """The kernels' scalars and the grid of the tile forms (the 4-bit matmul's plan).

    Returns:
        ``(params, groups)``: ``params`` as the kernels read them, ``groups`` the tile
        forms' CTAs (``stream`` takes ``stream_ctas``).
    """
    tiles, splits, per_split = tensor_qmm.split_plan(depth, columns, 4)
    row_bytes = depth // 2
    chunks = row_bytes // CHUNK_BYTES
    pieces = columns * row_bytes // 16
    return [
        columns,
        row_bytes,
        chunks,
        tiles,
        splits,
        per_split,
        pieces,
    ], tiles * splits


def tensor_maps(
    form: str, shape: str, weights: list, columns: int, row_bytes: int
) -> Optional[list]:
    """Each weight copy's extra inputs for ``form``: its tensor map for the ``tma``
    forms, none for the others; None (and a printed line) where the driver refused a
    map or mlx placed one off the 64-byte alignment the copy reads it at."""
    if not form.startswith("tma"):
        return [[] for _ in weights]
    try:
        maps = [weight_tensor_map(w, columns, row_bytes) for w in weights]
    except (OSError, RuntimeError) as error:
        print(json.dumps({"shape": shape, "form": form, "error": str(error)}))
        return None
    misaligned = [device_address(m) % 64 for m in maps]
    if any(misaligned):
        print(json.dumps({"shape": shape, "form": form, "misaligned": misaligned}))
        return None
    return [[m] for m in maps]


def run(args: argparse.Namespace) -> dict:
    """Every form x shape, timed by CUPTI with the weights cold; rows printed and kept."""
    specs = probe_specs(args.shared)
    result = {
        "meta": per_call_meta(args, stream_ctas=args.stream_ctas),
        "rows": [],
    }
    for shape in args.shapes:
        depth, columns = SHAPES[shape]
        nbytes = columns * depth // 2
        copies = weight_copies(nbytes, args.cold_bytes)
        weights = [
            mx.random.randint(0, 2**30, (columns, depth // 8)).astype(mx.uint32)
            for _ in range(copies)
        ]
        mx.eval(weights)
        values, groups = probe_params(depth, columns, args.stream_ctas)
        params = mx.array(values, dtype=mx.int32)
        for form in args.forms:
            grid = args.stream_ctas if form == "stream" else groups
            maps = tensor_maps(form, shape, weights, columns, depth // 2)
            if maps is None:
                continue

            def call(
                weight: mx.array, more: list, form: str = form, grid: int = grid
            ) -> mx.array:
                (sink,) = launch_groups(
                    specs[form], [weight, params, *more], [(1,)], [mx.uint32], grid,
                    mx.bfloat16,
                )  # fmt: skip
                return sink

            calls = [lambda w=w, m=m: call(w, m) for w, m in zip(weights, maps)]
            timed = device_time(in_turn(calls), args.reps)
            row = {
                "shape": shape,
                "form": form,
                "ctas": grid,
                "copies": copies,
                "bytes": nbytes,
                "device_us": round(timed["device_us"], 2),
                "tb_per_s": round(nbytes / timed["device_us"] / 1e6, 3),
                "over_bound": round(
                    timed["device_us"] / (1e6 * nbytes / args.bandwidth), 3
                ),
            }
            result["rows"].append(row)
            print(json.dumps(row), flush=True)
            write_json(args.json, result)
    return result


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.copy_probe")
    parser.add_argument(
        "--forms",
        type=lambda text: text.split(","),
        default=list(FORMS),
        help=f"comma list of: {', '.join(FORMS)}",
    )
    parser.add_argument(
        "--shapes",
        type=lambda text: text.split(";"),
        default=["mlp gate+up fused", "mlp down", "attn q/k/v/gate fused"],
        help=f"semicolon list of: {'; '.join(SHAPES)}",
    )
    parser.add_argument("--reps", type=int, default=30)
    parser.add_argument("--cold-bytes", type=int, default=268435456)
    parser.add_argument("--stream-ctas", type=int, default=132 * 8)
    parser.add_argument(
        "--shared", type=int, default=None, help="the ring forms' shared memory"
    )
    add_bandwidth_argument(parser)
    parser.add_argument("--json", help="write results here (after every row)")
    args = parser.parse_args(argv)
    unknown = [name for name in args.forms if name not in FORMS]
    unknown += [name for name in args.shapes if name not in SHAPES]
    if unknown:
        parser.error(f"unknown form or shape: {', '.join(unknown)}")
    if args.reps < 1 or args.stream_ctas < 1 or args.cold_bytes < 0:
        parser.error("--reps and --stream-ctas must be >= 1, --cold-bytes >= 0")
    return args


def main(argv: Optional[Sequence[str]] = None) -> int:
    return run_on_cuda("copy_probe", parse_args(argv), run)


if __name__ == "__main__":
    sys.exit(main())
