"""A node's torrent role: seed every model it holds, find seeders, fetch pieces.

Seeders are found two ways, merged: DHT provider records under the model's seed
key (every node that holds pieces of a model provides it), and the capability ads
of the swarm view (a server holds the blocks it serves).
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import trio
from libp2p.abc import IHost
from libp2p.kad_dht.kad_dht import KadDHT
from libp2p.peer.peerinfo import PeerInfo

from ..errors import ModelUnavailable
from ..model.store import StoredModel
from ..net.dht import find_provider_infos_fresh, provide_all, seed_key, should_provide, sync_routing_table
from ..net.dial import peer_info
from ..net.view import SwarmView
from .fetch import Bans, FetchError, FetchResult, Progress, fetch_manifest, fetch_model
from .protocol import PIECES_PROTOCOL
from .seeder import Seeder
from .storage import Library

log = logging.getLogger(__name__)

PROVIDE_INTERVAL_S = 600.0  # as pipeline/server/announce.py: a third of what other nodes keep them
CHECK_PERIOD_S = 2.0


class Torrent:
    def __init__(self, host: IHost, dht: KadDHT | None, data_dir: Path, view: SwarmView | None = None, *,
                 only: set[str] | None = None, upload_limit: float | None = None) -> None:
        self.host, self.dht, self.view = host, dht, view
        self.library = Library(data_dir, only=only)
        self.seeder = Seeder(self.library, upload_limit=upload_limit)
        self.bans = Bans()
        self.changed = trio.Event()  # set when this node starts holding a new model

    def start_seeding(self) -> None:
        self.host.set_stream_handler(PIECES_PROTOCOL, self.seeder.handle)

    async def discover(self, model_id: str) -> list[PeerInfo]:
        found: dict[str, PeerInfo] = {}
        if self.view is not None:
            for ad, _serving in self.view.servers(model_id, time.time()):
                found[ad.peer_id] = peer_info(ad.peer_id, ad.addrs)
        if self.dht is not None:
            for peer_id, info in (await find_provider_infos_fresh(self.dht, seed_key(model_id))).items():
                # A provider record keeps the addresses its peer had when it announced;
                # the peer's own ad has where to reach it now (behind NAT: its relays).
                ad = self.view.get(peer_id.to_string(), time.time()) if self.view is not None else None
                found.setdefault(peer_id.to_string(), peer_info(ad.peer_id, ad.addrs) if ad is not None else info)
        found.pop(self.host.get_id().to_string(), None)
        return list(found.values())

    async def obtain_manifest(self, model_id: str, *, attempts: int = 6, wait_s: float = 5.0) -> StoredModel:
        """The model's manifest from the swarm (seeders may still be announcing: retry)."""
        for attempt in range(attempts):
            seeders = await self.discover(model_id)
            try:
                if seeders:
                    manifest = await fetch_manifest(self.host, model_id, seeders)
                    return self.library.models.add_manifest(manifest)
                reason = "no seeder found"
            except FetchError as exc:
                reason = str(exc)
            log.warning("manifest of %s: %s (attempt %d of %d)", model_id[:12], reason, attempt + 1, attempts)
            await trio.sleep(wait_s)
        raise ModelUnavailable(f"no peer in the swarm holds model {model_id[:12]} (or none answered)")

    async def fetch(self, model_id: str, *, blocks: tuple[int, int] | None = None, head: bool = False,
                    everything: bool = False, progress: Progress | None = None,
                    alias: str | None = None) -> FetchResult:
        if self.library.only is not None:
            self.library.only.add(model_id)
        known = set(self.library.model_ids())
        result = await fetch_model(self.host, self.library, model_id, lambda: self.discover(model_id),
                                   blocks=blocks, head=head, everything=everything, bans=self.bans,
                                   progress=progress, alias=alias)
        if model_id not in known:
            self.changed.set()
            self.changed = trio.Event()
        return result

    async def seeded_models(self) -> list[str]:
        """Models of which this node holds at least one piece."""
        out = []
        for model_id in await trio.to_thread.run_sync(self.library.model_ids):
            pieces = await self.library.open(model_id)
            if pieces is not None and pieces.have:
                out.append(model_id)
        return out

    async def announce_loop(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """Provide the seed key of every model held: again when that set changes, when a
        small routing table gains peers that have not had the records (should_provide),
        and every 10 minutes.
        Started (task_status) after the first round."""
        provided: tuple[frozenset, frozenset] = (frozenset(), frozenset())
        last = -PROVIDE_INTERVAL_S
        while True:
            changed = self.changed
            models = frozenset(await self.seeded_models())
            if self.dht is not None and models:
                await sync_routing_table(self.host, self.dht)
                peers = frozenset(self.dht.routing_table.get_peer_ids())
                if should_provide(models, peers, provided[0], provided[1],
                                  due=trio.current_time() - last > PROVIDE_INTERVAL_S):
                    with trio.move_on_after(30):
                        await provide_all(self.dht, [seed_key(m) for m in models])
                        provided, last = (models, peers), trio.current_time()
            if task_status is not trio.TASK_STATUS_IGNORED:
                task_status.started()
                task_status = trio.TASK_STATUS_IGNORED
            with trio.move_on_after(CHECK_PERIOD_S):
                await changed.wait()
