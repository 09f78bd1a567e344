"""Group Relative Policy Optimization, following the design of TRL's GRPOTrainer.

Each optimizer step: take `batch_size × accumulation / num_generations` prompts, sample
`num_generations` completions each through the rollout engine, score them with the reward set
(weighted sum; a function may answer None), and turn rewards into group-relative advantages
(r − mean(group)) / std, std per group, per batch, or none). Completions are masked after their
first EOS (and wholly, with `mask_truncated_completions`, when they never end).

Per token, with ratio ρ = π/π_old (π_old = π detached unless `num_iterations` > 1 reuses a rollout):
    loss = −min(ρ·A, clip(ρ, 1−ε, 1+ε_high)·A) + β·KL_k3(π ‖ π_ref)
aggregated by `loss_type`: grpo (per-sequence mean, then mean), bnpo (mean over the micro-batch's
tokens), dr_grpo (sum / (sequences × max_completion_length)), dapo (sum / tokens of the whole step).
β = 0 loads no reference model; with LoRA the reference is the adapter-disabled policy.

Metrics (TRL's names, under train/): loss, reward, reward_std, rewards/<fn>/mean, rewards/<fn>/std,
frac_reward_zero_std (groups with fewer than two scorable completions do not count as zero-std,
as TRL counts them), completions/{mean,min,max}_length, completions/clipped_ratio, kl, entropy,
clip_ratio/{low,high,region}_mean; eval/reward (greedy, held-out prompts).

Entry point: `train(cfg, model, tokenizer, rows, rewards, tracker, output_dir, seed, ...)`.
"""

from __future__ import annotations

import contextlib
import logging
from pathlib import Path

import torch

from alignpipe.engine.sampling import SamplingParams
from alignpipe.judges.reward_set import RewardSet
from alignpipe.logprobs import shared_prompt_logprobs
from alignpipe.losses import aggregate, per_token_loss
from alignpipe.modeling import under_attention_kernels
from alignpipe.rl_math import frac_zero_std, group_advantages, masked_mean
from alignpipe.trainers.common import TrainLoop, TrainResult, pad_rows, resolve_seed
from alignpipe.trainers.configs import GRPOConfig
from alignpipe.trainers.online import extra_columns, print_samples

log = logging.getLogger(__name__)


def completion_mask(
    ids: torch.Tensor, lengths: torch.Tensor, ended: torch.Tensor, mask_truncated: bool
) -> torch.Tensor:
    """1 for completion tokens up to and including the first EOS; rows that never ended are zeroed
    when `mask_truncated`."""
    mask = (torch.arange(ids.size(1)).unsqueeze(0) < lengths.unsqueeze(1)).float()
    if mask_truncated:
        mask = mask * ended.float().unsqueeze(1)
    return mask


def completion_logps(
    model,
    prompt_ids,
    prompt_mask,
    completion_ids,
    temperature: float,
    chunk: int,
    with_entropy: bool = False,
    group: int = 1,
):
    """Log-probs (and entropies) of the completion tokens, (B, C). Rows come in groups of `group` samples of one
    prompt: each prompt's forward runs once (`shared_prompt_logprobs`)."""
    B = prompt_ids.size(0)
    firsts = prompt_ids[::group], prompt_mask[::group]
    index = torch.arange(B, device=prompt_ids.device) // group
    if B % group or not (torch.equal(prompt_ids, firsts[0][index]) and torch.equal(prompt_mask, firsts[1][index])):
        firsts, index = (
            (prompt_ids, prompt_mask),
            torch.arange(B, device=prompt_ids.device),
        )  # not grouped: one prompt per row
    return shared_prompt_logprobs(
        model, *firsts, completion_ids, index, temperature=temperature, chunk_tokens=chunk, with_entropy=with_entropy
    )


@under_attention_kernels
def train(
    cfg: GRPOConfig,
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
    temperature = cfg.sampling.temperature or 1.0
    sampling = cfg.sampling.model_copy(update={"max_new_tokens": cfg.max_completion_length})
    eps_high = cfg.epsilon_high if cfg.epsilon_high is not None else cfg.epsilon
    rewards.probe([r["prompt"] for r in rows[:2]], extra_columns(rows[:2]))  # a broken reward fails before any rollout

    loop = TrainLoop(
        "grpo",
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
    acc = loop.accelerator
    device = acc.device
    if engine is None:
        from alignpipe.engine.hf import HFEngine

        engine = HFEngine(loop.unwrapped, tokenizer, cfg.rollout.batch_size)
    if cfg.beta and not cfg.lora and ref_model is None:
        raise ValueError("beta > 0 without LoRA needs `ref_model` (a frozen copy of the starting model)")
    ref = ref_model.to(device).eval().requires_grad_(False) if (cfg.beta and not cfg.lora) else None

    def ref_context():
        return loop.unwrapped.disable_adapter() if (cfg.beta and cfg.lora) else contextlib.nullcontext()

    def encode_prompts(rs: list[dict]) -> list[list[int]]:
        ids = tokenizer([r["prompt"] for r in rs])["input_ids"]
        return [x[-cfg.max_prompt_length :] if cfg.max_prompt_length else x for x in ids]

    buffer: dict = {}

    @torch.no_grad()
    def rollout(window: list[list[dict]]) -> dict[str, float]:
        batch_rows = [r for micro in window for r in micro]
        prompt_lists = encode_prompts(batch_rows)
        engine.update_weights(loop.unwrapped)
        gens = engine.generate(prompt_lists, G, sampling, seed=seed + loop.step)
        rep_rows = [r for r in batch_rows for _ in range(G)]
        prompts_text = [r["prompt"] for r in rep_rows]
        completions = [g.completion for g in gens]
        total, per_fn = rewards(prompts_text, completions, extra_columns(rep_rows))
        adv, std = group_advantages(total, G, cfg.scale_rewards)
        prompt_ids, prompt_mask = pad_rows(
            [p for p in prompt_lists for _ in range(G)], tokenizer.pad_token_id, left=True
        )
        comp_ids, _ = pad_rows([g.completion_ids for g in gens], tokenizer.pad_token_id)
        lengths = torch.tensor([len(g.completion_ids) for g in gens])
        ended = torch.tensor([g.finish_reason == "stop" for g in gens])
        mask = completion_mask(comp_ids, lengths, ended, cfg.mask_truncated_completions)
        buf = {
            "prompt_ids": prompt_ids,
            "prompt_mask": prompt_mask,
            "completion_ids": comp_ids,
            "mask": mask,
            "advantages": adv,
        }
        loop.model.eval()
        for key, needed, model_ctx in (
            ("old_logps", cfg.num_iterations > 1, (loop.model, contextlib.nullcontext())),
            ("ref_logps", cfg.beta != 0.0, (ref if ref is not None else loop.model, ref_context())),
        ):
            if not needed:
                continue
            m, ctx = model_ctx
            parts = []
            with ctx:
                for s in range(0, len(gens), cfg.batch_size):
                    sl = slice(s, s + cfg.batch_size)
                    parts.append(
                        completion_logps(
                            m,
                            prompt_ids[sl].to(device),
                            prompt_mask[sl].to(device),
                            comp_ids[sl].to(device),
                            temperature,
                            cfg.logprob_chunk_tokens,
                            group=G,
                        ).float()
                    )
            buf[key] = torch.cat(parts)
        loop.model.train()
        tokens = float(mask.sum())
        if acc.num_processes > 1:
            tokens = float(acc.reduce(torch.tensor(tokens, device=device), "sum"))
        buf["step_tokens_per_process"] = tokens / acc.num_processes
        buffer.clear()
        buffer.update(buf)
        finite = total[~torch.isnan(total)]
        stats = {
            "reward": float(finite.mean()) if len(finite) else 0.0,
            "reward_std": float(finite.std()) if len(finite) > 1 else 0.0,
            "frac_reward_zero_std": frac_zero_std(std),
            "completions/mean_length": float(lengths.float().mean()),
            "completions/min_length": float(lengths.min()),
            "completions/max_length": float(lengths.max()),
            "completions/clipped_ratio": float((~ended).float().mean()),
        }
        for k, name in enumerate(rewards.names):
            col = per_fn[:, k][~torch.isnan(per_fn[:, k])]
            stats[f"rewards/{name}/mean"] = float(col.mean()) if len(col) else 0.0
            stats[f"rewards/{name}/std"] = float(col.std()) if len(col) > 1 else 0.0
        if loop.step % cfg.sample_every == 0 and acc.is_main_process:
            table = [
                {"prompt": p, "completion": c, "reward": float(t)}
                for p, c, t in zip(prompts_text[:8], completions[:8], total[:8])
            ]
            tracker.log_table(table, f"samples/step_{loop.step:06d}")
            print_samples(table, f"grpo samples at step {loop.step}")
        buffer["rollout_stats"] = stats
        buffer["num_samples"] = len(gens)
        return stats

    def step(window: list[list[dict]]) -> dict[str, float]:
        if loop.iteration == 0:
            rollout(window)
        b = buffer
        n = b["completion_ids"].size(0)
        sums = {
            "kl": 0.0,
            "entropy": 0.0,
            "clip_ratio/low_mean": 0.0,
            "clip_ratio/high_mean": 0.0,
            "clip_ratio/region_mean": 0.0,
        }
        loss_total = 0.0
        micro = list(range(0, n, cfg.batch_size))
        for j, s in enumerate(micro):
            sl = slice(s, s + cfg.batch_size)
            mask = b["mask"][sl].to(device)
            with loop.no_sync_unless(j == len(micro) - 1):
                logps, entropy = completion_logps(
                    loop.model,
                    b["prompt_ids"][sl].to(device),
                    b["prompt_mask"][sl].to(device),
                    b["completion_ids"][sl].to(device),
                    temperature,
                    cfg.logprob_chunk_tokens,
                    with_entropy=True,
                    group=G,
                )
                old = b["old_logps"][sl].to(device) if "old_logps" in b else None
                refl = b["ref_logps"][sl].to(device) if "ref_logps" in b else None
                adv = b["advantages"][sl].to(device)
                ptl, ratio, kl = per_token_loss(
                    logps.float(), old, refl, adv, cfg.epsilon, eps_high, cfg.beta, cfg.kl_importance_correction
                )
                loss = aggregate(
                    ptl, mask, cfg.loss_type, cfg.max_completion_length, b["step_tokens_per_process"], len(micro)
                )
                acc.backward(loss)
            with torch.no_grad():
                loss_total += float(loss) * (len(micro) if cfg.loss_type != "dapo" else 1.0)
                a = adv.unsqueeze(1)
                low = ((ratio < 1 - cfg.epsilon) & (a < 0)).float()
                high = ((ratio > 1 + eps_high) & (a > 0)).float()
                sums["clip_ratio/low_mean"] += float(masked_mean(low, mask)) / len(micro)
                sums["clip_ratio/high_mean"] += float(masked_mean(high, mask)) / len(micro)
                sums["clip_ratio/region_mean"] += float(masked_mean(torch.maximum(low, high), mask)) / len(micro)
                sums["entropy"] += float(masked_mean(entropy, mask)) / len(micro)
                if kl is not None:
                    sums["kl"] += float(masked_mean(kl, mask)) / len(micro)
        loss_value = loss_total / (len(micro) if cfg.loss_type != "dapo" else 1.0)
        out = {"loss": loss_value, **sums, **b["rollout_stats"]}
        if cfg.beta == 0.0:
            out.pop("kl")
        tokens = float(b["mask"].sum() + b["prompt_mask"].sum())
        out["_meter"] = {
            "num_tokens": tokens if loop.iteration == 0 else 0,
            "num_samples": b["num_samples"] if loop.iteration == 0 else 0,
        }
        return out

    @torch.no_grad()
    def evaluate() -> dict[str, float]:
        sample = (eval_rows or [])[:64]
        greedy = SamplingParams(temperature=0, max_new_tokens=cfg.max_completion_length)
        engine.update_weights(loop.unwrapped)
        gens = engine.generate(encode_prompts(sample), 1, greedy)
        total, _ = rewards([r["prompt"] for r in sample], [g.completion for g in gens], extra_columns(sample))
        finite = total[~torch.isnan(total)]
        return {"reward": float(finite.mean()) if len(finite) else 0.0}

    result = loop.run(step, evaluate if eval_rows else None)
    result.model_dir, result.adapter = loop.save(tokenizer)
    return result
