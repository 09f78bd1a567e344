"""A loss of summed sequence log-probs (DPO's), with the LM head's gradients computed in the forward pass.

DPO's loss depends on each answer's summed log-prob S_r = Σ_t log p(y_t). Through the chunked, checkpointed head of
`logprobs.token_logprobs` that costs 4 head matmuls per scored token (forward, the recomputed forward in backward,
and the two gradient matmuls). The loss's gradient with respect to a token's logits is g_r · (one-hot − softmax),
where g_r = ∂loss/∂S_r is a scalar per answer; g_r is known as soon as the answers whose sums the loss couples are
scored (a chosen answer and its rejected one). So the head runs over a group of coupled answers at a time: logits,
their log-probs and sums, the group's loss and its g_r by autograd on those few scalars, then the hidden-state and
head gradients, and the logits are freed: 3 matmuls per token and no recomputation. Backward only scales them. This
is Liger's fused linear preference loss design, in plain torch.

What it costs: a group's float32 logits at once (a pair of 512-token answers over a 152k vocabulary: 0.6 GB), and
the head's gradient (V × d, the weight's dtype) held from the forward to the backward.

Shapes: N = scored tokens (all rows' segments, row after row), d = hidden size, V = vocabulary, R = rows (answers).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from alignpipe import fused_kernels, triton_kernels
from alignpipe.compiled import compiled_function
from alignpipe.device_copies import to_device

GroupLoss = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
"""(S of a group's rows (k,), their row numbers (k,), a long tensor on the device) -> that group's share of the loss (a
scalar)."""


def _scores_fusable(logits: torch.Tensor, labels: torch.Tensor, precise: torch.dtype):
    """(log-sum-exp, the label's log-prob) per token, as one row reduction that reads the logits once when
    compiled (no float copy of the group's logits)."""
    x = logits.to(precise)
    lse = torch.logsumexp(x, -1)
    return lse, x.gather(-1, labels[:, None]).squeeze(-1) - lse


def _grad_fusable(logits: torch.Tensor, lse: torch.Tensor, labels: torch.Tensor, coef: torch.Tensor, precise):
    """g · (one-hot − softmax) per token, as one element-wise pass writing the logits' dtype when compiled."""
    hit = torch.arange(logits.size(-1), device=logits.device)[None, :] == labels[:, None]
    softmax = torch.exp(logits.to(precise) - lse[:, None])
    return (coef[:, None] * (hit.to(precise) - softmax)).to(logits.dtype)


def _group_indices(groups: list[list[int]], row_tokens: list[int], device) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per group, on `device`: its rows (k,), and the row (0..k−1 within the group) of each of its tokens. Built on the
    host and copied once for all groups without a wait (`to_device`): a tensor indexed by a host list, or sized by a
    device count, would make the host wait for the device's queue to drain at every group."""
    rows = torch.tensor([r for group in groups for r in group], dtype=torch.long)
    local = []
    for group in groups:
        counts = [row_tokens[r] for r in group]
        ids = torch.arange(len(group))
        local.append(torch.repeat_interleave(ids, torch.tensor(counts, dtype=torch.long), output_size=sum(counts)))
    flat = to_device(torch.cat([rows, *local]), device)
    out, at, token_at = [], 0, len(rows)
    for group, n in zip(groups, local, strict=True):
        out.append((flat[at : at + len(group)], flat[token_at : token_at + len(n)]))
        at, token_at = at + len(group), token_at + len(n)
    return out


class _LinearSequenceLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, labels, row_tokens, groups, loss_of: GroupLoss, grads: bool, compiled: bool):
        # `needs_input_grad` says True for a parameter under no_grad too: `grads` is the caller's grad mode
        want_h, want_w, want_b = (grads and want for want in ctx.needs_input_grad[:3])
        precise = torch.promote_types(hidden.dtype, torch.float32)
        device = hidden.device
        starts = [0]
        for n in row_tokens:
            starts.append(starts[-1] + n)
        total = torch.zeros((), dtype=precise, device=device)
        sums = torch.zeros(len(row_tokens), dtype=precise, device=device)
        grad_h = torch.zeros_like(hidden) if want_h else None
        grad_w = torch.zeros_like(weight) if want_w else None
        grad_b = torch.zeros(bias.shape, dtype=precise, device=bias.device) if want_b else None
        for group, (rows, local) in zip(groups, _group_indices(groups, row_tokens, device), strict=True):
            spans = [(starts[r], starts[r + 1]) for r in group]
            h = torch.cat([hidden[s:e] for s, e in spans])
            y = torch.cat([labels[s:e] for s, e in spans])
            logits = F.linear(h, weight, bias)
            by_hand = compiled and fused_kernels.by_hand(logits, head=True)
            if by_hand:
                lse, token_lp = triton_kernels.token_scores(logits, y)
            elif compiled:
                lse, token_lp = compiled_function(_scores_fusable)(logits, y, precise)
            else:
                lsm = torch.log_softmax(logits, -1, dtype=precise)
                token_lp = lsm.gather(-1, y[:, None]).squeeze(-1)
            s_group = torch.zeros(len(group), dtype=precise, device=device).index_add_(0, local, token_lp)
            sums.index_copy_(0, rows, s_group)
            with torch.enable_grad():
                leaf = s_group.detach().requires_grad_()
                loss = loss_of(leaf, rows)
                (g,) = torch.autograd.grad(loss, leaf) if loss.requires_grad else (torch.zeros_like(leaf),)
            total += loss.detach().to(precise)
            if not (want_h or want_w or want_b):
                continue
            coef = g[local]
            if by_hand:
                grad = triton_kernels.token_grads(logits, lse, y, coef)
            elif compiled:
                grad = compiled_function(_grad_fusable)(logits, lse, y, coef, precise)
            else:  # −g · softmax, written in the logits' dtype; the labels' g · (1 − p) from their precise log-probs
                grad = torch.mul(lsm.exp_(), -coef[:, None], out=torch.empty_like(logits))
                grad[torch.arange(y.size(0), device=device), y] = (-coef * torch.expm1(token_lp)).to(grad.dtype)
            if grad_b is not None:
                grad_b += grad.to(precise).sum(0)
            grad = grad.to(weight.dtype)
            if grad_h is not None:
                g_h = grad @ weight
                offset = 0
                for s, e in spans:
                    grad_h[s:e] = g_h[offset : offset + e - s]
                    offset += e - s
            if grad_w is not None:
                grad_w.addmm_(grad.t(), h)
        ctx.save_for_backward(grad_h, grad_w, grad_b)
        ctx.bias_dtype = bias.dtype if bias is not None else None
        ctx.mark_non_differentiable(sums)
        return total, sums

    @staticmethod
    def backward(ctx, grad_total, _grad_sums):
        grad_h, grad_w, grad_b = ctx.saved_tensors
        return (
            grad_h * grad_total.to(grad_h.dtype) if grad_h is not None else None,
            grad_w * grad_total.to(grad_w.dtype) if grad_w is not None else None,
            (grad_b * grad_total).to(ctx.bias_dtype) if grad_b is not None else None,
            None,
            None,
            None,
            None,
            None,
            None,
        )


def linear_sequence_loss(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    labels: torch.Tensor,
    row_tokens: list[int],
    groups: list[list[int]],
    loss_of: GroupLoss,
    compiled: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(Σ over `groups` of `loss_of(S[group], group)`, S detached (R,)), where S_r = Σ log softmax(h Wᵀ + b)[y] over
    row r's tokens (float32, float64 for float64 inputs). `hidden` (N, d) and `labels` (N,) hold the rows' scored
    tokens one row after another, `row_tokens[r]` of row r (host ints); `groups` (host lists of rows) partition
    the rows into those a group's loss couples, and each group's loss may depend on its own rows' sums only. The
    gradients of the loss are computed here, group by group, and only scaled in backward (none under `no_grad`);
    S carries none. `compiled` (a stage's `compile: true`, or `fused_kernels` on a GPU): each group's log-sum-exp
    and gradient run as two kernels over its logits instead of a float copy and ~6 passes: hand-written where Triton
    runs them (`triton_kernels.token_scores`, `token_grads`), otherwise compiled (`_scores_fusable`,
    `_grad_fusable`)."""
    grads = torch.is_grad_enabled()
    return _LinearSequenceLoss.apply(hidden, weight, bias, labels, row_tokens, groups, loss_of, grads, compiled)
