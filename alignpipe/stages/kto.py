"""`kto` stage: policy (and reference) from an upstream model, unpaired data, `trainers.kto.train`."""

from __future__ import annotations

from alignpipe.plots import curves_figure
from alignpipe.recipe.stages import KTOStage
from alignpipe.stages.context import StageContext, StageResult
from alignpipe.trainers import kto


def run(ctx: StageContext[KTOStage]) -> StageResult:
    s = ctx.stage
    model, tokenizer, base_path = ctx.start_model(s.model, lora=s.lora is not None)
    ref_model = ctx.load_model(s.model, merge=True) if not s.lora else None  # with LoRA: the adapter-disabled policy
    result = kto.train(
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
        (["train/kl", "eval/kl"], "kl_curve.png"),
    ):
        fig = curves_figure(ctx.tracker, keys, f"KTO {s.id}")
        if fig is not None:
            ctx.tracker.log_figure(fig, name)
    ctx.log_samples(model, tokenizer, ctx.rows(s.data, "eval"))
    return ctx.causal_lm_result(result, base_path)
