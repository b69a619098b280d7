"""The DFlash draft/verify loop: lossless greedy output, full acceptance, exact sampling."""

from types import SimpleNamespace

import mlx.core as mx
import numpy as np
import pytest
from conftest import (
    TINY_DFLASH2,
    assert_lossless,
    greedy_reference,
    recorded_async_evals,
    tiny_drafter_config,
    tiny_model,
)
from hypothesis import given, settings
from hypothesis import strategies as st

from dflash import (
    GenerationStats,
    dflash_generate_step,
    dflash_round,
    make_prompt_cache,
)
from dflash.drafter import DFlashDrafter
from dflash.rounds import round_size
from dflash.sampling import make_sampler
from dflash.verify.acceptance import rejection_accept

MASK = 255


def random_drafter(target, seed=7, block_size=8, **overrides):
    layers = len(target.layers)
    taps = (1, layers // 2, layers - 1)
    fields = dict(block_size=block_size, mask_token_id=MASK, target_layer_ids=taps)
    config = tiny_drafter_config(**{**fields, **overrides})
    mx.random.seed(seed)
    drafter = DFlashDrafter(config)
    mx.eval(drafter.parameters())
    drafter.bind(target)
    return drafter


class OracleDrafter:
    """Proposes the target's own greedy continuation: every draft is accepted."""

    def __init__(self, sequence, block_size, target_layer_ids):
        self.sequence = sequence
        self.config = SimpleNamespace(
            block_size=block_size,
            mask_token_id=MASK,
            target_layer_ids=target_layer_ids,
            has_candidate_selector=False,
        )

    def make_context(self, bucket_keys=None):
        return SimpleNamespace(offset=0, buffers=lambda: [])

    def append_context(self, context, target_hidden, start_position):
        assert start_position == context.offset, "context must grow contiguously"
        context.offset += target_hidden.shape[1]

    def __call__(self, block_tokens, context):
        size = block_tokens.shape[1]
        # Block position i sits at absolute position context.offset + i.
        wanted = self.sequence[context.offset + 1 : context.offset + size]
        logits = mx.full((1, size, 256), -10.0)
        for i, token in enumerate(wanted, start=1):
            logits[0, i, token] = 10.0
        return logits


@pytest.mark.parametrize("arch", ["muse_glimmer", "qwen3"])
@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("block_size", [4, 16])
def test_greedy_output_equals_target_greedy(arch, seed, block_size):
    target = tiny_model(arch, seed=seed, window=16)
    drafter = random_drafter(target, seed=seed + 10, block_size=block_size)
    prompt = mx.random.randint(0, 250, (19,))
    reference = greedy_reference(
        target, prompt, 70
    )  # 89 positions: 5 wraps of a 16-row ring
    stats = GenerationStats(block_size)
    output = [
        t
        for t, _, _ in dflash_generate_step(
            prompt, target, drafter, max_tokens=70, stats=stats
        )
    ]
    assert_lossless(target, prompt, reference, output)
    assert stats.rounds >= 1 and 1.0 <= stats.tau <= block_size


@pytest.mark.parametrize("every, tail", [("1", "0"), ("3", "0"), ("2", "1")])
def test_layers_started_early_keep_the_greedy_output(monkeypatch, every, tail):
    """``DFLASH_EVAL_EVERY`` (and ``DFLASH_EVAL_TAIL``) change only when layers start
    on the device."""
    monkeypatch.setenv(dflash_round.EVAL_EVERY_ENV, every)
    monkeypatch.setenv(dflash_round.EVAL_TAIL_ENV, tail)
    target = tiny_model("muse_glimmer", seed=2, window=16)
    drafter = random_drafter(target, seed=12, block_size=8)
    prompt = mx.random.randint(0, 250, (19,), key=mx.random.key(3))
    reference = greedy_reference(target, prompt, 40)
    output = [
        t for t, _, _ in dflash_generate_step(prompt, target, drafter, max_tokens=40)
    ]
    assert_lossless(target, prompt, reference, output)


@pytest.mark.parametrize("every", ["0", "4"])
def test_the_context_append_is_started_at_each_settle(monkeypatch, every):
    monkeypatch.setenv(dflash_round.EVAL_EVERY_ENV, every)
    target = tiny_model("muse_glimmer", seed=2, window=16)
    drafter = random_drafter(target, seed=12, block_size=8)
    cache = make_prompt_cache(target, drafter)
    started = recorded_async_evals(monkeypatch, "dflash.dflash_round")
    stats = GenerationStats(8)
    prompt = mx.random.randint(0, 250, (19,), key=mx.random.key(3))
    steps = dflash_generate_step(
        prompt, target, drafter, max_tokens=30, prompt_cache=cache, stats=stats
    )
    list(steps)
    buffers = cache.drafter_context.buffers()
    assert len(buffers) == 2 * len(drafter.layers)
    appends = [s for s in started if isinstance(s, list) and len(s) == len(buffers)]
    # One a settled round (the generation's last settle may write only its last token).
    assert stats.rounds <= len(appends) <= stats.rounds + 1
    # The last settle's append is what the context holds now.
    assert all(a is b for a, b in zip(appends[-1], buffers))


@pytest.mark.parametrize(
    "name, bad",
    [
        (dflash_round.EVAL_EVERY_ENV, "-1"),
        (dflash_round.EVAL_EVERY_ENV, "two"),
        (dflash_round.EVAL_EVERY_ENV, "1.5"),
        (dflash_round.EVAL_TAIL_ENV, "maybe"),
    ],
)
def test_a_bad_eval_switch_is_refused_naming_the_variable(monkeypatch, name, bad):
    monkeypatch.setenv(name, bad)
    target = tiny_model("muse_glimmer", seed=0)
    with pytest.raises(ValueError, match=name):
        next(dflash_generate_step(mx.array([1, 2]), target, random_drafter(target)))


@pytest.mark.parametrize("block_size", [2, 5, 16])
def test_oracle_drafter_is_fully_accepted_every_round(block_size):
    target = tiny_model("muse_glimmer", seed=4, window=16)
    prompt = mx.random.randint(0, 250, (19,))
    reference = greedy_reference(target, prompt, 64)
    drafter = OracleDrafter(prompt.tolist() + reference, block_size, (1, 4, 7))
    stats = GenerationStats(block_size)
    steps = list(
        dflash_generate_step(prompt, target, drafter, max_tokens=64, stats=stats)
    )
    assert [t for t, _, _ in steps] == reference
    full_rounds = stats.accepted[:-1]  # the last round may be cut by max_tokens
    assert all(n == block_size - 1 for n in full_rounds)
    assert stats.tau > block_size - 1
    # Every round ends with the target's own (bonus) token.
    assert [d for _, _, d in steps[:block_size]] == [True] * (block_size - 1) + [False]


class RecordingOracle(OracleDrafter):
    """The oracle drafter, keeping the block size of every draft call."""

    def __init__(self, *args):
        super().__init__(*args)
        self.sizes = []

    def __call__(self, block_tokens, context):
        self.sizes.append(block_tokens.shape[1])
        return super().__call__(block_tokens, context)


@settings(max_examples=12, deadline=None)
@given(
    block_size=st.integers(2, 9),
    max_tokens=st.integers(1, 30),
    limited=st.booleans(),
)
def test_rounds_keep_the_full_block_to_the_end_and_the_caches_end_at_the_tokens(
    block_size, max_tokens, limited
):
    """Every round drafts a whole block, also the rounds near ``max_tokens``, unless the
    caches' ``max_context`` leaves less room (then a round takes what fits and none
    overflows); the output is the target's greedy one, the caches end holding exactly
    the prompt and the emitted tokens, and the stats count only emitted drafts."""
    target = tiny_model("muse_glimmer", seed=4, window=16)
    prompt = mx.random.randint(0, 250, (11,))
    reference = greedy_reference(target, prompt, max_tokens)
    drafter = RecordingOracle(prompt.tolist() + reference, block_size, (1, 4, 7))
    limit = prompt.size + max_tokens if limited else None
    cache = make_prompt_cache(target, drafter=drafter, max_context=limit)
    stats = GenerationStats(block_size)
    steps = list(
        dflash_generate_step(
            prompt, target, drafter, max_tokens=max_tokens, prompt_cache=cache,
            stats=stats,
        )
    )  # fmt: skip
    assert [t for t, _, _ in steps] == reference
    assert all(layer.offset == prompt.size + max_tokens for layer in cache)
    assert cache.drafter_context.offset == prompt.size + max_tokens
    assert sum(stats.accepted) == sum(d for _, _, d in steps)
    if not limited:
        assert drafter.sizes and set(drafter.sizes) == {block_size}
    else:
        # A round's rows never pass the limit: the last ones shrink to the room.
        positions = prompt.size + np.cumsum([0] + [a + 1 for a in stats.accepted])
        assert all(
            size <= limit - start + 1 for size, start in zip(drafter.sizes, positions)
        )


@given(
    block_size=st.integers(1, 32),
    max_tokens=st.integers(-1, 64),
    emitted=st.integers(0, 64),
    room=st.none() | st.integers(1, 64),
)
def test_round_size_keeps_the_block_where_it_fits(
    block_size, max_tokens, emitted, room
):
    """A full round is ``block_size`` unless the room is smaller, never less than the
    rows the tokens left need; an unfull one is what the tokens left need."""
    needed = round_size(block_size, max_tokens, emitted)
    full = round_size(block_size, max_tokens, emitted, True, room)
    assert 1 <= needed <= block_size and needed <= full <= block_size
    if max_tokens >= 0:
        assert needed == max(1, min(block_size, max_tokens - emitted + 1))
    if room is None or room >= block_size or max_tokens < 0:
        assert full == block_size
    else:
        assert full == max(needed, room)


def chi_square(counts, probs):
    expected = np.asarray(probs) * np.sum(counts)
    keep = expected > 0
    return float(
        np.sum((np.asarray(counts)[keep] - expected[keep]) ** 2 / expected[keep])
    )


CRITICAL_DF5_P001 = 20.52  # chi-square, 5 degrees of freedom, p = 0.001


def test_rejection_sampling_reproduces_the_target_distribution():
    p = np.array([[0.5, 0.2, 0.1, 0.1, 0.05, 0.05], [0.1, 0.1, 0.5, 0.1, 0.1, 0.1]])
    q = np.array([[0.05, 0.05, 0.3, 0.3, 0.2, 0.1]])
    target, draft = mx.log(mx.array(p)), mx.log(mx.array(q))
    rng = np.random.default_rng(0)
    first = np.zeros(6)
    biased = np.zeros(6)
    for i in range(4000):
        d = int(rng.choice(6, p=q[0]))
        _, tokens = rejection_accept(target, draft, mx.array([d]), key=mx.random.key(i))
        first[tokens[0].item()] += 1  # the draft if kept, else the resampled token
        biased[d] += 1  # "always accept": what a broken rule would emit
    assert chi_square(first, p[0]) < CRITICAL_DF5_P001
    assert chi_square(biased, p[0]) > 10 * CRITICAL_DF5_P001  # the test can tell


@pytest.mark.parametrize("kind", ["dflash", "classic"])
def test_sampling_at_temperature_matches_the_target(kind):
    """The first two tokens, read from each run, follow the target's own law.

    The second token comes either from an accepted draft or from a one-token round (the
    round that used to crash), so its marginal checks both paths of rejection sampling.
    """
    import dflash

    # Small models: the test's cost is 800 whole generations.
    target = tiny_model(
        "muse_glimmer", seed=5, window=16, vocab_size=6, num_hidden_layers=3
    )
    drafter = random_drafter(target, seed=6, block_size=4, mask_token_id=5)
    draft = tiny_model(
        "muse_glimmer", seed=6, window=16, vocab_size=6, num_hidden_layers=2
    )
    prompt = mx.array([1, 2, 3, 4, 0, 1, 2])

    def next_probs(tokens):
        logits = target(mx.array(tokens)[None])[0, -1]
        return np.array(mx.softmax(logits.astype(mx.float32)))

    first_probs = next_probs(prompt.tolist())
    second_probs = sum(
        first_probs[i] * next_probs(prompt.tolist() + [i]) for i in range(6)
    )
    first, second = np.zeros(6), np.zeros(6)
    sampler = make_sampler(temp=1.0)
    mx.random.seed(11)
    for _ in range(800):
        if kind == "dflash":
            steps = dflash_generate_step(
                prompt, target, drafter, max_tokens=2, sampler=sampler
            )
        else:
            steps = dflash.speculative_generate_step(
                prompt, target, draft, num_draft_tokens=3, max_tokens=2, sampler=sampler
            )
        (a, _, _), (b, _, _) = list(steps)
        first[a] += 1
        second[b] += 1
    assert chi_square(first, first_probs) < CRITICAL_DF5_P001
    assert chi_square(second, second_probs) < CRITICAL_DF5_P001


def test_bad_block_size_and_empty_prompt_are_refused():
    target = tiny_model("muse_glimmer", seed=0)
    drafter = random_drafter(target)
    with pytest.raises(ValueError, match="block_size"):
        next(dflash_generate_step(mx.array([1, 2]), target, drafter, block_size=0))
    with pytest.raises(ValueError, match="prompt is empty"):
        next(dflash_generate_step(mx.array([], mx.uint32), target, drafter))


# ------------------------------------------------------------ temperature > 0, every length
B = 4
LENGTHS = [1, 2, B - 1, B, B + 1, 3 * B + 2]


@pytest.fixture(scope="module")
def sampled_setup():
    target = tiny_model("muse_glimmer", seed=2, window=16)
    draft = tiny_model("muse_glimmer", seed=3, window=16, num_hidden_layers=3)
    drafters = {
        "dflash": random_drafter(target, seed=4, block_size=B),
        "dflash2": random_drafter(target, seed=5, block_size=B, **TINY_DFLASH2),
    }
    prompt = mx.random.randint(0, 250, (19,))
    reference = greedy_reference(target, prompt, max(LENGTHS))
    return target, draft, drafters, prompt, reference


def run_generator(kind, setup, sampler, block, max_tokens):
    import dflash

    target, draft, drafters, prompt, _ = setup
    if kind == "classic":
        steps = dflash.speculative_generate_step(
            prompt,
            target,
            draft,
            num_draft_tokens=block - 1,
            max_tokens=max_tokens,
            sampler=sampler,
        )
    else:
        steps = dflash_generate_step(
            prompt,
            target,
            drafters[kind],
            block_size=block,
            max_tokens=max_tokens,
            sampler=sampler,
        )
    return list(steps)  # every token is read


def point_mass_samplers():
    """Temperature 0.7 restricted to the top token: the output must be the greedy one."""
    from mlx_lm.sample_utils import make_sampler as mlx_make_sampler

    return {
        "dflash": make_sampler(temp=0.7, top_k=1),
        "mlx_lm": mlx_make_sampler(temp=0.7, top_k=1),
    }


@pytest.mark.parametrize("kind", ["dflash", "dflash2", "classic"])
@pytest.mark.parametrize("sampler_kind", ["dflash", "mlx_lm"])
@pytest.mark.parametrize("block", [1, 2, B])
def test_sampled_generation_reads_every_length(
    sampled_setup, kind, sampler_kind, block
):
    """Temperature > 0 over the whole length range: no crash, and lossless where it is exact.

    A top-1 filter makes the target's distribution a point mass at its argmax, so rejection
    sampling (dflash's sampler) and the sample-match rule (mlx-lm's) must both reproduce the
    greedy output token for token, through rounds of every size including one-token rounds.
    """
    target, _, _, prompt, reference = sampled_setup
    sampler = point_mass_samplers()[sampler_kind]
    for max_tokens in LENGTHS:
        steps = run_generator(kind, sampled_setup, sampler, block, max_tokens)
        output = [token for token, _, _ in steps]
        assert_lossless(target, prompt, reference[:max_tokens], output)
        assert all(logprobs.shape == (256,) for _, logprobs, _ in steps)
        if block == 1:
            assert not any(from_draft for _, _, from_draft in steps)


@pytest.mark.parametrize("kind", ["dflash", "dflash2", "classic"])
def test_free_sampling_yields_every_requested_token(sampled_setup, kind):
    from mlx_lm.sample_utils import make_sampler as mlx_make_sampler

    mx.random.seed(1)
    for sampler in (make_sampler(temp=0.7), mlx_make_sampler(temp=0.7)):
        for block in (1, 2, B):
            for max_tokens in LENGTHS:
                output = [
                    t
                    for t, _, _ in run_generator(
                        kind, sampled_setup, sampler, block, max_tokens
                    )
                ]
                assert len(output) == max_tokens
                assert all(0 <= t < 256 for t in output)
