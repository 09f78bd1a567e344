"""Dispatch a stage to a Prefect work pool: run the single-stage flow's deployment for that pool
(`alignpipe-stage/<pool>`), wait for it, and read the manifest it left on shared storage."""

from __future__ import annotations

from typing import cast

from prefect import get_run_logger, task
from prefect.cache_policies import NONE
from prefect.client.schemas.objects import FlowRun
from prefect.deployments import run_deployment

from alignpipe.launch import StageFailed
from alignpipe.plan import read_manifest, read_spec

STAGE_FLOW = "alignpipe-stage"


def deployment_name(pool: str) -> str:
    return f"{STAGE_FLOW}/{pool}"


def worker_exit_code(message: str) -> int:
    """The exit code of the worker's job from a crashed flow run's state message (the worker writes
    "... exited with non-zero status code N"), or of the stage process from a failed one; -1 if none."""
    import re

    found = re.search(r"(?:status|exit) code:? *(-?\d+)", message)
    return int(found.group(1)) if found else -1


@task(name="dispatch-stage", cache_policy=NONE, task_run_name="{stage_id}@{pool}")
def dispatch_task(
    spec_path: str,
    stage_id: str,
    pool: str,
    processes: int = 1,
    timeout_s: float | None = None,
    accelerate_config: str | None = None,
    storage_options: dict | None = None,
) -> dict:
    logger = get_run_logger()
    flow_run = cast(
        FlowRun,
        run_deployment(  # called from a sync task: the FlowRun itself, not a coroutine
            deployment_name(pool),
            parameters={
                "spec_path": spec_path,
                "stage_id": stage_id,
                "processes": processes,
                "timeout_s": timeout_s,
                "accelerate_config": accelerate_config,
                "storage_options": storage_options,
            },
            timeout=timeout_s,
            as_subflow=True,
        ),
    )  # bounded: a dead worker cannot hang the pipeline
    state = flow_run.state
    state_name = state.name if state else "unknown"
    logger.info("stage %s ran as flow run %s on pool %s: %s", stage_id, flow_run.id, pool, state_name)
    spec = read_spec(spec_path, storage_options)
    manifest = read_manifest(spec)
    if state is None or not state.is_completed() or manifest is None or manifest.cache_key != spec.cache_key:
        message = (state.message if state else None) or ""
        raise StageFailed(
            stage_id,
            worker_exit_code(message),
            [f"flow run {flow_run.id} on pool {pool!r} ended {state_name}: {message}"],
        )
    return manifest.model_dump(mode="json")
