"""The context policy on a real server: a conversation long enough to shift several times, raw
prompts that shift, and the bounded queue (429 with Retry-After)."""

import threading
import time

import httpx
import openai
import pytest
import test_server_support as support

from dflash.server.policy import chat_turns, shift_chat

pytestmark = support.needs_demo

MAX_CONTEXT = 160
TOKENS = 8
KEEP = 4
FLAGS = [
    "--no-drafter",
    "--chat-template",
    support.CHAT_TEMPLATE,
    "--max-context",
    str(MAX_CONTEXT),
]
FLAGS += ["--prefill-step-size", "32", "--raw-keep-tokens", str(KEEP)]


@pytest.fixture(scope="module")
def pair():
    return support.demo_pair()[:2]


@pytest.fixture(scope="module")
def server():
    process = support.ServerProcess(*FLAGS)
    yield process
    process.close()


@pytest.fixture(scope="module")
def one_slot():
    """A server whose queue holds one waiting request."""
    process = support.ServerProcess("--no-drafter", "--queue-size", "1")
    yield process
    process.close()


@pytest.fixture(scope="module")
def fresh():
    """A second server with the same flags: what a fresh server answers."""
    process = support.ServerProcess(*FLAGS)
    yield process
    process.close()


def post_chat(server, messages, max_tokens=TOKENS):
    body = {"messages": messages, "max_tokens": max_tokens}
    response = httpx.post(server.base_url + "/chat/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text
    return response.json(), response.headers


def turn(index):
    """The messages a client adds in turn ``index``: a question, sometimes a tool exchange."""
    messages = [{"role": "user", "content": f"def step_{index}(x):"}]
    if index % 3 == 2:
        call = {
            "id": f"call_{index}",
            "type": "function",
            "function": {"name": "run", "arguments": f'{{"n": {index}}}'},
        }
        messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
        messages.append(
            {"role": "tool", "tool_call_id": f"call_{index}", "content": "ok"}
        )
    return messages


def test_a_long_conversation_shifts_whole_turns_and_answers_as_a_fresh_server(
    pair, server, fresh
):
    model, tokenizer = pair

    def count(messages):
        return len(support.chat_tokens(tokenizer, messages))

    messages = [{"role": "system", "content": "You write short Python functions."}]
    previous_dropped, previous_epoch = 0, 0
    increases = 0
    for index in range(
        8
    ):  # shifts at turns 5 and 6; turn 7 continues a shifted session
        messages += turn(index)
        shift = shift_chat(messages, count, MAX_CONTEXT, TOKENS)
        body, headers = post_chat(server, messages)
        dropped = int(headers["x-context-dropped-turns"])
        epoch = int(headers["x-context-epoch"])
        cached = body["usage"]["prompt_tokens_details"]["cached_tokens"]
        reply = body["choices"][0]["message"]["content"]
        assert dropped == shift.dropped_turns
        assert body["usage"]["prompt_tokens"] == shift.prompt_tokens
        assert shift.messages[0]["role"] == "system"  # system content always kept
        kept = chat_turns(shift.messages)
        assert len(kept) == len(chat_turns(messages)) - dropped  # whole turns only
        want = support.reference(
            model, tokenizer, support.chat_tokens(tokenizer, shift.messages), TOKENS
        )
        assert reply == want
        if dropped > previous_dropped:
            again, _ = post_chat(fresh, shift.messages)
            assert again["choices"][0]["message"]["content"] == want
        if dropped > previous_dropped:
            increases += 1
            assert epoch == previous_epoch + 1, "a shift must advance the context epoch"
        else:
            assert epoch == previous_epoch, "the same window must keep the epoch"
        if index and dropped == previous_dropped:
            assert cached > 0, "a continuation must reuse the session"
        previous_dropped, previous_epoch = dropped, epoch
        messages.append({"role": "assistant", "content": reply})
    assert increases >= 2, "the conversation should have shifted several times"


def test_chat_that_cannot_fit_is_refused_with_a_message_naming_it(server):
    messages = [
        {"role": "system", "content": "x " * 100},
        {"role": "user", "content": "y " * 100},
    ]
    body = {"messages": messages, "max_tokens": TOKENS}
    response = httpx.post(server.base_url + "/chat/completions", json=body)
    assert response.status_code == 400
    error = response.json()["error"]
    assert "system messages and the newest turn" in error["message"]
    assert error["code"] == "context_length_exceeded"


def test_raw_prompt_keeps_the_prefix_and_the_newest_suffix(pair, server):
    model, tokenizer = pair
    ids = tokenizer.encode("import os\n" + "".join(f"x{i} = {i}\n" for i in range(60)))
    assert len(ids) + TOKENS > MAX_CONTEXT
    room = MAX_CONTEXT - TOKENS - KEEP
    kept = ids[:KEEP] + ids[len(ids) - room :]
    body = {"prompt": ids, "max_tokens": TOKENS}
    response = httpx.post(server.base_url + "/completions", json=body)
    assert response.status_code == 200
    assert response.headers["x-context-dropped-tokens"] == str(len(ids) - len(kept))
    assert response.json()["usage"]["prompt_tokens"] == len(kept)
    assert response.json()["choices"][0]["text"] == support.reference(
        model, tokenizer, kept, TOKENS
    )


def test_a_full_queue_answers_429_with_retry_after_and_a_disconnect_frees_the_worker(
    pair, one_slot
):
    model, tokenizer = pair
    server = one_slot
    support.wait_idle(server.url)
    # A generation that only the client's disconnect ends (the end-of-text token is banned).
    long_body = {
        "prompt": "def main():\n",
        "max_tokens": 3000,
        "stream": True,
        "logit_bias": {str(tokenizer.eos_token_id): -1000},
    }
    queued_answer = {}
    prompt = tokenizer.encode("import sys\n")

    def queued():
        body = {"prompt": prompt, "max_tokens": TOKENS}
        queued_answer["response"] = httpx.post(
            server.base_url + "/completions", json=body, timeout=120
        )

    with httpx.stream(
        "POST", server.base_url + "/completions", json=long_body
    ) as stream:
        lines = (
            stream.iter_lines()
        )  # kept referenced: a dropped iterator closes the stream
        next(lines)  # generation is running
        waiter = threading.Thread(target=queued)
        waiter.start()
        deadline = time.monotonic() + 60
        while httpx.get(server.url + "/health").json()["queued"] < 1:
            assert time.monotonic() < deadline, "the second request never queued"
            time.sleep(0.02)
        refused = httpx.post(server.base_url + "/completions", json={"prompt": "x"})
        assert refused.status_code == 429
        assert int(refused.headers["retry-after"]) >= 1
        assert refused.json()["error"]["type"] == "rate_limit_error"
        client = openai.OpenAI(
            base_url=server.base_url, api_key="unused", max_retries=0
        )
        with pytest.raises(openai.RateLimitError):
            client.completions.create(model="demo", prompt="x", max_tokens=2)
        del lines
    waiter.join(120)  # leaving the stream disconnected the long request
    response = queued_answer["response"]
    assert response.status_code == 200
    assert response.json()["choices"][0]["text"] == support.reference(
        model, tokenizer, prompt, TOKENS
    )
    health = httpx.get(server.url + "/health").json()
    assert health["status"] == "ok" and health["cancelled"] == 1
    assert health["generated_tokens"] < 3000
