"""mlx's device headers read from ``libmlx`` (``dflash.metal.mlx_headers``) and the kept
modules compiled with them.

* The ELF reading, on shared libraries g++ builds here with tables laid out as mlx's
  JIT declares them (and on broken, stripped and foreign ones: None, never a raise).
* With a CUDA ``libmlx`` and an NVRTC on this machine (``DFLASH_TEST_LIBMLX`` names
  the library, ``DFLASH_NVRTC`` the compiler; skipped in CI, which has neither):
  every CUDA text the package ships compiles with mlx's own headers, the ones that
  name mlx's ``Sigmoid`` included.
* On mlx's CUDA backend (``cuda``): the headers come from the mapped ``libmlx``, and
  a kept kernel that calls ``Sigmoid`` gives the bits of mlx's own compile.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import uuid
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_kept_modules import NVRTC, _package_forms, keep_every_form

from dflash.metal import backend, kept_modules, mlx_headers
from dflash.metal.sources import CUDA

needs_gxx = pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++")
needs_cuda = pytest.mark.skipif(
    not mx.cuda.is_available(), reason="needs mlx's CUDA backend"
)
PREFIX = mlx_headers.INCLUDE_PREFIX

TABLES = r"""
namespace mlx::core::cu {
namespace {
constexpr const char* g_include_names[] = {
%s
};
constexpr const char* g_headers[] = {
%s
};
}  // namespace
}  // namespace mlx::core::cu
extern "C" const char* const* dfl_tables(int which) {
  return which ? mlx::core::cu::g_headers : mlx::core::cu::g_include_names;
}
"""


def _literal(text: str) -> str:
    return '"' + "".join(f"\\x{b:02x}" for b in text.encode()) + '"'


def _library(workdir: Path, names, texts, *flags: str) -> Path:
    """A shared library holding ``names`` and ``texts`` as mlx's two JIT tables."""
    source = workdir / f"tables_{uuid.uuid4().hex[:8]}.cpp"
    source.write_text(
        TABLES
        % (
            ",\n".join(_literal(n) for n in names),
            ",\n".join(_literal(t) for t in texts),
        )
    )
    library = source.with_suffix(".so")
    subprocess.run(
        ["g++", "-shared", "-fPIC", *flags, "-o", str(library), str(source)],
        check=True,
    )
    return library


HEADER_TEXT = st.text(
    alphabet=st.characters(blacklist_characters="\0", blacklist_categories=("Cs",)),
    max_size=300,
)


@needs_gxx
@settings(max_examples=12, deadline=None)
@given(
    st.lists(
        st.tuples(st.from_regex(r"[a-z_]{1,12}\.cuh", fullmatch=True), HEADER_TEXT),
        min_size=1,
        max_size=6,
        unique_by=lambda pair: pair[0],
    ),
    st.sampled_from(["-O0", "-O2"]),
)
def test_the_tables_are_read_in_order_with_each_text(tmp_path_factory, pairs, opt):
    names = [PREFIX + name for name, _ in pairs]
    texts = [text for _, text in pairs]
    library = _library(tmp_path_factory.mktemp("elf"), names, texts, opt)
    headers = mlx_headers.read_headers(library)
    assert headers is not None
    assert list(headers) == names
    assert list(headers.values()) == texts


@needs_gxx
def test_a_stripped_library_gives_none(tmp_path) -> None:
    library = _library(tmp_path, [PREFIX + "utils.cuh"], ["#pragma once\n"], "-s")
    assert mlx_headers.read_headers(library) is None


@needs_gxx
def test_names_outside_mlxs_device_folder_give_none(tmp_path) -> None:
    library = _library(tmp_path, ["utils.cuh", PREFIX + "a.cuh"], ["x", "y"])
    assert mlx_headers.read_headers(library) is None


@needs_gxx
def test_a_library_without_the_tables_gives_none(tmp_path) -> None:
    source = tmp_path / "plain.cpp"
    source.write_text('extern "C" int dfl_plain() { return 7; }\n')
    library = tmp_path / "plain.so"
    subprocess.run(
        ["g++", "-shared", "-fPIC", "-o", str(library), str(source)], check=True
    )
    assert mlx_headers.read_headers(library) is None


@needs_gxx
@settings(max_examples=20, deadline=None)
@given(st.data())
def test_a_truncated_or_damaged_library_gives_none_not_a_raise(tmp_path_factory, data):
    workdir = tmp_path_factory.mktemp("broken")
    library = _library(workdir, [PREFIX + "utils.cuh"], ["#pragma once\n"])
    image = bytearray(library.read_bytes())
    cut = data.draw(st.integers(min_value=0, max_value=len(image) - 1), label="cut")
    damaged = workdir / "damaged.so"
    if data.draw(st.booleans(), label="truncate"):
        damaged.write_bytes(bytes(image[:cut]))
        expected_none = True
    else:
        image[cut] ^= 0xFF
        damaged.write_bytes(bytes(image))
        expected_none = False
    headers = mlx_headers.read_headers(damaged)
    if expected_none:
        assert headers is None
    else:  # a flipped byte may miss everything read: then the tables come back whole
        assert headers is None or isinstance(headers, dict)


def test_not_a_file_or_not_elf_gives_none(tmp_path) -> None:
    assert mlx_headers.read_headers(tmp_path / "missing.so") is None
    text = tmp_path / "text.so"
    text.write_text("not an ELF image\n")
    assert mlx_headers.read_headers(text) is None
    assert mlx_headers.device_headers(None) is None


@needs_gxx
def test_compile_headers_prefers_mlxs_and_falls_back_to_the_prelude(tmp_path) -> None:
    utils = kept_modules.UTILS_HEADER
    library = _library(tmp_path, [utils, PREFIX + "unary_ops.cuh"], ["u", "s"])
    headers, source = kept_modules.compile_headers(library)
    assert source == "mlx" and headers == {utils: "u", PREFIX + "unary_ops.cuh": "s"}
    # Tables without utils.cuh cannot stand for mlx's: the prelude.
    other = _library(tmp_path, [PREFIX + "unary_ops.cuh"], ["s"])
    assert kept_modules.compile_headers(other) == (
        {utils: kept_modules.PRELUDE},
        "prelude",
    )
    assert kept_modules.compile_headers(None)[1] == "prelude"


# --- Every package kernel with mlx's own headers (a CUDA libmlx and NVRTC here) ------


def _cuda_libmlx():
    chosen = os.environ.get("DFLASH_TEST_LIBMLX", "").strip()
    path = Path(chosen) if chosen else kept_modules.libmlx_path()
    headers = mlx_headers.device_headers(path)
    return path if headers and kept_modules.UTILS_HEADER in headers else None


CUDA_LIBMLX = _cuda_libmlx()
needs_headers_and_nvrtc = pytest.mark.skipif(
    CUDA_LIBMLX is None or NVRTC is None,
    reason="needs a CUDA libmlx (DFLASH_TEST_LIBMLX) and an NVRTC (DFLASH_NVRTC)",
)


@needs_headers_and_nvrtc
def test_every_package_kernel_compiles_with_mlxs_headers(tmp_path, monkeypatch):
    """mlx's own headers serve every CUDA text the package ships, the gated fold and
    the SwiGLU forms (mlx's ``Sigmoid``) among them: every form is written."""
    monkeypatch.setattr(kept_modules, "device_capability", lambda: (9, 0), raising=True)
    compiler = kept_modules.Compiler()
    compiler.headers, compiler.header_source = kept_modules.compile_headers(CUDA_LIBMLX)
    assert compiler.header_source == "mlx"

    forms = _package_forms()
    assert any("unary_ops" in f.get("header", "") for f, *_ in forms)
    results = keep_every_form(forms, compiler, tmp_path, os.cpu_count() or 2)
    failed = {name: why for name, why in results.items() if why != "written"}
    assert not failed, failed
    assert len(list(tmp_path.rglob("*.ptx"))) == len(results)


# --- On mlx's CUDA backend ------------------------------------------------------------

SIGMOID_HEADER = '#include "mlx/backend/cuda/device/unary_ops.cuh"\n'
SIGMOID_BODY = """
  unsigned int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < 4096u) {
    out[i] = ::mlx::core::cu::Sigmoid{}(a[i]);
  }
"""


@needs_cuda
@pytest.mark.cuda
def test_the_headers_on_cuda_are_mlxs_own() -> None:
    headers, source = kept_modules.compile_headers(kept_modules.libmlx_path())
    assert source == "mlx"
    assert "Sigmoid" in headers[PREFIX + "unary_ops.cuh"]


@needs_cuda
@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16, mx.float16])
def test_a_kept_sigmoid_kernel_gives_mlxs_own_compiles_bits(
    monkeypatch, tmp_path, dtype
) -> None:
    """One body, two names: one compiled by mlx, one kept by us with mlx's headers
    (and loaded by mlx): equal bits over 4,096 inputs from -40 to 40."""
    monkeypatch.setattr(kept_modules, "STATS", kept_modules.collections.Counter())
    monkeypatch.setenv("MLX_PTX_CACHE_DIR", str(tmp_path))
    x = mx.linspace(-40.0, 40.0, 4096).astype(dtype)
    launch = dict(
        inputs=[x],
        output_shapes=[(4096,)],
        output_dtypes=[dtype],
        grid=(4096, 1, 1),
        threadgroup=(256, 1, 1),
        template=[("T", dtype)],
        stream=mx.gpu,
    )
    outputs = []
    for kept in ("0", "1"):
        monkeypatch.setenv(kept_modules.KEPT_MODULES_ENV, kept)
        fields = dict(
            name=f"dflash_sigmoid_{kept}_{uuid.uuid4().hex[:8]}",
            input_names=["a"],
            output_names=["out"],
            source=SIGMOID_BODY,
            header=SIGMOID_HEADER,
        )
        kernel = backend.make_kernel(CUDA, **fields)
        assert isinstance(kernel, kept_modules.KeptKernel) == (kept == "1")
        out = kernel(**launch)[0]
        mx.eval(out)
        outputs.append(
            np.array(out.view(mx.uint16 if dtype != mx.float32 else mx.uint32))
        )
    assert kept_modules.report()["counts"] == {"written": 1}, kept_modules.report()
    assert kept_modules.report()["headers"] == "mlx"
    assert np.array_equal(outputs[0], outputs[1])
