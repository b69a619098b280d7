"""Hold the ``1 + weight`` scale of Gemma-style norms instead of adding it every call.

Gemma's RMSNorm (mlx-lm's ``gemma``, ``gemma2``, ``gemma3_text``, ``recurrent_gemma``)
and Muse Glimmer's ``CenteredRMSNorm`` compute ``mx.fast.rms_norm(x, 1.0 + self.weight,
eps)``: every call adds one to the weight again, one more graph node, Python op, kernel
launch and encode per norm. Muse Glimmer has four such norms a decoder layer (208 a
52-layer forward); Gemma 3 has six. Decoding is paced by the host on a fast GPU, so those
launches cost the round their host time.

:func:`held_norms` swaps each such norm's class (reversibly, as :mod:`dflash.taps`
does) for a subclass whose forward passes a held ``1.0 + weight``: the same op on the
same array, computed once (again if the weight array is replaced), so every output is
bit for bit what the norm's own forward gives. A class is swapped only after a probe
shows its forward equals the held form bit for bit (an mlx-lm whose norm computes
something else keeps its own forward). Leaving the ``with`` block restores every class
and drops the held arrays.

Switch: ``DFLASH_HELD_NORMS=0`` turns it off (default on, every backend: it only removes
an op).
"""

from __future__ import annotations

import contextlib
from typing import Dict, Iterator, List, Optional, Tuple

import mlx.core as mx
import mlx.nn as nn

from .metal import backend

HELD_NORMS_ENV = "DFLASH_HELD_NORMS"

# (module, class name) of mlx-lm norms whose forward is
# ``mx.fast.rms_norm(x, 1.0 + self.weight, self.eps)`` (read in mlx-lm 0.32.2).
OFFSET_NORM_CLASSES = frozenset(
    {
        ("mlx_lm.models.gemma", "RMSNorm"),
        ("mlx_lm.models.gemma2", "RMSNorm"),
        ("mlx_lm.models.gemma3_text", "RMSNorm"),
        ("mlx_lm.models.recurrent_gemma", "RMSNorm"),
        ("mlx_lm.models.muse_glimmer", "CenteredRMSNorm"),
    }
)

# Marks a held subclass; its value is the class it replaced.
_ORIGINAL_CLASS = "_dflash_held_norm_original_class"
# The held ``(weight, 1.0 + weight)`` pair of one norm (plain attribute while installed).
_HELD = "_dflash_held_scale"


def held_norms_wanted(use_held: Optional[bool] = None) -> bool:
    """Whether :func:`held_norms` installs: ``use_held`` decides, else
    ``DFLASH_HELD_NORMS`` (read as the other ``DFLASH_*`` switches), else on.

    Raises:
        ValueError: ``DFLASH_HELD_NORMS`` is set to something that is not a switch value.
    """
    return backend.strict_switch(HELD_NORMS_ENV, use_held)


def _held_call(self: nn.Module, x: mx.array) -> mx.array:
    """The norm's forward with its ``1.0 + weight`` computed once per weight array.

    Shapes: x ``(..., D)``; returns ``(..., D)``.
    """
    weight = self.weight
    held = self.__dict__[_HELD]  # set by HeldNorms.install before the class swap
    if held[0] is not weight:
        held = self.__dict__[_HELD] = (weight, 1.0 + weight)
    return mx.fast.rms_norm(x, held[1], self.eps)


_HELD_CLASSES: Dict[type, type] = {}
# The probe's verdict per (norm class, weight dtype): a class's forward does not change
# while the process runs, so each generation need not evaluate the probe again.
_VERDICTS: Dict[Tuple[type, mx.Dtype], bool] = {}


def _held_class(base: type) -> type:
    """The subclass of ``base`` whose forward uses the held scale (built once)."""
    cls = _HELD_CLASSES.get(base)
    if cls is None:
        cls = _HELD_CLASSES[base] = type(
            f"Held{base.__name__}",
            (base,),
            {"__call__": _held_call, _ORIGINAL_CLASS: base},
        )
    return cls


def offset_norms(model: nn.Module) -> List[nn.Module]:
    """``model``'s norms of a class in :data:`OFFSET_NORM_CLASSES` (not yet swapped)."""
    return [
        module
        for module in model.modules()
        if (type(module).__module__, type(module).__name__) in OFFSET_NORM_CLASSES
        and "weight" in module
        and isinstance(module.weight, mx.array)
        and module.weight.ndim == 1
    ]


def forward_matches(norm: nn.Module) -> bool:
    """Whether ``norm``'s own forward gives the held form's bits on a probe input."""
    weight = norm.weight
    probe = mx.random.normal((2, weight.shape[0]), key=mx.random.key(0))
    probe = probe.astype(weight.dtype)
    own = type(norm).__call__(norm, probe)
    held = mx.fast.rms_norm(probe, 1.0 + weight, norm.eps)
    return own.dtype == held.dtype and bool(mx.array_equal(own, held))


class HeldNorms:
    """Hold the scale of ``model``'s Gemma-style norms (see the module docstring).

    Use as a context manager, or :meth:`install` / :meth:`uninstall`.

    Args:
        models: The models whose norms to swap (the target, a drafter); None and
            objects that are not ``nn.Module`` are skipped.
    """

    def __init__(self, *models: Optional[nn.Module]) -> None:
        # Stand-in drafters (replay, oracle) hold no modules.
        self.models = [m for m in models if isinstance(m, nn.Module)]
        self._swapped: List[Tuple[nn.Module, type]] = []

    @property
    def swapped(self) -> int:
        """How many norms hold their scale now."""
        return len(self._swapped)

    def install(self) -> "HeldNorms":
        """Swap every offset norm whose class passes the probe; compute the scales.

        Nothing is swapped when the probe fails for a class; norms of other classes are
        untouched. Installing twice is a no-op.
        """
        if self._swapped:
            return self
        # A module shared by two models (a draft model that is the target) once.
        norms = list({id(n): n for m in self.models for n in offset_norms(m)}.values())
        try:
            for norm in norms:
                base = type(norm)
                verdict = (base, norm.weight.dtype)
                if verdict not in _VERDICTS:
                    _VERDICTS[verdict] = forward_matches(norm)
                if _VERDICTS[verdict]:
                    norm.__dict__[_HELD] = (norm.weight, 1.0 + norm.weight)
                    norm.__class__ = _held_class(base)
                    self._swapped.append((norm, base))
            # One evaluation for every scale, outside any caller's graph or trace.
            mx.eval([norm.__dict__[_HELD][1] for norm, _ in self._swapped])
        except BaseException:
            self.uninstall()  # all or nothing
            raise
        return self

    def uninstall(self) -> None:
        """Restore every swapped class and drop the held scales."""
        for norm, base in self._swapped:
            norm.__class__ = base
            norm.__dict__.pop(_HELD, None)
        self._swapped.clear()

    def __enter__(self) -> "HeldNorms":
        return self.install()

    def __exit__(self, *exc: object) -> None:
        self.uninstall()


def is_centered(norm: nn.Module) -> bool:
    """Whether ``norm`` is a one-dimensional norm of a class in
    :data:`OFFSET_NORM_CLASSES` (held or not) whose forward is the held form."""
    base = getattr(type(norm), _ORIGINAL_CLASS, type(norm))
    if (base.__module__, base.__name__) not in OFFSET_NORM_CLASSES:
        return False
    weight = norm["weight"] if "weight" in norm else None
    if not isinstance(weight, mx.array) or weight.ndim != 1:
        return False
    verdict = (base, weight.dtype)
    if verdict not in _VERDICTS:
        _VERDICTS[verdict] = forward_matches(norm)
    return _VERDICTS[verdict]


def centered_scale(norm: nn.Module) -> mx.array:
    """``1.0 + norm.weight`` as the norm's forward passes it: the held array while the
    norm is held, else computed now (the same op, so the same bits).

    Shapes: returns ``(D,)``.
    """
    weight = norm.weight
    held = norm.__dict__.get(_HELD)
    if held is None:
        return 1.0 + weight
    if held[0] is not weight:
        held = norm.__dict__[_HELD] = (weight, 1.0 + weight)
    return held[1]


def is_held(module: nn.Module) -> bool:
    """Whether ``module`` is a norm swapped by :class:`HeldNorms`."""
    return hasattr(type(module), _ORIGINAL_CLASS)


@contextlib.contextmanager
def held_norms(
    model: nn.Module,
    drafter: Optional[nn.Module] = None,
    use_held: Optional[bool] = None,
) -> Iterator[Optional[HeldNorms]]:
    """Hold the norms' scales for the ``with`` block when :func:`held_norms_wanted`.

    What the generators use. Norms already held (by a caller's :class:`HeldNorms`) are
    left as they are.

    Args:
        model: The target.
        drafter: A drafter whose norms to hold too.
        use_held: As for :func:`held_norms_wanted`.

    Yields:
        The installed :class:`HeldNorms`, or None when nothing was swapped.
    """
    if not held_norms_wanted(use_held):
        yield None
        return
    with HeldNorms(model, drafter) as held:
        yield held if held.swapped else None
