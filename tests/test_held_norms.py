"""Held norm scales: the same bits as the norms' own forwards, installed and removed cleanly."""

from __future__ import annotations

import importlib

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from conftest import tiny_model
from hypothesis import given, settings
from hypothesis import strategies as st
from mlx.utils import tree_flatten
from test_dflash_loop import random_drafter

from dflash import dflash_generate_step
from dflash.generation import generate_step
from dflash.held_norms import (
    HELD_NORMS_ENV,
    OFFSET_NORM_CLASSES,
    HeldNorms,
    held_norms,
    held_norms_wanted,
    is_held,
    offset_norms,
)

NORM_CLASSES = sorted(OFFSET_NORM_CLASSES)
DTYPES = {"float32": mx.float32, "bfloat16": mx.bfloat16, "float16": mx.float16}


def _norm(module_name: str, class_name: str, dim: int, eps: float) -> nn.Module:
    cls = getattr(importlib.import_module(module_name), class_name)
    return cls(dim, eps)


def _bits(array: mx.array) -> np.ndarray:
    return np.asarray(array.astype(mx.float32))


def _all_norm_classes(model: nn.Module) -> set:
    return {type(m) for m in model.modules() if "Norm" in type(m).__name__}


@settings(max_examples=40)
@given(
    which=st.sampled_from(NORM_CLASSES),
    dim=st.sampled_from([8, 16, 64, 96]),
    rows=st.integers(1, 17),
    dtype=st.sampled_from(sorted(DTYPES)),
    weight_dtype=st.sampled_from(["same", "float32"]),
    seed=st.integers(0, 2**16),
)
def test_held_norm_gives_the_norms_own_bits(
    which, dim, rows, dtype, weight_dtype, seed
) -> None:
    norm = _norm(*which, dim, 1e-5)
    key_w, key_x = mx.random.split(mx.random.key(seed))
    weight = 0.5 * mx.random.normal((dim,), key=key_w)
    norm.weight = weight.astype(DTYPES[dtype] if weight_dtype == "same" else mx.float32)
    x = (3 * mx.random.normal((2, rows, dim), key=key_x)).astype(DTYPES[dtype])
    own = norm(x)
    with HeldNorms(norm) as held:
        assert held.swapped == 1 and is_held(norm)
        first, again = norm(x), norm(x)
    assert not is_held(norm)
    assert own.dtype == first.dtype
    np.testing.assert_array_equal(_bits(first), _bits(own))
    np.testing.assert_array_equal(_bits(again), _bits(own))


@pytest.mark.parametrize(
    "arch, per_layer, extra", [("muse_glimmer", 4, 0), ("gemma3_text", 6, 1)]
)
def test_held_norms_swap_every_offset_norm_and_restore_the_model(
    arch, per_layer, extra
) -> None:
    model = tiny_model(arch, seed=3)
    classes = _all_norm_classes(model)
    parameters = dict(tree_flatten(model.parameters()))
    with HeldNorms(model) as held:
        assert held.swapped == per_layer * len(model.layers) + extra
        assert offset_norms(model) == []  # every one swapped
    assert _all_norm_classes(model) == classes
    assert not any(is_held(m) for m in model.modules())
    assert not any("_dflash_held_scale" in m.__dict__ for m in model.modules())
    after = dict(tree_flatten(model.parameters()))
    assert after.keys() == parameters.keys()
    assert all(after[name] is parameters[name] for name in parameters)


def test_models_without_offset_norms_are_left_alone() -> None:
    for arch in ("llama", "qwen3", "cohere2"):
        model = tiny_model(arch, seed=0)
        with HeldNorms(model) as held:
            assert held.swapped == 0
        with held_norms(model) as installed:
            assert installed is None


def test_a_replaced_weight_is_held_again() -> None:
    norm = _norm("mlx_lm.models.muse_glimmer", "CenteredRMSNorm", 16, 1e-5)
    x = mx.random.normal((1, 3, 16), key=mx.random.key(1))
    with HeldNorms(norm):
        before = norm(x)
        norm.weight = mx.full((16,), 2.0)
        after = norm(x)
    own = mx.fast.rms_norm(x, 1.0 + mx.full((16,), 2.0), 1e-5)
    np.testing.assert_array_equal(_bits(after), _bits(own))
    assert not np.array_equal(_bits(after), _bits(before))


def test_a_norm_whose_forward_is_not_the_offset_form_keeps_its_own() -> None:
    # A class the table names whose forward computes something else (an mlx-lm that
    # changed it): the probe refuses it and the norm keeps its own forward.
    class RMSNorm(nn.Module):
        def __init__(self, dims: int):
            super().__init__()
            self.weight = mx.zeros((dims,))
            self.eps = 1e-5

        def __call__(self, x):
            return mx.fast.rms_norm(x, 2.0 + self.weight, self.eps)

    RMSNorm.__module__ = "mlx_lm.models.gemma3_text"
    norm = RMSNorm(8)
    x = mx.random.normal((2, 8), key=mx.random.key(2))
    with HeldNorms(norm) as held:
        assert held.swapped == 0 and not is_held(norm)
        np.testing.assert_array_equal(_bits(norm(x)), _bits(RMSNorm.__call__(norm, x)))


def test_a_module_shared_by_two_models_is_swapped_once() -> None:
    model = tiny_model("muse_glimmer", seed=4)
    classes = _all_norm_classes(model)
    with HeldNorms(model, model) as held:
        assert held.swapped == 4 * len(model.layers)
    assert _all_norm_classes(model) == classes


def test_none_and_stand_in_drafters_are_skipped() -> None:
    model = tiny_model("muse_glimmer", seed=0)
    with HeldNorms(model, None, object()) as held:
        assert held.swapped == 4 * len(model.layers)


def test_held_norms_follow_the_switch(monkeypatch) -> None:
    monkeypatch.delenv(HELD_NORMS_ENV, raising=False)
    assert held_norms_wanted() is True
    monkeypatch.setenv(HELD_NORMS_ENV, "0")
    assert held_norms_wanted() is False
    assert held_norms_wanted(True) is True
    model = tiny_model("muse_glimmer", seed=0)
    with held_norms(model) as installed:
        assert installed is None and not any(is_held(m) for m in model.modules())
    monkeypatch.setenv(HELD_NORMS_ENV, "off")
    assert held_norms_wanted() is False
    monkeypatch.setenv(HELD_NORMS_ENV, "maybe")
    with pytest.raises(ValueError, match=HELD_NORMS_ENV):
        held_norms_wanted()


@pytest.mark.parametrize(
    "arch, dtype", [("muse_glimmer", "bfloat16"), ("gemma3_text", "float32")]
)
def test_generations_with_held_norms_give_the_bits_of_generations_without(
    arch, dtype, monkeypatch
) -> None:
    model = tiny_model(arch, seed=5, window=8)
    model.set_dtype(DTYPES[dtype])
    drafter = random_drafter(model, seed=9, block_size=4)
    drafter.set_dtype(DTYPES[dtype])
    prompt = mx.array([3, 17, 4, 99, 23, 5, 61, 7, 8, 2, 44, 10])
    runs = {}
    for switch in ("0", "1"):
        monkeypatch.setenv(HELD_NORMS_ENV, switch)
        plain = list(generate_step(prompt, model, max_tokens=20))
        steps = dflash_generate_step(prompt, model, drafter, max_tokens=20)
        spec = [next(steps)]
        assert any(is_held(m) for m in model.modules()) == (switch == "1")
        spec += list(steps)
        runs[switch] = (plain, spec)
        assert not any(is_held(m) for m in model.modules())
    for (off_token, off_lp, *_), (on_token, on_lp, *_) in zip(
        runs["0"][0] + runs["0"][1], runs["1"][0] + runs["1"][1]
    ):
        assert off_token == on_token
        np.testing.assert_array_equal(_bits(off_lp), _bits(on_lp))
    assert len(runs["1"][0]) == len(runs["1"][1]) == 20


def test_a_closed_generation_restores_the_norms(monkeypatch) -> None:
    monkeypatch.delenv(HELD_NORMS_ENV, raising=False)
    model = tiny_model("muse_glimmer", seed=6)
    steps = generate_step(mx.array([1, 2, 3, 4]), model, max_tokens=10)
    next(steps)
    assert sum(is_held(m) for m in model.modules()) == 4 * len(model.layers)
    steps.close()
    assert not any(is_held(m) for m in model.modules())


def test_a_failing_install_leaves_every_norm_as_it_was(monkeypatch) -> None:
    model = tiny_model("muse_glimmer", seed=7)
    classes = _all_norm_classes(model)

    def broken(norms):
        raise RuntimeError("evaluation failed")

    monkeypatch.setattr("dflash.held_norms.mx.eval", broken)
    with pytest.raises(RuntimeError, match="evaluation failed"):
        HeldNorms(model).install()
    assert _all_norm_classes(model) == classes
    assert not any("_dflash_held_scale" in m.__dict__ for m in model.modules())
