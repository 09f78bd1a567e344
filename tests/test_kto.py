"""KTO: the loss, KL reference point and metrics against TRL 1.16's KTOTrainer on the same batch; the unpaired format;
the trainer on the sentiment task; validation and bad data."""

from __future__ import annotations

import contextlib
import json
import math
import tempfile
from typing import Any

import pytest
import torch
from support import tiny_split

from alignpipe.data.formats import format_rows
from alignpipe.losses import kto_loss
from alignpipe.modeling import load_causal_lm, load_tokenizer
from alignpipe.recipe import RecipeError, parse_recipe
from alignpipe.recipe.stages import FormatStage
from alignpipe.tracking import Tracker
from alignpipe.trainers import kto
from alignpipe.trainers.configs import KTOConfig, LoraSpec

TOL = 1e-5
ROWS = [
    {"prompt": "The film", "completion": " was great and fun.", "label": True},
    {"prompt": "I watched it and", "completion": " hated it", "label": False},
    {"prompt": "Critics say", "completion": " a wonderful story", "label": True},
    {"prompt": "My review:", "completion": " boring, dull and far too long", "label": False},
]


@pytest.mark.parametrize("loss_type", ["kto", "apo_zero_unpaired"])
def test_loss_kl_and_metrics_equal_trl_compute_loss(tiny, loss_type):
    """TRL's own `_compute_loss` on its collator's batch (KL completions rotated by one, as its dataset map builds
    them) against ours on the same rows: loss, KL reference point, rewards and log-probs, and the gradient. The
    reference is perturbed, so the KL estimate is positive and the reference point matters."""
    trl = pytest.importorskip("trl")
    from accelerate import Accelerator
    from datasets import Dataset

    path = str(tiny / "model")
    tok = load_tokenizer(path)
    policy, ref = load_causal_lm(path), load_causal_lm(path)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in ref.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g))
    ours_policy, ours_ref = load_causal_lm(path), load_causal_lm(path)
    ours_ref.load_state_dict(ref.state_dict())
    weights = dict(beta=0.3, loss_type=loss_type, desirable_weight=1.3, undesirable_weight=0.8, max_length=64)
    args = trl.KTOConfig(
        output_dir=tempfile.mkdtemp(),
        per_device_train_batch_size=4,
        report_to="none",
        use_cpu=True,
        bf16=False,
        **weights,
    )
    trainer = trl.KTOTrainer(
        model=policy, ref_model=ref, args=args, processing_class=tok, train_dataset=Dataset.from_list(ROWS)
    )
    inputs = next(iter(trainer.get_train_dataloader()))
    assert ("KL_input_ids" in inputs) == (loss_type == "kto")
    trainer.model.train()
    trl_loss = trainer._compute_loss(trainer.model, inputs, False)
    trl_loss.backward()
    trl_metrics = {k: v[-1] for k, v in trainer._metrics["train"].items()}

    cfg = KTOConfig(batch_size=4, **weights)
    batch = kto.collate(kto.tokenize(ROWS, tok), tok.pad_token_id, 64, with_kl=loss_type == "kto")
    sums: dict[str, torch.Tensor] = {}
    counts: dict[str, int] = {}
    ours_policy.train()
    losses = kto.Losses(cfg, Accelerator(cpu=True), lambda: (ours_ref, contextlib.nullcontext()))
    loss = losses(ours_policy, batch, sums, counts)
    loss.backward()
    ours = {k: float(v) for k, v in kto.metrics(sums, counts).items()}

    assert float(loss.detach()) == pytest.approx(float(trl_loss.detach()), abs=TOL)
    for key in ("kl", "rewards/chosen", "rewards/rejected", "rewards/margins", "logps/chosen", "logps/rejected"):
        assert ours[key] == pytest.approx(trl_metrics[key], abs=1e-4), key
    if loss_type == "kto":
        assert ours["kl"] > 0.5, "the perturbed reference makes the KL estimate positive"
    else:
        assert ours["kl"] == 0.0
    name = "model.layers.0.self_attn.q_proj.weight"
    theirs_grad = dict(trainer.model.named_parameters())[name].grad
    assert torch.allclose(dict(ours_policy.named_parameters())[name].grad, theirs_grad, atol=1e-6)


def test_kto_loss_formula_and_reference_point():
    """Eqn 7 of the KTO paper by hand: the reference point shifts both sides, the weights scale them."""
    logps = torch.tensor([-10.0, -12.0, -9.0])
    ref = torch.tensor([-11.0, -11.0, -11.0])
    labels = torch.tensor([True, False, True])
    kl = torch.tensor(0.5)
    loss, rewards = kto_loss(logps, ref, labels, kl, 0.2, "kto", 2.0, 0.5)
    r = logps - ref
    expected = torch.cat(
        [2.0 * (1 - torch.sigmoid(0.2 * (r[labels] - 0.5))), 0.5 * (1 - torch.sigmoid(0.2 * (0.5 - r[~labels])))]
    ).mean()
    assert float(loss) == pytest.approx(float(expected), abs=1e-7)
    assert rewards.tolist() == pytest.approx([0.2, -0.2, 0.4])
    apo, _ = kto_loss(logps, ref, labels, kl, 0.2, "apo_zero_unpaired")
    expected = torch.cat([1 - torch.sigmoid(0.2 * r[labels]), torch.sigmoid(0.2 * r[~labels])]).mean()
    assert float(apo) == pytest.approx(float(expected), abs=1e-7)


def test_kl_completions_are_the_batch_rotated_by_one(tiny):
    tok = load_tokenizer(str(tiny / "model"))
    ex = kto.tokenize(ROWS, tok)
    batch = kto.collate(ex, tok.pad_token_id, 64, with_kl=True)
    B = len(ROWS)
    assert batch["completion_ids"].size(0) == 2 * B and batch["label"].tolist() == [True, False, True, False]
    for i in range(B):
        kl_answer = batch["completion_ids"][B + i][batch["completion_tokens"][B + i].bool()].tolist()
        assert kl_answer == ex[(i - 1) % B]["completion_ids"], "row i is paired with row i-1's completion"
    plain = kto.collate(ex, tok.pad_token_id, 64, with_kl=False)
    assert plain["completion_ids"].size(0) == B


def test_unpaired_format_splits_preference_rows_and_keeps_labelled_ones(tiny):
    tok = load_tokenizer(str(tiny / "model"))
    pairs = [{"prompt": f"p{i}", "chosen": " good", "rejected": " bad", "topic": "film"} for i in range(5)]
    train, evals, stats = format_rows(pairs, fmt="unpaired", tokenizer=tok, eval_fraction=0.2)
    rows = train + evals
    assert len(rows) == 10 and stats.rows_in == 5
    assert sorted((r["completion"], r["label"]) for r in rows) == [(" bad", False)] * 5 + [(" good", True)] * 5
    assert all(set(r) == {"prompt", "completion", "label", "topic"} for r in rows)
    labelled = [{"prompt": "a", "completion": " b", "label": False, "score": 3}]
    (row,), _, _ = format_rows(labelled, fmt="unpaired", tokenizer=tok, eval_fraction=0)
    assert row == {"prompt": "a", "completion": " b", "label": False, "score": 3}
    with pytest.raises(ValueError, match=r"row 0 has label 'negative' \(str\), not true/false"):
        format_rows([{"prompt": "a", "completion": " b", "label": "negative"}], fmt="unpaired", tokenizer=tok)


def test_format_stage_rejects_a_string_label_naming_columns_and_mapping(tiny, tmp_path):
    """The sentiment SFT data has `label: "positive"/"negative"`: formatting it as unpaired fails before any row is
    written, naming the columns found and the mapping to set."""
    from alignpipe.stages import format as format_stage
    from alignpipe.stages.context import StageContext

    text = (
        f"name: k\nmodel: {{path: {tiny / 'model'}}}\n"
        f"datasets:\n  reviews: {{path: {tiny / 'data' / 'sentiment_sft.jsonl'}}}\n"
        "stages:\n  - {id: thumbs, kind: format, dataset: reviews, format: unpaired}\n"
    )
    recipe = parse_recipe(text)
    ctx = StageContext(recipe, recipe.stage("thumbs", FormatStage), tmp_path, {}, Tracker())
    with pytest.raises(ValueError) as err:
        format_stage.run(ctx)
    msg = str(err.value)
    assert "label 'negative' (str), not true/false" in msg or "label 'positive' (str), not true/false" in msg
    assert "Columns found: prompt, completion, label" in msg
    assert "datasets.reviews.columns: {label: <your column>}" in msg
    assert not (tmp_path / "data").exists()


def _recipe(tiny, kto_fields: str, fmt: str = "unpaired") -> str:
    return (
        f"name: k\nmodel: {{path: {tiny / 'model'}}}\n"
        f"datasets:\n  pairs: {{path: {tiny / 'data' / 'sentiment_preferences.jsonl'}}}\n"
        "stages:\n"
        f"  - {{id: thumbs, kind: format, dataset: pairs, format: {fmt}}}\n"
        f"  - {{id: kto, kind: kto, data: thumbs{kto_fields}}}\n"
    )


def test_validation_of_kto_stages(tiny):
    parse_recipe(_recipe(tiny, ", batch_size: 2"))
    parse_recipe(_recipe(tiny, ", batch_size: 1, loss_type: apo_zero_unpaired"))
    with pytest.raises(RecipeError, match="loss_type 'kto' needs batch_size >= 2"):
        parse_recipe(_recipe(tiny, ", batch_size: 1"))
    with pytest.raises(RecipeError, match="unpaired"):
        parse_recipe(_recipe(tiny, "", fmt="preference"))
    with pytest.raises(RecipeError, match="loss_type"):
        parse_recipe(_recipe(tiny, ", loss_type: sigmoid"))


def test_kto_data_without_a_label_column_names_columns_and_mapping(tiny, tmp_path):
    src = tmp_path / "thumbs.jsonl"
    src.write_text(json.dumps({"prompt": "a", "completion": " b", "thumbs_up": True}) + "\n")
    text = (
        f"name: k\nmodel: {{path: {tiny / 'model'}}}\ndatasets:\n  fb: {{path: {src}}}\n"
        "stages:\n  - {id: thumbs, kind: format, dataset: fb, format: unpaired}\n"
        "  - {id: kto, kind: kto, data: thumbs}\n"
    )
    with pytest.raises(RecipeError) as err:
        parse_recipe(text)
    msg = str(err.value)
    assert "prompt+completion+label" in msg and "found: prompt, completion, thumbs_up" in msg
    assert "label: <your column>" in msg
    parse_recipe(text.replace(f"{{path: {src}}}", f"{{path: {src}, columns: {{label: thumbs_up}}}}"))


@pytest.fixture(scope="module")
def sentiment(tiny):
    tok, train, evals = tiny_split(tiny, "sentiment_preferences", "unpaired", rows=400)
    return tok, train, evals


@pytest.mark.parametrize("lora", [False, True])
def test_kto_separates_desirable_from_undesirable_and_logs_trl_metrics(tiny, sentiment, tmp_path, lora):
    """30 steps on the sentiment thumbs: the implied reward of desirable completions rises above the undesirable
    ones' on held-out rows, the held-out loss falls, and TRL's metric names are logged (with LoRA, the reference is
    the adapter-disabled policy)."""
    tok, train, evals = sentiment
    path = str(tiny / "model")
    cfg = KTOConfig(
        learning_rate=2e-3 if lora else 3e-4,
        max_steps=30,
        batch_size=8,
        logging_every=5,
        eval_every=15,
        lora=LoraSpec(r=8) if lora else None,
    )
    tracker = Tracker()
    result = kto.train(
        cfg,
        load_causal_lm(path),
        tok,
        train,
        evals,
        tracker,
        tmp_path,
        ref_model=None if lora else load_causal_lm(path),
    )
    assert result.steps == 30 and result.adapter == lora
    margins, losses = tracker.series("eval/rewards/margins"), tracker.series("eval/loss")
    assert margins[0] > 0.05 and margins[-1] > margins[0], margins
    assert losses[-1] < losses[0] < 0.5, losses
    for key in ("loss", "kl", "rewards/chosen", "rewards/rejected", "rewards/margins", "logps/chosen"):
        value = tracker.last(f"train/{key}")
        assert value is not None and math.isfinite(value), key
    # the policy moves away from its reference, and the reference point sees it (under LoRA too: the policy's
    # mismatched pass runs with its adapter on)
    assert min(tracker.series("train/kl")) >= 0.0 and max(tracker.series("train/kl")) > 1e-3


def test_precomputed_reference_log_probs_give_the_live_losses_and_are_cached(tiny, sentiment, tmp_path):
    """`precompute_ref_logps`: each row's KL partner fixed as TRL's (the row before it in its chunk of batch_size);
    a batch's loss and KL with the cached log-probs equal a live reference pass over the same batch; a run trains
    from them with no reference model, writes the cache and a re-run reuses it; a full-model run resumed past step 0
    without its cache is refused."""
    tok, train, evals = sentiment
    path = str(tiny / "model")
    examples = kto.fixed_kl_partners(kto.tokenize(train[:10], tok), 4)
    assert [e["kl_completion_ids"] for e in examples[:4]] == [examples[i]["completion_ids"] for i in (3, 0, 1, 2)]
    assert [e["kl_completion_ids"] for e in examples[8:]] == [examples[i]["completion_ids"] for i in (9, 8)]

    cfg = KTOConfig(learning_rate=3e-4, max_steps=4, batch_size=8, logging_every=1, precompute_ref_logps=True)
    tracker = Tracker()
    result = kto.train(cfg, load_causal_lm(path), tok, train, evals[:16], tracker, tmp_path / "run")
    assert result.steps == 4 and (tmp_path / "run" / "ref_logps.pt").exists()
    cached = torch.load(tmp_path / "run" / "ref_logps.pt")
    assert cached["train"].shape == (len(train), 2) and cached["eval"].shape == (16, 2)

    policy, reference = load_causal_lm(path), load_causal_lm(path)
    with torch.no_grad():  # a step-1 batch: policy = reference's weights, but a perturbed policy tells them apart
        for p in policy.parameters():
            p.add_(0.02 * torch.randn(p.shape, generator=torch.Generator().manual_seed(0)))
    batch_examples = kto.fixed_kl_partners(kto.tokenize(train[:8], tok), 8)
    for e, (main, partner) in zip(batch_examples, cached["train"][:8].tolist()):
        e["ref_logp"], e["ref_kl_logp"] = main, partner
    batch = kto.collate(batch_examples, tok.pad_token_id, cfg.max_length, True)
    live = {k: v for k, v in batch.items() if k != "ref_logps"}
    from alignpipe.distributed import make_accelerator

    losses = kto.Losses(cfg, make_accelerator(), lambda: (reference, contextlib.nullcontext()))
    sums_cached: dict[Any, Any] = {}
    sums_live: dict[Any, Any] = {}
    policy.eval()
    with torch.no_grad():
        a = losses(policy, batch, sums_cached, {})
        b = losses(policy, live, sums_live, {})
    assert float(a) == pytest.approx(float(b), abs=1e-5) and float(sums_cached["kl"]) == pytest.approx(
        float(sums_live["kl"]), abs=1e-5
    )

    again = kto.train(cfg, load_causal_lm(path), tok, train, evals[:16], Tracker(), tmp_path / "run")
    assert again.steps == 4
    (tmp_path / "run" / "ref_logps.pt").unlink()
    resumed = KTOConfig(**{**cfg.model_dump(), "max_steps": 6, "save_every": 2})
    kto.train(resumed.model_copy(update={"max_steps": 3}), load_causal_lm(path), tok, train, [], Tracker(),
              tmp_path / "resume")  # fmt: skip
    (tmp_path / "resume" / "ref_logps.pt").unlink()
    with pytest.raises(RuntimeError, match=r"reference log-probs cache .* is missing"):
        kto.train(resumed, load_causal_lm(path), tok, train, [], Tracker(), tmp_path / "resume")


def test_a_step_without_desirable_rows_leaves_their_metrics_out(tiny, tmp_path):
    tok = load_tokenizer(str(tiny / "model"))
    rows = [{"prompt": "The film", "completion": " bad", "label": False}] * 8
    tracker = Tracker()
    path = str(tiny / "model")
    cfg = KTOConfig(learning_rate=1e-4, max_steps=2, batch_size=4, logging_every=1)
    kto.train(cfg, load_causal_lm(path), tok, rows, [], tracker, tmp_path, ref_model=load_causal_lm(path))
    assert tracker.last("train/rewards/rejected") is not None and tracker.last("train/loss") is not None
    assert tracker.last("train/rewards/chosen") is None and tracker.last("train/rewards/margins") is None
