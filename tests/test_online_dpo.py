"""Online DPO: one step against TRL's OnlineDPOTrainer.training_step on the same completions (loss and every
statistic), the judge ranker's ties, learning on the tiny model, and validation."""

from __future__ import annotations

import tempfile
from typing import Literal

import pytest
import torch
from support import known

from alignpipe.engine.base import Generation
from alignpipe.judges.reward_set import LoadedReward, RewardSet
from alignpipe.modeling import load_causal_lm, load_tokenizer
from alignpipe.recipe import RecipeError, parse_recipe
from alignpipe.tracking import Tracker
from alignpipe.trainers import online_dpo
from alignpipe.trainers.common import pad_rows
from alignpipe.trainers.configs import LoraSpec, OnlineDPOConfig

PROMPTS = ["The film", "I watched it and", "Critics say"]


class FixedEngine:
    """Hands out the same two completions of each prompt (keyed by its ids) on every call."""

    def __init__(self, tok, by_prompt: dict[tuple[int, ...], list[list[int]]]):
        self.tok, self.by_prompt = tok, by_prompt

    def update_weights(self, model) -> None:
        pass

    def generate(self, prompts, n=1, sampling=None, seed=None):
        out = []
        for i, p in enumerate(prompts):
            for ids in self.by_prompt[tuple(p)][:n]:
                text = self.tok.decode(ids, skip_special_tokens=True)
                reason: Literal["stop", "length"] = "stop" if ids[-1] == self.tok.eos_token_id else "length"
                out.append(Generation(i, text, ids, reason))
        return out


def lengths(prompts, completions, **_):
    return [float(len(c)) for c in completions]


@pytest.mark.parametrize("loss_type", ["sigmoid", "ipo"])
def test_one_step_equals_trl_training_step(tiny, loss_type, monkeypatch):
    """TRL's `training_step` with its generation replaced by fixed completions, against one step of ours on the same
    completions: the ranking (with the EOS penalty deciding a pair), the loss and TRL's statistics."""
    pytest.importorskip("trl")
    monkeypatch.setenv("TRL_EXPERIMENTAL_SILENCE", "1")  # the trainer lives in trl.experimental in TRL 1.x
    from datasets import Dataset
    from trl.experimental.online_dpo import OnlineDPOConfig as TRLConfig
    from trl.experimental.online_dpo import OnlineDPOTrainer

    path = str(tiny / "model")
    tok = load_tokenizer(path)
    eos = tok.eos_token_id
    # Equal lengths: TRL's objective/kl and objective/entropy sum over the padding after a short completion as well,
    # ours over completion tokens only; with no padding the two definitions agree.
    first = [[5, 6, 7, eos], [8, 9, 22, 23], [10, 11, 12, 13]]
    second = [[14, 24, 25, eos], [15, 16, 17, eos], [18, 19, 20, 21]]
    policy, ref = load_causal_lm(path), load_causal_lm(path)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in ref.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g))
    ours_policy, ours_ref = load_causal_lm(path), load_causal_lm(path)
    ours_ref.load_state_dict(ref.state_dict())

    args = TRLConfig(
        output_dir=tempfile.mkdtemp(),
        per_device_train_batch_size=3,
        report_to="none",
        use_cpu=True,
        bf16=False,
        beta=0.2,  # type: ignore[arg-type]  # TRL types a list of per-epoch betas and takes a float too
        loss_type=loss_type,
        missing_eos_penalty=1.0,
    )
    trainer = OnlineDPOTrainer(
        model=policy,
        ref_model=ref,
        reward_funcs=[lambda completions, **_: lengths(None, completions)],
        args=args,
        processing_class=tok,
        train_dataset=Dataset.from_list([{"prompt": p} for p in PROMPTS]),
    )
    prompt_ids = tok(PROMPTS)["input_ids"]
    pid, pm = pad_rows(prompt_ids * 2, tok.pad_token_id, left=True)
    cid, cm = pad_rows(first + second, tok.pad_token_id)
    trainer._generate = lambda model, prompts, images=None: (pid, pm, cid, cm, None)  # type: ignore[method-assign]
    trl_loss = float(trainer.training_step(known(trainer.model), {"prompt": PROMPTS}))
    trl_stats = {k: v[-1] for k, v in trainer.stats.items() if v}

    engine = FixedEngine(tok, {tuple(p): [a, b] for p, a, b in zip(prompt_ids, first, second)})
    cfg = OnlineDPOConfig(
        learning_rate=1e-4,
        max_steps=1,
        batch_size=3,
        beta=0.2,
        loss_type=loss_type,
        missing_eos_penalty=1.0,
        logging_every=1,
        sample_every=100,
    )
    tracker = Tracker()
    rewards = RewardSet([LoadedReward("len", lengths)])
    online_dpo.train(
        cfg,
        ours_policy,
        tok,
        [{"prompt": p} for p in PROMPTS],
        online_dpo.RewardRanker(rewards, cfg.missing_eos_penalty),
        tracker,
        tempfile.mkdtemp(),
        ref_model=ours_ref,
        engine=engine,
    )
    # IPO's loss is a squared log-ratio, ~17 here, where one float32 step is 2e-6: the same tensors through another
    # CPU's matrix kernels (an Intel Xeon against the AMD EPYC this was written on) moved it by 1.3e-5, 7 steps
    assert tracker.last("train/loss") == pytest.approx(trl_loss, rel=2e-6, abs=1e-5)
    for key, value in trl_stats.items():
        assert tracker.last(f"train/{key}") == pytest.approx(value, abs=1e-4), key
    assert tracker.last("train/pairs_decided") == 1.0
    assert known(tracker.last("train/generation/tokens_per_s")) > 0
    assert 0 < known(tracker.last("train/generation/time_share")) <= 1


def test_judge_ties_do_not_train(tiny, tmp_path):
    """A judge that always answers "A" contradicts itself once the order is swapped: every pair is a tie, the loss
    is 0; a judge that prefers the answer with more tokens decides every pair."""
    path = str(tiny / "model")
    tok = load_tokenizer(path)
    prompt_ids = tok(PROMPTS)["input_ids"]
    engine = FixedEngine(tok, {tuple(p): [[5, 6, 7], [8, 9, 10, 11, 12]] for p in prompt_ids})
    cfg = OnlineDPOConfig(learning_rate=1e-2, max_steps=1, batch_size=3, logging_every=1, lora=LoraSpec(r=4))
    rows = [{"prompt": p} for p in PROMPTS]

    tracker = Tracker()
    result = online_dpo.train(
        cfg, load_causal_lm(path), tok, rows, online_dpo.JudgeRanker(lambda ps: ["A"] * len(ps), "{prompt}|{response_a}|{response_b}"),
        tracker, tmp_path / "ties", engine=engine,
    )  # fmt: skip
    assert tracker.last("train/pairs_decided") == 0.0 and tracker.last("train/loss") == 0.0
    assert result.adapter

    def longer(ps):
        return ["A" if len(p.split("|")[1]) > len(p.split("|")[2]) else "B" for p in ps]

    tracker = Tracker()
    online_dpo.train(
        cfg, load_causal_lm(path), tok, rows, online_dpo.JudgeRanker(longer, "{prompt}|{response_a}|{response_b}"),
        tracker, tmp_path / "judged", engine=engine,
    )  # fmt: skip
    assert tracker.last("train/pairs_decided") == 1.0 and known(tracker.last("train/loss")) > 0.0


def test_online_dpo_learns_what_the_ranker_prefers(tiny, tmp_path):
    """Ranked by the `length` reward (longer is better), twelve steps on the tiny model's own samples raise the
    mean score of its completions and the held-out greedy reward."""
    path = str(tiny / "model")
    tok = load_tokenizer(path)
    rows = [{"prompt": p} for p in ["The film", "I watched it and", "Critics say", "My review:"] * 8]
    from alignpipe.judges.rewards import length

    rewards = RewardSet([LoadedReward("length", length)])
    cfg = OnlineDPOConfig(
        learning_rate=3e-3,
        max_steps=12,
        batch_size=8,
        beta=0.1,
        max_completion_length=16,
        logging_every=4,
        eval_every=6,
        sample_every=100,
    )
    tracker = Tracker()
    online_dpo.train(
        cfg,
        load_causal_lm(path),
        tok,
        rows,
        online_dpo.RewardRanker(rewards, None),
        tracker,
        tmp_path,
        ref_model=load_causal_lm(path),
        eval_rows=rows[:4],
        rewards=rewards,
    )
    scores = tracker.series("train/objective/scores")
    evals = tracker.series("eval/reward")
    print("scores", scores, "eval", evals)
    assert scores[-1] > scores[0] + 0.1, scores
    assert evals[-1] > evals[0], evals


def _recipe(tiny, fields: str) -> str:
    return (
        f"name: o\nmodel: {{path: {tiny / 'model'}}}\n"
        f"datasets:\n  prompts: {{path: {tiny / 'data' / 'sentiment_prompts.jsonl'}}}\n"
        "stages:\n  - {id: p, kind: format, dataset: prompts, format: prompt_only}\n"
        f"  - {{id: odpo, kind: online_dpo, data: p{fields}}}\n"
    )


def test_validation_needs_exactly_one_ranker(tiny):
    parse_recipe(_recipe(tiny, ", rewards: [{function: sentiment_lexicon}]"))
    parse_recipe(_recipe(tiny, ", llm_judge: {model: base}"))
    with pytest.raises(RecipeError, match="online_dpo needs exactly one ranker"):
        parse_recipe(_recipe(tiny, ""))
    with pytest.raises(RecipeError, match="not both"):
        parse_recipe(_recipe(tiny, ", rewards: [{function: length}], llm_judge: {model: base}"))
    with pytest.raises(RecipeError, match="no stage named 'rm'"):
        parse_recipe(_recipe(tiny, ", rewards: [{reward_model: rm}]"))
    with pytest.raises(RecipeError, match="loss_type"):
        parse_recipe(_recipe(tiny, ", rewards: [{function: length}], loss_type: hinge"))
