"""`python -m bench.peaks [--cpu]`: what this machine reaches at its two limits, as one JSON line: a square matrix
product (TFLOP/s, the ceiling a training step's MFU is read against, beside the data-sheet peak on a GPU) and a large
copy (bytes read + written per second, the ceiling of a memory-bound decode step).

On a GPU: a bf16 8192³ product and a 2 GiB device-to-device copy, timed with CUDA events. With `--cpu`: an fp32
2048³ product on torch's intra-op threads (those a benchmark run gets: the same default) and a 512 MiB copy in host
memory, timed by the host's clock. Each figure is the mean of `iters` timed runs after `warmup` untimed ones."""

from __future__ import annotations

import json
import sys
import time


def _timed(fn, warmup: int, iters: int, device: str) -> float:
    """Mean seconds per call of `fn`: on the current CUDA stream by CUDA events, or on the CPU by the host's clock
    (a CPU call has returned when its work is done)."""
    import torch

    for _ in range(warmup):
        fn()
    if device != "cuda":
        start = time.perf_counter()
        for _ in range(iters):
            fn()
        return (time.perf_counter() - start) / iters
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    begin.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return begin.elapsed_time(end) / 1e3 / iters


def matmul_tflops(n: int = 8192, warmup: int = 3, iters: int = 10, device: str = "cuda") -> float:
    import torch

    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    out = torch.empty(n, n, device=device, dtype=dtype)
    seconds = _timed(lambda: torch.mm(a, b, out=out), warmup, iters, device)
    return 2 * n**3 / seconds / 1e12


def copy_tb_per_s(gib: float = 2, warmup: int = 3, iters: int = 10, device: str = "cuda") -> float:
    import torch

    src = torch.empty(int(gib * 2**30), device=device, dtype=torch.uint8)
    src.fill_(1)  # touched, so that the host's pages exist before the timing
    dst = torch.empty_like(src)
    seconds = _timed(lambda: dst.copy_(src), warmup, iters, device)
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


def measure_cpu() -> dict:
    """The CPU's: no data sheet is looked up (the part and its clocks vary by machine), so its MFU is read against
    the measured product alone."""
    import torch

    return {
        "cpu_threads": torch.get_num_threads(),
        "matmul_tflops": matmul_tflops(2048, warmup=2, iters=5, device="cpu"),
        "copy_tb_s": copy_tb_per_s(0.5, warmup=2, iters=5, device="cpu"),
        "spec_tflops": None,
        "spec_tb_s": None,
    }


if __name__ == "__main__":
    print(json.dumps(measure_cpu() if "--cpu" in sys.argv[1:] else measure()))
