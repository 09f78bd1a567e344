"""A batch's host tensors made cheaply, and copies from the host to a device that do not make the host wait for the
device."""

from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np
import torch


def int64_tensor(values) -> torch.Tensor:
    """`values` (a list of ints, or of equal-length lists) as an int64 host tensor, through NumPy: `torch.tensor` of
    a Python list takes ~80 ns a value, NumPy ~20, and a DPO batch of 8 pairs of ~1,000 tokens makes ~60k of them
    (half of its ~19 ms collate on the CPU of these machines, on the host's side of a step)."""
    return torch.from_numpy(np.asarray(values, dtype=np.int64))


def to_device(data, device):
    """`data` (a tensor, or dicts, lists and tuples of them; other values pass through) on `device`, without the host
    waiting for the device. A plain `.to("cuda")` of a host tensor synchronises the stream: the host waits until every
    kernel already queued has run, so the GPU then idles while the host prepares what comes next. On CUDA each host
    tensor is staged in page-locked memory and copied `non_blocking`, queued behind that work (the caching host
    allocator keeps the staging buffer alive until the copy has run); elsewhere it is a plain move. For the
    per-micro-batch pieces trainers build on the host: index lists, masks, advantages, padding-free layouts."""
    from accelerate.utils import recursively_apply

    target = torch.device(device)
    stage = target.type == "cuda"

    def move(t: torch.Tensor) -> torch.Tensor:
        if stage and t.device.type == "cpu":
            t = t.pin_memory()
        return t.to(target, non_blocking=True)

    return recursively_apply(move, data, error_on_other_type=False)


class OneBuffer:
    """A collated batch whose host tensors lie in one byte buffer: what a loader's worker process hands over.

    A worker's batch reaches the training process through shared memory, one file descriptor and mapping per
    storage, and on a GPU is then page-locked and copied to the device storage by storage. A DPO batch holds 13
    tensors (the padded rows, the padding-free layout, its offsets); `rebuild_storage_fd` took ~9 ms a batch on
    these machines' CPU, in the loader's pin-memory thread, beside the step but holding the interpreter's lock for
    part of it. Laid out in one buffer, the batch crosses as one descriptor, is pinned as one block and copied in one
    transfer. `of` packs a batch (dicts, lists and tuples of tensors and other values); `to(device)` gives it back
    as it was collated, its tensors views of one buffer on `device`. PyTorch's loader calls `pin_memory`, and
    accelerate's device placement calls `to`."""

    ALIGN = 64  # bytes: every view starts aligned for any dtype, and for vectorised kernels reading it

    __slots__ = ("buffer", "tree")

    def __init__(self, buffer: torch.Tensor, tree):
        self.buffer, self.tree = buffer, tree

    @classmethod
    def of(cls, batch) -> OneBuffer:
        placed: list[tuple[torch.Tensor, _Slot]] = []
        end = 0

        def place(t: torch.Tensor) -> _Slot:
            nonlocal end
            if t.device.type != "cpu":
                raise ValueError(f"OneBuffer: a batch's tensors must be on the host, not {t.device}")
            slot = _Slot(end, t.dtype, tuple(t.shape))
            end += -(-t.numel() * t.element_size() // cls.ALIGN) * cls.ALIGN
            placed.append((t, slot))
            return slot

        tree = _map(batch, torch.Tensor, place)
        buffer = torch.empty(end, dtype=torch.uint8)
        for t, slot in placed:
            _view(buffer, slot).copy_(t)
        return cls(buffer, tree)

    def pin_memory(self, device=None) -> OneBuffer:
        return OneBuffer(self.buffer.pin_memory(), self.tree)

    def to(self, device, non_blocking: bool = False):
        """The batch as collated, its tensors on `device`, views of one copy of the buffer."""
        buffer = self.buffer.to(device, non_blocking=non_blocking)
        return _map(self.tree, _Slot, lambda slot: _view(buffer, slot))


class _Slot(NamedTuple):
    """Where a tensor lies in a `OneBuffer`."""

    offset: int
    dtype: torch.dtype
    shape: tuple[int, ...]


def _map(tree, kind: type, fn):
    """`tree` (dicts, lists, tuples and named tuples) with each leaf of `kind` replaced by `fn(leaf)`."""
    if isinstance(tree, kind):
        return fn(tree)
    if isinstance(tree, dict):
        return {k: _map(v, kind, fn) for k, v in tree.items()}
    if isinstance(tree, tuple) and hasattr(tree, "_fields"):
        return type(tree)(*(_map(v, kind, fn) for v in tree))
    if isinstance(tree, (list, tuple)):
        return type(tree)(_map(v, kind, fn) for v in tree)
    return tree


def _view(buffer: torch.Tensor, slot: _Slot) -> torch.Tensor:
    nbytes = slot.dtype.itemsize * math.prod(slot.shape)
    return buffer[slot.offset : slot.offset + nbytes].view(slot.dtype).view(slot.shape)
