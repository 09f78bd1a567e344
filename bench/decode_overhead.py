"""The host's share of a decode step: the hf engine's loops on a model whose operators cost almost nothing.

A Qwen2-shaped model with Qwen2-0.5B's 24 layers but hidden size 64 runs each decode loop (eager with a growing KV
cache, eager with a static one, the compiled step) over one prompt; the milliseconds per new token are then Python
and operator dispatch, what a GPU waits on when a 0.5B model's step is issued eagerly (docs/benchmarks.md).

    python -m bench.decode_overhead [--rows 1] [--new-tokens 64] [--no-compile]
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from typing import Any

import torch


def tiny_qwen(layers: int = 24):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen2Config(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=layers,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=1024,
        eos_token_id=1,
        pad_token_id=0,
    )
    return Qwen2ForCausalLM(cfg).eval()


def ms_per_token(loop, model, rows: int, new_tokens: int, **kwargs) -> float:
    from alignpipe.engine.sampling import SamplingParams

    ids = torch.randint(2, 512, (rows, 96), generator=torch.Generator().manual_seed(0))
    sampling = SamplingParams(temperature=1.0, max_new_tokens=new_tokens)
    with torch.inference_mode():
        start = time.perf_counter()
        out, _ = loop(model, ids, torch.ones_like(ids), sampling, None, 0, torch.Generator().manual_seed(0), **kwargs)
        return (time.perf_counter() - start) / out.shape[1] * 1000


def main(argv: list[str] | None = None) -> None:
    from alignpipe.engine.hf import CompiledDecodeStep, decode, decode_static

    parser = argparse.ArgumentParser(prog="python -m bench.decode_overhead")
    parser.add_argument("--rows", type=int, default=1)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--no-compile", action="store_true")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    model = tiny_qwen()
    loops: list[tuple[str, Callable, dict[str, Any]]] = [
        ("eager, growing KV cache", decode, {}),
        ("eager, static KV cache", decode_static, {}),
    ]
    if not args.no_compile:
        loops.append(("compiled step", decode_static, {"step": CompiledDecodeStep()}))
    for name, loop, kwargs in loops:
        times = [ms_per_token(loop, model, args.rows, args.new_tokens, **kwargs) for _ in range(3)]
        print(f"{name:26} ms per token: first {times[0]:.2f}, then {min(times[1:]):.2f}–{max(times[1:]):.2f}")


if __name__ == "__main__":
    main()
