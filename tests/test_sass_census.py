"""The SASS census (``benchmarks.sass_census``): its decoding checked against session
48's Nsight Compute listing of the shipped 4-bit form (committed under ``docs/``),
its loop analysis on hand-made code, and what it says of the paired stage."""

from __future__ import annotations

import csv
import gzip
from collections import Counter
from pathlib import Path

import pytest
from support.compilers import needs_nvcc

from benchmarks import matmul_variants, sass_census
from benchmarks.sass_census import Instruction, census, decode, hot_indices
from dflash.metal import tensor_qmm

LISTING = (
    Path(__file__).resolve().parent.parent
    / "docs/benchmarks/h200-2026-12-05-s48/D2/ncu-6656-39936-1-sass.csv.gz"
)
# The listed kernel's name: the scaled 4-bit form (one row tile, group 64, two K
# groups) with the merge before the vector one, as it ran in session 48.
LISTED = "dflash_tensor_q4_m1_scaled_g64_k2_af7b6a1125"
# Mnemonics whose counts the two compilers (nvcc here, the H200's NVRTC) agree on;
# the address arithmetic around them differs by a few instructions.
STABLE = (
    "HMMA", "HFMA2", "LOP3", "SHF", "LDS", "LDGSTS", "LDG", "STG", "BAR",
    "BRA", "BSSY", "BSYNC", "CALL", "ISETP", "F2FP", "EXIT",
)  # fmt: skip


def _listing() -> tuple[list[Instruction], list[int]]:
    """The listing as instructions (targets from the printed addresses) and each
    instruction's executed count."""
    with gzip.open(LISTING, "rt") as f:
        rows = list(csv.reader(f))[2:]
    first = int(rows[0][0], 16)
    instructions, executed = [], []
    for index, row in enumerate(rows):
        words = row[1].split()
        conditional = words[0].startswith("@")
        words = words[1:] if conditional else words
        mnemonic = words[0].split(".")[0]
        target = None
        if mnemonic == "BRA":
            target = (int(words[-1], 16) - first) // sass_census.WORD_BYTES
        opcode = sass_census.CALL if mnemonic == "CALL" else 0
        instructions.append(Instruction(index, opcode, mnemonic, target, conditional))
        executed.append(int(row[5]))
    return instructions, executed


def _listed_form():
    """The spec that ran in the listing (the merge before the vector one, the scales
    as mlx lays them out)."""
    with matmul_variants.variant(**matmul_variants.VARIANTS["rowmajor"]):
        tensor_qmm._BODY = tensor_qmm.merge_body(False)
        matmul_variants._rebuild()
        spec = tensor_qmm.SCALED_SPECS[(2, (4, 1), 64)]
    return spec


def test_branch_offsets_decode_to_the_listed_targets() -> None:
    """Words nvcc wrote here for the listed kernel's backward branches, and the byte
    offsets the device's listing printed for the same branches (its absolute targets
    less the next instruction's address)."""
    words = {
        0x000FEA000383FFFFFFFFFFF800943947: -1456,
        0x000FF0000383FFFFFFFFFFFC009C2947: -400,
        0x000FEC000383FFFFFFFFFFFC00D42947: -176,
        0x000FEC00038000000000000C001C8947: 3184,
    }
    for word, offset in words.items():
        assert sass_census.branch_offset(word) == offset
    (branch,) = decode([word for word in words if words[word] == 3184])
    assert branch.mnemonic == "BRA" and branch.conditional
    assert branch.target == 1 + 3184 // 16


def test_kernel_words_refuse_what_is_not_a_cubin() -> None:
    """A file that is not a little-endian ELF64 is refused by name."""
    with pytest.raises(ValueError, match="not a little-endian ELF64 cubin"):
        sass_census.kernel_words(b"\x7fELF\x01\x01" + bytes(64))
    with pytest.raises(ValueError, match="not a little-endian ELF64 cubin"):
        sass_census.kernel_words(b"PK\x03\x04" + bytes(64))


def _instr(index, mnemonic, target=None, conditional=False) -> Instruction:
    opcode = sass_census.CALL if mnemonic == "CALL" else 0
    return Instruction(index, opcode, mnemonic, target, conditional)


def test_hot_paths_leave_out_only_the_blocks_that_call() -> None:
    """A head with a fast path and a calling slow path that rejoin: the slow block is
    left out, the fast one kept; the tail runs from the join and is counted whole.
    Negative control: with the call removed the slow block counts as hot."""
    code = [
        _instr(0, "NOP"),  # loop head
        _instr(1, "BRA", target=4, conditional=True),  # misaligned: to the slow path
        _instr(2, "LDGSTS"),  # fast path
        _instr(3, "BRA", target=6),
        _instr(4, "CALL"),  # slow path
        _instr(5, "MOV"),
        _instr(6, "BAR"),  # the join, then the chunk's arithmetic
        _instr(7, "HMMA"),
        _instr(8, "HMMA"),
        _instr(9, "BRA", target=0, conditional=True),  # the loop's branch
    ]
    counts = census(code)
    assert counts["loop"] == {"head": 0, "tail": 6, "end": 9}
    assert counts["tail"] == {"BAR": 1, "HMMA": 2, "BRA": 1}
    assert counts["head"] == {"NOP": 1, "BRA": 2, "LDGSTS": 1}
    assert counts["head_cold"] == 2
    plain = [_instr(4, "NOP") if i.index == 4 else i for i in code]
    loop = sass_census.chunk_loop(plain)
    assert hot_indices(plain, loop) == set(range(6))


@needs_nvcc
def test_census_of_the_listed_form_agrees_with_the_device_listing(tmp_path) -> None:
    """nvcc here and the H200's NVRTC give the listed form the same instructions that
    matter: equal counts of every :data:`STABLE` mnemonic over the kernel, and the
    chunk loop's straight-line tail with the same arithmetic, permutes and shared
    loads. On the device, every instruction of that tail ran exactly as often as the
    loop's head: the tail's count is a chunk's."""
    spec = _listed_form()
    assert spec.name("cuda") == LISTED
    kernel = sass_census.compile_spec(spec, tmp_path)
    assert kernel.spilled == 0
    listed, executed = _listing()
    ours = Counter(i.mnemonic.split(".")[0] for i in kernel.instructions)
    theirs = Counter(i.mnemonic for i in listed)
    assert {m: ours[m] for m in STABLE} == {m: theirs[m] for m in STABLE}
    assert not [i for i in kernel.instructions if i.mnemonic.startswith("?")]
    # ptxas's three never-executed `@!PT LDS RZ, [RZ]` before each LDGSTS, both sides.
    with gzip.open(LISTING, "rt") as f:
        listed_never = sum("@!PT" in row[1] for row in list(csv.reader(f))[2:])
    assert sum(i.never for i in kernel.instructions) == listed_never == 86

    mine, device = census(kernel.instructions), census(listed)
    assert mine["head_never"] == 3 * mine["head"]["LDGSTS"]
    kinds = ("HMMA", "HFMA2", "LOP3", "SHF", "PRMT", "LDS")
    assert {k: mine["tail"][k] for k in kinds} == {k: device["tail"][k] for k in kinds}
    assert mine["mma"] == 32  # 2 sub-chunks x 4 column tiles x 2 halves x 2 K groups
    loop = device["loop"]
    head_runs = executed[loop["head"]]
    assert head_runs > 0
    assert set(executed[loop["tail"] : loop["end"] + 1]) == {head_runs}


@needs_nvcc
def test_paired_stage_takes_the_permutes_out_of_the_chunk_tail(tmp_path) -> None:
    """The paired stage (x interleaved as the mma's operands, scales paired) leaves
    the 4-bit forms' chunk tails with no permutes and no more register moves than the
    shipped form's, so fewer instructions a chunk; no spills. Its first version read
    x's rows as two separate pieces and paid ~105 moves a chunk for the mma's operand
    order: the moves are what this guards."""
    forms = {
        "q4-m1-g64": (2, (4, 1), 64),
        "q4-m2-g64": (2, (4, 2), 64),
    }
    tails = {}
    for name in ("current", "paired"):
        with matmul_variants.variant(**matmul_variants.VARIANTS[name]):
            specs = {form: tensor_qmm.SCALED_SPECS[key] for form, key in forms.items()}
        for form, spec in specs.items():
            kernel = sass_census.compile_spec(spec, tmp_path / name / form)
            assert kernel.spilled == 0
            tails[name, form] = census(kernel.instructions)
    for form in forms:
        shipped, paired = tails["current", form], tails["paired", form]
        assert shipped["tail"].get("PRMT", 0) > 0
        assert paired["tail"].get("PRMT", 0) == 0
        assert paired["tail_kinds"]["address"] <= shipped["tail_kinds"]["address"]
        assert paired["tail_total"] < shipped["tail_total"] - 40
        assert paired["mma"] == shipped["mma"]
