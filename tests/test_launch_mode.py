"""The commands ask mlx's CUDA backend for direct launches before any GPU work, and keep
a value the user set (dflash.launch_mode)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dflash import kernel_patch, launch_mode, prefer_direct_launches
from dflash.cli import chat, generate
from dflash.cli.common import (
    config_architecture,
    config_projection_form,
    target_prefers_direct_launches,
)
from dflash.launch_mode import GRAPHS_ENV
from dflash.server import cli as server_cli


@pytest.fixture(autouse=True)
def _keep_the_mark(monkeypatch):
    """The commands' ``prefer_direct_launches`` marks the module: undone after."""
    monkeypatch.setattr(launch_mode, "_set_before_use", launch_mode._set_before_use)


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

# mlx-lm's config entry for a 4-bit model whose matmuls run dflash's kernel on CUDA.
QUANTIZED = {
    "model_type": "muse_glimmer",
    "quantization": {"group_size": 64, "bits": 4},
}
# One whose rounds the device paces, with mlx's matmuls (session 70, an H100) or with
# dflash's (session 71): mlx's graphs measured faster either way.
EIGHT_BIT = {
    "model_type": "muse_glimmer",
    "quantization": {"group_size": 64, "bits": 8},
}


def _model_dir(root: Path, config) -> str:
    """A model folder holding only ``config.json`` (the load is stubbed)."""
    root.mkdir()
    (root / "config.json").write_text(json.dumps(config))
    return str(root)


@pytest.mark.parametrize("module, attribute, main, argv", COMMANDS)
@pytest.mark.parametrize(
    "target, given, expected",
    [
        ("quantized", None, "0"),
        ("quantized", "1", "1"),
        ("quantized", "0", "0"),
        ("dense", None, None),  # mlx's graphs: faster for a dense target
        ("8-bit", None, None),  # and for an 8-bit one
        ("dense", "0", "0"),
        ("demo", None, None),  # the bundled pair is dense
    ],
)
def test_each_command_chooses_before_its_models_load_and_keeps_the_users_value(
    monkeypatch,
    capsys,
    tmp_path,
    module,
    attribute,
    main,
    argv,
    target,
    given,
    expected,
):
    if attribute == "build_state":
        pytest.importorskip("uvicorn")
    if given is None:
        monkeypatch.delenv(GRAPHS_ENV, raising=False)
    else:
        monkeypatch.setenv(GRAPHS_ENV, given)
    if target != "demo":
        config = {"quantized": QUANTIZED, "8-bit": EIGHT_BIT}.get(
            target, {"model_type": "llama"}
        )
        argv = argv + ["--model", _model_dir(tmp_path / "model", config)]
    assert _seen_at_model_load(monkeypatch, module, attribute, main, argv) == expected
    assert "stopped at the model load" in capsys.readouterr().err


def test_a_device_paced_target_keeps_mlxs_graphs():
    environ = {}
    assert prefer_direct_launches(environ, host_paced=False) is False
    assert environ == {}
    assert prefer_direct_launches(environ, host_paced=True) is True
    assert environ == {GRAPHS_ENV: "0"}


def _glimmer(**quantization):
    return {"model_type": "muse_glimmer", "quantization": quantization}


@pytest.mark.parametrize(
    "config, expected",
    [
        (QUANTIZED, True),
        (_glimmer(group_size=64, bits=4, mode="affine"), True),
        (EIGHT_BIT, False),  # dflash's matmuls: the graphs measured faster
        # dflash's matmul, mlx's graphs kept (sessions 75-77: direct not separated):
        (_glimmer(group_size=32, bits=4), False),
        (_glimmer(group_size=128, bits=4), False),
        (_glimmer(group_size=64, bits=6), False),  # not measured: mlx's matmuls
        (_glimmer(group_size=64, bits=4, mode="mxfp4"), False),
        # A layer quantized otherwise, or left dense: the kernels are not installed.
        (
            _glimmer(
                group_size=64, bits=4, **{"lm_head": {"group_size": 64, "bits": 8}}
            ),
            False,
        ),
        (_glimmer(group_size=64, bits=4, **{"lm_head": False}), False),
        (
            _glimmer(
                group_size=64, bits=4, **{"lm_head": {"group_size": 64, "bits": 4}}
            ),
            True,
        ),
        (_glimmer(group_size=64, bits=4, **{"lm_head": True}), True),
        ({"model_type": "llama", "quantization": {"group_size": 64, "bits": 4}}, False),
        (
            {"model_type": "qwen2", "quantization_config": {"quant_method": "awq"}},
            False,
        ),
        ({"model_type": "llama"}, False),
        ({"model_type": "llama", "quantization": None}, False),
        ("not json {", True),  # unreadable: the old default; the load reports it
        ([1, 2], True),
        (None, True),  # no config.json at all
    ],
)
def test_direct_launches_are_read_from_the_targets_config(tmp_path, config, expected):
    folder = tmp_path / "model"
    folder.mkdir()
    if isinstance(config, str):
        (folder / "config.json").write_text(config)
    elif config is not None:
        (folder / "config.json").write_text(json.dumps(config))
    assert target_prefers_direct_launches(str(folder)) is expected


@pytest.mark.parametrize(
    "switch, expected",
    [("0", False), ("attention", False), ("matmul", True), ("1", True)],
)
def test_the_kernel_switch_decides_whose_matmuls_run(
    monkeypatch, tmp_path, switch, expected
):
    """``DFLASH_VERIFY_KERNELS`` installs or withholds the matmul kernel, and with it
    the host pacing of a 4-bit target; an 8-bit target keeps mlx's graphs either way
    (measured faster with dflash's matmul and with mlx's)."""
    monkeypatch.setenv("DFLASH_VERIFY_KERNELS", switch)
    assert (
        target_prefers_direct_launches(_model_dir(tmp_path / "m", EIGHT_BIT)) is False
    )
    assert (
        target_prefers_direct_launches(_model_dir(tmp_path / "q", QUANTIZED))
        is expected
    )


def test_direct_launches_only_where_dflashs_matmul_runs_and_they_measured_faster():
    """Every form in the direct-launch table installs dflash's matmul by default; an
    8-bit target installs it and still keeps mlx's graphs; a form whose matmul is
    mlx's never asks for direct launches."""
    for key in kernel_patch.DIRECT_LAUNCHES_BY_QUANTIZATION:
        assert "matmul" in kernel_patch.KERNELS_BY_QUANTIZATION[key]
    glimmer, cuda = "muse_glimmer", "cuda"
    assert kernel_patch.prefers_direct_launches(glimmer, ("affine", 4, 64), cuda)
    assert "matmul" in kernel_patch.default_parts(glimmer, ("affine", 8, 64), cuda)
    assert not kernel_patch.prefers_direct_launches(glimmer, ("affine", 8, 64), cuda)
    assert "matmul" in kernel_patch.default_parts(glimmer, ("affine", 4, 32), cuda)
    # Groups of 32 / 128: not separated (sessions 75-77); 6 bits: not measured.
    graphs_kept = (("affine", 4, 32), ("affine", 4, 128), ("affine", 6, 64))
    for form in graphs_kept + (("dense", "bfloat16"), None):
        assert not kernel_patch.prefers_direct_launches(glimmer, form, cuda)
    assert not kernel_patch.prefers_direct_launches("llama", ("affine", 4, 64), cuda)
    assert not kernel_patch.prefers_direct_launches(glimmer, ("affine", 4, 64), "metal")


def test_a_bad_kernel_switch_is_left_to_the_load(monkeypatch, tmp_path):
    monkeypatch.setenv("DFLASH_VERIFY_KERNELS", "everything")
    assert target_prefers_direct_launches(_model_dir(tmp_path / "q", QUANTIZED)) is True


def test_the_demo_pair_is_a_dense_target():
    assert target_prefers_direct_launches(None) is False


def test_a_hub_model_is_read_from_the_local_cache_only(monkeypatch, tmp_path):
    import huggingface_hub

    asked = []
    cached = {"org/dense": _model_dir(tmp_path / "dense", {"model_type": "llama"})}

    def from_cache(repo_id, filename, *args, **kwargs):
        asked.append((repo_id, filename))
        folder = cached.get(repo_id)
        return None if folder is None else str(Path(folder) / filename)

    monkeypatch.setattr(huggingface_hub, "try_to_load_from_cache", from_cache)
    assert target_prefers_direct_launches("org/dense") is False
    # Not downloaded yet: direct launches (the old choice), nothing fetched.
    assert target_prefers_direct_launches("org/elsewhere") is True
    assert asked == [("org/dense", "config.json"), ("org/elsewhere", "config.json")]


def test_the_architecture_is_remapped_as_mlx_lms_load_remaps_it():
    assert config_architecture({"model_type": "mistral"}) == "llama"
    assert config_architecture({"model_type": "muse_glimmer"}) == "muse_glimmer"
    assert config_architecture({"architectures": ["X"]}) is None


def _known_in_a_fresh_process(code: str, graphs=None) -> str:
    """What ``code`` prints in a new interpreter (``MLX_USE_CUDA_GRAPHS`` as given)."""
    env = {k: v for k, v in os.environ.items() if k != GRAPHS_ENV}
    if graphs is not None:
        env[GRAPHS_ENV] = graphs
    root = Path(__file__).resolve().parents[1]
    env["PYTHONPATH"] = os.pathsep.join([str(root), env.get("PYTHONPATH", "")])
    done = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout.strip()


_ASK = (
    "import dflash\n"
    "from dflash.launch_mode import direct_launches_known as known\n"
    "print(dflash.prefer_direct_launches(), known())\n"
)
_EVALUATE = "import mlx.core as mx\nmx.eval(mx.ones((64, 64)) + 1)\n"


@pytest.mark.parametrize(
    "code, graphs, expected",
    [
        (_ASK, None, "True True"),  # asked first thing, as the commands do
        (_EVALUATE + _ASK, None, "True False"),  # mlx may have read it already
        ("import dflash\n" + _EVALUATE + _ASK.split("\n", 1)[1], None, "True False"),
        (_ASK, "0", "False True"),  # the user's setting, there from the start
        (_ASK, "1", "False False"),
    ],
)
def test_direct_launches_are_known_only_if_set_before_any_evaluation(
    code, graphs, expected
):
    """``direct_launches_known`` (what the cluster-sum matmul's default needs): the
    variable off from the start, or set by ``prefer_direct_launches`` before mlx
    allocated anything beyond dflash's own constants; not where an evaluation came
    first (mlx reads the variable at its first one), nor with the graphs on."""
    assert _known_in_a_fresh_process(code, graphs) == expected


def test_reading_the_config_first_evaluates_nothing(tmp_path):
    """The commands read ``--model``'s config (and the kernel tables) before asking:
    that must allocate nothing, or the cluster sum's default would be lost."""
    folder = _model_dir(tmp_path / "model", QUANTIZED)
    code = (
        "import dflash\n"
        "from dflash.cli.common import target_prefers_direct_launches as prefers\n"
        "from dflash.launch_mode import direct_launches_known as known\n"
        f"print(dflash.prefer_direct_launches(host_paced=prefers({folder!r})), known())\n"
    )
    assert _known_in_a_fresh_process(code) == "True True"


def test_direct_launches_are_not_known_once_the_variable_is_turned_back_on(
    monkeypatch,
):
    monkeypatch.setattr(launch_mode, "_GRAPHS_AT_IMPORT", "0")
    monkeypatch.setenv(GRAPHS_ENV, "0")
    assert launch_mode.direct_launches_known()
    monkeypatch.setenv(GRAPHS_ENV, "1")
    assert not launch_mode.direct_launches_known()
    monkeypatch.delenv(GRAPHS_ENV)
    assert not launch_mode.direct_launches_known()


def test_a_mapping_other_than_the_environment_is_not_taken_as_mlxs(monkeypatch):
    monkeypatch.setattr(launch_mode, "_set_before_use", False)
    monkeypatch.setattr(launch_mode, "_GRAPHS_AT_IMPORT", None)
    monkeypatch.delenv(GRAPHS_ENV, raising=False)
    assert prefer_direct_launches({}) is True
    assert not launch_mode._set_before_use


def test_the_kernel_layer_asks_the_launch_mode():
    """The cluster sum's default reads ``direct_launches_known`` through the kernel
    layer's probe, which the package hands in at import."""
    from dflash.metal import backend

    assert backend._direct_launches_probe is launch_mode.direct_launches_known


def test_graphs_off_words_are_the_switch_words_and_nothing_else() -> None:
    """One rule reads ``MLX_USE_CUDA_GRAPHS`` for the launch mode and the kernel layer:
    an off word (any case, spaces around) turns the graphs off; unset, an on word or
    anything else leaves them on."""
    from dflash.metal.backend import cuda_graphs_off

    for value in ("0", "false", " OFF ", "No"):
        assert cuda_graphs_off(value)
    for value in (None, "", "1", "on", "maybe", "00"):
        assert not cuda_graphs_off(value)


def test_a_name_that_is_neither_a_folder_nor_a_repo_id_asks_for_direct_launches(
    tmp_path,
):
    """The hub refuses the name (no download is tried); the load reports it later."""
    assert (
        target_prefers_direct_launches(str(tmp_path / "no" / "such" / "model")) is True
    )


def _small_glimmer_config() -> dict:
    """The demo target's config, narrowed so every projection takes groups of 128,
    with a head of its own."""
    from dflash.demo import DEMO_DIR

    config = json.loads((DEMO_DIR / "target" / "config.json").read_text())
    config.update(hidden_size=256, intermediate_size=512, vocab_size=512)
    config.update(tie_word_embeddings=False)  # an lm_head of its own, a projection
    config.update(num_hidden_layers=2, layer_types=config["layer_types"][2:4])
    if isinstance(config.get("layer_rope_theta"), list):
        config["layer_rope_theta"] = config["layer_rope_theta"][2:4]
    return config


@settings(max_examples=16, deadline=None)
@given(
    bits=st.sampled_from([4, 8]),
    group_size=st.sampled_from([32, 64, 128]),
    other=st.one_of(
        st.none(),
        st.tuples(
            st.sampled_from(
                ["lm_head", "model.layers.1.mlp.down_proj", "model.embed_tokens"]
            ),
            st.sampled_from([4, 8]),
            st.sampled_from([32, 64, 128]),
        ),
    ),
)
def test_the_config_gives_the_form_the_loaded_model_has(bits, group_size, other):
    """What the config reader sees is what mlx-lm's load builds: a model quantized and
    saved by mlx-lm (one layer perhaps in another form), loaded back, has the
    projection form and the architecture read from its ``config.json``."""
    import tempfile

    import mlx.core as mx
    from mlx_lm import utils as mlx_lm_utils

    from dflash.kernel_patch import architecture, projection_form

    config = _small_glimmer_config()
    model_class, args_class = mlx_lm_utils._get_classes(config)
    model = model_class(args_class.from_dict(config))
    mx.eval(model.parameters())

    def predicate(path, module):
        if other is not None and path == other[0]:
            return {"group_size": other[2], "bits": other[1], "mode": "affine"}
        return True

    model, saved = mlx_lm_utils.quantize_model(
        model, config, group_size, bits, quant_predicate=predicate
    )
    with tempfile.TemporaryDirectory() as folder:
        mlx_lm_utils.save_model(folder, model)
        mlx_lm_utils.save_config(saved, Path(folder) / "config.json")
        written = json.loads((Path(folder) / "config.json").read_text())
        loaded, _ = mlx_lm_utils.load_model(Path(folder))
    assert config_projection_form(written) == projection_form(loaded)
    assert config_architecture(written) == architecture(loaded)
