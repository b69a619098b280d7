"""Session 33, on the CPU: gathers a DFlash round makes at Glimmer's full head geometry
(hidden 6656, 32/2 heads x 128, window 2048), 8 layers, small MLP and vocabulary; routed as on
CUDA (NATIVE_BACKEND faked, launches stubbed, the gather a stand-in). Counts packs by words
and caller, and which scalar sets recur."""
import collections, sys, traceback
import mlx.core as mx
from benchmarks.launch_cost import stubbed_launches
from dflash import kernel_patch
from dflash.bench import scale, scale_target
from dflash.bench.runs import replay_mode, timed_run
from dflash.bench.scale import scale_prompts
from dflash.drafter import DFlashDrafter
from dflash.greedy import greedy_reference_with_margins
from dflash.metal import backend

LAYERS = 4
scale_target.GEOMETRIES["mid"] = dict(num_hidden_layers=LAYERS, intermediate_size=1024, vocab_size=2048, sliding_window=64,
                                      layer_types=["sliding_attention"] * 3 + ["full_attention"],
                                      layer_rope_theta=[500000.0] * 3 + [0])
target = scale_target.build_target("mid", "4bit", 0)
import json
from dflash.loader import config_from_dict
raw = json.loads(scale.ASSISTANT_CONFIG.read_text())
raw.update(sliding_window=64, num_hidden_layers=1, layer_types=["sliding_attention"], intermediate_size=1024,
           target_layer_ids=[0, 1, 2, 3], mask_token_id=2047)
args = target.args
from dataclasses import replace
cfg = replace(config_from_dict(raw), vocab_size=args.vocab_size, num_target_layers=args.num_hidden_layers,
              output_multiplier=args.output_multiplier, final_logit_softcapping=args.final_logit_softcapping)
drafter = DFlashDrafter(cfg)
scale_target.randomize(drafter, 1, mx.bfloat16)
drafter.eval(); drafter.bind(target)
context = int(sys.argv[1]) if len(sys.argv) > 1 else 2200
prompt = scale_prompts(target, context, 1, 0)[0]
tokens = [int(t) for t in mx.random.randint(0, 2048, (64,)).tolist()]
replay = replay_mode(target, drafter, 16, 6)
packs = collections.Counter()
sets = collections.Counter()
def pack(words):
    frames = [f for f in traceback.extract_stack()[:-1] if "/dflash/" in f.filename or "/metal/" in f.filename]
    where = ";".join(f"{f.filename.split('/')[-1]}:{f.lineno}" for f in frames[-5:-1])
    packs[(len(words), where)] += 1
    sets[tuple(words)] += 1
    return mx.concatenate([mx.array(list(words[2 * i : 2 * i + 2]), dtype=mx.int32) for i in range(len(words) // 2)])
backend.pack_launch = pack
backend.NATIVE_BACKEND = "cuda"
with stubbed_launches():
    with kernel_patch.verify_kernels(target, drafter):
        for count in (32, 64):
            packs.clear(); sets.clear()
            record = timed_run(replay, prompt, count, set(), prompt.tolist() + tokens)
            print(count, "tokens", len(record.round_seconds), "rounds", LAYERS, "layers", sum(packs.values()), "packs", backend._scalars.cache_info(), flush=True)
            for (n, where), k in packs.most_common(14):
                print(f"   {k:5d} words={n:3d} {where}")
            print("   sets made more than once:", sum(1 for v in sets.values() if v > 1), "of", len(sets))
            for s, k in list(sets.items())[:12]:
                print("     ", k, s)
