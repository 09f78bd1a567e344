"""GRPO's `sampling_correction` and `off_policy_mask_threshold`: the weights and the mask equal TRL 1.16's, a run
weighs its policy term by them, and the settings an engine cannot serve are refused."""

from __future__ import annotations

import math

import pytest
import torch
from support import tiny_split

from alignpipe.judges.reward_set import LoadedReward, RewardSet
from alignpipe.modeling import load_causal_lm
from alignpipe.rl_math import off_policy_mask, sampling_importance_weights
from alignpipe.tracking import Tracker
from alignpipe.trainers import grpo
from alignpipe.trainers.configs import GRPOConfig

MODES = ["token_truncate", "token_mask", "sequence_truncate", "sequence_mask"]


def trl_sampling_weights(old, sampled, mask, mode, low, high):
    """trl/trainer/grpo_trainer.py (1.16.0) lines 2660-2707, `_generate_and_score_completions`, written out."""
    per_token_logps_diff = torch.nan_to_num((old - sampled) * mask, nan=0.0)
    if mode in ["sequence_mask", "sequence_truncate"]:
        logps_diff = per_token_logps_diff.sum(dim=-1, keepdim=True)
    else:
        logps_diff = per_token_logps_diff
    ratio = torch.exp(logps_diff)
    if mode in ["sequence_truncate", "token_truncate"]:
        return torch.clamp(ratio, min=low, max=high)
    min_val = low if low is not None else -math.inf
    max_val = high if high is not None else math.inf
    return ratio.masked_fill((ratio < min_val) | (ratio > max_val), value=0.0)


def batch(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0], [1, 1, 1, 1, 0]]).float()
    old = torch.randn(4, 5, generator=g) * 0.3 - 2
    sampled = old + torch.randn(4, 5, generator=g) * 0.4
    sampled[1, 2] = float("nan")  # a token the engine had no log-prob for
    return old, sampled, mask


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("bounds", [(None, 3.0), (0.5, 1.5), (0.8, None)])
def test_the_weights_equal_trls(mode, bounds):
    if mode.endswith("truncate") and bounds == (None, None):
        pytest.skip("refused by the config")
    old, sampled, mask = batch()
    ours = sampling_importance_weights(old, sampled, mask, mode, *bounds)
    theirs = trl_sampling_weights(old, sampled, mask, mode, *bounds)
    assert ours.shape == theirs.shape == ((4, 1) if mode.startswith("sequence") else (4, 5))
    assert torch.equal(ours, theirs)
    if mode.endswith("mask") and bounds == (0.5, 1.5):
        assert (ours == 0).any() and (ours != 0).any(), "some weights masked, some kept"


def test_the_off_policy_mask_equals_trls():
    trl = pytest.importorskip("trl")
    old, sampled, mask = batch(1)
    logps = old + 0.3 * torch.randn(4, 5, generator=torch.Generator().manual_seed(2))
    advantages = torch.tensor([-1.0, 0.5, -0.2, -2.0])
    for threshold in (0.0, 0.1, 1.0):
        ours = off_policy_mask(advantages, logps, sampled, mask, threshold)
        theirs = trl.GRPOTrainer.get_off_policy_mask(advantages.unsqueeze(1), logps, sampled, mask, threshold)
        assert torch.equal(ours, theirs), threshold


def length(prompts, completions, **_):
    return [float(len(c)) for c in completions]


class Biased:
    """The hf engine, its sampling log-probs shifted by log 2 (as if the sampler found every token twice as likely
    as the trainer does)."""

    def __init__(self, engine):
        self.engine = engine

    def update_weights(self, model):
        self.engine.update_weights(model)

    def generate(self, prompts, n=1, sampling=None, seed=None, logprobs=False):
        gens = self.engine.generate(prompts, n, sampling, seed, logprobs)
        for g in gens:
            if g.logprobs is not None:
                g.logprobs = [x + math.log(2.0) for x in g.logprobs]
        return gens


@pytest.fixture(scope="module")
def prompts(tiny):
    tok, train, _ = tiny_split(tiny, "reverse", "prompt_completion", rows=32)
    return tok, [{"prompt": r["prompt"]} for r in train]


def run(tiny, prompts, tmp_path, biased: bool = False, **overrides):
    from alignpipe.engine.hf import HFEngine

    tok, rows = prompts
    model = load_causal_lm(str(tiny / "model"))
    engine = HFEngine(model, tok, 64)
    cfg = GRPOConfig(learning_rate=1e-3, max_steps=2, batch_size=8, num_generations=4, max_completion_length=6,
                     loss_type="dapo", logging_every=1, sample_every=100, **overrides)  # fmt: skip
    tracker = Tracker()
    rewards = RewardSet([LoadedReward("length", length)])
    grpo.train(cfg, model, tok, rows, rewards, tracker, tmp_path, engine=Biased(engine) if biased else engine)
    return tracker


def test_a_run_weighs_its_policy_term_by_the_correction(tiny, prompts, tmp_path):
    """With the hf engine on CPU the sampler's log-probs are the trainer's (gap ~1e-7, weights 1); an engine whose
    log-probs are log 2 higher gets token weights of 1/2, and with them the first step's policy gradient halves (the
    same rollout: the seed decides the samples; β = 0, so the gradient is the policy term's)."""
    plain = run(tiny, prompts, tmp_path / "none", sampling_correction="none")
    honest = run(tiny, prompts, tmp_path / "honest", sampling_correction="token_truncate")
    assert honest.series("train/sampling/sampling_logp_difference/max")[0] < 1e-4
    assert honest.series("train/sampling/importance_sampling_ratio/mean")[0] == pytest.approx(1.0, abs=1e-4)
    assert honest.series("train/grad_norm")[0] == pytest.approx(plain.series("train/grad_norm")[0], rel=1e-4)
    biased = run(tiny, prompts, tmp_path / "biased", biased=True, sampling_correction="token_truncate")
    assert biased.series("train/sampling/sampling_logp_difference/mean")[0] == pytest.approx(math.log(2), abs=1e-4)
    assert biased.series("train/sampling/importance_sampling_ratio/max")[0] == pytest.approx(0.5, abs=1e-4)
    assert biased.series("train/grad_norm")[0] == pytest.approx(plain.series("train/grad_norm")[0] / 2, rel=1e-4)
    assert plain.series("train/grad_norm")[0] > 1e-3
    assert not plain.series("train/sampling/importance_sampling_ratio/mean")


def test_sequence_mask_drops_completions_the_sampler_disagrees_with(tiny, prompts, tmp_path):
    """sequence_mask with a lower bound above the biased engine's per-completion weights 2^-n: every completion's
    weight is zeroed, so nothing trains."""
    tracker = run(
        tiny, prompts, tmp_path, biased=True, sampling_correction="sequence_mask", sampling_correction_min=0.9
    )
    assert tracker.series("train/sampling/importance_sampling_ratio/max")[0] < 0.9
    assert tracker.series("train/grad_norm")[0] == 0.0


def test_the_off_policy_mask_runs_on_the_engines_logprobs(tiny, prompts, tmp_path):
    """With the biased engine every completion seems log 2 off-policy: a threshold of 0.5 drops those with negative
    advantages (leaving the loss's negative part), one of 1.0 keeps them all."""
    kept = run(tiny, prompts, tmp_path / "kept", biased=True, sampling_correction="none", off_policy_mask_threshold=1.0)
    cut = run(tiny, prompts, tmp_path / "cut", biased=True, sampling_correction="none", off_policy_mask_threshold=0.5)
    plain = run(tiny, prompts, tmp_path / "plain", sampling_correction="none")
    assert kept.series("train/grad_norm")[0] == pytest.approx(plain.series("train/grad_norm")[0], rel=1e-5)
    assert cut.series("train/loss")[0] < plain.series("train/loss")[0] - 1e-3


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (
            {
                "rollout": {"backend": "vllm", "mode": "server", "server_url": "http://x"},
                "sampling_correction": "token_truncate",
            },
            "started with `--logprobs-mode processed_logprobs`",
        ),
        (
            {
                "rollout": {"backend": "vllm", "mode": "server", "server_url": "http://x"},
                "off_policy_mask_threshold": 1,
            },
            "started with `--logprobs-mode processed_logprobs`",
        ),
        ({"sampling_correction": "token_truncate", "sampling_correction_max": None}, "both are null"),
        ({"sampling_correction_min": 2.0, "sampling_correction_max": 1.0}, "must be below"),
        ({"loss_type": "vespo", "rollout": {"backend": "vllm"}}, "folds the sampling correction"),
        ({"loss_type": "vespo", "importance_sampling_level": "sequence"}, "leave importance_sampling_level"),
    ],
)
def test_settings_no_engine_can_serve_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        GRPOConfig(**kwargs)


def test_auto_is_trls_default_with_vllm_colocate_and_off_elsewhere():
    assert GRPOConfig(rollout={"backend": "vllm"}).correction == "sequence_mask"
    assert GRPOConfig().correction == "none"
    server = {"backend": "vllm", "mode": "server", "server_url": "http://x"}
    assert GRPOConfig(rollout=server).correction == "none", "a server's raw log-probs cannot correct"
    processed = server | {"logprobs_mode": "processed_logprobs"}
    assert GRPOConfig(rollout=processed).correction == "sequence_mask", "its sampler's can, as TRL's server mode"
