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


def rows(assets: str, task: str) -> list[dict]:
    name = {"sft": "sentiment_sft", "grpo": "sentiment_prompts"}.get(task, "sentiment_preferences")
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
    seconds = time.perf_counter() - t0
    return seconds, tracker.last("train/loss"), tracker.series("train/tokens_per_s")


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

    torch.manual_seed(0)
    model, tok = model_for(kind, assets, task)
    data = rows(assets, task)
    seconds, loss, _ = (ours if impl == "ours" else trl_run)(task, model, tok, data, steps)
    samples = steps * (2 * G if task == "grpo" else BATCH)
    print(json.dumps({"impl": impl, "task": task, "model": kind, "seconds": seconds, "samples_per_s": samples / seconds,
                      "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, "loss": loss}))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), sys.argv[5])
