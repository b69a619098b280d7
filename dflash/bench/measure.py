"""Eval-timed parts of a round, the plain step against the bandwidth bound, bench overhead.

Each part is timed alone, ``mx.eval`` to ``mx.eval`` (median of ``reps`` after two
warm-ups), at the first prompt's context:

* drafter: the drafter forward over ``[last, mask, ...]`` and the argmax of its drafts (and
  the same through a :class:`ReplayDrafter`: the difference is what REPLAY adds);
* verify: the target forward over a ``B``-token block inside a ``SpeculativeCheckpoint`` on
  dflash's cache, with the taps the loop reads, then a rollback (the context stays fixed);
* plain step: one 1-token forward on mlx-lm's cache, synchronised each step.

"Everything else" of a round is the round measured inside the real loop minus drafter and
verify.
"""

import statistics
import time
from typing import Any, Callable, Dict, List, Optional, Sequence

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.generate import generation_stream

from .. import SpeculativeCheckpoint, TargetTaps, make_prompt_cache
from ..kernel_patch import attention_route
from .replay import ReplayDrafter
from .runs import close, consume
from .scale_target import parameter_bytes, step_read_bytes

DEFAULT_BANDWIDTH_TBS = 4.8  # H200 HBM3e
PREFILL_STEP = 2048


def median_ms(function: Callable[[], None], reps: int, warmup: int = 2) -> float:
    """Median wall time of ``function`` in milliseconds (it must evaluate what it builds).

    Args:
        function: The work, ending in ``mx.eval``.
        reps: Timed calls.
        warmup: Untimed calls first.

    Returns:
        The median, ms.
    """
    for _ in range(warmup):
        function()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        function()
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def _prefill_dflash(model, drafter, tokens: mx.array):
    """dflash cache and drafter context holding ``tokens`` (as the loop's prefill leaves them)."""
    cache = make_prompt_cache(model)
    context = drafter.make_context()
    with TargetTaps(model, drafter.config.target_layer_ids) as taps:
        for first in range(0, tokens.size, PREFILL_STEP):
            chunk = tokens[first : first + PREFILL_STEP]
            model(chunk[None], cache=cache)
            drafter.append_context(context, taps.pop(), start_position=first)
            planes = [(p.keys, p.values) for p in context.planes if p.keys is not None]
            mx.eval([c.state for c in cache], planes)
    return cache, context


def _prefill_mlx_lm(model, tokens: mx.array):
    from mlx_lm.models.cache import make_prompt_cache as mlx_lm_cache

    cache = mlx_lm_cache(model)
    for first in range(0, tokens.size, PREFILL_STEP):
        model(tokens[first : first + PREFILL_STEP][None], cache=cache)
        mx.eval([c.state for c in cache])
    return cache


def round_split(
    model: nn.Module,
    drafter: Any,
    prompt: mx.array,
    continuation: Sequence[int],
    block_size: int,
    reps: int,
    replay_tau: Optional[int] = None,
) -> Dict[str, Any]:
    """Drafter, verify and plain-step times at ``prompt``'s context (see the module doc).

    Args:
        model: The target.
        drafter: The DFlash drafter bound to it.
        prompt: The prompt (context = all but its last token, as in the loop's first round).
        continuation: The target's greedy continuation (verify block drafts, replay).
        block_size: Block size ``B``.
        reps: Timed repetitions per part.
        replay_tau: Also time the drafter through a replay of this profile.

    Returns:
        ``context``, ``drafter_ms``, ``drafter_replay_ms`` (or ``None``), ``verify_ms``,
        ``plain_step_ms`` and ``kv_bytes`` (mlx-lm's cache at that context).

    Shapes:
        prompt: ``(P,)``.
    """
    with mx.stream(generation_stream):
        out = _split(model, drafter, prompt, continuation, block_size, reps, replay_tau)
    mx.synchronize()
    mx.clear_cache()
    return out


def _split(model, drafter, prompt, continuation, block_size, reps, replay_tau):
    context_tokens, last = prompt[:-1], int(prompt[-1].item())
    mask = drafter.config.mask_token_id
    block = mx.array([[last] + [mask] * (block_size - 1)], mx.uint32)
    out: Dict[str, Any] = {"context": int(context_tokens.size), "reps": reps}
    cache, context = _prefill_dflash(model, drafter, context_tokens)

    def draft(fn) -> Callable[[], None]:
        return lambda: mx.eval(mx.argmax(fn(block, context)[0, 1:], axis=-1))

    out["drafter_ms"] = median_ms(draft(drafter), reps)
    out["drafter_replay_ms"] = None
    if replay_tau is not None:
        replay = ReplayDrafter(drafter, replay_tau)
        replay.sequence = prompt.tolist() + list(continuation)
        out["drafter_replay_ms"] = median_ms(draft(replay), reps)
    drafts = (list(continuation) + [0] * block_size)[: block_size - 1]
    verify_block = mx.array([[last] + drafts], mx.uint32)
    with (
        TargetTaps(model, drafter.config.target_layer_ids) as taps,
        attention_route(model),
    ):

        def verify() -> None:
            checkpoint = SpeculativeCheckpoint.begin(cache, block_size)
            try:
                logits = model(verify_block, cache=cache)[0]
                mx.eval(mx.argmax(logits, axis=-1), taps.pop())
            finally:
                checkpoint.rollback()

        out["verify_ms"] = median_ms(verify, reps)
    plain_cache = _prefill_mlx_lm(model, context_tokens)
    out["kv_bytes"] = int(sum(c.nbytes for c in plain_cache))
    step_input = mx.array([[last]], mx.uint32)
    out["plain_step_ms"] = median_ms(
        lambda: mx.eval(mx.argmax(model(step_input, cache=plain_cache)[0, -1])), reps
    )
    return out


def bandwidth_bound(
    model: nn.Module, kv_bytes: int, bandwidth_tbs: float
) -> Dict[str, Any]:
    """Bytes a plain decode step reads and the time that takes at ``bandwidth_tbs``.

    Args:
        model: The target.
        kv_bytes: Bytes of its KV cache at the measured context.
        bandwidth_tbs: Memory bandwidth, TB/s.

    Returns:
        ``weight_bytes`` (all parameters), ``step_read_bytes`` (weights once, one
        embedding row, the KV cache), ``bandwidth_tbs`` and ``bound_ms``.
    """
    read = step_read_bytes(model, kv_bytes)
    return {
        "weight_bytes": parameter_bytes(model),
        "step_read_bytes": read,
        "bandwidth_tbs": bandwidth_tbs,
        "bound_ms": 1e3 * read / (bandwidth_tbs * 1e12),
    }


def bookkeeping_us_per_token(tokens: int = 20000, block: int = 8) -> float:
    """The bench's per-token cost: :func:`consume` minus a bare loop, over a ready stream.

    Args:
        tokens: Stream length.
        block: One round-ending token every ``block`` tokens.

    Returns:
        Microseconds per token (median of 5).
    """
    items = [(i, None, i % block != block - 1) for i in range(tokens)]

    def bare() -> float:
        start = time.perf_counter()
        for _ in iter(items):
            pass
        return time.perf_counter() - start

    def bench() -> float:
        start = time.perf_counter()
        consume(iter(items), tokens + 1, ())
        return time.perf_counter() - start

    diffs = [bench() - bare() for _ in range(5)]
    return max(0.0, 1e6 * statistics.median(diffs) / tokens)


def ab_overhead(
    steps: Callable[[], Any], max_tokens: int, stop, reps: int
) -> Dict[str, float]:
    """Whole runs drained bare vs through the bench's bookkeeping, alternated.

    Args:
        steps: Returns a fresh generator of one mode on one prompt.
        max_tokens: Its token budget.
        stop: Stop tokens.
        reps: Pairs of runs.

    Returns:
        ``bare_s`` and ``bench_s`` (medians) and ``overhead`` (``bench / bare - 1``).
    """
    bare: List[float] = []
    bench: List[float] = []
    for _ in range(reps):
        mx.synchronize()
        start = time.perf_counter()
        for _ in steps():
            pass
        mx.synchronize()
        bare.append(time.perf_counter() - start)
        start = time.perf_counter()
        generator = steps()
        consume(generator, max_tokens, stop)
        close(generator)
        mx.synchronize()
        bench.append(time.perf_counter() - start)
    bare_s, bench_s = statistics.median(bare), statistics.median(bench)
    return {"bare_s": bare_s, "bench_s": bench_s, "overhead": bench_s / bare_s - 1.0}
