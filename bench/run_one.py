"""One measurement in a fresh process: `python -m bench.run_one IMPL TRAINER MODEL STEPS ASSETS` prints one
JSON line {samples_per_s, tokens_per_s, peak_rss_mb, loss}. Same model, tokenizer, data and
hyperparameters for both implementations. Timed for both: data preparation + training + saving the model
(what a user waits for; model loading excluded); checkpointing off."""

from __future__ import annotations

import json
import os
import resource
import sys
import tempfile
import time

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_DATASETS_DISABLE_PROGRESS_BARS", "1")

BATCH, LR, MAX_LEN = 8, 1e-4, 64
ASSETS = ""  # set by main
G, COMPLETION = 8, 32  # GRPO: 16 completions per step = 2 prompts × 8 generations, 32 new tokens


def model_for(kind: str, assets: str, task: str):
    import torch
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, LlamaConfig

    from alignpipe.modeling import load_tokenizer

    tok = load_tokenizer(f"{assets}/model")
    if kind == "tiny":
        cls = AutoModelForSequenceClassification if task == "reward" else AutoModelForCausalLM
        kwargs = {"num_labels": 1} if task == "reward" else {}
        model = cls.from_pretrained(f"{assets}/model", **kwargs)
    else:  # "small": the BASELINES.md shape, random init
        from transformers import LlamaForCausalLM, LlamaForSequenceClassification

        cfg = LlamaConfig(vocab_size=len(tok), hidden_size=512, num_hidden_layers=6, num_attention_heads=8, num_key_value_heads=4,
                          intermediate_size=1536, max_position_embeddings=512, tie_word_embeddings=True,
                          eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, num_labels=1)
        torch.manual_seed(0)
        model = (LlamaForSequenceClassification if task == "reward" else LlamaForCausalLM)(cfg)
    model.config.pad_token_id = tok.pad_token_id
    return model, tok


def reward_model_dir(assets: str) -> str:
    """A seeded sequence-scoring head on the tiny model, saved once: PPO's reward model for both sides."""
    import torch
    from transformers import AutoModelForSequenceClassification

    path = f"{tempfile.gettempdir()}/alignpipe-bench-rm"
    if not os.path.exists(f"{path}/config.json"):
        from alignpipe.modeling import load_tokenizer

        torch.manual_seed(1)
        tok = load_tokenizer(f"{assets}/model")
        rm = AutoModelForSequenceClassification.from_pretrained(f"{assets}/model", num_labels=1)
        rm.config.pad_token_id = tok.pad_token_id
        rm.save_pretrained(path)
        tok.save_pretrained(path)
    return path


def rows(assets: str, task: str) -> list[dict]:
    name = {"sft": "sentiment_sft", "grpo": "sentiment_prompts", "ppo": "sentiment_prompts"}.get(task, "sentiment_preferences")
    out = [json.loads(line) for line in open(f"{assets}/data/{name}.jsonl")]
    if task == "sft":
        out = [{"prompt": r["prompt"], "completion": r["completion"]} for r in out]
    return out[:2000]


def ours(task: str, model, tok, data, steps: int):
    from alignpipe.judges.reward_set import LoadedReward, RewardSet
    from alignpipe.judges.rewards import sentiment_lexicon
    from alignpipe.tracking import Tracker
    from alignpipe.trainers import dpo, grpo, reward, sft
    from alignpipe.trainers.configs import DPOConfig, GRPOConfig, RewardConfig, SFTConfig

    common = dict(learning_rate=LR, max_steps=steps, batch_size=BATCH, max_length=MAX_LEN, logging_every=steps, lr_scheduler="linear")
    tracker, out = Tracker(), tempfile.mkdtemp()
    t0 = time.perf_counter()
    if task == "sft":
        sft.train(SFTConfig(**common), model, tok, data, [], tracker, out)
    elif task == "reward":
        reward.train(RewardConfig(**common), model, tok, data, [], tracker, out)
    elif task == "dpo":
        import copy

        dpo.train(DPOConfig(**common), model, tok, data, [], tracker, out, ref_model=copy.deepcopy(model))
    elif task == "grpo":
        cfg = GRPOConfig(**{**common, "batch_size": 2 * G}, num_generations=G, max_completion_length=COMPLETION, sample_every=10**9)
        grpo.train(cfg, model, tok, data, RewardSet([LoadedReward("lexicon", sentiment_lexicon)]), tracker, out)
    elif task == "ppo":
        import copy

        from alignpipe.engine.sampling import SamplingParams
        from alignpipe.judges.reward_model import RewardModelScorer
        from alignpipe.modeling import load_sequence_scorer
        from alignpipe.trainers import ppo
        from alignpipe.trainers.configs import PPOConfig

        rm = reward_model_dir(ASSETS)
        cfg = PPOConfig(**common, max_completion_length=COMPLETION, num_ppo_epochs=4, sample_every=10**9,
                        sampling=SamplingParams(temperature=0.7, max_new_tokens=COMPLETION), missing_eos_penalty=1.0)
        value = load_sequence_scorer(rm, pad_token_id=tok.pad_token_id)
        ppo.train(cfg, model, value, tok, data, RewardSet([LoadedReward("rm", RewardModelScorer(rm))]), tracker, out,
                  ref_model=copy.deepcopy(model))
    seconds = time.perf_counter() - t0
    return seconds, tracker.last("loss/policy_avg" if task == "ppo" else "train/loss"), tracker.series("train/tokens_per_s")


def trl_run(task: str, model, tok, data, steps: int):
    import trl
    from datasets import Dataset

    common = dict(output_dir=tempfile.mkdtemp(), max_steps=steps, per_device_train_batch_size=BATCH, learning_rate=LR,
                  report_to="none", use_cpu=True, bf16=False, gradient_checkpointing=False, save_strategy="no",
                  logging_steps=steps, lr_scheduler_type="linear", max_length=MAX_LEN, disable_tqdm=True)
    ds = Dataset.from_list(data)
    t0 = time.perf_counter()  # construction (tokenization) + train + save, as `ours` is timed
    if task == "sft":
        trainer = trl.SFTTrainer(model=model, args=trl.SFTConfig(**common, completion_only_loss=True), processing_class=tok, train_dataset=ds)
    elif task == "reward":
        trainer = trl.RewardTrainer(model=model, args=trl.RewardConfig(**common), processing_class=tok, train_dataset=ds)
    elif task == "dpo":
        import copy

        trainer = trl.DPOTrainer(model=model, ref_model=copy.deepcopy(model), args=trl.DPOConfig(**common), processing_class=tok,
                                 train_dataset=ds)
    elif task == "ppo":  # TRL 1.12 (the last with PPO), from its own target folder on PYTHONPATH
        import copy

        from transformers import AutoModelForSequenceClassification
        from trl.experimental.ppo import PPOConfig, PPOTrainer

        rm = reward_model_dir(ASSETS)
        for k in ("max_length", "lr_scheduler_type"):
            common.pop(k)
        prompts = Dataset.from_dict({"input_ids": [tok(r["prompt"])["input_ids"] for r in data]})
        args = PPOConfig(**common, total_episodes=steps * BATCH, num_ppo_epochs=4, num_mini_batches=1, response_length=COMPLETION,
                         temperature=0.7, stop_token="eos", missing_eos_penalty=1.0, kl_coef=0.05, num_sample_generations=0,
                         local_rollout_forward_batch_size=BATCH)
        trainer = PPOTrainer(args=args, processing_class=tok, model=model, ref_model=copy.deepcopy(model),
                             reward_model=AutoModelForSequenceClassification.from_pretrained(rm, num_labels=1),
                             value_model=AutoModelForSequenceClassification.from_pretrained(rm, num_labels=1),
                             train_dataset=prompts)
        trainer.train()
        trainer.save_model(tempfile.mkdtemp())
        seconds = time.perf_counter() - t0
        losses = [h.get("loss/policy_avg") for h in trainer.state.log_history if "loss/policy_avg" in h]
        return seconds, losses[-1] if losses else None, []
    elif task == "grpo":
        from alignpipe.judges.rewards import sentiment_lexicon

        def lexicon(completions, **_):
            return sentiment_lexicon(None, completions)

        common.pop("max_length")
        args = trl.GRPOConfig(**{**common, "per_device_train_batch_size": 2 * G}, num_generations=G,
                              max_completion_length=COMPLETION)
        trainer = trl.GRPOTrainer(model=model, reward_funcs=[lexicon], args=args, processing_class=tok, train_dataset=ds)
    result = trainer.train()
    trainer.save_model(tempfile.mkdtemp())
    seconds = time.perf_counter() - t0
    return seconds, result.training_loss, [h.get("num_tokens") for h in trainer.state.log_history if "num_tokens" in h]


def main(impl: str, task: str, kind: str, steps: int, assets: str) -> None:
    import torch

    global ASSETS
    ASSETS = assets
    torch.manual_seed(0)
    model, tok = model_for(kind, assets, task)
    data = rows(assets, task)
    seconds, loss, _ = (ours if impl == "ours" else trl_run)(task, model, tok, data, steps)
    samples = steps * (2 * G if task == "grpo" else BATCH)  # PPO: episodes
    print(json.dumps({"impl": impl, "task": task, "model": kind, "seconds": seconds, "samples_per_s": samples / seconds,
                      "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, "loss": loss}))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), sys.argv[5])
