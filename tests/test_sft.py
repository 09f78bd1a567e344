"""Our SFT trainer on the tiny model: it learns, LoRA saves an adapter, a re-run resumes."""

from __future__ import annotations

import itertools
import json

import pytest
import torch
from support import assert_packed_equals_alone, known, loss_and_grads, tiny_split

from alignpipe.modeling import is_adapter_dir, load_causal_lm
from alignpipe.tracking import Tracker
from alignpipe.trainers import sft
from alignpipe.trainers.configs import LoraSpec, SFTConfig


@pytest.fixture(scope="module")
def data(tiny):
    return tiny_split(tiny, "sentiment_sft", "prompt_completion", rows=800, max_length=64)


def test_sft_loss_falls_by_at_least_half(tiny, data, tmp_path):
    tok, train, evals = data
    tracker = Tracker()
    cfg = SFTConfig(learning_rate=1e-3, max_steps=80, batch_size=16, logging_every=5, warmup_ratio=0.05)
    result = sft.train(cfg, load_causal_lm(str(tiny / "model")), tok, train, evals, tracker, tmp_path)
    losses = tracker.series("train/loss")
    assert losses[-1] <= 0.5 * losses[0], losses
    assert result.metrics["eval/loss"] < 0.5 * losses[0]
    assert tracker.series("train/tokens_per_s")[-1] > 0 and tracker.last("train/lr") is not None
    reloaded = load_causal_lm(str(result.model_dir))
    assert sum(p.numel() for p in reloaded.parameters()) > 1_000_000


def test_lora_sft_saves_only_the_adapter(tiny, data, tmp_path):
    tok, train, evals = data
    cfg = SFTConfig(learning_rate=5e-3, max_steps=10, batch_size=8, lora=LoraSpec(r=4, alpha=8))
    tracker = Tracker()
    result = sft.train(cfg, load_causal_lm(str(tiny / "model")), tok, train, evals, tracker, tmp_path)
    files = {p.name for p in result.model_dir.iterdir()}
    assert result.adapter and is_adapter_dir(result.model_dir)
    assert "adapter_model.safetensors" in files and "model.safetensors" not in files
    assert tracker.params["model.trainable_params"] < 0.2 * tracker.params["model.total_params"]
    assert tracker.params["model.attention"] == "sdpa" and tracker.params["model.fused_kernels"] is False
    merged = load_causal_lm(str(tiny / "model"), adapter=str(result.model_dir), merge=True)
    base = load_causal_lm(str(tiny / "model"))
    diff = sum(float((a - b).abs().sum().detach()) for a, b in zip(merged.parameters(), base.parameters()))
    assert diff > 0, "the merged adapter changes the weights"


def test_training_and_generation_leave_cudnn_attention_out(tiny, data, tmp_path):
    """cuDNN's attention builds a plan per new shape on the host (docs/benchmarks.md); trainers and the engine run
    their forwards with it switched off, and restore the setting afterwards."""
    from alignpipe.engine.hf import HFEngine
    from alignpipe.engine.sampling import SamplingParams
    from alignpipe.judges.reward_model import RewardModelScorer

    tok, train, evals = data
    model = load_causal_lm(str(tiny / "model"))
    seen = []
    model.get_decoder().register_forward_pre_hook(lambda *_: seen.append(torch.backends.cuda.cudnn_sdp_enabled()))
    before = torch.backends.cuda.cudnn_sdp_enabled()
    sft.train(SFTConfig(max_steps=1, batch_size=4), model, tok, train[:8], evals[:4], Tracker(), tmp_path)
    trained = len(seen)
    HFEngine(model, tok).generate(["good"], sampling=SamplingParams(max_new_tokens=2))
    generated = len(seen)
    scorer = RewardModelScorer(str(tiny / "model"))
    scorer.model.register_forward_pre_hook(lambda *_: seen.append(torch.backends.cuda.cudnn_sdp_enabled()))
    scorer(["good"], [" day"])
    assert 0 < trained < generated < len(seen) and not any(seen)
    assert torch.backends.cuda.cudnn_sdp_enabled() == before


def test_activation_checkpointing_trains_the_same_steps(tiny, data, tmp_path):
    """`gradient_checkpointing: true` (the real-size recipes set it) recomputes activations in the backward: same
    losses as without, through transformers' current API (no deprecation warning)."""
    import warnings

    from alignpipe.modeling import is_activation_checkpointing

    tok, train, _ = data
    losses = {}
    for on in (False, True):
        model, tracker = load_causal_lm(str(tiny / "model")), Tracker()
        cfg = SFTConfig(max_steps=3, batch_size=4, logging_every=1, gradient_checkpointing=on)
        with warnings.catch_warnings():
            warnings.simplefilter("error", FutureWarning)
            sft.train(cfg, model, tok, train[:12], [], tracker, tmp_path / str(on))
        assert is_activation_checkpointing(model) == on
        losses[on] = tracker.series("train/loss")
    assert losses[True] == pytest.approx(losses[False], rel=1e-4)


def test_completion_only_loss_masks_prompt_tokens(data):
    tok, train, _ = data
    ex = sft.tokenize(train[:1], tok, 64, completion_only=True)[0]
    n_prompt = len(tok(train[0]["prompt"])["input_ids"])
    assert ex["labels"][:n_prompt] == [sft.IGNORE] * n_prompt
    assert ex["labels"][n_prompt:] == ex["input_ids"][n_prompt:] and ex["input_ids"][-1] == tok.eos_token_id
    rows = sft.tokenize(train[:50], tok, 64, True)
    wrapped = sft.pack(rows, 64, "wrapped")
    assert all(len(b["input_ids"]) == 64 for b in wrapped[:-1])
    packed = sft.pack(rows, 64)  # bfd: whole rows, none split, no block over max_length
    assert all(len(b["input_ids"]) <= 64 for b in packed) and sum(len(b["labels"]) for b in packed) == sum(
        len(r["labels"]) for r in rows
    )


CONVERSATION = [
    {"role": "user", "content": "hi"},
    {"role": "assistant", "content": "yo"},
    {"role": "user", "content": "and?"},
    {"role": "assistant", "content": "done"},
]


def test_assistant_only_loss_trains_every_reply_of_a_conversation_and_nothing_else(tiny):
    """A two-reply conversation formatted as language_modeling: the labelled tokens are exactly both replies with the
    end-of-turn after each (the user turns and the template's role markers are -100), as TRL's assistant_only_loss."""
    from alignpipe.data.formats import format_rows
    from alignpipe.modeling import load_tokenizer

    tok = load_tokenizer(str(tiny / "model"))
    rows, _, _ = format_rows([{"messages": CONVERSATION}], fmt="language_modeling", tokenizer=tok, eval_fraction=0)
    (row,) = rows
    assert [row["text"][a:b] for a, b in row["assistant_spans"]] == ["yo<|end|>", "done<|end|>"]
    (ex,) = sft.tokenize(rows, tok, 64, completion_only=True, assistant_only=True)
    assert ex["input_ids"] == sft.tokenize(rows, tok, 64, completion_only=True)[0]["input_ids"], "same tokens"
    trained = [t for t, label in zip(ex["input_ids"], ex["labels"]) if label != sft.IGNORE]
    assert tok.decode(trained) == "yo<|end|>done<|end|>"
    assert [label for label in ex["labels"] if label != sft.IGNORE] == trained
    (plain,) = sft.tokenize(rows, tok, 64, completion_only=True)
    assert sft.IGNORE not in plain["labels"], "without it, every token trains"
    with pytest.raises(ValueError, match="assistant_only_loss needs conversations"):
        sft.tokenize([{"text": "plain text"}], tok, 64, completion_only=True, assistant_only=True)


def test_assistant_only_loss_runs_and_is_checked_against_the_data_format(tiny, tmp_path):
    from alignpipe.data.formats import format_rows
    from alignpipe.modeling import load_tokenizer
    from alignpipe.recipe import parse_recipe
    from alignpipe.recipe.errors import RecipeError

    tok = load_tokenizer(str(tiny / "model"))
    convos = [{"messages": [CONVERSATION[0], {"role": "assistant", "content": "yo " * (1 + i % 3)}]} for i in range(16)]
    rows, _, _ = format_rows(convos, fmt="language_modeling", tokenizer=tok, eval_fraction=0)
    cfg = SFTConfig(max_steps=3, batch_size=4, assistant_only_loss=True, packing=True, max_length=64, logging_every=1)
    result = sft.train(cfg, load_causal_lm(str(tiny / "model")), tok, rows, [], Tracker(), tmp_path, 0)
    assert result.metrics["train/loss"] > 0

    data = tmp_path / "chats.jsonl"
    data.write_text("".join(json.dumps(c) + "\n" for c in convos))
    head = f"name: c\nmodel: {{path: {tiny / 'model'}}}\ndatasets:\n  chats: {{path: {data}}}\nstages:\n"
    sft_stage = "  - {id: sft, kind: sft, data: chats-data, assistant_only_loss: true}\n"
    parse_recipe(head + "  - {id: chats-data, kind: format, dataset: chats, format: language_modeling}\n" + sft_stage)
    with pytest.raises(RecipeError) as err:
        parse_recipe(
            head + "  - {id: chats-data, kind: format, dataset: chats, format: prompt_completion}\n" + sft_stage
        )
    assert "assistant_only_loss trains on the assistant replies of whole conversations" in str(err.value)
    assert "set `format: language_modeling` on stage 'chats-data'" in str(err.value)


def test_gradient_accumulation_matches_one_big_batch(tiny, data, tmp_path):
    """Loss is averaged over all target tokens of a step, so 2×8 accumulated == 1×16."""
    tok, train, _ = data
    results = []
    for bs, acc in ((16, 1), (8, 2)):
        torch.manual_seed(0)
        model = load_causal_lm(str(tiny / "model"))
        tracker = Tracker()
        cfg = SFTConfig(
            learning_rate=1e-3, max_steps=1, batch_size=bs, gradient_accumulation_steps=acc, logging_every=1
        )
        sft.train(cfg, model, tok, train[:16], [], tracker, tmp_path / f"{bs}")
        results.append(tracker.series("train/loss")[0])
    assert abs(results[0] - results[1]) < 1e-5, results


def test_rerun_resumes_from_last_checkpoint(tiny, data, tmp_path):
    tok, train, _ = data
    cfg = SFTConfig(learning_rate=1e-3, max_steps=6, batch_size=8, save_every=4, logging_every=1)
    first = sft.train(cfg, load_causal_lm(str(tiny / "model")), tok, train, [], Tracker(), tmp_path)
    assert first.resumed_from is None and (tmp_path / "checkpoints" / "step-4" / "state.json").exists()
    tracker = Tracker()
    second = sft.train(cfg, load_causal_lm(str(tiny / "model")), tok, train, [], tracker, tmp_path)
    assert second.resumed_from == 4 and second.steps == 6
    assert [s for s, m in tracker.history if "train/loss" in m] == [5, 6], "the step counter continues"


def test_num_tokens_is_the_running_total_at_each_log_point(tiny, data, tmp_path):
    """`train/num_tokens` counts every loss token trained on so far: logged every 3 steps it equals the step-by-step
    run's total at steps 3 and 6 (it was the mean of the window's running totals, below the total)."""
    tok, train, _evals = data
    series = {}
    for every in (1, 3):
        tracker = Tracker()
        cfg = SFTConfig(learning_rate=1e-3, max_steps=6, batch_size=8, logging_every=every)
        sft.train(cfg, load_causal_lm(str(tiny / "model")), tok, train, [], tracker, tmp_path / str(every))
        series[every] = tracker.series("train/num_tokens")
    per_step = series[1]
    assert len(per_step) == 6 and all(b > a for a, b in itertools.pairwise(per_step))
    assert series[3] == [per_step[2], per_step[5]]


@pytest.mark.parametrize("attention", ["sdpa", "varlen"])
def test_packed_rows_train_exactly_as_alone(tiny, data, attention, monkeypatch):
    """bfd packing: in a packed batch (padding included) each row's summed loss equals that row's loss run alone
    (1e-5), and the batch's gradient equals the sum of the rows' gradients: positions restart per row, so no row
    attends to or predicts another. Under SDPA's block-diagonal mask and under `varlen` (each row its own
    variable-length sequence, from the offsets `collate` counted; rows alone run SDPA)."""
    tok, train, _ = data
    rows = sft.tokenize(train[:12], tok, 64, completion_only=True)
    blocks = sft.pack(rows, 64)
    assert len(blocks) < len(rows) and sum(len(b["input_ids"]) for b in blocks) == sum(
        len(r["input_ids"]) for r in rows
    )
    assert all(len(b["input_ids"]) <= 64 for b in blocks)
    model = load_causal_lm(str(tiny / "model"), attention=attention)
    from alignpipe import attention as varlen

    offsets = []  # the documents each varlen attention call ran
    run = varlen._documents_attention
    monkeypatch.setattr(varlen, "_documents_attention", lambda *a: offsets.append(a[3].tolist()) or run(*a))
    packed = sft.collate(blocks, tok.pad_token_id)
    packed_result = loss_and_grads(model, packed)
    if attention == "varlen":  # every layer ran the documents collate counted: the rows and each block's padding
        rows_and_pads = int((packed["position_ids"] == 0).sum())
        assert len(offsets) == model.config.num_hidden_layers
        assert all(
            cu == packed["documents"]["cu_seq_lens_q"].tolist() and len(cu) == rows_and_pads + 1 for cu in offsets
        )
    alone = [loss_and_grads(model, sft.collate([r], tok.pad_token_id)) for r in rows]
    if attention == "varlen":  # a row alone (no padding, so SDPA's mask is none) is one document
        layers = model.config.num_hidden_layers
        assert offsets[layers:] == [[0, len(r["input_ids"])] for r in rows for _ in range(layers)]
    assert_packed_equals_alone(packed_result, alone)
    # each row's own loss inside the packed batch: score the batch once and split its token losses by row
    batch = sft.collate(blocks, tok.pad_token_id)
    with torch.no_grad():
        from alignpipe.logprobs import token_logprobs

        valid = batch["labels"][:, 1:] != sft.IGNORE
        logps = token_logprobs(model, batch["input_ids"], None, only=valid, position_ids=batch["position_ids"])
    starts = batch["position_ids"] == 0
    per_row = []
    for i in range(len(blocks)):
        seg = starts[i].long().cumsum(0)[1:]  # segment of each target position
        for s in seg[valid[i]].unique():
            per_row.append(float(-logps[i][valid[i] & (seg == s)].sum()))
    assert sorted(per_row) == pytest.approx(sorted(loss for loss, _ in alone), rel=1e-5)


def test_wrapped_packing_fills_every_block(data):
    tok, train, _ = data
    rows = sft.tokenize(train[:12], tok, 64, completion_only=True)
    blocks = sft.pack(rows, 64, "wrapped")
    assert all(len(b["input_ids"]) == 64 for b in blocks[:-1]) and "position_ids" not in blocks[0]


def test_packed_sft_trains_on_fewer_forward_rows(tiny, data, tmp_path):
    tok, train, _ = data
    tracker = Tracker()
    cfg = SFTConfig(learning_rate=1e-3, max_steps=30, batch_size=4, logging_every=5, packing=True, max_length=128)
    sft.train(cfg, load_causal_lm(str(tiny / "model")), tok, train, [], tracker, tmp_path)
    losses = tracker.series("train/loss")
    assert losses[-1] < 0.7 * losses[0], losses
    assert known(tracker.last("train/num_tokens")) > 30 * 4 * 20, (
        "each packed row holds several examples' target tokens"
    )


def test_neftune_noise_equals_transformers_and_leaves_eval_alone(tiny, data, tmp_path):
    """Our NEFTune hook gives transformers' `neftune_post_forward_hook` output on the same random stream (the
    definition TRL's SFTTrainer uses); in eval mode embeddings, logits and greedy generation are unchanged; after
    training the hook is gone."""
    from transformers.integrations.neftune import neftune_post_forward_hook

    from alignpipe.modeling import add_neftune

    tok, train, _ = data
    model = load_causal_lm(str(tiny / "model"))
    emb = model.get_input_embeddings()
    ids = torch.tensor([tok("The film was great")["input_ids"]])
    clean = emb(ids)
    handle = add_neftune(model, 5.0)
    emb.train()
    torch.manual_seed(0)
    ours = emb(ids)
    handle.remove()
    emb.neftune_noise_alpha = 5.0
    torch.manual_seed(0)
    theirs = neftune_post_forward_hook(emb, (ids,), clean)
    assert torch.allclose(ours, theirs, atol=1e-7) and not torch.allclose(ours, clean)
    assert float((ours - clean).detach().abs().max()) <= 5.0 / (ids.size(1) * clean.size(2)) ** 0.5 + 1e-6

    handle = add_neftune(model, 5.0)
    model.eval()
    with torch.no_grad():
        assert torch.equal(emb(ids), clean)
        greedy = model.generate(ids, max_new_tokens=6, do_sample=False)
    handle.remove()
    with torch.no_grad():
        assert torch.equal(model.generate(ids, max_new_tokens=6, do_sample=False), greedy)

    cfg = SFTConfig(learning_rate=1e-3, max_steps=4, batch_size=8, logging_every=2, neftune_noise_alpha=5.0)
    trained = load_causal_lm(str(tiny / "model"))
    sft.train(cfg, trained, tok, train, [], Tracker(), tmp_path)
    trained.train()
    emb = trained.get_input_embeddings()
    assert torch.equal(emb(ids), emb(ids)), "the hook is removed once training ends"


def test_a_failed_checkpoint_save_keeps_the_previous_one_and_names_the_cause(tiny, data, tmp_path, monkeypatch):
    """The disk fills up while step 4's checkpoint is written (after its weights, at the optimizer state): the
    stage fails naming the cause and the intact step-2 checkpoint, the partial folder is gone, and a re-run resumes
    from step 2."""
    import errno
    from pathlib import Path

    from alignpipe.trainers.common import CheckpointSaveError

    tok, train, _ = data
    cfg = SFTConfig(learning_rate=1e-3, max_steps=6, batch_size=8, save_every=2, logging_every=1)
    real_save = torch.save

    def disk_full_at_step_4(obj, f, *args, **kwargs):
        if "step-4" in str(f):
            Path(f).write_bytes(b"\0" * 64)  # the start of the file made it to disk
            raise OSError(errno.ENOSPC, "No space left on device", str(f))
        return real_save(obj, f, *args, **kwargs)

    monkeypatch.setattr(torch, "save", disk_full_at_step_4)
    with pytest.raises(CheckpointSaveError) as failed:
        sft.train(cfg, load_causal_lm(str(tiny / "model")), tok, train, [], Tracker(), tmp_path)
    message = str(failed.value)
    assert "step-4 failed: [Errno 28] No space left on device" in message, message
    assert f"previous checkpoint {tmp_path / 'checkpoints' / 'step-2'} is intact" in message, message
    assert not (tmp_path / "checkpoints" / "step-4").exists()
    assert (tmp_path / "checkpoints" / "step-2" / "state.json").exists()
    monkeypatch.undo()

    tracker = Tracker()
    again = sft.train(cfg, load_causal_lm(str(tiny / "model")), tok, train, [], tracker, tmp_path)
    assert again.resumed_from == 2 and again.steps == 6
    assert [s for s, m in tracker.history if "train/loss" in m] == [3, 4, 5, 6]


def test_packed_rows_score_alike_under_every_attention_kernel_that_runs_on_cpu(tiny, data):
    """`model.attention`: packed rows (positions restarting per row, no mask) get the same log-probs under SDPA's
    block-diagonal mask, eager attention and FlexAttention's block mask (forward only: its backward does not run
    on CPU); eager attention trains them with SDPA's loss and gradients."""
    from alignpipe.logprobs import token_logprobs

    tok, train, _ = data
    blocks = sft.pack(sft.tokenize(train[:12], tok, 64, completion_only=True), 64)
    batch = sft.collate(blocks, tok.pad_token_id)
    assert int((batch["position_ids"] == 0).sum()) > len(blocks), "several rows per block"
    valid = batch["labels"][:, 1:] != sft.IGNORE
    scored, trained = {}, {}
    for attention in ("sdpa", "varlen", "eager", "flex_attention"):
        model = load_causal_lm(str(tiny / "model"), attention=attention)
        assert model.config._attn_implementation == attention
        with torch.no_grad():  # no document offsets handed over: varlen finds them from the position ids
            scored[attention] = token_logprobs(model, batch["input_ids"], None, position_ids=batch["position_ids"])
        if attention != "flex_attention":
            loss, _ = sft.token_loss_sum(model, batch)
            loss.backward()
            trained[attention] = (float(loss.detach()), model.model.layers[0].self_attn.q_proj.weight.grad)
    for attention in ("varlen", "eager", "flex_attention"):
        assert torch.allclose(scored[attention][valid], scored["sdpa"][valid], atol=1e-5), attention
    for attention in ("varlen", "eager"):
        assert trained[attention][0] == pytest.approx(trained["sdpa"][0], rel=1e-6), attention
        assert torch.allclose(trained[attention][1], trained["sdpa"][1], atol=1e-5), attention


def test_the_recipe_attention_reaches_every_model_a_stage_loads_and_a_missing_kernel_is_named(tiny, tmp_path):
    from support import demo_recipe

    from alignpipe.modeling import load_sequence_scorer
    from alignpipe.recipe import RecipeError, parse_recipe
    from alignpipe.stages.context import StageContext

    recipe = parse_recipe(demo_recipe(tiny, tmp_path), ["model.attention=eager"])
    ctx = StageContext(recipe, recipe.stage("sft"), tmp_path, {}, Tracker())
    assert ctx.load_model("base").config._attn_implementation == "eager"
    scorer = load_sequence_scorer(str(tiny / "model"), attention=recipe.model.attention)
    assert scorer.config._attn_implementation == "eager"
    recipe = parse_recipe(demo_recipe(tiny, tmp_path), ["model.attention=flash_attention_2"])
    ctx = StageContext(recipe, recipe.stage("sft"), tmp_path, {}, Tracker())
    with pytest.raises(ValueError, match=r"model.attention: flash_attention_2 cannot be used on this machine.*sdpa"):
        ctx.load_model("base")
    with pytest.raises(RecipeError, match="attention must be one of"):
        parse_recipe(demo_recipe(tiny, tmp_path), ["model.attention=flash"])


def test_packed_sft_on_sdpa_names_the_varlen_setting(tiny, caplog):
    """On a GPU a packed SFT stage under SDPA says once that `model.attention: varlen` avoids its dense mask;
    a model already on `varlen` hears nothing."""
    import logging

    with caplog.at_level(logging.INFO, logger="alignpipe.trainers.sft"):
        sft._suggest_varlen(load_causal_lm(str(tiny / "model")))
        sft._suggest_varlen(load_causal_lm(str(tiny / "model"), attention="varlen"))
    said = [r.getMessage() for r in caplog.records if "varlen" in r.getMessage()]
    assert len(said) == 1 and "model.attention: varlen" in said[0]


def test_the_varlen_kernel_is_called_in_each_torch_releases_keywords():
    """torch 2.13's `varlen_attn` takes `window_size` and `enable_gqa`; 2.11's (the GPU image's) has no GQA flag,
    and a release without `window_size` would take `is_causal`. Both stand-ins below run each document through causal SDPA, as the kernel does, and each must
    see the K/V heads it can take and give the per-document result."""
    from alignpipe.attention import _call_varlen, _documents_attention

    def per_document(q, k, v, cu, scale):
        out = []
        for a, b in zip(cu[:-1].tolist(), cu[1:].tolist(), strict=True):
            qd, kd, vd = (t[a:b].transpose(0, 1) for t in (q, k, v))
            assert kd.shape[0] == qd.shape[0], "K/V heads reach a kernel without a GQA flag unrepeated"
            out.append(torch.nn.functional.scaled_dot_product_attention(qd, kd, vd, is_causal=True, scale=scale))
        return torch.cat([o.transpose(0, 1) for o in out])

    def without_window_size(q, k, v, cu_seq_q, cu_seq_k, max_q, max_k, *, is_causal=False, return_aux=None, scale=None):
        assert is_causal
        return per_document(q, k, v, cu_seq_q, scale)

    def release_2_11(q, k, v, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None, window_size=(-1, -1)):
        assert window_size == (-1, 0)
        return per_document(q, k, v, cu_seq_q, scale)

    def release_2_13(q, k, v, cu_seq_q, cu_seq_k, max_q, max_k, *, scale=None, window_size=(-1, -1), enable_gqa=False):
        assert window_size == (-1, 0) and enable_gqa
        groups = q.shape[1] // k.shape[1]
        return per_document(q, k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1), cu_seq_q, scale)

    torch.manual_seed(0)
    q, k, v = torch.randn(11, 4, 8), torch.randn(11, 2, 8), torch.randn(11, 2, 8)
    cu = torch.tensor([0, 3, 9, 11], dtype=torch.int32)
    want = _documents_attention(q, k, v, cu, cu, 6, 6, 0.3)
    for kernel in (without_window_size, release_2_11, release_2_13):
        torch.testing.assert_close(_call_varlen(kernel, q, k, v, cu, cu, 6, 6, 0.3), want, rtol=1e-6, atol=1e-6)


def test_the_documents_op_gives_the_per_document_loops_outputs_and_gradients():
    """Off the CUDA kernel a compiled layer runs the documents as one op (`documents_attention_op`) whose backward is
    written out; in float64 it equals autograd through the eager loop, grouped K/V heads and the default scale
    included, and passes torch's own op checks (fake tensors, autograd registration)."""
    from alignpipe.attention import _per_document, documents_attention_op

    torch.manual_seed(0)
    q = torch.randn(11, 4, 8, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(11, 2, 8, dtype=torch.float64, requires_grad=True) for _ in range(2))
    cu, grad = torch.tensor([0, 3, 9, 11], dtype=torch.int32), torch.randn(11, 4, 8, dtype=torch.float64)
    for scale in (None, 0.3):
        want = _per_document(q, k, v, cu, cu, scale)
        got = documents_attention_op(q, k, v, cu, cu, 6, 6, scale)
        torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
        for a, b in zip(torch.autograd.grad(got, (q, k, v), grad), torch.autograd.grad(want, (q, k, v), grad)):
            torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
    torch.library.opcheck(documents_attention_op, (q, k, v, cu, cu, 6, 6, 0.3))


# Like Qwen3's and DeepSeek-R1's: an earlier reply loses its reasoning once later turns follow, so the conversation
# renders differently in part and in whole.
REASONING_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>"
    "{% if m['role'] == 'assistant' and not loop.last %}{{ m['content'].split('</think>')[-1] }}"
    "{% else %}{{ m['content'] }}{% endif %}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
# Its training version: each reply and its end of turn inside {% generation %}.
REASONING_TRAINING_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>"
    "{% if m['role'] == 'assistant' %}{% generation %}"
    "{% if not loop.last %}{{ m['content'].split('</think>')[-1] }}{% else %}{{ m['content'] }}{% endif %}"
    "<|end|>{% endgeneration %}"
    "{% else %}{{ m['content'] }}<|end|>{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def test_a_template_that_marks_its_replies_gives_assistant_only_loss_its_spans(tiny, tmp_path):
    """A reasoning template renders a conversation differently in part and in whole, so its replies cannot be found
    by rendering prefixes (a clear error says what to do); its training version's {% generation %} marks give them:
    the labelled tokens are the replies as the whole conversation renders them, with their ends of turn. The recipe's
    `model.chat_template` takes such a template inline or from a .jinja file."""
    from alignpipe.data.formats import format_rows
    from alignpipe.modeling import load_tokenizer
    from alignpipe.recipe.specs import ModelSpec

    conversation = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "<think>greet</think>yo"},
        {"role": "user", "content": "and?"},
        {"role": "assistant", "content": "<think>end</think>done"},
    ]
    tok = load_tokenizer(str(tiny / "model"), chat_template=REASONING_TEMPLATE)
    with pytest.raises(ValueError, match=r"(?s)differently in part and in whole.*\{% generation %\}"):
        format_rows([{"messages": conversation}], fmt="language_modeling", tokenizer=tok, eval_fraction=0)

    tok = load_tokenizer(str(tiny / "model"), chat_template=REASONING_TRAINING_TEMPLATE)
    rows, _, _ = format_rows([{"messages": conversation}], fmt="language_modeling", tokenizer=tok, eval_fraction=0)
    (row,) = rows
    assert [row["text"][a:b] for a, b in row["assistant_spans"]] == ["yo<|end|>", "<think>end</think>done<|end|>"]
    (ex,) = sft.tokenize(rows, tok, 128, completion_only=True, assistant_only=True)
    trained = [t for t, label in zip(ex["input_ids"], ex["labels"]) if label != sft.IGNORE]
    assert tok.decode(trained) == "yo<|end|><think>end</think>done<|end|>"

    template = tmp_path / "reasoning_training.jinja"
    template.write_text(REASONING_TRAINING_TEMPLATE)
    spec = ModelSpec(path=str(tiny / "model"), chat_template=str(template))
    assert spec.chat_template == REASONING_TRAINING_TEMPLATE  # read in: the recipe's fingerprint covers it
    assert ModelSpec(path="m", chat_template=REASONING_TEMPLATE).chat_template == REASONING_TEMPLATE
    with pytest.raises(ValueError, match="neither a Jinja template"):
        ModelSpec(path="m", chat_template=str(tmp_path / "missing.jinja"))


@pytest.mark.parametrize("shuffle", [True, False])
def test_shuffle_off_keeps_the_data_s_order(tiny, data, tmp_path, monkeypatch, shuffle):
    """`shuffle: false` (a curriculum): the steps take the rows in the data's order, epoch after epoch; by default
    each epoch is a new permutation."""
    tok, train, _ = data
    rows = train[:12]
    seen: list[list[int]] = []
    collate = sft.collate

    def recording(batch, *args):
        seen.append([b["input_ids"] for b in batch])
        return collate(batch, *args)

    monkeypatch.setattr(sft, "collate", recording)
    cfg = SFTConfig(max_steps=6, batch_size=4, logging_every=1, shuffle=shuffle)
    sft.train(cfg, load_causal_lm(str(tiny / "model")), tok, rows, [], Tracker(), tmp_path)
    in_order = sft.tokenize(rows, tok, cfg.max_length, cfg.completion_only_loss)
    assert len(seen) == 6  # two epochs of three batches
    first, second = seen[:3], seen[3:]
    flat = [ids for batch in first for ids in batch]
    if shuffle:
        assert flat != [r["input_ids"] for r in in_order] and first != second
    else:
        assert flat == [r["input_ids"] for r in in_order] and first == second


def test_a_gpu_stage_logs_its_device_memory_peaks_without_resetting_them(tiny, data, tmp_path, monkeypatch):
    """On CUDA each log point carries the allocator's peaks (allocated and reserved, GB); they are read, never reset
    (a benchmark around the stage reads them too). Here the device is faked: the counters and the loop's device."""
    from alignpipe.trainers import common

    assert common.device_memory(torch.device("cpu")) == {}
    reads: list[str] = []

    def counter(name: str, value: float):
        return lambda device: reads.append(name) or value

    monkeypatch.setattr(torch.cuda, "max_memory_allocated", counter("allocated", 3e9))
    monkeypatch.setattr(torch.cuda, "max_memory_reserved", counter("reserved", 4e9))
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda *a: reads.append("reset"))
    assert common.device_memory(torch.device("cuda")) == {
        "memory/max_allocated_gb": 3.0,
        "memory/max_reserved_gb": 4.0,
    }
    real = common.device_memory
    monkeypatch.setattr(common, "device_memory", lambda device: real(torch.device("cuda")))
    tok, train, _ = data
    tracker = Tracker()
    sft.train(SFTConfig(max_steps=4, batch_size=4, logging_every=2), load_causal_lm(str(tiny / "model")), tok,
              train[:16], [], tracker, tmp_path)  # fmt: skip
    assert tracker.series("train/memory/max_allocated_gb") == [3.0, 3.0]
    assert tracker.series("train/memory/max_reserved_gb") == [4.0, 4.0] and "reset" not in reads
