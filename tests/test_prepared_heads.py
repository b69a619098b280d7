"""Muse Glimmer's attention with its heads prepared in one launch, installed by the
kernel patch: same bits as mlx-lm's forward on the reference, one launch a served
call, our plain and DFlash decoding bit-equal through the emulated kernel, and the
fail-closed probe and switch."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from conftest import tiny_model
from mlx_lm.models import muse_glimmer
from support.compilers import built_emulator
from support.group_emulator import GroupEmulator
from test_dflash_loop import random_drafter

from dflash import dflash_generate_step, kernel_patch, prepared_heads
from dflash.cache import make_prompt_cache
from dflash.generation import generate_step
from dflash.kernel_patch import KernelPatch
from dflash.metal import attention, backend, groups, heads
from dflash.metal import norms as rn


def _f32(array: mx.array) -> np.ndarray:
    return np.asarray(array.astype(mx.float32))


def _prepared(model) -> list:
    """Per decoder layer: whether its attention runs the prepared forward."""
    cls = kernel_patch._SUBCLASSES.get(("prepared", muse_glimmer.Attention))
    return [type(layer.self_attn) is cls for layer in model.layers]


def patched_forwards(model, **patch) -> list:
    """Logits of a prefill, decode steps and a verify-sized block, under a patch."""
    with KernelPatch(model, **patch):
        cache = make_prompt_cache(model)
        outs = [model(mx.random.randint(0, 250, (1, 40), key=mx.random.key(1)), cache)]
        for token in range(5):
            outs.append(model(mx.array([[token + 3]]), cache))
        outs.append(
            model(mx.random.randint(0, 250, (1, 7), key=mx.random.key(2)), cache)
        )
        mx.eval(outs)
    return outs


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
@pytest.mark.parametrize("bits", [None, 4])
def test_prepared_forward_gives_mlx_lms_bits_on_the_reference(dtype, bits) -> None:
    """On the CPU the head prep is mlx's own ops: the re-stated forward changes no bit
    (past the window: the tiny model's ring wraps)."""
    target = tiny_model("muse_glimmer", seed=3, window=16)
    target.set_dtype(dtype)
    if bits:
        nn.quantize(target, group_size=32, bits=bits)
    with KernelPatch(target, head_prep=True):
        assert all(_prepared(target))
    prepared = patched_forwards(target, head_prep=True)
    routed = patched_forwards(target, head_prep=False)
    for got, want in zip(prepared, routed):
        assert np.array_equal(_f32(got), _f32(want))


def test_served_calls_take_one_head_prep_each(monkeypatch) -> None:
    """One head prep a layer for a decode step or a block; a prefill chunk longer than
    ``max_queries`` keeps mlx-lm's forward (its five ops)."""
    calls = []

    def counting(queries, keys, **kwargs):
        calls.append(queries.shape[1])
        return heads.head_prep(queries, keys, **kwargs)

    monkeypatch.setattr(prepared_heads, "head_prep", counting)
    target = tiny_model("muse_glimmer", seed=4, window=16)
    layers = len(target.layers)
    with KernelPatch(target, max_queries=16):
        calls.clear()  # the install's probe (when no earlier test cached its verdict)
        cache = make_prompt_cache(target)
        target(mx.random.randint(0, 250, (1, 20)), cache)
        assert calls == []
        target(mx.array([[5]]), cache)
        target(mx.random.randint(0, 250, (1, 16)), cache)
    assert calls == [1] * layers + [16] * layers


@pytest.mark.parametrize("switch", [None, "0"])
def test_served_calls_hand_the_gate_to_the_route(monkeypatch, switch) -> None:
    """Each served call's output gate reaches the route's attention (applied in its last
    pass), the same bits as mlx-lm's gate after it; ``DFLASH_GATE_EPILOGUE=0`` keeps
    mlx's two ops."""
    gates = []
    original = kernel_patch.small_query_attention

    def spy(*args, gate=None, **kwargs):
        gates.append(gate is not None)
        return original(*args, gate=gate, **kwargs)

    if switch is not None:
        monkeypatch.setenv(prepared_heads.GATE_EPILOGUE_ENV, switch)
    target = tiny_model("muse_glimmer", seed=4, window=16)
    want = patched_forwards(target, head_prep=True, gate_epilogue=False)
    monkeypatch.setattr(kernel_patch, "small_query_attention", spy)
    got = patched_forwards(target, head_prep=True)
    assert gates and all(gates) == (switch is None) and any(gates) == (switch is None)
    for g, w in zip(got, want):
        assert np.array_equal(_f32(g), _f32(w))


@pytest.mark.parametrize("fold", ["broken", "unbuildable", "reference"])
def test_the_gate_reaches_the_fold_only_where_its_probe_gives_mlxs_bits(
    monkeypatch, fold
) -> None:
    """Fail closed: a gated fold whose bits differ from mlx's sigmoid and multiply, or
    that cannot be built (an mlx whose JIT lacks the header), keeps mlx-lm's two ops."""

    def kernel(queries, plane, block_keys, block_values, plan, scale, softcap, gate):
        if fold == "unbuildable" and gate is not None:
            raise RuntimeError("nvrtc: cannot open unary_ops.cuh")
        out = attention.reference_attention(
            queries, plane, block_keys, block_values, plan, scale, softcap, gate
        )
        return out * 1.5 if fold == "broken" and gate is not None else out

    monkeypatch.setattr(prepared_heads, "_GATED_VERDICTS", {})
    monkeypatch.setattr(attention, "kernel_attention", kernel)
    monkeypatch.setattr(heads, "kernel_head_prep", heads.reference_head_prep)
    monkeypatch.setattr(backend, "BACKEND", "metal")
    target = tiny_model("muse_glimmer", seed=2, window=16)
    with KernelPatch(target, use_kernel=True, matmul=False) as patch:
        assert patch.route.gate_epilogue == (fold == "reference")
        assert all(_prepared(target))


def test_use_kernel_reaches_the_head_prep_kernel(monkeypatch) -> None:
    taken = []

    def kernel(queries, keys, prep, values=None):
        taken.append(prep.start)
        blocks.append(values is not None)
        return heads.reference_head_prep(queries, keys, prep, values)

    blocks = []

    monkeypatch.setattr(heads, "kernel_head_prep", kernel)
    monkeypatch.setattr(attention, "kernel_attention", attention.reference_attention)
    monkeypatch.setattr(rn, "kernel_residual_norm", rn.reference_residual_norm)
    monkeypatch.setattr(backend, "BACKEND", "metal")
    target = tiny_model("muse_glimmer", seed=9, window=16)
    with KernelPatch(target, use_kernel=True, matmul=False):
        cache = make_prompt_cache(target)
        target(mx.random.randint(0, 250, (1, 4)), cache)
        target(mx.array([[7]]), cache)
    # Sliding layers rotate from the cache's offset; full layers have no RoPE.
    sliding = [layer.self_attn.use_rope for layer in target.layers]
    assert taken == [0] * len(sliding) + [4 if rope else 0 for rope in sliding]
    assert any(sliding) and not all(sliding)
    # dflash's planes take the head prep's stacked block.
    assert blocks and all(blocks)


@pytest.fixture(scope="module")
def emulator(tmp_path_factory):
    return built_emulator(
        GroupEmulator, tmp_path_factory, "prepared_heads_emulator", heads.SPECS
    )


@pytest.mark.parametrize("dtype, block", [(mx.bfloat16, 8), (mx.float32, 5)])
def test_plain_and_speculative_agree_bitwise_through_the_emulated_kernel(
    emulator, monkeypatch, dtype, block
) -> None:
    """The Metal body run on the CPU for every served call: our plain decoding (one
    token a step) and DFlash decoding (blocks) give every token the same logits."""
    monkeypatch.setattr(backend, "BACKEND", "metal")
    monkeypatch.setattr(groups, "launch_groups", emulator.launch)
    monkeypatch.setattr(attention, "kernel_attention", attention.reference_attention)
    monkeypatch.setattr(rn, "kernel_residual_norm", rn.reference_residual_norm)
    target = tiny_model("muse_glimmer", seed=1, window=16)
    assert_plain_equals_dflash(target, emulator, dtype, block)


def assert_plain_equals_dflash(target, emulator, dtype, block, **patch) -> None:
    """Under the kernel patch (``patch``: its extra keywords), our plain decoding (one
    token a step) and DFlash decoding (blocks) of ``target`` in ``dtype`` give every
    token the same logits, and the emulator ran some launch."""
    target.set_dtype(dtype)
    drafter = random_drafter(target, seed=11, block_size=block)
    drafter.set_dtype(dtype)
    prompt = mx.random.randint(0, 250, (19,), key=mx.random.key(5))
    before = emulator.launches
    with KernelPatch(target, drafter, use_kernel=True, matmul=False, **patch):
        plain = list(generate_step(prompt, target, max_tokens=24))
        spec = list(dflash_generate_step(prompt, target, drafter, max_tokens=24))
    assert emulator.launches > before
    assert [int(t) for t, _ in plain] == [int(t) for t, _, _ in spec]
    for index, ((_, want), (_, got, _)) in enumerate(zip(plain, spec)):
        assert np.array_equal(_f32(want), _f32(got)), f"token {index}"


def test_a_class_whose_forward_differs_keeps_its_own(monkeypatch) -> None:
    """Fail closed: an mlx-lm whose Glimmer attention computes something else is
    routed as before, not re-stated."""
    original = muse_glimmer.Attention.__call__

    def changed(self, x, mask=None, cache=None):
        return original(self, x, mask, cache) * 2

    monkeypatch.setattr(prepared_heads, "_VERDICTS", {})
    monkeypatch.setattr(muse_glimmer.Attention, "__call__", changed)
    target = tiny_model("muse_glimmer", seed=6, window=16)
    with KernelPatch(target):
        assert not any(_prepared(target))
        assert all(hasattr(type(layer.self_attn), "_dflash_kernel_original_class")
                   for layer in target.layers)  # fmt: skip


def test_switch_and_uninstall(monkeypatch) -> None:
    target = tiny_model("muse_glimmer", seed=7, window=16)
    monkeypatch.setenv(prepared_heads.HEAD_PREP_ENV, "0")
    with KernelPatch(target):
        assert not any(_prepared(target))
    with KernelPatch(target, head_prep=True):
        assert all(_prepared(target))
    with KernelPatch(target, attention=False):
        assert not any(_prepared(target))
    assert all(
        type(layer.self_attn) is muse_glimmer.Attention for layer in target.layers
    )
    monkeypatch.setenv(prepared_heads.HEAD_PREP_ENV, "sometimes")
    with pytest.raises(ValueError, match="DFLASH_HEAD_PREP"):
        KernelPatch(target)


def test_other_architectures_keep_the_routed_forward() -> None:
    target = tiny_model("qwen3", seed=8)
    with KernelPatch(target):
        assert not any(
            prepared_heads.serves(layer.self_attn) for layer in target.layers
        )
        for layer in target.layers:
            base = type(layer.self_attn).__mro__[1]
            assert type(layer.self_attn) is kernel_patch._routed_class(base)


def test_a_declined_call_whose_rows_were_left_in_place_raises():
    """``rows_in_place`` is the caller's word that the route serves the call: were the
    route to decline, mlx's attention has no rows, and the forward says so."""
    target = tiny_model("muse_glimmer", seed=3, window=16)
    module = target.layers[0].self_attn
    cache = make_prompt_cache(target)[0]
    x = mx.random.normal((1, 2, target.args.hidden_size)).astype(mx.float32)
    attend = prepared_heads.model_attention(type(module))
    declines = lambda *args: None  # noqa: E731
    forward = prepared_heads.attention_forward(
        module, x, None, cache, attend, False, declines, True
    )
    assert forward.shape == x.shape  # declined, with the rows fetched: mlx's attention
    with pytest.raises(RuntimeError, match="declined"):
        prepared_heads.attention_forward(
            module, x, None, cache, attend, False, declines, True, rows_in_place=True
        )
