"""Bit-exactness cases of every kernel operation, shared by the tests and the selfcheck.

A :class:`Case` names one operation at one geometry; its inputs are random bit
patterns drawn from the case's seed, so every form sees the same inputs.
:func:`check_case` compares two forms bit for bit:

* ``"reference"``: the pure-MLX reference against plain numpy indexing;
* ``"kernel"``: the custom kernel (Metal, CUDA, or the CPU-emulated Metal body)
  against the pure-MLX reference.

Each case runs through the argument-checking wrappers of :mod:`.validated`, which
call the library's entries (:func:`dflash.metal.ring_write`,
:class:`dflash.metal.ShadowStager`, :func:`dflash.metal.retain_rows`,
:func:`dflash.metal.restore_rows`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import mlx.core as mx
import numpy as np

from dflash.metal import restore_rows, retain_rows

from .validated import (
    checked_ring_write,
    checked_stage_shadow,
    checked_stage_shadow_kv,
)

OPS: tuple[str, ...] = (
    "ring_write",
    "stage_shadow",
    "stage_shadow_kv",
    "retain_rows",
    "restore_rows",
)
# Ops whose buffer stacks K and V on a leading axis of 2 (their rows too).
STACKED_OPS: tuple[str, ...] = ("stage_shadow_kv",)
# Ops whose chunk may be empty while rows are live.
SHADOW_OPS: tuple[str, ...] = ("stage_shadow", "stage_shadow_kv")
DTYPES: dict[str, mx.Dtype] = {
    "float16": mx.float16,
    "bfloat16": mx.bfloat16,
    "float32": mx.float32,
}
# Bit-level view of each dtype, and its exponent mask (all-ones = inf/nan).
_BITS = {
    "float16": (mx.uint16, np.uint16, 0x7C00),
    "bfloat16": (mx.uint16, np.uint16, 0x7F80),
    "float32": (mx.uint32, np.uint32, 0x7F800000),
}


@dataclass(frozen=True)
class Case:
    """One operation at one geometry.

    Attributes:
        op: One of :data:`OPS`.
        dtype: Key of :data:`DTYPES`.
        head_major: Layout.
        batch: ``B``.
        heads: ``H``.
        capacity: ``C``.
        dim: ``D``.
        count: ``S`` (store/shadow) or ``n`` (retain/restore).
        start: ``dest_start`` (store) or ``origin_physical`` (shadows); first
            destination of plane 0 (retain/restore).
        length: Live rows (shadows only).
        planes: ``P`` (retain/restore only).
        scattered: Retain/restore destinations drawn at random instead of a
            wrapped run.
        seed: Seed of the input bits.
    """

    op: str
    dtype: str
    head_major: bool
    batch: int
    heads: int
    capacity: int
    dim: int
    count: int
    start: int
    length: int = 0
    planes: int = 1
    scattered: bool = False
    seed: int = 0

    def shape(self, rows: int) -> tuple[int, ...]:
        """Buffer-layout shape with ``rows`` rows."""
        if self.head_major:
            return (self.batch, self.heads, rows, self.dim)
        return (self.batch, rows, self.heads, self.dim)

    @property
    def row_axis(self) -> int:
        """Row axis of a 4-d buffer."""
        return 2 if self.head_major else 1


def random_bits(
    shape: Sequence[int], dtype: str, rng: np.random.Generator
) -> np.ndarray:
    """Random finite bit patterns (signed zeros and subnormals included)."""
    _, np_bits, exponent = _BITS[dtype]
    info = np.iinfo(np_bits)
    raw = rng.integers(0, int(info.max) + 1, size=tuple(shape), dtype=np.uint64)
    raw = raw.astype(np_bits)
    top = np_bits(exponent & ~(exponent >> 1))
    special = (raw & np_bits(exponent)) == np_bits(exponent)
    return np.where(special, raw & ~top, raw).astype(np_bits)


def to_mx(host_bits: np.ndarray, dtype: str) -> mx.array:
    """numpy bit patterns to an mx.array of ``dtype``."""
    return mx.array(host_bits).view(DTYPES[dtype])


def bits(x: mx.array) -> np.ndarray:
    """Bit patterns of a float16/bfloat16/float32 mx.array, as numpy."""
    word = mx.uint32 if x.dtype == mx.float32 else mx.uint16
    return np.asarray(x.view(word))


def case_dests(case: Case) -> np.ndarray:
    """``(P, n)`` destinations of a retain/restore case, distinct per plane."""
    rng = np.random.default_rng(case.seed + 1)
    rows = []
    for plane in range(case.planes):
        if case.scattered:
            rows.append(rng.permutation(case.capacity)[: case.count])
        else:
            first = (case.start + plane) % case.capacity
            rows.append((first + np.arange(case.count)) % case.capacity)
    return np.array(rows, dtype=np.int32).reshape(case.planes, case.count)


@dataclass(frozen=True)
class CaseInputs:
    """Host bit patterns of one case's inputs."""

    buffers: list[np.ndarray]
    rows: np.ndarray
    dests: np.ndarray


def case_inputs(case: Case) -> CaseInputs:
    """Deterministic inputs of ``case``."""
    rng = np.random.default_rng(case.seed)
    planes = case.planes if case.op in ("retain_rows", "restore_rows") else 1
    lead = (2,) if case.op in STACKED_OPS else ()
    buffers = [
        random_bits(lead + case.shape(case.capacity), case.dtype, rng)
        for _ in range(planes)
    ]
    if case.op == "restore_rows":
        rows = random_bits((planes,) + case.shape(case.count), case.dtype, rng)
    else:
        rows = random_bits(lead + case.shape(case.count), case.dtype, rng)
    return CaseInputs(buffers, rows, case_dests(case))


def _take(x: np.ndarray, index: np.ndarray, axis: int) -> np.ndarray:
    return np.take(x, index, axis=axis)


def _put(x: np.ndarray, index: np.ndarray, values: np.ndarray, axis: int) -> np.ndarray:
    out = x.copy()
    where = [slice(None)] * x.ndim
    where[axis] = index
    out[tuple(where)] = values
    return out


def numpy_expected(case: Case) -> list[np.ndarray]:
    """The case's result computed with plain numpy indexing on bit patterns."""
    data = case_inputs(case)
    axis = case.row_axis
    cap = case.capacity
    if case.op == "ring_write":
        index = (case.start + np.arange(case.count)) % cap
        return [_put(data.buffers[0], index, data.rows, axis)]
    if case.op == "stage_shadow":
        index = (case.start + np.arange(case.length)) % cap
        live = _take(data.buffers[0], index, axis)
        return [np.concatenate([live, data.rows], axis=axis)]
    if case.op == "stage_shadow_kv":
        index = (case.start + np.arange(case.length)) % cap
        live = _take(data.buffers[0], index, axis + 1)
        return [np.concatenate([live, data.rows], axis=axis + 1), data.rows]
    if case.op == "retain_rows":
        return [np.stack([_take(b, d, axis) for b, d in zip(data.buffers, data.dests)])]
    return [_put(b, d, r, axis) for b, d, r in zip(data.buffers, data.dests, data.rows)]


def run_case(case: Case, use_kernel: Optional[bool]) -> list[mx.array]:
    """Run the case's public wrapper with ``use_kernel``."""
    data = case_inputs(case)
    buffers = [to_mx(b, case.dtype) for b in data.buffers]
    rows = to_mx(data.rows, case.dtype)
    dests = mx.array(data.dests)
    flags = dict(head_major=case.head_major, use_kernel=use_kernel)
    if case.op == "ring_write":
        return [checked_ring_write(buffers[0], rows, case.start, **flags)]
    if case.op == "stage_shadow":
        shadow = checked_stage_shadow(
            buffers[0], rows, case.start, case.length, **flags
        )
        return [shadow]
    if case.op == "stage_shadow_kv":
        keys, values = rows[0], rows[1]
        pair = checked_stage_shadow_kv(
            buffers[0], keys, values, case.start, case.length, **flags
        )
        return list(pair)
    if case.op == "retain_rows":
        return [retain_rows(buffers, dests, **flags)]
    return restore_rows(buffers, dests, rows, **flags)


def _compare(got: Sequence[np.ndarray], want: Sequence[np.ndarray]) -> Optional[str]:
    if len(got) != len(want):
        return f"{len(got)} outputs, expected {len(want)}"
    for i, (g, w) in enumerate(zip(got, want)):
        if g.shape != w.shape:
            return f"output {i}: shape {g.shape}, expected {w.shape}"
        if not np.array_equal(g, w):
            bad = int(np.count_nonzero(g != w))
            return f"output {i}: {bad} of {w.size} elements differ"
    return None


def check_case(case: Case, form: str) -> Optional[str]:
    """Compare one form of ``case`` bit for bit; None when identical.

    Args:
        case: The case.
        form: ``"reference"`` (reference vs numpy) or ``"kernel"`` (kernel vs
            reference).

    Returns:
        None if the outputs are bit-identical, else a description.
    """
    reference = [bits(x) for x in run_case(case, use_kernel=False)]
    if form == "reference":
        return _compare(reference, numpy_expected(case))
    kernel = [bits(x) for x in run_case(case, use_kernel=True)]
    return _compare(kernel, reference)


def check_round_trip(
    case: Case, accepted: int, use_kernel: Optional[bool]
) -> Optional[str]:
    """Checkpoint oracle at buffer level, bit for bit.

    Retain the rows a block of ``case.count`` rows will overwrite in every
    plane (plane ``p`` writes at ``(case.start + p) % C`` onward), store the
    block, then put back all but the first ``accepted`` rows. Every plane must
    equal the original with only those ``accepted`` rows stored.

    Args:
        case: Geometry (its ``op`` is ignored; ``scattered`` must be False).
        accepted: Rows kept, ``0 <= accepted <= case.count``.
        use_kernel: Form of all four operations.

    Returns:
        None when every plane matches, else a description.
    """
    data = case_inputs(case)
    rng = np.random.default_rng(case.seed + 2)
    block = random_bits((case.planes,) + case.shape(case.count), case.dtype, rng)
    axis = case.row_axis
    flags = dict(head_major=case.head_major, use_kernel=use_kernel)
    planes = [to_mx(b, case.dtype) for b in data.buffers]
    dests = mx.array(data.dests)
    retained = retain_rows(planes, dests, **flags)
    starts = [int(d[0]) for d in data.dests]
    written = [
        checked_ring_write(p, to_mx(block[i], case.dtype), starts[i], **flags)
        for i, p in enumerate(planes)
    ]
    keep = [slice(None)] * retained.ndim
    keep[axis + 1] = slice(accepted, None)
    restored = restore_rows(
        written, dests[:, accepted:], retained[tuple(keep)], **flags
    )
    want = []
    for i, original in enumerate(data.buffers):
        head = [slice(None)] * block[i].ndim
        head[axis] = slice(0, accepted)
        want.append(
            _put(original, data.dests[i][:accepted], block[i][tuple(head)], axis)
        )
    return _compare([bits(x) for x in restored], want)


def case_strategy(op: str, max_capacity: int = 64, max_planes: int = 5):
    """Hypothesis strategy of valid cases of ``op`` (for the tests).

    Geometries: C 1..max_capacity, S (or n) 1..C (a shadow chunk may be 0
    when rows are live), B 1..2, H 1..3, D 1..8, P 1..max_planes; every dtype,
    both layouts, every wrap position.
    """
    from hypothesis import strategies as st

    @st.composite
    def build(draw) -> Case:
        capacity = draw(st.integers(1, max_capacity))
        length = draw(st.integers(0, capacity))
        low = 0 if (op in SHADOW_OPS and length) else 1
        return Case(
            op=op,
            dtype=draw(st.sampled_from(list(DTYPES))),
            head_major=draw(st.booleans()),
            batch=draw(st.integers(1, 2)),
            heads=draw(st.integers(1, 3)),
            capacity=capacity,
            dim=draw(st.integers(1, 8)),
            count=draw(st.integers(low, capacity)),
            start=draw(st.integers(0, capacity - 1)),
            length=length,
            planes=draw(st.integers(1, max_planes)),
            scattered=draw(st.booleans()),
            seed=draw(st.integers(0, 2**31 - 1)),
        )

    return build()


def glimmer_cases() -> list[Case]:
    """Full-size Muse Glimmer ring geometry: 2 KV heads x 128, C 2048, P 78."""
    common = dict(dtype="bfloat16", batch=1, heads=2, capacity=2048, dim=128)
    return [
        Case("ring_write", head_major=True, count=16, start=2040, **common),
        Case(
            "stage_shadow", head_major=True, count=16, start=1000, length=2048, **common
        ),
        Case(
            "stage_shadow_kv",
            head_major=True,
            count=16,
            start=2040,
            length=2048,
            **common,
        ),
        Case("retain_rows", head_major=True, count=16, start=2040, planes=78, **common),
        Case(
            "restore_rows", head_major=False, count=9, start=2045, planes=78, **common
        ),
    ]
