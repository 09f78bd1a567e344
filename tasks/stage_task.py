"""The Prefect tasks that run stages: one per stage kind, each launching `python -m alignpipe.stage SPEC`,
streaming its log and returning the manifest (paths and metrics only, never a model). What differs between
kinds (secrets, after-success hooks, retries) comes from `tasks.hooks`, which the work-pool flow reads too."""

from __future__ import annotations

from prefect import get_run_logger, task
from prefect.cache_policies import NONE

from alignpipe.launch import launch
from alignpipe.plan import read_spec
from tasks.hooks import StageProgress, hooks_for, stage_env


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
        if hooks.on_done is not None:
            hooks.on_done(manifest, spec)
        return manifest.model_dump(mode="json")

    return run_stage
