"""pipeline/routing.py: the least-expected-latency cover of a model's blocks."""

from __future__ import annotations

import functools

import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from compushare.errors import RouteError
from compushare.net.records import ServerRecord
from compushare.pipeline.client.routing import HOP_OVERHEAD_S, TIE_QUANTUM_S, Hop, Measure, describe_route, plan_route, uncovered_blocks

NOW = 1000.0


def rec(peer: str, start: int, end: int, *, tps: float = 0.0, expires: float = NOW + 60) -> ServerRecord:
    return ServerRecord(peer_id=peer, model_id="m", start=start, end=end, dtype="float32", addrs=(),
                        expires=expires, seq=1, throughput=tps)


def spans(hops: list[Hop]) -> list[tuple[str, int, int]]:
    return [(h.peer_id, h.start, h.end) for h in hops]


def plan(records, n, **kwargs):
    return plan_route(records, n, now=NOW, **kwargs)


def test_two_stage_chain():
    assert spans(plan([rec("b", 2, 4), rec("a", 0, 2)], 4)) == [("a", 0, 2), ("b", 2, 4)]


def test_with_nothing_measured_fewest_hops_win():
    assert spans(plan([rec("a", 0, 1), rec("full", 0, 4)], 4)) == [("full", 0, 4)]
    records = [rec("a", 0, 1), rec("b", 0, 3), rec("c", 1, 4), rec("d", 3, 4)]
    assert len(plan(records, 4)) == 2


def test_hop_may_be_a_suffix_of_the_servers_span_and_is_clipped_to_the_model():
    hops = plan([rec("a", 0, 3), rec("b", 1, 9)], 6)
    assert hops[-1].end == 6 and hops[-1].record.start == 1
    assert [h.start for h in hops] == [0, hops[0].end]


def test_slow_server_is_avoided_for_the_same_span():
    records = [rec("a", 0, 2), rec("fast", 2, 4), rec("slow", 2, 4)]
    measures = {"fast": Measure(rtt_s=0.002, block_rate=50), "slow": Measure(rtt_s=0.002, block_rate=5)}
    assert spans(plan(records, 4, measures=measures)) == [("a", 0, 2), ("fast", 2, 4)]
    measures["slow"] = Measure(rtt_s=0.002, block_rate=500)
    assert spans(plan(records, 4, measures=measures))[1][0] == "slow"


def test_far_server_is_avoided_and_an_extra_hop_can_pay_off():
    records = [rec("far", 0, 4), rec("x", 0, 2), rec("y", 2, 4)]
    far = {"far": Measure(rtt_s=0.300, block_rate=100), "x": Measure(rtt_s=0.01, block_rate=100),
           "y": Measure(rtt_s=0.01, block_rate=100)}
    assert spans(plan(records, 4, measures=far)) == [("x", 0, 2), ("y", 2, 4)]
    near = dict(far, far=Measure(rtt_s=0.01, block_rate=100))
    assert spans(plan(records, 4, measures=near)) == [("far", 0, 4)]


def test_load_stretches_compute():
    records = [rec("idle", 0, 4), rec("loaded", 0, 4)]
    measures = {"idle": Measure(rtt_s=0.01, block_rate=100, load=0.0),
                "loaded": Measure(rtt_s=0.005, block_rate=100, load=0.8)}
    hops = plan(records, 4, measures=measures)
    assert spans(hops) == [("idle", 0, 4)]


def test_busy_servers_are_left_out():
    records = [rec("full", 0, 4), rec("roomy", 0, 4)]
    measures = {"full": Measure(rtt_s=0.001, block_rate=900, free_tokens=10),
                "roomy": Measure(rtt_s=0.05, block_rate=10, free_tokens=5000)}
    assert spans(plan(records, 4, measures=measures, needed_tokens=100)) == [("roomy", 0, 4)]
    with pytest.raises(RouteError, match="1 busy"):
        plan([records[0]], 4, measures=measures, needed_tokens=100)


def test_expired_and_excluded_servers_are_skipped():
    records = [rec("dead", 0, 4, expires=NOW), rec("a", 0, 2), rec("b", 2, 4)]
    assert spans(plan(records, 4)) == [("a", 0, 2), ("b", 2, 4)]
    with pytest.raises(RouteError):
        plan(records, 4, exclude=frozenset({"b"}))
    assert spans(plan_route(records, 4, now=NOW - 1)) == [("dead", 0, 4)]


def test_ties_go_to_the_lowest_peer_ids():
    assert spans(plan([rec("b", 0, 4), rec("a", 0, 4)], 4)) == [("a", 0, 4)]


def test_gap_raises_route_error_naming_the_block():
    with pytest.raises(RouteError, match="block 2 of 5"):
        plan([rec("a", 0, 2), rec("b", 3, 5)], 5)
    with pytest.raises(RouteError, match="block 0 of 1"):
        plan([], 1)
    with pytest.raises(RouteError, match="block 0 of 4"):
        plan([rec("a", 0, 4, expires=NOW - 1)], 4)


def test_no_blocks_no_hops():
    assert plan([], 0) == []


def test_describe_route_gives_every_hop_and_the_total():
    hops = plan([rec("a", 0, 2), rec("b", 2, 4)], 4, measures={"a": Measure(rtt_s=0.004, block_rate=100)})
    lines = describe_route(hops)
    assert len(lines) == 3 and "hop 1: a blocks 0:2: ping 4.0 ms" in lines[0] and "compute ~20.0 ms" in lines[0]
    assert lines[-1].startswith("expected ") and "2 hops" in lines[-1]


def test_uncovered_blocks():
    records = [rec("a", 0, 2), rec("b", 3, 4), rec("dead", 2, 3, expires=NOW - 5), rec("far", 5, 9)]
    assert uncovered_blocks(records, 6, NOW) == [2, 4]
    assert uncovered_blocks(records, 6, NOW - 10) == [4]
    assert uncovered_blocks([], 3, NOW) == [0, 1, 2]


# --------------------------------------------------------------------------- sub-ranges (failover re-plans)


def check_chain(hops: list[Hop], start: int, end: int) -> None:
    """Contiguous from exactly `start` to exactly `end`, each hop within its server's span."""
    position = start
    for hop in hops:
        assert hop.start == position < hop.end <= end
        assert hop.record.start <= hop.start and hop.end <= hop.record.end
        position = hop.end
    assert position == end


def test_sub_range_route_stays_within_it():
    records = [rec("a", 0, 3), rec("b", 1, 6), rec("c", 3, 5), rec("d", 4, 6)]
    hops = plan(records, 6, start=2, end=4)
    check_chain(hops, 2, 4)
    assert spans(hops) == [("b", 2, 4)]  # one hop beats a:2..3 + c:3..4
    check_chain(plan(records, 6, start=4, end=6), 4, 6)
    check_chain(plan(records, 6, start=0, end=1), 0, 1)


def test_sub_range_defaults_to_the_model_end():
    records = [rec("a", 0, 2), rec("b", 2, 4)]
    assert spans(plan(records, 4, start=2)) == [("b", 2, 4)]
    assert spans(plan(records, 4, end=2)) == [("a", 0, 2)]


def test_sub_range_avoids_excluded_peers():
    """A failover re-plans the failed span without the server that failed."""
    records = [rec("failed", 0, 6), rec("x", 2, 3), rec("y", 3, 4)]
    assert spans(plan(records, 6, start=2, end=4)) == [("failed", 2, 4)]
    hops = plan(records, 6, start=2, end=4, exclude=frozenset({"failed"}))
    assert spans(hops) == [("x", 2, 3), ("y", 3, 4)]
    with pytest.raises(RouteError, match="block 2 of 6"):
        plan(records, 6, start=2, end=4, exclude=frozenset({"failed", "x"}))


def test_uncovered_sub_range_raises_naming_its_first_missing_block():
    records = [rec("a", 0, 2), rec("b", 3, 5), rec("c", 6, 8)]
    with pytest.raises(RouteError, match="block 2 of 8"):
        plan(records, 8, start=1, end=4)
    with pytest.raises(RouteError, match="block 5 of 8"):
        plan(records, 8, start=3, end=7)
    # gaps outside the sub-range do not matter
    assert spans(plan(records, 8, start=3, end=5)) == [("b", 3, 5)]
    assert spans(plan(records, 8, start=6, end=8)) == [("c", 6, 8)]


def test_empty_sub_range_is_no_hops():
    assert plan([], 4, start=2, end=2) == []
    assert plan([rec("a", 0, 4)], 4, start=4, end=4) == []
    assert plan([rec("a", 0, 4)], 4, start=0, end=0) == []


# --------------------------------------------------------------------------- properties

record_lists = st.lists(
    st.tuples(st.integers(0, 9), st.integers(1, 6), st.integers(0, 3), st.booleans()).map(
        lambda t: (t[0], t[0] + t[1], t[2], t[3])
    ),
    max_size=7,
).map(lambda items: [rec(f"p{i}", s, e, tps=float(tps), expires=NOW + 1 if live else NOW - 1)
                     for i, (s, e, tps, live) in enumerate(items)])
measure_maps = st.dictionaries(
    st.sampled_from([f"p{i}" for i in range(7)]),
    st.builds(Measure, rtt_s=st.one_of(st.none(), st.floats(0.0, 0.5)), block_rate=st.floats(0.0, 200.0),
              load=st.floats(0.0, 1.0)),
)


def _cheapest(records, n, measures, start: int = 0) -> float | None:
    """Exhaustive search over every contiguous cover, pricing hops with the planner's own
    estimates (the property checks the search, not the cost model)."""
    live = [r for r in records if r.is_live(NOW)]

    @functools.cache
    def from_(p: int) -> float | None:
        if p == n:
            return 0.0
        options = []
        for r in live:
            if r.start <= p < r.end:
                for e in range(p + 1, min(r.end, n) + 1):
                    rest = from_(e)
                    if rest is not None:
                        options.append(_hop_cost(records, measures, r, p, e) + rest)
        return min(options) if options else None

    return from_(start)


def _hop_cost(records, measures, record, start, end) -> float:
    """The planner's cost model, restated independently of its code."""
    import statistics

    from compushare.pipeline.client.routing import DEFAULT_BLOCK_RATE, DEFAULT_RTT_S, MAX_LOAD, MIN_BLOCK_RATE

    live = [r for r in records if r.is_live(NOW)]

    def rate(r):
        m = measures.get(r.peer_id, Measure())
        known = m.block_rate if m.block_rate > 0 else (r.throughput * (r.end - r.start) if r.throughput > 0 else 0)
        return max(known, MIN_BLOCK_RATE) if known > 0 else 0

    rtts = [measures[r.peer_id].rtt_s for r in live if r.peer_id in measures and measures[r.peer_id].rtt_s is not None]
    rates = [x for r in live if (x := rate(r)) > 0]
    m = measures.get(record.peer_id, Measure())
    r = rate(record) or (statistics.median(rates) if rates else DEFAULT_BLOCK_RATE)
    rtt = m.rtt_s if m.rtt_s is not None else (statistics.median(rtts) if rtts else DEFAULT_RTT_S)
    return rtt + HOP_OVERHEAD_S + (end - start) / r / (1 - min(m.load, MAX_LOAD))


@given(record_lists, st.integers(0, 10), measure_maps)
@example(  # a subnormal advertised rate once made every route's time infinite
    records=[rec("p0", 0, 2, tps=0.0, expires=NOW + 1), rec("p1", 0, 1, tps=1.0, expires=NOW + 1)], n=2,
    measures={"p0": Measure(block_rate=2.2250738585072014e-308)})
def test_plan_is_the_cheapest_contiguous_cover(records, n, measures):
    missing = uncovered_blocks(records, n, NOW)
    if missing:
        with pytest.raises(RouteError, match=f"block {missing[0]} of {n}"):
            plan(records, n, measures=measures)
        return
    hops = plan(records, n, measures=measures)
    position = 0
    for hop in hops:
        assert hop.start == position < hop.end
        assert hop.record.start <= hop.start and hop.end <= hop.record.end and hop.record.is_live(NOW)
        position = hop.end
    assert position == n
    cheapest = _cheapest(records, n, measures)  # optimal up to the tie quantum per hop
    assert cheapest - 1e-9 <= sum(h.expected_s for h in hops) <= cheapest + TIE_QUANTUM_S * len(hops) + 1e-9


@given(record_lists, st.integers(1, 10), measure_maps, st.randoms(use_true_random=False))
def test_plan_does_not_depend_on_record_order(records, n, measures, rng):
    shuffled = list(records)
    rng.shuffle(shuffled)
    try:
        expected = spans(plan(records, n, measures=measures))
    except RouteError:
        with pytest.raises(RouteError):
            plan(shuffled, n, measures=measures)
        return
    assert spans(plan(shuffled, n, measures=measures)) == expected


@given(record_lists, st.integers(0, 10), st.integers(0, 10), measure_maps)
def test_sub_range_plan_is_the_cheapest_cover_of_it(records, a, b, measures):
    start, end = min(a, b), max(a, b)
    n = 10
    missing = [block for block in uncovered_blocks(records, end, NOW) if block >= start]
    if missing:
        with pytest.raises(RouteError, match=f"block {missing[0]} of {n}"):
            plan(records, n, measures=measures, start=start, end=end)
        return
    hops = plan(records, n, measures=measures, start=start, end=end)
    check_chain(hops, start, end)
    assert all(h.record.is_live(NOW) for h in hops)
    # Optimal up to the tie quantum per hop (times that close are ties, broken by karma).
    cheapest = _cheapest(records, end, measures, start)
    assert cheapest - 1e-9 <= sum(h.expected_s for h in hops) <= cheapest + TIE_QUANTUM_S * len(hops) + 1e-9


def test_karma_breaks_ties_between_equally_fast_routes_and_never_outweighs_speed():
    records = [rec("a", 0, 4), rec("b", 0, 4)]
    equal = {"a": Measure(rtt_s=0.01, block_rate=100.0, karma=1.0), "b": Measure(rtt_s=0.01, block_rate=100.0, karma=3.5)}
    assert spans(plan(records, 4, measures=equal)) == [("b", 0, 4)]
    # Within a rounding quantum of expected time it is still a tie...
    close = dict(equal, b=Measure(rtt_s=0.0101, block_rate=100.0, karma=3.5))
    assert spans(plan(records, 4, measures=close)) == [("b", 0, 4)]
    # ...but a faster server wins whatever its karma.
    faster = dict(equal, a=Measure(rtt_s=0.002, block_rate=100.0, karma=1.0))
    assert spans(plan(records, 4, measures=faster)) == [("a", 0, 4)]
    # Unknown karma is a newcomer's 1.0: with equal scores, peer ids decide as before.
    assert spans(plan(records, 4, measures={p: Measure(rtt_s=0.01, block_rate=100.0) for p in "ab"})) == [("a", 0, 4)]


def test_absurdly_slow_estimates_still_order_routes():
    """Found by the property test: two estimates past any rounding must still compare."""
    records = [rec("p1", 0, 1), rec("p3", 0, 1)]
    measures = {"p1": Measure(block_rate=0.0, load=1.0), "p3": Measure(block_rate=1.6e-164)}
    # p1 takes the median rate (p3's) and is stretched 10x by its load: ~6e164 s against p3's ~6e163 s.
    assert [h.peer_id for h in plan(records, 1, measures=measures)] == ["p3"]
