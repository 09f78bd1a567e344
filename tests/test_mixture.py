"""A format stage that mixes several datasets (`dataset: [a, b]`, `dataset_weights`)."""

import json
import logging
import re

import pytest

from alignpipe.data.formats import SOURCE
from alignpipe.data.mixture import Source, mix
from alignpipe.recipe import parse_recipe
from alignpipe.recipe.stages import FormatStage


def _rows(name: str, n: int) -> list[dict]:
    return [{"prompt": f"{name} {i}", "completion": f" answer {i}"} for i in range(n)]


def _write(path, rows: list[dict]):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.mark.parametrize("fractions", [[0.75, 0.25], [1.0, 1.0], [2.0, 3.0]])
def test_shares_take_the_rows_trl_s_dataset_mixture_takes(tmp_path, fractions):
    """With `shuffle: false` a mixture of shares is TRL's (`get_dataset` with each dataset's `fraction`): the same
    first rows of each dataset, in the same order, on the same files."""
    from trl.scripts.utils import DatasetConfig, DatasetMixtureConfig, get_dataset

    data = {"a": _rows("a", 30), "b": _rows("b", 7)}
    files = {name: _write(tmp_path / f"{name}.jsonl", rows) for name, rows in data.items()}
    theirs = get_dataset(
        DatasetMixtureConfig(
            datasets=[
                DatasetConfig(path="json", data_files=str(files[name]), fraction=f)
                for name, f in zip(data, fractions, strict=True)
            ]
        )
    )["train"].to_list()
    ours = mix([Source(name, rows) for name, rows in data.items()], fractions, shuffle=False, seed=0)
    assert [{k: v for k, v in r.items() if k != SOURCE} for r in ours.rows] == theirs
    assert sum(ours.taken.values()) == len(theirs) > 0
    assert ours.taken["b"] == 7  # the smaller dataset, whole: the mixture takes no row twice


def test_shuffled_shares_draw_rows_from_all_of_each_dataset_once_and_the_same_for_a_seed():
    data = {"a": _rows("a", 100), "b": _rows("b", 40)}
    sources = [Source(name, rows) for name, rows in data.items()]
    one = mix(sources, [0.5, 0.5], shuffle=True, seed=3)
    assert one.taken == {"a": 40, "b": 40}
    taken_a = [r["prompt"] for r in one.rows if r[SOURCE] == "a"]
    assert len(set(taken_a)) == 40
    assert max(int(p.split()[1]) for p in taken_a) >= 40  # not only the first 40 rows
    assert mix(sources, [0.5, 0.5], shuffle=True, seed=3).rows == one.rows
    assert mix(sources, [0.5, 0.5], shuffle=True, seed=4).rows != one.rows
    whole = mix(sources, None, shuffle=True, seed=3)
    assert whole.taken == {"a": 100, "b": 40} and len(whole.rows) == 140


def test_each_dataset_s_columns_are_mapped_and_a_column_only_some_have_is_dropped():
    first = Source("qa", [{"q": "x", "a": " y", "answer": "1", "id": 5}], {"prompt": "q", "completion": "a"})
    second = Source("chat", [{"prompt": "p", "completion": " c", "answer": "2", "topic": "t"}])
    mixture = mix([first, second], None, shuffle=False, seed=0)
    assert mixture.rows == [
        {"prompt": "x", "completion": " y", "answer": "1", SOURCE: "qa"},
        {"prompt": "p", "completion": " c", "answer": "2", SOURCE: "chat"},
    ]
    assert mixture.dropped_columns == {"qa": ["id"], "chat": ["topic"]}


def _recipe(tiny, tmp_path, stage: str, datasets: dict[str, str]):
    lines = "".join(f"  {name}: {spec}\n" for name, spec in datasets.items())
    return parse_recipe(
        f"name: mix\nworkdir: {tmp_path / 'runs'}\nmodel: {{path: {tiny / 'model'}}}\ndatasets:\n{lines}"
        f"stages:\n  - {stage}\n"
    )


def _run(recipe, tmp_path, stage_id="mixed"):
    from alignpipe.stages import format as format_stage
    from alignpipe.stages.context import StageContext
    from alignpipe.tracking import Tracker

    tracker = Tracker()
    stage = recipe.stage(stage_id, FormatStage)
    return format_stage.run(StageContext(recipe, stage, tmp_path / stage_id, {}, tracker)), tracker


def test_a_format_stage_mixes_datasets_of_different_columns_and_counts_each_one_s_rows(tiny, tmp_path, caplog):
    """A conversation dataset and a question/answer file become one prompt_completion dataset; the rows each gave
    are logged as metrics and named in the model card's data table."""
    from alignpipe.hub import model_card
    from alignpipe.manifest import Manifest
    from alignpipe.stages.context import StageContext
    from alignpipe.stages.push import card_info
    from alignpipe.tracking import Tracker

    qa = _write(tmp_path / "qa.jsonl", [{"q": f"{i}+1=", "a": f" {i + 1}", "level": 1} for i in range(30)])
    chats = [
        {"messages": [{"role": "user", "content": f"hi {i}"}, {"role": "assistant", "content": f"hello {i}"}]}
        for i in range(10)
    ]
    chat = _write(tmp_path / "chat.jsonl", chats)
    recipe = _recipe(
        tiny,
        tmp_path,
        "{id: sft-data, kind: format, dataset: [qa, chat], format: prompt_completion, eval_fraction: 0.2}\n"
        "  - {id: publish, kind: push, model: base, needs: [sft-data], target: local}",
        {"qa": f"{{path: {qa}, columns: {{prompt: q, completion: a}}}}", "chat": f"{{path: {chat}}}"},
    )
    with caplog.at_level(logging.INFO, logger="alignpipe.stages.format"):
        result, tracker = _run(recipe, tmp_path, "sft-data")
    assert "mixing qa + chat: qa 30 of 30 rows, chat 10 of 10 rows" in caplog.text
    assert "leaves out column(s) level of dataset 'qa'" in caplog.text
    m = result.metrics
    assert (m["rows_train"], m["rows_eval"]) == (32, 8)
    assert m["rows_train/qa"] + m["rows_train/chat"] == 32 and m["rows_eval/qa"] + m["rows_eval/chat"] == 8
    assert m["rows_train/chat"] + m["rows_eval/chat"] == 10
    import datasets

    rows = datasets.load_from_disk(result.outputs["data"])["train"].to_list()
    assert set(rows[0]) == {"prompt", "completion"}
    assert {r["completion"] for r in rows} & {" hello 3", " 4"}  # both kinds of row, formatted alike
    assert any(r["prompt"].startswith("hi ") for r in rows) and any(r["prompt"].endswith("+1=") for r in rows)
    assert {k.split(".")[1] for k in tracker.params if k.startswith("dataset.")} == {"qa", "chat"}

    written = Manifest(stage_id="sft-data", kind="format", cache_key="k", outputs=result.outputs)
    written.info, written.metrics = result.info, result.metrics
    push = StageContext(recipe, recipe.stage("publish"), tmp_path / "publish", {"sft-data": written}, Tracker())
    card = model_card(card_info(push, adapter=False))
    for name in ("qa", "chat"):
        train, evals = m[f"rows_train/{name}"], m[f"rows_eval/{name}"]
        assert f"| {name} (sft-data, mixed) | `{tmp_path / (name + '.jsonl')}` |" in card
        assert f"| {train} | {evals} |" in card


def test_a_mixture_s_row_error_names_the_dataset_it_came_from(tiny, tmp_path):
    good = _write(tmp_path / "good.jsonl", _rows("g", 5))
    bad = _write(tmp_path / "bad.jsonl", [{"prompt": "p", "completion": "c"}, {"prompt": "q"}])
    recipe = _recipe(
        tiny,
        tmp_path,
        "{id: mixed, kind: format, dataset: [good, bad], format: prompt_completion, shuffle: false}",
        {"good": f"{{path: {good}}}", "bad": f"{{path: {bad}}}"},
    )
    with pytest.raises(ValueError) as err:
        _run(recipe, tmp_path)
    assert str(err.value) == (
        "stage 'mixed' formats dataset 'bad' as prompt_completion, but row 6 has no 'completion' (its columns with a "
        "value: prompt). Map the column in the recipe: datasets.bad.columns: {completion: <your column>}"
    )
    assert not (tmp_path / "mixed" / "data").exists()


def _a_and_b(tiny, tmp_path, fields: str, a: int = 60, b: int = 20):
    """A recipe whose format stage `mixed` mixes `a` rows of dataset a with `b` of dataset b."""
    files = {name: _write(tmp_path / f"{name}.jsonl", _rows(name, n)) for name, n in (("a", a), ("b", b))}
    stage = f"{{id: mixed, kind: format, dataset: [a, b], {fields}}}"
    return _recipe(tiny, tmp_path, stage, {name: f"{{path: {path}}}" for name, path in files.items()})


def test_shares_and_max_rows_hold_in_the_formatted_data(tiny, tmp_path):
    def rows_from(fields: str, where: str) -> tuple[float, float]:
        folder = tmp_path / where
        folder.mkdir()
        result, _ = _run(_a_and_b(tiny, folder, f"format: prompt_completion, eval_fraction: 0, {fields}"), folder)
        return result.metrics["rows_train/a"], result.metrics["rows_train/b"]

    assert rows_from("dataset_weights: [3, 1]", "a-heavy") == (60, 20)
    assert rows_from("dataset_weights: [1, 3]", "b-heavy") == (7, 20)  # round(0.25 × 26.67): b whole, a its share
    capped = rows_from("dataset_weights: [3, 1], max_rows: 40", "capped")
    assert sum(capped) == 40 and capped[0] > capped[1] > 0  # the cap takes the shuffled mixture's first rows


def test_a_mixture_is_checked_where_the_recipe_names_it(tiny, tmp_path):
    from alignpipe.recipe.errors import RecipeError

    a = _write(tmp_path / "a.jsonl", _rows("a", 3))
    head = f"name: m\nmodel: {{path: {tiny / 'model'}}}\ndatasets:\n  a: {{path: {a}}}\n  b: {{path: {a}}}\nstages:\n"
    for stage, message in [
        ("dataset: [a, a]", "a dataset mixture lists each dataset once"),
        ("dataset: [a, b], dataset_weights: [1]", "got 1 weight(s) for ['a', 'b']"),
        ("dataset: a, dataset_weights: [1]", "`dataset` names one ('a'): list the datasets to mix"),
        ("dataset: [a, b], dataset_weights: [1, 0]", "dataset_weights must all be above 0"),
    ]:
        with pytest.raises(RecipeError, match=re.escape(message)):
            parse_recipe(head + f"  - {{id: f, kind: format, {stage}, format: prompt_only}}\n")
    with pytest.raises(RecipeError) as err:
        parse_recipe(head + "  - {id: f, kind: format, dataset: [a, c], format: prompt_only}\n")
    assert [(p.path, p.message) for p in err.value.problems] == [(("stages", 0, "dataset", 1), "no dataset named 'c'")]
    assert err.value.problems[0].line == 7  # the stage's line


def test_a_mixture_s_cache_key_follows_each_dataset_s_contents(tiny, tmp_path):
    from alignpipe.plan import cache_keys

    recipe = _a_and_b(tiny, tmp_path, "format: prompt_only", a=3, b=3)
    before = cache_keys(recipe)["mixed"]
    _write(tmp_path / "b.jsonl", _rows("b", 4))
    assert cache_keys(recipe)["mixed"] != before
