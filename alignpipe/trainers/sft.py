"""Supervised fine-tuning, following the design of TRL's SFTTrainer.

Data: `language_modeling` rows (`text`) or `prompt_completion` rows (`prompt`, `completion`). EOS is
appended to every sequence. With `completion_only_loss` the prompt tokens get label -100; with `assistant_only_loss`
(conversations) every token outside the assistant replies does.

Departures from TRL, on purpose:
- The loss is averaged over *all* target tokens of the optimizer step (across gradient-accumulation
  micro-batches and processes), not averaged per micro-batch, so accumulation does not change it.
- Packing (`packing: true`) puts whole rows best-fit-decreasing into `max_length` blocks whose positions restart at
  every row, so each row attends to itself only and trains exactly as alone, on any attention kernel (TRL's "bfd"
  needs flash-attention for that). `packing_strategy: wrapped` cuts a concatenation every `max_length` tokens instead,
  attention crossing row boundaries (TRL's "wrapped").

NEFTune (`neftune_noise_alpha`) adds noise to the input embeddings in training mode only.

Metrics: train/loss, train/lr, train/grad_norm, train/tokens_per_s, train/samples_per_s, train/epoch,
train/num_tokens, eval/loss (every `eval_every` steps and at the end).

Entry point: `train(cfg, model, tokenizer, train_rows, eval_rows, tracker, output_dir, seed)`.
"""

from __future__ import annotations

import bisect
import logging
from pathlib import Path
from typing import Any

import numpy as np
import torch

from alignpipe.attention import document_kwargs, document_offsets
from alignpipe.device_copies import to_device
from alignpipe.fused_kernels import loss_kernels
from alignpipe.logprobs import token_nll_sum
from alignpipe.modeling import add_neftune, under_attention_kernels
from alignpipe.moe import RouterLoss, RouterTotals, recording
from alignpipe.packed_rows import layout
from alignpipe.special_tokens import encode, encode_with_offsets, with_eos
from alignpipe.trainers.common import TrainLoop, TrainResult, resolve_seed
from alignpipe.trainers.configs import SFTConfig

log = logging.getLogger(__name__)
IGNORE = -100


def tokenize(
    rows: list[dict], tokenizer, max_length: int, completion_only: bool, assistant_only: bool = False
) -> list[dict]:
    """Rows → `{"input_ids", "labels"}` lists, truncated to `max_length`, EOS appended."""
    if not rows:
        return []
    eos = tokenizer.eos_token_id
    out = []
    if "text" in rows[0] and assistant_only:
        return assistant_labels(rows, tokenizer, max_length)
    if "text" in rows[0]:
        for ids in encode(tokenizer, [r["text"] for r in rows]):
            ids = with_eos(ids, eos, tokenizer)[:max_length]
            out.append({"input_ids": ids, "labels": list(ids)})
        return out
    prompts = encode(tokenizer, [r["prompt"] for r in rows])
    completions = tokenizer([r["completion"] for r in rows], add_special_tokens=False)["input_ids"]
    for p, c in zip(prompts, completions):
        c = with_eos(c, eos, tokenizer)
        ids = (p + c)[:max_length]
        labels = ([IGNORE] * len(p) + c)[:max_length] if completion_only else list(ids)
        out.append({"input_ids": ids, "labels": labels})
    return out


def assistant_labels(rows: list[dict], tokenizer, max_length: int) -> list[dict]:
    """Conversation rows (`text` with `assistant_spans`, from a format stage) → ids labelled on the tokens that
    overlap an assistant reply's characters, -100 elsewhere; an appended EOS is labelled when the token before it is."""
    if any(not r.get("assistant_spans") for r in rows):
        raise ValueError(
            "assistant_only_loss needs conversations: `language_modeling` rows formatted from a `messages` column "
            "(each row then carries the character spans of its assistant replies); these rows have none. Format the "
            "data from `messages`, or use `prompt_completion` data with `completion_only_loss`"
        )
    eos = tokenizer.eos_token_id
    out = []
    for row, (ids, offsets) in zip(rows, zip(*encode_with_offsets(tokenizer, [r["text"] for r in rows]))):
        spans = row["assistant_spans"]
        labels = [t if any(s < b and e > a for a, b in spans) else IGNORE for t, (s, e) in zip(ids, offsets)]
        full = with_eos(ids, eos, tokenizer)
        if len(full) > len(ids):
            labels.append(eos if labels and labels[-1] != IGNORE else IGNORE)
        out.append({"input_ids": full[:max_length], "labels": labels[:max_length]})
    return out


def pack(examples: list[dict], max_length: int, strategy: str = "bfd") -> list[dict]:
    """Rows → blocks of at most `max_length` tokens.

    `bfd` (best-fit decreasing): each row goes whole into the fullest block it still fits, longest rows first; a
    block carries `position_ids` that restart at every row and the first label of each row is ignored, so in
    training each row sees only itself (transformers builds a block-diagonal causal mask from restarting
    positions) and its loss and gradient are those of the row alone. `wrapped`: rows concatenated and cut every
    `max_length` tokens, attending across row boundaries (TRL's "wrapped"; no padding at all)."""
    if strategy == "wrapped":
        ids: list[int] = []
        labels: list[int] = []
        for ex in examples:
            ids += ex["input_ids"]
            labels += ex["labels"]
        return [
            {"input_ids": ids[i : i + max_length], "labels": labels[i : i + max_length]}
            for i in range(0, len(ids), max_length)
        ]
    blocks: list[dict] = []
    space: list[tuple[int, int]] = []  # (room left, block index), sorted: bisect finds the best fit
    for ex in sorted(examples, key=lambda e: -len(e["input_ids"])):
        n = len(ex["input_ids"][:max_length])
        k = bisect.bisect_left(space, (n, -1))
        if k < len(space):
            room, b = space.pop(k)
        else:
            blocks.append({"input_ids": [], "labels": [], "position_ids": []})
            room, b = max_length, len(blocks) - 1
        block = blocks[b]
        block["input_ids"] += ex["input_ids"][:n]
        block["labels"] += [IGNORE] + ex["labels"][1:n]
        block["position_ids"] += list(range(n))
        if room - n > 0:
            bisect.insort(space, (room - n, b))
    return blocks


def collate(batch: list[dict], pad_id: int, padding_free: bool = False) -> dict[str, Any]:
    """Right-pad to the longest row in the batch. Packed blocks also get `position_ids`, the padding after a block
    counting as one more document of its own (so it attends to nothing real). `num_targets` (an int, counted here on
    the host) is how many tokens the loss is taken over: the step normalises by it without reading the device.
    `padding_free` (unpacked rows, for a model whose attention runs documents: `packed_rows.layout`): the rows run
    together as one block of documents, no padding, each row's first label ignored as a block's rows' are (it was
    never a target: nothing before it predicts it)."""
    if padding_free and "position_ids" not in batch[0]:
        batch = [
            {
                "input_ids": [t for b in batch for t in b["input_ids"]],
                "labels": [t for b in batch for t in [IGNORE, *b["labels"][1:]]],
                "position_ids": [p for b in batch for p in range(len(b["input_ids"]))],
            }
        ]
    n = max(len(b["input_ids"]) for b in batch)
    # filled in NumPy (~4x faster from Python lists than a `torch.tensor` a row: `device_copies.int64_tensor`)
    rows = (len(batch), n)
    input_ids, labels = np.full(rows, pad_id, dtype=np.int64), np.full(rows, IGNORE, dtype=np.int64)
    mask, positions = np.zeros(rows, dtype=np.int64), np.zeros(rows, dtype=np.int64)
    packed = "position_ids" in batch[0]
    for i, b in enumerate(batch):
        k = len(b["input_ids"])
        input_ids[i, :k] = b["input_ids"]
        labels[i, :k] = b["labels"]
        mask[i, :k] = 1
        if packed:
            positions[i, :k] = b["position_ids"]
            positions[i, k:] = np.arange(n - k)
    out: dict[str, Any] = {
        "input_ids": torch.from_numpy(input_ids),
        "attention_mask": torch.from_numpy(mask),
        "labels": torch.from_numpy(labels),
    }
    if packed:
        out["position_ids"] = torch.from_numpy(positions)
        out["documents"] = documents(out["position_ids"])
    out["num_targets"] = int((labels[:, 1:] != IGNORE).sum())
    return out


def documents(positions: torch.Tensor) -> dict[str, Any]:
    """The packed batch's documents (rows, and the padding after them) as the offsets of their tokens flattened
    block after block, in transformers' names for variable-length attention (`model.attention: varlen`,
    `flash_attention_2`): counted here on the host, so no attention call reads the device to find them."""
    return document_kwargs(document_offsets(positions)[0])


def _suggest_varlen(model) -> None:
    """On a GPU, packed rows under SDPA run its dense block-diagonal mask: say once which setting avoids it."""
    if getattr(model.config, "_attn_implementation", None) == "sdpa":
        log.info(
            "sft: packed rows run SDPA with a dense block-diagonal mask, computing every block of each row's square; "
            "`model.attention: varlen` runs each row through PyTorch's variable-length flash kernel instead"
        )


def token_loss_sum(
    model, batch: dict[str, Any], compiled: bool = False, dft: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed next-token cross-entropy over target tokens, and how many there were. The LM head runs on the
    target positions only (no logits for prompt or padding tokens), in chunks with its gradients formed in the
    forward (`logprobs.token_nll_sum`; `compiled`: with the softmax and gradient of each chunk one compiled kernel);
    labels are the input ids with prompt and padding set to IGNORE, so scoring the next input id is the CE."""
    valid = batch["labels"][:, 1:] != IGNORE
    count = batch.get("num_targets")  # counted on the host by `collate`: no device read to gather the targets
    if "position_ids" in batch:  # packed rows: positions restart per row and no 2-D mask, so rows attend to themselves
        ids, mask, positions = batch["input_ids"], None, batch["position_ids"]
    else:
        ids, mask, positions = batch["input_ids"], batch["attention_mask"], None
    loss = token_nll_sum(
        model,
        ids,
        mask,
        valid,
        position_ids=positions,
        count=count,
        compiled=compiled,
        documents=batch.get("documents"),
        dft=dft,
    )
    return loss, valid.sum()


def evaluate(
    model,
    accelerator,
    examples: list[dict],
    batch_size: int,
    pad_id: int,
    padding_free: bool = False,
    dft: bool = False,
    compiled: bool = False,
) -> float:
    """Token-averaged eval loss over all processes (`padding_free` as `collate`'s; `compiled`: the head's chunks on
    the stage's kernels, as its training steps')."""
    model.eval()
    shard = examples[accelerator.process_index :: accelerator.num_processes]
    total = torch.zeros(2, device=accelerator.device)
    with torch.no_grad():
        for i in range(0, len(shard), batch_size):
            batch = to_device(collate(shard[i : i + batch_size], pad_id, padding_free), accelerator.device)
            loss, n = token_loss_sum(model, batch, compiled=compiled, dft=dft)
            total += torch.stack([loss.detach().float(), n.float()])
    if accelerator.num_processes > 1:
        total = accelerator.reduce(total, "sum")
    return float(total[0] / total[1].clamp(min=1))


@under_attention_kernels
def train(
    cfg: SFTConfig,
    model,
    tokenizer,
    train_rows: list[dict],
    eval_rows: list[dict],
    tracker,
    output_dir: str | Path,
    seed: int = 0,
) -> TrainResult:
    seed = resolve_seed(cfg.seed, seed)
    pad_id = tokenizer.pad_token_id
    how = (cfg.max_length, cfg.completion_only_loss, cfg.assistant_only_loss)
    train_ex, eval_ex = tokenize(train_rows, tokenizer, *how), tokenize(eval_rows, tokenizer, *how)
    if cfg.packing:
        train_ex = pack(train_ex, cfg.max_length, cfg.packing_strategy)
    free = layout(model) is not None  # unpacked rows too run as one block of documents on such a kernel
    loop = TrainLoop("sft", cfg, model, train_ex, lambda b: collate(b, pad_id, free), tracker, output_dir, seed)
    neftune = add_neftune(loop.unwrapped, cfg.neftune_noise_alpha) if cfg.neftune_noise_alpha else None
    acc = loop.accelerator
    if cfg.packing_strategy == "bfd" and cfg.packing and acc.device.type == "cuda":
        _suggest_varlen(loop.unwrapped)
    kernels = loss_kernels(cfg, acc.device)
    dft = cfg.loss_type == "dft"
    router = RouterLoss.of(loop.model, cfg.router_aux_loss_coef, cfg.compile)
    num_tokens: int | torch.Tensor = 0

    def step(window: list[dict]) -> dict[str, float]:
        nonlocal num_tokens
        n_local = sum(b["num_targets"] for b in window)  # counted on the host by `collate`
        n_global: int | torch.Tensor = n_local
        if acc.num_processes > 1:  # the global token count stays on the device: the step reads nothing back
            n_global = acc.reduce(torch.tensor(n_local, device=acc.device), "sum")
        # DDP averages gradients over processes
        scale = acc.num_processes / (max(1, n_global) if isinstance(n_global, int) else n_global.clamp(min=1))
        loss_total = torch.zeros((), device=acc.device)
        aux = RouterTotals(router, acc.device)
        for i, batch in enumerate(window):
            with loop.no_sync_unless(i == len(window) - 1):
                with recording(router, batch["attention_mask"]):
                    loss_sum, _ = token_loss_sum(loop.model, batch, compiled=kernels, dft=dft)
                # the MoE loss is a micro-batch mean that DDP averages over ranks (TRL's): not scaled by `scale`
                acc.backward(loss_sum * scale + aux.term(1 / len(window)))
            loss_total += loss_sum.detach().float()
        num_tokens += n_global
        # this rank's share of the step's token-averaged loss, scaled so the mean over ranks is that loss
        return {"loss": loss_total * scale + aux.weighted, "num_tokens": num_tokens} | aux.metrics()

    eval_fn = (
        (lambda: {"loss": evaluate(loop.model, acc, eval_ex, cfg.batch_size, pad_id, free, dft, kernels)})
        if eval_ex
        else None
    )
    try:
        result = loop.run(step, eval_fn)
    finally:
        if neftune is not None:
            neftune.remove()  # the saved and returned model is the plain one
    result.model_dir, result.adapter = loop.save(tokenizer)
    return result
