"""Errors raised by the KV planes, the drop-in caches and the speculative checkpoint.

Every error is raised *before* any buffer or bookkeeping is touched, so a caller that catches
one holds a cache in exactly the state it had before the failing call.
"""


class CacheError(ValueError):
    """Base class of every cache error (a ``ValueError``: the input was wrong)."""


class CacheDiscontinuity(CacheError):
    """A write did not start at the plane's next logical position.

    Args:
        layer: Index of the layer whose plane refused the write (``None`` if unknown).
        expected: The logical position the plane expected (``origin_logical + len``).
        got: The logical position the write claimed to start at.
    """

    def __init__(self, layer, expected: int, got: int):
        self.layer = layer
        self.expected = expected
        self.got = got
        where = f"layer {layer}" if layer is not None else "a layer"
        super().__init__(
            f"KV cache for {where} expected logical position {expected}, got {got}"
        )


class ContextOverflow(CacheError):
    """A write would take a plane past its ``max_context``."""


class RollbackError(CacheError):
    """A speculative checkpoint could not be committed or rolled back exactly."""


class IncompatibleCache(CacheError):
    """A prompt cache does not belong to the model it is used with."""


class SnapshotError(CacheError):
    """A snapshot or a cache state was refused by the gate (nothing was installed).

    Args:
        where: What was being checked: ``"layer 3"``, ``"drafter layer 1"``, ``"header"``, or
            the file.
        field: The field that failed (``"len"``, ``"origin_physical"``, ``"keys"``, ...).
        problem: What is wrong with it.
    """

    def __init__(self, where: str, field: str, problem: str):
        self.where = where
        self.field = field
        super().__init__(f"{where}: {field}: {problem}")
