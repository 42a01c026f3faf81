"""The consumer's look-ups: which servers hold which blocks of a model (the DHT), and
which model the swarm serves under a name (ads, with karma as evidence).

One look-up of the model's provider key usually finds every server; only blocks
it leaves uncovered are looked up by their own keys, all concurrently. Server
records are then fetched concurrently and checked (signature, schema, expiry).
"""

from __future__ import annotations

import logging
import random
import time

import trio
from libp2p.kad_dht.kad_dht import KadDHT

from ...karma.service import KarmaBook
from ...net.dht import block_key, find_providers_fresh, get_record_fresh, model_key
from ...net.gossip import learn_views
from ...net.records import ServerRecord
from ...net.view import SwarmView
from .names import NameCandidate, choose_candidate, name_candidates
from .routing import uncovered_blocks

log = logging.getLogger(__name__)

KARMA_LOOKUP_S = 10.0  # one round of karma look-ups
MAX_NAME_PROVIDERS = 64  # karma looked up for at most this many providers of a name


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


def peer_ids_of(addrs) -> list[str]:
    """The peer ids named by `/p2p/<id>` multiaddrs."""
    return [addr.rsplit("/p2p/", 1)[1] for addr in addrs if "/p2p/" in addr]


async def name_from_swarm(host, dht, name: str, *, trusted: list[str] = ()) -> NameCandidate | None:
    """The model id the swarm serves under `name`, counting only providers with
    evidence (pipeline/client/names.py): the `trusted` peers (the bootstrap peers the
    user gave: a connection anyone can open is no evidence) and providers whose karma
    is above a newcomer's (looked up for at most MAX_NAME_PROVIDERS of them, chosen at
    random so ground ids cannot crowd others out). None when no server names it at all;
    an error when some do but none has evidence."""
    view = SwarmView()
    view.set_self(host.get_id().to_string())
    await learn_views(host, view)
    now = time.time()
    view.note_connected(trusted, now)
    providers = sorted({ad.peer_id for ad in view.live(now) for s in ad.serving if s.name == name})
    if not providers:
        return None
    karma = KarmaBook()
    sample = random.sample(providers, min(len(providers), MAX_NAME_PROVIDERS))
    with trio.move_on_after(KARMA_LOOKUP_S):
        await karma.refresh(host, dht, sample, timeout_s=KARMA_LOOKUP_S)
    view.note_karma([p for p in providers if (karma.known(p) or 0.0) > 1.0], time.time())
    candidates = name_candidates(view, name, time.time())
    chosen = choose_candidate(name, candidates)
    if len(candidates) > 1:
        log.warning("%d models are served as %r: using %s. Others: %s", len(candidates), name, chosen.describe(),
                    "; ".join(c.describe() for c in candidates[1:4]))
    else:
        log.info("%r is %s", name, chosen.describe())
    return chosen
