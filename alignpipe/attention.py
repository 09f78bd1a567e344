"""`model.attention: varlen`: packed rows attend each to itself through PyTorch's own variable-length flash kernel.

Packed SFT blocks hold several rows (documents) each, with position ids that restart at every row. Under `sdpa`,
transformers turns the restarting positions into a dense block-diagonal (B, 1, T, T) mask; SDPA's flash kernel
cannot take a mask, so the memory-efficient kernel runs and computes every block of the T × T square, most of which
the mask then throws away. Here the block's tokens are flattened into one (B·T, heads, head_dim) sequence and
`torch.nn.attention.varlen.varlen_attn` (flash attention's varlen kernel, shipped inside torch: nothing to install)
runs each document causally from its cumulative offsets: no mask and no work outside the documents. This is what
`flash_attention_2` does with padding-free batches, without the `flash-attn` package.

Where the offsets come from: `sft.collate` counts each block's documents on the host and hands the model
`cu_seq_lens_q` and `max_length_q` (transformers' names, passed through to every attention call), with
`documents_mask`'s marker as the attention mask, so that transformers does not look for the documents in the position
ids itself (a device read): the step needs no device read. A caller that passes only restarting `position_ids` (TRL's
padding-free collator, in the benchmark) gets them derived once per forward, with one device read, as transformers'
own packed-row check does.

Everything else runs SDPA unchanged: padded batches (a 2-D mask), decoding with a KV cache, rows without packing.
The kernel needs a CUDA device and fp16/bf16 tensors; elsewhere (CPU, float32) the same documents run one by one
through causal SDPA (exact, slower: for tests and CPU users).

`model.attention: auto` (the default) takes `varlen` where it pays and is known to be exact (`choose`): a CUDA
device, bf16/fp16 weights, one of the model families whose attention modules hand the documents through (Llama,
Qwen2, Qwen3, Mistral), no sliding-window layers and no attention dropout. Elsewhere it is `sdpa`.

The kernel is checked once per process, at its first call of each kind (each document attending to itself;
separate key documents), against the documents run one by one through SDPA on the same inputs (`_kernel_call`). A
torch release whose kernel takes its arguments otherwise (2.11's lacked `enable_gqa`, for one) then costs a warning
and the slower exact path, never a silently wrong gradient."""

from __future__ import annotations

import functools
import inspect
import itertools
import logging

import torch

log = logging.getLogger(__name__)

NAME = "varlen"

# model families whose attention modules pass `position_ids` and the document keywords through to the attention
# function, and whose SDPA and varlen runs the tests compare (`config.model_type`)
AUTO_FAMILIES = frozenset({"llama", "qwen2", "qwen3", "mistral"})


def kernel_available() -> bool:
    """Whether this torch ships the variable-length flash kernel (`torch.nn.attention.varlen`, torch ≥ 2.10)."""
    try:
        from torch.nn.attention.varlen import varlen_attn  # noqa: F401
    except ImportError:
        return False
    return True


def choose(model) -> tuple[str, str]:
    """(`varlen` or `sdpa`, why) for `model.attention: auto` on `model` as loaded: `varlen` on a machine with a CUDA
    device, for bf16/fp16 weights of a family in `AUTO_FAMILIES` without sliding-window layers or attention
    dropout, where torch has the kernel."""
    config = model.config
    family = getattr(config, "model_type", None)
    if not torch.cuda.is_available():
        return "sdpa", "no CUDA device"
    if not kernel_available():
        return "sdpa", f"torch {torch.__version__} has no torch.nn.attention.varlen"
    if model.dtype not in (torch.float16, torch.bfloat16):
        return "sdpa", f"{model.dtype} weights (the kernel runs bf16/fp16)"
    if family not in AUTO_FAMILIES:
        return "sdpa", f"model type {family!r} (varlen is chosen for {', '.join(sorted(AUTO_FAMILIES))})"
    sliding = "sliding_attention" in (getattr(config, "layer_types", None) or []) or (
        getattr(config, "sliding_window", None) is not None and getattr(config, "use_sliding_window", True)
    )
    if sliding:
        return "sdpa", "sliding-window layers"
    if getattr(config, "attention_dropout", 0.0):
        return "sdpa", f"attention dropout {config.attention_dropout}"
    return register(), "CUDA, bf16/fp16, full attention"


@functools.cache
def register() -> str:
    """Register `varlen` with transformers' attention and mask interfaces (once per process); returns the name to
    pass as `attn_implementation`."""
    from transformers import AttentionInterface, AttentionMaskInterface

    AttentionInterface.register(NAME, varlen_attention_forward)
    AttentionMaskInterface.register(NAME, _mask)
    return NAME


def _mask(**kwargs):
    """Masks as SDPA's where the input is padded (a 2-D `attention_mask`), none otherwise: packed rows are separated
    by their offsets in `varlen_attention_forward`, not by a mask."""
    from transformers.masking_utils import sdpa_mask

    if kwargs.get("attention_mask") is None:
        return None
    return sdpa_mask(**kwargs)


def implementation_of(model) -> str | None:
    """transformers' `attn_implementation` of `model` (plain, peft, DDP- or FSDP-wrapped)."""
    inner = model.module if isinstance(model, torch.nn.parallel.DistributedDataParallel) else model
    return getattr(getattr(inner, "config", None), "_attn_implementation", None)


def is_documents_mask(mask: object) -> bool:
    """Whether `mask` is `documents_mask`'s marker (told by its shape: a wrapper's move to the device copies it)."""
    return isinstance(mask, torch.Tensor) and mask.dim() == 4 and mask.numel() == 0


def documents_mask(model, attention_mask: torch.Tensor | None, device) -> torch.Tensor | None:
    """The `attention_mask` to hand `model` with a padding-free batch whose documents the caller counted on the host
    (`document_kwargs`): on `varlen`, an empty 4-D tensor in place of None. transformers returns a 4-D mask as it is,
    as one already prepared; given None with `position_ids`, it looks for packed rows in them (`masking_utils`'
    `find_packed_sequence_indices`), a device read that makes the host wait for the GPU once a forward, for a mask
    `varlen` never uses. `varlen_attention_forward` takes the marker for "no mask". Other kernels (and padded
    batches: a 2-D mask) get `attention_mask` unchanged."""
    if attention_mask is not None or implementation_of(model) != NAME:
        return attention_mask
    return torch.empty((0, 0, 0, 0), dtype=torch.bool, device=device)


def document_offsets(position_ids: torch.Tensor) -> tuple[list[int], int]:
    """Cumulative offsets of the documents of (B, T) `position_ids` flattened row after row, and the longest
    document's length. A document starts where the position is 0 (every row starts one). Host tensors only: the
    collator's and the test's helper."""
    starts = (position_ids.flatten() == 0).nonzero().flatten().tolist()
    cu = starts + [position_ids.numel()]
    return cu, max(b - a for a, b in itertools.pairwise(cu))


def document_kwargs(cu: list[int], side: str = "qk") -> dict[str, object]:
    """Documents at the cumulative offsets `cu` (host ints, documents + 1) in transformers' names for
    variable-length attention (`cu_seq_lens_q`/`_k`, `max_length_q`/`_k`; `side` "q" or "k" for one side's
    alone), as every attention call is handed them."""
    offsets = torch.tensor(cu, dtype=torch.int32)
    longest = max(b - a for a, b in itertools.pairwise(cu))
    return {f"{name}_{x}": value for x in side for name, value in (("cu_seq_lens", offsets), ("max_length", longest))}


_derived: tuple[torch.Tensor, torch.Tensor, int] | None = None


def _derived_offsets(position_ids: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Offsets from the position ids themselves (one device read), kept for the forward's other layers, which are
    handed the same tensor."""
    global _derived
    if _derived is None or _derived[0] is not position_ids:
        cu, longest = document_offsets(position_ids.cpu())
        _derived = (position_ids, torch.tensor(cu, dtype=torch.int32, device=position_ids.device), longest)
    return _derived[1], _derived[2]


def varlen_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function contract: query (B, H, T, D), key/value (B, Hkv, T, D) → (B, T, H, D).

    Documents come as transformers' `cu_seq_lens_q`/`max_length_q`; where keys are laid out apart from the queries
    (`packed_rows`' shared prompts), also `cu_seq_lens_k`/`max_length_k` and `key_rows`, the flattened tokens whose
    keys and values make up the key documents, in order (a token may serve several), so that document i's queries
    attend to key document i, its last query to its last key (causal, aligned at the bottom right)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if is_documents_mask(attention_mask):
        attention_mask = None
    batch, heads, length, dim = query.shape
    position_ids = kwargs.get("position_ids")
    cu = kwargs.get("cu_seq_lens_q")
    whole = attention_mask is None and length > 1 and key.shape[2] == length  # a training forward, no cache, no pad
    if not whole or (cu is None and position_ids is None):  # padded, decoding, or no documents to find: SDPA
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout, scaling, **kwargs)
    if kwargs.get("sliding_window") is not None:
        raise ValueError("model.attention: varlen does not run sliding-window layers; use sdpa or flex_attention")
    if dropout and module.training:
        raise ValueError("model.attention: varlen does not run attention dropout; set the model's dropout to 0")
    rows = kwargs.get("key_rows")
    if cu is None:
        cu, longest = _derived_offsets(position_ids.expand(batch, -1))  # type: ignore[union-attr]  # not None here
        cu_k, longest_k = cu, longest
    else:
        longest = int(kwargs["max_length_q"])
        cu_k = kwargs["cu_seq_lens_k"] if rows is not None else cu
        longest_k = int(kwargs["max_length_k"]) if rows is not None else longest
    q, k, v = (t.transpose(1, 2).reshape(batch * length, t.shape[1], dim) for t in (query, key, value))
    if rows is not None:
        k, v = k.index_select(0, rows), v.index_select(0, rows)  # autograd sums a shared token's copies
    out = _documents_attention(q, k, v, cu, cu_k, longest, longest_k, scaling)
    return out.view(batch, length, heads, dim), None


def _call_varlen(kernel, q, k, v, cu_q, cu_k, longest_q: int, longest_k: int, scale: float | None) -> torch.Tensor:
    """`kernel` (torch's `varlen_attn`) run causally over the documents at `cu_q` (queries) and `cu_k` (keys), in
    the keywords its torch release takes. Causality is `window_size=(-1, 0)` (2.11 and 2.13), else `is_causal`:
    flash attention aligns it at the bottom right, a document's last query seeing its last key. Grouped K/V heads go
    in as they are where it has `enable_gqa` (2.13); 2.11 has no such flag (seen on the GPU image), so there they are
    repeated to the query's heads (one copy per layer, as SDPA's math path does)."""
    takes = _keywords(kernel)
    causal: dict[str, object] = {"window_size": (-1, 0)} if "window_size" in takes else {"is_causal": True}
    if k.shape[1] != q.shape[1]:
        if "enable_gqa" in takes:
            causal["enable_gqa"] = True
        else:
            groups = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    if "scale" in takes:
        causal["scale"] = scale
    elif scale is not None and abs(scale * q.shape[-1] ** 0.5 - 1) > 1e-6:
        raise ValueError(f"this torch's varlen_attn has no `scale` (the model asks {scale}); use sdpa")
    out = kernel(q, k, v, cu_q, cu_k, longest_q, longest_k, **causal)
    assert isinstance(out, torch.Tensor)  # the log-sum-exp comes back too only when asked for
    return out


# The kernel's verdict per kind of call ("self": each document attends to itself; "keys": separate key documents),
# from its first call in this process: True agreed with `_per_document`, False did not (that kind then runs there).
KERNEL_VERDICTS: dict[str, bool] = {}

# Worst per-token relative gap from `_per_document` the kernel may show: bf16 rounding gives ~4e-3; a kernel given
# the wrong causal alignment, scale or head grouping is off by tens of percent.
KERNEL_TOLERANCE = 5e-2


def _kernel_call(kernel, q, k, v, cu_q, cu_k, longest_q: int, longest_k: int, scale: float | None) -> torch.Tensor:
    """`_call_varlen`, checked at the first call of each kind against the documents run one by one (one device
    read, once); a kind whose check failed runs one by one from then on, with a warning saying so. Inside a
    compiled layer (`compile: true`) the kernel runs unchecked: a check there would break the graph."""
    if torch.compiler.is_compiling():
        return _call_varlen(kernel, q, k, v, cu_q, cu_k, longest_q, longest_k, scale)
    kind = "self" if cu_k is cu_q else "keys"
    verdict = KERNEL_VERDICTS.get(kind)
    if verdict is False:
        return _per_document(q, k, v, cu_q, cu_k, scale)
    out = _call_varlen(kernel, q, k, v, cu_q, cu_k, longest_q, longest_k, scale)
    if verdict is None:
        with torch.no_grad():
            want = _per_document(q, k, v, cu_q, cu_k, scale).float()
            gap = ((out.float() - want).norm(dim=-1) / want.norm(dim=-1).clamp(min=1e-6)).max().item()
        KERNEL_VERDICTS[kind] = gap <= KERNEL_TOLERANCE
        if gap > KERNEL_TOLERANCE:
            log.warning(
                "model.attention: varlen: torch %s's varlen_attn is off from SDPA by %.2g (per-token relative gap; "
                "allowed %.2g) on %s documents; they run one by one through SDPA instead (exact, slower). Set "
                "`model.attention: sdpa` to silence this, and report the torch version",
                torch.__version__,
                gap,
                KERNEL_TOLERANCE,
                "self-attending" if kind == "self" else "shared-key",
            )
            return _per_document(q, k, v, cu_q, cu_k, scale)
    return out


@functools.cache
def _keywords(kernel) -> frozenset[str]:
    return frozenset(inspect.signature(kernel).parameters)


def _documents_attention(
    q, k, v, cu_q: torch.Tensor, cu_k: torch.Tensor, longest_q: int, longest_k: int, scale: float | None
) -> torch.Tensor:
    """Causal attention of the documents of flattened (N, H, D) q over those of (M, Hkv, D) k/v, at offsets `cu_q`
    and `cu_k` (int32, documents + 1; the same tensor where each document attends to itself), aligned at the bottom
    right."""
    if q.is_cuda and q.dtype in (torch.float16, torch.bfloat16):
        from torch.nn.attention.varlen import varlen_attn

        cu_q = cu_q.to(device=q.device, dtype=torch.int32)
        cu_k = cu_q if cu_k is cu_q else cu_k.to(device=q.device, dtype=torch.int32)
        return _kernel_call(varlen_attn, q, k, v, cu_q, cu_k, longest_q, longest_k, scale)
    if torch.compiler.is_compiling():
        # one opaque op, as the CUDA kernel is: the loop below would break the graph at `cu.tolist()` and
        # specialise on every document boundary, a recompile per batch
        return documents_attention_op(q, k, v, cu_q, cu_k, longest_q, longest_k, scale)
    return _per_document(q, k, v, cu_q, cu_k, scale)


def _segments(cu_q: torch.Tensor, cu_k: torch.Tensor):
    """(query start, query end, key start, key end) of each document, host ints."""
    q = cu_q.tolist()
    k = q if cu_k is cu_q else cu_k.tolist()
    return [(a, b, c, d) for (a, b), (c, d) in zip(itertools.pairwise(q), itertools.pairwise(k), strict=True)]


def _bottom_right(m: int, n: int, device) -> torch.Tensor:
    """(m, n) causal mask of m queries over n ≥ m keys, the last query seeing every key."""
    return torch.ones(m, n, dtype=torch.bool, device=device).tril(n - m)


def _per_document(q, k, v, cu_q: torch.Tensor, cu_k: torch.Tensor, scale: float | None) -> torch.Tensor:
    gqa = k.shape[1] != q.shape[1]
    pieces = []
    for a, b, c, d in _segments(cu_q, cu_k):
        qd, kd, vd = (t[x:y].transpose(0, 1).unsqueeze(0) for t, x, y in ((q, a, b), (k, c, d), (v, c, d)))
        square = b - a == d - c
        mask = None if square else _bottom_right(b - a, d - c, q.device)
        o = torch.nn.functional.scaled_dot_product_attention(
            qd, kd, vd, attn_mask=mask, is_causal=square, scale=scale, enable_gqa=gqa
        )
        pieces.append(o[0].transpose(0, 1))
    return torch.cat(pieces)


@torch.library.custom_op("alignpipe::documents_attention", mutates_args=())
def documents_attention_op(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_q: torch.Tensor,
    cu_k: torch.Tensor,
    longest_q: int,
    longest_k: int,
    scale: float | None,
) -> torch.Tensor:
    """The documents run one by one (off the CUDA kernel), as one op with the kernel's inputs (the longest lengths
    unused here), so that `compile: true` sees on CPU the graph it sees on a GPU."""
    return _per_document(q, k, v, cu_q, cu_k, scale)


@documents_attention_op.register_fake
def _(q, k, v, cu_q, cu_k, longest_q, longest_k, scale):
    return torch.empty_like(q)


@torch.library.custom_op("alignpipe::documents_attention_backward", mutates_args=())
def documents_attention_backward_op(
    grad: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_q: torch.Tensor,
    cu_k: torch.Tensor,
    scale: float | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The gradients of `documents_attention_op` per document, written out (an op's body runs below autograd):
    P = softmax(s·QKᵀ) causal at the bottom right, dV = Pᵀ dO, dS = P ∘ (dO Vᵀ − rowsum(dO ∘ O)), dQ = s·dS K,
    dK = s·dSᵀ Q; grouped K/V heads sum their queries' gradients."""
    groups = q.shape[1] // k.shape[1]
    s = q.shape[-1] ** -0.5 if scale is None else scale
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    at = torch.promote_types(q.dtype, torch.float32)
    for a, b, c, d in _segments(cu_q, cu_k):
        qd, do = q[a:b].transpose(0, 1).to(at), grad[a:b].transpose(0, 1).to(at)  # (H, m, D)
        kd, vd = (t[c:d].transpose(0, 1).to(at).repeat_interleave(groups, 0) for t in (k, v))  # (H, n, D)
        causal = _bottom_right(b - a, d - c, q.device)
        p = (s * qd @ kd.transpose(1, 2)).masked_fill(~causal, float("-inf")).softmax(-1)
        o = p @ vd
        ds = p * (do @ vd.transpose(1, 2) - (do * o).sum(-1, keepdim=True))
        dq[a:b] = (s * ds @ kd).transpose(0, 1).to(q.dtype)
        dk[c:d] = (s * ds.transpose(1, 2) @ qd).unflatten(0, (-1, groups)).sum(1).transpose(0, 1).to(k.dtype)
        dv[c:d] = (p.transpose(1, 2) @ do).unflatten(0, (-1, groups)).sum(1).transpose(0, 1).to(v.dtype)
    return dq, dk, dv


@documents_attention_backward_op.register_fake
def _(grad, q, k, v, cu_q, cu_k, scale):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _save(ctx, inputs, output):
    q, k, v, cu_q, cu_k, _, _, scale = inputs
    ctx.save_for_backward(q, k, v, cu_q, cu_k)
    ctx.scale = scale


def _backward(ctx, grad):
    q, k, v, cu_q, cu_k = ctx.saved_tensors
    return (*documents_attention_backward_op(grad, q, k, v, cu_q, cu_k, ctx.scale), None, None, None, None, None)


documents_attention_op.register_autograd(_backward, setup_context=_save)
