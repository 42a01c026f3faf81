"""A node's recent history, for the dashboard's charts: what it counts, sampled
every SAMPLE_PERIOD_S and kept for KEEP_S. Counters (steps and tokens served) are
kept as they grow and turned into rates between neighbouring samples; gauges (KV
held, peers known) are kept as they are. Pure: the node's loop
(node.NodeControl.history_loop) reads the node and adds the samples."""

from __future__ import annotations

import collections
import dataclasses

SAMPLE_PERIOD_S = 2.0
KEEP_S = 600.0
REACHES = ("public", "private", "unknown")  # what a peer's ad says of its reachability (net/reachability.py)


@dataclasses.dataclass(frozen=True)
class Sample:
    """What the node counts at one moment. `steps` and `tokens` count since its server
    started (a new server, after a move to another span, starts again from 0)."""

    time: float  # wall clock, seconds: the page labels its time axis with it
    steps: int = 0  # steps of sessions served
    tokens: int = 0  # tokens computed for them
    sessions: int = 0  # open now
    kv_used: int = 0  # tokens of the KV budget that open sessions hold (reserved at their opening)
    kv_total: int = 0  # the KV budget, tokens
    public: int = 0  # peers known (live ads), by what their ads say of their reachability
    private: int = 0
    unknown: int = 0

    def __post_init__(self) -> None:
        counts = (self.steps, self.tokens, self.sessions, self.kv_used, self.kv_total,
                  self.public, self.private, self.unknown)
        if any(count < 0 for count in counts):
            raise ValueError(f"a sample counts nothing below 0: {self}")

    @property
    def peers(self) -> int:
        return self.public + self.private + self.unknown


def count_reaches(reaches: list[str]) -> dict[str, int]:
    """{"public": n, "private": n, "unknown": n} of what peers' ads say (anything else: unknown)."""
    counts = dict.fromkeys(REACHES, 0)
    for reach in reaches:
        counts[reach if reach in counts else "unknown"] += 1
    return counts


def _rate(now: int, before: int, seconds: float) -> float:
    """Per second between two readings of a counter; a counter that went back started
    again from 0 (a new server) in between."""
    grown = now - before if now >= before else now
    return round(grown / seconds, 3)


class History:
    """The last `keep_s` of samples, oldest first; as JSON, one list per series."""

    def __init__(self, *, keep_s: float = KEEP_S, period_s: float = SAMPLE_PERIOD_S) -> None:
        if not 0 < period_s <= keep_s:
            raise ValueError("a history keeps at least one period")
        self.period_s, self.keep_s = period_s, keep_s
        self._samples: collections.deque[Sample] = collections.deque(maxlen=int(keep_s / period_s) + 1)

    def __len__(self) -> int:
        return len(self._samples)

    def add(self, sample: Sample) -> None:
        """Keep `sample`; the oldest goes when the history is full. A sample not later
        than the last one (a clock set back) replaces what it would follow."""
        while self._samples and self._samples[-1].time >= sample.time:
            self._samples.pop()
        self._samples.append(sample)

    def to_json(self) -> dict:
        """{"period_s", "keep_s", "time": [...], and a list per series, aligned with
        "time"}. Rates (steps_s, tokens_s) are null at the first sample."""
        samples = list(self._samples)
        series: dict[str, list] = {name: [] for name in (
            "time", "steps_s", "tokens_s", "sessions", "kv_used", "kv_total", "peers", *REACHES)}
        before = None
        for sample in samples:
            seconds = sample.time - before.time if before is not None else 0.0
            series["time"].append(round(sample.time, 3))
            series["steps_s"].append(_rate(sample.steps, before.steps, seconds) if before else None)
            series["tokens_s"].append(_rate(sample.tokens, before.tokens, seconds) if before else None)
            for name in ("sessions", "kv_used", "kv_total", "peers", *REACHES):
                series[name].append(getattr(sample, name))
            before = sample
        return {"period_s": self.period_s, "keep_s": self.keep_s, **series}
