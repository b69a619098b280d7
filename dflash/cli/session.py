"""Session files of the CLIs: a ``dflash.cache`` snapshot plus what the tools need to go on.

``dflash-chat --save-session``, ``dflash-cache-prompt`` and ``dflash-generate
--prompt-cache-file`` / ``dflash-chat --load-session`` share one file: the prompt cache saved
with :func:`dflash.cache.save_prompt_cache`, whose metadata (strings) holds

- ``format``: :data:`SESSION_FORMAT`;
- ``model`` / ``drafter``: the names the file was made with (a local directory's absolute
  path, a hub repo id, or ``demo`` for the bundled pair; ``drafter`` empty without one);
  a file is refused, by name, for any other model or drafter;
- ``tokens``: JSON list of every token id the cache holds, in order;
- ``pending``: JSON list of prompt tokens not yet in the cache (a prefill keeps the last
  prompt token out when the generator does): they open the next prompt;
- ``turns``: JSON list of ``[prompt tokens, reply tokens]`` per chat turn.
"""

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

from .common import DEMO_NAME, Models

SESSION_FORMAT = "dflash-session-1"
# The snapshot keeps user metadata under this prefix (mlx-lm's save_prompt_cache layout).
USER_PREFIX = "0."
MAX_HEADER_BYTES = 100_000_000  # safetensors' own limit


@dataclass
class Session:
    """A prompt cache and the tokens it holds.

    Attributes:
        cache: The prompt cache (``dflash.make_prompt_cache(model, drafter)``).
        tokens: Every token in the cache, in order.
        pending: Prompt tokens not yet in the cache; the next prompt starts with them.
        turns: ``(prompt tokens, reply tokens)`` of each chat turn.
    """

    cache: Any
    tokens: List[int] = field(default_factory=list)
    pending: List[int] = field(default_factory=list)
    turns: List[Tuple[int, int]] = field(default_factory=list)

    @property
    def position(self) -> int:
        """Tokens the cache holds (its first layer's offset)."""
        return int(self.cache[0].offset)

    @property
    def empty(self) -> bool:
        """Whether nothing has been said yet (no token cached or pending)."""
        return not self.tokens and not self.pending

    def check(self) -> None:
        """Refuse a cache that does not hold exactly the recorded tokens.

        Raises:
            RuntimeError: the two disagree.
        """
        if self.position != len(self.tokens):
            raise RuntimeError(
                f"session cache holds {self.position} tokens but the session recorded "
                f"{len(self.tokens)}"
            )

    def record(self, prompt: List[int], reply: List[int]) -> None:
        """Note a generation from ``prompt`` (pending tokens included) that emitted ``reply``.

        Args:
            prompt: The prompt given to the generator.
            reply: The tokens it emitted.
        """
        self.tokens += prompt + reply
        self.pending = []
        self.turns.append((len(prompt), len(reply)))
        self.check()


def new_session(models: Models) -> Session:
    """An empty session for ``models`` (with the drafter's context when there is a drafter).

    Args:
        models: The loaded models.

    Returns:
        The session.
    """
    from .. import make_prompt_cache

    return Session(make_prompt_cache(models.model, drafter=models.drafter))


def session_metadata(session: Session, models: Models) -> Dict[str, str]:
    """The metadata a session file carries beside the cache.

    Args:
        session: The session.
        models: Its models.

    Returns:
        ``format``, ``model``, ``drafter``, ``tokens``, ``pending`` and ``turns``, as strings.
    """
    return {
        "format": SESSION_FORMAT,
        "model": models.model_name,
        "drafter": models.drafter_name or "",
        "tokens": json.dumps(session.tokens),
        "pending": json.dumps(session.pending),
        "turns": json.dumps(session.turns),
    }


def save_session(path: str, session: Session, models: Models) -> None:
    """Write the session to ``path`` (the cache snapshot plus :func:`session_metadata`).

    Args:
        path: The file to write.
        session: The session.
        models: Its models.
    """
    from ..cache import save_prompt_cache

    session.check()
    save_prompt_cache(path, session.cache, metadata=session_metadata(session, models))


def read_metadata(path: str) -> Dict[str, str]:
    """A session file's metadata, read from its header alone (no model needed).

    Args:
        path: The file.

    Returns:
        The metadata the file was saved with.

    Raises:
        FileNotFoundError: no such file.
        ValueError: not a session or prompt-cache file of these tools.
    """
    file = Path(path)
    if not file.is_file():
        raise FileNotFoundError(f"{path}: no such file")
    try:
        with file.open("rb") as handle:
            size = int.from_bytes(handle.read(8), "little")
            if size > MAX_HEADER_BYTES:
                raise ValueError("header too large")
            header = json.loads(handle.read(size).decode("utf-8"))
        stored = header.get("__metadata__") or {}
    except (OSError, ValueError, AttributeError):
        stored = {}
    metadata = {
        key[len(USER_PREFIX) :]: value
        for key, value in stored.items()
        if isinstance(key, str) and key.startswith(USER_PREFIX)
    }
    if metadata.get("format") != SESSION_FORMAT:
        raise ValueError(f"{path} is not a dflash session or prompt-cache file")
    return metadata


def _shown(name: Optional[str]) -> str:
    return {None: "none", "": "none", DEMO_NAME: "the bundled demo pair"}.get(
        name, name
    )


def check_names(
    path: str, metadata: Dict[str, str], model_name: str, drafter_name: Optional[str]
) -> None:
    """Refuse a file made with another model or drafter, by name.

    Args:
        path: The file (for the message).
        metadata: Its metadata.
        model_name: The name of the model it would be used with (:attr:`Models.model_name`).
        drafter_name: The drafter's, or ``None``.

    Raises:
        ValueError: naming what the file was made with.
    """
    for what, recorded, ours in (
        ("model", metadata.get("model"), model_name),
        ("drafter", metadata.get("drafter") or None, drafter_name),
    ):
        if recorded != ours:
            raise ValueError(
                f"{path} was made with {what} {_shown(recorded)}, not {_shown(ours)}"
            )


def _token_list(path: str, metadata: Dict[str, str], key: str) -> List[int]:
    try:
        value = json.loads(metadata.get(key, "[]"))
    except ValueError:
        value = None
    if not isinstance(value, list) or not all(
        type(item) is int and item >= 0 for item in value
    ):
        raise ValueError(f"{path}: metadata {key!r} is not a list of token ids")
    return value


def _turns(path: str, metadata: Dict[str, str], tokens: int) -> List[Tuple[int, int]]:
    try:
        turns = json.loads(metadata.get("turns", "[]"))
    except ValueError:
        turns = None
    pairs = isinstance(turns, list) and all(
        isinstance(turn, list)
        and len(turn) == 2
        and all(type(n) is int and n >= 0 for n in turn)
        for turn in turns
    )
    if not pairs or sum(sum(turn) for turn in turns) > tokens:
        raise ValueError(f"{path}: metadata 'turns' does not fit its tokens")
    return [tuple(turn) for turn in turns]


def load_session(path: str, models: Models) -> Session:
    """A session continued from a file of these tools, refused if made for another model or
    drafter (by name, before the cache is read) or if anything in it is off.

    Args:
        path: The file.
        models: The loaded models.

    Returns:
        The session, its cache freshly built from the file (the live state is untouched by a
        refused file).
    """
    from ..cache import CacheError, load_prompt_cache

    check_names(path, read_metadata(path), models.model_name, models.drafter_name)
    try:
        cache, metadata = load_prompt_cache(
            path, models.model, return_metadata=True, drafter=models.drafter
        )
    except CacheError as error:
        text = str(error)
        raise ValueError(
            text if text.startswith(str(path)) else f"{path}: {text}"
        ) from error
    check_names(path, metadata, models.model_name, models.drafter_name)
    tokens = _token_list(path, metadata, "tokens")
    session = Session(
        cache,
        tokens,
        _token_list(path, metadata, "pending"),
        _turns(path, metadata, len(tokens)),
    )
    try:
        session.check()
    except RuntimeError as error:
        raise ValueError(f"{path}: {error}") from None
    return session
