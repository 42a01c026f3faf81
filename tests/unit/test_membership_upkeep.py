"""What a node spends on keeping its DHT routing table and connections, apart from
ads (protocol revision 23): a DHT server the routing table turned away is not offered
again (each offer pinged a bucket's oldest peer) until REFUSED_RETRY_S has passed, and
py-libp2p's walk of its tag store runs at most once a minute, not after every
connection."""

from __future__ import annotations

import trio
import trio.testing
from libp2p.kad_dht.kad_dht import PROTOCOL_ID

from compushare.net import dht as dht_module
from compushare.net import host as host_module


class FakePeerstore:
    def get_protocols(self, _peer):
        return [str(PROTOCOL_ID)]


class FakeNetwork:
    def __init__(self, peers) -> None:
        self.connections = {peer: [] for peer in peers}


class FakeHost:
    def __init__(self, peers) -> None:
        self.network = FakeNetwork(peers)

    def get_id(self):
        return "me"

    def get_network(self):
        return self.network

    def get_peerstore(self):
        return FakePeerstore()


class FullTable:
    """A routing table whose buckets are full: it takes only `room` of the peers offered."""

    def __init__(self, room: set) -> None:
        self.room, self.listed = room, set()

    def peer_in_table(self, peer) -> bool:
        return peer in self.listed


class FakeDHT:
    def __init__(self, room: set) -> None:
        self.routing_table = FullTable(room)
        self.offers: list = []

    async def add_peer(self, peer) -> bool:
        self.offers.append(peer)
        if peer in self.routing_table.room:
            self.routing_table.listed.add(peer)
            return True
        return False


def test_a_turned_away_dht_server_is_offered_again_only_after_the_retry_time():
    host, dht = FakeHost(["a", "b", "c"]), FakeDHT(room={"a"})

    async def main() -> None:
        await dht_module.sync_routing_table(host, dht)
        assert sorted(dht.offers) == ["a", "b", "c"]
        for _ in range(10):  # a sync every 2 s, as routing_sync_loop runs it
            await trio.sleep(dht_module.ROUTING_SYNC_PERIOD_S)
            await dht_module.sync_routing_table(host, dht)
        assert sorted(dht.offers) == ["a", "b", "c"], "b and c were offered again within the retry time"
        await trio.sleep(dht_module.REFUSED_RETRY_S)
        await dht_module.sync_routing_table(host, dht)
        assert sorted(dht.offers) == ["a", "b", "b", "c", "c"]  # a is listed: never offered twice

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))


def test_py_libp2ps_tag_store_is_walked_at_most_once_a_minute():
    walks: list[float] = []

    class Pruner:
        def _reap_stale_temp_entries(self) -> None:
            walks.append(trio.current_time())

    class Network:
        connection_pruner = Pruner()

    class Host:
        def get_network(self):
            return Network

    host = Host()
    host_module._throttle_tag_reaping(host)

    async def main() -> None:
        for _ in range(300):  # a new connection every second for 5 minutes
            Network.connection_pruner._reap_stale_temp_entries()
            await trio.sleep(1.0)

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
    assert len(walks) == 5
    assert all(b - a >= host_module.REAP_PERIOD_S for a, b in zip(walks, walks[1:]))
