"""The consumer's training loop through the swarm: its adapter trained through frozen
remote spans, its data and adapter staying its own.

An optimizer step takes several microbatches (gradient accumulation). Each goes
forward through the route's stages (embeddings here, then each span remote), its
loss and that loss's gradient are taken here at the head, and it goes back through
the stages in reverse: each server recomputes its span's forward from the input it
is sent and returns the input's gradient and its adapter slice's. Microbatches run
concurrently, one request at a time per server, so a span works on the next
microbatch while the previous one moves on (a pipeline as deep as the route).
Gradients are summed in microbatch order, so a step's update does not depend on
which microbatch finished first; AdamW runs here (model/training_state.py).

A server that fails, refuses or misses its deadline is replaced: the planner finds
other servers for exactly that stage's blocks (one, or several in a row) and only
that stage's request is sent again; nothing else of the step is lost. A sampled
backward is spot-checked: computed again on a second server of the span and
compared within the format's tolerance (proofs.inference.TOLERANCES); on a mismatch a third
decides, the one it contradicts is excluded and a signed TrainFailureReport is
filed, as for inference, and the step uses the agreeing gradients.
"""

from __future__ import annotations

import dataclasses
import logging
import random
import time
from collections.abc import Awaitable, Callable

import torch
import trio

from ...errors import HopFailed, PeerMisbehaved
from ...model.lora import Adapter
from ...model.train_head import IGNORE, embed_batch, loss_and_grad, loss_sum
from ...model.training_state import TrainingState
from ...proofs.inference import tolerance
from ...proofs.training import TrainClaim, TrainFailureReport, parts_error
from .planner import SwarmPlanner
from .spotcheck import Penalties
from .train_hop import Answer, TrainHop, open_train_hop

log = logging.getLogger(__name__)

MAX_ATTEMPTS = 4  # servers tried for one stage's request before the step fails
REPLAN_WAIT_S = 30.0


@dataclasses.dataclass
class StepStats:
    step: int
    loss: float
    tokens: int  # counted targets
    seconds: float
    grad_norm: float
    failovers: int = 0
    checks: int = 0


class Stage:
    """Blocks start:end of the route, computed by one server (or, after a failover,
    by the several that cover them in a row)."""

    def __init__(self, start: int, end: int, hops: list[TrainHop]) -> None:
        self.start, self.end, self.hops = start, end, hops

    async def forward(self, hidden: torch.Tensor, adapter: Adapter | None) -> tuple[torch.Tensor, list[Answer]]:
        answers = []
        for hop in self.hops:
            answers.append(await hop.forward(hidden, _slice(adapter, hop)))
            hidden = answers[-1].tensor
        return hidden, answers

    async def backward(self, hidden: torch.Tensor, grad: torch.Tensor, adapter: Adapter | None
                       ) -> tuple[torch.Tensor, dict[str, torch.Tensor], list[Answer]]:
        inputs = [hidden]
        for hop in self.hops[:-1]:  # the inner boundaries' inputs, recomputed
            inputs.append((await hop.forward(inputs[-1], _slice(adapter, hop))).tensor)
        grads: dict[str, torch.Tensor] = {}
        answers = []
        for hop, x in zip(reversed(self.hops), reversed(inputs)):
            answers.append(await hop.backward(x, grad, _slice(adapter, hop)))
            grad = answers[-1].tensor
            grads.update(answers[-1].grads)
        return grad, grads, answers

    async def close(self) -> None:
        for hop in self.hops:
            await hop.close()


def _slice(adapter: Adapter | None, hop: TrainHop) -> Adapter | None:
    return None if adapter is None else adapter.span(hop.start, hop.end)


class SwarmTrainer:
    def __init__(self, host, planner: SwarmPlanner, model_id: str, head, state: TrainingState, *,
                 spot_check_rate: float = 0.05, penalties: Penalties | None = None,
                 on_report: Callable[[TrainFailureReport], object] | None = None,
                 rng: random.Random | None = None) -> None:
        self.host, self.planner, self.model_id, self.head, self.state = host, planner, model_id, head, state
        self.spot_check_rate = spot_check_rate
        self.penalties = penalties or planner.penalties
        self.on_report = on_report
        self.rng = rng or random.Random()
        self.stages: list[Stage] = []
        self.failovers, self.checks = 0, 0
        self.reports: list[TrainFailureReport] = []
        self.mismatches: list[str] = []  # peers a check found wrong
        self.compared: list[tuple[str, str, float]] = []  # every check's (peer, peer, relative error)
        self._head_limiter = trio.CapacityLimiter(1)

    async def open(self) -> None:
        route = await self.planner.first_route()
        self.stages = [await self._open_stage(hop.start, hop.end, [hop]) for hop in route]

    async def _open_stage(self, start: int, end: int, hops) -> Stage:
        opened = []
        try:
            for hop in hops:
                opened.append(await open_train_hop(self.host, hop, self.model_id))
        except BaseException:
            for hop in opened:
                await hop.close()
            raise
        return Stage(start, end, opened)

    async def close(self) -> None:
        for stage in self.stages:
            await stage.close()

    @property
    def route(self) -> list[tuple[str, int, int]]:
        return [(hop.peer_id, hop.start, hop.end) for stage in self.stages for hop in stage.hops]

    # ------------------------------------------------------------ failover

    async def _on_stage(self, index: int, work):
        """`work(stage)`, on a replacement stage when a server fails (at most MAX_ATTEMPTS)."""
        for attempt in range(MAX_ATTEMPTS):
            stage = self.stages[index]
            try:
                return await work(stage)
            except HopFailed as exc:
                if attempt == MAX_ATTEMPTS - 1:
                    raise
                log.info("training request failed on %s (%s): replacing blocks %d:%d", exc.peer_id[-8:], exc.code,
                         stage.start, stage.end)
                self.penalties.fault(exc.peer_id, time.monotonic())
                await self._replace(index, stage)
        raise AssertionError("unreachable")  # pragma: no cover

    async def _replace(self, index: int, failed: Stage) -> None:
        if self.stages[index] is not failed:  # another microbatch replaced it meanwhile
            return
        hops = await self.planner.plan(failed.start, failed.end, deadline=trio.current_time() + REPLAN_WAIT_S)
        stage = await self._open_stage(failed.start, failed.end, hops)
        if self.stages[index] is failed:
            self.stages[index] = stage
            self.failovers += 1
            await failed.close()
        else:
            await stage.close()

    # ------------------------------------------------------------ steps

    async def gradients(self, microbatches: list[tuple[torch.Tensor, torch.Tensor]]
                        ) -> tuple[float, int, dict[str, torch.Tensor]]:
        """(the step's loss, its counted targets, the gradient of every adapter tensor)
        for `microbatches` ([B, T] input ids, [B, T] labels each), with the current adapter."""
        adapter = self.state.adapter()
        total = sum(int((labels != IGNORE).sum()) for _, labels in microbatches)
        if total == 0:
            raise ValueError("the step's microbatches count no targets")
        results: list = [None] * len(microbatches)
        async with trio.open_nursery() as nursery:
            for i, (ids, labels) in enumerate(microbatches):
                nursery.start_soon(self._microbatch, i, ids, labels, total, adapter, results)
        grads = {name: torch.zeros_like(p) for name, p in self.state.params.items()}
        loss = 0.0
        for mb_loss, mb_grads in results:  # in microbatch order: the same sums whatever finished first
            loss += mb_loss
            for name, g in mb_grads.items():
                grads[name] += g
        return loss, total, grads

    async def step(self, microbatches: list[tuple[torch.Tensor, torch.Tensor]]) -> StepStats:
        """One optimizer step over `microbatches`; then each server is sent a receipt (karma)."""
        began, failovers, checks = time.perf_counter(), self.failovers, self.checks
        loss, total, grads = await self.gradients(microbatches)
        norm = self.state.apply(grads)
        for stage in self.stages:
            for hop in stage.hops:
                await hop.receipt()
        return StepStats(self.state.step, loss, total, time.perf_counter() - began, norm,
                         self.failovers - failovers, self.checks - checks)

    async def _forward(self, hidden: torch.Tensor, adapter: Adapter | None) -> list[torch.Tensor]:
        inputs = [hidden]
        for index in range(len(self.stages)):
            x = inputs[-1]
            out, answers = await self._on_stage(index, lambda s, x=x: s.forward(x, adapter))
            if len(answers) == 1 and self._check_due():
                out = (await self._check(index, answers[0], lambda v, x=x: v.forward(x, _slice(adapter, v)))).tensor
            inputs.append(out)
        return inputs

    async def _microbatch(self, i: int, ids: torch.Tensor, labels: torch.Tensor, total: int, adapter: Adapter,
                          results: list) -> None:
        inputs = await self._forward(embed_batch(self.head, ids), adapter)
        # Off the event loop (a 128k-token vocabulary's head is seconds of CPU), one at a time.
        loss, grad = await trio.to_thread.run_sync(loss_and_grad, self.head, inputs[-1], labels, total,
                                                   limiter=self._head_limiter)
        grads: dict[str, torch.Tensor] = {}
        for index in reversed(range(len(self.stages))):
            x, g_out = inputs[index], grad
            grad, stage_grads, answers = await self._on_stage(index, lambda s, x=x, g=g_out: s.backward(x, g, adapter))
            if len(answers) == 1 and self._check_due():
                good = await self._check(index, answers[0], lambda v, x=x, g=g_out: v.backward(x, g, _slice(adapter, v)))
                grad, stage_grads = good.tensor, good.grads
            grads.update(stage_grads)
        results[i] = (loss, grads)

    async def evaluate(self, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> float:
        """Mean cross-entropy per counted target over `batches`, with the current adapter."""
        adapter, total, loss = self.state.adapter(), 0, 0.0
        for ids, labels in batches:
            inputs = await self._forward(embed_batch(self.head, ids), adapter)
            loss += loss_sum(self.head, inputs[-1], labels)
            total += int((labels != IGNORE).sum())
        return loss / max(total, 1)

    # ------------------------------------------------------------ spot checks

    def _check_due(self) -> bool:
        return self.spot_check_rate > 0 and self.rng.random() < self.spot_check_rate

    async def _check(self, index: int, first: Answer, again: Callable[[TrainHop], Awaitable[Answer]]) -> Answer:
        """A spot check of `first` (stage `index`'s one server's answer): `again` on a
        second server of its blocks; on a mismatch, on a third, which decides. Returns
        the answer to use (the agreeing one)."""
        tol = tolerance(first.mode, first.end - first.start)
        second = await self._recompute(first, {first.peer_id}, again)
        if second is None or self._error(first, second) <= tol:
            return first
        third = await self._recompute(first, {first.peer_id, second.peer_id}, again)
        if third is None:
            log.warning("%s and %s disagree on blocks %d:%d; no third server to decide", first.peer_id,
                        second.peer_id, first.start, first.end)
            return first
        if self._error(third, second) <= tol:
            bad, good = first, second
        elif self._error(third, first) <= tol:
            bad, good = second, first
        else:
            log.warning("three servers disagree on blocks %d:%d; keeping the first answer", first.start, first.end)
            return first
        self.penalties.mismatch(bad.peer_id, time.monotonic())
        self.mismatches.append(bad.peer_id)
        await self._file(bad, good)
        stage = self.stages[index]
        if bad is first and any(hop.peer_id == bad.peer_id for hop in stage.hops):
            await self._replace(index, stage)  # the step goes on with the honest answer
        return good

    async def _file(self, bad: Answer, good: Answer) -> None:
        """A failure report of two signed, conflicting answers: anyone can verify it."""
        report = TrainFailureReport(bad.mode, self.model_id, bad.start, bad.end, bad.input_digest,
                                    tuple((name, len(data) // 4) for name, data in bad.parts),
                                    TrainClaim(bad.peer_id, b"".join(d for _, d in bad.parts), bad.signature),
                                    TrainClaim(good.peer_id, b"".join(d for _, d in good.parts), good.signature))
        try:
            report.check()
        except PeerMisbehaved as exc:  # e.g. answers in different modes: excluded, not reportable
            log.warning("no failure report against %s: %s", bad.peer_id, exc)
            return
        self.reports.append(report)
        log.warning("spot check: %s computed blocks %d:%d wrongly; failure report %s", bad.peer_id, bad.start,
                    bad.end, report.digest[:12])
        if self.on_report is not None:
            await self.on_report(report)

    async def _recompute(self, first: Answer, exclude: set[str], again) -> Answer | None:
        verifier = await self._verifier(first.start, first.end, exclude)
        if verifier is None:
            return None
        self.checks += 1
        try:
            return await again(verifier)
        except HopFailed as exc:
            log.info("spot check on %s failed: %s", exc.peer_id[-8:], exc)
            return None
        finally:
            await verifier.close()

    async def _verifier(self, start: int, end: int, exclude: set[str]) -> TrainHop | None:
        for _ in range(MAX_ATTEMPTS):
            candidate = self.planner.verifier(start, end, exclude)
            if candidate is None:
                return None
            try:
                return await open_train_hop(self.host, candidate, self.model_id)
            except HopFailed:
                exclude = exclude | {candidate.peer_id}
        return None

    def _error(self, a: Answer, b: Answer) -> float:
        error = parts_error(a.parts, b.parts)
        self.compared.append((a.peer_id, b.peer_id, error))
        return error

