"""`fused_kernels`: the SwiGLU product and the LM head's loss kernels compiled while the layers stay eager. The
trainers take them on CUDA only; here inductor builds them for the CPU, with the gate opened, and they must train
as the eager kernels do."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from support import SHORT_GROUPS, counted_calls, tiny_split

from alignpipe import fused_kernels, linear_ce, linear_sequence_loss, logprobs, triton_kernels
from alignpipe.fused_kernels import loss_kernels, silu_mul, wanted
from alignpipe.modeling import load_causal_lm
from alignpipe.tracking import Tracker
from alignpipe.trainers import dpo, sft
from alignpipe.trainers.configs import DPOConfig, SFTConfig


def silu_mul_and_grads(fn, gate, up, grad):
    gate, up = gate.detach().requires_grad_(), up.detach().requires_grad_()
    out = fn(gate, up)
    return (out, *torch.autograd.grad(out, (gate, up), grad))


def eager(gate, up):
    return torch.nn.functional.silu(gate) * up


def test_silu_mul_equals_autograd_in_float32():
    g = torch.Generator().manual_seed(0)
    gate, up, grad = (torch.randn(37, 96, generator=g) * 3 for _ in range(3))
    for got, want in zip(
        silu_mul_and_grads(silu_mul, gate, up, grad), silu_mul_and_grads(eager, gate, up, grad), strict=True
    ):
        assert torch.allclose(got, want, rtol=1e-5, atol=1e-6)


def test_silu_mul_rounds_once_in_bfloat16():
    """bf16: the product and both gradients within one rounding step of their exact values on the same inputs
    (eager rounds silu(gate) before the product, so it may be two steps away)."""
    g = torch.Generator().manual_seed(1)
    gate, up, grad = (torch.randn(64, 128, generator=g).bfloat16() * 3 for _ in range(3))
    exact = silu_mul_and_grads(eager, gate.double(), up.double(), grad.double())
    fused = silu_mul_and_grads(silu_mul, gate, up, grad)
    for got, want in zip(fused, exact, strict=True):
        assert got.dtype == torch.bfloat16
        # one bf16 rounding of the float32 result: within 2^-8 of it relatively, plus float32's own error
        assert torch.allclose(got.double(), want, rtol=2**-8 + 1e-6, atol=1e-30), (got.double() - want).abs().max()


def down_and_grads(fn, gate, up, weight, grad):
    gate, up, weight = (t.detach().requires_grad_() for t in (gate, up, weight))
    out = fn(gate, up, weight)
    return (out, *torch.autograd.grad(out, (gate, up, weight), grad))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_mul_down_equals_the_product_then_the_projection_and_keeps_no_product(dtype):
    """`silu_mul_down` (the MLP's product and down projection, the product written again in backward): the values
    and the gradients of gate, up and the weight equal `linear(silu_mul(gate, up), weight)` bit for bit, and what
    it keeps for backward is gate, up and the weight alone."""
    from alignpipe.fused_kernels import silu_mul_down

    g = torch.Generator().manual_seed(3)
    gate, up = (torch.randn(2, 19, 96, generator=g).to(dtype) * 3 for _ in range(2))
    weight = (torch.randn(40, 96, generator=g) / 10).to(dtype)
    grad = torch.randn(2, 19, 40, generator=g).to(dtype)

    def unfused(gate, up, weight):
        return torch.nn.functional.linear(silu_mul(gate, up), weight)

    for got, want in zip(
        down_and_grads(silu_mul_down, gate, up, weight, grad), down_and_grads(unfused, gate, up, weight, grad)
    ):
        assert torch.equal(got, want)
    kept: list[torch.Tensor] = []
    inputs = [t.detach().requires_grad_() for t in (gate, up, weight)]
    with torch.autograd.graph.saved_tensors_hooks(lambda t: kept.append(t) or t, lambda t: t):
        silu_mul_down(*inputs)
    assert {t.data_ptr() for t in kept} == {t.data_ptr() for t in inputs}
    # a frozen weight: gate's and up's gradients alone (no product written), the same
    frozen = {}
    for name, fn in (("fused", silu_mul_down), ("unfused", unfused)):
        a, b = gate.detach().requires_grad_(), up.detach().requires_grad_()
        frozen[name] = torch.autograd.grad(fn(a, b, weight), (a, b), grad)
    assert all(torch.equal(x, y) for x, y in zip(frozen["fused"], frozen["unfused"]))


def test_only_a_plain_trained_projection_recomputes_the_product(tiny):
    """The product is dropped only where the down projection is a plain bias-free `nn.Linear` that trains, with
    gradients on and no hooks on it: a LoRA layer, a frozen weight, `no_grad` and a hooked module keep the plain
    path."""
    from peft import LoraConfig, get_peft_model

    from alignpipe.fused_kernels import recomputes_product

    down = load_causal_lm(str(tiny / "model")).model.layers[0].mlp.down_proj
    assert recomputes_product(down)
    with torch.no_grad():
        assert not recomputes_product(down)
    handle = down.register_forward_hook(lambda *a: None)
    assert not recomputes_product(down)
    handle.remove()
    down.weight.requires_grad_(False)
    assert not recomputes_product(down)
    lora = get_peft_model(load_causal_lm(str(tiny / "model")), LoraConfig(r=4, target_modules=["down_proj"]))
    peft_model: Any = lora.base_model.model
    assert not recomputes_product(peft_model.model.layers[0].mlp.down_proj)


def rotary_and_grads(fn, q, k, cos, sin, grads):
    q, k = q.detach().requires_grad_(), k.detach().requires_grad_()
    out = fn(q, k, cos, sin)
    return (*out, *torch.autograd.grad(out, (q, k), grads))


def rotary_inputs(dtype, seed=2):
    """Queries and keys as a Qwen2 attention module has them (a transposed view), cos and sin as its rotary
    embedding gives them."""
    g = torch.Generator().manual_seed(seed)
    B, T, H, KV, D = 2, 19, 4, 2, 16
    q = torch.randn(B, T, H, D, generator=g).to(dtype).transpose(1, 2)
    k = torch.randn(B, T, KV, D, generator=g).to(dtype).transpose(1, 2)
    angles = torch.arange(T)[:, None] * (1e4 ** (-torch.arange(0, D, 2) / D))[None, :]
    angles = torch.cat((angles, angles), -1).expand(B, T, D)
    grads = (torch.randn(B, H, T, D, generator=g).to(dtype), torch.randn(B, KV, T, D, generator=g).to(dtype))
    return q, k, angles.cos().to(dtype), angles.sin().to(dtype), grads


def test_rotary_equals_transformers_in_float32_and_rounds_once_in_bfloat16():
    from transformers.models.qwen2.modeling_qwen2 import apply_rotary_pos_emb

    original = getattr(apply_rotary_pos_emb, "alignpipe_original", apply_rotary_pos_emb)
    inputs = rotary_inputs(torch.float32)
    for got, want in zip(
        rotary_and_grads(fused_kernels.rotary, *inputs), rotary_and_grads(original, *inputs), strict=True
    ):
        assert torch.allclose(got, want, rtol=1e-5, atol=1e-6)
    q, k, cos, sin, grads = rotary_inputs(torch.bfloat16)
    exact = rotary_and_grads(original, q.double(), k.double(), cos.double(), sin.double(), [g.double() for g in grads])
    for got, want in zip(rotary_and_grads(fused_kernels.rotary, q, k, cos, sin, grads), exact, strict=True):
        assert got.dtype == torch.bfloat16
        assert torch.allclose(got.double(), want, rtol=2**-8 + 1e-6, atol=1e-30), (got.double() - want).abs().max()


def test_each_kernel_compiles_once_for_packed_rows_decode_steps_and_padded_rows():
    """Dynamo specialises a dimension of size 1, so a packed row (1, T, ·), a decode step's (rows, 1, ·) and padded
    rows (B, T, ·) were three graphs of each kernel, compiled in whichever step first met the shape (in a padded
    run, at the first one-row batch). As token rows they are one graph a kernel and direction; the values and
    gradients are still transformers' (rotary, with its gradients laid out as the attention kernels hand them
    back) and eager's (SwiGLU)."""
    from transformers.models.qwen2.modeling_qwen2 import apply_rotary_pos_emb

    original = getattr(apply_rotary_pos_emb, "alignpipe_original", apply_rotary_pos_emb)
    g = torch.Generator().manual_seed(3)
    H, KV, D, WIDE, OUT = 4, 2, 16, 24, 8
    weight = torch.randn(OUT, WIDE, generator=g)

    def step(b, t):
        tokens_first = lambda *shape: torch.randn(b, t, *shape, generator=g).transpose(1, 2)  # noqa: E731
        q, k, grads = tokens_first(H, D), tokens_first(KV, D), (tokens_first(H, D), tokens_first(KV, D))
        angles = torch.randn(b, t, D, generator=g)
        got = rotary_and_grads(fused_kernels.rotary, q, k, angles.cos(), angles.sin(), grads)
        want = rotary_and_grads(original, q, k, angles.cos(), angles.sin(), grads)
        gate, up = (torch.randn(b, t, WIDE, generator=g).requires_grad_() for _ in range(2))
        w = weight.clone().requires_grad_()
        out = fused_kernels.silu_mul_down(gate, up, w)
        got += (out, *torch.autograd.grad(out, (gate, up, w), torch.ones_like(out)))
        out = torch.nn.functional.linear(eager(gate, up), w)
        want += (out, *torch.autograd.grad(out, (gate, up, w), torch.ones_like(out)))
        got += silu_mul_and_grads(silu_mul, gate, up, torch.ones(b, t, WIDE))
        want += silu_mul_and_grads(eager, gate, up, torch.ones(b, t, WIDE))
        for a, e in zip(got, want, strict=True):
            assert a.shape == e.shape and torch.allclose(a, e, rtol=1e-5, atol=1e-5)

    torch._dynamo.reset()
    stats = torch._dynamo.utils.counters["stats"]
    step(3, 7)  # padded rows
    compiled = stats["unique_graphs"]
    assert compiled > 0
    step(1, 11)  # a packed row
    step(5, 1)  # a decode step
    step(2, 9)
    assert stats["unique_graphs"] == compiled, "a shape compiled a kernel again"


def test_only_patched_models_take_the_fused_rotary(tiny, gate_open):
    """The modeling module's rotary function is switched for the whole process, but only a patched model's
    attention modules route it to the fused kernel: a model left as transformers built it runs its own."""
    from alignpipe.lean_activations import lean_activations

    plain = load_causal_lm(str(tiny / "model"))
    patched = load_causal_lm(str(tiny / "model"))
    lean_activations(patched, fused=True)
    ids = torch.randint(0, plain.config.vocab_size, (2, 12))
    with torch.no_grad():
        want = plain(input_ids=ids).logits
        assert gate_open["rotary"] == 0
        got = patched(input_ids=ids).logits
    assert gate_open["rotary"] == plain.config.num_hidden_layers
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-5)
    with torch.no_grad():
        plain(input_ids=ids)
    assert gate_open["rotary"] == plain.config.num_hidden_layers


def test_the_kernels_are_taken_on_cuda_only():
    assert not wanted(True, "cpu") and not wanted(False, "cpu")
    assert not loss_kernels(SFTConfig(), "cpu"), "on CPU the eager kernels run"
    assert loss_kernels(SFTConfig(compile=True), "cpu"), "compile: true compiles the loss kernels everywhere"
    assert SFTConfig().fused_kernels and DPOConfig().fused_kernels
    assert fused_kernels.available(torch.device("cpu")), "inductor builds for this CPU: the tests below run"


@pytest.fixture
def gate_open(monkeypatch):
    """The trainers' gate opened on CPU, with a count of the fused kernels' calls."""
    calls = {"silu_mul": 0, "silu_mul_down": 0, "loss": 0, "scoring": 0, "rotary": 0}
    monkeypatch.setattr(fused_kernels, "wanted", lambda enabled, device: enabled)
    for name in ("silu_mul", "silu_mul_down"):
        kernel = getattr(fused_kernels, name)

        def counted_silu(*a, kernel=kernel, name=name):
            calls[name] += 1
            return kernel(*a)

        monkeypatch.setattr(fused_kernels, name, counted_silu)
    rotary = fused_kernels.rotary

    def counted_rotary(*a):
        calls["rotary"] += 1
        return rotary(*a)

    monkeypatch.setattr(fused_kernels, "rotary", counted_rotary)
    for module, key in ((linear_ce, "loss"), (linear_sequence_loss, "loss"), (logprobs, "scoring")):
        compiled = module.compiled_function

        def counted(fn, compiled=compiled, key=key):
            calls[key] += 1
            return compiled(fn)

        monkeypatch.setattr(module, "compiled_function", counted)
    return calls


def sft_series(tiny, out, fused: bool):
    tok, train, _ = tiny_split(tiny, "sentiment_sft", "prompt_completion", rows=120, max_length=64)
    torch.manual_seed(0)
    model = load_causal_lm(str(tiny / "model"))
    tracker = Tracker()
    cfg = SFTConfig(learning_rate=1e-3, max_steps=3, batch_size=4, logging_every=1, fused_kernels=fused)
    sft.train(cfg, model, tok, train, [], tracker, out / f"sft-{fused}")
    return tracker.series("train/loss"), tracker.series("train/grad_norm")


@pytest.fixture(params=["compiled", "triton"])
def kernels(request, gate_open, monkeypatch):
    """The gate opened on CPU with the SwiGLU and rotary work on inductor's compiled kernels or on the hand-written
    Triton ones (under Triton's interpreter), with a count of the hand-written ones' launches."""
    monkeypatch.setattr(fused_kernels, "ELEMENTWISE", request.param)
    names = ("silu_mul", "silu_mul_grads", "rotary", "token_scores", "token_grads")
    if request.param != "triton":
        return request.param, dict.fromkeys(names, 0)
    request.getfixturevalue("interpreted")
    # their probes launch each kernel before the count starts
    assert triton_kernels.usable(torch.device("cpu")) and triton_kernels.head_usable(torch.device("cpu"))
    return request.param, counted_calls(monkeypatch, triton_kernels, *names)


def test_an_sft_run_with_the_fused_kernels_trains_as_the_eager_one(tiny, tmp_path, gate_open):
    """The MLPs' products and the head's softmax and gradient through the compiled kernels: the same losses and
    gradient norms as the eager kernels (float32), and the eager run takes none of them."""
    eager_loss, eager_norm = sft_series(tiny, tmp_path, False)
    assert gate_open == {"silu_mul": 0, "silu_mul_down": 0, "loss": 0, "scoring": 0, "rotary": 0}
    loss, norm = sft_series(tiny, tmp_path, True)
    layers = load_causal_lm(str(tiny / "model")).config.num_hidden_layers
    # every training forward's MLPs take the product-recomputing kernel (full fine-tuning: a plain down projection)
    assert gate_open["silu_mul_down"] >= 3 * layers and gate_open["rotary"] >= 3 * layers and gate_open["loss"] >= 3
    assert loss == pytest.approx(eager_loss, rel=1e-5) and norm == pytest.approx(eager_norm, rel=1e-4)


def test_a_dpo_batch_with_the_fused_kernels_equals_the_eager_one(tiny, monkeypatch, gate_open, kernels):
    """DPO's fused head with its group kernels compiled, the MLPs' products and the rotary embeddings fused (the GPU
    default; inductor's kernels or the hand-written Triton ones): loss and every gradient equal eager. Two pairs:
    Triton's interpreter runs a kernel's programs one by one."""
    from alignpipe.lean_activations import lean_activations

    tok, rows, _ = tiny_split(tiny, "sentiment_preferences", "preference", rows=16, max_length=64)
    batch = dpo.collate(dpo.tokenize(rows[:2], tok, 64), tok.pad_token_id, 64)
    models = {fused: load_causal_lm(str(tiny / "model")) for fused in (False, True)}
    for fused, model in models.items():
        lean_activations(model, fused=fused)
    monkeypatch.setattr(logprobs, "WHOLE_LOGITS_MAX", 0)  # a GPU batch's logits: the fused head is taken

    def run(fused):
        model = models[fused]
        zeros = torch.zeros(2)
        loss, _ = dpo.batch_loss(model, batch, lambda _b: (zeros, zeros), DPOConfig(fused_kernels=fused))
        loss.backward()
        return float(loss.detach()), {n: p.grad.clone() for n, p in model.named_parameters()}

    eager = run(False)
    assert gate_open == {"silu_mul": 0, "silu_mul_down": 0, "loss": 0, "scoring": 0, "rotary": 0}
    fused = run(True)
    layers = models[True].config.num_hidden_layers
    which, launches = kernels
    assert gate_open["silu_mul_down"] == layers == gate_open["rotary"]
    # the head's group kernels: compiled, or hand-written (below) with no compiled one
    assert gate_open["loss"] >= 2 if which == "compiled" else gate_open["loss"] == 0
    assert fused[0] == pytest.approx(eager[0], rel=1e-6)
    for name, grad in eager[1].items():
        assert torch.allclose(fused[1][name], grad, rtol=1e-4, atol=1e-6), name
    if which == "triton":  # forward (the product, rotary) and backward (the gradients, rotary's) of each layer
        assert launches["silu_mul"] == layers == launches["silu_mul_grads"]
        assert launches["rotary"] == 2 * layers
        # the fused head's groups: scores and gradients, hand-written too
        assert launches["token_scores"] == launches["token_grads"] >= 1
    else:
        assert set(launches.values()) == {0}


def test_a_frozen_reference_rounds_as_the_policy_does(tiny, gate_open):
    """bf16 with the fused kernels (the gate opened on CPU): the frozen reference is patched as the policy is, so
    the answers' log-probs of identical weights are equal bit for bit (DPO's step-0 rewards exactly 0); a
    reference left as transformers builds it rounds the SwiGLU product and the rotary embedding differently."""
    import copy

    from alignpipe.lean_activations import lean_activations
    from alignpipe.trainers.common import frozen_reference

    tok, rows, _ = tiny_split(tiny, "sentiment_preferences", "preference", rows=16, max_length=64)
    batch = dpo.collate(dpo.tokenize(rows[:4], tok, 64), tok.pad_token_id, 64)
    plain = load_causal_lm(str(tiny / "model"), dtype="bfloat16")
    policy = copy.deepcopy(plain)
    lean_activations(policy, fused=True)
    reference = frozen_reference(copy.deepcopy(plain), DPOConfig(), torch.device("cpu"))
    with torch.no_grad():
        want = dpo.completion_logps(policy, batch)[0]
        assert torch.equal(dpo.completion_logps(reference, batch)[0], want)
        assert not torch.equal(dpo.completion_logps(plain, batch)[0], want)
    assert not any(p.requires_grad for p in reference.parameters())


def test_scoring_passes_with_the_fused_kernels_train_as_the_eager_ones(tiny, tmp_path, gate_open):
    """The reference's and the old policy's log-probs (no grad) with the LM head's chunks compiled: DPO against a
    frozen reference, GRPO with a reference and two iterations, and PPO log the eager runs' losses and metrics."""
    import copy

    from support import run_ppo

    from alignpipe.judges.reward_set import LoadedReward, RewardSet
    from alignpipe.modeling import load_tokenizer
    from alignpipe.trainers import grpo
    from alignpipe.trainers.configs import GRPOConfig

    tok = load_tokenizer(str(tiny / "model"))
    _, prefs, _ = tiny_split(tiny, "sentiment_preferences", "preference", rows=24)
    _, prompts, _ = tiny_split(tiny, "reverse", "prompt_completion", rows=16)
    rewards = RewardSet([LoadedReward("len", lambda p, c, **_: [len(x) / 10 for x in c])])
    series, scoring = {}, {}
    for fused in (False, True):
        before = gate_open["scoring"]
        dpo_tracker, grpo_tracker = Tracker(), Tracker()
        policy = load_causal_lm(str(tiny / "model"))
        dpo_cfg = DPOConfig(learning_rate=5e-4, max_steps=2, batch_size=8, logging_every=1, fused_kernels=fused)
        dpo.train(
            dpo_cfg, policy, tok, prefs, [], dpo_tracker, tmp_path / f"dpo-{fused}", ref_model=copy.deepcopy(policy)
        )
        policy = load_causal_lm(str(tiny / "model"))
        grpo_cfg = GRPOConfig(**SHORT_GROUPS, fused_kernels=fused)
        rows = [{"prompt": r["prompt"]} for r in prompts]
        grpo.train(
            grpo_cfg,
            policy,
            tok,
            rows,
            rewards,
            grpo_tracker,
            tmp_path / f"grpo-{fused}",
            ref_model=copy.deepcopy(policy),
        )
        _, ppo_tracker, _ = run_ppo(tiny, tmp_path / f"ppo-{fused}", max_steps=2, fused_kernels=fused)
        series[fused] = {
            "dpo": dpo_tracker.series("train/loss") + dpo_tracker.series("train/rewards/margins"),
            "grpo": grpo_tracker.series("train/loss") + grpo_tracker.series("train/kl"),
            "ppo": ppo_tracker.series("loss/policy_avg") + ppo_tracker.series("objective/kl"),
        }
        scoring[fused] = gate_open["scoring"] - before
    assert scoring[False] == 0 and scoring[True] > 0
    for key, eager in series[False].items():
        assert len(eager) >= 4 and series[True][key] == pytest.approx(eager, rel=1e-4, abs=1e-6), key


def _decoded(engine, prompts, n=1):
    from alignpipe.engine.sampling import SamplingParams

    sampling = SamplingParams(temperature=1.0 if n > 1 else 0, max_new_tokens=10)
    return [g.completion_ids for g in engine.generate(prompts, n, sampling, seed=2)]


def test_a_recorded_decode_step_takes_the_fused_kernels_an_eager_one_does_not(tiny, gate_open):
    """A one-position decode step of a patched policy takes the fused rotary and SwiGLU kernels only while it is
    recorded as a CUDA graph (here the CPU stand-in, whose replays run what was recorded): their host-side cost is
    paid once per recording. The tokens equal the eager loop's, greedy and sampled; the eager loop's decode steps
    take none (its prefill does: several positions)."""
    from support import replayed_on_cpu

    from alignpipe.engine.decode_steps import GraphedDecodeStep
    from alignpipe.engine.hf import HFEngine
    from alignpipe.lean_activations import lean_activations, takes_fused_kernels
    from alignpipe.modeling import load_tokenizer

    model, tok = load_causal_lm(str(tiny / "model")).eval(), load_tokenizer(str(tiny / "model"))
    assert not takes_fused_kernels(model)
    lean_activations(model, fused=True)
    assert takes_fused_kernels(model)
    layers = model.config.num_hidden_layers
    prompts = ["The film", "I watched it and", "A"]
    for n in (1, 3):
        want = _decoded(HFEngine(model, tok, 8, static_cache=True), prompts, n)
        assert gate_open["rotary"] == gate_open["silu_mul"] == layers, "the eager loop: its prefill only"
        graphed = HFEngine(model, tok, 8)
        graphed.step = step = GraphedDecodeStep(capture=replayed_on_cpu)
        assert _decoded(graphed, prompts, n) == want
        # every layer: the prefill, the step that compiles them and the warm-up, then the 10 replays
        assert gate_open["rotary"] == gate_open["silu_mul"] == layers * (3 + 10), gate_open
        assert step.fused and step.failed is None
        gate_open.update(rotary=0, silu_mul=0)


def test_a_recording_runs_each_layer_s_sibling_projections_as_one_matmul(tiny, gate_open, monkeypatch):
    """`merged_projections`: while merged, each layer's q, k and v projections run as one matmul, and gate and up as
    another (7 → 4 a layer); the logits equal the separate matmuls' (float32, 1e-5). A LoRA policy keeps its adapted
    group apart and merges the other; a budget too small merges nothing; merging twice wraps nothing twice. A
    recording of a patched policy (here the CPU stand-in, whose replays run in the recorded context) merges them
    for its warm-up, capture and every replay, and its tokens equal the eager loop's."""
    from peft import LoraConfig, get_peft_model
    from support import matmuls, replayed_on_cpu

    from alignpipe.engine import decode_steps
    from alignpipe.engine.hf import HFEngine
    from alignpipe.engine.merged_projections import MergedProjections
    from alignpipe.lean_activations import lean_activations
    from alignpipe.modeling import load_tokenizer

    model, tok = load_causal_lm(str(tiny / "model")).eval(), load_tokenizer(str(tiny / "model"))
    lean_activations(model, fused=True)
    layers = model.config.num_hidden_layers
    ids = torch.randint(3, 100, (3, 5), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        plain = model(input_ids=ids).logits
        separate = matmuls(lambda: model(input_ids=ids))
        merged = MergedProjections(model)
        assert len(merged) == 2 * layers and len(MergedProjections(model, budget=0)) == 0
        with merged.active():
            assert torch.allclose(model(input_ids=ids).logits, plain, rtol=1e-5, atol=1e-5)
            assert separate - matmuls(lambda: model(input_ids=ids)) == 3 * layers
        assert separate == matmuls(lambda: model(input_ids=ids)), "only while active"
        MergedProjections(model)  # the members' forwards are wrapped once
        assert model.model.layers[0].self_attn.q_proj.forward.__func__.__name__ == "_member_forward"
        lora = get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj", "v_proj"])).eval()
        apart = MergedProjections(lora)
        assert len(apart) == layers, "gate and up merged; the adapted q, k and v group kept apart"
        lora_logits, lora_separate = lora(input_ids=ids).logits, matmuls(lambda: lora(input_ids=ids))
        with apart.active():
            assert torch.allclose(lora(input_ids=ids).logits, lora_logits, rtol=1e-5, atol=1e-5)
            assert lora_separate - matmuls(lambda: lora(input_ids=ids)) == layers
        model = lora.unload()

    made = []

    class Counted(MergedProjections):
        def __init__(self, *args):
            super().__init__(*args)
            made.append(len(self))

    monkeypatch.setattr(decode_steps, "MergedProjections", Counted)
    prompts = ["The film", "I watched it and", "A"]
    want = _decoded(HFEngine(model, tok, 8, static_cache=True), prompts)
    replayed = []

    def capture(step):  # the stand-in, counting each replay's matmuls
        replay, out = replayed_on_cpu(step)
        return (lambda: replayed.append(matmuls(replay))), out

    graphed = HFEngine(model, tok, 8)
    graphed.step = decode_steps.GraphedDecodeStep(capture=capture)
    assert _decoded(graphed, prompts) == want
    assert made == [2 * layers] and set(replayed) == {4 * layers + 1}, (made, set(replayed))


def test_add_norm_adds_as_eager_and_normalises_in_float32_rounding_once():
    """`fused_residuals.add_norm` in bfloat16: the sum is the eager add's bit for bit; the normalised copy is the
    float32 RMSNorm of that sum, scaled, rounded once (torch's fused RMSNorm kernel's numerics)."""
    from alignpipe.engine.fused_residuals import add_norm

    g = torch.Generator().manual_seed(0)
    residual, delta = (torch.randn(4, 1, 96, generator=g).to(torch.bfloat16) for _ in range(2))
    norm: Any = torch.nn.Module()  # a stand-in norm: its weight and epsilon
    norm.weight = torch.nn.Parameter(torch.rand(96, generator=g).to(torch.bfloat16) + 0.5)
    norm.variance_epsilon = 1e-6
    total, normed = add_norm(residual, delta, norm)
    assert torch.equal(total, residual + delta)
    x = (residual + delta).float()
    want = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * norm.weight.float()
    assert normed.dtype == torch.bfloat16
    assert torch.allclose(normed.float(), want, rtol=2**-8, atol=1e-6), (normed.float() - want).abs().max()


def test_a_recording_adds_each_residual_in_the_kernel_of_the_norm_after_it(tiny, gate_open, monkeypatch):
    """`fused_residuals`: while active, each layer's two residual adds run in one kernel with the norm after them
    (`add_norm`, 2·layers − 1 calls a forward: the last layer's final add stays apart), and each layer's input norm
    but the first takes the copy the add made (the norms' own forwards run twice: the first layer's input norm and
    the model's final norm). The logits equal the unfused model's (float32, 1e-5); only while active, and only for a
    model whose norms `lean_activations` patched. A recording of a patched policy (the CPU stand-in, whose replays run
    in the recorded context) fuses them for its warm-up, capture and every replay; its tokens equal the eager loop's,
    greedy and sampled."""
    from support import replayed_on_cpu

    from alignpipe.engine import decode_steps, fused_residuals
    from alignpipe.engine.fused_residuals import FusedResiduals
    from alignpipe.engine.hf import HFEngine
    from alignpipe.lean_activations import lean_activations
    from alignpipe.modeling import load_tokenizer

    model, tok = load_causal_lm(str(tiny / "model")).eval(), load_tokenizer(str(tiny / "model"))
    assert len(FusedResiduals(model)) == 0, "unpatched norms: nothing fused"
    lean_activations(model, fused=True)
    layers = model.config.num_hidden_layers
    calls = {"add_norm": 0, "norm": 0}
    add_norm = fused_residuals.add_norm

    def counted_add_norm(*args):
        calls["add_norm"] += 1
        return add_norm(*args)

    monkeypatch.setattr(fused_residuals, "add_norm", counted_add_norm)
    for norm in [m for m in model.modules() if type(m).__name__.endswith("RMSNorm")]:
        norm.register_forward_hook(lambda *_: calls.__setitem__("norm", calls["norm"] + 1))

    def counted(fn):
        calls.update(add_norm=0, norm=0)
        out = fn()
        return out, dict(calls)

    ids = torch.randint(3, 100, (3, 5), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        plain, unfused = counted(lambda: model(input_ids=ids).logits)
        assert unfused == {"add_norm": 0, "norm": 2 * layers + 1}
        fused = FusedResiduals(model)
        assert len(fused) == layers
        with fused.active():
            logits, seen = counted(lambda: model(input_ids=ids).logits)
        assert seen == {"add_norm": 2 * layers - 1, "norm": 2}, seen
        assert torch.allclose(logits, plain, rtol=1e-5, atol=1e-5)
        assert counted(lambda: model(input_ids=ids).logits)[1] == unfused, "only while active"
        FusedResiduals(model)  # the layers' forwards are wrapped once
        assert model.model.layers[0].forward.__func__.__name__ == "_layer_forward"

    prompts = ["The film", "I watched it and", "A"]
    for n in (1, 3):
        want = _decoded(HFEngine(model, tok, 8, static_cache=True), prompts, n)
        replayed: list[Any] = []

        def capture(step, replayed=replayed):  # the stand-in, counting each replay's fused adds
            replay, out = replayed_on_cpu(step)
            return (lambda: replayed.append(counted(replay)[1]["add_norm"])), out

        graphed = HFEngine(model, tok, 8)
        graphed.step = step = decode_steps.GraphedDecodeStep(capture=capture)
        assert _decoded(graphed, prompts, n) == want
        assert step.fused and step.failed is None
        assert set(replayed) == {2 * layers - 1}, replayed


def test_a_recording_that_fails_with_the_fused_kernels_is_made_without_them(tiny, gate_open, caplog):
    """Where a capture with the fused kernels fails (a compiled call a graph cannot hold), the step is recorded
    without them, said once, and later rollouts do not try them again; the graph itself is kept."""
    import logging

    from support import replayed_on_cpu

    from alignpipe import fused_kernels
    from alignpipe.engine.decode_steps import GraphedDecodeStep
    from alignpipe.engine.hf import HFEngine
    from alignpipe.lean_activations import lean_activations
    from alignpipe.modeling import load_tokenizer

    model, tok = load_causal_lm(str(tiny / "model")).eval(), load_tokenizer(str(tiny / "model"))
    lean_activations(model, fused=True)
    tries = []

    def capture(step):
        tries.append(fused_kernels.GRAPH_RECORDING.get())
        if fused_kernels.GRAPH_RECORDING.get():
            step()  # the warm-up ran (and wrote the cache) before the capture failed
            raise RuntimeError("CUDA error: operation not permitted when stream is capturing")
        return replayed_on_cpu(step)

    prompts = ["The film", "I watched it and", "A"]
    want = _decoded(HFEngine(model, tok, 8, static_cache=True), prompts)
    engine = HFEngine(model, tok, 8)
    engine.step = step = GraphedDecodeStep(capture=capture)
    with caplog.at_level(logging.WARNING, logger="alignpipe.engine.decode_steps"):
        assert _decoded(engine, prompts) == want
        assert _decoded(engine, prompts) == want
    assert tries == [True, False, False], "tried with them once, then recorded without them"
    assert not step.fused and step.failed is None
    # torch's own records (its compile traces, where this test compiles the kernels first) are not the step's
    said = [r.getMessage() for r in caplog.records if r.name == "alignpipe.engine.decode_steps"]
    assert len(said) == 1 and "recordings leave them out from now on" in said[0], said


def test_the_availability_probe_compiles_the_graph_a_bf16_step_runs_first():
    """`available` tries the compiler on the SwiGLU forward as a bf16 training step calls it, so its graph is the
    one that step's first MLP runs, not one more compilation a process (on a GPU ~0.5 s warm, seconds cold)."""
    torch._dynamo.reset()
    fused_kernels.available.cache_clear()
    stats = torch._dynamo.utils.counters["stats"]
    before = stats["unique_graphs"]
    assert fused_kernels.available(torch.device("cpu"))
    assert stats["unique_graphs"] == before + 1
    g = torch.Generator().manual_seed(8)
    gate, up = (torch.randn(1, 37, 48, generator=g).bfloat16().requires_grad_() for _ in range(2))
    got = fused_kernels.silu_mul(gate, up)
    assert stats["unique_graphs"] == before + 1, "the step's forward compiled a graph of its own"
    assert torch.allclose(got.float(), eager(gate, up).float(), rtol=1e-2, atol=1e-2)


def test_where_the_hand_written_kernels_run_a_default_sft_run_compiles_nothing(
    tiny, tmp_path, monkeypatch, interpreted
):
    """With Triton's kernels usable, `available` opens the gate without trying the compiler, and an SFT run (its
    MLPs, rotary and head on the hand-written kernels) builds no graph: no first compilation in its fixed
    cost. Under `ELEMENTWISE = "compiled"` the probe still compiles the SwiGLU forward it tries."""
    device = torch.device("cpu")
    # the gate as on CUDA, through `available`
    monkeypatch.setattr(fused_kernels, "wanted", lambda enabled, dev: enabled and fused_kernels.available(device))
    torch._dynamo.reset()
    stats = torch._dynamo.utils.counters["stats"]
    before = stats["unique_graphs"]
    fused_kernels.available.cache_clear()
    assert fused_kernels.available(device) and stats["unique_graphs"] == before
    launches = counted_calls(monkeypatch, triton_kernels, "silu_mul_grads", "rotary", "token_scores", "token_grads")
    sft_series(tiny, tmp_path, True)
    assert all(launches.values()), launches
    assert stats["unique_graphs"] == before, "a default SFT step compiled a kernel"
    monkeypatch.setattr(fused_kernels, "ELEMENTWISE", "compiled")
    fused_kernels.available.cache_clear()
    assert fused_kernels.available(device) and stats["unique_graphs"] == before + 1
    fused_kernels.available.cache_clear()


def test_the_trained_chunked_heads_run_on_the_hand_written_kernels_as_eagerly(tiny, tmp_path, monkeypatch, interpreted):
    """Where Triton's kernels run, GRPO's, PPO's and online DPO's trained head (log-probs with gradients, and the
    entropy GRPO and PPO log, or that GRPO's entropy bonus trains through), and DPO's chunked head where its fused
    one cannot run (WPO's weights with their log Σp², LD-DPO) take `token_scores` and `token_grads`, and each run
    logs the eager run's losses and metrics; the eager runs launch neither. PPO with `kl_penalty: full` takes its
    rollouts' KL from `token_kl`. SFT's evaluation scores its chunks with `token_scores` alone, to the eager eval
    loss."""
    import copy

    from support import run_ppo

    from alignpipe.judges.reward_set import LoadedReward, RewardSet
    from alignpipe.modeling import load_tokenizer
    from alignpipe.trainers import grpo, online_dpo
    from alignpipe.trainers.configs import GRPOConfig, OnlineDPOConfig

    monkeypatch.setattr(fused_kernels, "wanted", lambda enabled, device: enabled)
    by_hand = fused_kernels.by_hand  # the head's kernels interpreted; the layers' compiled (faster here)
    monkeypatch.setattr(fused_kernels, "by_hand", lambda *t, head=False: head and by_hand(*t, head=True))
    tok = load_tokenizer(str(tiny / "model"))
    _, prompts, _ = tiny_split(tiny, "reverse", "prompt_completion", rows=16)
    rewards = RewardSet([LoadedReward("len", lambda p, c, **_: [len(x) / 10 for x in c])])
    assert triton_kernels.kl_usable(torch.device("cpu"))  # its probe's launch before the count starts
    launches = counted_calls(monkeypatch, triton_kernels, "token_scores", "token_grads", "token_kl")
    rows = [{"prompt": r["prompt"]} for r in prompts]

    def grpo_run(fused: bool, out, **bonus) -> list[float]:
        tracker, policy = Tracker(), load_causal_lm(str(tiny / "model"))
        cfg = GRPOConfig(**SHORT_GROUPS, fused_kernels=fused, **bonus)
        grpo.train(cfg, policy, tok, rows, rewards, tracker, out, ref_model=copy.deepcopy(policy))
        return tracker.series("train/loss") + tracker.series("train/entropy")

    def grpo_entropy_bonus_run(fused: bool, out) -> list[float]:  # the entropy's gradient through the kernels
        return grpo_run(fused, out, entropy_coef=0.5)

    def ppo_run(fused: bool, out) -> list[float]:
        _, tracker, _ = run_ppo(tiny, out, max_steps=2, fused_kernels=fused)
        return tracker.series("loss/policy_avg") + tracker.series("policy/entropy_avg")

    def ppo_full_kl_run(fused: bool, out) -> list[float]:  # the rollout's KL of the two heads: `token_kl`
        _, tracker, _ = run_ppo(tiny, out, max_steps=2, fused_kernels=fused, kl_penalty="full")
        return tracker.series("objective/kl") + tracker.series("loss/policy_avg")

    def online_dpo_run(fused: bool, out) -> list[float]:
        tracker, policy = Tracker(), load_causal_lm(str(tiny / "model"))
        cfg = OnlineDPOConfig(max_steps=2, batch_size=4, max_completion_length=6, logging_every=1, fused_kernels=fused)
        ranker = online_dpo.RewardRanker(rewards, 1.0)
        online_dpo.train(cfg, policy, tok, rows, ranker, tracker, out, ref_model=copy.deepcopy(policy))
        return tracker.series("train/loss") + tracker.series("train/rewards/margins")

    series: dict[tuple[str, bool], list[float]] = {}
    grads: dict[tuple[str, bool], int] = {}
    _, prefs, _ = tiny_split(tiny, "sentiment_preferences", "preference", rows=24)

    def dpo_run(fused: bool, out, **options) -> list[float]:  # the chunked head: WPO's weights, LD-DPO's tokens
        tracker, policy = Tracker(), load_causal_lm(str(tiny / "model"))
        cfg = DPOConfig(learning_rate=5e-4, max_steps=2, batch_size=8, logging_every=1, fused_kernels=fused, **options)
        dpo.train(cfg, policy, tok, prefs, [], tracker, out, ref_model=copy.deepcopy(policy))
        return tracker.series("train/loss") + tracker.series("train/rewards/margins")

    def wpo_run(fused: bool, out) -> list[float]:
        return dpo_run(fused, out, use_weighting=True)

    def ld_dpo_run(fused: bool, out) -> list[float]:
        return dpo_run(fused, out, ld_alpha=0.5)

    runs = (grpo_run, grpo_entropy_bonus_run, ppo_run, ppo_full_kl_run, online_dpo_run, wpo_run, ld_dpo_run)
    evaluate, scored = sft.evaluate, []

    def counted_evaluate(*a, **k):
        before = launches["token_scores"]
        try:
            return evaluate(*a, **k)
        finally:
            scored.append(launches["token_scores"] - before)

    monkeypatch.setattr(sft, "evaluate", counted_evaluate)
    _, sft_train, sft_eval = tiny_split(tiny, "sentiment_sft", "prompt_completion", rows=60, max_length=64)
    eval_losses = {}
    for fused in (False, True):  # SFT's evaluation (no gradients): each chunk's scores alone
        scored.clear()
        tracker, model = Tracker(), load_causal_lm(str(tiny / "model"))
        cfg = SFTConfig(learning_rate=1e-3, max_steps=2, batch_size=4, eval_every=1, fused_kernels=fused)
        sft.train(cfg, model, tok, sft_train, sft_eval, tracker, tmp_path / f"sft-{fused}")
        eval_losses[fused] = tracker.series("eval/loss"), sum(scored)
    assert len(eval_losses[False][0]) >= 2 and eval_losses[False][1] == 0 and eval_losses[True][1] > 0, eval_losses
    assert eval_losses[True][0] == pytest.approx(eval_losses[False][0], rel=1e-5)
    kl_launches = {}
    for fused in (False, True):
        for run in runs:
            before, kl_before = launches["token_grads"], launches["token_kl"]
            series[run.__name__, fused] = run(fused, tmp_path / f"{run.__name__}-{fused}")
            grads[run.__name__, fused] = launches["token_grads"] - before
            kl_launches[run.__name__, fused] = launches["token_kl"] - kl_before
    # 2 updates × 2 scoring slices of 8 episodes, each slice's responses one chunk
    assert {k: n for k, n in kl_launches.items() if n} == {("ppo_full_kl_run", True): 4}
    assert series["ppo_full_kl_run", False][1] > 0, "the second update's policy has moved from its reference"
    assert series["grpo_entropy_bonus_run", False] != series["grpo_run", False], "the bonus is in the loss"
    for name in (run.__name__ for run in runs):
        assert grads[name, False] == 0 and grads[name, True] > 0, (name, grads)
        eager = series[name, False]
        assert len(eager) >= 4 and series[name, True] == pytest.approx(eager, rel=1e-4, abs=1e-6), name


KERNELS = (fused_kernels._rotary_forward, fused_kernels._silu_mul_forward, logprobs._chunk_logprobs)


def graphs_of(fn) -> int:
    """How many graphs `torch.compile` holds for `fn` (its cache entries: one per guard set it was compiled for)."""
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    return len(_debug_get_cache_entry_list(fn.__code__))


@pytest.fixture
def kernels_on_gpu_batches(gate_open, monkeypatch):
    """The gate opened, the LM head run in chunks as at a GPU batch's size, and no graph compiled yet."""
    monkeypatch.setattr(logprobs, "WHOLE_LOGITS_MAX", 16 * 512)
    torch._dynamo.reset()
    return gate_open


def test_a_frozen_reference_runs_the_graphs_the_policy_s_step_compiled(tiny, tmp_path, kernels_on_gpu_batches):
    """DPO's reference log-probs run under no_grad where they take the fused kernels: under inference mode, whose
    tensors lack the autograd dispatch keys that dynamo guards, each forward kernel compiled a second graph beside
    the training step's (seconds a process on a GPU), and the head's chunk kernel one more."""
    import copy

    from alignpipe.modeling import load_tokenizer

    tok = load_tokenizer(str(tiny / "model"))
    _, prefs, _ = tiny_split(tiny, "sentiment_preferences", "preference", rows=24)
    policy = load_causal_lm(str(tiny / "model"))
    cfg = DPOConfig(learning_rate=5e-4, max_steps=2, batch_size=8, logging_every=1)
    dpo.train(cfg, policy, tok, prefs, [], Tracker(), tmp_path / "dpo", ref_model=copy.deepcopy(policy))
    assert kernels_on_gpu_batches["rotary"] and kernels_on_gpu_batches["scoring"], "the passes took the kernels"
    assert [graphs_of(fn) for fn in KERNELS] == [1, 1, 1]


def test_rollouts_and_scoring_passes_run_the_graphs_the_training_step_compiled(tiny, tmp_path, kernels_on_gpu_batches):
    """GRPO with recorded decode steps (the GPU default; here the CPU stand-in): the rollout's prefill runs under
    no_grad and shares the training step's forward graphs; the recorded steps read their merged projections' outputs
    (strided views), one graph more per kernel, where inference mode made it two. The old policy's and reference's
    scoring passes share one chunk kernel: the trained head and the frozen one differed in the requires_grad that
    dynamo guards. The training step's head (with gradients and its entropy) is the chunk kernel's second graph, as
    where Triton cannot run the hand-written head kernels on a GPU."""
    import copy

    from support import replayed_on_cpu

    from alignpipe.engine.decode_steps import GraphedDecodeStep
    from alignpipe.engine.hf import HFEngine
    from alignpipe.judges.reward_set import LoadedReward, RewardSet
    from alignpipe.modeling import load_tokenizer
    from alignpipe.trainers import grpo
    from alignpipe.trainers.configs import GRPOConfig

    tok = load_tokenizer(str(tiny / "model"))
    _, prompts, _ = tiny_split(tiny, "reverse", "prompt_completion", rows=16)
    rewards = RewardSet([LoadedReward("len", lambda p, c, **_: [len(x) / 10 for x in c])])
    policy = load_causal_lm(str(tiny / "model"))
    rows = [{"prompt": r["prompt"]} for r in prompts]
    engine = HFEngine(policy, tok)
    engine.step = step = GraphedDecodeStep(capture=replayed_on_cpu)
    reference = copy.deepcopy(policy)
    cfg = GRPOConfig(**SHORT_GROUPS)
    grpo.train(cfg, policy, tok, rows, rewards, Tracker(), tmp_path / "grpo", ref_model=reference, engine=engine)
    assert step.fused and step.failed is None, "the recordings took the fused kernels"
    assert [graphs_of(fn) for fn in KERNELS] == [2, 2, 2]


@pytest.mark.parametrize("updates", ["kahan", "stochastic"])
def test_a_bf16_stage_compiles_its_optimizer_step_once_whatever_the_learning_rate(
    tiny, tmp_path, kernels_on_gpu_batches, monkeypatch, updates
):
    """As a GPU stage runs (bf16 weights, the fused kernels, AdamW's compiled low-precision step, a warm-up and a
    decaying learning rate): the optimizer step is one graph for every learning rate, and a second run in the same
    process, at other rates, compiles nothing. On torch 2.11, the GPU image's, the Kahan step compiled anew for
    each learning rate until session 41: seconds at each of a stage's first 8 steps, then the eager step. Two
    slices a call here, so two graphs: calls of 2, and of 1 where a group (the decayed matrices, the undecayed
    vectors) has an odd count (8 a call would compile three lengths for the tiny model, ~40 s in inductor's C++)."""
    from alignpipe import low_precision_adamw

    monkeypatch.setattr(low_precision_adamw, "MAX_PIECES", 2)
    tok, train, _ = tiny_split(tiny, "sentiment_sft", "prompt_completion", rows=48, max_length=48)
    low_precision_adamw._compiled.cache_clear()
    graphs = torch._dynamo.utils.counters["stats"]
    counts = []
    for lr in (1e-4, 3e-5):
        model = load_causal_lm(str(tiny / "model"), dtype="bfloat16")
        cfg = SFTConfig(learning_rate=lr, max_steps=4, batch_size=8, logging_every=2, warmup_ratio=0.5,
                        low_precision_updates=updates)  # fmt: skip
        sft.train(cfg, model, tok, train, [], Tracker(), tmp_path / str(lr))
        counts.append(graphs["unique_graphs"])
    step = low_precision_adamw._stochastic_many if updates == "stochastic" else low_precision_adamw._kahan_many
    assert kernels_on_gpu_batches["silu_mul"] or kernels_on_gpu_batches["silu_mul_down"], "the kernels ran"
    assert graphs_of(step) == 2
    assert counts[1] == counts[0], "the second run compiled"
