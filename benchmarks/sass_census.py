"""What the tensor-core matmul's chunk loop is made of, from its machine code (no GPU).

Session 48's profile found the 4-bit matmul issue-bound: ~470 warp instructions a
warp a chunk, of which the arithmetic proper is ~250. Fewer instructions a chunk is
the lever, and counting them needs no GPU: nvcc compiles each form for ``sm_90``
exactly as mlx's JIT does (NVRTC, ``sm_90a``; the same SASS), and this module reads
the SASS words of the cubin itself. There is no disassembler on this machine
(``nvdisasm`` / ``cuobjdump`` are not installed), so the census decodes only what it
needs from each 128-bit word:

* the opcode, the low 9 bits, named by :data:`OPCODES` (the table was read off
  session 48's Nsight Compute listing of the shipped form, compiled here to the same
  instruction stream: every mnemonic's count agrees, see the tests);
* a branch's target (``BRA``: a signed word offset from the next instruction, bits
  16-23 in units of 4 bytes plus bits 32-81 in units of 256, checked against the
  listing's absolute targets).

The chunk loop is the backward branch whose body holds the most ``HMMA``. Its
**tail**, from the last point where control flow joins to the loop's branch, is
straight-line code that runs once a chunk: its count is the exact per-chunk count of
those instructions (on session 48's listing, the tail ran exactly as often as the
loop's head). The **head** before it holds the stage ring's copy issue, whose paths
depend on alignment and rows: it is given as the static count of every path but the
misaligned inputs' (the blocks that call the plain-copy helper), an upper bound of
what a chunk runs there.

Run (from the repository root; needs nvcc)::

    python -m benchmarks.sass_census --variants current,paired,lean,paired-lean \
        --json docs/benchmarks/.../sass-census.json

Each variant is one of ``benchmarks.matmul_variants.VARIANTS``; ``--forms`` picks the
kernel forms (default: :data:`DEFAULT_FORMS`, the 4-bit forms at group 64 with one and
two row tiles, scaled, denormal (pairs in place or not), unscaled, folded and SwiGLU, and
the dense bfloat16 forms).
Each form is compiled alone, as NVRTC compiles it (nvcc's code for a unit changes with
the other units in its file).
"""

from __future__ import annotations

import argparse
import json
import platform
import re
import struct
import sys
import tempfile
from collections import Counter
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable, Optional, Sequence

import mlx.core as mx

# The SASS opcodes (low 9 bits of the 128-bit word) of the forms' instructions, read
# off session 48's Nsight Compute listing (the other bits select operand kinds:
# register, immediate, constant or uniform); USEL and UISETP, not in it, by the
# uniform twins' pattern, FFMA by FADD's (0x021).
OPCODES = {
    0x002: "MOV",
    0x005: "CS2R",
    0x007: "SEL",
    0x00C: "ISETP",
    0x010: "IADD3",
    0x011: "LEA",
    0x012: "LOP3",
    0x013: "IABS",
    0x016: "PRMT",
    0x019: "SHF",
    0x01C: "PLOP3",
    0x021: "FADD",
    0x023: "FFMA",  # (the unscaled forms' group close; not in the listing)
    0x024: "IMAD",
    0x025: "IMAD.WIDE",
    0x027: "IMAD.HI",
    0x031: "HFMA2",
    0x036: "VIADD",
    0x03C: "HMMA",
    0x03E: "F2FP",
    0x046: "VIADDMNMX",
    0x082: "UMOV",
    0x086: "VOTEU",
    0x087: "USEL",  # (the uniform twins are 0x080 + the plain op, as UMOV / MOV)
    0x08C: "UISETP",
    0x090: "UIADD3",
    0x091: "ULEA",
    0x092: "ULOP3",
    0x099: "USHF",
    0x0A4: "UIMAD",
    0x0A5: "UIMAD.WIDE",
    0x0B9: "ULDC",
    0x0CA: "R2UR",
    0x100: "FLO",
    0x105: "F2I",
    0x106: "I2F",
    0x108: "MUFU",
    0x109: "POPC",
    0x118: "NOP",
    0x119: "S2R",
    0x11A: "DEPBAR",
    0x11D: "BAR",
    0x141: "BSYNC",
    0x142: "BREAK",
    0x144: "CALL",
    0x145: "BSSY",
    0x147: "BRA",
    0x14D: "EXIT",
    0x150: "RET",
    0x181: "LDG",
    0x182: "LDC",
    0x184: "LDS",
    0x186: "STG",
    0x188: "STS",
    0x189: "SHFL",
    0x18F: "CCTL",
    0x192: "MEMBAR",
    0x1A8: "ATOMG",
    0x1AB: "ERRBAR",  # (CGAERRBAR too)
    0x1AE: "LDGSTS",
    0x1AF: "LDGDEPBAR",
    0x1C3: "S2UR",
}
WORD_BYTES = 16
BRANCH = 0x147
CALL = 0x144
ALWAYS = 0x7  # the predicate field's PT, not negated
NEVER = 0xF  # !PT

# What each instruction is for, as session 48's profile grouped them.
KINDS = {
    "HMMA": "arithmetic",
    "HFMA2": "arithmetic",
    "LOP3": "arithmetic",
    "SHF": "arithmetic",
    "PRMT": "permute",
    "LDS": "shared load",
    "LDGSTS": "copy",
    "LDG": "copy",
    "BAR": "sync",
    "DEPBAR": "sync",
    "LDGDEPBAR": "sync",
}
ADDRESS = {"IMAD", "IMAD.WIDE", "IMAD.HI", "IADD3", "LEA", "VIADD", "MOV", "SEL"}


@dataclass(frozen=True)
class Instruction:
    """One decoded SASS word.

    Attributes:
        index: Position in the kernel (words).
        opcode: The low 9 bits.
        mnemonic: The opcode's name (``"?0x..."`` when not in :data:`OPCODES`).
        target: A branch's target index (None for other instructions).
        conditional: Whether a predicate guards it (bits 12-15 other than ``PT``).
        never: Its predicate is ``!PT``: it issues and does nothing (ptxas puts three
            ``@!PT LDS RZ, [RZ]`` before each ``LDGSTS``).
    """

    index: int
    opcode: int
    mnemonic: str
    target: Optional[int]
    conditional: bool = False
    never: bool = False


def kernel_words(cubin: bytes) -> dict[str, list[int]]:
    """Every ``.text.<kernel>`` section of an ELF64 cubin as 128-bit words.

    Args:
        cubin: The cubin's bytes.

    Returns:
        The words of each kernel, keyed by its mangled name.
    """
    if cubin[:4] != b"\x7fELF" or cubin[4] != 2 or cubin[5] != 1:
        raise ValueError("not a little-endian ELF64 cubin")
    (section_offset,) = struct.unpack_from("<Q", cubin, 0x28)
    entry_size, count, names_index = struct.unpack_from("<HHH", cubin, 0x3A)
    headers = [
        struct.unpack_from("<IIQQQQIIQQ", cubin, section_offset + i * entry_size)
        for i in range(count)
    ]
    names_at = headers[names_index][4]

    def name(offset: int) -> str:
        start = names_at + offset
        return cubin[start : cubin.index(b"\0", start)].decode()

    kernels = {}
    for header in headers:
        section = name(header[0])
        if section.startswith(".text."):
            offset, size = header[4], header[5]
            body = cubin[offset : offset + size]
            kernels[section[len(".text.") :]] = [
                int.from_bytes(body[i : i + WORD_BYTES], "little")
                for i in range(0, len(body), WORD_BYTES)
            ]
    return kernels


def branch_offset(word: int) -> int:
    """A ``BRA``'s signed byte offset from the next instruction."""
    high = (word >> 32) & ((1 << 50) - 1)
    if high >> 49:
        high -= 1 << 50
    return high * 256 + ((word >> 16) & 0xFF) * 4


def decode(words: Sequence[int]) -> list[Instruction]:
    """Name each word's opcode and resolve branch targets.

    Args:
        words: A kernel's 128-bit instruction words.

    Returns:
        One :class:`Instruction` a word.
    """
    instructions = []
    for index, word in enumerate(words):
        opcode = word & 0x1FF
        target = None
        if opcode == BRANCH:
            offset = branch_offset(word)
            if offset % WORD_BYTES:
                raise ValueError(f"branch at {index} has an unaligned offset {offset}")
            target = index + 1 + offset // WORD_BYTES
        mnemonic = OPCODES.get(opcode, f"?{opcode:#05x}")
        predicate = (word >> 12) & 0xF
        instructions.append(
            Instruction(
                index, opcode, mnemonic, target, predicate != ALWAYS, predicate == NEVER
            )
        )
    return instructions


@dataclass(frozen=True)
class Loop:
    """The chunk loop: ``head`` (a branch target) to ``end`` (its backward branch).

    Attributes:
        head: The loop's first instruction.
        tail: The first instruction of the straight-line part that closes the loop.
        end: The backward branch.
    """

    head: int
    tail: int
    end: int


def chunk_loop(instructions: Sequence[Instruction]) -> Loop:
    """The backward branch whose body holds the most ``HMMA``, and its tail.

    Raises:
        ValueError: No loop holds an ``HMMA``.
    """
    best, most = None, 0
    for branch in instructions:
        if branch.target is None or branch.target > branch.index:
            continue
        body = instructions[branch.target : branch.index + 1]
        mma = sum(i.mnemonic == "HMMA" for i in body)
        if mma > most:
            best, most = branch, mma
    if best is None:
        raise ValueError("no loop holds an HMMA")
    head, end = best.target, best.index
    tail = head
    for other in instructions:
        if other.target is None or other.index == end:
            continue
        if head <= other.index < end:
            tail = max(tail, other.index + 1)
        if head < other.target <= end:
            tail = max(tail, other.target)
    for i in range(head, end):
        # A reconvergence point joins paths too.
        if instructions[i].mnemonic == "BSYNC":
            tail = max(tail, i + 1)
    return Loop(head, tail, end)


def hot_indices(instructions: Sequence[Instruction], loop: Loop) -> set[int]:
    """The head's instructions reachable from the loop's head without entering a
    basic block that calls a helper (the misaligned inputs' plain copies).

    The head's paths differ by alignment (those calls), by rows (x's copies) and by
    the ring's last chunks (no issue): every path but the calls' counts as hot.
    """
    leaders = {loop.head, loop.tail}
    for i in range(loop.head, loop.tail):
        instruction = instructions[i]
        if instruction.target is not None:
            leaders.update((i + 1, instruction.target))
    starts = sorted(j for j in leaders if loop.head <= j <= loop.tail)
    blocks = {a: range(a, b) for a, b in zip(starts, starts[1:])}
    hot, pending = set(), [loop.head]
    while pending:
        start = pending.pop()
        if start in hot or start not in blocks:
            continue
        block = blocks[start]
        if any(instructions[i].opcode == CALL for i in block):
            continue
        hot.add(start)
        last = instructions[block[-1]]
        if last.target is not None:
            pending.append(last.target)
        if last.target is None or last.conditional:
            pending.append(block.stop)
    return {i for start in hot for i in blocks[start]}


def census(instructions: Sequence[Instruction]) -> dict:
    """The chunk loop's counts: the tail exactly, the head statically.

    Returns:
        ``kernel`` (words in the kernel), ``loop`` (head, tail, end), ``tail`` and
        ``head`` (counts by mnemonic; the head's hot paths, :func:`hot_indices`),
        ``head_never`` (the head's ``@!PT`` instructions: issued, never executed),
        ``tail_kinds`` (the tail grouped as :data:`KINDS`, address work and other),
        ``mma`` (``HMMA`` in the tail) and their totals.
    """
    loop = chunk_loop(instructions)
    tail = Counter(i.mnemonic for i in instructions[loop.tail : loop.end + 1])
    hot = hot_indices(instructions, loop)
    head = Counter(instructions[i].mnemonic for i in sorted(hot))
    kinds: Counter = Counter()
    for mnemonic, count in tail.items():
        kinds[
            KINDS.get(mnemonic, "address" if mnemonic in ADDRESS else "other")
        ] += count
    return {
        "kernel": len(instructions),
        "loop": {"head": loop.head, "tail": loop.tail, "end": loop.end},
        "head_never": sum(instructions[i].never for i in hot),
        "tail_total": sum(tail.values()),
        "head_total": sum(head.values()),
        "head_cold": loop.tail - loop.head - len(hot),
        "mma": tail["HMMA"],
        "tail_kinds": dict(kinds.most_common()),
        "tail": dict(tail.most_common()),
        "head": dict(head.most_common()),
    }


@dataclass(frozen=True)
class Kernel:
    """A compiled form: its instructions and ptxas's resource report.

    Attributes:
        instructions: The decoded words.
        registers: Registers a thread.
        spilled: Bytes of spill stores and loads.
    """

    instructions: list[Instruction]
    registers: int
    spilled: int


def ptxas_report(log: str) -> dict[str, tuple[int, int]]:
    """Registers and spilled bytes (stores + loads) of each entry in ``-Xptxas -v``'s
    log, keyed by mangled name."""
    report: dict[str, tuple[int, int]] = {}
    entry, spilled = None, 0
    for line in log.splitlines():
        found = re.search(r"Compiling entry function '([^']+)'", line)
        if found:
            entry, spilled = found.group(1), 0
            continue
        found = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", line)
        if found and entry is not None:
            spilled = int(found.group(1)) + int(found.group(2))
        found = re.search(r"Used (\d+) registers", line)
        if found and entry is not None:
            report[entry] = (int(found.group(1)), spilled)
            entry = None
    return report


def compile_spec(spec, workdir: Path) -> Kernel:
    """Compile one spec's bfloat16 unit for ``sm_90`` (alone, as NVRTC compiles each
    of mlx's kernels: nvcc's code for a unit changes with the other units in its
    file) and decode it.
    """
    from tests.support.compilers import NVCC
    from tests.support.group_emulator import check_cuda

    if NVCC is None:
        raise RuntimeError("nvcc not found: the census compiles the kernels with it")
    # (-w: the SwiGLU forms' unused variables would stop nvcc's -Werror; NVRTC takes
    # them.)
    flags = ("-Xptxas", "-v", "-w")
    result = check_cuda([spec], workdir, NVCC, dtypes=[mx.bfloat16], flags=flags)
    if not result.ok:
        raise RuntimeError(f"nvcc failed: {result.log[-2000:]}")
    words = kernel_words((workdir / "group_bodies.cubin").read_bytes())
    report = ptxas_report(result.log)
    name = spec.name("cuda")
    matches = [mangled for mangled in words if name in mangled]
    if len(matches) != 1 or matches[0] not in report:
        raise RuntimeError(f"{len(matches)} kernels named {name} in the cubin")
    registers, spilled = report[matches[0]]
    return Kernel(decode(words[matches[0]]), registers, spilled)


def _forms() -> dict[str, Callable[[], object]]:
    from dflash.metal import tensor_qmm

    return {
        "q4-m1-g64": lambda: tensor_qmm.SCALED_SPECS[(2, (4, 1), 64)],
        "q4-m2-g64": lambda: tensor_qmm.SCALED_SPECS[(2, (4, 2), 64)],
        "q4-m1-g64-denormal": lambda: tensor_qmm.DENORMAL_SPECS[(2, (4, 1), 64)],
        "q4-m2-g64-denormal": lambda: tensor_qmm.DENORMAL_SPECS[(2, (4, 2), 64)],
        "q4-m1-g64-inplace": lambda: tensor_qmm.IN_PLACE_SPECS[(2, (4, 1), 64)],
        "q4-m2-g64-inplace": lambda: tensor_qmm.IN_PLACE_SPECS[(2, (4, 2), 64)],
        # The unscaled and folded forms with their group a constant (as the scaled
        # forms ship): their group closes are then straight-line code too.
        "q4-m1-g64-unscaled": lambda: tensor_qmm._spec(
            tensor_qmm.LAYOUTS[(4, 1)], k_groups=2, group_size=64
        ),
        "q4-m1-g64-folded": lambda: tensor_qmm._spec(
            tensor_qmm.LAYOUTS[(4, 1)], folded=True, k_groups=2, group_size=64
        ),
        "q4-m1-g64-swiglu": lambda: tensor_qmm.SWIGLU_SCALED_SPECS[(2, (4, 1), 64)],
        "q4-m2-g64-swiglu": lambda: tensor_qmm.SWIGLU_SCALED_SPECS[(2, (4, 2), 64)],
        # SwiGLU with the pairs in place (session 64): the gate / up's own decode.
        "q4-m1-g64-swiglu-inplace": lambda: tensor_qmm.SWIGLU_IN_PLACE_SPECS[
            (2, (4, 1), 64)
        ],
        "q4-m2-g64-swiglu-inplace": lambda: tensor_qmm.SWIGLU_IN_PLACE_SPECS[
            (2, (4, 2), 64)
        ],
        # The 8-bit scaled forms (session 70: what an 8-bit target would run).
        "q8-m1-g64": lambda: tensor_qmm.SCALED_SPECS[(2, (8, 1), 64)],
        "q8-m2-g64": lambda: tensor_qmm.SCALED_SPECS[(2, (8, 2), 64)],
        "dense-m1": lambda: tensor_qmm.FORM_SPECS[(False, 2)][(0, 1)],
        "dense-m2": lambda: tensor_qmm.FORM_SPECS[(False, 2)][(0, 2)],
        # The persistent forms (session 56) of the default 4-bit and dense ones.
        "q4-m1-g64-inplace-persist": lambda: tensor_qmm.persistent_spec(
            tensor_qmm.IN_PLACE_SPECS[(2, (4, 1), 64)]
        ),
        "q4-m2-g64-inplace-persist": lambda: tensor_qmm.persistent_spec(
            tensor_qmm.IN_PLACE_SPECS[(2, (4, 2), 64)]
        ),
        "dense-m1-persist": lambda: tensor_qmm.persistent_spec(
            tensor_qmm.FORM_SPECS[(False, 2)][(0, 1)]
        ),
    }


DEFAULT_FORMS = (
    "q4-m1-g64",
    "q4-m2-g64",
    "q4-m1-g64-denormal",
    "q4-m2-g64-denormal",
    "q4-m1-g64-inplace",
    "q4-m2-g64-inplace",
    "q4-m1-g64-unscaled",
    "q4-m1-g64-folded",
    "q4-m1-g64-swiglu",
    "q4-m2-g64-swiglu",
    "q4-m1-g64-swiglu-inplace",
    "q4-m2-g64-swiglu-inplace",
    "dense-m1",
    "dense-m2",
)


def run(variants: Sequence[str], forms: Sequence[str]) -> list[dict]:
    """The census of every form under every variant (one nvcc run a form)."""
    from benchmarks.matmul_variants import VARIANTS, variant

    makers = _forms()
    unknown = [f for f in forms if f not in makers] + [
        v for v in variants if v not in VARIANTS
    ]
    if unknown:
        raise ValueError(f"unknown form or variant: {', '.join(unknown)}")
    rows = []
    for name in variants:
        with variant(**VARIANTS[name]), tempfile.TemporaryDirectory() as tmp:
            specs = [makers[form]() for form in forms]
            kernels = [
                compile_spec(spec, Path(tmp) / form) for form, spec in zip(forms, specs)
            ]
        for form, kernel in zip(forms, kernels):
            counts = census(kernel.instructions)
            rows.append(
                {
                    "variant": name,
                    "form": form,
                    "registers": kernel.registers,
                    "spilled": kernel.spilled,
                    **counts,
                }
            )
    return rows


def _table(rows: Sequence[dict]) -> str:
    lines = [
        f"{'form':<20} {'variant':<14} {'tail':>5} {'head':>5} {'mma':>4} "
        f"{'arith':>5} {'perm':>5} {'lds':>4} {'addr':>5} {'other':>5} {'regs':>4} "
        f"{'spill':>5} {'!PT':>4}"
    ]
    for row in rows:
        kinds = row["tail_kinds"]
        lines.append(
            f"{row['form']:<20} {row['variant']:<14} {row['tail_total']:>5} "
            f"{row['head_total']:>5} {row['mma']:>4} {kinds.get('arithmetic', 0):>5} "
            f"{kinds.get('permute', 0):>5} {kinds.get('shared load', 0):>4} "
            f"{kinds.get('address', 0):>5} {kinds.get('other', 0):>5} "
            f"{row['registers']:>4} {row['spilled']:>5} {row['head_never']:>4}"
        )
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Command line: print the table, optionally write the JSON."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--variants", default="current")
    parser.add_argument("--forms", default=",".join(DEFAULT_FORMS))
    parser.add_argument("--json", help="write the rows here")
    args = parser.parse_args(argv)
    try:
        rows = run(args.variants.split(","), args.forms.split(","))
    except (ValueError, RuntimeError) as error:
        print(f"sass_census: {error}", file=sys.stderr)
        return 2
    print(_table(rows))
    if args.json:
        record = {
            "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "command": "python -m benchmarks.sass_census " + " ".join(sys.argv[1:]),
            "machine": f"{platform.node()} ({platform.machine()}), no GPU: nvcc",
            "rows": rows,
        }
        Path(args.json).write_text(json.dumps(record, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
