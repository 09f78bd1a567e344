"""`activation_offloading: true` on a training stage: the decoder keeps what it saves for backward in host memory.

At long sequences the tensors a decoder saves for backward outgrow its weights (Qwen2-0.5B keeps ~12 GB for a
16k-token micro-batch: 24 layers × 30.8 kB a token). Offloading copies each of them to pinned host memory as the
forward saves it and back to the device when the backward needs it, so device memory holds the weights, the optimizer
state and a few layers' tensors in flight. Each offloaded byte crosses the host link twice a step: the forward's
copies run on a side stream, beside the compute; the backward waits for each copy back (no prefetch), so a step costs
about `offloaded_gb / host-to-device bandwidth` more (logged as `offloaded_gb` per step). With
`gradient_checkpointing` the decoder saves only each layer's input (the rest is recomputed): 1.8 of those 30.8 kB, the
pairing that suits long contexts, as in TRL and torchtune.

Only the decoder's own tensors move (hooks on the decoder stack's forward, which also hold under DDP, FSDP and
activation checkpointing, where the checkpoint's own hooks stay innermost): the LM head's and the loss's are the
first the backward needs, and copying them out only to wait for them again would be pure cost (TRL leaves its output
head out for the same reason). Parameters and views of them (a linear layer saves its weight transposed), tensors
under 1 KiB, broadcast views (copying them would materialise the broadcast) and tensor subclasses stay where they
are. A tensor saved several times in one forward (a norm's output feeding the query, key and value projections) is
copied once.
"""

from __future__ import annotations

import logging
import weakref
from dataclasses import dataclass
from typing import Self

import torch
from torch import nn

log = logging.getLogger(__name__)

MIN_BYTES = 1024
"""Smaller saved tensors stay on the device: their copies would cost more in launches than they free."""


@dataclass
class _Stored:
    """A saved tensor's host copy and the device it goes back to."""

    host: torch.Tensor
    device: torch.device


def decoder_bodies(model: nn.Module) -> list[nn.Module]:
    """The decoder stacks of `model` (a causal LM, a sequence classifier, PPO's policy and value pair, under peft,
    DDP or FSDP): each transformers model that is its own base model (`LlamaModel` in `LlamaForCausalLM`), outermost
    only."""
    from transformers import PreTrainedModel

    found: list[nn.Module] = []
    inside: set[int] = set()  # ids of the modules within one found already
    for module in model.modules():
        if id(module) not in inside and isinstance(module, PreTrainedModel) and module.base_model is module:
            found.append(module)
            inside.update(id(m) for m in module.modules())
    return found


def _dense_strides(t: torch.Tensor) -> bool:
    """Whether `t`'s elements fill a block of memory with no gaps (contiguous up to a permutation of its dims), so a
    copy can keep its strides."""
    expected = 1
    for d in sorted(range(t.dim()), key=lambda d: t.stride(d)):
        if t.size(d) != 1 and t.stride(d) != expected:
            return False
        expected *= t.size(d)
    return True


class ActivationOffload:
    """Saved-tensor hooks that keep a forward's saved tensors on the host while they wait for the backward.

    `attach(model)` opens them around each decoder stack's forward that records gradients (`with offload:` around
    any other code); `bytes_moved()` reads and resets how many bytes went to the host since the last read (a
    host-side count: no device wait). Offloads tensors of devices of `device_type` only (CUDA; `cpu` copies host
    tensors, which exercises the same path where there is no GPU, as the tests do)."""

    def __init__(self, device_type: str = "cuda", min_bytes: int = MIN_BYTES):
        self.device_type, self.min_bytes = device_type, min_bytes
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._open: list[bool] = []  # per decoder forward entered: whether it pushed the hooks
        self._copied: dict[int, tuple[weakref.ref, int, _Stored]] = {}  # id(tensor) -> (tensor, version, copy)
        self._streams: dict[torch.device, torch.cuda.Stream] = {}
        self._bytes = 0

    def attach(self, model: nn.Module) -> Self:
        bodies = decoder_bodies(model)
        if not bodies:
            raise ValueError(
                f"activation_offloading: found no transformers decoder in {type(model).__name__} to offload from"
            )
        for body in bodies:
            body.register_forward_pre_hook(self._enter)
            body.register_forward_hook(self._exit, always_call=True)
        return self

    def bytes_moved(self) -> int:
        moved, self._bytes = self._bytes, 0
        return moved

    def __enter__(self) -> Self:
        """Offload what autograd saves from here on (the outermost of nested entries; not where no gradient is
        recorded, since nothing is saved there)."""
        push = not self._open and torch.is_grad_enabled()
        if push:
            self._hooks.__enter__()
        self._open.append(push)
        return self

    def __exit__(self, *exc) -> None:
        if self._open.pop():
            self._hooks.__exit__(None, None, None)
            self._copied.clear()  # the copies live on in the autograd graph; this forward's dedup ends here

    # A compiled region (a rollout's compiled decode step traces the whole model) records no gradients: nothing to
    # offload, and no Python state for the compiler to trace.
    def _enter(self, module, args) -> None:
        if not torch.compiler.is_compiling():
            self.__enter__()

    def _exit(self, module, args, output) -> None:
        if not torch.compiler.is_compiling():
            self.__exit__()

    def keeps(self, t: torch.Tensor) -> bool:
        """Whether `t` stays where it is rather than going to the host."""
        return (
            type(t) is not torch.Tensor  # parameters, tensor subclasses (DTensor, float8)
            or t.device.type != self.device_type
            or t.layout != torch.strided
            or t.is_nested  # no strides to copy by
            or isinstance(t._base, nn.Parameter)  # a weight's transpose, saved by every linear layer
            or t.numel() * t.element_size() < self.min_bytes
            or any(st == 0 and n > 1 for st, n in zip(t.stride(), t.shape, strict=True))  # broadcast
        )

    def _pack(self, t: torch.Tensor):
        if self.keeps(t):
            return t
        seen = self._copied.get(id(t))
        if seen is not None and seen[0]() is t and seen[1] == t._version:
            return seen[2]
        stored = _Stored(self._copy_out(t), t.device)
        self._copied[id(t)] = (weakref.ref(t), t._version, stored)
        self._bytes += t.numel() * t.element_size()
        return stored

    def _copy_out(self, t: torch.Tensor) -> torch.Tensor:
        cuda = t.device.type == "cuda"
        if _dense_strides(t):
            host = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="cpu", pin_memory=cuda)
        else:
            host = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=cuda)
        if not cuda:
            return host.copy_(t)
        side = self._side(t.device)
        side.wait_stream(torch.cuda.current_stream(t.device))  # the kernels that wrote `t` come first
        with torch.cuda.stream(side):
            host.copy_(t, non_blocking=True)
        # `t` is freed as soon as autograd drops it; its memory must wait for the copy before it is handed out again
        t.record_stream(side)
        return host

    def _unpack(self, saved):
        if isinstance(saved, torch.Tensor):
            return saved
        if saved.device.type != "cuda":
            return saved.host
        torch.cuda.current_stream(saved.device).wait_stream(self._side(saved.device))
        return saved.host.to(saved.device, non_blocking=True)

    def _side(self, device: torch.device) -> torch.cuda.Stream:
        if device not in self._streams:
            self._streams[device] = torch.cuda.Stream(device)
        return self._streams[device]


def offload_activations(model: nn.Module, device: torch.device) -> ActivationOffload | None:
    """`activation_offloading` for a stage whose model runs on `device`: None on the CPU, where activations are in
    host memory already (said once in the log)."""
    if device.type == "cpu":
        log.info("activation_offloading: the model runs on the CPU, whose activations are in host memory already")
        return None
    return ActivationOffload(device.type).attach(model)
