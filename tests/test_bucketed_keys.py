"""Bucketed keys: attention over key lengths rounded up to whole buckets, padding masked out.

Forced on here (the default is on with CUDA only, see ``dflash.cache.plane.resolve_bucket_keys``).
On mlx's CPU backend the bucketed attention is bitwise the live-rows attention, so every
comparison below is exact.
"""

import mlx.core as mx
import numpy as np
import pytest
from conftest import assert_lossless, greedy_reference, tiny_model
from hypothesis import given, settings
from hypothesis import strategies as st
from test_dflash_loop import MASK, random_drafter

import dflash.cache.caches as caches_module
import dflash.cache.plane as plane_module
import dflash.drafter as drafter_module
from dflash import dflash_generate_step
from dflash.cache import GrowingKVCache, RingKVCache, SpeculativeCheckpoint
from dflash.cache.plane import KEY_BUCKET, bucketable, resolve_bucket_keys

HEADS, KV_HEADS, DIM = 4, 2, 8


def rows(rng, count, dtype=mx.float32):
    shape = (1, KV_HEADS, count, DIM)
    return mx.array(rng.standard_normal(shape).astype(np.float32)).astype(dtype)


def make_cache(kind, bucket_keys, window=None, max_context=None):
    if kind == "ring":
        return RingKVCache(window, max_context, bucket_keys=bucket_keys)
    return GrowingKVCache(max_context, bucket_keys=bucket_keys)


def attend(cache, queries, keys, values, window=None):
    """One mlx-lm attention step: mask first (as the models do), then write and read."""
    count = keys.shape[2]
    mask = cache.make_mask(count, window_size=window)
    keys, values = cache.update_and_fetch(keys, values)
    out = mx.fast.scaled_dot_product_attention(
        queries, keys, values, scale=DIM**-0.5, mask=mask
    )
    return out, mask, keys


def bits(array):
    return np.array(array.astype(mx.float32))


def test_the_switch_takes_the_default_unless_forced(monkeypatch):
    for default in (True, False):
        monkeypatch.setattr(plane_module, "BUCKET_KEYS_BY_DEFAULT", default)
        assert resolve_bucket_keys(None) is default
        assert GrowingKVCache().bucket_keys is default
    assert resolve_bucket_keys(True) is True and resolve_bucket_keys(False) is False
    assert GrowingKVCache(bucket_keys=True).bucket_keys
    assert not RingKVCache(16, bucket_keys=False).bucket_keys


@pytest.mark.parametrize("told, want", [("0", False), ("off", False), ("1", True)])
def test_the_environment_overrides_the_default(monkeypatch, told, want):
    monkeypatch.setenv(plane_module.BUCKET_KEYS_ENV, told)
    assert plane_module._bucket_keys_by_default() is want


def test_without_an_override_the_default_is_on_with_cuda_only(monkeypatch):
    monkeypatch.delenv(plane_module.BUCKET_KEYS_ENV, raising=False)
    on_cuda = bool(getattr(mx, "cuda", None) and mx.cuda.is_available())
    assert plane_module._bucket_keys_by_default() is on_cuda


@settings(max_examples=40)
@given(
    kind=st.sampled_from(["growing", "ring"]),
    window=st.sampled_from([16, 300, 600]),
    max_context=st.sampled_from([None, 700]),
    chunks=st.lists(
        st.one_of(st.integers(1, 20), st.sampled_from([63, 64, 65, 200, 257])),
        min_size=1,
        max_size=12,
    ),
    dtype=st.sampled_from([mx.float32, mx.bfloat16]),
    with_window_mask=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_bucketed_attention_is_bitwise_the_live_rows_attention(
    kind, window, max_context, chunks, dtype, with_window_mask, seed
):
    rng = np.random.default_rng(seed)
    live = make_cache(kind, False, window, max_context)
    bucketed = make_cache(kind, True, window, max_context)
    # A growing cache may be asked for a window mask (mlx-lm's window_size argument).
    mask_window = window if (kind == "ring" or with_window_mask) else None
    for count in chunks:
        if max_context is not None and live.offset + count > max_context:
            break
        keys, values = rows(rng, count, dtype), rows(rng, count, dtype)
        queries = mx.array(
            rng.standard_normal((1, HEADS, count, DIM)).astype(np.float32)
        ).astype(dtype)
        padded = bucketed.bucketed(count)  # asked before the write, like make_mask
        want, _, want_keys = attend(live, queries, keys, values, mask_window)
        got, mask, got_keys = attend(bucketed, queries, keys, values, mask_window)
        np.testing.assert_array_equal(bits(got), bits(want))
        if padded:
            assert mask.shape == (count, got_keys.shape[2])
            end = got_keys.shape[2]
            assert end % KEY_BUCKET == 0 or end == bucketed.capacity
        else:
            assert got_keys.shape == want_keys.shape
    assert live.meta == bucketed.meta


BOUNDARY_LENS = sorted(
    {n for edge in (0, 256, 512) for n in range(max(0, edge - 20), edge + 4)}
)
COUNTS = list(range(1, 21)) + [63, 64, 65, 300]


@pytest.mark.parametrize("kind", ["growing", "ring"])
@pytest.mark.parametrize("max_context", [None, 530])
def test_make_mask_predicts_the_shape_update_and_fetch_returns(kind, max_context):
    rng = np.random.default_rng(0)
    history = rows(rng, max(BOUNDARY_LENS))
    bucket = lambda n: -(-n // KEY_BUCKET)
    checked = crossed = 0
    for length in BOUNDARY_LENS:
        for count in COUNTS:
            if max_context is not None and length + count > max_context:
                continue
            cache = make_cache(kind, True, window=400, max_context=max_context)
            if length:
                cache.update_and_fetch(history[:, :, :length], history[:, :, :length])
            bucketed, predicted = cache.bucketed(count), cache.key_rows(count)
            before = cache.len
            mask = cache.make_mask(count, window_size=cache.window)
            keys, _ = cache.update_and_fetch(rows(rng, count), rows(rng, count))
            assert keys.shape[2] == predicted, (length, count)
            if isinstance(mask, mx.array):
                assert mask.shape[-2:] == (count, predicted), (length, count)
            if bucketed:
                assert isinstance(mask, mx.array) and predicted >= cache.len
                assert predicted % KEY_BUCKET == 0 or predicted == cache.capacity
                checked += 1
                crossed += bucket(before) != bucket(cache.len)
            else:
                assert not bucketable(count) or kind == "ring"
    assert checked > 300 and crossed > 20


def test_the_prediction_holds_after_a_trim_and_when_the_write_opens_a_bucket():
    rng = np.random.default_rng(1)
    cache = GrowingKVCache(bucket_keys=True)
    cache.update_and_fetch(rows(rng, 250), rows(rng, 250))
    assert cache.make_mask(16).shape == (
        16,
        512,
    )  # 266 live rows: the write opens a bucket
    keys, _ = cache.update_and_fetch(rows(rng, 16), rows(rng, 16))
    assert keys.shape[2] == 512 and cache.capacity == 512
    cache.trim(30)  # storage stays at 512 rows, the live rows drop back to bucket one
    assert cache.make_mask(2).shape == (2, 256)
    keys, _ = cache.update_and_fetch(rows(rng, 2), rows(rng, 2))
    assert keys.shape[2] == 256


@pytest.mark.parametrize("kind", ["growing", "ring"])
def test_single_query_steps_and_prompt_chunks_read_the_live_rows(kind):
    """A decode step keeps mlx's maskless vector attention; prefill keeps "causal"."""
    rng = np.random.default_rng(2)
    cache = make_cache(kind, True, window=400)
    assert cache.make_mask(100) == "causal"
    keys, _ = cache.update_and_fetch(rows(rng, 100), rows(rng, 100))
    assert keys.shape[2] == 100
    assert cache.make_mask(1) is None
    keys, _ = cache.update_and_fetch(rows(rng, 1), rows(rng, 1))
    assert keys.shape[2] == 101
    assert cache.make_mask(3).shape == (3, 256)


@settings(max_examples=60)
@given(
    kind=st.sampled_from(["growing", "ring"]),
    start_len=st.integers(0, 600),
    block=st.integers(1, 20),
    cut=st.one_of(st.none(), st.integers(1, 19)),
    seed=st.integers(0, 2**16),
)
def test_commit_under_bucketed_keys_equals_sequential_append(
    kind, start_len, block, cut, seed
):
    """The checkpoint oracle with bucketing on: state and the next attention step match."""
    rng = np.random.default_rng(seed)
    history = (rows(rng, start_len), rows(rng, start_len))
    block_kv = (rows(rng, block), rows(rng, block))
    queries = mx.array(rng.standard_normal((1, HEADS, 1, DIM)).astype(np.float32))
    step = (rows(rng, 1), rows(rng, 1))
    pieces = (
        [slice(0, block)]
        if cut is None or cut >= block
        else [
            slice(0, cut),
            slice(cut, block),
        ]
    )

    def built(extra):
        cache = make_cache(kind, True, window=300)
        if start_len:
            cache.update_and_fetch(*history)
        if extra:
            cache.update_and_fetch(*(a[:, :, :extra] for a in block_kv))
        return cache

    for accepted in sorted({0, block // 2, block}):
        cache = built(0)
        checkpoint = SpeculativeCheckpoint.begin([cache], block)
        for piece in pieces:
            cache.make_mask(piece.stop - piece.start, window_size=cache.window)
            cache.update_and_fetch(*(a[:, :, piece] for a in block_kv))
        checkpoint.commit(accepted)
        expected = built(accepted)
        assert (cache.len, cache.origin_logical, cache.origin_physical) == (
            expected.len,
            expected.origin_logical,
            expected.origin_physical,
        )
        got, _, _ = attend(cache, queries, *step, cache.window)
        want, _, _ = attend(expected, queries, *step, expected.window)
        np.testing.assert_array_equal(bits(got), bits(want))


@pytest.fixture(scope="module")
def glimmer16():
    return tiny_model("muse_glimmer", seed=0, window=16)


@settings(max_examples=15)
@given(
    chunks=st.lists(st.integers(1, 150), min_size=1, max_size=6),
    block=st.integers(1, 16),
    sliding_window=st.sampled_from([8, 300]),
    is_causal=st.sampled_from([None, True, False]),
)
def test_drafter_logits_with_bucketed_context_equal_unbucketed(
    glimmer16, chunks, block, sliding_window, is_causal
):
    drafter = random_drafter(
        glimmer16, sliding_window=sliding_window, is_causal=is_causal
    )
    width = len(drafter.config.target_layer_ids) * glimmer16.args.hidden_size
    features = mx.random.normal((1, sum(chunks), width), key=mx.random.key(5))
    plain, bucketed = drafter.make_context(False), drafter.make_context(True)
    tokens = mx.array([[7] + [MASK] * (block - 1)])
    start = 0
    for count in chunks:
        for context in (plain, bucketed):
            drafter.append_context(context, features[:, start : start + count], start)
        start += count
        want, got = drafter(tokens, plain), drafter(tokens, bucketed)
        np.testing.assert_array_equal(np.array(got), np.array(want))
    live = start + block
    padded = -(-live // KEY_BUCKET) * KEY_BUCKET if bucketable(block) else live
    assert bucketed.planes[1].key_rows(block) == padded
    assert plain.planes[1].key_rows(block) == start + block


@pytest.mark.parametrize("arch", ["muse_glimmer", "gemma3_text"])
@pytest.mark.parametrize("prompt_len, window", [(19, 16), (230, 300)])
def test_dflash_greedy_output_is_lossless_with_bucketed_keys(
    monkeypatch, arch, prompt_len, window
):
    """With bucketing forced on everywhere (target planes and drafter context), DFlash's
    greedy output equals the target's own greedy output and the unbucketed run."""
    target = tiny_model(arch, seed=0, window=window)
    drafter = random_drafter(target, block_size=8)
    prompt = mx.random.randint(0, 250, (prompt_len,), key=mx.random.key(prompt_len))
    reference = greedy_reference(target, prompt, 70)

    def run():
        return [
            t
            for t, _, _ in dflash_generate_step(prompt, target, drafter, max_tokens=70)
        ]

    unbucketed = run()
    masks, block_masks = [], []
    original_mask, original_block_mask = (
        caches_module.bucketed_mask,
        drafter_module._block_mask,
    )

    def spy_mask(*args, **kwargs):
        masks.append(args)
        return original_mask(*args, **kwargs)

    def spy_block_mask(context_rows, block, window, causal, key_rows=None):
        block_masks.append(key_rows is not None and key_rows > context_rows + block)
        return original_block_mask(context_rows, block, window, causal, key_rows)

    monkeypatch.setattr(plane_module, "BUCKET_KEYS_BY_DEFAULT", True)
    monkeypatch.setattr(caches_module, "bucketed_mask", spy_mask)
    monkeypatch.setattr(drafter_module, "_block_mask", spy_block_mask)
    output = run()
    assert_lossless(target, prompt, reference, output)
    assert output == unbucketed
    # The bucketed path ran in the target (masks over padded keys) and in the drafter.
    assert any(rows > first + count for count, first, rows, *_ in masks)
    assert any(block_masks)
