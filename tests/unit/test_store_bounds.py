"""The DHT store bounds (net/store_bounds.py), and their wiring into py-libp2p's
stores (net/dht._bound_stores) without a network."""

from __future__ import annotations

import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from compushare.net import store_bounds
from compushare.net.store_bounds import (PROVIDER_BOUNDS, VALUE_BOUNDS, Bounds, BoundedStore, provider_size,
                                         publisher_of, value_size)

ME = "me"
SMALL = Bounds(budget=10_000, per_publisher_count=4, per_publisher_size=4_000, per_sender_count=6,
               per_sender_size=6_000, ttl_cap_s=100.0)


def check(store: BoundedStore) -> None:
    """Every internal total agrees with the entries, and every bound holds."""
    entries = store._entries
    assert store.total == sum(e.size for e in entries.values())
    assert store.total <= max(store.bounds.budget, store.own_size())
    publishers: dict = {}
    senders: dict = {}
    holders: dict = {}
    for key, e in entries.items():
        publishers.setdefault(e.publisher, []).append(e.size)
        if e.foreign_sender is not None:
            senders.setdefault(e.foreign_sender, []).append(e.size)
        if e.holder is not None:
            holders.setdefault(e.holder, set()).add(key)
    for p, sizes in publishers.items():
        assert store.publisher_count(p) == len(sizes) and store.publisher_size(p) == sum(sizes)
        if p != ME:
            assert len(sizes) <= store.bounds.per_publisher_count
            assert sum(sizes) <= store.bounds.per_publisher_size
    for s, sizes in senders.items():
        assert store.sender_count(s) == len(sizes) and store.sender_size(s) == sum(sizes)
        assert len(sizes) <= store.bounds.per_sender_count and sum(sizes) <= store.bounds.per_sender_size
    assert {h: set(k) for h, k in store._holder_keys.items()} == holders
    assert {n: hs for n, hs in store._by_count.items()} == _buckets(holders)
    assert store._max_count == max((len(k) for k in holders.values()), default=0)


def _buckets(holders: dict) -> dict:
    out: dict = {}
    for h, keys in holders.items():
        out.setdefault(len(keys), set()).add(h)
    return out


def test_publisher_is_the_key_named_signer():
    assert publisher_of(b"/csserver/abc/12D3Koo") == "12D3Koo"
    assert publisher_of(b"/cskarma/12D3Koo") == "12D3Koo"


def test_sizes_charge_what_py_libp2p_spends_per_entry():
    assert value_size(b"k" * 10, b"v" * 100) == 110 + store_bounds.ENTRY_OVERHEAD_BYTES
    assert provider_size([b"a" * 10]) > store_bounds.PROVIDER_ENTRY_OVERHEAD_BYTES + 10


def test_the_budgets_keep_py_libp2p_own_eviction_out_of_reach():
    # py-libp2p evicts its oldest record at 50,000 (whoever's): our budget fills long before.
    assert VALUE_BOUNDS.budget // store_bounds.ENTRY_OVERHEAD_BYTES < 50_000
    assert VALUE_BOUNDS.ttl_cap_s <= 3600 and PROVIDER_BOUNDS.ttl_cap_s <= 3600


def test_a_sybil_flood_from_one_sender_stores_at_most_its_cap():
    store = BoundedStore(VALUE_BOUNDS, own=ME)
    stored = sum(store.admit(f"/csserver/m/sybil{i}".encode(), publisher=f"sybil{i}", sender="attacker",
                             size=3_000, now=0.0, expires=1e9).accepted for i in range(5_000))
    assert stored == VALUE_BOUNDS.per_sender_count
    assert store.total <= VALUE_BOUNDS.per_sender_size
    check(store)


def test_fresh_identities_cannot_push_out_established_records_and_refreshes_always_land():
    store = BoundedStore(SMALL, own=ME)
    assert store.admit("honest", publisher="h", sender="h", size=1_000, now=0.0).accepted
    assert store.admit("mine", publisher=ME, sender=None, size=1_000, now=0.0).accepted
    refused = 0
    for i in range(100):  # each Sybil its own publisher and sender: one record each
        refused += not store.admit(f"s{i}", publisher=f"s{i}", sender=f"s{i}", size=1_000, now=1.0).accepted
    assert refused == 100 - 8 and store.total == 10_000
    assert "honest" in store and "mine" in store
    # The honest publisher refreshes its record (a little larger) while the store is full.
    again = store.admit("honest", publisher="h", sender="h", size=1_100, now=2.0)
    assert again.accepted and len(again.evict) == 1 and "honest" in store
    check(store)


def test_a_newcomer_evens_out_the_holder_holding_most():
    store = BoundedStore(SMALL, own=ME)
    for i in range(6):  # one sender's third-party records: 6 x 1,000
        assert store.admit(f"via{i}", publisher=f"p{i}", sender="relay", size=1_000, now=float(i)).accepted
    for i in range(4):
        assert store.admit(f"a{i}", publisher="a", sender="a", size=1_000, now=10.0).accepted
    assert store.total == 10_000
    first = store.admit("n0", publisher="n", sender="n", size=1_000, now=11.0)
    assert first.accepted and first.evict == ("via0",)  # the oldest of the relay's
    # The relay and publisher a then hold 5 and 4; the newcomer holds 1.
    for i in range(1, 3):
        assert store.admit(f"n{i}", publisher="n", sender="n", size=1_000, now=12.0).accepted
    assert sorted([store.sender_count("relay"), store.publisher_count("a")]) == [3, 4]  # a tie: either
    # Now n holds 3: the next newcomer of n may only take from a holder of more than 4.
    assert not store.admit("n3", publisher="n", sender="n", size=1_000, now=13.0).accepted
    check(store)


def test_a_refused_refresh_keeps_the_old_record():
    store = BoundedStore(SMALL, own=ME)
    for i in range(4):
        assert store.admit(f"k{i}", publisher="p", sender="p", size=900, now=0.0).accepted
    refused = store.admit("k0", publisher="p", sender="p", size=2_000, now=1.0)  # 4,000 per publisher at most
    assert not refused.accepted and "k0" in store and store.publisher_size("p") == 3_600
    check(store)


def test_our_own_records_are_taken_when_full_and_never_evicted():
    store = BoundedStore(SMALL, own=ME)
    for i in range(10):
        assert store.admit(f"x{i}", publisher=f"x{i}", sender=f"x{i}", size=1_000, now=0.0).accepted
    mine = store.admit("mine", publisher=ME, sender=None, size=3_000, now=1.0)
    assert mine.accepted and len(mine.evict) == 3 and store.total == 10_000
    for i in range(20):
        store.admit(f"y{i}", publisher=f"y{i}", sender=f"y{i}", size=1_000, now=2.0)
    assert "mine" in store
    check(store)


def test_entries_live_until_their_own_expiry_or_the_cap():
    store = BoundedStore(SMALL, own=ME)
    long = store.admit("long", publisher="p", sender="p", size=100, now=0.0, expires=1e9)
    short = store.admit("short", publisher="q", sender="q", size=100, now=0.0, expires=10.0)
    assert long.expires == 100.0 and short.expires == 10.0
    assert store.admit("ours", publisher=ME, sender=None, size=100, now=0.0, expires=1e4).expires == 1e4
    assert not store.admit("past", publisher="r", sender="r", size=100, now=0.0, expires=-1.0).accepted
    assert store.expire(50.0) == ["short"]
    later = store.admit("z", publisher="z", sender="z", size=100, now=100.0)
    assert "long" in later.evict and "long" not in store
    check(store)


def test_refreshes_do_not_grow_the_expiry_heap_without_bound():
    store = BoundedStore(SMALL, own=ME)
    for t in range(10_000):
        store.admit("k", publisher="p", sender="p", size=100, now=float(t) / 1000, expires=1e9)
    assert len(store._expiry) <= 2 * len(store) + 65


def test_providers_are_bounded_per_provider():
    store = BoundedStore(PROVIDER_BOUNDS, own=ME)
    size = provider_size([b"\x04" * 8])
    taken = sum(store.admit((bytes([i % 256, i // 256]), "p"), publisher="p", sender="p", size=size,
                            now=0.0).accepted for i in range(1_000))
    assert taken == PROVIDER_BOUNDS.per_publisher_count
    check(store)


PUBLISHERS = [ME, "a", "b", "c", "d", "e"]
SENDERS = [None, ME, "a", "b", "x", "y"]


@st.composite
def operations(draw):
    kind = draw(st.sampled_from(["admit", "admit", "admit", "remove", "tick"]))
    return (kind, draw(st.integers(0, 15)), draw(st.sampled_from(PUBLISHERS)), draw(st.sampled_from(SENDERS)),
            draw(st.integers(1, 3_000)), draw(st.one_of(st.none(), st.floats(-10, 500))), draw(st.floats(0, 40)))


@settings(max_examples=300)
@given(st.lists(operations(), max_size=80))
def test_any_sequence_of_puts_keeps_every_bound_and_our_own_records(ops):
    store = BoundedStore(SMALL, own=ME)
    now = 0.0
    own_live: dict = {}  # our keys -> expiry: must stay until then (or our own removal)
    for kind, k, publisher, sender, size, expires, dt in ops:
        key = f"/ns/{publisher}/{k}"
        if kind == "tick":
            now += dt
            for gone in store.expire(now):
                assert own_live.pop(gone, now) <= now  # only at their expiry
        elif kind == "remove":
            store.remove(key)
            own_live.pop(key, None)
        else:
            decision = store.admit(key, publisher=publisher, sender=sender, size=min(size, 1_000) if
                                   publisher == ME else size, now=now, expires=expires)
            for gone in decision.evict:
                assert own_live.pop(gone, now) <= now
            if decision.accepted:
                assert decision.expires <= (now + SMALL.ttl_cap_s if publisher != ME or expires is None
                                            else expires)
                assert key in store
                if publisher == ME:
                    own_live[key] = decision.expires
            elif publisher == ME:
                assert expires is not None and expires <= now  # ours are refused only if already dead
        check(store)
        for key, until in own_live.items():
            assert until <= now or key in store


# -- the wiring into py-libp2p (net/dht._bound_stores), without a network -------------

@pytest.fixture
def bounded_dht():
    from libp2p.crypto.ed25519 import create_new_key_pair
    from libp2p.kad_dht.kad_dht import DHTMode, KadDHT

    from compushare.net import libp2p_patches
    from compushare.net.dht import _bound_stores
    from compushare.net.host import build_host

    libp2p_patches.apply()
    dht = KadDHT(build_host(create_new_key_pair()), DHTMode.SERVER)
    values, providers = _bound_stores(dht)
    return dht, values, providers


def _server_record(model: str = "m" * 8, *, expires_in: float = 86_400.0):
    from libp2p.crypto.ed25519 import create_new_key_pair
    from libp2p.kad_dht.pb.kademlia_pb2 import Record
    from libp2p.peer.id import ID

    from compushare.net.records import ServerRecord, record_key

    key_pair = create_new_key_pair()
    peer = ID.from_pubkey(key_pair.public_key).to_base58()
    value = ServerRecord(peer, model, 0, 1, "float32", (), time.time() + expires_in, 1).sign(key_pair)
    key = record_key(model, peer).encode()
    return key, Record(key=key, value=value), peer


def test_a_peers_puts_are_refused_over_its_cap_and_capped_in_time(bounded_dht):
    from compushare.net.dht import _SENDER, StoreRefused

    dht, values, _ = bounded_dht
    token = _SENDER.set("attacker")
    try:
        for _ in range(VALUE_BOUNDS.per_sender_count):
            key, record, _ = _server_record()
            dht.value_store.put_record(key, record)
            assert dht.value_store.store[key][1] <= time.time() + VALUE_BOUNDS.ttl_cap_s
        key, record, _ = _server_record()
        with pytest.raises(StoreRefused):
            dht.value_store.put_record(key, record)
    finally:
        _SENDER.reset(token)
    assert len(dht.value_store.store) == len(values) == VALUE_BOUNDS.per_sender_count
    # A record's own expiry comes first when sooner; removal is accounted.
    key, record, _ = _server_record(expires_in=60.0)
    dht.value_store.put_record(key, record)  # our own look-up's cache (no sender)
    assert dht.value_store.store[key][1] <= time.time() + 60.0
    assert dht.value_store.remove(key) and key not in values


def test_provider_entries_keep_8_addresses_and_expire_at_the_cap(bounded_dht, monkeypatch):
    import multiaddr
    from libp2p.peer.peerinfo import PeerInfo

    dht, _, providers = bounded_dht
    peer = _server_record()[2]
    from libp2p.peer.id import ID

    addrs = [multiaddr.Multiaddr(f"/ip4/10.0.0.{i}/tcp/4001") for i in range(50)]
    dht.provider_store.add_provider(b"k" * 32, PeerInfo(ID.from_base58(peer), addrs))
    assert [len(i.addrs) for i in dht.provider_store.get_providers(b"k" * 32)] == [8]
    later = time.time() + PROVIDER_BOUNDS.ttl_cap_s + 1
    monkeypatch.setattr(time, "time", lambda: later)
    assert dht.provider_store.get_providers(b"k" * 32) == [] and len(providers) == 0
