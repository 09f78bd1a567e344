"""The Prefect tasks that run stages: one per stage kind, each launching `python -m alignpipe.stage SPEC`,
streaming its log and returning the manifest (paths and metrics only, never a model). What differs between
kinds (secrets, after-success hooks, retries) comes from `tasks.hooks`, which the work-pool flow reads too."""

from __future__ import annotations

from prefect import task
from prefect.cache_policies import NONE

from tasks.hooks import hooks_for, launch_in_run


def stage_task(kind: str):
    """A Prefect task for one stage kind. Caching is alignpipe's (manifests by cache key), not Prefect's."""
    hooks = hooks_for(kind)

    @task(
        name=f"{kind}-stage",
        cache_policy=NONE,
        retries=hooks.retries,
        retry_delay_seconds=hooks.retry_delay_seconds,
        task_run_name="{stage_id}",
    )
    def run_stage(
        spec_path: str,
        stage_id: str,
        processes: int = 1,
        timeout_s: float | None = None,
        accelerate_config: str | None = None,
        storage_options: dict | None = None,
    ) -> dict:
        return launch_in_run(
            spec_path, stage_id, processes, timeout_s, accelerate_config, storage_options, carry_output=False
        )

    return run_stage
