"""`python -m bench` (or `make bench`): our trainers and TRL's on the same model, tokenizer, data and
hyperparameters, alternating in fresh processes, median of N repeats, written to docs/benchmarks.md.

Reported: samples/s, tokens/s (samples/s × mean tokens per row of the identical data), peak RSS of the
process (imports included, as a user pays them), final loss, and ours/TRL ratios. PPO runs against TRL 1.12
(the last release with PPO; 1.16 has none), installed into bench/.trl-1.12.0 on first use.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def versions() -> str:
    from importlib.metadata import version

    return ", ".join(f"{p} {version(p)}" for p in ("torch", "transformers", "accelerate", "peft", "trl"))


def cpu() -> str:
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        model = next(line.split(":", 1)[1].strip() for line in lines if line.startswith("model name"))
    except (OSError, StopIteration):
        model = platform.processor()
    return f"{os.cpu_count()} cores, {model}"


def mean_tokens(assets: Path, task: str, model: str) -> float | None:
    """Mean tokens per sample of the identical data both sides train on (rows cut at the shape's max length;
    DPO and reward forward chosen and rejected, so both count). None for the online trainers."""
    from alignpipe.modeling import load_tokenizer
    from bench.run_one import rows, shape_for

    if task in ("grpo", "rloo", "ppo", "online_dpo"):
        return None
    shape = shape_for(model)
    tok = load_tokenizer(str(assets / "model"))
    data = rows(str(assets), task, shape)[:500]
    if task in ("sft", "kto"):
        texts = [r["prompt"] + r["completion"] for r in data]
    else:
        texts = [r["prompt"] + r["chosen"] for r in data] + [r["prompt"] + r["rejected"] for r in data]
    mean = sum(min(len(x) + 1, shape.max_len) for x in tok(texts)["input_ids"]) / len(texts)
    return 2 * mean if task in ("dpo", "reward") else mean


BF16_PEAK = {"H100": 989.4e12, "H200": 989.4e12, "A100": 312e12}  # dense bf16 FLOP/s, SXM parts


def sft_flops_per_token(model: str, seq_len: float) -> float | None:
    """Training FLOPs per token, 6·N + 12·L·d·s (PaLM's appendix B: N = matmul parameters including the LM head,
    attention counted over the whole row). Only for the GPU model, where MFU is reported."""
    from bench.run_one import QWEN_05B as c

    if not model.startswith("qwen"):
        return None
    d, L, kv = c["hidden_size"], c["num_hidden_layers"], c["num_key_value_heads"]
    head_dim = d // c["num_attention_heads"]
    per_layer = d * d * 2 + 2 * d * kv * head_dim + 3 * d * c["intermediate_size"]  # q,o + k,v + gate,up,down
    n = L * per_layer + c["vocab_size"] * d
    return 6 * n + 12 * L * d * seq_len


def gpu_peak() -> tuple[str, float | None]:
    import torch

    name = torch.cuda.get_device_name()
    return name, next((v for k, v in BF16_PEAK.items() if k in name), None)


TRL_PPO = "1.12.0"  # the last TRL release with PPO (trl.experimental.ppo); 1.16 has none
TRL_PPO_DIR = ROOT / "bench" / f".trl-{TRL_PPO}"


def trl_with_ppo() -> Path:
    """TRL 1.12 installed into its own folder (no dependencies: it runs on this environment's transformers),
    put first on PYTHONPATH for the TRL side of the PPO case only."""
    if not (TRL_PPO_DIR / "trl" / "experimental" / "ppo").exists():
        subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "install",
                "-q",
                "--no-deps",
                "--target",
                str(TRL_PPO_DIR),
                f"trl=={TRL_PPO}",
            ],
            check=True,
        )
    return TRL_PPO_DIR


def measure(impl: str, task: str, model: str, steps: int, assets: Path) -> dict:
    env = dict(os.environ)
    if impl == "trl" and task == "ppo":
        env["PYTHONPATH"] = os.pathsep.join([str(trl_with_ppo()), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    out = subprocess.run(
        [sys.executable, "-m", "bench.run_one", impl, task, model, str(steps), str(assets)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=1800,
        env=env,
    )
    lines = [line for line in out.stdout.splitlines() if line.startswith("{")]
    if out.returncode != 0 or not lines:
        raise RuntimeError(f"{impl} {task} {model} failed:\n{out.stderr[-3000:]}")
    return json.loads(lines[-1])


def table(results: dict, tokens: dict, gpu: bool, runs_label: str = "") -> list[str]:
    """The markdown table of `results` {(trainer, model): {"ours": [run, ...], "trl": [...]}}; `runs_label` fills the
    `runs × steps` column (so rows from separate invocations can share one table, `merge_rows`)."""
    mem = "peak CUDA MB" if gpu else "peak RSS MB"
    cols = [
        "trainer",
        "model",
        "runs × steps",
        "ours samples/s",
        "TRL samples/s",
        "ratio",
        "ours tokens/s",
        "TRL tokens/s",
        "tokens/s ratio",
        f"ours {mem}",
        f"TRL {mem}",
        "memory ratio",
        "ours loss",
        "TRL loss",
    ]
    if gpu:
        cols += ["ours steady samples/s", "TRL steady samples/s", "steady ratio", "ours SFT MFU", "TRL SFT MFU"]
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    peak = gpu_peak()[1] if gpu else None
    for (task, model), runs in results.items():
        keys = ("samples_per_s", "peak_mb") + (("steady_samples_per_s",) if gpu else ())
        med = {impl: {k: _median([r.get(k) for r in runs[impl]]) for k in keys} for impl in runs}
        loss = {impl: runs[impl][-1]["loss"] for impl in runs}
        o, t = med["ours"], med["trl"]
        tk = tokens.get((task, model))
        tok_o, tok_t = (o["samples_per_s"] * tk, t["samples_per_s"] * tk) if tk else (None, None)
        row = [
            task,
            model,
            runs_label,
            f"{o['samples_per_s']:.1f}",
            f"{t['samples_per_s']:.1f}",
            f"**{o['samples_per_s'] / t['samples_per_s']:.2f}×**",
            f"{tok_o:,.0f}" if tk else "–",
            f"{tok_t:,.0f}" if tk else "–",
            f"**{tok_o / tok_t:.2f}×**" if tk else "–",
            f"{o['peak_mb']:,.0f}",
            f"{t['peak_mb']:,.0f}",
            f"{o['peak_mb'] / t['peak_mb']:.2f}",
            _fmt(loss["ours"]),
            _fmt(loss["trl"]),
        ]
        if gpu:
            so, st = o["steady_samples_per_s"], t["steady_samples_per_s"]
            row += [f"{so:.1f}" if so else "–", f"{st:.1f}" if st else "–", f"**{so / st:.2f}×**" if so and st else "–"]
            per_token = sft_flops_per_token(model, tk) if (task == "sft" and tk) else None
            mfu = (
                [f"{x * tk * per_token / peak:.1%}" if x else "–" for x in (so, st)]
                if (per_token and peak)
                else ["–", "–"]
            )
            row += mfu
        lines.append("| " + " | ".join(row) + " |")
    return lines


def merge_rows(old: list[str], new: list[str]) -> list[str]:
    """Table `new` with the rows of table `old` (same columns) whose trainer and model it does not measure kept:
    a GPU session that can afford only some trainers per invocation still ends with one table."""

    def key(line: str) -> tuple[str, ...]:
        return tuple(c.strip() for c in line.strip("|").split("|")[:2])

    if not old or old[0] != new[0]:
        return new
    fresh = {key(line) for line in new[2:]}
    return new[:2] + [line for line in old[2:] if key(line) not in fresh] + new[2:]


def read_table(path: Path, name: str) -> list[str]:
    """The table lines of generated section `name` of the report, or [] when there is none."""
    _, section, _ = split_section(path.read_text() if path.exists() else "", name)
    return [line for line in (section or "").splitlines() if line.startswith("|")]


def split_section(text: str, name: str) -> tuple[str, str | None, str]:
    """(before, generated section `name` without its markers or None when absent, after) of a report's text."""
    begin, end = f"<!-- bench:{name} -->", f"<!-- /bench:{name} -->"
    if begin not in text or end not in text:
        return text, None, ""
    head, rest = text.split(begin, 1)
    section, tail = rest.split(end, 1)
    return head, section, tail


def _median(values: list) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def _fmt(x) -> str:
    return f"{x:.4f}" if isinstance(x, (int, float)) else "–"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench")
    parser.add_argument("--trainers", default="sft,reward,dpo,kto,grpo,rloo,online_dpo,ppo")
    parser.add_argument("--models", default="tiny")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--assets", default=str(ROOT / "assets" / "tiny"))
    parser.add_argument("--out", default=str(ROOT / "docs" / "benchmarks.md"))
    parser.add_argument(
        "--merge",
        action="store_true",
        help="keep the report's rows for trainers/models this invocation does not run (split GPU sessions)",
    )
    parser.add_argument(
        "--warmup",
        type=int,
        default=None,
        help="discarded runs per side before each trainer's timed ones (default: 1 on a GPU, 0 on CPU)",
    )
    args = parser.parse_args(argv)
    from alignpipe.tiny import make_tiny

    assets = make_tiny(args.assets)
    from bench.run_one import shape_for

    models, trainers = args.models.split(","), args.trainers.split(",")
    gpu = shape_for(models[0]).gpu
    if any(shape_for(m).gpu != gpu for m in models):
        parser.error(
            "--models mixes CPU models (tiny, small) with GPU ones (qwen0.5b): run them in separate invocations"
        )
    # On a freshly started GPU machine the first process of each case ran at half speed (kernels compiled and
    # cached, clocks rising): a discarded run per side keeps that out of the medians.
    warmup = args.warmup if args.warmup is not None else (1 if gpu else 0)
    results: dict = {}
    tokens = {(task, model): mean_tokens(assets, task, model) for task in trainers for model in models}
    for model in models:
        for task in trainers:
            runs = {"ours": [], "trl": []}
            for _ in range(warmup):
                for impl in ("ours", "trl"):
                    r = measure(impl, task, model, args.steps, assets)
                    print(
                        f"{task:6} {model:8} {impl:4} warm-up (discarded): {r['samples_per_s']:.1f} samples/s",
                        flush=True,
                    )
            for rep in range(args.repeats):
                for impl in ("ours", "trl") if rep % 2 == 0 else ("trl", "ours"):  # alternate who goes first
                    r = measure(impl, task, model, args.steps, assets)
                    runs[impl].append(r)
                    print(
                        f"{task:6} {model:8} {impl:4} rep {rep}: {r['samples_per_s']:.1f} samples/s, "
                        f"{r['peak_mb']:.0f} MB, loss {r['loss']}",
                        flush=True,
                    )
            results[(task, model)] = runs
    section = "gpu" if gpu else "cpu"
    rows = table(results, tokens, gpu, f"{args.repeats} × {args.steps}")
    if args.merge:
        rows = merge_rows(read_table(Path(args.out), section), rows)
    s = shape_for(models[0])
    where = f"{gpu_peak()[0]}, bf16 weights and optimizer state" if gpu else f"{cpu()}, CPU fp32"
    lines = [
        "## GPU: Qwen2-0.5B-shaped model (random init, bf16)"
        if gpu
        else "## CPU: tiny (~1.7M) and small (~20M) Llama-shaped models",
        "",
        f"Measured {datetime.date.today()} on {where}; {versions()}.",
        "Median of the runs per side in the `runs × steps` column, alternating who runs first, each in a fresh process"
        + (f" (after {warmup} discarded warm-up run{'s' if warmup > 1 else ''} per side)" if warmup else "")
        + "; "
        f"batch {s.batch} (GRPO: {2 * s.generations} completions = 2 prompts × {s.generations}, "
        f"{s.completion} new tokens; PPO: {s.batch} episodes, 4 PPO epochs, {s.completion} new tokens), max length {s.max_len}, "
        "checkpointing off. Timed: data preparation + training + saving the model (model loading excluded). "
        + (
            "Steady: samples/s from the end of step 5 to the last step (data preparation, warm-up and saving left out). "
            "Memory: `torch.cuda.max_memory_allocated`. MFU: steady tokens/s × (6·N + 12·L·d·s) / the GPU's dense bf16 "
            "peak. "
            if gpu
            else "Memory: peak RSS of the process, imports included. "
        )
        + ("Rows of earlier invocations (`--merge`) are kept with their own runs × steps. " if args.merge else "")
        + "tokens/s = samples/s × mean tokens per row of the (identical) data. Ratios are ours / TRL; absolute "
        "numbers swing between runs on shared machines, ratios from one run are what count.",
        "",
        *rows,
        "",
        (
            "Reproduce on a GPU: `python -m bench --models qwen0.5b --repeats 3` (or a few trainers per invocation, "
            "`--trainers grpo,ppo --merge`, keeping the other rows); profile one case with `python -m bench.profile "
            "ours sft qwen0.5b --steps 10` (device time per operator, Perfetto trace)."
            if gpu
            else "Reproduce: `make bench` (or `python -m bench --models tiny,small --repeats 3`)."
        ),
        "",
    ]
    write_section(Path(args.out), section, lines)
    print("\n".join(lines))


def write_section(path: Path, name: str, lines: list[str]) -> None:
    """Replace the generated section `name` of the report (between its markers), keeping what is written by
    hand around it (profiles, before/after, GPU and orchestration figures); a new report is just the section."""
    block = "\n".join([f"<!-- bench:{name} -->", *lines, f"<!-- /bench:{name} -->"])
    head, section, tail = split_section(path.read_text() if path.exists() else "", name)
    if section is not None:
        text = head + block + tail
    else:
        text = (head.rstrip() + "\n\n" if head.strip() else "") + block + "\n"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


if __name__ == "__main__":
    main()
