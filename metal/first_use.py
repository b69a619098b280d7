"""A default kernel's first use, checked against its reference.

The cache kernels that a GPU backend takes by default (``retain_rows`` everywhere,
the staging shadow on Metal) only copy bits, so the custom kernel and its pure-MLX
reference give the same bits by construction. On Metal they are compile-checked and
emulated on the CPU here but have never run on Apple hardware; a Metal compiler that
refuses a body, or a GPU that computes it wrongly, would otherwise break every
generation. So the first default call of each kernel in a process (per operation,
word type and plane count) runs the kernel beside its reference, evaluates both and
keeps the kernel only if it ran and gave the reference's bits; otherwise it warns
once and that operation takes the reference from then on (the same output, without
the kernel's speed).

Only the default (``use_kernel=None``) is checked: a kernel asked for with
``use_kernel=True`` runs as it is, and its errors reach the caller. Inside an
``mx.compile`` trace nothing can be evaluated, so a call there takes the kernel
unchecked (the traced paths run on CUDA, where every kernel has run its tests).
"""

from __future__ import annotations

import warnings
from typing import Callable, Dict, Hashable, Sequence, TypeVar, Union

import mlx.core as mx

from . import backend

Outputs = TypeVar("Outputs", mx.array, Sequence[mx.array])

# Each checked key's verdict: True keeps the kernel, False takes the reference.
_VERDICTS: Dict[Hashable, bool] = {}

# Unsigned word of each element size, to compare bits (NaN payloads included).
_BITS = {1: mx.uint8, 2: mx.uint16, 4: mx.uint32, 8: mx.uint64}


def forget_verdicts() -> None:
    """Check every kernel again at its next default use (tests; a new device)."""
    _VERDICTS.clear()


def verdict(key: Hashable) -> Union[bool, None]:
    """The kept verdict for ``key``: True (kernel), False (reference) or None
    (not checked yet)."""
    return _VERDICTS.get(key)


def checked(
    key: Hashable,
    kernel: Callable[..., Outputs],
    reference: Callable[..., Outputs],
    arguments: tuple,
) -> Outputs:
    """``kernel(*arguments)``, checked against ``reference(*arguments)`` at the first
    call for ``key``.

    Args:
        key: What one verdict covers (the operation, its word type and the launch
            shapes that choose its kernels); the backend is added here.
        kernel: Builds the kernel form's outputs (an array or a tuple of arrays).
        reference: Builds the reference form's outputs, the same structure.
        arguments: What both take.

    Returns:
        The kernel's outputs while its verdict is (or becomes) True, else the
        reference's (the checked call launches the kernel twice: once evaluated
        for the check, once for the caller).
    """
    key = (backend.BACKEND, key)
    kept = _VERDICTS.get(key)
    if kept is True or (kept is None and backend.tracing()):
        return kernel(*arguments)
    if kept is False:
        return reference(*arguments)
    expected = reference(*arguments)
    try:
        outputs = kernel(*arguments)
        mx.eval(outputs, expected)
        problem = _difference(outputs, expected)
    except RuntimeError as error:  # mlx's refusal to build or run the kernel
        problem = f"it failed: {error}"
    _VERDICTS[key] = problem is None
    if problem is None:
        # Built again, unevaluated, as every later call is: the caller's graph is the
        # same whether or not this call was the checked one.
        return kernel(*arguments)
    warnings.warn(
        f"dflash: the {key[1][0]} kernel on {backend.BACKEND} did not pass its "
        f"first-use check ({problem}); this process runs the pure-MLX reference ops "
        "for it instead (the same output, slower)",
        RuntimeWarning,
        stacklevel=3,
    )
    return expected


def kernel_form(
    use_kernel: Union[bool, None],
    key: Hashable,
    kernel: Callable[..., Outputs],
    reference: Callable[..., Outputs],
    arguments: tuple,
) -> Outputs:
    """The kernel form a wrapper chose: :func:`checked` when the default chose it
    (``use_kernel`` None), else ``kernel(*arguments)`` as it is (asked for by name)."""
    if use_kernel is None:
        return checked(key, kernel, reference, arguments)
    return kernel(*arguments)


def _difference(outputs: Outputs, expected: Outputs) -> Union[str, None]:
    """What differs between the kernel's and the reference's outputs, or None."""
    got = [outputs] if isinstance(outputs, mx.array) else list(outputs)
    want = [expected] if isinstance(expected, mx.array) else list(expected)
    if len(got) != len(want):
        return f"{len(got)} outputs, the reference gives {len(want)}"
    for index, (mine, theirs) in enumerate(zip(got, want)):
        if mine.shape != theirs.shape or mine.dtype != theirs.dtype:
            return (
                f"output {index} is {mine.dtype} {tuple(mine.shape)}, the reference's "
                f"{theirs.dtype} {tuple(theirs.shape)}"
            )
        bits = _BITS[mine.dtype.size]
        if not mx.array_equal(mine.view(bits), theirs.view(bits)).item():
            return f"output {index} differs from the reference's bits"
    return None
