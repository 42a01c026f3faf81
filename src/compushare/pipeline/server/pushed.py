"""The trio side of pushes (push.py): steps begun from the upstream server's push
computed in the background on the receiving server, and outputs pushed on to the
downstream server on the sending one.

What becomes of a pushed step (used as the consumer's answer, rolled back for
another input, discarded by a truncate) is the session core's decision
(session.py); this module computes it, lets whoever needs its end wait for it, and
queues outputs to the downstream server, a push ahead of the consumer's reply.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

import torch
import trio
from libp2p.peer.id import ID

from ..messages import Downstream, WireTensor
from .compute import wire
from .push import PUSH_MAX_BYTES, PushLinks
from .session import Session, SessionTable, State, Step

log = logging.getLogger(__name__)

PUSH_FIRST_MAX_S = 0.01  # a reply waits this long at most for its step's push to be written


class PushedSteps:
    def __init__(self, links: PushLinks, nursery: trio.Nursery, *, forge: bool = False) -> None:
        self.links = links
        self.nursery = nursery  # pushed steps compute here
        self._changed = trio.Event()  # set (and replaced) whenever a push begins a step, or it ends
        self.forge = forge  # fault injection (tests): push bytes that differ from the signed output

    def start(self, table: SessionTable, session: Session, step: Step,
              compute: Callable[[], Awaitable[tuple[torch.Tensor, float]]], dtype: torch.dtype) -> None:
        """Compute a step the table began from a push; `compute` rolls the cache back
        and fails the step if the forward fails."""
        self.nursery.start_soon(self._compute, table, session, step, compute, dtype)
        self._notify()  # a step from_upstream waiting for this push now waits for its compute

    async def _compute(self, table: SessionTable, session: Session, step: Step,
                       compute: Callable[[], Awaitable[tuple[torch.Tensor, float]]], dtype: torch.dtype) -> None:
        try:
            # The step stays begun: it ends when the consumer's copy of its input comes.
            output, seconds = await compute()
        except Exception as exc:  # rolled back and failed already
            log.info("a pushed step failed: %s", exc)
        else:  # encoded once: the push and, once confirmed, the reply
            encoded = wire(output.to(dtype))
            table.computed(session, step, output, encoded, seconds)
            self.push_on(session.downstream, step.position, encoded)
        finally:
            self._notify()

    def _notify(self) -> None:
        self._changed.set()
        self._changed = trio.Event()

    def connected(self, peer: str | None) -> bool:
        """Whether this node still has a connection to `peer` (a step's upstream)."""
        if peer is None:
            return False
        try:
            return bool(self.links.host.get_network().get_connections(ID.from_base58(peer)))
        except Exception:  # a malformed id, or a host without connection tracking
            return True

    async def changed(self) -> None:
        """Return at the next push begun, or pushed step computed or failed."""
        await self._changed.wait()

    async def settled(self, session: Session, step: Step) -> None:
        """Return once `step` is no longer being computed (computed, or failed)."""
        while session.step is step and session.state is State.COMPUTING_PUSH:
            await self._changed.wait()

    def push_on(self, downstream: Downstream | None, position: int, encoded: WireTensor) -> None:
        """Queue a step's output to the next hop's server (never blocks)."""
        if downstream is not None and len(encoded.data) <= PUSH_MAX_BYTES:
            if self.forge:  # fault injection: push other bytes than the reply's (and proof's)
                data = bytearray(encoded.data)
                data[0] ^= 1
                encoded = WireTensor(encoded.dtype, encoded.shape, bytes(data))
            self.links.push(downstream, position, encoded)

    async def flushed(self, downstream: Downstream | None) -> None:
        """A reply goes after its step's push (at most PUSH_FIRST_MAX_S later)."""
        if downstream is not None:
            await self.links.flushed(downstream.peer, PUSH_FIRST_MAX_S)
