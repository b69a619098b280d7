"""What one short plain generation costs with the default kernels (installed per call)
against mlx-lm's and ours with the kernels off (session 24)."""
import os, time, json, sys
import mlx.core as mx
from mlx_lm.generate import generate_step as mlx_generate_step
from dflash.bench.scale import build_scale_pair, scale_prompts
from dflash.generation import generate_step
from dflash import kernel_patch

t0 = time.perf_counter()
model, _ = build_scale_pair("full", "4bit", seed=0)
prompt = scale_prompts(model, 512, 1, seed=0)[0]
print(f"build {time.perf_counter() - t0:.1f} s", flush=True)

def run(arm, tokens):
    env = {"mlx-lm": None, "off": "0", "default": None}[arm]
    if env is None:
        os.environ.pop(kernel_patch.VERIFY_KERNELS_ENV, None)
    else:
        os.environ[kernel_patch.VERIFY_KERNELS_ENV] = env
    step = mlx_generate_step if arm == "mlx-lm" else generate_step
    start = time.perf_counter()
    out = [int(t) for t, _ in step(prompt, model, max_tokens=tokens)]
    return (time.perf_counter() - start) * 1e3, out

rows = []
for rep in range(3):
    for tokens in (1, 16):
        for arm in ("mlx-lm", "off", "default"):
            ms, out = run(arm, tokens)
            rows.append({"rep": rep, "arm": arm, "tokens": tokens, "ms": round(ms, 1)})
            print(json.dumps(rows[-1]), flush=True)
os.environ.pop(kernel_patch.VERIFY_KERNELS_ENV, None)
# The install alone, and the first token's forwards.
for rep in range(3):
    start = time.perf_counter()
    with kernel_patch.verify_kernels(model) as patch:
        installed = time.perf_counter()
    done = time.perf_counter()
    print(json.dumps({"rep": rep, "install_ms": round((installed - start) * 1e3, 1),
                      "uninstall_ms": round((done - installed) * 1e3, 1),
                      "installed": patch is not None}), flush=True)
