"""Session 29 probe: what a generation call pays for installing the kernels per call
(the default for Python callers) against a held patch (what the server's worker now
does), full 4-bit Glimmer pair, 512-token prompts, DFlash and our plain decoding."""
import json, statistics, sys, time
import mlx.core as mx
from dflash.bench.scale import build_scale_pair, scale_prompts
from dflash.dflash_round import dflash_generate_step
from dflash.generation import generate_step
from dflash import kernel_patch

out_path = sys.argv[1]
scale = sys.argv[2] if len(sys.argv) > 2 else "full"
target, drafter = build_scale_pair(scale, "4bit", 0)
prompts = scale_prompts(target, 512 if scale == "full" else 48, 4, 1)
result = {"runs": []}


def call(kind, prompt, max_tokens):
    mx.synchronize()
    t0 = time.perf_counter()
    if kind == "dflash":
        tokens = [t for t, _, _ in dflash_generate_step(prompt, target, drafter, max_tokens=max_tokens)]
    else:
        tokens = [t for t, _ in generate_step(prompt, target, max_tokens=max_tokens)]
    mx.synchronize()
    return 1000 * (time.perf_counter() - t0), tokens


for rep in range(3):
    for arm in ("per-call", "held"):
        for kind, max_tokens in (("dflash", 32), ("plain", 1), ("plain", 16)):
            patch = kernel_patch.verify_kernels(target, drafter) if arm == "held" else None
            if patch is not None:
                patch.__enter__()
            walls, outs = [], []
            for prompt in prompts:
                wall, tokens = call(kind, prompt, max_tokens)
                walls.append(round(wall, 1)); outs.append(tokens)
            if patch is not None:
                patch.__exit__(None, None, None)
            row = {"rep": rep, "arm": arm, "kind": kind, "max_tokens": max_tokens, "walls_ms": walls,
                   "median_ms": statistics.median(walls), "tokens": outs}
            result["runs"].append(row)
            print(rep, arm, kind, max_tokens, walls, flush=True)
            json.dump(result, open(out_path, "w"))
# The same tokens either way (the kernels are the same; only where they live differs).
by = {}
for row in result["runs"]:
    by.setdefault((row["kind"], row["max_tokens"]), set()).add(json.dumps(row["tokens"]))
result["same_tokens"] = {f"{k}-{n}": len(v) == 1 for (k, n), v in by.items()}
print("same tokens:", result["same_tokens"], flush=True)
json.dump(result, open(out_path, "w"))
