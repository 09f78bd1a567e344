"""Canonical training formats, produced by `format` stages and read by trainers.

| format            | columns                      |
|-------------------|------------------------------|
| language_modeling | text                         |
| prompt_completion | prompt, completion           |
| prompt_only       | prompt                       |
| preference        | prompt, chosen, rejected     |
| unpaired          | prompt, completion, label    |

`unpaired` is KTO's thumbs-up/down data: `label` is true for a desirable completion, false for an undesirable one.
A preference source (prompt, chosen, rejected) becomes two unpaired rows, chosen → true and rejected → false.

With `chat_template`, rows are rendered with the tokenizer's chat template: a plain prompt becomes a
user turn (after an optional system turn), completions become the assistant turn, and the rendered
prompt ends with the generation prompt, so `prompt + completion` is the full conversation text.
Other columns (e.g. `answer` for verifiable rewards) are kept.
"""

from __future__ import annotations

import hashlib
import json
import random
import re
from dataclasses import dataclass, field

from alignpipe.special_tokens import encode

COMPLETION_COLUMNS = {
    "prompt_completion": ("completion",),
    "preference": ("chosen", "rejected"),
    "unpaired": ("completion",),
}


SOURCE = "_source"
"""The key a mixture's rows carry through formatting: the dataset each came from (counted and removed at the end)."""


class RowError(ValueError):
    """A row that cannot be formatted; `source` names the dataset of a mixture it came from."""

    def __init__(self, message: str, source: str | None = None):
        super().__init__(message)
        self.source = source


class LabelError(RowError):
    """An `unpaired` row whose `label` is not a boolean."""


class MissingColumnError(RowError):
    """A row without a value its format needs (`datasets` gives null where a row of a JSON-lines file lacks a field)."""

    def __init__(self, row: int, column: str, columns: list[str], source: str | None = None):
        self.row, self.column, self.columns = row, column, columns
        super().__init__(
            f"row {row} has no {column!r} (its columns with a value: {', '.join(columns) or 'none'})", source
        )


def implicit_prompt(row: dict) -> dict:
    """A preference row without a prompt whose chosen and rejected answers start alike (Anthropic's hh-rlhf: two whole
    dialogues differing in the last reply): the shared start becomes the prompt, as TRL's `extract_prompt` splits it.
    Texts split at the first differing character (a space before it goes with the answers); conversations after the
    last shared message. Rows with a prompt, or nothing shared, are returned as they are."""
    chosen, rejected = row.get("chosen"), row.get("rejected")
    if row.get("prompt") or chosen is None or rejected is None or type(chosen) is not type(rejected):
        return row
    n = 0
    for a, b in zip(chosen, rejected):
        if a != b:
            break
        n += 1
    if isinstance(chosen, str):
        n = n - 1 if 0 < n < min(len(chosen), len(rejected)) and chosen[n - 1] == " " else n
    if n == 0 or n >= min(len(chosen), len(rejected)):  # nothing shared, or one answer is the other's start
        return row
    return {**row, "prompt": chosen[:n], "chosen": chosen[n:], "rejected": rejected[n:]}


def unpair(rows: list[dict]) -> list[dict]:
    """Rows for the `unpaired` format: (prompt, completion, label) rows as they are, with `label` checked to be a
    boolean; preference rows split into (prompt, chosen, true) and (prompt, rejected, false)."""
    out = []
    for i, row in enumerate(rows):
        if "completion" not in row and "chosen" in row and "rejected" in row:
            rest = {k: v for k, v in row.items() if k not in ("chosen", "rejected", "label")}
            out.append({**rest, "completion": row["chosen"], "label": True})
            out.append({**rest, "completion": row["rejected"], "label": False})
            continue
        if not isinstance(row.get("label"), bool):
            raise LabelError(
                f"row {i} has label {row.get('label')!r} ({type(row.get('label')).__name__}), not true/false",
                row.get(SOURCE),
            )
        out.append(row)
    return out


CANONICAL = ("text", "messages", "prompt", "completion", "chosen", "rejected", "answer")


NEEDED = {
    "prompt_only": ("prompt",),
    "prompt_completion": ("prompt", "completion"),
    "preference": ("chosen", "rejected"),
    "unpaired": ("completion",),
}
"""Columns every row of a format must have a value in (preference and unpaired prompts may be empty)."""


class ConversationError(RowError):
    """A `messages` row that cannot be split into a prompt and an assistant reply."""


def split_conversation(messages: list[dict]) -> tuple[list[dict], list[dict]]:
    """(the turns before the last assistant turn, [that turn]): the completion is the last reply, the prompt the
    conversation that led to it; turns after it (a trailing user turn) are dropped."""
    last = max((i for i, m in enumerate(messages) if m.get("role") == "assistant"), default=None)
    if last is None:
        roles = [m.get("role") for m in messages]
        raise ConversationError(f"its `messages` have no assistant turn to learn from (roles: {roles})")
    return messages[:last], [messages[last]]


@dataclass
class FormatStats:
    rows_in: int = 0
    rows_train: int = 0
    rows_eval: int = 0
    dropped_too_long: int = 0
    dropped_identical_pair: int = 0
    rows_by_source: dict[str, list[int]] = field(default_factory=dict)
    """A mixture's formatted rows from each of its datasets: [train, eval]."""
    fingerprint: str = ""
    examples: list[dict] = field(default_factory=list)


def map_columns(rows: list[dict], columns: dict[str, str]) -> list[dict]:
    """Rename source columns to canonical names (`columns` maps canonical → source)."""
    if not columns:
        return rows
    out = []
    for row in rows:
        mapped = set(columns.values())
        new = {k: v for k, v in row.items() if k not in mapped}
        for canon, src in columns.items():
            new[canon] = row[src]
        out.append(new)
    return out


GENERATION_MARK = re.compile(r"\{%-?\s*generation\s*-?%\}")
"""A chat template's `{% generation %}` tag: the template marks the assistant replies itself."""


class Renderer:
    """Renders one row to a canonical format, as plain text or through the chat template."""

    def __init__(
        self,
        tokenizer,
        chat_template: bool,
        system_prompt: str | None = None,
        template_kwargs: dict | None = None,
        tools: list[dict] | None = None,
    ):
        self.tok = tokenizer
        self.chat = chat_template
        self.system = system_prompt
        self.kwargs = dict(template_kwargs or {})  # the template's own variables, e.g. Qwen3's enable_thinking
        if tools:  # JSON schemas the template shows the model (`tool_calls.tool_schema`)
            self.kwargs["tools"] = tools
        if chat_template and not getattr(tokenizer, "chat_template", None):
            raise ValueError(
                "`chat_template: true` but the tokenizer has no chat template; "
                "set `chat_template: false` or use a tokenizer that defines one"
            )

    def _render(self, messages: list[dict], add_generation_prompt: bool = False) -> str:
        return self.tok.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=add_generation_prompt, **self.kwargs
        )

    def _turns(self, prompt) -> list[dict]:
        turns = list(prompt) if isinstance(prompt, list) else [{"role": "user", "content": prompt}]
        if self.system and not any(t["role"] == "system" for t in turns):
            turns = [{"role": "system", "content": self.system}] + turns
        return turns

    def prompt(self, prompt) -> str:
        if not self.chat:
            return prompt if isinstance(prompt, str) else "\n".join(t["content"] for t in prompt)
        return self._render(self._turns(prompt), add_generation_prompt=True)

    def completion(self, prompt, completion) -> str:
        if not self.chat:
            return (
                completion
                if isinstance(completion, str)
                else [m for m in completion if m["role"] == "assistant"][-1]["content"]
            )
        if isinstance(completion, list):  # a whole conversation (e.g. UltraFeedback): keep the last assistant turn
            reply = [m for m in completion if m["role"] == "assistant"][-1:] or completion[-1:]
        else:
            reply = [{"role": "assistant", "content": completion}]
        full = self._render(self._turns(prompt) + reply)
        head = self.prompt(prompt)
        if not full.startswith(head):
            raise ValueError(
                "the chat template renders the prompt differently alone and in a conversation; "
                "cannot split prompt from completion"
            )
        return full[len(head) :]

    def text(self, row) -> str:
        if "messages" in row and row["messages"] is not None:
            return self._render(row["messages"])
        return row["text"]

    def assistant_spans(self, messages: list[dict], text: str) -> list[list[int]]:
        """[start, end) character offsets in `text` (the whole conversation rendered) of each assistant reply with the
        end-of-turn the template writes after it: for reply i, from the end of the conversation before it (with the
        generation prompt) to the end of the conversation up to it. What SFT's `assistant_only_loss` trains on. A
        template that marks its replies with `{% generation %}` gives them itself (`marked_spans`)."""
        if GENERATION_MARK.search(self.tok.chat_template or ""):
            return self.marked_spans(messages, text)
        spans = []
        for i, m in enumerate(messages):
            if m.get("role") != "assistant":
                continue
            before = self._render(messages[:i], add_generation_prompt=True)
            upto = self._render(messages[: i + 1])
            if not (text.startswith(before) and text.startswith(upto) and len(before) <= len(upto)):
                raise ValueError(
                    "the chat template renders a conversation differently in part and in whole (as Qwen3's and "
                    "DeepSeek-R1's, which drop earlier turns' reasoning); cannot find its assistant replies. Give "
                    "`model.chat_template` a training version of it that wraps each assistant reply in "
                    "{% generation %} ... {% endgeneration %}, or use `format: prompt_completion` to train on the last "
                    "reply only"
                )
            spans.append([len(before), len(upto)])
        return spans

    def marked_spans(self, messages: list[dict], text: str) -> list[list[int]]:
        """The character spans of the tokens the template's `{% generation %}` blocks render (transformers'
        `return_assistant_tokens_mask`), each run of them one span."""
        enc = self.tok.apply_chat_template(
            messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True, **self.kwargs
        )
        marks = enc["assistant_masks"]
        offsets = self.tok(text, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]
        if len(offsets) != len(marks):
            raise ValueError(
                "the chat template's {% generation %} marks cover a tokenization of the conversation other than its "
                f"text's ({len(marks)} tokens against {len(offsets)}); cannot place the assistant replies"
            )
        spans: list[list[int]] = []
        for t, marked in enumerate(marks):
            if not marked:
                continue
            if spans and t > 0 and marks[t - 1]:
                spans[-1][1] = offsets[t][1]
            else:
                spans.append([offsets[t][0], offsets[t][1]])
        if not spans and any(m.get("role") == "assistant" for m in messages):
            raise ValueError(
                "the chat template has {% generation %} marks but none of this conversation's assistant replies is "
                "inside one; wrap each reply (and its end of turn) in {% generation %} ... {% endgeneration %}"
            )
        return spans


def to_format(row: dict, fmt: str, r: Renderer) -> dict:
    """One raw row (canonical column names) → one row of `fmt`."""
    extra = {k: v for k, v in row.items() if k not in CANONICAL}
    if "answer" in row:
        extra["answer"] = row["answer"]
    if fmt == "language_modeling":
        text = r.text(row)
        if row.get("messages"):
            return {"text": text, "assistant_spans": r.assistant_spans(row["messages"], text), **extra}
        return {"text": text, **extra}
    msgs = row.get("messages")
    if msgs and fmt == "prompt_only" and "prompt" not in row:
        row = {**row, "prompt": msgs[:-1] if msgs[-1].get("role") == "assistant" else msgs}
    elif msgs and fmt == "prompt_completion" and "completion" not in row:
        # A conversation column (UltraChat, UltraFeedback's `messages`) gives both halves. A `prompt` column beside
        # it (there, the first user turn alone) lacks the turns before the reply, so it is not used.
        prompt, reply = split_conversation(msgs)
        row = {**row, "prompt": prompt, "completion": reply}
    for column in NEEDED.get(fmt, ()):
        if row.get(column) is None:  # `datasets` gives null for a field a row lacks
            raise KeyError(column)
    if fmt == "prompt_only":
        return {"prompt": r.prompt(row["prompt"]), **extra}
    if fmt == "prompt_completion":
        return {
            "prompt": r.prompt(row["prompt"]),
            "completion": r.completion(row["prompt"], row["completion"]),
            **extra,
        }
    if fmt == "unpaired":
        extra.pop("label", None)
        return {
            "prompt": r.prompt(row.get("prompt", "")),
            "completion": r.completion(row.get("prompt", ""), row["completion"]),
            "label": row["label"],
            **extra,
        }
    if fmt == "preference":
        return {
            "prompt": r.prompt(row.get("prompt", "")),
            "chosen": r.completion(row.get("prompt", ""), row["chosen"]),
            "rejected": r.completion(row.get("prompt", ""), row["rejected"]),
            **extra,
        }
    raise ValueError(f"unknown format {fmt!r}")


def fingerprint(rows: list[dict]) -> str:
    h = hashlib.sha256()
    for row in rows:
        h.update(json.dumps(row, sort_keys=True, default=str).encode())
    return h.hexdigest()[:16]


def format_rows(
    raw: list[dict],
    *,
    fmt: str,
    tokenizer,
    columns: dict[str, str] | None = None,
    chat_template: bool = False,
    system_prompt: str | None = None,
    chat_template_kwargs: dict | None = None,
    tools: list[dict] | None = None,
    max_length: int | None = None,
    eval_fraction: float = 0.1,
    max_rows: int | None = None,
    truncate_prompts: int | None = None,
    shuffle: bool = True,
    seed: int = 0,
) -> tuple[list[dict], list[dict], FormatStats]:
    """Raw rows → (train rows, eval rows, stats). Deterministic for a given seed. `tools`: JSON schemas rendered
    into every conversation by the chat template."""
    stats = FormatStats(rows_in=len(raw))
    rows = map_columns(raw, columns or {})
    if shuffle:
        rows = rows[:]
        random.Random(seed).shuffle(rows)
    if max_rows:
        rows = rows[:max_rows]
    if fmt in ("preference", "unpaired"):
        rows = [implicit_prompt(r) for r in rows]
    if fmt == "unpaired":
        rows = unpair(rows)
    renderer = Renderer(tokenizer, chat_template, system_prompt, chat_template_kwargs, tools)
    out = []
    for i, row in enumerate(rows):
        try:
            out.append(to_format(row, fmt, renderer))
        except ConversationError as e:
            raise ConversationError(f"row {i}: {e}", row.get(SOURCE)) from None
        except KeyError as e:
            valued = [k for k, v in row.items() if v is not None and k != SOURCE]
            raise MissingColumnError(i, str(e.args[0]), valued, row.get(SOURCE)) from None
    if fmt == "preference":
        keep = [r for r in out if r["chosen"] != r["rejected"]]
        stats.dropped_identical_pair = len(out) - len(keep)
        out = keep
    if truncate_prompts:
        out = [
            {**row, "prompt": head}
            for row, head in zip(out, first_tokens([r["prompt"] for r in out], tokenizer, truncate_prompts))
        ]
    if max_length:
        out, stats.dropped_too_long = _drop_long(out, fmt, tokenizer, max_length)
    mixed = any(SOURCE in r for r in out)
    if mixed:
        out = _uniform(out)
    n_eval = round(len(out) * eval_fraction)
    if eval_fraction > 0 and len(out) > 1:
        n_eval = max(1, n_eval)
    train, evals = out[: len(out) - n_eval], out[len(out) - n_eval :]
    if mixed:
        for split, rows in enumerate((train, evals)):
            for r in rows:
                counts = stats.rows_by_source.setdefault(r.pop(SOURCE), [0, 0])
                counts[split] += 1
    stats.rows_train, stats.rows_eval = len(train), len(evals)
    stats.fingerprint = fingerprint(train + [{"_split": "eval"}] + evals)
    stats.examples = out[:3]
    return train, evals, stats


def _uniform(rows: list[dict]) -> list[dict]:
    """A mixture's rows with the same columns (null where a row lacks one, e.g. `assistant_spans` on a row of plain
    text beside conversations): `datasets` takes a table's columns from its first row."""
    keys = list(dict.fromkeys(k for r in rows for k in r))
    return [{k: r.get(k) for k in keys} for r in rows]


def first_tokens(texts: list[str], tokenizer, n: int) -> list[str]:
    """Each text cut after its n-th token, the characters kept exactly as written (a fast tokenizer's offsets; a slow
    one's tokens decoded)."""
    if not texts:
        return texts
    if getattr(tokenizer, "is_fast", False):
        offsets = tokenizer(texts, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]
        return [text if len(spans) <= n else text[: spans[n - 1][1]] for text, spans in zip(texts, offsets)]
    ids = tokenizer(texts, add_special_tokens=False)["input_ids"]
    return [text if len(row) <= n else tokenizer.decode(row[:n]) for text, row in zip(texts, ids)]


def _drop_long(rows: list[dict], fmt: str, tokenizer, max_length: int) -> tuple[list[dict], int]:
    """Drop rows whose prompt + longest completion (+ EOS) is longer than `max_length` tokens."""
    if not rows:
        return rows, 0

    def lengths(col: str, special: bool) -> list[int]:
        texts = [r[col] for r in rows]
        return [
            len(x)
            for x in (encode(tokenizer, texts) if special else tokenizer(texts, add_special_tokens=False)["input_ids"])
        ]

    if fmt == "language_modeling":
        total = [n + 1 for n in lengths("text", True)]
    else:
        prompt = lengths("prompt", True)
        longest = [0] * len(rows)
        for col in COMPLETION_COLUMNS.get(fmt, ()):
            longest = [max(a, b + 1) for a, b in zip(longest, lengths(col, False))]
        total = [p + c for p, c in zip(prompt, longest)]
    keep = [r for r, n in zip(rows, total) if n <= max_length]
    return keep, len(rows) - len(keep)
