"""One measurement in a fresh process: `python -m bench.run_one IMPL TRAINER MODEL STEPS ASSETS` prints one
JSON line {samples_per_s, peak_mb, loss, ...}. Same model, tokenizer, data and hyperparameters for both
implementations. Timed for both: data preparation + training + saving the model (what a user waits for;
model loading excluded); checkpointing off.

Models: `tiny` (the project's 1.7M Llama) and `small` (a 20M Llama, random init) run on CPU in fp32;
`qwen0.5b` (Qwen2-0.5B's shape, random init) runs on a GPU in bf16 with longer rows (see `SHAPES`).
"""

from __future__ import annotations

import contextlib
import json
import os
import resource
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_DATASETS_DISABLE_PROGRESS_BARS", "1")

LR = 1e-4
ASSETS = ""  # set by main


@dataclass(frozen=True)
class Shape:
    """What one benchmark step is made of, per machine class."""

    batch: int  # rows per optimizer step (PPO: episodes)
    max_len: int  # tokens per row, prompt included
    generations: int  # GRPO: completions per prompt (2 prompts per step)
    completion: int  # GRPO/PPO: new tokens per completion
    join: int  # synthetic rows concatenated into one training row (longer sequences on GPU)
    gpu: bool
    log_every: int = 0  # log each N steps (0: once, at the end); GPU logs every step for the steady-state clock


WARMUP_STEPS = 5  # steps left out of the steady-state rate (CUDA/cuBLAS warm-up, allocator growth)


class StepClock:
    """Wall time at the end of each optimizer step: the steady-state rate leaves out data preparation, the
    warm-up steps and saving, which dominate a short end-to-end timing on a fast GPU."""

    def __init__(self):
        self.times: list[float] = []

    def tick(self) -> None:
        self.times.append(time.perf_counter())

    def steady(self, per_step: int) -> float | None:
        n = len(self.times) - 1 - WARMUP_STEPS
        return per_step * n / (self.times[-1] - self.times[WARMUP_STEPS]) if n > 0 else None


CPU = Shape(batch=8, max_len=64, generations=8, completion=32, join=1, gpu=False)
GPU = Shape(batch=8, max_len=512, generations=8, completion=64, join=24, gpu=True, log_every=1)
QWEN_05B = dict(
    vocab_size=151936,
    hidden_size=896,
    intermediate_size=4864,
    num_hidden_layers=24,
    num_attention_heads=14,
    num_key_value_heads=2,
    max_position_embeddings=4096,
    rope_theta=1_000_000.0,
    tie_word_embeddings=True,
)


def shape_for(kind: str) -> Shape:
    return GPU if kind.startswith("qwen") else CPU


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
    return model, tok


def random_model(kind: str, tok, head: str, seed: int = 0):
    """`small`: the BASELINES.md 20M Llama shape in fp32 on CPU; `qwen0.5b`: Qwen2-0.5B's shape, built in bf16
    directly on the GPU. Random init, seeded."""
    import torch
    from transformers import (
        LlamaConfig,
        LlamaForCausalLM,
        LlamaForSequenceClassification,
        Qwen2Config,
        Qwen2ForCausalLM,
        Qwen2ForSequenceClassification,
    )

    ids = dict(eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, num_labels=1)
    torch.manual_seed(seed)
    if kind == "small":
        cfg = LlamaConfig(
            vocab_size=len(tok),
            hidden_size=512,
            num_hidden_layers=6,
            num_attention_heads=8,
            num_key_value_heads=4,
            intermediate_size=1536,
            max_position_embeddings=512,
            tie_word_embeddings=True,
            **ids,
        )
        return (LlamaForSequenceClassification if head == "reward" else LlamaForCausalLM)(cfg)
    cfg = Qwen2Config(**QWEN_05B, **ids)
    cls = Qwen2ForSequenceClassification if head == "reward" else Qwen2ForCausalLM
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

    gpu = shape_for(kind).gpu
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


def rows(assets: str, task: str, shape: Shape = CPU) -> list[dict]:
    """The synthetic sentiment data; on GPU each row is `join` rows' text run together (~500 tokens)."""
    prompts_only = ("grpo", "rloo", "ppo", "online_dpo")
    name = {"sft": "sentiment_sft", **dict.fromkeys(prompts_only, "sentiment_prompts")}.get(
        task, "sentiment_preferences"
    )
    data = [json.loads(line) for line in Path(f"{assets}/data/{name}.jsonl").read_text().splitlines()]
    k, n = shape.join, len(data)
    if task == "sft":
        return [
            {"prompt": r["prompt"], "completion": "".join(data[(i + j) % n]["completion"] for j in range(k))}
            for i, r in enumerate(data[:2000])
        ]
    if task in ("dpo", "reward") and k > 1:
        tail = lambda i: "".join(data[(i + j) % n]["chosen"] for j in range(1, k))  # noqa: E731
        return [
            {"prompt": r["prompt"], "chosen": r["chosen"] + tail(i), "rejected": r["rejected"] + tail(i)}
            for i, r in enumerate(data[:2000])
        ]
    if task == "kto":  # each pair as two thumbs: chosen → true, rejected → false
        return [
            {"prompt": r["prompt"], "completion": r[side], "label": side == "chosen"}
            for r in data[:1000]
            for side in ("chosen", "rejected")
        ]
    return data[:2000]


def ours(task: str, model, tok, data, steps: int, shape: Shape, kind: str, clock: StepClock):
    from alignpipe.judges.reward_set import LoadedReward, RewardSet
    from alignpipe.judges.rewards import sentiment_lexicon
    from alignpipe.tracking import Tracker
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

    class ClockedTracker(Tracker):
        def log_metrics(self, metrics: dict, step: int) -> None:
            if not self.history or self.history[-1][0] != step:
                clock.tick()
            super().log_metrics(metrics, step)

    common = dict(
        learning_rate=LR,
        max_steps=steps,
        batch_size=shape.batch,
        max_length=shape.max_len,
        logging_every=shape.log_every or steps,
        lr_scheduler="linear",
    )
    tracker, out = ClockedTracker(), tempfile.mkdtemp()
    t0 = time.perf_counter()
    if task == "sft":
        sft.train(SFTConfig(**common), model, tok, data, [], tracker, out)
    elif task == "reward":
        reward.train(RewardConfig(**common), model, tok, data, [], tracker, out)
    elif task == "dpo":
        import copy

        dpo.train(DPOConfig(**common), model, tok, data, [], tracker, out, ref_model=copy.deepcopy(model))
    elif task == "kto":
        import copy

        kto.train(KTOConfig(**common), model, tok, data, [], tracker, out, ref_model=copy.deepcopy(model))
    elif task in ("grpo", "rloo"):
        import copy

        config, trainer = (GRPOConfig, grpo) if task == "grpo" else (RLOOConfig, rloo)
        cfg = config(
            **{**common, "batch_size": 2 * shape.generations},
            num_generations=shape.generations,
            max_completion_length=shape.completion,
            sample_every=10**9,
            # RLOO without its KL term on both sides: TRL builds RLOO's reference from the model's path, which the
            # bench's random-initialised models do not have
            **({"beta": 0.0} if task == "rloo" else {}),
        )
        lexicon = RewardSet([LoadedReward("lexicon", sentiment_lexicon)])
        ref = copy.deepcopy(model) if cfg.beta else None
        trainer.train(cfg, model, tok, data, lexicon, tracker, out, ref_model=ref)
    elif task == "online_dpo":
        import copy

        lexicon = RewardSet([LoadedReward("lexicon", sentiment_lexicon)])
        cfg = OnlineDPOConfig(
            **{k: v for k, v in common.items() if k != "max_length"},
            max_completion_length=shape.completion,
            sample_every=10**9,
        )
        ranker = online_dpo.RewardRanker(lexicon, None)
        online_dpo.train(cfg, model, tok, data, ranker, tracker, out, ref_model=copy.deepcopy(model))
    elif task == "ppo":
        import copy

        from alignpipe.engine.sampling import SamplingParams
        from alignpipe.judges.reward_model import RewardModelScorer
        from alignpipe.modeling import load_sequence_scorer
        from alignpipe.trainers import ppo
        from alignpipe.trainers.configs import PPOConfig

        rm, dtype = reward_model_dir(ASSETS, kind), ("bfloat16" if shape.gpu else "float32")
        cfg = PPOConfig(
            **common,
            max_completion_length=shape.completion,
            num_ppo_epochs=4,
            sample_every=10**9,
            sampling=SamplingParams(temperature=0.7, max_new_tokens=shape.completion),
            missing_eos_penalty=1.0,
        )
        value = load_sequence_scorer(rm, dtype, pad_token_id=tok.pad_token_id)
        ppo.train(
            cfg,
            model,
            value,
            tok,
            data,
            RewardSet([LoadedReward("rm", RewardModelScorer(rm, dtype=dtype))]),
            tracker,
            out,
            ref_model=copy.deepcopy(model),
        )
    seconds = time.perf_counter() - t0
    return seconds, tracker.last("loss/policy_avg" if task == "ppo" else "train/loss")


def trl_run(task: str, model, tok, data, steps: int, shape: Shape, kind: str, clock: StepClock):
    import trl
    from datasets import Dataset
    from transformers import TrainerCallback

    class Clock(TrainerCallback):
        def on_step_end(self, *_, **__):
            clock.tick()

    common = dict(
        output_dir=tempfile.mkdtemp(),
        max_steps=steps,
        per_device_train_batch_size=shape.batch,
        learning_rate=LR,
        report_to="none",
        use_cpu=not shape.gpu,
        bf16=shape.gpu,
        gradient_checkpointing=False,
        save_strategy="no",
        logging_steps=shape.log_every or steps,
        lr_scheduler_type="linear",
        max_length=shape.max_len,
        disable_tqdm=True,
    )
    ds = Dataset.from_list(data)
    t0 = time.perf_counter()  # construction (tokenization) + train + save, as `ours` is timed
    if task == "sft":
        trainer = trl.SFTTrainer(
            model=model, args=trl.SFTConfig(**common, completion_only_loss=True), processing_class=tok, train_dataset=ds
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
            total_episodes=steps * shape.batch,
            num_ppo_epochs=4,
            num_mini_batches=1,
            response_length=shape.completion,
            temperature=0.7,
            stop_token="eos",
            missing_eos_penalty=1.0,
            kl_coef=0.05,
            num_sample_generations=0,
            local_rollout_forward_batch_size=shape.batch,
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
        return seconds, losses[-1] if losses else None
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
            config, trainer_class = (
                (trl.GRPOConfig, trl.GRPOTrainer) if task == "grpo" else (trl.RLOOConfig, trl.RLOOTrainer)
            )
            args = config(
                **{**common, "per_device_train_batch_size": 2 * shape.generations},
                num_generations=shape.generations,
                max_completion_length=shape.completion,
                **({"beta": 0.0} if task == "rloo" else {}),
            )
            trainer = trainer_class(
                model=model, reward_funcs=[lexicon], args=args, processing_class=tok, train_dataset=ds
            )
    trainer.add_callback(Clock())
    result = trainer.train()
    trainer.save_model(tempfile.mkdtemp())
    seconds = time.perf_counter() - t0
    # The last logged loss, as ours reports: with a log every step it is the last step's, where
    # `training_loss` would be the mean over the whole run.
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    return seconds, losses[-1] if losses else result.training_loss


def peak_mb(gpu: bool) -> float:
    """GPU: peak memory allocated by torch on the device; CPU: peak RSS of the process (imports included)."""
    if gpu:
        import torch

        return torch.cuda.max_memory_allocated() / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def case(impl: str, task: str, kind: str, steps: int, assets: str, around=contextlib.nullcontext) -> dict:
    """Build the model and data, then run and time one side; `around` wraps the timed part only (the
    profiler in `bench.profile`)."""
    import torch

    global ASSETS
    ASSETS = assets
    shape = shape_for(kind)
    torch.manual_seed(0)
    model, tok = model_for(kind, assets, task)
    data = rows(assets, task, shape)
    if shape.gpu:
        torch.cuda.reset_peak_memory_stats()
    clock = StepClock()
    with around():
        seconds, loss = (ours if impl == "ours" else trl_run)(task, model, tok, data, steps, shape, kind, clock)
    # GRPO/RLOO: completions; PPO: episodes; online DPO: prompts (two completions each)
    per_step = 2 * shape.generations if task in ("grpo", "rloo") else shape.batch
    return {
        "impl": impl,
        "task": task,
        "model": kind,
        "seconds": seconds,
        "samples_per_s": steps * per_step / seconds,
        "steady_samples_per_s": clock.steady(per_step) if shape.log_every else None,
        "peak_mb": peak_mb(shape.gpu),
        "loss": loss,
    }


def main(impl: str, task: str, kind: str, steps: int, assets: str) -> None:
    print(json.dumps(case(impl, task, kind, steps, assets)))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), sys.argv[5])
