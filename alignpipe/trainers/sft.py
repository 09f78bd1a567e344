"""Supervised fine-tuning, following the design of TRL's SFTTrainer.

Data: `language_modeling` rows (`text`) or `prompt_completion` rows (`prompt`, `completion`). EOS is
appended to every sequence. With `completion_only_loss` the prompt tokens get label -100.

Departures from TRL, on purpose:
- The loss is averaged over *all* target tokens of the optimizer step (across gradient-accumulation
  micro-batches and processes), not averaged per micro-batch, so accumulation does not change it.
- Packing concatenates rows into `max_length` blocks keeping each row's loss mask; attention is not
  reset at row boundaries (TRL's "wrapped" packing; its "bfd" variant needs flash-attention).

Metrics: train/loss, train/lr, train/grad_norm, train/tokens_per_s, train/samples_per_s, train/epoch,
train/num_tokens, eval/loss (every `eval_every` steps and at the end).

Entry point: `train(cfg, model, tokenizer, train_rows, eval_rows, tracker, output_dir, seed)`.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from alignpipe.modeling import count_parameters, lora_model
from alignpipe.trainers.common import (
    Checkpointer, Throughput, TrainResult, build_optimizer, build_scheduler, grad_norm, progress, save_model,
    seed_everything, total_steps,
)
from alignpipe.trainers.configs import SFTConfig

log = logging.getLogger(__name__)
IGNORE = -100


def tokenize(rows: list[dict], tokenizer, max_length: int, completion_only: bool) -> list[dict]:
    """Rows → `{"input_ids", "labels"}` lists, truncated to `max_length`, EOS appended."""
    if not rows:
        return []
    eos = tokenizer.eos_token_id
    out = []
    if "text" in rows[0]:
        for ids in tokenizer([r["text"] for r in rows])["input_ids"]:
            ids = (ids + [eos])[:max_length]
            out.append({"input_ids": ids, "labels": list(ids)})
        return out
    prompts = tokenizer([r["prompt"] for r in rows])["input_ids"]
    completions = tokenizer([r["completion"] for r in rows], add_special_tokens=False)["input_ids"]
    for p, c in zip(prompts, completions):
        if not c or c[-1] != eos:
            c = c + [eos]
        ids = (p + c)[:max_length]
        labels = ([IGNORE] * len(p) + c)[:max_length] if completion_only else list(ids)
        out.append({"input_ids": ids, "labels": labels})
    return out


def pack(examples: list[dict], max_length: int) -> list[dict]:
    """Concatenate examples into blocks of exactly `max_length` tokens (the last one may be shorter)."""
    ids: list[int] = []
    labels: list[int] = []
    for ex in examples:
        ids += ex["input_ids"]
        labels += ex["labels"]
    return [{"input_ids": ids[i:i + max_length], "labels": labels[i:i + max_length]}
            for i in range(0, len(ids), max_length)]


def collate(batch: list[dict], pad_id: int) -> dict[str, torch.Tensor]:
    """Right-pad to the longest row in the batch."""
    n = max(len(b["input_ids"]) for b in batch)
    input_ids = torch.full((len(batch), n), pad_id, dtype=torch.long)
    labels = torch.full((len(batch), n), IGNORE, dtype=torch.long)
    mask = torch.zeros((len(batch), n), dtype=torch.long)
    for i, b in enumerate(batch):
        k = len(b["input_ids"])
        input_ids[i, :k] = torch.tensor(b["input_ids"])
        labels[i, :k] = torch.tensor(b["labels"])
        mask[i, :k] = 1
    return {"input_ids": input_ids, "attention_mask": mask, "labels": labels}


def token_loss_sum(model, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, int]:
    """Summed next-token cross-entropy over target tokens, and how many there were."""
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    targets = batch["labels"][:, 1:]
    logits = logits[:, :-1]
    loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), targets.reshape(-1), ignore_index=IGNORE, reduction="sum")
    return loss, int((targets != IGNORE).sum())


def evaluate(model, accelerator, examples: list[dict], batch_size: int, pad_id: int) -> float:
    """Token-averaged eval loss over all processes."""
    model.eval()
    shard = examples[accelerator.process_index::accelerator.num_processes]
    total = torch.zeros(2, device=accelerator.device)
    with torch.no_grad():
        for i in range(0, len(shard), batch_size):
            batch = {k: v.to(accelerator.device) for k, v in collate(shard[i:i + batch_size], pad_id).items()}
            loss, n = token_loss_sum(model, batch)
            total += torch.stack([loss.detach().float(), torch.tensor(float(n), device=accelerator.device)])
    total = accelerator.reduce(total, "sum") if accelerator.num_processes > 1 else total
    model.train()
    return float(total[0] / total[1].clamp(min=1))


def train(cfg: SFTConfig, model, tokenizer, train_rows: list[dict], eval_rows: list[dict], tracker, output_dir: str | Path,
          seed: int = 0) -> TrainResult:
    from accelerate import Accelerator
    from torch.utils.data import DataLoader

    started = time.perf_counter()
    output_dir = Path(output_dir)
    seed = cfg.seed if cfg.seed is not None else seed
    seed_everything(seed)
    accelerator = Accelerator(cpu=not torch.cuda.is_available())
    pad_id = tokenizer.pad_token_id

    if cfg.gradient_checkpointing:
        model.gradient_checkpointing_enable()
        model.config.use_cache = False
    if cfg.lora:
        model = lora_model(model, cfg.lora)
    trainable, total_params = count_parameters(model)
    tracker.log_params({"sft": cfg.model_dump(mode="json"), "model.trainable_params": trainable, "model.total_params": total_params})

    train_ex = tokenize(train_rows, tokenizer, cfg.max_length, cfg.completion_only_loss)
    eval_ex = tokenize(eval_rows, tokenizer, cfg.max_length, cfg.completion_only_loss)
    if cfg.packing:
        train_ex = pack(train_ex, cfg.max_length)
    if not train_ex:
        raise ValueError("the training split is empty: check the format stage (max_length filter, eval_fraction)")

    def loader(epoch: int):
        g = torch.Generator().manual_seed(seed + epoch)
        dl = DataLoader(train_ex, batch_size=cfg.batch_size, shuffle=True, generator=g,
                        collate_fn=lambda b: collate(b, pad_id))
        return accelerator.prepare_data_loader(dl)

    micro_per_epoch = len(loader(0))
    steps = total_steps(cfg, micro_per_epoch)
    optimizer = build_optimizer(model, cfg)
    scheduler = build_scheduler(optimizer, cfg, steps)
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
    checkpoints = Checkpointer(output_dir, cfg.save_total_limit)
    state = checkpoints.resume(accelerator)
    step = state["step"] if state else 0

    def micro_batches(start: int):
        m = start
        while True:
            epoch, offset = divmod(m, micro_per_epoch)
            dl = loader(epoch)
            yield from (accelerator.skip_first_batches(dl, offset) if offset else dl)
            m = (epoch + 1) * micro_per_epoch

    batches = micro_batches(step * cfg.gradient_accumulation_steps)
    meter, window_loss, window_tokens, num_tokens = Throughput(), 0.0, 0, 0
    bar = progress(steps, "sft", accelerator.is_main_process, initial=step)
    model.train()
    while step < steps:
        window = [next(batches) for _ in range(cfg.gradient_accumulation_steps)]
        n_local = sum(int((b["labels"][:, 1:] != IGNORE).sum()) for b in window)
        n_global = n_local
        if accelerator.num_processes > 1:
            n_global = int(accelerator.reduce(torch.tensor(n_local, device=accelerator.device), "sum"))
        scale = accelerator.num_processes / max(1, n_global)  # DDP averages gradients over processes
        step_loss = 0.0
        for i, batch in enumerate(window):
            sync = i == len(window) - 1
            ctx = accelerator.no_sync(model) if not sync else _null()
            with ctx:
                loss_sum, _ = token_loss_sum(model, batch)
                accelerator.backward(loss_sum * scale)
            step_loss += float(loss_sum.detach())
            meter.add(int(batch["attention_mask"].sum()), len(batch["input_ids"]))
        gnorm = grad_norm(model)
        if cfg.max_grad_norm:
            accelerator.clip_grad_norm_(model.parameters(), cfg.max_grad_norm)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        step += 1
        num_tokens += n_local
        window_loss += step_loss
        window_tokens += n_local
        bar.update(1)
        if step % cfg.logging_every == 0 or step == steps:
            metrics = {"train/loss": window_loss / max(1, window_tokens), "train/lr": scheduler.get_last_lr()[0],
                       "train/grad_norm": gnorm, "train/epoch": step * cfg.gradient_accumulation_steps / micro_per_epoch,
                       "train/num_tokens": num_tokens, **{f"train/{k}": v for k, v in meter.read().items()}}
            if accelerator.is_main_process:
                tracker.log_metrics(metrics, step)
            bar.set_postfix(loss=f"{metrics['train/loss']:.3f}")
            window_loss, window_tokens = 0.0, 0
        if eval_ex and cfg.eval_every and step % cfg.eval_every == 0 and step != steps:
            eval_loss = evaluate(model, accelerator, eval_ex, cfg.batch_size, pad_id)
            if accelerator.is_main_process:
                tracker.log_metrics({"eval/loss": eval_loss}, step)
        if cfg.save_every and step % cfg.save_every == 0 and step != steps:
            checkpoints.save(accelerator, step)
    bar.close()

    final = {"train/loss": tracker.last("train/loss") or float("nan")}
    if eval_ex:
        final["eval/loss"] = evaluate(model, accelerator, eval_ex, cfg.batch_size, pad_id)
        if accelerator.is_main_process:
            tracker.log_metrics({"eval/loss": final["eval/loss"]}, step)
    adapter = save_model(accelerator, model, tokenizer, output_dir / "model")
    return TrainResult(model_dir=output_dir / "model", steps=step, metrics=final, adapter=adapter,
                       seconds=time.perf_counter() - started, resumed_from=state["step"] if state else None)


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False
