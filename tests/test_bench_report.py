"""The benchmark report's plumbing and the profiler wrapper (the measurements themselves run in `make bench`, never
in tests)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import tempfile
import typing
from pathlib import Path

import pytest
from support import known

from bench.__main__ import Physics, write_section
from bench.cases import cases, decode_bound, find_case, rows, tokens_per_sample, train_flops_per_token
from bench.orchestration import critical_path
from bench.run_one import WARMUP_STEPS, SteadySyncs, StepClock

ROOT = Path(__file__).resolve().parents[1]
CPU_PEAKS = {"cpu_threads": 2, "matmul_tflops": 0.1, "copy_tb_s": 0.01, "spec_tflops": None, "spec_tb_s": None}


@pytest.fixture(autouse=True)
def _no_peaks_measured(monkeypatch):
    """`python -m bench` measures the machine's matmul and copy rates first (seconds of both cores); the tests of
    its report give it fixed ones (`test_the_cpu_peaks_are_measured_on_the_threads_a_run_gets` runs the real one)."""
    import bench.__main__ as bench_main

    monkeypatch.setattr(bench_main, "machine_peaks", lambda gpu: CPU_PEAKS)


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

    def fake(impl, key, model, steps, assets, *_):
        calls.append(impl)
        first = len(calls) <= 2  # the warm-up pair: slow, as a cold machine's first processes
        return {"samples_per_s": 1.0 if first else 10.0, "peak_mb": 100.0, "loss": 0.5, "steady_samples_per_s": None}

    monkeypatch.setattr(bench_main, "measure", fake)
    monkeypatch.setattr(bench_main, "physics", lambda *a: Physics(20.0, None, None))
    out = tmp_path / "report.md"
    bench_main.main(["--trainers", "sft", "--repeats", "3", "--warmup", "1", "--assets", str(tiny), "--out", str(out)])
    assert calls == ["ours", "trl", "ours", "trl", "trl", "ours", "ours", "trl"]
    text = out.read_text()
    assert "after 1 discarded warm-up run per side" in text
    row = next(line for line in text.splitlines() if line.startswith("| sft"))
    assert row.startswith("| sft | tiny | 8×64 | trl | 3 × 20 | tokens/s | 200.0 | 200.0 | **1.00×** |"), row


def test_a_call_cut_short_keeps_the_rounds_it_finished(tiny, tmp_path, monkeypatch):
    """A device call stopped at its time limit mid-case: the report already holds the case's finished rounds, its
    row naming how many runs each side had."""
    import bench.__main__ as bench_main

    calls = []

    def fake(*a, **k):
        calls.append(a[0])
        if len(calls) == 5:  # the third run of round 2: the call's time is up
            raise KeyboardInterrupt
        return {"samples_per_s": float(len(calls)), "peak_mb": 1.0, "loss": 0.1}

    monkeypatch.setattr(bench_main, "measure", fake)
    monkeypatch.setattr(bench_main, "physics", lambda *a: Physics(None, None, None))
    out = tmp_path / "report.md"
    with pytest.raises(KeyboardInterrupt):
        bench_main.main(
            ["--trainers", "sft", "--repeats", "3", "--warmup", "0", "--assets", str(tiny), "--out", str(out)]
        )
    row = next(line for line in out.read_text().splitlines() if line.startswith("| sft"))
    # rounds: ours 1, trl 2; then trl 3, ours 4 (medians 2.5 and 2.5)
    assert row.startswith("| sft | tiny | 8×64 | trl | 2 × 20 | rows/s | 2.5 | 2.5 | **1.00×** |"), row


def test_split_invocations_merge_into_one_table(tiny, tmp_path, monkeypatch):
    """A GPU session runs some trainers per invocation; `--merge` keeps the others' rows, replacing re-run ones."""
    import bench.__main__ as bench_main

    speed = {"value": 10.0}
    monkeypatch.setattr(
        bench_main, "measure", lambda *a: {"samples_per_s": speed["value"], "peak_mb": 1.0, "loss": 0.1}
    )
    monkeypatch.setattr(bench_main, "physics", lambda *a: Physics(None, None, None))
    out = tmp_path / "report.md"
    common = ["--assets", str(tiny), "--out", str(out), "--repeats", "1", "--warmup", "0"]
    bench_main.main(["--trainers", "sft,dpo", "--steps", "20", *common])
    speed["value"] = 20.0
    bench_main.main(["--trainers", "dpo,grpo", "--steps", "10", "--merge", *common])
    rows = [line for line in out.read_text().splitlines() if line.startswith("| ") and "trainer" not in line]
    assert [r.split("|")[1].strip() for r in rows] == ["sft", "dpo", "grpo"]
    assert "| 1 × 20 | rows/s | 10.0 |" in rows[0]
    assert "| 1 × 10 | pairs/s | 20.0 |" in rows[1] and "| 1 × 10 | completions/s | 20.0 |" in rows[2]
    speed["value"] = 30.0
    bench_main.main(["--trainers", "sft", "--steps", "10", "--merge", *common])  # replaced where it stands
    rows = [line for line in out.read_text().splitlines() if line.startswith("| ") and "trainer" not in line]
    assert [r.split("|")[1].strip() for r in rows] == ["sft", "dpo", "grpo"]
    assert "| 1 × 10 | rows/s | 30.0 |" in rows[0] and "| 1 × 10 | pairs/s | 20.0 |" in rows[1]
    bench_main.main(["--trainers", "grpo", *common])  # without --merge the table is this invocation's alone
    assert next(
        line for line in out.read_text().splitlines() if line.startswith("| ") and "trainer" not in line
    ).startswith("| grpo")


def test_merged_rows_stay_grouped_by_model():
    """Rows a later invocation adds go after the last row of their model, not after every other model's rows: a
    table merged from invocations by trainer (offline ones, then rollouts) still reads model by model."""
    from bench.__main__ import merge_rows

    head = ["| trainer | model | shape | contender | x |", "|---|---|---|---|---|"]

    def row(trainer: str, model: str, value: str) -> str:
        return f"| {trainer} | {model} | 8×64 | trl | {value} |"

    first = head + [row("sft", "tiny", "1"), row("dpo", "tiny", "1"), row("sft", "small", "1")]
    merged = merge_rows(first, head + [row("grpo", "tiny", "2"), row("grpo", "small", "2"), row("sft", "tiny", "3")])
    assert merged == head + [
        row("sft", "tiny", "3"),
        row("dpo", "tiny", "1"),
        row("grpo", "tiny", "2"),
        row("sft", "small", "1"),
        row("grpo", "small", "2"),
    ]
    assert merge_rows(first, head + [row("sft", "qwen0.5b", "4")])[-1] == row("sft", "qwen0.5b", "4")


def test_each_run_counts_what_it_compiled_and_its_line_says_so(tiny, tmp_path, monkeypatch, capsys):
    """A run reports the graphs `torch.compile` built during it and the seconds that took (its share of the fixed
    cost a GPU run of ours pays for its fused kernels); the per-run line prints them where there were any."""
    import torch

    import bench.__main__ as bench_main
    from bench.run_one import case, compilations

    graphs, seconds = compilations()
    square = torch.compile(lambda x: x * x + 1, dynamic=True)
    square(torch.ones(3))
    after = compilations()
    assert after[0] == graphs + 1 and after[1] > seconds
    run = case("ours", "sft/8x64", "tiny", 2, str(tiny))
    assert run["compiled_graphs"] == 0 and run["compile_s"] == 0.0  # on a CPU our stages compile nothing
    # the fixed cost split: before the first step's end, after the last's; with the steps between, the whole
    between = sum(run["step_ms"]) / 1e3
    assert run["to_first_step_s"] > 0 and run["after_last_step_s"] >= 0
    assert run["to_first_step_s"] + between + run["after_last_step_s"] == pytest.approx(run["seconds"], abs=0.1)
    # the set-up (tokenizing, packing, the loop) ends where the model's first forward begins, inside the first step
    assert 0 < run["to_first_forward_s"] < run["to_first_step_s"]

    def fake(impl, key, model, steps, assets, *_):
        compiled = {"compiled_graphs": 6, "compile_s": 4.25} if impl == "ours" else {"compiled_graphs": 0}
        return {"samples_per_s": 5.0, "peak_mb": 1.0, "loss": 0.1, **compiled}

    monkeypatch.setattr(bench_main, "measure", fake)
    monkeypatch.setattr(bench_main, "physics", lambda *a: Physics(None, None, None))
    bench_main.main(["--cases", "sft/8x64", "--assets", str(tiny), "--out", str(tmp_path / "r.md"), "--repeats", "1"])
    lines = [line for line in capsys.readouterr().out.splitlines() if " rep 0: " in line]
    assert [", 6 graphs compiled in 4.2 s" in line for line in lines] == [True, False], lines


def test_an_online_run_logged_once_reports_no_step_times_and_one_logged_every_step_does(tiny):
    """Our online trainers' steps are timed at their logs. Logged once at the end (the CPU shapes), that one log is
    not the first step's end: the run reports no step times and no split of its fixed cost. Logged every step (the
    GPU shapes), each step has its time and the split adds up to the run."""
    import dataclasses

    from bench.cases import find_case
    from bench.run_one import case

    once = find_case("tiny", "grpo/2x8x32")
    assert once.shape.log_every == 0
    run = case("ours", once, "tiny", 2, str(tiny))
    assert run["step_ms"] == [] and "to_first_step_s" not in run and run["samples_per_s"] > 0
    every = dataclasses.replace(once, shape=dataclasses.replace(once.shape, log_every=1))
    run = case("ours", every, "tiny", 2, str(tiny))
    assert len(run["step_ms"]) == 1 and run["to_first_step_s"] > 0
    whole = run["to_first_step_s"] + run["step_ms"][0] / 1e3 + run["after_last_step_s"]
    assert whole == pytest.approx(run["seconds"], abs=0.1)


def test_the_split_names_the_first_forward_only_inside_the_first_step():
    """`to_first_forward_s` is said where the first forward came after the trainer's start and by the first step's
    end; a forward outside that (none seen, or one before the timed part) says nothing rather than a wrong split."""
    clock = StepClock()
    clock.times = [14.0, 15.0]
    assert clock.ends(10.0, 16.5, 12.5) == {"to_first_step_s": 4.0, "after_last_step_s": 1.5, "to_first_forward_s": 2.5}
    assert "to_first_forward_s" not in clock.ends(10.0, 16.5, None)
    assert "to_first_forward_s" not in clock.ends(10.0, 16.5, 9.0)
    assert StepClock().ends(10.0, 16.5, 12.5) == {}


def test_the_first_forward_hook_keeps_the_first_call_and_leaves_nothing_behind():
    import torch

    from bench.run_one import FirstForward

    model = torch.nn.Linear(2, 2)
    seen = FirstForward(model)
    assert seen.at is None
    model(torch.ones(1, 2))
    first = seen.at
    model(torch.ones(1, 2))
    assert first is not None and seen.at == first
    seen.remove()
    assert not model._forward_pre_hooks


def test_steady_rate_leaves_out_the_warm_up_steps():
    clock = StepClock()
    clock.times = [0.0] * WARMUP_STEPS + [10.0, 11.0, 12.0, 13.0]  # slow start, then 1 s per step
    assert clock.steady(per_step=8) == 8.0
    assert StepClock().steady(8) is None


def test_the_clock_gives_each_step_s_time_and_the_steady_steps_that_compiled(monkeypatch):
    """Each tick notes the graphs `torch.compile` has built: a compile inside the steady window is named by its step
    (tick k ends step k + 1), one during the warm-up steps is not."""
    import bench.run_one as run_one

    built = iter([1, 2, 2, 2, 2, 2, 2, 3, 3, 3])  # step 2 (warm-up) and step 8 (steady) compiled
    monkeypatch.setattr(run_one, "graphs_built", lambda: next(built))
    times = iter([0.0, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0, 3.5, 3.6, 3.7])
    monkeypatch.setattr(run_one.time, "perf_counter", lambda: next(times))
    clock = StepClock()
    for _ in range(10):
        clock.tick()
    assert clock.step_ms() == [500, 100, 100, 100, 100, 100, 2500, 100, 100]
    assert WARMUP_STEPS == 5 and clock.steady_graphs() == [8]


def test_a_run_line_says_its_step_times_steady_compiles_syncs_and_warnings():
    from bench.__main__ import step_detail

    run = {"step_ms": [900, 190, 2500], "steady_compile_steps": [8], "warnings": ["alignpipe.x: fell back", "torch: y"]}
    assert step_detail(run) == (
        "; step ms 900 190 2500; compiled in steady steps 8; warned: alignpipe.x: fell back | torch: y"
    )
    assert step_detail({"step_ms": []}) == step_detail({}) == ""
    ends = {"step_ms": [900], "to_first_step_s": 7.25, "after_last_step_s": 1.5}
    assert step_detail(ends) == "; step ms 900; first step done 7.2 s in, the run 1.5 s after the last"
    assert step_detail(ends | {"to_first_forward_s": 3.04}) == (
        "; step ms 900; first forward 3.0 s in; first step done 7.2 s in, the run 1.5 s after the last"
    )
    synced: dict[str, typing.Any] = {"steady_syncs": {"per_step": [0, 0, 0], "sites": []}}
    assert step_detail(synced) == "; synchronising calls in 3 steady steps: 0"
    synced = {"steady_syncs": {"per_step": [2, 0, 1], "sites": ["trl/trainer/dpo_trainer.py:900 ×3"]}}
    assert step_detail(synced) == (
        "; synchronising calls in 3 steady steps: 3 (a step: 2 0 1; from trl/trainer/dpo_trainer.py:900 ×3)"
    )


class _DeviceEvent:
    """`torch.cuda.Event` as the clock uses it, on a device clock the test sets (`now`, seconds)."""

    now = 0.0
    waited: typing.ClassVar[list] = []

    def __init__(self, enable_timing: bool):
        assert enable_timing

    def record(self) -> None:
        self.at = _DeviceEvent.now

    def elapsed_time(self, later) -> float:
        return 1000 * (later.at - self.at)

    def synchronize(self) -> None:
        _DeviceEvent.waited.append(self)


def test_on_a_gpu_the_clock_times_steps_on_the_device_s_own_timeline(monkeypatch):
    """The host issues a step in 10 ms and runs ahead; the device takes 200 ms a step (500 ms the first). The clock
    reads the device's events after the run, with one wait, so the steps' times and the steady rate are the device's,
    not the host's issuing."""
    import bench.run_one as run_one

    host = iter(0.01 * k for k in range(100))
    monkeypatch.setattr(run_one.time, "perf_counter", lambda: next(host))
    clock = StepClock(event=_DeviceEvent)
    _DeviceEvent.waited = []
    for k in range(WARMUP_STEPS + 4):
        _DeviceEvent.now = 0.5 + 0.2 * k
        clock.tick()
    assert clock.step_ms() == [10] * (WARMUP_STEPS + 3), "the host's times until the run is read back"
    clock.finish()
    assert clock.step_ms() == [200] * (WARMUP_STEPS + 3)
    assert clock.steady(per_step=8) == pytest.approx(40.0)
    assert len(_DeviceEvent.waited) == 1 and clock.syncs is None  # no step count: nothing to count syncs over


def _wait_for_the_device() -> None:
    import warnings

    warnings.warn("called a synchronizing CUDA operation", stacklevel=1)  # torch's words, as the debug mode warns


def test_a_gpu_run_counts_the_synchronising_calls_of_its_steady_steps_and_where_they_came_from(monkeypatch):
    """Calls before the steady window (warm-up steps) and after the last step (saving) are not counted; each steady
    step's are, with the line outside torch that made them; the debug mode and the warning filters are put back."""
    import contextlib
    import warnings

    import torch

    modes: list[str] = []
    monkeypatch.setattr(torch.cuda, "set_sync_debug_mode", modes.append)
    steps = WARMUP_STEPS + 4
    clock = StepClock(steps, event=_DeviceEvent)
    shown = warnings.showwarning
    line = _wait_for_the_device.__code__.co_firstlineno + 3
    for k in range(steps):
        if k in (0, WARMUP_STEPS + 1, WARMUP_STEPS + 3):  # a warm-up step; steady steps 1 and 3 (of 3)
            with warnings.catch_warnings(record=True) if k == 0 else contextlib.nullcontext():
                _wait_for_the_device()
                _wait_for_the_device()
        clock.tick()
    with warnings.catch_warnings(record=True):
        _wait_for_the_device()  # after the last step: not counted
    clock.finish()
    assert modes == ["warn", "default"] and warnings.showwarning is shown
    assert clock.syncs is not None
    assert clock.syncs.summary() == {"per_step": [2, 0, 2], "sites": [f"tests/test_bench_report.py:{line} ×4"]}
    monkeypatch.setattr(SteadySyncs, "TRACED", 1)  # past the first call, counted without a caller
    syncs = SteadySyncs()
    syncs.start()
    for _ in range(3):
        _wait_for_the_device()
    syncs.mark()
    syncs.stop()
    assert syncs.summary() == {"per_step": [3], "sites": [f"tests/test_bench_report.py:{line} ×1"]}


def test_our_offline_runs_tick_at_each_optimizer_step_whatever_they_log(tiny):
    """Ours' SFT and DPO are timed by their optimizer steps (one log at the end on a CPU), once a step even where the
    step calls its parent class's (`LowPrecisionAdamW` hands float32 parameters to torch's AdamW, whose step torch
    wraps with the same global hooks once any AdamW exists)."""
    import torch
    from torch.optim.optimizer import register_optimizer_step_post_hook

    from alignpipe.low_precision_adamw import LowPrecisionAdamW
    from bench.run_one import case, optimizer_ticks

    for key in ("sft/8x64", "dpo/8x64"):
        run = case("ours", key, "tiny", 7, str(tiny))
        assert len(run["step_ms"]) == 6, (key, run["step_ms"])
        assert "steady_syncs" not in run  # a CPU run

    torch.optim.AdamW([torch.nn.Parameter(torch.ones(2))])  # torch wraps AdamW.step with the hooks
    low, full = torch.nn.Parameter(torch.ones(4, dtype=torch.bfloat16)), torch.nn.Parameter(torch.ones(4))
    optimizer = LowPrecisionAdamW([low, full], lr=1e-3)
    calls = []
    counted = register_optimizer_step_post_hook(lambda *_: calls.append(1))
    clock = StepClock()
    try:
        with optimizer_ticks(clock):
            for _ in range(3):
                low.grad, full.grad = torch.ones_like(low), torch.ones_like(full)
                optimizer.step()
    finally:
        counted.remove()
    assert len(calls) == 6 and len(clock.times) == 3
    optimizer.step()
    assert len(clock.times) == 3, "the hooks are gone after the run"


def test_a_run_keeps_the_distinct_warnings_its_library_and_torch_log():
    """`run_one.Warnings` collects what alignpipe's and torch's loggers warn of during a run (a GPU-only fallback is
    said once there), each once, and nothing below a warning or from other libraries; it lets go afterwards."""
    import logging

    from bench.run_one import Warnings

    with Warnings() as warned:
        for _ in range(3):
            logging.getLogger("alignpipe.attention").warning("varlen %s", "fell back")
        logging.getLogger("torch._dynamo").warning("cache_size_limit reached")
        logging.getLogger("alignpipe.stage").info("a step")
        logging.getLogger("transformers").warning("not ours")
    logging.getLogger("alignpipe").warning("after the run")
    assert warned.messages == ["alignpipe.attention: varlen fell back", "torch._dynamo: cache_size_limit reached"]
    with Warnings() as many:
        for i in range(Warnings.KEEP + 3):
            logging.getLogger("alignpipe").warning("warning %d", i)
    assert len(many.messages) == Warnings.KEEP


def test_the_optimizer_s_host_time_is_its_step_s_cpu_time_a_call():
    from types import SimpleNamespace

    from bench.profile import optimizer_host_ms

    events = [
        SimpleNamespace(key="Optimizer.step#LowPrecisionAdamW.step", cpu_time_total=30_000.0, count=3),
        SimpleNamespace(key="Optimizer.zero_grad#LowPrecisionAdamW.zero_grad", cpu_time_total=900.0, count=3),
        SimpleNamespace(key="aten::mm", cpu_time_total=5_000.0, count=10),
    ]
    assert optimizer_host_ms(events) == {"LowPrecisionAdamW.step": 10.0}


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
    per_token = known(train_flops_per_token("sft", "qwen0.5b", 0))
    assert 6 * 480e6 < per_token < 6 * 500e6  # 494M matmul parameters, LM head included
    assert known(train_flops_per_token("sft", "qwen0.5b", 2048)) - per_token == 12 * 24 * 896 * 2048
    assert known(train_flops_per_token("reward", "qwen0.5b", 0)) < per_token - 6 * 130e6  # no LM head (136M)
    assert train_flops_per_token("dpo", "qwen0.5b", 0) == pytest.approx(per_token * 8 / 6)  # + the reference forward
    assert train_flops_per_token("grpo", "qwen0.5b", 9) is None  # online: read against the decode bound
    # the CPU models: tiny 4 layers × (q,o 2·192² + k,v 2·192·64 + MLP 3·192·512) + a 512 × 192 head ("~1.7M")
    assert train_flops_per_token("sft", "tiny", 0) == 6 * (4 * (2 * 192**2 + 2 * 192 * 64 + 3 * 192 * 512) + 512 * 192)
    assert 6 * 19e6 < known(train_flops_per_token("sft", "small", 0)) < 6 * 21e6  # the 20M Llama


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
    # the tiny model's float32 weights take torch's AdamW, which the profiler records around its step
    assert prof["optimizer_host_ms"]["AdamW.step"] > 0 and "AdamW.step: " in run.stdout


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["ours", "sfft", "tiny"], "no trainer 'sfft'; one of: sft, reward"),
        (["ours", "sft/8x2049", "tiny"], "no case 'sft/8x2049' for model tiny; its cases: "),
        (["ours", "sft", "tiny", "--steps", "0"], "'0' is not a whole number of steps of at least 1"),
        (["ours", "sft", "tiny", "--assets", "/nonexistent"], "--assets /nonexistent holds no tiny assets"),
        (["ours", "sft", "qwen0.5b"], "qwen0.5b is the GPU model and this machine has no GPU"),
    ],
)
def test_profile_refuses_arguments_it_cannot_run_before_building_a_model(tiny, argv, says, capsys):
    import torch

    from bench.profile import main

    if "qwen0.5b" in argv and torch.cuda.is_available():
        pytest.skip("a GPU machine profiles qwen0.5b")
    if "--assets" not in argv:
        argv = [*argv, "--assets", str(tiny)]
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2 and says in capsys.readouterr().err


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


def test_on_a_gpu_the_summary_adds_up_kernels_only_and_sorts_them_by_kind():
    """The device clock: an operator's own device time is its kernels' time again (aten::mm and its GEMM kernel), and
    a Triton kernel that Liger launches outside any operator has no operator row; so the total, the matrix-multiply
    share and the kinds come from kernel rows alone, and both sides of a comparison add up alike."""
    from types import SimpleNamespace

    from bench.profile import kernel_kind, summarize

    def row(key, us, device, count=1):
        return SimpleNamespace(
            key=key, self_device_time_total=us, count=count, device_type=SimpleNamespace(name=device)
        )

    events = [
        row("aten::mm", 500.0, "CPU", 3),
        row("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64", 500.0, "CUDA", 3),
        row("pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<64, 128>>", 100.0, "CUDA"),
        row("_rms_norm_forward_kernel", 150.0, "CUDA", 49),  # Liger's Triton norm: no operator row
        row("triton_poi_fused_mul_silu_0", 100.0, "CUDA", 24),
        row(
            "void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<c10::BFloat16>>",
            80.0,
            "CUDA",
        ),
        row("Memcpy DtoD (Device -> Device)", 20.0, "CUDA"),
        row("void at::native::(anonymous namespace)::multi_tensor_apply_kernel<FusedAdamMathFunctor>", 50.0, "CUDA"),
        SimpleNamespace(
            key="ProfilerStep#1",
            self_device_time_total=1000.0,
            count=1,
            device_type=SimpleNamespace(name="CUDA"),
            is_user_annotation=True,
        ),
    ]
    s = summarize(events, device=True)
    assert s["clock"] == "device" and s["total_ms"] == 1.0
    assert abs(s["gemm_share"] - 0.6) < 1e-12
    assert {k: round(v["ms"], 3) for k, v in s["kinds"].items()} == {
        "matmul": 0.5,
        "norm": 0.15,
        "attention": 0.1,
        "swiglu": 0.1,
        "element-wise": 0.08,
        "optimizer": 0.05,
        "copy": 0.02,
    }
    assert "aten::mm" not in [r["op"] for r in s["top"]]
    assert kernel_kind("ampere_bf16_s16816gemm_bf16_128x64_ldg8_f2f_tn") == "matmul"
    assert kernel_kind("cutlass3x_sm90_tensorop_gemm_bf16_bf16_f32_bf16_bf16_128x128x64_1x1x1_0_tnn_align8") == "matmul"
    # attention kernels' full names hold cutlass's types: still attention, not matmul
    flash = "void pytorch_flash::flash_bwd_dq_dk_dv_loop_seqk_parallel_kernel<Flash_bwd_kernel_traits<64, cutlass::bfloat16_t>>"
    efficient = (
        "fmha_cutlassF_bf16_aligned_64x64_rf_sm80(PyTorchMemEfficientAttention::AttentionKernel<cutlass::bfloat16_t>)"
    )
    assert kernel_kind(flash) == "attention" and kernel_kind(efficient) == "attention"
    assert kernel_kind("_swiglu_forward_kernel") == "swiglu" and kernel_kind("_triton_rope") == "rotary"
    assert kernel_kind("triton_red_fused__log_softmax_exp_1") == "loss"
    assert kernel_kind("triton_poi_fused_add_0") == "triton, other" and kernel_kind("some_unknown_kernel") == "other"


def test_the_user_suite_runs_the_shapes_people_train_with():
    """Issue 18's shapes: SFT packed 8×2048 and 4×4096, reward and DPO 8 pairs of ~1024 tokens, GRPO 8 prompts × 8
    completions × 256 new tokens, PPO 64 episodes × 256 new tokens; the GPU default, the latency suite beside it."""
    user = {c.key: c.shape for c in cases("qwen0.5b", "user", ["sft", "reward", "dpo", "grpo", "ppo"])}
    assert list(user) == ["sft/8x2048", "sft/4x4096", "reward/8x1024", "dpo/8x1024", "grpo/8x8x256", "ppo/64x256"]
    assert user["sft/8x2048"].packed and user["sft/8x2048"].per_step * user["sft/8x2048"].max_len == 16384
    assert user["sft/4x4096"].per_step * user["sft/4x4096"].max_len == 16384
    assert user["dpo/8x1024"].per_step == 8 and user["dpo/8x1024"].max_len == 1024
    grpo, ppo = user["grpo/8x8x256"], user["ppo/64x256"]
    assert grpo.per_step == 64 and grpo.generations == 8 and grpo.completion == 256
    assert ppo.per_step == 64 and ppo.completion == 256
    # an online step is timed by its log; an offline one by its optimizer step, logging as users do
    assert [s.log_every for s in user.values()] == [10, 10, 10, 10, 1, 1]
    assert find_case("qwen0.5b", "dpo/8x512").shape.log_every == 10
    assert find_case("tiny", "sft/8x64").shape.max_len == 64  # the CPU latency shape
    assert find_case("qwen0.5b", "grpo/2x8x64").shape.per_step == 16
    with pytest.raises(SystemExit, match="unknown case"):
        find_case("tiny", "sft/9x9")


def test_user_shape_data_has_the_lengths_the_shapes_name(tiny):
    from alignpipe.modeling import load_tokenizer

    tok = load_tokenizer(str(tiny / "model"))
    n_tokens = lambda text: len(tok(text, add_special_tokens=False)["input_ids"])  # noqa: E731
    sft = find_case("qwen0.5b", "sft/8x2048")
    data = rows(str(tiny), sft, steps=4, tokenizer=tok)
    lengths = [n_tokens(r["completion"]) for r in data]
    assert sum(n_tokens(r["prompt"]) + n for r, n in zip(data, lengths)) >= 4 * 16384, "enough for the steps"
    assert min(lengths) < 250 < 384 < 600 < max(lengths) < 2048, "completions spread around the median"
    packed = tokens_per_sample(sft, [n + 129 for n in lengths])
    assert 0.95 * 2048 < packed <= 2048, "best-fit packing fills the blocks"
    dpo = rows(str(tiny), find_case("qwen0.5b", "dpo/8x1024"), steps=2, tokenizer=tok)
    assert len(dpo) >= 16
    for r in dpo[:8]:
        # joined texts tokenize a little differently at the seams than their parts
        assert 230 <= n_tokens(r["prompt"]) < 290 and 680 <= n_tokens(r["chosen"]) < 780
        assert 680 <= n_tokens(r["rejected"]) < 780
    grpo = rows(str(tiny), find_case("qwen0.5b", "grpo/8x8x256"), steps=2, tokenizer=tok)
    assert len(grpo) >= 16 and all(85 <= n_tokens(r["prompt"]) < 120 for r in grpo)


def test_decode_bound_counts_weights_and_kv_cache_read_per_step():
    grpo = find_case("qwen0.5b", "grpo/8x8x256")
    bound = decode_bound(grpo, "qwen0.5b", 3.0e12)
    # 494M bf16 weights (~0.99 GB) + 64 sequences × ~224 tokens of KV cache (12 KiB a token) per step
    per_step = 2 * 494e6 + 64 * 224 * 24 * 2 * 2 * 64 * 2
    assert bound == pytest.approx(64 * 3.0e12 / per_step, rel=0.02)
    assert 150_000 < bound < 200_000
    tiny = find_case("tiny", "grpo/2x8x32")  # fp32 on the CPU: 4 bytes a weight and a cached value
    tiny_step = 4 * (4 * (2 * 192**2 + 2 * 192 * 64 + 3 * 192 * 512) + 512 * 192)
    tiny_step += 4 * 16 * (tiny.shape.prompt_tokens + 16) * 4 * 2 * 2 * 32
    assert decode_bound(tiny, "tiny", 1e10) == pytest.approx(16 * 1e10 / tiny_step)


def test_the_gpu_rows_read_each_side_s_work_a_sample_from_the_counts_device_work_kept(tmp_path):
    """`counted_flops`: products and attention a sample by side, from `bench/device_counts.json` as kept (a DPO pair:
    a step's over its 8 pairs; a packed SFT block: FLOPs a token × the block's tokens); None for a case or file
    without counts."""
    import json

    from bench.__main__ import COUNTS, counted_flops

    kept = json.loads(COUNTS.read_text())
    dpo = counted_flops(find_case("qwen0.5b", "dpo/8x1024"), 1900.0)
    ours = kept["dpo/8x1024"]["ours"]
    assert dpo is not None and dpo["ours"] == pytest.approx((ours["total"] + ours["attention"]) / 8)
    assert dpo["trl+liger"] / dpo["ours"] == pytest.approx(1.34, abs=0.005)  # session 60's count
    sft = counted_flops(find_case("qwen0.5b", "sft/8x2048"), 2000.0)
    trl = kept["sft/8x2048"]["trl"]
    assert sft is not None and sft["trl"] == pytest.approx((trl["total"] + trl["attention"]) / trl["tokens"] * 2000.0)
    assert counted_flops(find_case("qwen0.5b", "grpo/8x8x256"), 1.0) is None
    assert counted_flops(find_case("qwen0.5b", "dpo/8x1024"), 1.0, tmp_path / "none.json") is None


def test_trl_s_bfd_packing_fills_blocks_as_ours_does_at_the_users_sft_shapes(tiny):
    """The GPU table's tokens/s for packed SFT are samples/s × ours' real tokens a block, on both sides: TRL's `bfd`
    must fill its blocks as ours does, or the contender's rate would be scaled wrong."""
    from datasets import Dataset
    from trl.data_utils import pack_dataset

    from alignpipe.modeling import load_tokenizer
    from bench.cases import row_lengths

    tok = load_tokenizer(str(tiny / "model"))
    for key in ("sft/8x2048", "sft/4x4096"):
        case = find_case("qwen0.5b", key)
        lengths = row_lengths(str(tiny), case, tok)
        packed = pack_dataset(Dataset.from_dict({"input_ids": [[1] * n for n in lengths]}), case.shape.max_len, "bfd")
        fills = [len(ids) for ids in packed["input_ids"]]
        assert sum(fills) == sum(lengths), "bfd splits no row"
        assert sum(fills) / len(fills) == pytest.approx(tokens_per_sample(case, lengths), rel=0.01), key


def test_each_contender_gets_its_row_with_mfu_and_the_rollout_bound():
    """On a GPU a case has a row per contender (TRL, TRL + Liger): the steady ratio, MFU against the data sheet and
    the measured matmul, generated tokens/s against the decode bound."""
    from bench.__main__ import table

    sft, grpo = find_case("qwen0.5b", "sft/8x2048"), find_case("qwen0.5b", "grpo/8x8x256")

    def run(e2e, steady, mb, length=None):
        return {
            "samples_per_s": e2e,
            "steady_samples_per_s": steady,
            "peak_mb": mb,
            "loss": 1.0,
            "mean_completion_length": length,
        }

    results = {
        (sft, "qwen0.5b"): {"ours": [run(5, 6, 20000)], "trl": [run(3, 4, 27000)], "trl+liger": [run(4, 5, 21000)]},
        (grpo, "qwen0.5b"): {
            "ours": [run(30, 40, 9000, 200.0) | {"generation_tokens_per_s": 24_000.0}],
            "trl": [run(10, 10, 9000, 256.0)],
        },
    }
    peaks = {"gpu": "NVIDIA H100", "matmul_tflops": 800.0, "copy_tb_s": 3.0, "spec_tflops": 989.4, "spec_tb_s": 3.35}
    flops = known(train_flops_per_token("sft", "qwen0.5b", 500))
    phys = {
        (sft, "qwen0.5b"): Physics(2000.0, flops, None, {"ours": 6.0e12, "trl": 7.2e12}),  # no trl+liger count
        (grpo, "qwen0.5b"): Physics(None, None, decode_bound(grpo, "qwen0.5b", 3.0e12)),
    }
    lines = table(results, phys, peaks, gpu=True, runs_label="1 × 20")
    cells = [[c.strip() for c in line.strip("|").split("|")] for line in lines[2:]]
    assert [c[3] for c in cells] == ["trl", "trl+liger", "trl"]
    sft_trl, sft_liger, grpo_trl = cells
    assert sft_trl[5:9] == ["tokens/s", "12,000.0", "8,000.0", "**1.50×**"] and sft_trl[9] == "1.67×"
    assert sft_liger[8] == "**1.20×**"
    mfu = 12_000 * flops / 1e12
    assert sft_trl[10] == f"{mfu / 989.4:.1%} · {mfu / 800:.1%}"
    # counted work: TRL's 1.2× ours' a sample; 6 samples/s × 6 TFLOP ours, 4 × 7.2 TRL's, of the 800 TFLOP/s matmul
    assert sft_trl[12:14] == ["1.20×", "36 (4%) · 29 (4%)"] and sft_liger[12:14] == ["–", "–"]
    assert sft_trl[14] == "–" and sft_trl[-3] == "0.74"
    assert grpo_trl[5:9] == ["completions/s", "40.0", "10.0", "**4.00×**"] and grpo_trl[10] == "–"
    assert grpo_trl[12:14] == ["–", "–"]
    bound = known(phys[(grpo, "qwen0.5b")].decode_bound)
    assert grpo_trl[14] == f"8,000 ({8000 / bound:.1%}); generating 24,000 ({24000 / bound:.1%})"
    assert grpo_trl[15] == f"2,560 ({2560 / bound:.1%})", "TRL logs no generation rate"


def test_cpu_rows_give_mfu_of_the_measured_matmul_and_the_rollout_bound(tiny, tmp_path):
    """The CPU table states its physical limits too: MFU against the matmul measured in the same invocation (no data
    sheet), generated tokens/s against the decode bound at the measured copy rate; the header says both rates."""
    import bench.__main__ as bench_main
    from bench.__main__ import report, table

    sft, grpo = find_case("tiny", "sft/8x64"), find_case("tiny", "grpo/2x8x32")

    def run(rate, length=None):
        return {"samples_per_s": rate, "peak_mb": 500.0, "loss": 1.0, "mean_completion_length": length}

    results = {
        (sft, "tiny"): {"ours": [run(10.0)], "trl": [run(5.0)]},
        (grpo, "tiny"): {"ours": [run(30.0, 20.0) | {"generation_tokens_per_s": 900.0}], "trl": [run(20.0, 32.0)]},
    }
    phys = {(c, "tiny"): bench_main.physics(c, "tiny", tiny, CPU_PEAKS) for c in (sft, grpo)}
    lines = table(results, phys, CPU_PEAKS, gpu=False, runs_label="1 × 20")
    header = [c.strip() for c in lines[0].strip("|").split("|")]
    assert header[9:13] == [
        "ours MFU (of matmul)",
        "contender MFU (of matmul)",
        "ours generated tokens/s (of bound)",
        "contender generated tokens/s (of bound)",
    ]
    sft_row, grpo_row = ([c.strip() for c in line.strip("|").split("|")] for line in lines[2:])
    tokens = 10.0 * known(phys[(sft, "tiny")].tokens_per_sample)
    assert sft_row[9] == f"{tokens * known(phys[(sft, 'tiny')].flops_per_token) / 0.1e12:.1%}" and sft_row[11] == "–"
    bound = known(phys[(grpo, "tiny")].decode_bound)
    assert bound == decode_bound(grpo, "tiny", 0.01e12)
    assert grpo_row[9] == "–" and grpo_row[11] == f"600 ({600 / bound:.1%}); generating 900 ({900 / bound:.1%})"
    text = "\n".join(report(lines, "latency", False, 0, CPU_PEAKS, False))
    assert "a 2048³ fp32 matrix product at 100 GFLOP/s; a 512 MiB copy in memory at 10.0 GB/s" in text


def test_the_cpu_peaks_are_measured_on_the_threads_a_run_gets():
    """`python -m bench.peaks --cpu`, as `python -m bench` runs it (a fresh process, torch's threads as a run's):
    positive rates, the threads it ran on named."""
    from bench import peaks

    assert 0 < peaks.matmul_tflops(256, warmup=1, iters=2, device="cpu") < 100  # TFLOP/s: a CPU's, not a GPU's
    assert 0 < peaks.copy_tb_per_s(2**-6, warmup=1, iters=2, device="cpu") < 10
    out = subprocess.run(
        [sys.executable, "-m", "bench.peaks", "--cpu"], cwd=ROOT, capture_output=True, text=True, check=True
    )
    measured = json.loads(out.stdout.splitlines()[-1])
    assert measured["cpu_threads"] >= 1 and measured["spec_tflops"] is None
    assert measured["matmul_tflops"] > 0 and measured["copy_tb_s"] > 0


def test_liger_is_a_gpu_contender(tiny, tmp_path, capsys):
    import bench.__main__ as bench_main

    with pytest.raises(SystemExit):
        bench_main.main(["--contenders", "trl+liger", "--assets", str(tiny), "--out", str(tmp_path / "r.md")])
    assert "need a GPU" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        bench_main.main(["--contenders", "trl,vllm", "--assets", str(tiny), "--out", str(tmp_path / "r.md")])
    assert "unknown contender(s) vllm" in capsys.readouterr().err


def test_a_run_cut_short_keeps_the_cases_it_finished(tiny, tmp_path, monkeypatch):
    """A device call ends at its time limit: the report is written after every case, so the finished ones stay.
    `--cases` picks cases by key."""
    import bench.__main__ as bench_main

    def fake(impl, key, model, steps, assets, *_):
        if key.startswith("dpo/"):
            raise RuntimeError("cut short")
        return {"samples_per_s": 5.0, "peak_mb": 1.0, "loss": 0.1}

    monkeypatch.setattr(bench_main, "measure", fake)
    monkeypatch.setattr(bench_main, "physics", lambda *a: Physics(None, None, None))
    out = tmp_path / "report.md"
    common = ["--assets", str(tiny), "--out", str(out), "--repeats", "1"]
    with pytest.raises(RuntimeError, match="cut short"):
        bench_main.main(["--cases", "sft/8x64,reward/8x64,dpo/8x64", *common])
    rows = [line.split("|")[1].strip() for line in out.read_text().splitlines() if line.startswith("| ")]
    assert rows == ["trainer", "sft", "reward"]
    with pytest.raises(SystemExit):
        bench_main.main(["--cases", "sft/8x2048", *common])  # a users' shape, not in the CPU's latency suite


def recorded_runs(monkeypatch) -> dict:
    """`python -m bench`'s run processes replaced by a stand-in that keeps each implementation's environment (the
    returned dict, by implementation) and reports one tiny figure; no physics."""
    import bench.__main__ as bench_main

    envs = {}

    def run(cmd, env, **_):
        envs[cmd[3]] = env
        return subprocess.CompletedProcess(cmd, 0, '{"samples_per_s": 1.0, "peak_mb": 1.0, "loss": 0.1}', "")

    monkeypatch.setattr(bench_main.subprocess, "run", run)
    monkeypatch.setattr(bench_main, "physics", lambda *a: Physics(None, None, None))
    return envs


def _elementwise_kernels(cfg) -> str:
    from alignpipe import fused_kernels

    return fused_kernels.ELEMENTWISE


@pytest.mark.parametrize(
    "flag, env, suffix, seen_by_a_stage, values",
    [
        # torch's AdamW rounding, as TRL's side runs: what the Kahan-compensated default costs a step
        ("--nearest-updates", "ALIGNPIPE_BENCH_NEAREST", "+nearest", lambda cfg: cfg.low_precision_updates,
         ["kahan", "nearest"]),
        # inductor's kernels for the SwiGLU, rotary and AdamW work: what the hand-written Triton ones buy
        ("--compiled-kernels", "ALIGNPIPE_BENCH_COMPILED_KERNELS", "+compiled-kernels", _elementwise_kernels,
         ["triton", "compiled"]),
    ],
)  # fmt: skip
def test_a_switch_of_our_side_reaches_our_run_only_and_names_its_rows(
    tiny, tmp_path, monkeypatch, flag, env, suffix, seen_by_a_stage, values
):
    """`--nearest-updates`, `--compiled-kernels`: the switch reaches our run only (its environment variable), its
    rows name the model with its suffix, and our stage runs with it on and without it off."""
    import bench.__main__ as bench_main
    from alignpipe import fused_kernels
    from alignpipe.trainers import sft
    from bench.run_one import case

    envs = recorded_runs(monkeypatch)
    out = tmp_path / "report.md"
    bench_main.main(["--assets", str(tiny), "--out", str(out), "--repeats", "1", "--trainers", "sft", flag])
    assert envs["ours"][env] == "1" and env not in envs["trl"]
    assert f"| sft | tiny{suffix} |" in out.read_text()

    seen = []

    def train(cfg, *args, **kwargs):
        seen.append(seen_by_a_stage(cfg))
        raise InterruptedError("the setting is all this test needs")

    monkeypatch.setattr(sft, "train", train)
    monkeypatch.setattr(fused_kernels, "ELEMENTWISE", "triton")  # `case` sets it for the process it runs in
    for on in (False, True):
        monkeypatch.setenv(env, "1" if on else "0")
        with pytest.raises(InterruptedError):
            case("ours", "sft/8x64", "tiny", 1, str(tiny))
    assert seen == values


def test_log_every_reaches_every_side_and_the_offline_gpu_shapes_and_names_its_rows(tiny, tmp_path, monkeypatch):
    """`--log-every 1`: the offline trainers' logging on a GPU, for every side (the A/B of session 44's clock against
    the log per step every earlier GPU row ran with); online trainers keep their log per step, CPU shapes their one
    log; the rows name it."""
    import bench.__main__ as bench_main
    from bench.cases import LOG_EVERY_ENV

    envs = recorded_runs(monkeypatch)
    out = tmp_path / "report.md"
    bench_main.main(
        ["--assets", str(tiny), "--out", str(out), "--repeats", "1", "--trainers", "dpo", "--log-every", "1"]
    )
    assert envs["ours"][LOG_EVERY_ENV] == envs["trl"][LOG_EVERY_ENV] == "1"
    assert "| dpo | tiny+log-every-1 |" in out.read_text()
    monkeypatch.setenv(LOG_EVERY_ENV, "1")
    assert find_case("qwen0.5b", "dpo/8x1024").shape.log_every == 1
    assert find_case("qwen0.5b", "ppo/64x256").shape.log_every == 1
    assert find_case("tiny", "dpo/8x64").shape.log_every == 0
    monkeypatch.delenv(LOG_EVERY_ENV)
    assert find_case("qwen0.5b", "dpo/8x1024").shape.log_every == 10


def test_an_attention_kernel_and_compile_name_their_rows(tiny, tmp_path, monkeypatch):
    """`--attention flex_attention` (on a GPU): every side's model runs that kernel (`bench.run_one` reads the
    environment `measure` gives it); `--compile`: our side compiled. Their rows name it beside the model, apart from
    the plain rows when merged."""
    import bench.__main__ as bench_main
    from bench.run_one import ATTENTION_ENV, COMPILE_ENV, UNFUSED_ENV, model_for

    real_measure = bench_main.measure
    monkeypatch.delenv(COMPILE_ENV, raising=False)
    monkeypatch.delenv(UNFUSED_ENV, raising=False)
    seen = []
    monkeypatch.setattr(
        bench_main,
        "measure",
        lambda *a: seen.append((a[0], a[5], "compile" in a[6])) or {"samples_per_s": 1.0, "peak_mb": 1.0, "loss": 0.1},
    )
    monkeypatch.setattr(bench_main, "physics", lambda *a: Physics(None, None, None))
    out = tmp_path / "report.md"
    common = ["--assets", str(tiny), "--out", str(out), "--repeats", "1", "--warmup", "0", "--trainers", "sft"]
    bench_main.main(common)
    bench_main.main([*common, "--attention", "eager", "--merge"])
    bench_main.main([*common, "--compile", "--merge"])
    rows = [line for line in out.read_text().splitlines() if line.startswith("| sft")]
    assert [r.split("|")[2].strip() for r in rows] == ["tiny", "tiny/eager", "tiny+compile"]
    bench_main.main([*common[:-1], "dpo", "--unfused"])
    assert "| dpo | tiny+unfused |" in out.read_text()
    seen.pop(), seen.pop()
    assert [(impl, attention, compile) for impl, attention, compile in seen] == [
        ("ours", None, False),
        ("trl", None, False),
        ("ours", "eager", False),
        ("trl", "eager", False),
        ("ours", None, True),
        ("trl", None, True),
    ]
    monkeypatch.setenv(ATTENTION_ENV, "eager")
    model, _ = model_for("tiny", str(tiny), "sft")
    assert model.config._attn_implementation == "eager"

    envs = {}

    def run(cmd, env, **_):
        envs[cmd[3]] = env
        return subprocess.CompletedProcess(cmd, 0, '{"samples_per_s": 1.0}', "")

    monkeypatch.setattr(bench_main.subprocess, "run", run)
    for impl in ("ours", "trl"):
        real_measure(impl, "sft/8x64", "tiny", 2, tiny, "flex_attention", ("compile", "unfused"))
    assert envs["ours"][COMPILE_ENV] == "1" and COMPILE_ENV not in envs["trl"], "compile is our side's switch only"
    assert envs["ours"][UNFUSED_ENV] == "1" and UNFUSED_ENV not in envs["trl"], "so is the unfused DPO head"
    assert envs["ours"][ATTENTION_ENV] == envs["trl"][ATTENTION_ENV] == "flex_attention"
    with pytest.raises(ValueError, match="unknown variants"):
        real_measure("ours", "sft/8x64", "tiny", 2, tiny, None, ("compiled",))


def test_fewer_warm_up_steps_reach_the_runs_and_their_rows_say_so(tiny, tmp_path, monkeypatch):
    """`--skip-steps N` (long PPO steps): every run's steady rate leaves out N steps (`bench.run_one` reads it from
    the environment at import), and the rows' `runs × steps` names it."""
    import bench.__main__ as bench_main
    from bench.run_one import SKIP_STEPS_ENV

    envs = recorded_runs(monkeypatch)
    out = tmp_path / "report.md"
    args = ["--assets", str(tiny), "--out", str(out), "--repeats", "1", "--warmup", "0", "--trainers", "sft"]
    bench_main.main([*args, "--skip-steps", "2", "--steps", "4"])
    assert envs["ours"][SKIP_STEPS_ENV] == envs["trl"][SKIP_STEPS_ENV] == "2"
    assert "| 1 × 4 (steady after 2) |" in out.read_text()
    bench_main.main(args)
    assert SKIP_STEPS_ENV not in envs["ours"] and "| 1 × 20 |" in out.read_text()
    monkeypatch.undo()  # `subprocess.run` itself was patched
    probe = "import bench.run_one as r; print(r.WARMUP_STEPS)"
    got = subprocess.run(
        [sys.executable, "-c", probe], env={**os.environ, SKIP_STEPS_ENV: "2"}, capture_output=True, text=True
    )
    assert got.stdout.strip() == "2", got.stderr


def test_the_decode_overhead_probe_times_each_loop(capsys):
    """`python -m bench.decode_overhead`: each decode loop's milliseconds per new token on the 24-layer probe."""
    from bench.decode_overhead import main

    main(["--new-tokens", "4", "--no-compile"])
    lines = capsys.readouterr().out.splitlines()
    assert [line.split(" ms")[0].strip() for line in lines] == ["eager, growing KV cache", "eager, static KV cache"]
    assert all(float(line.split("then ")[1].split("–")[0]) > 0 for line in lines)


def test_the_decode_kernel_count_sees_the_cache_s_and_the_mask_s_kernels_per_layer(capsys):
    """`python -m bench.decode_kernels`: a decode layer on transformers' cache and a boolean mask runs 5 kernels more
    than on the loop's own: the write positions (an arange, an add, an in-place add) and SDPA's conversion of the
    mask (a fill and a `where`); with its sibling projections merged, 3 fewer again (7 matmuls → 4)."""
    from bench import decode_kernels

    theirs, ours = ([len(decode_kernels.kernels(n, mine, 4, 8)) for n in (2, 3)] for mine in (False, True))
    merged = [len(decode_kernels.kernels(n, True, 4, 8, merged=True)) for n in (2, 3)]
    assert theirs[1] - theirs[0] == ours[1] - ours[0] + 5 == merged[1] - merged[0] + 8
    assert "aten::where" in decode_kernels.kernels(2, False, 4, 8)
    decode_kernels.main(["--rows", "4", "--width", "8"])
    rows = capsys.readouterr().out.splitlines()[2:]
    assert [row.split(" | ")[1] for row in rows] == [str(b - a) for a, b in (theirs, ours, merged)]


def test_the_gpu_checks_run_their_cpu_branches_and_pass(capsys):
    """`python -m bench.gpu_checks`, the first call of a GPU session, runs on CPU too (float32, small sizes): varlen
    attention against SDPA's mask with every layer taking the flattened path, padding-free DPO rows against padded
    ones, the compiled SwiGLU product (with its down projection) and rotary embedding against eager's, the fused
    heads and the RL trainers' head eager and compiled against autograd, PPO's full KL against float64's; the
    CUDA-only checks say they were skipped (the decode step's kernel
    count runs its steps, counting operators instead). So the script a GPU session depends on cannot rot."""
    from bench import gpu_checks

    gpu_checks.RESULTS.clear()
    assert gpu_checks.main(["--cpu"]) == 0
    out = capsys.readouterr().out
    # varlen, padding-free DPO, (norm: CUDA), SwiGLU, rotary, the SFT, DPO and RL heads, (loss watch), offloading,
    # (AdamW), the full KL, then the CUDA-only lines
    want = [True, True, None, True, True, True, True, True, None, True, None, True] + [None] * 7
    assert [ok for _, ok, _ in gpu_checks.RESULTS] == want
    assert "'documents': 4, 'flash': 0" in out and out.count("\nPASS ") == 9 and out.count("\nskip ") == 10
    kernels = gpu_checks.RESULTS[-1][2]  # the decode step's count runs its steps on CPU, operators counted
    assert "operators counted on CPU instead" in kernels and " a layer), policy " in kernels, kernels


def test_the_rollout_line_times_the_engine_s_own_token_choice():
    """The rollout-speed line's sampling share times the hf engine's `next_token` itself (sampled and greedy), so the
    figure a GPU session reads is the step the graph leaves out."""
    from alignpipe.engine.sampling import SamplingParams
    from bench.gpu_checks import Setup, _sampling_ms

    setup = Setup(force_cpu=True)
    for sampling in (SamplingParams(temperature=0.7, top_p=0.9), SamplingParams(temperature=0)):
        assert 0 < _sampling_ms(setup, 8, 512, sampling) < 1e3


def test_the_rollout_line_times_a_recording_s_replay_alone(tiny):
    """The rollout-speed line's "replay alone" replays the last rollout's recording with its static cache emptied
    first: more replays than the cache has positions left still write inside it (on CPU, the recording's stand-in
    replays the step; a write past the cache's end raises). Without a recording it says why, and the line stands."""
    import torch
    from support import replayed_on_cpu

    from alignpipe.engine.decode_steps import GraphedDecodeStep
    from alignpipe.engine.hf import decode_static
    from alignpipe.engine.sampling import SamplingParams
    from alignpipe.modeling import load_causal_lm
    from bench.gpu_checks import _replay_ms

    model = load_causal_lm(str(tiny / "model")).eval()
    step = GraphedDecodeStep(capture=replayed_on_cpu)
    ids = torch.randint(3, 100, (2, 4), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        decode_static(model, ids, torch.ones_like(ids), SamplingParams(temperature=0, max_new_tokens=6), None, 0,
                      step=step)  # fmt: skip
        (cache,) = step.caches.values()
        ms = _replay_ms(step, cuda=False, replays=cache.get_max_length() - 1)
        assert isinstance(ms, float) and 0 < ms < 1e3
    step.release()
    assert str(_replay_ms(step, cuda=False)).startswith("not measured (ValueError")


def test_the_gpu_session_script_names_real_cases_and_fits_each_call(tmp_path):
    """`bench/gpu_session.sh`: every stage's cases exist in the GPU suite, its steps' time limits add up to less
    than one device call (600 s, with room for the install), and an unknown stage is refused."""
    import re
    import shlex

    script = Path(__file__).parents[1] / "bench" / "gpu_session.sh"
    text = script.read_text()
    stages = dict(re.findall(r"^(\w)\)\n(.*?)\n  ;;", text, flags=re.S | re.M))
    assert sorted(stages) == list("12345abcdefghijklmno")
    limit = r'(?:bench|timeout) "?(?:\$\{\w+:-)?(\d+)'  # a number, or a variable's default (B_LIMIT)
    known = {c.key for c in cases("qwen0.5b", "user", ["sft", "reward", "dpo", "grpo", "ppo"])}

    def limits_of(body: str) -> list[int]:
        found = [int(n) for n in re.findall(limit, body)]
        for items, loop in re.findall(r"for \w+ in ([^;]+); do\n(.*?)\n\s*done", body, flags=re.S):
            # a step inside a loop runs once per item
            found += [int(n) * (len(items.split()) - 1) for n in re.findall(limit, loop)]
        return found

    functions = {
        name: limits_of(body) for name, body in re.findall(r"^(\w+)\(\) \{[^\n]*\n(.*?)\n\}", text, re.S | re.M)
    }
    assert sum(functions["dpo_profiles"]) == 240  # three profiles of 80 s
    for stage, body in stages.items():
        limits = limits_of(body)
        for called in re.findall(r"^\s*(\w+)$", body, flags=re.M):  # a function of the script, called bare
            limits += functions.get(called, [])
        assert limits and sum(limits) <= 570, (stage, limits)
        for line in re.findall(r'^\s*bench "?(?:\$\{\w+:-)?\d+\}?"? (.*)$', body, flags=re.M):
            args = shlex.split(line)
            assert set(args[args.index("--cases") + 1].split(",")) <= known, line
    out = subprocess.run(["bash", str(script), "9"], capture_output=True, text=True, cwd=tmp_path)
    assert out.returncode == 2 and "no stage 9" in out.stderr


def test_every_gpu_session_call_parses_and_plans_its_runs(tmp_path, capsys):
    """Each stage's `python -m bench` steps, with the script's own leading arguments, pass the bench's checks (flags,
    cases, contenders, Liger installed) and plan their rounds under `--dry-run`, who goes first rotating; each
    gpu_checks step names checks that exist. A flag renamed in the bench, or a check renamed in gpu_checks, would
    otherwise fail its step at the lease, after the machine's start."""
    import re
    import shlex

    from bench import gpu_checks
    from bench.__main__ import main

    text = (Path(__file__).parents[1] / "bench" / "gpu_session.sh").read_text()
    fixed = shlex.split(known(re.search(r'python3 -m bench (--models .*?) "\$@"', text)).group(1))
    assert fixed == ["--models", "qwen0.5b", "--merge", "--warmup", "0"]
    checks = {make.__name__.removeprefix("check_") for make in gpu_checks.CHECKS}
    stages = dict(re.findall(r"^(\w)\)\n(.*?)\n  ;;", text, flags=re.S | re.M))
    planned = 0
    for stage, body in stages.items():
        for names in re.findall(r"python3 -m bench\.gpu_checks[^\n]*?--(?:only|skip) ([\w,]+)", body):
            assert set(names.split(",")) <= checks, (stage, names)
        for line in re.findall(r'^\s*bench "?(?:\$\{\w+:-)?\d+\}?"? (.*)$', body, flags=re.M):
            args = shlex.split(line.replace('"$out', f'"{tmp_path}'))
            main([*fixed, *args, "--dry-run"])
            runs = [" ".join(r.split()[i] for i in (0, 2, 4)) for r in capsys.readouterr().out.splitlines()]
            contenders = args[args.index("--contenders") + 1] if "--contenders" in args else "trl,trl+liger"
            want = []
            for key in args[args.index("--cases") + 1].split(","):
                sides = ["ours"] + [
                    c for c in contenders.split(",") if not (key.startswith("ppo/") and c == "trl+liger")
                ]
                for rep in range(3):  # no warm-up run (`--warmup 0`); the first run of a round rotates
                    want += [f"{key} {side} {rep}" for side in sides[rep % len(sides) :] + sides[: rep % len(sides)]]
            assert runs == want, (stage, line)
            planned += 1
    assert planned == len(re.findall(r"^\s+bench ", text, flags=re.M)) > 20  # every bench step was read
    assert not list(tmp_path.iterdir())  # a dry run writes nothing


def test_a_warning_is_traced_to_the_caller_outside_torch_and_the_warnings_module():
    """gpu_checks' sync check names whose call a synchronising operator came from, not torch's or warnings' line."""
    import warnings

    from bench.gpu_checks import sync_recorder

    seen: list = []
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = sync_recorder(seen)
        warnings.warn("called a synchronizing CUDA operation", stacklevel=1)
        line = sys._getframe().f_lineno - 1
        warnings.warn("something else", stacklevel=1)
    assert seen == [(f"test_bench_report.py:{line}", f"{__file__}:{line}")]


def test_the_activation_count_separates_layers_tokens_and_the_heads_gradient(capsys):
    """`python -m bench.activation_memory` (small widths here): the bytes each variant keeps split into per token per
    layer, per token outside the layers and fixed. transformers' own loss keeps the float32 logits (4 bytes per
    vocabulary entry per token) and our fused loss none, holding the head's gradient instead (vocabulary × hidden in
    bf16, fixed); `lean_activations` keeps less per layer, and the fused kernels less again (the MLP's product); the
    projection is their sum at the asked shape."""
    import json

    from bench import activation_memory

    assert activation_memory.main(["--tiny", "--tokens", "1000", "--layers", "3"]) == 0
    rows = {r["variant"]: r for r in json.loads(capsys.readouterr().out.strip().splitlines()[-1])}
    plain, eager, fused = (rows[v] for v in activation_memory.VARIANTS)
    vocab, hidden = 512, 64
    assert plain["outside_per_token"] >= 4 * vocab > eager["outside_per_token"]
    assert eager["fixed"] == pytest.approx(2 * vocab * hidden, rel=0.01) and plain["fixed"] < 100
    assert eager["layer_per_token"] < plain["layer_per_token"]
    # the CUDA norm's float32 scale per row kept; `silu_mul_down`'s product (128 intermediate values in bf16) not
    assert fused["layer_per_token"] == eager["layer_per_token"] + 8 - 2 * 128
    for r in rows.values():
        want = (3 * r["layer_per_token"] + r["outside_per_token"]) * 1000 + r["fixed"]
        assert r["projected_gb"] == pytest.approx(want / 1e9, rel=1e-3)


def test_trl_with_liger_runs_a_reward_model_without_the_fused_lm_head():
    """The `trl+liger` contender's arguments, as TRL's configs take them: every Liger kernel for the causal LMs, and
    for a reward model (a sequence classifier, which has no LM head for Liger's fused cross-entropy forward to
    call) the layer kernels only."""
    import trl

    from bench.run_one import liger_args

    reward = trl.RewardConfig(output_dir=tempfile.mkdtemp(), use_cpu=True, report_to="none", **liger_args("reward"))
    assert reward.use_liger_kernel
    assert reward.liger_kernel_config == {"fused_linear_cross_entropy": False, "cross_entropy": False}
    for task, config in (("dpo", trl.DPOConfig), ("sft", trl.SFTConfig)):
        args = config(output_dir=tempfile.mkdtemp(), use_cpu=True, report_to="none", **liger_args(task))
        assert args.use_liger_kernel and not args.liger_kernel_config


def test_device_busy_is_kernel_time_a_step_over_a_steady_steps_wall_time():
    """`bench.profile`'s host-bound figure: 10 steps with 1.5 s of kernels, 8 samples a step at 40 samples/s (0.2 s a
    step): the device is busy 75% of a step. No steady rate (a CPU run), no figure."""
    from bench.profile import device_busy

    assert device_busy(1500.0, 10, 8, 40.0) == pytest.approx(0.75, abs=1e-12)
    assert device_busy(1500.0, 10, 8, None) is None and device_busy(1500.0, 0, 8, 40.0) is None


def test_host_work_runs_a_step_with_the_gpu_s_hand_written_paths_and_counts_its_work(tiny):
    """`python -m bench.host_work` runs our DPO step on CPU with the paths a CUDA device takes: every hand-written
    kernel's launch reached (a no-op there) in the counted steps, at the rate a 2-layer model makes them, and the
    step's Python calls and top-level operators counted."""
    out = subprocess.run(
        [sys.executable, "-m", "bench.host_work", "dpo", "--layers", "2", "--rows", "2", "--warmup", "1"]
        + ["--steps", "1", "--assets", str(tiny), "--json"],
        capture_output=True,
        text=True,
        cwd=Path(__file__).resolve().parents[1],
    )
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert len(got["step_ms"]) == 1 and got["median_ms"] > 0
    # per layer: the policy's and the reference's forward and the policy's backward; two parameter groups
    assert got["launches"]["rotary"] == 3 * 2 and got["launches"]["kahan_adamw"] == 2, got["launches"]
    assert got["launches"]["silu_mul_forward"] >= 2 * 2 and got["launches"]["token_scores"] >= 1
    assert got["python_calls"] > 1000 and got["aten_ops"] > 100
    ops = dict(got["ops_by_count"])
    assert ops["aten::linear"] == 2 * 7 * 2 + 2, ops  # 7 projections a layer in each of two forwards, a head each
    assert "aten::zero_" not in ops, "the stand-ins' own operators are left out of the counts"


def test_host_work_runs_every_trainer_it_names(tiny):
    """SFT, reward and KTO steps too (DPO's above): each reaches the hand-written kernels. Until session 57 the reward
    stand-in's pairs were longer than its `max_length`, every one was dropped, and the tool failed on an empty split."""
    runs = {
        trainer: subprocess.Popen(
            [sys.executable, "-m", "bench.host_work", trainer, "--layers", "2", "--rows", "2", "--warmup", "1"]
            + ["--steps", "1", "--assets", str(tiny), "--json"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=Path(__file__).resolve().parents[1],
        )
        for trainer in ("sft", "reward", "kto")
    }
    for trainer, proc in runs.items():
        out, err = proc.communicate(timeout=600)
        assert proc.returncode == 0, (trainer, err[-3000:])
        got = json.loads(out.strip().splitlines()[-1])
        assert got["trainer"] == trainer and len(got["step_ms"]) == 1
        # the reward model's last layer runs at the scored tokens alone (`last_layer`), its rotary in torch
        rotary = 2 if trainer == "reward" else 2 * 2
        assert got["launches"]["rotary"] >= rotary and got["launches"]["kahan_adamw"] == 2, (trainer, got["launches"])


def test_host_work_can_run_the_lm_head_in_as_many_pieces_as_at_the_users_dpo_shape(tiny):
    """With `--users-head` the stand-in's DPO head runs as DPO 8×1024's does over Qwen2-0.5B's vocabulary: a fused group
    a pair (its gradients formed in the forward: one `token_grads` launch each) and the reference's log-probs in
    chunks of a few positions (~27 at the users' shape), where the stand-in's 512-token vocabulary ran it whole."""
    out = subprocess.run(
        [sys.executable, "-m", "bench.host_work", "dpo", "--layers", "2", "--rows", "2", "--tokens", "64"]
        + ["--warmup", "1", "--steps", "1", "--users-head", "--assets", str(tiny), "--json"],
        capture_output=True,
        text=True,
        cwd=Path(__file__).resolve().parents[1],
    )
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert "the users' head" in got["shape"]
    assert got["launches"]["token_grads"] == 2, got["launches"]  # a group a pair
    assert 20 <= got["launches"]["token_scores"] - 2 <= 40, got["launches"]  # the reference's chunks


def test_host_work_runs_trl_s_step_on_its_gpu_paths_with_liger_s_kernels_launched(tiny):
    """`--side trl+liger` runs TRL's DPO step on the same stand-in: Liger's RMSNorm, rotary and SwiGLU launches at the
    rates a 2-layer model makes them (the reference keeps transformers' norms and MLP), TRL's head folded by its
    Triton kernels as on CUDA (the policy's and the reference's forward, the policy's backward), all no-ops, and the
    step's work counted. `--side trl` launches TRL's head kernels alone, and issues more operators: transformers'
    norms, rotary and MLP."""
    pytest.importorskip("liger_kernel", reason="liger-kernel is in the test extra on Linux x86-64 only")
    runs = {
        side: subprocess.Popen(
            [sys.executable, "-m", "bench.host_work", "dpo", "--side", side, "--layers", "2", "--rows", "2"]
            + ["--warmup", "1", "--steps", "1", "--assets", str(tiny), "--json"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=Path(__file__).resolve().parents[1],
        )
        for side in ("trl", "trl+liger")
    }
    got = {}
    for side, proc in runs.items():
        out, err = proc.communicate(timeout=600)
        assert proc.returncode == 0, (side, err[-3000:])
        got[side] = json.loads(out.strip().splitlines()[-1])
        assert got[side]["side"] == side and len(got[side]["step_ms"]) == 1
    head = {"chunked_logprob._forward_kernel": 2, "chunked_logprob._backward_kernel": 1}
    assert got["trl"]["launches"] == head, got["trl"]["launches"]
    liger = got["trl+liger"]["launches"]
    assert {k: liger[k] for k in head} == head, liger
    norms = 2 * 2 + 1  # two a layer and the final one, in the policy's forward only
    assert liger["rms_norm._rms_norm_forward_kernel"] == norms and liger["rms_norm._rms_norm_backward_kernel"] == norms
    # Liger swaps transformers' rotary function module-wide: the reference's forward runs it too
    assert liger["rope._triton_rope"] == 3 * 2, liger
    assert liger["swiglu._swiglu_forward_kernel"] == 2 and liger["swiglu._swiglu_backward_kernel"] == 2, liger
    assert got["trl+liger"]["aten_ops"] < got["trl"]["aten_ops"]
    assert dict(got["trl"]["ops_by_count"]).get("aten::pow", 0) > dict(got["trl+liger"]["ops_by_count"]).get(
        "aten::pow", 0
    ), "transformers' RMSNorm runs in plain TRL's policy and in both sides' reference"


def test_trl_s_head_is_cut_in_the_users_tiles_and_the_sides_compare_in_one_table():
    """`--users-head` on a TRL side: TRL's head tiles the users' DPO step (8 pairs of two 720-token answers: 11,520
    scored tokens) in 3 × 5 tiles of 4,096 tokens × 32,768 entries of Qwen2-0.5B's 151,936; the stand-in's tile gives
    its 8 pairs × 8 scored tokens a side over 512 entries as many. `--compare`'s table gives each side's figures and
    their ratios to ours."""
    from bench.host_work import comparison_table, trl_head_tiles

    tokens, entries = trl_head_tiles("dpo", 8, 16, 512)
    assert (math.ceil(8 * 2 * 8 / tokens), math.ceil(512 / entries)) == (3, 5)
    tokens, entries = trl_head_tiles("sft", 8, 16, 512)  # 8 packed blocks of 2048: 16,384 tokens in 4 × 5
    assert (math.ceil(8 * 2 * 16 / tokens), math.ceil(512 / entries)) == (4, 5)
    runs = [
        {"trainer": "dpo", "side": side, "shape": "24 layers × 64 wide, 8 rows × 16 tokens", "python_calls": calls,
         "aten_ops": ops, "launches": {"a": 100, "b": n}, "median_ms": ms}
        for side, calls, ops, n, ms in (("ours", 1000, 500, 47, 100.0), ("trl+liger", 2000, 750, 121, 80.0))
    ]  # fmt: skip
    table = comparison_table(runs)
    assert "| ours | 1,000 | 500 | 147 | 100.0 |" in table, table
    assert "| trl+liger | 2,000 (2.00× ours) | 750 (1.50× ours) | 221 | 80.0 (0.80× ours) |" in table, table


def test_device_work_counts_each_side_s_products_of_a_users_dpo_step(tiny):
    """`python -m bench.device_work` counts the matrix products of a DPO step (the users' case, shrunk, on the 64-wide
    stand-in): each side's decoder runs 6 · N a policy token and 2 · N a reference token, N the decoder's matrices
    scaled to 24 layers; ours embeds fewer tokens (each prompt once a pair, no padding); ours' fused head runs three
    products a scored token in the policy (no recomputation) and one in the reference, TRL's chunked head four (it
    recomputes each tile's logits in backward) and one. Attention's products as the GPU's kernels run them: TRL's
    padded rows through SDPA with a mask, every pair of each forward's square (seven products a pair where it trains,
    two in the reference's forward); ours' documents their causal pairs alone, fewer."""
    runs = {
        side: subprocess.Popen(
            [sys.executable, "-m", "bench.device_work", "dpo", "--side", side, "--shrink", "--layers", "2"]
            + ["--steps", "1", "--assets", str(tiny), "--json"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=Path(__file__).resolve().parents[1],
        )
        for side in ("ours", "trl")
    }
    got = {}
    for side, proc in runs.items():
        out, err = proc.communicate(timeout=600)
        assert proc.returncode == 0, (side, err[-3000:])
        got[side] = json.loads(out.strip().splitlines()[-1])
    per_layer = 2 * 64 * 64 + 2 * 64 * 32 + 3 * 64 * 128  # q, o; k, v (2 of 4 heads of 16); gate, up, down
    head_product = 2 * 512 * 64  # a token through the 512-entry head, 64 wide
    for side, products in (("ours", 3 + 1), ("trl", 4 + 1)):
        r = got[side]
        assert r["decoder"] == 4 * 24 * per_layer * r["tokens"], (side, r)  # (6 + 2) · N over half the tokens each
        scored = r["rest"] / head_product / products
        assert scored == int(scored) and scored > 0, (side, r)
        assert r["total"] == r["decoder"] + r["rest"] and r["model"] == got["ours"]["model"]
    assert got["ours"]["tokens"] < got["trl"]["tokens"]
    assert got["ours"]["total"] < got["ours"]["model"] < got["trl"]["total"]
    pair = 2 * 4 * 16  # a (query, key) pair a product: 4 query heads of 16
    trl = got["trl"]["forwards"]
    assert {trained for _, _, trained in trl} == {True, False}, trl  # the policy's forwards and the reference's
    assert got["trl"]["attention"] == 24 * sum((7 if t else 2) * pair * rows * n * n for rows, n, t in trl)
    ours = got["ours"]["forwards"]
    assert all(rows == 1 for rows, _, _ in ours), ours  # padding-free
    causal_whole = 24 * sum((7 if t else 2) * pair * n * (n + 1) // 2 for _, n, t in ours)  # one document a forward
    assert 0 < got["ours"]["attention"] < causal_whole and got["ours"]["attention"] < got["trl"]["attention"] / 2


def test_device_work_keeps_its_counts_by_case_and_side_for_the_profile_to_rate_kernels_by(tmp_path):
    from bench.device_work import save
    from bench.profile import counts_for, kernel_rates

    path = tmp_path / "counts.json"
    run = {"case": "dpo/8x1024", "decoder": 39e12, "rest": 13e12, "total": 52e12, "attention": 3e12, "tokens": 27000,
           "layers_run": 2, "by_operator": {"mm": 1.0}}  # fmt: skip
    save([run | {"side": "ours"}], path)
    save([run | {"side": "trl+liger", "total": 67e12}, run | {"side": "ours", "case": "reward/8x1024"}], path)
    assert (counts_for(path, "dpo/8x1024", "ours") or {})["total"] == 52e12  # kept beside what came after
    assert (counts_for(path, "dpo/8x1024", "trl+liger") or {})["total"] == 67e12
    assert counts_for(path, "reward/8x1024", "trl") is None and counts_for(tmp_path / "none", "x", "ours") is None
    assert "by_operator" not in (counts_for(path, "reward/8x1024", "ours") or {"by_operator": "missing"})
    kinds = {"matmul": {"ms": 1040.0}, "attention": {"ms": 150.0}, "norm": {"ms": 30.0}}
    rates = kernel_rates(kinds, 10, counts_for(path, "dpo/8x1024", "ours"))
    assert rates["matmul"] == {"ms_a_step": 104.0, "tflop_a_step": 52.0, "tflop_s": 500.0}
    assert abs(rates["attention"]["tflop_s"] - 200.0) < 1e-9 and kernel_rates(kinds, 10, None) == {}


def test_device_work_picks_a_users_shape_by_its_key():
    from bench.device_work import case_of

    assert case_of("sft").key == "sft/8x2048" and case_of("sft", "4x4096").key == "sft/4x4096"
    assert case_of("dpo", "8x1024").shape.batch == 8
    with pytest.raises(SystemExit, match="8x2048, 4x4096"):
        case_of("sft", "9x9")


def test_device_work_counts_attention_pairs_as_each_kernel_runs_them():
    from bench.device_work import attention_flops, causal_pairs, padded_pairs

    # a document of 3 attending to itself (1 + 2 + 3), then 2 queries over 4 keys aligned at the bottom right (3 + 4)
    assert causal_pairs([0, 3, 5], [0, 3, 7]) == 6 + 7
    assert causal_pairs([0, 1, 2], [0, 5, 7]) == 5 + 2  # one query a document (a reward model's read tokens)
    assert padded_pairs(2, 4, 4, masked=True) == 32 and padded_pairs(2, 4, 4, masked=False) == 20
    assert attention_flops(10, 14, 64, trained=False) == 2 * 2 * 14 * 64 * 10
    assert attention_flops(10, 14, 64, trained=True) == 7 * 2 * 14 * 64 * 10


def test_device_work_table_gives_each_side_against_the_formula_and_ours():
    from bench.device_work import table

    runs = [
        {"side": side, "case": "dpo/8x1024", "layers_run": 2, "decoder": dec * 1e12, "rest": rest * 1e12,
         "total": (dec + rest) * 1e12, "model": 40e12, "attention": att * 1e12, "tokens": tokens}
        for side, dec, rest, att, tokens in (("ours", 20.0, 10.0, 2.0, 27000), ("trl+liger", 26.0, 14.0, 8.0, 31500))
    ]  # fmt: skip
    text = table(runs)
    assert "the MFU formula's 40" in text, text
    assert "| ours | 20 | 10 | 30 | 0.75 | 1.00× | 2 | 32 | 1.00× | 27,000 |" in text, text
    assert "| trl+liger | 26 | 14 | 40 | 1.00 | 1.33× | 8 | 48 | 1.50× | 31,500 |" in text, text


def test_worker_batches_hands_a_dpo_batch_over_both_ways_and_times_the_receiving_side(tiny):
    """`python -m bench.worker_batches` collates the DPO user case's batch as a GPU stage does (padding-free, shared
    prompts: 13 tensors) and times its handover from a loader worker as separate tensors and in one buffer."""
    out = subprocess.run(
        [sys.executable, "-m", "bench.worker_batches", "--batches", "3", "--rounds", "1", "--assets", str(tiny)]
        + ["--json"],
        capture_output=True,
        text=True,
        cwd=Path(__file__).resolve().parents[1],
    )
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["case"] == "dpo/8x1024" and got["tensors"] == 13 and got["bytes"] > 100_000
    assert all(len(ms) == 1 and ms[0] > 0 for ms in got["median_ms"].values())


def test_the_liger_preflight_runs_each_users_case_shrunk_with_its_flags_and_judges_a_pair_of_runs():
    """`bench.liger_cpu` (run whole by `make test-slow`): the users' case of each trainer with a Liger contender, its
    tokens cut and its flags kept, named by the users' key; a pair of runs fails where either failed, Liger launched
    nothing, or an offline loss differs from plain TRL's."""
    from bench.liger_cpu import SHRINK, users_cases, verdict

    by = {c.trainer: c for c in users_cases(["sft", "reward", "dpo", "grpo"])}
    users: dict = {}
    for c in cases("qwen0.5b", "user", ["sft", "reward", "dpo", "grpo"]):
        users.setdefault(c.trainer, c)  # SFT's first: 8×2048
    assert (
        {t: c.key for t, c in by.items()}
        == {t: users[t].key for t in by}
        == {
            "sft": "sft/8x2048",
            "reward": "reward/8x1024",
            "dpo": "dpo/8x1024",
            "grpo": "grpo/8x8x256",
        }
    )
    assert by["sft"].shape.packed and by["sft"].shape.max_len == 2048 // (SHRINK // 2)
    grpo, users_grpo = by["grpo"].shape, users["grpo"].shape
    assert (grpo.batch, grpo.accumulation, grpo.generations) == (users_grpo.batch, users_grpo.accumulation, 8)
    assert grpo.completion == 256 // SHRINK and by["dpo"].shape.completion_tokens == 720 // SHRINK

    ran = {"loss": 0.5, "liger_kernels": {"rms_norm._rms_norm_forward_kernel": 9}}
    assert verdict("dpo", ran, ran) is None
    assert "failed" in str(verdict("dpo", ran, {"error": "AttributeError: no lm_head"}))
    assert "no Liger kernel" in str(verdict("dpo", ran, {**ran, "liger_kernels": {}}))
    assert "not plain TRL's" in str(verdict("dpo", ran, {**ran, "loss": 0.6}))
    assert verdict("grpo", ran, {**ran, "loss": 0.6}) is None, "sampled completions: GRPO's losses are not compared"
    assert "nan" in str(verdict("sft", ran, {**ran, "loss": float("nan")}))
