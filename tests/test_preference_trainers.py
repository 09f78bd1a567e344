"""Reward and DPO trainers on the tiny sentiment task: they learn, and the reference options behave."""

from __future__ import annotations

import pytest
import torch
from support import tiny_split

from alignpipe.modeling import load_causal_lm, load_sequence_scorer, load_tokenizer
from alignpipe.recipe.stages import FormatStage, RewardStage
from alignpipe.tracking import Tracker
from alignpipe.trainers import dpo, reward
from alignpipe.trainers.configs import DPOConfig, LoraSpec, RewardConfig


@pytest.fixture(scope="module")
def pairs(tiny):
    return tiny_split(tiny, "sentiment_preferences", "preference", rows=1200, max_length=64)


def test_reward_model_reaches_90_percent_on_held_out_pairs(tiny, pairs, tmp_path):
    tok, train, evals = pairs
    model = load_sequence_scorer(str(tiny / "model"), pad_token_id=tok.pad_token_id)
    tracker = Tracker()
    result = reward.train(
        RewardConfig(learning_rate=1e-3, max_steps=40, batch_size=16, logging_every=10),
        model,
        tok,
        train,
        evals,
        tracker,
        tmp_path,
    )
    assert result.metrics["eval/accuracy"] >= 0.90, result.metrics
    assert tracker.series("train/loss")[-1] < tracker.series("train/loss")[0]
    scorer = load_sequence_scorer(str(result.model_dir))  # saved as a loadable, merged scorer
    assert scorer.config.num_labels == 1


def test_lora_reward_model_is_saved_merged(tiny, pairs, tmp_path):
    tok, train, _ = pairs
    model = load_sequence_scorer(str(tiny / "model"), pad_token_id=tok.pad_token_id)
    result = reward.train(
        RewardConfig(max_steps=3, batch_size=8, lora=LoraSpec(r=4)), model, tok, train, [], Tracker(), tmp_path
    )
    assert (result.model_dir / "model.safetensors").exists() and not (result.model_dir / "adapter_config.json").exists()


def test_dpo_increases_reward_margins(tiny, pairs, tmp_path):
    tok, train, evals = pairs
    tracker = Tracker()
    cfg = DPOConfig(learning_rate=5e-4, max_steps=12, batch_size=16, logging_every=4, beta=0.1)
    result = dpo.train(
        cfg,
        load_causal_lm(str(tiny / "model")),
        tok,
        train,
        evals[:32],
        tracker,
        tmp_path,
        ref_model=load_causal_lm(str(tiny / "model")),
    )
    margins = tracker.series("train/rewards/margins")
    assert margins[-1] > margins[0] and result.metrics["eval/rewards/accuracies"] > 0.5
    for key in ("rewards/chosen", "rewards/rejected", "logps/chosen", "logps/rejected", "loss"):
        assert tracker.last(f"train/{key}") is not None


def test_full_dpo_without_a_reference_is_refused(tiny, pairs, tmp_path):
    tok, train, _ = pairs
    with pytest.raises(ValueError, match="needs `ref_model`"):
        dpo.train(DPOConfig(max_steps=1), load_causal_lm(str(tiny / "model")), tok, train, [], Tracker(), tmp_path)


def test_lora_reference_is_the_policy_with_adapter_disabled(tiny, pairs, tmp_path):
    """With LoRA no second model is loaded; the first step's loss equals a run against an explicit copy."""
    tok, train, _ = pairs
    first = {}
    for mode in ("lora", "copy"):
        torch.manual_seed(0)
        tracker = Tracker()
        cfg = DPOConfig(
            learning_rate=1e-3,
            max_steps=1,
            batch_size=8,
            logging_every=1,
            lora=LoraSpec(r=4) if mode == "lora" else None,
        )
        ref = None if mode == "lora" else load_causal_lm(str(tiny / "model"))
        dpo.train(cfg, load_causal_lm(str(tiny / "model")), tok, train, [], tracker, tmp_path / mode, ref_model=ref)
        first[mode] = tracker.series("train/loss")[0]
    # At step 1 a fresh adapter is a no-op, so both policies equal their references: loss = log 2.
    assert first["lora"] == pytest.approx(first["copy"], abs=1e-5) == pytest.approx(0.693147, abs=1e-5)


def test_precomputed_reference_matches_a_live_reference_and_is_cached(tiny, pairs, tmp_path):
    tok, train, _ = pairs
    losses = {}
    for mode in ("precompute", "live"):
        tracker = Tracker()
        cfg = DPOConfig(
            learning_rate=1e-3, max_steps=2, batch_size=8, logging_every=1, precompute_ref_logps=mode == "precompute"
        )
        ref = load_causal_lm(str(tiny / "model")) if mode == "live" else None
        dpo.train(
            cfg, load_causal_lm(str(tiny / "model")), tok, train[:64], [], tracker, tmp_path / mode, ref_model=ref
        )
        losses[mode] = tracker.series("train/loss")
    assert losses["precompute"] == pytest.approx(losses["live"], abs=1e-5)
    cache = tmp_path / "precompute" / "ref_logps.pt"
    stamp = cache.stat().st_mtime_ns
    cfg = DPOConfig(learning_rate=1e-3, max_steps=1, batch_size=8, precompute_ref_logps=True)
    dpo.train(cfg, load_causal_lm(str(tiny / "model")), tok, train[:64], [], Tracker(), tmp_path / "precompute")
    assert cache.stat().st_mtime_ns == stamp, "a re-run reuses the cached reference log-probs"


def test_the_reference_pass_takes_its_own_batch_size(tiny, pairs, tmp_path, capsys):
    """`precompute_ref_batch_size`: the pass without gradients runs larger batches (here 32 pairs, not 4) and
    gives the same log-probs, under a progress bar."""
    tok, train, _ = pairs
    cached = {}
    for size in (None, 32):
        cfg = DPOConfig(max_steps=1, batch_size=4, precompute_ref_logps=True, precompute_ref_batch_size=size)
        dpo.train(cfg, load_causal_lm(str(tiny / "model")), tok, train[:40], [], Tracker(), tmp_path / f"b{size}")
        cached[size] = torch.load(tmp_path / f"b{size}" / "ref_logps.pt")["train"]
        assert "dpo reference log-probs: 100%" in capsys.readouterr().err
    assert cached[None].shape == (40, 2) and torch.allclose(cached[32], cached[None], atol=1e-5)


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_reward_scores_with_a_shared_prefix_equal_whole_rows(tiny, lora, monkeypatch):
    """Each pair's common prefix runs once: scores and gradients equal the classifier's own forward on whole rows."""
    import torch
    from transformers import AutoModelForSequenceClassification

    from alignpipe import logprobs

    monkeypatch.setattr(logprobs, "SHARE_MIN_SAVED", 0)  # share even on the tiny model
    calls = []
    monkeypatch.setattr(reward, "shared_prefix_hidden", lambda *a: calls.append(1) or logprobs.shared_prefix_hidden(*a))
    tok = load_tokenizer(str(tiny / "model"))
    model = AutoModelForSequenceClassification.from_pretrained(str(tiny / "model"), num_labels=1)
    model.config.pad_token_id = tok.pad_token_id
    if lora:
        from alignpipe.modeling import lora_model

        model = lora_model(model, LoraSpec(r=4), task_type="SEQ_CLS")
    rows = [
        {"prompt": "The film was", "chosen": " great fun.", "rejected": " dull."},
        {
            "prompt": "Honestly, I",
            "chosen": " loved it",
            "rejected": " loved it and more",
        },  # one answer extends the other
        {"prompt": "A", "chosen": " fine film.", "rejected": " bad one."},
    ]
    batch = reward.collate(reward.tokenize(rows, tok, 64), tok.pad_token_id)
    assert batch["prefix_mask"].sum(1).min() > 0 and batch["suffix_ids"].size(1) < batch["input_ids"].size(1)

    def run(fn):
        model.zero_grad()
        out = fn()
        (out * torch.tensor([1.0, -2.0, 0.5, 3.0, 1.5, -1.0])).sum().backward()
        return out.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    whole = run(lambda: model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits.squeeze(-1))
    shared = run(lambda: reward.scores(model, batch))
    assert calls and torch.allclose(shared[0], whole[0], atol=1e-5)
    assert shared[1].keys() == whole[1].keys()
    for name, grad in whole[1].items():
        assert torch.allclose(shared[1][name], grad, atol=1e-5), name
    # A pair with nothing in common (no prompt, different first tokens): the batch runs as whole rows.
    bare = reward.collate(
        reward.tokenize(rows[:2] + [{"prompt": "", "chosen": "Fine.", "rejected": "Bad."}], tok, 64), tok.pad_token_id
    )
    assert bare["prefix_mask"].sum(1).min() == 0
    with torch.no_grad():
        assert torch.allclose(
            reward.scores(model, bare),
            model(input_ids=bare["input_ids"], attention_mask=bare["attention_mask"]).logits.squeeze(-1),
            atol=1e-6,
        )


def test_reward_stage_is_reproducible_from_its_seed(tiny, tmp_path):
    """A reward model starts from a causal LM with a fresh score head, which transformers draws from torch's global
    generator: the stage seeds it from the recipe, so two runs of one recipe train the same reward model (this
    once differed run to run, and the PPO built on it with it), and another seed gives another head."""
    from safetensors.torch import load_file

    from alignpipe.manifest import Manifest
    from alignpipe.recipe import parse_recipe
    from alignpipe.stages import format as format_stage
    from alignpipe.stages import reward as reward_stage
    from alignpipe.stages.context import StageContext

    def run(name: str, seed: int) -> dict[str, torch.Tensor]:
        recipe = parse_recipe(f"""name: rm
seed: {seed}
model: {{path: {tiny / "model"}}}
datasets: {{pairs: {{path: {tiny / "data" / "sentiment_preferences.jsonl"}}}}}
stages:
  - {{id: pref-data, kind: format, dataset: pairs, format: preference, max_length: 64, max_rows: 64}}
  - {{id: rm, kind: reward, data: pref-data, max_steps: 2, batch_size: 8}}
""")
        root = tmp_path / name
        data = format_stage.run(
            StageContext(recipe, recipe.stage("pref-data", FormatStage), root / "data", {}, Tracker())
        )
        inputs = {"pref-data": Manifest(stage_id="pref-data", kind="format", cache_key="k", outputs=data.outputs)}
        torch.manual_seed(1000 + len(name))  # whatever the process did before: the stage must not depend on it
        out = reward_stage.run(StageContext(recipe, recipe.stage("rm", RewardStage), root / "rm", inputs, Tracker()))
        return load_file(f"{out.outputs['model']}/model.safetensors")

    first, second, other = run("a", 0), run("bb", 0), run("c", 1)
    assert first.keys() == second.keys()
    assert all(torch.equal(first[k], second[k]) for k in first)
    assert not torch.equal(first["score.weight"], other["score.weight"])


@pytest.mark.parametrize(
    "extra",
    [
        {"loss_type": ["sigmoid", "bco_pair", "sft"], "loss_weights": [0.8, 0.2, 1.0]},
        {"ld_alpha": 0.5, "f_divergence_type": "js_divergence"},
        {"use_weighting": True, "loss_type": ["sigmoid", "sft"], "loss_weights": [1.0, 0.1]},
    ],
    ids=["mpo", "ld-js", "wpo"],
)
def test_dpo_variants_of_trl_1_16_increase_reward_margins(tiny, pairs, tmp_path, extra):
    """MPO's weighted loss mix (with the chosen NLL reported as nll_loss), and LD-DPO under a JS f-divergence,
    train as plain DPO does: the margins grow."""
    tok, train, evals = pairs
    tracker = Tracker()
    cfg = DPOConfig(learning_rate=5e-4, max_steps=12, batch_size=16, logging_every=4, beta=0.1, **extra)
    ref = load_causal_lm(str(tiny / "model"))
    dpo.train(cfg, load_causal_lm(str(tiny / "model")), tok, train, evals[:16], tracker, tmp_path, ref_model=ref)
    margins = tracker.series("train/rewards/margins")
    assert margins[-1] > margins[0]
    assert (tracker.last("train/nll_loss") is not None) == ("sft" in cfg.loss_types)


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"loss_type": ["sigmoid", "sigmoid"]}, "each loss once"),
        ({"loss_type": ["sigmoid", "sft"], "loss_weights": [1.0]}, "one each"),
        ({"loss_type": ["sigmoid", "sft"], "rpo_alpha": 0.5}, "keep one of them"),
        ({"loss_type": "bco_pair", "f_divergence_type": "forward_kl"}, "score difference only"),
        ({"ld_alpha": 1.5}, "less than or equal to 1"),
    ],
)
def test_dpo_loss_settings_that_contradict_themselves_are_refused(extra, message):
    with pytest.raises(ValueError, match=message):
        DPOConfig(**extra)
