"""Runner for the public DFlash MLX loop (PyPI ``dflash`` 0.1.0), in its own process.

The public package's import name is ``dflash``, like this project's, so this script never
imports this project: ``benchmarks/side_by_side.py`` starts it as ``python -I
peer_dflash.py --peer-src DIR --job JOB --out OUT`` from a folder outside the checkout, and
it puts ``--peer-src`` first on ``sys.path``. The scale target comes from
``dflash/bench/scale_target.py`` loaded by file path (it imports mlx and mlx-lm only), so the
same seed builds the same random weights as in the dflash-bench process.

Modes, timed by the bench's rule (tokens after the first round / time after it; the public
loop's first response is the prefill's token): ``plain`` (mlx-lm ``generate_step``, measured
in this process), ``dflash`` (the public ``stream_generate`` with the real drafter) and
``replay-tauN`` (the same with REPLAY proposals: the drafter forward runs, its logits get
the profile's boost, exactly as in dflash-bench). Detokenizing is skipped (a token-id-only
tokenizer with the target's end-of-sequence ids), as the bench's generators do not
detokenize either. The output holds raw per-run records; the driver summarises them with
dflash-bench's own code.
"""

import argparse
import importlib.util
import json
import statistics
import sys
import time
from pathlib import Path


def _load_peer(peer_src: Path):
    """The public ``dflash.model_mlx``, refusing any other ``dflash`` on the path."""
    sys.path.insert(0, str(peer_src))
    import dflash
    from dflash import model_mlx

    where = Path(dflash.__file__).resolve()
    if peer_src.resolve() not in where.parents:
        raise RuntimeError(f"imported dflash from {where}, not from {peer_src}")
    # load_draft downloads through the hub; a saved folder is read as it is.
    model_mlx.snapshot_download = _local_folder
    return model_mlx


def _local_folder(repo_id, **_):
    path = Path(repo_id)
    if not path.is_dir():
        raise FileNotFoundError(f"drafter folder not found: {repo_id}")
    return str(path)


def _load_module(path: Path, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class _Detokenizer:
    """Takes tokens and produces no text (the runs compare token ids)."""

    last_segment = ""

    def reset(self):
        pass

    def add_token(self, token):
        pass

    def finalize(self):
        pass


def _token_tokenizer(eos_ids):
    from mlx_lm.tokenizer_utils import TokenizerWrapper

    class TokenIds(TokenizerWrapper):
        def __init__(self, eos):
            self._tokenizer = None
            self._detokenizer = _Detokenizer()
            self._eos_token_ids = set(eos)

        bos_token = None

    return TokenIds(eos_ids)


class PeerReplay:
    """The public drafter with REPLAY proposals (see ``dflash/bench/replay.py``)."""

    def __init__(self, draft, tau, scale_target):
        self.draft, self.tau, self.st = draft, tau, scale_target
        self.sequence = None

    def __getattr__(self, name):
        if name == "draft":
            raise AttributeError(name)
        return getattr(self.draft, name)

    def __call__(self, inputs, target_hidden, cache, logits_start=0):
        # The draft cache starts at the first context row it has not seen yet; the block
        # follows the new rows.
        position = int(cache[0].offset) + int(target_hidden.shape[1])
        real = self.draft(inputs, target_hidden, cache, logits_start=logits_start)
        drafts = self.st.replay_tokens(
            self.sequence, position, inputs.shape[1] - 1, self.tau, real.shape[-1]
        )
        return self.st.replay_logits(real, drafts, first_row=1 - logits_start)


def _margin(logprobs):
    import mlx.core as mx

    top = mx.sort(logprobs.reshape(-1).astype(mx.float32))[-2:]
    return (top[1] - top[0]).item()


def reference(model, prompt, max_tokens, eos):
    """mlx-lm's greedy output (plain ``generate_step``) and its top-2 margins."""
    from mlx_lm.generate import generate_step
    from mlx_lm.models.cache import make_prompt_cache

    tokens, margins = [], []
    cache = make_prompt_cache(model)
    for token, logprobs in generate_step(
        prompt, model, max_tokens=max_tokens, prompt_cache=cache
    ):
        tokens.append(int(token))
        margins.append(_margin(logprobs))
        if tokens[-1] in eos:
            break
    return tokens, margins


def _drain_plain(steps, max_tokens, eos):
    clock = time.perf_counter
    tokens, ends = [], []
    start = clock()
    for token, _ in steps:
        tokens.append(int(token))
        ends.append(clock())
        if len(tokens) >= max_tokens or tokens[-1] in eos:
            break
    end = clock()
    return tokens, [False] * len(tokens), ends, start, end


def _drain_peer(responses, max_tokens):
    clock = time.perf_counter
    tokens, drafted, ends = [], [], []
    start = clock()
    for response in responses:
        if response.tokens:
            tokens.extend(int(t) for t in response.tokens)
            drafted.extend([True] * (len(response.tokens) - 1) + [False])
            ends.append(clock())
        if len(tokens) >= max_tokens or response.finish_reason is not None:
            break
    end = clock()
    return tokens, drafted, ends, start, end


def run(job, peer, st):
    import mlx.core as mx
    from mlx_lm.generate import generate_step
    from mlx_lm.models.cache import make_prompt_cache

    model = _target(job, st)
    draft = peer.load_draft(job["drafter"])
    block = job.get("block_size") or int(draft.config.block_size)
    prompts = _prompts(job, model, st)
    eos = set(job.get("eos") or [])
    tokenizer = _token_tokenizer(eos)
    max_tokens = job["max_tokens"]

    def peer_steps(drafter):
        return lambda prompt: peer.stream_generate(
            model, drafter, tokenizer, prompt, block_size=block, max_tokens=max_tokens
        )

    modes = [
        (
            "plain",
            "plain decoding (mlx-lm generate_step), in the peer's process",
            0,
            None,
        )
    ]
    if job.get("dflash", True):
        modes.append(
            ("dflash", f"public DFlash MLX loop, block {block}", block - 1, draft)
        )
    for tau in job.get("replay_taus") or []:
        label = f"REPLAY tau={tau} through the public loop, block {block}"
        modes.append((f"replay-tau{tau}", label, block - 1, PeerReplay(draft, tau, st)))

    refs, margins = [], []
    started = time.perf_counter()
    for prompt in prompts:
        tokens, gaps = reference(model, prompt, max_tokens, eos)
        refs.append(tokens)
        margins.append(gaps)
    reference_seconds = time.perf_counter() - started

    def one(name, drafter, index):
        prompt = prompts[index]
        if isinstance(drafter, PeerReplay):
            drafter.sequence = prompt.tolist() + refs[index]
        mx.synchronize()
        mx.clear_cache()
        mx.reset_peak_memory()
        if drafter is None:
            steps = generate_step(
                prompt,
                model,
                max_tokens=max_tokens,
                prompt_cache=make_prompt_cache(model),
            )
            out = _drain_plain(steps, max_tokens, eos)
        else:
            steps = peer_steps(drafter)(prompt)
            out = _drain_peer(steps, max_tokens)
        steps.close()
        mx.synchronize()
        tokens, drafted, ends, start, end = out
        return dict(
            tokens=tokens,
            drafted=drafted,
            round_ends=ends,
            start=start,
            end=end,
            peak_memory=mx.get_peak_memory(),
            # The public loop's first response is the prefill's token, not a round.
            prefill_rounds=0 if drafter is None else 1,
        )

    for name, _, _, drafter in modes:  # warm-up
        one(name, drafter, 0)
    records = {name: [] for name, *_ in modes}
    for pass_index in range(job["passes"]):
        shift = pass_index % len(modes)
        order = modes[shift:] + modes[:shift]
        runs = {name: [] for name, *_ in modes}
        for index in range(len(prompts)):
            for name, _, _, drafter in order:
                runs[name].append(one(name, drafter, index))
        for name, got in runs.items():
            records[name].append(got)
    return {
        "peer": _peer_version(peer),
        "block_size": block,
        "max_tokens": max_tokens,
        "passes": job["passes"],
        "modes": [dict(name=n, label=l, drafts_per_round=d) for n, l, d, _ in modes],
        "prompt_sizes": [int(p.size) for p in prompts],
        "refs": refs,
        "margins": margins,
        "reference_seconds": reference_seconds,
        "records": records,
        "errors": {},
        "mlx": mx.__version__,
        "device": str(mx.default_device()),
    }


def _peer_version(peer):
    dist = Path(peer.__file__).resolve().parents[1]
    found = sorted(dist.glob("dflash-*.dist-info"))
    return found[0].name[len("dflash-") : -len(".dist-info")] if found else "unknown"


def _target(job, st):
    target = job["target"]
    if "path" in target:
        from mlx_lm import load

        return load(target["path"])[0]
    return st.build_target(target["scale"], target["quant"], target["seed"])


def _prompts(job, model, st):
    import mlx.core as mx

    spec = job["prompts"]
    if isinstance(spec, list):
        return [mx.array(tokens, mx.uint32) for tokens in spec]
    vocab = model.args.vocab_size
    return [
        st.random_prompt(vocab, spec["context"], spec["seed"], i)
        for i in range(spec["count"])
    ]


def main(argv=None):
    parser = argparse.ArgumentParser(prog="peer_dflash.py")
    parser.add_argument("--peer-src", type=Path, required=True)
    parser.add_argument("--job", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    job = json.loads(args.job.read_text())
    peer = _load_peer(args.peer_src)
    st = _load_module(Path(job["scale_target_file"]), "scale_target")
    started = time.perf_counter()
    result = run(job, peer, st)
    result["wall_s"] = time.perf_counter() - started
    args.out.write_text(json.dumps(result) + "\n")
    medians = {
        name: statistics.median(len(r["tokens"]) for runs in passes for r in runs)
        for name, passes in result["records"].items()
    }
    print(
        f"peer runner: done in {result['wall_s']:.1f} s; median tokens per run {medians}"
    )


if __name__ == "__main__":
    main()
