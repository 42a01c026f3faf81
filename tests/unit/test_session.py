"""pipeline/session.py: admission by KV budget, strict step order, truncate, expiry."""

from __future__ import annotations

import collections
import dataclasses

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from compushare.pipeline import protocol
from compushare.pipeline.server.session import Rejected, SessionTable

BUDGET, MAX_SESSION, MAX_STEP, IDLE = 40, 24, 6, 10.0
IDS = [bytes([i]) * 16 for i in range(4)]


def table(**overrides) -> SessionTable:
    args = dict(budget_tokens=BUDGET, max_session_tokens=MAX_SESSION, max_step_tokens=MAX_STEP,
                idle_timeout_s=IDLE) | overrides
    return SessionTable(**args)


def code_of(fn, *args, **kwargs) -> str | None:
    try:
        fn(*args, **kwargs)
    except Rejected as exc:
        return exc.code
    return None


# ---------------------------------------------------------------- examples


def test_open_reserves_and_close_frees():
    t = table()
    s = t.open(IDS[0], 0, 4, 10, now=0.0)
    assert (s.session_id, s.start, s.end, s.max_tokens, s.length, s.in_step) == (IDS[0], 0, 4, 10, 0, False)
    assert IDS[0] in t and len(t) == 1
    assert t.reserved_tokens == 10 and t.free_tokens == BUDGET - 10
    assert t.close(IDS[0]) is s
    assert IDS[0] not in t and t.reserved_tokens == 0
    assert t.close(IDS[0]) is None


def test_admission_by_budget_then_busy():
    t = table()
    t.open(IDS[0], 0, 1, 24, now=0)
    t.open(IDS[1], 0, 1, 16, now=0)  # exactly fills the budget of 40
    assert t.free_tokens == 0
    assert code_of(t.open, IDS[2], 0, 1, 1, 0) == protocol.BUSY == "busy"
    assert IDS[2] not in t and t.reserved_tokens == 40
    t.close(IDS[1])
    assert code_of(t.open, IDS[2], 0, 1, 17, 0) == "busy"  # 16 free, 17 asked
    t.open(IDS[2], 0, 1, 16, now=0)
    assert t.reserved_tokens == 40


def test_reservation_is_max_tokens_not_length():
    t = table()
    t.open(IDS[0], 0, 1, 24, now=0)
    assert t.reserved_tokens == 24  # no tokens computed yet, but the budget is reserved
    assert code_of(t.open, IDS[1], 0, 1, 17, 0) == "busy"


@pytest.mark.parametrize("max_tokens", [0, -1, MAX_SESSION + 1])
def test_open_rejects_bad_max_tokens(max_tokens):
    t = table()
    assert code_of(t.open, IDS[0], 0, 1, max_tokens, 0) == protocol.TOO_LONG
    assert len(t) == 0


def test_open_twice_is_session_exists():
    t = table()
    t.open(IDS[0], 0, 1, 5, now=0)
    assert code_of(t.open, IDS[0], 0, 1, 5, 0) == protocol.SESSION_EXISTS
    assert t.reserved_tokens == 5


def test_unknown_session_everywhere():
    t = table()
    assert code_of(t.get, IDS[0]) == protocol.UNKNOWN_SESSION
    assert code_of(t.begin_step, IDS[0], 0, 1, 0) == "unknown_session"
    assert code_of(t.truncate, IDS[0], 0, 0) == "unknown_session"
    t.open(IDS[0], 0, 1, 5, now=0)
    t.close(IDS[0])
    assert code_of(t.begin_step, IDS[0], 0, 1, 0) == "unknown_session"


def test_steps_must_come_in_order():
    t = table()
    t.open(IDS[0], 0, 1, 20, now=0)
    assert code_of(t.begin_step, IDS[0], 1, 1, 0) == protocol.OUT_OF_ORDER  # skipped
    s = t.begin_step(IDS[0], 0, 3, now=1)
    assert s.in_step
    assert code_of(t.begin_step, IDS[0], 3, 1, 1) == "out_of_order"  # concurrent step
    t.end_step(s, 3, now=2, ok=True)
    assert s.length == 3 and not s.in_step
    assert code_of(t.begin_step, IDS[0], 0, 3, 2) == "out_of_order"  # repeated frame
    assert code_of(t.begin_step, IDS[0], 2, 1, 2) == "out_of_order"  # stale
    assert code_of(t.begin_step, IDS[0], 4, 1, 2) == "out_of_order"  # skipped
    t.end_step(t.begin_step(IDS[0], 3, 1, now=3), 1, now=3, ok=True)
    assert t.get(IDS[0]).length == 4


def test_failed_step_does_not_advance():
    t = table()
    t.open(IDS[0], 0, 1, 20, now=0)
    s = t.begin_step(IDS[0], 0, 2, now=0)
    t.end_step(s, 2, now=1, ok=False)
    assert s.length == 0 and not s.in_step
    t.begin_step(IDS[0], 0, 2, now=2)  # the same position may be retried


@pytest.mark.parametrize("tokens", [0, -1, MAX_STEP + 1])
def test_step_token_count_limits(tokens):
    t = table()
    t.open(IDS[0], 0, 1, 20, now=0)
    assert code_of(t.begin_step, IDS[0], 0, tokens, 0) == protocol.TOO_LONG
    assert not t.get(IDS[0]).in_step


def test_step_may_not_exceed_session_max_tokens():
    t = table()
    t.open(IDS[0], 0, 1, 8, now=0)
    t.end_step(t.begin_step(IDS[0], 0, 6, now=0), 6, now=0, ok=True)
    assert code_of(t.begin_step, IDS[0], 6, 3, 0) == "too_long"
    t.end_step(t.begin_step(IDS[0], 6, 2, now=0), 2, now=0, ok=True)  # exactly full
    assert code_of(t.begin_step, IDS[0], 8, 1, 0) == "too_long"


def test_truncate():
    t = table()
    t.open(IDS[0], 0, 1, 20, now=0)
    t.end_step(t.begin_step(IDS[0], 0, 5, now=0), 5, now=0, ok=True)
    assert code_of(t.truncate, IDS[0], 6, 1) == "out_of_order"
    assert code_of(t.truncate, IDS[0], -1, 1) == "out_of_order"
    assert t.truncate(IDS[0], 5, now=1).length == 5  # no-op truncate is fine
    assert t.truncate(IDS[0], 2, now=2).length == 2
    assert t.reserved_tokens == 20  # truncating frees no reservation
    assert code_of(t.begin_step, IDS[0], 5, 1, 3) == "out_of_order"
    t.begin_step(IDS[0], 2, 1, now=3)
    assert code_of(t.truncate, IDS[0], 0, 3) == "out_of_order"  # not during a step


def test_idle_expiry():
    t = table()
    t.open(IDS[0], 0, 1, 5, now=0)
    t.open(IDS[1], 0, 1, 5, now=5)
    assert t.expire(now=IDLE) == []  # exactly the timeout is not yet idle "for longer"
    expired = t.expire(now=IDLE + 0.5)
    assert [s.session_id for s in expired] == [IDS[0]]
    assert IDS[0] not in t and IDS[1] in t and t.reserved_tokens == 5


def test_activity_postpones_expiry():
    t = table()
    t.open(IDS[0], 0, 1, 20, now=0)
    s = t.begin_step(IDS[0], 0, 1, now=8)
    t.end_step(s, 1, now=9, ok=True)
    assert t.expire(now=IDLE + 5) == []
    t.truncate(IDS[0], 0, now=15)
    assert t.expire(now=15 + IDLE) == []
    assert len(t.expire(now=15 + IDLE + 0.01)) == 1


def test_a_session_mid_step_never_expires():
    t = table()
    t.open(IDS[0], 0, 1, 5, now=0)
    s = t.begin_step(IDS[0], 0, 1, now=0)
    assert t.expire(now=1e9) == []
    t.end_step(s, 1, now=1, ok=True)
    assert [x.session_id for x in t.expire(now=1 + IDLE + 1)] == [IDS[0]]


# ---------------------------------------------------------------- state machine


@dataclasses.dataclass
class Model:
    max_tokens: int
    length: int = 0
    in_step: bool = False
    pending: int = 0
    last_used: float = 0.0


class SessionMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.table = table()
        self.model: dict[bytes, Model] = {}
        self.handles: dict[bytes, object] = {}
        self.now = 0.0

    def reserved(self) -> int:
        return sum(m.max_tokens for m in self.model.values())

    @rule(dt=st.floats(min_value=0, max_value=6))
    def tick(self, dt):
        self.now += dt

    @rule(sid=st.sampled_from(IDS), max_tokens=st.integers(-1, MAX_SESSION + 2))
    def open(self, sid, max_tokens):
        if sid in self.model:
            expected = "session_exists"
        elif not 1 <= max_tokens <= MAX_SESSION:
            expected = "too_long"
        elif max_tokens > BUDGET - self.reserved():
            expected = "busy"
        else:
            expected = None
        got = code_of(self.table.open, sid, 0, 1, max_tokens, self.now)
        assert got == expected
        if expected is None:
            self.model[sid] = Model(max_tokens, last_used=self.now)

    @rule(sid=st.sampled_from(IDS), tokens=st.integers(0, MAX_STEP + 1))
    def step_at_expected_position(self, sid, tokens):
        m = self.model.get(sid)
        if m is None:
            expected = "unknown_session"
        elif m.in_step:
            expected = "out_of_order"
        elif not 1 <= tokens <= MAX_STEP or m.length + tokens > m.max_tokens:
            expected = "too_long"
        else:
            expected = None
        position = m.length if m else 0
        try:
            session = self.table.begin_step(sid, position, tokens, self.now)
            got = None
        except Rejected as exc:
            got = exc.code
        assert got == expected
        if expected is None:
            m.in_step, m.pending, m.last_used = True, tokens, self.now
            self.handles[sid] = session

    @precondition(lambda self: self.model)
    @rule(data=st.data(), offset=st.integers(-30, 30).filter(lambda x: x != 0),
          tokens=st.integers(-1, MAX_STEP + 1))
    def step_at_wrong_position(self, data, offset, tokens):
        sid = data.draw(st.sampled_from(sorted(self.model)))
        m = self.model[sid]
        before = (self.table.get(sid).length, self.table.get(sid).in_step, self.table.get(sid).last_used)
        assert code_of(self.table.begin_step, sid, m.length + offset, tokens, self.now + 1) == "out_of_order"
        s = self.table.get(sid)
        assert (s.length, s.in_step, s.last_used) == before

    @precondition(lambda self: any(m.in_step for m in self.model.values()))
    @rule(data=st.data(), ok=st.booleans())
    def end_step(self, data, ok):
        sid = data.draw(st.sampled_from(sorted(s for s, m in self.model.items() if m.in_step)))
        m = self.model[sid]
        self.table.end_step(self.handles.pop(sid), m.pending, self.now, ok=ok)
        if ok:
            m.length += m.pending
        m.in_step, m.pending, m.last_used = False, 0, self.now

    @rule(sid=st.sampled_from(IDS), position=st.integers(-2, MAX_SESSION + 2))
    def truncate(self, sid, position):
        m = self.model.get(sid)
        if m is None:
            expected = "unknown_session"
        elif m.in_step or not 0 <= position <= m.length:
            expected = "out_of_order"
        else:
            expected = None
        assert code_of(self.table.truncate, sid, position, self.now) == expected
        if expected is None:
            m.length, m.last_used = position, self.now

    @rule(sid=st.sampled_from(IDS))
    def close(self, sid):
        closed = self.table.close(sid)
        assert (closed is not None) == (sid in self.model)
        if closed is not None:
            assert closed.session_id == sid
            del self.model[sid]
            self.handles.pop(sid, None)

    @rule()
    def expire(self):
        expected = {s for s, m in self.model.items() if not m.in_step and self.now - m.last_used > IDLE}
        got = {s.session_id for s in self.table.expire(self.now)}
        assert got == expected
        for sid in expected:
            del self.model[sid]

    @invariant()
    def matches_model(self):
        assert len(self.table) == len(self.model)
        assert self.table.reserved_tokens == self.reserved()
        assert 0 <= self.table.reserved_tokens <= BUDGET
        assert self.table.free_tokens == BUDGET - self.reserved()
        for sid in IDS:
            assert (sid in self.table) == (sid in self.model)
        for sid, m in self.model.items():
            s = self.table.get(sid)
            assert (s.length, s.in_step, s.max_tokens, s.last_used) == (m.length, m.in_step, m.max_tokens,
                                                                        m.last_used)
            assert 0 <= s.length <= s.max_tokens


SessionMachine.TestCase.settings = settings(max_examples=100, stateful_step_count=40, deadline=None)
TestSessionTable = SessionMachine.TestCase


# ---------------------------------------------------------------- the core's transitions


def test_the_transition_table_is_the_only_way_a_state_changes():
    from compushare.pipeline.server.session import TRANSITIONS, Event, InvalidTransition, State

    t = table()
    s = t.open(IDS[0], 0, 1, 20, now=0)
    assert s.state is State.READY
    # every (state, event) pair not in the table is refused, with the peer's error or as a driver bug
    assert (State.STEPPING, Event.STEP) not in TRANSITIONS and (State.READY, Event.COMPUTED) not in TRANSITIONS
    t.begin_step(IDS[0], 0, 1, now=0)
    with pytest.raises(Rejected, match="still being computed"):
        t.push(IDS[0], 0, 1, b"x", "float32", now=0)
    with pytest.raises(InvalidTransition, match="computed is not allowed in state stepping"):
        t.computed(s, s.step, None, None, 0.0)
    assert s.state is State.STEPPING
    # everything a live session can do, and nothing leaves CLOSED
    for state in State:
        if state is not State.CLOSED:
            assert TRANSITIONS[state, Event.CLOSE] is State.CLOSED
            assert TRANSITIONS[state, Event.RECEIPT] is state and TRANSITIONS[state, Event.LINK] is state
    assert {after for (before, _), after in TRANSITIONS.items() if before is State.CLOSED} == {State.CLOSED}
    assert {state for state, event in TRANSITIONS if event is Event.EXPIRE} == {State.READY, State.PUSH_COMPUTED}


def test_a_pushed_step_confirmed_mismatched_or_discarded():
    from compushare.pipeline.server.session import RollBack, State, UsePushed, Wait

    t = table()
    s = t.open(IDS[0], 0, 1, 20, now=0, owner="consumer")
    with pytest.raises(Rejected, match="takes no pushes"):
        t.check_pusher(s, "upstream")
    assert code_of(t.link, s, "stranger", "upstream", None, pushes=True) == "bad_request"
    assert code_of(t.link, s, "consumer", "upstream", None, pushes=False) == "bad_request"
    t.link(s, "consumer", "upstream", None, pushes=True)
    t.check_pusher(s, "upstream")
    step = t.push(IDS[0], 0, 2, b"ab", "float32", now=1)
    assert s.state is State.COMPUTING_PUSH and s.step is step and s.in_step
    assert t.settle(s, 0, b"ab", "float32", 1, now=2) == Wait(step)
    assert t.expire(now=1e9) == []  # being computed: never expires
    t.computed(s, step, "output", "encoded", 0.5)
    assert s.state is State.PUSH_COMPUTED and s.last_used == 1  # idle since the push
    decision = t.settle(s, 0, b"ab", "float32", 1, now=3)
    assert decision == UsePushed(step) and decision.step.output == "output"
    assert (s.state, s.length, s.step, t.tokens_served, t.push_hits) == (State.READY, 2, None, 2, 1)
    assert (s.unreceipted_tokens, s.unreceipted_ms) == (2, 500.0)
    # another input, dtype or chunking: rolled back, counted as a miss, the length unchanged
    for data, dtype, chunks in [(b"xx", "float32", 1), (b"cd", "float16", 1), (b"cd", "float32", 2)]:
        t.computed(s, t.push(IDS[0], 2, 2, b"cd", "float32", now=4), None, None, 0.1)
        assert t.settle(s, 2, data, dtype, chunks, now=5) == RollBack(2)
        assert (s.state, s.length, s.step) == (State.READY, 2, None)
    assert (t.push_hits, t.push_misses, t.tokens_served) == (1, 3, 2)
    # a truncate discards a computed one first (not a miss), and waits for one being computed
    pending = t.push(IDS[0], 2, 1, b"e", "float32", now=6)
    assert t.discard(s, now=6) == Wait(pending)
    t.failed(s, pending, now=7)  # its compute failed: rolled back by the driver
    assert (s.state, s.step, s.last_used) == (State.READY, None, 7)
    assert t.discard(s, now=7) is None
    t.computed(s, t.push(IDS[0], 2, 1, b"e", "float32", now=8), None, None, 0.1)
    assert code_of(t.truncate, IDS[0], 1, 8) == "out_of_order"  # not past a step waiting to be confirmed
    assert t.discard(s, now=9) == RollBack(2) and s.state is State.READY
    assert t.truncate(IDS[0], 1, now=9).length == 1 and t.push_misses == 3


def test_work_begun_before_a_close_still_ends():
    from compushare.pipeline.server.session import State

    t = table()
    s = t.open(IDS[0], 0, 1, 20, now=0)
    t.begin_step(IDS[0], 0, 3, now=0)
    assert t.close(IDS[0]) is s and s.state is State.CLOSED
    t.end_step(s, 3, now=1, ok=True)  # its reply still goes out, and it was served
    assert s.state is State.CLOSED and t.tokens_served == 3
    t.receipted(s)  # a receipt kept while it closed is still countersigned
    assert code_of(t.begin_step, IDS[0], 3, 1, 2) == "unknown_session"
    u = t.open(IDS[1], 0, 1, 20, now=0, owner="c")
    t.link(u, "c", "up", None, pushes=True)
    step = t.push(IDS[1], 0, 1, b"x", "float32", now=0)
    assert t.drop_all() == 1 and len(t) == 0 and t.reserved_tokens == 0
    t.computed(u, step, None, None, 0.0)
    assert u.state is State.CLOSED


@dataclasses.dataclass
class Held:
    max_tokens: int
    owner: str
    last_used: float
    length: int = 0
    state: str = "ready"
    step: tuple | None = None  # (position, tokens, pushed data or None, dtype)
    upstream: str | None = None
    receipt_seq: int = 0
    unreceipted: int = 0
    provable: bool = True


OWNERS, DATA = ["alice", "bob"], [b"aa", b"bb"]
MACHINE_SESSIONS = 3
MIN_RESERVED = -(-BUDGET // MACHINE_SESSIONS)  # a session holds at least this much of the budget


def reserve(max_tokens: int) -> int:
    return max(max_tokens, MIN_RESERVED)


class CoreMachine(RuleBasedStateMachine):
    """Random sequences of every event the driver reports, against a simple model."""

    def __init__(self) -> None:
        super().__init__()
        self.table = table(max_sessions=MACHINE_SESSIONS, max_sessions_per_peer=2)
        self.model: dict[bytes, Held] = {}
        self.closed_in_flight: list[tuple[object, object]] = []  # (session, step) closed mid-compute
        self.now = 0.0
        self.served = self.hits = self.misses = 0

    def session(self, sid):
        return self.table.get(sid)

    def begin_expected(self, held: Held | None, position: int, tokens: int) -> str | None:
        if held is None:
            return "unknown_session"
        if held.state != "ready" or position != held.length:
            return "out_of_order"
        if not 1 <= tokens <= MAX_STEP or held.length + tokens > held.max_tokens:
            return "too_long"
        return None

    @initialize(max_tokens=st.integers(6, 16))
    def two_linked_sessions(self, max_tokens):
        for sid, owner in zip(IDS[:2], OWNERS):
            self.open(sid, max_tokens, owner, linked=True)

    @rule(dt=st.floats(min_value=0, max_value=6), expire=st.booleans())
    def time_passes(self, dt, expire):
        self.now += dt
        if expire:
            self.expire()

    @rule(sid=st.sampled_from(IDS), max_tokens=st.one_of(st.integers(6, 12), st.integers(0, MAX_SESSION + 1)),
          owner=st.sampled_from(OWNERS), linked=st.booleans())
    def open(self, sid, max_tokens, owner, linked):
        reserved = sum(reserve(h.max_tokens) for h in self.model.values())
        if sid in self.model:
            expected = "session_exists"
        elif sum(h.owner == owner for h in self.model.values()) >= 2:
            expected = "busy"
        elif not 1 <= max_tokens <= MAX_SESSION:
            expected = "too_long"
        elif reserve(max_tokens) > BUDGET - reserved:
            expected = "busy_unless_reclaimed"
        elif len(self.model) >= MACHINE_SESSIONS:  # the minimum reserve bounds the count first
            raise AssertionError("more sessions than the budget holds at the minimum reserve")
        else:
            expected = None
        code = code_of(self.table.open, sid, 0, 1, max_tokens, self.now, owner=owner)
        if expected == "busy_unless_reclaimed":
            expected = self.check_reclaim(owner, reserve(max_tokens), code)
        assert code == expected
        if expected is None:
            self.model[sid] = Held(max_tokens, owner, self.now)
            if linked:  # the consumer links it at once, as it does
                self.table.link(self.table.get(sid), owner, "up", None, pushes=True)
                self.model[sid].upstream = "up"

    def check_reclaim(self, owner, max_tokens, code):
        """An ask beyond the free budget: either busy, when the asker would go over its
        fair share or too little is held over shares; or it fits after reclaiming only
        sessions of peers that were over their share (a step in flight then ends in a
        closed session, as after a close)."""
        held = collections.Counter()
        for h in self.model.values():
            held[h.owner] += reserve(h.max_tokens)
        share = BUDGET // len(set(held) | {owner})
        reclaimable = sum(reserve(h.max_tokens) for h in self.model.values()
                          if h.owner != owner and held[h.owner] > share)
        free = BUDGET - sum(held.values())
        if code == "busy":
            assert held[owner] + max_tokens > share or free + reclaimable < max_tokens
            return "busy"
        assert code is None and held[owner] + max_tokens <= share
        gone = [sid for sid in self.model if sid not in self.table]
        reclaimed = {s.session_id: s for s in self.table.take_reclaimed()}
        assert gone and set(reclaimed) == set(gone)
        for sid in gone:
            lost = self.model.pop(sid)
            assert lost.owner != owner and held[lost.owner] > share and reclaimed[sid].reclaimed
            if lost.state in ("stepping", "computing_push"):
                self.closed_in_flight.append((reclaimed[sid], reclaimed[sid].step))
        return None

    @precondition(lambda self: self.model)
    @rule(data=st.data(), stranger=st.booleans(), upstream=st.sampled_from([None, "up", "up", "other"]))
    def link(self, data, stranger, upstream):
        sid = data.draw(st.sampled_from(sorted(self.model)))
        held = self.model[sid]
        peer = "mallory" if stranger else held.owner
        got = code_of(self.table.link, self.session(sid), peer, upstream, None, pushes=True)
        assert got == ("bad_request" if stranger else None)
        if got is None:
            held.upstream = upstream

    @rule(sid=st.sampled_from(IDS))
    def step_of_an_unknown_session(self, sid):
        if sid not in self.model:
            assert code_of(self.table.get, sid) == "unknown_session"
            assert code_of(self.table.begin_step, sid, 0, 1, self.now) == "unknown_session"
            assert code_of(self.table.push, sid, 0, 1, b"x", "float32", self.now) == "unknown_session"

    @precondition(lambda self: self.model)
    @rule(pick=st.data(), tokens=st.one_of(st.integers(1, 3), st.integers(0, MAX_STEP + 1)),
          offset=st.sampled_from([0, 0, 0, -1, 1]),
          same=st.booleans(), data=st.sampled_from(DATA), dtype=st.sampled_from(["float32", "float16"]),
          chunks=st.sampled_from([1, 1, 2]))
    def consumer_step(self, pick, tokens, offset, same, data, dtype, chunks):
        self.step_on(pick.draw(st.sampled_from(sorted(self.model))), tokens, offset, same, data, dtype, chunks)

    @precondition(lambda self: any(h.state == "push_computed" for h in self.model.values()))
    @rule(pick=st.data(), same=st.booleans(), data=st.sampled_from(DATA), dtype=st.sampled_from(["float32", "float16"]),
          chunks=st.sampled_from([1, 1, 2]))
    def consumer_step_after_a_push(self, pick, same, data, dtype, chunks):
        sid = pick.draw(st.sampled_from(sorted(s for s, h in self.model.items() if h.state == "push_computed")))
        self.step_on(sid, self.model[sid].step[1], 0, same, data, dtype, chunks)

    def step_on(self, sid, tokens, offset, same, data, dtype, chunks):
        """What the driver does with a consumer's step: settle any pushed step, then begin its own."""
        held = self.model[sid]
        session = self.session(sid)
        if same and held.step is not None and held.step[2] is not None:  # the pushed input, as pushed
            offset, tokens, data, dtype, chunks = held.step[0] - held.length, held.step[1], held.step[2], \
                held.step[3], 1
        position = held.length + offset
        before = held.length
        decision = self.table.settle(session, position, data, dtype, chunks, self.now)
        kind = type(decision).__name__ if decision is not None else None
        if held.state == "computing_push":
            assert kind == "Wait" and decision.step is session.step
            return
        if held.state == "push_computed":
            pos, n, pushed, pushed_dtype = held.step
            if (position, data, dtype, chunks) == (pos, pushed, pushed_dtype, 1):
                assert kind == "UsePushed" and decision.step.tokens == n
                held.provable = held.provable and len(pushed) % n == 0  # rows the chain can take
                held.length += n
                held.unreceipted += n
                self.served += n
                self.hits += 1
                held.state, held.step, held.last_used = "ready", None, self.now
                return
            assert kind == "RollBack" and decision.position == pos
            assert session.length == before  # a rolled-back pushed step leaves the length as it was
            self.misses += 1
            held.state, held.step, held.last_used = "ready", None, self.now
        else:
            assert decision is None
        expected = self.begin_expected(held, position, tokens)
        snapshot = (session.length, session.state, session.last_used)
        assert code_of(self.table.begin_step, sid, position, tokens, self.now) == expected
        if expected is None:
            held.state, held.step, held.last_used = "stepping", (position, tokens, None, None), self.now
        else:  # a refused step touches nothing
            assert (session.length, session.state, session.last_used) == snapshot

    @precondition(lambda self: any(h.state == "stepping" for h in self.model.values()))
    @rule(data=st.data(), ok=st.booleans(), seconds=st.floats(0, 2))
    def step_ends(self, data, ok, seconds):
        sid = data.draw(st.sampled_from(sorted(s for s, h in self.model.items() if h.state == "stepping")))
        held = self.model[sid]
        _, tokens, _, _ = held.step
        self.table.end_step(self.session(sid), tokens, self.now, ok=ok, seconds=seconds, data=b"in!!" * tokens,
                            dtype="float32")
        if ok:
            held.length += tokens
            held.unreceipted += tokens
            self.served += tokens
        held.state, held.step, held.last_used = "ready", None, self.now

    @precondition(lambda self: self.model)
    @rule(pick=st.data(), peer=st.sampled_from(["up", "up", "up", "other"]),
          tokens=st.one_of(st.integers(1, 3), st.integers(0, MAX_STEP + 1)),
          offset=st.sampled_from([0, 0, 1]), data=st.sampled_from(DATA), dtype=st.sampled_from(["float32", "float16"]))
    def push(self, pick, peer, tokens, offset, data, dtype):
        sid = pick.draw(st.sampled_from(sorted(self.model)))
        held = self.model[sid]
        session = self.session(sid)
        if held.upstream is None or held.upstream != peer:
            assert code_of(self.table.check_pusher, session, peer) == "bad_request"
            return
        self.table.check_pusher(session, peer)
        position = held.length + offset
        expected = self.begin_expected(held, position, tokens)
        assert code_of(self.table.push, sid, position, tokens, data, dtype, self.now) == expected
        if expected is None:
            held.state, held.step, held.last_used = "computing_push", (position, tokens, data, dtype), self.now

    @precondition(lambda self: any(h.state == "computing_push" for h in self.model.values()))
    @rule(data=st.data(), ok=st.booleans())
    def pushed_step_ends(self, data, ok):
        sid = data.draw(st.sampled_from(sorted(s for s, h in self.model.items() if h.state == "computing_push")))
        held, session = self.model[sid], self.session(sid)
        if ok:
            self.table.computed(session, session.step, "out", "wire", 0.25)
            held.state = "push_computed"  # idle time runs from the push
        else:
            self.table.failed(session, session.step, self.now)
            held.state, held.step, held.last_used = "ready", None, self.now

    @rule(sid=st.sampled_from(IDS), position=st.integers(-1, MAX_SESSION + 1))
    def truncate(self, sid, position):
        """What the driver does with a truncate: discard a computed pushed step, then truncate."""
        held = self.model.get(sid)
        if held is None:
            assert code_of(self.table.truncate, sid, position, self.now) == "unknown_session"
            return
        session = self.session(sid)
        decision = self.table.discard(session, self.now)
        if held.state == "computing_push":
            assert type(decision).__name__ == "Wait"
            return
        if held.state == "push_computed":
            assert type(decision).__name__ == "RollBack" and decision.position == held.step[0]
            held.state, held.step, held.last_used = "ready", None, self.now
        else:
            assert decision is None
        if held.state != "ready" or not 0 <= position <= held.length:
            expected = "out_of_order"
        else:
            expected = None
        assert code_of(self.table.truncate, sid, position, self.now) == expected
        if expected is None:
            held.length, held.last_used = position, self.now

    @precondition(lambda self: self.model)
    @rule(data=st.data())
    def receipt(self, data):
        sid = data.draw(st.sampled_from(sorted(self.model)))
        self.table.receipted(self.session(sid))
        held = self.model[sid]
        held.receipt_seq, held.unreceipted = held.receipt_seq + 1, 0

    @rule(sid=st.sampled_from(IDS))
    def close(self, sid):
        held = self.model.pop(sid, None)
        session = self.table.get(sid) if held is not None else None
        assert (self.table.close(sid) is session) and (session is None) == (held is None)
        if held is not None and held.state in ("stepping", "computing_push"):
            self.closed_in_flight.append((session, session.step))

    @precondition(lambda self: self.closed_in_flight)
    @rule(ok=st.booleans())
    def late_end(self, ok):
        from compushare.pipeline.server.session import State

        session, step = self.closed_in_flight.pop()
        if step.pushed is not None:
            (self.table.computed(session, step, None, None, 0.0) if ok else self.table.failed(session, step, self.now))
        else:
            self.table.end_step(session, step.tokens, self.now, ok=ok)
            self.served += step.tokens if ok else 0
        assert session.state is State.CLOSED

    def expire(self):
        expected = {s for s, h in self.model.items()
                    if h.state in ("ready", "push_computed") and self.now - h.last_used > IDLE}
        assert {s.session_id for s in self.table.expire(self.now)} == expected
        for sid in expected:
            del self.model[sid]

    @invariant()
    def matches_model(self):
        assert len(self.table) == len(self.model)
        assert self.table.reserved_tokens == sum(reserve(h.max_tokens) for h in self.model.values()) <= BUDGET
        assert (self.table.tokens_served, self.table.push_hits, self.table.push_misses) == (
            self.served, self.hits, self.misses)
        for sid, held in self.model.items():
            s = self.table.get(sid)
            assert s.state.value == held.state and s.in_step == (held.state != "ready")
            assert 0 <= s.length == held.length <= s.max_tokens
            step = None if s.step is None else (s.step.position, s.step.tokens, s.step.pushed, s.step.dtype)
            assert step == held.step
            assert (s.last_used, s.upstream, s.receipt_seq, s.unreceipted_tokens) == (
                held.last_used, held.upstream, held.receipt_seq, held.unreceipted)
            assert (s.chain is not None) == held.provable  # a truncate keeps it: the chain is cut back
            assert s.chain is None or len(s.chain) == s.length


CoreMachine.TestCase.settings = settings(max_examples=200, stateful_step_count=50, deadline=None)
TestSessionCore = CoreMachine.TestCase
