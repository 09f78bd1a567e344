"""Stopping on a NaN/inf loss without a device read per step.

Reading a step's loss on the host at once (`float(loss)`) makes the host wait until the device has finished the
step: the next step's kernels are queued only after, and the GPU idles for the host's share of a step (collation,
launches). `LossWatch` instead copies the loss to pinned host memory asynchronously, marks the copy with a CUDA
event, and looks at it when the next step has been queued, by which time the copy has landed.

The price is one step of lag: a diverged step's update is applied before the run stops. So the loop settles the
watch at once wherever a diverged model would be used: log points (which read the metrics anyway), evaluations,
checkpoint saves and the end of the run. A checkpoint is therefore never written after an unnoticed NaN loss.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass
class _Pending:
    step: int
    value: torch.Tensor  # on the host, or (on a GPU) a pinned buffer the copy lands in
    landed: torch.cuda.Event | None


class LossWatch:
    """Holds the losses of the steps not yet checked: `watch(step, loss)` after a step's work is queued,
    `first_bad()` for the earliest non-finite one among them (waiting for copies still in flight)."""

    def __init__(self) -> None:
        self._pending: list[_Pending] = []

    def watch(self, step: int, loss: torch.Tensor | float | None) -> None:
        """Take step `step`'s loss (a device tensor, a host float, or None where the step reported none) without
        reading it."""
        if loss is None:
            return
        if not isinstance(loss, torch.Tensor):
            self._pending.append(_Pending(step, torch.tensor(float(loss)), None))
            return
        loss = loss.detach()
        if loss.device.type != "cuda":
            self._pending.append(_Pending(step, loss, None))
            return
        host = torch.empty(loss.shape, dtype=loss.dtype, pin_memory=True)
        host.copy_(loss, non_blocking=True)
        landed = torch.cuda.Event()
        landed.record()
        self._pending.append(_Pending(step, host, landed))

    def first_bad(self) -> tuple[int, float] | None:
        """(step, value) of the earliest watched loss that is NaN or infinite, else None; every watched loss is
        checked and forgotten."""
        pending, self._pending = self._pending, []
        for p in pending:
            if p.landed is not None:
                p.landed.synchronize()
            value = float(p.value)
            if not math.isfinite(value):
                return p.step, value
        return None
