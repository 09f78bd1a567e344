"""Padding-free preference batches: a DPO, KTO or reward batch as one row of documents, each prompt run once.

Padded, a batch of pairs is (2B, T) with T its longest sequence. Every shorter row runs padding through the whole
model, and the padding mask keeps SDPA off its flash kernel. Run together instead, the batch is one row of its real
tokens: position ids restart at each document, and the document offsets, counted here on the host, go to every
attention call. A kernel that separates documents by their offsets then runs each one with no mask and no padding:
`model.attention: varlen` (PyTorch's variable-length flash kernel, `alignpipe/attention.py`) or flash-attn's
`flash_attention_2`/`_3` (`runs_documents`). The collators build this layout only for such a model (`layout`).

On `varlen` the layout is `shared`: a pair's prompt runs once, as the padded layout's KV-cache sharing runs it.
The prompt and the first answer are one document. The second answer is a document of its own, whose queries attend
to a key document made of the prompt's keys and its own (`cu_seq_lens_k` and `key_rows`, which
`varlen_attention_forward` gathers per layer; flash attention aligns causality at the bottom right, so answer token
t sees the whole prompt and answer tokens 0..t). flash-attn's kernels are called by transformers, which knows no
key layout, so there every prompt + answer is its own document (`documents`), with the prompt run twice. KTO cuts
its batch's halves apart (`answers_part`), so it takes `documents` too.

The trainers read from the layout exactly what they read from the padded rows: the hidden state that scores each
answer token (`scoring`), and the reward model's last-token position (`last`)."""

from __future__ import annotations

import itertools
from typing import Any

import torch

from alignpipe import last_layer
from alignpipe.attention import document_kwargs, documents_mask, implementation_of
from alignpipe.device_copies import int64_tensor

# transformers' `attn_implementation`s that run packed documents from their offsets, with no mask
DOCUMENT_KERNELS = frozenset({"varlen", "flash_attention_2", "flash_attention_3"})


def runs_documents(model) -> bool:
    """Whether `model` attends through a kernel in `DOCUMENT_KERNELS`."""
    return implementation_of(model) in DOCUMENT_KERNELS


def layout(model) -> str | None:
    """How `model`'s preference batches are best laid out: `shared` on our `varlen` kernel (a prompt runs once for
    all its answers, `pack_groups`), `documents` on flash-attn's (every prompt + answer its own document: its varlen
    call takes no key layout of ours), None (padded) on the others."""
    name = implementation_of(model)
    return "shared" if name == "varlen" else "documents" if name in DOCUMENT_KERNELS else None


def runs(packed: dict[str, Any] | None, model) -> bool:
    """Whether `model` can run the batch layout `packed` (a caller's other model may run another kernel): any
    padding-free layout on a kernel that `runs_documents`, shared prompts on our `varlen` alone."""
    if packed is None:
        return False
    need = "shared" if "key_rows" in packed["documents"] else "documents"
    return layout(model) in (need, "shared")


def pack(seqs: list[list[int]]) -> dict[str, Any]:
    """`seqs` run together into one row, each its own document (`pack_groups` with one answer per group)."""
    packed = pack_groups([([], [s]) for s in seqs], share=False)
    del packed["keys"]
    return packed


def pack_groups(groups: list[tuple[list[int], list[list[int]]]], share: bool) -> dict[str, Any]:
    """Groups of (prefix, answers) run together into one row:
    - `input_ids` and `position_ids` (1, N); each answer's positions continue its prefix's;
    - `documents`, in transformers' keywords (`attention.document_kwargs`): with `share`, a group's prefix runs once
      and is document one with its first answer, every further answer a document of its own whose keys are the
      prefix's and its own (`cu_seq_lens_k`, `max_length_k`, and `key_rows`, the tokens whose keys make up the key
      documents, for `attention.varlen_attention_forward`); else every prefix + answer its own document;
    - `offsets`, the query documents' offsets as host ints;
    - `where`, per group, per answer, (the first position of its prefix's copy, its answer's first position), and
      `keys`, the key documents' offsets and their tokens (host ints, whatever the layout), for the callers below to
      read (and drop: they stay on the host).
    Unshared, the documents go row after row (every group's first answer, then every second); shared, group after
    group. A group is laid out unshared where its prefix is empty or an answer is. Every document must hold a
    token."""
    ids: list[int] = []
    positions: list[int] = []
    cu_q, cu_k, key_rows = [0], [0], list[int]()
    where: list[dict[int, tuple[int, int]]] = [{} for _ in groups]

    def document(prefix: list[int], answer: list[int], p0: int | None = None) -> tuple[int, int]:
        """Append `answer` (after a copy of `prefix`, or after the one at `p0`) as a document; (p0, a0)."""
        if p0 is None:
            p0 = len(ids)
            ids.extend(prefix)
            positions.extend(range(len(prefix)))
        a0 = len(ids)
        ids.extend(answer)
        positions.extend(range(len(prefix), len(prefix) + len(answer)))
        cu_q.append(len(ids))
        if a0 == p0 + len(prefix):  # the document's keys are its own tokens
            key_rows.extend(range(p0, len(ids)))
        else:  # a shared prefix's keys, then the answer's
            key_rows.extend([*range(p0, p0 + len(prefix)), *range(a0, len(ids))])
        cu_k.append(len(key_rows))
        return p0, a0

    if share:  # group after group, a shareable group's prefix once
        for g, (prefix, answers) in enumerate(groups):
            together = bool(prefix) and len(answers) > 1 and all(answers)
            for j, answer in enumerate(answers):
                where[g][j] = document(prefix, answer, where[g][0][0] if together and j else None)
    else:  # row after row (every first answer, then every second), so that a run of rows is a run of documents
        for j in range(max((len(a) for _, a in groups), default=0)):
            for g, (prefix, answers) in enumerate(groups):
                if j < len(answers):
                    where[g][j] = document(prefix, answers[j])
    if len(cu_q) < 2 or any(b <= a for a, b in itertools.pairwise(cu_q)):
        raise ValueError("pack: every sequence must hold at least one token")
    documents = document_kwargs(cu_q)
    if cu_k != cu_q:
        documents |= document_kwargs(cu_k, "k")
        documents["key_rows"] = int64_tensor(key_rows)
    return {
        "input_ids": int64_tensor(ids)[None],
        "position_ids": int64_tensor(positions)[None],
        "documents": documents,
        "offsets": cu_q,
        "where": where,
        "keys": (cu_k, key_rows),
    }


def _groups(prefixes: list[list[int]], rows: list[list[int]], index: list[int] | None):
    """The (prefix, answers) groups of `rows`, row r following prefix `index[r]` (default `r % len(prefixes)`, the
    collated layout: every first answer, then every second), and each row's (group, place in its group)."""
    index = index if index is not None else [r % len(prefixes) for r in range(len(rows))]
    answers: list[list[list[int]]] = [[] for _ in prefixes]
    slots = []
    for r, g in enumerate(index):
        slots.append((g, len(answers[g])))
        answers[g].append(rows[r])
    return [(p, a) for p, a in zip(prefixes, answers, strict=True)], slots


def pack_answers(
    prompts: list[list[int]],
    answers: list[list[int]],
    width: int,
    share: bool = False,
    index: list[int] | None = None,
) -> dict[str, Any]:
    """Answer row r after its prompt, `prompts[index[r]]` (default `r % len(prompts)`), in `pack_groups`' layout
    (`share`: each prompt once), plus `scoring` (R, `width`): the position whose hidden state scores answer token t of
    row r, as `completion_ids` lays the answers out (token 0 is scored by the prompt's last token, token t by answer
    token t − 1). Positions past an answer's end, and the first token of an answer with no prompt (which nothing
    scores), point at the document's first token; the answer mask leaves them out."""
    groups, slots = _groups(prompts, answers, index)
    packed = pack_groups(groups, share)
    where = packed.pop("where")
    del packed["keys"]
    scoring = torch.empty((len(answers), width), dtype=torch.long)
    for r, answer in enumerate(answers):
        g, j = slots[r]
        p0, a0 = where[g][j]
        scoring[r] = p0  # a position of the document (an empty answer has none of its own)
        scoring[r, : len(answer)] = torch.arange(a0 - 1, a0 - 1 + len(answer))
        if answer:
            scoring[r, 0] = a0 if a0 == p0 else p0 + len(prompts[g]) - 1  # no prompt: nothing scores token 0
    packed["scoring"] = scoring
    return packed


def pack_scored(
    prefixes: list[list[int]],
    suffixes: list[list[int]],
    pad_id: int | None,
    share: bool = False,
    index: list[int] | None = None,
) -> dict[str, Any]:
    """Sequence r, `prefixes[index[r]] + suffixes[r]` (default index: r % len(prefixes)), in `pack_groups`' layout,
    plus `last` (R,): where a sequence classifier reads its score, its last token that is not `pad_id`, as
    transformers' classifiers read a padded row (a sequence of padding only: its first), and `read`, the last
    layer's documents for running it at those tokens alone (`last_layer.read_layout`)."""
    groups, slots = _groups(prefixes, suffixes, index)
    packed = pack_groups(groups, share)
    where = packed.pop("where")
    last = []
    for r, suffix in enumerate(suffixes):
        g, j = slots[r]
        prefix = prefixes[g]
        p0, a0 = where[g][j]
        real = [k for k, t in enumerate(prefix + suffix) if t != pad_id]
        k = real[-1] if real else 0
        last.append(p0 + k if k < len(prefix) else a0 + k - len(prefix))
    packed["last"] = torch.tensor(last)
    packed["read"] = last_layer.read_layout(last, packed["offsets"], *packed.pop("keys"))
    return packed


def answers_part(packed: dict[str, Any], part: slice) -> dict[str, Any]:
    """The documents of the answer rows in `part` (a contiguous slice) alone, from `pack_answers`' unshared layout,
    on whichever device it lies: the offsets tensor is cut and shifted where it lies (no copy to or from the host)."""
    if "key_rows" in packed["documents"]:
        raise ValueError("answers_part: rows of a layout whose prompts are shared cannot be cut apart")
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


def body_hidden(body, packed: dict[str, Any]) -> torch.Tensor:
    """The last hidden states (1, N, d) of `body` (a decoder without its head, e.g. `model.model`) over a layout's one
    row of documents: offsets counted on the host, and no mask for transformers to derive (`documents_mask`)."""
    ids = packed["input_ids"]
    return body(
        input_ids=ids,
        attention_mask=documents_mask(body, None, ids.device),
        position_ids=packed["position_ids"],
        use_cache=False,
        **packed["documents"],
    ).last_hidden_state


def classifier_scores(classifier, packed: dict[str, Any]) -> torch.Tensor:
    """A sequence classifier's (transformers' `*ForSequenceClassification`, unwrapped) float scores of a
    `pack_scored` layout: its body over the one row of documents, its `score` head at each sequence's `last`. Where
    the body allows (`last_layer.supported`), its last layer runs at those tokens alone."""
    body = getattr(classifier, classifier.base_model_prefix)
    if "read" in packed and last_layer.supported(body):
        with last_layer.reading_at(body, packed["read"]):
            hidden = body_hidden(body, packed)
        return classifier.score(hidden[0]).squeeze(-1).float()
    hidden = body_hidden(body, packed)
    return classifier.score(hidden[0].index_select(0, packed["last"])).squeeze(-1).float()


def common_prefixes(seqs: list[list[int]], groups: list[int]) -> tuple[list[list[int]], list[list[int]]]:
    """Per group of `seqs` (`groups[r]`: sequence r's group, numbered from 0), the longest token prefix all its
    sequences share, each keeping at least its last token out of it; and each sequence's rest. A group of one
    shares nothing (its prefix is empty)."""
    members: dict[int, list[list[int]]] = {}
    for seq, g in zip(seqs, groups, strict=True):
        members.setdefault(g, []).append(seq)
    prefixes = []
    for g in range(len(members)):
        rows = members[g]
        k = 0
        if len(rows) > 1:
            limit = min(len(r) for r in rows) - 1
            while k < limit and all(r[k] == rows[0][k] for r in rows):
                k += 1
        prefixes.append(rows[0][:k])
    return prefixes, [seq[len(prefixes[g]) :] for seq, g in zip(seqs, groups, strict=True)]
