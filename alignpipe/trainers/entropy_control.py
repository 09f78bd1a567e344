"""GRPO's entropy bonus: L = L_policy − c·H̄, H̄ the mean entropy of the tokens the policy term trains on, with c fixed
(`entropy_coef`) or adapted each optimizer step (Skywork-OR1's adaptive entropy control, as TRL 1.16): c rises by
`entropy_coef_delta` while the step's entropy is at or below `entropy_target` and falls otherwise, within
[`entropy_coef_min`, `entropy_coef_max`], and applies only while the last measured entropy is at or below the target.

Everything stays on the device (the coefficient, the last entropy, the step's sums): no host read in a step; the
coefficient is read where it is logged or checkpointed.
"""

from __future__ import annotations

import torch

from alignpipe.trainers.configs import GRPOConfig


def entropy_bonus(entropy: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """The mean entropy over `tokens` (a 0/1 mask of the tokens the policy term trains on), with its gradient."""
    return (entropy * tokens).sum() / tokens.sum().clamp(min=1.0)


class EntropyControl:
    """The coefficient of a GRPO stage's entropy bonus, fixed or adaptive."""

    def __init__(self, cfg: GRPOConfig, device, reduce=None):
        self.cfg = cfg
        self.coef = torch.tensor(float(cfg.entropy_coef), device=device)
        # No measurement yet: an adaptive bonus applies nothing until the first step has measured the entropy.
        self.last = torch.tensor(float("inf"), device=device)
        self.window = torch.zeros(2, device=device)  # the step's entropy sum and token count
        self.reduce = reduce  # sums the window over processes (multi-process runs)

    def applied(self) -> torch.Tensor:
        """The coefficient this step's micro-batches apply (the same for all of them)."""
        if not self.cfg.use_adaptive_entropy:
            return self.coef
        return torch.where(self.last <= self.cfg.entropy_target, self.coef, torch.zeros_like(self.coef))

    def observe(self, entropy: torch.Tensor, tokens: torch.Tensor) -> None:
        """Add a micro-batch's (detached) entropies over `tokens` to the step's window."""
        self.window = self.window + torch.stack([(entropy.detach() * tokens).sum(), tokens.sum()])

    def step(self) -> None:
        """At the end of an optimizer step: the adaptive rule on the step's mean entropy over all processes."""
        window, self.window = self.window, torch.zeros_like(self.window)
        if not self.cfg.use_adaptive_entropy:
            return
        if self.reduce is not None:
            window = self.reduce(window)
        entropy = window[0] / window[1].clamp(min=1.0)
        cfg = self.cfg
        raised = torch.clamp(self.coef + cfg.entropy_coef_delta, max=cfg.entropy_coef_max)
        lowered = torch.clamp(self.coef - cfg.entropy_coef_delta, min=cfg.entropy_coef_min)
        self.coef = torch.where(entropy <= cfg.entropy_target, raised, lowered)
        self.last = entropy

    def state(self) -> dict[str, float]:
        """What a checkpoint keeps (read from the device)."""
        return {"entropy_coef": float(self.coef), "last_entropy": float(self.last)}

    def load(self, state: dict | None) -> None:
        if state and "entropy_coef" in state:
            self.coef = torch.full_like(self.coef, state["entropy_coef"])
            self.last = torch.full_like(self.last, state["last_entropy"])
