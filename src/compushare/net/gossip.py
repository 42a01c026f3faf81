"""GossipSub glue for capability ads, and the view protocol that hands them out.

GossipSub v1.1 only (py-libp2p 0.8.1's v1.2 IDONTWANT path stalls under load), with
pubsub-level signing on. Ads travel on one topic per model (net/ad_intake.ad_topic):
a node joins the topics of the models it serves (on its first publication) and of
those it consumes (`follow`), and publishes only if it serves something, on the
topic of each model it serves, at a period that stretches with the topic's size
(net/ad_intake.ad_period). Before pubsub checks a message's signature, the early
drops of net/ad_intake run (size, topic, sender pace); a topic validator then runs
the cached ad checks and the view's rate/replay rules on every ad before it is
forwarded, so an invalid ad neither enters this node's view nor travels further
through it.

`/compushare/view/1.0.0` lets a short-lived client (`compushare status`, a
consumer choosing its route) ask any node for the ads it holds instead of waiting
a whole period on the topic; a request may name a model, and the reply then holds
only the ads that serve it. The reply is the signed ads themselves: the client
re-checks every signature (once per digest: net/ad_intake) and trusts the relaying
node for nothing.
"""

from __future__ import annotations

import contextlib
import logging
import random
import time
from collections.abc import AsyncIterator, Awaitable, Callable

import trio
from libp2p.abc import IHost, INetStream
from libp2p.peer.id import ID
from libp2p.peer.peerinfo import PeerInfo
from libp2p.pubsub.gossipsub import PROTOCOL_ID_V11, GossipSub
from libp2p.pubsub.pb import rpc_pb2
from libp2p.pubsub.pubsub import Pubsub
from libp2p.tools.anyio_service import background_trio_service

from .. import defences, wire
from ..errors import PeerMisbehaved
from .ad_intake import (GOSSIP_LAZY, HEARTBEAT_S, MAX_VIEW_ADS, MESH_DEGREE, AdIntake, ad_period, ad_topic,
                        model_of_topic, served_models)
from .ads import AD_PERIOD_S, MAX_AD_BYTES, CapabilityAd, parse_ad
from .framing import FramedStream, request_reply
from .limits import TokenBucket
from .serve import GuardedHandler
from .dial import dial
from .view import MAX_PEERS, PUBLISH_INTERVAL_S, SwarmView

log = logging.getLogger(__name__)

VIEW_PROTOCOL = wire.VIEW
MAX_VIEW_FRAME = MAX_VIEW_ADS * (MAX_AD_BYTES + 16) + 1024
VIEW_TIMEOUT_S = 5.0
DIAL_TIMEOUT_S = 5.0
# Ads checked per second from peers not in the view, node-wide (and a burst of 10 s
# worth): a 1,000-node swarm publishes 200 ads/s, nearly all from peers in view.
NEWCOMER_ADS_PER_S = 50.0
NEWCOMER_ADS_BURST = 10 * NEWCOMER_ADS_PER_S
EVIDENCE_PERIOD_S = 2.0
# A topic short of D_low neighbours after the ads' peers were dialled: its model's
# providers are looked up in the DHT, at most once per this (a small topic stays short).
PROVIDER_LOOKUP_S = 60.0
MAX_LEGACY_NOTED = 256  # peers still on revision 21's one ad topic, each logged once
# The checks of relayed ads (view replies), cached by digest: every peer asked sends them.
RELAYED_ADS = AdIntake()


class Gossip:
    """Publishes this node's ad every period (and on demand) and keeps `view` fed.

    `make_ad` is called for every publication (its ad's lifetime should follow
    `period_now`, the stretched period); None, or an ad serving nothing, makes a
    listen-only member. `models`: topics to follow from the start. `find_providers`:
    a model's providers from the DHT, dialled when a topic has too few neighbours.
    """

    def __init__(self, host: IHost, view: SwarmView, make_ad: Callable[[], CapabilityAd] | None = None,
                 *, period_s: float = AD_PERIOD_S, on_ad: Callable[[CapabilityAd], None] | None = None,
                 models: tuple[str, ...] = (),
                 find_providers: Callable[[str], Awaitable[list[PeerInfo]]] | None = None) -> None:
        self.host = host
        self.view = view
        self.make_ad = make_ad
        self.period_s = period_s  # the base period
        self.period_now = period_s  # stretched by the size of the topics we publish on
        self.on_ad = on_ad
        self.pubsub: Pubsub | None = None
        self.intake = AdIntake()
        self._wanted: dict[str, None] = dict.fromkeys(models)  # model ids to follow, in order
        self._follow_now = trio.Event()
        self._publish_now = trio.Event()
        self._last_publish = -float("inf")
        self._serves: list[str] = []  # the models of our last ad: the topics we publish on
        self._legacy_noted: set[ID] = set()
        self.find_providers, self._looked_up = find_providers, -float("inf")
        self._nursery: trio.Nursery | None = None  # run()'s, where each topic's subscription is read
        self.published = 0

    # ------------------------------------------------------------------ validation

    def _validate(self, _forwarder: ID, msg: rpc_pb2.Message) -> bool:
        """Topic validator: False drops the message here and stops its spread."""
        now, topic = time.time(), msg.topicIDs[0] if len(msg.topicIDs) == 1 else None
        try:
            ad = self.intake.check(msg.data, sender=ID(msg.from_id).to_base58(), now=now, topic=topic)
        except (PeerMisbehaved, ValueError) as exc:
            self.view.rejected += 1
            log.info("rejected an ad from %s: %s", _short(msg.from_id), exc)
            return False
        if not self.view.holds(ad):  # (the same ad on a second topic of its publisher: forwarded)
            offer = self.view.offer(ad, now)
            if not offer.accepted:
                log.debug("ad from %s not taken: %s", ad.peer_id, offer.reason)
                return False
            if self.on_ad is not None:
                self.on_ad(ad)
        self.intake.accepted(msg.from_id, topic, trio.current_time())
        return True

    # ------------------------------------------------------------------ topics

    def follow(self, model_id: str) -> None:
        """Join `model_id`'s ad topic (soon, in the background): a consumer does so when
        it first plans a route for the model. Idempotent."""
        if model_id not in self._wanted:
            self._wanted[model_id] = None
            self._follow_now.set()

    def followed(self) -> set[str]:
        return set(self.intake.followed)

    async def _join(self, model_id: str) -> None:
        if model_id in self.intake.followed or self.pubsub is None or self._nursery is None:
            return
        topic = ad_topic(model_id)
        self.pubsub.set_topic_validator(topic, self._validate, is_async_validator=False)
        self.intake.followed.add(model_id)
        subscription = await self.pubsub.subscribe(topic)
        self._nursery.start_soon(self._drain, subscription)
        log.info("following the ads of %s", model_id[:12])

    async def _follow_loop(self) -> None:
        while True:
            for model_id in list(self._wanted):
                await self._join(model_id)
            await self._follow_now.wait()
            self._follow_now = trio.Event()

    # ------------------------------------------------------------------ tasks

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        router = make_router()
        pubsub = Pubsub(self.host, router, strict_signing=True)
        pubsub.push_msg = _guarded_push(pubsub, self.view, self.intake)  # the instance attribute wins
        self.host.set_stream_handler(PROTOCOL_ID_V11, _guarded(pubsub))
        # A view request is one small message: 4 at once per peer is plenty, and 64 in
        # all keeps a crowd of peers from holding the node's view streams open.
        self.host.set_stream_handler(VIEW_PROTOCOL, GuardedHandler(self._serve_view, per_peer=4, total=64,
                                                                   defence="stream_caps"))
        async with background_trio_service(pubsub), background_trio_service(router):
            await pubsub.wait_until_ready()
            # Pubsub learns of peers from connection events only: connections made
            # before it started would never carry gossip. (Private in the pinned 0.8.1.)
            for peer in list(self.host.get_network().connections):
                pubsub.manager.run_task(pubsub._handle_new_peer_with_retry, peer)
            self.pubsub = pubsub
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                for model_id in list(self._wanted):
                    await self._join(model_id)
                nursery.start_soon(self._follow_loop)
                nursery.start_soon(self._expire_loop)
                nursery.start_soon(self._evidence_loop)
                nursery.start_soon(self._mesh_loop)
                if self.make_ad is not None:
                    nursery.start_soon(self._publish_loop)
                task_status.started(self)
                await trio.sleep_forever()

    async def _drain(self, subscription) -> None:
        # Validated ads are already in the view; the subscription must still be
        # read or its channel fills up and pubsub stalls.
        while True:
            await subscription.get()

    async def _expire_loop(self) -> None:
        while True:
            await trio.sleep(1.0)
            for peer in self.view.expire(time.time()):
                log.info("peer %s stopped advertising: dropped from the view", peer)

    async def _evidence_loop(self) -> None:
        """Tell the view which peers are more than a key: this node, and the peers
        connected to it that completed identify (a Sybil key with no running host
        cannot). Karma evidence comes from the node (app/node.py)."""
        self.view.set_self(self.host.get_id().to_base58())
        while True:
            self.view.note_connected(self.identified_peers(), time.time())
            await trio.sleep(EVIDENCE_PERIOD_S)

    def identified_peers(self) -> list[str]:
        peerstore, found = self.host.get_peerstore(), []
        for peer in list(self.host.get_network().connections):
            with contextlib.suppress(Exception):  # not in the peerstore: identify has not run
                if peerstore.get_protocols(peer):
                    found.append(peer.to_base58())
        return found

    async def _mesh_loop(self) -> None:
        """Keep at least D_low gossip neighbours: retry the pubsub handshake with
        connected peers that never completed it, and dial peers learned from ads."""
        while True:
            await trio.sleep(self.period_s / 2)
            pubsub = self.pubsub
            for peer in list(self.host.get_network().connections):
                if pubsub is not None and peer not in pubsub.peers:  # private in the pinned 0.8.1
                    pubsub.manager.run_task(pubsub._handle_new_peer_with_retry, peer)
            note_legacy_peers(self.pubsub, self._legacy_noted)
            missing = MESH_DEGREE[1] - len(self.subscribed_peers())
            if missing > 0 and self.intake.followed:
                missing -= await dial_ad_peers(self.host, self.view, missing)
            now = trio.current_time()
            if missing > 0 and self.find_providers is not None and self.intake.followed \
                    and now - self._looked_up >= PROVIDER_LOOKUP_S:
                self._looked_up = now
                with trio.move_on_after(3 * DIAL_TIMEOUT_S):
                    infos = await self.find_providers(random.choice(sorted(self.intake.followed)))
                    await dial_providers(self.host, infos, missing)

    def publish_soon(self) -> None:
        """Publish a fresh ad now (rate permitting), e.g. after a change of span."""
        self._publish_now.set()

    async def _publish_loop(self) -> None:
        while True:
            wait = self._last_publish + PUBLISH_INTERVAL_S - trio.current_time()
            if wait > 0:  # receivers refuse a faster ad
                await trio.sleep(wait)
            await self.publish_once()
            # Jitter keeps a swarm started at once from publishing in lockstep.
            with trio.move_on_after(self.period_now * random.uniform(0.9, 1.1)):
                await self._publish_now.wait()
            self._publish_now = trio.Event()

    def stretch_period(self) -> float:
        """The period for the next ad: the base, stretched by the largest topic we
        publish on (the providers in view, ourselves included)."""
        now = time.time()
        providers = max((self.view.providers(m, now) for m in self._serves), default=1)
        self.period_now = ad_period(providers, self.period_s)
        return self.period_now

    async def publish_once(self) -> None:
        assert self.pubsub is not None and self.make_ad is not None
        self.stretch_period()
        ad = self.make_ad()
        self._last_publish = trio.current_time()
        # Never longer than a third of the ad's own lifetime: a make_ad that ignores
        # period_now must not see its ads expire between publications.
        self.period_now = min(self.period_now, (ad.expires - ad.sent) / 3)
        try:  # pubsub would drop our own bad ad silently: say so instead
            parse_ad(ad.raw, sender=ad.peer_id)
        except PeerMisbehaved as exc:
            log.error("our own ad is invalid, not publishing it: %s", exc)
            return
        self._serves = served_models(ad)
        if not self._serves:  # serving nothing: nothing to say (and no topic to say it on)
            return
        for model_id in self._serves:
            await self._join(model_id)
            try:
                await self.pubsub.publish(ad_topic(model_id), ad.raw)
            except Exception as exc:  # pubsub raises assorted errors while peers come and go
                log.warning("publishing our ad failed: %s", exc)
                return
        self.published += 1

    def subscribed_peers(self) -> set[ID]:
        """The peers on any of the topics we follow."""
        if self.pubsub is None:
            return set()
        return {peer for model_id in self.intake.followed
                for peer in self.pubsub.peer_topics.get(ad_topic(model_id), ())}

    # ------------------------------------------------------------------ view protocol

    async def _serve_view(self, stream: INetStream) -> None:
        framed = FramedStream(stream, 4096)
        try:
            with trio.fail_after(VIEW_TIMEOUT_S):
                request = await framed.receive()
                model = request.get("model") if request is not None else None
                if request is None or request.get("type") != "view" or (
                        model is not None and (not isinstance(model, str) or model_of_topic(ad_topic(model)) is None)):
                    await framed.send({"type": "error", "code": "bad_request", "message": "expected a view request"})
                else:
                    # Evidenced peers first, then a random sample of newcomers (net/view.py):
                    # keys ground to sort first no longer crowd the servers out.
                    ranked = self.view.ranked(time.time(), MAX_VIEW_ADS)
                    ads = [ad.raw for ad in ranked if model is None or ad.serving_of(model)]
                    await framed.send({"type": "view", "ads": ads})
                await framed.close()
        except Exception as exc:  # a handler must not raise into py-libp2p's connection task
            log.debug("view request failed: %s", exc)
            with contextlib.suppress(Exception):
                await framed.reset()


async def fetch_view(host: IHost, peer_id: ID, view: SwarmView, model_id: str | None = None) -> int:
    """Ask `peer_id` for its ads (those serving `model_id` only, if given) and offer
    each to `view` after checking it; return how many were taken."""
    with trio.fail_after(VIEW_TIMEOUT_S):
        request = {"type": "view"} | ({"model": model_id} if model_id is not None else {})
        reply = await request_reply(host, peer_id, VIEW_PROTOCOL, request, MAX_VIEW_FRAME)
    if reply is None or reply.get("type") != "view" or not isinstance(reply.get("ads"), list):
        raise PeerMisbehaved(f"{peer_id} answered a view request with {reply and reply.get('type')}")
    taken = 0
    now = time.time()
    for raw in reply["ads"][:MAX_VIEW_ADS]:
        try:
            ad = RELAYED_ADS.check(raw, sender=None, now=now)
        except (PeerMisbehaved, TypeError) as exc:
            log.info("%s relayed a bad ad: %s", peer_id, exc)
            continue
        taken += view.replace(ad, now)
    return taken


async def learn_views(host: IHost, view: SwarmView, model_id: str | None = None, *, sample: bool = False) -> int:
    """Fill `view` from connected peers' views (the ads serving `model_id` only, if given);
    return how many answered. `sample`: a few (SwarmView.sample_for, the model's servers
    first), for a caller that asks again and again: a consumer's planner."""
    answered = 0

    async def one(peer) -> None:
        nonlocal answered
        with contextlib.suppress(Exception):
            await fetch_view(host, peer, view, model_id)
            answered += 1

    connected = {peer.to_base58(): peer for peer in host.get_network().connections}
    async with trio.open_nursery() as nursery:
        for peer in view.sample_for(list(connected), model_id, time.time()) if sample else connected:
            nursery.start_soon(one, connected[peer])
    return answered


async def dial_ad_peers(host: IHost, view: SwarmView, want: int) -> int:
    """Connect to up to `want` peers known from ads we are not connected to, so the
    gossip mesh has enough members beyond the bootstrap peers."""
    connected = set(host.get_network().connections)
    me = host.get_id().to_string()
    # Peers with evidence first, then newcomers at random (net/view.ranked): a flood of
    # Sybil ads with made-up addresses does not decide whom we dial.
    candidates = [ad for ad in view.ranked(time.time(), MAX_PEERS)
                  if ad.peer_id != me and ID.from_base58(ad.peer_id) not in connected and ad.addrs]
    dialed = 0

    async def one(ad: CapabilityAd) -> None:
        nonlocal dialed
        with contextlib.suppress(Exception):
            await dial(host, ad.peer_id, ad.addrs, timeout=DIAL_TIMEOUT_S)
            dialed += 1

    async with trio.open_nursery() as nursery:
        for ad in candidates[:want]:
            nursery.start_soon(one, ad)
    return dialed


def note_legacy_peers(pubsub: Pubsub | None, noted: set[ID]) -> None:
    """Say once per peer (of at most MAX_LEGACY_NOTED) that a neighbour still speaks
    revision 21's one ad topic: neither hears the other's ads (protocol.md, revision 22)."""
    for peer in list(pubsub.peer_topics.get(wire.AD_TOPIC_V1, ())) if pubsub is not None else []:
        if peer not in noted and len(noted) < MAX_LEGACY_NOTED:
            noted.add(peer)
            log.warning("peer %s advertises on %s (protocol revision 21 or older): its ads are not heard here "
                        "nor ours there; it must be upgraded to take part in gossip", peer, wire.AD_TOPIC_V1)


async def dial_providers(host: IHost, infos: list[PeerInfo], want: int) -> int:
    """Connect to up to `want` of a model's providers (found in the DHT) we are not
    connected to, chosen at random; return how many answered."""
    connected, me = set(host.get_network().connections), host.get_id()
    fresh = [info for info in infos if info.peer_id not in connected and info.peer_id != me and info.addrs]
    dialed = 0

    async def one(info: PeerInfo) -> None:
        nonlocal dialed
        with contextlib.suppress(Exception), trio.fail_after(DIAL_TIMEOUT_S):
            await host.connect(info)
            dialed += 1

    async with trio.open_nursery() as nursery:
        for info in random.sample(fresh, min(want, len(fresh))):
            nursery.start_soon(one, info)
    return dialed


def make_router() -> GossipSub:
    """GossipSub v1.1 as every node runs it. Adaptive gossip off: with peer scoring
    unweighted its health score stays low and it stretches the heartbeat to 30-60 s, so
    meshes stop being pruned and the nodes everyone joined through fall behind."""
    degree, low, high = MESH_DEGREE
    router = GossipSub(protocols=[PROTOCOL_ID_V11], degree=degree, degree_low=low, degree_high=high,
                       heartbeat_interval=HEARTBEAT_S, heartbeat_initial_delay=0.1,
                       adaptive_gossip_enabled=False)
    # IHAVE to GOSSIP_LAZY peers a topic, not a quarter of the connected ones: flat in N.
    router._get_adaptive_gossip_peers_count = lambda _topic, _peers: GOSSIP_LAZY  # private in 0.8.1
    return router


@contextlib.asynccontextmanager
async def open_gossip(host: IHost, view: SwarmView, make_ad=None, **kwargs) -> AsyncIterator[Gossip]:
    gossip = Gossip(host, view, make_ad, **kwargs)
    async with trio.open_nursery() as nursery:
        await nursery.start(gossip.run)
        try:
            yield gossip
        finally:
            nursery.cancel_scope.cancel()


def _guarded(pubsub: Pubsub):
    """py-libp2p's pubsub stream handler lets a protobuf DecodeError (any peer can
    send garbage) escape into the connection's task, which takes the whole node
    down. This one drops that stream and peer instead, and closes the stream when
    the handler is done with it."""

    async def handler(stream: INetStream) -> None:
        try:
            await pubsub.stream_handler(stream)
            # It returns on a clean or a truncated end of the peer's side without ever
            # closing ours: the stream would stay half open for the connection's life.
            with contextlib.suppress(Exception):
                await stream.close()
        except Exception as exc:
            peer = stream.muxed_conn.peer_id
            log.info("dropping the gossip stream of %s: %s", peer, exc)
            with contextlib.suppress(Exception):
                await stream.reset()
            pubsub._handle_dead_peer(peer)  # private in the pinned 0.8.1

    return handler


def _guarded_push(pubsub: Pubsub, view: SwarmView, intake: AdIntake):
    """py-libp2p checks each received message in its own pubsub task (push_msg), and its
    signature check raises on a `key` field that is not a public key (sent with a
    peer id that embeds none): the exception ends the pubsub service, and the node
    with it. A message that fails so is dropped instead.

    Checking an ad costs two signature checks and a decode on the event loop, and
    fresh keys cost an attacker nothing: ads of peers the view does not hold share
    one budget of NEWCOMER_ADS_PER_S, and those over it are dropped before any
    check (nor forwarded). Ads of peers in the view are always checked. A newcomer
    publishes again every period, so under a flood its ad gets in within a few
    tries; learn_views (a request, not gossip) is not budgeted. Before all of that,
    the early drops of net/ad_intake (size, topic, sender pace) cost no check at all."""
    push = pubsub.push_msg
    budget = TokenBucket(NEWCOMER_ADS_PER_S, NEWCOMER_ADS_BURST)
    unlimited = defences.disabled("view_policy")

    async def push_msg(forwarder: ID, msg: rpc_pb2.Message) -> None:
        if forwarder != pubsub.my_id and intake.early_drop(len(msg.data), list(msg.topicIDs), msg.from_id,
                                                           trio.current_time()) is not None:
            return
        if not unlimited and forwarder != pubsub.my_id and not _in_view(view, msg.from_id):
            if budget.take(1, trio.current_time()):
                view.newcomer_ads_dropped += 1
                return
        try:
            await push(forwarder, msg)
        except Exception as exc:
            if forwarder == pubsub.my_id:  # our own publication: the caller reports it
                raise
            log.info("dropping a gossip message from %s: %r", forwarder, exc)

    return push_msg


def _in_view(view: SwarmView, peer_bytes: bytes) -> bool:
    try:
        return view.get(ID(peer_bytes).to_base58(), time.time()) is not None
    except Exception:  # not a peer id: pubsub's own check rejects it
        return True


def _short(peer_bytes: bytes) -> str:
    try:
        return ID(peer_bytes).to_base58()
    except Exception:
        return "?"
