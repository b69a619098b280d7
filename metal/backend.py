"""Backend detection, kernel factories, launches and the per-operation defaults.

Kernel objects are built once: the fixed-arity ones at import, the ones whose
arity is a plane count on first use per count (memoised). Construction is
guarded, so importing this package never fails on a CPU-only mlx: without
Metal or CUDA the factories return ``None`` and every wrapper takes its
pure-MLX reference form.

The staging shadow's default (``use_kernel=None``) is decided here, once, by
measurement (:data:`SHADOW_KERNEL_BY_DEFAULT`): on CUDA the shadow defaults to
the reference ops (slices + one concatenate), which measured at least as fast as
the kernel on an H200, alone and inside the 16-token verify forward of Muse
Glimmer (``docs/bench-forward-h200.md``: cache work 2.97 vs 3.41 ms at 4k, 3.10
vs 3.25 ms at 32k; ``docs/metal.md`` has the other runs). On Metal, where nothing
could be measured, the kernel is the default. Other docstrings refer here rather
than restate it.
"""

from __future__ import annotations

import contextvars
import functools
import os
import struct
from typing import Any, Callable, Optional, Sequence

import mlx.core as mx
import numpy as np

from . import kept_modules, kernel_files
from .sources import CUDA, MAX_PLANES, METAL, KernelSpec, compact_text

Kernel = Callable[..., list]

THREADGROUP = 256


def _detect_backend() -> Optional[str]:
    try:
        if mx.metal.is_available():
            return METAL
    except (AttributeError, RuntimeError):
        pass
    try:
        if mx.cuda.is_available():
            return CUDA
    except (AttributeError, RuntimeError):
        pass
    return None


BACKEND: Optional[str] = _detect_backend()
# The backend mlx really has (tests and host-cost stubs set BACKEND to route as on a GPU).
NATIVE_BACKEND: Optional[str] = BACKEND


# Whether mlx launches every kernel directly in this process for certain (its CUDA graphs
# known off): the kernel layer cannot see how the process started, so dflash's
# ``launch_mode`` hands its answer in at import (:func:`set_direct_launches_probe`).
_direct_launches_probe: Callable[[], bool] = lambda: False


def set_direct_launches_probe(probe: Callable[[], bool]) -> None:
    """Take ``probe`` as the answer of :func:`direct_launches_known`."""
    global _direct_launches_probe
    _direct_launches_probe = probe


def direct_launches_known() -> bool:
    """Whether mlx's CUDA graphs are known off in this process (False until a probe is
    set; see ``dflash.launch_mode.direct_launches_known``)."""
    return bool(_direct_launches_probe())


def switch_word(value: Optional[str]) -> Optional[bool]:
    """An on/off word: ``1/true/on/yes`` True, ``0/false/off/no`` False (any case,
    spaces around ignored); None for None or anything else."""
    value = (value or "").strip().lower()
    if value in {"1", "true", "on", "yes"}:
        return True
    if value in {"0", "false", "off", "no"}:
        return False
    return None


def env_switch(name: str) -> Optional[bool]:
    """An on/off environment switch (:func:`switch_word` of its value).

    Returns:
        None when ``name`` is unset or holds anything else (the caller's default applies).
    """
    return switch_word(os.environ.get(name))


def cuda_graphs_off(value: Optional[str]) -> bool:
    """Whether ``value`` of ``MLX_USE_CUDA_GRAPHS`` turns mlx's CUDA graphs off (an
    off word; unset or anything else leaves them on)."""
    return switch_word(value) is False


def strict_switch(name: str, given: Optional[bool], default: bool = True) -> bool:
    """``given`` when not None, else the on/off switch ``name``, else ``default``.

    Raises:
        ValueError: ``name`` is set to something that is not an on/off word.
    """
    if given is not None:
        return bool(given)
    switch = env_switch(name)
    if switch is None and os.environ.get(name, "").strip():
        raise ValueError(f"{name} must be 0 or 1, got {os.environ[name]!r}")
    return default if switch is None else switch


def count_switch(name: str, default: int) -> int:
    """A non-negative integer environment setting: ``name``'s value, else ``default``.

    Raises:
        ValueError: ``name`` is set to something that is not a non-negative integer.
    """
    text = os.environ.get(name, "").strip()
    if not text:
        return default
    if not text.isdigit():
        raise ValueError(f"{name} must be a non-negative integer, got {text!r}")
    return int(text)


# ``DFLASH_KERNELS=0`` makes every default (``use_kernel=None``) pick the pure-MLX
# reference; an explicit ``use_kernel=True`` still launches the kernel.
KERNELS_ENV = "DFLASH_KERNELS"
KERNELS_ENABLED: bool = env_switch(KERNELS_ENV) is not False


# What ``use_kernel=None`` picks for the staging shadow, per backend (the module docstring
# gives the measurement).
SHADOW_KERNEL_BY_DEFAULT: dict[str, bool] = {METAL: True, CUDA: False}


# A patched layer's bound forward is replayed through ``mx.compile``: mlx reuses the
# traced launches in C++ instead of running our Python per call. On by default on CUDA
# (measured there: docs/verify-kernels-analysis.md, session 15); ``DFLASH_COMPILE=0`` /
# ``=1`` turn it off / on anywhere.
COMPILE_ENV = "DFLASH_COMPILE"
COMPILE_BY_DEFAULT = {CUDA: True, METAL: False}


def compile_wanted() -> bool:
    """Whether :func:`compile_bound` compiles: :data:`COMPILE_ENV`, else the backend's
    default (:data:`COMPILE_BY_DEFAULT`; off without a GPU backend)."""
    switch = env_switch(COMPILE_ENV)
    if switch is not None:
        return switch
    return COMPILE_BY_DEFAULT.get(BACKEND, False)


def compile_bound(forward: Callable) -> Callable:
    """``forward`` through ``mx.compile`` when :func:`compile_wanted`, else as it is.

    ``forward`` must be a pure function of its array arguments whose captured arrays
    are evaluated and never replaced (a bound layer's weights: a layer whose arrays are
    replaced is bound again). Its Python then runs once per input geometry (the trace),
    and the same launches, so the same bits, are replayed at every later call.
    """
    return compile_traced(forward) if compile_wanted() else forward


_TRACING = contextvars.ContextVar("dflash_tracing", default=False)


def compile_traced(forward: Callable) -> Callable:
    """``mx.compile(forward)``, with :func:`tracing` true while its Python runs (the
    trace): what must be fresh at every replay is then made inside the trace."""

    def traced(*args: Any, **kwargs: Any) -> Any:
        token = _TRACING.set(True)
        try:
            return forward(*args, **kwargs)
        finally:
            _TRACING.reset(token)

    return mx.compile(traced)


def tracing() -> bool:
    """Whether the running Python is an ``mx.compile`` trace of :func:`compile_traced`."""
    return _TRACING.get()


def shadow_kernel_by_default() -> bool:
    """Whether ``use_kernel=None`` launches the staging-shadow kernel on this backend."""
    return SHADOW_KERNEL_BY_DEFAULT.get(BACKEND, False)


def kernel_backend() -> Optional[str]:
    """The GPU backend custom kernels run on: ``"metal"``, ``"cuda"`` or None."""
    return BACKEND


def build_kernel(
    spec: KernelSpec, backend: Optional[str] = BACKEND
) -> Optional[Kernel]:
    """Build the mlx custom-kernel object for ``spec``.

    Args:
        spec: Kernel contract.
        backend: ``"metal"``, ``"cuda"`` or None.

    Returns:
        The callable from ``mx.fast.metal_kernel``/``mx.fast.cuda_kernel``, or
        None when there is no GPU backend.
    """
    if backend is None:
        return None
    return make_kernel(
        backend,
        name=spec.name(backend),
        input_names=list(spec.input_names),
        output_names=list(spec.output_names),
        source=spec.source(backend),
    )


def make_kernel(backend: str, **fields: Any) -> Optional[Kernel]:
    """``mx.fast.metal_kernel`` or ``mx.fast.cuda_kernel`` for ``backend``.

    The source and header are handed over compacted (:func:`compact_text`: mlx hashes
    them at every CUDA launch), and on CUDA as one ``#include`` line each where their
    files can be written (:mod:`.kernel_files`); the name, made from the full texts,
    stays. With ``DFLASH_KEPT_MODULES`` on, a CUDA kernel comes wrapped in
    :class:`.kept_modules.KeptKernel`, which leaves each launch form compiled where mlx
    looks before it compiles, so later processes load it.

    Args:
        backend: ``"metal"`` or ``"cuda"``.
        **fields: The kernel's name, input and output names, source (and header).

    Returns:
        The kernel callable, or None when mlx cannot build it here.
    """
    for text in ("source", "header"):
        if text in fields:
            fields[text] = compact_text(fields[text])
    switch = env_switch(kernel_files.INCLUDED_TEXTS_ENV)
    if backend == CUDA and (kernel_files.INCLUDED_TEXTS if switch is None else switch):
        stubs = kernel_files.included_texts(
            fields["name"],
            fields["source"],
            fields.get("header", ""),
            fields.get("input_names", ()),
        )
        if stubs is not None:
            fields["source"], header = stubs
            if header:
                fields["header"] = header
    try:
        if backend == METAL:
            return mx.fast.metal_kernel(**fields)
        kernel = mx.fast.cuda_kernel(**fields)
    except RuntimeError:
        return None
    if NATIVE_BACKEND == CUDA and strict_switch(
        kept_modules.KEPT_MODULES_ENV, None, kept_modules.by_default()
    ):
        return kept_modules.KeptKernel(kernel, fields)
    return kernel


@functools.lru_cache(maxsize=None)
def kernel_for(spec: KernelSpec) -> Optional[Kernel]:
    """The kernel object for ``spec``, built on first request and kept."""
    return build_kernel(spec)


def max_planes(kind: str) -> int:
    """Planes one launch of ``kind`` (``"retain"``/``"restore"``) can bind."""
    return MAX_PLANES[(BACKEND or CUDA, kind)]


def gpu_is_default() -> bool:
    """Whether mlx's default device is the GPU."""
    return mx.default_device().type == mx.gpu


def use_kernel_path(use_kernel: Optional[bool], auto: bool) -> bool:
    """Resolve a wrapper's ``use_kernel`` switch.

    Args:
        use_kernel: False forces the reference, True forces the kernel, None
            picks ``auto`` when a GPU backend is present, the default device
            is the GPU and ``DFLASH_KERNELS`` is not ``0``.
        auto: What this wrapper picks by default on a GPU.

    Returns:
        Whether to launch the custom kernel.

    Raises:
        RuntimeError: ``use_kernel=True`` without Metal or CUDA.
    """
    if use_kernel is False:
        return False
    if use_kernel is None:
        return auto and KERNELS_ENABLED and BACKEND is not None and gpu_is_default()
    if BACKEND is None:
        raise RuntimeError(
            "use_kernel=True needs mlx's Metal or CUDA backend; this mlx has "
            "neither (use_kernel=None or False runs the pure-MLX reference)"
        )
    return True


def launch(
    spec: KernelSpec,
    inputs: Sequence[mx.array],
    output_shapes: Sequence[tuple[int, ...]],
    word: mx.Dtype,
    total: int,
) -> list[mx.array]:
    """Launch the kernel of ``spec`` with one thread per output word.

    Args:
        spec: Kernel contract (its built kernel object is looked up).
        inputs: Inputs in the spec's order.
        output_shapes: Output shapes (all of dtype ``word``).
        word: Word dtype, also the template argument ``T``.
        total: Thread count (the bodies bound-check against ``params[0]``).

    Returns:
        The kernel's outputs.
    """
    return call_kernel(
        kernel_for(spec),
        spec.base,
        list(inputs),
        [tuple(shape) for shape in output_shapes],
        output_dtypes=[word] * len(output_shapes),
        grid=(total, 1, 1),
        threadgroup=(min(THREADGROUP, total), 1, 1),
        template=[("T", word)],
    )


def call_kernel(
    kernel: Optional[Kernel],
    name: str,
    inputs: Sequence[mx.array],
    output_shapes: Sequence[tuple[int, ...]],
    **launch: Any,
) -> list[mx.array]:
    """Run a built kernel on the GPU stream.

    Args:
        kernel: The kernel, or None when this mlx build could not make it.
        name: The kernel's name, for the error.
        inputs: Inputs in the spec's order, as a list.
        output_shapes: Output shapes, as a list of tuples (passed to mlx as they are).
        **launch: ``output_dtypes``, ``grid``, ``threadgroup``, ``template``.

    Returns:
        The kernel's outputs.

    Raises:
        RuntimeError: There is no kernel.
    """
    if kernel is None:
        raise RuntimeError(f"kernel {name} unavailable on this mlx build")
    return kernel(inputs=inputs, output_shapes=output_shapes, stream=mx.gpu, **launch)


RESIDENT_ENV = "DFLASH_RESIDENT_PARAMS"

# Launch-scalar words one packing launch gathers (two a slot); longer sets stay host-made.
PACK_SLOTS = 16


def resident_wanted() -> bool:
    """Whether a new launch-scalar set is gathered into device memory
    (:func:`launch_scalars`): with mlx's CUDA backend (and routed as on it) unless
    :data:`RESIDENT_ENV` is off, and never inside an ``mx.compile`` trace (the gather
    would be a traced op)."""
    if BACKEND != CUDA or NATIVE_BACKEND != CUDA or tracing():
        return False
    return strict_switch(RESIDENT_ENV, None, True)


def _pack_body(slots: int) -> str:
    lines = [
        f"  if (gid >= {2 * slots}u) {{",
        "    return;",
        "  }",
        "  const uint32_t lane = gid % 2u;",
        "  int32_t word = 0;",
    ]
    for slot in range(slots):
        branch = "if" if slot == 0 else "} else if"
        lines.append(f"  {branch} (gid / 2u == {slot}u) {{")
        lines.append(f"    word = s{slot}[lane];")
    lines += ["  }", "  out[gid] = word;", ""]
    return "\n".join(lines)


@functools.lru_cache(maxsize=None)
def pack_spec(slots: int) -> KernelSpec:
    """The kernel that gathers ``slots`` two-word int32 inputs ``s0 ..`` into ``out``
    (one thread a word): launch scalars read once from mlx's small host pool."""
    names = tuple(f"s{slot}" for slot in range(slots))
    return KernelSpec(f"pack_scalars{slots}", names, ("out",), _pack_body(slots))


def reference_pack(words: Sequence[int]) -> mx.array:
    """What a packing launch stores: ``words`` as an int32 array (even length)."""
    return mx.array(list(words), dtype=mx.int32)


def pack_launch(words: Sequence[int]) -> mx.array:
    """Gather ``words`` (even count, at most ``2 * PACK_SLOTS``) into device memory.

    Each pair is its own 8-byte ``mx.array``: mlx's CUDA allocator serves arrays of at
    most 8 bytes from a pool of host memory the GPU reads in place (advised
    ``AccessedBy``), so no page migrates; one launch copies them into an output mlx
    allocates on the device.
    """
    slots = len(words) // 2
    inputs = [
        mx.array(list(words[2 * i : 2 * i + 2]), dtype=mx.int32) for i in range(slots)
    ]
    spec = pack_spec(slots)
    return call_kernel(
        kernel_for(spec),
        spec.base,
        inputs,
        [(2 * slots,)],
        output_dtypes=[mx.int32],
        grid=(2 * slots, 1, 1),
        threadgroup=(2 * slots, 1, 1),
    )[0]


def _host_scalars(words: tuple, dtype_name: str) -> mx.array:
    host = mx.array(list(words), dtype=mx.int32)
    return host if dtype_name == "int32" else host.view(mx.float32)


def _gathered(words: tuple) -> mx.array:
    """``words`` (at most ``2 * PACK_SLOTS``) as an int32 array in device memory."""
    return pack_launch(words + (0,) * (len(words) % 2))[: len(words)]


def _resident_scalars(words: tuple, dtype_name: str) -> mx.array:
    if len(words) > 2 * PACK_SLOTS:
        return _host_scalars(words, dtype_name)
    packed = _gathered(words)
    packed = packed if dtype_name == "int32" else packed.view(mx.float32)
    # Scheduled now, so a trace that captures the memoised array (a bound launch plan
    # inside ``mx.compile``) holds its value, not the gather: a lazy capture re-ran the
    # gather at every replay (session 33: ~280 extra launches a 4-bit round).
    mx.async_eval(packed)
    return packed


@functools.lru_cache(maxsize=2048)
def _scalars(key, dtype_name: str, in_trace: bool) -> mx.array:
    # ``in_trace`` only keys the memo: a trace's sets are host-made (resident_wanted).
    if dtype_name == "int32":
        words = tuple(np.asarray(key, dtype=np.int32).tolist())
    else:
        words = tuple(np.frombuffer(key, dtype=np.int32).tolist())
    # The switch is read once a set: a memo hit costs no environment lookup.
    make = _resident_scalars if resident_wanted() else _host_scalars
    return make(words, dtype_name)


def clear_launch_scalars() -> None:
    """Forget every memoised scalar array (the next use of each set makes it anew)."""
    _scalars.cache_clear()


def launch_scalars(values: Sequence, dtype: mx.Dtype = mx.int32) -> mx.array:
    """A launch's runtime scalars as an immutable, memoised 1-D array.

    mlx's CUDA allocator puts an array made on the host (``mx.array`` of a list, more
    than 8 bytes) in managed memory, and the first kernel to read it waits while its
    page migrates: measured in session 32 (CUPTI, H200), a chunk pass reading new
    host-made scalars took ~100 us against 16, a residual norm ~100 against 10. A
    decode step's positions make new scalars every step. Where :func:`resident_wanted`,
    the scalars are therefore gathered by one small launch (:func:`pack_launch`) into
    device memory, and every launch reads them there.

    The route (:func:`resident_wanted`) is decided when a set is first made, so
    :data:`RESIDENT_ENV` applies to sets made after it is set (:func:`clear_launch_scalars`
    forgets the others).

    Args:
        values: The scalars, in the order the kernel reads them.
        dtype: ``mx.int32`` or ``mx.float32``.

    Returns:
        The array (the same object for the same words and dtype, outside or inside a
        trace).

    Raises:
        ValueError: another dtype, or a float that float32 cannot hold.
    """
    if dtype == mx.int32:
        return _scalars(tuple(values), "int32", tracing())
    if dtype != mx.float32:
        raise ValueError(f"launch scalars are int32 or float32, not {dtype}")
    # Keyed by the float32 bytes: equal values that differ in bits (signed zeros) stay apart.
    try:
        key = struct.pack(f"<{len(values)}f", *values)
    except OverflowError as error:
        raise ValueError(f"launch scalars {list(values)} overflow float32") from error
    return _scalars(key, "float32", tracing())


def resident_array(values: Sequence[int], dtype: mx.Dtype = mx.uint32) -> mx.array:
    """Host integers that change every call (a block's token ids) as a 1-D array, made
    where :func:`resident_wanted` without a page migration at its first reader.

    Not memoised (:func:`launch_scalars` is, for values that recur). An array of more than
    8 bytes made on the host lives in managed memory on CUDA, and the first kernel that
    reads it waits while its page moves (session 32: 40-100 us); at most
    ``2 * PACK_SLOTS`` words are gathered by one small launch instead.

    Args:
        values: The integers.
        dtype: ``mx.uint32`` (each in ``[0, 2**31)``) or ``mx.int32``.

    Returns:
        The array, of ``dtype`` and shape ``(len(values),)``.

    Raises:
        ValueError: another dtype, or a value the gather's int32 words cannot hold.
    """
    if dtype not in (mx.uint32, mx.int32):
        raise ValueError(f"resident arrays are uint32 or int32, not {dtype}")
    words = tuple(int(value) for value in values)
    low = 0 if dtype == mx.uint32 else -(2**31)
    bad = [word for word in words if not low <= word < 2**31]
    if bad:
        raise ValueError(f"values {bad[:4]} do not fit a {dtype} resident array")
    if not words or len(words) > 2 * PACK_SLOTS or not resident_wanted():
        return mx.array(list(words), dtype)
    return _gathered(words).view(dtype)


def params(*values: int) -> mx.array:
    """Runtime scalars of one launch as an int32 array (:func:`launch_scalars`).

    Memoised: every layer of a round launches with the same scalars, and an
    ``mx.array`` is immutable, so one copy serves them all.
    """
    return launch_scalars(values, mx.int32)


def probed(verdicts: dict, key: Any, probe: Callable[[], bool]) -> bool:
    """``probe()``'s verdict for ``key``, run once and kept in ``verdicts``. A probe
    that raises (a kernel that does not build here) gives False: the caller keeps
    mlx's ops, failing closed rather than mid-generation."""
    if key not in verdicts:
        try:
            verdicts[key] = bool(probe())
        except Exception:
            verdicts[key] = False
    return verdicts[key]
