"""The kernel layer is the bottom: ``metal/`` holds the library and imports nothing above it.

Kernels take arrays, never cache objects: no module under ``metal/`` imports
``dflash.cache`` (absolutely or as ``..cache``), any other part of ``dflash`` above it,
the tests or the benchmarks. And ``metal/`` holds only what ``import dflash.metal``
loads: every module is reached from its ``__init__``, and no tooling files (compile
shims, benchmarks) sit beside them.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

METAL = Path(__file__).resolve().parents[1] / "metal"
# Top-level names a kernel module may not import absolutely.
FORBIDDEN_ROOTS = {"cache", "verify", "training", "tests", "support", "benchmarks"}


def import_problems(source: str) -> list[str]:
    """The imports of ``source`` (a module of ``dflash.metal``) that reach above it.

    Args:
        source: Python source text.

    Returns:
        One description per offending import (empty when it imports only its
        siblings, the standard library and third-party packages).
    """
    problems = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.level > 1:
            problems.append(f"line {node.lineno}: from {'.' * node.level}{node.module}")
            continue
        if isinstance(node, ast.ImportFrom) and node.level == 0:
            names = [node.module or ""]
        elif isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        else:
            continue
        for name in names:
            parts = name.split(".")
            above = parts[0] == "dflash" and parts[1:2] != ["metal"]
            if above or parts[0] in FORBIDDEN_ROOTS:
                problems.append(f"line {node.lineno}: import {name}")
    return problems


def sibling_imports(source: str) -> set[str]:
    """Modules of the same package that ``source`` imports relatively."""
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.level == 1:
            if node.module:
                found.add(node.module.split(".")[0])
            else:
                found.update(alias.name for alias in node.names)
    return found


def test_no_metal_module_imports_the_cache_or_anything_above_it() -> None:
    modules = sorted(METAL.glob("*.py"))
    assert len(modules) >= 5, modules
    problems = {
        path.name: import_problems(path.read_text())
        for path in modules
        if import_problems(path.read_text())
    }
    assert not problems, problems


@pytest.mark.parametrize(
    "source",
    [
        "from ..cache import KvPlane",
        "from .. import cache",
        "from dflash.cache import plane",
        "import dflash.cache.plane",
        "import dflash",
        "def f():\n    from tests.support.launches import graph_launches",
        "from benchmarks.common import Geometry",
    ],
)
def test_the_import_check_catches_an_upward_import(source: str) -> None:
    assert import_problems(source), source


def test_the_import_check_allows_siblings_and_libraries() -> None:
    source = "import mlx.core as mx\nimport numpy as np\nfrom . import backend\n"
    source += (
        "from .layout import RowGeometry\nfrom dflash.metal.ring import ring_write\n"
    )
    assert import_problems(source) == []


def test_metal_holds_only_what_its_package_imports() -> None:
    modules = {path.stem for path in METAL.glob("*.py")}
    reached, todo = set(), ["__init__"]
    while todo:
        name = todo.pop()
        if name in reached:
            continue
        reached.add(name)
        todo += sorted(sibling_imports((METAL / f"{name}.py").read_text()) & modules)
    assert reached == modules, f"not imported by dflash.metal: {modules - reached}"
    files = {p.name for p in METAL.iterdir() if p.is_file()}
    assert files == {f"{name}.py" for name in modules}, files


def test_every_environment_switch_is_in_the_switch_table() -> None:
    """docs/verify-kernels.md lists every ``DFLASH_*`` switch the package reads (a new
    switch without a row fails), and no row names a switch the package dropped."""
    root = Path(__file__).resolve().parent.parent
    read = set()
    for folder in ("dflash", "metal", "cache"):
        for path in (root / folder).rglob("*.py"):
            read |= set(re.findall(r'"(DFLASH_[A-Z0-9_]+)"', path.read_text()))
    table = (root / "docs" / "verify-kernels.md").read_text()
    section = table.split("## Switches", 1)[1].split("\n## ", 1)[0]
    listed = set(re.findall(r"^\| `(DFLASH_[A-Z0-9_]+)` \|", section, flags=re.M))
    assert read and read == listed, (read - listed, listed - read)


def test_the_readme_names_only_switches_of_the_table() -> None:
    """Every ``DFLASH_*`` switch the README names is a row of the switch table (its
    summary of the defaults must not name a switch the package dropped)."""
    root = Path(__file__).resolve().parent.parent
    table = (root / "docs" / "verify-kernels.md").read_text()
    section = table.split("## Switches", 1)[1].split("\n## ", 1)[0]
    listed = set(re.findall(r"^\| `(DFLASH_[A-Z0-9_]+)` \|", section, flags=re.M))
    named = set(re.findall(r"DFLASH_[A-Z0-9_]+", (root / "README.md").read_text()))
    # Variables of the bench and the tests' interop, not package switches.
    others = {"DFLASH_PEER_SRC"}
    assert named - others <= listed, named - others - listed


@pytest.mark.parametrize("text, want", [(None, 5), ("", 5), ("12", 12), (" 7 ", 7)])
def test_count_switch_reads_a_non_negative_integer(monkeypatch, text, want) -> None:
    from dflash.metal import backend

    if text is None:
        monkeypatch.delenv("DFLASH_TEST_COUNT", raising=False)
    else:
        monkeypatch.setenv("DFLASH_TEST_COUNT", text)
    assert backend.count_switch("DFLASH_TEST_COUNT", 5) == want


@pytest.mark.parametrize("text", ["-1", "x", "1.5", "4k"])
def test_a_bad_count_switch_is_refused_naming_it(monkeypatch, text) -> None:
    from dflash.metal import backend

    monkeypatch.setenv("DFLASH_TEST_COUNT", text)
    with pytest.raises(ValueError, match="DFLASH_TEST_COUNT must be a non-negative"):
        backend.count_switch("DFLASH_TEST_COUNT", 5)
