"""Loading models and tokenizers from a local path, a Hub id, or an upstream stage's output."""

from __future__ import annotations

import contextlib
import functools
import logging
from pathlib import Path
from typing import Any, overload

log = logging.getLogger(__name__)

DTYPES = {"float32": "float32", "bfloat16": "bfloat16", "float16": "float16"}


def torch_dtype(name: str):
    import torch

    return "auto" if name == "auto" else getattr(torch, DTYPES[name])


def attention_kernels():
    """A context in which `scaled_dot_product_attention` runs the flash or memory-efficient kernels (or math), not
    cuDNN's. PyTorch prefers cuDNN's on Hopper GPUs, and cuDNN builds an execution plan on the host for every new
    shape: milliseconds per call, where padded batches of varying length (and a KV cache that grows by one token per
    decoding step) make most calls a new shape. Profiled on an H100 (Qwen2-0.5B-shaped SFT, ~260-token rows), plan
    building was two thirds of the host time of a step; leaving cuDNN out ran SFT 1.4–2.6× and DPO 1.5–1.9× faster
    in steady state (docs/benchmarks.md). CPU attention is unaffected (its kernels are flash and math)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH])


def under_attention_kernels(fn):
    """Decorator: `fn` runs inside `attention_kernels()` (each trainer's `train`, the hf engine's
    `HFEngine._generate`, the reward-model scorer)."""
    import functools

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        with attention_kernels():
            return fn(*args, **kwargs)

    return wrapper


def mask_positions(mask):
    """Position ids of a (B, T) attention mask: real tokens counted from 0, so left-padded prompts get the positions
    `generate` gives them (padding sits at 0)."""
    return (mask.long().cumsum(-1) - 1).clamp(min=0)


def enable_activation_checkpointing(model, every_n_layers: int = 1) -> None:
    """Turn activation checkpointing on: `activation_checkpointing_enable` in newer transformers (5.23 here), where
    the older `gradient_checkpointing_enable` warns that it goes away in v6. `every_n_layers` > 1 leaves all decoder
    layers but 0, N, 2N, … unchecked (set here, as 5.23 does, for the transformers 5 releases without it)."""
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable()
    else:
        model.gradient_checkpointing_enable()
    if every_n_layers > 1:
        from transformers.modeling_layers import GradientCheckpointingLayer

        layers = (m for m in model.modules() if isinstance(m, GradientCheckpointingLayer))
        for index, layer in enumerate(layers):
            layer.gradient_checkpointing = index % every_n_layers == 0


def is_activation_checkpointing(model) -> bool:
    """Whether activation checkpointing is on (`is_activation_checkpointing`, or the older, warning
    `is_gradient_checkpointing`)."""
    if hasattr(type(model), "is_activation_checkpointing"):
        return bool(model.is_activation_checkpointing)
    return bool(getattr(model, "is_gradient_checkpointing", False))


@overload
def implementation(attention: str) -> str: ...
@overload
def implementation(attention: None) -> None: ...
def implementation(attention: str | None) -> str | None:
    """transformers' `attn_implementation` to load the recipe's `model.attention` with: ours (`varlen`) registered
    first; `auto` loads as `sdpa` and `settle_auto` chooses once the weights' dtype is known."""
    if attention == "varlen":
        from alignpipe.attention import register

        return register()
    return "sdpa" if attention == "auto" else attention


def settle_auto(model, attention: str | None) -> None:
    """Under `model.attention: auto`, switch `model`'s attention (as loaded) to `alignpipe.attention.choose`'s pick
    (logged once per pick and reason)."""
    if attention != "auto":
        return
    from alignpipe.attention import choose

    name, why = choose(model)
    if name != model.config._attn_implementation:
        model.set_attn_implementation(name)
    _log_choice(name, why)


@functools.cache
def _log_choice(name: str, why: str) -> None:
    log.info("model.attention: auto runs %s (%s)", name, why)


@contextlib.contextmanager
def attention_errors(attention: str | None):
    """Loading a model with the recipe's `model.attention`: a kernel this machine cannot run (flash-attn not
    installed, no CUDA device) fails naming the recipe field and the way out."""
    try:
        yield
    except (ImportError, ValueError) as e:
        if attention in (None, "auto", "sdpa", "eager") or "attention" not in str(e).lower():
            raise
        raise ValueError(
            f"model.attention: {attention} cannot be used on this machine ({e}). Install what it needs "
            "(flash_attention_2: `pip install flash-attn` on a CUDA GPU) or set `model.attention: sdpa`"
        ) from e


def load_tokenizer(
    path: str,
    revision: str | None = None,
    trust_remote_code: bool = False,
    eos_token: str | None = None,
    chat_template: str | None = None,
):
    """A tokenizer with a pad token (falls back to EOS, as TRL does); `eos_token` (the recipe's `model.eos_token`)
    replaces its EOS, and must be one token it already has; `chat_template` (`model.chat_template`) its template."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path, revision=revision, trust_remote_code=trust_remote_code)
    if chat_template is not None:
        tok.chat_template = chat_template
    if eos_token is not None:
        ids = tok(eos_token, add_special_tokens=False)["input_ids"]
        if len(ids) != 1 or tok.convert_ids_to_tokens(ids[0]) != eos_token:
            raise ValueError(
                f"model.eos_token {eos_token!r} is not one token of the tokenizer at {path} (it encodes as {ids}); "
                "name a token of its vocabulary, such as its chat template's end-of-turn token"
            )
        tok.eos_token = eos_token
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    return tok


def load_causal_lm(
    path: str,
    dtype: str = "float32",
    revision: str | None = None,
    trust_remote_code: bool = False,
    adapter: str | None = None,
    merge: bool = False,
    attention: str | None = None,
):
    """A causal LM from `path`; with `adapter`, the peft adapter at that path applied on top
    (merged into the weights when `merge`). `attention`: transformers' `attn_implementation` (its default when
    None)."""
    from transformers import AutoModelForCausalLM

    with attention_errors(attention):
        model: Any = AutoModelForCausalLM.from_pretrained(
            path,
            dtype=torch_dtype(dtype),
            revision=revision,
            trust_remote_code=trust_remote_code,
            attn_implementation=implementation(attention),
        )
    settle_auto(model, attention)
    if adapter:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, adapter)
        if merge:
            model = model.merge_and_unload()
    return model


def lora_model(model, spec, task_type: str = "CAUSAL_LM"):
    """Wrap `model` with a fresh LoRA adapter described by a `LoraSpec` (SEQ_CLS also trains the head)."""
    from peft import LoraConfig, get_peft_model

    cfg = LoraConfig(
        r=spec.r,
        lora_alpha=spec.alpha,
        lora_dropout=spec.dropout,
        target_modules=spec.target_modules,
        task_type=task_type,
    )
    wrapped = get_peft_model(model, cfg)
    head = model.get_output_embeddings() if task_type == "CAUSAL_LM" else None
    if head is not None and hasattr(head, "base_layer"):  # a peft tuner layer
        name = next(n for n, m in model.named_modules() if m is head)
        raise ValueError(
            f"lora.target_modules adapts the LM head ({name}): the trainers compute it from its weight chunk by "
            f"chunk, so an adapter on it would never train; remove {name} from target_modules (all-linear leaves it "
            "out)"
        )
    return wrapped


def add_neftune(model, alpha: float):
    """NEFTune (Jain et al. 2023): while the model is in training mode, add uniform noise of magnitude
    alpha / sqrt(sequence length × hidden size) to the input embeddings (the definition TRL's SFTTrainer uses through
    transformers). Evaluation and generation (eval mode) see the embeddings unchanged. Returns the hook's handle:
    `.remove()` it when training ends."""
    import math

    import torch

    def hook(module, inputs, output):
        if module.training:
            magnitude = alpha / math.sqrt(output.size(1) * output.size(2))
            output = output + torch.zeros_like(output).uniform_(-magnitude, magnitude)
        return output

    return model.get_input_embeddings().register_forward_hook(hook)


def merged_state_dict(model) -> dict:
    """The weights a peft LoRA model would have after `merge_and_unload()`, under the base model's names, computed
    without touching the model: `merge_and_unload()` on the live policy would strip the adapter being trained (the
    vLLM colocate engine needs merged weights after every step). A plain model gives its `state_dict()`."""
    import torch

    if not hasattr(model, "peft_config"):
        return model.state_dict()
    from peft.tuners.lora import LoraLayer

    base = model.get_base_model()
    deltas = {}
    with torch.no_grad():
        for name, module in base.named_modules():
            if isinstance(module, LoraLayer) and not module.merged:
                active = [a for a in module.active_adapters if a in module.lora_A]
                if active:
                    deltas[name] = sum(module.get_delta_weight(a) for a in active)  # type: ignore[attr-defined]
        state = {}
        for key, value in base.state_dict().items():
            if ".lora_" in key or ".original_module." in key:
                continue
            module_name, sep, param = key.rpartition(".base_layer.")
            if sep:
                if param == "weight" and module_name in deltas:
                    value = value + torch.as_tensor(deltas[module_name]).to(value.dtype)
                key = f"{module_name}.{param}"
            state[key.replace(".modules_to_save.default.", ".")] = value.detach()
    return state


def disable_dropout(model) -> None:
    """Every dropout in `model` at probability 0: `nn.Dropout` layers (TRL's `disable_dropout_in_model` stops there)
    and the float rates models apply functionally (OPT's `dropout`, Llama's and Qwen2's `attention_dropout`, OPT's
    `layerdrop`), which a layer reads at each forward."""
    import torch

    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
        for name, value in list(vars(module).items()):
            if type(value) is float and (name in ("dropout", "layerdrop") or name.endswith("_dropout")):
                setattr(module, name, 0.0)


def float32_head(model) -> None:
    """Keep `model`'s LM head in float32 (the ScaleRL recipe; TRL GRPO's `cast_lm_head_to_fp32`): its weight is cast
    and trained in float32, and its forward casts the decoder's output up, so the logits that rollouts sample from
    and the log-probs the loss reads are computed in float32 in a bf16 model. A head tied to the input embeddings
    is cast with them; their output is cast back to the model's dtype, so the layers run as before. The chunked
    head of `logprobs` casts its input the same way. A float32 model has nothing to change; a head carrying a LoRA
    adapter is refused."""
    import torch
    import torch.nn.functional as F

    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    head = base.get_output_embeddings()
    if head is None or not isinstance(head, torch.nn.Linear):
        raise ValueError(
            f"cast_lm_head_to_fp32: {type(base).__name__}'s LM head is not a plain linear layer (a LoRA adapter on "
            "it, or none); drop lm_head from lora.target_modules or set cast_lm_head_to_fp32: false"
        )
    dtype = head.weight.dtype
    if dtype == torch.float32:
        log.info("cast_lm_head_to_fp32: %s is float32 already; nothing to cast", type(base).__name__)
        return
    embeddings = base.get_input_embeddings()
    tied = embeddings is not None and embeddings.weight is head.weight
    head.float()

    def forward(hidden: torch.Tensor) -> torch.Tensor:
        return F.linear(hidden.float(), head.weight, head.bias)

    head.forward = forward  # type: ignore[method-assign,assignment]
    if tied:
        embeddings.register_forward_hook(lambda _m, _a, out: out.to(dtype))


def count_parameters(model) -> tuple[int, int]:
    """(trainable, total) parameter counts."""
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return trainable, sum(p.numel() for p in model.parameters())


def is_adapter_dir(path: str | Path) -> bool:
    return (Path(path) / "adapter_config.json").exists()


def load_sequence_scorer(
    path: str,
    dtype: str = "float32",
    trust_remote_code: bool = False,
    pad_token_id: int | None = None,
    seed: int | None = None,
    attention: str | None = None,
):
    """A one-output sequence classifier (reward model / value head) from `path`; when `path` holds a
    causal LM, its score head starts random, as in TRL's RewardTrainer. transformers draws that head from torch's
    global generator: with `seed` it is seeded first, so the same recipe starts from the same head on every run.
    `attention` as in `load_causal_lm`."""
    import torch
    from transformers import AutoModelForSequenceClassification

    if seed is not None:
        torch.manual_seed(seed)
    with attention_errors(attention):
        model = AutoModelForSequenceClassification.from_pretrained(
            path,
            num_labels=1,
            dtype=torch_dtype(dtype),
            trust_remote_code=trust_remote_code,
            attn_implementation=implementation(attention),
        )
    settle_auto(model, attention)
    if pad_token_id is not None:
        model.config.pad_token_id = pad_token_id
    return model
