"""Session 30: drive the attention call for Nsight Compute. argv: context, growing|ring, queries, calls, layout[, row_fold 0/1 (call B only)]."""
import sys
import mlx.core as mx
from benchmarks.verify_kernels import GLIMMER, _attention_inputs
from dflash.metal import attention, tensor_attention
from dflash.metal.attention import small_query_attention

context, kind, count, calls = int(sys.argv[1]), sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
attention.TENSOR_LAYOUT = tensor_attention.LAYOUTS[sys.argv[5]]
if len(sys.argv) > 6:
    attention.ROW_FOLD = sys.argv[6] == "1"
ring = kind == "ring"
queries, plane, block_k, block_v = _attention_inputs(GLIMMER, context, count, ring)
for _ in range(calls):
    out = small_query_attention(queries, plane, block_k, block_v, scale=GLIMMER.dim ** -0.5,
                                window=GLIMMER.window if ring else None, chunk=attention.CHUNK)
    mx.eval(out)
print("layout", attention.tensor_layout().name, "out", out.shape)
