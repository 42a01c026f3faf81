"""One seam for joining the swarm: a running host, its DHT and the bootstrap.

Every CompuShare process (a provider node, a seeder, a consumer, `status`,
`karma`, `models fetch`) starts the same way:

    async with open_swarm_host(key_pair, server=False, validators=karma_validators(),
                               bootstrap=addrs) as swarm:
        ... swarm.host, swarm.dht ...

With `join=False` the caller dials the bootstrap peers itself, when it is ready,
with `await swarm.join()` (e.g. after starting gossip, which must see the
connections happen, or under a deadline of its own). A long-running node then
also runs net/dht.routing_sync_loop in its own nursery.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections.abc import AsyncIterator, Mapping, Sequence

import trio
from libp2p.abc import IHost
from libp2p.crypto.keys import KeyPair
from libp2p.kad_dht.kad_dht import KadDHT
from libp2p.records.validator import Validator

from ..errors import SwarmUnreachable
from .dht import connect_bootstrap, open_dht
from .host import open_host

log = logging.getLogger(__name__)

BOOTSTRAP_RETRY_S = (0.5, 5.0)  # first and longest wait between attempts of join() (doubling)
# py-libp2p caps ADD_PROVIDER at 10 per 10 s per peer; a provider announcing a span of
# 30 blocks sends 31. Every long-running node (server mode) raises the cap for its peers.
PROVIDER_RATE_MAX = 200


@dataclasses.dataclass
class SwarmHost:
    """A running host and DHT, and the bootstrap peers they join through."""

    host: IHost
    dht: KadDHT
    bootstrap: tuple[str, ...]

    async def join(self, *, attempts: int | None = 1) -> int:
        """Dial the bootstrap peers concurrently; return how many answered (0 with no
        bootstrap peers: the first node of a swarm). None answering within `attempts`
        tries (None: until one does, as a swarm may come up in any order), waiting
        longer between each, raises SwarmUnreachable."""
        wait, longest = BOOTSTRAP_RETRY_S
        tried = 0
        while True:
            try:
                return await connect_bootstrap(self.host, self.dht, self.bootstrap)
            except SwarmUnreachable as exc:
                tried += 1
                if attempts is not None and tried >= attempts:
                    raise
                log.warning("%s; retrying in %.1fs", exc, wait)
                await trio.sleep(wait)
                wait = min(2 * wait, longest)


@contextlib.asynccontextmanager
async def open_swarm_host(key_pair: KeyPair, *, server: bool, validators: Mapping[str, Validator],
                          listen: Sequence[str] = (), bootstrap: Sequence[str] = (),
                          join: bool = True) -> AsyncIterator[SwarmHost]:
    """A host listening on `listen` (empty: dial-only) with a DHT in server mode (it
    stores records for others: long-running nodes) or client mode, validating net's
    server records and `validators` (namespace -> Validator: every node passes
    karma.record.karma_validators()).

    join: dial `bootstrap` before yielding (once: SwarmUnreachable if none answers);
      False leaves it to the caller's `await swarm.join(...)`.
    """
    async with open_host(key_pair, listen) as host, open_dht(host, server=server, validators=validators) as dht:
        if server:
            dht._provider_rate_max = PROVIDER_RATE_MAX  # private in the pinned 0.8.1
        swarm = SwarmHost(host, dht, tuple(bootstrap))
        if join:
            await swarm.join()
        yield swarm
