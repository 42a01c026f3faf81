"""A Sybil flood of the DHT record store: 5,000 valid server records, each signed by a
fresh Ed25519 key, PUT_VALUE straight to a real node from one attacker host
(tools/hostile/sybil_records.py). With the store bounds (net/store_bounds.py) the
node stores at most one sender's share of them, its RSS barely moves, and the real
servers' records are still served; with COMPUSHARE_DISABLE_DEFENCES=dht_bounds it
stores all 5,000 (py-libp2p would keep 50,000 for 24 h).

Found by the hostile run: 4,000 such records cost a node about 23 KB each."""

from __future__ import annotations

import collections
import functools
import time

import trio
from libp2p.crypto.ed25519 import create_new_key_pair
from libp2p.kad_dht.common import PROTOCOL_ID as KAD_PROTOCOL
from libp2p.kad_dht.pb.kademlia_pb2 import Message
from libp2p.utils.varint import encode_uvarint, read_varint_prefixed_bytes_limited
from hostile.sybil_records import flood_records

from compushare.defences import ENV as DEFENCES_ENV
from compushare.net.dial import dial
from compushare.net.host import open_host
from compushare.net.records import parse_record, record_key
from compushare.net.store_bounds import VALUE_BOUNDS
from helpers import advance_to, vm_rss_mb

RECORDS = 5000
SETTLE_S = 3.0
RSS_BOUND_MB = 20.0  # records and all: what 5,000 refused puts may cost the node at most
RECORD_WAIT_S = 30.0
ANSWERS = ("sybil_records_stored", "sybil_records_refused", "sybil_records_timeout")



async def get_from(host, state: dict, key: str) -> bytes | None:
    """GET_VALUE `key` from that one node (no look-up elsewhere, no cache)."""
    info = await dial(host, state["peer_id"], state["addrs"], timeout=10)
    stream = await host.new_stream(info.peer_id, [KAD_PROTOCOL])
    try:
        payload = Message(type=Message.MessageType.GET_VALUE, key=key.encode()).SerializeToString()
        await stream.write(encode_uvarint(len(payload)) + payload)
        reply = Message()
        reply.ParseFromString(await read_varint_prefixed_bytes_limited(stream, 1 << 20))
        return reply.record.value if reply.HasField("record") and reply.record.value else None
    finally:
        await stream.close()


async def served_record(host, state: dict, owner: dict):
    """The owner's live server record as `state`'s node serves it, waiting for it to land."""
    key = record_key(owner["model_id"], owner["peer_id"])
    with trio.fail_after(RECORD_WAIT_S):
        while True:
            value = await get_from(host, state, key)
            if value is not None:
                return parse_record(key, value)
            await trio.sleep(0.5)


async def flood(state: dict, owners: list[dict]) -> tuple[collections.Counter, float, list]:
    """Flood the node; return the counts, its RSS growth (MB) and the owners' records it serves after."""
    counts: collections.Counter = collections.Counter()
    async with open_host(create_new_key_pair(), ["/ip4/127.0.0.1/tcp/0"]) as host:
        for owner in owners:
            await served_record(host, state, owner)
        await trio.sleep(SETTLE_S)
        before = vm_rss_mb(state["pid"])
        async with trio.open_nursery() as nursery:  # the flood's pace is the machine's: bound its stalls
            nursery.start_soon(functools.partial(flood_records, host, state, state["model_id"], counts,
                                                 records=RECORDS))
            await advance_to(lambda: sum(counts[k] for k in ANSWERS), RECORDS, "the Sybil records answered")
        await trio.sleep(SETTLE_S)
        grown = vm_rss_mb(state["pid"]) - before
        served = [await served_record(host, state, owner) for owner in owners]
    return counts, grown, served


def test_a_sybil_record_flood_is_bounded_and_real_records_are_still_served(processes, tiny_model, monkeypatch):
    monkeypatch.delenv(DEFENCES_ENV, raising=False)
    began = time.monotonic()
    _, a = processes.node("a", tiny_model, "0:2")
    _, b = processes.node("b", tiny_model, "2:4", bootstrap=a["addrs"][:1])
    counts, grown, served = trio.run(flood, a, [a, b])
    print(f"defence on: {dict(counts)}, RSS +{grown:.1f} MB in {time.monotonic() - began:.0f} s")
    assert counts["sybil_records"] == RECORDS
    assert counts["sybil_records_stored"] <= VALUE_BOUNDS.per_sender_count
    assert counts["sybil_records_refused"] >= RECORDS - VALUE_BOUNDS.per_sender_count
    assert grown <= RSS_BOUND_MB, f"RSS grew by {grown:.1f} MB under the flood"
    assert [r.peer_id for r in served] == [a["peer_id"], b["peer_id"]]  # both real records, live
    assert all(r.is_live() for r in served)

    # The defence off: every record is stored.
    monkeypatch.setenv(DEFENCES_ENV, "dht_bounds")
    _, c = processes.node("c", tiny_model, "0:4")
    counts_off, grown_off, _ = trio.run(flood, c, [c])
    print(f"defence off: {dict(counts_off)}, RSS +{grown_off:.1f} MB; total {time.monotonic() - began:.0f} s")
    assert counts_off["sybil_records_stored"] == RECORDS
    assert grown_off > grown
