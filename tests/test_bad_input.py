"""Bad input fails closed: a clear error naming the problem, and the cache unchanged."""

import mlx.core as mx
import numpy as np
import pytest
from conftest import tiny_model

import dflash
from dflash.cache import CacheDiscontinuity, IncompatibleCache, make_prompt_cache


def snapshot(cache):
    return [(c.meta, None if c.keys is None else np.array(c.keys)) for c in cache]


def assert_unchanged(cache, before):
    for plane, (meta, keys) in zip(cache, before):
        assert plane.meta == meta
        if keys is not None:
            np.testing.assert_array_equal(np.array(plane.keys), keys)


@pytest.fixture
def pair():
    return tiny_model("muse_glimmer", seed=0), tiny_model(
        "muse_glimmer", seed=1, num_hidden_layers=4
    )


def primed_cache(target, draft, tokens=20):
    cache = make_prompt_cache(target) + make_prompt_cache(draft)
    prompt = mx.random.randint(0, 256, (1, tokens))
    target(prompt, cache=cache[: len(target.layers)])
    draft(prompt, cache=cache[len(target.layers) :])
    return cache


def test_discontinuous_write_names_layer_and_positions(pair):
    target, _ = pair
    cache = make_prompt_cache(target)
    target(mx.array([[1, 2, 3]]), cache=cache)
    before = snapshot(cache)
    rows = mx.zeros((1, 2, 1, 16))
    with pytest.raises(
        CacheDiscontinuity, match="layer 0 expected logical position 3, got 5"
    ):
        cache[0].write(5, rows, rows)
    assert_unchanged(cache, before)


def test_prompt_cache_from_another_model_is_refused(pair):
    target, draft = pair
    other = tiny_model("muse_glimmer", seed=2, num_key_value_heads=1, window=8)
    cache = primed_cache(target, draft)
    foreign = make_prompt_cache(other) + cache[len(target.layers) :]
    before = snapshot(cache)
    with pytest.raises(
        IncompatibleCache, match="window 8 but the model's layer has window 16"
    ):
        list(
            dflash.speculative_generate_step(
                mx.array([1, 2]), target, draft, prompt_cache=foreign
            )
        )
    assert_unchanged(cache, before)
    # Same layout, different head geometry: refused by the row shape.
    wide = tiny_model("muse_glimmer", seed=3, num_key_value_heads=1)
    wide_cache = make_prompt_cache(wide)
    wide(mx.array([[1, 2, 3]]), cache=wide_cache)
    with pytest.raises(IncompatibleCache, match="KV heads"):
        list(dflash.generate_step(mx.array([4]), target, prompt_cache=wide_cache))


def test_mlx_lm_caches_are_refused(pair):
    from mlx_lm.models.cache import make_prompt_cache as mlx_make_prompt_cache

    target, draft = pair
    cache = mlx_make_prompt_cache(target) + mlx_make_prompt_cache(draft)
    with pytest.raises(IncompatibleCache, match="dflash.cache.make_prompt_cache"):
        list(
            dflash.speculative_generate_step(
                mx.array([1, 2]), target, draft, prompt_cache=cache
            )
        )


def test_negative_draft_count_is_refused(pair):
    target, draft = pair
    cache = primed_cache(target, draft)
    before = snapshot(cache)
    with pytest.raises(ValueError, match="num_draft_tokens must be >= 0, got -1"):
        next(
            dflash.speculative_generate_step(
                mx.array([1]), target, draft, num_draft_tokens=-1, prompt_cache=cache
            )
        )
    assert_unchanged(cache, before)


@pytest.mark.parametrize("prompt", [mx.array([], mx.uint32), []])
def test_empty_prompt_is_refused(pair, prompt):
    target, draft = pair
    cache = primed_cache(target, draft)
    before = snapshot(cache)
    with pytest.raises(ValueError, match="prompt is empty"):
        next(
            dflash.speculative_generate_step(prompt, target, draft, prompt_cache=cache)
        )
    with pytest.raises(ValueError, match="prompt is empty"):
        next(
            dflash.generate_step(
                prompt, target, prompt_cache=cache[: len(target.layers)]
            )
        )
    assert_unchanged(cache, before)


def test_caches_at_different_positions_are_refused(pair):
    target, draft = pair
    cache = make_prompt_cache(target) + make_prompt_cache(draft)
    target(mx.array([[1, 2, 3]]), cache=cache[: len(target.layers)])
    with pytest.raises(IncompatibleCache, match="different positions"):
        next(
            dflash.speculative_generate_step(
                mx.array([4]), target, draft, prompt_cache=cache
            )
        )


def test_quantized_cache_option_is_refused(pair):
    target, _ = pair
    with pytest.raises(ValueError, match="kv_bits"):
        next(dflash.generate_step(mx.array([1, 2]), target, kv_bits=4))


def counting(model):
    """Wrap ``model`` so the test can tell whether any forward ran."""
    calls = []
    original = type(model).__call__

    class Counted(type(model)):
        def __call__(self, *args, **kwargs):
            calls.append(1)
            return original(self, *args, **kwargs)

    model.__class__ = Counted
    return calls


@pytest.mark.parametrize("bad", [256, 1_000_000, -1])
@pytest.mark.parametrize("mode", ["plain", "classic", "dflash", "stream"])
def test_token_ids_outside_the_vocabulary_are_refused_before_any_forward(bad, mode):
    from test_dflash_loop import random_drafter

    target = tiny_model("muse_glimmer", seed=0)
    draft = tiny_model("muse_glimmer", seed=1, num_hidden_layers=3)
    drafter = random_drafter(target, seed=2, block_size=4)
    calls = counting(target)
    prompt = mx.array([3, 4, bad, 5], mx.int32)
    cache = make_prompt_cache(target)
    if mode == "plain":
        steps = dflash.generate_step(prompt, target, prompt_cache=cache)
    elif mode == "classic":
        steps = dflash.speculative_generate_step(
            prompt, target, draft, prompt_cache=cache + make_prompt_cache(draft)
        )
    elif mode == "dflash":
        steps = dflash.dflash_generate_step(prompt, target, drafter, prompt_cache=cache)
    else:
        from conftest import tiny_tokenizer

        steps = dflash.stream_generate(
            target, tiny_tokenizer(), prompt.tolist(), prompt_cache=cache
        )
    with pytest.raises(
        ValueError, match=f"token id {bad} is outside the vocabulary.*size 256"
    ):
        next(steps)
    assert calls == [] and all(c.offset == 0 for c in cache)
