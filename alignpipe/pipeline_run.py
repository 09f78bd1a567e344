"""A pipeline run's record: the MLflow parent run, each stage's outcome, promotion gates, and the summary file
(`<run root>/runs/<pipeline run id>.json`) that `alignpipe resume` reads."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

import yaml

from alignpipe.manifest import Manifest, write_whole
from alignpipe.recipe.schema import Recipe

STATUS_DONE, STATUS_CACHED, STATUS_FAILED, STATUS_NOT_RUN, STATUS_SKIPPED = (
    "done",
    "cached",
    "failed",
    "not run",
    "skipped",
)


def start_pipeline_run(recipe: Recipe, pipeline_run_id: str) -> tuple[str, str, str]:
    """Create the parent MLflow run; returns (tracking uri, experiment id, run id)."""
    from alignpipe.tracking import MlflowTracker, ensure_experiment

    uri = recipe.tracking_uri
    if uri.startswith("sqlite:///"):
        Path(uri[len("sqlite:///") :]).parent.mkdir(parents=True, exist_ok=True)
    exp = ensure_experiment(uri, recipe.experiment_name, Path(recipe.workdir).expanduser() / "mlartifacts")
    run = MlflowTracker.start(
        uri,
        exp,
        f"{recipe.name}",
        tags={
            "alignpipe.pipeline": recipe.name,
            "alignpipe.pipeline_run_id": pipeline_run_id,
            # the run page's description (MLflow renders this tag as the run's note)
            **({"mlflow.note.content": recipe.description} if recipe.description else {}),
        },
    )
    run.log_params(
        {
            "recipe_hash": recipe.fingerprint(),
            "name": recipe.name,
            "seed": recipe.seed,
            "model": recipe.model.path,
            "stages": ",".join(s.id for s in recipe.stages),
        }
    )
    run.log_text(yaml.safe_dump(recipe.model_dump(mode="json"), sort_keys=False), "recipe.resolved.yaml")
    return uri, exp, run.run_id


@dataclass
class StageOutcome:
    stage_id: str
    kind: str
    status: str
    duration_s: float = 0.0
    key_metric: str | None = None
    value: float | None = None
    output: str = ""
    message: str = ""
    mlflow_run_id: str | None = None
    """The MLflow run that trained the stage (for a cached stage, the earlier run's)."""

    @classmethod
    def from_manifest(cls, m: Manifest, status: str, duration: float | None = None) -> StageOutcome:
        output = next(iter(m.outputs.values()), "")
        return cls(
            m.stage_id,
            m.kind,
            status,
            m.duration_s if duration is None else duration,
            m.key_metric,
            m.metrics.get(m.key_metric) if m.key_metric else None,
            output,
            mlflow_run_id=m.mlflow_run_id,
        )


def gate(stage, manifests: dict[str, Manifest]) -> tuple[bool, str]:
    """Evaluate a stage's `when` on its upstream manifests: (open, explanation)."""
    from alignpipe.gates import evaluate, parse

    if not stage.when:
        return True, ""
    return evaluate(parse(stage.when), {sid: m.metrics for sid, m in manifests.items()})


def parent_metrics(outcomes: list[StageOutcome]) -> dict[str, float]:
    """Each finished or cached stage's key metric under its stage id (`judge/win_rate`, `sft/eval_loss`), so pipeline
    runs compare side by side in MLflow without opening their stage runs."""
    out = {}
    for o in outcomes:
        if o.key_metric is None or o.value is None or o.status not in (STATUS_DONE, STATUS_CACHED):
            continue
        name = o.key_metric[len(o.kind) + 1 :] if o.key_metric.startswith(o.kind + "/") else o.key_metric
        out[f"{o.stage_id}/{name.replace('/', '_')}"] = float(o.value)
    return out


def end_pipeline_run(tracking: tuple[str, str, str], outcomes: list[StageOutcome]) -> None:
    from alignpipe.tracking import MlflowTracker

    uri, _, run_id = tracking
    run = MlflowTracker(uri, run_id)
    failed = any(o.status == STATUS_FAILED for o in outcomes)
    run.log_text(json.dumps([asdict(o) for o in outcomes], indent=1), "summary.json")
    rolled = parent_metrics(outcomes)
    if rolled:
        run.log_metrics(rolled, 0)
    run.set_tags({f"alignpipe.status.{o.stage_id}": o.status for o in outcomes})
    # a cached stage's run belongs to an earlier pipeline run: the tag leads there from this one
    run.set_tags({f"alignpipe.stage_run.{o.stage_id}": o.mlflow_run_id for o in outcomes if o.mlflow_run_id})
    run.set_tags(
        {f"alignpipe.skip_reason.{o.stage_id}": o.message[:5000] for o in outcomes if o.status == STATUS_SKIPPED}
    )
    run.end("FAILED" if failed else "FINISHED")


def write_summary(
    recipe: Recipe,
    pipeline_run_id: str,
    outcomes: list[StageOutcome],
    mlflow_run_id: str | None,
    request: dict | None = None,
) -> Path:
    """`<run root>/runs/<pipeline run id>.json`: the outcome per stage and what to re-run (`alignpipe resume`)."""
    d = recipe.run_root / "runs"
    d.mkdir(parents=True, exist_ok=True)
    path = d / f"{pipeline_run_id}.json"
    write_whole(
        path,
        json.dumps(
            {
                "pipeline": recipe.name,
                "pipeline_run_id": pipeline_run_id,
                "mlflow_run_id": mlflow_run_id,
                "tracking_uri": recipe.tracking_uri,
                "request": request or {},
                "stages": [asdict(o) for o in outcomes],
            },
            indent=1,
        ),
    )
    store = recipe.remote_store()
    if store:
        store.write_text(f"runs/{pipeline_run_id}.json", path.read_text())
    return path
