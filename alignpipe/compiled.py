"""`compile: true` on a training stage: `torch.compile` of each decoder layer, in place.

Per layer, not the whole model, because the trainers reach the model by several doors: the decoder and the LM head
called apart (the chunked head, the shared-prompt path), the wrapper's forward under DDP and FSDP. Compiled layers
serve all of them, a graph break outside the layers costs nothing, and the layers being alike, one compiled graph
serves them all (their parameters are the graph's inputs). What it buys, on a GPU: the normalisation, rotary and
activation element-wise work fused into few kernels, far fewer launches per step. What it costs: compilation in the
first step. The layers compile with their sizes symbolic from the first batch (`dynamic=True`): every trainer's
batches change length, and packed ones their documents' count and offsets too; left to specialise, the layer
recompiled at the first change of each (on CPU, tests/test_compile.py; on the first H100 run the compiled steady
rate fell below eager's, which such recompiles inside the timed steps would explain). Activation
checkpointing and LoRA layers compile with the layer they belong to; under FSDP the layers are compiled before they
are sharded (the order torchtitan uses). The loss kernels of the LM head's chunks compile apart
(`compiled_function`)."""

from __future__ import annotations

import functools
import logging

import torch

log = logging.getLogger(__name__)


def decoder_layers(model: torch.nn.Module) -> torch.nn.ModuleList:
    """The model's stack of transformer blocks: the longest `ModuleList` whose modules are all of one class."""
    stacks = [
        m for m in model.modules() if isinstance(m, torch.nn.ModuleList) and len(m) and len({type(x) for x in m}) == 1
    ]
    best = max(stacks, key=len, default=None)
    if best is None:
        raise ValueError(f"compile: found no stack of decoder layers in {type(model).__name__} to compile")
    return best


def compile_layers(model: torch.nn.Module) -> int:
    """Compile each decoder layer of `model` in place (state dict, parameters and hooks unchanged); how many."""
    layers = decoder_layers(model)
    for layer in layers:
        layer.compile(dynamic=True)
    return len(layers)


@functools.cache
def compiled_function(fn):
    """`fn` through `torch.compile` with dynamic shapes, compiled once per process (chunks of an LM head differ in
    rows): the loss kernels `compile: true` fuses (`linear_ce`, `logprobs`) and `fused_kernels`' compiled ones.

    Nothing is compiled, or imported from the compiler, before the first call. Where the compiler fails on this
    device (no working Triton, an unsupported operator), the failure is said once and `fn` runs eagerly from then
    on: `fused_kernels.available` no longer tries the compiler in a process whose element-wise kernels are the
    hand-written ones, so a kernel compiled later (a rollout's fused residuals, a head in a dtype Triton's kernels
    do not take) is the first to meet it."""
    return _CompiledOrEager(fn)


class _CompiledOrEager:
    """`torch.compile(fn, dynamic=True)`, built at the first call; `fn` itself once compiling it has failed."""

    def __init__(self, fn):
        self.fn = fn
        self.compiled = None
        self.failed = False
        functools.update_wrapper(self, fn)

    def __call__(self, *args, **kwargs):
        if self.failed:
            return self.fn(*args, **kwargs)
        if self.compiled is None:
            self.compiled = torch.compile(self.fn, dynamic=True)
        try:
            return self.compiled(*args, **kwargs)
        except _compiler_errors() as err:
            self.failed = True
            log.warning("compiled: torch.compile cannot build %s (%s); it runs eagerly", self.fn.__name__, err)
            return self.fn(*args, **kwargs)


def _compiler_errors() -> type[BaseException]:
    """The errors of dynamo and inductor (`InductorError` and `BackendCompilerFailed` among them), looked up only as
    an exception is matched: the compiler stays unimported in a process that compiles nothing. Not RuntimeError: a
    compiled kernel's own failure at run time (out of memory, a device fault) is no reason to run eagerly."""
    from torch._dynamo.exc import TorchDynamoException

    return TorchDynamoException


def chunk_bounds(n: int, size: int) -> list[tuple[int, int]]:
    """[start, stop) pieces of at most `size` of `n` items in order, except that a last piece of one item joins the
    one before it (which then holds `size` + 1). A compiled kernel specialises a dimension of size 1 even with
    dynamic shapes, so the one-item piece that a batch's token count makes now and then (once in `size` batches of
    varying length) would compile the chunk kernel again, seconds in the middle of training."""
    bounds = [(s, min(s + size, n)) for s in range(0, n, max(1, size))]
    if len(bounds) > 1 and bounds[-1][1] - bounds[-1][0] == 1:
        bounds[-2:] = [(bounds[-2][0], n)]
    return bounds
