"""Joining the swarm with real hosts: a bounded join gives up after its attempts; an
unbounded one (a node's) waits for a bootstrap node that comes up later."""

from __future__ import annotations

import socket

import pytest
import trio
from libp2p.crypto.ed25519 import create_new_key_pair
from libp2p.peer.id import ID

from compushare.errors import SwarmUnreachable
from compushare.karma.record import karma_validators
from compushare.net import peer
from compushare.net.peer import open_swarm_host


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


async def test_a_bounded_join_tries_its_attempts_and_an_unbounded_one_waits_for_a_late_node(monkeypatch):
    late, port = create_new_key_pair(), _closed_port()
    addr = f"/ip4/127.0.0.1/tcp/{port}/p2p/{ID.from_pubkey(late.public_key)}"
    tries = []
    dial = peer.connect_bootstrap

    async def counted(*args):
        tries.append(trio.current_time())
        return await dial(*args)

    monkeypatch.setattr(peer, "connect_bootstrap", counted)
    async with open_swarm_host(create_new_key_pair(), server=False, validators=karma_validators(),
                               bootstrap=[addr], join=False) as swarm:
        with trio.fail_after(60), pytest.raises(SwarmUnreachable, match="bootstrap peers answered"):
            await swarm.join(attempts=3)
        assert len(tries) == 3
        first, longest = peer.BOOTSTRAP_RETRY_S
        assert tries[2] - tries[1] >= 2 * first  # the waits between attempts double
        joined = []

        async def join_forever() -> None:
            joined.append(await swarm.join(attempts=None))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(join_forever)
            with trio.fail_after(60):
                while len(tries) < 5:  # it keeps trying while nobody listens
                    await trio.sleep(0.1)
            async with open_swarm_host(late, server=True, validators=karma_validators(),
                                       listen=[f"/ip4/127.0.0.1/tcp/{port}"]):
                with trio.fail_after(60):
                    while not joined:
                        await trio.sleep(0.1)
        assert joined == [1]
