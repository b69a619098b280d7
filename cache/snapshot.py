"""Snapshots: a session's caches to a safetensors file and back, through a fail-closed gate.

``save_prompt_cache(path, cache, metadata=None)`` / ``load_prompt_cache(path, model, ...)``
(mlx-lm's names). A snapshot is a **logical-order cut**: per plane, its live rows oldest first
(a ring exactly ``min(position, capacity)`` rows from ``position - rows``, a growing plane
exactly ``position`` rows from 0) and no rotation; with DFlash, the drafter's context rows too.
Loading lays every row where sequential appends would have put it (a ring's rotation is
``origin_logical % capacity``, see :meth:`~dflash.cache.plane.KvPlane.install_cut`), into new
caches only, so a continued session replays the saved one's logits bitwise and a refused file
changes nothing.

File layout: a standard safetensors file. Tensors ``layers.{i}.keys`` / ``layers.{i}.values``
(``(B, H, rows, D)``, one pair per plane with rows, in cache order) and
``drafter.{j}.keys`` / ``drafter.{j}.values``. Metadata, in mlx-lm's ``save_prompt_cache``
layout: ``0.<key>`` the user's metadata; ``1.0`` a notice naming :func:`load_prompt_cache`
(mlx-lm's loader takes ``1.*`` for class names and looks them up in its own module, so on
these files it fails with ``KeyError`` carrying the notice instead of building caches);
``1.1`` the header (JSON: format, version, encoding, container, per-layer fingerprint and cut,
the drafter's, and a sha256 over header, user metadata and every tensor's bytes); ``2.0``
mlx-lm's empty scalar list.

Every refusal is a :class:`~dflash.cache.errors.SnapshotError` naming the layer (or the header,
or the file) and the field.
"""

import hashlib
import json
import math
import os
import secrets
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple, Union

import mlx.core as mx
import numpy as np

from . import gate
from .caches import GrowingKVCache, RingKVCache
from .errors import SnapshotError
from .plane import KvPlane, PlaneMeta, kv_halves
from .prompt_cache import (
    PromptCache,
    make_prompt_cache,
    model_row_shape,
    model_type_of,
)

FORMAT = "dflash.prompt_cache"
VERSION = 1
ENCODING = "dflash-logical-rows-v1"
NOTICE = (
    "this is a dflash snapshot: load it with "
    "dflash.cache.load_prompt_cache(path, model)"
)

_USER_PREFIX = "0."
_NOTICE_KEY = "1.0"
_HEADER_KEY = "1.1"
_SCALARS_KEY = "2.0"

_HEADER_FIELDS = (
    "format",
    "version",
    "encoding",
    "container",
    "layer_count",
    "layers",
    "drafter",
    "checksum",
)
_LAYER_FIELDS = (
    "kind",
    "window",
    "max_context",
    "position",
    "rows",
    "first",
    "batch",
    "kv_heads",
    "head_dim",
    "dtype",
    "model_type",
    "layer",
)
_ROW_FIELDS = ("batch", "kv_heads", "head_dim", "dtype")
_DRAFTER_FIELDS = ("offset", "batch", "layers")
_DRAFTER_LAYER_FIELDS = ("row_limit", "rows", "kv_heads", "head_dim", "dtype")

# safetensors dtype codes: K/V rows use the three float types; mlx-lm's scalar entries the rest.
_KV_CODES = {"F16": mx.float16, "BF16": mx.bfloat16, "F32": mx.float32}
_CODES = dict(
    _KV_CODES,
    BOOL=mx.bool_,
    U8=mx.uint8,
    I8=mx.int8,
    U16=mx.uint16,
    I16=mx.int16,
    U32=mx.uint32,
    I32=mx.int32,
    U64=mx.uint64,
    I64=mx.int64,
)
_DTYPE_NAMES = {mx.float16: "float16", mx.bfloat16: "bfloat16", mx.float32: "float32"}
_NAME_CODES = {"float16": "F16", "bfloat16": "BF16", "float32": "F32"}
_CODE_OF = {dtype: code for code, dtype in _CODES.items()}

ORACLE_ENCODING = "f32-full-history"

ModelArg = Union[Any, Sequence[Any]]


# --------------------------------------------------------------------- safetensors


@dataclass
class _Tensor:
    """One tensor as stored: safetensors dtype code, shape, raw little-endian bytes."""

    code: str
    shape: Tuple[int, ...]
    data: Any  # bytes or a memoryview into the file

    def to_mx(self) -> mx.array:
        flat = mx.array(np.frombuffer(self.data, dtype=np.uint8))
        return flat.view(_CODES[self.code]).reshape(self.shape)


def _tensor_of(array: mx.array) -> _Tensor:
    """The stored form of ``array`` (its bytes in C order)."""
    data = np.array(mx.contiguous(array).view(mx.uint8)).tobytes()
    return _Tensor(_CODE_OF[array.dtype], tuple(array.shape), data)


@dataclass
class _File:
    metadata: Dict[str, str]
    tensors: Dict[str, _Tensor]
    entries: dict  # the parsed safetensors header
    header_bytes: bytes  # as stored (JSON and padding)


def _read(path) -> _File:
    """Parse a safetensors file in Python (every length and offset checked)."""
    where = str(path)
    try:
        data = Path(path).read_bytes()
    except OSError as error:
        raise SnapshotError(where, "file", error.strerror or str(error)) from None
    if len(data) < 8:
        raise SnapshotError(where, "file", f"truncated: {len(data)} bytes")
    size = int.from_bytes(data[:8], "little")
    if size > len(data) - 8:
        raise SnapshotError(
            where, "header", f"claims {size} bytes; {len(data) - 8} follow (truncated?)"
        )
    try:
        header = json.loads(data[8 : 8 + size].decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as error:
        raise SnapshotError(where, "header", f"is not JSON ({error})") from None
    if not isinstance(header, dict):
        raise SnapshotError(where, "header", "is not a JSON object")
    entries = dict(header)
    metadata = header.pop("__metadata__", {})
    if not isinstance(metadata, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()
    ):
        raise SnapshotError(where, "__metadata__", "must map strings to strings")
    body = memoryview(data)[8 + size :]
    tensors, spans = {}, []
    for name, entry in header.items():
        tensors[name] = _parse_entry(name, entry, body)
        spans.append(tuple(entry["data_offsets"]))
    end = 0
    for start, stop in sorted(spans):
        if start != end:
            raise SnapshotError(where, "data", "tensors leave a gap or overlap")
        end = stop
    if end != len(body):
        raise SnapshotError(
            where, "data", f"{len(body)} data bytes, the tensors cover {end}"
        )
    return _File(metadata, tensors, entries, bytes(data[8 : 8 + size]))


def _parse_entry(name: str, entry: Any, body: memoryview) -> _Tensor:
    where = f"tensor {name!r}"
    gate.check_keys(where, entry, ("dtype", "shape", "data_offsets"))
    code, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
    if code not in _CODES:
        raise SnapshotError(where, "dtype", f"unsupported {code!r}")
    if not isinstance(shape, list) or not all(gate.is_int(n) and n >= 0 for n in shape):
        raise SnapshotError(where, "shape", f"is not a list of sizes: {shape!r}")
    if (
        not isinstance(offsets, list)
        or len(offsets) != 2
        or not all(gate.is_int(n) for n in offsets)
        or not 0 <= offsets[0] <= offsets[1] <= len(body)
    ):
        raise SnapshotError(where, "data_offsets", f"out of the file: {offsets!r}")
    itemsize = _CODES[code].size
    if offsets[1] - offsets[0] != math.prod(shape) * itemsize:
        raise SnapshotError(
            where,
            "data_offsets",
            f"span {offsets[1] - offsets[0]} bytes, shape {shape} of {code} needs "
            f"{math.prod(shape) * itemsize}",
        )
    return _Tensor(code, tuple(shape), body[offsets[0] : offsets[1]])


def _write(path, metadata: Mapping[str, str], tensors: Mapping[str, _Tensor]) -> None:
    """Write a safetensors file atomically (a failed save leaves any old file in place)."""
    entries, offset = {"__metadata__": dict(metadata)}, 0
    for name in sorted(tensors):
        tensor = tensors[name]
        end = offset + len(tensor.data)
        entries[name] = {
            "dtype": tensor.code,
            "shape": list(tensor.shape),
            "data_offsets": [offset, end],
        }
        offset = end
    header = _header_bytes(entries)
    target = Path(path)
    # A private name beside the target; created 0666 less the umask, like any new file.
    temporary = target.with_name(f".{target.name}.{os.getpid()}.{secrets.token_hex(4)}")
    created = False
    try:
        descriptor = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
        created = True
        with os.fdopen(descriptor, "wb") as handle:
            handle.write(len(header).to_bytes(8, "little") + header)
            for name in sorted(tensors):
                handle.write(tensors[name].data)
        os.replace(temporary, target)
    except BaseException as error:
        if created:
            temporary.unlink(missing_ok=True)
        if isinstance(error, OSError):
            reason = error.strerror or str(error)
            raise SnapshotError(str(path), "file", reason) from None
        raise


def _header_bytes(entries: Mapping[str, Any]) -> bytes:
    """The safetensors header as this module writes it: canonical JSON, space-padded to 8."""
    header = _canonical(entries).encode("ascii")
    return header + b" " * (-len(header) % 8)


def _canonical(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=True)


def _digest(
    header: Mapping[str, Any],
    metadata: Mapping[str, str],
    tensors: Mapping[str, _Tensor],
) -> str:
    """sha256 over the canonical header (less its checksum), user metadata and tensors."""
    digest = hashlib.sha256()
    digest.update(_canonical({"header": header, "metadata": metadata}).encode())
    for name in sorted(tensors):
        tensor = tensors[name]
        digest.update(
            _canonical(
                [name, tensor.code, list(tensor.shape), len(tensor.data)]
            ).encode()
        )
        digest.update(tensor.data)
    return "sha256:" + digest.hexdigest()


# --------------------------------------------------------------------------- save


def save_prompt_cache(
    path: Union[str, os.PathLike],
    cache: Sequence[Any],
    metadata: Optional[Mapping[str, str]] = None,
) -> None:
    """Save a session's caches as a snapshot (a safetensors file at exactly ``path``).

    Args:
        path: The file to write (replaced atomically; no extension is added).
        cache: A :class:`~dflash.cache.PromptCache` (its drafter context is saved too when it
            carries one), or a plain list of dflash planes, e.g. the classic loop's
            ``make_prompt_cache(model) + make_prompt_cache(draft_model)``.
        metadata: Strings to keep with the snapshot (mlx-lm's ``metadata``).

    Raises:
        SnapshotError: A cache that is not a dflash plane, one under an open speculative
            checkpoint, a plane whose state the gate refuses, planes of one session at
            different positions, metadata that is not ``str -> str``, or the file cannot be
            written.
    """
    user = _user_metadata(metadata)
    if not isinstance(cache, (list, tuple)):
        raise SnapshotError(
            "cache", "type", f"must be a list of caches, got {type(cache).__name__}"
        )
    records, tensors = [], {}
    for index, plane in enumerate(cache):
        record, pair = _plane_cut(plane, index)
        records.append(record)
        if pair is not None:
            tensors[f"layers.{index}.keys"] = _tensor_of(pair[0])
            tensors[f"layers.{index}.values"] = _tensor_of(pair[1])
    session = isinstance(cache, PromptCache)
    if session:
        for index, record in enumerate(records):
            gate.check_same(
                f"layer {index}",
                "position",
                record["position"],
                records[0]["position"],
                "one session's planes advance in lockstep",
            )
    context = cache.drafter_context if session else None
    drafter = None
    if context is not None:
        drafter = _context_cut(context, tensors)
        if records:
            gate.check_same(
                "drafter",
                "offset",
                drafter["offset"],
                records[0]["position"],
                "a session's drafter context is at its target's position",
            )
    header = {
        "format": FORMAT,
        "version": VERSION,
        "encoding": ENCODING,
        "container": "PromptCache" if session else "list",
        "layer_count": len(records),
        "layers": records,
        "drafter": drafter,
    }
    header["checksum"] = _digest(header, user, tensors)
    stored = {_USER_PREFIX + key: value for key, value in user.items()}
    stored.update(
        {_NOTICE_KEY: NOTICE, _HEADER_KEY: _canonical(header), _SCALARS_KEY: ""}
    )
    _write(path, stored, tensors)


def _user_metadata(metadata: Optional[Mapping[str, str]]) -> Dict[str, str]:
    if metadata is None:
        return {}
    if not isinstance(metadata, Mapping):
        raise SnapshotError(
            "metadata", "type", f"must map str to str, got {type(metadata).__name__}"
        )
    for key, value in metadata.items():
        if not isinstance(key, str) or not isinstance(value, str):
            raise SnapshotError(
                "metadata", repr(key), f"must map str to str, got {value!r}"
            )
    return dict(metadata)


def _plane_cut(plane: Any, index: int) -> Tuple[dict, Optional[Tuple[mx.array, ...]]]:
    """A plane's header record and its live rows oldest first (``None`` when empty)."""
    where = f"layer {index}"
    if not isinstance(plane, KvPlane):
        raise SnapshotError(
            f"cache {index}",
            "type",
            f"is a {type(plane).__name__}; only dflash planes "
            "(dflash.cache.make_prompt_cache) can be saved",
        )
    if plane.checkpointed:
        raise SnapshotError(
            where, "checkpoint", "is open; commit or roll back before saving"
        )
    if not plane.head_major:
        raise SnapshotError(
            where, "head_major", "snapshots hold head-major (mlx-lm layout) planes"
        )
    meta = {name: getattr(plane, name) for name in gate.META_FIELDS}
    plane.check_meta(meta, where)
    halves = (None, None) if plane.kv is None else kv_halves(plane.kv)
    gate.check_buffers(meta, *halves, where)
    pair = plane.logical_rows() if plane.len else None
    record = {
        "kind": plane.kind,
        "window": plane.window,
        "max_context": plane.max_context,
        "position": plane.offset,
        "rows": plane.len,
        "first": plane.origin_logical,
        "model_type": plane.model_type,
        "layer": plane.layer,
    }
    record.update(_row_fields(pair))
    return record, pair


def _row_fields(pair: Optional[Tuple[mx.array, mx.array]]) -> dict:
    if pair is None:
        return dict.fromkeys(_ROW_FIELDS)
    batch, heads, _, dim = pair[0].shape
    return {
        "batch": batch,
        "kv_heads": heads,
        "head_dim": dim,
        "dtype": _DTYPE_NAMES[pair[0].dtype],
    }


def _context_cut(context: Any, tensors: Dict[str, _Tensor]) -> dict:
    """The drafter context's header record; its rows go into ``tensors``."""
    if not callable(getattr(context, "live_rows", None)):
        raise SnapshotError(
            "drafter",
            "type",
            f"drafter_context is a {type(context).__name__}, not a dflash DrafterContext",
        )
    layers = []
    for index, (plane, pair) in enumerate(zip(context.planes, context.live_rows())):
        count = 0 if pair is None else pair[0].shape[2]
        want = _context_rows(plane.row_limit, context.offset)
        gate.check_same(f"drafter layer {index}", "rows", count, want)
        record = {"row_limit": plane.row_limit, "rows": count}
        row_fields = _row_fields(pair)
        record.update({k: row_fields[k] for k in ("kv_heads", "head_dim", "dtype")})
        layers.append(record)
        if pair is not None:
            tensors[f"drafter.{index}.keys"] = _tensor_of(pair[0])
            tensors[f"drafter.{index}.values"] = _tensor_of(pair[1])
    return {"offset": context.offset, "batch": context.batch, "layers": layers}


def _context_rows(row_limit: Optional[int], offset: int) -> int:
    """Rows a drafter context layer holds at ``offset``."""
    return offset if row_limit is None else min(offset, row_limit)


# --------------------------------------------------------------------------- load


def load_prompt_cache(
    path: Union[str, os.PathLike],
    model: ModelArg,
    return_metadata: bool = False,
    drafter: Optional[Any] = None,
):
    """Load a snapshot into new caches for ``model`` (fail-closed; nothing live is touched).

    Args:
        path: A file written by :func:`save_prompt_cache` (or by mlx-lm's
            ``save_prompt_cache`` from dflash caches: see below).
        model: The model the caches belong to; for a classic pair's caches, the list
            ``[target, draft_model]`` (their layers are split in that order).
        return_metadata: Also return the user metadata, as mlx-lm does.
        drafter: A DFlash drafter (``dflash.load_drafter``). When the snapshot carries a
            drafter context, it is rebuilt with ``drafter.make_context()`` and its rows
            installed; with ``drafter=None`` such a file loads the target planes only
            (``drafter_context`` is ``None``).

    Returns:
        The caches (a :class:`~dflash.cache.PromptCache` if one was saved, else a list),
        and with ``return_metadata`` also the metadata dict.

    Raises:
        SnapshotError: The file is unreadable, truncated, corrupt (checksum) or was made for
            another model or drafter, or a plane's cut breaks the gate; the message names the
            layer and the field.
        IncompatibleCache: ``model`` asks for caches dflash cannot build (as
            :func:`~dflash.cache.make_prompt_cache` refuses them).

    A file written by mlx-lm's ``save_prompt_cache`` from dflash caches (it keeps each
    plane's storage and bookkeeping) loads here too, every plane through the state gate and
    checked against ``model``, as a plain list; that layout has no checksum. mlx-lm's own
    ``load_prompt_cache`` cannot build dflash classes (``KeyError: 'RingKVCache'``).
    """
    models = list(model) if isinstance(model, (list, tuple)) else [model]
    if not models:
        raise SnapshotError("model", "type", "needs a model or a list of models")
    for index, each in enumerate(models):
        if not (hasattr(each, "make_cache") or hasattr(each, "layers")):
            raise SnapshotError(
                f"model {index}",
                "type",
                f"is a {type(each).__name__}, not an mlx-lm model",
            )
    if drafter is not None and not callable(getattr(drafter, "make_context", None)):
        raise SnapshotError(
            "drafter", "type", f"must be a DFlash drafter, got {type(drafter).__name__}"
        )
    stored = _read(path)
    if stored.metadata.get(_NOTICE_KEY) == NOTICE:
        cache, user = _load_snapshot(stored, models, drafter)
    else:
        cache, user = _load_mlx_lm_file(stored, models, drafter, str(path))
    return (cache, user) if return_metadata else cache


def _load_snapshot(stored: _File, models: List[Any], drafter: Optional[Any]):
    user, header = _header(stored)
    tensors = stored.tensors
    layers = header["layers"]
    if not isinstance(layers, list):
        raise SnapshotError("header", "layers", "must be a list")
    gate.check_int("header", "layer_count", header["layer_count"])
    gate.check_same("header", "layer_count", header["layer_count"], len(layers))
    container = header["container"]
    if container not in ("PromptCache", "list"):
        raise SnapshotError("header", "container", f"unknown {container!r}")
    expected: set = set()
    planes = []
    for label, first, model, count in _split(models, len(layers)):
        records = layers[first : first + count]
        planes += _rebuild_group(label, first, model, records, tensors, expected)
    position = planes[0].offset if planes else 0
    context = _rebuild_context(
        header["drafter"], container, drafter, tensors, expected, position
    )
    for name in sorted(tensors):
        if name not in expected:
            raise SnapshotError(f"tensor {name!r}", "name", "unexpected in a snapshot")
    if container == "list":
        return planes, user
    if context is None and drafter is not None:
        if position:
            raise SnapshotError(
                "header",
                "drafter",
                f"the snapshot carries no drafter context for position {position}; "
                "load it without drafter=",
            )
        context = drafter.make_context()
    return PromptCache(planes, drafter_context=context), user


def _header(stored: _File) -> Tuple[Dict[str, str], dict]:
    """User metadata and the header, after the layout, the identity and the checksum."""
    if stored.header_bytes != _header_bytes(stored.entries):
        # Only this module writes these files: any other byte there is damage.
        raise SnapshotError("header", "bytes", "not as save_prompt_cache writes them")
    user = {}
    for key, value in stored.metadata.items():
        if key.startswith(_USER_PREFIX):
            user[key[len(_USER_PREFIX) :]] = value
        elif key not in (_NOTICE_KEY, _HEADER_KEY, _SCALARS_KEY):
            raise SnapshotError("header", key, "unknown metadata key")
    if stored.metadata.get(_SCALARS_KEY) != "":
        raise SnapshotError("header", _SCALARS_KEY, "must be the empty string")
    if _HEADER_KEY not in stored.metadata:
        raise SnapshotError("header", _HEADER_KEY, "missing")
    try:
        header = json.loads(stored.metadata[_HEADER_KEY])
    except (ValueError, RecursionError) as error:
        raise SnapshotError("header", _HEADER_KEY, f"is not JSON ({error})") from None
    gate.check_keys("header", header, _HEADER_FIELDS)
    gate.check_same("header", "format", header["format"], FORMAT)
    gate.check_same("header", "version", header["version"], VERSION)
    if header["encoding"] == ORACLE_ENCODING:
        raise SnapshotError(
            "header",
            "encoding",
            f"{ORACLE_ENCODING!r} is the float32 reference oracle's; dflash planes "
            f"install only {ENCODING!r}",
        )
    gate.check_same("header", "encoding", header["encoding"], ENCODING)
    body = {key: value for key, value in header.items() if key != "checksum"}
    if _digest(body, user, stored.tensors) != header["checksum"]:
        raise SnapshotError(
            "header",
            "checksum",
            "does not match the file's contents (corrupt or edited)",
        )
    return user, header


def _split(models: List[Any], layer_count: int):
    """Per model: a label maker for its layers, its first layer index and its layer count."""
    groups, first = [], 0
    for index, model in enumerate(models):
        count = len(make_prompt_cache(model))
        if len(models) == 1:
            label = "layer {}".format
        else:
            label = f"model {index} layer {{}}".format
        groups.append((label, first, model, count))
        first += count
    if first != layer_count:
        counts = " + ".join(str(group[3]) for group in groups)
        hint = "; for a classic pair's caches pass model=[target, draft_model]"
        raise SnapshotError(
            "header",
            "layer_count",
            f"the snapshot holds {layer_count} layers, the model(s) given have {counts}"
            + (hint if len(models) == 1 else ""),
        )
    return groups


def _rebuild_group(
    label,
    first: int,
    model: Any,
    records: List[Any],
    tensors: Mapping[str, _Tensor],
    expected: set,
) -> List[KvPlane]:
    """New caches for one model, each holding its record's cut (every field checked)."""
    for index, record in enumerate(records):
        gate.check_keys(label(index), record, _LAYER_FIELDS)
    if not records:
        return []
    limit, position = records[0]["max_context"], records[0]["position"]
    gate.check_int(label(0), "max_context", limit, low=1, optional=True)
    gate.check_int(label(0), "position", position)
    planes = make_prompt_cache(model, max_context=limit)
    model_type = model_type_of(model)
    heads, head_dim = model_row_shape(model)
    for index, (plane, record) in enumerate(zip(planes, records)):
        where = label(index)
        gate.check_same(where, "kind", record["kind"], plane.kind)
        gate.check_same(where, "window", record["window"], plane.window)
        gate.check_same(where, "max_context", record["max_context"], limit)
        gate.check_same(where, "position", record["position"], position, "lockstep")
        gate.check_same(where, "model_type", record["model_type"], model_type)
        gate.check_same(where, "layer", record["layer"], plane.layer)
        rows = plane.meta_after(PlaneMeta(plane.capacity, 0, 0, 0), position).len
        gate.check_same(where, "rows", record["rows"], rows, f"a cut at {position}")
        gate.check_same(where, "first", record["first"], position - rows)
        prefix = f"layers.{first + index}"
        pair = _row_pair(where, prefix, record, rows, record["batch"], tensors)
        if pair is None and record["batch"] is not None:
            raise SnapshotError(where, "batch", "must be null: the cut has no rows")
        if heads is not None and pair is not None:
            gate.check_same(where, "kv_heads", record["kv_heads"], heads, "the model's")
        if head_dim is not None and pair is not None:
            gate.check_same(
                where, "head_dim", record["head_dim"], head_dim, "the model's"
            )
        expected.update((f"{prefix}.keys", f"{prefix}.values"))
        if pair is not None:
            plane.install_cut(position, *pair)
    return planes


def _row_pair(
    where: str,
    prefix: str,
    record: Mapping[str, Any],
    rows: int,
    batch: Any,
    tensors: Mapping[str, _Tensor],
) -> Optional[Tuple[mx.array, mx.array]]:
    """The keys and values of a record's ``rows`` rows, checked against its fields."""
    if rows == 0:
        for field in ("kv_heads", "head_dim", "dtype"):
            if record[field] is not None:
                raise SnapshotError(where, field, "must be null: the cut has no rows")
        return None
    gate.check_int(where, "batch", batch, low=1)
    gate.check_int(where, "kv_heads", record["kv_heads"], low=1)
    gate.check_int(where, "head_dim", record["head_dim"], low=1)
    dtype = record["dtype"]
    if dtype not in _NAME_CODES:
        raise SnapshotError(
            where, "dtype", f"{dtype!r} is not float16, bfloat16 or float32"
        )
    shape = (batch, record["kv_heads"], rows, record["head_dim"])
    pair = []
    for half in ("keys", "values"):
        tensor = tensors.get(f"{prefix}.{half}")
        if tensor is None:
            raise SnapshotError(where, half, f"tensor {prefix}.{half} is missing")
        gate.check_same(where, f"{half} dtype", tensor.code, _NAME_CODES[dtype])
        gate.check_same(where, f"{half} shape", tensor.shape, shape)
        pair.append(tensor.to_mx())
    return pair[0], pair[1]


def _rebuild_context(
    record: Any,
    container: str,
    drafter: Optional[Any],
    tensors: Mapping[str, _Tensor],
    expected: set,
    position: int,
):
    """A new drafter context holding the record's rows (``None`` without a drafter)."""
    if record is None:
        return None
    if container != "PromptCache":
        raise SnapshotError(
            "header", "drafter", "a plain cache list has no drafter context"
        )
    gate.check_keys("drafter", record, _DRAFTER_FIELDS)
    offset, batch, layers = record["offset"], record["batch"], record["layers"]
    gate.check_int("drafter", "offset", offset)
    gate.check_same("drafter", "offset", offset, position, "the target's position")
    gate.check_int("drafter", "batch", batch, low=1, optional=True)
    if offset == 0 and batch is not None:
        raise SnapshotError("drafter", "batch", "must be null: the context is empty")
    if not isinstance(layers, list):
        raise SnapshotError("drafter", "layers", "must be a list")
    context = drafter.make_context() if drafter is not None else None
    if context is not None:
        gate.check_same(
            "drafter", "layers", len(layers), len(context.planes), "the drafter's"
        )
        config = drafter.config
    pairs = []
    for index, layer in enumerate(layers):
        where = f"drafter layer {index}"
        gate.check_keys(where, layer, _DRAFTER_LAYER_FIELDS)
        limit = layer["row_limit"]
        gate.check_int(where, "row_limit", limit, optional=True)
        rows = _context_rows(limit, offset)
        gate.check_same(where, "rows", layer["rows"], rows, f"a context at {offset}")
        prefix = f"drafter.{index}"
        pair = _row_pair(where, prefix, layer, rows, batch, tensors)
        expected.update((f"{prefix}.keys", f"{prefix}.values"))
        if context is not None:
            gate.check_same(where, "row_limit", limit, context.planes[index].row_limit)
            if pair is not None:
                gate.check_same(
                    where, "kv_heads", layer["kv_heads"], config.num_key_value_heads
                )
                gate.check_same(where, "head_dim", layer["head_dim"], config.head_dim)
        pairs.append(pair)
    if context is None:
        return None
    context.install_rows(offset, pairs)
    return context


# ------------------------------------------------------------ mlx-lm's file layout

_MLX_LM_CLASSES = {"RingKVCache": RingKVCache, "GrowingKVCache": GrowingKVCache}


def _load_mlx_lm_file(
    stored: _File, models: List[Any], drafter: Optional[Any], where: str
):
    """Caches from a file mlx-lm's ``save_prompt_cache`` wrote from dflash caches."""
    metadata = stored.metadata
    if _NOTICE_KEY not in metadata or metadata.get(_SCALARS_KEY) != "":
        raise SnapshotError(
            where, "header", "neither a dflash snapshot nor an mlx-lm prompt-cache file"
        )
    if drafter is not None:
        raise SnapshotError(
            "header", "drafter", "mlx-lm's file layout carries no drafter context"
        )
    user = {k[2:]: v for k, v in metadata.items() if k.startswith(_USER_PREFIX)}
    classes = _indexed(
        "class", {k[2:]: v for k, v in metadata.items() if k.startswith("1.")}
    )
    states = [dict() for _ in classes]
    for name, tensor in stored.tensors.items():
        cache, _, entry = name.partition(".")
        if not (cache.isdigit() and entry.isdigit() and int(cache) < len(states)):
            raise SnapshotError(f"tensor {name!r}", "name", "not an mlx-lm cache entry")
        states[int(cache)][int(entry)] = tensor.to_mx()
    _apply_scalars(metadata, states)
    planes = []
    for index, (name, entries) in enumerate(zip(classes, states)):
        cls = _MLX_LM_CLASSES.get(name)
        if cls is None:
            raise SnapshotError(
                f"cache {index}",
                "class",
                f"{name!r} is not a dflash cache (mlx-lm's own caches load with "
                "mlx_lm.models.cache.load_prompt_cache)",
            )
        planes.append(cls.from_state(tuple(_indexed(f"cache {index}", entries))))
    for label, first, model, count in _split(models, len(planes)):
        _check_loaded_group(label, model, planes[first : first + count])
    return planes, user


def _indexed(what: str, entries: Mapping[Any, Any]) -> List[Any]:
    """``entries`` keyed ``0 .. n-1`` (as ints or digit strings) as a list."""
    keyed = {}
    for key, value in entries.items():
        if not str(key).isdigit():
            raise SnapshotError(what, str(key), "is not an index")
        keyed[int(key)] = value
    if sorted(keyed) != list(range(len(keyed))):
        raise SnapshotError(what, "index", f"entries {sorted(keyed)} are not 0..n-1")
    return [keyed[i] for i in range(len(keyed))]


def _apply_scalars(metadata: Mapping[str, str], states: List[dict]) -> None:
    """Turn mlx-lm's scalar entries (ints, bools, strings, None) back into Python values."""
    markers = {}
    for key, value in metadata.items():
        parts = key.split(".")
        if parts[0] == "2" and len(parts) == 3 and parts[1].isdigit():
            markers.setdefault(int(parts[1]), {})[parts[2]] = value
    for number, marker in sorted(markers.items()):
        position, kind = marker.get("0", ""), marker.get("1", "")
        cache, _, entry = position.partition(".")
        if not (cache.isdigit() and entry.isdigit() and int(cache) < len(states)):
            raise SnapshotError(
                "header", f"2.{number}", f"bad scalar position {position!r}"
            )
        state = states[int(cache)]
        array = state.get(int(entry))
        if array is None:
            raise SnapshotError("header", f"2.{number}", f"no tensor {position!r}")
        state[int(entry)] = _scalar(kind, array, f"2.{number}")


def _scalar(kind: str, array: mx.array, field: str) -> Any:
    if kind == "none":
        return None
    if kind == "scalar" and array.size == 1:
        return array.item()
    if kind == "string" and array.ndim == 1:
        try:
            return "".join(chr(code) for code in array.tolist())
        except (TypeError, ValueError, OverflowError):
            pass
    raise SnapshotError("header", field, f"cannot decode a {kind!r} entry")


def _check_loaded_group(label, model: Any, planes: List[KvPlane]) -> None:
    """Planes restored from mlx-lm's layout: the model's kinds, windows and one position."""
    templates = make_prompt_cache(model)
    heads, head_dim = model_row_shape(model)
    for index, (plane, template) in enumerate(zip(planes, templates)):
        where = label(index)
        gate.check_same(where, "kind", plane.kind, template.kind)
        gate.check_same(where, "window", plane.window, template.window)
        gate.check_same(where, "position", plane.offset, planes[0].offset, "lockstep")
        if plane.kv is not None:
            got_heads, got_dim = plane.kv.shape[2], plane.kv.shape[4]
            if heads is not None:
                gate.check_same(where, "kv_heads", got_heads, heads, "the model's")
            if head_dim is not None:
                gate.check_same(where, "head_dim", got_dim, head_dim, "the model's")
        plane.model_type = template.model_type
