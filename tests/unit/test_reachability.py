"""net/reachability.py: AutoNAT verdicts to a status, relay choice, circuit addresses."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from compushare.net.reachability import (
    PRIVATE,
    PUBLIC,
    UNKNOWN,
    RelayCandidate,
    Verdicts,
    advertised_addrs,
    choose_relays,
    circuit_addrs,
    is_circuit,
    relay_of,
    servers_to_ask,
    split_addrs,
)

R = "12D3KooWRelay"
ME = "12D3KooWMe"


def test_circuit_addresses_name_the_relay_and_the_node():
    addrs = circuit_addrs(R, ["/ip4/10.200.0.1/tcp/4001", f"/ip4/10.200.0.1/tcp/4002/p2p/{R}"], ME)
    assert addrs == [f"/ip4/10.200.0.1/tcp/4001/p2p/{R}/p2p-circuit/p2p/{ME}",
                     f"/ip4/10.200.0.1/tcp/4002/p2p/{R}/p2p-circuit/p2p/{ME}"]
    assert all(is_circuit(a) and relay_of(a) == R for a in addrs)
    assert circuit_addrs(R, [addrs[0]], ME) == []  # never a circuit through a circuit
    assert relay_of("/ip4/10.200.0.1/tcp/4001") is None
    direct, relayed = split_addrs(["/ip4/1.2.3.4/tcp/1", addrs[0]])
    assert direct == ["/ip4/1.2.3.4/tcp/1"] and relayed == [addrs[0]]


def test_three_agreeing_servers_decide_and_one_liar_does_not_flip_it():
    v = Verdicts(confirmations=3)
    v.record("a", False, 0.0)
    v.record("b", False, 0.0)
    assert v.decide(1.0, servers_available=5) == UNKNOWN  # two are not enough with five to ask
    v.record("c", False, 0.0)
    assert v.decide(1.0, servers_available=5) == PRIVATE
    v.record("d", True, 2.0)  # one server says it got through
    assert v.decide(3.0, servers_available=5) == PRIVATE


def test_a_small_swarm_decides_with_the_servers_it_has():
    v = Verdicts(confirmations=3)
    v.record("only", True, 0.0)
    assert v.decide(0.0, servers_available=1) == PUBLIC


def test_verdicts_age_out_and_a_new_address_forgets_them():
    v = Verdicts(confirmations=1, max_age_s=10.0)
    v.record("a", True, 0.0)
    assert v.decide(1.0, 1) == PUBLIC
    assert v.asked(1.0) == {"a"} and v.asked(11.0) == set()
    v.forget()
    assert v.status == UNKNOWN and v.decide(1.0, 1) == UNKNOWN


@given(st.lists(st.tuples(st.sampled_from("abcdef"), st.booleans()), max_size=30), st.integers(1, 6))
def test_a_new_status_always_has_enough_agreeing_servers_and_a_majority(votes, confirmations):
    v = Verdicts(confirmations=confirmations)
    latest: dict[str, bool] = {}
    for i, (server, ok) in enumerate(votes):
        before = v.status
        v.record(server, ok, float(i))
        latest[server] = ok
        after = v.decide(float(i), servers_available=6)
        if after != before:
            agree = sum(1 for o in latest.values() if o == (after == PUBLIC))
            assert agree >= min(confirmations, 6) and agree > len(latest) - agree


def test_servers_without_a_fresh_verdict_are_asked_first():
    assert servers_to_ask(["a", "b", "c", "d"], {"a", "c"}, 3) == ["b", "d", "a"]


def test_relays_are_chosen_nearest_first_never_twice_nor_avoided():
    cands = [RelayCandidate("x", ("/ip4/1/tcp/1",)), RelayCandidate("y", ("/ip4/2/tcp/1",), rtt_s=0.05),
             RelayCandidate("z", ("/ip4/3/tcp/1",), rtt_s=0.01), RelayCandidate("w", ())]
    assert [c.peer_id for c in choose_relays([], cands, 2)] == ["z", "y"]
    assert [c.peer_id for c in choose_relays(["z"], cands, 2)] == ["y"]
    assert [c.peer_id for c in choose_relays([], cands, 3, avoid={"y"})] == ["z", "x"]  # w has no address
    assert choose_relays(["a", "b"], cands, 2) == []


def test_a_natd_node_advertises_its_circuits_first():
    own = ["/ip4/10.201.2.2/tcp/4001/p2p/me"]
    relayed = [f"/ip4/10.200.0.1/tcp/4001/p2p/{R}/p2p-circuit/p2p/me"]
    assert advertised_addrs(PRIVATE, own, relayed, 8) == relayed + own
    assert advertised_addrs(PUBLIC, own, relayed, 8) == own
    assert advertised_addrs(UNKNOWN, own, [], 8) == own
    assert advertised_addrs(PRIVATE, own, relayed * 9, 8) == relayed * 8
