"""Session 34, CPU: host cost of the verify forward at Glimmer's full head geometry, routed as on
CUDA (launches stubbed as lazy zeros), 8 layers (6 sliding + 2 full), small MLP/vocab.
Prints per-layer build time of a 16-token verify forward, primitive counts of one forward's graph,
and a cProfile of builds."""
import collections, cProfile, io, json, pstats, re, sys, tempfile, time
from dataclasses import replace
import mlx.core as mx
from benchmarks.launch_cost import stubbed_launches
from dflash import kernel_patch
from dflash.bench import scale, scale_target
from dflash.metal import backend
from dflash.loader import config_from_dict
from dflash.drafter import DFlashDrafter
from dflash.bench.scale import scale_prompts

LAYERS = int(sys.argv[1]) if len(sys.argv) > 1 else 8
CONTEXT = int(sys.argv[2]) if len(sys.argv) > 2 else 300
scale_target.GEOMETRIES["mid"] = dict(num_hidden_layers=LAYERS, hidden_size=int(__import__("os").environ.get("HIDDEN", 6656)), intermediate_size=1024, vocab_size=2048, sliding_window=64,
    layer_types=(["sliding_attention"] * 3 + ["full_attention"]) * (LAYERS // 4),
    layer_rope_theta=([500000.0] * 3 + [0]) * (LAYERS // 4))
target = scale_target.build_target("mid", "4bit", 0)
raw = json.loads(scale.ASSISTANT_CONFIG.read_text())
raw.update(hidden_size=int(__import__("os").environ.get("HIDDEN", 6656)), sliding_window=64, num_hidden_layers=1, layer_types=["sliding_attention"], intermediate_size=1024,
           target_layer_ids=[0, 1, 2, 3], mask_token_id=2047)
args = target.args
cfg = replace(config_from_dict(raw), vocab_size=args.vocab_size, num_target_layers=args.num_hidden_layers,
              output_multiplier=args.output_multiplier, final_logit_softcapping=args.final_logit_softcapping)
drafter = DFlashDrafter(cfg)
scale_target.randomize(drafter, 1, mx.bfloat16)
drafter.eval(); drafter.bind(target)
prompt = scale_prompts(target, CONTEXT, 1, 0)[0]
backend.NATIVE_BACKEND = "cuda"
backend.pack_launch = lambda words: mx.array(list(words), dtype=mx.uint32)


from dflash.bench.runs import replay_mode, timed_run
from dflash import traced_layers
tokens = [int(t) for t in mx.random.randint(0, 2048, (int(sys.argv[3]) if len(sys.argv) > 3 else 96,)).tolist()]
replay = replay_mode(target, drafter, 16, 6)

def count_graph(out):
    with tempfile.NamedTemporaryFile("w", suffix=".dot", delete=False) as f:
        name = f.name
    mx.export_to_dot(name, out)
    text = open(name).read()
    return collections.Counter(re.findall(r'label\s*=\s*"([A-Za-z_]+)', text))

times = []
orig = traced_layers.layer_forward
def timed(layer, x, *a, **k):
    t0 = time.perf_counter(); out = orig(layer, x, *a, **k); times.append((x.shape[1], time.perf_counter() - t0)); return out
traced_layers.layer_forward = timed
import dflash.kernel_patch as kp
if getattr(kp, "layer_forward", None) is orig: kp.layer_forward = timed
counted = {}
model_cls = type(target)
orig_call = model_cls.__call__
def call(self, inputs, *a, **k):
    t0 = time.perf_counter()
    out = orig_call(self, inputs, *a, **k)
    if inputs.shape[-1] == 16:
        counted.setdefault("build", []).append(time.perf_counter() - t0)
        if "ops" not in counted:
            counted["ops"] = count_graph(out)
    return out
model_cls.__call__ = call
print("built", time.perf_counter(), flush=True)
with stubbed_launches():
    with kernel_patch.verify_kernels(target, drafter):
        rec = timed_run(replay, prompt, len(tokens), set(), prompt.tolist() + tokens)
        print("warm run done", time.perf_counter(), flush=True)
        times.clear(); counted.clear()
        rec = timed_run(replay, prompt, len(tokens), set(), prompt.tolist() + tokens)
        ver = sorted(t for n, t in times if n == 16)
        print("layer_forward calls (16 rows):", len(ver), "median us", round(ver[len(ver)//2]*1e6,1), "min", round(ver[0]*1e6,1), flush=True)
        b = sorted(counted["build"]); print("verify forward build ms median", round(b[len(b)//2]*1e3,2), "per layer us", round(b[len(b)//2]*1e6/LAYERS,1))
        ops = counted["ops"]; print("graph ops", sum(ops.values()), ops.most_common(40), flush=True)
        times.clear()
        pr = cProfile.Profile(); pr.enable()
        rec = timed_run(replay, prompt, len(tokens), set(), prompt.tolist() + tokens)
        pr.disable()
        s = io.StringIO(); pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(40); print(s.getvalue()[:10000])
        st = pstats.Stats(pr, stream=s)
        s2 = io.StringIO(); st.stream = s2
        st.sort_stats("cumulative").print_callees("layer_forward")
        st.sort_stats("cumulative").print_callees("update_and_fetch_block")
        st.sort_stats("cumulative").print_callees("make_plan")
        st.sort_stats("cumulative").print_callees(r"traced_layers.py:\d+\(__call__\)")
        print(s2.getvalue()[:12000])
