"""The stage process: `python -m alignpipe.stage SPEC.json` runs one stage and writes its manifest.

Running each stage in its own process releases accelerators between stages and lets a stage be
launched with `accelerate launch`. Only rank 0 logs to MLflow and writes the manifest; the manifest
is written last, so its presence means the stage finished.
"""

from __future__ import annotations

import logging
import os
import socket
import sys
import threading
import time
from pathlib import Path

from pydantic import BaseModel

from alignpipe import progress
from alignpipe.log_levels import LevelMarks
from alignpipe.manifest import Manifest, write_whole

log = logging.getLogger("alignpipe.stage")


class StageSpec(BaseModel):
    """Everything a stage process needs (no secrets: those stay in the environment)."""

    recipe: dict
    stage_id: str
    stage_dir: str
    cache_key: str
    inputs: dict[str, Manifest]
    tracking_uri: str
    experiment_id: str
    parent_run_id: str | None = None
    pipeline_run_id: str = ""


def quiet_environment() -> None:
    """The environment that quiets the libraries a stage imports; read by `datasets` when it is imported, so a stage
    host (`alignpipe.stage_host`) sets it before its imports too."""
    os.environ.setdefault("HF_DATASETS_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def log_to_launcher() -> None:
    """The stage's log records as lines on stdout, which the launcher logs to the Prefect run: INFO and up, warnings
    and errors marked with their level (`alignpipe.log_levels`), each library's once."""
    logging.basicConfig(level=logging.INFO, stream=sys.stdout, force=True)
    logging.getLogger().handlers[0].setFormatter(LevelMarks())
    _quiet_libraries()


def _quiet_libraries() -> None:
    quiet_environment()
    if not progress.live():  # MLflow's bar for each artifact transfer: a log line per file, in a file
        os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")
    import transformers
    from transformers.utils import logging as tlog

    tlog.set_verbosity_error()
    tlog.disable_progress_bar()
    transformers.logging.set_verbosity_error()
    for name in ("mlflow", "alembic", "urllib3", "httpx", "filelock"):
        logging.getLogger(name).setLevel(logging.WARNING)
    _library_records_once()


def _library_records_once() -> None:
    """huggingface_hub and datasets each give their logger a stderr handler at import and let it propagate too: a
    stage's Hub retries and dataset notes reached the launcher twice, raw on stderr and through the root logger's
    stdout, which the launcher logs to Prefect. They keep the root's path only: once, in the stage's Prefect log (and
    its UI), on the console and in the error's last lines."""
    import datasets  # noqa: F401  (its handler is added when it is imported; every stage reads data through it)

    for name in ("huggingface_hub", "datasets"):
        logger = logging.getLogger(name)
        for handler in list(logger.handlers):
            if type(handler) is logging.StreamHandler and logger.propagate:
                logger.removeHandler(handler)


def _tracker(spec: StageSpec, stage, tags: dict[str, str]):
    """The stage's MLflow child run. A stage that was killed (its run never ended) continues the same run
    on the next attempt instead of opening a duplicate; the run id lives in the stage folder."""
    from alignpipe.tracking import MlflowTracker, refusal

    marker = Path(spec.stage_dir) / "mlflow_run_id"
    if marker.exists():
        tracker = MlflowTracker(spec.tracking_uri, marker.read_text().strip())
        try:
            run = tracker.client.get_run(tracker.run_id)
            if run.info.status != "FINISHED" and run.data.tags.get("alignpipe.cache_key") == spec.cache_key:
                tracker.client.update_run(tracker.run_id, status="RUNNING")
                tracker.set_tags({"alignpipe.resumed": "true"})
                log.info("continuing MLflow run %s", tracker.run_id)
                return tracker
        except Exception:  # the store was reset or the run deleted: start a new one
            pass
    try:
        tracker = MlflowTracker.start(spec.tracking_uri, spec.experiment_id, stage.id, spec.parent_run_id, tags)
    except Exception as e:
        where = f"when stage {stage.id!r} opened its run on {socket.gethostname()}"
        refused = refusal(e, spec.tracking_uri, where)
        if refused is None:
            raise
        raise refused from None
    write_whole(marker, tracker.run_id)
    return tracker


def _system_metrics(spec: StageSpec, every: float | None, tracker):
    """MLflow's monitor of the machine, sampling every `every` seconds into the stage's run (rank 0's); None when
    off or not logging to MLflow."""
    from alignpipe.tracking import MlflowTracker

    if every is None or not isinstance(tracker, MlflowTracker):
        return None
    from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor

    # its start and stop lines (at INFO) in every stage's log, in-process stages' too, would say nothing new
    logging.getLogger("mlflow.system_metrics").setLevel(logging.WARNING)
    try:
        # resume_logging: a stage that continues its killed attempt's run goes on from that run's last sample
        monitor = SystemMetricsMonitor(
            tracker.run_id, sampling_interval=every, resume_logging=True, tracking_uri=spec.tracking_uri
        )
        monitor.start()
    except Exception as e:  # watching the machine must never stop the stage
        log.warning("no system metrics for this stage: %s: %s", type(e).__name__, e)
        return None
    return monitor


MONITOR_STOP_S = 30.0
"""How long the end of a stage waits for the machine monitor's thread to stop: it may be inside a call to a
tracking server that hangs (MLflow's own retries run for minutes)."""


def _stop_system_metrics(monitor, wait_s: float = MONITOR_STOP_S) -> None:
    """Stop the machine monitor and write its last samples, waiting at most `wait_s`: a monitor still stopping then
    is left behind (a daemon thread, gone with the process) with its unsent samples, so it never holds the stage's
    end."""
    if monitor is None:
        return
    stopper = threading.Thread(target=monitor.finish, name="stop-system-metrics", daemon=True)
    stopper.start()
    stopper.join(wait_s)
    if stopper.is_alive():
        log.warning(
            "the system-metrics monitor did not stop within %g s (a tracking server that does not answer?); "
            "its last samples are dropped",
            wait_s,
        )


def _die_with_launcher() -> None:
    """A rank of a multi-process stage dies when its launcher (torchrun, accelerate launch) does: a launcher killed
    by a worker's cancellation or the OOM killer must not leave ranks training on, racing the retry that resumes
    the stage in the same folder."""
    from alignpipe.launch import die_with_parent

    hook = die_with_parent()
    if hook is not None:
        parent = os.getppid()
        hook()
        if os.getppid() != parent:  # the launcher was already gone before the hook was set
            os._exit(1)


def require_gpus(stage_id: str, gpus: int) -> None:
    """Fail at once, naming the stage, where fewer CUDA devices are visible than `resources.gpus` asks for."""
    if not gpus:
        return
    import torch

    seen = torch.cuda.device_count()
    if seen < gpus:
        raise RuntimeError(
            f"stage {stage_id!r} needs resources.gpus = {gpus} but this machine ({socket.gethostname()}) "
            f"shows {seen} CUDA device(s): run it on a pool whose workers have them "
            "(`resources: {pool: gpu}`), or lower `resources.gpus`"
        )


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        _die_with_launcher()
    spec = StageSpec.model_validate_json(Path(argv[0]).read_text())
    log_to_launcher()

    from alignpipe.distributed import select_strategy, use_rank_device
    from alignpipe.recipe.schema import Recipe
    from alignpipe.stages import runner
    from alignpipe.stages.context import StageContext
    from alignpipe.tracking import MlflowTracker, Tracker, TrackingRefused

    recipe = Recipe.model_validate(spec.recipe)
    stage = recipe.stage(spec.stage_id)
    select_strategy(stage.resources.strategy)
    rank = int(os.environ.get("RANK", "0"))
    stage_dir = Path(spec.stage_dir)
    stage_dir.mkdir(parents=True, exist_ok=True)
    tags = {
        "alignpipe.stage_id": stage.id,
        "alignpipe.kind": stage.kind,
        "alignpipe.cache_key": spec.cache_key,
        "alignpipe.pipeline": recipe.name,
    }
    try:
        tracker = _tracker(spec, stage, tags) if rank == 0 else Tracker()
    except TrackingRefused as e:
        log.error("stage %s failed: %s", stage.id, e)
        return 1
    ctx = StageContext(recipe, stage, stage_dir, spec.inputs, tracker, spec.pipeline_run_id, spec.parent_run_id)
    started = time.perf_counter()
    log.info("stage %s (%s) → %s", stage.id, stage.kind, stage_dir)
    monitor = _system_metrics(spec, recipe.tracking.system_metrics_every, tracker)
    try:
        require_gpus(stage.id, stage.resources.gpus)
        use_rank_device()
        result = runner(stage.kind)(ctx)
    except BaseException as e:
        _stop_system_metrics(monitor)
        log.exception("stage %s failed: %s", stage.id, e)
        if isinstance(tracker, MlflowTracker):
            tracker.set_tags({"alignpipe.error": f"{type(e).__name__}: {e}"[:500]})
            tracker.end("FAILED")
        return 1
    duration = time.perf_counter() - started
    _stop_system_metrics(monitor)  # its last samples written before the run ends
    if rank == 0:
        manifest = Manifest(
            stage_id=stage.id,
            kind=stage.kind,
            cache_key=spec.cache_key,
            outputs=result.outputs,
            metrics={k: float(v) for k, v in result.metrics.items()},
            key_metric=result.key_metric,
            info={
                **result.info,
                "host": socket.gethostname(),
                "pid": os.getpid(),
                "prefect_flow_run_id": os.environ.get("PREFECT__FLOW_RUN_ID"),
            },
            mlflow_run_id=getattr(tracker, "run_id", None),
            duration_s=duration,
        )
        if isinstance(tracker, MlflowTracker):
            tracker.log_metrics({"stage/duration_s": duration}, 0)
            tracker.end("FINISHED")
        manifest.write(stage_dir)
    log.info("stage %s done in %.1fs", stage.id, duration)
    return 0


def hosted_main(argv: list[str]) -> int:
    """A stage, or a rank of one, forked by a stage host (`alignpipe.stage_host`): `main`, then out as `__main__`
    leaves (a rank once its peers are done with the process group)."""
    code = main(argv)
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        leave_process_group(code)
    exit_now(code)
    return 1  # not reached: exit_now ends the process


def exit_now(code: int) -> None:
    """Leave without the interpreter's teardown, which takes ~2 s in a process that has loaded torch and
    transformers (finalising their modules and objects) after everything is written: exit handlers (MLflow's
    included) run and the streams are flushed first, then the process ends with `code`."""
    import atexit

    atexit._run_exitfuncs()
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os._exit(code)


def leave_process_group(code: int) -> None:
    """A rank of a multi-process stage that finished waits for the others, then closes the process group before its
    interpreter exits. Without it a rank may tear down the group's threads while a peer still talks to it, abort
    ("terminate called without an active exception", seen once in a 2-rank FSDP run under load) and make the launcher
    report a stage whose work is done and written as failed. A failed rank does not wait (its peers are stopped by
    the launcher)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return
    if code == 0:
        dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    code = main()
    if int(os.environ.get("WORLD_SIZE", "1")) == 1:  # ranks of a multi-process stage leave the ordinary way
        exit_now(code)
    leave_process_group(code)
    sys.exit(code)
