"""Load and save DFlash drafter checkpoints.

Two on-disk layouts are understood:

* ``"assistant"``: Meta's ``MuseGlimmerAssistantModel``. DFlash keys
  (``block_size``, ``mask_token_id``, ``target_layer_ids``) sit at the top level
  of ``config.json``; weights ``encoder.fc.*`` / ``encoder.output_norm_enc.*`` are
  this package's ``fc.*`` / ``hidden_norm.*``; in-block attention is bidirectional.
  An unset ``output_multiplier`` / ``final_logit_softcapping`` means the target's.
* ``"dflash"``: the public DFlash layout (``DFlashDraftModel`` and
  ``DFlash2DraftModel``) with a ``dflash_config`` block. ``DFlash2DraftModel``
  adds per-layer ``attention_conv`` / ``mlp_conv`` and a ``candidate_selector``
  whose codebooks are stored without a ``.weight`` suffix. As in the public
  DFlash loaders, an absent ``output_multiplier`` is 1.0 and an absent
  ``final_logit_softcapping`` is none: this layout never borrows them from the
  target, so :func:`save_drafter` writes the values the drafter uses.

Loading fails closed with :class:`DrafterLoadError` naming the file and the field
or tensor: every ``config.json`` value the loader reads is type- and range-checked
(an integer is never a float or a bool, nothing is truncated), a ``*.safetensors``
file's header is checked against the file before any tensor is read, every model
parameter must come from the checkpoint with the right shape and a float dtype,
nothing in the checkpoint may be left over, and the drafter must fit the target
it is bound to. The target is never modified by a load, failed or not.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
from pathlib import Path
from typing import (
    Any,
    Dict,
    Iterable,
    Iterator,
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
from mlx_lm.models.rope_utils import initialize_rope

from .drafter import (
    ARCH_ASSISTANT,
    ARCH_DFLASH,
    ARCH_DFLASH2,
    ARCHITECTURES,
    EMBED_RAW,
    EMBED_TARGET,
    FULL_ATTENTION,
    DFlashDrafter,
    DrafterConfig,
    _find_embedding_owner,
    config_field_problem,
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

# DFlash settings that live in the public layout's ``dflash_config`` block (the
# loader also accepts them at the top level, as the public torch loader does).
_DFLASH_KEYS = frozenset(
    {
        "block_size",
        "mask_token_id",
        "target_layer_ids",
        "output_multiplier",
        "final_logit_softcapping",
        "input_embedding_scale",
        "conv_kernel_size",
        "conv_group_size",
        "selector_rank",
        "selector_top_k",
    }
)
_DFLASH2_KEYS = (
    "conv_kernel_size",
    "conv_group_size",
    "selector_rank",
    "selector_top_k",
)
# What the public layout records but this package may leave to the bound target.
_TARGET_DERIVED = (
    "vocab_size",
    "num_target_layers",
    "max_position_embeddings",
    "output_multiplier",
    "final_logit_softcapping",
)

# safetensors dtype names and their item sizes; drafter weights must be floats.
_SAFETENSORS_ITEM_BYTES = {
    **dict.fromkeys(("BOOL", "U8", "I8", "F8_E4M3", "F8_E5M2"), 1),
    **dict.fromkeys(("I16", "U16", "F16", "BF16"), 2),
    **dict.fromkeys(("I32", "U32", "F32"), 4),
    **dict.fromkeys(("I64", "U64", "F64"), 8),
}
_WEIGHT_DTYPES = ("F16", "BF16", "F32")
# The safetensors reference implementation refuses larger headers too.
_HEADER_LIMIT = 100 * 1024 * 1024


class DrafterLoadError(ValueError):
    """A drafter checkpoint that cannot be used as asked; the message says why."""


@contextlib.contextmanager
def _blame(where: Union[str, Path]) -> Iterator[None]:
    """Prefix any :class:`DrafterLoadError` raised inside with the file at fault."""
    try:
        yield
    except DrafterLoadError as err:
        raise DrafterLoadError(f"{where}: {err}") from err


def checkpoint_format(cfg: Mapping[str, Any]) -> str:
    """Which on-disk layout a drafter ``config.json`` describes.

    Args:
        cfg: Parsed ``config.json``.

    Returns:
        ``"assistant"`` or ``"dflash"``.

    Raises:
        DrafterLoadError: the architecture is not a supported drafter.
    """
    return FORMAT_ASSISTANT if _architecture(cfg) == ARCH_ASSISTANT else FORMAT_DFLASH


def _architecture(cfg: Mapping[str, Any]) -> str:
    archs = cfg.get("architectures")
    if not (isinstance(archs, list) and archs and isinstance(archs[0], str)):
        raise DrafterLoadError(
            f"architectures must be a non-empty list of strings, got {archs!r}; "
            f"supported drafters: {list(ARCHITECTURES)}"
        )
    if archs[0] not in ARCHITECTURES:
        raise DrafterLoadError(
            f"unknown drafter architecture {archs[0]!r}; supported: "
            f"{list(ARCHITECTURES)}"
        )
    return archs[0]


class _ConfigReader:
    """Typed reads of ``config.json`` values; each error names the key's JSON path.

    DFlash settings are looked up in ``dflash_config`` first, then at the top
    level; geometry keys only at the top level.
    """

    def __init__(self, cfg: Mapping[str, Any], arch: str) -> None:
        self.cfg = cfg
        self.arch = arch
        self.block: Mapping[str, Any] = {}
        if arch != ARCH_ASSISTANT:
            block = cfg.get("dflash_config")
            if not isinstance(block, dict):
                raise DrafterLoadError(
                    f"{arch} config needs a 'dflash_config' object, got {block!r}"
                )
            self.block = block

    def path(self, key: str) -> str:
        """The JSON path a key is read from (or would be, when absent)."""
        nested = key in self.block or (
            key in _DFLASH_KEYS and self.arch != ARCH_ASSISTANT and key not in self.cfg
        )
        return f"dflash_config.{key}" if nested else key

    def raw(self, key: str) -> Any:
        """The stored value of ``key`` (``None`` when absent or null)."""
        return self.block[key] if key in self.block else self.cfg.get(key)

    def field(self, name: str, *, default: Any = None, required: bool = False) -> Any:
        """Read DrafterConfig field ``name``, refusing a value it cannot hold.

        Args:
            name: DrafterConfig field, also the ``config.json`` key.
            default: Value when the key is absent or null.
            required: Absent or null is an error.

        Returns:
            The checked value.

        Raises:
            DrafterLoadError: naming the key's path and what it must be.
        """
        value = self.raw(name)
        if value is None:
            if required:
                raise DrafterLoadError(f"{self.path(name)} is missing")
            value = default
        problem = config_field_problem(name, value)
        if problem:
            raise DrafterLoadError(f"{self.path(name)} {problem}")
        return value


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
        DrafterLoadError: unknown architecture, a missing key, a value of the
            wrong type or range (naming its JSON path), or settings this
            implementation does not support.
    """
    if not isinstance(cfg, Mapping):
        raise DrafterLoadError(
            f"a drafter config must be a JSON object, got {type(cfg).__name__}"
        )
    arch = _architecture(cfg)
    read = _ConfigReader(cfg, arch)
    _refuse_unsupported(cfg)
    kwargs = dict(
        _geometry(read),
        **_dflash_settings_from(read),
        architecture=arch,
        # Meta's assistant is bidirectional in-block whatever its layer types say;
        # the DFlash layout's unset is_causal means "causal on sliding layers".
        is_causal=False if arch == ARCH_ASSISTANT else read.field("is_causal"),
        vocab_size=read.field("vocab_size"),
        num_target_layers=read.field("num_target_layers"),
        embedding=embedding,
    )
    try:
        config = DrafterConfig(**kwargs)
    except ValueError as err:
        raise DrafterLoadError(f"invalid {arch} config: {err}") from err
    _check_rope(config, read)
    return config


def _refuse_unsupported(cfg: Mapping[str, Any]) -> None:
    for key in ("hidden_act", "hidden_activation"):
        act = cfg.get(key)
        if act is not None and not isinstance(act, str):
            raise DrafterLoadError(f"{key} must be a string, got {act!r}")
        if act is not None and act != "silu":
            raise DrafterLoadError(f"unsupported {key} {act!r} (only 'silu')")
    for flag in ("attention_bias", "mlp_bias"):
        value = cfg.get(flag)
        if value is not None and not isinstance(value, bool):
            raise DrafterLoadError(f"{flag} must be true or false, got {value!r}")
        if value:
            raise DrafterLoadError(f"unsupported {flag}=true (drafter has no biases)")


def _geometry(read: _ConfigReader) -> Dict[str, Any]:
    hidden = read.field("hidden_size", required=True)
    layers = read.field("num_hidden_layers", required=True)
    heads = read.field("num_attention_heads", required=True)
    rope, rope_key = _rope_block(read.cfg)
    theta_path = "rope_theta" if "rope_theta" in read.cfg else f"{rope_key}.rope_theta"
    theta = read.cfg.get("rope_theta", rope.get("rope_theta"))
    if theta is None:
        raise DrafterLoadError(f"{theta_path} is missing")
    problem = config_field_problem("rope_theta", theta)
    if problem:
        raise DrafterLoadError(f"{theta_path} {problem}")
    # The same precedence as mlx-lm's initialize_rope, which builds the RoPE.
    type_key = "type" if rope.get("type") else "rope_type"
    rope_type = rope.get(type_key, "default")
    if not isinstance(rope_type, str):
        raise DrafterLoadError(
            f"{rope_key}.{type_key} must be a string, got {rope_type!r}"
        )
    return dict(
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=read.field("num_key_value_heads", default=heads),
        head_dim=read.field("head_dim", default=hidden // heads),
        intermediate_size=read.field("intermediate_size", required=True),
        rms_norm_eps=read.field("rms_norm_eps", required=True),
        rope_theta=theta,
        rope_scaling=dict(rope) if rope_type != "default" else None,
        max_position_embeddings=read.field("max_position_embeddings"),
        layer_types=read.field("layer_types", default=[FULL_ATTENTION] * layers),
        sliding_window=read.field("sliding_window"),
    )


def _rope_block(cfg: Mapping[str, Any]) -> Tuple[Mapping[str, Any], str]:
    for key in ("rope_parameters", "rope_scaling"):
        value = cfg.get(key)
        if value is None:
            continue
        if not isinstance(value, dict):
            raise DrafterLoadError(f"{key} must be an object, got {value!r}")
        if value:
            return value, key
    return {}, "rope_parameters"


def _dflash_settings_from(read: _ConfigReader) -> Dict[str, Any]:
    # The public DFlash layout has no "use the target's": absent means 1.0 / none.
    public = read.arch != ARCH_ASSISTANT
    out = dict(
        block_size=read.field("block_size", required=True),
        mask_token_id=read.field("mask_token_id", required=True),
        target_layer_ids=read.field("target_layer_ids", required=True),
        output_multiplier=read.field(
            "output_multiplier", default=1.0 if public else None
        ),
        final_logit_softcapping=read.field(
            "final_logit_softcapping", default=0.0 if public else None
        ),
        input_embedding_scale=read.field("input_embedding_scale", default=1.0),
    )
    if read.arch != ARCH_DFLASH2:
        return out
    settings = {name: read.field(name, default=0) for name in _DFLASH2_KEYS}
    unset = [read.path(name) for name, value in settings.items() if value <= 0]
    if read.field("vocab_size") is None:
        unset.append("vocab_size")
    if unset:
        raise DrafterLoadError(
            f"{ARCH_DFLASH2} needs positive {list(_DFLASH2_KEYS)} in dflash_config "
            f"and a vocab_size; missing or non-positive: {unset}"
        )
    out.update(settings)
    return out


def _check_rope(config: DrafterConfig, read: _ConfigReader) -> None:
    """Refuse RoPE settings mlx-lm cannot build, before any weight is read."""
    try:
        initialize_rope(
            config.head_dim,
            base=config.rope_theta,
            traditional=False,
            scaling_config=config.rope_scaling,
            max_position_embeddings=config.max_position_embeddings,
        )
    except (AssertionError, KeyError, TypeError, ValueError, ZeroDivisionError) as err:
        _, key = _rope_block(read.cfg)
        raise DrafterLoadError(
            f"{key} {config.rope_scaling!r} does not describe a RoPE mlx-lm can "
            f"build: {type(err).__name__}: {err}"
        ) from err


def checkpoint_to_model_name(name: str, fmt: str) -> str:
    """Map a checkpoint tensor name to this package's parameter name.

    Args:
        name: Tensor name as stored in the safetensors file.
        fmt: ``"assistant"`` or ``"dflash"``.

    Returns:
        The drafter parameter name.
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
        target_model: The mlx-lm target the drafter will read and borrow from;
            never modified.
        revision: Hub revision, for repo ids.
        embedding: Block embedding mode, see :class:`DrafterConfig`.

    Returns:
        The bound drafter with the checkpoint's weights.

    Raises:
        DrafterLoadError: anything that would make the drafter silently wrong,
            naming the file at fault (and the key or tensor within it).
    """
    if embedding not in (EMBED_RAW, EMBED_TARGET):
        raise DrafterLoadError(
            f"embedding must be '{EMBED_RAW}' or '{EMBED_TARGET}', got {embedding!r}"
        )
    path = _resolve(path_or_repo, revision)
    config_file = path / "config.json"
    cfg = _read_config(config_file)
    with _blame(config_file):
        fmt = checkpoint_format(cfg)
        config = config_from_dict(cfg, embedding=embedding)
        check_target(config, target_model)
    drafter = DFlashDrafter(config)
    headers = _read_headers(path)
    shards = sorted({file for file, _, _ in headers.values()})
    with _blame(", ".join(str(file) for file in shards)):
        check_weights(drafter, {k: shape for k, (_, _, shape) in headers.items()}, fmt)
    weights = _load_tensors(shards, headers)
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


def _read_config(file: Path) -> Dict[str, Any]:
    if not file.is_file():
        raise DrafterLoadError(f"{file.parent} has no config.json")
    try:
        cfg = json.loads(file.read_bytes().decode("utf-8"))
    except OSError as err:
        raise DrafterLoadError(f"{file} cannot be read: {err}") from err
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as err:
        raise DrafterLoadError(f"{file} is not valid JSON: {err}") from err
    if not isinstance(cfg, dict):
        raise DrafterLoadError(
            f"{file} must hold a JSON object, got {type(cfg).__name__}"
        )
    return cfg


# (file, safetensors dtype, shape) of one stored tensor.
_TensorInfo = Tuple[Path, str, Tuple[int, ...]]


def _read_headers(path: Path) -> Dict[str, _TensorInfo]:
    """Check every shard's safetensors header against its file; no data is read."""
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise DrafterLoadError(f"{path} has no *.safetensors files")
    tensors: Dict[str, _TensorInfo] = {}
    for file in files:
        for name, (dtype, shape) in _safetensors_header(file).items():
            if name in tensors:
                raise DrafterLoadError(
                    f"tensor {name!r} appears in both {tensors[name][0]} and {file}"
                )
            tensors[name] = (file, dtype, shape)
    return tensors


def _safetensors_header(file: Path) -> Dict[str, Tuple[str, Tuple[int, ...]]]:
    """Parse and check a drafter ``.safetensors`` file's header against the file.

    The header must be a JSON object whose entries tile the data section exactly
    (no gap, overlap or trailing byte) with sizes that match dtype and shape, and
    every tensor must be F16, BF16 or F32.

    Args:
        file: The ``.safetensors`` file.

    Returns:
        ``{tensor name: (safetensors dtype, shape)}``.

    Raises:
        DrafterLoadError: naming the file, and the tensor when one is at fault.
    """
    with _blame(file):
        raw, data_bytes = _header_bytes(file)
        try:
            header = json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as err:
            raise DrafterLoadError(f"malformed safetensors header: {err}") from err
        if not isinstance(header, dict):
            raise DrafterLoadError(
                f"safetensors header must be a JSON object, got {type(header).__name__}"
            )
        return _header_entries(header, data_bytes)


def _header_bytes(file: Path) -> Tuple[bytes, int]:
    """The header's JSON bytes and the size of the data section after it."""
    try:
        with open(file, "rb") as handle:
            size = file.stat().st_size
            prefix = handle.read(8)
            if len(prefix) < 8:
                what = "empty" if size == 0 else f"{size} bytes"
                raise DrafterLoadError(
                    f"not a safetensors file: {what}, shorter than the 8-byte header "
                    "length it must start with"
                )
            length = int.from_bytes(prefix, "little")
            if length > min(size - 8, _HEADER_LIMIT):
                raise DrafterLoadError(
                    f"truncated or not a safetensors file: the header length says "
                    f"{length} bytes, the file holds {size - 8} after it"
                )
            return handle.read(length), size - 8 - length
    except OSError as err:
        raise DrafterLoadError(f"cannot be read: {err}") from err


def _header_entries(
    header: Mapping[str, Any], data_bytes: int
) -> Dict[str, Tuple[str, Tuple[int, ...]]]:
    entries: Dict[str, Tuple[str, Tuple[int, ...]]] = {}
    spans: List[Tuple[int, int, str]] = []
    for name, entry in header.items():
        if name == "__metadata__":
            # mlx writes a null when saving without metadata.
            if entry is not None and not (
                isinstance(entry, dict)
                and all(isinstance(v, str) for v in entry.values())
            ):
                raise DrafterLoadError(
                    f"__metadata__ must map strings to strings, got {entry!r}"
                )
            continue
        dtype, shape, begin, end = _header_entry(name, entry)
        if end > data_bytes:
            raise DrafterLoadError(
                f"truncated: tensor {name!r} ends at data byte {end}, the file holds "
                f"{data_bytes}"
            )
        entries[name] = (dtype, shape)
        spans.append((begin, end, name))
    reached = 0
    for begin, end, name in sorted(spans):
        if begin != reached:
            what = (
                "overlaps the tensor before it" if begin < reached else "leaves a gap"
            )
            raise DrafterLoadError(
                f"tensor {name!r} at data bytes {begin}..{end} {what}"
            )
        reached = end
    if reached != data_bytes:
        raise DrafterLoadError(
            f"{data_bytes - reached} bytes after the last tensor (corrupt file)"
        )
    return entries


def _header_entry(name: str, entry: Any) -> Tuple[str, Tuple[int, ...], int, int]:
    """Dtype, shape and data span of one header entry, all checked."""
    if not isinstance(entry, dict):
        raise DrafterLoadError(f"tensor {name!r} header entry is not an object")
    dtype, shape, offsets = (entry.get(k) for k in ("dtype", "shape", "data_offsets"))
    if dtype not in _SAFETENSORS_ITEM_BYTES:
        raise DrafterLoadError(f"tensor {name!r} has unknown dtype {dtype!r}")
    if not _int_list(shape, None):
        raise DrafterLoadError(f"tensor {name!r} has a malformed shape {shape!r}")
    if not _int_list(offsets, 2) or offsets[0] > offsets[1]:
        raise DrafterLoadError(
            f"tensor {name!r} has malformed data_offsets {offsets!r}"
        )
    need = math.prod(shape) * _SAFETENSORS_ITEM_BYTES[dtype]
    if offsets[1] - offsets[0] != need:
        raise DrafterLoadError(
            f"tensor {name!r} ({dtype} {tuple(shape)}) needs {need} bytes, its "
            f"data_offsets span {offsets[1] - offsets[0]}"
        )
    if dtype not in _WEIGHT_DTYPES:
        raise DrafterLoadError(
            f"tensor {name!r} has dtype {dtype}; drafter weights must be one of "
            f"{list(_WEIGHT_DTYPES)}"
        )
    return dtype, tuple(shape), offsets[0], offsets[1]


def _int_list(value: Any, length: Optional[int]) -> bool:
    return (
        isinstance(value, list)
        and (length is None or len(value) == length)
        and all(
            isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in value
        )
    )


def _load_tensors(
    shards: Sequence[Path], headers: Mapping[str, _TensorInfo]
) -> Dict[str, mx.array]:
    """Read every shard whose header has been checked; names the shard on failure."""
    weights: Dict[str, mx.array] = {}
    for file in shards:
        try:
            loaded = mx.load(str(file))
            # mx.load reads lazily: read now, while the file can still be named.
            mx.eval(loaded)
        except (OSError, RuntimeError, ValueError) as err:
            raise DrafterLoadError(f"{file}: cannot be loaded: {err}") from err
        expected = {name for name, info in headers.items() if info[0] == file}
        if set(loaded) != expected:
            raise DrafterLoadError(
                f"{file}: changed while being loaded (tensor names differ from its "
                "header)"
            )
        weights.update(loaded)
    return weights


def save_drafter(
    drafter: DFlashDrafter,
    path: Union[str, Path],
    format: str = FORMAT_ASSISTANT,
    *,
    target_model: Optional[nn.Module] = None,
) -> Path:
    """Write ``config.json`` and ``model.safetensors`` in layout ``format``.

    The ``"dflash"`` layout is written so the public DFlash MLX and torch loaders
    run the same drafter: it records every key they read, including
    ``vocab_size``, ``num_target_layers``, ``max_position_embeddings`` and the
    logit multiplier and soft-cap the drafter uses. Where the drafter's config
    leaves those to its target, they come from ``target_model`` (or, for the
    multiplier and soft-cap, from the target the drafter is bound to).

    Args:
        drafter: The drafter to save (bound or not).
        path: Output directory (created if needed).
        format: ``"assistant"`` (MuseGlimmerAssistantModel) or ``"dflash"``
            (DFlashDraftModel / DFlash2DraftModel with a ``dflash_config``).
        target_model: The target the drafter serves; checked against the
            drafter and, for ``"dflash"``, the source of what the drafter takes
            from its target.

    Returns:
        The output directory.

    Raises:
        ValueError: the layout cannot express this drafter (DFlash2 components or
            causal in-block attention in the assistant layout, or a ``"dflash"``
            value left to a target that was not given), or the drafter does not
            fit ``target_model``.
    """
    if format not in FORMATS:
        raise ValueError(f"format must be one of {list(FORMATS)}, got {format!r}")
    _check_expressible(drafter.config, format)
    config = drafter.config
    if target_model is not None:
        check_target(config, target_model)
    if format == FORMAT_DFLASH:
        config = _resolve_target_derived(drafter, target_model)
    text = json.dumps(config_to_dict(config, format), indent=2, sort_keys=True)
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    tensors = {
        model_to_checkpoint_name(name, format): value
        for name, value in tree_flatten(drafter.parameters())
    }
    mx.save_safetensors(
        str(out / "model.safetensors"), tensors, metadata={"format": "mlx"}
    )
    (out / "config.json").write_text(text + "\n")
    return out


def _check_expressible(cfg: DrafterConfig, fmt: str) -> None:
    if fmt == FORMAT_ASSISTANT:
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


def _resolve_target_derived(
    drafter: DFlashDrafter, target_model: Optional[nn.Module]
) -> DrafterConfig:
    """The drafter's config with every value it leaves to its target filled in."""
    cfg = drafter.config
    found: Dict[str, Any] = {}
    if target_model is not None:
        args = getattr(target_model, "args", None)
        found = dict(
            vocab_size=_target_sizes(target_model)[1],
            num_target_layers=len(target_layers(target_model)),
            max_position_embeddings=getattr(args, "max_position_embeddings", None),
            # Exactly what bind() would borrow; a target without one has none.
            output_multiplier=getattr(args, "output_multiplier", None) or 1.0,
            final_logit_softcapping=getattr(args, "final_logit_softcapping", None)
            or 0.0,
        )
    elif drafter.is_bound:
        found = dict(
            output_multiplier=drafter.logit_multiplier or 1.0,
            final_logit_softcapping=drafter.logit_softcap or 0.0,
        )
    values = {
        name: found.get(name) if getattr(cfg, name) is None else getattr(cfg, name)
        for name in _TARGET_DERIVED
    }
    unknown = [name for name, value in values.items() if value is None]
    if unknown:
        raise ValueError(
            f"format='dflash' records {unknown}, which this drafter leaves to its "
            "target: pass target_model= (the target it serves)"
        )
    return dataclasses.replace(cfg, **values)


def config_to_dict(config: DrafterConfig, fmt: str) -> Dict[str, Any]:
    """The ``config.json`` contents of ``config`` in layout ``fmt``.

    Args:
        config: The drafter config; for ``"dflash"`` every value the public
            layout records must be set (see :func:`save_drafter`).
        fmt: ``"assistant"`` or ``"dflash"``.

    Returns:
        A JSON-serialisable dict that :func:`config_from_dict` reads back.

    Raises:
        ValueError: ``"dflash"`` asked for a config that leaves a recorded value
            to its target.
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
    if fmt == FORMAT_ASSISTANT:
        out.update(
            architectures=[ARCH_ASSISTANT],
            model_type="muse_glimmer_assistant",
            **_dflash_settings(config, fmt),
        )
        return out
    unknown = [name for name in _TARGET_DERIVED if getattr(config, name) is None]
    if unknown:
        raise ValueError(
            f"the dflash layout records {unknown}; this config leaves them to its "
            "target (save_drafter(..., target_model=) fills them in)"
        )
    extras = config.has_dynamic_conv or config.has_candidate_selector
    out.update(
        architectures=[ARCH_DFLASH2 if extras else ARCH_DFLASH],
        model_type="qwen3",
        dflash_config=_dflash_settings(config, fmt),
        is_causal=config.is_causal,
        num_target_layers=config.num_target_layers,
    )
    return out


def _dflash_settings(config: DrafterConfig, fmt: str) -> Dict[str, Any]:
    out: Dict[str, Any] = dict(
        block_size=config.block_size,
        mask_token_id=config.mask_token_id,
        target_layer_ids=list(config.target_layer_ids),
    )
    if fmt == FORMAT_DFLASH:
        # Both public loaders apply a soft-cap only when it is > 0; null is none.
        out.update(
            output_multiplier=config.output_multiplier,
            final_logit_softcapping=config.final_logit_softcapping or None,
            input_embedding_scale=config.input_embedding_scale,
        )
    else:
        for name in ("output_multiplier", "final_logit_softcapping"):
            if getattr(config, name) is not None:
                out[name] = getattr(config, name)
        if config.input_embedding_scale != 1.0:
            out["input_embedding_scale"] = config.input_embedding_scale
    if config.has_dynamic_conv or config.has_candidate_selector:
        out.update({name: getattr(config, name) for name in _DFLASH2_KEYS})
    return out
