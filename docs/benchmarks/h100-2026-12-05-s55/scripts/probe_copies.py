"""Session 55 probe: kernels per call of one bound 4-bit matmul, chunk-major vs interleaved
scales, eager / compiled / bound inside a trace, 1 and 16 rows, plain and member-major."""
import mlx.core as mx

from benchmarks import matmul_variants
from benchmarks.common import cupti_kernel_events
from dflash.metal import backend, qmm

SHAPES = {"o_proj": (4096, 6656, ()), "qkvg": (6656, 8704, (4096, 4352, 4608)), "gateup": (6656, 39936, ())}


def kernels(fn):
    mx.eval(fn())
    mx.eval(fn())
    events = cupti_kernel_events(lambda: mx.eval(fn()))
    return [name[:90] for name, _, _ in events]


for variant in ("current", "interleaved"):
    with matmul_variants.variant(**matmul_variants.VARIANTS[variant]):
        for shape, (depth, columns, members) in SHAPES.items():
            dense = (0.02 * mx.random.normal((columns, depth))).astype(mx.bfloat16)
            w, s, b = mx.quantize(dense, group_size=64, bits=4)
            mx.eval(w, s, b)
            for rows in (1, 16):
                x = mx.random.normal((rows, depth)).astype(mx.bfloat16)
                mx.eval(x)
                for mode in ("eager", "compiled", "bound-in-trace"):
                    try:
                        if mode == "bound-in-trace":
                            def outer(x, w=w, s=s, b=b):
                                m = qmm.bind_matmul(x.shape, x.dtype, w, s, b, bits=4, group_size=64, use_kernel=True, members=members)
                                return m(x)
                            f = backend.compile_traced(outer)
                            fn = lambda f=f, x=x: f(x)
                        else:
                            m = qmm.bind_matmul(x.shape, x.dtype, w, s, b, bits=4, group_size=64, use_kernel=True, members=members)
                            f = qmm.compile_around(m, m) if mode == "compiled" else m
                            fn = lambda f=f, x=x: f(x)
                        names = kernels(fn)
                    except Exception as e:  # noqa: BLE001
                        names = [f"ERROR {type(e).__name__}: {e}"[:200]]
                    print(variant, shape, rows, mode, len(names), names)
