"""`python -m bench.peaks`: what this GPU reaches at its two limits, as one JSON line: a bf16 8192×8192×8192 matrix
product (TFLOP/s, the ceiling a training step's MFU is read against beside the data-sheet peak) and a large
device-to-device copy (bytes read + written per second, the ceiling of a memory-bound decode step). Each is the
mean of `iters` timed runs after `warmup` untimed ones, timed with CUDA events."""

from __future__ import annotations

import json


def _timed(fn, warmup: int, iters: int) -> float:
    """Mean seconds per call of `fn` on the current CUDA stream."""
    import torch

    for _ in range(warmup):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1e3 / iters


def matmul_tflops(n: int = 8192, warmup: int = 3, iters: int = 10) -> float:
    import torch

    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    out = torch.empty(n, n, device="cuda", dtype=torch.bfloat16)
    seconds = _timed(lambda: torch.mm(a, b, out=out), warmup, iters)
    return 2 * n**3 / seconds / 1e12


def copy_tb_per_s(gib: int = 2, warmup: int = 3, iters: int = 10) -> float:
    import torch

    src = torch.empty(gib * 2**30, device="cuda", dtype=torch.uint8)
    dst = torch.empty_like(src)
    seconds = _timed(lambda: dst.copy_(src), warmup, iters)
    return 2 * src.numel() / seconds / 1e12


def measure() -> dict:
    import torch

    from bench.cases import SPEC

    name = torch.cuda.get_device_name()
    spec = next((v for k, v in SPEC.items() if k in name), (None, None))
    return {
        "gpu": name,
        "matmul_tflops": matmul_tflops(),
        "copy_tb_s": copy_tb_per_s(),
        "spec_tflops": spec[0] / 1e12 if spec[0] else None,
        "spec_tb_s": spec[1] / 1e12 if spec[1] else None,
    }


if __name__ == "__main__":
    print(json.dumps(measure()))
