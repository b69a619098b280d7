"""Acceptance rules for a verified draft block: greedy and lossless rejection sampling.

Vocabulary (speculative decoding literature): the target verifies drafts ``d1 .. dk``; the
accepted prefix is kept, then one more token comes from the target itself (the *bonus*): its
correction at the first rejected position, or its own next token after the last draft.
"""

from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

import mlx.core as mx
from mlx_lm.sample_utils import apply_min_p, apply_top_k, apply_top_p
from mlx_lm.sample_utils import make_sampler as _mlx_make_sampler


@dataclass(frozen=True)
class SamplingParams:
    """mlx-lm's sampler settings, kept as data so a distribution can be rebuilt from them.

    The fields, their order and their meaning are those of ``mlx_lm.sample_utils.make_sampler``:
    a filter is off at its neutral value (``top_p`` outside ``(0, 1)``, ``min_p == 0``,
    ``top_k <= 0``, ``xtc_probability == 0``), and a setting is validated only when it is in
    effect, as mlx-lm does (it refuses the same values, but only once it samples).
    """

    temp: float = 0.0
    top_p: float = 0.0
    min_p: float = 0.0
    min_tokens_to_keep: int = 1
    top_k: int = 0
    xtc_probability: float = 0.0
    xtc_threshold: float = 0.1
    xtc_special_tokens: Tuple[int, ...] = ()

    def __post_init__(self):
        object.__setattr__(
            self, "xtc_special_tokens", tuple(self.xtc_special_tokens or ())
        )
        if self.temp < 0:
            raise ValueError(f"temp must be >= 0, got {self.temp}")
        if not 0 <= self.top_p <= 1:
            raise ValueError(f"top_p must be in [0, 1], got {self.top_p}")
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if not isinstance(self.top_k, int):
            raise ValueError(f"top_k must be an integer, got {self.top_k!r}")
        if self.min_p != 0 and (
            not isinstance(self.min_tokens_to_keep, int) or self.min_tokens_to_keep < 1
        ):
            raise ValueError(
                f"min_tokens_to_keep must be a positive integer, got {self.min_tokens_to_keep!r}"
            )
        if not 0 <= self.xtc_probability <= 1:
            raise ValueError(
                f"xtc_probability must be in [0, 1], got {self.xtc_probability}"
            )
        if self.xtc_probability > 0 and not 0 <= self.xtc_threshold <= 0.5:
            raise ValueError(
                f"xtc_threshold must be in [0, 0.5], got {self.xtc_threshold}"
            )

    @property
    def greedy(self) -> bool:
        """Whether the sampler is an argmax (temperature 0)."""
        return self.temp == 0

    @property
    def expressible(self) -> bool:
        """Whether :func:`sampling_logprobs` is the distribution the sampler draws from.

        XTC draws one coin per call and then masks the top tokens, so a batch of rows sampled
        together is not a product of per-row distributions: it has no distribution to run
        rejection sampling against.
        """
        return self.xtc_probability == 0


def sampling_logprobs(logprobs: mx.array, params: SamplingParams) -> mx.array:
    """The log-distribution mlx-lm's ``make_sampler`` draws from (filters, then temperature).

    The filters run in mlx-lm's order (top-p, min-p, top-k) on the log-probabilities, then the
    temperature scales what is left. Only meaningful when ``params.expressible``.

    Shapes:
        logprobs: ``(N, V)``; returns ``(N, V)`` normalised log-probabilities.
    """
    if 0 < params.top_p < 1.0:
        logprobs = apply_top_p(logprobs, params.top_p)
    if params.min_p != 0.0:
        logprobs = apply_min_p(logprobs, params.min_p, params.min_tokens_to_keep)
    if params.top_k > 0:
        logprobs = apply_top_k(logprobs, params.top_k)
    scaled = logprobs * (1.0 / params.temp)
    return scaled - mx.logsumexp(scaled, axis=-1, keepdims=True)


class ParamSampler:
    """mlx-lm's sampler for ``params`` that also exposes the settings it was made from.

    Calling it runs mlx-lm's own sampler (same filters, same random draws), so it picks the
    same tokens as ``mlx_lm.sample_utils.make_sampler`` under the same seed. The DFlash loop
    reads ``params`` to rebuild the distributions that lossless rejection sampling needs; an
    opaque sampler only allows the sample-match rule.
    """

    def __init__(self, params: SamplingParams):
        self.params = params
        self._sample = _mlx_make_sampler(
            params.temp,
            params.top_p,
            params.min_p,
            params.min_tokens_to_keep,
            top_k=params.top_k,
            xtc_probability=params.xtc_probability,
            xtc_threshold=params.xtc_threshold,
            xtc_special_tokens=list(params.xtc_special_tokens),
        )

    def __call__(self, logprobs: mx.array) -> mx.array:
        return self._sample(logprobs)


def make_sampler(
    temp: float = 0.0,
    top_p: float = 0.0,
    min_p: float = 0.0,
    min_tokens_to_keep: int = 1,
    top_k: int = 0,
    xtc_probability: float = 0.0,
    xtc_threshold: float = 0.1,
    xtc_special_tokens: Optional[List[int]] = None,
) -> ParamSampler:
    """mlx-lm's ``make_sampler`` (same arguments, order and samples), readable by the loops.

    With these settings the DFlash and classic loops run lossless rejection sampling at
    temperature > 0. With XTC on (``xtc_probability > 0``) the sampler has no per-row
    distribution, so the loops fall back to the sample-match rule (a draft is kept only where
    the target's own sample equals it), which is lossless too but accepts fewer drafts.

    Args:
        temp: Temperature; 0 picks the argmax.
        top_p: Nucleus filter, on when in ``(0, 1)``.
        min_p: Min-p filter (relative to the top token's probability), on when non-zero.
        min_tokens_to_keep: Tokens the min-p filter always keeps.
        top_k: Keep the ``top_k`` most likely tokens, on when positive.
        xtc_probability: Probability of applying XTC to a sampling call.
        xtc_threshold: XTC's probability threshold.
        xtc_special_tokens: Token ids XTC never removes.

    Returns:
        A sampler ``(N, V) log-probabilities -> (N,) tokens`` with a ``params`` attribute.
    """
    return ParamSampler(
        SamplingParams(
            temp,
            top_p,
            min_p,
            min_tokens_to_keep,
            top_k,
            xtc_probability,
            xtc_threshold,
            tuple(xtc_special_tokens or ()),
        )
    )


def greedy_accept(drafts: Sequence[int], targets: Sequence[int]) -> int:
    """Accepted drafts: the longest prefix where each draft equals the target's token there.

    This is the greedy rule at temperature 0 and the sample-match rule when ``targets`` are the
    target's own samples.

    Args:
        drafts: ``d1 .. dk``.
        targets: The target's own token after each block position (``k + 1`` of them).

    Returns:
        How many drafts are kept.
    """
    accepted = 0
    while accepted < len(drafts) and drafts[accepted] == targets[accepted]:
        accepted += 1
    return accepted


def rejection_sample(
    target_logprobs: mx.array,
    draft_logprobs: Optional[mx.array],
    drafts: Sequence[int],
    key: Optional[mx.array] = None,
) -> Tuple[int, int]:
    """Lossless speculative sampling (Leviathan et al. / Chen et al.).

    Draft ``d_i`` (drawn from ``q_i``) is kept with probability ``min(1, p_i(d_i) / q_i(d_i))``;
    at the first rejection the token is redrawn from ``max(p_i - q_i, 0)`` renormalised; if
    every draft is kept the bonus token is drawn from ``p_k``. The emitted tokens are then
    distributed exactly as the target's own samples. With no drafts (``k = 0``) the bonus is
    simply a sample of ``p_0``.

    Args:
        target_logprobs: The target's sampling log-distribution at each block position.
        draft_logprobs: The drafter's sampling log-distribution for each draft (``None`` or
            empty when there are no drafts).
        drafts: The drafted tokens.
        key: Optional PRNG key.

    Shapes:
        target_logprobs: ``(k + 1, V)``; draft_logprobs: ``(k, V)``.

    Returns:
        ``(accepted, bonus)``: drafts kept and the target's own next token.
    """
    k = len(drafts)
    keys = mx.random.split(key, 2) if key is not None else (None, None)
    if k == 0:
        return 0, mx.random.categorical(target_logprobs[0], key=keys[1]).item()
    if draft_logprobs is None or draft_logprobs.shape[0] != k:
        raise ValueError(f"rejection sampling {k} drafts needs {k} draft distributions")
    p = mx.exp(target_logprobs.astype(mx.float32))
    q = mx.exp(draft_logprobs.astype(mx.float32))
    index = mx.array(drafts)[:, None]
    p_draft = mx.take_along_axis(p[:k], index, axis=-1)[:, 0]
    q_draft = mx.take_along_axis(q, index, axis=-1)[:, 0]
    uniform = mx.random.uniform(shape=(k,), key=keys[0])
    # A token the target cannot emit (p = 0) is never kept, even where q underflowed to 0.
    kept = ((uniform * q_draft <= p_draft) & (p_draft > 0)).tolist()
    accepted = 0
    while accepted < k and kept[accepted]:
        accepted += 1
    if accepted == k:
        row = target_logprobs[k]
    else:
        residual = mx.maximum(p[accepted] - q[accepted], 0.0)
        # If p == q exactly the residual is empty; the target's own row is then exact.
        total = residual.sum()
        row = mx.where(
            total > 0, mx.log(residual), target_logprobs[accepted].astype(mx.float32)
        )
    bonus = mx.random.categorical(row, key=keys[1]).item()
    return accepted, bonus


def acceptance_histogram(accepted_counts: Sequence[int], block_size: int) -> List[int]:
    """``hist[n]``: rounds that accepted exactly ``n`` drafts (``0 .. block_size - 1``)."""
    hist = [0] * block_size
    for n in accepted_counts:
        hist[n] += 1
    return hist
