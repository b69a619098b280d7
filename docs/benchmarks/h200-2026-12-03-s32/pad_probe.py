"""Session 32: the chunk pass (and fold) with launch scalar arrays padded to 16 bytes
(groups.MIN_PARAMS = 4, shipped since session 31) against unpadded (1: the 8-byte fparams
back in mlx's small pool), alternating in one process, for Nsight Compute.

argv: context, growing|ring, queries, rounds (each round: pad 4 twice, pad 1 twice).
"""
import sys

import mlx.core as mx

from benchmarks.verify_kernels import GLIMMER, _attention_inputs
from dflash.metal import attention, groups
from dflash.metal.attention import small_query_attention

context, kind, count, rounds = int(sys.argv[1]), sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
ring = kind == "ring"
queries, plane, block_k, block_v = _attention_inputs(GLIMMER, context, count, ring)


def use(pad):
    groups.MIN_PARAMS = pad
    groups.int_params.cache_clear()
    groups.float_params.cache_clear()
    attention._launch.cache_clear()


for _ in range(rounds):
    for pad in (4, 1):
        use(pad)
        for _ in range(2):
            out = small_query_attention(queries, plane, block_k, block_v, scale=GLIMMER.dim ** -0.5,
                                        window=GLIMMER.window if ring else None, chunk=attention.CHUNK)
            mx.eval(out)
        fp = groups.float_params(1.0, 0.0)
        print("pad", pad, "fparams bytes", fp.nbytes, flush=True)
