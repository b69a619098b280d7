"""Session 29 probe: where the drafter's forward goes (full 4-bit Glimmer pair, 4k context).

Times, synced, medians of N: the whole draft (drafter + LM head + argmax), its layers only,
the head only, one layer's MLP and attention; each with the host's enqueue time
(call + async_eval returning) beside the wall time. Patched (held KernelPatch) and not.
"""
import json, statistics, sys, time
import mlx.core as mx
from dflash.bench.scale import build_scale_pair, scale_prompts
from dflash.bench.measure import _prefill_dflash
from dflash import kernel_patch
from mlx_lm.generate import generation_stream

out_path = sys.argv[1]
reps = int(sys.argv[2]) if len(sys.argv) > 2 else 30
scale = sys.argv[3] if len(sys.argv) > 3 else "full"
target, drafter = build_scale_pair(scale, "4bit", 0)
prompt = scale_prompts(target, 4096 if scale == "full" else 64, 1, 0)[0]
H = drafter.config.hidden_size
B = drafter.config.block_size
T = len(drafter.config.target_layer_ids)
result = {}


def timed(fn, reps=reps):
    walls, hosts = [], []
    for i in range(reps + 3):
        mx.synchronize()
        t0 = time.perf_counter()
        out = fn()
        mx.async_eval(out)
        t1 = time.perf_counter()
        mx.eval(out)
        t2 = time.perf_counter()
        if i >= 3:
            walls.append(1000 * (t2 - t0)); hosts.append(1000 * (t1 - t0))
    return {"wall_ms": round(statistics.median(walls), 3), "host_ms": round(statistics.median(hosts), 3),
            "wall_min": round(min(walls), 3)}


with mx.stream(generation_stream):
    cache, context = _prefill_dflash(target, drafter, prompt[:-1])
    mask = drafter.config.mask_token_id
    block = mx.array([[int(prompt[-1].item())] + [mask] * (B - 1)], mx.uint32)
    hidden16 = mx.random.normal((1, B, H)).astype(mx.bfloat16)
    layer0 = drafter.layers[0]
    plane0 = context.planes[0]
    start = context.offset
    taps = mx.random.normal((1, 6, T * H)).astype(mx.bfloat16)
    parts = {
        "draft": lambda: mx.argmax(drafter(block, context)[0, 1:], axis=-1),
        "layers": lambda: drafter.hidden_states(block, context),
        "head": lambda: mx.argmax(drafter.logits(hidden16), axis=-1),
        "mlp0": lambda: layer0.mlp(hidden16),
        "attn0": lambda: layer0.self_attn(hidden16, plane0, drafter._rope, start),
        "layer0": lambda: layer0(hidden16, plane0, drafter._rope, start),
        "fc6": lambda: drafter.hidden_norm(drafter.fc(taps)),
    }
    for mode in ("off", "held", "off2"):
        patch = None
        if mode == "held":
            patch = kernel_patch.verify_kernels(target, drafter)
            print("patch", patch.__enter__(), flush=True)
        result[mode] = {name: timed(fn) for name, fn in parts.items()}
        print(mode, json.dumps(result[mode]), flush=True)
        if patch is not None:
            patch.__exit__(None, None, None)
        json.dump(result, open(out_path, "w"), indent=1)
