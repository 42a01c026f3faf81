"""tools/netlab's pure parts: a lab's names, addresses and build commands, and the
delayer's schedule. No root needed (tests/integration/test_netlab.py builds labs)."""

import random

import pytest
from hypothesis import given
from hypothesis import strategies as st

from netlab.delayer import Schedule
from netlab.topology import Topology, TopologyError, parse_hosts, parse_rates


def flat(cmds):
    return [" ".join(cmd) for cmd in cmds]


def test_names_and_addresses():
    top = Topology("ab", hosts=4, nat=frozenset({3}))
    assert top.namespaces() == ["abh1", "abh2", "abh3", "abh4", "abr3", "abhub"]
    assert top.addr(1) == top.seen_addr(1) == "10.200.0.1"
    assert top.addr(3) == "10.201.3.2" and top.seen_addr(3) == "10.200.0.103"
    with pytest.raises(TopologyError):
        top.router_ns(1)
    with pytest.raises(TopologyError):
        top.addr(5)


def test_a_prefix_owns_only_its_own_namespaces():
    top = Topology("ab", hosts=1)
    assert all(top.owns(ns) for ns in ("abhub", "abh1", "abh12", "abr3"))
    assert not any(top.owns(ns) for ns in ("abch1", "ab1h1", "xabh1", "abhubx", "abh", "ab"))


@pytest.mark.parametrize("kwargs", [
    dict(prefix="Bad", hosts=2), dict(prefix="1ab", hosts=2), dict(prefix="abcdefghi", hosts=2),
    dict(prefix="ab", hosts=0), dict(prefix="ab", hosts=100), dict(prefix="ab", hosts=2, delay_ms=-1),
    dict(prefix="ab", hosts=2, loss_pct=101), dict(prefix="ab", hosts=2, rates=("20mbit",) * 3),
    dict(prefix="ab", hosts=2, rates=("20 mbit",)), dict(prefix="ab", hosts=2, rates=("20mbit; rm",)),
    dict(prefix="ab", hosts=2, nat=frozenset({3})),
])
def test_bad_labs_are_refused(kwargs):
    with pytest.raises(TopologyError):
        Topology(**kwargs)


def test_rate_and_host_lists():
    assert parse_rates("20mbit") == ("20mbit",) and parse_rates("-") == (None,) and parse_rates(None) == (None,)
    assert parse_rates("1mbit,-,2mbit") == ("1mbit", None, "2mbit")
    assert parse_hosts("3,4") == {3, 4} and parse_hosts("") == frozenset()
    with pytest.raises(TopologyError):
        parse_hosts("3;4")
    top = Topology("ab", hosts=3, rates=parse_rates("1mbit,-,2mbit"))
    assert [top.rate(i) for i in (1, 2, 3)] == ["1mbit", None, "2mbit"]


def test_nat_router_masquerades_and_drops_unsolicited_inbound():
    cmds = flat(Topology("ab", hosts=2, nat=frozenset({2})).up_commands(netem=False))
    router = [c for c in cmds if "abr2" in c]
    assert any("POSTROUTING -o eth0 -j MASQUERADE" in c for c in router)
    accept = next(i for i, c in enumerate(cmds) if "ESTABLISHED,RELATED -j ACCEPT" in c)
    drop = next(i for i, c in enumerate(cmds) if c.endswith("-i eth0 -o lan0 -j DROP"))
    assert accept < drop  # replies pass before everything else inbound is dropped
    assert "ip -n abh2 route add default via 10.201.2.1" in cmds
    assert not any("abr1" in c for c in cmds)  # host 1 is public


def test_shaping_commands():
    delayed = flat(Topology("ab", hosts=2, delay_ms=20, rates=("8mbit", None)).up_commands(netem=False))
    assert sum("NFQUEUE" in c for c in delayed) == 2  # both hosts delay their ingress
    assert all("INPUT" in c for c in delayed if "NFQUEUE" in c)  # INPUT, never OUTPUT
    assert [c for c in delayed if " tbf " in c] == [
        "ip netns exec abh1 tc qdisc add dev eth0 root tbf rate 8mbit burst 32kb latency 200ms",
        "ip netns exec abhub tc qdisc add dev v1 root tbf rate 8mbit burst 32kb latency 200ms"]
    netem = flat(Topology("ab", hosts=2, delay_ms=20).up_commands(netem=True))
    assert not any("NFQUEUE" in c for c in netem) and sum(" netem delay 20ms 0ms loss 0%" in c for c in netem) == 2
    plain = flat(Topology("ab", hosts=2).up_commands(netem=False))
    assert not any("NFQUEUE" in c or "netem" in c or "tbf" in c for c in plain)
    assert all("tso off gso off gro off" in c for c in plain if "ethtool" in c)


def test_schedule_delays_by_the_delay():
    sched = Schedule(0.02)
    assert sched.arrive("a", now=1.0) and sched.arrive("b", now=1.005)
    assert sched.due(1.019) == [] and sched.next_wait(1.019) == pytest.approx(0.001)
    assert sched.due(1.02) == ["a"] and sched.due(1.03) == ["b"] and sched.next_wait(1.03) == 1.0


@given(st.lists(st.floats(min_value=0, max_value=0.1), min_size=1, max_size=60), st.integers(0, 2**32))
def test_jittered_packets_leave_in_arrival_order(gaps, seed):
    sched = Schedule(0.02, jitter_s=0.015, rng=random.Random(seed))
    now, out = 0.0, []
    for index, gap in enumerate(gaps):
        now += gap
        sched.arrive(index, now)
        out += sched.due(now)
    out += sched.due(now + 10)
    assert out == list(range(len(gaps)))


def test_loss_drops_about_the_share_asked():
    sched = Schedule(0.0, loss=0.25, rng=random.Random(7))
    kept = sum(sched.arrive(i, 0.0) for i in range(4000))
    assert 2800 < kept < 3200
    assert len(sched.due(0.0)) == kept
