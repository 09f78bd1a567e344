"""`alignpipe make-tiny DIR`: a tokenizer trained locally, a tiny random-init Llama, synthetic data.

Layout written:
    DIR/model/            config + safetensors + tokenizer (byte-level BPE, chat template)
    DIR/data/sentiment_sft.jsonl          prompt, completion, label
    DIR/data/sentiment_preferences.jsonl  prompt, chosen, rejected
    DIR/data/sentiment_prompts.jsonl      prompt
    DIR/data/addition.jsonl               prompt, completion, answer
    DIR/data/reverse.jsonl                prompt, completion (45% correct), answer
    DIR/data/lookup_sft.jsonl             messages (40% call the `lookup` tool)
    DIR/data/lookup_prompts.jsonl         prompt, answer
    DIR/ASSETS.json       written last; its presence means the folder is complete
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from alignpipe import __version__
from alignpipe.data import synthetic

SPECIAL_TOKENS = ["<|pad|>", "<|end|>", "<|system|>", "<|user|>", "<|assistant|>"]
# Tool calls as Hermes/Qwen write them (`<tool_call>{json}</tool_call>`), tool results as a `tool` turn. Tools are
# listed by name only: their JSON schemas would make every prompt ~10x longer for a model that cannot read them.
CHAT_TEMPLATE = (
    "{% if tools %}<|system|>tools: {% for t in tools %}{{ t['function']['name'] }}{% if not loop.last %}, "
    "{% endif %}{% endfor %}<|end|>{% endif %}"
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}"
    "{% for c in m.get('tool_calls') or [] %}<tool_call>"
    "{{ {'name': c['function']['name'], 'arguments': c['function']['arguments']} | tojson }}</tool_call>"
    "{% endfor %}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
ASSETS_REVISION = 2
"""Bumped when what `make_tiny` writes changes, so an older folder is made again."""
TINY_MODEL = dict(
    hidden_size=192,
    intermediate_size=512,
    num_hidden_layers=4,
    num_attention_heads=6,
    num_key_value_heads=2,
    max_position_embeddings=512,
    tie_word_embeddings=True,
)
TOKENIZER_VOCAB = 512
"""The tiny tokenizer's vocabulary, special tokens included (the tiny model's `vocab_size`)."""


def train_tokenizer(texts: list[str], vocab_size: int = TOKENIZER_VOCAB):
    """Byte-level BPE trained on `texts`, wrapped as a transformers fast tokenizer."""
    from tokenizers import ByteLevelBPETokenizer
    from transformers import PreTrainedTokenizerFast

    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(
        texts, vocab_size=vocab_size, min_frequency=2, special_tokens=SPECIAL_TOKENS, show_progress=False
    )
    tok = PreTrainedTokenizerFast(
        tokenizer_object=bpe._tokenizer,
        eos_token="<|end|>",
        pad_token="<|pad|>",
        additional_special_tokens=SPECIAL_TOKENS[2:],
        model_max_length=512,
    )
    tok.chat_template = CHAT_TEMPLATE
    return tok


def tiny_llama(tokenizer, seed: int = 0, **overrides):
    """A random-init Llama-shaped causal LM (~1.7M parameters with the default sizes)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=len(tokenizer),
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=None,
        **{**TINY_MODEL, **overrides},
    )
    torch.manual_seed(seed)
    return LlamaForCausalLM(cfg)


def _write_jsonl(path: Path, rows: list[dict]) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def make_tiny(out: str | Path, seed: int = 0, force: bool = False) -> Path:
    """Write the tiny assets to `out` (skipped when a complete folder with the same version exists)."""
    out = Path(out)
    marker = out / "ASSETS.json"
    meta = {"version": __version__, "seed": seed, "revision": ASSETS_REVISION}
    if marker.exists() and not force and json.loads(marker.read_text()) == meta:
        return out
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    (tmp / "data").mkdir(parents=True)
    tok = train_tokenizer(synthetic.corpus(seed))
    model = tiny_llama(tok, seed)
    model.save_pretrained(tmp / "model")
    tok.save_pretrained(tmp / "model")
    _write_jsonl(tmp / "data" / "sentiment_sft.jsonl", synthetic.sentiment_sft(2000, seed))
    _write_jsonl(tmp / "data" / "sentiment_preferences.jsonl", synthetic.sentiment_preferences(2000, seed + 1))
    _write_jsonl(tmp / "data" / "sentiment_prompts.jsonl", synthetic.sentiment_prompts(500, seed + 2))
    _write_jsonl(tmp / "data" / "addition.jsonl", synthetic.addition(3000, seed + 3))
    _write_jsonl(tmp / "data" / "reverse.jsonl", synthetic.reversal(3000, seed + 4))
    _write_jsonl(tmp / "data" / "lookup_sft.jsonl", synthetic.lookup_conversations(3000, seed + 5))
    _write_jsonl(tmp / "data" / "lookup_prompts.jsonl", synthetic.lookup_prompts(1000, seed + 6))
    (tmp / "ASSETS.json").write_text(json.dumps(meta))
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return out
