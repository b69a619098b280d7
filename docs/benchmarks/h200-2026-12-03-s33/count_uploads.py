"""Session 33, on the CPU: host-made arrays (mx.array of host data, > 8 bytes) a DFlash round
makes, by call site (tiny 4-bit Glimmer, every verify kernel part on, routed as on CUDA with
launches stubbed; NATIVE_BACKEND faked too so launch scalars take the gather route).
Run: DFLASH_VERIFY_KERNELS=1 PYTHONPATH=. python .sweep/s33/count_uploads.py [scale] [context]
"""
import collections, sys, traceback
import numpy as np
import mlx.core as mx
from benchmarks.launch_cost import stubbed_launches
from dflash import kernel_patch
from dflash.bench.runs import replay_mode, timed_run
from dflash.bench.scale import build_scale_pair, scale_prompts
from dflash.greedy import greedy_reference_with_margins
from dflash.metal import backend

scale = sys.argv[1] if len(sys.argv) > 1 else "tiny"
context = int(sys.argv[2]) if len(sys.argv) > 2 else 300
sites = collections.Counter()
real = mx.array


class _Meta(type):
    def __instancecheck__(cls, obj):
        return isinstance(obj, real)

    def __call__(cls, *args, **kwargs):
        out = real(*args, **kwargs)
        if args and not isinstance(args[0], real) and out.nbytes > 8:
            frames = [f for f in traceback.extract_stack()[:-1] if "/dflash/" in f.filename or "/metal/" in f.filename]
            where = ";".join(f"{f.filename.split('/')[-1]}:{f.lineno}" for f in frames[-2:])
            sites[(where, out.nbytes)] += 1
        return out


class HookedArray(metaclass=_Meta):
    pass


class Proxy:
    def __getattr__(self, name):
        return HookedArray if name == "array" else getattr(mx, name)


target, drafter = build_scale_pair(scale, "4bit", 0)
prompt = scale_prompts(target, context, 1, 0)[0]
tokens, _ = greedy_reference_with_margins(target, prompt, 48, set())
replay = replay_mode(target, drafter, 8 if scale == "tiny" else 16, 6)
for name, module in list(sys.modules.items()):
    if (name.startswith("dflash") or name.startswith("metal")) and getattr(module, "mx", None) is mx:
        module.mx = Proxy()
backend.NATIVE_BACKEND = "cuda"
# The gather's stand-in: its 8-byte pair arrays (pool memory, not counted), joined by an op.
backend.pack_launch = lambda words: mx.concatenate(
    [real(list(words[2 * i : 2 * i + 2]), dtype=mx.int32) for i in range(len(words) // 2)]
)
with stubbed_launches():
    with kernel_patch.verify_kernels(target, drafter):
        for count in (16, 48):
            sites.clear()
            record = timed_run(replay, prompt, count, set(), prompt.tolist() + tokens)
            n = len(record.round_seconds)
            print(f"{count} tokens, {n} rounds, {len(target.layers)} layers; host-made arrays > 8 bytes:")
            for (where, nbytes), k in sorted(sites.items(), key=lambda x: -x[1]):
                print(f"  {k:5d}  {nbytes:7d} B  {where}")
