"""Session 37: when the verify forward's layers start on the device (DFLASH_EVAL_EVERY), arms
alternated run by run in one process. Full-size random Glimmer (argv quant) + full-size bf16
drafter, 4k prompt, 96 tokens, REPLAY tau=6, default kernel patch. Arms: "N" = DFLASH_EVAL_EVERY=N
(0: the taps only, the tree's default); "Nc" = also start the drafter context's append at settle
(a monkeypatch of this script); "d" = also start the drafter's forward after its second layer. mlx-lm plain decodes interleaved; every run checked lossless.
argv: out.json quant arms reps"""
import json, os, statistics, sys, time
import mlx.core as mx
import dflash
from dflash import dflash_round, kernel_patch
from dflash.bench.runs import plain_mode, replay_mode, timed_run
from dflash.bench.scale import build_scale_pair, scale_prompts
from dflash.greedy import greedy_reference_with_margins

out, quant, arms, reps = sys.argv[1], sys.argv[2], sys.argv[3].split(","), int(sys.argv[4])
t0 = time.time()
SCALE = os.environ.get("S37_SCALE", "full")
START_CONTEXT = [False]
settle = dflash_round.DFlashSpeculator.settle


def settle_started(self, round_, rows):
    settle(self, round_, rows)
    if START_CONTEXT[0]:
        mx.async_eval([a for p in self.context.planes for a in (p.keys, p.values) if a is not None])


dflash_round.DFlashSpeculator.settle = settle_started
# Host time of each round's launch (draft build, target commit, verify build and its encodes) and of
# its judge (the wait on the device), summed a run.
from dflash import rounds as rounds_module
PHASES = {"launch": 0.0, "judge": 0.0}
launch, judge = dflash_round.DFlashSpeculator.launch, rounds_module.VerifyRound.judge


def timed(name, function):
    def wrapper(*args):
        t = time.perf_counter()
        try:
            return function(*args)
        finally:
            PHASES[name] += time.perf_counter() - t
    return wrapper


dflash_round.DFlashSpeculator.launch = timed("launch", launch)
# Arms "t..." start only the last gap's layers early (EXTRA[arm]) and the context append.
EXTRA = {"t2": {41, 45}, "t3": {40, 43, 46}, "t1": {43}}
ARM = [None]
Taps = dflash_round.TargetTaps


class PacedTaps(Taps):
    def __init__(self, model, layer_ids, start_early=False, eval_every=0):
        extra = EXTRA.get(ARM[0])
        super().__init__(model, layer_ids, start_early, 1 if extra else eval_every)
        if extra:
            self._swapped = sorted(set(self.layer_ids) | {i % len(self.layers) for i in extra})


dflash_round.TargetTaps = PacedTaps
rounds_module.VerifyRound.judge = timed("judge", judge)
START_DRAFT = [False]
from dflash import drafter as drafter_module
hidden_states = drafter_module.DFlashDrafter.hidden_states


def hidden_states_started(self, block_tokens, context):
    if not START_DRAFT[0]:
        return hidden_states(self, block_tokens, context)
    h = self.embed(block_tokens)
    for index, (layer, plane) in enumerate(zip(self.layers, context.planes)):
        h = layer(h, plane, self._rope, context.offset)
        if index == 1:
            mx.async_eval(h)
    return self.norm(h)


drafter_module.DFlashDrafter.hidden_states = hidden_states_started
target, drafter = build_scale_pair(SCALE, quant, 0)
prompt = scale_prompts(target, 4096 if SCALE == "full" else 64, 1, 0)[0]
tokens, _ = greedy_reference_with_margins(target, prompt, 96, set())
sequence = prompt.tolist() + tokens
plain = plain_mode(target)
replay = replay_mode(target, drafter, 16 if SCALE == "full" else 8, 6)
result = {"quant": quant, "arms": arms, "setup_s": round(time.time() - t0, 1), "plain_ms": [],
          "ms": {a: [] for a in arms}, "lossless": [], "rounds": []}
print("setup", result["setup_s"], flush=True)


def arm_run(arm):
    ARM[0] = arm
    os.environ["DFLASH_EVAL_EVERY"] = "0" if arm.startswith("t") else arm.rstrip("cd")
    START_CONTEXT[0] = "c" in arm
    START_DRAFT[0] = "d" in arm
    PHASES.update(launch=0.0, judge=0.0)
    rec = timed_run(replay, prompt, 96, set(), sequence)
    result["lossless"].append(list(rec.tokens) == tokens[: len(rec.tokens)] and len(rec.tokens) == 96)
    result["rounds"].append(len(rec.round_seconds))
    result.setdefault("phases", {}).setdefault(arm, []).append({k: round(1000 * v, 1) for k, v in PHASES.items()})
    return round(1000 * rec.decode_seconds, 1)


with kernel_patch.verify_kernels(target, drafter):
    for arm in arms:
        arm_run(arm)
for rep in range(reps):
    if rep % 2 == 0:
        rec = timed_run(plain, prompt, 96, set(), sequence)
        result["plain_ms"].append(round(1000 * rec.decode_seconds, 1))
    order = arms if rep % 2 == 0 else arms[::-1]
    with kernel_patch.verify_kernels(target, drafter):
        times = {arm: arm_run(arm) for arm in order}
    for arm in arms:
        result["ms"][arm].append(times[arm])
    print(rep, {a: (times[a], result["phases"][a][-1]) for a in arms}, flush=True)
plain_ms = statistics.median(result["plain_ms"])
result["median_ms"] = {a: statistics.median(v) for a, v in result["ms"].items()}
result["x_plain"] = {a: round(plain_ms / m, 2) for a, m in result["median_ms"].items()}
base = arms[0]
result["wins_vs_first"] = {a: sum(x < y for x, y in zip(result["ms"][a], result["ms"][base])) for a in arms[1:]}
result["total_s"] = round(time.time() - t0, 1)
print("summary", quant, "plain", plain_ms, "median", result["median_ms"], "x", result["x_plain"],
      "wins", result["wins_vs_first"], "lossless", all(result["lossless"]), "rounds", set(result["rounds"]),
      "total", result["total_s"], flush=True)
json.dump(result, open(out, "w"), indent=1)
