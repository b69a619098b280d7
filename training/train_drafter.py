"""Train the demo DFlash drafter against the exported target.

``python -m training.train_drafter --target out/target --distill data/distill
--checkpoint ckpt/drafter --export out/drafter`` trains (or resumes) with the DFlash
objective (:mod:`training.objective`) on the target's greedy continuations
(``--source greedy``) or on raw corpus windows (``--source raw``), and exports a
``MuseGlimmerAssistantModel`` checkpoint in bfloat16.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path
from typing import List, Optional

import mlx.core as mx
import numpy as np

from dflash.drafter import DFlashDrafter, DrafterConfig
from dflash.loader import save_drafter
from dflash.taps import TargetTaps

from .loop import Trainer, resume_and_fit
from .objective import block_logits, dflash_loss, sample_anchors
from .shards import read_json, write_json
from .train_target import count_parameters, load_settings, sample_windows


def build_drafter(config: dict, target, mask_token_id: int) -> DFlashDrafter:
    """A float32 drafter from ``configs/demo/drafter.json``, bound to ``target``."""
    fields = dict(config)
    fields.update(
        hidden_size=target.args.hidden_size,
        vocab_size=target.args.vocab_size,
        num_target_layers=target.args.num_hidden_layers,
        mask_token_id=mask_token_id,
    )
    drafter = DFlashDrafter(DrafterConfig(**fields))
    drafter.set_dtype(mx.float32)
    drafter.bind(target)
    return drafter


class FeatureSource:
    """The target's tapped features of whole sequences (no gradient)."""

    def __init__(self, target, layer_ids) -> None:
        self.target = target
        self.taps = TargetTaps(target, layer_ids)
        self.taps.attach()

    def __call__(self, tokens: mx.array) -> mx.array:
        """Shapes: tokens (b, L) -> (b, L, k*H) float32."""
        self.target.model(tokens)
        return mx.stop_gradient(self.taps.pop()).astype(mx.float32)


def accepted_lengths(
    drafter, features: mx.array, tokens: mx.array, anchors: mx.array
) -> mx.array:
    """Leading draft positions of each block whose argmax equals the sequence.

    Shapes: features (b, L, k*H), tokens (b, L), anchors (b, A) -> (b, A) int32.
    """
    size = drafter.config.block_size
    logits = block_logits(drafter, features, tokens, anchors)
    drafts = mx.argmax(logits[:, :, 1:], axis=-1)
    positions = anchors[:, :, None] + mx.arange(1, size)
    labels = mx.take_along_axis(tokens, positions.reshape(tokens.shape[0], -1), axis=1)
    hits = (drafts == labels.reshape(drafts.shape)).astype(mx.int32)
    return mx.cumprod(hits, axis=-1).sum(axis=-1)


def block_tau(
    drafter,
    features_fn,
    rows: np.ndarray,
    prompt_len: int,
    batch: int = 16,
    anchors_per_row: int = 16,
    seed: int = 99,
) -> dict:
    """Greedy acceptance of the drafter's blocks on held-out sequences.

    For each block the accepted length is the number of leading draft positions whose
    argmax equals the sequence; tau = 1 + its mean (what decoding would commit per round
    at these anchors when the sequence is the target's greedy output).
    """
    size = drafter.config.block_size
    rng = np.random.default_rng(seed)
    accepted = []
    for start in range(0, rows.shape[0], batch):
        tokens = mx.array(rows[start : start + batch].astype(np.int32))
        anchors = sample_anchors(
            rng,
            tokens.shape[0],
            anchors_per_row,
            prompt_len - 1,
            tokens.shape[1] - size,
        )
        accepted.append(
            accepted_lengths(
                drafter, features_fn(tokens), tokens, mx.array(anchors)
            ).reshape(-1)
        )
    accepted = mx.concatenate(accepted)
    return {"block_tau": round(1.0 + accepted.astype(mx.float32).mean().item(), 3)}


def accepted_at(
    drafter,
    features: mx.array,
    tokens: mx.array,
    anchors: np.ndarray,
    chunk: int = 64,
) -> np.ndarray:
    """:func:`accepted_lengths` at the same anchors in every row, ``chunk`` at a time.

    Shapes: features (b, L, k*H), tokens (b, L), anchors (A,) -> (b, A).
    """
    pieces = []
    for low in range(0, anchors.size, chunk):
        part = mx.array(anchors[low : low + chunk].astype(np.int32))
        part = mx.broadcast_to(part[None], (tokens.shape[0], part.size))
        pieces.append(np.array(accepted_lengths(drafter, features, tokens, part)))
    return np.concatenate(pieces, axis=1)


def chained_rounds(accepted: np.ndarray, first: int) -> List[int]:
    """Replay greedy decoding's rounds over one sequence from per-anchor acceptance.

    Round one anchors at ``first`` (the last prompt token); a round that accepts ``a``
    drafts commits ``a + 1`` tokens (with the target's bonus), so the next anchor is
    ``a + 1`` further on. Rounds stop at the first anchor past ``accepted``.

    Args:
        accepted: Accepted drafts at every anchor ``first, first + 1, ...``.
        first: Sequence position of ``accepted[0]``.

    Returns:
        The accepted drafts of each replayed round, in order.

    Shapes: accepted (A,).
    """
    rounds: List[int] = []
    offset = 0
    while offset < accepted.shape[0]:
        rounds.append(int(accepted[offset]))
        offset += rounds[-1] + 1
    return rounds


def decode_tau(
    drafter,
    features_fn,
    rows: np.ndarray,
    prompt_len: int,
    batch: int = 8,
    anchor_chunk: int = 64,
) -> dict:
    """Tau as greedy decoding would measure it on sequences of the target's greedy output.

    Every anchor's accepted length is computed in one teacher-forced pass (the target's
    features of its own greedy tokens are what decoding sees), then the rounds are
    replayed with :func:`chained_rounds`. Unlike :func:`block_tau`, which averages over
    uniform anchors, this counts rounds, so hard stretches weigh as they do in decoding.
    """
    size = drafter.config.block_size
    first = prompt_len - 1
    committed = rounds = 0
    for start in range(0, rows.shape[0], batch):
        tokens = mx.array(rows[start : start + batch].astype(np.int32))
        anchors = np.arange(first, tokens.shape[1] - size + 1, dtype=np.int32)
        accepted = accepted_at(
            drafter, features_fn(tokens), tokens, anchors, anchor_chunk
        )
        for row in accepted:
            replayed = chained_rounds(row, first)
            committed += sum(replayed) + len(replayed)
            rounds += len(replayed)
    return {"decode_tau": round(committed / max(rounds, 1), 3)}


def main(argv: Optional[List[str]] = None) -> None:
    from mlx_lm import load

    parser = argparse.ArgumentParser(prog="python -m training.train_drafter")
    parser.add_argument("--data", type=Path, default=Path("data"))
    parser.add_argument("--target", type=Path, required=True)
    parser.add_argument("--distill", type=Path, required=True)
    parser.add_argument(
        "--config", type=Path, default=Path("configs/demo/drafter.json")
    )
    parser.add_argument(
        "--settings", type=Path, default=Path("configs/demo/train-drafter.json")
    )
    parser.add_argument("--source", choices=("greedy", "raw"), default="greedy")
    parser.add_argument("--checkpoint", type=Path, required=True)
    parser.add_argument("--export", type=Path, default=None)
    parser.add_argument("--run-seconds", type=float, default=540.0)
    parser.add_argument("--total-steps", type=int, default=None)
    args = parser.parse_args(argv)

    settings = load_settings(args.settings)
    if args.total_steps is not None:
        settings.total_steps = args.total_steps
    anchors_per_row = int(settings.extra.get("anchors_per_row", 32))
    mx.random.seed(settings.seed)
    target, tokenizer = load(str(args.target))
    target.freeze()
    mask_id = tokenizer.convert_tokens_to_ids("<|mask|>")
    drafter = build_drafter(read_json(args.config), target, mask_id)
    size = drafter.config.block_size
    meta = read_json(args.distill / "meta.json")
    prompt_len = meta["prompt_len"]
    greedy = np.load(args.distill / "train.npy")
    heldout = np.load(args.distill / "heldout.npy")
    corpus = np.load(args.data / "train.npy") if args.source == "raw" else None
    length = greedy.shape[1]
    features_fn = FeatureSource(target, drafter.config.target_layer_ids)
    print(
        f"drafter: {count_parameters(drafter):,} parameters; source {args.source}; "
        f"{greedy.shape[0]} greedy rows of {length}"
    )

    def batch_fn(step: int):
        rng = np.random.default_rng([settings.seed, step])
        if args.source == "greedy":
            rows = greedy[rng.integers(0, greedy.shape[0], settings.batch_size)]
        else:
            rows = sample_windows(
                corpus, step, settings.batch_size, length, settings.seed
            )
        tokens = mx.array(rows.astype(np.int32))
        # The first round's anchor is the last prompt token (its features are not yet
        # in the context); every later anchor is a generated token.
        anchors = sample_anchors(
            rng, settings.batch_size, anchors_per_row, prompt_len - 1, length - size
        )
        return features_fn(tokens), tokens, mx.array(anchors)

    def evaluate() -> dict:
        scores = block_tau(drafter, features_fn, heldout, prompt_len)
        scores.update(decode_tau(drafter, features_fn, heldout, prompt_len))
        return scores

    trainer = Trainer(drafter, dflash_loss, settings, args.checkpoint)
    done = resume_and_fit(trainer, batch_fn, args.run_seconds, evaluate)
    if done and args.export is not None:
        drafter.set_dtype(mx.bfloat16)
        save_drafter(drafter, args.export, format="assistant")
        summary = {
            "steps": trainer.step,
            "train_seconds": round(trainer.elapsed, 1),
            "source": args.source,
            "history": trainer.history[-3:],
            "settings": dataclasses.asdict(settings),
        }
        summary.update(evaluate())
        write_json(args.export / "training.json", summary)
        print(json.dumps(summary))


if __name__ == "__main__":
    main()
