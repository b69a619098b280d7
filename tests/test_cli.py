"""dflash-generate, ``python -m dflash`` and the demo pair: real runs on a tiny saved target +
drafter, mlx-lm's output format, and one-line failures."""

import inspect
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import save_target, tiny_model
from huggingface_hub.errors import RepositoryNotFoundError
from test_dflash_loop import random_drafter

import dflash
from dflash import cli as dispatcher
from dflash import demo
from dflash.cli import generate as generate_cli
from dflash.loader import save_drafter

ROOT = Path(__file__).resolve().parent.parent
PROMPT = "w5 w6 w7 w8 w9 w10 w11 w12 w13 w14 w15 w16 w17 w18 w19 w20 w21"


@pytest.fixture(scope="module")
def saved_pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("pair")
    target = tiny_model("muse_glimmer", seed=0, window=16)
    save_target(target, root / "target")
    save_drafter(random_drafter(target, block_size=6), str(root / "drafter"))
    return root


def cli(*args, stdin=None, env=None):
    return subprocess.run(
        [sys.executable, "-m", "dflash", "generate", *args],
        capture_output=True,
        text=True,
        input=stdin,
        timeout=300,
        cwd=ROOT,
        env=None if env is None else {**os.environ, **env},
    )


def pair_flags(saved_pair):
    return [
        "--model",
        str(saved_pair / "target"),
        "--drafter",
        str(saved_pair / "drafter"),
    ]


def one_error_line(stderr, prog="dflash-generate"):
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in stderr, stderr
    assert lines[0].startswith(f"{prog}: error: "), stderr
    return lines[0]


def test_generates_with_a_drafter_and_reports_tau(saved_pair):
    result = cli(
        "--model",
        str(saved_pair / "target"),
        "--drafter",
        str(saved_pair / "drafter"),
        "--prompt",
        "-",
        "--max-tokens",
        "24",
        "--ignore-chat-template",
        stdin="w5 w6 w7 w8 w9 w10 w11 w12 w13 w14 w15 w16 w17 w18 w19 w20 w21",
    )
    assert result.returncode == 0, result.stderr
    assert "tau" in result.stdout and "Accepted drafts per round" in result.stdout
    assert "Generation:" in result.stdout


@pytest.mark.parametrize(
    "args, message",
    [
        (["--max-tokens", "0"], "expected an integer >= 1, got 0"),
        (["--bogus"], "unrecognized arguments"),
        (
            ["--model", "/nonexistent/model"],
            "--model /nonexistent/model: no such directory",
        ),
        (["--draft-model", "/some/draft"], "--draft-model needs --model"),
        (["--drafter", "/some/drafter"], "--drafter needs --model"),
        (["--temp", "-1"], "expected a number >= 0, got -1"),
    ],
)
def test_failures_print_one_line_and_exit_non_zero(args, message):
    result = cli(*args)
    assert result.returncode != 0
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], result.stderr
    assert "Traceback" not in result.stderr


def test_an_incompatible_drafter_is_one_line(saved_pair, tmp_path):
    other = tiny_model("muse_glimmer", seed=1, window=16, hidden_size=32, head_dim=8)
    save_drafter(random_drafter(other, hidden_size=32, head_dim=8), str(tmp_path / "d"))
    result = cli(
        "--model", str(saved_pair / "target"), "--drafter", str(tmp_path / "d")
    )
    assert result.returncode == 1
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "hidden" in lines[0], result.stderr


def generate_main(argv):
    """``dflash-generate`` in-process."""
    generate_cli.main(argv)


def test_no_model_uses_the_demo_pair_and_says_so_in_one_line(
    saved_pair, monkeypatch, capsys
):
    monkeypatch.setattr(demo, "DEMO_DIR", saved_pair)
    generate_main(["--prompt", "w5 w6 w7 w8 w9", "--max-tokens", "8"])
    out, err = capsys.readouterr()
    assert err.splitlines() == [
        "dflash-generate: no --model given; using the bundled demo pair "
        f"(Muse Glimmer code model + DFlash drafter, {saved_pair})"
    ]
    assert "tau" in out and "Accepted drafts per round" in out


def test_no_model_without_the_demo_pair_is_one_line(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(demo, "DEMO_DIR", tmp_path / "demo")
    with pytest.raises(SystemExit) as exit_info:
        generate_main(["--prompt", "w5"])
    assert exit_info.value.code == 1
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1
    assert lines[0].startswith(
        "dflash-generate: error: the bundled demo pair is not installed: "
    )
    assert str(tmp_path / "demo" / "target" / "config.json") in lines[0]


def test_load_demo_loads_a_pair_folder(saved_pair):
    assert dflash.demo_available(saved_pair)
    model, tokenizer, drafter = dflash.load_demo(saved_pair)
    assert drafter.config.block_size == 6
    assert tokenizer.encode("w5 w6") == [5, 6]
    assert model.args.model_type == "muse_glimmer"


def copy_pair(saved_pair, tmp_path):
    root = tmp_path / "pair"
    shutil.copytree(saved_pair, root)
    return root


@pytest.mark.parametrize(
    "missing",
    ["target/tokenizer.json", "target/model.safetensors", "drafter/model.safetensors"],
)
def test_load_demo_names_the_missing_file(saved_pair, tmp_path, missing):
    root = copy_pair(saved_pair, tmp_path)
    (root / missing).unlink()
    assert not dflash.demo_available(root)
    with pytest.raises(FileNotFoundError, match=f"{root / missing} missing"):
        dflash.load_demo(root)


def test_the_bundled_demo_message_when_not_installed(tmp_path, monkeypatch):
    monkeypatch.setattr(demo, "DEMO_DIR", tmp_path / "nothing")
    assert not dflash.demo_available()
    with pytest.raises(
        FileNotFoundError, match="bundled demo pair is not installed: .* missing"
    ):
        dflash.load_demo()


@pytest.mark.parametrize(
    "file, text, message",
    [
        ("target/config.json", "{not json", "not valid JSON"),
        (
            "target/config.json",
            json.dumps({"model_type": "llama"}),
            "model_type 'llama'",
        ),
        ("target/model.safetensors", "garbage", "demo target .* could not be loaded"),
        (
            "drafter/config.json",
            json.dumps({"architectures": ["X"]}),
            "demo drafter .* could not",
        ),
    ],
)
def test_a_broken_demo_pair_is_a_value_error_naming_it(
    saved_pair, tmp_path, file, text, message
):
    root = copy_pair(saved_pair, tmp_path)
    (root / file).write_text(text)
    with pytest.raises(ValueError, match=message):
        dflash.load_demo(root)


# -- python -m dflash and the entry points ------------------------------------------------


def project_scripts():
    """``name -> "module:function"`` of pyproject.toml's [project.scripts]."""
    text = (ROOT / "pyproject.toml").read_text()
    section = text.split("[project.scripts]", 1)[1].split("\n[", 1)[0]
    return dict(re.findall(r'^([\w.-]+) = "([\w.:]+)"$', section, re.MULTILINE))


def test_every_script_entry_point_resolves_to_a_main_function():
    scripts = project_scripts()
    assert {"dflash", "dflash-generate", "dflash-chat", "dflash-bench"} <= set(scripts)
    for name, target in scripts.items():
        module_name, function = target.split(":")
        module = __import__(module_name, fromlist=[function])
        assert callable(getattr(module, function)), name


def test_importing_the_cli_leaves_the_generate_function_in_place():
    import dflash.cli.generate  # noqa: F401

    assert inspect.isfunction(dflash.generate)
    assert "verbose" in inspect.signature(dflash.generate).parameters


def test_python_m_dflash_generate_runs_the_generate_cli(saved_pair):
    result = cli(*pair_flags(saved_pair), "--prompt", PROMPT, "--max-tokens", "6")
    assert result.returncode == 0, result.stderr
    assert "Generation: 6 tokens" in result.stdout


@pytest.mark.parametrize(
    "argv, message",
    [
        (
            [],
            "a subcommand is required: one of generate, chat, cache-prompt, bench, server",
        ),
        (["nope"], "unknown subcommand 'nope'"),
    ],
)
def test_the_dispatcher_refuses_in_one_line(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        dispatcher.main(argv)
    assert exit_info.value.code == 2
    assert message in one_error_line(capsys.readouterr().err, "dflash")


def test_a_subcommand_whose_module_is_absent_is_one_line(monkeypatch, capsys):
    monkeypatch.setitem(dispatcher.SUBCOMMANDS, "ghost", "dflash.no_such_module")
    with pytest.raises(SystemExit) as exit_info:
        dispatcher.main(["ghost", "--help"])
    assert exit_info.value.code == 1
    line = one_error_line(capsys.readouterr().err, "dflash")
    assert (
        "'ghost' subcommand is not available: dflash.no_such_module is not installed"
        in line
    )


def test_the_dispatcher_accepts_mlx_lm_underscore_spelling(monkeypatch, capsys):
    seen = {}
    monkeypatch.setattr(
        generate_cli, "main", lambda: seen.setdefault("argv", list(sys.argv))
    )
    monkeypatch.setitem(dispatcher.SUBCOMMANDS, "cache-prompt", "dflash.cli.generate")
    dispatcher.main(["cache_prompt", "--prompt", "x"])
    assert seen["argv"] == ["dflash cache-prompt", "--prompt", "x"]


# -- block size: one rule ---------------------------------------------------------------


@pytest.mark.parametrize("block_size", [7, 8, 100000])
def test_a_block_size_beyond_the_drafters_is_refused_in_one_line(
    saved_pair, block_size, capsys
):
    with pytest.raises(SystemExit) as exit_info:
        generate_main([*pair_flags(saved_pair), "--block-size", str(block_size)])
    assert exit_info.value.code == 1
    line = one_error_line(capsys.readouterr().err)
    assert f"--block-size {block_size} is outside 1..6" in line


@pytest.mark.parametrize("block_size", [1, 2, 6])
def test_every_block_size_the_drafter_serves_runs(saved_pair, block_size, capsys):
    generate_main(
        [
            *pair_flags(saved_pair),
            "--prompt",
            PROMPT,
            "--max-tokens",
            "9",
            "--block-size",
            str(block_size),
        ]
    )
    out = capsys.readouterr().out
    assert f"block {block_size}" in out and "Generation: 9 tokens" in out


def test_block_size_zero_is_refused_by_the_parser(capsys):
    with pytest.raises(SystemExit) as exit_info:
        generate_main(["--block-size", "0"])
    assert exit_info.value.code == 2
    assert "expected an integer >= 1, got 0" in one_error_line(capsys.readouterr().err)


def test_block_size_without_a_drafter_is_refused(saved_pair, capsys):
    with pytest.raises(SystemExit):
        generate_main(["--model", str(saved_pair / "target"), "--block-size", "4"])
    assert "--block-size needs a DFlash drafter" in one_error_line(
        capsys.readouterr().err
    )


# -- flag values say what they expected -------------------------------------------------


@pytest.mark.parametrize(
    "flag, value, expected",
    [
        ("--max-tokens", "ten", "expected an integer >= 1, got 'ten'"),
        ("--block-size", "big", "expected an integer >= 1, got 'big'"),
        ("--num-draft-tokens", "-1", "expected an integer >= 0, got -1"),
        ("--seed", "x", "expected an integer >= 0, got 'x'"),
        ("--temp", "hot", "expected a number >= 0, got 'hot'"),
        ("--temp", "nan", "expected a number >= 0, got nan"),
        ("--top-p", "-0.5", "expected a number >= 0, got -0.5"),
        ("--top-k", "1.5", "expected an integer >= 0, got '1.5'"),
        ("--prefill-step-size", "0", "expected an integer >= 1, got 0"),
    ],
)
def test_a_bad_flag_value_says_what_was_expected(flag, value, expected, capsys):
    with pytest.raises(SystemExit) as exit_info:
        generate_main([flag, value])
    assert exit_info.value.code == 2
    line = one_error_line(capsys.readouterr().err)
    assert line.endswith(expected) and flag in line


@pytest.mark.parametrize(
    "flag, message",
    [
        (
            ["--max-kv-size", "8"],
            "max_kv_size=8 is smaller than the model's sliding window 16",
        ),
        (["--kv-bits", "4"], "kv_bits=4 is not supported"),
    ],
)
def test_kv_flags_dflash_cannot_honour_are_refused_in_one_line(
    saved_pair, flag, message, capsys
):
    with pytest.raises(SystemExit):
        generate_main([*pair_flags(saved_pair), *flag])
    assert message in one_error_line(capsys.readouterr().err)


def test_a_max_kv_size_the_windows_fit_in_runs_as_mlx_lms_no_op(saved_pair, capsys):
    argv = [*pair_flags(saved_pair), "--prompt", PROMPT, "-m", "6", "--verbose", "F"]
    generate_main(argv)
    plain = capsys.readouterr().out
    generate_main([*argv, "--max-kv-size", "16"])
    assert capsys.readouterr().out == plain


def test_xtc_flags_reach_the_sampler(saved_pair, capsys):
    with pytest.raises(SystemExit):
        generate_main(["--xtc-probability", "1.5"])
    assert "xtc_probability must be in [0, 1], got 1.5" in one_error_line(
        capsys.readouterr().err
    )
    generate_main(
        [
            *pair_flags(saved_pair),
            "--prompt",
            PROMPT,
            "-m",
            "6",
            "--temp",
            "0.8",
            "--xtc-probability",
            "0.5",
            "--seed",
            "3",
        ]
    )
    assert "Generation: 6 tokens" in capsys.readouterr().out


@pytest.mark.parametrize("dflash_run", [False, True])
def test_a_prompt_token_outside_the_models_vocabulary_is_one_line(
    tmp_path, dflash_run, capsys
):
    # The saved tokenizer knows 256 words; this target only 128 ids.
    target = tiny_model("muse_glimmer", seed=0, window=16, vocab_size=128)
    save_target(target, tmp_path / "target")
    argv = ["--model", str(tmp_path / "target"), "--prompt", "w5 w200", "-m", "4"]
    if dflash_run:
        drafter = random_drafter(target, block_size=4, mask_token_id=127)
        save_drafter(drafter, str(tmp_path / "drafter"))
        argv += ["--drafter", str(tmp_path / "drafter")]
    with pytest.raises(SystemExit) as exit_info:
        generate_main(argv)
    assert exit_info.value.code == 1
    captured = capsys.readouterr()
    assert "prompt token id 200 is outside the vocabulary" in one_error_line(
        captured.err
    )
    assert captured.out == ""  # refused before anything is printed


# -- model names: a missing path, an unreachable hub -------------------------------------


@pytest.mark.parametrize("flag", ["--model", "--drafter", "--draft-model"])
def test_a_missing_local_path_says_it_does_not_exist(saved_pair, flag, capsys):
    flags = {"--model": str(saved_pair / "target")}
    flags[flag] = "/nonexistent/place"
    argv = [item for pair in flags.items() for item in pair]
    with pytest.raises(SystemExit):
        generate_main(argv)
    assert one_error_line(capsys.readouterr().err).endswith(
        f"{flag} /nonexistent/place: no such directory"
    )


def test_a_file_given_as_a_model_is_not_a_directory(saved_pair, capsys):
    with pytest.raises(SystemExit):
        generate_main(["--model", str(saved_pair / "target" / "config.json")])
    assert one_error_line(capsys.readouterr().err).endswith(
        "config.json: not a directory"
    )


@pytest.mark.parametrize(
    "env, reason",
    [
        (
            {"HF_ENDPOINT": "http://127.0.0.1:9"},
            "the Hugging Face hub cannot be reached",
        ),
        (
            {"HF_HUB_OFFLINE": "1"},
            "the Hugging Face hub is off (HF_HUB_OFFLINE is set)",
        ),
    ],
)
def test_an_unreachable_hub_says_so_and_that_the_model_is_not_cached(
    env, reason, tmp_path
):
    env = {**env, "HF_HUB_CACHE": str(tmp_path / "hub")}
    result = cli("--model", "someone/some-model", env=env)
    assert result.returncode == 1
    line = one_error_line(result.stderr)
    assert line.endswith(
        f"--model someone/some-model: not a local directory; {reason} and someone/some-model "
        f"is not in the local Hugging Face cache ({tmp_path / 'hub'})"
    )


def test_a_repository_the_hub_does_not_have_says_so(monkeypatch, capsys):
    import mlx_lm.utils

    def no_such_repo(*args, **kwargs):
        error = RepositoryNotFoundError.__new__(RepositoryNotFoundError)
        Exception.__init__(error, "404 Client Error")
        raise error

    monkeypatch.setattr(mlx_lm.utils, "snapshot_download", no_such_repo)
    with pytest.raises(SystemExit):
        generate_main(["--model", "someone/missing"])
    assert one_error_line(capsys.readouterr().err).endswith(
        "--model someone/missing: not a local directory, and the Hugging Face hub has no "
        "such model (or it is private or gated)"
    )


# -- output: the prompt, mlx-lm's statistics, acceptance for both speculative kinds ------


STATS = [
    r"Prompt: \d+ tokens, [\d.]+ tokens-per-sec",
    r"Generation: (\d+) tokens, [\d.]+ tokens-per-sec",
]
PEAK = r"Peak memory: [\d.]+ GB"


def stats_tail(out, acceptance_head):
    """The lines after the second rule, checked against mlx-lm's format."""
    lines = out.splitlines()
    rules = [i for i, line in enumerate(lines) if line == "=" * 10]
    assert len(rules) == 2, out
    tail = lines[rules[1] + 1 :]
    patterns = STATS + [
        acceptance_head,
        r"Accepted drafts per round \(n:rounds\): (.*)",
        PEAK,
    ]
    assert len(tail) == len(patterns), tail
    matches = [re.fullmatch(p, line) for p, line in zip(patterns, tail)]
    assert all(matches), tail
    return lines, rules, matches


def check_rounds(generated, rounds, tau, histogram):
    counts = dict(item.split(":") for item in histogram.split())
    assert sum(int(c) for c in counts.values()) == rounds
    assert round(tau * rounds) == generated


def test_the_prompt_is_echoed_above_a_rule_and_dflash_statistics_follow(
    saved_pair, capsys
):
    generate_main([*pair_flags(saved_pair), "--prompt", PROMPT, "--max-tokens", "12"])
    out = capsys.readouterr().out
    lines, rules, matches = stats_tail(
        out, r"DFlash: (\d+) rounds, tau ([\d.]+) tokens/round, block 6"
    )
    assert lines[: rules[0]] == [PROMPT]
    assert matches[1].group(1) == "12"
    check_rounds(
        12, int(matches[2].group(1)), float(matches[2].group(2)), matches[3].group(1)
    )


def test_a_draft_model_run_prints_acceptance_statistics(saved_pair, tmp_path, capsys):
    save_target(
        tiny_model("muse_glimmer", seed=3, num_hidden_layers=2), tmp_path / "draft"
    )
    generate_main(
        [
            "--model",
            str(saved_pair / "target"),
            "--draft-model",
            str(tmp_path / "draft"),
            "--num-draft-tokens",
            "4",
            "--prompt",
            PROMPT,
            "--max-tokens",
            "15",
        ]
    )
    out = capsys.readouterr().out
    _, _, matches = stats_tail(
        out,
        r"Draft model: (\d+) rounds, tau ([\d.]+) tokens/round, 4 draft tokens/round",
    )
    check_rounds(
        15, int(matches[2].group(1)), float(matches[2].group(2)), matches[3].group(1)
    )


def test_verbose_false_prints_only_the_text(saved_pair, capsys):
    generate_main(
        [
            *pair_flags(saved_pair),
            "--prompt",
            PROMPT,
            "--max-tokens",
            "5",
            "--verbose",
            "False",
        ]
    )
    out = capsys.readouterr().out
    assert len(out.split()) == 5 and all(re.fullmatch(r"w\d+", w) for w in out.split())


def test_an_extra_eos_token_ends_the_text_before_it(saved_pair, capsys):
    base = [
        *pair_flags(saved_pair),
        "--prompt",
        PROMPT,
        "--max-tokens",
        "8",
        "--verbose",
        "F",
    ]
    generate_main(base)
    words = capsys.readouterr().out.split()
    stop = next(w for w in words[2:] if w not in words[:2])
    generate_main([*base, "--extra-eos-token", stop])
    assert capsys.readouterr().out.split() == words[: words.index(stop)]


def test_a_closed_output_pipe_ends_the_run_quietly(saved_pair):
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "dflash",
            "generate",
            *pair_flags(saved_pair),
            "--prompt",
            PROMPT,
            "--max-tokens",
            "300",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=ROOT,
    )
    assert process.stdout.readline().strip() == PROMPT
    process.stdout.close()  # as `| head -1` does
    stderr = process.stderr.read()
    assert process.wait(timeout=300) == 141
    assert stderr == ""
