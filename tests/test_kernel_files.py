"""Kernel texts handed to mlx's CUDA backend as ``#include`` lines (metal/kernel_files).

mlx hashes a custom kernel's whole source at every CUDA launch, so
:func:`dflash.metal.backend.make_kernel` writes each (compacted) header and body to a
content-addressed file and hands mlx one ``#include`` line for each. These tests hold
that the files hold exactly the texts, that a changed or tampered file is never used
as it is, that every case where a file cannot serve keeps the texts inline, and that
nvcc compiles the included unit to the same PTX as the inline one.
"""

from __future__ import annotations

import dataclasses
import re
import tempfile
from pathlib import Path

import mlx.core as mx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support import group_emulator
from support.compilers import NVCC, needs_nvcc

from dflash.metal import (
    attention,
    backend,
    heads,
    kernel_files,
    norms,
    tensor_attention,
    tensor_qmm,
)
from dflash.metal.sources import CUDA, compact_text

SPEC = tensor_qmm.SCALED_SPECS[(2, (4, 1), 64)]


def _fields(spec, kind: str = CUDA) -> dict:
    return dict(
        name=spec.name(kind),
        input_names=list(spec.input_names),
        output_names=list(spec.output_names),
        source=spec.source(kind),
        header=spec.header(kind),
    )


def _handed(monkeypatch, spec=SPEC, kind: str = CUDA) -> dict:
    """The fields ``make_kernel`` hands mlx for ``spec`` (mlx's factory faked)."""
    seen = {}

    def fake_kernel(**fields):
        seen.update(fields)
        return "kernel"

    monkeypatch.setattr(mx.fast, "cuda_kernel", fake_kernel)
    monkeypatch.setattr(mx.fast, "metal_kernel", fake_kernel)
    assert backend.make_kernel(kind, **_fields(spec, kind)) == "kernel"
    return seen


def _included_path(line: str) -> Path:
    match = re.fullmatch(r'#include "([^"]+)"\n', line)
    assert match, line
    return Path(match.group(1))


@pytest.fixture
def text_dir(tmp_path, monkeypatch) -> Path:
    directory = tmp_path / "texts"
    monkeypatch.setenv(kernel_files.TEXT_DIR_ENV, str(directory))
    monkeypatch.delenv(kernel_files.INCLUDED_TEXTS_ENV, raising=False)
    return directory


def test_make_kernel_hands_mlx_one_include_line_per_text(monkeypatch, text_dir):
    seen = _handed(monkeypatch)
    assert seen["name"] == SPEC.name(CUDA)  # named by the full texts, as before
    body = _included_path(seen["source"])
    header = _included_path(seen["header"])
    assert body.parent == header.parent == text_dir
    assert body.read_text() == compact_text(SPEC.source(CUDA))
    assert header.read_text() == compact_text(SPEC.header(CUDA))
    # mlx hashes what it is handed: two short lines instead of ~12 KB.
    assert len(seen["source"]) + len(seen["header"]) < 400
    assert len(body.read_text()) > 5000


def test_the_same_text_keeps_its_file_and_another_text_gets_another(
    monkeypatch, text_dir
):
    first = _included_path(_handed(monkeypatch)["source"])
    written = first.stat().st_mtime_ns, first.stat().st_ino
    again = _included_path(_handed(monkeypatch)["source"])
    assert again == first
    assert (again.stat().st_mtime_ns, again.stat().st_ino) == written
    other = tensor_qmm.SCALED_SPECS[(2, (4, 1), 128)]
    assert _included_path(_handed(monkeypatch, other)["source"]) != first


def test_a_tampered_file_is_rewritten_before_use(monkeypatch, text_dir):
    body = _included_path(_handed(monkeypatch)["source"])
    body.write_text("#error tampered\n")
    assert _included_path(_handed(monkeypatch)["source"]) == body
    assert body.read_text() == compact_text(SPEC.source(CUDA))


def _assert_inline(seen: dict, spec=SPEC) -> None:
    assert seen["source"] == compact_text(spec.source(CUDA))
    assert seen["header"] == compact_text(spec.header(CUDA))


def test_the_switch_off_keeps_the_texts_inline(monkeypatch, text_dir):
    monkeypatch.setenv(kernel_files.INCLUDED_TEXTS_ENV, "0")
    _assert_inline(_handed(monkeypatch))
    assert not text_dir.exists()


def test_an_unwritable_directory_keeps_the_texts_inline(monkeypatch, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    monkeypatch.setenv(kernel_files.TEXT_DIR_ENV, str(blocker / "texts"))
    _assert_inline(_handed(monkeypatch))


@pytest.mark.parametrize("name", ['with"quote', "with space", "with\\slash"])
def test_a_path_an_include_cannot_spell_keeps_the_texts_inline(
    monkeypatch, tmp_path, name
):
    directory = tmp_path / name
    monkeypatch.setenv(kernel_files.TEXT_DIR_ENV, str(directory))
    _assert_inline(_handed(monkeypatch))
    assert not directory.exists()


def test_a_body_naming_an_input_shape_keeps_its_text_inline(monkeypatch, text_dir):
    # mlx passes x_shape only when the text it is handed names it.
    spec = dataclasses.replace(SPEC, body=SPEC.body + "\n  (void)x_shape;\n")
    _assert_inline(_handed(monkeypatch, spec), spec)


def test_metal_texts_are_never_files(monkeypatch, text_dir):
    spec = heads.HEAD_PREP
    seen = _handed(monkeypatch, spec, kind="metal")
    assert seen["source"] == compact_text(spec.source("metal"))
    assert not text_dir.exists()


def test_the_default_directory_is_the_user_cache(monkeypatch, tmp_path):
    monkeypatch.delenv(kernel_files.TEXT_DIR_ENV, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert kernel_files.text_dir() == tmp_path / "dflash" / "cuda-texts"
    monkeypatch.delenv("XDG_CACHE_HOME")
    home = Path("~").expanduser()
    assert kernel_files.text_dir() == home / ".cache" / "dflash" / "cuda-texts"


_STATES = st.sampled_from(["absent", "same", "other", "empty", "longer"])


@settings(max_examples=60, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=st.text(min_size=1, max_size=300), state=_STATES)
def test_write_text_leaves_exactly_the_text_whatever_was_there(
    tmp_path, text, state
) -> None:
    path = kernel_files.text_path(
        Path(tempfile.mkdtemp(dir=tmp_path)), "k", "body", text
    )
    before = {
        "absent": None,
        "same": text,
        "other": text[::-1] + "x",
        "empty": "",
        "longer": text * 3,
    }[state]
    if before is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(before.encode())
    kernel_files.write_text(path, text)
    assert path.read_bytes() == text.encode()
    # No temporary file is left beside it.
    assert [p.name for p in path.parent.iterdir()] == [path.name]


@given(a=st.text(max_size=50), b=st.text(max_size=50))
def test_a_path_names_its_text(a, b) -> None:
    directory = Path("/d")
    same = kernel_files.text_path(directory, "k", "body", a) == kernel_files.text_path(
        directory, "k", "body", b
    )
    assert same == (a == b)


def _ptx(units: dict[str, str], workdir: Path, name: str) -> str:
    """The PTX of ``units`` in one translation unit (one nvcc run), each in its own
    namespace."""
    source = workdir / f"{name}.cu"
    source.write_text(group_emulator.namespaced_cuda(units))
    return group_emulator.cuda_ptx(source, workdir, NVCC)


@needs_nvcc
def test_the_included_unit_compiles_to_the_inline_units_ptx(tmp_path: Path) -> None:
    """What mlx's JIT compiles from the stubs is the program of the inline texts: the
    4-bit verify's launches (matmul forms, attention, fold, head prep, norm)."""
    specs = [
        tensor_qmm.SCALED_SPECS[(2, (4, 1), 64)],
        tensor_qmm.SWIGLU_SCALED_SPECS[(2, (4, 2), 64)],
        tensor_qmm.FORM_SPECS[(False, 2)][(0, 1)],
        tensor_qmm.REDUCE_SPEC,
        tensor_attention.attend_spec(128, tensor_attention.WIDE),
        attention.FOLD_GATED,
        heads.HEAD_PREP,
        norms.RESIDUAL_NORM,
    ]
    workdir = tmp_path / "units"
    # Sets up the shim of mlx's device headers in workdir/include.
    assert group_emulator.check_cuda(specs[:1], workdir, NVCC, dtypes=[mx.bfloat16]).ok
    texts = tmp_path / "texts"
    inline_units, included_units = {}, {}
    for i, spec in enumerate(specs):
        small = dataclasses.replace(
            spec, helpers=compact_text(spec.helpers), body=compact_text(spec.body)
        )
        header, source = small.header(CUDA), small.source(CUDA)
        stubs = kernel_files.included_texts(
            spec.name(CUDA), source, header, spec.input_names, texts
        )
        assert stubs is not None
        inline = group_emulator.cuda_unit(small, mx.bfloat16, default_header=False)
        assert inline.count(source) == 1 and (not header or inline.count(header) == 1)
        included = inline.replace(source, stubs[0])
        if header:
            included = included.replace(header, stubs[1])
        assert len(included) < len(inline) - len(source) // 2
        inline_units[f"unit{i}"], included_units[f"unit{i}"] = inline, included
    # Every unit in one nvcc run a side (the namespaces keep their helpers apart).
    inline_ptx = _ptx(inline_units, workdir, "inline")
    assert _ptx(included_units, workdir, "included") == inline_ptx


def test_every_cuda_kernel_the_package_builds_is_included(tmp_path, monkeypatch):
    """No shipped CUDA text names an input's shape (which would keep it inline, and
    hashed at every launch): each gets its ``#include`` stubs."""
    monkeypatch.delenv(kernel_files.INCLUDED_TEXTS_ENV, raising=False)
    from support import compile_check

    plain = compile_check.check_specs()
    texts = [(s.name(CUDA), s.source(CUDA), "", s.input_names) for s in plain]
    texts += [
        (s.name(CUDA), s.source(CUDA), s.header(CUDA), s.input_names)
        for s in group_emulator.package_specs()
        if CUDA in s.backends
    ]
    for name, source, header, inputs in texts:
        source, header = compact_text(source), compact_text(header)
        stubs = kernel_files.included_texts(name, source, header, inputs, tmp_path)
        assert stubs is not None, name
        assert stubs[0].startswith("#include") and (not header or stubs[1])
