"""Replacements for a failed span, sans I/O: find a route through its blocks, open
each hop of it and replay the span's history through it (chain_plan.replay_plan);
an open or a replay that fails is penalised and the rest of the span re-planned."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from typing import Any

from ...errors import HopFailed
from .chain_events import Abort, Failed, FindRoute, OpenSession, RouteFound, SendSteps, Session
from .chain_machine import Machine
from .chain_plan import replay_plan
from .routing import Hop

log = logging.getLogger(__name__)


@dataclasses.dataclass
class Rebuild:
    """Replacements being found for blocks start..end-1."""

    start: int
    end: int
    steps: list[Any]  # the inputs at `position`, one per step
    sizes: list[int]  # their tokens kept
    computed: list[int]  # ... and as computed (chain_plan.History)
    done: Callable[[list[Session], list[Any]], None]  # (new hops, the outputs at `end`)
    position: int = 0  # blocks start..position-1 are covered by `new`
    route: list[Hop] = dataclasses.field(default_factory=list)  # planned, not yet opened
    new: list[Session] = dataclasses.field(default_factory=list)
    boundaries: dict[int, list[Any]] = dataclasses.field(default_factory=dict)  # new ones inside the span


class Rebuilding(Machine):
    def _rebuild(self, start: int, end: int, steps: list[Any], sizes: list[int], computed: list[int],
                 done: Callable[[list[Session], list[Any]], None]) -> None:
        """Servers covering start..end-1 with `steps` (the inputs at `start`, one per
        step, `sizes` tokens each kept, `computed` as computed) replayed through them;
        `done` gets the new hops and the outputs at `end`, one per step."""
        self._find_route(Rebuild(start, end, steps, sizes, computed, done, position=start), fresh=True)

    def _find_route(self, rebuild: Rebuild, *, fresh: bool) -> None:
        def found(events: list) -> None:
            event: RouteFound = events[0]
            rebuild.route = list(event.hops)
            self._next_replacement(rebuild)

        self._request([FindRoute(rebuild.position, rebuild.end, fresh)], found, "replanning")

    def _next_replacement(self, rebuild: Rebuild) -> None:
        if rebuild.position >= rebuild.end:
            self.history.inputs.update(rebuild.boundaries)
            return rebuild.done(rebuild.new, rebuild.steps)
        if not rebuild.route:
            return self._find_route(rebuild, fresh=False)
        session = Session(rebuild.route.pop(0))
        self._request([OpenSession(session)],
                      lambda events: self._replacement_opened(rebuild, session, events[0]),
                      "opening a replacement")

    def _replacement_opened(self, rebuild: Rebuild, session: Session, event) -> None:
        if isinstance(event, Failed):
            return self._replacement_failed(rebuild, None, event.error)
        self._opened_ok(session)
        plan = replay_plan(rebuild.steps, rebuild.sizes, self.replay_max_tokens, rebuild.computed)
        if not plan:
            return self._replayed(rebuild, session, [])
        self._request([SendSteps(session, plan)], lambda events: self._replay_answered(rebuild, session, events[0]),
                      "replaying")

    def _replay_answered(self, rebuild: Rebuild, session: Session, event) -> None:
        self._count(session, event)
        if isinstance(event, Failed):
            return self._replacement_failed(rebuild, session, event.error)
        self._replayed(rebuild, session, list(event.parts))

    def _replayed(self, rebuild: Rebuild, session: Session, outputs: list[Any]) -> None:
        rebuild.new.append(session)
        rebuild.position = session.hop.end
        if rebuild.position < rebuild.end:
            rebuild.boundaries[rebuild.position] = outputs  # a new boundary inside the span
        rebuild.steps = outputs
        self._next_replacement(rebuild)

    def _replacement_failed(self, rebuild: Rebuild, session: Session | None, error: HopFailed) -> None:
        log.warning("%s; replanning blocks %d:%d", error, rebuild.position, rebuild.end)
        self._penalise(error)
        if session is not None:  # opened, then failed in the replay
            self.retired.append(session)
            self._effect(Abort(session))
        self._find_route(rebuild, fresh=False)
