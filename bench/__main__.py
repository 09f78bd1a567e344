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
        model = next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name"))
    except (OSError, StopIteration):
        model = platform.processor()
    return f"{os.cpu_count()} cores, {model}"


def mean_tokens(assets: Path, task: str) -> float | None:
    from alignpipe.modeling import load_tokenizer

    if task in ("grpo", "ppo"):
        return None
    tok = load_tokenizer(str(assets / "model"))
    name = "sentiment_sft" if task == "sft" else "sentiment_preferences"
    rows = [json.loads(line) for line in (assets / "data" / f"{name}.jsonl").read_text().splitlines()[:500]]
    if task == "sft":
        texts = [r["prompt"] + r["completion"] for r in rows]
    else:  # chosen and rejected are both forwarded
        texts = [r["prompt"] + r["chosen"] for r in rows] + [r["prompt"] + r["rejected"] for r in rows]
        return 2 * sum(len(x) + 1 for x in tok(texts)["input_ids"]) / len(texts)
    return sum(len(x) + 1 for x in tok(texts)["input_ids"]) / len(texts)


TRL_PPO = "1.12.0"  # the last TRL release with PPO (trl.experimental.ppo); 1.16 has none
TRL_PPO_DIR = ROOT / "bench" / f".trl-{TRL_PPO}"


def trl_with_ppo() -> Path:
    """TRL 1.12 installed into its own folder (no dependencies: it runs on this environment's transformers),
    put first on PYTHONPATH for the TRL side of the PPO case only."""
    if not (TRL_PPO_DIR / "trl" / "experimental" / "ppo").exists():
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(TRL_PPO_DIR),
                        f"trl=={TRL_PPO}"], check=True)
    return TRL_PPO_DIR


def measure(impl: str, task: str, model: str, steps: int, assets: Path) -> dict:
    env = dict(os.environ)
    if impl == "trl" and task == "ppo":
        env["PYTHONPATH"] = os.pathsep.join([str(trl_with_ppo()), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    out = subprocess.run([sys.executable, "-m", "bench.run_one", impl, task, model, str(steps), str(assets)], cwd=ROOT,
                         capture_output=True, text=True, timeout=1800, env=env)
    lines = [line for line in out.stdout.splitlines() if line.startswith("{")]
    if out.returncode != 0 or not lines:
        raise RuntimeError(f"{impl} {task} {model} failed:\n{out.stderr[-3000:]}")
    return json.loads(lines[-1])


def table(results: dict, tokens: dict) -> list[str]:
    lines = ["| trainer | model | ours samples/s | TRL samples/s | ratio | ours tokens/s | TRL tokens/s | ours peak RSS MB | "
             "TRL peak RSS MB | RSS ratio | ours loss | TRL loss |", "|" + "---|" * 12]
    for (task, model), runs in results.items():
        med = {impl: {k: statistics.median(r[k] for r in runs[impl]) for k in ("samples_per_s", "peak_rss_mb")} for impl in runs}
        loss = {impl: runs[impl][-1]["loss"] for impl in runs}
        o, t = med["ours"], med["trl"]
        tk = tokens.get(task)
        tok_o = f"{o['samples_per_s'] * tk:,.0f}" if tk else "–"
        tok_t = f"{t['samples_per_s'] * tk:,.0f}" if tk else "–"
        lines.append(f"| {task} | {model} | {o['samples_per_s']:.1f} | {t['samples_per_s']:.1f} | **{o['samples_per_s'] / t['samples_per_s']:.2f}×** | "
                     f"{tok_o} | {tok_t} | {o['peak_rss_mb']:,.0f} | {t['peak_rss_mb']:,.0f} | {o['peak_rss_mb'] / t['peak_rss_mb']:.2f} | "
                     f"{_fmt(loss['ours'])} | {_fmt(loss['trl'])} |")
    return lines


def _fmt(x) -> str:
    return f"{x:.4f}" if isinstance(x, (int, float)) else "–"


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench")
    parser.add_argument("--trainers", default="sft,reward,dpo,grpo,ppo")
    parser.add_argument("--models", default="tiny")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--assets", default=str(ROOT / "assets" / "tiny"))
    parser.add_argument("--out", default=str(ROOT / "docs" / "benchmarks.md"))
    args = parser.parse_args()
    from alignpipe.tiny import make_tiny

    assets = make_tiny(args.assets)
    results: dict = {}
    tokens = {task: mean_tokens(assets, task) for task in args.trainers.split(",")}
    for model in args.models.split(","):
        for task in args.trainers.split(","):
            runs = {"ours": [], "trl": []}
            for rep in range(args.repeats):
                for impl in (("ours", "trl") if rep % 2 == 0 else ("trl", "ours")):  # alternate who goes first
                    r = measure(impl, task, model, args.steps, assets)
                    runs[impl].append(r)
                    print(f"{task:6} {model:5} {impl:4} rep {rep}: {r['samples_per_s']:.1f} samples/s, "
                          f"{r['peak_rss_mb']:.0f} MB, loss {r['loss']}", flush=True)
            results[(task, model)] = runs
    lines = ["# Benchmarks: alignpipe vs TRL", "",
             f"Measured {datetime.date.today()} on {cpu()}, CPU fp32; {versions()}.",
             f"Median of {args.repeats} runs per side, alternating who runs first, each in a fresh process; "
             f"{args.steps} optimizer steps, batch 8 (GRPO: 16 completions = 2 prompts × 8, 32 new tokens), max length 64, "
             "checkpointing off. Timed: data preparation + training + saving the model (model loading excluded); peak RSS includes imports. tokens/s = samples/s × mean "
             "tokens per row of the (identical) data. Ratios are ours / TRL; on these shared machines absolute numbers "
             "swing by up to 1.6× between runs, ratios from one run are what count.", "",
             *table(results, tokens), "",
             "Reproduce: `make bench` (or `python -m bench --models tiny,small --repeats 3`).", ""]
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
