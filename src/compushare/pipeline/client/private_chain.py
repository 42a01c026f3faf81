"""The consumer's side of private mode: a chain whose providers only ever see
CKKS ciphertexts.

`PrivateChain` has the interface of `InferenceChain` (`step(hidden) -> hidden`),
so `generate` drives either. A step runs every layer here (model/private_layers.py)
in a worker thread; each of a layer's four products is encrypted in that thread,
sent to the provider of the layer's hop (`_roundtrip`, on the event loop), and its
answer decrypted and summed in the thread again. A provider holds no state of the
session but its Galois keys (the KV cache is the consumer's), so a provider that
fails is replaced and the product asked again: nothing to replay.

Waits follow the work (protocol 2.1.0), not constants tuned on one machine: while
the other hops compute, `keep_alive` tells each quiet session when to expect its
next request (`wait`), and a provider working on an answer says `busy`, so only
silence (a provider stopped, a consumer gone) ends a session. A session that its
provider closed after this consumer really was quiet past what it announced (a
2.0.0 provider's fixed 60 s, or a keep-alive starved) is opened again on the same
provider, unpenalised: the fault was ours.

Spot checks: with probability `spot_check_rate` per step, one product of the step
(a random layer and group) is also asked of another provider holding that layer
(one at random),
and the two decrypted answers must agree within CKKS's noise (CHECK_TOLERANCE;
honest providers agree to ~1e-7). On a mismatch a third provider of the layer, if
there is one, decides; the one found wrong is penalised like a failed plaintext
spot check. If that is the route's provider it is replaced and the step computed
again from the last accepted position (the KV cache is cropped back). Without a
third, the route's provider is blamed: a lying verifier can then make the
consumer avoid an honest provider for a while, never accept a wrong product.
Every reply is signed (proofs/private.py; one without a valid signature is a bad
reply, failed over), so a mismatch also makes a PrivateFailureReport against the
one found wrong, witnessed by the other, kept in `reports` like InferenceChain's.
"""

from __future__ import annotations

import logging
import random
import threading
import time

import numpy as np
import torch
import trio

from ...errors import FAILED, MISMATCH, HopFailed, RouteError
from ...he.ckks import HEError, SecretContext, keys_digest
from ...he.groups import group_shapes
from ...he.plan import choose, request_tokens
from ...proofs.private import PrivateFailureReport
from ..private_wire import MAX_CTS_PER_REQUEST, MAX_OUTPUTS_PER_REPLY, MAX_TOKENS_PER_REQUEST, PrivateProtocolError
from .chain_plan import Failover
from .private_reports import Signed, mismatch_report
from .private_session import KEEPALIVE_CHECK_S, PrivateSession, PrivateStats, Request
from .routing import Hop

log = logging.getLogger(__name__)

MAX_FAILOVERS = 4
PIPELINE_CHUNK = 12  # a prefill longer than this runs as a pipeline of 12-token chunks over the hops
CHECK_TOLERANCE = 1e-4  # relative L2 difference two honest providers stay under (measured: ~1e-7)


class PrivateChain:
    def __init__(self, host, route: list[Hop], model_id: str, layers, secret: SecretContext,  # layers: PrivateLayers
                 keys: bytes, *, planner=None, spot_check_rate: float = 0.0, rng: random.Random | None = None) -> None:
        self.host, self.model_id, self.layers, self.secret = host, model_id, layers, secret
        self.keys, self.digest = keys, keys_digest(keys)
        self.planner, self.spot_check_rate = planner, spot_check_rate
        self.rng = rng or random.Random()
        self._route = list(route)
        self.sessions: dict[int, PrivateSession] = {}  # by hop index
        self.cache = layers.new_cache()
        self.position = 0
        self.stats = PrivateStats(keys_bytes=len(keys))
        self.failovers: list = []
        self.reports: list[PrivateFailureReport] = []
        self.checks = 0
        self.check_failures: list[str] = []
        self.avoid: set[str] = set()
        self._check_this_step: tuple[int, str] | None = None
        self._tls = threading.local()  # per forward thread: time spent in products
        self._shapes = group_shapes(layers.config)
        self._per_request = {group: request_tokens(rows, cols, secret.slots, max_tokens=MAX_TOKENS_PER_REQUEST,
                                                   max_inputs=MAX_CTS_PER_REQUEST, max_outputs=MAX_OUTPUTS_PER_REPLY)
                             for group, (rows, cols) in self._shapes.items()}
        layers.project = self._project

    @property
    def route(self) -> list[Hop]:
        return list(self._route)

    async def open(self) -> None:
        async with trio.open_nursery() as nursery:
            for index in range(len(self._route)):
                nursery.start_soon(self._open_hop, index)

    async def _open_hop(self, index: int) -> None:
        self.sessions[index] = await PrivateSession.open(self.host, self._route[index], self.model_id,
                                                         self.secret.params.name, self.keys, self.digest, self.stats)

    async def close(self) -> None:
        for session in list(self.sessions.values()):
            await session.close()
        self.sessions.clear()

    async def keep_alive(self) -> None:
        """Run beside the generation (until cancelled): every quiet session hears when
        to expect its next request, so a hop waiting for the others is not closed."""
        while True:
            await trio.sleep(KEEPALIVE_CHECK_S)
            for session in list(self.sessions.values()):
                try:
                    await session.keep_alive()
                except Exception as exc:  # its next request fails and is failed over as any other
                    log.info("private session with %s: keep-alive not sent: %r", session.hop.peer_id[-8:], exc)

    async def step(self, hidden: torch.Tensor) -> torch.Tensor:
        n = hidden.shape[1]
        if self.spot_check_rate > 0 and self.rng.random() < self.spot_check_rate:
            self._check_this_step = (self.rng.randrange(len(self.layers.layers)),
                                     self.rng.choice(("qkv", "o", "gate_up", "down")))
        else:
            self._check_this_step = None
        stages = [(hop.start, hop.end) for hop in self._route]
        for attempt in range(MAX_FAILOVERS + 1):
            try:
                if n > PIPELINE_CHUNK and len(stages) > 1:
                    out = await pipelined(self._forward, hidden, stages, self.position)
                else:
                    out = await trio.to_thread.run_sync(self._forward, hidden, self.position, 0, None)
                break
            except _Redo:
                if attempt == MAX_FAILOVERS:
                    raise HopFailed("", MISMATCH, "private spot checks kept failing") from None
                self._cut_back()
                stages = [(0, len(self.layers.layers))]  # the redo runs plainly
        self.position += n
        return out

    def _cut_back(self) -> None:
        """Drop what the layers already run appended of this step (transformers 5's
        `crop` takes a negative count of tokens to remove, per layer)."""
        for layer in self.cache.layers:
            surplus = layer.get_seq_length() - self.position if layer.is_initialized else 0
            if surplus > 0:
                layer.crop(-surplus)

    def _forward(self, hidden: torch.Tensor, position: int, start: int, end: int | None) -> torch.Tensor:
        """One forward of layers start..end in this worker thread; what of it was not
        spent in products (encrypting, waiting, decrypting) is the consumer's local work."""
        self._tls.in_products = 0.0
        began = time.perf_counter()
        out = self.layers.forward(hidden, self.cache, position, start, end)
        self.stats.local_s += time.perf_counter() - began - self._tls.in_products
        return out

    # -- one product, called from the forward's worker thread --

    def _project(self, layer: int, group: str, x: torch.Tensor) -> torch.Tensor:
        entered = time.perf_counter()
        try:
            return self._product(layer, group, x)
        finally:
            self._tls.in_products = getattr(self._tls, "in_products", 0.0) + time.perf_counter() - entered

    def _product(self, layer: int, group: str, x: torch.Tensor) -> torch.Tensor:
        began = time.perf_counter()
        requests = encrypt_requests(self.secret, *self._shapes[group], self._per_request[group], x.double().numpy())
        self.stats.encrypt_s += time.perf_counter() - began
        parts, signed = [], []
        for request in requests:
            for attempt in range(MAX_FAILOVERS + 1):
                outs, claim = trio.from_thread.run(self._roundtrip, layer, group, request)
                began = time.perf_counter()
                try:
                    parts.append(decrypt_product(self.secret, request, outs))
                    signed.append(claim)
                    break
                except PrivateProtocolError as exc:  # the provider's answer is not a product
                    if attempt == MAX_FAILOVERS:
                        raise
                    trio.from_thread.run(self._fail_over, hop_index(self._route, layer), exc)
                finally:
                    self.stats.decrypt_s += time.perf_counter() - began
        result = np.concatenate(parts)
        if self._check_this_step == (layer, group):
            self._check_this_step = None
            if not trio.from_thread.run(self._spot_check, layer, group, requests[0], parts[0], signed[0]):
                raise _Redo()
        self.stats.products += len(result)
        self.stats.projections += len(result) * {"qkv": 3, "gate_up": 2}.get(group, 1)
        return torch.from_numpy(result).to(x.dtype)

    async def _roundtrip(self, layer: int, group: str, request: Request) -> tuple[list[list[bytes]], Signed]:
        reopened = False
        for attempt in range(MAX_FAILOVERS + 1):
            index = hop_index(self._route, layer)
            try:
                if index not in self.sessions:
                    await self._open_hop(index)
                return await self._ask(self.sessions[index], layer, group, request)
            except Exception as exc:  # py-libp2p's stream and dial errors have no common base
                if attempt == MAX_FAILOVERS:
                    raise
                session = self.sessions.get(index)
                if session is not None and session.late and not reopened:
                    reopened = True  # we were quiet past what it expected: its close is no fault
                    await self._reopen(index, exc)
                    continue
                await self._fail_over(index, exc)
        raise AssertionError("unreachable")

    async def _reopen(self, index: int, exc: BaseException) -> None:
        """A new session on the same provider, unpenalised (its keys are cached there)."""
        session = self.sessions.pop(index)
        log.info("private session with %s ended after we were quiet past what it expected (%s): opening "
                 "another", session.hop.peer_id[-8:], exc)
        await session.close()
        self.stats.reopened += 1

    async def _ask(self, session: PrivateSession, layer: int, group: str, request: Request) -> tuple[list, Signed]:
        began = time.perf_counter()
        outs, compute_s, signed = await session.project(layer, group, request)
        s = self.stats
        s.roundtrip_s += time.perf_counter() - began
        s.provider_s += compute_s
        s.bytes_sent += sum(len(c) for c in request.cts)
        s.bytes_received += sum(len(c) for out in outs for c in out)
        return outs, signed

    async def _fail_over(self, index: int, exc: BaseException) -> None:
        hop = self._route[index]
        noticed = time.time()
        log.warning("private hop %s (blocks %d:%d) failed: %s; replacing it", hop.peer_id[-8:], hop.start, hop.end,
                    exc)
        session = self.sessions.pop(index, None)
        if session is not None:
            await session.close()
        if self.planner is None:
            raise HopFailed(hop.peer_id, FAILED, f"private hop {hop.peer_id[-8:]} failed and no planner can "
                                                   f"replace it: {exc}")
        if hop.peer_id not in self.avoid:  # a spot check's mismatch penalised it already
            self.planner.penalties.fault(hop.peer_id, time.monotonic())
        replacement = await self.planner.plan(hop.start, hop.end, deadline=trio.current_time() + 20)
        self._route[index:index + 1] = replacement
        self.sessions = {i: s for i, s in self.sessions.items() if i < index} | {
            i + len(replacement) - 1: s for i, s in self.sessions.items() if i > index}
        self.failovers.append(Failover(hop.peer_id, hop.start, hop.end, str(exc)[:200] or type(exc).__name__,
                                       noticed, time.time(), tuple(h.peer_id for h in replacement)))

    async def _spot_check(self, layer: int, group: str, request: Request, ours: np.ndarray, signed: Signed) -> bool:
        """Ask another provider of `layer` for the same product and compare. On a
        mismatch a third provider (if any) decides who is wrong (with none, the
        route's provider, whose claim is `signed`), and is reported. False when the
        route's provider was wrong (it is then replaced)."""
        if self.planner is None:
            return True
        index = hop_index(self._route, layer)
        served_by = self._route[index].peer_id
        verifier = random_verifier(self.planner, layer, {served_by} | self.avoid, self.rng)
        if verifier is None:
            return True
        self.checks += 1
        theirs, claimed = await self._product_from(verifier, layer, group, request)
        if theirs is None or _agree(ours, theirs):
            return True
        third = random_verifier(self.planner, layer, {served_by, verifier.peer_id} | self.avoid, self.rng)
        decider = (await self._product_from(third, layer, group, request))[0] if third is not None else None
        if decider is not None and _agree(ours, decider) and not _agree(theirs, decider):
            wrong = verifier.peer_id
        else:
            wrong = served_by
        log.warning("private spot check of layer %d %s: %s and %s disagree (relative %.2e)%s; %s is wrong",
                    layer, group, served_by[-8:], verifier.peer_id[-8:], _difference(ours, theirs),
                    f", {third.peer_id[-8:]} decided" if decider is not None else "", wrong[-8:])
        self.check_failures.append(wrong)
        self.reports += mismatch_report(signed, claimed, ours_wrong=wrong == served_by)
        self.avoid.add(wrong)
        self.planner.penalties.mismatch(wrong, time.monotonic())
        if wrong != served_by:
            return True
        await self._fail_over(index, HopFailed(served_by, MISMATCH, f"private spot check failed on layer {layer} "
                                                                      f"{group}"))
        return False

    async def _product_from(self, hop: Hop, layer: int, group: str, request: Request) -> tuple:
        """The same product from another provider, in a session of its own, and its
        signed claim; (None, None) if it cannot answer (which proves nothing)."""
        try:
            session = await PrivateSession.open(self.host, Hop(hop.record, layer, layer + 1), self.model_id,
                                                self.secret.params.name, self.keys, self.digest, self.stats)
            try:
                outs, _, signed = await session.project(layer, group, request)
            finally:
                await session.close()
            return decrypt_product(self.secret, request, outs), signed
        except Exception as exc:
            log.info("private spot check of layer %d by %s did not complete: %s", layer, hop.peer_id[-8:], exc)
            return None, None


async def pipelined(forward, hidden: torch.Tensor, stages: list[tuple[int, int]], position: int) -> torch.Tensor:
    """A prefill in chunks of PIPELINE_CHUNK tokens through the route's layer
    ranges as a pipeline: while one provider computes chunk c's products for its
    layers, the one before it computes chunk c + 1's. Each range takes its chunks
    in order, so every layer's KV cache grows as in a plain forward. `forward(h,
    position, start, end)` runs layers start..end on a chunk, in a worker thread."""
    chunks = [hidden[:, i:i + PIPELINE_CHUNK] for i in range(0, hidden.shape[1], PIPELINE_CHUNK)]
    outputs: list[torch.Tensor | None] = [None] * len(chunks)
    channels = [trio.open_memory_channel(len(chunks)) for _ in range(len(stages) + 1)]

    async def stage(index: int, start: int, end: int) -> None:
        receive, send = channels[index][1], channels[index + 1][0]
        async with send:
            async for which, h, position in receive:
                out = await trio.to_thread.run_sync(forward, h, position, start, end)
                await send.send((which, out, position))

    try:
        async with trio.open_nursery() as nursery:
            for index, (start, end) in enumerate(stages):
                nursery.start_soon(stage, index, start, end)
            async with channels[0][0] as first:
                offset = position
                for which, chunk in enumerate(chunks):
                    await first.send((which, chunk, offset))
                    offset += chunk.shape[1]
            async for which, out, _ in channels[-1][1]:
                outputs[which] = out
    except BaseExceptionGroup as group:  # one stage failed (a redo, a failed hop): that error, unwrapped
        leaves = [e for e in _leaves(group) if not isinstance(e, trio.Cancelled)]
        if len(leaves) == 1:
            raise leaves[0] from None
        raise
    return torch.cat(outputs, dim=1)


def encrypt_requests(secret: SecretContext, rows: int, cols: int, step: int, values: np.ndarray) -> list[Request]:
    """The token rows of `values` encrypted for a rows x cols product, as requests of
    at most `step` tokens (so that each fits a frame, both ways)."""
    out = []
    for offset in range(0, len(values), step):
        part = values[offset:offset + step]
        plan = choose(rows, cols, secret.slots, len(part))
        cts = [secret.encrypt(slots) for start in range(0, len(part), plan.tokens)
               for slots in plan.input_slots(part[start:start + plan.tokens])]
        out.append(Request(len(part), plan, tuple(cts)))
    return out


def decrypt_product(secret: SecretContext, request: Request, outs: list[list[bytes]]) -> np.ndarray:
    """[tokens, rows]: a request's products from a provider's output ciphertexts
    (per group of the plan, its outputs)."""
    plan = request.plan
    if len(outs) != plan.groups(request.tokens) or any(len(group) != plan.outputs for group in outs):
        raise PrivateProtocolError(f"{[len(g) for g in outs]} output ciphertexts, the plan makes "
                                   f"{plan.groups(request.tokens)} groups of {plan.outputs}")
    try:
        return plan.reduce(np.stack([secret.decrypt(ct) for group in outs for ct in group]), request.tokens)
    except HEError as exc:
        raise PrivateProtocolError(f"a provider's product did not decrypt: {exc}") from None


def hop_index(route: list[Hop], layer: int) -> int:
    for index, hop in enumerate(route):
        if hop.start <= layer < hop.end:
            return index
    raise RouteError(f"no hop holds layer {layer}")


def random_verifier(planner, layer: int, exclude: set[str], rng: random.Random) -> Hop | None:
    """A provider of `layer` to check against, chosen at random among those not
    avoided: every provider of a layer can be asked, so a liar off the route is found
    as a verifier too (the nearest one, as plaintext checks choose, would leave the
    others never asked)."""
    now = time.time()
    excluded = exclude | planner.penalties.excluded(time.monotonic()) | set(planner.unreachable)
    holders = sorted((r for r in planner.records if r.start <= layer < r.end and r.is_live(now)
                      and r.peer_id not in excluded), key=lambda r: r.peer_id)
    return Hop(rng.choice(holders), layer, layer + 1) if holders else None


def _leaves(group: BaseExceptionGroup) -> list[BaseException]:
    out = []
    for exc in group.exceptions:
        out += _leaves(exc) if isinstance(exc, BaseExceptionGroup) else [exc]
    return out


def _difference(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def _agree(a: np.ndarray, b: np.ndarray) -> bool:
    return _difference(a, b) <= CHECK_TOLERANCE


class _Redo(Exception):
    """A spot check failed: the step is computed again."""


def describe_private_route(hops: list[Hop], num_layers: int) -> list[str]:
    """What runs where in private mode, for the user (`run --private`, chat, the API)."""
    lines = ["private mode: this machine keeps the prompt, embeddings, every norm, attention and its KV "
             "cache, and the LM head; providers see only CKKS ciphertexts"]
    for index, hop in enumerate(hops, 1):
        lines.append(f"hop {index}: {hop.peer_id} layers {hop.start}:{hop.end}: q, k, v, o, gate, up, down "
                     f"projections encrypted")
    covered = sum(h.end - h.start for h in hops)
    lines.append(f"{covered} of {num_layers} layers x 7 projections encrypted; none in plaintext")
    return lines
