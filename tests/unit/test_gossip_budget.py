"""net/gossip.py's budget for ads of peers not in the view: a flood of fresh keys
costs a node at most NEWCOMER_ADS_PER_S checks a second, while ads of peers in the
view are always checked."""

from __future__ import annotations

import time
from types import SimpleNamespace

import trio
import trio.testing
from libp2p.crypto.ed25519 import create_new_key_pair
from libp2p.peer.id import ID
from libp2p.pubsub.pb import rpc_pb2

from compushare.defences import ENV as DEFENCES_ENV
from compushare.hardware import Hardware
from compushare.net.ad_intake import AdIntake, ad_topic
from compushare.net.ads import CapabilityAd
from compushare.net.gossip import NEWCOMER_ADS_BURST, _guarded_push
from compushare.net.view import SwarmView

ME = ID.from_pubkey(create_new_key_pair().public_key)
MODEL = "ab" * 32
TOPICS = [ad_topic(MODEL)]
HW = Hardware(cpu_cores=2, ram_mb=24000, ram_free_mb=20000, gpu=None, gpu_mb=0)


def _flood(fresh: int, known_peer: ID, view: SwarmView) -> tuple[int, int]:
    """`fresh` ads of new keys then one of `known_peer`: (fresh ads checked, known ones checked)."""
    checked = []

    async def push(forwarder, msg) -> None:
        checked.append(msg.from_id)

    pubsub = SimpleNamespace(push_msg=push, my_id=ME)
    forwarder = ID.from_pubkey(create_new_key_pair().public_key)
    intake = AdIntake()
    intake.followed.add(MODEL)
    guarded = _guarded_push(pubsub, view, intake)

    async def main() -> None:
        for _ in range(fresh):
            await guarded(forwarder, rpc_pb2.Message(from_id=ID.from_pubkey(create_new_key_pair().public_key).to_bytes(),
                                                       topicIDs=TOPICS))
        await guarded(forwarder, rpc_pb2.Message(from_id=known_peer.to_bytes(), topicIDs=TOPICS))

    trio.run(main, clock=trio.testing.MockClock())  # time stands still: the burst, exactly
    return len(checked) - checked.count(known_peer.to_bytes()), checked.count(known_peer.to_bytes())


def _view_holding(peer: ID) -> SwarmView:
    view, now = SwarmView(), time.time()
    view.offer(CapabilityAd(peer.to_base58(), (), HW, (), "0.1.0", seq=1, sent=now, expires=now + 60), now)
    return view


def test_fresh_keys_get_the_budget_and_peers_in_view_always_get_checked():
    known = ID.from_pubkey(create_new_key_pair().public_key)
    view = _view_holding(known)
    fresh, checked_known = _flood(int(NEWCOMER_ADS_BURST) + 300, known, view)
    assert fresh == NEWCOMER_ADS_BURST
    assert view.newcomer_ads_dropped == int(NEWCOMER_ADS_BURST) + 300 - fresh
    assert checked_known == 1


def test_with_the_view_policy_off_every_ad_is_checked(monkeypatch):
    monkeypatch.setenv(DEFENCES_ENV, "view_policy")
    known = ID.from_pubkey(create_new_key_pair().public_key)
    fresh, _ = _flood(int(NEWCOMER_ADS_BURST) + 300, known, _view_holding(known))
    assert fresh == int(NEWCOMER_ADS_BURST) + 300
