"""`activation_offloading`: the decoder's saved tensors wait for the backward in host memory, with the same losses and
gradients. Without a GPU the offloader copies host tensors (`device_type="cpu"`): the same hooks, rules and copies
run, only the streams are a GPU's own."""

from __future__ import annotations

import logging
import warnings

import pytest
import torch
from support import tiny_split

from alignpipe import offload
from alignpipe.modeling import enable_activation_checkpointing, load_causal_lm
from alignpipe.offload import ActivationOffload, decoder_bodies
from alignpipe.tracking import Tracker
from alignpipe.trainers import dpo, sft
from alignpipe.trainers.configs import DPOConfig, SFTConfig


@pytest.fixture(scope="module")
def data(tiny):
    return tiny_split(tiny, "sentiment_sft", "prompt_completion", rows=200, max_length=64)


class Spy(ActivationOffload):
    """An offloader on host tensors that remembers the storages it copied."""

    def __init__(self):
        super().__init__(device_type="cpu")
        self.copied: list[torch.Tensor] = []

    def _copy_out(self, t):
        self.copied.append(t)
        return super()._copy_out(t)


def test_parameters_their_views_small_and_broadcast_tensors_stay():
    off = ActivationOffload(device_type="cpu")
    weight = torch.nn.Parameter(torch.randn(64, 64))
    activation = torch.randn(16, 64)
    assert off.keeps(weight) and off.keeps(weight.t())
    assert off.keeps(torch.randn(8))  # 32 bytes
    assert off.keeps(torch.randn(1, 64).expand(64, 64))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # strided nested tensors are a prototype
        assert off.keeps(torch.nested.nested_tensor([torch.randn(300), torch.randn(400)]))
    assert not off.keeps(activation) and not off.keeps(activation.t()) and not off.keeps(activation[:, 8:])
    assert ActivationOffload(device_type="cuda").keeps(activation)  # a host tensor is already off the GPU


def test_a_tensor_saved_twice_is_copied_once_unless_changed_in_between():
    a, b = torch.randn(64, 64, requires_grad=True), torch.randn(64, 64, requires_grad=True)
    x = torch.randn(32, 64, requires_grad=True)
    with Spy() as off:
        h = x * 2
        y = h @ a + h @ b  # both matmuls save h
    assert len(off.copied) == 3 and off.bytes_moved() == (32 * 64 + 2 * 64 * 64) * 4  # h once, a and b once each
    assert off.bytes_moved() == 0  # read and reset

    with Spy() as off:
        h = x * 2
        h.sin()  # saves h, never backpropagated
        h.add_(1)
        z = h.cos()  # saves the changed h: its own copy, or the gradient would be taken at the old values
    assert len(off.copied) == 2
    (got,) = torch.autograd.grad(z.sum() + y.sum(), [x])
    with torch.no_grad():
        h_new = x * 2 + 1
    want = -torch.sin(h_new) * 2 + 2 * (a.sum(1) + b.sum(1))
    # float32 sums of 64 terms of ~25 in all, reduced in another order than the matmul's backward (which depends on
    # torch's thread count): 1e-4 is float32's noise there; gradients taken at the old h would be off by ~1
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def forward_backward(model, ids):
    model.zero_grad(set_to_none=True)
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("checkpointing", [False, True])
def test_the_same_loss_and_gradients_with_no_weight_copied(tiny, checkpointing):
    """Offloaded or not, the loss and every gradient are equal bit for bit; no parameter's storage is copied; under
    activation checkpointing only the layers' inputs move, a small fraction of what an unchecked forward saves."""
    model = load_causal_lm(str(tiny / "model")).train()
    if checkpointing:
        enable_activation_checkpointing(model)
    ids = torch.randint(0, model.config.vocab_size, (4, 48))
    want_loss, want = forward_backward(model, ids)
    spy = Spy().attach(model)
    loss, got = forward_backward(model, ids)
    assert torch.equal(loss, want_loss) and all(torch.equal(g, w) for g, w in zip(got, want, strict=True))
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    assert spy.copied and not any(t.untyped_storage().data_ptr() in params for t in spy.copied)
    moved, hidden = spy.bytes_moved(), ids.numel() * model.config.hidden_size * 4
    layers = model.config.num_hidden_layers
    if (
        checkpointing
    ):  # each layer's input, the final norm's input and normalised input (no checkpoint), the embedding's ids
        assert moved == (layers + 2) * hidden + ids.numel() * 8
    else:
        assert moved > 10 * layers * hidden


def test_the_heads_tensors_and_no_grad_forwards_stay(tiny):
    """The LM head saves its input (the decoder's last hidden states) and reads it first in the backward: it stays."""
    model = load_causal_lm(str(tiny / "model"))
    spy = Spy().attach(model)
    ids = torch.randint(0, model.config.vocab_size, (2, 32))
    with torch.no_grad():
        model(input_ids=ids)
    assert not spy.copied
    head_input = model(input_ids=ids, output_hidden_states=True).hidden_states[-1]
    assert head_input.grad_fn is not None
    assert spy.copied and not any(t.data_ptr() == head_input.data_ptr() for t in spy.copied)


def test_bodies_of_a_policy_and_value_pair(tiny):
    from alignpipe.modeling import load_sequence_scorer, lora_model
    from alignpipe.trainers.configs import LoraSpec

    policy = lora_model(load_causal_lm(str(tiny / "model")), LoraSpec(r=4))
    value = load_sequence_scorer(str(tiny / "model"), pad_token_id=0)
    pair = torch.nn.ModuleDict({"policy": policy, "value": value})
    assert [type(b).__name__ for b in decoder_bodies(pair)] == ["LlamaModel", "LlamaModel"]
    with pytest.raises(ValueError, match="found no transformers decoder"):
        ActivationOffload().attach(torch.nn.Linear(2, 2))


def test_on_the_cpu_a_stage_says_there_is_nothing_to_offload(tiny, caplog):
    with caplog.at_level(logging.INFO, "alignpipe.offload"):
        assert offload.offload_activations(load_causal_lm(str(tiny / "model")), torch.device("cpu")) is None
    assert "host memory already" in caplog.text


@pytest.fixture
def offloading_on_cpu(monkeypatch):
    """Stages offload as on a GPU, from host tensors; the offloaders made."""
    made: list[ActivationOffload] = []

    def attach(model, device):
        made.append(ActivationOffload(device_type="cpu").attach(model))
        return made[-1]

    monkeypatch.setattr(offload, "offload_activations", attach)
    return made


def test_sft_compiled_sft_and_dpo_train_the_same_steps_offloaded(tiny, data, tmp_path, offloading_on_cpu):
    tok, train, _ = data
    _, pairs, _ = tiny_split(tiny, "sentiment_preferences", "preference", rows=64, max_length=64)
    runs = {
        "sft": lambda cfg, tracker, out: sft.train(
            SFTConfig(**cfg, gradient_checkpointing=True),
            load_causal_lm(str(tiny / "model")),
            tok,
            train[:24],
            [],
            tracker,
            out,
        ),
        "sft-compiled": lambda cfg, tracker, out: sft.train(
            SFTConfig(**cfg, compile=True), load_causal_lm(str(tiny / "model")), tok, train[:24], [], tracker, out
        ),
        "dpo": lambda cfg, tracker, out: dpo.train(
            DPOConfig(**cfg),
            load_causal_lm(str(tiny / "model")),
            tok,
            pairs[:24],
            [],
            tracker,
            out,
            ref_model=load_causal_lm(str(tiny / "model")),
        ),
    }
    for name, run in runs.items():
        curves = {}
        for on in (False, True):
            tracker = Tracker()
            cfg = dict(max_steps=3, batch_size=4, logging_every=1, activation_offloading=on)
            run(cfg, tracker, tmp_path / f"{name}-{on}")
            curves[on] = tracker.series("train/loss")
            if on:
                assert all(gb > 0 for gb in tracker.series("train/offloaded_gb")) and offloading_on_cpu
            else:
                assert not tracker.series("train/offloaded_gb")
        assert curves[True] == curves[False], name


def test_ppo_offloads_from_the_policy_and_the_value_model(tiny, tmp_path, offloading_on_cpu):
    from support import run_ppo

    _, plain, _ = run_ppo(tiny, tmp_path / "plain")
    _, offloaded, _ = run_ppo(tiny, tmp_path / "offloaded", activation_offloading=True)
    for key in ("loss/policy_avg", "loss/value_avg", "objective/kl"):
        assert offloaded.series(key) == plain.series(key), key
    assert all(gb > 0 for gb in offloaded.series("offloaded_gb"))


def test_grpo_trains_the_same_steps_offloaded(tiny, tmp_path, offloading_on_cpu):
    """Rollouts (no gradient: nothing saved, nothing moved) then the update, offloaded."""
    from alignpipe.judges.reward_set import LoadedReward, RewardSet
    from alignpipe.trainers import grpo
    from alignpipe.trainers.configs import GRPOConfig

    tok, train, _ = tiny_split(tiny, "reverse", "prompt_completion", rows=16)
    rows = [{"prompt": r["prompt"]} for r in train]
    rewards = RewardSet([LoadedReward("len", lambda p, c, **_: [len(x) / 10 for x in c])])
    curves = {}
    for on in (False, True):
        cfg = GRPOConfig(
            max_steps=2, batch_size=8, num_generations=4, max_completion_length=8, beta=0.04, logging_every=1,
            activation_offloading=on,
        )  # fmt: skip
        tracker = Tracker()
        model = load_causal_lm(str(tiny / "model"))
        grpo.train(
            cfg, model, tok, rows, rewards, tracker, tmp_path / str(on), ref_model=load_causal_lm(str(tiny / "model"))
        )
        curves[on] = [tracker.series(k) for k in ("train/loss", "train/kl", "train/reward")]
    assert curves[True] == curves[False]
    assert all(gb > 0 for gb in tracker.series("train/offloaded_gb"))
