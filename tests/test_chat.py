"""dflash-chat: the session cache carries over between turns (each turn prefills only its new
tokens, each reply is the target's greedy continuation of the whole conversation), Ctrl-C
stops a reply and keeps exactly what was shown, and the stdin-driven CLI in a subprocess.
"""

import json
import os
import signal
import subprocess
import sys
import threading
import time
from types import SimpleNamespace

import mlx.core as mx
import pytest
from conftest import assert_lossless
from hypothesis import given, settings
from hypothesis import strategies as st
from test_cli import ROOT, one_error_line, saved_pair  # noqa: F401 (the fixture)

from dflash.cli import cache_prompt as cache_prompt_cli
from dflash.cli import chat as chat_cli
from dflash.cli.common import load_models
from dflash.cli.session import read_metadata
from dflash.greedy import greedy_reference_with_margins

EOS = 0
# Greedy continuations of these prompts on the saved pair run 400 tokens without the EOS.
LONG_PROMPT, NEXT_PROMPT = "w3 w4", "w200 w201"
MODES = ["plain", "dflash"]


def model_flags(pair, mode):
    flags = ["--model", str(pair / "target")]
    return flags + (["--drafter", str(pair / "drafter")] if mode == "dflash" else [])


@pytest.fixture(autouse=True)
def ctrl_c_at_its_default():
    """Ctrl-C as a terminal's Python has it, whatever this process inherited (pytest run as
    a background job of a script starts with it ignored, which the chat keeps)."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


@pytest.fixture(scope="module")
def loaded(saved_pair):  # noqa: F811
    return {
        mode: load_models("test", *model_flags(saved_pair, mode)[1::2])
        for mode in MODES
    }


def make_chat(models, *flags):
    args = chat_cli.build_parser().parse_args(list(flags))
    return chat_cli.Chat(models, args, chat_cli.new_session(models))


def assert_replies_are_greedy_continuations(model, session):
    """Each reply equals the target's own greedy continuation of everything before it."""
    start = 0
    for prompt_size, reply_size in session.turns:
        context = session.tokens[: start + prompt_size]
        reply = session.tokens[start + prompt_size : start + prompt_size + reply_size]
        reference, _ = greedy_reference_with_margins(
            model, mx.array(context), reply_size, {EOS}
        )
        assert_lossless(model, mx.array(context), reference, reply)
        start += prompt_size + reply_size
    assert start == len(session.tokens)


def test_plain_turn_text_is_the_documented_fallback():
    assert chat_cli.plain_turn_text("hi", None, True) == "hi\n"
    assert chat_cli.plain_turn_text("hi", "Be brief.", True) == "Be brief.\n\nhi\n"
    assert chat_cli.plain_turn_text("hi", "Be brief.", False) == "\nhi\n"


@pytest.mark.parametrize("mode", MODES)
def test_each_turn_prefills_only_its_new_tokens(loaded, mode, capsys):
    models = loaded[mode]
    chat = make_chat(models, "--max-tokens", "12", "--system-prompt", "w9 w9")
    for query in ("w5 w6 w7", "w8", "w10 w11 w12 w13"):
        before = len(chat.session.tokens)
        chat.reply(query)
        prompt_size, reply_size = chat.session.turns[-1]
        expected = chat_cli.turn_tokens(models.tokenizer, query, "w9 w9", before == 0)
        assert chat.session.tokens[before : before + prompt_size] == expected
        assert chat.session.position == before + prompt_size + reply_size
        assert (
            f"prompt {prompt_size} tokens" in capsys.readouterr().out.splitlines()[-1]
        )
    assert_replies_are_greedy_continuations(models.model, chat.session)


def interrupting_print(after):
    """A ``print`` that sends this process SIGINT once ``after`` reply pieces are printed."""
    printed = {"pieces": 0}

    def fake_print(*args, **kwargs):
        if kwargs.get("end") == "":
            printed["pieces"] += 1
            if printed["pieces"] == after:
                os.kill(os.getpid(), signal.SIGINT)
        print(*args, **kwargs)

    return fake_print


turn = st.tuples(
    st.lists(st.integers(2, 255), min_size=1, max_size=5),  # the message's words
    st.integers(1, 30),  # max tokens
    st.one_of(st.none(), st.integers(1, 30)),  # Ctrl-C after this many pieces
)


@pytest.mark.parametrize("mode", MODES)
@settings(max_examples=12)
@given(turns=st.lists(turn, min_size=1, max_size=4))
def test_any_sequence_of_turns_keeps_the_session_exact(loaded, mode, turns):
    models = loaded[mode]
    chat = make_chat(models)
    for words, max_tokens, stop_after in turns:
        chat.args.max_tokens = max_tokens
        with pytest.MonkeyPatch.context() as patch:
            if stop_after is not None:
                patch.setattr(
                    chat_cli, "print", interrupting_print(stop_after), raising=False
                )
            chat.reply(" ".join(f"w{w}" for w in words))
        _, reply_size = chat.session.turns[-1]
        if stop_after is not None and stop_after < max_tokens and chat.stop.requested:
            assert reply_size == stop_after
    assert_replies_are_greedy_continuations(models.model, chat.session)


def test_a_second_ctrl_c_in_a_reply_quits_and_the_session_is_not_saved(
    loaded, tmp_path, capsys
):
    path = tmp_path / "s.safetensors"
    chat = make_chat(loaded["plain"], "-m", "30", "--save-session", str(path))

    def pressing_twice(*args, **kwargs):
        if kwargs.get("end") == "":
            os.kill(os.getpid(), signal.SIGINT)  # asks the reply to stop
            os.kill(os.getpid(), signal.SIGINT)  # forces the quit
        print(*args, **kwargs)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(chat_cli, "print", pressing_twice, raising=False)
        with pytest.raises(KeyboardInterrupt):
            chat.reply("w5 w6")
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    assert not chat.consistent and chat.session.turns == []
    chat_cli._save(chat.args, chat)
    assert not path.exists()
    assert (
        "session not saved: a forced quit cut a reply short" in capsys.readouterr().err
    )


@pytest.mark.parametrize("mode", MODES)
def test_reset_starts_an_empty_session(loaded, mode, monkeypatch, capsys):
    models = loaded[mode]
    chat = make_chat(models, "--max-tokens", "5")
    monkeypatch.setattr("sys.stdin", __import__("io").StringIO("w5 w6\nr\nw5 w6\n"))
    chat.loop()
    out = capsys.readouterr().out
    assert "reset: context cleared" in out
    assert chat.session.turns == [(2, 5)]
    assert_replies_are_greedy_continuations(models.model, chat.session)


# -- the CLI in a subprocess, driven through stdin ---------------------------------------


class ChatProcess:
    """``python -m dflash chat`` with a pipe on stdin and stdout read in the background."""

    def __init__(self, *flags, ctrl_c=signal.SIG_DFL):
        self.process = subprocess.Popen(
            [sys.executable, "-m", "dflash", "chat", *flags],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            cwd=ROOT,
            # As a terminal starts it, whatever this process inherited: pytest started
            # as a background job of a script runs with Ctrl-C ignored, and so would it.
            preexec_fn=lambda: signal.signal(signal.SIGINT, ctrl_c),
        )
        self.out = b""
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self):
        while chunk := os.read(self.process.stdout.fileno(), 4096):
            self.out += chunk

    def text(self):
        return self.out.decode()

    def send(self, line):
        self.process.stdin.write(line.encode() + b"\n")
        self.process.stdin.flush()

    def wait_for(self, condition, timeout=240):
        deadline = time.monotonic() + timeout
        while not condition(self.text()):
            assert self.process.poll() is None or condition(self.text()), self.finish()
            assert time.monotonic() < deadline, self.text()
            time.sleep(0.005)

    def finish(self):
        self.process.stdin.close()
        code = self.process.wait(timeout=240)
        self.reader.join(timeout=10)
        return code, self.text(), self.process.stderr.read().decode()


def ids(text):
    """Token ids of the tiny tokenizer's text (token ``i`` prints as ``w{i}``; encoding
    splits words that start with the unknown token ``w1``, so the words are read instead).
    """
    return [int(word[1:]) for word in text.split()]


def replies(out):
    """``(reply text, turn line)`` of each turn in the chat's stdout."""
    pieces = out.split(chat_cli.PROMPT_MARK)[1:]
    return [tuple(piece.rsplit("\n  ", 1)) for piece in pieces if "\n  " in piece]


@pytest.mark.parametrize("mode", MODES)
def test_ctrl_c_stops_a_reply_and_the_next_turn_continues_what_was_shown(
    saved_pair, mode
):  # noqa: F811
    chat = ChatProcess(*model_flags(saved_pair, mode), "--max-tokens", "400")
    chat.send(LONG_PROMPT)
    # A few words of the reply are out: interrupt it mid-reply.
    chat.wait_for(lambda out: len(out.partition(chat_cli.PROMPT_MARK)[2].split()) >= 3)
    chat.process.send_signal(signal.SIGINT)
    chat.wait_for(
        lambda out: "[interrupted]" in out and out.endswith(chat_cli.PROMPT_MARK)
    )
    chat.send(NEXT_PROMPT)
    chat.wait_for(lambda out: out.count(chat_cli.PROMPT_MARK) == 3)
    chat.send("q")
    code, out, err = chat.finish()
    assert code == 0, err
    (first, first_line), (second, second_line) = replies(out)
    assert (
        first_line.startswith("[interrupted] ") and "[interrupted]" not in second_line
    )
    shown = first.split()
    assert 3 <= len(shown) < 400
    assert (
        f"prompt {len(NEXT_PROMPT.split())} tokens" in second_line
    )  # only the new tokens
    # The session holds the interrupted reply exactly as shown: the second reply is the
    # target's greedy continuation of the conversation with exactly those words in it.
    models = load_models("test", str(saved_pair / "target"))
    context = ids(LONG_PROMPT) + ids(first) + ids(NEXT_PROMPT)
    second_tokens = ids(second)
    reference, _ = greedy_reference_with_margins(
        models.model, mx.array(context), 400, {EOS}
    )
    if reference[-1] == EOS:
        reference = reference[:-1]  # the EOS ends the reply and is not printed
    assert_lossless(models.model, mx.array(context), reference, second_tokens)


def test_a_chat_started_with_ctrl_c_ignored_keeps_ignoring_it(saved_pair):  # noqa: F811
    chat = ChatProcess(
        "--model", str(saved_pair / "target"), "-m", "200", ctrl_c=signal.SIG_IGN
    )
    chat.send(LONG_PROMPT)  # no EOS in 200 tokens: the press lands mid-reply
    chat.wait_for(lambda out: len(out.partition(chat_cli.PROMPT_MARK)[2].split()) >= 3)
    chat.process.send_signal(signal.SIGINT)  # mid-reply
    chat.wait_for(lambda out: out.count(chat_cli.PROMPT_MARK) == 2)
    chat.process.send_signal(signal.SIGINT)  # at the prompt
    chat.send("q")
    code, out, err = chat.finish()
    assert code == 0, (out, err)
    ((reply, line),) = replies(out)
    assert line.startswith("200 tokens") and len(reply.split()) == 200, out


# -- sessions on disk --------------------------------------------------------------------


def run_chat(flags, lines):
    result = subprocess.run(
        [sys.executable, "-m", "dflash", "chat", *flags],
        input="\n".join([*lines, "q"]) + "\n",
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    return result


def saved(path):
    metadata = read_metadata(str(path))
    return SimpleNamespace(
        tokens=json.loads(metadata["tokens"]),
        turns=[tuple(turn) for turn in json.loads(metadata["turns"])],
    )


@pytest.mark.parametrize("mode", MODES)
def test_a_saved_and_reloaded_session_continues_as_the_unbroken_one(
    saved_pair, mode, tmp_path  # noqa: F811
):
    flags = [*model_flags(saved_pair, mode), "--max-tokens", "10"]
    turns = ["w5 w6 w7", "w8 w9", "w40 w41 w42"]
    first, second, whole = (tmp_path / f"{n}.safetensors" for n in "abc")
    run_chat([*flags, "--save-session", str(first)], turns[:2])
    resumed = run_chat(
        [*flags, "--load-session", str(first), "--save-session", str(second)], turns[2:]
    )
    unbroken = run_chat([*flags, "--save-session", str(whole)], turns)
    assert "session of" in resumed.stdout.splitlines()[0]
    assert saved(second) == saved(whole)
    assert replies(resumed.stdout)[-1][0] == replies(unbroken.stdout)[-1][0]
    models = load_models("test", *model_flags(saved_pair, mode)[1::2])
    assert_replies_are_greedy_continuations(models.model, saved(whole))


def test_a_session_of_another_model_is_refused_by_name(
    saved_pair, tmp_path
):  # noqa: F811
    path = tmp_path / "s.safetensors"
    run_chat(
        ["--model", str(saved_pair / "target"), "--save-session", str(path)], ["w5"]
    )
    (tmp_path / "other").mkdir()
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "dflash",
            "chat",
            "--model",
            str(tmp_path / "other"),
            "--load-session",
            str(path),
        ],
        input="q\n",
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=300,
    )
    assert result.returncode == 1
    line = one_error_line(result.stderr, "dflash-chat")
    assert line.endswith(
        f"{path} was made with model {(saved_pair / 'target').resolve()}, not "
        f"{tmp_path / 'other'}"
    )


def test_ctrl_c_at_the_prompt_saves_the_session_and_quits(
    saved_pair, tmp_path
):  # noqa: F811
    path = tmp_path / "s.safetensors"
    chat = ChatProcess(
        "--model", str(saved_pair / "target"), "-m", "5", "--save-session", str(path)
    )
    chat.send("w5 w6")
    chat.wait_for(lambda out: out.count(chat_cli.PROMPT_MARK) == 2)
    chat.process.send_signal(signal.SIGINT)
    code, out, err = chat.finish()
    assert code == 130 and f"session saved to {path}" in err, (code, out, err)
    assert saved(path).turns == [(2, 5)]


def test_a_cached_prompt_loads_as_a_session(saved_pair, tmp_path):  # noqa: F811
    path = tmp_path / "c.safetensors"
    flags = ["--model", str(saved_pair / "target")]
    cache_prompt_cli.main(
        [*flags, "--prompt", "w5 w6 w7", "--prompt-cache-file", str(path)]
    )
    run_chat(
        [*flags, "-m", "6", "--load-session", str(path), "--save-session", str(path)],
        ["w8"],
    )
    session = saved(path)
    assert session.tokens[:4] == [5, 6, 7, 8] and len(session.tokens) == 4 + 6
