"""Stopping on a NaN/inf loss without a device read per step.

Reading a step's loss on the host at once (`float(loss)`) makes the host wait until the device has finished the
step: the next step's kernels are queued only after, and the GPU idles for the host's share of a step (collation,
launches). `LossWatch` instead takes the loss as a `HostRead` (copied to pinned host memory asynchronously, the copy
marked with a CUDA event) and looks at it when the next step has been queued, by which time the copy has landed.

The price is one step of lag: a diverged step's update is applied before the run stops. So the loop settles the
watch at once wherever a diverged model would be used: log points (which read the metrics anyway), evaluations,
checkpoint saves and the end of the run. A checkpoint is therefore never written after an unnoticed NaN loss.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from alignpipe.host_reads import HostRead


@dataclass
class _Pending:
    step: int
    loss: HostRead


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
        value = loss if isinstance(loss, torch.Tensor) else torch.tensor(float(loss))
        self._pending.append(_Pending(step, HostRead(value)))

    def first_bad(self) -> tuple[int, float] | None:
        """(step, value) of the earliest watched loss that is NaN or infinite, else None; every watched loss is
        checked and forgotten."""
        pending, self._pending = self._pending, []
        for p in pending:
            value = float(p.loss.get())
            if not math.isfinite(value):
                return p.step, value
        return None
