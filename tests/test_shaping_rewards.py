"""The reasoning-RL shaping rewards (`think_format`, `ngram_repetition`, `overlong_penalty`) equal TRL 1.16's
`trl.rewards` on the same completions; token rewards get the completions' ids in RL stages and are refused where there
are none; a function of one's own gets `completion_ids` by naming it."""

from __future__ import annotations

import random

import pytest

from alignpipe.judges.reward_set import LoadedReward, RewardSet
from alignpipe.judges.rewards import (
    RewardFunctionError,
    check_builtin_kwargs,
    ngram_repetition,
    overlong_penalty,
    score,
    think_format,
)
from alignpipe.recipe.stages import GRPOStage

trl_rewards = pytest.importorskip("trl.rewards")

COMPLETIONS = [
    "<think>\nThis is my reasoning.\n</think>\nThis is my answer.",
    "<think>\nThis is my reasoning.\nThis is my answer.",
    "<think>a</think><think>b</think> twice",
    "no reasoning at all",
    "<think></think>",
    " <think>x</think> leading space",
    "<think>line\n\nbreaks</think>\n\nanswer\nmore",
]


def test_think_format_equals_trls():
    expected = trl_rewards.think_format_reward([[{"content": c}] for c in COMPLETIONS])
    assert think_format(None, COMPLETIONS) == expected
    assert 0 < sum(expected) < len(expected)


def token_lists(seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    rows = [[], [1], [1, 2], [5] * 9, [1, 2, 3, 1, 2, 3, 1, 2]]
    rows += [[rng.randrange(6) for _ in range(rng.randrange(3, 40))] for _ in range(20)]
    return rows


@pytest.mark.parametrize(("ngram_size", "max_penalty"), [(3, -1.0), (2, -0.5), (1, -2.0)])
def test_ngram_repetition_equals_trls(ngram_size, max_penalty):
    ids = token_lists(ngram_size)
    theirs = trl_rewards.get_repetition_penalty_reward(ngram_size, max_penalty)(completion_ids=ids)
    ours = ngram_repetition(None, [""] * len(ids), completion_ids=ids, ngram_size=ngram_size, max_penalty=max_penalty)
    assert ours == theirs and min(ours) < 0


@pytest.mark.parametrize(("max_length", "cache"), [(20, 5), (30, 30), (10, 1)])
def test_overlong_penalty_equals_trls(max_length, cache):
    ids = token_lists(max_length)
    theirs = trl_rewards.get_soft_overlong_punishment(max_length, cache)(completion_ids=ids)
    ours = overlong_penalty(None, [""] * len(ids), completion_ids=ids, max_length=max_length, cache=cache)
    assert ours == theirs and len(set(ours)) > 1


def test_token_rewards_need_ids_and_their_options_are_checked():
    with pytest.raises(RewardFunctionError, match="counts the completion's tokens"):
        score(overlong_penalty, "overlong_penalty", ["p"], ["c"])
    with pytest.raises(ValueError, match="must not exceed max_length"):
        check_builtin_kwargs("overlong_penalty", {"max_length": 8, "cache": 16})
    with pytest.raises(ValueError, match="max_penalty"):
        check_builtin_kwargs("ngram_repetition", {"max_penalty": 1.0})


def test_a_function_naming_completion_ids_gets_them_and_others_do_not():
    seen = {}

    def with_ids(prompts, completions, completion_ids, **_):
        seen["ids"] = completion_ids
        return [float(len(i)) for i in completion_ids]

    def without(prompts, completions):  # no **kwargs: nothing it did not ask for may be passed
        return [1.0] * len(completions)

    rewards = RewardSet([LoadedReward("ids", with_ids), LoadedReward("plain", without)])
    total, per = rewards(["a", "b"], ["x", "yy"], None, [[1, 2, 3], [4]])
    assert seen["ids"] == [[1, 2, 3], [4]] and per[:, 0].tolist() == [3.0, 1.0] and total.tolist() == [4.0, 2.0]


def test_grpo_rollouts_hand_the_token_rewards_each_completions_ids(tiny, tmp_path):
    """A GRPO run with overlong_penalty: the reward of each completion is its length's, as the rollout recorded it
    (max_length 6, cache 4: completions of 6 tokens get −1, the untrained model rarely ends sooner)."""
    from support import tiny_split

    from alignpipe.modeling import load_causal_lm
    from alignpipe.tracking import Tracker
    from alignpipe.trainers import grpo
    from alignpipe.trainers.configs import GRPOConfig

    tok, train, _ = tiny_split(tiny, "reverse", "prompt_completion", rows=32)
    rows = [{"prompt": r["prompt"]} for r in train]
    rewards = RewardSet([LoadedReward("overlong", overlong_penalty, kwargs={"max_length": 6, "cache": 4})])
    recorded = []
    original = grpo.rollout

    def record(run, batch_rows):
        batch, sm = original(run, batch_rows)
        recorded.append((batch.rewards, sm.lengths))
        return batch, sm

    import unittest.mock

    cfg = GRPOConfig(max_steps=1, batch_size=8, num_generations=4, max_completion_length=6, sample_every=100)
    with unittest.mock.patch.object(grpo, "rollout", record):
        grpo.train(cfg, load_causal_lm(str(tiny / "model")), tok, rows, rewards, Tracker(), tmp_path)
    ((scores, lengths),) = recorded
    expected = [0.0 if n <= 2 else (2 - n) / 4 for n in lengths.tolist()]
    assert scores.tolist() == pytest.approx(expected)


def test_a_judge_refuses_a_token_reward_and_an_rl_stage_takes_it(tiny, tmp_path):
    from support import demo_recipe

    from alignpipe.recipe import RecipeError, parse_recipe

    text = demo_recipe(tiny, tmp_path)
    with pytest.raises(RecipeError, match="counts the completion's tokens, which a judge does not keep"):
        parse_recipe(text.replace("reward: sentiment_lexicon", "reward: overlong_penalty", 1))
    from pathlib import Path

    grpo_text = (
        (Path(__file__).parents[1] / "pipelines" / "tiny-grpo.yaml").read_text().replace("assets/tiny", str(tiny))
    )
    line = "      - {function: exact_match}        # compares the completion with the `answer` column\n"
    extra = "      - {function: overlong_penalty, kwargs: {max_length: 16, cache: 4}, weight: 0.5}\n"
    recipe = parse_recipe(grpo_text.replace(line, line + extra))
    assert [r.function for r in recipe.stage("grpo", GRPOStage).rewards] == ["exact_match", "overlong_penalty"]
