"""Reward-model training, following the design of TRL's RewardTrainer.

Model: a sequence classifier with one output (`AutoModelForSequenceClassification`, num_labels=1),
whose score is read at the last non-padding token. Data: `preference` rows (prompt, chosen,
rejected; optional `margin`). Chosen and rejected go through the model in one forward pass that runs
their common token prefix (the prompt, mostly) once.

Loss (Bradley-Terry): −log σ(r_c − r_r − margin), plus `center_rewards_coefficient` · mean((r_c + r_r)²).
EOS is appended to plain-text completions, as TRL does.

Metrics: train/loss, train/accuracy (r_c > r_r), train/margin (mean r_c − r_r), train/rewards_chosen,
train/rewards_rejected, and the same under eval/.

Entry point: `train(cfg, model, tokenizer, train_rows, eval_rows, tracker, output_dir, seed)`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from alignpipe.device_copies import to_device
from alignpipe.logprobs import can_share_prefix, shared_prefix_hidden, unwrapped
from alignpipe.losses import bradley_terry_loss
from alignpipe.modeling import under_attention_kernels
from alignpipe.packed_rows import classifier_scores, layout, pack_scored, runs
from alignpipe.special_tokens import encode, with_eos
from alignpipe.trainers.common import TrainLoop, TrainResult, accumulate, pad_rows, resolve_seed
from alignpipe.trainers.configs import RewardConfig


def tokenize(rows: list[dict], tokenizer, max_length: int, use_margin: bool = True) -> list[dict]:
    """Rows → chosen_ids / rejected_ids (prompt + completion + EOS); pairs longer than max_length are dropped."""
    if not rows:
        return []
    eos = tokenizer.eos_token_id

    def ids(col: str) -> list[list[int]]:
        texts = [row.get("prompt", "") + row[col] for row in rows]
        return [with_eos(seq, eos, tokenizer) for seq in encode(tokenizer, texts)]

    chosen, rejected = ids("chosen"), ids("rejected")
    out = []
    for row, c, r in zip(rows, chosen, rejected):
        if len(c) <= max_length and len(r) <= max_length:
            ex: dict[str, Any] = {"chosen_ids": c, "rejected_ids": r}
            if use_margin and row.get("margin") is not None:
                ex["margin"] = float(row["margin"])
            out.append(ex)
    return out


def collate(examples: list[dict], pad_id: int, packed: str | None = None) -> dict[str, Any]:
    """A batch of B pairs in two layouts:
    - whole rows, [chosen rows..., rejected rows...] right-padded into (2B, T) `input_ids`/`attention_mask`;
    - what `scores` runs when it can: each pair's common token prefix once, `prefix_ids`/`prefix_mask` (B, P)
      left-padded, and the rest of each sequence, `suffix_ids`/`suffix_mask` (2B, C) right-padded (a suffix keeps
      at least its last token, where the score is read), with `shareable`, a host bool: whether every prefix holds a
      token and every suffix a non-padding one (`pad_id` is the scorer's), so `scores` need not read the masks;
    - with `packed` (`packed_rows.layout` of the scorer), `packed`: the sequences as one row of documents, no
      padding, each pair's common prefix once where "shared", with the position each score is read at
      (`packed_rows.pack_scored`)."""
    seqs = [e["chosen_ids"] for e in examples] + [e["rejected_ids"] for e in examples]
    input_ids, mask = pad_rows(seqs, pad_id)
    prefixes: list[list[int]] = []
    suffixes: list[list[list[int]]] = [[], []]
    for e in examples:
        c, r = e["chosen_ids"], e["rejected_ids"]
        k = 0
        while k < min(len(c), len(r)) - 1 and c[k] == r[k]:
            k += 1
        prefixes.append(c[:k])
        suffixes[0].append(c[k:])
        suffixes[1].append(r[k:])
    prefix_ids, prefix_mask = pad_rows(prefixes, pad_id, left=True)
    suffix_ids, suffix_mask = pad_rows(suffixes[0] + suffixes[1], pad_id)
    batch: dict[str, Any] = {
        "input_ids": input_ids,
        "attention_mask": mask,
        "prefix_ids": prefix_ids,
        "prefix_mask": prefix_mask,
        "suffix_ids": suffix_ids,
        "suffix_mask": suffix_mask,
    }
    # whether `scores` may share prefixes without reading the masks back: every prefix holds a token, and every
    # suffix a non-padding one (where the score is read)
    batch["shareable"] = all(prefixes) and all(any(t != pad_id for t in s) for s in suffixes[0] + suffixes[1])
    if packed:
        batch["packed"] = pack_scored(prefixes, suffixes[0] + suffixes[1], pad_id, share=packed == "shared")
    if "margin" in examples[0]:
        batch["margin"] = torch.tensor([e["margin"] for e in examples], dtype=torch.float)
    return batch


def scores(model, batch: dict) -> torch.Tensor:
    """The (2B,) float rewards of a collated batch: chosen, then rejected. Each pair's common prefix runs once
    (`shared_prefix_hidden`), the score is read at the last non-padding token as the classifier's own forward
    reads it; whole rows where that cannot be done (DDP's forward, activation checkpointing, an empty prefix, a
    head other than `score`) or does not pay (`worth_sharing`). A batch `collate` packed, for a scorer that runs its
    layout (`packed_rows.runs`), runs as one row of documents instead (`_packed_scores`)."""
    packed = _packed_scores(model, batch)
    if packed is not None:
        return packed
    shared = _shared_scores(model, batch)
    if shared is not None:
        return shared
    return (
        model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], use_cache=False)
        .logits.squeeze(-1)
        .float()
    )


def _packed_scores(model, batch: dict) -> torch.Tensor | None:
    """Scores of the padding-free layout, read at each sequence's `last` position; None where the batch has none or
    the classifier cannot be run as body + `score` (DDP's forward)."""
    packed, base = batch.get("packed"), unwrapped(model)
    if packed is None or base is None or not hasattr(base, "score") or not runs(packed, base):
        return None
    return classifier_scores(base, packed)


def _shared_scores(model, batch: dict) -> torch.Tensor | None:
    base = unwrapped(model)
    shareable = batch.get("shareable")
    if (
        base is None
        or base.config.pad_token_id is None
        or not hasattr(base, "score")
        or not can_share_prefix(base, batch["prefix_mask"], batch["prefix_ids"].numel(), shareable)
    ):
        return None
    pad = base.config.pad_token_id
    suffix = batch["suffix_ids"]
    real = batch["suffix_mask"].bool() & (suffix != pad)
    if shareable is None and not bool(real.any(1).all()):  # the last non-padding token would lie in the prefix
        return None
    rows = torch.arange(suffix.size(0), device=suffix.device)
    last = (torch.arange(suffix.size(1), device=suffix.device) * real).argmax(-1)
    pairs = batch["prefix_ids"].size(0)
    _, hidden = shared_prefix_hidden(
        getattr(base, base.base_model_prefix),
        base.config,
        batch["prefix_ids"],
        batch["prefix_mask"],
        suffix,
        rows % pairs,
    )
    return base.score(hidden[rows, last]).squeeze(-1).float()


def forward(model, batch: dict, cfg: RewardConfig) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The loss, and the micro-batch's metrics as device tensors (read once per log point, not here)."""
    rc, rr = scores(model, batch).chunk(2)
    loss = bradley_terry_loss(rc, rr, batch.get("margin"), cfg.center_rewards_coefficient)
    with torch.no_grad():
        stats = {
            "loss": loss.detach(),
            "accuracy": (rc > rr).float().mean(),
            "margin": (rc - rr).mean(),
            "rewards_chosen": rc.mean(),
            "rewards_rejected": rr.mean(),
        }
    return loss, stats


def evaluate(
    model, accelerator, examples: list[dict], cfg: RewardConfig, pad_id: int, packed: str | None = None
) -> dict[str, float]:
    model.eval()
    shard = examples[accelerator.process_index :: accelerator.num_processes]
    sums = torch.zeros(3, device=accelerator.device)  # correct, margin sum, loss sum
    with torch.no_grad():
        for i in range(0, len(shard), cfg.batch_size):
            ex = shard[i : i + cfg.batch_size]
            batch = to_device(collate(ex, pad_id, packed), accelerator.device)
            _, st = forward(model, batch, cfg)
            n = len(ex)
            sums += torch.stack([st["accuracy"], st["margin"], st["loss"]]) * n
    count = torch.tensor(float(len(shard)), device=accelerator.device)
    if accelerator.num_processes > 1:
        sums, count = accelerator.reduce(sums, "sum"), accelerator.reduce(count, "sum")
    count = count.clamp(min=1)
    return {"accuracy": float(sums[0] / count), "margin": float(sums[1] / count), "loss": float(sums[2] / count)}


@under_attention_kernels
def train(
    cfg: RewardConfig,
    model,
    tokenizer,
    train_rows: list[dict],
    eval_rows: list[dict],
    tracker,
    output_dir: str | Path,
    seed: int = 0,
) -> TrainResult:
    """Train `model` (a 1-label sequence classifier) on preference rows; saves a merged, loadable scorer."""
    seed = resolve_seed(cfg.seed, seed)
    pad_id = tokenizer.pad_token_id
    model.config.pad_token_id = pad_id
    train_ex = tokenize(train_rows, tokenizer, cfg.max_length, cfg.use_margin)
    eval_ex = tokenize(eval_rows, tokenizer, cfg.max_length, cfg.use_margin)
    packed = layout(model)  # padding-free batches for a document-separating attention kernel
    loop = TrainLoop(
        "reward",
        cfg,
        model,
        train_ex,
        lambda b: collate(b, pad_id, packed),
        tracker,
        output_dir,
        seed,
        lora_task="SEQ_CLS",
    )
    acc = loop.accelerator

    def step(window: list[dict]) -> dict[str, torch.Tensor]:
        totals: dict[str, torch.Tensor] = {}
        for i, batch in enumerate(window):
            with loop.no_sync_unless(i == len(window) - 1):
                loss, stats = forward(loop.model, batch, cfg)
                acc.backward(loss / len(window))
            accumulate(totals, stats, 1 / len(window))
        return totals

    eval_fn = (lambda: evaluate(loop.model, acc, eval_ex, cfg, pad_id, packed)) if eval_ex else None
    result = loop.run(step, eval_fn)
    # Saved merged, so later stages (PPO value init, judges, reward functions) load a plain scorer.
    result.model_dir, _ = loop.save(tokenizer, merge_adapter=True)
    return result
