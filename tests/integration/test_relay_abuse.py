"""What strangers cannot turn a relay or a hole punch into (issue 40):

- 32 fresh identities that reserve every slot of a relay and leave do not shut it
  to newcomers: py-libp2p's own reservation table follows CompuShare's ledger;
- a peer that reached a node over a circuit (a STOP stream) and starts DCUtR makes
  it dial only the addresses its CONNECT names, never what the peerstore holds, and
  a burst of punches (from one peer, then from several) stays within the budget.

Real hosts on 127.0.0.1, in one process; dials are counted by listeners that
record every connection attempt."""

from __future__ import annotations

import contextlib
import functools

import multiaddr
import pytest
import trio
from libp2p.crypto.ed25519 import create_new_key_pair
from libp2p.peer.id import ID
from libp2p.relay.circuit_v2.dcutr import PROTOCOL_ID as DCUTR
from libp2p.relay.circuit_v2.dcutr import read_dcutr_msg
from libp2p.relay.circuit_v2.pb.dcutr_pb2 import HolePunch
from libp2p.relay.circuit_v2.protocol import PROTOCOL_ID as HOP
from libp2p.relay.circuit_v2.utils import write_delimited_msg
from libp2p.tools.anyio_service import background_trio_service

from compushare.config import RelayQuotas
from compushare.net.dial import dial
from compushare.net.host import full_addrs, open_host
from compushare.net.punch_budget import PunchLimits
from compushare.net.relay import QuotaRelay
from compushare.net.traversal import Traversal

LOOPBACK = ["/ip4/127.0.0.1/tcp/0"]


async def reserve(client: Traversal, relay_host) -> bool:
    relay_id = relay_host.get_id()
    await dial(client.host, relay_id, full_addrs(relay_host), timeout=10)
    with trio.fail_after(10):
        stream = await client.host.new_stream(relay_id, [HOP])
        try:
            return await client.transport._make_reservation(stream, relay_id)
        finally:
            await stream.close()


async def gone(host, peer, timeout: float = 10.0) -> None:
    with trio.fail_after(timeout):
        while host.get_network().connections.get(peer):
            await trio.sleep(0.05)


@contextlib.asynccontextmanager
async def running_relay(stack: contextlib.AsyncExitStack, quotas: RelayQuotas = RelayQuotas()):
    relay_host = await stack.enter_async_context(open_host(create_new_key_pair(), LOOPBACK))
    relay = QuotaRelay(relay_host, quotas, offer=lambda: True)
    await stack.enter_async_context(background_trio_service(relay))
    await relay.event_started.wait()
    yield relay_host, relay


@pytest.mark.timeout(180)
async def test_slots_of_identities_that_left_are_free_for_a_newcomer_within_seconds():
    quotas = RelayQuotas()  # the defaults: 32 slots, each for 3,600 s
    async with contextlib.AsyncExitStack() as stack:
        relay_host, relay = await stack.enter_async_context(running_relay(stack, quotas))
        for _ in range(quotas.reservations):
            async with open_host(create_new_key_pair(), []) as host, trio.open_nursery() as nursery:
                client = Traversal(host, serve=False, punch=False)
                await nursery.start(client.run)
                assert await reserve(client, relay_host)
                nursery.cancel_scope.cancel()
            await gone(relay_host, host.get_id())

        async with open_host(create_new_key_pair(), []) as host, trio.open_nursery() as nursery:
            newcomer = Traversal(host, serve=False, punch=False)
            await nursery.start(newcomer.run)
            with trio.fail_after(5):
                assert await reserve(newcomer, relay_host), relay.ledger.stats()
            nursery.cancel_scope.cancel()
        # py-libp2p's table holds no more than the ledger: the newcomer's slot alone
        assert set(relay.ledger.reservations) == {host.get_id().to_base58()}
        assert list(relay.resource_manager._reservations) == [host.get_id()]
        assert relay.ledger.refusals["reservation"] == 0


# -- hole punches ---------------------------------------------------------------


class Listeners:
    """TCP listeners on 127.0.0.1 that count the connections made to them and hang up
    (a hole punch's dial to one fails at the security handshake)."""

    def __init__(self) -> None:
        self.attempts: dict[str, int] = {}

    async def open_many(self, nursery: trio.Nursery, n: int) -> list[str]:
        addrs = []
        for _ in range(n):
            listeners = await nursery.start(functools.partial(trio.serve_tcp, self._count, 0, host="127.0.0.1"))
            addr = f"/ip4/127.0.0.1/tcp/{listeners[0].socket.getsockname()[1]}"
            self.attempts[addr] = 0
            addrs.append(addr)
        return addrs

    async def _count(self, stream: trio.SocketStream) -> None:
        self.attempts[f"/ip4/127.0.0.1/tcp/{stream.socket.getsockname()[1]}"] += 1
        await stream.aclose()

    def total(self, addrs) -> int:
        return sum(self.attempts[a] for a in addrs)


async def punch_from(peer_host, node_id, addrs: list[str], *, timeout: float = 10.0) -> None:
    """One DCUtR session as its initiator: CONNECT naming `addrs`, the node's CONNECT
    back, SYNC; the node then hole-punches (or refuses to), on its own time."""
    with trio.fail_after(timeout):
        stream = await peer_host.new_stream(node_id, [DCUTR])
        try:
            await write_delimited_msg(stream, HolePunch(type=HolePunch.CONNECT,
                                                        ObsAddrs=[multiaddr.Multiaddr(a).to_bytes() for a in addrs]))
            await read_dcutr_msg(stream, HolePunch)
            await write_delimited_msg(stream, HolePunch(type=HolePunch.SYNC))
        finally:
            with contextlib.suppress(Exception):
                await stream.close()


async def relayed_peer(stack, relay_host, node_host):
    """A fresh identity with a relayed connection to the node (the node took it from a
    STOP stream): dial-only, so it advertises no address of its own."""
    host = await stack.enter_async_context(open_host(create_new_key_pair(), []))
    nursery = await stack.enter_async_context(trio.open_nursery())
    traversal = Traversal(host, serve=False, punch=False)
    await nursery.start(traversal.run)
    await dial(host, relay_host.get_id(), full_addrs(relay_host), timeout=10)
    with trio.fail_after(10):
        await traversal.transport.dial(multiaddr.Multiaddr(
            f"{full_addrs(relay_host)[0]}/p2p-circuit/p2p/{node_host.get_id().to_base58()}"))
    return host


def decided(node: Traversal) -> int:
    """The punches the node has taken up or refused (over its budget per peer)."""
    stats = node.stats()["hole_punch"]
    return stats["punches"] + stats["refused"].get("peer", 0)


async def wait_punches_over(node: Traversal, since: int, count: int, timeout: float = 60.0) -> None:
    """Until the node has decided `count` punches more than `since`, and made them all."""
    with trio.fail_after(timeout):
        while decided(node) < since + count or node.dcutr._in_progress:  # private in the pinned 0.8.1
            await trio.sleep(0.05)


@pytest.mark.timeout(240)
async def test_a_punch_dials_only_the_punched_peers_own_addresses_within_a_budget():
    limits = PunchLimits(peer_burst=2, peer_interval_s=600.0, dial_burst=12, dials_per_s=0.01)
    async with contextlib.AsyncExitStack() as stack:
        nursery = await stack.enter_async_context(trio.open_nursery())
        counted = Listeners()
        own, later, planted, foreign = [await counted.open_many(nursery, n) for n in (2, 1, 2, 2)]
        relay_host, _relay = await stack.enter_async_context(
            running_relay(stack, RelayQuotas(reservations=64, circuits_per_peer=64)))
        node_host = await stack.enter_async_context(open_host(create_new_key_pair(), LOOPBACK))
        node = Traversal(node_host, serve=False, punch_limits=limits)
        await nursery.start(node.run)
        assert await reserve(node, relay_host)

        peer = await relayed_peer(stack, relay_host, node_host)
        other = create_new_key_pair()
        # The swarm's auto-connector dials peerstore peers while a node has few
        # connections, punch or not: stopped, so that the listeners count the punch's dials.
        await node_host.get_network().auto_connector.stop()
        store = node_host.get_peerstore()
        store.add_addrs(peer.get_id(), [multiaddr.Multiaddr(a) for a in planted], 600)  # as an earlier CONNECT left them
        store.add_addrs(ID.from_pubkey(other.public_key), [multiaddr.Multiaddr(a) for a in foreign], 600)

        # One punch dials the addresses its CONNECT names, 3 rounds at most, and nothing else.
        since = decided(node)
        await punch_from(peer, node_host.get_id(), own)
        await wait_punches_over(node, since, 1)
        assert 1 <= counted.total(own) <= 3 * len(own), counted.attempts
        # A second punch names another address: the first one's are not dialled again.
        before, since = counted.total(own), decided(node)
        await punch_from(peer, node_host.get_id(), later)
        await wait_punches_over(node, since, 1)
        assert 1 <= counted.total(later) <= 3, counted.attempts
        assert counted.total(own) == before, counted.attempts
        assert counted.total(planted) == 0 and counted.total(foreign) == 0, counted.attempts

        # A burst of 10 more from the same peer: past its budget of 2, no dial at all.
        dialled, since = sum(counted.attempts.values()), decided(node)
        async with trio.open_nursery() as burst:
            for _ in range(10):
                burst.start_soon(punch_from, peer, node_host.get_id(), own)
        await wait_punches_over(node, since, 10)
        assert sum(counted.attempts.values()) == dialled, counted.attempts
        stats = node.stats()["hole_punch"]
        assert stats["refused"]["peer"] >= 10, stats

        # Fresh identities, 3 punches each: within the node's dials in all (12, refilled
        # at 0.01 a second), whatever the number of peers.
        for _ in range(4):
            fresh = await relayed_peer(stack, relay_host, node_host)
            since = decided(node)
            for _ in range(3):
                await punch_from(fresh, node_host.get_id(), own + later)
            await wait_punches_over(node, since, 3)
        assert sum(counted.attempts.values()) <= limits.dial_burst + 1, counted.attempts
        stats = node.stats()["hole_punch"]
        assert stats["dials"] <= limits.dial_burst + 1 and stats["refused"]["total"] >= 1, stats
        nursery.cancel_scope.cancel()
