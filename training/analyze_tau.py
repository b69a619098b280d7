"""Where the demo pair's τ comes from: repeating vs new text, and a copy-drafter baseline.

``python -m training.analyze_tau --json docs/demo/tau-analysis.json`` takes each held-out
prompt, computes the target's greedy output (``--max-tokens``, no early stop), and replays
greedy decoding's rounds over it twice (:func:`training.train_drafter.chained_rounds`, which
``tests/test_demo_pair.py`` checks against real decoding):

* with the DFlash drafter (every anchor's accepted drafts from one teacher-forced pass), and
* with prompt lookup, a drafter that copies the 15 tokens that followed the first earlier
  occurrence of the last 1–3 tokens (no model; the usual lossless baseline).

A round is a *repeat* round when the 15 tokens after its anchor already occur verbatim in the
sequence before the anchor (the target is looping or copying); otherwise *new*. The report
gives τ over all rounds, repeat rounds, new rounds and the first 64 generated tokens, and the
share of generated tokens in repeat rounds.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

import mlx.core as mx
import numpy as np

from dflash.greedy import greedy_reference

from .train_drafter import FeatureSource, accepted_at, chained_rounds


def lookup_accepted(
    tokens: Sequence[int], anchor: int, drafts: int, max_ngram: int = 3
) -> int:
    """Drafts a prompt-lookup drafter gets accepted at ``anchor``.

    The drafter finds the last ``n`` tokens up to ``anchor`` (``n = max_ngram .. 1``) at
    their first earlier occurrence, as transformers' prompt lookup does, and proposes the
    tokens that followed it, up to ``drafts`` and never past ``anchor`` (only known tokens
    can be copied).

    Args:
        tokens: The whole sequence (prompt, then the target's greedy output).
        anchor: Index of the last committed token.
        drafts: Drafts per round (block size - 1).
        max_ngram: Longest suffix to match.

    Returns:
        Leading proposed tokens equal to ``tokens[anchor + 1:]``.
    """
    for n in range(max_ngram, 0, -1):
        if anchor + 1 < n + 1:
            continue
        suffix = list(tokens[anchor - n + 1 : anchor + 1])
        for end in range(n - 1, anchor):
            if list(tokens[end - n + 1 : end + 1]) != suffix:
                continue
            accepted = 0
            while (
                accepted < drafts
                and end + 1 + accepted <= anchor
                and anchor + 1 + accepted < len(tokens)
                and tokens[end + 1 + accepted] == tokens[anchor + 1 + accepted]
            ):
                accepted += 1
            return accepted
    return 0


def is_repeat(tokens: Sequence[int], anchor: int, span: int) -> bool:
    """Whether ``tokens[anchor + 1 : anchor + 1 + span]`` occurs before ``anchor + 1``."""
    target = list(tokens[anchor + 1 : anchor + 1 + span])
    for start in range(0, anchor + 1 - span + 1):
        if list(tokens[start : start + span]) == target:
            return True
    return False


def replay(accepted: np.ndarray, first: int) -> List[Tuple[int, int]]:
    """``(anchor, accepted)`` of each replayed round."""
    rounds, anchor = [], first
    for count in chained_rounds(accepted, first):
        rounds.append((anchor, count))
        anchor += count + 1
    return rounds


def summarize(rounds: List[Tuple[int, int, bool]], head: int) -> dict:
    """τ over all, repeat, new and early rounds, and the repeat rounds' token share.

    Args:
        rounds: ``(offset, accepted, repeat)`` per round, ``offset`` counted from the
            prompt's first anchor.
        head: Rounds anchored within the first ``head`` generated tokens form the
            ``tau_first_{head}_tokens`` group.
    """

    def tau(selected: List[Tuple[int, int, bool]]) -> Optional[float]:
        if not selected:
            return None
        return round(sum(c + 1 for _, c, _ in selected) / len(selected), 3)

    repeats = [r for r in rounds if r[2]]
    committed = sum(c + 1 for _, c, _ in rounds)
    return {
        "tau": tau(rounds),
        "rounds": len(rounds),
        "tau_repeat_rounds": tau(repeats),
        "tau_new_rounds": tau([r for r in rounds if not r[2]]),
        "repeat_token_share": round(
            sum(c + 1 for _, c, _ in repeats) / max(committed, 1), 3
        ),
        f"tau_first_{head}_tokens": tau([r for r in rounds if r[0] < head]),
    }


def drafter_accepted(
    model, drafter, row: np.ndarray, anchors: np.ndarray
) -> np.ndarray:
    """The DFlash drafter's accepted drafts at each anchor (one teacher-forced pass).

    Shapes: row (L,), anchors (A,) -> (A,).
    """
    features = FeatureSource(model, drafter.config.target_layer_ids)
    try:
        tokens = mx.array(row)[None]
        return accepted_at(drafter, features(tokens), tokens, anchors)[0]
    finally:
        features.taps.detach()


def analyze(
    model, tokenizer, drafter, prompts: List[str], max_tokens: int, head: int = 64
) -> dict:
    """The report for ``prompts`` (see the module docstring)."""
    from tqdm import tqdm

    size = drafter.config.block_size
    pooled: Dict[str, list] = {"dflash": [], "prompt_lookup": []}
    for text in tqdm(prompts, desc="analyze_tau", unit="prompt", file=sys.stderr):
        prompt = mx.array(tokenizer.encode(text))
        generated = greedy_reference(model, prompt, max_tokens + size)
        row = np.concatenate([np.array(prompt), np.array(generated)]).astype(np.int32)
        first = prompt.size - 1
        anchors = np.arange(first, first + max_tokens)
        accepted = {
            "dflash": drafter_accepted(model, drafter, row, anchors),
            "prompt_lookup": np.array(
                [lookup_accepted(row, int(a), size - 1) for a in anchors]
            ),
        }
        for name, per_anchor in accepted.items():
            for anchor, count in replay(per_anchor, first):
                pooled[name].append(
                    (anchor - first, count, is_repeat(row, anchor, size - 1))
                )
    report = {name: summarize(rounds, head) for name, rounds in pooled.items()}
    report.update(prompts=len(prompts), max_tokens=max_tokens, block_size=size)
    return report


def main(argv: Optional[List[str]] = None) -> None:
    import dflash
    from dflash.bench import default_prompts_path, read_prompts

    parser = argparse.ArgumentParser(prog="python -m training.analyze_tau")
    parser.add_argument("--prompts", type=Path, default=None)
    parser.add_argument("--limit", type=int, default=None)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    model, tokenizer, drafter = dflash.load_demo()
    prompts = read_prompts(args.prompts or default_prompts_path(), args.limit)
    report = analyze(model, tokenizer, drafter, prompts, args.max_tokens)
    text = json.dumps(report, indent=2)
    print(text)
    if args.json is not None:
        args.json.write_text(text + "\n")


if __name__ == "__main__":
    main()
