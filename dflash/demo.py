"""The bundled demo pair: a small Muse Glimmer code model and its DFlash drafter.

Layout of a demo folder (``DEMO_DIR`` for the bundled one)::

    <dir>/target/   config.json (model_type muse_glimmer), model*.safetensors
                    (shards, as mlx-lm globs them), tokenizer.json,
                    tokenizer_config.json                  -- an mlx-lm model folder
    <dir>/drafter/  config.json, model.safetensors           -- a dflash drafter folder

Both are read offline from disk; nothing is downloaded.
"""

import json
from pathlib import Path
from typing import Any, Optional, Tuple, Union

import mlx.core as mx
import mlx.nn as nn

DEMO_DIR = Path(__file__).parent / "demo"
DEMO_MODEL_TYPE = "muse_glimmer"
DEMO_DESCRIPTION = "Muse Glimmer code model + DFlash drafter"

TARGET_FILES = ("config.json", "tokenizer.json", "tokenizer_config.json")
# mlx-lm reads every ``model*.safetensors``; the demo target is stored in shards.
TARGET_WEIGHTS = "model*.safetensors"
DRAFTER_FILES = ("config.json", "model.safetensors")


def _required_files(root: Path) -> Tuple[Path, ...]:
    target = tuple(root / "target" / name for name in TARGET_FILES)
    shards = sorted((root / "target").glob(TARGET_WEIGHTS))
    weights = tuple(shards) or (root / "target" / "model.safetensors",)
    drafter = tuple(root / "drafter" / name for name in DRAFTER_FILES)
    return target + weights + drafter


def _missing_error(root: Path, missing: Path) -> FileNotFoundError:
    if root == DEMO_DIR:
        return FileNotFoundError(
            f"the bundled demo pair is not installed: {missing} missing"
        )
    return FileNotFoundError(f"no demo pair at {root}: {missing} missing")


def demo_available(path: Optional[Union[str, Path]] = None) -> bool:
    """Whether every file of a demo pair is present (nothing is loaded).

    Args:
        path: A demo folder; default the bundled one, ``DEMO_DIR``.

    Returns:
        ``True`` when all files of the layout exist.
    """
    root = DEMO_DIR if path is None else Path(path)
    return all(file.is_file() for file in _required_files(root))


def check_demo_files(path: Optional[Union[str, Path]] = None) -> Path:
    """Refuse a demo folder with a missing file (nothing is loaded).

    Args:
        path: A demo folder; default the bundled one, ``DEMO_DIR``.

    Returns:
        The demo folder.

    Raises:
        FileNotFoundError: naming the first missing file.
    """
    root = DEMO_DIR if path is None else Path(path)
    for file in _required_files(root):
        if not file.is_file():
            raise _missing_error(root, file)
    return root


def _check_target_config(root: Path) -> None:
    file = root / "target" / "config.json"
    try:
        config = json.loads(file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ValueError(f"demo target config {file} is not valid JSON: {err}") from err
    model_type = config.get("model_type") if isinstance(config, dict) else None
    if model_type != DEMO_MODEL_TYPE:
        raise ValueError(
            f"demo target config {file} has model_type {model_type!r}, "
            f"expected {DEMO_MODEL_TYPE!r}"
        )


def _load_target(folder: Path) -> Tuple[nn.Module, Any]:
    from mlx_lm import load

    try:
        return load(str(folder))
    except Exception as err:  # mlx-lm raises many kinds; name the folder once
        raise ValueError(f"demo target {folder} could not be loaded: {err}") from err


def _load_drafter(folder: Path, model: nn.Module) -> nn.Module:
    from .loader import load_drafter

    try:
        return load_drafter(folder, model)
    except Exception as err:
        raise ValueError(f"demo drafter {folder} could not be loaded: {err}") from err


def load_demo(
    path: Optional[Union[str, Path]] = None,
    dtype: Optional[mx.Dtype] = mx.float32,
) -> Tuple[nn.Module, Any, nn.Module]:
    """Load a demo pair: the target, its tokenizer and the DFlash drafter bound to it.

    The weights are stored in bfloat16 (to fit the package); by default both models
    compute in float32. bfloat16 logits are coarse (one step is 1/16 near the
    soft-cap's range), so greedy ties are common and a 16-token verify forward and a
    1-token forward may break them differently; in float32 that is rare.

    Args:
        path: A demo folder (``target/`` and ``drafter/`` inside); default the
            bundled one, ``DEMO_DIR``.
        dtype: Compute dtype for both models; ``None`` keeps the stored bfloat16.

    Returns:
        ``(model, tokenizer, drafter)`` as ``mlx_lm.load`` and
        ``dflash.load_drafter`` return them.

    Raises:
        FileNotFoundError: a file of the layout is missing (the message names it).
        ValueError: a file is present but broken (the message names it).
    """
    root = check_demo_files(path)
    _check_target_config(root)
    model, tokenizer = _load_target(root / "target")
    drafter = _load_drafter(root / "drafter", model)
    if dtype is not None:
        model.set_dtype(dtype)
        drafter.set_dtype(dtype)
    return model, tokenizer, drafter
