"""`fused_kernels: true` (the default): on a CUDA device, the element-wise work between a step's matmuls runs as
kernels that `torch.compile` writes, each reading its inputs once and writing its outputs once, while the model's
layers stay eager.

Eager PyTorch runs every operator as its own kernel, reading and writing the whole tensor each time. Between the
matmuls of a training step that is most of the memory traffic. Two places carry most of it:

- the SwiGLU product of each MLP (eager decode steps aside: `GRAPH_RECORDING`), over (tokens × intermediate)
  tensors (16k × 4864 at Qwen2-0.5B's SFT shape: 160 MB each in bf16). Eagerly that is 2 kernels forward and 4 backward with their
  temporaries, about 16 passes over such a tensor; fused, one kernel each way and 8 passes (`silu_mul`). Where the
  down projection is a plain trained `nn.Linear` (full fine-tuning), the product is not kept for it either: the
  backward's kernel writes it again (`silu_mul_down`, one pass more, a quarter of a layer's kept bytes less).
- the LM head's softmax and gradient per chunk, over (positions × vocabulary) logits (16k × 151,936 per SFT step:
  5 GB in bf16). Eagerly that is a float32 log-softmax and its exp, ~24 bytes of traffic per logit; fused, ~6
  (`linear_ce._nll_and_grad_by_hand` or `_nll_and_grad_fusable`, `linear_sequence_loss._scores_fusable` and
  `_grad_fusable`). The scoring passes without gradients (reference and old-policy log-probs) run each chunk's
  log-softmax and gather as one kernel after the matmul (`logprobs._chunk_logprobs`, through the trainers'
  `compiled=` argument). GRPO's, PPO's and online DPO's trained head (log-probs with gradients, and the entropy
  they log or an entropy bonus trains through), and DPO's and KTO's chunked head where their fused one cannot run
  (WPO's weights, LD-DPO), read each chunk's logits once forward (`token_scores` with the entropy or log Σp²) and
  once more in backward, writing their gradient once (`token_grads`): ~6 bytes of traffic per bf16 logit besides
  the matmuls, where the eager chunk under activation checkpointing makes over 100 (a float32 copy, log-softmax
  and entropy, formed twice, and their backward). PPO's `kl_penalty: full` reads each chunk's policy and reference
  logits once (`token_kl`: both label log-probs and Σ p (log p − log q)), where the eager chunk forms two float32
  log-softmaxes, their exp, difference and product.

- the rotary embedding of each attention module's queries and keys (`rotary`): eagerly ~10 kernels forward
  (rotate_half's negation and concatenation, two products and a sum, for each), fused one.

These are the kernels Liger writes by hand in Triton (its SwiGLU, RoPE and fused linear cross-entropy). The SwiGLU
and rotary ones are written by hand here too (`triton_kernels`, the default where Triton runs them: `ELEMENTWISE`):
a DPO step calls them ~144 times on a 24-layer model, and a hand-written kernel's call is its launch, where a compiled
function's call also runs dynamo's guards and AOT autograd's and inductor's wrappers (~0.2–0.4 ms of host time
each on this project's CPUs). Otherwise inductor writes them from the same expressions the CPU path runs; each then
compiles with symbolic sizes, on token rows (`_rows`), a few seconds in the first step: once per process and
direction. The LM heads' softmax, scores and gradients (SFT's `linear_ce`, DPO's and KTO's
`linear_sequence_loss`, the scoring passes' and the RL trainers' `logprobs`) are hand-written too
(`triton_kernels.token_scores` and `token_grads`, where `triton_kernels.head_usable`), inductor's otherwise. The passes without gradients
that take inductor's (a frozen reference's log-probs, a recorded rollout's prefill) run under `no_grad` rather than
inference mode to share those graphs (`without_grad`); a recorded decode step's merged projections hand it strided
rows, one graph more. `compile: true` goes further (whole layers, norms and rotary included) at
the price of compiling the layers and keeping to their graph. On a CPU nothing changes: the eager kernels are already what the
tests compare against, and inductor's CPU code would buy little for what it costs to compile.

If the device cannot run them (no Triton, say), `available` finds it on its first call, says so once, and the eager
kernels run; where it passed on the hand-written kernels alone, a kernel compiled later that fails to compile says so
once and runs eagerly (`compiled_function`)."""

from __future__ import annotations

import functools
import logging
import sys
from contextvars import ContextVar

import torch

from alignpipe import triton_kernels
from alignpipe.compiled import compiled_function

log = logging.getLogger(__name__)


@functools.cache
def available(device: torch.device) -> bool:
    """Whether the fused kernels run on `device`: Triton's hand-written ones, or `torch.compile`'s (tried once per
    device and process).

    The kernel it tries is the SwiGLU product's forward as a bf16 training step calls it (two distinct row-major
    token-row tensors, gradients off, as inside an autograd function), so where the MLPs take the compiled kernels
    (`ELEMENTWISE`), the graph compiled here is the one the first MLP runs: the probe costs no compilation of its
    own. Where they take the hand-written ones and Triton runs them (`triton_kernels.usable`, whose probe checks
    them against the eager expressions), nothing is compiled: a default SFT, DPO, reward or KTO step then calls no
    compiled kernel, and the process spares the first compilation, its most expensive (3.1 s on this project's
    2-core CPU; on a GPU ~0.5 s from a warm cache, seconds cold; transformers imports the compiler either way). A
    kernel that is still compiled there (`compiled_function`) runs eagerly if the compiler fails."""
    if ELEMENTWISE == "triton" and triton_kernels.usable(device):
        return True
    try:
        dtype = torch.bfloat16 if torch.device(device).type != "cuda" or torch.cuda.is_bf16_supported() else None
        with torch.no_grad():
            gate, up = (torch.full((2, 8), value, dtype=dtype, device=device) for value in (0.5, 2.0))
            got = compiled_function(_silu_mul_forward)(gate, up)
        return bool(torch.allclose(got.float(), _silu_mul_forward(gate, up).float(), rtol=1e-2))
    except (torch._dynamo.exc.TorchDynamoException, torch._inductor.exc.InductorError, RuntimeError) as err:
        log.warning(
            "fused_kernels: torch.compile cannot build kernels on %s (%s); eager kernels run instead", device, err
        )
        return False


def wanted(enabled: bool, device: torch.device | str) -> bool:
    """Whether a stage with `fused_kernels: enabled` runs the fused kernels on `device`: on CUDA, where they compile.
    (The one gate every caller goes through; tests open it on CPU.)"""
    if not enabled:
        return False
    device = torch.device(device)
    if device.type != "cuda":
        return False
    if device.index is None:  # one probe for "cuda" and "cuda:0"
        device = torch.device("cuda", torch.cuda.current_device())
    return available(device)


def without_grad(fused: bool, model=None):
    """The context of a pass that needs no gradients (a frozen reference's log-probs, a rollout):
    `torch.inference_mode()`, which skips autograd's bookkeeping per op, unless the pass takes the fused kernels
    (`fused`) or runs a `model` sharded by FSDP; then `torch.no_grad()`. Dynamo guards a tensor's dispatch keys,
    which inference tensors lack the autograd ones of, so under inference mode each kernel compiled a second graph
    beside the training step's (on a GPU ~0.5 s each from a warm cache, seconds cold), while the bookkeeping
    `no_grad` keeps is host time that a GPU's kernels hide. FSDP keeps the buffers it gathers shards into from one
    forward to the next, and buffers made under inference mode refuse the training step's gathers."""
    return torch.no_grad() if fused or (model is not None and sharded(model)) else torch.inference_mode()


def sharded(model) -> bool:
    """Whether `model` is an FSDP2 root (accelerate shards the root with its layers; a check at every pass, so no
    scan of the modules)."""
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)


def loss_kernels(cfg, device: torch.device | str) -> bool:
    """Whether a stage's LM-head loss runs its compiled kernels per chunk: under `compile: true` anywhere, under
    `fused_kernels` on CUDA (`cfg`: a stage's `TrainingArgs`)."""
    return cfg.compile or wanted(cfg.fused_kernels, device)


def _silu_mul_forward(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    precise = torch.promote_types(gate.dtype, torch.float32)
    return (torch.nn.functional.silu(gate.to(precise)) * up.to(precise)).to(up.dtype)


def _silu_mul_backward(grad: torch.Tensor, gate: torch.Tensor, up: torch.Tensor):
    """(d gate, d up) of silu(gate) · up: silu(g)' = σ(g) · (1 + g · (1 − σ(g))), in float32 at least, each rounded
    once to its input's dtype."""
    precise = torch.promote_types(gate.dtype, torch.float32)
    g, u, dy = gate.to(precise), up.to(precise), grad.to(precise)
    sig = torch.sigmoid(g)
    d_gate = dy * u * sig * (1 + g * (1 - sig))
    return d_gate.to(gate.dtype), (dy * g * sig).to(up.dtype)


def _rows(t: torch.Tensor) -> torch.Tensor:
    """`t` as (rows, last dim): the kernels see 2-D tensors whatever a caller's leading dimensions are.

    `torch.compile` with dynamic sizes still specialises a dimension of size 1: a packed training row (1, T, ·), a
    decode step's (rows, 1, ·) and padded rows (B, T, ·) were three graphs of one kernel, each compiled in the
    step that first met its shape (seconds on a GPU; in a padded run, in the middle of training, at the first
    one-row batch). As rows they are one. Detached, because dynamo guards a view's base's sizes too (the kernels
    run inside autograd functions, which wire the gradients themselves)."""
    return (t.flatten(0, -2) if t.dim() > 2 else t).detach()


ELEMENTWISE = "triton"
"""Which kernels run the SwiGLU and rotary work, the bf16 AdamW step (Kahan's, `low_precision_adamw`) and the LM
head's scores and gradients in the scoring passes and DPO's and KTO's fused head (`logprobs`,
`linear_sequence_loss`) where the gate is open: `triton`, the hand-written ones (`triton_kernels`, where its probes
pass; elsewhere the compiled ones), or `compiled`, inductor's from the eager expressions. `python -m bench
--compiled-kernels` sets `compiled` to measure what the hand-written ones buy."""


def by_hand(*tensors: torch.Tensor, head: bool = False) -> bool:
    """Whether the SwiGLU or rotary kernel (with `head`, the LM head's scores and gradients) for `tensors` runs as
    `triton_kernels`' hand-written kernel."""
    if ELEMENTWISE != "triton" or not triton_kernels.takes(*tensors):
        return False
    usable = triton_kernels.head_usable if head else triton_kernels.usable
    return usable(tensors[0].device)


def _product(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) · up in gate's shape, from one kernel on rows."""
    if by_hand(gate, up):
        return triton_kernels.silu_mul(_rows(gate), _rows(up)).view(gate.shape)
    return compiled_function(_silu_mul_forward)(_rows(gate), _rows(up)).view(gate.shape)


def _product_grads(grad: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, product: bool = False):
    """(d gate, d up) in gate's and up's shapes from one kernel on rows; with `product`, also the product
    written again, as rows."""
    if by_hand(grad, gate, up):
        d_gate, d_up, *again = triton_kernels.silu_mul_grads(_rows(grad), _rows(gate), _rows(up), product)
    else:
        fn = _silu_mul_backward_and_product if product else _silu_mul_backward
        d_gate, d_up, *again = compiled_function(fn)(_rows(grad), _rows(gate), _rows(up))
    return (d_gate.view(gate.shape), d_up.view(up.shape), *again)


class _SiluMul(torch.autograd.Function):
    """silu(gate) · up keeping gate and up for backward, each direction one compiled kernel."""

    @staticmethod
    def forward(ctx, gate, up):
        ctx.save_for_backward(gate, up)
        return _product(gate, up)

    @staticmethod
    def backward(ctx, grad):
        gate, up = ctx.saved_tensors
        return _product_grads(grad, gate, up)


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) · up, forward and backward each one fused kernel (any device torch.compile builds for; the
    trainers take it on CUDA only, through `lean_activations`). The product is computed in float32 and rounded
    once, where eager rounds silu(gate) first: results differ from eager's by at most one rounding step of the
    inputs' dtype."""
    return _SiluMul.apply(gate, up)


def _silu_mul_backward_and_product(grad: torch.Tensor, gate: torch.Tensor, up: torch.Tensor):
    """`_silu_mul_backward`'s two gradients and the product `_silu_mul_forward` gave, from one read of the three
    inputs."""
    return (*_silu_mul_backward(grad, gate, up), _silu_mul_forward(gate, up))


class _SiluMulDown(torch.autograd.Function):
    """down(silu(gate) · up) through a bias-free down projection `weight`, keeping gate, up and the weight for
    backward but not the product: the backward's one kernel writes the product again beside the two gradients, for
    the weight's gradient."""

    @staticmethod
    def forward(ctx, gate, up, weight):
        ctx.save_for_backward(gate, up, weight)
        return torch.nn.functional.linear(_product(gate, up), weight)

    @staticmethod
    def backward(ctx, grad):
        gate, up, weight = ctx.saved_tensors
        grad_product = grad @ weight
        if not ctx.needs_input_grad[2]:
            return (*_product_grads(grad_product, gate, up), None)
        d_gate, d_up, product = _product_grads(grad_product, gate, up, product=True)
        return d_gate, d_up, _rows(grad).t() @ product


def silu_mul_down(gate: torch.Tensor, up: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """`linear(silu_mul(gate, up), weight)`, the SwiGLU MLP's product and down projection, with the same values and
    gradients but not keeping the product for backward (at Qwen2-0.5B's SFT shape 9.7 kB per token per layer, a
    quarter of what a layer keeps: ~3.8 GB at 16k tokens). What it costs is one more write of the product in the
    backward's fused kernel: 3.8 GB of traffic a step at that shape, ~1.3 ms at an H100's ~3 TB/s."""
    return _SiluMulDown.apply(gate, up, weight)


def recomputes_product(down_proj: torch.nn.Module) -> bool:
    """Whether an MLP's down projection can take `silu_mul_down`: a plain bias-free `nn.Linear` with no hooks of its
    own (a LoRA layer's adapter needs the product kept anyway) whose weight trains, with gradients on (without, the
    projection keeps nothing)."""
    return (
        type(down_proj) is torch.nn.Linear
        and down_proj.bias is None
        and down_proj.weight.requires_grad
        and torch.is_grad_enabled()
        and not (down_proj._forward_hooks or down_proj._forward_pre_hooks)
    )


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, precise: torch.dtype) -> torch.Tensor:
    """x · cos + rotate_half(x) · sin (transformers' rotary embedding), in `precise`."""
    x, half = x.to(precise), x.size(-1) // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), -1) * sin


def _unrotate(grad: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, precise: torch.dtype) -> torch.Tensor:
    """The gradient of `_rotate` with respect to x: grad · cos + rotate_halfᵀ(grad · sin), rotate_halfᵀ(z) being
    (z₂, −z₁)."""
    grad, half = grad.to(precise), grad.size(-1) // 2
    z = grad * sin
    return grad * cos + torch.cat((z[..., half:], -z[..., :half]), -1)


def _rotary_forward(q, k, cos, sin):
    precise = torch.promote_types(q.dtype, torch.float32)
    c, s = cos.unsqueeze(1).to(precise), sin.unsqueeze(1).to(precise)
    return _rotate(q, c, s, precise).to(q.dtype), _rotate(k, c, s, precise).to(k.dtype)


def _rotary_backward(grad_q, grad_k, cos, sin):
    precise = torch.promote_types(grad_q.dtype, torch.float32)
    c, s = cos.unsqueeze(1).to(precise), sin.unsqueeze(1).to(precise)
    return _unrotate(grad_q, c, s, precise).to(grad_q.dtype), _unrotate(grad_k, c, s, precise).to(grad_k.dtype)


def _token_rows(x: torch.Tensor) -> torch.Tensor | None:
    """(B, heads, T, D) queries or keys as (B·T, heads, D) token rows without a copy, as an attention module lays
    them out (the projection's (B, T, heads, D), transposed); None where they are laid out otherwise."""
    b, _, t, _ = x.shape
    tokens = x.transpose(1, 2)
    if b == 1 or t == 1 or tokens.stride(0) == t * tokens.stride(1):
        return tokens.view(b * t, *tokens.shape[2:]).detach()  # detached: `_rows` says why
    return None


def _rotary_call(fn, x: torch.Tensor, y: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """`fn` (the rotary kernel either way) on token rows, where the four tensors give them without a copy (`_rows`
    says why: one compiled graph for packed rows, decode steps and padded rows); on the (B, heads, T, D) tensors
    otherwise. Its outputs in the inputs' shape and layout."""
    b, _, t, _ = x.shape
    rows = _token_rows(x), _token_rows(y)
    if rows[0] is None or rows[1] is None or cos.shape[:2] != (b, t) or sin.shape[:2] != (b, t):
        return fn(x, y, cos, sin)
    out = fn(*rows, _rows(cos), _rows(sin))
    return tuple(o.view(b, t, *o.shape[1:]).transpose(1, 2) for o in out)


class _Rotary(torch.autograd.Function):
    """Queries and keys rotated, each direction one compiled kernel; only cos and sin are kept for backward."""

    @staticmethod
    def forward(ctx, q, k, cos, sin):
        ctx.save_for_backward(cos, sin)
        if by_hand(q, k, cos, sin):
            return triton_kernels.rotary(q, k, cos, sin)
        return _rotary_call(compiled_function(_rotary_forward), q, k, cos, sin)

    @staticmethod
    def backward(ctx, grad_q, grad_k):
        cos, sin = ctx.saved_tensors
        if by_hand(grad_q, grad_k, cos, sin):
            return (*triton_kernels.rotary(grad_q, grad_k, cos, sin, backward=True), None, None)
        return (*_rotary_call(compiled_function(_rotary_backward), grad_q, grad_k, cos, sin), None, None)


def rotary(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """transformers' `apply_rotary_pos_emb(q, k, cos, sin)` for (B, heads, T, head_dim) queries and keys and
    (B, T, head_dim) cos and sin, forward and backward each one fused kernel (computed in float32, rounded once:
    eager rounds each product and the sum)."""
    return _Rotary.apply(q, k, cos, sin)


GRAPH_RECORDING: ContextVar[bool] = ContextVar("alignpipe_graph_recording", default=False)
"""Set while a decode step is recorded as a CUDA graph (`decode_steps.Recording`): the rotary and SwiGLU kernels then
serve one-position steps too. An eager decode step leaves them out: a compiled call's guards cost the host more than
one position per row saves. A recording pays that host work once per rollout and its replays keep only the kernels.
A graphed step's time goes mostly to its kernel count: an H200 replayed Qwen2-0.5B's step (64 rows, ~43 kernels a
layer unpatched, 29 patched) in 4.0 ms where its bytes need 0.28 (docs/benchmarks-log.md, session 29). Fused, with the
decode loop's shared cache positions, attention bias and merged projections (session 31), a patched layer issues
about 13; with its residual adds fused into the norms after them (`engine.fused_residuals`, session 32), about 11."""


def takes_one_position() -> bool:
    """Whether a one-position forward (a decode step) takes the fused kernels: while it is recorded as a graph."""
    return GRAPH_RECORDING.get()


ROTARY_HERE: ContextVar[bool] = ContextVar("alignpipe_fused_rotary", default=False)
"""Set while a patched attention module runs (`lean_activations` with `fused`): the modeling module's rotary
function then takes `rotary` on a CUDA device. Every other model in the process calls transformers' own."""


def take_rotary(modeling_module: str) -> bool:
    """Route `modeling_module`'s `apply_rotary_pos_emb` (transformers' Llama, Qwen2, Qwen3, Mistral modules call it
    by its global name) through `rotary` while `ROTARY_HERE` is set, once per module; whether it has one.
    transformers' attention forwards stay as they are, which is why the switch is the module's global and not an
    instance's attribute."""
    module = sys.modules.get(modeling_module)
    original = getattr(module, "apply_rotary_pos_emb", None)
    if original is None:
        return False
    if getattr(original, "alignpipe_original", None) is not None:
        return True

    def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):
        # not while compiling (a compiled graph fuses the plain expression), nor in eager decode steps (one position)
        if (
            not torch.compiler.is_compiling()
            and ROTARY_HERE.get()
            and unsqueeze_dim == 1
            and q.dim() == 4
            and (q.size(2) > 1 or takes_one_position())
            and wanted(True, q.device)
        ):
            return rotary(q, k, cos, sin)
        return original(q, k, cos, sin, unsqueeze_dim)

    apply_rotary_pos_emb.alignpipe_original = original  # type: ignore[attr-defined]
    module.apply_rotary_pos_emb = apply_rotary_pos_emb  # type: ignore[union-attr]
    return True
