"""Shared fixtures: tiny random-weight mlx-lm models and a divergence checker."""

import importlib
import json
import os
from typing import Optional, Sequence

# On a GPU, mlx runs float32 matmuls in TF32 unless told not to (MLX_ENABLE_TF32, read
# at the first matmul); the tests compare our float32 kernels with mlx's float32 ops.
os.environ.setdefault("MLX_ENABLE_TF32", "0")

import mlx.core as mx  # noqa: E402
import pytest
from hypothesis import HealthCheck, settings
from mlx.utils import tree_flatten

from dflash.bench.scale_target import GEOMETRIES
from dflash.greedy import (  # noqa: F401 (re-exported to the tests)
    greedy_reference,
    mlx_lm_generate_module,
    top2_margin,
)

settings.register_profile(
    "ci", deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True
)
settings.load_profile("ci")

_TINY_ARGS = {
    # The bench's tiny Muse Glimmer layers, with a smaller vocabulary and the window and
    # positions left to tiny_model / mlx-lm.
    "muse_glimmer": dict(
        {
            key: value
            for key, value in GEOMETRIES["tiny"].items()
            if key not in ("sliding_window", "max_position_embeddings")
        },
        vocab_size=256,
    ),
    "gemma3_text": dict(
        model_type="gemma3_text",
        hidden_size=64,
        num_hidden_layers=6,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        vocab_size=256,
        query_pre_attn_scalar=16,
        sliding_window_pattern=3,
    ),
    "gpt_oss": dict(
        num_hidden_layers=4,
        num_local_experts=4,
        num_experts_per_tok=2,
        vocab_size=256,
        hidden_size=64,
        intermediate_size=64,
        head_dim=16,
        num_attention_heads=4,
        num_key_value_heads=2,
    ),
    "cohere2": dict(
        model_type="cohere2",
        hidden_size=64,
        head_dim=16,
        num_hidden_layers=4,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=256,
        sliding_window_pattern=4,
    ),
    "qwen3": dict(
        model_type="qwen3",
        hidden_size=64,
        num_hidden_layers=4,
        intermediate_size=128,
        num_attention_heads=4,
        rms_norm_eps=1e-6,
        vocab_size=256,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        head_dim=16,
        tie_word_embeddings=True,
        rope_theta=10000.0,
    ),
    "llama": dict(
        model_type="llama",
        hidden_size=64,
        num_hidden_layers=4,
        intermediate_size=128,
        num_attention_heads=4,
        rms_norm_eps=1e-6,
        vocab_size=256,
        num_key_value_heads=2,
    ),
}

SLIDING_ARCHS = ("muse_glimmer", "gemma3_text", "gpt_oss", "cohere2")


def tiny_model(arch: str, seed: int = 0, window: Optional[int] = 16, **overrides):
    """A float32 random-weight mlx-lm model of architecture ``arch``."""
    module = importlib.import_module(f"mlx_lm.models.{arch}")
    args = dict(_TINY_ARGS[arch])
    if window is not None and arch in SLIDING_ARCHS:
        args["sliding_window"] = window
    args.update(overrides)
    mx.random.seed(seed)
    model = module.Model(module.ModelArgs(**args))
    model.set_dtype(mx.float32)
    if arch == "gpt_oss":
        # Attention sinks start at zero; random ones exercise the sink path too.
        for layer in model.layers:
            layer.self_attn.sinks = mx.random.normal(layer.self_attn.sinks.shape)
    mx.eval(model.parameters())
    return model


# The DFlash2 fields of a tiny drafter (candidate selector and causal conv) over a
# 256-token vocabulary.
TINY_DFLASH2 = dict(
    architecture="DFlash2DraftModel",
    conv_kernel_size=2,
    conv_group_size=16,
    selector_rank=8,
    selector_top_k=5,
    vocab_size=256,
)


def tiny_drafter_config(**fields):
    """A tiny DFlash drafter config: two layers (sliding, full) at the tiny models' width.

    Args:
        **fields: ``DrafterConfig`` fields that replace the defaults (the taps,
            ``target_layer_ids``, are required).
    """
    from dflash.drafter import DrafterConfig

    defaults = dict(
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        intermediate_size=96,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        layer_types=("sliding_attention", "full_attention"),
        sliding_window=16,
        block_size=8,
        mask_token_id=255,
    )
    return DrafterConfig(**{**defaults, **fields})


def assert_lossless(
    model, prompt: mx.array, reference: Sequence[int], output: Sequence[int]
):
    """``output`` equals ``reference``, except after a near-tie (top-2 margin < 1e-4).

    A mismatch at a near-tie is reported (printed) and ends the comparison there, since the
    two continuations legitimately part ways after it.
    """
    assert len(output) == len(reference), (len(output), len(reference))
    for index, (want, got) in enumerate(zip(reference, output)):
        if want == got:
            continue
        context = prompt.tolist() + list(reference[:index])
        margin = top2_margin(model, context)
        assert margin < 1e-4, (
            f"output diverges from the target's greedy output at generated token {index} "
            f"(want {want}, got {got}); top-2 margin {margin:.3g} is no near-tie"
        )
        print(f"near-tie flip at generated token {index}: margin {margin:.3g}")
        return


@pytest.fixture(autouse=True)
def _cuda_graphs_setting_restored(monkeypatch):
    """The commands set ``MLX_USE_CUDA_GRAPHS`` (:mod:`dflash.launch_mode`); whatever a
    test sets, the next test sees the process's own value."""
    name = "MLX_USE_CUDA_GRAPHS"
    value = os.environ.get(name)
    monkeypatch.setenv(name, "")  # records the value to put back after the test
    if value is None:
        monkeypatch.delenv(name)
    else:
        monkeypatch.setenv(name, value)


@pytest.fixture
def glimmer():
    return tiny_model("muse_glimmer", seed=0)


def tiny_tokenizer(vocab_size: int = 256):
    """An offline word-level tokenizer: token ``i`` is the word ``w{i}``; ``w0`` ends text."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"w{i}": i for i in range(vocab_size)}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="w1"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    backend.decoder = decoders.WordPiece(prefix="##")
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, eos_token="w0", unk_token="w1"
    )


def save_target(model, path):
    """Save a tiny target as an mlx-lm model folder (weights, config, tiny tokenizer)."""
    path.mkdir(parents=True)
    mx.save_safetensors(
        str(path / "model.safetensors"), dict(tree_flatten(model.parameters()))
    )
    config = {k: v for k, v in vars(model.args).items() if not k.startswith("_")}
    (path / "config.json").write_text(json.dumps(config))
    tiny_tokenizer().save_pretrained(str(path))


def recorded_async_evals(monkeypatch, module: str) -> list:
    """Record what ``module`` starts with ``mx.async_eval`` (each call's first
    argument), still starting it; the list fills as the test runs."""
    started = []
    real_async_eval = mx.async_eval

    def recording_async_eval(*arrays):
        started.append(arrays[0])
        real_async_eval(*arrays)

    monkeypatch.setattr(f"{module}.mx.async_eval", recording_async_eval)
    return started
