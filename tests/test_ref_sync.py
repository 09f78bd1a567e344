"""TR-DPO's synced reference (`sync_ref_model`): the update equals TRL's, DPO and GRPO/RLOO runs use the synced
reference, a resumed run continues from the one in its checkpoint, and the settings without a reference copy are
refused."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from support import tiny_split

from alignpipe.judges.reward_set import LoadedReward, RewardSet
from alignpipe.modeling import load_causal_lm
from alignpipe.recipe import RecipeError, parse_recipe
from alignpipe.recipe.stages import DPOStage
from alignpipe.tracking import Tracker
from alignpipe.trainers import dpo, grpo, rloo
from alignpipe.trainers.configs import DPOConfig, GRPOConfig, LoraSpec, RLOOConfig
from alignpipe.trainers.ref_sync import CHECKPOINT_FILE, mix_into

LN2 = math.log(2.0)


@pytest.fixture(scope="module")
def pairs(tiny):
    return tiny_split(tiny, "sentiment_preferences", "preference", rows=400, max_length=64)


def test_the_update_equals_trls_sync_callback(tiny):
    """Our α-mix of a policy into its reference equals `SyncRefModelCallback._sync_target_model` bit for bit."""
    from trl.trainer.callbacks import SyncRefModelCallback

    policy, ours, theirs = (load_causal_lm(str(tiny / "model")) for _ in range(3))
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in policy.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.1)
    for alpha in (0.6, 1.0):
        mix_into(ours, policy, alpha)
        SyncRefModelCallback._sync_target_model(policy, theirs, alpha)
        for (name, a), b in zip(ours.named_parameters(), theirs.parameters()):
            assert torch.equal(a, b), name
    # α = 1 last: a copy of the policy
    assert all(torch.equal(a, b) for a, b in zip(ours.parameters(), policy.parameters()))


def run_dpo(tiny, pairs, out, **overrides):
    tok, train, _ = pairs
    tracker = Tracker()
    args = dict(learning_rate=5e-4, max_steps=4, batch_size=8, logging_every=1, lr_scheduler="constant")
    cfg = DPOConfig(**{**args, **overrides})
    model, ref = load_causal_lm(str(tiny / "model")), load_causal_lm(str(tiny / "model"))
    result = dpo.train(cfg, model, tok, train, [], tracker, out, ref_model=ref)
    return result, tracker, ref


def test_dpo_with_the_reference_copied_every_step_starts_each_step_at_log_2(tiny, pairs, tmp_path):
    """α = 1 every step: each step's reference is the policy the step starts from, so every log-ratio is 0 and
    every loss is log 2; without the sync the policy moves away from its reference after step 1."""
    _, synced, ref = run_dpo(tiny, pairs, tmp_path / "sync", sync_ref_model=True, ref_model_mixup_alpha=1.0,
                             ref_model_sync_steps=1)  # fmt: skip
    assert synced.series("train/loss") == pytest.approx([LN2] * 4, abs=1e-6)
    assert synced.series("train/rewards/margins") == pytest.approx([0.0] * 4, abs=1e-6)
    # the reference now holds the final policy's weights
    trained = load_causal_lm(str(tmp_path / "sync" / "model"))
    assert all(torch.equal(a, b) for a, b in zip(ref.parameters(), trained.parameters()))

    _, plain, _ = run_dpo(tiny, pairs, tmp_path / "plain")
    assert plain.series("train/loss")[0] == pytest.approx(LN2, abs=1e-6)
    assert all(abs(x - LN2) > 1e-3 for x in plain.series("train/loss")[1:])


def test_a_resumed_dpo_run_continues_from_the_synced_reference_in_its_checkpoint(tiny, pairs, tmp_path):
    """Synced at step 2 and checkpointed there, a run stopped after step 3 resumes from step 2 with that reference:
    its steps 3 and 4 equal an uninterrupted run's. A checkpoint without the reference is refused on resume."""
    args = dict(sync_ref_model=True, ref_model_mixup_alpha=0.5, ref_model_sync_steps=2, save_every=2)
    _, whole, _ = run_dpo(tiny, pairs, tmp_path / "whole", **args)
    run_dpo(tiny, pairs, tmp_path / "again", **{**args, "max_steps": 3})
    checkpoint = tmp_path / "again" / "checkpoints" / "step-2"
    assert (checkpoint / CHECKPOINT_FILE).exists()
    resumed, tracker, _ = run_dpo(tiny, pairs, tmp_path / "again", **args)
    assert resumed.resumed_from == 2
    assert tracker.series("train/loss") == pytest.approx(whole.series("train/loss")[2:], abs=1e-6)
    # the reference matters: steps 3-4 against the starting weights would differ
    _, unsynced, _ = run_dpo(tiny, pairs, tmp_path / "unsynced", save_every=2)
    assert abs(unsynced.series("train/loss")[2] - whole.series("train/loss")[2]) > 1e-4

    (checkpoint / CHECKPOINT_FILE).unlink()
    with pytest.raises(FileNotFoundError, match="synced reference"):
        run_dpo(tiny, pairs, tmp_path / "again", **args)


@pytest.fixture(scope="module")
def reversal(tiny):
    tok, train, _ = tiny_split(tiny, "reverse", "prompt_completion", rows=64)
    return tok, [{"prompt": r["prompt"], "answer": r["answer"]} for r in train]


def length(prompts, completions, **_):
    return [float(len(c)) for c in completions]


@pytest.mark.parametrize("trainer", ["grpo", "rloo"])
def test_grpo_and_rloo_with_the_reference_copied_every_step_measure_no_kl(tiny, reversal, tmp_path, trainer):
    """α = 1 every step with β > 0: each rollout's reference is the policy that sampled it, so the KL the step
    measures is 0; without the sync it grows after step 1 (a large learning rate)."""
    tok, rows = reversal
    rewards = RewardSet([LoadedReward("length", length)])  # varies within a group from the start, unlike exact_match
    config, module = {"grpo": (GRPOConfig, grpo), "rloo": (RLOOConfig, rloo)}[trainer]

    def kls(**sync):
        tracker = Tracker()
        cfg = config(
            learning_rate=3e-3, max_steps=3, batch_size=8, num_generations=4, max_completion_length=6, beta=0.1,
            logging_every=1, sample_every=100, **sync,
        )  # fmt: skip
        model, ref = load_causal_lm(str(tiny / "model")), load_causal_lm(str(tiny / "model"))
        module.train(cfg, model, tok, rows, rewards, tracker, tmp_path / str(bool(sync)), ref_model=ref)
        return tracker.series("train/kl")

    assert kls(sync_ref_model=True, ref_model_mixup_alpha=1.0, ref_model_sync_steps=1) == pytest.approx(
        [0.0] * 3, abs=1e-6
    )
    assert all(k > 1e-5 for k in kls()[1:])


@pytest.mark.parametrize(
    ("config", "kwargs", "why"),
    [
        (DPOConfig, {"lora": LoraSpec()}, "lora is set"),
        (DPOConfig, {"reference_free": True}, "reference_free"),
        (DPOConfig, {"precompute_ref_logps": True}, "precompute_ref_logps"),
        (GRPOConfig, {}, "beta is 0"),
        (RLOOConfig, {"beta": 0.0}, "beta is 0"),
    ],
)
def test_a_stage_without_a_reference_copy_cannot_sync_one(config, kwargs, why):
    with pytest.raises(ValueError, match=why):
        config(sync_ref_model=True, **kwargs)


def test_the_recipe_error_names_the_stage_and_the_fix(tiny):
    text = (Path(__file__).parents[1] / "pipelines" / "tiny-dpo.yaml").read_text().replace("assets/tiny", str(tiny))
    good = text.replace("    # sync_ref_model: true", "    sync_ref_model: true\n    ref_model_sync_steps: 16", 1)
    assert good != text and parse_recipe(good).stage("dpo", DPOStage).sync_ref_model
    with pytest.raises(RecipeError) as e:
        parse_recipe(good.replace("ref_model_sync_steps: 16", "ref_model_sync_steps: 16\n    reference_free: true"))
    assert "(stage 'dpo')" in str(e.value) and "reference_free is set" in str(e.value)
    assert "drop sync_ref_model" in str(e.value)


def test_kto_with_the_reference_copied_every_step_measures_no_log_ratio(tiny, tmp_path):
    """KTO (TRL 1.16 syncs its reference too): α = 1 every step, so each step's policy is its reference and every
    reward (β × log-ratio) and the KL reference point are 0; without the sync they move after step 1."""
    from alignpipe.trainers import kto
    from alignpipe.trainers.configs import KTOConfig

    tok, train, _ = tiny_split(tiny, "sentiment_preferences", "unpaired", rows=200, max_length=64)

    def run(out, **sync):
        tracker = Tracker()
        cfg = KTOConfig(learning_rate=3e-4, max_steps=3, batch_size=8, logging_every=1, **sync)
        model, ref = load_causal_lm(str(tiny / "model")), load_causal_lm(str(tiny / "model"))
        kto.train(cfg, model, tok, train, [], tracker, out, ref_model=ref)
        return [abs(x) for x in tracker.series("train/rewards/chosen") + tracker.series("train/kl")]

    synced = run(tmp_path / "sync", sync_ref_model=True, ref_model_mixup_alpha=1.0, ref_model_sync_steps=1)
    assert max(synced) < 1e-6
    assert max(run(tmp_path / "plain")) > 1e-4
