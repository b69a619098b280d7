"""Run a module with Python's collector counted (S62_GC=count) or off (S62_GC=off)."""
import atexit
import gc
import os
import runpy
import sys
import time

mode = os.environ.get("S62_GC", "count")
T0 = time.perf_counter()
stats = {0: [0, 0.0], 1: [0, 0.0], 2: [0, 0.0]}
started = {}


def callback(phase, info):
    if phase == "start":
        started["t"] = time.perf_counter()
    else:
        entry = stats[info["generation"]]
        entry[0] += 1
        took = time.perf_counter() - started.get("t", time.perf_counter())
        entry[1] += took
        if info["generation"] == 2:
            print(f"GC2 at {time.perf_counter() - T0:.2f} s took {took * 1e3:.1f} ms", flush=True)


if mode == "off":
    gc.disable()
gc.callbacks.append(callback)


@atexit.register
def report():
    print(
        "GC", mode,
        " ".join(f"gen{g}: {n} in {t * 1e3:.1f} ms" for g, (n, t) in stats.items()),
        "tracked", len(gc.get_objects()), flush=True,
    )


module = sys.argv[1]
sys.argv = [module] + sys.argv[2:]
runpy.run_module(module, run_name="__main__", alter_sys=True)
