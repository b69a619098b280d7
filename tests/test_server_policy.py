"""The context policy as a pure function: hypothesis over message lists with tool calls and tool
results, token counts from a real chat template on the demo tokenizer."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_server_support import CHAT_TEMPLATE, chat_tokens, needs_demo, with_template

from dflash import demo
from dflash.server.policy import (
    ERROR,
    PINNED_ROLES,
    ContextTooLong,
    chat_turns,
    drop_turns,
    shift_chat,
    shift_raw,
)

pytestmark = needs_demo


@pytest.fixture(scope="module")
def count():
    from mlx_lm.utils import load_tokenizer

    tokenizer = with_template(load_tokenizer(demo.DEMO_DIR / "target"), CHAT_TEMPLATE)
    return lambda messages: len(chat_tokens(tokenizer, messages))


words = st.text(alphabet="abc xyz(){}=+\n", min_size=0, max_size=12)


@st.composite
def tool_call(draw):
    name = draw(st.sampled_from(["run", "read", "add"]))
    return {
        "id": f"call_{draw(st.integers(0, 99))}",
        "type": "function",
        "function": {"name": name, "arguments": {"x": draw(st.integers(0, 9))}},
    }


@st.composite
def follow_up(draw):
    kind = draw(st.sampled_from(["assistant", "call", "tool", "system"]))
    if kind == "call":
        calls = draw(st.lists(tool_call(), min_size=1, max_size=2))
        return {"role": "assistant", "content": draw(words), "tool_calls": calls}
    return {"role": kind, "content": draw(words)}


@st.composite
def conversations(draw):
    messages = [{"role": "system", "content": draw(words)}]
    messages = messages[: draw(st.integers(0, 1))]
    if draw(st.booleans()):  # a reply before any user message: a leading unit
        messages.append({"role": "assistant", "content": draw(words)})
    for _ in range(draw(st.integers(1, 6))):
        messages.append({"role": "user", "content": draw(words)})
        messages.extend(draw(st.lists(follow_up(), max_size=3)))
    return messages


def dropped_units(messages, retained):
    """How many whole oldest units are missing; fails if a unit is partly kept."""
    kept = {id(message) for message in retained}
    states = [{id(messages[i]) in kept for i in unit} for unit in chat_turns(messages)]
    assert all(len(state) == 1 for state in states), "a turn was partly dropped"
    flags = [state.pop() for state in states]
    dropped = flags.index(True) if True in flags else len(flags)
    assert all(flags[dropped:]), "a turn newer than a kept one was dropped"
    return dropped


@settings(max_examples=80)
@given(conversations())
def test_turns_partition_the_non_system_messages_and_start_at_users(messages):
    units = chat_turns(messages)
    indices = [i for unit in units for i in unit]
    non_pinned = [i for i, m in enumerate(messages) if m["role"] not in PINNED_ROLES]
    assert indices == non_pinned
    for number, unit in enumerate(units):
        first = messages[unit[0]]["role"]
        assert first == "user" or number == 0
        assert all(messages[i]["role"] != "user" for i in unit[1:])


@settings(max_examples=60)
@given(conversations(), st.integers(20, 400), st.integers(1, 40))
def test_shift_keeps_system_messages_and_whole_newest_turns_and_fits_minimally(
    count, messages, max_context, reserve
):
    try:
        shift = shift_chat(messages, count, max_context, reserve)
    except ContextTooLong as error:
        newest = drop_turns(messages, max(len(chat_turns(messages)) - 1, 0))
        assert count(newest) + reserve > max_context, error
        return
    retained = shift.messages
    assert [m for m in messages if m["role"] in PINNED_ROLES] == [
        m for m in retained if m["role"] in PINNED_ROLES
    ]
    assert [
        m for m in messages if any(m is r for r in retained)
    ] == retained  # order kept
    assert dropped_units(messages, retained) == shift.dropped_turns
    assert retained == drop_turns(messages, shift.dropped_turns)
    assert shift.prompt_tokens == count(retained)
    assert shift.prompt_tokens + reserve <= max_context
    if shift.dropped_turns:
        fewer = drop_turns(messages, shift.dropped_turns - 1)
        assert count(fewer) + reserve > max_context, "dropped more turns than needed"
    units = chat_turns(messages)
    if units:
        newest = {id(messages[i]) for i in units[-1]}
        assert newest <= {id(m) for m in retained}


@settings(max_examples=40)
@given(conversations(), st.integers(20, 400), st.integers(1, 40))
def test_error_policy_keeps_everything_or_refuses(
    count, messages, max_context, reserve
):
    fits = count(messages) + reserve <= max_context
    try:
        shift = shift_chat(messages, count, max_context, reserve, policy=ERROR)
    except ContextTooLong:
        assert not fits
        return
    assert fits and shift.messages == messages and shift.dropped_turns == 0


def test_refusal_names_what_cannot_fit(count):
    messages = [
        {"role": "system", "content": "s" * 40},
        {"role": "user", "content": "old"},
        {"role": "user", "content": "u" * 200},
    ]
    with pytest.raises(ContextTooLong, match="system messages and the newest turn"):
        shift_chat(messages, count, 100, 10)
    with pytest.raises(ContextTooLong, match="max_tokens"):
        shift_chat(messages, count, 100, 100)


def test_without_a_limit_nothing_is_dropped(count):
    messages = [{"role": "user", "content": "x" * 500}]
    assert shift_chat(messages, count, None, 10**6).messages == messages


@settings(max_examples=200)
@given(
    st.lists(st.integers(0, 50), min_size=1, max_size=60),
    st.integers(2, 80),
    st.integers(1, 20),
    st.integers(0, 10),
)
def test_raw_shift_keeps_the_prefix_and_the_newest_suffix(
    tokens, max_context, reserve, keep
):
    try:
        shift = shift_raw(tokens, max_context, reserve, keep)
    except ContextTooLong:
        assert len(tokens) + reserve > max_context
        assert keep + 1 + reserve > max_context
        return
    if len(tokens) + reserve <= max_context:
        assert shift.tokens == tokens and shift.dropped_tokens == 0
        return
    room = max_context - reserve - keep
    assert shift.tokens == tokens[:keep] + tokens[len(tokens) - room :]
    assert len(shift.tokens) + reserve == max_context
    assert shift.dropped_tokens == len(tokens) - len(shift.tokens)


def test_raw_error_policy_refuses_what_does_not_fit():
    with pytest.raises(ContextTooLong, match="context policy 'error'"):
        shift_raw(list(range(30)), 20, 5, policy=ERROR)
    assert shift_raw(list(range(15)), 20, 5, policy=ERROR).tokens == list(range(15))
