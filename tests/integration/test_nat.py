"""A provider behind a home router (tools/netlab: its own MASQUERADE router, inbound
dropped, no port forwarding) serves in a chain: found unreachable by AutoNAT, it
holds relay slots on public nodes and advertises circuits through them. Consumers
reach it through a relay at once and, where the NATs allow, hole-punch to a direct
connection; every generation gives exactly the local greedy tokens. A relay that
dies is replaced. Real namespaces, real node processes (root; `make test` installs
the tools)."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import pytest

from compushare.app.swarm import node_command, start_node, wait_ready
from compushare.model.catalog import import_path
from helpers import reference_greedy, wait_until
from netlab import Lab, Topology

# Labs of network namespaces, one test at a time (make test runs tests in parallel).
pytestmark = [pytest.mark.skipif(os.geteuid() != 0, reason="network namespaces need root"),
              pytest.mark.xdist_group("netns")]
PREFIX = f"n{os.getpid() % 100000}"
CLIENT = Path(__file__).resolve().parents[1] / "nat_client.py"
PROMPT = [1, 17, 42, 99, 3]
NEW = 16
PUBLIC, PROVIDER, CONSUMER, NATD_CONSUMER, SPARE = 1, 3, 4, 5, 6  # host 2: another public node
NAT = frozenset({PROVIDER, NATD_CONSUMER})


def start(lab, processes, model, host: int, name: str, blocks: str, boot: list[str]):
    data_dir = processes.root / name
    import_path(model, data_dir, alias="tiny")
    cmd = node_command("tiny", tuple(int(x) for x in blocks.split(":")), data_dir, boot,
                       ["--ad-period", "1", "--api-port", "-1"])
    cmd[cmd.index("--listen") + 1] = f"/ip4/{lab.addr(host)}/tcp/0"
    proc = start_node(lab.wrap(host, cmd), data_dir)
    processes.procs.append(proc)
    return proc, data_dir


def state(data_dir: Path) -> dict:
    return json.loads((data_dir / "node.json").read_text())


def wait_for(what: str, check, timeout: float) -> float:
    """Seconds until `check()` held (polled; AssertionError after `timeout`)."""
    began = time.monotonic()
    wait_until(check, what, timeout, interval=0.25)
    return time.monotonic() - began


def consume(lab, model, tmp: Path, host: int, name: str, boot: list[str], target: str, *, listen: str | None,
            try_direct: list[str] = (), fetch: bool = False) -> dict:
    data_dir = tmp / name
    import_path(model, data_dir, alias="tiny")
    cmd = [sys.executable, str(CLIENT), "--data-dir", str(data_dir), "--prompt", ",".join(map(str, PROMPT)),
           "--new", str(NEW), "--target", target, *sum((["--bootstrap", b] for b in boot), [])]
    if listen:
        cmd += ["--listen", listen]
    for addr in try_direct:
        cmd += ["--try-direct", addr]
    if fetch:
        cmd += ["--fetch-from"]
    done = lab.run(host, cmd, capture_output=True, text=True, timeout=180,
                   env=dict(os.environ, COMPUSHARE_HOME=str(data_dir)))
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def relayed_bytes(dirs) -> int:
    return sum(state(d).get("net", {}).get("relay", {}).get("relayed_bytes", 0) for d in dirs)


def test_a_provider_behind_nat_serves_through_relays_and_hole_punching(processes, tiny_model, tmp_path):
    expected = reference_greedy(tiny_model, PROMPT, NEW)
    with Lab(Topology(PREFIX, hosts=6, nat=NAT)) as lab:
        _, first = start(lab, processes, tiny_model, PUBLIC, "a", "0:2", [])
        boot = wait_ready(processes.procs[-1], first, timeout=120)["addrs"][:1]
        publics = {PUBLIC: first}
        for host, name in ((2, "b"), (SPARE, "f")):
            publics[host] = start(lab, processes, tiny_model, host, name, "0:2", boot)[1]
        proc, natd = start(lab, processes, tiny_model, PROVIDER, "p", "2:4", boot)
        for host, data_dir in publics.items():
            wait_ready(processes.procs[list(publics).index(host)], data_dir, timeout=120)
        provider = wait_ready(proc, natd, timeout=120)

        # AutoNAT tells them apart; the NAT'd provider then holds two relay slots and
        # advertises only circuits through them.
        wait_for("the public nodes find themselves public",
                 lambda: all(state(d).get("net", {}).get("reachability") == "public" for d in publics.values()), 60)
        wait_for("the NAT'd provider holds 2 relays",
                 lambda: state(natd)["net"]["reachability"] == "private" and len(state(natd)["net"]["relays"]) == 2,
                 90)
        assert all("/p2p-circuit/" in a for a in state(natd)["addrs"][:2])
        target = provider["peer_id"]

        # A public consumer that cannot be dialled back (it listens on loopback only):
        # the hole punch cannot work, and the whole session goes through the relay.
        before = relayed_bytes(publics.values())
        relayed = consume(lab, tiny_model, tmp_path, CONSUMER, "c1", boot, target, listen=None)
        assert relayed["tokens"] == expected
        assert target in [peer for peer, _s, _e in relayed["route"]]
        assert relayed["to_target"] == ["relayed"] and relayed["net"]["punched"] == 0
        # At least each token's hidden state, once the relays' node.json catch up (every 2 s).
        wait_until(lambda: relayed_bytes(publics.values()) - before > NEW * 64 * 4, "the relays count the bytes")

        # The same consumer listening on its address: through the relay, then punched.
        punched = consume(lab, tiny_model, tmp_path, CONSUMER, "c2", boot, target,
                          listen=f"/ip4/{lab.addr(CONSUMER)}/tcp/0")
        assert punched["tokens"] == expected
        assert "direct" in punched["to_target"]  # the punch (within 3 s it also carries the session)

        # A consumer behind its own NAT: a direct dial to the provider fails, then the
        # relay and a hole punch between the two NATs carry the session.
        own = [a for a in provider["addrs"] if "/p2p-circuit" not in a]
        port = own[0].split("/tcp/")[1].split("/")[0]
        natd_pair = consume(lab, tiny_model, tmp_path, NATD_CONSUMER, "d1", boot, target,
                            listen=f"/ip4/{lab.addr(NATD_CONSUMER)}/tcp/0",
                            try_direct=own + [f"/ip4/{lab.seen_addr(PROVIDER)}/tcp/{port}"], fetch=True)
        assert natd_pair["direct_dial"].startswith("failed"), natd_pair["direct_dial"]
        # The NAT'd provider seeds too: the model's head pieces came from it alone.
        assert natd_pair["fetched"]["bytes"] > 0 and list(natd_pair["fetched"]["from"]) == [target]
        assert natd_pair["tokens"] == expected
        assert "direct" in natd_pair["to_target"]

        # One of its relays dies: the provider reserves on another and stays reachable.
        held = state(natd)["net"]["relays"]
        dead_host = next(h for h, d in publics.items() if state(d)["peer_id"] in held and h != PUBLIC)
        dead = state(publics[dead_host])
        os.kill(dead["pid"], 9)
        killed = time.monotonic()
        took = wait_for("the provider replaces the dead relay",
                        lambda: dead["peer_id"] not in state(natd)["net"]["relays"]
                        and len(state(natd)["net"]["relays"]) == 2, 30)
        again = consume(lab, tiny_model, tmp_path, NATD_CONSUMER, "d2", boot, target,
                        listen=f"/ip4/{lab.addr(NATD_CONSUMER)}/tcp/0")
        assert again["tokens"] == expected
        print(f"relay replaced in {took:.1f}s; reachable again {time.monotonic() - killed:.1f}s after the kill")
