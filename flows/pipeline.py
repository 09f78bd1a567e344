"""The pipeline flow: recipe → plan → stage tasks, each started as soon as its dependencies finish.

Independent stages run concurrently. Finished stages (same cache key) are reused, so a re-run after a
failure resumes at the failed stage. A failed stage marks its dependents "not run"; other branches go on.
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import uuid
from pathlib import Path
from typing import Any

from prefect import flow, get_run_logger
from prefect.context import get_run_context
from prefect.states import Failed, State

from alignpipe.pipeline_run import (
    STATUS_CACHED,
    STATUS_FAILED,
    STATUS_SKIPPED,
    StageOutcome,
    end_pipeline_run,
    start_pipeline_run,
    write_summary,
)
from alignpipe.plan import plan, write_spec
from alignpipe.recipe import load_recipe
from alignpipe.schedule import Schedule
from alignpipe.summary import clip
from flows.preflight import check_prefect
from tasks import TASKS
from tasks.dispatch import dispatch_task
from tasks.hooks import hooks_for, quiet_stage_failures
from tasks.skip import cached_task, skip_task


def upstream(futures: dict[str, Any], deps: list[str]) -> list:
    """The task runs of a stage's dependencies (for Prefect's run graph)."""
    return [futures[d] for d in deps if d in futures]


def link_mlflow_run(recipe, tracking: tuple[str, str, str]) -> None:
    """A link artifact from this flow run to its MLflow parent run (for a local store, the address `mlflow ui` serves
    it at, with the command in the description)."""
    from prefect.artifacts import create_link_artifact

    from tasks.hooks import artifact_key

    uri, experiment_id, run_id = tracking
    base = uri.rstrip("/") if uri.startswith("http") else "http://127.0.0.1:5000"
    how = "" if uri.startswith("http") else f" (start it with: mlflow ui --backend-store-uri {uri})"
    create_link_artifact(
        link=f"{base}/#/experiments/{experiment_id}/runs/{run_id}?workflowType=machine_learning",  # not GenAI
        link_text=f"MLflow run {run_id[:8]} of {recipe.name}",
        key=artifact_key(recipe.name, "mlflow-run"),
        description=f"the pipeline's MLflow parent run{how}",
    )


def publish_summary(recipe, outcomes: list[StageOutcome]) -> None:
    """The end-of-run table `alignpipe run` prints, as a table artifact of this flow run (`<pipeline>-summary`), for
    a run launched from Prefect's UI: a row a stage, with its status, duration, key metric, output and MLflow run."""
    from prefect.artifacts import create_table_artifact

    from tasks.hooks import artifact_key

    rows = [
        {
            "stage": o.stage_id,
            "kind": o.kind,
            "status": o.status,
            "duration_s": round(o.duration_s, 1) if o.duration_s else None,
            "key_metric": o.key_metric or "",
            "value": round(o.value, 4) if o.value is not None else None,
            "output": o.output,
            "mlflow_run": o.mlflow_run_id or "",
            "message": clip(o.message, 300),
        }
        for o in outcomes
    ]
    counts = collections.Counter(o.status for o in outcomes)
    create_table_artifact(
        table=rows,
        key=artifact_key(recipe.name, "summary"),
        description=f"{recipe.name}, {len(outcomes)} stages: " + ", ".join(f"{n} {st}" for st, n in counts.items()),
    )


def warm_stage_host(recipe, plans: dict | None = None) -> None:
    """Start this machine's stage host (`alignpipe.stage_host`) now, importing what stages need beside the run's own
    start-up, where a stage will be run here and in one process: of those `plans` does not reuse, or, before a plan
    (the CLI, which leaves hashing the data to the flow), of any."""
    from alignpipe import stage_host

    if any(
        (plans is None or not plans[s.id].cached)
        and not s.resources.pool
        and s.resources.processes <= 1
        and not s.resources.accelerate_config
        for s in recipe.stages
    ):
        stage_host.warm()


def submit_stage(recipe, s, spec: str, wait_for: list):
    """Start a stage's task run: the kind's local task, or its dispatch to the stage's work pool."""
    task = TASKS[s.kind]
    if s.resources.pool:  # the kind's default retries apply to its dispatch as to its local task
        hooks = hooks_for(s.kind)
        task = dispatch_task.with_options(retries=hooks.retries, retry_delay_seconds=hooks.retry_delay_seconds)
    if s.resources.retries:
        task = task.with_options(retries=s.resources.retries)
    task = task.with_options(tags={"alignpipe", s.kind, *s.resources.tags})
    where: dict[str, Any] = {"pool": s.resources.pool} if s.resources.pool else {}
    if recipe.storage:
        where["storage_options"] = recipe.storage.options
    return task.submit(
        wait_for=wait_for,
        return_state=False,
        spec_path=spec,
        stage_id=s.id,
        processes=s.resources.processes,
        timeout_s=s.resources.timeout_s,
        accelerate_config=s.resources.accelerate_config,
        **where,
    )


def marker_task(outcome: StageOutcome, folder: str, wait_for: list):
    """A skipped or cached stage as a finished task run in the run graph (stages that were not run get none)."""
    if outcome.status == STATUS_SKIPPED:
        future = skip_task.submit(
            stage_id=outcome.stage_id, reason=outcome.message, wait_for=wait_for, return_state=False
        )
    elif outcome.status == STATUS_CACHED:
        future = cached_task.submit(stage_id=outcome.stage_id, folder=folder, wait_for=wait_for, return_state=False)
    else:
        return None
    future.wait()
    return future


def log_outcome(logger, outcome: StageOutcome, folder: str) -> None:
    if outcome.status == STATUS_CACHED:
        logger.info("stage %s: cached (%s)", outcome.stage_id, folder)
    elif outcome.status == STATUS_SKIPPED:
        logger.warning("stage %s skipped: %s", outcome.stage_id, outcome.message)
    elif outcome.status == STATUS_FAILED:
        logger.error("stage %s: %s", outcome.stage_id, outcome.message)


def _flow_run_id() -> str:
    try:
        return str(get_run_context().flow_run.id)  # type: ignore[union-attr]  # a flow run's context
    except Exception:  # called outside a flow run (tests of the body)
        return uuid.uuid4().hex


def run_name() -> str:
    """`<pipeline name>-<first 8 characters of the flow run id>`: runs of one recipe told apart in the Prefect UI."""
    import yaml
    from prefect.runtime import flow_run

    path = Path(flow_run.parameters.get("recipe_path", "pipeline"))
    name = path.stem
    with contextlib.suppress(Exception):  # unreadable here (e.g. a storage URL): the file name will do
        name = str(yaml.safe_load(path.read_text()).get("name") or name)
    return f"{name}-{str(flow_run.id)[:8]}"


@flow(
    name="alignpipe-pipeline",
    flow_run_name=run_name,
    log_prints=True,
    description="Run a recipe as a DAG of stages; finished stages with unchanged inputs are reused.",
)
def pipeline(recipe_path: str, overrides: list[str] | None = None, force: list[str] | None = None) -> dict | State:
    """Run a recipe as a DAG of stages; finished stages with unchanged inputs are reused.

    Args:
        recipe_path: The recipe's YAML file, as the worker running this flow sees it (e.g. pipelines/tiny-demo.yaml).
        overrides: Edits to the recipe, one `key=value` each, as `alignpipe run --set` takes them (e.g.
            stages.sft.max_steps=200, or model.path=Qwen/Qwen2.5-0.5B).
        force: Ids of stages to run again even where a finished output with the same inputs exists.
    """
    quiet_stage_failures()  # a dispatched stage's failure is raised in this process
    logger = get_run_logger()
    recipe_text = Path(recipe_path).read_text() if Path(recipe_path).is_file() else None
    recipe = load_recipe(recipe_path, overrides or [], to_run=True)  # validated again: UI-launched runs skip the CLI
    check_prefect(recipe, recipe_path)
    plans = plan(recipe, force or [])
    warm_stage_host(recipe, plans)
    run_id = _flow_run_id()
    tracking = start_pipeline_run(recipe, run_id)
    link_mlflow_run(recipe, tracking)
    schedule = Schedule(recipe, plans)
    # Every stage's task run, passed as `wait_for` to its dependents: the upstream stages are finished by then, so
    # nothing waits, but Prefect records the edges and draws the run graph.
    futures: dict[str, Any] = {}
    running: dict[str, Any] = {}
    while not schedule.settled:
        for s, outcome in schedule.ready():
            wait_for = upstream(futures, plans[s.id].deps)
            if outcome is None:
                spec = write_spec(recipe, plans[s.id], schedule.inputs(s.id), tracking, run_id)
                futures[s.id] = running[s.id] = submit_stage(recipe, s, spec, wait_for)
            else:
                log_outcome(logger, outcome, plans[s.id].folder)
                marker = marker_task(outcome, str(plans[s.id].dir), wait_for)
                if marker is not None:
                    futures[s.id] = marker
        if running:
            done, _ = concurrent.futures.wait(
                [f.wrapped_future for f in running.values()], return_when=concurrent.futures.FIRST_COMPLETED
            )
            for sid in [sid for sid, f in running.items() if f.wrapped_future in done]:
                outcome = schedule.finish(sid, recipe.stage(sid).kind, running.pop(sid).result(raise_on_failure=False))
                if outcome.status == STATUS_FAILED:  # a StageFailed's headline names the stage already
                    named = outcome.message.startswith(f"stage {sid!r} ")
                    logger.error("%s", outcome.message if named else f"stage {sid} failed: {outcome.message}")

    ordered = schedule.ordered()
    end_pipeline_run(tracking, ordered)
    # The recipe's text too: `alignpipe resume` on a machine without the file (storage runs) rebuilds it.
    request = {
        "recipe": str(Path(recipe_path).resolve()),
        "overrides": list(overrides or []),
        "recipe_text": recipe_text,
    }
    summary_path = write_summary(recipe, run_id, ordered, tracking[2], request)
    publish_summary(recipe, ordered)
    failed = [o.stage_id for o in ordered if o.status == STATUS_FAILED]
    if failed:
        # A Failed state, not an exception: the stages' own errors are logged already, and Prefect would print an
        # exception's traceback through its engine, which says nothing of the run
        return Failed(
            message=f"stage(s) {failed} failed; finished stages are kept and a re-run resumes. Summary: {summary_path}"
        )
    return {"summary": str(summary_path), "mlflow_run_id": tracking[2]}
