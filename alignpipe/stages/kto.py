"""`kto` stage: policy (and reference) from an upstream model, unpaired data, `trainers.kto.train` (DPO's runner)."""

from __future__ import annotations

from alignpipe.recipe.stages import KTOStage
from alignpipe.stages.context import StageContext, StageResult
from alignpipe.stages.dpo import run_preference_stage
from alignpipe.trainers import kto


def run(ctx: StageContext[KTOStage]) -> StageResult:
    # with LoRA the reference is the adapter-disabled policy; precomputed log-probs come from the policy before its
    # first step; otherwise a frozen copy
    curves = [(["train/kl", "eval/kl"], "kl_curve.png")]
    needs_copy = not (ctx.stage.lora or ctx.stage.precompute_ref_logps)
    return run_preference_stage(ctx, kto.train, needs_copy, "KTO", curves)
