"""One forward for the decode steps of several sessions of one span (batching).

A decode step reads every weight of the span to compute one token: memory-bound,
so N sessions' steps cost little more than one when their projections and MLPs
run as one [N, 1, H] product (model/lean.py). Attention stays per session (each has
its own KV cache and length), through the very attention function transformers would call.

So for N = 1 the result is bit-identical to SpanRunner.forward; for N > 1 the
projections' rows come from a matrix product instead of a matrix-vector one, which
rounds differently (about 1e-6 relative on SmolLM2's hidden states, far inside the
protocol's fp32 tolerance of 1e-3; tests/unit/test_batched.py measures it). The
next token can only change where the model's two best tokens are that close.
"""

from __future__ import annotations

import torch

from .lean import run_layers
from .lora import Adapter

MAX_BATCH = 16


def supports_batching(runner) -> bool:
    return runner.batchable


def decode_batch(runner, hiddens: list[torch.Tensor], caches: list, positions: list[int], start: int,
                 end: int, adapters: list[Adapter | None] | None = None) -> list[torch.Tensor]:
    """Layers start..end-1 of `runner` for N one-token steps at once: `hiddens[i]`
    [1, 1, H] at `positions[i]`, appended to `caches[i]`, with `adapters[i]`'s LoRA
    updates where given (sessions of one batch may carry different adapters, or
    none). The outputs, [1, 1, H] each."""
    hidden = torch.cat([h.to(runner.dtype) for h in hiddens], dim=0)  # [N, 1, H]
    return list(run_layers(runner, hidden, caches, positions, start, end, None, adapters).split(1, dim=0))
