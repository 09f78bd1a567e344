"""A trained reward model as a reward function: scores prompt + completion (+ EOS, as in training)."""

from __future__ import annotations

import torch

from alignpipe.modeling import load_sequence_scorer, load_tokenizer, under_attention_kernels


class RewardModelScorer:
    """`scorer(prompts, completions) -> [float]`, batched, on `device` (the GPU when there is one). `dtype`: by
    default the checkpoint's own (`auto`), the one the reward stage trained it in: a bf16 reward model scores in bf16
    on a GPU's tensor cores, where float32 would take ~8× the time of every rollout's scoring."""

    def __init__(self, path: str, batch_size: int = 32, dtype: str = "auto", device: str | None = None):
        self.tok = load_tokenizer(path)
        device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        self.model = load_sequence_scorer(path, dtype, pad_token_id=self.tok.pad_token_id).to(device).eval()
        self.batch_size = batch_size

    @torch.no_grad()
    @under_attention_kernels
    def __call__(self, prompts: list[str], completions: list[str], **_) -> list[float]:
        eos = self.tok.eos_token or ""
        texts = [p + c if (p + c).endswith(eos) else p + c + eos for p, c in zip(prompts, completions)]
        device = next(self.model.parameters()).device
        side = self.tok.padding_side
        self.tok.padding_side = "right"
        scores: list[float] = []
        try:
            for i in range(0, len(texts), self.batch_size):
                enc = self.tok(texts[i : i + self.batch_size], return_tensors="pt", padding=True).to(device)
                scores += self.model(**enc).logits.squeeze(-1).float().tolist()
        finally:
            self.tok.padding_side = side
        return scores
