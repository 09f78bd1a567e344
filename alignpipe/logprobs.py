"""Log-probabilities of tokens under a model: the model-forward plumbing every trainer shares.

The decoder runs once per call; the LM head and the float32 log-softmax run only where they are needed (from a
start position, on masked positions) and in chunks when the full-vocabulary logits would be large, under
activation checkpointing when gradients are on. Prompts shared by several completions (GRPO's groups, DPO's
chosen/rejected pairs) can run once, their KV cache gathered to each completion. Also the exact KL of two
models' next-token distributions from their hidden states (PPO's `kl_penalty: full`).

Shapes: B = batch, T = sequence length, V = vocabulary, d = hidden size.
"""

from __future__ import annotations

import functools
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from alignpipe import fused_kernels, triton_kernels
from alignpipe.attention import documents_mask
from alignpipe.compiled import chunk_bounds, compiled_function
from alignpipe.linear_ce import linear_nll_sum
from alignpipe.modeling import is_activation_checkpointing, mask_positions


def _chunk_logprobs(
    hidden: torch.Tensor,
    head_weight: torch.Tensor,
    head_bias,
    labels: torch.Tensor,
    temperature: float,
    second: str | None = "entropy",
):
    """A chunk's token log-probs and its `second` statistic per position (`_second_statistic`), or a 0 for none."""
    logp = _scaled_log_softmax(hidden, (head_weight, head_bias), temperature)
    token = logp.gather(-1, labels.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    if second is None:
        return token, token.new_zeros(())
    return token, _second_statistic(logp, second)


def _chunk_logprobs_by_hand(
    hidden, head_weight, head_bias, labels, temperature: float, second: str | None, keep_logits: bool = False
):
    """`_chunk_logprobs` on `triton_kernels`' head kernels: the log-softmax, gather and `second` statistic as one
    read of the head's logits (`token_scores`), and, where gradients are on, their backward as `_HandScored`'s
    (`keep_logits`: the logits kept for it rather than formed again)."""
    h = hidden.to(head_weight.dtype)
    token, statistic = _HandScored.apply(
        h, head_weight, head_bias, labels.clamp(min=0).flatten(), temperature, second, keep_logits
    )
    return token.view(labels.shape), statistic.view(labels.shape) if second else statistic


class _HandScored(torch.autograd.Function):
    """A chunk's label log-probs at a temperature (and its second statistic: entropies, or WPO's log Σp², which has
    no gradient here) from the head's matmul and `token_scores`, keeping for backward the chunk's hidden states,
    log-sum-exps and statistic: backward forms the logits again (one head matmul; with `keep_logits`, where the head
    runs in one piece of at most WHOLE_LOGITS_MAX logits, they are kept instead, in their dtype) and their gradient
    in one pass (`token_grads`, with coefficients = the log-probs' and the entropies' upstream gradients /
    temperature). Activation checkpointing of the eager chunk (`_chunk_logprobs`) keeps as little but recomputes its
    float32 log-softmax and entropy, and its backward makes several float32 passes over the chunk's logits where
    this makes one read and one write in their dtype."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, labels, temperature: float, second: str | None, keep_logits: bool):
        # the matmul on the chunk as it comes (a strided slice of positions), as the eager chunk's: the same logits
        logits = F.linear(hidden, weight, bias).flatten(0, -2)
        lse, token, *statistic = triton_kernels.token_scores(logits, labels, temperature, second)
        spread = statistic[0] if second else token.new_zeros(())
        kept = logits if keep_logits else None
        ctx.save_for_backward(hidden, weight, bias, labels, lse, spread, kept)
        ctx.temperature = temperature
        if second != "entropy":
            ctx.mark_non_differentiable(spread)
        ctx.set_materialize_grads(False)  # a detached entropy's upstream gradient is None, not a tensor of zeros
        return token, spread

    @staticmethod
    def backward(ctx, grad_token, grad_spread):
        hidden, weight, bias, labels, lse, spread, kept = ctx.saved_tensors
        want_h, want_w, want_b = ctx.needs_input_grad[:3]
        t = ctx.temperature
        logits = kept if kept is not None else F.linear(hidden, weight, bias).flatten(0, -2)
        coef = (grad_token.float() / t).contiguous() if grad_token is not None else torch.zeros_like(lse)
        # an entropy that reaches the loss (a bonus) adds its gradient
        with_spread = (spread, (grad_spread.float() / t).contiguous()) if grad_spread is not None else None
        grad = triton_kernels.token_grads(logits, lse, labels, coef, t, with_spread)
        return (
            (grad @ weight).view(hidden.shape) if want_h else None,
            grad.t() @ hidden.flatten(0, -2) if want_w else None,
            grad.float().sum(0).to(bias.dtype) if want_b else None,
            None,
            None,
            None,
            None,
        )


def _second_statistic(logp: torch.Tensor, second: str) -> torch.Tensor:
    """From a chunk's log-softmax: the entropy −Σ p log p, or (`log_sum_sq`) log Σ p², WPO's weights' term."""
    if second == "log_sum_sq":
        return torch.logsumexp(2 * logp, -1)
    return -(logp.exp() * logp).sum(-1)


def _second(with_entropy: WithEntropy) -> str | None:
    """Which second statistic a `with_entropy` value asks for."""
    if not with_entropy:
        return None
    return "log_sum_sq" if with_entropy == "log_sum_sq" else "entropy"


WithEntropy = bool | Literal["grad", "log_sum_sq"]
"""Whether log-prob functions also return a second statistic per position: the entropy, detached (True) or with its
gradient ("grad"); or, detached, log Σ_v p_v² ("log_sum_sq": DPO's WPO weights)."""

# Below this many logit values (rows × V) the head runs in one piece without recomputation: chunking and
# checkpointing only pay off when the float32 logits would be large (256 MB here). It is also the budget of
# one chunk, so a 150k vocabulary gets chunks of ~440 positions, a 512 one chunks of `chunk_tokens`.
WHOLE_LOGITS_MAX = 64 * 2**20

# SFT's fused head with its compiled chunk kernel (`compiled`) takes chunks this many times larger: the kernel keeps
# no float32 copy of a chunk's logits, only the logits and their gradient in bf16, and every chunk reads the head's
# weight twice and reads and writes its gradient once (~1.1 GB at Qwen2-0.5B's 151,936 × 896). At 16k tokens that is
# 19 chunks instead of 37, ~20 GB less traffic per step (~6 ms of an H100's) for ~270 MB more at the memory peak.
FUSED_CHUNK_GROWTH = 2


def token_logprobs(
    model,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None,
    temperature: float = 1.0,
    chunk_tokens: int = 4096,
    with_entropy: WithEntropy = False,
    start: int = 0,
    only: torch.Tensor | None = None,
    position_ids: torch.Tensor | None = None,
    compiled: bool = False,
    count: int | None = None,
):
    """Log-probability of each next token, (B, T-1-start), without materialising (B, T, V) logits at once.

    The decoder runs once; the LM head + log-softmax run only where they are needed: from position `start`
    on (a completion after a prompt of `start + 1` tokens), and, with `only` (a (B, T-1-start) mask), only at
    its true positions (completion tokens of padded rows; elsewhere the result is 0). When the logits would be
    large (> WHOLE_LOGITS_MAX values) they run over chunks of at most `chunk_tokens` positions and
    WHOLE_LOGITS_MAX values (a last position alone joins the chunk before it: `chunk_bounds`), each under
    activation checkpointing when gradients are on, so peak memory holds one chunk of logits; small ones are
    computed in one piece.
    Packed rows: give `position_ids` restarting at every row and no `attention_mask`; the model then attends
    within each row only.
    `compiled` (a stage's `compile: true`, or `fused_kernels` on a GPU): each chunk of the head after its matmul
    runs on `triton_kernels`' hand-written head kernels where Triton runs them (`_HandScored`: one read of the
    logits forward, one read and one write in backward, no checkpointing), otherwise compiled
    (`compiled.compiled_function`): with gradients on, its forward and backward; without, its log-softmax and
    gather as one kernel. `count`: the number of
    true positions in `only`, where the caller knows it on the host (no wait for the device to count them).
    Returns `logps` (and `entropy` when `with_entropy`: detached, or with its gradient for `with_entropy="grad"`, an
    entropy bonus's). Position t scores input_ids[:, start+t+1].
    """
    labels = input_ids[:, start + 1 :]
    position_ids = _positions(attention_mask, position_ids)
    hidden, head = _hidden_and_head(model, input_ids, attention_mask, position_ids)
    return _scored_logprobs(
        None if hidden is None else hidden[:, start:-1],
        head,
        lambda: _logits_inside_forward(model, input_ids, attention_mask, position_ids)[:, start:-1],
        labels,
        only,
        count,
        (temperature, chunk_tokens, with_entropy, compiled),
    )


def _scored_logprobs(hidden, head, inside_forward, labels, only, count, options: tuple):
    """Log-probs (and entropies) of `labels` from the final `hidden` states through the LM `head`, chunk by chunk; or,
    where `hidden` is None (`RESHARDS_HEAD`), from the logits `inside_forward()` gets from the model's own forward.
    On `only`'s positions alone where given (`_select`). `options`: (temperature, chunk_tokens, with_entropy,
    compiled) as in `token_logprobs`."""
    temperature, chunk_tokens, with_entropy, compiled = options
    if hidden is None:
        return _select(
            inside_forward(),
            labels,
            only,
            lambda x, y: _logprobs_from_logits(x, y, temperature, chunk_tokens, with_entropy),
            with_entropy,
            count,
        )
    weight, bias = head.weight, getattr(head, "bias", None)
    return _select(
        hidden,
        labels,
        only,
        lambda x, y: _head_logprobs(x, weight, bias, y, temperature, chunk_tokens, with_entropy, compiled),
        with_entropy,
        count,
    )


def token_nll_sum(
    model,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None,
    only: torch.Tensor,
    position_ids: torch.Tensor | None = None,
    count: int | None = None,
    compiled: bool = False,
    documents: dict[str, Any] | None = None,
    dft: bool = False,
) -> torch.Tensor:
    """Σ −log p(input_ids[:, t+1]) over the positions t where `only` (B, T−1) is true: SFT's summed cross-entropy,
    −token_logprobs(...)[only].sum() in value and gradient. The LM head runs on those positions alone, in chunks
    with its gradients computed in the forward (`linear_ce.linear_nll_sum`): no logits kept for backward and no
    second head forward. `count`, the number of true positions when the caller knows it on the host, lets them be
    gathered without a device read (a boolean index waits for the device to count them). `compiled`: each chunk's
    softmax and gradient as one compiled kernel (`linear_ce.linear_nll_sum`'s `compiled`). `documents`: packed
    rows' document offsets counted on the host (`cu_seq_lens_q`/`_k`, `max_length_q`/`_k`), handed to every
    attention call (`attention.varlen_attention_forward`, flash-attn's). `dft`: each token's term weighted by its
    probability, held constant (`linear_ce.linear_nll_sum`). Other inputs as `token_logprobs`'s."""
    position_ids = _positions(attention_mask, position_ids)
    hidden, head = _hidden_and_head(model, input_ids, attention_mask, position_ids, documents)
    if hidden is None:
        logps = token_logprobs(model, input_ids, attention_mask, only=only, position_ids=position_ids)
        return -(logps * logps.detach().exp()).sum() if dft else -logps.sum()
    index = scored_index(only, count)
    weight = head.weight
    return linear_nll_sum(
        hidden[:, :-1].flatten(0, 1).index_select(0, index),
        weight,
        getattr(head, "bias", None),
        input_ids[:, 1:].flatten().index_select(0, index),
        WHOLE_LOGITS_MAX * (FUSED_CHUNK_GROWTH if compiled else 1) // weight.size(0),
        compiled,
        dft,
    )


def _positions(attention_mask: torch.Tensor | None, position_ids: torch.Tensor | None) -> torch.Tensor:
    """The given position ids (packed rows), or the mask's (`mask_positions`)."""
    if position_ids is not None:
        return position_ids
    if attention_mask is None:
        raise ValueError("token_logprobs needs an attention_mask or position_ids")
    return mask_positions(attention_mask)


def _hidden_and_head(model, input_ids, attention_mask, position_ids, documents: dict[str, Any] | None = None):
    """The decoder's final hidden states (B, T, d) and the LM head module, for a plain, peft, DDP or FSDP causal LM
    (positions from `_positions`; `documents` as `token_nll_sum`'s). (None, None) where the head can only run
    inside the model's forward (`RESHARDS_HEAD`)."""
    extra = documents or {}
    if documents:
        attention_mask = documents_mask(model, attention_mask, input_ids.device)
    base = unwrapped(model)
    if base is not None:
        body, head = _decoder_and_head(base)
        hidden = body(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False, **extra
        ).last_hidden_state
        return hidden, head
    if getattr(model, RESHARDS_HEAD, False):
        return None, None
    return _hidden_through_wrapper(model, input_ids, attention_mask, position_ids, extra)


def _logits_inside_forward(model, input_ids, attention_mask, position_ids):
    """Full logits from the model's own forward: for an FSDP layout that re-shards the LM head right after the
    forward (a user's accelerate config), where the head's weight exists whole only inside it. The float32
    log-softmax is still taken chunk by chunk by the caller."""
    return model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False).logits


# Set on an FSDP model whose LM head is a shard again after the forward (see `_hidden_through_wrapper`).
RESHARDS_HEAD = "_alignpipe_reshards_head"


def _hidden_through_wrapper(model, input_ids, attention_mask, position_ids, extra: dict[str, Any]):
    """The final hidden states (B, T, d) of a DDP- or FSDP-wrapped causal LM, and its LM head. The wrapper's own
    forward runs (DDP readies its gradient all-reduce there, FSDP gathers and frees the shards) with the head cut to
    one position (`logits_to_keep=1`); the decoder's output is taken by a hook, and the caller runs the head chunk
    by chunk on it: no (B, T, V) logits.

    DDP: the head's weight is an ordinary parameter of the wrapped module, so its gradient is all-reduced like any
    other. FSDP2: the head (with the final norm, accelerate's tail group, or in the root group) is not re-sharded
    after the forward, since backward needs it at once; its weight is then the gathered parameter, whose gradient
    FSDP reduce-scatters after backward as if the head had run inside the forward. Where a layout does re-shard it
    (the weight is a shard again), the hidden states are None, the model is marked `RESHARDS_HEAD`, and the
    caller runs the head inside the forward from then on."""
    from torch.distributed.tensor import DTensor

    inner = model.module if isinstance(model, torch.nn.parallel.DistributedDataParallel) else model
    inner = inner.get_base_model() if hasattr(inner, "get_base_model") else inner
    body, head = _decoder_and_head(inner)
    captured: dict[str, torch.Tensor] = {}
    handle = body.register_forward_hook(lambda _m, _a, out: captured.__setitem__("hidden", out[0]))
    try:
        model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            use_cache=False,
            logits_to_keep=1,
            **extra,
        )
    finally:
        handle.remove()
    if isinstance(head.weight, DTensor):
        setattr(model, RESHARDS_HEAD, True)  # seen once: later calls run the head inside the forward directly
        return None, None
    return captured["hidden"], head


def output_vocab(model) -> int | None:
    """The LM head's output size (the vocabulary) of a plain, peft, DDP or FSDP causal LM; None without a head."""
    inner = model.module if isinstance(model, torch.nn.parallel.DistributedDataParallel) else model
    inner = inner.get_base_model() if hasattr(inner, "get_base_model") else inner
    head = inner.get_output_embeddings() if hasattr(inner, "get_output_embeddings") else None
    return None if head is None else int(head.weight.shape[0])


def unwrapped(model):
    """The model whose modules the chunked-head and shared-prefix paths call directly: a peft model's base model,
    or the model itself; None under DDP, whose own forward must run for gradients to be synchronised, and under
    FSDP, whose root forward gathers the embedding, final norm and LM head."""
    from torch.distributed.fsdp import FSDPModule

    if isinstance(model, torch.nn.parallel.DistributedDataParallel | FSDPModule):
        return None
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def _decoder_and_head(base):
    """The decoder stack and the LM head of an `unwrapped` causal LM."""
    body = base.get_decoder() if hasattr(base, "get_decoder") else base.model
    return body, base.get_output_embeddings()


# Sharing a prefix costs one more decoder call: a fixed ~1–3 ms of operator dispatch on CPU that only pays off when
# the prompt work it saves is larger. Below this many saved token × parameter products (~1 GFLOP of forward), whole
# rows run faster: DPO on the 1.7M-parameter bench model saves 8 pairs × ~12 prompt tokens, 1.6e8, and ran 1.73×
# TRL whole against 1.27× shared; the 20M model's 1.9e9 gains 18%.
SHARE_MIN_SAVED = 2**29


# On a GPU the saved prompt tokens cost microseconds of device time while the shared path costs host time: DPO on the
# Qwen2-0.5B bench shape (8 pairs × ~12 prompt tokens, 4.7e10) ran at 15–16 steady samples/s shared against 31–32
# whole (H100, ~280 ms more per step than two more decoder calls' launches explain: the cache gather and the
# prefix + suffix mask take slower attention paths). Only short prompts were measured there, so this floor
# (2**38 ≈ 2.7e11, prompts of hundreds of tokens, ~0.5 TFLOP of forward + backward saved) is an estimate.
GPU_SHARE_MIN_SAVED = 2**38


def worth_sharing(model, saved_tokens: int) -> bool:
    """Whether running `saved_tokens` fewer prefix tokens outweighs the extra decoder call (`SHARE_MIN_SAVED`,
    `GPU_SHARE_MIN_SAVED` for a model on a GPU)."""
    params = list(model.parameters())
    floor = GPU_SHARE_MIN_SAVED if params and params[0].device.type == "cuda" else SHARE_MIN_SAVED
    return saved_tokens * sum(p.numel() for p in params) >= floor


def every_row_holds_a_token(mask: torch.Tensor) -> bool:
    """Whether each row of a (B, T) mask marks a token (a read when the mask is on a GPU)."""
    return bool(mask.bool().any(1).all())


def can_share_prefix(base, prefix_mask: torch.Tensor, saved_tokens: int, nonempty: bool | None = None) -> bool:
    """Whether `shared_prefix_hidden` can serve `base` (`unwrapped(model)`, None under DDP): the saving pays
    (`worth_sharing`), no activation checkpointing (it drops the KV cache), and every prefix holds a token:
    `nonempty` where the caller counted that on the host (a collate function), else read from the mask (on a GPU,
    a wait for the device). The checks run cheapest first."""
    return (
        base is not None
        and prefix_mask.size(1) > 0
        and worth_sharing(base, saved_tokens)
        and not is_activation_checkpointing(base)
        and (nonempty if nonempty is not None else every_row_holds_a_token(prefix_mask))
    )


def shared_prompt_logprobs(
    model,
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    completion_ids: torch.Tensor,
    index: torch.Tensor,
    temperature: float = 1.0,
    chunk_tokens: int = 4096,
    with_entropy: WithEntropy = False,
    only: torch.Tensor | None = None,
    prompts_nonempty: bool | None = None,
    compiled: bool = False,
    count: int | None = None,
    packed: dict[str, Any] | None = None,
):
    """Log-probs of completion tokens, (R, C), for R completions where completion row r follows the (left-padded)
    prompt row `index[r]` of `prompt_ids` (N, P): GRPO's groups of samples of one prompt, DPO's chosen and
    rejected answers to one prompt. Position t scores completion token t (the prompt's last token scores token 0).

    The decoder runs over each prompt once; its KV cache is gathered to the completion rows (differentiably: a
    prompt's gradient is the sum over its completions) and only the completions run per row: R·P − N·P fewer
    tokens in the forward and backward than running every prompt + completion row whole, with the same values
    and gradients. Completion padding goes at the end of a row (causality keeps it out of real tokens); `only`
    (R, C) limits the LM head to the real completion tokens (zeros elsewhere). Falls back to whole rows where a
    cache cannot carry gradients (DDP's forward, activation checkpointing), a prompt is empty, or the model is too
    small for the saving to outweigh one more decoder call (`worth_sharing`). `prompts_nonempty`: whether every
    prompt holds a token, where the caller knows it on the host (`can_share_prefix`). `compiled` and `count` as in
    `token_logprobs`. `packed`: the same rows padding-free (`packed_rows.pack_answers`), run as one row of documents
    instead (`completion_hidden`)."""
    hidden, head = completion_hidden(model, prompt_ids, prompt_mask, completion_ids, index, prompts_nonempty, packed)

    def inside_forward():
        ids, mask, start = _whole_rows(prompt_ids, prompt_mask, completion_ids, index)
        return _logits_inside_forward(model, ids, mask, mask_positions(mask))[:, start:-1]

    options = (temperature, chunk_tokens, with_entropy, compiled)
    return _scored_logprobs(hidden, head, inside_forward, completion_ids, only, count, options)


def completion_hidden(
    model,
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    completion_ids: torch.Tensor,
    index: torch.Tensor,
    prompts_nonempty: bool | None = None,
    packed: dict[str, Any] | None = None,
):
    """The final hidden states that score each completion token, (R, C, d) (the prompt's last position scores
    token 0), and the LM head module, for `shared_prompt_logprobs`'s layout: with `packed` (the rows as
    `packed_rows.pack_answers` lays them out, for a model that runs that layout) the rows as one row of documents,
    each prompt once where the layout shares it; else each prompt once where `can_share_prefix` allows, else every
    prompt + completion row whole, padded. (None, None) where the head can only run inside the model's forward
    (`RESHARDS_HEAD`)."""
    if packed is not None:
        hidden, head = _hidden_and_head(model, packed["input_ids"], None, packed["position_ids"], packed["documents"])
        if hidden is None:
            return None, None
        scoring = packed["scoring"]
        return hidden[0].index_select(0, scoring.flatten()).view(*scoring.shape, -1), head
    R, C = completion_ids.shape
    P = prompt_ids.size(1)
    base = unwrapped(model)
    if C == 0 or not can_share_prefix(base, prompt_mask, (R - prompt_ids.size(0)) * P, prompts_nonempty):
        ids, mask, start = _whole_rows(prompt_ids, prompt_mask, completion_ids, index)
        hidden, head = _hidden_and_head(model, ids, mask, mask_positions(mask))
        return (None, None) if hidden is None else (hidden[:, start:-1], head)
    body, head = _decoder_and_head(base)
    prompt_last, c_hidden = shared_prefix_hidden(body, base.config, prompt_ids, prompt_mask, completion_ids, index)
    return torch.cat([prompt_last, c_hidden[:, :-1]], 1), head


def _whole_rows(prompt_ids, prompt_mask, completion_ids, index):
    """(ids, mask, start) of every prompt + completion row whole; position `start + t` scores completion token t.
    An empty prompt gets one padding position in front: nothing scores the first token, as for an unscored one."""
    P = prompt_ids.size(1)
    ids = torch.cat([prompt_ids[index], completion_ids], 1)
    mask = torch.cat([prompt_mask[index], torch.ones_like(completion_ids)], 1)
    if P == 0:
        ids, mask = F.pad(ids, (1, 0)), F.pad(mask, (1, 0))
    return ids, mask, max(P, 1) - 1


def shared_prefix_hidden(
    body, config, prefix_ids: torch.Tensor, prefix_mask: torch.Tensor, suffix_ids: torch.Tensor, index: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Run a decoder stack over N left-padded prefixes (N, P) once, gather their KV cache to R rows (`index`, (R,)),
    and run the right-padded suffixes (R, C) after them. Returns the last prefix position's hidden state per row
    (R, 1, d) and the suffixes' hidden states (R, C, d), as running each prefix + suffix row whole would give them.
    Every prefix must hold at least one token."""
    from transformers import DynamicCache

    position = mask_positions(prefix_mask)
    cache = DynamicCache(config=config)
    prefix_out = body(
        input_ids=prefix_ids, attention_mask=prefix_mask, position_ids=position, past_key_values=cache, use_cache=True
    ).last_hidden_state
    cache.batch_select_indices(index)  # differentiable gather: the suffixes' gradients reach the prefix pass
    s_position = position[index, -1:] + 1 + torch.arange(suffix_ids.size(1), device=position.device)
    mask = torch.cat([prefix_mask[index], torch.ones_like(suffix_ids)], 1)
    s_hidden = body(
        input_ids=suffix_ids, attention_mask=mask, position_ids=s_position, past_key_values=cache, use_cache=True
    ).last_hidden_state
    return prefix_out[index, -1:], s_hidden


def scored_index(only: torch.Tensor, count: int | None) -> torch.Tensor:
    """Flat indices of the true positions of the mask `only`; with `count`, their number known on the host, found
    without waiting for the device to count them (as `nonzero` and a boolean index must)."""
    flat = only.flatten()
    return (flat.nonzero() if count is None else flat.nonzero_static(size=count)).squeeze(1)


def _select(rows: torch.Tensor, labels: torch.Tensor, only, fn, with_entropy: WithEntropy, count: int | None = None):
    """`fn(rows, labels)` everywhere, or (with the mask `only`) on the masked positions alone, scattered back
    into zeros of the full shape (`count` as in `scored_index`)."""
    if only is None:
        return fn(rows, labels)
    index = scored_index(only, count)
    out = fn(rows.flatten(0, 1).index_select(0, index).unsqueeze(0), labels.flatten().index_select(0, index)[None])

    def scatter(values: torch.Tensor) -> torch.Tensor:
        zeros = torch.zeros(labels.numel(), dtype=values.dtype, device=values.device)
        return zeros.index_copy(0, index, values[0]).view(labels.shape)

    if not with_entropy:
        return scatter(out)
    lp, ent = out
    return scatter(lp), scatter(ent)


def _head_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias,
    labels: torch.Tensor,
    temperature: float,
    chunk_tokens: int,
    with_entropy: WithEntropy,
    compiled: bool = False,
):
    B, T, _ = hidden.shape
    V = weight.shape[0]
    if not torch.is_grad_enabled():  # dynamo guards requires_grad: the policy's head and a frozen one, one graph
        weight, bias = weight.detach(), bias.detach() if bias is not None else None
    # compiled: the hand-written head kernels where Triton runs them, with gradients or without; otherwise the chunk
    # compiled, forward and backward with gradients, else one inference kernel after the head's matmul
    by_hand = compiled and fused_kernels.by_hand(hidden, weight, head=True)
    chunk_logprobs: Any
    if by_hand:
        chunk_logprobs = _chunk_logprobs_by_hand
    elif compiled:
        chunk_logprobs = compiled_function(_chunk_logprobs)
    else:
        chunk_logprobs = _chunk_logprobs
    if B * T * V <= WHOLE_LOGITS_MAX:
        whole = functools.partial(chunk_logprobs, keep_logits=True) if by_hand else chunk_logprobs
        lp, ent = whole(hidden, weight, bias, labels, temperature, _second(with_entropy))
        return (lp, _entropy_out(ent, with_entropy)) if with_entropy else lp
    step = max(1, min(chunk_tokens, WHOLE_LOGITS_MAX // V) // max(1, B))
    logps, entropies = [], []
    for s, e in chunk_bounds(T, step):
        args = (hidden[:, s:e], weight, bias, labels[:, s:e], temperature, _second(with_entropy))
        if torch.is_grad_enabled() and not by_hand:  # the hand-written chunk keeps no logits either
            lp, ent = checkpoint(chunk_logprobs, *args, use_reentrant=False)
        else:
            lp, ent = chunk_logprobs(*args)
        logps.append(lp)
        entropies.append(_entropy_out(ent, with_entropy))
    logp = torch.cat(logps, 1)
    return (logp, torch.cat(entropies, 1)) if with_entropy else logp


def _entropy_out(entropy: torch.Tensor, with_entropy: WithEntropy) -> torch.Tensor:
    """A chunk's entropies as returned: detached, unless an entropy bonus asked for their gradient."""
    return entropy if with_entropy == "grad" else entropy.detach()


def _logprobs_from_logits(logits, labels, temperature: float, chunk_tokens: int, with_entropy: WithEntropy):
    step = max(1, min(chunk_tokens, WHOLE_LOGITS_MAX // logits.size(-1)) // max(1, logits.size(0)))
    logps, entropies = [], []
    for s in range(0, logits.size(1), step):
        chunk = logits[:, s : s + step].float()
        if temperature != 1.0:
            chunk = chunk / temperature
        lp = chunk.log_softmax(-1)
        logps.append(lp.gather(-1, labels[:, s : s + step].clamp(min=0).unsqueeze(-1)).squeeze(-1))
        entropies.append(_entropy_out(_second_statistic(lp, _second(with_entropy) or "entropy"), with_entropy))
    logp = torch.cat(logps, 1)
    return (logp, torch.cat(entropies, 1)) if with_entropy else logp


def decoder_hidden(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, start: int = 0):
    """The decoder's hidden states at positions start … T−2 (those that score tokens start+1 … T−1) and the LM
    head's (weight, bias), for an unwrapped or peft causal LM (not under DDP). Returns (hidden, weight, bias)."""
    base = unwrapped(model)
    if base is None:
        raise ValueError("decoder_hidden needs the model itself, not its DDP wrapper")
    position_ids = mask_positions(attention_mask)
    body, head = _decoder_and_head(base)
    hidden = body(
        input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False
    ).last_hidden_state[:, start:-1]
    return hidden, head.weight, getattr(head, "bias", None)


def full_kl(
    hidden: torch.Tensor,
    head: tuple,
    ref_hidden: torch.Tensor,
    ref_head: tuple,
    labels: torch.Tensor,
    temperature: float = 1.0,
    chunk_tokens: int = 4096,
    compiled: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The exact per-position KL of the two next-token distributions, Σ_v π(v)(log π(v) − log π_ref(v)) at
    `temperature` (TRL 0.7's `kl_penalty: full`), with both sides' log-prob of `labels`, from the hidden states and
    (weight, bias) heads of `decoder_hidden`. Runs over chunks of positions within WHOLE_LOGITS_MAX values, so the
    two (B, T, V) float32 log-softmaxes are never held whole. `compiled` (the fused kernels' gate open): each chunk's
    two heads' logits are read once by `triton_kernels.token_kl` where `fused_kernels.by_hand` takes them (and
    `triton_kernels.kl_usable`), and the chunk is compiled otherwise. No gradient. Returns (logp, ref_logp, kl), each (B, T)."""
    B, T, _ = hidden.shape
    V = head[0].shape[0]
    step = max(1, min(chunk_tokens, WHOLE_LOGITS_MAX // V) // max(1, B))
    tensors = (hidden, head[0], ref_hidden, ref_head[0])
    if compiled and fused_kernels.by_hand(*tensors, head=True) and triton_kernels.kl_usable(hidden.device):
        chunk_kl = _chunk_kl_by_hand
    else:
        chunk_kl = compiled_function(_chunk_kl) if compiled else _chunk_kl
    (weight, bias), (ref_weight, ref_bias) = head, ref_head
    parts = []
    with torch.no_grad():
        for s in range(0, T, step):
            sl = slice(s, s + step)
            scored = (hidden[:, sl], weight, bias, ref_hidden[:, sl], ref_weight, ref_bias, labels[:, sl])
            parts.append(chunk_kl(*scored, temperature))
    logp, ref_logp, kl = (torch.cat(cols, 1) for cols in zip(*parts))
    return logp, ref_logp, kl


def logits_kl(
    logits: torch.Tensor, ref_logits: torch.Tensor, labels: torch.Tensor, temperature: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(the label's log-prob, the reference's, KL(π ‖ π_ref)) per position of two heads' logits at `temperature`, in
    float32: the eager expression that `triton_kernels.token_kl` computes in one read."""
    logp, ref_logp = _log_softmax_at(logits, temperature), _log_softmax_at(ref_logits, temperature)
    idx = labels.clamp(min=0).unsqueeze(-1)
    return (
        logp.gather(-1, idx).squeeze(-1),
        ref_logp.gather(-1, idx).squeeze(-1),
        (logp.exp() * (logp - ref_logp)).sum(-1),
    )


def _chunk_kl(hidden, weight, bias, ref_hidden, ref_weight, ref_bias, labels, temperature: float):
    return logits_kl(
        _head_logits(hidden, weight, bias), _head_logits(ref_hidden, ref_weight, ref_bias), labels, temperature
    )


def _chunk_kl_by_hand(hidden, weight, bias, ref_hidden, ref_weight, ref_bias, labels, temperature: float):
    logits = _head_logits(hidden, weight, bias).flatten(0, -2)
    ref_logits = _head_logits(ref_hidden, ref_weight, ref_bias).flatten(0, -2)
    scores = triton_kernels.token_kl(logits, ref_logits, labels.clamp(min=0).flatten(), temperature)
    return tuple(t.view(labels.shape) for t in scores)


def _head_logits(hidden: torch.Tensor, weight: torch.Tensor, bias) -> torch.Tensor:
    # a head kept in float32 (`modeling.float32_head`) takes the decoder's output cast up, as its forward does
    return F.linear(hidden.to(weight.dtype), weight, bias)


def _log_softmax_at(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    logits = logits.float()
    if temperature != 1.0:
        logits = logits / temperature
    return logits.log_softmax(-1)


def _scaled_log_softmax(hidden: torch.Tensor, head: tuple, temperature: float) -> torch.Tensor:
    return _log_softmax_at(_head_logits(hidden, *head), temperature)
