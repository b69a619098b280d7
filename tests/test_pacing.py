"""Pacing chosen at run time (``DFLASH_EVAL_EVERY=auto``): the order the arms are
explored in, the choice, which rounds are timed, and that every arm keeps the output."""

import gc
import statistics
import weakref

import mlx.core as mx
import pytest
from conftest import assert_lossless, greedy_reference, tiny_model
from hypothesis import given, settings
from hypothesis import strategies as st
from test_dflash_loop import random_drafter

from dflash import GenerationStats, dflash_generate_step, dflash_round, pacing
from dflash.pacing import (
    EXPLORE_ORDER,
    SAMPLES_PER_ARM,
    SKIPPED_PER_GENERATION,
    PacingChoice,
    RoundPacer,
    forget_pacing,
    pacing_choices,
)

round_times = st.floats(min_value=1e-4, max_value=1.0, allow_nan=False)


@settings(max_examples=60, deadline=None)
@given(
    st.lists(round_times, min_size=SAMPLES_PER_ARM, max_size=SAMPLES_PER_ARM + 6),
    st.lists(round_times, min_size=SAMPLES_PER_ARM, max_size=SAMPLES_PER_ARM + 6),
)
def test_the_arm_with_the_lower_median_round_is_chosen(unpaced, paced):
    """Rounds are fed in the exploring order; the choice is made the round the second
    arm reaches ``SAMPLES_PER_ARM`` and compares the medians of what was fed by then."""
    choice = PacingChoice()
    fed = {False: [], True: []}
    queues = {False: list(unpaced), True: list(paced)}
    # Neither arm needs more than SAMPLES_PER_ARM rounds before the choice.
    while choice.paced is None:
        arm = choice.next_arm()
        seconds = queues[arm].pop(0)
        fed[arm].append(seconds)
        choice.observe(arm, seconds)
    # The order alternates A B B A, so neither arm runs ahead by more than two rounds.
    assert abs(len(fed[False]) - len(fed[True])) <= 2
    assert choice.paced is not None
    assert min(len(fed[False]), len(fed[True])) == SAMPLES_PER_ARM
    want = statistics.median(fed[True]) < statistics.median(fed[False])
    assert choice.paced == want
    # Chosen: every later round takes that arm, and later times change nothing.
    launched = choice.launched
    assert [choice.next_arm() for _ in range(9)] == [want] * 9
    choice.observe(not want, 1e-9)
    assert choice.paced == want and choice.launched == launched


def test_exploring_follows_the_abba_order_until_chosen():
    choice = PacingChoice()
    arms = [choice.next_arm() for _ in range(8)]
    assert arms == list(EXPLORE_ORDER) * 2 == [False, True, True, False] * 2
    assert choice.paced is None and choice.summary()["paced"] is None


class FakeTaps:
    paced = True


def drive(pacer, sizes, cost, clock):
    """Launch rounds of ``sizes`` through ``pacer``; each round costs ``cost(arm)``
    seconds of ``clock`` until the next launch."""
    arms = []
    for size in sizes:
        pacer.start_round(size)
        arms.append(pacer.taps.paced)
        clock[0] += cost(pacer.taps.paced)
    return arms


@settings(max_examples=40, deadline=None)
@given(
    # Fewer full rounds than would make the choice (which stops the timing).
    st.lists(st.integers(1, 8), min_size=1, max_size=2 * SAMPLES_PER_ARM - 2),
    st.integers(1, 4),
)
def test_only_full_rounds_after_the_first_few_are_timed(sizes, paced_extra):
    """Each timed round is a full block launched after the first
    ``SKIPPED_PER_GENERATION`` of its generation, timed from its launch to the next,
    under the arm it ran with (a one-row error in which round is timed would show)."""
    clock = [100.0]
    choice = PacingChoice()
    pacer = RoundPacer(FakeTaps(), choice, block_size=8, clock=lambda: clock[0])
    assert pacer.taps.paced is False  # the prefill runs unpaced while exploring
    # A round's cost names its launch index and its arm.
    indices = iter(range(len(sizes)))
    arms = drive(
        pacer, sizes, lambda arm: cost_of(next(indices), arm, paced_extra), clock
    )
    want = {False: [], True: []}
    for index, size in enumerate(sizes[:-1]):  # the last round is never closed
        if size == 8 and index >= SKIPPED_PER_GENERATION:
            want[arms[index]].append(cost_of(index, arms[index], paced_extra))
    assert choice.seconds == want
    assert arms[: min(len(arms), 4)] == list(EXPLORE_ORDER)[: min(len(arms), 4)]


def cost_of(index, arm, paced_extra):
    return 1.0 + index + (1000.0 * paced_extra if arm else 0.0)


@pytest.mark.parametrize("paced_faster", [True, False])
def test_a_choice_spans_generations_and_takes_the_faster_arm(paced_faster):
    clock = [0.0]
    choice = PacingChoice()
    slow, fast = 2.0, 1.0

    def cost(arm):
        return fast if arm == paced_faster else slow

    generations = 0
    while choice.paced is None:
        pacer = RoundPacer(FakeTaps(), choice, block_size=4, clock=lambda: clock[0])
        drive(pacer, [4] * 7, cost, clock)  # 7 launches: 4 timed rounds a generation
        generations += 1
    assert choice.paced is paced_faster
    assert generations == pytest.approx(2 * SAMPLES_PER_ARM / 4, abs=1)
    later = RoundPacer(FakeTaps(), choice, block_size=4, clock=lambda: clock[0])
    assert later.taps.paced is paced_faster  # the prefill takes the choice too
    assert drive(later, [4, 4, 2], cost, clock) == [paced_faster] * 3


@pytest.mark.parametrize(
    "text, want",
    [
        ("", (0, False)),
        ("0", (0, False)),
        ("4", (4, False)),
        ("auto", (4, True)),
        ("AUTO", (4, True)),
        ("auto:3", (3, True)),
    ],
)
def test_eval_every_reads_counts_and_auto(monkeypatch, text, want):
    monkeypatch.setenv(dflash_round.EVAL_EVERY_ENV, text)
    assert dflash_round.eval_pacing() == want
    assert dflash_round.eval_every() == want[0]


@pytest.mark.parametrize("bad", ["auto:0", "auto:", "autox", "auto:-1", "auto:2.5"])
def test_a_bad_auto_setting_is_refused_with_nothing_left_tapped(monkeypatch, bad):
    monkeypatch.setenv(dflash_round.EVAL_EVERY_ENV, bad)
    target = tiny_model("muse_glimmer", seed=0)
    classes = [type(layer) for layer in target.layers]
    with pytest.raises(ValueError, match="DFLASH_EVAL_EVERY"):
        next(dflash_generate_step(mx.array([1, 2]), target, random_drafter(target)))
    assert [type(layer) for layer in target.layers] == classes
    assert pacing_choices(target) == {}


def run_auto(target, drafter, prompt, tokens):
    """One generation under ``auto``: its tokens and stats."""
    stats = GenerationStats(8)
    steps = dflash_generate_step(
        prompt, target, drafter, max_tokens=tokens, stats=stats
    )
    output = [t for t, _, _ in steps]
    return output, stats


def test_auto_pacing_keeps_the_greedy_output_through_both_arms_and_the_choice(
    monkeypatch,
):
    """Rounds alternate paced and unpaced while exploring, then take the choice; the
    output equals the target's greedy continuation in every generation (rings of 16
    rows wrap several times)."""
    monkeypatch.setenv(dflash_round.EVAL_EVERY_ENV, "auto:2")
    monkeypatch.setattr(pacing, "SAMPLES_PER_ARM", 3)
    target = tiny_model("muse_glimmer", seed=2, window=16)
    drafter = random_drafter(target, seed=12, block_size=8)
    seen = []
    real_start = RoundPacer.start_round

    def recording_start(self, size):
        real_start(self, size)
        seen.append(self.taps.paced)

    monkeypatch.setattr(RoundPacer, "start_round", recording_start)
    for seed in range(3):
        prompt = mx.random.randint(0, 250, (19,), key=mx.random.key(seed))
        reference = greedy_reference(target, prompt, 40)
        output, stats = run_auto(target, drafter, prompt, 40)
        assert_lossless(target, prompt, reference, output)
        assert stats.rounds >= 4
    (choice,) = pacing_choices(target).values()
    assert choice.paced is not None
    assert {False, True} <= set(seen[: choice.launched])
    assert set(seen[choice.launched :]) == {choice.paced}


def test_the_choice_goes_with_its_model_and_forget_drops_it(monkeypatch):
    monkeypatch.setenv(dflash_round.EVAL_EVERY_ENV, "auto")
    target = tiny_model("muse_glimmer", seed=2, window=16)
    drafter = random_drafter(target, seed=12, block_size=8)
    list(dflash_generate_step(mx.array([3, 4, 5]), target, drafter, max_tokens=20))
    (choice,) = pacing_choices(target).values()
    assert sum(map(len, choice.seconds.values())) >= 1
    # Another setting is another choice; the first is kept.
    monkeypatch.setenv(dflash_round.EVAL_TAIL_ENV, "1")
    list(dflash_generate_step(mx.array([3, 4, 5]), target, drafter, max_tokens=20))
    assert len(pacing_choices(target)) == 2
    forget_pacing(target)
    assert pacing_choices(target) == {}
    list(dflash_generate_step(mx.array([3, 4, 5]), target, drafter, max_tokens=20))
    (choice,) = pacing_choices(target).values()
    gone = weakref.ref(choice)
    del choice, target, drafter
    gc.collect()
    assert gone() is None


def test_without_auto_no_choice_is_made(monkeypatch):
    monkeypatch.setenv(dflash_round.EVAL_EVERY_ENV, "4")
    target = tiny_model("muse_glimmer", seed=2, window=16)
    drafter = random_drafter(target, seed=12, block_size=8)
    list(dflash_generate_step(mx.array([3, 4, 5]), target, drafter, max_tokens=20))
    assert pacing_choices(target) == {}
