"""Session 34: full-size 4-bit Glimmer, replay tau = 6, 4k prompt, 96 tokens, default kernel patch.
Warm-up, then RUNS timed decodes (and one mlx-lm plain decode for scale); meant to run under
`py-spy record --native` so the host's time in the decode can be split by frame.
argv: out.json [runs]"""
import json, os, sys, time
import mlx.core as mx
from dflash import kernel_patch
from dflash.bench.runs import plain_mode, replay_mode, timed_run
from dflash.bench.scale import build_scale_pair, scale_prompts
from dflash.greedy import greedy_reference_with_margins

if os.environ.get("S34_FULL_TEXT") == "1":  # the arm before session 34: full kernel texts
    from dflash.metal import backend as _backend
    _backend.compact_text = lambda text: text
out = sys.argv[1]
runs = int(sys.argv[2]) if len(sys.argv) > 2 else 6
t0 = time.time()
target, drafter = build_scale_pair(os.environ.get("S34_SCALE", "full"), "4bit", 0)
prompt = scale_prompts(target, 4096 if os.environ.get("S34_SCALE", "full") == "full" else 200, 1, 0)[0]
tokens, _ = greedy_reference_with_margins(target, prompt, 96, set())
sequence = prompt.tolist() + tokens
plain = plain_mode(target)
replay = replay_mode(target, drafter, 16 if os.environ.get("S34_SCALE", "full") == "full" else 8, 6)
result = {"setup_s": round(time.time() - t0, 1), "env": {k: v for k, v in os.environ.items() if k.startswith(("MLX_", "DFLASH_"))}}
print("setup", result, flush=True)
rec = timed_run(plain, prompt, 96, set(), sequence)
result["plain_ms"] = round(1000 * rec.decode_seconds, 1)
with kernel_patch.verify_kernels(target, drafter):
    for _ in range(2):
        timed_run(replay, prompt, 96, set(), sequence)
    import subprocess
    spy_out = os.environ.get("SPY_OUT")
    spy = None
    if spy_out:
        spy = subprocess.Popen([os.environ.get("SPY_BIN", ".sweep/s60/py-spy"), "record", "--pid", str(os.getpid()), "--native",
                                "--rate", os.environ.get("SPY_RATE", "100"), "--duration", os.environ.get("SPY_SECONDS", "10"),
                                "--format", "raw", "-o", spy_out], stdout=subprocess.DEVNULL, stderr=open(spy_out + ".err", "w"))
        time.sleep(float(os.environ.get("SPY_WAIT", "1.5")))
    print("MARK start", time.time(), flush=True)
    rows = []
    for _ in range(runs):
        record = timed_run(replay, prompt, 96, set(), sequence)
        rows.append({"decode_ms": round(1000 * record.decode_seconds, 1),
                     "lossless": list(record.tokens) == tokens[: len(record.tokens)],
                     "rounds": len(record.round_seconds),
                     "round_ms": sorted(round(1000 * s, 2) for s in record.round_seconds)})
        print({k: v for k, v in rows[-1].items() if k != "round_ms"}, flush=True)
    print("MARK end", time.time(), flush=True)
    if spy is not None:
        spy.wait(timeout=60)
result["runs"] = rows
ds = sorted(r["decode_ms"] for r in rows)
result["decode_median_ms"] = ds[len(ds) // 2]
result["x_plain"] = round(result["plain_ms"] / result["decode_median_ms"], 2)
print("summary", result["plain_ms"], ds, result["x_plain"], flush=True)
json.dump(result, open(out, "w"), indent=1)
