"""dflash-generate: a real run on a tiny saved model + drafter, and one-line failures."""

import json
import subprocess
import sys

import mlx.core as mx
import pytest
from conftest import tiny_model, tiny_tokenizer
from mlx.utils import tree_flatten
from test_dflash_loop import random_drafter

from dflash.loader import save_drafter


def save_target(model, path):
    path.mkdir()
    mx.save_safetensors(str(path / "model.safetensors"), dict(tree_flatten(model.parameters())))
    config = {k: v for k, v in vars(model.args).items() if not k.startswith("_")}
    (path / "config.json").write_text(json.dumps(config))
    tiny_tokenizer().save_pretrained(str(path))


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
        ([], "no --model given"),
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
