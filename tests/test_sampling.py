"""dflash.make_sampler is mlx-lm's make_sampler: same signature, same meaning, same samples."""

import inspect

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.sample_utils import make_sampler as mlx_make_sampler

import dflash
from dflash.sampling import SamplingParams, sampling_logprobs

# Every call form of mlx-lm's make_sampler that mlx-lm itself, its CLI, its server and common
# scripts use: positional prefixes of every length and the keyword forms.
CALL_FORMS = [
    ((0.7,), {}),
    ((0.7, 0.9), {}),
    ((0.7, 0.9, 0.05), {}),
    ((0.7, 0.9, 0.05, 1), {}),
    ((0.7, 0.9, 0.05, 1, 40), {}),
    ((0.7, 0.9, 0.05, 3, 40, 0.0, 0.2, [1, 2]), {}),
    ((0.7, 0.9, 0.05, 1), {"top_k": 40}),  # mlx_lm.generate main()
    ((0.8,), {"top_p": 0.9, "top_k": 40, "min_p": 0.05}),  # mlx_lm.server
    ((), {"temp": 1.0, "min_p": 0.1, "min_tokens_to_keep": 5}),
    ((), {"temp": 0.6, "top_k": 1}),
    ((), {"temp": 1.3, "top_p": 0.5}),
    ((), {"temp": 0.9, "top_k": -1}),  # a non-positive top_k is off, as in mlx-lm
    ((0.0,), {}),
    ((), {}),
]


def test_signature_is_mlx_lms():
    ours = inspect.signature(dflash.make_sampler).parameters
    theirs = inspect.signature(mlx_make_sampler).parameters
    assert list(ours) == list(theirs)
    for name, param in theirs.items():
        assert ours[name].default == param.default, name
        assert ours[name].kind == param.kind, name


def test_positional_order_means_what_it_means_in_mlx_lm():
    params = dflash.make_sampler(0.7, 0.9, 0.05, 1, 40).params
    assert (params.min_tokens_to_keep, params.top_k) == (1, 40)
    params = dflash.make_sampler(0.7, 0.9, 0.05, 3, 40, 0.25, 0.3, [7]).params
    assert params == SamplingParams(
        temp=0.7,
        top_p=0.9,
        min_p=0.05,
        min_tokens_to_keep=3,
        top_k=40,
        xtc_probability=0.25,
        xtc_threshold=0.3,
        xtc_special_tokens=(7,),
    )


def log_softmax(logits):
    return logits - mx.logsumexp(logits, axis=-1, keepdims=True)


@pytest.mark.parametrize("args,kwargs", CALL_FORMS)
def test_every_call_form_draws_mlx_lms_samples(args, kwargs):
    """Under one seed, ours and mlx-lm's pick the same token for every row."""
    mx.random.seed(3)
    logprobs = log_softmax(2.0 * mx.random.normal((64, 50)))
    ours, theirs = dflash.make_sampler(*args, **kwargs), mlx_make_sampler(
        *args, **kwargs
    )
    for seed in range(3):
        mx.random.seed(seed)
        a = ours(logprobs)
        mx.random.seed(seed)
        b = theirs(logprobs)
        assert a.tolist() == b.tolist()


def chi_square(counts, probs):
    expected = np.asarray(probs) * np.sum(counts)
    keep = expected > 0
    assert np.all(
        np.asarray(counts)[~keep] == 0
    ), "a token outside the support was drawn"
    return float(
        np.sum((np.asarray(counts)[keep] - expected[keep]) ** 2 / expected[keep])
    )


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(temp=0.7, top_p=0.9, min_p=0.05, min_tokens_to_keep=1, top_k=6),
        dict(temp=1.0, min_p=0.2, min_tokens_to_keep=4),
        dict(temp=1.3, top_p=0.6),
    ],
)
def test_rebuilt_distribution_is_what_mlx_lm_samples(kwargs):
    """sampling_logprobs (what rejection sampling uses) is the law of mlx-lm's samples."""
    mx.random.seed(0)
    row = log_softmax(1.5 * mx.random.normal((1, 12)))
    probs = np.array(
        mx.exp(sampling_logprobs(row, dflash.make_sampler(**kwargs).params))[0]
    )
    samples = mlx_make_sampler(**kwargs)(mx.broadcast_to(row, (20000, 12)))
    counts = np.bincount(np.array(samples), minlength=12)
    support = int((probs > 0).sum())
    assert 1 < support < 12  # the filters did something
    # chi-square critical value at p = 0.001 for up to 11 degrees of freedom
    assert chi_square(counts, probs) < 31.3


def test_xtc_is_flagged_as_having_no_distribution():
    assert dflash.make_sampler(0.7).params.expressible
    assert not dflash.make_sampler(0.7, xtc_probability=0.5).params.expressible


@pytest.mark.parametrize(
    "kwargs,field",
    [
        (dict(temp=-1.0), "temp"),
        (dict(temp=0.7, top_p=1.5), "top_p"),
        (dict(temp=0.7, min_p=2.0), "min_p"),
        (dict(temp=0.7, min_p=0.1, min_tokens_to_keep=0), "min_tokens_to_keep"),
        (dict(temp=0.7, xtc_probability=0.5, xtc_threshold=0.9), "xtc_threshold"),
        (dict(temp=0.7, top_k=2.5), "top_k"),
    ],
)
def test_bad_settings_are_refused_by_name(kwargs, field):
    with pytest.raises(ValueError, match=field):
        dflash.make_sampler(**kwargs)
