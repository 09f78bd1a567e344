"""RLOO: its advantages, KL-in-reward and loss against TRL 1.16's RLOOTrainer, the trainer on the reversal task, and
its validation."""

from __future__ import annotations

import math

import pytest
import torch
from support import known, parity_micro_batch, tiny_split, trl_group_trainer

from alignpipe.judges.reward_set import LoadedReward, RewardSet
from alignpipe.judges.rewards import exact_match
from alignpipe.losses import rloo_loss
from alignpipe.modeling import load_causal_lm
from alignpipe.recipe import RecipeError, parse_recipe
from alignpipe.rl_math import kl_penalized_rewards, leave_one_out_advantages
from alignpipe.tracking import Tracker
from alignpipe.trainers import grpo, rloo, sft
from alignpipe.trainers.configs import LoraSpec, RLOOConfig, SFTConfig

TOL = 1e-5


def trl_rloo_advantages(rewards: torch.Tensor, num_generations: int, normalize: bool) -> torch.Tensor:
    """trl/trainer/rloo_trainer.py (1.16.0) lines 1675-1699, `_generate_and_score_completions`, written out."""
    from trl.trainer.utils import nanstd

    grouped_rewards = rewards.view(-1, num_generations)
    scorable_counts = (~torch.isnan(grouped_rewards)).sum(dim=1, keepdim=True)
    grouped_sum = torch.nansum(grouped_rewards, dim=1, keepdim=True)
    baselines = (grouped_sum - grouped_rewards) / (scorable_counts - 1)
    advantages = rewards - baselines.view(-1)
    if normalize:
        advantages = (advantages - torch.nanmean(advantages)) / (nanstd(advantages) + 1e-4)
    return torch.nan_to_num(advantages, nan=0.0)


@pytest.mark.parametrize("normalize", [False, True])
def test_leave_one_out_advantages_equal_trl(normalize):
    nan = float("nan")
    g = torch.Generator().manual_seed(0)
    rewards = torch.randn(16, generator=g)
    rewards[[5, 9, 10, 11]] = nan  # one unscorable in a group; a group with a single scorable completion
    ours = leave_one_out_advantages(rewards, 4, normalize)
    assert torch.allclose(ours, trl_rloo_advantages(rewards, 4, normalize), atol=TOL)
    assert ours[8] == 0 and ours[5] == 0, "no scorable sibling, or unscorable itself: no signal"
    plain = leave_one_out_advantages(torch.tensor([1.0, 2.0, 3.0, 6.0]), 4)
    assert plain.tolist() == pytest.approx([1 - 11 / 3, 2 - 10 / 3, 3 - 3.0, 6 - 2.0])


def test_kl_penalty_enters_the_reward_as_trl():
    g = torch.Generator().manual_seed(1)
    old, ref = torch.randn(4, 6, generator=g) - 3, torch.randn(4, 6, generator=g) - 3
    mask = torch.tensor([[1, 1, 1, 0, 0, 0], [1] * 6, [1, 0, 0, 0, 0, 0], [1, 1, 1, 1, 0, 0]]).float()
    rewards = torch.randn(4, generator=g)
    # trl/trainer/rloo_trainer.py (1.16.0) lines 1669-1673, written out
    per_token_kl = old - ref
    kl = (per_token_kl * mask).sum(-1)
    expected = rewards - 0.05 * kl
    ours, ours_kl = kl_penalized_rewards(rewards, old, ref, mask, 0.05)
    assert torch.allclose(ours, expected, atol=TOL) and torch.allclose(ours_kl.sum(-1), kl, atol=TOL)
    assert not ours_kl[0, 3:].any(), "tokens after a completion carry no KL"


@pytest.mark.parametrize("epsilon_high", [None, 0.28])
def test_rloo_loss_equals_trl_compute_loss(tiny, epsilon_high):
    trl = pytest.importorskip("trl")
    trainer = trl_group_trainer(trl.RLOOTrainer, trl.RLOOConfig, tiny, beta=0.0, epsilon=0.2, epsilon_high=epsilon_high)
    model = trainer.model
    g = torch.Generator().manual_seed(0)
    inputs = parity_micro_batch(g)
    mask = inputs["completion_mask"]
    inputs["old_logps"] = torch.randn(len(mask), generator=g) * 0.3 - 20
    trl_loss = float(trainer._compute_loss(trainer.model, dict(inputs)).detach())
    trl_metrics = {k: v[-1] for k, v in trainer._metrics["train"].items()}
    with torch.no_grad():
        logps, entropy = grpo.completion_logps(
            model, inputs["prompt_ids"], inputs["prompt_mask"], inputs["completion_ids"], 1.0, 4096, with_entropy=True
        )
        seq = (logps * mask).sum(1)
        loss, ratio = rloo_loss(seq, inputs["old_logps"], inputs["advantages"], 0.2, epsilon_high or 0.2)
    assert float(loss) == pytest.approx(trl_loss, abs=TOL)
    assert float((entropy * mask).sum() / mask.sum()) == pytest.approx(trl_metrics["entropy"], abs=1e-4)
    high = ((ratio > 1 + (epsilon_high or 0.2)) & (inputs["advantages"] > 0)).float().mean()
    assert float(high) == pytest.approx(trl_metrics["clip_ratio/high_mean"], abs=TOL)


@pytest.fixture(scope="module")
def reversal(tiny, tmp_path_factory):
    tok, train, _evals = tiny_split(tiny, "reverse", "prompt_completion")
    out = tmp_path_factory.mktemp("rloo-sft")
    sft.train(
        SFTConfig(learning_rate=1e-3, max_steps=200, batch_size=32, logging_every=100),
        load_causal_lm(str(tiny / "model")),
        tok,
        train,
        [],
        Tracker(),
        out,
    )
    rows = [{"prompt": r["prompt"], "answer": r["answer"]} for r in train]
    return tok, out / "model", rows


def test_rloo_trains_with_kl_in_the_reward_and_logs_trl_metrics(tiny, reversal, tmp_path):
    """A few RLOO steps with the KL penalty against the adapter-disabled policy (LoRA), rollouts reused twice: every
    TRL metric logged and finite; KL starts at 0 (the policy is its reference) and the run saves an adapter."""
    tok, start, rows = reversal
    tracker = Tracker()
    cfg = RLOOConfig(
        learning_rate=5e-3,
        max_steps=4,
        batch_size=16,
        num_generations=4,
        max_completion_length=6,
        beta=0.05,
        lora=LoraSpec(r=4),
        num_iterations=2,
        logging_every=1,
        sample_every=2,
    )
    result = rloo.train(
        cfg,
        load_causal_lm(str(start)),
        tok,
        rows,
        RewardSet([LoadedReward("exact_match", exact_match)]),
        tracker,
        tmp_path,
    )
    assert result.steps == 4 and result.adapter
    for key in (
        "loss",
        "reward",
        "reward_std",
        "rewards/exact_match/mean",
        "frac_reward_zero_std",
        "kl",
        "entropy",
        "clip_ratio/region_mean",
        "completions/mean_length",
    ):
        assert math.isfinite(known(tracker.last(f"train/{key}"))), key
    assert tracker.series("train/kl")[0] == pytest.approx(0.0, abs=1e-5)
    assert "samples/step_000002" in tracker.tables


def rloo_recipe(tiny, **edits) -> str:
    from pathlib import Path

    text = (Path(__file__).parents[1] / "pipelines" / "tiny-rloo.yaml").read_text().replace("assets/tiny", str(tiny))
    for old, new in edits.items():
        assert old in text, old
        text = text.replace(old, new)
    return text


def test_rloo_needs_two_generations_and_whole_groups(tiny):
    with pytest.raises(RecipeError) as e:
        parse_recipe(rloo_recipe(tiny, **{"num_generations: 8": "num_generations: 1"}))
    assert "stages[2].num_generations (stage 'rloo')" in str(e.value) and "num_generations must be at least 2" in str(
        e.value
    )
    with pytest.raises(RecipeError) as e:
        parse_recipe(rloo_recipe(tiny, **{"    batch_size: 64": "    batch_size: 60"}))
    assert "does not split into groups of num_generations = 8" in str(e.value)
    with pytest.raises(RecipeError) as e:
        parse_recipe(rloo_recipe(tiny, **{"    normalize_advantages: false": "    reward_clip_range: [1, -1]"}))
    assert "reward_clip_range must be [low, high] with low < high" in str(e.value)
    assert parse_recipe(rloo_recipe(tiny)).stage("rloo").kind == "rloo"
