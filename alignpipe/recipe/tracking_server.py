"""A recipe's MLflow tracking server (`tracking.uri: http://...`), asked before the run whether it answers.

The pipeline flow opens its MLflow run first, and MLflow's client retries a server that refuses connections for
minutes (seven tries, backing off) before it fails: a server that is down, or a mistyped host or port, would hold the
run that long and then end it with a page of urllib3 warnings. Its `/health` is asked once a process, without
credentials (it needs none). Any HTTP answer counts as an answer, whatever its status (a proxy's path, a login
page): only a server that cannot be reached at all is a problem. `databricks` and other non-HTTP URIs are not asked.
"""

from __future__ import annotations

import functools
import re

from alignpipe.recipe.errors import Problem
from alignpipe.recipe.hub_refs import TIMEOUT_S, Unreachable, unreachable


def tracking_problems(recipe) -> list[Problem]:
    """A problem at `tracking.uri` when it names an HTTP(S) server that does not answer."""
    uri = recipe.tracking.uri
    if not uri or not uri.lower().startswith(("http://", "https://")):
        return []
    answer = _health(uri.rstrip("/"))
    if answer is None:
        return []
    return [
        Problem(
            ("tracking", "uri"),
            f"the MLflow tracking server {shown(uri)} does not answer ({answer.why}); MLflow's client would retry it for "
            "minutes before the run failed",
            "start it (`infra/mlflow/start-server.sh`, or `mlflow server --host 0.0.0.0 --port 5000 "
            "--backend-store-uri sqlite:///mlflow.db`), check the host and port, or remove `tracking.uri` to record "
            "to a SQLite store in the workdir",
        )
    ]


def shown(uri: str) -> str:
    """`uri` with any `user:password@` masked."""
    return re.sub(r"//[^/@]+@", "//***@", uri, count=1)


@functools.cache
def _health(root: str) -> Unreachable | None:
    """None where `root/health` gave any HTTP answer; else why not, in one line."""
    import httpx

    try:
        httpx.get(f"{root}/health", timeout=TIMEOUT_S, follow_redirects=False)
    except httpx.HTTPError as e:
        return unreachable(e)
    return None
