"""`judge` stage: candidate vs baseline completions on eval prompts, scored by a reward function."""

from __future__ import annotations

import json
import logging
from pathlib import Path

from alignpipe.engine.hf import HFEngine
from alignpipe.judges.rewards import load_reward_fn, score
from alignpipe.judges.winrate import win_rate
from alignpipe.plots import win_rate_figure
from alignpipe.stages.context import StageContext, StageResult

log = logging.getLogger(__name__)


def generate(ctx: StageContext, ref: str, prompts: list[str]) -> list[str]:
    s = ctx.stage
    engine = HFEngine(ctx.load_model(ref, merge=True), ctx.tokenizer(ref), batch_size=s.batch_size)
    return [g.completion for g in engine.generate(prompts, 1, s.sampling, seed=ctx.seed)]


def run(ctx: StageContext) -> StageResult:
    s = ctx.stage
    if s.reward_model:
        from alignpipe.judges.reward_model import RewardModelScorer

        fn, reward_name = RewardModelScorer(ctx.inputs[s.reward_model].outputs["model"], s.batch_size), f"reward model {s.reward_model}"
    else:
        fn, reward_name = load_reward_fn(s.reward), s.reward  # fails before any generation if it does not import
    rows = ctx.rows(s.prompts, s.split)[: s.num_prompts]
    if not rows:
        raise ValueError(f"format stage {s.prompts!r} has no rows in its {s.split!r} split to judge on")
    prompts = [r["prompt"] for r in rows]
    columns = {k: [r.get(k) for r in rows] for k in rows[0] if k not in ("prompt", "completion", "chosen", "rejected")}
    cand = generate(ctx, s.candidate, prompts)
    base = generate(ctx, s.baseline, prompts)
    cand_scores = score(fn, reward_name, prompts, cand, columns)
    base_scores = score(fn, reward_name, prompts, base, columns)
    pairs = [(c, b) for c, b in zip(cand_scores, base_scores) if c is not None and b is not None]
    if not pairs:
        raise ValueError(f"{reward_name} returned None (not applicable) for every prompt")
    wr = win_rate([p[0] for p in pairs], [p[1] for p in pairs])
    table = [{"prompt": p, "candidate": c, "baseline": b, "candidate_score": cs, "baseline_score": bs,
              "verdict": "n/a" if cs is None or bs is None else ("win" if cs > bs else "loss" if cs < bs else "tie")}
             for p, c, b, cs, bs in zip(prompts, cand, base, cand_scores, base_scores)]
    metrics = {"judge/win_rate": wr.win_rate, "judge/ci_low": wr.ci_low, "judge/ci_high": wr.ci_high,
               "judge/wins": wr.wins, "judge/ties": wr.ties, "judge/losses": wr.losses,
               "judge/candidate_score": sum(p[0] for p in pairs) / len(pairs),
               "judge/baseline_score": sum(p[1] for p in pairs) / len(pairs)}
    summary = {"candidate": s.candidate, "baseline": s.baseline, "judge": reward_name, "n": wr.n, **wr.as_dict()}
    log.info("%s vs %s: win rate %.3f [%.3f, %.3f] (%d wins, %d ties, %d losses; reward %s)", s.candidate, s.baseline,
             wr.win_rate, wr.ci_low, wr.ci_high, wr.wins, wr.ties, wr.losses, reward_name)
    results = Path(ctx.dir) / "results.json"
    results.write_text(json.dumps({"summary": summary, "examples": table}, indent=1))
    ctx.tracker.log_params({"judge": s.model_dump(mode="json", exclude={"resources"})})
    ctx.tracker.log_metrics(metrics, 0)
    ctx.tracker.log_table(table, "judged_examples")
    ctx.tracker.log_figure(win_rate_figure([summary], f"judge {s.id} ({reward_name})"), "win_rate.png")
    return StageResult(outputs={"results": str(results)}, metrics=metrics, key_metric="judge/win_rate",
                       info={"win_rates": [summary]})
