"""Who computes next on a server: fair among peers, decode steps first. Pure, no I/O.

Every forward a server runs is a *piece*: a step's chunk (protocol.md) cut into
pieces of at most PIECE_TOKENS tokens (`pieces`), so no single forward of one
peer's long prefill holds the compute for long. Pieces wait here for one of the
server's compute slots. The scheduler picks, among the waiting pieces,

1. a *short* piece (at most SHORT_TOKENS tokens: a decode step, a few drafted
   tokens) before any longer one: a decode step waits for at most the piece that
   is running, never for a queue of another peer's prefill;
2. within the class, the piece with the smallest start tag of start-time fair
   queueing (Goyal et al. 1996), costed in tokens: each peer's pieces are
   tagged S = max(V, F_prev), F = S + tokens, and V is the start tag of the piece
   last granted. Peers that want compute share it equally by tokens; a peer that
   was idle does not bank credit;
3. ties by arrival.

With `fair=False` (the defence switched off, tests only) pieces are granted in
arrival order and `pieces` does not cut chunks: the server of before.
"""

from __future__ import annotations

import dataclasses
import itertools

PIECE_TOKENS = 64  # protocol.md: a chunk is computed in pieces of at most this many tokens
SHORT_TOKENS = 8


def pieces(chunks: list[int] | tuple[int, ...], *, fair: bool = True) -> list[int]:
    """The forwards a step's `chunks` are computed as, in order: each chunk cut into
    pieces of PIECE_TOKENS, the last one shorter. Depends on the request alone, so
    a replay of the same history computes the very same pieces (bit-identical)."""
    if not fair:
        return list(chunks)
    out = []
    for size in chunks:
        whole, rest = divmod(size, PIECE_TOKENS)
        out.extend([PIECE_TOKENS] * whole + ([rest] if rest else []))
    return out


@dataclasses.dataclass(eq=False)
class Ticket:
    """One piece waiting for (or holding) a compute slot."""

    peer: str
    tokens: int
    arrival: int
    start_tag: float = 0.0
    granted: bool = False

    @property
    def short(self) -> bool:
        return self.tokens <= SHORT_TOKENS


class FairScheduler:
    def __init__(self, slots: int, *, fair: bool = True) -> None:
        if slots < 1:
            raise ValueError("a scheduler needs at least one slot")
        self.slots, self.fair = slots, fair
        self.running = 0
        self._waiting: list[Ticket] = []
        self._finish: dict[str, float] = {}  # each peer's last finish tag (only while it has work)
        self._busy: dict[str, int] = {}  # pieces of each peer waiting or running
        self._virtual = 0.0
        self._arrivals = itertools.count()

    def __len__(self) -> int:
        """Pieces waiting."""
        return len(self._waiting)

    def submit(self, peer: str, tokens: int) -> Ticket:
        """A piece of `tokens` tokens for `peer` wants a slot: call `grant` to learn
        who goes now."""
        start = max(self._virtual, self._finish.get(peer, 0.0))
        ticket = Ticket(peer, tokens, next(self._arrivals), start)
        self._finish[peer] = start + tokens
        self._busy[peer] = self._busy.get(peer, 0) + 1
        self._waiting.append(ticket)
        return ticket

    def grant(self) -> list[Ticket]:
        """The waiting pieces that get a slot now (marked granted), best first."""
        granted = []
        while self._waiting and self.running < self.slots:
            ticket = min(self._waiting, key=self._order)
            self._waiting.remove(ticket)
            ticket.granted = True
            self.running += 1
            self._virtual = max(self._virtual, ticket.start_tag)
            granted.append(ticket)
        return granted

    def _order(self, ticket: Ticket) -> tuple:
        if not self.fair:
            return (ticket.arrival,)
        return (not ticket.short, ticket.start_tag, ticket.arrival)

    def done(self, ticket: Ticket) -> None:
        """A granted piece ended, or a waiting one was given up (its waiter left)."""
        if ticket.granted:
            ticket.granted = False
            self.running -= 1
        elif ticket in self._waiting:
            self._waiting.remove(ticket)
        else:
            return  # already done
        self._busy[ticket.peer] -= 1
        if not self._busy[ticket.peer]:  # an idle peer banks no credit: its tag restarts from V
            del self._busy[ticket.peer]
            del self._finish[ticket.peer]
