"""`python -m bench` (or `make bench`): our trainers against TRL's, and on a GPU against TRL with Liger's kernels
(`trl+liger`), on the same model, tokenizer, data and hyperparameters, each run in a fresh process, who runs first
rotating, median of N repeats, written to docs/benchmarks.md as one table per suite (a row per case and contender,
the ratio ours / contender).

On a GPU the default is the `user` suite (the batch sizes people train with: `bench.cases`), with MFU against the
data-sheet peak and a measured 8192³ matmul, and rollouts' generated tokens/s against the memory-bandwidth bound of a
decode step; `--suite latency` keeps the small steps. On CPU the default is the latency suite against plain TRL.
PPO runs against TRL 1.12 (the last release with PPO; 1.16 has none), installed into bench/.trl-1.12.0 on first use.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import os
import platform
import statistics
import subprocess
import sys
from dataclasses import dataclass, replace
from pathlib import Path
from typing import NamedTuple

from bench.cases import (
    GPU_TRAINERS,
    LOG_EVERY_ENV,
    ONLINE,
    SUITES,
    TRAINERS,
    USERS_LOGGING_EVERY,
    Case,
    attention_span,
    cases,
    decode_bound,
    is_gpu_model,
    row_lengths,
    tokens_per_sample,
    train_flops_per_token,
)
from bench.run_one import (
    ATTENTION_ENV,
    COMPILE_ENV,
    COMPILED_KERNELS_ENV,
    EAGER_KERNELS_ENV,
    IMPLS,
    NEAREST_ENV,
    SKIP_STEPS_ENV,
    UNFUSED_ENV,
    fresh_json,
)

ROOT = Path(__file__).resolve().parents[1]


def versions() -> str:
    from importlib.metadata import PackageNotFoundError, version

    out = []
    for p in ("torch", "transformers", "accelerate", "peft", "trl", "liger-kernel"):
        try:
            out.append(f"{p} {version(p)}")
        except PackageNotFoundError:
            continue
    return ", ".join(out)


def cpu() -> str:
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        model = next(line.split(":", 1)[1].strip() for line in lines if line.startswith("model name"))
    except (OSError, StopIteration):
        model = platform.processor()
    return f"{os.cpu_count()} cores, {model}"


TRL_PPO = "1.12.0"  # the last TRL release with PPO (trl.experimental.ppo); 1.16 has none
TRL_PPO_DIR = ROOT / "bench" / f".trl-{TRL_PPO}"


def trl_with_ppo() -> Path:
    """TRL 1.12 installed into its own folder (no dependencies: it runs on this environment's transformers),
    put first on PYTHONPATH for the TRL side of the PPO case only. From the index, or on a machine that reaches none
    (the device tool's) from the wheel `bench/device_wheels.sh` put in `.whl/ppo/`."""
    if not (TRL_PPO_DIR / "trl" / "experimental" / "ppo").exists():
        local = sorted((ROOT / ".whl" / "ppo").glob(f"trl-{TRL_PPO}-*.whl"))
        source = [str(local[0]), "--no-index"] if local else [f"trl=={TRL_PPO}"]
        subprocess.run(
            [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(TRL_PPO_DIR), *source],
            check=True,
        )
    return TRL_PPO_DIR


@dataclass(frozen=True)
class Variant:
    """A switch of our side alone: `--NAME` asks for it, `env` carries it to `bench.run_one` (set to 1 for our run,
    never for a contender's), and its rows name the model with `suffix` (`qwen0.5b+compile`), so that a merged table
    keeps them apart from the default's."""

    name: str
    env: str
    suffix: str
    help: str

    @property
    def dest(self) -> str:
        return self.name.replace("-", "_")


VARIANTS = (
    Variant(
        "compile",
        COMPILE_ENV,
        "+compile",
        "our side with `compile: true` (sft, reward, dpo, kto) or `rollout: {compile: true}` (grpo, rloo, online_dpo, "
        "ppo)",
    ),
    Variant(
        "unfused",
        UNFUSED_ENV,
        "+unfused",
        "our DPO with `fused_loss: false` (the chunked, recomputed LM head): what the fused head buys",
    ),
    Variant(
        "eager-kernels",
        EAGER_KERNELS_ENV,
        "+eager-kernels",
        "our side with `fused_kernels: false` (the SwiGLU product and the LM head's loss as eager kernels): what the "
        "compiled element-wise kernels buy on a GPU",
    ),
    Variant(
        "compiled-kernels",
        COMPILED_KERNELS_ENV,
        "+compiled-kernels",
        "our side's SwiGLU and rotary work on inductor's compiled kernels instead of the hand-written Triton ones "
        "(`fused_kernels.ELEMENTWISE`): what the hand-written kernels buy",
    ),
    Variant(
        "nearest-updates",
        NEAREST_ENV,
        "+nearest",
        "our side with `low_precision_updates: nearest` (torch's AdamW rounding each bf16 update, as TRL's side does) "
        "instead of the Kahan-compensated default: what the default costs a step",
    ),
)


def chosen_variants(args: argparse.Namespace) -> tuple[str, ...]:
    """The names of the `VARIANTS` the command line asks for, in their order."""
    return tuple(v.name for v in VARIANTS if getattr(args, v.dest))


def measure_variant(impl: str, key: str, model: str, args: argparse.Namespace, assets: Path) -> dict:
    """`measure` with what the command line asks for (attention kernel, our side's `VARIANTS`, warm-up steps)."""
    return measure(
        impl, key, model, args.steps, assets, args.attention, chosen_variants(args), args.skip_steps, args.log_every
    )


def measure(
    impl: str,
    key: str,
    model: str,
    steps: int,
    assets: Path,
    attention: str | None = None,
    variants: tuple[str, ...] = (),
    skip_steps: int | None = None,
    log_every: int | None = None,
) -> dict:
    """One run of `bench.run_one` in a fresh process (its model on the `attention` kernel when given; our side with
    the named `VARIANTS`; its steady rate after `skip_steps` steps, default 5; an offline trainer logging every
    `log_every` steps on a GPU, default `USERS_LOGGING_EVERY`): its JSON figures."""
    env = dict(os.environ)
    if skip_steps is not None:
        env[SKIP_STEPS_ENV] = str(skip_steps)
    if log_every is not None:
        env[LOG_EVERY_ENV] = str(log_every)
    if attention:
        env[ATTENTION_ENV] = attention
    if unknown := set(variants) - {v.name for v in VARIANTS}:
        raise ValueError(f"unknown variants {sorted(unknown)}")
    if impl == "ours":
        env.update({v.env: "1" for v in VARIANTS if v.name in variants})
    if impl == "trl" and key.startswith("ppo/"):
        env["PYTHONPATH"] = os.pathsep.join([str(trl_with_ppo()), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return fresh_json(["bench.run_one", impl, key, model, str(steps), str(assets)], env, timeout=1800)


def machine_peaks(gpu: bool) -> dict:
    """This machine's measured matmul and copy rates (`bench.peaks`, in a fresh process, as each run is): the GPU's
    beside its data sheet's, or the CPU's on the threads a run gets."""
    command = [sys.executable, "-m", "bench.peaks"] + ([] if gpu else ["--cpu"])
    out = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600, check=True)
    return json.loads(out.stdout.splitlines()[-1])


@dataclass(frozen=True)
class Physics:
    """What one case's figures are read against."""

    tokens_per_sample: float | None  # offline trainers: real tokens in a row, pair or packed block
    flops_per_token: float | None  # model FLOPs per trained token (offline trainers)
    decode_bound: float | None  # generated tokens/s a memory-bound decode could reach at the measured copy rate
    counted: dict[str, float] | None = None  # GPU: FLOPs a sample each side's kernels run (`counted_flops`)


def physics(case: Case, model: str, assets: Path, peaks: dict | None) -> Physics:
    if case.trainer in ONLINE:
        bound = decode_bound(case, model, peaks["copy_tb_s"] * 1e12) if peaks else None
        return Physics(None, None, bound)
    from alignpipe.modeling import load_tokenizer

    lengths = row_lengths(str(assets), case, load_tokenizer(str(assets / "model")))
    per_sample = tokens_per_sample(case, lengths)
    return Physics(
        per_sample,
        train_flops_per_token(case.trainer, model, attention_span(lengths)),
        None,
        counted_flops(case, per_sample) if is_gpu_model(model) else None,
    )


COUNTS = ROOT / "bench" / "device_counts.json"


def counted_flops(case: Case, tokens_a_sample: float, path: Path = COUNTS) -> dict[str, float] | None:
    """The FLOPs a sample of the table that each side's GPU kernels run (products and attention), as
    `bench.device_work --save` counted them on CPU at this case (`path`), by side; None where it has no count. A
    packed SFT block: FLOPs a token × the block's real tokens (both sides fill blocks alike: TRL's `bfd` to within
    0.3% of ours at both users' shapes); a pair or a row: a step's FLOPs over the step's samples."""
    if not path.exists():
        return None
    by_side = json.loads(path.read_text()).get(case.key)
    if not by_side:
        return None
    out = {}
    for side, counts in by_side.items():
        flops = counts["total"] + counts["attention"]
        out[side] = flops / counts["tokens"] * tokens_a_sample if case.shape.packed else flops / case.shape.per_step
    return out


# What a sample is, per trainer (rows/s is shown only where tokens per sample are unknown)
UNIT = {
    "sft": "rows/s",
    "kto": "rows/s",
    "reward": "pairs/s",
    "dpo": "pairs/s",
    "grpo": "completions/s",
    "rloo": "completions/s",
    "ppo": "episodes/s",
    "online_dpo": "prompts/s",
}


def table(results: dict, phys: dict, peaks: dict | None, gpu: bool, runs_label: str = "") -> list[str]:
    """The markdown table of `results` {(case, model): {impl: [run, ...]}}: a row per case and contender, ours /
    contender as the ratio. On a GPU the headline rate is the steady one (steps after the warm-up ones), with MFU
    against the data-sheet peak and the measured matmul; on the CPU it is end to end, with MFU against the measured
    matmul alone. Rollouts' generated tokens/s stand beside the decode bound on both. `runs_label` fills `runs ×
    steps` (rows of separate invocations share one table, `merge_rows`); "{runs}" in it becomes the case's count of
    runs per side (a call cut short keeps its finished rounds)."""
    mem = "peak CUDA MB" if gpu else "peak RSS MB"
    cols = ["trainer", "model", "shape", "contender", "runs × steps", "measure", "ours", "contender", "ratio"]
    if gpu:
        cols += ["end-to-end ratio", "ours MFU (peak · matmul)", "contender MFU (peak · matmul)"]
        cols += ["counted work, contender / ours", "counted TFLOP/s, ours · contender (of matmul)"]
    else:
        cols += ["ours MFU (of matmul)", "contender MFU (of matmul)"]
    cols += ["ours generated tokens/s (of bound)", "contender generated tokens/s (of bound)"]
    cols += [f"ours {mem}", f"contender {mem}", "memory ratio", "ours loss", "contender loss"]
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for (case, model), runs in results.items():
        ph: Physics = phys[(case, model)]
        med = {impl: Medians.of(rs) for impl, rs in runs.items()}
        rate = {impl: (m.steady_samples_per_s if gpu else None) or m.samples_per_s for impl, m in med.items()}
        scale = ph.tokens_per_sample or 1.0
        for contender in [impl for impl in runs if impl != "ours"]:
            o, c = med["ours"], med[contender]
            row = [
                case.trainer,
                model,
                case.shape.label,
                contender,
                runs_label.replace("{runs}", str(min(map(len, runs.values())))),
                "tokens/s" if ph.tokens_per_sample else UNIT[case.trainer],
                f"{rate['ours'] * scale:,.1f}",
                f"{rate[contender] * scale:,.1f}",
                f"**{rate['ours'] / rate[contender]:.2f}×**",
            ]
            if gpu:
                row.append(f"{o.samples_per_s / c.samples_per_s:.2f}×")
            row += [_mfu(rate[impl] * scale, ph.flops_per_token, peaks, gpu) for impl in ("ours", contender)]
            if gpu:
                row += _counted(ph.counted, rate, contender, peaks)
            row += [
                _generated(case, rate[impl], med[impl].mean_completion_length, ph)
                + _engine(med[impl].generation_tokens_per_s, ph)
                for impl in ("ours", contender)
            ]
            row += [
                f"{o.peak_mb:,.0f}",
                f"{c.peak_mb:,.0f}",
                f"{o.peak_mb / c.peak_mb:.2f}",
                _fmt(runs["ours"][-1]["loss"]),
                _fmt(runs[contender][-1]["loss"]),
            ]
            lines.append("| " + " | ".join(row) + " |")
    return lines


def _mfu(tokens_per_s: float, flops_per_token: float | None, peaks: dict | None, gpu: bool) -> str:
    """Model FLOP/s over the data-sheet peak · over the measured matmul (GPU), or over the measured matmul (CPU)."""
    if not (flops_per_token and peaks):
        return "–"
    achieved = tokens_per_s * flops_per_token / 1e12
    of_matmul = f"{achieved / peaks['matmul_tflops']:.1%}"
    if not gpu:
        return of_matmul
    of_peak = f"{achieved / peaks['spec_tflops']:.1%}" if peaks.get("spec_tflops") else "–"
    return f"{of_peak} · {of_matmul}"


def _counted(counted: dict[str, float] | None, rate: dict[str, float], contender: str, peaks: dict | None) -> list[str]:
    """The work each side's kernels ran a sample, counted (`counted_flops`): the contender's over ours' (the ratio
    equal FLOP rates would give), and each side's measured samples/s × its FLOPs a sample, of the measured matmul."""
    if not counted or "ours" not in counted or contender not in counted:
        return ["–", "–"]

    def tflop_s(impl: str) -> str:
        achieved = rate[impl] * counted[impl] / 1e12
        return f"{achieved:,.0f}" + (f" ({achieved / peaks['matmul_tflops']:.0%})" if peaks else "")

    return [f"{counted[contender] / counted['ours']:.2f}×", f"{tflop_s('ours')} · {tflop_s(contender)}"]


def _generated(case: Case, rate: float, mean_length: float | None, ph: Physics) -> str:
    """Generated tokens/s of an online trainer: samples/s × completions per sample × their mean length (the logged
    one; the shape's maximum where a trainer does not log it: TRL 1.12's PPO)."""
    if case.trainer not in ONLINE:
        return "–"
    tokens = rate * (2 if case.trainer == "online_dpo" else 1) * (mean_length or case.shape.completion)
    return f"{tokens:,.0f}" + (f" ({tokens / ph.decode_bound:.1%})" if ph.decode_bound else "")


def _engine(tokens_per_s: float | None, ph: Physics) -> str:
    """Where a trainer logs it (ours: `generation/tokens_per_s`), the rate of its rollouts' generation alone, beside
    the same bound: what the engine does inside the stage, apart from the update's share of the step."""
    if not tokens_per_s:
        return ""
    return f"; generating {tokens_per_s:,.0f}" + (f" ({tokens_per_s / ph.decode_bound:.1%})" if ph.decode_bound else "")


def merge_rows(old: list[str], new: list[str]) -> list[str]:
    """Table `old` (same columns) with its rows of the cases and contenders `new` measures replaced where they stand,
    and `new`'s other rows placed after the last row of their model (at the end for a new model): a session that can
    afford only some trainers per invocation still ends with one table, grouped by model in the order first written."""

    def key(line: str) -> tuple[str, ...]:  # trainer, model, shape, contender
        return tuple(c.strip() for c in line.strip("|").split("|")[:4])

    if not old or old[0] != new[0]:
        return new
    fresh = {key(line): line for line in new[2:]}
    rows = [fresh.pop(key(line), line) for line in old[2:]]
    for k, line in fresh.items():
        same_model = [i for i, row in enumerate(rows) if key(row)[1] == k[1]]
        rows.insert(same_model[-1] + 1 if same_model else len(rows), line)
    return new[:2] + rows


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


class Medians(NamedTuple):
    """A side's medians over its runs of one case; every run measures its rate and peak, the rest may be absent
    (a steady rate on the CPU, a completion length or an engine's rate for an offline trainer)."""

    samples_per_s: float
    peak_mb: float
    steady_samples_per_s: float | None
    mean_completion_length: float | None
    generation_tokens_per_s: float | None

    @classmethod
    def of(cls, runs: list[dict]) -> Medians:
        def median(key: str) -> float | None:
            return _median([r.get(key) for r in runs])

        rate, peak = median("samples_per_s"), median("peak_mb")
        if rate is None or peak is None:
            raise ValueError(f"no run measured its samples/s and peak memory: {runs}")
        return cls(
            rate,
            peak,
            median("steady_samples_per_s"),
            median("mean_completion_length"),
            median("generation_tokens_per_s"),
        )


def _fmt(x) -> str:
    return f"{x:.4f}" if isinstance(x, (int, float)) else "–"


def chosen_cases(
    parser: argparse.ArgumentParser, model: str, suite: str, trainers: list[str], wanted: list[str] | None
) -> list[Case]:
    """The suite's cases of `trainers` for `model`, only those `wanted` if given; a wanted key the suite lacks is a
    usage error naming the known ones."""
    chosen = [c for c in cases(model, suite, trainers) if wanted is None or c.key in wanted]
    if wanted and (missing := set(wanted) - {c.key for c in chosen}):
        known = ", ".join(c.key for c in cases(model, suite, list(TRAINERS)))
        parser.error(f"no case {', '.join(sorted(missing))} in the {suite} suite of {model}; known: {known}")
    return chosen


def sides(case: Case, contenders: list[str]) -> list[str]:
    """Ours, then the contenders that run `case`: TRL 1.12's PPOTrainer (the last with PPO) has no Liger path, so PPO
    runs against plain TRL only."""
    return ["ours"] + [c for c in contenders if not (case.trainer == "ppo" and c == "trl+liger")]


def rotated(impls: list[str], rep: int) -> list[str]:
    """The order of round `rep`'s runs: who goes first rotates, so no side always meets a cold or a warm machine."""
    return impls[rep % len(impls) :] + impls[: rep % len(impls)]


def run_order(case: Case, contenders: list[str], warmup: int, repeats: int) -> list[str]:
    """What `--dry-run` prints for a case: each run the invocation would make, a line each, in order. On a freshly
    started GPU machine the first process of each case ran at half speed (kernels compiled and cached, clocks
    rising): the discarded warm-up runs per side keep that out of the medians."""
    impls = sides(case, contenders)
    lines = [f"{impl:9} warm-up {i} (discarded)" for i in range(warmup) for impl in impls]
    return lines + [f"{impl:9} rep {rep}" for rep in range(repeats) for impl in rotated(impls, rep)]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench")
    parser.add_argument("--models", default="tiny", help="tiny,small (CPU) or qwen0.5b (GPU)")
    parser.add_argument(
        "--suite",
        choices=SUITES,
        help="user: the batch sizes people train with (default on a GPU); latency: small steps (default on CPU)",
    )
    parser.add_argument("--trainers", help=f"default: {','.join(GPU_TRAINERS)} for the GPU user suite, else all")
    parser.add_argument(
        "--cases",
        help="only these cases of the suite, by key (sft/8x2048,dpo/8x1024): a GPU session's device time, spent where "
        "it counts",
    )
    parser.add_argument("--contenders", help="trl, trl+liger (default: both on a GPU, trl on CPU)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--assets", default=str(ROOT / "assets" / "tiny"))
    parser.add_argument("--out", default=str(ROOT / "docs" / "benchmarks.md"))
    parser.add_argument(
        "--merge",
        action="store_true",
        help="keep the report's rows for cases this invocation does not run (split GPU sessions)",
    )
    parser.add_argument(
        "--attention",
        choices=["varlen", "flex_attention", "eager", "flash_attention_2", "flash_attention_3"],
        help="run every side's model with this attention kernel instead of SDPA (its rows name the model "
        "`qwen0.5b/flex_attention`)",
    )
    for variant in VARIANTS:
        parser.add_argument(
            f"--{variant.name}",
            action="store_true",
            help=f"{variant.help}; its rows name the model `qwen0.5b{variant.suffix}`",
        )
    parser.add_argument(
        "--log-every",
        type=int,
        default=None,
        help=f"steps between logs of SFT, reward, DPO and KTO on a GPU, every side alike (default "
        f"{USERS_LOGGING_EVERY}, as users run them); 1 makes each step wait for the device at its log, as every GPU "
        "row before session 44 did; its rows name the model `qwen0.5b+log-every-1`",
    )
    parser.add_argument(
        "--skip-steps",
        type=int,
        default=None,
        help="steps each run leaves out of its steady-state rate (default 5): fewer for cases whose steps take long "
        "(PPO 64×256 against TRL 1.12), so that more runs fit a device call; the rows' `runs × steps` says so",
    )
    parser.add_argument(
        "--warmup",
        type=int,
        default=None,
        help="discarded runs per side before each case's timed ones (default: 1 on a GPU, 0 on CPU)",
    )
    parser.add_argument(
        "--dry-run",
        action="store_true",
        help="print the runs this invocation would make, in order, and exit without running, measuring or writing "
        "anything: a device call's command checked before the lease",
    )
    args = parser.parse_args(argv)
    models = args.models.split(",")
    gpu = is_gpu_model(models[0])
    if any(is_gpu_model(m) != gpu for m in models):
        parser.error(
            "--models mixes CPU models (tiny, small) with GPU ones (qwen0.5b): run them in separate invocations"
        )
    suite = args.suite or ("user" if gpu else "latency")
    trainers = (
        args.trainers.split(",") if args.trainers else list(GPU_TRAINERS if gpu and suite == "user" else TRAINERS)
    )
    if unknown := [t for t in trainers if t not in TRAINERS]:
        parser.error(f"unknown trainer(s) {', '.join(unknown)}; choose from {', '.join(TRAINERS)}")
    contenders = (args.contenders or ("trl,trl+liger" if gpu else "trl")).split(",")
    if unknown := [c for c in contenders if c not in IMPLS[1:]]:
        parser.error(f"unknown contender(s) {', '.join(unknown)}; choose from {', '.join(IMPLS[1:])}")
    if "trl+liger" in contenders:
        if not gpu:
            parser.error("trl+liger runs Liger's Triton kernels, which need a GPU: use --contenders trl on CPU models")
        if importlib.util.find_spec("liger_kernel") is None:
            parser.error(
                "--contenders trl+liger needs liger-kernel: pip install -e '.[bench-gpu]' (on the device tool's "
                "machine, the wheels of `bench/device_wheels.sh`; docs/benchmarks.md, section Users' shapes on a GPU)"
            )
    wanted = args.cases.split(",") if args.cases else None
    planned = {model: chosen_cases(parser, model, suite, trainers, wanted) for model in models}
    warmup = args.warmup if args.warmup is not None else (1 if gpu else 0)
    if args.dry_run:
        for model, chosen in planned.items():
            for case in chosen:
                for line in run_order(case, contenders, warmup, args.repeats):
                    print(f"{case.key:22} {model:8} {line}")
        return
    from alignpipe.tiny import make_tiny

    assets = make_tiny(args.assets)
    peaks = machine_peaks(gpu)
    print(f"peaks: {json.dumps(peaks)}", flush=True)
    results: dict = {}
    phys: dict = {}
    rows: list[str] = []
    default_suite = "user" if gpu else "latency"
    section = ("gpu" if gpu else "cpu") + ("" if suite == default_suite else f"-{suite}")
    old = read_table(Path(args.out), section) if args.merge else []
    runs_label = f"{{runs}} × {args.steps}" + (
        f" (steady after {args.skip_steps})" if args.skip_steps is not None else ""
    )
    for model in models:
        label = model + (f"/{args.attention}" if args.attention else "")
        label += "".join(v.suffix for v in VARIANTS if v.name in chosen_variants(args))
        label += f"+log-every-{args.log_every}" if args.log_every is not None else ""
        for case in planned[model]:
            impls = sides(case, contenders)
            runs: dict[str, list] = {impl: [] for impl in impls}
            phys[(case, label)] = physics(case, model, assets, peaks)  # before the runs: a cut-short call keeps them
            # the counts are of the default attention's and LM head's work
            if args.attention not in (None, "varlen") or "unfused" in chosen_variants(args):
                phys[(case, label)] = replace(phys[(case, label)], counted=None)
            for _ in range(warmup):
                for impl in impls:
                    r = measure_variant(impl, case.key, model, args, assets)
                    print(
                        f"{case.key:22} {model:8} {impl:9} warm-up (discarded): {r['samples_per_s']:.1f}/s", flush=True
                    )
            for rep in range(args.repeats):
                for impl in rotated(impls, rep):
                    r = measure_variant(impl, case.key, model, args, assets)
                    runs[impl].append(r)
                    print(
                        f"{case.key:22} {model:8} {impl:9} rep {rep}: {r['samples_per_s']:.1f}/s end to end, "
                        f"steady {r.get('steady_samples_per_s')}, {r['peak_mb']:.0f} MB, loss {r['loss']}"
                        + (f", mean length {n}" if (n := r.get("mean_completion_length")) else "")
                        + (
                            f", {g} graphs compiled in {r['compile_s']:.1f} s"
                            if (g := r.get("compiled_graphs"))
                            else ""
                        )
                        + step_detail(r),
                        flush=True,
                    )
                # written after every round of every case: a call cut short (a device call's time limit) keeps the
                # rounds it finished, its rows naming how many runs each side had
                results[(case, label)] = runs
                rows = merge_rows(old, table(results, phys, peaks, gpu, runs_label))
                write_section(Path(args.out), section, report(rows, suite, gpu, warmup, peaks, args.merge))
    print("\n".join(rows))


def step_detail(r: dict) -> str:
    """A run's step times (ms, each step from the one before it), when its trained model's first forward began and
    its first step ended and how long after its last the run ended (data preparation and set-up; the first step's
    compiles and first allocations; saving: where an end-to-end ratio's fixed cost lies), the steady
    steps in which `torch.compile` built a graph, the synchronising CUDA calls of its steady steps
    (`run_one.SteadySyncs`, on a GPU) and the warnings it logged: a slow steady rate made of a few long steps
    (compiles, a JIT cache filled) reads differently from one made of uniformly slow steps (a step that waits on its
    host, or whose host waits on the device), and a fallback taken on the GPU alone (`run_one.Warnings`) says
    itself."""
    out = f"; step ms {' '.join(map(str, ms))}" if (ms := r.get("step_ms")) else ""
    if (first := r.get("to_first_step_s")) is not None:
        if (forward := r.get("to_first_forward_s")) is not None:
            out += f"; first forward {forward:.1f} s in"
        out += f"; first step done {first:.1f} s in, the run {r['after_last_step_s']:.1f} s after the last"
    if steps := r.get("steady_compile_steps"):
        out += f"; compiled in steady steps {', '.join(map(str, steps))}"
    if (syncs := r.get("steady_syncs")) is not None and (per_step := syncs["per_step"]):
        out += f"; synchronising calls in {len(per_step)} steady steps: {sum(per_step)}"
        if sum(per_step):
            out += f" (a step: {' '.join(map(str, per_step))}; from {', '.join(syncs['sites'])})"
    if warned := r.get("warnings"):
        out += "; warned: " + " | ".join(warned)
    return out


def report(rows: list[str], suite: str, gpu: bool, warmup: int, peaks: dict | None, merged: bool) -> list[str]:
    """The generated section: a heading, how it was measured, the table, how to reproduce it."""
    if gpu:
        where = f"{peaks['gpu']}, bf16 weights and optimizer state" if peaks else "a GPU"
        title = f"## GPU, {'users’ shapes' if suite == 'user' else 'latency shapes'}: Qwen2-0.5B-shaped model (random init, bf16)"
    else:
        where = f"{cpu()}, CPU fp32"
        title = (
            f"## CPU{', users’ shapes' if suite == 'user' else ''}: tiny (~1.7M) and small (~20M) Llama-shaped models"
        )
    limits = ""
    if peaks and not gpu:
        limits = (
            f"This CPU's limits, measured in the same invocation (`python -m bench.peaks --cpu`, on the "
            f"{peaks['cpu_threads']} threads a run gets): a 2048³ fp32 matrix product at "
            f"{peaks['matmul_tflops'] * 1e3:.0f} GFLOP/s; a 512 MiB copy in memory at "
            f"{peaks['copy_tb_s'] * 1e3:.1f} GB/s read + written. "
        )
    elif peaks:
        spec_flops = f" (data sheet {peaks['spec_tflops']:.0f})" if peaks.get("spec_tflops") else ""
        spec_bw = f" (data sheet {peaks['spec_tb_s']:.2f} TB/s read)" if peaks.get("spec_tb_s") else ""
        limits = (
            f"This GPU's limits, measured in the same invocation (`python -m bench.peaks`): an 8192³ bf16 matrix "
            f"product at {peaks['matmul_tflops']:.0f} TFLOP/s{spec_flops}; a device-to-device copy at "
            f"{peaks['copy_tb_s']:.2f} TB/s read + written{spec_bw}. "
        )
    shapes = (
        "Shapes: SFT rows × max length, packed best-fit (rows of a 128-token prompt and a log-normal completion of "
        "median 384 tokens); reward, DPO and KTO pairs × max length (prompts ~256, completions ~720 tokens); GRPO and "
        "RLOO prompts × completions × new tokens, PPO episodes × new tokens, online DPO prompts × 2 × new tokens "
        "(prompts ~96 tokens; micro-batches of 16 with 4 accumulated per step on both sides). "
        if suite == "user"
        else "Shapes: rows × max length"
        + (" (each row 24 synthetic rows run together, ~260 tokens)" if gpu else "")
        + "; GRPO and RLOO 2 prompts × 8 completions × new tokens; PPO episodes × new tokens (4 PPO epochs); online "
        "DPO prompts × 2 × new tokens. "
    )
    method = (
        "Median of the runs per side in the `runs × steps` column, who runs first rotating, each in a fresh process"
        + (f" (after {warmup} discarded warm-up run{'s' if warmup > 1 else ''} per side)" if warmup else "")
        + "; checkpointing off; identical data, model and hyperparameters on every side. "
        + (
            "Ratio: ours / contender at steady state (from the end of step 5, or of the step the `runs × steps` "
            "column names, to the last step: data preparation, warm-up and saving left out), the steps' ends "
            "timed by CUDA events on the device's own timeline; SFT, reward, DPO and KTO log every "
            f"{USERS_LOGGING_EVERY} steps on every side, as users do, the online trainers every step; end-to-end "
            "ratio: data preparation + training + saving. tokens/s = "
            "samples/s × real tokens per sample of the identical data (a packed block: as our best-fit packer fills "
            "it, which TRL's `bfd` matches). MFU: tokens/s × model FLOPs per token (6·N + 12·L·d·s, s the span a "
            "token attends over; DPO and KTO add the reference forward) over the data-sheet dense bf16 peak · over "
            "the measured matmul. Counted work: the FLOPs a sample each side's kernels run (products, and attention "
            "as its kernel runs it: a padded row's whole square under a mask), counted on CPU by `bench.device_work` "
            "(bench/device_counts.json); contender / ours is the ratio equal FLOP rates would give, so the measured "
            "ratio over it is ours' FLOP rate over the contender's; counted TFLOP/s: steady samples/s × those FLOPs, "
            "of the measured matmul. Generated tokens/s: samples/s × completions × their logged mean length (TRL 1.12's "
            "PPO logs none: its maximum), beside the bound a decode step reading every weight and the KV cache at the "
            "measured copy rate allows; 'generating' after it: the rollouts' generation alone, as our trainers log it "
            "(`generation/tokens_per_s`, the median of the steady steps). Memory: `torch.cuda.max_memory_allocated`. "
            if gpu
            else "Ratio: ours / contender, end to end (data preparation + training + saving; model loading "
            "excluded); tokens/s = samples/s × mean real tokens per sample of the identical data. MFU: those "
            "tokens/s × model FLOPs per token (6·N + 12·L·d·s; DPO and KTO add the reference forward) over the "
            "measured matmul (these models' matrices are 192 to 512 wide, where a product runs below the 2048-wide "
            "one's rate). Generated tokens/s: samples/s × completions × their logged "
            "mean length, beside the bound a decode step reading every fp32 weight and the KV cache at the measured "
            "copy rate allows (the tiny model's 7 MB fit in cache, so that bound is the memory's, not the cache's); "
            "'generating' after it: the rollouts' generation alone, as our trainers log it. Memory: peak RSS of the "
            "process, imports included. "
        )
        + (
            "Rows of earlier invocations (`--merge`) are kept with their own runs × steps, their MFU and bounds "
            "against the limits their own invocation measured. "
            if merged
            else ""
        )
        + "Absolute numbers swing between runs on shared machines; ratios from one run are what count."
    )
    reproduce = (
        "Reproduce on a GPU: `python -m bench --models qwen0.5b` (users' shapes against TRL and TRL + Liger; "
        "`--suite latency` for the small steps; a few trainers per invocation with `--trainers grpo,ppo --merge`); "
        "profile one case with `python -m bench.profile ours sft/8x2048 qwen0.5b --steps 10`."
        if gpu
        else "Reproduce: `make bench` (or `python -m bench --models tiny,small --repeats 3`)."
    )
    return [
        title,
        "",
        f"Measured {datetime.date.today()} on {where}; {versions()}.",
        limits + shapes + method,
        "",
        *rows,
        "",
        reproduce,
        "",
    ]


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
