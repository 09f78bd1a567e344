"""Profile one benchmark case with the torch profiler:

    python -m bench.profile IMPL CASE MODEL [--steps N] [--out DIR]

IMPL is `ours`, `trl` or `trl+liger`; CASE a case key of `bench.cases` (`sft/8x2048`) or a trainer alone (`sft`: its
first shape in the model's default suite, users' shapes on the GPU); MODEL tiny/small (CPU) or qwen0.5b (GPU).
It runs exactly what `python -m bench` times for that case (same model, data and hyperparameters,
`bench.run_one.case`) with the profiler around the timed part, and writes to DIR (default
`<tmp>/alignpipe-profile/IMPL-CASE-MODEL/`):

- `ops.txt`: operators by self time (device time on a GPU, CPU time otherwise), the top 60;
- `trace.json`: a Chrome / Perfetto trace of the run (open it in https://ui.perfetto.dev);
- `summary.json`: the case's figures, the profiled total and the share of it spent in matrix multiplies.

It prints the top operators and the matrix-multiply share: the figure that says whether a case is bound by
its FLOPs (a high share: only fewer FLOPs help) or by everything around them (a low share: overhead to remove).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import tempfile
from pathlib import Path

from bench.cases import cases, is_gpu_model
from bench.run_one import IMPLS

ROOT = Path(__file__).resolve().parents[1]
GEMM_OPS = (
    "aten::mm",
    "aten::addmm",
    "aten::bmm",
    "aten::baddbmm",
    "aten::_scaled_dot_product_flash_attention",
    "aten::_scaled_dot_product_efficient_attention",
    "aten::_scaled_dot_product_cudnn_attention",
    "aten::_scaled_dot_product_flash_attention_for_cpu",
)


def self_time_us(event, device: bool) -> float:
    """An operator's own time (children excluded) in microseconds, on the device or the CPU."""
    if device:
        return float(getattr(event, "self_device_time_total", None) or getattr(event, "self_cuda_time_total", 0.0))
    return float(event.self_cpu_time_total)


def summarize(events, device: bool) -> dict:
    """Total self time, the matrix-multiply share (attention kernels and their backward included) and the top
    operators of a profiler's `key_averages()`."""
    rows = sorted(((e.key, self_time_us(e, device), e.count) for e in events), key=lambda r: -r[1])
    total = sum(t for _, t, _ in rows)
    gemm = sum(t for key, t, _ in rows if key.removesuffix("_backward") in GEMM_OPS)
    return {
        "clock": "device" if device else "cpu",
        "total_ms": total / 1e3,
        "gemm_share": gemm / total if total else 0.0,
        "top": [
            {"op": key, "ms": t / 1e3, "share": t / total if total else 0.0, "calls": n} for key, t, n in rows[:15]
        ],
    }


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(prog="python -m bench.profile", description=__doc__.split("\n\n")[0])
    parser.add_argument("impl", choices=list(IMPLS))
    parser.add_argument("case", help="a case key (sft/8x2048) or a trainer (sft)")
    parser.add_argument("model", choices=["tiny", "small", "qwen0.5b"])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--assets", default=str(ROOT / "assets" / "tiny"))
    parser.add_argument("--out", help="output folder (default <tmp>/alignpipe-profile/IMPL-TRAINER-MODEL)")
    args = parser.parse_args(argv)
    key = args.case
    if "/" not in key:
        key = cases(args.model, "user" if is_gpu_model(args.model) else "latency", [key])[0].key
    out = Path(
        args.out
        or Path(tempfile.gettempdir()) / "alignpipe-profile" / f"{args.impl}-{key.replace('/', '-')}-{args.model}"
    )
    out.mkdir(parents=True, exist_ok=True)
    if args.impl == "trl" and key.startswith("ppo/"):  # TRL 1.12, the last release with PPO, from its own folder
        from bench.__main__ import trl_with_ppo

        sys.path.insert(0, str(trl_with_ppo()))

    import torch
    from torch.profiler import ProfilerActivity, profile

    from bench.run_one import case

    device = torch.cuda.is_available()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device else [])
    holder: dict = {}

    @contextlib.contextmanager
    def around():
        with profile(activities=activities) as prof:
            yield
        holder["prof"] = prof

    figures = case(args.impl, key, args.model, args.steps, args.assets, around=around)
    prof = holder["prof"]
    events = prof.key_averages()
    sort = "self_device_time_total" if device else "self_cpu_time_total"
    (out / "ops.txt").write_text(events.table(sort_by=sort, row_limit=60))
    prof.export_chrome_trace(str(out / "trace.json"))
    summary = {**figures, "profile": summarize(events, device)}
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    p = summary["profile"]
    print(
        f"{args.impl} {key} {args.model}: {figures['samples_per_s']:.1f} samples/s under the profiler; "
        f"{p['total_ms']:.0f} ms of {p['clock']} self time, {100 * p['gemm_share']:.0f}% in matrix multiplies"
    )
    for row in p["top"]:
        print(f"  {row['op']:<50} {row['ms']:>10.1f} ms {100 * row['share']:>5.1f}%  {row['calls']:>7} calls")
    print(f"wrote {out}/ops.txt, trace.json, summary.json")
    return summary


if __name__ == "__main__":
    main()
