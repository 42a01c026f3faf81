"""A chain whose middle provider is behind NAT: relayed, hole-punched and all-public
side by side in one run; hole-punch success between two NAT'd hosts; relay quotas.

    sudo .venv/bin/python bench/nat.py [--delay-ms 20] [--trials 3] [--tokens 48] [--attempts 20]

One netlab lab (tools/netlab), every host delaying what it receives by D ms (a round
trip between two hosts is 2 x D), SmolLM2-135M (fp32, 1 torch thread) in three spans:

  host 1  A       blocks 0:10, public, the bootstrap (public nodes relay)
  host 2  C       blocks 20:30, public
  host 3  Ppub    blocks 10:20, public
  host 4  Prelay  blocks 10:20, behind NAT, `node --no-hole-punch`: every connection
                  to it stays relayed
  host 5  Ppunch  blocks 10:20, behind NAT, hole punching on
  host 6  the consumer (a subprocess of this script), public, listening on its own
          lab address (so that the NAT'd provider can be punched to)
  host 7  the hole-punch probe (a subprocess), behind its own NAT; its targets run
          in host 5's namespace beside Ppunch

Nodes run with `--ad-period 1 --api-port -1`. The run waits until A, C and Ppub find
themselves public and both NAT'd providers' node.json say `private` with 2 relays.

Chains (consumer, host 6): routes [A, Prelay, C] (`relayed`), [A, Ppunch, C]
(`punched`) and [A, Ppub, C] (`public`), fixed (no planner: the records come from the
DHT, picked by peer id), open_chain(push=True, direct=True), greedy, stop_at_eos
off, on the `freeform` prompt of bench/wan_prompts.json (chat template applied).
After one untimed warm-up of each mode, the modes are interleaved in each of
--trials rounds; figures are medians. Before every chain (warm-up included) the
consumer closes every connection it has to the middle provider, so each trial
reaches it afresh: through a relay (its record's circuit addresses come first), then
DCUtR where it runs.
  tok/s  decode only, as in bench/wan.py: a trial makes --tokens + 1 tokens and
         tok/s = --tokens / (time of the last token - time of the first).
  ttft   from just before open_chain (dialling the middle provider through its relay,
         the hole punch and the wait for it included) to the first token.
  conn   how the consumer's session stream to the middle provider travels
         (`relayed` or `direct`), and the kinds of all its connections to it at the
         end of the generation.
`identical`: every trial's tokens (warm-ups too) equal a single-process greedy
reference computed in the consumer (compushare.model.blocks.load_full_model, as
bench/wan.py's `local`).

Hole punching between two NAT'd hosts: --attempts attempts, each between two new
lightweight libp2p hosts (new identities, new listen ports: new connections and new
NAT mappings), both with net.traversal.Traversal(serve=False). The target runs in
host 5 (Ppunch's NAT) and reserves a slot on one public relay (A, C, Ppub in turn);
the probe, in host 7 (its own NAT), joins A, shows that a direct dial to the target
(its own address and its router's address with its port) fails within DIRECT_TRY_S,
then net.dial.dial through the target's circuit address (relay at once, then DCUtR);
a success is a direct (non-circuit) connection within PUNCH_WINDOW_S of starting
that dial. Both ends then close every connection (host.disconnect: leaving
py-libp2p's host does not). Fresh targets, not Ppunch itself: after a hole punch
the relay keeps the circuit open (a product bug, see relay_ledgers' circuits_open),
and 8 leaked circuits (circuits_per_peer) make a relay refuse every new circuit to
that peer. Reported: successes / attempts and the median time to the direct
connection.

Relay quotas (a subprocess in host 6's namespace, everything on its 127.0.0.1): an
in-process net.relay.QuotaRelay (offer=lambda: True) whose quotas come from a
config.toml [relay] table read by config.NodeConfig.build (reservations=1,
circuits_per_peer=1, circuit_bytes=262144, circuit_duration_s=3), with small hosts
that trigger one refusal of each kind: reservation (a second peer asks for a slot),
circuit (a second circuit to the same target while one is open), bytes (512 KiB
pushed through one circuit) and duration (a circuit kept open past 3 s).
relay_quota_enforced: the relay's ledger counted >= 1 refusal of every kind.

Needs root; the namespaces are removed, the nodes stopped by pid and the temp dir
removed on every exit path (--keep keeps the temp dir, node logs included). Human-
readable lines first; the last line is one JSON object, also appended to
bench/results/nat.jsonl with run, date and commit (--results '' skips that).
Targets (the issue's): punch_success >= 18 of 20; punched_tok_s >= 0.95 x
public_tok_s; identical true.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _common import REPO, finish, stop_lab  # noqa: E402  (this checkout's src/, the shared caches)

sys.path.insert(0, str(REPO / "tools"))
import netlab  # noqa: E402  (tools/netlab, the project's namespace harness)

MODEL = "smollm2-135m"
PROMPTS = Path(__file__).resolve().with_name("wan_prompts.json")
PROMPT = "freeform"
# Our own namespace names, one prefix per run: a fixed one would let a second run of
# this bench (entering its lab removes every namespace of its prefix) kill this one's.
PFX = f"nat{os.getpid() % 100000}"
A, C, PPUB, PRELAY, PPUNCH, CONSUMER, PROBE = 1, 2, 3, 4, 5, 6, 7
HOSTS = 7
NAT = frozenset({PRELAY, PPUNCH, PROBE})
PUBLIC_NODES = (A, C, PPUB)
MODES = {"relayed": PRELAY, "punched": PPUNCH, "public": PPUB}  # mode: its middle provider
NODE_FLAGS = ["--ad-period", "1", "--api-port", "-1"]
WARMUP_TOKENS = 4
TRIAL_TIMEOUT_S = 120
CLIENT_TIMEOUT_S = 900
READY_TIMEOUT_S = 300
NAT_TIMEOUT_S = 150  # AutoNAT verdicts, then 2 relay slots each
RECORDS_TIMEOUT_S = 90  # the consumer finds every record, the NAT'd ones with circuits
DIRECT_TRY_S = 2.0  # the probe's direct dial, which the NAT must make fail
PUNCH_WINDOW_S = 10.0  # from the relay dial's start to a direct connection
QUOTAS = {"reservations": 1, "circuits_per_peer": 1, "circuit_bytes": 262144, "circuit_duration_s": 3}
QUOTA_TIMEOUT_S = 120
SINK = "/compushare-bench/sink/1.0.0"


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def prompt_text() -> str:
    return json.loads(PROMPTS.read_text())[PROMPT]


def conn_kind(conn) -> str:
    from compushare.net.reachability import is_circuit

    return "relayed" if all(is_circuit(str(a)) for a in conn.get_transport_addresses()) else "direct"


# ---------------------------------------------------------------- the consumer (host 6)


def client_main(spec: dict, trials: int, tokens: int) -> None:
    """Runs inside the consumer's namespace; prints one JSON line of trial results."""
    import torch
    import trio
    from libp2p.peer.id import ID

    from compushare.model.blocks import load_full_model
    from compushare.net.reachability import is_circuit
    from compushare.net.traversal import traversal_of
    from compushare.pipeline.client.chain import open_chain
    from compushare.pipeline.client.consumer import Consumer, RunRequest, prompt_ids_of
    from compushare.pipeline.client.discovery import discover_servers
    from compushare.pipeline.client.generate import generate
    from compushare.pipeline.client.routing import Hop
    from compushare.pipeline.client.sampling import SamplingParams

    torch.set_num_threads(1)
    data_dir = Path(tempfile.mkdtemp(prefix="compushare-nat-client-"))
    try:
        async def main() -> dict:
            async with Consumer.connect(data_dir, (spec["bootstrap"],), MODEL, spot_check_rate=0.0,
                                        listen=(spec["listen"],)) as consumer:
                host, model = consumer.host, consumer.model
                traversal = traversal_of(host)
                ids = prompt_ids_of(consumer.tokenizer, RunRequest(model=MODEL, prompt=prompt_text()))

                def reference(steps: int) -> list[int]:
                    full = load_full_model(model.path)
                    produced = []
                    with torch.inference_mode():
                        out = full(input_ids=torch.tensor([ids]), use_cache=True)
                        while True:
                            token = int(torch.argmax(out.logits[0, -1]))
                            produced.append(token)
                            if len(produced) > steps:
                                return produced
                            out = full(input_ids=torch.tensor([[token]]), past_key_values=out.past_key_values,
                                       use_cache=True)

                local = await trio.to_thread.run_sync(reference, tokens)
                log(f"  local reference: {len(local)} tokens")

                # The records, by peer id; a NAT'd provider's must carry its circuits.
                wanted = {name: spec["peers"][name] for name in ("A", "C", *MODES)}
                natd = {spec["peers"]["relayed"], spec["peers"]["punched"]}
                began = time.monotonic()
                while True:
                    records = {r.peer_id: r for r in await discover_servers(consumer.dht, model.model_id,
                                                                             model.num_blocks)}
                    missing = [name for name, peer in wanted.items() if peer not in records
                               or (peer in natd and not any(is_circuit(a) for a in records[peer].addrs))]
                    if not missing:
                        break
                    if time.monotonic() - began > RECORDS_TIMEOUT_S:
                        raise RuntimeError(f"no usable server records of {missing} within {RECORDS_TIMEOUT_S} s")
                    await trio.sleep(1.0)
                log(f"  records found in {time.monotonic() - began:.1f} s")

                def hop(peer: str) -> Hop:
                    record = records[peer]
                    return Hop(record, record.start, record.end)

                routes = {mode: [hop(wanted["A"]), hop(wanted[mode]), hop(wanted["C"])] for mode in MODES}
                out: dict = {"local": local, "prompt_tokens": len(ids),
                             "routes": {m: [[h.start, h.end] for h in r] for m, r in routes.items()},
                             "middle_addrs": {m: list(routes[m][1].record.addrs) for m in MODES},
                             **{mode: [] for mode in MODES}, "warmup": {}}

                async def fresh(peer: ID) -> None:
                    """No connection to `peer` left, for 0.3 s in a row (a hole punch
                    still under way can bring one back): the next chain dials it anew."""
                    network = host.get_network()
                    with trio.move_on_after(10):
                        quiet = 0
                        while quiet < 6:
                            if network.connections.get(peer):
                                quiet = 0
                                await host.disconnect(peer)
                            else:
                                quiet += 1
                            await trio.sleep(0.05)
                    network.unblock_peer(peer)

                async def chain_trial(mode: str, steps: int) -> dict:
                    route = routes[mode]
                    middle = ID.from_base58(route[1].peer_id)
                    await fresh(middle)
                    dials, punched = traversal.relayed_dials, traversal.punched
                    times, produced = [], []
                    with trio.fail_after(TRIAL_TIMEOUT_S):
                        began = time.perf_counter()
                        connected_before = len(host.get_network().connections.get(middle, []))
                        async with open_chain(host, route, model.model_id, max_tokens=len(ids) + steps + 8,
                                              hidden_size=model.hidden_size, push=True, direct=True) as chain:
                            opened = time.perf_counter()
                            kinds_at_open = [conn_kind(c) for c in host.get_network().connections.get(middle, [])]

                            def on_token(token: int) -> None:
                                times.append(time.perf_counter())
                                produced.append(token)

                            await generate(chain, consumer.head, ids,
                                           SamplingParams(max_new_tokens=steps + 1, stop_at_eos=False),
                                           on_token=on_token, speculate=False)
                            conns = host.get_network().connections.get(middle, [])
                            stream = chain.hops[1].framed.stream
                            session = [conn_kind(c) for c in conns if getattr(c, "muxed_conn", None)
                                       is stream.muxed_conn]
                            kinds = [conn_kind(c) for c in conns]
                            direct_steps = chain.core.direct_steps
                    return {"tokens": produced, "tok_s": steps / (times[-1] - times[0]),
                            "ttft_s": times[0] - began, "open_s": opened - began,
                            "session_conn": session[0] if session else "unknown", "conns": kinds,
                            "conns_at_open": kinds_at_open, "fresh": connected_before == 0, "direct_steps": direct_steps,
                            "relayed_dial": traversal.relayed_dials - dials, "punched_in_dial": traversal.punched - punched}

                for mode in MODES:  # warm-up: first sessions, first pushes, first punches
                    run = await chain_trial(mode, WARMUP_TOKENS)
                    out["warmup"][mode] = run
                    log(f"  warm-up {mode:8} ttft {run['ttft_s']:5.2f} s  session {run['session_conn']:7}  "
                        f"conns {run['conns']}")
                for index in range(trials):
                    for mode in MODES:
                        run = await chain_trial(mode, tokens)
                        out[mode].append(run)
                        log(f"  trial {index + 1} {mode:8} {run['tok_s']:6.2f} tok/s  ttft {run['ttft_s']:5.2f} s  "
                            f"(chain open {run['open_s']:5.2f} s)  session {run['session_conn']:7}  conns "
                            f"{run['conns']}  punched in dial {run['punched_in_dial']}  direct steps "
                            f"{run['direct_steps']}" + ("" if run["fresh"] else "  NOT FRESH (already connected)"))
                out["net"] = traversal.stats()
                # Printed before the consumer's teardown: a failure there loses no measurement.
                print(json.dumps(out), flush=True)
                return out

        trio.run(main)
    finally:
        shutil.rmtree(data_dir, ignore_errors=True)


# ---------------------------------------------------------------- hole punching (hosts 5 and 7)


async def close_all(host) -> None:
    """Close every connection of `host`: leaving py-libp2p's host does not (its TCP
    sockets stay open, and a relay would keep the circuits through them)."""
    import trio

    with trio.CancelScope(shield=True), trio.move_on_after(5):
        for peer in list(host.get_network().connections):
            with contextlib.suppress(Exception):
                await host.disconnect(peer)


async def wait_file(path: Path, timeout: float):
    import trio

    with trio.fail_after(timeout):
        while not path.exists():
            await trio.sleep(0.02)
    return json.loads(path.read_text())


def write_file(path: Path, data: dict) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data))
    tmp.rename(path)


def punch_target_main(spec: dict, attempts: int) -> None:
    """Host 5 (NAT'd), beside Ppunch: for each attempt a new host (new identity, new
    port) reserves a slot on a public relay and says where it is; it stays until the
    probe is done with it. Prints one JSON line: one entry per attempt."""
    import trio
    from libp2p.crypto.ed25519 import create_new_key_pair

    from compushare.net.host import full_addrs, open_host
    from compushare.net.reachability import circuit_addrs
    from compushare.net.traversal import Traversal

    shared = Path(spec["dir"])

    async def one(index: int) -> dict:
        relay_id, relay_addrs = spec["relays"][index % len(spec["relays"])]
        async with open_host(create_new_key_pair(), [f"/ip4/{spec['listen']}/tcp/0"]) as host, \
                trio.open_nursery() as nursery:
            traversal = Traversal(host, serve=False)
            await nursery.start(traversal.run)
            try:
                me = host.get_id().to_base58()
                traversal.verdicts.status = "private"  # NAT'd by construction (it runs no AutoNAT of its own)
                reserved = await traversal._reserve(relay_id, relay_addrs)
                own = [a for a in full_addrs(host) if "/p2p-circuit" not in a]
                port = own[0].split("/tcp/")[1].split("/")[0]
                write_file(shared / f"target-{index}.json", {
                    "peer_id": me, "reserved": reserved, "relay": relay_id,
                    "circuits": circuit_addrs(relay_id, relay_addrs, me),
                    "direct": own + [f"/ip4/{spec['seen']}/tcp/{port}"]})
                done = await wait_file(shared / f"done-{index}.json", 90)
                return {"reserved": reserved, "punched_here": traversal.punched, **done}
            finally:
                await close_all(host)
                nursery.cancel_scope.cancel()

    async def main() -> list[dict]:
        return [await one(index) for index in range(attempts)]

    print(json.dumps(trio.run(main)), flush=True)


def punch_main(spec: dict, attempts: int) -> None:
    """Host 7 (NAT'd): for each attempt a new host (new identity, new port) joins the
    swarm, shows that a direct dial to that attempt's target fails, then reaches it
    through its relay and waits for the hole punch. Prints one JSON line."""
    import trio
    from libp2p.crypto.ed25519 import create_new_key_pair
    from libp2p.peer.id import ID

    from compushare.net.dial import dial, parse_peer_addr, peer_info
    from compushare.net.host import open_host
    from compushare.net.traversal import Traversal, has_direct

    boot = parse_peer_addr(spec["bootstrap"])
    shared = Path(spec["dir"])

    async def measure(host, traversal, target: dict, out: dict) -> None:
        peer = ID.from_base58(target["peer_id"])
        with trio.fail_after(10):  # a NAT'd consumer joins the swarm first
            await dial(host, boot.peer_id, boot.addrs, timeout=10)
        began = time.monotonic()
        try:
            with trio.fail_after(DIRECT_TRY_S):
                await host.connect(peer_info(peer, target["direct"]))
            out["direct_dial"] = "connected"
        except Exception as exc:  # noqa: BLE001  (TooSlowError, or py-libp2p's dial errors)
            out["direct_dial"] = f"failed: {type(exc).__name__} after {time.monotonic() - began:.1f}s"
        with contextlib.suppress(Exception):
            host.get_network().unblock_peer(peer)
        if out["direct_dial"] == "connected":  # the NAT let a dial in: not a hole punch
            out["error"] = "direct dial went through"
            return
        began = time.monotonic()
        try:
            await dial(host, peer, target["circuits"], timeout=PUNCH_WINDOW_S)
            out["relayed_s"] = time.monotonic() - began
            with trio.move_on_at(trio.current_time() + PUNCH_WINDOW_S - (time.monotonic() - began)):
                while not has_direct(host, peer):
                    await trio.sleep(0.02)
        except Exception as exc:  # noqa: BLE001  (no relay reached it, or the window ran out)
            out["error"] = f"{type(exc).__name__}: {exc}"[:300]
        out["punched"] = has_direct(host, peer)
        if out["punched"]:
            out["direct_s"] = time.monotonic() - began
            addrs = [str(a) for c in host.get_network().connections.get(peer, [])
                     for a in c.get_transport_addresses() if "/p2p-circuit" not in str(a)]
            out["direct_addr"] = addrs[0] if addrs else None
        out["punched_in_dial"] = traversal.punched

    async def one(index: int) -> dict:
        out: dict = {"attempt": index + 1, "punched": False}
        try:
            target = await wait_file(shared / f"target-{index}.json", 60)
            out["target_reserved"] = target["reserved"]
            with trio.move_on_after(DIRECT_TRY_S + PUNCH_WINDOW_S + 30) as scope:
                async with open_host(create_new_key_pair(), [f"/ip4/{spec['listen']}/tcp/0"]) as host, \
                        trio.open_nursery() as nursery:
                    traversal = Traversal(host, serve=False)
                    await nursery.start(traversal.run)
                    try:
                        await measure(host, traversal, target, out)
                    finally:
                        await close_all(host)
                        nursery.cancel_scope.cancel()
            if scope.cancelled_caught:
                out.setdefault("error", "attempt timed out")
        except Exception as exc:  # noqa: BLE001
            out.setdefault("error", f"{type(exc).__name__}: {exc}"[:300])
        finally:
            write_file(shared / f"done-{index}.json", {"probe_punched": out["punched"]})
        return out

    async def main() -> list[dict]:
        results = []
        for index in range(attempts):
            result = await one(index)
            results.append(result)
            log(f"  punch attempt {index + 1:2}: direct dial {result.get('direct_dial', '?')}; "
                + (f"direct after {result['direct_s']:.2f} s ({result.get('direct_addr')})" if result["punched"]
                   else f"no direct connection ({result.get('error', 'still relayed')})"))
        return results

    print(json.dumps(trio.run(main)), flush=True)


# ---------------------------------------------------------------- relay quotas (127.0.0.1)


def quotas_main() -> None:
    """Runs inside a namespace, on its loopback; prints one JSON line: the ledger."""
    import logging

    import trio
    from libp2p.crypto.ed25519 import create_new_key_pair
    from libp2p.tools.anyio_service import background_trio_service

    from compushare.config import NodeConfig
    from compushare.net.dial import dial
    from compushare.net.host import full_addrs, open_host
    from compushare.net.reachability import circuit_addrs
    from compushare.net.relay import QuotaRelay
    from compushare.net.traversal import Traversal

    logging.getLogger("compushare.net.relay").setLevel(logging.ERROR)  # each refusal is reported below
    said: list[str] = []  # why a reservation failed on the asking side (net/traversal.py logs it)

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            said.append(record.getMessage()[:300])

    traversal_log = logging.getLogger("compushare.net.traversal")
    traversal_log.setLevel(logging.INFO)
    traversal_log.addHandler(Keep())
    traversal_log.propagate = False  # kept in the JSON, not printed
    data_dir = Path(tempfile.mkdtemp(prefix="compushare-nat-quotas-"))
    (data_dir / "config.toml").write_text("[relay]\n" + "".join(f"{k} = {v}\n" for k, v in QUOTAS.items()))
    quotas = NodeConfig.build(data_dir).relay_quotas
    listen = ["/ip4/127.0.0.1/tcp/0"]
    steps: dict[str, str] = {}

    async def main() -> dict:
        async with open_host(create_new_key_pair(), listen) as relay_host, \
                open_host(create_new_key_pair(), listen) as t1, open_host(create_new_key_pair(), listen) as t2, \
                open_host(create_new_key_pair(), listen) as s1, open_host(create_new_key_pair(), listen) as s2:
            relay = QuotaRelay(relay_host, quotas, offer=lambda: True)
            ledger = relay.ledger
            async with background_trio_service(relay), trio.open_nursery() as nursery:
                travs = {}
                for name, host in (("t1", t1), ("t2", t2), ("s1", s1), ("s2", s2)):
                    travs[name] = Traversal(host, serve=False, punch=False)  # circuits stay circuits
                    travs[name].verdicts.status = "private"  # stand-ins for NAT'd peers (_reserve asks)
                    await nursery.start(travs[name].run)
                relay_id, relay_addrs = relay_host.get_id().to_base58(), full_addrs(relay_host)
                target = t1.get_id()
                circuit = circuit_addrs(relay_id, relay_addrs, target.to_base58())

                async def sink(stream) -> None:
                    with contextlib.suppress(Exception):
                        while await stream.read(65536):
                            pass

                t1.set_stream_handler(SINK, sink)

                async def until(what: str, check, timeout: float = 8.0) -> bool:
                    with trio.move_on_after(timeout):
                        while not check():
                            await trio.sleep(0.05)
                        return True
                    steps[what] = steps.get(what, "") + " (not seen in time)"
                    return False

                # reservation: the only slot goes to t1; t2 asks for a second one
                steps["t1 reserves"] = str(await travs["t1"]._reserve(relay_id, relay_addrs))
                steps["t2 reserves"] = str(await travs["t2"]._reserve(relay_id, relay_addrs))
                # circuit: s1 -> t1 open, then s2 -> t1 (t1 is already an end of one)
                await dial(s1, target, circuit, timeout=10)
                steps["s1 -> t1 circuit"] = "open"
                try:
                    await dial(s2, target, circuit, timeout=10)
                    steps["s2 -> t1 circuit"] = "open (not refused)"
                except Exception as exc:  # noqa: BLE001
                    steps["s2 -> t1 circuit"] = f"refused: {type(exc).__name__}"
                # bytes: 512 KiB through s1's circuit (its quota: 256 KiB both ways)
                sent = 0
                try:
                    with trio.fail_after(10):
                        stream = await s1.new_stream(target, [SINK])
                        chunk = os.urandom(65536)
                        for _ in range(8):
                            await stream.write(chunk)
                            sent += len(chunk)
                        await stream.close()
                except Exception as exc:  # noqa: BLE001  (the relay resets the circuit)
                    steps["bytes"] = f"{type(exc).__name__} after {sent} bytes written"
                await until("bytes", lambda: ledger.refusals["bytes"] >= 1)
                steps.setdefault("bytes", f"{sent} bytes written")
                # duration: a new circuit (s2 -> t1, once the first is gone), kept open past its 3 s
                await until("first circuit closed", lambda: not ledger.circuits)
                with contextlib.suppress(Exception):
                    await s1.disconnect(target)
                opened_at = time.monotonic()
                await dial(s2, target, circuit, timeout=10)
                steps["s2 -> t1 second circuit"] = "open"
                await until("duration", lambda: ledger.refusals["duration"] >= 1, quotas.circuit_duration_s + 5)
                steps["duration"] = f"refused after {time.monotonic() - opened_at:.1f} s" \
                    if ledger.refusals["duration"] else "not refused"
                nursery.cancel_scope.cancel()
            return {"quotas": {k: getattr(quotas, k) for k in QUOTAS}, "ledger": ledger.stats(), "log": said,
                    "last_refusal": dict(ledger.last_refusal), "steps": steps}

    try:
        print(json.dumps(trio.run(main)), flush=True)
    finally:
        shutil.rmtree(data_dir, ignore_errors=True)


# ---------------------------------------------------------------- the run (root namespace)


def ping_rtt_ms(text: str) -> float | None:
    """The median of ping's per-reply times."""
    times = [float(m) for m in re.findall(r"time=([\d.]+) ms", text)]
    return statistics.median(times) if times else None


def read_state(data_dir: Path) -> dict:
    with contextlib.suppress(OSError, ValueError):
        return json.loads((data_dir / "node.json").read_text())
    return {}


def wait_for(what: str, check, timeout: float) -> float:
    began = time.monotonic()
    while time.monotonic() - began < timeout:
        if check():
            return time.monotonic() - began
        time.sleep(0.25)
    raise RuntimeError(f"not within {timeout:.0f} s: {what}")


TEARDOWN_FAILURES: list[str] = []  # subprocesses that printed their results, then failed


def sub_json(lab, host: int, cmd: list[str], timeout: float, what: str):
    done = lab.run(host, [sys.executable, __file__, *cmd], stdout=subprocess.PIPE, text=True,
                   timeout=timeout)  # its stderr (progress) passes through
    lines = [line for line in done.stdout.strip().splitlines() if line.startswith(("{", "["))]
    if done.returncode != 0:
        if not lines:
            raise RuntimeError(f"{what} failed (exit {done.returncode}); its stderr is above")
        TEARDOWN_FAILURES.append(f"{what}: exit {done.returncode} after printing its results")
        log(f"WARNING: {what} exited {done.returncode} after printing its results (its stderr is above)")
    return json.loads(lines[-1])


def run_lab(args) -> dict:
    from compushare.app.swarm import node_command, split_blocks, start_node, wait_ready
    from compushare.model.catalog import resolve_model

    root = Path(tempfile.mkdtemp(prefix="compushare-nat-"))
    procs: list[subprocess.Popen] = []
    lab = netlab.Lab(netlab.Topology(PFX, hosts=HOSTS, delay_ms=args.delay_ms, nat=NAT))
    failed = True
    out: dict = {}
    try:
        lab.__enter__()  # removes a lab left by a killed earlier run, then builds this one
        model = resolve_model(MODEL, root / "reference")
        first, middle, last = split_blocks(model.num_blocks, 3)
        print(f"{MODEL}: A {first} and C {last} public, the middle {middle} on Ppub (public), Prelay (NAT'd, no "
              f"hole punching) and Ppunch (NAT'd); {args.delay_ms} ms added per one-way transit", flush=True)
        nodes = {A: ("a", first, []), C: ("c", last, []), PPUB: ("ppub", middle, []),
                 PRELAY: ("prelay", middle, ["--no-hole-punch"]), PPUNCH: ("ppunch", middle, [])}
        dirs: dict[int, Path] = {host: root / name for host, (name, _span, _extra) in nodes.items()}
        cmds: dict[int, list[str]] = {}
        live: dict[int, subprocess.Popen] = {}
        bootstrap: list[str] = []
        began = time.monotonic()
        for host, (name, span, extra) in nodes.items():
            cmds[host] = node_command(MODEL, span, dirs[host], bootstrap, NODE_FLAGS + extra)
            cmds[host][cmds[host].index("--listen") + 1] = f"/ip4/{lab.addr(host)}/tcp/0"
            live[host] = start_node(lab.wrap(host, cmds[host]), dirs[host])
            procs.append(live[host])
            if host == A:
                bootstrap = wait_ready(live[host], dirs[host], timeout=READY_TIMEOUT_S)["addrs"][:1]
        for host, proc in live.items():
            wait_ready(proc, dirs[host], timeout=READY_TIMEOUT_S)
        print(f"5 nodes serving after {time.monotonic() - began:.0f} s", flush=True)

        def still_up() -> None:
            """A node that died (a product bug: see the report) is restarted, twice at most."""
            for host, proc in list(live.items()):
                if proc.poll() is None:
                    continue
                text = dirs[host].joinpath("node.log").read_text(errors="replace")
                errors = re.findall(r"^[\s│|]*([A-Za-z_.]*(?:Error|Exception)\b[^│\n]*)", text, re.M)
                why = errors[-1].strip() if errors else f"exit {proc.returncode}"
                crash = {"node": nodes[host][0], "exit": proc.returncode, "error": why,
                         "at_s": round(time.monotonic() - began)}
                out.setdefault("node_crashes", []).append(crash)
                log(f"WARNING: node {nodes[host][0]} died (exit {proc.returncode}): {why}")
                if host == A or sum(1 for c in out["node_crashes"] if c["node"] == nodes[host][0]) > 2:
                    raise RuntimeError(f"node {nodes[host][0]} died: {why}")
                live[host] = start_node(lab.wrap(host, cmds[host]), dirs[host])
                procs.append(live[host])
                wait_ready(live[host], dirs[host], timeout=READY_TIMEOUT_S)
                log(f"  restarted {nodes[host][0]}")

        quota = sub_json(lab, CONSUMER, ["--quotas"], QUOTA_TIMEOUT_S, "the relay-quota run")
        print(f"relay quotas {quota['quotas']}: refusals {quota['ledger']['refusals']}; steps {quota['steps']}",
              flush=True)
        out["quota"] = quota

        def net_of(host: int) -> dict:
            still_up()
            return read_state(dirs[host]).get("net", {})

        wait_for("A, C and Ppub find themselves public", lambda: all(
            net_of(h).get("reachability") == "public" for h in PUBLIC_NODES), NAT_TIMEOUT_S)
        took = wait_for("both NAT'd providers private with 2 relays", lambda: all(
            net_of(h).get("reachability") == "private" and len(net_of(h).get("relays", [])) == 2
            for h in (PRELAY, PPUNCH)), NAT_TIMEOUT_S)
        states = {h: read_state(d) for h, d in dirs.items()}
        names = {state["peer_id"]: nodes[h][0] for h, state in states.items()}
        for h in (PRELAY, PPUNCH):
            net = states[h]["net"]
            print(f"{nodes[h][0]}: {net['reachability']}, relays {[names.get(r, r[:12]) for r in net['relays']]}, "
                  f"hole punching {net.get('hole_punching')} (after {time.monotonic() - began:.0f} s; "
                  f"{took:.0f} s after the quota run)", flush=True)

        ping = lab.run(CONSUMER, ["ping", "-U", "-c", "10", "-i", "0.2", lab.addr(A)], capture_output=True,
                       text=True, timeout=30).stdout
        rtt = ping_rtt_ms(ping)
        rtt = round(rtt, 2) if rtt is not None else None
        print(f"ping consumer -> A: median {rtt} ms ({(ping.strip().splitlines() or ['?'])[-1]})", flush=True)
        out["rtt_ms"] = rtt

        spec = {"bootstrap": bootstrap[0], "listen": f"/ip4/{lab.addr(CONSUMER)}/tcp/0",
                "peers": {"A": states[A]["peer_id"], "C": states[C]["peer_id"],
                          **{mode: states[h]["peer_id"] for mode, h in MODES.items()}}}
        began_client = time.monotonic()
        out["client"] = sub_json(lab, CONSUMER, ["--client", json.dumps(spec), "--trials", str(args.trials),
                                                 "--tokens", str(args.tokens)], CLIENT_TIMEOUT_S, "the consumer")
        out["client_s"] = time.monotonic() - began_client

        # Hole punching: a new target (host 5) and a new probe (host 7) each attempt.
        shared = root / "punch"
        shared.mkdir()
        relays = [[states[h]["peer_id"], [a for a in read_state(dirs[h])["addrs"] if "/p2p-circuit" not in a]]
                  for h in PUBLIC_NODES]
        target_spec = {"dir": str(shared), "relays": relays, "listen": lab.addr(PPUNCH),
                       "seen": lab.seen_addr(PPUNCH)}
        probe_spec = {"dir": str(shared), "bootstrap": bootstrap[0], "listen": lab.addr(PROBE)}
        began_probe = time.monotonic()
        punch_timeout = args.attempts * (DIRECT_TRY_S + PUNCH_WINDOW_S + 40) + 60
        target_proc = lab.popen(PPUNCH, [sys.executable, __file__, "--punch-target", json.dumps(target_spec),
                                         "--attempts", str(args.attempts)], stdout=subprocess.PIPE, text=True)
        try:
            out["punch"] = sub_json(lab, PROBE, ["--punch", json.dumps(probe_spec), "--attempts",
                                                 str(args.attempts)], punch_timeout, "the hole-punch probe")
            target_out, _ = target_proc.communicate(timeout=60)
            lines = [line for line in target_out.splitlines() if line.startswith("[")]
            out["punch_targets"] = json.loads(lines[-1]) if lines else []
            if target_proc.returncode != 0:
                TEARDOWN_FAILURES.append(f"the hole-punch target: exit {target_proc.returncode}")
        finally:
            if target_proc.poll() is None:
                target_proc.kill()
                target_proc.wait(timeout=10)
        out["punch_s"] = time.monotonic() - began_probe

        time.sleep(2.5)  # node.json follows within 2 s
        dead = [nodes[h][0] for h, proc in live.items() if proc.poll() is not None]
        if dead:
            log(f"WARNING: nodes {dead} died during the measurements")
            out.setdefault("node_crashes", []).extend({"node": name, "during": "measurements"} for name in dead)
        out["nodes"] = {nodes[h][0]: read_state(d).get("net", {}) for h, d in dirs.items()}
        failed = False
        return out
    finally:
        stop_lab(procs, lab, root, failed=failed, keep=args.keep, logs="*/node.log", log=log)


def summarise(runs: dict, args) -> dict:
    client, punch, quota = runs["client"], runs["punch"], runs["quota"]
    local = client["local"]
    med = lambda mode, key: statistics.median(t[key] for t in client[mode])  # noqa: E731
    identical = all(t["tokens"] == local for mode in MODES for t in client[mode]) and all(
        t["tokens"] == local[:len(t["tokens"])] for t in client["warmup"].values())
    successes = [a for a in punch if a.get("punched")]
    refusals = quota["ledger"]["refusals"]
    relayed_bytes = {name: net.get("relay", {}).get("relayed_bytes", 0) for name, net in runs["nodes"].items()
                     if name in ("a", "c", "ppub")}
    out = {
        **{f"{mode}_tok_s": med(mode, "tok_s") for mode in MODES},
        **{f"{mode}_ttft_s": med(mode, "ttft_s") for mode in MODES},
        "identical": identical,
        "not_fresh_trials": sum(1 for mode in MODES for t in client[mode] if not t["fresh"]),
        "punch_success": len(successes),
        "punch_attempts": len(punch),
        "punch_median_s": statistics.median(a["direct_s"] for a in successes) if successes else None,
        "punch_direct_dial_failed": sum(1 for a in punch if str(a.get("direct_dial", "")).startswith("failed")),
        "punch_errors": sorted({a["error"][:120] for a in punch if a.get("error") and not a.get("punched")}),
        "relay_quota_enforced": all(refusals.get(kind, 0) >= 1 for kind in ("reservation", "circuit", "bytes",
                                                                            "duration")),
        "relay_refusals": refusals,
        **{f"{mode}_session_conn": sorted({t["session_conn"] for t in client[mode]}) for mode in MODES},
        **{f"{mode}_ttft_trials_s": [t["ttft_s"] for t in client[mode]] for mode in MODES},
        **{f"{mode}_tok_s_trials": [t["tok_s"] for t in client[mode]] for mode in MODES},
        "relayed_bytes": sum(relayed_bytes.values()),
        "relayed_bytes_by_relay": relayed_bytes,
        # each public node's relay ledger at the end (circuits still open, opened, refusals)
        "relay_ledgers": {name: {k: v for k, v in net.get("relay", {}).items() if k != "relayed_bytes"}
                          for name, net in runs["nodes"].items() if name in ("a", "c", "ppub")},
        "rtt_ms": runs["rtt_ms"],
        "rtt_ok": runs["rtt_ms"] is not None and abs(runs["rtt_ms"] - 2 * args.delay_ms) <= 0.1 * 2 * args.delay_ms,
    }
    out["punched_vs_public"] = out["punched_tok_s"] / out["public_tok_s"]
    out["relayed_vs_public"] = out["relayed_tok_s"] / out["public_tok_s"]
    out["targets_met"] = {"punch_success": out["punch_success"] >= round(0.9 * out["punch_attempts"]),
                          "punched_vs_public": out["punched_vs_public"] >= 0.95, "identical": identical}

    def rounded(value):
        if isinstance(value, float):
            return round(value, 3)
        if isinstance(value, dict):
            return {k: rounded(v) for k, v in value.items()}
        return [rounded(x) for x in value] if isinstance(value, list) else value

    return {key: rounded(value) for key, value in out.items()}


def report(s: dict, runs: dict, args) -> None:
    print(f"== {args.delay_ms} ms each way (RTT {s['rtt_ms']} ms, ok: {s['rtt_ok']}), {args.tokens} decode tokens, "
          f"{runs['client']['prompt_tokens']} prompt tokens, {args.trials} trials, route {runs['client']['routes']}",
          flush=True)
    for mode in MODES:
        print(f"  {mode:8} {s[f'{mode}_tok_s']:6.2f} tok/s  ttft {s[f'{mode}_ttft_s']:5.2f} s  (trials "
              f"{s[f'{mode}_tok_s_trials']} tok/s, ttft {s[f'{mode}_ttft_trials_s']} s)  session to the middle: "
              f"{s[f'{mode}_session_conn']}", flush=True)
    print(f"  punched/public x{s['punched_vs_public']:.3f}, relayed/public x{s['relayed_vs_public']:.3f}; tokens "
          f"identical to local: {s['identical']}; relays carried {s['relayed_bytes']} bytes "
          f"{s['relayed_bytes_by_relay']}", flush=True)
    print(f"  hole punching NAT <-> NAT: {s['punch_success']}/{s['punch_attempts']} direct within "
          f"{PUNCH_WINDOW_S:.0f} s (median {s['punch_median_s']} s), direct dial failed first in "
          f"{s['punch_direct_dial_failed']}", flush=True)
    print(f"  relay quotas enforced: {s['relay_quota_enforced']} (refusals {s['relay_refusals']})", flush=True)
    print(f"  targets met: {s['targets_met']}", flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--delay-ms", type=int, default=20, help="ms added on each host's ingress (RTT = 2x)")
    parser.add_argument("--trials", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=48, help="timed decode tokens per trial")
    parser.add_argument("--attempts", type=int, default=20, help="hole-punch attempts between two NAT'd hosts")
    parser.add_argument("--keep", action="store_true", help="keep the temp dir (node logs)")
    parser.add_argument("--results", default=str(REPO / "bench" / "results" / "nat.jsonl"),
                        help="JSON-lines file the summary is appended to ('' for none)")
    parser.add_argument("--client", help=argparse.SUPPRESS)  # internal: the consumer, in its namespace
    parser.add_argument("--punch", help=argparse.SUPPRESS)  # internal: the hole-punch probe
    parser.add_argument("--punch-target", help=argparse.SUPPRESS)  # internal: its targets
    parser.add_argument("--quotas", action="store_true", help=argparse.SUPPRESS)  # internal: the relay quotas
    args = parser.parse_args()
    if args.client:
        client_main(json.loads(args.client), args.trials, args.tokens)
        return 0
    if args.punch:
        punch_main(json.loads(args.punch), args.attempts)
        return 0
    if args.punch_target:
        punch_target_main(json.loads(args.punch_target), args.attempts)
        return 0
    if args.quotas:
        quotas_main()
        return 0
    if os.geteuid() != 0:
        parser.error("needs root (network namespaces)")

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # run the finallys
    signal.signal(signal.SIGHUP, lambda *_: sys.exit(129))
    began = time.perf_counter()
    runs = run_lab(args)
    summary = summarise(runs, args)
    report(summary, runs, args)
    result = {**summary, "delay_ms": args.delay_ms, "tokens": args.tokens, "trials": args.trials,
              "client_s": round(runs["client_s"]), "punch_s": round(runs["punch_s"]),
              "teardown_failures": TEARDOWN_FAILURES, "node_crashes": runs.get("node_crashes", []),
              "wall_s": round(time.perf_counter() - began)}
    print(f"total {result['wall_s']} s", flush=True)
    return finish(result, args.results)


if __name__ == "__main__":
    sys.exit(main())
