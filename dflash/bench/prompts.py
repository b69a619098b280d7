"""Prompt sets: the JSON-lines file format, encoding, and the stop tokens."""

import json
from os import PathLike
from pathlib import Path
from typing import Any, Collection, List, Optional, Sequence, Union

import mlx.core as mx

from .. import demo

PACKAGED_PROMPTS = "bench-prompts.jsonl"
REPO_PROMPTS = Path("configs") / "bench" / "heldout.jsonl"

Prompt = Union[str, Sequence[int], mx.array]


def default_prompts_path() -> Path:
    """The default prompt set: the packaged copy if installed, else the repo's file.

    Returns:
        ``dflash/demo/bench-prompts.jsonl`` when present, else
        ``<repo root>/configs/bench/heldout.jsonl`` (which may not exist).
    """
    packaged = demo.DEMO_DIR / PACKAGED_PROMPTS
    if packaged.is_file():
        return packaged
    return Path(__file__).resolve().parents[2] / REPO_PROMPTS


def read_prompts(path: Path, limit: Optional[int] = None) -> List[str]:
    """Read the ``prompt`` field of each JSON line of ``path``.

    Blank lines are skipped; other fields are ignored.

    Args:
        path: A JSON-lines file.
        limit: Keep only the first ``limit`` prompts.

    Returns:
        The prompt texts, in file order.

    Raises:
        FileNotFoundError: ``path`` is not a file.
        ValueError: a line is not JSON or has no ``prompt`` string (the message
            names the line), or the file holds no prompts.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"prompts file not found: {path}")
    prompts = []
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        if line.strip():
            prompts.append(_parse_prompt_line(path, number, line))
    if not prompts:
        raise ValueError(f"{path} holds no prompts")
    return prompts[:limit] if limit is not None else prompts


def _parse_prompt_line(path: Path, number: int, line: str) -> str:
    try:
        record = json.loads(line)
    except json.JSONDecodeError as err:
        raise ValueError(f"{path}:{number}: not valid JSON ({err.msg})") from err
    prompt = record.get("prompt") if isinstance(record, dict) else None
    if not isinstance(prompt, str):
        raise ValueError(f"{path}:{number}: no 'prompt' string field")
    return prompt


def stop_tokens(tokenizer: Any) -> Collection[int]:
    """The end-of-sequence token ids of an mlx-lm or Hugging Face tokenizer.

    Args:
        tokenizer: ``mlx_lm``'s ``TokenizerWrapper``, a Hugging Face tokenizer, or
            ``None`` (token-id prompts: nothing stops a run early).

    Returns:
        The ids that end a generation (possibly none).
    """
    ids = getattr(tokenizer, "eos_token_ids", None)
    if ids is None:
        ids = getattr(tokenizer, "eos_token_id", None)
    if ids is None:
        return set()
    return {int(ids)} if isinstance(ids, int) else {int(i) for i in ids}


def check_prompt_set(prompts: Any) -> None:
    """Refuse what is not a non-empty list of prompts (a file name is a string).

    Args:
        prompts: What a caller passed as the prompt set.

    Raises:
        TypeError: a string, bytes or path (read a file with :func:`read_prompts`).
        ValueError: an empty set.
    """
    if isinstance(prompts, (str, bytes, PathLike)):
        raise TypeError(
            "prompts must be a list of prompt texts or token lists, not "
            f"{type(prompts).__name__} {str(prompts)[:60]!r}; read a JSON-lines file "
            "with dflash.bench.read_prompts(path)"
        )
    if len(prompts) == 0:
        raise ValueError("the prompt set is empty")


def encode_prompt(tokenizer: Any, prompt: Prompt, index: int) -> mx.array:
    """Prompt ``index`` as token ids: text is encoded raw (no chat template).

    Args:
        tokenizer: Encodes text prompts (may be ``None`` for token-id prompts).
        prompt: Text, token ids, or a token array.
        index: Its index in the set (for the error message).

    Returns:
        The tokens.

    Raises:
        ValueError: the prompt is empty, or text without a tokenizer.

    Shapes:
        returns ``(P,)`` uint32.
    """
    if isinstance(prompt, str):
        if tokenizer is None:
            raise ValueError(f"prompt {index} is text but no tokenizer was given")
        prompt = tokenizer.encode(prompt)
    tokens = (
        prompt if isinstance(prompt, mx.array) else mx.array(list(prompt), mx.uint32)
    )
    if tokens.size == 0:
        raise ValueError(f"prompt {index} encodes to no tokens")
    return tokens.reshape(-1).astype(mx.uint32)
