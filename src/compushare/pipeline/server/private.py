"""Serving /compushare/private/2.0.0: a peer's encrypted projections.

The provider never sees a plaintext activation: it receives CKKS ciphertexts and
public Galois keys, multiplies by its span's plaintext weights in its HE worker
process (private_worker.py) and sends ciphertexts back. What it holds per peer,
and how much of its compute a peer gets, is bounded like the rest of the server:

- streams: at most 2 private sessions per peer and 16 in all (GuardedHandler);
- keys: a session's Galois keys (at most what the model's rotations can take,
  ~29 MB for SmolLM2, announced before a byte is sent; streamed in 1 MiB chunks,
  at most KEY_UPLOADS sessions' at once; cached by their sha256 so a consumer's
  next session sends only the digest); the worker holds at most MAX_KEY_SETS
  sets, least recently used first out but never one an open session uses (so at
  most 16 past the cap: the sessions' cap), and each peer at most one (its new
  set replaces its old);
- compute: every request waits for a turn in the server's fair scheduler (the
  one plaintext steps use), costed at PRIVATE_TOKEN_COST tokens per token and
  product, so a peer's private work counts against its one fair share; it then
  runs on the node's HE workers (private_pool.py: one per compute thread);
- answers: a request whose answer would not fit a frame is refused;
- time: a session waits IDLE_TIMEOUT_S for its next message, or what its
  consumer's last `wait` announced (2.1.0: its other hops are computing) plus
  WAIT_GRACE_S, and never more than MAX_QUIET_S without a request in all, so a
  consumer that is gone or stuck frees its session and key set within a bounded
  time; while this node works on an answer it says `busy` (2.1.0), so the
  consumer's patience follows this node's pace, not a constant.

Every `projected` reply is signed with the node's key over the request's and the
reply's ciphertext digests (proofs/private.py), so a failed private spot check
makes a failure report anyone can check.
"""

from __future__ import annotations

import collections
import contextlib
import hashlib
import logging
import time

import trio

from ... import wire
from ...errors import FrameError, PeerMisbehaved
from ...he.ckks import HEError, check_header, parameter_set
from ...he.groups import group_shapes, required_steps
from ...he.plan import choose
from ...net.framing import FramedStream
from ...net.serve import GuardedHandler, peer_of
from ...proofs.private import PrivateStatement
from ..private_wire import (BUSY, BUSY_PERIOD_S, MAX_FRAME_BYTES, MAX_OUTPUTS_PER_REPLY, PRIVATE_PROTOCOLS,
                            PrivateProtocolError, decode_keys_chunk, decode_open, decode_project, decode_wait,
                            error)
from .private_pool import HEWorker, WorkerCrashed

log = logging.getLogger(__name__)

PRIVATE_TOKEN_COST = 8  # fair-queue tokens per token of one encrypted product (~50 ms vs ~5 ms a plaintext block)
OPEN_TIMEOUT_S = 30.0
KEYS_CHUNK_TIMEOUT_S = 30.0
IDLE_TIMEOUT_S = 60.0  # a session waits this long for its next message, unless its consumer announced more
WAIT_GRACE_S = 15.0  # beyond a `wait`'s announcement: transfer and scheduling on a loaded machine
MAX_QUIET_S = 1800.0  # the most a session stays open without a request, whatever was announced
KEY_UPLOADS = 2  # sessions receiving keys at once, all peers together (each buffers its keys)


class PrivateServer:
    def __init__(self, provider, worker: HEWorker, key_pair, *,
                 slow_steps: tuple[int, int, float] | None = None) -> None:
        self.key_pair = key_pair  # signs every product (libp2p KeyPair)
        self.slow_steps = slow_steps  # fault injection (app/debug.py): requests FIRST.. wait SECONDS first
        self.provider = provider  # its span and server (with the fair scheduler) may change: read them per request
        self.worker = worker
        self.handler = GuardedHandler(self._serve, per_peer=2, total=16, defence="stream_caps")
        self.sessions = 0
        self.requests = 0
        self.refused = collections.Counter()
        self.compute_s = 0.0
        self.products = 0
        self._peer_keys: dict[str, str] = {}
        self._in_use: collections.Counter[str] = collections.Counter()  # key digests of open sessions
        self._uploads = trio.Semaphore(KEY_UPLOADS)
        self._keys_bound: dict[str, int] = {}  # per parameter set: the most key bytes this model needs
        self.worker_slots = parameter_set(worker.params).slots

    def serve_on(self, host) -> None:
        for protocol in PRIVATE_PROTOCOLS:  # 2.1.0 and the 2.0.0 it extends
            host.set_stream_handler(protocol, self.handler)

    def rate(self) -> float:
        """Encrypted layer-steps per second to advertise (0 until the worker measured some)."""
        if self.products == 0 or self.compute_s <= 0:
            return 1.0 if self.provider.span is not None else 0.0  # a nominal rate: it serves, speed unknown
        groups_per_layer = 4
        return self.products / groups_per_layer / self.compute_s

    async def _serve(self, stream) -> None:
        peer = peer_of(stream)
        framed = FramedStream(stream, MAX_FRAME_BYTES)
        talk = _Talk(framed, announces=stream.get_protocol() != wire.PRIVATE_V2_0)
        try:
            await self._session(talk, peer)
        except (PeerMisbehaved, FrameError, PrivateProtocolError) as exc:
            self.refused["malformed"] += 1
            await talk.say(error(wire.MALFORMED, str(exc)))
        except trio.TooSlowError:
            self.refused["timeout"] += 1
        except Exception as exc:  # the task boundary: never raise into py-libp2p
            log.info("private session of %s ended: %r", peer[-8:], exc)
        finally:
            with trio.move_on_after(2):
                try:
                    await framed.close()
                except Exception:
                    pass

    async def _session(self, talk: _Talk, peer: str) -> None:
        framed = talk.framed
        with trio.fail_after(OPEN_TIMEOUT_S):
            message = await framed.receive()
        if message is None:
            return
        opened = decode_open(message)
        self._in_use[opened.keys_digest] += 1  # an open session's key set is never evicted
        try:
            span_key = await self._open(talk, peer, opened)
            if span_key is None:
                return
            self.sessions += 1
            await self._requests(talk, peer, opened, span_key)
        finally:
            self._in_use[opened.keys_digest] -= 1
            if not self._in_use[opened.keys_digest]:
                del self._in_use[opened.keys_digest]

    async def _requests(self, talk: _Talk, peer: str, opened, span_key: tuple[int, int]) -> None:
        """Answer `project` requests until the consumer closes, or stays silent past what
        it announced (IDLE_TIMEOUT_S without a `wait`; MAX_QUIET_S in all)."""
        framed = talk.framed
        last_request = trio.current_time()
        patience = IDLE_TIMEOUT_S
        while True:
            with trio.move_on_after(min(patience, last_request + MAX_QUIET_S - trio.current_time())) as quiet:
                message = await framed.receive()
            if quiet.cancelled_caught:
                self.refused["idle"] += 1
                if talk.announces:  # 2.0.0 has no such code: its session just ends
                    await talk.say(error(wire.IDLE, f"nothing heard within {patience:.0f} s (or {MAX_QUIET_S:.0f} "
                                                    f"s without a request): the session is closed"))
                return
            if message is None:
                return
            if isinstance(message, dict) and message.get("type") == "wait":
                patience = max(IDLE_TIMEOUT_S, decode_wait(message) + WAIT_GRACE_S)
                continue
            request = decode_project(message)
            if not opened.start <= request.layer < opened.end:
                await framed.send(error(wire.NOT_SERVED, f"layer {request.layer} is outside the session's "
                                                         f"{opened.start}:{opened.end}"))
                continue
            await framed.send(await talk.busy_while(self._answer, peer, span_key, opened, request))
            last_request, patience = trio.current_time(), IDLE_TIMEOUT_S

    async def _open(self, talk: _Talk, peer: str, opened) -> tuple[int, int] | None:
        """Answer an `open`: the span's key, or None when it was refused (said on the stream)."""
        framed = talk.framed
        span = self.provider.span
        model_id = self.provider.model.model_id
        try:
            parameter_set(opened.params)
        except HEError as exc:
            self.refused["params"] += 1
            await framed.send(error(wire.BAD_PARAMS, str(exc)))
            return None
        if opened.model_id != model_id or span is None or not (span.start <= opened.start < opened.end <= span.end):
            self.refused["span"] += 1
            await framed.send(error(wire.NOT_SERVED, f"this node serves {model_id[:12]} blocks "
                                                     f"{span.start if span else '-'}:{span.end if span else '-'}"))
            return None
        span_key = (span.start, span.end)
        bound = self._max_keys_bytes(opened.params)
        need = not self.worker.has_keys(opened.keys_digest)
        if need and opened.keys_size > bound:
            self.refused["keys"] += 1
            await framed.send(error(wire.BAD_KEYS, f"{opened.keys_size} bytes of keys announced; this model's "
                                                   f"rotations need at most {bound}"))
            return None
        answer = {"type": "opened", "need_keys": need, "max_keys_bytes": bound}
        if not need:
            await framed.send(answer)
            return span_key
        # The keys are buffered here until the worker holds them: KEY_UPLOADS sessions at
        # once. Under 2.1.0 the slot is taken (saying busy) before the consumer is asked to
        # send, so its chunks never wait unread; a 2.0.0 consumer is answered first, as before.
        if talk.announces:
            await talk.busy_while(self._uploads.acquire)
            await framed.send(answer)
        else:
            await framed.send(answer)
            await self._uploads.acquire()
        try:
            taken = await self._take_keys(talk, peer, opened, span_key, bound)
        finally:
            self._uploads.release()
        return span_key if taken else None

    async def _take_keys(self, talk: _Talk, peer: str, opened, span_key: tuple[int, int], bound: int) -> bool:
        """Receive, check and install the consumer's Galois keys; whether they were taken."""
        framed = talk.framed
        data = await self._receive_keys(framed, opened.keys_size)
        if hashlib.sha256(data).hexdigest() != opened.keys_digest:
            self.refused["keys"] += 1
            await framed.send(error(wire.BAD_KEYS, "the keys do not match their digest"))
            return False
        try:
            # SEAL's header first, here: junk costs no worker start nor span encoding.
            check_header(data, max_size=bound, what="Galois keys")
            # The first session also has the worker load (and pre-encode) the span: seconds to minutes.
            await talk.busy_while(self.worker.add_keys, span_key, opened.keys_digest, data, keep=set(self._in_use))
        except (HEError, WorkerCrashed) as exc:
            self.refused["keys"] += 1
            await framed.send(error(wire.BAD_KEYS, str(exc)))
            return False
        del data
        previous = self._peer_keys.get(peer)
        if previous is not None and previous != opened.keys_digest and previous not in self._in_use:
            await self.worker.forget_keys(previous)  # one key set per peer
        self._peer_keys[peer] = opened.keys_digest
        # Only owners of key sets still held are remembered (at most MAX_KEY_SETS).
        self._peer_keys = {p: d for p, d in self._peer_keys.items() if self.worker.has_keys(d)}
        await framed.send({"type": "keys_ok", "bytes": opened.keys_size})
        return True

    def _max_keys_bytes(self, params: str) -> int:
        """The most Galois-key bytes this model's products can need under `params`."""
        if params not in self._keys_bound:
            server = self.provider.server
            if server is None:
                return 0
            p = parameter_set(params)
            self._keys_bound[params] = p.max_keys_bytes(len(required_steps(server.runner.config, p.slots)))
        return self._keys_bound[params]

    async def _receive_keys(self, framed: FramedStream, size: int) -> bytes:
        data = bytearray()
        while len(data) < size:
            with trio.fail_after(KEYS_CHUNK_TIMEOUT_S):
                message = await framed.receive()
            if message is None:
                raise PrivateProtocolError("stream closed during the keys")
            chunk = decode_keys_chunk(message)
            if len(data) + len(chunk) > size:
                raise PrivateProtocolError(f"more key bytes than the {size} announced")
            data += chunk
        return bytes(data)

    async def _answer(self, peer: str, span_key: tuple[int, int], opened, request) -> dict:
        return await self._signed(opened, request, await self._project(peer, span_key, opened.keys_digest, request))

    async def _project(self, peer: str, span_key: tuple[int, int], digest: str, request) -> dict:
        self.requests += 1
        server = self.provider.server
        refused = self._too_large(request)
        if refused is not None:
            self.refused["ciphertext"] += 1
            return error(wire.BAD_CIPHERTEXT, refused)
        cost = request.tokens * PRIVATE_TOKEN_COST
        began = time.perf_counter()
        await self._maybe_slow()
        try:
            async with server.compute.turn(peer, cost) if server is not None else contextlib.nullcontext():
                outs, seconds = await self.worker.project(span_key, digest, request.layer, request.group,
                                                          request.tokens, list(request.cts))
        except HEError as exc:
            self.refused["ciphertext"] += 1
            return error(wire.BAD_CIPHERTEXT, str(exc))
        except WorkerCrashed as exc:
            self.refused["worker"] += 1
            log.warning("HE worker crashed on a request of %s (restarted on the next one): %s", peer[-8:], exc)
            return error(wire.WORKER_CRASHED, "the request crashed the HE worker; it is restarted")
        self.compute_s += seconds
        self.products += request.tokens
        log.debug("private %s layer %d x%d: %.3fs compute, %.3fs in all", request.group, request.layer,
                  len(request.cts), seconds, time.perf_counter() - began)
        return {"type": "projected", "cts": outs, "compute_s": seconds}

    async def _maybe_slow(self) -> None:
        """--debug-slow-steps: requests FIRST.. (counted over all sessions) wait SECONDS first."""
        if self.slow_steps is not None and 0 <= self.requests - 1 - self.slow_steps[0] < self.slow_steps[1]:
            await trio.sleep(self.slow_steps[2])

    def _too_large(self, request) -> str | None:
        """Why a request's answer would not fit a frame (its plan's outputs), or None."""
        server = self.provider.server
        if server is None:
            return None
        rows, cols = group_shapes(server.runner.config)[request.group]
        plan = choose(rows, cols, self.worker_slots, request.tokens)
        if plan.groups(request.tokens) * plan.outputs > MAX_OUTPUTS_PER_REPLY:
            return (f"{request.tokens} tokens make {plan.groups(request.tokens) * plan.outputs} output ciphertexts; "
                    f"at most {MAX_OUTPUTS_PER_REPLY} a request")
        return None

    async def _signed(self, opened, request, reply: dict) -> dict:
        """A `projected` reply with its `sig` (proofs/private.py); an error as it is."""
        if reply.get("type") != "projected":
            return reply
        statement = await trio.to_thread.run_sync(  # hashing ~10 MB of ciphertexts: off the event loop
            lambda: PrivateStatement.of(opened.model_id, opened.params, opened.keys_digest, request.layer,
                                        request.group, request.tokens, request.cts, reply["cts"]))
        return reply | {"sig": statement.sign(self.key_pair)}

    def stats(self) -> dict:
        return {"sessions": self.sessions, "requests": self.requests, "refused": dict(self.refused),
                "compute_s": round(self.compute_s, 3), "worker_restarts": self.worker.restarts,
                "held_mb": round(self.worker.held_bytes / 1e6, 1)}



class _Talk:
    """One session's stream as both sides of 2.1.0 use it: `busy` said while this node
    works on an answer, so the consumer's patience follows this node's pace. A 2.0.0
    consumer (`announces` False) hears nothing it did not ask for."""

    def __init__(self, framed: FramedStream, *, announces: bool) -> None:
        self.framed, self.announces = framed, announces

    async def busy_while(self, work, *args, **kwargs):
        """`await work(*args, **kwargs)`, saying `busy` every BUSY_PERIOD_S meanwhile."""
        if not self.announces:
            return await work(*args, **kwargs)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._beat)
            try:
                return await work(*args, **kwargs)
            finally:
                nursery.cancel_scope.cancel()

    async def _beat(self) -> None:
        while True:
            await trio.sleep(BUSY_PERIOD_S)
            # Shielded: a frame cut off by the work's end would break the stream's framing.
            with trio.CancelScope(shield=True), trio.move_on_after(BUSY_PERIOD_S):
                await self.framed.send(BUSY)

    async def say(self, message: dict) -> None:
        """Send a last word, if the consumer still reads within 5 s."""
        with trio.move_on_after(5):
            try:
                await self.framed.send(message)
            except Exception:
                pass
