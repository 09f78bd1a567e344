"""Padding-free preference batches (`alignpipe/packed_rows.py`): under `model.attention: varlen` the DPO, KTO and
reward trainers run each batch as one row of documents, and every value and gradient equals the padded layout's.
On CPU the varlen attention runs the documents one by one through causal SDPA (exact), so these equalities check the
layout (offsets, restarting positions, the scoring and last-token positions), not the CUDA kernel, which
`bench/gpu_checks.py` compares on a GPU."""

from __future__ import annotations

import contextlib

import pytest
import torch
from accelerate import Accelerator
from support import SHORT_GROUPS, known, tiny_split

from alignpipe import attention as varlen
from alignpipe import last_layer, logprobs
from alignpipe.modeling import load_causal_lm, load_sequence_scorer, load_tokenizer
from alignpipe.packed_rows import answers_part, common_prefixes, pack, pack_answers, pack_scored, runs_documents
from alignpipe.tracking import Tracker
from alignpipe.trainers import dpo, kto, reward
from alignpipe.trainers.configs import DPOConfig, KTOConfig, LoraSpec, RewardConfig

ROWS = [
    {"prompt": "The film was", "chosen": " great fun, start to end.", "rejected": " dull."},
    {"prompt": "Honestly, I", "chosen": " loved it", "rejected": " loved it and more than I can say"},
    {"prompt": "", "chosen": "Fine film.", "rejected": "Bad one, really bad."},
    {"prompt": "A long prompt that takes most of the length budget of the row", "chosen": " yes", "rejected": " no"},
]


@pytest.fixture(scope="module")
def tok(tiny):
    return load_tokenizer(str(tiny / "model"))


def spy_documents(monkeypatch) -> list[list[int]]:
    """The document offsets every varlen attention call ran."""
    seen: list[list[int]] = []
    run = varlen._documents_attention
    monkeypatch.setattr(varlen, "_documents_attention", lambda *a: seen.append(a[3].tolist()) or run(*a))
    return seen


def grads_of(model) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def assert_same_grads(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys() and a
    for name, g in a.items():  # float32 sums in another order: relative to the gradient's norm
        assert float((g - b[name]).norm() / b[name].norm().clamp(min=1e-12)) < 1e-5, name


def test_the_layout_scores_each_answer_token_from_its_own_document(tok):
    """Every scored answer token is the next token after its scoring position, inside the row's own document, with
    positions restarting at each document; the prompt-less answer's first token is not scored; a slice of the rows
    (KTO's halves) is the layout of those rows alone."""
    batch = dpo.collate(dpo.tokenize(ROWS, tok, 24), tok.pad_token_id, 24, packed="documents")
    packed = batch["packed"]
    ids, positions, offsets = packed["input_ids"][0], packed["position_ids"][0], packed["offsets"]
    R = batch["completion_ids"].size(0)
    assert len(offsets) == R + 1 and offsets[-1] == ids.numel() == int(batch["attention_mask"].sum())
    assert packed["documents"]["cu_seq_lens_q"].tolist() == offsets
    assert packed["documents"]["max_length_q"] == batch["input_ids"].size(1)  # the longest row, here not padded
    for r in range(R):
        a, b = offsets[r], offsets[r + 1]
        assert positions[a:b].tolist() == list(range(b - a))
        whole = batch["input_ids"][r][batch["attention_mask"][r].bool()]
        assert torch.equal(ids[a:b], whole), "document r is row r of the padded layout without its padding"
        scored = batch["completion_tokens"][r].bool()
        at = packed["scoring"][r][scored]
        assert ((at >= a) & (at + 1 < b + 1)).all()
        assert torch.equal(ids[at + 1], batch["completion_ids"][r][scored])
    assert batch["completion_tokens"][2, 0] == 0 and batch["completion_tokens"][R // 2 + 2, 0] == 0  # no prompt
    half = answers_part(packed, slice(R // 2, R))
    ex = dpo.tokenize(ROWS, tok, 24)
    prompts = [e["prompt_ids"][:24] for e in ex]
    rejected = [e["rejected_ids"][: 24 - len(p)] for e, p in zip(ex, prompts)]
    alone = pack_answers(prompts, rejected, batch["completion_ids"].size(1))
    assert torch.equal(half["input_ids"], alone["input_ids"]) and half["offsets"] == alone["offsets"]
    assert torch.equal(half["position_ids"], alone["position_ids"])
    assert half["documents"]["cu_seq_lens_q"].tolist() == alone["offsets"]
    assert half["documents"]["max_length_q"] == alone["documents"]["max_length_q"]
    scored = batch["completion_tokens"][R // 2 :].bool()
    assert torch.equal(half["scoring"][scored], alone["scoring"][scored])
    with pytest.raises(ValueError, match="at least one token"):
        pack([[1, 2], []])


def test_collators_pack_only_when_asked_and_models_say_whether_they_run_documents(tiny, tok):
    ex = dpo.tokenize(ROWS, tok, 32)
    assert "packed" not in dpo.collate(ex, tok.pad_token_id, 32)
    assert not runs_documents(load_causal_lm(str(tiny / "model")))
    assert runs_documents(load_causal_lm(str(tiny / "model"), attention="varlen"))
    scored = pack_scored([[], [], []], [[5, 6, 0, 0], [7], [0]], pad_id=0)
    assert scored["last"].tolist() == [1, 4, 5]  # the last non-padding token; a row of padding only: its first
    shared = pack_scored([[5, 6]], [[7, 0], [8, 9]], pad_id=0, share=True)  # one prefix, two suffixes
    assert shared["input_ids"].tolist() == [[5, 6, 7, 0, 8, 9]] and shared["last"].tolist() == [2, 5]
    assert shared["documents"]["key_rows"].tolist() == [0, 1, 2, 3, 0, 1, 4, 5]


@pytest.mark.parametrize(
    "fused, lora, packed",
    [
        (False, False, "documents"),
        (True, False, "documents"),
        (False, False, "shared"),
        (True, False, "shared"),
        (True, True, "shared"),
    ],
    ids=["chunked-head", "fused-head", "shared-chunked-head", "shared-fused-head", "shared-fused-head-lora"],
)
def test_dpo_packed_equals_padded_in_loss_metrics_and_gradients(tiny, tok, fused, lora, packed, monkeypatch):
    """One DPO micro-batch, padded on SDPA (prompts shared, as a GPU-sized model runs them) and padding-free on
    varlen, every prompt + answer its own document or each prompt once for both answers: the same loss, metrics and
    gradients (1e-5), through the chunked head and the fused pair loss, of the full model or a LoRA adapter; every
    varlen call ran the collated documents."""
    monkeypatch.setattr(logprobs, "SHARE_MIN_SAVED", 0)  # the padded side shares its prompts, as on a GPU
    if fused:  # the fused pair loss runs only where logits would be large
        monkeypatch.setattr(logprobs, "WHOLE_LOGITS_MAX", 16)
    seen = spy_documents(monkeypatch)
    batch = dpo.collate(dpo.tokenize(ROWS, tok, 40), tok.pad_token_id, 40, packed=packed)
    once = sum(int(m.sum()) for m in batch["prompt_mask"]) if packed == "shared" else 0  # a prompt's second copy
    assert batch["packed"]["input_ids"].size(1) == int(batch["attention_mask"].sum()) - once
    ref = load_causal_lm(str(tiny / "model"))
    with torch.no_grad():
        ref_logps = dpo.completion_logps(ref, batch)[0].chunk(2)
    cfg = DPOConfig(beta=0.2, fused_loss=fused, rpo_alpha=0.5)
    out = {}
    for attention in ("sdpa", "varlen"):
        model = load_causal_lm(str(tiny / "model"), attention=attention)
        with torch.no_grad():
            for p in model.parameters():  # policy ≠ reference, so the log-ratios are not zero
                p.add_(0.02 * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))
        if lora:
            from alignpipe.modeling import lora_model

            torch.manual_seed(0)
            model = lora_model(model, LoraSpec(r=4))
            for name, p in model.named_parameters():  # B starts at zero: move it, so the adapter counts
                if "lora_B" in name:
                    torch.nn.init.normal_(p, std=0.05, generator=torch.Generator().manual_seed(p.numel()))
        loss, stats = dpo.batch_loss(model, batch, lambda _: ref_logps, cfg)
        loss.backward()
        out[attention] = (float(loss.detach()), {k: float(v) for k, v in stats.items()}, grads_of(model))
    assert out["varlen"][0] == pytest.approx(out["sdpa"][0], abs=1e-5)
    assert out["varlen"][1] == pytest.approx(out["sdpa"][1], abs=1e-5)
    assert_same_grads(out["varlen"][2], out["sdpa"][2])
    layers = ref.config.num_hidden_layers
    assert len(seen) == layers and all(cu == batch["packed"]["offsets"] for cu in seen)
    assert ("key_rows" in batch["packed"]["documents"]) == (packed == "shared")


def test_kto_packed_equals_padded(tiny, tok, monkeypatch):
    """KTO's batch (each completion, then the rotated completions its KL term scores) padding-free on varlen: the
    same loss, metrics and gradients as padded on SDPA; the KL half runs as its own documents."""
    rows = [
        {"prompt": r["prompt"], "completion": r[side], "label": side == "chosen"}
        for r in ROWS
        for side in ("chosen", "rejected")
    ]
    seen = spy_documents(monkeypatch)
    batch = kto.collate(kto.tokenize(rows, tok), tok.pad_token_id, 40, with_kl=True, packed=True)
    ref = load_causal_lm(str(tiny / "model"))
    cfg = KTOConfig(batch_size=len(rows))
    out = {}
    for attention in ("sdpa", "varlen"):
        model = load_causal_lm(str(tiny / "model"), attention=attention)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.02 * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))
        model.train()
        sums: dict[str, torch.Tensor] = {}
        counts: dict[str, int] = {}
        losses = kto.Losses(cfg, Accelerator(cpu=True), lambda: (ref, contextlib.nullcontext()))
        loss = losses(model, batch, sums, counts)
        loss.backward()
        out[attention] = (float(loss), {k: float(v) for k, v in kto.metrics(sums, counts).items()}, grads_of(model))
    assert out["varlen"][0] == pytest.approx(out["sdpa"][0], abs=1e-5)
    assert out["varlen"][1] == pytest.approx(out["sdpa"][1], abs=1e-5)
    assert_same_grads(out["varlen"][2], out["sdpa"][2])
    B, offsets = len(rows), batch["packed"]["offsets"]
    kl_half = [o - offsets[B] for o in offsets[B:]]
    assert seen and kl_half in seen and offsets[: B + 1] in seen  # the KL answers alone, the own answers alone


@pytest.mark.parametrize(
    "lora, packed", [(False, "documents"), (False, "shared"), (True, "shared")], ids=["full", "shared", "shared-lora"]
)
def test_reward_scores_packed_equal_the_classifiers_own_forward(tiny, tok, lora, packed, monkeypatch):
    """The reward model's scores and gradients padding-free on varlen (each pair's common prefix once where
    "shared") equal the classifier's own forward over the padded rows, read at each row's last non-padding token."""
    seen = spy_documents(monkeypatch)
    batch = reward.collate(reward.tokenize(ROWS, tok, 64), tok.pad_token_id, packed=packed)
    assert ("key_rows" in batch["packed"]["documents"]) == (packed == "shared")
    weights = torch.tensor([1.0, -2.0, 0.5, 3.0, 1.5, -1.0, 0.25, 2.0])
    out = {}
    for attention in ("sdpa", "varlen"):
        model = load_sequence_scorer(str(tiny / "model"), pad_token_id=tok.pad_token_id, seed=0, attention=attention)
        if lora:
            from alignpipe.modeling import lora_model

            model = lora_model(model, LoraSpec(r=4), task_type="SEQ_CLS")
        if attention == "sdpa":
            scores = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits.squeeze(-1)
        else:
            scores = reward.scores(model, batch)
        (scores * weights).sum().backward()
        out[attention] = (scores.detach(), grads_of(model))
    assert torch.allclose(out["varlen"][0], out["sdpa"][0], atol=1e-5)
    assert_same_grads(out["varlen"][1], out["sdpa"][1])
    layers = load_sequence_scorer(str(tiny / "model"), pad_token_id=tok.pad_token_id).config.num_hidden_layers
    assert seen[:-1] == [batch["packed"]["offsets"]] * (layers - 1)
    assert seen[-1] == list(range(9)), "the last layer ran at the 8 scored tokens alone, a query document each"


def test_the_last_layer_reads_each_position_with_the_keys_it_sees_in_its_document():
    """`last_layer.read_layout`: a shared prompt (tokens 0, 1) with two answers, the first in the prompt's document
    (token 2), the second a document of its own (tokens 3, 4) whose keys are the prompt's and its own. Each read
    position gets one query document and, as keys, its document's keys up to its own (bottom-right causality)."""
    got = last_layer.read_layout([2, 4, 3], [0, 3, 5], [0, 3, 7], [0, 1, 2, 0, 1, 3, 4])
    assert got["rows"].tolist() == [2, 4, 3]
    assert got["key_rows"].tolist() == [0, 1, 2, 0, 1, 3, 4, 0, 1, 3]
    docs = got["documents"]
    assert docs["cu_seq_lens_q"].tolist() == [0, 1, 2, 3] and docs["max_length_q"] == 1
    assert docs["cu_seq_lens_k"].tolist() == [0, 3, 7, 10] and docs["max_length_k"] == 4


def test_the_last_layer_runs_whole_where_it_cannot_run_at_the_read_tokens_alone(tiny):
    """`last_layer.supported`: our varlen kernel on a Llama-family layer; not SDPA (no documents), nor a layer with
    attention dropout."""
    on = load_sequence_scorer(str(tiny / "model"), seed=0, attention="varlen")
    assert last_layer.supported(on.model)
    assert not last_layer.supported(load_sequence_scorer(str(tiny / "model"), seed=0, attention="sdpa").model)
    on.model.layers[-1].self_attn.attention_dropout = 0.1
    assert not last_layer.supported(on.model)


def test_preference_stages_on_varlen_train_as_on_sdpa(tiny, tok, tmp_path):
    """Whole DPO and reward stages on `model.attention: varlen` (padding-free batches) log the losses the padded
    SDPA stages log, step for step."""
    _, train, _ = tiny_split(tiny, "sentiment_preferences", "preference", rows=48)
    series = {}
    for attention in ("sdpa", "varlen"):
        tracker = Tracker()
        cfg = DPOConfig(learning_rate=5e-4, max_steps=3, batch_size=8, precompute_ref_logps=True, logging_every=1)
        model = load_causal_lm(str(tiny / "model"), attention=attention)
        dpo.train(cfg, model, tok, train, [], tracker, tmp_path / f"dpo-{attention}")
        reward_tracker = Tracker()
        scorer = load_sequence_scorer(str(tiny / "model"), pad_token_id=tok.pad_token_id, seed=0, attention=attention)
        reward.train(
            RewardConfig(max_steps=3, batch_size=8, seed=3, logging_every=1),
            scorer,
            tok,
            train,
            [],
            reward_tracker,
            tmp_path / attention,
        )
        series[attention] = (tracker.series("train/loss"), reward_tracker.series("train/loss"))
    assert len(series["sdpa"][0]) == 3 and len(series["sdpa"][1]) == 3
    assert series["varlen"][0] == pytest.approx(series["sdpa"][0], abs=1e-4)
    assert series["varlen"][1] == pytest.approx(series["sdpa"][1], abs=1e-4)


def test_key_documents_apart_from_the_queries_attend_at_the_bottom_right():
    """A document's queries over a longer key document (a shared prompt's keys, then its answer's): query i sees the
    keys up to i + (n − m), as flash attention aligns causality. The eager loop and the op a compiled layer runs
    (its backward written out) equal attention through an explicit mask in float64, and the op passes torch's op
    checks."""
    from alignpipe.attention import _per_document, documents_attention_op

    torch.manual_seed(0)
    q = torch.randn(9, 4, 8, dtype=torch.float64, requires_grad=True)  # documents of 4 and 5 queries
    k, v = (torch.randn(13, 2, 8, dtype=torch.float64, requires_grad=True) for _ in range(2))  # of 6 and 7 keys
    cu_q, cu_k = torch.tensor([0, 4, 9], dtype=torch.int32), torch.tensor([0, 6, 13], dtype=torch.int32)

    def by_hand():
        out = []
        for (a, b), (c, d) in zip([(0, 4), (4, 9)], [(0, 6), (6, 13)]):
            scores = 0.3 * q[a:b].transpose(0, 1) @ k[c:d].repeat_interleave(2, 1).permute(1, 2, 0)
            seen = torch.arange(d - c)[None, :] <= torch.arange(b - a)[:, None] + (d - c) - (b - a)
            weights = scores.masked_fill(~seen, float("-inf")).softmax(-1)
            out.append((weights @ v[c:d].repeat_interleave(2, 1).transpose(0, 1)).transpose(0, 1))
        return torch.cat(out)

    grad = torch.randn(9, 4, 8, dtype=torch.float64)
    want = by_hand()
    want_grads = torch.autograd.grad(want, (q, k, v), grad)
    for got in (_per_document(q, k, v, cu_q, cu_k, 0.3), documents_attention_op(q, k, v, cu_q, cu_k, 5, 7, 0.3)):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
        for a, b in zip(torch.autograd.grad(got, (q, k, v), grad), want_grads, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
    torch.library.opcheck(documents_attention_op, (q, k, v, cu_q, cu_k, 5, 7, 0.3))


def test_documents_counted_on_the_host_leave_transformers_nothing_to_search(tiny, monkeypatch):
    """A packed forward on varlen with host offsets hands transformers `documents_mask`'s marker: it never looks for
    packed rows in the position ids (a device read a forward), and each row's hidden states equal the row run alone
    on SDPA. Other kernels, and padded batches, keep the mask they were given."""
    import transformers.masking_utils as masking

    searched: list[int] = []
    search = masking.find_packed_sequence_indices
    monkeypatch.setattr(masking, "find_packed_sequence_indices", lambda p: searched.append(1) or search(p))
    rows = [[5, 9, 13, 2], [7, 7, 3, 11, 4, 8], [6, 1]]
    layout = pack(rows)
    model = load_causal_lm(str(tiny / "model"), attention="varlen")
    hidden, _ = logprobs._hidden_and_head(model, layout["input_ids"], None, layout["position_ids"], layout["documents"])
    assert not searched
    alone = load_causal_lm(str(tiny / "model"), attention="sdpa")
    offsets = layout["offsets"]
    for i, row in enumerate(rows):
        want = alone.model(input_ids=torch.tensor([row])).last_hidden_state[0]
        torch.testing.assert_close(hidden[0, offsets[i] : offsets[i + 1]], want, rtol=1e-5, atol=1e-5)
    # the marker is told by its shape: a wrapper that moves inputs to the device hands over a copy
    marker = varlen.documents_mask(model, None, "cpu")
    assert varlen.is_documents_mask(known(marker).clone()) and not varlen.is_documents_mask(torch.ones(1, 1, 2, 2))
    padded = torch.ones(2, 4, dtype=torch.long)
    assert varlen.documents_mask(model, padded, "cpu") is padded
    assert varlen.documents_mask(alone, None, "cpu") is None
    alone.model(input_ids=layout["input_ids"], position_ids=layout["position_ids"], use_cache=False)
    assert searched, "the check still runs where the kernel takes no offsets (SDPA derives its block mask)"


@pytest.mark.parametrize("algorithm", ["grpo", "rloo"])
def test_online_updates_on_varlen_run_padding_free_and_train_as_on_sdpa(tiny, tok, tmp_path, monkeypatch, algorithm):
    """GRPO's and RLOO's updates on varlen (the policy's, the old policy's and the reference's log-probs) run each
    micro-batch padding-free, each prompt once for its group: the same rollouts, losses and gradient norms as the
    padded update on SDPA."""
    import copy

    from alignpipe.judges.reward_set import LoadedReward, RewardSet
    from alignpipe.trainers import grpo, rloo
    from alignpipe.trainers.configs import GRPOConfig, RLOOConfig

    layouts: list[bool] = []
    pack = grpo.pack_answers
    monkeypatch.setattr(grpo, "pack_answers", lambda *a: layouts.append(a[3]) or pack(*a))
    _, train, _ = tiny_split(tiny, "reverse", "prompt_completion", rows=40)
    rows = [{"prompt": r["prompt"]} for r in train]
    module, config = {"grpo": (grpo, GRPOConfig), "rloo": (rloo, RLOOConfig)}[algorithm]
    rewards = RewardSet([LoadedReward("len", lambda p, c, **_: [len(x) / 10 for x in c])])
    series = {}
    for attention in ("sdpa", "varlen"):
        cfg = config(**SHORT_GROUPS)
        tracker = Tracker()
        policy = load_causal_lm(str(tiny / "model"), attention=attention)
        module.train(cfg, policy, tok, rows, rewards, tracker, tmp_path / attention, ref_model=copy.deepcopy(policy))
        series[attention] = {k: tracker.series(f"train/{k}") for k in ("reward", "loss", "grad_norm")}
    assert series["varlen"]["reward"] == series["sdpa"]["reward"] and len(series["sdpa"]["loss"]) == 2
    for key in ("loss", "grad_norm"):
        assert series["varlen"][key] == pytest.approx(series["sdpa"][key], rel=1e-4, abs=1e-6), key
    assert layouts and all(layouts), "every padding-free micro-batch shared its prompts"


@pytest.mark.parametrize(
    "lora, kl_penalty", [(False, "kl"), (True, "kl"), (False, "full")], ids=["reference-copy", "lora", "full-kl"]
)
def test_ppo_on_varlen_runs_its_episodes_padding_free_and_trains_as_on_sdpa(
    tiny, tmp_path, monkeypatch, lora, kl_penalty
):
    """PPO on varlen: the rollout's policy, reference and value passes and every epoch's micro-batch run as one row
    of documents, an episode each (left-padded prompts and the padding after short responses left out): the same
    rollouts, KL, value predictions, losses and clip fractions as the padded run on SDPA. With `kl_penalty: full`
    the rollout's full-distribution KL is taken from the padding-free hidden states too."""
    from support import run_ppo

    from alignpipe.trainers import ppo

    layouts: list[int] = []
    pack = ppo.pack_answers
    monkeypatch.setattr(ppo, "pack_answers", lambda *a, **k: layouts.append(len(a[1])) or pack(*a, **k))
    full_kl_layouts: list[bool] = []
    hidden = ppo.completion_hidden
    monkeypatch.setattr(
        ppo, "completion_hidden", lambda *a, **k: full_kl_layouts.append(k["packed"] is not None) or hidden(*a, **k)
    )
    keys = ("objective/scores", "objective/kl", "loss/policy_avg", "loss/value_avg", "policy/clipfrac_avg")
    series = {}
    for attention in ("sdpa", "varlen"):
        _, tracker, _ = run_ppo(
            tiny, tmp_path / attention, lora=lora, attention=attention, max_steps=2, kl_penalty=kl_penalty
        )
        series[attention] = {k: tracker.series(k) for k in keys}
        assert tracker.params["model.attention"] == attention  # the run's parameters say which kernel ran
        if attention == "sdpa":
            assert not layouts, "padded on SDPA"
    for key in keys:
        assert len(series["sdpa"][key]) == 2
        assert series["varlen"][key] == pytest.approx(series["sdpa"][key], rel=1e-4, abs=1e-6), key
    # per update of 16 episodes: 2 scoring slices of 8, then 2 epochs × 2 mini-batches of one 8-episode micro-batch
    assert layouts == [8] * 6 * 2
    # the full KL's policy and reference passes of each scoring slice (2 updates × 2 slices) ran padding-free
    assert full_kl_layouts == ([True] * 2 * 2 * 2 if kl_penalty == "full" else [])


@pytest.mark.parametrize("packed", ["documents", "shared"])
def test_an_answer_cut_to_nothing_leaves_its_prompt_a_document(tiny, tok, packed):
    """A prompt as long as `max_length` leaves its answers no room (DPO cuts them to nothing): the prompt is still a
    document, nothing of it is scored, and the other pairs' log-probs equal the padded layout's, also when that pair
    is the batch's last."""
    rows = ROWS[:2] + [{"prompt": " ".join(["word"] * 40), "chosen": " yes", "rejected": " no"}]
    examples = dpo.tokenize(rows, tok, 24)
    batch = dpo.collate(examples, tok.pad_token_id, 24, packed=packed)
    assert batch["completion_tokens"][2].sum() == 0 and batch["completion_tokens"][5].sum() == 0
    assert int(batch["packed"]["scoring"].max()) < batch["packed"]["input_ids"].size(1)
    with torch.no_grad():
        padded = dpo.completion_logps(load_causal_lm(str(tiny / "model")), batch)[0]
        free = dpo.completion_logps(load_causal_lm(str(tiny / "model"), attention="varlen"), batch)[0]
    assert torch.allclose(free, padded, atol=1e-5) and float(free[2]) == 0.0


def test_online_dpo_on_varlen_runs_its_pairs_padding_free_and_trains_as_on_sdpa(tiny, tok, tmp_path, monkeypatch):
    """Online DPO's pairs of the policy's own samples, on varlen, run padding-free with each prompt once: the same
    samples, losses and gradient norms as the padded pairs on SDPA."""
    from alignpipe.judges.reward_set import LoadedReward, RewardSet
    from alignpipe.judges.rewards import length
    from alignpipe.trainers import online_dpo
    from alignpipe.trainers.configs import OnlineDPOConfig

    shared: list[bool] = []
    pack = online_dpo.pack_answers
    monkeypatch.setattr(online_dpo, "pack_answers", lambda *a: shared.append(a[3]) or pack(*a))
    rows = [{"prompt": p} for p in ["The film", "I watched it and", "Critics say", "My review:"] * 4]
    rewards = RewardSet([LoadedReward("length", length)])
    series = {}
    for attention in ("sdpa", "varlen"):
        cfg = OnlineDPOConfig(
            learning_rate=3e-3, max_steps=2, batch_size=4, max_completion_length=8, logging_every=1, sample_every=100
        )
        tracker = Tracker()
        online_dpo.train(
            cfg,
            load_causal_lm(str(tiny / "model"), attention=attention),
            tok,
            rows,
            online_dpo.RewardRanker(rewards, None),
            tracker,
            tmp_path / attention,
            ref_model=load_causal_lm(str(tiny / "model"), attention=attention),
        )
        series[attention] = {k: tracker.series(f"train/{k}") for k in ("objective/scores", "loss", "grad_norm")}
    assert series["varlen"]["objective/scores"] == series["sdpa"]["objective/scores"]
    for key in ("loss", "grad_norm"):
        assert series["varlen"][key] == pytest.approx(series["sdpa"][key], rel=1e-4, abs=1e-6), key
    assert shared and all(shared)


def test_unpacked_sft_on_varlen_runs_each_batch_as_one_block_and_trains_as_padded(tiny, tok, tmp_path, monkeypatch):
    """SFT without `packing` on varlen: each batch's rows run together as one block of documents (no padding), with
    the same targets; the losses, gradient norms and eval loss equal the padded batches' on SDPA."""
    from alignpipe.trainers import sft
    from alignpipe.trainers.configs import SFTConfig

    _, train, evals = tiny_split(tiny, "sentiment_sft", "prompt_completion", rows=80, max_length=64)
    rows = sft.tokenize(train[:6], tok, 64, completion_only=True)
    padded, free = sft.collate(rows, tok.pad_token_id), sft.collate(rows, tok.pad_token_id, padding_free=True)
    assert free["input_ids"].shape == (1, sum(len(r["input_ids"]) for r in rows)) and "documents" in free
    assert free["num_targets"] == padded["num_targets"]
    shapes: list[tuple[int, ...]] = []
    collate = sft.collate
    monkeypatch.setattr(
        sft, "collate", lambda *a: (lambda b: shapes.append(tuple(b["input_ids"].shape)) or b)(collate(*a))
    )
    series = {}
    for attention in ("sdpa", "varlen"):
        shapes.clear()
        tracker = Tracker()
        cfg = SFTConfig(learning_rate=1e-3, max_steps=3, batch_size=4, logging_every=1, max_length=64)
        sft.train(
            cfg,
            load_causal_lm(str(tiny / "model"), attention=attention),
            tok,
            train,
            evals[:8],
            tracker,
            tmp_path / attention,
        )
        series[attention] = {k: tracker.series(k) for k in ("train/loss", "train/grad_norm", "eval/loss")}
        assert all((rows_ == 1) == (attention == "varlen") for rows_, _ in shapes), shapes
    for key, values in series["sdpa"].items():
        assert series["varlen"][key] == pytest.approx(values, rel=1e-5), key


def test_common_prefixes_keep_each_sequence_s_last_token_and_share_nothing_alone():
    """A group's prefix is the longest one all its sequences share, short of each one's last token; a group of one
    shares nothing; the rests put the sequences back together."""
    seqs = [[1, 2, 3, 4], [1, 2, 3], [1, 2, 5], [7, 8], [9, 9, 9], [9, 9]]
    groups = [0, 0, 0, 1, 2, 2]
    prefixes, rests = common_prefixes(seqs, groups)
    assert prefixes == [[1, 2], [], [9]]
    assert [prefixes[g] + r for g, r in zip(groups, rests)] == seqs and all(rests)
