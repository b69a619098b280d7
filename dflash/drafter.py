"""The DFlash block drafter: a few transformer layers that read the target's hidden states.

The drafter never owns an embedding table or an LM head. It borrows both from the
target (see :meth:`DFlashDrafter.bind`), together with the target's logit
multiplier and soft-cap whenever its own config leaves those unset.

Context stream. The outputs of the target's decoder layers ``target_layer_ids``
(output of decoder layer ``i``, 0-based, i.e. Hugging Face ``hidden_states[i + 1]``)
are concatenated along features, projected by ``fc`` and RMS-normed by
``hidden_norm``. That stream goes straight into every draft layer's ``k_proj`` /
``v_proj``: it is *not* passed through the layer's ``input_layernorm`` and it is not
re-normed per layer. Each layer keeps the projected, ``k_norm``-ed and RoPE-rotated
context keys/values in an append-only :class:`DrafterContext`, so a round only
projects the rows committed since the last round.

Block. ``[last committed token, mask, mask, ...]`` at absolute positions
``context.offset .. context.offset + B - 1``. Queries come from the block only;
keys/values are ``[context rows ‖ block rows]`` through the same projections. In-block
attention is bidirectional unless the checkpoint says otherwise.

DFlash2 checkpoints add a grouped dynamic causal convolution around each layer's
attention and MLP, and a low-rank candidate selector that re-ranks the top-k tokens
of each block position given the token chosen before it (see
:meth:`DFlashDrafter.propose`).
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.rope_utils import initialize_rope

from .cache.plane import bucket_end, bucketable, resolve_bucket_keys
from .metal.layout import leading_view

SLIDING_ATTENTION = "sliding_attention"
FULL_ATTENTION = "full_attention"
LAYER_TYPES = (SLIDING_ATTENTION, FULL_ATTENTION)

ARCH_ASSISTANT = "MuseGlimmerAssistantModel"
ARCH_DFLASH = "DFlashDraftModel"
ARCH_DFLASH2 = "DFlash2DraftModel"
ARCHITECTURES = (ARCH_ASSISTANT, ARCH_DFLASH, ARCH_DFLASH2)

EMBED_RAW = "raw"
EMBED_TARGET = "target"

# Context buffers grow in chunks of this many rows, so a round's append is a slice
# write and not a copy of everything committed so far.
_ROW_STEP = 256

# Targets whose own forward feeds the raw embedding-table rows to layer 0.
_PLAIN_EMBEDDING_MODEL_TYPES = frozenset(
    {"llama", "mistral", "qwen2", "qwen3", "qwen3_moe", "qwen2_moe"}
)


@dataclass(frozen=True)
class _Rule:
    """What one :class:`DrafterConfig` field accepts.

    ``kind`` is ``"int"``, ``"float"``, ``"bool"``, ``"str"``, ``"dict"``,
    ``"ints"`` (a list of ints) or ``"strs"`` (a list of strings); ``low`` bounds
    numbers (and list items) from below, strictly when ``strict``.
    """

    kind: str
    optional: bool = False
    low: Optional[float] = None
    strict: bool = False


_FIELD_RULES: Dict[str, _Rule] = {
    "hidden_size": _Rule("int", low=1),
    "num_hidden_layers": _Rule("int", low=1),
    "num_attention_heads": _Rule("int", low=1),
    "num_key_value_heads": _Rule("int", low=1),
    "head_dim": _Rule("int", low=1),
    "intermediate_size": _Rule("int", low=1),
    "rms_norm_eps": _Rule("float", low=0, strict=True),
    "rope_theta": _Rule("float", low=0, strict=True),
    "layer_types": _Rule("strs"),
    "sliding_window": _Rule("int", optional=True, low=1),
    "block_size": _Rule("int", low=1),
    "mask_token_id": _Rule("int", low=0),
    "target_layer_ids": _Rule("ints", low=0),
    "output_multiplier": _Rule("float", optional=True, low=0, strict=True),
    "final_logit_softcapping": _Rule("float", optional=True, low=0),
    "rope_scaling": _Rule("dict", optional=True),
    "max_position_embeddings": _Rule("int", optional=True, low=1),
    "is_causal": _Rule("bool", optional=True),
    "input_embedding_scale": _Rule("float", low=0, strict=True),
    "embedding": _Rule("str"),
    "vocab_size": _Rule("int", optional=True, low=1),
    "num_target_layers": _Rule("int", optional=True, low=1),
    "conv_kernel_size": _Rule("int", low=0),
    "conv_group_size": _Rule("int", low=0),
    "selector_rank": _Rule("int", low=0),
    "selector_top_k": _Rule("int", low=0),
    "architecture": _Rule("str"),
}

_KIND_NAMES = {
    "int": "an integer",
    "float": "a finite number",
    "bool": "true or false",
    "str": "a string",
    "dict": "a mapping",
    "ints": "a list of integers",
    "strs": "a list of strings",
}


def config_field_problem(name: str, value: Any) -> Optional[str]:
    """Why ``value`` cannot be the :class:`DrafterConfig` field ``name``, if it can't.

    Integers are ``int`` values, never ``bool`` nor a float such as ``1.5``; numbers
    accept integers but not ``bool``, NaN or infinity; lists are sequences (never a
    string) whose every item has the item type.

    Args:
        name: A :class:`DrafterConfig` field name.
        value: The candidate value (for instance read from ``config.json``).

    Returns:
        ``None`` when the value is acceptable, else the reason, phrased to follow
        the field name (``"must be an integer >= 1, got 1.5 (float)"``).

    Raises:
        KeyError: ``name`` is not a DrafterConfig field.
    """
    rule = _FIELD_RULES[name]
    if value is None and rule.optional:
        return None
    if _fits(rule, value):
        return None
    wanted = _KIND_NAMES[rule.kind]
    if rule.low is not None:
        wanted += f" {'>' if rule.strict else '>='} {rule.low:g}"
        if rule.kind == "ints":
            wanted = f"a list of integers each >= {rule.low:g}"
    if rule.optional:
        wanted = "null, true or false" if rule.kind == "bool" else f"null or {wanted}"
    return f"must be {wanted}, got {value!r} ({type(value).__name__})"


def _fits(rule: _Rule, value: Any) -> bool:
    if rule.kind in ("ints", "strs"):
        item = _Rule("int" if rule.kind == "ints" else "str", low=rule.low)
        listed = isinstance(value, Sequence) and not isinstance(value, (str, bytes))
        return listed and all(_fits(item, v) for v in value)
    if rule.kind == "int":
        ok = isinstance(value, numbers.Integral) and not isinstance(value, bool)
    elif rule.kind == "float":
        ok = isinstance(value, numbers.Real) and not isinstance(value, bool)
        ok = ok and math.isfinite(value)
    else:
        ok = isinstance(value, {"bool": bool, "str": str, "dict": dict}[rule.kind])
    if not ok or rule.low is None:
        return ok
    return value > rule.low if rule.strict else value >= rule.low


def _canonical(rule: _Rule, value: Any) -> Any:
    """The plain Python form of an accepted value (numpy ints become ``int``)."""
    if value is None:
        return None
    if rule.kind == "int":
        return int(value)
    if rule.kind == "float":
        return float(value)
    if rule.kind == "ints":
        return tuple(int(v) for v in value)
    if rule.kind == "strs":
        return tuple(value)
    return value


@dataclass
class DrafterConfig:
    """Geometry and DFlash settings of a block drafter.

    ``output_multiplier`` / ``final_logit_softcapping`` left at ``None`` mean "use
    the target's"; a soft-cap of ``0.0`` means none. ``is_causal`` follows the
    public DFlash convention: ``False`` makes in-block attention bidirectional in
    every layer, ``True`` causal in every layer, ``None`` causal on sliding layers
    only. ``embedding`` picks how the block is embedded: ``"raw"`` takes the
    target's embedding-table rows (what the Hugging Face Muse Glimmer assistant
    consumes: its reference forward embeds the block with ``F.embedding(ids,
    embed_tokens.weight)``, no embedding norm); ``"target"`` reproduces what the
    target's first layer sees (for Muse Glimmer, the scaleless RMSNorm of those
    rows).

    Every field is type- and range-checked on construction (see
    :func:`config_field_problem`): a value of the wrong type is refused rather
    than truncated, so ``block_size=1.5`` or ``is_causal="yes"`` raise. Accepted
    values are stored in plain Python form (integers as ``int``, numbers as
    ``float``, lists as tuples).
    """

    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    rope_theta: float
    layer_types: Tuple[str, ...]
    sliding_window: Optional[int]
    block_size: int
    mask_token_id: int
    target_layer_ids: Tuple[int, ...]
    output_multiplier: Optional[float] = None
    final_logit_softcapping: Optional[float] = None
    rope_scaling: Optional[dict] = None
    max_position_embeddings: Optional[int] = None
    is_causal: Optional[bool] = False
    input_embedding_scale: float = 1.0
    embedding: str = EMBED_RAW
    vocab_size: Optional[int] = None
    num_target_layers: Optional[int] = None
    conv_kernel_size: int = 0
    conv_group_size: int = 0
    selector_rank: int = 0
    selector_top_k: int = 0
    architecture: str = ARCH_ASSISTANT

    def __post_init__(self) -> None:
        problems = self._type_problems()
        if not problems:
            for name, rule in _FIELD_RULES.items():
                setattr(self, name, _canonical(rule, getattr(self, name)))
            problems = self._problems()
        if problems:
            raise ValueError("; ".join(problems))

    def _type_problems(self) -> List[str]:
        problems = []
        for name in _FIELD_RULES:
            problem = config_field_problem(name, getattr(self, name))
            if problem:
                problems.append(f"{name} {problem}")
        return problems

    def _problems(self) -> List[str]:
        problems = []
        if self.num_attention_heads % self.num_key_value_heads:
            problems.append(
                f"num_attention_heads ({self.num_attention_heads}) is not a multiple "
                f"of num_key_value_heads ({self.num_key_value_heads})"
            )
        if len(self.layer_types) != self.num_hidden_layers:
            problems.append(
                f"layer_types has {len(self.layer_types)} entries, expected "
                f"num_hidden_layers={self.num_hidden_layers}"
            )
        unknown = sorted(set(self.layer_types) - set(LAYER_TYPES))
        if unknown:
            problems.append(f"unsupported layer_types {unknown}")
        if SLIDING_ATTENTION in self.layer_types and (self.sliding_window or 0) < 2:
            problems.append(
                f"sliding_attention layers need sliding_window >= 2, got "
                f"{self.sliding_window}"
            )
        if self.embedding not in (EMBED_RAW, EMBED_TARGET):
            problems.append(
                f"embedding must be '{EMBED_RAW}' or '{EMBED_TARGET}', got "
                f"{self.embedding!r}"
            )
        if self.architecture not in ARCHITECTURES:
            problems.append(f"unknown architecture {self.architecture!r}")
        problems.extend(self._token_and_layer_problems())
        problems.extend(self._dflash2_problems())
        return problems

    def _token_and_layer_problems(self) -> List[str]:
        problems = []
        if not self.target_layer_ids:
            problems.append("target_layer_ids is empty")
        layers = self.num_target_layers
        if layers is not None and any(i >= layers for i in self.target_layer_ids):
            problems.append(
                f"target_layer_ids {list(self.target_layer_ids)} reach past "
                f"num_target_layers={layers}"
            )
        if self.vocab_size is not None and self.mask_token_id >= self.vocab_size:
            problems.append(
                f"mask_token_id {self.mask_token_id} is outside vocab_size "
                f"{self.vocab_size}"
            )
        return problems

    def _dflash2_problems(self) -> List[str]:
        problems = []
        if self.conv_kernel_size > 0 and (
            self.conv_group_size <= 0 or self.hidden_size % self.conv_group_size
        ):
            problems.append(
                f"conv_group_size ({self.conv_group_size}) must divide hidden_size "
                f"({self.hidden_size})"
            )
        if self.selector_rank > 0 and (
            self.selector_top_k <= 0 or not self.vocab_size or self.vocab_size <= 0
        ):
            problems.append(
                "a candidate selector needs selector_top_k > 0 and vocab_size, got "
                f"selector_top_k={self.selector_top_k}, vocab_size={self.vocab_size}"
            )
        return problems

    @property
    def has_dynamic_conv(self) -> bool:
        """Whether each layer wraps attention and MLP in a dynamic causal conv."""
        return self.conv_kernel_size > 0

    @property
    def has_candidate_selector(self) -> bool:
        """Whether draft tokens are picked by the low-rank candidate selector."""
        return self.selector_rank > 0

    def is_sliding(self, layer: int) -> bool:
        """Whether draft layer ``layer`` is a sliding-window layer."""
        return self.layer_types[layer] == SLIDING_ATTENTION

    def block_causal(self, layer: int) -> bool:
        """Whether block rows of draft layer ``layer`` attend causally to each other."""
        if self.is_causal is None:
            return self.is_sliding(layer)
        return bool(self.is_causal)

    def context_row_limit(self, layer: int) -> Optional[int]:
        """Most context rows layer ``layer`` ever needs (``None``: all of them).

        The first block query sits one position after the newest context row, so a
        window of ``W`` positions reaches back over ``W - 1`` context rows.
        """
        if self.is_sliding(layer):
            return int(self.sliding_window) - 1
        return None


@dataclass
class DraftProposal:
    """Draft tokens of one block and, when sampled, the distribution they came from.

    Shapes: ``tokens`` (b, B-1) int32; ``probs`` (b, B-1, V) float32 or ``None``.
    """

    tokens: mx.array
    probs: Optional[mx.array]


class _TargetBinding:
    """Plain holder for what the drafter borrows, kept out of ``parameters()``."""

    def __init__(
        self,
        embed: Callable[[mx.array], mx.array],
        head: Callable[[mx.array], mx.array],
        multiplier: Optional[float],
        softcap: Optional[float],
    ) -> None:
        self.embed = embed
        self.head = head
        self.multiplier = multiplier
        self.softcap = softcap


class _ContextPlane:
    """Append-only K/V rows of one draft layer, with scratch room for one block.

    Live rows are ``keys[..., begin:end, :]``; rows past ``end`` are scratch where a
    block's own K/V is written so attention reads one contiguous run. A plane with a
    row limit drops its oldest rows once it holds more than the limit. With
    ``bucket_keys`` a block reads on past its own rows to the end of a bucket (see
    :func:`dflash.cache.plane.resolve_bucket_keys`); :func:`_block_mask` hides them.
    """

    def __init__(
        self, row_limit: Optional[int], reserve: int, bucket_keys: bool = False
    ) -> None:
        self.row_limit = row_limit
        self.reserve = reserve
        self.bucket_keys = bucket_keys
        self.keys: Optional[mx.array] = None
        self.values: Optional[mx.array] = None
        self.begin = 0
        self.end = 0

    @property
    def rows(self) -> int:
        return self.end - self.begin

    @property
    def capacity(self) -> int:
        return 0 if self.keys is None else self.keys.shape[2]

    def append(self, keys: mx.array, values: mx.array) -> None:
        count = keys.shape[2]
        if self.row_limit is not None and count >= self.row_limit:
            # The chunk alone fills the window: nothing older survives.
            keys = keys[..., count - self.row_limit :, :]
            values = values[..., count - self.row_limit :, :]
            count = self.row_limit
            self._reallocate(keys, extra=count, keep=0)
        elif self.keys is None or self.end + count + self.reserve > self.capacity:
            self._reallocate(keys, extra=count, keep=self._rows_kept_for(count))
        self.keys[..., self.end : self.end + count, :] = keys
        self.values[..., self.end : self.end + count, :] = values
        self.end += count
        if self.row_limit is not None and self.rows > self.row_limit:
            self.begin = self.end - self.row_limit

    def with_block(
        self, block_keys: mx.array, block_values: mx.array
    ) -> Tuple[mx.array, mx.array]:
        """Return ``[live rows ‖ block rows ‖ padding]`` without committing the block.

        The padding (scratch rows, hidden by :func:`_block_mask`) is there only with
        bucketed keys; see :meth:`key_rows`.
        """
        count = block_keys.shape[2]
        if self.keys is None:
            return block_keys, block_values
        if self.end + count > self.capacity:
            self.reserve = max(self.reserve, count)
            self._reallocate(self.keys, extra=0, keep=self.rows)
        stop = self.end + count
        self.keys[..., self.end : stop, :] = block_keys
        self.values[..., self.end : stop, :] = block_values
        last = self.begin + self.key_rows(count)
        return (
            self.keys[..., self.begin : last, :],
            self.values[..., self.begin : last, :],
        )

    def key_rows(self, count: int) -> int:
        """Key rows a block of ``count`` rows reads: live + block, bucketed if enabled.

        A full layer's length grows every round, so it is rounded up to a whole bucket; a
        sliding layer's is capped at ``row_limit + count``, the constant length it keeps
        once its window is full. Never past the buffer (room is made before this).
        """
        live = self.rows + count
        if not self.bucket_keys or not bucketable(count):
            return live
        rows = bucket_end(live)
        if self.row_limit is not None:
            rows = min(rows, self.row_limit + count)
        return max(live, min(rows, self.capacity - self.begin))

    def _rows_kept_for(self, incoming: int) -> int:
        if self.row_limit is None:
            return self.rows
        return max(0, min(self.rows, self.row_limit - incoming))

    def _reallocate(self, like: mx.array, extra: int, keep: int) -> None:
        """Move the newest ``keep`` live rows to the front of a buffer with room."""
        batch, heads, _, dim = like.shape
        needed = keep + extra + self.reserve
        if self.row_limit is None:
            capacity = max(needed + _ROW_STEP, 2 * (keep + extra))
        else:
            # Slack of a whole window: a sliding plane compacts once per W-1 rows.
            capacity = needed + max(_ROW_STEP, self.row_limit)
        capacity = -(-capacity // _ROW_STEP) * _ROW_STEP
        dtype = like.dtype if self.keys is None else self.keys.dtype
        new_keys = mx.zeros((batch, heads, capacity, dim), dtype=dtype)
        new_values = mx.zeros((batch, heads, capacity, dim), dtype=dtype)
        if keep:
            new_keys[..., :keep, :] = self.keys[..., self.end - keep : self.end, :]
            new_values[..., :keep, :] = self.values[..., self.end - keep : self.end, :]
        self.keys, self.values = new_keys, new_values
        self.begin, self.end = 0, keep

    @property
    def nbytes(self) -> int:
        if self.keys is None:
            return 0
        return self.keys.nbytes + self.values.nbytes

    def live_rows(self) -> Optional[Tuple[mx.array, mx.array]]:
        """The live context rows, oldest first (views), or ``None`` while empty.

        Shapes:
            Returns keys and values ``(b, n_kv, rows, head_dim)``.
        """
        if self.keys is None or self.rows == 0:
            return None
        return (
            self.keys[..., self.begin : self.end, :],
            self.values[..., self.begin : self.end, :],
        )


class DrafterContext:
    """Per-draft-layer context K/V of the committed tokens, append-only.

    ``offset`` is the absolute position right after the last committed context row:
    the block's first position. Sliding layers keep at most ``sliding_window - 1``
    rows; full layers keep every row.
    """

    def __init__(self, planes: Sequence[_ContextPlane]) -> None:
        self.planes: List[_ContextPlane] = list(planes)
        self.offset = 0
        self.batch: Optional[int] = None

    def rows(self, layer: int) -> int:
        """Number of live context rows held for draft layer ``layer``."""
        return self.planes[layer].rows

    @property
    def nbytes(self) -> int:
        """Bytes held by all context buffers (live rows, slack and scratch)."""
        return sum(plane.nbytes for plane in self.planes)

    def buffers(self) -> List[mx.array]:
        """Every key and value buffer the planes hold (what an append writes): started
        on the device as soon as an append is built (``mx.async_eval``), it runs while
        the host builds the next draft."""
        return [
            buffer
            for plane in self.planes
            for buffer in (plane.keys, plane.values)
            if buffer is not None
        ]

    def live_rows(self) -> List[Optional[Tuple[mx.array, mx.array]]]:
        """Per draft layer, the live context rows oldest first (``None`` while empty).

        This is what a snapshot saves: the newest ``min(offset, row_limit)`` rows of a
        sliding layer, every row of a full layer.

        Shapes:
            Each pair is keys and values ``(b, n_kv, rows, head_dim)``.
        """
        return [plane.live_rows() for plane in self.planes]

    def install_rows(
        self, offset: int, rows: Sequence[Optional[Tuple[mx.array, mx.array]]]
    ) -> None:
        """Fill this new, empty context with saved rows (the inverse of :meth:`live_rows`).

        The caller (``dflash.cache.load_prompt_cache``) has checked the row counts against
        ``offset`` and the planes' row limits; each layer's rows are appended once.

        Args:
            offset: The absolute position right after the newest context row.
            rows: Per draft layer, keys and values oldest first, or ``None`` for no rows.

        Shapes:
            Each pair is keys and values ``(b, n_kv, rows, head_dim)``.
        """
        if self.offset != 0 or any(plane.rows for plane in self.planes):
            raise ValueError("saved rows install only into a new drafter context")
        if len(rows) != len(self.planes):
            raise ValueError(
                f"{len(rows)} layers of rows for a context of {len(self.planes)} layers"
            )
        batch = None
        for plane, pair in zip(self.planes, rows):
            if pair is not None:
                plane.append(*pair)
                batch = pair[0].shape[0]
        self.offset = offset
        self.batch = batch


def _block_mask(
    context_rows: int,
    block: int,
    window: Optional[int],
    causal: bool,
    key_rows: Optional[int] = None,
) -> Optional[mx.array]:
    """Boolean (block, key_rows) mask, or ``None`` when all is visible.

    Context rows sit at positions ``-context_rows .. -1`` and block rows at
    ``0 .. block - 1`` relative to the block start; rows past the block (bucketed
    keys' padding, up to ``key_rows``, default ``context_rows + block``) are never
    visible. A query sees a key within the window (``|q - k| < window``), and, if
    ``causal``, no block key after it.
    """
    key_rows = context_rows + block if key_rows is None else key_rows
    padded = key_rows > context_rows + block
    widest = context_rows + block - 1
    if not padded and not causal and (window is None or widest < window):
        return None
    query = mx.arange(block)[:, None]
    key = mx.arange(-context_rows, key_rows - context_rows)[None, :]
    visible = key < block
    if window is not None:
        visible = visible & (mx.abs(query - key) < window)
    if causal:
        visible = visible & (key <= query)
    return visible


class DraftMLP(nn.Module):
    """SiLU-gated MLP: ``down(silu(gate(x)) * up(x))``."""

    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def __call__(self, x: mx.array) -> mx.array:
        return self.down_proj(nn.silu(self.gate_proj(x)) * self.up_proj(x))


class DraftAttention(nn.Module):
    """Block queries over ``[context ‖ block]`` keys/values with q/k RMS-norm and RoPE."""

    def __init__(self, config: DrafterConfig, layer: int) -> None:
        super().__init__()
        hidden = config.hidden_size
        self.n_heads = config.num_attention_heads
        self.n_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.scale = config.head_dim**-0.5
        self.window = config.sliding_window if config.is_sliding(layer) else None
        self.causal = config.block_causal(layer)
        self.q_proj = nn.Linear(hidden, self.n_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(hidden, self.n_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(hidden, self.n_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, hidden, bias=False)
        self.q_norm = nn.RMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.k_norm = nn.RMSNorm(self.head_dim, eps=config.rms_norm_eps)

    def project_kv(
        self, x: mx.array, rope: nn.Module, start: int
    ) -> Tuple[mx.array, mx.array]:
        """Keys and values of rows ``x`` sitting at absolute positions from ``start``.

        Args:
            x: Rows to project (context stream or normed block).
            rope: The drafter's rotary embedding.
            start: Absolute position of the first row.

        Returns:
            ``(keys, values)``, keys normed and rotated.

        Shapes: x (b, n, H) -> keys, values (b, n_kv, n, head_dim).
        """
        keys = self.split_heads(self.k_proj, x, self.n_kv_heads)
        values = self.split_heads(self.v_proj, x, self.n_kv_heads)
        _, keys = self.rotate(None, keys, rope, start)
        return keys, values.transpose(0, 2, 1, 3)

    def block_heads(
        self, x: mx.array, rope: nn.Module, start: int
    ) -> Tuple[mx.array, mx.array, mx.array]:
        """A block's queries, keys and values, queries and keys normed and rotated.

        Shapes: x (b, B, H) -> queries (b, n_heads, B, head_dim), keys and values
        (b, n_kv, B, head_dim).
        """
        queries = self.split_heads(self.q_proj, x, self.n_heads)
        keys = self.split_heads(self.k_proj, x, self.n_kv_heads)
        values = self.split_heads(self.v_proj, x, self.n_kv_heads)
        queries, keys = self.rotate(queries, keys, rope, start)
        return queries, keys, values.transpose(0, 2, 1, 3)

    def rotate(
        self,
        queries: Optional[mx.array],
        keys: mx.array,
        rope: nn.Module,
        start: int,
    ) -> Tuple[Optional[mx.array], mx.array]:
        """RMS-norm each head (``q_norm`` / ``k_norm``), then RoPE from ``start``.

        Shapes: queries (b, n, n_heads, head_dim) or None, keys (b, n, n_kv,
        head_dim) -> (b, n_heads, n, head_dim) or None, (b, n_kv, n, head_dim).
        """
        keys = rope(self.k_norm(keys).transpose(0, 2, 1, 3), offset=start)
        if queries is None:
            return None, keys
        return rope(self.q_norm(queries).transpose(0, 2, 1, 3), offset=start), keys

    def split_heads(self, projection: nn.Module, x: mx.array, count: int) -> mx.array:
        """``projection(x)`` split into ``count`` heads: (b, n, H) -> (b, n, count, D)."""
        return projection(x).reshape(x.shape[0], x.shape[1], count, self.head_dim)

    def __call__(
        self, x: mx.array, plane: _ContextPlane, rope: nn.Module, start: int
    ) -> mx.array:
        batch, block, _ = x.shape
        queries, block_keys, block_values = self.block_heads(x, rope, start)
        keys, values = plane.with_block(block_keys, block_values)
        mask = _block_mask(plane.rows, block, self.window, self.causal, keys.shape[2])
        out = mx.fast.scaled_dot_product_attention(
            queries, keys, values, scale=self.scale, mask=mask
        )
        return self.o_proj(out.transpose(0, 2, 1, 3).reshape(batch, block, -1))


class GroupedDynamicCausalConv(nn.Module):
    """DFlash2's grouped dynamic causal convolution along the block.

    ``out[t] = sum_o (base[o] + dyn[t, o, g]) * x[t - o]`` (zero before the block
    start), where ``base`` is a learned per-channel kernel and ``dyn`` a per-group
    weight projected from the token at ``t``. ``prepare`` convolves a sub-layer's
    input with kernel half 0 and returns the dynamic weights of half 1, which
    ``finish`` applies to the sub-layer's output.
    """

    def __init__(self, hidden_size: int, kernel_size: int, group_size: int) -> None:
        super().__init__()
        self.kernel_size = kernel_size
        self.group_size = group_size
        self.groups = hidden_size // group_size
        self.base_kernel = mx.zeros((2, kernel_size, hidden_size))
        self.kernel_projection = nn.Linear(
            hidden_size, 2 * kernel_size * self.groups, bias=False
        )

    def prepare(self, x: mx.array) -> Tuple[mx.array, mx.array]:
        """Convolve ``x`` with kernel half 0; return it and half 1's dynamic weights.

        Args:
            x: Normed sub-layer input.

        Returns:
            ``(convolved x, dynamic weights for finish)``.

        Shapes: x (b, B, H) -> (b, B, H), (b, B, kernel_size, groups).
        """
        batch, length, _ = x.shape
        dynamic = self.kernel_projection(x).reshape(
            batch, length, 2, self.kernel_size, self.groups
        )
        mixed = self._convolve(x, dynamic[:, :, 0], leading_view(self.base_kernel, 0))
        return mixed, dynamic[:, :, 1]

    def finish(self, y: mx.array, dynamic: mx.array) -> mx.array:
        """Convolve a sub-layer output with kernel half 1.

        Args:
            y: Sub-layer output.
            dynamic: Second value returned by :meth:`prepare`.

        Returns:
            The convolved output.

        Shapes: y (b, B, H), dynamic (b, B, kernel_size, groups) -> (b, B, H).
        """
        return self._convolve(y, dynamic, leading_view(self.base_kernel, 1))

    def _convolve(self, x: mx.array, dynamic: mx.array, base: mx.array) -> mx.array:
        batch, length, hidden = x.shape
        grouped = x.reshape(batch, length, self.groups, self.group_size)
        out = mx.zeros_like(grouped)
        for lag in range(self.kernel_size):
            shifted = _shift_right(grouped, lag)
            kernel = base[lag].reshape(1, 1, self.groups, self.group_size)
            out = out + kernel.astype(x.dtype) * shifted
            out = out + dynamic[:, :, lag, :, None] * shifted
        return out.reshape(batch, length, hidden)


def _shift_right(x: mx.array, lag: int) -> mx.array:
    """Shift along axis 1 by ``lag`` rows, filling the start with zeros."""
    if lag == 0:
        return x
    length = x.shape[1]
    if lag >= length:
        return mx.zeros_like(x)
    pad = [(0, 0)] * x.ndim
    pad[1] = (lag, 0)
    return mx.pad(x[:, : length - lag], pad)


class CandidateSelector(nn.Module):
    """DFlash2's low-rank re-ranking of each block position's top-k candidates.

    Candidate ``c`` at position ``t`` scores ``logit[t, c] + sum_r P[prev, r] *
    h[t, r] * S[c, r]``, where ``prev`` is the token chosen at ``t - 1`` (the anchor
    for the first draft position), ``h`` the projected drafter hidden state and
    ``P`` / ``S`` the predecessor / successor codebooks.
    """

    def __init__(self, hidden_size: int, vocab_size: int, rank: int, top_k: int):
        super().__init__()
        self.top_k = top_k
        self.predecessor_codebook = nn.Embedding(vocab_size, rank)
        self.successor_codebook = nn.Embedding(vocab_size, rank)
        self.hidden_projection = nn.Linear(hidden_size, rank, bias=False)

    def __call__(
        self,
        hidden: mx.array,
        logits: mx.array,
        anchor: mx.array,
        temperature: float = 0.0,
        key: Optional[mx.array] = None,
    ) -> Tuple[mx.array, mx.array, Optional[mx.array]]:
        """Walk the draft positions left to right, choosing one candidate each.

        Args:
            hidden: Final-normed drafter hidden states of the draft positions.
            logits: Drafter logits of the same positions.
            anchor: The token before the first draft position.
            temperature: 0 for argmax, otherwise softmax temperature over candidates.
            key: Optional PRNG key for sampling.

        Returns:
            ``(tokens, candidates, probs)``; ``probs`` is the per-position
            distribution over ``candidates`` (``None`` when greedy).

        Shapes: hidden (b, T, H), logits (b, T, V), anchor (b,) -> tokens (b, T),
            candidates (b, T, k), probs (b, T, k).
        """
        top_k = min(self.top_k, logits.shape[-1])
        candidates = _top_k_indices(logits, top_k)
        unary = mx.take_along_axis(logits, candidates, axis=-1).astype(mx.float32)
        projected = self.hidden_projection(hidden)
        keys = _split_keys(key, hidden.shape[1])
        previous, path, rows = anchor, [], []
        for t in range(hidden.shape[1]):
            edge = (
                self.predecessor_codebook(previous)[:, None]
                * projected[:, t, None]
                * self.successor_codebook(candidates[:, t])
            ).sum(axis=-1)
            scores = unary[:, t] + edge.astype(mx.float32)
            if temperature > 0:
                rows.append(mx.softmax(scores / temperature, axis=-1))
                pick = mx.random.categorical(scores / temperature, key=keys[t])
            else:
                pick = mx.argmax(scores, axis=-1)
            previous = mx.take_along_axis(candidates[:, t], pick[:, None], axis=-1)
            previous = previous[:, 0]
            path.append(previous)
        probs = mx.stack(rows, axis=1) if rows else None
        return mx.stack(path, axis=1).astype(mx.int32), candidates, probs


def _top_k_indices(logits: mx.array, k: int) -> mx.array:
    """Indices of the ``k`` largest logits, best first."""
    part = mx.argpartition(-logits, k - 1, axis=-1)[..., :k]
    order = mx.argsort(-mx.take_along_axis(logits, part, axis=-1), axis=-1)
    return mx.take_along_axis(part, order, axis=-1)


def _split_keys(key: Optional[mx.array], count: int) -> List[Optional[mx.array]]:
    if key is None:
        return [None] * count
    return list(mx.random.split(key, max(count, 2)))[:count]


class DraftDecoderLayer(nn.Module):
    """Pre-norm draft layer; DFlash2 wraps attention and MLP in dynamic convs."""

    def __init__(self, config: DrafterConfig, layer: int) -> None:
        super().__init__()
        self.self_attn = DraftAttention(config, layer)
        self.mlp = DraftMLP(config.hidden_size, config.intermediate_size)
        self.input_layernorm = nn.RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = nn.RMSNorm(
            config.hidden_size, eps=config.rms_norm_eps
        )
        self.has_conv = config.has_dynamic_conv
        if self.has_conv:
            args = (config.hidden_size, config.conv_kernel_size, config.conv_group_size)
            self.attention_conv = GroupedDynamicCausalConv(*args)
            self.mlp_conv = GroupedDynamicCausalConv(*args)

    def __call__(
        self, h: mx.array, plane: _ContextPlane, rope: nn.Module, start: int
    ) -> mx.array:
        x = self.input_layernorm(h)
        if self.has_conv:
            x, dynamic = self.attention_conv.prepare(x)
        x = self.self_attn(x, plane, rope, start)
        if self.has_conv:
            x = self.attention_conv.finish(x, dynamic)
        h = h + x
        x = self.post_attention_layernorm(h)
        if self.has_conv:
            x, dynamic = self.mlp_conv.prepare(x)
        x = self.mlp(x)
        if self.has_conv:
            x = self.mlp_conv.finish(x, dynamic)
        return h + x


class DFlashDrafter(nn.Module):
    """DFlash block drafter over a bound target model.

    Parameters are exactly the checkpoint's (``fc``, ``hidden_norm``, ``layers``,
    ``norm``, and for DFlash2 the convs and ``candidate_selector``); the borrowed
    embedding and LM head never appear in ``parameters()``.
    """

    def __init__(self, config: DrafterConfig) -> None:
        super().__init__()
        self.config = config
        hidden = config.hidden_size
        taps = len(config.target_layer_ids)
        self.fc = nn.Linear(taps * hidden, hidden, bias=False)
        self.hidden_norm = nn.RMSNorm(hidden, eps=config.rms_norm_eps)
        self.layers = [
            DraftDecoderLayer(config, i) for i in range(config.num_hidden_layers)
        ]
        self.norm = nn.RMSNorm(hidden, eps=config.rms_norm_eps)
        if config.has_candidate_selector:
            self.candidate_selector = CandidateSelector(
                hidden, config.vocab_size, config.selector_rank, config.selector_top_k
            )
        # Leading underscore keeps RoPE (and any frequency table) out of parameters.
        self._rope = initialize_rope(
            config.head_dim,
            base=config.rope_theta,
            traditional=False,
            scaling_config=config.rope_scaling,
            max_position_embeddings=config.max_position_embeddings,
        )
        self._target: Optional[_TargetBinding] = None

    @property
    def is_bound(self) -> bool:
        """Whether :meth:`bind` has attached a target."""
        return self._target is not None

    @property
    def logit_multiplier(self) -> Optional[float]:
        """Multiplier in effect (own config, else the bound target's)."""
        return None if self._target is None else self._target.multiplier

    @property
    def logit_softcap(self) -> Optional[float]:
        """Soft-cap in effect (own config, else the bound target's)."""
        return None if self._target is None else self._target.softcap

    def bind(self, target_model: nn.Module) -> None:
        """Share the target's embedding, LM head and logit scale (not as parameters).

        Args:
            target_model: An mlx-lm model (``Model`` with ``.model.embed_tokens``).

        Raises:
            ValueError: the target has no embedding table, or ``embedding="target"``
                is asked for a target whose embedding path is not known here.
        """
        inner = _find_embedding_owner(target_model)
        table = inner.embed_tokens
        args = getattr(target_model, "args", None)
        cfg = self.config
        multiplier = cfg.output_multiplier
        if multiplier is None:
            multiplier = getattr(args, "output_multiplier", None)
        softcap = cfg.final_logit_softcapping
        if softcap is None:
            softcap = getattr(args, "final_logit_softcapping", None)
        self._target = _TargetBinding(
            embed=_embedding_fn(table, inner, args, cfg),
            head=_find_head(target_model, table),
            multiplier=multiplier,
            softcap=softcap,
        )

    def make_context(self, bucket_keys: Optional[bool] = None) -> DrafterContext:
        """Create an empty context whose first append must start at position 0.

        Args:
            bucket_keys: Whether blocks attend over key lengths rounded up to whole
                buckets, with a mask; ``None``: on with CUDA only (why:
                :func:`dflash.cache.plane.resolve_bucket_keys`).

        Returns:
            A :class:`DrafterContext` with one plane per draft layer; each plane holds
            ``(b, n_kv, rows, head_dim)`` keys and values once filled.
        """
        cfg = self.config
        return DrafterContext(
            [
                _ContextPlane(
                    cfg.context_row_limit(i),
                    reserve=cfg.block_size,
                    bucket_keys=resolve_bucket_keys(bucket_keys),
                )
                for i in range(cfg.num_hidden_layers)
            ]
        )

    def append_context(
        self, context: DrafterContext, target_hidden: mx.array, start_position: int
    ) -> None:
        """Project committed tokens' tapped features into every layer's context K/V.

        Args:
            context: The context to grow (from :meth:`make_context`).
            target_hidden: Tapped target features of ``n`` committed tokens.
            start_position: Absolute position of the first of them; must equal
                ``context.offset``.

        Raises:
            ValueError: on a discontinuous ``start_position``, a wrong feature
                width, batch or context; the context is left untouched.

        Shapes: target_hidden (b, n, k*H); sliding layers then hold <= W-1 rows.
        """
        self._check_append(context, target_hidden, start_position)
        count = target_hidden.shape[1]
        if count == 0:
            return
        # Rows older than every layer's reach are never projected.
        limits = [plane.row_limit for plane in context.planes]
        needed = count if None in limits else min(count, max(limits))
        first = start_position + count - needed
        stream = self.hidden_norm(self.fc(target_hidden[:, count - needed :]))
        for layer, plane in zip(self.layers, context.planes):
            drop = 0 if plane.row_limit is None else max(0, needed - plane.row_limit)
            keys, values = layer.self_attn.project_kv(
                stream[:, drop:], self._rope, first + drop
            )
            plane.append(keys, values)
        context.offset = start_position + count
        context.batch = target_hidden.shape[0]

    def _check_append(
        self, context: DrafterContext, target_hidden: mx.array, start_position: int
    ) -> None:
        if len(context.planes) != len(self.layers):
            raise ValueError(
                f"context has {len(context.planes)} layers, drafter has "
                f"{len(self.layers)}"
            )
        width = len(self.config.target_layer_ids) * self.config.hidden_size
        if target_hidden.ndim != 3 or target_hidden.shape[-1] != width:
            raise ValueError(
                f"target_hidden must be (batch, n, {width}), got "
                f"{tuple(target_hidden.shape)}"
            )
        if context.batch is not None and target_hidden.shape[0] != context.batch:
            raise ValueError(
                f"target_hidden batch {target_hidden.shape[0]} != context batch "
                f"{context.batch}"
            )
        if int(start_position) != context.offset:
            raise ValueError(
                f"discontinuous drafter context: expected start_position "
                f"{context.offset}, got {start_position}"
            )

    def embed(self, tokens: mx.array) -> mx.array:
        """Embed block tokens through the bound target.

        Args:
            tokens: Token ids.

        Returns:
            Block embeddings, times ``input_embedding_scale``.

        Shapes: (b, B) -> (b, B, H).
        """
        h = self._binding().embed(tokens)
        if self.config.input_embedding_scale != 1.0:
            h = h * self.config.input_embedding_scale
        return h

    def hidden_states(
        self, block_tokens: mx.array, context: DrafterContext
    ) -> mx.array:
        """Run the draft layers over a block and apply the final ``norm``.

        Args:
            block_tokens: ``[last committed token, mask, ...]``.
            context: Committed context; the block sits at ``context.offset``.

        Returns:
            Final-normed hidden states of every block position.

        Shapes: (b, B) -> (b, B, H).
        """
        if block_tokens.ndim != 2:
            raise ValueError(
                f"block_tokens must be (batch, B), got {tuple(block_tokens.shape)}"
            )
        if context.batch is not None and block_tokens.shape[0] != context.batch:
            raise ValueError(
                f"block batch {block_tokens.shape[0]} != context batch {context.batch}"
            )
        h = self.embed(block_tokens)
        for layer, plane in zip(self.layers, context.planes):
            h = layer(h, plane, self._rope, context.offset)
        return self.norm(h)

    def logits(self, hidden: mx.array) -> mx.array:
        """Target LM head, then the multiplier and soft-cap in effect.

        Args:
            hidden: Final-normed drafter hidden states.

        Returns:
            Logits over the target vocabulary.

        Shapes: (b, B, H) -> (b, B, V).
        """
        binding = self._binding()
        out = binding.head(hidden)
        if binding.multiplier is not None and binding.multiplier != 1.0:
            out = out * binding.multiplier
        if binding.softcap is not None and binding.softcap > 0:
            out = mx.tanh(out / binding.softcap) * binding.softcap
        return out

    def __call__(self, block_tokens: mx.array, context: DrafterContext) -> mx.array:
        """Drafter logits for a block.

        Row ``i >= 1`` is the drafter's distribution for the token at block
        position ``i`` (the mask it replaces); row 0 sits on the anchor token.

        Args:
            block_tokens: ``[last committed token, mask, mask, ...]``.
            context: Committed context; block positions are ``context.offset ..
                context.offset + B - 1``.

        Returns:
            Logits after the target's LM head, multiplier and soft-cap.

        Shapes: block_tokens (b, B), context rows (b, n_kv, rows, head_dim) ->
            (b, B, V).
        """
        return self.logits(self.hidden_states(block_tokens, context))

    def propose(
        self,
        block_tokens: mx.array,
        context: DrafterContext,
        temperature: float = 0.0,
        key: Optional[mx.array] = None,
    ) -> DraftProposal:
        """Draft tokens for block positions 1..B-1, honouring a candidate selector.

        Without a selector this is argmax (or a sample at ``temperature``) of
        ``self(block_tokens, context)[:, 1:]``. DFlash2 checkpoints pick each
        position among its top-k candidates given the previous pick, so their draft
        tokens are not the per-position argmax.

        Args:
            block_tokens: ``[last committed token, mask, ...]``.
            context: Committed context.
            temperature: 0 for greedy drafts, otherwise the sampling temperature.
            key: Optional PRNG key for sampling.

        Returns:
            A :class:`DraftProposal`; ``probs`` is the full-vocabulary draft
            distribution each token was drawn from (``None`` when greedy), the
            ``q`` of lossless rejection sampling.

        Shapes: block_tokens (b, B) -> tokens (b, B-1), probs (b, B-1, V).
        """
        hidden = self.hidden_states(block_tokens, context)[:, 1:]
        logits = self.logits(hidden)
        if self.config.has_candidate_selector:
            tokens, candidates, probs = self.candidate_selector(
                hidden, logits, block_tokens[:, 0], temperature, key
            )
            if probs is not None:
                full = mx.zeros(logits.shape, dtype=mx.float32)
                probs = mx.put_along_axis(full, candidates, probs, axis=-1)
            return DraftProposal(tokens, probs)
        if temperature <= 0:
            return DraftProposal(mx.argmax(logits, axis=-1).astype(mx.int32), None)
        scaled = logits.astype(mx.float32) / temperature
        tokens = mx.random.categorical(scaled, key=key).astype(mx.int32)
        return DraftProposal(tokens, mx.softmax(scaled, axis=-1))

    def _binding(self) -> _TargetBinding:
        if self._target is None:
            raise RuntimeError("drafter is not bound to a target; call bind() first")
        return self._target


def _find_embedding_owner(target_model: nn.Module) -> Any:
    """The module holding ``embed_tokens`` (mlx-lm's inner ``model``, usually)."""
    candidates = [target_model, getattr(target_model, "model", None)]
    language = getattr(target_model, "language_model", None)
    if language is not None:
        candidates += [language, getattr(language, "model", None)]
    for owner in candidates:
        if owner is not None and _has_child(owner, "embed_tokens"):
            return owner
    raise ValueError(
        f"cannot find embed_tokens in target {type(target_model).__name__}"
    )


def _has_child(module: Any, name: str) -> bool:
    try:
        return getattr(module, name, None) is not None
    except AttributeError:
        return False


def _find_head(
    target_model: nn.Module, table: nn.Module
) -> Callable[[mx.array], mx.array]:
    for owner in (target_model, getattr(target_model, "language_model", None)):
        if owner is not None and _has_child(owner, "lm_head"):
            return owner.lm_head
    # Tied embeddings: the table doubles as the output projection.
    return table.as_linear


def _embedding_fn(
    table: nn.Module, inner: Any, args: Any, config: DrafterConfig
) -> Callable[[mx.array], mx.array]:
    if config.embedding == EMBED_RAW:
        return table
    model_type = getattr(args, "model_type", None)
    if model_type == "muse_glimmer":
        eps = getattr(inner, "embed_eps", None) or getattr(args, "rms_norm_eps")
        return lambda tokens: mx.fast.rms_norm(table(tokens), None, eps)
    if model_type in _PLAIN_EMBEDDING_MODEL_TYPES:
        return table
    raise ValueError(
        f"embedding='target' is not known for target model_type {model_type!r}; "
        "use embedding='raw'"
    )
