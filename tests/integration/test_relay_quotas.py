"""A relay (net/relay.QuotaRelay on a real py-libp2p host) refuses past each of its
quotas, one refusal of each kind seen by the peers and counted in its ledger:
a reservation over the total, a circuit over a peer's share, bytes over a circuit's,
a circuit kept past its duration. Real hosts on 127.0.0.1, in one process.

The duration quota is checked on a second relay: a 2 s circuit would otherwise be
reset under the byte check on a loaded machine, and the test would depend on speed."""

from __future__ import annotations

import contextlib

import multiaddr
import pytest
import trio
from libp2p.crypto.ed25519 import create_new_key_pair
from libp2p.relay.circuit_v2.protocol import PROTOCOL_ID as HOP
from libp2p.tools.anyio_service import background_trio_service

from compushare.config import RelayQuotas
from compushare.net.dial import dial
from compushare.net.host import full_addrs, open_host
from compushare.net.relay import QuotaRelay
from compushare.net.traversal import Traversal

ECHO = "/test/echo/1"
LOOPBACK = ["/ip4/127.0.0.1/tcp/0"]
QUOTAS = RelayQuotas(reservations=1, circuits_per_peer=1, circuit_bytes=256 * 1024, circuit_duration_s=600)
SHORT = RelayQuotas(reservations=1, circuits_per_peer=1, circuit_duration_s=2)


async def echo(stream) -> None:
    try:
        while data := await stream.read(65536):
            await stream.write(data)
    except Exception:  # the circuit under it was reset: that is the point
        pass


async def reserve(client: Traversal, relay_host) -> bool:
    relay_id = relay_host.get_id()
    await dial(client.host, relay_id, full_addrs(relay_host), timeout=10)
    stream = await client.host.new_stream(relay_id, [HOP])
    try:
        return await client.transport._make_reservation(stream, relay_id)
    finally:
        await stream.close()


def circuit(relay_host, target) -> multiaddr.Multiaddr:
    return multiaddr.Multiaddr(f"{full_addrs(relay_host)[0]}/p2p-circuit/p2p/{target.get_id().to_base58()}")


async def gone(host, peer, timeout: float = 10.0) -> None:
    with trio.fail_after(timeout):
        while host.get_network().connections.get(peer):
            await trio.sleep(0.05)


@pytest.mark.timeout(120)
async def test_every_quota_kind_is_refused_once_and_counted():
    async with contextlib.AsyncExitStack() as stack:
        relay_host, short_host, target_host, second_host, c1_host, c2_host = [
            await stack.enter_async_context(open_host(create_new_key_pair(), LOOPBACK)) for _ in range(6)]
        nursery = await stack.enter_async_context(trio.open_nursery())
        relay = QuotaRelay(relay_host, QUOTAS, offer=lambda: True)
        short = QuotaRelay(short_host, SHORT, offer=lambda: True)
        target, second, c1, c2 = (Traversal(h, serve=False, punch=False)
                                  for h in (target_host, second_host, c1_host, c2_host))
        for traversal in (target, second, c1, c2):
            await nursery.start(traversal.run)
        target_host.set_stream_handler(ECHO, echo)
        for service in (relay, short):
            await stack.enter_async_context(background_trio_service(service))
            await service.event_started.wait()
        await check_quotas(relay_host, target_host, c1_host, target, second, c1, c2, relay.ledger)
        await check_duration(short_host, target_host, second_host, target, second, short.ledger)
        nursery.cancel_scope.cancel()


async def check_quotas(relay_host, target_host, c1_host, target, second, c1, c2, ledger) -> None:
    # reservation: one slot in all, the target's; the second peer is refused
    assert await reserve(target, relay_host)
    assert not await reserve(second, relay_host)
    assert ledger.refusals["reservation"] == 1

    # circuit: the target may be an end of one circuit; a second is refused
    await c1.transport.dial(circuit(relay_host, target_host))
    with pytest.raises(Exception, match="status 201"):  # RESOURCE_LIMIT_EXCEEDED
        await c2.transport.dial(circuit(relay_host, target_host))
    assert ledger.refusals["circuit"] == 1

    # bytes: 256 KiB through one circuit; more resets it
    stream = await c1_host.new_stream(target_host.get_id(), [ECHO])
    with pytest.raises(Exception):  # noqa: B017 (py-libp2p's stream errors share no base class)
        with trio.fail_after(30):
            for _ in range(16):
                await stream.write(b"x" * 32768)
                got = 0
                while got < 32768:
                    data = await stream.read(32768 - got)
                    if not data:
                        raise EOFError("the circuit was closed")
                    got += len(data)
    assert ledger.refusals["bytes"] == 1
    await gone(c1_host, target_host.get_id())
    await released(ledger)
    stats = ledger.stats()
    assert stats["refusals"] == {"reservation": 1, "circuit": 1, "bytes": 1, "duration": 0}, stats
    assert stats["relayed_bytes"] >= 256 * 1024 - 65536

    # An end that hangs up frees its circuit (and its quota) at once, whatever the other end does.
    await c1.transport.dial(circuit(relay_host, target_host))
    assert ledger.stats()["circuits_open"] == 1
    await c1_host.disconnect(target_host.get_id())
    await released(ledger)


async def check_duration(short_host, target_host, dialer_host, target, dialer, ledger) -> None:
    # duration: a circuit idle past its 2 s is reset. The dialer is one with no circuit
    # address of the target stored (py-libp2p tries those first, whatever relay is named).
    assert await reserve(target, short_host)
    await dialer.transport.dial(circuit(short_host, target_host))
    assert ledger.stats()["circuits_open"] == 1
    await gone(dialer_host, target_host.get_id(), timeout=SHORT.circuit_duration_s + 20)
    await released(ledger)
    stats = ledger.stats()
    assert stats["refusals"] == {"reservation": 0, "circuit": 0, "bytes": 0, "duration": 1}, stats


async def released(ledger) -> None:
    with trio.fail_after(10):  # the relay has let go of every circuit
        while ledger.stats()["circuits_open"]:
            await trio.sleep(0.05)
