"""`sft` stage: load the start model and data, run `trainers.sft.train`, plot the loss curve."""

from __future__ import annotations

from alignpipe.plots import curves_figure
from alignpipe.stages.context import StageContext, StageResult
from alignpipe.trainers import sft
from alignpipe.trainers.configs import SFTConfig


def run(ctx: StageContext) -> StageResult:
    s = ctx.stage
    cfg = SFTConfig.model_validate(s.model_dump(include=set(SFTConfig.model_fields)))
    src = ctx.model_source(s.model)
    model = ctx.load_model(s.model, merge=True)
    tokenizer = ctx.tokenizer(s.model)
    base_path = src.base_path if src.adapter else src.path
    if cfg.lora and src.adapter:  # a new adapter over merged weights: keep those weights as its base
        base_path = str(ctx.dir / "base_model")
        model.save_pretrained(base_path)
        tokenizer.save_pretrained(base_path)
    result = sft.train(cfg, model, tokenizer, ctx.rows(s.data, "train"), ctx.rows(s.data, "eval"), ctx.tracker, ctx.dir, ctx.seed)
    fig = curves_figure(ctx.tracker, ["train/loss", "eval/loss"], f"SFT {s.id}")
    if fig is not None:
        ctx.tracker.log_figure(fig, "loss_curve.png")
    return StageResult(
        outputs={"model": str(result.model_dir)}, metrics={**result.metrics, "steps": result.steps},
        key_metric="eval/loss" if "eval/loss" in result.metrics else "train/loss",
        info={"adapter": result.adapter, "base_model_path": base_path if result.adapter else None,
              "base_model": ctx.recipe.model.path, "train_seconds": result.seconds})
