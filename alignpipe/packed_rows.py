"""Padding-free preference batches: every sequence of a DPO, KTO or reward batch one document of a single row.

Padded, a batch of pairs is (2B, T) with T its longest sequence. Every shorter row runs padding through the whole
model, and the padding mask keeps SDPA off its flash kernel. Run together instead, the batch is (1, Σ lengths):
position ids restart at each sequence, and the document offsets, counted here on the host, go to every attention
call. A kernel that separates documents by their offsets then runs each sequence alone, with no mask and no padding:
`model.attention: varlen` (PyTorch's variable-length flash kernel, `alignpipe/attention.py`) or flash-attn's
`flash_attention_2`/`_3` (`runs_documents`). The collators build this layout only for such a model. The
trainers read from it exactly what they read from the padded rows: the hidden state that scores each answer
token (`scoring`), and the reward model's last-token position (`last`).

What it gives up: the padded layout runs each prompt once for both of its answers (`logprobs.shared_prefix_hidden`),
and here each answer's document holds its own copy of the prompt. The prompt runs twice, but without the masked
attention and the KV-cache gather that sharing needs. That loses where prompts are long and answers short.
Real preference data varies in answer length, so padding usually costs more than the duplicated prompt."""

from __future__ import annotations

import itertools
from typing import Any

import torch

from alignpipe.attention import document_kwargs

# transformers' `attn_implementation`s that run packed documents from their offsets, with no mask
DOCUMENT_KERNELS = frozenset({"varlen", "flash_attention_2", "flash_attention_3"})


def runs_documents(model) -> bool:
    """Whether `model` (plain, peft, DDP- or FSDP-wrapped) attends through a kernel in `DOCUMENT_KERNELS`."""
    inner = model.module if isinstance(model, torch.nn.parallel.DistributedDataParallel) else model
    return getattr(getattr(inner, "config", None), "_attn_implementation", None) in DOCUMENT_KERNELS


def pack(seqs: list[list[int]]) -> dict[str, Any]:
    """`seqs` run together into one row:
    - `input_ids` and `position_ids` (1, N), with the positions restarting at every sequence;
    - `documents`, the offsets in transformers' keywords (`attention.document_kwargs`);
    - `offsets`, the same offsets as host ints, one more than there are sequences.
    Every sequence must hold a token."""
    if not seqs or not all(seqs):
        raise ValueError("pack: every sequence must hold at least one token")
    offsets = list(itertools.accumulate(map(len, seqs), initial=0))
    return {
        "input_ids": torch.tensor([list(itertools.chain.from_iterable(seqs))]),
        "position_ids": torch.tensor([[p for s in seqs for p in range(len(s))]]),
        "documents": document_kwargs(offsets),
        "offsets": offsets,
    }


def pack_answers(prompts: list[list[int]], answers: list[list[int]], width: int) -> dict[str, Any]:
    """Answer row r after its prompt, `prompts[r % len(prompts)]`, as document r of `pack`'s layout, plus
    `scoring` (R, `width`): the position whose hidden state scores answer token t of row r, as `completion_ids`
    lays the answers out. Positions past an answer's end, and the first token of an answer with no prompt (which
    nothing scores), point at the row's own first token; the answer mask leaves them out."""
    seqs = [prompts[r % len(prompts)] + a for r, a in enumerate(answers)]
    packed = pack(seqs)
    scoring = torch.empty((len(answers), width), dtype=torch.long)
    for r, (start, answer) in enumerate(zip(packed["offsets"], answers)):
        first = start + len(seqs[r]) - len(answer) - 1  # the prompt's last token scores answer token 0
        scoring[r] = start
        scoring[r, : len(answer)] = torch.arange(first, first + len(answer)).clamp(min=start)
    packed["scoring"] = scoring
    return packed


def pack_scored(seqs: list[list[int]], pad_id: int | None) -> dict[str, Any]:
    """`pack(seqs)` plus `last` (len(seqs),): where a sequence classifier reads each sequence's score, its last token
    that is not `pad_id`, as transformers' classifiers read a padded row (a sequence of padding only: its first)."""
    packed = pack(seqs)
    last = []
    for start, seq in zip(packed["offsets"], seqs):
        real = [k for k, t in enumerate(seq) if t != pad_id]
        last.append(start + (real[-1] if real else 0))
    packed["last"] = torch.tensor(last)
    return packed


def answers_part(packed: dict[str, Any], part: slice) -> dict[str, Any]:
    """The documents of the answer rows in `part` (a contiguous slice) alone, from `pack_answers`' layout, on
    whichever device it lies: the offsets tensor is cut and shifted where it lies (no copy to or from the host)."""
    a, b, step = part.indices(len(packed["offsets"]) - 1)
    if step != 1:
        raise ValueError("answers_part: a contiguous slice of rows")
    offsets = packed["offsets"][a : b + 1]
    lo, hi = offsets[0], offsets[-1]
    cu = packed["documents"]["cu_seq_lens_q"][a : b + 1] - lo
    longest = max(y - x for x, y in itertools.pairwise(offsets))
    return {
        "input_ids": packed["input_ids"][:, lo:hi],
        "position_ids": packed["position_ids"][:, lo:hi],
        "documents": {"cu_seq_lens_q": cu, "cu_seq_lens_k": cu, "max_length_q": longest, "max_length_k": longest},
        "offsets": [o - lo for o in offsets],
        "scoring": packed["scoring"][part] - lo,
    }
