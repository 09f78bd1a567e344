"""Canonical formats from raw rows."""

import pytest

from alignpipe.data.formats import ConversationError, format_rows
from alignpipe.modeling import load_tokenizer
from alignpipe.recipe.stages import FormatStage


def test_plain_prompt_completion_split_is_deterministic(tiny):
    tok = load_tokenizer(str(tiny / "model"))
    raw = [{"q": f"{i}+1=", "a": str(i + 1)} for i in range(20)]
    a = format_rows(
        raw,
        fmt="prompt_completion",
        tokenizer=tok,
        columns={"prompt": "q", "completion": "a"},
        eval_fraction=0.25,
        seed=1,
    )
    b = format_rows(
        raw,
        fmt="prompt_completion",
        tokenizer=tok,
        columns={"prompt": "q", "completion": "a"},
        eval_fraction=0.25,
        seed=1,
    )
    train, evals, stats = a
    assert (len(train), len(evals)) == (15, 5)
    assert set(train[0]) == {"prompt", "completion"}
    assert stats.fingerprint == b[2].fingerprint
    assert (
        stats.fingerprint
        != format_rows(raw, fmt="prompt_completion", tokenizer=tok, columns={"prompt": "q", "completion": "a"}, seed=2)[
            2
        ].fingerprint
    )


def test_chat_template_renders_prompt_with_generation_prompt(tiny):
    tok = load_tokenizer(str(tiny / "model"))
    raw = [{"prompt": "hello", "completion": "world", "answer": "x"}]
    train, _, _ = format_rows(
        raw, fmt="prompt_completion", tokenizer=tok, chat_template=True, system_prompt="be nice", eval_fraction=0
    )
    row = train[0]
    assert row["prompt"] == "<|system|>be nice<|end|><|user|>hello<|end|><|assistant|>"
    assert row["completion"] == "world<|end|>"
    assert row["answer"] == "x", "extra columns are kept"


def test_preference_drops_identical_pairs_and_long_rows(tiny):
    tok = load_tokenizer(str(tiny / "model"))
    raw = [
        {"prompt": "p", "chosen": "good", "rejected": "bad"},
        {"prompt": "p", "chosen": "same", "rejected": "same"},
        {"prompt": "p " * 100, "chosen": "good", "rejected": "bad"},
    ]
    train, _evals, stats = format_rows(
        raw, fmt="preference", tokenizer=tok, max_length=32, eval_fraction=0, shuffle=False
    )
    assert stats.dropped_identical_pair == 1 and stats.dropped_too_long == 1
    assert train == [{"prompt": "p", "chosen": "good", "rejected": "bad"}]


def test_conversational_messages_split_into_prompt_and_last_turn(tiny):
    tok = load_tokenizer(str(tiny / "model"))
    raw = [{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}]
    train, _, _ = format_rows(raw, fmt="prompt_completion", tokenizer=tok, chat_template=True, eval_fraction=0)
    assert train[0] == {"prompt": "<|user|>hi<|end|><|assistant|>", "completion": "yo<|end|>"}


ULTRACHAT_ROW = {  # openai/ultrachat_200k's columns: `prompt` is the first user turn alone
    "prompt": "hi",
    "prompt_id": "0",
    "messages": [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "yo"},
        {"role": "user", "content": "and?"},
        {"role": "assistant", "content": "done"},
    ],
}


def test_a_conversation_beside_a_prompt_column_gives_both_halves(tiny):
    """UltraChat rows have `prompt` and `messages` and no `completion`: the reply is the last assistant turn and the
    prompt every turn before it (this raised KeyError 'completion' in the shipped chat-SFT recipe)."""
    tok = load_tokenizer(str(tiny / "model"))
    (row,), _, _ = format_rows(
        [ULTRACHAT_ROW], fmt="prompt_completion", tokenizer=tok, chat_template=True, eval_fraction=0
    )
    assert row == {
        "prompt": "<|user|>hi<|end|><|assistant|>yo<|end|><|user|>and?<|end|><|assistant|>",
        "completion": "done<|end|>",
        "prompt_id": "0",
    }
    (row,), _, _ = format_rows([ULTRACHAT_ROW], fmt="prompt_only", tokenizer=tok, chat_template=True, eval_fraction=0)
    assert row["prompt"] == "<|user|>hi<|end|><|assistant|>", "prompt_only keeps the prompt column"


def test_conversations_for_prompts_and_without_a_reply(tiny):
    tok = load_tokenizer(str(tiny / "model"))
    asking = {
        "messages": [
            {"role": "user", "content": "a"},
            {"role": "assistant", "content": "b"},
            {"role": "user", "content": "c"},
        ]
    }
    (row,), _, _ = format_rows([asking], fmt="prompt_only", tokenizer=tok, chat_template=True, eval_fraction=0)
    assert row["prompt"] == "<|user|>a<|end|><|assistant|>b<|end|><|user|>c<|end|><|assistant|>", "the question is kept"
    (row,), _, _ = format_rows([asking], fmt="prompt_completion", tokenizer=tok, chat_template=True, eval_fraction=0)
    assert (row["prompt"], row["completion"]) == ("<|user|>a<|end|><|assistant|>", "b<|end|>"), (
        "a trailing question is dropped"
    )
    with pytest.raises(ConversationError, match=r"row 1: its `messages` have no assistant turn .*\['user'\]"):
        format_rows(
            [asking, {"messages": [{"role": "user", "content": "a"}]}],
            fmt="prompt_completion",
            tokenizer=tok,
            shuffle=False,
        )


def test_a_row_without_a_column_its_format_needs_names_row_column_and_mapping(tiny, tmp_path):
    """The stage's column check looks at the dataset's columns; a row whose own columns differ (here a
    prompt/completion file with one row missing its completion) fails named, not with a bare KeyError."""
    import json

    from alignpipe.recipe import parse_recipe
    from alignpipe.stages import format as format_stage
    from alignpipe.stages.context import StageContext
    from alignpipe.tracking import Tracker

    data = tmp_path / "rows.jsonl"
    data.write_text(json.dumps({"prompt": "a", "completion": "b"}) + "\n" + json.dumps({"prompt": "c"}) + "\n")
    recipe = parse_recipe(
        f"name: f\nmodel: {{path: {tiny / 'model'}}}\ndatasets:\n  pairs: {{path: {data}}}\n"
        "stages:\n  - {id: pc, kind: format, dataset: pairs, format: prompt_completion, shuffle: false}\n"
    )
    with pytest.raises(ValueError) as err:
        format_stage.run(StageContext(recipe, recipe.stage("pc", FormatStage), tmp_path / "pc", {}, Tracker()))
    assert str(err.value) == (
        "stage 'pc' formats dataset 'pairs' as prompt_completion, but row 1 has no 'completion' (its columns with a "
        "value: prompt). Map the column in the recipe: datasets.pairs.columns: {completion: <your column>}"
    )
    assert not (tmp_path / "pc" / "data").exists()


def test_a_format_stage_without_eval_rows_is_readable_by_the_stages_after_it(tiny, tmp_path):
    """`eval_fraction: 0` leaves the eval split empty; `datasets` writes no shard for an empty split unless told to,
    and could then not load the stage's output at all (every stage reading it failed with an IndexError)."""
    from alignpipe.manifest import Manifest
    from alignpipe.recipe import parse_recipe
    from alignpipe.stages import format as format_stage
    from alignpipe.stages.context import StageContext
    from alignpipe.tracking import Tracker

    text = (
        f"name: f\nmodel: {{path: {tiny / 'model'}}}\n"
        f"datasets:\n  reviews: {{path: {tiny / 'data' / 'sentiment_sft.jsonl'}}}\n"
        "stages:\n"
        "  - {id: all-train, kind: format, dataset: reviews, format: prompt_completion, eval_fraction: 0}\n"
        "  - {id: sft, kind: sft, data: all-train, max_steps: 1}\n"
    )
    recipe = parse_recipe(text)
    result = format_stage.run(
        StageContext(recipe, recipe.stage("all-train", FormatStage), tmp_path / "fmt", {}, Tracker())
    )
    assert result.metrics["rows_eval"] == 0
    written = Manifest(stage_id="all-train", kind="format", cache_key="k", outputs=result.outputs)
    reader = StageContext(recipe, recipe.stage("sft"), tmp_path / "sft", {"all-train": written}, Tracker())
    assert len(reader.rows("all-train", "train")) == result.metrics["rows_train"] > 0
    assert reader.rows("all-train", "eval") == []


def test_truncate_prompts_keeps_each_prompt_s_first_tokens_as_written(tiny):
    """IMDB reviews as prompts: the openings, not only the reviews shorter than max_length."""
    tok = load_tokenizer(str(tiny / "model"))
    raw = [{"prompt": "a great movie with a boring plot"}, {"prompt": "fun"}]
    rows, _, _ = format_rows(
        raw, fmt="prompt_only", tokenizer=tok, truncate_prompts=3, max_length=3, eval_fraction=0, shuffle=False
    )
    assert [r["prompt"] for r in rows] == ["a great movie", "fun"]
    assert len(tok("a great movie", add_special_tokens=False)["input_ids"]) == 3


def test_truncate_prompts_is_for_plain_prompt_only_data(tiny):
    from alignpipe.recipe import parse_recipe
    from alignpipe.recipe.errors import RecipeError

    head = f"name: f\nmodel: {{path: {tiny / 'model'}}}\ndatasets:\n  d: {{path: {tiny / 'data' / 'sentiment_prompts.jsonl'}}}\n"
    for fields in ("format: prompt_completion", "format: prompt_only, chat_template: true"):
        with pytest.raises(RecipeError, match="truncate_prompts cuts plain prompt_only prompts"):
            parse_recipe(head + f"stages:\n  - {{id: p, kind: format, dataset: d, {fields}, truncate_prompts: 8}}\n")


def test_preference_rows_without_a_prompt_split_off_their_shared_start(tiny):
    """Anthropic/hh-rlhf gives two whole dialogues that differ in the last reply and no prompt column: the shared
    start is the prompt (TRL's `extract_prompt` rule, the space before the answers going with them), so DPO's
    rewards and KTO's completions are about the replies, not the dialogue."""
    from alignpipe.data.formats import implicit_prompt

    tok = load_tokenizer(str(tiny / "model"))
    hh = {"chosen": "\n\nHuman: hi\n\nAssistant: hello there", "rejected": "\n\nHuman: hi\n\nAssistant: go away"}
    (row,), _, _ = format_rows([hh], fmt="preference", tokenizer=tok, eval_fraction=0)
    assert row == {"prompt": "\n\nHuman: hi\n\nAssistant:", "chosen": " hello there", "rejected": " go away"}
    rows, _, _ = format_rows([hh], fmt="unpaired", tokenizer=tok, eval_fraction=0, shuffle=False)
    assert [(r["prompt"], r["completion"], r["label"]) for r in rows] == [
        ("\n\nHuman: hi\n\nAssistant:", " hello there", True),
        ("\n\nHuman: hi\n\nAssistant:", " go away", False),
    ]
    user = {"role": "user", "content": "hi"}
    convo = {
        "chosen": [user, {"role": "assistant", "content": "yo"}],
        "rejected": [user, {"role": "assistant", "content": "no"}],
    }
    (row,), _, _ = format_rows([convo], fmt="preference", tokenizer=tok, chat_template=True, eval_fraction=0)
    assert row == {"prompt": "<|user|>hi<|end|><|assistant|>", "chosen": "yo<|end|>", "rejected": "no<|end|>"}
    assert implicit_prompt({"prompt": "q", "chosen": "a b", "rejected": "a c"})["prompt"] == "q", "a prompt is kept"
    assert implicit_prompt({"chosen": "abc", "rejected": "ab"}) == {"chosen": "abc", "rejected": "ab"}
    assert implicit_prompt({"chosen": "x", "rejected": "y"}) == {"chosen": "x", "rejected": "y"}


def test_chat_template_kwargs_reach_every_rendering(tiny):
    """`chat_template_kwargs` are the template's own variables, as Qwen3's `enable_thinking`: given, the prompts and
    conversations a format stage renders use them (TRL's option of the same name)."""
    from alignpipe.data.formats import format_rows
    from alignpipe.modeling import load_tokenizer

    quiet_think = "{% if enable_thinking is defined and not enable_thinking %}<think></think>{% endif %}"
    template = (  # as Qwen3's: without thinking, an empty reasoning block opens the reply
        "{% for m in messages %}<|{{ m['role'] }}|>"
        "{% if m['role'] == 'assistant' and loop.last %}" + quiet_think + "{% endif %}{{ m['content'] }}<|end|>"
        "{% endfor %}{% if add_generation_prompt %}<|assistant|>" + quiet_think + "{% endif %}"
    )
    tok = load_tokenizer(str(tiny / "model"), chat_template=template)
    rows = [{"prompt": "hi", "completion": "yo"}]
    common = dict(fmt="prompt_completion", tokenizer=tok, chat_template=True, eval_fraction=0)
    (plain,), _, _ = format_rows(rows, **common)
    (quiet,), _, _ = format_rows(rows, **common, chat_template_kwargs={"enable_thinking": False})
    assert plain["prompt"] == "<|user|>hi<|end|><|assistant|>" and plain["completion"] == "yo<|end|>"
    assert quiet["prompt"] == "<|user|>hi<|end|><|assistant|><think></think>" and quiet["completion"] == "yo<|end|>"
