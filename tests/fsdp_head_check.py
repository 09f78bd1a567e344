"""Run by tests/test_multiprocess.py under `torch.distributed.run` with two ranks: log-probs and every gradient of an
FSDP2-sharded model equal the plain model's, with the LM head run chunk by chunk outside the forward where the
layout keeps it gathered (accelerate's), and inside the forward where the root re-shards it. Prints one JSON line
per layout on rank 0."""

import copy
import json
import os
import sys

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard

from alignpipe import logprobs
from alignpipe.distributed import FSDP_ENV, make_accelerator
from alignpipe.logprobs import RESHARDS_HEAD, token_logprobs
from alignpipe.modeling import load_causal_lm

logprobs.WHOLE_LOGITS_MAX = 0  # chunk even the tiny model's head
os.environ.update(FSDP_ENV)
accelerator = make_accelerator()
plain = load_causal_lm(sys.argv[1])
ids = torch.randint(2, 500, (3, 12), generator=torch.Generator().manual_seed(2))
mask = torch.ones_like(ids)
mask[1, :3] = 0
expected = token_logprobs(plain, ids, mask, chunk_tokens=6)
expected.sum().backward()
expected_grads = {n: p.grad for n, p in plain.named_parameters()}


def check(model, layout):
    widths = []
    handle = model.get_output_embeddings().register_forward_hook(lambda _m, a, _o: widths.append(a[0].shape[1]))
    got = token_logprobs(model, ids, mask, chunk_tokens=6)
    got.sum().backward()
    handle.remove()
    grads = {n: p.grad.full_tensor() for n, p in model.named_parameters()}
    result = {
        "layout": layout,
        "values": (got - expected).abs().max().item(),
        "grad": max((grads[n] - g).abs().max().item() for n, g in expected_grads.items()),
        "widths": widths,
        "reshards_head": getattr(model, RESHARDS_HEAD, False),
    }
    if dist.get_rank() == 0:
        print(json.dumps(result), flush=True)


sharded = copy.deepcopy(plain)
sharded, _ = accelerator.prepare(sharded, torch.optim.SGD(sharded.parameters(), lr=0.0))  # FSDP2 wants both
check(sharded, "accelerate")
resharded = copy.deepcopy(plain)
for layer in resharded.model.layers:
    fully_shard(layer)
fully_shard(resharded, reshard_after_forward=True)  # the root (embeddings, norm, head) re-shards after forward
check(resharded, "root-reshards")
dist.barrier()
os._exit(0)  # no teardown: gloo's threads can hold a process group's destruction forever
