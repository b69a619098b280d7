"""Threadgroup kernels: one shared body, a per-backend header and prologue.

The copy kernels of :mod:`dflash.metal.sources` need one flat thread index. The
verify kernels (:mod:`dflash.metal.attention`, :mod:`dflash.metal.qmm`) cooperate
inside a threadgroup: they stage data in threadgroup memory and wait at barriers.
The three things that differ between Metal and CUDA for that are spelled by the
backend, everything else is one text shared by both:

* a **header** (``header=`` of ``mx.fast.metal_kernel`` / ``mx.fast.cuda_kernel``)
  defining the macros ``DFL_SHARED`` (threadgroup / ``__shared__`` storage),
  ``DFL_BARRIER()``, ``DFL_FN`` (helper-function qualifier) and the float maths
  ``DFL_EXP``, ``DFL_TANH``, ``DFL_FMA``, ``DFL_FMAX`` and ``DFL_UNROLL8`` (unroll the
  next loop by 8 where the compiler takes the hint); after it comes the kernel's
  shared helper functions (index arithmetic only, no pointers);
* a **prologue** of two statements: ``lid`` (thread index in its threadgroup) and
  ``group`` (threadgroup index in the grid);
* the **body**, identical for both backends.

Every launch is one-dimensional: ``groups`` threadgroups of ``threads`` threads
(the grid is ``groups * threads``, a whole number of threadgroups, so no thread is
outside a group and every thread reaches every barrier).
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import hashlib
import itertools
import threading
from dataclasses import dataclass
from typing import Callable, Iterator, Optional, Sequence

import mlx.core as mx

from . import backend
from .sources import CUDA, METAL

Kernel = Callable[..., list]

HEADERS: dict[str, str] = {
    METAL: """
#define DFL_SHARED threadgroup
#define DFL_BARRIER() threadgroup_barrier(mem_flags::mem_threadgroup)
#define DFL_FN inline
#define DFL_EXP(x) exp(x)
#define DFL_TANH(x) tanh(x)
#define DFL_FMA(a, b, c) fma(a, b, c)
#define DFL_FMAX(a, b) fmax(a, b)
#define DFL_UNROLL8
""",
    CUDA: """
#define DFL_SHARED __shared__
#define DFL_BARRIER() __syncthreads()
#define DFL_FN __device__ inline
#define DFL_EXP(x) expf(x)
#define DFL_TANH(x) tanhf(x)
#define DFL_FMA(a, b, c) fmaf(a, b, c)
#define DFL_FMAX(a, b) fmaxf(a, b)
#define DFL_UNROLL8 _Pragma("unroll 8")
""",
}

PROLOGUES: dict[str, str] = {
    METAL: (
        "  const uint32_t lid = thread_position_in_threadgroup.x;\n"
        "  const uint32_t group = threadgroup_position_in_grid.x;\n"
    ),
    CUDA: (
        "  const uint32_t lid = threadIdx.x;\n" "  const uint32_t group = blockIdx.x;\n"
    ),
}


def indent(text: str, spaces: int) -> str:
    """``text`` with ``spaces`` more spaces before every non-empty line (body text)."""
    pad = " " * spaces
    return "".join(
        pad + line if line.strip() else line for line in text.splitlines(True)
    )


# Compared and hashed by identity: each spec is one module-level (or memoised) object,
# and launches look its kernel up on every call.
@dataclass(frozen=True, eq=False)
class GroupKernelSpec:
    """One threadgroup kernel: names, shared helper text and shared body.

    Attributes:
        base: Kernel family name.
        input_names: Parameter names of the inputs, in launch order.
        output_names: Parameter names of the outputs.
        input_types: Element type of each input: ``"T"`` (the template type),
            ``"int32"``, ``"uint32"`` or ``"float32"``.
        output_types: Element type of each output, as ``input_types``.
        helpers: Shared helper functions (``DFL_FN`` functions, no pointers).
        body: Shared body (all index arithmetic and maths).
        threads: Threads per threadgroup the body is written for.
        small_inputs: Inputs that always hold fewer than 8 elements (mlx binds
            them in Metal's ``constant`` address space).
        backends: The backends the body is written for (a body using tensor-core
            instructions is CUDA's alone).
        shared_memory: Dynamic shared memory per threadgroup in bytes (CUDA's
            ``extern __shared__``; 0: none).
        dtypes: The template types ``T`` the body is written for.
        cluster: CTAs of a thread-block cluster (CUDA; 1: none). The header
            declares it (``__cluster_dims__``); a launch's CTAs must fill whole
            clusters, and the emulator runs a cluster's CTAs together.
    """

    base: str
    input_names: tuple[str, ...]
    input_types: tuple[str, ...]
    output_names: tuple[str, ...]
    output_types: tuple[str, ...]
    helpers: str
    body: str
    threads: int
    small_inputs: tuple[str, ...] = ()
    backends: tuple[str, ...] = (METAL, CUDA)
    shared_memory: int = 0
    dtypes: tuple[mx.Dtype, ...] = (mx.float32, mx.float16, mx.bfloat16)
    cluster: int = 1

    def header(self, backend_name: str) -> str:
        """The ``header=`` text for ``backend_name``: its macros, then the helpers."""
        return HEADERS[backend_name] + self.helpers

    def source(self, backend_name: str) -> str:
        """The kernel source for ``backend_name``: its prologue, then the body."""
        return PROLOGUES[backend_name] + self.body

    def name(self, backend_name: str) -> str:
        """Kernel name, unique per header and source text (mlx caches by name)."""
        text = self.header(backend_name) + self.source(backend_name)
        digest = hashlib.sha1(text.encode()).hexdigest()[:10]
        return f"dflash_{self.base}_{digest}"


def build_group_kernel(
    spec: GroupKernelSpec, backend_name: Optional[str]
) -> Optional[Kernel]:
    """Build the mlx custom-kernel object for ``spec`` (None without a GPU backend).

    Args:
        spec: Kernel contract.
        backend_name: ``"metal"``, ``"cuda"`` or None.

    Returns:
        The callable from ``mx.fast.metal_kernel`` / ``mx.fast.cuda_kernel``, or None
        (also for a backend the spec's body is not written for).
    """
    if backend_name is None or backend_name not in spec.backends:
        return None
    fields = {}
    if spec.shared_memory:
        fields["shared_memory"] = spec.shared_memory
    return backend.make_kernel(
        backend_name,
        name=spec.name(backend_name),
        input_names=list(spec.input_names),
        output_names=list(spec.output_names),
        source=spec.source(backend_name),
        header=spec.header(backend_name),
        **fields,
    )


@functools.lru_cache(maxsize=None)
def group_kernel_for(spec: GroupKernelSpec) -> Optional[Kernel]:
    """The kernel object for ``spec`` on this process's backend, built once."""
    return build_group_kernel(spec, backend.BACKEND)


def launch_groups(
    spec: GroupKernelSpec,
    inputs: list[mx.array],
    output_shapes: Sequence[tuple[int, ...]],
    output_dtypes: Sequence[mx.Dtype],
    groups: int,
    dtype: mx.Dtype,
) -> list[mx.array]:
    """Launch ``groups`` threadgroups of ``spec.threads`` threads.

    Tests replace this function (module attribute) with a CPU emulation of the
    Metal form; the wrappers always call it through the module. The kernel object
    and mlx's launch arguments are worked out once per spec and geometry.

    Args:
        spec: Kernel contract.
        inputs: Inputs in the spec's order, as a list (handed to mlx as it is).
        output_shapes: Output shapes.
        output_dtypes: Output dtypes.
        groups: Number of threadgroups (at least 1).
        dtype: The template type ``T`` (the element type of the model's arrays).

    Returns:
        The kernel's outputs.
    """
    key = (spec, tuple(output_shapes), tuple(output_dtypes), groups, dtype)
    launch = _LAUNCHES.get(key)
    if launch is None:
        if len(_LAUNCHES) >= MAX_LAUNCHES:  # geometries of long-gone contexts
            _LAUNCHES.clear()
        launch = _LAUNCHES[key] = _launch_arguments(*key)
    kernel, arguments = launch
    return backend.call_kernel(kernel, spec.base, inputs, **arguments)


# mlx's launch arguments per (spec, output shapes, output dtypes, groups, dtype).
MAX_LAUNCHES = 4096
_LAUNCHES: dict[tuple, tuple[Optional[Kernel], dict]] = {}


def launch_replayed(
    spec: GroupKernelSpec,
    inputs: list[mx.array],
    output_shapes: Sequence[tuple[int, ...]],
    output_dtypes: Sequence[mx.Dtype],
    groups: int,
    dtype: mx.Dtype,
) -> list[mx.array]:
    """:func:`launch_groups` through one ``mx.compile`` trace per launch geometry where
    :func:`backend.compile_wanted` (CUDA by default), else as it is.

    mlx's binding of a custom kernel builds the kernel's whole source string at every
    call (about 15-20 µs of host time a launch on the H200's host, against ~1.5 µs for
    one of mlx's own ops); a replayed trace adds the same ``CustomKernel`` primitive
    without it, so the same launch and the same bits. Every runtime value must be an
    input (the kernels read their scalars from ``params`` arrays), never captured.

    Args: as :func:`launch_groups`.

    Returns:
        The kernel's outputs.
    """
    if not backend.compile_wanted():
        return launch_groups(spec, inputs, output_shapes, output_dtypes, groups, dtype)
    key = (spec, tuple(map(tuple, output_shapes)), tuple(output_dtypes), groups, dtype)
    replay = _REPLAYS.get(key)
    if replay is None:
        if len(_REPLAYS) >= MAX_LAUNCHES:
            _REPLAYS.clear()
        replay = _REPLAYS[key] = backend.compile_traced(
            functools.partial(_launch_positional, key)
        )
    return replay(*inputs)


def _launch_positional(key: tuple, *inputs: mx.array) -> list[mx.array]:
    """:func:`launch_groups` of ``key``'s geometry over positional inputs (what
    :func:`launch_replayed` traces)."""
    spec, output_shapes, output_dtypes, groups, dtype = key
    return launch_groups(
        spec, list(inputs), output_shapes, output_dtypes, groups, dtype
    )


# The compiled launches per (spec, output shapes, output dtypes, groups, dtype).
_REPLAYS: dict[tuple, Callable] = {}


def _launch_arguments(
    spec: GroupKernelSpec,
    output_shapes: tuple,
    output_dtypes: tuple,
    groups: int,
    dtype: mx.Dtype,
) -> tuple[Optional[Kernel], dict]:
    if groups % spec.cluster:
        raise ValueError(
            f"{spec.base}: {groups} threadgroups do not fill clusters of {spec.cluster}"
        )
    arguments = {
        "output_shapes": [tuple(shape) for shape in output_shapes],
        "output_dtypes": list(output_dtypes),
        "grid": (groups * spec.threads, 1, 1),
        "threadgroup": (spec.threads, 1, 1),
        "template": [("T", dtype)],
    }
    return group_kernel_for(spec), arguments


# Fewest elements of a launch's scalar array. mlx's CUDA allocator puts host-made arrays
# of at most 8 bytes in a shared pool of host memory read in place, and every warp read
# them there: measured in session 32, the 4k chunk pass + fold took 29.0 us with its
# 8-byte ``fparams`` against 24.1 padded (where scalars are host-made; see
# :func:`backend.launch_scalars` for where they are not).
MIN_PARAMS = 4


def _padded(values: tuple) -> list:
    """``values`` and zeros up to :data:`MIN_PARAMS` (kernels read their own indices)."""
    return list(values) + [0] * (MIN_PARAMS - len(values))


def int_params(*values: int) -> mx.array:
    """Runtime integer scalars of a launch as an int32 array (memoised, immutable,
    device-made on CUDA: :func:`backend.launch_scalars`; zero-padded to
    :data:`MIN_PARAMS`)."""
    return backend.launch_scalars(_padded(values), mx.int32)


class CounterPool:
    """Zeroed int32 counters, each region handed out once, cut from one fill.

    A launch whose last threadgroup is elected by an atomic needs zeroed counters that
    no other launch shares (mlx may run two launches at once). A fresh ``mx.zeros`` per
    launch costs a fill kernel each (four a decoder layer); regions of one pooled
    array cost one fill per :attr:`size` counters. A region is never handed out twice,
    so launches never share one, whatever mlx runs concurrently.

    Regions are cut ahead, per size asked, :data:`REGIONS_A_CUT` at a time: one slice
    of the fill and one split of it. A region then costs a quarter of a graph node,
    where a slice a region was one node a replay (two a traced layer, each host work
    at every replay; session 61).

    Attributes:
        size: Counters a fill holds.
        fills: Fills made so far.
    """

    def __init__(self, size: int = 1 << 16) -> None:
        self.size = size
        self.fills = 0
        # Per region size: the regions cut and not handed out (last first), and the
        # fill they are cut from with its first counter not cut yet.
        self._cut: dict[int, list[tuple[int, int, mx.array]]] = {}
        self._source: dict[int, tuple[int, mx.array, int]] = {}
        self._lock = threading.Lock()

    def _fill(self) -> mx.array:
        return mx.zeros((self.size,), mx.int32)

    def take(self, count: int) -> mx.array:
        """``count`` (>= 1) zeroed counters no other call of this pool gets."""
        return self.take_located(count)[2]

    def take_located(self, count: int) -> tuple[int, int, mx.array]:
        """:meth:`take`, with where the region lies: ``(fill, start, region)``, the
        fill's number (0 for a region longer than a fill: zeros of its own) and the
        region's first counter in it."""
        if count > self.size:
            return 0, 0, mx.zeros((count,), mx.int32)
        with self._lock:
            regions = self._cut.get(count)
            if not regions:
                regions = self._cut[count] = self._cut_ahead(count)
            return regions.pop()

    def _cut_ahead(self, count: int) -> list[tuple[int, int, mx.array]]:
        """The next regions of ``count`` (last first): a new fill when this size's
        fill has no room left for one."""
        number, fill, start = self._source.get(count, (0, None, self.size))
        if start + count > self.size:
            self.fills += 1
            number, fill, start = self.fills, self._fill(), 0
        regions = min(REGIONS_A_CUT, (self.size - start) // count)
        end = start + regions * count
        block = fill if (start, end) == (0, self.size) else fill[start:end]
        pieces = mx.split(block, regions) if regions > 1 else [block]
        self._source[count] = (number, fill, end)
        return [(number, start + i * count, p) for i, p in enumerate(pieces)][::-1]


# Regions of one size cut at a time: mlx makes a split of up to 10 pieces one node,
# of more one slice a piece.
REGIONS_A_CUT = 8
COUNTER_POOL = CounterPool()


@functools.lru_cache(maxsize=None)
def _unused_counter() -> mx.array:
    """The one-element placeholder bound where a launch elects no threadgroup."""
    return mx.array([0], dtype=mx.int32)


def launch_counters(count: int) -> mx.array:
    """Zeroed int32 counters for one launch whose last threadgroup is elected by an
    atomic, fresh each launch (from :data:`COUNTER_POOL`; under a :func:`counter_feed`
    the next region of its array; inside any other ``mx.compile`` trace a fill of
    their own, as a pool region the trace captured would be shared by every replay);
    for ``count`` 0 a shared one-element placeholder, which the kernel never writes."""
    if not count:
        return _unused_counter()
    feed = _FEED.get()
    if feed is not None:
        return feed.take(count)
    if backend.tracing():
        return mx.zeros((count,), mx.int32)
    return COUNTER_POOL.take(count)


class CounterFeed:
    """Hands out consecutive regions of one counters array (or, with none, counts
    what a call takes from :data:`COUNTER_POOL`).

    A compiled function that launches several counter-taking kernels takes one
    counters array as an input and, while tracing, cuts every launch's region from
    it: each replay is then given a fresh pool region, and no fill runs inside it.
    Given the ``sizes`` a counting feed recorded, the regions are cut by one split
    (a lone region is the array itself): one graph node a replay instead of one a
    launch, each of them host work at every replay (session 61).

    Attributes:
        source: The array regions are cut from (None: counting, regions come from
            the pool).
        taken: Counters handed out so far.
        sizes: Counting: each region's size, in order. Given with ``source``: the
            regions the call will take (it must take exactly these).
    """

    def __init__(
        self, source: Optional[mx.array] = None, sizes: Optional[Sequence[int]] = None
    ) -> None:
        self.source = source
        self.taken = 0
        self.sizes: list[int] = [] if sizes is None else list(sizes)
        self._regions: Optional[list[mx.array]] = None
        self._given = 0  # regions handed out (with sizes given)

    def take(self, count: int) -> mx.array:
        """The next ``count`` counters.

        Raises:
            RuntimeError: the source array has fewer than ``count`` left, or the call
                asks for another region than the ``sizes`` given.
        """
        start, end = self.taken, self.taken + count
        if self.source is None:
            self.taken = end
            self.sizes.append(count)
            return COUNTER_POOL.take(count)
        if end > self.source.shape[0]:
            raise RuntimeError(
                f"a counter feed of {self.source.shape[0]} counters was asked for "
                f"{end}: the call launches more than when it was counted"
            )
        if not self.sizes:
            self.taken = end
            return self.source[start:end]
        index = self._given
        if index >= len(self.sizes) or self.sizes[index] != count:
            raise RuntimeError(
                f"a counter feed counted as regions {self.sizes} was asked for "
                f"{count} counters as region {index}: the call launches otherwise "
                "than when it was counted"
            )
        self.taken = end
        self._given += 1
        return self._cut()[index]

    def _cut(self) -> list[mx.array]:
        """The regions of ``sizes``, cut once: the source itself for a lone region,
        else one split."""
        if self._regions is None:
            if sum(self.sizes) != self.source.shape[0]:
                raise RuntimeError(
                    f"a counter feed of {self.source.shape[0]} counters was given "
                    f"regions {self.sizes}"
                )
            if len(self.sizes) == 1:
                self._regions = [self.source]
            else:
                edges = list(itertools.accumulate(self.sizes[:-1]))
                self._regions = mx.split(self.source, edges)
        return self._regions


_FEED: contextvars.ContextVar[Optional[CounterFeed]] = contextvars.ContextVar(
    "dflash_counter_feed", default=None
)


@contextlib.contextmanager
def counter_feed(feed: CounterFeed) -> Iterator[CounterFeed]:
    """Have :func:`launch_counters` take from ``feed`` inside the ``with`` block."""
    token = _FEED.set(feed)
    try:
        yield feed
    finally:
        _FEED.reset(token)


@functools.lru_cache(maxsize=None)
def unused_input(dtype: mx.Dtype) -> mx.array:
    """A one-element stand-in bound to an input a launch never reads (an absent norm
    weight). Scheduled as it is made: a trace capturing it holds a value, not a fill."""
    blank = mx.zeros((1,), dtype)
    mx.async_eval(blank)
    return blank


def float_params(*values: float) -> mx.array:
    """Runtime float scalars of a launch as a float32 array (memoised, immutable,
    device-made on CUDA: :func:`backend.launch_scalars`; zero-padded to
    :data:`MIN_PARAMS`)."""
    return backend.launch_scalars(_padded(values), mx.float32)
