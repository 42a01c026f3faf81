"""Which steps a consumer re-computes elsewhere, and who it stops trusting. Pure.

Sampling is stratified: the steps of a span fall in windows of round(1 / rate)
steps, and one step of each window, at a uniformly random offset, is checked. The
rate is exact, a server cannot tell which step is checked (checks go to another
server), and one that tampers with every step is caught within the first window,
where independent coin flips would let it through 100 steps with chance 0.95^100.
"""

from __future__ import annotations

import dataclasses
import random

DEFAULT_RATE = 0.05


class SpotCheckSchedule:
    def __init__(self, rate: float = DEFAULT_RATE, rng: random.Random | None = None) -> None:
        if not 0.0 <= rate <= 1.0:
            raise ValueError("the spot-check rate is a fraction within 0..1")
        self.rate = rate
        self.window = max(1, round(1 / rate)) if rate > 0 else 0
        self.rng = rng or random.Random()
        self._step = 0
        self._target = -1

    def should_check(self) -> bool:
        """Called once per step of the span, in order."""
        if not self.window:
            return False
        offset = self._step % self.window
        if offset == 0:
            self._target = self.rng.randrange(self.window)
        self._step += 1
        return offset == self._target


@dataclasses.dataclass
class _Record:
    count: int = 0
    until: float = 0.0


class Penalties:
    """Peers a consumer avoids for a while. A fault (dropped connection, missed
    deadline, error reply) costs a short exclusion, doubling up to 4 s and forgiven
    once the peer answers again: a restarted server is soon used again. A wrong
    answer blacklists, doubling from ten minutes to a day."""

    FAULT_BASE_S, FAULT_MAX_S = 1.0, 4.0
    MISMATCH_BASE_S, MISMATCH_MAX_S = 600.0, 86400.0

    def __init__(self) -> None:
        self._faults: dict[str, _Record] = {}
        self._mismatches: dict[str, _Record] = {}

    def fault(self, peer: str, now: float) -> float:
        return self._penalise(self._faults, peer, now, self.FAULT_BASE_S, self.FAULT_MAX_S)

    def mismatch(self, peer: str, now: float) -> float:
        return self._penalise(self._mismatches, peer, now, self.MISMATCH_BASE_S, self.MISMATCH_MAX_S)

    @staticmethod
    def _penalise(table: dict[str, _Record], peer: str, now: float, base: float, cap: float) -> float:
        record = table.setdefault(peer, _Record())
        record.count += 1
        duration = min(cap, base * 2 ** (record.count - 1))
        record.until = max(record.until, now + duration)
        return duration

    def success(self, peer: str) -> None:
        """The peer answered again: its faults are forgiven (a wrong answer is not)."""
        self._faults.pop(peer, None)

    def faulted(self, peer: str) -> bool:
        """Whether the peer has faults not yet forgiven (however long ago)."""
        return peer in self._faults

    def blacklisted(self, peer: str, now: float) -> bool:
        record = self._mismatches.get(peer)
        return record is not None and record.until > now

    def excluded(self, now: float) -> frozenset[str]:
        return frozenset(peer for table in (self._faults, self._mismatches)
                         for peer, record in table.items() if record.until > now)
