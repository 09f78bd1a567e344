"""`online_dpo` stage: policy from an upstream model, prompts from a format stage, a ranker from `rewards` or
`llm_judge`, `trainers.online_dpo.train`."""

from __future__ import annotations

from alignpipe.engine.factory import make_engine
from alignpipe.judges.reward_set import load_rewards
from alignpipe.plots import curves_figure
from alignpipe.recipe.stages import OnlineDPOStage
from alignpipe.stages.context import StageContext, StageResult
from alignpipe.stages.grpo import prompt_rows
from alignpipe.stages.judge import local_or_endpoint_judge
from alignpipe.trainers import online_dpo


def run(ctx: StageContext[OnlineDPOStage]) -> StageResult:
    s = ctx.stage
    rewards = load_rewards(s.rewards, lambda sid: ctx.inputs[sid].outputs["model"]) if s.rewards else None
    ranker: online_dpo.RewardRanker | online_dpo.JudgeRanker
    if rewards is not None:
        ranker = online_dpo.RewardRanker(rewards, s.missing_eos_penalty)
    else:
        assert s.llm_judge is not None  # validation: exactly one ranker
        _, judge = local_or_endpoint_judge(ctx, s.llm_judge)
        ranker = online_dpo.JudgeRanker(judge, s.llm_judge.template)
    model, tokenizer, base_path = ctx.start_model(s.model, lora=s.lora is not None)
    ref = ctx.load_model(s.model, merge=True) if not s.lora else None
    engine = make_engine(s.rollout, model, tokenizer) if s.rollout.backend != "hf" else None
    result = online_dpo.train(
        s,
        model,
        tokenizer,
        prompt_rows(ctx, s.data, "train"),
        ranker,
        ctx.tracker,
        ctx.dir,
        ctx.seed,
        ref_model=ref,
        engine=engine,
        eval_rows=prompt_rows(ctx, s.data, "eval"),
        rewards=rewards,
    )
    for keys, name in (
        (["train/rewards/margins"], "reward_margin_curve.png"),
        (["train/objective/scores", "eval/reward"], "score_curve.png"),
        (["train/objective/kl"], "kl_curve.png"),
    ):
        fig = curves_figure(ctx.tracker, keys, f"online DPO {s.id}")
        if fig is not None:
            ctx.tracker.log_figure(fig, name)
    out = ctx.causal_lm_result(result, base_path)
    if "eval/reward" in result.metrics:
        out.key_metric = "eval/reward"
    return out
