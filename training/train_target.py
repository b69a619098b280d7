"""Train the demo target: mlx-lm's own ``muse_glimmer`` on the stdlib corpus.

``python -m training.train_target --data data --checkpoint ckpt/target --export out/target``
trains (or resumes) for at most ``--run-seconds`` and, once the schedule is complete,
exports a bfloat16 mlx-lm model folder (config, weight shards under 16 MB, tokenizer).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shutil
from pathlib import Path
from typing import List, Optional

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten
from mlx_lm.models import muse_glimmer

from .loop import Trainer, TrainSettings, resume_and_fit
from .shards import load_shards, read_json, save_shards, write_json

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def load_settings(path: Path) -> TrainSettings:
    """Read a ``TrainSettings`` JSON file (unknown keys are an error)."""
    return TrainSettings(**read_json(path))


def build_target(config: dict) -> muse_glimmer.Model:
    """A float32 Muse Glimmer from a config dict (``configs/demo/target.json``)."""
    args = muse_glimmer.ModelArgs.from_dict(config)
    model = muse_glimmer.Model(args)
    model.set_dtype(mx.float32)
    return model


def sample_windows(
    tokens: np.ndarray, step: int, batch: int, length: int, seed: int
) -> np.ndarray:
    """``batch`` random windows of ``length`` tokens, a pure function of ``step``.

    Shapes: tokens (N,) -> (batch, length) int32.
    """
    rng = np.random.default_rng([seed, step])
    starts = rng.integers(0, tokens.size - length, size=batch)
    return np.stack([tokens[s : s + length] for s in starts]).astype(np.int32)


def next_token_loss(model: nn.Module, inputs: mx.array, targets: mx.array) -> mx.array:
    """Mean next-token cross-entropy in float32.

    Shapes: inputs, targets (b, L) -> scalar.
    """
    logits = model(inputs).astype(mx.float32)
    return nn.losses.cross_entropy(logits, targets, reduction="mean")


def heldout_loss(
    model: nn.Module,
    tokens: np.ndarray,
    seq_len: int,
    windows: int = 64,
    seed: int = 1234,
) -> float:
    """Mean next-token loss over fixed held-out windows (same windows every call)."""
    data = sample_windows(tokens, 0, windows, seq_len + 1, seed)
    total = 0.0
    for start in range(0, windows, 8):
        chunk = mx.array(data[start : start + 8])
        loss = next_token_loss(model, chunk[:, :-1], chunk[:, 1:])
        total += loss.item() * chunk.shape[0]
    return total / windows


def model_config(model: muse_glimmer.Model, eos_token_id: int) -> dict:
    """The ``config.json`` of an exported target."""
    config = dataclasses.asdict(model.args)
    config.update(
        architectures=["MuseGlimmerForCausalLM"],
        eos_token_id=eos_token_id,
        bos_token_id=None,
        torch_dtype="bfloat16",
    )
    return config


def export_target(
    model: muse_glimmer.Model,
    tokenizer_dir: Path,
    out: Path,
    eos_token_id: int = 0,
    dtype: mx.Dtype = mx.bfloat16,
) -> None:
    """Write an mlx-lm model folder that ``mlx_lm.load(out)`` reads offline.

    Args:
        model: The trained target.
        tokenizer_dir: Folder with the tokenizer files.
        out: Destination folder.
        eos_token_id: Id of ``<|endoftext|>``.
        dtype: Weight dtype of the export.
    """
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    weights = {k: v.astype(dtype) for k, v in tree_flatten(model.parameters())}
    save_shards(weights, out, "model")
    write_json(out / "config.json", model_config(model, eos_token_id))
    for name in TOKENIZER_FILES:
        if (Path(tokenizer_dir) / name).exists():
            shutil.copy(Path(tokenizer_dir) / name, out / name)


def count_parameters(model: nn.Module) -> int:
    """Number of parameters."""
    return sum(v.size for _, v in tree_flatten(model.parameters()))


def main(argv: Optional[List[str]] = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m training.train_target")
    parser.add_argument("--data", type=Path, default=Path("data"))
    parser.add_argument("--config", type=Path, default=Path("configs/demo/target.json"))
    parser.add_argument(
        "--settings", type=Path, default=Path("configs/demo/train-target.json")
    )
    parser.add_argument("--checkpoint", type=Path, required=True)
    parser.add_argument("--export", type=Path, default=None)
    parser.add_argument("--run-seconds", type=float, default=540.0)
    parser.add_argument("--total-steps", type=int, default=None)
    parser.add_argument(
        "--export-from",
        choices=("last", "best"),
        default="last",
        help="export the final weights (the shipped pair) or those with the lowest "
        "held-out loss seen at an evaluation",
    )
    args = parser.parse_args(argv)

    config = read_json(args.config)
    settings = load_settings(args.settings)
    if args.total_steps is not None:
        settings.total_steps = args.total_steps
    mx.random.seed(settings.seed)
    model = build_target(config)
    train = np.load(args.data / "train.npy")
    heldout = np.load(args.data / "heldout.npy")
    print(
        f"target: {count_parameters(model):,} parameters; train tokens {train.size:,}"
    )

    def batch_fn(step: int):
        window = mx.array(
            sample_windows(
                train, step, settings.batch_size, settings.seq_len + 1, settings.seed
            )
        )
        return window[:, :-1], window[:, 1:]

    best_dir = args.checkpoint / "best"

    def evaluate() -> dict:
        loss = round(heldout_loss(model, heldout, settings.seq_len), 4)
        best = (
            read_json(best_dir / "best.json")
            if (best_dir / "best.json").exists()
            else {}
        )
        if loss < best.get("heldout_loss", float("inf")):
            # Keep the weights with the lowest held-out loss: the target can overfit.
            save_shards(dict(tree_flatten(model.parameters())), best_dir, "params")
            write_json(
                best_dir / "best.json", {"heldout_loss": loss, "step": trainer.step}
            )
        return {"heldout_loss": loss}

    trainer = Trainer(model, next_token_loss, settings, args.checkpoint)
    done = resume_and_fit(trainer, batch_fn, args.run_seconds, evaluate)
    if done and args.export is not None:
        exported = {
            "step": trainer.step,
            "heldout_loss": trainer.history[-1].get("heldout_loss"),
        }
        if args.export_from == "best":
            exported = read_json(best_dir / "best.json")
            model.load_weights(list(load_shards(best_dir, "params").items()))
        export_target(model, args.data / "tokenizer", args.export)
        summary = {
            "parameters": count_parameters(model),
            "steps": trainer.step,
            "exported": args.export_from,
            "exported_step": exported["step"],
            "train_seconds": round(trainer.elapsed, 1),
            "heldout_loss_float32": exported["heldout_loss"],
            "settings": dataclasses.asdict(settings),
        }
        bf16 = build_target(read_json(args.export / "config.json"))
        bf16.load_weights(list(load_shards(args.export, "model").items()))
        bf16.set_dtype(mx.bfloat16)
        summary["heldout_loss_bfloat16"] = round(
            heldout_loss(bf16, heldout, settings.seq_len), 4
        )
        write_json(args.export / "training.json", summary)
        print(json.dumps(summary))


if __name__ == "__main__":
    main()
