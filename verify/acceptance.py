"""Acceptance rules for a verified draft block: sample-match (greedy) and lossless rejection
sampling.

Vocabulary (speculative decoding literature): the target verifies drafts ``d1 .. dk``; the
accepted prefix is kept, then one more token comes from the target itself (the *bonus*): its
correction at the first rejected position, or its own next token after the last draft. Which
rule a generation uses is decided by its sampler (:mod:`dflash.sampling`).
"""

from typing import List, Optional, Sequence, Tuple

import mlx.core as mx


def match_accept(drafts: mx.array, targets: mx.array) -> Tuple[mx.array, mx.array]:
    """The sample-match rule: keep the longest prefix of drafts equal to the target's tokens.

    At temperature 0 ``targets`` are the target's argmax (the greedy rule); otherwise its own
    samples, one per block position, which makes the rule lossless for any proposal. Runs on
    the device: nothing is read back.

    Args:
        drafts: ``d1 .. dk``.
        targets: The target's own token after each block position.

    Shapes:
        drafts: ``(k,)``; targets: ``(k + 1,)``.

    Returns:
        ``(accepted, tokens)``: a scalar count of kept drafts and the ``(k + 1,)`` tokens to
        emit, valid up to ``tokens[accepted]`` (the kept drafts equal the targets there, and
        ``tokens[accepted]`` is the target's own token).
    """
    k = drafts.shape[0]
    if k == 0:
        return mx.array(0, mx.uint32), targets
    matches = (drafts.astype(mx.uint32) == targets[:k].astype(mx.uint32)).astype(
        mx.uint32
    )
    return mx.cumprod(matches).sum(), targets


def rejection_accept(
    target_logprobs: mx.array,
    draft_logprobs: mx.array,
    drafts: mx.array,
    key: Optional[mx.array] = None,
) -> Tuple[mx.array, mx.array]:
    """Lossless speculative sampling (Leviathan et al. / Chen et al.), on the device.

    Draft ``d_i`` (drawn from ``q_i``) is kept with probability ``min(1, p_i(d_i) / q_i(d_i))``;
    at the first rejection the token is redrawn from ``max(p_i - q_i, 0)`` renormalised; if
    every draft is kept the bonus token is drawn from ``p_k``. The emitted tokens are then
    distributed exactly as the target's own samples. A bonus candidate is drawn at every
    position, independently of the acceptance coins, and the one at the first rejection is
    taken, so nothing is read back to the host.

    Args:
        target_logprobs: The target's sampling log-distribution at each block position.
        draft_logprobs: The drafter's sampling log-distribution for each draft.
        drafts: The drafted tokens (``k >= 1``).
        key: Optional PRNG key.

    Shapes:
        target_logprobs: ``(k + 1, V)``; draft_logprobs: ``(k, V)``; drafts: ``(k,)``.

    Returns:
        ``(accepted, tokens)`` as :func:`match_accept`.
    """
    k = drafts.shape[0]
    if draft_logprobs is None or draft_logprobs.shape[0] != k or k == 0:
        raise ValueError(f"rejection sampling {k} drafts needs {k} draft distributions")
    coin_key, bonus_key = mx.random.split(key, 2) if key is not None else (None, None)
    p = mx.exp(target_logprobs.astype(mx.float32))
    q = mx.exp(draft_logprobs.astype(mx.float32))
    index = drafts.astype(mx.uint32)[:, None]
    p_draft = mx.take_along_axis(p[:k], index, axis=-1)[:, 0]
    q_draft = mx.take_along_axis(q, index, axis=-1)[:, 0]
    uniform = mx.random.uniform(shape=(k,), key=coin_key)
    # A token the target cannot emit (p = 0) is never kept, even where q underflowed to 0.
    kept = (uniform * q_draft <= p_draft) & (p_draft > 0)
    accepted = mx.cumprod(kept.astype(mx.uint32)).sum()
    residual = mx.maximum(p[:k] - q, 0.0)
    # Where p == q exactly the residual is empty; the target's own row is then exact.
    own = target_logprobs.astype(mx.float32)
    rows = mx.where(residual.sum(axis=-1, keepdims=True) > 0, mx.log(residual), own[:k])
    candidates = mx.random.categorical(mx.concatenate([rows, own[k:]]), key=bonus_key)
    bonus = mx.take(candidates.astype(mx.uint32), accepted)
    padded = mx.concatenate([drafts.astype(mx.uint32), mx.zeros((1,), mx.uint32)])
    tokens = mx.where(mx.arange(k + 1) < accepted, padded, bonus)
    return accepted, tokens


def acceptance_histogram(accepted_counts: Sequence[int], block_size: int) -> List[int]:
    """``hist[n]``: rounds that accepted exactly ``n`` drafts (``0 .. block_size - 1``).

    Args:
        accepted_counts: Drafts accepted in each round.
        block_size: The block size ``B``.

    Returns:
        The ``B`` counts.
    """
    hist = [0] * block_size
    for n in accepted_counts:
        hist[n] += 1
    return hist
