"""dflash-cache-prompt and dflash-generate --prompt-cache-file: a cached prompt continued gives
what the whole prompt gives, prefilling only the new tokens; files made for other models, and
broken files, are refused in one line."""

import json
import re
import subprocess
import sys

import mlx.core as mx
import pytest
from conftest import assert_lossless
from test_cli import ROOT, generate_main, one_error_line, saved_pair  # noqa: F401

from dflash.cli import cache_prompt as cache_prompt_cli
from dflash.cli import chat as chat_cli
from dflash.cli.common import load_models
from dflash.cli.session import new_session, read_metadata, save_session
from dflash.greedy import greedy_reference_with_margins

HEAD, TAIL = "w5 w6 w7 w8 w9 w20 w21 w22", "w30 w31"
MODES = ["plain"]


def model_flags(pair, mode):
    flags = ["--model", str(pair / "target")]
    return flags + (["--drafter", str(pair / "drafter")] if mode == "dflash" else [])


def cache_prompt(*argv):
    cache_prompt_cli.main(list(argv))


@pytest.fixture(scope="module", params=MODES)
def cached(request, saved_pair, tmp_path_factory):  # noqa: F811
    path = tmp_path_factory.mktemp("cached") / f"{request.param}.safetensors"
    cache_prompt(
        *model_flags(saved_pair, request.param),
        "--prompt",
        HEAD,
        "--prompt-cache-file",
        str(path),
    )
    return request.param, path


def generated(capsys, *argv):
    generate_main([*argv, "--max-tokens", "20"])
    out = capsys.readouterr().out
    text = out.split("=" * 10)[1].strip()
    prompt = int(re.search(r"^Prompt: (\d+) tokens", out, re.MULTILINE).group(1))
    return text, prompt


def test_the_file_records_the_names_and_every_prompt_token(
    cached, saved_pair
):  # noqa: F811
    mode, path = cached
    metadata = read_metadata(str(path))
    assert metadata["model"] == str((saved_pair / "target").resolve())
    drafter = str((saved_pair / "drafter").resolve()) if mode == "dflash" else ""
    assert metadata["drafter"] == drafter
    tokens = json.loads(metadata["tokens"]) + json.loads(metadata["pending"])
    assert tokens == [int(word[1:]) for word in HEAD.split()]


def test_a_continued_cache_gives_the_whole_prompts_output(
    cached, saved_pair, capsys
):  # noqa: F811
    mode, path = cached
    flags = model_flags(saved_pair, mode)
    whole, whole_prompt = generated(capsys, *flags, "--prompt", f"{HEAD} {TAIL}")
    continued, new_prompt = generated(
        capsys, *flags, "--prompt", TAIL, "--prompt-cache-file", str(path)
    )
    assert continued == whole
    pending = len(json.loads(read_metadata(str(path))["pending"]))
    assert whole_prompt == len((HEAD + " " + TAIL).split())
    assert new_prompt == len(TAIL.split()) + pending  # only what the file does not hold


def test_without_model_the_files_model_and_drafter_are_used(
    cached, saved_pair, capsys
):  # noqa: F811
    mode, path = cached
    named, _ = generated(
        capsys,
        *model_flags(saved_pair, mode),
        "--prompt",
        TAIL,
        "--prompt-cache-file",
        str(path),
    )
    from_file, _ = generated(capsys, "--prompt", TAIL, "--prompt-cache-file", str(path))
    assert from_file == named


def test_a_file_made_for_another_model_is_refused_by_name(cached, tmp_path, capsys):
    _, path = cached
    (tmp_path / "other").mkdir()
    with pytest.raises(SystemExit) as exit_info:
        generate_main(
            ["--model", str(tmp_path / "other"), "--prompt-cache-file", str(path)]
        )
    assert exit_info.value.code == 1
    assert one_error_line(capsys.readouterr().err).endswith(
        f"{path} was made with model {read_metadata(str(path))['model']}, not "
        f"{tmp_path / 'other'}"
    )


def test_a_file_made_without_the_drafter_is_refused_by_name(
    saved_pair, tmp_path, capsys
):  # noqa: F811
    path = tmp_path / "plain.safetensors"
    cache_prompt(
        *model_flags(saved_pair, "plain"),
        "--prompt",
        HEAD,
        "--prompt-cache-file",
        str(path),
    )
    with pytest.raises(SystemExit):
        generate_main(
            [*model_flags(saved_pair, "dflash"), "--prompt-cache-file", str(path)]
        )
    assert one_error_line(capsys.readouterr().err).endswith(
        f"{path} was made with drafter none, not {(saved_pair / 'drafter').resolve()}"
    )


def test_a_draft_model_cannot_continue_a_cache_file(
    cached, saved_pair, capsys
):  # noqa: F811
    _, path = cached
    with pytest.raises(SystemExit):
        generate_main(
            [
                "--model",
                str(saved_pair / "target"),
                "--draft-model",
                str(saved_pair / "target"),
                "--prompt-cache-file",
                str(path),
            ]
        )
    assert "takes no --draft-model" in one_error_line(capsys.readouterr().err)


def broken_copies(path, tmp_path):
    data = path.read_bytes()
    size = int.from_bytes(data[:8], "little")
    flipped = bytearray(data)
    flipped[8 + size + 5] ^= 0x40  # a byte of the cached rows
    return {
        "missing": (tmp_path / "missing.safetensors", None, "no such file"),
        "not a session": (
            tmp_path / "model.safetensors",
            b"",
            "is not a dflash session",
        ),
        "truncated": (tmp_path / "truncated.safetensors", data[: len(data) // 2], None),
        "flipped": (tmp_path / "flipped.safetensors", bytes(flipped), "checksum"),
    }


@pytest.mark.parametrize("case", ["missing", "not a session", "truncated", "flipped"])
def test_a_broken_file_is_one_line_naming_it(
    cached, saved_pair, tmp_path, case, capsys
):  # noqa: F811
    _, path = cached
    target, data, message = broken_copies(path, tmp_path)[case]
    if case == "not a session":
        target.write_bytes((saved_pair / "target" / "model.safetensors").read_bytes())
    elif data is not None:
        target.write_bytes(data)
    with pytest.raises(SystemExit) as exit_info:
        generate_main(["--prompt", TAIL, "--prompt-cache-file", str(target)])
    assert exit_info.value.code == 1
    line = one_error_line(capsys.readouterr().err)
    assert str(target) in line and (message is None or message in line), line


def test_cache_prompt_through_python_m_dflash(saved_pair, tmp_path):  # noqa: F811
    path = tmp_path / "c.safetensors"
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "dflash",
            "cache_prompt",
            *model_flags(saved_pair, "plain"),
            "--prompt",
            "-",
            "--prompt-cache-file",
            str(path),
        ],
        input=HEAD,
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    assert "Saving..." in result.stdout and re.search(
        r"Peak memory: [\d.]+ GB", result.stdout
    )
    assert json.loads(read_metadata(str(path))["tokens"])


@pytest.mark.parametrize(
    "argv, message",
    [
        ([], "the following arguments are required: --prompt-cache-file, --prompt"),
        (
            ["--prompt", "x", "--prompt-cache-file", "f", "--model", "/none"],
            "--model /none: no such directory",
        ),
        (["--prompt", "", "--prompt-cache-file", "f", "--model", "{target}"], "empty"),
    ],
)
def test_cache_prompt_failures_are_one_line(
    saved_pair, tmp_path, argv, message, capsys
):  # noqa: F811
    argv = [a.replace("{target}", str(saved_pair / "target")) for a in argv]
    argv = [str(tmp_path / a) if a == "f" else a for a in argv]
    with pytest.raises(SystemExit):
        cache_prompt(*argv)
    assert message in one_error_line(capsys.readouterr().err, "dflash-cache-prompt")
    assert not (tmp_path / "f").exists()


def test_a_dflash_chat_session_continues_through_generate(
    saved_pair, tmp_path, capsys  # noqa: F811
):
    models = load_models("test", *model_flags(saved_pair, "dflash")[1::2])
    chat = chat_cli.Chat(
        models,
        chat_cli.build_parser().parse_args(["--max-tokens", "9"]),
        new_session(models),
    )
    for query in ("w5 w6 w7", "w40 w41"):
        chat.reply(query)
    path = tmp_path / "session.safetensors"
    save_session(str(path), chat.session, models)
    capsys.readouterr()
    text, prompt = generated(capsys, "--prompt", TAIL, "--prompt-cache-file", str(path))
    assert prompt == len(TAIL.split())  # only the new tokens are prefilled
    context = mx.array(chat.session.tokens + [int(w[1:]) for w in TAIL.split()])
    reference, _ = greedy_reference_with_margins(models.model, context, 20, {0})
    assert_lossless(
        models.model, context, reference, [int(w[1:]) for w in text.split()]
    )


def test_a_dflash_cached_prompt_continues_as_the_whole_prompt(
    saved_pair, tmp_path, capsys  # noqa: F811
):
    flags = model_flags(saved_pair, "dflash")
    path = tmp_path / "dflash.safetensors"
    cache_prompt(*flags, "--prompt", HEAD, "--prompt-cache-file", str(path))
    whole, _ = generated(capsys, *flags, "--prompt", f"{HEAD} {TAIL}")
    continued, _ = generated(
        capsys, *flags, "--prompt", TAIL, "--prompt-cache-file", str(path)
    )
    assert continued == whole
