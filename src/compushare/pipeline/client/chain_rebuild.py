"""Opening a route and replacing what fails in it, sans I/O: a hop that cannot be
opened, or fails in a step, is penalised and its span rebuilt: a route found
through its blocks, each hop of it opened and the span's history replayed through
it (chain_plan.replay_plan; with the chain's fast_replay, in few forwards:
replay_for); an open or a replay that fails is penalised and the rest of the span
re-planned. A hop failing in a step is first taken over by its
span's standby, if it has one (chain_standby.py). Functions of the chain core
(chain_core.py)."""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

from ...errors import HopFailed
from . import chain_standby
from .chain_events import (
    Abort, Failed, FindRoute, HopSession, OpenSession, Phase, SendSteps, SessionOpened, count_answered,
)
from .chain_plan import Failover, Verifier, catch_up_plan, kept_inputs, replay_plan
from .chain_state import ChainState
from .routing import Hop

log = logging.getLogger(__name__)


@dataclasses.dataclass
class Opening:
    """The route's sessions being opened: the answers, and how far they are taken
    (a hop that failed is rebuilt before the next is taken)."""

    sessions: list[HopSession]
    events: list = dataclasses.field(default_factory=list)
    index: int = 0


@dataclasses.dataclass
class FailingOver:
    """The hop at `index` of the route failed in the step under way."""

    index: int
    failed: HopSession
    record: Failover


@dataclasses.dataclass
class TakingOver:
    """A standby computing the steps it missed, to replace the failed hop."""

    failing: FailingOver
    standby: Verifier


@dataclasses.dataclass
class Rebuild:
    """Replacements being found for blocks start..end-1, then going on with `then`."""

    start: int
    end: int
    steps: list[Any]  # the inputs at `position`, one per step
    sizes: list[int]  # their tokens kept
    computed: list[int]  # ... and as computed (chain_plan.History)
    then: Opening | FailingOver  # the new hops go into the route being opened, or replace the failed hop
    position: int = 0  # blocks start..position-1 are covered by `new`
    route: list[Hop] = dataclasses.field(default_factory=list)  # planned, not yet opened
    new: list[HopSession] = dataclasses.field(default_factory=list)
    boundaries: dict[int, list[Any]] = dataclasses.field(default_factory=dict)  # new ones inside the span


@dataclasses.dataclass
class Replacement:
    """`session`, a hop of the rebuild's route, being opened, then replayed."""

    rebuild: Rebuild
    session: HopSession
    last_only: bool = False  # its replay answers the step's output only (a fast replay's last hop)


# -- opening -------------------------------------------------------------------------------

def opened(core: ChainState, opening: Opening, events: list) -> None:
    core.hops = []
    for session, event in zip(opening.sessions, events):
        if isinstance(event, SessionOpened):
            core.forgive(session)
    opening.events = events
    keep_opened(core, opening)


def keep_opened(core: ChainState, opening: Opening) -> None:
    """The opened hops into the route, in order; a hop that failed is rebuilt in place."""
    while opening.index < len(opening.sessions):
        session, event = opening.sessions[opening.index], opening.events[opening.index]
        opening.index += 1
        if isinstance(event, SessionOpened):
            core.hops.append(session)
            continue
        if not core.can_fail_over:
            raise event.error
        core.penalise(event.error)
        log.warning("%s; choosing another server for blocks %d:%d", event.error, *session.span)
        return rebuild_span(core, Rebuild(session.hop.start, session.hop.end, [], [], [], opening))


# -- failover ------------------------------------------------------------------------------

def fail_over(core: ChainState, error: HopFailed) -> None:
    """The current hop failed: its standby takes over, or its span is rebuilt."""
    if not core.can_fail_over:
        raise error
    index = core.step.index
    failed = core.hops[index]
    start, end = failed.span
    record = Failover(failed.peer_id, start, end, error.code, core.clock())
    core.failovers.append(record)
    log.warning("%s; failing over blocks %d:%d at position %d", error, start, end, core.position)
    core.penalise(error)
    core.retired.append(failed)
    core.effect(Abort(failed))
    core.rollback.discard(failed)
    failing = FailingOver(index, failed, record)
    if not take_over(core, failing):
        replace(core, failing)


def take_over(core: ChainState, failing: FailingOver) -> bool:
    """Ask the failed hop's standby, if it has one, for the steps it missed and this
    one; whether there was one."""
    span = failing.failed.span
    standby = core.standbys.pop(span, None)
    if standby is None:
        log.info("no standby for blocks %d:%d (standbys: %s)", *span, sorted(core.standbys))
        return False
    plan = chain_standby.takeover_plan(core, span, standby)
    core.request([SendSteps(standby.session, plan)], Phase.TAKING_OVER, TakingOver(failing, standby))
    return True


def taken_over(core: ChainState, taking: TakingOver, events: list) -> None:
    [event] = events
    failing, standby, step = taking.failing, taking.standby, core.step
    span = failing.failed.span
    count_answered(standby.session, event)
    if isinstance(event, Failed):
        log.warning("the standby of blocks %d:%d failed too: %s", *span, event.error)
        chain_standby.drop_standby(core, span, standby)
        core.penalise(event.error)
        return replace(core, failing)
    core.hops[failing.index] = standby.session
    core.history.at(span[0]).append(step.hidden)
    failing.record.recovered = core.clock()
    failing.record.replacements = (standby.session.peer_id,)
    core.standby_takeovers += 1
    core.standby_tried.pop(span, None)  # a new standby for it, at the next step
    step.index += 1
    step.hidden = event.replies[-1].output
    core.enter_hop()


def replace(core: ChainState, failing: FailingOver) -> None:
    """Rebuild the failed hop's span with its history plus this step's input."""
    step, history = core.step, core.history
    start, end = failing.failed.span
    rebuild_span(core, Rebuild(start, end, history.at(start) + [step.hidden], history.sizes + [step.tokens],
                               history.computed + [step.tokens], failing))


def replaced(core: ChainState, failing: FailingOver, new: list[HopSession], outputs: list) -> None:
    """The new hops in the failed one's place; the step goes on after them."""
    step = core.step
    step.due = None  # drawn per hop of the old route
    core.hops[failing.index:failing.index + 1] = new
    core.history.at(failing.failed.span[0]).append(step.hidden)
    failing.record.recovered = core.clock()
    failing.record.replacements = tuple(s.peer_id for s in new)
    step.index += len(new)
    step.hidden = outputs[-1]
    core.enter_hop()


# -- rebuild -------------------------------------------------------------------------------

def rebuild_span(core: ChainState, rebuild: Rebuild) -> None:
    """Servers covering rebuild.start..end-1 with its steps (the inputs at `start`,
    one per step) replayed through them; then `rebuild.then` goes on."""
    rebuild.position = rebuild.start
    find_route(core, rebuild, fresh=True)


def find_route(core: ChainState, rebuild: Rebuild, *, fresh: bool) -> None:
    core.request([FindRoute(rebuild.position, rebuild.end, fresh)], Phase.REPLANNING, rebuild)


def route_found(core: ChainState, rebuild: Rebuild, events: list) -> None:
    [event] = events
    rebuild.route = list(event.hops)
    next_replacement(core, rebuild)


def next_replacement(core: ChainState, rebuild: Rebuild) -> None:
    if rebuild.position >= rebuild.end:
        core.history.inputs.update(rebuild.boundaries)
        return rebuilt(core, rebuild)
    if not rebuild.route:
        return find_route(core, rebuild, fresh=False)
    replacement = Replacement(rebuild, HopSession(rebuild.route.pop(0)))
    core.request([OpenSession(replacement.session)], Phase.OPENING_REPLACEMENT, replacement)


def replacement_opened(core: ChainState, replacement: Replacement, events: list) -> None:
    [event] = events
    rebuild, session = replacement.rebuild, replacement.session
    if isinstance(event, Failed):
        return replacement_failed(core, rebuild, None, event.error)
    core.forgive(session)
    plan = replay_for(core, replacement)
    if not plan:
        return replayed(core, replacement, [])
    core.request([SendSteps(session, plan)], Phase.REPLAYING, replacement)


def replay_for(core: ChainState, replacement: Replacement) -> tuple:
    """The replacement's replay: the history as computed (bit-identical); with the
    chain's fast_replay, in few forwards (within tolerance), and for the hop ending
    the span, where only the step under way's output goes on (no new boundary), the
    kept tokens in one chunk per request, the step its own last chunk, last rows only
    (chain_plan.catch_up_plan): no request per rejected draft, no history sent back."""
    rebuild = replacement.rebuild
    if not (core.fast_replay and rebuild.steps and replacement.session.hop.end >= rebuild.end):
        return replay_plan(rebuild.steps, rebuild.sizes, core.replay_max_tokens, rebuild.computed,
                           fast=core.fast_replay)
    replacement.last_only = True
    kept = kept_inputs(rebuild.steps, rebuild.sizes, rebuild.computed)
    return catch_up_plan(kept[:-1], rebuild.sizes[:-1], 0, kept[-1], rebuild.sizes[-1], core.replay_max_tokens)


def replay_answered(core: ChainState, replacement: Replacement, events: list) -> None:
    [event] = events
    count_answered(replacement.session, event)
    if isinstance(event, Failed):
        return replacement_failed(core, replacement.rebuild, replacement.session, event.error)
    replayed(core, replacement, [event.replies[-1].output] if replacement.last_only else list(event.parts))


def replayed(core: ChainState, replacement: Replacement, outputs: list[Any]) -> None:
    rebuild, session = replacement.rebuild, replacement.session
    rebuild.new.append(session)
    rebuild.position = session.hop.end
    if rebuild.position < rebuild.end:
        rebuild.boundaries[rebuild.position] = outputs  # a new boundary inside the span
    rebuild.steps = outputs
    next_replacement(core, rebuild)


def replacement_failed(core: ChainState, rebuild: Rebuild, session: HopSession | None, error: HopFailed) -> None:
    log.warning("%s; replanning blocks %d:%d", error, rebuild.position, rebuild.end)
    core.penalise(error)
    if session is not None:  # opened, then failed in the replay
        core.retired.append(session)
        core.effect(Abort(session))
    find_route(core, rebuild, fresh=False)


def rebuilt(core: ChainState, rebuild: Rebuild) -> None:
    """The span is covered: its new hops go into the route being opened, or in the
    failed hop's place."""
    then = rebuild.then
    if isinstance(then, Opening):
        core.hops.extend(rebuild.new)
        return keep_opened(core, then)
    replaced(core, then, rebuild.new, rebuild.steps)
