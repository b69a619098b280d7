"""stream_generate / generate: mlx-lm's responses, drop-in, with speculative decoding."""

import mlx.core as mx
import pytest
from conftest import greedy_reference, tiny_model, tiny_tokenizer
from mlx_lm.generate import GenerationResponse

import dflash


@pytest.fixture
def setup():
    target = tiny_model("muse_glimmer", seed=0)
    draft = tiny_model("muse_glimmer", seed=1, num_hidden_layers=4)
    return target, draft, tiny_tokenizer()


def test_stream_generate_yields_mlx_lm_responses(setup):
    target, _, tokenizer = setup
    prompt = " ".join(f"w{i}" for i in range(5, 30))
    responses = list(
        # The target drafting for itself: every draft is accepted.
        dflash.stream_generate(
            target, tokenizer, prompt, max_tokens=40, draft_model=target
        )
    )
    assert all(isinstance(r, GenerationResponse) for r in responses)
    assert responses[-1].finish_reason in ("stop", "length")
    assert all(r.finish_reason is None for r in responses[:-1])
    tokens = [r.token for r in responses]
    reference = greedy_reference(target, mx.array(tokenizer.encode(prompt)), 40)
    assert tokens == reference[: len(tokens)]
    assert sum(r.from_draft for r in responses) >= len(tokens) // 2


def test_generate_with_and_without_draft_agree(setup):
    target, draft, tokenizer = setup
    prompt = " ".join(f"w{i}" for i in range(40, 70))
    plain = dflash.generate(target, tokenizer, prompt, max_tokens=30)
    speculative = dflash.generate(
        target, tokenizer, prompt, max_tokens=30, draft_model=draft, num_draft_tokens=3
    )
    assert plain == speculative and len(plain) > 0


def test_zero_max_tokens_is_refused(setup):
    target, _, tokenizer = setup
    with pytest.raises(ValueError, match="non-zero"):
        next(dflash.stream_generate(target, tokenizer, "w5", max_tokens=0))
