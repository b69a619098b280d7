"""Load and save DFlash drafter checkpoints.

Two on-disk layouts are understood:

* ``"assistant"``: Meta's ``MuseGlimmerAssistantModel``. DFlash keys
  (``block_size``, ``mask_token_id``, ``target_layer_ids``) sit at the top level
  of ``config.json``; weights ``encoder.fc.*`` / ``encoder.output_norm_enc.*`` are
  this package's ``fc.*`` / ``hidden_norm.*``; in-block attention is bidirectional.
* ``"dflash"``: the public DFlash layout (``DFlashDraftModel`` and
  ``DFlash2DraftModel``) with a ``dflash_config`` block. ``DFlash2DraftModel``
  adds per-layer ``attention_conv`` / ``mlp_conv`` and a ``candidate_selector``
  whose codebooks are stored without a ``.weight`` suffix.

Loading fails closed: every model parameter must come from the checkpoint with
the right shape, nothing in the checkpoint may be left over, and the drafter must
fit the target it is bound to.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import (
    Any,
    Dict,
    Iterable,
    List,
    Mapping,
    Optional,
    Sequence,
    Tuple,
    Union,
)

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from .drafter import (
    ARCH_ASSISTANT,
    ARCH_DFLASH,
    ARCH_DFLASH2,
    ARCHITECTURES,
    EMBED_RAW,
    FULL_ATTENTION,
    DFlashDrafter,
    DrafterConfig,
    _find_embedding_owner,
)
from .taps import target_layers

FORMAT_ASSISTANT = "assistant"
FORMAT_DFLASH = "dflash"
FORMATS = (FORMAT_ASSISTANT, FORMAT_DFLASH)

_ASSISTANT_PREFIXES = (
    ("encoder.fc.", "fc."),
    ("encoder.output_norm_enc.", "hidden_norm."),
)
_BARE_CODEBOOKS = (
    "candidate_selector.predecessor_codebook",
    "candidate_selector.successor_codebook",
)
_HUB_PATTERNS = ["*.json", "*.safetensors"]
_SHOWN = 5


class DrafterLoadError(ValueError):
    """A drafter checkpoint that cannot be used as asked; the message says why."""


def checkpoint_format(cfg: Mapping[str, Any]) -> str:
    """Which on-disk layout a drafter ``config.json`` describes.

    Args:
        cfg: Parsed ``config.json``.

    Returns:
        ``"assistant"`` or ``"dflash"``.

    Raises:
        DrafterLoadError: the architecture is not a supported drafter.

    Shapes: none.
    """
    return FORMAT_ASSISTANT if _architecture(cfg) == ARCH_ASSISTANT else FORMAT_DFLASH


def _architecture(cfg: Mapping[str, Any]) -> str:
    archs = cfg.get("architectures")
    arch = archs[0] if isinstance(archs, list) and archs else None
    if arch not in ARCHITECTURES:
        raise DrafterLoadError(
            f"unknown drafter architecture {arch!r}; supported: {list(ARCHITECTURES)}"
        )
    return arch


def config_from_dict(
    cfg: Mapping[str, Any], embedding: str = EMBED_RAW
) -> DrafterConfig:
    """Build a :class:`DrafterConfig` from a checkpoint's ``config.json``.

    Args:
        cfg: Parsed ``config.json`` of either supported layout.
        embedding: Block embedding mode (``"raw"`` or ``"target"``), a runtime
            choice the checkpoint does not record.

    Returns:
        The drafter config.

    Raises:
        DrafterLoadError: unknown architecture, missing keys, or settings this
            implementation does not support.

    Shapes: none.
    """
    arch = _architecture(cfg)
    dflash = _dflash_block(cfg, arch)
    _refuse_unsupported(cfg)

    def pick(name: str, default: Any = None) -> Any:
        return dflash.get(name, cfg.get(name, default))

    for name in ("block_size", "mask_token_id", "target_layer_ids"):
        if pick(name) is None:
            where = "config" if arch == ARCH_ASSISTANT else "dflash_config"
            raise DrafterLoadError(f"{arch} {where} is missing {name!r}")
    kwargs = dict(
        _geometry(cfg),
        architecture=arch,
        block_size=int(pick("block_size")),
        mask_token_id=int(pick("mask_token_id")),
        target_layer_ids=tuple(int(i) for i in pick("target_layer_ids")),
        output_multiplier=_optional_float(pick("output_multiplier")),
        final_logit_softcapping=_optional_float(pick("final_logit_softcapping")),
        input_embedding_scale=float(pick("input_embedding_scale", 1.0)),
        # Meta's assistant is bidirectional in-block whatever its layer types say;
        # the DFlash layout's unset is_causal means "causal on sliding layers".
        is_causal=False if arch == ARCH_ASSISTANT else cfg.get("is_causal"),
        vocab_size=cfg.get("vocab_size"),
        num_target_layers=cfg.get("num_target_layers"),
        embedding=embedding,
    )
    if arch == ARCH_DFLASH2:
        kwargs.update(_dflash2_settings(dflash, cfg))
    try:
        return DrafterConfig(**kwargs)
    except (TypeError, ValueError) as err:
        raise DrafterLoadError(f"invalid {arch} config: {err}") from err


def _dflash_block(cfg: Mapping[str, Any], arch: str) -> Mapping[str, Any]:
    if arch == ARCH_ASSISTANT:
        return {}
    block = cfg.get("dflash_config")
    if not isinstance(block, dict):
        raise DrafterLoadError(f"{arch} config has no 'dflash_config' block")
    return block


def _refuse_unsupported(cfg: Mapping[str, Any]) -> None:
    act = cfg.get("hidden_act", cfg.get("hidden_activation", "silu"))
    if act != "silu":
        raise DrafterLoadError(f"unsupported hidden_act {act!r} (only 'silu')")
    for flag in ("attention_bias", "mlp_bias"):
        if cfg.get(flag):
            raise DrafterLoadError(f"unsupported {flag}=true (drafter has no biases)")


def _geometry(cfg: Mapping[str, Any]) -> Dict[str, Any]:
    required = (
        "hidden_size",
        "num_hidden_layers",
        "num_attention_heads",
        "intermediate_size",
        "rms_norm_eps",
    )
    missing = [name for name in required if cfg.get(name) is None]
    if missing:
        raise DrafterLoadError(f"drafter config is missing {missing}")
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    theta = cfg.get("rope_theta", rope.get("rope_theta"))
    if theta is None:
        raise DrafterLoadError("drafter config has no rope_theta")
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    layers = int(cfg["num_hidden_layers"])
    heads = int(cfg["num_attention_heads"])
    return dict(
        hidden_size=int(cfg["hidden_size"]),
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=int(cfg.get("num_key_value_heads") or heads),
        head_dim=int(cfg.get("head_dim") or int(cfg["hidden_size"]) // heads),
        intermediate_size=int(cfg["intermediate_size"]),
        rms_norm_eps=float(cfg["rms_norm_eps"]),
        rope_theta=float(theta),
        rope_scaling=dict(rope) if rope_type != "default" else None,
        max_position_embeddings=cfg.get("max_position_embeddings"),
        layer_types=tuple(cfg.get("layer_types") or (FULL_ATTENTION,) * layers),
        sliding_window=cfg.get("sliding_window"),
    )


def _dflash2_settings(
    dflash: Mapping[str, Any], cfg: Mapping[str, Any]
) -> Dict[str, int]:
    names = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")
    settings = {name: int(dflash.get(name) or 0) for name in names}
    unset = [name for name, value in settings.items() if value <= 0]
    if not cfg.get("vocab_size"):
        unset.append("vocab_size")
    if unset:
        raise DrafterLoadError(
            f"{ARCH_DFLASH2} needs positive {list(names)} in dflash_config and a "
            f"vocab_size; missing or non-positive: {unset}"
        )
    return settings


def _optional_float(value: Any) -> Optional[float]:
    return None if value is None else float(value)


def checkpoint_to_model_name(name: str, fmt: str) -> str:
    """Map a checkpoint tensor name to this package's parameter name.

    Args:
        name: Tensor name as stored in the safetensors file.
        fmt: ``"assistant"`` or ``"dflash"``.

    Returns:
        The drafter parameter name.

    Shapes: none.
    """
    if fmt == FORMAT_ASSISTANT:
        for stored, ours in _ASSISTANT_PREFIXES:
            if name.startswith(stored):
                return ours + name[len(stored) :]
        return name
    return name + ".weight" if name in _BARE_CODEBOOKS else name


def model_to_checkpoint_name(name: str, fmt: str) -> str:
    """Map a drafter parameter name to its tensor name in layout ``fmt``.

    Args:
        name: Parameter name from ``tree_flatten(drafter.parameters())``.
        fmt: ``"assistant"`` or ``"dflash"``.

    Returns:
        The checkpoint tensor name.

    Shapes: none.
    """
    if fmt == FORMAT_ASSISTANT:
        for stored, ours in _ASSISTANT_PREFIXES:
            if name.startswith(ours):
                return stored + name[len(ours) :]
        return name
    bare = name[: -len(".weight")]
    return bare if bare in _BARE_CODEBOOKS else name


def map_checkpoint_names(names: Iterable[str], fmt: str) -> Dict[str, str]:
    """Model parameter name for each checkpoint name, refusing collisions.

    Args:
        names: Checkpoint tensor names.
        fmt: ``"assistant"`` or ``"dflash"``.

    Returns:
        ``{model name: checkpoint name}``.

    Raises:
        DrafterLoadError: two checkpoint tensors land on one parameter.

    Shapes: none.
    """
    mapped: Dict[str, str] = {}
    for name in names:
        ours = checkpoint_to_model_name(name, fmt)
        if ours in mapped:
            raise DrafterLoadError(
                f"checkpoint tensors {mapped[ours]!r} and {name!r} both map to "
                f"parameter {ours!r}"
            )
        mapped[ours] = name
    return mapped


def check_weights(
    drafter: DFlashDrafter, shapes: Mapping[str, Sequence[int]], fmt: str
) -> None:
    """Check checkpoint tensor names and shapes against the drafter's parameters.

    Args:
        drafter: A drafter built from the checkpoint's config (may be lazy).
        shapes: ``{checkpoint tensor name: shape}``.
        fmt: ``"assistant"`` or ``"dflash"``.

    Raises:
        DrafterLoadError: naming a few missing, extra and mis-shaped tensors.

    Shapes: none.
    """
    mapped = map_checkpoint_names(shapes, fmt)
    expected = {k: tuple(v.shape) for k, v in tree_flatten(drafter.parameters())}
    missing = [model_to_checkpoint_name(k, fmt) for k in expected if k not in mapped]
    extra = [mapped[k] for k in mapped if k not in expected]
    wrong = [
        f"{mapped[k]} {tuple(shapes[mapped[k]])} != expected {expected[k]}"
        for k in mapped
        if k in expected and tuple(shapes[mapped[k]]) != expected[k]
    ]
    problems = []
    if missing:
        problems.append(f"missing weights {_few(sorted(missing))}")
    if extra:
        problems.append(f"unexpected weights {_few(sorted(extra))}")
    if wrong:
        problems.append(f"shape mismatches {_few(sorted(wrong))}")
    if problems:
        raise DrafterLoadError(
            f"{drafter.config.architecture} checkpoint does not match the model: "
            + "; ".join(problems)
        )


def _few(items: List[str]) -> str:
    shown = ", ".join(items[:_SHOWN])
    more = len(items) - _SHOWN
    return f"[{shown}{f', ... and {more} more' if more > 0 else ''}]"


def check_target(config: DrafterConfig, target_model: nn.Module) -> None:
    """Refuse a drafter that cannot read this target's hidden states or vocabulary.

    Args:
        config: The drafter config.
        target_model: The mlx-lm target model.

    Raises:
        DrafterLoadError: hidden size, layer ids, mask token or selector vocabulary
            do not fit the target.

    Shapes: none.
    """
    hidden, vocab = _target_sizes(target_model)
    if config.hidden_size != hidden:
        raise DrafterLoadError(
            f"drafter hidden_size {config.hidden_size} != target hidden_size {hidden}"
        )
    count = len(target_layers(target_model))
    bad = [i for i in config.target_layer_ids if not 0 <= i < count]
    if bad:
        raise DrafterLoadError(
            f"target_layer_ids {bad} out of range for a target with {count} layers "
            f"(valid 0..{count - 1})"
        )
    if not 0 <= config.mask_token_id < vocab:
        raise DrafterLoadError(
            f"mask_token_id {config.mask_token_id} is outside the target vocabulary "
            f"(size {vocab})"
        )
    if config.has_candidate_selector and config.vocab_size != vocab:
        raise DrafterLoadError(
            f"candidate selector vocab_size {config.vocab_size} != target vocab "
            f"size {vocab}"
        )


def _target_sizes(target_model: nn.Module) -> Tuple[int, int]:
    args = getattr(target_model, "args", None)
    table = _find_embedding_owner(target_model).embed_tokens
    hidden = getattr(args, "hidden_size", None)
    vocab = getattr(args, "vocab_size", None)
    if hidden is None or vocab is None:
        # Unquantized table rows are (vocab, hidden); a quantized one knows its size.
        rows = getattr(table, "num_embeddings", None) or table.weight.shape[0]
        dims = getattr(table, "dims", None) or table.weight.shape[1]
        hidden, vocab = hidden or dims, vocab or rows
    return int(hidden), int(vocab)


def load_drafter(
    path_or_repo: Union[str, Path],
    target_model: nn.Module,
    *,
    revision: Optional[str] = None,
    embedding: str = EMBED_RAW,
) -> DFlashDrafter:
    """Load a drafter checkpoint and bind it to ``target_model``.

    Args:
        path_or_repo: Local directory with ``config.json`` and ``*.safetensors``,
            or a Hugging Face repo id (downloaded the way mlx-lm downloads models).
        target_model: The mlx-lm target the drafter will read and borrow from.
        revision: Hub revision, for repo ids.
        embedding: Block embedding mode, see :class:`DrafterConfig`.

    Returns:
        The bound drafter with the checkpoint's weights.

    Raises:
        DrafterLoadError: anything that would make the drafter silently wrong.

    Shapes: none.
    """
    path = _resolve(path_or_repo, revision)
    cfg = _read_config(path)
    fmt = checkpoint_format(cfg)
    config = config_from_dict(cfg, embedding=embedding)
    check_target(config, target_model)
    drafter = DFlashDrafter(config)
    weights = _read_weights(path)
    check_weights(drafter, {k: v.shape for k, v in weights.items()}, fmt)
    mapped = map_checkpoint_names(weights, fmt)
    drafter.load_weights([(ours, weights[name]) for ours, name in mapped.items()])
    mx.eval(drafter.parameters())
    drafter.eval()
    try:
        drafter.bind(target_model)
    except ValueError as err:
        raise DrafterLoadError(str(err)) from err
    return drafter


def _resolve(path_or_repo: Union[str, Path], revision: Optional[str]) -> Path:
    path = Path(path_or_repo).expanduser()
    if path.exists():
        if not path.is_dir():
            raise DrafterLoadError(f"drafter path {path} is not a directory")
        return path
    text = str(path_or_repo)
    if _looks_local(text):
        raise DrafterLoadError(f"no such drafter directory: {text}")
    # Same hub download mlx-lm uses for models (imported late: it pulls in the
    # tokenizer stack).
    from mlx_lm import utils as mlx_utils

    return Path(
        mlx_utils._download(text, revision=revision, allow_patterns=_HUB_PATTERNS)
    )


def _looks_local(text: str) -> bool:
    return (
        text.startswith(("/", ".", "~"))
        or "\\" in text
        or text.count("/") != 1
        or text.endswith("/")
    )


def _read_config(path: Path) -> Dict[str, Any]:
    file = path / "config.json"
    if not file.is_file():
        raise DrafterLoadError(f"{path} has no config.json")
    try:
        return json.loads(file.read_text())
    except json.JSONDecodeError as err:
        raise DrafterLoadError(f"{file} is not valid JSON: {err}") from err


def _read_weights(path: Path) -> Dict[str, mx.array]:
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise DrafterLoadError(f"{path} has no *.safetensors files")
    weights: Dict[str, mx.array] = {}
    for file in files:
        for name, value in mx.load(str(file)).items():
            if name in weights:
                raise DrafterLoadError(f"tensor {name!r} appears in two shards")
            weights[name] = value
    return weights


def save_drafter(
    drafter: DFlashDrafter, path: Union[str, Path], format: str = FORMAT_ASSISTANT
) -> Path:
    """Write ``config.json`` and ``model.safetensors`` in layout ``format``.

    Args:
        drafter: The drafter to save (bound or not).
        path: Output directory (created if needed).
        format: ``"assistant"`` (MuseGlimmerAssistantModel) or ``"dflash"``
            (DFlashDraftModel / DFlash2DraftModel with a ``dflash_config``).

    Returns:
        The output directory.

    Raises:
        ValueError: the layout cannot express this drafter (DFlash2 components or
            causal in-block attention in the assistant layout).

    Shapes: none.
    """
    if format not in FORMATS:
        raise ValueError(f"format must be one of {list(FORMATS)}, got {format!r}")
    cfg = drafter.config
    if format == FORMAT_ASSISTANT:
        if cfg.has_dynamic_conv or cfg.has_candidate_selector:
            raise ValueError(
                "the assistant layout cannot hold DFlash2 convs or a candidate "
                "selector; use format='dflash'"
            )
        if cfg.is_causal is not False:
            raise ValueError(
                "the assistant layout implies bidirectional in-block attention; "
                f"this drafter has is_causal={cfg.is_causal}"
            )
    elif cfg.has_dynamic_conv != cfg.has_candidate_selector:
        raise ValueError(
            f"{ARCH_DFLASH2} has both dynamic convs and a candidate selector; this "
            "drafter has only one of them"
        )
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    tensors = {
        model_to_checkpoint_name(name, format): value
        for name, value in tree_flatten(drafter.parameters())
    }
    mx.save_safetensors(
        str(out / "model.safetensors"), tensors, metadata={"format": "mlx"}
    )
    text = json.dumps(config_to_dict(cfg, format), indent=2, sort_keys=True)
    (out / "config.json").write_text(text + "\n")
    return out


def config_to_dict(config: DrafterConfig, fmt: str) -> Dict[str, Any]:
    """The ``config.json`` contents of ``config`` in layout ``fmt``.

    Args:
        config: The drafter config.
        fmt: ``"assistant"`` or ``"dflash"``.

    Returns:
        A JSON-serialisable dict that :func:`config_from_dict` reads back.

    Shapes: none.
    """
    rope = dict(config.rope_scaling or {"rope_type": "default"})
    rope["rope_theta"] = config.rope_theta
    out: Dict[str, Any] = dict(
        hidden_size=config.hidden_size,
        num_hidden_layers=config.num_hidden_layers,
        num_attention_heads=config.num_attention_heads,
        num_key_value_heads=config.num_key_value_heads,
        head_dim=config.head_dim,
        intermediate_size=config.intermediate_size,
        rms_norm_eps=config.rms_norm_eps,
        hidden_act="silu",
        attention_bias=False,
        layer_types=list(config.layer_types),
        rope_parameters=rope,
    )
    for name in ("sliding_window", "max_position_embeddings", "vocab_size"):
        if getattr(config, name) is not None:
            out[name] = getattr(config, name)
    dflash = _dflash_settings(config)
    if fmt == FORMAT_ASSISTANT:
        out.update(
            architectures=[ARCH_ASSISTANT],
            model_type="muse_glimmer_assistant",
            **dflash,
        )
        return out
    extras = config.has_dynamic_conv or config.has_candidate_selector
    out.update(
        architectures=[ARCH_DFLASH2 if extras else ARCH_DFLASH],
        model_type="qwen3",
        dflash_config=dflash,
    )
    if config.is_causal is not None:
        out["is_causal"] = config.is_causal
    if config.num_target_layers is not None:
        out["num_target_layers"] = config.num_target_layers
    return out


def _dflash_settings(config: DrafterConfig) -> Dict[str, Any]:
    out: Dict[str, Any] = dict(
        block_size=config.block_size,
        mask_token_id=config.mask_token_id,
        target_layer_ids=list(config.target_layer_ids),
    )
    for name in ("output_multiplier", "final_logit_softcapping"):
        if getattr(config, name) is not None:
            out[name] = getattr(config, name)
    if config.input_embedding_scale != 1.0:
        out["input_embedding_scale"] = config.input_embedding_scale
    if config.has_dynamic_conv or config.has_candidate_selector:
        out.update(
            conv_kernel_size=config.conv_kernel_size,
            conv_group_size=config.conv_group_size,
            selector_rank=config.selector_rank,
            selector_top_k=config.selector_top_k,
        )
    return out
