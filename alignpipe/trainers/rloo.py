"""REINFORCE Leave-One-Out (Ahmadian et al. 2024), following the design of TRL 1.16's RLOOTrainer.

Each optimizer step: take `batch_size × accumulation / num_generations` prompts and sample k = `num_generations`
completions each (the generation step is GRPO's, `grpo.sample`). A completion's reward is the reward set's weighted
total (optionally clipped to `reward_clip_range`), minus `beta` × its summed first-order KL to the reference,
Σ_t (log π_old − log π_ref); its advantage is that reward minus the mean reward of its k − 1 siblings (the
leave-one-out baseline: unbiased, no value model), optionally whitened over the batch. The loss works on whole
sequences: ρ = π(y)/π_old(y) from summed token log-probs, −min(ρ·A, clip(ρ, 1 − ε, 1 + ε_high)·A) averaged over
completions (π_old = π detached unless `num_iterations` > 1 reuses a rollout).

Metrics (TRL's names, under train/): loss, reward (after the KL penalty, as TRL), reward_std, rewards/<fn>/mean|std,
frac_reward_zero_std, completions/{mean,min,max}_length, completions/clipped_ratio, kl (per token), entropy,
clip_ratio/{low,high,region}_mean; eval/reward (greedy, held-out prompts).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from pathlib import Path

import torch

from alignpipe.device_copies import to_device
from alignpipe.judges.reward_set import RewardSet
from alignpipe.losses import rloo_loss
from alignpipe.modeling import under_attention_kernels
from alignpipe.moe import RouterTotals
from alignpipe.rl_math import kl_penalized_rewards, leave_one_out_advantages, masked_mean, nanstd
from alignpipe.trainers.common import TrainResult
from alignpipe.trainers.configs import RLOOConfig
from alignpipe.trainers.grpo import (
    GRPORollout,
    GRPORun,
    Samples,
    StepMetrics,
    clip_fractions,
    micro_batches,
    sample,
    step_tokens_per_process,
    train_on_samples,
)
from alignpipe.trainers.online import extra_columns


@torch.no_grad()
def rollout(run: GRPORun, batch_rows: list[dict]) -> tuple[GRPORollout, Samples]:
    """Sample k completions per prompt, score them, subtract the KL penalty and turn the rewards into leave-one-out
    advantages (the rollout's `kl` is the mean per-token KL when beta > 0)."""
    cfg, loop = run.cfg, run.loop
    assert isinstance(cfg, RLOOConfig)
    sm = sample(run, batch_rows)
    rewards, per_fn = run.rewards(sm.prompts, sm.completions, extra_columns(sm.rows), sm.token_lists, sm.messages)
    if cfg.reward_clip_range is not None:
        rewards = rewards.clamp(*cfg.reward_clip_range)
    batch = GRPORollout(
        sm.prompt_ids,
        sm.prompt_mask,
        sm.completion_ids,
        sm.mask,
        sm.lengths,
        sm.ended,
        rewards,
        per_fn,
        advantages=torch.zeros_like(rewards),
        group_std=torch.zeros_like(rewards),
        old_logps=None,
        ref_logps=None,
        step_tokens_per_process=step_tokens_per_process(loop, sm.mask, cfg.steps_per_rollout),
        prompts_nonempty=sm.prompts_nonempty,
        **sm.tool_fields(),
    )
    loop.model.eval()
    if run.reuses_rollouts or cfg.beta != 0.0:
        batch.old_logps = run.logps_of(loop.model, batch, contextlib.nullcontext()).cpu()
    if cfg.beta != 0.0:
        ref_model, context = run.reference()
        ref_logps = run.logps_of(ref_model, batch, context).cpu()
        assert batch.old_logps is not None
        batch.rewards, per_token_kl = kl_penalized_rewards(rewards, batch.old_logps, ref_logps, batch.mask, cfg.beta)
        batch.kl = float(per_token_kl.sum() / batch.mask.sum().clamp(min=1))
    loop.model.train()
    batch.advantages = leave_one_out_advantages(batch.rewards, cfg.num_generations, cfg.normalize_advantages)
    grouped = batch.rewards.view(-1, cfg.num_generations)
    batch.group_std = nanstd(grouped, 1, keepdim=True).expand_as(grouped).reshape(-1)
    return batch, sm


def update(run: GRPORun, batch: GRPORollout, micro: list[int]) -> dict[str, torch.Tensor]:
    """One optimizer step's forward and backward over the rollout's micro-batches starting at `micro`. Returns the
    loss and TRL's metrics as device tensors, read when logged."""
    cfg, acc = run.cfg, run.loop.accelerator
    assert isinstance(cfg, RLOOConfig)
    sums = StepMetrics(len(micro))
    aux = RouterTotals(run.router, acc.device)
    for sl, mask, adv in micro_batches(run, batch, micro):
        logps, entropy = run.micro_logps(batch, sl, mask)
        seq_logps = (logps.float() * mask).sum(1)
        if batch.old_logps is not None and run.reuses_rollouts:
            old = (to_device(batch.old_logps[sl], acc.device) * mask).sum(1)
        else:
            old = seq_logps.detach()
        loss, ratio = rloo_loss(seq_logps, old, adv, cfg.epsilon, run.epsilon_high)
        acc.backward(loss / len(micro) + aux.term(1 / len(micro)))
        with torch.no_grad():
            sums.mean("loss", loss)
            for key, value in clip_fractions(ratio, adv, cfg.epsilon, run.epsilon_high).items():
                sums.mean(key, value)
            sums.mean("entropy", masked_mean(entropy, mask))
    return aux.into(sums)


@under_attention_kernels
def train(
    cfg: RLOOConfig,
    model,
    tokenizer,
    rows: list[dict],
    rewards: RewardSet,
    tracker,
    output_dir: str | Path,
    seed: int = 0,
    ref_model=None,
    engine=None,
    eval_rows: list[dict] | None = None,
    tools: list[Callable] | None = None,
    chat_template_kwargs: dict | None = None,
) -> TrainResult:
    """`tools`: as `grpo.train`'s."""
    return train_on_samples(
        "rloo", rollout, update, cfg, model, tokenizer, rows, rewards, tracker, output_dir, seed, ref_model, engine,
        eval_rows, tools, chat_template_kwargs,
    )  # fmt: skip
