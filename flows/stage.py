"""The single-stage flow that work-pool workers run: one stage process from a spec file on storage
every worker can reach. The pipeline flow stays the parent; this one only launches and reports. The
stage kind's hooks (secrets from Prefect blocks, artifacts after success) apply here as in the local task."""

from __future__ import annotations

from prefect import flow, get_run_logger

from alignpipe.launch import launch
from alignpipe.plan import read_spec
from tasks.hooks import StageProgress, hooks_for, stage_entry, stage_env


@flow(
    name="alignpipe-stage",
    flow_run_name="{stage_id}",
    description="Run one stage of a pipeline on this pool's worker (the pipeline flow dispatches it).",
)
def stage(
    spec_path: str,
    stage_id: str,
    processes: int = 1,
    timeout_s: float | None = None,
    accelerate_config: str | None = None,
    storage_options: dict | None = None,
) -> dict:
    """Run one stage from its spec file (a shared path or a URL in the recipe's storage root) and return
    its manifest.

    Args:
        spec_path: The stage's spec.json, which the pipeline flow wrote: a path every worker of the pool reaches, or
            a URL in the recipe's storage root.
        stage_id: The stage's id in its recipe (names the flow run).
        processes: Data-parallel ranks to launch (`resources.processes`).
        timeout_s: Seconds after which the stage is killed (`resources.timeout_s`); none: no limit.
        accelerate_config: An `accelerate` config file for its ranks (FSDP, DeepSpeed; `resources.accelerate_config`).
        storage_options: The recipe's `storage.options` (fsspec's, never credentials: those come from the worker's
            environment).
    """
    logger = get_run_logger()
    spec = read_spec(spec_path, storage_options)
    with StageProgress(spec, logger) as on_progress:
        manifest = launch(
            spec_path,
            on_line=lambda line: logger.info("[%s] %s", stage_id, line),
            processes=processes,
            timeout_s=timeout_s,
            extra_env=stage_env(spec),
            accelerate_config=accelerate_config,
            storage_options=storage_options,
            on_progress=on_progress,
        )
    on_done = hooks_for(stage_entry(spec)["kind"]).on_done
    if on_done is not None:
        on_done(manifest, spec)
    return manifest.model_dump(mode="json")
