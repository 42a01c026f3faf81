"""net/gossip.py's topics per model (issue 40): the period it publishes at follows the
size of its topics, a consumer's follow is idempotent, and a neighbour still on
revision 20's one topic is named once in the log; the router sends IHAVE to a fixed
number of peers (revision 23)."""

from __future__ import annotations

import logging
import time
from types import SimpleNamespace

from libp2p.crypto.ed25519 import create_new_key_pair
from libp2p.peer.id import ID
from libp2p.pubsub.gossipsub import PROTOCOL_ID_V11, GossipSub
from libp2p.pubsub.pb import rpc_pb2

from compushare import wire
from compushare.hardware import Hardware
from compushare.net.ad_intake import GOSSIP_LAZY, HEARTBEAT_S, MESH_DEGREE, TARGET_ADS_PER_S
from compushare.net.ads import CapabilityAd, Serving
from compushare.net.gossip import Gossip, make_router, note_legacy_peers
from compushare.net.view import SwarmView

HW = Hardware(cpu_cores=2, ram_mb=24000, ram_free_mb=20000, gpu=None, gpu_mb=0)
MODEL, OTHER = "ab" * 32, "cd" * 32


def _view_with(providers: dict[str, int]) -> SwarmView:
    view, now = SwarmView(policy=False), time.time()
    for model, count in providers.items():
        for _ in range(count):
            peer = ID.from_pubkey(create_new_key_pair().public_key).to_base58()
            span = Serving(model, 0, 2, "float32", free_tokens=1, load=0.0, block_rate=1.0)
            view.offer(CapabilityAd(peer, (), HW, (span,), "0.1.0", seq=1, sent=now, expires=now + 60), now)
    return view


def test_the_period_follows_the_largest_topic_published_on():
    gossip = Gossip(None, _view_with({MODEL: 40, OTHER: 4}), period_s=5.0)
    assert gossip.stretch_period() == 5.0  # nothing published yet: the base
    gossip._serves = [OTHER]
    assert gossip.stretch_period() == 5.0
    gossip._serves = [OTHER, MODEL]
    assert gossip.stretch_period() == 40 / TARGET_ADS_PER_S == gossip.period_now


def test_follow_is_idempotent():
    gossip = Gossip(None, SwarmView(), models=(MODEL,))
    gossip.follow(MODEL)
    assert not gossip._follow_now.is_set()
    gossip.follow(OTHER)
    assert gossip._follow_now.is_set() and list(gossip._wanted) == [MODEL, OTHER]


def test_a_neighbour_on_the_old_topic_is_named_once(caplog):
    old = ID.from_pubkey(create_new_key_pair().public_key)
    pubsub, noted = SimpleNamespace(peer_topics={wire.AD_TOPIC_V1: {old}}), set()
    with caplog.at_level(logging.WARNING, logger="compushare.net.gossip"):
        note_legacy_peers(pubsub, noted)
        note_legacy_peers(pubsub, noted)
    warnings = [r for r in caplog.records if wire.AD_TOPIC_V1 in r.getMessage()]
    assert len(warnings) == 1 and str(old) in warnings[0].getMessage()


def _ihave_sent_at_a_heartbeat(router: GossipSub, connected: int) -> set:
    """The peers `router`'s heartbeat sends IHAVE to (py-libp2p 0.8.1) on a topic with
    `connected` peers, the first D of them its mesh, and a message in the gossip window."""
    peers = [f"p{i}" for i in range(connected)]
    router.pubsub = SimpleNamespace(peer_topics={"t": set(peers)})
    router.peer_protocol = dict.fromkeys(peers, PROTOCOL_ID_V11)
    router.mesh = {"t": set(peers[:MESH_DEGREE[0]])}
    router.mcache.put(rpc_pb2.Message(from_id=b"a", seqno=b"1", topicIDs=["t"]))
    sent = set(router.gossip_heartbeat())
    assert not sent & router.mesh["t"]  # IHAVE goes outside the mesh only
    return sent


def test_the_router_sends_ihave_to_gossip_lazy_peers_however_many_are_connected():
    router = make_router()
    assert (router.degree, router.degree_low, router.degree_high) == MESH_DEGREE
    assert router.heartbeat_interval == HEARTBEAT_S and not router.adaptive_gossip_enabled
    assert GOSSIP_LAZY == 6
    assert all(router._get_adaptive_gossip_peers_count("t", n) == GOSSIP_LAZY for n in range(401))
    # the heartbeat asks it: min(outside the mesh, 6), flat from 12 topic peers on
    for connected, ihave in ((3, 0), (9, 3), (12, 6), (49, 6), (300, 6)):
        assert len(_ihave_sent_at_a_heartbeat(make_router(), connected)) == ihave, connected
    # py-libp2p's own rule, max(6, ⌊M/4⌋) of the M = 294 outside the mesh: it grew with N
    stock = GossipSub(protocols=[PROTOCOL_ID_V11], degree=6, degree_low=4, degree_high=12,
                      heartbeat_interval=HEARTBEAT_S, adaptive_gossip_enabled=False)
    assert len(_ihave_sent_at_a_heartbeat(stock, 300)) == 73
