"""DPO's fused LM-head loss (`linear_sequence_loss`): a loss of summed answer log-probs whose head gradients are formed
in the forward, a group of coupled answers at a time. Its value, sums and every gradient equal autograd through full
logits; DPO's loss through it equals the chunked head's in value and every parameter's gradient, for each loss type
(to float32's precision, which the chunked head's log-softmax runs in)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from support import known, matmuls, tiny_split

from alignpipe.linear_sequence_loss import linear_sequence_loss
from alignpipe.losses import dpo_loss
from alignpipe.modeling import load_causal_lm
from alignpipe.trainers import dpo
from alignpipe.trainers.configs import DPOConfig


def pair_loss(sums, rows, B, ref):
    """A DPO-shaped coupling: rows i and B + i are a pair; the loss is a mean over pairs plus an NLL-like sum."""
    k = len(rows) // 2
    pairs = rows[:k]
    losses, _, _ = dpo_loss(sums[:k], sums[k:], ref[0][pairs], ref[1][pairs], 0.3)
    return losses.sum() / B - 0.2 * sums[:k].sum()


@pytest.mark.parametrize("grouping", ["pair-by-pair", "two-groups", "whole"])
@pytest.mark.parametrize("with_bias", [False, True])
def test_value_sums_and_gradients_equal_autograd_through_full_logits(grouping, with_bias):
    g = torch.Generator().manual_seed(0)
    B, d, V = 3, 16, 97
    row_tokens = [5, 1, 7, 4, 6, 2]  # chosen rows 0..2, rejected rows 3..5
    N = sum(row_tokens)
    hidden = torch.randn(N, d, generator=g, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(V, d, generator=g, dtype=torch.float64, requires_grad=True)
    bias = torch.randn(V, generator=g, dtype=torch.float64, requires_grad=True) if with_bias else None
    labels = torch.randint(0, V, (N,), generator=g)
    ref = torch.randn(B, generator=g, dtype=torch.float64), torch.randn(B, generator=g, dtype=torch.float64)
    inputs = [t for t in (hidden, weight, bias) if t is not None]

    token_lp = F.log_softmax(F.linear(hidden, weight, bias), -1).gather(-1, labels[:, None]).squeeze(-1)
    expected_sums = torch.stack([part.sum() for part in token_lp.split(row_tokens)])
    expected = pair_loss(expected_sums, list(range(2 * B)), B, ref)
    want = torch.autograd.grad(expected * 0.37, inputs)

    pairs = {"pair-by-pair": [[0], [1], [2]], "two-groups": [[0, 2], [1]], "whole": [[0, 1, 2]]}[grouping]
    groups = [p + [B + i for i in p] for p in pairs]
    got, sums = linear_sequence_loss(
        hidden, weight, bias, labels, row_tokens, groups, lambda s, rows: pair_loss(s, rows, B, ref)
    )
    grads = torch.autograd.grad(got * 0.37, inputs)  # the upstream gradient scales what the forward formed
    assert float(got.detach()) == pytest.approx(float(expected.detach()), rel=1e-12)
    assert not sums.requires_grad and torch.allclose(sums, expected_sums.detach(), atol=1e-12)
    for a, b in zip(grads, want):
        assert torch.allclose(a, b, atol=1e-10), (a - b).abs().max()


def test_no_grad_and_a_frozen_head_form_only_what_is_wanted():
    g = torch.Generator().manual_seed(1)
    row_tokens = [3, 4]
    hidden = torch.randn(7, 8, generator=g, requires_grad=True)
    weight = torch.randn(31, 8, generator=g, requires_grad=True)
    labels = torch.randint(0, 31, (7,), generator=g)

    def run():
        return linear_sequence_loss(hidden, weight, None, labels, row_tokens, [[0, 1]], lambda s, rows: -s.sum())

    assert matmuls(run) == 3  # logits, hidden-state gradient, head gradient
    with torch.no_grad():
        assert matmuls(run) == 1  # an evaluation: the logits alone
    frozen = weight.detach()
    loss, _ = linear_sequence_loss(hidden, frozen, None, labels, row_tokens, [[0, 1]], lambda s, rows: -s.sum())
    loss.backward()
    expected_h = hidden.detach().clone().requires_grad_(True)
    F.cross_entropy(F.linear(expected_h, frozen), labels, reduction="sum").backward()
    assert torch.allclose(known(hidden.grad), known(expected_h.grad), atol=1e-6)


@pytest.mark.parametrize(
    "overrides",
    [
        {},
        {"rpo_alpha": 0.5},
        {"loss_type": "ipo"},
        {"loss_type": "hinge"},
        {"label_smoothing": 0.1},
        {"loss_type": "exo_pair", "label_smoothing": 1e-3},
        {"loss_type": "sigmoid_norm"},
        {"loss_type": "apo_down"},
        {"loss_type": "discopop", "discopop_tau": 0.5},  # its default 0.05 multiplies the chunked head's float32
        # rounding by 20 in the mixing weight: 4e-7 off in this float64 comparison, past its 1e-7
        {"loss_type": ["sigmoid", "bco_pair", "sft"], "loss_weights": [0.8, 0.2, 1.0]},
        {"loss_type": "sigmoid", "f_divergence_type": "js_divergence"},
    ],
    ids=["sigmoid", "rpo", "ipo", "hinge", "cdpo", "exo", "sigmoid_norm", "apo_down", "discopop", "mpo", "js"],
)
def test_dpo_fused_loss_equals_the_chunked_head_in_value_and_gradients(tiny, monkeypatch, overrides):
    """One DPO batch through the fused loss and through the chunked, recomputed head: the same loss, metrics and
    gradient for every parameter; and pairs grouped one by one give the same as all at once. (Logits small enough
    to run whole, as this batch's, take the whole head: it keeps them for backward, 3 matmuls as well.)"""
    tok, rows, _ = tiny_split(tiny, "sentiment_preferences", "preference", rows=16, max_length=64)
    examples = dpo.tokenize(rows[:6], tok, 64)
    batch = dpo.collate(examples, tok.pad_token_id, 64)
    model = load_causal_lm(str(tiny / "model")).double()
    ref = copy.deepcopy(model).requires_grad_(False)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():  # a policy some steps away from its reference: rewards clearly apart from 0
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g, dtype=p.dtype) * 0.05)

    def reference_logps(b):
        with torch.no_grad():
            return dpo.completion_logps(ref, b)[0].chunk(2)

    def run(**cfg):
        model.zero_grad()
        loss, stats = dpo.batch_loss(model, batch, reference_logps, DPOConfig(**overrides, **cfg))
        loss.backward()
        return loss.detach(), stats, {n: p.grad.clone() for n, p in model.named_parameters()}

    from alignpipe import logprobs

    monkeypatch.setattr(logprobs, "WHOLE_LOGITS_MAX", 0)  # the logits of a GPU batch: chunked, recomputed in backward
    chunked = run(fused_loss=False)
    calls = []
    fused_pair_loss = dpo.fused_pair_loss
    monkeypatch.setattr(dpo, "fused_pair_loss", lambda *a: calls.append(1) or fused_pair_loss(*a))
    fused = run()
    rows, B = batch["scored_per_row"], len(examples)
    monkeypatch.setattr(dpo, "FUSED_GROUP_MAX", max(rows[i] + rows[B + i] for i in range(B)) * model.config.vocab_size)
    one_by_one = run()  # the budget holds one pair: a group per pair
    monkeypatch.setattr(dpo, "FUSED_GROUP_MAX", 1)  # every pair over the budget: the chunked head again
    fallback = run()
    # the chunked head takes its log-softmax in float32 (the fused one in the model's float64): float32 tolerances
    assert len(calls) == 3 and float(fused[0]) == pytest.approx(float(chunked[0]), rel=1e-6)
    for key, value in chunked[1].items():
        assert float(fused[1][key]) == pytest.approx(float(value), rel=1e-5, abs=1e-5), key
    for name, grad in chunked[2].items():
        assert torch.allclose(fused[2][name], grad, rtol=1e-4, atol=1e-7), (name, (fused[2][name] - grad).abs().max())
        assert torch.allclose(one_by_one[2][name], fused[2][name], atol=1e-12), name
        assert torch.equal(fallback[2][name], grad), name


def test_dpo_takes_the_whole_head_where_its_logits_fit(tiny, monkeypatch):
    """Where `completion_logps` runs the head in one piece (logits up to `WHOLE_LOGITS_MAX`) it saves nothing to
    fuse: the fused loss is not taken."""
    tok, rows, _ = tiny_split(tiny, "sentiment_preferences", "preference", rows=16, max_length=64)
    batch = dpo.collate(dpo.tokenize(rows[:4], tok, 64), tok.pad_token_id, 64)
    model = load_causal_lm(str(tiny / "model"))
    assert dpo.fused_pair_loss(model, batch, None, DPOConfig()) is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compiled_group_kernels_give_the_eager_loss_sums_and_gradients(dtype):
    """`compile: true`: each group's log-sum-exp and g · (one-hot − softmax) come from two compiled kernels
    (inductor's CPU code here) reading the logits in their own dtype; the loss, sums and every gradient equal the
    eager passes (bf16: to the gradient's own rounding). Groups of different sizes share the kernels."""
    g = torch.Generator().manual_seed(5)
    B, d, V = 3, 16, 211
    row_tokens = [5, 1, 7, 4, 6, 2]
    N = sum(row_tokens)
    hidden = torch.randn(N, d, generator=g).to(dtype).requires_grad_()
    weight = torch.randn(V, d, generator=g).to(dtype).requires_grad_()
    bias = torch.randn(V, generator=g).to(dtype).requires_grad_()
    labels = torch.randint(0, V, (N,), generator=g)
    ref = torch.randn(B, generator=g), torch.randn(B, generator=g)
    groups = [[0, 2, 3, 5], [1, 4]]

    def run(compiled):
        loss, sums = linear_sequence_loss(
            hidden, weight, bias, labels, row_tokens, groups, lambda s, r: pair_loss(s, r, B, ref), compiled
        )
        return loss, sums, torch.autograd.grad(loss, (hidden, weight, bias))

    eager, fused = run(False), run(True)
    assert float(fused[0]) == pytest.approx(float(eager[0]), rel=1e-6)
    assert torch.allclose(fused[1], eager[1], rtol=1e-6, atol=1e-6)
    for a, b in zip(fused[2], eager[2]):
        assert a.dtype == b.dtype == dtype
        tolerance = 1e-5 if dtype == torch.float32 else 2e-2 * float(b.float().abs().max())
        assert torch.allclose(a.float(), b.float(), atol=tolerance), (a.float() - b.float()).abs().max()


def test_a_compiled_dpo_batch_equals_the_eager_fused_one(tiny, monkeypatch):
    """DPO with `compile: true` takes the fused head with its compiled group kernels: loss and every parameter's
    gradient equal the eager fused head's."""
    from alignpipe import logprobs

    tok, rows, _ = tiny_split(tiny, "sentiment_preferences", "preference", rows=16, max_length=64)
    batch = dpo.collate(dpo.tokenize(rows[:4], tok, 64), tok.pad_token_id, 64)
    model = load_causal_lm(str(tiny / "model"))
    monkeypatch.setattr(logprobs, "WHOLE_LOGITS_MAX", 0)  # a GPU batch's logits: the fused head is taken
    calls = []
    fused_pair_loss = dpo.fused_pair_loss
    monkeypatch.setattr(dpo, "fused_pair_loss", lambda *a: calls.append(a[3].compile) or fused_pair_loss(*a))

    def run(compile):
        model.zero_grad()
        zeros = torch.zeros(4)
        loss, _ = dpo.batch_loss(model, batch, lambda _b: (zeros, zeros), DPOConfig(compile=compile))
        loss.backward()
        return float(loss.detach()), {n: p.grad.clone() for n, p in model.named_parameters()}

    eager, compiled = run(False), run(True)
    assert calls == [False, True] and compiled[0] == pytest.approx(eager[0], rel=1e-6)
    for name, grad in eager[1].items():
        assert torch.allclose(compiled[1][name], grad, rtol=1e-4, atol=1e-6), name


@pytest.mark.parametrize("loss_type", ["kto", "apo_zero_unpaired"])
def test_kto_fused_loss_equals_the_chunked_head_in_value_and_gradients(tiny, monkeypatch, loss_type):
    """KTO's loss through the fused head (each completion a unit: its loss reads its own log-prob, the KL reference
    point being detached) equals the chunked head's in loss, metrics and every parameter's gradient, grouped all
    at once or one completion at a time."""
    import contextlib

    from accelerate import Accelerator

    from alignpipe import logprobs
    from alignpipe.trainers import kto
    from alignpipe.trainers.configs import KTOConfig

    tok, rows, _ = tiny_split(tiny, "sentiment_preferences", "preference", rows=16, max_length=64)
    unpaired = [
        {"prompt": r["prompt"], "completion": r[side], "label": side == "chosen"}
        for r in rows[:3]
        for side in ("chosen", "rejected")
    ]
    batch = kto.collate(kto.tokenize(unpaired, tok), tok.pad_token_id, 64, with_kl=loss_type == "kto")
    model = load_causal_lm(str(tiny / "model")).double()
    ref = copy.deepcopy(model).requires_grad_(False)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g, dtype=p.dtype) * 0.05)
    monkeypatch.setattr(logprobs, "WHOLE_LOGITS_MAX", 0)  # a GPU batch's logits
    calls = []
    fused_answers_loss = dpo.fused_answers_loss
    monkeypatch.setattr(dpo, "fused_answers_loss", lambda *a: calls.append(fused_answers_loss(*a)) or calls[-1])

    def run(**cfg):
        model.zero_grad()
        losses = kto.Losses(
            KTOConfig(batch_size=6, beta=0.3, loss_type=loss_type, desirable_weight=1.3, **cfg),
            Accelerator(cpu=True),
            lambda: (ref, contextlib.nullcontext()),
        )
        sums: dict[str, torch.Tensor] = {}
        counts: dict[str, int] = {}
        loss = losses(model, batch, sums, counts)
        loss.backward()
        return float(loss.detach()), kto.metrics(sums, counts), {n: p.grad.clone() for n, p in model.named_parameters()}

    chunked = run(fused_loss=False)
    fused = run()
    monkeypatch.setattr(dpo, "FUSED_GROUP_MAX", max(batch["scored_per_row"][:6]) * model.config.vocab_size)
    one_by_one = run()
    assert len(calls) == 2 and all(c is not None for c in calls)
    assert fused[0] == pytest.approx(chunked[0], rel=1e-6)
    for key, value in chunked[1].items():
        assert float(fused[1][key]) == pytest.approx(float(value), rel=1e-5, abs=1e-6), key
    for name, grad in chunked[2].items():  # the chunked head's log-softmax runs in float32: relative to the norm
        assert float((fused[2][name] - grad).norm() / grad.norm()) < 1e-5, name
        assert torch.allclose(one_by_one[2][name], fused[2][name], atol=1e-12), name


def test_ld_dpo_and_wpo_take_the_chunked_head(tiny, monkeypatch):
    """LD-DPO weighs the tokens of a completion unequally, which the fused head's whole-completion sums cannot: it
    takes the chunked head even where the fused one would run."""
    from alignpipe import logprobs

    tok, rows, _ = tiny_split(tiny, "sentiment_preferences", "preference", rows=16, max_length=64)
    batch = dpo.collate(dpo.tokenize(rows[:4], tok, 64), tok.pad_token_id, 64)
    model = load_causal_lm(str(tiny / "model"))
    monkeypatch.setattr(logprobs, "WHOLE_LOGITS_MAX", 0)
    assert dpo.fused_pair_loss(model, batch, lambda c, r, p: (c - r, c, r), DPOConfig()) is not None
    assert dpo.fused_pair_loss(model, batch, None, DPOConfig(ld_alpha=0.5)) is None
    assert dpo.fused_pair_loss(model, batch, None, DPOConfig(use_weighting=True)) is None  # WPO: log Σp² per token


def test_each_group_s_rows_and_token_ids_reach_the_device_in_one_staged_copy(monkeypatch):
    """The groups' rows and each token's row within its group are built on the host and copied once (`to_device`:
    page-locked, queued on a GPU); the group loss is handed its rows as that device index, never as a host list,
    which torch would copy to the device with a wait at every group."""
    from alignpipe import linear_sequence_loss as module

    copies = []
    monkeypatch.setattr(module, "to_device", lambda t, device: copies.append(t.clone()) or t)
    got = module._group_indices([[0, 2], [1], []], [3, 0, 2], torch.device("cpu"))
    assert len(copies) == 1
    assert [(rows.tolist(), local.tolist()) for rows, local in got] == [
        ([0, 2], [0, 0, 0, 1, 1]),
        ([1], []),
        ([], []),
    ]
    seen = []
    hidden = torch.randn(5, 4, dtype=torch.float64)
    weight = torch.randn(7, 4, dtype=torch.float64)
    labels = torch.tensor([1, 2, 3, 4, 5])
    module.linear_sequence_loss(
        hidden, weight, None, labels, [3, 0, 2], [[0, 2], [1]], lambda s, rows: seen.append(rows) or -s.sum()
    )
    assert all(isinstance(rows, torch.Tensor) and rows.dtype == torch.long for rows in seen)
