"""`triton_kernels`: the hand-written SwiGLU and rotary kernels, run here by Triton's interpreter on the CPU (the
`interpreted` fixture), against the eager expressions that the compiled kernels are built from (`fused_kernels`'
`_silu_mul_*` and `_rotary_*`) and transformers' rotary embedding. Whole training steps through them:
tests/test_fused_kernels.py (`kernels="triton"`)."""

from __future__ import annotations

import logging
import os

import pytest
import torch
import torch.nn.functional as F
from support import counted_calls

from alignpipe import fused_kernels, triton_kernels

ULP = 2**-7  # a bfloat16 value's spacing, relative to it (8 significant bits): at most one rounding step apart


def close(got: torch.Tensor, want: torch.Tensor) -> None:
    """float32: equal but for the order of float32 operations; bfloat16: at most one rounding step apart, and
    nearly always equal (both compute in float32 and round once)."""
    assert got.shape == want.shape and got.dtype == want.dtype
    if got.dtype == torch.float32:
        assert torch.allclose(got, want, rtol=1e-5, atol=1e-6), (got - want).abs().max()
    else:
        assert torch.allclose(got.float(), want.float(), rtol=ULP, atol=1e-6), (got.float() - want.float()).abs().max()
        assert (got == want).float().mean() >= 0.98


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_swiglu_kernels_compute_the_eager_expressions(interpreted, dtype):
    """Forward, backward, and backward writing the product again, on rows wider than one block (two column blocks,
    the second partial) where gate and up are the two halves of one merged projection's output (strided rows)."""
    g = torch.Generator().manual_seed(0)
    rows, cols = 5, triton_kernels.SWIGLU_BLOCK + 76
    merged = torch.randn(rows, 2 * cols, generator=g).to(dtype) * 3
    gate, up = merged[:, :cols], merged[:, cols:]
    grad = torch.randn(rows, cols, generator=g).to(dtype)
    assert gate.stride(0) == 2 * cols

    got = triton_kernels.silu_mul(gate, up)
    close(got, fused_kernels._silu_mul_forward(gate, up))
    assert got.is_contiguous()
    for got, want in zip(
        triton_kernels.silu_mul_grads(grad, gate, up), fused_kernels._silu_mul_backward(grad, gate, up), strict=True
    ):
        close(got, want)
    for got, want in zip(
        triton_kernels.silu_mul_grads(grad, gate, up, product=True),
        fused_kernels._silu_mul_backward_and_product(grad, gate, up),
        strict=True,
    ):
        close(got, want)


def qkv_layouts(dtype, seed=1):
    """(name, q, k, cos, sin) as attention modules hand them over: projections' (B, T, heads, D) transposed; one
    merged projection's slices (a recorded decode step's); contiguous (B, heads, T, D); a decode step (T = 1); a
    packed row whose cos and sin have batch 1 for B > 1 rows."""
    g = torch.Generator().manual_seed(seed)
    H, KV, D = 4, 2, 16

    def angles(b, t):
        a = torch.randn(b, t, D // 2, generator=g) * 3
        a = torch.cat((a, a), -1)
        return a.cos().to(dtype), a.sin().to(dtype)

    def tokens_first(b, t, heads):
        return torch.randn(b, t, heads, D, generator=g).to(dtype).transpose(1, 2)

    layouts = [("projections", tokens_first(2, 7, H), tokens_first(2, 7, KV), *angles(2, 7))]
    merged = torch.randn(3, 5, (H + 2 * KV) * D, generator=g).to(dtype)
    q, k, _ = merged.split((H * D, KV * D, KV * D), -1)
    layouts.append(("merged", q.view(3, 5, H, D).transpose(1, 2), k.view(3, 5, KV, D).transpose(1, 2), *angles(3, 5)))
    layouts.append(
        (
            "contiguous",
            torch.randn(2, H, 6, D, generator=g).to(dtype),
            torch.randn(2, KV, 6, D).to(dtype),
            *angles(2, 6),
        )
    )
    layouts.append(("decode", tokens_first(4, 1, H), tokens_first(4, 1, KV), *angles(4, 1)))
    layouts.append(("broadcast", tokens_first(3, 6, H), tokens_first(3, 6, KV), *angles(1, 6)))
    return layouts


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_rotary_kernel_computes_the_eager_expression_in_every_layout(interpreted, dtype):
    for name, q, k, cos, sin in qkv_layouts(dtype):
        wide = cos.expand(q.size(0), -1, -1), sin.expand(q.size(0), -1, -1)
        for backward, eager in ((False, fused_kernels._rotary_forward), (True, fused_kernels._rotary_backward)):
            got = triton_kernels.rotary(q, k, cos, sin, backward=backward)
            for out, want in zip(got, eager(q, k, *wide), strict=True):
                close(out, want)
                # laid out as a projection's output: token-major (B, T, heads, D)
                assert out.transpose(1, 2).is_contiguous(), name


def test_the_rotary_kernel_and_its_gradient_are_transformers_rotary_embedding(interpreted):
    """Through `fused_kernels.rotary` (the autograd function the patched attention calls) with the gate routed to
    the hand-written kernel: transformers' values and gradients, float32."""
    from transformers.models.qwen2.modeling_qwen2 import apply_rotary_pos_emb

    original = getattr(apply_rotary_pos_emb, "alignpipe_original", apply_rotary_pos_emb)
    g = torch.Generator().manual_seed(4)
    for name, q, k, cos, sin in qkv_layouts(torch.float32):
        assert fused_kernels.by_hand(q, k, cos, sin), name
        grads = torch.randn(q.shape, generator=g), torch.randn(k.shape, generator=g)
        results = []
        for fn in (fused_kernels.rotary, original):
            leaves = q.detach().requires_grad_(), k.detach().requires_grad_()
            out = fn(*leaves, cos, sin)
            results.append((*out, *torch.autograd.grad(out, leaves, grads)))
        for got, want in zip(*results, strict=True):
            assert torch.allclose(got, want, rtol=1e-5, atol=1e-6), name


def test_the_compiled_kernels_run_where_asked_or_where_triton_fails(interpreted, monkeypatch, caplog):
    x = torch.randn(3, 8)
    assert fused_kernels.by_hand(x, x)
    monkeypatch.setattr(fused_kernels, "ELEMENTWISE", "compiled")
    assert not fused_kernels.by_hand(x, x), "`compiled` (the bench's --compiled-kernels) is honoured"
    monkeypatch.setattr(fused_kernels, "ELEMENTWISE", "triton")
    assert not fused_kernels.by_hand(x.double(), x.double()), "float64 is computed as float64: the compiled kernels"

    def broken(*_):
        raise RuntimeError("no compiler for this card")

    triton_kernels.usable.cache_clear()
    monkeypatch.setattr(triton_kernels, "silu_mul", broken)
    with caplog.at_level(logging.WARNING, logger="alignpipe.triton_kernels"):
        assert not fused_kernels.by_hand(x, x) and not fused_kernels.by_hand(x, x)
    said = [r.getMessage() for r in caplog.records if r.name == "alignpipe.triton_kernels"]
    assert len(said) == 1 and "no compiler for this card" in said[0] and "compiled kernels run" in said[0]


def test_kernels_that_compute_otherwise_than_the_eager_expressions_are_not_taken(interpreted, monkeypatch, caplog):
    """The probe tries each kernel each way, not the SwiGLU forward alone: a rotary backward that a card's compiler
    got wrong is found before a step runs, named, and the compiled kernels run instead."""
    assert triton_kernels.disagreement(torch.device("cpu")) is None
    rotary = triton_kernels.rotary

    def wrong_backward(q, k, cos, sin, backward=False):
        return rotary(q, k, cos, -sin if backward else sin, backward=backward)

    monkeypatch.setattr(triton_kernels, "rotary", wrong_backward)
    triton_kernels.usable.cache_clear()
    x = torch.randn(3, 8)
    with caplog.at_level(logging.WARNING, logger="alignpipe.triton_kernels"):
        assert not fused_kernels.by_hand(x, x)
    said = [r.getMessage() for r in caplog.records if r.name == "alignpipe.triton_kernels"]
    assert len(said) == 1 and "the rotary backward on cpu differs from the eager expression" in said[0], said


def test_off_cuda_the_kernels_are_not_taken_unless_interpreted(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    triton_kernels.usable.cache_clear()
    x = torch.randn(2, 4)
    assert not triton_kernels.takes(x) and not triton_kernels.usable(torch.device("cpu"))
    assert not fused_kernels.by_hand(x, x)
    triton_kernels.usable.cache_clear()


def test_the_kahan_adamw_step_is_one_launch_a_step_and_equals_the_eager_step(interpreted, monkeypatch):
    """bf16 weights under `kahan` with the gate open: every contiguous parameter's slices (here of at most 1,000
    values, several a parameter) in one launch a step, whatever the learning rate's schedule; a strided parameter
    goes to the compiled step (recorded here, run eagerly). Weights and moments equal the eager step's bit for bit,
    and so does the compensation but for a few values a rounding step apart (Triton's interpreter computing as a GPU
    does: the `interpreted` fixture)."""
    from alignpipe import low_precision_adamw
    from alignpipe.low_precision_adamw import LowPrecisionAdamW

    monkeypatch.setattr(low_precision_adamw, "CHUNK", 1000)
    monkeypatch.setattr(fused_kernels, "wanted", lambda enabled, device: enabled)
    gen = torch.Generator().manual_seed(0)
    shapes = [(50, 70), (16, 9), (70,), (33, 40)]
    weights = [torch.randn(shape, generator=gen) * 0.02 for shape in shapes]
    grads = [[torch.randn(shape, generator=gen) * 1e-3 for shape in shapes] for _ in range(4)]
    launches, compiled_calls = [], []
    assert triton_kernels.adamw_usable(torch.device("cpu"))  # its probe launches before the count starts
    launch = triton_kernels.kahan_adamw
    monkeypatch.setattr(
        triton_kernels, "kahan_adamw", lambda pieces, *a: (launches.append(len(pieces)), launch(pieces, *a))
    )

    def recorded(self, bucket, scalars, stochastic):
        compiled_calls.append(len(bucket))
        for piece, salt in bucket:
            low_precision_adamw._update(piece, scalars, salt)

    monkeypatch.setattr(LowPrecisionAdamW, "_update_compiled", recorded)

    def run(fused: bool):
        params = [torch.nn.Parameter(w.bfloat16()) for w in weights]
        params[3] = torch.nn.Parameter(weights[3].bfloat16().t().contiguous().t())  # strided: a weight's transpose
        opt = LowPrecisionAdamW(params, lr=1e-3, weight_decay=0.01, fused_kernels=fused)
        scheduler = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1 / (1 + step))
        for step_grads in grads:
            for p, g in zip(params, step_grads, strict=True):
                p.grad = g.bfloat16()
            opt.step()
            scheduler.step()
        return params, opt

    by_hand, opt = run(True)
    assert not by_hand[3].is_contiguous()
    # 4 + 1 + 1 slices of the contiguous parameters in each step's launch, the strided one alone
    assert launches == [6] * 4 and compiled_calls == [1] * 4
    eager, ref = run(False)
    assert launches == [6] * 4 and compiled_calls == [1] * 4, "the eager step takes neither"
    for a, b in zip(by_hand, eager, strict=True):
        assert torch.equal(a, b)
        for name in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(opt.state[a][name], ref.state[b][name]), name
        # the compensation: equal but where torch's CPU kernel ran the last few values of a slice without its vector
        # code, whose lerp is not a fused multiply-add (the float32 moment then differs in its last bit)
        comp, want = opt.state[a]["kahan_comp"].float(), ref.state[b]["kahan_comp"].float()
        assert (comp != want).float().mean() <= 0.01 and (comp - want).abs().max() <= ULP * want.abs().max()
        assert want.abs().max() > 0


def test_a_group_whose_every_slice_went_by_hand_steps_from_its_kept_plan(interpreted, monkeypatch):
    """After a step in which all of a group's slices went into the one launch, the next steps launch from the kept
    addresses (`_HandPlan`) while the group holds the same parameters at the same storages with the same states; a
    weight given new storage, a parameter without a gradient, a loaded state or parameters at two step counts take
    the long way (and a plan is kept anew where it allows). Weights, moments, compensations and step counts equal
    a run that never keeps a plan, bit for bit; one launch a group and step count a step either way."""
    from alignpipe import low_precision_adamw
    from alignpipe.low_precision_adamw import LowPrecisionAdamW, _HandPlan

    monkeypatch.setattr(low_precision_adamw, "CHUNK", 1000)
    monkeypatch.setattr(fused_kernels, "wanted", lambda enabled, device: enabled)
    gen = torch.Generator().manual_seed(0)
    shapes = [(50, 70), (16, 9), (70,)]
    weights = [torch.randn(shape, generator=gen) * 0.02 for shape in shapes]
    grads = [[torch.randn(shape, generator=gen) * 1e-3 for shape in shapes] for _ in range(8)]
    assert triton_kernels.adamw_usable(torch.device("cpu"))  # its probe launches before the count starts
    launches = counted_calls(monkeypatch, triton_kernels, "kahan_adamw_at")
    planned: list[tuple[int, int, bool]] = []  # (step, group, whether the plan held)
    plan_step = _HandPlan.step

    def recorded(self, params, *args):
        held = plan_step(self, params, *args)
        planned.append((len(steps), int(self.params[0] is params_now[2]), held))
        return held

    monkeypatch.setattr(_HandPlan, "step", recorded)
    built: list[int] = []  # the steps in which a group's block table was made (on a GPU: copied to it)
    tables_of = triton_kernels.AdamWBlocks.of

    def of(self, sizes, device):
        built.extend(len(steps) for _ in range(sizes != self.sizes))
        return tables_of(self, sizes, device)

    monkeypatch.setattr(triton_kernels.AdamWBlocks, "of", of)
    steps: list[int] = []
    params_now: list[torch.Tensor] = []

    def run(keep_plans: bool):
        params = [torch.nn.Parameter(w.bfloat16()) for w in weights]
        params_now[:] = params
        groups = [{"params": params[:2]}, {"params": params[2:], "weight_decay": 0.0}]
        opt = LowPrecisionAdamW(groups, lr=1e-3, weight_decay=0.01, fused_kernels=True)
        scheduler = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1 / (1 + step))
        steps.clear()
        for step, step_grads in enumerate(grads, start=1):
            steps.append(step)
            if step == 3:
                params[0].data = params[0].data.clone()  # new storage, same values
            if step == 5:
                opt.load_state_dict(opt.state_dict())
            for p, g in zip(params, step_grads, strict=True):
                p.grad = None if step in (5, 6) and p is params[1] else g.bfloat16()
            if not keep_plans:
                opt._plans.clear()
            opt.step()
            scheduler.step()
        return params, opt

    kept, opt = run(True)
    assert planned == [
        (2, 0, True), (2, 1, True),
        (3, 0, False), (3, 1, True),  # a new storage for a weight of group 0
        (4, 0, True), (4, 1, True),
        # step 5: the state loaded, no plan; group 0 without params[1] keeps one of params[0] alone
        (6, 0, True), (6, 1, True),
        (7, 0, False), (7, 1, True),  # params[1] back, a step behind: two step counts, no plan kept
        (8, 1, True),
    ]  # fmt: skip
    assert launches["kahan_adamw_at"] == 18  # one a group a step; group 0's two step counts at steps 7 and 8, two
    # a table a group, made again where its slices change: group 0 without params[1] (5), then its two launches
    assert built == [1, 1, 5, 7, 8, 8]
    planned.clear()
    plain, ref = run(False)
    assert planned == [] and launches["kahan_adamw_at"] == 36
    for a, b in zip(kept, plain, strict=True):
        assert torch.equal(a, b)
        for name in ("step", "exp_avg", "exp_avg_sq", "kahan_comp"):
            assert torch.equal(opt.state[a][name], ref.state[b][name]), name
    assert [int(opt.state[p]["step"]) for p in kept] == [8, 6, 8]


def test_a_card_whose_adamw_kernel_disagrees_runs_the_compiled_step(interpreted, monkeypatch, caplog):
    assert triton_kernels.adamw_disagreement(torch.device("cpu")) is None
    launch = triton_kernels.kahan_adamw

    def off_by_a_step(pieces, scalars, blocks):
        launch(pieces, (*scalars[:2], scalars[2] * 2, *scalars[3:]), blocks)

    monkeypatch.setattr(triton_kernels, "kahan_adamw", off_by_a_step)
    triton_kernels.adamw_usable.cache_clear()
    with caplog.at_level(logging.WARNING, logger="alignpipe.triton_kernels"):
        assert not triton_kernels.adamw_usable(torch.device("cpu"))
    said = [r.getMessage() for r in caplog.records if r.name == "alignpipe.triton_kernels"]
    assert said == [
        "triton_kernels: the Kahan AdamW step on cpu differs from the eager expression; the compiled AdamW step runs"
    ]
    triton_kernels.adamw_usable.cache_clear()


def test_a_run_counts_the_kernel_variants_triton_compiled_beside_torch_compile_s_graphs(monkeypatch):
    """`bench.run_one` names the steady steps in which something compiled: Triton's variants of our kernels count
    too (read from each kernel's per-device cache, as Triton 3.x keeps it), so a launch that compiles in the middle
    of training reads as a compile, not as a slow step."""
    import sys
    from types import SimpleNamespace

    from bench import run_one

    def kernel(*variants_per_device):
        return SimpleNamespace(
            device_caches={d: ({v: None for v in range(n)}, None) for d, n in enumerate(variants_per_device)}
        )

    names = ("silu_mul_forward", "silu_mul_backward", "rotary", "kahan_adamw")
    jit = SimpleNamespace(**{name: kernel(*counts) for name, counts in zip(names, [(2,), (1, 1), (), (1,)])})
    monkeypatch.delitem(sys.modules, "alignpipe.triton_jit", raising=False)
    assert triton_kernels.variants_compiled() == 0, "no kernel launched yet"
    before = run_one.graphs_built()
    monkeypatch.setitem(sys.modules, "alignpipe.triton_jit", jit)
    assert triton_kernels.variants_compiled() == 5
    assert run_one.graphs_built() == before + 5


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_head_kernels_compute_the_compiled_kernels_eager_expressions(interpreted, dtype):
    """`token_scores` over a vocabulary of two blocks and a part (its running maximum and sum), on strided rows, at
    temperatures 1 and 0.7, and `token_grads`: the eager expressions `linear_sequence_loss` and `logprobs` compile;
    with the entropy (its running sum rescaled with the maximum), and the gradients at a temperature (the entropy's
    too), the eager log-softmax's and autograd's."""
    from alignpipe.linear_sequence_loss import _grad_fusable, _scores_fusable

    g = torch.Generator().manual_seed(5)
    vocab = 2 * triton_kernels.VOCAB_BLOCK + 77
    logits = (torch.randn(4, vocab + 9, generator=g) * 5).to(dtype)[:, :vocab]
    labels = torch.tensor([0, vocab - 1, 3, triton_kernels.VOCAB_BLOCK])
    coef = torch.tensor([1.0, -0.5, 2.0, 0.25])
    lse, token = triton_kernels.token_scores(logits, labels)
    want_lse, want_token = _scores_fusable(logits, labels, torch.float32)
    assert torch.allclose(lse, want_lse, rtol=1e-6, atol=1e-5) and torch.allclose(token, want_token, atol=1e-5)
    scaled = (logits.float() / 0.7).log_softmax(-1).gather(-1, labels[:, None]).squeeze(-1)
    assert torch.allclose(triton_kernels.token_scores(logits, labels, 0.7)[1], scaled, atol=1e-5)
    grad = triton_kernels.token_grads(logits, lse, labels, coef)
    close(grad, _grad_fusable(logits, lse, labels, coef, torch.float32))
    assert triton_kernels.head_disagreement(torch.device("cpu")) is None

    logits[0, 5] = float("-inf")  # a masked logit weighs nothing in the entropy (its 0 · −inf is not a NaN)
    for t in (1.0, 0.7):
        lse, token, spread = triton_kernels.token_scores(logits, labels, t, "entropy")
        logp = (logits.float() / t).log_softmax(-1)
        want_spread = -(logp.exp() * logp.clamp(min=torch.finfo(torch.float32).min)).sum(-1)
        assert torch.allclose(spread, want_spread, rtol=1e-5, atol=1e-5), (spread - want_spread).abs().max()
        assert torch.allclose(token, logp.gather(-1, labels[:, None]).squeeze(-1), atol=1e-5)
        grad = triton_kernels.token_grads(logits, lse, labels, coef, t)
        close(grad, (coef[:, None] * (F.one_hot(labels, vocab) - logp.exp())).to(dtype))
        # with the entropy: the gradient of Σ coef · log p(label) + Σ c · H with respect to the scaled logits
        c = torch.tensor([0.5, -2.0, 1.0, 3.0])
        z = (logits.float() / t).requires_grad_()
        lp = z.log_softmax(-1)
        h = -(lp.exp() * lp.clamp(min=torch.finfo(torch.float32).min)).sum(-1)
        (want,) = torch.autograd.grad((coef * lp.gather(-1, labels[:, None]).squeeze(-1)).sum() + (c * h).sum(), z)
        close(triton_kernels.token_grads(logits, lse, labels, coef, t, (spread, c)), want.to(dtype))


def test_scoring_passes_and_the_fused_head_take_the_head_kernels_where_the_gate_is_open(interpreted, monkeypatch):
    """A pass without gradients (a frozen reference's log-probs, an old policy's) scores its chunks with
    `token_scores` after the head's matmul, equal to the eager log-softmax, with the entropy or WPO's log Σp² from
    the same read; no compiled chunk runs (recorded here). DPO's fused head (`linear_sequence_loss`) takes
    `token_scores` and `token_grads` and gives the eager head's loss and gradients."""
    from alignpipe import linear_sequence_loss, logprobs

    assert triton_kernels.head_usable(torch.device("cpu"))  # its probe launches before the count starts
    launched = counted_calls(monkeypatch, triton_kernels, "token_scores", "token_grads")
    compiled_chunks = []
    monkeypatch.setattr(logprobs, "compiled_function", lambda fn: compiled_chunks.append(fn) or fn)
    g = torch.Generator().manual_seed(6)
    hidden = torch.randn(2, 9, 16, generator=g)
    weight = torch.randn(triton_kernels.VOCAB_BLOCK + 50, 16, generator=g) / 4
    labels = torch.randint(0, weight.size(0), (2, 9), generator=g)
    with torch.no_grad():
        want = logprobs._head_logprobs(hidden, weight, None, labels, 0.9, 4, False, compiled=False)
        got = logprobs._head_logprobs(hidden, weight, None, labels, 0.9, 4, False, compiled=True)
        assert torch.allclose(got, want, atol=1e-5) and launched["token_scores"] >= 1
        before = launched["token_scores"]
        for second in (True, "log_sum_sq"):  # the entropy; WPO's log Σp², from the same read
            got = logprobs._head_logprobs(hidden, weight, None, labels, 0.9, 4, second, compiled=True)
            want = logprobs._head_logprobs(hidden, weight, None, labels, 0.9, 4, second, compiled=False)
            for a, b in zip(got, want, strict=True):
                assert torch.allclose(a, b, rtol=1e-5, atol=1e-5), (second, (a - b).abs().max())
    assert launched["token_scores"] == before + 2 and compiled_chunks == []
    before = launched["token_scores"]

    rows = [5, 4, 6, 3]
    h = torch.randn(sum(rows), 16, generator=g, requires_grad=True)
    w = weight.clone().requires_grad_()
    y = torch.randint(0, weight.size(0), (sum(rows),), generator=g)

    def loss_of(sums, group_rows):
        return (sums * torch.tensor([1.0, -2.0, 0.5, 3.0])[group_rows]).sum()

    results = []
    for compiled in (False, True):
        total, _ = linear_sequence_loss.linear_sequence_loss(
            h, w, None, y, rows, [[0, 1], [2, 3]], loss_of, compiled=compiled
        )
        results.append((total.detach(), *torch.autograd.grad(total, (h, w))))
    assert launched["token_scores"] == before + 2 and launched["token_grads"] == 2
    for a, b in zip(*results, strict=True):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("with_entropy", [True, "grad"], ids=["entropy", "entropy bonus"])
@pytest.mark.parametrize("whole", [False, True], ids=["chunked", "whole"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_rl_trainers_heads_take_the_head_kernels_with_their_gradients_and_entropies(
    interpreted, monkeypatch, dtype, whole, with_entropy
):
    """GRPO's, PPO's and online DPO's trained head (`logprobs._head_logprobs` with gradients, `compiled`: the gate
    open) on `token_scores` (with the entropy) and, in backward, `token_grads`: no compiled function and no
    activation checkpointing, one launch of each a chunk (the logits formed again in backward, or kept where the head
    runs in one piece). Its log-probs, entropies (detached, or with their gradient
    where an entropy bonus trains through them) and the hidden states', head's and bias's gradients at a temperature
    are the eager chunks' (float32: to float32 ordering; bf16: the logits are the same bf16 matmul's, the gradients
    round once, so within a rounding step of the logits')."""
    from alignpipe import logprobs

    assert triton_kernels.head_usable(torch.device("cpu"))  # its probe launches before the count starts
    launched = counted_calls(monkeypatch, triton_kernels, "token_scores", "token_grads")
    compiled, checkpointed = [], []
    monkeypatch.setattr(logprobs, "compiled_function", lambda fn: compiled.append(fn) or fn)
    checkpoint = logprobs.checkpoint
    monkeypatch.setattr(logprobs, "checkpoint", lambda *a, **k: checkpointed.append(a[0]) or checkpoint(*a, **k))
    vocab = triton_kernels.VOCAB_BLOCK + 50
    monkeypatch.setattr(logprobs, "WHOLE_LOGITS_MAX", 10**9 if whole else 8 * vocab)
    g = torch.Generator().manual_seed(8)
    hidden = torch.randn(2, 9, 16, generator=g).to(dtype)
    weight = (torch.randn(vocab, 16, generator=g) / 2).to(dtype)
    bias = (torch.randn(vocab, generator=g) / 4).to(dtype)
    labels = torch.randint(0, vocab, (2, 9), generator=g)
    labels[0, 0], labels[1, 8] = 0, vocab - 1
    upstream = torch.linspace(-1, 2, 18).view(2, 9)
    bonus = torch.linspace(0.5, -3, 18).view(2, 9) if with_entropy == "grad" else torch.zeros(2, 9)

    def run(kernels: bool):
        h, w, b = (t.clone().requires_grad_() for t in (hidden, weight, bias))
        lp, ent = logprobs._head_logprobs(h, w, b, labels, 0.8, 4, with_entropy, compiled=kernels)
        assert lp.dtype == ent.dtype == torch.float32 and ent.requires_grad == (with_entropy == "grad")
        loss = (lp * upstream).sum() + (ent * bonus).sum() if ent.requires_grad else (lp * upstream).sum()
        return (lp.detach(), ent.detach(), *torch.autograd.grad(loss, (h, w, b)))

    heads = counted_calls(monkeypatch, logprobs.F, "linear")
    got = run(True)
    chunks = 1 if whole else 4  # 2 rows × 2 positions within 8 × V values, the last position alone joining: 2, 2, 2, 3
    assert launched == {"token_scores": chunks, "token_grads": chunks}
    assert compiled == [] and checkpointed == []
    # a chunk's logits formed again in backward; in one piece (≤ WHOLE_LOGITS_MAX values) kept instead
    assert heads["linear"] == (1 if whole else 2 * chunks)
    want = run(False)
    for a, b in zip(got[:2], want[:2], strict=True):
        assert torch.allclose(a, b, rtol=1e-5, atol=2e-5), (a - b).abs().max()
    for a, b in zip(got[2:], want[2:], strict=True):
        assert a.dtype == b.dtype == dtype
        if dtype == torch.float32:  # sums over the vocabulary in another order: ~1e-6 of the largest gradient
            scale = float(b.abs().max())
            assert torch.allclose(a, b, rtol=1e-5, atol=1e-5 * scale), ((a - b).abs().max(), scale)
        else:
            assert float((a.float() - b.float()).norm() / b.float().norm()) < ULP, (a - b).abs().max()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_kl_kernel_computes_the_eager_kl_of_two_heads(interpreted, dtype):
    """`token_kl` (PPO's `kl_penalty: full`) over a vocabulary of two blocks and a part, on strided rows, at
    temperatures 1 and 0.7: each side's label log-prob and Σ p (log p − log q) equal the eager float32 log-softmaxes'
    (`logprobs.logits_kl`). Identical heads give a KL of exactly 0; a policy logit of −inf weighs nothing (the eager
    expression's 0 · −inf there is a NaN); a reference logit of −inf where the policy's is not gives ∞."""
    from alignpipe.logprobs import logits_kl

    g = torch.Generator().manual_seed(9)
    vocab = 2 * triton_kernels.VOCAB_BLOCK + 77
    logits = (torch.randn(5, vocab + 9, generator=g) * 3).to(dtype)[:, :vocab]
    ref_logits = (logits.float() + torch.randn(5, vocab, generator=g)).to(dtype)
    labels = torch.tensor([0, vocab - 1, 3, triton_kernels.VOCAB_BLOCK, 11])
    for t in (1.0, 0.7):
        got, want = triton_kernels.token_kl(logits, ref_logits, labels, t), logits_kl(logits, ref_logits, labels, t)
        for a, b in zip(got, want, strict=True):
            assert a.dtype == torch.float32 and torch.allclose(a, b, rtol=1e-5, atol=1e-5), (a - b).abs().max()
        assert (got[2] > 0.1).all(), "a KL of a few tenths: compared, not two zeros"
        same = triton_kernels.token_kl(logits, logits, labels, t)
        assert triton_kernels.kl_disagreement(torch.device("cpu")) is None
        assert torch.equal(same[2], torch.zeros(5)) and torch.equal(same[0], same[1])

    logits[0, 5] = float("-inf")
    ref_logits[1, 6] = float("-inf")
    _, _, kl = triton_kernels.token_kl(logits, ref_logits, labels, 0.7)
    logp, ref_logp = ((x.float() / 0.7).log_softmax(-1) for x in (logits, ref_logits))
    masked = torch.where(logp > float("-inf"), logp.exp() * (logp - ref_logp), 0.0).sum(-1)
    assert kl[1] == float("inf") and masked[1] == float("inf")
    assert torch.allclose(kl[[0, 2, 3, 4]], masked[[0, 2, 3, 4]], rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="differ"):
        triton_kernels.token_kl(logits, ref_logits[:, :-1], labels)


def test_the_full_kl_takes_the_kl_kernel_where_the_gate_is_open_and_compiles_its_chunk_otherwise(
    interpreted, monkeypatch, caplog
):
    """`logprobs.full_kl` with the fused kernels' gate open: each chunk's two heads' logits go to `token_kl` (one
    launch a chunk, nothing compiled), with a float32 head beside a bf16 reference's; where the hand-written kernels
    cannot run, the eager chunk is compiled. Either way the log-probs and KL are the eager run's. A card whose
    `token_kl` computes otherwise is told once and runs the compiled chunk, keeping the other head kernels."""
    from alignpipe import logprobs

    cpu = torch.device("cpu")
    assert triton_kernels.head_usable(cpu) and triton_kernels.kl_usable(cpu)  # probes launch before the count
    launched = counted_calls(monkeypatch, triton_kernels, "token_kl")
    compiled: list = []
    monkeypatch.setattr(logprobs, "compiled_function", lambda fn: compiled.append(fn) or fn)
    g = torch.Generator().manual_seed(10)
    vocab = triton_kernels.VOCAB_BLOCK + 50
    hidden, ref_hidden = torch.randn(2, 9, 16, generator=g), torch.randn(2, 9, 16, generator=g).to(torch.bfloat16)
    head = (torch.randn(vocab, 16, generator=g) / 3, torch.randn(vocab, generator=g) / 4)
    ref_head = (head[0] + torch.randn(vocab, 16, generator=g) / 10).to(torch.bfloat16), None
    labels = torch.randint(0, vocab, (2, 9), generator=g)
    labels[1, 8] = -100  # a padded position: scored as token 0, as the eager chunk scores it

    def kl_of(compiled: bool):
        return logprobs.full_kl(hidden, head, ref_hidden, ref_head, labels, 0.8, chunk_tokens=4, compiled=compiled)

    want = kl_of(False)
    assert launched["token_kl"] == 0 and compiled == []
    got = kl_of(True)
    assert launched["token_kl"] == 5 and compiled == []  # 2 rows × 2 positions a chunk over 9 positions
    for a, b in zip(got, want, strict=True):
        assert a.shape == (2, 9) and torch.allclose(a, b, rtol=1e-5, atol=1e-5), (a - b).abs().max()
    by_hand = fused_kernels.by_hand
    monkeypatch.setattr(fused_kernels, "by_hand", lambda *t, head=False: False)
    again = kl_of(True)
    assert launched["token_kl"] == 5 and compiled == [logprobs._chunk_kl]
    for a, b in zip(again, want, strict=True):
        assert torch.equal(a, b)

    monkeypatch.setattr(fused_kernels, "by_hand", by_hand)  # the kernels as they were; then one gets the KL wrong
    kl = triton_kernels.token_kl
    monkeypatch.setattr(triton_kernels, "token_kl", lambda *a: (*kl(*a)[:2], kl(*a)[2] * 1.01))
    triton_kernels.kl_usable.cache_clear()
    with caplog.at_level(logging.WARNING, logger="alignpipe.triton_kernels"):
        assert not triton_kernels.kl_usable(cpu) and triton_kernels.head_usable(cpu)
        assert all(torch.equal(a, b) for a, b in zip(kl_of(True), want, strict=True))
    assert compiled == [logprobs._chunk_kl] * 2 and launched["token_kl"] == 5 + 2  # the probe's, then none
    said = [r.getMessage() for r in caplog.records if r.name == "alignpipe.triton_kernels"]
    assert len(said) == 1 and "the heads' KL on cpu differs" in said[0] and "full KL runs compiled" in said[0], said


@pytest.mark.parametrize("dft", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sft_s_fused_head_takes_the_head_kernels_and_compiles_nothing(interpreted, monkeypatch, dtype, dft):
    """SFT's head with its gradients formed in the forward (`linear_ce.linear_nll_sum`, `compiled`: the gate open)
    runs each chunk on `token_scores` and `token_grads`, as DPO's does, and builds no compiled function: its loss and
    the hidden states', head's and bias's gradients equal the eager chunks' (float32: to float32 ordering; bf16: the
    compiled kernels' expressions, the same float32 arithmetic rounded once), plain and `dft`. Without gradients (an
    evaluation pass) each chunk takes `token_scores` alone, and the eager value."""
    from alignpipe import linear_ce

    assert triton_kernels.head_usable(torch.device("cpu"))  # its probe launches before the count starts
    launched = counted_calls(monkeypatch, triton_kernels, "token_scores", "token_grads")
    compiled = []
    monkeypatch.setattr(linear_ce, "compiled_function", lambda fn: compiled.append(fn) or fn)
    g = torch.Generator().manual_seed(7)
    rows, vocab = 11, triton_kernels.VOCAB_BLOCK + 50
    hidden = torch.randn(rows, 16, generator=g).to(dtype)
    weight = (torch.randn(vocab, 16, generator=g) / 2).to(dtype)
    bias = (torch.randn(vocab, generator=g) / 4).to(dtype)
    labels = torch.randint(0, vocab, (rows,), generator=g)
    labels[0], labels[1] = 0, vocab - 1

    def run(kernels: bool):
        h, w, b = (t.clone().requires_grad_() for t in (hidden, weight, bias))
        loss = linear_ce.linear_nll_sum(h, w, b, labels, 4, compiled=kernels, dft=dft)
        return (loss.detach(), *torch.autograd.grad(loss * 0.5, (h, w, b)))

    got = run(True)
    assert launched == {"token_scores": 3, "token_grads": 3} and compiled == [], "3 chunks of 4, 4 and 3 rows"
    with torch.no_grad():  # an evaluation pass: the scores alone, one read of each chunk's logits
        evaluated = linear_ce.linear_nll_sum(hidden, weight, bias, labels, 4, compiled=True, dft=dft)
        eager = linear_ce.linear_nll_sum(hidden, weight, bias, labels, 4, compiled=False, dft=dft)
    assert launched == {"token_scores": 6, "token_grads": 3} and compiled == []
    assert torch.allclose(evaluated, eager, rtol=1e-5) and torch.allclose(evaluated, got[0], rtol=1e-5)
    if dtype == torch.float32:
        for a, b in zip(got, run(False), strict=True):
            assert torch.allclose(a, b, rtol=1e-5, atol=1e-6), (a - b).abs().max()
        return
    monkeypatch.setattr(fused_kernels, "ELEMENTWISE", "compiled")  # the expressions inductor compiles, run as they are
    fusable = run(True)
    assert compiled == [linear_ce._nll_and_grad_fusable]
    assert torch.allclose(got[0], fusable[0], rtol=1e-5)
    for a, b in zip(got[1:], fusable[1:], strict=True):
        close(a, b)


GPUS = {80: "A100", 90: "H100 and H200", 100: "B200"}


def test_every_kernel_builds_for_the_gpus_users_train_on_with_vector_loads_and_no_spills(tmp_path):
    """Each hand-written kernel, launched as a training step launches it (Qwen2-0.5B's sizes, bf16 and float32), built
    by Triton and ptxas for A100s, H100s/H200s and B200s (`tests/triton_build_check.py`; no GPU needed): the
    interpreter that runs them here checks what they compute, not that they compile, and it ignores the hints their
    vector loads rely on. Each build keeps its registers (no local memory). Where a program's values are adjacent in
    memory, its bf16 loads and stores move 16 bytes each, not 2. This holds for the SwiGLU kernels, for the queries'
    and keys' rotation (its batch strides specialised on their alignment), and for the AdamW step over slices that
    start 16-byte aligned and hold a multiple of 8 values (`ALIGNED`). Without the hints that step's 5 loads and 4 stores of 16
    values a thread were 144 scalar instructions and took 212 registers a thread, so only one block of 8 warps fit
    an H100's SM."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    pytest.importorskip("triton", reason="the test extra installs Triton (Linux x86-64)")
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "TRITON_CACHE_DIR", "TRITON_HOME")}
    env |= {"TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor"), "HOME": str(tmp_path / "home")}
    script = Path(__file__).with_name("triton_build_check.py")
    out = subprocess.run(
        [sys.executable, str(script), *map(str, GPUS)], capture_output=True, text=True, timeout=600, env=env
    )
    assert out.returncode == 0, out.stderr[-3000:]
    builds = [json.loads(line) for line in out.stdout.splitlines()]
    # each build went to the compiler's cache folder (on a pool's shared volume), none to the home folder
    assert len(list((tmp_path / "inductor" / "triton" / "0").glob("*/*.cubin"))) == len(builds)
    assert not (tmp_path / "home" / ".triton" / "cache").exists()
    by = {(b["kernel"], b["variant"], b["capability"]): b for b in builds}
    kernels = {"silu_mul_forward", "silu_mul_backward", "rotary", "token_scores", "token_grads", "token_kl"}
    kernels.add("kahan_adamw")
    assert {b["kernel"] for b in builds} == kernels and {b["capability"] for b in builds} == set(GPUS)
    assert len(by) == len(builds) == 24 * len(GPUS)  # 11 launches in each of 2 dtypes, the AdamW step 2 ways
    assert all(b["local"] == 0 for b in builds), [b for b in builds if b["local"]]

    for capability in GPUS:
        for kernel, variant in [
            ("silu_mul_forward", "bfloat16"),
            ("silu_mul_backward", "bfloat16"),
            ("silu_mul_backward", "bfloat16, product kept"),
            ("kahan_adamw", "aligned slices"),
        ]:
            memory = by[(kernel, variant, capability)]["memory"]
            # the AdamW step's reads of its table (a slice's addresses, size and start) are the only scalar ones
            assert not any(op.endswith(".b16") for op in memory), (kernel, variant, capability, memory)
            assert all(".v4." in op for op in memory if op.startswith("st.")), (kernel, variant, capability, memory)
        adamw = by[("kahan_adamw", "aligned slices", capability)]
        assert adamw["memory"]["ld.global.v4.b32"] == 10 and adamw["memory"]["st.global.v4.b32"] == 8, adamw
        assert adamw["registers"] <= 96, adamw
        assert "ld.global.b16" in by[("kahan_adamw", "a slice of 17 values", capability)]["memory"]
        for direction in ("forward", "backward"):
            rotary = by[("rotary", f"bfloat16, {direction}", capability)]["memory"]
            assert rotary.get("ld.global.v4.b32", 0) >= 4 and rotary.get("ld.global.b16", 0) <= 8, rotary
        for variant in ("bfloat16", "bfloat16, with the entropy", "bfloat16, with log Σp²"):  # a second sum kept
            scores = by[("token_scores", variant, capability)]["memory"]
            assert scores.get("ld.global.v4.b32", 0) == 2 and scores.get("ld.global.b16", 0) == 1, scores
        kl = by[("token_kl", "bfloat16", capability)]["memory"]  # two heads' blocks, and each one's label
        assert kl.get("ld.global.v4.b32", 0) == 4 and kl.get("ld.global.b16", 0) == 2, kl


def test_the_kernels_builds_go_where_the_compiler_s_triton_kernels_go_unless_the_user_chose_a_folder(
    monkeypatch, tmp_path
):
    """Triton caches a build of these kernels in `TRITON_CACHE_DIR`, and inductor points that variable at its own
    folder when it loads its first kernel, if it is unset. Set at the kernels' first use to the folder inductor would
    pick, it is one folder whichever kind of kernel a process builds first, under `TORCHINDUCTOR_CACHE_DIR`: where the
    work-pool templates keep it on the volume that outlives a job. A folder the user set is kept."""
    triton = pytest.importorskip("triton", reason="the test extra installs Triton (Linux x86-64)")
    from torch._inductor.runtime.cache_dir_utils import triton_cache_dir

    monkeypatch.setenv("TRITON_CACHE_DIR", "")  # restored afterwards, whatever it was
    monkeypatch.delenv("TRITON_CACHE_DIR")
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    monkeypatch.setenv("TRITON_HOME", str(tmp_path / "home"))  # Triton's home folder (`HOME` at its import)
    assert triton.knobs.cache.dir == str(tmp_path / "home" / ".triton" / "cache"), "Triton's own default"
    inductors = triton_cache_dir(0)  # where inductor would point Triton had its kernel come first
    assert inductors == str(tmp_path / "inductor" / "triton" / "0")

    triton_kernels._kernels.cache_clear()
    triton_kernels._kernels()
    triton_kernels._kernels.cache_clear()  # the next test's kernels are decorated under its own settings
    assert os.environ["TRITON_CACHE_DIR"] == inductors
    assert triton.knobs.cache.dir == inductors, "Triton reads the variable at each build"

    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "mine"))
    triton_kernels.share_compile_cache()
    assert os.environ["TRITON_CACHE_DIR"] == str(tmp_path / "mine")


def test_the_adamw_kernel_moves_8_values_a_load_only_where_every_slice_of_its_launch_allows_it(
    interpreted, monkeypatch
):
    """The kernel is told its slices' values go 8 at a time (`ALIGNED`) for a launch whose every slice starts on a
    16-byte boundary and holds a multiple of 8 values, and for no other: with a slice of 17 values, or one that starts
    a value into its buffer (as a gradient can in DDP's bucket), every slice goes a value at a time. (On a GPU a
    vector load from an unaligned address faults.) Either way the step is the eager step's: weights and moments equal,
    the compensation within a rounding step, and no more than 1% of a launch's compensations off by that step (counted
    over the launch: a slice of 24 values with one off is 4%, which session 63's machine gave where earlier ones gave
    none; which values land a step off can hang on the CPU, whose vector width decides where torch's CPU kernels fuse
    a multiply-add)."""
    from types import SimpleNamespace

    from alignpipe.low_precision_adamw import _scalars, kahan_update

    kernels, told = triton_kernels._kernels(), []

    class Watched:
        def __getitem__(self, grid):
            launch = kernels.kahan_adamw[grid]
            return lambda *args, **kwargs: (told.append(kwargs["ALIGNED"]), launch(*args, **kwargs))

    monkeypatch.setattr(triton_kernels, "_kernels", lambda: SimpleNamespace(kahan_adamw=Watched()))
    g = torch.Generator().manual_seed(0)
    buffers = [torch.randn(triton_kernels.ADAMW_BLOCK + 200, generator=g) * s for s in (0.02, 1e-3, 1e-4, 1e-7, 1e-5)]
    buffers[3] = buffers[3].abs()
    scalars = _scalars({"betas": (0.9, 0.999), "lr": 1e-4, "eps": 1e-8, "weight_decay": 0.01}, 2)

    def slices(at: list[tuple[int, int]]) -> list[tuple[torch.Tensor, ...]]:
        return [tuple(b.bfloat16()[start:stop] for b in buffers) for start, stop in at]

    for at, aligned in [
        ([(0, triton_kernels.ADAMW_BLOCK + 104), (8, 32)], True),
        ([(0, triton_kernels.ADAMW_BLOCK + 104), (8, 25)], False),
        ([(1, triton_kernels.ADAMW_BLOCK + 105), (8, 32)], False),
    ]:
        got, want = slices(at), slices(at)
        triton_kernels.kahan_adamw(got, scalars, triton_kernels.AdamWBlocks())
        for piece in want:
            kahan_update(*piece, *scalars)
        assert told[-1] is aligned, at
        for (w, _, m, v, c), (w0, _, m0, v0, c0) in zip(got, want, strict=True):
            assert torch.equal(w, w0) and torch.equal(m, m0) and torch.equal(v, v0)
            assert (c.float() - c0.float()).abs().max() <= ULP * c0.abs().max()
        off = sum(int((c != c0).sum()) for (*_, c), (*_, c0) in zip(got, want, strict=True))
        assert off <= 0.01 * sum(c.numel() for *_, c in want), (at, off)
    assert told == [True, False, False]
