"""`python -m bench.activation_memory`: what a packed SFT micro-step keeps for backward, ours against the plain
transformers model TRL trains, at Qwen2-0.5B's widths in bf16, measured on CPU.

Peak training memory is the weights, gradients and optimizer state, plus what the forward keeps for backward, plus
the largest temporary. The middle term is set by each operator's autograd, not by the device, so it can be counted
on CPU: every tensor autograd saves goes through `torch.autograd.graph.saved_tensors_hooks`, and the distinct
storages (parameters left out: they are the weights) are summed. Two depths (1 and 2 decoder layers) and two lengths
give the bytes per token per layer, per token outside the layers, and fixed (the head's gradient our fused loss
holds from the forward to the backward). From those, the projection at a users' shape (`--tokens`, `--layers`).

Variants:
- `transformers`: the model as loaded, its own loss (`labels=`), as TRL's SFTTrainer runs it without Liger;
- `ours, eager kernels`: `lean_activations` and SFT's fused linear cross-entropy, as on CPU or with
  `fused_kernels: false`;
- `ours, fused kernels`: the same with the CUDA path's SwiGLU and rotary autograd Functions (`fused_kernels`; their
  kernels run eagerly here: what they keep for backward is the Function's choice, not the compiler's). On CUDA the
  norms run torch's fused kernel, which keeps one float32 scale per row more (4 bytes per token per norm; added).
"""

from __future__ import annotations

import argparse
import contextlib
import json

import torch

from bench.cases import QWEN_05B

VARIANTS = ("transformers", "ours, eager kernels", "ours, fused kernels")


def model(layers: int, shape: dict):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen2Config(**{**shape, "num_hidden_layers": layers})
    built = Qwen2ForCausalLM(cfg).to(torch.bfloat16)  # type: ignore[arg-type]  # functools.wraps: unbound to mypy
    return built.eval().requires_grad_(True)


def kept_bytes(step, leave_out) -> int:
    """Bytes of the distinct storages autograd keeps for backward in `step()`, those of the tensors `leave_out`
    (a model's parameters, a function's inputs) left out."""
    params = {p.untyped_storage().data_ptr() for p in leave_out}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor):
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        step()
    return sum(seen.values())


def fused_path():
    """`fused_kernels` as on a CUDA device, the kernels eager (the same autograd Functions, so the same tensors kept)."""
    from alignpipe import fused_kernels
    from bench.host_work import patched

    return patched(
        {
            (fused_kernels, "wanted"): lambda enabled, device: enabled,
            (fused_kernels, "compiled_function"): lambda fn: fn,
        }
    )


def measure(variant: str, layers: int, tokens: int, shape: dict) -> int:
    from alignpipe.lean_activations import lean_activations
    from alignpipe.trainers import sft

    net = model(layers, shape)
    ids = torch.randint(0, shape["vocab_size"], (1, tokens), generator=torch.Generator().manual_seed(1))
    if variant == "transformers":
        return kept_bytes(lambda: net(input_ids=ids, labels=ids).loss, net.parameters())
    fused = variant == "ours, fused kernels"
    batch = {"input_ids": ids, "labels": ids.clone(), "attention_mask": torch.ones_like(ids)}
    with fused_path() if fused else contextlib.nullcontext():
        lean_activations(net, fused=fused)
        return kept_bytes(lambda: sft.token_loss_sum(net, batch), net.parameters())


def breakdown(variant: str, shape: dict, lengths: tuple[int, int]) -> dict[str, float]:
    """Bytes kept per token per decoder layer, per token outside the layers, and fixed, from 1 and 2 layers at two
    lengths."""
    a, b = lengths
    kept = {(n, t): measure(variant, n, t, shape) for n in (1, 2) for t in (a, b)}
    per_layer = [kept[2, t] - kept[1, t] for t in (a, b)]
    layer_per_token = (per_layer[1] - per_layer[0]) / (b - a)
    outside = [kept[1, t] - layer_per_token * t for t in (a, b)]
    outside_per_token = (outside[1] - outside[0]) / (b - a)
    fixed = outside[0] - outside_per_token * a
    if variant == "ours, fused kernels":
        layer_per_token += 2 * 4  # torch's fused RMSNorm on CUDA: one float32 scale per row, two norms a layer
    return {"layer_per_token": layer_per_token, "outside_per_token": outside_per_token, "fixed": fixed}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=16384, help="tokens per micro-step to project to")
    parser.add_argument("--layers", type=int, default=24, help="decoder layers to project to")
    parser.add_argument("--lengths", default="128,256", help="the two lengths measured")
    parser.add_argument("--tiny", action="store_true", help="a small model (the tests)")
    args = parser.parse_args(argv)
    shape = QWEN_05B
    if args.tiny:
        shape = dict(QWEN_05B, vocab_size=512, hidden_size=64, intermediate_size=128, num_attention_heads=4)
    lengths = tuple(int(x) for x in args.lengths.split(","))
    rows = []
    for variant in VARIANTS:
        parts = breakdown(variant, shape, lengths)  # type: ignore[arg-type]
        projected = (args.layers * parts["layer_per_token"] + parts["outside_per_token"]) * args.tokens + parts["fixed"]
        rows.append({"variant": variant, **{k: round(v, 1) for k, v in parts.items()}, "projected_gb": projected / 1e9})
    print(
        f"| bytes kept for backward ({args.layers} layers × {args.tokens} tokens, bf16) | per token per layer | "
        "per token outside the layers | fixed | projected GB |"
    )
    print("|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['variant']} | {r['layer_per_token']:,.0f} | {r['outside_per_token']:,.0f} | {r['fixed'] / 1e6:,.1f} MB"
            f" | {r['projected_gb']:.2f} |"
        )
    print(json.dumps(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
