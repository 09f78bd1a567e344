"""`reward` stage: a one-output sequence classifier initialised from a causal LM, trained on pairs."""

from __future__ import annotations

from alignpipe.modeling import load_sequence_scorer
from alignpipe.plots import curves_figure
from alignpipe.positions import check_model_window
from alignpipe.recipe.stages import RewardStage
from alignpipe.stages.context import StageContext, StageResult
from alignpipe.trainers import reward


def run(ctx: StageContext[RewardStage]) -> StageResult:
    s = ctx.stage
    src = ctx.model_source(s.model)
    init = src.path
    if src.adapter:  # a classifier is built from full weights: merge the upstream adapter first
        init = str(ctx.dir / "init")
        ctx.load_model(s.model, merge=True).save_pretrained(init)
    tokenizer = ctx.tokenizer(s.model)
    model = load_sequence_scorer(
        init,
        ctx.recipe.model.dtype,
        trust_remote_code=ctx.recipe.model.trust_remote_code,
        pad_token_id=tokenizer.pad_token_id,
        seed=ctx.seed,
        attention=ctx.recipe.model.attention,
    )
    check_model_window(model, s)
    result = reward.train(
        s, model, tokenizer, ctx.rows(s.data, "train"), ctx.rows(s.data, "eval"), ctx.tracker, ctx.dir, ctx.seed
    )
    fig = curves_figure(ctx.tracker, ["train/accuracy", "eval/accuracy"], f"reward model {s.id}")
    if fig is not None:
        ctx.tracker.log_figure(fig, "accuracy_curve.png")
    key = "eval/accuracy" if "eval/accuracy" in result.metrics else "train/loss"
    return StageResult(
        outputs={"model": str(result.model_dir)},
        metrics={**result.metrics, "steps": result.steps},
        key_metric=key,
        info={"scorer": True, "base_model": ctx.recipe.model.path},
    )
