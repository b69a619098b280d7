"""A default cache kernel is checked against its reference at its first use.

On a pretend Metal device (the CPU with ``dflash.metal.backend`` told it is Metal and
the GPU is the default device), the cache's default kernels launch through stand-ins:
the Metal bodies on the CPU emulator (a kernel that works), a launch that mlx refuses
(a compiler that rejects the body) and a launch whose bits are wrong (a GPU that
computes it wrongly). A refused or wrong kernel must cost nothing but speed.
"""

from __future__ import annotations

import warnings

import mlx.core as mx
import numpy as np
import pytest
from conftest import assert_lossless, greedy_reference, tiny_model
from support.compile_check import check_specs
from support.compilers import built_emulator
from support.metal_emulator import MetalEmulator
from test_dflash_loop import random_drafter

from dflash import dflash_generate_step
from dflash.metal import backend, first_use
from dflash.metal.retain import retain_rows
from dflash.metal.ring import ShadowStager


class Launches:
    """A stand-in for ``backend.launch``: the emulator, a refusal or wrong bits."""

    def __init__(self, emulator: MetalEmulator, mode: str) -> None:
        self.emulator, self.mode, self.calls = emulator, mode, []

    def __call__(self, spec, inputs, output_shapes, word, total):
        self.calls.append(spec.base)
        if self.mode == "refused":
            raise RuntimeError(
                "[metal::Device] Unable to build metal library from source"
            )
        outputs = self.emulator.launch(spec, inputs, output_shapes, word, total)
        if self.mode == "wrong":  # one word of the first output off by one
            flat = outputs[0].reshape(-1)
            flat = mx.concatenate([flat[:1] + mx.array(1, dtype=flat.dtype), flat[1:]])
            outputs = [flat.reshape(outputs[0].shape)] + list(outputs[1:])
        return outputs


@pytest.fixture(scope="module")
def emulator(tmp_path_factory: pytest.TempPathFactory) -> MetalEmulator:
    return built_emulator(
        MetalEmulator, tmp_path_factory, "first_use", check_specs(planes=(1, 2, 3))
    )


@pytest.fixture
def pretend_metal(monkeypatch, emulator):
    """Make a pretend Metal device whose launches go to a :class:`Launches` of the
    mode asked for (call the fixture's value with it)."""
    monkeypatch.setattr(backend, "BACKEND", backend.METAL)
    monkeypatch.setattr(backend, "gpu_is_default", lambda: True)
    first_use.forget_verdicts()

    def install(mode: str) -> Launches:
        launches = Launches(emulator, mode)
        monkeypatch.setattr(backend, "launch", launches)
        return launches

    yield install
    first_use.forget_verdicts()


def _buffers(planes: int = 3, capacity: int = 12, dtype=mx.bfloat16):
    rng = np.random.default_rng(planes)
    shape = (1, 2, capacity, 8)
    return [mx.array(rng.standard_normal(shape)).astype(dtype) for _ in range(planes)]


def _dests(planes: int, rows: int, capacity: int = 12) -> mx.array:
    return mx.array(
        [[(p + 5 * r) % capacity for r in range(rows)] for p in range(planes)]
    )


def _bits(array: mx.array) -> np.ndarray:
    return np.asarray(array.view(mx.uint16) if array.dtype.size == 2 else array)


def _retained(use_kernel=None, rows: int = 4) -> mx.array:
    buffers = _buffers()
    return retain_rows(buffers, _dests(len(buffers), rows), use_kernel=use_kernel)


def test_a_working_kernel_is_kept_after_one_checked_call(pretend_metal) -> None:
    launches = pretend_metal("emulated")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        first = _retained()
        second = _retained(rows=5)
    assert np.array_equal(_bits(first), _bits(_retained(use_kernel=False)))
    # The checked call twice (evaluated for the check, lazy for the caller), then once.
    assert len(launches.calls) == 3
    assert first_use.verdict((backend.METAL, ("retain_rows", mx.uint64, 3))) is True
    assert second.shape[3] == 5


@pytest.mark.parametrize("mode", ["refused", "wrong"])
def test_a_refused_or_wrong_kernel_falls_back_to_the_reference_once(
    pretend_metal, mode
) -> None:
    launches = pretend_metal(mode)
    expected = _bits(_retained(use_kernel=False))
    with pytest.warns(RuntimeWarning, match="retain_rows kernel on metal") as caught:
        first = _retained()
    assert (
        "failed" in str(caught[0].message)
        if mode == "refused"
        else "differs" in (str(caught[0].message))
    )
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no second warning
        second = _retained()
    assert np.array_equal(_bits(first), expected)
    assert np.array_equal(_bits(second), expected)
    assert len(launches.calls) == 1  # only the checked call launched


def test_a_kernel_asked_for_by_name_is_not_checked(pretend_metal) -> None:
    pretend_metal("refused")
    with pytest.raises(RuntimeError, match="Unable to build"):
        _retained(use_kernel=True)
    assert first_use.verdict((backend.METAL, ("retain_rows", mx.uint64, 3))) is None


def test_inside_a_trace_the_kernel_runs_unchecked(pretend_metal) -> None:
    launches = pretend_metal("emulated")
    token = backend._TRACING.set(True)
    try:
        _retained()
    finally:
        backend._TRACING.reset(token)
    assert len(launches.calls) == 1
    assert first_use.verdict((backend.METAL, ("retain_rows", mx.uint64, 3))) is None


def test_each_operation_word_and_plane_count_has_its_own_verdict(pretend_metal) -> None:
    pretend_metal("wrong")
    with pytest.warns(RuntimeWarning):
        _retained()
    buffers = _buffers(planes=2)
    with pytest.warns(RuntimeWarning):  # two planes: other launches, checked anew
        retain_rows(buffers, _dests(2, 3))
    buffers = _buffers(planes=2, dtype=mx.float32)
    with pytest.warns(RuntimeWarning):
        retain_rows([b[..., :3] for b in buffers], _dests(2, 3))


@pytest.mark.parametrize("mode", ["emulated", "refused", "wrong"])
def test_the_shadow_and_its_pair_give_the_reference_bits(pretend_metal, mode) -> None:
    pretend_metal(mode)
    kv = mx.stack(_buffers(planes=2))
    rows = _buffers(planes=2, capacity=3)
    stager = ShadowStager.for_buffer(kv)
    reference = ShadowStager.for_buffer(kv, use_kernel=False)
    single_stager = ShadowStager.for_buffer(kv[0])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore" if mode != "emulated" else "error")
        for _ in range(2):
            shadow, block = stager.pair(kv, rows[0], rows[1], 5, 9)
            single = single_stager(kv[0], rows[0], 5, 9)
    want_shadow, want_block = reference.pair(kv, rows[0], rows[1], 5, 9)
    assert np.array_equal(_bits(shadow), _bits(want_shadow))
    assert np.array_equal(_bits(block), _bits(want_block))
    want_single = ShadowStager.for_buffer(kv[0], use_kernel=False)(kv[0], rows[0], 5, 9)
    assert np.array_equal(_bits(single), _bits(want_single))
    kept = mode == "emulated"
    assert first_use.verdict((backend.METAL, ("stage_shadow_kv", mx.uint64))) is kept
    assert first_use.verdict((backend.METAL, ("stage_shadow", mx.uint64))) is kept


@pytest.mark.parametrize("mode", ["emulated", "refused"])
def test_a_metal_device_that_refuses_every_kernel_still_decodes_losslessly(
    pretend_metal, mode
) -> None:
    """DFlash decoding over wrapping rings (their staging shadows launched) on a device
    whose kernels work or are all refused: the target's greedy output."""
    launches = pretend_metal(mode)
    target = tiny_model("muse_glimmer", seed=3, window=16)
    drafter = random_drafter(target, seed=13, block_size=8)
    prompt = mx.random.randint(0, 250, (19,), key=mx.random.key(5))
    reference = greedy_reference(target, prompt, 40)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        output = [
            t
            for t, _, _ in dflash_generate_step(prompt, target, drafter, max_tokens=40)
        ]
    assert_lossless(target, prompt, reference, output)
    assert launches.calls  # the default path did reach the kernels
    refused = [w for w in caught if "first-use check" in str(w.message)]
    if mode == "refused":  # one warning for each operation the loop launched
        named = sorted(str(w.message).split()[2] for w in refused)
        assert named == ["stage_shadow_kv"], named  # the held-back blocks retain none
    else:
        assert not refused
