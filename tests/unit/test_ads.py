"""net/ads.py and net/view.py: signed capability ads and the swarm view they feed."""

from __future__ import annotations

import dataclasses

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from libp2p.crypto.ed25519 import create_new_key_pair
from libp2p.peer.id import ID

from compushare.errors import PeerMisbehaved
from compushare.hardware import Hardware
from compushare.net.ads import (
    AD_TTL_S,
    MAX_AD_BYTES,
    MAX_AD_TTL_S,
    MAX_SERVING,
    CapabilityAd,
    Serving,
    make_ad,
    parse_ad,
)
from compushare.net.view import SwarmView, coverage, relay_candidates

MODEL = "ab" * 32
NOW = 1_700_000_000.0
HW = Hardware(cpu_cores=2, ram_mb=24000, ram_free_mb=20000, gpu=None, gpu_mb=0)


def keypair(n: int):
    return create_new_key_pair(bytes([n]) * 32)


def peer_of(kp) -> str:
    return ID.from_pubkey(kp.public_key).to_base58()


ALICE, BOB = keypair(1), keypair(2)
SPAN = Serving(MODEL, 0, 10, "float32", free_tokens=8192, load=0.25, block_rate=40.0)


def ad(kp=ALICE, *, serving=(SPAN,), now=NOW, ttl=AD_TTL_S, **changes) -> CapabilityAd:
    made = make_ad(kp, peer_of(kp), ["/ip4/127.0.0.1/tcp/4001"], HW, list(serving), "0.1.0", now=now, ttl_s=ttl)
    if changes:
        made = dataclasses.replace(made, **changes)
        made = dataclasses.replace(made, raw=made.sign(kp))
    return made


def body_of(raw: bytes) -> dict:
    return msgpack.unpackb(msgpack.unpackb(raw)["body"])


def seal(kp, body: dict) -> bytes:
    raw = msgpack.packb(body, use_bin_type=True)
    return msgpack.packb({"body": raw, "sig": kp.private_key.sign(raw)}, use_bin_type=True)


def rejected(value: bytes, sender: str | None = None, now: float = NOW + 1) -> str:
    with pytest.raises(PeerMisbehaved) as info:
        parse_ad(value, sender=sender if sender is not None else peer_of(ALICE), now=now)
    return str(info.value)


def test_round_trip():
    made = ad()
    parsed = parse_ad(made.raw, sender=peer_of(ALICE), now=NOW + 1)
    assert parsed == made
    assert parsed.serving_of(MODEL) == [SPAN] and parsed.serving_of("cd" * 32) == []
    assert SPAN.step_s(10) == pytest.approx(0.25) and dataclasses.replace(SPAN, block_rate=0).step_s(3) is None


def test_the_runtime_and_its_build_ride_the_ad_and_an_older_entry_without_them_still_parses():
    serving = dataclasses.replace(SPAN, runtime="ggml/0.25.3:1f2e3d4c")
    made = ad(serving=(serving,))
    assert parse_ad(made.raw, sender=peer_of(ALICE), now=NOW + 1).serving_of(MODEL) == [serving]
    assert "rt" not in SPAN.to_wire() and parse_ad(ad().raw, sender=peer_of(ALICE), now=NOW + 1).serving[0].runtime == ""
    for bad in ("", "ggml 0.15", "x" * 65):
        body = body_of(made.raw)
        body["serves"] = [serving.to_wire() | {"rt": bad}]
        assert "runtime" in rejected(seal(ALICE, body))


def test_reachability_rides_the_ad_and_an_older_ad_without_it_still_parses():
    made = ad(reach="public", relay=True)
    parsed = parse_ad(made.raw, sender=peer_of(ALICE), now=NOW + 1)
    assert (parsed.reach, parsed.relay) == ("public", True)
    old = body_of(made.raw)
    del old["net"]  # revision 13's ads
    parsed = parse_ad(seal(ALICE, old), sender=peer_of(ALICE), now=NOW + 1)
    assert (parsed.reach, parsed.relay) == ("unknown", False)


def test_relay_candidates_are_public_relaying_peers_with_their_direct_addresses():
    view = SwarmView()
    relay = ad(BOB, reach="public", relay=True,
               addrs=("/ip4/10.0.0.2/tcp/1", f"/ip4/10.0.0.3/tcp/1/p2p/{peer_of(ALICE)}/p2p-circuit/p2p/x"))
    natd = ad(keypair(3), reach="private", relay=False)
    not_relaying = ad(keypair(4), reach="public", relay=False)
    for made in (relay, natd, not_relaying, ad(ALICE, reach="public", relay=True)):
        assert view.offer(made, now=NOW + 1).accepted
    found = relay_candidates(view, me=peer_of(ALICE), now=NOW + 1)
    assert [(c.peer_id, c.addrs) for c in found] == [(peer_of(BOB), ("/ip4/10.0.0.2/tcp/1",))]


def test_relayed_ad_is_checked_against_its_own_peer():
    assert parse_ad(ad().raw, sender=None, now=NOW + 1).peer_id == peer_of(ALICE)


def test_forged_ad_signed_by_another_key_is_rejected():
    body = body_of(ad().raw)  # claims to be Alice
    forged = seal(BOB, body)
    assert "signature does not match" in rejected(forged)
    with pytest.raises(PeerMisbehaved, match="signature does not match"):
        parse_ad(forged, sender=None, now=NOW + 1)


def test_ad_from_another_sender_is_rejected():
    # Bob relays Alice's genuine ad as if it were his own publication.
    assert "signature does not match" in rejected(ad().raw, sender=peer_of(BOB))
    # Bob signs an ad naming Alice: the body's peer is not the signer.
    body = body_of(ad(BOB).raw) | {"peer": peer_of(ALICE)}
    assert "signed by" in rejected(seal(BOB, body), sender=peer_of(BOB))


def test_oversized_ad_is_rejected_before_its_signature_is_checked():
    big = ad(addrs=tuple(f"/ip4/10.0.0.{i}/tcp/{'9' * 200}" for i in range(8)))
    padded = seal(ALICE, body_of(big.raw) | {"sw": "x" * MAX_AD_BYTES})
    assert "exceeds" in rejected(padded)


def test_expired_future_and_overlong_ads_are_rejected():
    assert "expired" in rejected(ad().raw, now=NOW + AD_TTL_S + 1)
    assert "future" in rejected(ad(now=NOW + 3600).raw)
    assert "lifetime" in rejected(ad(ttl=MAX_AD_TTL_S + 1).raw)
    assert "lifetime" in rejected(ad(ttl=-1).raw, now=NOW - 5)


@pytest.mark.parametrize("change, message", [
    ({"v": 2}, "version"),
    ({"extra": 1}, "exactly"),
    ({"addrs": "x"}, "addrs"),
    ({"addrs": ["a"] * 9}, "addrs"),
    ({"hw": {"cpu": 2}}, "hardware"),
    ({"seq": True}, "seq"),
    ({"sent": float("nan")}, "sent"),
    ({"serves": [SPAN.to_wire()] * (MAX_SERVING + 1)}, "more than"),
    ({"serves": [SPAN.to_wire() | {"start": 5, "end": 5}]}, "span"),
    ({"serves": [SPAN.to_wire() | {"model": "M" * 64}]}, "hex"),
    ({"serves": [SPAN.to_wire() | {"dtype": "int8"}]}, "dtype"),
    ({"serves": [SPAN.to_wire() | {"state": "lying"}]}, "state"),
    ({"serves": [SPAN.to_wire() | {"load": 1.5}]}, "load"),
    ({"serves": [SPAN.to_wire() | {"rate": float("inf")}]}, "rate"),
    ({"serves": [SPAN.to_wire() | {"free": -1}]}, "free"),
    ({"serves": [SPAN.to_wire() | {"bonus": 1}]}, "exactly"),
    ({"serves": ["x"]}, "exactly"),
    ({"net": {"reach": "public"}}, "net"),
    ({"net": {"reach": "behind", "relay": False}}, "net"),
    ({"net": {"reach": "public", "relay": 1}}, "net"),
    ({"net": "public"}, "net"),
])
def test_malformed_ads_are_rejected(change, message):
    assert message in rejected(seal(ALICE, body_of(ad().raw) | change))


def test_non_map_bodies_and_garbage_are_rejected():
    raw = msgpack.packb([1, 2], use_bin_type=True)
    assert "map" in rejected(msgpack.packb({"body": raw, "sig": ALICE.private_key.sign(raw)}))
    assert "malformed" in rejected(b"\x00garbage")
    assert "bytes" in rejected("text")  # type: ignore[arg-type]


@settings(max_examples=300)
@given(st.binary(max_size=600))
def test_arbitrary_bytes_never_crash_the_parser(data):
    for sender in (peer_of(ALICE), None):
        with pytest.raises(PeerMisbehaved):
            parse_ad(data, sender=sender, now=NOW)


@settings(max_examples=200)
@given(st.dictionaries(st.sampled_from(["v", "peer", "addrs", "hw", "serves", "sw", "seq", "sent", "expires", "x"]),
                       st.one_of(st.none(), st.integers(-2**63, 2**64 - 1), st.floats(), st.text(max_size=8),
                                 st.binary(max_size=8),
                                 st.lists(st.integers(-5, 5), max_size=3)), max_size=10))
def test_arbitrary_signed_bodies_are_rejected_cleanly(body):
    with pytest.raises(PeerMisbehaved):
        parse_ad(seal(ALICE, body), sender=peer_of(ALICE), now=NOW)


# --------------------------------------------------------------------------- view


def test_view_keeps_the_newest_ad_and_forgets_expired_peers():
    view = SwarmView(min_interval_s=1.0)
    first = ad(now=NOW)
    assert view.offer(first, NOW).accepted
    second = ad(now=NOW + 2)
    assert view.offer(second, NOW + 2).accepted
    assert view.get(peer_of(ALICE), NOW + 2) == second
    other = ad(BOB, now=NOW + 2)
    assert view.offer(other, NOW + 2).accepted
    assert [a.peer_id for a in view.live(NOW + 3)] == sorted([peer_of(ALICE), peer_of(BOB)])
    assert view.expire(NOW + 1 + AD_TTL_S) == []
    assert sorted(view.expire(NOW + 2 + AD_TTL_S)) == sorted([peer_of(ALICE), peer_of(BOB)])
    assert view.live(NOW) == [] and view.get(peer_of(ALICE), NOW) is None


def test_view_refuses_replays_and_floods():
    view = SwarmView(min_interval_s=1.0)
    old, new = ad(now=NOW), ad(now=NOW + 0.5)
    assert view.offer(new, NOW + 0.5).accepted
    replay = view.offer(old, NOW + 3)
    assert not replay.accepted and "newer" in replay.reason
    flood = view.offer(ad(now=NOW + 0.6), NOW + 0.6)
    assert not flood.accepted and "faster" in flood.reason
    assert view.rejected == 2
    assert not view.offer(old, NOW + AD_TTL_S + 5).accepted  # expired


def test_relayed_ads_skip_the_rate_rule_but_not_seq():
    view = SwarmView(min_interval_s=10.0)
    first, second = ad(now=NOW), ad(now=NOW + 0.1)
    assert view.offer(first, NOW).accepted
    assert view.replace(second, NOW + 0.2)
    assert not view.replace(first, NOW + 0.3)


def test_coverage_counts_servers_per_block():
    view = SwarmView()
    view.offer(ad(ALICE, serving=(SPAN,)), NOW)
    view.offer(ad(BOB, serving=(dataclasses.replace(SPAN, start=5, end=12),)), NOW)
    servers = view.servers(MODEL, NOW + 1)
    assert coverage(servers, 12) == [1] * 5 + [2] * 5 + [1] * 2
    assert coverage(servers, 12, exclude=frozenset({peer_of(BOB)})) == [1] * 10 + [0] * 2
    assert view.models(NOW + 1) == {MODEL}
