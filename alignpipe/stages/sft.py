"""`sft` stage: load the start model and data, run `trainers.sft.train`, plot the loss curve."""

from __future__ import annotations

from alignpipe.plots import curves_figure
from alignpipe.recipe.stages import SFTStage
from alignpipe.stages.context import StageContext, StageResult
from alignpipe.trainers import sft


def run(ctx: StageContext[SFTStage]) -> StageResult:
    s = ctx.stage
    model, tokenizer, base_path = ctx.start_model(s.model, lora=s.lora is not None)
    result = sft.train(
        s, model, tokenizer, ctx.rows(s.data, "train"), ctx.rows(s.data, "eval"), ctx.tracker, ctx.dir, ctx.seed
    )
    fig = curves_figure(ctx.tracker, ["train/loss", "eval/loss"], f"SFT {s.id}")
    if fig is not None:
        ctx.tracker.log_figure(fig, "loss_curve.png")
    ctx.log_samples(model, tokenizer, ctx.rows(s.data, "eval"))
    return ctx.causal_lm_result(result, base_path)
