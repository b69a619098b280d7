"""Drop-in mlx-lm cache classes built on KV planes.

mlx-lm's model files call ``cache.offset`` (for RoPE, before writing), ``cache.make_mask(N, ...)``
(once per layer type, before any layer runs) and ``cache.update_and_fetch(keys, values)``. The
classes here answer those calls from a plane, so mlx-lm's own models run unchanged.
"""

import functools
from typing import Any, Optional, Tuple

import mlx.core as mx
import numpy as np
from mlx_lm.models.base import create_causal_mask
from mlx_lm.models.cache import create_attention_mask

from . import gate
from .errors import CacheError, RollbackError, SnapshotError
from .plane import GrowingPlane, RingPlane, kv_halves

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


def bucketed_mask(
    query_count: int, first: int, key_rows: int, window: Optional[int] = None
) -> mx.array:
    """Mask of a chunk attended over bucketed keys (see ``plane.resolve_bucket_keys``).

    Query ``i`` sits at row ``first + i`` of keys that start at row 0; it may see row ``j``
    iff ``j <= first + i`` (and ``j > first + i - window`` with a window), so the rows past
    the newest live one (the bucket's padding) are hidden. The bounds change every round,
    so the mask is built on the device (two ``arange`` and a compare, as mlx-lm's own
    causal mask): no upload, no host sync.

    Returns:
        A boolean array of shape ``(query_count, key_rows)``.
    """
    query = mx.arange(first, first + query_count)[:, None]
    key = mx.arange(key_rows)[None]
    visible = key <= query
    if window is not None:
        visible = visible & (key > query - window)
    return visible


class _CacheProtocol:
    """The parts of mlx-lm's cache protocol that rings and growing planes share (a mixin)."""

    def size(self) -> int:
        return self.len

    def empty(self) -> bool:
        return self.kv is None

    @property
    def state(self) -> Tuple[Any, ...]:
        """mlx-lm's state: the storage as it sits and every bookkeeping field.

        ``(keys, values, encoding, window, max_context, capacity, len, origin_logical,
        origin_physical, head_major, layer)``: a ring's buffers keep their rotation, so the
        state replays bitwise. ``keys`` / ``values`` are views of the storage (``None`` while
        empty); ``encoding`` is ``"dflash-plane-v1"``. Self-contained, so mlx-lm's
        ``save_prompt_cache`` keeps every field.
        """
        self.settle()
        pair = (None, None) if self.kv is None else kv_halves(self.kv)
        return pair + (gate.STATE_ENCODING,) + tuple(self._meta_fields().values())

    @state.setter
    def state(self, value) -> None:
        """Install a state (fail-closed: the gate checks it all before anything changes)."""
        self._refuse_under_checkpoint("state")
        keys, values, meta = gate.parse_state(value, self.where())
        self._check_state(keys, values, meta)
        self._install(keys, values, meta)

    @property
    def meta_state(self) -> Tuple[str, ...]:
        """The bookkeeping as strings (mlx-lm's older protocol), in ``state`` order."""
        return gate.encode_meta_state(self._meta_fields())

    @meta_state.setter
    def meta_state(self, value) -> None:
        """Replace the bookkeeping; refused unless it fits the buffers the plane holds."""
        self._refuse_under_checkpoint("meta_state")
        meta = gate.decode_meta_state(value, self.where())
        keys, values = (None, None) if self.kv is None else kv_halves(self.kv)
        self._check_state(keys, values, meta)
        self._install_meta(meta)

    @classmethod
    def from_state(cls, state, meta_state=None):
        """Rebuild a cache from ``state`` (mlx-lm's protocol), through the gate.

        Args:
            state: A ``state`` tuple of this class (see :attr:`state`).
            meta_state: Optional ``meta_state`` strings (the older protocol); when given they
                must agree with the state's bookkeeping field by field.

        Returns:
            A new cache holding the state's buffers and bookkeeping.
        """
        keys, values, meta = gate.parse_state(state, "layer ?")
        obj = cls.__new__(cls)
        obj.init_runtime()
        obj._check_state(keys, values, meta)
        if meta_state is not None:
            where = gate.where_layer(meta["layer"])
            told = gate.decode_meta_state(meta_state, where)
            for name in gate.META_FIELDS:
                gate.check_same(
                    where, name, told[name], meta[name], "meta_state vs state"
                )
        obj._install(keys, values, meta)
        return obj

    def _meta_fields(self) -> dict:
        return {name: getattr(self, name) for name in gate.META_FIELDS}

    def _refuse_under_checkpoint(self, field: str) -> None:
        if self.checkpointed:
            raise SnapshotError(
                self.where(),
                field,
                "cannot be replaced while a speculative checkpoint is open",
            )

    def _check_state(self, keys, values, meta: dict) -> None:
        where = gate.where_layer(meta.get("layer"))
        self.check_meta(meta, where)
        if meta["head_major"] is not True:
            raise SnapshotError(where, "head_major", "mlx-lm caches are head-major")
        gate.check_buffers(meta, keys, values, where)

    def _install(self, keys, values, meta: dict) -> None:
        self.set_buffers(keys, values)
        self._install_meta(meta)

    def _install_meta(self, meta: dict) -> None:
        for name in gate.META_FIELDS:
            setattr(self, name, meta[name])

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
        bucket_keys: Bucketed-keys switch while the ring is not yet full (``None``: the
            default, see :func:`~dflash.cache.plane.resolve_bucket_keys`).
    """

    def __init__(
        self,
        window: int,
        max_context: Optional[int] = None,
        layer: Optional[int] = None,
        use_kernel: Optional[bool] = None,
        bucket_keys: Optional[bool] = None,
    ):
        super().__init__(
            window,
            max_context,
            layer=layer,
            use_kernel=use_kernel,
            bucket_keys=bucket_keys,
        )

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        """Store a chunk and return the keys/values its queries attend to.

        A staged chunk returns its staging shadow (the guard decides whether the ring is
        written now or, under a checkpoint, at commit). With bucketed keys, a ring not yet
        full returns its rows up to the end of the bucket (``key_rows``).

        Shapes:
            keys, values: ``(B, H, S, D)``.
        """
        count = keys.shape[2]
        if self.is_staged(count):
            return kv_halves(self.stage(keys, values))
        rows = self.key_rows(count) if self.bucketed(count) else None
        self.write(self.offset, keys, values)
        return self.attention_rows() if rows is None else self.prefix_rows(rows)

    def update_and_fetch_block(self, kv: mx.array, fetch: bool = True):
        """:meth:`update_and_fetch` of a chunk whose keys and values come stacked.

        Args:
            kv: The chunk's keys and values stacked (the plane's layout).
            fetch: False: return None wherever every row the chunk's queries read
                stays in the plane's buffer or a checkpoint's held-back block (what
                the kernel route reads in place), so no rows are gathered for a
                caller that will not read them; the rows otherwise (a staged chunk
                stored at once, a plane without a buffer).

        Shapes:
            kv: ``(2, B, H, S, D)``.
        """
        count = kv.shape[self.kv_axis] if kv.ndim == 5 else 0
        if self.is_staged(count):
            staged = self.stage_block(kv, shadow=fetch)
            return None if staged is None else kv_halves(staged)
        rows = self.key_rows(count) if self.bucketed(count) else None
        self.write_block(self.offset, kv)
        if not fetch and self.kv is not None:
            return None
        return self.attention_rows() if rows is None else self.prefix_rows(rows)

    def make_mask(
        self, N: int, window_size: Optional[int] = None, return_array: bool = False
    ):
        """The mask matching what ``update_and_fetch`` will return for ``N`` queries."""
        if window_size is not None and window_size != self.window:
            raise CacheError(
                f"layer {self.layer}: mask asked for window {window_size} but the ring "
                f"was built for window {self.window}"
            )
        if self.bucketed(N):
            return bucketed_mask(N, self.len, self.key_rows(N), self.window)
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
        bucket_keys: Bucketed-keys switch (``None``: the default, see
            :func:`~dflash.cache.plane.resolve_bucket_keys`).
    """

    def __init__(
        self,
        max_context: Optional[int] = None,
        layer: Optional[int] = None,
        use_kernel: Optional[bool] = None,
        bucket_keys: Optional[bool] = None,
    ):
        super().__init__(
            max_context, layer=layer, use_kernel=use_kernel, bucket_keys=bucket_keys
        )

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        """Append a chunk and return every row so far.

        With bucketed keys the rows run on to the end of the bucket (``key_rows``); the
        mask from :meth:`make_mask` hides the padding.

        Shapes:
            keys, values: ``(B, H, S, D)``.
        """
        rows = self.key_rows(keys.shape[2])
        self.write(self.offset, keys, values)
        return self.prefix_rows(rows)

    def update_and_fetch_block(self, kv: mx.array, fetch: bool = True):
        """:meth:`update_and_fetch` of a chunk whose keys and values come stacked.

        Args:
            kv: The chunk's keys and values stacked (the plane's layout).
            fetch: False: return None once the rows are in the buffer (the kernel
                route reads them in place).

        Shapes:
            kv: ``(2, B, H, S, D)``.
        """
        rows = self.key_rows(kv.shape[self.kv_axis]) if kv.ndim == 5 else 0
        self.write_block(self.offset, kv)
        if not fetch and self.kv is not None:
            return None
        return self.prefix_rows(rows)

    def make_mask(
        self, N: int, window_size: Optional[int] = None, return_array: bool = False
    ):
        """The mask matching what ``update_and_fetch`` will return for ``N`` queries."""
        if self.bucketed(N):
            return bucketed_mask(N, self.offset, self.key_rows(N), window_size)
        return create_attention_mask(
            N, offset=self.offset, return_array=return_array, window_size=window_size
        )
