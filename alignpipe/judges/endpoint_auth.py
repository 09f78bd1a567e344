"""An HTTP endpoint's API key, held in an environment variable the recipe names (`api_key_env`): an endpoint judge's
or a remote scorer's. The key is read where the stage runs and goes into the requests' `Authorization` header only,
never into the recipe, a log, an error or MLflow."""

from __future__ import annotations

import os


def endpoint_api_key(variable: str | None, field: str) -> str | None:
    """The key in environment variable `variable` (the recipe's `field`), or None without one."""
    if variable is None:
        return None
    key = os.environ.get(variable)
    if not key:
        raise ValueError(
            f"{field} names {variable}, which is not set where this stage runs: export the endpoint's API key in it "
            "(on a work pool, in its workers' environment)"
        )
    return key


def auth_headers(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}
