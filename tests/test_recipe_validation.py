"""Bad recipes fail with the field path, the YAML line and a fix; the CLI exits 2 and writes nothing."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from pydantic import BaseModel

from alignpipe.recipe import RecipeError, parse_recipe
from alignpipe.recipe.stages import DPOStage, GRPOStage, JudgeStage, PPOStage, SFTStage


def problems_of(text: str, overrides=()) -> str:
    with pytest.raises(RecipeError) as e:
        parse_recipe(text, overrides)
    return str(e.value)


def test_demo_recipe_is_valid(demo_text):
    recipe = parse_recipe(demo_text)
    assert [s.id for s in recipe.topological_order()] == ["sft-data", "eval-prompts", "sft", "judge", "publish"]
    assert recipe.stage("sft", SFTStage).learning_rate == 1e-3
    assert recipe.ancestors("publish") == ["sft-data", "eval-prompts", "sft", "judge"]


def test_unknown_top_level_key_suggests_the_right_one(demo_text):
    msg = problems_of(demo_text.replace("seed: 0", "seeed: 0"))
    assert "unknown key 'seeed'" in msg and "did you mean 'seed'" in msg


def test_unknown_stage_key_names_stage_path_and_line(demo_text):
    text = demo_text.replace("    learning_rate: 1.0e-3", "    learning_rat: 1.0e-3")
    line = text.splitlines().index("    learning_rat: 1.0e-3") + 1
    msg = problems_of(text)
    assert "stages[2].learning_rat (stage 'sft')" in msg
    assert f"line {line}" in msg
    assert "did you mean 'learning_rate'" in msg


def test_wrong_type_is_reported_with_the_value(demo_text):
    msg = problems_of(demo_text.replace("max_steps: 150", "max_steps: many"))
    assert "stages[2].max_steps" in msg and "must be a whole number (got 'many')" in msg
    assert "fix: write `max_steps:` as a whole number" in msg, "says what to write, not only what the field is"
    msg = problems_of(demo_text.replace("eval_fraction: 0.1", "eval_fraction: lots"))
    assert "write `eval_fraction:` as a number, e.g. `eval_fraction: 0.1` (the default)" in msg


def test_a_bad_set_override_is_attributed_to_the_override_not_a_line(demo_text):
    msg = problems_of(demo_text, ["stages.sft.lr_scheduler=cosin"])
    assert "from --set stages.sft.lr_scheduler=cosin" in msg and ", line " not in msg.split("\n")[1], msg
    assert "one of 'cosine', 'linear' or 'constant'" in msg


def test_unknown_stage_kind_lists_kinds(demo_text):
    msg = problems_of(demo_text.replace("kind: sft\n", "kind: sftt\n"))
    assert (
        "unknown stage kind 'sftt'" in msg
        and "format, sft, reward, dpo, kto, grpo, rloo, ppo, online_dpo, judge, push" in msg
    )


def test_duplicate_stage_ids(demo_text):
    msg = problems_of(demo_text.replace("id: eval-prompts", "id: sft-data"))
    assert "duplicate stage id 'sft-data'" in msg and "stages[1].id" in msg


def test_missing_needs(demo_text):
    msg = problems_of(demo_text.replace("    target: local ", "    needs: [judgment]\n    target: local "))
    assert "stages[4].needs[0]" in msg and "no stage named 'judgment'" in msg and "name one of" in msg


def test_gate_syntax_and_stages_are_checked(demo_text):
    msg = problems_of(demo_text.replace("when: judge.win_rate >= 0.55 and", "when: judge.win_rate >= and"))
    assert "stages[4].when" in msg and "bad condition" in msg
    msg = problems_of(demo_text.replace("when: judge.win_rate", "when: judges.win_rate"))
    assert "the condition reads stage 'judges', which does not exist" in msg
    msg = problems_of(demo_text.replace("when: judge.win_rate >= 0.55", "when: __import__('os').system('x') >= 0.55"))
    assert "bad condition" in msg


@pytest.mark.parametrize(
    ("condition", "says"),
    [
        ("judge.winrate >= 0.55", "judge stage 'judge' reports no metric 'winrate'; did you mean 'win_rate'?"),
        ("judge.base_vs_sft/win_rate > 0.5", "reports no metric 'base_vs_sft/win_rate'"),
        ("judge.score/dpo > 0", "reports no metric 'score/dpo'"),
    ],
)
def test_a_gate_on_a_metric_the_judge_never_reports_fails_validation(demo_text, condition, says):
    """Caught before any stage runs, not when the gate is evaluated after the judge: the hint lists what it reports."""
    msg = problems_of(demo_text.replace("when: judge.win_rate >= 0.55 and judge.ci_low > 0.5", f"when: {condition}"))
    assert "stages[4].when (stage 'publish')" in msg and says in msg, msg
    assert "name one it reports: win_rate, ci_low, ci_high, wins, ties, losses, candidate_score" in msg
    assert "or a pair's rate: sft_vs_base/win_rate" in msg


@pytest.mark.parametrize(
    "condition",
    [
        "judge.judge/win_rate >= 0.5",
        "judge.sft_vs_base/ci_low > 0.5",
        "judge.score/sft > 0 and judge.candidate_score > judge.baseline_score",
        "judge.losses < 10 or not (judge.wins > 3)",
    ],
)
def test_gates_on_what_the_judge_reports_validate(demo_text, condition):
    recipe = parse_recipe(
        demo_text.replace("when: judge.win_rate >= 0.55 and judge.ci_low > 0.5", f"when: {condition}")
    )
    assert recipe.stage("publish").when == condition


def test_a_gate_reads_a_judge_s_scores_only_where_a_function_scores(demo_text):
    text = demo_text.replace("when: judge.win_rate >= 0.55 and judge.ci_low > 0.5", "when: judge.candidate_score > 0.5")
    text = text.replace("    reward: sentiment_lexicon ", "    llm_judge: {url: 'http://127.0.0.1:9'} ")
    assert "reports no metric 'candidate_score'" in problems_of(text)
    # and an LLM judge's share of unreadable answers only where an LLM judges
    gated = "judge.win_rate >= 0.55 and judge.unreadable_rate < 0.1"
    llm = text.replace("when: judge.candidate_score > 0.5", f"when: {gated}")
    assert parse_recipe(llm).stage("publish").when == gated
    scored = demo_text.replace("when: judge.win_rate >= 0.55 and judge.ci_low > 0.5", f"when: {gated}")
    assert "reports no metric 'unreadable_rate'" in problems_of(scored)


def test_cyclic_needs(demo_text):
    text = demo_text.replace("    data: sft-data\n", "    data: sft-data\n    needs: [publish]\n")
    msg = problems_of(text)
    assert "dependency cycle" in msg and "sft" in msg and "publish" in msg


def test_reference_to_a_stage_of_the_wrong_kind(demo_text):
    msg = problems_of(demo_text.replace("candidate: sft", "candidate: sft-data"))
    assert "stages[3].candidate" in msg
    assert "'sft-data' is a format stage and produces a dataset, but `candidate` needs a causal LM" in msg
    assert "base, sft" in msg


def test_sft_data_of_the_wrong_format(demo_text):
    msg = problems_of(demo_text.replace("data: sft-data", "data: eval-prompts"))
    assert "produces prompt_only data" in msg and "language_modeling or prompt_completion" in msg


def test_missing_dataset_file(demo_text, tiny):
    msg = problems_of(demo_text.replace("sentiment_sft.jsonl", "nope.jsonl"))
    assert "datasets.reviews.path" in msg and "does not exist" in msg and "make-tiny" in msg


def test_missing_mapped_column(demo_text, tiny):
    text = demo_text.replace("sentiment_sft.jsonl\n", "sentiment_sft.jsonl\n    columns: {prompt: review}\n")
    msg = problems_of(text)
    assert "datasets.reviews.columns.prompt" in msg and "column 'review' is not in" in msg
    assert "columns found: prompt, completion, label" in msg


def test_format_needs_columns_the_dataset_lacks(demo_text):
    msg = problems_of(demo_text.replace("format: prompt_completion", "format: preference"))
    assert "needs columns prompt+chosen+rejected" in msg and "map your columns" in msg


def test_hub_push_needs_repo_id(demo_text):
    msg = problems_of(demo_text.replace("target: local", "target: hub"))
    assert "repo_id" in msg


def test_one_run_lists_bad_values_and_bad_references_together(demo_text):
    """Bad values (a number out of range, a number of the wrong type) and the graph and data checks' problems come in
    one error: the checks run with each bad key left out, so fixing the values does not uncover a second list. Each
    problem is listed once, with its line."""
    text = (
        demo_text.replace("learning_rate: 1.0e-3", "learning_rate: -1")
        .replace("eval_every: 50", "eval_every: often")
        .replace("candidate: sft", "candidate: sfx")
        .replace("sentiment_sft.jsonl", "nope.jsonl")
    )
    lines = text.splitlines()
    msg = problems_of(text)
    assert "is invalid (4 problems)" in msg
    assert f"stages[2].learning_rate (stage 'sft'), line {lines.index('    learning_rate: -1') + 1}: " in msg
    assert "stages[2].eval_every (stage 'sft')" in msg and "must be a whole number (got 'often')" in msg
    assert (
        f"stages[3].candidate (stage 'judge'), line {lines.index('    candidate: sfx') + 1}: no stage named 'sfx'"
        in msg
    )
    assert "datasets.reviews.path" in msg and "does not exist" in msg


@pytest.mark.parametrize(
    "field_problem, says",
    [
        (("learning_rate: 1.0e-3", "learning_rat: 1.0e-3"), "unknown key 'learning_rat'"),  # perhaps a misspelt key
        (("kind: sft", "kind: sfx"), "unknown stage kind 'sfx'"),  # the whole stage untyped
        (("format: prompt_only", "format: prompt-only"), "format must be one of"),  # a data format others read
    ],
)
def test_checks_wait_where_leaving_the_bad_key_out_could_change_what_they_find(demo_text, field_problem, says):
    """Where a field problem is not a bad value alone (an unknown key, perhaps a misspelt `format:`; a stage kind or a
    data format other stages' checks read), the checks could object to a default the user never meant: the field
    problems come alone, and the checks' with the next run, as the fix asks."""
    text = demo_text.replace("candidate: sft", "candidate: sft-data")
    msg = problems_of(text.replace(*field_problem))
    assert says in msg and "is invalid (1 problem)" in msg
    msg = problems_of(text)
    assert "'sft-data' is a format stage" in msg and "is invalid (1 problem)" in msg


def test_a_stage_that_lost_a_bad_value_keeps_its_checks_for_the_next_run(demo_text):
    """What the checks find in a stage (or top-level section) whose bad value was left out is not listed: there a
    default the user did not write stands in, which a check could be objecting to. It comes with the next run."""
    text = demo_text.replace("learning_rate: 1.0e-3", "learning_rate: -1").replace(
        "data: sft-data", "data: eval-prompts"
    )
    msg = problems_of(text)
    assert "stages[2].learning_rate" in msg and "is invalid (1 problem)" in msg
    msg = problems_of(text.replace("learning_rate: -1", "learning_rate: 1.0e-3"))
    assert "produces prompt_only data" in msg and "is invalid (1 problem)" in msg


def test_yaml_syntax_error_has_a_line(demo_text):
    msg = problems_of(demo_text.replace("seed: 0", "seed: [0"))
    assert "not valid YAML" in msg and "line" in msg


def test_overrides_address_stages_by_id(demo_text):
    recipe = parse_recipe(demo_text, ["stages.sft.max_steps=7", "stages.judge.sampling.temperature=0", "seed=3"])
    assert recipe.stage("sft", SFTStage).max_steps == 7
    assert recipe.stage("judge", JudgeStage).sampling.greedy
    assert recipe.seed == 3
    with pytest.raises(TypeError, match="stage 'sft' is a sft stage, not a DPOStage"):
        recipe.stage("sft", DPOStage)  # a kind's fields, asked of a stage of another kind
    with pytest.raises(KeyError):
        recipe.stage("nope")
    msg = problems_of(demo_text, ["stages.nope.max_steps=7"])

    assert "no list item 'nope'" in msg and "sft-data" in msg


def test_every_field_is_documented():
    from alignpipe.recipe.schema import Recipe
    from alignpipe.recipe.specs import DatasetSpec, ModelSpec, Resources, Tracking
    from alignpipe.recipe.stages import STAGE_TYPES

    models: list[type[BaseModel]] = [Recipe, ModelSpec, DatasetSpec, Tracking, Resources, *STAGE_TYPES]
    for model in models:
        undocumented = [name for name, f in model.model_fields.items() if name != "kind" and not f.description]
        assert not undocumented, f"{model.__name__}: {undocumented}"


def _cli(args, cwd: Path, env_extra=None) -> subprocess.CompletedProcess:
    env = {**os.environ, **(env_extra or {})}
    return subprocess.run(
        [sys.executable, "-m", "alignpipe.cli", *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=120
    )


def test_cli_run_of_bad_recipe_exits_2_and_writes_nothing(demo_text, tmp_path):
    recipe = tmp_path / "bad.yaml"
    recipe.write_text(demo_text.replace("candidate: sft", "candidate: sft-data"))
    prefect_home = tmp_path / "prefect-home"
    out = _cli(["run", str(recipe)], tmp_path, {"PREFECT_HOME": str(prefect_home)})
    assert out.returncode == 2, out.stderr
    assert "stages[3].candidate" in out.stderr and "fix:" in out.stderr
    assert not (tmp_path / "runs").exists(), "no workdir, no MLflow store"
    assert not prefect_home.exists(), "no Prefect flow run (the server was never started)"


def test_cli_validate_ok_and_show(demo_text, tmp_path):
    recipe = tmp_path / "ok.yaml"
    recipe.write_text(demo_text)
    out = _cli(["validate", str(recipe)], tmp_path)
    assert out.returncode == 0 and "is valid" in out.stdout
    out = _cli(["show", str(recipe)], tmp_path)
    assert out.returncode == 0 and "[will run]" in out.stdout and "judge" in out.stdout
    lines = {line.split()[0]: line for line in out.stdout.splitlines()[1:]}
    assert "└─" not in out.stdout and "first" in lines["sft-data"], out.stdout
    assert "after: sft, eval-prompts" in lines["judge"] or "after: eval-prompts, sft" in lines["judge"], out.stdout
    assert not (tmp_path / "runs" / "tiny-demo" / "stages").exists()
    # columns: each stage's state, `after`/`first` and what it reads start where the others' do
    for column in (r"\[will run\]", "after: |first", "dataset=|model=|prompts="):
        found = [re.search(column, line) for line in lines.values()]
        assert all(found) and len({m.start() for m in found if m}) == 1, (column, out.stdout)


def test_show_says_where_each_finished_stage_s_products_are(demo_text, tmp_path, monkeypatch):
    """A cached stage's outputs under its line (what `vllm serve` or a notebook is pointed at), relative to the
    working directory; a stage still to run has none, and what is not a local path is shown as it is."""
    from alignpipe.manifest import Manifest
    from alignpipe.plan import plan
    from alignpipe.summary import dag_text

    monkeypatch.chdir(tmp_path)
    recipe = parse_recipe(demo_text)
    planned = plan(recipe)
    for stage, outputs in (
        ("sft-data", {"data": str(planned["sft-data"].dir / "data")}),
        ("sft", {"model": str(planned["sft"].dir / "model"), "registered": "models:/tiny-demo-sft@champion"}),
    ):
        planned[stage].dir.mkdir(parents=True)
        Manifest(stage_id=stage, kind="x", cache_key=planned[stage].key, outputs=outputs).write(planned[stage].dir)
    lines = dag_text(recipe, plan(recipe)).splitlines()
    at = {line.split()[0]: i for i, line in enumerate(lines)}
    assert "[cached]" in lines[at["sft-data"]] and "[cached]" in lines[at["sft"]]
    assert lines[at["sft-data"] + 1] == f"    data: runs/tiny-demo/stages/{planned['sft-data'].folder}/data"
    assert lines[at["sft"] + 1 : at["sft"] + 3] == [
        f"      model: runs/tiny-demo/stages/{planned['sft'].folder}/model",
        "      registered: models:/tiny-demo-sft@champion",
    ]
    assert lines[at["eval-prompts"] + 1].split()[0] == "sft", "a stage to run lists nothing"


def test_missing_recipe_file_exits_2(tmp_path):
    out = _cli(["validate", str(tmp_path / "none.yaml")], tmp_path)
    assert out.returncode == 2 and "not found" in out.stderr


def test_every_shipped_recipe_validates_again_from_its_dump(tiny):
    """What a stage process does: the plan hands it `recipe.model_dump(mode="json")`, which it validates again, every
    default now written out."""
    from alignpipe.recipe.schema import Recipe

    for path in sorted((Path(__file__).parents[1] / "pipelines").glob("*.yaml")):
        recipe = parse_recipe(path.read_text().replace("assets/tiny", str(tiny)), check_files=False)
        again = Recipe.model_validate(recipe.model_dump(mode="json"))
        assert again.model_dump(mode="json") == recipe.model_dump(mode="json"), path.name


def test_shipped_recipes_validate(tiny, tmp_path):
    """Every recipe in pipelines/ parses; those on the tiny assets also pass the file checks."""
    for path in sorted((Path(__file__).parents[1] / "pipelines").glob("*.yaml")):
        text = path.read_text().replace("assets/tiny", str(tiny))
        parse_recipe(text, source=str(path), check_files="assets/tiny" in path.read_text())


def dpo_recipe(tiny) -> str:
    return (Path(__file__).parents[1] / "pipelines" / "tiny-dpo.yaml").read_text().replace("assets/tiny", str(tiny))


def test_dpo_recipe_is_valid(tiny):
    recipe = parse_recipe(dpo_recipe(tiny))
    assert recipe.stage("dpo", DPOStage).beta == 0.1 and recipe.stage("rm").kind == "reward"


@pytest.mark.parametrize(
    "edit,expected",
    [
        ("beta: 0.1", "beta: 0"),
        ("beta: 0.1", "beta: -1"),
    ],
)
def test_dpo_beta_must_be_positive(tiny, edit, expected):
    msg = problems_of(dpo_recipe(tiny).replace(edit, expected))
    assert "stages[5].beta (stage 'dpo')" in msg and "greater than 0" in msg


def test_dpo_unknown_loss_type(tiny):
    msg = problems_of(dpo_recipe(tiny).replace("loss_type: sigmoid", "loss_type: kto"))
    assert "stages[5].loss_type" in msg and "'apo_down' or 'discopop'" in msg


def test_dpo_loss_types_that_read_label_smoothing(tiny):
    msg = problems_of(dpo_recipe(tiny).replace("loss_type: sigmoid", "loss_type: exo_pair"))
    assert "loss_type 'exo_pair' needs label_smoothing > 0" in msg and "the EXO paper uses 1e-3" in msg
    msg = problems_of(dpo_recipe(tiny).replace("loss_type: sigmoid", "loss_type: hinge\n    label_smoothing: 0.1"))
    assert "label_smoothing applies to loss_type sigmoid, robust and exo_pair only (got 'hinge')" in msg


def test_dpo_model_must_be_a_causal_lm(tiny):
    msg = problems_of(
        dpo_recipe(tiny).replace("    model: sft                        # policy", "    model: rm  # policy")
    )
    assert "stage 'rm' is a reward stage and produces a reward model, but `model` needs a causal LM" in msg
    msg = problems_of(
        dpo_recipe(tiny).replace("    model: sft                        # policy", "    model: pref-data  # policy")
    )
    assert "stage 'pref-data' is a format stage" in msg


def test_preference_stage_needs_preference_data(tiny):
    msg = problems_of(
        dpo_recipe(tiny).replace("    data: pref-data\n    loss_type", "    data: sft-data\n    loss_type")
    )
    assert "produces prompt_completion data; a dpo stage's `data` needs preference" in msg


def test_preference_dataset_without_chosen_rejected_names_columns_and_mapping(tiny):
    text = dpo_recipe(tiny).replace("sentiment_preferences.jsonl", "sentiment_sft.jsonl")
    msg = problems_of(text)
    assert "formats 'pairs' as preference, which needs columns prompt+chosen+rejected or chosen+rejected" in msg
    assert "found: prompt, completion, label" in msg and "columns: {prompt: <your column>, chosen: <your column>" in msg


def test_judge_reward_model_must_be_a_reward_stage(tiny):
    msg = problems_of(dpo_recipe(tiny).replace("reward_model: rm", "reward_model: sft"))
    assert "`reward_model` needs a reward model" in msg and "name one of: rm" in msg


def rl_recipe(tiny, name) -> str:
    return (Path(__file__).parents[1] / "pipelines" / name).read_text().replace("assets/tiny", str(tiny))


def test_grpo_batch_must_split_into_groups_and_says_what_to_change(tiny):
    msg = problems_of(rl_recipe(tiny, "tiny-grpo.yaml").replace("    batch_size: 64", "    batch_size: 60"))
    assert "stages[2].batch_size (stage 'grpo')" in msg
    assert "60 × 1 = 60 completions per forward pass, which does not split into groups of num_generations = 8" in msg
    assert "make batch_size a multiple of 8 (e.g. 64)" in msg


def test_grpo_batch_times_processes_is_checked(tiny):
    text = rl_recipe(tiny, "tiny-grpo.yaml").replace(
        "    batch_size: 64", "    batch_size: 12\n    resources: {processes: 2}"
    )
    text = text.replace("num_generations: 8", "num_generations: 8")
    msg = problems_of(text)
    assert "12 × 2 = 24 completions" in msg


def test_reward_spec_needs_exactly_one_source(tiny):
    msg = problems_of(
        rl_recipe(tiny, "tiny-grpo.yaml").replace("{function: exact_match}", "{function: exact_match, url: http://x}")
    )
    assert "stages[2].rewards[0]" in msg and "exactly one of function, reward_model, url" in msg


def test_a_misspelt_reward_function_is_named_with_the_built_in_it_resembles(tiny):
    """Caught by `validate`, not when the RL stage starts after SFT has run."""
    text = rl_recipe(tiny, "tiny-grpo.yaml").replace("{function: exact_match}", "{function: exact_mach}")
    line = next(i for i, row in enumerate(text.splitlines(), 1) if "exact_mach}" in row)
    msg = problems_of(text)
    assert f"stages[2].rewards[0].function (stage 'grpo'), line {line}: unknown reward function 'exact_mach'" in msg
    assert "did you mean 'exact_match'?" in msg and "`package.module:function`" in msg


@pytest.mark.parametrize(
    ("value", "ok"),
    [("my_pkg.rewards:score", True), ("score:fn", True), ("my-pkg:score", False), ("pkg:", False), (":fn", False)],
)
def test_a_judge_reward_is_a_built_in_or_module_function_not_imported_at_validation(tiny, value, ok):
    """`module:function` is checked for its form only: the module may exist only on the worker that runs the stage."""
    text = rl_recipe(tiny, "tiny-grpo.yaml").replace("reward: exact_match ", f"reward: '{value}' ")
    assert f"'{value}'" in text
    if ok:
        assert parse_recipe(text).stage("judge", JudgeStage).reward == value
    else:
        assert "is not `package.module:function`" in problems_of(text)


@pytest.mark.parametrize(
    ("entry", "says"),
    [
        (
            "{function: keyword, kwargs: {word: [great]}}",
            "unknown option 'word' (did you mean 'words'?); 'words' is required",
        ),
        ("{function: keyword}", "'words' is required; `keyword` takes kwargs words, case_sensitive"),
        ("{function: keyword, kwargs: {words: great}}", "words: Input should be a valid list (got 'great')"),
        ("{function: regex, kwargs: {pattern: 'a(b'}}", "pattern: not a valid regular expression"),
        ("{function: exact_match, kwargs: {answer: x}}", "unknown option 'answer'; `exact_match` takes no kwargs"),
        ("{url: 'http://x', kwargs: {k: 1}}", "kwargs are passed to a `function` only"),
    ],
    ids=["misspelt", "missing", "not-a-list", "bad-regex", "none-taken", "url"],
)
def test_a_built_in_reward_s_kwargs_are_checked(tiny, entry, says):
    """The built-ins take dataset columns as keyword arguments too, so a misspelt option would be swallowed and the
    reward silently constant (`keyword` with no words scores 0 everywhere): `validate` says so instead."""
    msg = problems_of(rl_recipe(tiny, "tiny-grpo.yaml").replace("{function: exact_match}", entry))
    assert "stages[2].rewards[0].kwargs (stage 'grpo')" in msg and says in msg, msg


def test_built_in_reward_kwargs_that_fit_validate(tiny):
    entries = "{function: keyword, kwargs: {words: [great], case_sensitive: true}}\n      - {function: length_penalty}"
    recipe = parse_recipe(rl_recipe(tiny, "tiny-grpo.yaml").replace("{function: exact_match}", entries))
    assert [r.label for r in recipe.stage("grpo", GRPOStage).rewards] == ["keyword", "length_penalty"]


def test_two_rewards_logged_under_one_name_are_an_error(tiny):
    entries = "{function: exact_match}\n      - {function: exact_match, weight: 2}"
    msg = problems_of(rl_recipe(tiny, "tiny-grpo.yaml").replace("{function: exact_match}", entries))
    assert "stages[2].rewards (stage 'grpo')" in msg and "two rewards would be logged as 'exact_match'" in msg


@pytest.mark.parametrize(
    ("recipe", "sampling"),
    [
        ("tiny-grpo.yaml", "    sampling: {temperature: 1.0}"),
        ("tiny-rloo.yaml", "    sampling: {temperature: 1.0}"),
        ("tiny-online-dpo.yaml", "    sampling: {temperature: 0.7}"),
    ],
)
def test_greedy_rollouts_are_an_error_where_a_prompt_s_completions_are_compared(tiny, recipe, sampling):
    """GRPO, RLOO and online DPO learn from differences between a prompt's completions; greedy ones are identical."""
    text = rl_recipe(tiny, recipe)
    assert sampling + "\n" in text
    msg = problems_of(text.replace(sampling + "\n", "    sampling: {temperature: 0}\n"))
    assert "sampling.temperature: 0 decodes greedily, so a prompt's completions are all the same" in msg


def test_greedy_ppo_rollouts_validate(tiny):
    text = rl_recipe(tiny, "tiny-ppo.yaml").replace(
        "    sampling: {temperature: 0.7}\n", "    sampling: {temperature: 0}\n"
    )
    assert parse_recipe(text).stage("ppo", PPOStage).sampling.greedy


def test_a_sampling_length_rollouts_would_ignore_is_an_error(tiny):
    text = rl_recipe(tiny, "tiny-grpo.yaml")
    msg = problems_of(text.replace("sampling: {temperature: 1.0}", "sampling: {temperature: 1.0, max_new_tokens: 32}"))
    assert "sampling.max_new_tokens (32) is not what rollouts use: their length is max_completion_length (10)" in msg
    same = parse_recipe(
        text.replace("sampling: {temperature: 1.0}", "sampling: {temperature: 1.0, max_new_tokens: 10}")
    )
    assert same.stage("grpo", GRPOStage).sampling.max_new_tokens == 10


def test_reward_model_entry_must_name_a_reward_stage(tiny):
    msg = problems_of(rl_recipe(tiny, "tiny-ppo.yaml").replace("{reward_model: rm}", "{reward_model: sft}"))
    assert "stages[5].rewards.0.reward_model" in msg or "stages[5].rewards[0].reward_model" in msg
    assert "`rewards.0.reward_model` needs a reward model" in msg


def test_ppo_needs_a_value_model(tiny):
    msg = problems_of(rl_recipe(tiny, "tiny-ppo.yaml").replace("{reward_model: rm}", "{function: sentiment_lexicon}"))
    assert "PPO needs a value model" in msg


def test_vllm_server_rollouts_need_a_url(tiny):
    text = rl_recipe(tiny, "tiny-grpo.yaml").replace(
        "    sampling: {temperature: 1.0}",
        "    sampling: {temperature: 1.0}\n    rollout: {backend: vllm, mode: server}",
    )
    assert "rollout mode 'server' needs `server_url`" in problems_of(text)


def test_ppo_runs_on_ddp_ranks_but_not_sharded(tiny):
    """Several PPO processes are DDP ranks (tests/test_multiprocess.py); FSDP is refused, as for every stage whose
    policy generates."""
    ranks = "    kl_coef: 0.05\n    resources: {processes: 2%s}\n"
    recipe = parse_recipe(rl_recipe(tiny, "tiny-ppo.yaml").replace("    kl_coef: 0.05\n", ranks % ""))
    assert recipe.stage("ppo").resources.processes == 2
    sharded = rl_recipe(tiny, "tiny-ppo.yaml").replace("    kl_coef: 0.05\n", ranks % ", strategy: fsdp")
    assert "strategy: fsdp is supported for sft, reward, dpo and kto stages, not ppo" in problems_of(sharded)


def ppo_with(tiny, *lines: str) -> str:
    extra = "".join(f"    {line}\n" for line in lines)
    return rl_recipe(tiny, "tiny-ppo.yaml").replace("    kl_coef: 0.05\n", "    kl_coef: 0.05\n" + extra)


@pytest.mark.parametrize(
    "line,field,bound",
    [
        ("target: 0", "target", "greater than 0"),
        ("horizon: -5", "horizon", "greater than 0"),
        ("score_clip: 0", "score_clip", "greater than 0"),
        ("ratio_threshold: 1.0", "ratio_threshold", "greater than 1"),
        ("target_kl: 0", "target_kl", "greater than 0"),
    ],
)
def test_ppo_control_bounds_name_the_field_and_what_to_write(tiny, line, field, bound):
    msg = problems_of(ppo_with(tiny, line))
    assert f"stages[5].{field} (stage 'ppo')" in msg and f"{field} must be {bound}" in msg
    assert f"fix: write `{field}:` as a number {bound}" in msg


def test_ppo_early_stopping_needs_target_kl(tiny):
    msg = problems_of(ppo_with(tiny, "early_stopping: true"))
    assert "`early_stopping: true` needs `target_kl`" in msg and "add e.g. `target_kl: 1.0`" in msg
    parse_recipe(ppo_with(tiny, "early_stopping: true", "target_kl: 0.5"))


def test_ppo_score_norm_needs_score_scaling(tiny):
    assert "`use_score_norm` applies only with `use_score_scaling: true`" in problems_of(
        ppo_with(tiny, "use_score_norm: true")
    )


def test_ppo_kl_estimator_points_to_kl_penalty(tiny):
    text = rl_recipe(tiny, "tiny-ppo.yaml").replace("kl_penalty: kl", "kl_estimator: k3")
    assert "replace `kl_estimator: k3` with `kl_penalty: k3`" in problems_of(text)
    msg = problems_of(rl_recipe(tiny, "tiny-ppo.yaml").replace("kl_penalty: kl", "kl_penalty: k2"))
    assert "'kl', 'abs', 'mse', 'k3' or 'full'" in msg


def test_ppo_controls_of_trl07_validate(tiny):
    stage = parse_recipe(
        ppo_with(
            tiny,
            "adap_kl_ctrl: true",
            "target: 4",
            "horizon: 2000",
            "use_score_scaling: true",
            "use_score_norm: true",
            "score_clip: 3",
            "ratio_threshold: 10",
        ).replace("kl_penalty: kl", "kl_penalty: full")
    ).stage("ppo", PPOStage)
    assert (stage.adap_kl_ctrl, stage.target, stage.horizon, stage.score_clip, stage.ratio_threshold) == (
        True,
        4,
        2000,
        3,
        10,
    )
    assert stage.kl_penalty == "full"


def test_a_key_given_twice_is_an_error_not_silently_shadowed(tiny):
    msg = problems_of(ppo_with(tiny, "kl_penalty: k3"))
    assert "stages[5].kl_penalty" in msg and "key 'kl_penalty' is given twice (lines 40 and 41)" in msg
    assert "fix: remove one of them" in msg


def test_cli_run_force_of_an_unknown_stage_exits_2_naming_the_stages(demo_text, tmp_path):
    from alignpipe.cli import main

    path = tmp_path / "demo.yaml"
    path.write_text(demo_text)
    import contextlib
    import io

    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        assert main(["run", str(path), "--force", "sftt"]) == 2
    assert "(1 problem)" in err.getvalue() and "--force: no stage 'sftt' in this recipe" in err.getvalue()
    assert "fix: use one of: sft-data, eval-prompts, sft, judge, publish" in err.getvalue()
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize(
    "overrides,says",
    [
        (["stages.sft.resources.strategy=fsdp"], "strategy: fsdp shards the model across processes, but"),
        (
            ["stages.sft.resources.strategy=fsdp", "stages.sft.resources.processes=2", "stages.sft.lora.r=8"],
            "strategy: fsdp with a LoRA adapter is not supported",
        ),
        (
            ["stages.judge.resources.strategy=fsdp", "stages.judge.resources.processes=2"],
            "strategy: fsdp is supported for sft, reward, dpo and kto stages, not judge",
        ),
        (["stages.sft.resources.strategy=zero3"], "stages.sft.resources.strategy"),
    ],
)
def test_fsdp_strategy_is_checked(demo_text, overrides, says):
    assert says in problems_of(demo_text, overrides)


def test_fsdp_strategy_on_two_processes_is_valid(demo_text):
    recipe = parse_recipe(demo_text, ["stages.sft.resources.strategy=fsdp", "stages.sft.resources.processes=2"])
    assert recipe.stage("sft").resources.strategy == "fsdp"


def test_more_data_parallel_ranks_than_gpus_is_an_error(demo_text):
    msg = problems_of(demo_text, ["stages.sft.resources.processes=4", "stages.sft.resources.gpus=2"])
    assert "stages[2].resources.processes (stage 'sft')" in msg
    assert "processes: 4 data-parallel ranks need a GPU each, but the stage asks for gpus: 2" in msg
    assert "fix: set gpus: 4 (or more), or processes: 2" in msg
    for fine in (
        ["stages.sft.resources.processes=2"],
        ["stages.sft.resources.processes=2", "stages.sft.resources.gpus=4"],
    ):
        assert parse_recipe(demo_text, fine).stage("sft").resources.processes == 2  # CPU ranks, or a GPU to spare
