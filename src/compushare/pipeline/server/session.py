"""The server's session table: pure state, no I/O, no torch.

Every step names the position of its first token; it must equal the number of
tokens the session already holds, so a stale, repeated or skipped frame is
rejected instead of being applied to the KV cache. Rolling back is its own
operation (`truncate`), never a side effect of a step.
"""

from __future__ import annotations

import dataclasses

from .. import protocol
from ...proofs import InputDigest


class Rejected(Exception):
    """A request the table refuses; `code` goes into the error reply."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message


@dataclasses.dataclass
class Session:
    session_id: bytes
    start: int
    end: int
    max_tokens: int
    last_used: float
    length: int = 0
    in_step: bool = False
    cache: object = None  # the KV cache; opaque here
    owner: str = ""  # the peer that opened it
    digest: InputDigest | None = dataclasses.field(default_factory=InputDigest)  # every input, in order
    # Karma: what the next receipt may cover (the steps computed since the last one).
    receipt_seq: int = 0
    unreceipted_tokens: int = 0
    unreceipted_ms: float = 0.0
    # Pushes (pipeline/push.py): who may push inputs here, where outputs are pushed,
    # and a step computed from a push that awaits the consumer's copy of its input.
    upstream: str | None = None
    downstream: object = None
    speculation: object = None


class SessionTable:
    def __init__(self, *, budget_tokens: int, max_session_tokens: int, max_step_tokens: int,
                 idle_timeout_s: float, max_sessions: int = 256, max_sessions_per_peer: int = 32) -> None:
        self.budget_tokens = budget_tokens
        self.max_sessions = max_sessions
        self.max_sessions_per_peer = max_sessions_per_peer
        self.max_session_tokens = max_session_tokens
        self.max_step_tokens = max_step_tokens
        self.idle_timeout_s = idle_timeout_s
        self._sessions: dict[bytes, Session] = {}

    def __len__(self) -> int:
        return len(self._sessions)

    def __contains__(self, session_id: bytes) -> bool:
        return session_id in self._sessions

    @property
    def reserved_tokens(self) -> int:
        return sum(s.max_tokens for s in self._sessions.values())

    @property
    def free_tokens(self) -> int:
        return self.budget_tokens - self.reserved_tokens

    def open(self, session_id: bytes, start: int, end: int, max_tokens: int, now: float,
             owner: str = "") -> Session:
        if session_id in self._sessions:
            raise Rejected(protocol.SESSION_EXISTS, "a session with this id is already open")
        if len(self._sessions) >= self.max_sessions:
            raise Rejected(protocol.BUSY, f"{len(self._sessions)} sessions open, the most this server holds")
        if sum(1 for s in self._sessions.values() if s.owner == owner) >= self.max_sessions_per_peer:
            raise Rejected(protocol.BUSY, f"{self.max_sessions_per_peer} sessions of this peer are open already")
        if not (1 <= max_tokens <= self.max_session_tokens):
            raise Rejected(protocol.TOO_LONG, f"max_tokens must be 1..{self.max_session_tokens}")
        if max_tokens > self.free_tokens:
            raise Rejected(
                protocol.BUSY,
                f"KV budget full: {self.free_tokens} of {self.budget_tokens} tokens free, {max_tokens} asked",
            )
        session = Session(session_id, start, end, max_tokens, last_used=now, owner=owner)
        self._sessions[session_id] = session
        return session

    def get(self, session_id: bytes) -> Session:
        session = self._sessions.get(session_id)
        if session is None:
            raise Rejected(protocol.UNKNOWN_SESSION, "no such session (never opened, closed or expired)")
        return session

    def begin_step(self, session_id: bytes, position: int, tokens: int, now: float) -> Session:
        session = self.get(session_id)
        if session.in_step:
            raise Rejected(protocol.OUT_OF_ORDER, "a step of this session is still being computed")
        if position != session.length:
            raise Rejected(
                protocol.OUT_OF_ORDER, f"step at position {position}, session holds {session.length} tokens"
            )
        if not (1 <= tokens <= self.max_step_tokens):
            raise Rejected(protocol.TOO_LONG, f"a step carries 1..{self.max_step_tokens} tokens")
        if session.length + tokens > session.max_tokens:
            raise Rejected(
                protocol.TOO_LONG, f"{session.length}+{tokens} tokens exceed the session's {session.max_tokens}"
            )
        session.in_step = True
        session.last_used = now
        return session

    def end_step(self, session: Session, tokens: int, now: float, *, ok: bool) -> None:
        session.in_step = False
        session.last_used = now
        if ok:
            session.length += tokens

    def truncate(self, session_id: bytes, position: int, now: float) -> Session:
        session = self.get(session_id)
        if session.in_step:
            raise Rejected(protocol.OUT_OF_ORDER, "cannot truncate during a step")
        if not (0 <= position <= session.length):
            raise Rejected(protocol.OUT_OF_ORDER, f"cannot truncate to {position}: holds {session.length}")
        if position != session.length:
            # The running digest cannot be rewound: steps after a rollback are not provable.
            session.digest = None
        session.length = position
        session.last_used = now
        return session

    def close(self, session_id: bytes) -> Session | None:
        return self._sessions.pop(session_id, None)

    def expire(self, now: float) -> list[Session]:
        """Drop sessions idle for longer than the timeout (never one mid-step; a step
        computed from a push that its consumer never confirmed does not count)."""
        idle = [
            s for s in self._sessions.values()
            if (not s.in_step or getattr(s.speculation, "finished", False)) and now - s.last_used > self.idle_timeout_s
        ]
        for session in idle:
            del self._sessions[session.session_id]
        return idle
