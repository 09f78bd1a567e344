"""Online DPO (Guo et al. 2024, "Direct Language Model Alignment from Online AI Feedback"), following the design of
TRL's OnlineDPOTrainer.

Each optimizer step: take `batch_size × accumulation` prompts, sample two completions of each from the current policy
through the rollout engine, and let a ranker pick the better one: the reward set's weighted total (a reward model, a
`module:function`, a URL; `missing_eos_penalty` off a completion that never ended; the first sample wins a tie, as
TRL), or a pairwise LLM judge asked in both orders (a disagreement is a tie, and a tied pair does not train, since it
says nothing about which is better). Then the DPO loss on (chosen, rejected) against the reference (a frozen copy,
or the adapter-disabled policy under LoRA): sigmoid −log σ(βρ), or ipo (ρ − 1/2β)², ρ the difference of summed
log-ratios, log-probs at temperature 1 as TRL. The policy runs each prompt once for both answers.

Metrics (TRL's names, under train/): loss, objective/kl (Σ_t log π − log π_ref per completion, averaged),
objective/entropy, objective/non_score_reward, objective/rlhf_reward, objective/scores, objective/scores_margin
(reward ranking), rewards/chosen, rewards/rejected, rewards/margins, rewards/accuracies, logps/chosen, logps/rejected,
val/contain_eos_token, beta, and pairs_decided (the share of pairs the ranker separated); eval/reward (greedy,
held-out prompts) with reward ranking.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from alignpipe import fused_kernels
from alignpipe.device_copies import to_device
from alignpipe.engine.factory import hf_engine
from alignpipe.judges.pairwise import judge_pairs
from alignpipe.judges.reward_set import RewardSet
from alignpipe.losses import dpo_loss
from alignpipe.modeling import under_attention_kernels
from alignpipe.packed_rows import layout, pack_answers
from alignpipe.trainers import dpo
from alignpipe.trainers.common import TrainLoop, TrainResult, frozen_reference, pad_rows, resolve_seed
from alignpipe.trainers.configs import OnlineDPOConfig
from alignpipe.trainers.grpo import greedy_reward
from alignpipe.trainers.online import extra_columns, print_samples, prompt_ids, sync_weights


@dataclass
class Ranking:
    """Which of each prompt's two samples is chosen."""

    prefer_first: torch.Tensor
    """(B,) true where the first sample is the better one."""
    decided: torch.Tensor
    """(B,) false where the ranker could not separate the two (a judge tie); such pairs do not train."""
    scores: torch.Tensor | None = None
    """(2B,) every first sample's score, then every second's (reward ranking only)."""


class RewardRanker:
    """Ranks by the reward set's weighted total (an unscorable completion counts 0), after the EOS penalty."""

    def __init__(self, rewards: RewardSet, missing_eos_penalty: float | None):
        self.rewards, self.penalty = rewards, missing_eos_penalty

    def __call__(self, prompts: list[str], first: list, second: list, rows: list[dict]) -> Ranking:
        gens = first + second
        total, _ = self.rewards(
            prompts * 2, [g.completion for g in gens], extra_columns(rows * 2), [g.completion_ids for g in gens]
        )
        scores = torch.nan_to_num(total.float(), nan=0.0)
        if self.penalty is not None:
            ended = torch.tensor([g.finish_reason == "stop" for g in first + second])
            scores[~ended] -= self.penalty
        a, b = scores.split(len(prompts))
        return Ranking(a >= b, torch.ones(len(prompts), dtype=torch.bool), scores)


class JudgeRanker:
    """Ranks with a pairwise judge (`judges.pairwise`): both orders, disagreement = tie."""

    def __init__(self, judge, template: str):
        self.judge, self.template = judge, template

    def __call__(self, prompts: list[str], first: list, second: list, rows: list[dict]) -> Ranking:
        records = judge_pairs(
            self.judge, self.template, prompts, [g.completion for g in first], [g.completion for g in second]
        )
        verdicts = [r["verdict"] for r in records]
        return Ranking(torch.tensor([v != "loss" for v in verdicts]), torch.tensor([v != "tie" for v in verdicts]))


def pair_batch(
    prompts: list[list[int]],
    chosen: list[list[int]],
    rejected: list[list[int]],
    pad_id: int,
    packed: str | None = None,
) -> dict:
    """`dpo.completion_logps`'s layout: prompts once (left-padded), every chosen answer then every rejected one; with
    `packed` (`packed_rows.layout` of the policy), also the rows padding-free, as `dpo.collate` lays them out."""
    prompt_ids, prompt_mask = pad_rows(prompts, pad_id, left=True)
    completion_ids, completion_tokens = pad_rows(chosen + rejected, pad_id)
    answers = chosen + rejected
    extra = {}
    if packed and all(prompts[r % len(prompts)] or a for r, a in enumerate(answers)):  # no document may be empty
        extra["packed"] = pack_answers(prompts, answers, completion_ids.size(1), packed == "shared")
    return {
        **extra,
        "prompt_ids": prompt_ids,
        "prompt_mask": prompt_mask,
        "completion_ids": completion_ids,
        "completion_tokens": completion_tokens,
        "prompts_nonempty": all(prompts),
        "scored_per_row": completion_tokens.sum(1).tolist(),  # host counts: no device read to gather them
    }


def pair_metrics(parts: dict[str, list[torch.Tensor]], ranking: Ranking, eos: torch.Tensor, beta: float) -> dict:
    """TRL's step statistics from the window's per-pair tensors (device tensors, read when logged)."""
    c, r = torch.cat(parts["chosen"]), torch.cat(parts["rejected"])
    rc, rr = torch.cat(parts["ref_chosen"]), torch.cat(parts["ref_rejected"])
    kl = torch.cat([c - rc, r - rr])  # summed over each completion's tokens
    chosen_rewards, rejected_rewards = beta * (c - rc), beta * (r - rr)
    margins = chosen_rewards - rejected_rewards
    out: dict[str, Any] = {
        "objective/kl": kl.mean(),
        "objective/entropy": -torch.cat([c, r]).mean(),
        "objective/non_score_reward": (-beta * kl).mean(),
        "rewards/chosen": chosen_rewards.mean(),
        "rewards/rejected": rejected_rewards.mean(),
        "rewards/margins": margins.mean(),
        "rewards/accuracies": (margins > 0).float().mean(),
        "logps/chosen": c.mean(),
        "logps/rejected": r.mean(),
        "val/contain_eos_token": eos.float().mean(),
        "beta": beta,
        "pairs_decided": ranking.decided.float().mean(),
    }
    if ranking.scores is not None:
        B = len(ranking.prefer_first)
        # the scores (computed on the host) go to the log-probs' device, not the other way: no device read here
        scores = to_device(ranking.scores, kl.device)
        first, second = scores.split(B)
        prefer_first = to_device(ranking.prefer_first, kl.device)
        chosen_s = torch.where(prefer_first, first, second)
        rejected_s = torch.where(prefer_first, second, first)
        # TRL's rlhf_reward pairs each completion's score with its own non-score reward, in chosen/rejected order
        non_score = -beta * kl
        out["objective/scores"] = scores.mean()
        out["objective/scores_margin"] = (chosen_s - rejected_s).mean()
        out["objective/rlhf_reward"] = (torch.cat([chosen_s, rejected_s]) + non_score).mean()
    return out


@dataclass
class OnlineDPORun:
    """What `sample_pairs` and `update` read: the config, the loop (model, optimizer, accelerator), the ranker, the
    engine, the reference (a frozen copy, or none under LoRA: the adapter-disabled policy) and how batches run."""

    cfg: OnlineDPOConfig
    loop: TrainLoop
    tokenizer: Any
    ranker: Any
    engine: Any
    ref: Any
    packed: str | None
    """`packed_rows.layout` of the policy: its pairs run padding-free on a document-separating attention kernel."""
    kernels: bool
    """The LM head's chunks on the fused kernels (`fused_kernels`): the policy's, hand-written where Triton runs them,
    and the reference pass's."""
    seed: int

    def encode(self, batch_rows: list[dict]) -> list[list[int]]:
        return prompt_ids(self.tokenizer, batch_rows, self.cfg.max_prompt_length)

    def reference(self):
        """The reference model and the context it runs in."""
        if self.ref is not None:
            return self.ref, contextlib.nullcontext()
        return self.loop.model, self.loop.unwrapped.disable_adapter()


@dataclass
class RankedPairs:
    """One step's prompts, two sampled completions of each, the ranker's verdict, and the micro-batches of
    (chosen, rejected) pairs laid out on the host (`pair_batch`), so that `update` only moves them."""

    rows: list[dict]
    generations: list
    """Two per prompt: the first sample of prompt i at 2i, the second at 2i + 1."""
    ranking: Ranking
    chosen: list
    rejected: list
    batches: list[dict]

    @property
    def prompts(self) -> list[str]:
        return [r["prompt"] for r in self.rows]


@torch.no_grad()
def sample_pairs(run: OnlineDPORun, batch_rows: list[dict]) -> RankedPairs:
    """Sample two completions of each prompt, rank them, and lay out the (chosen, rejected) micro-batches."""
    cfg, loop = run.cfg, run.loop
    prompt_ids = run.encode(batch_rows)
    sync_weights(run.engine, loop.unwrapped, loop.count_sync)
    sampling = cfg.sampling.model_copy(update={"max_new_tokens": cfg.max_completion_length})
    started = time.perf_counter()
    gens = run.engine.generate(prompt_ids, 2, sampling, seed=run.seed + loop.step)
    loop.count_generation(time.perf_counter() - started, sum(len(g.completion_ids) for g in gens))
    first, second = gens[0::2], gens[1::2]
    prompts = [r["prompt"] for r in batch_rows]
    ranking = run.ranker(prompts, first, second, batch_rows)
    prefer = ranking.prefer_first.tolist()
    chosen = [f if p else s for f, s, p in zip(first, second, prefer)]
    rejected = [s if p else f for f, s, p in zip(first, second, prefer)]
    loop.count(sum(len(g.completion_ids) for g in gens) + 2 * sum(map(len, prompt_ids)), len(gens))
    batches = [
        pair_batch(
            prompt_ids[s : s + cfg.batch_size],
            [g.completion_ids for g in chosen[s : s + cfg.batch_size]],
            [g.completion_ids for g in rejected[s : s + cfg.batch_size]],
            run.tokenizer.pad_token_id,
            run.packed,
        )
        for s in range(0, len(batch_rows), cfg.batch_size)
    ]
    return RankedPairs(batch_rows, gens, ranking, chosen, rejected, batches)


def update(run: OnlineDPORun, pairs: RankedPairs) -> dict:
    """One optimizer step's forward and backward over the step's pairs, micro-batch by micro-batch (the loop then
    clips and steps); pairs the ranker left tied do not train. Returns the loss and TRL's statistics as device
    tensors, read when logged."""
    cfg, loop, acc = run.cfg, run.loop, run.loop.accelerator
    decided = to_device(pairs.ranking.decided, acc.device)
    denominator = decided.sum().clamp(min=1)
    parts: dict[str, list[torch.Tensor]] = {k: [] for k in ("chosen", "rejected", "ref_chosen", "ref_rejected")}
    loss_sum = torch.zeros((), device=acc.device)
    for j, host_batch in enumerate(pairs.batches):
        sl = slice(j * cfg.batch_size, (j + 1) * cfg.batch_size)
        batch = to_device(host_batch, acc.device)
        with loop.no_sync_unless(j == len(pairs.batches) - 1):
            logps, _, _ = dpo.completion_logps(loop.model, batch, compiled=run.kernels)
            ref_model, context = run.reference()
            with fused_kernels.without_grad(run.kernels, ref_model), context:
                ref_logps = dpo.completion_logps(ref_model, batch, compiled=run.kernels)[0]
            ref_logps = ref_logps.clone()
            c, r = logps.chunk(2)
            rc, rr = ref_logps.chunk(2)
            ones = torch.ones_like(c)  # ipo on summed log-ratios, as TRL's online trainer
            losses, _, _ = dpo_loss(c, r, rc, rr, cfg.beta, cfg.loss_type, 0.0, ones, ones)
            loss = (losses * decided[sl]).sum() / denominator
            acc.backward(loss)
        loss_sum += loss.detach()
        for key, value in zip(parts, (c, r, rc, rr)):
            parts[key].append(value.detach())
    eos = torch.tensor([g.finish_reason == "stop" for g in pairs.generations])
    return {"loss": loss_sum, **pair_metrics(parts, pairs.ranking, eos, cfg.beta)}


def log_samples(run: OnlineDPORun, pairs: RankedPairs) -> None:
    """Every `sample_every` steps, a table of (prompt, chosen, rejected, decided) in the tracker and the log."""
    loop = run.loop
    if loop.step % run.cfg.sample_every == 0 and loop.accelerator.is_main_process:
        table = [
            {"prompt": p, "chosen": ch.completion, "rejected": rj.completion, "decided": bool(d)}
            for p, ch, rj, d in zip(pairs.prompts[:8], pairs.chosen[:8], pairs.rejected[:8], pairs.ranking.decided[:8])
        ]
        loop.tracker.log_table(table, f"samples/step_{loop.step:06d}")
        print_samples(
            [{"prompt": t["prompt"], "completion": t["chosen"], "reward": 1.0} for t in table],
            f"online_dpo chosen samples at step {loop.step}",
        )


@under_attention_kernels
def train(
    cfg: OnlineDPOConfig,
    model,
    tokenizer,
    rows: list[dict],
    ranker,
    tracker,
    output_dir: str | Path,
    seed: int = 0,
    ref_model=None,
    engine=None,
    eval_rows: list[dict] | None = None,
    rewards: RewardSet | None = None,
) -> TrainResult:
    """Train `model` on pairs of its own completions ranked by `ranker` (`RewardRanker` or `JudgeRanker`). Without
    LoRA, pass a frozen `ref_model`. `rewards`, when given, also scores greedy completions of `eval_rows`."""
    from alignpipe.engine.sampling import SamplingParams

    seed = resolve_seed(cfg.seed, seed)
    if not cfg.lora and ref_model is None:
        raise ValueError("full-model online DPO needs `ref_model` (a frozen copy of the starting model), or set lora")
    if rewards is not None:
        rewards.probe([r["prompt"] for r in rows[:2]], extra_columns(rows[:2]))
    loop = TrainLoop("online_dpo", cfg, model, rows, lambda b: b, tracker, output_dir, seed, collates=False)
    device = loop.accelerator.device
    if engine is None:  # the hf engine on the policy itself
        engine = hf_engine(cfg.rollout, loop.unwrapped, tokenizer)
    ref = frozen_reference(ref_model, cfg, device) if not cfg.lora else None
    run = OnlineDPORun(
        cfg, loop, tokenizer, ranker, engine, ref, layout(model), fused_kernels.wanted(cfg.fused_kernels, device), seed
    )

    def step(window: list[list[dict]]) -> dict:
        pairs = sample_pairs(run, [r for micro in window for r in micro])
        log_samples(run, pairs)
        return update(run, pairs)

    def evaluate() -> dict[str, float]:
        assert rewards is not None
        greedy = SamplingParams(temperature=0, max_new_tokens=cfg.max_completion_length)
        return {"reward": greedy_reward(engine, loop, rewards, run.encode, eval_rows or [], greedy)}

    result = loop.run(step, evaluate if (eval_rows and rewards is not None) else None)
    result.model_dir, result.adapter = loop.save(tokenizer)
    return result
