"""The `math_answer` reward (final answer of a worked solution against a reference) and the shipped GSM8K GRPO recipe,
run end to end on the tiny model with GSM8K-shaped rows."""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from alignpipe.judges.math_answer import answers_equal, marked_answer, math_answer
from alignpipe.recipe import load_recipe, parse_recipe
from alignpipe.recipe.errors import RecipeError

GSM8K_REFERENCE = (
    "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\nAltogether she sold 48+24 = <<48+24=72>>72 clips.\n#### 72"
)


@pytest.mark.parametrize(
    "completion,reference,paid",
    [
        ("48 + 24 = 72, so she sold \\boxed{72} clips.", GSM8K_REFERENCE, 1.0),
        ("She sold 48 + 24 = 72 clips in all.", GSM8K_REFERENCE, 1.0),  # no marker: the last number
        ("In May 24, in all 70. \\boxed{70}", GSM8K_REFERENCE, 0.0),
        ("First \\boxed{72}, no wait: \\boxed{96}", GSM8K_REFERENCE, 0.0),  # the last boxed answer counts
        ("The answer is 72. (Check: 72 - 24 = 48.)", GSM8K_REFERENCE, 1.0),  # "answer is" beats the last number
        ("<think>48/2 = 24</think><answer>72</answer>", GSM8K_REFERENCE, 1.0),
        ("So \\boxed{\\$1,000.00}", "#### 1000", 1.0),
        ("\\boxed{\\dfrac{3}{4}}", "0.75", 1.0),
        ("\\boxed{-3/4}", "\\frac{-3}{4}", 1.0),
        ("\\boxed{x = 5}", "5", 1.0),
        ("\\boxed{50\\%}", "50", 1.0),
        ("\\boxed{\\frac{\\sqrt{3}}{2}}", "\\frac{\\sqrt3}{2}", 0.0),  # no symbolic equivalence, said in the docs
        ("\\boxed{\\frac{\\sqrt{3}}{2}}", "The area is $\\boxed{\\frac{\\sqrt{3}}{2}}$.", 1.0),  # nested braces
        ("\\boxed{\\text{(B)}}", "(B)", 1.0),
        ("The answer isn't 70; adding again gives 72", GSM8K_REFERENCE, 1.0),  # no "answer is": the last number
        ("Final answer: 72 clips", GSM8K_REFERENCE, 1.0),
        ("I cannot tell.", GSM8K_REFERENCE, 0.0),
        ("", GSM8K_REFERENCE, 0.0),
    ],
)
def test_math_answer_pays_the_final_answer(completion, reference, paid):
    assert math_answer(["q"], [completion], answer=[reference]) == [paid]


def test_math_answer_without_a_reference_is_not_applicable():
    assert math_answer(["q", "q"], ["1", "2"]) == [None, None]
    assert math_answer(["q", "q"], ["1", "2"], answer=[None, "  "]) == [None, None]


def test_last_number_fallback_off_pays_only_marked_answers():
    assert math_answer(["q"], ["so 72"], answer=["72"], last_number_fallback=False) == [0.0]
    assert math_answer(["q"], ["so \\boxed{72}"], answer=["72"], last_number_fallback=False) == [1.0]


def test_extraction_and_comparison_pieces():
    assert marked_answer("text without a marked answer, 3 and 4") is None
    assert marked_answer("#### 1,234 apples") == "1,234"
    assert marked_answer("\\boxed{a{b}c} then \\boxed{broken") == "a{b}c"
    assert answers_equal("72.0", "72") and answers_equal("1,000", "1000")
    assert not answers_equal("", "") and not answers_equal("7", "72")


def test_math_answer_options_are_checked_in_the_recipe(tiny):
    text = (
        (Path(__file__).parents[1] / "pipelines" / "tiny-grpo.yaml")
        .read_text()
        .replace("assets/tiny", str(tiny))
        .replace("{function: exact_match}", "{function: math_answer, kwargs: {last_number: false}}")
    )
    with pytest.raises(RecipeError) as e:
        parse_recipe(text)
    assert "unknown option 'last_number' (did you mean 'last_number_fallback'?)" in str(e.value)


def gsm8k_rows(n: int, seed: int = 0) -> list[dict]:
    """Rows shaped like openai/gsm8k (`question`, `answer` = worked solution ending in `#### N`)."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        a, b = rng.randint(2, 40), rng.randint(2, 40)
        rows.append(
            {
                "question": f"Sam has {a} marbles and finds {b} more. How many marbles does Sam have now?",
                "answer": f"Sam has {a} + {b} = <<{a}+{b}={a + b}>>{a + b} marbles.\n#### {a + b}",
            }
        )
    return rows


@pytest.mark.parametrize("name", ["qwen2.5-0.5b-gsm8k-grpo.yaml", "qwen2.5-0.5b-gsm8k-tools-grpo.yaml"])
def test_gsm8k_grpo_recipe_runs_on_gsm8k_shaped_rows(prefect_harness, tiny, tmp_path, name):
    """The shipped recipes (plain, and with the calculator), their model and dataset swapped for the tiny model and
    local GSM8K-shaped files and their sizes shrunk: the system prompt (and the tool) reaches the chat-rendered
    prompts, the `answer` column reaches the reward in GRPO and in the judge (a missing column would make every reward
    NaN), and the push gate reads the accuracies."""
    from test_pipeline_flow import run_flow, summary_of

    for split, n in (("train", 48), ("test", 12)):
        (tmp_path / f"gsm8k-{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in gsm8k_rows(n, len(split))))
    text = (Path(__file__).parents[1] / "pipelines" / name).read_text()
    text = text.replace("Qwen/Qwen2.5-0.5B-Instruct", str(tiny / "model")).replace("bfloat16", "float32")
    text = text.replace("./runs", str(tmp_path / "runs")).replace("    subset: main\n", "")
    for split in ("train", "test"):
        text = text.replace(
            f"path: openai/gsm8k\n    split: {split}", f"path: {tmp_path / f'gsm8k-{split}.jsonl'}\n    split: train"
        )
    path = tmp_path / "gsm8k-grpo.yaml"
    path.write_text(text)
    small = [
        "stages.grpo.max_steps=2",
        "stages.grpo.logging_every=1",
        "stages.grpo.batch_size=8",
        "stages.grpo.num_generations=4",
        "stages.grpo.gradient_accumulation_steps=1",
        "stages.grpo.max_completion_length=12",
        "stages.judge.num_prompts=8",
        "stages.judge.sampling.max_new_tokens=12",
        "stages.publish.target=local",
        "stages.grpo.resources.gpus=0",
        "stages.judge.resources.gpus=0",
    ]
    state = run_flow(path, small)
    assert state.is_completed()
    summary = summary_of(path, state, small)
    status = {s["stage_id"]: s for s in summary["stages"]}
    assert [status[s]["status"] for s in ("problems", "test-problems", "grpo", "judge")] == ["done"] * 4

    recipe = load_recipe(path, small)
    import datasets

    rows = datasets.load_from_disk(status["problems"]["output"])["train"].to_list()
    assert len(rows) == 48 and "our final answer within \\boxed{}" in rows[0]["prompt"]
    assert ("tools: calculator" in rows[0]["prompt"]) == ("tools" in name)  # the tiny template lists tools by name
    assert rows[0]["answer"].startswith("Sam has ") and "\n#### " in rows[0]["answer"]

    client = MlflowClient(recipe.tracking_uri)
    tags = client.get_run(summary["mlflow_run_id"]).data.tags
    grpo_run, judge_run = (tags[f"alignpipe.stage_run.{stage}"] for stage in ("grpo", "judge"))
    grpo = [m.value for m in client.get_metric_history(grpo_run, "train/rewards/math_answer/mean")]
    assert grpo and all(0.0 <= v <= 1.0 for v in grpo), grpo
    calls = client.get_metric_history(grpo_run, "train/tools/call_frequency")
    assert bool(calls) == ("tools" in name)  # the rollouts ran the tool path
    judge = client.get_run(judge_run).data.metrics
    for score in ("judge/candidate_score", "judge/baseline_score"):
        assert not math.isnan(judge[score]) and 0.0 <= judge[score] <= 1.0
    # The gate decided from the two accuracies (the push goes to a local folder here).
    if judge["judge/candidate_score"] > judge["judge/baseline_score"]:
        assert status["publish"]["status"] == "done"
    else:
        assert status["publish"]["status"] == "skipped"
        assert "judge.candidate_score > judge.baseline_score` is false" in status["publish"]["message"]
