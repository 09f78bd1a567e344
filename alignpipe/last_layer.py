"""The last decoder layer run only where its outputs are read (a reward model's scores).

A sequence classifier reads one hidden state a sequence, at its last token. Every layer but the last must run over
every token: the next layer's keys and values need them. The last layer's keys and values still do, but its queries,
attention output, output projection and MLP are needed at the read tokens alone. On a padding-free reward batch
(`packed_rows.pack_scored`) the read tokens are one a sequence, so running the last layer there alone skips about
1/L of the step's decoder products, less that layer's key and value projections (~4% of a 24-layer model's step).

`read_layout` lays out, on the host, the one-token query documents of the read positions and the keys each sees
(the keys its position saw in the full layer: causal attention aligned at the bottom right, so the read token of a
document sees that document's keys up to its own). `reading_at` swaps the body's last layer for `ReadLayer` for
one forward; the body then returns the read tokens' hidden states (1, R, d) in `read`'s order. The result and its
gradients are the full layer's at those tokens.

Runs for the decoder layers of Llama, Qwen2 and Mistral (pre-norm, rotary, q/k/v/o projections, no sliding window,
no q/k norm) on our `varlen` attention, unsharded (`supported`); the full layer runs elsewhere.
"""

from __future__ import annotations

import bisect
import contextlib
from typing import Any

import torch

from alignpipe import attention
from alignpipe.attention import document_kwargs
from alignpipe.device_copies import int64_tensor

LAYERS = frozenset({"LlamaDecoderLayer", "Qwen2DecoderLayer", "MistralDecoderLayer"})


def read_layout(positions: list[int], cu_q: list[int], cu_k: list[int], key_rows: list[int]) -> dict[str, Any]:
    """The last layer's documents for reading `positions` (host ints into the packed row) of a layout whose query
    documents lie at `cu_q` and whose key documents are `key_rows[cu_k[i]:cu_k[i + 1]]`: one query document a
    position, and as its keys the ones that position sees in its document. `rows`: the positions, (R,)."""
    keys: list[int] = []
    cu = [0]
    for pos in positions:
        doc = bisect.bisect_right(cu_q, pos) - 1
        seen = (cu_k[doc + 1] - cu_k[doc]) - (cu_q[doc + 1] - pos) + 1  # bottom-right causal alignment
        keys.extend(key_rows[cu_k[doc] : cu_k[doc] + seen])
        cu.append(len(keys))
    return {
        "rows": int64_tensor(positions),
        "documents": document_kwargs(list(range(len(positions) + 1)), "q") | document_kwargs(cu, "k"),
        "key_rows": int64_tensor(keys),
    }


def supported(body) -> bool:
    """Whether `body`'s last layer can run at the read tokens alone: a layer of `LAYERS` on our `varlen` kernel,
    without a sliding window or attention dropout, and not sharded (FSDP gathers a layer's weights in its own forward
    only)."""
    from torch.distributed.fsdp import FSDPModule

    layers = getattr(body, "layers", None)
    if not layers or attention.implementation_of(body) != "varlen":
        return False
    layer = layers[-1]
    attn = getattr(layer, "self_attn", None)
    return (
        type(layer).__name__ in LAYERS
        and not isinstance(layer, FSDPModule)
        and getattr(attn, "sliding_window", None) is None
        and not getattr(attn, "attention_dropout", 0.0)  # the varlen kernel runs none either
        and all(hasattr(attn, name) for name in ("q_proj", "k_proj", "v_proj", "o_proj", "head_dim", "scaling"))
    )


def _rotated(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding of (1, heads, T, D) `x` at (1, T, D) `cos`/`sin`, as transformers' `apply_rotary_pos_emb`."""
    cos, sin = cos[:, None], sin[:, None]
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), -1) * sin


class ReadLayer(torch.nn.Module):
    """`layer` (a decoder layer of `LAYERS`) with its outputs computed at `read["rows"]` alone: (1, R, d)."""

    def __init__(self, layer: torch.nn.Module, read: dict[str, Any]):
        super().__init__()
        self.layer, self.read = layer, read

    def forward(self, hidden_states: torch.Tensor, position_embeddings=None, **_) -> torch.Tensor:
        layer: Any = self.layer  # a decoder layer of `LAYERS`: its modules by name
        read = self.read
        attn = layer.self_attn
        device = hidden_states.device
        rows = read["rows"].to(device, non_blocking=True)
        normed = layer.input_layernorm(hidden_states)
        at = normed.index_select(1, rows)
        q = attn.q_proj(at).view(1, at.shape[1], -1, attn.head_dim).transpose(1, 2)
        k = attn.k_proj(normed).view(1, normed.shape[1], -1, attn.head_dim).transpose(1, 2)
        v = attn.v_proj(normed).view(1, normed.shape[1], -1, attn.head_dim).transpose(1, 2)
        cos, sin = position_embeddings
        q = _rotated(q, cos.index_select(1, rows), sin.index_select(1, rows))
        k = _rotated(k, cos, sin)
        key_rows = read["key_rows"].to(device, non_blocking=True)
        q, k, v = (t[0].transpose(0, 1) for t in (q, k, v))  # (tokens, heads, D)
        docs = read["documents"]
        out = attention._documents_attention(  # by the module's name: whoever stands in for it stands in here too
            q,
            k.index_select(0, key_rows),
            v.index_select(0, key_rows),
            docs["cu_seq_lens_q"],
            docs["cu_seq_lens_k"],
            int(docs["max_length_q"]),
            int(docs["max_length_k"]),
            attn.scaling,
        )
        h = hidden_states.index_select(1, rows) + attn.o_proj(out.reshape(1, out.shape[0], -1))
        return h + layer.mlp(layer.post_attention_layernorm(h))


@contextlib.contextmanager
def reading_at(body, read: dict[str, Any]):
    """`body`'s last layer swapped for its `ReadLayer` at `read` for the block. The layer keeps one `ReadLayer`
    (outside its modules), so hooks and profilers see the same module at every step."""
    layer = body.layers[-1]
    wrapper = layer.__dict__.get("_read_layer")
    if wrapper is None:
        wrapper = ReadLayer(layer, read)
        object.__setattr__(layer, "_read_layer", wrapper)  # not a submodule: the wrapper holds the layer
    wrapper.read = read
    body.layers[-1] = wrapper
    try:
        yield
    finally:
        body.layers[-1] = layer
