"""Choose a chain of servers that covers every block. Pure: records in, hops out."""

from __future__ import annotations

import dataclasses

from ..errors import RouteError
from ..net.records import ServerRecord


@dataclasses.dataclass(frozen=True)
class Hop:
    record: ServerRecord
    start: int  # the sub-span this hop runs: may be a suffix of what the server holds
    end: int

    @property
    def peer_id(self) -> str:
        return self.record.peer_id


def plan_chain(records: list[ServerRecord], num_blocks: int, *, now: float,
               exclude: frozenset[str] = frozenset()) -> list[Hop]:
    """Fewest hops first: at each block take the live server reaching furthest
    (ties: higher advertised throughput, then peer id, for determinism)."""
    live = [r for r in records if r.is_live(now) and r.peer_id not in exclude]
    hops: list[Hop] = []
    position = 0
    while position < num_blocks:
        candidates = [r for r in live if r.start <= position < r.end]
        if not candidates:
            raise RouteError(
                f"no live server holds block {position} of {num_blocks} "
                f"({len(live)} live servers known: "
                + ", ".join(f"{r.peer_id[-8:]}[{r.start}:{r.end}]" for r in live) + ")"
            )
        best = max(candidates, key=lambda r: (min(r.end, num_blocks), r.throughput, r.peer_id))
        end = min(best.end, num_blocks)
        hops.append(Hop(best, position, end))
        position = end
    return hops


def uncovered_blocks(records: list[ServerRecord], num_blocks: int, now: float) -> list[int]:
    covered = set()
    for record in records:
        if record.is_live(now):
            covered.update(range(record.start, min(record.end, num_blocks)))
    return [b for b in range(num_blocks) if b not in covered]
