"""The pipelined round: one host sync per round, the device kept busy with async_eval.

Every way a host can wait for the device is counted while a generation runs its rounds:
``mx.eval`` and reading an array back (``item``, ``tolist``, numpy conversion, ``int``,
``float``, ``bool``). Drafts feed the verify as device arrays and the acceptance rule runs on
the device, so each round reads back exactly one array: its packed result.
"""

import contextlib

import mlx.core as mx
import pytest
from conftest import tiny_model
from mlx_lm.sample_utils import make_sampler as mlx_make_sampler
from test_dflash_loop import random_drafter

import dflash

READS = ("item", "tolist", "__array__", "__int__", "__float__", "__bool__", "__index__")


@contextlib.contextmanager
def counting(monkeypatch):
    counts = {"syncs": 0, "evals": 0, "async_evals": 0}

    def counted(original, key):
        def wrapper(*args, **kwargs):
            counts[key] += 1
            return original(*args, **kwargs)

        return wrapper

    for name in READS:
        if hasattr(mx.array, name):
            monkeypatch.setattr(
                mx.array, name, counted(getattr(mx.array, name), "syncs")
            )
    monkeypatch.setattr(mx, "eval", counted(mx.eval, "evals"))
    monkeypatch.setattr(mx, "async_eval", counted(mx.async_eval, "async_evals"))
    try:
        yield counts
    finally:
        monkeypatch.undo()


def count_rounds(monkeypatch, steps, stats, rounds: int):
    """Run ``steps`` for ``rounds`` more rounds under :func:`counting`, then close it.

    Returns:
        ``(counts, rounds run)``.
    """
    first = stats.rounds
    with counting(monkeypatch) as counts:
        while stats.rounds < first + rounds:
            next(steps)
    steps.close()
    return counts, stats.rounds - first


@pytest.fixture(scope="module")
def models():
    target = tiny_model("muse_glimmer", seed=0, window=16)  # rings wrap during the run
    # A draft without sliding layers: see test_sliding_draft_rings_add_the_caches_retain.
    draft = tiny_model("qwen3", seed=1, num_hidden_layers=2)
    return target, draft, random_drafter(target, seed=2, block_size=4)


def generator(kind, models, sampler, stats):
    target, draft, drafter = models
    prompt = mx.array([(11 * i) % 250 + 1 for i in range(19)])
    if kind == "dflash":
        return dflash.dflash_generate_step(
            prompt, target, drafter, max_tokens=-1, sampler=sampler, stats=stats
        )
    return dflash.speculative_generate_step(
        prompt,
        target,
        draft,
        num_draft_tokens=3,
        max_tokens=-1,
        sampler=sampler,
        stats=stats,
    )


SAMPLERS = {
    "greedy": lambda: None,
    "rejection": lambda: dflash.make_sampler(temp=0.8),
    "sample_match": lambda: mlx_make_sampler(temp=0.8, top_k=20),
}


@pytest.mark.parametrize("kind", ["dflash", "classic"])
@pytest.mark.parametrize("rule", sorted(SAMPLERS))
def test_a_round_waits_for_the_device_once(models, monkeypatch, kind, rule):
    stats = dflash.GenerationStats(4)
    steps = generator(kind, models, SAMPLERS[rule](), stats)
    next(steps)  # prefill and the first round (the prompt check reads ids back once)
    counts, rounds = count_rounds(monkeypatch, steps, stats, 12)
    assert counts["syncs"] + counts["evals"] == rounds, counts
    # Each round starts its graph without waiting (drafts, then verify and acceptance).
    assert counts["async_evals"] >= rounds, counts
    assert len(stats.synced_at) == stats.rounds and len(stats.waited) == stats.rounds


def test_sliding_draft_rings_add_the_caches_retain(monkeypatch):
    """Documented cost outside the loop: a classic draft model with full sliding rings
    writes single tokens under its checkpoint, and the checkpoint's retain evaluates the
    rows it saves (``mx.eval`` in cache/checkpoint.py), at most once a round; the loop's
    own reads stay at one a round."""
    target = tiny_model("muse_glimmer", seed=0, window=16)
    draft = tiny_model("muse_glimmer", seed=1, window=16, num_hidden_layers=3)
    stats = dflash.GenerationStats(4)
    prompt = mx.array([(11 * i) % 250 + 1 for i in range(19)])
    steps = dflash.speculative_generate_step(
        prompt, target, draft, num_draft_tokens=3, max_tokens=-1, stats=stats
    )
    next(steps)
    counts, rounds = count_rounds(monkeypatch, steps, stats, 8)
    assert counts["syncs"] == rounds and counts["evals"] <= rounds, counts
