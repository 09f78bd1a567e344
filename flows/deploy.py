"""Deployments the CLI creates (`alignpipe deploy`): the single-stage flow on a work pool, and a recipe's
pipeline flow with an optional cron schedule. Both are loaded from this checkout's source."""

from __future__ import annotations

from pathlib import Path
from typing import Any, cast

from flows.pipeline import pipeline
from flows.stage import stage

ROOT = str(Path(__file__).resolve().parents[1])


def deploy_stage_flow(pool: str) -> None:
    """Deploy `alignpipe-stage/<pool>`, which workers of `pool` run for dispatched stages."""
    flow = cast(Any, stage.from_source(source=ROOT, entrypoint="flows/stage.py:stage"))  # sync call: the Flow itself
    flow.deploy(name=pool, work_pool_name=pool)


def deploy_pipeline(recipe_path: str, name: str, work_pool: str, overrides: list[str], cron: str | None = None) -> None:
    """Deploy `alignpipe-pipeline/<name>` for a recipe, run by `work_pool`'s workers, on `cron` if given. One run
    at a time: a scheduled run that fires while the previous one still runs is queued, not started beside it."""
    from prefect.client.schemas.objects import ConcurrencyLimitConfig, ConcurrencyLimitStrategy

    flow = cast(Any, pipeline.from_source(source=ROOT, entrypoint="flows/pipeline.py:pipeline"))
    flow.deploy(
        name=name,
        work_pool_name=work_pool,
        cron=cron,
        concurrency_limit=ConcurrencyLimitConfig(limit=1, collision_strategy=ConcurrencyLimitStrategy.ENQUEUE),
        parameters={"recipe_path": str(Path(recipe_path).resolve()), "overrides": overrides, "force": []},
    )
