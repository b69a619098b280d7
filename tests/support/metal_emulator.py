"""The Metal kernel bodies run on the CPU, thread by thread.

The Metal translation units of :mod:`.compile_check` are valid C++ under
``shim_metal.h``, so :class:`MetalEmulator` compiles them with g++ together with a
driver that calls the kernel function once per thread (the grid rounded up to whole
threadgroups, as a CUDA launch rounds to whole blocks, with canary bytes past every
output) and stands in for ``dflash.metal.backend.launch``: the library's kernel
paths then run the Metal bodies on the CPU and can be compared bit for bit with
the references.
"""

from __future__ import annotations

import subprocess
import tempfile
from pathlib import Path
from typing import Sequence

import mlx.core as mx
import numpy as np

from dflash.metal.sources import KernelSpec

from .compile_check import (
    EMULATOR_FLAGS,
    METAL_SHIM,
    METAL_TYPES,
    WORDS,
    input_dtype,
    metal_kernel_name,
    metal_translation_unit,
    run_compiler,
)
from .driver import DRIVER_INCLUDES, buffer_args, driver_main

_NUMPY_TYPES = {
    mx.uint16: np.uint16,
    mx.uint32: np.uint32,
    mx.uint64: np.uint64,
    mx.int32: np.int32,
}

CANARY_WORDS = 512
CANARY_BYTE = 0xA5


def _driver_case(spec: KernelSpec, word: mx.Dtype) -> str:
    name = metal_kernel_name(spec, word)
    args = buffer_args(
        [METAL_TYPES[input_dtype(arg, word)] for arg in spec.input_names],
        [METAL_TYPES[word]] * len(spec.output_names),
    )
    call = f"{name}<{METAL_TYPES[word]}>({', '.join(args)}, uint3{{g, 0u, 0u}})"
    return (
        f'  if (key == "{name}") {{\n'
        f"    for (uint g = 0; g < threads; ++g) {{\n      {call};\n    }}\n"
        f"    return finish(argv, outs, sizes, first_out);\n  }}\n"
    )


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
        main = driver_main(("threads",), cases, CANARY_WORDS * 8, CANARY_BYTE)
        units = [metal_translation_unit(s, w) for s in specs for w in WORDS]
        source.write_text(
            DRIVER_INCLUDES + f'#include "{METAL_SHIM}"\n' + "\n".join(units) + main
        )
        command = [compiler, *EMULATOR_FLAGS, "-Wno-attributes"]
        command += ["-o", str(self.binary), str(source)]
        self.build = run_compiler(command, self.workdir)

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
