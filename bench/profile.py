"""Profile one benchmark case with the torch profiler:

    python -m bench.profile IMPL CASE MODEL [--steps N] [--out DIR]

IMPL is `ours`, `trl` or `trl+liger`; CASE a case key of `bench.cases` (`sft/8x2048`) or a trainer alone (`sft`: its
first shape in the model's default suite, users' shapes on the GPU); MODEL tiny/small (CPU) or qwen0.5b (GPU).
It runs exactly what `python -m bench` times for that case (same model, data and hyperparameters,
`bench.run_one.case`) with the profiler around the timed part, and writes to DIR (default
`<tmp>/alignpipe-profile/IMPL-CASE-MODEL/`):

- `ops.txt`: operators by self time (device time on a GPU, CPU time otherwise), the top 60;
- `trace.json`: a Chrome / Perfetto trace of the run (open it in https://ui.perfetto.dev);
- `summary.json`: the case's figures, the profiled total and the share of it spent in matrix multiplies; on a GPU
  also the device time by kind of kernel (matmul, attention, Triton, norm, element-wise, copy, optimizer), from
  the kernels themselves, so that ours and TRL + Liger's (whose Triton kernels run outside aten's operators) add up
  alike, how busy the device is in a steady step (`device_busy`: well under 100% says the step waits on its
  host), the host time of each optimizer step (`optimizer_host_ms`), and, where `bench.device_work --save` counted
  the case (`bench/device_counts.json`), the matmul and attention kernels' TFLOP/s (`kernel_rates`: the figure
  that says whether a side's step is slow in its products or around them). It also prints the run's step times,
  the synchronising calls of its steady steps (on a GPU) and the warnings it logged (`bench.__main__.step_detail`).

It prints the top operators (kernels, on a GPU) and the matrix-multiply share: the figure that says whether a case is bound by
its FLOPs (a high share: only fewer FLOPs help) or by everything around them (a low share: overhead to remove).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import tempfile
from pathlib import Path

from bench.cases import SUITES, TRAINERS, cases, find_case, is_gpu_model
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


# Device kernels by what they do, from their names: cuBLAS/CUTLASS matmuls, flash and memory-efficient attention,
# the fused optimizer, then the element-wise work around the matmuls by what it computes (torch's, inductor's
# `triton_*` and Liger's Triton kernels alike: a Liger norm and a fused torch norm both count as norm), copies, and
# what is left of inductor's and torch's kernels.
KERNEL_KINDS = (  # attention first: flash's and memory-efficient attention's names hold `cutlass::` types
    ("attention", ("flash", "fmha", "attention", "attn")),
    ("matmul", ("gemm", "cutlass", "xmma", "nvjet", "cublas", "matmul", "splitk")),
    ("optimizer", ("adam", "multi_tensor_apply")),
    ("norm", ("rms", "layer_norm", "norm_")),
    ("rotary", ("rope", "rotary")),
    ("swiglu", ("swiglu", "silu", "geglu")),
    ("loss", ("cross_entropy", "log_softmax", "logsumexp", "nll", "softmax")),
    ("copy", ("memcpy", "memset", "copy", "cat", "index", "gather", "scatter")),
    ("triton, other", ("triton",)),
    ("element-wise", ("elementwise", "vectorized", "reduce", "mul", "add", "fill")),
)


def kernel_kind(name: str) -> str:
    """What a device kernel does, by its name: the first of `KERNEL_KINDS` whose words it contains, else other."""
    lowered = name.lower()
    for kind, words in KERNEL_KINDS:
        if any(word in lowered for word in words):
            return kind
    return "other"


def self_time_us(event, device: bool) -> float:
    """An event's own time (children excluded) in microseconds, on the device or the CPU."""
    if device:
        return float(getattr(event, "self_device_time_total", 0.0) or getattr(event, "self_cuda_time_total", 0.0))
    return float(event.self_cpu_time_total)


def is_kernel(event) -> bool:
    """A device-side event (a kernel, copy or memset), not an operator on the host: an operator's own device time is
    its kernels' again, so a device total sums kernels only (as torch's own table does), and the kernels Liger's
    Triton functions launch outside any operator are counted too."""
    kind = getattr(getattr(event, "device_type", None), "name", "CPU")
    return kind in ("CUDA", "PrivateUse1", "XPU", "MTIA") and not getattr(event, "is_user_annotation", False)


def summarize(events, device: bool) -> dict:
    """Total self time, the matrix-multiply share (attention kernels and their backward included) and the top
    entries of a profiler's `key_averages()`: operators on CPU; on a device, its kernels, with their time by kind
    (`kernel_kind`), so two sides whose kernels come from different places (aten, inductor, Liger) compare alike."""
    if device:
        rows = sorted(((e.key, self_time_us(e, True), e.count) for e in events if is_kernel(e)), key=lambda r: -r[1])
        kinds: dict[str, float] = {}
        for key, t, _ in rows:
            kinds[kernel_kind(key)] = kinds.get(kernel_kind(key), 0.0) + t
        gemm = kinds.get("matmul", 0.0) + kinds.get("attention", 0.0)
    else:
        rows = sorted(((e.key, self_time_us(e, False), e.count) for e in events), key=lambda r: -r[1])
        kinds = {}
        gemm = sum(t for key, t, _ in rows if key.removesuffix("_backward") in GEMM_OPS)
    total = sum(t for _, t, _ in rows)
    return {
        "clock": "device" if device else "cpu",
        "total_ms": total / 1e3,
        "gemm_share": gemm / total if total else 0.0,
        "kinds": {k: {"ms": t / 1e3, "share": t / total} for k, t in sorted(kinds.items(), key=lambda kv: -kv[1])},
        "top": [
            {"op": key[:120], "ms": t / 1e3, "share": t / total if total else 0.0, "calls": n}
            for key, t, n in rows[:15]
        ],
    }


def optimizer_host_ms(events) -> dict[str, float]:
    """Host time a call of each optimizer's step (`Optimizer.step#<class>.step`, which torch's profiler records
    around every optimizer's step) in ms, children included: on a GPU what the host spends launching the update,
    which costs the step its wall time only where the step waits on its host. The profiler's own cost per operator
    inflates it a little."""
    return {
        e.key.split("#", 1)[1]: e.cpu_time_total / e.count / 1e3
        for e in events
        if e.key.startswith("Optimizer.step#") and e.count
    }


def counts_for(path: Path, key: str, impl: str) -> dict | None:
    """`bench.device_work`'s counts a step of case `key` on side `impl`, as `--save` kept them in `path`; None where
    they are not there."""
    if not path.exists():
        return None
    return json.loads(path.read_text()).get(key, {}).get(impl)


def kernel_rates(kinds: dict, steps: int, counts: dict | None) -> dict:
    """The matmul and attention kernels' rates: `bench.device_work`'s FLOPs a step of each (its products; attention's
    as the kernels run them) over the kind's device time a step (the profiled steps' over their number, the warm-up
    steps' included, so a little low). {} without counts. device_work counted two steps' batches, the profile runs
    others of the same data, so a rate is good to the few percent a step's tokens vary."""
    if not counts:
        return {}
    rates = {}
    for kind, flops in (("matmul", counts["total"]), ("attention", counts["attention"])):
        ms = kinds.get(kind, {}).get("ms", 0.0) / steps
        if ms > 0:
            rates[kind] = {"ms_a_step": ms, "tflop_a_step": flops / 1e12, "tflop_s": flops / 1e9 / ms}
    return rates


def device_busy(kernel_ms: float, steps: int, per_step: int, steady_samples_per_s: float | None) -> float | None:
    """The share of a steady step's wall time that the device spends in kernels: the run's kernel time a step (the
    warm-up steps' included, so a little high) over the wall time a step at the steady rate. Well under 1 says the
    step waits on its host (Python, launches, a sync), which no faster kernel helps; near 1, on its kernels. None
    without a steady rate (CPU runs log once)."""
    if not steady_samples_per_s or steps <= 0:
        return None
    return (kernel_ms / steps) / (1e3 * per_step / steady_samples_per_s)


def _positive(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number of steps of at least 1")
    return int(text)


def case_key(parser: argparse.ArgumentParser, model: str, given: str) -> str:
    """The case key `given` names on `model`: a key of either suite, or a trainer (its first shape in the model's
    default suite); anything else is a usage error listing what there is, before a model is built."""
    if "/" not in given:
        if given not in TRAINERS:
            parser.error(f"no trainer {given!r}; one of: {', '.join(TRAINERS)} (or a case key such as sft/8x2048)")
        return cases(model, "user" if is_gpu_model(model) else "latency", [given])[0].key
    known = sorted({c.key for suite in SUITES for c in cases(model, suite, list(TRAINERS))})
    if given not in known:
        parser.error(f"no case {given!r} for model {model}; its cases: {', '.join(known)}")
    return given


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(prog="python -m bench.profile", description=__doc__.split("\n\n")[0])
    parser.add_argument("impl", choices=list(IMPLS))
    parser.add_argument("case", help="a case key (sft/8x2048) or a trainer (sft)")
    parser.add_argument("model", choices=["tiny", "small", "qwen0.5b"])
    parser.add_argument("--steps", type=_positive, default=10)
    parser.add_argument("--assets", default=str(ROOT / "assets" / "tiny"))
    parser.add_argument("--out", help="output folder (default <tmp>/alignpipe-profile/IMPL-TRAINER-MODEL)")
    parser.add_argument(
        "--counts",
        default=str(ROOT / "bench" / "device_counts.json"),
        help="`bench.device_work --save`'s counts, to rate the matmul and attention kernels by (qwen0.5b on a GPU)",
    )
    args = parser.parse_args(argv)
    key = case_key(parser, args.model, args.case)
    if not (Path(args.assets) / "ASSETS.json").is_file():
        parser.error(f"--assets {args.assets} holds no tiny assets (no ASSETS.json); make them with `make assets`")
    if is_gpu_model(args.model):
        import torch

        if not torch.cuda.is_available():
            parser.error(f"{args.model} is the GPU model and this machine has no GPU; on a CPU profile tiny or small")
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

    from bench.__main__ import step_detail
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
    summary = {**figures, "profile": summarize(events, device) | {"optimizer_host_ms": optimizer_host_ms(events)}}
    if device:
        per_step = find_case(args.model, key).shape.per_step
        summary["profile"]["device_busy"] = device_busy(
            summary["profile"]["total_ms"], args.steps, per_step, figures.get("steady_samples_per_s")
        )
        if args.model == "qwen0.5b":  # the model device_work counts
            counts = counts_for(Path(args.counts), key, args.impl)
            summary["profile"]["rates"] = kernel_rates(summary["profile"]["kinds"], args.steps, counts)
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    p = summary["profile"]
    print(
        f"{args.impl} {key} {args.model}: {figures['samples_per_s']:.1f} samples/s under the profiler; "
        f"{p['total_ms']:.0f} ms of {p['clock']} self time, {100 * p['gemm_share']:.0f}% in matrix multiplies"
    )
    if p.get("device_busy") is not None:
        print(f"  device busy {100 * p['device_busy']:.0f}% of a steady step's wall time (well under 100%: host-bound)")
    for name, ms in p["optimizer_host_ms"].items():
        print(f"  {name}: {ms:.1f} ms of host time a step")
    if detail := step_detail(figures):
        print(f"  {detail.lstrip('; ')}")
    for kind, row in p["kinds"].items():
        print(f"  {kind:<14} {row['ms']:>10.1f} ms {100 * row['share']:>5.1f}%")
    for kind, r in p.get("rates", {}).items():
        print(
            f"  {kind} kernels: {r['ms_a_step']:.1f} ms a step for device_work's {r['tflop_a_step']:.3g} TFLOP: "
            f"{r['tflop_s']:.0f} TFLOP/s"
        )
    for row in p["top"]:
        print(f"  {row['op'][:60]:<60} {row['ms']:>10.1f} ms {100 * row['share']:>5.1f}%  {row['calls']:>7} calls")
    print(f"wrote {out}/ops.txt, trace.json, summary.json")
    return summary


if __name__ == "__main__":
    main()
