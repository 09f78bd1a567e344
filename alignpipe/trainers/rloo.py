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
from pathlib import Path
from typing import Any

import torch

from alignpipe.engine.sampling import SamplingParams
from alignpipe.judges.reward_set import RewardSet
from alignpipe.losses import rloo_loss
from alignpipe.modeling import under_attention_kernels
from alignpipe.rl_math import kl_penalized_rewards, leave_one_out_advantages, masked_mean, nanstd
from alignpipe.trainers.common import TrainLoop, TrainResult, resolve_seed
from alignpipe.trainers.configs import RLOOConfig
from alignpipe.trainers.grpo import (
    GRPORollout,
    GRPORun,
    completion_logps,
    log_samples,
    sample,
    step_tokens_per_process,
)
from alignpipe.trainers.online import extra_columns


@torch.no_grad()
def rollout(run: GRPORun, batch_rows: list[dict]) -> tuple[GRPORollout, Any, torch.Tensor | None]:
    """Sample k completions per prompt, score them, subtract the KL penalty and turn the rewards into leave-one-out
    advantages. Returns the rollout, its samples and the per-token KL (None when beta is 0)."""
    cfg, loop = run.cfg, run.loop
    assert isinstance(cfg, RLOOConfig)
    sm = sample(run, batch_rows)
    rewards, per_fn = run.rewards(sm.prompts, sm.completions, extra_columns(sm.rows))
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
        step_tokens_per_process=step_tokens_per_process(loop, sm.mask),
    )
    per_token_kl = None
    loop.model.eval()
    if cfg.num_iterations > 1 or cfg.beta != 0.0:
        batch.old_logps = run.logps_of(loop.model, batch, contextlib.nullcontext()).cpu()
    if cfg.beta != 0.0:
        ref_model, context = run.reference()
        ref_logps = run.logps_of(ref_model, batch, context).cpu()
        assert batch.old_logps is not None
        batch.rewards, per_token_kl = kl_penalized_rewards(rewards, batch.old_logps, ref_logps, batch.mask, cfg.beta)
    loop.model.train()
    batch.advantages = leave_one_out_advantages(batch.rewards, cfg.num_generations, cfg.normalize_advantages)
    grouped = batch.rewards.view(-1, cfg.num_generations)
    batch.group_std = nanstd(grouped, 1, keepdim=True).expand_as(grouped).reshape(-1)
    return batch, sm, per_token_kl


def update(run: GRPORun, batch: GRPORollout) -> dict[str, torch.Tensor]:
    """One optimizer step's forward and backward over the rollout, micro-batch by micro-batch. Returns the loss and
    TRL's metrics as device tensors, read when logged."""
    cfg, loop, acc = run.cfg, run.loop, run.loop.accelerator
    assert isinstance(cfg, RLOOConfig)
    device, eps_high = acc.device, run.epsilon_high
    micro = list(range(0, batch.completion_ids.size(0), cfg.batch_size))
    sums: dict[str, torch.Tensor] = {}

    def add(key: str, value: torch.Tensor) -> None:
        sums[key] = sums.get(key, 0) + value.detach() / len(micro)

    for j, s in enumerate(micro):
        sl = slice(s, s + cfg.batch_size)
        mask = batch.mask[sl].to(device)
        adv = batch.advantages[sl].to(device)
        with loop.no_sync_unless(j == len(micro) - 1):
            logps, entropy = completion_logps(
                loop.model,
                batch.prompt_ids[sl].to(device),
                batch.prompt_mask[sl].to(device),
                batch.completion_ids[sl].to(device),
                run.temperature,
                cfg.logprob_chunk_tokens,
                with_entropy=True,
                group=cfg.num_generations,
            )
            seq_logps = (logps.float() * mask).sum(1)
            if batch.old_logps is not None and cfg.num_iterations > 1:
                old = (batch.old_logps[sl].to(device) * mask).sum(1)
            else:
                old = seq_logps.detach()
            loss, ratio = rloo_loss(seq_logps, old, adv, cfg.epsilon, eps_high)
            acc.backward(loss / len(micro))
        with torch.no_grad():
            low = ((ratio < 1 - cfg.epsilon) & (adv < 0)).float()
            high = ((ratio > 1 + eps_high) & (adv > 0)).float()
            add("loss", loss)
            add("clip_ratio/low_mean", low.mean())
            add("clip_ratio/high_mean", high.mean())
            add("clip_ratio/region_mean", torch.maximum(low, high).mean())
            add("entropy", masked_mean(entropy, mask))
    return sums


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
) -> TrainResult:
    G = cfg.num_generations
    if cfg.batch_size % G:
        raise ValueError(f"batch_size ({cfg.batch_size}) must be a multiple of num_generations ({G})")
    seed = resolve_seed(cfg.seed, seed)
    rewards.probe([r["prompt"] for r in rows[:2]], extra_columns(rows[:2]))  # a broken reward fails before any rollout
    loop = TrainLoop(
        "rloo",
        cfg,
        model,
        rows,
        lambda b: b,
        tracker,
        output_dir,
        seed,
        rows_per_batch=cfg.batch_size // G,
        repeat=cfg.num_iterations,
    )
    if engine is None:
        from alignpipe.engine.hf import HFEngine

        engine = HFEngine(loop.unwrapped, tokenizer, cfg.rollout.batch_size)
    if cfg.beta and not cfg.lora and ref_model is None:
        raise ValueError("beta > 0 without LoRA needs `ref_model` (a frozen copy of the starting model)")
    ref = ref_model.to(loop.accelerator.device).eval().requires_grad_(False) if (cfg.beta and not cfg.lora) else None
    run = GRPORun(cfg, loop, tokenizer, rewards, engine, ref, seed)
    current: dict[str, Any] = {}

    def step(window: list[list[dict]]) -> dict:
        if loop.iteration == 0:  # a new generation batch; num_iterations > 1 reuses it
            batch, sm, per_token_kl = rollout(run, [r for micro in window for r in micro])
            stats = batch.stats(rewards.names)
            if per_token_kl is not None:
                stats["kl"] = float(per_token_kl.sum() / batch.mask.sum().clamp(min=1))
            current.update(batch=batch, stats=stats)
            log_samples(run, sm, batch.rewards, "rloo")
        return {**update(run, current["batch"]), **current["stats"]}

    @torch.no_grad()
    def evaluate() -> dict[str, float]:
        sample_rows = (eval_rows or [])[:64]
        greedy = SamplingParams(temperature=0, max_new_tokens=cfg.max_completion_length)
        engine.update_weights(loop.unwrapped)
        gens = engine.generate(run.encode_prompts(sample_rows), 1, greedy)
        total, _ = rewards([r["prompt"] for r in sample_rows], [g.completion for g in gens], extra_columns(sample_rows))
        finite = total[~torch.isnan(total)]
        return {"reward": float(finite.mean()) if len(finite) else 0.0}

    result = loop.run(step, evaluate if eval_rows else None)
    result.model_dir, result.adapter = loop.save(tokenizer)
    return result
