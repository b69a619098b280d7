"""Reference oracles: float32, full history, the window applied as a mask.

The production planes keep a rotated ring of ``window`` rows; the oracle keeps every row ever
written, in time order, and expresses the sliding window only in the attention mask. The two
share no code path, which is what makes the oracle worth comparing against.
"""

from typing import Optional, Tuple

import mlx.core as mx
from mlx_lm.models.cache import create_attention_mask

from dflash.cache.errors import SnapshotError


def window_mask(
    query_positions: mx.array, key_positions: mx.array, window: Optional[int]
):
    """Boolean mask: query at ``p`` sees key at ``k`` iff ``p - window < k <= p``.

    Shapes:
        query_positions: ``(Q,)``; key_positions: ``(K,)``; returns ``(Q, K)``.
    """
    query = query_positions[:, None]
    key = key_positions[None]
    visible = key <= query
    if window is not None:
        visible = visible & (key > query - window)
    return visible


def reference_attention(
    queries: mx.array,
    keys: mx.array,
    values: mx.array,
    query_positions: mx.array,
    window: Optional[int],
    scale: float,
) -> mx.array:
    """Attention of ``queries`` over the full history in float32, windowed by a mask.

    Args:
        queries: Queries at absolute positions ``query_positions``.
        keys: Every key from position 0, in time order.
        values: Every value from position 0, in time order.
        query_positions: Absolute position of each query.
        window: Sliding window (``None``: full attention).
        scale: Score scale.

    Shapes:
        queries: ``(B, Hq, Q, D)``; keys, values: ``(B, Hkv, K, D)``; returns ``(B, Hq, Q, D)``.
    """
    queries, keys, values = (a.astype(mx.float32) for a in (queries, keys, values))
    repeats = queries.shape[1] // keys.shape[1]
    if repeats > 1:
        keys = mx.repeat(keys, repeats, axis=1)
        values = mx.repeat(values, repeats, axis=1)
    scores = (queries * scale) @ keys.swapaxes(-1, -2)
    mask = window_mask(query_positions, mx.arange(keys.shape[2]), window)
    scores = mx.where(mask, scores, mx.array(-mx.inf, mx.float32))
    return mx.softmax(scores, axis=-1) @ values


class ReferenceKVCache:
    """A drop-in mlx-lm cache that keeps the full history and masks the window.

    Float32 throughout; never evicts a row. Its state's encoding (``"f32-full-history"``) is
    deliberately not the planes' (``"dflash-plane-v1"``): neither installs the other's state.

    Args:
        window: The layer's sliding window (``None`` for a full-attention layer).
    """

    encoding = "f32-full-history"

    def __init__(self, window: Optional[int] = None):
        self.window = window
        self.keys: Optional[mx.array] = None
        self.values: Optional[mx.array] = None
        self.offset = 0

    def update_and_fetch(
        self, keys: mx.array, values: mx.array
    ) -> Tuple[mx.array, mx.array]:
        """Append a chunk and return the whole history in float32.

        Shapes:
            keys, values: ``(B, H, S, D)``.
        """
        keys, values = keys.astype(mx.float32), values.astype(mx.float32)
        if self.keys is None:
            self.keys, self.values = keys, values
        else:
            self.keys = mx.concatenate([self.keys, keys], axis=2)
            self.values = mx.concatenate([self.values, values], axis=2)
        self.offset += keys.shape[2]
        return self.keys, self.values

    def make_mask(
        self, N: int, window_size: Optional[int] = None, return_array: bool = False
    ):
        """Causal mask over the full history, windowed when the layer slides."""
        window = window_size if window_size is not None else self.window
        if window is None:
            return create_attention_mask(
                N, offset=self.offset, return_array=return_array, window_size=None
            )
        positions = mx.arange(self.offset, self.offset + N)
        return window_mask(positions, mx.arange(self.offset + N), window)

    @property
    def state(self) -> Tuple:
        """``(keys, values, encoding, offset, window)``: the whole float32 history."""
        return (self.keys, self.values, self.encoding, self.offset, self.window)

    @classmethod
    def from_state(cls, state) -> "ReferenceKVCache":
        """Rebuild an oracle cache; refuses any state not in the oracle's encoding.

        Args:
            state: A ``state`` of a :class:`ReferenceKVCache`.

        Returns:
            A new oracle cache holding that history.
        """
        where = "reference cache"
        fields = len(state) if isinstance(state, (tuple, list)) else 0
        encoding = state[2] if fields >= 3 else None
        if not isinstance(encoding, str) or encoding != cls.encoding:
            raise SnapshotError(
                where,
                "encoding",
                f"{encoding!r} is not the oracle's {cls.encoding!r}; the oracle and the "
                "dflash planes cannot install each other's state",
            )
        if fields != 5:
            raise SnapshotError(where, "state", f"has {fields} fields, the oracle's 5")
        keys, values, _, offset, window = state
        if window is not None and (not isinstance(window, int) or window < 1):
            raise SnapshotError(
                where, "window", f"must be None or >= 1, got {window!r}"
            )
        if keys is None or values is None:
            if keys is not values or offset != 0:
                raise SnapshotError(where, "keys", "missing for a non-empty history")
        elif (
            not isinstance(keys, mx.array)
            or not isinstance(values, mx.array)
            or keys.ndim != 4
            or keys.dtype != mx.float32
            or values.shape != keys.shape
            or values.dtype != mx.float32
        ):
            raise SnapshotError(where, "keys", "must be float32 (B, H, T, D) K and V")
        elif keys.shape[2] != offset:
            raise SnapshotError(
                where,
                "offset",
                f"is {offset!r} but the history holds {keys.shape[2]} rows",
            )
        cache = cls(window)
        cache.keys, cache.values, cache.offset = keys, values, offset
        return cache

    def size(self) -> int:
        return self.offset

    def empty(self) -> bool:
        return self.keys is None

    def is_trimmable(self) -> bool:
        return True

    def trim(self, n: int) -> int:
        n = min(self.offset, n)
        self.offset -= n
        if self.keys is not None:
            self.keys = self.keys[:, :, : self.offset]
            self.values = self.values[:, :, : self.offset]
        return n

    @property
    def nbytes(self) -> int:
        return 0 if self.keys is None else self.keys.nbytes + self.values.nbytes


def make_reference_cache(model) -> list:
    """One :class:`ReferenceKVCache` per layer, windowed where the model's own cache rotates."""
    from mlx_lm.models.cache import RotatingKVCache

    template = (
        model.make_cache()
        if hasattr(model, "make_cache")
        else [None] * len(model.layers)
    )
    return [
        ReferenceKVCache(t.max_size if isinstance(t, RotatingKVCache) else None)
        for t in template
    ]
