"""The target's own greedy output, computed with mlx-lm's plain machinery.

This is the yardstick every lossless claim is measured against: mlx-lm's
``generate_step`` on mlx-lm's own prompt cache with an argmax sampler, nothing
from this package in the loop.
"""

import importlib
import sys
from types import ModuleType
from typing import Collection, List, Sequence, Tuple

import mlx.core as mx
import mlx.nn as nn


def mlx_lm_generate_module() -> ModuleType:
    """mlx-lm's ``generate`` module (the package attribute is shadowed by the function).

    Returns:
        The module ``mlx_lm.generate``.
    """
    importlib.import_module("mlx_lm.generate")
    return sys.modules["mlx_lm.generate"]


def _argmax(logprobs: mx.array) -> mx.array:
    return mx.argmax(logprobs, axis=-1)


def logit_margin(logprobs: mx.array) -> float:
    """Gap between the two largest entries of one row of logits or log-probabilities.

    Log-softmax shifts every logit by the same amount, so the gap is the same for
    logits and log-probabilities.

    Args:
        logprobs: Logits or log-probabilities of one position.

    Returns:
        ``top1 - top2`` (0.0 for a vocabulary of one).

    Shapes:
        logprobs: ``(V,)``.
    """
    if logprobs.size < 2:
        return 0.0
    top = mx.sort(logprobs.reshape(-1).astype(mx.float32))[-2:]
    return (top[1] - top[0]).item()


def greedy_reference_with_margins(
    model: nn.Module,
    prompt: mx.array,
    max_tokens: int,
    stop_tokens: Collection[int] = (),
) -> Tuple[List[int], List[float]]:
    """The target's greedy continuation and its top-2 logit margin at each step.

    Args:
        model: The mlx-lm target model.
        prompt: The prompt tokens.
        max_tokens: Tokens to generate at most.
        stop_tokens: Tokens that end the generation; the stop token itself is kept
            as the last token.

    Returns:
        ``(tokens, margins)``: ``margins[i]`` is the gap between the two largest
        logits from which ``tokens[i]`` was picked.

    Shapes:
        prompt: ``(P,)``.
    """
    from mlx_lm.models.cache import make_prompt_cache

    steps = mlx_lm_generate_module().generate_step(
        prompt,
        model,
        max_tokens=max_tokens,
        sampler=_argmax,
        prompt_cache=make_prompt_cache(model),
    )
    tokens: List[int] = []
    margins: List[float] = []
    for token, logprobs in steps:
        tokens.append(int(token))
        margins.append(logit_margin(logprobs))
        if tokens[-1] in stop_tokens:
            break
    return tokens, margins


def greedy_reference(model: nn.Module, prompt: mx.array, max_tokens: int) -> List[int]:
    """The target's own greedy output: mlx-lm's ``generate_step`` with mlx-lm's cache.

    Args:
        model: The mlx-lm target model.
        prompt: The prompt tokens.
        max_tokens: Tokens to generate.

    Returns:
        The generated tokens.

    Shapes:
        prompt: ``(P,)``.
    """
    steps = mlx_lm_generate_module().generate_step(prompt, model, max_tokens=max_tokens)
    return [token for token, _ in steps]


def top2_margin(model: nn.Module, tokens: Sequence[int]) -> float:
    """Gap between the target's two largest logits after ``tokens`` (no cache).

    Args:
        model: The mlx-lm target model.
        tokens: The full context (prompt plus generated tokens).

    Returns:
        ``top1 - top2`` of the logits predicting the next token.

    Shapes:
        tokens: ``(T,)``.
    """
    logits = model(mx.array(tokens, mx.uint32)[None])[0, -1]
    return logit_margin(logits)
