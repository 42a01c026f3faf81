"""Standby replicas, sans I/O: per span of the route, a session on another server of
the same blocks, fed every step of the span's history as it was first computed
(chain_plan.replay_plan: same chunks, same rollbacks), so its KV cache is
bit-identical to the hop's. A failover then takes the standby over and replays
only the steps it has not seen yet (normally the last one), instead of the whole
history: at 1,000 tokens that is the difference between about one decode step
and a prefill of the span (or, exactly, 1,000 decode steps).

The cost is the span's compute once more, on another server, off the critical
path: a standby's feed goes beside the step's first requests, one step behind
(its input is the hop's input, known once the step is through), with its replies
cut to the last token. Opening one costs one round trip before a step, and its
first feed replays the whole history beside that step. A per-session choice
(RunRequest.standby). Functions of the chain core (chain_core.py); the takeover
itself is a failover's (chain_rebuild.py)."""

from __future__ import annotations

import dataclasses
import logging
import math

from .chain_events import (
    Abort, Close, Failed, FindVerifier, HopSession, HopStepRequest, OpenSession, Phase, SendSteps, Span,
    count_answered,
)
from .chain_plan import StandbyFeed, Verifier, replay_plan
from .chain_state import ChainState

log = logging.getLogger(__name__)

# A span without a standby looks for one again after this many steps: a look-up is
# the planner's, local (no round trip), and the planner refreshes its candidates when
# one finds none (planner.SwarmPlanner.verifier), so a restarted replica is taken as
# soon as the consumer sees it serve again.
STANDBY_RETRY_STEPS = 2


@dataclasses.dataclass
class StandbySearch:
    """Standbys being found for `spans`, then opened (`found`)."""

    spans: list[Span]
    found: list[tuple[Span, HopSession]] = dataclasses.field(default_factory=list)


def look_for_standbys(core: ChainState) -> bool:
    """Before a step: close the standbys of spans gone from the route, look for
    standbys for spans without one (again every STANDBY_RETRY_STEPS steps); whether
    that is under way (else every standby's feed is queued)."""
    if not (core.standby and core.can_fail_over):
        return False
    steps = len(core.history.sizes)
    spans = {s.span for s in core.hops}
    for span in [span for span in core.standbys if span not in spans]:  # the route changed
        core.effect(Close(core.standbys.pop(span).session))
    missing = [span for span in dict.fromkeys(s.span for s in core.hops)
               if span not in core.standbys and steps - core.standby_tried.get(span, -math.inf)
               >= STANDBY_RETRY_STEPS]
    if not missing:
        queue_feeds(core)
        return False
    for span in missing:
        core.standby_tried[span] = steps
    exclude = frozenset(s.peer_id for s in core.hops) | {v.session.peer_id for v in core.standbys.values()}
    core.request([FindVerifier(*span, exclude) for span in missing], Phase.FINDING_STANDBYS,
                 StandbySearch(missing))
    return True


def standbys_found(core: ChainState, search: StandbySearch, events: list) -> None:
    search.found = [(span, HopSession(event.hop)) for span, event in zip(search.spans, events)
                    if event.hop is not None]
    if not search.found:
        queue_feeds(core)
        return core.link_and_step()
    core.request([OpenSession(session) for _, session in search.found], Phase.OPENING_STANDBYS, search)


def standbys_opened(core: ChainState, search: StandbySearch, events: list) -> None:
    for (span, session), event in zip(search.found, events):
        if isinstance(event, Failed):
            log.info("no standby for blocks %d:%d now: %s", *span, event.error)
            core.penalise(event.error)
            continue
        core.forgive(session)
        core.standbys[span] = Verifier(session)
        log.info("standby for blocks %d:%d: %s", *span, session.peer_id)
    queue_feeds(core)
    core.link_and_step()


def feed_plan(core: ChainState, span: Span, fed: int) -> tuple[HopStepRequest, ...]:
    """The requests bringing a standby that has seen `fed` steps up to the history."""
    history = core.history
    return replay_plan(history.at(span[0])[fed:], history.sizes[fed:], core.replay_max_tokens,
                       history.computed[fed:], position=sum(history.sizes[:fed]), rollback=True,
                       last_only=True)


def queue_feeds(core: ChainState) -> None:
    """Every standby's missed steps, sent beside the step's first requests."""
    steps = len(core.history.sizes)
    for span, standby in core.standbys.items():
        if standby.fed < steps:
            request = SendSteps(standby.session, feed_plan(core, span, standby.fed))
            core.side_feeds.append(StandbyFeed(span, standby, steps, request))


def feed_current(core: ChainState, session: HopSession) -> None:
    """The step's input to `session`'s standby beside the hop's own request, when
    it is known before the hop answers (a relayed hop, the first hop): no lag."""
    standby = core.standbys.get(session.span)
    steps = len(core.history.sizes)
    if standby is None or standby.fed != steps or any(f.request.session is standby.session
                                                      for f in core.side_feeds):
        return
    step = core.step
    request = HopStepRequest(core.position, (step.hidden,), (step.tokens,), last_only=True, rollback=True)
    core.side_feeds.append(StandbyFeed(session.span, standby, steps + 1, SendSteps(standby.session, (request,))))


def fed(core: ChainState, feed: StandbyFeed, event) -> None:
    """A feed's answer: the standby has seen its steps, or is dropped."""
    count_answered(feed.standby.session, event)
    if isinstance(event, Failed):
        log.info("dropping the standby of blocks %d:%d: %s", *feed.span, event.error)
        drop_standby(core, feed.span, feed.standby)
        core.penalise(event.error)
        return
    feed.standby.fed = feed.steps


def drop_standby(core: ChainState, span: Span, standby: Verifier) -> None:
    if core.standbys.get(span) is standby:
        del core.standbys[span]
    core.retired.append(standby.session)
    core.effect(Abort(standby.session))


def takeover_plan(core: ChainState, span: Span, standby: Verifier) -> tuple[HopStepRequest, ...]:
    """What a standby taking over `span` computes: the steps it missed and this one,
    as first computed. It may have this step already (fed beside the hop): the
    rollback drops it, and it computes the step again, the same way."""
    step = core.step
    current = HopStepRequest(core.position, (step.hidden,), (step.tokens,), rollback=True)
    return feed_plan(core, span, min(standby.fed, len(core.history.sizes))) + (current,)
