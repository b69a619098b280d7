"""Head prep vs mlx's ops on this GPU: mismatch fraction and largest difference in ulps,
per tensor, rope on/off, norm-only steps; and each step's own agreement."""

import json, sys
import mlx.core as mx, numpy as np
from dflash.metal import heads as hp


def ulps(a, b, dtype):
    a = np.array(a.astype(mx.float32))
    b = np.array(b.astype(mx.float32))
    diff = a != b
    if not diff.any():
        return 0.0, 0
    step = {mx.bfloat16: 2.0**-7, mx.float16: 2.0**-10, mx.float32: 2.0**-23}[dtype]
    scale = np.maximum(np.abs(b), 1e-30)
    return float(diff.mean()), float((np.abs(a - b) / (scale * step))[diff].max())


out = []
for dtype in (mx.bfloat16, mx.float16, mx.float32):
    for seq, start in ((1, 4096), (16, 4096), (16, 32768), (16, 0)):
        key = mx.random.key(seq + start)
        k1, k2 = mx.random.split(key)
        q = (4 * mx.random.normal((1, seq, 32, 128), key=k1)).astype(dtype)
        k = mx.random.normal((1, seq, 2, 128), key=k2).astype(dtype)
        for rope in (None, 500000.0):
            args = dict(eps=1e-5, q_scale=3.87, rope_base=rope, start=start)
            got = hp.head_prep(q, k, use_kernel=True, **args)
            want = hp.head_prep(q, k, use_kernel=False, **args)
            row = dict(
                dtype=str(dtype),
                seq=seq,
                start=start,
                rope=rope,
                q=ulps(got[0], want[0], dtype),
                k=ulps(got[1], want[1], dtype),
            )
            out.append(row)
            print(json.dumps(row))
json.dump(out, open(sys.argv[1], "w"), indent=1)
