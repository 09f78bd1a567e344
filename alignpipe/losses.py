"""Every trainer's loss, as pure functions of tensors (no model calls): the Bradley-Terry reward loss, the DPO family
and KTO, GRPO's clipped per-token loss and its aggregations, PPO's clipped policy and value losses. The trainers
compute log-probs (`alignpipe.logprobs`) and advantages (`alignpipe.rl_math`) and call these; the tests pin each
against TRL's own functions on identical tensors. SFT's summed cross-entropy is computed with the LM head itself
(`alignpipe.linear_ce`), so that its gradients can be formed in the forward.
"""

from __future__ import annotations

import math
from typing import NamedTuple, get_args

import torch
import torch.nn.functional as F

from alignpipe.rl_math import kl_estimate, masked_mean, vespo_weights
from alignpipe.trainers.configs import DPOLossType

# --- reward model ---------------------------------------------------------------------------------


def bradley_terry_loss(
    rewards_chosen: torch.Tensor,
    rewards_rejected: torch.Tensor,
    margin: torch.Tensor | None = None,
    center_coefficient: float | None = None,
) -> torch.Tensor:
    """Mean −log σ(r_c − r_r − margin) (+ centring term). Inputs: (B,) rewards, optional (B,) margins."""
    diff = rewards_chosen - rewards_rejected
    if margin is not None:
        diff = diff - margin
    loss = -F.logsigmoid(diff).mean()
    if center_coefficient is not None:
        loss = loss + center_coefficient * torch.mean((rewards_chosen + rewards_rejected) ** 2)
    return loss


# --- DPO family -----------------------------------------------------------------------------------


def dpo_loss(
    chosen_logps: torch.Tensor,
    rejected_logps: torch.Tensor,
    ref_chosen_logps: torch.Tensor,
    ref_rejected_logps: torch.Tensor,
    beta: float,
    loss_type: str = "sigmoid",
    label_smoothing: float = 0.0,
    chosen_lengths: torch.Tensor | None = None,
    rejected_lengths: torch.Tensor | None = None,
    discopop_tau: float = 0.05,
    f_divergence: str = "reverse_kl",
    alpha_coef: float = 0.5,
):
    """Per-pair DPO-family losses (B,) and the implicit rewards β·log(π/π_ref) for chosen and rejected, each loss a
    function of its own pair (TRL 1.16's formulas; `DPOConfig.loss_type` names the papers). `*_lengths`
    (completion token counts) are needed for `ipo` and `sigmoid_norm`. `f_divergence` maps each log-ratio to the
    score the difference-based losses compare (`f_divergence_scores`)."""
    chosen_ratio = chosen_logps - ref_chosen_logps
    rejected_ratio = rejected_logps - ref_rejected_logps
    chosen_score = f_divergence_scores(chosen_ratio, f_divergence, alpha_coef)
    rejected_score = f_divergence_scores(rejected_ratio, f_divergence, alpha_coef)
    delta = chosen_score - rejected_score
    chosen_reward, rejected_reward = beta * chosen_ratio, beta * rejected_ratio
    if loss_type in ("ipo", "sigmoid_norm"):
        if chosen_lengths is None or rejected_lengths is None:
            raise ValueError(f"{loss_type} needs the completion lengths")
        per_token = chosen_score / chosen_lengths.clamp(min=1) - rejected_score / rejected_lengths.clamp(min=1)
    if loss_type == "sigmoid":
        losses = -F.logsigmoid(beta * delta) * (1 - label_smoothing) - F.logsigmoid(-beta * delta) * label_smoothing
    elif loss_type == "hinge":
        losses = torch.relu(1 - beta * delta)
    elif loss_type == "ipo":
        losses = (per_token - 1 / (2 * beta)) ** 2
    elif loss_type == "sigmoid_norm":
        losses = -F.logsigmoid(beta * per_token)
    elif loss_type == "robust":
        clean, flipped = -F.logsigmoid(beta * delta), -F.logsigmoid(-beta * delta)
        losses = ((1 - label_smoothing) * clean - label_smoothing * flipped) / (1 - 2 * label_smoothing)
    elif loss_type == "exo_pair":
        eps = torch.tensor(label_smoothing, dtype=delta.dtype, device=delta.device)
        won, lost = F.logsigmoid(beta * delta), F.logsigmoid(-beta * delta)
        losses = won.exp() * (won - torch.log1p(-eps)) + lost.exp() * (lost - torch.log(eps))
    elif loss_type == "nca_pair":
        losses = (
            -F.logsigmoid(chosen_reward) - 0.5 * F.logsigmoid(-chosen_reward) - 0.5 * F.logsigmoid(-rejected_reward)
        )
    elif loss_type == "bco_pair":
        losses = -F.logsigmoid(chosen_reward) - F.logsigmoid(-rejected_reward)
    elif loss_type == "sppo_hard":
        losses = (chosen_ratio - 0.5 / beta) ** 2 + (rejected_ratio + 0.5 / beta) ** 2
    elif loss_type == "apo_zero":
        losses = 1 - torch.sigmoid(chosen_reward) + torch.sigmoid(rejected_reward)
    elif loss_type == "apo_down":
        losses = torch.sigmoid(chosen_reward) + 1 - torch.sigmoid(beta * (chosen_ratio - rejected_ratio))
    elif loss_type == "discopop":
        logits = beta * delta
        mix = torch.sigmoid(logits / discopop_tau)
        losses = -F.logsigmoid(logits) * (1 - mix) + torch.exp(-logits) * mix
    else:
        raise ValueError(f"unknown loss_type {loss_type!r}; use one of {', '.join(get_args(DPOLossType))}")
    return losses, chosen_reward.detach(), rejected_reward.detach()


def f_divergence_scores(log_ratio: torch.Tensor, divergence: str, alpha: float = 0.5) -> torch.Tensor:
    """f'(π/π_ref) of the f-divergence that regularises f-DPO (Wang et al. 2023), from the log-ratio u, as TRL 1.16:
    reverse_kl u; forward_kl 1 − e^−u; js_divergence log 2 + log σ(u); alpha_divergence (e^((α−1)u) − 1)/(α−1), its
    exponent clamped at 80 (11 in float16) so that it stays finite, and u itself at α = 1."""
    if divergence == "reverse_kl" or (divergence == "alpha_divergence" and abs(alpha - 1.0) < 1e-6):
        return log_ratio
    if divergence == "forward_kl":
        return 1 - torch.exp(-log_ratio)
    if divergence == "js_divergence":
        return math.log(2) + F.logsigmoid(log_ratio)
    if divergence == "alpha_divergence":
        limit = 11.0 if log_ratio.dtype == torch.float16 else 80.0
        t = torch.clamp(((alpha - 1.0) * log_ratio).float(), max=limit)
        return (torch.exp(t) - 1.0).to(log_ratio.dtype) / (alpha - 1.0)
    raise ValueError(f"unknown f_divergence_type {divergence!r}")


def length_desensitized(per_token: torch.Tensor, mask: torch.Tensor, alpha: float) -> torch.Tensor:
    """LD-DPO's sequence log-probs (Liu et al. 2024), (2B,) from a (2B, C) batch of chosen rows then rejected rows:
    each pair's tokens up to the shorter completion's length count once, the rest `alpha` times (as TRL 1.16)."""
    position = mask.cumsum(1)
    lengths = mask.sum(1)
    shared = torch.minimum(*lengths.chunk(2)).repeat(2).unsqueeze(1)
    head = (position > 0) & (position <= shared) & mask.bool()
    tail = (position > shared) & mask.bool()
    return (per_token * head).sum(1) + alpha * (per_token * tail).sum(1)


def kto_loss(
    logps: torch.Tensor,
    ref_logps: torch.Tensor,
    labels: torch.Tensor,
    kl: torch.Tensor,
    beta: float,
    loss_type: str = "kto",
    desirable_weight: float = 1.0,
    undesirable_weight: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """KTO (Ethayarajh et al. 2024, eqn 7) on unpaired completions: with r = log π(y) − log π_ref(y) and the reference
    point z = `kl` (a detached batch estimate of KL(π ‖ π_ref), ≥ 0), a desirable completion (label true) costs
    w_d · (1 − σ(β(r − z))) and an undesirable one w_u · (1 − σ(β(z − r))). `apo_zero_unpaired` (APO, D'Oosterlinck
    et al. 2024) drops z: 1 − σ(βr) and σ(βr). Returns the mean over the batch's completions and β·r per completion
    (detached; TRL reports the desirable and undesirable ones apart). As TRL 1.16's KTOTrainer, computed per row
    with `where` rather than TRL's boolean indexing, which reads the labels back from the device."""
    logratios = logps - ref_logps
    if loss_type == "kto":
        chosen_losses = 1 - torch.sigmoid(beta * (logratios - kl))
        rejected_losses = 1 - torch.sigmoid(beta * (kl - logratios))
    elif loss_type == "apo_zero_unpaired":
        chosen_losses = 1 - torch.sigmoid(beta * logratios)
        rejected_losses = torch.sigmoid(beta * logratios)
    else:
        raise ValueError(f"unknown KTO loss_type {loss_type!r}")
    losses = torch.where(labels, desirable_weight * chosen_losses, undesirable_weight * rejected_losses)
    return losses.nanmean(), beta * logratios.detach()


# --- GRPO -----------------------------------------------------------------------------------------


def per_token_loss(
    logps: torch.Tensor,
    old_logps: torch.Tensor | None,
    ref_logps: torch.Tensor | None,
    advantages: torch.Tensor,
    epsilon: float,
    epsilon_high: float,
    beta: float,
    kl_correction: bool = True,
    mask: torch.Tensor | None = None,
    importance_sampling_level: str = "token",
    loss_type: str = "dapo",
    sapo_temperatures: tuple[float, float] = (1.0, 1.05),
    delta: float | None = None,
    policy_tokens: torch.Tensor | None = None,
    sampling_weights: torch.Tensor | None = None,
    vespo: tuple[tuple[float, float], tuple[float, float]] = ((2.0, 3.0), (3.0, 2.0)),
):
    """The policy loss per token, (B, C) (+ β·k3 KL, times the ratio with `kl_correction`); also the importance ratio
    π/π_old ((B, C), or (B, 1) at the sequence level) and the KL term (or None). As TRL 1.16's GRPOTrainer:
    - the ratio per token, or with `importance_sampling_level: sequence` (GSPO) one per completion, the exponential
      of its mean token log-ratio under `mask`;
    - the clipped surrogate −min(ρA, clip(ρ, 1 − ε, 1 + ε_high)A) (grpo, bnpo, dr_grpo, dapo, luspo);
    - cispo: −sg(min(ρ, ε_high))·A·log π, the clipped ratio a constant weight on the policy gradient (MiniMax-M1);
    - sapo: −(4/τ)·σ(τ(ρ − 1))·A, a soft gate instead of the clip, τ by the sign of A (`sapo_temperatures`:
      positive, non-positive);
    - vespo: −φ(w)·A·log π, φ the gamma weight of the completion's importance weight w (`rl_math.vespo_weights`,
      `vespo` = ((k, λ) for A ≥ 0, (k, λ) for A < 0)); `sampling_weights` enter w there instead of weighing the loss.
    `delta` caps the unclipped ratio too (INTELLECT-2's two-sided clip); `policy_tokens` (a 0/1 (B, C) mask, e.g. the
    high-entropy tokens) keeps the policy term on those tokens only, the KL term on all. `sampling_weights` ((B, C) or
    (B, 1): `rl_math.sampling_importance_weights`, times `rl_math.off_policy_mask`) weigh the policy term too."""
    old = logps.detach() if old_logps is None else old_logps
    log_ratio = logps - old
    token_log_ratio = log_ratio
    if importance_sampling_level == "sequence":
        if mask is None:
            raise ValueError("sequence-level importance sampling needs the completion mask")
        log_ratio = ((log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).unsqueeze(-1)
    ratio = torch.exp(log_ratio)
    adv = advantages.unsqueeze(1)
    if loss_type == "cispo":
        loss = -torch.clamp(ratio, max=epsilon_high).detach() * adv * logps
    elif loss_type == "sapo":
        pos, neg = sapo_temperatures
        temperature = torch.where(adv > 0, pos, neg)
        loss = -torch.sigmoid(temperature * (ratio - 1)) * 4 / temperature * adv
    elif loss_type == "vespo":
        if mask is None:
            raise ValueError("vespo's sequence weights need the completion mask")
        (k_pos, lam_pos), (k_neg, lam_neg) = vespo
        phi = vespo_weights(advantages, token_log_ratio, mask, sampling_weights, (k_pos, k_neg), (lam_pos, lam_neg))
        loss = -phi * adv * logps
        sampling_weights = None  # inside φ
    else:
        unclipped = ratio if delta is None else torch.clamp(ratio, max=delta)
        loss = -torch.min(unclipped * adv, torch.clamp(ratio, 1 - epsilon, 1 + epsilon_high) * adv)
    if policy_tokens is not None:
        loss = loss * policy_tokens
    if sampling_weights is not None:
        loss = loss * sampling_weights
    kl = None
    if beta != 0.0:
        if ref_logps is None:
            raise ValueError("beta > 0 needs the reference log-probs")
        kl = kl_estimate(logps, ref_logps, "k3")
        if kl_correction:
            kl = kl * ratio
        loss = loss + beta * kl
    return loss, ratio, kl


def aggregate(
    loss: torch.Tensor,
    mask: torch.Tensor,
    loss_type: str,
    max_completion_length: int,
    step_tokens_per_process: float,
    accumulation: int,
) -> torch.Tensor:
    """One micro-batch's contribution to the step loss (already divided for accumulation)."""
    if loss_type in ("grpo", "sapo"):
        return ((loss * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).mean() / accumulation
    if loss_type == "luspo":  # each completion's summed loss: GSPO weighted by length
        return (loss * mask).sum(-1).mean() / accumulation
    if loss_type == "bnpo":
        return (loss * mask).sum() / mask.sum().clamp(min=1.0) / accumulation
    if loss_type == "dr_grpo":
        return (loss * mask).sum() / (loss.size(0) * max_completion_length) / accumulation
    if loss_type in STEP_TOKEN_NORMALISED:
        return (loss * mask).sum() / max(1.0, step_tokens_per_process)
    raise ValueError(f"unknown loss_type {loss_type!r}")


STEP_TOKEN_NORMALISED = ("dapo", "cispo", "vespo")
"""GRPO loss types whose micro-batch losses are shares of the whole step's (divided by its token count)."""


# --- RLOO -----------------------------------------------------------------------------------------


def rloo_loss(
    seq_logps: torch.Tensor, old_seq_logps: torch.Tensor, advantages: torch.Tensor, epsilon: float, epsilon_high: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """RLOO's clipped surrogate on whole sequences: ρ = exp(log π(y) − log π_old(y)) with log π(y) the summed token
    log-probs of a completion, loss = mean over completions of −min(ρ·A, clip(ρ, 1 − ε, 1 + ε_high)·A). Returns
    (loss, ρ). As TRL 1.16's RLOOTrainer."""
    ratio = torch.exp(seq_logps - old_seq_logps)
    clipped = torch.clamp(ratio, 1 - epsilon, 1 + epsilon_high)
    return -torch.min(ratio * advantages, clipped * advantages).mean(), ratio


# --- PPO ------------------------------------------------------------------------------------------


class PolicyLoss(NamedTuple):
    loss: torch.Tensor
    clipfrac: torch.Tensor
    ratio: torch.Tensor
    approxkl: torch.Tensor
    """½ · mean of (log π − log π_old)² over response tokens."""
    policykl: torch.Tensor
    """mean of (log π_old − log π) over response tokens (TRL 0.7's `policy/policykl`, early stopping's measure)."""


def policy_loss(new_logprobs, old_logprobs, advantages, mask, cliprange: float) -> PolicyLoss:
    """Clipped surrogate: mean over response tokens of max(−A·ρ, −A·clip(ρ, 1 ± cliprange)), with its statistics
    over the same tokens."""
    diff = new_logprobs - old_logprobs
    ratio = torch.exp(diff)
    losses1 = -advantages * ratio
    losses2 = -advantages * torch.clamp(ratio, 1.0 - cliprange, 1.0 + cliprange)
    loss = masked_mean(torch.max(losses1, losses2), mask)
    clipfrac = masked_mean((losses2 > losses1).float(), mask)
    return PolicyLoss(
        loss, clipfrac, ratio, 0.5 * masked_mean(diff.detach() ** 2, mask), masked_mean(-diff.detach(), mask)
    )


def value_loss(vpred, old_values, returns, mask, cliprange_value: float):
    """½ · mean over response tokens of max((v − R)², (clip(v, v_old ± c) − R)²). Returns (loss, clipfrac)."""
    clipped = torch.clamp(vpred, old_values - cliprange_value, old_values + cliprange_value)
    losses1 = (vpred - returns) ** 2
    losses2 = (clipped - returns) ** 2
    loss = 0.5 * masked_mean(torch.max(losses1, losses2), mask)
    clipfrac = masked_mean((losses2 > losses1).float(), mask)
    return loss, clipfrac
