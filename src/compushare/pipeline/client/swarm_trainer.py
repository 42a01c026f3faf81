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
compared within the format's tolerance (proofs.TOLERANCES); on a mismatch a third
decides, the one it contradicts is excluded and a signed TrainFailureReport is
filed, as for inference, and the step uses the agreeing gradients.
"""

from __future__ import annotations

import dataclasses
import logging
import random
import time
from collections.abc import Callable

import numpy as np
import torch
import trio

from ...errors import HopFailed
from ...model.lora import Adapter
from ...model.train_head import IGNORE, embed_batch, loss_and_grad, loss_sum
from ...model.training_state import TrainingState
from ...proofs import TrainClaim, TrainFailureReport, relative_error, tolerance
from .planner import SwarmPlanner
from .spotcheck import Penalties
from .train_hop import Gradients, TrainHop, open_train_hop

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

    async def forward(self, hidden: torch.Tensor, adapter: Adapter | None) -> torch.Tensor:
        for hop in self.hops:
            hidden = await hop.forward(hidden, _slice(adapter, hop))
        return hidden

    async def backward(self, hidden: torch.Tensor, grad: torch.Tensor, adapter: Adapter | None
                       ) -> tuple[torch.Tensor, dict[str, torch.Tensor], list[tuple[TrainHop, Gradients]]]:
        inputs = [hidden]
        for hop in self.hops[:-1]:  # the inner boundaries' inputs, recomputed
            inputs.append(await hop.forward(inputs[-1], _slice(adapter, hop)))
        grads: dict[str, torch.Tensor] = {}
        answers = []
        for hop, x in zip(reversed(self.hops), reversed(inputs)):
            answer = await hop.backward(x, grad, _slice(adapter, hop))
            answers.append((hop, answer))
            grad = answer.grad_input
            grads.update(answer.grads)
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
            inputs.append(await self._on_stage(index, lambda s, x=inputs[-1]: s.forward(x, adapter)))
        return inputs

    async def _microbatch(self, i: int, ids: torch.Tensor, labels: torch.Tensor, total: int, adapter: Adapter,
                          results: list) -> None:
        inputs = await self._forward(embed_batch(self.head, ids), adapter)
        loss, grad = loss_and_grad(self.head, inputs[-1], labels, total)
        grads: dict[str, torch.Tensor] = {}
        for index in reversed(range(len(self.stages))):
            x, g_out = inputs[index], grad
            grad, stage_grads, answers = await self._on_stage(index, lambda s, x=x, g=g_out: s.backward(x, g, adapter))
            if len(answers) == 1 and self._check_due():
                stage_grads, grad = await self._spot_check(index, x, g_out, answers[0], adapter, stage_grads, grad)
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

    async def _spot_check(self, index: int, x: torch.Tensor, grad_output: torch.Tensor,
                          answer: tuple[TrainHop, Gradients], adapter: Adapter, grads: dict, grad_input: torch.Tensor):
        """Compute the backward again on another server of the span; on a mismatch a
        third decides. Returns the gradients to use (the agreeing ones)."""
        hop, first = answer
        verifier = await self._verifier(hop.start, hop.end, {hop.peer_id})
        if verifier is None:
            return grads, grad_input
        self.checks += 1
        try:
            second = await verifier.backward(x, grad_output, _slice(adapter, verifier))
        except HopFailed as exc:
            log.info("spot check on %s failed: %s", exc.peer_id[-8:], exc)
            return grads, grad_input
        finally:
            await verifier.close()
        mode = hop.format or "fp32"
        if _error(first, second) <= tolerance(mode, hop.end - hop.start):
            return grads, grad_input
        judge = await self._verifier(hop.start, hop.end, {hop.peer_id, verifier.peer_id})
        if judge is None:
            log.warning("gradients of %s and %s differ; no third server to decide", hop.peer_id, verifier.peer_id)
            return grads, grad_input
        try:
            third = await judge.backward(x, grad_output, _slice(adapter, judge))
        finally:
            await judge.close()
        tol = tolerance(mode, hop.end - hop.start)
        liar, honest, good = (hop, verifier, second) if _error(third, second) <= tol else (verifier, hop, first)
        if _error(third, good) > tol:
            log.warning("three servers disagree on blocks %d:%d; keeping the first answer", hop.start, hop.end)
            return grads, grad_input
        bad = first if liar is hop else second
        self.penalties.mismatch(liar.peer_id, time.monotonic())
        self.mismatches.append(liar.peer_id)
        report = TrainFailureReport(mode, self.model_id, hop.start, hop.end, first.input_digest,
                                    tuple((name, len(data) // 4) for name, data in bad.parts),
                                    TrainClaim(liar.peer_id, b"".join(d for _, d in bad.parts), bad.signature),
                                    TrainClaim(honest.peer_id, b"".join(d for _, d in good.parts), good.signature))
        report.check()
        self.reports.append(report)
        if self.on_report is not None:
            await self.on_report(report)
        log.warning("spot check: %s's gradients for blocks %d:%d were wrong; report %s", liar.peer_id,
                    hop.start, hop.end, report.digest[:12])
        if liar is hop:  # the step goes on with the honest gradients; the liar's stage is replaced
            await self._replace(index, self.stages[index])
            return good.grads, good.grad_input
        return grads, grad_input

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


def _error(a: Gradients, b: Gradients) -> float:
    """The largest relative error of any one part (proofs.TrainFailureReport.error)."""
    if [n for n, _ in a.parts] != [n for n, _ in b.parts]:
        return float("inf")
    return max(relative_error(np.frombuffer(x, "<f4"), np.frombuffer(y, "<f4"))
               for (_, x), (_, y) in zip(a.parts, b.parts))

