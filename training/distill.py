"""The target's own greedy continuations of corpus prompts: the drafter's training data.

``python -m training.distill --data data --target out/target --out data/distill``
writes ``train.npy`` (uint16, (n, prompt_len + new_tokens)) from training-split prompts
for at most ``--seconds``, ``heldout.npy`` from held-out prompts, and ``meta.json``.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Callable, List, Optional

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import make_prompt_cache

from .shards import write_json
from .train_target import sample_windows


def greedy_continue(model, prompts: np.ndarray, new_tokens: int) -> np.ndarray:
    """Append the target's greedy continuation to each prompt (no early stop).

    Args:
        model: An mlx-lm model.
        prompts: Equal-length prompts.
        new_tokens: Tokens to generate per prompt.

    Returns:
        Prompts followed by their continuations.

    Shapes: prompts (b, P) -> (b, P + new_tokens) uint16.
    """
    cache = make_prompt_cache(model)
    logits = model(mx.array(prompts.astype(np.int32)), cache=cache)
    token = mx.argmax(logits[:, -1], axis=-1)
    out = [token]
    for _ in range(new_tokens - 1):
        logits = model(token[:, None], cache=cache)
        token = mx.argmax(logits[:, -1], axis=-1)
        mx.async_eval(token)
        out.append(token)
    generated = np.array(mx.stack(out, axis=1)).astype(np.uint16)
    return np.concatenate([prompts.astype(np.uint16), generated], axis=1)


def function_prompts(data: Path, prompt_len: int) -> np.ndarray:
    """Prompts shaped like the benchmark's, cut from the *training* split.

    Each is the last ``prompt_len`` tokens of a documented function's preceding lines,
    signature and docstring (``training.bench_prompts``); shorter cuts are dropped.
    The cut reads the running interpreter's stdlib, so it is cached as
    ``data/functions-{prompt_len}.npy`` where the corpus was prepared and carried with
    ``data`` (a GPU host may run another Python).

    Shapes: -> (n, prompt_len) uint16.
    """
    from .bench_prompts import candidates
    from .tokenizer import load_tokenizer

    cached = Path(data) / f"functions-{prompt_len}.npy"
    if cached.exists():
        return np.load(cached)
    tokenizer = load_tokenizer(Path(data) / "tokenizer")
    rows = []
    for record in candidates(Path(data), prompt_len + 64, prompt_len, heldout=False):
        ids = tokenizer.encode(record["prompt"]).ids
        if len(ids) >= prompt_len:
            rows.append(np.asarray(ids[-prompt_len:], dtype=np.uint16))
    if not rows:
        raise ValueError(f"no documented function gives {prompt_len} prompt tokens")
    np.save(cached, np.stack(rows))
    return np.load(cached)


def prompt_sampler(
    source: str,
    tokens: np.ndarray,
    functions: Optional[np.ndarray],
    prompt_len: int,
    batch: int,
    seed: int,
) -> Callable[[int], np.ndarray]:
    """``sample(step) -> (batch, prompt_len)`` prompts: corpus windows, functions, or
    alternating batches of both (``mixed``)."""

    def windows(step: int) -> np.ndarray:
        return sample_windows(tokens, step, batch, prompt_len, seed)

    def cuts(step: int) -> np.ndarray:
        rng = np.random.default_rng([seed, step])
        return functions[rng.integers(0, functions.shape[0], batch)]

    if source == "windows":
        return windows
    if source == "functions":
        return cuts
    if source == "mixed":
        return lambda step: cuts(step) if step % 2 else windows(step)
    raise ValueError(f"unknown prompt source {source!r}")


def distill(
    model,
    sample: Callable[[int], np.ndarray],
    new_tokens: int,
    max_rows: int,
    seconds: float,
) -> np.ndarray:
    """Continue sampled prompts until ``max_rows`` rows or ``seconds`` pass.

    Shapes: -> (rows, prompt_len + new_tokens) uint16.
    """
    rows: List[np.ndarray] = []
    start = time.perf_counter()
    step = 0
    while (
        sum(len(r) for r in rows) < max_rows and time.perf_counter() - start < seconds
    ):
        rows.append(greedy_continue(model, sample(step), new_tokens))
        step += 1
    return np.concatenate(rows)[:max_rows]


def main(argv: Optional[List[str]] = None) -> None:
    from mlx_lm import load

    parser = argparse.ArgumentParser(prog="python -m training.distill")
    parser.add_argument("--data", type=Path, default=Path("data"))
    parser.add_argument("--target", type=Path)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--prompt-len", type=int, default=192)
    parser.add_argument("--new-tokens", type=int, default=320)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--max-rows", type=int, default=65536)
    parser.add_argument("--heldout-rows", type=int, default=128)
    parser.add_argument("--seconds", type=float, default=120.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--prompt-source",
        choices=("windows", "functions", "mixed"),
        default="windows",
        help="training prompts: random corpus windows (the shipped pair), documented "
        "functions cut like the benchmark's prompts, or both",
    )
    parser.add_argument(
        "--cut-only",
        action="store_true",
        help="only cut and cache the function prompts (run where the corpus was prepared)",
    )
    args = parser.parse_args(argv)
    if args.cut_only:
        functions = function_prompts(args.data, args.prompt_len)
        print(f"{functions.shape[0]} function prompts of {args.prompt_len} tokens")
        return
    if args.target is None or args.out is None:
        parser.error("--target and --out are required")

    model, _ = load(str(args.target))
    args.out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    functions = None
    if args.prompt_source != "windows":
        functions = function_prompts(args.data, args.prompt_len)
    sample = prompt_sampler(
        args.prompt_source,
        np.load(args.data / "train.npy"),
        functions,
        args.prompt_len,
        args.batch,
        args.seed,
    )
    train = distill(model, sample, args.new_tokens, args.max_rows, args.seconds)
    train_seconds = time.perf_counter() - started
    heldout_batch = min(args.batch, args.heldout_rows)
    held = np.load(args.data / "heldout.npy")
    sample = prompt_sampler(
        "windows", held, None, args.prompt_len, heldout_batch, args.seed + 1
    )
    heldout = distill(model, sample, args.new_tokens, args.heldout_rows, float("inf"))
    np.save(args.out / "train.npy", train)
    np.save(args.out / "heldout.npy", heldout)
    meta = {
        "prompt_len": args.prompt_len,
        "new_tokens": args.new_tokens,
        "train_rows": int(train.shape[0]),
        "heldout_rows": int(heldout.shape[0]),
        "seed": args.seed,
        "prompt_source": args.prompt_source,
        "train_seconds": round(train_seconds, 1),
        "target": str(args.target),
    }
    write_json(args.out / "meta.json", meta)
    print(meta)


if __name__ == "__main__":
    main()
