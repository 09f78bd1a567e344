"""SFT's fused LM-head cross-entropy (`linear_ce`): its value and the gradients it forms in the forward equal autograd
through full logits, chunked or whole, with a bias or without, with the head frozen, and scaled by whatever the loss
is multiplied by afterwards; SFT's loss through it equals the summed log-probs of `token_logprobs`."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from support import known, matmuls

from alignpipe.compiled import chunk_bounds, compiled_function
from alignpipe.linear_ce import _nll_and_grad, _nll_and_grad_fusable, linear_nll_sum


def reference(hidden, weight, bias, labels):
    return F.cross_entropy(F.linear(hidden, weight, bias), labels, reduction="sum")


@pytest.mark.parametrize("rows_per_chunk", [1, 7, 64], ids=["row-by-row", "chunked", "whole"])
@pytest.mark.parametrize("with_bias", [False, True])
def test_value_and_gradients_equal_autograd_through_full_logits(rows_per_chunk, with_bias):
    g = torch.Generator().manual_seed(0)
    N, d, V = 40, 16, 97
    hidden = torch.randn(N, d, generator=g, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(V, d, generator=g, dtype=torch.float64, requires_grad=True)
    bias = torch.randn(V, generator=g, dtype=torch.float64, requires_grad=True) if with_bias else None
    labels = torch.randint(0, V, (N,), generator=g)
    inputs = [t for t in (hidden, weight, bias) if t is not None]

    expected = reference(hidden, weight, bias, labels)
    want = torch.autograd.grad(expected * 0.37, inputs)
    got = linear_nll_sum(hidden, weight, bias, labels, rows_per_chunk)
    grads = torch.autograd.grad(got * 0.37, inputs)  # the upstream gradient scales what the forward formed
    assert got.dtype == torch.float64 and float(got.detach()) == pytest.approx(float(expected.detach()), rel=1e-12)
    for a, b in zip(grads, want):
        assert a.dtype == b.dtype and torch.allclose(a, b, atol=1e-10), (a - b).abs().max()


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_dft_weights_each_token_by_its_probability_held_constant(compiled):
    """`dft` (Dynamic Fine-Tuning): the value Σ p·NLL and the gradient of −Σ sg(p)·log p, as autograd gives them
    through full logits; under no_grad the same value."""
    g = torch.Generator().manual_seed(2)
    N, d, V = 30, 16, 61
    hidden = torch.randn(N, d, generator=g, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(V, d, generator=g, dtype=torch.float64, requires_grad=True) * 0.3
    weight = weight.detach().requires_grad_(True)
    labels = torch.randint(0, V, (N,), generator=g)
    logp = torch.log_softmax(F.linear(hidden, weight), -1).gather(-1, labels[:, None]).squeeze(-1)
    expected = -(logp * logp.detach().exp()).sum()
    want = torch.autograd.grad(expected, (hidden, weight))
    got = linear_nll_sum(hidden, weight, None, labels, 7, compiled=compiled, dft=True)
    grads = torch.autograd.grad(got, (hidden, weight))
    assert float(got.detach()) == pytest.approx(float(expected.detach()), rel=1e-10)
    for a, b in zip(grads, want):
        assert torch.allclose(a, b, atol=1e-10), (a - b).abs().max()
    with torch.no_grad():
        assert float(linear_nll_sum(hidden, weight, None, labels, 7, dft=True)) == pytest.approx(
            float(expected), rel=1e-10
        )
    assert float(got) < float(linear_nll_sum(hidden, weight, None, labels, 7).detach()), "p < 1 shrinks every term"


def test_a_frozen_head_and_no_grad_form_no_gradients():
    g = torch.Generator().manual_seed(1)
    hidden = torch.randn(9, 8, generator=g, requires_grad=True)
    weight = torch.randn(31, 8, generator=g)  # frozen (a LoRA run's head)
    labels = torch.randint(0, 31, (9,), generator=g)
    got = linear_nll_sum(hidden, weight, None, labels, 4)
    assert got.dtype == torch.float32
    got.backward()
    expected_h = hidden.detach().clone().requires_grad_(True)
    reference(expected_h, weight, None, labels).backward()
    assert weight.grad is None and torch.allclose(known(hidden.grad), known(expected_h.grad), atol=1e-6)
    with torch.no_grad():
        assert float(linear_nll_sum(hidden, weight, None, labels, 4)) == pytest.approx(float(got.detach()), rel=1e-6)


def test_evaluation_under_no_grad_runs_the_head_once_per_chunk():
    """With gradients off (an evaluation) the head's gradients are not formed: one matmul per chunk, not three."""
    g = torch.Generator().manual_seed(3)
    hidden = torch.randn(12, 8, generator=g, requires_grad=True)
    weight = torch.randn(31, 8, generator=g, requires_grad=True)
    labels = torch.randint(0, 31, (12,), generator=g)
    assert matmuls(lambda: linear_nll_sum(hidden, weight, None, labels, 4)) == 9
    with torch.no_grad():
        assert matmuls(lambda: linear_nll_sum(hidden, weight, None, labels, 4)) == 3


def test_bf16_gradients_stay_close_to_float32():
    """On a GPU the head and hidden states are bf16: the logits' softmax is taken in float32, the matmuls in bf16."""
    g = torch.Generator().manual_seed(2)
    hidden = torch.randn(64, 32, generator=g)
    weight = torch.randn(211, 32, generator=g) / 4
    labels = torch.randint(0, 211, (64,), generator=g)
    h32, w32 = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    reference(h32, w32, None, labels).backward()
    h16, w16 = hidden.bfloat16().requires_grad_(True), weight.bfloat16().requires_grad_(True)
    linear_nll_sum(h16, w16, None, labels, 16).backward()
    assert known(h16.grad).dtype == torch.bfloat16 and known(w16.grad).dtype == torch.bfloat16
    for low, high in ((known(h16.grad), known(h32.grad)), (known(w16.grad), known(w32.grad))):
        assert float((low.float() - high).norm() / high.norm()) < 2e-2


@pytest.mark.parametrize("host_count", [False, True], ids=["counted-on-device", "counted-on-host"])
@pytest.mark.parametrize("whole_max", [64, 10**9], ids=["chunked", "whole"])
def test_sft_loss_equals_the_summed_token_logprobs(tiny, monkeypatch, whole_max, host_count):
    """`token_nll_sum` (SFT's loss) against −Σ `token_logprobs` on the scored positions of a padded batch: value and
    the gradient of every parameter; the scored positions gathered by a boolean index or, with the count `collate`
    makes on the host, without reading the device."""
    from alignpipe import logprobs
    from alignpipe.logprobs import token_logprobs, token_nll_sum
    from alignpipe.modeling import load_causal_lm

    monkeypatch.setattr(logprobs, "WHOLE_LOGITS_MAX", whole_max * 512)  # 64 rows of the tiny model's vocabulary
    model = load_causal_lm(str(tiny / "model"))
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(2, 500, (4, 50), generator=g)
    mask = torch.ones_like(ids)
    mask[1, 30:] = 0
    only = mask[:, 1:].bool()
    only[:, :5] = False  # a prompt is not scored
    params = [p for p in model.parameters() if p.requires_grad]

    def loss_and_grads(fn):
        model.zero_grad()
        loss = fn()
        loss.backward()
        return loss.detach(), [p.grad.clone() for p in params]

    count = int(only.sum()) if host_count else None
    fused, fused_grads = loss_and_grads(lambda: token_nll_sum(model, ids, mask, only, count=count))
    plain, plain_grads = loss_and_grads(lambda: -(token_logprobs(model, ids, mask, only=only)).sum())
    assert float(fused) == pytest.approx(float(plain), rel=1e-6)
    for a, b in zip(fused_grads, plain_grads):
        assert float((a - b).norm() / b.norm().clamp(min=1e-12)) < 1e-5


def test_the_compiled_chunk_kernel_takes_larger_chunks(tiny, monkeypatch):
    """With the compiled chunk kernel (`fused_kernels` on a GPU, `compile: true`) SFT's head runs chunks
    `FUSED_CHUNK_GROWTH` times larger than the eager head's (no float32 copy of a chunk's logits to bound), so each
    step reads the head's weight and its gradient fewer times; the loss is the same (the chunking is tested
    above)."""
    from alignpipe import logprobs
    from alignpipe.modeling import load_causal_lm

    monkeypatch.setattr(logprobs, "WHOLE_LOGITS_MAX", 16 * 512)  # 16 rows of the tiny model's vocabulary
    chunks: list[int] = []
    real: Any = logprobs.linear_nll_sum  # Any: the spy passes it a slice of its own *args
    monkeypatch.setattr(logprobs, "linear_nll_sum", lambda *a: chunks.append(a[4]) or real(*a[:5], False))
    model = load_causal_lm(str(tiny / "model"))
    ids = torch.randint(2, 500, (2, 40), generator=torch.Generator().manual_seed(5))
    only = torch.ones(2, 39, dtype=torch.bool)
    mask = torch.ones_like(ids)
    losses = [float(logprobs.token_nll_sum(model, ids, mask, only, compiled=c).detach()) for c in (False, True)]
    assert chunks == [16, 16 * logprobs.FUSED_CHUNK_GROWTH] and logprobs.FUSED_CHUNK_GROWTH > 1
    assert losses[1] == pytest.approx(losses[0], rel=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_compiled_chunk_kernel_gives_the_eager_softmax_and_gradient(dtype):
    """`compile: true`: each chunk's NLL and softmax − one-hot come from one compiled kernel (inductor's CPU code
    here), equal to the eager passes; the gradient in the logits' dtype. Chunks of different rows share it."""
    g = torch.Generator().manual_seed(4)
    for rows in (37, 64):
        logits = (torch.randn(rows, 501, generator=g) * 3).to(dtype)
        labels = torch.randint(0, 501, (rows,), generator=g)
        nll, grad = compiled_function(_nll_and_grad_fusable)(logits, labels, torch.float32)
        want_nll, want_grad = _nll_and_grad(logits.clone(), labels, torch.float32)
        assert grad.dtype == dtype and float(nll) == pytest.approx(float(want_nll), rel=1e-6)
        assert torch.allclose(grad.float(), want_grad.to(dtype).float(), atol=1e-6 if dtype == torch.float32 else 1e-2)
    hidden = torch.randn(50, 16, generator=g, requires_grad=True)
    weight = torch.randn(97, 16, generator=g, requires_grad=True)
    labels = torch.randint(0, 97, (50,), generator=g)
    eager = torch.autograd.grad(linear_nll_sum(hidden, weight, None, labels, 7), (hidden, weight))
    fused = torch.autograd.grad(linear_nll_sum(hidden, weight, None, labels, 7, compiled=True), (hidden, weight))
    for a, b in zip(fused, eager):
        assert torch.allclose(a, b, atol=1e-6)


@pytest.mark.parametrize("size", [2, 3, 4, 7])
def test_chunk_bounds_cover_the_items_in_order_and_never_leave_one_alone(size):
    for n in range(0, 30):
        bounds = chunk_bounds(n, size)
        assert [i for s, e in bounds for i in range(s, e)] == list(range(n))
        assert all(e - s <= size for s, e in bounds[:-1]) and all(e - s <= size + 1 for s, e in bounds[-1:])
        assert n == 1 or all(e - s > 1 for s, e in bounds), (n, bounds)


def test_a_last_row_alone_compiles_no_chunk_kernel_again():
    """Dynamo specialises a dimension of size 1, so a batch whose token count left one row for the last chunk
    compiled the chunk kernels again mid-training (SFT's fused head; the scoring passes' log-softmax, whose chunks
    are positions). That row now joins the chunk before it; the values are unchanged."""
    from alignpipe import logprobs

    g = torch.Generator().manual_seed(6)
    d, V = 16, 97
    weight = torch.randn(V, d, generator=g, requires_grad=True)

    def sft_head(n):
        hidden = torch.randn(n, d, generator=g, requires_grad=True)
        labels = torch.randint(0, V, (n,), generator=g)
        got = torch.autograd.grad(linear_nll_sum(hidden, weight, None, labels, 4, compiled=True), (hidden, weight))
        want = torch.autograd.grad(reference(hidden, weight, None, labels), (hidden, weight))
        for a, b in zip(got, want, strict=True):
            assert torch.allclose(a, b, atol=1e-5)

    def scoring_pass(t):
        hidden, labels = torch.randn(1, t, d, generator=g), torch.randint(0, V, (1, t), generator=g)
        with torch.no_grad():
            got = logprobs._head_logprobs(hidden, weight, None, labels, 1.0, 4, False, compiled=True)
            want = F.linear(hidden, weight).log_softmax(-1).gather(-1, labels[..., None]).squeeze(-1)
        assert torch.allclose(got, want, atol=1e-5)

    torch._dynamo.reset()
    stats = torch._dynamo.utils.counters["stats"]
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(logprobs, "WHOLE_LOGITS_MAX", 4 * V)  # chunks of 4 positions
        sft_head(10)  # chunks of 4, 4 and 2 rows
        scoring_pass(10)
        compiled = stats["unique_graphs"]
        assert compiled > 0
        sft_head(9)  # 4 and 5, not 4, 4 and 1
        scoring_pass(13)
    assert stats["unique_graphs"] == compiled, "a one-row chunk compiled a kernel again"
