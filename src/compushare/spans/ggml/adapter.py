"""LoRA adapters on a ggml span: each adapted projection computes y = W x + s · B (A x),
as model/lora.py's update on torch, its factors in float32 ggml tensors beside the
span's weights (graph.product adds the update after the product and its bias, in
PEFT's order).

A session's adapter is uploaded once and kept, with the graphs built over it, among
the span's last few (GgmlSpan.MAX_ADAPTERS); the factors of the layers outside the
span are not uploaded. A Llama file's attn_q / attn_k rows are permuted for ggml's
rotary layout (recipe.ROPE_NORMAL): so are the rows of those projections' B factors,
and their outputs come out as the permuted weights' do.
"""

from __future__ import annotations

import collections
from collections.abc import Callable

import numpy as np

from ...errors import UsageError
from ...model.gguf_native import permute
from ...model.lora import Adapter, parse_name
from .recipe import ROPE_NORMAL, Recipe
from .weights import Weights, filled_weights

PERMUTED = {"self_attn.q_proj": "heads", "self_attn.k_proj": "kv_heads"}  # projection -> the recipe's head count


class AdaptedWeights:
    """A span's weights seen with an adapter's factors: what graph.layer reads, as
    `Weights`, plus `lora(projection)`."""

    def __init__(self, base: Weights, adapter: Adapter, recipe: Recipe, start: int, end: int) -> None:
        self.base, self.adapter = base, adapter  # the adapter kept: its id keys the graphs over these factors
        self.scale = adapter.spec.scaling
        entries, self.projections = [], set()
        for name, tensor in adapter.tensors.items():
            index, module, which = parse_name(name)
            if not start <= index < end:
                continue
            array = tensor.detach().float().contiguous().numpy()
            if which == "B" and module in PERMUTED and recipe.rope_mode == ROPE_NORMAL:
                array = permute(array, getattr(recipe, PERMUTED[module]))
            entries.append((name, np.ascontiguousarray(array).view(np.uint8), "F32"))
            self.projections.add(f"model.layers.{index}.{module}")
        self.factors = filled_weights(entries, repack=False)
        self.nbytes = self.factors.nbytes
        self.applied: set[str] = set()

    def __getitem__(self, name: str):
        return self.base[name]

    def get(self, name: str):
        return self.base.get(name)

    def lora(self, projection: str):
        """(A, B, scale) of `projection` ("model.layers.3.self_attn.q_proj"), or None."""
        a = self.factors.get(projection + ".lora_A.weight")
        if a is None:
            return None
        self.applied.add(projection)
        return a, self.factors[projection + ".lora_B.weight"], self.scale

    def check_applied(self, start: int, end: int) -> None:
        """After a graph over layers start..end-1 is built: every factor of theirs found
        its projection (an adapter for projections this model's layers lack is refused,
        not silently half-applied)."""
        prefixes = tuple(f"model.layers.{i}." for i in range(start, end))
        missing = sorted(p for p in self.projections - self.applied if p.startswith(prefixes))
        if missing:
            raise UsageError(f"the adapter adapts {missing[0]}, which this model's layers do not compute "
                             f"({len(missing)} such projections)")

    def free(self) -> None:
        self.factors.free()


class KeptAdapters:
    """The adapters a span keeps uploaded, by id(adapter), the least recently used
    dropped first past `limit`; `on_drop(key)` lets the span free the graphs built
    over a dropped one. Callers hold the span's lock."""

    def __init__(self, limit: int, upload: Callable[[Adapter], AdaptedWeights], on_drop: Callable[[int], None]
                 ) -> None:
        self.limit, self.upload, self.on_drop = limit, upload, on_drop
        self._kept: collections.OrderedDict[int, AdaptedWeights] = collections.OrderedDict()

    def get(self, adapter: Adapter | None) -> AdaptedWeights | None:
        """`adapter`'s factors in ggml tensors, uploaded on first use (None: no adapter)."""
        if adapter is None:
            return None
        key = id(adapter)
        adapted = self._kept.get(key)
        if adapted is None or adapted.adapter is not adapter:
            if adapted is not None:  # another adapter at a dead one's address
                self._drop(key)
            while len(self._kept) >= self.limit:
                self._drop(next(iter(self._kept)))
            adapted = self._kept[key] = self.upload(adapter)
        self._kept.move_to_end(key)
        return adapted

    def _drop(self, key: int) -> None:
        self.on_drop(key)
        self._kept.pop(key).free()

    def __len__(self) -> int:
        return len(self._kept)

    def __contains__(self, key: int) -> bool:
        return key in self._kept

    def free(self) -> None:
        for key in list(self._kept):
            self._drop(key)
