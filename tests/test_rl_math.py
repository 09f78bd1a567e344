"""Shared RL math against TRL 1.16 (log-probs, GRPO). PPO's math is in test_ppo_math.py, against TRL 0.7.11."""

from __future__ import annotations

import pytest
import torch
from support import parity_micro_batch, trl_group_trainer

from alignpipe import losses
from alignpipe.launch import free_port
from alignpipe.logprobs import shared_prefix_hidden, shared_prompt_logprobs, token_logprobs, worth_sharing
from alignpipe.rl_math import (
    frac_zero_std,
    group_advantages,
    high_entropy_tokens,
    kl_estimate,
    masked_mean,
    normalize_then_sum_advantages,
)
from alignpipe.trainers import grpo
from alignpipe.trainers.configs import GRPOConfig

TOL = 1e-5


@pytest.mark.parametrize("whole_max", [0, 10**9], ids=["chunked", "whole"])
def test_chunked_logprobs_equal_full_logits(tiny, monkeypatch, whole_max):
    """Large logits go through checkpointed chunks, small ones in one piece: both equal the plain computation."""
    from alignpipe import logprobs
    from alignpipe.modeling import load_causal_lm

    monkeypatch.setattr(logprobs, "WHOLE_LOGITS_MAX", whole_max)
    model = load_causal_lm(str(tiny / "model"))
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(2, 500, (3, 11), generator=g)
    mask = torch.ones_like(ids)
    mask[0, :4] = 0  # left padding on row 0
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    logits = model(input_ids=ids, attention_mask=mask, position_ids=pos).logits[:, :-1] / 0.7
    full = logits.log_softmax(-1).gather(-1, ids[:, 1:].unsqueeze(-1)).squeeze(-1)
    chunked, entropy = token_logprobs(
        model, ids, mask, temperature=0.7, chunk_tokens=6, with_entropy=True
    )  # chunked: 1 position per chunk
    assert torch.allclose(chunked, full, atol=TOL)
    assert torch.allclose(entropy, -(logits.log_softmax(-1).exp() * logits.log_softmax(-1)).sum(-1), atol=1e-4)
    chunked.sum().backward()  # gradients flow through the checkpointed chunks
    assert model.get_output_embeddings().weight.grad is not None


@pytest.mark.parametrize("attention", ["sdpa", "varlen"])
def test_under_ddp_the_lm_head_runs_in_chunks_outside_the_wrapper(tiny, attention):
    """A DDP-wrapped model (one gloo process, in a child process): the wrapper's forward runs with the LM head cut
    to one position, the head then runs chunk by chunk on the decoder's output. Values and every gradient equal
    the plain model's; the head never sees the whole sequence. On varlen the DPO batch runs padding-free through the
    wrapper's forward, its documents and key layout handed to every attention call. (That two ranks train as one
    process is test_multiprocess.)"""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).with_name("wrapped_head_check.py")
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    out = subprocess.run(
        [sys.executable, str(script), "ddp", str(tiny / "model"), attention],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["values"] < TOL and got["grad"] < 1e-5, got
    assert got["widths"] and max(got["widths"]) < 11, got["widths"]
    # DPO's fused head under DDP: its loss and every gradient equal the plain model's
    assert got["dpo_fused"] and got["dpo_loss"] < 1e-6 and got["dpo_grad"] < 1e-5, got


@pytest.mark.parametrize("whole_max", [0, 10**9], ids=["chunked", "whole"])
def test_logprobs_from_a_start_position_and_on_masked_positions_only(tiny, monkeypatch, whole_max):
    """`start` (completions after a prompt) and `only` (completion tokens of padded rows) run the LM head on
    fewer positions: values and gradients equal the full computation's on those positions, zeros elsewhere."""
    from alignpipe import logprobs
    from alignpipe.modeling import load_causal_lm

    monkeypatch.setattr(logprobs, "WHOLE_LOGITS_MAX", whole_max)
    model = load_causal_lm(str(tiny / "model"))
    ids = torch.randint(2, 500, (3, 12), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    full = token_logprobs(model, ids, mask, temperature=0.9)
    tail = token_logprobs(model, ids, mask, temperature=0.9, start=4)
    assert tail.shape == (3, 7) and torch.allclose(tail, full[:, 4:], atol=TOL)
    only = torch.zeros(3, 11, dtype=torch.bool)
    only[0, 3:] = only[1, 5:9] = True  # row 2 has no scored tokens
    (w := model.get_output_embeddings().weight).grad = None
    (full * only).sum().backward()
    g_full = w.grad.clone()
    w.grad = None
    part, ent = token_logprobs(model, ids, mask, temperature=0.9, only=only, with_entropy=True)
    assert torch.allclose(part, full * only, atol=TOL) and (ent[~only] == 0).all()
    part.sum().backward()
    assert torch.allclose(w.grad, g_full, atol=1e-5)


@pytest.mark.parametrize("whole_max", [0, 10**9], ids=["chunked", "whole"])
def test_shared_prompt_logprobs_equal_every_row_run_whole(tiny, monkeypatch, whole_max):
    """GRPO's groups: the prompt runs once per group and its KV cache is repeated; log-probs, entropies and
    every parameter's gradient equal running each prompt + completion row whole (left padding included)."""
    from alignpipe import logprobs
    from alignpipe.modeling import load_causal_lm

    monkeypatch.setattr(logprobs, "WHOLE_LOGITS_MAX", whole_max)
    monkeypatch.setattr(logprobs, "SHARE_MIN_SAVED", 0)  # share even on the tiny model
    calls = []
    monkeypatch.setattr(logprobs, "shared_prefix_hidden", lambda *a: calls.append(1) or shared_prefix_hidden(*a))
    model = load_causal_lm(str(tiny / "model"))
    g = torch.Generator().manual_seed(2)
    G, P, C = 3, 6, 5
    prompts = torch.randint(2, 500, (2, P), generator=g)
    p_mask = torch.ones_like(prompts)
    p_mask[1, :2] = 0  # the second prompt is left-padded
    prompt_ids, prompt_mask = prompts.repeat_interleave(G, 0), p_mask.repeat_interleave(G, 0)
    completions = torch.randint(2, 500, (2 * G, C), generator=g)
    weights = torch.randn(2 * G, C, generator=g)

    def run(fn):
        model.zero_grad()
        logps, ent = fn()
        (logps * weights).sum().backward()
        return logps.detach(), ent, {n: p.grad.clone() for n, p in model.named_parameters()}

    ids, mask = torch.cat([prompt_ids, completions], 1), torch.cat([prompt_mask, torch.ones_like(completions)], 1)
    whole = run(lambda: token_logprobs(model, ids, mask, temperature=0.8, with_entropy=True, start=P - 1))
    index = torch.arange(2 * G) // G
    shared = run(
        lambda: shared_prompt_logprobs(model, prompts, p_mask, completions, index, temperature=0.8, with_entropy=True)
    )
    assert calls and torch.allclose(shared[0], whole[0], atol=TOL) and torch.allclose(shared[1], whole[1], atol=1e-4)
    for name, grad in whole[2].items():
        assert torch.allclose(shared[2][name], grad, atol=1e-5), name
    # GRPO's micro-batch: the LM head on the training tokens alone, counted on the host (no boolean index)
    train_mask = torch.ones(2 * G, C)
    train_mask[1, 2:] = train_mask[5, :] = 0  # a short completion, and a truncated one masked whole
    masked = run(
        lambda: grpo.completion_logps(
            model, prompt_ids, prompt_mask, completions, 0.8, 4096, True, G, device="cpu", mask=train_mask
        )
    )
    assert torch.allclose(masked[0], shared[0] * train_mask, atol=TOL)
    assert torch.allclose(masked[1], shared[1] * train_mask, atol=1e-4)
    weights.mul_(train_mask)
    reweighted = run(
        lambda: shared_prompt_logprobs(model, prompts, p_mask, completions, index, temperature=0.8, with_entropy=True)
    )
    for name, grad in reweighted[2].items():
        assert torch.allclose(masked[2][name], grad, atol=1e-5), name
    # DPO's layout (every chosen row, then every rejected row) with right-padded completions and the LM head on
    # the real tokens only; and GRPO's wrapper on rows that are not groups, which runs them whole.
    only = torch.ones(2 * G, C, dtype=torch.bool)
    only[0, 3:] = only[4, 1:] = False
    tiled = torch.arange(2 * G) % 2
    ids3 = torch.cat([prompts[tiled], completions], 1)
    mask3 = torch.cat([p_mask[tiled], torch.ones_like(completions)], 1)
    mixed = prompt_ids.clone()
    mixed[1, -1] = (mixed[1, -1] + 1) % 500
    with torch.no_grad():
        expected = token_logprobs(model, ids3, mask3, start=P - 1) * only
        assert torch.allclose(
            shared_prompt_logprobs(model, prompts, p_mask, completions, tiled, only=only), expected, atol=TOL
        )
        counted = shared_prompt_logprobs(model, prompts, p_mask, completions, tiled, only=only, count=int(only.sum()))
        assert torch.allclose(counted, expected, atol=TOL)
        assert torch.allclose(
            grpo.completion_logps(model, mixed, prompt_mask, completions, 1.0, 4096, group=G),
            token_logprobs(model, torch.cat([mixed, completions], 1), mask, start=P - 1),
            atol=TOL,
        )


def test_sharing_a_prompt_is_left_to_models_big_enough_to_gain(tiny):
    """One more decoder call costs more than a few prompt tokens of a 1.7M-parameter model saves."""
    from alignpipe.modeling import load_causal_lm

    model = load_causal_lm(str(tiny / "model"))
    assert not worth_sharing(model, 8 * 12)  # the bench's DPO batch
    assert worth_sharing(model, 4096)


def test_activation_checkpointing_turns_sharing_off_without_a_deprecation_warning(tiny, monkeypatch):
    """The shared prefix's KV cache does not survive checkpointing's recomputation, so whole rows run then."""
    import warnings

    from alignpipe import logprobs
    from alignpipe.modeling import enable_activation_checkpointing, load_causal_lm

    monkeypatch.setattr(logprobs, "SHARE_MIN_SAVED", 0)
    model = load_causal_lm(str(tiny / "model"))
    mask = torch.ones(2, 3, dtype=torch.long)
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        assert logprobs.can_share_prefix(model, mask, 6)
        enable_activation_checkpointing(model)
        assert not logprobs.can_share_prefix(model, mask, 6)


def test_on_a_gpu_sharing_waits_for_long_prompts():
    """On a GPU the extra decoder call is host time: the Qwen2-0.5B bench shape's 8 pairs × 12 prompt tokens ran DPO
    at half the speed shared; prompts of hundreds of tokens still share. (Parameters stand in: only their device
    type and size are read.)"""

    class Param:
        device = torch.device("cuda")

        def numel(self):
            return 494_000_000

    class Model:
        def parameters(self):
            return iter([Param()])

    assert not worth_sharing(Model(), 8 * 12)
    assert worth_sharing(Model(), 8 * 512)


def test_kl_is_zero_for_the_same_policy_and_k3_is_nonnegative():
    lp = torch.randn(4, 7)
    for kind in ("k1", "k2", "k3"):
        assert torch.allclose(kl_estimate(lp, lp, kind), torch.zeros_like(lp))
    ref = lp + torch.randn(4, 7)
    assert (kl_estimate(lp, ref, "k3") >= 0).all()
    assert torch.allclose(kl_estimate(lp, ref, "k1"), lp - ref)


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_group_advantages_equal_trl(scale):
    trl_utils = pytest.importorskip("trl.trainer.utils")
    g = torch.Generator().manual_seed(1)
    rewards = torch.randn(12, generator=g)
    rewards[5] = float("nan")  # unscorable completion
    rewards[8:12] = 2.0  # a zero-std group
    ours, std = group_advantages(rewards, 4, scale)
    # TRL 1.16 GRPOTrainer._generate_and_score_completions, "sum_then_normalize":
    mean = torch.nanmean(rewards.view(-1, 4), 1).repeat_interleave(4)
    if scale in ("group", "none"):
        ref_std = trl_utils.nanstd(rewards.view(-1, 4), dim=1).repeat_interleave(4)
    else:
        ref_std = trl_utils.nanstd(rewards).expand_as(rewards)
    expected = rewards - mean
    if scale != "none":
        expected = expected / (ref_std + 1e-4)
    expected = torch.nan_to_num(expected, nan=0.0)
    assert torch.allclose(ours, expected, atol=TOL)
    assert torch.allclose(std, ref_std, atol=TOL, equal_nan=True)


def test_normalize_then_sum_advantages_equal_trl():
    """GDPO: TRL 1.16's `normalize_then_sum` branch of `_generate_and_score_completions`, on its own `nanstd`, with a
    function that does not apply to some rows (NaN) and a row no function scored."""
    trl_utils = pytest.importorskip("trl.trainer.utils")
    g = torch.Generator().manual_seed(3)
    per_func = torch.stack([torch.randn(12, generator=g) * 10, torch.randint(0, 2, (12,), generator=g).float()], 1)
    per_func[2, 1] = float("nan")
    per_func[7] = float("nan")
    weights = torch.tensor([1.0, 0.5])
    ours, std = normalize_then_sum_advantages(per_func, weights, 4)
    # TRL 1.16 GRPOTrainer._generate_and_score_completions, multi_objective_aggregation == "normalize_then_sum":
    grouped = per_func.view(-1, 4, 2)
    mean_k = torch.nanmean(grouped, dim=1, keepdim=True)
    std_k = trl_utils.nanstd(grouped, dim=1, keepdim=True)
    rewards = (((grouped - mean_k) / (std_k + 1e-4)).view(-1, 2) * weights.unsqueeze(0)).nansum(dim=1)
    rewards[torch.isnan(per_func).all(1)] = torch.nan
    std_rewards = trl_utils.nanstd(rewards).expand_as(rewards)
    expected = torch.nan_to_num((rewards - torch.nanmean(rewards)) / (std_rewards + 1e-4), nan=0.0)
    assert torch.allclose(ours, expected, atol=TOL) and torch.allclose(std, std_rewards, atol=TOL)
    assert ours[7] == 0 and not torch.allclose(ours, group_advantages((per_func * weights).nansum(1), 4)[0])


@pytest.mark.parametrize(
    "loss_type,kl_correction,level,eps_high,extra",
    [
        ("grpo", True, "token", 0.28, {}),
        ("bnpo", True, "token", 0.28, {}),
        ("dr_grpo", False, "token", 0.28, {}),
        ("dapo", True, "token", 0.28, {}),
        ("dapo", False, "token", 0.28, {}),
        ("grpo", True, "sequence", 0.28, {}),  # GSPO
        ("luspo", True, "sequence", 0.28, {}),
        ("cispo", True, "token", 0.25, {}),  # ε_max: a bound some of these ratios (0.17 to 0.3) pass
        ("sapo", True, "token", 0.28, {}),
        ("dapo", True, "token", 0.28, {"top_entropy_quantile": 0.2}),
        ("dapo", True, "token", 0.28, {"delta": 1.5}),
        # TRL's vLLM importance sampling (its _compute_loss takes the weights we compute; they equal TRL's in
        # test_sampling_correction) and the off-policy sequence mask, on sampling log-probs that differ from π_old
        ("dapo", True, "token", 0.28, {"sampling_correction": "token_truncate"}),
        ("grpo", True, "token", 0.28, {"sampling_correction": "sequence_mask", "off_policy_mask_threshold": 0.05}),
        ("vespo", True, "token", 0.28, {}),
        ("vespo", False, "token", 0.28, {"sampling_correction": "token_mask"}),  # the weights inside φ
        ("dapo", True, "token", 0.28, {"entropy_coef": 0.05}),  # the entropy bonus, on every completion token
        ("grpo", True, "token", 0.28, {"entropy_coef": 0.1, "top_entropy_quantile": 0.2}),  # on the trained ones
    ],
)
def test_grpo_loss_and_metrics_equal_trl_compute_loss(tiny, loss_type, kl_correction, level, eps_high, extra):
    trl = pytest.importorskip("trl")
    from alignpipe.rl_math import off_policy_mask, sampling_importance_weights
    from alignpipe.trainers.entropy_control import entropy_bonus

    correction = extra.get("sampling_correction")
    threshold = extra.get("off_policy_mask_threshold")
    trl_extra = {k: v for k, v in extra.items() if k != "sampling_correction"}
    if correction:
        trl_extra["vllm_importance_sampling_mode"] = correction
    trainer = trl_group_trainer(
        trl.GRPOTrainer,
        trl.GRPOConfig,
        tiny,
        loss_type=loss_type,
        beta=0.04,
        epsilon=0.2,
        epsilon_high=eps_high,
        use_bias_correction_kl=kl_correction,
        importance_sampling_level=level,
        **trl_extra,
    )
    model = trainer.model
    g = torch.Generator().manual_seed(0)
    inputs = parity_micro_batch(g)
    mask = inputs["completion_mask"]
    B, C = mask.shape
    inputs["old_per_token_logps"] = torch.randn(B, C, generator=g) * 0.1 - 5
    inputs["ref_per_token_logps"] = torch.randn(B, C, generator=g) - 3
    if "delta" in extra:  # an older policy far enough behind that ratios reach 2 to 3, past the cap
        inputs["old_per_token_logps"] = inputs["old_per_token_logps"] - 2.0
    weights = None
    if correction:  # TRL reads them where it used vLLM
        sampled = inputs["old_per_token_logps"] + torch.randn(B, C, generator=g) * 0.3
        weights = sampling_importance_weights(
            inputs["old_per_token_logps"], sampled, mask.float(), correction, None, 3.0
        )
        inputs |= {"importance_sampling_ratio": weights, "sampling_per_token_logps": sampled}
        trainer.use_vllm = True
    trl_loss = float(trainer._compute_loss(trainer.model, dict(inputs)).detach())
    trl_metrics = {k: v[-1] for k, v in trainer._metrics["train"].items()}
    with torch.no_grad():
        logps, entropy = grpo.completion_logps(  # as a training micro-batch runs: the head on masked tokens only
            model,
            inputs["prompt_ids"],
            inputs["prompt_mask"],
            inputs["completion_ids"],
            1.0,
            4096,
            with_entropy=True,
            device="cpu",
            mask=mask.float(),
        )
        m = mask.float()
        keep = extra.get("top_entropy_quantile", 1.0)
        tokens = high_entropy_tokens(entropy, m, keep).float() if keep < 1 else None
        if threshold is not None:
            kept = off_policy_mask(inputs["advantages"], logps, inputs["sampling_per_token_logps"], m, threshold)
            assert 0 < kept.sum() < B, "some completions dropped, some kept"
            weights = kept if weights is None else weights * kept
        ptl, ratio, kl = losses.per_token_loss(
            logps,
            inputs["old_per_token_logps"],
            inputs["ref_per_token_logps"],
            inputs["advantages"],
            0.2,
            eps_high,
            0.04,
            kl_correction,
            m,
            level,
            loss_type,
            delta=extra.get("delta"),
            policy_tokens=tokens,
            sampling_weights=weights,
        )
        loss = losses.aggregate(ptl, m, loss_type, C, float(mask.sum()), 1)
        if extra.get("entropy_coef"):
            loss = loss - extra["entropy_coef"] * entropy_bonus(entropy, m if tokens is None else m * tokens)
        cfg = GRPOConfig(loss_type=loss_type, epsilon_high=eps_high, importance_sampling_level=level, **extra)
        ours = grpo.ratio_metrics(cfg, ratio, inputs["advantages"], eps_high, m, weights if correction else None)
    assert float(loss) == pytest.approx(trl_loss, abs=TOL)
    assert float(masked_mean(kl, m)) == pytest.approx(trl_metrics["kl"], abs=1e-4)
    assert float(masked_mean(entropy, m)) == pytest.approx(trl_metrics["entropy"], abs=1e-4)
    expected = {"sapo": set(), "cispo": {"cispo_clip_ratio"}, "vespo": {"vespo/phi_seq_mean"}}.get(
        loss_type, {f"clip_ratio/{k}_mean" for k in ("low", "high", "region")}
    )
    assert set(ours) == expected
    for key, value in ours.items():
        assert float(value) == pytest.approx(trl_metrics[key], abs=TOL), key
    if loss_type == "cispo":
        assert 0 < float(ours["cispo_clip_ratio"]) < 1, "some ratios clipped, some not"
    if "delta" in extra:
        assert ((ratio > extra["delta"]) & mask.bool()).any(), "the cap binds on some token"
    if tokens is not None:
        assert 0 < tokens.sum() < m.sum(), "some tokens kept, some not"


def test_frac_reward_zero_std_counts_groups_as_trl():
    """A group with fewer than two scorable completions has no std (NaN in both) and is not a zero-std group; a group
    of equal rewards is. Compared with TRL 1.16's own `nanstd` + `isclose` on the same rewards."""
    from trl.trainer.utils import nanstd as trl_nanstd

    nan = float("nan")
    rewards = torch.tensor([1.0, 1.0, 1.0, 1.0, 0.0, 1.0, 0.5, 1.0, nan, nan, nan, 2.0, nan, nan, nan, nan])
    _, std = group_advantages(rewards, 4, "group")
    trl_std = trl_nanstd(rewards.view(-1, 4), dim=1).repeat_interleave(4)
    expected = float(torch.isclose(trl_std, torch.zeros_like(trl_std)).float().mean())
    assert frac_zero_std(std) == expected == 0.25


def test_grpo_loss_types_say_what_they_need():
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match="loss_type 'luspo' is GSPO's sequence-level loss"):
        GRPOConfig(loss_type="luspo")
    with pytest.raises(ValidationError, match=r"set epsilon_high \(ScaleRL recommends 5.0\)"):
        GRPOConfig(loss_type="cispo")
    with pytest.raises(ValidationError, match="scale_rewards \\('batch'\\) does not apply"):
        GRPOConfig(multi_objective_aggregation="normalize_then_sum", scale_rewards="batch")
    GRPOConfig(loss_type="luspo", importance_sampling_level="sequence")
    GRPOConfig(loss_type="cispo", epsilon_high=5.0)


def test_high_entropy_tokens_pool_every_process_before_the_quantile():
    """The threshold is the quantile of every process's tokens (TRL gathers them); padding is NaN, never counted."""
    entropy = torch.tensor([[0.1, 0.2, 0.3, 9.0], [0.4, 0.5, 0.6, 9.0]])
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 0]])
    alone = high_entropy_tokens(entropy, mask, 0.5)
    assert alone.tolist() == [[False, False, False, False], [True, True, True, False]], "the top half of six tokens"
    other = torch.tensor([5.0, 6.0, 7.0, 8.0, 9.0, 10.0, float("nan")])  # another process: higher entropies, padded
    pooled = high_entropy_tokens(entropy, mask, 0.5, gather=lambda x: torch.cat([x, other]))
    assert not pooled.any(), "against the pooled tokens none of these is in the top half"


@pytest.mark.parametrize("with_sampling", [False, True])
def test_vespo_gamma_weights_equal_trl(with_sampling):
    """`rl_math.vespo_weights` against TRL 1.16's `GRPOTrainer.get_gamma_weights` on identical tensors: log-ratios
    past the ±20 clamp, both signs of advantage, and sampling-correction weights folded in (some 0: masked)."""
    trl = pytest.importorskip("trl")
    from alignpipe.rl_math import vespo_weights

    g = torch.Generator().manual_seed(4)
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1], [1, 0, 0, 0], [1, 1, 0, 0]]).float()
    log_ratio = torch.randn(4, 4, generator=g) * 0.3
    log_ratio[1, 2] = 25.0
    advantages = torch.tensor([0.5, -1.0, 0.0, -0.2])
    sampling = torch.rand(4, 4, generator=g) * 2 if with_sampling else None
    if sampling is not None:
        sampling[3, 1] = 0.0
    ours = vespo_weights(advantages, log_ratio, mask, sampling, (2.0, 3.0), (3.0, 2.0))
    theirs = trl.GRPOTrainer.get_gamma_weights(advantages.unsqueeze(1), log_ratio, mask, sampling)
    assert ours.shape == (4, 1) and torch.allclose(ours, theirs, atol=1e-7, rtol=1e-6)


def test_adaptive_entropy_control_follows_trls_rule():
    """`EntropyControl` against TRL 1.16's rule written out (grpo_trainer.py lines 3206-3240): the coefficient steps
    up by delta while the step's entropy is at or below the target and down otherwise, within [min, max], and is
    applied only while the previous step's entropy was at or below the target (nothing before the first step)."""
    from alignpipe.trainers.entropy_control import EntropyControl

    cfg = GRPOConfig(entropy_coef=0.02, use_adaptive_entropy=True, entropy_coef_delta=0.01, entropy_target=0.5,
                     entropy_coef_min=0.005, entropy_coef_max=0.04)  # fmt: skip
    control = EntropyControl(cfg, "cpu")
    coef, last = 0.02, float("inf")
    for entropy in [0.3, 0.4, 0.2, 0.1, 0.6, 0.9, 0.9, 0.9, 0.45]:
        applied = coef if last <= 0.5 else 0.0
        assert float(control.applied()) == pytest.approx(applied)
        tokens = torch.ones(2, 3)
        control.observe(torch.full((2, 3), entropy), tokens)  # two micro-batches of the same entropy
        control.observe(torch.full((2, 3), entropy), tokens)
        control.step()
        coef = min(coef + 0.01, 0.04) if entropy <= 0.5 else max(coef - 0.01, 0.005)
        last = entropy
        assert float(control.coef) == pytest.approx(coef) and float(control.last) == pytest.approx(entropy)
    restored = EntropyControl(cfg, "cpu")
    restored.load(control.state())
    assert float(restored.applied()) == pytest.approx(float(control.applied()))
