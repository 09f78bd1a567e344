"""How the processes of a multi-process stage share the model (`resources.strategy`).

`ddp`: every rank holds the whole model and optimizer state; gradients are all-reduced.
`fsdp`: FSDP2 (torch's `fully_shard`, through accelerate): parameters, gradients and optimizer state are sharded
across ranks, each decoder layer gathered only while it runs. Checkpoints are sharded (one file per rank, torch
distributed checkpoint); the final model is gathered and saved as an ordinary transformers folder.

The stage process turns the recipe's choice into accelerate's own environment (what `accelerate launch --use_fsdp`
or an accelerate config file with `distributed_type: FSDP` sets), so on GPUs accelerate does everything itself.
"""

from __future__ import annotations

import os

import torch

FSDP_ENV = {
    "ACCELERATE_USE_FSDP": "true",
    "FSDP_VERSION": "2",
    "FSDP_AUTO_WRAP_POLICY": "TRANSFORMER_BASED_WRAP",  # one shard group per decoder layer (`_no_split_modules`)
    "FSDP_STATE_DICT_TYPE": "SHARDED_STATE_DICT",
    "FSDP_RESHARD_AFTER_FORWARD": "true",
}


def select_strategy(strategy: str) -> None:
    """Set accelerate's FSDP environment for `fsdp`; values an accelerate config file already set are kept."""
    if strategy == "fsdp":
        for key, value in FSDP_ENV.items():
            os.environ.setdefault(key, value)


def use_rank_device() -> None:
    """On a machine with GPUs, make a rank's own GPU (`LOCAL_RANK`) the current CUDA device before its stage loads
    anything: what a stage places on "cuda" before the trainer's accelerator exists (the reward models an RL stage
    scores with) then lands on that rank's GPU instead of every rank's on GPU 0. Accelerate does the same when its
    state is made, which is later. One process, or no GPU: nothing to do."""
    if int(os.environ.get("WORLD_SIZE", "1")) > 1 and torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))


def fsdp_requested() -> bool:
    return os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true"


def make_accelerator():
    """The stage's Accelerator: CPU where no CUDA device is visible; FSDP when requested and there is more than one
    process."""
    from accelerate import Accelerator
    from accelerate.state import PartialState
    from accelerate.utils import DataLoaderConfiguration, DistributedType, FullyShardedDataParallelPlugin

    cuda = torch.cuda.is_available()
    # Batches go to the GPU without a wait: a blocking copy drains the device's queue at every batch, and the host
    # then collates the batch after next while the device idles (the loaders pin their batches on CUDA).
    acc = Accelerator(cpu=not cuda, dataloader_config=DataLoaderConfiguration(non_blocking=cuda))
    if fsdp_requested() and acc.distributed_type == DistributedType.MULTI_CPU:
        # accelerate turns FSDP on only for accelerator devices, but `fully_shard` runs on CPU with gloo too: this is
        # how FSDP is tested against one process on machines without a GPU. Both shared states carry the type (the
        # accelerator reads one, its collectives the other).
        acc.state.fsdp_plugin = getattr(acc.state, "fsdp_plugin", None) or FullyShardedDataParallelPlugin()
        acc.state.distributed_type = DistributedType.FSDP
        PartialState().distributed_type = DistributedType.FSDP
    return acc


def is_fsdp(accelerator) -> bool:
    from accelerate.utils import DistributedType

    return accelerator.distributed_type == DistributedType.FSDP
