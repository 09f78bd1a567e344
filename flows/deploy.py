"""Deployments the CLI creates (`alignpipe deploy`): the single-stage flow on a work pool, and a recipe's
pipeline flow with an optional cron schedule. Both are loaded from this checkout's source."""

from __future__ import annotations

from pathlib import Path
from typing import Any, cast

from flows.pipeline import pipeline
from flows.preflight import pool_exists
from flows.stage import stage

ROOT = str(Path(__file__).resolve().parents[1])


def deploy_problems(pools: list[str], cron: str | None) -> list[str]:
    """What would stop `alignpipe deploy` part-way, found before anything is deployed: a cron string Prefect
    rejects, and work pools the Prefect server (PREFECT_API_URL, else the local one) does not have. Each problem
    is one line with its fix."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.schedules import CronSchedule
    from prefect.settings import PREFECT_API_URL
    from pydantic import ValidationError

    problems = []
    if cron is not None:
        try:
            CronSchedule(cron=cron)
        except ValidationError:
            problems.append(
                f"--cron {cron!r} is not a cron schedule; write five fields, minute hour day-of-month month "
                "day-of-week, e.g. '0 3 * * 1' for Mondays 03:00 (or @daily, @weekly)"
            )
    where = f"the Prefect server at {url}" if (url := PREFECT_API_URL.value()) else "the local Prefect server"
    with get_client(sync_client=True) as client:
        for pool in dict.fromkeys(pools):
            if not pool_exists(client, pool):
                problems.append(
                    f"work pool {pool!r} does not exist on {where}; create it first, "
                    f"e.g. `prefect work-pool create {pool} --type process` (see infra/README.md for docker and "
                    "kubernetes pools)"
                )
    return problems


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
