"""Which blocks a node should serve: where the swarm is weakest. Pure, no I/O.

Like Petals' block selection: a block's strength is the summed decode rate of the
servers holding it; a newcomer takes the window of its size whose weakest block is
weakest (then the lowest total), and a server moves only when moving clearly
helps the swarm, judged on the view without itself:

  - it moves if that leaves fewer uncovered blocks (a departed node's hole fills);
  - with no holes either way, it moves if the weakest block gets stronger by more
    than `min_gain` (hysteresis: servers do not flap over small differences).

Ties are broken at random, so nodes that start together spread out, and a node
waits a random delay and re-checks before moving (Provider.rebalance_loop, pipeline/provider.py),
so several nodes do not all rush into the same hole.
"""

from __future__ import annotations

import random
import statistics
from collections.abc import Iterable

from ...config import Span
from ...net.ads import CapabilityAd, Serving

MIN_GAIN = 0.2
RATE_CAP = 4.0


def block_strength(servers: Iterable[tuple[CapabilityAd, Serving]], num_blocks: int, *,
                   exclude: str | None = None, unknown_rate: float = 1.0) -> list[float]:
    """Summed decode rate per block (a server with no measured rate counts `unknown_rate`).

    Rates are self-reported: one counts at most RATE_CAP times the median, so a peer
    boasting an absurd rate cannot make its blocks look so strong that nobody ever
    moves there to help."""
    servers = [(ad, s) for ad, s in servers if ad.peer_id != exclude]
    rates = [s.block_rate if s.block_rate > 0 else unknown_rate for _, s in servers]
    cap = RATE_CAP * statistics.median(rates) if rates else 0.0
    strength = [0.0] * num_blocks
    for (_ad, serving), rate in zip(servers, rates):
        rate = min(rate, cap)
        for block in range(serving.start, min(serving.end, num_blocks)):
            strength[block] += rate
    return strength


def span_length(num_blocks: int, max_blocks: int) -> int:
    return max(1, min(num_blocks, max_blocks))


def choose_span(strength: list[float], length: int, rng: random.Random) -> Span:
    """The window of `length` blocks whose weakest block is weakest (then lowest total)."""
    starts = range(len(strength) - length + 1)
    keys = {s: (min(strength[s:s + length]), sum(strength[s:s + length])) for s in starts}
    best = min(keys.values())
    ties = [s for s, key in keys.items() if _close(key, best)]
    start = rng.choice(ties)
    return Span(start, start + length)


def _close(a: tuple[float, float], b: tuple[float, float]) -> bool:
    return all(abs(x - y) <= 1e-9 * max(1.0, abs(y)) for x, y in zip(a, b))


def _with(strength: list[float], span: Span, rate: float) -> list[float]:
    out = list(strength)
    for block in range(span.start, min(span.end, len(out))):
        out[block] += rate
    return out


def _holes(strength: list[float]) -> int:
    return sum(1 for s in strength if s <= 0)


def holes_outside(strength: list[float], span: Span) -> bool:
    """Blocks outside `span` that nobody else serves: the model is broken until filled."""
    return any(s <= 0 and not span.start <= b < span.end for b, s in enumerate(strength))


def better_span(strength_without_me: list[float], current: Span, my_rate: float, rng: random.Random,
                *, min_gain: float = MIN_GAIN) -> Span | None:
    """A span to move to, or None to stay. `strength_without_me` excludes this node."""
    target = choose_span(strength_without_me, len(current), rng)
    if target == current:
        return None
    stay = _with(strength_without_me, current, my_rate)
    move = _with(strength_without_me, target, my_rate)
    if _holes(move) != _holes(stay):
        return target if _holes(move) < _holes(stay) else None
    if _holes(stay) == 0 and min(move) > min(stay) * (1 + min_gain):
        return target
    return None
