"""`resources.processes: 2` runs a stage as two data-parallel ranks (gloo on CPU): the same global batch
gives the same loss curve as one process within tolerance, and only rank 0 logs and writes outputs."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from mlflow.tracking import MlflowClient
from support import known

from alignpipe.launch import free_port, launch
from alignpipe.pipeline_run import start_pipeline_run
from alignpipe.plan import plan, write_spec
from alignpipe.recipe import parse_recipe


def run_stage(tiny, tmp_path, text_fn, stage: str, processes: int, overrides: list[str]):
    """Run `stage` with `processes` ranks after its ancestors. The runs of a test share one workdir, so the ancestors
    (same config, same cache key) are trained once and reused; `stage` itself always runs again (its cache key
    ignores `resources`: the DDP and FSDP runs share a folder, which the later run clears)."""
    recipe = parse_recipe(text_fn(tiny, tmp_path / "runs"), overrides)
    plans = plan(recipe, force=[stage])
    tracking = start_pipeline_run(recipe, f"p{processes}")
    done: dict[str, Any] = {}
    for sid in recipe.ancestors(stage):
        inputs = {a: done[a] for a in recipe.ancestors(sid)}
        done[sid] = (
            plans[sid].manifest
            if plans[sid].cached
            else launch(write_spec(recipe, plans[sid], inputs, tracking, "x"), on_line=lambda line: None)
        )
    spec = write_spec(recipe, plans[stage], {a: done[a] for a in recipe.ancestors(stage)}, tracking, "x")
    manifest = launch(spec, on_line=lambda line: None, processes=processes)
    client = MlflowClient(recipe.tracking_uri)
    runs = client.search_runs(
        [tracking[1]], f"tags.`alignpipe.stage_id` = '{stage}' and tags.mlflow.parentRunId = '{tracking[2]}'"
    )
    losses = [m.value for m in client.get_metric_history(runs[0].info.run_id, "train/loss")]
    return manifest, runs, losses


def demo(tiny, workdir):
    from support import demo_recipe

    return demo_recipe(tiny, workdir)


def dpo(tiny, workdir):
    from pathlib import Path

    text = (Path(__file__).parents[1] / "pipelines" / "tiny-dpo.yaml").read_text()
    return text.replace("assets/tiny", str(tiny)).replace("./runs", str(workdir))


BOTH = ("ddp", "fsdp")


@pytest.mark.parametrize(
    "text_fn,stage,per_process,strategies",
    [
        (
            demo,
            "sft",
            ["stages.sft.max_steps=30", "stages.sft.logging_every=5", "stages.sft.eval_every=null"],
            BOTH,
        ),
        (dpo, "dpo", ["stages.sft.max_steps=10", "stages.dpo.max_steps=12", "stages.dpo.logging_every=3"], BOTH),
        # TR-DPO: every rank mixes the same (under FSDP: gathered) policy into its reference copy. FSDP alone: under
        # DDP each rank's copy is the whole policy, the mixing a single process's
        (
            dpo,
            "dpo",
            ["stages.sft.max_steps=10", "stages.dpo.max_steps=9", "stages.dpo.logging_every=3"]
            + ["stages.dpo.sync_ref_model=true", "stages.dpo.ref_model_sync_steps=3"],
            ("fsdp",),
        ),
        # the reference pass shared out over the ranks (each scores every other pair) and gathered back in order.
        # FSDP alone: the sharing is the same code under DDP, and a sharded forward also needs every rank in every
        # forward, which an uneven share would hang
        (
            dpo,
            "dpo",
            ["stages.sft.max_steps=10", "stages.dpo.max_steps=6", "stages.dpo.logging_every=3"]
            + ["stages.dpo.precompute_ref_logps=true", "stages.dpo.precompute_ref_batch_size=3"],
            ("fsdp",),
        ),
    ],
    ids=["sft", "dpo", "dpo-synced-reference", "dpo-precomputed-reference"],
)
def test_two_processes_match_one_process_with_ddp_and_fsdp(
    tiny, tmp_path_factory, monkeypatch, text_fn, stage, per_process, strategies
):
    """The same global batch (16 rows: one process × 16, or two × 8) gives the same logged loss curve, whether the
    two processes hold full copies (DDP) or shards (FSDP2), and the FSDP model saves as a normal transformers
    folder with the same weights. The DPO cases share one workdir on a test worker, so its SFT ancestor (the same
    config in each) is trained once there. The ranks are forked from the stage host, but SFT's DDP ranks, which
    torchrun starts (as on a machine with the host turned off)."""
    from transformers import AutoModelForCausalLM

    workdir = _shared_workdir(tmp_path_factory, text_fn.__name__)
    one, _, single = run_stage(tiny, workdir, text_fn, stage, 1, per_process + [f"stages.{stage}.batch_size=16"])
    alone = AutoModelForCausalLM.from_pretrained(one.outputs["model"])
    two = per_process + [f"stages.{stage}.batch_size=8", f"stages.{stage}.resources.processes=2"]
    curves = {}
    for strategy in strategies:
        if (stage, strategy) == ("sft", "ddp"):
            monkeypatch.setenv("ALIGNPIPE_STAGE_HOST", "0")
        else:
            monkeypatch.delenv("ALIGNPIPE_STAGE_HOST", raising=False)
        manifest, runs, curves[strategy] = run_stage(
            tiny, workdir, text_fn, stage, 2, two + [f"stages.{stage}.resources.strategy={strategy}"]
        )
        assert len(runs) == 1, "only rank 0 opened an MLflow run"
        assert manifest.metrics["steps"] == one.metrics["steps"]
        print(stage, strategy, [f"{a:.6f}/{b:.6f}" for a, b in zip(single, curves[strategy])])
        assert len(single) == len(curves[strategy])
        assert max(abs(a - b) for a, b in zip(single, curves[strategy])) <= 1e-4, (strategy, single, curves[strategy])
    assert strategies[-1] == "fsdp"
    sharded = AutoModelForCausalLM.from_pretrained(manifest.outputs["model"])
    for (name, a), b in zip(alone.state_dict().items(), sharded.state_dict().values()):
        assert torch.allclose(a, b, atol=1e-4), name


_WORKDIRS: dict[str, object] = {}


def _shared_workdir(tmp_path_factory, name: str):
    """One folder per recipe on this test worker, for the runs whose ancestors are the same."""
    if name not in _WORKDIRS:
        _WORKDIRS[name] = tmp_path_factory.mktemp(f"shared-{name}")
    return _WORKDIRS[name]


def test_fsdp_stage_killed_mid_run_resumes_from_its_sharded_checkpoint(tiny, tmp_path):
    from support import demo_recipe, kill_at_checkpoint, sft_spec_after_format

    from alignpipe.launch import stage_command

    recipe = parse_recipe(
        demo_recipe(tiny, tmp_path / "runs"),
        [
            "stages.sft.max_steps=40",
            "stages.sft.save_every=10",
            "stages.sft.logging_every=5",
            "stages.sft.eval_every=null",
            "stages.sft.batch_size=8",
            "stages.sft.resources.processes=2",
            "stages.sft.resources.strategy=fsdp",
        ],
    )
    plans, spec, _ = sft_spec_after_format(recipe)
    ckpt = plans["sft"].dir / "checkpoints" / "step-10"
    # SIGKILL to the launcher's process group; the ranks (torchrun puts them in groups of their own) die with their
    # launcher. Before they did, orphaned ranks trained on to the end beside the resumed stage.
    kill_at_checkpoint(stage_command(spec, processes=2), ckpt)
    assert not (plans["sft"].dir / "manifest.json").exists()
    shards = sorted(p.name for p in (ckpt / "pytorch_model_fsdp_0").iterdir())
    assert len([s for s in shards if s.endswith(".distcp")]) == 2, shards  # one shard per rank

    manifest = launch(spec, on_line=lambda line: None, processes=2)
    assert manifest.info["resumed_from"] >= 10 and manifest.metrics["steps"] == 40
    client = MlflowClient(recipe.tracking_uri)
    steps = [m.step for m in client.get_metric_history(known(manifest.mlflow_run_id), "train/loss")]
    assert min(steps) == 5 and max(steps) == 40, steps  # one MLflow run across the kill


def test_under_fsdp_the_lm_head_runs_in_chunks_where_the_layout_keeps_it_gathered(tiny):
    """Two FSDP2 ranks: with accelerate's layout (the final norm and head a group kept gathered after the forward)
    the head runs chunk by chunk on the decoder's output, never on the whole sequence; where the root re-shards the
    head after the forward, the head runs inside the forward. Values and every gradient equal the plain model's, and
    a DPO batch's too (through the fused head with accelerate's layout)."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).with_name("wrapped_head_check.py")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port())]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out = subprocess.run(
        [*cmd, str(script), "fsdp", str(tiny / "model")], capture_output=True, text=True, timeout=300, env=env
    )
    assert out.returncode == 0, out.stderr[-3000:]
    rows = {r["layout"]: r for r in map(json.loads, (x for x in out.stdout.splitlines() if x.startswith("{")))}
    for row in rows.values():
        assert row["values"] < 1e-5 and row["grad"] < 1e-5, row
        assert row["dpo_loss"] < 1e-6 and row["dpo_grad"] < 1e-5, row  # a DPO batch as the plain model's
    # DPO's fused head runs where the head runs outside the forward; the re-sharding root takes the chunked one
    assert rows["accelerate"]["dpo_fused"] and not rows["root-reshards"]["dpo_fused"], rows
    assert max(rows["accelerate"]["widths"]) < 11 and not rows["accelerate"]["reshards_head"], rows
    assert max(rows["root-reshards"]["widths"]) == 12 and rows["root-reshards"]["reshards_head"], rows


def test_a_log_points_metrics_over_processes_take_means_sums_and_extremes(monkeypatch):
    """Two ranks' metrics at a log point: means averaged, throughputs summed, extremes (completions/max_length,
    sampling/…/min and /max, a device's memory/max_…) the ranks' extreme, as TRL gathers them; a metric one rank lacks from the other alone."""
    import accelerate.utils

    from alignpipe.trainers.common import across_processes

    ranks = [
        {"loss": 1.0, "tokens_per_s": 10.0, "completions/max_length": 6.0, "completions/min_length": 2.0,
         "sampling/importance_sampling_ratio/max": 1.5, "sampling/importance_sampling_ratio/min": 0.5, "only": 3.0,
         "memory/max_allocated_gb": 20.0},
        {"loss": 3.0, "tokens_per_s": 30.0, "completions/max_length": 9.0, "completions/min_length": 1.0,
         "sampling/importance_sampling_ratio/max": 1.2, "sampling/importance_sampling_ratio/min": 0.8,
         "memory/max_allocated_gb": 24.0},
    ]  # fmt: skip
    monkeypatch.setattr(accelerate.utils, "gather_object", lambda _: ranks)

    class TwoRanks:
        num_processes = 2

    out = across_processes(TwoRanks(), ranks[0])
    assert out == {
        "loss": 2.0, "tokens_per_s": 40.0, "completions/max_length": 9.0, "completions/min_length": 1.0,
        "sampling/importance_sampling_ratio/max": 1.5, "sampling/importance_sampling_ratio/min": 0.5, "only": 3.0,
        "memory/max_allocated_gb": 24.0,
    }  # fmt: skip


def test_a_windows_generation_rate_and_share_and_their_sum_over_processes(monkeypatch):
    """`Throughput`: a rollout's generation (seconds, sampled tokens) gives the window's generation/tokens_per_s and
    its share of the window's wall time; a window without one reports neither; over processes the rates add up (each
    rank samples its share at once) and the shares are averaged."""
    import accelerate.utils

    from alignpipe.trainers import common

    clock = iter([0.0, 4.0, 4.0, 9.0, 9.0])
    monkeypatch.setattr(common.time, "perf_counter", lambda: next(clock))
    meter = common.Throughput()
    meter.add(100, 2)
    meter.add_generation(1.0, 300)
    meter.add_generation(0.5, 150)
    assert meter.read() == {
        "tokens_per_s": 25.0, "samples_per_s": 0.5, "generation/tokens_per_s": 300.0, "generation/time_share": 0.375,
    }  # fmt: skip
    assert meter.read() == {"tokens_per_s": 0.0, "samples_per_s": 0.0}, "reset: a window with no rollout"
    clock = iter(
        [0.0, 10.0, 10.0, 12.0, 12.0]
    )  # a fresh meter: the engine's copies of the policy's weights, 2.5 s of 10
    meter = common.Throughput()
    meter.add_sync(2.0)
    meter.add_sync(0.5)
    assert meter.read()["generation/sync_time_share"] == 0.25
    assert "generation/sync_time_share" not in meter.read(), "reset"
    ranks = [{"generation/tokens_per_s": 300.0, "generation/time_share": 0.4}, {"generation/tokens_per_s": 200.0,
             "generation/time_share": 0.2}]  # fmt: skip
    monkeypatch.setattr(accelerate.utils, "gather_object", lambda _: ranks)

    class TwoRanks:
        num_processes = 2

    out = common.across_processes(TwoRanks(), ranks[0])
    assert out == {"generation/tokens_per_s": 500.0, "generation/time_share": pytest.approx(0.3)}


def grpo(tiny, workdir):
    from pathlib import Path

    text = (Path(__file__).parents[1] / "pipelines" / "tiny-grpo.yaml").read_text()
    return text.replace("assets/tiny", str(tiny)).replace("./runs", str(workdir))


def test_grpo_with_several_steps_per_generation_and_a_sampling_correction_runs_on_two_ranks(tiny, tmp_path):
    """Each rank samples its own completions, so two ranks cannot repeat one process's curve; what must hold is that
    the collectives of a generation batch split over two optimizer steps (the dapo normaliser's token count, the
    sampling correction's statistics) line up across ranks: the run ends, logs every step once from rank 0, and the
    hf engine's sampler agrees with the trainer (importance weights 1)."""
    overrides = [
        "stages.sft.max_steps=10",
        "stages.grpo.max_steps=4",
        "stages.grpo.batch_size=8",
        "stages.grpo.num_generations=4",
        "stages.grpo.steps_per_generation=2",
        "stages.grpo.sampling_correction=token_truncate",
        "stages.grpo.logging_every=1",
        "stages.grpo.resources.processes=2",  # DDP (FSDP is refused for stages whose policy generates)
    ]
    manifest, runs, losses = run_stage(tiny, tmp_path, grpo, "grpo", 2, overrides)
    assert len(runs) == 1, "only rank 0 opened an MLflow run"
    assert manifest.metrics["steps"] == 4 and len(losses) == 4
    assert all(torch.isfinite(torch.tensor(losses)))
    client = MlflowClient(parse_recipe(grpo(tiny, tmp_path / "runs"), overrides).tracking_uri)
    ratios = [
        m.value for m in client.get_metric_history(runs[0].info.run_id, "train/sampling/importance_sampling_ratio/mean")
    ]
    assert len(ratios) == 4 and all(abs(r - 1) < 1e-3 for r in ratios), ratios


@pytest.mark.parametrize("variant", [[], ["lora", "checkpointing"]], ids=["full", "lora-checkpointing"])
def test_ppo_ranks_stay_in_step_with_every_batch_control_on(tiny, tmp_path, variant):
    """Two DDP ranks of PPO, each rolling out its own prompts: after three updates both hold the same policy and value
    weights (the micro-batches' passes run inside the wrapper's forward, so both models' gradients are all-reduced),
    the same KL coefficient moved by the same KL (the mean of the ranks'), the same running score moments (updated
    with both ranks' scores), and the same early-stopping decisions (on the ranks' mean policy KL); rank 1 skips every
    micro-batch over the ratio threshold and rank 0 none, and both still step (`tests/ppo_ddp_check.py`). The same with
    a LoRA policy (the reference its adapter-disabled self) and activation checkpointing."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).with_name("ppo_ddp_check.py")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port())]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out = subprocess.run(
        [*cmd, str(script), str(tiny), str(tmp_path), *variant], capture_output=True, text=True, timeout=300, env=env
    )
    assert out.returncode == 0, out.stderr[-3000:]
    zero, one = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1))
    assert zero["end"] == one["end"] and zero["end"] != zero["start"], "both ranks trained the same weights"
    # a batch's KL estimate (the sum of log-ratios over sampled tokens) can come out either side of 0: it must be measured
    assert zero["kl_seen"] == one["kl_seen"] and len(zero["kl_seen"]) == 3 and 0 not in zero["kl_seen"][1:]
    assert zero["kl_coef"] == one["kl_coef"] != 0.2
    assert zero["moments"] == one["moments"] and zero["moments"]["count"] == 3 * 16 * 2, (
        "both ranks' scores, each update"
    )
    assert zero["stops"] == one["stops"] and any(stop for _, stop in zero["stops"])
    assert zero["prompts"] != one["prompts"] and len(zero["prompts"]) == len(one["prompts"]) == 3 * 16
    # rank 0 skipped none, rank 1 its 2 micro-batches (2 mini-batches of 1) every epoch; the log has the ranks' mean
    epochs = zero["series"]["policy/ppo_epochs"]
    assert zero["series"]["policy/skipped_batches"] == [(0 + 2 * e) / 2 for e in epochs], zero["series"]
    assert not one["series"]["objective/kl_coef"], "rank 1 logs nothing"


def test_each_rank_makes_its_own_gpu_current_before_its_stage_loads_models(monkeypatch):
    """A reward model placed on "cuda" before the trainer's accelerator exists goes to the current device: each rank
    of a multi-process stage on a GPU machine makes its `LOCAL_RANK` GPU current first, so eight ranks do not load
    eight reward models onto GPU 0. One process, or a machine without GPUs, changes nothing."""
    from alignpipe import distributed

    chosen: list[int] = []
    monkeypatch.setattr(torch.cuda, "set_device", chosen.append)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_RANK", "3")
    distributed.use_rank_device()
    monkeypatch.setenv("WORLD_SIZE", "1")
    distributed.use_rank_device()
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    distributed.use_rank_device()
    assert chosen == [3]


def ppo_recipe(tiny, workdir):
    from pathlib import Path

    text = (Path(__file__).parents[1] / "pipelines" / "tiny-ppo.yaml").read_text()
    return text.replace("assets/tiny", str(tiny)).replace("./runs", str(workdir))


def test_a_ppo_stage_runs_on_two_ranks(tiny, tmp_path):
    """`resources.processes: 2` on a ppo stage, as a pipeline runs it: the ranks are forked from the stage host, each
    loads the reward model and the value head, rank 0 alone logs, and the episode count is both ranks'."""
    overrides = [
        "stages.sft.max_steps=10",
        "stages.rm.max_steps=5",
        "stages.ppo.max_steps=3",
        "stages.ppo.batch_size=8",
        "stages.ppo.max_completion_length=8",
        "stages.ppo.logging_every=1",
        "stages.ppo.resources.processes=2",
    ]
    manifest, runs, _ = run_stage(tiny, tmp_path, ppo_recipe, "ppo", 2, overrides)
    assert len(runs) == 1, "only rank 0 opened an MLflow run"
    assert manifest.metrics["steps"] == 3
    client = MlflowClient(parse_recipe(ppo_recipe(tiny, tmp_path / "runs"), overrides).tracking_uri)
    episodes = [m.value for m in client.get_metric_history(runs[0].info.run_id, "episode")]
    assert episodes == [16.0 * 2 * k for k in (1, 2, 3)], episodes  # 8 × 2 mini-batches on each of 2 ranks


def test_low_precision_adamw_under_fsdp_takes_the_unsharded_steps_and_saves_its_compensation():
    """Two FSDP2 ranks, a bf16 model: `LowPrecisionAdamW` (kahan) on the sharded parameters (DTensors) takes exactly the unsharded
    model's steps, keeps its states sharded, and its compensation comes out of torch's distributed state dict."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).with_name("low_precision_fsdp_check.py")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port())]
    out = subprocess.run(
        [*cmd, str(script)], capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"}
    )
    assert out.returncode == 0, out.stderr[-3000:]
    row = json.loads(next(x for x in out.stdout.splitlines() if x.startswith("{")))
    assert row["gap"] == 0.0 and row["comp_gap"] == 0.0 and row["sharded_states"], row
    assert row["saved"] == ["exp_avg", "exp_avg_sq", "kahan_comp", "step"], row
