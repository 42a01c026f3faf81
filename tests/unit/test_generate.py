"""pipeline/generate.py: the consumer's loop, with a chain that returns its input and a
head that names the next token (input + 1): where the LM head runs."""

from __future__ import annotations

import threading
import time

import torch

from compushare.pipeline.client.generate import HEAD_INLINE_MAX_S, generate
from compushare.pipeline.client.sampling import SamplingParams


class EchoChain:
    async def step(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden


class CountingHead:
    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.on_loop: list[bool] = []  # per token: did logits run in the event loop's thread?

    def embed_tokens(self, ids: list[int]) -> torch.Tensor:
        return torch.tensor([ids], dtype=torch.float32).unsqueeze(-1)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        self.on_loop.append(threading.current_thread() is threading.main_thread())
        time.sleep(self.seconds)
        logits = torch.zeros(16)
        logits[int(hidden[0, -1, 0]) + 1] = 1.0
        return logits


async def test_a_fast_head_runs_on_the_loop_once_timed():
    head = CountingHead(0.0)
    tokens = await generate(EchoChain(), head, [3], SamplingParams(max_new_tokens=5, stop_at_eos=False))
    assert tokens == [4, 5, 6, 7, 8]
    assert head.on_loop == [False, True, True, True, True]  # the first, not yet timed, in a worker thread


async def test_a_slow_head_stays_in_a_worker_thread():
    head = CountingHead(HEAD_INLINE_MAX_S + 0.01)
    tokens = await generate(EchoChain(), head, [3], SamplingParams(max_new_tokens=3, stop_at_eos=False))
    assert tokens == [4, 5, 6]
    assert head.on_loop == [False, False, False]
