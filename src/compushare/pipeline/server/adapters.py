"""The LoRA adapters of a server's sessions: decoded at `open`, kept with the session,
applied by every forward of it (compute.py), and bounded in memory.

An `open` carries its adapter (pipeline/adapter_wire.py) for the session's layers;
it is decoded against the runner's model and the session's span, checked, and put
on the span's device. What it costs, chosen here:

- the AdapterCache (per peer, by digest: 4 of a peer's, 256 MiB of everyone's) keeps
  decoded adapters, so a peer's sessions with the same adapter share one copy (and
  an `open` naming only a digest it holds needs no tensors);
- what open sessions hold counts apart from it, each distinct (peer, digest) once:
  at most PEER_BYTES of one peer's and TOTAL_BYTES of everyone's. An open past
  either is `busy` (others' sessions free it as they close); one adapter larger than
  PEER_BYTES is `bad_adapter` (no server with these limits takes it).

So adapters pin at most TOTAL_BYTES for sessions plus the cache's bound, however many
sessions and peers come; the frame limit (16 MiB) bounds one `open`'s bytes anyway.
A span on ggml uploads a copy of the factors of the adapters its forwards last used,
at most 4 (spans/ggml/adapter.py): at most 4 × PEER_BYTES more.
"""

from __future__ import annotations

import dataclasses

from ...errors import FrameError
from ...model.lora import Adapter
from ...wire import BAD_ADAPTER
from .. import protocol
from ..adapter_wire import AdapterCache, decode_adapter
from .session import Rejected, Session, State

MiB = 1024 * 1024
PEER_BYTES = 64 * MiB
TOTAL_BYTES = 256 * MiB


@dataclasses.dataclass(frozen=True)
class Held:
    """A session's adapter: what its forwards apply, and the digest its proofs name."""

    adapter: Adapter
    digest: bytes
    peer: str


def on_device(adapter: Adapter, device) -> Adapter:
    """The adapter's factors where the span's activations are (a CUDA span's)."""
    if all(t.device == device for t in adapter.tensors.values()):
        return adapter
    return Adapter(adapter.spec, {name: t.to(device) for name, t in adapter.tensors.items()}, adapter.model_id)


class SessionAdapters:
    def __init__(self, peer_bytes: int = PEER_BYTES, total_bytes: int = TOTAL_BYTES) -> None:
        self.peer_bytes, self.total_bytes = peer_bytes, total_bytes
        self.cache = AdapterCache()
        self._sessions: list[Session] = []  # sessions holding an adapter (closed ones pruned at each open)

    def admit(self, wire: dict, runner, start: int, end: int, peer: str) -> Held:
        """The adapter an `open` names, decoded and within the bounds; FrameError
        (bad_adapter, unknown_adapter) or Rejected (busy). Nothing is held until `keep`."""
        if "tensors" in wire:
            decoded = decode_adapter(wire, runner.config, start, end, None, peer)  # checks the digest
            digest = wire["digest"]
            adapter = self.cache.get(peer, digest)
            if adapter is None:
                if decoded.nbytes > self.peer_bytes:
                    raise FrameError(BAD_ADAPTER, f"an adapter of {decoded.nbytes} bytes exceeds this server's "
                                                  f"{self.peer_bytes} per peer")
                adapter = on_device(decoded, runner.device)
                self.cache.put(peer, digest, adapter)
        else:  # named by its digest: one this peer sent before
            adapter = decode_adapter(wire, runner.config, start, end, self.cache, peer)
            digest = wire["digest"]
        self._check_room(peer, digest, adapter.nbytes)
        return Held(adapter, digest, peer)

    def keep(self, session: Session, held: Held) -> None:
        session.adapter = held
        self._sessions.append(session)

    def held_bytes(self, peer: str | None = None) -> int:
        """Bytes of the distinct adapters open sessions hold (of `peer`'s only, if given)."""
        self._sessions = [s for s in self._sessions if s.state is not State.CLOSED]
        distinct = {(s.adapter.peer, s.adapter.digest): s.adapter.adapter.nbytes for s in self._sessions}
        return sum(n for (owner, _), n in distinct.items() if peer is None or owner == peer)

    def _check_room(self, peer: str, digest: bytes, nbytes: int) -> None:
        if any(s.adapter.peer == peer and s.adapter.digest == digest for s in self._sessions
               if s.state is not State.CLOSED):
            return  # shared with an open session of the same peer: costs nothing more
        if self.held_bytes(peer) + nbytes > self.peer_bytes:
            raise Rejected(protocol.BUSY, f"this peer's sessions hold {self.held_bytes(peer)} bytes of adapters; "
                                          f"{nbytes} more would pass {self.peer_bytes}")
        if self.held_bytes() + nbytes > self.total_bytes:
            raise Rejected(protocol.BUSY, f"sessions hold {self.held_bytes()} bytes of adapters; {nbytes} more "
                                          f"would pass this server's {self.total_bytes}")
