"""In a decode step recorded as a CUDA graph, each residual add runs in one kernel with the RMSNorm that reads its sum.

A Llama-family decoder layer adds its attention's output to the residual stream and normalises the sum for its MLP,
then adds the MLP's output, which the next layer's input norm normalises. Eagerly each add is a kernel of its own
before the norm's. At a decode step's few rows a kernel's time is its launch and its fixed start and finish, not its
bytes, so the adds cost about what the norms do. While a `FusedResiduals` is `active` (`scoped_patch`: set around
a recording's warm-up and capture), the layers compute each sum and its normalised copy in one compiled kernel
(`add_norm`), and a layer's input norm takes the copy the previous layer's last add made: 2 kernels fewer a layer
(the last layer's final add stays apart; the model's final norm is its own).

Numerics: the sum is the eager add's, bit for bit. The normalised copy is the fused RMSNorm's that a patched policy
runs on a GPU (`lean_activations`): normalised and scaled in float32, rounded once, up to the order of the
reduction's terms. Only layers of known classes (`LAYERS`, whose forwards are transformers' plain pre-norm block)
with both norms patched by `lean_activations` are changed, and only recordings of a policy that takes the fused
kernels use it (`decode_steps.StepFusions`), whose replays already differ from the eager step at rounding level;
and only where the fused kernels are taken (`fused_kernels.wanted`: on CUDA).
"""

from __future__ import annotations

from typing import Any

import torch

from alignpipe import fused_kernels, lean_activations
from alignpipe.compiled import compiled_function
from alignpipe.engine.scoped_patch import ScopedPatch

LAYERS = {"LlamaDecoderLayer", "Qwen2DecoderLayer", "Qwen3DecoderLayer", "MistralDecoderLayer"}
"""Decoder layers whose forward is `input_layernorm → self_attn → add → post_attention_layernorm → mlp → add` (the
same source in transformers 5.2x for all four)."""


def _add_norm(residual: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float):
    total = residual + delta
    x = total.to(torch.promote_types(total.dtype, torch.float32))
    normed = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight.to(x.dtype)
    return total, normed.to(total.dtype)


def add_norm(residual: torch.Tensor, delta: torch.Tensor, norm: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    """(residual + delta, `norm`(residual + delta)) from one compiled kernel: the sum rounded as the eager add rounds
    it, the norm computed from the rounded sum in float32 and rounded once."""
    return compiled_function(_add_norm)(residual, delta, norm.weight, norm.variance_epsilon)


class FusedResiduals(ScopedPatch):
    """The decoder layers of `model` whose adds are fused with the norms after them while `active` (none where the
    model has no such layers)."""

    def __init__(self, model: torch.nn.Module):
        self.following: dict[int, torch.nn.Module | None] = {}
        """Per fused layer (by id): the norm that reads its output (the next layer's input norm), or None."""
        self.prenormed: tuple[torch.Tensor, torch.Tensor] | None = None
        """The last layer output whose normalised copy its add made, and that copy."""
        for layers in _stacks(model):
            for k, layer in enumerate(layers):
                following: Any = layers[k + 1].input_layernorm if k + 1 < len(layers) else None
                self.following[id(layer)] = following
                self.wrap(layer, _layer_forward, "alignpipe_fused_residuals")

    def __len__(self) -> int:
        """How many layers are fused."""
        return len(self.following)

    def forget(self) -> None:
        self.prenormed = None

    def layer(self, layer: Any, hidden_states: torch.Tensor, **kwargs) -> torch.Tensor:
        """`layer`'s forward with its adds fused: transformers' pre-norm block, step for step."""
        normed = None
        if self.prenormed is not None and self.prenormed[0] is hidden_states:
            normed = self.prenormed[1]
        self.prenormed = None
        if normed is None:
            normed = layer.input_layernorm(hidden_states)
        attended, _ = layer.self_attn(hidden_states=normed, **kwargs)
        residual, normed = add_norm(hidden_states, attended, layer.post_attention_layernorm)
        out = layer.mlp(normed)
        following = self.following[id(layer)]
        if following is None:
            return residual + out
        total, normed = add_norm(residual, out, following)
        self.prenormed = (total, normed)
        return total


def _stacks(model: torch.nn.Module) -> list[torch.nn.ModuleList]:
    """`model`'s stacks of decoder layers that can be fused: `ModuleList`s of known layers (`LAYERS`) whose norms
    `lean_activations` patched."""
    return [
        stack
        for stack in model.modules()
        if isinstance(stack, torch.nn.ModuleList)
        and len(stack)
        and all(
            type(layer).__name__ in LAYERS
            and lean_activations.is_patched_norm(getattr(layer, "input_layernorm", None))
            and lean_activations.is_patched_norm(getattr(layer, "post_attention_layernorm", None))
            for layer in stack
        )
    ]


def _layer_forward(self, hidden_states, *args, **kwargs):
    fused = FusedResiduals.in_effect()
    if (
        fused is None
        or args  # positional extras: not the call the model makes
        or id(self) not in fused.following
        or not fused_kernels.wanted(True, hidden_states.device)
    ):
        return type(self).forward(self, hidden_states, *args, **kwargs)
    return fused.layer(self, hidden_states, **kwargs)
