"""dflash's CUDA kernels compiled once per machine, kept where mlx looks first.

mlx's CUDA backend (0.32) looks for a JIT module in its cache directory,
``<ptx dir>/<module>.ptx`` with the kernel names in ``<module>.txt``, *before* it
compiles anything, custom kernels included; but it writes that cache only for its own
kernels (``custom_kernel.cpp`` asks for no disk cache), and it compiles ours with NVRTC
straight to SASS, which the driver's cache never sees. So every process paid NVRTC for
every dflash kernel again (session 73: 11.7-19.1 s of a first verify forward), and a
one-shot ``dflash-generate`` on CUDA paid it every time.

This module writes those two files for each launch form of ours the first time a process
meets it, so later processes load the module instead of compiling it:

* **The name is mlx's.** mlx names a custom kernel's module by the kernel's function name
  (``custom_kernel_<name><template suffix>``) and ``std::hash`` (libstdc++) of the whole
  source it generates around the texts it is handed. :func:`generated_source` spells that
  source for the mlx versions in :data:`SPELLED_MLX_VERSIONS` and :func:`std_hash` hashes
  it. A ``cuda`` test compares the spelling with what mlx prints with ``verbose=True``;
  its first run (session 78, an H100) found :data:`DEFAULT_HEADER` one line off, fixed
  since but not rerun.
* **The image is compiled here** by the NVRTC library mlx itself loaded, from that same
  source, with mlx's options and mlx's own device headers. mlx hands NVRTC those headers
  from strings inside ``libmlx`` (the wheel ships none of them as files);
  :mod:`.mlx_headers` reads the same two tables out of the mapped ``libmlx``, so the
  compile is mlx's own, the kernels that name mlx's ``Sigmoid`` (the gated fold, the
  SwiGLU forms) included. Where the tables cannot be read (a stripped or foreign
  library), :data:`PRELUDE`, the CUDA headers ``utils.cuh`` includes, stands in for
  ``utils.cuh``, and a source that needs more of mlx's headers fails to compile here
  and is left to mlx, which compiles it as before.
* **Fail open, never half-written.** Any failure (no NVRTC, no device, a compile error,
  an unwritable directory) keeps mlx's own compile for that form and is counted in
  :data:`STATS`; the ``.txt`` is written before the ``.ptx``, each by an atomic rename,
  because mlx takes a module as cached when its ``.ptx`` exists.

``DFLASH_KEPT_MODULES=1`` turns it on with mlx's CUDA backend (**opt-in** until a GPU has
shown that mlx loads the kept modules and that they give its own compile's bits:
:data:`KEPT_BY_DEFAULT`; then on by default for the spelled versions), ``=0`` off. mlx's ``MLX_PTX_CACHE_DIR`` picks
the directory, as it does for mlx's own modules.
"""

from __future__ import annotations

import collections
import ctypes
import ctypes.util
import glob
import os
import re
from pathlib import Path
from typing import Any, Callable, Dict, Mapping, Optional, Sequence, Tuple

import mlx.core as mx

from . import kernel_files, mlx_headers

KEPT_MODULES_ENV = "DFLASH_KEPT_MODULES"
PTX_DIR_ENV = "MLX_PTX_CACHE_DIR"
# The NVRTC library to compile with (default: mlx's; see Nvrtc.load).
NVRTC_ENV = "DFLASH_NVRTC"

# mlx versions whose generated custom-kernel source generated_source() spells.
SPELLED_MLX_VERSIONS = ("0.32.4",)
# Off until a GPU has shown mlx loading kept modules and their bits equal to mlx's own
# compile (not yet: no device came in session 78).
KEPT_BY_DEFAULT = False

# What mlx 0.32.4 puts before a custom kernel's header (custom_kernel.cpp; as mlx printed
# it on an H100 in session 78: no ``#define inf`` line, which mlx dropped in 2026-06).
DEFAULT_HEADER = (
    '\n#include "mlx/backend/cuda/device/utils.cuh"\n\n'
    "#include <cooperative_groups.h>\n\n"
)
UTILS_HEADER = "mlx/backend/cuda/device/utils.cuh"
# Handed to NVRTC under UTILS_HEADER's name where mlx's own headers cannot be read from
# libmlx (compile_headers): the CUDA headers mlx's own includes.
PRELUDE = (
    "#pragma once\n"
    "#include <cuda_bf16.h>\n"
    "#include <cuda_fp16.h>\n"
    "#include <cuda/std/array>\n"
    "#include <cuda/std/cstdint>\n"
    "#include <cuda/std/limits>\n"
    "#include <cuda/std/tuple>\n"
)

# mlx's CUDA spelling of a dtype in a signature / a ``using`` line.
CUDA_TYPES: Dict[mx.Dtype, str] = {
    mx.bool_: "bool",
    mx.int8: "int8_t",
    mx.int16: "int16_t",
    mx.int32: "int32_t",
    mx.int64: "int64_t",
    mx.uint8: "uint8_t",
    mx.uint16: "uint16_t",
    mx.uint32: "uint32_t",
    mx.uint64: "uint64_t",
    mx.float16: "__half",
    mx.bfloat16: "__nv_bfloat16",
    mx.float32: "float",
    mx.float64: "double",
}
# mlx's spelling of a dtype in a kernel's template suffix.
SUFFIX_TYPES: Dict[mx.Dtype, str] = {
    **CUDA_TYPES,
    mx.float16: "float16_t",
    mx.bfloat16: "bfloat16_t",
}
# The input names mlx looks for in a body to pass that input's shape, strides, ndim.
SHAPE_ARGUMENTS = (
    ("_shape", "const __grid_constant__ Shape"),
    ("_strides", "const __grid_constant__ Strides"),
    ("_ndim", "const __grid_constant__ int"),
)
# mlx splits a module name longer than this into directories.
MAX_FILE_NAME = 245

# What happened to each launch form a process met: "found" (a file was there),
# "written", "failed" (mlx compiles it); with the last failure's reason.
STATS: collections.Counter = collections.Counter()
LAST_FAILURE: Dict[str, str] = {}

TemplateArg = Tuple[str, Any]
Kernel = Callable[..., list]


def by_default() -> bool:
    """The default of ``DFLASH_KEPT_MODULES`` (``backend.make_kernel`` reads the
    switch): :data:`KEPT_BY_DEFAULT` where this mlx's custom-kernel source is one
    :func:`generated_source` spells."""
    return KEPT_BY_DEFAULT and mx.__version__ in SPELLED_MLX_VERSIONS


_MASK = (1 << 64) - 1
_MULTIPLIER = (0xC6A4A793 << 32) + 0x5BD1E995
_SEED = 0xC70F6907


def _shift_mix(value: int) -> int:
    return value ^ (value >> 47)


def std_hash(data: bytes) -> int:
    """``std::hash<std::string>`` of libstdc++ on a 64-bit machine (its
    ``_Hash_bytes``, a MurmurHash2 variant, with the library's seed).

    Args:
        data: The string's bytes.

    Returns:
        The 64-bit hash, as mlx formats it with ``{:x}`` in a module name.
    """
    length = len(data)
    whole = length - length % 8
    value = (_SEED ^ (length * _MULTIPLIER)) & _MASK
    for start in range(0, whole, 8):
        word = int.from_bytes(data[start : start + 8], "little")
        word = (_shift_mix((word * _MULTIPLIER) & _MASK) * _MULTIPLIER) & _MASK
        value = ((value ^ word) * _MULTIPLIER) & _MASK
    if length % 8:
        value = ((value ^ int.from_bytes(data[whole:], "little")) * _MULTIPLIER) & _MASK
    return _shift_mix((_shift_mix(value) * _MULTIPLIER) & _MASK)


def template_suffix(template: Sequence[TemplateArg]) -> str:
    """What mlx appends to ``custom_kernel_<name>`` for ``template``'s values."""
    parts = []
    for _, value in template:
        if isinstance(value, bool):
            parts.append("_t" if value else "_f")
        elif isinstance(value, int):
            parts.append(f"_{value}")
        else:
            parts.append("_" + SUFFIX_TYPES[value])
    return "".join(parts)


def _template_lines(template: Sequence[TemplateArg]) -> str:
    lines = []
    for name, value in template:
        if isinstance(value, bool):
            lines.append(f"  constexpr bool {name} = {'true' if value else 'false'};\n")
        elif isinstance(value, int):
            lines.append(f"  constexpr int {name} = {value};\n")
        else:
            lines.append(f"  using {name} = {CUDA_TYPES[value]};\n")
    return "".join(lines) + ("\n" if lines else "")


def generated_source(
    function_name: str,
    header: str,
    source: str,
    input_names: Sequence[str],
    input_forms: Sequence[Tuple[mx.Dtype, int]],
    output_names: Sequence[str],
    output_dtypes: Sequence[mx.Dtype],
    template: Sequence[TemplateArg],
) -> str:
    """The CUDA source mlx 0.32.4 generates for one launch form of a custom kernel.

    Args:
        function_name: ``custom_kernel_<name><template suffix>``.
        header: The header text mlx was handed ("" for none).
        source: The body text mlx was handed.
        input_names: The kernel's input names.
        input_forms: Each input's ``(dtype, ndim)``.
        output_names: The kernel's output names (at least one).
        output_dtypes: Each output's dtype.
        template: The launch's template arguments, in order.

    Returns:
        The text whose :func:`std_hash` names mlx's module.
    """
    parameters = []
    for name, (dtype, ndim) in zip(input_names, input_forms):
        parameters.append(f"    const {CUDA_TYPES[dtype]}* {name}")
        if ndim > 0:
            parameters += [
                f"    {kind} {name}{suffix}"
                for suffix, kind in SHAPE_ARGUMENTS
                if name + suffix in source
            ]
    parameters += [
        f"    {CUDA_TYPES[dtype]}* {name}"
        for name, dtype in zip(output_names, output_dtypes)
    ]
    return (
        DEFAULT_HEADER
        + header
        + "namespace mlx::core::cu {\n\nnamespace cg = cooperative_groups;\n\n"
        + f"__global__ void {function_name}(\n"
        + ",\n".join(parameters)
        + ") {\n"
        + _template_lines(template)
        + source
        + "\n}\n\n} // namespace mlx::core::cu\n"
    )


def module_name(function_name: str, source: str) -> str:
    """mlx's name for the JIT module of ``source`` (its generated text)."""
    return f"{function_name}_{std_hash(source.encode()):x}"


def temp_directory() -> Path:
    """libstdc++'s ``temp_directory_path()``: the first of ``TMPDIR``, ``TMP``,
    ``TEMP``, ``TEMPDIR`` that is set, else ``/tmp``."""
    for name in ("TMPDIR", "TMP", "TEMP", "TEMPDIR"):
        value = os.environ.get(name)
        if value:
            return Path(value)
    return Path("/tmp")


def mlx_cache_dir() -> Path:
    """Where mlx looks for compiled modules: ``MLX_PTX_CACHE_DIR``, else
    ``<temp>/mlx/<mlx version>/ptx``."""
    chosen = os.environ.get(PTX_DIR_ENV)
    if chosen:
        return Path(chosen).absolute()
    return temp_directory() / "mlx" / mx.__version__ / "ptx"


def module_path(cache_dir: Path, name: str) -> Path:
    """The ``.ptx`` path mlx reads for module ``name`` (a name longer than
    :data:`MAX_FILE_NAME` characters is cut into directories of that length)."""
    path = cache_dir
    while len(name) > MAX_FILE_NAME:
        path, name = path / name[:MAX_FILE_NAME], name[MAX_FILE_NAME:]
    return path / (name + ".ptx")


def write_module(path: Path, image: bytes, kernel: str, lowered: str) -> None:
    """Leave at ``path`` (a ``.ptx``) the module mlx loads for ``kernel``.

    The kernel-name line goes first: mlx takes the module as cached once the ``.ptx``
    exists, and a ``.ptx`` without its names would fail its launch.

    Args:
        path: :func:`module_path` of the module.
        image: The compiled image (SASS or PTX).
        kernel: The name mlx asks for (``mlx::core::cu::custom_kernel_...``).
        lowered: Its mangled name in ``image``.

    Raises:
        OSError: The directory cannot be made or written, or ``path`` reads back
            other than ``image``.
    """
    if not image or "\t" in kernel or "\n" in kernel + lowered:
        raise OSError(f"refusing to keep an empty or malformed module at {path}")
    path.parent.mkdir(parents=True, exist_ok=True)
    kernel_files.replace_atomically(
        path.with_suffix(".txt"), f"{kernel}\t{lowered}\n".encode()
    )
    kernel_files.replace_atomically(path, image)
    if path.read_bytes() != image:
        raise OSError(f"{path} does not hold the module just written to it")


class NvrtcError(RuntimeError):
    """NVRTC could not be loaded, or refused a program."""


class Nvrtc:
    """The NVRTC library (through ctypes): compile one program to an image."""

    def __init__(self, library: ctypes.CDLL) -> None:
        self.library = library
        library.nvrtcGetErrorString.restype = ctypes.c_char_p
        major, minor = ctypes.c_int(), ctypes.c_int()
        self._check(library.nvrtcVersion(ctypes.byref(major), ctypes.byref(minor)))
        self.version = (major.value, minor.value)

    @classmethod
    def load(cls) -> "Nvrtc":
        """The library ``DFLASH_NVRTC`` names when set, else the NVRTC mlx loaded (from
        this process's mapped libraries), else the one beside mlx's wheel
        (``nvidia/*/lib``), else the system's.

        Raises:
            NvrtcError: None can be loaded.
        """
        for path in _nvrtc_candidates():
            try:
                _load_builtins_beside(path)
                return cls(ctypes.CDLL(path))
            except (OSError, AttributeError, NvrtcError):
                continue
        raise NvrtcError("no NVRTC library could be loaded")

    def _check(self, result: int) -> None:
        if result != 0:
            text = self.library.nvrtcGetErrorString(result)
            raise NvrtcError(f"NVRTC error {result}: {(text or b'').decode()}")

    def compile(
        self,
        source: str,
        program_name: str,
        kernel: str,
        headers: Mapping[str, str],
        options: Sequence[str],
        sass: bool,
    ) -> Tuple[bytes, str]:
        """Compile ``source`` and return ``(image, lowered name of kernel)``.

        Args:
            source: The whole translation unit.
            program_name: Its file name (for NVRTC's messages).
            kernel: The ``__global__`` function's qualified name.
            headers: Include name to text, served before the include paths.
            options: NVRTC's command-line options.
            sass: The image as SASS (a cubin), else as PTX.

        Raises:
            NvrtcError: NVRTC refused the program (its log in the message).
        """
        lib, program = self.library, ctypes.c_void_p()
        names = [name.encode() for name in headers]
        texts = [headers[name].encode() for name in headers]
        self._check(
            lib.nvrtcCreateProgram(
                ctypes.byref(program),
                source.encode(),
                program_name.encode(),
                len(names),
                (ctypes.c_char_p * len(texts))(*texts),
                (ctypes.c_char_p * len(names))(*names),
            )
        )
        try:
            self._check(lib.nvrtcAddNameExpression(program, kernel.encode()))
            encoded = [option.encode() for option in options]
            result = lib.nvrtcCompileProgram(
                program, len(encoded), (ctypes.c_char_p * len(encoded))(*encoded)
            )
            if result != 0:
                raise NvrtcError(f"compile failed: {self._log(program)}")
            lowered = ctypes.c_char_p()
            self._check(
                lib.nvrtcGetLoweredName(program, kernel.encode(), ctypes.byref(lowered))
            )
            size_of, get = (
                (lib.nvrtcGetCUBINSize, lib.nvrtcGetCUBIN)
                if sass
                else (lib.nvrtcGetPTXSize, lib.nvrtcGetPTX)
            )
            size = ctypes.c_size_t()
            self._check(size_of(program, ctypes.byref(size)))
            image = ctypes.create_string_buffer(size.value)
            self._check(get(program, image))
            return image.raw, (lowered.value or b"").decode()
        finally:
            lib.nvrtcDestroyProgram(ctypes.byref(program))

    def _log(self, program: ctypes.c_void_p) -> str:
        size = ctypes.c_size_t()
        self.library.nvrtcGetProgramLogSize(program, ctypes.byref(size))
        log = ctypes.create_string_buffer(max(size.value, 1))
        self.library.nvrtcGetProgramLog(program, log)
        return log.value.decode(errors="replace").strip()[-2000:]

    def supports_sass(self, major: int, minor: int) -> bool:
        """Whether this NVRTC compiles device ``major.minor``'s SASS (mlx's rule: 11.8
        and later for every device, older releases up to the device of their day)."""
        newest = {9: (7, 2), 10: (7, 5)}
        nvrtc = self.version
        if nvrtc[0] < 9:
            return False
        if nvrtc[0] in newest:
            return (major, minor) <= newest[nvrtc[0]]
        if nvrtc == (11, 0):
            return (major, minor) <= (8, 0)
        if nvrtc[0] == 11 and nvrtc[1] < 8:
            return (major, minor) <= (8, 6)
        return True


def _mapped_libraries(marker: str) -> list[str]:
    """Paths of this process's mapped files whose name holds ``marker``."""
    try:
        with open("/proc/self/maps") as maps:
            fields = [line.split() for line in maps]
    except OSError:
        return []
    return sorted({f[-1] for f in fields if len(f) >= 6 and marker in Path(f[-1]).name})


def mlx_roots() -> list[Path]:
    """mlx's package directories (``site-packages/mlx``): the imported package's, and
    the one above each ``libmlx`` this process mapped (``mlx/lib/libmlx.so``)."""
    import mlx

    roots = [Path(path) for path in getattr(mlx, "__path__", [])]
    roots += [Path(path).parents[1] for path in _mapped_libraries("libmlx")]
    return list(dict.fromkeys(roots))


def _load_builtins_beside(path: str) -> None:
    """Load the ``libnvrtc-builtins`` next to NVRTC library ``path`` into the global
    namespace: NVRTC opens it by name at its first compile, which fails where the
    directory is on no search path (mlx's own first compile may come after ours)."""
    directory = Path(path).parent
    for builtins in sorted(directory.glob("libnvrtc-builtins.so*")):
        ctypes.CDLL(str(builtins), mode=ctypes.RTLD_GLOBAL)


def _nvrtc_candidates() -> list[str]:
    chosen = os.environ.get(NVRTC_ENV, "").strip()
    if chosen:
        return [chosen]
    found = _mapped_libraries("libnvrtc.so")
    found = [path for path in found if "builtins" not in Path(path).name]
    for root in mlx_roots():
        wheels = root.parent / "nvidia" / "*" / "lib" / "libnvrtc.so*"
        found += sorted(glob.glob(str(wheels)))
    system = ctypes.util.find_library("nvrtc")
    return found + ([system] if system else [])


def include_options() -> list[str]:
    """NVRTC's ``--include-path`` options, as mlx finds them: mlx's own ``include``
    (and its ``cccl``), the CUDA runtime headers of the ``nvidia`` wheels beside mlx,
    else ``CUDA_HOME`` / ``CUDA_PATH`` / ``/usr/local/cuda``."""
    paths: list[Path] = []
    for mlx_root in mlx_roots():
        paths += [mlx_root / "include", mlx_root / "include" / "cccl"]
        for runtime in ("cu13", "cu12", "cuda_runtime"):
            paths.append(mlx_root.parent / "nvidia" / runtime / "include")
            paths.append(mlx_root.parent / "nvidia" / runtime / "include" / "cccl")
    home = (
        os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH") or "/usr/local/cuda"
    )
    paths += [Path(home) / "include", Path(home) / "include" / "cccl"]
    seen: list[str] = []
    for path in paths:
        if path.is_dir() and str(path) not in seen:
            seen.append(str(path))
    return [f"--include-path={path}" for path in seen]


def device_capability() -> Tuple[int, int]:
    """The default CUDA device's compute capability, from ``mx.device_info``
    (``compute_capability_major`` / ``_minor``, else its ``architecture``, ``sm_90``).

    Raises:
        RuntimeError: mlx reports neither.
    """
    info = mx.device_info()
    major, minor = (info.get(f"compute_capability_{k}") for k in ("major", "minor"))
    if isinstance(major, int) and isinstance(minor, int):
        return major, minor
    found = re.fullmatch(r"sm_(\d+)(\d)\w*", str(info.get("architecture", "")))
    if found is None:
        raise RuntimeError("mlx reports no compute capability for this device")
    return int(found.group(1)), int(found.group(2))


class Compiler:
    """NVRTC with mlx's options for the default device (made once per process)."""

    def __init__(self) -> None:
        self.nvrtc = Nvrtc.load()
        major, minor = device_capability()
        self.sass = self.nvrtc.supports_sass(major, minor)
        arch = f"{'sm' if self.sass else 'compute'}_{major}{minor}"
        self.options = [
            "--device-as-default-execution-space",
            f"--gpu-architecture={arch}{'a' if major >= 9 else ''}",
            *include_options(),
        ]

        self.headers, self.header_source = compile_headers(libmlx_path())

    def image(self, name: str, source: str, kernel: str) -> Tuple[bytes, str]:
        """``(image, lowered name)`` of module ``name`` (see :meth:`Nvrtc.compile`)."""
        return self.nvrtc.compile(
            source, name + ".cu", kernel, self.headers, self.options, self.sass
        )


def libmlx_path() -> Optional[Path]:
    """The ``libmlx`` this process mapped, else the one in mlx's package (None: none)."""
    for path in _mapped_libraries("libmlx"):
        return Path(path)
    for root in mlx_roots():
        for candidate in sorted((root / "lib").glob("libmlx.so*")):
            return candidate
    return None


def compile_headers(library: Optional[Path]) -> Tuple[Dict[str, str], str]:
    """The headers NVRTC is handed: mlx's own, read from ``library``
    (:func:`~dflash.metal.mlx_headers.device_headers`, source ``"mlx"``), else
    :data:`PRELUDE` as ``utils.cuh`` (source ``"prelude"``: the kernels that need
    more of mlx's headers then fail to compile and are left to mlx)."""
    headers = mlx_headers.device_headers(library)
    if headers and UTILS_HEADER in headers:
        return headers, "mlx"
    return {UTILS_HEADER: PRELUDE}, "prelude"


_COMPILER: list = []


def compiler() -> Compiler:
    """The process's :class:`Compiler` (its failure to load is kept and raised again).

    Raises:
        NvrtcError, RuntimeError: NVRTC or the device could not be found.
    """
    if not _COMPILER:
        try:
            _COMPILER.append(Compiler())
        except (NvrtcError, RuntimeError, ValueError) as error:
            _COMPILER.append(error)
    made = _COMPILER[0]
    if isinstance(made, Exception):
        raise made
    return made


def keep_module(
    fields: Mapping[str, Any],
    input_forms: Sequence[Tuple[mx.Dtype, int]],
    output_dtypes: Sequence[mx.Dtype],
    template: Sequence[TemplateArg],
    cache_dir: Optional[Path] = None,
    make_image: Optional[Callable[[str, str, str], Tuple[bytes, str]]] = None,
) -> str:
    """Make sure mlx finds one launch form of a kernel compiled on disk.

    Args:
        fields: What the kernel was built from (``name``, ``input_names``,
            ``output_names``, ``source``, optional ``header``), as handed to mlx.
        input_forms: Each input's ``(dtype, ndim)`` at this launch.
        output_dtypes: Each output's dtype.
        template: The launch's template arguments.
        cache_dir: mlx's module directory (default :func:`mlx_cache_dir`).
        make_image: ``(module name, source, kernel) -> (image, lowered)`` (default
            the process's :class:`Compiler`).

    Returns:
        ``"found"`` when the module was already there, ``"written"`` when it was made.

    Raises:
        NvrtcError, RuntimeError, OSError, KeyError: It could not be made (a dtype mlx
            does not spell, no NVRTC or device, a compile error, a file error).
    """
    function = f"custom_kernel_{fields['name']}{template_suffix(template)}"
    source = generated_source(
        function,
        fields.get("header", ""),
        fields["source"],
        fields["input_names"],
        input_forms,
        fields["output_names"],
        output_dtypes,
        template,
    )
    name = module_name(function, source)
    path = module_path(mlx_cache_dir() if cache_dir is None else cache_dir, name)
    if path.is_file() and path.with_suffix(".txt").is_file():
        return "found"
    kernel = "mlx::core::cu::" + function
    image, lowered = (make_image or compiler().image)(name, source, kernel)
    write_module(path, image, kernel, lowered)
    return "written"


class KeptKernel:
    """mlx's custom-kernel callable that first makes sure each launch form it is asked
    for is on disk where mlx looks (:func:`keep_module`), once per process."""

    def __init__(self, kernel: Kernel, fields: Mapping[str, Any]) -> None:
        self.kernel = kernel
        self.fields = dict(fields)
        self._forms: set = set()

    def __call__(self, **launch: Any) -> list:
        inputs = launch.get("inputs", ())
        template = tuple(launch.get("template") or ())
        output_dtypes = tuple(launch.get("output_dtypes", ()))
        input_forms = tuple((x.dtype, x.ndim) for x in inputs)
        form = (input_forms, output_dtypes, template)
        if form not in self._forms:
            self._forms.add(form)
            try:
                STATS[
                    keep_module(self.fields, input_forms, output_dtypes, template)
                ] += 1
            except (NvrtcError, RuntimeError, OSError, KeyError, ValueError) as error:
                STATS["failed"] += 1
                LAST_FAILURE[self.fields["name"]] = f"{type(error).__name__}: {error}"
        return self.kernel(**launch)


def report() -> Dict[str, Any]:
    """The process's counts, its last failures and whose headers its compiles used
    (``"mlx"``, ``"prelude"``, or None before the first compile; for benchmarks and
    tests)."""
    made = _COMPILER[0] if _COMPILER else None
    return {
        "counts": dict(STATS),
        "failures": dict(LAST_FAILURE),
        "headers": made.header_source if isinstance(made, Compiler) else None,
    }
