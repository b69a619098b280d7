"""Compile checks for the kernel bodies, and a CPU run of the Metal form.

Without Apple hardware or (here) an NVIDIA GPU, the bodies are still put
through real compilers, inside the exact function signatures mlx generates:

* Metal: each body is wrapped the way ``mx.fast.metal_kernel`` wraps it
  (``template <typename T> [[kernel]] void custom_kernel_...(const device T*
  ... [[buffer(i)]], ..., uint3 thread_position_in_grid
  [[thread_position_in_grid]])`` plus the explicit ``[[host_name]]``
  instantiation), with ``device`` / ``constant`` address spaces chosen by mlx's
  rule (inputs of fewer than 8 elements go to ``constant``), and compiled as
  C++ by g++ against ``shim_metal.h``.
* CUDA: each body is wrapped the way ``mx.fast.cuda_kernel`` wraps it (mlx's
  default header, ``namespace mlx::core::cu``, ``__global__ void ...(const T*
  ..., T* out)``, ``using T = ...;``) and compiled to PTX by nvcc, with
  ``shim_cuda_utils.h`` standing in for mlx's device header.

Because the Metal translation unit is valid C++ under the shim, it can also be
*run*: :class:`MetalEmulator` compiles it with a driver that calls the kernel
function once per thread (rounding the grid up to whole threadgroups, as a CUDA
launch does, with canaries past every output) and plugs into
``dflash.metal.backend.launch``, so the public wrappers' kernel paths run the
Metal body on the CPU and can be compared bit for bit with the references.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Optional, Sequence

import mlx.core as mx
import numpy as np

from .sources import (
    CUDA,
    METAL,
    RING_STORE,
    STAGE_SHADOW,
    STAGE_SHADOW_KV,
    KernelSpec,
    restore_spec,
    retain_spec,
)

HERE = Path(__file__).resolve().parent
METAL_SHIM = HERE / "shim_metal.h"
CUDA_SHIM = HERE / "shim_cuda_utils.h"

WORDS: tuple[mx.Dtype, ...] = (mx.uint16, mx.uint32, mx.uint64)
INDEX_INPUTS = ("dests", "params")

_METAL_TYPES = {
    mx.uint16: "uint16_t",
    mx.uint32: "uint32_t",
    mx.uint64: "uint64_t",
    mx.int32: "int32_t",
}
_CUDA_TYPES = dict(_METAL_TYPES)
_NUMPY_TYPES = {
    mx.uint16: np.uint16,
    mx.uint32: np.uint32,
    mx.uint64: np.uint64,
    mx.int32: np.int32,
}

# mlx's CUDA default header (mlx/backend/cuda/custom_kernel.cpp).
_CUDA_DEFAULT_HEADER = """
#include "mlx/backend/cuda/device/utils.cuh"

#include <cooperative_groups.h>

#define inf cuda::std::numeric_limits<float>::infinity()

"""

# Plane counts whose P-ary kernels the checks compile: small ones plus the
# Metal per-launch maxima the wrappers chunk by.
CHECK_PLANES: tuple[int, ...] = (1, 2, 3, 4, 5, 14, 28)
# CUDA launches bind up to 256 (retain) / 160 (restore) planes; 78 is Glimmer's.
CUDA_CHECK_PLANES: tuple[int, ...] = CHECK_PLANES + (78, 160, 256)

CANARY_WORDS = 512
CANARY_BYTE = 0xA5


@dataclass(frozen=True)
class CompileResult:
    """Outcome of one compiler run.

    Attributes:
        ok: Whether the compiler exited 0.
        command: The command line.
        log: Compiler output.
    """

    ok: bool
    command: str
    log: str


def check_specs(planes: Iterable[int] = CHECK_PLANES) -> list[KernelSpec]:
    """Every kernel spec the package launches, P-ary ones at ``planes``."""
    specs = [RING_STORE, STAGE_SHADOW, STAGE_SHADOW_KV]
    for count in planes:
        specs += [retain_spec(count), restore_spec(count)]
    return specs


def input_dtype(name: str, word: mx.Dtype) -> mx.Dtype:
    """Dtype of a kernel input: int32 for indices/scalars, else the word."""
    return mx.int32 if name in INDEX_INPUTS else word


def _word_suffix(word: mx.Dtype) -> str:
    return _METAL_TYPES[word]


def metal_kernel_name(spec: KernelSpec, word: mx.Dtype) -> str:
    """Host name mlx gives the instantiated Metal kernel (template-hashed)."""
    return f"custom_kernel_{spec.name(METAL)}__{_word_suffix(word)}"


def cuda_kernel_name(spec: KernelSpec, word: mx.Dtype) -> str:
    """Name mlx gives the CUDA kernel (``custom_kernel_`` + name + template)."""
    return f"custom_kernel_{spec.name(CUDA)}_{_word_suffix(word)}"


def metal_translation_unit(
    spec: KernelSpec, word: mx.Dtype, small: Sequence[str] = INDEX_INPUTS
) -> str:
    """The Metal source mlx would generate for ``spec`` at word type ``word``.

    Args:
        spec: Kernel contract.
        word: Word dtype (template argument ``T`` and buffer element type).
        small: Inputs with fewer than 8 elements (bound in ``constant``).

    Returns:
        Source text: templated ``[[kernel]]`` function plus its instantiation.
    """
    name = metal_kernel_name(spec, word)
    lines = ["template <typename T>", f"[[kernel]] void {name}("]
    index = 0
    for arg in spec.input_names:
        space = "constant" if arg in small else "device"
        ctype = _METAL_TYPES[input_dtype(arg, word)]
        lines.append(f"  const {space} {ctype}* {arg} [[buffer({index})]],")
        index += 1
    for arg in spec.output_names:
        lines.append(f"  device {_METAL_TYPES[word]}* {arg} [[buffer({index})]],")
        index += 1
    lines.append("  uint3 thread_position_in_grid [[thread_position_in_grid]]) {")
    instance = f"{name}<{_METAL_TYPES[word]}>"
    return (
        "\n".join(lines)
        + "\n"
        + spec.source(METAL)
        + "\n}\n"
        + f'\ntemplate [[host_name("{name}")]] [[kernel]] '
        + f"decltype({instance}) {instance};\n"
    )


def cuda_translation_unit(spec: KernelSpec, word: mx.Dtype) -> str:
    """The CUDA source mlx would generate for ``spec`` at word type ``word``."""
    name = cuda_kernel_name(spec, word)
    args = [
        f"    const {_CUDA_TYPES[input_dtype(arg, word)]}* {arg}"
        for arg in spec.input_names
    ]
    args += [f"    {_CUDA_TYPES[word]}* {arg}" for arg in spec.output_names]
    return (
        _CUDA_DEFAULT_HEADER
        + "namespace mlx::core::cu {\n\n"
        + "namespace cg = cooperative_groups;\n\n"
        + f"__global__ void {name}(\n"
        + ",\n".join(args)
        + ") {\n"
        + f"  using T = {_CUDA_TYPES[word]};\n\n"
        + spec.source(CUDA)
        + "\n}\n\n} // namespace mlx::core::cu\n"
    )


def find_compiler(name: str) -> Optional[str]:
    """Path of compiler ``name`` (also looked for under /usr/local/cuda/bin)."""
    found = shutil.which(name)
    if found is None and name == "nvcc":
        candidate = Path(os.environ.get("CUDA_HOME", "/usr/local/cuda")) / "bin/nvcc"
        found = str(candidate) if candidate.exists() else None
    return found


def _run(command: list[str], cwd: Path) -> CompileResult:
    done = subprocess.run(command, cwd=cwd, capture_output=True, text=True)
    return CompileResult(
        done.returncode == 0, " ".join(command), done.stdout + done.stderr
    )


# Which inputs mlx binds as ``constant`` (fewer than 8 elements): the usual
# case (scalars and a short dests), many destinations, and a tiny geometry.
ADDRESS_CASES: dict[str, Optional[tuple[str, ...]]] = {
    "": INDEX_INPUTS,
    "_longdests": ("params",),
    "_tiny": None,  # every input
}


def metal_source_file(specs: Sequence[KernelSpec]) -> str:
    """All Metal translation units: each word type, each address-space case."""
    units = [f'#include "{METAL_SHIM}"\n']
    for spec in specs:
        for suffix, small in ADDRESS_CASES.items():
            variant = dataclasses.replace(spec, base=spec.base + suffix)
            small = spec.input_names if small is None else small
            for word in WORDS:
                units.append(metal_translation_unit(variant, word, small=small))
    return "\n".join(units)


def check_metal(
    specs: Sequence[KernelSpec], workdir: Path, compiler: str = "g++"
) -> CompileResult:
    """Syntax-check every Metal body as C++ (g++ ``-fsyntax-only``)."""
    source = workdir / "metal_bodies.cpp"
    source.write_text(metal_source_file(specs))
    command = [compiler, "-std=c++14", "-fsyntax-only", "-Wall", "-Wextra", "-Werror"]
    command += ["-Wno-attributes", str(source)]
    return _run(command, workdir)


def check_cuda(
    specs: Sequence[KernelSpec], workdir: Path, compiler: str = "nvcc"
) -> CompileResult:
    """Compile every CUDA body to PTX with nvcc inside mlx's signature."""
    include = workdir / "include"
    header = include / "mlx/backend/cuda/device/utils.cuh"
    header.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(CUDA_SHIM, header)
    source = workdir / "cuda_bodies.cu"
    source.write_text(
        "\n".join(cuda_translation_unit(s, w) for s in specs for w in WORDS)
    )
    command = [compiler, "-std=c++17", "-arch=sm_90", "-ptx", "-Werror=all-warnings"]
    command += ["-I", str(include), "-o", str(workdir / "cuda_bodies.ptx"), str(source)]
    return _run(command, workdir)


# ----------------------------------------------------------------- emulator


def _driver_case(spec: KernelSpec, word: mx.Dtype) -> str:
    name = metal_kernel_name(spec, word)
    args = []
    for i, arg in enumerate(spec.input_names):
        ctype = _METAL_TYPES[input_dtype(arg, word)]
        args.append(f"reinterpret_cast<const {ctype}*>(ins[{i}].data())")
    for i, _ in enumerate(spec.output_names):
        args.append(f"reinterpret_cast<{_METAL_TYPES[word]}*>(outs[{i}].data())")
    call = f"{name}<{_METAL_TYPES[word]}>({', '.join(args)}, uint3{{g, 0u, 0u}})"
    return (
        f'  if (key == "{name}") {{\n'
        f"    for (uint g = 0; g < threads; ++g) {{\n      {call};\n    }}\n"
        f"    return finish(argv, outs, sizes, first_out);\n  }}\n"
    )


# Host headers come before the shim: its empty address-space macros must not
# reach the C library's own declarations.
_DRIVER_INCLUDES = """#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>
"""

_DRIVER_MAIN = r"""
static std::vector<char> slurp(const char* path) {
  std::ifstream in(path, std::ios::binary);
  return std::vector<char>(std::istreambuf_iterator<char>(in), {});
}

// Outputs carry CANARY bytes past their end; a body that writes past its
// output (e.g. a missing bound check on a rounded-up grid) fails the run.
static int finish(char** argv, std::vector<std::vector<char>>& outs,
                  const std::vector<size_t>& sizes, int first_out) {
  for (size_t i = 0; i < outs.size(); ++i) {
    for (size_t b = sizes[i]; b < outs[i].size(); ++b) {
      if (static_cast<unsigned char>(outs[i][b]) != CANARY) {
        std::fprintf(stderr, "output %zu written past its end\n", i);
        return 3;
      }
    }
    std::ofstream out(argv[first_out + 2 * i], std::ios::binary);
    out.write(outs[i].data(), sizes[i]);
  }
  return 0;
}

// argv: key threads n_in in_path... n_out (out_path out_bytes)...
int main(int argc, char** argv) {
  const std::string key = argv[1];
  const uint threads = uint(std::strtoul(argv[2], nullptr, 10));
  const int n_in = std::atoi(argv[3]);
  std::vector<std::vector<char>> ins;
  for (int i = 0; i < n_in; ++i) {
    ins.push_back(slurp(argv[4 + i]));
  }
  const int n_out = std::atoi(argv[4 + n_in]);
  const int first_out = 5 + n_in;
  std::vector<std::vector<char>> outs;
  std::vector<size_t> sizes;
  for (int i = 0; i < n_out; ++i) {
    sizes.push_back(std::strtoull(argv[first_out + 2 * i + 1], nullptr, 10));
    outs.emplace_back(sizes.back() + CANARY_BYTES, char(CANARY));
  }
__CASES__
  std::fprintf(stderr, "unknown kernel %s\n", key.c_str());
  return 2;
}
"""


class MetalEmulator:
    """Runs the Metal translation units on the CPU through g++.

    Use :meth:`launch` in place of ``dflash.metal.backend.launch`` (with
    ``backend.BACKEND`` set to ``"metal"``) to route the wrappers' kernel paths
    through the Metal bodies.

    Args:
        workdir: Directory for sources, binary and launch files.
        specs: Kernel specs to compile.
        compiler: C++ compiler.
        threadgroup: Grid rounding, as a CUDA launch rounds to whole blocks.
    """

    def __init__(
        self,
        workdir: Path,
        specs: Sequence[KernelSpec],
        compiler: str = "g++",
        threadgroup: int = 256,
    ) -> None:
        self.workdir = Path(workdir)
        self.threadgroup = threadgroup
        self.binary = self.workdir / "metal_emulator"
        self.launches = 0
        source = self.workdir / "metal_emulator.cpp"
        cases = "".join(_driver_case(s, w) for s in specs for w in WORDS)
        main = _DRIVER_MAIN.replace("__CASES__", cases)
        main = main.replace("CANARY_BYTES", str(CANARY_WORDS * 8))
        main = main.replace("CANARY", str(CANARY_BYTE))
        units = [metal_translation_unit(s, w) for s in specs for w in WORDS]
        source.write_text(
            _DRIVER_INCLUDES + f'#include "{METAL_SHIM}"\n' + "\n".join(units) + main
        )
        command = [compiler, "-std=c++17", "-O1", "-Wno-attributes"]
        command += ["-o", str(self.binary), str(source)]
        self.build = _run(command, self.workdir)

    def launch(
        self,
        spec: KernelSpec,
        inputs: Sequence[mx.array],
        output_shapes: Sequence[tuple[int, ...]],
        word: mx.Dtype,
        total: int,
    ) -> list[mx.array]:
        """Same contract as ``dflash.metal.backend.launch``, run on the CPU."""
        if not self.build.ok:
            raise RuntimeError(f"emulator did not build:\n{self.build.log}")
        self.launches += 1
        with tempfile.TemporaryDirectory(dir=self.workdir) as tmp:
            argv = [str(self.binary), metal_kernel_name(spec, word)]
            groups = -(-total // self.threadgroup)
            argv += [str(groups * self.threadgroup), str(len(inputs))]
            for i, (arg, array) in enumerate(zip(spec.input_names, inputs)):
                host = np.ascontiguousarray(np.asarray(array))
                expected = _NUMPY_TYPES[input_dtype(arg, word)]
                if host.dtype != expected:
                    raise TypeError(
                        f"input {arg} is {host.dtype}, kernel expects {expected}"
                    )
                path = Path(tmp) / f"in{i}.bin"
                host.tofile(path)
                argv.append(str(path))
            argv.append(str(len(output_shapes)))
            itemsize = np.dtype(_NUMPY_TYPES[word]).itemsize
            for i, shape in enumerate(output_shapes):
                argv += [str(Path(tmp) / f"out{i}.bin")]
                argv += [str(int(np.prod(shape)) * itemsize)]
            done = subprocess.run(argv, capture_output=True, text=True)
            if done.returncode != 0:
                raise RuntimeError(f"emulated {spec.base} failed: {done.stderr}")
            return [
                mx.array(
                    np.fromfile(
                        Path(tmp) / f"out{i}.bin", dtype=_NUMPY_TYPES[word]
                    ).reshape(shape)
                )
                for i, shape in enumerate(output_shapes)
            ]
