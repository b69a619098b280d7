"""The CUDA tensor-core bodies run on the CPU: the body text itself, its helpers emulated.

:mod:`.tensor_qmm_model` re-derives the matmul's arithmetic in numpy; this module
runs the very body text of ``dflash.metal.tensor_qmm`` and of the tensor-core chunk
pass of ``dflash.metal.tensor_attention`` (and the plain CUDA bodies they launch
with: the split sum, the attention's fold), compiled by g++ inside mlx's CUDA
header macros (``groups.HEADERS["cuda"]``), so an indexing, layout or pipeline
slip in them shows. Only the helper functions with inline PTX are replaced, each
by a C++ emulation written from the PTX ISA:

* the warp collectives meet their warp (every lane posts its operands, the lanes
  wait for each other, each takes what it needs from the others' posts): ``mma``
  (``dfl_mma``, PTX's m16n8k16 fragment layout, products summed exactly and
  rounded once to float32), ``ldmatrix.x4`` and ``.x4.trans`` (lane ``L`` gives
  the address of row ``L % 8`` of matrix ``L / 8``) and ``__shfl_xor_sync``;
  lanes of a warp that do not all reach one fail the run;
* ``cp.async`` copies (zero-filled when their source size is 0) are queued per
  thread in commit groups and land either at issue (``early``: a refill of a
  buffer other threads still read shows) or only when ``cp.async.wait_group``
  retires their group (``late``: a read before the wait shows); a copy never
  waited for fails the run, as does one to a misaligned or out-of-range address;
* dynamic shared memory (``extern __shared__``) is the spec's ``shared_memory``
  bytes, filled with 0xFF (NaN in every float type) before each threadgroup, with
  guard bytes after it that a write past its end changes (the run fails); a
  cluster's CTAs (``spec.cluster``) each have their own copy and guard;
* a thread-block cluster's barrier (``dfl_cluster_sync``) meets every thread of
  its CTAs, and ``dfl_cluster_map`` (``mapa``) takes an address in the running
  CTA's shared memory to the same offset in another rank's (an address outside
  it, or a rank outside the cluster, fails the run);
* the half-precision pair arithmetic (``fma.rn.bf16x2``, ``cvt.rn.*x2.f32``, the
  attention's ``dfl_pack``, the scaled-weight form's ``dfl_scaled``) is computed per
  half and rounded once to nearest even.

Threads run as coroutines, one threadgroup at a time, or one cluster at a time
with its CTAs together (the scheduler of :mod:`.group_emulator`, whose warp
meetings release a warp once all its lanes are there; a CTA's barrier releases
that CTA, the cluster's barrier the whole cluster), in one of two orders: every
thread in turn to its next stop (warps move together, so a warp with less to do
runs ahead of the others) or ``eager``, each warp as far as it goes before the
next starts (warp 0 runs ahead). :meth:`TensorEmulator.launch` has the contract
of ``dflash.metal.groups.launch_groups``.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Collection, Iterator, Sequence

import mlx.core as mx

from dflash.metal import tensor_attention, tensor_qmm
from dflash.metal.groups import HEADERS, GroupKernelSpec
from dflash.metal.sources import CUDA

from .compile_check import EMULATOR_FLAGS, METAL_SHIM, run_compiler
from .driver import buffer_args, driver_main
from .group_emulator import (
    _DRIVER,
    _DRIVER_INCLUDES,
    CUDA_TYPES,
    DriverLauncher,
    cuda_params,
    element_dtype,
    group_case,
)

SUFFIX = {mx.float32: "f32", mx.float16: "f16", mx.bfloat16: "bf16"}
CANARY_BYTES = 4096
CANARY = 0xA5
# Bytes after the dynamic shared memory whose change shows a write past its end.
GUARD_BYTES = 256
# Slots of the shim's per-thread state: a cluster of 8 CTAs of 256 threads.
MAX_SLOTS = 2048
# The helper texts (inline PTX) the shim below emulates; cut out of a spec's helpers.
EMULATED_HELPERS = (
    tensor_qmm._HELPERS,
    tensor_qmm._LEAN_HELPERS,
    tensor_qmm._LEAN_BYTES_HELPERS,
    tensor_attention.TENSOR_HELPERS,
    tensor_qmm._SCALED_HELPERS,
    tensor_qmm.launch_bounds(128),
    tensor_qmm.launch_bounds(256),
    tensor_qmm.CLUSTER_HELPERS,
)
# A kernel attributes header (launch bounds, cluster dims): g++ has no such attributes.
_ATTRIBUTES = re.compile(r"\n#undef __global__\n#define __global__ [^\n]*\n")
# The unit's bytes of dynamic shared memory, every CTA's copy of a cluster.
SHARED_STORE = "dfl_shared_store"
_EXTERN_SHARED = re.compile(
    r"extern __shared__ (?:__align__\(\d+\) )?([\w ]+?) (\w+)\[\];"
)

SHIM = (
    f"""
#include "{METAL_SHIM}"
#define DFL_SLOTS {MAX_SLOTS}
"""
    + r"""
// Only its types: none of Metal's address-space words.
#undef device
#undef constant
#undef thread
#undef threadgroup
#include <cmath>
#include <cstdint>
#include <cstring>
#include <deque>
#include <limits>

namespace metal {
enum class mem_flags { mem_none, mem_device, mem_threadgroup };
void threadgroup_barrier(mem_flags flags);
}  // namespace metal
namespace cuda {
namespace std = ::std;
}
uint dfl_current_slot();    // the thread's slot in its cluster: per-thread state
uint dfl_current_thread();  // threadIdx.x
uint dfl_current_group();   // blockIdx.x
uint dfl_current_cta();     // the CTA's rank in its cluster
void dfl_warp_sync();
void dfl_cluster_sync();

struct dim1 { uint x; };
#define threadIdx (dim1{dfl_current_thread()})
#define blockIdx (dim1{dfl_current_group()})
// Dynamic shared memory is a namespace-scope array of the unit, one copy a CTA of the
// cluster (clusters run one after another); the body's extern declaration becomes a
// pointer to the running CTA's copy.
#define __shared__
#define __device__
#define __align__(n) __attribute__((aligned(n)))
inline void __syncthreads() {
  metal::threadgroup_barrier(metal::mem_flags::mem_threadgroup);
}

struct uint4 { uint32_t x, y, z, w; };
struct uint2 { uint32_t x, y; };
struct alignas(16) float4 { float x, y, z, w; };

typedef _Float16 __half;
// The Metal shim's bfloat16 (round to nearest even, as __float2bfloat16).
typedef bfloat16_t __nv_bfloat16;

inline float __uint_as_float(uint32_t u) { float f; std::memcpy(&f, &u, 4); return f; }
inline float __fadd_rn(float a, float b) { return a + b; }
inline float __fmul_rn(float a, float b) { return a * b; }
// CUDA's rsqrtf is approximate (the GPU tests hold its bits to mlx's); here exact.
inline float rsqrtf(float x) { return 1.0f / std::sqrt(x); }
inline float __fsub_rn(float a, float b) { return a - b; }
inline uint32_t __byte_perm(uint32_t a, uint32_t b, uint32_t s) {
  const uint64_t pool = uint64_t(a) | (uint64_t(b) << 32);
  uint32_t out = 0;
  for (int i = 0; i < 4; ++i) {
    out |= uint32_t((pool >> (8 * ((s >> (4 * i)) & 7))) & 0xFF) << (8 * i);
  }
  return out;
}

// Half values of 16-bit words and back (round to nearest even).
inline float dfl_emu_value(uint32_t h, const __nv_bfloat16*) { return __uint_as_float(h << 16); }
inline float dfl_emu_value(uint32_t h, const __half*) {
  uint16_t b = uint16_t(h); __half v; std::memcpy(&v, &b, 2); return float(v);
}
inline uint32_t dfl_emu_word(float f, const __nv_bfloat16*) { return __nv_bfloat16(f).bits; }
inline uint32_t dfl_emu_word(float f, const __half*) {
  __half v = __half(f); uint16_t b; std::memcpy(&b, &v, 2); return b;
}

// ----- the running cluster's dynamic shared memory: a copy a CTA, `stride` apart -----
static unsigned char* dfl_shared_begin = nullptr;  // CTA 0's copy
static size_t dfl_shared_bytes = 0;
static size_t dfl_shared_stride = 0;
static uint dfl_cluster_ctas = 1;

inline unsigned char* dfl_cta_shared(uint cta) {
  return dfl_shared_begin == nullptr ? nullptr : dfl_shared_begin + cta * dfl_shared_stride;
}
// The running CTA's copy.
inline unsigned char* dfl_shared_now() { return dfl_cta_shared(dfl_current_cta()); }

// Aborts unless [p, p + bytes) is 16-byte aligned and inside the running CTA's copy.
inline void dfl_check_shared(const void* p, size_t bytes) {
  const unsigned char* c = static_cast<const unsigned char*>(p);
  const unsigned char* mine = dfl_shared_now();
  if ((reinterpret_cast<size_t>(c) & 15) || mine == nullptr || c < mine ||
      c + bytes > mine + dfl_shared_bytes) {
    std::abort();
  }
}

// mapa: the same offset of `p` (in the running CTA's shared memory) in CTA `rank`'s.
inline const float* dfl_cluster_map(const float* p, uint32_t rank) {
  const unsigned char* c = reinterpret_cast<const unsigned char*>(p);
  const unsigned char* mine = dfl_shared_now();
  if (mine == nullptr || c < mine || c >= mine + dfl_shared_bytes) {
    std::fprintf(stderr, "group %u: dfl_cluster_map of an address outside its shared memory\n",
                 dfl_current_group());
    std::abort();
  }
  if (rank >= dfl_cluster_ctas) {
    std::fprintf(stderr, "group %u: dfl_cluster_map to rank %u of a cluster of %u\n",
                 dfl_current_group(), rank, dfl_cluster_ctas);
    std::abort();
  }
  return reinterpret_cast<const float*>(dfl_cta_shared(rank) + (c - mine));
}

// ----- warp collectives: each lane posts, the warp meets, each reads the others -----
struct DflPost {
  uint32_t a[4]; uint32_t b[2]; const unsigned char* row; uint32_t word;
  uint32_t kind;  // which collective: 1 mma, 2 ldmatrix, 3 ldmatrix.trans, 4 + mask shuffle,
                  // 40 / 41 integer min / max reduction
  uint32_t seq;   // how many collectives the lane met before
};
// Two slots a lane, used alternately: a lane can post its next collective while a
// slower lane still reads this one (it cannot post twice before the warp meets).
static DflPost dfl_posts[2][DFL_SLOTS];
static unsigned dfl_collectives[DFL_SLOTS];

// Posts `mine` (of collective `kind`), meets the warp; returns the warp's 32 posts.
// Lanes that meet at different collectives (some skipped one) end the run.
inline const DflPost* dfl_meet(DflPost mine, uint32_t kind) {
  const uint me = dfl_current_slot();
  mine.kind = kind;
  mine.seq = dfl_collectives[me]++;
  dfl_posts[mine.seq & 1u][me] = mine;
  dfl_warp_sync();
  const DflPost* warp = dfl_posts[mine.seq & 1u] + (me & ~31u);
  for (uint lane = 0; lane < 32; ++lane) {
    if (warp[lane].kind != kind || warp[lane].seq != mine.seq) {
      std::fprintf(stderr, "group %u: lanes of warp %u meet at different warp collectives\n",
                   dfl_current_group(), dfl_current_thread() / 32);
      std::_Exit(7);  // no exit handlers: they would free the stack this runs on
    }
  }
  return warp;
}
inline uint dfl_lane() { return dfl_current_slot() & 31u; }

// mma.sync.m16n8k16.row.col, float32 accumulate (PTX fragment layout).
template <typename H>
inline void dfl_mma_warp(float* d, const uint32_t* a, uint32_t b0, uint32_t b1, const H* tag) {
  const DflPost* warp = dfl_meet(DflPost{{a[0], a[1], a[2], a[3]}, {b0, b1}, nullptr, 0, 0, 0}, 1);
  const uint gid = dfl_lane() / 4, tig = dfl_lane() % 4;
  for (int i = 0; i < 4; ++i) {
    const uint row = gid + 8 * (i / 2), col = 2 * tig + (i % 2);
    double sum = double(d[i]);
    for (uint k = 0; k < 16; ++k) {
      // A element (row, k): lane (row % 8, (k % 8) / 2), register (row >= 8) + 2 (k >= 8).
      const DflPost& ha = warp[(row % 8) * 4 + (k % 8) / 2];
      const uint32_t wa = ha.a[(row >= 8) + 2 * (k >= 8)] >> (16 * (k % 2));
      // B element (k, col): lane (col, (k % 8) / 2), register (k >= 8).
      const DflPost& hb = warp[col * 4 + (k % 8) / 2];
      const uint32_t wb = hb.b[k >= 8] >> (16 * (k % 2));
      sum += double(dfl_emu_value(wa & 0xFFFF, tag)) * double(dfl_emu_value(wb & 0xFFFF, tag));
    }
    d[i] = float(sum);
  }
}
// The matmul's form (registers one by one) and the attention's (arrays).
template <typename H>
inline void dfl_mma(float* d, uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                    uint32_t b0, uint32_t b1, const H* tag) {
  const uint32_t a[4] = {a0, a1, a2, a3};
  dfl_mma_warp(d, a, b0, b1, tag);
}
template <typename H>
inline void dfl_mma(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1,
                    const H* tag) {
  dfl_mma_warp(d, a, b0, b1, tag);
}

// ldmatrix.sync.aligned.m8n8.x4[.trans].shared.b16: lane L gives row L % 8 of
// matrix L / 8. Plain: register m holds (row lane / 4, columns 2 (lane % 4), +1) of
// matrix m; transposed: (rows 2 (lane % 4), +1, column lane / 4), first in the low half.
inline void dfl_ldmatrix(uint32_t (&r)[4], const void* row, bool trans) {
  dfl_check_shared(row, 16);
  const DflPost* warp =
      dfl_meet(DflPost{{0, 0, 0, 0}, {0, 0}, static_cast<const unsigned char*>(row), 0, 0, 0},
               trans ? 3 : 2);
  const uint lane = dfl_lane();
  for (int m = 0; m < 4; ++m) {
    if (trans) {
      uint16_t lo, hi;
      std::memcpy(&lo, warp[8 * m + 2 * (lane % 4)].row + 2 * (lane / 4), 2);
      std::memcpy(&hi, warp[8 * m + 2 * (lane % 4) + 1].row + 2 * (lane / 4), 2);
      r[m] = uint32_t(lo) | (uint32_t(hi) << 16);
    } else {
      std::memcpy(&r[m], warp[8 * m + lane / 4].row + 4 * (lane % 4), 4);
    }
  }
}
inline void dfl_ldmatrix_x4(uint32_t (&r)[4], const void* row) { dfl_ldmatrix(r, row, false); }
inline void dfl_ldmatrix_x4_trans(uint32_t (&r)[4], const void* row) {
  dfl_ldmatrix(r, row, true);
}

// __shfl_xor_sync over the whole warp (the only mask the bodies use).
template <typename V>
inline V __shfl_xor_sync(unsigned mask, V value, int lane_mask) {
  static_assert(sizeof(V) == 4, "32-bit shuffles only");
  if (mask != 0xffffffffu || lane_mask < 0 || lane_mask > 31) std::abort();
  DflPost mine{{0, 0, 0, 0}, {0, 0}, nullptr, 0, 0, 0};
  std::memcpy(&mine.word, &value, 4);
  const DflPost* warp = dfl_meet(mine, 4 + uint32_t(lane_mask));
  V out;
  std::memcpy(&out, &warp[dfl_lane() ^ uint(lane_mask)].word, 4);
  return out;
}

// __reduce_min_sync / __reduce_max_sync of 32-bit signed values over the whole warp.
inline int dfl_reduce_warp(unsigned mask, int value, bool take_max) {
  if (mask != 0xffffffffu) std::abort();
  DflPost mine{{0, 0, 0, 0}, {0, 0}, nullptr, 0, 0, 0};
  std::memcpy(&mine.word, &value, 4);
  const DflPost* warp = dfl_meet(mine, take_max ? 41 : 40);
  int out = value;
  for (uint lane = 0; lane < 32; ++lane) {
    int other;
    std::memcpy(&other, &warp[lane].word, 4);
    out = take_max ? (other > out ? other : out) : (other < out ? other : out);
  }
  return out;
}
inline int __reduce_min_sync(unsigned mask, int value) {
  return dfl_reduce_warp(mask, value, false);
}
inline int __reduce_max_sync(unsigned mask, int value) {
  return dfl_reduce_warp(mask, value, true);
}

// Two floats rounded to the 16-bit type, packed (first in the low half), and their
// rounded values (cvt.rn.bf16x2.f32 / __floats2half2_rn).
template <typename H>
inline uint32_t dfl_pack(float a, float b, float& lo, float& hi, const H* tag) {
  const uint32_t low = dfl_emu_word(a, tag), high = dfl_emu_word(b, tag);
  lo = dfl_emu_value(low, tag);
  hi = dfl_emu_value(high, tag);
  return low | (high << 16);
}

template <typename H>
inline uint32_t dfl_ones(const H* tag) {
  return dfl_emu_word(1.0f, tag) | (dfl_emu_word(1.0f, tag) << 16);
}

// fma.rn.{bf16,f16}x2 r * 1 - magic, per half (exact for the integers here).
template <typename H>
inline uint32_t dfl_pair_fma(uint32_t r, float magic, const H* tag) {
  const float lo = dfl_emu_value(r & 0xFFFF, tag) - magic;
  const float hi = dfl_emu_value(r >> 16, tag) - magic;
  return dfl_emu_word(lo, tag) | (dfl_emu_word(hi, tag) << 16);
}
inline uint32_t dfl_q4(uint32_t v, const __nv_bfloat16* tag) {
  return dfl_pair_fma((v & 0x000F000Fu) | 0x43004300u, 128.0f, tag);
}
inline uint32_t dfl_q4(uint32_t v, const __half* tag) {
  return dfl_pair_fma((v & 0x000F000Fu) | 0x64006400u, 1024.0f, tag);
}
// The scaled form's one-lop3 spelling of dfl_q4: the same pair.
template <typename H>
inline uint32_t dfl_q4_lop3(uint32_t v, const H* tag) {
  return dfl_q4(v, tag);
}
// A double rounded to float by round-to-odd: rounding that float to a half type then
// gives the double's correctly rounded half (float keeps 13+ more bits than either).
inline float dfl_emu_round_odd(double d) {
  float f = float(d);
  if (double(f) == d) return f;
  if (std::fabs(double(f)) > std::fabs(d)) f = std::nextafter(f, 0.0f);
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  bits |= 1u;
  std::memcpy(&f, &bits, 4);
  return f;
}
// fma.rn.{bf16,f16}x2 q * s + b per half, rounded once (the scaled-weight form).
template <typename H>
inline uint32_t dfl_scaled(uint32_t q, uint32_t s, uint32_t b, const H* tag) {
  uint32_t out = 0;
  for (int h = 0; h < 2; ++h) {
    const int shift = 16 * h;
    const double v = double(dfl_emu_value((q >> shift) & 0xFFFF, tag)) *
                         double(dfl_emu_value((s >> shift) & 0xFFFF, tag)) +
                     double(dfl_emu_value((b >> shift) & 0xFFFF, tag));
    out |= dfl_emu_word(dfl_emu_round_odd(v), tag) << shift;
  }
  return out;
}
template <typename H>
inline uint32_t dfl_q8(uint32_t lo, uint32_t hi, const H* tag) {
  // cvt.rn.*x2.f32 d, hi, lo: the first operand to the upper half.
  return dfl_emu_word(float(lo), tag) | (dfl_emu_word(float(hi), tag) << 16);
}
// prmt.b32's default mode: result byte i is byte (nibble i & 7) of hi:lo, or, where
// the nibble's bit 3 is set, that byte's sign bit over all 8 bits.
inline uint32_t dfl_emu_prmt(uint32_t lo, uint32_t hi, uint32_t selector) {
  const uint64_t pool = uint64_t(lo) | (uint64_t(hi) << 32);
  uint32_t out = 0;
  for (int i = 0; i < 4; ++i) {
    const uint32_t nibble = (selector >> (4 * i)) & 0xF;
    uint32_t byte = uint32_t(pool >> (8 * (nibble & 7))) & 0xFF;
    if (nibble & 8) byte = (byte & 0x80) ? 0xFF : 0x00;
    out |= byte << (8 * i);
  }
  return out;
}
// fma.rn.{bf16,f16}x2 r * 1 + c per half, rounded once.
template <typename H>
inline uint32_t dfl_emu_pair_add(uint32_t r, uint32_t c, const H* tag) {
  uint32_t out = 0;
  for (int h = 0; h < 2; ++h) {
    const int shift = 16 * h;
    const double v = double(dfl_emu_value((r >> shift) & 0xFFFF, tag)) +
                     double(dfl_emu_value((c >> shift) & 0xFFFF, tag));
    out |= dfl_emu_word(dfl_emu_round_odd(v), tag) << shift;
  }
  return out;
}
// The lean byte decode (tensor_qmm.LEAN_BYTES), instruction by instruction.
inline uint32_t dfl_q8_lean(uint32_t lo, uint32_t hi, uint32_t spread, uint32_t sign,
                            const __nv_bfloat16* tag) {
  const uint32_t r = (dfl_emu_prmt(lo, hi, spread) & 0x007F007Fu) | 0x43004300u;
  const uint32_t c = ~dfl_emu_prmt(lo, hi, sign) & 0xC300C300u;
  return dfl_emu_pair_add(r, c, tag);
}
inline uint32_t dfl_q8_lean(uint32_t lo, uint32_t hi, uint32_t spread, uint32_t,
                            const __half* tag) {
  const uint32_t r = (dfl_emu_prmt(lo, hi, spread) & 0x00FF00FFu) | 0x64006400u;
  return dfl_emu_pair_add(r, 0xE400E400u, tag);
}

// ----- cp.async: per-thread commit groups, landing early or late -----
struct DflCopy { unsigned char* dst; unsigned char data[16]; int bytes; };
struct DflThreadCopies { std::vector<DflCopy> open; std::deque<std::vector<DflCopy>> groups; };
static DflThreadCopies dfl_copies[DFL_SLOTS];
static bool dfl_late = false;

inline void dfl_land(const std::vector<DflCopy>& copies) {
  for (const DflCopy& c : copies) std::memcpy(c.dst, c.data, c.bytes);
}
inline void dfl_queue(unsigned char* dst, const unsigned char* src, int bytes, bool valid) {
  dfl_check_shared(dst - (reinterpret_cast<size_t>(dst) & 15), 16);
  DflCopy c{dst, {0}, bytes};
  if (valid) std::memcpy(c.data, src, bytes);
  if (dfl_late) {
    dfl_copies[dfl_current_slot()].open.push_back(c);
  } else {
    dfl_land({c});
  }
}
inline void dfl_copy16(unsigned char* dst, const unsigned char* src, bool fast) {
  if (fast && (reinterpret_cast<size_t>(src) & 15)) {
    std::abort();  // cp.async would fault on a misaligned source
  }
  dfl_queue(dst, src, 16, true);
}
// The lean issue's (tensor_qmm.LEAN_ISSUE): a shared-state-space address is the offset
// into the running CTA's shared memory; its 16-byte cp.async faults on a misaligned source.
inline uint32_t dfl_shared_address(const void* p) {
  return uint32_t(static_cast<const unsigned char*>(p) - dfl_shared_now());
}
inline void dfl_cp16(uint32_t dst, const unsigned char* src) {
  if (reinterpret_cast<size_t>(src) & 15) std::abort();
  dfl_queue(dfl_shared_now() + dst, src, 16, true);
}
// Its copies where a pointer is not 16-byte aligned: plain 16-bit loads and stores.
inline void dfl_copy_plain(unsigned char* dst, const unsigned char* src, int n) {
  dfl_check_shared(dst, 2 * n);
  std::memcpy(dst, src, 2 * n);
}
inline void dfl_copy_small(unsigned char* dst, const unsigned char* src, int bytes, bool fast) {
  if (bytes != 4 && bytes != 8 && bytes != 16) std::abort();  // no such cp.async size
  // cp.async faults on a source or destination not aligned to its size.
  if (fast && ((reinterpret_cast<size_t>(src) | reinterpret_cast<size_t>(dst)) & (bytes - 1))) {
    std::abort();
  }
  dfl_queue(dst, src, bytes, true);
}
// The attention's form: 16 bytes, zero-filled (source size 0) when !fill.
inline void dfl_cp_async16(void* shared, const void* global, bool fill) {
  if ((reinterpret_cast<size_t>(shared) | reinterpret_cast<size_t>(global)) & 15) {
    std::abort();
  }
  dfl_queue(static_cast<unsigned char*>(shared), static_cast<const unsigned char*>(global),
            16, fill);
}
inline void dfl_commit() {
  DflThreadCopies& t = dfl_copies[dfl_current_slot()];
  t.groups.push_back(t.open);
  t.open.clear();
}
inline void dfl_cp_async_commit() { dfl_commit(); }
template <int PENDING>
inline void dfl_wait() {
  DflThreadCopies& t = dfl_copies[dfl_current_slot()];
  while (int(t.groups.size()) > PENDING) {
    dfl_land(t.groups.front());
    t.groups.pop_front();
  }
}
template <int PENDING>
inline void dfl_cp_async_wait() { dfl_wait<PENDING>(); }

// A cluster of `ctas` threadgroups starts: no copies, no collectives, each CTA's
// shared memory (`bytes` a CTA, `stride` apart from `shared` on) poisoned and guarded.
inline void dfl_begin_group(unsigned char* shared, size_t bytes, size_t stride, uint ctas) {
  for (DflThreadCopies& t : dfl_copies) { t.open.clear(); t.groups.clear(); }
  std::memset(dfl_collectives, 0, sizeof(dfl_collectives));
  dfl_shared_begin = shared;
  dfl_shared_bytes = bytes;
  dfl_shared_stride = stride;
  dfl_cluster_ctas = ctas;
  for (uint c = 0; shared != nullptr && c < ctas; ++c) {
    std::memset(dfl_cta_shared(c), 0xFF, bytes);
    std::memset(dfl_cta_shared(c) + bytes, 0xA5, GUARD);
  }
}
// Whether no CTA of the cluster wrote a guard byte.
inline bool dfl_guard_intact() {
  for (uint c = 0; dfl_shared_begin != nullptr && c < dfl_cluster_ctas; ++c) {
    for (size_t i = 0; i < GUARD; ++i) {
      if (dfl_cta_shared(c)[dfl_shared_bytes + i] != 0xA5) return false;
    }
  }
  return true;
}
// Whether every queued copy was retired by a wait (committed empty groups aside).
inline bool dfl_copies_done() {
  for (const DflThreadCopies& t : dfl_copies) {
    if (!t.open.empty()) return false;
    for (const auto& g : t.groups) if (!g.empty()) return false;
  }
  return true;
}
// The merged split sum's memory operations: groups run one after another here (a
// cluster's CTAs on one CPU thread), so the fence has nothing to order and the atomic
// is a plain read-modify-write.
inline void __threadfence() {}
inline int atomicAdd(int* address, int value) {
  const int old = *address;
  *address = old + value;
  return old;
}
inline float __ldcg(const float* p) { return *p; }
// A 16-byte load (CUDA faults on a misaligned one: so does this).
inline float4 __ldcg(const float4* p) {
  if ((reinterpret_cast<size_t>(p) & 15) != 0) std::abort();
  return *p;
}
inline void dfl_pairs(uint4 v, uint32_t* r) {
  r[0] = __byte_perm(v.x, v.z, 0x5410);
  r[1] = __byte_perm(v.x, v.z, 0x7632);
  r[2] = __byte_perm(v.y, v.w, 0x5410);
  r[3] = __byte_perm(v.y, v.w, 0x7632);
}
"""
).replace("GUARD", str(GUARD_BYTES))

_GROUP_ACCESS = r"""
uint dfl_group_now = 0;  // the running cluster's first threadgroup
uint dfl_current_slot() { return current; }
uint dfl_current_thread() { return current % cta_threads; }
uint dfl_current_cta() { return current / cta_threads; }
uint dfl_current_group() { return dfl_group_now + current / cta_threads; }
"""


def _unit_name(index: int, dtype: mx.Dtype) -> str:
    return f"unit{index}_{SUFFIX[dtype]}"


def _shared_stride(spec: GroupKernelSpec) -> int:
    """Bytes from one CTA's copy of the dynamic shared memory to the next (the copy,
    its guard bytes, rounded up to 16)."""
    return -(-(spec.shared_memory + GUARD_BYTES) // 16) * 16


def _shared_source(spec: GroupKernelSpec) -> tuple[str, str]:
    """The unit's store of the body's dynamic shared memory (one copy a CTA of the
    spec's cluster, :data:`SHARED_STORE`; empty when the body has none) and the kernel
    source, its ``extern __shared__`` declaration made a pointer to the running CTA's
    copy.

    A body without dynamic shared memory may declare static ``DFL_SHARED`` arrays
    (outside clusters): they become function statics, one copy shared by the running
    CTA's threads (CTAs run one after another), as in :mod:`.group_emulator`.

    Raises:
        ValueError: The body declares static shared arrays beside dynamic shared
            memory or in a cluster (not emulated).
    """
    source = spec.source(CUDA)
    found = _EXTERN_SHARED.search(source)
    rest = _EXTERN_SHARED.sub("", source)
    if found is None and spec.cluster == 1 and "__shared__" not in rest:
        return "", re.sub(r"\bDFL_SHARED\b", "static", source)
    if "__shared__" in rest or "DFL_SHARED" in rest:
        raise ValueError(f"{spec.base}: static shared arrays are not emulated")
    if found is None:
        return "", source
    ctype, name = found.groups()
    pointer = f"{ctype}* const {name} = reinterpret_cast<{ctype}*>(dfl_shared_now());"
    size = spec.cluster * _shared_stride(spec)
    store = f"alignas(16) unsigned char {SHARED_STORE}[{size}];\n"
    return store, source[: found.start()] + pointer + source[found.end() :]


def _helpers(spec: GroupKernelSpec) -> str:
    """The spec's helpers less the emulated ones (what is left is plain C++).

    Raises:
        ValueError: Inline PTX is left (a helper the shim does not emulate).
    """
    helpers = _ATTRIBUTES.sub("\n", spec.helpers)
    for text in EMULATED_HELPERS:
        helpers = helpers.replace(text, "")
    if "asm" in helpers:
        raise ValueError(f"{spec.base}: helpers with inline PTX the shim lacks")
    return helpers


def _unit(
    index: int, spec: GroupKernelSpec, dtype: mx.Dtype, cuda_branches: bool = False
) -> str:
    """One spec at one ``T``: mlx's CUDA header macros, the plain helpers, the shared
    memory and the kernel with mlx's CUDA signature; with ``cuda_branches``, compiled
    with ``__CUDACC__`` defined (the text's ``#ifdef __CUDACC__`` branches, as nvcc
    takes them)."""
    args = cuda_params(spec, dtype)
    store, source = _shared_source(spec)
    unit = (
        f"namespace {_unit_name(index, dtype)} {{\n"
        + HEADERS[CUDA]
        + _helpers(spec)
        + store
        + f"void kernel({', '.join(args)}) {{\n"
        f"  using T = {CUDA_TYPES[dtype]};\n" + source + "\n}\n}\n"
    )
    if cuda_branches:
        return "#define __CUDACC__ 1\n" + unit + "#undef __CUDACC__\n"
    return unit


def _case(index: int, spec: GroupKernelSpec, dtype: mx.Dtype) -> str:
    ctypes = [
        [CUDA_TYPES[element_dtype(kind, dtype)] for kind in kinds]
        for kinds in (spec.input_types, spec.output_types)
    ]
    # Inputs start ``dfl_offset`` bytes into their buffers (the files carry as many
    # leading bytes): 2 puts every input off its 16-byte boundary.
    args = [
        (
            arg.replace(".data())", ".data() + dfl_offset)", 1)
            if i < len(ctypes[0])
            else arg
        )
        for i, arg in enumerate(buffer_args(*ctypes))
    ]
    space = _unit_name(index, dtype)
    shared = (
        f"{space}::{SHARED_STORE}, {spec.shared_memory}, {_shared_stride(spec)}"
        if _shared_source(spec)[0]
        else "nullptr, 0, 0"
    )
    setup = (
        f"    if (threads * {spec.cluster} > {MAX_SLOTS}) {{\n"
        f'      std::fprintf(stderr, "{spec.cluster} CTAs of %u threads overflow the '
        f"shim's {MAX_SLOTS} slots\\n\", threads);\n"
        "      return 9;\n    }\n"
        '    dfl_late = std::getenv("DFL_CP_LATE") != nullptr;\n'
        '    eager_warps = std::getenv("DFL_EAGER_WARPS") != nullptr;\n'
        '    const size_t dfl_offset = std::getenv("DFL_OFFSET") ? 2 : 0;\n'
    )
    per_group = (
        "      dfl_group_now = group;\n"
        f"      dfl_begin_group({shared}, {spec.cluster});\n"
    )
    check = (
        "      if (!dfl_copies_done()) {\n"
        '        std::fprintf(stderr, "group %u: cp.async copies never waited for\\n", group);\n'
        "        return 5;\n      }\n"
        "      if (!dfl_guard_intact()) {\n"
        '        std::fprintf(stderr, "group %u: shared memory written past its end\\n", group);\n'
        "        return 6;\n      }\n"
    )
    call = f"{space}::kernel({', '.join(args)});"
    return group_case(space, call, setup, per_group, check, spec.cluster)


class TensorEmulator(DriverLauncher):
    """Runs CUDA threadgroup specs (tensor-core bodies and plain ones) on the CPU.

    Args:
        workdir: Directory for the source and binary.
        specs: The specs to build, each at its ``dtypes`` (default: every spec of
            ``tensor_qmm``).
        compiler: C++ compiler.
        cuda_branches: Compile the units with ``__CUDACC__`` defined (their CUDA
            branches; the emulated helpers stand in for CUDA's maths functions).
        bfloat16_only: Specs built in ``bfloat16`` alone (variants whose tests run
            them at that type; the build's time is its units'). Launching one at
            another type raises ``KeyError``.

    Attributes:
        late: Land ``cp.async`` copies at their wait (else at issue); settable
            between launches.
        eager: Run each warp as far as it goes (to a barrier) before the next
            (else every thread in turn to its next stop, warps moving together:
            they meet a slip in another order); settable between launches.
        misaligned: Start every input 2 bytes past a 16-byte boundary (the body
            then copies without ``cp.async``); settable between launches.
    """

    def __init__(
        self,
        workdir: Path,
        specs: Sequence[GroupKernelSpec] = tensor_qmm.SPECS,
        compiler: str = "g++",
        cuda_branches: bool = False,
        bfloat16_only: Collection[GroupKernelSpec] = (),
    ) -> None:
        super().__init__()
        self.workdir = Path(workdir)
        self.specs = list(specs)
        self.late = False
        self.eager = False
        self.misaligned = False
        self.binary = self.workdir / "tensor_emulator"
        narrowed = {id(spec) for spec in bfloat16_only}
        self.built: set[str] = set()
        units, cases = [], []
        for i, spec in enumerate(self.specs):
            if self.specs.index(spec) != i:
                continue  # listed again: key() names its first place
            dtypes = (mx.bfloat16,) if id(spec) in narrowed else spec.dtypes
            assert all(dtype in spec.dtypes for dtype in dtypes), spec.base
            for dtype in dtypes:
                units.append(_unit(i, spec, dtype, cuda_branches))
                cases.append(_case(i, spec, dtype))
                self.built.add(_unit_name(i, dtype))
        driver = _DRIVER + _GROUP_ACCESS
        driver += driver_main(
            ("groups", "threads"), "".join(cases), CANARY_BYTES, CANARY
        )
        # The units come before the scheduler (as in the group emulator); the shim's
        # forward declarations bind them to it.
        source = self.workdir / "tensor_emulator.cpp"
        source.write_text(_DRIVER_INCLUDES + SHIM + "".join(units) + driver)
        command = [compiler, *EMULATOR_FLAGS, "-o", str(self.binary), str(source)]
        self.build = run_compiler(command, self.workdir)

    def key(self, spec: GroupKernelSpec, dtype: mx.Dtype) -> str:
        name = _unit_name(self.specs.index(spec), dtype)
        if name not in self.built:
            raise KeyError(f"{spec.base} was not built in {dtype} (bfloat16_only)")
        return name

    def run_options(self) -> tuple[dict[str, str], bytes]:
        env = {"DFL_CP_LATE": "1"} if self.late else {}
        if self.eager:
            env["DFL_EAGER_WARPS"] = "1"
        if self.misaligned:
            env["DFL_OFFSET"] = "1"
        return env, b"\0\0" if self.misaligned else b""


def route_launches_to(emulator: "TensorEmulator", monkeypatch) -> None:
    """The kernel path taken as on CUDA (launched directly, no ``mx.compile``), every
    launch run by ``emulator``."""
    from dflash.metal import backend, groups

    monkeypatch.setattr(backend, "BACKEND", "cuda")
    monkeypatch.setenv(backend.COMPILE_ENV, "0")
    monkeypatch.setattr(groups, "launch_groups", emulator.launch)


def pretend_cluster_device(
    emulator: "TensorEmulator",
    monkeypatch,
    copies: Sequence[tuple[dict, object, GroupKernelSpec]],
) -> Iterator["TensorEmulator"]:
    """A fixture's body: ``bind_tensor_core`` on a pretend CUDA device with clusters
    (mlx's graphs off; the wave split, the merged split sum and the member-major store
    on, the folded offset off), its launches run by ``emulator``, and each ``(table,
    key, spec)`` of ``copies`` put in its form table for the plans to pick (the
    emulator's copies: specs compare by identity). Yields the emulator; afterwards
    its landing and warp order are reset."""
    monkeypatch.setattr(tensor_qmm.backend, "BACKEND", "cuda")
    monkeypatch.setattr(tensor_qmm, "device_clusters", lambda: True)
    monkeypatch.setenv("MLX_USE_CUDA_GRAPHS", "0")
    monkeypatch.setenv(tensor_qmm.WAVE_SPLIT_ENV, "1")
    monkeypatch.setenv(tensor_qmm.MERGED_SPLIT_SUM_ENV, "1")
    monkeypatch.setenv(tensor_qmm.FOLDED_OFFSET_ENV, "0")
    monkeypatch.setenv(tensor_qmm.MEMBER_MAJOR_ENV, "1")
    for table, key, spec in copies:
        monkeypatch.setitem(table, key, spec)
    from dflash.metal import groups

    monkeypatch.setattr(groups, "launch_groups", emulator.launch)
    # Plans hold specs: none from before the copies, none of them after.
    tensor_qmm.launch_plan.cache_clear()
    yield emulator
    tensor_qmm.launch_plan.cache_clear()
    emulator.late = False
    emulator.eager = False
