"""What the consumer's chain core (chain_core.py) and its driver (chain.py) say to
each other. Pure data: no I/O, no tensors looked into.

The core emits *actions*. Requests are answered by exactly one event each, fed back
in the order of the requests: `OpenSession` → `SessionOpened` | `Failed`; `SendSteps` →
`Answered` | `Failed`; `FindRoute` → `RouteFound` (or the planner's RouteError
propagates); `FindVerifier` → `VerifierFound`; `Link`, `SendReceipt` → `Done`.
Effects (`Penalise`, `Forgive`, `Abort`, `Close`, `FileReport`) are answered by
nothing; the driver applies them, in order, before it starts the requests emitted
with them. The requests of one batch run at once (a hop's step next to its spot
check, receipts, links, the first sessions of a chain).

Payloads (`inputs`, outputs) are whatever the driver hands in (torch tensors): the
core stores and forwards them and only compares outputs (judging a spot check).

Also here: the `Phase` a batch of requests waits in and the `Kind` of the events
answering it, the two keys of the core's transition table (chain_core.TRANSITIONS).
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Any

from ...errors import HopFailed
from .routing import Hop

Span = tuple[int, int]  # blocks start..end-1


@dataclasses.dataclass(eq=False)
class HopSession:
    """One session the core asked for (a hop, a replacement, a verifier, an arbiter);
    the driver maps it to its stream. Compared by identity."""

    hop: Hop
    answered: int = 0  # requests answered since its last receipt
    linked: tuple = (None, None)  # (upstream peer, downstream HopSession) as last sent
    link_ok: bool = False  # the server took that link: it pushes, and takes steps from_upstream

    @property
    def peer_id(self) -> str:
        return self.hop.peer_id

    @property
    def span(self) -> Span:
        return self.hop.start, self.hop.end


@dataclasses.dataclass(frozen=True)
class HopStepRequest:
    """One `step` request: `inputs` (one payload per original step, concatenated on
    the wire) at `position`, run as `chunks` (token counts, summing to the inputs')."""

    position: int
    inputs: tuple[Any, ...]  # empty with from_upstream
    chunks: tuple[int, ...]
    last_only: bool = False
    rollback: bool = False  # the session may hold more than `position` tokens: cut it back first
    from_upstream: bool = False  # direct return: the input is what the upstream server pushes
    splits: tuple[int, ...] = ()  # how the output is cut into parts, one per original step (empty: by chunks)


@dataclasses.dataclass(frozen=True)
class HopReply:
    """A server's answer to one step request, as the driver decoded it."""

    output: Any  # [1, n, H]: every chunk's, or the last one's with last_only
    data: bytes = b""  # the output's wire bytes (what the proof signs)
    dtype: str = ""
    proof: Any = None  # the server's step proof, None if it sent none
    input_digest: bytes = b""  # proofs.inference.step_digest of the input the consumer sent (none from_upstream)


# -- requests ----------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class OpenSession:
    session: HopSession


@dataclasses.dataclass(frozen=True)
class SendSteps:
    """Requests on one session, one after another; the first failure ends them."""

    session: HopSession
    requests: tuple[HopStepRequest, ...]


@dataclasses.dataclass(frozen=True)
class FindRoute:
    """A route through blocks start..end-1; `fresh`: a new failover begins, with a
    new deadline (the replans of one failover share it)."""

    start: int
    end: int
    fresh: bool


@dataclasses.dataclass(frozen=True)
class FindVerifier:
    """A server holding all of start..end-1 and none of `exclude` (a spot check or a
    third opinion); may be none."""

    start: int
    end: int
    exclude: frozenset[str]


@dataclasses.dataclass(frozen=True)
class Link:
    """Tell `session` its neighbours, so it pushes its output straight to the next."""

    session: HopSession
    upstream: str | None
    downstream: HopSession | None


@dataclasses.dataclass(frozen=True)
class SendReceipt:
    session: HopSession


# -- effects -----------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Penalise:
    peer_id: str
    kind: str  # "fault" (short exclusion) or "mismatch" (blacklist)


@dataclasses.dataclass(frozen=True)
class Forgive:
    """The peer opened a session: its faults are forgiven."""

    peer_id: str


@dataclasses.dataclass(frozen=True)
class Abort:
    session: HopSession


@dataclasses.dataclass(frozen=True)
class Close:
    session: HopSession


@dataclasses.dataclass(frozen=True)
class FileReport:
    """Two servers disagree on a step: keep a failure report naming `accused`, if
    both replies carry matching signed proofs."""

    accused: HopSession
    witness: HopSession
    position: int
    tokens: int
    accused_reply: HopReply
    witness_reply: HopReply


REQUESTS = (OpenSession, SendSteps, FindRoute, FindVerifier, Link, SendReceipt)
EFFECTS = (Penalise, Forgive, Abort, Close, FileReport)


# -- events ------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class SessionOpened:
    pass


@dataclasses.dataclass(frozen=True)
class Answered:
    replies: tuple[HopReply, ...]  # one per request
    parts: tuple[Any, ...] = ()  # every chunk's output, in order (requests without last_only)


@dataclasses.dataclass(frozen=True)
class Failed:
    error: HopFailed  # names the server and the code ("timeout", "busy", "bad_reply"...)
    answered: int = 0  # requests of the SendSteps answered before it failed


@dataclasses.dataclass(frozen=True)
class RouteFound:
    hops: tuple[Hop, ...]


@dataclasses.dataclass(frozen=True)
class VerifierFound:
    hop: Hop | None


@dataclasses.dataclass(frozen=True)
class Done:
    ok: bool = True  # a Link: whether the server took it


# -- the keys of the core's transition table ---------------------------------------

class Phase(enum.Enum):
    """What the core's pending requests are for."""

    IDLE = "idle"  # nothing pending
    OPENING = "opening"  # the route's sessions
    FINDING_STANDBYS = "finding standbys"
    OPENING_STANDBYS = "opening standbys"
    LINKING = "linking"  # hops told their neighbours
    FINDING_VERIFIER = "finding a verifier"
    OPENING_VERIFIER = "opening a verifier"
    STEPPING = "stepping"  # one hop
    STEPPING_CHECKED = "stepping with a spot check"  # one hop, and its verifier
    STEPPING_DIRECTLY = "stepping directly"  # every hop at once
    FINDING_ARBITER = "finding an arbiter"
    OPENING_ARBITER = "opening an arbiter"
    ARBITRATING = "arbitrating"
    RECEIPTS = "receipts"
    REPLANNING = "replanning"  # a route through a failed span
    OPENING_REPLACEMENT = "opening a replacement"
    REPLAYING = "replaying"  # the history through a replacement
    TAKING_OVER = "taking over"  # a standby replaces a failed hop


class Kind(enum.Enum):
    """What a batch of events answers."""

    OPENED = "opened"  # OpenSession: SessionOpened | Failed
    ANSWERED = "answered"  # SendSteps: Answered | Failed
    ROUTE_FOUND = "route found"  # FindRoute
    VERIFIER_FOUND = "verifier found"  # FindVerifier
    DONE = "done"  # Link, SendReceipt


ANSWERS: dict[type, tuple[Kind, tuple[type, ...]]] = {
    OpenSession: (Kind.OPENED, (SessionOpened, Failed)),
    SendSteps: (Kind.ANSWERED, (Answered, Failed)),
    FindRoute: (Kind.ROUTE_FOUND, (RouteFound,)),
    FindVerifier: (Kind.VERIFIER_FOUND, (VerifierFound,)),
    Link: (Kind.DONE, (Done,)),
    SendReceipt: (Kind.DONE, (Done,)),
}


def kind_of(requests: list, events: list) -> Kind | None:
    """The kind of `events`, if they answer `requests` one each, in order, and are
    all of one kind; None if they do not."""
    if len(events) != len(requests):
        return None
    kinds = set()
    for request, event in zip(requests, events):
        kind, answers = ANSWERS[type(request)]
        if not isinstance(event, answers):
            return None
        kinds.add(kind)
    return kinds.pop() if len(kinds) == 1 else None


def count_answered(session: HopSession, event) -> None:
    """Requests answered, towards the session's next receipt."""
    if isinstance(event, Answered):
        session.answered += len(event.replies)
    elif isinstance(event, Failed):
        session.answered += event.answered
