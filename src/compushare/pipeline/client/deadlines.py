"""How long a hop's step may take, and whether a step past its deadline is waited
for. Pure: the clock, the pings and the requests are hop.py's.

A step's deadline follows the hop's own pace: MIN_DEADLINE_S, plus
DEADLINE_LATENCIES times its step latency per chunk, plus its compute (or
DEADLINE_PER_TOKEN_S, if more) per token. The pace is the larger of an EWMA and the
largest of the last RECENT_STEPS observations, so a server whose load just rose (eight
sessions arriving at once) is given its new pace from its next step on, not after the
EWMA has caught up, and one slow step in a few keeps the allowance up until it has
left the window. The servers' own figure of their load is not needed for that: what
their replies take is the load as this consumer meets it.

A step past its deadline is given up (the hop failed over: a missed deadline is how a
hung server is noticed in about a second) unless nothing could replace the hop: then,
as long as the server answers a ping within PING_TIMEOUT_S, the step is waited for,
one check interval at a time (its own deadline, within CHECK_MIN_S..CHECK_MAX_S), up
to `limit_s` after it was sent (chain.FAILOVER_TIMEOUT_S): a server that is merely
slow finishes the generation, one that is stopped or gone fails it as before.
"""

from __future__ import annotations

import collections
import dataclasses

MIN_DEADLINE_S = 1.0  # no step is given less (scheduling hiccups on a loaded machine)
DEADLINE_LATENCIES = 5.0  # a step may take this many times the hop's usual latency per chunk...
DEADLINE_PER_TOKEN_S = 0.01  # ... plus this much (or one usual step's compute, if more) per token it carries
LATENCY_EWMA = 0.2
RECENT_STEPS = 8  # the window of the recent maximum
PING_TIMEOUT_S = 1.0  # a late hop's server must answer a ping within this to be waited for
CHECK_MIN_S, CHECK_MAX_S = 1.0, 5.0  # how often a late step's server is pinged again


class Pace:
    """A hop's observed seconds per decode step (wall) and of them its server's
    compute: each an EWMA, read as at least the largest of the recent steps."""

    def __init__(self, latency: float, compute: float) -> None:
        self._latency = latency
        self._compute = compute
        self._recent: collections.deque[tuple[float, float]] = collections.deque(maxlen=RECENT_STEPS)

    def observe(self, wall: float, compute: float) -> None:
        self._latency = (1 - LATENCY_EWMA) * self._latency + LATENCY_EWMA * wall
        self._compute = (1 - LATENCY_EWMA) * self._compute + LATENCY_EWMA * compute
        self._recent.append((wall, compute))

    @property
    def latency(self) -> float:
        return max([self._latency, *(wall for wall, _ in self._recent)])

    @property
    def compute(self) -> float:
        return max([self._compute, *(compute for _, compute in self._recent)])

    def deadline(self, tokens: int, chunks: int = 1) -> float:
        """Seconds a step of `tokens` tokens in `chunks` chunks may take. A prompt's
        tokens cost compute, not only bytes: through 11 blocks of an 8B-shaped model on
        one thread each prompt token costs about what a decode step does (~0.15 s), so
        a flat 10 ms per token timed out a healthy 31-token prefill. The step's compute,
        not its latency: a slow link's round trip is paid once a step."""
        per_token = max(DEADLINE_PER_TOKEN_S, self.compute)
        return MIN_DEADLINE_S + DEADLINE_LATENCIES * self.latency * chunks + per_token * tokens


@dataclasses.dataclass(frozen=True)
class Lateness:
    """A step past its deadline, as the decision sees it."""

    waited_s: float  # since the step was sent
    timeout_s: float  # the step's own deadline
    limit_s: float  # the most a step may be waited for in all
    replaceable: bool  # another server (or a standby) could take the hop's blocks
    alive: bool  # its server answered a ping just now


def wait_more(late: Lateness) -> float:
    """Seconds more to wait for a late step before checking again; 0: give it up."""
    if late.replaceable or not late.alive:
        return 0.0
    left = late.limit_s - late.waited_s
    if left <= 0:
        return 0.0
    return min(left, max(CHECK_MIN_S, min(CHECK_MAX_S, late.timeout_s)))
