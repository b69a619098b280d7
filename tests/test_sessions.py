"""Turn-by-turn sessions: after any generation ends the caches hold what mlx-lm's would.

mlx-lm's plain ``generate_step`` yields a token only once it is in the cache, so after a
generation that stops by ``max_tokens``, at an end-of-sequence token or because the consumer
closed the generator, its cache holds the prompt and every yielded token. Every dflash
generator (plain, classic draft model, DFlash) must leave its caches (target, draft model,
drafter context) exactly there, so the next turn, given only its new tokens, continues the
same conversation as mlx-lm's own.
"""

import mlx.core as mx
import numpy as np
import pytest
from conftest import mlx_lm_generate_module, tiny_model, tiny_tokenizer, top2_margin
from hypothesis import given, settings
from hypothesis import strategies as st
from mlx_lm.models.cache import make_prompt_cache as mlx_make_prompt_cache
from mlx_lm.tokenizer_utils import TokenizerWrapper
from test_dflash_loop import MASK, OracleDrafter, random_drafter

import dflash
from dflash.taps import TargetTaps

MLX = mlx_lm_generate_module()
BLOCK = 4


class TranscriptDrafter(OracleDrafter):
    """Proposes the target's own continuation from a transcript the test keeps, wrong at every
    ``miss``-th absolute position, so rounds both accept and reject drafts."""

    def __init__(self, layer_ids, miss):
        super().__init__([], BLOCK, layer_ids)
        self.transcript = []
        self.miss = miss

    def __call__(self, block_tokens, context):
        size = block_tokens.shape[1]
        logits = mx.full((1, size, 256), -10.0)
        for i in range(1, size):
            position = context.offset + i  # block row i sits at this absolute position
            token = self.transcript[position] if position < len(self.transcript) else 1
            if position % self.miss == 0:
                token = (token + 1) % 256
            logits[0, i, token] = 10.0
        return logits


@pytest.fixture(scope="module")
def models():
    target = tiny_model("muse_glimmer", seed=0, window=16)
    small = tiny_model("muse_glimmer", seed=1, window=16, num_hidden_layers=3)
    return target, small


def mlx_turn(model, cache, prompt, stop):
    """mlx-lm's own turn: its ``generate_step`` (or ``stream_generate`` for an EOS stop)."""
    mode, value = stop
    if mode == "eos":
        tokenizer = TokenizerWrapper(tiny_tokenizer(), eos_token_ids=[value])
        responses = MLX.stream_generate(
            model, tokenizer, prompt, max_tokens=64, prompt_cache=cache
        )
        return [r.token for r in responses]
    steps = MLX.generate_step(
        prompt, model, max_tokens=value if mode == "max" else 64, prompt_cache=cache
    )
    return take(steps, value if mode == "close" else None)


def take(steps, count):
    """Read ``count`` tokens (all when ``None``) and close the generator, as a consumer does."""
    tokens = []
    for step in steps:
        tokens.append(int(step[0]))
        if len(tokens) == count:
            break
    steps.close()
    return tokens


def our_turn(kind, models, session, prompt, stop):
    target, small = models
    mode, value = stop
    extra = {}
    if kind == "classic":
        extra["draft_model"] = session["draft"]
        extra["num_draft_tokens"] = BLOCK - 1
    elif kind == "dflash":
        extra["drafter"] = session["drafter"]
    if mode == "eos":
        tokenizer = TokenizerWrapper(tiny_tokenizer(), eos_token_ids=[value])
        responses = dflash.stream_generate(
            target,
            tokenizer,
            prompt,
            max_tokens=64,
            prompt_cache=session["cache"],
            **extra,
        )
        return [r.token for r in responses]
    max_tokens = value if mode == "max" else 64
    cache = session["cache"]
    if kind == "plain":
        steps = dflash.generate_step(
            prompt, target, max_tokens=max_tokens, prompt_cache=cache
        )
    elif kind == "classic":
        steps = dflash.speculative_generate_step(
            prompt,
            target,
            extra["draft_model"],
            num_draft_tokens=BLOCK - 1,
            max_tokens=max_tokens,
            prompt_cache=cache,
        )
    else:
        steps = dflash.dflash_generate_step(
            prompt, target, extra["drafter"], max_tokens=max_tokens, prompt_cache=cache
        )
    return take(steps, value if mode == "close" else None)


def new_session(kind, models, draft_kind, miss):
    target, small = models
    session = {}
    if kind == "plain":
        session["cache"] = dflash.make_prompt_cache(target)
    elif kind == "classic":
        session["draft"] = target if draft_kind == "self" else small
        session["cache"] = dflash.make_prompt_cache(target) + dflash.make_prompt_cache(
            session["draft"]
        )
    else:
        session["drafter"] = TranscriptDrafter((1, 4, 7), miss)
        session["cache"] = dflash.make_prompt_cache(target, drafter=session["drafter"])
    return session


def positions(kind, models, session):
    """``(target offset, offset of what sits beside it)`` of a session."""
    layers = len(models[0].layers)
    cache = session["cache"]
    target = cache[0].offset
    if kind == "classic":
        return target, {c.offset for c in cache[layers:]}
    if kind == "dflash":
        return target, {cache.drafter_context.offset}
    return target, {target}


def continuation(model, history, count):
    """The greedy continuation after ``history`` (a fresh mlx-lm cache)."""
    steps = MLX.generate_step(mx.array(history), model, max_tokens=count)
    return [int(t) for t, _ in steps]


stops = st.one_of(
    st.tuples(st.just("max"), st.integers(1, 14)),
    st.tuples(st.just("close"), st.integers(1, 14)),
    st.tuples(st.just("eos"), st.integers(0, 10)),  # EOS = the token at this index
)
turns = st.lists(
    st.tuples(st.lists(st.integers(1, 255), min_size=1, max_size=20), stops),
    min_size=2,
    max_size=3,
)


@pytest.mark.parametrize("kind", ["plain", "classic", "dflash"])
@settings(max_examples=10)
@given(
    plan=turns, draft_kind=st.sampled_from(["self", "small"]), miss=st.integers(2, 5)
)
def test_turns_leave_the_caches_where_mlx_lm_leaves_its_own(
    models, kind, plan, draft_kind, miss
):
    target, _ = models
    session = new_session(kind, models, draft_kind, miss)
    reference_cache = mlx_make_prompt_cache(target)
    history = []
    for prompt, stop in plan:
        if stop[0] == "eos":
            ahead = continuation(target, history + prompt, stop[1] + 1)
            stop = ("eos", ahead[-1])
        if kind == "dflash":
            drafter = session["drafter"]
            drafter.transcript = (
                history + prompt + continuation(target, history + prompt, 80)
            )
        want = mlx_turn(target, reference_cache, mx.array(prompt), stop)
        got = our_turn(kind, models, session, mx.array(prompt), stop)
        if got != want:
            # Only a near-tie may part the two (the comparison ends there).
            index = next(i for i, (a, b) in enumerate(zip(got, want)) if a != b)
            assert top2_margin(target, history + prompt + want[:index]) < 1e-4, (
                got,
                want,
            )
            return
        history += prompt + want
        offset, beside = positions(kind, models, session)
        assert offset == reference_cache[0].offset == len(history)
        assert beside == {offset}


@pytest.mark.parametrize("kind", ["classic", "dflash"])
@pytest.mark.parametrize("count", [1, 2, 3, 4, 5, 7])
def test_closing_inside_a_round_keeps_exactly_the_yielded_rows(models, kind, count):
    """Closing after each position of a fully accepted round (drafts, then the bonus)."""
    target, _ = models
    session = new_session(kind, models, "self", miss=10**6)  # every draft is right
    prompt = list(range(3, 22))
    if kind == "dflash":
        session["drafter"].transcript = prompt + continuation(target, prompt, 40)
    tokens = our_turn(kind, models, session, mx.array(prompt), ("close", count))
    assert len(tokens) == count
    offset, beside = positions(kind, models, session)
    assert offset == len(prompt) + count and beside == {offset}


def test_a_non_empty_cache_without_a_drafter_context_is_refused(models):
    target, _ = models
    drafter = TranscriptDrafter((1, 4, 7), miss=3)
    cache = dflash.make_prompt_cache(target)
    list(
        dflash.generate_step(
            mx.array([5, 6, 7]), target, max_tokens=2, prompt_cache=cache
        )
    )
    with pytest.raises(ValueError, match="holds 5 tokens but no drafter context"):
        next(
            dflash.dflash_generate_step(
                mx.array([8]), target, drafter, prompt_cache=cache
            )
        )


def test_a_stale_drafter_context_is_refused(models):
    target, _ = models
    drafter = TranscriptDrafter((1, 4, 7), miss=3)
    cache = dflash.make_prompt_cache(target, drafter=drafter)
    list(
        dflash.dflash_generate_step(
            mx.array([5, 6, 7]), target, drafter, max_tokens=2, prompt_cache=cache
        )
    )
    list(dflash.generate_step(mx.array([9]), target, max_tokens=2, prompt_cache=cache))
    with pytest.raises(
        dflash.cache.IncompatibleCache, match="drafter context is at position 5"
    ):
        next(
            dflash.dflash_generate_step(
                mx.array([8]), target, drafter, prompt_cache=cache
            )
        )


def test_the_drafter_context_of_a_session_is_the_one_a_fresh_prefill_builds(models):
    """A real drafter: after two turns (the first closed mid-round) its context equals the
    context built from the whole history at once, seen through the drafter's logits."""
    target, _ = models
    drafter = random_drafter(target, seed=9, block_size=BLOCK)
    cache = dflash.make_prompt_cache(target, drafter=drafter)
    first = take(
        dflash.dflash_generate_step(
            mx.array(list(range(3, 30))), target, drafter, prompt_cache=cache
        ),
        9,
    )
    second = take(
        dflash.dflash_generate_step(
            mx.array([40, 41, 42]), target, drafter, prompt_cache=cache, max_tokens=6
        ),
        None,
    )
    history = list(range(3, 30)) + first + [40, 41, 42] + second
    fresh = drafter.make_context()
    with TargetTaps(target, drafter.config.target_layer_ids) as taps:
        target(mx.array(history)[None])
        drafter.append_context(fresh, taps.pop(), start_position=0)
    session = cache.drafter_context
    assert session.offset == fresh.offset == len(history)
    probe = mx.array([[history[-1]] + [MASK] * (BLOCK - 1)])
    np.testing.assert_allclose(
        np.array(drafter(probe, session)),
        np.array(drafter(probe, fresh)),
        atol=1e-4,
        rtol=1e-4,
    )
