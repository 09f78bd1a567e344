"""The pipelines against an MLflow server that asks for a password (`infra/mlflow/start-server.sh DIR PORT
basic-auth`, MLflow's basic-auth app): the demo records through it with MLFLOW_TRACKING_USERNAME/PASSWORD the same
parent and child runs, metrics, artifacts (through the server, into its artifact folder, none in the workdir) and
registered model as to the default SQLite store, the password reaching no parameter, tag, artifact, log or Prefect
parameter; and what the server would refuse (no
credentials, a wrong password, a user who may only read the experiment or the registered model) is a problem of the
recipe before the run, its fix a grant that works when run as written."""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from mlflow.exceptions import MlflowException
from mlflow.server.auth.client import AuthServiceClient
from mlflow.tracking import MlflowClient
from support import demo_on_mlflow_server, demo_recipe, known, sft_spec_after_format, start_service, stop_service

from alignpipe.launch import free_port
from alignpipe.recipe import RecipeError, parse_recipe

REPO = Path(__file__).resolve().parents[1]
ADMIN = ("admin", "admin-pw-5f3a9c1e")
RUNNER = ("alice", "alice-pw-8d2b7e4f")  # the pipelines' user
READER = ("bob", "bob-pw-1c6e0a9d")  # a colleague: reads what others made, writes what he creates


@pytest.fixture(scope="module")
def auth_server(tmp_path_factory):
    """The server as the script starts it, with the runner and the reader made by the admin; its URL and folder."""
    root = tmp_path_factory.mktemp("mlflow-auth")
    port = free_port()
    env = {
        **os.environ,
        "MLFLOW_AUTH_ADMIN_PASSWORD": ADMIN[1],
        "MLFLOW_FLASK_SERVER_SECRET_KEY": "tests-csrf-key",
    }
    if (REPO / ".venv").is_dir():
        env["VENV"] = str(REPO / ".venv")
    proc = start_service(
        ["bash", "infra/mlflow/start-server.sh", str(root), str(port), "basic-auth"],
        root / "server.log",
        f"http://127.0.0.1:{port}/health",
        env=env,
        cwd=REPO,
        timeout_s=180,
    )
    url = f"http://127.0.0.1:{port}"
    with as_user(*ADMIN):
        admin = AuthServiceClient(url)
        for name, password in (RUNNER, READER):
            admin.create_user(name, password)
    yield url, root
    stop_service(proc)


@contextlib.contextmanager
def as_user(name: str | None, password: str | None):
    """MLFLOW_TRACKING_USERNAME/PASSWORD set for the block (unset for `as_user(None, None)`), as before after it."""
    with pytest.MonkeyPatch.context() as mp:
        for var, value in (("MLFLOW_TRACKING_USERNAME", name), ("MLFLOW_TRACKING_PASSWORD", password)):
            if value is None:
                mp.delenv(var, raising=False)
            else:
                mp.setenv(var, value)
        yield


def test_the_demo_records_through_basic_auth_and_the_password_goes_nowhere(
    prefect_harness, tiny, tmp_path, auth_server, capfd
):
    from prefect import get_client

    url, server_root = auth_server
    with as_user(*RUNNER):
        state, client, parent = demo_on_mlflow_server(
            tiny, tmp_path, url, "tracking.experiment=auth-demo", "stages.publish.registry.name=auth-demo-sft"
        )
        runs = client.search_runs([parent.info.experiment_id])
        assert parent.info.status == "FINISHED" and parent.data.params["name"] == "tiny-demo"
        children = {c.data.tags["alignpipe.stage_id"]: c for c in runs if c.info.run_id != parent.info.run_id}
        assert set(children) == {"sft-data", "eval-prompts", "sft", "judge", "publish"}
        assert all(c.info.status == "FINISHED" for c in children.values())
        assert all(c.data.tags["mlflow.parentRunId"] == parent.info.run_id for c in children.values())
        losses = client.get_metric_history(children["sft"].info.run_id, "train/loss")
        assert len(losses) >= 2 and losses[-1].value < losses[0].value
        assert parent.data.metrics["judge/win_rate"] == children["judge"].data.metrics["judge/win_rate"]
        champion = client.get_model_version_by_alias("auth-demo-sft", "champion")
        assert champion.run_id == children["publish"].info.run_id
        recorded = [str(r.data.params) + str(r.data.tags) for r in runs]
        for run in runs:
            client.download_artifacts(run.info.run_id, "", str(tmp_path / "dl" / run.info.run_id))

    flow_run_id = known(state.state_details.flow_run_id)

    async def parameters() -> str:
        async with get_client() as prefect:
            return str((await prefect.read_flow_run(flow_run_id)).parameters)

    recorded.append(asyncio.run(parameters()))
    out, err = capfd.readouterr()
    recorded += [out, err]
    password = RUNNER[1].encode()
    files = [
        p
        for folder in (tmp_path / "dl", tmp_path / "runs", server_root / "mlartifacts")
        for p in folder.rglob("*")
        if p.is_file()
    ]
    assert any(p.name == "recipe.resolved.yaml" for p in files) and len(files) > 20
    # artifacts went through the server into its own folder; the client's workdir holds none, nor an MLflow store
    sft_png = tmp_path / "dl" / children["sft"].info.run_id / "loss_curve.png"
    assert sft_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert list((server_root / "mlartifacts").rglob("loss_curve.png")), "stored where the server keeps artifacts"
    assert not (tmp_path / "runs" / "mlartifacts").exists() and not (tmp_path / "runs" / "mlflow.db").exists()
    leaks = [str(p) for p in files if password in p.read_bytes()]
    leaks += [text[:80] for text in recorded if RUNNER[1] in text]
    assert not leaks, leaks


def test_what_the_server_would_refuse_is_said_before_the_run(demo_text, auth_server):
    url, _ = auth_server
    shared = ["tracking.experiment=shared", "stages.publish.registry.name=shared-sft", f"tracking.uri={url}"]
    with as_user(*RUNNER):  # the runner owns an experiment and a registered model
        experiment_id = MlflowClient(url).create_experiment("shared")
        MlflowClient(url).create_registered_model("shared-sft")

    def problems(user, password) -> list:
        with as_user(user, password):
            try:
                parse_recipe(demo_text, shared, to_run=True)
            except RecipeError as e:
                return e.problems
        return []

    (none,) = problems(None, None)
    assert none.path == ("tracking", "uri") and "asks for credentials, and none are set here" in none.message
    assert "MLFLOW_TRACKING_USERNAME and MLFLOW_TRACKING_PASSWORD" in none.hint

    (wrong,) = problems(READER[0], "not-" + READER[1])
    assert wrong.path == ("tracking", "uri") and "refused the credentials of the user 'bob'" in wrong.message
    assert READER[1] not in wrong.message + wrong.hint

    assert problems(*RUNNER) == [], "the owner may write both"
    exp, model = problems(*READER)
    assert exp.path == ("tracking", "experiment"), exp
    assert f"'bob' has READ permission on the MLflow experiment 'shared' (id {experiment_id})" in exp.message
    assert model.path == ("stages", 4, "registry", "name") and "'bob' has READ permission on the registered model" in (
        model.message
    )
    with as_user(*READER), pytest.raises(MlflowException, match="403"):  # what the run would have met
        MlflowClient(url).create_run(experiment_id)

    # each fix is a call an admin runs as written
    for problem in (exp, model):
        (call,) = re.findall(r"`(AuthServiceClient\(.*?\)\.grant_user_permission\(.*?\))`", problem.hint)
        with as_user(*ADMIN):
            eval(call, {"AuthServiceClient": AuthServiceClient})
    assert problems(*READER) == []
    with as_user(*READER):
        MlflowClient(url).create_run(experiment_id)


def test_a_stage_on_a_machine_without_the_credentials_says_what_to_set(tiny, tmp_path, auth_server):
    """The checks before a run ask from the machine that starts it; a pool's worker without the credentials meets the
    server when its stage opens its MLflow run: one line saying what to set there, not MLflow's traceback."""
    url, _ = auth_server
    recipe = parse_recipe(
        demo_recipe(tiny, tmp_path / "runs"), [f"tracking.uri={url}", "tracking.experiment=worker-creds"]
    )
    with as_user(*RUNNER):  # the pipeline's machine holds them: its format stage ran
        _plans, spec, _tracking = sft_spec_after_format(recipe)
    for user, said in ((None, "refused a client with no credentials"), (READER, "does not let the user 'bob' write")):
        with as_user(*(user or (None, None))):
            out = subprocess.run(
                [sys.executable, "-m", "alignpipe.stage", str(spec)], capture_output=True, text=True, timeout=300
            )
        text = out.stdout + out.stderr
        assert out.returncode == 1, text[-3000:]
        assert f"stage sft failed: the MLflow server {url} {said}" in text, text[-3000:]
        assert "when stage 'sft' opened its run on" in text and "Traceback" not in text, text[-3000:]
        assert READER[1] not in text
