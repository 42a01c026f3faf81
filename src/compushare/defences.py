"""Switches that turn one defence against hostile peers off, for the tests and
benchmarks that show the defence matters (each hostile-peer test runs its attack
once with the defence on and, where cheap, once with it off, and expects the
attack to work then).

    COMPUSHARE_DISABLE_DEFENCES=fair_compute,yamux_window compushare node ...

Nothing else reads this variable and no user should set it: a node started with a
defence off says so in its log at start-up.
"""

from __future__ import annotations

import os

ENV = "COMPUSHARE_DISABLE_DEFENCES"
KNOWN = frozenset({
    "fair_kv",  # max-min fair shares of a server's KV budget (pipeline/server/kv_share.py)
    "fair_compute",  # compute pieces, decode steps first, fair queueing (pipeline/server/scheduler.py)
    "yamux_window",  # resetting a yamux stream whose sender overruns its receive window (net)
    "stream_caps",  # per-peer caps on inbound streams and buffered bytes (net)
    "view_policy",  # the view prefers peers with evidence over fresh identities (net/view)
    "dht_bounds",  # the DHT record store's byte and per-publisher bounds (net/dht)
})


def disabled(name: str) -> bool:
    """Whether defence `name` (one of KNOWN) is switched off in this process."""
    if name not in KNOWN:
        raise ValueError(f"unknown defence {name!r}")
    return name in {part.strip() for part in os.environ.get(ENV, "").split(",")}


def disabled_now() -> list[str]:
    """The known defences switched off in this process (for the start-up log)."""
    return sorted(name for name in KNOWN if disabled(name))
