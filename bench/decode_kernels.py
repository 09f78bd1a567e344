"""How many kernels one decode step of the hf engine issues, counted on CPU.

A decode step replayed as a CUDA graph spends its time on the number of kernels it runs, not on their bytes (an H200
replayed Qwen2-0.5B's step at 64 rows in 4.0 ms, 14× what its bytes need: docs/benchmarks-log.md, session 29). This
counts the operators of one static-cache decode step of a Qwen2-shaped model (Qwen2-0.5B's layout, small widths)
through torch's profiler, which also sees what SDPA runs inside. Leaf operators only, views, allocations and
no-op casts left out: what is left launches one kernel each on a GPU. The difference between a 2-layer and a 3-layer
model is the count per layer; the rest is the step's fixed part (embedding, rotary tables, final norm, LM head).

Three setups: transformers' `StaticCache` given a boolean mask (the loop until session 31), the loop's cache
(`static_cache`: write positions worked out once a step) given the additive bias (`hf.attention_bias`), and the same
with each layer's sibling projections merged as a recording of a policy runs them (`merged_projections`). On a GPU,
SDPA's memory-efficient kernel also copies a bias whose rows are not 8-aligned into a padded one (the loop's rows
are aligned since session 31); the CPU path has no such copy, so the count below leaves it out. The patched
policy's compiled kernels (fused rotary and SwiGLU) run on CUDA only and are not counted here.

    python -m bench.decode_kernels [--rows 64] [--width 128]
"""

from __future__ import annotations

import argparse
import contextlib

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

NO_KERNEL = {"empty", "empty_like", "empty_strided", "new_empty", "lift_fresh", "detach_"}

# What SDPA runs inside, before its kernel, to turn a boolean mask into a bias (and to pad an unaligned one)
MASK_WORK = {"aten::where", "aten::scalar_tensor", "aten::logical_not", "aten::constant_pad_nd", "aten::masked_fill_"}


class Kernels(TorchDispatchMode):
    """Within: counts the operators that launch a kernel (`names`): in place, or writing a new tensor (views and
    no-op casts share their input's storage and launch none; allocations alone launch none)."""

    def __init__(self):
        super().__init__()
        self.names: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.__name__.split(".")[0]
        if name not in NO_KERNEL and (name.endswith("_") or _storages(out) - _storages((args, kwargs))):
            self.names.append(name)
        return out


def _storages(tree) -> set[int]:
    return {t.untyped_storage().data_ptr() for t in tree_leaves(tree) if isinstance(t, torch.Tensor)}


def prefilled_step(model, rows: int, width: int, ours: bool = True) -> tuple:
    """The arguments of `decode_steps.decode_step` for one step of `model` after a `width`-token prefill of `rows`
    random rows, as the hf engine's loop lays them out (`ours`: its cache and attention bias; else transformers'
    cache and a boolean mask)."""
    from alignpipe.engine.decode_steps import new_cache
    from alignpipe.engine.hf import aligned, attention_bias

    device = model.device
    length = aligned(width + 8)
    cache = new_cache(model, length, shared_positions=ours)
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(2, model.config.vocab_size, (rows, width + 1), generator=generator).to(device)
    keys = torch.zeros(rows, length, dtype=torch.long, device=device)
    keys[:, : width + 1] = 1
    mask = attention_bias(keys, model.dtype) if ours else keys.bool()[:, None, None, :]
    with torch.inference_mode():
        model(input_ids=ids[:, :width], past_key_values=cache, use_cache=True)
    position = torch.full((rows, 1), width, device=device)
    return ids[:, width:], mask, position, cache, torch.tensor([width], device=device)


def kernels(layers: int, ours: bool, rows: int, width: int, merged: bool = False) -> list[str]:
    """The kernels one decode step issues, by operator name: a Qwen2-shaped model of `layers` layers in bf16, `rows`
    rows after a `width`-token prefill; `ours`: the loop's cache and bias, else transformers' cache and a boolean
    mask; `merged`: the sibling projections merged, as a recording of a policy runs them (`merged_projections`)."""
    from torch.profiler import profile

    from alignpipe.engine.decode_steps import decode_step
    from alignpipe.engine.merged_projections import MergedProjections
    from bench.decode_overhead import tiny_qwen

    model = tiny_qwen(layers).to(torch.bfloat16)  # as a GPU decodes: the norms' float32 casts are kernels too
    args = prefilled_step(model, rows, width, ours)
    with torch.inference_mode():
        projections = MergedProjections(model).active() if merged else contextlib.nullcontext()
        with projections, profile() as prof, Kernels() as counted:
            decode_step(model, *args)
    inside = [
        e.name for e in prof.events() if e.name in MASK_WORK and _parent(e) == "aten::scaled_dot_product_attention"
    ]
    return counted.names + inside


def _parent(event) -> str | None:
    """The name of the profiled operator that called `event`'s (its direct children are SDPA's own steps)."""
    return event.cpu_parent.name if event.cpu_parent is not None else None


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.decode_kernels")
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--width", type=int, default=128)
    args = parser.parse_args(argv)
    print("| decode step | kernels per layer | fixed per step | Qwen2-0.5B (24 layers) |")
    print("|---|---|---|---|")
    setups = (
        ("transformers' StaticCache, boolean mask", False, False),
        ("the loop's cache and bias", True, False),
        ("the same, projections merged (a policy's recording)", True, True),
    )
    for name, ours, merged in setups:
        two, three = (len(kernels(n, ours, args.rows, args.width, merged)) for n in (2, 3))
        per = three - two
        fixed = two - 2 * per
        print(f"| {name} | {per} | {fixed} | {fixed + 24 * per} |")


if __name__ == "__main__":
    main()
