"""mlx's CUDA device headers, read from the ``libmlx`` this process runs.

mlx compiles every custom CUDA kernel with NVRTC against its own device headers
(``mlx/backend/cuda/device/utils.cuh``, ``unary_ops.cuh`` and the rest). They are not
files of the wheel: mlx's build embeds each as a NUL-terminated string in ``libmlx``,
and its JIT hands NVRTC two parallel tables, the include names (``g_include_names``)
and the texts (``g_headers``). :mod:`.kept_modules` compiles our kernels as mlx would,
so it needs those same texts: with them its compile is mlx's own (same source, headers,
options and NVRTC), including the kernels that name mlx's ``Sigmoid``.

:func:`device_headers` reads the two tables out of the shared library's ELF image:
the tables' symbols (``.symtab``; mlx's wheels keep it), the relocations that fill
their pointers (``.rela.dyn``, ``R_*_RELATIVE``), and the strings those point at.
Nothing is copied into this project; the texts come from the mlx installed beside it.
Anything unexpected (no symbol table, another layout, a name outside mlx's device
folder) gives None, and the caller keeps its stand-in.
"""

from __future__ import annotations

import functools
import mmap
import struct
from pathlib import Path
from typing import Dict, Iterator, Optional, Tuple

import numpy as np

INCLUDE_PREFIX = "mlx/backend/cuda/device/"
# The tables' mangled names (namespace mlx::core::cu, anonymous, internal linkage).
NAMES_SYMBOL = b"_ZN3mlx4core2cu12_GLOBAL__N_1L15g_include_namesE"
HEADERS_SYMBOL = b"_ZN3mlx4core2cu12_GLOBAL__N_1L9g_headersE"
# R_X86_64_RELATIVE and R_AARCH64_RELATIVE, by e_machine.
RELATIVE_TYPES = {62: 8, 183: 1027}
SHT_SYMTAB = 2
SHT_RELA = 4
PT_LOAD = 1
MAX_HEADER_BYTES = 1 << 20
_SYMBOL = np.dtype(
    [("name", "<u4"), ("info", "u1"), ("other", "u1"), ("shndx", "<u2"),
     ("value", "<u8"), ("size", "<u8")]
)  # fmt: skip
_RELA = np.dtype([("offset", "<u8"), ("info", "<u8"), ("addend", "<i8")])


class _Image:
    """A little-endian ELF64 shared library, mapped read-only."""

    def __init__(self, data: mmap.mmap) -> None:
        self.data = data
        if data[:6] != b"\x7fELF\x02\x01":
            raise ValueError("not a little-endian ELF64 file")
        (self.machine,) = struct.unpack_from("<H", data, 0x12)
        phoff, shoff = struct.unpack_from("<QQ", data, 0x20)
        phentsize, phnum, shentsize, shnum = struct.unpack_from("<HHHH", data, 0x36)
        self.segments = []
        for index in range(phnum):
            kind, _, offset, vaddr, _, filesz = struct.unpack_from(
                "<IIQQQQ", data, phoff + index * phentsize
            )
            if kind == PT_LOAD:
                self.segments.append((vaddr, filesz, offset))
        self.sections = [
            struct.unpack_from("<IIQQQQIIQQ", data, shoff + index * shentsize)
            for index in range(shnum)
        ]

    def file_offset(self, address: int) -> int:
        """The file offset of virtual ``address`` (ValueError outside the loaded file)."""
        for vaddr, filesz, offset in self.segments:
            if vaddr <= address < vaddr + filesz:
                return address - vaddr + offset
        raise ValueError(f"address {address:#x} is not in the file")

    def section_bytes(self, section: tuple) -> bytes:
        offset, size = section[4], section[5]
        return self.data[offset : offset + size]

    def symbols(self, wanted: Tuple[bytes, ...]) -> Dict[bytes, Tuple[int, int]]:
        """``name -> (address, size)`` for the ``wanted`` names in ``.symtab``."""
        found: Dict[bytes, Tuple[int, int]] = {}
        for section in self.sections:
            if section[1] != SHT_SYMTAB:
                continue
            strings = self.section_bytes(self.sections[section[6]])
            offsets = {}
            for name in wanted:
                at = strings.find(name + b"\0")
                while at >= 0:
                    offsets[at] = name
                    at = strings.find(name + b"\0", at + 1)
            table = np.frombuffer(self.section_bytes(section), dtype=_SYMBOL)
            for index in np.flatnonzero(np.isin(table["name"], list(offsets))):
                entry = table[index]
                if int(entry["size"]):
                    found.setdefault(
                        offsets[int(entry["name"])],
                        (int(entry["value"]), int(entry["size"])),
                    )
        return found

    def relative_targets(self, start: int, stop: int) -> Dict[int, int]:
        """``slot address -> target`` of the RELATIVE relocations in ``[start, stop)``."""
        relative = RELATIVE_TYPES.get(self.machine)
        targets: Dict[int, int] = {}
        for section in self.sections:
            if section[1] != SHT_RELA or relative is None:
                continue
            table = np.frombuffer(self.section_bytes(section), dtype=_RELA)
            chosen = (
                (table["offset"] >= start)
                & (table["offset"] < stop)
                & (table["info"] & 0xFFFFFFFF == relative)
            )
            for entry in table[chosen]:
                targets[int(entry["offset"])] = int(entry["addend"])
        return targets

    def pointers(self, address: int, size: int) -> Iterator[int]:
        """The pointer values of the table at ``address``: the relocation's target, or
        the word stored in the file where no relocation fills the slot."""
        targets = self.relative_targets(address, address + size)
        for slot in range(address, address + size, 8):
            stored = struct.unpack_from("<Q", self.data, self.file_offset(slot))[0]
            yield targets.get(slot, stored)

    def string(self, address: int) -> str:
        start = self.file_offset(address)
        stop = self.data.find(b"\0", start, start + MAX_HEADER_BYTES)
        if stop < 0:
            raise ValueError(f"no end to the string at {address:#x}")
        return self.data[start:stop].decode("utf-8")


def read_headers(library: Path) -> Optional[Dict[str, str]]:
    """mlx's device headers (include name -> text) embedded in ``library``.

    Args:
        library: A ``libmlx`` shared library (mlx's CUDA build).

    Returns:
        The include names and texts of mlx's JIT tables, in mlx's order; None where
        the file cannot be read or holds no such tables (a CPU or Metal build, a
        stripped library, another layout).
    """
    try:
        with open(library, "rb") as handle:
            data = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ)
    except (OSError, ValueError):
        return None
    try:
        image = _Image(data)
        found = image.symbols((NAMES_SYMBOL, HEADERS_SYMBOL))
        if len(found) != 2 or found[NAMES_SYMBOL][1] != found[HEADERS_SYMBOL][1]:
            return None
        names = [image.string(p) for p in image.pointers(*found[NAMES_SYMBOL])]
        texts = [image.string(p) for p in image.pointers(*found[HEADERS_SYMBOL])]
    except (ValueError, struct.error, UnicodeDecodeError, IndexError):
        return None
    finally:
        data.close()
    if not names or len(set(names)) != len(names):
        return None
    if not all(name.startswith(INCLUDE_PREFIX) for name in names):
        return None
    return dict(zip(names, texts))


@functools.lru_cache(maxsize=8)
def _cached_headers(library: str, stamp: Tuple[int, int]) -> Optional[Dict[str, str]]:
    return read_headers(Path(library))


def device_headers(library: Optional[Path]) -> Optional[Dict[str, str]]:
    """:func:`read_headers`, read once per file version (path, size and mtime)."""
    if library is None:
        return None
    try:
        status = Path(library).stat()
    except OSError:
        return None
    headers = _cached_headers(str(library), (status.st_size, status.st_mtime_ns))
    return None if headers is None else dict(headers)
