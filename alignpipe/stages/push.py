"""`push` stage: model (or adapter) + tokenizer + generated model card → the Hub or a local folder."""

from __future__ import annotations

import logging
import shutil
import tempfile
from pathlib import Path

from alignpipe.hub import CardInfo, model_card, push_to_hub, stage_folder, without_front_matter
from alignpipe.recipe.stages import FormatStage, JudgeStage, PushStage
from alignpipe.stages.context import StageContext, StageResult

log = logging.getLogger(__name__)
CARD_HYPERPARAMETERS = (
    "learning_rate",
    "max_steps",
    "epochs",
    "batch_size",
    "gradient_accumulation_steps",
    "max_length",
    "lora",
    "beta",
    "loss_type",
    "num_generations",
    "kl_coef",
)


def card_info(ctx: StageContext[PushStage], adapter: bool) -> CardInfo:
    recipe, s = ctx.recipe, ctx.stage
    info = CardInfo(
        # the model's name: its Hub repo, else its registry name, else pipeline and model stage (never "publish")
        name=s.repo_id or (s.registry.name if s.registry else f"{recipe.name}-{s.model}"),
        base_model=recipe.model.path,
        pipeline=recipe.name,
        recipe_hash=recipe.fingerprint(),
        mlflow_run_id=ctx.mlflow_parent_run_id,
        license=s.license,
        tags=list(s.tags),
        adapter=adapter,
        description=recipe.description,
    )
    for sid, m in ctx.inputs.items():
        stage = recipe.stage(sid)
        if isinstance(stage, FormatStage):
            # a row per dataset read, with the formatted rows it gave; a mixture's share its fingerprint
            mixed = ", mixed" if len(stage.dataset_names) > 1 else ""
            info.datasets += [
                {
                    "name": f"{source['name']} ({sid}{mixed})",
                    "path": source["path"],
                    "fingerprint": m.info.get("fingerprint", ""),
                    "hub": source["hub"],
                    "rows_train": source["rows"][0],
                    "rows_eval": source["rows"][1],
                }
                for source in m.info.get("sources") or [_single_source(stage, m)]
            ]
        elif isinstance(stage, JudgeStage):
            info.win_rates += m.info.get("win_rates", [])
        else:
            hp = {k: v for k, v in stage.model_dump(mode="json").items() if k in CARD_HYPERPARAMETERS and v is not None}
            info.stages.append({"id": sid, "kind": stage.kind, "hyperparameters": hp, "metrics": m.metrics})
            info.tags.append(stage.kind)
    return info


def _single_source(stage: FormatStage, m) -> dict:
    """The one dataset of a format stage whose manifest predates `sources` (written before mixtures, still cached)."""
    rows = [int(m.metrics.get("rows_train", 0)), int(m.metrics.get("rows_eval", 0))]
    return {
        "name": stage.dataset_names[0],
        "path": m.info.get("path", ""),
        "hub": m.info.get("hub", False),
        "rows": rows,
    }


def register(ctx: StageContext[PushStage], spec, published: str, full_model: Path) -> str:
    """Log the model as an MLflow pyfunc model (`alignpipe.registry`) in the stage's run, create a registry version
    from it and move the alias there; the version's `alignpipe.published` tag says where it was published."""
    client = getattr(ctx.tracker, "client", None)
    if client is None:
        log.warning("no MLflow tracker: model not registered")
        return ""
    from mlflow.exceptions import MlflowException

    from alignpipe.registry import save_pyfunc

    # written beside the stage's outputs only until logged: the artifact store keeps the one copy of the weights
    with tempfile.TemporaryDirectory(dir=ctx.dir, prefix=".mlflow-model-") as tmp:
        ctx.tracker.log_artifact(save_pyfunc(full_model, Path(tmp) / "model"), "model")
    run_id = ctx.tracker.run_id  # type: ignore[attr-defined]  # an MlflowTracker: it has a client
    try:
        client.get_registered_model(spec.name)
    except MlflowException:
        client.create_registered_model(spec.name, description=f"Published by alignpipe pipeline {ctx.recipe.name}")
    version = client.create_model_version(
        spec.name,
        source=f"{client.get_run(run_id).info.artifact_uri}/model",
        run_id=run_id,
        tags={
            "alignpipe.pipeline": ctx.recipe.name,
            "alignpipe.recipe_hash": ctx.recipe.fingerprint(),
            "alignpipe.published": published,
        },
    )
    client.set_registered_model_alias(spec.name, spec.alias, version.version)
    log.info("registered %s version %s with alias %r", spec.name, version.version, spec.alias)
    return f"models:/{spec.name}@{spec.alias} (version {version.version})"


def save_merged(ctx: StageContext[PushStage], model: str) -> Path:
    """The adapter of stage `model` merged into its base, with the tokenizer, in `<stage dir>/merged`."""
    folder = Path(ctx.dir) / "merged"
    ctx.load_model(model, merge=True).save_pretrained(folder)
    ctx.tokenizer(model).save_pretrained(folder)
    return folder


def run(ctx: StageContext[PushStage]) -> StageResult:
    s = ctx.stage
    src = ctx.model_source(s.model)
    folder = Path(src.path)
    adapter = src.adapter
    if src.adapter and s.merge_adapter:
        folder = save_merged(ctx, s.model)
        adapter = False
    card = model_card(card_info(ctx, adapter))
    outputs = {}
    if s.target == "local":
        dest = Path(s.path).expanduser().resolve() if s.path else ctx.recipe.run_root / "published" / s.id
        dest.parent.mkdir(parents=True, exist_ok=True)
        stage_folder(folder, dest, card)
        outputs["published"] = str(dest)
        log.info("published %s to %s", s.model, dest)
    else:
        staged = stage_folder(folder, Path(ctx.dir) / "upload", card)
        message = f"alignpipe {ctx.recipe.name}: pipeline run {ctx.pipeline_run_id}"
        revision = s.revision
        if revision:
            import datetime

            revision = revision.replace("{run_id}", ctx.pipeline_run_id[:8]).replace(
                "{date}", datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%d")
            )
        assert s.repo_id is not None  # validation: target 'hub' needs repo_id
        url = push_to_hub(staged, s.repo_id, private=s.private, revision=revision, commit_message=message)
        outputs["published"] = url
        log.info("pushed %s to %s", s.model, url)
    (Path(ctx.dir) / "README.md").write_text(card)
    if s.registry is not None:
        full = save_merged(ctx, s.model) if adapter else folder  # the registered version stands alone
        outputs["registered"] = register(ctx, s.registry, outputs["published"], full)
        if full != folder:
            shutil.rmtree(full)
    (Path(ctx.dir) / "model_card").mkdir(exist_ok=True)
    (Path(ctx.dir) / "model_card" / "README.md").write_text(without_front_matter(card))
    ctx.tracker.log_artifact(Path(ctx.dir) / "model_card" / "README.md", "model_card")
    ctx.tracker.log_params({"push.target": s.target, "push.repo_id": s.repo_id or "", "push.adapter": adapter})
    return StageResult(outputs=outputs, metrics={}, info={"adapter": adapter, "card": str(Path(ctx.dir) / "README.md")})
