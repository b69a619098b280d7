"""The corpus: the running CPython's standard-library ``.py`` files, split by path hash.

The file list is sorted, so the corpus (and therefore the tokenizer and token arrays) is a
function of the Python version alone. A file is held out when the first 8 bytes of the
SHA-256 of its relative path, read as an integer, fall in the lowest ``heldout_fraction``
of the range: about 5 % of files, chosen independently of their content or order.
"""

from __future__ import annotations

import hashlib
import os
import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, List, Optional, Tuple

HELDOUT_FRACTION = 0.05
_SKIPPED_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__"})


@dataclass(frozen=True)
class CorpusFile:
    """One source file: its path relative to the stdlib root and its split."""

    relative_path: str
    heldout: bool


def stdlib_root() -> Path:
    """The running interpreter's standard-library folder."""
    return Path(sysconfig.get_paths()["stdlib"])


def is_heldout(relative_path: str, fraction: float = HELDOUT_FRACTION) -> bool:
    """Whether ``relative_path`` belongs to the held-out split.

    Args:
        relative_path: POSIX path relative to the stdlib root.
        fraction: Share of the hash range that is held out.

    Returns:
        True for held-out files.
    """
    digest = hashlib.sha256(relative_path.encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") < fraction * 2**64


def list_files(
    root: Optional[Path] = None, fraction: float = HELDOUT_FRACTION
) -> List[CorpusFile]:
    """Every ``.py`` file under ``root`` outside site-packages, sorted by path.

    Args:
        root: Folder to walk (default: the running stdlib).
        fraction: Held-out share passed to :func:`is_heldout`.

    Returns:
        The files in sorted order with their split.
    """
    root = Path(root) if root is not None else stdlib_root()
    paths = []
    for folder, subfolders, names in os.walk(root):
        subfolders[:] = [d for d in subfolders if d not in _SKIPPED_DIRS]
        for name in names:
            if name.endswith(".py"):
                paths.append(Path(folder, name).relative_to(root).as_posix())
    return [CorpusFile(path, is_heldout(path, fraction)) for path in sorted(paths)]


def read_source(path: Path) -> str:
    """A source file's text: UTF-8, or Latin-1 for the few files that are not UTF-8."""
    data = Path(path).read_bytes()
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return data.decode("latin-1")


def iter_texts(
    files: List[CorpusFile], root: Optional[Path] = None, heldout: bool = False
) -> Iterator[Tuple[str, str]]:
    """Yield ``(relative_path, text)`` of the files in one split, in list order."""
    root = Path(root) if root is not None else stdlib_root()
    for entry in files:
        if entry.heldout == heldout:
            yield entry.relative_path, read_source(root / entry.relative_path)
