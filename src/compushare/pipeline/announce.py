"""Keeps a provider's DHT entries fresh: its signed server record (own expiry,
increasing seq) and provider records for the model key and each block it holds.
When the node stops, the loop stops and the record lapses within its TTL."""

from __future__ import annotations

import logging
import time

import trio
from libp2p.abc import IHost
from libp2p.crypto.keys import KeyPair
from libp2p.kad_dht.kad_dht import KadDHT

from ..net.dht import block_key, model_key, provide_all, sync_routing_table
from ..net.host import full_addrs
from ..net.records import MAX_ADDRS, ServerRecord, record_key

log = logging.getLogger(__name__)


def build_record(host: IHost, model_id: str, start: int, end: int, dtype: str, ttl_s: float,
                 throughput: float = 0.0) -> ServerRecord:
    return ServerRecord(
        peer_id=host.get_id().to_string(),
        model_id=model_id,
        start=start,
        end=end,
        dtype=dtype,
        addrs=tuple(full_addrs(host))[:MAX_ADDRS],  # loopback sorts last: dropped first
        expires=time.time() + ttl_s,
        seq=time.time_ns(),
        throughput=throughput,
    )


PROVIDE_INTERVAL_S = 300.0


async def announce_loop(host: IHost, dht: KadDHT, key_pair: KeyPair, model_id: str, start: int, end: int,
                        dtype: str, ttl_s: float, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
    """Re-put the server record every TTL/3. Provider records (which py-libp2p keeps
    24 h) are re-sent only when the routing table gained peers that have not had
    them, or every PROVIDE_INTERVAL_S: a full re-provide is a lookup per key, and
    running it every few seconds steals CPU from inference on small machines."""
    keys = [model_key(model_id)] + [block_key(model_id, b) for b in range(start, end)]
    provided_to: set = set()
    last_provide = -PROVIDE_INTERVAL_S
    started = False
    while True:
        record = build_record(host, model_id, start, end, dtype, ttl_s)
        try:
            with trio.fail_after(ttl_s / 3):
                await sync_routing_table(host, dht)
                await dht.put_value(record_key(record.model_id, record.peer_id), record.sign(key_pair))
                peers = set(dht.routing_table.get_peer_ids())
                if peers - provided_to or trio.current_time() - last_provide > PROVIDE_INTERVAL_S:
                    await provide_all(dht, keys)
                    provided_to, last_provide = peers, trio.current_time()
        except trio.TooSlowError:
            log.warning("announcing took longer than %.0fs; retrying", ttl_s / 3)
        if not started:
            task_status.started(record)
            started = True
        await trio.sleep(ttl_s / 3)
