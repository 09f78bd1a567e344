"""`dpo` stage: policy (and reference) from an upstream model, preference data, `trainers.dpo.train`."""

from __future__ import annotations

from alignpipe.plots import curves_figure
from alignpipe.recipe.stages import DPOStage
from alignpipe.stages.context import StageContext, StageResult
from alignpipe.trainers import dpo


def run(ctx: StageContext[DPOStage]) -> StageResult:
    s = ctx.stage
    model, tokenizer, base_path = ctx.start_model(s.model, lora=s.lora is not None)
    # A second copy only when nothing else can serve as the reference (see DPOConfig).
    needs_copy = not (s.lora or s.reference_free or s.precompute_ref_logps)
    ref_model = ctx.load_model(s.model, merge=True) if needs_copy else None
    result = dpo.train(
        s,
        model,
        tokenizer,
        ctx.rows(s.data, "train"),
        ctx.rows(s.data, "eval"),
        ctx.tracker,
        ctx.dir,
        ctx.seed,
        ref_model=ref_model,
    )
    for keys, name in (
        (["train/loss", "eval/loss"], "loss_curve.png"),
        (["train/rewards/margins", "eval/rewards/margins"], "reward_margin_curve.png"),
    ):
        fig = curves_figure(ctx.tracker, keys, f"DPO {s.id}")
        if fig is not None:
            ctx.tracker.log_figure(fig, name)
    ctx.log_samples(model, tokenizer, ctx.rows(s.data, "eval"))
    return ctx.causal_lm_result(result, base_path)
