"""Drafter checkpoints: real fixture layouts, save/load round trips, fail-closed loading."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import mlx.core as mx
from conftest import tiny_model
import pytest
from mlx.utils import tree_flatten
from mlx_lm.models import qwen3

from dflash.drafter import (
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
    load_drafter,
    save_drafter,
)

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
        extras = dict(
            architecture=ARCH_DFLASH2,
            conv_kernel_size=2,
            conv_group_size=16,
            selector_rank=8,
            selector_top_k=4,
            vocab_size=VOCAB,
            output_multiplier=0.25,
            final_logit_softcapping=15.0,
        )
    elif kind == "dflash":
        extras = dict(architecture=ARCH_DFLASH, is_causal=None, vocab_size=VOCAB)
    config = DrafterConfig(
        hidden_size=HIDDEN,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        intermediate_size=96,
        rms_norm_eps=1e-5,
        rope_theta=50000.0,
        layer_types=("sliding_attention", "full_attention"),
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


def saved(tmp_path: Path, kind: str, fmt: str) -> Path:
    return save_drafter(tiny_drafter(kind), tmp_path / f"{kind}-{fmt}", format=fmt)


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
    path = save_drafter(original, tmp_path / "drafter", format=fmt)
    loaded = load_drafter(path, target)
    want_arch = {"assistant": ARCH_ASSISTANT, "dflash": ARCH_DFLASH}[fmt]
    want_arch = ARCH_DFLASH2 if kind == "dflash2" else want_arch
    assert loaded.config == dataclasses.replace(original.config, architecture=want_arch)
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


def test_saved_dflash2_codebooks_are_bare(tmp_path):
    path = saved(tmp_path, "dflash2", "dflash")
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
    path = saved(tmp_path, "dflash", "dflash")
    edit_config(path, mask_token_id=300)
    with pytest.raises(DrafterLoadError, match=r"mask_token_id 300 .*\(size 256\)"):
        load_drafter(path, target)


def test_selector_vocabulary_must_match_target(tmp_path, target):
    path = saved(tmp_path, "dflash2", "dflash")
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
    path = saved(tmp_path, "dflash2", "dflash")

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
    path = saved(tmp_path, "dflash2", "dflash")
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
    path = saved(tmp_path, "dflash2", "dflash")
    edit_config(path, selector_top_k=0)
    with pytest.raises(DrafterLoadError, match="selector_top_k"):
        load_drafter(path, target)


def test_missing_local_directory_never_reaches_the_hub(tmp_path, target):
    with pytest.raises(DrafterLoadError, match="no such drafter directory"):
        load_drafter(str(tmp_path / "absent"), target)
    with pytest.raises(DrafterLoadError, match="no such drafter directory"):
        load_drafter("./relative/absent", target)
