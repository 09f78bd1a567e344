"""`dpo` stage: policy (and reference) from an upstream model, preference data, `trainers.dpo.train`."""

from __future__ import annotations

from alignpipe.plots import curves_figure
from alignpipe.recipe.stages import DPOStage
from alignpipe.stages.context import StageContext, StageResult
from alignpipe.trainers import dpo


def run(ctx: StageContext[DPOStage]) -> StageResult:
    s = ctx.stage
    # A second copy only when nothing else can serve as the reference (see DPOConfig).
    needs_copy = not (s.lora or s.reference_free or s.precompute_ref_logps)
    return run_preference_stage(ctx, dpo.train, needs_copy, "DPO", [])


def run_preference_stage(ctx: StageContext, train, needs_copy: bool, title: str, extra_curves: list) -> StageResult:
    """The runner DPO and KTO share: policy (and a frozen reference copy when `needs_copy`) from the upstream model,
    the train and eval splits of `data`, loss / reward-margin curves (and `extra_curves`: (keys, file) pairs)."""
    s = ctx.stage
    model, tokenizer, base_path = ctx.start_model(s.model, lora=s.lora is not None)
    ref_model = ctx.load_model(s.model, merge=True) if needs_copy else None
    result = train(
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
        *extra_curves,
    ):
        fig = curves_figure(ctx.tracker, keys, f"{title} {s.id}")
        if fig is not None:
            ctx.tracker.log_figure(fig, name)
    ctx.log_samples(model, tokenizer, ctx.rows(s.data, "eval"))
    return ctx.causal_lm_result(result, base_path)
