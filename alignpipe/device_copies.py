"""A batch's host tensors made cheaply, and copies from the host to a device that do not make the host wait for the
device."""

from __future__ import annotations

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
