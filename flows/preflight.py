"""What a run needs of the Prefect server, checked when it starts and before any stage runs: each work pool a stage
names, with the single-stage flow deployed on it, and each Secret block a push reads its Hub token from, holding a
token that can write where the push pushes. `alignpipe validate` and `run` ask where a stage names either (`run`
before it starts the flow), and the pipeline flow asks again (runs launched from the UI or a schedule skip the CLI):
a misspelt block name or a revoked token in it would otherwise fail the push after the training.
"""

from __future__ import annotations

from typing import Any

from alignpipe.recipe import Problem, RecipeError
from alignpipe.recipe.push_access import hub_write_problems
from alignpipe.recipe.stages import PushStage

SECRET = "secret"
"""The block type slug of Prefect's `Secret`."""


def needs_prefect(recipe) -> bool:
    """Whether a stage names something only the Prefect server can confirm (a work pool, a Secret block)."""
    return any(s.resources.pool or _secret_push(s) for s in recipe.stages)


def check_prefect(recipe, source: str = "recipe", deploying: tuple[str, ...] = ()) -> None:
    """Raise a `RecipeError` (naming `source`, the recipe's file) listing every missing pool, undeployed stage flow,
    missing or empty Secret block, and Secret-held token the Hub shows cannot write. `deploying`: pools whose stage
    flow `alignpipe deploy` is deploying now (their deployment is not asked for)."""
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        problems = pool_problems(client, recipe, deploying) + secret_problems(client, recipe)
    if problems:
        raise RecipeError(problems, source)


def pool_exists(client, pool: str) -> bool:
    """Whether the Prefect server `client` talks to has work pool `pool`."""
    from prefect.exceptions import ObjectNotFound

    try:
        client.read_work_pool(pool)
    except ObjectNotFound:
        return False
    return True


def pool_problems(client, recipe, deploying: tuple[str, ...] = ()) -> list[Problem]:
    """Every work pool a stage names must exist, with the single-stage flow deployed on it (or in `deploying`)."""
    from prefect.exceptions import ObjectNotFound

    from tasks.dispatch import deployment_name  # imports Prefect: `validate` of a recipe that names no pool does not

    problems = []
    for i, s in enumerate(recipe.stages):
        pool = s.resources.pool
        if not pool:
            continue
        where = ("stages", i, "resources", "pool")
        if not pool_exists(client, pool):
            problems.append(
                Problem(
                    where,
                    f"work pool {pool!r} does not exist on the Prefect server",
                    f"create it (prefect work-pool create {pool} --type process) and deploy "
                    "the stage flow on it (infra/README.md), or remove `pool`",
                    label=f"stage {s.id!r}",
                )
            )
            continue
        if pool in deploying:
            continue
        try:
            client.read_deployment_by_name(deployment_name(pool))
        except ObjectNotFound:
            problems.append(
                Problem(
                    where,
                    f"no deployment {deployment_name(pool)!r} on pool {pool!r}",
                    "deploy it: alignpipe deploy --pool " + pool,
                    label=f"stage {s.id!r}",
                )
            )
    return problems


def secret_problems(client, recipe) -> list[Problem]:
    """Each push's `token_secret` must name a Secret block on the server that holds a token; where the Hub can be
    asked, that token must be able to write the push's repository. The token is read into this process only, for
    the Hub's `whoami-v2`, and never shown."""
    from prefect.exceptions import ObjectNotFound

    problems: list[Problem] = []
    for i, s in enumerate(recipe.stages):
        if not _secret_push(s):
            continue
        name = str(s.token_secret)
        where = ("stages", i, "token_secret")
        try:
            block = client.read_block_document_by_name(name, block_type_slug=SECRET, include_secrets=True)
        except ObjectNotFound:
            problems.append(
                Problem(
                    where,
                    f"stage {s.id!r} reads its Hub token from Prefect Secret block {name!r}, which this Prefect "
                    f"server does not have ({_known_secrets(client)})",
                    f"correct the name, or save the token there: in the Prefect UI (Blocks → add Secret, named {name!r}) "
                    f"or in Python, `Secret(value=<token>).save({name!r})` (from prefect.blocks.system import Secret)",
                    label=f"stage {s.id!r}",
                )
            )
            continue
        token = _token_in(block.data)
        if token is None:
            problems.append(
                Problem(
                    where,
                    f"Prefect Secret block {name!r} holds no Hub token (an empty value, or a JSON object)",
                    f"save the token as its value: `Secret(value=<token>).save({name!r}, overwrite=True)`, or edit "
                    "the block in the Prefect UI",
                    label=f"stage {s.id!r}",
                )
            )
            continue
        found = hub_write_problems(
            [(i, s)],
            token,
            f"Prefect Secret block {name!r}",
            holder="the token",
            install=f"save it in the block: `Secret(value=<it>).save({name!r}, overwrite=True)` or the Prefect UI",
            field="token_secret",
        )
        for p in found:
            p.label = f"stage {s.id!r}"
        problems += found
    return problems


def _secret_push(stage) -> bool:
    return isinstance(stage, PushStage) and stage.target == "hub" and bool(stage.token_secret)


def _token_in(data: dict[str, Any]) -> str | None:
    """The string a Secret block document holds, or None (a block may hold a JSON object or nothing)."""
    value = data.get("value")
    return value.strip() if isinstance(value, str) and value.strip() else None


def _known_secrets(client) -> str:
    """The Secret block names the server has, for a misspelt name (names only: nothing secret is read)."""
    blocks = client.read_block_documents_by_type(SECRET, include_secrets=False)
    names = sorted(str(b.name) for b in blocks if b.name and not b.is_anonymous)
    return f"it has {', '.join(map(repr, names))}" if names else "it has no Secret blocks"
