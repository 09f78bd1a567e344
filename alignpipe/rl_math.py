"""RL math as pure functions on tensors (no model calls): masked statistics and whitening, KL estimators, GRPO's
group advantages, GAE, and PPO's per-token rewards and advantages over a response. Losses are in
`alignpipe.losses`, log-probs under a model in `alignpipe.logprobs`.

Shapes: B = batch, T = sequence (completion) length. Masks are 0/1 (or bool) with
the same shape as the values they mask. References: TRL (trl/trainer/utils.py, grpo_trainer.py,
experimental/ppo), "The N+ implementation details of RLHF with PPO" (Huang et al., 2024),
"Approximating KL divergence" (Schulman, 2020).
"""

from __future__ import annotations

import math

import torch


def masked_mean(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Mean of `values` where `mask` is 1 (over everything, or along `dim`)."""
    if dim is None:
        return (values * mask).sum() / mask.sum().clamp(min=1)
    return (values * mask).sum(dim) / mask.sum(dim).clamp(min=1)


def masked_var(values: torch.Tensor, mask: torch.Tensor, unbiased: bool = True) -> torch.Tensor:
    """Variance where `mask` is 1 (Bessel-corrected by default, as TRL's `masked_var`)."""
    mean = masked_mean(values, mask)
    var = masked_mean((values - mean) ** 2, mask)
    if unbiased:
        n = mask.sum()
        if n <= 1:
            raise ValueError("masked_var needs at least two unmasked values")
        var = var * n / (n - 1)
    return var


def masked_whiten(values: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True) -> torch.Tensor:
    """(values − mean) / std over unmasked entries; with `shift_mean=False` the mean is added back
    (PPO whitens rewards without shifting them)."""
    mean, var = masked_mean(values, mask), masked_var(values, mask)
    whitened = (values - mean) * torch.rsqrt(var + 1e-8)
    return whitened if shift_mean else whitened + mean


def kl_estimate(logp: torch.Tensor, ref_logp: torch.Tensor, kind: str = "k3") -> torch.Tensor:
    """Per-token penalty estimating KL(π ‖ π_ref) from tokens sampled from π, with r = log π − log π_ref
    (Schulman 2020): `k1`/`kl` r (unbiased, high variance); `abs` |r|; `k2`/`mse` ½ r²; `k3` exp(−r) − 1 + r
    (unbiased, always ≥ 0). kl/abs/mse are TRL 0.7's `kl_penalty` names (its `_kl_penalty`)."""
    r = logp - ref_logp
    if kind in ("k1", "kl"):
        return r
    if kind == "abs":
        return r.abs()
    if kind in ("k2", "mse"):
        return 0.5 * r**2
    if kind == "k3":
        return torch.exp(-r) - 1 + r
    raise ValueError(f"unknown KL estimator {kind!r}; use kl (k1), abs, mse (k2) or k3")


def frac_zero_std(std: torch.Tensor) -> float:
    """GRPO's `frac_reward_zero_std`: the fraction of completions whose group's reward std is 0 (a group where
    every completion got the same reward, so none of them is learned from). As TRL counts it, a group with fewer
    than two scorable completions has an undefined (NaN) std and is not a zero-std group."""
    return float(torch.isclose(std, torch.zeros_like(std)).float().mean())


def nanstd(values: torch.Tensor, dim: int | None = None, keepdim: bool = False) -> torch.Tensor:
    """Bessel-corrected standard deviation ignoring NaNs."""
    mean = torch.nanmean(values, dim=dim, keepdim=True)
    var = torch.nanmean((values - mean) ** 2, dim=dim, keepdim=True)
    count = (~torch.isnan(values)).sum(dim=dim, keepdim=True)
    std = (var * count / (count - 1)).sqrt()
    if keepdim:
        return std
    return std.squeeze(dim) if dim is not None else std.reshape(())


def group_advantages(rewards: torch.Tensor, group_size: int, scale: str = "group") -> tuple[torch.Tensor, torch.Tensor]:
    """GRPO advantages for rewards (N,) laid out as N/group_size groups of consecutive completions:
    r − mean(group), divided by the group std (`group`), the batch std (`batch`), or not (`none`).
    NaN rewards (unscorable) are left out of the statistics and get advantage 0.
    Returns (advantages (N,), std used for the zero-std check (N,))."""
    grouped = rewards.view(-1, group_size)
    mean = torch.nanmean(grouped, 1, keepdim=True).expand_as(grouped).reshape(-1)
    if scale in ("group", "none"):
        std = nanstd(grouped, 1, keepdim=True).expand_as(grouped).reshape(-1)
    elif scale == "batch":
        std = nanstd(rewards).expand_as(rewards)
    else:
        raise ValueError(f"unknown scale_rewards {scale!r}; use group, batch or none")
    adv = rewards - mean
    if scale != "none":
        adv = adv / (std + 1e-4)
    return torch.nan_to_num(adv, nan=0.0), std


def normalize_then_sum_advantages(
    per_function: torch.Tensor, weights: torch.Tensor, group_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """GDPO's advantages (Liu et al. 2026; TRL's `multi_objective_aggregation: normalize_then_sum`) for rewards
    (N, K), one column per reward function: each function's rewards normalised within each group (mean 0, std 1),
    summed with `weights` (K,), then whitened over the batch. A function's NaN (not applicable) is left out; a row
    no function scored gets advantage 0. Returns (advantages (N,), the batch std (N,) for the zero-std check)."""
    k = per_function.size(1)
    grouped = per_function.view(-1, group_size, k)
    mean = torch.nanmean(grouped, 1, keepdim=True)
    std = nanstd(grouped, 1, keepdim=True) if group_size > 1 else torch.zeros_like(mean)
    summed = (((grouped - mean) / (std + 1e-4)).view(-1, k) * weights.unsqueeze(0)).nansum(1)
    summed[torch.isnan(per_function).all(1)] = float("nan")
    batch_std = nanstd(summed).expand_as(summed) if summed.numel() > 1 else torch.zeros_like(summed)
    advantages = (summed - torch.nanmean(summed)) / (batch_std + 1e-4)
    return torch.nan_to_num(advantages, nan=0.0), batch_std


def kl_penalized_rewards(
    rewards: torch.Tensor, logps: torch.Tensor, ref_logps: torch.Tensor, mask: torch.Tensor, beta: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """RLOO's reward: rewards (N,) − beta × Σ_t (log π − log π_ref) over each completion's tokens (first-order KL, as
    the RLOO paper and TRL 1.16). Returns (penalised rewards, per-token KL masked to the completions)."""
    per_token_kl = (logps - ref_logps) * mask
    return rewards - beta * per_token_kl.sum(-1), per_token_kl


def leave_one_out_advantages(rewards: torch.Tensor, group_size: int, normalize: bool = False) -> torch.Tensor:
    """RLOO advantages for rewards (N,) laid out as groups of `group_size` consecutive completions of one prompt:
    r − mean of the other scorable rewards of its group. NaN rewards (unscorable) are left out of the baselines; a
    completion without a scorable sibling, or unscorable itself, gets 0. With `normalize`, whitened over the
    scorable ones (std + 1e-4). As TRL 1.16's RLOOTrainer."""
    grouped = rewards.view(-1, group_size)
    scorable = (~torch.isnan(grouped)).sum(dim=1, keepdim=True)
    total = torch.nansum(grouped, dim=1, keepdim=True)
    advantages = rewards - ((total - grouped) / (scorable - 1)).view(-1)
    if normalize:
        advantages = (advantages - torch.nanmean(advantages)) / (nanstd(advantages) + 1e-4)
    return torch.nan_to_num(advantages, nan=0.0)


def gae(
    rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float, lam: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation over (B, T) per-token rewards and values; positions where
    `mask` is 0 (after the response) contribute nothing. Returns (advantages, returns)."""
    B, T = rewards.shape
    values = values * mask
    rewards = rewards * mask
    last = torch.zeros(B, dtype=rewards.dtype, device=rewards.device)
    adv = torch.zeros_like(rewards)
    for t in reversed(range(T)):
        next_value = values[:, t + 1] if t + 1 < T else torch.zeros_like(last)
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        last = delta + gamma * lam * last
        adv[:, t] = last
    return adv, adv + values


# --- PPO: rewards per token and advantages over a response ----------------------------------------


def kl_rewards(scores: torch.Tensor, kl: torch.Tensor, last_index: torch.Tensor, kl_coef: float):
    """Per-token rewards (B, R) from the per-token KL penalty `kl` (B, R): −kl_coef·kl everywhere, + the score at
    `last_index` (the last response token). Returns (rewards, non_score_reward)."""
    non_score = -kl_coef * kl
    rewards = non_score.clone()
    rewards[torch.arange(rewards.size(0), device=rewards.device), last_index] += scores
    return rewards, non_score


def advantages_and_returns(
    rewards: torch.Tensor,
    values: torch.Tensor,
    response_mask: torch.Tensor,
    gamma: float,
    lam: float,
    whiten_rewards: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GAE over a response's own tokens: the step after the last response token (EOS, or the length limit) is
    terminal, so nothing after it (values, rewards) reaches an advantage or a return. Rewards are optionally
    whitened over response tokens (mean kept); advantages are whitened over them and 0 elsewhere. As TRL 0.7's
    `compute_advantages` (TRL 1.12 bootstrapped from the value one position past the response)."""
    mask = response_mask.to(rewards.dtype)
    rewards = rewards * mask
    if whiten_rewards:
        rewards = masked_whiten(rewards, response_mask.bool(), shift_mean=False) * mask
    advantages, returns = gae(rewards, values, mask, gamma, lam)
    advantages = masked_whiten(advantages, response_mask.bool()) * mask
    return advantages, returns * mask


def high_entropy_tokens(entropy: torch.Tensor, mask: torch.Tensor, keep: float, gather=None) -> torch.Tensor:
    """The tokens (a bool (B, C) mask) whose entropy is at least the (1 − `keep`) quantile of the entropies under
    `mask` (Wang et al. 2025, "Beyond the 80/20 rule"; TRL's `top_entropy_quantile`). Padding is NaN to
    `nanquantile`, so nothing is read back to the host; `gather` (several processes) pools every process's tokens
    first, as TRL does."""
    values = entropy.detach().float().masked_fill(~mask.bool(), float("nan")).flatten()
    pooled = gather(values) if gather is not None else values
    threshold = torch.nanquantile(pooled, 1 - keep)
    return (entropy.detach() * mask >= threshold) & mask.bool()


def sampling_importance_weights(
    old_logps: torch.Tensor,
    sampling_logps: torch.Tensor,
    mask: torch.Tensor,
    mode: str,
    clip_min: float | None = None,
    clip_max: float | None = None,
) -> torch.Tensor:
    """Importance weights π_old / π_sampler that correct for the engine sampling from a slightly different
    distribution than the trainer's forward computes (TRL 1.16's vLLM importance sampling: truncated, TIS, or masked,
    MIS). `mode`: `token_*` one weight per token (B, C), `sequence_*` one per completion from its summed log-ratio
    (B, 1); `*_truncate` clamps weights to [clip_min, clip_max], `*_mask` zeroes weights outside it. A token without a
    sampling log-prob (NaN) counts as no gap."""
    diff = torch.nan_to_num((old_logps - sampling_logps) * mask, nan=0.0)
    if mode.startswith("sequence"):
        diff = diff.sum(-1, keepdim=True)
    weights = torch.exp(diff)
    if mode.endswith("truncate"):
        return torch.clamp(weights, min=clip_min, max=clip_max)
    low = clip_min if clip_min is not None else -float("inf")
    high = clip_max if clip_max is not None else float("inf")
    return weights.masked_fill((weights < low) | (weights > high), 0.0)


def off_policy_mask(
    advantages: torch.Tensor, logps: torch.Tensor, sampling_logps: torch.Tensor, mask: torch.Tensor, threshold: float
) -> torch.Tensor:
    """DeepSeek-V3.2's off-policy sequence mask, (B, 1): drop a completion with a negative advantage whose mean
    per-token KL(π_sampler ‖ π), estimated as log π_sampler − log π over its tokens, exceeds `threshold` (as TRL 1.16's
    `get_off_policy_mask`; tokens without a sampling log-prob count as no divergence)."""
    kl = torch.nan_to_num(sampling_logps - logps.detach(), nan=0.0)
    mean_kl = (kl * mask).sum(1, keepdim=True) / mask.sum(1, keepdim=True).clamp(min=1.0)
    return ((advantages.unsqueeze(1) >= 0) | (mean_kl <= threshold)).to(mask.dtype)


def vespo_weights(
    advantages: torch.Tensor,
    log_ratio: torch.Tensor,
    mask: torch.Tensor,
    sampling_weights: torch.Tensor | None,
    k: tuple[float, float],
    lam: tuple[float, float],
) -> torch.Tensor:
    """VESPO's gamma weights φ(w) = e^λ · w^k · e^(−λw) of each completion's importance weight w (B, 1), detached, as
    TRL 1.16's `get_gamma_weights`: w = exp of the completion's summed token log-ratios log π/π_old (each clamped to
    ±20), plus the summed log `sampling_weights` (π_old/π_sampler, from `sampling_correction`) where given, log w
    clamped to [log 1e-8, 20]; (k, λ) = (`k[0]`, `lam[0]`) for a non-negative advantage, (`k[1]`, `lam[1]`) for a
    negative one."""
    with torch.no_grad():
        floor = math.log(1e-8)
        log_w = (torch.clamp(log_ratio, -20.0, 20.0) * mask).sum(-1, keepdim=True)
        if sampling_weights is not None:
            log_w = log_w + torch.clamp(torch.log(sampling_weights), floor, 20.0).sum(-1, keepdim=True)
        log_w = torch.clamp(log_w, floor, 20.0)
        nonneg = advantages.unsqueeze(1) >= 0
        k_seq = torch.where(nonneg, k[0], k[1])
        lam_seq = torch.where(nonneg, lam[0], lam[1]).clamp(min=1e-4)
        log_phi = lam_seq + k_seq * log_w - lam_seq * torch.exp(log_w)
        return torch.exp(log_phi).nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)
