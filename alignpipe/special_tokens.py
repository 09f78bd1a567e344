"""Special tokens at a text's ends: one BOS where a chat template already wrote its own, the EOS a trainer appends
to what it learns, and the tokens that end a generated completion."""

from __future__ import annotations


def encode(tokenizer, texts: list[str]) -> list[list[int]]:
    """Token ids of `texts` with the tokenizer's special tokens (Llama's and Gemma's BOS), but one BOS only where a
    text starts with its own: a chat template writes `<|begin_of_text|>` / `<bos>` into the rendered prompt, and the
    tokenizer would add a second (TRL tokenizes such prompts without special tokens for the same reason)."""
    return [row[_doubled_bos(row, tokenizer.bos_token_id) :] for row in tokenizer(texts)["input_ids"]]


def _doubled_bos(ids: list[int], bos: int | None) -> int:
    """1 when `ids` start with two BOS (the template's and the tokenizer's): the tokens to drop; else 0."""
    return int(bos is not None and len(ids) > 1 and ids[0] == bos and ids[1] == bos)


def encode_with_offsets(tokenizer, texts: list[str]) -> tuple[list[list[int]], list[list[tuple[int, int]]]]:
    """`encode`, with each token's [start, end) characters in its text (special tokens: (0, 0)); fast tokenizers only."""
    if not getattr(tokenizer, "is_fast", False):
        raise ValueError(f"{type(tokenizer).__name__} is a slow tokenizer: character offsets need a fast one")
    enc = tokenizer(texts, return_offsets_mapping=True)
    ids, offsets = [], []
    for row, spans in zip(enc["input_ids"], enc["offset_mapping"]):
        cut = _doubled_bos(row, tokenizer.bos_token_id)
        ids.append(row[cut:])
        offsets.append([tuple(s) for s in spans[cut:]])
    return ids, offsets


def with_eos(ids: list[int], eos: int | None, tokenizer) -> list[int]:
    """`ids` ending in EOS: unchanged when they end with it already, or with it and then only whitespace (a chat
    template's newline after its end-of-turn token, as Qwen's `<|im_end|>` + newline with the instruct tokenizer), so
    a rendered conversation is not taught a second end of turn; else EOS appended (nothing without an EOS token)."""
    if eos is None:
        return ids
    tail = ids[-4:]
    if eos in tail:
        after = tail[len(tail) - tail[::-1].index(eos) :]
        if not after or not tokenizer.decode(after).strip():
            return ids
    return ids + [eos]


def text_with_eos(text: str, eos: str | None) -> str:
    """`with_eos` on text: a reward model scores what it was trained on."""
    if not eos or text.rstrip().endswith(eos):
        return text
    return text + eos


def stop_token_ids(tokenizer, model=None) -> list[int]:
    """The tokens that end a completion: the tokenizer's EOS and every `eos_token_id` of the model's generation config.
    Instruct models such as Gemma's end a turn with a token other than the tokenizer's EOS (`<end_of_turn>` beside
    `<eos>`); `model.generate` and vLLM stop at either, and so do our engines."""
    ids = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    config = getattr(model, "generation_config", None)
    more = getattr(config, "eos_token_id", None)
    for i in [more] if isinstance(more, int) else list(more or []):
        if i not in ids:
            ids.append(i)
    return ids
