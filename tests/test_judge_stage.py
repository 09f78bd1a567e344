"""The judge stage in-process: several models and their win-rate matrix, pairwise LLM judges (local and
over an OpenAI-compatible endpoint), prompts from a file, models given by path."""

from __future__ import annotations

import json
import re

import pytest
import torch
from loopback import serve
from support import known

from alignpipe.judges.pairwise import combine, parse_verdict
from alignpipe.judges.winrate import WinRate, from_verdicts, matrix
from alignpipe.recipe import parse_recipe
from alignpipe.stages import judge as judge_stage
from alignpipe.stages.context import StageContext
from alignpipe.tracking import Tracker


@pytest.fixture(scope="module")
def models(tiny, tmp_path_factory):
    """Three model folders: the tiny base and two perturbed copies."""
    from alignpipe.modeling import load_causal_lm, load_tokenizer

    root = tmp_path_factory.mktemp("judge-models")
    tok = load_tokenizer(str(tiny / "model"))
    paths = [str(tiny / "model")]
    for k in (1, 2):
        m = load_causal_lm(str(tiny / "model"))
        g = torch.Generator().manual_seed(k)
        with torch.no_grad():
            for p in m.parameters():
                p.add_(0.05 * torch.randn(p.shape, generator=g))
        m.save_pretrained(root / f"m{k}")
        tok.save_pretrained(root / f"m{k}")
        paths.append(str(root / f"m{k}"))
    prompts = root / "prompts.jsonl"
    prompts.write_text(
        "".join(
            json.dumps({"prompt": p, "topic": "film"}) + "\n"
            for p in ["The film", "I watched it and", "Critics say", "My review:", "After the movie,", "The cast"]
        )
    )
    return tiny, paths, prompts


def context(tiny, tmp_path, stage_yaml: str) -> StageContext:
    text = f"name: j\nmodel: {{path: {tiny / 'model'}}}\nstages:\n{stage_yaml}"
    recipe = parse_recipe(text, check_files=False)
    return StageContext(recipe, recipe.stages[0], tmp_path, {}, Tracker())


def llm_judged(paths: list[str], prompts, llm_judge: str, max_new_tokens: int) -> str:
    """A judge stage: the second model against the first, judged by `llm_judge: {...}`."""
    return f"""  - id: judge
    kind: judge
    candidate: {paths[1]}
    baseline: {paths[0]}
    prompts_file: {prompts}
    llm_judge: {{{llm_judge}}}
    sampling: {{temperature: 0.9, max_new_tokens: {max_new_tokens}}}
"""


def test_three_models_give_a_consistent_win_rate_matrix(models, tmp_path):
    tiny, paths, prompts = models
    ctx = context(
        tiny,
        tmp_path,
        f"""  - id: judge
    kind: judge
    candidate: [{paths[1]}, {paths[2]}]
    baseline: {paths[0]}
    prompts_file: {prompts}
    reward: length
    sampling: {{temperature: 0.9, max_new_tokens: 12}}
""",
    )
    result = judge_stage.run(ctx)
    grid = result.info["matrix"]
    assert result.info["models"] == [paths[1], paths[2], paths[0]] and len(grid) == 3
    for i in range(3):
        assert grid[i][i] is None
        for j in range(3):
            if i != j:
                assert grid[i][j] + grid[j][i] == pytest.approx(1.0)
    assert len(result.info["win_rates"]) == 3, "2 candidate×baseline pairs + the candidates against each other"
    assert f"judge/{paths[1]}_vs_{paths[0]}/win_rate" in result.metrics
    assert all(ctx.stage.reports_metric(key) for key in result.metrics), "what `validate` lets a gate read"
    assert f"judge/score/{paths[2]}" in result.metrics
    saved = json.loads((tmp_path / "results.json").read_text())
    assert len(saved["examples"]) == 3 * 6 and {
        "prompt",
        "candidate_completion",
        "baseline_completion",
        "verdict",
    } <= set(saved["examples"][0])
    assert "Win rate of the row model against the column model" in (tmp_path / "report.md").read_text()
    assert ctx.tracker.tables["judged_examples"]


def test_llm_judge_over_an_endpoint_judges_both_orders(models, tmp_path):
    """The stand-in judge prefers the longer response, so its two orders agree unless lengths tie."""
    tiny, paths, prompts = models

    def chat(method, path, body, headers):
        if path == "/v1/models":
            return 200, {"data": [{"id": "judge-llm"}]}
        text = body["messages"][0]["content"]
        a = known(re.search(r"Response A:\n(.*)\n\nResponse B:", text, re.S)).group(1)
        b = known(re.search(r"Response B:\n(.*)\n\nWhich", text, re.S)).group(1)
        return 200, {
            "choices": [{"message": {"content": "A" if len(a) > len(b) else "B" if len(b) > len(a) else "tie?"}}]
        }

    with serve(chat) as url:
        ctx = context(
            tiny,
            tmp_path,
            llm_judged(paths, prompts, f"url: {url}", 12),
        )
        result = judge_stage.run(ctx)
        calls = [r for r in url.requests if r["path"] == "/v1/chat/completions"]
    assert len(calls) == 2 * 6, "every pair judged in both orders"
    rows = ctx.tracker.tables["judged_examples"]
    for r in rows:
        c, b = len(r["candidate_completion"]), len(r["baseline_completion"])
        assert r["verdict"] == ("win" if c > b else "loss" if c < b else "tie")
    wr = result.info["win_rates"][0]
    assert wr["wins"] + wr["ties"] + wr["losses"] == 6 and wr["judge"].startswith("LLM judge")
    assert all(ctx.stage.reports_metric(key) for key in result.metrics), "what `validate` lets a gate read"
    assert "judge/candidate_score" not in result.metrics and not ctx.stage.reports_metric("candidate_score")


def test_a_local_llm_judge_that_never_names_a_letter_judges_nothing(models, tmp_path):
    """The random tiny judge answers no A or B: every pair would be a tie and the win rate 0.5 by construction, so the
    stage fails saying so, with what it answered and what to change."""
    tiny, paths, prompts = models
    ctx = context(
        tiny,
        tmp_path,
        llm_judged(paths, prompts, f"model: {paths[2]}, max_new_tokens: 4", 8),
    )
    with pytest.raises(ValueError, match=r"named neither A nor B in any of its 12 answers .*\(the first: '") as e:
        judge_stage.run(ctx)
    assert "raise llm_judge.max_new_tokens" in str(e.value) and "enable_thinking: false" in str(e.value)


def test_unreadable_answers_are_ties_counted_and_warned_about(models, tmp_path, caplog):
    """A judge that names neither letter in a third of its answers: those pairs are ties, the share is a metric a
    gate can read (`judge.unreadable_rate`), and the stage warns."""
    import logging

    tiny, paths, prompts = models
    answers = iter(["A", "B", "I cannot decide"] * 10)

    def chat(method, path, body, headers):
        return 200, {"choices": [{"message": {"content": next(answers)}}]}

    with serve(chat) as url:
        ctx = context(
            tiny,
            tmp_path,
            llm_judged(paths, prompts, f"url: {url}, served_model: j, concurrency: 1", 8),
        )
        with caplog.at_level(logging.WARNING, logger="alignpipe.stages.judge"):
            result = judge_stage.run(ctx)
    rows = ctx.tracker.tables["judged_examples"]
    assert result.metrics["judge/unreadable_rate"] == pytest.approx(sum(r["unreadable"] for r in rows) / 12)
    assert result.metrics["judge/unreadable_rate"] == pytest.approx(4 / 12)
    for r in rows:
        assert r["verdict"] == combine(parse_verdict(r["judge_forward"]), parse_verdict(r["judge_swapped"]))
        assert r["unreadable"] == [parse_verdict(r["judge_forward"]), parse_verdict(r["judge_swapped"])].count(None)
    assert any("named neither A nor B in 33% of its answers" in m for m in caplog.messages), caplog.messages
    assert ctx.stage.reports_metric("unreadable_rate") and ctx.stage.reports_metric(
        f"{paths[1]}_vs_{paths[0]}/unreadable_rate"
    )


def test_a_local_judge_is_asked_through_its_chat_template(tiny):
    """An instruct judge gets the filled template as a user turn (as an endpoint's server renders a chat request); a
    base-model judge, or `chat_template: false`, the raw text."""
    from alignpipe.judges.pairwise import LocalJudge
    from alignpipe.modeling import load_causal_lm, load_tokenizer

    model, tok = load_causal_lm(str(tiny / "model")), load_tokenizer(str(tiny / "model"))
    sent = []

    def generate(prompts, n, sampling):
        sent.extend(prompts)
        return [type("G", (), {"completion": "A"})() for _ in prompts]

    for chat in (True, False):
        judge = LocalJudge(model, tok, chat_template=chat)
        judge.engine.generate = generate  # type: ignore[method-assign,assignment]
        assert judge(["Which is better? A or B."]) == ["A"]
    assert sent == ["<|user|>Which is better? A or B.<|end|><|assistant|>", "Which is better? A or B."]


def test_a_local_judge_with_a_learned_position_table_fails_before_generating(tiny, tmp_path):
    """The judge reads its template with the prompt and both completions: longer than a GPT-2-style table, it says
    which setting to lower instead of an index error inside the forward pass."""
    from transformers import GPT2Config, GPT2LMHeadModel

    from alignpipe.judges.pairwise import LocalJudge
    from alignpipe.modeling import load_tokenizer

    tok = load_tokenizer(str(tiny / "model"))
    small = GPT2LMHeadModel(GPT2Config(vocab_size=len(tok), n_positions=32, n_embd=16, n_layer=1, n_head=2))
    judge = LocalJudge(small, tok, max_new_tokens=8, name="LLM judge gpt2")
    with pytest.raises(
        ValueError, match=r"LLM judge gpt2: the longest prompt is \d+ tokens, and with llm_judge.max_new_tokens \(8\)"
    ):
        judge(["great " * 40])
    assert judge(["great"]) is not None


def test_verdicts_and_matrix_by_hand():
    assert (
        parse_verdict(" B, clearly") == "B" and parse_verdict("neither") is None and parse_verdict("Answer: A") == "A"
    )
    assert (
        combine("A", "B") == "win"
        and combine("B", "A") == "loss"
        and combine("A", "A") == "tie"
        and combine(None, "B") == "tie"
    )
    wr = from_verdicts(["win", "win", "win", "tie", "loss"])
    assert (wr.wins, wr.ties, wr.losses) == (3, 1, 1) and wr.win_rate == pytest.approx(0.7)
    # Wilson by hand: p = 0.7, n = 5, z² = 3.8416 → centre 0.61311 ± 0.31432
    assert wr.ci_low == pytest.approx(0.2988, abs=1e-4) and wr.ci_high == pytest.approx(0.9274, abs=1e-4)
    grid = matrix(["a", "b", "c"], {("a", "b"): WinRate(3, 0, 1, 0.75, 0, 1), ("c", "a"): WinRate(1, 0, 3, 0.25, 0, 1)})
    assert grid == [[None, 0.75, 0.75], [0.25, None, None], [0.25, None, None]]


def test_judge_config_errors(tiny):
    def problems(stage: str) -> str:
        from alignpipe.recipe import RecipeError

        with pytest.raises(RecipeError) as e:
            parse_recipe(f"name: j\nmodel: {{path: {tiny / 'model'}}}\nstages:\n{stage}", check_files=False)
        return str(e.value)

    assert "exactly one of `prompts`" in problems("  - {id: j, kind: judge, candidate: base}")
    assert "exactly one of `model` (local judge) or `url`" in problems(
        "  - {id: j, kind: judge, candidate: base, prompts_file: x.jsonl, llm_judge: {}}"
    )
    assert "template is missing {response_b}" in problems(
        "  - {id: j, kind: judge, candidate: base, prompts_file: x.jsonl, llm_judge: {url: http://x, template: '{prompt} {response_a}'}}"
    )
    assert "no stage named 'sfft'" in problems(
        "  - {id: j, kind: judge, candidate: [base, sfft], prompts_file: x.jsonl}"
    )


def test_a_judges_chat_template_kwargs_reach_its_template_or_endpoint(tiny):
    """`llm_judge.chat_template_kwargs` (e.g. Qwen3's enable_thinking: false) render into a local judge's turn, and go
    to an endpoint as the request's `chat_template_kwargs`; without them the request carries none."""
    from alignpipe.judges.pairwise import EndpointJudge, LocalJudge
    from alignpipe.modeling import load_causal_lm, load_tokenizer

    template = (
        "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}<|assistant|>"
        "{% if enable_thinking is defined and not enable_thinking %}<think></think>{% endif %}"
    )
    model, tok = load_causal_lm(str(tiny / "model")), load_tokenizer(str(tiny / "model"), chat_template=template)
    judge = LocalJudge(model, tok, template_kwargs={"enable_thinking": False})
    assert judge.render("A or B?") == "<|user|>A or B?<|end|><|assistant|><think></think>"

    def chat(method, path, body, headers):
        return 200, {"choices": [{"message": {"content": "A"}}]}

    with serve(chat) as url:
        assert EndpointJudge(url, model="j", template_kwargs={"enable_thinking": False})(["A or B?"]) == ["A"]
        assert EndpointJudge(url, model="j")(["A or B?"]) == ["A"]
        bodies = [r["body"] for r in url.requests if r["path"] == "/v1/chat/completions"]
    assert bodies[0]["chat_template_kwargs"] == {"enable_thinking": False} and "chat_template_kwargs" not in bodies[1]
