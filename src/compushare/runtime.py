"""What every long-running CompuShare process shares: stopping on signals, the state
file. (Joining the swarm is net/peer.open_swarm_host's.)

Kept free of torch and libp2p so that seed-only nodes start in a second or two.
"""

from __future__ import annotations

import json
import logging
import os
import signal

import trio

from .config import STATE_FILE

log = logging.getLogger(__name__)


async def stop_on_signal(scope: trio.CancelScope) -> None:
    with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
        async for signum in signals:
            log.info("received %s: stopping", signal.Signals(signum).name)
            scope.cancel()
            return


def write_state(data_dir, state: dict) -> None:
    """`<data dir>/node.json`: what `swarm`, `status` and tests read about a node."""
    write_json(data_dir / STATE_FILE, state)


def write_json(path, value: dict) -> None:
    """Replace `path` atomically: a reader sees the old file or the new one, never half."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(value, indent=2))
    os.replace(tmp, path)
