"""PPO's math against TRL 0.7.11's PPOTrainer (the `PPOConfig` our users' recipes come from), and the terminal step.

TRL 0.7.11 cannot be installed beside the TRL 1.16 of the test extra, so its functions are written out below from
its wheel (trl-0.7.11-py3-none-any.whl), each citing file and lines; the tests feed both sides the same tensors and
compare within 1e-6.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from alignpipe import losses, rl_math
from alignpipe.logprobs import full_kl
from alignpipe.rl_math import kl_estimate, masked_whiten
from alignpipe.trainers import ppo
from alignpipe.trainers.ppo_controls import (
    KLController,
    RunningMoments,
    ratio_exceeds,
    should_stop_early,
    transform_scores,
)

TOL = 1e-6


# --- TRL 0.7.11, written out ------------------------------------------------------------------------


def trl07_masked_mean(values, mask):
    """trl/core.py:116-121 (axis=None)."""
    return (values * mask).sum() / mask.sum()


def trl07_masked_var(values, mask):
    """trl/core.py:124-140 (unbiased=True)."""
    mean = trl07_masked_mean(values, mask)
    variance = trl07_masked_mean((values - mean) ** 2, mask)
    mask_sum = mask.sum()
    return variance * (mask_sum / (mask_sum - 1))


def trl07_masked_whiten(values, mask, shift_mean=True):
    """trl/core.py:143-149."""
    mean, var = trl07_masked_mean(values, mask), trl07_masked_var(values, mask)
    whitened = (values - mean) * torch.rsqrt(var + 1e-8)
    if not shift_mean:
        whitened += mean
    return whitened


def trl07_kl_penalty(kind, logprob, ref_logprob):
    """trl/trainer/ppo_trainer.py:1116-1130 (`PPOTrainer._kl_penalty`); for `full` the arguments are full
    log-softmaxes (ppo_trainer.py:732-738, `logprobs_from_logits(..., gather=False)`)."""
    if kind == "kl":
        return logprob - ref_logprob
    if kind == "abs":
        return (logprob - ref_logprob).abs()
    if kind == "mse":
        return 0.5 * (logprob - ref_logprob).square()
    if kind == "full":
        return F.kl_div(ref_logprob, logprob, log_target=True, reduction="none").sum(-1)
    raise NotImplementedError


def trl07_compute_rewards(scores, logprobs, ref_logprobs, masks, kl_coef, kind):
    """trl/trainer/ppo_trainer.py:1078-1114 (`compute_rewards`, with `self.kl_ctl.value` = kl_coef)."""
    rewards, non_score_rewards, kls = [], [], []
    for score, logprob, ref_logprob, mask in zip(scores, logprobs, ref_logprobs, masks):
        kl = trl07_kl_penalty(kind, logprob, ref_logprob)
        kls.append(kl)
        non_score_reward = -kl_coef * kl
        non_score_rewards.append(non_score_reward)
        reward = non_score_reward.clone()
        last_non_masked_index = mask.nonzero()[-1]
        reward[last_non_masked_index] += score
        rewards.append(reward)
    return torch.stack(rewards), torch.stack(non_score_rewards), torch.stack(kls)


def trl07_compute_advantages(values, rewards, mask, gamma, lam, whiten_rewards, remask_whitened=False):
    """trl/trainer/ppo_trainer.py:1132-1158 (`compute_advantages`). `remask_whitened` closes its one leak: whitening
    with shift_mean=False leaves −mean/std + mean on the padding positions, and the GAE loop then carries those
    fake rewards back into the last response token."""
    lastgaelam = 0
    advantages_reversed = []
    gen_len = rewards.shape[-1]
    values = values * mask
    rewards = rewards * mask
    if whiten_rewards:
        rewards = trl07_masked_whiten(rewards, mask, shift_mean=False)
        if remask_whitened:
            rewards = rewards * mask
    for t in reversed(range(gen_len)):
        nextvalues = values[:, t + 1] if t < gen_len - 1 else 0.0
        delta = rewards[:, t] + gamma * nextvalues - values[:, t]
        lastgaelam = delta + gamma * lam * lastgaelam
        advantages_reversed.append(lastgaelam)
    advantages = torch.stack(advantages_reversed[::-1]).transpose(0, 1)
    returns = advantages + values
    advantages = trl07_masked_whiten(advantages, mask)
    return values, advantages, returns


def trl07_loss(
    old_logprobs,
    values,
    vpreds,
    logprobs,
    mask,
    advantages,
    returns,
    cliprange,
    cliprange_value,
    vf_coef,
    ratio_threshold,
):
    """trl/trainer/ppo_trainer.py:1190-1222 (`loss`, without the entropy and return/value statistics)."""
    vpredclipped = torch.max(torch.min(vpreds, values + cliprange_value), values - cliprange_value)  # core.py:152-158
    vf_losses1 = (vpreds - returns) ** 2
    vf_losses2 = (vpredclipped - returns) ** 2
    vf_loss = 0.5 * trl07_masked_mean(torch.max(vf_losses1, vf_losses2), mask)
    vf_clipfrac = trl07_masked_mean(torch.gt(vf_losses2, vf_losses1).float(), mask)
    ratio = torch.exp(logprobs - old_logprobs)
    pg_losses = -advantages * ratio
    pg_losses2 = -advantages * torch.clamp(ratio, 1.0 - cliprange, 1.0 + cliprange)
    pg_loss = trl07_masked_mean(torch.max(pg_losses, pg_losses2), mask)
    pg_clipfrac = trl07_masked_mean(torch.gt(pg_losses2, pg_losses).float(), mask)
    loss = pg_loss + vf_coef * vf_loss
    avg_ratio = trl07_masked_mean(ratio, mask).item()
    skipped = avg_ratio > ratio_threshold
    if skipped:
        pg_loss, vf_loss, loss = pg_loss * 0.0, vf_loss * 0.0, loss * 0.0
    approxkl = 0.5 * trl07_masked_mean((logprobs - old_logprobs) ** 2, mask)
    policykl = trl07_masked_mean(old_logprobs - logprobs, mask)
    return {
        "loss": loss,
        "pg_loss": pg_loss,
        "vf_loss": vf_loss,
        "vf_clipfrac": vf_clipfrac,
        "pg_clipfrac": pg_clipfrac,
        "approxkl": approxkl,
        "policykl": policykl,
        "skipped": skipped,
    }


class Trl07AdaptiveKLController:
    """trl/trainer/utils.py:35-50."""

    def __init__(self, init_kl_coef, target, horizon):
        self.value = init_kl_coef
        self.target = target
        self.horizon = horizon

    def update(self, current, n_steps):
        target = self.target
        proportional_error = np.clip(current / target - 1, -0.2, 0.2)
        mult = 1 + proportional_error * n_steps / self.horizon
        self.value *= mult


class Trl07RunningMoments:
    """trl/trainer/utils.py:483-520 (one process: `accelerator.use_distributed` false)."""

    def __init__(self):
        self.mean = 0
        self.std = 1
        self.var = 1
        self.count = 1e-24

    @torch.no_grad()
    def update(self, xs):
        xs_count = xs.numel()
        xs_var, xs_mean = torch.var_mean(xs, unbiased=False)
        xs_mean, xs_var = xs_mean.float(), xs_var.float()
        delta = xs_mean - self.mean
        tot_count = self.count + xs_count
        new_sum = xs_var * xs_count
        old_sum = self.var * self.count + delta**2 * self.count * xs_count / tot_count
        tot_sum = old_sum + new_sum
        self.mean += delta * xs_count / tot_count
        self.var = tot_sum / tot_count
        self.std = (self.var * tot_count / (tot_count - 1)).float().sqrt()
        self.count = tot_count
        return xs_mean.item(), (xs_var * xs_count / (xs_count - 1)).float().sqrt().item()


def trl07_scale_scores(scores, running, use_score_scaling, use_score_norm, score_clip):
    """trl/trainer/ppo_trainer.py:647-660 (`step`: score scaling, normalisation and clipping)."""
    if use_score_scaling:
        running.update(scores)
        tensor_to_kwargs = dict(dtype=scores.dtype, device=scores.device)
        score_scaling_factor = running.std.to(**tensor_to_kwargs) + torch.finfo(scores.dtype).eps
        if use_score_norm:
            scores = (scores - running.mean.to(**tensor_to_kwargs)) / score_scaling_factor
        else:
            scores /= score_scaling_factor
    if score_clip is not None:
        scores_dtype = scores.dtype
        scores = torch.clip(scores.float(), -score_clip, score_clip).to(dtype=scores_dtype)
    return scores


def trl07_early_stop(policykl, target_kl):
    """trl/trainer/ppo_trainer.py:862-881 (`_early_stop`, one process), called after each epoch (808-812)."""
    return bool(policykl > 1.5 * target_kl)


# --- inputs ---------------------------------------------------------------------------------------


@pytest.fixture
def episode():
    """Five responses of lengths 7, 3, 5, 1, 6 in a (5, 7) batch: the response mask, sampled log-probs of the policy and
    the reference (INVALID after the response, as the trainer fills them), values, scores."""
    g = torch.Generator().manual_seed(3)
    B, R = 5, 7
    lengths = torch.tensor([7, 3, 5, 1, 6])
    mask = torch.arange(R).unsqueeze(0) < lengths.unsqueeze(1)
    return {
        "g": g,
        "B": B,
        "R": R,
        "lengths": lengths,
        "mask": mask,
        "logprobs": (torch.randn(B, R, generator=g) - 2).masked_fill(~mask, ppo.INVALID_LOGPROB),
        "ref": (torch.randn(B, R, generator=g) - 2).masked_fill(~mask, ppo.INVALID_LOGPROB),
        "values": torch.randn(B, R, generator=g).masked_fill(~mask, 0),
        "scores": torch.randn(B, generator=g),
    }


def ours_advantages(e, kind="kl", whiten=False, values=None, kl_coef=0.05, gamma=0.99, lam=0.95):
    kl = kl_estimate(e["logprobs"], e["ref"], kind).masked_fill(~e["mask"], 0)
    rewards, non_score = rl_math.kl_rewards(e["scores"], kl, e["lengths"] - 1, kl_coef)
    values = e["values"] if values is None else values
    return (rewards, non_score, kl), rl_math.advantages_and_returns(rewards, values, e["mask"], gamma, lam, whiten)


# --- equal to TRL 0.7.11 --------------------------------------------------------------------------


def test_masked_whiten_equals_trl07(episode):
    x, mask = torch.randn(5, 7, generator=episode["g"]), episode["mask"]
    for shift in (True, False):
        assert torch.allclose(
            masked_whiten(x, mask, shift), trl07_masked_whiten(x, mask.float(), shift), atol=TOL, rtol=0
        )


@pytest.mark.parametrize("kind", ["kl", "abs", "mse"])
def test_token_kl_penalties_equal_trl07(episode, kind):
    e = episode
    ours = kl_estimate(e["logprobs"], e["ref"], kind)
    assert torch.allclose(ours, trl07_kl_penalty(kind, e["logprobs"], e["ref"]), atol=TOL, rtol=0)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_full_kl_from_hidden_states_equals_trl07_on_the_logits(temperature):
    """`kl_penalty: full`: our chunked KL from hidden states + LM heads equals TRL 0.7's `F.kl_div` over the two
    full log-softmaxes (at temperature 1 TRL's logits are ours; at 0.7 both sides' logits are divided by it first)."""
    g = torch.Generator().manual_seed(0)
    B, T, d, V = 3, 11, 16, 50
    h, rh = torch.randn(B, T, d, generator=g), torch.randn(B, T, d, generator=g)
    # weights of a trained head's scale (logits of a few units), so float32 KLs of ~0.1–1 are compared at 1e-6
    w, rw, bias = (
        0.2 * torch.randn(V, d, generator=g),
        0.2 * torch.randn(V, d, generator=g),
        torch.randn(V, generator=g),
    )
    labels = torch.randint(0, V, (B, T), generator=g)
    logits, ref_logits = (F.linear(h, w, bias) / temperature), (F.linear(rh, rw, bias) / temperature)
    expected = trl07_kl_penalty("full", F.log_softmax(logits, 2), F.log_softmax(ref_logits, 2))  # core.py:95-104
    for chunk in (4096, 2):  # whole, and chunks of 2 positions
        lp, ref_lp, kl = full_kl(h, (w, bias), rh, (rw, bias), labels, temperature, chunk_tokens=chunk)
        assert torch.allclose(kl, expected, atol=TOL, rtol=0)
        assert torch.allclose(lp, F.log_softmax(logits, 2).gather(2, labels.unsqueeze(2)).squeeze(2), atol=TOL, rtol=0)
        assert torch.allclose(
            ref_lp, F.log_softmax(ref_logits, 2).gather(2, labels.unsqueeze(2)).squeeze(2), atol=TOL, rtol=0
        )
    assert (kl >= -TOL).all()


@pytest.mark.parametrize("whiten", [False, True], ids=["raw", "whiten_rewards"])
@pytest.mark.parametrize("kind", ["kl", "abs", "mse"])
def test_rewards_advantages_and_returns_equal_trl07(episode, kind, whiten):
    e = episode
    (rewards, _non_score, kl), (adv, ret) = ours_advantages(e, kind, whiten)
    t_rewards, _t_non_score, t_kl = trl07_compute_rewards(
        e["scores"], e["logprobs"], e["ref"], e["mask"].long(), 0.05, kind
    )
    m = e["mask"]
    assert torch.allclose(rewards[m], t_rewards[m], atol=TOL, rtol=0)
    assert torch.allclose(kl[m], t_kl[m], atol=TOL, rtol=0)
    _, t_adv, t_ret = trl07_compute_advantages(
        e["values"], t_rewards, m.float(), 0.99, 0.95, whiten, remask_whitened=True
    )
    assert torch.allclose(adv[m], t_adv[m], atol=TOL, rtol=0)
    assert torch.allclose(ret, t_ret * m, atol=TOL, rtol=0)
    assert not adv[~m].any() and not ret[~m].any()
    if whiten:  # the re-mask matters only where there is padding: on unpadded rows TRL 0.7's own code gives the same
        full = {**e, "lengths": torch.full((e["B"],), e["R"]), "mask": torch.ones_like(m)}
        (f_rewards, _, _), (f_adv, f_ret) = ours_advantages(full, kind, whiten)
        _, tf_adv, tf_ret = trl07_compute_advantages(
            full["values"], f_rewards, full["mask"].float(), 0.99, 0.95, whiten
        )
        assert torch.allclose(f_adv, tf_adv, atol=TOL, rtol=0) and torch.allclose(f_ret, tf_ret, atol=TOL, rtol=0)


@pytest.mark.parametrize("threshold", [10.0, 1.05])
def test_policy_and_value_losses_and_ratio_threshold_equal_trl07(episode, threshold):
    e = episode
    g = e["g"]
    m = e["mask"]
    new = (e["logprobs"] + 0.3 * torch.randn(e["B"], e["R"], generator=g)).masked_fill(~m, ppo.INVALID_LOGPROB)
    adv = torch.randn(e["B"], e["R"], generator=g).masked_fill(~m, 0)
    vpred = e["values"] + 0.5 * torch.randn(e["B"], e["R"], generator=g)
    returns = torch.randn(e["B"], e["R"], generator=g)
    pl = losses.policy_loss(new, e["logprobs"], adv, m, 0.2)
    vf, vf_clipfrac = losses.value_loss(vpred, e["values"], returns, m, 0.2)
    skipped = ratio_exceeds(pl.ratio, m, threshold)
    loss = (pl.loss + 0.1 * vf) * (0.0 if skipped else 1.0)
    t = trl07_loss(e["logprobs"], e["values"], vpred, new, m.float(), adv, returns, 0.2, 0.2, 0.1, threshold)
    assert skipped == t["skipped"] and skipped == (threshold < 2)  # the 0.3-σ perturbation gives a mean ratio ≈ 1.1
    for ours, theirs in (
        (loss, t["loss"]),
        (pl.clipfrac, t["pg_clipfrac"]),
        (vf_clipfrac, t["vf_clipfrac"]),
        (pl.approxkl, t["approxkl"]),
        (pl.policykl, t["policykl"]),
    ):
        assert float(ours) == pytest.approx(float(theirs), abs=TOL)
    if not skipped:
        assert float(pl.loss) == pytest.approx(float(t["pg_loss"]), abs=TOL)
        assert float(vf) == pytest.approx(float(t["vf_loss"]), abs=TOL)


def test_adaptive_kl_controller_equals_trl07():
    ours, theirs = (
        KLController(0.2, adaptive=True, target=6.0, horizon=10000),
        Trl07AdaptiveKLController(0.2, 6.0, 10000),
    )
    fixed = KLController(0.2)
    for kl, n in [(0.0, 256), (3.0, 256), (6.0, 64), (7.0, 64), (100.0, 512), (-2.0, 128), (5.9, 8000)]:
        ours.update(kl, n)
        theirs.update(kl, n)
        fixed.update(kl, n)
        assert ours.value == pytest.approx(float(theirs.value), abs=TOL, rel=0)
    assert fixed.value == 0.2
    restored = KLController(0.2, adaptive=True, target=6.0, horizon=10000)
    restored.load_state_dict(ours.state_dict())
    assert restored.value == ours.value


@pytest.mark.parametrize(
    "scaling,norm,clip", [(True, False, None), (True, True, None), (True, True, 0.5), (False, False, 1.0)]
)
def test_score_scaling_normalisation_and_clipping_equal_trl07(scaling, norm, clip):
    g = torch.Generator().manual_seed(1)
    ours, theirs = RunningMoments() if scaling else None, Trl07RunningMoments()
    for k in range(4):
        scores = 3.0 + 2.0 * torch.randn(16 + 8 * k, generator=g)
        mine = transform_scores(scores.clone(), ours, norm, clip)
        expected = trl07_scale_scores(scores.clone(), theirs, scaling, norm, clip)
        assert torch.allclose(mine, expected, atol=TOL, rtol=0)
        if ours is not None:
            assert ours.mean == pytest.approx(float(theirs.mean), abs=TOL) and ours.std == pytest.approx(
                float(theirs.std), abs=TOL
            )
    if ours is not None:
        again = RunningMoments()
        again.load_state_dict(ours.state_dict())
        assert again.state_dict() == ours.state_dict()


def test_running_moments_return_the_batch_moments_as_trl07():
    xs = torch.tensor([1.0, 2.0, 4.0, 8.0])
    assert RunningMoments().update(xs) == pytest.approx(Trl07RunningMoments().update(xs), abs=TOL)


@pytest.mark.parametrize("policykl", [-0.5, 0.0, 1.49, 1.5, 1.51, 4.0])
def test_early_stopping_rule_equals_trl07(policykl):
    assert should_stop_early(policykl, 1.0) == trl07_early_stop(torch.tensor(policykl), 1.0)
    assert should_stop_early(policykl, None) is False


# --- the terminal step after EOS ------------------------------------------------------------------


@pytest.mark.parametrize("whiten", [False, True], ids=["raw", "whiten_rewards"])
def test_nothing_after_the_response_reaches_advantages_returns_or_losses(episode, whiten):
    """The step after a response's last token is terminal: values at or after the first padding position (which the
    TRL 1.12 loop bootstrapped from: +10 there moved the last token's advantage by γ(1−λ)·10) change no advantage,
    return, policy loss or value loss."""
    e = episode
    g = e["g"]
    _, (adv, ret) = ours_advantages(e, whiten=whiten)
    m = e["mask"]
    noisy = e["values"] + 10.0 * torch.randn(e["B"], e["R"], generator=g) * (~m)
    _, (adv2, ret2) = ours_advantages(e, whiten=whiten, values=noisy)
    assert torch.equal(adv, adv2) and torch.equal(ret, ret2)
    # the shift the old bootstrap caused, on the same tensors: γ(1−λ)·Δ at the last token of each row with padding
    bumped = e["values"].clone()
    rows = torch.nonzero(e["lengths"] < e["R"]).squeeze(1)
    bumped[rows, e["lengths"][rows]] += 10.0
    _, (adv3, _) = ours_advantages(e, whiten=whiten, values=bumped)
    assert torch.equal(adv, adv3)

    new = (e["logprobs"] + 0.2 * torch.randn(e["B"], e["R"], generator=g)).masked_fill(~m, ppo.INVALID_LOGPROB)
    vpred = e["values"] + 0.3 * torch.randn(e["B"], e["R"], generator=g)
    vpred_noisy = vpred + 50.0 * (~m)
    assert (
        losses.policy_loss(new, e["logprobs"], adv, m, 0.2).loss
        == losses.policy_loss(new, e["logprobs"], adv2, m, 0.2).loss
    )
    assert losses.value_loss(vpred, e["values"], ret, m, 0.2) == losses.value_loss(vpred_noisy, noisy, ret2, m, 0.2)


def test_reward_whitening_sees_response_tokens_only(episode):
    """With `whiten_rewards`, the statistics are those of the response tokens alone (no fake zero-reward step per row)."""
    e = episode
    (rewards, _, _), _ = ours_advantages(e)
    m = e["mask"]
    whitened = masked_whiten(rewards * m, m, shift_mean=False)
    inside = whitened[m]
    assert float(inside.mean()) == pytest.approx(float(rewards[m].mean()), abs=1e-5)
    assert float(((inside - inside.mean()) ** 2).sum() / (m.sum() - 1)) == pytest.approx(1.0, abs=1e-4)


def test_policy_statistics_average_over_response_tokens_only(episode):
    """approxkl and policykl are means over response tokens: padding (equal INVALID log-probs, ratio 1) does not dilute them."""
    e = episode
    m = e["mask"]
    new = (e["logprobs"] + 0.3).masked_fill(~m, ppo.INVALID_LOGPROB)
    pl = losses.policy_loss(new, e["logprobs"], torch.zeros_like(new), m, 0.2)
    assert float(pl.approxkl) == pytest.approx(0.5 * 0.3**2, abs=1e-6)
    assert float(pl.policykl) == pytest.approx(-0.3, abs=1e-6)
