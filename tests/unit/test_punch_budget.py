"""net/punch_budget.py: hole punches per peer and dials in all stay within their
buckets, whatever the number of peers; refusals are counted and cost nothing."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from compushare.net.punch_budget import PunchBudget, PunchLimits


def test_a_peer_gets_its_burst_then_one_punch_per_interval():
    budget = PunchBudget(PunchLimits(peer_burst=3, peer_interval_s=20.0))
    assert [budget.punch("a", 0.0) for _ in range(5)] == [True, True, True, False, False]
    assert budget.punch("b", 0.0)  # another peer has its own budget
    assert not budget.punch("a", 19.0)
    assert budget.punch("a", 21.0) and not budget.punch("a", 21.0)
    assert budget.stats() == {"punches": 5, "dials": 0, "refused": {"peer": 4, "total": 0}}


def test_dials_in_all_refill_at_their_rate_and_a_refused_round_takes_nothing():
    budget = PunchBudget(PunchLimits(dial_burst=12, dials_per_s=1.0))
    assert budget.dial(4, 0.0) and budget.dial(4, 0.0) and budget.dial(4, 0.0)
    assert not budget.dial(1, 0.0)
    assert not budget.dial(4, 3.0)  # 3 back, not 4
    assert budget.dial(4, 4.0)
    assert budget.stats() == {"punches": 0, "dials": 16, "refused": {"peer": 0, "total": 2}}


def test_forgotten_peers_are_bounded():
    budget = PunchBudget(PunchLimits(max_peers=8))
    for n in range(100):
        budget.punch(f"p{n}", 0.0)
    assert len(budget._peers) == 8


@pytest.mark.parametrize("field", ["peer_burst", "peer_interval_s", "dial_burst", "dials_per_s", "max_peers"])
def test_limits_must_be_positive(field):
    with pytest.raises(ValueError, match=field):
        PunchLimits(**{field: 0})


@given(st.lists(st.tuples(st.integers(0, 50), st.integers(1, 4), st.floats(0, 5)), max_size=200))
def test_fresh_identities_never_dial_past_the_total(events):
    limits = PunchLimits(peer_burst=3, peer_interval_s=20.0, dial_burst=48, dials_per_s=1.0)
    budget = PunchBudget(limits)
    now = 0.0
    for peer, addrs, step in events:
        now += step
        if budget.punch(f"p{peer}", now):
            budget.dial(addrs, now)
    assert budget.dials <= limits.dial_burst + now * limits.dials_per_s + 1e-9
