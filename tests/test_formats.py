"""Canonical formats from raw rows."""

from alignpipe.data.formats import format_rows
from alignpipe.modeling import load_tokenizer


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
    result = format_stage.run(StageContext(recipe, recipe.stage("all-train"), tmp_path / "fmt", {}, Tracker()))
    assert result.metrics["rows_eval"] == 0
    written = Manifest(stage_id="all-train", kind="format", cache_key="k", outputs=result.outputs)
    reader = StageContext(recipe, recipe.stage("sft"), tmp_path / "sft", {"all-train": written}, Tracker())
    assert len(reader.rows("all-train", "train")) == result.metrics["rows_train"] > 0
    assert reader.rows("all-train", "eval") == []
