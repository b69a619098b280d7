"""Session 32, on the CPU: launch-scalar lookups and new scalar sets a DFlash round (tiny 4-bit Glimmer,
every verify kernel part on, the kernel path routed as on CUDA with its launches stubbed).
Run: DFLASH_VERIFY_KERNELS=1 PYTHONPATH=. python docs/benchmarks/h200-2026-12-03-s32/count_sets.py
"""
import functools
import mlx.core as mx
from benchmarks.launch_cost import stubbed_launches
from dflash import kernel_patch
from dflash.bench.runs import replay_mode, timed_run
from dflash.bench.scale import build_scale_pair, scale_prompts
from dflash.metal import backend

target, drafter = build_scale_pair("tiny", "4bit", 0)
prompt = scale_prompts(target, 200, 1, 0)[0]
replay = replay_mode(target, drafter, 8, 6)
calls = []
made = []
orig_ls, orig_s = backend.launch_scalars, backend._scalars.__wrapped__
def ls(values, dtype=mx.int32):
    calls.append(1)
    return orig_ls(values, dtype)
def sp(*a):
    made.append(1)
    return orig_s(*a)
backend._scalars = functools.lru_cache(maxsize=2048)(sp)
backend.launch_scalars = ls
with stubbed_launches():
    with kernel_patch.verify_kernels(target, drafter):
        for tokens in (32, 64):
            calls.clear(); made.clear()
            record = timed_run(replay, prompt, tokens, set(), prompt.tolist() + [1] * tokens)
            n = len(record.round_seconds)
            print(tokens, "tokens", n, "rounds", len(calls), "calls", len(made), "new sets", "layers", len(target.layers))
