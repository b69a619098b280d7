"""The kernel texts mlx is handed are compacted: the same tokens in fewer bytes.

mlx's CUDA backend hashes a custom kernel's whole source at every launch, so
:func:`dflash.metal.backend.make_kernel` hands it :func:`compact_text` of each text.
These tests hold that the compaction keeps every token, literal and preprocessor line
of every kernel text the package builds, that it splits over the header / helpers and
prologue / body joins (so compiling compacted specs compiles what mlx gets), that the
compacted kernels compile (g++ for Metal, nvcc for CUDA), and that bad text fails.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import List

import mlx.core as mx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from support import compile_check, group_emulator
from support.compilers import GXX, NVCC, needs_gxx, needs_nvcc

from dflash.metal import (
    attention,
    backend,
    groups,
    heads,
    kernel_files,
    norms,
    tensor_attention,
    tensor_qmm,
)
from dflash.metal.sources import BACKENDS, PROLOGUES, compact_text

# Comments, string / character literals, then words and single punctuation marks.
_TOKEN = re.compile(
    r"//[^\n]*|/\*.*?\*/|\"(?:\\.|[^\"\\])*\"|'(?:\\.|[^'\\])*'|\w+|\S", re.DOTALL
)


def tokens(text: str) -> List[str]:
    """The C tokens of ``text``, comments dropped (a reference independent of
    :func:`compact_text`'s scanner)."""
    return [t for t in _TOKEN.findall(text) if not t.startswith(("//", "/*"))]


def directives(text: str) -> List[str]:
    """The preprocessor lines of ``text``, trimmed and without trailing comments."""
    lines = (re.sub(r"\s*//.*", "", line.strip()) for line in text.splitlines())
    return [line for line in lines if line.startswith("#")]


def every_text() -> List[str]:
    texts = []
    for spec in compile_check.check_specs():
        texts += [spec.source(name) for name in BACKENDS]
    for spec in group_emulator.package_specs():
        for name in spec.backends:
            texts += [spec.header(name), spec.source(name)]
    return texts


def compacted(spec: groups.GroupKernelSpec) -> groups.GroupKernelSpec:
    return dataclasses.replace(
        spec, helpers=compact_text(spec.helpers), body=compact_text(spec.body)
    )


def test_every_kernel_text_keeps_its_tokens_and_directives() -> None:
    saved = 0
    for text in every_text():
        small = compact_text(text)
        assert tokens(small) == tokens(text)
        assert directives(small) == directives(text)
        assert compact_text(small) == small  # nothing left to take
        assert "//" not in small and "/*" not in small
        assert all(line == line.strip() and line for line in small.splitlines())
        saved += len(text) - len(small)
    assert saved > 0


def test_the_matmul_text_loses_a_quarter() -> None:
    spec = tensor_qmm.FORM_SPECS[(False, 2)][(4, 1)]
    text = spec.header("cuda") + spec.source("cuda")
    assert len(compact_text(text)) < 0.8 * len(text)


def test_compaction_splits_at_the_joins_mlx_sees() -> None:
    # make_kernel compacts header = HEADERS + helpers and source = PROLOGUE + body;
    # the compile checks below compact helpers and body alone.
    for spec in group_emulator.package_specs():
        for name in spec.backends:
            whole = compact_text(spec.header(name))
            assert whole == compact_text(groups.HEADERS[name]) + compact_text(
                spec.helpers
            )
            whole = compact_text(spec.source(name))
            assert whole == compact_text(groups.PROLOGUES[name]) + compact_text(
                spec.body
            )
    for spec in compile_check.check_specs():
        for name in BACKENDS:
            assert compact_text(spec.source(name)) == compact_text(
                PROLOGUES[name]
            ) + compact_text(spec.body)


def test_make_kernel_hands_mlx_the_compacted_texts(monkeypatch) -> None:
    # Inline (the included files hold the same texts: tests/test_kernel_files.py).
    monkeypatch.setenv(kernel_files.INCLUDED_TEXTS_ENV, "0")
    seen = {}

    def fake_kernel(**fields):
        seen.update(fields)
        return "kernel"

    monkeypatch.setattr(mx.fast, "cuda_kernel", fake_kernel)
    spec = heads.HEAD_PREP
    made = backend.make_kernel(
        "cuda",
        name=spec.name("cuda"),
        input_names=list(spec.input_names),
        output_names=list(spec.output_names),
        source=spec.source("cuda"),
        header=spec.header("cuda"),
    )
    assert made == "kernel"
    assert seen["source"] == compact_text(spec.source("cuda"))
    assert seen["header"] == compact_text(spec.header("cuda"))
    assert seen["name"] == spec.name("cuda")  # named by the full text, as before


# Fragments of C text: tokens, literals holding comment markers, comments, blanks,
# indentation and a continued macro.
_FRAGMENTS = st.sampled_from(
    [
        "int",
        "x",
        "=",
        "a/b",
        "1.0f",
        ";",
        "{",
        "}",
        '"// kept"',
        '"/* kept */"',
        '"esc\\"aped"',
        "'/'",
        "'\\''",
        "// a comment",
        "/* a\nblock */",
        "/**/",
        "\n",
        "\n\n",
        "   ",
        "\t",
        "#define M(v) \\\n  (v)\n",
        "#pragma unroll\n",
        "a = b / c;",
    ]
)


@settings(max_examples=300, deadline=None)
@given(st.lists(_FRAGMENTS, max_size=40))
def test_random_text_keeps_its_tokens(parts: List[str]) -> None:
    # Fragments are joined by line breaks so no two tokens merge into one.
    text = "\n".join(parts) + "\n"
    small = compact_text(text)
    assert tokens(small) == tokens(text)
    assert directives(small) == directives(text)
    assert compact_text(small) == small
    assert len(small) <= len(text)


@pytest.mark.parametrize(
    "text", ["int a; /* never closed\n", "int a; // spliced \\\nint b;\n"]
)
def test_text_compaction_cannot_keep_fails(text: str) -> None:
    with pytest.raises(ValueError):
        compact_text(text)


@needs_gxx
def test_compacted_metal_bodies_compile(tmp_path: Path) -> None:
    specs = [
        compacted(s) for s in group_emulator.package_specs() if "metal" in s.backends
    ]
    for part in ("groups", "plain"):
        (tmp_path / part).mkdir()
    result = group_emulator.check_metal(specs, tmp_path / "groups", GXX)
    assert result.ok, f"{result.command}\n{result.log}"
    plain = [
        dataclasses.replace(s, body=compact_text(s.body))
        for s in compile_check.check_specs()
    ]
    result = compile_check.check_metal(plain, tmp_path / "plain", GXX)
    assert result.ok, f"{result.command}\n{result.log}"


def _ptx(specs, workdir: Path) -> str:
    """The PTX of ``specs`` in bfloat16 (one translation unit, as
    :func:`group_emulator.check_cuda` writes it), kernel-name digests masked (a name
    hashes its own text)."""
    source = group_emulator.write_cuda_units(specs, workdir, dtypes=[mx.bfloat16])
    ptx = group_emulator.cuda_ptx(source, workdir, NVCC)
    return re.sub(r"_[0-9a-f]{10}_", "_digest_", ptx)


@needs_nvcc
def test_compacted_cuda_bodies_compile_to_the_same_ptx(tmp_path: Path) -> None:
    # What the 4-bit verify launches: matmul forms of each kind, the attention.
    specs = [
        tensor_qmm.FORM_SPECS[(False, 2)][(4, 1)],
        tensor_qmm.FORM_SPECS[(True, 1)][(4, 2)],
        *tensor_qmm.SCALED_SPECS.values(),
        tensor_qmm.REDUCE_SPEC,
        tensor_attention.attend_spec(128, tensor_attention.STREAM),
        attention.FOLD_GATED,
        heads.HEAD_PREP,
        norms.RESIDUAL_NORM,
    ]
    # PTX alone: the forms' cubins (ptxas) are built by their own compile tests.
    full = _ptx(specs, tmp_path / "full")
    assert full == _ptx([compacted(s) for s in specs], tmp_path / "compact")
