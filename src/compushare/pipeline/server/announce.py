"""Keeps a provider's DHT entries fresh: its signed server record (own expiry,
increasing seq) and provider records for the model key and each block it holds.
The DHT stays the source of truth for short-lived clients; gossip ads add live load.
When the node stops, the loop stops and the record lapses within its TTL."""

from __future__ import annotations

import logging
import time

import trio
from libp2p.abc import IHost
from libp2p.crypto.keys import KeyPair
from libp2p.kad_dht.kad_dht import KadDHT

from ...net.dht import block_key, model_key, provide_all, should_provide, sync_routing_table
from ...net.host import advertised_addrs
from ...net.records import MAX_ADDRS, ServerRecord, record_key
from .provider import Provider

log = logging.getLogger(__name__)


def build_record(host: IHost, model_id: str, start: int, end: int, dtype: str, ttl_s: float,
                 throughput: float = 0.0, fmt: str = "") -> ServerRecord:
    return ServerRecord(
        peer_id=host.get_id().to_string(),
        model_id=model_id,
        start=start,
        end=end,
        dtype=dtype,
        addrs=tuple(advertised_addrs(host))[:MAX_ADDRS],  # loopback sorts last: dropped first
        expires=time.time() + ttl_s,
        seq=time.time_ns(),
        throughput=throughput,
        fmt=fmt,
    )


# A look-up and k stores per key; other nodes keep a provider record 30 minutes
# (net/store_bounds.PROVIDER_TTL_CAP_S), three of these periods.
PROVIDE_INTERVAL_S = 600.0


async def announce_loop(host: IHost, dht: KadDHT, key_pair: KeyPair, provider: Provider, ttl_s: float, *,
                        task_status=trio.TASK_STATUS_IGNORED) -> None:
    """Re-put the server record every TTL/3, and at once when the provider's span
    changes. Provider records (which py-libp2p keeps 24 h) are re-sent when the span
    changed, when a small routing table gained peers that have not had them
    (net/dht.should_provide), or every PROVIDE_INTERVAL_S: a full re-provide is a
    lookup per key, and running it every few seconds steals CPU from inference on
    small machines."""
    model_id = provider.model.model_id
    provided: tuple = ((), frozenset())  # (keys, peers they went to)
    last_provide = -PROVIDE_INTERVAL_S
    started = False
    while True:
        span = provider.span
        changed = provider.changed
        if span is None or provider.state != "serving":  # the DHT learns only of loaded spans
            await changed.wait()
            continue
        record = build_record(host, model_id, span.start, span.end, provider.dtype, ttl_s,
                              throughput=provider.span_throughput(), fmt=provider.advertised_format)
        keys = [model_key(model_id)] + [block_key(model_id, b) for b in range(span.start, span.end)]
        try:
            with trio.fail_after(ttl_s / 3):
                await sync_routing_table(host, dht)
                await dht.put_value(record_key(record.model_id, record.peer_id), record.sign(key_pair))
                peers = frozenset(dht.routing_table.get_peer_ids())
                due = trio.current_time() - last_provide > PROVIDE_INTERVAL_S
                if should_provide(tuple(keys), peers, provided[0], provided[1], due=due):
                    await provide_all(dht, keys)
                    provided, last_provide = (tuple(keys), peers), trio.current_time()
        except trio.TooSlowError:
            log.warning("announcing took longer than %.0fs; retrying", ttl_s / 3)
        if not started:
            task_status.started(record)
            started = True
        with trio.move_on_after(ttl_s / 3):
            await changed.wait()
