"""End-to-end learning checks (minutes on 2 CPU cores): `make test-slow`."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient
from support import experiment_id

from alignpipe.recipe import load_recipe

pytestmark = pytest.mark.slow
ROOT = Path(__file__).parents[1]


def run_recipe(name: str, tiny: Path, tmp_path: Path, edits: dict[str, str] | None = None):
    from flows.pipeline import pipeline

    path = tmp_path / name
    text = (
        (ROOT / "pipelines" / name)
        .read_text()
        .replace("assets/tiny", str(tiny))
        .replace("./runs", str(tmp_path / "runs"))
    )
    for old, new in (edits or {}).items():
        assert old in text, old
        text = text.replace(old, new)
    path.write_text(text)
    state = pipeline(recipe_path=str(path), return_state=True)
    assert state.is_completed(), state.message
    recipe = load_recipe(path)
    summary = json.loads((recipe.run_root / "runs" / f"{state.state_details.flow_run_id}.json").read_text())
    return recipe, summary


def child_metrics(recipe, summary) -> dict[str, dict[str, float]]:
    client = MlflowClient(recipe.tracking_uri)
    runs = client.search_runs(
        [experiment_id(client, recipe.experiment_name)], f"tags.mlflow.parentRunId = '{summary['mlflow_run_id']}'"
    )
    return {r.data.tags["alignpipe.stage_id"]: r.data.metrics for r in runs}


def test_tiny_dpo_beats_sft_and_reward_model_is_accurate(prefect_harness, tiny, tmp_path):
    recipe, summary = run_recipe("tiny-dpo.yaml", tiny, tmp_path)
    metrics = child_metrics(recipe, summary)
    print(
        "reward model eval accuracy",
        metrics["rm"]["eval/accuracy"],
        "DPO win rate vs SFT",
        metrics["judge"]["judge/win_rate"],
        "by reward model",
        metrics["judge-rm"]["judge/win_rate"],
    )
    assert metrics["rm"]["eval/accuracy"] >= 0.90
    assert metrics["judge"]["judge/win_rate"] >= 0.65


def test_tiny_kto_beats_sft_on_unpaired_thumbs(prefect_harness, tiny, tmp_path):
    recipe, summary = run_recipe("tiny-kto.yaml", tiny, tmp_path)
    metrics = child_metrics(recipe, summary)
    print(
        "KTO win rate vs SFT", metrics["judge"]["judge/win_rate"], "eval margin", metrics["kto"]["eval/rewards/margins"]
    )
    assert metrics["judge"]["judge/win_rate"] >= 0.65
    assert metrics["kto"]["eval/rewards/margins"] > 0


def test_tiny_online_dpo_beats_sft(prefect_harness, tiny, tmp_path):
    recipe, summary = run_recipe("tiny-online-dpo.yaml", tiny, tmp_path)
    metrics = child_metrics(recipe, summary)
    print("online DPO win rate vs SFT", metrics["judge"]["judge/win_rate"])
    assert metrics["judge"]["judge/win_rate"] >= 0.65
    assert metrics["online-dpo"]["train/objective/scores"] > 1.5, "the reward model's scores rose from ~1.0"


def test_tiny_grpo_raises_held_out_accuracy_by_40_points(prefect_harness, tiny, tmp_path):
    recipe, summary = run_recipe("tiny-grpo.yaml", tiny, tmp_path)
    judge = child_metrics(recipe, summary)["judge"]
    print("held-out exact match: SFT", judge["judge/baseline_score"], "GRPO", judge["judge/candidate_score"])
    assert judge["judge/candidate_score"] - judge["judge/baseline_score"] >= 0.40


def test_tiny_grpo_with_this_releases_options_still_learns(prefect_harness, tiny, tmp_path):
    """The GRPO recipe with VESPO's gamma-weighted loss, two optimizer steps per generation batch (the second off
    the policy that sampled it), the hf engine's sampling correction, an adaptive entropy bonus and a reference that
    follows the policy (TR-DPO's sync, with a KL term to make it matter): held-out accuracy still rises by 40 points."""
    edits = {
        "    loss_type: dapo\n": "    loss_type: vespo\n    steps_per_generation: 2\n"
        "    sampling_correction: token_truncate\n    entropy_coef: 0.001\n    use_adaptive_entropy: true\n"
        "    sync_ref_model: true\n    ref_model_sync_steps: 10\n",
        "    beta: 0.0                          # no reference model loaded\n": "    beta: 0.01\n",
        "    max_steps: 40\n    max_completion_length: 10": "    max_steps: 48\n    max_completion_length: 10",
    }
    recipe, summary = run_recipe("tiny-grpo.yaml", tiny, tmp_path, edits)
    judge = child_metrics(recipe, summary)["judge"]
    print("held-out exact match: SFT", judge["judge/baseline_score"], "GRPO", judge["judge/candidate_score"])
    assert judge["judge/candidate_score"] - judge["judge/baseline_score"] >= 0.40


def test_tiny_grpo_learns_to_call_its_tool(prefect_harness, tiny, tmp_path):
    """The lookup agent: the SFT model mostly guesses without its tool; GRPO, whose rollouts run the calls, learns
    that calling pays. The judge calls the tool for both models (the eval split's prompts, greedy)."""
    recipe, summary = run_recipe("tiny-tools.yaml", tiny, tmp_path)
    metrics = child_metrics(recipe, summary)
    judge, grpo = metrics["judge"], metrics["grpo"]
    print("lookup exact match: SFT", judge["judge/baseline_score"], "GRPO", judge["judge/candidate_score"],
          "calls per completion (last step)", grpo["train/tools/call_frequency"])  # fmt: skip
    assert judge["judge/candidate_score"] - judge["judge/baseline_score"] >= 0.50
    assert grpo["train/tools/call_frequency"] >= 0.8


def test_tiny_dpo_with_a_loss_mix_beats_sft(prefect_harness, tiny, tmp_path):
    """The DPO recipe with MPO's loss mix (sigmoid + BCO + the chosen NLL) and LD-DPO's length weighting: the aligned
    model still beats the SFT model it starts from."""
    edits = {
        "    loss_type: sigmoid ": "    loss_type: [sigmoid, bco_pair, sft]\n    loss_weights: [0.8, 0.2, 0.1]\n"
        "    ld_alpha: 0.5\n    # was: loss_type: sigmoid "
    }
    recipe, summary = run_recipe("tiny-dpo.yaml", tiny, tmp_path, edits)
    metrics = child_metrics(recipe, summary)
    print("DPO (loss mix) win rate vs SFT", metrics["judge"]["judge/win_rate"])
    assert metrics["judge"]["judge/win_rate"] >= 0.65


def test_tiny_rloo_raises_held_out_accuracy_by_40_points(prefect_harness, tiny, tmp_path):
    recipe, summary = run_recipe("tiny-rloo.yaml", tiny, tmp_path)
    judge = child_metrics(recipe, summary)["judge"]
    print("held-out exact match: SFT", judge["judge/baseline_score"], "RLOO", judge["judge/candidate_score"])
    assert judge["judge/candidate_score"] - judge["judge/baseline_score"] >= 0.40


def test_tiny_ppo_raises_rlhf_reward_and_beats_sft(prefect_harness, tiny, tmp_path):
    recipe, summary = run_recipe("tiny-ppo.yaml", tiny, tmp_path)
    metrics = child_metrics(recipe, summary)
    client = MlflowClient(recipe.tracking_uri)
    ppo_run = client.search_runs(
        [experiment_id(client, recipe.experiment_name)],
        f"tags.mlflow.parentRunId = '{summary['mlflow_run_id']}' and tags.`alignpipe.stage_id` = 'ppo'",
    )[0]
    history = [m.value for m in client.get_metric_history(ppo_run.info.run_id, "objective/rlhf_reward")]
    print("rlhf_reward", history[0], "→", history[-1], "win rate vs SFT", metrics["judge"]["judge/win_rate"])
    assert history[-1] > history[0]
    assert metrics["judge"]["judge/win_rate"] >= 0.65


def test_tiny_ppo_adaptive_kl_holds_the_target_and_beats_sft(prefect_harness, tiny, tmp_path):
    """tiny-ppo with TRL 0.7's adaptive KL controller (init 0.2, target 1 nat per response, horizon 64 episodes: up to
    ±10% of the coefficient per 32-episode batch). A batch's KL is measured on 32 episodes (±40% sampling noise between
    batches at this size, and single batches at 3× the target), so the check is on means over 10 updates (320
    episodes): over the last half of training each stays within ±50% of the target. 5-update means passed on the AMD
    EPYC this was written on; on an Intel Xeon, whose float32 kernels round differently and so sample another run,
    one reached 1.7 through a single batch at 3.3 that a horizon of 64 episodes cannot chase (the 10-update means
    there: 1.42 and 0.94). PPO still beats SFT by the judge."""
    target = 1.0
    edits = {
        "    kl_coef: 0.05\n": f"    kl_coef: 0.2\n    adap_kl_ctrl: true\n    target: {target}\n    horizon: 64\n",
        "    logging_every: 5\n": "    logging_every: 1\n",
    }
    recipe, summary = run_recipe("tiny-ppo.yaml", tiny, tmp_path, edits)
    metrics = child_metrics(recipe, summary)
    client = MlflowClient(recipe.tracking_uri)
    ppo_run = client.search_runs(
        [experiment_id(client, recipe.experiment_name)],
        f"tags.mlflow.parentRunId = '{summary['mlflow_run_id']}' and tags.`alignpipe.stage_id` = 'ppo'",
    )[0]

    def history(key):
        return [m.value for m in sorted(client.get_metric_history(ppo_run.info.run_id, key), key=lambda m: m.step)]

    kl, coef = history("objective/kl"), history("objective/kl_coef")
    assert len(kl) == len(coef) == 40 and coef[0] == 0.2 and len(set(coef)) > 30, "the coefficient moves every update"
    windows = [sum(kl[i : i + 10]) / 10 for i in range(20, 40, 10)]
    print(
        "KL per update",
        [round(k, 2) for k in kl],
        "\nlast-half 10-update means",
        [round(w, 3) for w in windows],
        "\nkl_coef",
        [round(c, 3) for c in coef],
        "\nwin rate vs SFT",
        metrics["judge"]["judge/win_rate"],
    )
    assert all(0.5 * target <= w <= 1.5 * target for w in windows), windows
    assert metrics["judge"]["judge/win_rate"] >= 0.65
