"""The shipped real-size recipes start from GPT-2 (learned positions, Conv1D projections, LayerNorm) and Qwen2 (biased
QKV); everything else tests the tiny Llama. The Llama-shaped fast paths (lean activations, fused kernels) step aside
for other shapes: here every trainer runs on tiny models of both, and packed SFT rows stay isolated on each."""

from __future__ import annotations

import copy
import math
import shutil
from typing import Any

import pytest
import torch
from support import SHORT_GROUPS, assert_packed_equals_alone, known, loss_and_grads, run_ppo, tiny_split
from transformers import GPT2Config, GPT2LMHeadModel, Qwen2Config, Qwen2ForCausalLM

from alignpipe.judges.reward_set import LoadedReward, RewardSet
from alignpipe.modeling import load_causal_lm, load_sequence_scorer
from alignpipe.tracking import Tracker
from alignpipe.trainers import dpo, grpo, reward, sft
from alignpipe.trainers.configs import DPOConfig, GRPOConfig, RewardConfig, SFTConfig


def small_model(arch: str, tok):
    ids = dict(vocab_size=len(tok), eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    if arch == "gpt2":
        return GPT2LMHeadModel(GPT2Config(n_positions=256, n_embd=64, n_layer=2, n_head=4, bos_token_id=None, **ids))
    config = Qwen2Config(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, **ids
    )
    return Qwen2ForCausalLM(config)


@pytest.fixture(params=["gpt2", "qwen2"])
def assets(request, tiny, tmp_path_factory):
    """A copy of the tiny assets whose model/ is a small random `request.param` model with the tiny tokenizer."""
    from alignpipe.modeling import load_tokenizer

    root = tmp_path_factory.mktemp(request.param)
    shutil.copytree(tiny / "data", root / "data")
    tok = load_tokenizer(str(tiny / "model"))
    torch.manual_seed(0)
    small_model(request.param, tok).save_pretrained(root / "model")
    tok.save_pretrained(root / "model")
    return root


def test_packed_rows_train_as_alone_on_other_architectures(assets):
    tok, train, _ = tiny_split(assets, "sentiment_sft", "prompt_completion", rows=200, max_length=64)
    rows = sft.tokenize(train[:12], tok, 64, completion_only=True)
    blocks = sft.pack(rows, 64)
    model = load_causal_lm(str(assets / "model"), attention="sdpa")
    assert len(blocks) < len(rows)
    packed = loss_and_grads(model, sft.collate(blocks, tok.pad_token_id))
    assert_packed_equals_alone(packed, [loss_and_grads(model, sft.collate([r], tok.pad_token_id)) for r in rows])


def test_every_trainer_runs_on_other_architectures(assets, tmp_path):
    tok, train, evals = tiny_split(assets, "sentiment_sft", "prompt_completion", rows=400, max_length=64)
    tracker = Tracker()
    cfg = SFTConfig(learning_rate=3e-3, max_steps=12, batch_size=16, logging_every=1)
    sft.train(cfg, load_causal_lm(str(assets / "model")), tok, train, evals, tracker, tmp_path / "sft")
    losses = tracker.series("train/loss")
    assert losses[-1] < 0.8 * losses[0], losses

    _, prefs, pref_evals = tiny_split(assets, "sentiment_preferences", "preference", rows=48, max_length=64)
    policy = load_causal_lm(str(assets / "model"))
    tracker = Tracker()
    dpo_cfg = DPOConfig(learning_rate=1e-3, max_steps=2, batch_size=8, logging_every=1)
    dpo.train(dpo_cfg, policy, tok, prefs, pref_evals, tracker, tmp_path / "dpo", ref_model=copy.deepcopy(policy))
    assert tracker.series("train/loss")[0] == pytest.approx(math.log(2), abs=1e-4)  # policy = reference at step 1
    assert math.isfinite(known(tracker.last("eval/loss")))

    scorer = load_sequence_scorer(str(assets / "model"), "float32", pad_token_id=tok.pad_token_id)
    tracker = Tracker()
    reward.train(RewardConfig(max_steps=2, batch_size=8), scorer, tok, prefs, pref_evals, tracker, tmp_path / "rm")
    assert math.isfinite(known(tracker.last("train/loss"))) and tracker.last("eval/accuracy") is not None

    _, prompts, _ = tiny_split(assets, "reverse", "prompt_completion", rows=16)
    policy = load_causal_lm(str(assets / "model"))
    tracker = Tracker()
    rewards = RewardSet([LoadedReward("len", lambda p, c, **_: [len(x) / 10 for x in c])])
    rows = [{"prompt": r["prompt"]} for r in prompts]
    grpo_cfg = GRPOConfig(**SHORT_GROUPS)
    grpo.train(grpo_cfg, policy, tok, rows, rewards, tracker, tmp_path / "grpo", ref_model=copy.deepcopy(policy))
    assert len(tracker.series("train/loss")) == 2 and math.isfinite(known(tracker.last("train/kl")))

    _, tracker, _ = run_ppo(assets, tmp_path / "ppo", max_steps=2)
    assert len(tracker.series("objective/kl")) == 2 and math.isfinite(tracker.last("loss/policy_avg"))


def test_dropout_off_leaves_no_randomness_in_training_mode():
    """Dropout layers, LoRA's, and the rates OPT applies functionally (and its layerdrop) all go to 0: two forwards
    in training mode agree with each other and with evaluation mode."""
    from peft import LoraConfig, get_peft_model
    from transformers import OPTConfig, OPTForCausalLM

    from alignpipe.modeling import disable_dropout

    torch.manual_seed(0)
    opt = OPTConfig(
        vocab_size=64,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        ffn_dim=64,
        max_position_embeddings=64,
    )
    opt.dropout = opt.attention_dropout = 0.3
    opt.layerdrop = 0.5
    gpt2 = GPT2Config(vocab_size=64, n_positions=64, n_embd=32, n_layer=2, n_head=2)
    ids = torch.randint(0, 64, (2, 12))
    for base in (OPTForCausalLM(opt), GPT2LMHeadModel(gpt2)):
        model = get_peft_model(base, LoraConfig(r=4, lora_dropout=0.5, target_modules="all-linear"))
        model.train()
        assert not torch.equal(model(ids).logits, model(ids).logits)  # the rates are on: two samples differ
        disable_dropout(model)
        first, second = model(ids).logits, model(ids).logits
        model.eval()
        assert torch.equal(first, second) and torch.allclose(first, model(ids).logits, atol=1e-6)


def test_dropout_defaults_are_trl_s():
    """TRL's `disable_dropout` defaults: on for reward, DPO, KTO, online DPO; off for GRPO and RLOO; SFT has none
    (keeps dropout); TRL 1.12's PPO always turns it off."""
    import trl
    from trl.experimental.online_dpo import OnlineDPOConfig as TRLOnlineDPOConfig

    from alignpipe.trainers.configs import KTOConfig, OnlineDPOConfig, PPOConfig, RLOOConfig

    pairs: list[tuple[type, Any]] = [
        (RewardConfig, trl.RewardConfig),
        (DPOConfig, trl.DPOConfig),
        (KTOConfig, trl.KTOConfig),
        (OnlineDPOConfig, TRLOnlineDPOConfig),
        (GRPOConfig, trl.GRPOConfig),
        (RLOOConfig, trl.RLOOConfig),
    ]
    for ours, theirs in pairs:
        assert ours().disable_dropout == theirs.__dataclass_fields__["disable_dropout"].default, ours.__name__
    assert PPOConfig().disable_dropout and not SFTConfig().disable_dropout
    assert "disable_dropout" not in trl.SFTConfig.__dataclass_fields__


@pytest.mark.parametrize("assets", ["qwen2"], indirect=True)
def test_a_qwen2_reward_model_runs_its_last_layer_at_the_scored_tokens_alone(assets):
    """On varlen a Qwen2 classifier (biased QKV, grouped K/V heads) scores a padding-free reward batch with its last
    layer run at each sequence's last token alone (`last_layer`): its scores and gradients equal its own forward over
    the padded rows."""
    from alignpipe import last_layer
    from alignpipe.modeling import load_tokenizer

    tok = load_tokenizer(str(assets / "model"))
    rows = [
        {"prompt": "The film was", "chosen": " great fun, start to end.", "rejected": " dull."},
        {"prompt": "Honestly, I", "chosen": " loved it", "rejected": " loved it and more than I can say"},
        {"prompt": "", "chosen": "Fine film.", "rejected": "Bad one, really bad."},
    ]
    batch = reward.collate(reward.tokenize(rows, tok, 64), tok.pad_token_id, packed="shared")
    weights = torch.tensor([1.0, -2.0, 0.5, 3.0, 1.5, -1.0])
    out = {}
    for attention in ("sdpa", "varlen"):
        model = load_sequence_scorer(str(assets / "model"), pad_token_id=tok.pad_token_id, seed=0, attention=attention)
        if attention == "varlen":
            assert last_layer.supported(model.model)
            scores = reward.scores(model, batch)
        else:
            scores = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits.squeeze(-1)
        (scores * weights).sum().backward()
        out[attention] = (scores.detach(), {n: p.grad.clone() for n, p in model.named_parameters()})
    assert torch.allclose(out["varlen"][0], out["sdpa"][0], atol=1e-5)
    for name, g in out["sdpa"][1].items():
        assert float((out["varlen"][1][name] - g).norm() / g.norm().clamp(min=1e-12)) < 1e-5, name
