"""The demo recorded to a real `mlflow server`, started as a user starts it (`infra/mlflow/start-server.sh`):
`tracking.uri: http://...` gives the same parent and child runs, metrics, artifacts (through the server, into its
artifact folder, none in the workdir) and registered model as the default SQLite store; and a tracking server that
does not answer is a problem of the recipe before the run, not minutes of MLflow's retries."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from support import demo_on_mlflow_server, start_service, stop_service

from alignpipe.launch import free_port
from alignpipe.recipe import RecipeError, parse_recipe, tracking_server

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def mlflow_server(tmp_path_factory):
    """`infra/mlflow/start-server.sh DIR PORT` from the repository, as the README says; its URL and folder."""
    root = tmp_path_factory.mktemp("mlflow-server")
    port = free_port()
    env = {**os.environ, "VENV": str(REPO / ".venv")} if (REPO / ".venv").is_dir() else dict(os.environ)
    proc = start_service(
        ["bash", "infra/mlflow/start-server.sh", str(root), str(port)],
        root / "server.log",
        f"http://127.0.0.1:{port}/health",
        env=env,
        cwd=REPO,
        timeout_s=180,
    )
    yield f"http://127.0.0.1:{port}", root
    stop_service(proc)


def test_the_demo_records_to_a_running_mlflow_server(prefect_harness, tiny, tmp_path, mlflow_server):
    url, server_root = mlflow_server
    _state, client, parent = demo_on_mlflow_server(tiny, tmp_path, url)
    assert parent.info.status == "FINISHED" and parent.data.params["name"] == "tiny-demo"
    children = {
        c.data.tags["alignpipe.stage_id"]: c
        for c in client.search_runs([parent.info.experiment_id], f"tags.mlflow.parentRunId = '{parent.info.run_id}'")
    }
    assert set(children) == {"sft-data", "eval-prompts", "sft", "judge", "publish"}
    assert all(c.info.status == "FINISHED" for c in children.values())
    losses = client.get_metric_history(children["sft"].info.run_id, "train/loss")
    assert len(losses) >= 2 and losses[-1].value < losses[0].value
    assert parent.data.metrics["judge/win_rate"] == children["judge"].data.metrics["judge/win_rate"]
    # artifacts go through the server into its own folder; the client's workdir holds none
    assert "loss_curve.png" in [a.path for a in client.list_artifacts(children["sft"].info.run_id)]
    local = client.download_artifacts(children["sft"].info.run_id, "loss_curve.png", str(tmp_path / "dl"))
    assert Path(local).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert list((server_root / "mlartifacts").rglob("loss_curve.png")), "stored where the server keeps artifacts"
    assert not (tmp_path / "runs" / "mlartifacts").exists() and not (tmp_path / "runs" / "mlflow.db").exists()
    champion = client.get_model_version_by_alias("tiny-demo-sft", "champion")
    assert champion.run_id == children["publish"].info.run_id


def test_a_tracking_server_that_does_not_answer_is_refused_before_the_run(demo_text, mlflow_server):
    url, _ = mlflow_server
    tracking_server._health.cache_clear()
    parse_recipe(demo_text, [f"tracking.uri={url}"], to_run=True)  # it answers
    parse_recipe(demo_text, [f"tracking.uri={url}/"], to_run=True)
    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    with pytest.raises(RecipeError) as e:
        parse_recipe(demo_text, [f"tracking.uri={dead}"], to_run=True)
    (problem,) = e.value.problems
    assert problem.path == ("tracking", "uri") and "does not answer (ConnectError" in problem.message, problem
    assert "remove `tracking.uri`" in problem.hint
    with pytest.raises(RecipeError) as e:  # credentials belong in the environment: the recipe is logged
        parse_recipe(demo_text, [f"tracking.uri=http://user:hunter2@{dead[len('http://') :]}"])
    (problem,) = e.value.problems
    assert "holds credentials" in problem.message and "MLFLOW_TRACKING_PASSWORD" in problem.message
    assert "hunter2" not in str(e.value), "the refused value is not repeated"
    parse_recipe(demo_text, [f"tracking.uri={dead}"])  # `show` does not ask
    parse_recipe(demo_text, ["tracking.uri=databricks"], to_run=True)  # not HTTP: not asked
