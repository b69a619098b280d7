"""Session 40: one attention case, `calls` calls with the named fold arm (for Nsight Compute).
argv: context growing|ring count arm calls"""
import dataclasses, sys

import mlx.core as mx

from benchmarks.verify_kernels import GLIMMER, _attention_inputs
from dflash.metal import attention
from dflash.metal.attention import small_query_attention

context, kind, count, arm, calls = int(sys.argv[1]), sys.argv[2], int(sys.argv[3]), sys.argv[4], int(sys.argv[5])
if arm == "loops":
    attention.FOLD_CHUNKS = dataclasses.replace(
        attention.FOLD_CHUNKS, base="fold_chunks_loops",
        body=attention.FOLD_CHUNKS.body.replace(attention.FOLD_CHUNKS_BODY, attention.fold_body(0)))
ring = kind == "ring"
q, plane, bk, bv = _attention_inputs(GLIMMER, context, count, ring)
stored = mx.contiguous(q.transpose(0, 2, 1, 3))
mx.eval(stored)
q = stored.transpose(0, 2, 1, 3)
for _ in range(calls):
    mx.eval(small_query_attention(q, plane, bk, bv, scale=GLIMMER.dim ** -0.5,
                                  window=GLIMMER.window if ring else None, use_kernel=True))
print("done", arm, attention.FOLD_CHUNKS.name("cuda"))
