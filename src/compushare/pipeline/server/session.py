"""A server's sessions as a state machine: pure, no I/O, no trio, no torch, no libp2p.

The driver (inference.py) tells the table what happened (a step begun, a compute
ended, a push taken, a truncate asked for...); the table checks that it may happen
in the session's state, changes the state by the one TRANSITIONS table, keeps the
books (length, KV reservation, receipts, counters) and says what the driver must
do about the KV cache (`RollBack`) or a pushed step (`Wait`, `UsePushed`).

Every step names the position of its first token; it must equal the number of
tokens the session already holds, so a stale, repeated or skipped frame is
rejected instead of being applied to the KV cache. Rolling back is its own
operation (`truncate`), never a side effect of a step.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import TYPE_CHECKING

from .. import protocol
from . import kv_share
from ...errors import CompushareError
from ...proofs.inference import InputChain, token_digests

if TYPE_CHECKING:
    from ..messages import Downstream


class Rejected(CompushareError):
    """A request the table refuses; `code` goes into the error reply."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message


class InvalidTransition(RuntimeError):
    """The driver reported an event the session's state does not allow: a bug, not a peer's doing."""


class State(enum.Enum):
    READY = "ready"  # open, no step in flight
    STEPPING = "stepping"  # a consumer's step is being computed
    COMPUTING_PUSH = "computing_push"  # a step begun from the upstream server's push is being computed
    PUSH_COMPUTED = "push_computed"  # that step is computed; it waits for the consumer's copy of its input
    CLOSED = "closed"  # closed, expired or dropped with its span; work begun before still ends here


class Event(enum.Enum):
    STEP = "step"  # the consumer's step begins
    DONE = "done"  # its compute ended
    FAILED = "failed"  # a compute (the consumer's or a pushed step's) failed: rolled back
    PUSH = "push"  # a push begins a step
    COMPUTED = "computed"  # the pushed step's compute ended
    CONFIRM = "confirm"  # the consumer's step carries the pushed input: the pushed step is its answer
    MISMATCH = "mismatch"  # it carries another: the pushed step is rolled back
    DISCARD = "discard"  # a truncate rolls the pushed step back first
    TRUNCATE = "truncate"
    RECEIPT = "receipt"
    LINK = "link"
    CLOSE = "close"
    EXPIRE = "expire"  # idle longer than the timeout
    RECLAIM = "reclaim"  # its peer holds more than its fair share of the KV budget, and another wants it


S, E = State, Event
TRANSITIONS: dict[tuple[State, Event], State] = {
    (S.READY, E.STEP): S.STEPPING,
    (S.READY, E.PUSH): S.COMPUTING_PUSH,
    (S.READY, E.TRUNCATE): S.READY,
    (S.READY, E.RECEIPT): S.READY,
    (S.READY, E.LINK): S.READY,
    (S.READY, E.CLOSE): S.CLOSED,
    (S.READY, E.EXPIRE): S.CLOSED,
    (S.READY, E.RECLAIM): S.CLOSED,

    (S.STEPPING, E.DONE): S.READY,
    (S.STEPPING, E.FAILED): S.READY,
    (S.STEPPING, E.RECEIPT): S.STEPPING,
    (S.STEPPING, E.LINK): S.STEPPING,
    (S.STEPPING, E.CLOSE): S.CLOSED,
    (S.STEPPING, E.RECLAIM): S.CLOSED,  # its step stops at its next piece (compute.py)

    (S.COMPUTING_PUSH, E.COMPUTED): S.PUSH_COMPUTED,
    (S.COMPUTING_PUSH, E.FAILED): S.READY,
    (S.COMPUTING_PUSH, E.RECEIPT): S.COMPUTING_PUSH,
    (S.COMPUTING_PUSH, E.LINK): S.COMPUTING_PUSH,
    (S.COMPUTING_PUSH, E.CLOSE): S.CLOSED,
    (S.COMPUTING_PUSH, E.RECLAIM): S.CLOSED,

    (S.PUSH_COMPUTED, E.CONFIRM): S.READY,
    (S.PUSH_COMPUTED, E.MISMATCH): S.READY,
    (S.PUSH_COMPUTED, E.DISCARD): S.READY,
    (S.PUSH_COMPUTED, E.RECEIPT): S.PUSH_COMPUTED,
    (S.PUSH_COMPUTED, E.LINK): S.PUSH_COMPUTED,
    (S.PUSH_COMPUTED, E.CLOSE): S.CLOSED,
    (S.PUSH_COMPUTED, E.EXPIRE): S.CLOSED,  # a pushed step its consumer never confirmed does not hold a session
    (S.PUSH_COMPUTED, E.RECLAIM): S.CLOSED,

    # Work begun before its session closed still ends (its reply still goes out).
    (S.CLOSED, E.DONE): S.CLOSED,
    (S.CLOSED, E.FAILED): S.CLOSED,
    (S.CLOSED, E.COMPUTED): S.CLOSED,
    (S.CLOSED, E.RECEIPT): S.CLOSED,
}

# What a peer is told when its request's event is not allowed in the session's state.
_BUSY_STEP = (protocol.OUT_OF_ORDER, "a step of this session is still being computed")
_GONE = (protocol.UNKNOWN_SESSION, "no such session (never opened, closed or expired)")
REFUSALS: dict[Event, tuple[str, str]] = {
    E.STEP: _BUSY_STEP,
    E.PUSH: _BUSY_STEP,
    E.TRUNCATE: (protocol.OUT_OF_ORDER, "cannot truncate during a step"),
}


@dataclasses.dataclass(eq=False)
class Step:
    """The one step a session has in flight, or computed from a push and waiting."""

    position: int
    tokens: int
    pushed: bytes | None = None  # a pushed step's input bytes (None: the consumer's own step)
    dtype: str | None = None  # ... and their wire dtype
    output: object = None  # a pushed step's output once computed (the driver's tensor)
    encoded: object = None  # ... on the wire, in the pushed dtype
    seconds: float = 0.0  # ... and its compute time

    def matches(self, position: int, data: bytes, dtype: str, chunks: int) -> bool:
        """Whether a consumer's step carries this pushed step's very input."""
        return position == self.position and chunks == 1 and dtype == self.dtype and data == self.pushed


@dataclasses.dataclass(eq=False)
class Session:
    session_id: bytes
    start: int
    end: int
    max_tokens: int
    last_used: float
    reserved: int = 0  # KV tokens it holds of the budget: max_tokens, at least the table's minimum
    length: int = 0
    state: State = State.READY
    step: Step | None = None
    cache: object = None  # the KV cache; opaque here
    adapter: object = None  # the LoRA adapter every forward of it applies (adapters.Held); opaque here
    owner: str = ""  # the peer that opened it
    reclaimed: bool = False  # for a peer within its fair share: a step in flight stops at its next piece
    chain: InputChain | None = dataclasses.field(default_factory=InputChain)  # every input row's digest, in order
    # Karma: what the next receipt may cover (the steps computed since the last one).
    receipt_seq: int = 0
    unreceipted_tokens: int = 0
    unreceipted_ms: float = 0.0
    # Pushes: who may push inputs here, and where outputs are pushed.
    upstream: str | None = None
    downstream: Downstream | None = None
    parked: object = None  # a push for a position before `length`, kept until a rollback reaches it
    pushed_by: str | None = None  # the peer whose push it took last

    @property
    def in_step(self) -> bool:
        return self.step is not None


# What the driver does about a consumer's step meeting a pushed one (`SessionTable.settle`).
@dataclasses.dataclass(frozen=True)
class Wait:
    """A pushed step is being computed: wait until `step` is computed or failed, then settle again."""

    step: Step


@dataclasses.dataclass(frozen=True)
class UsePushed:
    """The pushed step was the consumer's: its output is the reply (the step has ended)."""

    step: Step


@dataclasses.dataclass(frozen=True)
class RollBack:
    """Truncate the session's KV cache to `position` (a pushed step was rolled back)."""

    position: int


class SessionStates:
    """Every open session of a server and the events that move it (one TRANSITIONS
    table): steps, pushes, truncates, links, receipts, closes, expiry."""

    def __init__(self, *, max_step_tokens: int, idle_timeout_s: float) -> None:
        self.max_step_tokens, self.idle_timeout_s = max_step_tokens, idle_timeout_s
        self._sessions: dict[bytes, Session] = {}
        self.tokens_served = self.steps_served = 0  # every step's tokens and steps, once (a confirmed push: once)
        self.push_hits = 0  # pushed steps the consumer confirmed
        self.push_misses = 0  # pushed steps rolled back for the consumer's other input

    def __len__(self) -> int:
        return len(self._sessions)

    def __contains__(self, session_id: bytes) -> bool:
        return session_id in self._sessions

    # -- transitions ---------------------------------------------------------------------

    @staticmethod
    def _check(session: Session, event: Event) -> State:
        """The state `event` takes the session to; Rejected (a peer's request) or
        InvalidTransition (the driver's report) when its state does not allow it."""
        after = TRANSITIONS.get((session.state, event))
        if after is None:
            if session.state is State.CLOSED:
                raise Rejected(*_GONE)
            if event in REFUSALS:
                raise Rejected(*REFUSALS[event])
            raise InvalidTransition(f"{event.value} is not allowed in state {session.state.value}")
        return after

    def _fire(self, session: Session, event: Event) -> None:
        session.state = self._check(session, event)

    def get(self, session_id: bytes) -> Session:
        session = self._sessions.get(session_id)
        if session is None:
            raise Rejected(*_GONE)
        return session

    def _begin(self, session_id: bytes, event: Event, position: int, tokens: int, now: float,
               **pushed) -> Session:
        session = self.get(session_id)
        self._check(session, event)
        if position != session.length:
            raise Rejected(protocol.OUT_OF_ORDER, f"step at position {position}, session holds {session.length} tokens")
        if not (1 <= tokens <= self.max_step_tokens):
            raise Rejected(protocol.TOO_LONG, f"a step carries 1..{self.max_step_tokens} tokens")
        if session.length + tokens > session.max_tokens:
            raise Rejected(
                protocol.TOO_LONG, f"{session.length}+{tokens} tokens exceed the session's {session.max_tokens}"
            )
        self._fire(session, event)
        session.step = Step(position, tokens, **pushed)
        session.last_used = now
        return session

    def begin_step(self, session_id: bytes, position: int, tokens: int, now: float) -> Session:
        """The consumer's step begins (STEP)."""
        return self._begin(session_id, Event.STEP, position, tokens, now)

    def end_step(self, session: Session, tokens: int, now: float, *, ok: bool, seconds: float = 0.0,
                 data: bytes | None = None, dtype: str | None = None, forwards: tuple[int, ...] | None = None) -> None:
        """The consumer's step ended (DONE: `data` is its input, of wire `dtype`, for the
        input chain, computed in `forwards`: one by default), or it failed (FAILED)."""
        if session.step is None or session.step.tokens != tokens:
            raise InvalidTransition(f"no step of {tokens} tokens in flight")
        self._fire(session, Event.DONE if ok else Event.FAILED)
        session.step = None
        session.last_used = now
        if ok:
            self._ran(session, tokens, seconds, data, dtype, forwards)

    def _ran(self, session: Session, tokens: int, seconds: float, data: bytes | None, dtype: str | None,
             forwards: tuple[int, ...] | None = None) -> None:
        if session.chain is not None:
            if data is None or dtype is None or len(data) % tokens:
                session.chain = None  # an input not told in rows: no later step is provable
            else:
                session.chain.extend(token_digests(dtype, data, tokens), forwards)
        session.length += tokens
        session.unreceipted_tokens += tokens
        session.unreceipted_ms += seconds * 1000
        self.tokens_served, self.steps_served = self.tokens_served + tokens, self.steps_served + 1

    def truncate(self, session_id: bytes, position: int, now: float) -> Session:
        """TRUNCATE: the cache keeps its first `position` tokens (a pushed step waiting
        must be discarded first)."""
        session = self.get(session_id)
        self._check(session, Event.TRUNCATE)
        if not (0 <= position <= session.length):
            raise Rejected(protocol.OUT_OF_ORDER, f"cannot truncate to {position}: holds {session.length}")
        self._fire(session, Event.TRUNCATE)
        if session.chain is not None:
            session.chain.truncate(position)  # proofs go on after a rollback
        session.length = position
        session.last_used = now
        return session

    def link(self, session: Session, peer: str, upstream: str | None, downstream: Downstream | None, *,
             pushes: bool) -> None:
        """LINK: the session's neighbours in its consumer's chain (`pushes`: whether
        this server takes part in pushes at all)."""
        if peer != session.owner:
            raise Rejected(protocol.BAD_REQUEST, "only the consumer that opened a session may link it")
        if not pushes:
            raise Rejected(protocol.BAD_REQUEST, "this server does not take part in pushes")
        self._fire(session, Event.LINK)
        session.upstream, session.downstream = upstream, downstream
        session.parked = None  # pushed by the old upstream

    def receipted(self, session: Session) -> None:
        """RECEIPT: the consumer's receipt for the steps since the last one is countersigned."""
        self._fire(session, Event.RECEIPT)
        session.receipt_seq += 1
        session.unreceipted_tokens, session.unreceipted_ms = 0, 0.0

    def close(self, session_id: bytes) -> Session | None:
        session = self._sessions.pop(session_id, None)
        if session is not None:
            self._fire(session, Event.CLOSE)
        return session

    def drop_all(self) -> int:
        """CLOSE every session (their caches belong to a span this server no longer serves)."""
        dropped = list(self._sessions)
        for session_id in dropped:
            self.close(session_id)
        return len(dropped)

    def expire(self, now: float) -> list[Session]:
        """EXPIRE sessions idle for longer than the timeout (never one mid-step; a step
        computed from a push that its consumer never confirmed does not count)."""
        idle = [s for s in self._sessions.values()
                if (s.state, Event.EXPIRE) in TRANSITIONS and now - s.last_used > self.idle_timeout_s]
        for session in idle:
            del self._sessions[session.session_id]
            self._fire(session, Event.EXPIRE)
        return idle

    # -- pushes ------------------------------------------------------------------------------

    @staticmethod
    def check_pusher(session: Session, peer: str) -> None:
        if session.upstream is None or peer != session.upstream:
            raise Rejected(protocol.BAD_REQUEST, "this session takes no pushes from this peer")

    def push(self, session_id: bytes, position: int, tokens: int, data: bytes, dtype: str, now: float) -> Step:
        """PUSH: a step begins from the upstream server's output, before the consumer's
        copy of it arrives."""
        step = self._begin(session_id, Event.PUSH, position, tokens, now, pushed=data, dtype=dtype).step
        assert step is not None  # _begin's session is in its step
        return step

    def computed(self, session: Session, step: Step, output: object, encoded: object, seconds: float) -> None:
        """COMPUTED: the pushed step's output waits for the consumer's step (the
        session's idle time runs from the push)."""
        if session.state is not State.CLOSED and session.step is not step:
            raise InvalidTransition("that pushed step is not the session's")
        self._fire(session, Event.COMPUTED)
        step.output, step.encoded, step.seconds = output, encoded, seconds

    def failed(self, session: Session, step: Step, now: float) -> None:
        """FAILED: a compute failed (its cache is rolled back to the step's position)."""
        if session.state is not State.CLOSED and session.step is not step:
            raise InvalidTransition("that step is not the session's")
        self._fire(session, Event.FAILED)
        if session.step is step:
            session.step = None
        session.last_used = now

    def settle(self, session: Session, position: int, data: bytes, dtype: str, chunks: int,
               now: float) -> Wait | UsePushed | RollBack | None:
        """The consumer's step (its input's bytes, dtype and number of chunks) meets a
        pushed step: Wait for one being computed; CONFIRM one computed from the very
        same input (UsePushed: it is the reply, and the step has ended); otherwise
        MISMATCH (RollBack its cache). None: no pushed step, begin the consumer's."""
        step = _pushed_step(session)
        if step is None:
            return None
        if session.state is State.COMPUTING_PUSH:
            return Wait(step)
        if step.matches(position, data, dtype, chunks):
            self._fire(session, Event.CONFIRM)
            session.step = None
            session.last_used = now
            self.push_hits += 1
            self._ran(session, step.tokens, step.seconds, data, dtype)
            return UsePushed(step)
        self._fire(session, Event.MISMATCH)
        session.step = None
        session.last_used = now
        self.push_misses += 1
        return RollBack(step.position)

    def take_pushed(self, session: Session, position: int, tokens: int,
                    now: float) -> Wait | UsePushed | RollBack | None:
        """A step `from_upstream` (direct return) meets what the upstream pushed: Wait
        for a pushed step being computed; CONFIRM one computed at this position with
        these many tokens (UsePushed: its input was whatever the upstream sent, which
        the server's proof names); MISMATCH any other (RollBack: a stale push). None:
        nothing pushed yet, the driver waits for it."""
        step = _pushed_step(session)
        if step is None:
            return None
        if session.state is State.COMPUTING_PUSH:
            return Wait(step)
        if step.position == position and step.tokens == tokens and step.pushed is not None:
            return self.settle(session, position, step.pushed, step.dtype or "", 1, now)
        self._fire(session, Event.MISMATCH)
        session.step = None
        session.last_used = now
        self.push_misses += 1
        return RollBack(step.position)

    def discard(self, session: Session, now: float) -> Wait | RollBack | None:
        """DISCARD a computed pushed step before a truncate (RollBack its cache); Wait
        for one being computed; None if there is none."""
        step = _pushed_step(session)
        if step is None:
            return None
        if session.state is State.COMPUTING_PUSH:
            return Wait(step)
        self._fire(session, Event.DISCARD)
        session.step = None
        session.last_used = now
        return RollBack(step.position)


class SessionTable(SessionStates):
    """Every session of a server (SessionStates) and their admission: caps on sessions
    and the KV budget they share max-min fairly (kv_share.py): a session of a peer
    over its share is reclaimed, however busily it is kept, when another peer within
    its share needs the room."""

    def __init__(self, *, budget_tokens: int, max_session_tokens: int, max_step_tokens: int,
                 idle_timeout_s: float, max_sessions: int = 256, max_sessions_per_peer: int = 32,
                 fair: bool = True) -> None:
        super().__init__(max_step_tokens=max_step_tokens, idle_timeout_s=idle_timeout_s)
        self.budget_tokens, self.fair = budget_tokens, fair
        self.max_sessions, self.max_sessions_per_peer = max_sessions, max_sessions_per_peer
        self.max_session_tokens = max_session_tokens
        self.reclaimed: list[Session] = []  # sessions reclaimed for fair shares, until the driver takes them

    @property
    def reserved_tokens(self) -> int:
        return sum(s.reserved for s in self._sessions.values())

    @property
    def min_reserved(self) -> int:
        """What any session holds of the budget at least: so many sessions fill the budget
        as fill the table, and a crowd of tiny sessions is reclaimed like a big one
        (else 8 identities' 32 one-token sessions each left every newcomer `busy`)."""
        return -(-self.budget_tokens // self.max_sessions) if self.fair else 1

    @property
    def free_tokens(self) -> int:
        return self.budget_tokens - self.reserved_tokens

    def open(self, session_id: bytes, start: int, end: int, max_tokens: int, now: float,
             owner: str = "") -> Session:
        if session_id in self._sessions:
            raise Rejected(protocol.SESSION_EXISTS, "a session with this id is already open")
        if sum(1 for s in self._sessions.values() if s.owner == owner) >= self.max_sessions_per_peer:
            raise Rejected(protocol.BUSY, f"{self.max_sessions_per_peer} sessions of this peer are open already")
        if not (1 <= max_tokens <= self.max_session_tokens):
            raise Rejected(protocol.TOO_LONG, f"max_tokens must be 1..{self.max_session_tokens}")
        reserved = max(max_tokens, self.min_reserved)
        if reserved > self.free_tokens:
            self._reclaim_for(owner, reserved)
        if len(self._sessions) >= self.max_sessions:  # with fair shares the reserve above bounds it first
            raise Rejected(protocol.BUSY, f"{len(self._sessions)} sessions open, the most this server holds")
        session = Session(session_id, start, end, max_tokens, last_used=now, reserved=reserved, owner=owner)
        self._sessions[session_id] = session
        return session

    def fair_share(self, owner: str) -> int:  # what `owner` may hold when the budget is contended
        return kv_share.fair_share(self.budget_tokens, self._sessions.values(), owner)

    def available_to_newcomer(self) -> int:
        """The KV tokens a peer holding no session could reserve now (advertised)."""
        if not self.fair:
            return self.free_tokens
        return kv_share.available(self.budget_tokens, self._sessions.values())

    def _reclaim_for(self, owner: str, max_tokens: int) -> None:
        """Make room for `owner`'s ask by reclaiming sessions of peers over their fair
        share (see the class docstring), or raise Rejected(busy) and change nothing."""
        full = f"KV budget full: {self.free_tokens} of {self.budget_tokens} tokens free, {max_tokens} asked"
        if not self.fair:
            raise Rejected(protocol.BUSY, full)
        plan = kv_share.plan_reclaim(self.budget_tokens, self._sessions.values(), owner, max_tokens)
        if isinstance(plan, str):
            raise Rejected(protocol.BUSY, f"{full}; {plan}")
        for session in plan:
            del self._sessions[session.session_id]
            self._fire(session, Event.RECLAIM)
            session.reclaimed = True
            self.reclaimed.append(session)

    def take_reclaimed(self) -> list[Session]:  # reclaimed since the last call (the driver logs them)
        taken, self.reclaimed = self.reclaimed, []
        return taken


def _pushed_step(session: Session) -> Step | None:
    """The pushed step a session computing or holding one has; None in any other state."""
    if session.state not in (State.COMPUTING_PUSH, State.PUSH_COMPUTED):
        return None
    assert session.step is not None  # the PUSH that entered these states set it
    return session.step
