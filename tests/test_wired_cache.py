"""The kernels wired into the cache: held-back staged blocks, batched retain, no host sync.

* **Oracle** (hypothesis): several rings (two windows) and a growing plane, written through
  ``update_and_fetch`` as mlx-lm models do, in one chunk, two chunks or token by token, at
  every dtype and rotation: ``begin -> block -> commit(n)`` leaves every plane bit for bit as
  appending only the first ``n`` rows, and attention saw exactly what it sees without a
  checkpoint. Run with the pure-MLX references and with the Metal kernel bodies compiled by
  g++ and run on the CPU (the same index arithmetic the GPU runs).
* ``ring_write`` (the in-place store: one launch, never split at the seam) against numpy.
* Launches per round, counted on the lazy graph: a staged round's checkpoint adds none.
* ``begin`` / a staged round / ``commit`` never call ``mx.eval``.
* ``use_kernel=`` and ``DFLASH_KERNELS=0`` reach the wired kernels.
"""

import os
import subprocess
import sys
from typing import Iterator, List, Optional

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from support.compile_check import check_specs, find_compiler
from support.kernel_cases import DTYPES, bits, random_bits, to_mx
from support.launches import graph_launches
from support.metal_emulator import MetalEmulator

from dflash.cache import GrowingKVCache, KvPlane, RingKVCache, SpeculativeCheckpoint
from dflash.cache.plane import ring_indices, take_rows
from dflash.metal import backend, first_use, ring_write

WINDOWS = (5, 11)  # two ring geometries in one cache
HEADS, DIM = 2, 4

# --------------------------------------------------------------------- helpers


def make_cache(use_kernel: Optional[bool]) -> List[KvPlane]:
    """Rings of two windows and a growing plane, like a hybrid model's layers."""
    return [
        RingKVCache(WINDOWS[0], layer=0, use_kernel=use_kernel),
        RingKVCache(WINDOWS[1], layer=1, use_kernel=use_kernel),
        GrowingKVCache(layer=2, use_kernel=use_kernel),
        RingKVCache(WINDOWS[0], layer=3, use_kernel=use_kernel),
    ]


def random_rows(rng: np.random.Generator, count: int, dtype: str) -> mx.array:
    """``(1, H, count, D)`` rows of random finite bit patterns, as a transposed view."""
    host = random_bits((1, count, HEADS, DIM), dtype, rng)
    return to_mx(host, dtype).transpose(0, 2, 1, 3)


def chunk_rows(rows: mx.array, cuts: List[int]) -> List[mx.array]:
    """Split ``(B, H, S, D)`` rows at the block-relative positions ``cuts``."""
    edges = [0] + cuts + [rows.shape[2]]
    return [rows[:, :, lo:hi] for lo, hi in zip(edges, edges[1:]) if hi > lo]


def live_bits(plane: KvPlane):
    """Metadata and the live rows as they sit physically, as bit patterns."""
    meta = plane.meta
    if not plane.is_ring:
        meta = (
            meta.len,
            meta.origin_logical,
            meta.origin_physical,
        )  # capacity may differ
    if plane.len == 0:
        return meta, None
    rows = ring_indices(plane.origin_physical, 0, plane.len, max(plane.capacity, 1))
    keys, values = plane.keys, plane.values
    return meta, [bits(take_rows(a, rows, plane.head_major)) for a in (keys, values)]


def assert_same_planes(got: List[KvPlane], want: List[KvPlane]) -> None:
    for plane, expected in zip(got, want):
        meta, rows = live_bits(plane)
        want_meta, want_rows = live_bits(expected)
        assert meta == want_meta
        if want_rows is not None:
            for g, w in zip(rows, want_rows):
                np.testing.assert_array_equal(g, w)


def write_history(cache: List[KvPlane], history: List[List[mx.array]]) -> None:
    for layer_rows in history:
        for plane, (keys, values) in zip(cache, layer_rows):
            plane.update_and_fetch(keys, values)


def fetch_block(cache, block, cuts) -> List[List[np.ndarray]]:
    """Write the block through ``update_and_fetch``; return what attention read."""
    seen = []
    for plane, (keys, values) in zip(cache, block):
        for k, v in zip(chunk_rows(keys, cuts), chunk_rows(values, cuts)):
            seen.append([bits(a) for a in plane.update_and_fetch(k, v)])
    return seen


@st.composite
def rounds(draw, max_block: int = 14):
    """A cache history, a block, how it is chunked, and the rows kept."""
    dtype = draw(st.sampled_from(list(DTYPES)))
    history = draw(st.lists(st.integers(1, 13), min_size=0, max_size=4))
    block = draw(st.integers(1, max_block))
    style = draw(st.sampled_from(["one", "two", "tokens"]))
    cuts = []
    if style == "two" and block > 1:
        cuts = [draw(st.integers(1, block - 1))]
    elif style == "tokens":
        cuts = list(range(1, block))
    accepted = draw(st.integers(0, block))
    seed = draw(st.integers(0, 2**31 - 1))
    return dtype, history, block, cuts, accepted, seed


def check_round(case, use_kernel: Optional[bool]) -> None:
    """The checkpoint oracle of DESIGN §3 over a whole multi-plane cache."""
    dtype, history_sizes, block_size, cuts, accepted, seed = case
    rng = np.random.default_rng(seed)
    planes = len(make_cache(None))

    def rows_for(count):
        return [
            (random_rows(rng, count, dtype), random_rows(rng, count, dtype))
            for _ in range(planes)
        ]

    history = [rows_for(count) for count in history_sizes]
    block = rows_for(block_size)

    speculative = make_cache(use_kernel)
    write_history(speculative, history)
    checkpoint = SpeculativeCheckpoint.begin(
        speculative, block_size, use_kernel=use_kernel
    )
    seen = fetch_block(speculative, block, cuts)
    checkpoint.commit(accepted)
    assert not any(plane.checkpointed for plane in speculative)

    # Attention saw exactly what it sees with no checkpoint open (and the reference ops).
    plain = make_cache(False)
    write_history(plain, history)
    for got, want in zip(seen, fetch_block(plain, block, cuts)):
        for g, w in zip(got, want):
            np.testing.assert_array_equal(g, w)

    # The planes equal appending only the first ``accepted`` rows.
    expected = make_cache(False)
    write_history(expected, history)
    for plane, (keys, values) in zip(expected, block):
        if accepted:
            plane.write(plane.offset, keys[:, :, :accepted], values[:, :, :accepted])
    assert_same_planes(speculative, expected)


# ------------------------------------------------------------------ reference


@settings(max_examples=150, deadline=None)
@given(rounds())
def test_reference_round_equals_appending_the_accepted_rows(case) -> None:
    check_round(case, use_kernel=False)


@settings(max_examples=60, deadline=None)
@given(rounds(max_block=30))
def test_blocks_wider_than_every_ring(case) -> None:
    check_round(case, use_kernel=False)


def test_a_reader_mid_round_sees_the_block_and_rollback_stays_exact() -> None:
    rng = np.random.default_rng(0)
    cache = make_cache(False)
    write_history(cache, [[(random_rows(rng, 13, "float16"),) * 2 for _ in cache]])
    before = [live_bits(p) for p in cache]
    checkpoint = SpeculativeCheckpoint.begin(cache, 4)
    block = random_rows(rng, 4, "float16")
    cache[0].update_and_fetch(block, block)
    assert cache[0].guard.mode == "deferred"
    # Reading the buffers writes the held-back block first (and retains what it overwrites).
    keys, _ = cache[0].logical_rows()  # window 5: one old row, then the 4-row block
    np.testing.assert_array_equal(bits(keys)[:, :, 1:], bits(block))
    assert cache[0].guard.mode == "retained"
    checkpoint.rollback()
    for plane, (meta, rows) in zip(cache, before):
        got_meta, got_rows = live_bits(plane)
        assert got_meta == meta
        for g, w in zip(got_rows, rows):
            np.testing.assert_array_equal(g, w)


# ------------------------------------------------------------------ ring_write


@settings(max_examples=120, deadline=None)
@given(
    dtype=st.sampled_from(list(DTYPES)),
    head_major=st.booleans(),
    capacity=st.integers(1, 40),
    data=st.data(),
)
def test_ring_write_equals_numpy_per_row_indexing(
    dtype, head_major, capacity, data
) -> None:
    count = data.draw(st.integers(1, capacity))
    start = data.draw(st.integers(0, capacity - 1))
    extra = data.draw(
        st.integers(0, 3)
    )  # rows taken as a strided slice of a wider block
    seed = data.draw(st.integers(0, 2**31 - 1))
    rng = np.random.default_rng(seed)
    shape = (2, 1, HEADS, capacity, DIM) if head_major else (2, 1, capacity, HEADS, DIM)
    axis = 3 if head_major else 2
    buffer = random_bits(shape, dtype, rng)
    wide = list(shape)
    wide[axis] = count + extra
    block = random_bits(tuple(wide), dtype, rng)
    rows = np.take(block, np.arange(extra, extra + count), axis=axis)
    window = [slice(None)] * 5
    window[axis] = slice(extra, extra + count)
    got = ring_write(
        to_mx(buffer, dtype), to_mx(block, dtype)[tuple(window)], start, axis
    )
    want = buffer.copy()
    index = [slice(None)] * 5
    index[axis] = (start + np.arange(count)) % capacity
    want[tuple(index)] = rows
    launches = graph_launches(got)
    assert sum(launches.values()) <= 1, launches  # one op, never split at the seam
    np.testing.assert_array_equal(bits(got), want)


# -------------------------------------------------------- launches, host syncs


def glimmer_like(
    use_kernel: Optional[bool], window: int = 16, context: int = 40, dim: int = DIM
) -> List[KvPlane]:
    """Muse Glimmer's layer pattern (3 sliding, 1 full) over 8 layers, rings full."""
    cache = [
        (
            GrowingKVCache(layer=i, use_kernel=use_kernel)
            if i % 4 == 3
            else RingKVCache(window, layer=i, use_kernel=use_kernel)
        )
        for i in range(8)
    ]
    rows = mx.ones((1, HEADS, context, dim), dtype=mx.bfloat16)
    for plane in cache:
        plane.update_and_fetch(rows, rows)
    mx.eval([plane.kv for plane in cache])
    return cache


def fetch_all(cache: List[KvPlane], block: int) -> List[mx.array]:
    """``update_and_fetch`` a ``block``-row chunk in every layer; what attention reads."""
    rows = mx.zeros(
        cache[0].keys.shape[:2] + (block,) + cache[0].keys.shape[3:], mx.bfloat16
    )
    return [array for plane in cache for array in plane.update_and_fetch(rows, rows)]


def staged_round(cache: List[KvPlane], block: int, kept: int) -> List[mx.array]:
    """begin -> update_and_fetch every layer -> commit(kept), all lazy; the lazy outputs."""
    ckpt = SpeculativeCheckpoint.begin(cache, block)
    seen = fetch_all(cache, block)
    ckpt.commit(kept)
    return seen


def ring_launches(cache: List[KvPlane]) -> int:
    return sum(graph_launches(*[plane.kv for plane in cache if plane.is_ring]).values())


@pytest.mark.parametrize("kept", [0, 1, 8])
def test_a_staged_round_adds_no_launch_for_the_checkpoint(kept: int) -> None:
    cache = glimmer_like(False)
    rings = sum(plane.is_ring for plane in cache)
    checkpoint = SpeculativeCheckpoint.begin(cache, 8)
    seen = fetch_all(cache, 8)
    with_checkpoint = graph_launches(*seen)
    # Per ring the staging shadow only: stack K/V, then one concatenate of the live rows'
    # two runs and the chunk (no gather).
    assert (
        with_checkpoint["Gather"] == 0 and with_checkpoint["Concatenate"] == 8 + rings
    )
    mx.eval(seen)
    assert ring_launches(cache) == 0  # the forward never wrote a ring
    checkpoint.commit(kept)
    # The block reaches the rings at commit: one store per ring, none on rollback.
    assert ring_launches(cache) == (rings if kept else 0)
    plain = glimmer_like(False)
    seen = fetch_all(plain, 8)
    assert graph_launches(*seen) == with_checkpoint  # the checkpoint added no launch
    mx.eval(seen)
    assert (
        ring_launches(plain) == rings
    )  # without a checkpoint the forward stores instead


def test_no_host_sync_in_a_staged_round(monkeypatch: pytest.MonkeyPatch) -> None:
    cache = glimmer_like(False)

    def refuse(*args, **kwargs):
        raise AssertionError("host sync in a staged round")

    with monkeypatch.context() as patch:
        patch.setattr(mx, "eval", refuse)
        patch.setattr(mx, "async_eval", refuse)
        seen = staged_round(cache, 8, 5)
    mx.eval(seen, [plane.kv for plane in cache])


def test_commit_stores_run_in_place() -> None:
    cache = glimmer_like(False, window=256, context=300, dim=64)
    seen = staged_round(cache, 16, 9)
    mx.eval(seen)
    del seen
    mx.synchronize()
    plane_bytes = cache[0].nbytes
    mx.reset_peak_memory()
    resident = mx.get_active_memory()
    mx.eval([plane.kv for plane in cache])
    mx.synchronize()
    assert mx.get_peak_memory() - resident < plane_bytes  # no ring was copied


# ------------------------------------------------------- emulated Metal kernels


@pytest.fixture(scope="module")
def emulator(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MetalEmulator]:
    """Route the wired kernel paths through the Metal bodies, compiled and run on the CPU."""
    gxx = find_compiler("g++")
    if gxx is None:
        pytest.skip("g++ not installed")
    emu = MetalEmulator(
        tmp_path_factory.mktemp("wired_emu"), check_specs(planes=(1, 2, 3)), gxx
    )
    assert emu.build.ok, emu.build.log
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(backend, "BACKEND", "metal")
        patch.setattr(backend, "launch", emu.launch)
        yield emu


@settings(max_examples=60, deadline=None)
@given(rounds(max_block=9))
def test_emulated_metal_round_equals_appending_the_accepted_rows(
    emulator, case
) -> None:
    before = emulator.launches
    check_round(case, use_kernel=True)
    LAUNCHES.append(emulator.launches - before)


LAUNCHES = []


def test_the_emulated_rounds_ran_kernels(emulator) -> None:
    assert sum(LAUNCHES) > 50, LAUNCHES


def test_emulated_kernels_are_what_the_cache_launches(emulator: MetalEmulator) -> None:
    rng = np.random.default_rng(1)
    cache = make_cache(True)
    write_history(cache, [[(random_rows(rng, 13, "bfloat16"),) * 2 for _ in cache]])
    rows = random_rows(rng, 3, "bfloat16")
    before = emulator.launches
    checkpoint = SpeculativeCheckpoint.begin(cache, 3)
    for plane in cache:
        plane.update_and_fetch(rows, rows)
    # One shadow launch per ring (K and V together); begin launched nothing.
    assert emulator.launches - before == 3
    checkpoint.commit(2)
    assert emulator.launches - before == 3
    # Single-token writes retain first: one retain launch per ring geometry (2 here).
    before = emulator.launches
    checkpoint = SpeculativeCheckpoint.begin(cache, 1)
    for plane in cache:
        plane.update_and_fetch(rows[:, :, :1], rows[:, :, :1])
    assert emulator.launches - before == 2
    checkpoint.rollback()


def test_the_switches_reach_the_wired_kernels(
    emulator: MetalEmulator, monkeypatch: pytest.MonkeyPatch
) -> None:
    rng = np.random.default_rng(2)
    rows = random_rows(rng, 13, "float32")

    def launches(use_kernel, enabled=True):
        with monkeypatch.context() as patch:
            patch.setattr(backend, "KERNELS_ENABLED", enabled)
            patch.setattr(backend, "gpu_is_default", lambda: True)
            plane = RingKVCache(5, use_kernel=use_kernel)
            before = emulator.launches
            plane.update_and_fetch(rows, rows)
            plane.update_and_fetch(rows[:, :, :3], rows[:, :, :3])
            return emulator.launches - before

    first_use.forget_verdicts()
    # A GPU backend: the kernel by default, launched twice at its first use in a
    # process (evaluated beside its reference, then for the caller), once after.
    assert launches(None) == 2
    assert launches(None) == 1
    first_use.forget_verdicts()
    assert launches(None, enabled=False) == 0  # DFLASH_KERNELS=0
    assert launches(False) == 0
    assert launches(True, enabled=False) == 1  # an explicit True still wins


def test_kernels_env_var_is_read_at_import() -> None:
    code = "from dflash.metal import backend; print(backend.KERNELS_ENABLED)"
    for value, want in (("0", "False"), ("1", "True")):
        env = dict(os.environ, DFLASH_KERNELS=value)
        done = subprocess.run(
            [sys.executable, "-c", code],
            capture_output=True,
            text=True,
            env=env,
            check=True,
        )
        assert done.stdout.strip() == want


# ----------------------------------------------------------------------- CUDA


@pytest.mark.cuda
@pytest.mark.skipif(not mx.cuda.is_available(), reason="needs mlx's CUDA backend")
def test_cuda_round_equals_the_reference_round() -> None:
    @settings(max_examples=60, deadline=None)
    @given(rounds())
    def check(case):
        check_round(case, use_kernel=True)

    check()


@pytest.mark.cuda
@pytest.mark.skipif(not mx.cuda.is_available(), reason="needs mlx's CUDA backend")
def test_cuda_staged_round_launches(monkeypatch: pytest.MonkeyPatch) -> None:
    # The round's own launches: scalars host-made (their packing has its own tests).
    monkeypatch.setenv(backend.RESIDENT_ENV, "0")
    backend.clear_launch_scalars()  # sets made before keep their route
    # By default CUDA stages with the reference ops (measured at least as fast): per ring a
    # stack and one concatenate, no gather, no custom kernel.
    default = glimmer_like(None)
    rings = sum(plane.is_ring for plane in default)
    SpeculativeCheckpoint.begin(default, 8)
    fetch = graph_launches(*fetch_all(default, 8))
    assert fetch["CustomKernel"] == 0 and fetch["Gather"] == 0
    assert fetch["Concatenate"] == len(default) + rings
    cache = glimmer_like(True)
    checkpoint = SpeculativeCheckpoint.begin(cache, 8)
    seen = fetch_all(cache, 8)
    fetch = graph_launches(*seen)
    # One launch per ring (shadow and stacked block together); only growing planes stack.
    assert fetch["CustomKernel"] == rings and fetch["Gather"] == 0
    assert fetch["Concatenate"] == len(cache) - rings
    # Count the commit alone: the block rows it stores must already be evaluated (on the
    # H200 the unevaluated K/V stacking was counted too: 6 Concatenate + 1 Full extra).
    mx.eval(seen)
    checkpoint.commit(3)
    assert ring_launches(cache) == rings
