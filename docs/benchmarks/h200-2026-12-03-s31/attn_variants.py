"""Session 31: the wide chunk pass with text edits, driven for Nsight Compute.

argv: context, growing|ring, queries, calls, variant. Variants (edits of the shipped text,
timing only: `loadonly` and `computeonly` give wrong outputs on purpose):
  base        the shipped wide body
  loadonly    stage the chunk, skip the tiles' arithmetic (run-time false, still compiled)
  computeonly skip the key/value copies (queries still staged), do the arithmetic
  unroll      #pragma unroll before every loop of the arithmetic
  kfirst      keys (and queries) in one copy group, values in a second: the scores start
              once the keys land
  kfirst_unroll both
"""
import dataclasses
import sys

import mlx.core as mx

from benchmarks.verify_kernels import GLIMMER, _attention_inputs
from dflash.metal import attention, tensor_attention
from dflash.metal.attention import small_query_attention

context, kind, count, calls, variant = (
    int(sys.argv[1]), sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5])
original = tensor_attention.attend_spec


def replace_once(text, old, new):
    assert text.count(old) == 1, (old, text.count(old))
    return text.replace(old, new)


def unroll(body):
    start = body.index("  if (warp_active && seen) {")
    end = body.index("the tiles are read")
    middle = body[start:end].replace("for (", "#pragma unroll\n    for (")
    return body[:start] + middle + body[end:]


def kfirst(body):
    # Keys in group 0 (with the queries), values in group 1.
    body = replace_once(body,
        "    dfl_cp_async16(v_tiles + (g * TILE + r) * PITCH + c, v_src, live);\n  }\n  dfl_cp_async_commit();\n",
        "    asm volatile(\"\" :: \"l\"(v_src));\n  }\n  dfl_cp_async_commit();\n@VLOOP@  dfl_cp_async_commit();\n")
    loop_start = body.index("  for (int idx = int(lid); idx < GROUPS * TILE * VECTORS;")
    loop_end = body.index("  }\n  dfl_cp_async_commit();\n@VLOOP@")
    vloop = body[loop_start:loop_end].replace(
        "    dfl_cp_async16(k_tiles + (g * TILE + r) * PITCH + c, k_src, live);\n",
        "    dfl_cp_async16(v_tiles + (g * TILE + r) * PITCH + c, v_src, live);\n    asm volatile(\"\" :: \"l\"(k_src));\n") + "  }\n"
    body = body.replace("@VLOOP@", vloop)
    body = replace_once(body, "  dfl_cp_async_wait<0>();\n  __syncthreads();\n  if (warp_active && seen) {",
                        "  dfl_cp_async_wait<1>();\n  __syncthreads();\n  uint32_t p_frag[KEY_TILES][2];\n  if (warp_active && seen) {")
    body = replace_once(body, "    uint32_t p_frag[KEY_TILES][2];\n", "")
    body = replace_once(body, "    const T* v_tile = v_tiles + key_tile * TILE * PITCH;\n    const T* q_tile", "    const T* q_tile")
    body = replace_once(body, "  // Weighted values: 16 keys per k-step",
                        "  }\n  dfl_cp_async_wait<0>();\n  __syncthreads();\n  if (warp_active && seen) {\n    const T* v_tile = v_tiles + key_tile * TILE * PITCH;\n  // Weighted values: 16 keys per k-step")
    return body


EDITS = {
    "base": lambda b: b,
    "loadonly": lambda b: replace_once(b, "  if (warp_active && seen) {", "  if (warp_active && seen && params[0] < 0) {"),
    "computeonly": lambda b: replace_once(b, "    if (g >= n_tiles || tile_start", "    if (params[0] >= 0 || g >= n_tiles || tile_start"),
    "unroll": unroll,
    "kfirst": kfirst,
    "kfirst_unroll": lambda b: unroll(kfirst(b)),
}


def edited(dim, layout=tensor_attention.STREAM):
    spec = original(dim, layout)
    if layout is not tensor_attention.WIDE or variant == "base":
        return spec
    return dataclasses.replace(spec, base=spec.base + "_" + variant, body=EDITS[variant](spec.body))


tensor_attention.attend_spec = edited
attention.TENSOR_LAYOUT = tensor_attention.WIDE
ring = kind == "ring"
queries, plane, block_k, block_v = _attention_inputs(GLIMMER, context, count, ring)
outs = []
for _ in range(calls):
    out = small_query_attention(queries, plane, block_k, block_v, scale=GLIMMER.dim ** -0.5,
                                window=GLIMMER.window if ring else None, chunk=attention.CHUNK)
    mx.eval(out)
    outs.append(out)
if variant in ("base", "unroll", "kfirst", "kfirst_unroll") and len(sys.argv) > 6:
    # Check the edit kept the bits of the shipped text (run once with `check`).
    tensor_attention.attend_spec = original
    ref = small_query_attention(queries, plane, block_k, block_v, scale=GLIMMER.dim ** -0.5,
                                window=GLIMMER.window if ring else None, chunk=attention.CHUNK)
    print("same_bits", variant, bool(mx.array_equal(ref, outs[-1]).item()))
print("variant", variant, "name", edited(GLIMMER.dim, tensor_attention.WIDE).name("cuda"), "out", outs[-1].shape)
