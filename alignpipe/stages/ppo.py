"""`ppo` stage: policy from an upstream model, value head from a reward model, rewards from the recipe."""

from __future__ import annotations

from alignpipe.judges.reward_set import load_rewards
from alignpipe.modeling import load_sequence_scorer
from alignpipe.recipe.stages import PPOStage
from alignpipe.stages.context import StageContext, StageResult
from alignpipe.stages.online import finish, prompt_rows, start_policy
from alignpipe.trainers import ppo


def run(ctx: StageContext[PPOStage]) -> StageResult:
    s = ctx.stage
    rewards = load_rewards(s.rewards, lambda sid: ctx.inputs[sid].outputs["model"])
    value_source = s.value_model or next(r.reward_model for r in s.rewards if r.reward_model)
    with start_policy(ctx, reference=True) as p:
        value_model = load_sequence_scorer(
            ctx.inputs[value_source].outputs["model"],
            ctx.recipe.model.dtype,
            pad_token_id=p.tokenizer.pad_token_id,
            attention=ctx.recipe.model.attention,
        )
        result = ppo.train(
            s,
            p.model,
            value_model,
            p.tokenizer,
            prompt_rows(ctx, s.data, "train"),
            rewards,
            ctx.tracker,
            ctx.dir,
            ctx.seed,
            ref_model=p.ref,
            engine=p.engine,
        )
    curves = ((["objective/rlhf_reward", "objective/scores"], "reward_curve.png"), (["objective/kl"], "kl_curve.png"))
    return finish(ctx, "PPO", curves, result, p.base_path, "objective/rlhf_reward")
