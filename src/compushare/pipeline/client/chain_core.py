"""The consumer's chain of sessions, sans I/O: a state machine that says which
requests to send and what to make of their answers (chain.py does the sending).

State (chain_machine.Machine, which ChainCore extends):
  hops        the route: one Session per hop, in block order (each knows its Hop span)
  position    tokens every hop's session holds
  history     every step's input at every block boundary, and the steps' sizes
  verifiers   per span, the session recomputing its sampled steps and how many
              steps it has seen (`fed`); schedules: per span, which steps are checked
  failovers, checks, retired (sessions given up, aborted again at close)

Operations: `open(route)` and `start_step(payload, tokens)` begin one; `feed(events)`
answers the requests of the last batch of actions (chain_events.py) and returns the
next batch; the operation is over when a batch holds no request (`idle`, and
`output` holds a step's result). Transitions (phase names in brackets):

  open:  [opening] OpenSession for every hop at once → a hop that failed is penalised
         and rebuilt in place with an empty history (rebuild, below) → idle
  step:  [linking] Link the hops whose neighbours changed (push on) → for each hop:
         sampled for a check? → [finding a verifier] FindVerifier → [opening a
         verifier] OpenSession (failed: penalised, no check) → [stepping] SendSteps on
         the hop (position, one chunk), with a check also on the verifier at once (its
         missed steps batched, last_only) → answers within the tolerance: the hop is
         done, its input kept in the history; a failed verifier is dropped (no check);
         a disagreement → [finding/opening an arbiter] → [arbitrating] SendSteps of the
         whole history on a third session, then Close → judge → FileReport against the
         blamed one, Penalise "mismatch"; the verifier blamed: it is dropped and the
         hop is done; the hop blamed ("primary" or "both"): fail over. The hop failed
         (any code): fail over. After the last hop: position += tokens, then
         [receipts] SendReceipt to every live session answered RECEIPT_STEPS times
         since its last one → idle.
  fail over: Failover recorded, Penalise (fault, or mismatch), Abort the hop → rebuild
         its span with its history plus this step's input → the new hops replace it,
         the last one's output goes on to the next hop.
  rebuild: [replanning] FindRoute(position, end) → per hop of the route: [opening a
         replacement] OpenSession → [replaying] SendSteps of replay_plan (the history
         from position 0, each step a chunk of its original size, at most
         REPLAY_MAX_TOKENS per request) → its outputs are the next hop's steps and,
         inside the span, a new boundary's history. An open or replay that fails:
         Penalise, Abort, FindRoute again from where it stopped (same deadline).

A chain without a planner (`can_fail_over=False`) raises the first HopFailed instead
of failing over and runs no spot checks.

Where the transitions are: open, steps and failover here; rebuild in
chain_rebuild.py; spot checks, arbitration and blame in chain_checks.py; the plans
(replay, catch-up) and `judge` in chain_plan.py. Each transition either ends with
requests pending (`_request` names the method that takes their answers) or idle.
"""

from __future__ import annotations

import logging
from typing import Any

from ...errors import HopFailed
from .chain_checks import SpotChecking
from .. import protocol
from .chain_events import (
    Abort, Answered, Close, Failed, Link, OpenSession, Opened, SendReceipt, SendSteps, Session, StepRequest,
)
from .chain_machine import Step
from .chain_plan import Failover, Verifier, proof_links
from .chain_rebuild import Rebuilding
from .chain_standby import Standbys
from .routing import Hop

log = logging.getLogger(__name__)


class ChainCore(SpotChecking, Rebuilding, Standbys):
    """The consumer's chain, sans I/O (state and plumbing: chain_machine.Machine)."""

    def open(self, route: list[Hop]) -> list:
        """Open a session on every hop at once; the first batch of actions."""
        assert self.idle
        sessions = [Session(hop) for hop in route]
        self._request([OpenSession(s) for s in sessions], lambda events: self._opened(sessions, events),
                      "opening")
        return self._flush()

    def start_step(self, hidden: Any, tokens: int) -> list:
        """Run `hidden` (`tokens` tokens) through every hop; the first batch of actions."""
        assert self.idle
        self._step = Step(hidden, tokens)
        self._prepare_standbys(self._link_then_step)
        return self._flush()

    def _link_then_step(self) -> None:
        links = self._links() if self.push else []
        if links:
            self._request(links, lambda events: self._linked(links, events), "linking")
        else:
            self._enter_hop()

    def rewind(self, position: int) -> list:
        """Forget every token from `position` on (speculative decoding's rejected
        drafts): the history is cut back, each session is cut back by its next step
        (`rollback`), a verifier that saw those tokens is closed. Effects only."""
        assert self.idle and 0 <= position <= self.position
        self.history.cut(self.position - position)
        sizes = self.history.sizes
        self.position = position
        self.rollback.update(self.hops)
        for span, verifier in list(self.verifiers.items()):
            if verifier.fed >= len(sizes):  # it holds tokens past the cut: not worth a rollback
                del self.verifiers[span]
                self._effect(Close(verifier.session))
        for standby in self.standbys.values():  # its next feed rolls it back (replay_plan)
            standby.fed = min(standby.fed, len(sizes))
        return self._flush()

    def _linked(self, links: list[Link], events: list) -> None:
        for link, event in zip(links, events):
            link.session.link_ok = event.ok
        self._enter_hop()

    def _links(self) -> list[Link]:
        """The hops whose neighbours changed since they were last told (opened, failed over)."""
        links = []
        for index, session in enumerate(self.hops):
            upstream = self.hops[index - 1].peer_id if index > 0 else None
            downstream = self.hops[index + 1] if index + 1 < len(self.hops) else None
            if session.linked != (upstream, downstream):
                session.linked = (upstream, downstream)  # also when refused: pushes only save time
                links.append(Link(session, upstream, downstream))
        return links

    # -- open --------------------------------------------------------------------------

    def _opened(self, sessions: list[Session], events: list) -> None:
        self.hops = []
        for session, event in zip(sessions, events):
            if isinstance(event, Opened):
                self._opened_ok(session)
        self._keep_opened(sessions, events, 0)

    def _keep_opened(self, sessions: list[Session], events: list, index: int) -> None:
        while index < len(sessions):
            session, event = sessions[index], events[index]
            index += 1
            if isinstance(event, Opened):
                self.hops.append(session)
                continue
            if not self.can_fail_over:
                raise event.error
            self._penalise(event.error)
            log.warning("%s; choosing another server for blocks %d:%d", event.error, *session.span)

            def rebuilt(new: list[Session], _outputs: list, index: int = index) -> None:
                self.hops.extend(new)
                self._keep_opened(sessions, events, index)

            return self._rebuild(session.hop.start, session.hop.end, [], [], [], rebuilt)
        self._idle()

    # -- a step, hop by hop ------------------------------------------------------------

    def _enter_hop(self) -> None:
        step = self._step
        if step.index >= len(self.hops):
            return self._finish_step()
        session = self.hops[step.index]
        if session in step.failed:  # it failed in this step's direct attempt
            return self._fail_over(step.failed.pop(session))
        if step.index == 0 and self._direct_ok(step):
            return self._send_direct()
        due = step.due[step.index] if step.due is not None else self._check_due(session)
        if due:
            self._start_check(session)
        else:
            self._send_hop(None)

    def _send_hop(self, verifier: Verifier | None) -> None:
        step = self._step
        session = self.hops[step.index]
        self._feed_current(session)
        primary = SendSteps(session, (StepRequest(self.position, (step.hidden,), (step.tokens,),
                                                  rollback=session in self.rollback),))
        if verifier is None:
            return self._request([primary], lambda events: self._hop_answered(session, events[0]), "stepping",
                                 side=True)
        self.checks += 1
        check = SendSteps(verifier.session, self._catch_up(session.span, verifier.fed))
        self._request([primary, check], lambda events: self._checked(session, verifier, *events),
                      "stepping with a spot check", side=True)

    def _hop_answered(self, session: Session, event) -> None:
        self._count(session, event)
        if isinstance(event, Failed):
            return self._fail_over(event.error)
        self._hop_done(event.replies[0].output)

    def _hop_done(self, output: Any) -> None:
        step = self._step
        session = self.hops[step.index]
        self.rollback.discard(session)
        self.history.at(session.hop.start).append(step.hidden)
        step.index += 1
        step.hidden = output
        self._enter_hop()

    # -- direct return -------------------------------------------------------------------

    def _direct_ok(self, step: Step) -> bool:
        """Whether this step goes straight through the chain: every hop took its link,
        the step is small enough to push, and no hop is spot-checked this step (a
        checked step is relayed, its check beside it)."""
        if not (self.direct and len(self.hops) > 1 and step.tokens <= self.direct_max_tokens
                and all(session.link_ok for session in self.hops)):
            return False
        step.due = [self._check_due(session) for session in self.hops]
        if any(step.due):
            self.checked_relays += 1
            return False
        return True

    def _send_direct(self) -> None:
        """Every hop's request at once: the first carries the input, the others take
        theirs from their upstream's push; each answers with its output and proof."""
        step = self._step
        self.direct_steps += 1
        self._feed_current(self.hops[0])
        first = StepRequest(self.position, (step.hidden,), (step.tokens,), rollback=self.hops[0] in self.rollback)
        requests = [SendSteps(self.hops[0], (first,))]
        requests += [SendSteps(session, (StepRequest(self.position, (), (step.tokens,),
                                                     rollback=session in self.rollback, from_upstream=True),))
                     for session in self.hops[1:]]
        hops = list(self.hops)
        self._request(requests, lambda events: self._direct_answered(hops, events), "stepping directly", side=True)

    def _direct_answered(self, hops: list[Session], events: list) -> None:
        """Take the hops' answers in chain order while each one's proof links to the
        previous one's (chain_plan.proof_links); from the first that failed, did not
        get its push or does not link, the step goes on hop by hop from the
        consumer's copy (a failed hop is failed over). Hops after that point that
        answered anyway computed from an input not taken: they are cut back."""
        step = self._step
        for session, event in zip(hops, events):
            self._count(session, event)
        stop = len(hops)
        for index, (session, event) in enumerate(zip(hops, events)):
            if isinstance(event, Failed):
                stop = index
                break
            reply = event.replies[0]
            expected = reply.input_digest if index == 0 else step.last_reply.proof.output_digest
            problem = proof_links(reply, expected, self.model_id, session.hop, self.position, step.tokens,
                                  self.mode)
            if problem is not None:
                self.chain_breaks += 1
                log.warning("direct step %d: %s; relaying it from the previous server's signed output, and "
                            "this chain's steps from now on", self.position, problem)
                self.rollback.add(session)
                session.link_ok = False  # who of the two lied is not known: neither link is trusted again
                stop = index
                break
            step.last_reply = reply
            self.rollback.discard(session)
            self.history.at(session.hop.start).append(step.hidden)
            step.index += 1
            step.hidden = reply.output
        for session, event in zip(hops[stop:], events[stop:]):
            if isinstance(event, Answered):
                self.rollback.add(session)
            elif event.error.code != protocol.NO_INPUT:
                step.failed[session] = event.error  # fails over when the step reaches it
        step.due = None
        self._enter_hop()

    def _finish_step(self) -> None:
        step = self._step
        self.history.append(step.tokens)
        self.position += step.tokens
        self.output = step.hidden
        due = [session for session in self.live() if session.answered >= self.receipt_steps]
        if not due:
            return self._idle()
        for session in due:
            session.answered = 0
        self._request([SendReceipt(session) for session in due], lambda _events: self._idle(), "receipts")

    # -- failover ----------------------------------------------------------------------

    def _fail_over(self, error: HopFailed) -> None:
        if not self.can_fail_over:
            raise error
        step = self._step
        index = step.index
        failed = self.hops[index]
        start, end = failed.span
        event = Failover(failed.peer_id, start, end, error.code, self.clock())
        self.failovers.append(event)
        log.warning("%s; failing over blocks %d:%d at position %d", error, start, end, self.position)
        self._penalise(error)
        self.retired.append(failed)
        self._effect(Abort(failed))

        self.rollback.discard(failed)

        def rebuilt(new: list[Session], outputs: list) -> None:
            step.due = None  # drawn per hop of the old route
            self.hops[index:index + 1] = new
            self.history.at(start).append(step.hidden)
            event.recovered = self.clock()
            event.replacements = tuple(s.peer_id for s in new)
            step.index += len(new)
            step.hidden = outputs[-1]
            self._enter_hop()

        def rebuild() -> None:
            history = self.history
            self._rebuild(start, end, history.at(start) + [step.hidden], history.sizes + [step.tokens],
                          history.computed + [step.tokens], rebuilt)

        if not self._take_over(index, failed, event, rebuild):
            rebuild()
