"""Many lightweight CompuShare nodes on one machine: several libp2p hosts per process.

A light node runs what every CompuShare node runs for membership, and no model:
a libp2p host (net/host.py: TCP, Noise, yamux) with its Kademlia DHT in server mode
and the DHT's routing upkeep (net/peer.py, net/dht.py), the torrent seeder's handler
over an empty library (torrent/service.py), and GossipSub with the project's own ad
topics, intake, validator and view (net/gossip.Gossip). No torch is imported.

Roles, fixed by a node's index i: it belongs to fake model `FAKE_MODELS[i % models]`;
every `consumer_every`-th node consumes it (follows its topic, publishes nothing),
the others provide a fake span of it: they publish signed capability ads on the
model's topic (the period stretched by the topic's size, as a real node's is), and
announce like a real server (net/dht: a signed server record put every
RECORD_TTL_S / 3, provider records for the model and each block of the span).

A member process (`light_swarm.py --member ...`, started by LightSwarm) runs `--hosts`
such nodes in one trio loop, each dialling two addresses it is given (other
processes' nodes) or, lacking those, an earlier node of its own process. It writes:
  ready.json     one entry per node once its host listens and joined: index, peer,
                 addrs, model, provider, t
  status.json    every second: the process's counters summed over its nodes (ad
                 copies and their bytes, ads verified, control messages and bytes,
                 RPCs, published), mesh sizes and connections per node, loop lag
  events.jsonl   one line per ad published ("pub": node, model, seq, sent) and per
                 ad accepted into a node's view ("recv": node, publisher, seq, sent,
                 arrival), appended as they happen

LightSwarm (the controller, for bench/scale.py and the tests) starts members as
fresh interpreters, waits for their ready files, reads their files and stops them by
pid (SIGTERM, then SIGKILL); each member also dies with its parent (PR_SET_PDEATHSIG
and a parent-pid watchdog).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import hashlib
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
SRC = HERE.parent / "src"
if str(SRC) not in sys.path:
    sys.path.insert(0, str(SRC))

FAKE_MODELS = [hashlib.sha256(f"compushare light model {i}".encode()).hexdigest() for i in range(64)]
FAKE_SPAN = (0, 10)
RECORD_TTL_S = 300.0  # a real node's default (config.record_ttl_s)
PROVIDE_INTERVAL_S = 600.0  # as pipeline/server/announce.py
READY_FILE, STATUS_FILE, EVENTS_FILE = "ready.json", "status.json", "events.jsonl"
STOP_TIMEOUT_S = 10.0
HOST_START_GAP_S = 0.05  # between a process's node starts: a gentler join storm


QUIET_MODEL = FAKE_MODELS[-1]  # followed by quiet nodes, provided by none


def role(index: int, models: int, consumer_every: int, quiet: bool = False) -> tuple[str, bool]:
    """The fake model node `index` belongs to, and whether it provides it. A quiet
    node follows a model nobody provides: it hears no ads, so what it spends is a
    node's upkeep alone (DHT, heartbeats, connections)."""
    if quiet:
        return QUIET_MODEL, False
    # (index // models): consumers spread over every model, whatever their number.
    provider = consumer_every <= 0 or (index // models) % consumer_every != consumer_every - 1
    return FAKE_MODELS[index % models], provider


def _write_json_atomic(path: Path, obj) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(obj))
    os.replace(tmp, path)


# =========================================================================== member


class Counters:
    """What one process's nodes took in, summed (plain ints: one trio loop)."""

    def __init__(self) -> None:
        self.copies = self.copy_bytes = self.control = self.control_bytes = self.rpcs = 0
        self.connected = self.disconnected = self.streams = 0
        self.protocols: collections.Counter = collections.Counter()  # streams opened, by protocol

    def count_network(self, host) -> None:
        """Count a node's connections opened and closed, and its streams by protocol."""
        from libp2p.abc import INotifee

        counters = self

        class Counting(INotifee):
            async def opened_stream(self, network, stream) -> None:
                counters.streams += 1

            async def closed_stream(self, network, stream) -> None:
                with contextlib.suppress(Exception):
                    counters.protocols[str(stream.get_protocol())] += 1

            async def connected(self, network, conn) -> None:
                counters.connected += 1

            async def disconnected(self, network, conn) -> None:
                counters.disconnected += 1

            async def listen(self, network, multiaddr) -> None:
                pass

            async def listen_close(self, network, multiaddr) -> None:
                pass

        host.get_network().register_notifee(Counting())

    def count_push(self, pubsub) -> None:
        """Count every ad copy a node's pubsub is handed (duplicates included)."""
        push = pubsub.push_msg

        async def counting(forwarder, msg) -> None:
            self.copies += 1
            self.copy_bytes += msg.ByteSize()
            await push(forwarder, msg)

        pubsub.push_msg = counting

    def count_control(self, router) -> None:
        """Count the control messages (IHAVE, IWANT, GRAFT, PRUNE) a node's router handles."""
        handle = router.handle_rpc

        async def counting(rpc, sender) -> None:
            control = rpc.control
            self.rpcs += 1
            self.control += len(control.ihave) + len(control.iwant) + len(control.graft) + len(control.prune)
            self.control_bytes += control.ByteSize()
            await handle(rpc, sender)

        router.handle_rpc = counting


async def light_announce(dht, host, key_pair, model_id: str) -> None:
    """A provider's DHT upkeep as pipeline/server/announce.announce_loop does it for a
    served span: the signed server record every RECORD_TTL_S / 3, provider records of
    the model and each block every PROVIDE_INTERVAL_S."""
    import trio

    from compushare.net.dht import block_key, model_key, provide_all
    from compushare.net.host import advertised_addrs
    from compushare.net.records import MAX_ADDRS, ServerRecord, record_key

    last_provide = -PROVIDE_INTERVAL_S
    keys = [model_key(model_id)] + [block_key(model_id, b) for b in range(*FAKE_SPAN)]
    while True:
        record = ServerRecord(peer_id=host.get_id().to_string(), model_id=model_id, start=FAKE_SPAN[0],
                              end=FAKE_SPAN[1], dtype="float32", addrs=tuple(advertised_addrs(host))[:MAX_ADDRS],
                              expires=time.time() + RECORD_TTL_S, seq=time.time_ns())
        with trio.move_on_after(RECORD_TTL_S / 3):
            await dht.put_value(record_key(model_id, record.peer_id), record.sign(key_pair))
            if trio.current_time() - last_provide > PROVIDE_INTERVAL_S:
                await provide_all(dht, keys)
                last_provide = trio.current_time()
        await trio.sleep(RECORD_TTL_S / 3 * random.uniform(0.9, 1.1))


async def light_node(index: int, args, hardware, counters: Counters, record, dial_to: list[str],
                     *, task_status) -> None:
    import trio

    from compushare import __version__
    from compushare.karma.record import karma_validators
    from compushare.net.ads import Serving, ad_ttl, make_ad
    from compushare.net.dht import find_model_providers, routing_sync_loop
    from compushare.net.gossip import Gossip
    from compushare.net.host import full_addrs
    from compushare.net.identity import load_or_create_identity
    from compushare.net.peer import open_swarm_host
    from compushare.net.view import SwarmView
    from compushare.torrent.service import Torrent

    data_dir = Path(args.dir) / f"node-{index}"
    data_dir.mkdir(parents=True, exist_ok=True)
    key_pair = load_or_create_identity(data_dir)
    model_id, provides = role(index, args.models, args.consumer_every, args.quiet)
    async with open_swarm_host(key_pair, server=True, validators=karma_validators(), listen=["/ip4/127.0.0.1/tcp/0"],
                               bootstrap=dial_to, join=False) as swarm:
        host, dht = swarm.host, swarm.dht
        counters.count_network(host)
        me = host.get_id().to_string()
        view = SwarmView()
        Torrent(host, dht, data_dir, view).start_seeding()
        serving = [Serving(model_id, *FAKE_SPAN, "float32", free_tokens=4096, load=0.1, block_rate=40.0)]
        last_seq, gossip = 0, None

        def new_ad():  # as app/startup.ad_maker: a rising seq, the lifetime from the stretched period
            nonlocal last_seq
            last_seq = max(last_seq + 1, time.time_ns())
            ad = make_ad(key_pair, me, full_addrs(host), hardware, serving, __version__,
                         ttl_s=ad_ttl(gossip.period_now), seq=last_seq)
            record({"e": "pub", "n": index, "m": model_id[:8], "q": ad.seq, "s": ad.sent})
            return ad

        def on_ad(ad) -> None:
            if ad.peer_id != me:
                record({"e": "recv", "n": index, "p": ad.peer_id, "q": ad.seq, "s": ad.sent, "a": time.time()})

        gossip = Gossip(host, view, new_ad if provides else None, models=(model_id,), on_ad=on_ad,
                        find_providers=lambda m: find_model_providers(dht, m))
        async with trio.open_nursery() as nursery:
            await nursery.start(gossip.run)
            counters.count_push(gossip.pubsub)
            counters.count_control(gossip.pubsub.router)
            await swarm.join(attempts=None)
            nursery.start_soon(routing_sync_loop, host, dht)
            if provides:
                nursery.start_soon(light_announce, dht, host, key_pair, model_id)
            task_status.started({"index": index, "peer": me, "addrs": full_addrs(host), "model": model_id[:8],
                                 "provider": provides, "t": time.time(), "node": (host, gossip)})
            await trio.sleep_forever()


def _die_with_parent() -> None:
    with contextlib.suppress(Exception):
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def member_main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="light_swarm.py --member")
    parser.add_argument("--dir", required=True)
    parser.add_argument("--first", type=int, required=True, help="index of this process's first node")
    parser.add_argument("--hosts", type=int, required=True)
    parser.add_argument("--models", type=int, required=True)
    parser.add_argument("--consumer-every", type=int, default=10)
    parser.add_argument("--quiet", action="store_true", help="nodes that follow a model nobody provides")
    parser.add_argument("--dial", action="append", default=[], help="addresses of other processes' nodes")
    parser.add_argument("--hardware", required=True, help="a file holding Hardware.to_wire() as JSON")
    parser.add_argument("--parent-pid", type=int, required=True)
    parser.add_argument("--max-lifetime", type=float, default=7200.0, help="a member outlives no run")
    args = parser.parse_args(argv)
    _die_with_parent()
    if os.getppid() != args.parent_pid:
        return 1
    import trio

    profile = os.environ.get("LIGHT_SWARM_PROFILE")  # a path: cProfile stats of this member, at its end
    with open(Path(args.dir) / EVENTS_FILE, "w", buffering=1) as events:
        with contextlib.suppress(KeyboardInterrupt):
            if profile:
                import cProfile

                cProfile.runctx("trio.run(_member, args, events)", globals(), locals(), profile)
            else:
                trio.run(_member, args, events)
    return 0


async def _member(args, events) -> None:
    import trio

    from compushare.hardware import Hardware

    hardware = Hardware.from_wire(json.loads(Path(args.hardware).read_text()))
    counters, ready, nodes = Counters(), [], []
    rng = random.Random(args.first)

    def record(obj: dict) -> None:
        events.write(json.dumps(obj, separators=(",", ":")) + "\n")

    async with trio.open_nursery() as nursery:
        async def stop_on_signal() -> None:
            with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
                async for _ in signals:
                    nursery.cancel_scope.cancel()
                    return

        async def watchdog() -> None:
            deadline = trio.current_time() + args.max_lifetime
            while os.getppid() == args.parent_pid and trio.current_time() < deadline:
                await trio.sleep(1.0)
            nursery.cancel_scope.cancel()

        lag = {"max": 0.0}

        async def lag_probe() -> None:
            while True:
                began = trio.current_time()
                await trio.sleep(0.25)
                lag["max"] = max(lag["max"], trio.current_time() - began - 0.25)

        nursery.start_soon(stop_on_signal)
        nursery.start_soon(watchdog)
        nursery.start_soon(lag_probe)
        for offset in range(args.hosts):
            own = [a for entry in ready for a in entry["addrs"][:1]]
            dial_to = rng.sample(args.dial, min(2, len(args.dial))) if args.dial else []
            if own and (not dial_to or offset % 2):
                dial_to = dial_to[:1] + rng.sample(own, 1)
            info = await nursery.start(light_node, args.first + offset, args, hardware, counters, record, dial_to)
            nodes.append(info.pop("node"))
            ready.append(info)
            _write_json_atomic(Path(args.dir) / READY_FILE, ready)
            await trio.sleep(HOST_START_GAP_S)
        while True:
            _write_json_atomic(Path(args.dir) / STATUS_FILE, _status(counters, nodes, lag))
            lag["max"] = 0.0
            await trio.sleep(1.0)


def _status(counters: Counters, nodes: list, lag: dict) -> dict:
    from compushare.net.ad_intake import ad_topic

    meshes, connections, topic_peers, published, verified, unregistered = [], [], [], 0, 0, 0
    for host, gossip in nodes:
        router = gossip.pubsub.router
        meshes.append(sum(len(router.mesh.get(ad_topic(m), ())) for m in gossip.followed()))
        topic_peers.append(len(gossip.subscribed_peers()))
        unregistered += sum(1 for peer in list(host.get_network().connections) if peer not in gossip.pubsub.peers)
        connections.append(len(host.get_network().connections))
        published += gossip.published
        verified += gossip.intake.counts["verified"]
    return {"t": time.time(), "nodes": len(nodes), "copies": counters.copies, "copy_bytes": counters.copy_bytes,
            "control": counters.control, "control_bytes": counters.control_bytes, "rpcs": counters.rpcs,
            "verified": verified, "published": published, "connected": counters.connected,
            "disconnected": counters.disconnected, "streams": counters.streams,
            "protocols": dict(counters.protocols.most_common(12)), "mesh": meshes, "connections": connections, "topic_peers": topic_peers,
            "unregistered": unregistered,
            "lag_max_s": round(lag["max"], 3)}


# =========================================================================== controller


class Member:
    def __init__(self, first: int, hosts: int, data_dir: Path, proc: subprocess.Popen, quiet: bool) -> None:
        self.first, self.hosts, self.dir, self.proc, self.quiet = first, hosts, data_dir, proc, quiet

    def ready(self) -> list[dict]:
        with contextlib.suppress(FileNotFoundError, json.JSONDecodeError):
            return json.loads((self.dir / READY_FILE).read_text())
        return []

    def status(self) -> dict | None:
        with contextlib.suppress(FileNotFoundError, json.JSONDecodeError):
            return json.loads((self.dir / STATUS_FILE).read_text())
        return None

    def events(self) -> list[dict]:
        rows = []
        with contextlib.suppress(FileNotFoundError), open(self.dir / EVENTS_FILE) as f:
            for line in f:
                with contextlib.suppress(json.JSONDecodeError):  # the last line may be half written
                    rows.append(json.loads(line))
        return rows

    def last_error(self) -> str:
        with contextlib.suppress(OSError):
            lines = (self.dir / "stderr.log").read_text(errors="replace").strip().splitlines()
            return lines[-1] if lines else ""
        return ""


class LightSwarm:
    """Member processes of light nodes under `root`; `close()` ends every one by pid."""

    def __init__(self, root: Path, *, models: int, consumer_every: int = 10, hardware_json: str) -> None:
        self.root, self.models, self.consumer_every = root, models, consumer_every
        self.members: list[Member] = []
        self.hardware_file = root / "hardware.json"
        self.hardware_file.write_text(hardware_json)
        self.rng = random.Random(0)

    @property
    def nodes(self) -> int:
        return sum(m.hosts for m in self.members)

    def addrs(self) -> list[str]:
        return [e["addrs"][0] for m in self.members for e in m.ready()]

    def ready_nodes(self) -> list[dict]:
        return [e for m in self.members for e in m.ready()]

    def add(self, hosts: int, *, extra_dial: list[str] = (), quiet: bool = False) -> Member:
        """Start one member process of `hosts` nodes (not waiting for it)."""
        first = self.nodes
        data_dir = self.root / f"member-{len(self.members):02d}"
        data_dir.mkdir()
        known = self.addrs()
        dial = self.rng.sample(known, min(8, len(known))) + list(extra_dial)
        cmd = [sys.executable, str(Path(__file__).resolve()), "--member", "--dir", str(data_dir),
               "--first", str(first), "--hosts", str(hosts), "--models", str(self.models),
               "--consumer-every", str(self.consumer_every), "--hardware", str(self.hardware_file),
               "--parent-pid", str(os.getpid())]
        for addr in dial:
            cmd += ["--dial", addr]
        if quiet:
            cmd.append("--quiet")
        with open(data_dir / "stderr.log", "w") as err:
            proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=err,
                                    env={**os.environ, "PYTHONPATH": str(SRC)})
        member = Member(first, hosts, data_dir, proc, quiet)
        self.members.append(member)
        return member

    def wait_ready(self, timeout: float) -> None:
        """Until every member's every node is ready; RuntimeError (with the member's
        last stderr line) if one dies or time runs out."""
        deadline = time.monotonic() + timeout
        while True:
            pending = [m for m in self.members if len(m.ready()) < m.hosts]
            if not pending:
                return
            for member in pending:
                if member.proc.poll() is not None:
                    raise RuntimeError(f"light member {member.dir.name} exited {member.proc.returncode}: "
                                       f"{member.last_error()}")
            if time.monotonic() > deadline:
                counts = ", ".join(f"{m.dir.name} {len(m.ready())}/{m.hosts}" for m in pending)
                raise RuntimeError(f"light nodes not ready within {timeout:.0f}s: {counts}")
            time.sleep(0.5)

    def pids(self) -> list[int]:
        return [m.proc.pid for m in self.members if m.proc.poll() is None]

    def close(self) -> None:
        for member in self.members:
            if member.proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    member.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + STOP_TIMEOUT_S
        for member in self.members:
            try:
                member.proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                member.proc.kill()
                with contextlib.suppress(subprocess.TimeoutExpired):
                    member.proc.wait(5)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--member"]:
        sys.exit(member_main(sys.argv[2:]))
    sys.exit("light_swarm.py is started by bench/scale.py (and the tests) with --member")
