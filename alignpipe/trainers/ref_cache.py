"""Reference log-probs computed once before training and cached on disk (`precompute_ref_logps` of DPO and KTO)."""

from __future__ import annotations

import hashlib
import json
import logging
import math
from collections.abc import Callable
from pathlib import Path

import torch

from alignpipe.device_copies import to_device
from alignpipe.progress import progress
from alignpipe.trainers.common import TrainLoop

log = logging.getLogger(__name__)


def cached_reference_logps(
    splits: dict[str, list[dict]],
    identity: Callable[[dict], list],
    fields: tuple[str, str],
    score: Callable[[dict], tuple[torch.Tensor, torch.Tensor]],
    collate_fn,
    loop: TrainLoop,
    path: Path,
    can_recompute: bool,
) -> None:
    """Fill the two `fields` of every example of `splits` with its reference log-probs, from the cache at `path` when
    it was computed for the same examples (their `identity`: the token ids the values depend on), else by
    `score(collated batch) -> (first, second)` over batches of the stage's `precompute_ref_batch_size` (else its
    `batch_size`), shared out over the stage's processes, under a progress bar, then cached (by the main
    process). A run resumed past step 0 without its cache is refused unless `can_recompute` (a frozen copy, or the
    adapter-disabled policy, still holds the reference; a full model's policy has moved)."""
    key = hashlib.sha256(
        json.dumps({name: [identity(e) for e in examples] for name, examples in splits.items()}).encode()
    ).hexdigest()
    cached = torch.load(path) if path.exists() else None
    if cached is None or cached.get("key") != key:
        if loop.step > 0 and not can_recompute:
            raise RuntimeError(
                f"resuming a full-model {loop.name.upper()} run whose reference log-probs cache {path} is missing; re-run "
                "the stage from scratch (--force) or pass a reference model"
            )
        cached = {"key": key}
        size = getattr(loop.cfg, "precompute_ref_batch_size", None) or loop.cfg.batch_size
        loop.model.eval()
        acc = loop.accelerator
        rows = sum(len(examples) for examples in splits.values())
        with progress(rows, f"{loop.name} reference log-probs", acc.is_main_process) as bar:
            for name, examples in splits.items():
                cached[name] = _scored_by_all_ranks(examples, score, collate_fn, size, acc, bar)
        loop.model.train()
        if loop.accelerator.is_main_process:
            path.parent.mkdir(parents=True, exist_ok=True)
            torch.save(cached, path)
        log.info("precomputed reference log-probs for %s", {k: len(v) for k, v in splits.items()})
    else:
        log.info("reusing cached reference log-probs %s", path)
    for name, examples in splits.items():
        for e, (first, second) in zip(examples, cached[name].tolist(), strict=True):
            e[fields[0]], e[fields[1]] = first, second


def _scored_by_all_ranks(examples: list[dict], score, collate_fn, size: int, acc, bar) -> torch.Tensor:
    """(len(examples), 2) reference log-probs on the host. Several processes share the work: rank r scores examples
    r, r + world, … in batches of `size` and every rank gets all of them back (`gather_object`). Each rank runs the
    same number of batches, a rank out of rows scoring one row again unused, because an FSDP model's forward
    gathers its shards from every rank."""
    rank, world = acc.process_index, acc.num_processes
    mine = examples[rank::world]
    batches = math.ceil(math.ceil(len(examples) / world) / size)
    values = []
    for b in range(batches):
        chunk = mine[b * size : (b + 1) * size]
        first, second = score(to_device(collate_fn(chunk or examples[:1]), acc.device))
        if chunk:
            values.append(torch.stack([first, second], 1).float().cpu())
        bar.update(min(len(examples) - b * size * world, size * world))
    local = torch.cat(values) if values else torch.zeros(0, 2)
    if world == 1:
        return local
    from accelerate.utils import gather_object

    scored = torch.zeros(len(examples), 2)
    for r, part in enumerate(gather_object([local])):
        scored[r::world] = part
    return scored
