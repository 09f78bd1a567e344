"""Mixture-of-Experts models train with their routers' load-balancing loss (`router_aux_loss_coef`, TRL's option).

The loss recorded from the routers equals transformers' own `aux_loss` on the same forward (three MoE families);
the coefficient's default, refusals and where the option exists; and GRPO, RLOO and KTO add coef × the loss to a
step's loss (the SFT and DPO trajectories equal TRL's: `test_parity_trl.py`).
"""

from __future__ import annotations

import copy
import importlib

import pytest
import torch
from moe_models import moe_model, save_moe
from pydantic import ValidationError
from support import known, tiny_split

from alignpipe.judges.reward_set import LoadedReward, RewardSet
from alignpipe.modeling import load_causal_lm
from alignpipe.moe import RouterLoss, answer_masks
from alignpipe.recipe.stages import SFTStage
from alignpipe.tracking import Tracker
from alignpipe.trainers import grpo, kto, rloo
from alignpipe.trainers.configs import GRPOConfig, KTOConfig, PPOConfig, RewardConfig, RLOOConfig, SFTConfig


@pytest.mark.parametrize("kind", ["qwen3_moe", "mixtral", "olmoe"])
def test_the_recorded_loss_is_transformers_own(kind):
    """On the decoder stack alone (as the trainers run it) the recorded loss equals the causal LM's `aux_loss`, with
    left and right padding masked and without a mask; forwards without gradients are not recorded."""
    torch.manual_seed(0)
    model = moe_model(kind, 50)
    ids = torch.randint(0, 50, (3, 7))
    mask = torch.ones(3, 7, dtype=torch.long)
    mask[0, :3] = 0
    mask[2, 5:] = 0
    router = RouterLoss.of(model, None)
    assert router is not None and router.coef == model.config.router_aux_loss_coef
    assert len(router.routers) == 2 and (router.experts, router.top_k) == (4, 2)
    for given in (mask, None):
        expected = model(input_ids=ids, attention_mask=given, output_router_logits=True).aux_loss
        with router.recording():
            model.model(input_ids=ids, attention_mask=given)
            with torch.no_grad():
                model.model(input_ids=ids)  # a reference or old-policy pass: not counted
        got = router.take()
        assert got.requires_grad
        assert float(got.detach()) == pytest.approx(float(expected.detach()), rel=1e-6)
    assert float(router.take()) == 0.0  # taken: nothing left


def test_a_shared_prompt_and_its_answers_count_each_token_they_run_once():
    """A prompt run once and its answers run after it through the KV cache (`shared_prompt_logprobs`' layout): the
    recorded loss is transformers' over the tokens those two forwards run, the prompt's left padding and the
    answers' right padding left out (the answers' mask found by its shape among `answer_masks`)."""
    from transformers import DynamicCache

    torch.manual_seed(1)
    model = moe_model("qwen3_moe", 50)
    prompt = torch.randint(0, 50, (2, 5))
    prompt_mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    answers = torch.randint(0, 50, (4, 3))
    answer_mask = torch.tensor([[1, 1, 1], [1, 1, 0], [1, 0, 0], [1, 1, 1]])
    index = torch.tensor([0, 0, 1, 1])
    router = RouterLoss.of(model, None)
    assert router is not None
    with router.recording(*answer_masks(prompt_mask, answer_mask, index)):
        cache = DynamicCache(config=model.config)
        model.model(input_ids=prompt, attention_mask=prompt_mask, past_key_values=cache, use_cache=True)
        cache.batch_select_indices(index)
        whole_mask = torch.cat([prompt_mask[index], torch.ones_like(answers)], 1)
        model.model(input_ids=answers, attention_mask=whole_mask, past_key_values=cache, use_cache=True)
    got = router.take()

    captured: list[torch.Tensor] = []
    hooks = [m.register_forward_hook(lambda _m, _a, out: captured.append(out[0])) for m, _ in router.routers]
    cache = DynamicCache(config=model.config)
    model.model(input_ids=prompt, attention_mask=prompt_mask, past_key_values=cache, use_cache=True)
    cache.batch_select_indices(index)
    model.model(input_ids=answers, attention_mask=whole_mask, past_key_values=cache, use_cache=True)
    for hook in hooks:
        hook.remove()
    # transformers' function over one "layer" per router call, its tokens masked as each call's real ones
    flat = torch.cat([prompt_mask.flatten()] * 2 + [answer_mask.flatten()] * 2)
    logits = torch.cat(captured[:2] + captured[2:])
    loss_fn = importlib.import_module(type(model).__module__).load_balancing_loss_func
    expected = loss_fn((logits,), 4, 2, flat[None])
    assert float(got.detach()) == pytest.approx(float(expected.detach()), rel=1e-6)


def test_the_coefficient_s_default_and_refusals(tiny):
    """Null takes the model's own coefficient and 0 turns the loss off; a dense model refuses a non-zero one and an
    MoE loss refuses `compile`, each saying what to change; the option exists where TRL has it (SFT, DPO, KTO,
    GRPO, RLOO) and nowhere else."""
    moe = moe_model("qwen3_moe", 50)
    assert RouterLoss.of(moe, 0.0) is None
    assert known(RouterLoss.of(moe, 0.3)).coef == 0.3
    dense = load_causal_lm(str(tiny / "model"))
    assert RouterLoss.of(dense, None) is None and RouterLoss.of(dense, 0.0) is None
    with pytest.raises(ValueError, match=r"not a Mixture-of-Experts model.*remove router_aux_loss_coef"):
        RouterLoss.of(dense, 0.01)
    with pytest.raises(ValueError, match="compile: false, or router_aux_loss_coef: 0"):
        RouterLoss.of(moe, None, compiled=True)
    assert RouterLoss.of(moe, 0.0, compiled=True) is None
    for config in (SFTConfig, KTOConfig, GRPOConfig, RLOOConfig):
        assert config(router_aux_loss_coef=0.1).router_aux_loss_coef == 0.1
    for without in (RewardConfig, PPOConfig):
        with pytest.raises(ValidationError, match="router_aux_loss_coef"):
            without(router_aux_loss_coef=0.1)  # type: ignore[call-arg]  # the field these configs lack
    with pytest.raises(ValidationError):
        SFTConfig(router_aux_loss_coef=-1)


def _first_step(trainer: str, model_dir, tiny, tmp_path, coef: float) -> dict:
    """Step 1's logged metrics of a short `trainer` run on the MoE model with `router_aux_loss_coef` `coef`."""
    torch.manual_seed(0)
    tracker = Tracker()
    policy = load_causal_lm(str(model_dir))
    if trainer == "kto":
        tok, train, _ = tiny_split(tiny, "sentiment_preferences", "unpaired", rows=32, max_length=64)
        cfg = KTOConfig(max_steps=1, batch_size=8, logging_every=1, router_aux_loss_coef=coef)
        kto.train(cfg, policy, tok, train, [], tracker, tmp_path / f"kto{coef}", ref_model=copy.deepcopy(policy))
    else:
        tok, train, _ = tiny_split(tiny, "reverse", "prompt_completion", rows=16)
        rows = [{"prompt": r["prompt"]} for r in train]
        rewards = RewardSet([LoadedReward("len", lambda p, c, **_: [len(x) / 10 for x in c])])
        online, module = (GRPOConfig, grpo) if trainer == "grpo" else (RLOOConfig, rloo)
        shape = dict(batch_size=8, num_generations=4, max_completion_length=8, logging_every=1)
        rl_cfg = online(max_steps=1, beta=0.04, router_aux_loss_coef=coef, **shape)
        out = tmp_path / f"{trainer}{coef}"
        module.train(rl_cfg, policy, tok, rows, rewards, tracker, out, ref_model=copy.deepcopy(policy))
    return {k.removeprefix("train/"): v for _, d in tracker.history for k, v in d.items() if k.startswith("train/")}


@pytest.mark.parametrize("trainer", ["grpo", "rloo", "kto"])
def test_online_stages_and_kto_add_the_load_balancing_loss(tiny, tmp_path, trainer):
    """The same first step (same seed: same rollouts, same batch) with and without the MoE loss: the logged loss
    differs by exactly coef × the logged `aux_loss` (near 2, top-2 of 4 experts balanced), which is not logged when
    the coefficient is 0."""
    model_dir = save_moe(tiny, tmp_path)
    without = _first_step(trainer, model_dir, tiny, tmp_path, 0.0)
    coef = 0.5
    with_aux = _first_step(trainer, model_dir, tiny, tmp_path, coef)
    assert "aux_loss" not in without
    assert 1.5 < with_aux["aux_loss"] < 3.0
    assert with_aux["loss"] - without["loss"] == pytest.approx(coef * with_aux["aux_loss"], rel=1e-4, abs=1e-6)


def test_validate_names_the_option_a_model_cannot_take(tiny, tmp_path):
    """`alignpipe validate` reads the base model's config: a non-zero coefficient on a dense model, and `compile`
    on an MoE model that trains with its loss, fail there with the field and the fix; an MoE base takes both."""
    from support import demo_recipe

    from alignpipe.recipe import RecipeError, parse_recipe

    text = demo_recipe(tiny, tmp_path / "runs")
    with pytest.raises(RecipeError) as e:
        parse_recipe(text, ["stages.sft.router_aux_loss_coef=0.1"])
    msg = str(e.value)
    assert "stages[2].router_aux_loss_coef (stage 'sft')" in msg and "not a Mixture-of-Experts model" in msg
    assert "fix: remove router_aux_loss_coef from the stage" in msg
    assert parse_recipe(text, ["stages.sft.router_aux_loss_coef=0"]).stage("sft", SFTStage).router_aux_loss_coef == 0

    moe_text = text.replace(f"path: {tiny}/model", f"path: {save_moe(tiny, tmp_path)}", 1)
    assert (
        parse_recipe(moe_text, ["stages.sft.router_aux_loss_coef=0.1"]).stage("sft", SFTStage).router_aux_loss_coef
        == 0.1
    )
    with pytest.raises(RecipeError) as e:
        parse_recipe(moe_text, ["stages.sft.compile=true"])
    msg = str(e.value)
    assert "stages[2].compile (stage 'sft')" in msg and "router_aux_loss_coef 0.001" in msg
    assert parse_recipe(moe_text, ["stages.sft.compile=true", "stages.sft.router_aux_loss_coef=0"])


def test_activation_checkpointing_keeps_the_loss(tiny, tmp_path):
    """With activation checkpointing the layers run again in backward, after the recording has closed: the MoE loss
    is counted once, and two SFT steps log what they log without it."""
    from alignpipe.trainers import sft

    model_dir = save_moe(tiny, tmp_path)
    tok, train, _ = tiny_split(tiny, "sentiment_sft", "prompt_completion", rows=40, max_length=64)
    runs = []
    for checkpointing in (False, True):
        torch.manual_seed(0)
        tracker = Tracker()
        cfg = SFTConfig(max_steps=2, batch_size=8, logging_every=1, gradient_checkpointing=checkpointing)
        sft.train(cfg, load_causal_lm(str(model_dir)), tok, train, [], tracker, tmp_path / f"sft{checkpointing}")
        runs.append([d[f"train/{k}"] for _, d in tracker.history for k in ("loss", "aux_loss", "grad_norm")])
    assert runs[1] == pytest.approx(runs[0], rel=1e-5)
