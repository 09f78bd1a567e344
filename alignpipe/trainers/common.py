"""Pieces every trainer shares: seeding, optimizer and schedule, checkpoints, saving, progress."""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import math
import os
import random
import shutil
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import cast

import numpy as np
import torch

from alignpipe import fused_kernels, offload
from alignpipe.compiled import compile_layers
from alignpipe.device_copies import OneBuffer
from alignpipe.lean_activations import lean_activations
from alignpipe.low_precision_adamw import LowPrecisionAdamW, low_precision_params, rounds_stochastically
from alignpipe.manifest import write_whole
from alignpipe.progress import progress
from alignpipe.trainers.configs import TrainingArgs
from alignpipe.trainers.loss_watch import LossWatch

log = logging.getLogger(__name__)


@dataclass
class TrainResult:
    """What a trainer hands back: where the model is, final metrics, and how long it took."""

    model_dir: Path
    steps: int
    metrics: dict[str, float] = field(default_factory=dict)
    adapter: bool = False
    seconds: float = 0.0
    resumed_from: int | None = None


def resolve_seed(own: int | None, default: int) -> int:
    """A stage's or trainer config's own `seed` when set, else `default` (the recipe's)."""
    return own if own is not None else default


def config_params(cfg: TrainingArgs) -> dict:
    """The hyperparameters of a trainer config as JSON values, for MLflow params: the fields of its trainer config
    class only (a recipe stage is that config plus wiring such as ids and data references, which are not logged)."""
    own = next(c for c in type(cfg).__mro__ if issubclass(c, TrainingArgs) and c.__module__ == TrainingArgs.__module__)
    return cfg.model_dump(mode="json", include=set(own.model_fields))


def seed_everything(seed: int) -> None:
    random.seed(seed)
    torch.manual_seed(seed)
    try:
        import numpy as np

        np.random.seed(seed % 2**32)
    except ImportError:  # pragma: no cover
        pass


def pad_rows(rows: list[list[int]], pad_id: int, left: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Token-id lists → (ids, 0/1 mask), padded to the longest row (at least one column) on the right, or on the
    left (prompts that completions follow end at the same column)."""
    n = max(1, max(len(r) for r in rows))
    # filled in NumPy (~4x faster from Python lists than a `torch.tensor` a row: `device_copies.int64_tensor`)
    values = np.full((len(rows), n), pad_id, dtype=np.int64)
    mask = np.zeros((len(rows), n), dtype=np.int64)
    for i, r in enumerate(rows):
        if r:
            cols = slice(n - len(r), n) if left else slice(0, len(r))
            values[i, cols] = r
            mask[i, cols] = 1
    return torch.from_numpy(values), torch.from_numpy(mask)


def kernels_run(model, cfg: TrainingArgs, device) -> dict[str, object]:
    """What the stage's model really runs, for the run's parameters (the recipe may say `auto`): its attention
    implementation (`model.attention`, from the first module holding a transformers config: the policy of PPO's
    pair) and whether the fused element-wise kernels are on (`model.fused_kernels`: `fused_kernels` on a device
    that compiles them)."""
    names = (getattr(getattr(m, "config", None), "_attn_implementation", None) for m in model.modules())
    attention = next((name for name in names if name is not None), None)
    return {"model.attention": attention, "model.fused_kernels": fused_kernels.wanted(cfg.fused_kernels, device)}


def lean_patched(cfg: TrainingArgs) -> bool:
    """Whether a stage's models get `lean_activations`: not under `compile` (inductor chooses what to keep) nor
    activation checkpointing of every layer (nothing is kept)."""
    every_layer_checkpointed = cfg.gradient_checkpointing and cfg.checkpoint_every_n_layers == 1
    return cfg.lean_activations and not cfg.compile and not every_layer_checkpointed


def frozen_reference(ref_model, cfg: TrainingArgs, device: torch.device):
    """A frozen reference model on `device`, its layers made as the policy's are: patched (`lean_activations`, with
    `fused_kernels`), or under `compile` compiled (`compile_layers`). On a GPU the fused kernels round differently
    from transformers' modules, and a reference that rounds as the policy does gives the step-0 log-ratios of
    identical weights exactly 0, as on CPU; a compiled policy's reference left as transformers' eager modules would
    also spend on its own pass the launches (a step's host time) and unfused kernels that compiling saves the
    policy. Its compiled layers run without gradients: one graph more, compiled at the first step."""
    ref_model = ref_model.to(device).eval().requires_grad_(False)
    if cfg.compile:
        compile_layers(ref_model)
    elif lean_patched(cfg):
        lean_activations(ref_model, fused=cfg.fused_kernels)
    return ref_model


def build_optimizer(model, cfg: TrainingArgs) -> torch.optim.Optimizer:
    """AdamW with no weight decay on biases and normalization weights (1-D parameters); bf16/fp16 weights updated
    as `low_precision_updates` says (`low_precision_adamw.py`)."""
    decay: list[torch.nn.Parameter] = []
    no_decay: list[torch.nn.Parameter] = []
    for p in model.parameters():
        if p.requires_grad:
            (decay if p.ndim >= 2 else no_decay).append(p)
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    params = decay + no_decay
    low = low_precision_params(params)
    adamw: Callable[..., torch.optim.Optimizer] = torch.optim.AdamW
    if low and cfg.low_precision_updates != "nearest":
        adamw = functools.partial(LowPrecisionAdamW, updates=cfg.low_precision_updates, fused_kernels=cfg.fused_kernels)
        buffered = sum(
            p.numel() * p.element_size() for p in low if not rounds_stochastically(cfg.low_precision_updates, p.dtype)
        )
        log.info(
            "AdamW steps %d %s parameters (%.1fM values) with low_precision_updates: %s (+%s of compensation)",
            len(low),
            "/".join(sorted({str(p.dtype).removeprefix("torch.") for p in low})),
            sum(p.numel() for p in low) / 1e6,
            cfg.low_precision_updates,
            f"{buffered / 1e9:.2f} GB" if buffered >= 1e9 else f"{buffered / 1e6:.1f} MB",
        )
    # The fused kernel (CPU and CUDA, floating-point params) updates every tensor in one call; the default
    # per-tensor loop costs ~15% of a step for small models on CPU.
    fused = bool(params) and all(p.is_floating_point() and p.device.type in ("cpu", "cuda") for p in params)
    try:
        return adamw(
            groups,
            lr=cfg.learning_rate,
            betas=cfg.adam_betas,
            fused=fused or None,
            foreach=None if fused else True,
        )
    except (RuntimeError, ValueError):  # a device/dtype the fused kernel does not take
        return adamw(groups, lr=cfg.learning_rate, betas=cfg.adam_betas)


def build_scheduler(optimizer, cfg: TrainingArgs, total_steps: int):
    """Linear warmup, then cosine / linear decay to 0, or constant."""
    warmup = int(cfg.warmup_ratio * total_steps)

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / max(1, warmup)
        if cfg.lr_scheduler == "constant":
            return 1.0
        progress = (step - warmup) / max(1, total_steps - warmup)
        if cfg.lr_scheduler == "linear":
            return max(0.0, 1.0 - progress)
        return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def total_steps(cfg: TrainingArgs, batches_per_epoch: int, batches_per_step: int | None = None) -> int:
    """Steps the run will take (`max_steps`, else `epochs` over batches of `batches_per_step`, by default
    `gradient_accumulation_steps`)."""
    if cfg.max_steps:
        return cfg.max_steps
    per_step = batches_per_step or cfg.gradient_accumulation_steps
    return max(1, math.ceil(cfg.epochs * batches_per_epoch / per_step))


def _grads_by_kind(model) -> list[list[torch.Tensor]]:
    """The gradients of `model`'s parameters grouped by (device, dtype), in the order torch's `clip_grad_norm_`
    groups them (each group in parameter order, the groups in the order first seen)."""
    groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for p in model.parameters():
        if p.grad is not None:
            groups.setdefault((p.grad.device, p.grad.dtype), []).append(p.grad)
    return list(groups.values())


def _total_norm(groups: list[list[torch.Tensor]]) -> torch.Tensor:
    """The 2-norm of all `groups`' values: torch's `clip_grad_norm_` total, computed as it computes it."""
    norms = [n for grads in groups for n in torch._foreach_norm(grads, 2.0)]
    return torch.linalg.vector_norm(torch.stack(norms), 2.0)


def clip_and_measure(accelerator, model, max_norm: float | None) -> torch.Tensor:
    """The global gradient norm before clipping (a device tensor, read when logged), clipping to `max_norm` when set
    (one pass over the grads).

    Off FSDP, the norm and the clipping are torch's `clip_grad_norm_`'s operators on the same values (so the same
    bits), less the copy of each parameter's norm to the first device it makes: one operator a parameter (290 for
    Qwen2-0.5B) of host work a step that does nothing where a stage's gradients share one device, as ours do off
    FSDP."""
    from alignpipe.distributed import is_fsdp

    if is_fsdp(accelerator):
        # sharded gradients: torch's clipping knows how to reduce their norm across ranks (inf: measure, scale by 1)
        return accelerator.clip_grad_norm_(model.parameters(), max_norm or float("inf"))
    if max_norm:
        accelerator.unscale_gradients()  # fp16's loss scale off the gradients before they are measured
    groups = _grads_by_kind(model)
    if not groups:
        return torch.zeros(())
    if len({grads[0].device for grads in groups}) > 1:  # a model spread over devices: torch's own
        return torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm or float("inf"))
    total = _total_norm(groups)
    if max_norm:
        scale = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        for grads in groups:
            torch._foreach_mul_(grads, scale)
    return total


class CheckpointSaveError(OSError):
    """A checkpoint could not be written; the earlier ones are untouched."""


class Checkpointer:
    """Resumable checkpoints under `<output_dir>/checkpoints/step-N` via `accelerator.save_state`
    (model, optimizer, scheduler, RNG) plus `state.json` with the step. `state.json` is written last,
    so a checkpoint without it (a kill mid-save) is ignored."""

    def __init__(self, output_dir: Path, keep: int):
        self.root = Path(output_dir) / "checkpoints"
        self.keep = keep
        self.resumed_from: Path | None = None
        """The checkpoint `resume` loaded, if any."""

    def save(
        self,
        accelerator,
        step: int,
        extra: dict | None = None,
        files: Sequence[Callable[[Path, int], None]] = (),
    ) -> Path:
        """Save step `step`; older checkpoints beyond `keep` are removed only once it is complete. `files`: writers
        of a trainer's own state into the checkpoint folder, `(path, step)`, run before `state.json` marks it
        complete. A failed save (a full disk, a read-only folder) removes its partial folder and raises
        CheckpointSaveError naming the cause and the checkpoint a re-run resumes from."""
        path = self.root / f"step-{step}"
        try:
            accelerator.save_state(str(path))
            for write in files:
                write(path, step)
            if accelerator.is_main_process:
                write_whole(path / "state.json", json.dumps({"step": step, **(extra or {})}))
        except OSError as e:
            shutil.rmtree(path, ignore_errors=True)
            kept = self.complete()
            raise CheckpointSaveError(
                f"saving checkpoint {path} failed: {e}. "
                + (f"The previous checkpoint {kept[-1]} is intact; " if kept else "No earlier checkpoint; ")
                + f"free space or fix permissions under {self.root} and re-run to resume"
            ) from e
        if accelerator.is_main_process:
            for old in self.complete()[: -self.keep]:
                shutil.rmtree(old, ignore_errors=True)
        accelerator.wait_for_everyone()
        return path

    def complete(self) -> list[Path]:
        if not self.root.exists():
            return []
        done = [p for p in self.root.glob("step-*") if (p / "state.json").exists()]
        return sorted(done, key=lambda p: int(p.name.split("-")[1]))

    def resume(self, accelerator) -> dict | None:
        """Load the newest complete checkpoint into the prepared objects; its state, or None."""
        done = self.complete()
        if not done:
            return None
        accelerator.load_state(str(done[-1]))
        self.resumed_from = done[-1]
        state = json.loads((done[-1] / "state.json").read_text())
        log.info("resumed from checkpoint %s (step %d)", done[-1], state["step"])
        return state


def ends_turns(model, tokenizer) -> None:
    """The model's generation config stops at the tokenizer's EOS too (`special_tokens.stop_token_ids`), so the saved
    model, loaded anywhere, ends a completion where it learnt to (a `model.eos_token` override included)."""
    from alignpipe.special_tokens import stop_token_ids

    config = getattr(model, "generation_config", None)
    stops = stop_token_ids(tokenizer, model)
    if config is not None and stops:
        config.eos_token_id = stops[0] if len(stops) == 1 else stops


def save_model(accelerator, model, tokenizer, out: Path) -> bool:
    """Save the (unwrapped) model and tokenizer to `out`. A peft model saves only its adapter.
    Returns True when an adapter was saved."""
    from alignpipe.distributed import is_fsdp

    unwrapped = accelerator.unwrap_model(model)
    adapter = hasattr(unwrapped, "peft_config")
    # sharded parameters are gathered into one full state dict (a collective: every rank takes part)
    state_dict = accelerator.get_state_dict(model) if is_fsdp(accelerator) else None
    if accelerator.is_main_process:
        try:
            out.mkdir(parents=True, exist_ok=True)
            ends_turns(unwrapped, tokenizer)
            unwrapped.save_pretrained(out, state_dict=state_dict)
            tokenizer.save_pretrained(out)
        except OSError as e:
            raise CheckpointSaveError(
                f"saving the trained model to {out} failed: {e}. The stage's checkpoints are kept: free space or "
                "fix permissions and re-run to resume from the last one"
            ) from e
    accelerator.wait_for_everyone()
    return adapter


class Throughput:
    """Tokens/s and samples/s between two log points, and for online trainers what their rollouts' generation took:
    `generation/tokens_per_s` (tokens sampled per second of the engine's calls) and `generation/time_share` (those
    calls' share of the window's wall time), and where the engine copies the policy's weights before it samples (a vLLM
    engine, a vLLM server's adapter) `generation/sync_time_share`, those copies' share. Token counts may be device
    tensors: they are summed where they are and read once, in `read()`."""

    def __init__(self):
        self.t0, self.samples = time.perf_counter(), 0
        self.tokens: int | torch.Tensor = 0
        self.generation_s, self.generated, self.sync_s = 0.0, 0, 0.0

    def add(self, tokens: int | torch.Tensor, samples: int) -> None:
        self.tokens = self.tokens + tokens
        self.samples += samples

    def add_generation(self, seconds: float, tokens: int) -> None:
        """A rollout's generation: the wall time of the engine's calls and the tokens they sampled. The calls end with
        the tokens on the host, so none of their device work is left out. On a GPU the first of them also waits for
        what the previous step left queued (its last kernels, a small share)."""
        self.generation_s += seconds
        self.generated += tokens

    def add_sync(self, seconds: float) -> None:
        """The wall time of copying the policy's weights into the rollout engine."""
        self.sync_s += seconds

    def read(self) -> dict[str, float]:
        dt = max(1e-9, time.perf_counter() - self.t0)
        out = {"tokens_per_s": float(self.tokens) / dt, "samples_per_s": self.samples / dt}
        if self.generation_s > 0:
            out["generation/tokens_per_s"] = self.generated / self.generation_s
            out["generation/time_share"] = min(1.0, self.generation_s / dt)
        if self.sync_s > 0:
            out["generation/sync_time_share"] = min(1.0, self.sync_s / dt)
        self.t0, self.tokens, self.samples = time.perf_counter(), 0, 0
        self.generation_s, self.generated, self.sync_s = 0.0, 0, 0.0
        return out


def device_memory(device: torch.device) -> dict[str, float]:
    """The most device memory this process's tensors took (`memory/max_allocated_gb`) and its allocator held
    (`memory/max_reserved_gb`, what the driver sees taken) since it started, in GB; nothing off a GPU. The
    allocator's own counters, read on the host; never reset here (a benchmark around the stage reads them too)."""
    if device.type != "cuda":
        return {}
    return {
        "memory/max_allocated_gb": torch.cuda.max_memory_allocated(device) / 1e9,
        "memory/max_reserved_gb": torch.cuda.max_memory_reserved(device) / 1e9,
    }


def accumulate(totals: dict[str, torch.Tensor], stats: dict[str, torch.Tensor], weight: float) -> None:
    """Add `weight` × each of `stats` (device tensors) into `totals`, on the device: a step's micro-batch means."""
    for k, v in stats.items():
        totals[k] = totals[k] + v * weight if k in totals else v * weight


# Metrics a step function reports as running totals: logged as the window's last value, not its mean.
RUNNING_TOTALS = frozenset({"num_tokens", "episode"})
# Metrics shown in the stage log's line at each log point, when a trainer reports them.
SHOWN = ("loss", "reward", "rewards/margins", "accuracy", "objective/scores", "objective/kl", "lr")


# Metrics that add up over processes (each rank's throughput is its share of the step's).
SUMMED = frozenset({"tokens_per_s", "samples_per_s", "generation/tokens_per_s", "eps"})


def extreme(key: str):
    """`max` or `min` for a metric that is an extreme (…/max, …/min, completions/max_length, …/min_length, a device's
    memory/max_…): over processes it is the extreme of the ranks', as TRL gathers it, not their mean; else None."""
    last = key.rsplit("/", 1)[-1]
    if last in ("max", "max_length") or key.startswith("memory/max_"):
        return max
    if last in ("min", "min_length"):
        return min
    return None


def mean_over_processes(accelerator, value: float | torch.Tensor) -> float:
    """`value`'s mean over the processes of a multi-process stage (an all-reduce every process must join), for a
    decision they must all take alike; `value` itself in one process."""
    if accelerator.num_processes == 1:
        return float(value)
    tensor = value.detach().float().clone() if isinstance(value, torch.Tensor) else torch.tensor(float(value))
    return float(accelerator.reduce(tensor.to(accelerator.device), "mean"))


def across_processes(accelerator, metrics: dict[str, float]) -> dict[str, float]:
    """One log point's metrics over all processes: the mean of each rank's (a step's global mean where every rank
    holds an equal share of the batch), throughputs summed, extremes (`extreme`) the ranks' extreme, running totals
    (already global) as rank 0 has them. A metric some ranks did not report in this window is reduced over those
    that did."""
    if accelerator.num_processes == 1:
        return metrics
    from accelerate.utils import gather_object

    ranks: list[dict[str, float]] = gather_object([metrics])
    out = {}
    for k in dict.fromkeys(k for r in ranks for k in r):
        values = [r[k] for r in ranks if k in r]
        if k in RUNNING_TOTALS:
            out[k] = metrics.get(k, values[0])
        elif k in SUMMED:
            out[k] = float(sum(values))
        elif (pick := extreme(k)) is not None:
            out[k] = float(pick(values))
        else:
            out[k] = float(sum(values) / len(values))
    return out


def batch_loader(
    accelerator,
    examples: list,
    batch_size: int,
    collate,
    generator=None,
    drop_last: bool = False,
    shuffle: bool = True,
    workers: int = 0,
):
    """The prepared loader of a stage's examples, shuffled by `generator` unless `shuffle` is off, collated in
    `workers` processes beside training (0: in this one, as the loop asks for each batch). On a GPU its batches are
    page-locked and copied without a wait (`make_accelerator`): a blocking copy would drain the device's queue at
    every batch."""
    from torch.utils.data import DataLoader, Dataset

    if workers:
        # a forked worker's tokenizer runs single-threaded either way; said explicitly, tokenizers does not warn
        # about the fork in every worker
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
        # the worker's batches cross in one buffer each (one shared-memory descriptor, one pinning, one copy to the
        # device), which the loader's device placement unpacks into the batch as collated
        collate = _in_one_buffer(collate)
    return accelerator.prepare_data_loader(
        DataLoader(
            cast("Dataset", examples),
            batch_size=batch_size,
            shuffle=shuffle,
            generator=generator,
            collate_fn=collate,
            drop_last=drop_last,
            pin_memory=accelerator.device.type == "cuda",
            num_workers=workers,
            worker_init_fn=_forget_the_parents_thread_exit_hooks,  # run by workers only: none where workers=0
        )
    )


def _forget_the_parents_thread_exit_hooks(worker_id: int) -> None:
    """A loader worker is forked from the training process, and inherits the exit hooks that its libraries registered
    for their background threads (`threading._register_atexit`), though not the threads. A hook that drains such a
    thread fails in the worker: Prefect 3's API-log and event services assert, so a trainer called in a process where
    Prefect had run a flow saw each worker exit with status 1 at the end of its pass, and the loader raise
    "DataLoader worker exited unexpectedly". The worker only collates; nothing of theirs is its to flush."""
    hooks = getattr(threading, "_threading_atexits", None)
    if isinstance(hooks, list):
        hooks.clear()


def _in_one_buffer(collate):
    def collate_in_one_buffer(rows):
        return OneBuffer.of(collate(rows))

    return collate_in_one_buffer


def loader_workers(cfg: TrainingArgs, device: torch.device, collates: bool = True) -> int:
    """`dataloader_workers`, its default resolved: 1 on a CUDA device where the loader's `collate` does work
    (`collates`: the offline trainers tokenize and lay out batches; the online ones hand prompt rows on as they are,
    to a rollout), 0 elsewhere."""
    if cfg.dataloader_workers is not None:
        return cfg.dataloader_workers
    return 1 if collates and torch.device(device).type == "cuda" else 0


class TrainLoop:
    """The optimisation loop every offline trainer shares.

    Set-up: Accelerator, optional LoRA, optimizer + schedule, resume from the newest checkpoint.
    `run(step_fn)`: each step takes a window of `batches_per_step` micro-batches (default
    `gradient_accumulation_steps`; epochs are re-shuffled with `seed + epoch` unless `shuffle` is off, so a resumed
    run sees the same batches), calls `step_fn(window) -> metrics` (which does the backward passes), clips, steps,
    logs the mean of the step metrics every `logging_every` steps under `metric_prefix`, evaluates with
    `eval_fn() -> metrics` under `eval/`, and checkpoints every `save_every` steps (with `checkpoint_state()` beside the step).

    A trainer that takes several optimizer steps per step itself (PPO: epochs × mini-batches over one rollout)
    passes `updates_per_step`: the schedule is sized for that many and the loop leaves the optimizer alone.
    `adapt_model=False` hands over a model that already has its LoRA adapters and activation checkpointing.
    """

    def __init__(
        self,
        name: str,
        cfg: TrainingArgs,
        model,
        examples: list[dict],
        collate,
        tracker,
        output_dir,
        seed: int,
        lora_task: str = "CAUSAL_LM",
        rows_per_batch: int | None = None,
        repeat: int = 1,
        batches_per_step: int | None = None,
        updates_per_step: int | None = None,
        adapt_model: bool = True,
        drop_last: bool = False,
        metric_prefix: str = "train/",
        summary_keys: tuple[str, ...] = ("loss",),
        collates: bool = True,
    ):
        from alignpipe.distributed import make_accelerator
        from alignpipe.modeling import count_parameters, disable_dropout, enable_activation_checkpointing, lora_model

        if not examples:
            raise ValueError(
                f"{name}: the training split is empty (check the format stage's max_length and eval_fraction)"
            )
        self.name, self.cfg, self.tracker = name, cfg, tracker
        self.repeat = repeat  # optimizer steps per window of data (GRPO's num_iterations)
        self.batches_per_step = batches_per_step or cfg.gradient_accumulation_steps
        self.updates_per_step = updates_per_step
        self.prefix, self.summary_keys = metric_prefix, summary_keys
        self.checkpoint_state: Callable[[], dict] | None = None
        self.after_step: list[Callable[[int], None]] = []
        """Called with the step number after each optimizer step the loop takes (e.g. `ref_sync.ReferenceSync`)."""
        self.checkpoint_files: list[Callable[[Path, int], None]] = []
        """Writers of a trainer's own state into each checkpoint folder (`Checkpointer.save`'s `files`)."""
        self.output_dir = Path(output_dir)
        self.seed = seed
        seed_everything(seed)
        self.accelerator = make_accelerator()
        if adapt_model and cfg.gradient_checkpointing:
            enable_activation_checkpointing(model, cfg.checkpoint_every_n_layers)
            model.config.use_cache = False
        if adapt_model and cfg.lora:
            model = lora_model(model, cfg.lora, task_type=lora_task)
        if adapt_model and cfg.compile:
            compile_layers(model)
        elif adapt_model and lean_patched(cfg):
            lean_activations(model, fused=cfg.fused_kernels)
        if cfg.disable_dropout:  # after LoRA, whose dropout goes too (as TRL's)
            disable_dropout(model)
        self.offload = (
            offload.offload_activations(model, self.accelerator.device) if cfg.activation_offloading else None
        )
        trainable, total = count_parameters(model)
        if self.accelerator.is_main_process:
            tracker.log_params(
                {
                    name: config_params(cfg),
                    "model.trainable_params": trainable,
                    "model.total_params": total,
                    **kernels_run(model, cfg, self.accelerator.device),
                }
            )

        def loader(epoch: int):
            g = torch.Generator().manual_seed(seed + epoch)
            size = rows_per_batch or cfg.batch_size
            workers = loader_workers(cfg, self.accelerator.device, collates)
            return batch_loader(self.accelerator, examples, size, collate, g, drop_last, cfg.shuffle, workers)

        self._loader = loader
        self.micro_per_epoch = len(loader(0))
        if not self.micro_per_epoch:
            raise ValueError(f"{name}: the training split has fewer rows than one step takes")
        self.steps = total_steps(cfg, self.micro_per_epoch, self.batches_per_step) * (1 if cfg.max_steps else repeat)
        optimizer = build_optimizer(model, cfg)
        scheduler = build_scheduler(optimizer, cfg, self.steps * (updates_per_step or 1))
        # The scheduler stays out of `prepare`: accelerate's wrapper steps it once per process per call,
        # which would decay the learning rate `num_processes` times too fast. It is still checkpointed.
        self.model, self.optimizer = self.accelerator.prepare(model, optimizer)
        self.scheduler = scheduler
        self.accelerator.register_for_checkpointing(scheduler)
        self.checkpoints = Checkpointer(self.output_dir, cfg.save_total_limit)
        self.state = self.checkpoints.resume(self.accelerator)
        self.step = self.state["step"] if self.state else 0
        self.meter = Throughput()
        self.losses = LossWatch()

    def count(self, tokens: int | torch.Tensor, samples: int) -> None:
        """Add work done outside the data loader's batches (e.g. a rollout's generated tokens) to tokens_per_s and
        samples_per_s."""
        self.meter.add(tokens, samples)

    def count_generation(self, seconds: float, tokens: int) -> None:
        """Add a rollout's generation (its engine calls' wall time, the tokens they sampled) to this window's
        generation/tokens_per_s and generation/time_share."""
        self.meter.add_generation(seconds, tokens)

    def count_sync(self, seconds: float) -> None:
        """Add the time a copy of the policy's weights into the rollout engine took to this window's
        generation/sync_time_share."""
        self.meter.add_sync(seconds)

    @property
    def iteration(self) -> int:
        """Which of the `repeat` optimizer steps on the current window this is (0-based)."""
        return self.step % self.repeat

    @property
    def unwrapped(self):
        return self.accelerator.unwrap_model(self.model)

    def no_sync_unless(self, last: bool):
        """Skip the DDP gradient all-reduce on all but the last micro-batch of a step."""
        return contextlib.nullcontext() if last else self.accelerator.no_sync(self.model)

    def _micro_batches(self, start: int):
        m = start
        while True:
            epoch, offset = divmod(m, self.micro_per_epoch)
            dl = self._loader(epoch)
            yield from (self.accelerator.skip_first_batches(dl, offset) if offset else dl)
            m = (epoch + 1) * self.micro_per_epoch

    def log(self, metrics: dict[str, float]) -> None:
        if self.accelerator.is_main_process:
            self.tracker.log_metrics(metrics, self.step)

    def _check_finite(self, metrics: dict) -> None:
        """Stop on a non-finite metric already on the host (no device read: the loss is `_watch_loss`'s)."""
        bad = sorted(k for k, v in metrics.items() if isinstance(v, float) and not math.isfinite(v))
        if bad:
            self._stop(", ".join(f"{k} is {metrics[k]}" for k in bad), self.step + 1)

    def _watch_loss(self, metrics: dict) -> None:
        """Hand this step's loss to the watch without reading it (`LossWatch`)."""
        self.losses.watch(self.step + 1, metrics.get("loss"))

    def _check_losses(self) -> None:
        """Stop if a watched loss was NaN/inf; a wait only for copies still in flight."""
        bad = self.losses.first_bad()
        if bad:
            self._stop(f"loss is {bad[1]}", bad[0])

    def _stop(self, what: str, step: int):
        last = self.checkpoints.complete()
        raise FloatingPointError(
            f"{self.name}: {what} at step {step}; last checkpoint kept: {last[-1] if last else 'none (set save_every)'}"
        )

    def _optimizer_step(self) -> torch.Tensor:
        gnorm = clip_and_measure(self.accelerator, self.model, self.cfg.max_grad_norm)
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return gnorm

    def run(self, step_fn, eval_fn=None) -> TrainResult:
        cfg, acc = self.cfg, self.accelerator
        started = time.perf_counter()
        batches = self._micro_batches((self.step // self.repeat) * self.batches_per_step)
        meter = self.meter = Throughput()
        window_metrics: list[dict[str, float | torch.Tensor]] = []
        bar = progress(self.steps, self.name, acc.is_main_process, initial=self.step)
        try:
            self.model.train()
            window: list = []
            upcoming: list | None = None  # the next step's window, fetched while this step's work was queued

            def next_window() -> list:
                return [next(batches) for _ in range(self.batches_per_step)]

            while self.step < self.steps:
                if upcoming is not None:
                    window, upcoming = upcoming, None
                elif self.step % self.repeat == 0 or not window:
                    window = next_window()
                metrics = dict(step_fn(window))
                if self.offload is not None:
                    metrics["offloaded_gb"] = self.offload.bytes_moved() / 1e9
                self._check_finite(metrics)
                self._check_losses()  # the previous step's, landed on the host while this one was queued
                self._watch_loss(metrics)
                if self.updates_per_step is None:
                    metrics["grad_norm"] = self._optimizer_step()
                self.step += 1
                for hook in self.after_step:
                    hook(self.step)
                for b in window:
                    if isinstance(b, dict) and "attention_mask" in b:
                        meter.add(b["attention_mask"].sum(), len(b["attention_mask"]))
                if self.step < self.steps and self.step % self.repeat == 0:
                    # The next window is collated and its copies queued now, while the device still runs this step:
                    # a log point below waits for the device, and the host would otherwise collate after it.
                    upcoming = next_window()
                window_metrics.append(metrics)
                bar.update(1)
                if self.step % cfg.logging_every == 0 or self.step == self.steps:
                    self._check_losses()  # this point reads the metrics anyway
                    # step functions may report device tensors: they are read here, once per log point
                    # a metric a step did not report (e.g. KTO's rewards/chosen in a step without desirable rows) is
                    # averaged over the steps that did
                    keys = dict.fromkeys(k for m in window_metrics for k in m)
                    mean = {}
                    for k in keys:
                        values = [m[k] for m in window_metrics if k in m]
                        mean[k] = float(values[-1] if k in RUNNING_TOTALS else sum(values) / len(values))
                    mean |= meter.read() | device_memory(acc.device)
                    mean = across_processes(acc, mean)
                    mean |= {
                        "lr": self.scheduler.get_last_lr()[0],
                        "epoch": self.step * cfg.gradient_accumulation_steps / self.micro_per_epoch,
                    }
                    self.log({f"{self.prefix}{k}": v for k, v in mean.items()})
                    shown = {k: mean[k] for k in SHOWN if k in mean}
                    bar.set_postfix({k.split("/")[-1]: f"{v:.4g}" for k, v in shown.items() if k != "lr"})
                    if acc.is_main_process:  # one line per log point in the stage log (Prefect UI, CI logs)
                        log.info(
                            "%s step %d/%d %s",
                            self.name,
                            self.step,
                            self.steps,
                            " ".join(f"{k}={v:.4g}" for k, v in shown.items()),
                        )
                    window_metrics = []
                if eval_fn and cfg.eval_every and self.step % cfg.eval_every == 0 and self.step != self.steps:
                    self._check_losses()
                    self.log({f"eval/{k}": v for k, v in eval_fn().items()})
                    self.model.train()
                if cfg.save_every and self.step % cfg.save_every == 0 and self.step != self.steps:
                    self._check_losses()  # no checkpoint after a diverged step
                    self.checkpoints.save(
                        acc,
                        self.step,
                        self.checkpoint_state() if self.checkpoint_state else None,
                        self.checkpoint_files,
                    )
        finally:  # a failed step or save ends the bar too, not leaving it half-drawn
            bar.close()
        final: dict[str, float] = {}
        for key in (self.prefix + k for k in self.summary_keys):
            if self.tracker.last(key) is not None:
                final[key] = self.tracker.last(key)
        if eval_fn:
            ev = eval_fn()
            self.log({f"eval/{k}": v for k, v in ev.items()})
            final |= {f"eval/{k}": v for k, v in ev.items()}
        return TrainResult(
            model_dir=self.output_dir / "model",
            steps=self.step,
            metrics=final,
            seconds=time.perf_counter() - started,
            resumed_from=self.state["step"] if self.state else None,
        )

    def save(self, tokenizer, merge_adapter: bool = False) -> tuple[Path, bool]:
        """Save to `<output_dir>/model`; an adapter is merged first when `merge_adapter`."""
        out = self.output_dir / "model"
        model = self.model
        if merge_adapter and hasattr(self.unwrapped, "merge_and_unload"):
            model = self.unwrapped.merge_and_unload()
        return out, save_model(self.accelerator, model, tokenizer, out)
