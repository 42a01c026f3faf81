"""Node lifecycle: span-only weights, clean SIGTERM, records that lapse."""

import signal
import time

import trio
from libp2p.crypto.ed25519 import create_new_key_pair
from safetensors import safe_open

from compushare.net.dht import connect_bootstrap, open_dht
from compushare.net.host import open_host
from compushare.pipeline.discovery import discover_servers


def _parameters(model_dir, predicate) -> int:
    total = 0
    with safe_open(str(model_dir / "model.safetensors"), framework="pt") as handle:
        for name in handle.keys():
            if predicate(name):
                total += handle.get_tensor(name).numel()
    return total


def test_provider_holds_only_its_span(processes, tiny_model):
    (state,) = processes.nodes([("a", "1:3")], tiny_model)
    in_span = _parameters(tiny_model, lambda n: n.startswith(("model.layers.1.", "model.layers.2.")))
    everything = _parameters(tiny_model, lambda n: True)
    assert state["parameters"] == in_span
    assert state["parameters"] < everything / 2  # no embeddings, no head, no other layers


async def test_sigterm_stops_node_quickly_and_its_record_lapses(processes, tiny_model):
    ttl = ["--record-ttl", "6"]
    (stays,) = processes.nodes([("stays", "0:4")], tiny_model, extra=ttl)
    boot = stays["addrs"][:1]
    proc, _ = processes.node("goes", tiny_model, "0:4", bootstrap=boot, extra=ttl, wait=False)
    goes = processes.ready("goes", proc)
    async with open_host(create_new_key_pair(), ["/ip4/127.0.0.1/tcp/0"]) as host, \
            open_dht(host, server=False) as dht:
        await connect_bootstrap(host, dht, boot)
        with trio.fail_after(20):
            records = await discover_servers(dht, stays["model_id"], 4)
        assert {r.peer_id for r in records} == {stays["peer_id"], goes["peer_id"]}

        began = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        await trio.to_thread.run_sync(proc.wait, 5)
        assert time.monotonic() - began < 5
        assert proc.returncode == 0
        assert not (processes.root / "goes" / "node.json").exists()

        # Its record is no longer refreshed: within one TTL it is gone from look-ups.
        await trio.sleep(6.5)
        with trio.fail_after(20):
            records = await discover_servers(dht, stays["model_id"], 4)
        assert {r.peer_id for r in records} == {stays["peer_id"]}
