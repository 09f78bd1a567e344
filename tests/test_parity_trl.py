"""Our reward and DPO losses equal TRL's (1.16, test extra only) on identical models and batches.

Policy and reference differ (the policy's weights are perturbed), so the DPO log-ratios are not zero.
TRL paths called: `DPOTrainer.compute_loss` (sigmoid, ipo, hinge, and RPO as TRL's ["sigmoid", "sft"]
mix) and `RewardTrainer.compute_loss` (with and without margin and centring), on batches built by
TRL's own tokenization and collator, which our tokenize + collate reproduce exactly (asserted). And the whole
training loop: SFT, DPO and reward trained six steps from the same weights on one batch give TRL's per-step
losses and gradient norms (optimizer, schedule, clipping and loss normalisation included).
"""

from __future__ import annotations

import json
import tempfile

import pytest
import torch

trl = pytest.importorskip("trl")
from datasets import Dataset  # noqa: E402

from alignpipe import losses  # noqa: E402
from alignpipe.modeling import load_causal_lm, load_tokenizer  # noqa: E402
from alignpipe.trainers import dpo, reward  # noqa: E402
from alignpipe.trainers.configs import DPOConfig, RewardConfig  # noqa: E402

TOL = 1e-5


@pytest.fixture(scope="module")
def rows(tiny):
    lines = (tiny / "data" / "sentiment_preferences.jsonl").read_text().splitlines()[:8]
    return [json.loads(line) for line in lines]


def perturbed(model, seed=0, scale=0.05):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(scale * torch.randn(p.shape, generator=g))
    return model


def trl_dpo(tiny, rows, **kwargs):
    tok = load_tokenizer(str(tiny / "model"))
    policy = perturbed(load_causal_lm(str(tiny / "model")))
    ref = load_causal_lm(str(tiny / "model"))
    args = trl.DPOConfig(
        output_dir=tempfile.mkdtemp(),
        per_device_train_batch_size=4,
        report_to="none",
        use_cpu=True,
        bf16=False,
        gradient_checkpointing=False,
        max_length=128,
        **kwargs,
    )
    trainer = trl.DPOTrainer(
        model=policy, ref_model=ref, args=args, processing_class=tok, train_dataset=Dataset.from_list(rows)
    )
    batch = trainer.data_collator([trainer.train_dataset[i] for i in range(4)])
    trainer.model.train()
    loss = trainer.compute_loss(trainer.model, batch)
    metrics = {k: v[-1] for k, v in trainer._metrics["train"].items()}
    return tok, policy, ref, batch, float(loss.detach()), metrics


@pytest.mark.parametrize(
    "loss_type,beta,extra",
    [
        ("sigmoid", 0.1, {}),
        ("ipo", 0.3, {}),
        ("hinge", 0.5, {}),
        ("sigmoid_norm", 0.5, {}),
        ("robust", 0.1, {"label_smoothing": 0.2}),
        ("exo_pair", 0.1, {"label_smoothing": 1e-3}),
        ("nca_pair", 0.2, {}),
        ("bco_pair", 0.2, {}),
        ("sppo_hard", 0.5, {}),
        ("apo_zero", 0.2, {}),
        ("apo_down", 0.2, {}),
        ("discopop", 0.3, {"discopop_tau": 0.1}),
        # f-DPO's divergences
        ("sigmoid", 0.1, {"f_divergence_type": "forward_kl"}),
        ("ipo", 0.3, {"f_divergence_type": "js_divergence"}),
        ("hinge", 0.5, {"f_divergence_type": "alpha_divergence", "f_alpha_divergence_coef": 0.3}),
        # MPO's weighted sum of losses, the chosen NLL among them
        (["sigmoid", "bco_pair", "sft"], 0.1, {"loss_weights": [0.8, 0.2, 1.0]}),
        # LD-DPO
        ("sigmoid", 0.1, {"ld_alpha": 0.5}),
        (["sigmoid", "sft"], 0.1, {"ld_alpha": 0.0}),
        # WPO's weights, on a pair loss and a mix (TRL 1.16 itself fails to weigh an `sft` term: an in-place product
        # on an expanded tensor)
        ("sigmoid", 0.1, {"use_weighting": True}),
        (["ipo", "bco_pair"], 0.3, {"use_weighting": True, "loss_weights": [1.0, 0.5]}),
    ],
)
def test_dpo_loss_and_metrics_equal_trl(tiny, rows, loss_type, beta, extra):
    types = loss_type if isinstance(loss_type, list) else [loss_type]
    tok, policy, ref, trl_batch, trl_loss, trl_metrics = trl_dpo(tiny, rows, beta=beta, loss_type=types, **extra)
    ours = dpo.collate(dpo.tokenize(rows[:4], tok, 128), tok.pad_token_id, 128)
    for key in ("input_ids", "attention_mask", "completion_mask"):
        assert torch.equal(ours[key], trl_batch[key]), key
    cfg = DPOConfig(beta=beta, loss_type=loss_type, **extra)
    reference = dpo._Reference(cfg, type("Loop", (), {})(), None)
    reference.model = ref
    with torch.no_grad():
        loss, stats = dpo.batch_loss(policy, ours, reference.compute, cfg)
    # float32: sppo_hard's squares reach ~50, forward_kl's exponentials ~100
    assert float(loss) == pytest.approx(trl_loss, abs=TOL, rel=1e-5)
    assert stats["rewards/margins"] != 0
    for key in (
        "rewards/chosen",
        "rewards/rejected",
        "rewards/accuracies",
        "rewards/margins",
        "logps/chosen",
        "logps/rejected",
    ):
        assert float(stats[key]) == pytest.approx(trl_metrics[key], abs=TOL), key


def test_rpo_equals_trl_sigmoid_plus_sft_mix(tiny, rows):
    alpha = 0.7
    tok, policy, ref, _, trl_loss, _ = trl_dpo(
        tiny, rows, beta=0.1, loss_type=["sigmoid", "sft"], loss_weights=[1.0, alpha]
    )
    ours = dpo.collate(dpo.tokenize(rows[:4], tok, 128), tok.pad_token_id, 128)
    with torch.no_grad():
        loss, _ = dpo.batch_loss(
            policy, ours, lambda b: dpo.completion_logps(ref, b)[0].chunk(2), DPOConfig(beta=0.1, rpo_alpha=alpha)
        )
    assert float(loss) == pytest.approx(trl_loss, abs=TOL)


def test_label_smoothing_and_reference_free_follow_the_documented_formulas():
    """TRL 1.16 dropped cDPO's label smoothing from `sigmoid` and has no reference_free flag, so these
    two are checked against the formulas TRL documented for them (cDPO: −(1−ε)logσ(βρ) − ε logσ(−βρ);
    reference-free: log π_ref ≡ 0)."""
    g = torch.Generator().manual_seed(0)
    pc, pr, rc, rr = (torch.randn(6, generator=g) * 5 for _ in range(4))
    beta, eps = 0.2, 0.1
    per_pair, _, _ = losses.dpo_loss(pc, pr, rc, rr, beta, "sigmoid", eps)
    rho = (pc - rc) - (pr - rr)
    expected = -(1 - eps) * torch.nn.functional.logsigmoid(beta * rho) - eps * torch.nn.functional.logsigmoid(
        -beta * rho
    )
    assert torch.allclose(per_pair, expected, atol=TOL)
    free, r_c, _ = losses.dpo_loss(pc, pr, torch.zeros(6), torch.zeros(6), beta)
    assert torch.allclose(free, -torch.nn.functional.logsigmoid(beta * (pc - pr)), atol=TOL)
    assert torch.allclose(r_c, beta * pc, atol=TOL)


@pytest.mark.parametrize("margin,center", [(False, None), (True, None), (False, 0.01), (True, 0.05)])
def test_reward_loss_and_metrics_equal_trl(tiny, rows, margin, center):
    from transformers import AutoModelForSequenceClassification

    tok = load_tokenizer(str(tiny / "model"))
    data = [{**r, "margin": 0.25 * i} if margin else dict(r) for i, r in enumerate(rows)]
    model = AutoModelForSequenceClassification.from_pretrained(str(tiny / "model"), num_labels=1)
    model.config.pad_token_id = tok.pad_token_id
    perturbed(model, seed=1, scale=0.1)
    args = trl.RewardConfig(
        output_dir=tempfile.mkdtemp(),
        per_device_train_batch_size=4,
        report_to="none",
        use_cpu=True,
        bf16=False,
        gradient_checkpointing=False,
        max_length=128,
        center_rewards_coefficient=center,
    )
    trainer = trl.RewardTrainer(model=model, args=args, processing_class=tok, train_dataset=Dataset.from_list(data))
    trl_batch = trainer.data_collator([trainer.train_dataset[i] for i in range(4)])
    trainer.model.train()
    trl_loss = float(trainer.compute_loss(trainer.model, dict(trl_batch)).detach())
    trl_metrics = {k: v[-1] for k, v in trainer._metrics["train"].items()}
    ours = reward.collate(reward.tokenize(data[:4], tok, 128), tok.pad_token_id)
    for key in ("input_ids", "attention_mask"):
        assert torch.equal(ours[key], trl_batch[key]), key
    with torch.no_grad():
        loss, stats = reward.forward(model, ours, RewardConfig(center_rewards_coefficient=center))
    assert float(loss) == pytest.approx(trl_loss, abs=TOL)
    assert float(stats["accuracy"]) == pytest.approx(trl_metrics["accuracy"], abs=TOL)
    assert float(stats["margin"]) == pytest.approx(trl_metrics["margin"], abs=TOL)


def _trajectories(
    tiny,
    task: str,
    steps: int = 6,
    model_dir=None,
    moe: dict | None = None,
    lr: float = 1e-3,
    dtype: torch.dtype | None = None,
    ours_only: dict | None = None,
):
    """(ours, TRL's) per-step (loss, grad norm, MoE aux loss or None) of `steps` optimizer steps from the same
    weights on one batch of 8 rows: with a single batch every step sees the same data whatever order each side's
    sampler draws, so the optimizer, schedule, clipping and loss normalisation are compared, not the luck of the
    shuffle. `model_dir`: another model with the tiny tokenizer; `moe`: both sides' `router_aux_loss_coef`; `dtype`:
    both sides' weights cast to it (bf16: trained in it, as a bf16-loaded model is); `ours_only`: our config's
    other fields (`low_precision_updates`)."""
    import copy

    from alignpipe.modeling import load_sequence_scorer
    from alignpipe.tracking import Tracker
    from alignpipe.trainers import sft
    from alignpipe.trainers.configs import SFTConfig

    tok = load_tokenizer(str(tiny / "model"))
    name = "sentiment_sft" if task.startswith("sft") else "sentiment_preferences"
    loss_type = "dft" if task == "sft_dft" else "nll"
    data = [json.loads(line) for line in (tiny / "data" / f"{name}.jsonl").read_text().splitlines()[:8]]
    max_length = 64

    def model():
        torch.manual_seed(0)  # the reward model's score head starts random: the same on both sides
        if task == "reward":
            m = load_sequence_scorer(str(tiny / "model"), pad_token_id=tok.pad_token_id)
        else:
            m = load_causal_lm(str(model_dir or tiny / "model"))
        return m if dtype is None else m.to(dtype)

    common = dict(
        learning_rate=lr, max_steps=steps, batch_size=8, max_length=max_length, logging_every=1, lr_scheduler="linear"
    )
    common |= moe or {}
    ours_common = common | (ours_only or {})
    tracker, m = Tracker(), model()
    if task.startswith("sft"):
        sft.train(SFTConfig(**ours_common, loss_type=loss_type), m, tok, data, [], tracker, tempfile.mkdtemp())
    elif task == "dpo":
        dpo.train(DPOConfig(**ours_common), m, tok, data, [], tracker, tempfile.mkdtemp(), ref_model=copy.deepcopy(m))
    else:
        reward.train(RewardConfig(**ours_common), m, tok, data, [], tracker, tempfile.mkdtemp())
    ours = [
        (d["train/loss"], d["train/grad_norm"], d.get("train/aux_loss"))
        for _, d in tracker.history
        if "train/loss" in d
    ]

    args = dict(
        output_dir=tempfile.mkdtemp(),
        max_steps=steps,
        per_device_train_batch_size=8,
        learning_rate=lr,
        report_to="none",
        use_cpu=True,
        bf16=False,
        gradient_checkpointing=False,
        save_strategy="no",
        logging_steps=1,
        lr_scheduler_type="linear",
        max_length=max_length,
        disable_tqdm=True,
        **(moe or {}),
    )
    ds, m = Dataset.from_list(data), model()
    if task.startswith("sft"):
        sft_args = trl.SFTConfig(**args, completion_only_loss=True, loss_type=loss_type)
        trainer = trl.SFTTrainer(model=m, args=sft_args, processing_class=tok, train_dataset=ds)
    elif task == "dpo":
        trainer = trl.DPOTrainer(
            model=m, ref_model=copy.deepcopy(m), args=trl.DPOConfig(**args), processing_class=tok, train_dataset=ds
        )
    else:
        trainer = trl.RewardTrainer(model=m, args=trl.RewardConfig(**args), processing_class=tok, train_dataset=ds)
    trainer.train()
    history = trainer.state.log_history
    theirs = [(h["loss"], h["grad_norm"], h.get("aux_loss")) for h in history if "loss" in h and "grad_norm" in h]
    return ours, theirs


@pytest.mark.parametrize("task", ["sft", "sft_dft", "dpo", "reward"])
def test_training_trajectory_equals_trl(tiny, task):
    """The whole loop, not just the loss: same starting weights and data, six steps of AdamW with a linear schedule
    and clipping at 1.0, and every step's loss and gradient norm equal TRL's (the loss falls by a quarter or more;
    DFT's probability-weighted loss rises while the tokens' probabilities climb toward 1/e, so not that one)."""
    ours, theirs = _trajectories(tiny, task)
    assert len(ours) == len(theirs) == 6
    for step, ((loss, gn, _), (trl_loss, trl_gn, _)) in enumerate(zip(ours, theirs), 1):
        assert loss == pytest.approx(trl_loss, rel=1e-4), f"step {step} loss"
        assert gn == pytest.approx(trl_gn, rel=1e-3), f"step {step} grad norm"
    if task != "sft_dft":
        assert ours[-1][0] < 0.75 * ours[0][0]


@pytest.mark.parametrize("task", ["sft", "dpo"])
def test_an_moe_model_trains_with_trl_s_load_balancing_loss(tiny, tmp_path, task):
    """A Mixture-of-Experts model (a tiny Qwen3-MoE) adds its routers' load-balancing loss to the training loss, as
    TRL's trainers do (`router_aux_loss_coef`, here 0.5 so that it weighs): every step's loss (the sum, as TRL logs
    it), gradient norm and aux loss equal TRL's, though our trainers run the decoder and LM head themselves."""
    from moe_models import save_moe

    model_dir = save_moe(tiny, tmp_path)
    ours, theirs = _trajectories(tiny, task, steps=4, model_dir=model_dir, moe={"router_aux_loss_coef": 0.5})
    assert len(ours) == len(theirs) == 4
    for step, ((loss, gn, aux), (trl_loss, trl_gn, trl_aux)) in enumerate(zip(ours, theirs), 1):
        assert aux is not None and trl_aux is not None and aux > 1.0  # top-2 of 4 experts: 2 when balanced
        assert aux == pytest.approx(trl_aux, rel=1e-4), f"step {step} aux loss"
        assert loss == pytest.approx(trl_loss, rel=1e-4), f"step {step} loss"
        assert gn == pytest.approx(trl_gn, rel=1e-3), f"step {step} grad norm"


def test_in_bf16_rounded_updates_give_trl_s_trajectory_and_kahan_s_follow_float32(tiny):
    """Weights trained in bf16, as a bf16-loaded model is on a GPU (`python -m bench`'s rows): with
    `low_precision_updates: nearest` (torch's AdamW, each new weight rounded to bf16) every step's loss and gradient
    norm equal TRL's; with the default `kahan` the updates that rounding drops are kept, and the losses follow the
    float32 run's where TRL's fall behind it. So the last-step losses of the GPU table differ by more than the batch
    order: ours' are lower by what TRL's bf16 rounding loses."""
    steps, lr = 20, 1e-4  # an update of ~lr a weight: about one bf16 rounding step at the tiny model's ~0.016
    rounded = {"low_precision_updates": "nearest"}
    nearest, theirs = _trajectories(tiny, "sft", steps=steps, lr=lr, dtype=torch.bfloat16, ours_only=rounded)
    kahan, _ = _trajectories(tiny, "sft", steps=steps, lr=lr, dtype=torch.bfloat16)
    float32, _ = _trajectories(tiny, "sft", steps=steps, lr=lr)
    assert len(nearest) == len(kahan) == len(float32) == len(theirs) == steps
    for step, ((loss, gn, _), (trl_loss, trl_gn, _)) in enumerate(zip(nearest, theirs), 1):
        assert loss == pytest.approx(trl_loss, rel=1e-3), f"step {step} loss"
        assert gn == pytest.approx(trl_gn, rel=1e-2), f"step {step} grad norm"
    # session 64, this machine: last-step losses float32 4.7771, kahan 4.7772, nearest 4.9162, TRL 4.9156
    assert abs(kahan[-1][0] - float32[-1][0]) < 0.01
    assert theirs[-1][0] - float32[-1][0] > 0.1
