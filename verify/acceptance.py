"""Acceptance rules for a verified draft block: greedy and lossless rejection sampling.

Vocabulary (speculative decoding literature): the target verifies drafts ``d1 .. dk``; the
accepted prefix is kept, then one more token comes from the target itself (the *bonus*): its
correction at the first rejected position, or its own next token after the last draft.
"""

from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

import mlx.core as mx
from mlx_lm.sample_utils import apply_min_p, apply_top_k, apply_top_p


@dataclass(frozen=True)
class SamplingParams:
    """mlx-lm's sampler settings, kept as data so a distribution can be rebuilt from them."""

    temp: float = 0.0
    top_p: float = 1.0
    min_p: float = 0.0
    top_k: int = 0
    min_tokens_to_keep: int = 1

    def __post_init__(self):
        if self.temp < 0:
            raise ValueError(f"temp must be >= 0, got {self.temp}")
        if not 0 < self.top_p <= 1 and self.top_p != 0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")

    @property
    def greedy(self) -> bool:
        return self.temp == 0


def sampling_logprobs(logprobs: mx.array, params: SamplingParams) -> mx.array:
    """The log-distribution mlx-lm's ``make_sampler`` draws from (filters, then temperature).

    Shapes:
        logprobs: ``(N, V)``; returns ``(N, V)`` normalised log-probabilities.
    """
    if 0 < params.top_p < 1.0:
        logprobs = apply_top_p(logprobs, params.top_p)
    if params.min_p != 0.0:
        logprobs = apply_min_p(logprobs, params.min_p, params.min_tokens_to_keep)
    if params.top_k > 0:
        logprobs = apply_top_k(logprobs, params.top_k)
    scaled = logprobs / params.temp
    return scaled - mx.logsumexp(scaled, axis=-1, keepdims=True)


class ParamSampler:
    """A sampler that behaves like ``mlx_lm.sample_utils.make_sampler`` and keeps its params.

    The DFlash loop needs the target's and drafter's *distributions*, not just a sample, to
    run lossless rejection sampling; an opaque sampler only allows the sample-match rule.
    """

    def __init__(self, params: SamplingParams):
        self.params = params

    def __call__(self, logprobs: mx.array) -> mx.array:
        if self.params.greedy:
            return mx.argmax(logprobs, axis=-1)
        return mx.random.categorical(sampling_logprobs(logprobs, self.params))


def make_sampler(
    temp: float = 0.0, top_p: float = 1.0, min_p: float = 0.0, top_k: int = 0,
    min_tokens_to_keep: int = 1,
) -> ParamSampler:
    """mlx-lm's ``make_sampler`` settings as a sampler the DFlash loop can see into."""
    return ParamSampler(SamplingParams(temp, top_p, min_p, top_k, min_tokens_to_keep))


def greedy_accept(drafts: Sequence[int], targets: Sequence[int]) -> int:
    """Accepted drafts: the longest prefix where each draft equals the target's token there.

    Args:
        drafts: ``d1 .. dk``.
        targets: The target's own token after each block position (``k + 1`` of them).
    """
    accepted = 0
    while accepted < len(drafts) and drafts[accepted] == targets[accepted]:
        accepted += 1
    return accepted


def rejection_sample(
    target_logprobs: mx.array,
    draft_logprobs: mx.array,
    drafts: Sequence[int],
    key: Optional[mx.array] = None,
) -> Tuple[int, int]:
    """Lossless speculative sampling (Leviathan et al. / Chen et al.).

    Draft ``d_i`` (drawn from ``q_i``) is kept with probability ``min(1, p_i(d_i) / q_i(d_i))``;
    at the first rejection the token is redrawn from ``max(p_i - q_i, 0)`` renormalised; if
    every draft is kept the bonus token is drawn from ``p_k``. The emitted tokens are then
    distributed exactly as the target's own samples.

    Args:
        target_logprobs: The target's sampling log-distribution at each block position.
        draft_logprobs: The drafter's sampling log-distribution for each draft.
        drafts: The drafted tokens.
        key: Optional PRNG key.

    Shapes:
        target_logprobs: ``(k + 1, V)``; draft_logprobs: ``(k, V)``.

    Returns:
        ``(accepted, bonus)``: drafts kept and the target's own next token.
    """
    k = len(drafts)
    keys = mx.random.split(key, 2) if key is not None else (None, None)
    p = mx.exp(target_logprobs.astype(mx.float32))
    q = mx.exp(draft_logprobs.astype(mx.float32))
    if k:
        index = mx.array(drafts)[:, None]
        p_draft = mx.take_along_axis(p[:k], index, axis=-1)[:, 0]
        q_draft = mx.take_along_axis(q, index, axis=-1)[:, 0]
        uniform = mx.random.uniform(shape=(k,), key=keys[0])
        kept = (uniform * q_draft <= p_draft).tolist()
    else:
        kept = []
    accepted = 0
    while accepted < k and kept[accepted]:
        accepted += 1
    if accepted == k:
        row = target_logprobs[k]
    else:
        residual = mx.maximum(p[accepted] - q[accepted], 0.0)
        # If p == q exactly the residual is empty; the target's own row is then exact.
        total = residual.sum()
        row = mx.where(total > 0, mx.log(residual), target_logprobs[accepted].astype(mx.float32))
    bonus = mx.random.categorical(row, key=keys[1]).item()
    return accepted, bonus


def acceptance_histogram(accepted_counts: Sequence[int], block_size: int) -> List[int]:
    """``hist[n]``: rounds that accepted exactly ``n`` drafts (``0 .. block_size - 1``)."""
    hist = [0] * block_size
    for n in accepted_counts:
        hist[n] += 1
    return hist
