"""The state of the consumer's chain core and its request/answer plumbing; the
transitions live in chain_core.py (open, steps, failover), chain_rebuild.py
(replacements and replays) and chain_checks.py (spot checks and blame). Pure."""

from __future__ import annotations

import dataclasses
import random
import time
from collections.abc import Callable
from typing import Any

from ...errors import HopFailed
from ...karma.receipts import RECEIPT_STEPS
from ...proofs import DEFAULT_MODE, tolerance as protocol_tolerance
from .chain_events import EFFECTS, REQUESTS, Answered, Failed, Forgive, Penalise, Session
from .chain_plan import REPLAY_MAX_TOKENS, Failover, History, Verifier
from .spotcheck import SpotCheckSchedule

Span = tuple[int, int]


@dataclasses.dataclass
class Step:
    """The step under way: at hop `index`, with that hop's input `hidden`."""

    hidden: Any
    tokens: int
    index: int = 0
    due: list[bool] | None = None  # per hop, whether it is spot-checked (drawn for a direct step)
    failed: dict = dataclasses.field(default_factory=dict)  # Session -> HopFailed, in a direct step
    last_reply: Any = None  # the previous hop's Reply in a direct step (its proof links to the next)


class Machine:
    """The chain's state, and how a transition asks for I/O: `_request` queues
    requests and names the method that takes their answers (`feed`), `_effect` queues
    an effect. A transition ends with a request pending, or the machine idle."""

    def __init__(self, *, can_fail_over: bool, spot_check_rate: float = 0.0,
                 tolerance: float | None = None, rng: random.Random | None = None, push: bool = True,
                 clock: Callable[[], float] = time.time, receipt_steps: int = RECEIPT_STEPS,
                 replay_max_tokens: int = REPLAY_MAX_TOKENS, direct: bool = False, model_id: str = "",
                 mode: str = DEFAULT_MODE,
                 direct_max_tokens: int = 0, standby: bool = False) -> None:
        self.can_fail_over = can_fail_over  # a planner finds replacements and verifiers
        self.spot_check_rate = spot_check_rate
        self.tolerance = tolerance  # None: the protocol's, for the mode and the span (proofs.tolerance)
        self.rng = rng or random.Random()
        self.push = push
        self.clock = clock  # wall time, for the failover records
        self.receipt_steps = receipt_steps
        self.replay_max_tokens = replay_max_tokens
        # Direct return (needs push): each server's output goes to the next server, the
        # last one's to the consumer; steps of at most direct_max_tokens tokens.
        self.direct = direct and push
        self.model_id = model_id  # what step proofs name (direct steps check them)
        self.mode = mode  # the compute mode they must sign: the model's weight format
        self.direct_max_tokens = direct_max_tokens
        self.direct_steps = 0  # steps that went straight through the chain
        self.checked_relays = 0  # steps relayed instead because a hop's spot check was due
        self.chain_breaks = 0  # direct steps whose proofs did not link up (then relayed)
        self.rollback: set[Session] = set()  # sessions that may hold more than `position` tokens
        # Standby replicas (chain_standby.py): per span, a session fed the same steps.
        self.standby = standby
        self.standbys: dict[Span, Verifier] = {}
        self.standby_takeovers = 0
        self._standby_tried: dict[Span, int] = {}  # span -> history length when last looked for
        self._side: list = []  # (request, handler): sent beside the step's next requests
        self.hops: list[Session] = []
        self.position = 0
        self.history = History()
        self.failovers: list[Failover] = []
        self.checks = 0
        self.schedules: dict[Span, SpotCheckSchedule] = {}
        self.verifiers: dict[Span, Verifier] = {}
        self.retired: list[Session] = []  # given up (aborted again at close)
        self.output: Any = None  # the last step's output at the end of the chain
        self.phase = "idle"
        self._step: Step | None = None
        self._then: Callable[[list], None] | None = None  # takes the answers to the pending requests
        self._outbox: list = []

    def tolerance_for(self, span: tuple[int, int]) -> float:
        """How far two honest answers for `span` may differ: the protocol's tolerance for
        the chain's compute mode and the span's length, unless the chain was given one."""
        if self.tolerance is not None:
            return self.tolerance
        return protocol_tolerance(self.mode, span[1] - span[0])

    @property
    def idle(self) -> bool:
        return self._then is None

    def live(self) -> list[Session]:
        """Sessions the chain keeps (receipts, close): its hops, verifiers and standbys."""
        return self.hops + [v.session for v in (*self.verifiers.values(), *self.standbys.values())]

    def feed(self, events: list) -> list:
        """The events answering the last batch's requests, in their order; the next batch."""
        then, self._then = self._then, None
        assert then is not None, "no request is pending"
        try:
            then(list(events))
        except BaseException:  # a HopFailed without a planner: the chain is done for
            self._outbox.clear()
            raise
        return self._flush()

    # -- plumbing --------------------------------------------------------------------

    def _request(self, requests: list, then: Callable[[list], None], phase: str, *, side: bool = False) -> None:
        """Queue `requests`, `then` taking their answers; with `side`, the side
        requests waiting (standby feeds) go along, their answers to their own handlers."""
        self._outbox.extend(requests)
        self.phase = phase
        if side and self._side:
            pending, self._side = self._side, []
            self._outbox.extend(request for request, _ in pending)
            count = len(requests)

            def split(events: list) -> None:
                for (_, handle), event in zip(pending, events[count:]):
                    handle(event)
                then(events[:count])

            self._then = split
        else:
            self._then = then

    def _effect(self, action) -> None:
        self._outbox.append(action)

    def _flush(self) -> list:
        actions, self._outbox = self._outbox, []
        assert all(isinstance(a, REQUESTS + EFFECTS) for a in actions)
        assert self.idle == (not any(isinstance(a, REQUESTS) for a in actions))
        return actions

    def _idle(self) -> None:
        self.phase = "idle"

    def _penalise(self, error: HopFailed) -> None:
        if self.can_fail_over:
            self._effect(Penalise(error.peer_id, "mismatch" if error.code == "mismatch" else "fault"))

    def _opened_ok(self, session: Session) -> None:
        if self.can_fail_over:
            self._effect(Forgive(session.peer_id))  # it answers again: forgive its faults

    @staticmethod
    def _count(session: Session, event) -> None:
        """Requests answered, towards the session's next receipt."""
        if isinstance(event, Answered):
            session.answered += len(event.replies)
        elif isinstance(event, Failed):
            session.answered += event.answered

    # -- transitions other parts call (chain_core.py) ----------------------------------

    def _send_hop(self, verifier: Verifier | None) -> None:
        """Send the step to the current hop (and to `verifier`, a spot check)."""
        raise NotImplementedError

    def _hop_done(self, output: Any) -> None:
        """The current hop's answer is taken: on to the next hop."""
        raise NotImplementedError

    def _fail_over(self, error: HopFailed) -> None:
        """The current hop failed: replace it."""
        raise NotImplementedError
