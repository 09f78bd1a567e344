"""`resources.processes: 2` runs a stage as two data-parallel ranks (gloo on CPU): the same global batch
gives the same loss curve as one process within tolerance, and only rank 0 logs and writes outputs."""

from __future__ import annotations

import pytest
from mlflow.tracking import MlflowClient

from alignpipe.launch import launch
from alignpipe.pipeline_run import start_pipeline_run
from alignpipe.plan import plan, write_spec
from alignpipe.recipe import parse_recipe


def run_stage(tiny, tmp_path, text_fn, stage: str, processes: int, overrides: list[str]):
    """Run `stage` with `processes` ranks after its ancestors; both runs of a test share one workdir, so the
    ancestors (same config, same cache key) are trained once and reused."""
    recipe = parse_recipe(text_fn(tiny, tmp_path / "runs"), overrides)
    plans = plan(recipe)
    tracking = start_pipeline_run(recipe, f"p{processes}")
    done = {}
    for sid in recipe.ancestors(stage):
        inputs = {a: done[a] for a in recipe.ancestors(sid)}
        done[sid] = (
            plans[sid].manifest
            if plans[sid].cached
            else launch(write_spec(recipe, plans[sid], inputs, tracking, "x"), on_line=lambda line: None)
        )
    spec = write_spec(recipe, plans[stage], {a: done[a] for a in recipe.ancestors(stage)}, tracking, "x")
    manifest = launch(spec, on_line=lambda line: None, processes=processes)
    client = MlflowClient(recipe.tracking_uri)
    runs = client.search_runs(
        [tracking[1]], f"tags.`alignpipe.stage_id` = '{stage}' and tags.mlflow.parentRunId = '{tracking[2]}'"
    )
    losses = [m.value for m in client.get_metric_history(runs[0].info.run_id, "train/loss")]
    return manifest, runs, losses


def demo(tiny, workdir):
    from support import demo_recipe

    return demo_recipe(tiny, workdir)


def dpo(tiny, workdir):
    from pathlib import Path

    text = (Path(__file__).parents[1] / "pipelines" / "tiny-dpo.yaml").read_text()
    return text.replace("assets/tiny", str(tiny)).replace("./runs", str(workdir))


@pytest.mark.parametrize(
    "text_fn,stage,per_process",
    [
        (demo, "sft", ["stages.sft.max_steps=30", "stages.sft.logging_every=5", "stages.sft.eval_every=null"]),
        (dpo, "dpo", ["stages.sft.max_steps=10", "stages.dpo.max_steps=12", "stages.dpo.logging_every=3"]),
    ],
)
def test_two_processes_match_one_process(tiny, tmp_path, text_fn, stage, per_process):
    one, _, single = run_stage(tiny, tmp_path, text_fn, stage, 1, per_process + [f"stages.{stage}.batch_size=16"])
    two, runs, double = run_stage(
        tiny,
        tmp_path,
        text_fn,
        stage,
        2,
        per_process + [f"stages.{stage}.batch_size=8", f"stages.{stage}.resources.processes=2"],
    )
    print(stage, "1 process:", [round(x, 3) for x in single], "2 processes:", [round(x, 3) for x in double])
    assert len(single) == len(double)
    assert all(abs(a - b) <= 0.15 * max(abs(a), 0.05) for a, b in zip(single, double)), (single, double)
    assert len(runs) == 1, "only rank 0 opened an MLflow run"
    assert two.metrics["steps"] == one.metrics["steps"]
