"""The server-owned context policy (seed 23.7): what to keep when a request outgrows the context.

The engine never shifts, truncates or evicts a live cache. The server decides what the retained
context is, as a pure function of the request, and the worker re-prefills it (staging swap).

* ``shift`` for chat: every system message is kept; the oldest whole turns are dropped until the
  retained conversation plus the output reserve fits. A turn starts at a user message and owns
  every assistant reply, tool call and tool result after it (messages before the first user
  message, other than system ones, form one leading unit). The relative order of the kept
  messages never changes.
* ``shift`` for raw prompts: a configured prefix plus the newest suffix of the tokens.
* ``error``: any request that does not fit is refused.
"""

from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence

SHIFT = "shift"
ERROR = "error"
POLICIES = (SHIFT, ERROR)

# Roles that are never dropped ("developer" is OpenAI's newer name for a system message).
PINNED_ROLES = frozenset({"system", "developer"})


class ContextTooLong(ValueError):
    """A request cannot fit the context under the policy; the message names what does not fit."""


@dataclass(frozen=True)
class ChatShift:
    """The retained conversation of a chat request.

    Attributes:
        messages: The kept messages, in their original order.
        dropped_turns: How many of the oldest turns were dropped.
        prompt_tokens: Tokens of the kept conversation as rendered for generation.
    """

    messages: List[Dict[str, Any]]
    dropped_turns: int
    prompt_tokens: int


@dataclass(frozen=True)
class RawShift:
    """The retained tokens of a raw prompt.

    Attributes:
        tokens: The kept prefix followed by the newest suffix.
        dropped_tokens: How many tokens from the middle were dropped.
    """

    tokens: List[int]
    dropped_tokens: int


def chat_turns(messages: Sequence[Dict[str, Any]]) -> List[List[int]]:
    """Split a message list into droppable units (lists of message indices), oldest first.

    Pinned (system) messages belong to no unit. A user message opens a turn; every other message
    joins the turn open at that point, or a leading unit when no user message came yet.

    Args:
        messages: OpenAI chat messages (each a dict with a ``role``).

    Returns:
        The units in order; the last is the newest turn.
    """
    units: List[List[int]] = []
    for index, message in enumerate(messages):
        role = message.get("role")
        if role in PINNED_ROLES:
            continue
        if role == "user" or not units:
            units.append([index])
        else:
            units[-1].append(index)
    return units


def drop_turns(messages: Sequence[Dict[str, Any]], count: int) -> List[Dict[str, Any]]:
    """The messages left after dropping the ``count`` oldest units of :func:`chat_turns`.

    Args:
        messages: OpenAI chat messages.
        count: Units to drop (``0 <= count <= len(chat_turns(messages))``).

    Returns:
        The kept messages in their original order.
    """
    units = chat_turns(messages)
    if not 0 <= count <= len(units):
        raise ValueError(f"cannot drop {count} of {len(units)} turns")
    dropped = {index for unit in units[:count] for index in unit}
    return [message for index, message in enumerate(messages) if index not in dropped]


def check_reserve(max_context: int, reserve: int) -> None:
    """Refuse an output reserve that leaves no room for even one prompt token."""
    if reserve + 1 > max_context:
        raise ContextTooLong(
            f"max_tokens ({reserve}) leaves no room for the prompt in the context of "
            f"{max_context} tokens"
        )


def shift_chat(
    messages: Sequence[Dict[str, Any]],
    count_tokens: Callable[[List[Dict[str, Any]]], int],
    max_context: Optional[int],
    reserve: int,
    policy: str = SHIFT,
) -> ChatShift:
    """Apply the context policy to a chat request.

    Args:
        messages: The request's messages.
        count_tokens: Prompt tokens of a message list as the server renders it (chat template,
            tools and all).
        max_context: The context limit (``None``: unlimited, nothing is ever dropped).
        reserve: Tokens reserved for the output (the request's ``max_tokens``).
        policy: ``"shift"`` or ``"error"``.

    Returns:
        The retained conversation.

    Raises:
        ContextTooLong: The policy is ``error`` and the request does not fit, or the system
            messages, the newest turn and the reserve cannot fit together.
    """
    if policy not in POLICIES:
        raise ValueError(f"unknown context policy {policy!r}; use one of {POLICIES}")
    messages = list(messages)
    tokens = count_tokens(messages)
    if max_context is None or tokens + reserve <= max_context:
        return ChatShift(messages, 0, tokens)
    check_reserve(max_context, reserve)
    if policy == ERROR:
        raise ContextTooLong(
            f"the conversation takes {tokens} tokens; with max_tokens {reserve} it exceeds "
            f"the context of {max_context} tokens (context policy 'error')"
        )
    units = len(chat_turns(messages))
    for count in range(1, units):
        kept = drop_turns(messages, count)
        tokens = count_tokens(kept)
        if tokens + reserve <= max_context:
            return ChatShift(kept, count, tokens)
    newest = count_tokens(drop_turns(messages, max(units - 1, 0)))
    raise ContextTooLong(
        f"the system messages and the newest turn take {newest} tokens; with max_tokens "
        f"{reserve} they cannot fit the context of {max_context} tokens"
    )


def shift_raw(
    tokens: Sequence[int],
    max_context: Optional[int],
    reserve: int,
    keep: int = 0,
    policy: str = SHIFT,
) -> RawShift:
    """Apply the context policy to a raw (completions) prompt.

    Args:
        tokens: The prompt tokens.
        max_context: The context limit (``None``: unlimited).
        reserve: Tokens reserved for the output (the request's ``max_tokens``).
        keep: Leading tokens always kept (the configured prefix).
        policy: ``"shift"`` or ``"error"``.

    Returns:
        The retained tokens.

    Raises:
        ContextTooLong: The policy is ``error`` and the prompt does not fit, or the prefix, one
            newest token and the reserve cannot fit together.
    """
    if policy not in POLICIES:
        raise ValueError(f"unknown context policy {policy!r}; use one of {POLICIES}")
    if keep < 0:
        raise ValueError(f"the kept prefix must be >= 0 tokens, got {keep}")
    tokens = list(tokens)
    if max_context is None or len(tokens) + reserve <= max_context:
        return RawShift(tokens, 0)
    check_reserve(max_context, reserve)
    if policy == ERROR:
        raise ContextTooLong(
            f"the prompt takes {len(tokens)} tokens; with max_tokens {reserve} it exceeds the "
            f"context of {max_context} tokens (context policy 'error')"
        )
    room = max_context - reserve - keep
    if room < 1:
        raise ContextTooLong(
            f"the kept prefix ({keep} tokens), one newest token and max_tokens {reserve} "
            f"cannot fit the context of {max_context} tokens"
        )
    kept = tokens[:keep] + tokens[len(tokens) - room :]
    return RawShift(kept, len(tokens) - len(kept))
