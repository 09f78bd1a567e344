"""A recipe's MLflow tracking server (`tracking.uri: http://...`), asked before the run whether it answers.

The pipeline flow opens its MLflow run first, and MLflow's client retries a server that refuses connections for
minutes (seven tries, backing off) before it fails: a server that is down, or a mistyped host or port, would hold the
run that long and then end it with a page of urllib3 warnings. Its `/health` is asked once a process, without
credentials (it needs none). Any HTTP answer counts as an answer, whatever its status (a proxy's path, a login
page): only a server that cannot be reached at all is a problem. `databricks` and other non-HTTP URIs are not asked.

A server that answers is then asked, with the credentials MLflow's client will send (MLFLOW_TRACKING_USERNAME and
MLFLOW_TRACKING_PASSWORD, MLFLOW_TRACKING_TOKEN, `~/.mlflow/credentials`), what the run will need of it: to accept
those credentials (a server run with `--app-name basic-auth` answers 401 otherwise, and the run would end at its first
call with MLflow's traceback), and, where the recipe's experiment or a push stage's registered model already exists
and belongs to someone else, that this user may write to it (EDIT or MANAGE: a user who may only read the registered
model would train every stage and then fail to publish). Those answers come from MLflow's own auth API
(`users/current`, asked once, and `users/permissions/get`); a server without it (no auth, or an MLflow older than
3.17) is not asked further. Nothing is written to the server.
"""

from __future__ import annotations

import contextlib
import functools
import os
import re
import warnings

from alignpipe.recipe.errors import Problem
from alignpipe.recipe.hub_refs import TIMEOUT_S, Unreachable, unreachable
from alignpipe.tracking import credentials_sent, whose


def tracking_problems(recipe) -> list[Problem]:
    """A problem at `tracking.uri` when it names an HTTP(S) server that does not answer, or that answers but will
    refuse what the run needs of it."""
    uri = recipe.tracking.uri
    if not uri or not uri.lower().startswith(("http://", "https://")):
        return []
    answer = _health(uri.rstrip("/"), **_tls())
    if answer is None:
        return _access_problems(recipe, uri.rstrip("/"))
    if answer.why.startswith("SSLError"):
        fix = (
            "give MLflow's client the certificate of the CA that signed the server's (MLFLOW_TRACKING_SERVER_CERT_PATH "
            "or REQUESTS_CA_BUNDLE: a .pem file), a client certificate where the server asks for one "
            "(MLFLOW_TRACKING_CLIENT_CERT_PATH), or, on a network you trust, MLFLOW_TRACKING_INSECURE_TLS=true"
        )
        return [
            Problem(
                ("tracking", "uri"),
                f"the MLflow tracking server {uri} could not be reached over TLS ({answer.why})",
                fix,
            )
        ]
    return [
        Problem(
            ("tracking", "uri"),
            f"the MLflow tracking server {uri} does not answer ({answer.why}); MLflow's client would retry it for "
            "minutes before the run failed",
            "start it (`infra/mlflow/start-server.sh`, or `mlflow server --host 0.0.0.0 --port 5000 "
            "--backend-store-uri sqlite:///mlflow.db`), check the host and port, or remove `tracking.uri` to record "
            "to a SQLite store in the workdir",
        )
    ]


def _tls() -> dict:
    """The TLS settings MLflow's client takes for its tracking server, as `requests` keywords (requests itself reads
    REQUESTS_CA_BUNDLE, as it does for MLflow's client)."""
    insecure = os.environ.get("MLFLOW_TRACKING_INSECURE_TLS", "").strip().lower() in ("true", "1")
    return {
        "verify": False if insecure else (os.environ.get("MLFLOW_TRACKING_SERVER_CERT_PATH") or True),
        "cert": os.environ.get("MLFLOW_TRACKING_CLIENT_CERT_PATH") or None,
    }


@functools.cache
def _health(root: str, verify: bool | str, cert: str | None) -> Unreachable | None:
    """None where `root/health` gave any HTTP answer; else why not, in one line. Asked with `requests`, as MLflow's
    client asks, so that the same certificates and proxies apply."""
    import requests

    try:
        with _insecure_is_chosen():
            requests.get(f"{root}/health", timeout=TIMEOUT_S, allow_redirects=False, verify=verify, cert=cert)
    except requests.RequestException as e:
        # requests wraps urllib3's error in a "Max retries exceeded … (Caused by …)" sentence; the cause's own words
        # ("[Errno 111] Connection refused", "[SSL: CERTIFICATE_VERIFY_FAILED] … self-signed certificate") say it
        cause = re.search(r"\[(?:Errno -?\d+|SSL: \w+)\][^'\")]*", str(e))
        if cause is None:
            return unreachable(e)
        words = re.sub(r"\s*\(_ssl\.c:\d+$", "", cause.group(0).strip())
        return Unreachable(f"{type(e).__name__}: {words}")
    return None


@contextlib.contextmanager
def _insecure_is_chosen():
    """urllib3 warns of each unverified HTTPS request; with MLFLOW_TRACKING_INSECURE_TLS that is the user's choice."""
    import urllib3

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", urllib3.exceptions.InsecureRequestWarning)
        yield


READ_ONLY = ("READ", "USE", "NO_PERMISSIONS", "DENY")
"""MLflow auth's permissions short of EDIT: they do not let a user create runs in an experiment, or versions and
aliases of a registered model."""


def _access_problems(recipe, root: str) -> list[Problem]:
    experiment = recipe.experiment_name
    new_experiment = "set `tracking.experiment` to a new name (a new experiment is yours)"
    status, body = _ask(root, "/api/2.0/mlflow/experiments/get-by-name", experiment_name=experiment)
    if status == 401:
        return [_unauthenticated(root)]
    user = _current_user(root)  # asked once: every message and permission below is this user's
    if status == 403:
        return [
            Problem(
                ("tracking", "experiment"),
                f"the MLflow server {root} does not let {_who(user)} read the experiment {experiment!r}",
                f"ask its owner or an MLflow admin for EDIT on it, or {new_experiment}",
            )
        ]
    problems = []
    if status == 200 and isinstance(body.get("experiment"), dict):
        exp_id = str(body["experiment"].get("experiment_id", ""))
        permission = _permission(root, user, "experiment", exp_id)
        if permission in READ_ONLY:
            problems.append(
                Problem(
                    ("tracking", "experiment"),
                    f"{_who(user)} has {permission} permission on the MLflow experiment {experiment!r} (id {exp_id}) "
                    f"at {root}; creating the pipeline's runs there needs EDIT",
                    _grant_hint(root, user, "experiment", exp_id, new_experiment),
                )
            )
    for i, stage in enumerate(recipe.stages):
        registry = getattr(stage, "registry", None)
        if registry is None:
            continue
        status, body = _ask(root, "/api/2.0/mlflow/registered-models/get", name=registry.name)
        if status not in (200, 403):
            continue
        permission = "NO_PERMISSIONS" if status == 403 else _permission(root, user, "registered_model", registry.name)
        if permission in READ_ONLY:
            problems.append(
                Problem(
                    ("stages", i, "registry", "name"),
                    f"{_who(user)} has {permission} permission on the registered model {registry.name!r} at "
                    f"{root}; adding a version and moving its alias {registry.alias!r} needs EDIT, so the "
                    "push would fail after every stage before it had trained",
                    _grant_hint(root, user, "registered_model", registry.name, "register under a new `name`"),
                )
            )
    return problems


def _unauthenticated(root: str) -> Problem:
    creds = credentials_sent(root)
    if creds.username or creds.token:
        return Problem(
            ("tracking", "uri"),
            f"the MLflow server {root} refused {whose(creds)}",
            "check MLFLOW_TRACKING_USERNAME and MLFLOW_TRACKING_PASSWORD (or MLFLOW_TRACKING_TOKEN) in this "
            "environment; an MLflow admin can reset a password with "
            f"`AuthServiceClient({root!r}).update_user_password(user, new_password)` "
            "(`from mlflow.server.auth.client import AuthServiceClient`)",
        )
    return Problem(
        ("tracking", "uri"),
        f"the MLflow server {root} asks for credentials, and none are set here",
        "set MLFLOW_TRACKING_USERNAME and MLFLOW_TRACKING_PASSWORD (or MLFLOW_TRACKING_TOKEN) in the environment of "
        "the machine that runs the flow and of each pool's workers; never in the recipe",
    )


def _grant_hint(root: str, user: str | None, resource_type: str, resource_id: str, instead: str) -> str:
    return (
        f"an MLflow admin or its owner grants it with `AuthServiceClient({root!r}).grant_user_permission("
        f"{user or 'USER'!r}, {resource_type!r}, {resource_id!r}, 'EDIT')` (`from mlflow.server.auth.client import "
        f"AuthServiceClient`); or {instead}"
    )


def _who(user: str | None) -> str:
    return f"the MLflow user {user!r}" if user else "the credentials set here"


def _permission(root: str, user: str | None, resource_type: str, resource_id: str) -> str | None:
    """`user`'s effective permission on one resource (READ, EDIT, ...), where the server says."""
    if not user:
        return None
    status, body = _ask(
        root,
        "/api/3.0/mlflow/users/permissions/get",
        username=user,
        resource_type=resource_type,
        resource_id=resource_id,
    )
    permission = body.get("permission") if status == 200 else None
    return permission if isinstance(permission, str) else None


def _current_user(root: str) -> str | None:
    """The user the server takes these credentials for; None where it has no auth API or no user."""
    status, body = _ask(root, "/api/2.0/mlflow/users/current")
    user = body.get("user") if status == 200 else None
    return str(user["username"]) if isinstance(user, dict) and user.get("username") else None


def _ask(root: str, endpoint: str, **params: str) -> tuple[int | None, dict]:
    """(status, JSON body) of one GET, as MLflow's client sends it (auth, TLS settings), without retries; status
    None where the server did not answer."""
    from mlflow.utils.rest_utils import http_request

    try:
        with _insecure_is_chosen():
            response = http_request(
                credentials_sent(root),
                endpoint,
                "GET",
                max_retries=0,
                backoff_factor=0,
                timeout=TIMEOUT_S,
                raise_on_status=False,
                params=params,
            )
    except Exception:  # a check that cannot ask leaves the question to the run
        return None, {}
    try:
        body = response.json()
    except ValueError:
        body = {}
    return response.status_code, body if isinstance(body, dict) else {}
