"""Compile checks and a CPU run of the threadgroup kernels (``dflash.metal.groups``).

The companion of :mod:`.compile_check` and :mod:`.metal_emulator` (which serve the
flat copy kernels of ``dflash.metal.sources``) for the verify kernels.

The verify kernels cooperate inside a threadgroup (threadgroup memory, barriers),
so the thread-by-thread driver of :mod:`.metal_emulator` cannot run them. This
module does the same three jobs for them:

* :func:`metal_unit` writes the Metal source ``mx.fast.metal_kernel`` generates
  (``header``, ``template <typename T> [[kernel]] void ...`` with ``device`` /
  ``constant`` buffers by mlx's 8-element rule and the thread-position attributes
  the source mentions, in mlx's order), and :func:`check_metal` syntax-checks it
  with g++ against :data:`METAL_SHIM` (``-Wall -Wextra -Werror``);
* :func:`cuda_unit` writes the source ``mx.fast.cuda_kernel`` generates (mlx's
  default header, ``namespace mlx::core::cu``, ``__global__``, ``using T = ...``),
  and :func:`check_cuda` compiles it to PTX with nvcc (sm_90), against the same
  stand-in for mlx's device header as :mod:`.compile_check`;
* :class:`GroupEmulator` compiles the Metal units with a driver that runs every
  threadgroup's threads as coroutines (``ucontext``) on one CPU thread: each runs
  until it reaches a barrier or returns, and the group moves on when all of them
  are at the barrier. Threadgroup arrays become function statics (one copy,
  shared by the group; groups run one after another). A barrier that some threads
  of a group never reach (they returned) is reported as an error, as is a write
  past the end of an output (canary bytes).

The scheduler also runs a CUDA thread-block cluster (:func:`group_case`'s
``cluster``, used by :mod:`.tensor_emulator`): its CTAs' threads together, each
CTA's barrier releasing that CTA, the cluster's barrier (``dfl_cluster_sync``)
every thread of the cluster; threads of a CTA split between its barrier and the
cluster's, or CTAs that end while others wait at the cluster's, fail the run.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import tempfile
from abc import ABC, abstractmethod
from pathlib import Path
from typing import Optional, Sequence

import mlx.core as mx
import numpy as np

from dflash.metal import kept_modules
from dflash.metal.groups import GroupKernelSpec
from dflash.metal.sources import CUDA, METAL

from .compile_check import (
    CUDA_SHIM,
    CUDA_UNARY_SHIM,
    EMULATOR_FLAGS,
)
from .compile_check import METAL_SHIM as SHARED_METAL_SHIM
from .compile_check import CompileResult, find_compiler, run_compiler
from .driver import DRIVER_INCLUDES, buffer_args, driver_main

__all__ = [
    "CompileResult",
    "GroupEmulator",
    "check_cuda",
    "check_metal",
    "cuda_unit",
    "find_compiler",
    "metal_unit",
]

# Element type names mlx writes into generated signatures.
METAL_TYPES = {
    mx.float32: "float",
    mx.float16: "float16_t",
    mx.bfloat16: "bfloat16_t",
    mx.int32: "int32_t",
    mx.uint32: "uint32_t",
    mx.uint8: "uint8_t",
}
# mlx's CUDA spelling of each dtype (the package's table).
CUDA_TYPES = kept_modules.CUDA_TYPES
_NAMED = {"int32": mx.int32, "uint32": mx.uint32, "float32": mx.float32}
TEMPLATE_TYPES = (mx.float32, mx.float16, mx.bfloat16)

# The thread-position attributes mlx's metal_kernel adds when the source names them,
# in mlx's order (mlx/backend/common/metal_kernel.cpp).
METAL_ATTRIBUTES: tuple[tuple[str, str], ...] = (
    ("thread_index_in_threadgroup", "uint"),
    ("thread_position_in_grid", "uint3"),
    ("thread_position_in_threadgroup", "uint3"),
    ("threadgroup_position_in_grid", "uint3"),
    ("threads_per_threadgroup", "uint3"),
)
# What the emulator passes for each attribute: (lid, group, threads) -> C++ expr.
_ATTRIBUTE_VALUES = {
    "thread_index_in_threadgroup": "lid",
    "thread_position_in_grid": "uint3{group * threads + lid, 0u, 0u}",
    "thread_position_in_threadgroup": "uint3{lid, 0u, 0u}",
    "threadgroup_position_in_grid": "uint3{group, 0u, 0u}",
    "threads_per_threadgroup": "uint3{threads, 0u, 0u}",
}

# The shared Metal shim, plus what the threadgroup bodies use. No <cmath>: its global
# double overloads would make the float calls below ambiguous.
METAL_SHIM = (
    f"""
#include "{SHARED_METAL_SHIM}"
// Threadgroup storage: one static copy, shared by the threads of the running group.
#undef threadgroup
#define threadgroup static
"""
    + r"""
namespace metal {
enum class mem_flags { mem_none, mem_device, mem_threadgroup };
void threadgroup_barrier(mem_flags flags);
inline float exp(float x) { return __builtin_expf(x); }
inline float tanh(float x) { return __builtin_tanhf(x); }
inline float fma(float a, float b, float c) { return __builtin_fmaf(a, b, c); }
inline float fmax(float a, float b) { return __builtin_fmaxf(a, b); }
inline float exp2(float x) { return __builtin_exp2f(x); }
inline float rsqrt(float x) { return 1.0f / __builtin_sqrtf(x); }
inline float fabs(float x) { return __builtin_fabsf(x); }
namespace precise {
inline float cos(float x) { return __builtin_cosf(x); }
inline float sin(float x) { return __builtin_sinf(x); }
}  // namespace precise
}  // namespace metal
using namespace metal;
"""
)

# mlx's CUDA default header (0.32.4, as mlx printed it on an H100 in session 78).
CUDA_DEFAULT_HEADER = kept_modules.DEFAULT_HEADER

CANARY_BYTES = 4096
CANARY = 0xA5


def element_dtype(kind: str, dtype: mx.Dtype) -> mx.Dtype:
    """The dtype of an argument declared ``kind`` when ``T`` is ``dtype``."""
    return dtype if kind == "T" else _NAMED[kind]


def type_suffix(dtype: mx.Dtype) -> str:
    """The part of a kernel name mlx derives from the template type."""
    return METAL_TYPES[dtype]


def metal_kernel_name(spec: GroupKernelSpec, dtype: mx.Dtype) -> str:
    """Host name of the instantiated Metal kernel (mlx appends the template)."""
    return f"custom_kernel_{spec.name(METAL)}_{type_suffix(dtype)}"


def metal_attributes(source: str) -> list[tuple[str, str]]:
    """The attributes mlx adds to the signature for ``source``, in mlx's order."""
    return [(name, kind) for name, kind in METAL_ATTRIBUTES if name in source]


def metal_unit(
    spec: GroupKernelSpec, dtype: mx.Dtype, small: Optional[Sequence[str]] = None
) -> str:
    """The Metal source mlx generates for ``spec`` at template type ``dtype``.

    Args:
        spec: Kernel contract.
        dtype: The template type ``T``.
        small: Inputs bound as ``constant`` (fewer than 8 elements); default the
            spec's ``small_inputs``.

    Returns:
        Header, the templated ``[[kernel]]`` function and its instantiation.
    """
    small = spec.small_inputs if small is None else tuple(small)
    name = metal_kernel_name(spec, dtype)
    source = spec.source(METAL)
    lines = ["template <typename T>", f"[[kernel]] void {name}("]
    index = 0
    for arg, kind in zip(spec.input_names, spec.input_types):
        space = "constant" if arg in small else "device"
        ctype = METAL_TYPES[element_dtype(kind, dtype)]
        lines.append(f"  const {space} {ctype}* {arg} [[buffer({index})]],")
        index += 1
    for arg, kind in zip(spec.output_names, spec.output_types):
        ctype = METAL_TYPES[element_dtype(kind, dtype)]
        lines.append(f"  device {ctype}* {arg} [[buffer({index})]],")
        index += 1
    attributes = metal_attributes(source)
    for i, (attr, kind) in enumerate(attributes):
        end = "," if i < len(attributes) - 1 else ") {"
        lines.append(f"  {kind} {attr} [[{attr}]]{end}")
    if not attributes:
        lines[-1] = lines[-1].rstrip(",") + ") {"
    instance = f"{name}<{METAL_TYPES[dtype]}>"
    return (
        spec.header(METAL)
        + "\n".join(lines)
        + "\n"
        + source
        + "\n}\n"
        + f'\ntemplate [[host_name("{name}")]] [[kernel]] decltype({instance}) {instance};\n'
    )


def cuda_params(spec: GroupKernelSpec, dtype: mx.Dtype) -> list[str]:
    """The parameters of mlx's generated CUDA signature: inputs ``const``, then outputs."""
    params = [
        f"const {CUDA_TYPES[element_dtype(kind, dtype)]}* {arg}"
        for arg, kind in zip(spec.input_names, spec.input_types)
    ]
    return params + [
        f"{CUDA_TYPES[element_dtype(kind, dtype)]}* {arg}"
        for arg, kind in zip(spec.output_names, spec.output_types)
    ]


def cuda_unit(
    spec: GroupKernelSpec, dtype: mx.Dtype, default_header: bool = True
) -> str:
    """The CUDA source mlx generates for ``spec`` at template type ``dtype``
    (:func:`dflash.metal.kept_modules.generated_source`, the package's spelling).

    Args:
        spec: Kernel contract.
        dtype: The template type ``T``.
        default_header: Whether to start with mlx's default header (its includes).
    """
    template = [("T", dtype)]
    unit = kept_modules.generated_source(
        f"custom_kernel_{spec.name(CUDA)}{kept_modules.template_suffix(template)}",
        spec.header(CUDA),
        spec.source(CUDA),
        spec.input_names,
        [(element_dtype(kind, dtype), 1) for kind in spec.input_types],
        spec.output_names,
        [element_dtype(kind, dtype) for kind in spec.output_types],
        template,
    )
    return unit if default_header else unit[len(CUDA_DEFAULT_HEADER) :]


def _metal_file(specs: Sequence[GroupKernelSpec], every_space: bool = False) -> str:
    """One C++ file of every Metal unit, each in its own namespace (the headers'
    helper functions repeat). With ``every_space``, each spec also appears with every
    input in ``constant`` (what mlx binds for inputs of fewer than 8 elements)."""
    parts = [METAL_SHIM]
    for i, spec in enumerate(specs):
        variants = [("", None)] + ([("_tiny", spec.input_names)] if every_space else [])
        for suffix, small in variants:
            for dtype in TEMPLATE_TYPES:
                parts.append(f"namespace unit{i}{suffix}_{type_suffix(dtype)} {{\n")
                parts.append(metal_unit(spec, dtype, small))
                parts.append("}\n")
    return "\n".join(parts)


def check_metal(specs: Sequence[GroupKernelSpec], workdir: Path, compiler: str = "g++"):
    """Syntax-check every Metal unit as C++ (g++ ``-fsyntax-only -Werror``)."""
    source = Path(workdir) / "group_bodies.cpp"
    source.write_text(_metal_file(specs, every_space=True))
    command = [compiler, "-std=c++17", "-fsyntax-only", "-Wall", "-Wextra", "-Werror"]
    command += ["-Wno-attributes", "-Wno-unused-parameter", str(source)]
    return run_compiler(command, Path(workdir))


def package_specs() -> list[GroupKernelSpec]:
    """Every threadgroup kernel the package registers (the modules' ``SPECS``, the
    two-K-group folded matmuls), and the attention chunk pass at head dim 128 (over
    separate and stacked K/V)."""
    from dflash.metal import attention, heads, norms, qmm, tensor_attention, tensor_qmm

    specs = [*attention.SPECS, *heads.SPECS, *norms.SPECS, *qmm.SPECS]
    specs += [*tensor_qmm.SPECS, *tensor_qmm.K2_FOLDED_SPECS.values()]
    specs += [
        tensor_attention.attend_spec(128, layout, stacked)
        for layout in tensor_attention.LAYOUTS.values()
        for stacked in (False, True)
    ]
    return specs


def cuda_ptx(unit: Path, workdir: Path, compiler: str = "nvcc") -> str:
    """The PTX nvcc makes of the CUDA file ``unit`` for sm_90, with the shim of mlx's
    device headers that :func:`check_cuda` set up in ``workdir``."""
    out = Path(unit).with_suffix(".ptx")
    command = [compiler, "-std=c++17", "-arch=sm_90", "-ptx"]
    command += ["-I", str(Path(workdir) / "include"), "-o", str(out), str(unit)]
    subprocess.run(command, check=True)
    return out.read_text()


def write_cuda_units(
    specs: Sequence[GroupKernelSpec],
    workdir: Path,
    dtypes: Optional[Sequence[mx.Dtype]] = None,
) -> Path:
    """Write the translation unit :func:`check_cuda` compiles (every spec at each of
    ``dtypes``, default its own, in a namespace of its own) and the shim of mlx's
    device headers under ``workdir/include``; returns the unit's path."""
    workdir = Path(workdir)
    header = workdir / "include/mlx/backend/cuda/device/utils.cuh"
    header.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(CUDA_SHIM, header)
    shutil.copyfile(CUDA_UNARY_SHIM, header.parent / "unary_ops.cuh")
    units = {
        f"unit{i}_{type_suffix(dtype)}": cuda_unit(spec, dtype, default_header=False)
        for i, spec in enumerate(specs)
        for dtype in (spec.dtypes if dtypes is None else dtypes)
    }
    source = workdir / "group_bodies.cu"
    source.write_text(namespaced_cuda(units))
    return source


def namespaced_cuda(units: dict[str, str]) -> str:
    """One CUDA translation unit of ``units`` (namespace name: unit text without
    mlx's default header), each in its namespace after the header."""
    # mlx's device headers once, outside the units' namespaces (the bodies name their
    # functors from the global namespace, where mlx's JIT puts them).
    parts = [CUDA_DEFAULT_HEADER, '#include "mlx/backend/cuda/device/unary_ops.cuh"\n']
    for name, unit in units.items():
        parts += [f"namespace {name} {{\n", unit, "}\n"]
    return "\n".join(parts)


def check_cuda(
    specs: Sequence[GroupKernelSpec],
    workdir: Path,
    compiler: str = "nvcc",
    dtypes: Optional[Sequence[mx.Dtype]] = None,
    flags: Sequence[str] = (),
):
    """Compile every CUDA unit for sm_90 inside mlx's generated signature.

    The units share one nvcc run, each in its own namespace after mlx's default
    header (NVRTC compiles each alone; the namespaces keep their helpers apart).
    The output is a cubin, so ptxas also checks the inline PTX (tensor-core
    instructions) of the bodies that have some. ``dtypes``: the template types
    ``T`` to instantiate (default: each spec's own ``dtypes``; a tensor-core body has
    no float32 form); ``flags``:
    extra nvcc flags (e.g. ``-Xptxas -v`` for register counts).
    """
    workdir = Path(workdir)
    source = write_cuda_units(specs, workdir, dtypes)
    command = [compiler, "-std=c++17", "-arch=sm_90", "-cubin", "-Werror=all-warnings"]
    command += list(flags) + [
        "-I",
        str(workdir / "include"),
        "-o",
        str(workdir / "group_bodies.cubin"),
    ]
    return run_compiler(command + [str(source)], workdir)


def entry_registers(log: str) -> dict[str, int]:
    """The registers ptxas gave each kernel of a :func:`check_cuda` log (``-Xptxas
    -v``), by the unit's namespace (``unit{i}_{type}``: spec ``i`` at a type)."""
    registers, unit = {}, None
    for line in log.splitlines():
        entry = re.search(r"Compiling entry function '_ZN(\d+)", line)
        if entry:
            start = entry.end()
            unit = line[start : start + int(entry.group(1))]
        used = re.search(r"Used (\d+) registers", line)
        if used and unit is not None:
            registers[unit] = int(used.group(1))
            unit = None
    return registers


def assert_within_bounds(
    specs: Sequence[GroupKernelSpec],
    workdir: Path,
    compiler: str,
    dtypes: Sequence[mx.Dtype],
    max_registers: int = 128,
) -> None:
    """Compile ``specs`` for sm_90 (:func:`check_cuda`, ptxas verbose) and assert that
    every kernel, one a spec and dtype, has no spills and at most ``max_registers``
    registers (the launch bounds' cap at two 256-thread CTAs an SM)."""
    forms = check_cuda(specs, workdir, compiler, dtypes=dtypes, flags=("-Xptxas", "-v"))
    assert forms.ok, f"{forms.command}\n{forms.log}"
    kernels = len(specs) * len(dtypes)
    spills = re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", forms.log)
    assert len(spills) >= kernels, forms.log
    assert all(a == "0" and b == "0" for a, b in spills), forms.log
    registers = [int(r) for r in re.findall(r"Used (\d+) registers", forms.log)]
    assert len(registers) >= kernels and max(registers) <= max_registers, forms.log


# ----------------------------------------------------------------- emulator

# The coroutine scheduler's headers; the shared host headers come before the shim.
_DRIVER_INCLUDES = DRIVER_INCLUDES + """#include <ucontext.h>
#include <functional>
"""

_DRIVER = r"""
namespace {
// READY: runs on; WAITING: at its CTA's (threadgroup's) barrier; AT_CLUSTER: at the
// cluster's barrier; AT_WARP: at a warp collective (released when every lane of its
// warp is there); DONE: returned.
enum State { READY, WAITING, AT_CLUSTER, AT_WARP, DONE };
ucontext_t scheduler;
std::vector<ucontext_t> contexts;
std::vector<State> states;
std::vector<std::vector<char>> stacks;
// The running thread's slot: CTA `slot / cta_threads` of the cluster, thread
// `slot % cta_threads` of it (one CTA: the thread's index).
uint current = 0;
uint cta_threads = 1;
std::function<void(uint)> run_thread;

void trampoline() {
  run_thread(current);
  states[current] = DONE;
}

// Releases the warp of threads [first, end) if all its lanes wait at a warp collective;
// `at`: how many do.
bool release_warp(uint first, uint end, uint* at) {
  *at = 0;
  for (uint t = first; t < end; ++t) {
    *at += states[t] == AT_WARP;
  }
  if (*at < end - first) {
    return false;
  }
  for (uint t = first; t < end; ++t) {
    states[t] = READY;
  }
  return true;
}

uint warp_end(uint first, uint threads) {
  return first + 32 < threads ? first + 32 : threads;
}

// Releases every warp whose lanes all wait at a warp collective; counts the lanes
// left waiting at one.
bool release_warps(uint threads, uint* stuck) {
  bool released = false;
  *stuck = 0;
  for (uint first = 0; first < threads; first += 32) {
    uint at = 0;
    if (release_warp(first, warp_end(first, threads), &at)) {
      released = true;
    } else {
      *stuck += at;
    }
  }
  return released;
}

void run_ready(uint first, uint end) {
  for (uint t = first; t < end; ++t) {
    if (states[t] == READY) {
      current = t;
      swapcontext(&scheduler, &contexts[t]);
    }
  }
}

// Schedule: false, every thread in turn to its next stop (warps move together);
// true, each warp as far as it goes (to a barrier or its end) before the next.
bool eager_warps = false;

// Sets the threads of CTA `cta` at a barrier running again.
void release_cta(uint cta, uint threads) {
  for (uint t = cta * threads; t < (cta + 1) * threads; ++t) {
    states[t] = READY;
  }
}

// Runs one cluster of `ctas` threadgroups (CTAs) of `threads` threads together (one
// CTA: a threadgroup alone): every thread until a barrier, a warp collective or its
// end, round after round (in the order `eager_warps` picks). A CTA's barrier releases
// its threads once all of them are there; the cluster's barrier, every thread of the
// cluster. Returns null when every thread ended, else what went wrong.
const char* run_group(uint threads, uint ctas = 1) {
  // Warps are 32 consecutive slots, so a CTA must hold whole ones to share a cluster.
  if (ctas > 1 && threads % 32 != 0) {
    return "a cluster's CTAs must hold whole warps";
  }
  const uint slots = threads * ctas;
  cta_threads = threads;
  contexts.assign(slots, ucontext_t());
  states.assign(slots, READY);
  stacks.resize(slots);
  for (uint t = 0; t < slots; ++t) {
    stacks[t].resize(1 << 16);
    getcontext(&contexts[t]);
    contexts[t].uc_stack.ss_sp = stacks[t].data();
    contexts[t].uc_stack.ss_size = stacks[t].size();
    contexts[t].uc_link = &scheduler;
    makecontext(&contexts[t], trampoline, 0);
  }
  while (true) {
    if (eager_warps) {
      for (uint first = 0; first < slots; first += 32) {
        const uint end = warp_end(first, slots);
        uint at = 0;
        do {
          run_ready(first, end);
        } while (release_warp(first, end, &at));
      }
    } else {
      run_ready(0, slots);
    }
    uint stuck = 0;
    if (release_warps(slots, &stuck)) {
      continue;
    }
    if (stuck > 0) {
      return "some lanes of a warp never reach its warp collective";
    }
    // Every thread now waits at a barrier or has ended.
    bool released = false;
    uint done_ctas = 0;
    for (uint c = 0; c < ctas; ++c) {
      uint waiting = 0;
      uint done = 0;
      for (uint t = c * threads; t < (c + 1) * threads; ++t) {
        waiting += states[t] == WAITING;
        done += states[t] == DONE;
      }
      if (done > 0 && done < threads) {
        return "threads ended before a barrier";
      }
      // The rest wait at the cluster's barrier, which needs these too: a deadlock.
      if (waiting > 0 && waiting < threads) {
        return "threads of a CTA wait at its barrier and at the cluster's";
      }
      if (waiting == threads) {
        release_cta(c, threads);
        released = true;
      }
      done_ctas += done == threads;
    }
    if (released) {
      continue;
    }
    if (done_ctas == ctas) {
      return nullptr;
    }
    if (done_ctas > 0) {
      return "CTAs of a cluster ended before a cluster barrier";
    }
    for (uint t = 0; t < slots; ++t) {
      states[t] = READY;
    }
  }
}
}  // namespace

// A warp-collective meeting point (the tensor emulator's shuffles, ldmatrix, mma).
void dfl_warp_sync() {
  states[current] = AT_WARP;
  swapcontext(&contexts[current], &scheduler);
}

void metal::threadgroup_barrier(mem_flags) {
  states[current] = WAITING;
  swapcontext(&contexts[current], &scheduler);
}

// The cluster's barrier (barrier.cluster.arrive + wait): every thread of every CTA.
void dfl_cluster_sync() {
  states[current] = AT_CLUSTER;
  swapcontext(&contexts[current], &scheduler);
}

"""


def _driver_case(index: int, spec: GroupKernelSpec, dtype: mx.Dtype) -> str:
    space = f"unit{index}_{type_suffix(dtype)}"
    name = metal_kernel_name(spec, dtype)
    ctypes = [
        [METAL_TYPES[element_dtype(kind, dtype)] for kind in kinds]
        for kinds in (spec.input_types, spec.output_types)
    ]
    args = buffer_args(*ctypes)
    args += [_ATTRIBUTE_VALUES[a] for a, _ in metal_attributes(spec.source(METAL))]
    call = f"{space}::{name}<{METAL_TYPES[dtype]}>({', '.join(args)})"
    return group_case(name, f"{call};")


def group_case(
    key: str,
    call: str,
    setup: str = "",
    per_group: str = "",
    check: str = "",
    cluster: int = 1,
) -> str:
    """The driver's ``if (key == ...)`` block: every cluster of threadgroups in turn,
    its threads (each running ``call``, which sees ``lid`` and ``group``) as
    coroutines, then the outputs.

    Args:
        key: The kernel's key on the command line.
        call: C++ statements one thread runs.
        setup: C++ statements before the first group.
        per_group: C++ statements before each cluster (they see ``group``, its first
            threadgroup).
        check: C++ statements after each cluster, returning non-zero on a failure.
        cluster: Threadgroups run together (a thread-block cluster); the launch's
            groups must be a multiple of it.
    """
    where = (
        '"group %u: %s\\n", group'
        if cluster == 1
        else f'"cluster of groups %u to %u: %s\\n", group, group + {cluster - 1}'
    )
    fill = (
        f"    if (groups % {cluster} != 0) {{\n"
        f'      std::fprintf(stderr, "%u groups do not fill clusters of {cluster}\\n", groups);\n'
        f"      return 8;\n    }}\n"
        if cluster > 1
        else ""
    )
    return (
        f'  if (key == "{key}") {{\n{fill}{setup}'
        f"    for (uint group = 0; group < groups; group += {cluster}) {{\n{per_group}"
        f"      run_thread = [&](uint slot) {{\n"
        f"        const uint first = group;\n"
        f"        {{\n"
        f"          const uint lid = slot % threads;\n"
        f"          const uint group = first + slot / threads;\n"
        f"          (void)lid;\n          (void)group;\n"
        f"          {call}\n        }}\n      }};\n"
        f"      if (const char* failure = run_group(threads, {cluster})) {{\n"
        f"        std::fprintf(stderr, {where}, failure);\n"
        f"        return 4;\n      }}\n{check}    }}\n"
        f"    return finish(argv, outs, sizes, first_out);\n  }}\n"
    )


def _host(array: mx.array) -> np.ndarray:
    """Bytes of ``array`` as a numpy array (bfloat16 seen as uint16)."""
    if array.dtype == mx.bfloat16:
        array = array.view(mx.uint16)
    return np.ascontiguousarray(np.asarray(array))


class DriverLauncher(ABC):
    """The launch side the emulators share: inputs to files, a run of the driver
    binary, the outputs back as arrays.

    Subclasses set ``workdir``, ``specs``, ``binary`` and ``build`` and name the
    driver's case of a launch (:meth:`key`).

    Attributes:
        launches: Launches so far.
        launched: The ``base`` of every spec launched, in order.
    """

    workdir: Path
    specs: list[GroupKernelSpec]
    binary: Path
    build: CompileResult

    def __init__(self) -> None:
        self.launches = 0
        self.launched: list[str] = []

    @abstractmethod
    def key(self, spec: GroupKernelSpec, dtype: mx.Dtype) -> str:
        """The driver's name for ``spec`` at template type ``dtype``."""

    def run_options(self) -> tuple[dict[str, str], bytes]:
        """The driver's environment and the bytes put before each input's data."""
        return {}, b""

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
        if spec not in self.specs:
            raise RuntimeError(f"emulator was not built with {spec.base}")
        # launch_groups' own check (the driver has one too).
        if groups % spec.cluster:
            raise ValueError(
                f"{spec.base}: {groups} threadgroups do not fill clusters of {spec.cluster}"
            )
        self.launches += 1
        self.launched.append(spec.base)
        env, lead = self.run_options()
        with tempfile.TemporaryDirectory(dir=self.workdir) as tmp:
            argv = [str(self.binary), self.key(spec, dtype), str(groups)]
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
                    out.write(lead)
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


class GroupEmulator(DriverLauncher):
    """Runs the Metal units of threadgroup kernels on the CPU through g++.

    Use :meth:`launch` in place of ``dflash.metal.groups.launch_groups`` (with
    ``dflash.metal.backend.BACKEND`` set to ``"metal"``).

    Args:
        workdir: Directory for the source and binary.
        specs: Kernel specs to compile.
        compiler: C++ compiler.
    """

    def __init__(
        self, workdir: Path, specs: Sequence[GroupKernelSpec], compiler: str = "g++"
    ) -> None:
        super().__init__()
        self.workdir = Path(workdir)
        self.specs = list(specs)
        self.binary = self.workdir / "group_emulator"
        cases = "".join(
            _driver_case(i, spec, dtype)
            for i, spec in enumerate(self.specs)
            for dtype in TEMPLATE_TYPES
        )
        driver = _DRIVER + driver_main(
            ("groups", "threads"), cases, CANARY_BYTES, CANARY
        )
        source = self.workdir / "group_emulator.cpp"
        source.write_text(_DRIVER_INCLUDES + _metal_file(self.specs) + driver)
        command = [compiler, *EMULATOR_FLAGS, "-Wno-attributes", "-o", str(self.binary)]
        self.build = run_compiler(command + [str(source)], self.workdir)

    def key(self, spec: GroupKernelSpec, dtype: mx.Dtype) -> str:
        return metal_kernel_name(spec, dtype)


def _numpy(dtype: mx.Dtype):
    return {
        mx.float32: np.float32,
        mx.float16: np.float16,
        mx.uint16: np.uint16,
        mx.int32: np.int32,
        mx.uint32: np.uint32,
        mx.uint8: np.uint8,
    }[dtype]
