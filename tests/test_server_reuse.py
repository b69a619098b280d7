"""Prompt-cache reuse across requests on a real server: a continuing conversation prefills only
its new tokens, reports them as cached, and still answers what a fresh generation answers.
"""

import httpx
import openai
import pytest
import test_server_support as support

import dflash
from dflash import demo

pytestmark = support.needs_demo

TOKENS = 8
TARGET = str(demo.DEMO_DIR / "target")


@pytest.fixture(scope="module")
def plain():
    model, tokenizer, _ = dflash.load_demo()
    process = support.ServerProcess(
        "--no-drafter", "--chat-template", support.CHAT_TEMPLATE
    )
    yield process, (model, support.with_template(tokenizer), {})
    process.close()


@pytest.fixture(scope="module")
def classic():
    from mlx_lm import load

    model, tokenizer = load(TARGET)
    draft, _ = load(TARGET)
    process = support.ServerProcess(
        "--model",
        TARGET,
        "--draft-model",
        TARGET,
        "--chat-template",
        support.CHAT_TEMPLATE,
    )
    yield process, (model, support.with_template(tokenizer), {"draft_model": draft})
    process.close()


def ask(server, messages, max_tokens=TOKENS):
    client = openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0)
    response = client.chat.completions.with_raw_response.create(
        model="default_model", messages=messages, max_tokens=max_tokens, temperature=0
    )
    return response.parse(), response.headers


def check_conversation(server, pair):
    model, tokenizer, kwargs = pair
    messages = [
        {"role": "system", "content": "Write Python."},
        {"role": "user", "content": "def fibonacci(n):"},
    ]
    first, _ = ask(server, messages)
    first_prompt = support.chat_tokens(tokenizer, messages)
    assert first.usage.prompt_tokens == len(first_prompt)
    messages += [
        {"role": "assistant", "content": first.choices[0].message.content},
        {"role": "user", "content": "class Stack:"},
    ]
    second, headers = ask(server, messages)
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached >= len(first_prompt), "turn 2 did not reuse turn 1's prompt"
    assert headers["x-cached-tokens"] == str(cached)
    prompt = support.chat_tokens(tokenizer, messages)
    assert second.usage.prompt_tokens == len(prompt)
    fresh = support.reference(model, tokenizer, prompt, TOKENS, **kwargs)
    assert second.choices[0].message.content == fresh
    # The same request again (a regeneration) reuses all but the last prompt token.
    again, _ = ask(server, messages)
    assert again.choices[0].message.content == fresh
    assert again.usage.prompt_tokens_details.cached_tokens == len(prompt) - 1


def test_plain_second_turn_reports_cached_tokens_and_answers_as_fresh(plain):
    check_conversation(*plain)


def test_classic_draft_second_turn_reports_cached_tokens_and_answers_as_fresh(classic):
    check_conversation(*classic)


def test_completions_continuing_a_prompt_prefill_only_the_new_tokens(plain):
    server, (model, tokenizer, _) = plain
    ids = tokenizer.encode("import os\n")
    url = server.base_url + "/completions"
    first = httpx.post(url, json={"prompt": ids, "max_tokens": TOKENS}).json()
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    more = tokenizer.encode("import sys\n")
    longer = ids + tokenizer.encode(first["choices"][0]["text"]) + more
    second = httpx.post(url, json={"prompt": longer, "max_tokens": TOKENS}).json()
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] >= len(ids)
    assert second["choices"][0]["text"] == support.reference(
        model, tokenizer, longer, TOKENS
    )


def test_other_conversations_keep_their_own_sessions(plain):
    server, (model, tokenizer, _) = plain
    a = [{"role": "user", "content": "def area(r):"}]
    b = [{"role": "user", "content": "def volume(r):"}]
    ask(server, a)
    ask(server, b)
    # Both are still cached: repeating either reuses all but its last token.
    for messages in (a, b):
        response, _ = ask(server, messages)
        prompt = support.chat_tokens(tokenizer, messages)
        assert response.usage.prompt_tokens_details.cached_tokens == len(prompt) - 1
        assert response.choices[0].message.content == support.reference(
            model, tokenizer, prompt, TOKENS
        )


def test_a_disconnected_stream_leaves_a_session_that_continues_correctly(plain):
    server, (model, tokenizer, _) = plain
    prompt = tokenizer.encode("class Queue:\n")
    body = {"prompt": prompt, "max_tokens": 200, "stream": True}
    with httpx.stream("POST", server.base_url + "/completions", json=body) as response:
        lines = response.iter_lines()
        for _ in range(4):
            next(lines)
    # The session holds the prompt and whatever was emitted: the prompt again forks it.
    again = httpx.post(
        server.base_url + "/completions", json={"prompt": prompt, "max_tokens": TOKENS}
    ).json()
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == len(prompt) - 1
    assert again["choices"][0]["text"] == support.reference(
        model, tokenizer, prompt, TOKENS
    )
