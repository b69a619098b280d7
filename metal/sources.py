"""Kernel sources: one shared body per kernel, two thin backend prologues.

Every kernel body below is plain C++ that compiles as Metal Shading Language
and as CUDA: it uses only ``uint32_t``/``int32_t`` arithmetic, array indexing,
``if``/``for``/``switch``. All index arithmetic lives in the body; a backend
adds only a prologue that defines the flat thread index ``gid``:

* Metal: ``thread_position_in_grid.x`` (mlx adds the attribute to the generated
  signature because the source mentions it);
* CUDA: ``blockIdx.x * blockDim.x + threadIdx.x`` (mlx launches
  ``ceil(grid / threadgroup)`` blocks, so bodies bound-check ``gid``).

Address-space qualifiers (``device``/``constant`` on Metal) come from mlx's
generated signature, never from the body, so the body is the same string for
both backends. What the CUDA twin proves on an NVIDIA GPU is therefore the same
index arithmetic that runs on Metal.

Conventions shared by all bodies:

* buffers are seen as ``(A, C, W)`` words (see :mod:`dflash.metal.layout`);
* ``params`` is a small int32 array of runtime scalars whose first entry is the
  thread count ``total``; geometry is passed at run time, not as template
  constants, so a new ring position never triggers a recompile;
* the only template argument is the word type ``T``: it keys mlx's kernel
  caches (the CUDA backend names a kernel by its template arguments only).
"""

from __future__ import annotations

import functools
import hashlib
from dataclasses import dataclass

METAL = "metal"
CUDA = "cuda"
BACKENDS: tuple[str, ...] = (METAL, CUDA)


def compact_text(text: str) -> str:
    """``text`` without comments, indentation or blank lines: the kernel text mlx is
    handed.

    mlx's CUDA backend hashes a custom kernel's whole source at every launch (to name
    its JIT module; 7-10 % of a 4-bit decode's host time in session 34), so
    a byte the compiler never needed costs host time at every launch. Tokens, string
    and character literals and line breaks between kept lines stay as they are
    (preprocessor lines end at them), and an empty line that ends a continued macro
    is kept.

    Args:
        text: C++ / CUDA / Metal source.

    Returns:
        The same program in fewer bytes.

    Raises:
        ValueError: A block comment is not closed, or a line comment ends in a
            backslash (it would swallow the next line, which compaction cannot keep).
    """
    code, index, quote = [], 0, None
    while index < len(text):
        char = text[index]
        if quote is not None:
            escaped = char == "\\" and index + 1 < len(text)
            code.append(text[index : index + 2] if escaped else char)
            quote = None if char == quote else quote
            index += 2 if escaped else 1
        elif char in "\"'":
            quote = char
            code.append(char)
            index += 1
        elif text.startswith("//", index):
            end = text.find("\n", index)
            end = len(text) if end < 0 else end
            if text[index:end].rstrip().endswith("\\"):
                raise ValueError("a line comment ends in a backslash")
            index = end
        elif text.startswith("/*", index):
            end = text.find("*/", index + 2)
            if end < 0:
                raise ValueError("a block comment is not closed")
            code.append(" ")  # a comment separates tokens
            index = end + 2
        else:
            code.append(char)
            index += 1
    kept: list[str] = []
    for line in "".join(code).split("\n"):
        line = line.strip()
        if line or (kept and kept[-1].endswith("\\")):
            kept.append(line)
    return "".join(f"{line}\n" for line in kept)


PROLOGUES: dict[str, str] = {
    METAL: "  const uint32_t gid = thread_position_in_grid.x;\n",
    CUDA: "  const uint32_t gid = blockIdx.x * blockDim.x + threadIdx.x;\n",
}

# ring_write: out = ring with rows[i] at physical (dest_start + i) % C.
# params: total, A, C, W, S, dest_start. One thread per output word.
RING_WRITE_BODY = """
  const uint32_t total = uint32_t(params[0]);
  if (gid >= total) {
    return;
  }
  const uint32_t cap = uint32_t(params[2]);
  const uint32_t words = uint32_t(params[3]);
  const uint32_t count = uint32_t(params[4]);
  const uint32_t start = uint32_t(params[5]);
  const uint32_t w = gid % words;
  const uint32_t t = gid / words;
  const uint32_t r = t % cap;
  const uint32_t a = t / cap;
  // Block slot whose wrapped destination is physical row r.
  const uint32_t slot = (r + cap - start) % cap;
  if (slot < count) {
    out[gid] = rows[(a * count + slot) * words + w];
  } else {
    out[gid] = ring[gid];
  }
"""

# Index arithmetic shared by both shadows: one thread per shadow word, (a, k, w) =
# (outer slice, shadow row, word). params: total, A, C, W, L, S, origin.
SHADOW_INDEX = """
  const uint32_t total = uint32_t(params[0]);
  if (gid >= total) {
    return;
  }
  const uint32_t cap = uint32_t(params[2]);
  const uint32_t words = uint32_t(params[3]);
  const uint32_t live = uint32_t(params[4]);
  const uint32_t count = uint32_t(params[5]);
  const uint32_t origin = uint32_t(params[6]);
  const uint32_t span = live + count;
  const uint32_t w = gid % words;
  const uint32_t t = gid / words;
  const uint32_t k = t % span;
  const uint32_t a = t / span;
"""

# stage_shadow: out[k] = ring[(origin + k) % C] for k < L, rows[k - L] after.
STAGE_SHADOW_BODY = SHADOW_INDEX + """  if (k < live) {
    out[gid] = ring[(a * cap + (origin + k) % cap) * words + w];
  } else {
    out[gid] = rows[(a * count + (k - live)) * words + w];
  }
"""

# stage_shadow_kv: the staging shadow of a stacked (2, ...) K/V ring, built
# straight from the chunk's separate keys and values, plus the chunk stacked.
# out[a, k] = ring[a, (origin + k) % C] for k < L, else the chunk row k - L of
# keys (a < A/2) or values (a >= A/2); block[a, j] = that chunk row j.
STAGE_SHADOW_KV_BODY = SHADOW_INDEX + """  if (k < live) {
    out[gid] = ring[(a * cap + (origin + k) % cap) * words + w];
    return;
  }
  // Keys fill the first half of the outer slices, values the second.
  const uint32_t half = uint32_t(params[1]) / 2;
  const uint32_t j = k - live;
  const uint32_t dst = (a * count + j) * words + w;
  if (a < half) {
    const uint32_t src = (a * count + j) * words + w;
    out[gid] = keys[src];
    block[dst] = keys[src];
  } else {
    const uint32_t src = ((a - half) * count + j) * words + w;
    out[gid] = values[src];
    block[dst] = values[src];
  }
"""

# retain_rows: out[p, a, j] = plane_p[a, dests[p, j]].
# params: total, A, C, W, n. One thread per output word; the switch only
# selects plane p's pointer (generated per plane count, no arithmetic in it).
RETAIN_ROWS_BODY = """
  const uint32_t total = uint32_t(params[0]);
  if (gid >= total) {
    return;
  }
  const uint32_t outer = uint32_t(params[1]);
  const uint32_t cap = uint32_t(params[2]);
  const uint32_t words = uint32_t(params[3]);
  const uint32_t n = uint32_t(params[4]);
  const uint32_t w = gid % words;
  uint32_t t = gid / words;
  const uint32_t j = t % n;
  t = t / n;
  const uint32_t a = t % outer;
  const uint32_t p = t / outer;
  const uint32_t src = (a * cap + uint32_t(dests[p * n + j])) * words + w;
  switch (p) {
{cases}
    default:
      break;
  }
"""

# restore_rows (fresh outputs): out_p = plane_p with rows[p, :, j] put back at
# physical dests[p, j]. params: total, A, C, W, n. One thread per output word.
RESTORE_ROWS_BODY = """
  const uint32_t total = uint32_t(params[0]);
  if (gid >= total) {
    return;
  }
  const uint32_t outer = uint32_t(params[1]);
  const uint32_t cap = uint32_t(params[2]);
  const uint32_t words = uint32_t(params[3]);
  const uint32_t n = uint32_t(params[4]);
  const uint32_t w = gid % words;
  uint32_t t = gid / words;
  const uint32_t r = t % cap;
  t = t / cap;
  const uint32_t a = t % outer;
  const uint32_t p = t / outer;
  const uint32_t off = (a * cap + r) * words + w;
  // Which retained slot (if any) belongs at physical row r of plane p.
  int32_t hit = -1;
  for (uint32_t j = 0; j < n; ++j) {
    if (uint32_t(dests[p * n + j]) == r) {
      hit = int32_t(j);
    }
  }
  const bool restored = hit >= 0;
  const uint32_t from = ((p * outer + a) * n + uint32_t(restored ? hit : 0)) * words + w;
  switch (p) {
{cases}
    default:
      break;
  }
"""


def _retain_cases(planes: int) -> str:
    return "\n".join(
        f"    case {p}:\n      out[gid] = plane{p}[src];\n      break;"
        for p in range(planes)
    )


def _restore_cases(planes: int) -> str:
    return "\n".join(
        f"    case {p}:\n"
        f"      out{p}[off] = restored ? rows[from] : plane{p}[off];\n"
        f"      break;"
        for p in range(planes)
    )


@dataclass(frozen=True)
class KernelSpec:
    """One kernel contract: names, shared body, per-backend sources.

    Attributes:
        base: Kernel family name (``ring_write``, ...).
        input_names: Parameter names of the inputs, in launch order.
        output_names: Parameter names of the outputs.
        body: Shared body (all index arithmetic).
    """

    base: str
    input_names: tuple[str, ...]
    output_names: tuple[str, ...]
    body: str

    def source(self, backend: str) -> str:
        """Kernel source for ``backend``: its prologue then the shared body."""
        return PROLOGUES[backend] + self.body

    def name(self, backend: str) -> str:
        """Kernel name, unique per source text.

        mlx caches compiled kernels by name (CUDA even on disk, across
        processes), so the name carries a hash of the source: an edited body can
        never be served from a stale cache entry.
        """
        digest = hashlib.sha1(self.source(backend).encode()).hexdigest()[:10]
        return f"dflash_{self.base}_{digest}"


RING_WRITE = KernelSpec(
    "ring_write", ("ring", "rows", "params"), ("out",), RING_WRITE_BODY
)
STAGE_SHADOW = KernelSpec(
    "stage_shadow", ("ring", "rows", "params"), ("out",), STAGE_SHADOW_BODY
)
STAGE_SHADOW_KV = KernelSpec(
    "stage_shadow_kv",
    ("ring", "keys", "values", "params"),
    ("out", "block"),
    STAGE_SHADOW_KV_BODY,
)


@functools.lru_cache(maxsize=None)
def retain_spec(planes: int) -> KernelSpec:
    """Retain kernel over ``planes`` separate plane buffers."""
    names = tuple(f"plane{p}" for p in range(planes)) + ("dests", "params")
    body = RETAIN_ROWS_BODY.replace("{cases}", _retain_cases(planes))
    return KernelSpec(f"retain_rows_p{planes}", names, ("out",), body)


@functools.lru_cache(maxsize=None)
def restore_spec(planes: int) -> KernelSpec:
    """Restore kernel over ``planes`` plane buffers, one fresh output each."""
    names = tuple(f"plane{p}" for p in range(planes)) + ("dests", "rows", "params")
    outputs = tuple(f"out{p}" for p in range(planes))
    body = RESTORE_ROWS_BODY.replace("{cases}", _restore_cases(planes))
    return KernelSpec(f"restore_rows_p{planes}", names, outputs, body)


# Buffer-argument budget of one Metal launch (the argument table has 31 slots,
# and mlx.fast.metal_kernel has no argument buffers): retain binds P planes +
# dests + params + out, restore binds P planes + dests + rows + params + P outs.
# CUDA passes the pointers as kernel parameters: 8 bytes each against the
# classic 4 KiB parameter limit (259 and 323 pointers at these maxima), so all
# 78 K/V ring planes of Muse Glimmer fit one launch of either kernel.
MAX_PLANES: dict[tuple[str, str], int] = {
    (METAL, "retain"): 28,
    (METAL, "restore"): 14,
    (CUDA, "retain"): 256,
    (CUDA, "restore"): 160,
}
