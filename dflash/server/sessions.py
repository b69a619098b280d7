"""Sessions the server keeps between requests, and how a request picks one.

A session is a prompt cache (the target's planes, a classic draft model's planes after them,
and with DFlash the drafter's context) plus the tokens it holds. A request reuses the session
with the longest usable prefix of its prompt and prefills only the rest:

* **extend**: the session's tokens are a proper prefix of the prompt; it continues in place.
* **fork**: a session shares a prefix with the prompt and can be trimmed back to it (no sliding
  window has advanced): a copy of it, trimmed, becomes the staging session. The original stays
  as it was, so another conversation that shares only a system prompt does not evict it.
* **rebuild**: anything else: an empty staging session.

A staging session (fork or rebuild) replaces its predecessor, or joins the pool, with one
assignment, and only once its prefill succeeded (see :meth:`SessionPool.install`); a failure or a
disconnect before that leaves every live session bit-identical. A staging session built for a
request whose policy dropped more than its base session's context did (a shift) advances the
context epoch; rebuilding the same window (e.g. after a reply re-tokenized differently) does not.
"""

import copy
import time
from dataclasses import dataclass, field
from typing import Any, Callable, List, Optional, Sequence

EXTEND = "extend"
FORK = "fork"
REBUILD = "rebuild"
STAGED = (FORK, REBUILD)


@dataclass(eq=False)  # sessions are compared by identity
class Session:
    """A prompt cache and the tokens it holds.

    Attributes:
        cache: The prompt cache (``dflash.cache.PromptCache``).
        tokens: The tokens the cache holds, in order.
        epoch: Context shifts this conversation has gone through.
        dropped: What the context policy left out of the request it holds (oldest chat turns
            or middle raw tokens; 0: nothing).
        used: When a request last used it (``time.monotonic``).
    """

    cache: Any
    tokens: List[int] = field(default_factory=list)
    epoch: int = 0
    dropped: int = 0
    used: float = field(default_factory=time.monotonic)


@dataclass
class Plan:
    """How one request uses the sessions.

    Attributes:
        kind: ``"extend"``, ``"fork"`` or ``"rebuild"``.
        session: The session generation runs in (the staging one for a fork or rebuild).
        reuse: Prompt tokens already in the cache (not prefilled again).
        replaces: For a staging session, the live session it replaces on success
            (``None``: it is added as a new conversation).
        shifted: Whether this plan moved the context window (advanced the epoch).
    """

    kind: str
    session: Session
    reuse: int
    replaces: Optional[Session] = None
    shifted: bool = False


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix of two token sequences."""
    count = 0
    for x, y in zip(a, b):
        if x != y:
            break
        count += 1
    return count


def _parts(cache) -> List[Any]:
    """Everything of a cache that has a position: its planes and a drafter context."""
    context = getattr(cache, "drafter_context", None)
    return list(cache) + ([context] if context is not None else [])


def positions(cache) -> List[int]:
    """The position of every plane (and of the drafter context) of a cache."""
    return [part.offset for part in _parts(cache)]


def trimmable(cache) -> bool:
    """Whether every part of a cache can drop its newest rows exactly."""
    for part in _parts(cache):
        check = getattr(part, "is_trimmable", None)
        if check is None or not callable(getattr(part, "trim", None)) or not check():
            return False
    return True


def trim_to(cache, position: int) -> None:
    """Trim every part of a (trimmable) cache back to ``position``."""
    for part in _parts(cache):
        if part.offset > position:
            part.trim(part.offset - position)


def fork(cache):
    """An independent copy of a cache (planes rebuilt from their state, as mlx-lm copies)."""
    planes = []
    for plane in cache:
        clone = type(plane).from_state(plane.state, plane.meta_state)
        clone.use_kernel = getattr(plane, "use_kernel", None)
        planes.append(clone)
    clone = copy.copy(cache)
    clone[:] = planes
    context = getattr(cache, "drafter_context", None)
    if context is not None:
        clone.drafter_context = copy.deepcopy(context)
    return clone


def materialize(cache) -> None:
    """Evaluate every array a cache holds, so no lazy graph outlives the generation that made it
    (arrays are bound to the thread that built them; only then can another thread read them).
    """
    import mlx.core as mx

    arrays = []
    for part in _parts(cache):
        for holder in [part, *(getattr(part, "planes", None) or [])]:
            arrays += [v for v in vars(holder).values() if isinstance(v, mx.array)]
    mx.eval(arrays)


def nbytes(cache) -> int:
    """Bytes held by a cache (planes and drafter context)."""
    return sum(int(getattr(part, "nbytes", 0) or 0) for part in _parts(cache))


class SessionPool:
    """The worker's sessions, least recently used first; only the worker thread touches it.

    Args:
        new_cache: Builds an empty prompt cache for the served models.
        capacity: Sessions kept at most (``--prompt-cache-size``).
        max_bytes: Bytes of cache kept at most (``--prompt-cache-bytes``; ``None``: no limit).
    """

    def __init__(
        self,
        new_cache: Callable[[], Any],
        capacity: int,
        max_bytes: Optional[int] = None,
    ):
        if capacity < 1:
            raise ValueError(
                f"the prompt cache must hold at least 1 session, got {capacity}"
            )
        self.new_cache = new_cache
        self.capacity = capacity
        self.max_bytes = max_bytes
        self.sessions: List[Session] = []

    def __len__(self) -> int:
        return len(self.sessions)

    def plan(self, tokens: Sequence[int], dropped: int = 0) -> Plan:
        """Pick how a prompt uses the sessions (no live session is modified).

        Args:
            tokens: The retained prompt.
            dropped: What the policy left out of the request to get ``tokens`` (0: nothing).

        Returns:
            The plan; for a fork or a rebuild its session is a new staging session.
        """
        extend, extend_reuse = None, 0
        source, fork_reuse = None, 0
        for session in reversed(self.sessions):  # most recent first wins ties
            held = len(session.tokens)
            shared = common_prefix(session.tokens, tokens)
            if shared == held and extend_reuse < held < len(tokens):
                extend, extend_reuse = session, held
            # At least one prompt token must be left to feed.
            usable = min(shared, len(tokens) - 1)
            if usable > fork_reuse and trimmable(session.cache):
                source, fork_reuse = session, usable
        if extend is not None and extend_reuse >= fork_reuse:
            extend.dropped = dropped
            return Plan(EXTEND, extend, extend_reuse)
        replaces = self._predecessor(tokens) if dropped else None
        base = source if source is not None else replaces
        shifted = dropped > (base.dropped if base is not None else 0)
        epoch = (base.epoch if base is not None else 0) + int(shifted)
        if source is not None:
            cache = fork(source.cache)
            trim_to(cache, fork_reuse)
            staging = Session(cache, list(tokens[:fork_reuse]), epoch, dropped)
            return Plan(FORK, staging, fork_reuse, replaces, shifted)
        staging = Session(self.new_cache(), [], epoch, dropped)
        return Plan(REBUILD, staging, 0, replaces, shifted)

    def _predecessor(self, tokens: Sequence[int]) -> Optional[Session]:
        """The session a shifted conversation continues: the longest common prefix."""
        best, shared = None, 0
        for session in reversed(self.sessions):
            length = common_prefix(session.tokens, tokens)
            if length > shared:
                best, shared = session, length
        return best

    def install(self, plan: Plan) -> None:
        """Publish a rebuilt session: one assignment replaces its predecessor.

        Called only after the staging prefill succeeded. Evicts least recently used sessions
        beyond the pool's limits (never the one just installed).
        """
        staging = plan.session
        if plan.replaces is not None and plan.replaces in self.sessions:
            self.sessions[self.sessions.index(plan.replaces)] = staging
        else:
            self.sessions.append(staging)
        self.touch(staging)
        self._evict(keep=staging)

    def touch(self, session: Session) -> None:
        """Mark a session most recently used."""
        session.used = time.monotonic()
        if session in self.sessions:
            self.sessions.remove(session)
            self.sessions.append(session)

    def _evict(self, keep: Session) -> None:
        while len(self.sessions) > self.capacity:
            self._drop_oldest(keep)
        if self.max_bytes is not None:
            while len(self.sessions) > 1 and self.nbytes > self.max_bytes:
                self._drop_oldest(keep)

    def _drop_oldest(self, keep: Session) -> None:
        for session in self.sessions:
            if session is not keep:
                self.sessions.remove(session)
                return

    @property
    def nbytes(self) -> int:
        """Bytes held by all sessions."""
        return sum(nbytes(session.cache) for session in self.sessions)

    def drop(self, session: Session) -> None:
        """Forget a session (its cache no longer matches any known tokens)."""
        if session in self.sessions:
            self.sessions.remove(session)

    def settle(self, session: Session, sequence: Sequence[int]) -> bool:
        """Record what a session holds after a generation; drop it when that is unknowable.

        After a generation the cache holds a prefix of ``prompt + emitted tokens``. Parts left at
        different positions are trimmed back to the lowest where possible.

        Args:
            session: The session generation ran in.
            sequence: Every token of the session's context: prompt then emitted tokens.

        Returns:
            Whether the session was kept.
        """
        found = positions(session.cache)
        position = min(found) if found else 0
        if len(set(found)) > 1:
            if not trimmable(session.cache):
                self.drop(session)
                return False
            trim_to(session.cache, position)
        if position > len(sequence):
            self.drop(session)
            return False
        session.tokens = list(sequence[:position])
        materialize(session.cache)
        self._drop_implied(session)
        return True

    def _drop_implied(self, session: Session) -> None:
        """Drop sessions whose tokens a trimmable ``session`` also holds (a fork recreates them)."""
        if session not in self.sessions or not trimmable(session.cache):
            return
        held = session.tokens
        for other in list(self.sessions):
            if other is not session and common_prefix(other.tokens, held) == len(
                other.tokens
            ):
                self.sessions.remove(other)
