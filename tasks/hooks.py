"""What differs between stage kinds on the Prefect side, in one table that both the local stage task
(`tasks.stage_task`) and the work-pool flow (`flows.stage`) read: environment for the stage process
(secrets resolved from Prefect blocks, never written to the spec), what runs after a stage succeeds
(Prefect artifacts), and default retries; and the progress artifact every stage's run keeps (`StageProgress`)."""

from __future__ import annotations

import contextvars
import functools
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import cast
from uuid import UUID

from alignpipe.log_levels import level_of
from alignpipe.manifest import Manifest
from alignpipe.stage import StageSpec


@dataclass(frozen=True)
class KindHooks:
    retries: int = 0
    """Task retries when the recipe's `resources.retries` does not set them."""
    retry_delay_seconds: list[float] | float = 0
    env: Callable[[StageSpec], dict[str, str]] | None = None
    """Extra environment variables for the stage process (e.g. a token from a Prefect Secret block)."""
    on_done: Callable[[Manifest, StageSpec], None] | None = None
    """Runs in the Prefect run after the stage succeeded (e.g. publishing artifacts)."""


class NoStageFailedTraceback(logging.Filter):
    """Prefect logs a failed task's exception with its traceback. For a `StageFailed` that traceback is Prefect's
    engine and `launch`, and says nothing of the stage (whose own traceback its log showed, in its process); the
    record keeps its message, which holds the cause."""

    def filter(self, record: logging.LogRecord) -> bool:
        from alignpipe.launch import StageFailed

        if record.exc_info and isinstance(record.exc_info[1], StageFailed):
            record.exc_info, record.exc_text = None, None
        return True


def quiet_stage_failures() -> None:
    """Install `NoStageFailedTraceback` on Prefect's task-run and flow-run loggers (a pool's stage flow runs the stage
    in its own body), once a process."""
    for name in ("prefect.task_runs", "prefect.flow_runs"):
        logger = logging.getLogger(name)
        if not any(isinstance(f, NoStageFailedTraceback) for f in logger.filters):
            logger.addFilter(NoStageFailedTraceback())


def stage_entry(spec: StageSpec) -> dict:
    """The recipe's entry for the spec's stage."""
    return next(s for s in spec.recipe["stages"] if s["id"] == spec.stage_id)


def hub_token_env(spec: StageSpec) -> dict[str, str]:
    """HF_TOKEN for the push process from the stage's Prefect Secret block, if it names one."""
    from prefect.blocks.system import Secret

    name = stage_entry(spec).get("token_secret")
    if not name:
        return {}
    block = cast(Secret, Secret.load(name))  # called outside an event loop, `load` returns the block itself
    return {"HF_TOKEN": block.get()}


def artifact_key(*parts: str) -> str:
    """A Prefect artifact key (lowercase letters, digits, dashes) from e.g. the pipeline and stage names."""
    return "-".join("".join(ch if ch.isalnum() else "-" for ch in p.lower()) for p in parts)


def publish_judge_artifacts(manifest: Manifest, spec: StageSpec) -> None:
    """The win rates as a Prefect table artifact and the judge's report as a markdown artifact, keyed by pipeline and
    stage (so each pipeline's judge has its own history)."""
    from prefect.artifacts import create_markdown_artifact, create_table_artifact

    key = artifact_key(spec.recipe.get("name", "pipeline"), manifest.stage_id)
    rows = [
        {
            **{k: w[k] for k in ("candidate", "baseline")},
            **{k: round(float(w[k]), 3) for k in ("win_rate", "ci_low", "ci_high")},
            **{k: w[k] for k in ("wins", "ties", "losses")},
        }
        for w in manifest.info.get("win_rates", [])
    ]
    create_table_artifact(
        table=rows, key=f"{key}-win-rates", description=f"win rates of judge stage {manifest.stage_id}"
    )
    create_markdown_artifact(
        markdown=manifest.info.get("report", ""),
        key=f"{key}-report",
        description=f"report of judge stage {manifest.stage_id}",
    )


KIND_HOOKS: dict[str, KindHooks] = {
    # Hub uploads fail transiently; the stage is idempotent (manifest last), so a retry is safe.
    "push": KindHooks(retries=2, retry_delay_seconds=[5, 30], env=hub_token_env),
    # Judging may call remote endpoints (LLM judges, HTTP scorers): retry transient failures.
    "judge": KindHooks(retries=1, retry_delay_seconds=10, on_done=publish_judge_artifacts),
}


def hooks_for(kind: str) -> KindHooks:
    return KIND_HOOKS.get(kind, KindHooks())


def stage_env(spec: StageSpec) -> dict[str, str] | None:
    """The extra environment of the spec's stage process, per its kind's hooks."""
    hooks = hooks_for(stage_entry(spec)["kind"])
    return hooks.env(spec) if hooks.env else None


class StageProgress:
    """A stage's bars as one Prefect progress artifact of its run (task run locally, flow run on a pool), keyed
    `<pipeline>-<stage>-progress`: the percentage of the bar running now, and which bar with its figures
    ("sft 40/150 (loss=1.7)"), updated as the stage reports (`launch`'s `on_progress`). A thread of its own sends the
    latest report (in the run's context, copied), so the launcher reading the stage's log never waits on Prefect's
    API; leaving the `with` block sends the last one. The artifact is the UI's view only: if Prefect's API refuses it,
    one warning, and the stage runs on."""

    def __init__(self, spec: StageSpec, logger, close_timeout_s: float = 30.0):
        self.key = artifact_key(spec.recipe.get("name", "pipeline"), spec.stage_id, "progress")
        self.logger = logger
        self.close_timeout_s = close_timeout_s
        self.artifact_id: UUID | None = None
        self.broken = False
        self._latest: dict | None = None
        self._closed = False
        self._ready = threading.Condition()
        self._sender = threading.Thread(
            target=contextvars.copy_context().run,
            args=(self._send_each,),
            name=f"progress-{spec.stage_id}",
            daemon=True,
        )

    def __enter__(self) -> StageProgress:
        self._sender.start()
        return self

    def __exit__(self, *exc) -> None:
        with self._ready:
            self._closed = True
            self._ready.notify()
        self._sender.join(self.close_timeout_s)

    def __call__(self, report: dict) -> None:
        with self._ready:
            self._latest = report  # a report not sent yet is replaced: only the latest state matters
            self._ready.notify()

    def _send_each(self) -> None:
        while True:
            with self._ready:
                self._ready.wait_for(lambda: self._latest is not None or self._closed)
                report, self._latest = self._latest, None
            if report is not None and not self.broken:
                self._send(report)
            elif report is None:
                return  # closed, and everything reported was sent

    def _send(self, report: dict) -> None:
        from prefect.artifacts import create_progress_artifact, update_progress_artifact

        n, total = report.get("n", 0), report.get("total")
        percent = min(100.0, 100.0 * n / total) if total else 0.0
        described = f"{report.get('desc', '')} {n}/{total if total else '?'}"
        if report.get("postfix"):
            described += f" ({report['postfix']})"
        try:
            if self.artifact_id is None:
                # called outside an event loop, it returns the id itself
                self.artifact_id = cast(UUID, create_progress_artifact(percent, key=self.key, description=described))
            else:
                update_progress_artifact(self.artifact_id, percent, description=described)
        except Exception as e:  # any API failure: the training matters, its progress view does not
            self.broken = True
            self.logger.warning("progress artifact %s not updated (%s); the stage runs on", self.key, e)


def log_stage_line(logger, stage_id: str, line: str) -> None:
    """A line of the stage's log into the run's log, at the level the stage logged it (`alignpipe.log_levels`)."""
    level, text = level_of(line)
    logger.log(level, "[%s] %s", stage_id, text)


def launch_in_run(
    spec_path: str,
    stage_id: str,
    processes: int = 1,
    timeout_s: float | None = None,
    accelerate_config: str | None = None,
    storage_options: dict | None = None,
    carry_output: bool = True,
) -> dict:
    """What the local stage task and the pool's stage flow both do, inside their Prefect run: launch the stage with
    its kind's environment, its log lines to the run's log and its bars to the run's progress artifact, run the
    kind's after-success hook, and return the manifest as JSON.

    `carry_output`: a failure's message carries the stage's last lines, as the pool's flow needs (its message is
    what the launcher sees); false where the run's log is the launcher's own, which showed them as they came."""
    from prefect import get_run_logger

    from alignpipe.launch import StageFailed, launch
    from alignpipe.plan import read_spec

    quiet_stage_failures()
    logger = get_run_logger()
    spec = read_spec(spec_path, storage_options)
    try:
        with StageProgress(spec, logger) as on_progress:
            manifest = launch(
                spec_path,
                on_line=functools.partial(log_stage_line, logger, stage_id),
                processes=processes,
                timeout_s=timeout_s,
                extra_env=stage_env(spec),
                accelerate_config=accelerate_config,
                storage_options=storage_options,
                on_progress=on_progress,
            )
    except StageFailed as e:
        if carry_output:
            raise
        raise e.logged_above() from None
    on_done = hooks_for(stage_entry(spec)["kind"]).on_done
    if on_done is not None:
        on_done(manifest, spec)
    return manifest.model_dump(mode="json")
