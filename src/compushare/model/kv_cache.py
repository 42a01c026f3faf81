"""A session's KV cache that grows in blocks instead of one copy per step.

transformers' DynamicCache appends each step's keys and values with torch.cat: a
new tensor the size of the whole cache every step, per layer. Besides the copy,
that churn is what made a server keep memory after sessions ended: glibc serves
those mid-sized tensors from its heaps, where the holes other sessions' caches
leave cannot be returned to the system (bench/hostile.py measured +144 MB still
held after a KV hog left). Here each layer keeps one buffer with room for
GROW_TOKENS-token blocks and hands attention a view of the used part: a step
writes its rows in place, the buffer is reallocated (and the old one freed
whole) once per block, and a truncate just shortens the view. The values, and
so the outputs, are bit-identical to DynamicCache's (tests/unit/test_kv_cache.py).
"""

from __future__ import annotations

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer

GROW_TOKENS = 256  # capacity grows by whole blocks: at most this much unused room per layer


class BlockGrownLayer(DynamicLayer):
    """DynamicLayer's interface (keys/values hold exactly the cached tokens), over a
    buffer that grows GROW_TOKENS at a time."""

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        super().lazy_initialization(key_states, value_states)
        self._key_room = self._value_room = None

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        used = self.get_seq_length()
        total = used + key_states.shape[-2]
        if self._key_room is None or total > self._key_room.shape[-2]:
            self._grow(total, key_states, value_states)
        self._key_room[..., used:total, :] = key_states
        self._value_room[..., used:total, :] = value_states
        self.keys = self._key_room[..., :total, :]
        self.values = self._value_room[..., :total, :]
        return self.keys, self.values

    def _grow(self, total: int, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        room = -(-total // GROW_TOKENS) * GROW_TOKENS
        keys = key_states.new_empty((*key_states.shape[:-2], room, key_states.shape[-1]))
        values = value_states.new_empty((*value_states.shape[:-2], room, value_states.shape[-1]))
        used = self.get_seq_length()
        if used:
            keys[..., :used, :] = self.keys
            values[..., :used, :] = self.values
        self._key_room, self._value_room = keys, values

    def reset(self) -> None:
        self._key_room = self._value_room = None
        super().reset()

    def room(self) -> int:
        """Tokens the buffer has room for (0 before the first step)."""
        return 0 if not self.is_initialized or self._key_room is None else self._key_room.shape[-2]


class BlockGrownSlidingLayer(BlockGrownLayer):
    """A sliding-window layer (Mistral, Gemma's local layers) that keeps every token,
    as BlockGrownLayer does, but hands attention only what transformers' sliding
    layer would: the last `sliding_window - 1` cached tokens and the new ones. So
    outputs are bit-identical to transformers' and a rollback of any depth works
    (speculation's truncate), where transformers' layer, having dropped the tokens
    that left the window, refuses to crop. The cost: the whole history's memory,
    what a full-attention layer holds (and what the KV budget counts)."""

    is_sliding = True

    def __init__(self, sliding_window: int) -> None:
        super().__init__()
        self.sliding_window = sliding_window

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        before = self.get_seq_length()
        keys, values = super().update(key_states, value_states)
        first = max(0, before - (self.sliding_window - 1))
        return keys[..., first:, :], values[..., first:, :]

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        """The (length, offset) of the keys `update` returns, as transformers' sliding layer says."""
        before = self.get_seq_length()
        return min(before, self.sliding_window - 1) + query_length, max(before - self.sliding_window + 1, 0)


def new_cache(config) -> DynamicCache:
    """A DynamicCache for `config` whose layers grow in blocks."""
    cache = DynamicCache(config=config)
    layers = []
    for layer in cache.layers:
        if type(layer) is DynamicLayer:
            layers.append(BlockGrownLayer())
        elif type(layer) is DynamicSlidingWindowLayer:
            layers.append(BlockGrownSlidingLayer(layer.sliding_window))
        else:
            raise ValueError(f"no block-grown cache for {type(layer).__name__} layers")
    cache.layers = layers
    return cache
