"""`rloo` stage: policy from an upstream model, prompts from a format stage, rewards from the recipe (GRPO's wiring)."""

from __future__ import annotations

from alignpipe.recipe.stages import RLOOStage
from alignpipe.stages.context import StageContext, StageResult
from alignpipe.stages.grpo import run_sampled
from alignpipe.trainers import rloo


def run(ctx: StageContext[RLOOStage]) -> StageResult:
    return run_sampled(ctx, rloo.train, "RLOO")
