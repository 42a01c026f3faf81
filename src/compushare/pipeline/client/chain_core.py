"""The consumer's chain of sessions, sans I/O: a state machine that says which
requests to send and what to make of their answers (chain.py does the sending).

State (ChainCore):
  hops        the route: one HopSession per hop, in block order (each knows its Hop span)
  position    tokens every hop's session holds
  history     every step's input at every block boundary, and the steps' sizes
  verifiers   per span, the session recomputing its sampled steps and how many
              steps it has seen (`fed`); schedules: per span, which steps are checked
  standbys    per span, a session fed every step (chain_standby.py)
  failovers, checks, retired (sessions given up, aborted again at close)

Operations: `open(route)` and `start_step(payload, tokens)` begin one; `feed(events)`
answers the requests of the last batch of actions (chain_events.py) and returns the
next batch; the operation is over when a batch holds no request (`idle`, and
`output` holds a step's result). A batch of requests waits in a `Phase`; the
TRANSITIONS table below names, per phase and kind of answer, the handler taking
the answers and the operation's state (a small dataclass); any other answer raises
UnexpectedEvents. The standbys' feeds go along with a step's requests (STEPPING*),
their answers to chain_standby.fed. Transitions (phases in brackets):

  open:  [OPENING] OpenSession for every hop at once → a hop that failed is penalised
         and rebuilt in place with an empty history (rebuild, below) → idle
  step:  standbys looked for ([FINDING_STANDBYS], [OPENING_STANDBYS]) → [LINKING] Link
         the hops whose neighbours changed (push on) → for each hop: sampled for a
         check? → [FINDING_VERIFIER] FindVerifier → [OPENING_VERIFIER] OpenSession
         (failed: penalised, no check) → [STEPPING] SendSteps on the hop (position, one
         chunk), [STEPPING_CHECKED] with a check also on the verifier at once (its
         missed steps batched, last_only) → answers within the tolerance: the hop is
         done, its input kept in the history; a failed verifier is dropped (no check);
         a disagreement → [FINDING_ARBITER] → [OPENING_ARBITER] → [ARBITRATING]
         SendSteps of the whole history on a third session, then Close → judge →
         FileReport against the blamed one, Penalise "mismatch"; the verifier blamed:
         it is dropped and the hop is done; the hop blamed ("primary" or "both"):
         fail over. The hop failed (any code): fail over. [STEPPING_DIRECTLY]: every
         hop at once (chain_direct.py). After the last hop: position += tokens, then
         [RECEIPTS] SendReceipt to every live session answered RECEIPT_STEPS times
         since its last one → idle.
  fail over: Failover recorded, Penalise (fault, or mismatch), Abort the hop → its
         standby, if any, [TAKING_OVER] with the steps it missed; else rebuild its
         span with its history plus this step's input → the new hops replace it,
         the last one's output goes on to the next hop.
  rebuild: [REPLANNING] FindRoute(position, end) → per hop of the route:
         [OPENING_REPLACEMENT] OpenSession → [REPLAYING] SendSteps of replay_plan (the
         history from position 0, each step a chunk of its original size, at most
         REPLAY_MAX_TOKENS per request; with fast_replay, one chunk per request, the
         span's last replacement catching up like a verifier: chain_rebuild.replay_for) → its outputs are the next hop's steps and,
         inside the span, a new boundary's history. An open or replay that fails:
         Penalise, Abort, FindRoute again from where it stopped (same deadline).

A chain without a planner (`can_fail_over=False`) raises the first HopFailed instead
of failing over and runs no spot checks.

Where the transitions are: a step hop by hop in chain_steps.py; direct steps in
chain_direct.py; opening, failover and rebuild in chain_rebuild.py; spot checks,
arbitration and blame in chain_checks.py; standbys in chain_standby.py; the plans
(replay, catch-up) and `judge` in chain_plan.py. All are functions of the core.
"""

from __future__ import annotations

import dataclasses
import random
import time
from collections.abc import Callable
from typing import Any

from ...errors import MISMATCH, HopFailed
from ...karma.receipts import RECEIPT_STEPS
from ...proofs.inference import DEFAULT_MODE, adapted_model, tolerance as protocol_tolerance
from . import chain_checks, chain_direct, chain_rebuild, chain_standby, chain_steps
from .chain_events import (
    EFFECTS, REQUESTS, Close, Forgive, HopSession, Kind, OpenSession, Penalise, Phase, Span, kind_of,
)
from .chain_plan import REPLAY_MAX_TOKENS, Failover, History, Verifier
from .chain_standby import StandbyFeed
from .routing import Hop
from .spotcheck import SpotCheckSchedule


class UnexpectedEvents(RuntimeError):
    """The driver fed events that do not answer what the core waits for: a bug, not a peer's doing."""


@dataclasses.dataclass
class ChainStep:
    """The step under way: at hop `index`, with that hop's input `hidden`."""

    hidden: Any
    tokens: int
    index: int = 0
    due: list[bool] | None = None  # per hop, whether it is spot-checked (drawn for a direct step)
    failed: dict = dataclasses.field(default_factory=dict)  # HopSession -> HopFailed, in a direct step
    last_reply: Any = None  # the previous hop's HopReply in a direct step (its proof links to the next)


@dataclasses.dataclass
class Waiting:
    """A batch of requests out: the phase it waits in, the state of the operation its
    answers go on with, and the standby feeds sent along (answered last)."""

    phase: Phase
    operation: Any
    requests: list
    feeds: list[StandbyFeed]


class ChainCore:
    """The consumer's chain, sans I/O: one state machine driven by TRANSITIONS."""

    def __init__(self, *, can_fail_over: bool, spot_check_rate: float = 0.0,
                 tolerance: float | None = None, rng: random.Random | None = None, push: bool = True,
                 clock: Callable[[], float] = time.time, receipt_steps: int = RECEIPT_STEPS,
                 replay_max_tokens: int = REPLAY_MAX_TOKENS, direct: bool = False, model_id: str = "",
                 mode: str = DEFAULT_MODE, direct_max_tokens: int = 0, standby: bool = False,
                 fast_replay: bool = False, adapter_digest: Callable[[int, int], bytes | None] | None = None) -> None:
        self.can_fail_over = can_fail_over  # a planner finds replacements and verifiers
        self.spot_check_rate = spot_check_rate
        self.tolerance = tolerance  # None: the protocol's, for the mode and the span (proofs.inference.tolerance)
        self.rng = rng or random.Random()
        self.push = push
        self.clock = clock  # wall time, for the failover records
        self.receipt_steps = receipt_steps
        self.replay_max_tokens = replay_max_tokens
        # A replacement's replay in few multi-token forwards, within the format's tolerance
        # (chain_plan.replay_plan `fast`), instead of every step as computed, bit-identical.
        self.fast_replay = fast_replay
        # Direct return (needs push): each server's output goes to the next server, the
        # last one's to the consumer; steps of at most direct_max_tokens tokens.
        self.direct = direct and push
        self.model_id = model_id  # what step proofs name (direct steps check them)...
        self.adapter_digest = adapter_digest  # ... with the LoRA adapter's slice for blocks start:end, if any
        self.mode = mode  # the compute mode they must sign: the model's weight format
        self.direct_max_tokens = direct_max_tokens
        self.direct_steps = 0  # steps that went straight through the chain
        self.checked_relays = 0  # steps relayed instead because a hop's spot check was due
        self.chain_breaks = 0  # direct steps whose proofs did not link up (then relayed)
        self.rollback: set[HopSession] = set()  # sessions that may hold more than `position` tokens
        # Standby replicas (chain_standby.py): per span, a session fed the same steps.
        self.standby = standby
        self.standbys: dict[Span, Verifier] = {}
        self.standby_takeovers = 0
        self.standby_tried: dict[Span, int] = {}  # span -> history length when last looked for
        self.side_feeds: list[StandbyFeed] = []  # sent beside the step's next requests
        self.hops: list[HopSession] = []
        self.position = 0
        self.history = History()
        self.failovers: list[Failover] = []
        self.checks = 0
        self.schedules: dict[Span, SpotCheckSchedule] = {}
        self.verifiers: dict[Span, Verifier] = {}
        self.retired: list[HopSession] = []  # given up (aborted again at close)
        self.output: Any = None  # the last step's output at the end of the chain
        self._step: ChainStep | None = None
        self._waiting: Waiting | None = None
        self._outbox: list = []

    # -- operations ----------------------------------------------------------------------

    def open(self, route: list[Hop]) -> list:
        """Open a session on every hop at once; the first batch of actions."""
        assert self.idle
        sessions = [HopSession(hop) for hop in route]
        self.request([OpenSession(s) for s in sessions], Phase.OPENING, chain_rebuild.Opening(sessions))
        return self._flush()

    def start_step(self, hidden: Any, tokens: int) -> list:
        """Run `hidden` (`tokens` tokens) through every hop; the first batch of actions."""
        assert self.idle
        self._step = ChainStep(hidden, tokens)
        if not chain_standby.look_for_standbys(self):
            self.link_and_step()
        return self._flush()

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
                self.effect(Close(verifier.session))
        for standby in self.standbys.values():  # its next feed rolls it back (replay_plan)
            standby.fed = min(standby.fed, len(sizes))
        return self._flush()

    def feed(self, events: list) -> list:
        """The events answering the last batch's requests, in their order; the next batch."""
        waiting, events = self._waiting, list(events)
        if waiting is None:
            raise UnexpectedEvents("events fed to a chain core with no request pending")
        handle = self._handler(waiting, events)
        self._waiting = None
        try:
            own = len(waiting.requests) - len(waiting.feeds)
            for feed, event in zip(waiting.feeds, events[own:]):
                chain_standby.fed(self, feed, event)
            handle(self, waiting.operation, events[:own])
        except BaseException:  # a HopFailed without a planner: the chain is done for
            self._outbox.clear()
            raise
        return self._flush()

    @staticmethod
    def _handler(waiting: Waiting, events: list) -> Callable[[ChainCore, Any, list], None]:
        """The handler TRANSITIONS names for the phase and the events' kind."""
        kind = kind_of(waiting.requests, events)
        handle = None if kind is None else TRANSITIONS.get((waiting.phase, kind))
        if handle is None:
            fed = ", ".join(type(e).__name__ for e in events)
            asked = ", ".join(type(r).__name__ for r in waiting.requests)
            raise UnexpectedEvents(f"[{fed}] fed in phase {waiting.phase.value!r} "
                                   f"({'unknown kind' if kind is None else kind.value}), asking [{asked}]")
        return handle

    # -- state -----------------------------------------------------------------------------

    @property
    def idle(self) -> bool:
        return self._waiting is None

    @property
    def step(self) -> ChainStep:
        """The step under way (what a step's transitions work on)."""
        assert self._step is not None, "no step has started"
        return self._step

    @property
    def phase(self) -> Phase:
        return Phase.IDLE if self._waiting is None else self._waiting.phase

    def live(self) -> list[HopSession]:
        """Sessions the chain keeps (receipts, close): its hops, verifiers and standbys."""
        return self.hops + [v.session for v in (*self.verifiers.values(), *self.standbys.values())]

    def proof_model(self, hop: Hop) -> str:
        """The model the step proofs of `hop`'s server name (proofs.inference.adapted_model)."""
        return adapted_model(self.model_id, self.adapter_digest(hop.start, hop.end) if self.adapter_digest else None)

    def tolerance_for(self, span: Span) -> float:
        """How far two honest answers for `span` may differ: the protocol's tolerance for
        the chain's compute mode and the span's length, unless the chain was given one."""
        if self.tolerance is not None:
            return self.tolerance
        return protocol_tolerance(self.mode, span[1] - span[0])

    # -- what the transitions do -------------------------------------------------------------

    def request(self, requests: list, phase: Phase, operation: Any = None, *, side: bool = False) -> None:
        """Queue `requests`, to be answered in `phase`, the handler going on with
        `operation`; with `side`, the standby feeds waiting go along."""
        feeds: list[StandbyFeed] = []
        if side:
            feeds, self.side_feeds = self.side_feeds, []
        batch = list(requests) + [feed.request for feed in feeds]
        self._outbox.extend(batch)
        self._waiting = Waiting(phase, operation, batch, feeds)

    def effect(self, action) -> None:
        self._outbox.append(action)

    def penalise(self, error: HopFailed) -> None:
        if self.can_fail_over:
            self.effect(Penalise(error.peer_id, "mismatch" if error.code == MISMATCH else "fault"))

    def forgive(self, session: HopSession) -> None:
        if self.can_fail_over:
            self.effect(Forgive(session.peer_id))  # it answers again: forgive its faults

    def link_and_step(self) -> None:
        chain_steps.link_then_step(self)

    def enter_hop(self) -> None:
        chain_steps.enter_hop(self)

    def send_hop(self, verifier: Verifier | None) -> None:
        chain_steps.send_hop(self, verifier)

    def hop_done(self, output: Any) -> None:
        chain_steps.hop_done(self, output)

    def _flush(self) -> list:
        actions, self._outbox = self._outbox, []
        assert all(isinstance(a, REQUESTS + EFFECTS) for a in actions)
        assert self.idle == (not any(isinstance(a, REQUESTS) for a in actions))
        return actions


# Per phase and kind of answer, the function taking the answers: handler(core, operation, events).
P, K = Phase, Kind
TRANSITIONS: dict[tuple[Phase, Kind], Callable[[ChainCore, Any, list], None]] = {
    (P.OPENING, K.OPENED): chain_rebuild.opened,

    (P.FINDING_STANDBYS, K.VERIFIER_FOUND): chain_standby.standbys_found,
    (P.OPENING_STANDBYS, K.OPENED): chain_standby.standbys_opened,
    (P.LINKING, K.DONE): chain_steps.linked,
    (P.FINDING_VERIFIER, K.VERIFIER_FOUND): chain_checks.verifier_found,
    (P.OPENING_VERIFIER, K.OPENED): chain_checks.verifier_opened,
    (P.STEPPING, K.ANSWERED): chain_steps.hop_answered,
    (P.STEPPING_CHECKED, K.ANSWERED): chain_checks.checked,
    (P.STEPPING_DIRECTLY, K.ANSWERED): chain_direct.direct_answered,
    (P.RECEIPTS, K.DONE): chain_steps.receipted,

    (P.FINDING_ARBITER, K.VERIFIER_FOUND): chain_checks.arbiter_found,
    (P.OPENING_ARBITER, K.OPENED): chain_checks.arbiter_opened,
    (P.ARBITRATING, K.ANSWERED): chain_checks.arbitrated,

    (P.REPLANNING, K.ROUTE_FOUND): chain_rebuild.route_found,
    (P.OPENING_REPLACEMENT, K.OPENED): chain_rebuild.replacement_opened,
    (P.REPLAYING, K.ANSWERED): chain_rebuild.replay_answered,
    (P.TAKING_OVER, K.ANSWERED): chain_rebuild.taken_over,
}
