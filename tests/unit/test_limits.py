"""net/limits.py: token buckets per peer; a peer never gets more than rate × time + burst."""

from __future__ import annotations

import math
from collections import defaultdict

import pytest
from hypothesis import given
from hypothesis import strategies as st

from compushare.net.limits import PeerRateLimiter, TokenBucket

T0 = 1000.0  # monotonic clocks do not start at 0


# ---------------------------------------------------------------- TokenBucket


def test_bucket_starts_full():
    bucket = TokenBucket(rate=2.0, burst=5.0)
    assert bucket.take(5, T0) == 0.0
    assert bucket.take(1, T0) == pytest.approx(0.5)


def test_bucket_starts_full_whenever_first_used():
    """The first take fills the bucket at its own time: no credit from time 0."""
    bucket = TokenBucket(rate=1.0, burst=3.0)
    for _ in range(3):
        assert bucket.take(1, T0) == 0.0
    assert bucket.take(1, T0) > 0


def test_bucket_refills_at_its_rate_up_to_the_burst():
    bucket = TokenBucket(rate=2.0, burst=5.0)
    bucket.take(5, T0)
    assert bucket.take(1, T0 + 0.25) == pytest.approx(0.25)  # half a token so far
    assert bucket.take(1, T0 + 0.5) == 0.0
    assert bucket.take(2, T0 + 1.5) == 0.0  # 2 more tokens in the second since
    bucket.take(0, T0 + 1000)  # a long idle time fills it, no further
    assert bucket.level == 5.0
    assert bucket.take(5, T0 + 1000) == 0.0 and bucket.take(0.5, T0 + 1000) > 0


def test_refusal_takes_nothing_and_its_wait_is_enough():
    bucket = TokenBucket(rate=4.0, burst=8.0)
    bucket.take(7, T0)
    wait = bucket.take(3, T0)
    assert wait == pytest.approx(0.5)
    assert bucket.level == pytest.approx(1.0)  # nothing was taken
    assert bucket.take(3, T0 + wait / 2) > 0  # not yet
    assert bucket.take(3, T0 + wait + 1e-9) == 0.0
    assert bucket.level == pytest.approx(0.0, abs=1e-6)


def test_amount_above_the_burst_gets_a_finite_wait_and_takes_nothing():
    bucket = TokenBucket(rate=10.0, burst=20.0)
    bucket.take(5, T0)
    wait = bucket.take(50, T0)
    assert 0 < wait < math.inf
    assert wait >= (20 - 15) / 10  # at least until the bucket is full
    assert bucket.level == pytest.approx(15.0)
    assert bucket.take(15, T0) == 0.0


def test_zero_amount_always_passes():
    bucket = TokenBucket(rate=1.0, burst=1.0)
    bucket.take(1, T0)
    assert bucket.take(0, T0) == 0.0


@given(st.floats(0.1, 100), st.floats(0.5, 50), st.lists(st.tuples(st.floats(0, 60), st.floats(0, 5)), max_size=30))
def test_a_refused_take_succeeds_after_its_wait(rate, burst, moves):
    bucket = TokenBucket(rate=rate, burst=burst)
    now = T0
    for amount, dt in moves:
        now += dt
        bucket.take(0, now)  # refill to now
        level = bucket.level
        wait = bucket.take(amount, now)
        assert wait >= 0 and math.isfinite(wait)
        if wait:
            assert bucket.level == pytest.approx(level)
            if amount <= burst:
                now += wait * (1 + 1e-9) + 1e-12
                assert bucket.take(amount, now) == 0.0
        assert -1e-9 <= bucket.level <= burst


# ---------------------------------------------------------------- PeerRateLimiter


def test_requests_per_peer_are_limited_independently():
    limiter = PeerRateLimiter(requests_per_s=1.0, bytes_per_s=1e9, burst_s=3.0)
    assert [limiter.check("a", 0, T0) for _ in range(3)] == [0.0] * 3
    wait = limiter.check("a", 0, T0)
    assert wait == pytest.approx(1.0)
    assert limiter.check("b", 0, T0) == 0.0  # another peer has its own bucket
    assert limiter.check("a", 0, T0 + 1.0) == 0.0


def test_bytes_are_limited():
    limiter = PeerRateLimiter(requests_per_s=100.0, bytes_per_s=100.0, burst_s=2.0)
    assert limiter.check("a", 150, T0) == 0.0
    assert limiter.check("a", 100, T0) == pytest.approx(0.5)  # 50 bytes left, 100 asked
    assert limiter.check("a", 50, T0) == 0.0
    assert limiter.check("a", 1, T0) > 0
    assert limiter.check("a", 0, T0) == 0.0  # a request without bytes still counts requests only


def test_a_refused_request_is_not_counted():
    """Refused for its bytes, a request leaves the request bucket as it was."""
    limiter = PeerRateLimiter(requests_per_s=1.0, bytes_per_s=100.0, burst_s=2.0)
    assert limiter.check("a", 150, T0) == 0.0  # request 1 of 2
    for _ in range(5):
        assert limiter.check("a", 100, T0) > 0  # refused: bytes
    assert limiter.check("a", 50, T0) == 0.0  # request 2 of 2 still allowed
    assert limiter.check("a", 0, T0) == pytest.approx(1.0)  # now requests run out


def test_remembers_at_most_max_peers_least_recent_first():
    limiter = PeerRateLimiter(requests_per_s=1.0, bytes_per_s=1e9, burst_s=1.0, max_peers=2)
    assert limiter.check("a", 0, T0) == 0.0
    assert limiter.check("a", 0, T0) > 0  # a is out of requests
    limiter.check("b", 0, T0)
    assert limiter.check("a", 0, T0) > 0  # a used most recently (a refusal counts as use)...
    limiter.check("c", 0, T0)  # ...so b goes, a stays
    assert limiter.check("a", 0, T0) > 0
    assert len(limiter._peers) == 2 and set(limiter._peers) == {"a", "c"}
    limiter.check("d", 0, T0)
    limiter.check("e", 0, T0)  # a is forgotten: a fresh, full bucket
    assert len(limiter._peers) == 2
    assert limiter.check("a", 0, T0) == 0.0


events = st.lists(st.tuples(st.integers(0, 3), st.integers(0, 400), st.floats(0, 2.0)), max_size=80)


@given(events, st.floats(0.5, 20), st.floats(50, 1000), st.floats(0.25, 3))
def test_admitted_requests_never_exceed_rate_times_window_plus_burst(events, rps, bps, burst_s):
    """For every peer and every window [t_i, t_j] between two of its admitted requests,
    requests admitted ≤ rps·(t_j − t_i) + burst, and likewise for bytes."""
    limiter = PeerRateLimiter(rps, bps, burst_s=burst_s, max_peers=16)
    admitted: dict[int, list[tuple[float, int]]] = defaultdict(list)
    now = T0
    for peer, nbytes, dt in events:
        now += dt
        wait = limiter.check(str(peer), nbytes, now)
        assert wait >= 0 and math.isfinite(wait)
        if wait == 0:
            admitted[peer].append((now, nbytes))
    for history in admitted.values():
        for i in range(len(history)):
            total = 0
            for j in range(i, len(history)):
                total += history[j][1]
                window = history[j][0] - history[i][0]
                assert j - i + 1 <= rps * window + rps * burst_s + 1e-6
                assert total <= bps * window + bps * burst_s + 1e-6
