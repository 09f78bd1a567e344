"""Metrics and artifacts. Trainers log to a `Tracker`; stages hand them an `MlflowTracker`
(a nested child run of the pipeline's parent run), tests a plain in-memory `Tracker`.

Only rank 0 logs: other ranks get a `Tracker` that keeps history but sends nothing.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import tempfile
from pathlib import Path
from typing import Any

SECRET_ENV = (
    "HF_TOKEN",
    "HUGGING_FACE_HUB_TOKEN",
    "MLFLOW_TRACKING_PASSWORD",
    "MLFLOW_TRACKING_TOKEN",
    "PREFECT_API_AUTH_STRING",
    "PREFECT_API_KEY",
)
# A key is secret when its last component *is* or *ends in* a secret word (hf_token, api_key, password,
# token_secret), not when it merely contains one: max_new_tokens, logprob_chunk_tokens and tokenizer are
# hyperparameters, and a tokenizer's special tokens (pad_token, ...) are not credentials.
_SECRET_KEY = re.compile(r"(^|[_-])(token|password|passwd|secret|api[_-]?key|access[_-]?key|credentials?)$", re.I)
_SPECIAL_TOKEN = re.compile(r"^(pad|eos|bos|unk|sep|cls|mask)_token$", re.I)


def is_secret_key(key: str) -> bool:
    last = key.rsplit(".", 1)[-1]
    return bool(_SECRET_KEY.search(last)) and not _SPECIAL_TOKEN.match(last)


def redact(params: dict[str, Any]) -> dict[str, Any]:
    """Drop values whose key names a secret and any value equal to a secret in the environment."""
    secrets = {os.environ[k] for k in SECRET_ENV if os.environ.get(k)}
    out = {}
    for k, v in params.items():
        if is_secret_key(k) or str(v) in secrets:
            out[k] = "***"
        else:
            out[k] = v
    return out


def flatten(d: dict, prefix: str = "") -> dict[str, Any]:
    """`{"a": {"b": 1}}` → `{"a.b": 1}` (lists become JSON strings)."""
    out: dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(flatten(v, key + "."))
        elif isinstance(v, (list, tuple)):
            out[key] = json.dumps(v)
        else:
            out[key] = v
    return out


class Tracker:
    """In-memory tracker: records every metric, so trainers and tests need no MLflow."""

    def __init__(self):
        self.history: list[tuple[int, dict[str, float]]] = []
        self.params: dict[str, Any] = {}
        self.tables: dict[str, list[dict]] = {}

    def log_params(self, params: dict[str, Any]) -> None:
        self.params.update(redact(flatten(params)))

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        clean = {k: float(v) for k, v in metrics.items() if v is not None and math.isfinite(float(v))}
        self.history.append((step, clean))

    def log_table(self, rows: list[dict], name: str) -> None:
        self.tables[name] = rows

    def log_artifact(self, path: str | Path, artifact_path: str | None = None) -> None:
        pass

    def log_figure(self, figure, name: str) -> None:
        pass

    def set_tags(self, tags: dict[str, str]) -> None:
        pass

    def series(self, key: str) -> list[float]:
        """All logged values of one metric, in order."""
        return [m[key] for _, m in self.history if key in m]

    def last(self, key: str) -> float | None:
        values = self.series(key)
        return values[-1] if values else None


class TrackingRefused(RuntimeError):
    """The MLflow server refused this machine's credentials (401) or this user's permission (403)."""


def refusal(error: BaseException, tracking_uri: str, where: str) -> TrackingRefused | None:
    """A `TrackingRefused` saying what to set, for an MlflowException that is a 401 or 403 from the server; else None.
    `where` names the machine and what it was doing (a pool worker lacking the credentials the pipeline's machine
    was checked with, most often)."""
    from mlflow.exceptions import MlflowException

    code = getattr(error, "error_code", None) if isinstance(error, MlflowException) else None
    if code == "UNAUTHENTICATED":
        return TrackingRefused(
            f"the MLflow server {tracking_uri} refused {whose(credentials_sent(tracking_uri))} {where}; set "
            "MLFLOW_TRACKING_USERNAME and MLFLOW_TRACKING_PASSWORD (or MLFLOW_TRACKING_TOKEN) in this machine's "
            "environment (a pool's workers need them as the machine that starts the pipeline does)"
        )
    if code == "PERMISSION_DENIED":
        user = credentials_sent(tracking_uri).username
        return TrackingRefused(
            f"the MLflow server {tracking_uri} does not let {f'the user {user!r}' if user else 'these credentials'} "
            f"write {where}; set this machine's MLFLOW_TRACKING_USERNAME/PASSWORD to the user the pipeline runs as, "
            "or have an admin grant this one EDIT on the experiment"
        )
    return None


def credentials_sent(uri: str):
    """The credentials MLflow's client sends to `uri`, read where it reads them (MLFLOW_TRACKING_USERNAME and
    MLFLOW_TRACKING_PASSWORD, MLFLOW_TRACKING_TOKEN, `~/.mlflow/credentials`)."""
    from mlflow.utils.credentials import get_default_host_creds

    return get_default_host_creds(uri)


def whose(creds) -> str:
    """`credentials_sent`'s answer in words, for a refusal's message; never the secret itself."""
    if creds.username:
        return f"the credentials of the user {creds.username!r}"
    if creds.token:
        return "the token in MLFLOW_TRACKING_TOKEN"
    return "a client with no credentials"


class MlflowTracker(Tracker):
    """Sends everything to one MLflow run (created as a child of `parent_run_id`)."""

    def __init__(self, tracking_uri: str, run_id: str):
        super().__init__()
        from mlflow.tracking import MlflowClient

        self.client = MlflowClient(tracking_uri)
        self.run_id = run_id

    @classmethod
    def start(
        cls,
        tracking_uri: str,
        experiment_id: str,
        run_name: str,
        parent_run_id: str | None = None,
        tags: dict[str, str] | None = None,
    ) -> MlflowTracker:
        from mlflow.tracking import MlflowClient

        all_tags = dict(tags or {})
        if parent_run_id:
            all_tags["mlflow.parentRunId"] = parent_run_id
        run = MlflowClient(tracking_uri).create_run(experiment_id, run_name=run_name, tags=all_tags)
        return cls(tracking_uri, run.info.run_id)

    def log_params(self, params: dict[str, Any]) -> None:
        from mlflow.entities import Param

        clean = redact(flatten(params))
        self.params.update(clean)
        items = [Param(k, str(v)[:6000]) for k, v in clean.items()]
        for i in range(0, len(items), 100):
            self.client.log_batch(self.run_id, params=items[i : i + 100])

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        import time

        from mlflow.entities import Metric

        super().log_metrics(metrics, step)
        now = int(time.time() * 1000)
        _, clean = self.history[-1]
        if clean:
            self.client.log_batch(self.run_id, metrics=[Metric(k, v, now, step) for k, v in clean.items()])

    def log_table(self, rows: list[dict], name: str) -> None:
        super().log_table(rows, name)
        if rows:
            self.client.log_table(
                self.run_id, data={k: [r.get(k) for r in rows] for k in rows[0]}, artifact_file=f"{name}.json"
            )

    def log_artifact(self, path: str | Path, artifact_path: str | None = None) -> None:
        path = Path(path)
        if path.is_dir():
            self.client.log_artifacts(self.run_id, str(path), artifact_path)
        else:
            self.client.log_artifact(self.run_id, str(path), artifact_path)

    def log_figure(self, figure, name: str) -> None:
        self.client.log_figure(self.run_id, figure, name)

    def set_tags(self, tags: dict[str, str]) -> None:
        for k, v in tags.items():
            self.client.set_tag(self.run_id, k, v)

    def log_text(self, text: str, name: str) -> None:
        with tempfile.TemporaryDirectory() as d:
            p = Path(d) / name
            p.write_text(text)
            self.client.log_artifact(self.run_id, str(p))

    def end(self, status: str = "FINISHED") -> None:
        self.client.set_terminated(self.run_id, status=status)


# MLflow 3's UI opens an experiment without this tag in its GenAI (traces) view; these are training runs.
EXPERIMENT_KIND, MODEL_TRAINING = "mlflow.experimentKind", "custom_model_development"


def ensure_experiment(tracking_uri: str, name: str, artifact_root: Path | None = None) -> str:
    """The id of experiment `name`, created (with artifacts under `artifact_root` for local stores)."""
    from mlflow.tracking import MlflowClient

    from alignpipe.locks import file_lock

    # Two runs starting together on a fresh SQLite store would both create its tables (and race on the schema
    # migration: "duplicate column name"), then both create the experiment: one at a time.
    local_db = tracking_uri[len("sqlite:///") :] if tracking_uri.startswith("sqlite:///") else None
    with file_lock(local_db + ".lock") if local_db else contextlib.nullcontext():
        client = MlflowClient(tracking_uri)
        client.search_experiments(max_results=1)  # creates and migrates the store now, under the lock
        exp = client.get_experiment_by_name(name)
        if exp is not None:
            if EXPERIMENT_KIND not in exp.tags:
                client.set_experiment_tag(exp.experiment_id, EXPERIMENT_KIND, MODEL_TRAINING)
            return exp.experiment_id
        location = artifact_root.resolve().as_uri() if artifact_root and not tracking_uri.startswith("http") else None
        return client.create_experiment(name, artifact_location=location, tags={EXPERIMENT_KIND: MODEL_TRAINING})
