"""Lossless: speculative output equals the target's own greedy output across window wraps."""

import mlx.core as mx
import pytest
from conftest import (
    assert_lossless,
    greedy_reference,
    mlx_lm_generate_module,
    tiny_model,
)

import dflash

WINDOW = 16
PROMPT = 19
GENERATED = 70  # (19 + 70) / 16: the ring wraps at least four times


@pytest.mark.parametrize("arch", ["muse_glimmer", "gemma3_text", "gpt_oss"])
@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("num_draft_tokens", [1, 4, 7])
def test_speculative_output_equals_target_greedy(arch, seed, num_draft_tokens):
    target = tiny_model(arch, seed=seed, window=WINDOW)
    draft = tiny_model(arch, seed=seed + 100, window=WINDOW, num_hidden_layers=3)
    prompt = mx.random.randint(0, 256, (PROMPT,))
    reference = greedy_reference(target, prompt, GENERATED)
    steps = dflash.speculative_generate_step(
        prompt, target, draft, num_draft_tokens=num_draft_tokens, max_tokens=GENERATED
    )
    output = [token for token, _, _ in steps]
    assert_lossless(target, prompt, reference, output)


def test_self_draft_accepts_every_token_and_stays_lossless():
    target = tiny_model("muse_glimmer", seed=3, window=WINDOW)
    prompt = mx.random.randint(0, 256, (PROMPT,))
    reference = greedy_reference(target, prompt, 50)
    steps = list(
        dflash.speculative_generate_step(
            prompt, target, target, num_draft_tokens=5, max_tokens=50
        )
    )
    assert_lossless(target, prompt, reference, [token for token, _, _ in steps])
    # Every round accepts all 5 drafts plus the target's own token.
    assert [from_draft for _, _, from_draft in steps[:12]] == [True] * 5 + [False] + [
        True
    ] * 5 + [False]


def test_mlx_lm_speculative_decoding_diverges_on_the_same_setup():
    """The bug this project fixes: mlx-lm keeps rejected rows once the ring has wrapped."""
    target = tiny_model("muse_glimmer", seed=0, window=WINDOW)
    draft = tiny_model("muse_glimmer", seed=100, window=WINDOW, num_hidden_layers=3)
    prompt = mx.random.randint(0, 256, (PROMPT,))
    reference = greedy_reference(target, prompt, GENERATED)
    theirs = mlx_lm_generate_module().speculative_generate_step(
        prompt, target, draft, num_draft_tokens=4, max_tokens=GENERATED
    )
    theirs = [token for token, _, _ in theirs]
    ours = [
        token
        for token, _, _ in dflash.speculative_generate_step(
            prompt, target, draft, num_draft_tokens=4, max_tokens=GENERATED
        )
    ]
    assert theirs != reference
    assert_lossless(target, prompt, reference, ours)
