"""Run by a test under `torch.distributed.run` with two ranks: `LowPrecisionAdamW` on a bf16 model sharded by FSDP2 (its
parameters, gradients and states DTensors) takes the steps it takes on the unsharded model, and its state,
compensation included, comes out of torch's distributed `get_optimizer_state_dict`. Prints one JSON line on rank 0,
then exits without teardown (a gloo group's teardown can wait forever on its threads)."""

import copy
import json
import os
from typing import cast

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from alignpipe.low_precision_adamw import LowPrecisionAdamW

dist.init_process_group("gloo")
torch.manual_seed(0)
plain = torch.nn.Sequential(torch.nn.Linear(64, 96), torch.nn.GELU(), torch.nn.Linear(96, 8)).bfloat16()
sharded = copy.deepcopy(plain)
for layer in (sharded[0], sharded[2]):
    fully_shard(layer)
fully_shard(sharded)
optimizers = [LowPrecisionAdamW(m.parameters(), lr=1e-4, weight_decay=0.01) for m in (plain, sharded)]
x = torch.randn(16, 64, generator=torch.Generator().manual_seed(1)).bfloat16()  # the same batch on both ranks
for _ in range(5):
    for model, opt in zip((plain, sharded), optimizers):
        model(x).float().pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
gap = max(
    (a.detach().float() - cast(DTensor, b).full_tensor().float()).abs().max().item()
    for a, b in zip(plain.parameters(), sharded.parameters())
)
comp_gap = max(
    (optimizers[0].state[a]["kahan_comp"].float() - optimizers[1].state[b]["kahan_comp"].full_tensor().float())
    .abs()
    .max()
    .item()
    for a, b in zip(plain.parameters(), sharded.parameters())
)
state = get_optimizer_state_dict(sharded, optimizers[1], options=StateDictOptions(full_state_dict=True))
saved = sorted({key for per_param in cast(dict, state["state"]).values() for key in per_param})
sharded_states = all(hasattr(optimizers[1].state[p]["kahan_comp"], "full_tensor") for p in sharded.parameters())
if int(os.environ["RANK"]) == 0:
    print(json.dumps({"gap": gap, "comp_gap": comp_gap, "saved": saved, "sharded_states": sharded_states}), flush=True)
os._exit(0)
