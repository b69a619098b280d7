"""Drafter checkpoints: real layouts, round trips, fail-closed loading, public format.

Covers issue 11 item 4 (every malformed config value or weight file is refused with
a DrafterLoadError naming the file and the key or tensor) and issue 12 item 7 (the
"dflash" layout holds everything the public DFlash loaders read, and their MLX
loader runs a drafter we saved exactly as we do).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from conftest import (
    TINY_DFLASH2,
    greedy_reference,
    save_target,
    tiny_drafter_config,
    tiny_model,
)
from hypothesis import given, settings
from hypothesis import strategies as st
from mlx.utils import tree_flatten
from mlx_lm.models import qwen3

from dflash.drafter import (
    _FIELD_RULES,
    ARCH_ASSISTANT,
    ARCH_DFLASH,
    ARCH_DFLASH2,
    DFlashDrafter,
    DrafterConfig,
)
from dflash.loader import (
    DrafterLoadError,
    check_weights,
    checkpoint_format,
    checkpoint_to_model_name,
    config_from_dict,
    config_to_dict,
    load_drafter,
    save_drafter,
)
from dflash.taps import TargetTaps

FIXTURES = Path("/work/shared/fixtures/muse-glimmer-drafters")
HIDDEN, VOCAB, MASK = 64, 256, 255


def fixture(name: str) -> dict:
    path = FIXTURES / name
    if not path.exists():
        pytest.skip(f"fixture {path} not present")
    return json.loads(path.read_text())


def header_shapes(name: str) -> dict:
    header = fixture(name)
    return {k: tuple(v["shape"]) for k, v in header.items() if k != "__metadata__"}


@pytest.fixture(scope="module")
def target():
    return tiny_model("muse_glimmer", seed=31, window=32)


def tiny_drafter(kind: str) -> DFlashDrafter:
    extras = {}
    if kind == "dflash2":
        extras = dict(TINY_DFLASH2, selector_top_k=4, vocab_size=VOCAB)
        extras.update(output_multiplier=0.25, final_logit_softcapping=15.0)
    elif kind == "dflash":
        extras = dict(architecture=ARCH_DFLASH, is_causal=None, vocab_size=VOCAB)
    config = tiny_drafter_config(
        hidden_size=HIDDEN,
        rope_theta=50000.0,
        sliding_window=8,
        block_size=4,
        mask_token_id=MASK,
        target_layer_ids=(1, 4, 6),
        max_position_embeddings=4096,
        **extras,
    )
    mx.random.seed(7)
    drafter = DFlashDrafter(config)
    # Random values everywhere, so a dropped or swapped tensor cannot go unseen.
    drafter.update(
        {
            "layers": [
                (
                    {
                        name: {"base_kernel": mx.random.normal((2, 2, HIDDEN))}
                        for name in ("attention_conv", "mlp_conv")
                    }
                    if kind == "dflash2"
                    else {}
                )
                for _ in range(2)
            ]
        }
    )
    mx.eval(drafter.parameters())
    return drafter


def saved(tmp_path: Path, kind: str, fmt: str, target=None) -> Path:
    return save_drafter(
        tiny_drafter(kind), tmp_path / f"{kind}-{fmt}", format=fmt, target_model=target
    )


def edit_config(path: Path, **changes) -> None:
    cfg = json.loads((path / "config.json").read_text())
    for key, value in changes.items():
        if key in cfg.get("dflash_config", {}):
            cfg["dflash_config"][key] = value
        else:
            cfg[key] = value
    (path / "config.json").write_text(json.dumps(cfg))


def edit_weights(path: Path, edit) -> None:
    file = path / "model.safetensors"
    weights = dict(mx.load(str(file)))
    edit(weights)
    mx.save_safetensors(str(file), weights)


# --- the real checkpoints' layouts --------------------------------------------


@pytest.mark.parametrize(
    "config_name, header_name, fmt",
    [
        ("assistant-config.json", "assistant-safetensors-header.json", "assistant"),
        ("dflash2-config.json", "dflash2-safetensors-header.json", "dflash"),
    ],
)
def test_fixture_header_matches_lazy_full_size_model(config_name, header_name, fmt):
    cfg = fixture(config_name)
    shapes = header_shapes(header_name)
    assert checkpoint_format(cfg) == fmt
    # Built lazily: the 6656-wide weights are never evaluated.
    drafter = DFlashDrafter(config_from_dict(cfg))
    params = {k: tuple(v.shape) for k, v in tree_flatten(drafter.parameters())}
    mapped = {checkpoint_to_model_name(k, fmt): v for k, v in shapes.items()}
    assert mapped == params
    check_weights(drafter, shapes, fmt)


def test_assistant_fixture_config():
    config = config_from_dict(fixture("assistant-config.json"))
    assert config.architecture == ARCH_ASSISTANT
    assert (config.block_size, config.mask_token_id) == (16, 201818)
    assert config.target_layer_ids == (1, 13, 25, 37, 49)
    assert config.is_causal is False
    assert (config.output_multiplier, config.final_logit_softcapping) == (None, None)
    assert config.sliding_window == 2048 and config.rope_theta == 500000.0
    assert config.context_row_limit(0) == 2047


def test_dflash2_fixture_config():
    config = config_from_dict(fixture("dflash2-config.json"))
    assert config.architecture == ARCH_DFLASH2
    assert config.target_layer_ids == (1, 13, 25, 37, 49)
    assert config.output_multiplier == pytest.approx(0.19611613513818404)
    assert config.final_logit_softcapping == 20.0
    assert (config.conv_kernel_size, config.conv_group_size) == (2, 16)
    assert (config.selector_rank, config.selector_top_k) == (256, 16)
    assert config.vocab_size == 202048 and config.is_causal is False


# --- round trips ---------------------------------------------------------------


@pytest.mark.parametrize(
    "kind, fmt",
    [("assistant", "assistant"), ("assistant", "dflash"), ("dflash", "dflash")]
    + [("dflash2", "dflash")],
)
def test_save_load_round_trip(tmp_path, target, kind, fmt):
    original = tiny_drafter(kind)
    path = save_drafter(original, tmp_path / "drafter", format=fmt, target_model=target)
    loaded = load_drafter(path, target)
    want_arch = {"assistant": ARCH_ASSISTANT, "dflash": ARCH_DFLASH}[fmt]
    want_arch = ARCH_DFLASH2 if kind == "dflash2" else want_arch
    want = dataclasses.replace(original.config, architecture=want_arch)
    if fmt == "dflash":
        # The public layout records what the drafter takes from its target.
        taken = dict(vocab_size=VOCAB, num_target_layers=len(target.layers))
        if kind != "dflash2":
            taken.update(
                output_multiplier=target.args.output_multiplier,
                final_logit_softcapping=target.args.final_logit_softcapping,
            )
        want = dataclasses.replace(want, **taken)
    assert loaded.config == want
    ours, theirs = tree_flatten(original.parameters()), tree_flatten(
        loaded.parameters()
    )
    assert [k for k, _ in ours] == [k for k, _ in theirs]
    assert all(mx.array_equal(a, b) for (_, a), (_, b) in zip(ours, theirs))

    original.bind(target)
    hidden = mx.random.normal((1, 9, 3 * HIDDEN), key=mx.random.key(3))
    tokens = mx.array([[5, MASK, MASK, MASK]])
    outputs = []
    for drafter in (original, loaded):
        context = drafter.make_context()
        drafter.append_context(context, hidden, 0)
        outputs.append(drafter(tokens, context))
    assert mx.array_equal(*outputs)


def test_saved_assistant_layout_uses_meta_names(tmp_path):
    path = saved(tmp_path, "assistant", "assistant")
    names = set(mx.load(str(path / "model.safetensors")))
    assert {"encoder.fc.weight", "encoder.output_norm_enc.weight"} <= names
    assert not {"fc.weight", "hidden_norm.weight"} & names
    cfg = json.loads((path / "config.json").read_text())
    assert cfg["architectures"] == [ARCH_ASSISTANT]
    assert cfg["target_layer_ids"] == [1, 4, 6] and "dflash_config" not in cfg


def test_saved_dflash2_codebooks_are_bare(tmp_path, target):
    path = saved(tmp_path, "dflash2", "dflash", target)
    names = set(mx.load(str(path / "model.safetensors")))
    assert "candidate_selector.successor_codebook" in names
    assert "candidate_selector.successor_codebook.weight" not in names


def test_assistant_layout_refuses_dflash2_parts(tmp_path):
    with pytest.raises(ValueError, match="format='dflash'"):
        save_drafter(tiny_drafter("dflash2"), tmp_path / "x", format="assistant")


def test_hub_ids_go_through_mlx_lm_download(tmp_path, target, monkeypatch):
    import mlx_lm.utils

    path = saved(tmp_path, "assistant", "assistant")
    calls = []

    def fake_download(repo, revision=None, allow_patterns=None):
        calls.append((repo, revision, allow_patterns))
        return path

    monkeypatch.setattr(mlx_lm.utils, "_download", fake_download)
    drafter = load_drafter("someone/tiny-drafter", target, revision="abc")
    assert calls == [("someone/tiny-drafter", "abc", ["*.json", "*.safetensors"])]
    assert drafter.is_bound


# --- fail closed ---------------------------------------------------------------


def test_unknown_architecture(tmp_path, target):
    path = saved(tmp_path, "assistant", "assistant")
    edit_config(path, architectures=["FooDraftModel"])
    with pytest.raises(
        DrafterLoadError, match="unknown drafter architecture 'FooDraft"
    ):
        load_drafter(path, target)


def test_hidden_size_mismatch_names_both(tmp_path):
    path = saved(tmp_path, "assistant", "assistant")
    mx.random.seed(1)
    other = qwen3.Model(
        qwen3.ModelArgs(
            model_type="qwen3",
            hidden_size=48,
            num_hidden_layers=8,
            intermediate_size=96,
            num_attention_heads=4,
            rms_norm_eps=1e-6,
            vocab_size=VOCAB,
            num_key_value_heads=2,
            max_position_embeddings=512,
            head_dim=12,
            tie_word_embeddings=True,
            rope_theta=10000.0,
        )
    )
    with pytest.raises(
        DrafterLoadError, match="hidden_size 64 != target hidden_size 48"
    ):
        load_drafter(path, other)


def test_target_layer_ids_out_of_range(tmp_path, target):
    path = saved(tmp_path, "assistant", "assistant")
    edit_config(path, target_layer_ids=[1, 4, 8])
    with pytest.raises(DrafterLoadError, match=r"\[8\] out of range .* 8 layers"):
        load_drafter(path, target)


def test_mask_token_outside_vocabulary(tmp_path, target):
    path = saved(tmp_path, "dflash", "dflash", target)
    edit_config(path, mask_token_id=300)
    with pytest.raises(DrafterLoadError, match=r"mask_token_id 300 is outside .*256"):
        load_drafter(path, target)


def test_selector_vocabulary_must_match_target(tmp_path, target):
    path = saved(tmp_path, "dflash2", "dflash", target)
    edit_config(path, vocab_size=512)
    with pytest.raises(
        DrafterLoadError, match="vocab_size 512 != target vocab size 256"
    ):
        load_drafter(path, target)


def test_missing_weights_are_named(tmp_path, target):
    path = saved(tmp_path, "assistant", "assistant")
    edit_weights(path, lambda w: w.pop("layers.1.mlp.up_proj.weight"))
    with pytest.raises(DrafterLoadError, match="missing weights.*layers.1.mlp.up_proj"):
        load_drafter(path, target)


def test_extra_weights_are_named(tmp_path, target):
    path = saved(tmp_path, "dflash2", "dflash", target)

    def add(weights):
        weights["layers.0.self_attn.gate_proj.weight"] = mx.zeros((64, 64))
        weights["lm_head.weight"] = mx.zeros((VOCAB, 64))

    edit_weights(path, add)
    with pytest.raises(
        DrafterLoadError, match=r"unexpected weights \[layers.0.self_attn.gate_proj"
    ):
        load_drafter(path, target)


def test_dflash2_parts_are_never_dropped(tmp_path, target):
    # A DFlash2 checkpoint relabelled as plain DFlash must not load by ignoring parts.
    path = saved(tmp_path, "dflash2", "dflash", target)
    edit_config(path, architectures=[ARCH_DFLASH])
    with pytest.raises(DrafterLoadError, match="unexpected weights.*attention_conv"):
        load_drafter(path, target)


def test_shape_mismatch_is_named(tmp_path, target):
    path = saved(tmp_path, "assistant", "assistant")
    edit_weights(path, lambda w: w.update({"norm.weight": mx.ones((32,))}))
    with pytest.raises(
        DrafterLoadError, match=r"norm.weight \(32,\) != expected \(64,\)"
    ):
        load_drafter(path, target)


def test_incomplete_dflash2_config(tmp_path, target):
    path = saved(tmp_path, "dflash2", "dflash", target)
    edit_config(path, selector_top_k=0)
    with pytest.raises(DrafterLoadError, match="selector_top_k"):
        load_drafter(path, target)


def test_missing_local_directory_never_reaches_the_hub(tmp_path, target):
    with pytest.raises(DrafterLoadError, match="no such drafter directory"):
        load_drafter(str(tmp_path / "absent"), target)
    with pytest.raises(DrafterLoadError, match="no such drafter directory"):
        load_drafter("./relative/absent", target)


# --- malformed config values (issue 11 item 4) --------------------------------
#
# Every key the loader reads, by JSON path in the public ("dflash") layout, with
# what it must hold: (kind, required, lowest allowed value, strictly above it).
# The assistant layout holds the dflash_config keys at the top level.

READ_KEYS = {
    "hidden_size": ("int", True, 1, False),
    "num_hidden_layers": ("int", True, 1, False),
    "num_attention_heads": ("int", True, 1, False),
    "num_key_value_heads": ("int", False, 1, False),
    "head_dim": ("int", False, 1, False),
    "intermediate_size": ("int", True, 1, False),
    "rms_norm_eps": ("float", True, 0, True),
    "rope_parameters.rope_theta": ("float", True, 0, True),
    "layer_types": ("strs", False, None, False),
    "sliding_window": ("int", False, 1, False),
    "max_position_embeddings": ("int", False, 1, False),
    "vocab_size": ("int", False, 1, False),
    "num_target_layers": ("int", False, 1, False),
    "is_causal": ("bool", False, None, False),
    "dflash_config.block_size": ("int", True, 1, False),
    "dflash_config.mask_token_id": ("int", True, 0, False),
    "dflash_config.target_layer_ids": ("ints", True, 0, False),
    "dflash_config.output_multiplier": ("float", False, 0, True),
    "dflash_config.final_logit_softcapping": ("float", False, 0, False),
    "dflash_config.input_embedding_scale": ("float", False, 0, True),
}
DFLASH2_KEYS = {
    f"dflash_config.{name}": ("int", True, 1, False)
    for name in (
        "conv_kernel_size",
        "conv_group_size",
        "selector_rank",
        "selector_top_k",
    )
}
# Keys that are not DrafterConfig fields but are read and checked all the same.
OTHER_BAD = [
    ("architectures", "DFlashDraftModel"),
    ("architectures", []),
    ("architectures", [3]),
    ("dflash_config", [1, 2]),
    ("rope_parameters", "default"),
    ("rope_parameters.rope_type", 3),
    ("hidden_act", 7),
    ("hidden_activation", ["silu"]),
    ("attention_bias", "false"),
    ("mlp_bias", 1),
]


def bad_values(kind: str, required: bool, low, strict: bool) -> list:
    """Values a key of this kind must refuse (wrong type, out of range, not finite)."""
    values = {
        "int": [1.5, 2.0, True, "4", [4], {"v": 4}],
        "float": ["abc", True, [1.0], {"v": 1.0}, math.nan, math.inf],
        "ints": ["1,4,6", 4, [1.5, 4, 6], [True, 4, 6], ["1", 4, 6]],
        "strs": ["full_attention", 3, ["full_attention", 3]],
        "bool": ["yes", 1, 0.0, [True]],
    }[kind]
    if low is not None:
        below = low if strict else low - 1
        values.append([below, 4, 6] if kind == "ints" else below)
        if kind == "float":
            values.append(-1e-9 if not strict else 0.0)
    if required:
        values.append(None)
    return values


def layout_path(path: str, fmt: str) -> str:
    return (
        path.split(".", 1)[1]
        if fmt == "assistant" and path.startswith("dflash_config.")
        else path
    )


def set_path(cfg: dict, path: str, value) -> None:
    *parents, last = path.split(".")
    for key in parents:
        cfg = cfg[key]
    cfg[last] = value


def field_cases() -> list:
    cases = []
    for fmt, keys in (
        ("dflash", READ_KEYS),
        ("assistant", {k: v for k, v in READ_KEYS.items() if k != "is_causal"}),
        ("dflash2", DFLASH2_KEYS),
    ):
        for path, rule in keys.items():
            for value in bad_values(*rule):
                cases.append((fmt, layout_path(path, fmt), value))
    return cases


@pytest.fixture(scope="module")
def layouts(tmp_path_factory, target):
    """A saved tiny drafter per layout: ``{name: (folder, config dict)}``."""
    root = tmp_path_factory.mktemp("layouts")
    out = {}
    for name, kind, fmt in (
        ("dflash", "dflash", "dflash"),
        ("assistant", "assistant", "assistant"),
        ("dflash2", "dflash2", "dflash"),
    ):
        path = save_drafter(
            tiny_drafter(kind), root / name, format=fmt, target_model=target
        )
        out[name] = (path, json.loads((path / "config.json").read_text()))
    return out


def with_config(source: Path, cfg: dict, folder: Path) -> Path:
    """A drafter folder holding ``cfg`` and (a link to) ``source``'s weights."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(cfg))
    link = folder / "model.safetensors"
    if not link.exists():
        link.symlink_to(source / "model.safetensors")
    return folder


def assert_refused(folder: Path, target, *names: str) -> str:
    """Loading ``folder`` raises DrafterLoadError naming ``names``; returns it."""
    with pytest.raises(DrafterLoadError) as info:
        load_drafter(folder, target)
    message = str(info.value)
    for name in names:
        assert name in message, f"{name!r} not named in: {message}"
    return message


def test_every_config_field_has_a_rule():
    fields = {f.name for f in dataclasses.fields(DrafterConfig)}
    assert set(_FIELD_RULES) == fields


@pytest.mark.parametrize("fmt, path, value", field_cases(), ids=repr)
def test_malformed_config_value_names_file_and_key(
    tmp_path, target, layouts, fmt, path, value
):
    source, cfg = layouts[fmt]
    cfg = json.loads(json.dumps(cfg))
    set_path(cfg, path, value)
    folder = with_config(source, cfg, tmp_path / "d")
    assert_refused(folder, target, str(folder / "config.json"), path)


@pytest.mark.parametrize("path, value", OTHER_BAD, ids=repr)
def test_malformed_structure_names_file_and_key(tmp_path, target, layouts, path, value):
    source, cfg = layouts["dflash"]
    cfg = json.loads(json.dumps(cfg))
    set_path(cfg, path, value)
    folder = with_config(source, cfg, tmp_path / "d")
    assert_refused(folder, target, str(folder / "config.json"), path.split(".")[0])


def test_issue_examples_are_refused(tmp_path, target, layouts):
    # The three reports of issue 11 item 4, as a user wrote them.
    source, cfg = layouts["assistant"]
    for path, value, named in (
        ("block_size", 1.5, "block_size must be an integer >= 1, got 1.5"),
        ("rope_parameters.rope_theta", "abc", "rope_parameters.rope_theta must be"),
    ):
        edited = json.loads(json.dumps(cfg))
        set_path(edited, path, value)
        folder = with_config(source, edited, tmp_path / path)
        assert_refused(folder, target, str(folder / "config.json"), named)


def test_rope_settings_mlx_lm_cannot_build_are_named(tmp_path, target, layouts):
    source, cfg = layouts["dflash"]
    cfg = json.loads(json.dumps(cfg))
    cfg["rope_parameters"] = {"rope_type": "llama3", "rope_theta": 1e4, "factor": "x"}
    folder = with_config(source, cfg, tmp_path / "d")
    assert_refused(folder, target, str(folder / "config.json"), "rope_parameters")


def test_cross_field_problems_name_the_fields(tmp_path, target, layouts):
    source, cfg = layouts["dflash"]
    for path, value, named in (
        ("num_key_value_heads", 3, "num_key_value_heads"),
        ("layer_types", ["full_attention"], "layer_types"),
        ("sliding_window", 1, "sliding_window"),
        ("num_target_layers", 5, "num_target_layers"),
        ("dflash_config.target_layer_ids", [], "target_layer_ids"),
    ):
        edited = json.loads(json.dumps(cfg))
        set_path(edited, path, value)
        folder = with_config(source, edited, tmp_path / path)
        assert_refused(folder, target, str(folder / "config.json"), named)


@pytest.mark.parametrize(
    "text",
    ["", "{", "[1, 2]", '"drafter"', "null", "3", "\udcff"],
    ids=["empty", "cut", "list", "string", "null", "number", "not-utf8"],
)
def test_config_file_that_is_not_a_json_object(tmp_path, target, layouts, text):
    source, _ = layouts["dflash"]
    folder = with_config(source, {}, tmp_path / "d")
    (folder / "config.json").write_bytes(text.encode("utf-8", "surrogateescape"))
    assert_refused(folder, target, str(folder / "config.json"))


def wrong_values(kind: str, required: bool, low, strict: bool):
    """Hypothesis strategy of values a key of this kind must refuse."""
    anything = st.one_of(
        st.text(max_size=5),
        st.booleans(),
        st.lists(st.integers(), max_size=3),
        st.dictionaries(st.text(max_size=3), st.integers(), max_size=2),
    )
    if kind == "int":
        wrong = st.one_of(anything, st.floats(), st.integers(max_value=low - 1))
    elif kind == "float":
        wrong = st.one_of(
            anything,
            st.sampled_from([math.nan, math.inf, -math.inf]),
            # -0.0 is not below a bound of 0: keep clear of it when 0 is allowed.
            st.floats(max_value=low if strict else low - 1e-6, allow_nan=False),
        )
    elif kind == "ints":
        item = st.one_of(
            st.floats(allow_nan=False),
            st.booleans(),
            st.text(max_size=2),
            st.integers(max_value=-1),
        )
        wrong = st.one_of(
            st.integers(),
            st.text(max_size=5),
            st.lists(st.integers(0, 5), max_size=2).flatmap(
                lambda good: item.map(lambda bad: good + [bad])
            ),
        )
    elif kind == "strs":
        wrong = st.one_of(
            st.text(max_size=5),
            st.integers(),
            st.lists(
                st.one_of(st.integers(), st.booleans(), st.none()),
                min_size=1,
                max_size=2,
            ),
        )
    else:
        wrong = st.one_of(
            st.text(max_size=5),
            st.integers(),
            st.floats(),
            st.lists(st.booleans(), max_size=2),
        )
    return st.one_of(wrong, st.just(None)) if required else wrong


FIELD_VALUES = st.sampled_from(sorted({**READ_KEYS, **DFLASH2_KEYS}.items())).flatmap(
    lambda item: st.tuples(st.just(item[0]), wrong_values(*item[1]))
)


@settings(max_examples=150)
@given(case=FIELD_VALUES, fmt=st.sampled_from(["dflash", "assistant"]))
def test_any_wrong_type_is_refused_naming_the_key(target, layouts, case, fmt):
    path, value = case
    if path in DFLASH2_KEYS:
        fmt = "dflash2"
    if fmt == "assistant" and path == "is_causal":
        return  # the assistant layout is bidirectional whatever the key says
    source, cfg = layouts[fmt]
    cfg = json.loads(json.dumps(cfg))
    path = layout_path(path, fmt)
    set_path(cfg, path, value)
    with tempfile.TemporaryDirectory() as tmp:
        folder = with_config(source, cfg, Path(tmp))
        assert_refused(folder, target, str(folder / "config.json"), path)


# --- malformed weight files (issue 11 item 4) ---------------------------------


def weights_bytes(layouts, fmt: str = "dflash") -> bytes:
    return (layouts[fmt][0] / "model.safetensors").read_bytes()


def with_weights(layouts, data: bytes, folder: Path, fmt: str = "dflash") -> Path:
    """A drafter folder with ``fmt``'s valid config and ``data`` as its weights."""
    folder.mkdir(parents=True, exist_ok=True)
    shutil.copy(layouts[fmt][0] / "config.json", folder / "config.json")
    (folder / "model.safetensors").write_bytes(data)
    return folder


def header_and_data(data: bytes):
    length = int.from_bytes(data[:8], "little")
    return json.loads(data[8 : 8 + length]), data[8 + length :]


def rebuilt(header: dict, body: bytes) -> bytes:
    raw = json.dumps(header).encode()
    return len(raw).to_bytes(8, "little") + raw + body


def test_empty_weights_file_is_named(tmp_path, target, layouts):
    folder = with_weights(layouts, b"", tmp_path / "d")
    assert_refused(folder, target, str(folder / "model.safetensors"), "empty")


@settings(max_examples=60)
@given(fraction=st.floats(0, 1, exclude_max=True))
def test_truncated_weights_file_is_named(target, layouts, fraction):
    data = weights_bytes(layouts)
    with tempfile.TemporaryDirectory() as tmp:
        folder = with_weights(layouts, data[: int(fraction * len(data))], Path(tmp))
        assert_refused(folder, target, str(folder / "model.safetensors"))


@settings(max_examples=60)
@given(data=st.binary(max_size=4096))
def test_random_bytes_as_weights_are_named(target, layouts, data):
    with tempfile.TemporaryDirectory() as tmp:
        folder = with_weights(layouts, data, Path(tmp))
        assert_refused(folder, target, str(folder / "model.safetensors"))


@settings(max_examples=40)
@given(length=st.integers(0, 2**64 - 1), body=st.binary(max_size=512))
def test_random_header_length_is_named(target, layouts, length, body):
    data = length.to_bytes(8, "little") + body
    with tempfile.TemporaryDirectory() as tmp:
        folder = with_weights(layouts, data, Path(tmp))
        assert_refused(folder, target, str(folder / "model.safetensors"))


def corrupt_header(case: str, header: dict, body: bytes):
    """Edit a valid safetensors header (and body) into a malformed one."""
    first = next(k for k in sorted(header) if k != "__metadata__")
    entry = header[first]
    if case == "not-json":
        return b"{" + json.dumps(header).encode()[1:-1], body
    if case == "json-list":
        return json.dumps([header]).encode(), body
    if case == "unknown-dtype":
        entry["dtype"] = "F33"
    elif case == "shape-not-list":
        entry["shape"] = "64"
    elif case == "shape-size-mismatch":
        entry["shape"] = [dim * 2 for dim in entry["shape"]]
    elif case == "negative-offset":
        entry["data_offsets"] = [-4, entry["data_offsets"][1]]
    elif case == "overlap":
        begin, end = entry["data_offsets"]
        other = next(v for k, v in header.items() if k not in ("__metadata__", first))
        size = end - begin
        other_begin = other["data_offsets"][0]
        entry["data_offsets"] = [other_begin, other_begin + size]
    elif case == "trailing-bytes":
        body = body + b"\0" * 16
    elif case == "metadata-not-strings":
        header["__metadata__"] = {"format": 3}
    elif case == "entry-not-object":
        header[first] = [1, 2]
    return json.dumps(header).encode(), body


@pytest.mark.parametrize(
    "case",
    [
        "not-json",
        "json-list",
        "unknown-dtype",
        "shape-not-list",
        "shape-size-mismatch",
        "negative-offset",
        "overlap",
        "trailing-bytes",
        "metadata-not-strings",
        "entry-not-object",
    ],
)
def test_malformed_safetensors_header_is_named(tmp_path, target, layouts, case):
    header, body = header_and_data(weights_bytes(layouts))
    raw, body = corrupt_header(case, header, body)
    data = len(raw).to_bytes(8, "little") + raw + body
    folder = with_weights(layouts, data, tmp_path / "d")
    assert_refused(folder, target, str(folder / "model.safetensors"))


@pytest.mark.parametrize("dtype", [mx.int32, mx.uint8, mx.bool_])
def test_weight_of_non_float_dtype_is_named(tmp_path, target, layouts, dtype):
    folder = with_weights(layouts, weights_bytes(layouts), tmp_path / "d")
    edit_weights(
        folder, lambda w: w.update({"norm.weight": w["norm.weight"].astype(dtype)})
    )
    assert_refused(folder, target, str(folder / "model.safetensors"), "'norm.weight'")


@pytest.mark.parametrize("dtype", [mx.float16, mx.bfloat16])
def test_half_precision_weights_load_in_their_dtype(tmp_path, target, layouts, dtype):
    folder = with_weights(layouts, weights_bytes(layouts), tmp_path / "d")
    edit_weights(folder, lambda w: w.update({k: v.astype(dtype) for k, v in w.items()}))
    drafter = load_drafter(folder, target)
    assert {v.dtype for _, v in tree_flatten(drafter.parameters())} == {dtype}


def test_wrong_shape_names_the_file(tmp_path, target, layouts):
    folder = with_weights(layouts, weights_bytes(layouts), tmp_path / "d")
    edit_weights(folder, lambda w: w.update({"norm.weight": mx.ones((32,))}))
    assert_refused(
        folder,
        target,
        str(folder / "model.safetensors"),
        "norm.weight (32,) != expected (64,)",
    )


def test_tensor_in_two_shards_names_both(tmp_path, target, layouts):
    folder = with_weights(layouts, weights_bytes(layouts), tmp_path / "d")
    mx.save_safetensors(
        str(folder / "extra.safetensors"), {"norm.weight": mx.ones((64,))}
    )
    assert_refused(
        folder,
        target,
        str(folder / "model.safetensors"),
        str(folder / "extra.safetensors"),
    )


def test_sharded_weights_load(tmp_path, target, layouts):
    folder = with_weights(layouts, weights_bytes(layouts), tmp_path / "d")
    weights = dict(mx.load(str(folder / "model.safetensors")))
    mx.eval(weights)
    names = sorted(weights)
    mx.save_safetensors(
        str(folder / "model.safetensors"), {k: weights[k] for k in names[::2]}
    )
    mx.save_safetensors(
        str(folder / "more.safetensors"), {k: weights[k] for k in names[1::2]}
    )
    drafter = load_drafter(folder, target)
    loaded = dict(tree_flatten(drafter.parameters()))
    assert all(mx.array_equal(loaded[k], weights[k]) for k in names)


# --- a failed load changes nothing ---------------------------------------------


def target_state(model) -> tuple:
    params = [(k, np.array(v)) for k, v in tree_flatten(model.parameters())]
    layers = [(id(layer), type(layer)) for layer in model.layers]
    return params, layers, sorted(vars(model)), sorted(vars(model.model))


def assert_same_state(before: tuple, after: tuple) -> None:
    assert [k for k, _ in before[0]] == [k for k, _ in after[0]]
    assert all(np.array_equal(a, b) for (_, a), (_, b) in zip(before[0], after[0]))
    assert before[1:] == after[1:]


def test_target_is_unchanged_by_failed_and_successful_loads(tmp_path, target, layouts):
    before = target_state(target)
    data = weights_bytes(layouts)
    header, body = header_and_data(data)
    folders = [
        with_weights(layouts, data[: len(data) // 2], tmp_path / "truncated"),
        with_weights(layouts, rebuilt(header, body + b"\0"), tmp_path / "trailing"),
    ]
    cfg = json.loads(json.dumps(layouts["dflash"][1]))
    cfg["dflash_config"]["target_layer_ids"] = [1, 4, 8]
    folders.append(with_config(layouts["dflash"][0], cfg, tmp_path / "layers"))
    for folder in folders:
        with pytest.raises(DrafterLoadError):
            load_drafter(folder, target)
        assert_same_state(before, target_state(target))
    load_drafter(layouts["dflash"][0], target)
    assert_same_state(before, target_state(target))
    # And the target still computes what it computed before.
    tokens = mx.array([[3, 9, 27, 81]])
    fresh = tiny_model("muse_glimmer", seed=31, window=32)
    assert mx.array_equal(target(tokens), fresh(tokens))


# --- the public DFlash layout (issue 12 item 7) ---------------------------------
#
# What the public DFlash MLX loader reads, derived by reading ``load_draft`` in
# dflash/model_mlx.py of PyPI dflash 0.1.0 (/work/peer/src/dflash/model_mlx.py):
# keys it indexes directly (a KeyError when absent) ...
PUBLIC_REQUIRED = (
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "intermediate_size",
    "vocab_size",
    "rms_norm_eps",
    "max_position_embeddings",
    "num_target_layers",
    "dflash_config.target_layer_ids",
    "dflash_config.mask_token_id",
)
# ... and keys it reads with a default: (where it looks, in order; its default).
PUBLIC_DEFAULTED = {
    "block_size": (("dflash_config.block_size", "block_size"), 16),
    "output_multiplier": (("dflash_config.output_multiplier",), 1.0),
    "final_logit_softcapping": (
        ("dflash_config.final_logit_softcapping", "final_logit_softcapping"),
        None,
    ),
    "input_embedding_scale": (("dflash_config.input_embedding_scale",), 1.0),
    "conv_kernel_size": (("dflash_config.conv_kernel_size",), 0),
    "conv_group_size": (("dflash_config.conv_group_size",), 0),
    "selector_rank": (("dflash_config.selector_rank",), 0),
    "selector_top_k": (("dflash_config.selector_top_k",), 0),
    "rope_theta": (("rope_theta", "rope_parameters.rope_theta"), 10000.0),
    "layer_types": (("layer_types",), None),
    "sliding_window": (("sliding_window",), None),
    "is_causal": (("is_causal",), None),
    "architectures": (("architectures",), []),
}


def lookup(cfg: dict, path: str):
    for key in path.split("."):
        if not isinstance(cfg, dict) or key not in cfg:
            return KeyError
        cfg = cfg[key]
    return cfg


def public_reading(cfg: dict) -> dict:
    """Each defaulted key's value as the public loader resolves it."""
    out = {}
    for name, (paths, default) in PUBLIC_DEFAULTED.items():
        found = [lookup(cfg, p) for p in paths if lookup(cfg, p) is not KeyError]
        out[name] = found[0] if found else default
    return out


@pytest.mark.parametrize("kind", ["assistant", "dflash", "dflash2"])
def test_dflash_layout_holds_every_key_the_public_loader_reads(tmp_path, target, kind):
    drafter = tiny_drafter(kind)
    path = save_drafter(drafter, tmp_path / "d", format="dflash", target_model=target)
    cfg = json.loads((path / "config.json").read_text())
    missing = [key for key in PUBLIC_REQUIRED if lookup(cfg, key) in (KeyError, None)]
    assert not missing
    assert cfg["model_type"] == "qwen3"  # the public torch model's config class
    assert cfg["vocab_size"] == VOCAB and cfg["num_target_layers"] == len(target.layers)
    seen = public_reading(cfg)
    drafter.bind(target)
    config = drafter.config
    softcap = drafter.logit_softcap if (drafter.logit_softcap or 0) > 0 else None
    assert seen == dict(
        block_size=config.block_size,
        output_multiplier=drafter.logit_multiplier or 1.0,
        final_logit_softcapping=softcap,
        input_embedding_scale=config.input_embedding_scale,
        conv_kernel_size=config.conv_kernel_size,
        conv_group_size=config.conv_group_size,
        selector_rank=config.selector_rank,
        selector_top_k=config.selector_top_k,
        rope_theta=config.rope_theta,
        layer_types=list(config.layer_types),
        sliding_window=config.sliding_window,
        is_causal=config.is_causal,
        architectures=[ARCH_DFLASH2 if kind == "dflash2" else ARCH_DFLASH],
    )
    # The multiplier and soft-cap of the Muse Glimmer target are really recorded.
    if kind != "dflash2":
        assert seen["output_multiplier"] == target.args.output_multiplier
        assert seen["final_logit_softcapping"] == target.args.final_logit_softcapping


def test_dflash_layout_needs_what_the_drafter_takes_from_its_target(tmp_path, target):
    drafter = tiny_drafter("dflash")
    with pytest.raises(ValueError, match=r"\['num_target_layers', 'output_multiplier'"):
        save_drafter(drafter, tmp_path / "unbound", format="dflash")
    drafter.bind(target)
    with pytest.raises(ValueError, match=r"\['num_target_layers'\].*target_model="):
        save_drafter(drafter, tmp_path / "bound", format="dflash")
    assert not (tmp_path / "unbound").exists() and not (tmp_path / "bound").exists()
    with pytest.raises(ValueError, match="num_target_layers"):
        config_to_dict(drafter.config, "dflash")


def test_save_refuses_a_target_the_drafter_does_not_fit(tmp_path):
    other = tiny_model("muse_glimmer", seed=1, window=32, num_hidden_layers=4)
    with pytest.raises(
        DrafterLoadError, match=r"target_layer_ids \[4, 6\] out of range"
    ):
        save_drafter(
            tiny_drafter("dflash"), tmp_path / "d", format="dflash", target_model=other
        )


def test_public_layout_without_multiplier_or_softcap_has_none(
    tmp_path, target, layouts
):
    # The public loaders read these as 1.0 and no soft-cap, never as the target's.
    source, cfg = layouts["dflash"]
    cfg = json.loads(json.dumps(cfg))
    del cfg["dflash_config"]["output_multiplier"]
    del cfg["dflash_config"]["final_logit_softcapping"]
    drafter = load_drafter(with_config(source, cfg, tmp_path / "d"), target)
    assert drafter.config.output_multiplier == 1.0
    assert drafter.config.final_logit_softcapping == 0.0
    hidden = mx.random.normal((1, 4, HIDDEN), key=mx.random.key(5))
    assert mx.array_equal(drafter.logits(hidden), target.lm_head(hidden))


PEER_SRC = Path(os.environ.get("DFLASH_PEER_SRC", "/work/peer/src"))


def public_package() -> Path:
    """Folder holding the public ``dflash`` package (PyPI dflash 0.1.0), or skip."""
    if not (PEER_SRC / "dflash" / "model_mlx.py").is_file():
        pytest.skip(
            f"public DFlash package (PyPI dflash==0.1.0) not at {PEER_SRC}; point "
            "DFLASH_PEER_SRC at a folder holding it (pip install --no-deps --target)"
        )
    return PEER_SRC


def run_public_loader(tmp_path: Path, target, drafter, prompt, anchor, max_tokens):
    """Save target and drafter, run the public MLX loader on them in a subprocess."""
    peer = public_package()
    save_target(target, tmp_path / "target")
    # Their load_draft goes through the hub cache: serve the drafter from a local one.
    repo, revision = tmp_path / "hub" / "models--local--drafter", "0" * 40
    save_drafter(
        drafter, repo / "snapshots" / revision, format="dflash", target_model=target
    )
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(revision)
    request = dict(
        peer_src=str(peer),
        target=str(tmp_path / "target"),
        repo_id="local/drafter",
        prompt=prompt,
        anchor=anchor,
        max_tokens=max_tokens,
        out=str(tmp_path / "public.safetensors"),
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(
        HF_HUB_OFFLINE="1",
        HF_HUB_CACHE=str(tmp_path / "hub"),
        PYTHONDONTWRITEBYTECODE="1",  # leave the public package's folder untouched
    )
    probe = (Path(__file__).parent / "public_dflash_probe.py").read_text()
    # A fresh interpreter outside our checkout: their package is also named dflash.
    run = subprocess.run(
        [sys.executable, "-c", probe, json.dumps(request)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr[-4000:]
    arrays, metadata = mx.load(request["out"], return_metadata=True)
    return arrays, json.loads(metadata["config"])


@pytest.mark.parametrize("kind", ["assistant", "dflash", "dflash2"])
def test_public_mlx_loader_runs_the_drafter_we_saved(tmp_path, target, kind):
    drafter = tiny_drafter(kind)
    prompt, anchor, max_tokens = [3 + 7 * i % 250 for i in range(12)], 17, 12
    theirs, their_config = run_public_loader(
        tmp_path, target, drafter, prompt, anchor, max_tokens
    )
    drafter.bind(target)
    assert their_config["class"] == (ARCH_DFLASH2 if kind == "dflash2" else ARCH_DFLASH)
    assert their_config["output_multiplier"] == drafter.logit_multiplier
    assert their_config["final_logit_softcapping"] == drafter.logit_softcap
    assert their_config["block_size"] == drafter.config.block_size

    with TargetTaps(target, drafter.config.target_layer_ids) as taps:
        target(mx.array([prompt]))
        hidden = taps.pop()
    context = drafter.make_context()
    drafter.append_context(context, hidden, 0)
    block = mx.array([[anchor] + [MASK] * (drafter.config.block_size - 1)])
    logits = drafter(block, context)[:, 1:]
    assert mx.allclose(theirs["hidden"], hidden, rtol=1e-5, atol=1e-5)
    assert mx.allclose(theirs["logits"], logits, rtol=1e-5, atol=1e-6)
    assert theirs["tokens"].tolist() == drafter.propose(block, context).tokens.tolist()
    # Their whole greedy loop with our drafter is lossless too.
    generated = theirs["generated"].tolist()
    reference = greedy_reference(target, mx.array(prompt), max_tokens)
    assert generated == reference[: len(generated)]
    assert len(generated) == max_tokens or generated[-1] == 0  # w0 ends text
