"""dflash's CUDA kernels kept compiled where mlx looks first (metal/kept_modules).

The CPU tests hold the parts that decide whether mlx finds a kept module: libstdc++'s
``std::hash`` (against g++ itself where it is installed), the module's name and path,
the generated source's form, the order the two files are written in, once-per-form
keeping, and that every failure leaves mlx's own compile in charge. The CUDA tests (an
NVIDIA GPU) compare the generated source with what mlx prints, prove mlx loads a kept
module instead of compiling (a doctored image's output), and that a kept real kernel
gives the reference's bits.
"""

from __future__ import annotations

import shutil
import subprocess
import uuid
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dflash.metal import backend, kept_modules, kernel_files
from dflash.metal.sources import CUDA

CUDA_MLX = mx.cuda.is_available()
needs_cuda = pytest.mark.skipif(not CUDA_MLX, reason="needs mlx's CUDA backend")
needs_gxx = pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++")

# std::hash<std::string> of libstdc++ (g++ 12, x86-64) for three strings.
KNOWN_HASHES = {
    b"": 0x553E93901E462A6E,
    b"a": 0x454DDEE488C1ED6B,
    b"hello world, custom kernel": 0x8FCE7EB276C76104,
}

HASHER = r"""
#include <functional>
#include <iostream>
#include <iterator>
#include <string>
int main() {
  std::string line;
  while (std::getline(std::cin, line)) {
    std::string text;
    for (size_t i = 0; i + 1 < line.size(); i += 2)
      text += static_cast<char>(std::stoi(line.substr(i, 2), nullptr, 16));
    std::cout << std::hex << std::hash<std::string>{}(text) << "\n";
  }
}
"""


@pytest.fixture(scope="module")
def hasher(tmp_path_factory) -> Path:
    """g++'s own ``std::hash`` as a program: hex lines in, hashes out."""
    workdir = tmp_path_factory.mktemp("hasher")
    (workdir / "hash.cpp").write_text(HASHER)
    subprocess.run(
        ["g++", "-O1", "-o", str(workdir / "hash"), str(workdir / "hash.cpp")],
        check=True,
    )
    return workdir / "hash"


def test_std_hash_of_known_strings() -> None:
    for data, value in KNOWN_HASHES.items():
        assert kept_modules.std_hash(data) == value


@needs_gxx
@settings(max_examples=60, deadline=None)
@given(st.lists(st.binary(min_size=0, max_size=70), min_size=1, max_size=12))
def test_std_hash_is_libstdcxx_for_every_length_and_byte(hasher, texts) -> None:
    """Every tail length (0-7 bytes past the whole words) and high bytes included."""
    lines = "".join(text.hex() + "x\n" for text in texts)
    done = subprocess.run([str(hasher)], input=lines, capture_output=True, text=True)
    expected = [int(line, 16) for line in done.stdout.split()]
    assert [kept_modules.std_hash(text) for text in texts] == expected


def test_template_suffix_spells_bools_ints_and_types() -> None:
    template = [("B", True), ("C", False), ("N", 3), ("M", -2), ("T", mx.bfloat16)]
    assert kept_modules.template_suffix(template) == "_t_f_3_-2_bfloat16_t"
    assert kept_modules.template_suffix([("T", mx.float16)]) == "_float16_t"
    assert kept_modules.template_suffix([("T", mx.float32)]) == "_float"
    assert kept_modules.template_suffix([]) == ""


def test_generated_source_has_mlxs_signature_and_constants() -> None:
    source = kept_modules.generated_source(
        "custom_kernel_k_t",
        "// header\n",
        "out[0] = a[a_strides[0]];",
        ["a", "b", "c"],
        [(mx.float32, 2), (mx.uint32, 0), (mx.bfloat16, 1)],
        ["out", "flags"],
        [mx.float16, mx.int32],
        [("B", True), ("N", 4), ("T", mx.float16)],
    )
    assert source.startswith(kept_modules.DEFAULT_HEADER + "// header\nnamespace ")
    assert (
        "__global__ void custom_kernel_k_t(\n"
        "    const float* a,\n"
        "    const __grid_constant__ Strides a_strides,\n"
        "    const uint32_t* b,\n"
        "    const __nv_bfloat16* c,\n"
        "    __half* out,\n"
        "    int32_t* flags) {\n"
        "  constexpr bool B = true;\n"
        "  constexpr int N = 4;\n"
        "  using T = __half;\n"
        "\n"
        "out[0] = a[a_strides[0]];\n}\n\n} // namespace mlx::core::cu\n"
    ) in source


def test_a_scalar_input_gets_no_shape_arguments() -> None:
    """mlx passes shapes only for inputs of one dimension or more."""
    body = "out[0] = s[0] + s_ndim + t_shape[0];"
    source = kept_modules.generated_source(
        "f",
        "",
        body,
        ["s", "t"],
        [(mx.int32, 0), (mx.int32, 1)],
        ["out"],
        [mx.int32],
        [],
    )
    assert "s_ndim" not in source.split(body)[0]
    assert "const __grid_constant__ Shape t_shape,\n" in source
    assert ") {\n" + body in source  # no template lines, no blank line


def test_module_name_is_function_name_and_hex_hash() -> None:
    text = "some source"
    name = kept_modules.module_name("custom_kernel_x", text)
    assert name == f"custom_kernel_x_{kept_modules.std_hash(text.encode()):x}"


@given(st.integers(min_value=1, max_value=1000))
def test_a_long_module_name_is_cut_into_directories(length: int) -> None:
    name = "".join(chr(ord("a") + i % 26) for i in range(length))
    path = kept_modules.module_path(Path("/cache"), name)
    parts = path.relative_to("/cache").parts
    assert "".join(parts)[: -len(".ptx")] == name
    assert all(len(part) == kept_modules.MAX_FILE_NAME for part in parts[:-1])
    assert len(parts[-1]) <= kept_modules.MAX_FILE_NAME + len(".ptx")
    assert (length > kept_modules.MAX_FILE_NAME) == (len(parts) > 1)


def test_the_cache_directory_is_mlxs(monkeypatch, tmp_path) -> None:
    for name in ("MLX_PTX_CACHE_DIR", "TMPDIR", "TMP", "TEMP", "TEMPDIR"):
        monkeypatch.delenv(name, raising=False)
    version = mx.__version__
    assert kept_modules.mlx_cache_dir() == Path("/tmp/mlx") / version / "ptx"
    monkeypatch.setenv("TEMP", "/t3")
    monkeypatch.setenv("TMP", "/t2")
    assert kept_modules.mlx_cache_dir() == Path("/t2/mlx") / version / "ptx"
    monkeypatch.setenv("TMPDIR", "/t1")
    assert kept_modules.mlx_cache_dir() == Path("/t1/mlx") / version / "ptx"
    monkeypatch.setenv("MLX_PTX_CACHE_DIR", str(tmp_path))
    assert kept_modules.mlx_cache_dir() == tmp_path


def test_the_names_are_written_before_the_image(monkeypatch, tmp_path) -> None:
    """mlx takes a module as cached once its .ptx exists, so the .txt comes first."""
    order = []
    real = kernel_files.replace_atomically

    def recording(path, data):
        order.append(path.suffix)
        assert not path.with_suffix(".ptx").exists()
        real(path, data)

    monkeypatch.setattr(kernel_files, "replace_atomically", recording)
    path = tmp_path / "deep" / "mod.ptx"
    kept_modules.write_module(path, b"\x7fELF image", "mlx::core::cu::k", "_Z1kv")
    assert order == [".txt", ".ptx"]
    assert path.read_bytes() == b"\x7fELF image"
    assert path.with_suffix(".txt").read_text() == "mlx::core::cu::k\t_Z1kv\n"
    assert sorted(p.name for p in path.parent.iterdir()) == ["mod.ptx", "mod.txt"]


@pytest.mark.parametrize(
    "image, kernel, lowered",
    [(b"", "k", "_Z1kv"), (b"x", "k\tj", "_Z1kv"), (b"x", "k", "_Z1k\nv")],
)
def test_an_empty_or_malformed_module_is_refused(tmp_path, image, kernel, lowered):
    with pytest.raises(OSError, match="refusing"):
        kept_modules.write_module(tmp_path / "m.ptx", image, kernel, lowered)
    assert list(tmp_path.iterdir()) == []


FIELDS = {
    "name": "dflash_probe",
    "input_names": ["a"],
    "output_names": ["out"],
    "source": "out[0] = a[0];",
}


def test_keep_module_writes_once_then_finds(tmp_path) -> None:
    made = []

    def make_image(name, source, kernel):
        made.append((name, kernel))
        assert kept_modules.module_name(kernel.split("::")[-1], source) == name
        return b"image of " + name.encode(), "_lowered"

    forms = [(mx.float32, 1)]
    template = [("T", mx.float32)]
    args = (FIELDS, forms, [mx.float32], template, tmp_path, make_image)
    assert kept_modules.keep_module(*args) == "written"
    assert kept_modules.keep_module(*args) == "found"
    assert len(made) == 1
    name, kernel = made[0]
    assert kernel == "mlx::core::cu::custom_kernel_dflash_probe_float"
    assert (tmp_path / f"{name}.txt").read_text() == f"{kernel}\t_lowered\n"


class FakeKernel:
    """mlx's kernel callable: records the launches it is handed."""

    def __init__(self) -> None:
        self.launches = []

    def __call__(self, **launch):
        self.launches.append(launch)
        return ["outputs"]


def _launch(kernel, dtype=mx.float32) -> list:
    return kernel(
        inputs=[mx.zeros((4,), dtype=dtype)],
        output_shapes=[(4,)],
        output_dtypes=[dtype],
        grid=(4, 1, 1),
        threadgroup=(4, 1, 1),
        template=[("T", dtype)],
    )


def test_a_kept_kernel_keeps_each_form_once_and_always_launches(monkeypatch):
    kept = []
    monkeypatch.setattr(
        kept_modules,
        "keep_module",
        lambda fields, forms, dtypes, template: kept.append((forms, template)) or "x",
    )
    inner = FakeKernel()
    kernel = kept_modules.KeptKernel(inner, FIELDS)
    for dtype in (mx.float32, mx.float32, mx.bfloat16, mx.float32):
        assert _launch(kernel, dtype) == ["outputs"]
    assert len(inner.launches) == 4
    assert [template for _, template in kept] == [
        (("T", mx.float32),),
        (("T", mx.bfloat16),),
    ]


def test_a_failed_keep_leaves_mlxs_compile_and_is_counted(monkeypatch, tmp_path):
    def refuse(name, source, kernel):
        raise kept_modules.NvrtcError("compile failed: no such header")

    monkeypatch.setattr(kept_modules, "STATS", kept_modules.collections.Counter())
    monkeypatch.setattr(kept_modules, "LAST_FAILURE", {})
    monkeypatch.setenv("MLX_PTX_CACHE_DIR", str(tmp_path))
    real = kept_modules.keep_module
    monkeypatch.setattr(
        kept_modules,
        "keep_module",
        lambda *args: real(*args, cache_dir=None, make_image=refuse),
    )
    inner = FakeKernel()
    assert _launch(kept_modules.KeptKernel(inner, FIELDS)) == ["outputs"]
    assert len(inner.launches) == 1
    report = kept_modules.report()
    assert report["counts"] == {"failed": 1}
    assert "no such header" in report["failures"]["dflash_probe"]
    assert list(tmp_path.iterdir()) == []  # nothing half-written


def test_no_nvrtc_is_a_clear_failure(monkeypatch) -> None:
    monkeypatch.setattr(kept_modules, "_nvrtc_candidates", lambda: ["/nonexistent.so"])
    with pytest.raises(kept_modules.NvrtcError, match="no NVRTC"):
        kept_modules.Nvrtc.load()


@pytest.mark.parametrize(
    "nvrtc, device, sass",
    [
        ((8, 0), (7, 0), False),
        ((10, 2), (7, 5), True),
        ((10, 2), (8, 0), False),
        ((11, 4), (8, 6), True),
        ((11, 4), (9, 0), False),
        ((11, 8), (9, 0), True),
        ((13, 0), (10, 0), True),
    ],
)
def test_sass_where_mlx_compiles_sass(nvrtc, device, sass) -> None:
    compiler = object.__new__(kept_modules.Nvrtc)
    compiler.version = nvrtc
    assert compiler.supports_sass(*device) is sass


@pytest.mark.parametrize(
    "info, capability",
    [
        ({"compute_capability_major": 9, "compute_capability_minor": 0}, (9, 0)),
        ({"architecture": "sm_90a"}, (9, 0)),
        ({"architecture": "sm_86"}, (8, 6)),
        ({"architecture": "sm_120"}, (12, 0)),
    ],
)
def test_the_device_capability_is_read_from_mlx(monkeypatch, info, capability):
    monkeypatch.setattr(mx, "device_info", lambda: info)
    assert kept_modules.device_capability() == capability


def test_no_capability_is_a_clear_failure(monkeypatch) -> None:
    monkeypatch.setattr(mx, "device_info", lambda: {"device_name": "cpu"})
    with pytest.raises(RuntimeError, match="no compute capability"):
        kept_modules.device_capability()


def _made(monkeypatch, native: str | None) -> object:
    monkeypatch.setattr(mx.fast, "cuda_kernel", lambda **fields: FakeKernel())
    monkeypatch.setattr(backend, "NATIVE_BACKEND", native)
    return backend.make_kernel(CUDA, **FIELDS)


def test_make_kernel_keeps_only_on_mlxs_cuda_backend(monkeypatch) -> None:
    monkeypatch.delenv(kept_modules.KEPT_MODULES_ENV, raising=False)
    monkeypatch.setattr(kept_modules, "SPELLED_MLX_VERSIONS", (mx.__version__,))
    monkeypatch.setattr(kept_modules, "KEPT_BY_DEFAULT", True)
    assert isinstance(_made(monkeypatch, CUDA), kept_modules.KeptKernel)
    assert isinstance(_made(monkeypatch, None), FakeKernel)
    monkeypatch.setenv(kept_modules.KEPT_MODULES_ENV, "0")
    assert isinstance(_made(monkeypatch, CUDA), FakeKernel)


def test_kept_modules_are_opt_in_until_a_gpu_proves_them(monkeypatch) -> None:
    monkeypatch.delenv(kept_modules.KEPT_MODULES_ENV, raising=False)
    assert kept_modules.KEPT_BY_DEFAULT is False
    assert isinstance(_made(monkeypatch, CUDA), FakeKernel)
    monkeypatch.setenv(kept_modules.KEPT_MODULES_ENV, "1")
    assert isinstance(_made(monkeypatch, CUDA), kept_modules.KeptKernel)


def test_an_unspelled_mlx_keeps_nothing_unless_asked(monkeypatch) -> None:
    monkeypatch.delenv(kept_modules.KEPT_MODULES_ENV, raising=False)
    monkeypatch.setattr(kept_modules, "KEPT_BY_DEFAULT", True)
    monkeypatch.setattr(kept_modules, "SPELLED_MLX_VERSIONS", ("0.0.0",))
    assert isinstance(_made(monkeypatch, CUDA), FakeKernel)
    monkeypatch.setenv(kept_modules.KEPT_MODULES_ENV, "1")
    assert isinstance(_made(monkeypatch, CUDA), kept_modules.KeptKernel)


def test_a_bad_switch_value_is_named(monkeypatch) -> None:
    monkeypatch.setenv(kept_modules.KEPT_MODULES_ENV, "sometimes")
    with pytest.raises(ValueError, match="DFLASH_KEPT_MODULES must be 0 or 1"):
        _made(monkeypatch, CUDA)


# --- On mlx's CUDA backend -------------------------------------------------------------

TOY_HEADER = "__device__ inline float twice(float x) { return 2.0f * x; }\n"
TOY_BODY = """
  const uint32_t i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < a_shape[0]) {
    out[i] = static_cast<T>(twice(static_cast<float>(a[i])) + static_cast<float>(b[0]) + N);
  }
"""


# Kept forms fall back to the prelude (no Shape type) where mlx's headers cannot be read
# from libmlx: the toy kept here names no input's shape, as the package's never do.
KEPT_BODY = TOY_BODY.replace("a_shape[0]", "8u")


def _toy_fields(tag: str, body: str = KEPT_BODY) -> dict:
    return {
        "name": f"dflash_kept_probe_{tag}_{uuid.uuid4().hex[:8]}",
        "input_names": ["a", "b"],
        "output_names": ["out"],
        "source": body,
        "header": TOY_HEADER,
    }


def _toy_launch(kernel, dtype, verbose: bool = False) -> mx.array:
    a = mx.arange(8, dtype=mx.float32).astype(dtype)
    b = mx.array([0.5], dtype=mx.float32).astype(dtype)[0]  # ndim 0: no shape args
    launch = dict(
        inputs=[a, b],
        output_shapes=[(8,)],
        output_dtypes=[dtype],
        grid=(8, 1, 1),
        threadgroup=(8, 1, 1),
        template=[("T", dtype), ("N", 3), ("B", True)],
        stream=mx.gpu,
    )
    if verbose:
        launch["verbose"] = True
    out = kernel(**launch)[0]
    mx.eval(out)
    return out


@needs_cuda
@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16, mx.float16])
def test_the_generated_source_is_what_mlx_prints(capfd, dtype) -> None:
    fields = _toy_fields("print", TOY_BODY)
    kernel = mx.fast.cuda_kernel(**fields)
    _toy_launch(kernel, dtype, verbose=True)
    printed = capfd.readouterr().out
    text = printed.split("```\n", 1)[1].rsplit("\n```", 1)[0]
    template = [("T", dtype), ("N", 3), ("B", True)]
    function = f"custom_kernel_{fields['name']}{kept_modules.template_suffix(template)}"
    assert f"`{function}`" in printed
    expected = kept_modules.generated_source(
        function,
        TOY_HEADER,
        TOY_BODY,
        ["a", "b"],
        [(dtype, 1), (dtype, 0)],
        ["out"],
        [dtype],
        template,
    )
    assert text == expected


@needs_cuda
@pytest.mark.cuda
def test_mlx_loads_a_kept_module_instead_of_compiling() -> None:
    """A module kept from a doctored body (adds 100) under the real body's name: mlx's
    launch returns the doctored result, so it loaded the file and compiled nothing."""
    fields = _toy_fields("doctored")
    compiler = kept_modules.compiler()

    def doctored(name, source, kernel):
        return compiler.image(name, source.replace("+ N);", "+ N + 100.0f);"), kernel)

    template = [("T", mx.float32), ("N", 3), ("B", True)]
    forms = [(mx.float32, 1), (mx.float32, 0)]
    done = kept_modules.keep_module(
        fields, forms, [mx.float32], template, None, doctored
    )
    assert done == "written"
    out = _toy_launch(mx.fast.cuda_kernel(**fields), mx.float32)
    assert np.array(out).tolist() == [2.0 * i + 0.5 + 3 + 100 for i in range(8)]


@needs_cuda
@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
def test_a_kept_kernel_gives_the_references_bits(monkeypatch, dtype) -> None:
    monkeypatch.setattr(kept_modules, "STATS", kept_modules.collections.Counter())
    monkeypatch.setenv(kept_modules.KEPT_MODULES_ENV, "1")
    # A body that names no shape: make_kernel hands mlx its #include stubs.
    fields = _toy_fields("real")
    kernel = backend.make_kernel(CUDA, **fields)
    assert isinstance(kernel, kept_modules.KeptKernel)
    out = _toy_launch(kernel, dtype)
    assert kept_modules.report()["counts"] == {"written": 1}, kept_modules.report()
    a = mx.arange(8, dtype=mx.float32).astype(dtype).astype(mx.float32)
    b = mx.array(0.5, dtype=mx.float32).astype(dtype).astype(mx.float32)
    reference = (2.0 * a + b + 3).astype(dtype)
    assert np.array_equal(
        np.array(out.astype(mx.float32)), np.array(reference.astype(mx.float32))
    )


# --- Every package kernel under the prelude, with NVRTC (no GPU needed) ---------------


def _nvrtc():
    try:
        return kept_modules.Nvrtc.load()
    except kept_modules.NvrtcError:
        return None


NVRTC = _nvrtc()
needs_nvrtc = pytest.mark.skipif(
    NVRTC is None, reason="needs an NVRTC library (DFLASH_NVRTC or beside mlx)"
)


def _package_forms() -> list:
    """``(fields, input forms, output dtypes, template)`` of each CUDA kernel the
    package builds, at bfloat16 (group kernels) or uint32 words (the plain ones)."""
    from support import compile_check, group_emulator

    forms = []
    for spec in compile_check.check_specs():
        word = mx.uint32
        inputs = [(compile_check.input_dtype(n, word), 1) for n in spec.input_names]
        fields = dict(
            name=spec.name(CUDA),
            input_names=list(spec.input_names),
            output_names=list(spec.output_names),
            source=spec.source(CUDA),
        )
        forms.append((fields, inputs, [word] * len(spec.output_names), [("T", word)]))
    for spec in group_emulator.package_specs():
        if CUDA not in spec.backends:
            continue
        dtype = mx.bfloat16
        fields = dict(
            name=spec.name(CUDA),
            input_names=list(spec.input_names),
            output_names=list(spec.output_names),
            source=spec.source(CUDA),
            header=spec.header(CUDA),
        )
        inputs = [(group_emulator.element_dtype(k, dtype), 1) for k in spec.input_types]
        outputs = [group_emulator.element_dtype(k, dtype) for k in spec.output_types]
        forms.append((fields, inputs, outputs, [("T", dtype)]))
    return forms


def keep_every_form(forms: list, compiler, directory: Path, workers: int = 2) -> dict:
    """Each form's name and ``"written"`` or the compile's error, every form kept in
    ``directory`` by ``compiler`` (threads: NVRTC compiles programs concurrently)."""
    from concurrent.futures import ThreadPoolExecutor

    def keep(form):
        fields, inputs, outputs, template = form
        try:
            return fields["name"], kept_modules.keep_module(
                fields, inputs, outputs, template, directory, compiler.image
            )
        except kept_modules.NvrtcError as error:
            return fields["name"], str(error)[:600]

    with ThreadPoolExecutor(max_workers=workers) as pool:
        return dict(pool.map(keep, forms))


@needs_nvrtc
def test_every_package_kernel_compiles_under_the_prelude_or_names_mlxs_functors(
    tmp_path, monkeypatch
) -> None:
    """The prelude serves every CUDA text the package ships but the ones that name
    mlx's ``Sigmoid`` (its ``unary_ops.cuh``, inside libmlx only): those fail to
    compile here and are left to mlx, and nothing is written for them."""
    monkeypatch.setattr(kept_modules, "device_capability", lambda: (9, 0), raising=True)
    compiler = kept_modules.Compiler()
    compiler.headers = {kept_modules.UTILS_HEADER: kept_modules.PRELUDE}
    forms = _package_forms()
    results = keep_every_form(forms, compiler, tmp_path)
    failed = {name: why for name, why in results.items() if why != "written"}
    assert all("unary_ops.cuh" in why for why in failed.values()), failed
    functors = {f["name"] for f, *_ in forms if "unary_ops" in f.get("header", "")}
    assert functors and set(failed) == functors
    assert len(list(tmp_path.rglob("*.ptx"))) == len(results) - len(failed)
