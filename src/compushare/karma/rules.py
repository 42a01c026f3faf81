"""The karma rules: which receipts count, how much, and the score. Pure, no I/O.

    karma = (1 + ln(1 + counted compute ms)) × 0.95 ^ (verified failure reports)

A receipt counts in the ledger of the server it names only if both signatures
check out, its consumer is another peer, its compute time is within the wall time
the consumer observed, it is neither from the future nor older than WINDOW_S, it
is not dated before a receipt counted earlier in the ledger (by more than twice
the clock skew: a ledger grows in time), and its slot (server, consumer, session,
seq) was not counted before. One consumer's receipts count at most DAILY_CAP_MS
per server per UTC day (by the receipt's time). A new peer, with no receipts, has
karma 1.0. Everyone applying these rules to the same evidence gets
the same number: that is what makes a score checkable.
"""

from __future__ import annotations

import collections
import dataclasses
import math

from ..errors import PeerMisbehaved
from ..proofs.reports import Report, parse_report
from .receipts import Receipt, parse_receipt

DAILY_CAP_MS = 3_600_000.0  # one consumer's receipts, per server, per UTC day
REPORT_FACTOR = 0.95
CLOCK_SKEW_S = 300.0  # a receipt may be this far ahead of the record counting it
DAY_S = 86_400
WINDOW_S = 30 * DAY_S  # karma is the compute of the last 30 days: old receipts lapse


@dataclasses.dataclass
class Tally:
    compute_ms: float = 0.0  # what counts
    counted: int = 0  # receipts that count for something (some only in part, by the cap)
    capped_ms: float = 0.0  # compute cut by the daily cap
    rejected: collections.Counter[str] = dataclasses.field(default_factory=collections.Counter)

    def to_wire(self) -> dict:
        return {"compute_ms": self.compute_ms, "counted": self.counted, "capped_ms": self.capped_ms,
                "rejected": dict(self.rejected)}


def tally(wires: list[bytes], owner: str, *, as_of: float) -> Tally:
    """Count `owner`'s receipts (in ledger order) as of unix time `as_of`."""
    result = Tally()
    seen: set[tuple] = set()
    used: collections.defaultdict[tuple[str, int], float] = collections.defaultdict(float)  # (consumer, day) -> ms counted
    latest = -math.inf  # the latest receipt time counted so far
    for wire in wires:
        try:
            receipt = parse_receipt(wire)
        except PeerMisbehaved:
            result.rejected["bad_signature_or_malformed"] += 1
            continue
        reason = _refusal(receipt, owner, as_of)
        if reason is None and receipt.slot in seen:
            reason = "replayed"
        if reason is None and receipt.time < latest - 2 * CLOCK_SKEW_S:
            reason = "backdated"
        if reason is not None:
            result.rejected[reason] += 1
            continue
        seen.add(receipt.slot)
        latest = max(latest, receipt.time)
        day = (receipt.consumer, int(receipt.time // DAY_S))
        counted = min(receipt.compute_ms, max(0.0, DAILY_CAP_MS - used[day]))
        used[day] += counted
        result.capped_ms += receipt.compute_ms - counted
        result.compute_ms += counted
        if counted > 0:
            result.counted += 1
    return result


def _refusal(receipt: Receipt, owner: str, as_of: float) -> str | None:
    if receipt.server != owner:
        return "for_another_server"
    if receipt.consumer == owner:
        return "self_signed"
    if receipt.compute_ms > receipt.wall_ms:
        return "beyond_wall_time"
    if receipt.time > as_of + CLOCK_SKEW_S:
        return "from_the_future"
    if receipt.time < as_of - WINDOW_S:
        return "older_than_window"
    return None


def base_score(compute_ms: float) -> float:
    return 1.0 + math.log1p(max(0.0, compute_ms))


def score(compute_ms: float, reports: int = 0) -> float:
    return base_score(compute_ms) * REPORT_FACTOR ** max(0, reports)


def verified_reports(wires: list[bytes], accused: str) -> list[Report]:
    """The distinct failure reports against `accused` whose signatures check out.
    One per witness: a witness's disagreements with a server count once, however
    many reports of them circulate (a report proves two servers disagree, not which
    of them is wrong; see README "Karma" for what this does and does not resist)."""
    found: dict[str, Report] = {}
    for wire in wires:
        try:
            report = parse_report(wire)
            if report.accused.peer_id != accused:
                continue
            report.check()
        except PeerMisbehaved:
            continue
        witness = report.witness.peer_id
        if witness not in found or report.digest < found[witness].digest:  # same choice everywhere
            found[witness] = report
    return [found[w] for w in sorted(found)]
