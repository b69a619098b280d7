"""The compilers the kernel tests use (found once), the marks that skip a test without
them, and the emulators built for a test module."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Sequence, TypeVar

import pytest

from .compile_check import find_compiler

GXX = find_compiler("g++")
NVCC = find_compiler("nvcc")
needs_gxx = pytest.mark.skipif(GXX is None, reason="g++ not installed")
needs_nvcc = pytest.mark.skipif(NVCC is None, reason="nvcc not installed")

Emulator = TypeVar("Emulator")


def built_emulator(
    make: Callable[[Path, Sequence[Any], str], Emulator],
    tmp_path_factory: pytest.TempPathFactory,
    name: str,
    specs: Sequence[Any],
) -> Emulator:
    """An emulator compiled with g++ in a fresh folder; skips the test without g++.

    Args:
        make: The emulator class (``MetalEmulator`` or ``GroupEmulator``).
        tmp_path_factory: pytest's factory for the build folder.
        name: The build folder's name.
        specs: The kernel specs to compile.

    Returns:
        The emulator, its build checked.
    """
    if GXX is None:
        pytest.skip("g++ not installed")
    emulator = make(tmp_path_factory.mktemp(name), specs, GXX)
    assert emulator.build.ok, emulator.build.log
    return emulator
