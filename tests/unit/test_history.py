"""The dashboard's history (app/history.py), directly: rates from counters, gauges as
they are, a bounded window, a counter that starts again, a clock set back."""

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from compushare.app.history import History, Sample, count_reaches

T0 = 1_700_000_000.0


def test_rates_come_from_neighbouring_samples_and_gauges_stay_as_they_are():
    history = History(keep_s=60, period_s=2)
    history.add(Sample(T0, steps=10, tokens=100, kv_used=5, kv_total=4096, public=1, unknown=2))
    history.add(Sample(T0 + 2, steps=30, tokens=140, sessions=1, kv_used=512, kv_total=4096,
                       public=2, private=1))
    history.add(Sample(T0 + 4, steps=30, tokens=140, kv_total=4096, public=2, private=1))
    data = json.loads(json.dumps(history.to_json()))  # what the API sends
    assert data["period_s"] == 2 and data["keep_s"] == 60
    assert data["time"] == [T0, T0 + 2, T0 + 4]
    assert data["steps_s"] == [None, 10.0, 0.0]
    assert data["tokens_s"] == [None, 20.0, 0.0]
    assert data["sessions"] == [0, 1, 0]
    assert data["kv_used"] == [5, 512, 0] and data["kv_total"] == [4096] * 3
    assert data["peers"] == [3, 3, 3]
    assert (data["public"], data["private"], data["unknown"]) == ([1, 2, 2], [0, 1, 1], [2, 0, 0])


def test_the_window_keeps_the_last_keep_s():
    history = History(keep_s=10, period_s=2)
    for i in range(100):
        history.add(Sample(T0 + 2 * i, steps=i))
    data = history.to_json()
    assert len(history) == 6 and data["time"][0] == T0 + 2 * 94 and data["time"][-1] == T0 + 2 * 99
    assert data["steps_s"] == [None] + [0.5] * 5


def test_a_counter_that_starts_again_counts_from_zero():
    history = History()
    history.add(Sample(T0, steps=500, tokens=900))
    history.add(Sample(T0 + 2, steps=4, tokens=6))  # a new server (the node moved to another span)
    assert history.to_json()["steps_s"] == [None, 2.0]
    assert history.to_json()["tokens_s"] == [None, 3.0]


def test_a_clock_set_back_replaces_the_later_samples():
    history = History()
    for t in (0, 2, 4):
        history.add(Sample(T0 + t, steps=t))
    history.add(Sample(T0 + 3, steps=3))
    assert history.to_json()["time"] == [T0, T0 + 2, T0 + 3]
    assert history.to_json()["steps_s"] == [None, 1.0, 1.0]


def test_reaches_are_counted_and_anything_else_is_unknown():
    assert count_reaches(["public", "private", "public", "unknown", "bogus"]) == {"public": 2, "private": 1,
                                                                                 "unknown": 2}
    assert count_reaches([]) == {"public": 0, "private": 0, "unknown": 0}


def test_bad_samples_and_windows_are_refused():
    with pytest.raises(ValueError):
        Sample(T0, steps=-1)
    with pytest.raises(ValueError):
        History(keep_s=1, period_s=2)


@given(st.lists(st.tuples(st.floats(0.1, 10), st.integers(0, 10**6), st.integers(0, 10**9)), max_size=400))
def test_any_sequence_gives_aligned_series_with_rates_never_negative(steps):
    history = History(keep_s=120, period_s=2)
    now = T0
    for gap, count, tokens in steps:
        now += gap
        history.add(Sample(now, steps=count, tokens=tokens))
    data = history.to_json()
    assert len(data["time"]) == len(history) <= 61
    assert all(len(data[name]) == len(data["time"]) for name in data if name not in ("period_s", "keep_s"))
    assert data["time"] == sorted(data["time"])
    assert all(rate is None or rate >= 0 for rate in data["steps_s"] + data["tokens_s"])
