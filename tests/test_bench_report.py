"""The benchmark report's plumbing (the measurements themselves run in `make bench`, never in tests)."""

from __future__ import annotations

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


def test_steady_rate_leaves_out_the_warm_up_steps():
    clock = StepClock()
    clock.times = [0.0] * WARMUP_STEPS + [10.0, 11.0, 12.0, 13.0]  # slow start, then 1 s per step
    assert clock.steady(per_step=8) == 8.0
    assert StepClock().steady(8) is None


def test_critical_path_follows_the_longest_chain_not_the_sum():
    # tiny-dpo: the SFT and reward-model branches run side by side
    seconds = {"sft-data": 1.0, "pref-data": 1.0, "eval-prompts": 1.0, "sft": 10.0, "rm": 30.0, "dpo": 5.0, "judge": 2.0,
               "judge-rm": 2.0}
    total = critical_path(ROOT / "pipelines" / "tiny-dpo.yaml", seconds)
    assert total < sum(seconds.values())
    assert total >= 1.0 + 10.0 + 5.0 + 2.0  # format → sft → dpo → judge at least


def test_mfu_flops_count_the_qwen_shape():
    per_token = sft_flops_per_token("qwen0.5b", 0)
    assert 6 * 480e6 < per_token < 6 * 500e6  # 494M matmul parameters, LM head included
    assert sft_flops_per_token("tiny", 100) is None
