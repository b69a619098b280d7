"""The fail-closed gate: what a plane's state must satisfy before anything installs it.

Two encodings pass through here. A plane's **state** (``cache.state``, mlx-lm's protocol) is its
storage as it sits (a ring's rotation included) plus every bookkeeping field, tagged
:data:`STATE_ENCODING`. A **snapshot** (``dflash.cache.save_prompt_cache``) carries each plane's
logical-order cut instead and no rotation; :func:`cut_rows` is its row rule. Both are checked
against the invariants sequential appends maintain:

- a ring holds exactly ``min(position, capacity)`` rows, the oldest at ``position - len``, its
  capacity is ``min(window, max_context)`` and ``origin_physical == origin_logical % capacity``;
- a growing plane holds exactly ``position`` rows from 0 (both origins 0);
- buffers are 4-D float16 / bfloat16 / float32 K and V of one shape, ``capacity`` rows long.

Every refusal is a :class:`~dflash.cache.errors.SnapshotError` naming the layer and the field.
The float32 full-history oracle (``dflash.verify.reference``) tags its state with its own
encoding; each side refuses the other's.
"""

from typing import Any, Dict, Mapping, Optional, Sequence, Tuple

import mlx.core as mx

from .errors import SnapshotError

STATE_ENCODING = "dflash-plane-v1"

# The bookkeeping of a plane state, in ``state`` / ``meta_state`` order.
META_FIELDS = (
    "window",
    "max_context",
    "capacity",
    "len",
    "origin_logical",
    "origin_physical",
    "head_major",
    "layer",
)
STATE_FIELDS = ("keys", "values", "encoding") + META_FIELDS

KV_DTYPES = (mx.float16, mx.bfloat16, mx.float32)

Meta = Dict[str, Any]


def is_int(value: Any) -> bool:
    """A Python integer that is not a bool."""
    return isinstance(value, int) and not isinstance(value, bool)


def where_layer(layer: Any) -> str:
    """How a refusal names a layer."""
    return f"layer {layer}" if is_int(layer) else "layer ?"


def check_int(
    where: str, field: str, value: Any, low: int = 0, optional: bool = False
) -> None:
    """Refuse ``value`` unless it is an integer ``>= low`` (or ``None`` when optional)."""
    if optional and value is None:
        return
    if not is_int(value):
        raise SnapshotError(where, field, f"must be an integer, got {value!r}")
    if value < low:
        raise SnapshotError(where, field, f"must be >= {low}, got {value}")


def _check_common(meta: Meta, where: str) -> None:
    for field in ("capacity", "len", "origin_logical", "origin_physical"):
        check_int(where, field, meta[field])
    check_int(where, "max_context", meta["max_context"], low=1, optional=True)
    if not isinstance(meta["head_major"], bool):
        raise SnapshotError(
            where, "head_major", f"must be a bool, got {meta['head_major']!r}"
        )
    check_int(where, "layer", meta["layer"], optional=True)
    limit, position = meta["max_context"], meta["origin_logical"] + meta["len"]
    if limit is not None and position > limit:
        raise SnapshotError(
            where, "len", f"position {position} exceeds max_context {limit}"
        )


def check_ring_meta(meta: Meta, where: str) -> None:
    """The bookkeeping of a ring (see the module docstring)."""
    check_int(where, "window", meta["window"], low=1)
    _check_common(meta, where)
    window, limit = meta["window"], meta["max_context"]
    capacity, rows = meta["capacity"], meta["len"]
    logical, physical = meta["origin_logical"], meta["origin_physical"]
    want = window if limit is None else min(window, limit)
    if capacity != want:
        raise SnapshotError(
            where,
            "capacity",
            f"is {capacity} but a ring of window {window} (max_context {limit}) holds "
            f"{want} rows",
        )
    if rows > capacity:
        raise SnapshotError(where, "len", f"{rows} exceeds the capacity {capacity}")
    if logical > 0 and rows != capacity:
        raise SnapshotError(
            where,
            "len",
            f"is {rows}, but a ring whose window has advanced (origin_logical {logical}) "
            f"holds min(position, capacity) = {capacity} rows",
        )
    if physical != logical % capacity:
        raise SnapshotError(
            where,
            "origin_physical",
            f"is {physical}, but sequential appends leave origin_logical {logical} at "
            f"rotation {logical % capacity}",
        )


def check_growing_meta(meta: Meta, where: str) -> None:
    """The bookkeeping of a growing plane (see the module docstring)."""
    if meta["window"] is not None:
        raise SnapshotError(
            where, "window", f"a growing plane has none, got {meta['window']!r}"
        )
    _check_common(meta, where)
    for field in ("origin_logical", "origin_physical"):
        if meta[field] != 0:
            raise SnapshotError(
                where, field, f"must be 0 for a growing plane, got {meta[field]}"
            )
    capacity, limit = meta["capacity"], meta["max_context"]
    if meta["len"] > capacity:
        raise SnapshotError(
            where, "len", f"{meta['len']} exceeds the capacity {capacity}"
        )
    if limit is not None and capacity > limit:
        raise SnapshotError(
            where, "capacity", f"{capacity} exceeds max_context {limit}"
        )


def check_buffers(meta: Meta, keys: Any, values: Any, where: str) -> None:
    """The storage of a plane with (already checked) bookkeeping ``meta``.

    Shapes:
        keys, values: ``(B, H, capacity, D)`` head-major or ``(B, capacity, H, D)``.
    """
    if keys is None and values is None:
        if meta["len"]:
            raise SnapshotError(
                where, "keys", f"missing, but the plane counts {meta['len']} rows"
            )
        if meta["window"] is None and meta["capacity"]:
            raise SnapshotError(
                where,
                "capacity",
                f"is {meta['capacity']} but the plane holds no buffers",
            )
        return
    for field, array in (("keys", keys), ("values", values)):
        if not isinstance(array, mx.array):
            raise SnapshotError(
                where, field, f"must be an mx.array, got {type(array).__name__}"
            )
    if keys.ndim != 4:
        raise SnapshotError(where, "keys", f"must be 4-D, got shape {keys.shape}")
    if values.shape != keys.shape:
        raise SnapshotError(
            where, "values", f"shape {values.shape} differs from keys {keys.shape}"
        )
    if keys.dtype not in KV_DTYPES:
        raise SnapshotError(
            where, "keys", f"dtype {keys.dtype} is not float16, bfloat16 or float32"
        )
    if values.dtype != keys.dtype:
        raise SnapshotError(
            where, "values", f"dtype {values.dtype} differs from keys {keys.dtype}"
        )
    axis = 2 if meta["head_major"] else 1
    if keys.shape[axis] != meta["capacity"]:
        raise SnapshotError(
            where,
            "keys",
            f"hold {keys.shape[axis]} rows but the capacity is {meta['capacity']}",
        )
    if min(size for index, size in enumerate(keys.shape) if index != axis) < 1:
        raise SnapshotError(where, "keys", f"has an empty axis: {keys.shape}")


def parse_state(state: Any, where: str) -> Tuple[Any, Any, Meta]:
    """Split a plane state into ``(keys, values, meta)``; refuse a foreign encoding or arity."""
    if not isinstance(state, (tuple, list)):
        raise SnapshotError(
            where, "state", f"must be a tuple, got {type(state).__name__}"
        )
    if len(state) == len(STATE_FIELDS) and is_int(state[-1]):
        where = where_layer(state[-1])
    if len(state) >= 3 and isinstance(state[2], str) and state[2] != STATE_ENCODING:
        raise SnapshotError(
            where,
            "encoding",
            f"{state[2]!r} is not a dflash plane's ({STATE_ENCODING!r}); the two "
            "encodings cannot install each other's state",
        )
    if len(state) != len(STATE_FIELDS):
        raise SnapshotError(
            where,
            "state",
            f"has {len(state)} fields; a dflash plane's has {len(STATE_FIELDS)}: "
            f"{', '.join(STATE_FIELDS)}",
        )
    if not isinstance(state[2], str) or state[2] != STATE_ENCODING:
        raise SnapshotError(
            where, "encoding", f"must be {STATE_ENCODING!r}, got {state[2]!r}"
        )
    meta = dict(zip(META_FIELDS, state[3:]))
    return state[0], state[1], meta


def _encode(value: Any) -> str:
    return "None" if value is None else str(int(value))


def encode_meta_state(meta: Mapping[str, Any]) -> Tuple[str, ...]:
    """``meta_state``: the bookkeeping as strings (mlx-lm's older protocol)."""
    return tuple(_encode(meta[name]) for name in META_FIELDS)


def decode_meta_state(texts: Any, where: str) -> Meta:
    """Parse a ``meta_state``; every field must be canonical (``str(int)`` or ``"None"``)."""
    if not isinstance(texts, (tuple, list)) or len(texts) != len(META_FIELDS):
        count = len(texts) if isinstance(texts, (tuple, list)) else type(texts).__name__
        raise SnapshotError(
            where,
            "meta_state",
            f"needs {len(META_FIELDS)} fields ({', '.join(META_FIELDS)}), got {count}",
        )
    meta = {}
    for name, text in zip(META_FIELDS, texts):
        meta[name] = _decode(name, text, where)
    head_major = meta["head_major"]
    if head_major not in (0, 1):
        raise SnapshotError(where, "head_major", f"must be 0 or 1, got {head_major}")
    meta["head_major"] = bool(head_major)
    return meta


def _decode(name: str, text: Any, where: str) -> Optional[int]:
    if not isinstance(text, str):
        raise SnapshotError(where, name, f"must be a string, got {text!r}")
    if text == "None":
        return None
    try:
        value = int(text)
    except ValueError:
        raise SnapshotError(where, name, f"is not an integer: {text!r}") from None
    if str(value) != text:
        raise SnapshotError(where, name, f"is not a canonical integer: {text!r}")
    return value


def cut_rows(is_ring: bool, capacity: int, position: int) -> int:
    """Rows a snapshot's cut at ``position`` carries: ``min(position, capacity)`` for a ring,
    ``position`` for a growing plane."""
    return min(position, capacity) if is_ring else position


def check_same(where: str, field: str, got: Any, want: Any, why: str = "") -> None:
    """Refuse ``got`` unless it equals ``want`` and has its type (``True`` is not ``1``)."""
    if type(got) is not type(want) or got != want:
        tail = f" ({why})" if why else ""
        raise SnapshotError(where, field, f"is {got!r}, expected {want!r}{tail}")


def check_keys(where: str, record: Mapping[str, Any], required: Sequence[str]) -> None:
    """Refuse a record whose field names are not exactly ``required``."""
    if not isinstance(record, Mapping):
        raise SnapshotError(
            where, "record", f"must be an object, got {type(record).__name__}"
        )
    missing = [name for name in required if name not in record]
    if missing:
        raise SnapshotError(where, missing[0], "missing")
    extra = sorted(str(name) for name in record if name not in required)
    if extra:
        raise SnapshotError(where, extra[0], "unknown field")
