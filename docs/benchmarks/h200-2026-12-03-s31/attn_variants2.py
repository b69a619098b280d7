"""Session 31, call B: several chunk-pass variants in one process, for Nsight Compute.

argv: context, growing|ring, queries, variants (comma list). Each variant runs 2 calls
(chunk pass + fold each). Variants (edits of the shipped `wide` text; `nostores` and
`nocombine` give wrong outputs on purpose, timing only):
  base       shipped wide, chunk 256 (16 warps, one CTA an SM)
  wide2      wide with 2 key tiles (8 warps, chunk 128, launch bounds (256, 2): two CTAs an SM)
  nostores   base without the final global stores of the chunk's state
  nocombine  base without the exchange's reads (tile 0 writes its own state only)
  stream     the stream layout, chunk 256
"""
import dataclasses
import sys

import mlx.core as mx

from benchmarks.verify_kernels import GLIMMER, _attention_inputs
from dflash.metal import attention, tensor_attention as ta, tensor_qmm
from dflash.metal.attention import small_query_attention

context, kind, count, variants = int(sys.argv[1]), sys.argv[2], int(sys.argv[3]), sys.argv[4].split(",")
original = ta.attend_spec
original_bytes = ta.shared_bytes
WIDE2 = ta.Layout("wide2", 64, 32 * 4 * 2, 2 * ta.TILE)


def replace_once(text, old, new, count=1):
    assert text.count(old) == count, (old, text.count(old))
    return text.replace(old, new)


def wide2_body(body):
    body = replace_once(body, "  constexpr int THREADS = 512;\n", "  constexpr int THREADS = 256;\n")
    return replace_once(body, "  constexpr int GROUPS = 4;\n", "  constexpr int GROUPS = 2;\n")


def shfl_params(body):
    import re
    lane_load = (
        "  const int dfl_lane = int(lid) % 32;\n"
        "  const int dfl_param = dfl_lane < 17 ? params[dfl_lane] : 0;\n"
        "  const float dfl_fparam = dfl_lane < 2 ? fparams[dfl_lane] : 0.0f;\n")
    body = re.sub(r"params\[(\d+)\]", lambda m: f"__shfl_sync(0xffffffffu, dfl_param, {m.group(1)})", body)
    body = body.replace("f__shfl_sync(0xffffffffu, dfl_param,", "__shfl_sync(0xffffffffu, dfl_fparam,")
    at = body.index("  const int n_heads")
    return body[:at] + lane_load + body[at:]


EDITS = {
    "shfl": shfl_params,
    "nostores": lambda b: replace_once(b, "    if (!row_ok[i]) {\n      continue;", "    if (!row_ok[i] || params[0] >= 0) {\n      continue;"),
    "nocombine": lambda b: replace_once(b, "g < GROUPS; ++g)", "g < (params[0] >= 0 ? 1 : GROUPS); ++g)", 2),
}
variant = "base"


def edited(dim, layout=ta.STREAM):
    if layout is WIDE2:
        spec = original(dim, ta.WIDE)
        helpers = spec.helpers.replace(tensor_qmm.launch_bounds(512, 1), tensor_qmm.launch_bounds(256, 2))
        assert helpers != spec.helpers
        return dataclasses.replace(spec, base="attend_chunks_narrow128", body=wide2_body(spec.body),
                                   helpers=helpers, threads=256,
                                   shared_memory=(2 * 2 * ta.TILE + 64) * (ta.MAX_DIM + ta.PAD) * 2)
    spec = original(dim, layout)
    if layout is not ta.WIDE or variant not in EDITS:
        return spec
    return dataclasses.replace(spec, base=spec.base + "_" + variant, body=EDITS[variant](spec.body))


ta.attend_spec = edited
ring = kind == "ring"
queries, plane, block_k, block_v = _attention_inputs(GLIMMER, context, count, ring)


def call(chunk):
    return small_query_attention(queries, plane, block_k, block_v, scale=GLIMMER.dim ** -0.5,
                                 window=GLIMMER.window if ring else None, chunk=chunk)


attention.TENSOR_LAYOUT = ta.WIDE
reference = call(256)
mx.eval(reference)
for variant in variants:
    layout = {"wide2": WIDE2, "stream": ta.STREAM}.get(variant, ta.WIDE)
    attention.TENSOR_LAYOUT = layout
    chunk = layout.max_chunk if variant == "wide2" else 256
    for _ in range(2):
        out = call(chunk)
        mx.eval(out)
    diff = mx.abs(out.astype(mx.float32) - reference.astype(mx.float32)).max().item()
    print("variant", variant, "kernel", edited(GLIMMER.dim, layout).name("cuda"),
          "same_bits", bool(mx.array_equal(out, reference).item()), "max_diff", diff, flush=True)
