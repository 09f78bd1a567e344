"""Group Relative Policy Optimization, following the design of TRL's GRPOTrainer.

Each generation batch: take `batch_size × steps_per_generation / num_generations` prompts (by default one optimizer
step's: `steps_per_generation` = `gradient_accumulation_steps`), sample `num_generations` completions each through
the rollout engine, score them with the reward set (weighted sum; a function may answer None), and turn rewards into
group-relative advantages (r − mean(group)) / std, std per group, per batch, or none). Completions are masked after
their first EOS (and wholly, with `mask_truncated_completions`, when they never end). The batch feeds
`steps_per_generation / gradient_accumulation_steps` optimizer steps, a part each, `num_iterations` times over.

Per token, with ratio ρ = π/π_old (π_old = π detached unless the rollout is reused: `num_iterations` > 1 or several
steps per generation batch, when π_old's log-probs are taken at generation):
    loss = −min(ρ·A, clip(ρ, 1−ε, 1+ε_high)·A) + β·KL_k3(π ‖ π_ref)
aggregated by `loss_type`: grpo (per-sequence mean, then mean), bnpo (mean over the micro-batch's tokens), dr_grpo
(sum / (sequences × max_completion_length)), dapo (sum / tokens of the step: the generation batch's, divided among its
steps, as TRL), luspo (per-sequence sum, then mean); or cispo's, sapo's and vespo's losses (`losses.per_token_loss`).
With `importance_sampling_level: sequence` (GSPO) ρ is one ratio per completion. `sampling_correction` weighs the
policy term by π_old/π_sampler (the engine's own log-probs), `off_policy_mask_threshold` drops completions the
sampler has drifted from. `entropy_coef` subtracts c × the trained tokens' mean entropy (`entropy_control`).
β = 0 loads no reference model; with LoRA the reference is the adapter-disabled policy.

Metrics (TRL's names, under train/): loss, reward, reward_std, rewards/<fn>/mean, rewards/<fn>/std,
frac_reward_zero_std (groups with fewer than two scorable completions do not count as zero-std,
as TRL counts them), completions/{mean,min,max}_length, completions/clipped_ratio, kl, entropy,
clip_ratio/{low,high,region}_mean (cispo: cispo_clip_ratio; vespo: vespo/phi_seq_mean; sapo: none), sampling/* (with
a sampling correction), policy_loss and entropy_coef (with an entropy bonus), tools/call_frequency and
tools/failure_frequency (with tools); eval/reward (held-out prompts: greedy, or the mean of `num_generations_eval`
samples each, with eval/reward_std and eval/rewards/<fn>/mean).

With tools (the prompts' format stage lists them), each rollout runs the model's calls (`tool_calls.tool_turns`):
the results sit in the completions and are masked out of the loss.

Entry point: `train(cfg, model, tokenizer, rows, rewards, tracker, output_dir, seed, ...)`.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from alignpipe import fused_kernels
from alignpipe.device_copies import to_device
from alignpipe.engine.factory import hf_engine
from alignpipe.engine.sampling import SamplingParams
from alignpipe.judges.reward_set import RewardSet
from alignpipe.logprobs import WithEntropy, every_row_holds_a_token, shared_prompt_logprobs
from alignpipe.losses import aggregate, per_token_loss
from alignpipe.modeling import float32_head, under_attention_kernels
from alignpipe.moe import RouterLoss, RouterTotals, answer_masks, recording
from alignpipe.packed_rows import layout, pack_answers
from alignpipe.rl_math import (
    frac_zero_std,
    group_advantages,
    high_entropy_tokens,
    masked_mean,
    normalize_then_sum_advantages,
    off_policy_mask,
    sampling_importance_weights,
    vespo_weights,
)
from alignpipe.tool_calls import ToolRollout, ToolRunner
from alignpipe.trainers.common import TrainLoop, TrainResult, frozen_reference, pad_rows, resolve_seed
from alignpipe.trainers.configs import GRPOConfig, RLOOConfig
from alignpipe.trainers.entropy_control import EntropyControl, entropy_bonus
from alignpipe.trainers.online import extra_columns, print_samples, prompt_ids, sync_weights
from alignpipe.trainers.ref_sync import synced

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
    with_entropy: WithEntropy = False,
    group: int = 1,
    device: torch.device | str | None = None,
    mask: torch.Tensor | None = None,
    rollout: RolloutFacts | None = None,
    compiled: bool = False,
):
    """Log-probs (and entropies) of the completion tokens, (B, C). Rows come in groups of `group` samples of one
    prompt: each prompt's forward runs once (`shared_prompt_logprobs`). With `device`, the inputs are host tensors:
    whether rows really come in groups and every prompt holds a token is checked there, and `mask`'s tokens counted,
    before they move, so the device is not waited on; `rollout` gives those facts where the caller knows them
    already. `mask` (B, C): the tokens that train; the LM head runs on them alone (0 elsewhere), not on the padding
    after shorter completions. On a kernel that runs documents (`packed_rows.layout`), with `rollout`'s token lists
    and `mask`, the rows run padding-free, each prompt once for its group (`packed_rows.pack_answers`). `compiled`:
    the LM head's chunks compiled (`logprobs.token_logprobs`)."""
    B = prompt_ids.size(0)
    firsts = prompt_ids[::group], prompt_mask[::group]
    index = torch.arange(B, device=prompt_ids.device) // group
    grouped = rollout is not None or (
        not B % group and (torch.equal(prompt_ids, firsts[0][index]) and torch.equal(prompt_mask, firsts[1][index]))
    )
    if not grouped:  # one prompt per row
        firsts, index = (prompt_ids, prompt_mask), torch.arange(B, device=prompt_ids.device)
    nonempty, count = None, None
    how = layout(model) if device is not None and mask is not None and rollout is not None else None
    packed = rollout.padding_free(how == "shared", device) if how and rollout and rollout.padding_free else None
    if device is not None:
        nonempty = rollout.prompts_nonempty if rollout else every_row_holds_a_token(firsts[1])
        if mask is not None:
            count = rollout.tokens if rollout else int(mask.sum())
        mask, firsts, index, completion_ids = to_device((mask, firsts, index, completion_ids), device)
    return shared_prompt_logprobs(
        model,
        *firsts,
        completion_ids,
        index,
        temperature=temperature,
        chunk_tokens=chunk,
        with_entropy=with_entropy,
        prompts_nonempty=nonempty,
        only=mask,
        count=count,
        packed=packed,
        compiled=compiled,
    )


@dataclass
class RolloutFacts:
    """What a rollout's builder knows on the host about a micro-batch of it, so `completion_logps` need not look:
    its rows come in whole groups of one prompt's samples, whether every prompt holds a token, and how many
    completion tokens train."""

    prompts_nonempty: bool
    tokens: int
    padding_free: Callable[[bool, Any], dict | None] | None = None
    """`(share, device) ->` the micro-batch's rows as `packed_rows.pack_answers` lays them out, on the device (None
    where a document would be empty), built once per micro-batch and layout (`GRPORollout.padding_free`)."""


@dataclass
class GRPORollout:
    """One generation batch, B = prompts × num_generations rows in groups of one prompt's samples, in the order it is
    built: generation, then scoring, then the reference and old-policy log-probs (host tensors; micro-batches move
    to the device as they train)."""

    # after generation
    prompt_ids: torch.Tensor
    """(B, P) left-padded prompt ids, each prompt repeated for its group."""
    prompt_mask: torch.Tensor
    completion_ids: torch.Tensor
    """(B, C) right-padded completion ids."""
    mask: torch.Tensor
    """(B, C) 1 on the tokens that train: through the first EOS (none for truncated rows with
    `mask_truncated_completions`)."""
    lengths: torch.Tensor
    ended: torch.Tensor
    """(B,) whether the completion ended with EOS."""
    # after scoring
    rewards: torch.Tensor
    """(B,) the reward set's weighted total (NaN where no function could score)."""
    per_fn: torch.Tensor
    """(B, functions) each reward function's score."""
    advantages: torch.Tensor
    group_std: torch.Tensor
    # after the reference / old-policy passes
    old_logps: torch.Tensor | None
    """π_old's log-probs (num_iterations > 1 only; otherwise π_old is π detached)."""
    ref_logps: torch.Tensor | None
    """The reference's log-probs (beta > 0 only)."""
    step_tokens_per_process: float
    """Completion tokens of the whole step over all processes, per process (the dapo normaliser)."""
    prompts_nonempty: bool
    """Whether every prompt holds a token (from the token lists, before padding)."""
    row_tokens: list[int] = field(init=False)
    """`mask`'s count per row, on the host: a micro-batch's LM head gathers its tokens without a device read."""
    layouts: dict[tuple, dict | None] = field(init=False, default_factory=dict, repr=False)
    """The padding-free layouts built so far, per (micro-batch, shared prompts): the old-policy, reference and
    update passes over a micro-batch reuse its layout."""
    kl: float | None = None
    """Mean per-token KL of the sampling policy to the reference, when the rollout measured it (RLOO's penalty)."""
    sampling_logps: torch.Tensor | None = None
    """(B, C) the engine's log-prob of each sampled token (NaN where it had none), when the run asked for them."""
    sampling_weights: torch.Tensor | None = None
    """`sampling_correction`'s weights π_old/π_sampler, (B, C) or (B, 1)."""
    correction_stats: dict[str, float] = field(default_factory=dict)
    """TRL's sampling/* metrics of the correction (`sampling_gap_metrics`)."""
    tool_mask: torch.Tensor | None = None
    """(B, C) 0 on tool results inside completions, with tools: the completions' lengths count sampled tokens only."""
    tool_stats: dict[str, float] = field(default_factory=dict)
    """TRL's tools/call_frequency (calls per completion) and tools/failure_frequency (failed / calls)."""

    def __post_init__(self) -> None:
        self.row_tokens = [int(n) for n in self.mask.sum(1).long()]

    def facts(self, sl: slice, group: int) -> RolloutFacts:
        """The host facts of micro-batch `sl`, which starts and ends on group boundaries (`batch_size` is a multiple
        of `num_generations`, `group`)."""
        return RolloutFacts(
            self.prompts_nonempty,
            sum(self.row_tokens[sl]),
            lambda share, device: self.padding_free(sl, group, share, device),
        )

    def padding_free(self, sl: slice, group: int, share: bool, device) -> dict | None:
        """Micro-batch `sl`'s rows (groups of `group` samples of one prompt) as `packed_rows.pack_answers` lays them
        out, on `device`, from the host tensors; None where a document would be empty. Built once per micro-batch
        and layout."""
        key = (sl.start, sl.stop, share)
        if key not in self.layouts:
            prompts = [
                ids[keep.bool()].tolist()
                for ids, keep in zip(self.prompt_ids[sl][::group], self.prompt_mask[sl][::group])
            ]
            answers = [row[:n].tolist() for row, n in zip(self.completion_ids[sl], self.lengths[sl].tolist())]
            index = [r // group for r in range(len(answers))]
            whole = all(prompts[g] or a for g, a in zip(index, answers, strict=True))  # no document may be empty
            packed = pack_answers(prompts, answers, self.completion_ids.size(1), share, index) if whole else None
            self.layouts[key] = to_device(packed, device) if packed else None
        return self.layouts[key]

    def stats(self, reward_names: list[str]) -> dict[str, float]:
        """TRL's rollout metrics: reward, reward_std, rewards/<fn>/mean|std, frac_reward_zero_std, completions/*."""
        finite = self.rewards[~torch.isnan(self.rewards)]
        lengths = self.lengths if self.tool_mask is None else self.tool_mask.sum(1)  # TRL's: sampled tokens only
        out = {
            "reward": float(finite.mean()) if len(finite) else 0.0,
            "reward_std": float(finite.std()) if len(finite) > 1 else 0.0,
            "frac_reward_zero_std": frac_zero_std(self.group_std),
            "completions/mean_length": float(lengths.float().mean()),
            "completions/min_length": float(lengths.min()),
            "completions/max_length": float(lengths.max()),
            "completions/clipped_ratio": float((~self.ended).float().mean()),
        }
        for k, name in enumerate(reward_names):
            col = self.per_fn[:, k][~torch.isnan(self.per_fn[:, k])]
            out[f"rewards/{name}/mean"] = float(col.mean()) if len(col) else 0.0
            out[f"rewards/{name}/std"] = float(col.std()) if len(col) > 1 else 0.0
        if self.kl is not None:
            out["kl"] = self.kl
        out |= self.correction_stats
        out |= self.tool_stats
        return out


@dataclass
class GRPORun:
    """What `rollout` and `update` read: the config, the loop (model, optimizer, accelerator), the engine and the
    reference (a frozen copy, or the adapter-disabled policy under LoRA, or none when beta is 0)."""

    cfg: GRPOConfig | RLOOConfig
    loop: TrainLoop
    tokenizer: Any
    rewards: RewardSet
    engine: Any
    ref: Any
    seed: int
    entropy: EntropyControl | None = None
    """GRPO's entropy bonus (`entropy_coef`), when it has one."""
    tools: ToolRunner | None = None
    """The tools the prompts offer, called during rollouts."""
    router: RouterLoss | None = None
    """An MoE policy's load-balancing loss (`router_aux_loss_coef`), recorded in each micro-batch's forward."""

    @property
    def temperature(self) -> float:
        return self.cfg.sampling.temperature or 1.0

    @property
    def epsilon_high(self) -> float:
        return self.cfg.epsilon_high if self.cfg.epsilon_high is not None else self.cfg.epsilon

    @property
    def reuses_rollouts(self) -> bool:
        """Whether a generation batch trains after the policy has moved (`num_iterations` > 1, or several optimizer
        steps per generation batch): then its old-policy log-probs are taken at generation."""
        return self.cfg.num_iterations > 1 or self.cfg.steps_per_rollout > 1

    def step_part(self, batch: GRPORollout) -> list[int]:
        """The starts of the micro-batches this optimizer step trains on: the generation batch's micro-batches of
        `batch_size` rows, in `steps_per_rollout` consecutive parts of `gradient_accumulation_steps`, part
        `iteration % steps_per_rollout` (TRL's order: every part once, then again for each further iteration)."""
        starts = list(range(0, batch.completion_ids.size(0), self.cfg.batch_size))
        per_step = self.cfg.gradient_accumulation_steps
        part = self.loop.iteration % self.cfg.steps_per_rollout
        return starts[part * per_step : (part + 1) * per_step] if self.cfg.steps_per_rollout > 1 else starts

    def reference(self):
        """The reference model and the context it runs in."""
        if self.ref is not None:
            return self.ref, contextlib.nullcontext()
        return self.loop.model, self.loop.unwrapped.disable_adapter()

    def encode_prompts(self, rows: list[dict]) -> list[list[int]]:
        return prompt_ids(self.tokenizer, rows, self.cfg.max_prompt_length)

    def logps_of(self, model, batch: GRPORollout, context) -> torch.Tensor:
        """Log-probs of every completion of `batch` under `model` (no grad), micro-batch by micro-batch, the LM head's
        chunks compiled under `fused_kernels` on a GPU."""
        device, cfg = self.loop.accelerator.device, self.cfg
        kernels = fused_kernels.wanted(cfg.fused_kernels, device)
        parts = []
        with context:
            for s in range(0, batch.completion_ids.size(0), cfg.batch_size):
                sl = slice(s, s + cfg.batch_size)
                parts.append(
                    completion_logps(
                        model,
                        batch.prompt_ids[sl],
                        batch.prompt_mask[sl],
                        batch.completion_ids[sl],
                        self.temperature,
                        cfg.logprob_chunk_tokens,
                        group=cfg.num_generations,
                        device=device,
                        mask=batch.mask[sl],
                        rollout=batch.facts(sl, cfg.num_generations),
                        compiled=kernels,
                    ).float()
                )
        return torch.cat(parts)

    def micro_logps(self, batch: GRPORollout, sl: slice, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The trained policy's log-probs and entropies of one micro-batch of `batch`, with grad, on the device (an
        MoE policy's routers recorded for its load-balancing loss; `mask`: the micro-batch's completion mask, on the
        device already); the LM head's chunks on the hand-written head kernels under `fused_kernels` on a GPU."""
        device = self.loop.accelerator.device
        kernels = fused_kernels.wanted(self.cfg.fused_kernels, device)
        masks: tuple = ()
        if self.router is not None:
            rows = torch.arange(mask.size(0), device=device)
            masks = answer_masks(to_device(batch.prompt_mask[sl], device), mask, rows)
        with recording(self.router, *masks):
            return completion_logps(
                self.loop.model,
                batch.prompt_ids[sl],
                batch.prompt_mask[sl],
                batch.completion_ids[sl],
                self.temperature,
                self.cfg.logprob_chunk_tokens,
                with_entropy="grad" if self.entropy is not None else True,  # a bonus trains through the entropy
                group=self.cfg.num_generations,
                device=device,
                mask=batch.mask[sl],
                rollout=batch.facts(sl, self.cfg.num_generations),
                compiled=kernels,
            )


def clip_fractions(
    ratio: torch.Tensor, advantages: torch.Tensor, epsilon: float, epsilon_high: float, mask: torch.Tensor | None = None
) -> dict[str, torch.Tensor]:
    """TRL's clip_ratio/{low,high,region}_mean: how often the ratio sits below 1 − ε with A < 0, above 1 + ε_high
    with A > 0, or either (per token under `mask`, else per sequence)."""
    a = advantages.unsqueeze(1) if mask is not None else advantages
    low = ((ratio < 1 - epsilon) & (a < 0)).float()
    high = ((ratio > 1 + epsilon_high) & (a > 0)).float()

    def mean(x: torch.Tensor) -> torch.Tensor:
        return masked_mean(x, mask) if mask is not None else x.mean()

    return {
        "clip_ratio/low_mean": mean(low),
        "clip_ratio/high_mean": mean(high),
        "clip_ratio/region_mean": mean(torch.maximum(low, high)),
    }


@dataclass
class Samples:
    """`num_generations` completions of each prompt, grouped (what generation yields; GRPO and RLOO score them)."""

    prompt_ids: torch.Tensor
    prompt_mask: torch.Tensor
    completion_ids: torch.Tensor
    mask: torch.Tensor
    lengths: torch.Tensor
    ended: torch.Tensor
    rows: list[dict]
    """The dataset row of each completion (its prompt and extra columns such as `answer`)."""
    completions: list[str]
    prompts_nonempty: bool
    sampling_logps: torch.Tensor | None = None
    """(B, C) each sampled token's log-prob under the engine's sampling distribution (0 on padding, NaN where the
    engine had none), when asked for."""
    tools: ToolRollout | None = None
    """The tool turns, when the prompts offer tools: `completions` are then each completion's last assistant turn."""
    tool_mask: torch.Tensor | None = None
    """(B, C) 0 on the tool results inside completions (already out of `mask`)."""

    @property
    def prompts(self) -> list[str]:
        return [r["prompt"] for r in self.rows]

    @property
    def messages(self) -> list[list[dict]] | None:
        """Each completion as messages (assistant turns with their `tool_calls`, tool results), with tools."""
        return self.tools.messages if self.tools else None

    def tool_fields(self) -> dict[str, Any]:
        """The `GRPORollout` fields of the tool turns: the mask of sampled tokens and TRL's tools/* metrics."""
        if self.tools is None:
            return {}
        calls, n = self.tools.calls, len(self.rows)
        return {
            "tool_mask": self.tool_mask,
            "tool_stats": {
                "tools/call_frequency": calls / n,
                "tools/failure_frequency": self.tools.failures / calls if calls else 0.0,
            },
        }

    @property
    def token_lists(self) -> list[list[int]]:
        """Each completion's token ids, through its EOS (what reward functions reading `completion_ids` get)."""
        return [row[:n] for row, n in zip(self.completion_ids.tolist(), self.lengths.tolist(), strict=True)]


@torch.no_grad()
def sample(run: GRPORun, batch_rows: list[dict], logprobs: bool = False) -> Samples:
    """Generate `num_generations` completions per prompt through the engine (weights synced first); with `logprobs`,
    the engine's sampling log-probs too."""
    cfg, loop, G = run.cfg, run.loop, run.cfg.num_generations
    pad = run.tokenizer.pad_token_id
    prompt_lists = run.encode_prompts(batch_rows)
    sync_weights(run.engine, loop.unwrapped, loop.count_sync)
    sampling = cfg.sampling.model_copy(update={"max_new_tokens": cfg.max_completion_length})
    extra = {"logprobs": True} if logprobs else {}  # engines that cannot give them need not take the argument
    seed = run.seed + loop.step
    started = time.perf_counter()
    gens = run.engine.generate(prompt_lists, G, sampling, seed=seed, **extra)
    repeated = [p for p in prompt_lists for _ in range(G)]
    tools = run.tools.turns(run.engine, repeated, gens, sampling, seed, logprobs) if run.tools else None
    ids = tools.completion_ids if tools else [g.completion_ids for g in gens]
    sampled = sum(map(sum, tools.tool_mask)) if tools else sum(map(len, ids))  # tool answers are not sampled
    loop.count_generation(time.perf_counter() - started, sampled)
    prompt_ids, prompt_mask = pad_rows(repeated, pad, left=True)
    completion_ids, _ = pad_rows(ids, pad)
    lengths = torch.tensor([len(x) for x in ids])
    ended = torch.tensor(tools.ended if tools else [g.finish_reason == "stop" for g in gens])
    mask = completion_mask(completion_ids, lengths, ended, cfg.mask_truncated_completions)
    tool_mask = None
    if tools:  # the tool results are in the completion, not in the loss
        tool_mask = pad_rows(tools.tool_mask, 0)[0].float()
        mask = mask * tool_mask
    rows = [r for r in batch_rows for _ in range(G)]
    loop.count(mask.sum() + prompt_mask.sum(), len(gens))
    completions = tools.answers if tools else [g.completion for g in gens]
    sampling_logps = None
    if logprobs:
        sampling_logps = torch.zeros(completion_ids.shape)
        lists = tools.logprobs if tools else [g.logprobs for g in gens]
        for i, row in enumerate(lists or []):
            if row is None:
                raise RuntimeError(f"the rollout engine {type(run.engine).__name__} returned no sampling log-probs")
            sampling_logps[i, : len(row)] = torch.tensor(row, dtype=torch.float32)
    return Samples(
        prompt_ids, prompt_mask, completion_ids, mask, lengths, ended, rows, completions, all(prompt_lists),
        sampling_logps, tools, tool_mask,
    )  # fmt: skip


def sampling_gap_metrics(
    old_logps: torch.Tensor, sampling_logps: torch.Tensor, mask: torch.Tensor, weights: torch.Tensor
) -> dict[str, float]:
    """TRL's metrics of the sampling correction over a generation batch: |log π_old − log π_sampler| per token
    (sampling/sampling_logp_difference/mean, max; tokens without a sampling log-prob left out) and the weights
    (sampling/importance_sampling_ratio/min, mean, max; per token on completion tokens, or per completion)."""
    on = mask.bool()
    gap = (old_logps - sampling_logps).abs()[on & ~torch.isnan(sampling_logps)]
    w = weights.flatten() if weights.size(1) == 1 else weights[on]
    zero = torch.zeros((), device=weights.device)

    def stat(x: torch.Tensor, fn) -> float:
        return float(fn(x) if x.numel() else zero)

    return {
        "sampling/sampling_logp_difference/mean": stat(gap, torch.mean),
        "sampling/sampling_logp_difference/max": stat(gap, torch.max),
        "sampling/importance_sampling_ratio/min": stat(w, torch.min),
        "sampling/importance_sampling_ratio/mean": stat(w, torch.mean),
        "sampling/importance_sampling_ratio/max": stat(w, torch.max),
    }


def step_tokens_per_process(loop: TrainLoop, mask: torch.Tensor, steps: int = 1) -> float:
    """Completion tokens of an optimizer step over all processes, per process (the dapo normaliser): the generation
    batch's, divided among the `steps` optimizer steps it feeds (TRL's rescaling of `num_items_in_batch`)."""
    acc = loop.accelerator
    tokens = mask.sum().to(acc.device)
    if acc.num_processes > 1:
        tokens = acc.reduce(tokens, "sum")
    return float(tokens) / acc.num_processes / steps


@torch.no_grad()
def rollout(run: GRPORun, batch_rows: list[dict]) -> tuple[GRPORollout, Samples]:
    """Generate `num_generations` completions per prompt, score them, turn rewards into group advantages and take
    the old-policy and reference log-probs the loss needs."""
    cfg, loop = run.cfg, run.loop
    assert isinstance(cfg, GRPOConfig)
    sm = sample(run, batch_rows, logprobs=cfg.needs_sampling_logprobs)
    total, per_fn = run.rewards(sm.prompts, sm.completions, extra_columns(sm.rows), sm.token_lists, sm.messages)
    if cfg.multi_objective_aggregation == "normalize_then_sum":
        weights = torch.tensor([r.weight for r in run.rewards.rewards], dtype=per_fn.dtype)
        advantages, std = normalize_then_sum_advantages(per_fn, weights, cfg.num_generations)
    else:
        advantages, std = group_advantages(total, cfg.num_generations, cfg.scale_rewards)
    batch = GRPORollout(
        sm.prompt_ids,
        sm.prompt_mask,
        sm.completion_ids,
        sm.mask,
        sm.lengths,
        sm.ended,
        total,
        per_fn,
        advantages,
        std,
        old_logps=None,
        ref_logps=None,
        step_tokens_per_process=step_tokens_per_process(loop, sm.mask, cfg.steps_per_rollout),
        prompts_nonempty=sm.prompts_nonempty,
        sampling_logps=sm.sampling_logps,
        **sm.tool_fields(),
    )
    loop.model.eval()
    if run.reuses_rollouts or cfg.correction != "none":
        batch.old_logps = run.logps_of(loop.model, batch, contextlib.nullcontext())
    if cfg.correction != "none":
        assert batch.old_logps is not None and batch.sampling_logps is not None
        sampled, mask = to_device((batch.sampling_logps, batch.mask), batch.old_logps.device)
        batch.sampling_weights = sampling_importance_weights(
            batch.old_logps, sampled, mask, cfg.correction, cfg.sampling_correction_min, cfg.sampling_correction_max
        )
        batch.correction_stats = sampling_gap_metrics(batch.old_logps, sampled, mask, batch.sampling_weights)
    if cfg.beta != 0.0:
        ref_model, context = run.reference()
        batch.ref_logps = run.logps_of(ref_model, batch, context)
    loop.model.train()
    return batch, sm


class StepMetrics(dict):
    """An optimizer step's metrics over its micro-batches, as device tensors (read when logged)."""

    def __init__(self, parts: int):
        super().__init__()
        self.parts = parts

    def mean(self, key: str, value: torch.Tensor) -> None:
        """Adds `value`'s share of the step's mean over its micro-batches."""
        self[key] = self.get(key, 0) + value.detach() / self.parts

    def total(self, key: str, value: torch.Tensor) -> None:
        """Adds `value` as it is (a micro-batch's loss already is its share of the step's)."""
        self[key] = self.get(key, 0) + value.detach()


def micro_batches(run: GRPORun, batch: GRPORollout, micro: list[int]):
    """The micro-batches of one optimizer step, starting at the rollout's rows `micro`: each one's rows (a slice) and
    its completion mask and advantages on the device, its body run with gradients synchronised across processes at
    the last one's backward only."""
    loop = run.loop
    for j, start in enumerate(micro):
        rows = slice(start, start + run.cfg.batch_size)
        mask, adv = to_device((batch.mask[rows], batch.advantages[rows]), loop.accelerator.device)
        with loop.no_sync_unless(j == len(micro) - 1):
            yield rows, mask, adv


def update(run: GRPORun, batch: GRPORollout, micro: list[int]) -> dict[str, torch.Tensor]:
    """One optimizer step's forward and backward over the rollout's micro-batches starting at `micro` (the loop then
    clips and steps). Returns the loss and TRL's per-token metrics as device tensors, read when logged."""
    cfg, acc = run.cfg, run.loop.accelerator
    assert isinstance(cfg, GRPOConfig)
    device, eps_high = acc.device, run.epsilon_high
    sums = StepMetrics(len(micro))
    aux = RouterTotals(run.router, device)
    for sl, mask, adv in micro_batches(run, batch, micro):
        logps, entropy_grad = run.micro_logps(batch, sl, mask)
        entropy = entropy_grad.detach()
        policy_tokens, weights, high = None, None, None
        if batch.sampling_weights is not None:
            weights = to_device(batch.sampling_weights[sl], device)
        if cfg.top_entropy_quantile < 1:
            pool = acc.num_processes > 1
            gather = (lambda x: acc.gather(acc.pad_across_processes(x, pad_index=float("nan")))) if pool else None
            policy_tokens = high = high_entropy_tokens(entropy, mask, cfg.top_entropy_quantile, gather).float()
        if cfg.off_policy_mask_threshold is not None:  # (B, 1): keeps the policy term of whole completions
            assert batch.sampling_logps is not None
            sampled = to_device(batch.sampling_logps[sl], device)
            keep = off_policy_mask(adv, logps.float(), sampled, mask, cfg.off_policy_mask_threshold)
            policy_tokens = keep if policy_tokens is None else policy_tokens * keep
        old = to_device(batch.old_logps[sl], device) if batch.old_logps is not None else None
        ref = to_device(batch.ref_logps[sl], device) if batch.ref_logps is not None else None
        ptl, ratio, kl = per_token_loss(
            logps.float(),
            old,
            ref,
            adv,
            cfg.epsilon,
            eps_high,
            cfg.beta,
            cfg.kl_importance_correction,
            mask,
            cfg.importance_sampling_level,
            cfg.loss_type,
            (cfg.sapo_temperature_pos, cfg.sapo_temperature_neg),
            cfg.delta,
            policy_tokens,
            weights,
            ((cfg.vespo_k_pos, cfg.vespo_lambda_pos), (cfg.vespo_k_neg, cfg.vespo_lambda_neg)),
        )
        policy_loss = loss = aggregate(
            ptl, mask, cfg.loss_type, cfg.max_completion_length, batch.step_tokens_per_process, len(micro)
        )
        if run.entropy is not None:  # on the tokens the policy term trains (TRL's: the high-entropy ones, if set)
            tokens = mask if high is None else mask * high
            loss = loss - run.entropy.applied() * entropy_bonus(entropy_grad.float(), tokens) / len(micro)
            run.entropy.observe(entropy, tokens)
        loss = loss + aux.term(1 / len(micro))  # TRL's: the micro-batch's MoE loss over the accumulation steps
        acc.backward(loss)
        with torch.no_grad():
            sums.total("loss", loss)  # each micro-batch's loss is its share of the step's: they add up
            if run.entropy is not None:
                sums.total("policy_loss", policy_loss)
            for key, value in ratio_metrics(cfg, ratio, adv, eps_high, mask, weights).items():
                sums.mean(key, value)
            sums.mean("entropy", masked_mean(entropy, mask))
            if kl is not None:
                sums.mean("kl", masked_mean(kl, mask))
    if run.entropy is not None:
        run.entropy.step()
        sums["entropy_coef"] = run.entropy.coef  # as TRL logs it: the coefficient after the step's update
    sums |= aux.metrics()
    return sums


def ratio_metrics(
    cfg: GRPOConfig,
    ratio: torch.Tensor,
    advantages: torch.Tensor,
    epsilon_high: float,
    mask: torch.Tensor,
    sampling_weights: torch.Tensor | None = None,
) -> dict[str, torch.Tensor]:
    """TRL's ratio metrics for the loss type: the clip fractions of the clipped surrogate, cispo's
    `cispo_clip_ratio` (ratio above ε_high with A > 0), vespo's mean gamma weight `vespo/phi_seq_mean`, none for
    sapo's soft gate; per token, or per completion with sequence-level ratios."""
    sequence = ratio.size(1) == 1
    if cfg.loss_type == "sapo":
        return {}
    if cfg.loss_type == "vespo":
        k, lam = (cfg.vespo_k_pos, cfg.vespo_k_neg), (cfg.vespo_lambda_pos, cfg.vespo_lambda_neg)
        return {
            "vespo/phi_seq_mean": vespo_weights(advantages, torch.log(ratio), mask, sampling_weights, k, lam).mean()
        }
    if cfg.loss_type == "cispo":
        clipped = ((ratio > epsilon_high) & (advantages.unsqueeze(1) > 0)).float()
        return {"cispo_clip_ratio": clipped.mean() if sequence else masked_mean(clipped, mask)}
    if sequence:
        return clip_fractions(ratio.squeeze(1), advantages, cfg.epsilon, epsilon_high)
    return clip_fractions(ratio, advantages, cfg.epsilon, epsilon_high, mask)


def log_samples(run: GRPORun, sm: Samples, rewards: torch.Tensor, name: str) -> None:
    """Every `sample_every` steps, a table of (prompt, completion, reward) in the tracker and the log."""
    loop = run.loop
    if loop.step % run.cfg.sample_every == 0 and loop.accelerator.is_main_process:
        table = [
            {"prompt": p, "completion": c, "reward": float(t)}
            for p, c, t in zip(sm.prompts[:8], sm.completions[:8], rewards[:8])
        ]
        loop.tracker.log_table(table, f"samples/step_{loop.step:06d}")
        print_samples(table, f"{name} samples at step {loop.step}")


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
    tools: list[Callable] | None = None,
    chat_template_kwargs: dict | None = None,
) -> TrainResult:
    """`tools`: the functions the prompts offer (rendered into them by the chat template, with
    `chat_template_kwargs`), called during rollouts (`alignpipe.tool_calls`)."""
    return train_on_samples(
        "grpo", rollout, update, cfg, model, tokenizer, rows, rewards, tracker, output_dir, seed, ref_model, engine,
        eval_rows, tools, chat_template_kwargs,
    )  # fmt: skip


@torch.no_grad()
def held_out_rewards(
    engine,
    loop: TrainLoop,
    rewards: RewardSet,
    encode,
    rows: list[dict],
    sampling: SamplingParams,
    n: int = 1,
    tools: ToolRunner | None = None,
    seed: int | None = None,
    limit: int = 64,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The reward set's (total, per function) for `n` completions of each of the first `limit` held-out prompts
    (grouped by prompt), calling the tools as in training."""
    sample_rows = rows[:limit]
    sync_weights(engine, loop.unwrapped, loop.count_sync)
    prompts = encode(sample_rows)
    gens = engine.generate(prompts, n, sampling, seed=seed)
    turns = tools.turns(engine, [p for p in prompts for _ in range(n)], gens, sampling, seed, False) if tools else None
    repeated = [r for r in sample_rows for _ in range(n)]
    return rewards(
        [r["prompt"] for r in repeated],
        turns.answers if turns else [g.completion for g in gens],
        extra_columns(repeated),
        turns.completion_ids if turns else [g.completion_ids for g in gens],
        turns.messages if turns else None,
    )


def _mean_std(x: torch.Tensor) -> tuple[float, float]:
    """Mean and std of the scorable (non-NaN) values, 0 where there are too few."""
    x = x[~torch.isnan(x)]
    return (float(x.mean()) if len(x) else 0.0), (float(x.std()) if len(x) > 1 else 0.0)


def greedy_reward(
    engine, loop: TrainLoop, rewards: RewardSet, encode, rows: list[dict], greedy, tools: ToolRunner | None = None
) -> float:
    """The mean reward of greedy completions of the held-out prompts (unscorable ones left out)."""
    total, _ = held_out_rewards(engine, loop, rewards, encode, rows, greedy, tools=tools)
    return _mean_std(total)[0]


def sampled_rewards(run: GRPORun, rows: list[dict], sampling: SamplingParams, n: int) -> dict[str, float]:
    """TRL's evaluation: `n` completions of each held-out prompt, sampled with the training `sampling` (the same
    seed at every evaluation, so the points compare); reward (their mean), reward_std and rewards/<fn>/mean."""
    total, per_fn = held_out_rewards(
        run.engine, run.loop, run.rewards, run.encode_prompts, rows, sampling, n, run.tools, run.seed
    )
    out = dict(zip(("reward", "reward_std"), _mean_std(total), strict=True))
    for k, name in enumerate(run.rewards.names):
        out[f"rewards/{name}/mean"] = _mean_std(per_fn[:, k])[0]
    return out


RolloutFn = Callable[[GRPORun, list[dict]], tuple[GRPORollout, Samples]]
UpdateFn = Callable[[GRPORun, GRPORollout, list[int]], dict[str, torch.Tensor]]


def train_on_samples(
    name: str,
    rollout_fn: RolloutFn,
    update_fn: UpdateFn,
    cfg: GRPOConfig | RLOOConfig,
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
    """The loop GRPO and RLOO share: `num_generations` samples per prompt each new generation batch (`rollout_fn`),
    one optimizer step per `update_fn` on a part of it (`steps_per_rollout` parts, each `num_iterations` times),
    greedy held-out reward as eval/reward."""
    G = cfg.num_generations
    if cfg.batch_size % G:
        raise ValueError(f"batch_size ({cfg.batch_size}) must be a multiple of num_generations ({G})")
    seed = resolve_seed(cfg.seed, seed)
    rewards.probe([r["prompt"] for r in rows[:2]], extra_columns(rows[:2]))  # a broken reward fails before any rollout
    if getattr(cfg, "cast_lm_head_to_fp32", False):  # before the optimizer sees the head's weight
        for m in (model, ref_model):
            if m is not None:
                float32_head(m)
    loop = TrainLoop(
        name,
        cfg,
        model,
        rows,
        lambda b: b,
        tracker,
        output_dir,
        seed,
        rows_per_batch=cfg.batch_size // G,
        batches_per_step=cfg.micro_batches_per_generation,
        repeat=cfg.num_iterations * cfg.steps_per_rollout,
        collates=False,
    )
    if engine is None:  # the hf engine on the policy itself
        engine = hf_engine(cfg.rollout, loop.unwrapped, tokenizer)
    if cfg.beta and not cfg.lora and ref_model is None:
        raise ValueError("beta > 0 without LoRA needs `ref_model` (a frozen copy of the starting model)")
    ref = frozen_reference(ref_model, cfg, loop.accelerator.device) if (cfg.beta and not cfg.lora) else None
    synced(ref, cfg, loop)
    run = GRPORun(cfg, loop, tokenizer, rewards, engine, ref, seed)
    run.router = RouterLoss.of(loop.model, cfg.router_aux_loss_coef)
    if tools:
        run.tools = ToolRunner.for_model(
            tools, tokenizer, loop.unwrapped, cfg.tool_call_format, cfg.max_completion_length,
            cfg.max_tool_calling_iterations, chat_template_kwargs,
        )  # fmt: skip
    if isinstance(cfg, GRPOConfig) and cfg.entropy_bonus:
        acc = loop.accelerator
        reduce = (lambda t: acc.reduce(t, "sum")) if acc.num_processes > 1 else None
        run.entropy = EntropyControl(cfg, acc.device, reduce)
        run.entropy.load(loop.state)
        loop.checkpoint_state = run.entropy.state
    current: dict[str, Any] = {}

    def step(window: list[list[dict]]) -> dict:
        # A new generation batch (also when a run resumes between two of its steps, as TRL); it feeds
        # `steps_per_rollout` optimizer steps, each on its part, `num_iterations` times over.
        if loop.iteration == 0 or "batch" not in current:
            batch, sm = rollout_fn(run, [r for micro in window for r in micro])
            current.update(batch=batch, stats=batch.stats(rewards.names))
            log_samples(run, sm, batch.rewards, name)
        return {**update_fn(run, current["batch"], run.step_part(current["batch"])), **current["stats"]}

    def evaluate() -> dict[str, float]:
        if cfg.num_generations_eval:
            sampling = cfg.sampling.model_copy(update={"max_new_tokens": cfg.max_completion_length})
            return sampled_rewards(run, eval_rows or [], sampling, cfg.num_generations_eval)
        greedy = SamplingParams(temperature=0, max_new_tokens=cfg.max_completion_length)
        return {
            "reward": greedy_reward(engine, loop, rewards, run.encode_prompts, eval_rows or [], greedy, tools=run.tools)
        }

    result = loop.run(step, evaluate if eval_rows else None)
    result.model_dir, result.adapter = loop.save(tokenizer)
    return result
