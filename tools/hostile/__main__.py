"""Attackers in a process of their own, until SIGTERM:

    python -m hostile --state <node>/node.json --model-id ID --attackers 4 \
        --kinds kv_hog,sybil,window --counts counts.json

Each of --attackers identities (a libp2p host with a fresh Ed25519 key) runs every
attack kind at once against the node whose state file is given, and starts an
attack again when the node's defences end it (a reset or closed stream). What
they did is written to --counts as JSON every second and at exit. A process of
their own keeps the attackers' CPU (signing ads, grinding keys) off the GIL of
whoever measures the swarm.
"""

from __future__ import annotations

import argparse
import collections
import importlib
import json
import signal
from pathlib import Path

import trio
from libp2p.crypto.ed25519 import create_new_key_pair

from compushare.net.host import open_host

MODULES = {"kv_hog": "hostile.infer", "sybil": "hostile.sybil", "window": "hostile.window"}


async def attacker(state: dict, model_id: str, counts: collections.Counter, kinds: dict) -> None:
    async def persist(kind: str, attack) -> None:
        while True:
            try:
                await attack()
            except Exception as exc:
                counts[f"{kind}_ended_{type(exc).__name__}"] += 1
                await trio.sleep(0.5)

    async with open_host(create_new_key_pair(), []) as host, trio.open_nursery() as nursery:
        for kind, attack in kinds.items():
            nursery.start_soon(persist, kind, lambda attack=attack: attack(host, state, model_id, counts))


async def main(args) -> None:
    state = json.loads(Path(args.state).read_text())
    kinds = {kind: importlib.import_module(MODULES[kind]).attack for kind in args.kinds.split(",")}
    counts: collections.Counter = collections.Counter()
    out = Path(args.counts)

    def write() -> None:
        out.with_suffix(".tmp").write_text(json.dumps(dict(counts)))
        out.with_suffix(".tmp").replace(out)

    try:
        with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
            async with trio.open_nursery() as nursery:
                for _ in range(args.attackers):
                    nursery.start_soon(attacker, state, args.model_id, counts, kinds)

                async def report() -> None:
                    while True:
                        write()
                        await trio.sleep(1.0)

                nursery.start_soon(report)
                async for _ in signals:
                    nursery.cancel_scope.cancel()
                    break
    finally:
        write()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--state", required=True, help="the attacked node's node.json")
    parser.add_argument("--model-id", required=True)
    parser.add_argument("--attackers", type=int, default=4)
    parser.add_argument("--kinds", default="kv_hog,sybil,window", help=", ".join(MODULES))
    parser.add_argument("--counts", required=True, help="where to write what the attackers did (JSON)")
    trio.run(main, parser.parse_args())
