"""A consumer that tests/integration/test_nat.py (and bench/nat.py) run inside a
netlab namespace: it joins the swarm, optionally first shows that a direct dial to
`--target` fails, generates greedily, and prints one JSON line: the tokens, the
route, how it reached the target (relayed, punched) and what its connections to the
target are at the end."""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import trio
from libp2p.peer.id import ID

from compushare.net.dial import peer_info
from compushare.net.reachability import is_circuit
from compushare.net.traversal import traversal_of
from compushare.pipeline.client.consumer import Consumer, RunRequest
from compushare.pipeline.client.discovery import discover_servers
from compushare.pipeline.client.sampling import SamplingParams
from compushare.torrent.fetch import fetch_model
from compushare.torrent.storage import Library

DIRECT_TRY_S = 3.0


async def _only(info):
    return [info]


async def main(args) -> dict:
    out: dict = {}
    async with Consumer.connect(Path(args.data_dir), tuple(args.bootstrap), args.model, text_prompts=False,
                                listen=tuple(args.listen)) as consumer:
        host = consumer.host
        target = ID.from_base58(args.target) if args.target else None
        if args.try_direct:
            # Straight at the target's own addresses, as if it were reachable: a NAT
            # drops the SYN, so this must time out (or be refused).
            began = time.monotonic()
            try:
                with trio.fail_after(DIRECT_TRY_S):
                    await host.connect(peer_info(target, args.try_direct))
                out["direct_dial"] = "connected"
            except BaseException as exc:  # noqa: BLE001  (TooSlowError, or py-libp2p's dial errors)
                out["direct_dial"] = f"failed: {type(exc).__name__} after {time.monotonic() - began:.1f}s"
            host.get_network().unblock_peer(target)
        if args.fetch_from:
            # Pieces from the target alone (at the addresses its record gives: its relays).
            library = Library(Path(args.data_dir) / "fetched")
            records = await discover_servers(consumer.dht, consumer.model.model_id, consumer.model.num_blocks)
            record = next(r for r in records if r.peer_id == args.target)
            fetched = await fetch_model(host, library, consumer.model.model_id,
                                        lambda: _only(peer_info(record.peer_id, record.addrs)), head=True)
            out["fetched"] = {"bytes": fetched.bytes, "from": fetched.bytes_from}
        began = time.perf_counter()
        outcome = await consumer.generate(RunRequest(
            model=args.model, prompt=[int(t) for t in args.prompt.split(",")], direct=not args.no_direct,
            speculate=False, params=SamplingParams(max_new_tokens=args.new, stop_at_eos=False)))
        out.update(tokens=outcome.tokens, route=[[h.peer_id, h.start, h.end] for h in outcome.route],
                   seconds=time.perf_counter() - began, first_token_s=outcome.first_token_s,
                   decode_tok_s=outcome.decode_tok_s, net=traversal_of(host).stats())
        if target is not None:
            out["to_target"] = ["relayed" if all(is_circuit(str(a)) for a in conn.get_transport_addresses())
                                else "direct" for conn in host.get_network().connections.get(target, [])]
    return out


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--data-dir", required=True)
    parser.add_argument("--bootstrap", action="append", default=[])
    parser.add_argument("--listen", action="append", default=[])
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--prompt", required=True, help="token ids, comma-separated")
    parser.add_argument("--new", type=int, default=16)
    parser.add_argument("--target", default=None, help="a peer id whose connection is reported")
    parser.add_argument("--try-direct", action="append", default=[], help="an address of --target to dial first")
    parser.add_argument("--no-direct", action="store_true")
    parser.add_argument("--fetch-from", action="store_true", help="first fetch the model's head pieces from --target")
    print(json.dumps(trio.run(main, parser.parse_args())), flush=True)
