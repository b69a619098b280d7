"""Target taps: recorded layer outputs, clean detach, mlx-lm models left untouched."""

from __future__ import annotations

from types import SimpleNamespace

import mlx.core as mx
import pytest
from conftest import recorded_async_evals, tiny_model
from mlx.utils import tree_flatten
from mlx_lm.models import llama, muse_glimmer
from mlx_lm.models.base import create_attention_mask
from mlx_lm.models.cache import make_prompt_cache

from dflash.taps import TargetTaps, target_layers

LAYERS = 8
TOKENS = mx.array([[3, 17, 5, 99, 42, 7, 7, 250, 1, 64, 128, 9]])


def build(family: str):
    # A window shorter than the prompt exercises the sliding masks too.
    extra = {}
    if family == "qwen3":
        extra = dict(tie_word_embeddings=False, max_position_embeddings=512)
    return tiny_model(family, seed=21, window=8, num_hidden_layers=LAYERS, **extra)


def manual_layer_outputs(model, tokens):
    """Each decoder layer's output, running the layers by hand as the model would."""
    inner = model.model
    h = inner.embed_tokens(tokens)
    if isinstance(model, muse_glimmer.Model):
        h = mx.fast.rms_norm(h, None, inner.embed_eps)
        masks = inner._masks(h, [None] * LAYERS)
    else:
        masks = [create_attention_mask(h, None)] * LAYERS
    outputs = []
    for layer, mask in zip(inner.layers, masks):
        h = layer(h, mask, None)
        outputs.append(h)
    return outputs


FAMILIES = ["muse_glimmer", "qwen3", "llama"]


@pytest.mark.parametrize("family", FAMILIES)
def test_taps_equal_manual_layer_outputs(family):
    model = build(family)
    ids = (6, 1, 4)
    expected = manual_layer_outputs(model, TOKENS)
    with TargetTaps(model, ids) as taps:
        model(TOKENS)
        got = taps.pop()
    want = mx.concatenate([expected[i] for i in ids], axis=-1)
    assert got.shape == (1, TOKENS.shape[1], 3 * 64)
    assert mx.allclose(got, want, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("family", FAMILIES)
def test_detach_restores_class_parameters_and_outputs(family):
    model = build(family)
    layers = target_layers(model)
    classes = [type(layer) for layer in layers]
    names = [name for name, _ in tree_flatten(model.parameters())]
    before = model(TOKENS)
    taps = TargetTaps(model, (0, 3, 7))
    taps.attach()
    assert type(layers[3]) is not classes[3]
    assert isinstance(layers[3], classes[3])
    assert [name for name, _ in tree_flatten(model.parameters())] == names
    assert mx.array_equal(model(TOKENS), before)
    taps.detach()
    assert [type(layer) for layer in layers] == classes
    assert mx.array_equal(model(TOKENS), before)


@pytest.mark.parametrize("family", FAMILIES)
def test_taps_follow_chunked_cached_forwards(family):
    model = build(family)
    ids = (1, 5)
    with TargetTaps(model, ids) as taps:
        model(TOKENS)
        whole = taps.pop()
        cache = make_prompt_cache(model)
        model(TOKENS[:, :7], cache=cache)
        first = taps.pop()
        model(TOKENS[:, 7:], cache=cache)
        second = taps.pop()
    assert mx.allclose(
        mx.concatenate([first, second], axis=1), whole, atol=1e-5, rtol=1e-5
    )


def test_pop_order_duplicates_and_clearing():
    model = build("qwen3")
    expected = manual_layer_outputs(model, TOKENS)
    with TargetTaps(model, (4, 1, 4)) as taps:
        model(TOKENS)
        got = taps.pop()
        with pytest.raises(RuntimeError, match="no recorded output"):
            taps.pop()
    want = mx.concatenate([expected[4], expected[1], expected[4]], axis=-1)
    assert mx.allclose(got, want, atol=1e-6, rtol=1e-6)


def test_invalid_layer_ids_and_double_tapping():
    model = build("llama")
    with pytest.raises(ValueError, match=r"\[8\] out of range .* 8 layers"):
        TargetTaps(model, (1, 8))
    with pytest.raises(ValueError, match=r"\[-1\]"):
        TargetTaps(model, (-1,))
    with TargetTaps(model, (2,)):
        with pytest.raises(RuntimeError, match="already tapped"):
            TargetTaps(model, (2, 3)).attach()
    assert type(model.layers[2]) is llama.TransformerBlock


def test_context_manager_detaches_on_error():
    model = build("muse_glimmer")
    with pytest.raises(KeyError):
        with TargetTaps(model, (0,)):
            raise KeyError("boom")
    assert type(model.layers[0]) is muse_glimmer.DecoderLayer


def test_start_early_launches_each_tapped_output_and_keeps_the_values(monkeypatch):
    model = build("muse_glimmer")
    ids = (5, 1, 3)
    with TargetTaps(model, ids) as taps:
        want_logits = model(TOKENS)
        want = taps.pop()
    started = recorded_async_evals(monkeypatch, "dflash.taps")
    with TargetTaps(model, ids, start_early=True) as taps:
        logits = model(TOKENS)
        got = taps.pop()
    # One launch per tapped layer, in layer order, each the recorded hidden state.
    assert len(started) == len(ids)
    assert all(a.shape == (1, TOKENS.shape[1], 64) for a in started)
    assert mx.array_equal(got, want).item()
    assert mx.array_equal(logits, want_logits).item()


@pytest.mark.parametrize("every", [1, 3, 4, 8, 9])
def test_eval_every_starts_paced_layers_too_and_keeps_every_value(monkeypatch, every):
    """Paced layers only start their output: the records (tapped layers only), the
    logits and the classes after detach are those of plain taps."""
    model = build("muse_glimmer")
    ids = (5, 1, 3)
    with TargetTaps(model, ids, start_early=True) as taps:
        want_logits = model(TOKENS)
        want = taps.pop()
    started = recorded_async_evals(monkeypatch, "dflash.taps")
    outputs = manual_layer_outputs(model, TOKENS)
    with TargetTaps(model, ids, start_early=True, eval_every=every) as taps:
        logits = model(TOKENS)
        got = taps.pop()
        assert sorted(taps._records) == []  # popped: only the tapped were recorded
    paced = set(range(every - 1, LAYERS, every)) | set(ids)
    assert len(started) == len(paced)
    # In layer order, each the output of its layer.
    for array, index in zip(started, sorted(paced)):
        assert mx.array_equal(array, outputs[index]).item()
    assert mx.array_equal(got, want).item()
    assert mx.array_equal(logits, want_logits).item()
    assert all(type(layer) is muse_glimmer.DecoderLayer for layer in model.layers)


def test_eval_every_without_start_early_swaps_only_the_tapped_layers():
    model = build("muse_glimmer")
    with TargetTaps(model, (2,), eval_every=2):
        swapped = [
            type(layer) is not muse_glimmer.DecoderLayer for layer in model.layers
        ]
    assert swapped == [index == 2 for index in range(LAYERS)]


def test_negative_eval_every_is_refused():
    with pytest.raises(ValueError, match="eval_every"):
        TargetTaps(build("muse_glimmer"), (1,), start_early=True, eval_every=-1)


@pytest.mark.parametrize(
    "every, tail, paced",
    [
        (4, False, set(range(3, 52, 4))),
        (4, True, {41, 45}),  # session 37's measured arm: the last gap in pieces
        (3, True, {40, 43, 46}),  # and 49, a tap
        (0, True, set()),
    ],
)
def test_eval_tail_paces_only_the_last_two_gaps_between_starts(every, tail, paced):
    """Glimmer's 52 layers with its drafter's taps: which layers start early."""
    layers = SimpleNamespace(layers=[object() for _ in range(52)])
    taps = (1, 13, 25, 37, 49)
    got = TargetTaps(layers, taps, start_early=True, eval_every=every, eval_tail=tail)
    assert got._swapped == sorted(set(taps) | paced)


def test_eval_tail_with_fewer_than_three_starts_paces_every_layer():
    layers = SimpleNamespace(layers=[object() for _ in range(12)])
    got = TargetTaps(layers, (11,), start_early=True, eval_every=5, eval_tail=True)
    assert got._swapped == [4, 9, 11]


def test_unpaced_taps_start_only_the_tapped_layers_and_keep_every_value(monkeypatch):
    """``paced`` (switched per round by a run-time pacing rule) turns the paced layers'
    starts off and on without a new attach; the values never change."""
    model = build("muse_glimmer")
    ids = (5, 1)
    started = recorded_async_evals(monkeypatch, "dflash.taps")
    with TargetTaps(model, ids, start_early=True, eval_every=2) as taps:
        counts, logits = [], []
        for paced in (False, True, False):
            taps.paced = paced
            before = len(started)
            logits.append(model(TOKENS))
            taps.pop()
            counts.append(len(started) - before)
    every_other = set(range(1, LAYERS, 2)) | set(ids)
    assert counts == [len(ids), len(every_other), len(ids)]
    assert all(mx.array_equal(out, logits[0]).item() for out in logits[1:])
