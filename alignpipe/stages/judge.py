"""`judge` stage: generate from every model on the same prompts, then compare each pair, either by a
per-completion score (rule, callable or reward model) or by a pairwise LLM judge, into win rates with
Wilson intervals; with more than two models, the full win-rate matrix."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import cast

from alignpipe.data.sources import load_raw
from alignpipe.engine.hf import HFEngine
from alignpipe.judges.http_endpoints import endpoint_api_key
from alignpipe.judges.pairwise import EndpointJudge, LocalJudge, judge_pairs, unreadable_rate
from alignpipe.judges.rewards import load_reward_fn, score
from alignpipe.judges.winrate import WinRate, from_verdicts, matrix, verdict
from alignpipe.plots import win_rate_figure
from alignpipe.positions import check_generation_window, model_position_limit
from alignpipe.recipe.stages import FormatStage, JudgeStage, LLMJudgeSpec
from alignpipe.special_tokens import encode
from alignpipe.stages.context import StageContext, StageResult
from alignpipe.tool_calls import ToolRunner, load_tools
from alignpipe.trainers.online import extra_columns

log = logging.getLogger(__name__)


def generate(
    ctx: StageContext[JudgeStage], ref: str, prompts: list[str], tool_stage: FormatStage | None = None
) -> list[str]:
    """Model `ref`'s completion of each prompt; where the prompts offer tools (`tool_stage`: the format stage that
    rendered them), the model calls them as in training and its last turn is its answer."""
    s = ctx.stage
    model, tokenizer = ctx.load_model(ref, merge=True), ctx.tokenizer(ref)
    limit = model_position_limit(model)
    check_generation_window(limit, tokenizer, prompts, s.sampling.max_new_tokens, f"judge {s.id!r}, model {ref!r}")
    engine = HFEngine(model, tokenizer, batch_size=s.batch_size, progress=f"{s.id}: generating with {ref}")
    if tool_stage is None:
        return [g.completion for g in engine.generate(prompts, 1, s.sampling, seed=ctx.seed)]
    runner = ToolRunner.for_model(
        load_tools(tool_stage.tools), tokenizer, model, s.tool_call_format, s.sampling.max_new_tokens,
        s.max_tool_calling_iterations, tool_stage.chat_template_kwargs,
    )  # fmt: skip
    ids = encode(tokenizer, prompts)
    gens = engine.generate(ids, 1, s.sampling, seed=ctx.seed)
    return runner.turns(engine, ids, gens, s.sampling, ctx.seed, False).answers


def prompt_rows(ctx: StageContext[JudgeStage]) -> list[dict]:
    s = ctx.stage
    source = s.prompts_file or f"{s.prompts} / {s.split}"
    if s.prompts_file:
        rows = load_raw(s.prompts_file).to_list()
    else:
        assert s.prompts is not None  # validation: exactly one of prompts, prompts_file
        rows = ctx.rows(s.prompts, s.split)
    rows = rows[: s.num_prompts]
    if not rows:
        raise ValueError(f"no prompts to judge ({source})")
    if "prompt" not in rows[0]:
        raise ValueError(f"the judge's prompts have no `prompt` column (columns: {sorted(rows[0])})")
    return rows


def scorer(ctx: StageContext[JudgeStage]):
    """(name, fn) of the per-completion scorer, loaded before any generation so a bad one fails first."""
    s = ctx.stage
    if s.reward_model:
        from alignpipe.judges.reward_model import RewardModelScorer

        return f"reward model {s.reward_model}", RewardModelScorer(
            ctx.inputs[s.reward_model].outputs["model"], s.batch_size
        )
    return s.reward, load_reward_fn(s.reward)


def llm_judge(ctx: StageContext[JudgeStage]):
    assert ctx.stage.llm_judge is not None
    return local_or_endpoint_judge(ctx, ctx.stage.llm_judge, progress=f"{ctx.stage.id}: judging")


def local_or_endpoint_judge(ctx: StageContext, spec: LLMJudgeSpec, progress: str | None = None):
    """(name, judge) for a pairwise LLM judge spec: a local model (stage id, path or Hub id) or an endpoint; an
    endpoint judge shows a bar labelled `progress` for each call."""
    assert spec.url or spec.model  # validation: exactly one of model, url
    if spec.url:
        judge = EndpointJudge(
            spec.url,
            model=spec.served_model,
            max_new_tokens=spec.max_new_tokens,
            template_kwargs=spec.chat_template_kwargs,
            api_key=endpoint_api_key(spec.api_key_env, "llm_judge.api_key_env"),
            concurrency=spec.concurrency,
            progress=progress,
        )
        return f"LLM judge {spec.url}" + (f" ({spec.served_model})" if spec.served_model else ""), judge
    model = cast(str, spec.model)
    name = f"LLM judge {model}"
    return name, LocalJudge(
        ctx.load_model(model, merge=True),
        ctx.tokenizer(model),
        spec.max_new_tokens,
        chat_template=spec.chat_template,
        name=name,
        template_kwargs=spec.chat_template_kwargs,
    )


def run(ctx: StageContext[JudgeStage]) -> StageResult:
    s = ctx.stage
    judge_name, judge_fn = llm_judge(ctx) if s.llm_judge else scorer(ctx)
    rows = prompt_rows(ctx)
    prompts = [r["prompt"] for r in rows]
    columns = extra_columns(rows)
    models = list(dict.fromkeys(s.candidates + s.baselines))
    data = ctx.recipe.stage(s.prompts) if s.prompts else None
    offered = data if isinstance(data, FormatStage) and data.tools else None
    outputs = {m: generate(ctx, m, prompts, offered) for m in models}
    pairs = s.pairs
    scores = {} if s.llm_judge else {m: score(judge_fn, judge_name, prompts, outputs[m], columns) for m in models}
    results: dict[tuple[str, str], WinRate] = {}
    unreadable: dict[tuple[str, str], float] = {}
    table = []
    for c, b in pairs:
        if s.llm_judge:
            records = judge_pairs(judge_fn, s.llm_judge.template, prompts, outputs[c], outputs[b])
            unreadable[(c, b)] = unreadable_rate(records, judge_name, f"{c} vs {b}", log)
        else:
            records = [
                {
                    "candidate_score": cs,
                    "baseline_score": bs,
                    "verdict": "n/a" if cs is None or bs is None else verdict(cs, bs),
                }
                for cs, bs in zip(scores[c], scores[b])
            ]
        verdicts = [r["verdict"] for r in records if r["verdict"] != "n/a"]
        if not verdicts:
            raise ValueError(f"{judge_name} could not score any prompt for {c} vs {b}")
        results[(c, b)] = from_verdicts(verdicts)
        table += [
            {
                "candidate": c,
                "baseline": b,
                "prompt": p,
                "candidate_completion": outputs[c][i],
                "baseline_completion": outputs[b][i],
                **records[i],
            }
            for i, p in enumerate(prompts)
        ]
    summaries = [
        {"candidate": c, "baseline": b, "judge": judge_name, "n": wr.n, **wr.as_dict()}
        for (c, b), wr in results.items()
    ]
    for w in summaries:
        log.info(
            "%s vs %s: win rate %.3f [%.3f, %.3f] (%d wins, %d ties, %d losses; %s)",
            w["candidate"],
            w["baseline"],
            w["win_rate"],
            w["ci_low"],
            w["ci_high"],
            w["wins"],
            w["ties"],
            w["losses"],
            judge_name,
        )
    primary = results[pairs[0]]
    metrics = {
        "judge/win_rate": primary.win_rate,
        "judge/ci_low": primary.ci_low,
        "judge/ci_high": primary.ci_high,
        "judge/wins": primary.wins,
        "judge/ties": primary.ties,
        "judge/losses": primary.losses,
    }
    if scores:
        for m in models:
            valid = [x for x in scores[m] if x is not None]
            metrics[f"judge/score/{m}"] = sum(valid) / len(valid) if valid else 0.0
        metrics["judge/candidate_score"] = metrics[f"judge/score/{pairs[0][0]}"]
        metrics["judge/baseline_score"] = metrics[f"judge/score/{pairs[0][1]}"]
    if unreadable:
        metrics["judge/unreadable_rate"] = unreadable[pairs[0]]
    per_pair = {
        f"judge/{c}_vs_{b}/{name}": value
        for (c, b), wr in results.items()
        for name, value in (("win_rate", wr.win_rate), ("ci_low", wr.ci_low), ("ci_high", wr.ci_high))
    } | {f"judge/{c}_vs_{b}/unreadable_rate": rate for (c, b), rate in unreadable.items()}
    grid = matrix(models, results) if len(models) > 2 else None
    results_path = Path(ctx.dir) / "results.json"
    results_path.write_text(
        json.dumps({"summary": summaries, "models": models, "matrix": grid, "examples": table}, indent=1)
    )
    ctx.tracker.log_params({"judge": s.model_dump(mode="json", exclude={"resources"})})
    # MLflow gets the per-pair rates only when there are several pairs: with one, they repeat judge/* (the manifest
    # keeps them either way, for gates such as `judge.sft_vs_base/win_rate`)
    ctx.tracker.log_metrics(metrics | (per_pair if len(results) > 1 else {}), 0)
    ctx.tracker.log_table(table, "judged_examples")
    shown = [
        w for w in summaries if (w["candidate"], w["baseline"]) in [(c, b) for c in s.candidates for b in s.baselines]
    ]
    title = f"Win rate, stage {s.id!r} ({judge_name})"
    ctx.tracker.log_figure(win_rate_figure(shown or summaries, title), "win_rate.png")
    report = report_markdown(s.id, judge_name, summaries, models, grid)
    (Path(ctx.dir) / "report.md").write_text(report)
    ctx.tracker.log_artifact(Path(ctx.dir) / "report.md")
    return StageResult(
        outputs={"results": str(results_path)},
        metrics=metrics | per_pair,
        key_metric="judge/win_rate",
        info={"win_rates": summaries, "models": models, "matrix": grid, "report": report},
    )


def report_markdown(stage_id: str, judge_name: str, summaries: list[dict], models: list[str], grid) -> str:
    lines = [
        f"# Judge `{stage_id}` ({judge_name})",
        "",
        "| candidate | baseline | win rate | 95% interval | wins | ties | losses |",
        "|---|---|---|---|---|---|---|",
    ]
    lines += [
        f"| {w['candidate']} | {w['baseline']} | {w['win_rate']:.3f} | [{w['ci_low']:.3f}, {w['ci_high']:.3f}] | "
        f"{w['wins']} | {w['ties']} | {w['losses']} |"
        for w in summaries
    ]
    if grid:
        lines += [
            "",
            "Win rate of the row model against the column model:",
            "",
            "| | " + " | ".join(models) + " |",
            "|---" * (len(models) + 1) + "|",
        ]
        lines += [
            f"| {m} | " + " | ".join("–" if v is None else f"{v:.3f}" for v in row) + " |"
            for m, row in zip(models, grid)
        ]
    return "\n".join(lines) + "\n"
