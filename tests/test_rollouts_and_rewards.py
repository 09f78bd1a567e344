"""The engine contract (hf and vLLM server mode), reward sets, and the RL trainers end to end on tiny data."""

from __future__ import annotations

import math

import pytest
from loopback import completions_handler, serve
from support import known, run_ppo, tiny_split

from alignpipe.engine.hf import HFEngine
from alignpipe.engine.sampling import SamplingParams
from alignpipe.engine.vllm import VLLMServerEngine
from alignpipe.judges.reward_set import LoadedReward, RewardSet
from alignpipe.judges.rewards import HTTPScorer, RewardFunctionError, exact_match
from alignpipe.modeling import load_causal_lm, load_sequence_scorer, load_tokenizer
from alignpipe.tracking import Tracker
from alignpipe.trainers import grpo, ppo, sft
from alignpipe.trainers.configs import GRPOConfig, LoraSpec, PPOConfig, SFTConfig


def check_engine_contract(engine, tok, prompts, n=2, max_new=5):
    """What every backend must do: n completions per prompt, grouped in prompt order, EOS-terminated
    ids for `stop`, at most max_new_tokens (+ EOS) for `length`."""
    out = engine.generate(prompts, n=n, sampling=SamplingParams(max_new_tokens=max_new), seed=0)
    assert len(out) == len(prompts) * n
    assert [g.prompt_index for g in out] == [i for i in range(len(prompts)) for _ in range(n)]
    for g in out:
        assert g.finish_reason in ("stop", "length")
        if g.finish_reason == "stop":
            assert g.completion_ids[-1] == tok.eos_token_id
        assert isinstance(g.completion, str)
    return out


def test_hf_engine_meets_the_contract_with_text_and_token_prompts(tiny):
    tok = load_tokenizer(str(tiny / "model"))
    engine = HFEngine(load_causal_lm(str(tiny / "model")), tok, batch_size=2)
    check_engine_contract(engine, tok, ["The film", "I watched it and", "Critics say"])
    ids = tok(["The film", "I watched it and"])["input_ids"]
    a = [g.completion_ids for g in engine.generate(ids, 1, SamplingParams(temperature=0, max_new_tokens=6))]
    b = [
        g.completion_ids
        for g in engine.generate(["The film", "I watched it and"], 1, SamplingParams(temperature=0, max_new_tokens=6))
    ]
    assert a == b, "token-id prompts are left-padded exactly as text prompts"


def test_vllm_server_engine_meets_the_contract_over_http(tiny):
    tok = load_tokenizer(str(tiny / "model"))
    with serve(completions_handler) as url:
        engine = VLLMServerEngine(url, tok)
        out = check_engine_contract(engine, tok, ["a", "b", "c"], n=2)
        post = [r for r in url.requests if r["method"] == "POST"][-1]["body"]
    assert post["model"] == "served-policy" and post["n"] == 2 and post["max_tokens"] == 5 and post["seed"] == 0
    assert out[0].completion == " good film" and out[0].finish_reason == "stop"
    assert out[1].finish_reason == "length" and out[1].completion_ids[-1] != tok.eos_token_id


def test_vllm_server_engine_takes_the_token_ids_the_server_sampled(tiny):
    """A vLLM server that returns the sampled ids (`return_token_ids`) is taken at its word, not tokenized again (a
    text's tokenization need not be the sampled one); a stop without the EOS among them gets it appended."""
    tok = load_tokenizer(str(tiny / "model"))
    eos = tok.eos_token_id

    def with_ids(method, path, body, headers):
        status, answer = completions_handler(method, path, body, headers)
        if path == "/v1/completions" and body.get("return_token_ids"):
            for c in answer["choices"]:
                c["token_ids"] = (
                    [11, 12, eos] if c["index"] == 0 else [11, 12, 13] if c["finish_reason"] == "stop" else [21, 22]
                )
        return status, answer

    with serve(with_ids) as url:
        out = check_engine_contract(VLLMServerEngine(url, tok), tok, ["a", "b"], n=2)
        post = [r for r in url.requests if r["method"] == "POST"][-1]["body"]
    assert post["return_token_ids"] is True
    assert [g.completion_ids for g in out] == [[11, 12, eos], [21, 22], [21, 22], [11, 12, 13, eos]]
    assert out[0].completion == " good film"


def test_vllm_server_engine_asks_again_after_a_5xx_and_quotes_a_refusal(tiny):
    """A rollout is asked again after a server error (a restart, an overloaded proxy), as the judges' and scorers'
    calls are; a request the server refuses fails at once with the server's own words (here vLLM's, for a prompt past
    its context), not only the status."""
    tok = load_tokenizer(str(tiny / "model"))
    answers = [503]

    def flaky(method, path, body, headers):
        if path == "/v1/completions" and answers:
            return answers.pop(), {"object": "error", "message": "Service Unavailable", "code": 503}
        return completions_handler(method, path, body, headers)

    with serve(flaky) as url:
        out = check_engine_contract(VLLMServerEngine(url, tok), tok, ["a"], n=2)
        assert len(out) == 2 and [r["path"] for r in url.requests].count("/v1/completions") == 2

    def refusing(method, path, body, headers):
        if path == "/v1/completions":
            said = "This model's maximum context length is 2048 tokens. However, you requested 4100 tokens."
            return 400, {"object": "error", "message": said, "type": "BadRequestError", "param": None, "code": 400}
        return completions_handler(method, path, body, headers)

    with serve(refusing) as url, pytest.raises(RuntimeError) as caught:
        VLLMServerEngine(url, tok).generate(["a"])
    assert "the server said: This model's maximum context length is 2048 tokens" in str(caught.value)
    assert "after 1 attempt(s)" in str(caught.value) and "served-policy" in str(caught.value)


def test_reward_set_weights_and_none():
    half = LoadedReward("half", lambda p, c, **_: [0.5 if x else None for x in c], weight=2.0)
    one = LoadedReward("one", lambda p, c, **_: [1.0 if x == "a" else None for x in c])
    total, per = RewardSet([half, one])(["p"] * 3, ["a", "b", ""])
    assert total[:2].tolist() == [2.0, 1.0] and math.isnan(total[2])
    assert math.isnan(per[1, 1]) and per[0].tolist() == [0.5, 1.0]


def test_broken_reward_functions_fail_before_any_rollout():
    wrong = RewardSet([LoadedReward("wrong_len", lambda p, c, **_: [1.0])])
    with pytest.raises(RewardFunctionError, match="'wrong_len' returned 1 values for 2 completions"):
        wrong.probe(["a", "b"])
    inf = RewardSet([LoadedReward("inf", lambda p, c, **_: [float("inf")] * len(c))])
    with pytest.raises(RewardFunctionError, match="'inf' returned inf"):
        inf(["a"], ["b"])


def test_http_scorer_over_loopback():
    def handler(method, path, body, headers):
        return 200, {"rewards": [float(len(c)) for c in body["completions"]]}

    with serve(handler) as url:
        scorer = HTTPScorer(url + "/score")
        assert scorer(["p", "q"], ["ab", "abc"], answer=["x", "y"]) == [2.0, 3.0]
        assert url.requests[0]["body"]["columns"] == {"answer": ["x", "y"]}


@pytest.fixture(scope="module")
def reversal_sft(tiny, tmp_path_factory):
    """SFT on the noisy reversal task (the tiny GRPO recipe's start)."""
    tok, train, evals = tiny_split(tiny, "reverse", "prompt_completion")
    out = tmp_path_factory.mktemp("revsft")
    sft.train(
        SFTConfig(learning_rate=1e-3, max_steps=400, batch_size=32, logging_every=100),
        load_causal_lm(str(tiny / "model")),
        tok,
        train,
        [],
        Tracker(),
        out,
    )
    strip = lambda rows: [{"prompt": r["prompt"], "answer": r["answer"]} for r in rows]  # noqa: E731
    return tok, out / "model", strip(train), strip(evals)


def accuracy(model, tok, rows) -> float:
    gens = HFEngine(model, tok, 64).generate(
        [r["prompt"] for r in rows], 1, SamplingParams(temperature=0, max_new_tokens=10)
    )
    hits = [known(exact_match(None, [g.completion], answer=[r["answer"]])[0]) for g, r in zip(gens, rows)]
    return sum(hits) / len(rows)


def test_grpo_raises_held_out_accuracy_by_40_points(reversal_sft, tmp_path):
    tok, start, train, evals = reversal_sft
    before = accuracy(load_causal_lm(str(start)), tok, evals[:200])
    model = load_causal_lm(str(start))
    tracker = Tracker()
    cfg = GRPOConfig(
        learning_rate=3e-4,
        max_steps=40,
        batch_size=64,
        num_generations=8,
        max_completion_length=10,
        logging_every=5,
        sample_every=20,
    )
    rewards = RewardSet([LoadedReward("exact_match", exact_match)])
    result = grpo.train(cfg, model, tok, train, rewards, tracker, tmp_path, eval_rows=evals)
    after = accuracy(model, tok, evals[:200])
    print(f"held-out exact match: SFT {before:.2f} → GRPO {after:.2f}")
    assert after - before >= 0.40
    assert result.metrics["eval/reward"] > 0.5
    for key in (
        "reward",
        "reward_std",
        "rewards/exact_match/mean",
        "frac_reward_zero_std",
        "completions/mean_length",
        "completions/min_length",
        "completions/max_length",
        "completions/clipped_ratio",
        "entropy",
        "clip_ratio/low_mean",
        "clip_ratio/high_mean",
        "clip_ratio/region_mean",
        "loss",
    ):
        assert tracker.last(f"train/{key}") is not None, key
    assert "samples/step_000000" in tracker.tables and "samples/step_000020" in tracker.tables


@pytest.mark.parametrize(
    "loss_type,extra",
    [
        ("grpo", {}),
        ("bnpo", {}),
        ("dr_grpo", {}),
        ("grpo", {"importance_sampling_level": "sequence"}),  # luspo and sapo: their losses equal TRL's (test_rl_math)
        ("cispo", {"epsilon_high": 5.0}),
        ("dapo", {"top_entropy_quantile": 0.2, "delta": 1.5, "multi_objective_aggregation": "normalize_then_sum"}),
        ("vespo", {"sampling_correction": "token_truncate"}),
    ],
    ids=["grpo", "bnpo", "dr_grpo", "gspo", "cispo", "high_entropy_two_sided_gdpo", "vespo_corrected"],
)
def test_grpo_variants_with_kl_lora_reference_and_reused_rollouts(reversal_sft, tmp_path, loss_type, extra):
    """β > 0 with LoRA takes the reference from the adapter-disabled policy; num_iterations = 2 reuses a
    rollout for a second step (ratios ≠ 1 then); truncated completions can be masked out."""
    tok, start, train, _ = reversal_sft
    tracker = Tracker()
    cfg = GRPOConfig(
        **extra,
        learning_rate=1e-3,
        max_steps=4,
        batch_size=16,
        num_generations=4,
        max_completion_length=10,
        beta=0.1,
        loss_type=loss_type,
        num_iterations=2,
        mask_truncated_completions=True,
        lora=LoraSpec(r=4),
        logging_every=1,
        sample_every=100,
    )
    rewards = RewardSet([LoadedReward("exact_match", exact_match)])
    result = grpo.train(cfg, load_causal_lm(str(start)), tok, train, rewards, tracker, tmp_path)
    assert result.adapter and result.steps == 4
    kls = tracker.series("train/kl")
    assert len(kls) == 4 and kls[0] == pytest.approx(0.0, abs=1e-6) and all(math.isfinite(k) for k in kls)
    assert all(math.isfinite(x) for x in tracker.series("train/loss"))
    # each step that sampled (num_iterations 2: every other one) logs its generation's rate and share of the step
    rates, shares = tracker.series("train/generation/tokens_per_s"), tracker.series("train/generation/time_share")
    assert len(rates) == len(shares) == 2 and all(r > 0 for r in rates) and all(0 < s <= 1 for s in shares)
    assert not tracker.series("train/generation/sync_time_share"), "the hf engine samples from the policy: no copy"


def test_grpo_with_static_cache_and_cuda_graph_rollouts_trains_identically(reversal_sft, tmp_path, monkeypatch):
    """`rollout: {static_cache: true}`, and the CUDA-graph step a GPU decodes with by default (its recording made by a
    CPU stand-in: recorded at each rollout, released before each update), sample the same tokens, so GRPO takes the
    same steps: identical metrics."""
    import support

    from alignpipe.engine.hf import HFEngine
    from alignpipe.trainers.configs import RolloutSpec

    tok, start, train, _ = reversal_sft
    rewards = RewardSet([LoadedReward("exact_match", exact_match)])
    series = {}
    recorded: list[int] = []
    replay = support.replayed_on_cpu
    for static in (False, True, "graphed"):
        if static == "graphed":
            monkeypatch.setattr(support, "replayed_on_cpu", lambda step: recorded.append(1) or replay(step))
            monkeypatch.setattr(HFEngine, "_decode_step", support.graphed_on_cpu)
        tracker = Tracker()
        cfg = GRPOConfig(
            learning_rate=3e-4,
            max_steps=3,
            batch_size=16,
            num_generations=4,
            max_completion_length=10,
            logging_every=1,
            sample_every=100,
            rollout=RolloutSpec(static_cache=static is True),
        )
        grpo.train(cfg, load_causal_lm(str(start)), tok, train, rewards, tracker, tmp_path / str(static))
        series[static] = {k: tracker.series(f"train/{k}") for k in ("reward", "completions/mean_length", "loss")}
    assert len(recorded) >= 3, "a recording per rollout"
    for other in (True, "graphed"):
        assert series[other]["reward"] == series[False]["reward"], other
        assert series[other]["completions/mean_length"] == series[False]["completions/mean_length"], other
        assert series[other]["loss"] == pytest.approx(series[False]["loss"], abs=1e-6), other


def test_grpo_refuses_a_batch_that_does_not_split_into_groups(reversal_sft, tmp_path):
    tok, start, train, _ = reversal_sft
    with pytest.raises(ValueError, match=r"batch_size \(10\) must be a multiple of num_generations \(4\)"):
        grpo.train(
            GRPOConfig(batch_size=10, num_generations=4),
            load_causal_lm(str(start)),
            tok,
            train,
            RewardSet([LoadedReward("em", exact_match)]),
            Tracker(),
            tmp_path,
        )


def test_nan_loss_stops_with_the_step_and_keeps_the_checkpoint(reversal_sft, tmp_path, monkeypatch):
    tok, start, train, _ = reversal_sft
    tracker = Tracker()
    original = grpo.per_token_loss

    def nan_from_step_three(*args, **kwargs):
        loss, ratio, kl = original(*args, **kwargs)
        if len(tracker.history) >= 2:  # two steps logged (logging_every=1): the third goes NaN
            loss = loss * float("nan")
        return loss, ratio, kl

    monkeypatch.setattr(grpo, "per_token_loss", nan_from_step_three)
    cfg = GRPOConfig(
        learning_rate=1e-3,
        max_steps=6,
        batch_size=8,
        num_generations=4,
        max_completion_length=6,
        save_every=1,
        logging_every=1,
    )
    with pytest.raises(FloatingPointError, match=r"loss is nan at step 3; last checkpoint kept: .*step-2"):
        grpo.train(
            cfg, load_causal_lm(str(start)), tok, train, RewardSet([LoadedReward("em", exact_match)]), tracker, tmp_path
        )
    assert (tmp_path / "checkpoints" / "step-2" / "state.json").exists()


def test_ppo_runs_updates_and_logs_the_seed_metrics(tiny, tmp_path):
    """Three PPO updates (k3 KL, whitened rewards, EOS penalty) log every metric the seed's PPO logs."""
    result, tracker, _ = run_ppo(
        tiny, tmp_path, sample_every=1, missing_eos_penalty=0.5, whiten_rewards=True, kl_penalty="k3"
    )
    assert result.steps == 3 and (tmp_path / "model" / "model.safetensors").exists()
    for key in (
        "objective/kl",
        "objective/entropy",
        "objective/non_score_reward",
        "objective/rlhf_reward",
        "objective/scores",
        "policy/approxkl_avg",
        "policy/clipfrac_avg",
        "loss/policy_avg",
        "loss/value_avg",
        "val/clipfrac_avg",
        "policy/entropy_avg",
        "val/ratio",
        "val/ratio_var",
        "val/num_eos_tokens",
        "lr",
        "episode",
        "eps",
        "generation/tokens_per_s",
        "generation/time_share",
    ):
        assert tracker.last(key) is not None and math.isfinite(tracker.last(key)), key
    assert tracker.series("objective/kl")[0] == pytest.approx(0.0, abs=1e-5), (
        "the first rollout is on the reference policy"
    )
    assert tracker.last("episode") == 3 * 16
    assert "samples/update_000003" in tracker.tables


def test_ppo_and_grpo_resume_from_their_last_checkpoint(tiny, reversal_sft, tmp_path):
    tok, start, train, _ = reversal_sft
    rewards = RewardSet([LoadedReward("exact_match", exact_match)])
    grpo_cfg = GRPOConfig(
        learning_rate=1e-3,
        max_steps=3,
        batch_size=8,
        num_generations=4,
        max_completion_length=6,
        save_every=1,
        logging_every=1,
        sample_every=100,
    )
    grpo.train(grpo_cfg, load_causal_lm(str(start)), tok, train, rewards, Tracker(), tmp_path / "grpo")
    tracker = Tracker()
    again = grpo.train(grpo_cfg, load_causal_lm(str(start)), tok, train, rewards, tracker, tmp_path / "grpo")
    assert again.resumed_from == 2 and again.steps == 3 and [s for s, _ in tracker.history] == [3]

    rows = [{"prompt": p} for p in ["The film", "I watched it and", "Critics say", "My review:"] * 4]
    value = lambda: load_sequence_scorer(str(tiny / "model"), pad_token_id=tok.pad_token_id)  # noqa: E731
    ppo_cfg = PPOConfig(
        learning_rate=1e-4,
        max_steps=3,
        batch_size=4,
        num_ppo_epochs=1,
        max_completion_length=6,
        save_every=1,
        logging_every=1,
        sample_every=100,
    )
    lengths = RewardSet([LoadedReward("len", lambda p, c, **_: [len(x) / 10 for x in c])])
    ppo.train(
        ppo_cfg,
        load_causal_lm(str(tiny / "model")),
        value(),
        tok,
        rows,
        lengths,
        Tracker(),
        tmp_path / "ppo",
        ref_model=load_causal_lm(str(tiny / "model")),
    )
    tracker = Tracker()
    again = ppo.train(
        ppo_cfg,
        load_causal_lm(str(tiny / "model")),
        value(),
        tok,
        rows,
        lengths,
        tracker,
        tmp_path / "ppo",
        ref_model=load_causal_lm(str(tiny / "model")),
    )
    assert again.resumed_from == 2 and again.steps == 3 and [s for s, _ in tracker.history] == [3]


def test_the_entropy_bonus_keeps_the_policy_more_random_and_its_adaptive_state_resumes(reversal_sft, tmp_path):
    """From the reversal SFT model (peaked, low entropy), four steps with a large bonus end with a higher entropy
    than without, and log the policy loss apart; an adaptive bonus whose target is above any entropy raises its
    coefficient by delta each step, and a run resumed from step 1 goes on from the coefficient it had reached."""
    tok, start, train, _ = reversal_sft
    rewards = RewardSet([LoadedReward("exact_match", exact_match)])

    def run(out, **overrides):
        tracker = Tracker()
        args = dict(learning_rate=1e-3, max_steps=4, batch_size=16, num_generations=4, max_completion_length=8)
        cfg = GRPOConfig(**{**args, "logging_every": 1, "sample_every": 100, **overrides})
        result = grpo.train(cfg, load_causal_lm(str(start)), tok, train, rewards, tracker, out)
        return tracker, result

    plain, _ = run(tmp_path / "plain")
    bonus, _ = run(tmp_path / "bonus", entropy_coef=0.5)
    assert bonus.series("train/entropy")[-1] > plain.series("train/entropy")[-1] + 0.05
    assert bonus.series("train/entropy_coef") == [0.5] * 4 and len(bonus.series("train/policy_loss")) == 4
    assert not plain.series("train/policy_loss")

    adaptive = dict(max_steps=3, entropy_coef=0.01, use_adaptive_entropy=True, entropy_coef_delta=0.01,
                    entropy_target=100.0, save_every=1)  # fmt: skip
    whole, _ = run(tmp_path / "whole", **adaptive)
    assert whole.series("train/entropy_coef") == pytest.approx([0.02, 0.03, 0.04])
    run(tmp_path / "again", **{**adaptive, "max_steps": 2})  # leaves step-1 (its last step saves none)
    resumed, result = run(tmp_path / "again", **adaptive)
    assert result.resumed_from == 1
    assert resumed.series("train/entropy_coef") == pytest.approx([0.03, 0.04])
