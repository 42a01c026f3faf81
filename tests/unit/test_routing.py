"""pipeline/routing.py: greedy fewest-hop cover of a model's blocks by live servers."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from compushare.errors import RouteError
from compushare.net.records import ServerRecord
from compushare.pipeline.routing import Hop, plan_chain, uncovered_blocks

NOW = 1000.0


def rec(peer: str, start: int, end: int, *, tps: float = 0.0, expires: float = NOW + 60) -> ServerRecord:
    return ServerRecord(peer_id=peer, model_id="m", start=start, end=end, dtype="float32", addrs=(),
                        expires=expires, seq=1, throughput=tps)


def spans(hops: list[Hop]) -> list[tuple[str, int, int]]:
    return [(h.peer_id, h.start, h.end) for h in hops]


def test_two_stage_chain():
    hops = plan_chain([rec("b", 2, 4), rec("a", 0, 2)], 4, now=NOW)
    assert spans(hops) == [("a", 0, 2), ("b", 2, 4)]
    assert hops[0].record.peer_id == "a"


def test_single_server_covering_everything():
    assert spans(plan_chain([rec("a", 0, 1), rec("full", 0, 4)], 4, now=NOW)) == [("full", 0, 4)]


def test_greedy_takes_the_furthest_reach():
    records = [rec("a", 0, 1), rec("b", 0, 3), rec("c", 1, 4, tps=1), rec("d", 3, 4)]
    assert spans(plan_chain(records, 4, now=NOW)) == [("b", 0, 3), ("c", 3, 4)]


def test_hop_may_be_a_suffix_of_the_servers_span():
    records = [rec("a", 0, 3), rec("b", 1, 6)]
    hops = plan_chain(records, 6, now=NOW)
    assert spans(hops) == [("a", 0, 3), ("b", 3, 6)]
    assert (hops[1].record.start, hops[1].record.end) == (1, 6)


def test_span_beyond_the_model_is_clipped():
    hops = plan_chain([rec("a", 0, 2), rec("b", 2, 10)], 4, now=NOW)
    assert spans(hops) == [("a", 0, 2), ("b", 2, 4)]


def test_ties_prefer_throughput_then_peer_id():
    assert spans(plan_chain([rec("a", 0, 4, tps=5), rec("b", 0, 4, tps=1)], 4, now=NOW)) == [("a", 0, 4)]
    assert spans(plan_chain([rec("a", 0, 4, tps=1), rec("b", 0, 4, tps=1)], 4, now=NOW)) == [("b", 0, 4)]
    # Reach beats throughput; clipped reach ties.
    assert spans(plan_chain([rec("fast", 0, 2, tps=99), rec("far", 0, 4)], 4, now=NOW)) == [("far", 0, 4)]
    assert spans(plan_chain([rec("x", 0, 9, tps=1), rec("y", 0, 4, tps=2)], 4, now=NOW)) == [("y", 0, 4)]


def test_expired_and_excluded_servers_are_skipped():
    records = [rec("dead", 0, 4, expires=NOW), rec("a", 0, 2), rec("b", 2, 4), rec("bad", 2, 4, tps=100)]
    assert spans(plan_chain(records, 4, now=NOW)) == [("a", 0, 2), ("bad", 2, 4)]
    assert spans(plan_chain(records, 4, now=NOW, exclude=frozenset({"bad"}))) == [("a", 0, 2), ("b", 2, 4)]
    assert spans(plan_chain(records, 4, now=NOW - 1)) == [("dead", 0, 4)]


def test_gap_raises_route_error_naming_the_block():
    with pytest.raises(RouteError, match="block 2 of 5"):
        plan_chain([rec("a", 0, 2), rec("b", 3, 5)], 5, now=NOW)
    with pytest.raises(RouteError, match="block 0 of 1"):
        plan_chain([], 1, now=NOW)
    with pytest.raises(RouteError, match="block 0 of 4"):
        plan_chain([rec("a", 0, 4, expires=NOW - 1)], 4, now=NOW)
    with pytest.raises(RouteError):
        plan_chain([rec("a", 0, 4)], 4, now=NOW, exclude=frozenset({"a"}))


def test_no_blocks_no_hops():
    assert plan_chain([], 0, now=NOW) == []


def test_uncovered_blocks():
    records = [rec("a", 0, 2), rec("b", 3, 4), rec("dead", 2, 3, expires=NOW - 5), rec("far", 5, 9)]
    assert uncovered_blocks(records, 6, NOW) == [2, 4]
    assert uncovered_blocks(records, 6, NOW - 10) == [4]
    assert uncovered_blocks([], 3, NOW) == [0, 1, 2]


def _min_hops(records, n, now):
    """Breadth-first search over positions: the true minimum number of hops, or None."""
    frontier, seen, hops = {0}, {0}, 0
    if n == 0:
        return 0
    while frontier:
        hops += 1
        nxt = set()
        for p in frontier:
            for r in records:
                if r.is_live(now) and r.start <= p < r.end:
                    for q in range(p + 1, min(r.end, n) + 1):
                        if q == n:
                            return hops
                        if q not in seen:
                            seen.add(q)
                            nxt.add(q)
        frontier = nxt
    return None


record_lists = st.lists(
    st.tuples(st.integers(0, 9), st.integers(1, 6), st.integers(0, 3), st.booleans()).map(
        lambda t: (t[0], t[0] + t[1], t[2], t[3])
    ),
    max_size=8,
).map(lambda items: [rec(f"p{i}", s, e, tps=float(tps), expires=NOW + 1 if live else NOW - 1)
                     for i, (s, e, tps, live) in enumerate(items)])


@given(record_lists, st.integers(0, 10))
def test_plan_is_a_minimal_contiguous_cover(records, n):
    missing = uncovered_blocks(records, n, NOW)
    best = _min_hops(records, n, NOW)
    assert (best is None) == bool(missing)
    if missing:
        with pytest.raises(RouteError, match=f"block {missing[0]} of {n}"):
            plan_chain(records, n, now=NOW)
        return
    hops = plan_chain(records, n, now=NOW)
    assert len(hops) == best
    position = 0
    for hop in hops:
        assert hop.start == position < hop.end
        assert hop.record.start <= hop.start and hop.end <= hop.record.end
        assert hop.record.is_live(NOW)
        position = hop.end
    assert position == n


@given(record_lists, st.integers(1, 10), st.randoms(use_true_random=False))
def test_plan_does_not_depend_on_record_order(records, n, rng):
    shuffled = list(records)
    rng.shuffle(shuffled)
    try:
        expected = spans(plan_chain(records, n, now=NOW))
    except RouteError:
        with pytest.raises(RouteError):
            plan_chain(shuffled, n, now=NOW)
        return
    assert spans(plan_chain(shuffled, n, now=NOW)) == expected
