"""Where a step's forward runs, and what this server measures of its compute.

Torch runs in worker threads behind a CapacityLimiter, so the event loop keeps
reading every stream (yamux resets a stream whose reader stalls for 5 s); a short
one-token step runs on the event loop itself (`runs_inline`). Every step's compute
time feeds the load and throughput this server advertises, and decode steps refine
its decode rate (block-steps/s), which predicts how long the next one takes.
"""

from __future__ import annotations

import collections
import time

import torch
import trio

from ...model.blocks import SpanRunner
from ...net.tensors import encode_tensor
from ..messages import WireTensor

LOAD_WINDOW_S = 10.0
RATE_EWMA = 0.2
# A one-token step whose forward the measured rate puts at or under this runs on the
# event loop itself instead of a worker thread (see runs_inline).
INLINE_MAX_S = 0.05


class Compute:
    def __init__(self, threads: int, *, block_rate: float = 0.0, noise: float = 0.0) -> None:
        self.limiter = trio.CapacityLimiter(threads)
        self.block_rate = block_rate  # decode steps/s through one block: self-benchmark, then served steps
        self.noise = noise  # fault injection only: a lying server (tests, benchmarks)
        self.busy: collections.deque[tuple[float, float, int]] = collections.deque()  # (end, seconds, tokens)

    async def run(self, runner: SpanRunner, cache: object, hidden: torch.Tensor, position: int, start: int,
                  end: int, chunks: list[int]) -> tuple[torch.Tensor, float]:
        """The output of blocks start:end for `hidden` at `position`, and the seconds its
        forward took. On failure the cache may hold part of the step: the caller rolls
        it back."""

        def compute() -> tuple:
            # Chunks run one after another, exactly as the original steps did: a replayed
            # history then rebuilds the very same KV cache (one batched prefill would not).
            # Timed in the worker: waiting for the limiter is queueing (load), not speed.
            began = time.perf_counter()
            outputs, offset = [], 0
            for size in chunks:
                outputs.append(runner.forward(hidden[:, offset:offset + size], cache, position + offset, start, end))
                offset += size
            out = outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=1)
            if self.noise > 0:
                out = out + torch.randn_like(out) * self.noise * out.abs().mean()
            return out, time.perf_counter() - began

        if self.runs_inline(runner, chunks, end - start):
            async with self.limiter:  # never beside a long step in a worker thread
                output, seconds = compute()
        else:
            output, seconds = await trio.to_thread.run_sync(compute, limiter=self.limiter)
        self.observe(hidden.shape[1], end - start, seconds)
        return output, seconds

    def runs_inline(self, runner: SpanRunner, chunks: list[int], blocks: int) -> bool:
        """Whether a step runs on the event loop rather than in a worker thread.

        A decode step's forward is hundreds of small torch ops, each releasing the GIL.
        In a worker thread it shares the GIL with this loop's network work (py-libp2p
        is pure Python), which takes the GIL at every op and keeps it for its burst:
        measured, a decode step spends a share of each forward waiting for the GIL and
        the thread hand-off, and a token takes longer than inline. Inline holds the
        loop for the forward's duration, so only short one-token steps qualify,
        predicted from the measured rate; prefills, replays, several compute threads
        and slowed runners stay in threads."""
        if chunks != [1] or self.limiter.total_tokens != 1 or runner.slowdown > 1.0:
            return False
        return self.block_rate > 0 and blocks / self.block_rate <= INLINE_MAX_S

    def observe(self, tokens: int, blocks: int, seconds: float) -> None:
        self.busy.append((time.monotonic(), seconds, tokens))
        if tokens == 1 and seconds > 0:  # decode steps are what the rate predicts
            sample = blocks / seconds
            self.block_rate = sample if self.block_rate <= 0 else (1 - RATE_EWMA) * self.block_rate + RATE_EWMA * sample

    def load(self, now: float | None = None) -> float:
        """Share of the last LOAD_WINDOW_S this server spent computing, 0..1."""
        now = self._trim(now)
        busy = sum(min(seconds, end - (now - LOAD_WINDOW_S)) for end, seconds, _ in self.busy)
        return min(1.0, max(0.0, busy / LOAD_WINDOW_S))

    def throughput(self, now: float | None = None) -> float:
        """Tokens/s this server computed over the last LOAD_WINDOW_S."""
        now = self._trim(now)
        return sum(tokens for _, _, tokens in self.busy) / LOAD_WINDOW_S

    def _trim(self, now: float | None) -> float:
        now = time.monotonic() if now is None else now
        while self.busy and self.busy[0][0] < now - LOAD_WINDOW_S:
            self.busy.popleft()
        return now


def wire(tensor: torch.Tensor) -> WireTensor:
    """A tensor as it goes on the wire."""
    encoded = encode_tensor(tensor)
    return WireTensor(encoded["dtype"], tuple(encoded["shape"]), encoded["data"])
