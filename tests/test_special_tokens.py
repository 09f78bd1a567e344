"""BOS once and EOS at the end: chat templates that write their own BOS (Llama 3's `<|begin_of_text|>`, Gemma's
`<bos>`) or end a turn with EOS and a newline (Qwen), and generation configs with several end-of-turn tokens."""

from __future__ import annotations

import pytest

from alignpipe.special_tokens import encode, text_with_eos


@pytest.fixture(scope="module")
def bos_tok(tiny):
    """The tiny tokenizer made Llama-like: it adds `<|bos|>` in front of every text, and its chat template writes one."""
    from tokenizers.processors import TemplateProcessing

    from alignpipe.modeling import load_tokenizer

    tok = load_tokenizer(str(tiny / "model"))
    tok.add_special_tokens({"bos_token": "<|bos|>"})
    bos = tok.bos_token_id
    tok._tokenizer.post_processor = TemplateProcessing(
        single="<|bos|> $A", pair="<|bos|> $A $B", special_tokens=[("<|bos|>", bos)]
    )
    tok.chat_template = "<|bos|>" + tok.chat_template
    return tok


def test_a_chat_rendered_text_keeps_its_own_bos_only(bos_tok):
    bos = bos_tok.bos_token_id
    rendered = bos_tok.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    assert rendered.startswith("<|bos|>") and bos_tok(rendered)["input_ids"][:2] == [bos, bos], (
        "the tokenizer doubles it"
    )
    once = encode(bos_tok, [rendered, "hi"])
    assert (
        once[0][0] == bos
        and once[0][1] != bos
        and once[1] == [bos] + bos_tok("hi", add_special_tokens=False)["input_ids"]
    )


def test_every_prompt_tokenizer_puts_one_bos_before_a_chat_prompt(bos_tok):
    """SFT, DPO, KTO, reward training, the RL trainers' prompts, the engine and the format stage's length count all
    tokenize through `encode` (so does the reward-model scorer)."""
    from alignpipe.data.formats import format_rows
    from alignpipe.engine.hf import HFEngine
    from alignpipe.trainers import dpo, kto, reward, sft
    from alignpipe.trainers.online import prompt_ids

    bos = bos_tok.bos_token_id
    prompt = bos_tok.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    pair = {"prompt": prompt, "chosen": "yes<|end|>", "rejected": "no<|end|>"}

    def starts_once(ids: list[int]) -> bool:
        return ids[0] == bos and ids[1] != bos

    assert starts_once(sft.tokenize([{"prompt": prompt, "completion": "yes"}], bos_tok, 64, True)[0]["input_ids"])
    assert starts_once(sft.tokenize([{"text": prompt + "yes"}], bos_tok, 64, True)[0]["input_ids"])
    assert starts_once(dpo.tokenize([pair], bos_tok, 64)[0]["prompt_ids"])
    assert starts_once(kto.tokenize([{"prompt": prompt, "completion": "yes", "label": True}], bos_tok)[0]["prompt_ids"])
    scored = reward.tokenize([pair], bos_tok, 64)[0]
    assert starts_once(scored["chosen_ids"]) and starts_once(scored["rejected_ids"])
    assert starts_once(prompt_ids(bos_tok, [{"prompt": prompt}], 16)[0])
    enc = HFEngine(None, bos_tok)._encode([prompt, "hi"])
    first = [row[mask.bool()].tolist() for row, mask in zip(enc["input_ids"], enc["attention_mask"])]
    assert all(starts_once(ids) for ids in first)
    kept, _, stats = format_rows(
        [{"prompt": prompt}], fmt="prompt_only", tokenizer=bos_tok, max_length=len(first[0]), eval_fraction=0
    )
    assert len(kept) == 1 and stats.dropped_too_long == 0, "counted with one BOS"


def test_a_rendered_end_of_turn_is_not_taught_twice(tiny):
    """A chat template may end a turn with EOS and a newline (Qwen's `<|im_end|>` + newline): every trainer keeps that
    ending as the template wrote it instead of appending a second EOS; a completion without EOS gets one. Here the
    tiny tokenizer's EOS `<|end|>` stands for `<|im_end|>`."""
    from alignpipe.modeling import load_tokenizer
    from alignpipe.special_tokens import with_eos
    from alignpipe.trainers import dpo, kto, reward, sft

    tok = load_tokenizer(str(tiny / "model"))
    eos = tok.eos_token_id
    ids = tok("yes", add_special_tokens=False)["input_ids"]
    newline = tok("\n", add_special_tokens=False)["input_ids"]
    assert with_eos(ids + [eos] + newline, eos, tok) == ids + [eos] + newline
    assert with_eos(ids + [eos], eos, tok) == ids + [eos]
    assert with_eos(ids, eos, tok) == ids + [eos]
    assert with_eos(ids + [eos] + ids, eos, tok) == ids + [eos] + ids + [eos], "EOS inside the text is not an ending"
    assert with_eos(ids, None, tok) == ids

    turn = {"prompt": "<|user|>hi<|end|><|assistant|>", "completion": "yes<|end|>\n"}
    (row,) = sft.tokenize([turn], tok, 64, completion_only=True)
    assert row["input_ids"][-2:] == [eos] + newline
    (pair,) = dpo.tokenize([{"prompt": turn["prompt"], "chosen": "yes<|end|>\n", "rejected": "no"}], tok, 64)
    assert pair["chosen_ids"][-2:] == [eos] + newline and pair["rejected_ids"][-1] == eos
    (scored,) = reward.tokenize([{"prompt": turn["prompt"], "chosen": "yes<|end|>\n", "rejected": "no"}], tok, 64)
    assert scored["chosen_ids"].count(eos) == 2 and scored["rejected_ids"][-1] == eos  # the prompt's and the reply's
    (unpaired,) = kto.tokenize([{**turn, "label": True}], tok)
    assert unpaired["completion_ids"][-2:] == [eos] + newline


def test_text_with_eos_is_with_eos_on_text():
    assert text_with_eos("a<|end|>\n", "<|end|>") == "a<|end|>\n"
    assert text_with_eos("a", "<|end|>") == "a<|end|>"
    assert text_with_eos("a", None) == "a"


def test_a_recipe_can_name_the_eos_token_and_saved_models_stop_there(tiny, tmp_path):
    """`model.eos_token`: a base model learning a chat template whose turns end elsewhere than its tokenizer's EOS.
    The override is what SFT appends and what the saved model's generation config stops at; a string that is not one
    token of the vocabulary is refused, naming it."""
    from accelerate import Accelerator

    from alignpipe.modeling import load_causal_lm, load_tokenizer
    from alignpipe.special_tokens import stop_token_ids
    from alignpipe.trainers import sft
    from alignpipe.trainers.common import save_model

    tok = load_tokenizer(str(tiny / "model"), eos_token="<|user|>")
    turn_end = tok.convert_tokens_to_ids("<|user|>")
    assert tok.eos_token_id == turn_end != load_tokenizer(str(tiny / "model")).eos_token_id
    (row,) = sft.tokenize([{"prompt": "a", "completion": " b"}], tok, 16, True)
    assert row["input_ids"][-1] == turn_end
    model = load_causal_lm(str(tiny / "model"))
    save_model(Accelerator(cpu=True), model, tok, tmp_path / "saved")
    saved = load_causal_lm(str(tmp_path / "saved"))
    assert turn_end in stop_token_ids(load_tokenizer(str(tmp_path / "saved")), saved)
    assert saved.generation_config.eos_token_id[0] == turn_end
    with pytest.raises(ValueError, match=r"model.eos_token 'two tokens' is not one token of the tokenizer"):
        load_tokenizer(str(tiny / "model"), eos_token="two tokens")
