"""Who averages with whom, who owns which part, who checks whom. Pure, no I/O.

Everything here is a function of public values (the run id, the round, peer ids),
so every participant computes the same answers and nobody can pick them:

- the round's DHT provider key, under which its ready participants announce
  themselves (sha256(ROUND_KEY + run_id + "/" + round));
- each peer's ticket for a round, sha256(run_id, round, peer): the lowest ticket among
  those a peer sees leads the round's group formation (and nothing else: it lists the
  members, it sees no data);
- a group's digest, over its members sorted: it names one attempt of one all-reduce;
- the owner of part i of an attempt: its i-th member in sorted order;
- the round's checks: a derangement of the members (each checks the next in an order
  drawn from the round's seed), of which each pair runs with probability check_rate.
"""

from __future__ import annotations

import hashlib
import struct

from .. import wire

DIGEST_BYTES = 32


def round_key(run_id: str, round_: int) -> str:
    """The provider key of a round's ready participants."""
    return hashlib.sha256(f"{wire.ROUND_KEY}{run_id}/{round_}".encode()).hexdigest()


def participants_key(run_id: str) -> str:
    """The provider key of a run's participants (joiners look here for the weights)."""
    return hashlib.sha256(f"{wire.RUN_KEY}{run_id}".encode()).hexdigest()


def _hash(*items: str | int) -> bytes:
    h = hashlib.sha256()
    for item in items:
        data = str(item).encode()
        h.update(struct.pack(">I", len(data)) + data)
    return h.digest()


def ticket(run_id: str, round_: int, peer: str) -> bytes:
    return _hash("compushare/diloco/ticket/v1", run_id, round_, peer)


def leader(run_id: str, round_: int, peers) -> str:
    """The peer of the lowest ticket (peers: non-empty)."""
    return min(peers, key=lambda peer: ticket(run_id, round_, peer))


def group_digest(run_id: str, round_: int, attempt: int, members) -> bytes:
    return _hash("compushare/diloco/group/v1", run_id, round_, attempt, *sorted(members))


def owners(members) -> list[str]:
    """Part i's owner is owners(members)[i]."""
    return sorted(members)


def checks(run_id: str, round_: int, members, rate: float) -> list[tuple[str, str]]:
    """(checker, target) pairs of a round: a derangement of the members drawn from the
    round's seed, each pair kept with probability `rate` (drawn per checker)."""
    ordered = sorted(members, key=lambda peer: _hash("compushare/diloco/check-order/v1", run_id, round_, peer))
    if len(ordered) < 2:
        return []
    pairs = []
    for i, checker in enumerate(ordered):
        draw = int.from_bytes(_hash("compushare/diloco/check/v1", run_id, round_, checker)[:8], "big") / 2.0 ** 64
        if draw < rate:
            pairs.append((checker, ordered[(i + 1) % len(ordered)]))
    return pairs


def session_of(run_id: str, round_: int, peer: str) -> bytes:
    """The 16-byte session id of a round's karma receipt for `peer`."""
    return _hash("compushare/diloco/receipt/v1", run_id, round_, peer)[:16]
