"""`ppo` stage: policy from an upstream model, value head from a reward model, rewards from the recipe."""

from __future__ import annotations

from alignpipe.engine.factory import make_engine
from alignpipe.judges.reward_set import load_rewards
from alignpipe.modeling import load_sequence_scorer
from alignpipe.plots import curves_figure
from alignpipe.recipe.stages import PPOStage
from alignpipe.stages.context import StageContext, StageResult
from alignpipe.stages.grpo import prompt_rows
from alignpipe.trainers import ppo


def run(ctx: StageContext[PPOStage]) -> StageResult:
    s = ctx.stage
    rewards = load_rewards(s.rewards, lambda sid: ctx.inputs[sid].outputs["model"])
    value_source = s.value_model or next(r.reward_model for r in s.rewards if r.reward_model)
    policy, tokenizer, base_path = ctx.start_model(s.model, lora=s.lora is not None)
    value_model = load_sequence_scorer(
        ctx.inputs[value_source].outputs["model"],
        ctx.recipe.model.dtype,
        pad_token_id=tokenizer.pad_token_id,
        attention=ctx.recipe.model.attention,
    )
    ref = ctx.load_model(s.model, merge=True) if not s.lora else None
    engine = make_engine(s.rollout, policy, tokenizer) if s.rollout.backend != "hf" else None
    result = ppo.train(
        s,
        policy,
        value_model,
        tokenizer,
        prompt_rows(ctx, s.data, "train"),
        rewards,
        ctx.tracker,
        ctx.dir,
        ctx.seed,
        ref_model=ref,
        engine=engine,
    )
    for keys, name in (
        (["objective/rlhf_reward", "objective/scores"], "reward_curve.png"),
        (["objective/kl"], "kl_curve.png"),
    ):
        fig = curves_figure(ctx.tracker, keys, f"PPO {s.id}")
        if fig is not None:
            ctx.tracker.log_figure(fig, name)
    out = ctx.causal_lm_result(result, base_path)
    out.key_metric = "objective/rlhf_reward"
    return out
