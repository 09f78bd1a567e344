"""A static KV cache whose layers share one write position per forward.

transformers' `StaticLayer.update` works out where to write in each layer: an `arange`, an add of its own
tokens-written counter, and an in-place add to that counter, before its two writes. That is three small kernels per
layer per decode step (72 of a 24-layer step's ~1,100: `python -m bench.decode_kernels`), each costing a kernel's
fixed few microseconds on a GPU even inside a CUDA graph. Here the layers of one cache share one counter; the first
layer a forward writes works the positions out once and the others write at them: two kernels per layer
(`index_copy_` of keys and of values).

Only for caches whose layers are all plain full-attention `StaticLayer`s keeping such a counter (sliding-window
layers write differently), and not under `torch.compile`, whose inductor fuses the position arithmetic anyway (the
compiled decode step keeps transformers' cache).
"""

from __future__ import annotations

import torch


class SharedPositions:
    """What one cache's layers share: the tokens-written counter (every layer's `cumulative_length`) and the
    positions the current forward writes at, worked out by the first layer to write in it."""

    def __init__(self, device: torch.device | str):
        self.length = torch.zeros((), dtype=torch.long, device=device)
        self.positions: torch.Tensor | None = None
        self.written: set[int] = set()
        """Which layers (`id`) wrote at `positions`: a layer writing again means a new forward."""

    def at(self, layer: object, tokens: int) -> torch.Tensor:
        """Where `layer` writes its `tokens` new entries: a new forward's positions (and the counter advanced past
        them) when this layer wrote at the current ones already, or they are for another number of tokens."""
        positions = self.positions
        if positions is None or id(layer) in self.written or positions.numel() != tokens:
            positions = self.positions = torch.arange(tokens, device=self.length.device) + self.length
            self.length.add_(tokens)
            self.written = set()
        self.written.add(id(layer))
        return positions

    def forget(self) -> None:
        """The cache was emptied: the next write starts a forward."""
        self.positions = None
        self.written = set()


def _layer_class():
    from transformers.cache_utils import StaticLayer

    class SharedPositionLayer(StaticLayer):
        """A `StaticLayer` writing at the positions its cache's `SharedPositions` worked out for this forward."""

        def __init__(self, max_cache_len: int, shared: SharedPositions):
            super().__init__(max_cache_len=max_cache_len)
            self.shared = shared
            self.cumulative_length = shared.length

        def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
            if not self.is_initialized:
                self.lazy_initialization(key_states, value_states)
            keys, values = self.keys, self.values
            assert keys is not None and values is not None  # allocated by `lazy_initialization`
            positions = self.shared.at(self, key_states.shape[-2])
            keys.index_copy_(2, positions, key_states)
            values.index_copy_(2, positions, value_states)
            return keys, values

        def reset(self) -> None:
            super().reset()
            self.shared.forget()

    return SharedPositionLayer


_LAYER: type | None = None


def _counting(layer, static_layer: type) -> bool:
    """Whether `layer` is a plain full-attention static layer that writes at its own tokens-written counter (a
    tensor, as transformers 5.2x keeps it): the layer this module replaces."""
    return type(layer) is static_layer and isinstance(getattr(layer, "cumulative_length", None), torch.Tensor)


def static_cache(config, max_cache_len: int, device: torch.device | str):
    """transformers' `StaticCache` for `config`, its full-attention layers writing at positions shared per forward
    (on `device`, where the keys and values will be); a cache with other layers is returned as transformers made it."""
    global _LAYER
    from transformers import StaticCache
    from transformers.cache_utils import StaticLayer

    cache = StaticCache(config=config, max_cache_len=max_cache_len)
    if not cache.layers or any(not _counting(layer, StaticLayer) for layer in cache.layers):
        return cache
    _LAYER = _LAYER or _layer_class()
    shared = SharedPositions(device)
    cache.layers = [_LAYER(max_cache_len, shared) for _ in cache.layers]
    return cache
