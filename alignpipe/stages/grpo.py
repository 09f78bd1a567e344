"""`grpo` stage: policy from an upstream model, prompts from a format stage, rewards from the recipe."""

from __future__ import annotations

from alignpipe.judges.reward_set import load_rewards
from alignpipe.recipe.stages import FormatStage, GRPOStage, RLOOStage
from alignpipe.stages.context import StageContext, StageResult
from alignpipe.stages.online import finish, prompt_rows, start_policy
from alignpipe.tool_calls import load_tools
from alignpipe.trainers import grpo

CURVES = ((["train/reward", "eval/reward"], "reward_curve.png"), (["train/kl"], "kl_curve.png"))


def run_sampled(ctx: StageContext[GRPOStage] | StageContext[RLOOStage], train, title: str) -> StageResult:
    """A stage whose trainer samples groups of completions and scores them with the recipe's rewards (GRPO's and
    RLOO's wiring): `train` is `grpo.train` or `rloo.train`. The tools its format stage renders into the prompts
    are called during rollouts."""
    s = ctx.stage
    rewards = load_rewards(s.rewards, lambda sid: ctx.inputs[sid].outputs["model"])
    data = ctx.recipe.stage(s.data)
    offered = data if isinstance(data, FormatStage) and data.tools else None  # the format stage that renders tools
    with start_policy(ctx, reference=bool(s.beta)) as p:
        result = train(
            s,
            p.model,
            p.tokenizer,
            prompt_rows(ctx, s.data, "train"),
            rewards,
            ctx.tracker,
            ctx.dir,
            ctx.seed,
            ref_model=p.ref,
            engine=p.engine,
            eval_rows=prompt_rows(ctx, s.data, "eval"),
            tools=load_tools(offered.tools) if offered else None,
            chat_template_kwargs=offered.chat_template_kwargs if offered else None,
        )
    return finish(ctx, title, CURVES, result, p.base_path, "eval/reward")


def run(ctx: StageContext[GRPOStage]) -> StageResult:
    return run_sampled(ctx, grpo.train, "GRPO")
