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
(RunRequest.standby)."""

from __future__ import annotations

import logging
import math

from .chain_events import Abort, Close, Failed, FindVerifier, OpenSession, SendSteps, Session, StepRequest
from .chain_machine import Machine, Span
from .chain_plan import Failover, Verifier, replay_plan

log = logging.getLogger(__name__)

STANDBY_RETRY_STEPS = 8  # a span without a standby looks for one again after this many steps


class Standbys(Machine):
    def _prepare_standbys(self, then) -> None:
        """Before a step: open standbys for spans without one (looked for again every
        STANDBY_RETRY_STEPS steps), queue every standby's feed; then `then()`."""
        if not (self.standby and self.can_fail_over):
            return then()
        steps = len(self.history.sizes)
        spans = {s.span for s in self.hops}
        for span in [span for span in self.standbys if span not in spans]:  # the route changed
            self._effect(Close(self.standbys.pop(span).session))
        missing = [span for span in dict.fromkeys(s.span for s in self.hops)
                   if span not in self.standbys and steps - self._standby_tried.get(span, -math.inf)
                   >= STANDBY_RETRY_STEPS]
        if not missing:
            self._queue_feeds()
            return then()
        for span in missing:
            self._standby_tried[span] = steps
        exclude = frozenset(s.peer_id for s in self.hops) | {v.session.peer_id for v in self.standbys.values()}
        self._request([FindVerifier(*span, exclude) for span in missing],
                      lambda events: self._standbys_found(missing, events, then), "finding standbys")

    def _standbys_found(self, spans: list[Span], events: list, then) -> None:
        found = [(span, Session(event.hop)) for span, event in zip(spans, events) if event.hop is not None]
        if not found:
            self._queue_feeds()
            return then()
        self._request([OpenSession(session) for _, session in found],
                      lambda events: self._standbys_opened(found, events, then), "opening standbys")

    def _standbys_opened(self, found: list[tuple[Span, Session]], events: list, then) -> None:
        for (span, session), event in zip(found, events):
            if isinstance(event, Failed):
                log.info("no standby for blocks %d:%d now: %s", *span, event.error)
                self._penalise(event.error)
                continue
            self._opened_ok(session)
            self.standbys[span] = Verifier(session)
            log.info("standby for blocks %d:%d: %s", *span, session.peer_id)
        self._queue_feeds()
        then()

    def _feed_plan(self, span: Span, fed: int) -> tuple[StepRequest, ...]:
        """The requests bringing a standby that has seen `fed` steps up to the history."""
        history = self.history
        return replay_plan(history.at(span[0])[fed:], history.sizes[fed:], self.replay_max_tokens,
                           history.computed[fed:], position=sum(history.sizes[:fed]), rollback=True,
                           last_only=True)

    def _queue_feeds(self) -> None:
        """Every standby's missed steps, sent beside the step's first requests."""
        steps = len(self.history.sizes)
        for span, standby in self.standbys.items():
            if standby.fed < steps:
                self._side.append((SendSteps(standby.session, self._feed_plan(span, standby.fed)),
                                   lambda event, span=span, standby=standby: self._fed(span, standby, steps, event)))

    def _feed_current(self, session: Session) -> None:
        """The step's input to `session`'s standby beside the hop's own request, when
        it is known before the hop answers (a relayed hop, the first hop): no lag."""
        standby = self.standbys.get(session.span)
        steps = len(self.history.sizes)
        if standby is None or standby.fed != steps or any(r.session is standby.session for r, _ in self._side):
            return
        step = self._step
        request = StepRequest(self.position, (step.hidden,), (step.tokens,), last_only=True, rollback=True)
        self._side.append((SendSteps(standby.session, (request,)),
                           lambda event: self._fed(session.span, standby, steps + 1, event)))

    def _fed(self, span: Span, standby: Verifier, steps: int, event) -> None:
        self._count(standby.session, event)
        if isinstance(event, Failed):
            log.info("dropping the standby of blocks %d:%d: %s", *span, event.error)
            self._drop_standby(span, standby)
            self._penalise(event.error)
            return
        standby.fed = steps

    def _drop_standby(self, span: Span, standby: Verifier) -> None:
        if self.standbys.get(span) is standby:
            del self.standbys[span]
        self.retired.append(standby.session)
        self._effect(Abort(standby.session))

    def _take_over(self, index: int, failed: Session, record: Failover, otherwise) -> bool:
        """Replace the failed hop by its span's standby, if it has one: the steps it
        missed and this one, as first computed. Whether one was there (else the
        caller's `otherwise()` replays the history on a replacement)."""
        standby = self.standbys.pop(failed.span, None)
        if standby is None:
            log.info("no standby for blocks %d:%d (standbys: %s)", *failed.span, sorted(self.standbys))
            return False
        step = self._step
        # It may have this step already (fed beside the hop): the rollback drops it, and
        # it computes the step again, the same way.
        current = StepRequest(self.position, (step.hidden,), (step.tokens,), rollback=True)
        plan = self._feed_plan(failed.span, min(standby.fed, len(self.history.sizes))) + (current,)

        def answered(events: list) -> None:
            event = events[0]
            self._count(standby.session, event)
            if isinstance(event, Failed):
                log.warning("the standby of blocks %d:%d failed too: %s", *failed.span, event.error)
                self._drop_standby(failed.span, standby)
                self._penalise(event.error)
                return otherwise()
            self.hops[index] = standby.session
            self.history.at(failed.span[0]).append(step.hidden)
            record.recovered = self.clock()
            record.replacements = (standby.session.peer_id,)
            self.standby_takeovers += 1
            self._standby_tried.pop(failed.span, None)  # a new standby for it, at the next step
            step.index += 1
            step.hidden = event.replies[-1].output
            self._enter_hop()

        self._request([SendSteps(standby.session, plan)], answered, "taking over")
        return True
