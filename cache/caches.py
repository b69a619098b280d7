"""Drop-in mlx-lm cache classes built on KV planes.

mlx-lm's model files call ``cache.offset`` (for RoPE, before writing), ``cache.make_mask(N, ...)``
(once per layer type, before any layer runs) and ``cache.update_and_fetch(keys, values)``. The
classes here answer those calls from a plane, so mlx-lm's own models run unchanged.
"""

import functools
from typing import Optional, Tuple

import mlx.core as mx
import numpy as np
from mlx_lm.models.base import create_causal_mask
from mlx_lm.models.cache import create_attention_mask

from .errors import CacheError, RollbackError
from .plane import GrowingPlane, RingPlane, kv_halves

_META_FIELDS = (
    "window",
    "max_context",
    "capacity",
    "len",
    "origin_logical",
    "origin_physical",
    "head_major",
    "layer",
)


def _encode(value) -> str:
    return "None" if value is None else str(int(value))


def _decode(text: str):
    return None if text == "None" else int(text)


# Verify blocks are small; prefill chunks (thousands of queries) are not memoised.
_MEMO_QUERIES = 64


def staged_window_mask(query_count: int, old_len: int, window: int) -> mx.array:
    """Mask of a staged chunk over ``[old live rows ‖ chunk rows]``.

    Query ``i`` (at logical index ``old_len + i`` of the shadow) may see shadow column ``j``
    iff ``old_len + i - window + 1 <= j <= old_len + i``: keys in ``[p + i - W + 1, p + i]``,
    mlx-lm's window semantics. Built on the host; for verify-sized chunks it is memoised, so
    every round of a full ring reuses one uploaded mask instead of launching six ops a forward
    (an ``mx.array`` is immutable, so sharing it is safe).

    Returns:
        A boolean array of shape ``(query_count, old_len + query_count)``.
    """
    if query_count <= _MEMO_QUERIES:
        return _memo_window_mask(query_count, old_len, window)
    return _window_mask(query_count, old_len, window)


def _window_mask(query_count: int, old_len: int, window: int) -> mx.array:
    query = np.arange(old_len, old_len + query_count)[:, None]
    key = np.arange(old_len + query_count)[None]
    return mx.array((key <= query) & (key > query - window))


_memo_window_mask = functools.lru_cache(maxsize=16)(_window_mask)


class _CacheProtocol:
    """The parts of mlx-lm's cache protocol that rings and growing planes share (a mixin)."""

    def size(self) -> int:
        return self.len

    def empty(self) -> bool:
        return self.kv is None

    @property
    def state(self):
        if self.kv is None:
            return []
        return self.keys, self.values

    @state.setter
    def state(self, value) -> None:
        if not value:
            self.set_buffers(None, None)
            return
        self.set_buffers(*value)

    @property
    def meta_state(self) -> Tuple[str, ...]:
        return tuple(_encode(getattr(self, name)) for name in _META_FIELDS)

    @meta_state.setter
    def meta_state(self, value) -> None:
        if len(value) != len(_META_FIELDS):
            raise CacheError(
                f"{type(self).__name__} meta_state needs {len(_META_FIELDS)} fields, "
                f"got {len(value)}"
            )
        for name, text in zip(_META_FIELDS, value):
            setattr(self, name, _decode(text))
        self.head_major = bool(self.head_major)

    @classmethod
    def from_state(cls, state, meta_state):
        """Rebuild a cache from ``state`` and ``meta_state`` (as mlx-lm's caches do)."""
        obj = cls.__new__(cls)
        obj.init_runtime()
        obj.meta_state = meta_state
        obj.state = state
        return obj

    def is_trimmable(self) -> bool:
        # Trimming is exact only while no row has been evicted from the window.
        return self.origin_logical == 0 and not self.checkpointed

    def trim(self, n: int) -> int:
        """Drop the newest ``n`` rows; refuses (raises) where that cannot be exact."""
        if not self.is_trimmable():
            raise RollbackError(
                f"layer {self.layer}: cannot trim a ring whose window has advanced "
                f"(origin_logical={self.origin_logical}); use SpeculativeCheckpoint"
            )
        n = min(self.len, n)
        self.len -= n
        return n


class RingKVCache(RingPlane, _CacheProtocol):
    """Sliding-window layer cache: a ring of ``min(window, max_context)`` rows.

    Multi-token chunks that would overwrite live rows are *staged*: attention runs over
    ``[old live rows in time order ‖ chunk]`` with a per-query window mask, and only then are
    the rows committed to the ring, which never holds more than its capacity.

    Args:
        window: The layer's sliding window (mlx-lm's ``max_size``).
        max_context: Largest context the cache accepts (``None``: unbounded).
        layer: Layer index, used in error messages.
        use_kernel: Custom-kernel switch of the staging shadow (``None``: the backend's
            default, see :mod:`dflash.metal.backend`).
    """

    def __init__(
        self,
        window: int,
        max_context: Optional[int] = None,
        layer: Optional[int] = None,
        use_kernel: Optional[bool] = None,
    ):
        super().__init__(window, max_context, layer=layer, use_kernel=use_kernel)

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        """Store a chunk and return the keys/values its queries attend to.

        A staged chunk returns its staging shadow (the guard decides whether the ring is
        written now or, under a checkpoint, at commit).

        Shapes:
            keys, values: ``(B, H, S, D)``.
        """
        if self.is_staged(keys.shape[2]):
            return kv_halves(self.stage(keys, values))
        self.write(self.offset, keys, values)
        return self.attention_rows()

    def make_mask(
        self, N: int, window_size: Optional[int] = None, return_array: bool = False
    ):
        """The mask matching what ``update_and_fetch`` will return for ``N`` queries."""
        if window_size is not None and window_size != self.window:
            raise CacheError(
                f"layer {self.layer}: mask asked for window {window_size} but the ring "
                f"was built for window {self.window}"
            )
        if N == 1:
            # One query sees every row the ring returns: they are exactly its window.
            return None
        if self.is_staged(N):
            return staged_window_mask(N, self.len, self.window)
        if return_array:
            return create_causal_mask(N, self.len)
        return "causal"


class GrowingKVCache(GrowingPlane, _CacheProtocol):
    """Full-attention layer cache: rows from position 0, storage grown in chunks.

    Args:
        max_context: Largest context the cache accepts (``None``: unbounded).
        layer: Layer index, used in error messages.
        use_kernel: Accepted for symmetry with :class:`RingKVCache` (a growing plane never
            stages, so it launches no custom kernel).
    """

    def __init__(
        self,
        max_context: Optional[int] = None,
        layer: Optional[int] = None,
        use_kernel: Optional[bool] = None,
    ):
        super().__init__(max_context, layer=layer, use_kernel=use_kernel)

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        """Append a chunk and return every row so far.

        Shapes:
            keys, values: ``(B, H, S, D)``.
        """
        self.write(self.offset, keys, values)
        return self.attention_rows()

    def make_mask(
        self, N: int, window_size: Optional[int] = None, return_array: bool = False
    ):
        """The mask matching what ``update_and_fetch`` will return for ``N`` queries."""
        return create_attention_mask(
            N, offset=self.offset, return_array=return_array, window_size=window_size
        )
