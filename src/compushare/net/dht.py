"""Kademlia DHT glue: strict validation, provider keys, and fresh look-ups.

py-libp2p 0.8.1 facts this module works around:
- validation is off unless strict and a validator is registered per namespace;
- its routing table is not filled on connect: we add peers ourselves;
- the per-subnet diversity cap (2 per /24) would refuse a loopback swarm;
- `find_providers` and `get_value` answer from the local store first and cache
  what they find, so a second look-up never sees a provider that came later.
- a peer whose addresses all failed once is not redialled for a while (its
  "negative cache"): bootstrap dials clear it first.
  `find_providers_fresh` / `get_record_fresh` always ask the network.
- every DHT request to one peer may take 10 s (QUERY_TIMEOUT), and an iterative
  look-up waits for its slowest peer: one hung peer stalls every look-up. We cut
  the per-request time to 3 s (net/libp2p_patches.py), and our fresh look-ups also
  ask the peers we know directly, each on its own deadline.
- it serves 12 inbound streams at once, node-wide, each waiting forever for the
  peer's next message: one peer's stalled streams took the DHT from everyone. We
  bound streams per peer and reset silent ones (_guard_inbound_streams).
- it stores any valid record or provider entry a peer puts, up to 50,000 records,
  for 24-48 h: a flood of valid records signed by fresh keys grew a node without
  bound. Server nodes bound both stores by bytes, per publisher, per sender and in
  time (net/store_bounds.py; _bound_stores).

Record namespaces: this module validates its own (server records); the caller
hands `open_dht` the validators of every other namespace its node accepts (karma
records: karma.record.karma_validators()), so that net imports nothing above it.
"""

from __future__ import annotations

import contextlib
import contextvars
import hashlib
import logging
import time
from collections.abc import AsyncIterator, Iterable, Mapping

import msgpack
import trio
from libp2p.abc import IHost, INetStream
from libp2p.kad_dht.common import PROTOCOL_ID
from libp2p.kad_dht.kad_dht import DHTMode, KadDHT
from libp2p.peer.id import ID
from libp2p.peer.peerinfo import PeerInfo
from libp2p.records.validator import NamespacedValidator, Validator
from libp2p.tools.anyio_service import background_trio_service

from .. import defences, wire
from ..errors import CompushareError, PeerMisbehaved, SwarmUnreachable
from .dial import dial, parse_peer_addr
from .libp2p_patches import PEER_QUERY_TIMEOUT_S
from .records import RECORD_NAMESPACE, ServerRecord, newest_index, parse_record, record_key
from .serve import GuardedHandler
from .signed import SignedRecordValidator
from .store_bounds import (MAX_PROVIDER_ADDRS, PROVIDER_BOUNDS, VALUE_BOUNDS, BoundedStore, provider_size,
                           publisher_of, value_size)

log = logging.getLogger(__name__)

LOOKUP_TIMEOUT_S = 5.0
DIAL_TIMEOUT_S = 5.0
INBOUND_STREAMS = 48  # inbound DHT streams served at once (py-libp2p: 12)
INBOUND_PER_PEER = 12  # of which one peer may hold (what py-libp2p allowed every peer together)
INBOUND_IDLE_S = 10.0  # an inbound DHT stream silent this long is reset
INBOUND_MAX_S = 120.0  # and none is served longer
ROUTING_SYNC_PERIOD_S = 2.0
# A connected DHT server the routing table turned away (its bucket full and the oldest
# peer there answered a ping) is offered again only after this: offering it every sync
# cost a ping each time, a cost that grew with the node's connections.
REFUSED_RETRY_S = 300.0


def block_key(model_id: str, block: int) -> str:
    """Provider key for one block of a model (hex: py-libp2p uses it as raw bytes)."""
    return hashlib.sha256(f"{wire.BLOCK_KEY}{model_id}/{block}".encode()).hexdigest()


def model_key(model_id: str) -> str:
    """Provider key for "serves some block of this model": one look-up finds most servers."""
    return hashlib.sha256(f"{wire.MODEL_KEY}{model_id}".encode()).hexdigest()


@contextlib.asynccontextmanager
async def open_dht(host: IHost, *, server: bool,
                   validators: Mapping[str, Validator] | None = None) -> AsyncIterator[KadDHT]:
    """A running DHT on `host`: a server (it stores records and answers queries) or a
    client. Validation is strict: a record is accepted only in a namespace with a
    validator, net's server records and `validators` (namespace -> Validator)."""
    namespaces: dict[str, Validator] = {RECORD_NAMESPACE: SignedRecordValidator(parse_record, newest_index)}
    for namespace, validator in (validators or {}).items():
        if namespace in namespaces:
            raise ValueError(f"DHT namespace {namespace!r} is net's own")
        namespaces[namespace] = validator
    validator = NamespacedValidator(namespaces, strict_validation=True)
    dht = KadDHT(
        host,
        DHTMode.SERVER if server else DHTMode.CLIENT,
        validator=validator,
        validator_changed=True,
        strict_validation=True,
        max_peers_per_subnet=0,  # a loopback swarm lives in one /24
    )
    if server:
        _guard_inbound_streams(host, dht)
        _keep_clients_out(dht)
        if defences.disabled("dht_bounds"):
            log.warning("defence dht_bounds is off: this node stores every valid DHT record it is sent")
        else:
            _bound_stores(dht)
    async with background_trio_service(dht):
        yield dht


class _IdleBoundedStream:
    """An inbound DHT stream whose every read gives up after `idle_s`."""

    def __init__(self, stream: INetStream, idle_s: float) -> None:
        self._stream, self._idle_s = stream, idle_s

    def __getattr__(self, name: str):
        return getattr(self._stream, name)

    async def read(self, n: int | None = None) -> bytes:
        with trio.fail_after(self._idle_s):  # py-libp2p's handler resets the stream on the error
            return await self._stream.read(n)


def _guard_inbound_streams(host: IHost, dht: KadDHT) -> None:
    """py-libp2p serves at most 12 inbound DHT streams at once, node-wide, and waits
    forever for a stream's next message: one peer holding 12 stalled streams (half a
    message each) took the DHT from everyone else for as long as it liked. Here one
    peer gets at most INBOUND_PER_PEER streams of INBOUND_STREAMS, a stream that stays
    silent for INBOUND_IDLE_S (or lives INBOUND_MAX_S) is reset."""
    dht._inbound_limiter.total_tokens = INBOUND_STREAMS  # private in the pinned 0.8.1

    async def serve(stream: INetStream) -> None:
        _SENDER.set(stream.muxed_conn.peer_id.to_base58())  # this task's, for _bound_stores
        with trio.move_on_after(INBOUND_MAX_S) as scope:
            await dht.handle_stream(_IdleBoundedStream(stream, INBOUND_IDLE_S))
        if scope.cancelled_caught:
            with contextlib.suppress(Exception):
                await stream.reset()

    host.set_stream_handler(PROTOCOL_ID, GuardedHandler(serve, per_peer=INBOUND_PER_PEER))


# The peer whose inbound DHT stream the current task serves (None: our own calls).
# py-libp2p's handler does not tell its stores who sent a record; each inbound stream
# is served in a task of its own, so the task's context does.
_SENDER: contextvars.ContextVar[str | None] = contextvars.ContextVar("compushare_dht_sender", default=None)


class StoreRefused(CompushareError):
    """A put this node will not store (py-libp2p's handler then resets the stream)."""


def _claimed_expiry(value: bytes) -> float | None:
    """The `expires` a sealed record's body states (validated before it gets here)."""
    try:
        body = msgpack.unpackb(msgpack.unpackb(value, raw=False)["body"], raw=False)
        expires = body.get("expires")
    except Exception:
        return None
    return float(expires) if isinstance(expires, int | float) and not isinstance(expires, bool) else None


def _bound_stores(dht: KadDHT) -> tuple[BoundedStore, BoundedStore]:
    """Bound what py-libp2p's value and provider stores keep for others (see
    net/store_bounds.py): every way in (a peer's PUT_VALUE and ADD_PROVIDER, our own
    puts, provides and look-up caches) passes a BoundedStore, and every way out (expiry
    on read, removal) is told to it. Returns both (for tests)."""
    me = dht.local_peer_id.to_base58()
    values, providers = BoundedStore(VALUE_BOUNDS, own=me), BoundedStore(PROVIDER_BOUNDS, own=me)
    _bound_value_store(dht.value_store, values)
    _bound_provider_store(dht.provider_store, providers, me)
    return values, providers


def _bound_value_store(value_store, values: BoundedStore) -> None:
    # key -> (Record, validity): private in the pinned 0.8.1
    stored = value_store.store
    put, put_record, remove = value_store.put, value_store.put_record, value_store.remove

    def admit_value(key: bytes, value: bytes, sender: str | None):
        decision = values.admit(key, publisher=publisher_of(key), sender=sender, size=value_size(key, value),
                                now=time.time(), expires=_claimed_expiry(value))
        for victim in decision.evict:
            stored.pop(victim, None)
        return decision

    def bounded_put(key: bytes, value: bytes, validity: float = 0.0) -> None:
        decision = admit_value(key, value, None)  # ours: always taken; anyone else's: a bounded cache
        if not decision.accepted:
            return
        put(key, value, validity)
        stored[key] = (stored[key][0], decision.expires)  # the TTL cap (py-libp2p's default: 24 h)

    def bounded_put_record(key: bytes, record) -> None:
        sender = _SENDER.get()
        decision = admit_value(key, record.value, sender)
        if not decision.accepted:
            if sender is None:
                return  # our own look-up's cache: simply not kept
            raise StoreRefused(f"not storing {key[:80]!r} from {sender}: {decision.reason}")
        put_record(key, record)
        stored[key] = (record, decision.expires)

    def bounded_remove(key: bytes) -> bool:
        values.remove(key)
        return remove(key)

    value_store.put, value_store.put_record, value_store.remove = bounded_put, bounded_put_record, bounded_remove


def _bound_provider_store(provider_store, providers: BoundedStore, me: str) -> None:
    # key -> {peer id str: ProviderRecord}: private in the pinned 0.8.1
    provided = provider_store.providers
    add_provider, get_providers = provider_store.add_provider, provider_store.get_providers

    def drop_providers(victims) -> None:
        for content_key, peer in victims:
            entries = provided.get(content_key)
            if entries is not None:
                entries.pop(peer, None)
                if not entries:
                    del provided[content_key]

    def bounded_add_provider(key: bytes, provider: PeerInfo) -> None:
        if not provider or not provider.peer_id:
            return
        peer = provider.peer_id.to_base58()
        addrs = list(provider.addrs)[:None if peer == me else MAX_PROVIDER_ADDRS]
        decision = providers.admit((key, peer), publisher=peer, sender=_SENDER.get(),
                                   size=provider_size([a.to_bytes() for a in addrs]), now=time.time())
        drop_providers(decision.evict)
        if not decision.accepted:
            return  # py-libp2p echoes an ADD_PROVIDER whatever it stored
        add_provider(key, PeerInfo(provider.peer_id, addrs))
        if peer not in provided.get(key, {}):  # py-libp2p's own cap of 20 providers per key
            providers.remove((key, peer))

    def bounded_get_providers(key: bytes) -> list[PeerInfo]:
        drop_providers(providers.expire(time.time()))  # the TTL cap (py-libp2p keeps them 48 h)
        return get_providers(key)

    provider_store.add_provider, provider_store.get_providers = bounded_add_provider, bounded_get_providers


async def connect_bootstrap(host: IHost, dht: KadDHT, addrs: Iterable[str]) -> int:
    """Dial every bootstrap address concurrently; return how many answered."""
    addrs = list(addrs)
    infos = [parse_peer_addr(a) for a in addrs]
    connected = 0

    async def one(info: PeerInfo) -> None:
        nonlocal connected
        try:
            await dial(host, info.peer_id, info.addrs, timeout=DIAL_TIMEOUT_S)
            await dht.add_peer(info.peer_id)
            connected += 1
        except trio.TooSlowError:
            log.warning("bootstrap %s did not answer within %.0fs", info.peer_id, DIAL_TIMEOUT_S)
        except Exception as exc:
            log.warning("bootstrap %s unreachable: %s", info.peer_id, exc)

    async with trio.open_nursery() as nursery:
        for info in infos:
            nursery.start_soon(one, info)
    if infos and not connected:
        raise SwarmUnreachable(f"none of {len(infos)} bootstrap peers answered: {', '.join(addrs)}")
    return connected


def speaks_dht(host: IHost, peer_id: ID) -> bool:
    """Whether identify has told us that `peer_id` serves the DHT (server mode)."""
    try:
        return str(PROTOCOL_ID) in (host.get_peerstore().get_protocols(peer_id) or ())
    except Exception:  # not in the peerstore (yet)
        return False


def identified(host: IHost, peer_id: ID) -> bool:
    """Whether identify has told us anything of `peer_id`'s protocols."""
    try:
        return bool(host.get_peerstore().get_protocols(peer_id))
    except Exception:  # not in the peerstore (yet)
        return False


def _keep_clients_out(dht: KadDHT) -> None:
    """py-libp2p adds whoever opens a DHT stream to the routing table, on the theory
    that only servers query; consumers query as clients. Each short-lived consumer
    then sat in every node's table: it set off a full re-provide (a look-up per key,
    CPU taken from the forward passes of the consumer's own generation) and later
    look-ups dialled it long after it left. The spec adds a peer only once it is
    known to serve the DHT; identify tells us, and sync_routing_table adds it then."""
    add_peer = dht.add_peer

    async def add_identified_peer(peer_id: ID, *, skip_server_mode_check: bool = False) -> bool:
        if skip_server_mode_check and not speaks_dht(dht.host, peer_id):
            return False
        return await add_peer(peer_id, skip_server_mode_check=skip_server_mode_check)

    dht.add_peer = add_identified_peer


async def sync_routing_table(host: IHost, dht: KadDHT) -> None:
    """Add every connected peer that identify says serves the DHT to the routing table
    (one the table turned away: again after REFUSED_RETRY_S), and drop those that say
    they stopped (a node that found itself behind NAT: its addresses would make every
    look-up wait on them)."""
    refused: dict[ID, float] = dht.__dict__.setdefault("_compushare_refused", {})
    now = trio.current_time()
    for peer_id, when in list(refused.items()):
        if now - when >= REFUSED_RETRY_S:
            del refused[peer_id]
    for peer_id in list(host.get_network().connections):
        if peer_id == host.get_id():
            continue
        listed, serves = dht.routing_table.peer_in_table(peer_id), speaks_dht(host, peer_id)
        if not listed and serves and peer_id not in refused:
            try:
                added = await dht.add_peer(peer_id)
            except Exception:  # (no addresses yet, say): offered again at the next sync
                continue
            if not added and not dht.routing_table.peer_in_table(peer_id):
                refused[peer_id] = now
        elif listed and not serves and identified(host, peer_id):
            dht.routing_table.remove_peer(peer_id)


async def routing_sync_loop(host: IHost, dht: KadDHT) -> None:
    """sync_routing_table every ROUTING_SYNC_PERIOD_S, for as long as a node runs."""
    while True:
        await sync_routing_table(host, dht)
        await trio.sleep(ROUTING_SYNC_PERIOD_S)


def seed_key(model_id: str) -> str:
    """Provider key for "holds pieces of this model" (seeders)."""
    return hashlib.sha256(f"{wire.SEED_KEY}{model_id}".encode()).hexdigest()


async def find_providers_fresh(dht: KadDHT, key: str) -> set[ID]:
    """Ask the peers closest to `key` for providers; never trust a cached answer."""
    return set(await find_provider_infos_fresh(dht, key))


async def find_model_providers(dht: KadDHT, model_id: str) -> list[PeerInfo]:
    """The servers of `model_id` the DHT knows, with their addresses (gossip dials them
    when the model's ad topic has too few neighbours)."""
    return list((await find_provider_infos_fresh(dht, model_key(model_id))).values())


async def find_provider_infos_fresh(dht: KadDHT, key: str) -> dict[ID, PeerInfo]:
    """Like find_providers_fresh, with the addresses each provider record carries."""
    key_bytes = bytes.fromhex(key)
    found: dict[ID, PeerInfo] = {info.peer_id: info for info in dht.provider_store.get_providers(key_bytes)}
    closest = set(_known_peers(dht, key_bytes))  # asked even if the look-up times out (a hung peer)
    with trio.move_on_after(LOOKUP_TIMEOUT_S):
        closest.update(await dht.peer_routing.find_closest_peers_network(key_bytes))
    # py-libp2p exposes no "ask this peer" call without local caching; this private
    # helper is stable in the pinned 0.8.1.
    ask = dht.provider_store._get_providers_from_peer_with_closers

    async def query(peer: ID) -> None:
        with contextlib.suppress(Exception), trio.move_on_after(PEER_QUERY_TIMEOUT_S):
            providers, _closer = await ask(peer, key_bytes)
            for info in providers:
                if info.addrs or info.peer_id not in found:
                    found[info.peer_id] = info

    async with trio.open_nursery() as nursery:
        for peer in closest:
            if peer != dht.local_peer_id:
                nursery.start_soon(query, peer)
    return found


def _known_peers(dht: KadDHT, key_bytes: bytes) -> list[ID]:
    """The routing table's closest peers to a key, and every connected DHT peer."""
    peers = dict.fromkeys(dht.routing_table.find_local_closest_peers(key_bytes, 20))
    peers.update(dict.fromkeys(p for p in dht.host.get_connected_peers() if dht.routing_table.peer_in_table(p)))
    peers.pop(dht.local_peer_id, None)
    return list(peers)


async def get_value_fresh(dht: KadDHT, key: str, parse, *, newest, drop_cached: bool = True):
    """Fetch one signed value from the network, parsed by `parse` (which raises
    PeerMisbehaved for a bad one); None if absent or bad.

    The known peers closest to the key are asked directly, each on its own deadline;
    the parsed value with the highest `newest(value)` wins. Only if none has it, an
    iterative look-up runs.
    """
    key_bytes = key.encode()
    if drop_cached:  # a cached copy may be stale (keep it for a value we own)
        dht.value_store.remove(key_bytes)
    found: list = []

    async def ask(peer: ID) -> None:
        with contextlib.suppress(Exception), trio.move_on_after(PEER_QUERY_TIMEOUT_S):
            record = await dht.value_store._get_from_peer(peer, key_bytes, return_record=True)
            if record is not None:
                found.append(parse(record.value))

    async with trio.open_nursery() as nursery:
        for peer in _known_peers(dht, key_bytes):
            nursery.start_soon(ask, peer)
    if found:
        return max(found, key=newest)
    value = None
    with trio.move_on_after(LOOKUP_TIMEOUT_S):
        value = await dht.get_value(key)
    if value is None:
        return None
    try:
        return parse(value)
    except PeerMisbehaved as exc:
        log.info("ignoring the value of %s: %s", key, exc)
        return None


async def get_record_fresh(dht: KadDHT, model_id: str, peer_id: str) -> ServerRecord | None:
    """Fetch and validate one server record from the network; None if absent or bad."""
    key = record_key(model_id, peer_id)
    return await get_value_fresh(dht, key, lambda v: parse_record(key, v), newest=lambda r: r.seq,
                                 drop_cached=peer_id != dht.local_peer_id.to_string())


async def provide_all(dht: KadDHT, keys: Iterable[str]) -> None:
    async with trio.open_nursery() as nursery:
        for key in keys:
            nursery.start_soon(dht.provide, key)


PROVIDE_REPLICAS = 20  # k: a provide stores its record on the k peers closest to the key


def should_provide(keys, peers: frozenset, provided_keys, provided_peers: frozenset, *, due: bool) -> bool:
    """Whether to (re-)send provider records: when the keys changed, when they are due,
    or when the routing table gained peers while the last provide reached fewer than k
    of them (then every newcomer is among the k closest to every key). In a bigger
    swarm re-sending on each join would make every join cost every node a look-up per
    key; the periodic refresh reaches newcomers there, and look-ups still find the
    records on the other k - 1 closest peers meanwhile."""
    if keys != provided_keys or due:
        return True
    return bool(peers - provided_peers) and len(provided_peers) < PROVIDE_REPLICAS
