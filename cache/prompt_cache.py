"""Build and check prompt caches of KV planes for mlx-lm models."""

from typing import Any, List, Optional, Sequence, Tuple

import mlx.nn as nn
from mlx_lm.models.cache import KVCache, RotatingKVCache

from .caches import GrowingKVCache, RingKVCache
from .errors import IncompatibleCache
from .plane import KvPlane


def model_type_of(model: nn.Module) -> Optional[str]:
    """The model's ``model_type`` (mlx-lm's models carry it), or ``None``."""
    for owner in (model, getattr(model, "args", None)):
        value = getattr(owner, "model_type", None)
        if isinstance(value, str):
            return value
    return None


def _model_template(model: nn.Module) -> List[Any]:
    """The caches the model itself asks for (mlx-lm's convention)."""
    if hasattr(model, "make_cache"):
        return model.make_cache()
    return [KVCache() for _ in model.layers]


class PromptCache(list):
    """A session's caches: the target's planes (one per layer, as a list) plus, with DFlash,
    the drafter's context at the same position.

    It is a ``list`` so mlx-lm code that indexes or iterates a prompt cache runs unchanged.

    Attributes:
        drafter_context: The DFlash drafter's context (``drafter.make_context()``), or
            ``None`` when the cache serves plain or classic speculative decoding.
    """

    def __init__(self, planes=(), drafter_context: Optional[Any] = None):
        super().__init__(planes)
        self.drafter_context = drafter_context


def make_prompt_cache(
    model: nn.Module,
    drafter: Optional[Any] = None,
    max_context: Optional[int] = None,
    use_kernel: Optional[bool] = None,
    bucket_keys: Optional[bool] = None,
) -> PromptCache:
    """Construct the model's cache out of KV planes.

    A ring is built wherever the model's own ``make_cache()`` asks for a ``RotatingKVCache``
    and a growing plane wherever it asks for a ``KVCache``. Any other cache type (quantized,
    recurrent state, a ring with ``keep > 0``) cannot be rolled back exactly and is refused.

    Args:
        model: An mlx-lm model.
        drafter: A DFlash drafter bound to ``model``: the cache then also carries its
            (empty) context, so DFlash generation can continue the session turn after turn.
        max_context: Largest context the cache accepts; ``None`` means unbounded. A ring's
            capacity is ``min(window, max_context)``.
        use_kernel: The planes' custom-kernel switch: ``False`` / ``True`` force the pure-MLX
            reference / the kernels; ``None`` takes the backend's default (see
            :mod:`dflash.metal.backend`).
        bucket_keys: Whether small forwards (verify blocks, decode steps) attend over key
            lengths rounded up to whole buckets, with a mask, in the planes and the
            drafter's context; ``None``: on with CUDA only (why:
            :func:`dflash.cache.plane.resolve_bucket_keys`).

    Returns:
        One cache per layer, drop-in for mlx-lm's.
    """
    if drafter is not None and not callable(getattr(drafter, "make_context", None)):
        raise TypeError(
            f"drafter must be a DFlash drafter (dflash.load_drafter), got "
            f"{type(drafter).__name__}; pass max_context by keyword"
        )
    caches = PromptCache(
        drafter_context=(
            drafter.make_context(bucket_keys=bucket_keys)
            if drafter is not None
            else None
        )
    )
    model_type = model_type_of(model)
    for layer, template in enumerate(_model_template(model)):
        if isinstance(template, RotatingKVCache):
            if template.keep:
                raise IncompatibleCache(
                    f"layer {layer} asks for a RotatingKVCache with keep={template.keep}; "
                    "dflash rings keep no attention-sink rows"
                )
            caches.append(
                RingKVCache(
                    template.max_size,
                    max_context,
                    layer=layer,
                    use_kernel=use_kernel,
                    bucket_keys=bucket_keys,
                )
            )
        elif type(template) is KVCache:
            caches.append(
                GrowingKVCache(
                    max_context,
                    layer=layer,
                    use_kernel=use_kernel,
                    bucket_keys=bucket_keys,
                )
            )
        else:
            raise IncompatibleCache(
                f"layer {layer} asks for a {type(template).__name__}, which dflash cannot "
                "roll back exactly"
            )
        caches[-1].model_type = model_type
    return caches


def _expected_row_shape(model: nn.Module):
    """``(n_kv_heads, head_dim)`` when the model advertises them, else ``None``."""
    heads = getattr(model, "n_kv_heads", None)
    head_dim = getattr(model, "head_dim", None)
    if isinstance(heads, int) and isinstance(head_dim, int):
        return heads, head_dim
    return None


def model_row_shape(model: nn.Module) -> Tuple[Optional[int], Optional[int]]:
    """``(KV heads, head dim)`` of the model's caches, each ``None`` where it is not known.

    From the model's ``n_kv_heads`` / ``head_dim`` attributes, else its ``args``'
    ``num_key_value_heads`` / ``head_dim``.
    """
    known = _expected_row_shape(model)
    if known:
        return known
    args = getattr(model, "args", None)
    heads = getattr(args, "num_key_value_heads", None)
    head_dim = getattr(args, "head_dim", None)
    return (
        heads if isinstance(heads, int) else None,
        head_dim if isinstance(head_dim, int) else None,
    )


def check_prompt_cache(
    model: nn.Module, prompt_cache: Sequence[Any], what: str = ""
) -> int:
    """Check that ``prompt_cache`` is a dflash cache built for ``model``; return its offset.

    Args:
        model: The model the cache is used with.
        prompt_cache: One cache per layer of ``model``.
        what: A name for the cache in error messages (e.g. ``"draft"``).

    Returns:
        The common absolute position of every plane.
    """
    name = f"{what} prompt cache" if what else "prompt cache"
    expected = make_prompt_cache(model, max_context=None)
    if len(prompt_cache) != len(expected):
        raise IncompatibleCache(
            f"{name} has {len(prompt_cache)} layers but the model has {len(expected)}"
        )
    row_shape = _expected_row_shape(model)
    for layer, (cache, want) in enumerate(zip(prompt_cache, expected)):
        if not isinstance(cache, KvPlane):
            raise IncompatibleCache(
                f"{name} layer {layer} is a {type(cache).__name__}; build the cache with "
                "dflash.cache.make_prompt_cache(model)"
            )
        if cache.window != want.window:
            raise IncompatibleCache(
                f"{name} layer {layer} has window {cache.window} but the model's layer has "
                f"window {want.window}; is this prompt cache from another model?"
            )
        if row_shape and cache.keys is not None:
            axis_heads = 1 if cache.head_major else 2
            got = (cache.keys.shape[axis_heads], cache.keys.shape[-1])
            if got != row_shape:
                raise IncompatibleCache(
                    f"{name} layer {layer} holds {got[0]} KV heads x {got[1]} dims but the "
                    f"model has {row_shape[0]} x {row_shape[1]}; is this prompt cache from "
                    "another model?"
                )
    offsets = {cache.offset for cache in prompt_cache}
    if len(offsets) > 1:
        raise IncompatibleCache(
            f"{name} layers are at different positions {sorted(offsets)}"
        )
    return offsets.pop() if offsets else 0
