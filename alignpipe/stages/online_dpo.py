"""`online_dpo` stage: policy from an upstream model, prompts from a format stage, a ranker from `rewards` or
`llm_judge`, `trainers.online_dpo.train`."""

from __future__ import annotations

from alignpipe.judges.reward_set import load_rewards
from alignpipe.recipe.stages import OnlineDPOStage
from alignpipe.stages.context import StageContext, StageResult
from alignpipe.stages.judge import local_or_endpoint_judge
from alignpipe.stages.online import finish, prompt_rows, start_policy
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
    with start_policy(ctx, reference=True) as p:
        result = online_dpo.train(
            s,
            p.model,
            p.tokenizer,
            prompt_rows(ctx, s.data, "train"),
            ranker,
            ctx.tracker,
            ctx.dir,
            ctx.seed,
            ref_model=p.ref,
            engine=p.engine,
            eval_rows=prompt_rows(ctx, s.data, "eval"),
            rewards=rewards,
        )
    curves = (
        (["train/rewards/margins"], "reward_margin_curve.png"),
        (["train/objective/scores", "eval/reward"], "score_curve.png"),
        (["train/objective/kl"], "kl_curve.png"),
    )
    return finish(ctx, "online DPO", curves, result, p.base_path, "eval/reward")
