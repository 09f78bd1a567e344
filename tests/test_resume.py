"""A stage killed with SIGKILL mid-training resumes from its last checkpoint on the next run: the step
counter continues, and its MLflow child run is continued, not duplicated."""

from __future__ import annotations

import subprocess

from mlflow.tracking import MlflowClient
from support import experiment_id

from alignpipe.launch import launch, stage_command
from alignpipe.plan import plan, write_spec
from alignpipe.recipe import parse_recipe


def test_sigkilled_sft_resumes_and_continues_its_mlflow_run(tiny, tmp_path):
    from support import demo_recipe, kill_at_checkpoint, sft_spec_after_format

    recipe = parse_recipe(
        demo_recipe(tiny, tmp_path / "runs"),
        [
            "stages.sft.max_steps=60",
            "stages.sft.save_every=10",
            "stages.sft.logging_every=5",
            "stages.sft.eval_every=null",
        ],
    )
    plans, spec, tracking = sft_spec_after_format(recipe)
    kill_at_checkpoint(stage_command(spec), plans["sft"].dir / "checkpoints" / "step-20", timeout_s=180)
    assert not (plans["sft"].dir / "manifest.json").exists()

    manifest = launch(spec, on_line=lambda line: None)
    assert manifest.info["resumed_from"] >= 20 and manifest.metrics["steps"] == 60

    client = MlflowClient(recipe.tracking_uri)
    runs = client.search_runs(
        [experiment_id(client, recipe.experiment_name)],
        f"tags.`alignpipe.stage_id` = 'sft' and tags.mlflow.parentRunId = '{tracking[2]}'",
    )
    assert len(runs) == 1 and runs[0].info.run_id == manifest.mlflow_run_id
    assert runs[0].info.status == "FINISHED" and runs[0].data.tags["alignpipe.resumed"] == "true"
    steps = [m.step for m in client.get_metric_history(runs[0].info.run_id, "train/loss")]
    assert min(steps) == 5 and max(steps) == 60, steps


def test_forcing_a_finished_stage_starts_it_afresh(tiny, tmp_path):
    """`--force sft` on a finished SFT must train again, not "resume" from its final checkpoint."""
    from support import demo_recipe

    from alignpipe.manifest import Manifest

    recipe = parse_recipe(demo_recipe(tiny, tmp_path / "runs"))
    done = plan(recipe)["sft"]
    (done.dir / "checkpoints" / "step-150").mkdir(parents=True)
    (done.dir / "checkpoints" / "step-150" / "state.json").write_text('{"step": 150}')
    Manifest(stage_id="sft", kind="sft", cache_key=done.key).write(done.dir)
    assert plan(recipe)["sft"].cached and not plan(recipe, ["sft"])["sft"].cached
    forced = plan(recipe, ["sft"])["sft"]
    assert forced.fresh
    write_spec(recipe, forced, {}, ("sqlite:///x.db", "0", None), "run-2")
    assert not (forced.dir / "checkpoints").exists() and Manifest.read(forced.dir) is None


def test_a_stage_process_leaving_early_still_runs_exit_handlers_and_flushes_its_output():
    """`alignpipe.stage` skips the interpreter's slow teardown (`exit_now`): exit handlers still run, buffered
    output still arrives, and the exit code is kept."""
    import sys

    code = (
        "import atexit, sys\nfrom alignpipe.stage import exit_now\natexit.register(lambda: print('handler ran'))\n"
        "print('buffered line', end='')\nsys.stderr.write('to stderr')\nexit_now(3)\nprint('never')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 3
    assert out.stdout == "buffered linehandler ran\n" and out.stderr == "to stderr"


def test_system_metrics_that_cannot_start_leave_the_stage_running(tmp_path, monkeypatch, caplog):
    """The machine's monitor is extra: one that fails to start says so in the log and the stage goes on without it;
    off (null) or without an MLflow run (a rank other than 0) none is started."""
    import mlflow.system_metrics.system_metrics_monitor as monitors

    from alignpipe import stage
    from alignpipe.tracking import MlflowTracker, Tracker, ensure_experiment

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    tracker = MlflowTracker.start(uri, ensure_experiment(uri, "x"), "sft")
    spec = stage.StageSpec(recipe={}, stage_id="sft", stage_dir=str(tmp_path), cache_key="k", inputs={},
                           tracking_uri=uri, experiment_id="0")  # fmt: skip
    assert stage._system_metrics(spec, None, tracker) is None and stage._system_metrics(spec, 10, Tracker()) is None

    def broken(*args, **kwargs):
        raise ConnectionError("tracking server gone")

    monkeypatch.setattr(monitors, "SystemMetricsMonitor", broken)
    assert stage._system_metrics(spec, 10, tracker) is None
    assert "no system metrics for this stage: ConnectionError: tracking server gone" in caplog.text


def test_a_system_metrics_monitor_that_hangs_does_not_hold_the_stage_end(tmp_path, caplog):
    """A monitor stuck in a call (a tracking server that stops answering, an NVML read that never returns) is left
    behind after a bounded wait with a warning; one that stops writes its last samples into the stage's run."""
    import threading
    import time

    from alignpipe import stage
    from alignpipe.tracking import MlflowTracker, ensure_experiment

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    tracker = MlflowTracker.start(uri, ensure_experiment(uri, "x"), "sft")
    spec = stage.StageSpec(recipe={}, stage_id="sft", stage_dir=str(tmp_path), cache_key="k", inputs={},
                           tracking_uri=uri, experiment_id="0")  # fmt: skip

    monitor = stage._system_metrics(spec, 0.05, tracker)
    time.sleep(0.5)
    stage._stop_system_metrics(monitor, wait_s=10)
    assert not monitor._process  # finish() ran to its end
    logged = tracker.client.get_run(tracker.run_id).data.metrics
    assert "system/cpu_utilization_percentage" in logged

    release = threading.Event()
    stuck = stage._system_metrics(spec, 0.05, tracker)
    stuck.collect_metrics = lambda: release.wait()  # the thread blocks inside its next sample
    time.sleep(0.3)
    started = time.perf_counter()
    stage._stop_system_metrics(stuck, wait_s=0.5)
    assert time.perf_counter() - started < 5
    assert "the system-metrics monitor did not stop within 0.5 s" in caplog.text
    assert stuck._process.is_alive()
    release.set()
    stuck._process.join(10)
    tracker.end("FINISHED")
