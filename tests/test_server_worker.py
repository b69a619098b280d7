"""The generation worker from the inside: the staging swap under an injected failure and under a
client disconnect (live sessions bitwise unchanged), lossless reuse over random request
sequences, stop strings, and the error policy."""

import socket
import threading
import time

import httpx
import mlx.core as mx
import numpy as np
import pytest
import test_server_support as support
from conftest import assert_lossless, tiny_model, tiny_tokenizer
from hypothesis import given, settings
from hypothesis import strategies as st
from mlx_lm.tokenizer_utils import TokenizerWrapper
from test_dflash_loop import random_drafter

import dflash
from dflash import kernel_patch
from dflash.cache import make_prompt_cache
from dflash.server.policy import shift_chat
from dflash.server.protocol import TEXT, APIError, GenerationRequest
from dflash.server.sessions import positions
from dflash.server.worker import (
    Delta,
    Engine,
    Failed,
    Finished,
    Job,
    Started,
    StopText,
    Worker,
)

MAX_CONTEXT = 160
TOKENS = 6


class InjectedFault(RuntimeError):
    pass


class FaultyModel:
    """The target model, except that its ``fault_at``-th forward calls ``fault()``."""

    def __init__(self, model, fault_at, fault):
        self._model, self._fault_at, self._fault = model, fault_at, fault
        self.calls = 0

    def __getattr__(self, name):
        return getattr(self._model, name)

    def __call__(self, *args, **kwargs):
        self.calls += 1
        if self.calls == self._fault_at:
            self._fault()
        return self._model(*args, **kwargs)


def _raise():
    raise InjectedFault("injected rebuild failure")


def turn(index):
    return [{"role": "user", "content": f"def step_{index}(x):"}]


def settled(worker):
    """Wait until the worker finished its last job (it settles sessions after answering)."""
    deadline = time.monotonic() + 60
    while worker.busy or worker.queue.qsize():
        assert time.monotonic() < deadline, "the worker stayed busy"
        time.sleep(0.01)
    return worker.pool


def conversation_up_to_a_shift(server, tokenizer):
    """Talk until the next turn would shift; returns ``(messages, that turn's shift)``."""

    def count(messages):
        return len(support.chat_tokens(tokenizer, messages))

    messages = [{"role": "system", "content": "You write short Python functions."}]
    for index in range(40):
        candidate = messages + turn(index)
        shift = shift_chat(candidate, count, MAX_CONTEXT, TOKENS)
        if shift.dropped_turns:
            return candidate, shift
        body = {"messages": candidate, "max_tokens": TOKENS}
        reply = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=120)
        assert reply.status_code == 200, reply.text
        content = reply.json()["choices"][0]["message"]["content"]
        messages = candidate + [{"role": "assistant", "content": content}]
    raise AssertionError("the conversation never shifted")


@pytest.fixture(scope="module", params=["plain", "dflash"])
def live(request):
    flags = [
        "--chat-template",
        support.CHAT_TEMPLATE,
        "--max-context",
        str(MAX_CONTEXT),
    ]
    flags += ["--prefill-step-size", "16", "--block-size", "4"]
    if request.param == "plain":
        flags.append("--no-drafter")
    server = support.InProcessServer(flags)
    yield server, request.param
    server.close()


@support.needs_demo
def test_a_failed_rebuild_leaves_the_live_sessions_bitwise_unchanged(live):
    server, mode = live
    engine = server.worker.engine
    tokenizer = support.with_template(engine.tokenizer)
    messages, shift = conversation_up_to_a_shift(server, tokenizer)
    before = support.snapshot_sessions(settled(server.worker))
    epochs = {session.epoch for session in server.worker.pool.sessions}
    model = engine.model
    engine.model = FaultyModel(model, 2, _raise)
    try:
        body = {"messages": messages, "max_tokens": TOKENS}
        failed = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=120)
    finally:
        engine.model = model
    assert failed.status_code == 500
    assert "injected rebuild failure" in failed.json()["error"]["message"]
    assert support.snapshot_sessions(settled(server.worker)) == before
    assert httpx.get(server.url + "/health").json()["status"] == "ok"
    # The same request now succeeds: a shift, answered as a fresh generation would.
    again = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=120)
    assert again.status_code == 200
    assert again.headers["x-context-dropped-turns"] == str(shift.dropped_turns)
    assert int(again.headers["x-context-epoch"]) == max(epochs | {0}) + 1
    kwargs = {"drafter": engine.drafter, "block_size": 4} if mode == "dflash" else {}
    # The worker closes its generation (detaching its taps from this very model) after
    # the answer is sent: one generation on a model at a time.
    settled(server.worker)
    want = support.reference(
        model,
        tokenizer,
        support.chat_tokens(tokenizer, shift.messages),
        TOKENS,
        **kwargs,
    )
    assert again.json()["choices"][0]["message"]["content"] == want


def _raw_request(url: str, body: bytes) -> socket.socket:
    host, port = url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)))
    head = (
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: {host}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    )
    sock.sendall(head.encode() + body)
    return sock


@support.needs_demo
def test_a_client_leaving_during_the_rebuild_leaves_the_live_sessions_unchanged(live):
    import json

    server, _ = live
    worker = server.worker
    engine = worker.engine
    tokenizer = support.with_template(engine.tokenizer)
    messages, _ = conversation_up_to_a_shift(server, tokenizer)
    before = support.snapshot_sessions(settled(worker))
    cancelled_before = worker.stats["cancelled"]
    reached = threading.Event()

    def wait_for_the_disconnect():
        # The rebuild is mid-prefill: let the client go, and hold until the server noticed.
        reached.set()
        deadline = time.monotonic() + 60
        while not (worker.current and worker.current.cancelled.is_set()):
            assert time.monotonic() < deadline, "the disconnect was never noticed"
            time.sleep(0.01)

    model = engine.model
    engine.model = FaultyModel(model, 2, wait_for_the_disconnect)
    try:
        body = json.dumps({"messages": messages, "max_tokens": TOKENS}).encode()
        sock = _raw_request(server.url, body)
        assert reached.wait(60), "the rebuild never started"
        sock.close()
        deadline = time.monotonic() + 60
        while worker.stats["cancelled"] == cancelled_before or worker.busy:
            assert time.monotonic() < deadline
            time.sleep(0.01)
    finally:
        engine.model = model
    assert support.snapshot_sessions(settled(worker)) == before


@support.needs_demo
def test_the_error_policy_refuses_a_request_that_does_not_fit():
    flags = [
        "--chat-template",
        support.CHAT_TEMPLATE,
        "--max-context",
        "64",
        "--no-drafter",
    ]
    server = support.InProcessServer(flags + ["--context-policy", "error"])
    try:
        long = [{"role": "user", "content": "x = 1\n" * 40}]
        body = {"messages": long, "max_tokens": 8}
        response = httpx.post(server.url + "/v1/chat/completions", json=body)
        assert response.status_code == 400
        error = response.json()["error"]
        assert "context policy 'error'" in error["message"]
        assert error["code"] == "context_length_exceeded"
        short = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 8}
        assert (
            httpx.post(server.url + "/v1/chat/completions", json=short).status_code
            == 200
        )
    finally:
        server.close()


# ------------------------------------------------------------------ reuse over request sequences
@pytest.fixture(scope="module")
def tiny_engines():
    target = tiny_model("muse_glimmer", seed=0, window=16)
    tokenizer = TokenizerWrapper(tiny_tokenizer())
    plain = Engine(target, tokenizer, prefill_step_size=4)
    dflash_engine = Engine(
        target,
        tokenizer,
        drafter=random_drafter(target, block_size=4),
        prefill_step_size=4,
    )
    return {"plain": plain, "dflash": dflash_engine}


requests = st.lists(
    st.tuples(
        st.one_of(
            st.none(), st.integers(0, 5)
        ),  # continue which earlier request (or none)
        st.one_of(st.just(1.0), st.floats(0, 1)),  # how much of it to keep
        st.lists(st.integers(2, 60), min_size=1, max_size=12),  # new tokens
        st.integers(1, 6),  # max_tokens
    ),
    min_size=2,
    max_size=6,
)


def _check_session_matches_a_fresh_prefill(engine, session):
    assert set(positions(session.cache)) == {len(session.tokens)}
    if not session.tokens:
        return
    fresh = make_prompt_cache(engine.model)
    engine.model(mx.array(session.tokens)[None], cache=fresh)
    for got, want in zip(session.cache, fresh):
        for a, b in zip(got.logical_rows(), want.logical_rows()):
            np.testing.assert_allclose(np.array(a), np.array(b), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("mode", ["plain", "dflash"])
@settings(max_examples=12)
@given(sequence=requests, capacity=st.integers(1, 3))
def test_reused_sessions_answer_as_a_fresh_generation_and_hold_their_tokens(
    tiny_engines, mode, sequence, capacity
):
    engine = tiny_engines[mode]
    tokenizer = engine.tokenizer
    worker = Worker(engine, cache_size=capacity)
    histories = []
    for parent, keep, new, max_tokens in sequence:
        base = (
            histories[parent % len(histories)]
            if parent is not None and histories
            else []
        )
        tokens = base[: int(keep * len(base))] + new
        events = []
        request = GenerationRequest(kind=TEXT, max_tokens=max_tokens)
        worker.run_job(Job(tokens, request, 0, events.append))
        assert not [e for e in events if isinstance(e, Failed)], events
        assert isinstance(events[-1], Finished)
        output = [t for e in events if isinstance(e, Delta) for t in e.tokens]
        kwargs = {"drafter": engine.drafter} if engine.drafter is not None else {}
        want = [
            r.token
            for r in dflash.stream_generate(
                engine.model, tokenizer, tokens, max_tokens=max_tokens, **kwargs
            )
        ]
        common = min(len(output), len(want))
        assert_lossless(engine.model, mx.array(tokens), want[:common], output[:common])
        if output[:common] == want[:common]:
            assert len(output) == len(want)
        histories.append(tokens + output)
        assert len(worker.pool) <= capacity
        for session in worker.pool.sessions:
            _check_session_matches_a_fresh_prefill(engine, session)


# ------------------------------------------------------------------ stop strings
@settings(max_examples=200)
@given(
    text=st.text(alphabet="ab\n", max_size=30),
    stops=st.lists(st.text(alphabet="ab\n", min_size=1, max_size=3), max_size=3),
    cuts=st.lists(st.integers(0, 30), max_size=6),
)
def test_stop_text_cuts_at_the_first_stop_however_the_text_is_split(text, stops, cuts):
    hits = [text.find(stop) for stop in stops if stop in text]
    want = text[: min(hits)] if hits else text
    pieces, start = [], 0
    for cut in sorted(set(cuts)) + [len(text)]:
        pieces.append(text[start:cut])
        start = max(start, cut)
    stop_text, sent, stopped = StopText(stops), "", False
    for piece in pieces:
        out, stopped = stop_text.feed(piece)
        sent += out
        if stopped:
            break
    if not stopped:
        sent += stop_text.flush()
    assert sent == want
    assert stopped == bool(hits)


def _run(worker, tokens, max_tokens=3):
    events = []
    worker.run_job(
        Job(
            list(tokens),
            GenerationRequest(kind=TEXT, max_tokens=max_tokens),
            0,
            events.append,
        )
    )
    started = next(e for e in events if isinstance(e, Started))
    output = [t for e in events if isinstance(e, Delta) for t in e.tokens]
    return started, output


def test_pool_extends_forks_rebuilds_and_evicts_the_least_recent(tiny_engines):
    worker = Worker(tiny_engines["plain"], cache_size=2)
    a = [5, 6, 7, 8]
    started, out = _run(worker, a)
    assert (started.plan, started.cached_tokens) == ("rebuild", 0)
    longer = a + out + [9]
    started, _ = _run(worker, longer)
    assert (started.plan, started.cached_tokens) == ("extend", len(a + out))
    # A regeneration of the first prompt forks the (trimmable) session; the original stays.
    started, again = _run(worker, a)
    assert (started.plan, started.cached_tokens, again) == ("fork", len(a) - 1, out)
    assert len(worker.pool) == 2
    # An unrelated prompt is a new conversation: the least recently used session goes.
    kept = list(worker.pool.sessions[-1].tokens)
    started, _ = _run(worker, [40, 41, 42])
    assert started.plan == "rebuild" and len(worker.pool) == 2
    assert kept in [s.tokens for s in worker.pool.sessions]
    # Past the sliding window (16) a session cannot be trimmed: a regeneration rebuilds.
    long = list(range(10, 40))
    _run(worker, long)
    started, _ = _run(worker, long)
    assert (started.plan, started.cached_tokens) == ("rebuild", 0)


def test_a_byte_limit_keeps_only_what_fits_but_always_the_newest(tiny_engines):
    worker = Worker(tiny_engines["plain"], cache_size=5, cache_bytes=1)
    for prompt in ([5, 6, 7], [8, 9, 10], [11, 12, 13]):
        _run(worker, prompt)
        assert len(worker.pool) == 1
        assert worker.pool.sessions[0].tokens[:3] == prompt


def _submit(worker, tokens, max_tokens=3):
    """Queue a job on the running worker and wait for its end; its tokens."""
    events = []
    request = GenerationRequest(kind=TEXT, max_tokens=max_tokens)
    worker.submit(Job(list(tokens), request, 0, events.append))
    deadline = time.monotonic() + 120
    while not any(isinstance(e, (Finished, Failed)) for e in events):
        assert time.monotonic() < deadline, "the job never ended"
        time.sleep(0.01)
    assert not any(isinstance(e, Failed) for e in events), events
    return [t for e in events if isinstance(e, Delta) for t in e.tokens]


def test_the_worker_holds_the_verify_kernels_between_requests(
    tiny_engines, monkeypatch
):
    """Where the verify kernels are wanted (here ``DFLASH_VERIFY_KERNELS=1``: on the
    CPU their reference forms), the running worker installs them once: the model stays
    patched between requests with the same patch, the answers are those of requests
    that install the kernels themselves, and stopping the worker removes them."""
    engine = tiny_engines["dflash"]
    model = engine.model
    monkeypatch.setenv(kernel_patch.VERIFY_KERNELS_ENV, "1")
    prompts = ([5, 6, 7, 8], [30, 31, 32, 33, 34])
    alone = Worker(engine, cache_size=2)
    want = [_run(alone, prompt)[1] for prompt in prompts]
    assert not kernel_patch.is_patched(model)
    worker = Worker(engine, cache_size=2)
    worker.start()
    try:
        got = [_submit(worker, prompts[0])]
        assert kernel_patch.is_patched(model)
        held = kernel_patch._HELD_PATCHES[id(model)].patch
        got.append(_submit(worker, prompts[1]))
        assert kernel_patch._HELD_PATCHES[id(model)].patch is held
    finally:
        worker.stop()
    assert not kernel_patch.is_patched(model)
    assert id(model) not in kernel_patch._HELD_PATCHES
    assert got == want


def test_the_warm_up_runs_first_on_the_worker_thread_and_changes_no_answer(
    tiny_engines, monkeypatch
):
    """The warm-up generates once before the first job, on the generation thread with
    the verify kernels installed; it leaves no session, no counted request or token, and
    the job's answer is that of a worker without a warm-up."""
    from dflash.server.worker import WARM_UP_TEXT

    engine = tiny_engines["dflash"]
    monkeypatch.setenv(kernel_patch.VERIFY_KERNELS_ENV, "1")
    prompt = [5, 6, 7, 8]
    want = _run(Worker(engine, cache_size=2), prompt)[1]
    calls = []
    real_generate = Engine.generate

    def recording_generate(self, tokens, cache, request):
        patched = kernel_patch.is_patched(self.model)
        calls.append((list(tokens), threading.current_thread().name, patched))
        return real_generate(self, tokens, cache, request)

    monkeypatch.setattr(Engine, "generate", recording_generate)
    worker = Worker(engine, cache_size=2, warm_up=True)
    busy_while_warming = []
    real_warm_up = Engine.warm_up

    def observed_warm_up(self):
        busy_while_warming.append(worker.busy)
        return real_warm_up(self)

    monkeypatch.setattr(Engine, "warm_up", observed_warm_up)
    worker.start()
    try:
        got = _submit(worker, prompt)  # queued at once: it waits for the warm-up
        settled(worker)
    finally:
        worker.stop()
    assert got == want
    warm_up_prompt = engine.tokenizer.encode(WARM_UP_TEXT)
    assert calls[0] == (warm_up_prompt, "dflash-generation", True)
    assert [call[0] for call in calls[1:]] == [prompt]
    assert len(worker.pool) == 1
    assert worker.stats["requests"] == 1
    assert worker.stats["generated_tokens"] == len(got)
    assert worker.stats["warm_up_seconds"] > 0
    assert busy_while_warming == [True] and not worker.busy


def test_without_warm_up_nothing_runs_before_the_first_job(tiny_engines, monkeypatch):
    calls = []
    monkeypatch.setattr(Engine, "warm_up", lambda self: calls.append(self) or 0)
    worker = Worker(tiny_engines["plain"], cache_size=2)
    worker.start()
    try:
        _submit(worker, [5, 6, 7])
    finally:
        worker.stop()
    assert calls == [] and worker.stats["warm_up_seconds"] is None


def test_a_failing_warm_up_stops_the_worker_and_requests_get_503(
    tiny_engines, monkeypatch
):
    def failing_warm_up(self):
        raise InjectedFault("the kernels did not compile")

    monkeypatch.setattr(Engine, "warm_up", failing_warm_up)
    worker = Worker(tiny_engines["plain"], cache_size=2, warm_up=True)
    worker.start()
    worker._thread.join(30)
    assert isinstance(worker.failure, InjectedFault)
    assert not worker.healthy
    with pytest.raises(APIError) as raised:
        worker.submit(Job([5, 6], GenerationRequest(kind=TEXT), 0, lambda e: None))
    assert raised.value.status == 503


def test_the_warm_up_forgets_the_pacing_choice_it_started(tiny_engines, monkeypatch):
    """Its rounds compile as they go: a run-time pacing choice starts again after it."""
    from dflash.dflash_round import EVAL_EVERY_ENV
    from dflash.pacing import pacing_choices

    monkeypatch.setenv(EVAL_EVERY_ENV, "auto")
    engine = tiny_engines["dflash"]
    seen = []
    real_forget = dflash.pacing.forget_pacing

    def recording_forget(model):
        seen.append(len(pacing_choices(model)))
        real_forget(model)

    monkeypatch.setattr(dflash.pacing, "forget_pacing", recording_forget)
    assert engine.warm_up() > 0
    assert seen == [1]  # the warm-up made a choice entry, then it was dropped
    assert pacing_choices(engine.model) == {}


@pytest.mark.parametrize("kind", ["plain", "dflash"])
@pytest.mark.parametrize("max_context", [2, 3, 7, 16, 64, None])
def test_the_warm_up_fits_any_context_limit(tiny_engines, kind, max_context):
    """``--max-context`` accepts 2 and up: the warm-up stays inside whatever it is."""
    base = tiny_engines[kind]
    engine = Engine(
        base.model,
        base.tokenizer,
        drafter=base.drafter,
        max_context=max_context,
        prefill_step_size=4,
    )
    assert engine.warm_up() >= 1


@support.needs_demo
def test_the_server_warms_up_unless_told_not_to():
    from dflash.server.cli import build_parser, build_state

    for argv, wanted in (([], True), (["--no-warmup"], False)):
        state = build_state(build_parser().parse_args(argv))
        assert state.worker.warm_up is wanted
