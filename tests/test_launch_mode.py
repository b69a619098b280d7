"""The commands ask mlx's CUDA backend for direct launches before any GPU work, and keep
a value the user set (dflash.launch_mode)."""

import os

import pytest

from dflash import prefer_direct_launches
from dflash.cli import chat, generate
from dflash.launch_mode import GRAPHS_ENV
from dflash.server import cli as server_cli


def test_direct_launches_are_asked_for_only_where_nothing_was_chosen():
    environ = {}
    assert prefer_direct_launches(environ) is True
    assert environ == {GRAPHS_ENV: "0"}
    # A second call, and a value the user set, are kept as they are.
    assert prefer_direct_launches(environ) is False
    assert environ == {GRAPHS_ENV: "0"}
    chosen = {GRAPHS_ENV: "1"}
    assert prefer_direct_launches(chosen) is False
    assert chosen == {GRAPHS_ENV: "1"}


def test_the_process_environment_is_the_default(monkeypatch):
    monkeypatch.delenv(GRAPHS_ENV, raising=False)
    assert prefer_direct_launches() is True
    assert os.environ[GRAPHS_ENV] == "0"


class _Stop(Exception):
    pass


def _seen_at_model_load(monkeypatch, module, attribute, main, argv):
    """What ``MLX_USE_CUDA_GRAPHS`` held when the command first loaded its models (the
    load stands in for the first GPU evaluation, which comes after it)."""
    seen = []

    def load(*args, **kwargs):
        seen.append(os.environ.get(GRAPHS_ENV))
        raise _Stop("stopped at the model load")

    monkeypatch.setattr(module, attribute, load)
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code != 0 and len(seen) == 1
    return seen[0]


COMMANDS = [
    (generate, "load_models", generate.main, ["--prompt", "hi"]),
    (chat, "load_models", chat.main, []),
    (server_cli, "build_state", server_cli.main, ["--port", "0"]),
]


@pytest.mark.parametrize("module, attribute, main, argv", COMMANDS)
@pytest.mark.parametrize("given, expected", [(None, "0"), ("1", "1"), ("0", "0")])
def test_each_command_chooses_before_its_models_load_and_keeps_the_users_value(
    monkeypatch, capsys, module, attribute, main, argv, given, expected
):
    if attribute == "build_state":
        pytest.importorskip("uvicorn")
    if given is None:
        monkeypatch.delenv(GRAPHS_ENV, raising=False)
    else:
        monkeypatch.setenv(GRAPHS_ENV, given)
    assert _seen_at_model_load(monkeypatch, module, attribute, main, argv) == expected
    assert "stopped at the model load" in capsys.readouterr().err
