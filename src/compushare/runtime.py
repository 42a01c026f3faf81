"""What every long-running CompuShare process shares: joining the swarm, keeping the
DHT routing table in step with connections, stopping on signals, the state file.

Kept free of torch so that seed-only nodes start in a second or two.
"""

from __future__ import annotations

import json
import logging
import os
import signal

import trio

from .config import STATE_FILE
from .errors import SwarmUnreachable
from .net.dht import connect_bootstrap, sync_routing_table

log = logging.getLogger(__name__)

ROUTING_SYNC_PERIOD_S = 2.0
BOOTSTRAP_RETRY_S = (0.5, 5.0)  # first and longest wait between attempts (doubling)
# py-libp2p caps ADD_PROVIDER at 10 per 10 s per peer; a node announcing a span of
# 30 blocks sends 31. Every CompuShare node raises the cap for its peers.
PROVIDER_RATE_MAX = 200


async def join_swarm(host, dht, bootstrap) -> None:
    """Dial the bootstrap peers; keep retrying (a swarm may come up in any order)."""
    wait, longest = BOOTSTRAP_RETRY_S
    while True:
        try:
            await connect_bootstrap(host, dht, bootstrap)
            return
        except SwarmUnreachable as exc:
            log.warning("%s; retrying in %.1fs", exc, wait)
            await trio.sleep(wait)
            wait = min(2 * wait, longest)


async def routing_sync_loop(host, dht) -> None:
    while True:
        await sync_routing_table(host, dht)
        await trio.sleep(ROUTING_SYNC_PERIOD_S)


async def stop_on_signal(scope: trio.CancelScope) -> None:
    with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
        async for signum in signals:
            log.info("received %s: stopping", signal.Signals(signum).name)
            scope.cancel()
            return


def write_state(data_dir, state: dict) -> None:
    """`<data dir>/node.json`: what `swarm`, `status` and tests read about a node."""
    path = data_dir / STATE_FILE
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(state, indent=2))
    os.replace(tmp, path)


