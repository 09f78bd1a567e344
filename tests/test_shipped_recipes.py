"""The real-size recipes of pipelines/, run as users run them but shrunk: their Hub model swapped for a small local one
of the same family, their Hub datasets for local files with the same columns, every stage a few CPU steps. This is
what found that UltraChat's and UltraFeedback's `prompt` + `messages` rows failed the chat-SFT and DPO recipes' format
stages, and that `max_length` dropped almost every IMDB review the sentiment recipe meant to use as a prompt."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
from loopback import serve

from alignpipe.recipe import load_recipe

WORDS = ["good", "great", "bad", "awful", "movie", "plot", "actor", "scene", "fun", "boring", "lovely", "dull"]


def _words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def imdb_rows(rng: random.Random) -> list[dict]:
    """stanfordnlp/imdb: `text` (a review of a few hundred words), `label`."""
    return [{"text": _words(rng, 120), "label": i % 2} for i in range(40)]


def ultrachat_rows(rng: random.Random) -> list[dict]:
    """HuggingFaceH4/ultrachat_200k: `prompt` (the first user turn alone), `prompt_id`, `messages` (several turns)."""
    rows = []
    for i in range(40):
        turns = [_words(rng, 6), _words(rng, 10), _words(rng, 5), _words(rng, 12)]
        roles = ["user", "assistant"] * 2
        rows.append(
            {
                "prompt": turns[0],
                "prompt_id": str(i),
                "messages": [{"role": r, "content": t} for r, t in zip(roles, turns)],
            }
        )
    return rows


def _conversation(prompt: str, reply: str) -> list[dict]:
    return [{"role": "user", "content": prompt}, {"role": "assistant", "content": reply}]


def ultrafeedback_rows(rng: random.Random) -> list[dict]:
    """HuggingFaceH4/ultrafeedback_binarized: `prompt`, `chosen` / `rejected` / `messages` as whole conversations,
    scores."""
    rows = []
    for i in range(60):
        prompt, good, bad = _words(rng, 8), _words(rng, 10), _words(rng, 9)
        rows.append(
            {
                "prompt": prompt,
                "prompt_id": str(i),
                "chosen": _conversation(prompt, good),
                "rejected": _conversation(prompt, bad),
                "messages": _conversation(prompt, good),
                "score_chosen": 8.0,
                "score_rejected": 4.0,
            }
        )
    return rows


def small_gpt2(tiny: Path, root: Path) -> Path:
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    from alignpipe.modeling import load_tokenizer

    tok = load_tokenizer(str(tiny / "model"))
    torch.manual_seed(0)
    ids = dict(vocab_size=len(tok), eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, bos_token_id=None)
    GPT2LMHeadModel(GPT2Config(n_positions=1024, n_embd=64, n_layer=2, n_head=4, **ids)).save_pretrained(root)
    tok.save_pretrained(root)
    return root


RECIPES = {
    "gpt2-imdb-sft.yaml": ("openai-community/gpt2", {"stanfordnlp/imdb": imdb_rows}),
    "qwen2.5-0.5b-chat-sft.yaml": ("Qwen/Qwen2.5-0.5B", {"HuggingFaceH4/ultrachat_200k": ultrachat_rows}),
    "qwen2.5-0.5b-ultrafeedback-dpo.yaml": (
        "Qwen/Qwen2.5-0.5B-Instruct",
        {"HuggingFaceH4/ultrafeedback_binarized": ultrafeedback_rows},
    ),
    "qwen2.5-0.5b-ultrafeedback-ppo.yaml": (
        "Qwen/Qwen2.5-0.5B-Instruct",
        {"HuggingFaceH4/ultrafeedback_binarized": ultrafeedback_rows},
    ),
}
JUDGES = {"Qwen/Qwen2.5-1.5B-Instruct"}
"""Hub models of LLM judges, swapped for a stand-in judge server (`judge_url`): the tiny model names no letter, and
a judge that never does fails its stage (nothing would be judged)."""


def letter_judge(method, path, body, headers):
    """An OpenAI-compatible judge answering A or B by the prompt's length, so that both orders can disagree."""
    if path == "/v1/models":
        return 200, {"data": [{"id": "letter-judge"}]}
    prompt = body["messages"][0]["content"]
    return 200, {"choices": [{"message": {"content": "A" if len(prompt) % 2 else "B"}}]}


def shrunk_recipe(name: str, tiny: Path, root: Path, judge_url: str = "") -> Path:
    """pipelines/`name` with its model and datasets replaced by local ones of the same shape, written under `root`;
    its LLM judges' Hub models by the judge server at `judge_url`."""
    model_id, datasets = RECIPES[name]
    text = (Path(__file__).parents[1] / "pipelines" / name).read_text()
    model = small_gpt2(tiny, root / "gpt2") if "gpt2" in model_id else tiny / "model"
    text = text.replace(f"tokenizer: {model_id}-Instruct", f"tokenizer: {model}")
    text = text.replace(f"path: {model_id}\n", f"path: {model}\n").replace("bfloat16", "float32")
    text = text.replace("./runs", str(root / "runs"))
    for judge in JUDGES:
        text = text.replace(f"model: {judge}", f"url: {judge_url}")
    for hub_id, rows in datasets.items():
        local = root / f"{hub_id.split('/')[-1]}.jsonl"
        local.write_text("".join(json.dumps(r) + "\n" for r in rows(random.Random(0))))
        text = text.replace(f"path: {hub_id}\n", f"path: {local}\n")
    sources = [
        line.split(":", 1)[1].split("#")[0].strip()
        for line in text.splitlines()
        if line.strip().startswith(("path:", "tokenizer:"))
    ]
    assert all(Path(source).exists() for source in sources), f"a Hub id is left: {sources}"
    path = root / name
    path.write_text(text)
    return path


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_a_shipped_recipe_runs_end_to_end_shrunk(name, prefect_harness, tiny, tmp_path):
    import datasets
    from support import shrunk_overrides
    from test_pipeline_flow import run_flow, summary_of

    from alignpipe.modeling import load_tokenizer

    with serve(letter_judge) as judge_url:
        path = shrunk_recipe(name, tiny, tmp_path, judge_url)
        overrides = shrunk_overrides(load_recipe(path))
        state = run_flow(path, overrides)
    summary = summary_of(path, state, overrides)
    status = {s["stage_id"]: s for s in summary["stages"]}
    assert state.is_completed(), {k: (s["status"], s.get("message")) for k, s in status.items()}
    recipe = load_recipe(path, overrides)
    gated = {s.id for s in recipe.stages if s.when}  # a closed gate skips its stage: the tiny models decide
    assert all(s["status"] == "done" or (k in gated and s["status"] == "skipped") for k, s in status.items()), status

    def rows(stage: str) -> list[dict]:
        return datasets.load_from_disk(status[stage]["output"])["train"].to_list()

    tok = load_tokenizer(str(tiny / "model"))
    if name == "qwen2.5-0.5b-chat-sft.yaml":  # whole conversations, both replies of each found for the loss
        row = rows("chat-data")[0]
        replies = [row["text"][a:b] for a, b in row["assistant_spans"]]
        assert len(replies) == 2 and all(r.endswith("<|end|>") and "<|" not in r[: -len("<|end|>")] for r in replies)
    if name == "qwen2.5-0.5b-ultrafeedback-dpo.yaml":
        # every row formats: `messages` gives the SFT pairs, the conversations the preference pairs
        assert (len(rows("sft-data")), len(rows("pref-data"))) == (54, 59)  # eval_fraction 0.1 and 0.02
    if name == "qwen2.5-0.5b-ultrafeedback-ppo.yaml":  # both judges judged every prompt; the gate read the LLM judge's
        metrics = {k: s.get("value") for k, s in status.items()}
        assert 0.0 <= metrics["judge"] <= 1.0 and 0.0 <= metrics["judge-rm"] <= 1.0
    if name == "gpt2-imdb-sft.yaml":  # the reviews' openings, none dropped
        prompts = [r["prompt"] for r in rows("imdb-prompts")]
        assert len(prompts) == 30 and all(len(tok(p, add_special_tokens=False)["input_ids"]) == 8 for p in prompts)
