"""What the consumer's chain core (chain_core.py) and its driver (chain.py) say to
each other. Pure data: no I/O, no tensors looked into.

The core emits *actions*. Requests are answered by exactly one event each, fed back
in the order of the requests: `OpenSession` → `Opened` | `Failed`; `SendSteps` →
`Answered` | `Failed`; `FindRoute` → `RouteFound` (or the planner's RouteError
propagates); `FindVerifier` → `VerifierFound`; `Link`, `SendReceipt` → `Done`.
Effects (`Penalise`, `Forgive`, `Abort`, `Close`, `FileReport`) are answered by
nothing; the driver applies them, in order, before it starts the requests emitted
with them. The requests of one batch run at once (a hop's step next to its spot
check, receipts, links, the first sessions of a chain).

Payloads (`inputs`, outputs) are whatever the driver hands in (torch tensors): the
core stores and forwards them and only compares outputs (judging a spot check).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from ...errors import HopFailed
from .routing import Hop


@dataclasses.dataclass(eq=False)
class Session:
    """One session the core asked for (a hop, a replacement, a verifier, an arbiter);
    the driver maps it to its stream. Compared by identity."""

    hop: Hop
    answered: int = 0  # requests answered since its last receipt
    linked: tuple = (None, None)  # (upstream peer, downstream Session) as last sent
    link_ok: bool = False  # the server took that link: it pushes, and takes steps from_upstream

    @property
    def peer_id(self) -> str:
        return self.hop.peer_id

    @property
    def span(self) -> tuple[int, int]:
        return self.hop.start, self.hop.end


@dataclasses.dataclass(frozen=True)
class StepRequest:
    """One `step` request: `inputs` (one payload per original step, concatenated on
    the wire) at `position`, run as `chunks` (token counts, summing to the inputs')."""

    position: int
    inputs: tuple[Any, ...]  # empty with from_upstream
    chunks: tuple[int, ...]
    last_only: bool = False
    rollback: bool = False  # the session may hold more than `position` tokens: cut it back first
    from_upstream: bool = False  # direct return: the input is what the upstream server pushes


@dataclasses.dataclass(frozen=True)
class Reply:
    """A server's answer to one step request, as the driver decoded it."""

    output: Any  # [1, n, H]: every chunk's, or the last one's with last_only
    data: bytes = b""  # the output's wire bytes (what the proof signs)
    dtype: str = ""
    proof: Any = None  # the server's step proof, None if it sent none
    input_digest: bytes = b""  # proofs.step_digest of the input the consumer sent (none from_upstream)


# -- requests ----------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class OpenSession:
    session: Session


@dataclasses.dataclass(frozen=True)
class SendSteps:
    """Requests on one session, one after another; the first failure ends them."""

    session: Session
    requests: tuple[StepRequest, ...]


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

    session: Session
    upstream: str | None
    downstream: Session | None


@dataclasses.dataclass(frozen=True)
class SendReceipt:
    session: Session


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
    session: Session


@dataclasses.dataclass(frozen=True)
class Close:
    session: Session


@dataclasses.dataclass(frozen=True)
class FileReport:
    """Two servers disagree on a step: keep a failure report naming `accused`, if
    both replies carry matching signed proofs."""

    accused: Session
    witness: Session
    position: int
    tokens: int
    accused_reply: Reply
    witness_reply: Reply


REQUESTS = (OpenSession, SendSteps, FindRoute, FindVerifier, Link, SendReceipt)
EFFECTS = (Penalise, Forgive, Abort, Close, FileReport)


# -- events ------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Opened:
    pass


@dataclasses.dataclass(frozen=True)
class Answered:
    replies: tuple[Reply, ...]  # one per request
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
