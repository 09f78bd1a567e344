"""A trained reward model as a reward function: scores prompt + completion (+ EOS, as in training)."""

from __future__ import annotations

import torch
from accelerate.utils import send_to_device

from alignpipe.modeling import load_sequence_scorer, load_tokenizer, under_attention_kernels
from alignpipe.packed_rows import classifier_scores, common_prefixes, layout, pack_scored
from alignpipe.special_tokens import encode, text_with_eos
from alignpipe.trainers.common import pad_rows


class RewardModelScorer:
    """`scorer(prompts, completions) -> [float]`, batched, on `device` (the GPU when there is one). `dtype`: by
    default the checkpoint's own (`auto`), the one the reward stage trained it in: a bf16 reward model scores in bf16
    on a GPU's tensor cores, where float32 would take ~8× the time of every rollout's scoring.

    On a kernel that runs documents (`model.attention: auto` on a GPU picks `varlen`) a batch is scored padding-free,
    as the reward stage trains (`packed_rows`): one row of the texts' real tokens, and on `varlen` the token prefix
    that the completions of one prompt share (GRPO's group, the judge's candidates) run once for all of them."""

    def __init__(self, path: str, batch_size: int = 32, dtype: str = "auto", device: str | None = None):
        self.tok = load_tokenizer(path)
        device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        self.model = load_sequence_scorer(path, dtype, pad_token_id=self.tok.pad_token_id).to(device).eval()
        self.batch_size = batch_size

    @torch.no_grad()
    @under_attention_kernels
    def __call__(self, prompts: list[str], completions: list[str], **_) -> list[float]:
        texts = [text_with_eos(p + c, self.tok.eos_token) for p, c in zip(prompts, completions)]
        device = next(self.model.parameters()).device
        how = layout(self.model) if hasattr(self.model, "score") else None
        scores: list[float] = []
        for i in range(0, len(texts), self.batch_size):
            chunk = texts[i : i + self.batch_size]
            if how is not None:
                scores += self._packed(chunk, prompts[i : i + self.batch_size], how == "shared", device)
                continue
            ids, mask = pad_rows(encode(self.tok, chunk), self.tok.pad_token_id)  # right-padded
            out = self.model(input_ids=ids.to(device), attention_mask=mask.to(device))
            scores += out.logits.squeeze(-1).float().tolist()
        return scores

    def _packed(self, texts: list[str], prompts: list[str], share: bool, device) -> list[float]:
        """`texts` scored as one row of documents; with `share`, those of one prompt after their common prefix."""
        seqs = encode(self.tok, texts)
        group = {p: g for g, p in enumerate(dict.fromkeys(prompts))}
        index = [group[p] for p in prompts]
        prefixes, rests = common_prefixes(seqs, index) if share else ([[] for _ in seqs], seqs)
        packed = pack_scored(prefixes, rests, self.tok.pad_token_id, share, index if share else None)
        return classifier_scores(self.model, send_to_device(packed, device)).tolist()
