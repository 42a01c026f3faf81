"""net/view.py's view policy (issue 20): a flood of fresh identities churns the
newcomer part of the view and never touches a peer with evidence; replies put
evidence first and sample newcomers at random, never by peer id; a view pull asks a few
peers, the model's servers first (revision 23)."""

from __future__ import annotations

import contextlib
import itertools
import random
from unittest import mock

from hypothesis import given, settings
from hypothesis import strategies as st

from compushare.hardware import Hardware
from compushare.net import view as view_module
from compushare.net.ads import CapabilityAd, Serving
from compushare.net.view import (
    AGE_EVIDENCE_S,
    AGED,
    CONNECTED,
    EVIDENCED_SLOTS,
    KNOWN,
    MAX_PEERS,
    NEWCOMER_SLOTS,
    NONE,
    SELF,
    SwarmView,
)

NOW = 1_700_000_000.0
TTL = 60.0
HW = Hardware(cpu_cores=2, ram_mb=24000, ram_free_mb=20000, gpu=None, gpu_mb=0)
SPAN = Serving("ab" * 32, 0, 4, "float32", free_tokens=8192, load=0.0, block_rate=40.0)


def ad(peer: str, now: float, seq: int | None = None) -> CapabilityAd:
    """The view checks no signature (parse_ad did): plain ads will do."""
    return CapabilityAd(peer, (), HW, (SPAN,), "0.1.0", seq=int(now * 1e3) if seq is None else seq, sent=now,
                        expires=now + TTL)


def sybil(i: int) -> str:
    return f"12D3KooW0000{i:08d}"  # sorts before every honest id below


def honest(i: int) -> str:
    return f"12D3KooWzzzz{i:08d}"


def ids(ads) -> list[str]:
    return [a.peer_id for a in ads]


@contextlib.contextmanager
def small(newcomers: int, evidenced: int, aged: int | None = None):
    """The same policy at a size hypothesis can explore."""
    with mock.patch.multiple(view_module, NEWCOMER_SLOTS=newcomers, EVIDENCED_SLOTS=evidenced,
                             AGED_SLOTS=evidenced if aged is None else aged, MAX_PEERS=newcomers + evidenced):
        yield


def test_a_flood_of_fresh_identities_leaves_every_peer_with_evidence_in_view():
    view = SwarmView(policy=True, rng=random.Random(1))
    view.set_self(honest(0))
    for i in range(4):
        assert view.offer(ad(honest(i), NOW), NOW).accepted
    view.note_connected([honest(1), honest(2)], NOW)  # 3 stays a newcomer
    for i in range(5000):
        assert view.offer(ad(sybil(i), NOW + i * 0.01), NOW + i * 0.01).accepted  # never a gate
    later = NOW + 50
    held = set(ids(view.live(later)))
    assert {honest(0), honest(1), honest(2)} <= held
    assert view.counts() == {"peers": 3 + NEWCOMER_SLOTS, "evidenced": 3, "newcomers": NEWCOMER_SLOTS}
    assert view.displaced == 5000 + 1 - NEWCOMER_SLOTS  # honest(3) was one newcomer among the rest
    # An honest newcomer still gets in, and connecting makes it stay.
    assert view.offer(ad(honest(9), later), later).accepted and honest(9) in ids(view.live(later))
    view.note_connected([honest(1), honest(2), honest(9)], later)
    for i in range(5000, 7000):
        view.offer(ad(sybil(i), later), later)
    assert honest(9) in ids(view.live(later)) and view.evidence(honest(9), later) == CONNECTED


def test_the_reply_puts_evidence_first_and_samples_newcomers_not_by_id():
    view = SwarmView(policy=True, rng=random.Random(2))
    view.set_self(honest(0))
    view.offer(ad(honest(0), NOW), NOW)
    view.offer(ad(honest(1), NOW), NOW)  # connected, then gone: still evidenced
    view.note_connected([honest(1)], NOW)
    view.note_connected([], NOW + 1)
    view.offer(ad(honest(2), NOW + 1), NOW + 1)
    view.note_connected([honest(2)], NOW + 1)
    for i in range(3000):
        view.offer(ad(sybil(i), NOW + 2), NOW + 2)
    reply = ids(view.ranked(NOW + 3, 1024))
    assert reply[:3] == [honest(0), honest(2), honest(1)]  # self, connected now, connected before
    assert [view.evidence(p, NOW + 3) for p in reply[:3]] == [SELF, CONNECTED, KNOWN]
    newcomers = reply[3:]
    assert len(newcomers) == NEWCOMER_SLOTS and newcomers != sorted(newcomers)
    assert len(ids(view.ranked(NOW + 3, 100))) == 100


def test_ground_ids_crowd_the_reply_only_with_the_policy_off():
    on, off = SwarmView(policy=True), SwarmView(policy=False)
    for view in (on, off):
        view.offer(ad(honest(1), NOW), NOW)
        view.note_connected([honest(1)], NOW)
        for i in range(MAX_PEERS + 100):
            view.offer(ad(sybil(i), NOW + 1), NOW + 1)
    assert honest(1) in ids(on.ranked(NOW + 2, 1024))
    assert honest(1) not in ids(off.ranked(NOW + 2, 1024))  # the first 1,024 by id
    assert honest(1) in ids(off.live(NOW + 2))  # held, just never handed out
    # A new server arriving once the view is full: refused with the policy off only.
    late = NOW + 3
    for view in (on, off):
        view.note_connected([honest(1), honest(2)], late)
    assert on.offer(ad(honest(2), late), late).accepted
    refused = off.offer(ad(honest(2), late), late)
    assert not refused.accepted and "full" in refused.reason
    assert len(off.live(late)) == MAX_PEERS


def test_age_is_evidence_and_a_sustained_flood_keeps_newcomers_from_ageing_in():
    view = SwarmView(policy=True, rng=random.Random(3))
    view.offer(ad(honest(1), NOW), NOW)
    # A quiet swarm: the peer keeps advertising and is evidenced by age alone.
    t = NOW
    while t < NOW + AGE_EVIDENCE_S:
        t += 5
        view.offer(ad(honest(1), t), t)
    view.expire(t)
    assert view.evidence(honest(1), t) == AGED and view.counts()["evidenced"] == 1
    # Under a flood of 100 fresh keys/s a newcomer lasts about 5 s: it is back with
    # each ad (so it is in view much of the time) but never ages in.
    view.offer(ad(honest(2), t), t)
    present = 0
    for step in range(int(AGE_EVIDENCE_S)):
        now = t + step + 1
        for i in range(100):
            view.offer(ad(sybil(step * 100 + i), now), now)
        if step % 5 == 0:  # both honest peers keep advertising
            view.offer(ad(honest(2), now), now)
            view.offer(ad(honest(1), now), now)
        view.expire(now)
        present += honest(2) in ids(view.live(now))
        assert view.evidence(honest(2), now) == NONE
    assert present > 0.3 * AGE_EVIDENCE_S
    assert honest(1) in ids(view.live(now))  # aged before the flood: never displaced


def test_connection_evidence_displaces_the_youngest_aged_peer_only():
    with small(newcomers=4, evidenced=4):
        view = SwarmView(policy=True, rng=random.Random(4))
        for i in range(4):
            view.offer(ad(honest(i), NOW + i), NOW + i)
        aged_at = NOW + 3 + AGE_EVIDENCE_S
        for i in range(4):  # refreshed, so still live
            view.offer(ad(honest(i), aged_at), aged_at)
        view.expire(aged_at)
        assert view.counts() == {"peers": 4, "evidenced": 4, "newcomers": 0}
        # A connected peer arrives with the evidenced part full of aged peers.
        view.note_connected([honest(7)], aged_at)
        assert view.offer(ad(honest(7), aged_at), aged_at).accepted
        assert view.evidence(honest(7), aged_at) == CONNECTED
        assert view.counts() == {"peers": 5, "evidenced": 4, "newcomers": 1}
        assert view._peers[honest(3)].evidenced is False  # the youngest moved to the newcomer part
        # Newcomers never displace the evidenced part nor a connected peer; the peer
        # that made room is a newcomer now (its age counts again once there is room).
        for i in range(50):
            assert view.offer(ad(sybil(i), aged_at), aged_at).accepted
        assert set(map(honest, range(3))) | {honest(7)} <= set(ids(view.live(aged_at)))


def test_peers_that_age_in_take_at_most_the_aged_slots_and_newcomers_still_get_in():
    with small(newcomers=4, evidenced=6, aged=3):
        view = SwarmView(policy=True, rng=random.Random(6))
        view.note_connected([honest(1)], NOW)
        view.offer(ad(honest(1), NOW), NOW)
        for i in range(4):  # a patient attacker: four keys that keep advertising
            view.offer(ad(sybil(i), NOW), NOW)
        t = NOW + AGE_EVIDENCE_S
        for peer in [honest(1)] + [sybil(i) for i in range(4)]:  # all kept advertising
            view.offer(ad(peer, t), t)
        view.note_connected([], t)  # honest(1) keeps its evidence: it was connected
        assert view.counts() == {"peers": 5, "evidenced": 4, "newcomers": 1}
        assert sum(view._peers[sybil(i)].evidenced for i in range(4)) == 3  # the oldest three, by id
        # The fourth aged Sybil finds no room: it is a newcomer, and a newcomer may take its place.
        assert view.offer(ad(honest(2), t), t).accepted
        for i in range(10, 30):
            assert view.offer(ad(sybil(i), t), t).accepted
        assert honest(1) in ids(view.live(t)) and sum(sybil(i) in ids(view.live(t)) for i in range(3)) == 3


def test_lost_karma_makes_a_peer_a_newcomer_again():
    view = SwarmView(policy=True)
    view.offer(ad(honest(1), NOW), NOW)
    view.note_karma([honest(1)], NOW)
    assert view.evidence(honest(1), NOW) == KNOWN and view.counts()["evidenced"] == 1
    view.note_karma([], NOW + 1)
    assert view.evidence(honest(1), NOW + 1) == NONE and view.counts()["newcomers"] == 1


def test_relayed_sybils_do_not_push_out_what_the_reply_put_first():
    client = SwarmView(policy=True, rng=random.Random(5))
    reply = [ad(honest(i), NOW) for i in range(3)] + [ad(sybil(i), NOW) for i in range(1021)]
    taken = sum(client.replace(a, NOW + 1) for a in reply)
    assert taken == NEWCOMER_SLOTS
    assert {honest(0), honest(1), honest(2)} <= set(ids(client.live(NOW + 1)))
    assert client.replace(ad(honest(0), NOW + 1), NOW + 1)  # a newer ad of a peer held


def test_evidence_tables_are_bounded():
    view = SwarmView(policy=True)
    view.note_connected((f"p{i}" for i in range(100_000)), NOW)
    view.note_karma((f"k{i}" for i in range(100_000)), NOW)
    assert len(view._connected) == MAX_PEERS and len(view._karma) == MAX_PEERS


def test_the_policy_off_is_the_old_view():
    view = SwarmView(policy=False)
    for i in range(MAX_PEERS):
        assert view.offer(ad(sybil(i), NOW), NOW).accepted
    assert not view.offer(ad(honest(1), NOW), NOW).accepted
    assert not view.replace(ad(honest(1), NOW), NOW)
    assert ids(view.ranked(NOW, 10)) == sorted(ids(view.live(NOW)))[:10]
    view.expire(NOW + TTL)
    assert view.offer(ad(honest(1), NOW + TTL), NOW + TTL).accepted


# ------------------------------------------------------------------ properties

EVENTS = st.lists(st.one_of(
    st.tuples(st.just("sybil"), st.integers(0, 40)),  # a burst of fresh identities
    st.tuples(st.just("honest"), st.integers(0, 5)),  # an honest peer (re)advertises
    st.tuples(st.just("connect"), st.frozensets(st.integers(0, 5), max_size=3)),
    st.tuples(st.just("karma"), st.frozensets(st.integers(0, 5), max_size=2)),
    st.tuples(st.just("relay"), st.integers(0, 40)),
    st.tuples(st.just("wait"), st.floats(0.5, 200.0)),
), max_size=60)


@settings(max_examples=300)
@given(EVENTS, st.integers(0, 2**32 - 1), st.integers(1, 6))
def test_whatever_the_newcomers_do_peers_with_evidence_stay_and_sizes_hold(events, seed, aged_slots):
    newcomers, evidenced = 8, 6
    with small(newcomers, evidenced, aged_slots):
        view = SwarmView(policy=True, rng=random.Random(seed))
        now, fresh, seq = NOW, 0, 0
        for kind, arg in events:
            seq += 1
            if kind in ("sybil", "relay"):
                # Protected: the evidenced part, and connection or karma evidence anywhere.
                guarded = {p for p in ids(view.live(now))
                           if view._peers[p].evidenced or view.evidence(p, now) >= KNOWN}
                for _ in range(arg):
                    fresh += 1
                    if kind == "sybil":
                        taken = view.offer(ad(sybil(fresh), now, seq), now).accepted
                        assert taken or all(view.evidence(p, now) >= KNOWN for p in view._newcomers)
                    else:
                        view.replace(ad(sybil(fresh), now, seq), now)
                lost = guarded - set(ids(view.live(now)))
                assert not lost, f"newcomers displaced peers with evidence: {lost}"
            elif kind == "honest":
                view.offer(ad(honest(arg), now, seq), now)
            elif kind == "connect":
                view.note_connected(map(honest, arg), now)
            elif kind == "karma":
                view.note_karma(map(honest, arg), now)
            else:
                now += arg
                view.expire(now)
            counts = view.counts()
            assert counts["newcomers"] <= newcomers and counts["evidenced"] <= evidenced
            assert counts["peers"] == counts["newcomers"] + counts["evidenced"] == len(view._peers)
            assert sum(view.evidence(p, now) == AGED for p in view._evidenced) <= aged_slots
            assert len(view.ranked(now, 5)) <= 5


@settings(max_examples=100)
@given(st.integers(1, 2000), st.integers(0, 2**32 - 1))
def test_a_newcomer_always_gets_in_unless_every_peer_has_evidence(flood, seed):
    view = SwarmView(policy=True, rng=random.Random(seed))
    view.note_connected([honest(i) for i in range(10)], NOW)
    for i in range(10):
        view.offer(ad(honest(i), NOW), NOW)
    for i in range(flood):
        view.offer(ad(sybil(i), NOW), NOW)
    assert view.offer(ad(honest(99), NOW + 1), NOW + 1).accepted
    assert len(view.live(NOW + 1)) <= MAX_PEERS and view.counts()["evidenced"] <= EVIDENCED_SLOTS


# ------------------------------------------------------------------ a view pull's sample (revision 23)

MODEL = SPAN.model_id
OTHER_SPAN = Serving("cd" * 32, 0, 4, "float32", free_tokens=8192, load=0.0, block_rate=40.0)


def other_ad(peer: str, now: float) -> CapabilityAd:
    """A live ad that serves another model only."""
    return CapabilityAd(peer, (), HW, (OTHER_SPAN,), "0.1.0", seq=int(now * 1e3), sent=now, expires=now + TTL)


def pull_view(servers: int, others: int, stale: int, unknown: int, absent: int = 0) -> tuple[SwarmView, dict]:
    """A view holding `servers` live ads of MODEL, `others` of another model, `stale` ads
    of MODEL past their lifetime, and none of `unknown` peers; `absent` more servers of
    MODEL are in the view but not connected (not among the peers to sample)."""
    view, groups, n = SwarmView(policy=True), {}, itertools.count()
    for name, count in (("servers", servers), ("others", others), ("stale", stale), ("unknown", unknown),
                        ("absent", absent)):
        groups[name] = [honest(next(n)) for _ in range(count)]
    for peer in groups["servers"] + groups["absent"]:
        assert view.offer(ad(peer, NOW), NOW).accepted
    for peer in groups["others"]:
        assert view.offer(other_ad(peer, NOW), NOW).accepted
    for peer in groups["stale"]:  # offered a lifetime ago: held until expire(), never live
        assert view.offer(ad(peer, NOW - TTL - 1), NOW - TTL - 1).accepted
    return view, groups


@given(st.integers(0, 12), st.integers(0, 12), st.integers(0, 4), st.integers(0, 12), st.integers(0, 4),
       st.integers(0, 16), st.booleans())
def test_a_pull_asks_at_most_size_peers_the_models_servers_first(servers, others, stale, unknown, absent, size,
                                                                  named):
    view, groups = pull_view(servers, others, stale, unknown, absent)
    peers = groups["servers"] + groups["others"] + groups["stale"] + groups["unknown"]
    random.shuffle(peers)
    model_id = MODEL if named else None
    sample = view.sample_for(list(peers), model_id, NOW, size)
    assert len(sample) == len(set(sample)) == min(size, len(peers))  # all of them when fewer than size
    assert set(sample) <= set(peers)  # never a peer not given (not even a server in view)
    if named:
        serving = [peer in groups["servers"] for peer in sample]
        assert serving == sorted(serving, reverse=True)  # every server before any other peer
        assert sum(serving) == min(size, servers)


def test_the_sample_is_random_within_each_part_and_without_a_model_ignores_serving():
    view, groups = pull_view(servers=4, others=10, stale=2, unknown=8)
    servers = set(groups["servers"])
    peers = groups["servers"] + groups["others"] + groups["stale"] + groups["unknown"]
    named = [view.sample_for(peers, MODEL, NOW, 8) for _ in range(300)]
    assert all(set(s[:4]) == servers for s in named)
    assert len({tuple(s[:4]) for s in named}) > 1  # the servers in random order, not as given
    assert set().union(*(s[4:] for s in named)) == set(peers) - servers  # any of the rest may fill up
    assert view.sample_for(peers, MODEL, NOW, 3)[0] in servers
    unnamed = [view.sample_for(peers, None, NOW, 8) for _ in range(300)]
    assert set().union(*unnamed) == set(peers)  # a plain random sample: every peer can be asked
    assert any(not servers <= set(s) for s in unnamed)
    assert view.sample_for([], MODEL, NOW) == [] and view.sample_for(peers, MODEL, NOW, 0) == []
    assert len(view.sample_for(peers, MODEL, NOW)) == view_module.VIEW_SAMPLE == 8
