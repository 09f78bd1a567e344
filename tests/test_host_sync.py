"""An offline training step reads nothing back from the device: each read would stall a GPU until its queue drains
(`float(loss)` per micro-batch is the classic, a boolean index of a device tensor another). The step runs with tensor-to-host conversions made to fail; metrics
stay device tensors until the loop reads them at a log point. (Reads inside transformers, e.g. its check of an SDPA
padding mask, are outside this test: they are the same for every trainer built on it.)"""

from __future__ import annotations

import copy

import pytest
import torch
from support import tiny_split

from alignpipe.modeling import load_causal_lm, load_sequence_scorer
from alignpipe.tracking import Tracker
from alignpipe.trainers import common, dpo, kto, reward, sft
from alignpipe.trainers.configs import DPOConfig, KTOConfig, RewardConfig, SFTConfig

READS = ("__float__", "__int__", "item", "tolist")


class HostRead(AssertionError):
    pass


@pytest.fixture
def steps_read_nothing(monkeypatch):
    """Inside a training step, `float(t)`, `int(t)`, `t.item()` and `t.tolist()` of a tensor raise."""
    inside = {"step": False}
    for name in READS:
        original = getattr(torch.Tensor, name)

        def guarded(self, *args, _name=name, _original=original, **kwargs):
            if inside["step"]:
                raise HostRead(f"a training step read a tensor back with {_name}")
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, guarded)
    run = common.TrainLoop.run

    def run_guarded(self, step_fn, eval_fn=None):
        def step(window):
            inside["step"] = True
            try:
                return step_fn(window)
            finally:
                inside["step"] = False

        return run(self, step, eval_fn)

    monkeypatch.setattr(common.TrainLoop, "run", run_guarded)


@pytest.mark.parametrize("packing", [False, True])
def test_an_sft_step_reads_nothing_back(tiny, tmp_path, steps_read_nothing, packing):
    tok, train, evals = tiny_split(tiny, "sentiment_sft", "prompt_completion", rows=120, max_length=64)
    cfg = SFTConfig(max_steps=3, batch_size=4, gradient_accumulation_steps=2, packing=packing, max_length=128)
    tracker = Tracker()
    sft.train(cfg, load_causal_lm(str(tiny / "model")), tok, train, evals, tracker, tmp_path)
    assert tracker.last("train/loss") > 0 and tracker.last("train/num_tokens") > 0


@pytest.mark.parametrize("share", [False, True], ids=["whole-rows", "shared-prompts"])
def test_dpo_and_reward_steps_read_nothing_back(tiny, tmp_path, monkeypatch, steps_read_nothing, share):
    """Sharing each pair's prompt (what pays at long prompts on a GPU) is decided from host flags `collate` sets."""
    from alignpipe import logprobs

    calls: list[str] = []
    if share:
        monkeypatch.setattr(logprobs, "SHARE_MIN_SAVED", 0)
        for module in (logprobs, reward):
            shared = module.shared_prefix_hidden
            monkeypatch.setattr(
                module, "shared_prefix_hidden", lambda *a, _f=shared, _m=module: calls.append(_m.__name__) or _f(*a)
            )
    tok, train, evals = tiny_split(tiny, "sentiment_preferences", "preference", rows=80, max_length=64)
    policy = load_causal_lm(str(tiny / "model"))
    tracker = Tracker()
    cfg = DPOConfig(max_steps=2, batch_size=4, gradient_accumulation_steps=2, rpo_alpha=0.5)
    dpo.train(cfg, policy, tok, train, evals, tracker, tmp_path / "dpo", ref_model=copy.deepcopy(policy))
    assert tracker.last("train/rewards/accuracies") is not None and tracker.last("train/nll_loss") > 0
    scorer = load_sequence_scorer(str(tiny / "model"), "float32", pad_token_id=tok.pad_token_id)
    tracker = Tracker()
    reward.train(RewardConfig(max_steps=2, batch_size=4), scorer, tok, train, evals, tracker, tmp_path / "rm")
    assert tracker.last("train/accuracy") is not None and tracker.last("eval/accuracy") is not None
    if share:
        assert {"alignpipe.logprobs", "alignpipe.trainers.reward"} <= set(calls), "both took the shared path"


@pytest.mark.parametrize("loss_type", ["kto", "apo_zero_unpaired"])
def test_a_kto_step_reads_nothing_back(tiny, tmp_path, monkeypatch, steps_read_nothing, loss_type):
    """KTO's sides are told apart with `where` on the labels, and counted on the host by `collate`."""
    from alignpipe import logprobs

    monkeypatch.setattr(logprobs, "SHARE_MIN_SAVED", 0)
    tok, train, evals = tiny_split(tiny, "sentiment_preferences", "unpaired", rows=80, max_length=64)
    policy = load_causal_lm(str(tiny / "model"))
    tracker = Tracker()
    cfg = KTOConfig(max_steps=2, batch_size=4, gradient_accumulation_steps=2, loss_type=loss_type)
    kto.train(cfg, policy, tok, train, evals, tracker, tmp_path, ref_model=copy.deepcopy(policy))
    assert tracker.last("train/rewards/margins") is not None and tracker.last("eval/logps/chosen") is not None
