"""Consumers find chains through the DHT only: bootstrap address in, route out."""

import time

import msgpack
import pytest
import trio
from libp2p.crypto.ed25519 import create_new_key_pair

from compushare.errors import PeerMisbehaved
from compushare.karma.record import karma_validators
from compushare.model.catalog import import_path
from compushare.net.dht import connect_bootstrap, find_providers_fresh, model_key, open_dht, sync_routing_table
from compushare.net.host import full_addrs, open_host
from compushare.net.peer import open_swarm_host
from compushare.net.records import ServerRecord, record_key
from compushare.pipeline.client.consumer import RunRequest, run_prompt
from compushare.pipeline.client.discovery import discover_servers
from compushare.pipeline.client.sampling import SamplingParams
from helpers import reference_greedy


@pytest.fixture
def unrelated_bootstrap(processes, other_tiny_model):
    """A node serving a different model: none of the blocks the consumer needs."""
    _, state = processes.node("boot", other_tiny_model, "0:4", alias="other")
    return state["addrs"][:1], state


async def test_consumer_finds_chain_through_node_serving_nothing_it_needs(
        processes, tiny_model, unrelated_bootstrap, tmp_path):
    boot, boot_state = unrelated_bootstrap
    states = processes.nodes([("a", "0:2"), ("b", "2:4")], tiny_model, bootstrap=boot)
    client = tmp_path / "client"
    import_path(tiny_model, client, alias="tiny")
    prompt = [1, 9, 8, 7]
    outcome = await run_prompt(client, tuple(boot), RunRequest(
        model="tiny", prompt=prompt, params=SamplingParams(max_new_tokens=12, stop_at_eos=False)))
    assert outcome.tokens == reference_greedy(tiny_model, prompt, 12)
    assert [h.peer_id for h in outcome.route] == [s["peer_id"] for s in states]
    assert boot_state["peer_id"] not in {h.peer_id for h in outcome.route}


async def test_late_provider_found_by_next_lookup(processes, tiny_model, unrelated_bootstrap):
    boot, _ = unrelated_bootstrap
    (first,) = processes.nodes([("a", "0:4")], tiny_model, bootstrap=boot)
    model_id = first["model_id"]
    async with open_swarm_host(create_new_key_pair(), server=False, validators=karma_validators(),
                               listen=["/ip4/127.0.0.1/tcp/0"], bootstrap=boot) as swarm:
        dht = swarm.dht
        with trio.fail_after(20):
            records = await discover_servers(dht, model_id, 4)
        assert {r.peer_id for r in records} == {first["peer_id"]}

        (late,) = processes.nodes([("late", "1:3")], tiny_model, bootstrap=boot)
        with trio.fail_after(20):
            records = await discover_servers(dht, model_id, 4)
        assert {r.peer_id for r in records} == {first["peer_id"], late["peer_id"]}
        assert {(r.start, r.end) for r in records} == {(0, 4), (1, 3)}


async def test_dht_clients_stay_out_of_a_servers_routing_table():
    """Consumers query the DHT as clients. Had a node put them in its routing table, each
    one would set off a full re-provide and be dialled by look-ups long after it left."""
    async with open_host(create_new_key_pair(), ["/ip4/127.0.0.1/tcp/0"]) as node, \
            open_dht(node, server=True, validators=karma_validators()) as node_dht, \
            open_host(create_new_key_pair(), ["/ip4/127.0.0.1/tcp/0"]) as peer, \
            open_dht(peer, server=True, validators=karma_validators()) as peer_dht, \
            open_host(create_new_key_pair(), ["/ip4/127.0.0.1/tcp/0"]) as consumer, \
            open_dht(consumer, server=False, validators=karma_validators()) as consumer_dht:
        for host, dht in ((peer, peer_dht), (consumer, consumer_dht)):
            await connect_bootstrap(host, dht, full_addrs(node))
            await find_providers_fresh(dht, "ab" * 32)  # opens a DHT stream to the node
        with trio.fail_after(20):
            while not node_dht.routing_table.peer_in_table(peer.get_id()):  # once identify ran
                await sync_routing_table(node, node_dht)
                await trio.sleep(0.1)
        await sync_routing_table(node, node_dht)
        assert not node_dht.routing_table.peer_in_table(consumer.get_id())
        assert node.get_network().connections.get(consumer.get_id())  # connected all the same


async def test_record_signed_by_wrong_key_is_ignored(processes, tiny_model, unrelated_bootstrap):
    boot, _ = unrelated_bootstrap
    (honest,) = processes.nodes([("a", "0:4")], tiny_model, bootstrap=boot)
    model_id = honest["model_id"]
    forger_key, other_key = create_new_key_pair(), create_new_key_pair()
    async with open_swarm_host(forger_key, server=True, validators=karma_validators(),
                               listen=["/ip4/127.0.0.1/tcp/0"], bootstrap=boot) as swarm:
        forger, fdht = swarm.host, swarm.dht
        forger_id = forger.get_id().to_string()
        forged = ServerRecord(peer_id=forger_id, model_id=model_id, start=0, end=4, dtype="float32",
                              addrs=tuple(full_addrs(forger)), expires=time.time() + 600, seq=time.time_ns(),
                              throughput=1e9)  # would win every tie
        value = forged.sign(other_key)  # signed by a key that is not the forger's peer id
        # The validator refuses to store it even locally ...
        with pytest.raises(PeerMisbehaved, match="signature"):
            await fdht.put_value(record_key(model_id, forger_id), value)
        # ... so the forger bypasses it, serves the record from its store and
        # advertises itself as a provider of the model.
        fdht.value_store.put(record_key(model_id, forger_id).encode(), value)
        envelope = msgpack.unpackb(value)
        assert len(envelope["sig"]) == 64
        await fdht.provide(model_key(model_id))

        async with open_swarm_host(create_new_key_pair(), server=False, validators=karma_validators(),
                                   listen=["/ip4/127.0.0.1/tcp/0"], bootstrap=boot) as swarm:
            dht = swarm.dht
            with trio.fail_after(20):
                records = await discover_servers(dht, model_id, 4)
    peers = {r.peer_id for r in records}
    assert honest["peer_id"] in peers
    assert forger_id not in peers
