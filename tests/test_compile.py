"""`compile: true`: each decoder layer compiled in place, the same training as eager (inductor on CPU here; the
speed it buys is a GPU figure, docs/benchmarks.md)."""

from __future__ import annotations

import logging

import pytest
import torch
from support import tiny_split

from alignpipe.compiled import compile_layers, compiled_function, decoder_layers
from alignpipe.modeling import load_causal_lm
from alignpipe.tracking import Tracker
from alignpipe.trainers import sft
from alignpipe.trainers.configs import GRPOConfig, RolloutSpec, SFTConfig


def packed_sft_series(tiny, out, attention: str, compiled: bool, steps: int):
    """(losses, gradient norms) of a short packed SFT run on `attention`, compiled or eager."""
    tok, train, _ = tiny_split(tiny, "sentiment_sft", "prompt_completion", rows=200, max_length=64)
    torch.manual_seed(0)
    model = load_causal_lm(str(tiny / "model"), attention=attention)
    tracker = Tracker()
    cfg = SFTConfig(
        learning_rate=1e-3,
        max_steps=steps,
        batch_size=4,
        logging_every=1,
        packing=True,
        max_length=128,
        compile=compiled,
    )
    sft.train(cfg, model, tok, train, [], tracker, out / f"{attention}-{compiled}")
    assert all((layer._compiled_call_impl is not None) == compiled for layer in decoder_layers(model))
    return tracker.series("train/loss"), tracker.series("train/grad_norm")


def test_a_compiled_sft_run_trains_as_the_eager_one(tiny, tmp_path):
    """Packed rows (positions restarting per row) through compiled layers: the same losses and gradient norms."""
    (eager_loss, eager_norm), (loss, norm) = (packed_sft_series(tiny, tmp_path, "sdpa", c, 3) for c in (False, True))
    assert loss == pytest.approx(eager_loss, rel=1e-5) and norm == pytest.approx(eager_norm, rel=1e-4)


def test_a_compiled_varlen_sft_run_trains_as_the_eager_one_and_as_sdpa(tiny, tmp_path):
    """`model.attention: varlen` with `compile: true`: packed rows through compiled layers whose attention takes the
    documents `collate` counted; the same losses and gradient norms as eager varlen and as SDPA's mask."""
    runs = (("sdpa", False), ("varlen", False), ("varlen", True))
    series = {run: packed_sft_series(tiny, tmp_path, *run, 4) for run in runs}
    for key in (("varlen", False), ("sdpa", False)):
        assert series["varlen", True][0] == pytest.approx(series[key][0], rel=1e-5), key
        assert series["varlen", True][1] == pytest.approx(series[key][1], rel=1e-4), key


def test_the_decoder_stack_is_found_and_compiled_in_place(tiny):
    model = load_causal_lm(str(tiny / "model"))
    keys = list(model.state_dict())
    assert compile_layers(model) == model.config.num_hidden_layers
    assert list(model.state_dict()) == keys, "checkpoints and saved models keep their names"
    with pytest.raises(ValueError, match="no stack of decoder layers"):
        compile_layers(torch.nn.Linear(2, 2))


def test_online_stages_refuse_compile():
    with pytest.raises(ValueError, match="compile: true is for offline stages"):
        GRPOConfig(compile=True)


def test_compiled_rollouts_are_an_hf_engine_option():
    assert RolloutSpec(compile=True).compile
    with pytest.raises(ValueError, match="options of the hf engine"):
        RolloutSpec(backend="vllm", compile=True)


@pytest.mark.parametrize("whole_max", [64 * 512, 10**9], ids=["chunked", "whole"])
def test_compiled_head_chunks_give_the_eager_logprobs_and_gradients(tiny, monkeypatch, whole_max):
    """`compile: true` on DPO and KTO: each chunk of the LM head (log-softmax, gather, their backward) runs compiled,
    under the chunks' activation checkpointing too; values and every gradient equal eager."""
    from alignpipe import logprobs
    from alignpipe.logprobs import token_logprobs

    monkeypatch.setattr(logprobs, "WHOLE_LOGITS_MAX", whole_max)
    model = load_causal_lm(str(tiny / "model"))
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(2, 500, (3, 40), generator=g)
    mask = torch.ones_like(ids)
    mask[2, :6] = 0
    only = mask[:, 1:].bool()
    params = [p for p in model.parameters() if p.requires_grad]
    results = {}
    for compiled in (False, True):
        model.zero_grad()
        logps = token_logprobs(model, ids, mask, temperature=0.9, only=only, compiled=compiled)
        (logps * torch.linspace(-1, 1, logps.size(1))).sum().backward()
        results[compiled] = logps.detach(), [p.grad.clone() for p in params]
    assert torch.allclose(results[True][0], results[False][0], atol=1e-5)
    for a, b in zip(results[True][1], results[False][1]):
        assert float((a - b).norm() / b.norm().clamp(min=1e-12)) < 1e-5


@pytest.mark.parametrize("attention", ["sdpa", "varlen"])
def test_a_compiled_dpo_run_trains_as_the_eager_one(tiny, tmp_path, attention):
    """DPO with `compile: true` (layers and, with `fused_loss: false`, the head's chunks compiled; the reference's
    layers compiled too, `frozen_reference`): the same losses and gradient norms as eager. On varlen the batches run
    padding-free, one row of documents whose length and count change every batch: every graph is compiled in the
    first step (the reference's no-grad pass is one of its own), none after it."""
    import copy

    from alignpipe.compiled import decoder_layers
    from alignpipe.trainers import dpo
    from alignpipe.trainers.configs import DPOConfig

    class Graphs(Tracker):  # the graphs compiled so far, at each step's log
        def log_metrics(self, metrics: dict, step: int) -> None:
            graphs.append(torch._dynamo.utils.counters["stats"]["unique_graphs"])
            super().log_metrics(metrics, step)

    tok, train, _ = tiny_split(tiny, "sentiment_preferences", "preference", rows=80, max_length=64)
    series = {}
    for compiled in (False, True):
        model = load_causal_lm(str(tiny / "model"), attention=attention)
        ref = copy.deepcopy(model)
        tracker, graphs = Graphs(), list[int]()
        cfg = DPOConfig(
            learning_rate=1e-3, max_steps=3, batch_size=4, logging_every=1, compile=compiled, fused_loss=False
        )
        torch._dynamo.reset()
        before = torch._dynamo.utils.counters["stats"]["unique_graphs"]
        dpo.train(cfg, model, tok, train, [], tracker, tmp_path / str(compiled), ref_model=ref)
        series[compiled] = tracker.series("train/loss"), tracker.series("train/grad_norm")
        assert all((layer._compiled_call_impl is not None) == compiled for layer in decoder_layers(ref))
        assert len(set(graphs)) == 1 and (graphs[0] > before) == compiled, graphs  # nothing compiled after step 1
    (eager_loss, eager_norm), (loss, norm) = series[False], series[True]
    assert loss == pytest.approx(eager_loss, rel=1e-5) and norm == pytest.approx(eager_norm, rel=1e-4)


@pytest.mark.parametrize("attention", ["sdpa", "varlen"])
def test_batches_of_new_lengths_and_document_counts_do_not_recompile(tiny, tmp_path, attention):
    """Packed blocks' lengths, their documents' count and the offsets change every batch: the layers compile once,
    with those sizes symbolic from the first batch (a recompile in the middle of a GPU run costs seconds; on the
    first H100 run it fell inside the timed steps). Under `varlen` off the CUDA kernel the documents run as one op,
    as the kernel does, so this checks on CPU the graph a GPU compiles."""
    torch._dynamo.reset()
    with torch._dynamo.config.patch(error_on_recompile=True):
        losses, _ = packed_sft_series(tiny, tmp_path, attention, True, 5)
    assert len(losses) == 5


def test_a_kernel_the_compiler_cannot_build_runs_eagerly_and_says_so_once(monkeypatch, caplog):
    """Where `fused_kernels.available` passed on the hand-written kernels alone, the compiler is first met by a
    kernel compiled later; if it fails there (a device with no working Triton), the kernel runs eagerly, said once,
    and is not compiled again at every call."""
    real = torch.compile
    tries = []

    def no_triton(graph, example_inputs):
        tries.append(graph)
        raise RuntimeError("Cannot find a working triton installation")

    monkeypatch.setattr(torch, "compile", lambda fn, **kw: real(fn, backend=no_triton, **kw))

    def scaled_shift(x):
        return x * 2 + 1

    kernel = compiled_function(scaled_shift)
    assert not tries, "nothing is compiled before the first call"
    x = torch.arange(6.0)
    with caplog.at_level(logging.WARNING, logger="alignpipe.compiled"):
        assert torch.equal(kernel(x), x * 2 + 1)
        assert torch.equal(kernel(x + 1), x * 2 + 3)
    assert len(tries) == 1, "tried once, then eager"
    said = [r.getMessage() for r in caplog.records if r.name == "alignpipe.compiled"]
    assert len(said) == 1 and "scaled_shift" in said[0] and "working triton" in said[0], said


def test_a_compiled_kernel_compiles_at_its_first_call_and_keeps_its_graph():
    torch._dynamo.reset()
    stats = torch._dynamo.utils.counters["stats"]

    def halved(x):
        return x / 2

    kernel = compiled_function(halved)
    before = stats["unique_graphs"]
    for n in (5, 7, 9):
        assert torch.equal(kernel(torch.arange(float(n))), torch.arange(float(n)) / 2)
    assert stats["unique_graphs"] == before + 1 and compiled_function(halved) is kernel
