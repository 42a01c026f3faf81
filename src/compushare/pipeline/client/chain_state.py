"""The consumer chain's state, sans I/O (chain_core.py's docstring has the whole
machine): the route's sessions, the position, the history, verifiers and standbys,
and the step or batch of requests under way. The transition modules (chain_steps,
chain_direct, chain_rebuild, chain_checks, chain_standby) are functions of this
state; chain_core.ChainCore is this state with its operations and transition table.
"""

from __future__ import annotations

import dataclasses
import random
import time
from collections.abc import Callable
from typing import Any

from ...errors import MISMATCH, HopFailed
from ...karma.receipts import RECEIPT_STEPS
from ...proofs.inference import DEFAULT_MODE, adapted_model, tolerance as protocol_tolerance, tolerance_between
from .chain_events import EFFECTS, REQUESTS, Forgive, HopSession, Penalise, Phase, Span
from .chain_plan import REPLAY_MAX_TOKENS, Failover, History, StandbyFeed, Verifier
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


class ChainState:
    """The chain's state, and what every transition does with it: queue requests and
    effects, penalise, forgive. The four ways a step goes on (`link_and_step`,
    `enter_hop`, `send_hop`, `hop_done`) are chain_steps.py's, which imports this
    module: ChainCore binds them."""

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
        self.exact_checks = 0  # spot checks held to no tolerance that passed
        self.schedules: dict[Span, SpotCheckSchedule] = {}
        self.verifiers: dict[Span, Verifier] = {}
        self.retired: list[HopSession] = []  # given up (aborted again at close)
        self.output: Any = None  # the last step's output at the end of the chain
        self._step: ChainStep | None = None
        self._waiting: Waiting | None = None
        self._outbox: list = []

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

    def tolerance_for(self, span: Span, proofs: tuple[Any, Any] | None = None) -> float:
        """How far two honest answers for `span` may differ: the protocol's tolerance for
        the chain's compute mode and the span's length, unless the chain was given one;
        with both answers' `proofs`, the pair's (proofs.inference.tolerance_between)."""
        if self.tolerance is not None:
            return self.tolerance
        if proofs is not None and None not in proofs:
            return tolerance_between(self.mode, span[1] - span[0], *((p.runtime, p.forwards) for p in proofs))
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

    # -- how a step goes on: chain_steps.py's, bound by ChainCore ------------------------------

    def link_and_step(self) -> None:
        raise NotImplementedError

    def enter_hop(self) -> None:
        raise NotImplementedError

    def send_hop(self, verifier: Verifier | None) -> None:
        raise NotImplementedError

    def hop_done(self, output: Any) -> None:
        raise NotImplementedError

    def _flush(self) -> list:
        actions, self._outbox = self._outbox, []
        assert all(isinstance(a, REQUESTS + EFFECTS) for a in actions)
        assert self.idle == (not any(isinstance(a, REQUESTS) for a in actions))
        return actions
