"""The demo recipe as a Prefect flow (test harness): MLflow parent + one FINISHED child per stage,
a model card from the local push, re-runs that reuse finished stages, and resume after a failure."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from alignpipe.manifest import Manifest
from alignpipe.recipe import load_recipe

FAST = ["stages.sft.max_steps=60", "stages.sft.eval_every=null", "stages.judge.num_prompts=32"]


def run_flow(recipe_path: Path, overrides=(), force=()):
    from flows.pipeline import pipeline

    return pipeline(recipe_path=str(recipe_path), overrides=list(overrides), force=list(force), return_state=True)


def summary_of(recipe_path: Path, state, overrides=()) -> dict:
    recipe = load_recipe(recipe_path, list(overrides))
    return json.loads((recipe.run_root / "runs" / f"{state.state_details.flow_run_id}.json").read_text())


@pytest.fixture(scope="module")
def demo_run(prefect_harness, tiny, tmp_path_factory):
    from conftest import demo_recipe

    root = tmp_path_factory.mktemp("demo")
    path = root / "tiny-demo.yaml"
    path.write_text(demo_recipe(tiny, root / "runs"))
    state = run_flow(path, FAST)
    return path, state


def test_demo_flow_completes_with_mlflow_parent_and_children(demo_run):
    path, state = demo_run
    assert state.is_completed(), state.message
    summary = summary_of(path, state, FAST)
    assert [s["status"] for s in summary["stages"]] == ["done"] * 5
    recipe = load_recipe(path, FAST)
    client = MlflowClient(recipe.tracking_uri)
    parent = client.get_run(summary["mlflow_run_id"])
    assert parent.info.status == "FINISHED"
    assert parent.data.params["recipe_hash"] == recipe.fingerprint()
    assert parent.data.params["seed"] == "0" and parent.data.params["name"] == "tiny-demo"
    assert "recipe.resolved.yaml" in [a.path for a in client.list_artifacts(parent.info.run_id)]
    exp = client.get_experiment_by_name("tiny-demo")
    children = client.search_runs([exp.experiment_id], f"tags.mlflow.parentRunId = '{parent.info.run_id}'")
    assert sorted(c.data.tags["alignpipe.stage_id"] for c in children) == sorted(s.id for s in recipe.stages)
    assert all(c.info.status == "FINISHED" for c in children)
    sft_run = next(c for c in children if c.data.tags["alignpipe.stage_id"] == "sft")
    assert sft_run.data.params["sft.learning_rate"] == "0.001"
    losses = client.get_metric_history(sft_run.info.run_id, "train/loss")
    assert len(losses) >= 5 and losses[-1].value < losses[0].value
    assert {"train/lr", "train/grad_norm", "train/tokens_per_s", "eval/loss"} <= set(sft_run.data.metrics)
    sft_artifacts = [a.path for a in client.list_artifacts(sft_run.info.run_id)]
    assert "loss_curve.png" in sft_artifacts
    judge_run = next(c for c in children if c.data.tags["alignpipe.stage_id"] == "judge")
    assert 0.0 <= judge_run.data.metrics["judge/win_rate"] <= 1.0
    assert {"win_rate.png", "judged_examples.json"} <= {a.path for a in client.list_artifacts(judge_run.info.run_id)}


def test_local_push_writes_model_and_card_with_lineage(demo_run):
    path, state = demo_run
    recipe = load_recipe(path, FAST)
    published = recipe.run_root / "published" / "publish"
    assert (published / "model.safetensors").exists() and (published / "tokenizer.json").exists()
    card = (published / "README.md").read_text()
    fmt = Manifest.read(next((recipe.run_root / "stages").glob("sft-data-*")))
    sft = Manifest.read(next((recipe.run_root / "stages").glob("sft-*[0-9a-f]")))
    assert card.startswith("---\nlicense: apache-2.0\nbase_model: " + recipe.model.path)
    assert fmt.info["fingerprint"] in card
    assert "eval/loss" in card and f"{sft.metrics['eval/loss']:.4g}" in card
    assert "Judged win rates" in card and recipe.fingerprint() in card
    assert summary_of(path, state, FAST)["mlflow_run_id"] in card


def test_rerun_reuses_every_finished_stage(demo_run):
    path, _ = demo_run
    state = run_flow(path, FAST)
    assert state.is_completed()
    assert [s["status"] for s in summary_of(path, state, FAST)["stages"]] == ["cached"] * 5


def test_failed_stage_keeps_upstream_and_rerun_resumes(demo_run):
    """A judge whose reward function does not import fails; format and SFT stay finished; fixing the
    recipe re-runs only judge and publish."""
    path, _ = demo_run
    broken = FAST + ["stages.judge.reward=no_such_module:score"]
    state = run_flow(path, broken)
    assert state.is_failed()
    statuses = {s["stage_id"]: s["status"] for s in summary_of(path, state, broken)["stages"]}
    assert statuses == {"sft-data": "cached", "eval-prompts": "cached", "sft": "cached", "judge": "failed", "publish": "not run"}
    fixed = FAST + ["stages.judge.reward=alignpipe.judges.rewards:sentiment_lexicon"]
    state = run_flow(path, fixed)
    statuses = {s["stage_id"]: s["status"] for s in summary_of(path, state, fixed)["stages"]}
    assert statuses == {"sft-data": "cached", "eval-prompts": "cached", "sft": "cached", "judge": "done", "publish": "done"}


def test_force_reruns_one_stage(demo_run):
    path, _ = demo_run
    state = run_flow(path, FAST, force=["eval-prompts"])
    statuses = {s["stage_id"]: s["status"] for s in summary_of(path, state, FAST)["stages"]}
    assert statuses["eval-prompts"] == "done" and statuses["sft"] == "cached"
