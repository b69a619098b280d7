"""Folded block attention: same results as mlx's attention, routed only where it serves."""

from __future__ import annotations

import sys

import mlx.core as mx
import numpy as np
import pytest
from conftest import assert_lossless, tiny_model
from hypothesis import given, settings
from hypothesis import strategies as st
from test_dflash_loop import OracleDrafter, random_drafter

from dflash import dflash_generate_step
from dflash import folded_attention as folded
from dflash import kernel_patch
from dflash.greedy import greedy_reference
from dflash.kernel_patch import KernelPatch, attention_route
from dflash.speculative import speculative_generate_step

MASKS = ("none", "causal", "bool-2d", "bool-4d-one-head", "bool-4d-heads", "additive")


def _mask(kind, batch, heads, count, length, rng):
    if kind == "none":
        return None
    if kind == "causal":
        return "causal"
    if kind == "additive":
        return mx.array(rng.normal(size=(batch, heads, count, length)), mx.float32)
    shape = {
        "bool-2d": (count, length),
        "bool-4d-one-head": (batch, 1, count, length),
        "bool-4d-heads": (batch, heads, count, length),
    }[kind]
    seen = rng.random(shape) < 0.7
    seen[..., -1] = True  # every query sees some key
    return mx.array(seen)


@settings(max_examples=60, deadline=None)
@given(
    batch=st.integers(1, 2),
    kv_heads=st.integers(1, 3),
    group=st.integers(1, 4),
    count=st.integers(2, 32),
    extra=st.integers(0, 70),
    dim=st.sampled_from([8, 16, 32]),
    kind=st.sampled_from(MASKS),
    seed=st.integers(0, 2**16),
)
def test_folded_attention_equals_mlx_attention(
    batch, kv_heads, group, count, extra, dim, kind, seed
):
    rng = np.random.default_rng(seed)
    heads, length = kv_heads * group, count + extra
    queries = mx.array(rng.normal(size=(batch, heads, count, dim)), mx.float32)
    keys = mx.array(rng.normal(size=(batch, kv_heads, length, dim)), mx.float32)
    values = mx.array(rng.normal(size=(batch, kv_heads, length, dim)), mx.float32)
    mask = _mask(kind, batch, heads, count, length, rng)
    assert folded.serves(queries, keys, values, mask, min_keys=1)
    ours = folded.folded_attention(queries, keys, values, dim**-0.5, mask)
    want = mx.fast.scaled_dot_product_attention(
        queries, keys, values, scale=dim**-0.5, mask=mask
    )
    assert ours.shape == want.shape and ours.dtype == want.dtype
    np.testing.assert_allclose(np.asarray(ours), np.asarray(want), atol=2e-5, rtol=2e-5)


def test_folded_attention_keeps_the_mask_negative_control():
    rng = np.random.default_rng(0)
    queries = mx.array(rng.normal(size=(1, 4, 8, 16)), mx.float32)
    keys = mx.array(rng.normal(size=(1, 2, 40, 16)), mx.float32)
    values = mx.array(rng.normal(size=(1, 2, 40, 16)), mx.float32)
    causal = folded.folded_attention(queries, keys, values, 0.25, "causal")
    unmasked = mx.fast.scaled_dot_product_attention(
        queries, keys, values, scale=0.25, mask=None
    )
    # Only the last query sees every key: its row agrees, the others do not.
    np.testing.assert_allclose(
        np.asarray(causal[:, :, -1]), np.asarray(unmasked[:, :, -1]), atol=1e-5
    )
    assert not np.allclose(np.asarray(causal[:, :, 0]), np.asarray(unmasked[:, :, 0]))


@pytest.mark.parametrize(
    "change, reason",
    [
        (dict(count=1), "a decode step keeps mlx's vector kernel"),
        (dict(count=33), "a prompt chunk keeps mlx's attention"),
        (dict(length=8), "fewer keys than min_keys"),
        (dict(sinks=True), "attention sinks"),
        (dict(key_dtype=mx.float16), "keys in another dtype"),
        (dict(mask_shape=(1, 3, 4, 64)), "a head axis that is neither 1 nor Hq"),
        (dict(mask_shape=(2, 4, 64)), "a 3-D mask whose head axis is 2"),
        (dict(mask_shape=(3, 1, 4, 64)), "a mask of another batch"),
        (dict(mask_shape=(1, 1, 5, 64)), "a mask of another query count"),
        (dict(mask_shape=(64,)), "a 1-D mask"),
        (dict(mask_shape=(1, 1, 1, 4, 64)), "a 5-D mask"),
    ],
)
def test_serves_refuses_calls_it_does_not_take(change, reason):
    count = change.get("count", 4)
    length = change.get("length", 64)
    queries = mx.zeros((1, 4, count, 8))
    keys = mx.zeros((1, 2, length, 8), change.get("key_dtype", mx.float32))
    mask = None
    if "mask_shape" in change:
        mask = mx.ones(change["mask_shape"], mx.bool_)
    sinks = mx.zeros((4,)) if change.get("sinks") else None
    assert not folded.serves(queries, keys, keys, mask, sinks, min_keys=16), reason


def _count_folded(monkeypatch):
    calls = []
    original = folded.folded_attention

    def counting(*args):
        calls.append(args[1].shape[2])
        return original(*args)

    monkeypatch.setattr(folded, "folded_attention", counting)
    return calls


def test_route_hooks_the_module_and_restores_it(monkeypatch):
    target = tiny_model("muse_glimmer", seed=2, window=16)
    module = sys.modules[type(target).__module__]
    function = module.scaled_dot_product_attention
    with attention_route(target, use_folded=True) as installed:
        assert installed and module.scaled_dot_product_attention is not function
        with KernelPatch(target, use_kernel=False):
            pass
        # Leaving the kernel patch keeps the folded route's hook.
        assert module.scaled_dot_product_attention is not function
    assert module.scaled_dot_product_attention is function
    with attention_route(target, use_folded=False) as installed:
        assert not installed and module.scaled_dot_product_attention is function
    with pytest.raises(KeyError):
        with attention_route(target, use_folded=True):
            raise KeyError("boom")
    assert module.scaled_dot_product_attention is function


def test_default_follows_env_then_backend_table(monkeypatch):
    target = tiny_model("muse_glimmer", seed=2, window=16)
    monkeypatch.setenv(folded.FOLDED_ENV, "1")
    assert kernel_patch.folded_wanted(target)
    monkeypatch.setenv(folded.FOLDED_ENV, "0")
    assert not kernel_patch.folded_wanted(target)
    monkeypatch.delenv(folded.FOLDED_ENV)
    assert folded.wanted("cuda") and not folded.wanted("metal")
    assert not folded.wanted(None)
    assert not kernel_patch.folded_wanted(tiny_model("gpt_oss", seed=0, window=16))


@pytest.mark.parametrize("oracle", [False, True])
def test_dflash_output_is_lossless_through_the_folded_route(monkeypatch, oracle):
    calls = _count_folded(monkeypatch)
    monkeypatch.setattr(folded, "MIN_KEYS", 1)
    monkeypatch.setenv(folded.FOLDED_ENV, "1")
    target = tiny_model("muse_glimmer", seed=4, window=16)
    prompt = mx.random.randint(0, 250, (37,))
    reference = greedy_reference(target, prompt, 60)
    block = 8
    if oracle:
        taps = (1, len(target.layers) // 2, len(target.layers) - 1)
        drafter = OracleDrafter(prompt.tolist() + reference, block, taps)
    else:
        drafter = random_drafter(target, seed=14, block_size=block)
    out = [
        int(t)
        for t, _, _ in dflash_generate_step(
            prompt, target, drafter, block_size=block, max_tokens=60
        )
    ]
    assert_lossless(target, prompt, reference, out)
    # Verify blocks took the route (the prompt chunk and decode steps did not).
    assert calls and all(length >= block for length in calls)


def test_classic_loop_is_lossless_through_the_folded_route(monkeypatch):
    calls = _count_folded(monkeypatch)
    monkeypatch.setattr(folded, "MIN_KEYS", 1)
    monkeypatch.setenv(folded.FOLDED_ENV, "1")
    target = tiny_model("muse_glimmer", seed=5, window=16)
    draft = tiny_model("muse_glimmer", seed=6, window=16, num_hidden_layers=2)
    prompt = mx.random.randint(0, 250, (29,))
    reference = greedy_reference(target, prompt, 40)
    out = [
        int(t)
        for t, _, _ in speculative_generate_step(
            prompt, target, draft, num_draft_tokens=4, max_tokens=40
        )
    ]
    assert_lossless(target, prompt, reference, out)
    assert calls
