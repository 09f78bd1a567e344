"""The shape every stage task has: launch `python -m alignpipe.stage SPEC`, stream its log, return
the manifest (paths and metrics only, never a model)."""

from __future__ import annotations

from prefect import get_run_logger, task
from prefect.cache_policies import NONE

from alignpipe.pipeline import launch, read_spec


def stage_task(kind: str, retries: int = 0, retry_delay_seconds: list[int] | int = 0, on_done=None, env_fn=None):
    """A Prefect task for one stage kind. Caching is alignpipe's (manifests by cache key), not Prefect's.
    `on_done(manifest)` runs in the task after success (e.g. to publish Prefect artifacts);
    `env_fn(spec: StageSpec) -> dict` adds environment variables for the stage process (e.g. secrets)."""

    @task(name=f"{kind}-stage", cache_policy=NONE, retries=retries, retry_delay_seconds=retry_delay_seconds,
          task_run_name="{stage_id}")
    def run_stage(spec_path: str, stage_id: str, processes: int = 1, timeout_s: float | None = None,
                  accelerate_config: str | None = None, storage_options: dict | None = None) -> dict:
        logger = get_run_logger()
        manifest = launch(spec_path, on_line=lambda line: logger.info("[%s] %s", stage_id, line),
                          processes=processes, timeout_s=timeout_s, extra_env=env_fn(read_spec(spec_path, storage_options)) if env_fn else None,
                          accelerate_config=accelerate_config, storage_options=storage_options)
        if on_done is not None:
            on_done(manifest)
        return manifest.model_dump(mode="json")

    return run_stage
