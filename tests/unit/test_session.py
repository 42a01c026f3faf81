"""pipeline/session.py: admission by KV budget, strict step order, truncate, expiry."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

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
