"""Session 33, on the CPU: gathers (pack launches) a DFlash round makes, by set length and
caller, routed as on CUDA (NATIVE_BACKEND faked, launches stubbed, the gather a stand-in)."""
import collections, sys, traceback
import mlx.core as mx
from benchmarks.launch_cost import stubbed_launches
from dflash import kernel_patch
from dflash.bench.runs import replay_mode, timed_run
from dflash.bench.scale import build_scale_pair, scale_prompts
from dflash.greedy import greedy_reference_with_margins
from dflash.metal import backend

target, drafter = build_scale_pair("tiny", "4bit", 0)
prompt = scale_prompts(target, 300, 1, 0)[0]
tokens, _ = greedy_reference_with_margins(target, prompt, 64, set())
replay = replay_mode(target, drafter, 8, 6)
packs = collections.Counter()
real_pack = backend.pack_launch
def pack(words):
    frames = [f for f in traceback.extract_stack()[:-1] if "/dflash/" in f.filename or "/metal/" in f.filename]
    where = ";".join(f"{f.filename.split('/')[-1]}:{f.lineno}" for f in frames[-4:-1])
    packs[(len(words), where)] += 1
    return mx.concatenate([mx.array(list(words[2 * i : 2 * i + 2]), dtype=mx.int32) for i in range(len(words) // 2)])
backend.pack_launch = pack
backend.NATIVE_BACKEND = "cuda"
with stubbed_launches():
    with kernel_patch.verify_kernels(target, drafter):
        for count in (32, 64):
            packs.clear()
            record = timed_run(replay, prompt, count, set(), prompt.tolist() + tokens)
            print(count, "tokens", len(record.round_seconds), "rounds", len(target.layers), "layers", sum(packs.values()), "packs", backend._scalars.cache_info())
            for (n, where), k in packs.most_common(12):
                print(f"   {k:5d} words={n:3d} {where}")
