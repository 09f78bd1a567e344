"""`steps_per_generation` / `generation_batch_size` (TRL's): one generation batch feeds several optimizer steps, each
on its own part, in TRL's order, with TRL's dapo normaliser, against log-probs taken at generation."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from support import tiny_split

from alignpipe.judges.reward_set import LoadedReward, RewardSet
from alignpipe.modeling import load_causal_lm
from alignpipe.recipe import RecipeError, parse_recipe
from alignpipe.recipe.stages import GRPOStage
from alignpipe.tracking import Tracker
from alignpipe.trainers import grpo, rloo
from alignpipe.trainers.configs import GRPOConfig, RLOOConfig


def length(prompts, completions, **_):
    return [float(len(c)) for c in completions]


@pytest.fixture(scope="module")
def prompts(tiny):
    tok, train, _ = tiny_split(tiny, "reverse", "prompt_completion", rows=64)
    return tok, [{"prompt": r["prompt"]} for r in train]


def run(tiny, prompts, tmp_path, monkeypatch, module, config, **overrides):
    """A run whose rollouts and trained micro-batches (per step, the row slices the update ran) are recorded: its
    tracker, the rollouts and the slices."""
    tok, rows = prompts
    rollouts: list[Any] = []
    trained: list[Any] = []
    original, micro_logps = module.rollout, grpo.GRPORun.micro_logps

    def recorded(run_, batch_rows):
        batch, sm = original(run_, batch_rows)
        rollouts.append(batch)
        return batch, sm

    def recorded_micro(run_, batch, sl, mask):
        while len(trained) <= run_.loop.step:
            trained.append([])
        trained[run_.loop.step].append((sl.start, sl.stop))
        return micro_logps(run_, batch, sl, mask)

    monkeypatch.setattr(module, "rollout", recorded)
    monkeypatch.setattr(grpo.GRPORun, "micro_logps", recorded_micro)
    # a learning rate too small to move a ratio from 1 within the check's tolerance
    args = dict(learning_rate=1e-12, max_steps=4, batch_size=8, num_generations=4, max_completion_length=6)
    cfg = config(**{**args, "logging_every": 1, "sample_every": 100, **overrides})
    tracker = Tracker()
    module.train(cfg, load_causal_lm(str(tiny / "model")), tok, rows, RewardSet([LoadedReward("length", length)]),
                 tracker, tmp_path)  # fmt: skip
    return tracker, rollouts, trained


def part_loss(batch, rows: slice, parts: int) -> float:
    """dapo's loss of a part at ratio 1 and β = 0: −Σ A·tokens over its rows, over the generation batch's tokens
    divided among its `parts` steps (TRL: `num_items_in_batch` × accumulation / steps_per_generation)."""
    tokens = batch.mask.sum(1)
    return float(-(batch.advantages[rows] * tokens[rows]).sum() / (tokens.sum() / parts))


@pytest.mark.parametrize("iterations", [1, 2])
def test_a_generation_batch_feeds_its_steps_a_part_each_in_trls_order(tiny, prompts, tmp_path, monkeypatch, iterations):
    """Two micro-batches per generation batch, one per optimizer step: 4 steps take 2 rollouts (1 with
    num_iterations 2, whose steps revisit the parts 0, 1, 0, 1); each step trains its own part, and its loss is that
    part's with TRL's normaliser (at ratio 1: a part whose completions all run to the length limit has loss 0, the
    group's advantages summing to 0); the log-probs the later steps compare against were taken at generation."""
    tracker, rollouts, trained = run(tiny, prompts, tmp_path, monkeypatch, grpo, GRPOConfig, steps_per_generation=2,
                                     num_iterations=iterations, loss_type="dapo")  # fmt: skip
    assert len(rollouts) == 2 // iterations
    assert all(r.old_logps is not None and r.completion_ids.size(0) == 16 for r in rollouts)
    assert trained == [[(0, 8)], [(8, 16)], [(0, 8)], [(8, 16)]]
    parts = [slice(0, 8), slice(8, 16)]
    expected = [part_loss(rollouts[s // 2 if iterations == 1 else 0], parts[s % 2], 2) for s in range(4)]
    assert tracker.series("train/loss") == pytest.approx(expected, rel=1e-4, abs=1e-6)
    assert any(abs(x) > 1e-4 for x in expected)  # not all parts' losses vanish: the check reads the normaliser


def test_one_part_per_generation_is_the_default(tiny, prompts, tmp_path, monkeypatch):
    """Without the knob, each optimizer step samples its own generation batch and trains on all of it."""
    tracker, rollouts, trained = run(tiny, prompts, tmp_path, monkeypatch, grpo, GRPOConfig, loss_type="dapo",
                                     max_steps=2)  # fmt: skip
    assert len(rollouts) == 2 and all(r.old_logps is None for r in rollouts)
    assert trained == [[(0, 8)], [(0, 8)]]
    assert tracker.series("train/loss") == pytest.approx(
        [part_loss(r, slice(0, 8), 1) for r in rollouts], rel=1e-4, abs=1e-6
    )


def test_rloo_generation_batch_in_completions(tiny, prompts, tmp_path, monkeypatch):
    """RLOO with generation_batch_size = 2 × batch_size and 2 accumulation steps: one rollout of 16 completions
    feeds one step (both micro-batches), the next rollout the next."""
    _, rollouts, trained = run(tiny, prompts, tmp_path, monkeypatch, rloo, RLOOConfig, generation_batch_size=32,
                               max_steps=4, gradient_accumulation_steps=2, beta=0.0)  # fmt: skip
    assert len(rollouts) == 2 and all(r.completion_ids.size(0) == 32 and r.old_logps is not None for r in rollouts)
    assert trained == [[(0, 8), (8, 16)], [(16, 24), (24, 32)]] * 2


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"steps_per_generation": 3, "gradient_accumulation_steps": 2}, "does not feed whole optimizer steps"),
        ({"generation_batch_size": 12}, "must be a multiple of batch_size"),
        ({"generation_batch_size": 16, "steps_per_generation": 2}, "set one of them"),
    ],
)
def test_generation_batches_that_do_not_split_into_steps_are_refused(kwargs, message):
    for config in (GRPOConfig, RLOOConfig):
        with pytest.raises(ValueError, match=message):
            config(batch_size=8, **kwargs)


def test_the_recipe_names_the_stage(tiny):
    from pathlib import Path

    text = (Path(__file__).parents[1] / "pipelines" / "tiny-grpo.yaml").read_text().replace("assets/tiny", str(tiny))
    recipe = parse_recipe(text, ["stages.grpo.steps_per_generation=4"])
    assert (
        recipe.stage("grpo", GRPOStage).steps_per_rollout
        == 4 // recipe.stage("grpo", GRPOStage).gradient_accumulation_steps
    )
    with pytest.raises(RecipeError) as e:
        parse_recipe(text, ["stages.grpo.generation_batch_size=7"])
    assert "(stage 'grpo')" in str(e.value) and "must be a multiple of batch_size" in str(e.value)


def test_the_normaliser_is_trls(tiny):
    """`step_tokens_per_process` of a generation batch split among k steps equals TRL 1.16's dapo normaliser
    (`num_items_in_batch / num_processes × gradient_accumulation_steps / steps_per_generation`) on one process."""
    from alignpipe.distributed import make_accelerator

    class Loop:
        accelerator = make_accelerator()

    mask = torch.tensor([[1, 1, 0], [1, 1, 1], [1, 0, 0], [1, 1, 1]])
    accumulation, steps_per_generation = 2, 4
    trl = float(mask.sum()) / 1 * accumulation / steps_per_generation
    assert grpo.step_tokens_per_process(Loop(), mask, steps_per_generation // accumulation) == trl  # type: ignore[arg-type]


def test_a_run_resumed_between_the_steps_of_a_generation_batch_samples_it_again(tiny, prompts, tmp_path, monkeypatch):
    """A checkpoint after step 1 of a 2-step generation batch: the resumed run has no rollout in memory, so (as TRL)
    it samples the batch's prompts again and trains step 2 on the second part of that new rollout."""
    run(tiny, prompts, tmp_path, monkeypatch, grpo, GRPOConfig, steps_per_generation=2, max_steps=2, save_every=1)
    assert (tmp_path / "checkpoints" / "step-1" / "state.json").exists()
    tracker, rollouts, trained = run(tiny, prompts, tmp_path, monkeypatch, grpo, GRPOConfig, steps_per_generation=2,
                                     save_every=1)  # fmt: skip
    assert len(rollouts) == 2 and trained[1:] == [[(8, 16)], [(0, 8)], [(8, 16)]]
    assert len(tracker.series("train/loss")) == 3
