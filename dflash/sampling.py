"""Sampling in one place: mlx-lm's sampler settings, the distributions they draw from, and the
per-generation sampling state every generator shares (logits processors over the history,
draft proposals, and the choice of acceptance rule).

The acceptance rules themselves live in :mod:`dflash.verify.acceptance`; this module decides
which one a generation uses: lossless rejection sampling when the sampler's distribution is
known (``dflash.make_sampler`` at temperature > 0, XTC off), the sample-match rule otherwise
(greedy decoding, an opaque sampler, XTC).
"""

from dataclasses import dataclass
from typing import Callable, List, Optional, Tuple

import mlx.core as mx
from mlx_lm.sample_utils import apply_min_p, apply_top_k, apply_top_p, greedy_sampler
from mlx_lm.sample_utils import make_sampler as _mlx_make_sampler

from .verify.acceptance import match_accept, rejection_accept

Sampler = Callable[[mx.array], mx.array]
LogitsProcessor = Callable[[mx.array, mx.array], mx.array]


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
        special = tuple(self.xtc_special_tokens or ())
        object.__setattr__(self, "xtc_special_tokens", special)
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
                "min_tokens_to_keep must be a positive integer, got "
                f"{self.min_tokens_to_keep!r}"
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

    Args:
        logprobs: Log-probabilities, one row per position.
        params: The sampler's settings (temperature > 0).

    Shapes:
        logprobs: ``(N, V)``; returns ``(N, V)`` normalised log-probabilities.

    Returns:
        The normalised log-distribution of each row.
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
    same tokens as ``mlx_lm.sample_utils.make_sampler`` under the same seed. The loops read
    ``params`` to rebuild the distributions that lossless rejection sampling needs; an opaque
    sampler only allows the sample-match rule.
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


def log_normalize(logits: mx.array) -> mx.array:
    """Log-probabilities of each row of ``logits``.

    Shapes:
        logits: ``(N, V)``; returns ``(N, V)``.
    """
    return logits - mx.logsumexp(logits, axis=-1, keepdims=True)


class Sampling:
    """One generation's sampler, logits processors and token history, all on the device.

    Nothing here reads a value back to the host: the loops sync once per round, on the
    packed result of :meth:`accept`.

    Args:
        sampler: Picks tokens from log-probabilities (``None``: greedy).
        processors: Functions ``(tokens, logits) -> logits``.
        history: Tokens before the first block (kept only when a processor needs them).

    Shapes:
        history: ``(T,)``.
    """

    def __init__(
        self,
        sampler: Optional[Sampler],
        processors: Optional[List[LogitsProcessor]],
        history: mx.array,
    ):
        self.sampler = sampler or greedy_sampler
        params = getattr(self.sampler, "params", None)
        self.greedy = self.sampler is greedy_sampler or bool(
            isinstance(params, SamplingParams) and params.greedy
        )
        # Settings are usable for rejection sampling only when they define a distribution.
        self.params = (
            params
            if isinstance(params, SamplingParams)
            and params.expressible
            and not params.greedy
            else None
        )
        self.processors = processors or []
        self.history = history.astype(mx.uint32) if self.processors else None

    @property
    def rejection(self) -> bool:
        """Whether drafts are judged by lossless rejection sampling (else sample-match)."""
        return self.params is not None

    @property
    def temperature(self) -> float:
        """The sampling temperature of rejection sampling (0 otherwise)."""
        return self.params.temp if self.params is not None else 0.0

    def processed_logprobs(
        self, logits: mx.array, inputs: Optional[mx.array] = None
    ) -> mx.array:
        """Log-probabilities of ``logits`` after the logits processors.

        Row ``i`` of ``N`` follows the history plus ``inputs[: len(inputs) - N + i + 1]``.

        Shapes:
            logits: ``(N, V)``; inputs: ``(M,)`` with ``M >= N``; returns ``(N, V)``.
        """
        if self.processors:
            count = 0 if inputs is None else inputs.shape[0]
            rows = []
            for i in range(logits.shape[0]):
                upto = count - logits.shape[0] + i + 1
                seen = self.history
                if upto > 0:
                    seen = mx.concatenate([seen, inputs[:upto].astype(mx.uint32)])
                row = logits[i : i + 1]
                for processor in self.processors:
                    row = processor(seen, row)
                rows.append(row)
            logits = mx.concatenate(rows, axis=0)
        return log_normalize(logits)

    def sample_rows(self, logprobs: mx.array) -> mx.array:
        """One sampler call per row, as sequential decoding makes them.

        A sampler may draw one random number per call for the whole batch (mlx-lm's XTC
        does), so rows sampled together would not be independent samples.

        Shapes:
            logprobs: ``(N, V)``; returns ``(N,)`` ``uint32``.
        """
        if self.greedy or logprobs.shape[0] == 1:
            return self.sampler(logprobs).astype(mx.uint32)
        rows = [self.sampler(logprobs[i : i + 1]) for i in range(logprobs.shape[0])]
        return mx.concatenate(rows).astype(mx.uint32)

    def propose(self, logprobs: mx.array) -> Tuple[mx.array, Optional[mx.array]]:
        """Draft tokens from a drafter's log-probabilities, one per row.

        Returns:
            ``(tokens, q)``: the ``uint32`` drafts and, under rejection sampling, the
            log-distribution each was drawn from (``None`` otherwise: any proposal is
            lossless under sample-match).

        Shapes:
            logprobs: ``(N, V)``; returns ``(N,)`` and ``(N, V)``.
        """
        if self.rejection:
            q = sampling_logprobs(logprobs, self.params)
            return mx.random.categorical(q).astype(mx.uint32), q
        if self.greedy:
            return mx.argmax(logprobs, axis=-1).astype(mx.uint32), None
        return self.sample_rows(logprobs), None

    def accept(
        self, logits: mx.array, block: mx.array, q: Optional[mx.array]
    ) -> Tuple[mx.array, mx.array]:
        """Judge the drafts of a verified block, on the device.

        Args:
            logits: The target's logits at each block position.
            block: ``[last committed token, d1 .. dk]``.
            q: The drafts' log-distributions under rejection sampling, else ``None``.

        Shapes:
            logits: ``(k + 1, V)``; block: ``(k + 1,)``; q: ``(k, V)``; returns
            ``(k + 2,)`` and ``(k + 1, V)``.

        Returns:
            ``(packed, logprobs)``: ``packed`` is ``[accepted, tokens...]`` (the kept drafts,
            then the target's own token at index ``accepted``; see
            :func:`dflash.verify.acceptance.match_accept`), read back with one sync;
            ``logprobs`` are the target's processed log-probabilities.
        """
        logprobs = self.processed_logprobs(logits, block)
        drafts = block[1:]
        if q is not None and drafts.shape[0]:
            target = sampling_logprobs(logprobs, self.params)
            accepted, tokens = rejection_accept(target, q, drafts)
        else:
            accepted, tokens = match_accept(drafts, self.sample_rows(logprobs))
        packed = mx.concatenate(
            [accepted.astype(mx.uint32)[None], tokens.astype(mx.uint32)]
        )
        return packed, logprobs

    def extend(self, tokens: mx.array) -> None:
        """Add committed tokens to the history the processors see.

        Shapes:
            tokens: ``(n,)``.
        """
        if self.processors:
            self.history = mx.concatenate([self.history, tokens.astype(mx.uint32)])
