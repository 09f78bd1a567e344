"""Tiny random Mixture-of-Experts models with the tiny tokenizer, for the load-balancing loss's tests."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch


def moe_model(kind: str, vocab: int, **ids):
    """A two-layer random `kind` (qwen3_moe, mixtral, olmoe) model: 4 experts, 2 per token."""
    from transformers import (
        MixtralConfig,
        MixtralForCausalLM,
        OlmoeConfig,
        OlmoeForCausalLM,
        Qwen3MoeConfig,
        Qwen3MoeForCausalLM,
    )

    shape: dict[str, Any] = dict(
        vocab_size=vocab, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_experts_per_tok=2
    )
    if kind == "qwen3_moe":
        qwen3: dict[str, Any] = dict(
            intermediate_size=64, moe_intermediate_size=16, num_experts=4, num_key_value_heads=2, head_dim=8
        )
        return Qwen3MoeForCausalLM(Qwen3MoeConfig(**shape, **qwen3, **ids))
    if kind == "mixtral":
        mixtral = MixtralConfig(**shape, intermediate_size=32, num_local_experts=4, num_key_value_heads=2, **ids)
        return MixtralForCausalLM(mixtral)
    return OlmoeForCausalLM(OlmoeConfig(**shape, intermediate_size=16, num_experts=4, num_key_value_heads=4, **ids))


def save_moe(tiny: Path, root: Path, kind: str = "qwen3_moe") -> Path:
    """`root`/model: a random `kind` model saved beside the tiny tokenizer."""
    from alignpipe.modeling import load_tokenizer

    tok = load_tokenizer(str(tiny / "model"))
    torch.manual_seed(0)
    ids = dict(eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id)
    model_dir = root / "model"
    moe_model(kind, len(tok), **ids).save_pretrained(model_dir)
    tok.save_pretrained(model_dir)
    return model_dir
