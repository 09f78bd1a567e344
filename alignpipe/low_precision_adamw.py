"""`low_precision_updates`: AdamW that keeps the small updates of bf16/fp16 weights, which rounding to the nearest
value throws away.

A bf16 number has 8 significant bits: around a weight w the representable values are ~w/256 apart, and an update
smaller than half that is rounded away. Adam's update is about the learning rate per element, so with the weights
in bf16 (`model.dtype: bfloat16`, as TRL's trainers run a bf16-loaded model) and a Qwen-sized weight of 0.02, every
update under ~4e-5 is lost: at the learning rates of DPO, GRPO and PPO (1e-6 to 5e-6) most weights never move.
Measured on CPU (`tests/test_low_precision_adamw.py`): 50 steps at 1e-6 move a 0.02-scale weight matrix 2% as far
as the same steps in float32 do, and 98% of its weights not at all; at 1e-5, 17%.

Two remedies (Zamirai et al. 2020, "Revisiting BFloat16 Training"):
- `kahan` (the default): Kahan summation keeps what each rounding dropped in a buffer of the weights' dtype and
  adds it to the next update (optimi's `kahan_sum`), so weight + buffer follows the float32 trajectory to ~16
  significant bits. +2 bytes a trained parameter (1 GB for Qwen2-0.5B).
- `stochastic` (bf16 weights): each new weight rounds up or down at random, with the probabilities that make its
  expected value the float32 one (torchao's `bf16_stochastic_round`). No buffer, so no memory; the weights follow
  the float32 trajectory in expectation, with noise of about one rounding step. The random bits are a hash of the
  step, the parameter and the position, not a generator's draws: DDP's replicas, whose generators drift apart,
  must round alike. fp16 weights take `kahan`.

On CUDA each slice of 16M bf16 values is one compiled kernel beside torch's fused one (~18 bytes of traffic a value
against its ~14); the eager form, on CPU and for fp16 weights, makes ~25 passes. The moments stay in the weights' dtype, as torch's
AdamW keeps them; the arithmetic is float32, as in its fused kernel. Float32 parameters (LoRA adapters, which peft
keeps in float32) take torch's fused AdamW unchanged.
"""

from __future__ import annotations

import functools
import logging
import math

import torch

from alignpipe import fused_kernels
from alignpipe.compiled import chunk_bounds

log = logging.getLogger(__name__)

LOW_PRECISION = (torch.bfloat16, torch.float16)

CHUNK = 1 << 24
"""Values per slice of the element-wise passes: the float32 temporaries of a step stay under ~0.5 GB however large
a parameter (an embedding) is."""


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's shard on this process (FSDP2); other tensors as they are. Every pass here is element-wise, and a
    parameter's gradient and states are sharded alike."""
    return t.to_local() if hasattr(t, "to_local") else t


def _slices(tensors: list[torch.Tensor]):
    """Flat slices of at most `CHUNK` values over each of `tensors`, which share one shape: for each slice, the
    tuple of their views (the tensors whole where one the step writes is not contiguous, so has no flat view)."""
    tensors = [t.detach() for t in tensors]
    if not all(t.is_contiguous() for t in tensors[:1] + tensors[2:]):
        yield tuple(tensors)
        return
    # Each slice a view of a 1-D tensor that is itself no view (`detach` drops the link to the parameter): a compiled
    # step guards on its inputs' bases, so a matrix's rows and a vector would otherwise be graphs of their own.
    flat = [t.reshape(-1).detach() for t in tensors]
    for start, stop in chunk_bounds(flat[0].numel(), CHUNK):  # no one-value slice, which would compile again
        yield tuple(f[start:stop] for f in flat)


class LowPrecisionAdamW(torch.optim.AdamW):
    """torch's AdamW for float32 parameters; for bf16/fp16 ones, the same update computed in float32 and added with
    Kahan compensation (state `kahan_comp`, beside torch's `exp_avg` and `exp_avg_sq`) or, for bf16 under
    `updates="stochastic"`, rounded stochastically. With `fused_kernels` (a stage's setting) each slice's update is
    one compiled kernel on a CUDA device, as torch's fused AdamW is one."""

    def __init__(self, params, *args, updates: str = "kahan", fused_kernels: bool = False, **kwargs):
        if updates not in ("kahan", "stochastic"):
            raise ValueError(f"updates must be 'kahan' or 'stochastic', not {updates!r}")
        super().__init__(params, *args, **kwargs)
        self.updates = updates
        self.fused_kernels = fused_kernels

    @torch.no_grad()
    def step(self, closure=None):
        if closure is not None:
            raise ValueError("LowPrecisionAdamW.step takes no closure")
        held: list[list[tuple[torch.Tensor, torch.Tensor]]] = []  # each group's (parameter, gradient) pairs
        for group in self.param_groups:
            held.append([(p, p.grad) for p in group["params"] if p.grad is not None and p.dtype in LOW_PRECISION])
            for p, _ in held[-1]:
                p.grad = None  # torch's step skips parameters without a gradient
        try:
            super().step()
        finally:
            for p, grad in (pair for pairs in held for pair in pairs):
                p.grad = grad
        for group_index, (group, pairs) in enumerate(zip(self.param_groups, held)):
            if pairs:
                self._low_precision_step(group_index, group, [p for p, _ in pairs])
        return None

    def _low_precision_step(self, group_index: int, group: dict, params: list[torch.Tensor]) -> None:
        beta1, beta2 = (float(b) for b in group["betas"])
        lr, eps, decay = float(group["lr"]), float(group["eps"]), float(group["weight_decay"])
        for position, p in enumerate(params):
            stochastic = rounds_stochastically(self.updates, p.dtype)
            state = self.state[p]
            names = ("exp_avg", "exp_avg_sq") + (() if stochastic else ("kahan_comp",))
            if not state:
                state["step"] = torch.tensor(0.0)
            elif state["step"].device.type != "cpu":  # torch's load_state_dict moves it for fused steps
                state["step"] = state["step"].cpu()
            for name in names:  # all at the first step; the buffer too where a run resumes under `kahan`
                if name not in state:
                    state[name] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["step"] += 1
            step = float(state["step"])  # a host tensor: no device read
            scalars = (beta1, beta2, lr / (1 - beta1**step), math.sqrt(1 - beta2**step), lr * decay, eps)
            assert p.grad is not None  # `step` hands over only parameters with a gradient
            tensors = [_local(t) for t in (p, p.grad, *(state[name] for name in names))]
            for index, piece in enumerate(_slices(tensors)):
                # the rounding's random bits: a hash of where and when, the same on every process of a DDP stage,
                # whose replicas must round alike (the global generator's state differs between ranks)
                salt = _mix(int(step), group_index, position, index) if stochastic else None
                self._update_slice(piece, scalars, salt)

    def _update_slice(self, piece: tuple[torch.Tensor, ...], scalars: tuple[float, ...], salt: int | None) -> None:
        """One slice's update, rounded stochastically where it has a `salt`: compiled where the stage's fused kernels
        run, for bf16 weights, eagerly elsewhere and from the first slice the compiler fails on (said once;
        compilation fails before the kernel writes anything). fp16 weights take the eager step: their rounding is a
        cast, which a compiled kernel may skip (`round_to_bf16`)."""
        args = (*piece, *scalars) if salt is None else (*piece, *scalars, salt)
        if piece[0].dtype == torch.bfloat16 and fused_kernels.wanted(self.fused_kernels, piece[0].device):
            try:
                _compiled(salt is not None)(*args)
                return
            except (torch._dynamo.exc.TorchDynamoException, torch._inductor.exc.InductorError) as err:
                log.warning("low_precision_updates: the compiled step failed (%s); the eager step runs instead", err)
                self.fused_kernels = False
        (kahan_update if salt is None else stochastic_update)(*args)


def _adamw_step(weight, grad, exp_avg, exp_avg_sq, beta1, beta2, step_size, root_correction, lr_decay, eps):
    """The moments (written back) and the step in float32, torch's fused AdamW's arithmetic: (weight, step), both
    float32."""
    g = grad.float()
    m = exp_avg.float().lerp_(g, 1 - beta1)
    v = exp_avg_sq.float().mul_(beta2).addcmul_(g, g, value=1 - beta2)
    exp_avg.copy_(m)
    exp_avg_sq.copy_(v)
    denom = v.sqrt_().div_(root_correction).add_(eps)
    w = weight.float()
    # the decay as a product, not `alpha=` or a branch, which would make a compiled step specialise on its value;
    # `neg_()` after the product, not `mul_(-step_size)`: torch 2.11's dynamo guards on a negated float input's value,
    # which recompiled the step for every learning rate (the same bits: negation is exact)
    return w, m.div_(denom).mul_(step_size).neg_().sub_(w * lr_decay)


def kahan_update(weight, grad, exp_avg, exp_avg_sq, comp, *scalars) -> None:
    """weight ← round(weight + step + comp), comp ← what that rounding dropped."""
    w, update = _adamw_step(weight, grad, exp_avg, exp_avg_sq, *scalars)
    update.add_(comp.float())
    new = round_to_bf16(w + update) if weight.dtype == torch.bfloat16 else (w + update).to(weight.dtype).float()
    weight.copy_(new)
    comp.copy_(update.sub_(new.sub_(w)))


def round_to_bf16(x: torch.Tensor) -> torch.Tensor:
    """float32 → the nearest bf16 value (ties to even), as float32: `x.to(torch.bfloat16)`'s value, worked out on the
    bits. Kahan's compensation is taken from the rounded value, and a compiled kernel may read the float32 sum in
    place of a cast or of the bf16 weight it just wrote: inductor does by default, and torch 2.11's also under
    `emulate_precision_casts` (the buffer then holds ~nothing: off by up to 3e-3 on unit-scale weights, about half a
    rounding step, and the weights drift from the eager step's). Integer arithmetic cannot be skipped. NaN stays
    NaN."""
    bits = x.view(torch.int32)
    rounded = (bits + (0x7FFF + ((bits >> 16) & 1))).bitwise_and_(-(1 << 16)).view(torch.float32)
    return torch.where(x.isnan(), x, rounded)


def stochastic_update(weight, grad, exp_avg, exp_avg_sq, *scalars) -> None:
    """weight (bf16) ← weight + step, rounded up or down at random in proportion to its distance from each (the last
    scalar: the salt of the random bits)."""
    w, update = _adamw_step(weight, grad, exp_avg, exp_avg_sq, *scalars[:-1])
    weight.copy_(round_stochastically(w.add_(update), scalars[-1]))


def round_stochastically(x: torch.Tensor, salt: int) -> torch.Tensor:
    """float32 → bf16, rounding away from zero with probability (the 16 bits bf16 drops) / 2^16: a float's bits are
    sign and magnitude, so adding uniform noise below the kept bits and truncating is unbiased for either sign. The
    noise is a hash of each value's position and `salt` (so the same on every process), not a generator's draw."""
    bits = x.view(torch.int32)
    position = torch.arange(bits.numel(), device=x.device, dtype=torch.int64).view(bits.shape)
    noise = (_lowbias32(position ^ salt) >> 16).to(torch.int32)
    return (bits + noise).bitwise_and_(-(1 << 16)).view(torch.float32).to(torch.bfloat16)


_MASK32 = 0xFFFFFFFF


def _lowbias32(h):
    """Wellons' lowbias32 integer hash of each value's low 32 bits (tensors of int64, or an int): every output bit
    depends on every input bit."""
    h = h & _MASK32
    h = h ^ (h >> 16)
    h = (h * 0x7FEB352D) & _MASK32
    h = h ^ (h >> 15)
    h = (h * 0x846CA68B) & _MASK32
    return h ^ (h >> 16)


def _mix(*parts: int) -> int:
    """One 32-bit salt from a few small integers (step, group, parameter, slice)."""
    h = 0
    for part in parts:
        h = _lowbias32(h ^ (part & _MASK32) ^ 0x9E3779B9)
    return h


@functools.cache
def _compiled(stochastic: bool):
    """The slice update of bf16 weights as one kernel, compiled once a process: dynamic sizes, and the learning
    rate's terms as inputs, not constants (no graph per step). Every rounding whose result the step reads again is
    done on the bits (`round_to_bf16`, `round_stochastically`), so the compiled step equals the eager one whatever
    inductor does with casts."""
    return torch.compile(stochastic_update if stochastic else kahan_update, dynamic=True)


def rounds_stochastically(updates: str, dtype: torch.dtype) -> bool:
    """Whether `low_precision_updates: updates` rounds weights of `dtype` stochastically (bf16 only; fp16 weights
    keep Kahan's buffer)."""
    return updates == "stochastic" and dtype == torch.bfloat16


def low_precision_params(params) -> list[torch.Tensor]:
    """The bf16/fp16 parameters among `params` (those `LowPrecisionAdamW` steps itself)."""
    return [p for p in params if p.dtype in LOW_PRECISION]
