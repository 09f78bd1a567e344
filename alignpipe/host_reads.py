"""Reading a device value on the host without waiting for the work queued after it.

`float(x)` or `bool(x)` on a CUDA tensor copies it on the tensor's stream, so the host waits until every kernel
queued before the copy has run, including those queued after `x` was computed, and then the GPU idles while the host
queues the next ones. `HostRead(x)` instead queues a copy of `x` into pinned host memory at once and marks it with a
CUDA event; `get()` later waits for that event alone, by which time the work queued since keeps the GPU busy. On
other devices the value is read where it is (a read there waits for nothing).
"""

from __future__ import annotations

import torch


class HostRead:
    """`x`'s value as it is now, for the host to read later with `get()`."""

    def __init__(self, x: torch.Tensor):
        x = x.detach()
        self._landed: torch.cuda.Event | None = None
        if x.device.type != "cuda":
            self._value = x.clone()  # later in-place changes of `x` do not reach it, as on a GPU
            return
        self._value = torch.empty(x.shape, dtype=x.dtype, pin_memory=True)
        self._value.copy_(x, non_blocking=True)
        self._landed = torch.cuda.Event()
        self._landed.record(torch.cuda.current_stream(x.device))  # the stream the copy was queued on

    def get(self) -> torch.Tensor:
        """The value, on the host (on a GPU, waiting for the copy if it has not landed yet)."""
        if self._landed is not None:
            self._landed.synchronize()
        return self._value
