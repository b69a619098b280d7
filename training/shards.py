"""Checkpoints as safetensors shards of bounded size, plus a JSON sidecar.

Every file stays under ``max_bytes`` (16 MB is the most one file may be when it comes back
from the GPU machine), so a checkpoint is a folder: ``<stem>-00000.safetensors`` ...
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Dict, List

import mlx.core as mx

MAX_SHARD_BYTES = 15 * 1024 * 1024


def save_shards(
    arrays: Dict[str, mx.array],
    folder: Path,
    stem: str,
    max_bytes: int = MAX_SHARD_BYTES,
) -> List[str]:
    """Write ``arrays`` into as few shards as fit ``max_bytes`` each.

    Args:
        arrays: Flat name -> array mapping.
        folder: Destination folder (created).
        stem: File name prefix; old ``<stem>-*.safetensors`` files are removed first.
        max_bytes: Upper bound on one shard's tensor bytes.

    Returns:
        The shard file names written, in order.

    Raises:
        ValueError: one array alone is larger than ``max_bytes``.
    """
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    for old in folder.glob(f"{stem}-*.safetensors"):
        old.unlink()
    groups: List[Dict[str, mx.array]] = [{}]
    used = 0
    for name in sorted(arrays):
        size = arrays[name].nbytes
        if size > max_bytes:
            raise ValueError(
                f"array {name} ({size} bytes) exceeds a shard ({max_bytes})"
            )
        if used + size > max_bytes and groups[-1]:
            groups.append({})
            used = 0
        groups[-1][name] = arrays[name]
        used += size
    names = []
    for index, group in enumerate(groups):
        name = f"{stem}-{index:05d}.safetensors"
        mx.save_safetensors(str(folder / name), group)
        names.append(name)
    return names


def load_shards(folder: Path, stem: str) -> Dict[str, mx.array]:
    """Read every ``<stem>-*.safetensors`` in ``folder`` into one mapping.

    Raises:
        FileNotFoundError: no shard with that stem exists.
    """
    paths = sorted(Path(folder).glob(f"{stem}-*.safetensors"))
    if not paths:
        raise FileNotFoundError(f"no {stem}-*.safetensors in {folder}")
    arrays: Dict[str, mx.array] = {}
    for path in paths:
        arrays.update(mx.load(str(path)))
    return arrays


def write_json(path: Path, data: dict) -> None:
    """Write ``data`` as indented JSON, replacing the file atomically."""
    path = Path(path)
    partial = path.with_suffix(path.suffix + ".partial")
    partial.write_text(json.dumps(data, indent=2) + "\n")
    partial.replace(path)


def read_json(path: Path) -> dict:
    """Read a JSON file."""
    return json.loads(Path(path).read_text())
