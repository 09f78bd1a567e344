"""Summed cross-entropy of an LM head, with its gradients computed in the forward pass (SFT's loss).

The LM head of a 150k-vocabulary model is a quarter of a 0.5B model's FLOPs, and its float32 logits for a 16k-token
step would take 10 GB. `token_logprobs` bounds the logits by running the head in chunks under activation
checkpointing, which pays for the memory with a second head forward in backward: 4 head matmuls per token. When the
loss is a plain sum of token NLLs, as SFT's is, the gradient with respect to each chunk's logits is known in the
forward (softmax minus one-hot, times the loss's upstream gradient, a scalar applied in backward), so each chunk
computes its gradients for the hidden states and the head there and frees its logits: 3 matmuls per token, no
recomputation, no logits kept. This is the design of Liger's fused linear cross-entropy, in plain torch.

Shapes: N = scored positions, d = hidden size, V = vocabulary.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from alignpipe import fused_kernels, triton_kernels
from alignpipe.compiled import chunk_bounds, compiled_function


def _nll_sum(x: torch.Tensor, lse: torch.Tensor, labels: torch.Tensor, dft: bool = False) -> torch.Tensor:
    """Σ (log-sum-exp − the label's logit) over a chunk's rows (with `dft`, each weighted by its probability)."""
    nll = lse - x.gather(-1, labels[:, None]).squeeze(-1)
    return (nll * torch.exp(-nll)).sum() if dft else nll.sum()


def _nll_and_grad(logits: torch.Tensor, labels: torch.Tensor, precise: torch.dtype, dft: bool = False):
    """One chunk's summed NLL and d(Σ NLL)/d logits = softmax − one-hot, eagerly, in two passes over the chunk: a
    log-softmax in `precise` (float32 at least), and its exp written straight in the logits' dtype. The labels'
    entries, p − 1, are then set from their precise log-probs (`expm1`), so a confident label's small gradient keeps
    its digits. (A float copy, log-sum-exp, subtract, exp and cast made five passes, ~36 bytes per bf16 logit.)"""
    lsm = torch.log_softmax(logits, -1, dtype=precise)
    rows = torch.arange(labels.size(0), device=labels.device)
    label_lp = lsm[rows, labels]
    grad = torch.exp(lsm, out=torch.empty_like(logits))
    grad[rows, labels] = torch.expm1(label_lp).to(grad.dtype)
    if dft:  # each row's loss and gradient weighted by its label's probability, a constant (`linear_nll_sum`)
        weight = torch.exp(label_lp)
        grad.mul_(weight[:, None].to(grad.dtype))
        return -(weight * label_lp).sum(), grad
    return -label_lp.sum(), grad


def _nll_and_grad_fusable(logits: torch.Tensor, labels: torch.Tensor, precise: torch.dtype, dft: bool = False):
    """`_nll_and_grad` as element-wise expressions that `torch.compile` fuses into a row reduction and one pass
    writing the gradient in the logits' dtype: the float32 copy and the separate passes over the (rows × V) chunk
    are never materialised, which is most of the head's memory traffic in eager mode."""
    x = logits.to(precise)
    lse = torch.logsumexp(x, -1, keepdim=True)
    nll = lse - x.gather(-1, labels[:, None])
    hit = torch.arange(x.size(-1), device=x.device)[None, :] == labels[:, None]
    grad = torch.exp(x - lse) - hit.to(precise)
    if dft:
        weight = torch.exp(-nll)
        return (weight * nll).sum(), (grad * weight).to(logits.dtype)
    return nll.sum(), grad.to(logits.dtype)


def _nll_and_grad_by_hand(logits: torch.Tensor, labels: torch.Tensor, precise: torch.dtype, dft: bool = False):
    """`_nll_and_grad_fusable` on `triton_kernels`' hand-written head kernels (DPO's): the log-sum-exp and label
    log-prob in one read of the logits (`token_scores`), then coef · (one-hot − softmax) with coef = −1 (with `dft`,
    −p) in one read and one write (`token_grads`). The same passes as inductor's kernels, without a compiled
    function's guards and wrappers at each chunk, or the compiler in the process (`fused_kernels.available`)."""
    lse, label_lp = triton_kernels.token_scores(logits, labels)
    if dft:
        weight = torch.exp(label_lp)
        return -(weight * label_lp).sum().to(precise), triton_kernels.token_grads(logits, lse, labels, -weight)
    coef = torch.full_like(label_lp, -1.0)
    return -label_lp.sum().to(precise), triton_kernels.token_grads(logits, lse, labels, coef)


def _nll_sum_only(logits: torch.Tensor, labels: torch.Tensor, precise: torch.dtype, dft: bool, by_hand: bool):
    """A chunk's summed NLL without its gradient (an evaluation pass): one read of the logits by `token_scores` where
    the hand-written kernels run, else the log-sum-exp of a `precise` copy."""
    if by_hand:
        _, label_lp = triton_kernels.token_scores(logits, labels)
        weighted = label_lp * torch.exp(label_lp) if dft else label_lp
        return -weighted.sum().to(precise)
    x = logits.to(precise)
    return _nll_sum(x, torch.logsumexp(x, -1), labels, dft)


def _chunk_kernels(hidden: torch.Tensor, compiled: bool):
    """The kernels of each chunk's softmax and gradient: eager, or (`compiled`) the hand-written ones where
    `fused_kernels.by_hand` takes the head (decided on `hidden`: its logits share its device, and the kernels take
    every floating dtype the head runs in), inductor's otherwise (compiled at their first call)."""
    if not compiled:
        return _nll_and_grad
    if fused_kernels.by_hand(hidden, head=True):
        return _nll_and_grad_by_hand
    return compiled_function(_nll_and_grad_fusable)


class _LinearNLLSum(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, labels, rows_per_chunk: int, compiled: bool, grads: bool, dft: bool):
        # `needs_input_grad` says True for a parameter under no_grad too: `grads` is the caller's grad mode
        want_h, want_w, want_b = (grads and want for want in ctx.needs_input_grad[:3])
        precise = torch.promote_types(hidden.dtype, torch.float32)  # the softmax's dtype: float32 at least
        total = torch.zeros((), dtype=precise, device=hidden.device)
        grad_h = torch.empty_like(hidden) if want_h else None
        grad_w = torch.zeros_like(weight) if want_w else None
        grad_b = torch.zeros(bias.shape, dtype=precise, device=bias.device) if want_b else None
        nll_and_grad = _chunk_kernels(hidden, compiled)
        for s, e in chunk_bounds(hidden.size(0), rows_per_chunk):
            h, y = hidden[s:e], labels[s:e]
            logits = F.linear(h, weight, bias)
            if not (want_h or want_w or want_b):
                total += _nll_sum_only(logits, y, precise, dft, by_hand=nll_and_grad is _nll_and_grad_by_hand)
                continue
            nll, grad = nll_and_grad(logits, y, precise, dft)
            total += nll
            if grad_b is not None:
                grad_b += grad.to(precise).sum(0)
            grad = grad.to(weight.dtype)
            if grad_h is not None:
                grad_h[s:e] = grad @ weight
            if grad_w is not None:
                grad_w.addmm_(grad.t(), h)
        ctx.save_for_backward(grad_h, grad_w, grad_b)
        ctx.bias_dtype = bias.dtype if bias is not None else None
        return total

    @staticmethod
    def backward(ctx, grad_out):
        grad_h, grad_w, grad_b = ctx.saved_tensors
        return (
            grad_h * grad_out.to(grad_h.dtype) if grad_h is not None else None,
            grad_w * grad_out.to(grad_w.dtype) if grad_w is not None else None,
            (grad_b * grad_out).to(ctx.bias_dtype) if grad_b is not None else None,
            None,
            None,
            None,
            None,
            None,
        )


def linear_nll_sum(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    labels: torch.Tensor,
    rows_per_chunk: int,
    compiled: bool = False,
    dft: bool = False,
) -> torch.Tensor:
    """Σ −log softmax(hidden Wᵀ + b)[label] over the N rows of `hidden` (N, d), in float32 (float64 for float64
    inputs), with `labels` (N,) all scored. Runs `rows_per_chunk` rows at a time (`chunk_bounds`: a last row
    alone joins the chunk before it); where gradients are wanted they are computed here, chunk by chunk, and only
    scaled in backward (under `no_grad`, none are: evaluation pays one head matmul per token). The weight's
    gradient accumulates in the weight's dtype over chunks, as autograd's sum of per-chunk gradients would.
    `compiled` (a stage's `compile: true`): each chunk's softmax and gradient run as one compiled kernel
    (`_nll_and_grad_fusable`) instead of several passes over the chunk's logits. `dft`
    (Dynamic Fine-Tuning, Wu et al. 2025): each token's NLL weighted by its probability p, held constant, so the
    value is Σ p·NLL and the gradient p·(softmax − one-hot), as TRL's `loss_type: dft`."""
    rows = max(1, rows_per_chunk)
    return _LinearNLLSum.apply(hidden, weight, bias, labels, rows, compiled, torch.is_grad_enabled(), dft)
