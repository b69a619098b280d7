"""The scale pair: a random-weight Muse Glimmer target and a random full-size drafter.

The target comes from :mod:`dflash.bench.scale_target` (shared with the public loop's
runner). The drafter is built through dflash's own loader path from Meta's assistant
config (``muse-glimmer-assistant-config.json``, packaged beside this module): 5 sliding
layers, hidden 6,656, block 16, taps ``1, 13, 25, 37, 49``; ``tiny`` shrinks its geometry
to fit the tiny target. Its weights are random (bf16, seeded), so its own proposals are
almost never accepted: REPLAY profiles measure speed at a chosen acceptance.
"""

import json
from dataclasses import replace
from pathlib import Path
from typing import Any, Dict, List, Tuple

import mlx.core as mx
import mlx.nn as nn

from ..drafter import DFlashDrafter, DrafterConfig
from ..loader import config_from_dict
from . import scale_target

ASSISTANT_CONFIG = Path(__file__).with_name("muse-glimmer-assistant-config.json")
DEFAULT_CONTEXT = {"full": 4096, "tiny": 64}
DRAFTER_SEED_OFFSET = 1

_TINY_DRAFTER = dict(
    hidden_size=64,
    num_hidden_layers=2,
    layer_types=["sliding_attention"] * 2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    intermediate_size=128,
    sliding_window=32,
    block_size=8,
    mask_token_id=511,
    target_layer_ids=[1, 3, 5, 7],
    max_position_embeddings=4096,
)


def drafter_block_size(geometry: str) -> int:
    """The block size of a scale geometry's drafter (known before anything is built)."""
    if geometry == "tiny":
        return int(_TINY_DRAFTER["block_size"])
    return int(json.loads(ASSISTANT_CONFIG.read_text())["block_size"])


def drafter_config(geometry: str, target: nn.Module) -> DrafterConfig:
    """The drafter config of a scale geometry, read through ``config_from_dict``.

    Fields the assistant layout leaves to the target (vocabulary, layer count, logit
    multiplier and soft-cap) are filled in from ``target.args``, so a saved copy in the
    public DFlash layout is complete.

    Args:
        geometry: ``"full"`` or ``"tiny"``.
        target: The scale target.

    Returns:
        The config.
    """
    cfg: Dict[str, Any] = json.loads(ASSISTANT_CONFIG.read_text())
    if geometry == "tiny":
        cfg.update(_TINY_DRAFTER)
    config = config_from_dict(cfg)
    args = target.args
    return replace(
        config,
        vocab_size=args.vocab_size,
        num_target_layers=args.num_hidden_layers,
        output_multiplier=args.output_multiplier,
        final_logit_softcapping=args.final_logit_softcapping,
    )


def build_scale_pair(
    geometry: str, quant: str, seed: int = 0
) -> Tuple[nn.Module, DFlashDrafter]:
    """The random target (``quant``) and the random bf16 drafter bound to it.

    Args:
        geometry: ``"full"`` or ``"tiny"``.
        quant: ``"bf16"`` or a name of :data:`.scale_target.QUANT_FORMS` (the
            target only; the drafter stays bf16).
        seed: Weight seed (the drafter uses ``seed + 1``).

    Returns:
        ``(target, drafter)``.
    """
    target = scale_target.build_target(geometry, quant, seed)
    drafter = DFlashDrafter(drafter_config(geometry, target))
    scale_target.randomize(drafter, seed + DRAFTER_SEED_OFFSET, mx.bfloat16)
    drafter.eval()
    drafter.bind(target)
    return target, drafter


def scale_prompts(
    target: nn.Module, context: int, count: int, seed: int
) -> List[mx.array]:
    """``count`` seeded random prompts of ``context`` tokens.

    Args:
        target: The scale target (its vocabulary).
        context: Prompt length.
        count: Number of prompts.
        seed: Seed.

    Returns:
        The prompts.
    """
    vocab = target.args.vocab_size
    return [scale_target.random_prompt(vocab, context, seed, i) for i in range(count)]


def geometry_summary(model: nn.Module) -> Dict[str, Any]:
    """The target's geometry as reported in the JSON (mlx-lm ``args`` fields).

    Args:
        model: An mlx-lm model.

    Returns:
        Layer counts by type, widths, vocabulary, window, quantization, parameter bytes.
    """
    args = getattr(model, "args", None)
    out: Dict[str, Any] = {"model_type": getattr(args, "model_type", None)}
    for name in (
        "num_hidden_layers",
        "hidden_size",
        "intermediate_size",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "vocab_size",
        "sliding_window",
    ):
        out[name] = getattr(args, name, None)
    types = getattr(args, "layer_types", None) or []
    out["layer_types"] = {t: list(types).count(t) for t in sorted(set(types))}
    quantized = [
        m for _, m in model.named_modules() if isinstance(m, nn.QuantizedLinear)
    ]
    out["quantization"] = (
        {"bits": quantized[0].bits, "group_size": quantized[0].group_size}
        if quantized
        else None
    )
    leaves = [v for _, v in _flat(model)]
    out["dtype"] = str(leaves[0].dtype) if leaves else None
    out["parameter_bytes"] = scale_target.parameter_bytes(model)
    return out


def _flat(model: nn.Module):
    from mlx.utils import tree_flatten

    return [(k, v) for k, v in tree_flatten(model.parameters()) if v.ndim >= 2][:1]
