"""dflash-generate and the demo pair: real runs on a tiny saved target + drafter, and
one-line failures."""

import importlib
import json
import shutil
import subprocess
import sys

import pytest
from conftest import save_target, tiny_model
from test_dflash_loop import random_drafter

import dflash
from dflash import demo
from dflash.loader import save_drafter


@pytest.fixture(scope="module")
def saved_pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("pair")
    target = tiny_model("muse_glimmer", seed=0, window=16)
    save_target(target, root / "target")
    save_drafter(random_drafter(target, block_size=6), str(root / "drafter"))
    return root


def cli(*args, stdin=None):
    return subprocess.run(
        [sys.executable, "-m", "dflash.generate", *args],
        capture_output=True, text=True, input=stdin, timeout=300,
    )


def test_generates_with_a_drafter_and_reports_tau(saved_pair):
    result = cli("--model", str(saved_pair / "target"), "--drafter", str(saved_pair / "drafter"),
                 "--prompt", "-", "--max-tokens", "24", "--ignore-chat-template",
                 stdin="w5 w6 w7 w8 w9 w10 w11 w12 w13 w14 w15 w16 w17 w18 w19 w20 w21")
    assert result.returncode == 0, result.stderr
    assert "tau" in result.stdout and "Accepted drafts per round" in result.stdout
    assert "Generation:" in result.stdout


@pytest.mark.parametrize(
    "args, message",
    [
        (["--max-tokens", "0"], "must be > 0"),
        (["--bogus"], "unrecognized arguments"),
        (["--model", "/nonexistent/model"], "error:"),
        (["--draft-model", "/some/draft"], "--draft-model needs --model"),
        (["--drafter", "/some/drafter"], "--drafter needs --model"),
        (["--temp", "-1"], "must be >= 0"),
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
    result = cli("--model", str(saved_pair / "target"), "--drafter", str(tmp_path / "d"))
    assert result.returncode == 1
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "hidden" in lines[0], result.stderr


def generate_main(argv):
    """``dflash-generate`` in-process (``import dflash.generate`` rebinds the attribute)."""
    importlib.import_module("dflash.generate").main(argv)


def test_no_model_uses_the_demo_pair_and_says_so_in_one_line(saved_pair, monkeypatch, capsys):
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
    assert lines[0].startswith("dflash-generate: error: the bundled demo pair is not installed: ")
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
    "missing", ["target/tokenizer.json", "target/model.safetensors", "drafter/model.safetensors"]
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
    with pytest.raises(FileNotFoundError, match="bundled demo pair is not installed: .* missing"):
        dflash.load_demo()


@pytest.mark.parametrize(
    "file, text, message",
    [
        ("target/config.json", "{not json", "not valid JSON"),
        ("target/config.json", json.dumps({"model_type": "llama"}), "model_type 'llama'"),
        ("target/model.safetensors", "garbage", "demo target .* could not be loaded"),
        ("drafter/config.json", json.dumps({"architectures": ["X"]}), "demo drafter .* could not"),
    ],
)
def test_a_broken_demo_pair_is_a_value_error_naming_it(saved_pair, tmp_path, file, text, message):
    root = copy_pair(saved_pair, tmp_path)
    (root / file).write_text(text)
    with pytest.raises(ValueError, match=message):
        dflash.load_demo(root)
