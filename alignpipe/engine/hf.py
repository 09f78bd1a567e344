"""The `hf` backend: batched `transformers` generation with left padding (CPU or GPU)."""

from __future__ import annotations

import torch

from alignpipe.engine.base import Generation
from alignpipe.engine.sampling import SamplingParams


class HFEngine:
    """Generates with `model.generate`, `batch_size` prompts at a time."""

    def __init__(self, model, tokenizer, batch_size: int = 32):
        self.model = model
        self.tok = tokenizer
        self.batch_size = batch_size

    @torch.no_grad()
    def generate(self, prompts: list[str] | list[list[int]], n: int = 1, sampling: SamplingParams | None = None,
                 seed: int | None = None) -> list[Generation]:
        from transformers import GenerationConfig

        sampling = sampling or SamplingParams()
        if seed is not None:
            torch.manual_seed(seed)
        eos = self.tok.eos_token_id
        cfg = GenerationConfig(
            max_new_tokens=sampling.max_new_tokens, do_sample=not sampling.greedy, num_return_sequences=n,
            temperature=sampling.temperature if not sampling.greedy else None,
            top_p=sampling.top_p if not sampling.greedy else None,
            top_k=sampling.top_k if (sampling.top_k and not sampling.greedy) else None,
            min_p=sampling.min_p if (sampling.min_p and not sampling.greedy) else None,
            pad_token_id=self.tok.pad_token_id, eos_token_id=eos,
        )
        was_training = self.model.training
        self.model.eval()
        side = self.tok.padding_side
        self.tok.padding_side = "left"
        device = next(self.model.parameters()).device
        out: list[Generation] = []
        try:
            for start in range(0, len(prompts), self.batch_size):
                chunk = prompts[start:start + self.batch_size]
                enc = self._encode(chunk).to(device)
                seqs = self.model.generate(**enc, generation_config=cfg)
                new = seqs[:, enc["input_ids"].shape[1]:].tolist()
                for k, ids in enumerate(new):
                    out.append(self._finish(start + k // n, ids, eos))
        finally:
            self.tok.padding_side = side
            self.model.train(was_training)
        return out

    def _encode(self, chunk: list):
        """Texts are tokenized; token-id lists are left-padded as they are."""
        from transformers import BatchEncoding

        if chunk and isinstance(chunk[0], str):
            return self.tok(chunk, return_tensors="pt", padding=True)
        n = max(len(ids) for ids in chunk)
        input_ids = torch.full((len(chunk), n), self.tok.pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(chunk), n), dtype=torch.long)
        for i, ids in enumerate(chunk):
            input_ids[i, n - len(ids):] = torch.tensor(ids)
            mask[i, n - len(ids):] = 1
        return BatchEncoding({"input_ids": input_ids, "attention_mask": mask})

    def update_weights(self, model) -> None:
        """Rollouts use the policy object itself: nothing to copy."""
        self.model = model

    def _finish(self, prompt_index: int, ids: list[int], eos: int) -> Generation:
        if eos in ids:
            ids = ids[: ids.index(eos) + 1]
            reason = "stop"
        else:
            ids = [i for i in ids if i != self.tok.pad_token_id] if self.tok.pad_token_id != eos else ids
            reason = "length"
        text = self.tok.decode(ids, skip_special_tokens=True)
        return Generation(prompt_index, text, ids, reason)
