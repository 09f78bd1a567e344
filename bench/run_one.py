"""One measurement in a fresh process: `python -m bench.run_one IMPL CASE MODEL STEPS ASSETS` prints one
JSON line {samples_per_s, steady_samples_per_s, peak_mb, loss, ...}. IMPL is `ours`, `trl` or `trl+liger` (TRL with
`use_liger_kernel=True`); CASE a case key of `bench.cases` (`sft/8x2048`, `grpo/8x8x256`, `dpo/8x64`, ...). Same
model, tokenizer, data and hyperparameters for every implementation. Timed for all: data preparation + training +
saving the model (what a user waits for; model loading excluded); checkpointing off.

Models: `tiny` (the project's 1.7M Llama) and `small` (a 20M Llama, random init) run on CPU in fp32;
`qwen0.5b` (Qwen2-0.5B's shape, random init) runs on a GPU in bf16; `tiny-qwen2` (the tiny model's sizes in Qwen2's
architecture, random init, fp32 on CPU) is the one `bench.liger_cpu` runs TRL + Liger's contenders on.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import resource
import statistics
import sys
import tempfile
import time
from collections import Counter
from typing import Any, Protocol

from bench.cases import ONLINE, QWEN_05B, SMALL, TINY_QWEN2, Case, find_case, is_gpu_model, model_sizes, rows

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_DATASETS_DISABLE_PROGRESS_BARS", "1")

LR = 1e-4
ASSETS = ""  # set by main


# Set by `python -m bench --skip-steps N`: the steps left out of the steady-state rate (default 5).
SKIP_STEPS_ENV = "ALIGNPIPE_BENCH_SKIP_STEPS"
# steps left out of the steady-state rate (CUDA/cuBLAS warm-up, allocator growth)
WARMUP_STEPS = int(os.environ.get(SKIP_STEPS_ENV, "5"))


class Ticking(Protocol):
    """What is told of each optimizer step's end: a `StepClock`, or a tool's own counter."""

    def tick(self) -> None: ...


class StepClock:
    """The end of each optimizer step: the steady-state rate leaves out data preparation, the warm-up steps and
    saving, which dominate a short end-to-end timing on a fast GPU. Each tick also notes how many graphs
    `torch.compile` has built so far, so a run can say whether compiling fell inside its steady window (a JIT compile
    there is seconds, and looks like a slow step).

    On a GPU (`event`: `torch.cuda.Event`) each tick also records an event in the device's queue, and `finish` reads
    the steps' times from those: the device's own timeline, read once after the run. A host clock at a step's end
    times the host's issuing, which runs ahead of the device unless something waits for it, and making it wait at
    every step (a log per step, as this clock needed until session 44) costs the overlap of one step's host work
    with the last one's kernels that a run logging every 10 steps, as users do, keeps. With `steps`, the
    synchronising CUDA calls of the steady window are counted too (`SteadySyncs`)."""

    def __init__(self, steps: int | None = None, event=None):
        self.times: list[float] = []
        self.graphs: list[int] = []
        self.steps = steps
        self._event = event
        self._events: list = []
        self.syncs = SteadySyncs() if event is not None and steps else None

    def tick(self) -> None:
        self.times.append(time.perf_counter())
        self.graphs.append(graphs_built())
        if self._event is not None:
            event = self._event(enable_timing=True)
            event.record()
            self._events.append(event)
        if self.syncs is not None:
            n = len(self.times)  # the steady window runs from the end of step WARMUP_STEPS + 1 to the last
            if n == WARMUP_STEPS + 1:
                self.syncs.start()
            elif n > WARMUP_STEPS + 1:
                self.syncs.mark()
            if n == self.steps:
                self.syncs.stop()

    def finish(self) -> None:
        """After the run: the steps' times from the device's events (one wait, for the last), and no more counting
        of synchronising calls (a run that ended early)."""
        if self.syncs is not None:
            self.syncs.stop()
        if self._events:
            first = self._events[0]
            self._events[-1].synchronize()
            self.times = [self.times[0] + first.elapsed_time(e) / 1e3 for e in self._events]
            self._events = []

    def steady(self, per_step: int) -> float | None:
        n = len(self.times) - 1 - WARMUP_STEPS
        return per_step * n / (self.times[-1] - self.times[WARMUP_STEPS]) if n > 0 else None

    def ends(self, begin: float, end: float, first_forward: float | None = None) -> dict[str, float]:
        """Where a run's fixed cost lies, its timed part having run from `begin` to `end` (host clock; `begin` is
        the trainer's start, after the imports the end-to-end figure leaves out, as `seconds` does): the seconds
        to the first step's end (data preparation, the trainer's set-up, compiles and the first step) and after the
        last step's (saving); with the host time of the trained model's `first_forward` call (`FirstForward`), the
        seconds to it too, which part the set-up (data preparation included) and the first step (compiles, kernels
        loaded, memory first allocated). On a GPU the steps' ends are the device's events placed on the host clock
        at the first tick, so both are within the host's lead over the device at that tick. Nothing where no step
        ended."""
        if not self.times:
            return {}
        out = {"to_first_step_s": self.times[0] - begin, "after_last_step_s": max(0.0, end - self.times[-1])}
        if first_forward is not None and begin <= first_forward <= self.times[0]:
            out["to_first_forward_s"] = first_forward - begin
        return out

    def step_ms(self) -> list[int]:
        """Each optimizer step's wall time in ms, from the first step's end (the first step holds the set-up)."""
        return [round(1000 * (b - a)) for a, b in zip(self.times, self.times[1:])]

    def steady_graphs(self) -> list[int]:
        """The steps of the steady window (tick k ends step k + 1) in which `torch.compile` built a graph."""
        return [k + 1 for k in range(WARMUP_STEPS + 1, len(self.graphs)) if self.graphs[k] > self.graphs[k - 1]]


class FirstForward:
    """The host time at which `model` first runs a forward (`at`; None until then): a forward pre-hook on its input
    embedding, which every forward of every side begins with (ours calls the decoder stack under its own LM head, not
    the top-level module; it compiles decoder layers, not the embedding; TRL + Liger patches methods, not the call).
    The hook takes itself off at its first call, so the steps after carry no hook. It is a plain function, which
    `copy.deepcopy` shares rather than copies: a copy made after it is set (a reference model) calls this same hook,
    so `at` is the first forward of either, the end of the set-up all the same. `remove()` after the run."""

    def __init__(self, model):
        self.at: float | None = None
        target = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else model

        def seen(module, _args) -> None:
            if self.at is None:
                self.at = time.perf_counter()
            module._forward_pre_hooks.pop(self._handle.id, None)  # a copy's too: each module drops it once seen

        self._handle = target.register_forward_pre_hook(seen)

    def remove(self) -> None:
        self._handle.remove()


class SteadySyncs:
    """The synchronising CUDA calls of a run's steady window, step by step, with where each was called from
    (`torch.cuda.set_sync_debug_mode("warn")`, recorded as `bench.gpu_checks.sync_recorder` does). A call that waits
    for the device inside a step stops the host from issuing the next kernels until the queue has drained, so the
    step's host work no longer overlaps its kernels: a step near host + device time rather than the larger of them.
    Log steps read the logged values back (one wait each, by design), so a run logging every 10 steps shows a few
    there; any other step's calls are the ones to remove. Both sides are counted alike. The recording is
    `gpu_checks.recorded_syncs`, open for the window: other warnings raised in it are not shown."""

    SITES = 6
    TRACED = 40  # calls whose caller is looked up (`gpu_checks.sync_recorder`); later ones are only counted

    def __init__(self):
        self.seen: list[tuple[str, str]] = []  # (the warning's line, the innermost caller outside torch or "")
        self.marks: list[int] = []  # len(seen) at the end of each steady step
        self._recording: contextlib.ExitStack | None = None

    def start(self) -> None:
        from bench.gpu_checks import recorded_syncs

        self._recording = contextlib.ExitStack()
        self._recording.enter_context(recorded_syncs(self.seen, self.TRACED))

    def mark(self) -> None:
        self.marks.append(len(self.seen))

    def stop(self) -> None:
        if self._recording is not None:
            self._recording.close()
            self._recording = None

    def summary(self) -> dict:
        """{"per_step": the calls in each steady step, "sites": the callers of the first `TRACED` by count, at most
        `SITES`}."""
        per_step = [b - a for a, b in zip([0, *self.marks], self.marks)]
        counted = Counter(caller.removeprefix(ROOT_PREFIX) for _, caller in self.seen if caller)
        return {"per_step": per_step, "sites": [f"{site} ×{n}" for site, n in counted.most_common(self.SITES)]}


ROOT_PREFIX = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep


def fresh_json(module_args: list[str], env: dict[str, str] | None = None, timeout: float | None = None) -> dict:
    """`python -m MODULE ARGS…` (`module_args`) in a fresh process from the repository's root: the last JSON line it
    prints. A failure (a non-zero exit, no JSON line) raises RuntimeError with the output's tail."""
    import subprocess

    out = subprocess.run(
        [sys.executable, "-m", *module_args],
        cwd=ROOT_PREFIX,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    lines = [line for line in out.stdout.splitlines() if line.startswith("{")]
    if out.returncode != 0 or not lines:
        raise RuntimeError(f"{' '.join(module_args)} failed:\n{(out.stdout + out.stderr)[-3000:]}")
    return json.loads(lines[-1])


@contextlib.contextmanager
def optimizer_ticks(clock: Ticking):
    """`clock.tick()` at the end of every optimizer step taken within (torch's global step hooks), once per step
    where a step calls its parent class's (`LowPrecisionAdamW` hands float32 parameters to torch's AdamW): our
    offline trainers' steps, whatever they log."""
    from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

    depth = 0

    def entered(*_) -> None:
        nonlocal depth
        depth += 1

    def left(*_) -> None:
        nonlocal depth
        depth -= 1
        if depth == 0:
            clock.tick()

    handles = [register_optimizer_step_pre_hook(entered), register_optimizer_step_post_hook(left)]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


# Set by `python -m bench --attention KERNEL`: the attention implementation every side's model runs.
ATTENTION_ENV = "ALIGNPIPE_BENCH_ATTENTION"
# Set to 1 by `python -m bench --compile` for our side: `compile: true` on offline trainers, `rollout: {compile: true}`
# on online ones.
COMPILE_ENV = "ALIGNPIPE_BENCH_COMPILE"
# Set by `python -m bench --unfused`: our DPO with `fused_loss: false` (the chunked, recomputed LM head), to measure
# what the fused head buys.
UNFUSED_ENV = "ALIGNPIPE_BENCH_UNFUSED"
# Set by `python -m bench --eager-kernels`: our side with `fused_kernels: false`, to measure what the compiled SwiGLU
# and LM-head loss kernels buy on a GPU.
EAGER_KERNELS_ENV = "ALIGNPIPE_BENCH_EAGER_KERNELS"
# Set by `python -m bench --compiled-kernels`: our side's SwiGLU and rotary work on inductor's compiled kernels
# (`fused_kernels.ELEMENTWISE = "compiled"`) instead of the hand-written Triton ones, to measure what those buy.
COMPILED_KERNELS_ENV = "ALIGNPIPE_BENCH_COMPILED_KERNELS"
# Set by `python -m bench --nearest-updates`: our side with `low_precision_updates: nearest` (torch's AdamW, each bf16
# update rounded to the nearest value, as TRL's side runs), to measure what the Kahan-compensated default costs a step.
NEAREST_ENV = "ALIGNPIPE_BENCH_NEAREST"


def model_for(kind: str, assets: str, task: str):
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    from alignpipe.modeling import load_tokenizer

    tok = load_tokenizer(f"{assets}/model")
    if kind == "tiny":
        cls = AutoModelForSequenceClassification if task == "reward" else AutoModelForCausalLM
        kwargs = {"num_labels": 1} if task == "reward" else {}
        model = cls.from_pretrained(f"{assets}/model", **kwargs)
    else:
        model = random_model(kind, tok, "reward" if task == "reward" else "lm")
    model.config.pad_token_id = tok.pad_token_id
    if attention := os.environ.get(ATTENTION_ENV):  # `python -m bench --attention`: every side alike
        from alignpipe.modeling import implementation

        model.set_attn_implementation(implementation(attention))  # `varlen`: TRL's side runs ours too
    return model, tok


def random_model(kind: str, tok, head: str, seed: int = 0):
    """`small`: the BASELINES.md 20M Llama shape in fp32 on CPU; `tiny-qwen2`: the tiny model's sizes in Qwen2's
    architecture, fp32 on CPU (`bench.liger_cpu`); `qwen0.5b`: Qwen2-0.5B's shape, built in bf16 directly on the GPU.
    Random init, seeded."""
    import torch
    from transformers import (
        LlamaConfig,
        LlamaForCausalLM,
        LlamaForSequenceClassification,
        Qwen2Config,
        Qwen2ForCausalLM,
        Qwen2ForSequenceClassification,
    )

    ids: dict[str, Any] = dict(eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, num_labels=1)
    torch.manual_seed(seed)
    if kind == "small":
        llama = LlamaConfig(vocab_size=len(tok), **SMALL, **ids)
        return (LlamaForSequenceClassification if head == "reward" else LlamaForCausalLM)(llama)
    cls = Qwen2ForSequenceClassification if head == "reward" else Qwen2ForCausalLM
    if kind == TINY_QWEN2:
        return cls(Qwen2Config(**model_sizes(kind), **ids))
    cfg = Qwen2Config(**QWEN_05B, **ids)
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device("cuda"):
            return cls(cfg)
    finally:
        torch.set_default_dtype(default)


def reward_model_dir(assets: str, kind: str) -> str:
    """A seeded sequence-scoring head, saved once: PPO's reward model (and value init) for both sides. The
    tiny model's for the CPU models, a Qwen2-0.5B-shaped one on the GPU."""
    import torch
    from transformers import AutoModelForSequenceClassification

    from alignpipe.modeling import load_tokenizer

    gpu = is_gpu_model(kind)
    path = f"{tempfile.gettempdir()}/alignpipe-bench-rm" + ("-qwen0.5b" if gpu else "")
    if not os.path.exists(f"{path}/config.json"):
        tok = load_tokenizer(f"{assets}/model")
        if gpu:
            rm = random_model(kind, tok, "reward", seed=1)
        else:
            torch.manual_seed(1)
            rm = AutoModelForSequenceClassification.from_pretrained(f"{assets}/model", num_labels=1)
        rm.config.pad_token_id = tok.pad_token_id
        rm.save_pretrained(path)
        tok.save_pretrained(path)
    return path


def ours(case: Case, model, tok, data, steps: int, kind: str, clock: StepClock) -> dict:
    from alignpipe.tracking import Tracker
    from alignpipe.trainers.configs import RolloutSpec

    task, shape = case.trainer, case.shape
    by_logs = task in ONLINE  # an online step is several optimizer steps (PPO's epochs): timed by its log
    # Logged once at the end (the CPU shapes) its one tick would read as the first step's end: no ticks then, so the
    # run reports no step times and no split of its fixed cost rather than wrong ones.
    ticks_at_logs = by_logs and shape.log_every == 1

    class ClockedTracker(Tracker):
        def log_metrics(self, metrics: dict, step: int) -> None:
            if ticks_at_logs and (not self.history or self.history[-1][0] != step):
                clock.tick()
            super().log_metrics(metrics, step)

    common = dict(
        learning_rate=LR,
        max_steps=steps,
        batch_size=shape.batch,
        gradient_accumulation_steps=shape.accumulation,
        max_length=shape.max_len,
        logging_every=shape.log_every or steps,
        lr_scheduler="linear",
    )
    if os.environ.get(EAGER_KERNELS_ENV) == "1":
        common["fused_kernels"] = False
    if os.environ.get(NEAREST_ENV) == "1":
        common["low_precision_updates"] = "nearest"
    if os.environ.get(COMPILED_KERNELS_ENV) == "1":
        from alignpipe import fused_kernels

        fused_kernels.ELEMENTWISE = "compiled"
    compiled = os.environ.get(COMPILE_ENV) == "1"
    offline = {"compile": True} if compiled else {}
    online = {"rollout": RolloutSpec(compile=True)} if compiled else {}
    tracker, out = ClockedTracker(), tempfile.mkdtemp()
    with contextlib.nullcontext() if by_logs else optimizer_ticks(clock):
        seconds = _train_ours(task, shape, common, offline, online, model, tok, data, steps, kind, tracker, out)
    return {
        "seconds": seconds,
        "loss": tracker.last("loss/policy_avg" if task == "ppo" else "train/loss"),
        "mean_completion_length": _mean_length(tracker, "completions/mean_length", "train/completions/mean_length"),
        "generation_tokens_per_s": _steady_median(tracker, "generation/tokens_per_s", "train/generation/tokens_per_s"),
    }


def _train_ours(task, shape, common, offline, online, model, tok, data, steps, kind, tracker, out) -> float:
    """Run our trainer of `task` as `ours` configured it; the seconds it took."""
    from alignpipe.judges.reward_set import LoadedReward, RewardSet
    from alignpipe.judges.rewards import sentiment_lexicon
    from alignpipe.trainers import dpo, grpo, kto, online_dpo, reward, rloo, sft
    from alignpipe.trainers.configs import (
        DPOConfig,
        GRPOConfig,
        KTOConfig,
        OnlineDPOConfig,
        RewardConfig,
        RLOOConfig,
        SFTConfig,
    )

    t0 = time.perf_counter()
    if task == "sft":
        sft.train(SFTConfig(**common, **offline, packing=shape.packed), model, tok, data, [], tracker, out)
    elif task == "reward":
        reward.train(RewardConfig(**common, **offline), model, tok, data, [], tracker, out)
    elif task == "dpo":
        import copy

        fused = os.environ.get(UNFUSED_ENV) != "1"
        dpo.train(
            DPOConfig(**common, **offline, fused_loss=fused),
            model,
            tok,
            data,
            [],
            tracker,
            out,
            ref_model=copy.deepcopy(model),
        )
    elif task == "kto":
        import copy

        kto.train(KTOConfig(**common, **offline), model, tok, data, [], tracker, out, ref_model=copy.deepcopy(model))
    elif task in ("grpo", "rloo"):
        import copy

        config, trainer = (GRPOConfig, grpo) if task == "grpo" else (RLOOConfig, rloo)
        rl_cfg = config(
            **common,
            **online,
            num_generations=shape.generations,
            max_completion_length=shape.completion,
            sample_every=10**9,
            # RLOO without its KL term on both sides: TRL builds RLOO's reference from the model's path, which the
            # bench's random-initialised models do not have
            **({"beta": 0.0} if task == "rloo" else {}),
        )
        lexicon = RewardSet([LoadedReward("lexicon", sentiment_lexicon)])
        ref = copy.deepcopy(model) if rl_cfg.beta else None
        trainer.train(rl_cfg, model, tok, data, lexicon, tracker, out, ref_model=ref)
    elif task == "online_dpo":
        import copy

        lexicon = RewardSet([LoadedReward("lexicon", sentiment_lexicon)])
        odpo_cfg = OnlineDPOConfig(
            **{k: v for k, v in common.items() if k != "max_length"},
            **online,
            max_completion_length=shape.completion,
            sample_every=10**9,
        )
        ranker = online_dpo.RewardRanker(lexicon, None)
        online_dpo.train(odpo_cfg, model, tok, data, ranker, tracker, out, ref_model=copy.deepcopy(model))
    elif task == "ppo":
        import copy

        from alignpipe.engine.sampling import SamplingParams
        from alignpipe.judges.reward_model import RewardModelScorer
        from alignpipe.modeling import load_sequence_scorer
        from alignpipe.trainers import ppo
        from alignpipe.trainers.configs import PPOConfig

        rm, dtype = reward_model_dir(ASSETS, kind), ("bfloat16" if is_gpu_model(kind) else "float32")
        ppo_cfg = PPOConfig(
            **common,
            **online,
            max_completion_length=shape.completion,
            num_ppo_epochs=4,
            sample_every=10**9,
            sampling=SamplingParams(temperature=0.7, max_new_tokens=shape.completion),
            missing_eos_penalty=1.0,
        )
        value = load_sequence_scorer(rm, dtype, pad_token_id=tok.pad_token_id)
        ppo.train(
            ppo_cfg,
            model,
            value,
            tok,
            data,
            RewardSet([LoadedReward("rm", RewardModelScorer(rm, dtype=dtype))]),
            tracker,
            out,
            ref_model=copy.deepcopy(model),
        )
    return time.perf_counter() - t0


def _mean_length(tracker, *names: str) -> float | None:
    for name in names:
        if tracker.last(name) is not None:
            return float(tracker.last(name))
    return None


def _steady_median(tracker, *names: str) -> float | None:
    """The median of a metric's log points after the warm-up steps (all of them where a run logged fewer): with a
    log every step (the GPU shapes), the steady window's."""
    for name in names:
        if values := tracker.series(name):
            return float(statistics.median(values[WARMUP_STEPS:] or values))
    return None


def liger_args(task: str) -> dict:
    """TRL's arguments for its trainer of `task` with Liger's kernels, as a user gets them to run: all of them, but
    for a reward model no fused linear cross-entropy. Liger patches the forward of any Qwen2 model it is given with
    the causal LM's (`lce_forward`), which a sequence classifier has no `lm_head` for: `use_liger_kernel=True` alone
    fails at the reward model's first step (session 42's lease). Its norm, SwiGLU and rotary kernels still apply."""
    args: dict = {"use_liger_kernel": True}
    if task == "reward":
        args["liger_kernel_config"] = {"fused_linear_cross_entropy": False, "cross_entropy": False}
    return args


def trl_run(case: Case, model, tok, data, steps: int, kind: str, clock: Ticking, liger: bool = False) -> dict:
    """TRL's trainer for the case, as a user would configure it for the same step (`liger`: with
    `use_liger_kernel=True`, TRL's fused kernels and losses)."""
    import trl
    from datasets import Dataset
    from transformers import Trainer, TrainerCallback

    class Clock(TrainerCallback):
        def on_step_end(self, *_, **__):
            clock.tick()

    task, shape, gpu = case.trainer, case.shape, is_gpu_model(kind)
    common = dict(
        output_dir=tempfile.mkdtemp(),
        max_steps=steps,
        per_device_train_batch_size=shape.batch,
        gradient_accumulation_steps=shape.accumulation,
        learning_rate=LR,
        report_to="none",
        use_cpu=not gpu,
        bf16=gpu,
        gradient_checkpointing=False,
        save_strategy="no",
        logging_steps=shape.log_every or steps,
        lr_scheduler_type="linear",
        max_length=shape.max_len,
        disable_tqdm=True,
        **(liger_args(task) if liger else {}),
    )
    ds = Dataset.from_list(data)
    trainer: Trainer  # TRL's trainer for the task
    t0 = time.perf_counter()  # construction (tokenization) + train + save, as `ours` is timed
    if task == "sft":
        trainer = trl.SFTTrainer(
            model=model,
            args=trl.SFTConfig(**common, completion_only_loss=True, packing=shape.packed),
            processing_class=tok,
            train_dataset=ds,
        )
    elif task == "reward":
        trainer = trl.RewardTrainer(
            model=model, args=trl.RewardConfig(**common), processing_class=tok, train_dataset=ds
        )
    elif task == "dpo":
        import copy

        trainer = trl.DPOTrainer(
            model=model,
            ref_model=copy.deepcopy(model),
            args=trl.DPOConfig(**common),
            processing_class=tok,
            train_dataset=ds,
        )
    elif task == "ppo":  # TRL 1.12 (the last with PPO), from its own target folder on PYTHONPATH
        import copy

        from transformers import AutoModelForSequenceClassification
        from trl.experimental.ppo import PPOConfig, PPOTrainer

        rm = reward_model_dir(ASSETS, kind)
        for k in ("max_length", "lr_scheduler_type"):
            common.pop(k)
        prompts = Dataset.from_dict({"input_ids": [tok(r["prompt"])["input_ids"] for r in data]})
        args = PPOConfig(
            **common,
            total_episodes=steps * shape.per_step,
            num_ppo_epochs=4,
            num_mini_batches=1,
            response_length=shape.completion,
            temperature=0.7,
            stop_token="eos",
            missing_eos_penalty=1.0,
            kl_coef=0.05,
            num_sample_generations=0,
            local_rollout_forward_batch_size=shape.per_step,
        )
        load = lambda: AutoModelForSequenceClassification.from_pretrained(rm, num_labels=1, dtype=model.dtype)  # noqa: E731
        trainer = PPOTrainer(
            args=args,
            processing_class=tok,
            model=model,
            ref_model=copy.deepcopy(model),
            reward_model=load(),
            value_model=load(),
            train_dataset=prompts,
            callbacks=[Clock()],
        )
        trainer.train()
        trainer.save_model(tempfile.mkdtemp())
        seconds = time.perf_counter() - t0
        losses = [h.get("loss/policy_avg") for h in trainer.state.log_history if "loss/policy_avg" in h]
        return {"seconds": seconds, "loss": losses[-1] if losses else None, "mean_completion_length": None}
    elif task == "kto":
        import copy

        trainer = trl.KTOTrainer(
            model=model,
            ref_model=copy.deepcopy(model),
            args=trl.KTOConfig(**common),
            processing_class=tok,
            train_dataset=ds,
        )
    elif task in ("grpo", "rloo", "online_dpo"):
        from alignpipe.judges.rewards import sentiment_lexicon

        def lexicon(completions, **_):
            return sentiment_lexicon(None, completions)

        common.pop("max_length")
        if task == "online_dpo":
            import copy
            import os

            os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
            from trl.experimental.online_dpo import OnlineDPOConfig as TRLOnlineDPOConfig
            from trl.experimental.online_dpo import OnlineDPOTrainer

            trainer = OnlineDPOTrainer(
                model=model,
                ref_model=copy.deepcopy(model),
                reward_funcs=[lexicon],
                args=TRLOnlineDPOConfig(**common, max_new_tokens=shape.completion, temperature=1.0),
                processing_class=tok,
                train_dataset=ds,
            )
        else:
            sampled: dict[str, Any] = {
                "num_generations": shape.generations,
                "max_completion_length": shape.completion,
            }
            if task == "grpo":
                args = trl.GRPOConfig(**common, **sampled)
                trainer = trl.GRPOTrainer(
                    model=model, reward_funcs=[lexicon], args=args, processing_class=tok, train_dataset=ds
                )
            else:  # without the KL term, as ours' RLOO runs (`_train_ours`)
                rloo_args = trl.RLOOConfig(**common, **sampled, beta=0.0)
                trainer = trl.RLOOTrainer(
                    model=model, reward_funcs=[lexicon], args=rloo_args, processing_class=tok, train_dataset=ds
                )
    trainer.add_callback(Clock())
    result = trainer.train()
    trainer.save_model(tempfile.mkdtemp())
    seconds = time.perf_counter() - t0
    # The last logged loss, as ours reports: with a log every step it is the last step's, where
    # `training_loss` would be the mean over the whole run.
    logs = trainer.state.log_history
    losses = [h["loss"] for h in logs if "loss" in h]
    lengths = [h["completions/mean_length"] for h in logs if "completions/mean_length" in h]
    return {
        "seconds": seconds,
        "loss": losses[-1] if losses else result.training_loss,
        "mean_completion_length": statistics.fmean(lengths) if lengths else None,
    }


def peak_mb(gpu: bool) -> float:
    """GPU: peak memory allocated by torch on the device; CPU: peak RSS of the process (imports included)."""
    if gpu:
        import torch

        return torch.cuda.max_memory_allocated() / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


class Warnings(logging.Handler):
    """The distinct warnings our library and torch log during a run (`with Warnings() as w: ...; w.messages`). A
    fallback taken on a GPU alone (the varlen kernel's check failing over to documents one by one, a compiled step
    given up for the eager one, CUDA graphs given up, dynamo's recompile limit) is said once in the run's log, which
    the bench does not print; a slow run should say why beside its rate."""

    # torch's logging setup stops its compilers' records at their own loggers (no propagation to "torch"), so
    # those are listened to directly; a record heard twice is kept once
    LOGGERS = ("alignpipe", "torch", "torch._dynamo", "torch._inductor")
    KEEP = 8

    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        text = f"{record.name}: {record.getMessage()}"[:400]
        if text not in self.messages and len(self.messages) < self.KEEP:
            self.messages.append(text)

    def __enter__(self) -> Warnings:
        for name in self.LOGGERS:
            logging.getLogger(name).addHandler(self)
        return self

    def __exit__(self, *exc) -> None:
        for name in self.LOGGERS:
            logging.getLogger(name).removeHandler(self)


def graphs_built() -> int:
    """How many graphs `torch.compile` has built in this process so far, and kernel variants Triton compiled for our
    hand-written kernels (`triton_kernels.variants_compiled`): counters read, cheap at every step."""
    from torch._dynamo import utils

    from alignpipe import triton_kernels

    return utils.counters["stats"]["unique_graphs"] + triton_kernels.variants_compiled()


def compilations() -> tuple[int, float]:
    """What `torch.compile` has built in this process so far: (graphs, seconds dynamo and inductor took over them).
    Ours compiles its fused kernels on a GPU; a run's share of it is the part of its fixed cost that compiling is."""
    from torch._dynamo import utils

    timed = getattr(utils, "compilation_time_metrics", {})
    # dynamo's timer of a whole compilation (named `_compile.compile_inner` in torch 2.13; older names end alike)
    seconds = [t for name, ts in timed.items() if name.endswith("compile_inner") for t in ts]
    return graphs_built(), float(sum(seconds))


IMPLS = ("ours", "trl", "trl+liger")


def case(impl: str, key: str | Case, kind: str, steps: int, assets: str, around=contextlib.nullcontext) -> dict:
    """Build the model and data of case `key` (a key of the suites, or a `Case` of no suite: `bench.liger_cpu`'s
    shrunk ones), then run and time one implementation; `around` wraps the timed part only (the profiler in
    `bench.profile`)."""
    import torch

    if impl not in IMPLS:
        raise SystemExit(f"unknown implementation {impl!r}; one of {', '.join(IMPLS)}")
    global ASSETS
    ASSETS = assets
    c = key if isinstance(key, Case) else find_case(kind, key)
    gpu = is_gpu_model(kind)
    torch.manual_seed(0)
    model, tok = model_for(kind, assets, c.trainer)
    data = rows(assets, c, steps, tok)
    if gpu:
        torch.cuda.reset_peak_memory_stats()
    clock = StepClock(steps, event=torch.cuda.Event if gpu else None)
    graphs, compile_s = compilations()
    forward = FirstForward(model)
    with around(), Warnings() as warned:
        try:
            if impl == "ours":
                out = ours(c, model, tok, data, steps, kind, clock)
            else:
                out = trl_run(c, model, tok, data, steps, kind, clock, liger=impl == "trl+liger")
            end = time.perf_counter()
        finally:
            clock.finish()
            forward.remove()
    per_step = c.shape.per_step
    graphs_after, compile_s_after = compilations()
    return {
        "impl": impl,
        "case": c.key,
        "model": kind,
        **out,
        "samples_per_s": steps * per_step / out["seconds"],
        "steady_samples_per_s": clock.steady(per_step) if c.shape.log_every else None,
        "step_ms": clock.step_ms(),
        **clock.ends(end - out["seconds"], end, forward.at),
        "steady_compile_steps": clock.steady_graphs(),
        "peak_mb": peak_mb(gpu),
        "compiled_graphs": graphs_after - graphs,
        "compile_s": compile_s_after - compile_s,
        "warnings": warned.messages,
        **({"steady_syncs": clock.syncs.summary()} if clock.syncs is not None else {}),
    }


def main(impl: str, key: str, kind: str, steps: int, assets: str) -> None:
    print(json.dumps(case(impl, key, kind, steps, assets)))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), sys.argv[5])
