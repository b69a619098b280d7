"""The planes as mlx-lm caches: mlx-lm's own model files run on them unchanged."""

import mlx.core as mx
import numpy as np
import pytest
from conftest import greedy_reference, tiny_model

import dflash
from dflash.cache import (
    GrowingKVCache,
    IncompatibleCache,
    RingKVCache,
    make_prompt_cache,
)
from dflash.verify.reference import make_reference_cache

ARCHS = ["muse_glimmer", "gemma3_text", "gpt_oss", "cohere2", "qwen3", "llama"]
CHUNKS = [19, 1, 1, 16, 5, 30, 1, 17, 2]


@pytest.mark.parametrize("arch", ARCHS)
def test_chunked_forward_matches_the_full_history_oracle(arch):
    model = tiny_model(arch, window=16)
    tokens = mx.random.randint(0, 256, (1, sum(CHUNKS)))
    want = model(tokens, cache=make_reference_cache(model))
    cache = make_prompt_cache(model)
    outputs, position = [], 0
    for count in CHUNKS:
        outputs.append(model(tokens[:, position : position + count], cache=cache))
        position += count
    got = mx.concatenate(outputs, axis=1)
    np.testing.assert_allclose(np.array(got), np.array(want), rtol=1e-4, atol=1e-4)
    for plane in cache:
        assert plane.offset == position
        if isinstance(plane, RingKVCache):
            assert plane.keys.shape[2] == 16  # the ring never grows past its window


@pytest.mark.parametrize("arch", ARCHS)
def test_make_prompt_cache_mirrors_the_models_own_cache(arch):
    from mlx_lm.models.cache import RotatingKVCache

    model = tiny_model(arch, window=16)
    ours = make_prompt_cache(model, max_context=1000)
    for plane, theirs in zip(
        ours, model.make_cache() if hasattr(model, "make_cache") else ours
    ):
        if isinstance(theirs, RotatingKVCache):
            assert isinstance(plane, RingKVCache) and plane.capacity == 16
        else:
            assert isinstance(plane, GrowingKVCache) and plane.max_context == 1000


def test_plain_decode_matches_mlx_lm(glimmer):
    prompt = mx.random.randint(0, 256, (21,))
    want = greedy_reference(glimmer, prompt, 60)
    got = [token for token, _ in dflash.generate_step(prompt, glimmer, max_tokens=60)]
    assert got == want


def test_state_round_trip_replays_bitwise(glimmer):
    cache = make_prompt_cache(glimmer)
    tokens = mx.random.randint(0, 256, (1, 41))
    glimmer(tokens, cache=cache)
    restored = [type(c).from_state(c.state, c.meta_state) for c in cache]
    for c in restored:
        c.keys, c.values = mx.array(c.keys), mx.array(c.values)  # own buffers
    step = mx.array([[5]])
    a, b = glimmer(step, cache=cache), glimmer(step, cache=restored)
    assert np.array_equal(np.array(a), np.array(b))
    assert [c.meta_state for c in cache] == [c.meta_state for c in restored]


def test_protocol_surface(glimmer):
    cache = make_prompt_cache(glimmer)
    assert all(c.empty() and c.nbytes == 0 and c.size() == 0 for c in cache)
    glimmer(mx.random.randint(0, 256, (1, 40)), cache=cache)
    ring, growing = cache[0], cache[3]
    assert ring.size() == 16 and growing.size() == 40
    assert (
        ring.nbytes == 2 * 16 * 2 * 16 * 4
    )  # K+V, 16 rows, 2 heads x 16 dims, float32
    assert not ring.is_trimmable() and growing.is_trimmable()
    with pytest.raises(ValueError, match="cannot trim"):
        ring.trim(2)
    assert growing.trim(3) == 3 and growing.offset == 37


def test_unsupported_caches_are_refused():
    class Quantized:
        layers = [0]

        def make_cache(self):
            from mlx_lm.models.cache import QuantizedKVCache

            return [QuantizedKVCache()]

    with pytest.raises(IncompatibleCache, match="QuantizedKVCache"):
        make_prompt_cache(Quantized())
