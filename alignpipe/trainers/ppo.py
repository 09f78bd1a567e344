"""PPO for RLHF, following TRL ≤ 1.12's PPOTrainer and "The N+ implementation details of RLHF with PPO"
(Huang et al., 2024).

One update: take `batch_size × accumulation × num_mini_batches` prompts (left-padded, so response
columns line up), sample one response each at `temperature`, truncate at the first EOS, then (no grad):
- log-probs of the policy and the reference (adapter-disabled policy with LoRA) at that temperature,
  masked to INVALID_LOGPROB after the response;
- values from the value model (a sequence classifier initialised from a reward model, its head read
  at every position);
- scores from the reward set on (prompt, response); `missing_eos_penalty` for responses without EOS.
Rewards per token: −kl_coef · KL (k1 or k3), plus the score at the last response token. Optionally
whitened (mean kept). GAE(γ, λ) gives advantages (whitened) and returns. Then `num_ppo_epochs` passes
over shuffled mini-batches: clipped policy loss + vf_coef × clipped value loss (½ max of squared errors).

Departure from TRL 1.12 (on purpose): TRL adds the score one position *after* the last response token
(`sequence_lengths + 1`); here it lands on the last response token itself, as the N+ paper and this
project's spec describe, so λ does not discount it.

Metrics (the seed's names): objective/kl, objective/entropy, objective/non_score_reward,
objective/rlhf_reward, objective/scores, policy/approxkl_avg, policy/clipfrac_avg, loss/policy_avg,
loss/value_avg, val/clipfrac_avg, policy/entropy_avg, val/ratio, val/ratio_var, val/num_eos_tokens,
lr, episode, eps, plus rewards/<fn>/mean.
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
from pathlib import Path

import torch
import torch.nn as nn

from alignpipe.judges.reward_set import RewardSet
from alignpipe.modeling import under_attention_kernels
from alignpipe.rl_math import gae, kl_estimate, masked_mean, masked_whiten, token_logprobs
from alignpipe.trainers.common import (
    Checkpointer, TrainResult, build_optimizer, build_scheduler, pad_rows, progress, save_model, seed_everything,
)
from alignpipe.trainers.configs import PPOConfig
from alignpipe.trainers.online import extra_columns, print_samples

log = logging.getLogger(__name__)
INVALID_LOGPROB = 1.0


# --- the math (pure; parity-tested) ----------------------------------------------------------------

def kl_rewards(scores: torch.Tensor, logprobs: torch.Tensor, ref_logprobs: torch.Tensor, last_index: torch.Tensor,
               kl_coef: float, estimator: str = "k1"):
    """Per-token rewards (B, R): −kl_coef·KL everywhere, + score at `last_index` (the last response
    token). Returns (rewards, kl, non_score_reward)."""
    kl = kl_estimate(logprobs, ref_logprobs, estimator)
    non_score = -kl_coef * kl
    rewards = non_score.clone()
    rewards[torch.arange(rewards.size(0), device=rewards.device), last_index] += scores
    return rewards, kl, non_score


def policy_loss(new_logprobs, old_logprobs, advantages, mask, cliprange: float):
    """Clipped surrogate: masked mean of max(−A·ρ, −A·clip(ρ)). Returns (loss, clipfrac, ratio, approxkl)."""
    diff = new_logprobs - old_logprobs
    ratio = torch.exp(diff)
    losses1 = -advantages * ratio
    losses2 = -advantages * torch.clamp(ratio, 1.0 - cliprange, 1.0 + cliprange)
    loss = masked_mean(torch.max(losses1, losses2), mask)
    clipfrac = masked_mean((losses2 > losses1).float(), mask)
    approxkl = 0.5 * (diff ** 2).mean()
    return loss, clipfrac, ratio, approxkl


def value_loss(vpred, old_values, returns, mask, cliprange_value: float):
    """½ · masked mean of max((v − R)², (clip(v, v_old ± c) − R)²). Returns (loss, clipfrac)."""
    clipped = torch.clamp(vpred, old_values - cliprange_value, old_values + cliprange_value)
    losses1 = (vpred - returns) ** 2
    losses2 = (clipped - returns) ** 2
    loss = 0.5 * masked_mean(torch.max(losses1, losses2), mask)
    clipfrac = masked_mean((losses2 > losses1).float(), mask)
    return loss, clipfrac


# --- models ---------------------------------------------------------------------------------------

class PolicyAndValue(nn.Module):
    """Both trained modules under one optimizer (as TRL's PolicyAndValueWrapper)."""

    def __init__(self, policy, value_model):
        super().__init__()
        self.policy = policy
        self.value_model = value_model


def token_values(value_model, input_ids, attention_mask) -> torch.Tensor:
    """The value head applied at every position, (B, T)."""
    backbone = getattr(value_model, value_model.base_model_prefix)
    position_ids = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
    hidden = backbone(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False).last_hidden_state
    return value_model.score(hidden).squeeze(-1).float()


def response_logprobs(policy, query, query_mask, response, temperature: float, chunk: int, with_entropy: bool = False):
    ids = torch.cat([query, response], 1)
    mask = torch.cat([query_mask, torch.ones_like(response)], 1)
    return token_logprobs(policy, ids, mask, temperature=temperature, chunk_tokens=chunk, with_entropy=with_entropy,
                          start=query.size(1) - 1)


def response_values(value_model, query, query_mask, response) -> torch.Tensor:
    ids = torch.cat([query, response], 1)
    mask = torch.cat([query_mask, torch.ones_like(response)], 1)
    P = query.size(1)
    return token_values(value_model, ids, mask)[:, P - 1:-1]


# --- training -------------------------------------------------------------------------------------

@under_attention_kernels
def train(cfg: PPOConfig, policy, value_model, tokenizer, rows: list[dict], rewards: RewardSet, tracker, output_dir: str | Path,
          seed: int = 0, ref_model=None, engine=None) -> TrainResult:
    from accelerate import Accelerator

    from alignpipe.modeling import enable_activation_checkpointing, lora_model

    started = time.perf_counter()
    output_dir = Path(output_dir)
    seed = cfg.seed if cfg.seed is not None else seed
    seed_everything(seed)
    temperature = cfg.sampling.temperature or 1.0
    sampling = cfg.sampling.model_copy(update={"max_new_tokens": cfg.max_completion_length})
    rewards.probe([r["prompt"] for r in rows[:2]], extra_columns(rows[:2]))

    acc = Accelerator(cpu=not torch.cuda.is_available())
    device = acc.device
    if cfg.gradient_checkpointing:
        enable_activation_checkpointing(policy)
    if cfg.lora:
        policy = lora_model(policy, cfg.lora)
    elif ref_model is None:
        raise ValueError("full-model PPO needs `ref_model` (a frozen copy of the starting policy)")
    ref = ref_model.to(device).eval().requires_grad_(False) if not cfg.lora else None
    value_model.config.pad_token_id = tokenizer.pad_token_id
    model = PolicyAndValue(policy, value_model)
    mini = cfg.batch_size * cfg.gradient_accumulation_steps
    rollout_size = mini * cfg.num_mini_batches
    updates = cfg.max_steps or max(1, math.ceil(cfg.epochs * len(rows) / rollout_size))
    optimizer = build_optimizer(model, cfg)
    scheduler = build_scheduler(optimizer, cfg, updates * cfg.num_ppo_epochs * cfg.num_mini_batches)
    model, optimizer = acc.prepare(model, optimizer)  # scheduler unwrapped: see TrainLoop
    acc.register_for_checkpointing(scheduler)
    if acc.is_main_process:
        tracker.log_params({"ppo": cfg.model_dump(mode="json")})
    checkpoints = Checkpointer(output_dir, cfg.save_total_limit)
    state = checkpoints.resume(acc)
    update = state["step"] if state else 0
    unwrapped = acc.unwrap_model(model)
    if engine is None:
        from alignpipe.engine.hf import HFEngine

        engine = HFEngine(unwrapped.policy, tokenizer, cfg.rollout.batch_size)

    def ref_logprobs_of(q, qm, r):
        if ref is not None:
            return response_logprobs(ref, q, qm, r, temperature, cfg.logprob_chunk_tokens)
        with unwrapped.policy.disable_adapter():
            return response_logprobs(unwrapped.policy, q, qm, r, temperature, cfg.logprob_chunk_tokens)

    order = torch.randperm(len(rows), generator=torch.Generator().manual_seed(seed)).tolist()
    bar = progress(updates, "ppo", acc.is_main_process, initial=update)
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    while update < updates:
        t0 = time.perf_counter()
        start = (update * rollout_size) % len(rows)
        batch_rows = [rows[order[(start + i) % len(rows)]] for i in range(rollout_size)]
        # ---- rollout (no grad)
        with torch.no_grad():
            prompts = [x[-cfg.max_prompt_length:] if cfg.max_prompt_length else x for x in tokenizer([r["prompt"] for r in batch_rows])["input_ids"]]
            engine.update_weights(unwrapped.policy)
            gens = engine.generate(prompts, 1, sampling, seed=seed + update)
            query, query_mask = pad_rows(prompts, pad, left=True)
            response, _ = pad_rows([g.completion_ids for g in gens], pad)
            lengths = torch.tensor([max(1, len(g.completion_ids)) for g in gens])
            query, query_mask, response = query.to(device), query_mask.to(device), response.to(device)
            total, per_fn = rewards([r["prompt"] for r in batch_rows], [g.completion for g in gens], extra_columns(batch_rows))
            scores = torch.nan_to_num(total, nan=0.0).to(device)
            contain_eos = torch.tensor([g.finish_reason == "stop" for g in gens], device=device)
            if cfg.missing_eos_penalty is not None:
                scores[~contain_eos] -= cfg.missing_eos_penalty
            unwrapped.eval()
            logprobs, ref_logprobs, values = [], [], []
            for s in range(0, rollout_size, cfg.batch_size):
                sl = slice(s, s + cfg.batch_size)
                logprobs.append(response_logprobs(unwrapped.policy, query[sl], query_mask[sl], response[sl], temperature, cfg.logprob_chunk_tokens))
                ref_logprobs.append(ref_logprobs_of(query[sl], query_mask[sl], response[sl]))
                values.append(response_values(unwrapped.value_model, query[sl], query_mask[sl], response[sl]))
            logprobs, ref_logprobs, values = torch.cat(logprobs).float(), torch.cat(ref_logprobs).float(), torch.cat(values)
            idx = torch.arange(response.size(1), device=device).unsqueeze(0)
            last = (lengths - 1).to(device)
            padding_mask = idx > last.unsqueeze(1)        # after the last response token
            padding_mask_p1 = idx > (last + 1).unsqueeze(1)
            logprobs = logprobs.masked_fill(padding_mask, INVALID_LOGPROB)
            ref_logprobs = ref_logprobs.masked_fill(padding_mask, INVALID_LOGPROB)
            values = values.masked_fill(padding_mask_p1, 0)
            token_rewards, kl, non_score = kl_rewards(scores, logprobs, ref_logprobs, last, cfg.kl_coef, cfg.kl_estimator)
            if cfg.whiten_rewards:
                token_rewards = masked_whiten(token_rewards, ~padding_mask_p1, shift_mean=False).masked_fill(padding_mask_p1, 0)
            advantages, returns = gae(token_rewards, values, (~padding_mask_p1).float(), cfg.gamma, cfg.lam)
            advantages = masked_whiten(advantages, ~padding_mask).masked_fill(padding_mask, 0)
        # ---- PPO epochs
        unwrapped.train()
        stats: dict[str, list[float]] = {k: [] for k in ("approxkl", "clipfrac", "pg_loss", "vf_loss", "vf_clipfrac", "entropy", "ratio")}
        for _ in range(cfg.num_ppo_epochs):
            perm = torch.randperm(rollout_size, device=device)
            for m0 in range(0, rollout_size, mini):
                mb = perm[m0:m0 + mini]
                for j, s in enumerate(range(0, mini, cfg.batch_size)):
                    ix = mb[s:s + cfg.batch_size]
                    sync = j == cfg.gradient_accumulation_steps - 1
                    with (contextlib.nullcontext() if sync else acc.no_sync(model)):
                        new_lp, entropy = response_logprobs(unwrapped.policy, query[ix], query_mask[ix], response[ix], temperature,
                                                            cfg.logprob_chunk_tokens, with_entropy=True)
                        new_lp = new_lp.float().masked_fill(padding_mask[ix], INVALID_LOGPROB)
                        vpred = response_values(unwrapped.value_model, query[ix], query_mask[ix], response[ix]).masked_fill(padding_mask_p1[ix], 0)
                        pg, clipfrac, ratio, approxkl = policy_loss(new_lp, logprobs[ix], advantages[ix], ~padding_mask[ix], cfg.cliprange)
                        vf, vf_clipfrac = value_loss(vpred, values[ix], returns[ix], ~padding_mask_p1[ix], cfg.cliprange_value)
                        loss = pg + cfg.vf_coef * vf
                        acc.backward(loss / cfg.gradient_accumulation_steps)
                    for k, v in (("approxkl", approxkl), ("clipfrac", clipfrac), ("pg_loss", pg), ("vf_loss", vf),
                                 ("vf_clipfrac", vf_clipfrac), ("entropy", entropy.mean()), ("ratio", ratio.mean())):
                        stats[k].append(float(v.detach()))
                if cfg.max_grad_norm:
                    acc.clip_grad_norm_(model.parameters(), cfg.max_grad_norm)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad(set_to_none=True)
        update += 1
        bar.update(1)
        mean_kl = float(kl.masked_fill(padding_mask, 0).sum(1).mean())
        mean_non_score = float(non_score.masked_fill(padding_mask, 0).sum(1).mean())
        ratios = torch.tensor(stats["ratio"])
        metrics = {
            "eps": rollout_size / (time.perf_counter() - t0), "objective/kl": mean_kl,
            "objective/entropy": float((-logprobs.masked_fill(padding_mask, 0)).sum(1).mean()),
            "objective/non_score_reward": mean_non_score, "objective/rlhf_reward": mean_non_score + float(scores.mean()),
            "objective/scores": float(scores.mean()), "policy/approxkl_avg": _mean(stats["approxkl"]),
            "policy/clipfrac_avg": _mean(stats["clipfrac"]), "loss/policy_avg": _mean(stats["pg_loss"]),
            "loss/value_avg": _mean(stats["vf_loss"]), "val/clipfrac_avg": _mean(stats["vf_clipfrac"]),
            "policy/entropy_avg": _mean(stats["entropy"]), "val/ratio": float(ratios.mean()),
            "val/ratio_var": float(ratios.var()) if len(ratios) > 1 else 0.0,
            "val/num_eos_tokens": float((response == eos).sum()), "lr": scheduler.get_last_lr()[0], "episode": update * rollout_size,
        }
        for k, name in enumerate(rewards.names):
            col = per_fn[:, k][~torch.isnan(per_fn[:, k])]
            metrics[f"rewards/{name}/mean"] = float(col.mean()) if len(col) else 0.0
        if not all(math.isfinite(v) for v in metrics.values()):
            bad = [k for k, v in metrics.items() if not math.isfinite(v)]
            last_ckpt = checkpoints.complete()
            raise FloatingPointError(f"ppo: non-finite {bad} at update {update}; last checkpoint kept: "
                                     f"{last_ckpt[-1] if last_ckpt else 'none (set save_every)'}")
        if acc.is_main_process and (update % cfg.logging_every == 0 or update == updates or update == 1):
            tracker.log_metrics(metrics, update)
            bar.set_postfix(score=f"{metrics['objective/scores']:.3f}", kl=f"{mean_kl:.3f}")
            log.info("ppo update %d/%d score=%.4g kl=%.4g rlhf_reward=%.4g", update, updates, metrics["objective/scores"],
                     mean_kl, metrics["objective/rlhf_reward"])
        if acc.is_main_process and (update % cfg.sample_every == 0 or update == 1):
            table = [{"prompt": r["prompt"], "completion": g.completion, "reward": float(sc)}
                     for r, g, sc in zip(batch_rows[:8], gens[:8], scores[:8])]
            tracker.log_table(table, f"samples/update_{update:06d}")
            print_samples(table, f"ppo samples at update {update}")
        if cfg.save_every and update % cfg.save_every == 0 and update != updates:
            checkpoints.save(acc, update)
    bar.close()
    adapter = save_model(acc, unwrapped.policy, tokenizer, output_dir / "model")
    final = {k: tracker.last(k) for k in ("objective/scores", "objective/rlhf_reward", "objective/kl") if tracker.last(k) is not None}
    return TrainResult(model_dir=output_dir / "model", steps=update, metrics=final, adapter=adapter,
                       seconds=time.perf_counter() - started, resumed_from=state["step"] if state else None)


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else 0.0
