"""The CUDA tensor-core matmul bodies run on the CPU: the body text itself, its helpers emulated.

:mod:`.tensor_qmm_model` re-derives the kernel's arithmetic in numpy; this module
runs the very body text of ``dflash.metal.tensor_qmm`` (compiled by g++), so an
indexing, layout or pipeline slip in it shows. Only the helper functions (the
inline PTX) are replaced, each by a C++ emulation written from the PTX ISA:

* ``dfl_mma`` is warp-collective, like ``mma.sync``: each lane posts its A, B and C
  registers, the threads meet at a barrier, each lane assembles its four outputs
  from the registers of the lanes that hold them (PTX's m16n8k16 fragment layout)
  and sums them exactly (rounded once to float32), and they meet again;
* ``cp.async`` copies are queued per thread in commit groups and land either at
  issue (``early``: a refill of a buffer other threads still read shows) or only
  when ``cp.async.wait_group`` retires their group (``late``: a read before the
  wait shows);
* the half-precision pair arithmetic (``fma.rn.bf16x2``, ``cvt.rn.*x2.f32``) is
  computed per half and rounded to nearest even.

Threads run as coroutines, one threadgroup at a time (the scheduler of
:mod:`.group_emulator`). :meth:`TensorEmulator.launch` has the contract of
``dflash.metal.groups.launch_groups``.
"""

from __future__ import annotations

import subprocess
import tempfile
from pathlib import Path
from typing import Sequence

import mlx.core as mx
import numpy as np

from dflash.metal import tensor_qmm
from dflash.metal.groups import GroupKernelSpec
from dflash.metal.sources import CUDA

from .compile_check import run_compiler
from .driver import buffer_args, driver_main
from .group_emulator import _DRIVER, _DRIVER_INCLUDES, _host, _numpy, element_dtype

CTYPES = {
    mx.float32: "float",
    mx.float16: "__half",
    mx.bfloat16: "__nv_bfloat16",
    mx.int32: "int32_t",
    mx.uint32: "uint32_t",
}
SUFFIX = {mx.float32: "f32", mx.float16: "f16", mx.bfloat16: "bf16"}
CANARY_BYTES = 4096
CANARY = 0xA5

SHIM = r"""
#include <cmath>
#include <cstdint>
#include <cstring>
#include <deque>

typedef unsigned int uint;
namespace metal {
enum class mem_flags { mem_none, mem_device, mem_threadgroup };
void threadgroup_barrier(mem_flags flags);
}  // namespace metal
uint dfl_current_thread();
uint dfl_current_group();

struct dim1 { uint x; };
#define threadIdx (dim1{dfl_current_thread()})
#define blockIdx (dim1{dfl_current_group()})
#define __shared__
#define DFL_SHARED
#define DFL_FN inline
#define DFL_BARRIER() metal::threadgroup_barrier(metal::mem_flags::mem_threadgroup)

struct uint4 { uint32_t x, y, z, w; };
struct uint2 { uint32_t x, y; };

typedef _Float16 __half;
// bfloat16 with round-to-nearest-even conversions (as __float2bfloat16).
struct __nv_bfloat16 {
  uint16_t bits;
  __nv_bfloat16() = default;
  __nv_bfloat16(float f) {
    uint32_t u;
    std::memcpy(&u, &f, 4);
    bits = uint16_t((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
  }
  operator float() const {
    uint32_t u = uint32_t(bits) << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
  }
};

inline float __uint_as_float(uint32_t u) { float f; std::memcpy(&f, &u, 4); return f; }
inline float __fadd_rn(float a, float b) { return a + b; }
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

// ----- mma.sync.m16n8k16.row.col, float32 accumulate (PTX fragment layout) -----
struct DflFragments { uint32_t a[4]; uint32_t b[2]; float c[4]; };
static DflFragments dfl_posted[1024];

template <typename H>
inline void dfl_mma(float* d, uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                    uint32_t b0, uint32_t b1, const H* tag) {
  const uint me = dfl_current_thread();
  dfl_posted[me] = DflFragments{{a0, a1, a2, a3}, {b0, b1}, {d[0], d[1], d[2], d[3]}};
  DFL_BARRIER();
  const uint warp0 = me & ~31u;
  const uint gid = (me & 31u) / 4, tig = me & 3u;
  float out[4];
  for (int i = 0; i < 4; ++i) {
    const uint row = gid + 8 * (i / 2), col = 2 * tig + (i % 2);
    double sum = double(dfl_posted[me].c[i]);
    for (uint k = 0; k < 16; ++k) {
      // A element (row, k): lane (row % 8, (k % 8) / 2), register (row >= 8) + 2 (k >= 8).
      const DflFragments& ha = dfl_posted[warp0 + (row % 8) * 4 + (k % 8) / 2];
      const uint32_t wa = ha.a[(row >= 8) + 2 * (k >= 8)] >> (16 * (k % 2));
      // B element (k, col): lane (col, (k % 8) / 2), register (k >= 8).
      const DflFragments& hb = dfl_posted[warp0 + col * 4 + (k % 8) / 2];
      const uint32_t wb = hb.b[k >= 8] >> (16 * (k % 2));
      sum += double(dfl_emu_value(wa & 0xFFFF, tag)) * double(dfl_emu_value(wb & 0xFFFF, tag));
    }
    out[i] = float(sum);
  }
  DFL_BARRIER();
  for (int i = 0; i < 4; ++i) d[i] = out[i];
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
template <typename H>
inline uint32_t dfl_q8(uint32_t lo, uint32_t hi, const H* tag) {
  // cvt.rn.*x2.f32 d, hi, lo: the first operand to the upper half.
  return dfl_emu_word(float(lo), tag) | (dfl_emu_word(float(hi), tag) << 16);
}

// ----- cp.async: per-thread commit groups, landing early or late -----
struct DflCopy { unsigned char* dst; unsigned char data[16]; int bytes; };
struct DflThreadCopies { std::vector<DflCopy> open; std::deque<std::vector<DflCopy>> groups; };
static DflThreadCopies dfl_copies[1024];
static bool dfl_late = false;

inline void dfl_land(const std::vector<DflCopy>& copies) {
  for (const DflCopy& c : copies) std::memcpy(c.dst, c.data, c.bytes);
}
inline void dfl_queue(unsigned char* dst, const unsigned char* src, int bytes, bool valid) {
  DflCopy c{dst, {0}, bytes};
  if (valid) std::memcpy(c.data, src, bytes);
  if (dfl_late) {
    dfl_copies[dfl_current_thread()].open.push_back(c);
  } else {
    dfl_land({c});
  }
}
inline void dfl_copy16(unsigned char* dst, const unsigned char* src, bool valid, bool fast) {
  if (fast && (reinterpret_cast<size_t>(src) & 15)) {
    std::abort();  // cp.async would fault on a misaligned source
  }
  dfl_queue(dst, src, 16, valid);
}
inline void dfl_copy4(unsigned char* dst, const unsigned char* src, bool fast) {
  if (fast && (reinterpret_cast<size_t>(src) & 3)) std::abort();
  dfl_queue(dst, src, 4, true);
}
inline void dfl_commit() {
  DflThreadCopies& t = dfl_copies[dfl_current_thread()];
  t.groups.push_back(t.open);
  t.open.clear();
}
template <int PENDING>
inline void dfl_wait() {
  DflThreadCopies& t = dfl_copies[dfl_current_thread()];
  while (int(t.groups.size()) > PENDING) {
    dfl_land(t.groups.front());
    t.groups.pop_front();
  }
}
inline void dfl_reset_copies() {
  for (DflThreadCopies& t : dfl_copies) { t.open.clear(); t.groups.clear(); }
}
// Whether every queued copy was retired by a wait (committed empty groups aside).
inline bool dfl_copies_done() {
  for (const DflThreadCopies& t : dfl_copies) {
    if (!t.open.empty()) return false;
    for (const auto& g : t.groups) if (!g.empty()) return false;
  }
  return true;
}
inline void dfl_pairs(uint4 v, uint32_t* r) {
  r[0] = __byte_perm(v.x, v.z, 0x5410);
  r[1] = __byte_perm(v.x, v.z, 0x7632);
  r[2] = __byte_perm(v.y, v.w, 0x5410);
  r[3] = __byte_perm(v.y, v.w, 0x7632);
}
"""

_GROUP_ACCESS = r"""
uint dfl_group_now = 0;
uint dfl_current_thread() { return current; }
uint dfl_current_group() { return dfl_group_now; }
"""


def _unit_name(index: int, dtype: mx.Dtype) -> str:
    return f"unit{index}_{SUFFIX[dtype]}"


def _unit(index: int, spec: GroupKernelSpec, dtype: mx.Dtype) -> str:
    """One spec at one ``T``: its shared memory and the kernel with mlx's CUDA signature."""
    args = [
        f"const {CTYPES[element_dtype(kind, dtype)]}* {name}"
        for name, kind in zip(spec.input_names, spec.input_types)
    ]
    args += [
        f"{CTYPES[element_dtype(kind, dtype)]}* {name}"
        for name, kind in zip(spec.output_names, spec.output_types)
    ]
    return (
        f"namespace {_unit_name(index, dtype)} {{\n"
        f"uint4 dfl_tc_smem[{max(1, spec.shared_memory // 16)}];\n"
        f"void kernel({', '.join(args)}) {{\n"
        f"  using T = {CTYPES[dtype]};\n" + spec.source(CUDA) + "\n}\n}\n"
    )


def _case(index: int, spec: GroupKernelSpec, dtype: mx.Dtype) -> str:
    ctypes = [
        [CTYPES[element_dtype(kind, dtype)] for kind in kinds]
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
    call = f"{_unit_name(index, dtype)}::kernel({', '.join(args)})"
    return (
        f'  if (key == "{_unit_name(index, dtype)}") {{\n'
        f'    dfl_late = std::getenv("DFL_CP_LATE") != nullptr;\n'
        f'    const size_t dfl_offset = std::getenv("DFL_OFFSET") ? 2 : 0;\n'
        f"    for (uint group = 0; group < groups; ++group) {{\n"
        f"      dfl_group_now = group;\n"
        f"      dfl_reset_copies();\n"
        f"      run_thread = [&](uint lid) {{ (void)lid; {call}; }};\n"
        f"      if (!run_group(threads)) {{\n"
        f'        std::fprintf(stderr, "group %u: threads ended before a barrier\\n", group);\n'
        f"        return 4;\n      }}\n"
        f"      if (!dfl_copies_done()) {{\n"
        f'        std::fprintf(stderr, "group %u: cp.async copies never waited for\\n", group);\n'
        f"        return 5;\n      }}\n    }}\n"
        f"    return finish(argv, outs, sizes, first_out);\n  }}\n"
    )


def _dtypes(spec: GroupKernelSpec) -> tuple[mx.Dtype, ...]:
    """The ``T`` a spec is launched with (the matmul forms: half types only)."""
    if spec.input_types[0] == "float32":
        return (mx.bfloat16, mx.float16, mx.float32)
    return tensor_qmm.DTYPES


class TensorEmulator:
    """Runs the tensor-core specs of ``dflash.metal.tensor_qmm`` on the CPU.

    Args:
        workdir: Directory for the source and binary.
        specs: The specs to build (default: every spec of ``tensor_qmm``).
        compiler: C++ compiler.

    Attributes:
        late: Land ``cp.async`` copies at their wait (else at issue); settable
            between launches.
        misaligned: Start every input 2 bytes past a 16-byte boundary (the body
            then copies without ``cp.async``); settable between launches.
    """

    def __init__(
        self,
        workdir: Path,
        specs: Sequence[GroupKernelSpec] = tensor_qmm.SPECS,
        compiler: str = "g++",
    ) -> None:
        self.workdir = Path(workdir)
        self.specs = list(specs)
        self.late = False
        self.misaligned = False
        self.binary = self.workdir / "tensor_emulator"
        self.launches = 0
        units, cases = [], []
        for i, spec in enumerate(self.specs):
            for dtype in _dtypes(spec):
                units.append(_unit(i, spec, dtype))
                cases.append(_case(i, spec, dtype))
        driver = _DRIVER + _GROUP_ACCESS
        driver += driver_main(
            ("groups", "threads"), "".join(cases), CANARY_BYTES, CANARY
        )
        # The units come before the scheduler (as in the group emulator); the shim's
        # forward declarations bind them to it.
        source = self.workdir / "tensor_emulator.cpp"
        source.write_text(_DRIVER_INCLUDES + SHIM + "".join(units) + driver)
        command = [compiler, "-std=c++17", "-O1", "-o", str(self.binary), str(source)]
        self.build = run_compiler(command, self.workdir)

    def launch(
        self,
        spec: GroupKernelSpec,
        inputs: Sequence[mx.array],
        output_shapes: Sequence[tuple[int, ...]],
        output_dtypes: Sequence[mx.Dtype],
        groups: int,
        dtype: mx.Dtype,
    ) -> list[mx.array]:
        """Same contract as ``dflash.metal.groups.launch_groups``, run on the CPU."""
        if not self.build.ok:
            raise RuntimeError(f"emulator did not build:\n{self.build.log}")
        index = self.specs.index(spec)
        self.launches += 1
        env = {"DFL_CP_LATE": "1"} if self.late else {}
        if self.misaligned:
            env["DFL_OFFSET"] = "1"
        with tempfile.TemporaryDirectory(dir=self.workdir) as tmp:
            argv = [str(self.binary), _unit_name(index, dtype), str(groups)]
            argv += [str(spec.threads), str(len(inputs))]
            for i, (kind, array) in enumerate(zip(spec.input_types, inputs)):
                want = element_dtype(kind, dtype)
                if array.dtype != want:
                    raise TypeError(
                        f"input {spec.input_names[i]} is {array.dtype}, kernel expects {want}"
                    )
                path = Path(tmp) / f"in{i}.bin"
                # Row-contiguous, as mlx's ensure_row_contiguous hands them over.
                with open(path, "wb") as out:
                    out.write(b"\0\0" if self.misaligned else b"")
                    out.write(_host(array).tobytes())
                argv.append(str(path))
            argv.append(str(len(output_shapes)))
            for i, (shape, out_dtype) in enumerate(zip(output_shapes, output_dtypes)):
                argv += [str(Path(tmp) / f"out{i}.bin")]
                argv += [str(int(np.prod(shape)) * out_dtype.size)]
            done = subprocess.run(argv, capture_output=True, text=True, env=env)
            if done.returncode != 0:
                raise RuntimeError(
                    f"emulated {spec.base} failed ({done.returncode}): {done.stderr}"
                )
            outs = []
            for i, (shape, out_dtype) in enumerate(zip(output_shapes, output_dtypes)):
                raw = out_dtype if out_dtype != mx.bfloat16 else mx.uint16
                host = np.fromfile(Path(tmp) / f"out{i}.bin", dtype=_numpy(raw))
                out = mx.array(host.reshape(shape))
                outs.append(out.view(mx.bfloat16) if out_dtype == mx.bfloat16 else out)
            return outs
