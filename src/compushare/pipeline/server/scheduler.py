"""Who computes next on a server: fair among peers, decode steps first. Pure, no I/O.

Every forward a server runs is a *piece*: a step's chunk (protocol.md) cut into
pieces of at most PIECE_TOKENS tokens (`pieces`). Pieces wait here for the
server's compute `slots`:

1. a *short* piece (at most SHORT_TOKENS tokens: a decode step, a few drafted
   tokens) goes before any longer one, and does not wait for a long piece that
   is running: it *preempts* it (the driver pauses the long forward between two
   layers while the short one runs, so a decode step waits about one layer of
   another peer's prefill, never a whole forward or a queue of them). Only while
   its start tag is at most SHORT_LEAD tokens past the smallest tag of the long
   pieces waiting or running, though: beyond that it is just another piece, so
   a peer sending short pieces back to back cannot hold the long ones forever;
2. within each class, the piece with the smallest start tag of start-time fair
   queueing (Goyal et al. 1996), costed in tokens: each peer's pieces are
   tagged S = max(V, F_prev), F = S + tokens, and V is the start tag of the piece
   last granted. Peers that want compute share it equally by tokens; a peer that
   was idle does not bank credit, nor shed what it owes while V has not caught up;
3. ties by arrival.

Long pieces run at most `slots` at a time (fewer while short ones preempt them),
short ones at most `slots` at a time. With `fair=False` (the defence switched
off, tests only) pieces are granted one slot each in arrival order and `pieces`
does not cut chunks: the server of before.
"""

from __future__ import annotations

import dataclasses
import itertools

PIECE_TOKENS = 128  # protocol.md: a chunk is computed in pieces of at most this many tokens
SHORT_TOKENS = 8
MAX_IDLE_PEERS = 4096  # idle peers whose fair-queueing debt is remembered
SHORT_LEAD = 2 * PIECE_TOKENS  # how far (in tokens of fair-queueing time) short pieces may run ahead


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
    preempts: bool = False  # granted as a short piece that long forwards pause for

    @property
    def short(self) -> bool:
        return self.tokens <= SHORT_TOKENS


class FairScheduler:
    def __init__(self, slots: int, *, fair: bool = True) -> None:
        if slots < 1:
            raise ValueError("a scheduler needs at least one slot")
        self.slots, self.fair = slots, fair
        self._running = {"short": 0, "long": 0}
        self._long: list[Ticket] = []  # granted pieces that do not preempt
        self._waiting: list[Ticket] = []
        self._finish: dict[str, float] = {}  # each peer's last finish tag (while it has work or is ahead of V)
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
        """The waiting pieces that get a slot now (marked granted), best first. A short
        piece granted while a long one runs preempts it (`preempting`)."""
        granted = []
        floor = min((t.start_tag for t in (*self._waiting, *self._long) if not t.short), default=float("inf"))
        for ticket in sorted(self._waiting, key=lambda t: self._order(t, floor)):
            if not self._may_run(ticket, floor):
                if not self.fair:
                    break  # arrival order: nobody overtakes
                continue
            self._waiting.remove(ticket)
            ticket.granted = True
            ticket.preempts = self._preempts(ticket, floor)
            if not ticket.preempts:
                self._long.append(ticket)
            self._running[self._class(ticket)] += 1
            self._virtual = max(self._virtual, ticket.start_tag)
            granted.append(ticket)
        return granted

    @property
    def running(self) -> int:
        return sum(self._running.values())

    @property
    def running_short(self) -> int:
        return self._running["short"]

    @property
    def preempting(self) -> bool:
        """Whether short pieces run now (long ones must pause between layers)."""
        return self._running["short"] > 0

    def _preempts(self, ticket: Ticket, floor: float) -> bool:
        return self.fair and ticket.short and ticket.start_tag <= floor + SHORT_LEAD

    def _class(self, ticket: Ticket) -> str:
        return "short" if ticket.preempts else "long"

    def _may_run(self, ticket: Ticket, floor: float) -> bool:
        if self._preempts(ticket, floor):
            return self._running["short"] < self.slots
        return self.running < self.slots

    def _order(self, ticket: Ticket, floor: float) -> tuple:
        if not self.fair:
            return (ticket.arrival,)
        return (not self._preempts(ticket, floor), ticket.start_tag, ticket.arrival)

    def done(self, ticket: Ticket) -> None:
        """A granted piece ended, or a waiting one was given up (its waiter left)."""
        if ticket.granted:
            ticket.granted = False
            self._running[self._class(ticket)] -= 1
            if not ticket.preempts:
                self._long.remove(ticket)
        elif ticket in self._waiting:
            self._waiting.remove(ticket)
        else:
            return  # already done
        self._busy[ticket.peer] -= 1
        if not self._busy[ticket.peer]:
            del self._busy[ticket.peer]
            # An idle peer banks no credit (its next tag is at least V), but keeps its
            # debt: a peer whose pieces come one at a time, each after the last ended,
            # must not restart at V every time and so stay ahead of a waiting piece.
            if self._finish[ticket.peer] <= self._virtual:
                del self._finish[ticket.peer]
            if len(self._finish) > MAX_IDLE_PEERS:  # bounded: forget the smallest debts
                for peer in sorted((p for p in self._finish if p not in self._busy),
                                   key=self._finish.__getitem__)[:len(self._finish) - MAX_IDLE_PEERS]:
                    del self._finish[peer]
