"""Session 33, on the CPU: an array still lazy when mx.compile traces a function that captures it
is part of the trace (re-run at every replay); evaluated or scheduled first, it is a constant.
Run: python docs/benchmarks/h200-2026-12-03-s33/capture_check.py"""
import time, mlx.core as mx
big = mx.random.normal((1500, 1500)); mx.eval(big)
def run(prep):
    A = (big @ big).sum()          # lazy, costly
    if prep == "eval": mx.eval(A)
    if prep == "async": mx.async_eval(A)
    f = mx.compile(lambda x: x + A)
    x = mx.array(1.0)
    mx.eval(f(x))
    t = time.perf_counter()
    for i in range(20):
        mx.eval(f(x + i))
    return (time.perf_counter() - t) / 20 * 1e3
for prep in ("lazy", "eval", "async", "lazy"):
    print(prep, round(run(prep), 3), "ms per replay")
