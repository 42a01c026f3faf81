"""`compushare models fetch` and `compushare models seed`: the torrent role on its own,
as a short-lived fetching peer or a long-running seed-only node.

Kept free of torch so that seed-only nodes start in a second or two.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

import trio

from ..config import STATE_FILE
from ..errors import UsageError
from ..karma.record import karma_validators
from ..model.store import ModelStore
from ..net.dht import routing_sync_loop
from ..net.gossip import learn_views
from ..net.host import full_addrs
from ..net.identity import load_or_create_identity
from ..net.peer import open_swarm_host
from ..net.traversal import client_traversal
from ..net.view import SwarmView
from ..runtime import stop_on_signal, write_state
from ..torrent.fetch import FetchResult, Progress
from ..torrent.service import Torrent

log = logging.getLogger(__name__)


async def fetch_from_swarm(data_dir: Path, bootstrap, model_id: str, *, blocks: tuple[int, int] | None = None,
                           head: bool = False, everything: bool = False, progress: Progress | None = None,
                           alias: str | None = None, upload_limit: float | None = None) -> FetchResult:
    """`compushare models fetch`: join as a short-lived peer, fetch, and seed to the
    peers we are connected to while the download runs."""
    key_pair = load_or_create_identity(data_dir)
    async with open_swarm_host(key_pair, server=False, validators=karma_validators(),
                               listen=["/ip4/127.0.0.1/tcp/0"], bootstrap=bootstrap) as swarm, \
            client_traversal(swarm.host):  # seeders behind NAT: through their relays
        view = SwarmView()
        with trio.move_on_after(5):
            await learn_views(swarm.host, view, model_id)
        torrent = Torrent(swarm.host, swarm.dht, data_dir, view, upload_limit=upload_limit)
        torrent.start_seeding()
        return await torrent.fetch(model_id, blocks=blocks, head=head, everything=everything, progress=progress,
                                   alias=alias)


async def seed_forever(data_dir, *, listen, bootstrap, models: list[str] | None = None,
                       upload_limit: float | None = None, task_status=trio.TASK_STATUS_IGNORED) -> None:
    """A node that only seeds: `compushare models seed`. It serves the pieces of every
    model in its store (or of `models`) and announces them in the DHT."""
    store = ModelStore(data_dir)
    model_ids = None
    if models:
        model_ids = set()
        for name in models:
            model = store.get(name)
            if model is None:
                raise UsageError(f"{name!r} is not in the local store (see `compushare models list`)")
            model_ids.add(model.model_id)

    key_pair = load_or_create_identity(data_dir)
    async with open_swarm_host(key_pair, server=True, validators=karma_validators(), listen=listen,
                               bootstrap=bootstrap, join=False) as swarm:
        host, dht = swarm.host, swarm.dht
        torrent = Torrent(host, dht, data_dir, only=model_ids, upload_limit=upload_limit)
        torrent.start_seeding()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(stop_on_signal, nursery.cancel_scope)
            await swarm.join(attempts=None)
            nursery.start_soon(routing_sync_loop, host, dht)
            await nursery.start(torrent.announce_loop)  # ready means findable
            state = {"pid": os.getpid(), "peer_id": host.get_id().to_string(), "addrs": full_addrs(host),
                     "role": "seeder", "models": await torrent.seeded_models(), "started": time.time()}
            write_state(data_dir, state)
            log.info("seeding %d models as %s on %s", len(state["models"]), state["peer_id"],
                     ", ".join(state["addrs"]))
            task_status.started(state)
            try:
                await trio.sleep_forever()
            finally:
                (data_dir / STATE_FILE).unlink(missing_ok=True)
