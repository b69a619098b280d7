"""The bundled demo pair as shipped: layout, size, formats, and lossless generation."""

import json
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from conftest import assert_lossless
from mlx.utils import tree_flatten

import dflash
from dflash import GenerationStats, dflash_generate_step
from dflash.demo import DEMO_DIR
from dflash.greedy import greedy_reference

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def demo():
    return dflash.load_demo()


def test_demo_pair_fits_the_package_budget():
    files = [p for p in DEMO_DIR.rglob("*") if p.is_file()]
    assert sum(p.stat().st_size for p in files) <= 30 * 1024 * 1024
    # Every file came back from the GPU machine, where one file may be at most 16 MB.
    assert max(p.stat().st_size for p in files) < 16 * 1024 * 1024


def test_demo_target_is_a_small_muse_glimmer_whose_window_wraps(demo):
    model, _, _ = demo
    args = model.args
    assert args.model_type == "muse_glimmer" and args.sliding_window == 256
    assert args.layer_types[:4] == ["sliding_attention"] * 3 + ["full_attention"]
    parameters = sum(v.size for _, v in tree_flatten(model.parameters()))
    assert 10_000_000 <= parameters <= 30_000_000


def test_demo_drafter_is_an_assistant_checkpoint_bound_to_the_demo_tokenizer(demo):
    _, tokenizer, drafter = demo
    config = json.loads((DEMO_DIR / "drafter" / "config.json").read_text())
    assert config["architectures"] == ["MuseGlimmerAssistantModel"]
    assert config["block_size"] == 16
    assert config["mask_token_id"] == tokenizer.convert_tokens_to_ids("<|mask|>")
    assert drafter.config.target_layer_ids == (1, 3, 5, 7)


def test_packaged_prompts_are_the_held_out_set():
    packaged = (DEMO_DIR / "bench-prompts.jsonl").read_text()
    assert packaged == (REPO / "configs" / "bench" / "heldout.jsonl").read_text()


def test_demo_generation_equals_the_target_greedy_output_past_the_window(demo):
    model, tokenizer, drafter = demo
    record = json.loads((DEMO_DIR / "bench-prompts.jsonl").read_text().splitlines()[0])
    prompt = mx.array(tokenizer.encode(record["prompt"]))
    assert prompt.size + 40 > model.args.sliding_window  # the ring wraps
    stats = GenerationStats(16)
    output = [
        t
        for t, *_ in dflash_generate_step(
            prompt, model, drafter, max_tokens=40, stats=stats
        )
    ]
    reference = greedy_reference(model, prompt, 40)
    assert_lossless(model, prompt, reference, output)
    assert stats.rounds < 40  # some drafts were accepted


def test_replayed_decode_tau_equals_the_rounds_of_real_decoding(demo):
    # training.train_drafter's decode_tau replays rounds from one teacher-forced pass
    # over the target's greedy output; it must see what real decoding sees.
    from training.train_drafter import FeatureSource, accepted_lengths, chained_rounds

    model, tokenizer, drafter = demo
    record = json.loads((DEMO_DIR / "bench-prompts.jsonl").read_text().splitlines()[1])
    prompt = mx.array(tokenizer.encode(record["prompt"]))
    size, new_tokens = drafter.config.block_size, 48
    stats = GenerationStats(size)
    for _ in dflash_generate_step(
        prompt, model, drafter, max_tokens=new_tokens, stats=stats
    ):
        pass
    row = mx.concatenate(
        [prompt, mx.array(greedy_reference(model, prompt, new_tokens + size))]
    )[None]
    features = FeatureSource(model, drafter.config.target_layer_ids)
    try:
        first = prompt.size - 1
        anchors = mx.arange(first, row.shape[1] - size + 1)[None]
        accepted = accepted_lengths(drafter, features(row), row, anchors)
    finally:
        features.taps.detach()
    replayed = chained_rounds(np.array(accepted[0]), first)
    full_rounds, emitted = 0, 0
    for count in stats.accepted:
        if new_tokens - emitted < size:
            break  # real decoding shortens its last blocks to fit max_tokens
        full_rounds += 1
        emitted += count + 1
    assert full_rounds >= 4
    assert replayed[:full_rounds] == stats.accepted[:full_rounds]
