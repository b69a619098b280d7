"""Kernel texts handed to mlx's CUDA backend as one ``#include`` line each.

mlx 0.32.4's ``CustomKernel::eval_gpu`` names a custom kernel's JIT module by
``std::hash`` of the kernel's whole generated source, at *every* launch (session 34:
7-10 % of a 4-bit decode's host time; the compacted matmul text is still ~12 KB).
NVRTC reads ``#include`` files from the file system when it compiles, so the header
and the body can live in files while mlx is handed, and hashes, one line for each:
``#include "<dir>/<name>.<part>.<digest>.cuh"``. The body's line sits inside the
kernel function mlx writes, so the preprocessor pastes the body there: the same
translation unit, the same program (``tests/test_kernel_files.py`` compares the PTX).

The files are content-addressed (the digest is of the text), written atomically and
read back before use, so a module mlx cached on disk under a stub's name always
matches the text that stub names. Where no file can be written (or the directory's
path cannot be spelled inside an ``#include``), the texts stay inline, as before.

``DFLASH_INCLUDED_TEXTS=0`` keeps every text inline; ``DFLASH_KERNEL_TEXT_DIR`` picks
the directory (default: ``$XDG_CACHE_HOME/dflash/cuda-texts`` or
``~/.cache/dflash/cuda-texts``). Metal is unaffected (mlx's Metal backend does not
hash the source at a launch, and its compiler is not handed files).
"""

from __future__ import annotations

import hashlib
import os
import re
import tempfile
from pathlib import Path
from typing import Optional, Sequence

INCLUDED_TEXTS = True
INCLUDED_TEXTS_ENV = "DFLASH_INCLUDED_TEXTS"
TEXT_DIR_ENV = "DFLASH_KERNEL_TEXT_DIR"
# Characters a directory may hold to be spelled inside ``#include "..."`` as is.
_SAFE_PATH = re.compile(r"[A-Za-z0-9_./+=,@%-]+")
# mlx passes an input's shape, strides or ndim only when the source it is handed
# names them, so a body that does keeps its text inline.
_SHAPE_SUFFIXES = ("_shape", "_strides", "_ndim")


def text_dir() -> Path:
    """The directory the kernel texts are written to (see the module docstring)."""
    chosen = os.environ.get(TEXT_DIR_ENV, "").strip()
    if chosen:
        return Path(chosen).expanduser().absolute()
    cache = os.environ.get("XDG_CACHE_HOME", "").strip() or "~/.cache"
    return (Path(cache).expanduser() / "dflash" / "cuda-texts").absolute()


def text_path(directory: Path, name: str, part: str, text: str) -> Path:
    """Where ``text`` (the ``part`` of kernel ``name``) lives: named by its digest."""
    digest = hashlib.sha256(text.encode()).hexdigest()[:20]
    return directory / f"{name}.{part}.{digest}.cuh"


def write_text(path: Path, text: str) -> None:
    """Make ``path`` hold exactly ``text``: kept when it already does, else written
    to a temporary file beside it and renamed over it (readers never see a part).

    Raises:
        OSError: The directory cannot be made or written, or the file read back
            differs from ``text``.
    """
    data = text.encode()
    try:
        if path.read_bytes() == data:
            return
    except OSError:
        pass
    path.parent.mkdir(parents=True, exist_ok=True)
    replace_atomically(path, data)
    if path.read_bytes() != data:
        raise OSError(f"{path} does not hold the text just written to it")


def replace_atomically(path: Path, data: bytes) -> None:
    """Write ``data`` to a temporary file beside ``path`` and rename it over ``path``
    (a reader sees the old file or the whole new one; the temporary never stays).

    Raises:
        OSError: The temporary cannot be made or written, or the rename fails.
    """
    handle, temporary = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
    try:
        with os.fdopen(handle, "wb") as file:
            file.write(data)
        os.replace(temporary, path)
    except BaseException:
        try:
            os.unlink(temporary)
        except OSError:
            pass
        raise


def include_line(path: Path) -> str:
    """The one line mlx is handed for the text in ``path``."""
    return f'#include "{path}"\n'


def included_texts(
    name: str,
    source: str,
    header: str,
    input_names: Sequence[str],
    directory: Optional[Path] = None,
) -> Optional[tuple[str, str]]:
    """The ``(source, header)`` stubs that include kernel ``name``'s texts from files,
    or None when they must stay inline: the path cannot be spelled inside an
    ``#include``, a file cannot be written, or the body names an input's shape,
    strides or ndim (mlx looks for those names in the text it is handed). The
    switch (:data:`INCLUDED_TEXTS_ENV`) is the caller's: ``backend.make_kernel``.

    Args:
        name: The kernel's name (it already hashes its full text).
        source: The (compacted) body mlx would be handed.
        header: The (compacted) header mlx would be handed ("" for none).
        input_names: The kernel's input names.
        directory: Where to write (default :func:`text_dir`).
    """
    if any(n + suffix in source for n in input_names for suffix in _SHAPE_SUFFIXES):
        return None
    directory = text_dir() if directory is None else directory
    if not directory.is_absolute():
        return None
    stubs = []
    try:
        for part, text in (("body", source), ("header", header)):
            if not text:
                stubs.append("")
                continue
            path = text_path(directory, name, part, text)
            if not _SAFE_PATH.fullmatch(str(path)):
                return None
            write_text(path, text)
            stubs.append(include_line(path))
    except OSError:
        return None
    return stubs[0], stubs[1]
