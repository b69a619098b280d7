"""Compile checks for the kernel bodies, inside the signatures mlx generates.

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
*run*: :mod:`.metal_emulator` does so.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Optional, Sequence

import mlx.core as mx

from dflash.metal import kept_modules
from dflash.metal.backend import PACK_SLOTS, pack_spec
from dflash.metal.sources import (
    CUDA,
    METAL,
    RING_WRITE,
    STAGE_SHADOW,
    STAGE_SHADOW_KV,
    KernelSpec,
    restore_spec,
    retain_spec,
)

HERE = Path(__file__).resolve().parent
METAL_SHIM = HERE / "shim_metal.h"
CUDA_SHIM = HERE / "shim_cuda_utils.h"
CUDA_UNARY_SHIM = HERE / "shim_cuda_unary_ops.h"

WORDS: tuple[mx.Dtype, ...] = (mx.uint16, mx.uint32, mx.uint64)
INDEX_INPUTS = ("dests", "params")

METAL_TYPES = {
    mx.uint16: "uint16_t",
    mx.uint32: "uint32_t",
    mx.uint64: "uint64_t",
    mx.int32: "int32_t",
}


# Plane counts whose P-ary kernels the checks compile: small ones plus the
# Metal per-launch maxima the wrappers chunk by.
CHECK_PLANES: tuple[int, ...] = (1, 2, 3, 4, 5, 14, 28)
# CUDA launches bind up to 256 (retain) / 160 (restore) planes; 78 is Glimmer's.
CUDA_CHECK_PLANES: tuple[int, ...] = CHECK_PLANES + (78, 160, 256)


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
    specs = [RING_WRITE, STAGE_SHADOW, STAGE_SHADOW_KV]
    for count in planes:
        specs += [retain_spec(count), restore_spec(count)]
    # The launch-scalar gather (launched on CUDA only; its text is shared all the same).
    return specs + [pack_spec(1), pack_spec(PACK_SLOTS)]


def input_dtype(name: str, word: mx.Dtype) -> mx.Dtype:
    """Dtype of a kernel input: int32 for indices/scalars, else the word."""
    return mx.int32 if name in INDEX_INPUTS else word


def _word_suffix(word: mx.Dtype) -> str:
    return METAL_TYPES[word]


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
        ctype = METAL_TYPES[input_dtype(arg, word)]
        lines.append(f"  const {space} {ctype}* {arg} [[buffer({index})]],")
        index += 1
    for arg in spec.output_names:
        lines.append(f"  device {METAL_TYPES[word]}* {arg} [[buffer({index})]],")
        index += 1
    lines.append("  uint3 thread_position_in_grid [[thread_position_in_grid]]) {")
    instance = f"{name}<{METAL_TYPES[word]}>"
    return (
        "\n".join(lines)
        + "\n"
        + spec.source(METAL)
        + "\n}\n"
        + f'\ntemplate [[host_name("{name}")]] [[kernel]] '
        + f"decltype({instance}) {instance};\n"
    )


def cuda_translation_unit(spec: KernelSpec, word: mx.Dtype) -> str:
    """The CUDA source mlx would generate for ``spec`` at word type ``word``
    (:func:`dflash.metal.kept_modules.generated_source`, the package's spelling)."""
    return kept_modules.generated_source(
        cuda_kernel_name(spec, word),
        "",
        spec.source(CUDA),
        spec.input_names,
        [(input_dtype(arg, word), 1) for arg in spec.input_names],
        spec.output_names,
        [word] * len(spec.output_names),
        [("T", word)],
    )


def find_compiler(name: str) -> Optional[str]:
    """Path of compiler ``name`` (also looked for under /usr/local/cuda/bin)."""
    found = shutil.which(name)
    if found is None and name == "nvcc":
        candidate = Path(os.environ.get("CUDA_HOME", "/usr/local/cuda")) / "bin/nvcc"
        found = str(candidate) if candidate.exists() else None
    return found


# The emulators' build: -Og takes under half of -O1's compile time for about its run
# time, and the bits are the same (ISO C++ contracts no multiply-add; no fast maths).
EMULATOR_FLAGS = ("-std=c++17", "-Og")


def run_compiler(command: list[str], cwd: Path) -> CompileResult:
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
    return run_compiler(command, workdir)


def check_cuda(
    specs: Sequence[KernelSpec], workdir: Path, compiler: str = "nvcc"
) -> CompileResult:
    """Compile every CUDA body to PTX with nvcc inside mlx's signature."""
    include = workdir / "include"
    header = include / "mlx/backend/cuda/device/utils.cuh"
    header.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(CUDA_SHIM, header)
    shutil.copyfile(CUDA_UNARY_SHIM, header.parent / "unary_ops.cuh")
    source = workdir / "cuda_bodies.cu"
    source.write_text(
        "\n".join(cuda_translation_unit(s, w) for s in specs for w in WORDS)
    )
    command = [compiler, "-std=c++17", "-arch=sm_90", "-ptx", "-Werror=all-warnings"]
    command += ["-I", str(include), "-o", str(workdir / "cuda_bodies.ptx"), str(source)]
    return run_compiler(command, workdir)
