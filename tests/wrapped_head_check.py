"""Run by tests in a child process: `python wrapped_head_check.py ddp MODEL [ATTENTION]` (one gloo rank) or, under
`torch.distributed.run` with two ranks, `... fsdp MODEL`. Log-probs and every gradient of the wrapped model equal the
plain model's; the LM head runs chunk by chunk outside the wrapper's forward (DDP; FSDP with accelerate's layout,
which keeps the head gathered) or inside it (an FSDP root that re-shards the head after the forward). A DPO batch's
loss and every gradient equal the plain model's too, through the fused head where the head runs outside the forward. Prints one
JSON line per layout on rank 0, then exits without teardown: freeing DDP's reducer or a gloo group can wait forever
on gloo's threads."""

import copy
import json
import os
import sys
from typing import Any

import torch
import torch.distributed as dist

from alignpipe import logprobs
from alignpipe.logprobs import RESHARDS_HEAD, token_logprobs
from alignpipe.modeling import load_causal_lm
from alignpipe.trainers import dpo
from alignpipe.trainers.configs import DPOConfig

logprobs.WHOLE_LOGITS_MAX = 0  # chunk even the tiny model's head
mode, path = sys.argv[1:3]
attention = sys.argv[3] if len(sys.argv) > 3 else "sdpa"  # varlen: the DPO batch runs padding-free, prompts shared
plain = load_causal_lm(path, attention=attention)
ids = torch.randint(2, 500, (3, 12), generator=torch.Generator().manual_seed(2))
mask = torch.ones_like(ids)
mask[1, :3] = 0
expected = token_logprobs(plain, ids, mask, chunk_tokens=6)
expected.sum().backward()
expected_grads = {n: p.grad for n, p in plain.named_parameters()}

# DPO's fused head (`fused_pair_loss`: hidden states from the same route, gradients formed in the forward)
pairs = [
    {"prompt_ids": ids[i, : 3 + i].tolist(), "chosen_ids": ids[i, 5:].tolist(), "rejected_ids": ids[i, 7:].tolist()}
    for i in range(3)
]
dpo_batch = dpo.collate(pairs, 0, 16, packed="shared" if attention == "varlen" else None)
refs = (torch.tensor([-40.0, -35.0, -30.0]), torch.tensor([-30.0, -33.0, -36.0]))
fused_calls: list[Any] = []
fused_pair_loss = dpo.fused_pair_loss
dpo.fused_pair_loss = lambda *a: fused_calls.append(fused_pair_loss(*a)) or fused_calls[-1]
plain.zero_grad()
expected_dpo = dpo.batch_loss(plain, dpo_batch, lambda _b: refs, DPOConfig())[0]
expected_dpo.backward()
expected_dpo_grads = {n: p.grad.clone() for n, p in plain.named_parameters()}
assert fused_calls[-1] is not None, "the plain model's DPO batch took the fused head"


def check(model, layout, full=lambda grad: grad):
    widths = []
    handle = model.get_output_embeddings().register_forward_hook(lambda _m, a, _o: widths.append(a[0].shape[1]))
    got = token_logprobs(model, ids, mask, chunk_tokens=6)
    got.sum().backward()
    handle.remove()
    grads = {n.removeprefix("module."): full(p.grad) for n, p in model.named_parameters()}
    model.zero_grad()
    taken = len(fused_calls)
    loss = dpo.batch_loss(model, dpo_batch, lambda _b: refs, DPOConfig())[0]
    loss.backward()
    dpo_grads = {n.removeprefix("module."): full(p.grad) for n, p in model.named_parameters()}
    result = {
        "layout": layout,
        "values": (got - expected).abs().max().item(),
        "grad": max((grads[n] - g).abs().max().item() for n, g in expected_grads.items()),
        "widths": widths,
        "reshards_head": getattr(model, RESHARDS_HEAD, False),
        "dpo_fused": [r is not None for r in fused_calls[taken:]] == [True],
        "dpo_loss": abs(float(loss.detach()) - float(expected_dpo.detach())),
        "dpo_grad": max((dpo_grads[n] - g).abs().max().item() for n, g in expected_dpo_grads.items()),
    }
    if dist.get_rank() == 0:
        print(json.dumps(result), flush=True)


if mode == "ddp":
    dist.init_process_group("gloo", rank=0, world_size=1)
    wrapped = torch.nn.parallel.DistributedDataParallel(copy.deepcopy(plain))
    wrapped.get_output_embeddings = wrapped.module.get_output_embeddings
    check(wrapped, "ddp")
else:
    from torch.distributed.fsdp import fully_shard

    from alignpipe.distributed import FSDP_ENV, make_accelerator

    os.environ.update(FSDP_ENV)
    accelerator = make_accelerator()
    sharded = copy.deepcopy(plain)
    sharded, _ = accelerator.prepare(sharded, torch.optim.SGD(sharded.parameters(), lr=0.0))  # FSDP2 wants both
    check(sharded, "accelerate", lambda grad: grad.full_tensor())
    resharded = copy.deepcopy(plain)
    for layer in resharded.model.layers:
        fully_shard(layer)
    fully_shard(resharded, reshard_after_forward=True)  # the root (embeddings, norm, head) re-shards after forward
    check(resharded, "root-reshards", lambda grad: grad.full_tensor())
    dist.barrier()
os._exit(0)
