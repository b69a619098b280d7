"""Capture a target's decoder-layer outputs without editing mlx-lm.

While attached, each tapped layer instance has its class swapped for a recording
subclass of its own class; detaching swaps the original class back. Nothing else
about the layer changes (same object, same parameters and names), and layers of a
target with no taps attached run exactly their original code.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence

import mlx.core as mx
import mlx.nn as nn

# Marks a recording subclass; its value is the class it replaced.
_ORIGINAL_CLASS = "_dflash_tap_original_class"


def target_layers(model: nn.Module) -> List[nn.Module]:
    """The decoder layers of an mlx-lm model (``model.layers`` or a nested one).

    Args:
        model: An mlx-lm ``Model``.

    Returns:
        The list of decoder layer modules.
    """
    for owner in (
        model,
        getattr(model, "model", None),
        getattr(model, "language_model", None),
    ):
        layers = getattr(owner, "layers", None) if owner is not None else None
        if isinstance(layers, (list, tuple)):
            return list(layers)
    raise ValueError(f"cannot find decoder layers in {type(model).__name__}")


class TargetTaps:
    """Records the outputs of decoder layers ``layer_ids`` on each target forward.

    ``layer_ids[i]`` names the output of decoder layer ``i`` (0-based), which is
    Hugging Face ``hidden_states[i + 1]`` and what DFlash's ``target_layer_ids``
    mean. Use as a context manager or call :meth:`attach` / :meth:`detach`.
    """

    def __init__(
        self,
        model: nn.Module,
        layer_ids: Sequence[int],
        start_early: bool = False,
        eval_every: int = 0,
        eval_tail: bool = False,
    ) -> None:
        """Validate ``layer_ids`` against the model's decoder layers.

        Args:
            model: The target mlx-lm model.
            layer_ids: Decoder layer indices to tap, in concatenation order.
            start_early: Start each tapped output on the device (``mx.async_eval``) as
                soon as its graph is built, so the device runs the first layers of a
                forward while Python still builds the later ones (the loop's verify is
                bound by host graph building as much as by the device).
            eval_every: With ``start_early``, also start the output of every
                ``eval_every``-th decoder layer (layers ``eval_every - 1``,
                ``2 * eval_every - 1``, ...; 0: the tapped ones only), so the device
                follows the build a few layers behind instead of a whole gap between
                taps behind (values are unchanged: only when work is started).
            eval_tail: Pace only the last two gaps between starts (the taps and the
                last layer): layers ``s + eval_every``, ``s + 2 * eval_every``, ...
                after the third-to-last start ``s``. Those are what the device still
                runs when the host has built the forward; earlier starts each cost
                the host a graph commit.

        Raises:
            ValueError: an id is outside ``[0, len(model.layers))``, the list is
                empty, or ``eval_every`` is negative.
        """
        self.model = model
        self.layers = target_layers(model)
        self.layer_ids = tuple(int(i) for i in layer_ids)
        if not self.layer_ids:
            raise ValueError("layer_ids is empty")
        bad = [i for i in self.layer_ids if not 0 <= i < len(self.layers)]
        if bad:
            raise ValueError(
                f"layer_ids {bad} out of range for a target with "
                f"{len(self.layers)} layers (valid 0..{len(self.layers) - 1})"
            )
        if eval_every < 0:
            raise ValueError(f"eval_every must be >= 0, got {eval_every}")
        self._records: Dict[int, mx.array] = {}
        self._attached = False
        self.start_early = start_early
        # Whether the paced layers start their output (a run-time pacing rule may switch
        # it per round, see dflash.pacing); tapped layers start theirs regardless.
        self.paced = True
        # The layers whose class is swapped: the tapped ones and, when started early,
        # the paced ones (which only start their output).
        self._swapped = sorted(set(self.layer_ids))
        if start_early and eval_every:
            starts = sorted(set(self.layer_ids) | {len(self.layers) - 1})
            first = starts[-3] if eval_tail and len(starts) >= 3 else -1
            paced = range(first + eval_every, len(self.layers), eval_every)
            self._swapped = sorted(set(self._swapped) | set(paced))

    def attach(self) -> None:
        """Swap each tapped layer's class for a recording subclass.

        Raises:
            RuntimeError: a tapped layer is already tapped by another ``TargetTaps``.
        """
        if self._attached:
            return
        busy = [
            i for i in self._swapped if hasattr(type(self.layers[i]), _ORIGINAL_CLASS)
        ]
        if busy:
            raise RuntimeError(f"layers {busy} are already tapped")
        recorded = set(self.layer_ids)
        for index in self._swapped:
            layer = self.layers[index]
            layer.__class__ = _recording_class(
                type(layer), self, index if index in recorded else None
            )
        self._attached = True

    def detach(self) -> None:
        """Restore every tapped layer's original class and drop pending records."""
        for index in self._swapped:
            layer = self.layers[index]
            original = getattr(type(layer), _ORIGINAL_CLASS, None)
            if original is not None:
                layer.__class__ = original
        self._records.clear()
        self._attached = False

    def pop(self) -> mx.array:
        """Tapped outputs of the most recent forward, concatenated; clears them.

        Returns:
            Layer outputs concatenated along features in ``layer_ids`` order.

        Raises:
            RuntimeError: some tapped layer has not run since the last ``pop``.

        Shapes: (B, L, k*H) with k = len(layer_ids).
        """
        missing = sorted({i for i in self.layer_ids if i not in self._records})
        if missing:
            raise RuntimeError(
                f"no recorded output for layers {missing}; run a target forward "
                "with the taps attached first"
            )
        parts = [self._records[i] for i in self.layer_ids]
        self._records.clear()
        return mx.concatenate(parts, axis=-1)

    def __enter__(self) -> "TargetTaps":
        self.attach()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.detach()


def _recording_class(base: type, taps: TargetTaps, index: Optional[int]) -> type:
    """A subclass of ``base`` whose ``__call__`` also stores its output in ``taps`` as
    layer ``index``'s (``None``: a paced layer, which only starts its output early)."""

    def __call__(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        out = base.__call__(self, *args, **kwargs)
        # Some layer types return (hidden, extras); the hidden state comes first.
        hidden = out[0] if isinstance(out, tuple) else out
        if index is not None:
            taps._records[index] = hidden
        if taps.start_early and (index is not None or taps.paced):
            mx.async_eval(hidden)
        return out

    return type(
        f"Tapped{base.__name__}",
        (base,),
        {"__call__": __call__, _ORIGINAL_CLASS: base},
    )
