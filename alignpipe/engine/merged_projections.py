"""In a decode step recorded as a CUDA graph, the projections that read one input run as one matmul.

An attention module's q, k and v projections read the same hidden states, and so do an MLP's gate and up. At a
decode step's few rows each is a small matmul whose time is mostly its launch and its fixed start and finish, not
its bytes, so 3 + 2 of them a layer cost about as much as 2 larger ones. `MergedProjections` concatenates each such
group's weights (and biases) for one recording; while it is `active` (a context variable, set around the warm-up and
the capture), the first member of a group to be called computes the merged product and its siblings, called with
the same input, return their slices of it: 3 kernels fewer a layer in every replay.

The merged weights are copies: they live as long as the recording (one rollout) and are made only where they fit in
a quarter of the device's free memory (~0.5 GB for Qwen2-0.5B). Only groups of plain `nn.Linear`s are merged (a
LoRA or quantised projection keeps its own matmul), and only recordings of a policy that takes the fused kernels
(`decode_steps.GraphedDecodeStep`), whose replays already differ from the eager step at rounding level: a merged
matmul may round differently from three.
"""

from __future__ import annotations

import torch

from alignpipe.engine.scoped_patch import ScopedPatch

GROUPS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))
"""Sibling projections of one input in Llama-family attention and MLP modules, in the order their forwards call them."""

FREE_SHARE = 4
"""The merged weights are made only where they take at most 1/FREE_SHARE of the device's free memory."""


class _Group:
    """One group's merged weight and bias, and the last input it multiplied with its slices."""

    def __init__(self, linears: list[torch.nn.Linear]):
        self.members = {id(linear): k for k, linear in enumerate(linears)}
        with torch.no_grad():
            self.weight = torch.cat([linear.weight for linear in linears])
            biases = [linear.bias for linear in linears]
            self.bias = torch.cat(biases) if biases[0] is not None else None  # type: ignore[arg-type]
        self.sizes = [linear.out_features for linear in linears]
        self.last: tuple[torch.Tensor, tuple[torch.Tensor, ...]] | None = None

    def output(self, linear: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
        if self.last is None or self.last[0] is not x:
            product = torch.nn.functional.linear(x, self.weight, self.bias)
            self.last = (x, product.split(self.sizes, dim=-1))
        return self.last[1][self.members[id(linear)]]


class MergedProjections(ScopedPatch):
    """The merged groups of `model` for one recording (none where they would not fit, `budget` bytes); while
    `active`, the members return slices of their group's product."""

    def __init__(self, model: torch.nn.Module, budget: int | None = None):
        found = [linears for module in model.modules() if (linears := _siblings(module))]
        size = sum(linear.weight.numel() * linear.weight.element_size() for group in found for linear in group)
        self.groups: dict[int, _Group] = {}
        if not found or (budget is not None and size > budget):
            return
        for linears in found:
            group = _Group(linears)
            for linear in linears:
                self.groups[id(linear)] = group
                self.wrap(linear, _member_forward, "alignpipe_merged")

    def __len__(self) -> int:
        """How many groups are merged."""
        return len({id(group) for group in self.groups.values()})

    def forget(self) -> None:
        for group in self.groups.values():
            group.last = None

    def output(self, linear: torch.nn.Module, x: torch.Tensor) -> torch.Tensor | None:
        group = self.groups.get(id(linear))
        return group.output(linear, x) if group is not None else None


def budget(device: torch.device) -> int | None:
    """The bytes merged weights may take on `device`: a `FREE_SHARE`th of what is free there, counting the blocks
    torch's caching allocator holds unused; None (no limit) off CUDA."""
    if device.type != "cuda":
        return None
    free, _ = torch.cuda.mem_get_info(device)
    cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    return (free + cached) // FREE_SHARE


def _siblings(module: torch.nn.Module) -> list[torch.nn.Linear] | None:
    """`module`'s group of sibling projections (`GROUPS`), where all are plain `nn.Linear`s with whole weights, alike
    in dtype, device, input width and bias; else None."""
    for names in GROUPS:
        found = [getattr(module, name, None) for name in names]
        # plain layers with whole weights: not LoRA or quantised layers, nor a sharded (DTensor) or gathered weight
        linears = [x for x in found if type(x) is torch.nn.Linear and type(x.weight) is torch.nn.Parameter]
        if len(linears) < len(names):
            continue
        first = linears[0]
        if all(
            linear.weight.dtype == first.weight.dtype
            and linear.weight.device == first.weight.device
            and linear.in_features == first.in_features
            and (linear.bias is None) == (first.bias is None)
            for linear in linears
        ):
            return linears
    return None


def _member_forward(self, x: torch.Tensor) -> torch.Tensor:
    merged = MergedProjections.in_effect()
    if merged is not None and (out := merged.output(self, x)) is not None:
        return out
    return torch.nn.functional.linear(x, self.weight, self.bias)
