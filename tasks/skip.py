"""Stages that do not run still show in Prefect's run graph: a stage whose gate is closed as a task run in a "Skipped"
state with the reason, a stage reused from an earlier run as a task run in a "Cached" state naming its folder."""

from prefect import task
from prefect.cache_policies import NONE
from prefect.states import Completed


@task(name="skipped-stage", cache_policy=NONE, task_run_name="{stage_id}")
def skip_task(stage_id: str, reason: str):
    return Completed(name="Skipped", message=reason)


@task(name="cached-stage", cache_policy=NONE, task_run_name="{stage_id}")
def cached_task(stage_id: str, folder: str):
    return Completed(name="Cached", message=f"finished earlier (same cache key); reused {folder}")
