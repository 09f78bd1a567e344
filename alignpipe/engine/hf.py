"""The `hf` backend: batched `transformers` generation with left padding (CPU or GPU)."""

from __future__ import annotations

import functools
from typing import Any

import torch

from alignpipe import fused_kernels
from alignpipe.engine.base import FinishReason, Generation
from alignpipe.engine.decode_steps import (
    CompiledDecodeStep,
    FixedShapeStep,
    GraphedDecodeStep,
    decode_step,
    new_cache,
    takes_fused_kernels,
)
from alignpipe.engine.sampling import SamplingParams
from alignpipe.host_reads import HostRead
from alignpipe.modeling import mask_positions, under_attention_kernels
from alignpipe.progress import progress
from alignpipe.special_tokens import encode, stop_token_ids


class HFEngine:
    """Batched sampling with the model's own forward and KV cache, `batch_size` prompts at a time.

    A plain decode loop rather than `model.generate`: for the small models rollouts train on CPU (and
    for short completions anywhere) generate()'s per-token machinery (processor lists, stopping
    criteria, kwargs bookkeeping) costs more than the forward itself. Greedy output equals
    `model.generate`'s token for token (tested). On a GPU the decode step is replayed as a CUDA graph (`cuda_graphs`,
    `decode_steps.GraphedDecodeStep`) or compiled (`compile`); on CPU the eager loop runs (`static_cache` for the
    fixed-shape one)."""

    def __init__(
        self,
        model,
        tokenizer,
        batch_size: int = 32,
        static_cache: bool = False,
        compile: bool = False,
        cuda_graphs: bool = True,
        progress: str | None = None,
    ):
        self.model = model
        self.tok = tokenizer
        self.batch_size = batch_size
        self.progress = progress  # a bar's label: each `generate` call shows its completions done (judging)
        self.static_cache = static_cache or compile
        self.step: FixedShapeStep | None = CompiledDecodeStep() if compile else None
        self.cuda_graphs = cuda_graphs and not compile

    def _decode_step(self, device: torch.device) -> FixedShapeStep | None:
        """The replayed step this rollout decodes with: the compiled one under `compile`; on a GPU, unless
        `cuda_graphs` is off, the eager step recorded as a CUDA graph (for models whose decode steps take a ready
        padding mask: a step that builds its mask reads the device); else none (the eager loop)."""
        if self.step is None and self.cuda_graphs and device.type == "cuda" and _takes_padding_mask(self.model):
            self.step = GraphedDecodeStep()
        return self.step

    def generate(
        self,
        prompts: list[str] | list[list[int]],
        n: int = 1,
        sampling: SamplingParams | None = None,
        seed: int | None = None,
        logprobs: bool = False,
    ) -> list[Generation]:
        device = next(self.model.parameters()).device
        step = self._decode_step(device)
        # Inference mode skips autograd's bookkeeping per op (~10–20% of an eager decode step's host time; only
        # lists leave). Steps replayed from a recording have no per-op host work to save, and under no_grad their
        # prefill and recordings run the fused kernels' graphs that training compiles (`without_grad`).
        replayed = isinstance(step, GraphedDecodeStep) and not step.failed
        with fused_kernels.without_grad(replayed and takes_fused_kernels(self.model, device), self.model):
            return self._generate(prompts, n, sampling or SamplingParams(), seed, logprobs, step, device)

    @under_attention_kernels
    def _generate(
        self,
        prompts: list[str] | list[list[int]],
        n: int,
        sampling: SamplingParams,
        seed: int | None,
        logprobs: bool,
        step: FixedShapeStep | None,
        device: torch.device,
    ) -> list[Generation]:
        generator = None
        if seed is not None:
            generator = torch.Generator(device=device).manual_seed(seed)
        stops = stop_token_ids(self.tok, self.model)
        stop_ids = torch.tensor(stops, dtype=torch.long, device=device) if stops else None
        was_training = self.model.training
        self.model.eval()
        out: list[Generation] = []
        bar = progress(len(prompts) * n, self.progress) if self.progress else None
        try:
            for start in range(0, len(prompts), self.batch_size):
                chunk = prompts[start : start + self.batch_size]
                enc = self._encode(chunk)
                args = (
                    self.model,
                    enc["input_ids"].to(device),
                    enc["attention_mask"].to(device),
                    sampling,
                    stop_ids,
                    self.tok.pad_token_id,
                    generator,
                )
                if self.static_cache or step is not None:
                    tokens, logps = decode_static(*args, n=n, step=step, logprobs=logprobs)
                else:
                    tokens, logps = decode(*args, n=n, logprobs=logprobs)
                rows = logps.tolist() if logps is not None else [None] * len(tokens)
                for k, (row, row_logps) in enumerate(zip(tokens.tolist(), rows)):
                    out.append(self._finish(start + k // n, row, stops, row_logps))
                if bar is not None:
                    bar.update(len(chunk) * n)
        finally:
            if bar is not None:
                bar.close()
            self.model.train(was_training)
            if step is not None:
                step.release()
        return out

    def _encode(self, chunk: list):
        """Texts are tokenized (one BOS, `special_tokens.encode`); token-id lists are left-padded as they are."""
        from transformers import BatchEncoding

        if chunk and isinstance(chunk[0], str):
            chunk = encode(self.tok, chunk)
        n = max(len(ids) for ids in chunk)
        input_ids = torch.full((len(chunk), n), self.tok.pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(chunk), n), dtype=torch.long)
        for i, ids in enumerate(chunk):
            input_ids[i, n - len(ids) :] = torch.tensor(ids)
            mask[i, n - len(ids) :] = 1
        return BatchEncoding({"input_ids": input_ids, "attention_mask": mask})

    def update_weights(self, model) -> None:
        """Rollouts use the policy object itself: nothing to copy (a replayed step records a new model again)."""
        self.model = model

    def _finish(
        self, prompt_index: int, ids: list[int], stops: list[int], logps: list[float] | None = None
    ) -> Generation:
        reason: FinishReason = "length"
        end = next((t for t, i in enumerate(ids) if i in stops), None)
        if end is not None:
            ids, logps, reason = ids[: end + 1], logps[: end + 1] if logps is not None else None, "stop"
        elif self.tok.pad_token_id not in stops:  # a row that ran to the limit: drop padding it sampled
            keep = [t for t, i in enumerate(ids) if i != self.tok.pad_token_id]
            ids, logps = [ids[t] for t in keep], [logps[t] for t in keep] if logps is not None else None
        text = self.tok.decode(ids, skip_special_tokens=True)
        return Generation(prompt_index, text, ids, reason, logps)


def decode(
    model,
    ids: torch.Tensor,
    mask: torch.Tensor,
    sampling: SamplingParams,
    stops: torch.Tensor | None,
    pad: int,
    generator: torch.Generator | None = None,
    n: int = 1,
    logprobs: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Sample up to `max_new_tokens`, `n` times for each left-padded prompt row; (rows × n, steps) new tokens
    (a prompt's samples adjacent), `pad` after EOS, and with `logprobs` their sampling log-probs (`next_token`;
    meaningless after a row's EOS). Each prompt is prefilled once and its KV cache repeated `n` times. Stops once
    every row has ended, looking every `check_every` steps; the columns after the last row's end are cut, so the
    result does not depend on when it looked."""
    position = mask_positions(mask)
    logits, cache = prefill(model, ids, mask, position)
    seen = SeenTokens.of(ids, mask, n, logits.shape[-1], sampling)
    if n > 1:
        cache.batch_repeat_interleave(n)
        logits, mask, position = (x.repeat_interleave(n, 0) for x in (logits, mask, position))
    rows = logits.shape[0]
    out = Sampled(rows, sampling, pad, ids.device, generator, logprobs, stops, seen)
    pos = position[:, -1:] + 1
    width = ids.shape[1]
    length = aligned(width + sampling.max_new_tokens)
    full_mask = torch.cat([mask, mask.new_ones((rows, length - width))], dim=1)
    if _takes_padding_mask(model):  # (rows, 1, 1, keys): the model skips building the mask on every step
        full_mask = attention_bias(full_mask, model.get_input_embeddings().weight.dtype)
    for t in range(sampling.max_new_tokens):
        token = out.add(logits, t)
        if out.ends.finished(t):
            return out.result()
        logits = model(
            input_ids=token,
            attention_mask=full_mask[..., : width + t + 1],
            position_ids=pos,
            past_key_values=cache,
            use_cache=True,
        ).logits[:, -1]
        pos = pos + 1
    return out.result()


class Sampled:
    """What a decode loop has sampled so far: each row's new tokens (`pad` after its end), with `logprobs` their
    sampling log-probs (`next_token`), and which rows have ended (`RowEnds`, at a token of `stops`). `add` chooses
    and records a step's tokens into `token` (rows, 1), the same tensor every step, which a replayed decode step
    therefore reads where it lies (no copy into its own input); `result` cuts the columns after the last row's end.
    Each token costs a fixed handful of kernels beside the decode step itself: on a GPU, where a replayed step of a
    small policy is shorter than the host's work around it, these are what sets the pace."""

    def __init__(
        self,
        rows: int,
        sampling: SamplingParams,
        pad: int,
        device: torch.device,
        generator: torch.Generator | None,
        logprobs: bool,
        stops: torch.Tensor | None,
        seen: SeenTokens | None,
    ):
        self.sampling, self.pad, self.generator, self.logprobs, self.stops, self.seen = (
            sampling, pad, generator, logprobs, stops, seen
        )  # fmt: skip
        self.new = torch.full((rows, sampling.max_new_tokens), pad, dtype=torch.long, device=device)
        self.logps = torch.zeros(self.new.shape, device=device) if logprobs else None
        self.token = torch.full((rows, 1), pad, dtype=torch.long, device=device)
        self._tokens = self.token[:, 0]  # the same memory as a (rows,) view, taken once rather than a token
        self._pad = torch.tensor(pad, dtype=torch.long, device=device)
        self.ends = RowEnds(rows, sampling.max_new_tokens, device)

    def add(self, logits: torch.Tensor, t: int) -> torch.Tensor:
        """Step `t`'s token of each row, chosen from its next-token `logits` and recorded: `token`, (rows, 1)."""
        seen = self.seen
        token, logp = next_token(seen(logits) if seen else logits, self.sampling, self.generator, self.logprobs)
        torch.where(self.ends.done[:, None], self._pad, token[:, None], out=self.token)  # ended rows: pad
        if seen:
            seen.add(self._tokens)
        self.new[:, t] = self._tokens
        if self.logps is not None and logp is not None:
            self.logps[:, t] = logp
        self.ends.record(self._tokens, self.stops)
        return self.token

    def result(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(new tokens, log-probs or None), up to the step the last row ended at (all columns if none ended)."""
        width = ended_width(self.new, self.stops)
        return self.new[:, :width], (self.logps[:, :width] if self.logps is not None else None)


def ended_width(new: torch.Tensor, stops: torch.Tensor | None) -> int:
    """The columns of `new` (rows, steps) up to the first stop token of the row that ends last, all of them where a
    row has none (one read of the device). Worked out once, at the end, from the tokens: a row's tokens after its
    end are `pad`, so its first stop token is its end, whether or not `pad` is a stop token, and a loop that looked
    late (or decoded past the end) cuts the same columns as one that looked at every step."""
    if stops is None:
        return new.size(1)
    hits = torch.isin(new, stops)
    first = torch.where(hits.any(1), hits.to(torch.uint8).argmax(1), new.size(1) - 1)
    return int(first.max()) + 1


# How often a decode loop on a GPU asks "have all rows ended?". Each answer is read one check late (`RowEnds`), so
# the steps queued in between keep the GPU busy while the host waits for it; up to twice this many steps are decoded
# past the last row's end in exchange (and cut from the result).
CHECK_EVERY = 4


def check_every(device: torch.device) -> int:
    """Steps between "have all rows ended?" checks: every step on CPU, where a read waits for nothing."""
    return 1 if device.type == "cpu" else CHECK_EVERY


def late_reads(device: torch.device) -> bool:
    """Whether each check's answer is read at the next check: on a GPU, where reading it at once would wait for
    every step queued before it and leave the GPU idle while the host queues the next."""
    return device.type == "cuda"


class RowEnds:
    """Which rows of a decode loop have sampled a stop token, kept on the device (the step a row ended at is read
    from the tokens afterwards: `ended_width`). `finished(t)` asks only every `check_every` steps (or at the last
    step), on a GPU reading the answer of the check before (`HostRead`)."""

    def __init__(self, rows: int, steps: int, device: torch.device):
        self.steps, self.every, self.late = steps, check_every(device), late_reads(device)
        self.done = torch.zeros(rows, dtype=torch.bool, device=device)
        self.asked: HostRead | None = None

    def record(self, token: torch.Tensor, stops: torch.Tensor | None) -> None:
        if stops is not None:
            self.done |= torch.isin(token, stops)

    def finished(self, t: int) -> bool:
        if t + 1 == self.steps:
            return True
        if (t + 1) % self.every:
            return False
        ask = HostRead(self.done.all())
        if not self.late:
            return bool(ask.get())
        answer, self.asked = self.asked, ask
        return answer is not None and bool(answer.get())


def decode_static(
    model,
    ids: torch.Tensor,
    mask: torch.Tensor,
    sampling: SamplingParams,
    stops: torch.Tensor | None,
    pad: int,
    generator: torch.Generator | None = None,
    n: int = 1,
    step: FixedShapeStep | None = None,
    logprobs: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`decode` with a KV cache of fixed size (prompt + `max_new_tokens` positions, transformers' StaticCache, its
    layers writing at positions worked out once a step: `static_cache`) and
    every decode step the same shapes: a (rows, 1) token, the full-length attention mask (future positions 0 until
    written) and the cache position as a tensor. Nothing is re-allocated per token, and "have all rows ended?" is
    asked every `CHECK_EVERY` steps on a GPU and read a check late (`RowEnds`), so the GPU is not held up by the
    host between steps. Same tokens as `decode` (tested). Each prompt is prefilled once and its keys and values
    written into the rows of its `n` samples (models with sliding-window layers prefill each sample's row). With
    `step` (`alignpipe.engine.decode_steps`) each decode step is replayed (a CUDA graph, compiled or not), prompts
    left-padded to the step's width so that a few shapes serve every rollout."""
    extra = step.width(ids.size(1)) - ids.size(1) if step is not None else 0
    if extra:  # left padding: masked, positions unchanged
        ids = torch.cat([ids.new_full((ids.size(0), extra), pad), ids], dim=1)
        mask = torch.cat([mask.new_zeros((mask.size(0), extra)), mask], dim=1)
    shared = n > 1 and not _sliding(model)
    if n > 1 and not shared:
        ids, mask = ids.repeat_interleave(n, 0), mask.repeat_interleave(n, 0)
    width = ids.size(1)
    rows = ids.size(0) * (n if shared else 1)
    steps = sampling.max_new_tokens
    length = aligned(width + steps)  # the positions past the last step stay masked
    cache = step.cache(model, rows, length) if step is not None else new_cache(model, length)
    position = mask_positions(mask)
    seen_of = (ids, mask, rows // ids.size(0))  # the prompts, shared by their samples or already one row each
    if shared:
        logits = _prefill_once(model, ids, mask, position, cache, n)
        mask, position = mask.repeat_interleave(n, 0), position.repeat_interleave(n, 0)
    full_mask = torch.cat([mask, mask.new_zeros((rows, length - width))], dim=1)
    if not shared:
        logits = model(
            input_ids=ids,
            attention_mask=full_mask,
            position_ids=position,
            past_key_values=cache,
            cache_position=torch.arange(width, device=ids.device),
            use_cache=True,
            logits_to_keep=1,
        ).logits[:, -1]
    step_mask, attend = full_mask, 1.0  # what a step is given; what marks a cache entry it attends to
    if _takes_padding_mask(model):  # ready for SDPA: the steps build no mask (which reads the device)
        step_mask, attend = attention_bias(full_mask, model.get_input_embeddings().weight.dtype), 0.0
    keys = step_mask.view(rows, length)  # which cache entries the next step attends to
    seen = SeenTokens.of(*seen_of, logits.shape[-1], sampling)
    out = Sampled(rows, sampling, pad, ids.device, generator, logprobs, stops, seen)
    # every step is handed the same tensors, advanced in place: a replayed step reads them where they lie
    pos = position[:, -1:] + 1
    cache_position = torch.full((1,), width, dtype=torch.long, device=ids.device)
    for t in range(steps):
        token = out.add(logits, t)
        if out.ends.finished(t):
            return out.result()
        keys[:, width + t] = attend
        logits = (step or decode_step)(model, token, step_mask, pos, cache, cache_position)
        pos += 1
        cache_position += 1
    return out.result()


def prefill(model, ids, mask, position):
    """Left-padded prompt rows through the model into a new dynamic KV cache: (next-token logits (rows, V), cache)."""
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    out = model(
        input_ids=ids,
        attention_mask=mask,
        position_ids=position,
        past_key_values=cache,
        use_cache=True,
        logits_to_keep=1,
    )
    return out.logits[:, -1], cache


def _prefill_once(model, ids, mask, position, cache, n: int) -> torch.Tensor:
    """Run each prompt row once and write its keys and values into `cache` (a static cache of `n` × the rows) for
    each of its `n` samples, a prompt's rows adjacent: the next-token logits, (rows × n, V). The prompt's share of
    the prefill is paid once, not `n` times (GRPO's 8 or 16 samples per prompt)."""
    logits, once = prefill(model, ids, mask, position)
    layers: list[Any] = once.layers  # dense layers here (`_sliding` models prefill each sample's row)
    for index, layer in enumerate(layers):
        cache.update(layer.keys.repeat_interleave(n, 0), layer.values.repeat_interleave(n, 0), index)
    return logits.repeat_interleave(n, 0)


MASK_ALIGNMENT = 8
"""A static cache's length is a multiple of this: SDPA's memory-efficient kernel takes an attention bias whose rows
start at multiples of 8 elements as it is, and copies any other into a padded one at every call (every layer of
every decode step)."""


def aligned(length: int) -> int:
    """`length` rounded up to a multiple of `MASK_ALIGNMENT`."""
    return -(-length // MASK_ALIGNMENT) * MASK_ALIGNMENT


def attention_bias(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A (rows, keys) 0/1 mask as the (rows, 1, 1, keys) additive bias SDPA adds to the scores: 0 where attended,
    the dtype's lowest value elsewhere. Given a boolean mask instead, SDPA converts it at every call (a fill and a
    `where`: two kernels per layer per decode step)."""
    bias = torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(mask == 0, torch.finfo(dtype).min)
    return bias[:, None, None, :]


def _sliding(model) -> bool:
    """Whether some of the model's layers attend within a sliding window (their caches keep the window only)."""
    config = model.config
    return "sliding_attention" in (getattr(config, "layer_types", None) or []) or bool(
        getattr(config, "sliding_window", None) and getattr(config, "use_sliding_window", True)
    )


def _takes_padding_mask(model) -> bool:
    """Whether a one-token decode step can be given a ready 4-D boolean mask (transformers passes 4-D masks
    through as they are): SDPA attention, or our `varlen`, which hands masked calls to SDPA, and no sliding-window
    layers, whose own masks would be skipped."""
    config = model.config
    return getattr(config, "_attn_implementation", None) in ("sdpa", "varlen") and "sliding_attention" not in (
        getattr(config, "layer_types", None) or []
    )


class SeenTokens:
    """For `repetition_penalty`: which tokens each row has seen, its prompt's (real tokens only, as vLLM counts them;
    transformers counts left padding too) and its completion's so far. A seen token's logit is divided by the
    penalty when positive and multiplied by it otherwise (the rule of transformers and vLLM), before temperature and
    the filters. Kept on the device as a (rows, V) bool, updated by each sampled token: no host read."""

    def __init__(self, ids: torch.Tensor, mask: torch.Tensor, repeat: int, vocab: int, penalty: float):
        counts = torch.zeros(ids.size(0), vocab, dtype=torch.int32, device=ids.device)
        counts.scatter_add_(1, ids, mask.to(torch.int32))
        self.seen = (counts > 0).repeat_interleave(repeat, 0)
        self.penalty = penalty

    @classmethod
    def of(cls, ids, mask, repeat: int, vocab: int, sampling: SamplingParams) -> SeenTokens | None:
        """None where the penalty is 1 (off): nothing is kept."""
        if sampling.repetition_penalty == 1.0:
            return None
        return cls(ids, mask, repeat, vocab, sampling.repetition_penalty)

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        penalised = torch.where(logits > 0, logits / self.penalty, logits * self.penalty)
        return torch.where(self.seen, penalised, logits)

    def add(self, token: torch.Tensor) -> None:
        self.seen.scatter_(1, token[:, None], True)


def next_token(
    logits: torch.Tensor, sampling: SamplingParams, generator: torch.Generator | None = None, logprob: bool = False
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One token per row: argmax when greedy, else a sample from `filter_logits`; with `logprob`, also each token's
    log-probability under the distribution it was drawn from (after temperature and the filters, as vLLM's
    "processed" logprobs; greedy: the model's own). The sample is the same either way."""
    if sampling.greedy:
        token = logits.argmax(-1)
        return token, (logits.float().log_softmax(-1).gather(-1, token[:, None]).squeeze(-1) if logprob else None)
    filters = sampling.temperature != 1.0 or sampling.top_k or sampling.top_p < 1.0 or sampling.min_p
    # unfiltered (GRPO's usual setting): the softmax reads the logits in their dtype and computes in float32, one
    # kernel where a cast and a softmax would be two passes over (rows × V)
    probs = (filter_logits(logits, sampling) if filters else logits).softmax(-1, dtype=torch.float32)
    token = sample(probs, generator)
    # float32 probabilities: a drawn token's is far above the smallest normal, so its log loses nothing that matters
    return token, (probs.gather(-1, token[:, None]).squeeze(-1).log() if logprob else None)


@functools.cache
def _zero(device: torch.device) -> torch.Tensor:
    """A 0-dim zero on `device`, made once: an operand that costs no kernel a token."""
    return torch.zeros((), device=device)


def sample(probs: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """One draw per row from `probs` (rows, V) by inverting the CDF: one uniform per row where
    `torch.multinomial` draws an exponential per vocabulary entry (7% of a small model's decode step on CPU).
    Zero-probability tokens are never drawn: the draw is the first entry whose cumulative sum exceeds a uniform
    strictly below the total, and a sum that rises has a probability above 0 there."""
    cdf = probs.cumsum(-1, dtype=torch.float32)
    total = cdf[:, -1:]
    u = torch.rand(probs.shape[0], 1, generator=generator, device=probs.device) * total
    # a uniform just under 1 times the total can round up onto it (p ≈ 1e-7), past the last nonzero entry
    u = torch.minimum(u, total.nextafter(_zero(total.device)))
    return torch.searchsorted(cdf, u, right=True).squeeze(-1)


def filter_logits(logits: torch.Tensor, sampling: SamplingParams) -> torch.Tensor:
    """Temperature, then top-k, top-p and min-p (the order and rules of transformers' warpers; tested
    against them): filtered-out tokens get -inf."""
    logits = logits.float()
    if sampling.temperature != 1.0:  # a pass over (rows × V) float32 less per token at the usual rollout setting
        logits = logits / sampling.temperature
    if sampling.top_k and sampling.top_k < logits.shape[-1]:
        kth = torch.topk(logits, sampling.top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if sampling.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True, dim=-1)
        probs = sorted_logits.softmax(-1)
        drop = probs.cumsum(-1) - probs >= sampling.top_p  # keep the smallest set reaching top_p
        logits = logits.masked_fill(torch.zeros_like(drop).scatter(-1, order, drop), float("-inf"))
    if sampling.min_p:
        probs = logits.softmax(-1)
        logits = logits.masked_fill(probs < sampling.min_p * probs.max(-1, keepdim=True).values, float("-inf"))
    return logits
