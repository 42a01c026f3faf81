"""Choose the chain of servers that covers every block fastest. Pure: records and
measurements in, hops out."""

from __future__ import annotations

import dataclasses
import heapq
import statistics

from ...errors import RouteError
from ...net.reachability import is_circuit
from ...net.records import ServerRecord

TIE_QUANTUM_S = 0.0005  # expected times this close are a tie, broken by karma
HOP_OVERHEAD_S = 0.003  # framing, crypto and waking two processes, measured per hop on loopback
DEFAULT_RTT_S = 0.05  # a server we could not ping yet: assume a typical WAN hop
DEFAULT_BLOCK_RATE = 40.0  # decode steps/s through one block when nothing was measured
# An advertised rate is taken as at least this: a rate of 1e-308 (a peer's ad says what
# it likes) made a hop's time overflow to infinity, and every route then tied.
MIN_BLOCK_RATE = 1e-3
MAX_LOAD = 0.9


@dataclasses.dataclass(frozen=True)
class Measure:
    """What a consumer knows of one server beyond its DHT record."""

    rtt_s: float | None = None  # measured round trip; None if not measured
    block_rate: float = 0.0  # decode steps/s through one block (from its ad), 0 if unknown
    load: float = 0.0  # share of recent time its compute was busy (from its ad)
    free_tokens: int | None = None  # KV tokens still free (from its ad); None if unknown
    karma: float = 1.0  # its verified karma (karma/service.py); a newcomer's 1.0 if unknown


@dataclasses.dataclass(frozen=True)
class Hop:
    record: ServerRecord
    start: int  # the sub-span this hop runs: may be a suffix of what the server holds
    end: int
    rtt_s: float = 0.0  # the estimates the route was chosen on (for --verbose)
    compute_s: float = 0.0

    @property
    def peer_id(self) -> str:
        return self.record.peer_id

    @property
    def expected_s(self) -> float:
        return self.rtt_s + HOP_OVERHEAD_S + self.compute_s


def _rate(record: ServerRecord, measure: Measure) -> float:
    """Known decode steps/s through one block, at least MIN_BLOCK_RATE; 0 if unknown."""
    if measure.block_rate > 0:
        return max(measure.block_rate, MIN_BLOCK_RATE)
    if record.throughput > 0:  # the record's figure is for its whole span
        return max(record.throughput * (record.end - record.start), MIN_BLOCK_RATE)
    return 0.0


def plan_route(records: list[ServerRecord], num_blocks: int, *, now: float,
               measures: dict[str, Measure] | None = None, needed_tokens: int = 0,
               exclude: frozenset[str] = frozenset(), start: int = 0, end: int | None = None) -> list[Hop]:
    """The chain with the least expected time per decode step through blocks
    start..end-1 (default: all of them; a failover re-plans one failed span).

    A hop costs its round trip + a fixed per-hop overhead + blocks / decode rate,
    stretched by the server's load (1 / (1 - load)). Servers that are excluded
    (failed), expired or advertise fewer free KV tokens than `needed_tokens` (busy)
    are left out. Unmeasured values take the median of those measured, so an
    unknown server is neither favoured nor shunned. Ties (expected times within
    TIE_QUANTUM_S per hop): fewer hops, then more karma, then peer ids. Karma only
    ever breaks ties: it never gates access, nor outweighs speed.
    """
    measures = measures or {}
    live = [r for r in records if r.is_live(now) and r.peer_id not in exclude]
    busy = {r.peer_id for r in live
            if (m := measures.get(r.peer_id)) and m.free_tokens is not None and m.free_tokens < needed_tokens}
    usable = [r for r in live if r.peer_id not in busy]
    rtts = [m.rtt_s for r in usable if (m := measures.get(r.peer_id)) and m.rtt_s is not None]
    rates = [x for r in usable if (x := _rate(r, measures.get(r.peer_id, Measure()))) > 0]
    default_rtt = statistics.median(rtts) if rtts else DEFAULT_RTT_S
    default_rate = statistics.median(rates) if rates else DEFAULT_BLOCK_RATE

    def hop(record: ServerRecord, start: int, end: int) -> Hop:
        measure = measures.get(record.peer_id, Measure())
        rate = _rate(record, measure) or default_rate
        compute = (end - start) / rate / (1 - min(max(measure.load, 0.0), MAX_LOAD))
        return Hop(record, start, end, default_rtt if measure.rtt_s is None else measure.rtt_s, compute)

    # Dijkstra over block positions 0..num_blocks; an edge is one server running [p, e).
    # Keys are (time in quanta, hops, -karma, peer ids): comparable, the tie-breaks in order.
    end = num_blocks if end is None else end
    best: dict[int, tuple[tuple, tuple[Hop, ...]]] = {start: ((0.0, 0, 0.0, ()), ())}
    heap: list[tuple[tuple, int]] = [((0.0, 0, 0.0, ()), start)]
    done: set[int] = set()
    while heap:
        key, position = heapq.heappop(heap)
        if position in done:
            continue
        done.add(position)
        path = best[position][1]
        if position == end:
            return list(path)
        for record in usable:
            if not record.start <= position < record.end:
                continue
            for stop in range(position + 1, min(record.end, end) + 1):
                step = hop(record, position, stop)
                karma = measures.get(record.peer_id, Measure()).karma
                new_key = (key[0] + _quanta(step.expected_s), key[1] + 1, key[2] - karma,
                           key[3] + (record.peer_id,))
                if stop not in best or new_key < best[stop][0]:
                    best[stop] = (new_key, path + (step,))
                    heapq.heappush(heap, (new_key, stop))
    if start >= end:
        return []
    raise _no_route(usable, busy, exclude, start, end, num_blocks, now)


def _no_route(usable: list[ServerRecord], busy: set[str], exclude: frozenset[str], start: int, end: int,
              num_blocks: int, now: float) -> RouteError:
    missing = [b for b in uncovered_blocks(usable, end, now) if b >= start]
    why = f" ({len(busy)} busy: " + ", ".join(sorted(p[-8:] for p in busy)) + ")" if busy else ""
    return RouteError(
        f"no live server holds block {missing[0] if missing else '?'} of {num_blocks}{why}; "
        f"{len(exclude)} excluded; {len(usable)} usable servers known: "
        + ", ".join(f"{r.peer_id[-8:]}[{r.start}:{r.end}]" for r in usable)
    )


def _quanta(seconds: float) -> float:
    """Seconds in whole TIE_QUANTUM_S; beyond 1e15 quanta (absurd estimates) the float
    itself, so that even such times still order routes."""
    quanta = seconds / TIE_QUANTUM_S
    return float(round(quanta)) if quanta < 1e15 else quanta


def describe_route(hops: list[Hop]) -> list[str]:
    """One line per hop saying why it was chosen (for --verbose)."""
    lines = []
    for index, hop in enumerate(hops, 1):
        # A NAT'd server advertises its circuits first; its ping was measured on the
        # connection its session uses (through the relay, or hole-punched).
        natd = ", behind NAT (relayed, or hole-punched)" if hop.record.addrs and is_circuit(hop.record.addrs[0]) \
            else ""
        lines.append(
            f"hop {index}: {hop.peer_id} blocks {hop.start}:{hop.end}: ping {hop.rtt_s * 1000:.1f} ms, "
            f"compute ~{hop.compute_s * 1000:.1f} ms, expected {hop.expected_s * 1000:.1f} ms{natd}"
        )
    total = sum(h.expected_s for h in hops)
    lines.append(f"expected {total * 1000:.0f} ms per token through {len(hops)} hops")
    return lines


def uncovered_blocks(records: list[ServerRecord], num_blocks: int, now: float) -> list[int]:
    covered: set[int] = set()
    for record in records:
        if record.is_live(now):
            covered.update(range(record.start, min(record.end, num_blocks)))
    return [b for b in range(num_blocks) if b not in covered]
