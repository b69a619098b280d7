"""Reference forms of the dflash.metal operations against plain numpy.

Runs on any mlx (CPU included): the pure-MLX references are the oracle the
kernels are proven against, so they are themselves proven here, bit for bit,
over random geometries, dtypes, wrap positions and both layouts.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from support.kernel_cases import (
    OPS,
    Case,
    bits,
    case_strategy,
    check_case,
    check_round_trip,
    to_mx,
)
from support.validated import (
    checked_ring_write,
    checked_stage_shadow,
    checked_stage_shadow_kv,
)

from dflash.metal import kernel_backend, restore_rows, retain_rows, wrapped_rows

EXAMPLES = 60


@pytest.mark.parametrize("op", OPS)
def test_reference_matches_numpy(op: str) -> None:
    @settings(max_examples=EXAMPLES, deadline=None)
    @given(case_strategy(op))
    def check(case: Case) -> None:
        assert check_case(case, "reference") is None, case

    check()


@settings(max_examples=EXAMPLES, deadline=None)
@given(case_strategy("restore_rows"), st.data())
def test_reference_checkpoint_round_trip(case: Case, data: st.DataObject) -> None:
    case = Case(**{**case.__dict__, "scattered": False})
    accepted = data.draw(st.integers(0, case.count))
    assert check_round_trip(case, accepted, use_kernel=False) is None


def test_wrapped_rows() -> None:
    assert wrapped_rows(6, 4, 8).tolist() == [6, 7, 0, 1]
    assert wrapped_rows(0, 3, 3).tolist() == [0, 1, 2]
    assert wrapped_rows(5, 0, 8).dtype == np.int32


def test_block_store_equals_single_row_stores() -> None:
    rng = np.random.default_rng(3)
    buffer = mx.array(rng.standard_normal((1, 2, 5, 3)).astype(np.float16))
    rows = mx.array(rng.standard_normal((1, 2, 4, 3)).astype(np.float16))
    block = checked_ring_write(buffer, rows, 3, use_kernel=False)
    single = buffer
    for i in range(4):
        single = checked_ring_write(
            single, rows[:, :, i : i + 1], (3 + i) % 5, use_kernel=False
        )
    assert np.array_equal(bits(block), bits(single))


def test_store_leaves_input_untouched() -> None:
    buffer = mx.zeros((1, 1, 4, 2), dtype=mx.bfloat16)
    mx.eval(buffer)
    out = checked_ring_write(buffer, mx.ones((1, 1, 2, 2), dtype=mx.bfloat16), 3)
    mx.eval(out)
    assert not np.asarray(buffer.astype(mx.float32)).any()
    assert np.asarray(out.astype(mx.float32))[0, 0, [3, 0]].all()


def test_zero_row_blocks() -> None:
    buffer = mx.ones((1, 2, 4, 3))
    assert checked_ring_write(buffer, mx.zeros((1, 2, 0, 3)), 1) is buffer
    shadow = checked_stage_shadow(buffer, mx.zeros((1, 2, 0, 3)), 2, 3)
    assert shadow.shape == (1, 2, 3, 3)
    empty = checked_stage_shadow(buffer, mx.zeros((1, 2, 0, 3)), 0, 0)
    assert empty.shape == (1, 2, 0, 3)
    kv = mx.stack([buffer, buffer])
    none = mx.zeros((1, 2, 0, 3))
    shadow, block = checked_stage_shadow_kv(kv, none, none, 2, 3)
    assert shadow.shape == (2, 1, 2, 3, 3) and block.shape == (2, 1, 2, 0, 3)
    empty = mx.zeros((2, 0), dtype=mx.int32)
    assert retain_rows([buffer, buffer], empty).shape == (2, 1, 2, 0, 3)
    restored = restore_rows([buffer, buffer], empty, mx.zeros((2, 1, 2, 0, 3)))
    assert restored[0] is buffer and len(restored) == 2


def test_auto_dispatch_without_gpu_uses_reference() -> None:
    if kernel_backend() is not None:
        pytest.skip("a GPU backend is present")
    buffer = to_mx(np.arange(16, dtype=np.uint16).reshape(1, 1, 8, 2), "float16")
    rows = to_mx(np.full((1, 1, 3, 2), 7, dtype=np.uint16), "float16")
    auto = checked_ring_write(buffer, rows, 6)
    ref = checked_ring_write(buffer, rows, 6, use_kernel=False)
    assert np.array_equal(bits(auto), bits(ref))
    with pytest.raises(RuntimeError, match="use_kernel=True"):
        checked_ring_write(buffer, rows, 6, use_kernel=True)


# ---------------------------------------------------------------- validation

BUF = mx.zeros((1, 2, 8, 4), dtype=mx.float16)
ROWS = mx.zeros((1, 2, 3, 4), dtype=mx.float16)
DESTS = mx.array(np.array([[1, 2], [3, 4]], dtype=np.int32))
BLOCK = mx.zeros((2, 1, 2, 2, 4), dtype=mx.float16)
KV = mx.zeros((2, 1, 2, 8, 4), dtype=mx.float16)


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda: checked_ring_write(BUF, ROWS, 8), r"dest_start=8 outside \[0, 8\)"),
        (lambda: checked_ring_write(BUF, ROWS, -1), "dest_start=-1"),
        (lambda: checked_ring_write(BUF, ROWS, 1.0), "dest_start must be an int"),
        (lambda: checked_ring_write(BUF, mx.zeros((1, 2, 9, 4), mx.float16), 0), "S=9"),
        (lambda: checked_ring_write(BUF, ROWS.astype(mx.float32), 0), "dtype"),
        (
            lambda: checked_ring_write(BUF, mx.zeros((1, 3, 3, 4), mx.float16), 0),
            "shape",
        ),
        (lambda: checked_ring_write(BUF, ROWS, 0, head_major=False), "shape"),
        (
            lambda: checked_ring_write(BUF.astype(mx.int32), ROWS, 0),
            "float16, bfloat16",
        ),
        (lambda: checked_ring_write(mx.zeros((8, 4)), ROWS, 0), "at least 4 dims"),
        (lambda: checked_ring_write(np.zeros((1, 2, 8, 4)), ROWS, 0), "mx.array"),
        (lambda: checked_stage_shadow(BUF, ROWS, 0, 9), r"length=9 outside \[0, 8\]"),
        (lambda: checked_stage_shadow(BUF, ROWS, 8, 2), "origin_physical=8"),
        (lambda: checked_stage_shadow(BUF, ROWS, 0, True), "length must be an int"),
        (lambda: checked_stage_shadow_kv(BUF, ROWS, ROWS, 0, 2), "leading axis of 2"),
        (
            lambda: checked_stage_shadow_kv(BLOCK[:1], ROWS, ROWS, 0, 2),
            "leading axis of 2",
        ),
        (lambda: checked_stage_shadow_kv(KV, ROWS, ROWS[:, :, :2], 0, 2), "differ"),
        (
            lambda: checked_stage_shadow_kv(KV, ROWS, ROWS.astype(mx.float32), 0, 2),
            "dtype",
        ),
        (lambda: checked_stage_shadow_kv(KV, ROWS[:, :1], ROWS[:, :1], 0, 2), "shape"),
        (lambda: checked_stage_shadow_kv(KV, ROWS, ROWS, 8, 2), "origin_physical=8"),
        (lambda: checked_stage_shadow_kv(KV, ROWS, ROWS, 0, 9), r"length=9 outside"),
        (lambda: retain_rows([], DESTS), "non-empty sequence"),
        (lambda: retain_rows(BUF, DESTS), "non-empty sequence"),
        (lambda: retain_rows([BUF, BUF[:, :1]], DESTS), r"buffers\[1\]"),
        (lambda: retain_rows([BUF, BUF.astype(mx.float32)], DESTS), "must match"),
        (lambda: retain_rows([BUF], DESTS), r"shape \(P=1, n\)"),
        (lambda: retain_rows([BUF, BUF], DESTS.astype(mx.int64)), "int32"),
        (lambda: retain_rows([BUF, BUF], DESTS + 5), r"outside \[0, 8\)"),
        (lambda: retain_rows([BUF, BUF], DESTS - 2), "min -1"),
        (lambda: retain_rows([BUF, BUF], DESTS * 0), "repeats a row"),
        (lambda: restore_rows([BUF, BUF], DESTS, BLOCK[:1]), "rows must be"),
        (
            lambda: restore_rows([BUF, BUF], DESTS, BLOCK.astype(mx.float32)),
            "rows must be",
        ),
        (
            lambda: restore_rows([BUF, BUF], DESTS, np.zeros((2, 1, 2, 2, 4))),
            "mx.array",
        ),
        (lambda: restore_rows([BUF, BUF], DESTS + 7, BLOCK), "outside"),
    ],
)
def test_invalid_arguments_raise(call, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        call()


def test_token_major_shapes() -> None:
    buffer = mx.zeros((2, 8, 3, 4), dtype=mx.bfloat16)
    rows = mx.ones((2, 5, 3, 4), dtype=mx.bfloat16)
    assert checked_ring_write(buffer, rows, 6, head_major=False).shape == (2, 8, 3, 4)
    assert checked_stage_shadow(buffer, rows, 6, 8, head_major=False).shape == (
        2,
        13,
        3,
        4,
    )
    kv = mx.stack([buffer, buffer])
    shadow, block = checked_stage_shadow_kv(kv, rows, rows, 6, 8, head_major=False)
    assert shadow.shape == (2, 2, 13, 3, 4) and block.shape == (2, 2, 5, 3, 4)
    dests = mx.array(np.array([[0, 7], [3, 1], [2, 5]], dtype=np.int32))
    block = retain_rows([buffer] * 3, dests, head_major=False)
    assert block.shape == (3, 2, 2, 3, 4)
    assert len(restore_rows([buffer] * 3, dests, block, head_major=False)) == 3
