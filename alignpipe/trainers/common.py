"""Pieces every trainer shares: seeding, optimizer and schedule, checkpoints, saving, progress."""

from __future__ import annotations

import json
import logging
import math
import random
import shutil
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from alignpipe.trainers.configs import TrainingArgs

log = logging.getLogger(__name__)


@dataclass
class TrainResult:
    """What a trainer hands back: where the model is, final metrics, and how long it took."""

    model_dir: Path
    steps: int
    metrics: dict[str, float] = field(default_factory=dict)
    adapter: bool = False
    seconds: float = 0.0
    resumed_from: int | None = None


def seed_everything(seed: int) -> None:
    random.seed(seed)
    torch.manual_seed(seed)
    try:
        import numpy as np

        np.random.seed(seed % 2**32)
    except ImportError:  # pragma: no cover
        pass


def build_optimizer(model, cfg: TrainingArgs) -> torch.optim.Optimizer:
    """AdamW with no weight decay on biases and normalization weights (1-D parameters)."""
    decay, no_decay = [], []
    for p in model.parameters():
        if p.requires_grad:
            (decay if p.ndim >= 2 else no_decay).append(p)
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=cfg.learning_rate, betas=cfg.adam_betas)


def build_scheduler(optimizer, cfg: TrainingArgs, total_steps: int):
    """Linear warmup, then cosine / linear decay to 0, or constant."""
    warmup = int(cfg.warmup_ratio * total_steps)

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / max(1, warmup)
        if cfg.lr_scheduler == "constant":
            return 1.0
        progress = (step - warmup) / max(1, total_steps - warmup)
        if cfg.lr_scheduler == "linear":
            return max(0.0, 1.0 - progress)
        return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def total_steps(cfg: TrainingArgs, batches_per_epoch: int) -> int:
    """Optimizer steps the run will take."""
    if cfg.max_steps:
        return cfg.max_steps
    return max(1, math.ceil(cfg.epochs * batches_per_epoch / cfg.gradient_accumulation_steps))


def grad_norm(model) -> float:
    norms = [p.grad.detach().norm(2) for p in model.parameters() if p.grad is not None]
    return float(torch.norm(torch.stack(norms), 2)) if norms else 0.0


class Checkpointer:
    """Resumable checkpoints under `<output_dir>/checkpoints/step-N` via `accelerator.save_state`
    (model, optimizer, scheduler, RNG) plus `state.json` with the step. `state.json` is written last,
    so a checkpoint without it (a kill mid-save) is ignored."""

    def __init__(self, output_dir: Path, keep: int):
        self.root = Path(output_dir) / "checkpoints"
        self.keep = keep

    def save(self, accelerator, step: int, extra: dict | None = None) -> Path:
        path = self.root / f"step-{step}"
        accelerator.save_state(str(path))
        if accelerator.is_main_process:
            (path / "state.json").write_text(json.dumps({"step": step, **(extra or {})}))
            for old in self.complete()[: -self.keep]:
                shutil.rmtree(old, ignore_errors=True)
        accelerator.wait_for_everyone()
        return path

    def complete(self) -> list[Path]:
        if not self.root.exists():
            return []
        done = [p for p in self.root.glob("step-*") if (p / "state.json").exists()]
        return sorted(done, key=lambda p: int(p.name.split("-")[1]))

    def resume(self, accelerator) -> dict | None:
        """Load the newest complete checkpoint into the prepared objects; its state, or None."""
        done = self.complete()
        if not done:
            return None
        accelerator.load_state(str(done[-1]))
        state = json.loads((done[-1] / "state.json").read_text())
        log.info("resumed from checkpoint %s (step %d)", done[-1], state["step"])
        return state


def save_model(accelerator, model, tokenizer, out: Path) -> bool:
    """Save the (unwrapped) model and tokenizer to `out`. A peft model saves only its adapter.
    Returns True when an adapter was saved."""
    unwrapped = accelerator.unwrap_model(model)
    adapter = hasattr(unwrapped, "peft_config")
    if accelerator.is_main_process:
        out.mkdir(parents=True, exist_ok=True)
        unwrapped.save_pretrained(out)
        tokenizer.save_pretrained(out)
    accelerator.wait_for_everyone()
    return adapter


def progress(total: int, desc: str, enabled: bool = True, initial: int = 0):
    """A tqdm bar on stderr (live in a terminal, a line every 10 s in logs)."""
    from tqdm.auto import tqdm

    interactive = sys.stderr.isatty()
    return tqdm(total=total, initial=initial, desc=desc, disable=not enabled, file=sys.stderr, dynamic_ncols=True,
                mininterval=0.2 if interactive else 10.0, ascii=not interactive)


class Throughput:
    """Tokens/s and samples/s between two log points."""

    def __init__(self):
        self.t0, self.tokens, self.samples = time.perf_counter(), 0, 0

    def add(self, tokens: int, samples: int) -> None:
        self.tokens += tokens
        self.samples += samples

    def read(self) -> dict[str, float]:
        dt = max(1e-9, time.perf_counter() - self.t0)
        out = {"tokens_per_s": self.tokens / dt, "samples_per_s": self.samples / dt}
        self.t0, self.tokens, self.samples = time.perf_counter(), 0, 0
        return out
