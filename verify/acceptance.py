"""Acceptance rules for a verified draft block: sample-match (greedy) and lossless rejection
sampling.

Vocabulary (speculative decoding literature): the target verifies drafts ``d1 .. dk``; the
accepted prefix is kept, then one more token comes from the target itself (the *bonus*): its
correction at the first rejected position, or its own next token after the last draft. Which
rule a generation uses is decided by its sampler (:mod:`dflash.sampling`).
"""

from typing import List, Optional, Sequence, Tuple

import mlx.core as mx


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
