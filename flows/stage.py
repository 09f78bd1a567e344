"""The single-stage flow that work-pool workers run: one stage process from a spec file on storage
every worker can reach. The pipeline flow stays the parent; this one only launches and reports. The
stage kind's hooks (secrets from Prefect blocks, artifacts after success) apply here as in the local task."""

from __future__ import annotations

from prefect import flow

from tasks.hooks import launch_in_run


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
    return launch_in_run(spec_path, stage_id, processes, timeout_s, accelerate_config, storage_options)
