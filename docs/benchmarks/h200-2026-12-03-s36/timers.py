"""Session 36: timers around the traced layer's pieces (module-level wraps; acc in seconds)."""
import os
import time
from dflash import traced_layers
from dflash.metal import attention, groups, heads

acc = {}


def wrap(owner, name, label):
    f = getattr(owner, name)

    def timed(*a, **k):
        t = time.perf_counter()
        try:
            return f(*a, **k)
        finally:
            acc[label] = acc.get(label, 0.0) + time.perf_counter() - t

    setattr(owner, name, timed)


def install(model, drafter=None):
    wrap(type(model), "__call__", "model")
    if drafter is not None:
        wrap(type(drafter), "__call__", "drafter")
    wrap(traced_layers, "layer_forward", "layer")
    if os.environ.get("S36_ONLY_MODEL") == "1":
        return
    wrap(traced_layers, "_traces", "layer.traces")
    wrap(traced_layers, "prep_of", "layer.prep_of")
    wrap(heads, "head_prep_ints", "layer.head_prep_ints")
    wrap(attention, "make_plan", "layer.make_plan")
    wrap(attention, "kernel_form", "layer.kernel_form")
    wrap(attention, "bound_arrays", "layer.bound_arrays")
    wrap(groups, "float_params", "layer.float_params")
    replay_call = traced_layers._Replay.__call__

    def replay(self, *inputs):
        t = time.perf_counter()
        try:
            return replay_call(self, *inputs)
        finally:
            label = "layer.replay_pre" if len(inputs) == 2 else "layer.replay_post"
            acc[label] = acc.get(label, 0.0) + time.perf_counter() - t

    traced_layers._Replay.__call__ = replay
    pool_take = groups.COUNTER_POOL.take

    def take(n):
        t = time.perf_counter()
        try:
            return pool_take(n)
        finally:
            acc["layer.pool_take"] = acc.get("layer.pool_take", 0.0) + time.perf_counter() - t

    groups.COUNTER_POOL.take = take
