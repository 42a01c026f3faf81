"""Max-min fair shares of a server's KV budget. Pure, no I/O.

A peer's fair share is the budget over the number of peers holding sessions
(the asking peer included). A peer may reserve beyond its share while the budget
has room (no one else wants it); when it has none, an ask that keeps the asking
peer within its share reclaims sessions of peers over theirs: the most-over peer
first, its idle sessions before those mid-step, least recently used first, and
only while that peer is still over its share.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol, TypeVar


class Held(Protocol):
    """What a share needs of a session (read-only)."""

    @property
    def owner(self) -> str: ...
    @property
    def reserved(self) -> int: ...  # KV tokens held of the budget
    @property
    def last_used(self) -> float: ...
    @property
    def in_step(self) -> bool: ...


H = TypeVar("H", bound=Held)


def held_by(sessions: Iterable[Held]) -> dict[str, int]:
    """KV tokens reserved by each peer holding sessions."""
    held: dict[str, int] = {}
    for session in sessions:
        held[session.owner] = held.get(session.owner, 0) + session.reserved
    return held


def fair_share(budget: int, sessions: Iterable[Held], owner: str) -> int:
    return budget // len(held_by(sessions).keys() | {owner})


def plan_reclaim(budget: int, sessions: Iterable[H], owner: str, max_tokens: int) -> list[H] | str:
    """The sessions to reclaim so that `owner`'s ask of `max_tokens` fits, or why it
    cannot."""
    sessions = list(sessions)
    held, share = held_by(sessions), fair_share(budget, sessions, owner)
    mine = held.get(owner, 0) + max_tokens
    if mine > share:
        return f"this peer would hold {mine}, over its fair share of {share}"
    chosen, free = _reclaim(budget, sessions, held, share, owner, max_tokens)
    if free < max_tokens:
        return f"too little held over fair shares of {share} to reclaim"
    return chosen


def available(budget: int, sessions: Iterable[Held], owner: str = "") -> int:
    """The KV tokens `owner` (by default a peer holding no session) could reserve
    now: the free budget, or more where reclaiming makes room within its share.
    What a server advertises, so that routes do not pass over a server whose
    budget a hog has filled."""
    sessions = list(sessions)
    held, share = held_by(sessions), fair_share(budget, sessions, owner)
    room = max(0, share - held.get(owner, 0))
    _, free = _reclaim(budget, sessions, held, share, owner, room)
    return max(budget - sum(held.values()), min(room, free))


def _reclaim(budget: int, sessions: list[H], held: dict[str, int], share: int, owner: str,
             wanted: int) -> tuple[list[H], int]:
    """Sessions of peers over their share to reclaim until `wanted` tokens are free
    (or none are left to take), and the free tokens then."""
    held = dict(held)
    free = budget - sum(held.values())
    chosen = []
    for session in sorted((s for s in sessions if s.owner != owner),
                          key=lambda s: (-held[s.owner], s.in_step, s.last_used)):
        if free >= wanted:
            break
        if held[session.owner] > share:
            chosen.append(session)
            held[session.owner] -= session.reserved
            free += session.reserved
    return chosen, free
