"""Direct Preference Optimization, following the design of TRL's DPOTrainer.

Data: `preference` rows (prompt, chosen, rejected). Prompt tokens (left-truncated to
`max_prompt_length`) + completion tokens + EOS, the whole truncated to `max_length`. Chosen and
rejected of a batch go through the policy in one forward pass that runs each prompt once (its KV cache
shared by both answers); a sequence's log-prob is the sum over its completion tokens, computed in
chunks (no full (B, T, V) logits).

With ρ = (log π(y_c) − log π_ref(y_c)) − (log π(y_r) − log π_ref(y_r)):
- sigmoid (DPO): −(1−ε) log σ(βρ) − ε log σ(−βρ), ε = `label_smoothing` (cDPO; TRL ≤ 0.x's formula)
- ipo (IPO): (ρ̄ − 1/(2β))², ρ̄ using per-token averaged log-ratios (as TRL)
- hinge (SLiC): max(0, 1 − βρ)
- and TRL 1.16's other pair losses (`losses.dpo_loss`), or a weighted sum of several (`loss_type` list,
  `loss_weights`; MPO), the log-ratios mapped by an f-divergence (`f_divergence_type`)
- + `rpo_alpha` (or an `sft` entry of the list) · NLL of the chosen completion tokens (RPO; TRL's `sft` loss term)
- `ld_alpha` (LD-DPO): the tokens past the shorter answer's length weigh α in every sequence log-prob
- `reference_free`: π_ref ≡ 1 (log π_ref = 0)

Reference model: with LoRA, the policy with its adapter disabled (no second copy); otherwise a frozen
copy passed in as `ref_model`; or, with `precompute_ref_logps`, log-probs computed once before the
first step and cached in `<output_dir>/ref_logps.pt` (reused by a re-run, checked by a content key).

Metrics (TRL's names): loss, rewards/chosen, rewards/rejected, rewards/accuracies, rewards/margins,
logps/chosen, logps/rejected (under train/ and eval/).

Entry point: `train(cfg, model, tokenizer, train_rows, eval_rows, tracker, output_dir, seed, ref_model=None)`.
"""

from __future__ import annotations

import contextlib
import logging
from pathlib import Path
from typing import Any

import torch

from alignpipe import fused_kernels, logprobs
from alignpipe.device_copies import to_device
from alignpipe.fused_kernels import loss_kernels
from alignpipe.linear_sequence_loss import linear_sequence_loss
from alignpipe.logprobs import completion_hidden, output_vocab, scored_index, shared_prompt_logprobs
from alignpipe.losses import dpo_loss, length_desensitized
from alignpipe.modeling import under_attention_kernels
from alignpipe.moe import RouterLoss, RouterTotals, answer_masks, recording
from alignpipe.packed_rows import layout, pack_answers, runs
from alignpipe.special_tokens import encode, with_eos
from alignpipe.trainers.common import (
    TrainLoop,
    TrainResult,
    accumulate,
    frozen_reference,
    pad_rows,
    resolve_seed,
)
from alignpipe.trainers.configs import DPOConfig
from alignpipe.trainers.ref_cache import cached_reference_logps
from alignpipe.trainers.ref_sync import synced

log = logging.getLogger(__name__)


def tokenize(rows: list[dict], tokenizer, max_length: int, max_prompt_length: int | None = None) -> list[dict]:
    if not rows:
        return []
    eos = tokenizer.eos_token_id
    prompts = encode(tokenizer, [r.get("prompt", "") for r in rows])
    chosen = tokenizer([r["chosen"] for r in rows], add_special_tokens=False)["input_ids"]
    rejected = tokenizer([r["rejected"] for r in rows], add_special_tokens=False)["input_ids"]
    out = []
    for p, c, r in zip(prompts, chosen, rejected):
        if max_prompt_length:
            p = p[-max_prompt_length:]
        out.append(
            {"prompt_ids": p, "chosen_ids": with_eos(c, eos, tokenizer), "rejected_ids": with_eos(r, eos, tokenizer)}
        )
    return out


def collate(
    examples: list[dict],
    pad_id: int,
    max_length: int,
    keys: tuple[str, ...] = ("chosen_ids", "rejected_ids"),
    packed: str | None = None,
) -> dict[str, Any]:
    """A batch of B pairs, each prompt + answer cut to `max_length` tokens, in two layouts:
    - what the policy runs (`completion_logps`): `prompt_ids`/`prompt_mask` (B, P), left-padded, once per pair,
      and `completion_ids`/`completion_tokens` (2B, C), every chosen answer then every rejected one, right-padded;
      `completion_tokens` marks the scored tokens;
    - whole rows as TRL builds them (what the TRL parity test compares, and the token count): `input_ids`,
      `attention_mask`, `completion_mask` (2B, T), chosen rows then rejected rows, right-padded.
    `keys` names the answers of each prompt (KTO: its completion, and the completion its KL estimate pairs it with).
    `prompts_nonempty` (a host bool) tells the shared-prompt path whether it may run without reading the mask, and
    `scored_per_row` (host ints, one per answer row) lets the LM head gather the scored tokens without counting them
    on the device. With `packed` (`packed_rows.layout` of the model: "shared" or "documents"), also `packed`: the
    rows as one row of documents, no padding, each prompt once for its answers where "shared"
    (`packed_rows.pack_answers`), which the policy and reference then run."""
    prompts = [e["prompt_ids"][:max_length] for e in examples]
    seqs, comp, answers = [], [], []
    for key in keys:
        for e, prompt in zip(examples, prompts):
            answers.append(e[key][: max_length - len(prompt)])
            seqs.append(prompt + answers[-1])
            comp.append([0] * len(prompt) + [1] * len(answers[-1]))
    input_ids, attention = pad_rows(seqs, pad_id)
    completion, _ = pad_rows(comp, 0)
    prompt_ids, prompt_mask = pad_rows(prompts, pad_id, left=True)
    completion_ids, completion_tokens = pad_rows(answers, pad_id)
    for i, e in enumerate(examples * len(keys)):
        if not e["prompt_ids"]:  # nothing before the answer scores its first token (as in the whole row)
            completion_tokens[i, :1] = 0
    batch = {
        "scored_per_row": completion_tokens.sum(1).tolist(),
        "input_ids": input_ids,
        "attention_mask": attention,
        "completion_mask": completion,
        "prompt_ids": prompt_ids,
        "prompt_mask": prompt_mask,
        "completion_ids": completion_ids,
        "completion_tokens": completion_tokens,
        "prompts_nonempty": all(prompts),
    }
    if packed:
        batch["packed"] = pack_answers(prompts, answers, completion_ids.size(1), share=packed == "shared")
    if "ref_chosen_logps" in examples[0]:
        batch["ref_chosen_logps"] = torch.tensor([e["ref_chosen_logps"] for e in examples])
        batch["ref_rejected_logps"] = torch.tensor([e["ref_rejected_logps"] for e in examples])
    return batch


def packed_layout(model, batch: dict) -> dict | None:
    """The batch's padding-free rows where `collate` made them and `model` runs documents (a policy and its
    reference run one attention kernel, but a caller's other model need not)."""
    packed = batch.get("packed")
    return packed if runs(packed, model) else None


def completion_logps(model, batch: dict, compiled: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(summed completion log-probs (kB,), per-token log-probs (kB, C), completion token mask (kB, C)) for the k
    answers of each of B prompts. Each prompt runs once for all its answers (`shared_prompt_logprobs`); the LM head
    runs on answer tokens only (`compiled`: its chunks compiled, with gradients on)."""
    per_token, mask = _completion_scores(model, batch, compiled, False)
    return (per_token * mask).sum(1), per_token, mask


def wpo_weights(model, batch: dict, compiled: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The per-token log-probs (kB, C) and completion mask of `completion_logps`, and WPO's weights (Zhou et al. 2024;
    TRL's `use_weighting`) from the policy's per-token log Σ p² of the same pass: each pair's exp(mean over the chosen
    answer's tokens of log p − log Σp²) times the same of the rejected answer, detached, (B,)."""
    (per_token, log_sum_sq), mask = _completion_scores(model, batch, compiled, "log_sum_sq")
    with torch.no_grad():
        aligned = ((per_token - log_sum_sq) * mask).sum(1) / mask.sum(1).clamp(min=1)
        chosen, rejected = aligned.exp().chunk(2)
    return per_token, mask, chosen * rejected


def _completion_scores(model, batch: dict, compiled: bool, with_entropy):
    """`shared_prompt_logprobs` over a collated batch's answers (with its second statistic when asked), and the
    completion token mask in the log-probs' dtype."""
    mask = batch["completion_tokens"]
    pairs = batch["prompt_ids"].size(0)
    index = torch.arange(mask.size(0), device=mask.device) % pairs
    per_token = shared_prompt_logprobs(
        model,
        batch["prompt_ids"],
        batch["prompt_mask"],
        batch["completion_ids"],
        index,
        only=mask.bool(),
        prompts_nonempty=batch.get("prompts_nonempty"),
        compiled=compiled,
        count=sum(batch["scored_per_row"]) if "scored_per_row" in batch else None,
        packed=packed_layout(model, batch),
        with_entropy=with_entropy,
    )
    logps = per_token[0] if with_entropy else per_token
    return per_token, mask.to(logps.dtype)


def fused_pair_loss(model, batch: dict, losses_of, cfg: DPOConfig):
    """(loss, chosen S (B,), rejected S (B,), RPO's NLL or None) with the LM head's gradients formed in the forward
    (`fused_answers_loss`, each chosen answer with its rejected one); S detached. `losses_of(chosen, rejected,
    pairs)` is `dpo_loss` on those pairs. None where the fused head cannot run or need not (`fused_answers_loss`):
    the caller then takes `completion_logps`."""
    rows = batch.get("scored_per_row")
    if rows is None or cfg.ld_alpha is not None or cfg.use_weighting:
        return None  # LD-DPO weighs tokens within a completion, WPO needs log Σp² per token: the chunked head
    B = batch["prompt_ids"].size(0)
    chosen_tokens = sum(rows[:B])

    def group_loss(sums: torch.Tensor, group_rows: torch.Tensor) -> torch.Tensor:
        # the group is its pairs' rows, chosen then rejected, pair after pair: the chosen rows number the pairs (a
        # device index, as the rows are: a host list would be copied to the device with a wait, at every group)
        pairs = group_rows[0::2]
        loss = losses_of(sums[0::2], sums[1::2], pairs)[0].sum() / B
        if cfg.nll_weight is not None:
            loss = loss - cfg.nll_weight * sums[0::2].sum() / chosen_tokens
        return loss

    kernels = loss_kernels(cfg, batch["prompt_ids"].device)
    fused = fused_answers_loss(model, batch, [[i, B + i] for i in range(B)], group_loss, kernels)
    if fused is None:
        return None
    loss, sums = fused
    chosen, rejected = sums.chunk(2)
    nll = -chosen.sum() / chosen_tokens if cfg.nll_weight is not None else None  # inside `loss`, reported apart
    return loss, chosen, rejected, nll


def fused_answers_loss(model, batch: dict, units: list[list[int]], group_loss, compiled: bool = False):
    """(loss, S (rows,) detached) of a collated batch's answers (`completion_ids` rows, each answering prompt
    row % B) with the LM head's gradients formed in the forward (`linear_sequence_loss`). `units` are the answer
    rows one term of the loss couples (DPO: a chosen answer and its rejected one; KTO: one answer); units are
    grouped up to `FUSED_GROUP_MAX` logits, and `group_loss(S of a group's rows, those rows)` is the group's share
    of the loss, its rows being its units' rows, unit after unit (a long tensor on the device). None where it cannot run (no host token counts,
    a head that runs only inside the forward, a unit over the budget) or need not (logits small enough for the head
    to run in one piece and keep them for backward, which costs the same 3 matmuls)."""
    rows = batch.get("scored_per_row")
    if rows is None:
        return None
    unit_tokens = [sum(rows[r] for r in unit) for unit in units]
    vocab = output_vocab(model)
    if vocab is None or max(unit_tokens, default=0) * vocab > FUSED_GROUP_MAX:
        return None
    if sum(rows) * vocab <= logprobs.WHOLE_LOGITS_MAX:  # the head in one piece keeps its logits: 3 matmuls already
        return None
    mask = batch["completion_tokens"]
    index = torch.arange(mask.size(0), device=mask.device) % batch["prompt_ids"].size(0)
    hidden, head = completion_hidden(
        model,
        batch["prompt_ids"],
        batch["prompt_mask"],
        batch["completion_ids"],
        index,
        batch.get("prompts_nonempty"),
        packed_layout(model, batch),
    )
    if hidden is None:
        return None
    groups: list[list[int]] = [[]]
    budget = max(FUSED_GROUP_MAX // 4, max(unit_tokens, default=0) * vocab)  # whole small batches in one group
    held = 0
    for unit, n in zip(units, unit_tokens, strict=True):
        if groups[-1] and (held + n) * vocab > budget:
            groups.append([])
            held = 0
        groups[-1].extend(unit)
        held += n
    flat = scored_index(mask, sum(rows))
    return linear_sequence_loss(
        hidden.flatten(0, 1).index_select(0, flat),
        head.weight,
        getattr(head, "bias", None),
        batch["completion_ids"].flatten().index_select(0, flat),
        rows,
        groups,
        group_loss,
        compiled=compiled,
    )


def batch_answer_masks(batch: dict, router: RouterLoss | None) -> tuple:
    """The real-token masks of a collated batch's answer forwards (`moe.answer_masks`; answer row r answers prompt
    r % prompts), for an MoE policy's load-balancing loss; none without one."""
    if router is None:
        return ()
    mask = batch["completion_tokens"]
    index = torch.arange(mask.size(0), device=mask.device) % batch["prompt_ids"].size(0)
    return answer_masks(batch["prompt_mask"], mask, index)


class _Reference:
    """Reference log-probs for a batch: precomputed, adapter-disabled policy, frozen copy, or none."""

    def __init__(self, cfg: DPOConfig, loop: TrainLoop, ref_model):
        self.cfg, self.loop = cfg, loop
        self.model = frozen_reference(ref_model, cfg, loop.accelerator.device) if ref_model is not None else None

    def _context(self):
        if self.model is None and hasattr(self.loop.unwrapped, "disable_adapter"):
            return self.loop.unwrapped.disable_adapter()
        return contextlib.nullcontext()

    def compute(self, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
        if self.cfg.reference_free:
            zeros = torch.zeros(batch["prompt_ids"].shape[0], device=batch["prompt_ids"].device)
            return zeros, zeros
        if "ref_chosen_logps" in batch:
            return batch["ref_chosen_logps"], batch["ref_rejected_logps"]
        model = self.model if self.model is not None else self.loop.model
        # the LM head's chunks compiled on a GPU
        kernels = fused_kernels.wanted(self.cfg.fused_kernels, batch["prompt_ids"].device)
        with fused_kernels.without_grad(kernels, model), self._context():
            logps, per_token, mask = completion_logps(model, batch, compiled=kernels)
            if self.cfg.ld_alpha is not None:
                logps = length_desensitized(per_token, mask, self.cfg.ld_alpha)
        chosen, rejected = logps.clone().chunk(2)  # cloned: an inference tensor is one the loss may not save
        return chosen, rejected

    def precompute(self, splits: dict[str, list[dict]], collate_fn, path: Path) -> None:
        """Fill `ref_chosen_logps`/`ref_rejected_logps` into every example, from the cache when it matches."""
        cached_reference_logps(
            splits,
            lambda e: [e["prompt_ids"], e["chosen_ids"], e["rejected_ids"]],
            ("ref_chosen_logps", "ref_rejected_logps"),
            self.compute,
            collate_fn,
            self.loop,
            path,
            can_recompute=self.model is not None or hasattr(self.loop.unwrapped, "disable_adapter"),
        )
        self.model = None  # the reference is no longer needed in memory


# The most float32 logits values a group of pairs of the fused loss holds at once (1 GB); a larger pair takes the
# chunked head.
FUSED_GROUP_MAX = 2**28


def batch_loss(model, batch: dict, reference_logps, cfg: DPOConfig) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Loss and metrics (device tensors) of one (2B, T) batch; `reference_logps(batch) -> (ref_chosen, ref_rejected)`.
    With `fused_loss` the LM head forms its gradients in the forward (`fused_pair_loss`), else it runs in chunks
    recomputed in backward (`completion_logps`)."""
    ref_chosen, ref_rejected = reference_logps(batch)
    lengths = batch["completion_tokens"].sum(1).to(ref_chosen.dtype).chunk(2)

    def losses_of(chosen, rejected, pairs):
        """The pairs' weighted sum of `cfg`'s pair losses, and their implicit rewards."""
        total = torch.zeros_like(chosen)
        for loss_type, weight in cfg.weighted_losses:
            losses, _, _ = dpo_loss(
                chosen,
                rejected,
                ref_chosen[pairs],
                ref_rejected[pairs],
                cfg.beta,
                loss_type,
                cfg.label_smoothing,
                lengths[0][pairs],
                lengths[1][pairs],
                cfg.discopop_tau,
                cfg.f_divergence_type,
                cfg.f_alpha_divergence_coef,
            )
            total = total + weight * losses
        with torch.no_grad():
            rewards = cfg.beta * (chosen - ref_chosen[pairs]), cfg.beta * (rejected - ref_rejected[pairs])
        return total, *rewards

    fused = fused_pair_loss(model, batch, losses_of, cfg) if cfg.fused_loss else None
    stats: dict[str, torch.Tensor] = {}
    if fused is not None:
        loss, chosen, rejected, nll = fused
        _, r_c, r_r = losses_of(chosen, rejected, slice(None))
    else:
        weights = None
        kernels = loss_kernels(cfg, batch["prompt_ids"].device)  # the chunked head's kernels (`token_logprobs`)
        if cfg.use_weighting:
            per_token, mask, weights = wpo_weights(model, batch, compiled=kernels)
            logps = (per_token * mask).sum(1)
        else:
            logps, per_token, mask = completion_logps(model, batch, compiled=kernels)
        if cfg.ld_alpha is not None:
            logps = length_desensitized(per_token, mask, cfg.ld_alpha)
        chosen, rejected = logps.chunk(2)
        losses, r_c, r_r = losses_of(chosen, rejected, slice(None))
        loss = (losses if weights is None else losses * weights).mean()
        if cfg.nll_weight is not None:
            chosen_mask = mask.chunk(2)[0]  # a mean over the chosen tokens without a boolean index (a device wait)
            nll = -(per_token.chunk(2)[0] * chosen_mask).sum() / chosen_mask.sum()
            # weighed per pair as TRL means to weigh its `sft` term (TRL 1.16 fails there): the mean weight
            loss = loss + cfg.nll_weight * nll * (1.0 if weights is None else weights.mean())
    if cfg.nll_weight is not None:
        stats["nll_loss"] = nll.detach()
    # device tensors, read once per log point: a read here would stall the device every micro-batch
    with torch.no_grad():
        stats |= {
            "loss": loss.detach(),
            "rewards/chosen": r_c.mean(),
            "rewards/rejected": r_r.mean(),
            "rewards/accuracies": (r_c > r_r).float().mean(),
            "rewards/margins": (r_c - r_r).mean(),
            "logps/chosen": chosen.detach().mean(),
            "logps/rejected": rejected.detach().mean(),
        }
    return loss, stats


@under_attention_kernels
def train(
    cfg: DPOConfig,
    model,
    tokenizer,
    train_rows: list[dict],
    eval_rows: list[dict],
    tracker,
    output_dir: str | Path,
    seed: int = 0,
    ref_model=None,
) -> TrainResult:
    """Align `model` on preference rows. Without LoRA, pass a frozen `ref_model` (a second copy of the
    starting weights) unless `precompute_ref_logps` or `reference_free` makes it unnecessary."""
    seed = resolve_seed(cfg.seed, seed)
    pad_id = tokenizer.pad_token_id
    eval_ex = tokenize(eval_rows, tokenizer, cfg.max_length, cfg.max_prompt_length)
    packed = layout(model)  # padding-free batches for a document-separating attention kernel
    collate_fn = lambda b: collate(b, pad_id, cfg.max_length, packed=packed)  # noqa: E731
    if cfg.precompute_ref_logps:  # the reference pass reads every tokenized row up front
        train_ex, train_collate = tokenize(train_rows, tokenizer, cfg.max_length, cfg.max_prompt_length), collate_fn
    else:
        # Rows are tokenized batch by batch as the loader yields them: step 1 starts at once instead of after
        # a pass over the whole dataset, and no tokenized copy of it is held.
        train_ex = train_rows

        def train_collate(b):
            return collate_fn(tokenize(b, tokenizer, cfg.max_length, cfg.max_prompt_length))

    loop = TrainLoop("dpo", cfg, model, train_ex, train_collate, tracker, output_dir, seed)
    acc = loop.accelerator
    needs_copy = not (cfg.lora or cfg.reference_free or cfg.precompute_ref_logps)
    if needs_copy and ref_model is None:
        raise ValueError(
            "full-model DPO needs `ref_model` (a frozen copy of the starting model), "
            "or set precompute_ref_logps / lora / reference_free"
        )
    reference = _Reference(cfg, loop, ref_model if not (cfg.lora or cfg.reference_free) else None)
    synced(reference.model, cfg, loop)
    if cfg.precompute_ref_logps:
        reference.precompute({"train": train_ex, "eval": eval_ex}, collate_fn, Path(output_dir) / "ref_logps.pt")

    router = RouterLoss.of(loop.model, cfg.router_aux_loss_coef, cfg.compile)

    def step(window: list[dict]) -> dict[str, torch.Tensor]:
        totals: dict[str, torch.Tensor] = {}
        aux = RouterTotals(router, acc.device)
        for i, batch in enumerate(window):
            with loop.no_sync_unless(i == len(window) - 1):
                with recording(router, *batch_answer_masks(batch, router)):  # the reference's pass runs without grad
                    loss, stats = batch_loss(loop.model, batch, reference.compute, cfg)
                acc.backward(loss / len(window) + aux.term(1 / len(window)))
            accumulate(totals, stats, 1 / len(window))
        return aux.into(totals)

    @torch.no_grad()
    def evaluate() -> dict[str, float]:
        loop.model.eval()
        shard = eval_ex[acc.process_index :: acc.num_processes]
        sums: dict[str, torch.Tensor] = {}
        for i in range(0, len(shard), cfg.batch_size):
            ex = shard[i : i + cfg.batch_size]
            batch = to_device(collate_fn(ex), acc.device)
            _, stats = batch_loss(loop.model, batch, reference.compute, cfg)
            accumulate(sums, {k: v.float() for k, v in stats.items()}, len(ex))
        keys = sorted(sums)
        count = torch.tensor(float(len(shard)), device=acc.device)
        totals = torch.stack([*(sums[k] for k in keys), count]) if keys else count[None]
        if acc.num_processes > 1:
            totals = acc.reduce(totals, "sum")
        return {k: float(totals[i] / totals[-1].clamp(min=1)) for i, k in enumerate(keys)}

    result = loop.run(step, evaluate if eval_ex else None)
    result.model_dir, result.adapter = loop.save(tokenizer)
    return result
