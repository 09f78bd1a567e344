"""The PPO trainer with TRL 0.7's controls switched on: each acts in a real run and shows in the metrics."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from support import run_ppo

from alignpipe.modeling import load_causal_lm
from alignpipe.trainers import ppo


def test_adaptive_kl_coefficient_follows_the_controller_every_update(tiny, tmp_path):
    """`objective/kl_coef` is logged at every update; each batch's coefficient is the last one moved by the controller
    from that batch's `objective/kl` over its 16 episodes (horizon 32: up to ±10% a batch)."""
    _, tracker, _ = run_ppo(
        tiny, tmp_path, learning_rate=3e-3, max_steps=4, kl_coef=0.2, adap_kl_ctrl=True, target=0.5, horizon=32
    )
    coefs, kls = tracker.series("objective/kl_coef"), tracker.series("objective/kl")
    assert len(coefs) == len(kls) == 4 and coefs[0] == 0.2
    for t in range(3):
        err = min(max(kls[t] / 0.5 - 1, -0.2), 0.2)
        assert coefs[t + 1] == pytest.approx(coefs[t] * (1 + err * 16 / 32), rel=1e-9)
    assert coefs[1] < coefs[0], "the first batch samples the reference policy (KL 0 < target), so the coefficient falls"


def test_fixed_kl_coefficient_is_logged_and_stays(tiny, tmp_path):
    _, tracker, _ = run_ppo(tiny, tmp_path, max_steps=2, kl_coef=0.07)
    assert tracker.series("objective/kl_coef") == [0.07, 0.07]


def test_full_distribution_kl_with_lora_starts_at_zero_and_grows(tiny, tmp_path):
    """`kl_penalty: full` against the adapter-disabled policy: exactly 0 on the first batch (same model), positive after."""
    _, tracker, _ = run_ppo(tiny, tmp_path, lora=True, learning_rate=5e-3, kl_penalty="full")
    kls = tracker.series("objective/kl")
    assert kls[0] == pytest.approx(0.0, abs=1e-5) and kls[-1] > 1e-4


def test_score_scaling_normalisation_and_clip_shape_the_scores(tiny, tmp_path):
    _, tracker, _ = run_ppo(tiny, tmp_path, use_score_scaling=True, use_score_norm=True, score_clip=0.5)
    for raw, scaled in zip(tracker.series("objective/raw_scores"), tracker.series("objective/scores")):
        assert -0.5 <= scaled <= 0.5 and raw >= 0
    assert tracker.last("objective/score_running_std") > 0
    raw, scaled = tracker.series("objective/raw_scores"), tracker.series("objective/scores")
    assert raw != scaled and max(raw) > 0.5, "the lengths reward reaches 1; scaled and clipped scores stay within ±0.5"


def test_a_batch_over_the_ratio_threshold_takes_no_optimizer_step(tiny, tmp_path, monkeypatch):
    """Every micro-batch over the threshold: its loss is zeroed and no optimizer step is taken, so neither the policy
    nor the value model moves (AdamW on zero gradients would still move them through momentum and weight decay)."""
    monkeypatch.setattr(ppo, "ratio_exceeds", lambda ratio, mask, threshold: threshold is not None)
    before = {k: v.clone() for k, v in load_causal_lm(str(tiny / "model")).state_dict().items()}
    _, tracker, policy = run_ppo(tiny, tmp_path, max_steps=2, ratio_threshold=1.5, weight_decay=0.1)
    assert tracker.series("policy/skipped_batches") == [4.0, 4.0]  # 2 epochs × 2 mini-batches × 1 micro-batch
    after = policy.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_ratio_threshold_skips_only_batches_that_drift(tiny, tmp_path):
    """A real run with a threshold just above 1 and a large learning rate: the first mini-batch of each update (ratio
    exactly 1) trains, later ones that drifted past the threshold are skipped and counted."""
    _, tracker, _ = run_ppo(tiny, tmp_path, learning_rate=1e-2, num_ppo_epochs=3, ratio_threshold=1.0001)
    skipped = tracker.series("policy/skipped_batches")
    assert all(0 <= s <= 5 for s in skipped) and sum(skipped) > 0


def test_early_stopping_ends_the_epochs_of_a_batch(tiny, tmp_path):
    """A tiny `target_kl` and a large learning rate: the epochs of some batch stop before `num_ppo_epochs`, and the
    metrics say so."""
    _, tracker, _ = run_ppo(tiny, tmp_path, learning_rate=1e-2, num_ppo_epochs=4, early_stopping=True, target_kl=1e-6)
    epochs, stopped = tracker.series("policy/ppo_epochs"), tracker.series("policy/early_stopped")
    assert any(s == 1.0 for s in stopped)
    assert all((e < 4) == (s == 1.0) for e, s in zip(epochs, stopped))
    assert all(math.isfinite(v) for v in tracker.series("lr"))


def test_resume_keeps_the_adapted_kl_coefficient(tiny, tmp_path):
    """A killed adaptive-KL run resumes with the coefficient it had reached, not the initial one."""
    args: dict[str, Any] = dict(
        learning_rate=3e-3, max_steps=3, kl_coef=0.2, adap_kl_ctrl=True, target=0.5, horizon=32, save_every=1
    )
    _, whole, _ = run_ppo(tiny, tmp_path / "whole", **args)
    run_ppo(tiny, tmp_path / "again", **{**args, "max_steps": 2})
    # the 2-update run left step-1 (the final update saves no checkpoint); a 3-update run resumes from it
    resumed, tracker, _ = run_ppo(tiny, tmp_path / "again", **args)
    assert resumed.resumed_from == 1
    assert tracker.series("objective/kl_coef")[0] == pytest.approx(whole.series("objective/kl_coef")[1], rel=1e-9)
    assert tracker.series("objective/kl_coef")[0] != 0.2


def test_the_update_runs_the_lm_head_on_response_tokens_only(tiny):
    """A PPO micro-batch's log-probs, entropies and gradients with the head limited to the response tokens (counted
    on the host) equal the whole response's wherever the loss reads them."""
    policy = load_causal_lm(str(tiny / "model"))
    g = torch.Generator().manual_seed(0)
    query = torch.randint(2, 500, (3, 4), generator=g)
    query_mask = torch.ones_like(query)
    query_mask[0, :2] = 0
    response = torch.randint(2, 500, (3, 6), generator=g)
    mask = torch.arange(6).unsqueeze(0) < torch.tensor([[6], [2], [1]])
    weights = torch.randn(3, 6, generator=g) * mask

    def run(**only):
        policy.zero_grad()
        lp, ent = ppo.response_logprobs(policy, query, query_mask, response, 0.7, 4096, True, **only)
        (lp * weights).sum().backward()
        return lp.detach(), ent, [p.grad.clone() for p in policy.parameters()]

    whole, part = run(), run(only=mask, count=int(mask.sum()))
    assert torch.allclose(part[0], whole[0] * mask, atol=1e-6) and torch.allclose(part[1], whole[1] * mask, atol=1e-5)
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(part[2], whole[2]))
