"""A small resumable training loop shared by the target and the drafter.

The learning rate follows linear warm-up then cosine decay to ``min_lr_ratio`` of the
peak, computed in Python each step and handed to the compiled step through the
optimizer state. When ``total_steps`` is not fixed in advance, the first
``probe_steps`` (all inside the warm-up, so the schedule does not yet depend on the
total) are timed and the total is set to fit ``time_budget`` seconds; the resolved
total is stored in the checkpoint, so resumed runs keep the same schedule.
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, List, Optional, Sequence

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
from mlx.utils import tree_flatten, tree_unflatten

from .shards import load_shards, read_json, save_shards, write_json


@dataclass
class TrainSettings:
    """Optimisation settings (``configs/demo/train-*.json``)."""

    batch_size: int = 32
    seq_len: int = 1024
    peak_lr: float = 1.5e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 200
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    seed: int = 0
    total_steps: Optional[int] = None
    time_budget: float = 480.0
    probe_steps: int = 20
    checkpoint_every: int = 500
    eval_every: int = 1000
    log_every: int = 50
    extra: dict = field(default_factory=dict)


def learning_rate(settings: TrainSettings, step: int, total_steps: int) -> float:
    """Warm-up then cosine learning rate at optimizer step ``step`` (0-based)."""
    if step < settings.warmup_steps:
        return settings.peak_lr * (step + 1) / settings.warmup_steps
    span = max(1, total_steps - settings.warmup_steps)
    progress = min(1.0, (step - settings.warmup_steps) / span)
    floor = settings.min_lr_ratio
    return settings.peak_lr * (
        floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))
    )


class Trainer:
    """Compiled AdamW steps over ``module`` with sharded, resumable checkpoints.

    Args:
        module: The module whose trainable parameters are optimised.
        loss_fn: ``loss_fn(module, *batch) -> scalar``.
        settings: Optimisation settings.
        checkpoint_dir: Where checkpoints are written and resumed from.
        frozen: Modules read by ``loss_fn`` but not trained (their state is passed to
            the compiled step so it is not baked in as constants).
    """

    def __init__(
        self,
        module: nn.Module,
        loss_fn: Callable,
        settings: TrainSettings,
        checkpoint_dir: Path,
        frozen: Sequence[nn.Module] = (),
    ) -> None:
        self.module = module
        self.settings = settings
        self.checkpoint_dir = Path(checkpoint_dir)
        self.optimizer = optim.AdamW(
            learning_rate=settings.peak_lr,
            betas=[0.9, 0.95],
            weight_decay=settings.weight_decay,
        )
        self.optimizer.init(module.trainable_parameters())
        self.step = 0
        self.total_steps = settings.total_steps
        self.history: List[dict] = []
        self.elapsed = 0.0
        self._frozen = list(frozen)
        self._loss_fn = loss_fn
        self._step = None

    def _compile(self) -> Callable:
        """Compile the step over the *current* state objects (after any resume)."""
        module, optimizer = self.module, self.optimizer
        state = [module.state, optimizer.state] + [m.state for m in self._frozen]
        value_and_grad = nn.value_and_grad(module, self._loss_fn)
        clip = self.settings.grad_clip

        def train_step(*batch):
            loss, grads = value_and_grad(module, *batch)
            if clip:
                grads, _ = optim.clip_grad_norm(grads, clip)
            optimizer.update(module, grads)
            return loss

        return mx.compile(train_step, inputs=state, outputs=state)

    # -- checkpoints -------------------------------------------------------------
    def save(self, extra: Optional[dict] = None) -> None:
        """Write parameters, optimizer state and progress under ``checkpoint_dir``."""
        folder = self.checkpoint_dir
        # Evaluate the whole state at once: saving shard by shard would evaluate only
        # some outputs of the compiled step.
        mx.eval(self.module.parameters(), self.optimizer.state)
        save_shards(
            dict(tree_flatten(self.module.trainable_parameters())), folder, "params"
        )
        save_shards(dict(tree_flatten(self.optimizer.state)), folder, "optimizer")
        meta = {
            "step": self.step,
            "total_steps": self.total_steps,
            "elapsed_seconds": round(self.elapsed, 2),
            "settings": asdict(self.settings),
            "history": self.history,
        }
        meta.update(extra or {})
        write_json(folder / "progress.json", meta)

    def resume(self) -> bool:
        """Load the checkpoint in ``checkpoint_dir`` if there is one.

        Returns:
            Whether a checkpoint was loaded.
        """
        meta_path = self.checkpoint_dir / "progress.json"
        if not meta_path.exists():
            return False
        meta = read_json(meta_path)
        params = load_shards(self.checkpoint_dir, "params")
        self.module.update(tree_unflatten(list(params.items())))
        state = load_shards(self.checkpoint_dir, "optimizer")
        self.optimizer.state = tree_unflatten(list(state.items()))
        self._step = None
        self.step = int(meta["step"])
        self.total_steps = meta["total_steps"]
        self.elapsed = float(meta.get("elapsed_seconds", 0.0))
        self.history = list(meta.get("history", []))
        mx.eval(self.module.parameters(), self.optimizer.state)
        return True

    # -- steps ---------------------------------------------------------------------
    def train_step(self, *batch: mx.array) -> mx.array:
        """One optimizer step at the scheduled learning rate; returns the loss."""
        total = self.total_steps or max(self.settings.warmup_steps * 2, 1)
        self.optimizer.learning_rate = mx.array(
            learning_rate(self.settings, self.step, total), dtype=mx.float32
        )
        if self._step is None:
            self._step = self._compile()
        loss = self._step(*batch)
        self.step += 1
        return loss

    def fit(
        self,
        batch_fn: Callable[[int], tuple],
        run_seconds: float,
        evaluate: Optional[Callable[[], dict]] = None,
        log: Callable[[str], None] = print,
    ) -> bool:
        """Train until ``total_steps`` or until this run has used ``run_seconds``.

        Args:
            batch_fn: ``batch_fn(step) -> tuple of arrays`` (deterministic in ``step``).
            run_seconds: Wall-clock allowance of this run; a checkpoint is written
                before it runs out.
            evaluate: Optional callable returning metrics, run every ``eval_every``
                steps and at the end.
            log: Line sink.

        Returns:
            True when training reached ``total_steps``.
        """
        s = self.settings
        run_start = segment_start = last_save = time.perf_counter()
        probe_start = None
        losses = []
        while self.total_steps is None or self.step < self.total_steps:
            loss = self.train_step(*batch_fn(self.step))
            mx.async_eval(loss, self.module.parameters(), self.optimizer.state)
            losses.append(loss)
            if self.total_steps is None:
                probe_start = self._probe(probe_start, log)
            if self.step % s.log_every == 0 or self.step == self.total_steps:
                losses = self._log(losses, run_start, segment_start, log)
            if evaluate is not None and s.eval_every and self.step % s.eval_every == 0:
                self._evaluate(evaluate, log)
            now = time.perf_counter()
            if now - last_save > 120 or self.step % s.checkpoint_every == 0:
                self.elapsed += now - segment_start
                segment_start = now
                self.save()
                last_save = time.perf_counter()
            if now - run_start > run_seconds:
                break
        self.elapsed += time.perf_counter() - segment_start
        done = self.total_steps is not None and self.step >= self.total_steps
        if evaluate is not None and done:
            self._evaluate(evaluate, log)
        self.save()
        return done

    def _log(self, losses: list, run_start: float, segment_start: float, log) -> list:
        """Record and print the mean loss since the last log line."""
        mean = mx.stack(losses).mean().item()
        now = time.perf_counter()
        elapsed = self.elapsed + now - segment_start
        self.history.append(
            {"step": self.step, "loss": round(mean, 4), "elapsed": round(elapsed, 1)}
        )
        log(
            f"step {self.step}/{self.total_steps} loss {mean:.4f} "
            f"lr {self.optimizer.learning_rate.item():.2e} run {now - run_start:.0f}s"
        )
        return []

    def _probe(self, probe_start: Optional[float], log: Callable[[str], None]):
        """Time the probe steps and fix ``total_steps`` to fit the time budget."""
        s = self.settings
        if self.step == 2:
            mx.eval(self.module.parameters())
            return time.perf_counter()
        if probe_start is not None and self.step == 2 + s.probe_steps:
            mx.eval(self.module.parameters())
            per_step = (time.perf_counter() - probe_start) / s.probe_steps
            self.total_steps = max(self.step + 1, int(s.time_budget / per_step))
            log(
                f"probe: {per_step * 1000:.1f} ms/step -> total_steps {self.total_steps}"
            )
        return probe_start

    def _evaluate(
        self, evaluate: Callable[[], dict], log: Callable[[str], None]
    ) -> None:
        metrics = evaluate()
        metrics["step"] = self.step
        self.history.append(metrics)
        log("eval " + " ".join(f"{k} {v}" for k, v in metrics.items()))


def resume_and_fit(
    trainer: Trainer,
    batch_fn: Callable[[int], tuple],
    run_seconds: float,
    evaluate: Optional[Callable[[], dict]] = None,
) -> bool:
    """Resume ``trainer`` from its checkpoint if any, train one run, report; True if done."""
    if trainer.resume():
        print(f"resumed at step {trainer.step}/{trainer.total_steps}")
    started = time.perf_counter()
    done = trainer.fit(batch_fn, run_seconds, evaluate)
    elapsed = time.perf_counter() - started
    print(f"run: {elapsed:.0f}s, step {trainer.step}, done={done}")
    return done
