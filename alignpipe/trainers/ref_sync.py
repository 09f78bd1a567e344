"""A reference model that follows the policy: TR-DPO's soft update (Gorbatovski et al. 2024), as TRL's
`sync_ref_model` does it for DPO, GRPO and RLOO.

Every `ref_model_sync_steps` optimizer steps, each reference weight becomes α·θ + (1 − α)·θ_ref (α =
`ref_model_mixup_alpha`; α = 1 copies the policy). The synced reference is part of the run's state: a checkpoint
taken after the first sync holds it (`reference.safetensors`), and a resumed run continues from it rather than from
the starting weights it would load again.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

log = logging.getLogger(__name__)

CHECKPOINT_FILE = "reference.safetensors"


def mix_into(reference: torch.nn.Module, policy: torch.nn.Module, alpha: float) -> None:
    """reference ← α·policy + (1 − α)·reference, weight by weight, matched by name. A policy weight sharded by FSDP
    is gathered first (a collective: every process calls this at the same step)."""
    from torch.distributed.tensor import DTensor

    theirs = dict(policy.named_parameters())
    with torch.no_grad():
        for name, target in reference.named_parameters():
            source: torch.Tensor = theirs[name]
            if isinstance(source, DTensor):
                source = source.full_tensor()
            target.mul_(1.0 - alpha).add_(source.to(target.dtype), alpha=alpha)


class ReferenceSync:
    """Mixes the policy into a trainer's frozen reference copy every `every` optimizer steps, and keeps the mixed
    reference in the run's checkpoints. `attach(loop)` hooks it into a `TrainLoop`: after each optimizer step, and
    into each checkpoint; it loads the reference of the checkpoint the loop resumed from."""

    def __init__(self, reference: torch.nn.Module, alpha: float, every: int):
        self.reference, self.alpha, self.every = reference, alpha, every

    def after_step(self, policy: torch.nn.Module, step: int) -> None:
        if step % self.every == 0:
            mix_into(self.reference, policy, self.alpha)
            log.info("reference synced with the policy at step %d (alpha %g)", step, self.alpha)

    def save(self, checkpoint: Path, step: int, main_process: bool) -> None:
        """Write the reference into `checkpoint` once it differs from the starting weights (after the first sync)."""
        from safetensors.torch import save_model

        if main_process and step >= self.every:
            save_model(self.reference, str(Path(checkpoint) / CHECKPOINT_FILE))

    def resume(self, checkpoint: Path | None, step: int) -> None:
        """Load the reference saved in `checkpoint` (the one a run resumed from at `step`)."""
        from safetensors.torch import load_model

        if checkpoint is None or step < self.every:
            return
        path = Path(checkpoint) / CHECKPOINT_FILE
        if not path.exists():
            raise FileNotFoundError(
                f"resuming at step {step} with sync_ref_model needs the synced reference {path}, which is missing "
                "(the checkpoint was written by a run without sync_ref_model?); re-run the stage from scratch (--force)"
            )
        load_model(self.reference, str(path), device=str(next(self.reference.parameters()).device))
        log.info("resumed the synced reference from %s", path)

    def attach(self, loop) -> None:
        loop.after_step.append(lambda step: self.after_step(loop.unwrapped, step))
        loop.checkpoint_files.append(lambda path, step: self.save(path, step, loop.accelerator.is_main_process))
        self.resume(loop.checkpoints.resumed_from, loop.step)


def synced(reference, cfg, loop) -> None:
    """Attach a `ReferenceSync` to `loop` where the stage's config asks for one (`sync_ref_model`)."""
    if getattr(cfg, "sync_ref_model", False):
        ReferenceSync(reference, cfg.ref_model_mixup_alpha, cfg.ref_model_sync_steps).attach(loop)
