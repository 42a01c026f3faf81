"""The consumer's DHT look-ups: which servers hold which blocks of a model.

One look-up of the model's provider key usually finds every server; only blocks
it leaves uncovered are looked up by their own keys, all concurrently. Server
records are then fetched concurrently and checked (signature, schema, expiry).
"""

from __future__ import annotations

import logging
import time

import trio
from libp2p.kad_dht.kad_dht import KadDHT

from ...net.dht import block_key, find_providers_fresh, get_record_fresh, model_key
from ...net.records import ServerRecord
from .routing import uncovered_blocks

log = logging.getLogger(__name__)


async def _fetch_records(dht: KadDHT, model_id: str, peers: set[str]) -> list[ServerRecord]:
    records: list[ServerRecord] = []

    async def fetch(peer: str) -> None:
        record = await get_record_fresh(dht, model_id, peer)
        if record is not None:
            records.append(record)

    async with trio.open_nursery() as nursery:
        for peer in peers:
            nursery.start_soon(fetch, peer)
    return records


async def discover_servers(dht: KadDHT, model_id: str, num_blocks: int) -> list[ServerRecord]:
    began = time.perf_counter()
    peers = {p.to_string() for p in await find_providers_fresh(dht, model_key(model_id))}
    records = await _fetch_records(dht, model_id, peers)
    missing = uncovered_blocks(records, num_blocks, time.time())
    if missing:
        more: set[str] = set()

        async def lookup(block: int) -> None:
            more.update(p.to_string() for p in await find_providers_fresh(dht, block_key(model_id, block)))

        async with trio.open_nursery() as nursery:
            for block in missing:
                nursery.start_soon(lookup, block)
        records += await _fetch_records(dht, model_id, more - peers)
    log.info("discovered %d servers of %s in %.2fs", len(records), model_id[:12], time.perf_counter() - began)
    return records
