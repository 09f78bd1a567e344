"""PPO for RLHF, following TRL's PPOTrainer (1.12's loop; 0.7's `PPOConfig` controls) and "The N+
implementation details of RLHF with PPO" (Huang et al., 2024).

One update: take `batch_size × accumulation × num_mini_batches` prompts (left-padded, so response
columns line up), sample one response each at `temperature`, truncate at the first EOS, then (no grad):
- log-probs of the policy and the reference (adapter-disabled policy with LoRA) at that temperature,
  masked to INVALID_LOGPROB after the response;
- values from the value model (a sequence classifier initialised from a reward model, its head read
  at every position);
- scores from the reward set on (prompt, response); `missing_eos_penalty` for responses without EOS; then
  optional running score scaling / normalisation and clipping (`use_score_scaling`, `use_score_norm`, `score_clip`).
Rewards per token: −kl_coef · `kl_penalty` (kl, abs, mse, k3 on the sampled token, or the full-distribution KL),
plus the score at the last response token. GAE(γ, λ) runs over the response's own tokens: the step after the
last one is terminal (nothing is bootstrapped from the padding after EOS), and reward whitening, advantage
whitening, the value loss and every per-token metric cover response tokens only. Then up to `num_ppo_epochs`
passes over shuffled mini-batches: clipped policy loss + vf_coef × clipped value loss (½ max of squared errors);
a micro-batch whose mean ratio passes `ratio_threshold` is skipped, and `early_stopping` ends the epochs once the
policy KL passes 1.5 × `target_kl`. After the batch, `adap_kl_ctrl` moves `kl_coef` toward `target`
(trainers/ppo_controls.py).

On an attention kernel that runs documents (`model.attention: varlen`, the default on a CUDA GPU, or flash-attn's)
every forward over episodes, the rollout's policy, reference and value passes (`kl_penalty: full`'s too) and each
epoch's micro-batch, runs padding-free: one row of documents, an episode each (`episode_layout`, from the rollout's
host token lists), so neither the prompts' left padding nor the padding after short responses is computed.

On several processes (DDP) each rank rolls out its own prompts and whitens its own advantages, as TRL does. Each
micro-batch's passes run inside the wrapper's forward (`PolicyAndValue.forward`), so both models' gradients are
all-reduced. The controls that act on a batch see every rank's statistics, so the ranks stay in step: the adaptive
KL coefficient, the running score moments, early stopping, and whether a mini-batch's optimizer step is taken.

Departures from TRL 1.12, both as TRL 0.7 and the N+ paper do: the score lands on the last response token
(1.12 added it one position later, `sequence_lengths + 1`, so λ discounted it), and that token is the last step
of the episode (1.12 treated the position after EOS as a real next step, bootstrapping from its value and
training that value toward 0).

Metrics (TRL 1.12's names, and TRL 0.7's for its controls): objective/kl, objective/kl_coef, objective/entropy, objective/non_score_reward,
objective/rlhf_reward, objective/scores (after the EOS penalty and scaling), objective/raw_scores (the reward
set's total), policy/approxkl_avg, policy/policykl_avg, policy/clipfrac_avg, loss/policy_avg, loss/value_avg,
val/clipfrac_avg, policy/entropy_avg, val/ratio, val/ratio_var, val/num_eos_tokens, policy/ppo_epochs,
policy/early_stopped, policy/skipped_batches, lr, episode, eps, rewards/<fn>/mean, and with score scaling
objective/score_running_{mean,std}.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import os
import re
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

from alignpipe import fused_kernels
from alignpipe.device_copies import to_device
from alignpipe.engine.factory import hf_engine
from alignpipe.judges.reward_set import RewardSet
from alignpipe.lean_activations import lean_activations
from alignpipe.logprobs import completion_hidden, decoder_hidden, full_kl, shared_prompt_logprobs, token_logprobs
from alignpipe.losses import policy_loss, value_loss
from alignpipe.modeling import mask_positions, under_attention_kernels
from alignpipe.packed_rows import body_hidden, pack_answers, runs, runs_documents
from alignpipe.rl_math import advantages_and_returns, kl_estimate, kl_rewards, masked_mean
from alignpipe.trainers.common import (
    TrainLoop,
    TrainResult,
    frozen_reference,
    lean_patched,
    mean_over_processes,
    pad_rows,
    resolve_seed,
    save_model,
    seed_everything,
)
from alignpipe.trainers.configs import PPOConfig
from alignpipe.trainers.online import extra_columns, print_samples, prompt_ids, sync_weights
from alignpipe.trainers.ppo_controls import (
    KLController,
    RunningMoments,
    ratio_exceeds,
    should_stop_early,
    transform_scores,
)

log = logging.getLogger(__name__)
INVALID_LOGPROB = 1.0


# --- models ---------------------------------------------------------------------------------------


class PolicyAndValue(nn.Module):
    """Both trained modules under one optimizer (as TRL's PolicyAndValueWrapper)."""

    def __init__(self, policy, value_model):
        super().__init__()
        self.policy = policy
        self.value_model = value_model

    def forward(self, passes: Callable[[PolicyAndValue], Any]) -> Any:
        """`passes(self)`: a micro-batch's policy and value passes, run as this module's forward. Under DDP the
        wrapper's own forward must run for the backward to all-reduce the gradients of both models; the passes still
        call the models' parts directly (the chunked LM head, padding-free documents). A closure, so that DDP has no
        arguments to walk and copy."""
        return passes(self)


def token_values(value_model, input_ids, attention_mask) -> torch.Tensor:
    """The value head applied at every position, (B, T)."""
    backbone = getattr(value_model, value_model.base_model_prefix)
    position_ids = mask_positions(attention_mask)
    hidden = backbone(
        input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False
    ).last_hidden_state
    return value_model.score(hidden).squeeze(-1).float()


def response_logprobs(
    policy,
    query,
    query_mask,
    response,
    temperature: float,
    chunk: int,
    with_entropy: bool = False,
    only: torch.Tensor | None = None,
    count: int | None = None,
    compiled: bool = False,
    packed: dict[str, Any] | None = None,
):
    """Log-probs (and entropies) of the response tokens, (B, R). `only` (B, R): the LM head runs on those tokens
    alone (0 elsewhere); `count`, their number counted on the host; `compiled`, the head's chunks compiled
    (`token_logprobs`). `packed`: the episodes padding-free (`episode_layout`), run as one row of documents where
    `policy`'s attention runs documents."""
    if runs(packed, policy):
        index = torch.arange(query.size(0), device=query.device)
        return shared_prompt_logprobs(
            policy,
            query,
            query_mask,
            response,
            index,
            temperature=temperature,
            chunk_tokens=chunk,
            with_entropy=with_entropy,
            only=only,
            count=count,
            compiled=compiled,
            packed=packed,
        )
    ids, mask = _episode(query, query_mask, response)
    return token_logprobs(
        policy,
        ids,
        mask,
        temperature=temperature,
        chunk_tokens=chunk,
        with_entropy=with_entropy,
        start=query.size(1) - 1,
        only=only,
        count=count,
        compiled=compiled,
    )


def response_hidden(policy, query, query_mask, response, packed: dict[str, Any] | None = None):
    """Decoder hidden states at the positions that score the response tokens, (B, R, d), and the LM head's weight
    and bias (`decoder_hidden`). `packed`: as `response_logprobs`'."""
    if runs(packed, policy):
        index = torch.arange(query.size(0), device=query.device)
        hidden, head = completion_hidden(policy, query, query_mask, response, index, packed=packed)
        if hidden is not None:
            return hidden, head.weight, getattr(head, "bias", None)
    ids, mask = _episode(query, query_mask, response)
    return decoder_hidden(policy, ids, mask, start=query.size(1) - 1)


def response_values(value_model, query, query_mask, response, packed: dict[str, Any] | None = None) -> torch.Tensor:
    """The value head at the positions that score each response token, (B, R) (the prompt's last position for
    token 0). `packed`: as `response_logprobs`'."""
    if packed is not None and runs(packed, value_model):
        hidden = body_hidden(getattr(value_model, value_model.base_model_prefix), packed)
        scoring = packed["scoring"]
        return value_model.score(hidden[0].index_select(0, scoring.flatten())).view(scoring.shape).float()
    ids, mask = _episode(query, query_mask, response)
    P = query.size(1)
    return token_values(value_model, ids, mask)[:, P - 1 : -1]


def episode_layout(
    prompts: list[list[int]], responses: list[list[int]], rows: list[int], width: int, device
) -> dict[str, Any] | None:
    """Episodes `rows` (prompt + response token lists, host) as one row of documents, one per episode
    (`packed_rows.pack_answers`, nothing shared: each prompt has one response), on `device`; `width`: the padded
    responses' length, which the scored positions are laid out to. None where a document would be empty."""
    chosen_prompts, chosen = [prompts[i] for i in rows], [responses[i] for i in rows]
    if not all(p or r for p, r in zip(chosen_prompts, chosen, strict=True)):
        return None
    return to_device(pack_answers(chosen_prompts, chosen, width, share=False), device)


def _episode(query, query_mask, response):
    return torch.cat([query, response], 1), torch.cat([query_mask, torch.ones_like(response)], 1)


# --- training -------------------------------------------------------------------------------------


@dataclass
class Rollout:
    """One batch of episodes and everything the PPO epochs read, (B, R) per token unless noted. R is the longest
    response; `response_mask` is true on each response's own tokens (through its EOS), false after."""

    query: torch.Tensor
    """Left-padded prompt ids (B, P)."""
    query_mask: torch.Tensor
    response: torch.Tensor
    """Right-padded response ids."""
    response_mask: torch.Tensor
    logprobs: torch.Tensor
    """Log-probs of the sampling policy (INVALID_LOGPROB after the response)."""
    ref_logprobs: torch.Tensor
    values: torch.Tensor
    """Value-head predictions (0 after the response)."""
    kl: torch.Tensor
    """The `kl_penalty` per token (0 after the response)."""
    advantages: torch.Tensor
    returns: torch.Tensor
    raw_scores: torch.Tensor
    """(B,) the reward set's total per episode, before the EOS penalty and score scaling."""
    scores: torch.Tensor
    """(B,) the scores that entered the rewards."""
    non_score: torch.Tensor
    """−kl_coef · kl per token."""
    kl_coef: float
    lengths: torch.Tensor
    """(B,) host ints: each response's tokens (`response_mask`'s count per row), counted without a device read."""
    prompt_tokens: list[list[int]] = field(default_factory=list, repr=False)
    """Each episode's prompt tokens (host, unpadded), for the padding-free layouts of `layout`; kept only where the
    policy's or the value model's attention runs documents (empty otherwise)."""
    response_tokens: list[list[int]] = field(default_factory=list, repr=False)
    """Each episode's response tokens through its EOS (host, `lengths` of them), kept as `prompt_tokens` is."""

    def layout(self, rows: list[int], device) -> dict[str, Any] | None:
        """Micro-batch `rows` padding-free (`episode_layout`), or None where no model runs documents."""
        if not self.response_tokens:
            return None
        return episode_layout(self.prompt_tokens, self.response_tokens, rows, self.response.size(1), device)


@dataclass
class PPORun:
    """What `rollout` and `update` read and move: the config, the accelerator, the policy + value module under one
    optimizer, the reference (a frozen copy, or the adapter-disabled policy under LoRA), the engine, and the KL and
    score controls."""

    cfg: PPOConfig
    acc: Any
    model: Any
    """The prepared `PolicyAndValue` (DDP-wrapped when several processes)."""
    optimizer: Any
    scheduler: Any
    tokenizer: Any
    rewards: RewardSet
    engine: Any
    ref: Any
    kl_ctl: KLController
    moments: RunningMoments | None
    seed: int
    count_generation: Callable[[float, int], None]
    """`TrainLoop.count_generation`: a rollout's generation time and sampled tokens, for the window's metrics."""
    count_sync: Callable[[float], None]
    """`TrainLoop.count_sync`: the time the policy's weights took to reach the engine, for the window's metrics."""

    @property
    def unwrapped(self) -> PolicyAndValue:
        return self.acc.unwrap_model(self.model)

    @property
    def temperature(self) -> float:
        return self.cfg.sampling.temperature or 1.0

    @property
    def mini_batch(self) -> int:
        return self.cfg.batch_size * self.cfg.gradient_accumulation_steps

    @property
    def rollout_size(self) -> int:
        return self.mini_batch * self.cfg.num_mini_batches

    def reference(self):
        """The reference model and the context it runs in."""
        if self.ref is not None:
            return self.ref, contextlib.nullcontext()
        return self.unwrapped.policy, self.unwrapped.policy.disable_adapter()

    def score_episodes(
        self, q, qm, r, only: torch.Tensor | None = None, count: int | None = None, packed: dict | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """(logprobs, ref_logprobs, full-distribution KL or None) of a slice of episodes; the log-probs on the
        response tokens `only` alone (`response_logprobs`), 0 after them; `packed`: the slice padding-free
        (`episode_layout`), for the models whose attention runs documents."""
        cfg, policy = self.cfg, self.unwrapped.policy
        ref_model, ref_ctx = self.reference()
        chunk = cfg.logprob_chunk_tokens
        kernels = fused_kernels.wanted(cfg.fused_kernels, q.device)  # the head's chunks by hand or compiled on a GPU
        if cfg.kl_penalty == "full":
            hidden, *head = response_hidden(policy, q, qm, r, packed)
            with ref_ctx:
                ref_hidden, *ref_head = response_hidden(ref_model, q, qm, r, packed)
            return full_kl(
                hidden, tuple(head), ref_hidden, tuple(ref_head), r, self.temperature, chunk, compiled=kernels
            )
        options: dict[str, Any] = dict(only=only, count=count, compiled=kernels, packed=packed)
        lp = response_logprobs(policy, q, qm, r, self.temperature, chunk, **options)
        with ref_ctx:
            ref_lp = response_logprobs(ref_model, q, qm, r, self.temperature, chunk, **options)
        return lp, ref_lp, None


@torch.no_grad()
def rollout(run: PPORun, batch_rows: list[dict], update_index: int) -> tuple[Rollout, list, torch.Tensor]:
    """Sample one response per prompt, score it (reward set, EOS penalty, score scaling), take the policy's,
    reference's and value model's view of every token, and turn it into per-token rewards, advantages and returns.
    Returns the rollout, the generations and each reward function's scores."""
    cfg, device, tok = run.cfg, run.acc.device, run.tokenizer
    unwrapped = run.unwrapped
    prompts = prompt_ids(tok, batch_rows, cfg.max_prompt_length)
    sync_weights(run.engine, unwrapped.policy, run.count_sync)
    sampling = cfg.sampling.model_copy(update={"max_new_tokens": cfg.max_completion_length})
    started = time.perf_counter()
    gens = run.engine.generate(prompts, 1, sampling, seed=run.seed + update_index)
    run.count_generation(time.perf_counter() - started, sum(len(g.completion_ids) for g in gens))
    query, query_mask = pad_rows(prompts, tok.pad_token_id, left=True)
    response, _ = pad_rows([g.completion_ids for g in gens], tok.pad_token_id)
    lengths = torch.tensor([max(1, len(g.completion_ids)) for g in gens])
    padding_free = runs_documents(unwrapped.policy) or runs_documents(unwrapped.value_model)
    # host token lists for the padding-free layouts, through each EOS; SDPA runs build none
    responses = [row[:n] for row, n in zip(response.tolist(), lengths.tolist(), strict=True)] if padding_free else []
    query, query_mask, response = to_device((query, query_mask, response), device)
    total, per_fn = run.rewards(
        [r["prompt"] for r in batch_rows],
        [g.completion for g in gens],
        extra_columns(batch_rows),
        [g.completion_ids for g in gens],
    )
    raw_scores = torch.nan_to_num(total, nan=0.0).to(device)
    scores = raw_scores.clone()
    if cfg.missing_eos_penalty is not None:
        scores[~torch.tensor([g.finish_reason == "stop" for g in gens], device=device)] -= cfg.missing_eos_penalty
    everyone = run.acc.gather(scores) if run.moments is not None else None  # one process: `scores` itself
    scores = transform_scores(scores, run.moments, cfg.use_score_norm, cfg.score_clip, everyone)
    unwrapped.eval()
    last = (lengths - 1).to(device)
    padding = torch.arange(response.size(1), device=device).unsqueeze(0) > last.unsqueeze(1)
    lp_parts, ref_parts, kl_parts, value_parts = [], [], [], []
    for s in range(0, len(gens), cfg.batch_size):
        sl = slice(s, s + cfg.batch_size)
        count = int(lengths[sl].sum())  # host ints
        rows = list(range(len(gens)))[sl]
        packed = episode_layout(prompts, responses, rows, response.size(1), device) if padding_free else None
        lp, ref_lp, full = run.score_episodes(query[sl], query_mask[sl], response[sl], ~padding[sl], count, packed)
        lp_parts.append(lp)
        ref_parts.append(ref_lp)
        if full is not None:
            kl_parts.append(full)
        value_parts.append(response_values(unwrapped.value_model, query[sl], query_mask[sl], response[sl], packed))
    logprobs = torch.cat(lp_parts).float().masked_fill(padding, INVALID_LOGPROB)
    ref_logprobs = torch.cat(ref_parts).float().masked_fill(padding, INVALID_LOGPROB)
    values = torch.cat(value_parts).masked_fill(padding, 0)
    kl = (torch.cat(kl_parts).float() if kl_parts else kl_estimate(logprobs, ref_logprobs, cfg.kl_penalty)).masked_fill(
        padding, 0
    )
    token_rewards, non_score = kl_rewards(scores, kl, last, run.kl_ctl.value)
    advantages, returns = advantages_and_returns(
        token_rewards, values, ~padding, cfg.gamma, cfg.lam, cfg.whiten_rewards
    )
    batch = Rollout(
        query=query,
        query_mask=query_mask,
        response=response,
        response_mask=~padding,
        logprobs=logprobs,
        ref_logprobs=ref_logprobs,
        values=values,
        kl=kl,
        advantages=advantages,
        returns=returns,
        raw_scores=raw_scores,
        scores=scores,
        non_score=non_score.masked_fill(padding, 0),
        kl_coef=run.kl_ctl.value,
        lengths=lengths,
        prompt_tokens=prompts if padding_free else [],
        response_tokens=responses,
    )
    return batch, gens, per_fn


EPOCH_STATS = ("approxkl", "policykl", "clipfrac", "pg_loss", "vf_loss", "vf_clipfrac", "entropy", "ratio")


def update(run: PPORun, b: Rollout) -> dict[str, float]:
    """Up to `num_ppo_epochs` passes over shuffled mini-batches of the rollout, one optimizer step per mini-batch;
    a micro-batch over `ratio_threshold` is skipped, and `early_stopping` ends the passes. The statistics stay on
    the device and are read once, at the end (`_epochs` reads nothing unless those two opt-in controls ask).
    Returns the epoch metrics."""
    # on the host, as the lengths they pick: each micro-batch's token count is a host sum
    orders = [torch.randperm(run.rollout_size).tolist() for _ in range(run.cfg.num_ppo_epochs)]
    stats, skipped, epochs_run, stopped = _epochs(run, b, b.lengths.tolist(), orders)
    ratios = torch.stack(stats["ratio"])
    means = torch.stack(
        [torch.stack(v).mean() for v in stats.values()]
        + [ratios.var() if len(ratios) > 1 else torch.zeros((), device=ratios.device)]
    ).tolist()
    avg = dict(zip([*EPOCH_STATS, "ratio_var"], means))
    return {
        "policy/approxkl_avg": avg["approxkl"],
        "policy/policykl_avg": avg["policykl"],
        "policy/clipfrac_avg": avg["clipfrac"],
        "loss/policy_avg": avg["pg_loss"],
        "loss/value_avg": avg["vf_loss"],
        "val/clipfrac_avg": avg["vf_clipfrac"],
        "policy/entropy_avg": avg["entropy"],
        "val/ratio": avg["ratio"],
        "val/ratio_var": avg["ratio_var"],
        "policy/ppo_epochs": float(epochs_run),
        "policy/early_stopped": float(stopped),
        "policy/skipped_batches": float(skipped),
    }


def _passes(
    run: PPORun, b: Rollout, ix, mask, count: int, packed, m: PolicyAndValue
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A micro-batch's (log-probs, entropies, values) of episodes `ix`, by the unwrapped module `m`: the LM head runs on
    the `mask`ed response tokens alone (`count` of them), not on the padding after short responses; on the
    hand-written head kernels under `fused_kernels` on a GPU."""
    q, qm, r = b.query[ix], b.query_mask[ix], b.response[ix]
    lp, entropy = response_logprobs(
        m.policy, q, qm, r, run.temperature, run.cfg.logprob_chunk_tokens, with_entropy=True, only=mask, count=count,
        packed=packed, compiled=fused_kernels.wanted(run.cfg.fused_kernels, q.device),
    )  # fmt: skip
    vpred = response_values(m.value_model, q, qm, r, packed)
    return lp.float().masked_fill(~mask, INVALID_LOGPROB), entropy, vpred.masked_fill(~mask, 0)


def _epochs(
    run: PPORun, b: Rollout, lengths: list[int], orders: list[list[int]]
) -> tuple[dict[str, list[torch.Tensor]], int, int, bool]:
    """`update`'s passes: (the statistics per micro-batch as device tensors, skipped micro-batches, epochs run,
    whether early stopping ended them). `lengths`: each episode's response tokens, and `orders`: each epoch's
    shuffle of the episodes, host ints, so each micro-batch's token count is known without a device read."""
    cfg, acc, model, unwrapped = run.cfg, run.acc, run.model, run.unwrapped
    unwrapped.train()
    stats: dict[str, list[torch.Tensor]] = {k: [] for k in EPOCH_STATS}
    skipped, epochs_run, stopped = 0, 0, False
    for epoch in range(cfg.num_ppo_epochs):
        perm = orders[epoch]
        for m0 in range(0, run.rollout_size, run.mini_batch):
            mb = perm[m0 : m0 + run.mini_batch]
            skipped_here = 0
            for j, s in enumerate(range(0, run.mini_batch, cfg.batch_size)):
                rows = mb[s : s + cfg.batch_size]
                ix = to_device(torch.tensor(rows), acc.device)
                mask = b.response_mask[ix]
                packed = b.layout(rows, acc.device)
                sync = j == cfg.gradient_accumulation_steps - 1
                with contextlib.nullcontext() if sync else acc.no_sync(model):
                    count = sum(lengths[i] for i in rows)
                    new_lp, entropy, vpred = model(functools.partial(_passes, run, b, ix, mask, count, packed))
                    pl = policy_loss(new_lp, b.logprobs[ix], b.advantages[ix], mask, cfg.cliprange)
                    vf, vf_clipfrac = value_loss(vpred, b.values[ix], b.returns[ix], mask, cfg.cliprange_value)
                    loss = pl.loss + cfg.vf_coef * vf
                    if ratio_exceeds(pl.ratio.detach(), mask, cfg.ratio_threshold):
                        loss = loss * 0.0  # backward still runs, so processes stay in step
                        skipped_here += 1
                    acc.backward(loss / cfg.gradient_accumulation_steps)
                for k, v in zip(
                    EPOCH_STATS,
                    (
                        pl.approxkl,
                        pl.policykl,
                        pl.clipfrac,
                        pl.loss,
                        vf,
                        vf_clipfrac,
                        masked_mean(entropy, mask),
                        masked_mean(pl.ratio, mask),
                    ),
                ):
                    stats[k].append(v.detach())
            skipped += skipped_here
            if _trained_anywhere(acc, cfg.gradient_accumulation_steps - skipped_here, cfg.ratio_threshold):
                if cfg.max_grad_norm:
                    acc.clip_grad_norm_(model.parameters(), cfg.max_grad_norm)
                run.optimizer.step()
            with (
                warnings.catch_warnings()
            ):  # a skipped first step: torch warns that the schedule ran before the optimizer
                warnings.filterwarnings(
                    "ignore", re.escape("Detected call of `lr_scheduler.step()` before"), UserWarning
                )
                run.scheduler.step()
            run.optimizer.zero_grad(set_to_none=True)
        epochs_run = epoch + 1
        # every process decides on the mean of the processes' KLs (TRL 0.7's all-reduce): they stop together
        policy_kl = mean_over_processes(acc, stats["policykl"][-1]) if cfg.early_stopping else 0.0
        if cfg.early_stopping and should_stop_early(policy_kl, cfg.target_kl):
            stopped = True
            log.info(
                "ppo: early stop after epoch %d/%d (policy KL %.4g > 1.5 × target_kl %g)",
                epochs_run,
                cfg.num_ppo_epochs,
                policy_kl,
                cfg.target_kl,
            )
            for _ in range((cfg.num_ppo_epochs - epochs_run) * cfg.num_mini_batches):
                run.scheduler.step()  # the schedule stays on time with the updates
            break
    return stats, skipped, epochs_run, stopped


def _trained_anywhere(acc, trained_here: int, ratio_threshold: float | None) -> bool:
    """Whether a mini-batch takes its optimizer step: where some micro-batch trained, on this process or, under DDP,
    on any other (the all-reduced gradient then holds its share everywhere, and every process steps, as one process
    would on the whole mini-batch). Only `ratio_threshold` skips micro-batches, so only it asks the other processes."""
    if ratio_threshold is None or acc.num_processes == 1:
        return trained_here > 0
    return mean_over_processes(acc, float(trained_here)) > 0


def batch_metrics(run: PPORun, b: Rollout, per_fn: torch.Tensor) -> dict[str, float]:
    """The rollout's objective metrics (TRL's names): KL and non-score reward summed over a response and averaged,
    scores, entropy, EOS count, rewards per function, the running score statistics with score scaling."""
    mean_non_score = float(b.non_score.sum(1).mean())
    out = {
        "objective/kl": float(b.kl.sum(1).mean()),
        "objective/kl_coef": b.kl_coef,
        "objective/entropy": float((-b.logprobs.masked_fill(~b.response_mask, 0)).sum(1).mean()),
        "objective/non_score_reward": mean_non_score,
        "objective/rlhf_reward": mean_non_score + float(b.scores.mean()),
        "objective/scores": float(b.scores.mean()),
        "objective/raw_scores": float(b.raw_scores.mean()),
        "val/num_eos_tokens": float((b.response == run.tokenizer.eos_token_id).sum()),
    }
    if run.moments is not None:
        out |= {
            "objective/score_running_mean": float(run.moments.mean),
            "objective/score_running_std": float(run.moments.std),
        }
    for j, fn_name in enumerate(run.rewards.names):
        col = per_fn[:, j][~torch.isnan(per_fn[:, j])]
        out[f"rewards/{fn_name}/mean"] = float(col.mean()) if len(col) else 0.0
    return out


@under_attention_kernels
def train(
    cfg: PPOConfig,
    policy,
    value_model,
    tokenizer,
    rows: list[dict],
    rewards: RewardSet,
    tracker,
    output_dir: str | Path,
    seed: int = 0,
    ref_model=None,
    engine=None,
) -> TrainResult:
    from alignpipe.modeling import enable_activation_checkpointing, lora_model

    seed = resolve_seed(cfg.seed, seed)
    seed_everything(seed)  # before the adapters' initialisation
    rewards.probe([r["prompt"] for r in rows[:2]], extra_columns(rows[:2]))
    if cfg.gradient_checkpointing:
        enable_activation_checkpointing(policy, cfg.checkpoint_every_n_layers)
    if cfg.lora:
        policy = lora_model(policy, cfg.lora)
    elif ref_model is None:
        raise ValueError("full-model PPO needs `ref_model` (a frozen copy of the starting policy)")
    if lean_patched(cfg):  # as `TrainLoop` patches the other stages' models, and `frozen_reference` the reference
        for model in (policy, value_model):
            lean_activations(model, fused=cfg.fused_kernels)
    value_model.config.pad_token_id = tokenizer.pad_token_id
    rollout_size = cfg.batch_size * cfg.gradient_accumulation_steps * cfg.num_mini_batches  # per process
    # Every update takes a whole rollout batch on each process; a split smaller than that is cycled to fill it.
    everywhere = rollout_size * int(os.environ.get("WORLD_SIZE", "1"))  # the launcher's; no accelerator yet
    examples = rows * math.ceil(everywhere / len(rows)) if rows and len(rows) < everywhere else rows
    loop = TrainLoop(
        "ppo",
        cfg,
        PolicyAndValue(policy, value_model),
        examples,
        lambda b: b,
        tracker,
        output_dir,
        seed,
        rows_per_batch=rollout_size,
        batches_per_step=1,
        updates_per_step=cfg.num_ppo_epochs * cfg.num_mini_batches,
        adapt_model=False,
        drop_last=True,
        metric_prefix="",
        summary_keys=("objective/scores", "objective/rlhf_reward", "objective/kl", "objective/kl_coef"),
        collates=False,
    )
    acc = loop.accelerator
    kl_ctl = KLController(cfg.kl_coef, cfg.adap_kl_ctrl, cfg.target, cfg.horizon)
    moments = RunningMoments() if cfg.use_score_scaling else None
    if loop.state:
        kl_ctl.load_state_dict(loop.state.get("kl_ctl", kl_ctl.state_dict()))
        if moments is not None and "score_moments" in loop.state:
            moments.load_state_dict(loop.state["score_moments"])
    loop.checkpoint_state = lambda: {
        "kl_ctl": kl_ctl.state_dict(),
        **({"score_moments": moments.state_dict()} if moments else {}),
    }
    ref = frozen_reference(ref_model, cfg, acc.device) if not cfg.lora else None
    if engine is None:  # the hf engine on the policy itself
        engine = hf_engine(cfg.rollout, acc.unwrap_model(loop.model).policy, tokenizer)
    run = PPORun(
        cfg,
        acc,
        loop.model,
        loop.optimizer,
        loop.scheduler,
        tokenizer,
        rewards,
        engine,
        ref,
        kl_ctl,
        moments,
        seed,
        loop.count_generation,
        loop.count_sync,
    )

    def step(window: list[list[dict]]) -> dict[str, float]:
        t0 = time.perf_counter()
        batch_rows = window[0]
        update_index = loop.step + 1
        b, gens, per_fn = rollout(run, batch_rows, loop.step)
        loop.count(b.response_mask.sum() + b.query_mask.sum(), len(batch_rows))
        metrics = batch_metrics(run, b, per_fn) | update(run, b)
        if kl_ctl.adaptive:  # every process moves its coefficient by the KL of all the processes' episodes
            kl_ctl.update(mean_over_processes(acc, metrics["objective/kl"]), rollout_size * acc.num_processes)
        metrics |= {
            "eps": rollout_size / (time.perf_counter() - t0),  # this process's; summed over processes at a log point
            "episode": float(update_index * rollout_size * acc.num_processes),
        }
        if acc.is_main_process and update_index % cfg.sample_every == 0:
            table = [
                {"prompt": r["prompt"], "completion": g.completion, "reward": float(sc)}
                for r, g, sc in zip(batch_rows[:8], gens[:8], b.scores[:8])
            ]
            tracker.log_table(table, f"samples/update_{update_index:06d}")
            print_samples(table, f"ppo samples at update {update_index}")
        return metrics

    result = loop.run(step)
    out = Path(output_dir) / "model"
    result.adapter = save_model(acc, run.unwrapped.policy, tokenizer, out)
    return result
