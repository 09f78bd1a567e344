"""The benchmark report's plumbing and the profiler wrapper (the measurements themselves run in `make bench`, never
in tests)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from bench.__main__ import sft_flops_per_token, write_section
from bench.orchestration import critical_path
from bench.run_one import WARMUP_STEPS, StepClock

ROOT = Path(__file__).resolve().parents[1]


def test_a_generated_section_is_replaced_and_hand_written_text_kept(tmp_path):
    report = tmp_path / "benchmarks.md"
    write_section(report, "cpu", ["| a |", "| 1 |"])
    report.write_text("# Title\n\n" + report.read_text() + "\n## Notes by hand\n")
    write_section(report, "cpu", ["| a |", "| 2 |"])
    write_section(report, "gpu", ["| g |"])
    text = report.read_text()
    assert text.startswith("# Title") and "## Notes by hand" in text
    assert "| 2 |" in text and "| 1 |" not in text and text.count("<!-- bench:cpu -->") == 1
    assert text.index("<!-- bench:gpu -->") > text.index("## Notes by hand")


def test_warm_up_runs_are_measured_but_left_out_of_the_medians(tiny, tmp_path, monkeypatch):
    import bench.__main__ as bench_main

    calls = []

    def fake(impl, task, model, steps, assets):
        calls.append(impl)
        first = len(calls) <= 2  # the warm-up pair: slow, as a cold machine's first processes
        return {"samples_per_s": 1.0 if first else 10.0, "peak_mb": 100.0, "loss": 0.5, "steady_samples_per_s": None}

    monkeypatch.setattr(bench_main, "measure", fake)
    monkeypatch.setattr(bench_main, "mean_tokens", lambda *a: 20.0)
    out = tmp_path / "report.md"
    bench_main.main(["--trainers", "sft", "--repeats", "3", "--warmup", "1", "--assets", str(tiny), "--out", str(out)])
    assert calls == ["ours", "trl", "ours", "trl", "trl", "ours", "ours", "trl"]
    text = out.read_text()
    assert "after 1 discarded warm-up run per side" in text
    row = next(line for line in text.splitlines() if line.startswith("| sft"))
    assert "| 10.0 | 10.0 |" in row and "**1.00×**" in row


def test_split_invocations_merge_into_one_table(tiny, tmp_path, monkeypatch):
    """A GPU session runs some trainers per invocation; `--merge` keeps the others' rows, replacing re-run ones."""
    import bench.__main__ as bench_main

    speed = {"value": 10.0}
    monkeypatch.setattr(
        bench_main, "measure", lambda *a: {"samples_per_s": speed["value"], "peak_mb": 1.0, "loss": 0.1}
    )
    monkeypatch.setattr(bench_main, "mean_tokens", lambda *a: None)
    out = tmp_path / "report.md"
    common = ["--assets", str(tiny), "--out", str(out), "--repeats", "1", "--warmup", "0"]
    bench_main.main(["--trainers", "sft,dpo", "--steps", "20", *common])
    speed["value"] = 20.0
    bench_main.main(["--trainers", "dpo,grpo", "--steps", "10", "--merge", *common])
    rows = [line for line in out.read_text().splitlines() if line.startswith("| ") and "trainer" not in line]
    assert [r.split("|")[1].strip() for r in rows] == ["sft", "dpo", "grpo"]
    assert "| 1 × 20 | 10.0 |" in rows[0] and "| 1 × 10 | 20.0 |" in rows[1] and "| 1 × 10 | 20.0 |" in rows[2]
    bench_main.main(["--trainers", "grpo", *common])  # without --merge the table is this invocation's alone
    assert next(
        line for line in out.read_text().splitlines() if line.startswith("| ") and "trainer" not in line
    ).startswith("| grpo")


def test_steady_rate_leaves_out_the_warm_up_steps():
    clock = StepClock()
    clock.times = [0.0] * WARMUP_STEPS + [10.0, 11.0, 12.0, 13.0]  # slow start, then 1 s per step
    assert clock.steady(per_step=8) == 8.0
    assert StepClock().steady(8) is None


def test_critical_path_follows_the_longest_chain_not_the_sum():
    # tiny-dpo: the SFT and reward-model branches run side by side
    seconds = {
        "sft-data": 1.0,
        "pref-data": 1.0,
        "eval-prompts": 1.0,
        "sft": 10.0,
        "rm": 30.0,
        "dpo": 5.0,
        "judge": 2.0,
        "judge-rm": 2.0,
    }
    total = critical_path(ROOT / "pipelines" / "tiny-dpo.yaml", seconds)
    assert total < sum(seconds.values())
    assert total >= 1.0 + 10.0 + 5.0 + 2.0  # format → sft → dpo → judge at least


def test_mfu_flops_count_the_qwen_shape():
    per_token = sft_flops_per_token("qwen0.5b", 0)
    assert 6 * 480e6 < per_token < 6 * 500e6  # 494M matmul parameters, LM head included
    assert sft_flops_per_token("tiny", 100) is None


def test_profile_of_a_case_reports_its_operators_and_matrix_multiply_share(tiny, tmp_path):
    """`python -m bench.profile` runs a benchmark case under the torch profiler and writes the op table,
    a Perfetto trace and the matrix-multiply share."""
    out = tmp_path / "prof"
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "bench.profile",
            "ours",
            "sft",
            "tiny",
            "--steps",
            "2",
            "--assets",
            str(tiny),
            "--out",
            str(out),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    prof = summary["profile"]
    assert summary["samples_per_s"] > 0 and prof["clock"] == "cpu" and prof["total_ms"] > 0
    ops = {row["op"] for row in prof["top"]}
    assert "aten::mm" in ops or "aten::addmm" in ops, ops
    assert 0 < prof["gemm_share"] < 1
    assert abs(sum(r["share"] for r in prof["top"]) - sum(r["ms"] for r in prof["top"]) / prof["total_ms"]) < 1e-6
    assert "traceEvents" in json.loads((out / "trace.json").read_text())
    assert "Self CPU" in (out / "ops.txt").read_text() and "matrix multiplies" in run.stdout


def test_summarize_counts_only_matrix_multiplies_in_the_gemm_share():
    from types import SimpleNamespace

    from bench.profile import summarize

    events = [
        SimpleNamespace(key="aten::mm", self_cpu_time_total=600.0, count=3),
        SimpleNamespace(key="aten::add", self_cpu_time_total=300.0, count=9),
        SimpleNamespace(key="aten::linear", self_cpu_time_total=100.0, count=3),
        SimpleNamespace(
            key="aten::_scaled_dot_product_flash_attention_for_cpu_backward", self_cpu_time_total=200.0, count=1
        ),
    ]
    s = summarize(events, device=False)
    assert s["total_ms"] == 1.2 and abs(s["gemm_share"] - 800 / 1200) < 1e-12
    assert [r["op"] for r in s["top"]][:2] == ["aten::mm", "aten::add"] and s["top"][-1]["op"] == "aten::linear"
