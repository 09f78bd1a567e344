"""The demo recipe as a Prefect flow (test harness): MLflow parent + one FINISHED child per stage,
a model card from the local push, re-runs that reuse finished stages, and resume after a failure."""

from __future__ import annotations

import json
import logging
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest
from mlflow.tracking import MlflowClient
from support import experiment_id

from alignpipe.launch import LOGGED_ABOVE
from alignpipe.manifest import Manifest
from alignpipe.recipe import load_recipe

# the machine sampled twice a second, so a stage of a few seconds logs some
FAST = [
    "stages.sft.max_steps=100",
    "stages.sft.eval_every=null",
    "stages.judge.num_prompts=64",
    "tracking.system_metrics_every=0.5",
    "stages.judge.resources.tags=[llm-judge]",  # outside the cache key
]


def run_flow(recipe_path: Path, overrides=(), force=()):
    from flows.pipeline import pipeline

    return pipeline(recipe_path=str(recipe_path), overrides=list(overrides), force=list(force), return_state=True)


def _when(t: datetime | None) -> datetime:
    """A Prefect object's timestamp (`created`, `start_time`), which the server has set on every one read here."""
    assert t is not None
    return t


def summary_of(recipe_path: Path, state, overrides=()) -> dict:
    recipe = load_recipe(recipe_path, list(overrides))
    return json.loads((recipe.run_root / "runs" / f"{state.state_details.flow_run_id}.json").read_text())


@pytest.fixture(scope="module")
def demo_run(prefect_harness, tiny, tmp_path_factory):
    from support import demo_recipe

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
    children = client.search_runs(
        [experiment_id(client, "tiny-demo")], f"tags.mlflow.parentRunId = '{parent.info.run_id}'"
    )
    assert sorted(c.data.tags["alignpipe.stage_id"] for c in children) == sorted(s.id for s in recipe.stages)
    assert all(c.info.status == "FINISHED" for c in children)
    sft_run = next(c for c in children if c.data.tags["alignpipe.stage_id"] == "sft")
    assert sft_run.data.params["sft.learning_rate"] == "0.001"
    losses = client.get_metric_history(sft_run.info.run_id, "train/loss")
    assert len(losses) >= 5 and losses[-1].value < losses[0].value
    assert {"train/lr", "train/grad_norm", "train/tokens_per_s", "eval/loss"} <= set(sft_run.data.metrics)
    # the machine beside the curves (a GPU's utilisation too, where NVML finds one)
    assert {"system/cpu_utilization_percentage", "system/system_memory_usage_megabytes"} <= set(sft_run.data.metrics)
    sft_artifacts = [a.path for a in client.list_artifacts(sft_run.info.run_id)]
    assert "loss_curve.png" in sft_artifacts and "samples.json" in sft_artifacts
    judge_run = next(c for c in children if c.data.tags["alignpipe.stage_id"] == "judge")
    m = judge_run.data.metrics
    n = m["judge/wins"] + m["judge/ties"] + m["judge/losses"]
    assert n == 64 and m["judge/win_rate"] == pytest.approx((m["judge/wins"] + 0.5 * m["judge/ties"]) / n)
    assert m["judge/ci_low"] <= m["judge/win_rate"] <= m["judge/ci_high"]
    assert {"win_rate.png", "judged_examples.json"} <= {a.path for a in client.list_artifacts(judge_run.info.run_id)}


def test_parent_run_rolls_up_stage_metrics_with_description_and_readable_params(demo_run):
    """What a user compares pipeline runs on, read through MlflowClient: each stage's key metric on the parent run
    under its stage id, the recipe's description as the run's note, and hyperparameters whose names merely contain
    "token" shown, not masked."""
    path, state = demo_run
    summary = summary_of(path, state, FAST)
    recipe = load_recipe(path, FAST)
    client = MlflowClient(recipe.tracking_uri)
    parent = client.get_run(summary["mlflow_run_id"])
    children = {
        c.data.tags["alignpipe.stage_id"]: c
        for c in client.search_runs([parent.info.experiment_id], f"tags.mlflow.parentRunId = '{parent.info.run_id}'")
    }
    metrics = parent.data.metrics
    assert metrics["judge/win_rate"] == children["judge"].data.metrics["judge/win_rate"]
    assert metrics["sft/eval_loss"] == pytest.approx(children["sft"].data.metrics["eval/loss"])
    assert metrics["sft-data/rows_train"] == children["sft-data"].data.metrics["rows_train"]
    assert parent.data.tags["mlflow.note.content"] == "Tiny end-to-end demo on synthetic sentiment data."
    experiment = client.get_experiment(parent.info.experiment_id)
    assert experiment.tags["mlflow.experimentKind"] == "custom_model_development", "opens as model training, not GenAI"
    judge_params = children["judge"].data.params
    assert judge_params["judge.sampling.max_new_tokens"] == "32"
    judge_metrics = children["judge"].data.metrics
    assert not [k for k in judge_metrics if "_vs_" in k], "one pair: its rates are judge/*, not logged twice"


def test_flow_run_is_named_after_the_pipeline_and_its_id(demo_run):
    from prefect.client.orchestration import get_client

    _, state = demo_run
    with get_client(sync_client=True) as client:
        run = client.read_flow_run(state.state_details.flow_run_id)
    assert run.name == f"tiny-demo-{str(run.id)[:8]}"


def test_judge_publishes_prefect_table_and_markdown_artifacts(demo_run):
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey

    _, state = demo_run

    def artifacts(key: str):
        with get_client(sync_client=True) as client:
            return client.read_artifacts(artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=[key])))

    table, report = artifacts("tiny-demo-judge-win-rates"), artifacts("tiny-demo-judge-report")
    assert table and table[0].type == "table" and "win_rate" in str(table[0].data)
    rows = json.loads(table[0].data) if isinstance(table[0].data, str) else table[0].data
    rates = [row["win_rate"] for row in rows]
    assert rates and all(round(r, 3) == r for r in rates), "rates shown to 3 decimals"
    assert report and report[0].type == "markdown" and "| sft | base |" in report[0].data
    link = artifacts("tiny-demo-mlflow-run")
    summary = summary_of(demo_run[0], state, FAST)
    assert link and summary["mlflow_run_id"] in str(link[0].data) and "http://" in str(link[0].data)
    assert "?workflowType=machine_learning" in str(link[0].data), "opens MLflow's model-training view, not GenAI"


def test_a_slow_prefect_api_never_holds_up_the_launcher_reading_the_stage_s_log():
    """`StageProgress` sends from a thread of its own: the launcher's call returns at once however long the API takes,
    reports waiting meanwhile give way to the latest, and leaving the `with` block sends the last one."""
    import logging
    import threading
    import time
    from types import SimpleNamespace

    from tasks.hooks import StageProgress

    sent, api_answers = [], threading.Event()

    def slow_api(report: dict) -> None:
        api_answers.wait(10)
        sent.append(report["n"])

    spec: Any = SimpleNamespace(recipe={"name": "demo"}, stage_id="sft")  # the two fields StageProgress reads
    progress = StageProgress(spec, logging.getLogger("test"))
    assert progress.key == "demo-sft-progress"
    progress._send = slow_api  # type: ignore[method-assign]
    with progress:
        start = time.monotonic()
        for n in range(1, 101):
            progress({"n": n, "total": 100, "desc": "sft", "postfix": ""})
        assert time.monotonic() - start < 1.0
        api_answers.set()
    assert sent[-1] == 100 and len(sent) < 100 and sent == sorted(sent)


def test_the_run_s_summary_table_is_a_prefect_table_artifact_of_its_flow_run(demo_run):
    """What `alignpipe run` prints at the end, for a run launched from Prefect's UI: a row a stage."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey

    path, state = demo_run
    with get_client(sync_client=True) as client:
        found = client.read_artifacts(artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=["tiny-demo-summary"])))
    mine = [a for a in found if a.flow_run_id == state.state_details.flow_run_id]
    assert len(mine) == 1 and mine[0].type == "table" and mine[0].description == "tiny-demo, 5 stages: 5 done"
    rows = json.loads(mine[0].data) if isinstance(mine[0].data, str) else mine[0].data
    assert isinstance(rows, list)
    summary = summary_of(path, state, FAST)
    assert [(r["stage"], r["status"], r["output"]) for r in rows] == [
        (s["stage_id"], s["status"], s["output"]) for s in summary["stages"]
    ]
    judge = next(r for r in rows if r["stage"] == "judge")
    assert judge["key_metric"] == "judge/win_rate" and 0 < judge["value"] <= 1 and judge["mlflow_run"]


def test_each_stage_s_progress_is_a_prefect_progress_artifact_of_its_task_run(demo_run):
    """A run launched from Prefect's UI shows each stage's bar there: a progress artifact of the stage's task run,
    ending at 100% with the bar's last figures; the stage's report lines never reach its log."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey, LogFilter, LogFilterFlowRunId

    _, state = demo_run
    with get_client(sync_client=True) as client:
        keys = ["tiny-demo-sft-progress", "tiny-demo-judge-progress"]
        found = client.read_artifacts(artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=keys)))
        logs = client.read_logs(LogFilter(flow_run_id=LogFilterFlowRunId(any_=[state.state_details.flow_run_id])))
        runs = {a.key: client.read_task_run(a.task_run_id) for a in found if a.task_run_id}
    latest = {a.key: a for a in sorted(found, key=lambda a: _when(a.created))}
    assert sorted(str(k) for k in latest) == sorted(keys)
    sft, judge = latest["tiny-demo-sft-progress"], latest["tiny-demo-judge-progress"]
    assert sft.description is not None and judge.description is not None
    assert sft.type == judge.type == "progress" and float(str(sft.data)) == float(str(judge.data)) == 100.0
    assert sft.description.startswith("sft 100/100 (loss=") and judge.description.endswith(" 64/64"), (sft, judge)
    assert runs[sft.key].name == "sft" and runs[judge.key].name == "judge"
    # tags to find stages by, and for Prefect's tag concurrency limits: `alignpipe`, the kind, the recipe's own
    assert set(runs[sft.key].tags) == {"alignpipe", "sft"}
    assert set(runs[judge.key].tags) == {"alignpipe", "judge", "llm-judge"}
    assert logs and not any("alignpipe-progress" in entry.message for entry in logs)


def test_local_push_writes_model_and_card_with_lineage(demo_run):
    path, state = demo_run
    recipe = load_recipe(path, FAST)
    published = recipe.run_root / "published" / "publish"
    assert (published / "model.safetensors").exists() and (published / "tokenizer.json").exists()
    card = (published / "README.md").read_text()
    manifests = {m.stage_id: m for m in map(Manifest.read, (recipe.run_root / "stages").iterdir()) if m}
    fmt, sft = manifests["sft-data"], manifests["sft"]
    assert card.startswith("---\nlicense: apache-2.0\nbase_model: " + recipe.model.path)
    assert "\n# tiny-demo-sft\n" in card, "titled with the model's registry name, not the stage id"
    client = MlflowClient(recipe.tracking_uri)
    push_run = client.search_runs([experiment_id(client, "tiny-demo")], "tags.`alignpipe.stage_id` = 'publish'")[0]
    shown = Path(client.download_artifacts(push_run.info.run_id, "model_card/README.md")).read_text()
    assert shown.startswith("# tiny-demo-sft\n") and "| license | apache-2.0 |" in shown, "no raw YAML header in MLflow"
    assert fmt.info["fingerprint"] in card
    assert "eval/loss" in card and f"{sft.metrics['eval/loss']:.4g}" in card
    assert "Judged win rates" in card and recipe.fingerprint() in card
    assert summary_of(path, state, FAST)["mlflow_run_id"] in card


def test_rerun_reuses_every_finished_stage(demo_run):
    """Nothing re-runs; the Prefect run still shows every stage, as a Cached task run, and the new MLflow parent run
    carries the stages' key metrics and links to the runs that trained them."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    path, first = demo_run
    state = run_flow(path, FAST)
    assert state.is_completed()
    summary = summary_of(path, state, FAST)
    assert [s["status"] for s in summary["stages"]] == ["cached"] * 5
    with get_client(sync_client=True) as client:
        runs = client.read_task_runs(
            flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[state.state_details.flow_run_id]))
        )
    assert sorted(r.name for r in runs) == sorted(s["stage_id"] for s in summary["stages"])
    assert all(r.state is not None and r.state.is_completed() and r.state.name == "Cached" for r in runs)
    recipe = load_recipe(path, FAST)
    mlflow = MlflowClient(recipe.tracking_uri)
    parent = mlflow.get_run(summary["mlflow_run_id"])
    before = mlflow.get_run(summary_of(path, first, FAST)["mlflow_run_id"])
    assert parent.data.metrics["judge/win_rate"] == before.data.metrics["judge/win_rate"]
    assert parent.data.tags["alignpipe.stage_run.sft"] == before.data.tags["alignpipe.stage_run.sft"]
    sft_run = mlflow.get_run(parent.data.tags["alignpipe.stage_run.sft"])
    assert sft_run.data.tags["alignpipe.stage_id"] == "sft"


def test_task_runs_record_their_upstream_stages(demo_run):
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    _, state = demo_run
    with get_client(sync_client=True) as client:
        runs = client.read_task_runs(
            flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[state.state_details.flow_run_id]))
        )
    by_name = {r.name: r for r in runs}
    ids = {name: str(r.id) for name, r in by_name.items()}

    def parents(name: str) -> set[str]:
        inputs = by_name[name].task_inputs
        return {str(ref_id) for refs in inputs.values() for ref in refs if (ref_id := getattr(ref, "id", None))}

    assert parents("sft") >= {ids["sft-data"]}
    assert parents("judge") >= {ids["sft"], ids["eval-prompts"]}
    assert parents("publish") >= {ids["sft"], ids["judge"]}


def test_failed_stage_keeps_upstream_and_rerun_resumes(demo_run):
    """A judge whose reward function does not import fails; format and SFT stay finished; fixing the
    recipe re-runs only judge and publish."""
    path, _ = demo_run
    broken = FAST + ["stages.judge.reward=no_such_module:score"]
    state = run_flow(path, broken)
    assert state.is_failed()
    # the flow ends Failed with the run's verdict, no exception of its own (whose traceback would be the engine's)
    assert state.message.startswith("stage(s) ['judge'] failed; finished stages are kept and a re-run resumes")
    statuses = {s["stage_id"]: s["status"] for s in summary_of(path, state, broken)["stages"]}
    assert statuses == {
        "sft-data": "cached",
        "eval-prompts": "cached",
        "sft": "cached",
        "judge": "failed",
        "publish": "not run",
    }
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId, ArtifactFilterKey

    with get_client(sync_client=True) as client:  # the failed run's table says which stage failed, and why
        (table,) = client.read_artifacts(
            artifact_filter=ArtifactFilter(
                key=ArtifactFilterKey(any_=["tiny-demo-summary"]),
                flow_run_id=ArtifactFilterFlowRunId(any_=[state.state_details.flow_run_id]),
            )
        )
    assert table.description == "tiny-demo, 5 stages: 3 cached, 1 failed, 1 not run", table.description
    rows = json.loads(table.data) if isinstance(table.data, str) else table.data
    assert isinstance(rows, list)
    failed = next(r for r in rows if r["status"] == "failed")["message"]
    assert "no_such_module" in failed and not failed.endswith("Last output:"), failed
    # the stage's failure and its traceback are errors in the task run's log, where Prefect's level filter finds them
    levels = stage_log_levels(state.state_details.flow_run_id, "[judge] ")
    said = next(text for text in levels if text.startswith("[judge] stage judge failed: "))
    assert levels[said] == logging.ERROR and levels["[judge] Traceback (most recent call last):"] == logging.ERROR
    assert levels[next(text for text in levels if text.startswith("[judge] stage judge (judge) → "))] == logging.INFO
    # the lines were logged as they came: Prefect's own report of the task's exception is its headline only
    (task_message,) = task_run_messages(state.state_details.flow_run_id, "judge")
    assert task_message.endswith(LOGGED_ABOVE) and "Traceback" not in task_message, task_message
    # and its log lines about the exception (a retry's, the last's) carry no traceback: the engine's and launch's
    # frames say nothing
    for line in run_log_lines(state.state_details.flow_run_id, "Task run failed with exception: StageFailed("):
        assert "no_such_module" in line and "Traceback" not in line and "task_engine" not in line, line
    fixed = FAST + ["stages.judge.reward=alignpipe.judges.rewards:sentiment_lexicon"]
    state = run_flow(path, fixed)
    statuses = {s["stage_id"]: s["status"] for s in summary_of(path, state, fixed)["stages"]}
    assert statuses == {
        "sft-data": "cached",
        "eval-prompts": "cached",
        "sft": "cached",
        "judge": "done",
        "publish": "done",
    }


def task_run_messages(flow_run_id, name: str) -> list[str]:
    """The final state's message of each task run `name` of a flow run."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId, TaskRunFilter, TaskRunFilterName

    with get_client(sync_client=True) as client:
        runs = client.read_task_runs(
            flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id])),
            task_run_filter=TaskRunFilter(name=TaskRunFilterName(any_=[name])),
        )
    return [str(run.state.message if run.state else "") for run in runs]


def run_log_lines(flow_run_id, prefix: str) -> list[str]:
    """The lines of a flow run's log (its task runs' included) that start with `prefix`, once one has reached the
    server (the log is sent in batches)."""
    import time

    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId

    with get_client(sync_client=True) as client:
        for _ in range(40):
            logs = client.read_logs(log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=[flow_run_id])))
            found = [log.message for log in logs if log.message.startswith(prefix)]
            if found:
                return found
            time.sleep(0.25)
    raise AssertionError(f"no line starting {prefix!r} in the run's log")


def stage_log_levels(flow_run_id, prefix: str) -> dict[str, int]:
    """The level of each line starting with `prefix` in a flow run's log (its task runs' included), once the run's
    log has reached the server (it is sent in batches)."""
    import time

    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId

    with get_client(sync_client=True) as client:
        for _ in range(40):
            logs = client.read_logs(log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=[flow_run_id])))
            levels = {log.message: log.level for log in logs if log.message.startswith(prefix)}
            if any("Traceback" in text for text in levels):
                return levels
            time.sleep(0.25)
    raise AssertionError(f"no {prefix}traceback in the run's log: {sorted(levels)}")


def test_force_reruns_one_stage(demo_run):
    path, _ = demo_run
    state = run_flow(path, FAST, force=["eval-prompts"])
    statuses = {s["stage_id"]: s["status"] for s in summary_of(path, state, FAST)["stages"]}
    assert statuses["eval-prompts"] == "done" and statuses["sft"] == "cached"


def test_gate_opened_so_publish_registered_the_model_as_champion(demo_run):
    path, _state = demo_run
    recipe = load_recipe(path, FAST)
    client = MlflowClient(recipe.tracking_uri)
    champion = client.get_model_version_by_alias("tiny-demo-sft", "champion")
    assert champion.tags["alignpipe.published"] == str(recipe.run_root / "published" / "publish")
    assert champion.tags["alignpipe.pipeline"] == "tiny-demo" and len(champion.tags["alignpipe.recipe_hash"]) == 16


def test_the_registered_model_loads_with_mlflow_pyfunc_and_generates(demo_run, monkeypatch):
    """What an MLflow user does with a registered model: load it by alias and predict (greedy: equal to the
    published model's own greedy completions). Saving and loading it warn of nothing (no pickled model, a typed
    `predict`, an input example)."""
    import mlflow
    import pandas as pd

    from alignpipe.engine.hf import HFEngine
    from alignpipe.engine.sampling import SamplingParams
    from alignpipe.modeling import load_causal_lm, load_tokenizer

    path, _state = demo_run
    recipe = load_recipe(path, FAST)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", recipe.tracking_uri)
    mlflow.set_tracking_uri(recipe.tracking_uri)
    model = mlflow.pyfunc.load_model("models:/tiny-demo-sft@champion")
    assert [c.type.name for c in model.metadata.signature.inputs.inputs] == ["string"]
    # built by code at load time (nothing unpickled), with an input example for MLflow's UI and serving users
    assert model.metadata.flavors["python_function"]["loader_module"] == "mlflow.pyfunc.loaders.code_model"
    assert model.metadata.saved_input_example_info["artifact_path"] == "input_example.json"
    prompts = ["The film was", "I watched this movie and"]
    got = model.predict(pd.DataFrame({"prompt": prompts}), params={"max_new_tokens": 12})
    published = str(recipe.run_root / "published" / "publish")
    engine = HFEngine(load_causal_lm(published), load_tokenizer(published))
    expected = [
        g.completion for g in engine.generate(prompts, sampling=SamplingParams(max_new_tokens=12, temperature=0))
    ]
    assert list(got) == expected and all(expected)
    assert model.predict(prompts[:1], params={"max_new_tokens": 12}) == expected[:1]


def test_force_publish_moves_the_champion_alias(demo_run):
    path, _ = demo_run
    recipe = load_recipe(path, FAST)
    client = MlflowClient(recipe.tracking_uri)
    before = int(client.get_model_version_by_alias("tiny-demo-sft", "champion").version)
    state = run_flow(path, FAST, force=["publish"])
    assert state.is_completed()
    after = int(client.get_model_version_by_alias("tiny-demo-sft", "champion").version)
    assert after == before + 1


def test_untrained_candidate_fails_the_gate_and_publish_is_skipped(demo_run):
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    path, _ = demo_run
    untrained = FAST + ["stages.sft.max_steps=1", "stages.sft.learning_rate=1e-6"]
    state = run_flow(path, untrained)
    assert state.is_completed(), "a closed gate is not a failure"
    summary = summary_of(path, state, untrained)
    publish = next(s for s in summary["stages"] if s["stage_id"] == "publish")
    assert publish["status"] == "skipped"
    assert "gate `judge.win_rate >= 0.55 and judge.ci_low > 0.5` is false: judge.win_rate = " in publish["message"]
    recipe = load_recipe(path, untrained)
    parent = MlflowClient(recipe.tracking_uri).get_run(summary["mlflow_run_id"])
    assert parent.data.tags["alignpipe.status.publish"] == "skipped"
    assert parent.data.tags["alignpipe.skip_reason.publish"] == publish["message"]
    with get_client(sync_client=True) as client:
        runs = client.read_task_runs(
            flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[state.state_details.flow_run_id]))
        )
    skipped = [r for r in runs if r.name == "publish"]
    state_ = skipped[0].state if skipped else None
    assert state_ is not None and state_.name == "Skipped" and "is false" in (state_.message or "")


def test_hub_push_through_the_real_client_never_leaks_the_token(prefect_harness, tiny, tmp_path, monkeypatch):
    """`target: hub` with HfApi against a loopback stand-in for the Hub (HF_ENDPOINT): the files and the
    commit arrive, the token authorises the calls, and it appears in no log, MLflow store or artifact."""
    from loopback import FakeHub, serve
    from support import demo_recipe

    token = "hf_SECRET_test_token_4242"
    hub = FakeHub()
    text = demo_recipe(tiny, tmp_path / "runs").replace(
        "    target: local ",
        "    repo_id: alice/tiny-sft\n    revision: nightly-{run_id}\n    private: true\n    target: hub ",
    )
    path = tmp_path / "hub.yaml"
    path.write_text(text)
    with serve(hub) as url:
        monkeypatch.setenv("HF_ENDPOINT", url)
        monkeypatch.setenv("HF_TOKEN", token)
        monkeypatch.setenv("HF_HUB_OFFLINE", "0")
        state = run_flow(path, FAST)
        assert state.is_completed(), state.message
        again = run_flow(path, FAST)  # unchanged pipeline: push is reused, no new commit
    assert again.is_completed()
    assert len(hub.commits) == 1
    commit = hub.commits[0]
    branch = f"nightly-{str(state.state_details.flow_run_id)[:8]}"
    assert commit["repo"] == "alice/tiny-sft" and commit["branch"] == branch and hub.repos["alice/tiny-sft"]["private"]
    assert str(state.state_details.flow_run_id) in commit["message"]
    assert {"README.md", "model.safetensors", "config.json", "tokenizer.json"} <= set(commit["files"])
    assert commit["authorization"] == f"Bearer {token}"
    card = hub.repos["alice/tiny-sft"]["branches"][branch]["README.md"].decode()
    import yaml

    meta = yaml.safe_load(card.split("---")[1])
    assert meta["license"] == "apache-2.0" and meta["base_model"] == str(tiny / "model")
    assert {"alignpipe", "sft"} <= set(meta["tags"]) and "Judged win rates" in card
    assert hub.validated, "the card's metadata went through the Hub's YAML validation"
    # The token is nowhere on disk: workdir (stage logs, specs, manifests), MLflow store and artifacts.
    leaks = [p for p in (tmp_path / "runs").rglob("*") if p.is_file() and token.encode() in p.read_bytes()]
    assert not leaks, leaks
    from prefect.settings import get_current_settings

    url = get_current_settings().server.database.connection_url
    assert url is not None
    db = url.get_secret_value()
    db_path = Path(db.split("///", 1)[1].split("?")[0])
    assert db_path.exists()
    assert token.encode() not in db_path.read_bytes(), "token in Prefect's database (logs, parameters, artifacts)"


def test_a_stage_that_dies_before_logging_reports_its_traceback(tmp_path):
    """A stage process that fails at start-up (here: an unreadable spec) says why in StageFailed."""
    from alignpipe.launch import StageFailed, launch
    from alignpipe.stage import StageSpec

    spec = StageSpec(
        recipe={"name": "x"},
        stage_id="s",
        stage_dir=str(tmp_path),
        cache_key="k",
        inputs={},
        tracking_uri="sqlite:///x.db",
        experiment_id="0",
    )
    path = tmp_path / "spec.json"
    path.write_text(spec.model_dump_json())
    with pytest.raises(StageFailed) as e:
        launch(path, on_line=lambda line: None)
    assert "--- stderr ---" in str(e.value) and "ValidationError" in str(e.value)


def test_hub_token_can_come_from_a_prefect_secret_block(prefect_harness, tmp_path):
    from prefect.blocks.system import Secret

    from alignpipe.stage import StageSpec
    from tasks.hooks import hub_token_env

    Secret(value="hf_from_block").save("hub-token", overwrite=True)
    spec = StageSpec(
        recipe={"stages": [{"id": "publish", "kind": "push", "token_secret": "hub-token"}]},
        stage_id="publish",
        stage_dir=str(tmp_path),
        cache_key="k",
        inputs={},
        tracking_uri="sqlite:///x",
        experiment_id="0",
    )
    path = tmp_path / "spec.json"
    path.write_text(spec.model_dump_json())
    assert hub_token_env(spec) == {"HF_TOKEN": "hf_from_block"}
    assert "hf_from_block" not in path.read_text(), "only the block's name is in the spec"


def test_a_tag_concurrency_limit_holds_back_a_tagged_stage_while_another_runs(prefect_harness, tiny, tmp_path):
    """`resources.tags` with Prefect's tag concurrency limits: the demo's two format stages run side by side unless
    both carry a tag limited to one run at a time, as here, where the second starts after the first ends."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId
    from support import demo_recipe

    path = tmp_path / "tiny-demo.yaml"
    path.write_text(demo_recipe(tiny, tmp_path / "runs"))
    tagged = [f"stages.{sid}.resources.tags=[one-format]" for sid in ("sft-data", "eval-prompts")]
    with get_client(sync_client=True) as client:
        client.create_concurrency_limit(tag="one-format", concurrency_limit=1)
    try:
        state = run_flow(path, FAST + tagged + ["stages.sft.max_steps=5", "stages.judge.num_prompts=8"])
        with get_client(sync_client=True) as client:
            runs = client.read_task_runs(
                flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[state.state_details.flow_run_id]))
            )
    finally:
        with get_client(sync_client=True) as client:
            client.delete_concurrency_limit_by_tag("one-format")
    assert state.is_completed(), state.message
    first, second = sorted((r for r in runs if "one-format" in r.tags), key=lambda r: _when(r.start_time))

    assert {first.name, second.name} == {"sft-data", "eval-prompts"}
    assert first.end_time is not None and second.start_time is not None
    assert second.start_time >= first.end_time, (first, second)


def test_the_flows_parameters_are_described_in_the_form_prefect_s_ui_shows():
    """A run launched from Prefect's UI is set up in a form built from the flow's parameter schema: each field says
    what it takes (from the flows' docstrings), and the flows' descriptions are a line each."""
    from prefect.utilities.callables import parameter_schema

    from flows.pipeline import pipeline
    from flows.stage import stage

    for flow_ in (pipeline, stage):
        schema = parameter_schema(flow_.fn).model_dump()
        missing = [name for name, field in schema["properties"].items() if not field.get("description")]
        assert not missing, (flow_.name, missing)
        assert flow_.description and "\n" not in flow_.description
    overrides = parameter_schema(pipeline.fn).model_dump()["properties"]["overrides"]["description"]
    assert "key=value" in overrides and "--set" in overrides
