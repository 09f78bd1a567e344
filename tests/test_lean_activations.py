"""`lean_activations`: the decoder's norms and SwiGLU products keep fewer tensors for backward, with the same
outputs and gradients."""

from __future__ import annotations

import copy

import pytest
import torch
from support import tiny_split

from alignpipe.lean_activations import lean_activations
from alignpipe.modeling import load_causal_lm, lora_model
from alignpipe.tracking import Tracker
from alignpipe.trainers import sft
from alignpipe.trainers.configs import LoraSpec, SFTConfig


def saved_for_backward(model, ids) -> tuple[int, torch.Tensor]:
    """(bytes of the distinct tensors autograd keeps for backward, logits) of a forward."""
    seen: dict = {}

    def pack(t):
        seen[(t.data_ptr(), t.dtype, tuple(t.shape))] = t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        logits = model(input_ids=ids).logits
    return sum(seen.values()), logits


def grads(model, logits, g):
    return torch.autograd.grad(logits, [p for p in model.parameters() if p.requires_grad], g)


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_the_same_outputs_and_gradients_with_fewer_bytes_kept(tiny, dtype):
    """bf16 (how GPU users train): outputs and every gradient equal the unpatched model's bit for bit. float32: the
    norm's input is its float32 copy, so the two gradient paths into it add in another order (each gradient within 2e-6 of its norm). The bytes
    kept for backward fall by exactly a hidden-sized float32 tensor per norm and silu(gate) per MLP."""
    torch.manual_seed(0)
    base = load_causal_lm(str(tiny / "model"), dtype=dtype)
    lean = copy.deepcopy(base)
    cfg = base.config
    layers = cfg.num_hidden_layers
    assert lean_activations(lean) == 2 * layers + 1 + layers  # two norms a layer, the final norm, an MLP a layer
    ids = torch.randint(0, cfg.vocab_size, (2, 64))
    (kept, logits), (lean_kept, lean_logits) = saved_for_backward(base, ids), saved_for_backward(lean, ids)
    assert torch.equal(lean_logits, logits)
    g = torch.randn_like(logits)
    want, got = grads(base, logits, g), grads(lean, lean_logits, g)
    if dtype == "bfloat16":
        assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    else:
        assert max(((a - b).norm() / b.norm()).item() for a, b in zip(got, want, strict=True)) < 2e-6
    tokens, width = ids.numel(), torch.finfo(logits.dtype).bits // 8
    hidden, inner = tokens * cfg.hidden_size, tokens * cfg.intermediate_size
    # a norm kept x in float32 (bf16: a copy; float32: x itself, which it keeps anyway), the normalised x in the
    # input's dtype and rsqrt's output; it now keeps x: one hidden-sized float32 tensor and rsqrt's output less
    per_norm = hidden * 4 + tokens * 4
    assert kept - lean_kept == (2 * layers + 1) * per_norm + layers * inner * width


def test_lora_layers_train_through_the_patched_modules(tiny):
    torch.manual_seed(0)
    base = lora_model(load_causal_lm(str(tiny / "model"), dtype="bfloat16"), LoraSpec(r=4))
    lean = copy.deepcopy(base)
    assert lean_activations(lean) > 0
    ids = torch.randint(0, 500, (2, 32))
    logits, lean_logits = base(input_ids=ids).logits, lean(input_ids=ids).logits
    g = torch.randn_like(logits)
    assert all(torch.equal(a, b) for a, b in zip(grads(lean, lean_logits, g), grads(base, logits, g), strict=True))


@pytest.mark.parametrize(
    ("options", "patched"),
    [
        ({}, True),
        ({"lean_activations": False}, False),
        ({"gradient_checkpointing": True}, False),
        ({"gradient_checkpointing": True, "checkpoint_every_n_layers": 2}, True),
    ],
)
def test_a_training_stage_patches_its_model_unless_told_or_checkpointing(tiny, tmp_path, options, patched):
    """On by default; the SFT run trains as the unpatched one (its losses, float32)."""
    tok, train, _ = tiny_split(tiny, "sentiment_sft", "prompt_completion", rows=64, max_length=64)

    def run(**extra):
        torch.manual_seed(0)
        model = load_causal_lm(str(tiny / "model"))
        tracker = Tracker()
        cfg = SFTConfig(learning_rate=1e-3, max_steps=3, batch_size=4, logging_every=1, **extra)
        sft.train(cfg, model, tok, train, [], tracker, tmp_path / str(len(list(tmp_path.iterdir()))))
        norm = model.model.norm
        return tracker.series("train/loss"), "forward" in vars(norm)

    losses, was_patched = run(**options)
    assert was_patched == patched
    reference, _ = run(lean_activations=False, **{k: v for k, v in options.items() if k != "lean_activations"})
    assert losses == pytest.approx(reference, rel=1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_fused_norm_equals_transformers_norm_within_a_rounding_step(dtype, monkeypatch):
    """On CUDA the patched norm runs torch's fused RMSNorm kernel. Here its CPU reference (the same op, torch's
    composite) against transformers' RMSNorm: outputs within two rounding steps of the dtype, one for each of
    transformers' roundings (float32: to 1e-6), and
    the input's and weight's gradients as close. A norm on a CUDA tensor takes that op; others keep the
    recomputing one (tested above)."""
    from transformers.models.qwen2.modeling_qwen2 import Qwen2RMSNorm

    from alignpipe import lean_activations as lean

    torch.manual_seed(0)
    norm = Qwen2RMSNorm(96, eps=1e-6).to(dtype)
    with torch.no_grad():
        norm.weight.add_(0.1 * torch.randn(96))
    x = (3 * torch.randn(64, 96)).to(dtype).requires_grad_()
    g = torch.randn(64, 96).to(dtype)
    want = norm(x)
    want_grads = torch.autograd.grad(want, (x, norm.weight), g)
    got = lean._fused_norm(x, norm.weight, norm.variance_epsilon)
    got_grads = torch.autograd.grad(got, (x, norm.weight), g)
    step = 2**-6 if dtype == torch.bfloat16 else 1e-6  # bf16 keeps 8 significant bits: a step is 2**-7 at most
    assert got.dtype == dtype and float(((got - want).abs() / want.abs().clamp(min=1)).max()) <= step
    for a, b in zip(got_grads, want_grads, strict=True):
        assert float((a.float() - b.float()).norm() / b.float().norm()) < (1e-2 if dtype == torch.bfloat16 else 1e-5)
    # which path a norm takes: the fused op only for a CUDA tensor of the weight's dtype, where torch has the kernel
    taken = []
    monkeypatch.setattr(lean, "_fused_norm", lambda *a: taken.append(1) or want)
    monkeypatch.setattr(lean, "fused_norm_kernel", lambda: True)
    patched = copy.deepcopy(norm)
    assert lean.lean_activations(torch.nn.ModuleList([patched])) == 1
    patched(x)
    assert not taken, "a CPU tensor keeps the recomputing norm"
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))  # as a CUDA tensor would say
    patched(x)
    assert taken == [1]


@pytest.mark.parametrize("lean", [True, False])
def test_ppo_patches_its_policy_and_value_model_as_its_reference(tiny, tmp_path, monkeypatch, lean):
    """PPO builds its pair without `TrainLoop`'s adaptation, yet its frozen reference is patched: both trained models
    are patched too (on a GPU a reference that rounds otherwise gives step 0 a KL that is not 0), and train as the
    unpatched pair (float32)."""
    from support import run_ppo

    from alignpipe.trainers import ppo

    patched = []
    real = ppo.lean_activations
    monkeypatch.setattr(
        ppo, "lean_activations", lambda model, fused: patched.append(type(model).__name__) or real(model, fused)
    )
    _, tracker, policy = run_ppo(tiny, tmp_path / "run", lean_activations=lean)
    assert patched == (["LlamaForCausalLM", "LlamaForSequenceClassification"] if lean else [])
    assert ("forward" in vars(policy.model.norm)) == lean
    if lean:
        torch.manual_seed(0)
        _, plain, _ = run_ppo(tiny, tmp_path / "plain", lean_activations=False)
        for key in ("loss/policy_avg", "loss/value_avg", "objective/kl"):
            assert tracker.series(key) == pytest.approx(plain.series(key), rel=1e-5, abs=1e-7), key


def test_checkpointing_every_other_layer_keeps_what_the_unchecked_layers_save(tiny):
    """`checkpoint_every_n_layers: 2` checkpoints layers 0 and 2 of 4: the bytes kept for backward fall between no
    checkpointing and checkpointing every layer, and the gradients are the plain model's."""
    from alignpipe.modeling import enable_activation_checkpointing

    ids = torch.randint(0, 500, (2, 48))
    kept, grads_of = {}, {}
    for every in (None, 1, 2):
        model = load_causal_lm(str(tiny / "model")).train()
        if every:
            enable_activation_checkpointing(model, every)
        kept[every], logits = saved_for_backward(model, ids)
        grads_of[every] = grads(model, logits, torch.ones_like(logits))
        flags = [layer.gradient_checkpointing for layer in model.model.layers]
        assert flags == ([False] * 4 if every is None else [True] * 4 if every == 1 else [True, False, True, False])
    assert kept[1] < kept[2] < kept[None]
    assert kept[2] - kept[1] == pytest.approx((kept[None] - kept[1]) / 2, rel=0.05)  # half the layers keep theirs
    for every in (1, 2):
        assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(grads_of[every], grads_of[None], strict=True))


def test_choosing_layers_to_checkpoint_needs_checkpointing():
    with pytest.raises(ValueError, match="set gradient_checkpointing: true"):
        SFTConfig(checkpoint_every_n_layers=2)
