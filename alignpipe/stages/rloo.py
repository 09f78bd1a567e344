"""`rloo` stage: policy from an upstream model, prompts from a format stage, rewards from the recipe (GRPO's wiring)."""

from __future__ import annotations

from alignpipe.engine.factory import make_engine
from alignpipe.judges.reward_set import load_rewards
from alignpipe.plots import curves_figure
from alignpipe.recipe.stages import RLOOStage
from alignpipe.stages.context import StageContext, StageResult
from alignpipe.stages.grpo import prompt_rows
from alignpipe.trainers import rloo


def run(ctx: StageContext[RLOOStage]) -> StageResult:
    s = ctx.stage
    rewards = load_rewards(s.rewards, lambda sid: ctx.inputs[sid].outputs["model"])
    model, tokenizer, base_path = ctx.start_model(s.model, lora=s.lora is not None)
    ref = ctx.load_model(s.model, merge=True) if s.beta and not s.lora else None
    engine = make_engine(s.rollout, model, tokenizer) if s.rollout.backend != "hf" else None
    result = rloo.train(
        s,
        model,
        tokenizer,
        prompt_rows(ctx, s.data, "train"),
        rewards,
        ctx.tracker,
        ctx.dir,
        ctx.seed,
        ref_model=ref,
        engine=engine,
        eval_rows=prompt_rows(ctx, s.data, "eval"),
    )
    for keys, name in ((["train/reward", "eval/reward"], "reward_curve.png"), (["train/kl"], "kl_curve.png")):
        fig = curves_figure(ctx.tracker, keys, f"RLOO {s.id}")
        if fig is not None:
            ctx.tracker.log_figure(fig, name)
    out = ctx.causal_lm_result(result, base_path)
    if "eval/reward" in result.metrics:
        out.key_metric = "eval/reward"
    return out
