"""The demo-pair training code: corpus split, tokenizer, shards, resumable loop, and a
DFlash objective whose forward is the inference drafter's forward."""

import json

import mlx.core as mx
import numpy as np
import pytest
from conftest import tiny_model
from hypothesis import given
from hypothesis import strategies as st
from mlx.utils import tree_flatten
from test_dflash_loop import MASK, random_drafter

from dflash.taps import TargetTaps
from training import corpus, objective
from training.analyze_tau import is_repeat, lookup_accepted
from training.loop import Trainer, TrainSettings, learning_rate
from training.shards import load_shards, save_shards
from training.train_drafter import chained_rounds


def make_drafter(target, block_size=4, window=8, seed=3, **overrides):
    """The loop tests' random drafter, with a full layer between two sliding ones."""
    layers = ("sliding_attention", "full_attention", "sliding_attention")
    fields = dict(num_hidden_layers=3, layer_types=layers, sliding_window=window)
    fields.update(overrides)
    return random_drafter(target, seed=seed, block_size=block_size, **fields)


def features_of(target, layer_ids, tokens):
    with TargetTaps(target, layer_ids) as taps:
        target(tokens)
        return taps.pop()


@pytest.mark.parametrize("causal", [False, True])
def test_training_forward_equals_inference_drafter_per_anchor(causal):
    target = tiny_model("muse_glimmer", seed=1)
    drafter = make_drafter(target, is_causal=causal)
    tokens = mx.random.randint(2, 250, (2, 24), key=mx.random.key(5))
    features = features_of(target, drafter.config.target_layer_ids, tokens)
    # Anchors before, at and past the sliding window, so window masking is exercised.
    anchors = mx.array([[1, 7, 13, 20], [3, 9, 16, 19]], dtype=mx.int32)
    trained = objective.block_logits(drafter, features, tokens, anchors)
    for row in range(2):
        for j, anchor in enumerate(anchors[row].tolist()):
            context = drafter.make_context()
            drafter.append_context(context, features[row : row + 1, :anchor], 0)
            block = mx.array([[tokens[row, anchor].item()] + [MASK] * 3])
            expected = drafter(block, context)[0]
            assert mx.allclose(
                trained[row, j], expected, atol=2e-4, rtol=1e-4
            ).item(), (row, anchor, mx.abs(trained[row, j] - expected).max().item())


def test_training_forward_sees_no_context_at_or_after_its_anchor():
    target = tiny_model("muse_glimmer", seed=1)
    drafter = make_drafter(target)
    tokens = mx.random.randint(2, 250, (1, 20), key=mx.random.key(2))
    features = features_of(target, drafter.config.target_layer_ids, tokens)
    anchors = mx.array([[10]], dtype=mx.int32)
    before = objective.block_logits(drafter, features, tokens, anchors)
    changed = features.at[:, 10:].add(5.0)
    after = objective.block_logits(drafter, changed, tokens, anchors)
    assert mx.array_equal(before, after).item()
    earlier = features.at[:, 9:10].add(5.0)
    assert not mx.allclose(
        objective.block_logits(drafter, earlier, tokens, anchors), before
    )


def test_position_weights_follow_the_dflash_decay():
    weights = objective.position_weights(16, 7.0).tolist()
    assert weights[0] == 0.0 and weights[1] == pytest.approx(1.0)
    assert weights[8] == pytest.approx(np.exp(-1.0), rel=1e-6)


def test_dflash_loss_equals_weighted_cross_entropy_by_hand():
    target = tiny_model("muse_glimmer", seed=1)
    drafter = make_drafter(target)
    tokens = mx.random.randint(2, 250, (1, 16), key=mx.random.key(9))
    features = features_of(target, drafter.config.target_layer_ids, tokens)
    anchors = mx.array([[3, 8]], dtype=mx.int32)
    logits = objective.block_logits(drafter, features, tokens, anchors)
    weights = objective.position_weights(4).tolist()
    total = 0.0
    for j, anchor in enumerate([3, 8]):
        for i in range(1, 4):
            logprobs = logits[0, j, i] - mx.logsumexp(logits[0, j, i])
            total += -weights[i] * logprobs[tokens[0, anchor + i]].item()
    expected = total / (sum(weights) * 2)
    got = objective.dflash_loss(drafter, features, tokens, anchors).item()
    assert got == pytest.approx(expected, rel=1e-5)


@given(
    batch=st.integers(1, 4),
    count=st.integers(1, 8),
    low=st.integers(0, 20),
    span=st.integers(0, 40),
    seed=st.integers(0, 2**16),
)
def test_anchors_are_distinct_sorted_and_in_range(batch, count, low, span, seed):
    rng = np.random.default_rng(seed)
    high = low + span
    if span + 1 < count:
        with pytest.raises(ValueError):
            objective.sample_anchors(rng, batch, count, low, high)
        return
    anchors = objective.sample_anchors(rng, batch, count, low, high)
    assert anchors.shape == (batch, count)
    for row in anchors:
        assert list(row) == sorted(set(row.tolist()))
        assert row.min() >= low and row.max() <= high


@given(accepted=st.lists(st.integers(0, 15), min_size=1, max_size=60))
def test_replayed_rounds_anchor_where_the_previous_round_committed(accepted):
    rounds = chained_rounds(np.array(accepted), first=7)
    anchor = 0
    for count in rounds:
        # Each round reads the acceptance at its own anchor, then moves past its commits.
        assert count == accepted[anchor]
        anchor += count + 1
    assert anchor >= len(accepted)
    assert anchor - rounds[-1] - 1 < len(accepted)  # the last round started inside


def test_replayed_rounds_bound_tau_by_one_and_the_block():
    assert chained_rounds(np.zeros(10, np.int32), first=0) == [0] * 10
    assert chained_rounds(np.full(33, 15), first=0) == [15, 15, 15]


def test_prompt_lookup_copies_what_followed_the_first_match():
    tokens = [5, 6, 7, 8, 5, 6, 7, 9, 5, 6, 7, 8]
    # Suffix [7, 9, 5, 6]'s last 3 tokens [9, 5, 6] never occurred; [5, 6] first did at
    # 0..1, so the drafts are 7, 8, 5, ... and the sequence continues 7, 8: 2 accepted.
    assert lookup_accepted(tokens, 9, drafts=15) == 2
    assert lookup_accepted(tokens, 9, drafts=1) == 1
    assert lookup_accepted([1, 2, 3, 4], 2, drafts=15) == 0  # nothing to copy


@given(
    tokens=st.lists(st.integers(0, 3), min_size=2, max_size=40),
    data=st.data(),
)
def test_prompt_lookup_only_copies_known_tokens_after_a_match(tokens, data):
    anchor = data.draw(st.integers(0, len(tokens) - 1))
    accepted = lookup_accepted(tokens, anchor, drafts=15)
    assert 0 <= accepted <= min(15, anchor, len(tokens) - 1 - anchor)
    if accepted:
        proposed = tokens[anchor + 1 : anchor + 1 + accepted]
        assert any(
            tokens[end] == tokens[anchor]
            and end + accepted <= anchor
            and tokens[end + 1 : end + 1 + accepted] == proposed
            for end in range(anchor)
        )


def test_repeat_rounds_are_spans_already_seen():
    tokens = [1, 2, 3, 9, 1, 2, 3, 4]
    assert is_repeat(tokens, 3, span=3)  # 1, 2, 3 came before
    assert not is_repeat(tokens, 4, span=3)  # 2, 3, 4 did not


def test_heldout_split_is_a_hash_of_the_path_and_about_five_percent():
    paths = [f"pkg{i}/module{j}.py" for i in range(40) for j in range(50)]
    held = [p for p in paths if corpus.is_heldout(p)]
    assert 0.035 < len(held) / len(paths) < 0.065
    assert held == [p for p in reversed(paths) if corpus.is_heldout(p)][::-1]


def test_corpus_lists_sorted_py_files_and_skips_site_packages(tmp_path):
    for name in ["b.py", "a.py", "sub/c.py", "site-packages/x/d.py", "notes.txt"]:
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text("x = 1\n")
    (tmp_path / "latin.py").write_bytes("s = 'caf\xe9'\n".encode("latin-1"))
    files = corpus.list_files(tmp_path)
    assert [f.relative_path for f in files] == ["a.py", "b.py", "latin.py", "sub/c.py"]
    assert corpus.read_source(tmp_path / "latin.py") == "s = 'caf\xe9'\n"


def test_tokenizer_has_special_ids_and_round_trips(tmp_path):
    from mlx_lm.tokenizer_utils import load as load_tokenizer

    from training.tokenizer import END_OF_TEXT, MASK, save_tokenizer, train_tokenizer

    texts = ["def add(a, b):\n    return a + b\n"] * 20 + ["class A:\n    pass\n"] * 20
    tokenizer = train_tokenizer(texts, vocab_size=300)
    save_tokenizer(tokenizer, tmp_path)
    assert tokenizer.token_to_id(END_OF_TEXT) == 0 and tokenizer.token_to_id(MASK) == 1
    wrapped = load_tokenizer(tmp_path, eos_token_ids=[0])
    text = "def add(x, y):\n    return x * y  # café\n"
    assert wrapped.decode(wrapped.encode(text)) == text


def test_shards_stay_under_the_limit_and_round_trip(tmp_path):
    arrays = {f"w{i}": mx.random.normal((64, 64)) for i in range(7)}
    names = save_shards(arrays, tmp_path, "params", max_bytes=3 * 64 * 64 * 4)
    assert len(names) == 3
    for name in names:
        assert (tmp_path / name).stat().st_size < 3 * 64 * 64 * 4 + 4096
    loaded = load_shards(tmp_path, "params")
    assert all(mx.array_equal(loaded[k], v).item() for k, v in arrays.items())
    with pytest.raises(ValueError, match="exceeds a shard"):
        save_shards({"big": mx.zeros((100, 100))}, tmp_path, "x", max_bytes=1000)


def test_learning_rate_warms_up_then_decays_to_the_floor():
    s = TrainSettings(peak_lr=1.0, warmup_steps=10, min_lr_ratio=0.1)
    assert learning_rate(s, 0, 100) == pytest.approx(0.1)
    assert learning_rate(s, 9, 100) == pytest.approx(1.0)
    assert learning_rate(s, 100, 100) == pytest.approx(0.1)
    assert learning_rate(s, 55, 100) == pytest.approx(0.55)


def _tiny_training(folder, total_steps):
    from training.train_target import build_target, next_token_loss, sample_windows

    config = {
        "model_type": "muse_glimmer",
        "hidden_size": 32,
        "num_hidden_layers": 4,
        "intermediate_size": 64,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "head_dim": 16,
        "vocab_size": 64,
        "sliding_window": 8,
        "tie_word_embeddings": True,
    }
    mx.random.seed(0)
    model = build_target(config)
    settings = TrainSettings(
        batch_size=2,
        seq_len=12,
        warmup_steps=2,
        total_steps=6,
        checkpoint_every=100,
        log_every=3,
        eval_every=0,
    )
    tokens = np.random.default_rng(0).integers(0, 64, 500).astype(np.uint16)

    def batch_fn(step):
        window = mx.array(sample_windows(tokens, step, 2, 13, 0))
        return window[:, :-1], window[:, 1:]

    trainer = Trainer(model, next_token_loss, settings, folder)
    trainer.resume()
    stop_after = total_steps - trainer.step
    for _ in range(stop_after):
        trainer.train_step(*batch_fn(trainer.step))
    trainer.save()
    return model


def test_resumed_training_equals_uninterrupted_training(tmp_path):
    straight = _tiny_training(tmp_path / "a", 6)
    _tiny_training(tmp_path / "b", 3)
    resumed = _tiny_training(tmp_path / "b", 6)
    progress = json.loads((tmp_path / "b" / "progress.json").read_text())
    assert progress["step"] == 6
    for (name, a), (_, b) in zip(
        tree_flatten(straight.parameters()), tree_flatten(resumed.parameters())
    ):
        assert mx.array_equal(a, b).item(), name


def test_prompt_sources_are_deterministic_and_alternate_when_mixed():
    from training.distill import prompt_sampler

    tokens = np.arange(1000, dtype=np.uint16)
    functions = np.full((5, 8), 7, dtype=np.uint16)
    windows = prompt_sampler("windows", tokens, None, 8, 3, seed=1)
    assert windows(4).shape == (3, 8) and np.array_equal(windows(4), windows(4))
    assert all(np.array_equal(row, np.arange(row[0], row[0] + 8)) for row in windows(4))
    mixed = prompt_sampler("mixed", tokens, functions, 8, 3, seed=1)
    assert np.array_equal(mixed(0), windows(0)) and (mixed(1) == 7).all()
    with pytest.raises(ValueError, match="unknown prompt source"):
        prompt_sampler("poems", tokens, None, 8, 3, seed=1)
