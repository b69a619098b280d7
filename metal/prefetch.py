"""The next matmul's first weights asked into the L2 by a latency-bound launch (CUDA).

A verify layer's 4-bit MLP matmuls read their weights at ~1.6 TB/s of the device's 3.35
(an H100), while the launches between the matmuls (a norm is one CTA a row) leave the
memory idle. Session 59 measured (``benchmarks/l2_prefetch.py``, an H100) that a fused
gate / up whose first 16 MB were asked into the L2 by the launch before it takes 7.5 µs
less (82.7-83.4 -> 75.6-76.3 µs at 16 rows in 6 of 8 timings, 80.8 in two; 76.0-76.2 ->
68.2-69.8 at one row), mlp down 3.4 µs
less, and 32 MB gains no more; a one-wave call (o_proj, the fused q / k / v / gate)
gains under 1 µs even with every byte in the L2 (its fixed costs dominate).

So a launch may carry :data:`FETCHERS` more CTAs that only issue
``prefetch.global.L2`` over byte ranges of another launch's inputs and exit: no store,
no wait, no effect on any result (a prefetch is a hint; the bits cannot move). The
ranges are the first columns' rows of the weights (``(N, K / 8)`` words, a prefix) and
the same columns' scales and biases as the matmul's bind repacked them (chunk-major
``(K / 256, N, ...)``: one run a chunk), so the CTAs of the first column tiles find
all of theirs in the L2.

:func:`with_prefetch` derives such a launch from any :class:`GroupKernelSpec` (CUDA
only): its CTAs past the spec's own come first in the body and return. The residual
norm before a traced layer's MLP carries one for the MLP's fused 4-bit gate / up
(:mod:`dflash.traced_layers`), ``DFLASH_L2_PREFETCH`` megabytes of it (default
:data:`DEFAULT_MEGABYTES`; 0 turns it off). In τ = 6 rounds on an H100 (session 59)
that took the matmuls 393-414 µs less a round and the norms 215-273 µs more (the
prefetch CTAs keep the launch open while they issue): device busy 0.9-3.1 % less, the
same bits. A tensor-core matmul's launch can carry the same CTAs
(``bind_tensor_core``'s ``prefetch=``); session 60 measured o_proj carrying the gate /
up's and the gate / up carrying mlp down's (``benchmarks/carried_prefetch.py``, an
H100): each carrier grew 3.0-4.2 µs, as the norm had, so the norm keeps them.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from dataclasses import dataclass
from typing import Optional, Sequence

import mlx.core as mx

from .groups import GroupKernelSpec
from .sources import CUDA

PREFETCH_ENV = "DFLASH_L2_PREFETCH"
# Session 59: 16 MB gave the fused gate / up its 7.5 µs; 32 MB no more.
DEFAULT_MEGABYTES = 16
# Prefetch CTAs a launch carries (18 MB asked by 32 CTAs took ~5.6 µs of issue).
FETCHERS = 32
LINE = 128
# The words of l2_params before the ranges, and the words of a range.
HEAD_WORDS = 3
RANGE_WORDS = 5
BULK_BYTES = 4096

# l2_params: fetchers, bulk (0: one prefetch.global.L2 a 128-byte line; 1:
# cp.async.bulk.prefetch.L2 of up to BULK_BYTES), range count, then each range as
# (array 0 l2_weight / 1 l2_scales, start, length, stride, repeats), the byte values in
# 16-byte units: ``repeats`` runs of ``length`` bytes every ``stride``. The launch's
# last ``fetchers`` CTAs walk them, piece p of a range being CTA p / THREADS's (mod
# fetchers), thread p % THREADS's; a run's pieces start at the line holding its
# first byte.
WALK = r"""
  if (int(group) >= int(gridDim.x) - l2_params[0]) {
    const int fetchers = l2_params[0];
    const int fetcher = int(group) - (int(gridDim.x) - fetchers);
    const long long piece = l2_params[1] ? (long long)L2_BULK_BYTES : (long long)L2_LINE;
    for (int r = 0; r < l2_params[2]; ++r) {
      const int* range = l2_params + L2_HEAD_WORDS + L2_RANGE_WORDS * r;
      const unsigned char* base = range[0] == 0
          ? reinterpret_cast<const unsigned char*>(l2_weight)
          : reinterpret_cast<const unsigned char*>(l2_scales);
      const long long start = (long long)range[1] * 16;
      const long long length = (long long)range[2] * 16;
      const long long stride = (long long)range[3] * 16;
      // Pieces from the line holding a run's first byte (a line prefetch fetches
      // the line its address lies in): the last may pass the run's end, skipped.
      const long long per_run = (length + L2_LINE - 1 + piece - 1) / piece;
      const long long pieces = per_run * (long long)range[4];
      for (long long p = (long long)fetcher * blockDim.x + lid; p < pieces;
           p += (long long)fetchers * blockDim.x) {
        const long long run = p / per_run;
        const long long low = start + run * stride;
        const long long offset = low - low % L2_LINE + (p - run * per_run) * piece;
        const long long end = low + length;
        if (offset >= end) {
          continue;
        }
        const unsigned char* at = base + offset;
        if (l2_params[1]) {
          const long long left = end - offset;
          asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;\n" ::
                       "l"(at), "r"(int(left < piece ? left : piece)) : "memory");
        } else {
          asm volatile("prefetch.global.L2 [%0];\n" :: "l"(at));
        }
      }
    }
    return;
  }
"""

WALK_CONSTANTS = (
    f"  constexpr int L2_LINE = {LINE};\n"
    f"  constexpr int L2_BULK_BYTES = {BULK_BYTES};\n"
    f"  constexpr int L2_HEAD_WORDS = {HEAD_WORDS};\n"
    f"  constexpr int L2_RANGE_WORDS = {RANGE_WORDS};\n"
)
INPUT_NAMES = ("l2_weight", "l2_scales", "l2_params")
INPUT_TYPES = ("uint32", "uint32", "int32")


def megabytes_wanted(megabytes: Optional[int] = None) -> int:
    """How many megabytes of the next matmul's weights a launch asks into the L2: the
    argument, else ``DFLASH_L2_PREFETCH``, else :data:`DEFAULT_MEGABYTES`; 0 is off.

    Raises:
        ValueError: The value is not a whole number of megabytes from 0 to 1024.
    """
    if megabytes is None:
        text = os.environ.get(PREFETCH_ENV, "").strip()
        if not text:
            return DEFAULT_MEGABYTES
        try:
            megabytes = int(text)
        except ValueError:
            raise ValueError(
                f"{PREFETCH_ENV} must be a whole number of megabytes (0: off), "
                f"got {text!r}"
            ) from None
    if not 0 <= megabytes <= 1024:
        raise ValueError(f"{PREFETCH_ENV} must be 0 to 1024 megabytes, got {megabytes}")
    return megabytes


@functools.lru_cache(maxsize=None)
def with_prefetch(spec: GroupKernelSpec) -> GroupKernelSpec:
    """``spec`` with prefetch CTAs (CUDA only): inputs ``l2_weight``, ``l2_scales`` and
    ``l2_params`` appended, and a launch's last ``l2_params[0]`` CTAs walking the
    ranges and returning before the body (so the body sees its own CTAs as before)."""
    if CUDA not in spec.backends:
        raise ValueError(f"{spec.base} has no CUDA form to carry prefetch CTAs")
    return dataclasses.replace(
        spec,
        base=f"{spec.base}_l2",
        input_names=spec.input_names + INPUT_NAMES,
        input_types=spec.input_types + INPUT_TYPES,
        body=WALK_CONSTANTS + WALK + spec.body,
        backends=(CUDA,),
    )


Range = tuple[int, int, int, int, int]


def prefix_ranges(
    weight_shape: Sequence[int],
    weight_bytes: int,
    scales_shape: Optional[Sequence[int]],
    scales_bytes: int,
    megabytes: int,
) -> list[Range]:
    """The byte ranges of a matmul's first columns: the weights' first rows up to
    ``megabytes`` (whole lines), and the same columns' scales.

    Args:
        weight_shape, weight_bytes: The weights, ``(N, K / 8)`` words.
        scales_shape, scales_bytes: The repack the matmul reads its scales (and
            biases) from: chunk-major ``(K / 256, N, ...)`` (a run a chunk) or mlx's
            ``(N, ...)`` (a prefix); None: none asked for.
        megabytes: How much of the weights to ask for.

    Returns:
        ``(array, start, length, stride, repeats)`` each (array 0 the weights, 1 the
        scales), every byte value a multiple of 16.
    """
    columns = weight_shape[0]
    row_bytes = weight_bytes // columns
    wanted = min(weight_bytes, megabytes * 2**20)
    taken = wanted // row_bytes  # whole columns
    if taken == 0:
        return []
    ranges: list[Range] = [(0, 0, whole_lines(taken * row_bytes), 0, 1)]
    if scales_shape is None:
        return ranges
    if len(scales_shape) == 3 and scales_shape[1] == columns:
        chunks = scales_shape[0]
        per_column = scales_bytes // (chunks * columns)
        run = taken * per_column
        if run % 16 == 0 and per_column * columns % 16 == 0:
            ranges.append((1, 0, run, per_column * columns, chunks))
    elif scales_shape[0] == columns:
        ranges.append((1, 0, whole_lines(taken * (scales_bytes // columns)), 0, 1))
    return ranges


def whole_lines(nbytes: int) -> int:
    """``nbytes`` down to whole 128-byte lines."""
    return nbytes // LINE * LINE


def params_of(ranges: Sequence[Range], fetchers: int, bulk: bool = False) -> list[int]:
    """``l2_params`` for ``ranges`` (see :data:`WALK`).

    Raises:
        ValueError: A byte value is not a multiple of 16, or a value passes int32.
    """
    values = [fetchers, int(bulk), len(ranges)]
    for which, start, length, stride, repeats in ranges:
        if start % 16 or length % 16 or stride % 16:
            raise ValueError(
                f"range {(which, start, length, stride)} is not 16-byte aligned"
            )
        values += [which, start // 16, length // 16, stride // 16, repeats]
    if any(not 0 <= v < 2**31 for v in values):
        raise ValueError("a prefetch range passes int32 in 16-byte units")
    return values


@dataclass(frozen=True, eq=False)
class Prefetch:
    """What a launch's prefetch CTAs read: the arrays and their ``l2_params``.

    Attributes:
        weight: The matmul's weights.
        scales: Its scales repack as ``uint32`` words (a view of the same buffer), or
            the weights again where none is asked for.
        params: ``l2_params`` (evaluated).
        fetchers: The CTAs a launch adds.
        megabytes: The weights' megabytes asked for.
        source: The matmul's ``reads`` it was planned from.
    """

    weight: mx.array
    scales: mx.array
    params: mx.array
    fetchers: int
    megabytes: int
    source: tuple = ()

    @property
    def inputs(self) -> list[mx.array]:
        return [self.weight, self.scales, self.params]

    def plans(self, reads: Sequence[mx.array], megabytes: int) -> bool:
        """Whether this is the plan of ``reads`` (the very arrays) and ``megabytes``."""
        return (
            megabytes == self.megabytes
            and len(reads) == len(self.source)
            and all(a is b for a, b in zip(reads, self.source))
        )


def plan(
    reads: Sequence[mx.array], megabytes: int, fetchers: int = FETCHERS
) -> Optional[Prefetch]:
    """The prefetch of a bound tensor-core matmul's weight stream (its ``reads``:
    the weights, then the scales repack), ``megabytes`` of its weights, asked by
    ``fetchers`` CTAs; None when there is nothing to ask for (0 megabytes, or no
    weights).

    The arrays are evaluated here: a trace must not capture a lazy one.
    """
    if megabytes <= 0 or not reads:
        return None
    weight = reads[0]
    scales = reads[1] if len(reads) > 1 else None
    if scales is not None and scales.shape[-1] * scales.itemsize % 4:
        scales = None  # no uint32 view of its rows: the weights alone
    ranges = prefix_ranges(
        weight.shape,
        weight.nbytes,
        None if scales is None else scales.shape,
        0 if scales is None else scales.nbytes,
        megabytes,
    )
    if not ranges:
        return None
    asks_scales = any(which == 1 for which, *_ in ranges)
    words = mx.view(scales, mx.uint32) if asks_scales else weight
    params = mx.array(params_of(ranges, fetchers), dtype=mx.int32)
    mx.eval(weight, words, params)
    return Prefetch(weight, words, params, fetchers, megabytes, tuple(reads))
