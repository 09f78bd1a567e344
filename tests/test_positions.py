"""A stage whose token window outgrows the model's learned position table (GPT-2's 1024) fails at validate time,
or before the first step, with the fields to change; rotary models have no such limit."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from support import demo_recipe
from transformers import (
    GPT2Config,
    GPT2ForSequenceClassification,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    OPTConfig,
    OPTForCausalLM,
)

from alignpipe.positions import check_model_window, config_position_limit, model_position_limit, stage_window
from alignpipe.recipe import RecipeError, parse_recipe
from alignpipe.recipe.stages import GRPOStage, SFTStage
from alignpipe.trainers.configs import DPOConfig, GRPOConfig, SFTConfig

SMALL: dict[str, Any] = {"n_embd": 16, "n_layer": 1, "n_head": 2, "vocab_size": 64}


@pytest.fixture
def gpt2_dir(tmp_path) -> Path:
    """A GPT-2-shaped model folder with 64 positions (config only: validation reads nothing else)."""
    path = tmp_path / "gpt2-64"
    GPT2Config(n_positions=64, **SMALL).save_pretrained(path)
    return path


def test_limits_come_from_the_config_and_from_the_loaded_table():
    assert config_position_limit(GPT2Config(n_positions=64).to_dict()) == 64
    assert config_position_limit({"model_type": "opt", "max_position_embeddings": 96}) == 96
    assert config_position_limit(LlamaConfig().to_dict()) is None  # rotary: no table
    torch.manual_seed(0)
    assert model_position_limit(GPT2LMHeadModel(GPT2Config(n_positions=64, **SMALL))) == 64
    assert model_position_limit(GPT2ForSequenceClassification(GPT2Config(n_positions=48, **SMALL))) == 48
    opt = OPTConfig(max_position_embeddings=96, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, ffn_dim=32)
    assert model_position_limit(OPTForCausalLM(opt)) == 96  # its table has 2 rows more (the offset)
    llama = LlamaConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2)
    assert model_position_limit(LlamaForCausalLM(llama)) is None


def test_a_stage_window_is_what_its_trainer_feeds_the_model():
    assert stage_window(SFTConfig(max_length=300)) == (300, "max_length")
    assert stage_window(DPOConfig(max_length=700, max_prompt_length=200)) == (700, "max_length")
    window = stage_window(GRPOConfig(max_prompt_length=900, max_completion_length=256))
    assert window == (1156, "max_prompt_length + max_completion_length")
    assert stage_window(GRPOConfig(max_prompt_length=None)) is None  # prompts not cut: unknown until data


def test_validate_rejects_a_window_longer_than_the_position_table(tiny, tmp_path, gpt2_dir):
    text = demo_recipe(tiny, tmp_path / "runs").replace(f"path: {tiny}/model", f"path: {gpt2_dir}", 1)
    with pytest.raises(RecipeError) as e:
        parse_recipe(text, ["stages.sft.max_length=128"])
    msg = str(e.value)
    assert "stages[2].max_length (stage 'sft')" in msg
    assert f"max_length is 128 tokens, but {gpt2_dir}'s learned position table holds 64 positions" in msg
    assert "fix: lower max_length so the window is at most 64 tokens" in msg
    assert parse_recipe(text, ["stages.sft.max_length=64"]).stage("sft", SFTStage).max_length == 64


def test_validate_counts_prompt_and_completion_in_rl_stages(tiny, gpt2_dir):
    text = (Path(__file__).parents[1] / "pipelines" / "tiny-grpo.yaml").read_text().replace("assets/tiny", str(tiny))
    text = text.replace(f"path: {tiny}/model", f"path: {gpt2_dir}", 1)
    with pytest.raises(RecipeError) as e:
        parse_recipe(text, ["stages.sft.max_length=64"])  # grpo: 256 prompt tokens (the default) + 10
    msg = str(e.value)
    assert "stages[2].max_prompt_length (stage 'grpo')" in msg
    assert "max_prompt_length + max_completion_length is 266 tokens" in msg
    assert "stage 'sft'" not in msg
    fits = parse_recipe(text, ["stages.sft.max_length=64", "stages.grpo.max_prompt_length=54"])
    assert fits.stage("grpo", GRPOStage).max_prompt_length == 54


def test_rotary_base_models_have_no_window_limit(demo_text):
    assert parse_recipe(demo_text, ["stages.sft.max_length=100000"]).stage("sft", SFTStage).max_length == 100000


def test_a_loaded_model_is_checked_before_training(demo_text):
    stage = parse_recipe(demo_text, ["stages.sft.max_length=128"]).stage("sft")
    model = GPT2LMHeadModel(GPT2Config(n_positions=64, **SMALL))
    with pytest.raises(ValueError, match=r"stage 'sft': max_length is 128 tokens, but .* holds 64 positions"):
        check_model_window(model, stage)
    check_model_window(model, parse_recipe(demo_text, ["stages.sft.max_length=64"]).stage("sft"))


def test_a_hub_model_in_the_local_cache_is_checked_without_a_download(tiny, tmp_path, monkeypatch):
    """The cache layout `huggingface_hub` writes: models--org--name/refs/main names a snapshot holding config.json."""
    from huggingface_hub import constants

    repo = tmp_path / "hub" / "models--openai-community--gpt2"
    commit = "0" * 40
    GPT2Config(n_positions=64, **SMALL).save_pretrained(repo / "snapshots" / commit)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    text = demo_recipe(tiny, tmp_path / "runs").replace(f"path: {tiny}/model", "path: openai-community/gpt2", 1)
    with pytest.raises(RecipeError, match=r"128 tokens, but openai-community/gpt2's learned position table holds 64"):
        parse_recipe(text, ["stages.sft.max_length=128"])
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "empty"))  # not cached: checked at stage start
    assert parse_recipe(text, ["stages.sft.max_length=128"]).stage("sft", SFTStage).max_length == 128


def test_a_judge_checks_its_prompts_against_each_model_it_generates_from(tiny):
    from types import SimpleNamespace

    from transformers import AutoTokenizer

    from alignpipe.engine.sampling import SamplingParams
    from alignpipe.stages.judge import generate

    tokenizer = AutoTokenizer.from_pretrained(tiny / "model")
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_positions=64, **{**SMALL, "vocab_size": len(tokenizer)}))
    stage = SimpleNamespace(id="judge", batch_size=4, sampling=SamplingParams(temperature=0.0, max_new_tokens=8))
    ctx = SimpleNamespace(stage=stage, seed=0, load_model=lambda ref, merge: model, tokenizer=lambda ref: tokenizer)
    long_prompt = " ".join(["great"] * 60)
    n = len(tokenizer(long_prompt)["input_ids"])
    with pytest.raises(ValueError) as e:
        generate(ctx, "sft", ["a short one", long_prompt])  # type: ignore[arg-type]
    assert f"judge 'judge', model 'sft': the longest prompt is {n} tokens" in str(e.value)
    assert f"needs {n + 8} positions, but the model's learned position table holds 64" in str(e.value)
    assert "keep prompts to at most 56 tokens" in str(e.value)
    assert len(generate(ctx, "sft", ["a short one", "the film was"])) == 2  # type: ignore[arg-type]


def test_an_rl_stage_with_whole_prompts_checks_its_data_before_the_first_rollout(tiny):
    """`max_prompt_length: null` keeps whole prompts, so validation cannot know the window: the stage measures its
    longest prompt (train and eval) against the policy's table at start."""
    from types import SimpleNamespace

    from transformers import AutoTokenizer

    from alignpipe.stages.online import start_policy

    tokenizer = AutoTokenizer.from_pretrained(tiny / "model")
    model = GPT2LMHeadModel(GPT2Config(n_positions=64, **{**SMALL, "vocab_size": len(tokenizer)}))
    long_prompt = " ".join(["great"] * 60)
    n = len(tokenizer(long_prompt)["input_ids"])
    splits = {"train": [{"prompt": "short"}], "eval": [{"prompt": long_prompt}]}
    stage = GRPOConfig(max_prompt_length=None, max_completion_length=10).model_copy(
        update={"id": "grpo", "model": "sft", "data": "data"}
    )
    ctx = SimpleNamespace(
        stage=stage,
        start_model=lambda ref, lora: (model, tokenizer, "sft"),
        rows=lambda data, split: splits[split],
    )
    with pytest.raises(ValueError) as e:
        start_policy(ctx, reference=False)  # type: ignore[arg-type]
    assert f"stage 'grpo': the longest prompt is {n} tokens, and with max_completion_length (10)" in str(e.value)
    assert "set max_prompt_length: 54 (prompts keep their last tokens) or lower max_completion_length" in str(e.value)
    splits["eval"] = [{"prompt": "the film was"}]
    assert start_policy(ctx, reference=False).model is model  # type: ignore[arg-type]
