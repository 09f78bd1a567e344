"""The controls of TRL 0.7's PPOTrainer that act between rollout batches: the adaptive KL coefficient, the
running score statistics, and the two guards on a batch's PPO epochs (ratio threshold, early stopping).

Each is a small object or pure function with the state it needs, checkpointed through `state_dict()` so a
resumed run continues with the coefficient and statistics it had. The PPO trainer composes them; each equals
TRL 0.7.11's code (tests/test_ppo_controls.py cites file and line).
"""

from __future__ import annotations

import torch


class KLController:
    """The KL coefficient of the reward's penalty: fixed, or adaptive (Ziegler et al. 2019, TRL 0.7's
    `AdaptiveKLController`): after each batch of `n_steps` episodes whose KL per response was `current`,
    value ×= 1 + clip(current / target − 1, −0.2, 0.2) · n_steps / horizon."""

    def __init__(self, init_kl_coef: float, adaptive: bool = False, target: float = 6.0, horizon: float = 10000.0):
        self.value = float(init_kl_coef)
        self.adaptive = adaptive
        self.target = target
        self.horizon = horizon

    def update(self, current: float, n_steps: int) -> None:
        if not self.adaptive:
            return
        proportional_error = min(max(current / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + proportional_error * n_steps / self.horizon

    def state_dict(self) -> dict:
        return {"value": self.value}

    def load_state_dict(self, state: dict) -> None:
        self.value = float(state["value"])


class RunningMoments:
    """Running mean and standard deviation of every score seen (TRL 0.7's `RunningMoments`, after MOSS-RLHF):
    each batch's moments are merged into the totals with Chan's parallel update; `std` is Bessel-corrected over
    all values seen."""

    def __init__(self):
        self.mean = 0.0
        self.var = 1.0
        self.std = 1.0
        self.count = 1e-24

    @torch.no_grad()
    def update(self, xs: torch.Tensor) -> tuple[float, float]:
        """Merge the batch `xs`; returns the batch's own (mean, Bessel-corrected std)."""
        xs = xs.detach().float()
        n = xs.numel()
        var_t, mean_t = torch.var_mean(xs, unbiased=False)
        xs_mean, xs_var = float(mean_t), float(var_t)
        delta = xs_mean - self.mean
        total = self.count + n
        old_sum = self.var * self.count + delta**2 * self.count * n / total
        self.mean += delta * n / total
        self.var = (old_sum + xs_var * n) / total
        self.std = (self.var * total / (total - 1)) ** 0.5
        self.count = total
        return xs_mean, (xs_var * n / (n - 1)) ** 0.5 if n > 1 else float("nan")

    def state_dict(self) -> dict:
        return {"mean": self.mean, "var": self.var, "std": self.std, "count": self.count}

    def load_state_dict(self, state: dict) -> None:
        self.mean, self.var, self.std, self.count = (float(state[k]) for k in ("mean", "var", "std", "count"))


def transform_scores(
    scores: torch.Tensor,
    moments: RunningMoments | None,
    normalize: bool,
    clip: float | None,
    everyone: torch.Tensor | None = None,
) -> torch.Tensor:
    """Scale scores by the running std (updating `moments` with this batch first; and centre them on the running
    mean with `normalize`), then clip to ±`clip`. `moments` None skips scaling. As TRL 0.7's `PPOTrainer.step`.
    `everyone`: the scores of every process's batch, which update the moments instead of `scores` (TRL 0.7's global
    statistics), so that all processes keep the same moments."""
    if moments is not None:
        moments.update(scores if everyone is None else everyone)
        factor = moments.std + torch.finfo(scores.dtype).eps
        scores = (scores - moments.mean) / factor if normalize else scores / factor
    if clip is not None:
        scores = torch.clip(scores.float(), -clip, clip).to(scores.dtype)
    return scores


def ratio_exceeds(ratio: torch.Tensor, mask: torch.Tensor, threshold: float | None) -> bool:
    """Whether a micro-batch's mean importance ratio over its response tokens exceeds `threshold` (the batch is
    then skipped; TRL 0.7's `ratio_threshold` check)."""
    if threshold is None:
        return False
    mask = mask.to(ratio.dtype)
    return float((ratio * mask).sum() / mask.sum().clamp(min=1)) > threshold


def should_stop_early(policy_kl: float, target_kl: float | None) -> bool:
    """TRL 0.7's early-stopping rule: stop the epochs of a batch once the policy KL exceeds 1.5 × target_kl."""
    return target_kl is not None and policy_kl > 1.5 * target_kl
