"""Max-min fair shares of a server's KV budget. Pure, no I/O.

A peer's fair share is the budget over the number of peers holding sessions
(the asking peer included). A peer may reserve beyond its share while the budget
has room (no one else wants it); when it has none, an ask that keeps the asking
peer within its share reclaims sessions of peers over theirs: the most-over peer
first, its least recently used session first, and only while that peer is still
over its share.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol


class Held(Protocol):
    owner: str
    max_tokens: int
    last_used: float


def held_by(sessions: Iterable[Held]) -> dict[str, int]:
    """KV tokens reserved by each peer holding sessions."""
    held: dict[str, int] = {}
    for session in sessions:
        held[session.owner] = held.get(session.owner, 0) + session.max_tokens
    return held


def fair_share(budget: int, sessions: Iterable[Held], owner: str) -> int:
    return budget // len(held_by(sessions).keys() | {owner})


def plan_reclaim(budget: int, reclaimable: list[Held], sessions: Iterable[Held], owner: str,
                 max_tokens: int) -> list[Held] | str:
    """The sessions to reclaim (of `reclaimable`: those not mid-step) so that
    `owner`'s ask of `max_tokens` fits, or why it cannot."""
    sessions = list(sessions)
    held, share = held_by(sessions), fair_share(budget, sessions, owner)
    mine = held.get(owner, 0) + max_tokens
    if mine > share:
        return f"this peer would hold {mine}, over its fair share of {share}"
    free = budget - sum(held.values())
    chosen = []
    for session in sorted((s for s in reclaimable if s.owner != owner), key=lambda s: (-held[s.owner], s.last_used)):
        if free >= max_tokens:
            break
        if held[session.owner] > share:
            chosen.append(session)
            held[session.owner] -= session.max_tokens
            free += session.max_tokens
    if free < max_tokens:
        return f"too little held over fair shares of {share} to reclaim"
    return chosen
