"""Kahneman-Tversky Optimization (Ethayarajh et al. 2024), following the design of TRL's KTOTrainer.

Data: `unpaired` rows (prompt, completion, label): a completion someone marked good (true) or bad (false), with no
pairing. Prompt tokens (left-truncated to `max_prompt_length`) + completion tokens + EOS, the whole cut to
`max_length`.

Per micro-batch of B rows, r = log π(y|x) − log π_ref(y|x) (summed over completion tokens). KTO compares each r with a
reference point z: the batch's KL(π ‖ π_ref), estimated on mismatched pairs (x_i, y_{i−1}), the completions rotated
by one within the batch, as TRL builds its `KL_completion_ids`; z is detached, averaged over processes and clamped
at 0. Desirable rows cost w_d (1 − σ(β(r − z))), undesirable ones w_u (1 − σ(β(z − r))); the loss is the mean over
the batch (`losses.kto_loss`). `apo_zero_unpaired` drops z and the mismatched pass.

The policy runs the batch's completions with grad and the mismatched ones without; the reference (a frozen copy, or
the adapter-disabled policy under LoRA) runs both in one pass, each prompt once for its two answers. With
`precompute_ref_logps` each row's mismatched partner is fixed instead (TRL's: the row before it in its chunk of
`batch_size` rows, in the data's order) and the reference's log-probs of both are computed once and cached.

Metrics (TRL's names, under train/ and eval/): loss, kl, rewards/chosen, rewards/rejected, rewards/margins,
logps/chosen, logps/rejected (chosen = desirable; averaged over the step's desirable / undesirable rows, absent
from a step that has none).

Entry point: `train(cfg, model, tokenizer, train_rows, eval_rows, tracker, output_dir, seed, ref_model=None)`.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from alignpipe import fused_kernels
from alignpipe.device_copies import to_device
from alignpipe.fused_kernels import loss_kernels
from alignpipe.losses import kto_loss
from alignpipe.modeling import under_attention_kernels
from alignpipe.moe import RouterLoss, RouterTotals, recording
from alignpipe.packed_rows import answers_part, runs_documents
from alignpipe.special_tokens import encode, with_eos
from alignpipe.trainers import dpo
from alignpipe.trainers.common import TrainLoop, TrainResult, frozen_reference, resolve_seed
from alignpipe.trainers.configs import KTOConfig
from alignpipe.trainers.ref_cache import cached_reference_logps
from alignpipe.trainers.ref_sync import synced

log = logging.getLogger(__name__)


def tokenize(rows: list[dict], tokenizer, max_prompt_length: int | None = None) -> list[dict]:
    """Rows → prompt ids, completion ids ending in EOS, and the boolean label."""
    if not rows:
        return []
    for i, r in enumerate(rows):
        if not isinstance(r.get("label"), bool):
            raise ValueError(
                f"KTO row {i} has label {r.get('label')!r}; unpaired data needs a true/false `label` per row "
                "(produce it with a `format: unpaired` stage)"
            )
    eos = tokenizer.eos_token_id
    prompts = encode(tokenizer, [r.get("prompt", "") for r in rows])
    completions = tokenizer([r["completion"] for r in rows], add_special_tokens=False)["input_ids"]
    out = []
    for p, c, r in zip(prompts, completions, rows):
        if max_prompt_length:
            p = p[-max_prompt_length:]
        out.append({"prompt_ids": p, "completion_ids": with_eos(c, eos, tokenizer), "label": r["label"]})
    return out


def fixed_kl_partners(examples: list[dict], batch_size: int) -> list[dict]:
    """Each example with the KL partner TRL gives it (`KL_completion_ids`): in each chunk of `batch_size` examples, in
    order, the completion of the one before it (the first takes the last's)."""
    out = []
    for s in range(0, len(examples), batch_size):
        chunk = examples[s : s + batch_size]
        shifted = [chunk[-1]["completion_ids"]] + [e["completion_ids"] for e in chunk[:-1]]
        out += [{**e, "kl_completion_ids": k} for e, k in zip(chunk, shifted, strict=True)]
    return out


def collate(examples: list[dict], pad_id: int, max_length: int, with_kl: bool, packed: bool = False) -> dict[str, Any]:
    """`dpo.collate`'s layout with each prompt's completion first and, `with_kl`, then its KL partner: the example's
    fixed one (`fixed_kl_partners`), else the completion of the row before it in the batch (the first row takes the
    last one's): B + B answers. Adds `label` (B,) bool, `num_chosen` (the host int count of desirable rows) and,
    where the examples carry them, the precomputed reference log-probs `ref_logps` (B, or 2B with the partners')."""
    keys: tuple[str, ...] = ("completion_ids",)
    if with_kl:
        if "kl_completion_ids" in examples[0]:
            shifted = [e["kl_completion_ids"] for e in examples]
        else:
            shifted = [examples[-1]["completion_ids"]] + [e["completion_ids"] for e in examples[:-1]]
        examples = [{**e, "kl_ids": k} for e, k in zip(examples, shifted)]
        keys = ("completion_ids", "kl_ids")
    # padding-free (`packed`), each answer with its own copy of its prompt: the step cuts the batch's halves apart
    batch = dpo.collate(examples, pad_id, max_length, keys=keys, packed="documents" if packed else None)
    batch["label"] = torch.tensor([e["label"] for e in examples], dtype=torch.bool)
    batch["num_chosen"] = sum(e["label"] for e in examples)  # an int, counted on the host: no read in the step
    if "ref_logp" in examples[0]:
        values = [e["ref_logp"] for e in examples] + ([e["ref_kl_logp"] for e in examples] if with_kl else [])
        batch["ref_logps"] = torch.tensor(values)
    return batch


def answers(batch: dict, part: slice) -> dict[str, torch.Tensor]:
    """The batch with only the answers in `part` (rows of `completion_ids`), for `dpo.completion_logps`."""
    return {
        "prompt_ids": batch["prompt_ids"],
        "prompt_mask": batch["prompt_mask"],
        "completion_ids": batch["completion_ids"][part],
        "completion_tokens": batch["completion_tokens"][part],
        "prompts_nonempty": batch["prompts_nonempty"],
        "scored_per_row": batch["scored_per_row"][part],
        **({"packed": answers_part(batch["packed"], part)} if "packed" in batch else {}),
    }


class Losses:
    """One micro-batch's KTO loss, and the step's metric sums kept on the device (read when logged) beside the host
    counts of desirable and undesirable rows. `reference()` gives the reference model and the context it runs in."""

    def __init__(
        self,
        cfg: KTOConfig,
        accelerator,
        reference: Callable[[], tuple[Any, Any]],
        router: RouterLoss | None = None,
    ):
        self.cfg, self.acc, self.reference, self.router = cfg, accelerator, reference, router
        self.with_kl = cfg.loss_type == "kto"

    @torch.no_grad()
    def reference_logps(self, batch: dict, kernels: bool = False) -> torch.Tensor:
        """The reference's summed log-probs of a collated batch's answers (its completions, then its KL partners)."""
        ref_model, context = self.reference()
        with fused_kernels.without_grad(kernels, ref_model), context:
            logps, _, _ = dpo.completion_logps(ref_model, batch, compiled=kernels)
        return logps

    def __call__(self, model, batch: dict, sums: dict[str, torch.Tensor], counts: dict[str, int]) -> torch.Tensor:
        cfg, acc = self.cfg, self.acc
        labels = batch["label"]
        B = labels.size(0)
        main = slice(0, B)
        kernels = fused_kernels.wanted(cfg.fused_kernels, labels.device)  # the scoring passes' head compiled
        ref_logps = batch.get("ref_logps")
        if ref_logps is None:
            ref_logps = self.reference_logps(batch, kernels)
        # the policy's own pass over the mismatched pairs: outside the reference's context, which under LoRA
        # disables the adapter
        with fused_kernels.without_grad(kernels, model):
            kl = torch.zeros((), device=ref_logps.device)
            if self.with_kl:
                kl_logps, _, _ = dpo.completion_logps(model, answers(batch, slice(B, 2 * B)), compiled=kernels)
                kl = (kl_logps - ref_logps[B:]).mean()
                if acc.num_processes > 1 and model.training:  # eval shards may differ in batch count
                    kl = acc.reduce(kl, "mean")
                kl = kl.clamp(min=0)
        kl, ref_logps = kl.clone(), ref_logps.clone()  # plain tensors outside inference mode, for autograd

        def losses_of(logps: torch.Tensor, rows) -> tuple[torch.Tensor, torch.Tensor]:
            return kto_loss(
                logps,
                ref_logps[rows],
                labels[rows],
                kl,
                cfg.beta,
                cfg.loss_type,
                cfg.desirable_weight,
                cfg.undesirable_weight,
            )

        own = answers(batch, main)
        with recording(self.router, *dpo.batch_answer_masks(own, self.router)):  # an MoE policy's routers
            loss, logps, rewards = self._policy_loss(model, own, main, losses_of)
        detached, zero = logps.detach(), logps.new_zeros(())
        chosen = batch["num_chosen"]
        for key, value in (
            ("loss", loss.detach()),
            ("kl", kl),
            ("rewards/chosen", torch.where(labels, rewards, zero).sum()),
            ("rewards/rejected", torch.where(labels, zero, rewards).sum()),
            ("logps/chosen", torch.where(labels, detached, zero).sum()),
            ("logps/rejected", torch.where(labels, zero, detached).sum()),
            ("batches", torch.ones((), device=logps.device)),
        ):
            sums[key] = sums.get(key, 0) + value
        counts["chosen"] = counts.get("chosen", 0) + chosen
        counts["rejected"] = counts.get("rejected", 0) + B - chosen
        return loss

    def _policy_loss(self, model, own: dict, main: slice, losses_of) -> tuple[torch.Tensor, ...]:
        """(loss, summed log-probs, rewards) of the policy's pass over the batch's own completions."""
        cfg, B = self.cfg, main.stop
        kernels = loss_kernels(cfg, own["prompt_ids"].device)
        if cfg.fused_loss:  # each completion its own unit: its loss (a mean over the batch) reads its sum alone
            fused = dpo.fused_answers_loss(
                model, own, [[i] for i in range(B)], lambda s, rows: losses_of(s, rows)[0] * len(rows) / B, kernels
            )
            if fused is not None:
                loss, logps = fused
                return loss, logps, losses_of(logps, main)[1]
        logps, _, _ = dpo.completion_logps(model, own, compiled=kernels)
        loss, rewards = losses_of(logps, main)
        return loss, logps, rewards


def precompute_reference(
    losses: Losses, loop: TrainLoop, splits: dict[str, list[dict]], collate_fn, path: Path, has_copy: bool
) -> None:
    """Fill `ref_logp` (and `ref_kl_logp`, its KL partner's) into every example of `splits`
    (`ref_cache.cached_reference_logps`), scored by the reference: a frozen copy, the adapter-disabled policy, or the
    policy before its first step."""

    def score(batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
        logps = losses.reference_logps(batch)
        main, partner = logps.chunk(2) if losses.with_kl else (logps, logps)
        return main, partner

    cached_reference_logps(
        splits,
        lambda e: [e["prompt_ids"], e["completion_ids"], e["kl_completion_ids"]],
        ("ref_logp", "ref_kl_logp"),
        score,
        collate_fn,
        loop,
        path,
        can_recompute=has_copy or hasattr(loop.unwrapped, "disable_adapter"),
    )


def metrics(sums: dict[str, torch.Tensor], counts: dict[str, int]) -> dict[str, torch.Tensor]:
    """Per-row means of the summed rewards and log-probs (TRL's), per-batch means of the loss and KL; rewards of a
    side with no rows are left out, and the margin needs both. The row counts are host ints (`collate`'s)."""
    out = {"loss": sums["loss"] / sums["batches"], "kl": sums["kl"] / sums["batches"]}
    for side in ("chosen", "rejected"):
        if n := counts.get(side, 0):
            out[f"rewards/{side}"] = sums[f"rewards/{side}"] / n
            out[f"logps/{side}"] = sums[f"logps/{side}"] / n
    if "rewards/chosen" in out and "rewards/rejected" in out:
        out["rewards/margins"] = out["rewards/chosen"] - out["rewards/rejected"]
    return out


@under_attention_kernels
def train(
    cfg: KTOConfig,
    model,
    tokenizer,
    train_rows: list[dict],
    eval_rows: list[dict],
    tracker,
    output_dir: str | Path,
    seed: int = 0,
    ref_model=None,
) -> TrainResult:
    """Align `model` on unpaired rows. Without LoRA, pass a frozen `ref_model` (a copy of the starting weights)."""
    seed = resolve_seed(cfg.seed, seed)
    if not (cfg.lora or cfg.precompute_ref_logps) and ref_model is None:
        raise ValueError(
            "full-model KTO needs `ref_model` (a frozen copy of the starting model), or set lora or "
            "precompute_ref_logps"
        )
    pad_id, with_kl = tokenizer.pad_token_id, cfg.loss_type == "kto"
    tokenize(train_rows[:1], tokenizer)  # a bad label fails here, not at the first batch that holds it

    packed = runs_documents(model)  # padding-free batches for a document-separating attention kernel

    def collate_examples(examples: list[dict]) -> dict[str, Any]:
        return collate(examples, pad_id, cfg.max_length, with_kl, packed)

    def collate_rows(rows: list[dict]) -> dict[str, Any]:
        return collate_examples(tokenize(rows, tokenizer, cfg.max_prompt_length))

    splits: dict[str, list[dict]] = {}
    if cfg.precompute_ref_logps:  # every row tokenized up front, each with its fixed KL partner
        for name, rows in (("train", train_rows), ("eval", eval_rows)):
            splits[name] = fixed_kl_partners(tokenize(rows, tokenizer, cfg.max_prompt_length), cfg.batch_size)
        loop = TrainLoop("kto", cfg, model, splits["train"], collate_examples, tracker, output_dir, seed)
    else:
        loop = TrainLoop("kto", cfg, model, train_rows, collate_rows, tracker, output_dir, seed)
    acc = loop.accelerator
    ref = frozen_reference(ref_model, cfg, acc.device) if (ref_model is not None and not cfg.lora) else None
    synced(ref, cfg, loop)

    def reference():
        if ref is not None:
            return ref, contextlib.nullcontext()
        if hasattr(loop.unwrapped, "disable_adapter"):
            return loop.model, loop.unwrapped.disable_adapter()
        return loop.model, contextlib.nullcontext()  # precomputing: the policy before its first step

    losses = Losses(cfg, acc, reference, RouterLoss.of(loop.model, cfg.router_aux_loss_coef, cfg.compile))
    if cfg.precompute_ref_logps:
        precompute_reference(losses, loop, splits, collate_examples, Path(output_dir) / "ref_logps.pt", ref is not None)
        ref = ref_model = None  # no reference pass from here on: a copy's memory goes back

    def step(window: list[dict]) -> dict[str, torch.Tensor]:
        sums: dict[str, torch.Tensor] = {}
        counts: dict[str, int] = {}
        aux = RouterTotals(losses.router, acc.device)
        for i, batch in enumerate(window):
            with loop.no_sync_unless(i == len(window) - 1):
                acc.backward(losses(loop.model, batch, sums, counts) / len(window) + aux.term(1 / len(window)))
        return aux.into(metrics(sums, counts))

    @torch.no_grad()
    def evaluate() -> dict[str, float]:
        loop.model.eval()
        precomputed = "eval" in splits
        shard = (splits["eval"] if precomputed else eval_rows)[acc.process_index :: acc.num_processes]
        sums: dict[str, torch.Tensor] = {}
        counts: dict[str, int] = {}
        for i in range(0, len(shard), cfg.batch_size):
            part = shard[i : i + cfg.batch_size]
            batch = to_device(collate_examples(part) if precomputed else collate_rows(part), acc.device)
            losses(loop.model, batch, sums, counts)
        if acc.num_processes > 1:
            sums = {k: acc.reduce(v.float(), "sum") for k, v in sums.items()}
            totals = acc.reduce(
                torch.tensor([counts.get(k, 0) for k in ("chosen", "rejected")], device=acc.device), "sum"
            )
            counts = dict(zip(("chosen", "rejected"), totals.tolist()))
        return {k: float(v) for k, v in metrics(sums, counts).items()}

    result = loop.run(step, evaluate if eval_rows else None)
    result.model_dir, result.adapter = loop.save(tokenizer)
    return result
