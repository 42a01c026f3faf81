"""One provider's private session as the consumer holds it: its stream, the
handshake (open, keys), requests, and the waits of protocol 2.1.0 (the consumer's
`wait` while its other hops compute, the provider's `busy` while it works); under
2.0.0 the fixed limits. private_chain.py drives sessions through a generation."""

from __future__ import annotations

import dataclasses

import trio

from ...errors import CLOSED, HopFailed
from ...he.plan import Plan
from ...net.dial import dial
from ...net.framing import FramedStream
from ..private_wire import (KEYS_CHUNK, MAX_FRAME_BYTES, PRIVATE_PROTOCOL, PRIVATE_PROTOCOLS, Open, Project,
                            PrivateProtocolError, PrivateRemoteError, decode_projected, wait)
from .private_reports import Signed, signed_reply
from .routing import Hop

CONNECT_TIMEOUT_S = 15.0
KEYS_TIMEOUT_S = 120.0
REQUEST_TIMEOUT_S = 30.0  # a provider silent this long (+ per token) on a request has failed:
REQUEST_TIMEOUT_PER_TOKEN_S = 5.0  # under 2.1.0 its `busy` frames restart the count
MAX_ANSWER_S = 900.0  # ... and under 2.1.0 one answer takes at most this, busy or not
PROVIDER_PATIENCE_S = 60.0  # how long a provider waits for a session's next message unannounced
KEEPALIVE_S = 20.0  # a session quiet this long in a generation announces its next wait
ANNOUNCED_WAIT_S = 60.0  # what that `wait` announces (said again while the quiet lasts)
KEEPALIVE_CHECK_S = 2.0
LATE_MARGIN_S = 10.0  # a session this close to its announced quiet counts as late (reply transfer)


@dataclasses.dataclass
class PrivateStats:
    """Where a private step's time goes (seconds, summed over the generation)."""

    encrypt_s: float = 0.0
    decrypt_s: float = 0.0  # decrypt, decode and the window sums
    roundtrip_s: float = 0.0  # from sending a product to its answer
    provider_s: float = 0.0  # the providers' own compute, as they report it
    local_s: float = 0.0  # everything else of the layers here: norms, attention, SiLU
    products: int = 0  # group products (4 a layer) times tokens
    projections: int = 0  # weight projections (7 a layer) times tokens
    bytes_sent: int = 0
    bytes_received: int = 0
    keys_bytes: int = 0
    keys_sent: int = 0  # sessions that had to receive the keys (the others had them cached)
    reopened: int = 0  # sessions a provider closed after we were quiet too long, opened again on it

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class Request:
    """One `project` request: its tokens, their plan and input ciphertexts."""

    tokens: int
    plan: Plan
    cts: tuple[bytes, ...]


class PrivateSession:
    """One provider's private session: its stream, opened with our key digest."""

    def __init__(self, hop: Hop, framed: FramedStream, signed: tuple[str, str, str], *,
                 announces: bool = True) -> None:
        self.hop, self.framed = hop, framed
        self.signed = signed  # (model_id, params, keys digest): what every reply's statement names
        self.announces = announces  # 2.1.0: we send `wait`, it sends `busy`
        self.late = False  # the last request went out after we were quiet past what the provider expected
        self._sending = trio.Lock()
        self._asking = False  # a request in flight: the provider is not waiting on us
        self._quiet_since: float | None = None  # since the last answer or `wait` (None: not opened yet)
        self._allowed_s = PROVIDER_PATIENCE_S

    @classmethod
    async def open(cls, host, hop: Hop, model_id: str, params: str, keys: bytes, digest: str,
                   stats: PrivateStats) -> PrivateSession:
        with trio.fail_after(CONNECT_TIMEOUT_S):
            info = await dial(host, hop.peer_id, hop.record.addrs, timeout=CONNECT_TIMEOUT_S)
            stream = await host.new_stream(info.peer_id, list(PRIVATE_PROTOCOLS))
        session = cls(hop, FramedStream(stream, MAX_FRAME_BYTES), (model_id, params, digest),
                      announces=stream.get_protocol() == PRIVATE_PROTOCOL)
        try:
            await session._handshake(model_id, params, keys, digest, stats)
        except BaseException:
            await session.close()
            raise
        return session

    async def _handshake(self, model_id, params, keys, digest, stats) -> None:
        with trio.fail_after(CONNECT_TIMEOUT_S):
            await self._send(Open(model_id, self.hop.start, self.hop.end, params, digest, len(keys)).to_wire())
        reply = await self._answer(CONNECT_TIMEOUT_S)  # the provider may first wait for a key-upload slot
        _check(reply, "opened", self.hop.peer_id)
        if reply.get("need_keys"):
            with trio.fail_after(KEYS_TIMEOUT_S):
                for offset in range(0, len(keys), KEYS_CHUNK):
                    await self._send({"type": "keys", "data": keys[offset:offset + KEYS_CHUNK]})
            reply = await self._answer(KEYS_TIMEOUT_S)  # its first session pre-encodes the span: minutes
            _check(reply, "keys_ok", self.hop.peer_id)
            stats.keys_sent += 1
            stats.bytes_sent += len(keys)
        self._quiet(PROVIDER_PATIENCE_S)

    async def project(self, layer: int, group: str, request: Request) -> tuple[list[list[bytes]], float, Signed]:
        silence_s = REQUEST_TIMEOUT_S + REQUEST_TIMEOUT_PER_TOKEN_S * request.tokens
        self.late = self._quiet_for() > self._allowed_s - LATE_MARGIN_S
        self._asking = True
        try:
            with trio.fail_after(silence_s):
                await self._send(Project(layer, group, request.tokens, request.cts).to_wire())
            reply = await self._answer(silence_s)
        finally:
            self._asking = False
            self._quiet(PROVIDER_PATIENCE_S)
        if reply is None:
            raise HopFailed(self.hop.peer_id, CLOSED, f"{self.hop.peer_id[-8:]} closed the private session")
        outs, compute_s = decode_projected(reply, request.plan.groups(request.tokens))
        return outs, compute_s, await trio.to_thread.run_sync(  # hashing ~10 MB: off the event loop
            signed_reply, self.hop.peer_id, self.signed, layer, group, request.tokens, request.cts, outs,
            reply.get("sig"))

    async def keep_alive(self) -> None:
        """Under 2.1.0, tell the provider when to expect our next request, once this
        session has been quiet KEEPALIVE_S (its hop waits while the others compute)."""
        if not self.announces or self._asking or self._quiet_for() < KEEPALIVE_S:
            return
        with trio.fail_after(KEEPALIVE_S):  # a provider reads between requests: this never blocks long
            await self._send(wait(ANNOUNCED_WAIT_S))
        self._quiet(ANNOUNCED_WAIT_S)

    def _quiet_for(self) -> float:
        return 0.0 if self._quiet_since is None else trio.current_time() - self._quiet_since

    def _quiet(self, allowed_s: float) -> None:
        self._quiet_since, self._allowed_s = trio.current_time(), allowed_s

    async def _send(self, message: dict) -> None:
        async with self._sending:  # a keep-alive never cuts into a request's frame
            await self.framed.send(message)

    async def _answer(self, silence_s: float) -> dict | None:
        """The provider's next message: under 2.1.0 its `busy` frames skipped, failing
        after `silence_s` without any (or MAX_ANSWER_S in all); under 2.0.0 within
        `silence_s`."""
        if not self.announces:
            with trio.fail_after(silence_s):
                return await self.framed.receive()
        with trio.fail_after(MAX_ANSWER_S):
            while True:
                with trio.fail_after(silence_s):
                    reply = await self.framed.receive()
                if not (isinstance(reply, dict) and reply.get("type") == "busy"):
                    return reply

    async def close(self) -> None:
        with trio.move_on_after(2):
            try:
                await self.framed.close()
            except Exception:
                pass


def _check(reply, expected: str, peer_id: str) -> None:
    if reply is None:
        raise HopFailed(peer_id, CLOSED, "the provider closed the private session")
    if reply.get("type") == "error":
        raise PrivateRemoteError(str(reply.get("code")), str(reply.get("message"))[:500])
    if reply.get("type") != expected:
        raise PrivateProtocolError(f"expected {expected}, got {reply.get('type')!r}")
