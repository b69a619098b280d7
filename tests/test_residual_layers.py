"""Muse Glimmer's decoder layer with its residual norms fused, installed by the kernel
patch: same bits as mlx-lm's forward on the reference, two launches a served call,
our plain and DFlash decoding bit-equal through the emulated kernel, the taps still
recording, and the fail-closed probe and switch."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from conftest import tiny_model
from mlx_lm.models import muse_glimmer
from support.compilers import built_emulator
from support.group_emulator import GroupEmulator
from test_prepared_heads import assert_plain_equals_dflash, patched_forwards

from dflash import kernel_patch, residual_layers
from dflash.cache import make_prompt_cache
from dflash.held_norms import HeldNorms, centered_scale
from dflash.kernel_patch import KernelPatch
from dflash.metal import attention, backend, groups
from dflash.metal import norms as rn
from dflash.taps import TargetTaps


def _f32(array: mx.array) -> np.ndarray:
    return np.asarray(array.astype(mx.float32))


def _fused(model) -> list:
    """Per decoder layer: whether it runs the fused forward."""
    cls = kernel_patch._SUBCLASSES.get(("residual", muse_glimmer.DecoderLayer))
    return [type(layer) is cls for layer in model.layers]


def _randomize_norms(model, seed: int) -> None:
    """Give the centered norms nonzero weights (a fresh model holds zeros)."""
    key = mx.random.key(seed)
    for layer in model.layers:
        for name in residual_layers.NORMS:
            key, draw = mx.random.split(key)
            norm = getattr(layer, name)
            norm.weight = (0.2 * mx.random.normal(norm.weight.shape, key=draw)).astype(
                norm.weight.dtype
            )


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
@pytest.mark.parametrize("bits", [None, 4])
@pytest.mark.parametrize("held", [False, True])
def test_fused_forward_gives_mlx_lms_bits_on_the_reference(dtype, bits, held) -> None:
    """On the CPU the residual norm is mlx's own ops: the re-stated layer changes no bit
    (held norms or not; past the window: the tiny model's ring wraps)."""
    target = tiny_model("muse_glimmer", seed=3, window=16)
    _randomize_norms(target, 3)
    target.set_dtype(dtype)
    if bits:
        nn.quantize(target, group_size=32, bits=bits)
    with KernelPatch(target, residual_norms=True):
        assert all(_fused(target))
    held_context = HeldNorms(target) if held else _nothing()
    with held_context:
        fused = patched_forwards(target, residual_norms=True)
        unfused = patched_forwards(target, residual_norms=False)
    for got, want in zip(fused, unfused):
        assert np.array_equal(_f32(got), _f32(want))


class _nothing:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return None


def test_norms_of_another_dtype_keep_mlx_lms_bits(monkeypatch) -> None:
    """Float32 norms in a bf16 model: the kernel does not take mixed dtypes, so the
    first layer's first group runs mlx's ops (never an error mid-generation; mlx
    promotes the sum to float32); groups whose arrays are all float32 after it launch;
    mlx-lm's bits are kept."""
    launches = []

    def kernel(branch, residual, weight, eps, next_weight, next_eps, prefetch=None):
        launches.append((branch.dtype, next_weight is not None))
        return rn.reference_residual_norm(
            branch, residual, weight, eps, next_weight, next_eps
        )

    monkeypatch.setattr(rn, "kernel_residual_norm", kernel)
    monkeypatch.setattr(backend, "BACKEND", "metal")
    monkeypatch.setattr(attention, "kernel_attention", attention.reference_attention)
    from dflash.metal import heads

    monkeypatch.setattr(heads, "kernel_head_prep", heads.reference_head_prep)
    target = tiny_model("muse_glimmer", seed=3, window=16)
    _randomize_norms(target, 3)
    target.set_dtype(mx.bfloat16)
    for layer in target.layers:
        for name in residual_layers.NORMS:
            norm = getattr(layer, name)
            norm.weight = norm.weight.astype(mx.float32)
    fused = patched_forwards(target, use_kernel=True, matmul=False, residual_norms=True)
    f32 = mx.float32
    assert set(launches) == {(f32, False), (f32, True)}
    assert launches.count((f32, True)) < launches.count((f32, False))
    unfused = patched_forwards(
        target, use_kernel=True, matmul=False, residual_norms=False
    )
    for got, want in zip(fused, unfused):
        assert np.array_equal(_f32(got), _f32(want))


def test_centered_scale_is_the_held_array_or_the_same_op() -> None:
    target = tiny_model("muse_glimmer", seed=2, window=16)
    _randomize_norms(target, 2)
    norm = target.layers[0].post_attention_layernorm
    computed = centered_scale(norm)
    assert np.array_equal(_f32(computed), _f32(1.0 + norm.weight))
    with HeldNorms(target):
        assert centered_scale(norm) is centered_scale(norm)  # the held array
        assert np.array_equal(_f32(centered_scale(norm)), _f32(computed))
        norm.weight = norm.weight * 2  # a replaced weight is held again
        assert np.array_equal(_f32(centered_scale(norm)), _f32(1.0 + norm.weight))


def test_served_calls_take_two_residual_norms_each(monkeypatch) -> None:
    """Two launches a layer for a decode step or a block (the second without a next
    norm); a prefill chunk longer than ``max_queries`` keeps mlx-lm's forward."""
    calls = []

    def counting(branch, residual, weight, eps, **kwargs):
        calls.append((branch.shape[1], kwargs.get("next_weight") is not None))
        return rn.residual_norm(branch, residual, weight, eps, **kwargs)

    monkeypatch.setattr(residual_layers, "residual_norm", counting)
    target = tiny_model("muse_glimmer", seed=4, window=16)
    layers = len(target.layers)
    with KernelPatch(target, max_queries=16, residual_norms=True):
        cache = make_prompt_cache(target)
        target(mx.random.randint(0, 250, (1, 20)), cache)
        assert calls == []
        target(mx.array([[5]]), cache)
        target(mx.random.randint(0, 250, (1, 16)), cache)
    assert (
        calls == [(1, True), (1, False)] * layers + [(16, True), (16, False)] * layers
    )


@pytest.fixture(scope="module")
def emulator(tmp_path_factory):
    return built_emulator(
        GroupEmulator, tmp_path_factory, "residual_layers_emulator", rn.SPECS
    )


@pytest.mark.parametrize("dtype, block", [(mx.bfloat16, 8), (mx.float32, 5)])
def test_plain_and_speculative_agree_bitwise_through_the_emulated_kernel(
    emulator, monkeypatch, dtype, block
) -> None:
    """The Metal body run on the CPU for every served call (the other kernels as their
    references): our plain decoding and DFlash decoding give every token the same
    logits, and the taps record the fused layers' outputs."""
    from dflash.metal import heads

    monkeypatch.setattr(backend, "BACKEND", "metal")
    monkeypatch.setattr(groups, "launch_groups", emulator.launch)
    monkeypatch.setattr(attention, "kernel_attention", attention.reference_attention)
    monkeypatch.setattr(heads, "kernel_head_prep", heads.reference_head_prep)
    target = tiny_model("muse_glimmer", seed=1, window=16)
    _randomize_norms(target, 1)
    with KernelPatch(target, residual_norms=True):
        assert all(_fused(target))
    assert_plain_equals_dflash(target, emulator, dtype, block, residual_norms=True)


def test_taps_record_the_fused_layers_and_a_tapped_layer_is_left_alone() -> None:
    """Installed before the taps, the fused forward's outputs are recorded; a layer
    tapped first keeps its recording class (and mlx-lm's forward)."""
    target = tiny_model("muse_glimmer", seed=5, window=16)
    _randomize_norms(target, 5)
    tokens = mx.random.randint(0, 250, (1, 6), key=mx.random.key(3))
    with TargetTaps(target, [0, 2]) as taps:
        target(tokens)
        want = taps.pop()
    with KernelPatch(target, residual_norms=True):
        with TargetTaps(target, [0, 2]) as taps:
            assert all(_fused(target)[i] is False for i in (0, 2))  # tapped on top
            target(tokens)
            got = taps.pop()
    assert np.array_equal(_f32(got), _f32(want))
    with TargetTaps(target, [1]):
        with KernelPatch(target, residual_norms=True):
            fused = _fused(target)
            assert fused[1] is False and fused[0] and fused[2]
            assert type(target.layers[1]).__name__.startswith("Tapped")
    assert all(type(layer) is muse_glimmer.DecoderLayer for layer in target.layers)


def test_a_class_whose_forward_differs_keeps_its_own(monkeypatch) -> None:
    """Fail closed: an mlx-lm whose Glimmer layer computes something else keeps it."""
    original = muse_glimmer.DecoderLayer.__call__

    def changed(self, x, mask=None, cache=None):
        return original(self, x, mask, cache) * 2

    monkeypatch.setattr(residual_layers, "_VERDICTS", {})
    monkeypatch.setattr(muse_glimmer.DecoderLayer, "__call__", changed)
    target = tiny_model("muse_glimmer", seed=6, window=16)
    with KernelPatch(target, residual_norms=True):
        assert not any(_fused(target))


def test_switch_default_off_and_uninstall(monkeypatch) -> None:
    """Off unless asked (measured slower on an H200); the switch turns it on, the
    argument wins over the switch, a bad switch value fails closed."""
    target = tiny_model("muse_glimmer", seed=7, window=16)
    monkeypatch.delenv(residual_layers.RESIDUAL_NORMS_ENV, raising=False)
    with KernelPatch(target):
        assert not any(_fused(target))
    monkeypatch.setenv(residual_layers.RESIDUAL_NORMS_ENV, "1")
    with KernelPatch(target):
        assert all(_fused(target))
    with KernelPatch(target, residual_norms=False):
        assert not any(_fused(target))
    with KernelPatch(target, attention=False, residual_norms=True):
        assert not any(_fused(target))
    assert all(type(layer) is muse_glimmer.DecoderLayer for layer in target.layers)
    monkeypatch.setenv(residual_layers.RESIDUAL_NORMS_ENV, "maybe")
    with pytest.raises(ValueError, match="DFLASH_RESIDUAL_NORMS"):
        KernelPatch(target)


def test_other_architectures_keep_their_layers() -> None:
    target = tiny_model("gemma3_text", seed=8)
    with KernelPatch(target, residual_norms=True):
        assert not any(residual_layers.serves(layer) for layer in target.layers)
        assert all(
            not hasattr(type(layer), "_dflash_kernel_original_class")
            for layer in target.layers
        )
