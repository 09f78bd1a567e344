"""`model.attention: auto` (the default): the varlen kernel where it pays and is known exact, SDPA elsewhere; and the
kernel's first call of each kind checked against the documents run one by one."""

from __future__ import annotations

import functools
import logging

import pytest
import torch
from support import demo_recipe

from alignpipe import attention
from alignpipe.modeling import load_causal_lm, load_sequence_scorer
from alignpipe.tracking import Tracker

PER_DOCUMENT = attention._per_document  # the one-by-one path, kept from the tests' patching


def small(config_class, **overrides):
    """A two-layer model of `config_class` in bf16 (no weights loaded)."""
    from transformers import AutoModelForCausalLM

    fields = (
        dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4)
        | overrides
    )
    if config_class.__name__ == "GPT2Config":
        fields = dict(vocab_size=64, n_embd=32, n_layer=2, n_head=4)
    return AutoModelForCausalLM.from_config(config_class(**fields), dtype=torch.bfloat16)


def test_auto_runs_varlen_on_cuda_bf16_for_the_families_it_knows_and_sdpa_elsewhere(tiny, monkeypatch, caplog):
    """Without a CUDA device `auto` is SDPA; with one (here pretended: the model still runs on CPU, through the
    one-by-one path) bf16 and fp16 Llama-family weights get `varlen`, the causal LM and the sequence scorer alike,
    while float32 weights, sliding-window layers, attention dropout, other families and a torch without the kernel
    keep SDPA. The log names the pick and why."""
    from transformers import GPT2Config, LlamaConfig, MistralConfig, Qwen2Config

    from alignpipe import modeling

    path = str(tiny / "model")
    assert load_causal_lm(path, "bfloat16", attention="auto").config._attn_implementation == "sdpa"
    assert attention.choose(small(LlamaConfig)) == ("sdpa", "no CUDA device")

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    modeling._log_choice.cache_clear()
    with caplog.at_level(logging.INFO, logger="alignpipe.modeling"):
        model = load_causal_lm(path, "bfloat16", attention="auto")
    assert model.config._attn_implementation == "varlen"
    assert "model.attention: auto runs varlen (CUDA, bf16/fp16, full attention)" in caplog.text
    assert load_sequence_scorer(path, "float16", attention="auto").config._attn_implementation == "varlen"
    assert load_causal_lm(path, "float32", attention="auto").config._attn_implementation == "sdpa"
    assert load_causal_lm(path, "bfloat16", attention="sdpa").config._attn_implementation == "sdpa"

    assert attention.choose(small(Qwen2Config))[0] == "varlen"
    assert attention.choose(small(Qwen2Config, use_sliding_window=True, sliding_window=16))[0] == "sdpa"
    assert attention.choose(small(MistralConfig)) == ("sdpa", "sliding-window layers")
    assert attention.choose(small(MistralConfig, sliding_window=None))[0] == "varlen"
    assert attention.choose(small(LlamaConfig, attention_dropout=0.1)) == ("sdpa", "attention dropout 0.1")
    assert attention.choose(small(GPT2Config))[1].startswith("model type 'gpt2'")
    monkeypatch.setattr(attention, "kernel_available", lambda: False)
    assert "has no torch.nn.attention.varlen" in attention.choose(small(LlamaConfig))[1]

    # the packed SFT rows an `auto` model trains on run exactly as under SDPA (here: one by one on CPU)
    monkeypatch.undo()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    from alignpipe.trainers import sft

    ids = torch.randint(0, 500, (40,)).tolist()
    blocks = sft.pack([{"input_ids": ids[:15], "labels": ids[:15]}, {"input_ids": ids[15:], "labels": ids[15:]}], 48)
    batch = sft.collate(blocks, 0)
    losses = {}
    for name in ("auto", "sdpa"):
        losses[name] = float(sft.token_loss_sum(load_causal_lm(path, "float32", attention=name), batch)[0].detach())
        model = load_causal_lm(path, "bfloat16", attention=name)
        losses[name + "-bf16"] = float(sft.token_loss_sum(model, batch)[0].detach())
    assert losses["auto"] == losses["sdpa"]
    assert losses["auto-bf16"] == pytest.approx(losses["sdpa-bf16"], rel=1e-2)


def test_a_recipe_defaults_to_auto_and_every_stage_model_follows_it(tiny, tmp_path):
    from alignpipe.recipe import parse_recipe
    from alignpipe.stages.context import StageContext

    recipe = parse_recipe(demo_recipe(tiny, tmp_path))
    assert recipe.model.attention == "auto"
    ctx = StageContext(recipe, recipe.stage("sft"), tmp_path, {}, Tracker())
    assert ctx.load_model("base").config._attn_implementation == "sdpa"  # float32 on CPU


def documents_through_sdpa(q, k, v, cu_q, cu_k, max_q, max_k, *, scale=None, window_size=(-1, -1), enable_gqa=False):
    """A stand-in for torch's `varlen_attn` (2.13's keywords) that runs each document causally at the bottom right,
    as the kernel does."""
    assert window_size == (-1, 0)
    return PER_DOCUMENT(q, k, v, cu_q, cu_k, scale)


def documents_unmasked(q, k, v, cu_q, cu_k, max_q, max_k, *, scale=None, window_size=(-1, -1), enable_gqa=False):
    """A kernel that ignores causality: what a release reading `window_size` otherwise would do."""
    pieces = []
    for a, b, c, d in attention._segments(cu_q, cu_k):
        qd, kd, vd = (t[x:y].transpose(0, 1) for t, x, y in ((q, a, b), (k, c, d), (v, c, d)))
        pieces.append(torch.nn.functional.scaled_dot_product_attention(qd, kd, vd, scale=scale, enable_gqa=True))
    return torch.cat([p.transpose(0, 1) for p in pieces])


def test_the_kernels_first_call_of_each_kind_is_checked_and_a_wrong_kernel_is_replaced(monkeypatch, caplog):
    """A kernel that agrees with the one-by-one documents is checked once per kind (self-attending documents, shared
    key documents) and then trusted; one that does not (here: no causal mask) is reported once and not called
    again, the documents running one by one from that call on, gradients included."""
    torch.manual_seed(0)
    q, k, v = torch.randn(11, 4, 8), torch.randn(11, 2, 8), torch.randn(11, 2, 8)
    cu, cu_k = torch.tensor([0, 3, 9, 11], dtype=torch.int32), torch.tensor([0, 3, 9, 11], dtype=torch.int32)
    want = attention._per_document(q, k, v, cu, cu, 0.3)
    references = []

    def counted(*a):
        references.append(1)
        return PER_DOCUMENT(*a)

    monkeypatch.setattr(attention, "_per_document", counted)
    monkeypatch.setattr(attention, "KERNEL_VERDICTS", {})
    for _ in range(3):
        torch.testing.assert_close(attention._kernel_call(documents_through_sdpa, q, k, v, cu, cu, 6, 6, 0.3), want)
    attention._kernel_call(documents_through_sdpa, q, k, v, cu, cu_k, 6, 6, 0.3)  # separate key documents
    assert attention.KERNEL_VERDICTS == {"self": True, "keys": True}
    assert len(references) == 2  # the check's, at the first call of each kind

    monkeypatch.setattr(attention, "KERNEL_VERDICTS", {})
    kernel_calls = []

    @functools.wraps(documents_unmasked)  # its signature: the keywords `_call_varlen` passes
    def wrong(*a, **kw):
        kernel_calls.append(1)
        return documents_unmasked(*a, **kw)

    qg = q.clone().requires_grad_()
    with caplog.at_level(logging.WARNING, logger="alignpipe.attention"):
        for _ in range(3):
            out = attention._kernel_call(wrong, qg, k, v, cu, cu, 6, 6, 0.3)
            torch.testing.assert_close(out, want)
    assert attention.KERNEL_VERDICTS == {"self": False} and len(kernel_calls) == 1
    assert len(caplog.records) == 1 and "one by one through SDPA instead" in caplog.text
    qr = q.clone().requires_grad_()
    (grad,), (want_grad,) = (
        torch.autograd.grad(x.sum(), y) for x, y in ((out, qg), (PER_DOCUMENT(qr, k, v, cu, cu, 0.3), qr))
    )
    torch.testing.assert_close(grad, want_grad)
