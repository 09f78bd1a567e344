"""GRPO's `cast_lm_head_to_fp32` (the ScaleRL recipe, TRL's option): in a bf16 model the LM head is kept and computed
in float32, in the model's own forward (rollouts) and in the chunked head the loss reads, tied to the embeddings
or not. And a LoRA adapter on the LM head, which the chunked head would never train, is refused."""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn.functional as F
from support import tiny_split

from alignpipe.judges.reward_set import LoadedReward, RewardSet
from alignpipe.logprobs import token_logprobs
from alignpipe.modeling import float32_head, load_causal_lm, lora_model
from alignpipe.tracking import Tracker
from alignpipe.trainers import grpo
from alignpipe.trainers.configs import GRPOConfig, LoraSpec


def _bf16(tiny, tied: bool):
    model = load_causal_lm(str(tiny / "model"), dtype="bfloat16")
    if not tied:  # the tiny model ties its head to the embeddings; give the head a weight of its own
        model.config.tie_word_embeddings = False
        model.lm_head.weight = torch.nn.Parameter(model.lm_head.weight.detach().clone())
    return model


@pytest.mark.parametrize("tied", [True, False])
def test_the_head_runs_in_float32_in_a_bf16_model(tiny, tied):
    """After the cast: the head's weight is float32 and the rest stays bf16 (the embeddings' output too, when tied);
    the model's logits are the float32 product of its bf16 hidden states, and the chunked head's log-probs are
    their log-softmax; the bf16 head's differ."""
    model = _bf16(tiny, tied)
    ids = torch.randint(5, 200, (2, 9))
    mask = torch.ones_like(ids)
    before = token_logprobs(model, ids, mask)
    float32_head(model)
    assert model.lm_head.weight.dtype == torch.float32
    assert model.model.layers[0].mlp.up_proj.weight.dtype == torch.bfloat16
    assert (model.model.embed_tokens.weight is model.lm_head.weight) == tied
    assert model.model.embed_tokens(ids).dtype == torch.bfloat16
    with torch.no_grad():
        hidden = model.model(input_ids=ids, attention_mask=mask).last_hidden_state
        logits = model(input_ids=ids, attention_mask=mask).logits
        expected = F.linear(hidden.float(), model.lm_head.weight)
        assert hidden.dtype == torch.bfloat16 and logits.dtype == torch.float32
        assert torch.equal(logits, expected)
        want = expected[:, :-1].log_softmax(-1).gather(-1, ids[:, 1:, None]).squeeze(-1)
        got = token_logprobs(model, ids, mask)
    assert got.dtype == torch.float32 and torch.allclose(got, want, atol=1e-6)
    assert not torch.allclose(got, before.float(), atol=1e-4)  # bf16 logits round where these do not


def test_a_float32_model_is_left_alone(tiny):
    model = load_causal_lm(str(tiny / "model"))
    forward = model.lm_head.forward
    float32_head(model)
    assert model.lm_head.forward == forward and model.lm_head.weight.dtype == torch.float32


def test_grpo_trains_a_bf16_policy_with_a_float32_head(tiny, tmp_path):
    """Two GRPO steps in bf16 with `cast_lm_head_to_fp32` and a reference copy: the policy's and the reference's
    heads are float32 and the rest bf16, the first step measures no KL (the policy is its reference), and the head
    trains in float32 (a change too small for bf16 to hold)."""
    tok, train, _ = tiny_split(tiny, "reverse", "prompt_completion", rows=16)
    rows = [{"prompt": r["prompt"]} for r in train]
    rewards = RewardSet([LoadedReward("len", lambda p, c, **_: [len(x) / 10 for x in c])])
    policy = load_causal_lm(str(tiny / "model"), dtype="bfloat16")
    ref = copy.deepcopy(policy)
    start = policy.lm_head.weight.detach().float().clone()
    cfg = GRPOConfig(
        max_steps=2, batch_size=8, num_generations=4, max_completion_length=8, beta=0.04, logging_every=1,
        learning_rate=1e-6, cast_lm_head_to_fp32=True,
    )  # fmt: skip
    tracker = Tracker()
    grpo.train(cfg, policy, tok, rows, rewards, tracker, tmp_path, ref_model=ref)
    assert policy.lm_head.weight.dtype == torch.float32 and ref.lm_head.weight.dtype == torch.float32
    assert policy.model.layers[0].mlp.up_proj.weight.dtype == torch.bfloat16
    kl = tracker.series("train/kl")
    assert len(kl) == 2 and kl[0] == pytest.approx(0.0, abs=1e-6) and all(math.isfinite(k) for k in kl)
    trained = policy.lm_head.weight.detach()
    assert (trained - start).abs().max() > 0
    assert (trained.bfloat16() == start.bfloat16()).float().mean() > 0.9  # steps of ~1e-6: bf16 would lose most


@pytest.mark.filterwarnings("ignore:Model has `tie_word_embeddings=True`")
def test_a_lora_adapter_on_the_lm_head_is_refused(tiny):
    """The chunked head reads the head's weight, so an adapter on it would stay at zero: refused in the recipe
    (`lora.target_modules`) and, for a head of another name, when the adapter is made."""
    with pytest.raises(ValueError, match="lm_head cannot be a LoRA target"):
        LoraSpec(target_modules=["q_proj", "lm_head"])
    model = load_causal_lm(str(tiny / "model"))
    spec = LoraSpec.model_construct(r=4, alpha=8.0, dropout=0.0, target_modules=["q_proj", "lm_head"])
    with pytest.raises(ValueError, match=r"adapts the LM head \(lm_head\).*remove lm_head from target_modules"):
        lora_model(model, spec)
