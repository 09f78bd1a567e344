"""Helpers the tests import (`from support import ...`; pytest puts tests/ on the path): recipes and data
built from the tiny assets."""

from __future__ import annotations

import contextvars
import os
import signal
import subprocess
import tempfile
import time
from pathlib import Path
from typing import TypeVar

import httpx
import pytest

T = TypeVar("T")


def start_service(
    cmd: list[str],
    log: Path,
    ready_url: str,
    *,
    env: dict | None = None,
    cwd: Path | None = None,
    timeout_s: float = 120,
    needs_ok: bool = True,
) -> subprocess.Popen:
    """A server started as its users start it, in a session of its own (`stop_service` ends its children too), its
    output in `log`; returned once `ready_url` answers (200, or any answer where not `needs_ok`). A server that exits
    or does not answer in `timeout_s` fails the test with its log's tail."""
    proc = subprocess.Popen(
        cmd, env=env, cwd=cwd, stdout=log.open("w"), stderr=subprocess.STDOUT, start_new_session=True
    )
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if httpx.get(ready_url, timeout=2).status_code == 200 or not needs_ok:
                return proc
        except httpx.HTTPError:
            pass
        if proc.poll() is not None:
            pytest.fail(f"{Path(cmd[0]).name} exited:\n" + log.read_text()[-3000:])
        time.sleep(0.5)
    stop_service(proc)
    pytest.fail(f"{Path(cmd[0]).name} did not answer {ready_url} in {timeout_s:.0f} s:\n" + log.read_text()[-3000:])


def stop_service(proc: subprocess.Popen) -> None:
    """SIGTERM to the process's session, then SIGKILL after 20 s."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def known(value: T | None) -> T:
    """`value`, which must be there: a function that may answer None (a metric not logged, a rate with no steady
    window) answered in a case where the test needs it, and the type checker sees it is set."""
    assert value is not None
    return value


# A short GRPO/RLOO run on the tiny model: 2 updates of 8 completions (2 prompts × 4), a KL term and 2 iterations
# per rollout, so the old-policy and reference passes both run.
SHORT_GROUPS = dict(
    max_steps=2, batch_size=8, num_generations=4, max_completion_length=8, beta=0.04, num_iterations=2, logging_every=1
)


def tiny_split(tiny: Path, name: str, fmt: str, rows: int | None = None, **kwargs):
    """(tokenizer, train rows, eval rows) of the tiny data file `name`.jsonl, formatted as `fmt` (10% held out)."""
    import json

    from alignpipe.data.formats import format_rows
    from alignpipe.modeling import load_tokenizer

    tok = load_tokenizer(str(tiny / "model"))
    raw = [json.loads(line) for line in (tiny / "data" / f"{name}.jsonl").read_text().splitlines()][:rows]
    train, evals, _ = format_rows(raw, fmt=fmt, tokenizer=tok, eval_fraction=0.1, **kwargs)
    return tok, train, evals


def demo_recipe(tiny: Path, workdir: Path, **extra) -> str:
    """pipelines/tiny-demo.yaml with absolute asset paths and a private workdir."""
    text = (Path(__file__).parents[1] / "pipelines" / "tiny-demo.yaml").read_text()
    text = text.replace("assets/tiny", str(tiny)).replace("./runs", str(workdir))
    return text


def demo_on_mlflow_server(tiny: Path, tmp_path: Path, url: str, *overrides: str):
    """The demo (SFT shortened, judge on 32 prompts) run by the pipeline flow in this process, recording to the
    MLflow server at `url`: (the flow's final state, an MlflowClient of the server, the parent run)."""
    from mlflow.tracking import MlflowClient

    from flows.pipeline import pipeline

    path = tmp_path / "demo.yaml"
    path.write_text(demo_recipe(tiny, tmp_path / "runs"))
    fast = ["stages.sft.max_steps=40", "stages.sft.eval_every=null", "stages.judge.num_prompts=32"]
    state = pipeline(recipe_path=str(path), overrides=[*fast, f"tracking.uri={url}", *overrides], return_state=True)
    assert state.is_completed(), state.message
    result = state.result()
    assert isinstance(result, dict)
    client = MlflowClient(url)
    return state, client, client.get_run(result["mlflow_run_id"])


def sft_spec_after_format(recipe, run_id: str = "run-1"):
    """Run the recipe's `sft-data` format stage and write the `sft` stage's spec: (plans, spec path, tracking)."""
    from alignpipe.launch import launch
    from alignpipe.pipeline_run import start_pipeline_run
    from alignpipe.plan import plan, write_spec

    plans = plan(recipe)
    tracking = start_pipeline_run(recipe, run_id)
    fmt = launch(write_spec(recipe, plans["sft-data"], {}, tracking, run_id), on_line=lambda line: None)
    return plans, write_spec(recipe, plans["sft"], {"sft-data": fmt}, tracking, run_id), tracking


def kill_at_checkpoint(command: list[str], checkpoint: Path, timeout_s: float = 240) -> None:
    """Start a stage command (with all the processes it starts in one group), wait until `checkpoint` is complete
    (its state.json written), then SIGKILL the whole group, as a crash or an OOM killer would."""
    import os
    import signal
    import subprocess
    import time

    proc = subprocess.Popen(
        command,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
        start_new_session=True,
    )
    deadline = time.monotonic() + timeout_s
    while not (checkpoint / "state.json").exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.2)
    assert (checkpoint / "state.json").exists(), f"no checkpoint {checkpoint} before the deadline"
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def matmuls(fn) -> int:
    """How many matrix products `fn()` runs (under inference mode a `linear` or `matmul` is seen whole, not as the
    `addmm` or `mm` it runs)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    seen = []

    class Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.__name__.split(".")[0] in ("mm", "addmm", "addmm_", "bmm", "linear", "matmul"):
                seen.append(func)
            return func(*args, **(kwargs or {}))

    with Count():
        fn()
    return len(seen)


PPO_PROMPTS = ["The film", "I watched it and", "Critics say", "My review:"]


def run_ppo(tiny: Path, tmp_path: Path, tracker=None, lora: bool = False, attention: str | None = None, **overrides):
    """A short PPO run on the tiny model (32 prompts, a length reward, 3 updates of 8 episodes unless `overrides`
    say otherwise), every model on `attention`: (result, tracker, policy). The value model's new score head is drawn
    from seed 0 (before the run seeds itself), so two runs of one config are the same run wherever they come in a
    process."""
    import torch

    from alignpipe.judges.reward_set import LoadedReward, RewardSet
    from alignpipe.modeling import load_causal_lm, load_sequence_scorer, load_tokenizer
    from alignpipe.tracking import Tracker
    from alignpipe.trainers import ppo
    from alignpipe.trainers.configs import LoraSpec, PPOConfig

    tok = load_tokenizer(str(tiny / "model"))
    policy = load_causal_lm(str(tiny / "model"), attention=attention)
    ref = None if lora else load_causal_lm(str(tiny / "model"), attention=attention)
    torch.manual_seed(0)
    value = load_sequence_scorer(str(tiny / "model"), pad_token_id=tok.pad_token_id, attention=attention)
    rows = [{"prompt": p} for p in PPO_PROMPTS * 8]
    rewards = RewardSet([LoadedReward("len", lambda p, c, **_: [min(len(x.split()), 5) / 5 for x in c])])
    args = dict(
        learning_rate=1e-4,
        max_steps=3,
        batch_size=8,
        num_mini_batches=2,
        num_ppo_epochs=2,
        max_completion_length=8,
        logging_every=1,
        sample_every=100,
        lora=LoraSpec(r=4) if lora else None,
    )
    cfg = PPOConfig(**{**args, **overrides})
    tracker = tracker or Tracker()
    result = ppo.train(cfg, policy, value, tok, rows, rewards, tracker, tmp_path, ref_model=ref)
    return result, tracker, policy


def replayed_on_cpu(step):
    """What recording a CUDA graph amounts to, on CPU (a `GraphedDecodeStep`'s `capture`): the warm-up runs the step
    (and writes the cache); each replay runs it again on the same input buffers, in the context it was recorded in
    (a graph replays the kernels chosen while it was recorded), and writes the same output tensor."""
    recorded = contextvars.copy_context()
    out = step()
    return (lambda: out.copy_(recorded.run(step))), out


def graphed_on_cpu(engine, device):
    """`HFEngine._decode_step` as on a GPU with `cuda_graphs` on, its recordings made by `replayed_on_cpu`."""
    from alignpipe.engine.decode_steps import GraphedDecodeStep

    if engine.step is None and engine.cuda_graphs:
        engine.step = GraphedDecodeStep(capture=replayed_on_cpu)
    return engine.step


def loss_and_grads(model, batch) -> tuple[float, list]:
    """SFT's summed token loss of `batch` under `model` and the gradient of each trainable parameter."""
    from alignpipe.trainers import sft

    model.zero_grad()
    loss, _ = sft.token_loss_sum(model, batch)
    loss.backward()
    return float(loss.detach()), [p.grad.clone() for p in model.parameters() if p.requires_grad]


def assert_packed_equals_alone(packed: tuple[float, list], alone: list[tuple[float, list]]) -> None:
    """A packed batch's loss and gradients (`loss_and_grads`) equal the sums of its rows' run alone (1e-5)."""
    import pytest

    packed_loss, packed_grads = packed
    assert packed_loss == pytest.approx(sum(loss for loss, _ in alone), rel=1e-5)
    for k, g in enumerate(packed_grads):
        expected = sum(grads[k] for _, grads in alone)
        # float32 sums in another order: compared relative to the gradient's norm
        assert float((g - expected).norm() / expected.norm().clamp(min=1e-12)) < 1e-5, k


def shrunk_overrides(recipe) -> list[str]:
    """`--set` overrides that run a real-size recipe's stages as a few CPU steps: no GPUs asked for, 2 training steps
    of 2 rows (RL: 2 prompts × their group), 8 judged prompts of 8 new tokens, the push to a local folder."""
    out = []
    for s in recipe.stages:
        key = f"stages.{s.id}"
        if getattr(s, "resources", None) is not None and s.resources.gpus:
            out.append(f"{key}.resources.gpus=0")
        if hasattr(s, "max_steps"):
            group = getattr(s, "num_generations", 1)
            out += [f"{key}.max_steps=2", f"{key}.batch_size={2 * group}", f"{key}.gradient_accumulation_steps=1"]
            out += [f"{key}.logging_every=1", f"{key}.save_every=null", f"{key}.eval_every=null"]
            if hasattr(s, "max_completion_length"):
                out.append(f"{key}.max_completion_length=12")
        if s.kind == "judge":
            out += [f"{key}.num_prompts=8", f"{key}.sampling.max_new_tokens=8"]
        if s.kind == "push":
            out.append(f"{key}.target=local")
    return out


# The micro-batch TRL's GRPO and RLOO `_compute_loss` parity tests hand both sides: 4 completions of 5 tokens after
# 3-token prompts, ending at different lengths (one after its first token, one filling the window).
PARITY_COMPLETION_MASK = [[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0], [1, 1, 1, 1, 0]]


def trl_group_trainer(trl_trainer, trl_config, tiny: Path, **config):
    """TRL's GRPOTrainer or RLOOTrainer (`trl_trainer`, with its config class `trl_config`) on the tiny model, on CPU
    in float32, 4 generations a prompt, completions of `len(PARITY_COMPLETION_MASK[0])` tokens and a zero reward:
    what a loss-parity test calls `_compute_loss` on, its model the one both sides score with."""
    from datasets import Dataset

    from alignpipe.modeling import load_causal_lm, load_tokenizer

    args = trl_config(
        output_dir=tempfile.mkdtemp(),
        per_device_train_batch_size=4,
        num_generations=4,
        report_to="none",
        use_cpu=True,
        bf16=False,
        gradient_checkpointing=False,
        max_completion_length=len(PARITY_COMPLETION_MASK[0]),
        **config,
    )
    trainer = trl_trainer(
        model=load_causal_lm(str(tiny / "model")),
        reward_funcs=[lambda completions, **_: [0.0] * len(completions)],
        args=args,
        processing_class=load_tokenizer(str(tiny / "model")),
        train_dataset=Dataset.from_list([{"prompt": "a"}] * 8),
    )
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1
    return trainer


def parity_micro_batch(generator):
    """The token part of that micro-batch (random ids, the completion mask, one advantage a row), drawn from
    `generator` in a fixed order; each test adds the log-probs its loss reads, drawn after these."""
    import torch

    mask = torch.tensor(PARITY_COMPLETION_MASK)
    rows, length = mask.shape
    return {
        "prompt_ids": torch.randint(2, 500, (rows, 3), generator=generator),
        "prompt_mask": torch.ones(rows, 3, dtype=torch.long),
        "completion_ids": torch.randint(2, 500, (rows, length), generator=generator),
        "completion_mask": mask,
        "advantages": torch.randn(rows, generator=generator),
        "num_items_in_batch": mask.sum().float(),
    }


def counted_calls(monkeypatch, module, *names: str) -> dict[str, int]:
    """`module`'s functions `names` wrapped to count their calls (the hand-written kernels' launches): the counts,
    updated as they are called."""
    calls = dict.fromkeys(names, 0)
    for name in names:
        fn = getattr(module, name)

        def counted(*args, fn=fn, name=name, **kwargs):
            calls[name] += 1
            return fn(*args, **kwargs)

        monkeypatch.setattr(module, name, counted)
    return calls


def experiment_id(client, name: str) -> str:
    """The id of the MLflow experiment `name`, which the run under test made (`client`: an `MlflowClient`)."""
    return known(client.get_experiment_by_name(name)).experiment_id
