"""How many token positions a model can take, and how many a stage will feed it.

Models with a learned position table (GPT-2, OPT, GPT-Neo, ...) index it with each token's position: a sequence
longer than the table fails inside the first forward with an index error on CPU and a device-side assert on a GPU,
after the stages before have run. Rotary models (Llama, Qwen, Mistral) have no such table and no hard limit here.
Importing it imports no torch: `alignpipe validate` reads configs only.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from alignpipe.special_tokens import encode

# model_type → the config key holding the size of its learned position table.
LEARNED_TABLES = {
    "gpt2": "n_positions",
    "gpt_bigcode": "n_positions",
    "openai-gpt": "n_positions",
    "gpt_neo": "max_position_embeddings",
    "opt": "max_position_embeddings",
    "biogpt": "max_position_embeddings",
}
TABLE_NAMES = ("wpe", "embed_positions", "position_embeddings")


def config_position_limit(config: dict[str, Any]) -> int | None:
    """Positions a model of this `config.json` can index, or None where it has no learned table we know."""
    key = LEARNED_TABLES.get(config.get("model_type", ""))
    value = config.get(key) if key else None
    return int(value) if isinstance(value, int) else None


def model_position_limit(model) -> int | None:
    """Positions a loaded model's learned position table holds (OPT's table carries an offset of 2), or None."""
    import torch

    base = getattr(model, "base_model", model)
    for name, module in base.named_modules():
        if name.rsplit(".", 1)[-1] in TABLE_NAMES and isinstance(module, torch.nn.Embedding):
            return module.num_embeddings - int(getattr(module, "offset", 0))
    return None


def local_config(path: str, revision: str | None = None) -> dict[str, Any] | None:
    """The `config.json` of a model directory, or of a Hub model already in the local cache (nothing is
    downloaded); None where neither is at hand or it cannot be read."""
    file = Path(path).expanduser() / "config.json"
    if not file.is_file():
        try:
            from huggingface_hub import try_to_load_from_cache

            cached = try_to_load_from_cache(path, "config.json", revision=revision)
        except Exception:  # not a repo id
            return None
        if not isinstance(cached, str):
            return None
        file = Path(cached)
    try:
        return json.loads(file.read_text())
    except (OSError, ValueError):
        return None


def stage_window(stage) -> tuple[int, str] | None:
    """(tokens, the fields that set it): the longest sequence a training stage feeds its model; None for stages
    that train nothing or whose prompts are not cut (`max_prompt_length: null` in an RL stage)."""
    from alignpipe.trainers.configs import OnlineRLArgs, TrainingArgs

    if isinstance(stage, OnlineRLArgs):
        if stage.max_prompt_length is None:
            return None
        return (
            stage.max_prompt_length + stage.max_completion_length,
            "max_prompt_length + max_completion_length",
        )
    if isinstance(stage, TrainingArgs):
        return stage.max_length, "max_length"
    return None


def window_problem(
    limit: int | None, window: tuple[int, str] | None, model: str = "the model"
) -> tuple[str, str] | None:
    """(what is wrong, how to fix it) where the stage's window does not fit `model`'s position table."""
    if limit is None or window is None or window[0] <= limit:
        return None
    tokens, fields = window
    first = fields.split(" + ")[0]
    return (
        f"{fields} is {tokens} tokens, but {model}'s learned position table holds {limit} positions: "
        "longer sequences fail in the first forward pass",
        f"lower {first} so the window is at most {limit} tokens",
    )


def check_model_window(model, stage) -> None:
    """Raise before training when `stage` would feed `model` more positions than its table holds."""
    problem = window_problem(model_position_limit(model), stage_window(stage))
    if problem:
        what, fix = problem
        raise ValueError(f"stage {stage.id!r}: {what}; {fix}")


def check_generation_window(
    limit: int | None,
    tokenizer,
    prompts: list[str],
    new_tokens: int,
    name: str,
    new_field: str = "sampling.max_new_tokens",
    prompt_fix: str = "keep prompts to at most {n} tokens (the prompts' format stage drops longer rows with `max_length`)",
) -> None:
    """Raise before generating when the longest prompt plus `new_tokens` (the `new_field` setting) outgrows a
    position table of `limit` rows (`model_position_limit`); `prompt_fix` says how to shorten the prompts to `{n}`
    tokens."""
    if limit is None or not prompts:
        return
    longest = longest_prompt(tokenizer, prompts)
    if longest + new_tokens > limit:
        raise ValueError(
            f"{name}: the longest prompt is {longest} tokens, and with {new_field} ({new_tokens}) generation needs "
            f"{longest + new_tokens} positions, but the model's learned position table holds {limit}; "
            f"{prompt_fix.format(n=limit - new_tokens)} or lower {new_field}"
        )


def rollout_window(tokenizer, prompts: list[str], max_prompt_length: int | None, new_tokens: int, config) -> int:
    """The longest sequence an RL stage's rollouts decode: its longest prompt (cut to `max_prompt_length`, as the
    trainers cut them) plus `new_tokens`, within the positions the model's `config` declares. What a vLLM colocate
    engine sizes its KV cache for, rather than the model's whole context (128k positions for Llama 3.1, more KV cache
    than a colocated engine's share of the GPU holds)."""
    longest = longest_prompt(tokenizer, prompts)
    if max_prompt_length is not None:
        longest = min(longest, max_prompt_length)
    window = longest + new_tokens
    declared = getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None)
    return min(window, declared) if isinstance(declared, int) else window


def longest_prompt(tokenizer, prompts: list[str]) -> int:
    """Tokens in the longest of `prompts`, encoded as the trainers encode them (`special_tokens.encode`); 0 for none."""
    return max((len(ids) for ids in encode(tokenizer, prompts)), default=0)
