"""What the benchmark runs: models, the shapes of a step (two suites), the data of each case, and the physics a
figure is read against (training FLOPs per token, bytes a decode step must read).

Suites:
- `user`: the batch sizes people train with on one GPU (issue 18): SFT packed 8×2048 and 4×4096, reward and DPO
  with ~1024-token rows 8 pairs per step, GRPO 8 prompts × 8 completions × 256 new tokens, PPO 64 episodes × 256
  new tokens. The GPU default.
- `latency`: small steps where per-step overhead dominates (the CPU default; on the GPU a second table).

A case is one trainer at one shape; its key (`sft/8x2048`) names it on the command line of `bench.run_one`.
"""

from __future__ import annotations

import json
import math
import os
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

TRAINERS = ("sft", "reward", "dpo", "kto", "grpo", "rloo", "online_dpo", "ppo")
ONLINE = ("grpo", "rloo", "online_dpo", "ppo")
PAIRED = ("dpo", "reward")  # chosen and rejected both run: a sample is two rows


@dataclass(frozen=True)
class Shape:
    """What one optimizer step is made of."""

    label: str  # how the table names it: "8×2048 packed"
    batch: int  # rows per forward pass (GRPO/RLOO: completions; PPO: episodes; online DPO: prompts)
    max_len: int  # tokens per row, prompt included
    accumulation: int = 1  # forward passes per optimizer step
    generations: int = 8  # GRPO/RLOO: completions per prompt
    completion: int = 32  # online trainers: new tokens per completion
    packed: bool = False  # SFT: whole rows best-fit into `max_len` blocks, each attending to itself
    prompt_tokens: int = 0  # synthetic rows joined to about this many prompt tokens (0: one row's prompt)
    completion_tokens: int = 0  # offline rows: about this many completion tokens (SFT: the median; 0: `join` rows)
    join: int = 1  # latency suite: synthetic completions joined into one row
    log_every: int = 0  # steps between logs; 0: one log at the end (CPU). On a GPU: `_logging_every`

    @property
    def per_step(self) -> int:
        """Samples per optimizer step: rows (pairs for DPO/reward), completions (GRPO/RLOO), episodes (PPO),
        prompts (online DPO)."""
        return self.batch * self.accumulation

    @property
    def key(self) -> str:
        return self.label.split()[0].replace("×", "x")


@dataclass(frozen=True)
class Case:
    trainer: str
    shape: Shape

    @property
    def key(self) -> str:
        return f"{self.trainer}/{self.shape.key}"


USERS_LOGGING_EVERY = 10
"""Steps between logs of the offline trainers on a GPU: ours' `logging_every` default and TRL's `logging_steps`. A log
reads the logged values back, so the device drains there; what happens between logs is what a user's run gets."""


LOG_EVERY_ENV = "ALIGNPIPE_BENCH_LOG_EVERY"
"""Set by `python -m bench --log-every N`: the offline trainers' steps between logs on a GPU, every side alike (1: as
every GPU row before session 44 ran, each step then waiting for the device)."""


def _logging_every(gpu: bool, online: bool) -> int:
    """A GPU case's steps between logs: every step for an online trainer (its log times a step, `bench.run_one`),
    `USERS_LOGGING_EVERY` (or `LOG_EVERY_ENV`'s) for an offline one (timed by its optimizer steps); on a CPU one log
    at the end."""
    if not gpu:
        return 0
    return 1 if online else int(os.environ.get(LOG_EVERY_ENV) or USERS_LOGGING_EVERY)


def _latency(gpu: bool) -> dict[str, Shape]:
    if gpu:
        s = Shape("8×512", batch=8, max_len=512, generations=8, completion=64, join=24, log_every=1)
    else:
        s = Shape("8×64", batch=8, max_len=64, generations=8, completion=32)
    grpo = Shape(f"2×{s.generations}×{s.completion}", **{**_fields(s), "batch": 2 * s.generations})
    ppo = Shape(f"{s.batch}×{s.completion}", **_fields(s))
    online = Shape(f"{s.batch}×2×{s.completion}", **_fields(s))
    offline = Shape(s.label, **{**_fields(s), "log_every": _logging_every(gpu, online=False)})
    return {t: offline for t in ("sft", "reward", "dpo", "kto")} | {
        "grpo": grpo,
        "rloo": grpo,
        "ppo": ppo,
        "online_dpo": online,
    }


def _user(gpu: bool) -> dict[str, list[Shape]]:
    log = _logging_every(gpu, online=False)
    pair = Shape("8×1024", batch=8, max_len=1024, prompt_tokens=256, completion_tokens=720, log_every=log)
    rl: dict[str, Any] = dict(
        batch=16,
        accumulation=4,
        max_len=384,
        completion=256,
        prompt_tokens=96,
        log_every=_logging_every(gpu, online=True),
    )
    packed: dict[str, Any] = dict(packed=True, prompt_tokens=128, completion_tokens=384, log_every=log)
    return {
        "sft": [
            Shape("8×2048 packed", batch=8, max_len=2048, **packed),
            Shape("4×4096 packed", batch=4, max_len=4096, **packed),
        ],
        "reward": [pair],
        "dpo": [pair],
        "kto": [pair],
        "grpo": [Shape("8×8×256", generations=8, **rl)],
        "rloo": [Shape("8×8×256", generations=8, **rl)],
        "ppo": [Shape("64×256", **rl)],
        "online_dpo": [Shape("16×2×256", **{**rl, "batch": 16, "accumulation": 1})],
    }


def _fields(s: Shape) -> dict:
    return {k: getattr(s, k) for k in s.__dataclass_fields__ if k != "label"}


SUITES = ("user", "latency")
GPU_TRAINERS = ("sft", "reward", "dpo", "grpo", "ppo")  # the shapes issue 18 names; the others on request


def is_gpu_model(model: str) -> bool:
    return model.startswith("qwen")


def cases(model: str, suite: str, trainers: list[str]) -> list[Case]:
    """The cases of `suite` for `trainers` on `model`, in trainer order."""
    gpu = is_gpu_model(model)
    if suite == "latency":
        table = _latency(gpu)
        return [Case(t, table[t]) for t in trainers]
    user = _user(gpu)
    return [Case(t, s) for t in trainers for s in user[t]]


def find_case(model: str, key: str) -> Case:
    """The case `trainer/shape` (`sft/8x2048`) of either suite."""
    for suite in SUITES:
        for c in cases(model, suite, list(TRAINERS)):
            if c.key == key:
                return c
    known = sorted({c.key for suite in SUITES for c in cases(model, suite, list(TRAINERS))})
    raise SystemExit(f"unknown case {key!r} for model {model}; known: {', '.join(known)}")


# --- data ---------------------------------------------------------------------------------------------------------


def _source(assets: str, trainer: str) -> list[dict]:
    name = {"sft": "sentiment_sft", **dict.fromkeys(ONLINE, "sentiment_prompts")}.get(trainer, "sentiment_preferences")
    return [json.loads(line) for line in Path(f"{assets}/data/{name}.jsonl").read_text().splitlines()]


class _Joiner:
    """Texts of one field of the synthetic rows, run together from a cursor to about a number of tokens."""

    def __init__(self, texts: list[str], tokenizer):
        self.texts = texts
        self.tokens = [len(ids) for ids in tokenizer(texts, add_special_tokens=False)["input_ids"]]
        self.i = 0

    def take(self, target: int) -> str:
        out, n = [], 0
        while n < max(1, target):
            out.append(self.texts[self.i % len(self.texts)])
            n += self.tokens[self.i % len(self.texts)]
            self.i += 1
        return "".join(out)


def rows(assets: str, case: Case, steps: int = 40, tokenizer=None) -> list[dict]:
    """The synthetic sentiment data of `case`, enough for `steps` optimizer steps. Latency shapes: the rows as they
    are (on the GPU each completion is `join` rows' run together). User shapes: rows run together to the shape's
    prompt and completion lengths; SFT's completion lengths spread log-normally around the median (seeded), so
    packing has rows of many sizes to fit."""
    s, trainer = case.shape, case.trainer
    data = _source(assets, trainer)
    if not (s.prompt_tokens or s.completion_tokens):
        return _latency_rows(data, trainer, s.join)
    if tokenizer is None:
        from alignpipe.modeling import load_tokenizer

        tokenizer = load_tokenizer(f"{assets}/model")
    rng = random.Random(0)
    prompts = _Joiner([r["prompt"] + " " for r in data], tokenizer)
    if trainer in ONLINE:
        return [{"prompt": prompts.take(s.prompt_tokens)} for _ in range(max(64, steps * s.per_step))]
    if trainer == "sft":
        completions = _Joiner([r["completion"] for r in data], tokenizer)
        out, budget = [], 1.25 * steps * s.per_step * s.max_len
        while budget > 0:
            n = int(
                min(s.max_len - s.prompt_tokens - 8, max(16, rng.lognormvariate(math.log(s.completion_tokens), 0.6)))
            )
            out.append({"prompt": prompts.take(s.prompt_tokens), "completion": completions.take(n)})
            budget -= n + s.prompt_tokens
        return out
    chosen = _Joiner([r["chosen"] for r in data], tokenizer)
    rejected = _Joiner([r["rejected"] for r in data], tokenizer)
    pairs = [
        {
            "prompt": prompts.take(s.prompt_tokens),
            "chosen": chosen.take(s.completion_tokens),
            "rejected": rejected.take(s.completion_tokens),
        }
        for _ in range(max(64, steps * s.per_step))
    ]
    if trainer == "kto":  # each pair as two thumbs: chosen → true, rejected → false
        return [
            {"prompt": p["prompt"], "completion": p[side], "label": side == "chosen"}
            for p in pairs
            for side in ("chosen", "rejected")
        ]
    return pairs


def _latency_rows(data: list[dict], trainer: str, k: int) -> list[dict]:
    n = len(data)
    if trainer == "sft":
        return [
            {"prompt": r["prompt"], "completion": "".join(data[(i + j) % n]["completion"] for j in range(k))}
            for i, r in enumerate(data[:2000])
        ]
    if trainer in PAIRED and k > 1:
        tail = lambda i: "".join(data[(i + j) % n]["chosen"] for j in range(1, k))  # noqa: E731
        return [
            {"prompt": r["prompt"], "chosen": r["chosen"] + tail(i), "rejected": r["rejected"] + tail(i)}
            for i, r in enumerate(data[:2000])
        ]
    if trainer == "kto":
        return [
            {"prompt": r["prompt"], "completion": r[side], "label": side == "chosen"}
            for r in data[:1000]
            for side in ("chosen", "rejected")
        ]
    return data[:2000]


def row_lengths(assets: str, case: Case, tokenizer, steps: int = 40) -> list[int]:
    """Tokens of each sequence the case trains on (EOS included, cut at the shape's max length): SFT rows; chosen
    and rejected rows for DPO and reward; prompt + completion for KTO. Packing does not change them."""
    data = rows(assets, case, steps, tokenizer)[:2000]
    if case.trainer in ("sft", "kto"):
        texts = [r["prompt"] + r["completion"] for r in data]
    else:
        texts = [r["prompt"] + r["chosen"] for r in data] + [r["prompt"] + r["rejected"] for r in data]
    return [min(len(ids) + 1, case.shape.max_len) for ids in tokenizer(texts)["input_ids"]]


def tokens_per_sample(case: Case, lengths: list[int]) -> float:
    """Real tokens in one sample of the table: a row, a pair (two rows), or a packed block (rows placed
    best-fit-decreasing by our packer, as TRL's `bfd` places them: the fill both sides get)."""
    mean = sum(lengths) / len(lengths)
    if case.trainer in PAIRED:
        return 2 * mean
    if case.shape.packed:
        from alignpipe.trainers.sft import pack

        blocks = pack([{"input_ids": [0] * n, "labels": [0] * n} for n in lengths], case.shape.max_len, "bfd")
        return sum(len(b["input_ids"]) for b in blocks) / len(blocks)
    return mean


# --- physics -------------------------------------------------------------------------------------------------------

QWEN_05B: dict[str, Any] = dict(
    vocab_size=151936,
    hidden_size=896,
    intermediate_size=4864,
    num_hidden_layers=24,
    num_attention_heads=14,
    num_key_value_heads=2,
    max_position_embeddings=4096,
    rope_theta=1_000_000.0,
    tie_word_embeddings=True,
)
# Dense bf16 FLOP/s and HBM bytes/s of the SXM parts, from NVIDIA's data sheets.
SPEC = {"H100": (989.4e12, 3.35e12), "H200": (989.4e12, 4.8e12), "A100": (312e12, 2.04e12)}


# The CPU models' sizes: `tiny` is the project's own (alignpipe.tiny), `small` the BASELINES.md 20M Llama shape
# (`bench.run_one.random_model` builds it); both take the tiny tokenizer's vocabulary.
SMALL: dict[str, Any] = dict(
    hidden_size=512,
    num_hidden_layers=6,
    num_attention_heads=8,
    num_key_value_heads=4,
    intermediate_size=1536,
    max_position_embeddings=512,
    tie_word_embeddings=True,
)


TINY_QWEN2 = "tiny-qwen2"
"""A CPU model: the tiny model's sizes and vocabulary in Qwen2's architecture (random init), so that Liger patches it
as it patches the GPU's `qwen0.5b`, at sizes Triton's interpreter runs in seconds (`bench.liger_cpu`)."""


def model_sizes(model: str) -> dict:
    """A benchmark model's configuration sizes, the vocabulary included."""
    if is_gpu_model(model):
        return QWEN_05B
    from alignpipe.tiny import TINY_MODEL, TOKENIZER_VOCAB

    return {**(SMALL if model == "small" else TINY_MODEL), "vocab_size": TOKENIZER_VOCAB}


def value_bytes(model: str) -> int:
    """Bytes of one weight or cache value as the benchmark runs the model: bf16 on the GPU, fp32 on the CPU."""
    return 2 if is_gpu_model(model) else 4


def _dims(model: str) -> tuple[int, int, int, int]:
    """(layers, d, matmul parameters of the decoder, LM head parameters)."""
    c = model_sizes(model)
    d, L, kv = c["hidden_size"], c["num_hidden_layers"], c["num_key_value_heads"]
    head_dim = d // c["num_attention_heads"]
    per_layer = d * d * 2 + 2 * d * kv * head_dim + 3 * d * c["intermediate_size"]  # q,o + k,v + gate,up,down
    return L, d, L * per_layer, c["vocab_size"] * d


def attention_span(lengths: list[int]) -> float:
    """The length the average token attends over, Σs²/Σs: a token of a row of s tokens attends within its row (a
    packed row too: document-masked), so long rows weigh more than their count."""
    return sum(n * n for n in lengths) / max(1, sum(lengths))


def train_flops_per_token(trainer: str, model: str, span: float) -> float | None:
    """Model FLOPs per trained token (PaLM's appendix B: 6·N + 12·L·d·s, attention over the whole span): the same
    figure for both sides, so MFU ratios are throughput ratios. DPO and KTO add the reference model's forward (2·N +
    4·L·d·s); the reward model has no LM head. None for the online trainers (their step is mostly decoding, read
    against the bandwidth bound instead)."""
    if trainer in ONLINE:
        return None
    L, d, decoder, head = _dims(model)
    n = decoder + (0 if trainer == "reward" else head)
    flops = 6 * n + 12 * L * d * span
    if trainer in ("dpo", "kto"):
        flops += 2 * n + 4 * L * d * span
    return flops


def decode_bytes_per_step(model: str, sequences: int, context: float) -> float:
    """Bytes one decode step must read from memory (bf16 on the GPU, fp32 on the CPU): every weight once (decoder +
    LM head; the embedding lookup reads `sequences` rows only) and each sequence's KV cache of `context` tokens."""
    L, d, decoder, head = _dims(model)
    c = model_sizes(model)
    kv_per_token = L * 2 * c["num_key_value_heads"] * (d // c["num_attention_heads"])
    return value_bytes(model) * (decoder + head + sequences * context * kv_per_token)


def decode_bound(case: Case, model: str, bandwidth: float) -> float:
    """Generated tokens/s a rollout of the shape could reach if each decode step only read memory at `bandwidth`:
    all of a step's completions decode together, over an average context of prompt + half the completion."""
    shape = case.shape
    sequences = shape.per_step * (2 if case.trainer == "online_dpo" else 1)  # online DPO: two per prompt
    per_step = decode_bytes_per_step(model, sequences, shape.prompt_tokens + shape.completion / 2)
    return sequences * bandwidth / per_step
