"""One thin Prefect task per stage kind (`TASKS`), the dispatch task for work pools, and the per-kind hooks both use."""

from alignpipe.recipe.stages import STAGE_KINDS
from tasks.stage_task import stage_task

TASKS = {kind: stage_task(kind) for kind in STAGE_KINDS}

__all__ = ["TASKS", "stage_task"]
