"""`lean_activations: true`: the decoder's RMSNorms and SwiGLU products keep fewer tensors for backward.

Eager PyTorch keeps what each small operator's backward reads. An RMSNorm keeps its input in float32 (twice the
bf16 input's bytes) beside the bf16 normalised copy. A SwiGLU MLP keeps silu(gate) as well as gate and up. At
Qwen2-0.5B's shape and 16k tokens a step that is ~3 GB for the 49 norms and ~3.8 GB for the 24 MLPs. That was the
gap between our eager SFT (26.8 GB) and TRL with Liger's kernels (20.4 GB) on the first H100 run.

Here the norm keeps only its bf16 input and recomputes its few element-wise operators in backward. The MLP's
product keeps gate and up and recomputes silu(gate) (one element-wise pass, as Liger's kernel does). The forward
runs the same operators as transformers' modules, and the backward the same formulas (aten's own `silu_backward`,
autograd through the norm), so outputs and gradients equal the unpatched model's bit for bit. Only modules whose
forward is known are patched: the RMSNorm and SwiGLU MLP of Llama, Qwen2, Qwen3 and Mistral. Others run as they
are. Compiled layers (`compile: true`) are left alone: inductor already chooses what to keep.

On a CUDA device whose torch has it, the norm runs as torch's fused RMSNorm kernel (`torch._fused_rms_norm`) instead:
one pass forward and one backward where the operators above take about eight of each over the hidden states,
keeping the input and one float32 scale per token, as Liger's norm kernel does. It normalises and scales in float32
and rounds once, where transformers' rounds the normalised input to bf16 before the scale, so outputs differ from
the unpatched model's by at most two bf16 rounding steps, one for each of transformers' roundings
(`bench/gpu_checks.py` measures both on the GPU). Where `fused_kernels` is on (the default), the MLP's product
runs on CUDA as one compiled kernel each way (`fused_kernels.silu_mul`), keeping the same two tensors, and so does
each attention module's rotary embedding (`fused_kernels.rotary`). With a plain trained down projection (full
fine-tuning) the product itself is not kept for it: the backward's kernel writes it again
(`fused_kernels.silu_mul_down`)."""

from __future__ import annotations

import functools
import types

import torch

from alignpipe import fused_kernels

NORMS = {"LlamaRMSNorm", "Qwen2RMSNorm", "Qwen3RMSNorm", "MistralRMSNorm"}
MLPS = {"LlamaMLP", "Qwen2MLP", "Qwen3MLP", "MistralMLP"}
ATTENTIONS = {"LlamaAttention", "Qwen2Attention", "Qwen3Attention", "MistralAttention"}


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' LlamaRMSNorm.forward, operator for operator."""
    input_dtype = x.dtype
    h = x.to(torch.float32)
    variance = h.pow(2).mean(-1, keepdim=True)
    h = h * torch.rsqrt(variance + eps)
    return weight * h.to(input_dtype)


class _LeanRMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps):
        ctx.save_for_backward(x, weight)
        ctx.eps = eps
        return _rms_norm(x, weight, eps)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        with torch.enable_grad():
            xd, wd = x.detach().requires_grad_(), weight.detach().requires_grad_()
            dx, dw = torch.autograd.grad(_rms_norm(xd, wd, ctx.eps), (xd, wd), grad)
        return dx, dw, None


class _LeanSiluMul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate, up):
        ctx.save_for_backward(gate, up)
        return torch.nn.functional.silu(gate) * up

    @staticmethod
    def backward(ctx, grad):
        gate, up = ctx.saved_tensors
        return torch.ops.aten.silu_backward(grad * up, gate), grad * torch.nn.functional.silu(gate)


@functools.cache
def fused_norm_kernel() -> bool:
    """Whether this torch has a CUDA kernel for `_fused_rms_norm` (2.13 has; a CPU build has none)."""
    return torch._C._dispatch_has_kernel_for_dispatch_key("aten::_fused_rms_norm", "CUDA")


def _fused_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """torch's fused RMSNorm over the last dimension, scaled by `weight` (its own autograd: the input and one float32
    scale per row kept)."""
    return torch._fused_rms_norm(x, [x.shape[-1]], weight, eps)[0]


def _norm_forward(self, hidden_states):
    if hidden_states.is_cuda and hidden_states.dtype == self.weight.dtype and fused_norm_kernel():
        return _fused_norm(hidden_states, self.weight, self.variance_epsilon)
    return _LeanRMSNorm.apply(hidden_states, self.weight, self.variance_epsilon)


def _mlp_forward(self, x):
    gate, up = self.gate_proj(x), self.up_proj(x)
    # Not in eager decode steps (one position per row): their rows are too few for one pass less to pay for a
    # compiled call's guards on the host. A decode step recorded as a CUDA graph takes it (the guards run once, at
    # the recording), and inside a compiled graph (a compiled decode step) inductor fuses the plain expression itself.
    # Every multi-token forward takes it, so a rollout's scoring passes and the update's forward round alike (a GRPO
    # ratio of 1 stays 1).
    decode_step = gate.dim() == 3 and gate.size(1) == 1
    fused = (
        not torch.compiler.is_compiling()  # first: what follows reads a context variable, which dynamo cannot trace
        and self.alignpipe_fused_silu
        and (not decode_step or fused_kernels.takes_one_position())
    )
    if fused and fused_kernels.wanted(True, gate.device):
        if fused_kernels.recomputes_product(self.down_proj):
            return fused_kernels.silu_mul_down(gate, up, self.down_proj.weight)
        return self.down_proj(fused_kernels.silu_mul(gate, up))
    return self.down_proj(_LeanSiluMul.apply(gate, up))


def _attention_forward(self, *args, **kwargs):
    if torch.compiler.is_compiling():
        return type(self).forward(self, *args, **kwargs)
    here = fused_kernels.ROTARY_HERE.set(True)  # this module's rotary call takes the fused kernel on a GPU
    try:
        return type(self).forward(self, *args, **kwargs)
    finally:
        fused_kernels.ROTARY_HERE.reset(here)


def lean_activations(model: torch.nn.Module, fused: bool = False) -> int:
    """Patch `model`'s known RMSNorms and SiLU MLPs in place (instance forwards; weights, state dict and hooks
    unchanged); how many modules were patched. `fused`: on a CUDA device the MLPs' products and the attention
    modules' rotary embeddings run as compiled kernels (`fused_kernels.silu_mul`, `fused_kernels.rotary`)."""
    patched = 0
    for module in model.modules():
        name = type(module).__name__
        if name in NORMS and hasattr(module, "variance_epsilon"):
            module.forward = types.MethodType(_norm_forward, module)
        elif name in MLPS and type(getattr(module, "act_fn", None)).__name__ in ("SiLUActivation", "SiLU"):
            module.forward = types.MethodType(_mlp_forward, module)
            object.__setattr__(module, "alignpipe_fused_silu", fused)  # a plain flag, not a submodule or buffer
        elif fused and name in ATTENTIONS and fused_kernels.take_rotary(type(module).__module__):
            module.forward = types.MethodType(_attention_forward, module)
        else:
            continue
        patched += 1
    return patched


def is_patched_norm(module: torch.nn.Module | None) -> bool:
    """Whether `module` is an RMSNorm this module patched (its forward: the fused kernel on CUDA, else the lean norm)."""
    return getattr(getattr(module, "forward", None), "__func__", None) is _norm_forward


def takes_fused_kernels(model: torch.nn.Module) -> bool:
    """Whether `model` was patched with `fused` (its MLPs' products and rotary embeddings through `fused_kernels`)."""
    return any(getattr(module, "alignpipe_fused_silu", False) for module in model.modules())
