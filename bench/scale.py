"""Membership at scale: 200 light nodes, 3 real SmolLM2 providers and a consumer on one
machine, measured at 50 and 200 nodes in one run, then projected to 10,000.

    .venv/bin/python bench/scale.py [--nodes 200] [--first 50] [--per-process 25] [--models 4]

swarm      light nodes (bench/light_swarm.py: host, DHT, seeder, the project's gossip;
           no torch), `--per-process` per process: providers of `--models` fake
           models (every 10th node a consumer that only follows its model's topic),
           and `--quiet` nodes that follow a model nobody serves (what a node spends
           when it hears no ads: its upkeep). Then 3 real provider processes of
           SmolLM2 (`compushare node`: A 0:15, C 0:15, B 15:30), each bootstrapping
           from light nodes only, so their DHT records live among the light nodes.
windows    at `--first` light nodes, then at `--nodes` (the rest started, one process
           at a time), each after `--warmup` s: a `--window` s window in which every
           light process's CPU (/proc, all threads) and counters are read at both
           ends. Per node: CPU share (of one core), messages received per second (ad
           copies, duplicates included, and GossipSub control messages), bytes.
           Ads published in the window are expected at every other node following
           their model; delivered_fraction = arrivals / expected (arrivals counted
           until `--drain` s after the window), ad p95 = their latency's 95th
           percentile (sent, in the publisher, to accepted into the receiver's view;
           one machine clock).
discovery  at `--nodes`: a consumer (pipeline.client.consumer.Consumer, a DHT client
           that bootstraps from light nodes) generates through A/C and B; B is
           stopped and a fresh provider D of 15:30 started (new identity, bootstrapping
           from light nodes); discover_s = from D's ready state (its node.json,
           written once it announced) to the end of the first generation (4 tokens)
           whose route goes through D (the consumer retries every RETRY_S while no
           route exists). Done `--rounds` times (D stopped and
           another fresh one started); the worst is reported. Every generation's tokens
           must equal the first's.
projection net/scale_model.py, fed with unit costs measured here: the verify cost of
           one new ad (decode_ad and pubsub's signature check, timed in this process),
           the quiet nodes' upkeep, the per-copy cost as the rest of the busy nodes' CPU
           at the first window per message, copies per ad, control messages per node,
           bytes, gossip hop latency (p50 latency over the hops the model assigns)
           and a DHT round trip (a look-up timed from the consumer). It is printed
           at the two measured sizes beside the measurements, and at 100, 1,000 and
           10,000 nodes with 1, 5 and 20 models.

Human-readable lines first; the last line is one JSON object with at least {"nodes",
"discover_s", "delivered_fraction", "ad_p95_s", "cpu_per_node_50", "cpu_per_node_200",
"msgs_per_node_s_200", "projected_msgs_per_node_s_10000", "projected_discover_s_10000"}.
Targets: cpu_per_node_200 <= 1.2 x cpu_per_node_50, delivered_fraction >= 0.95,
ad_p95_s <= 3, discover_s <= 10, projected_msgs_per_node_s_10000 <= 20.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _common import REPO, finish  # noqa: E402  (this checkout's src/, the shared cache)

import trio  # noqa: E402

from compushare.app.swarm import node_command, start_node, wait_ready  # noqa: E402
from compushare.pipeline.client.consumer import Consumer, RunRequest  # noqa: E402
from compushare.pipeline.client.sampling import SamplingParams  # noqa: E402
from light_swarm import LightSwarm  # noqa: E402  (bench/light_swarm.py)
from local_swarm import cpu_seconds  # noqa: E402

MODEL = "smollm2-135m"
REAL = {"A": (0, 15), "C": (0, 15), "B": (15, 30)}
FRESH_SPAN = (15, 30)
RETRY_S = 0.5
DISCOVER_TIMEOUT_S = 180.0
PROJECT_NODES, PROJECT_MODELS = (100, 1000, 10000), (1, 5, 20)
HEADLINE_MODELS = 20  # the 10,000-node headline: 20 models (the table has 1 and 5 too)
TARGETS = {"cpu_flat": 1.2, "delivered_fraction": 0.95, "ad_p95_s": 3.0, "discover_s": 10.0,
           "projected_msgs_per_node_s_10000": 20.0}


def log(text: str = "") -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {text}", flush=True)


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


# =========================================================================== windows


def snapshot(swarm: LightSwarm) -> dict:
    """Every light process's CPU seconds and counters, now."""
    rows = {}
    for member in swarm.members:
        status = member.status() or {}
        rows[member.dir.name] = {"cpu": cpu_seconds(member.proc.pid), "quiet": member.quiet, "nodes": member.hosts,
                                 **{k: status.get(k, 0) for k in ("copies", "copy_bytes", "control", "control_bytes",
                                                                  "verified", "published", "connected", "streams")}}
    return {"t": time.time(), "members": rows, "machine_cpu": machine_cpu_s()}


def machine_cpu_s() -> float:
    """CPU seconds the whole machine has spent busy (/proc/stat: all but idle and iowait)."""
    fields = [int(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    return (sum(fields[:8]) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK")


def window_costs(before: dict, after: dict) -> dict:
    """Per-node rates between two snapshots, for the busy and the quiet nodes."""
    seconds = after["t"] - before["t"]
    out = {"seconds": round(seconds, 1), "machine_cores_busy": _r((after["machine_cpu"] - before["machine_cpu"]) / seconds, 2)}
    for kind, quiet in (("busy", False), ("quiet", True)):
        names = [n for n, r in before["members"].items() if r["quiet"] == quiet and n in after["members"]]
        nodes = sum(before["members"][n]["nodes"] for n in names)
        if not nodes:
            continue

        def rate(key: str) -> float:
            return sum(after["members"][n][key] - before["members"][n][key] for n in names) / seconds / nodes

        out[kind] = {"nodes": nodes, "cpu": rate("cpu"), "copies_s": rate("copies"), "control_s": rate("control"),
                     "new_ads_s": rate("verified"), "copy_bytes_s": rate("copy_bytes"),
                     "control_bytes_s": rate("control_bytes"), "published_s": rate("published"),
                     "new_connections_s": rate("connected"), "streams_s": rate("streams")}
    return out


def delivery(swarm: LightSwarm, w0: float, w1: float) -> dict:
    """The ads published in [w0, w1] against the nodes that should have heard them."""
    nodes = {e["index"]: e for e in swarm.ready_nodes()}
    peer_index = {e["peer"]: i for i, e in nodes.items()}
    followers: dict[str, list[int]] = {}
    for index, entry in nodes.items():
        followers.setdefault(entry["model"], []).append(index)
    events = [e for member in swarm.members for e in member.events()]
    published = {(e["n"], e["q"]): e for e in events if e["e"] == "pub" and w0 <= e["s"] <= w1}
    expected = sum(len(followers[nodes[n]["model"]]) - 1 for n, _ in published if n in nodes)
    latencies = []
    for e in events:
        if e["e"] == "recv" and (peer_index.get(e["p"]), e["q"]) in published:
            latencies.append(e["a"] - e["s"])
    return {"ads": len(published), "expected": expected, "arrived": len(latencies),
            "delivered_fraction": round(len(latencies) / expected, 4) if expected else None,
            "p50_s": _r(percentile(latencies, 0.5)), "p95_s": _r(percentile(latencies, 0.95))}


def measure(swarm: LightSwarm, args, label: str, warmup: float) -> dict:
    log(f"{label}: {swarm.nodes} light nodes; settling {warmup:.0f} s")
    time.sleep(warmup)
    before = snapshot(swarm)
    time.sleep(args.window)
    after = snapshot(swarm)
    time.sleep(args.drain)
    costs = window_costs(before, after)
    costs["delivery"] = delivery(swarm, before["t"], after["t"])
    meshes = [m for member in swarm.members for m in (member.status() or {}).get("mesh", [])]
    peers = [p for member in swarm.members if not member.quiet for p in (member.status() or {}).get("topic_peers", [])]
    costs["topic_peers_mean"] = _r(sum(peers) / len(peers)) if peers else None
    conns = [c for member in swarm.members for c in (member.status() or {}).get("connections", [])]
    costs["mesh_mean"] = _r(sum(meshes) / len(meshes)) if meshes else None
    costs["connections_mean"] = _r(sum(conns) / len(conns)) if conns else None
    costs["lag_max_s"] = max((member.status() or {}).get("lag_max_s", 0) for member in swarm.members)
    busy, d = costs["busy"], costs["delivery"]
    log(f"{label}: per busy node {100 * busy['cpu']:.2f} % of a core, {busy['copies_s']:.1f} ad copies/s + "
        f"{busy['control_s']:.1f} control/s, {busy['new_ads_s']:.2f} new ads/s, {busy['streams_s']:.1f} streams/s, "
        f"{busy['new_connections_s']:.2f} new connections/s; quiet node "
        f"{100 * costs['quiet']['cpu']:.2f} %; delivered {d['arrived']}/{d['expected']} "
        f"(p50 {d['p50_s']} s, p95 {d['p95_s']} s); mesh {costs['mesh_mean']}, connections {costs['connections_mean']}, "
        f"machine {costs['machine_cores_busy']} cores busy")
    return costs


# =========================================================================== real nodes


class RealNodes:
    """The SmolLM2 provider processes, started and always ended by pid."""

    def __init__(self, root: Path, light: LightSwarm) -> None:
        self.root, self.light, self.procs, self.states = root, light, {}, {}

    def start(self, name: str, span: tuple[int, int]) -> None:
        data_dir = self.root / name
        bootstrap = random.Random(name).sample(self.light.addrs(), 3)
        self.procs[name] = start_node(node_command(MODEL, span, data_dir, bootstrap), data_dir)

    def ready(self, name: str) -> dict:
        self.states[name] = wait_ready(self.procs[name], self.root / name, timeout=300)
        self.states[name]["ready_t"] = time.time()
        return self.states[name]

    def stop(self, name: str) -> None:
        proc = self.procs[name]
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                proc.kill()
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(5)

    def close(self) -> None:
        for proc in self.procs.values():  # all at once, then each waited for
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for name in self.procs:
            self.stop(name)


async def discover_round(consumer: Consumer, request: RunRequest, reference: list[int], fresh_peer: str,
                         ready_t: float) -> dict:
    """Generations until one's route goes through `fresh_peer`: the seconds from its
    ready state to that route, and whether every output equalled the reference."""
    attempts, identical = 0, True
    with trio.fail_after(DISCOVER_TIMEOUT_S):
        while True:
            attempts += 1
            try:
                outcome = await consumer.generate(request)
            except Exception as exc:  # no route yet (the stopped server's span): retried
                log(f"  attempt {attempts}: {type(exc).__name__}: {str(exc)[:120]}")
                await trio.sleep(RETRY_S)
                continue
            identical &= outcome.tokens == reference
            if any(hop.peer_id == fresh_peer for hop in outcome.route):
                return {"discover_s": round(time.time() - ready_t, 2), "attempts": attempts, "identical": identical}
            await trio.sleep(RETRY_S)


async def consumer_phase(real: RealNodes, light: LightSwarm, client_dir: Path, rounds: int) -> dict:
    bootstrap = tuple(random.Random(1).sample(light.addrs(), 3))
    params = SamplingParams(max_new_tokens=4, stop_at_eos=False)
    request = RunRequest(model=MODEL, prompt="The capital of France is", params=params, speculate=False)
    out: dict = {"rounds": []}
    async with Consumer.connect(client_dir, bootstrap, MODEL) as consumer:
        reference = (await consumer.generate(request)).tokens
        began = time.perf_counter()
        await consumer.dht.find_providers("00" * 32)  # a look-up of a key nobody provides: every round asked
        out["dht_lookup_s"] = round(time.perf_counter() - began, 3)
        out["dht_nodes"] = light.nodes + len(real.procs)
        serving = "B"
        for index in range(rounds):
            fresh = f"D{index}"
            await trio.to_thread.run_sync(real.stop, serving)
            real.start(fresh, FRESH_SPAN)
            state = await trio.to_thread.run_sync(real.ready, fresh)
            result = await discover_round(consumer, request, reference, state["peer_id"], state["ready_t"])
            log(f"discovery round {index + 1}: fresh provider used {result['discover_s']} s after it was ready "
                f"({result['attempts']} generations)")
            out["rounds"].append(result)
            serving = fresh
    return out


# =========================================================================== unit costs


def verify_cost(samples: int = 300) -> float:
    """CPU seconds to take in one new ad: decode_ad (signature, schema) and pubsub's
    own signature check over the message, both real, timed here."""
    from libp2p.peer.id import ID  # noqa: PLC0415
    from libp2p.pubsub.pb import rpc_pb2  # noqa: PLC0415
    from libp2p.pubsub.validators import signature_validator  # noqa: PLC0415

    from compushare import __version__  # noqa: PLC0415
    from compushare.hardware import detect_hardware  # noqa: PLC0415
    from compushare.net.ads import Serving, decode_ad, make_ad  # noqa: PLC0415
    from compushare.net.identity import load_or_create_identity  # noqa: PLC0415

    with tempfile.TemporaryDirectory() as tmp:
        key_pair = load_or_create_identity(Path(tmp))
    peer = ID.from_pubkey(key_pair.public_key)
    ad = make_ad(key_pair, peer.to_base58(), ["/ip4/127.0.0.1/tcp/4001/p2p/" + peer.to_base58()], detect_hardware(),
                 [Serving("ab" * 32, 0, 10, "float32", free_tokens=4096, load=0.1, block_rate=40.0)], __version__)
    # Signed as py-libp2p's Pubsub.sign_message does: the prefix, then the unsigned message.
    msg = rpc_pb2.Message(from_id=peer.to_bytes(), data=ad.raw, seqno=os.urandom(8), topicIDs=["t"])
    msg.signature = key_pair.private_key.sign(b"libp2p-pubsub:" + msg.SerializeToString())
    msg.key = key_pair.public_key.serialize()
    assert signature_validator(msg), "the timed message must pass the check it times"
    began = time.process_time()
    for _ in range(samples):
        decode_ad(ad.raw, sender=peer.to_base58())
        signature_validator(msg)
    return (time.process_time() - began) / samples


def unit_costs(first: dict, consumer: dict, hop_latency_s: float, topic_size: float):
    from compushare.net.scale_model import UnitCosts, dht_rounds, gossip_hops  # noqa: PLC0415

    busy, quiet = first["busy"], first["quiet"]
    new_ad = verify_cost()
    msgs = busy["copies_s"] + busy["control_s"]
    per_copy = max(0.0, (busy["cpu"] - quiet["cpu"] - busy["new_ads_s"] * new_ad) / msgs) if msgs else 0.0
    rounds = dht_rounds(consumer["dht_nodes"]) + 1  # the look-up's rounds, then the ask
    return UnitCosts(
        cpu_s_per_copy=per_copy, cpu_s_per_new_ad=new_ad, cpu_s_per_control=per_copy, cpu_s_idle=quiet["cpu"],
        bytes_per_ad=busy["copy_bytes_s"] / busy["copies_s"] if busy["copies_s"] else 0.0,
        bytes_per_control=busy["control_bytes_s"] / busy["control_s"] if busy["control_s"] else 0.0,
        copies_per_ad=busy["copies_s"] / busy["new_ads_s"] if busy["new_ads_s"] else 0.0,
        control_per_s=busy["control_s"],
        hop_s=hop_latency_s / max(1.0, gossip_hops(topic_size)),
        dht_rtt_s=(consumer["dht_lookup_s"] or 0.0) / rounds, bench_topic_peers=first.get("topic_peers_mean") or 0.0)


def _r(value, digits: int = 4):
    return None if value is None else round(value, digits)


# =========================================================================== main


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=200, help="light nodes at the second window")
    parser.add_argument("--first", type=int, default=50, help="light nodes at the first window")
    parser.add_argument("--per-process", type=int, default=25)
    parser.add_argument("--quiet", type=int, default=5, help="of the light nodes: quiet ones, in their own process")
    parser.add_argument("--models", type=int, default=4)
    parser.add_argument("--warmup", type=float, default=45.0, help="seconds before the first window")
    parser.add_argument("--settle", type=float, default=150.0,
                        help="seconds between the last node's start and the second window: a node's start-up "
                             "look-ups (a provider record per key) are over by then")
    parser.add_argument("--window", type=float, default=60.0)
    parser.add_argument("--drain", type=float, default=10.0)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--results", default=str(REPO / "bench" / "results" / "scale.jsonl"))
    args = parser.parse_args()
    if not 1 <= args.quiet < args.first < args.nodes:
        parser.error("need 1 <= --quiet < --first < --nodes (the quiet nodes measure a node's upkeep)")
    signal.signal(signal.SIGTERM, _terminated)  # run the finally below
    from compushare.hardware import detect_hardware  # noqa: PLC0415
    from compushare.model.catalog import resolve_model  # noqa: PLC0415

    root = Path(tempfile.mkdtemp(prefix="compushare-scale-"))
    light = LightSwarm(root, models=args.models, hardware_json=json.dumps(detect_hardware().to_wire()))
    real = RealNodes(root, light)
    try:
        client_dir = root / "client"
        resolve_model(MODEL, client_dir)
        grow(light, args.first - args.quiet, args.per_process)
        light.add(args.quiet, quiet=True)
        light.wait_ready(300)
        for name, span in REAL.items():
            real.start(name, span)
        for name in REAL:
            real.ready(name)
        log(f"real providers ready: {', '.join(f'{n} {s[0]}:{s[1]}' for n, s in REAL.items())}")
        first = measure(light, args, f"{args.first} nodes", args.warmup)
        grow(light, args.nodes - args.first, args.per_process)
        second = measure(light, args, f"{args.nodes} nodes", args.settle)
        try:
            consumer = trio.run(consumer_phase, real, light, client_dir, args.rounds)
        except Exception as exc:  # a consumer that found no route is a result too (a saturated machine)
            if TERMINATED:
                raise
            log(f"discovery failed: {type(exc).__name__}: {str(exc)[:200]}")
            consumer = {"rounds": [], "dht_lookup_s": None, "dht_nodes": light.nodes + len(real.procs),
                        "error": f"{type(exc).__name__}: {exc}"[:300]}
        result = report(args, first, second, consumer)
    finally:
        try:
            real.close()
        finally:
            light.close()
            shutil.rmtree(root, ignore_errors=True)
    return finish(result, args.results)


TERMINATED: list[bool] = []  # set by SIGTERM: whatever fails after it is no result


def _terminated(*_) -> None:
    # Once: a second SIGTERM (a kill of both `timeout` and this process) must not cut
    # the clean-up short and leave provider processes behind.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    TERMINATED.append(True)
    sys.exit(143)


def grow(light: LightSwarm, nodes: int, per_process: int) -> None:
    """Start `nodes` more light nodes, one process at a time (each joins through the
    ones already up)."""
    while nodes > 0:
        light.add(min(per_process, nodes))
        nodes -= per_process
        light.wait_ready(900)
    log(f"{light.nodes} light nodes up")


def targets_met(result: dict) -> bool:
    return bool(
        result["cpu_ratio_200_50"] is not None and result["cpu_ratio_200_50"] <= TARGETS["cpu_flat"]
        and result["delivered_fraction"] >= TARGETS["delivered_fraction"]
        and result["ad_p95_s"] <= TARGETS["ad_p95_s"]
        and result["discover_s"] is not None and result["discover_s"] <= TARGETS["discover_s"]
        and result["projected_msgs_per_node_s_10000"] <= TARGETS["projected_msgs_per_node_s_10000"]
        and result["identical"])


def report(args, first: dict, second: dict, consumer: dict) -> dict:
    from compushare.net.scale_model import RETRY_S as RETRY_WAIT_S  # noqa: PLC0415
    from compushare.net.scale_model import Swarm, project, table  # noqa: PLC0415

    topic = (args.first - args.quiet) / args.models  # a topic's followers at the first window
    costs = unit_costs(first, consumer, first["delivery"]["p50_s"] or 0.0, topic)
    predicted = {n: project(Swarm(nodes=n, models=args.models, provider_fraction=0.9), costs, wait_s=RETRY_WAIT_S)
                 for n in (args.first, args.nodes)}
    # Discovery as measured here: a consumer with no route yet looks again every RETRY_S.
    projections = table(costs, nodes=PROJECT_NODES, models=PROJECT_MODELS, provider_fraction=0.9, wait_s=RETRY_WAIT_S)
    for p in projections:
        log(f"projected {p.nodes:>6} nodes, {p.models:>2} models: {p.msgs_per_node_s:6.1f} msgs/s, "
            f"{100 * p.cpu_share:5.2f} % of a core, {p.bytes_per_node_s / 1e3:6.1f} kB/s, period {p.period_s:.0f} s, "
            f"discover {p.discover_s:.1f} s")
    headline = next(p for p in projections if p.nodes == 10000 and p.models == HEADLINE_MODELS)
    worst = max((p for p in projections if p.nodes == 10000), key=lambda p: p.msgs_per_node_s)
    rounds = consumer["rounds"]
    b1, b2 = first["busy"], second["busy"]
    result = {
        "nodes": args.nodes + len(REAL) + 1,
        "light_nodes": args.nodes,
        "light_nodes_first": args.first,  # the "_50" figures are at this many, the "_200" at light_nodes
        "models": args.models,
        "discover_s": max((r["discover_s"] for r in rounds), default=None),
        "discover_error": consumer.get("error"),
        "discover_rounds": rounds,
        "identical": bool(rounds) and all(r["identical"] for r in rounds),
        "delivered_fraction": min(first["delivery"]["delivered_fraction"] or 0,
                                  second["delivery"]["delivered_fraction"] or 0),
        "ad_p95_s": max(first["delivery"]["p95_s"] or 0, second["delivery"]["p95_s"] or 0),
        "cpu_per_node_50": _r(b1["cpu"]),
        "cpu_per_node_200": _r(b2["cpu"]),
        "cpu_ratio_200_50": _r(b2["cpu"] / b1["cpu"]) if b1["cpu"] else None,
        "msgs_per_node_s_50": _r(b1["copies_s"] + b1["control_s"], 2),
        "msgs_per_node_s_200": _r(b2["copies_s"] + b2["control_s"], 2),
        "predicted_msgs_per_node_s": {n: _r(p.msgs_per_node_s, 2) for n, p in predicted.items()},
        "predicted_cpu_per_node": {n: _r(p.cpu_share) for n, p in predicted.items()},
        "projected_msgs_per_node_s_10000": _r(headline.msgs_per_node_s, 2),
        # None when no DHT round trip was measured (the consumer's phase failed).
        "projected_discover_s_10000": _r(headline.discover_s, 2) if consumer.get("dht_lookup_s") else None,
        "projected_cpu_per_node_10000": _r(headline.cpu_share),
        "projected_models_10000": HEADLINE_MODELS,
        "projected_worst_10000": {"models": worst.models, "msgs_per_node_s": _r(worst.msgs_per_node_s, 2),
                                  "cpu_share": _r(worst.cpu_share)},
        "projection": [{"nodes": p.nodes, "models": p.models, "msgs_per_node_s": _r(p.msgs_per_node_s, 2),
                        "cpu_share": _r(p.cpu_share), "kbytes_per_node_s": _r(p.bytes_per_node_s / 1e3, 2),
                        "period_s": _r(p.period_s, 1), "discover_s": _r(p.discover_s, 2)} for p in projections],
        "unit_costs": {k: _r(v, 7) for k, v in vars(costs).items()},
        "window_50": first,
        "window_200": second,
        "dht_lookup_s": consumer["dht_lookup_s"],
        "machine": {"cpus": os.cpu_count()},
        # The machine's own limit, beside the figures: a window with every core busy
        # measures CPU queueing (late ads, failed look-ups) as much as membership.
        "machine_cores_busy_50": first.get("machine_cores_busy"),
        "machine_cores_busy_200": second.get("machine_cores_busy"),
        "saturated_200": (second.get("machine_cores_busy") or 0) >= 0.9 * (os.cpu_count() or 1),
    }
    result["targets_met"] = targets_met(result)
    return result


if __name__ == "__main__":
    sys.exit(main())
