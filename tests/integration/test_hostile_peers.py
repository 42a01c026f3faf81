"""The hostile-peer harness: every protocol a node speaks (as it announces them over
identify, and multistream negotiation itself) is attacked from one libp2p host with
garbage, truncated frames, huge length prefixes, well-formed messages of the wrong
shape and stalled streams, while a second identity floods every protocol with
stalled streams and an honest generation runs through the same nodes. The nodes
stay up, end every hostile stream themselves, the generation matches transformers,
and a second one after the attacks does too.

Found by it (and kept as regressions): one gossip message with a peer id that embeds
no key and a `key` field that is not one killed the node (py-libp2p's push_msg
raised in a pubsub service task); 12 stalled DHT streams from one peer took the
node's DHT from everyone (py-libp2p serves 12 inbound DHT streams node-wide and
never times one out)."""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import os

import msgpack
import pytest
import trio
from libp2p.crypto.ed25519 import create_new_key_pair
from libp2p.host.autonat.autonat import AUTONAT_PROTOCOL_ID as AUTONAT_PROTOCOL
from libp2p.host.ping import ID as PING_PROTOCOL
from libp2p.identity.identify.identify import ID as IDENTIFY_PROTOCOL
from libp2p.identity.identify.pb.identify_pb2 import Identify
from libp2p.identity.identify_push.identify_push import ID_PUSH as IDENTIFY_PUSH_PROTOCOL
from libp2p.kad_dht.common import PROTOCOL_ID as KAD_PROTOCOL
from libp2p.kad_dht.pb.kademlia_pb2 import Message as KadMessage
from libp2p.peer.id import ID
from libp2p.pubsub.gossipsub import PROTOCOL_ID_V11 as GOSSIP_PROTOCOL
from libp2p.pubsub.pb import rpc_pb2
from libp2p.pubsub.validators import PUBSUB_SIGNING_PREFIX
from libp2p.relay.circuit_v2.dcutr import PROTOCOL_ID as DCUTR_PROTOCOL
from libp2p.relay.circuit_v2.protocol import PROTOCOL_ID as HOP_PROTOCOL
from libp2p.relay.circuit_v2.protocol import STOP_PROTOCOL_ID as STOP_PROTOCOL
from libp2p.utils.varint import encode_uvarint

from compushare.errors import FrameError
from compushare.karma.service import KARMA_PROTOCOL
from compushare.model.catalog import import_path
from compushare.net.ad_intake import ad_topic
from compushare.net.codec import LENGTH, FrameDecoder
from compushare.net.gossip import VIEW_PROTOCOL
from compushare.net.host import open_host, parse_peer_addr
from compushare.pipeline.client.consumer import RunRequest, run_prompt
from compushare.pipeline.private_wire import PRIVATE_PROTOCOL
from compushare.pipeline.protocol import INFER_PROTOCOL
from compushare.wire import PRIVATE_V2_0
from compushare.wire import TRAIN as TRAIN_PROTOCOL
from compushare.pipeline.client.sampling import SamplingParams
from compushare.torrent.protocol import PIECES_PROTOCOL
from helpers import reference_greedy

PROMPT = [1, 17, 42, 99, 3]
NEW_TOKENS = 16
MULTISTREAM = "/multistream/1.0.0"  # negotiation itself, before any protocol is chosen
OPEN_TIMEOUT_S = 10.0  # opening one attack stream
ATTACK_TIMEOUT_S = 15.0  # one attack, from its first byte to the node's answer (or our giving up)
HOLD_LIMIT_S = 240.0  # stalled streams are held at most this long (until the generation is done)
GENERATION_TIMEOUT_S = 120.0
FLOOD_STREAMS = 16  # stalled streams per protocol at once (more than py-libp2p's 12 DHT handlers)

FRAMED = (INFER_PROTOCOL, PIECES_PROTOCOL, VIEW_PROTOCOL, KARMA_PROTOCOL, PRIVATE_PROTOCOL, PRIVATE_V2_0,
          TRAIN_PROTOCOL)
# NAT traversal (revision 14): AutoNAT, circuit relay v2's hop and stop, DCUtR.
VARINT = (KAD_PROTOCOL, GOSSIP_PROTOCOL, IDENTIFY_PUSH_PROTOCOL, AUTONAT_PROTOCOL, HOP_PROTOCOL, STOP_PROTOCOL,
          DCUTR_PROTOCOL)
EVERY_PROTOCOL = {*FRAMED, *VARINT, PING_PROTOCOL, IDENTIFY_PROTOCOL}


@dataclasses.dataclass(frozen=True)
class Attack:
    name: str
    protocol: str  # MULTISTREAM: a raw stream, garbage in place of the negotiation
    payload: bytes
    stall: bool = False  # then hold the stream open, idle, until the honest generation is done


def framed(*messages) -> bytes:
    """Frames of msgpack values, whatever their shape (encode_frame wants a dict)."""
    out = b""
    for message in messages:
        payload = message if isinstance(message, bytes) else msgpack.packb(message, use_bin_type=True)
        out += LENGTH.pack(len(payload)) + payload
    return out


def varint_framed(*payloads: bytes) -> bytes:
    return b"".join(encode_uvarint(len(p)) + p for p in payloads)


def deep_msgpack(depth: int) -> bytes:
    """A map whose "session" is `depth` nested one-element arrays."""
    return b"\x82\xa4type\xa5close\xa7session" + b"\x91" * depth + b"\xc0"


def signed_pubsub_message(key_pair, data: bytes, topic: str) -> rpc_pb2.Message:
    """A pubsub message correctly signed by the attacker itself: it passes the
    signature check and reaches the node's topic validator."""
    msg = rpc_pb2.Message(from_id=ID.from_pubkey(key_pair.public_key).to_bytes(), data=data,
                          seqno=os.urandom(8), topicIDs=[topic])
    msg.signature = key_pair.private_key.sign(PUBSUB_SIGNING_PREFIX.encode() + msg.SerializeToString())
    return msg


def stall_payload(protocol: str) -> bytes:
    """Half a message in the protocol's own framing."""
    if protocol in FRAMED:
        return LENGTH.pack(100) + b"\x81\xa4ty"
    if protocol in VARINT:
        return encode_uvarint(100) + b"\x08\x01"
    if protocol == PING_PROTOCOL:
        return os.urandom(16)  # of 32
    if protocol == MULTISTREAM:
        return varint_framed(b"/multistream/1.0.0\n") + b"\x20/comp"
    return b""  # identify: the node talks, we say nothing


def generic_attacks(protocol: str) -> list[Attack]:
    """Garbage, truncated, huge and stalled frames in the protocol's own framing."""
    p = protocol
    attacks = [Attack(f"{p} random bytes", p, os.urandom(4096)),
               Attack(f"{p} stalled half message", p, stall_payload(p), stall=True)]
    if p in FRAMED:
        attacks += [
            Attack(f"{p} not msgpack", p, framed(b"\xc1" * 64)),
            Attack(f"{p} truncated frame", p, LENGTH.pack(1000) + b"\x81\xa4type" + b"\x00" * 10),
            Attack(f"{p} 4 GiB length prefix", p, LENGTH.pack(0xFFFFFFFF) + b"x" * 1024),
        ]
    elif p in VARINT:
        attacks += [
            Attack(f"{p} truncated message", p, encode_uvarint(1000) + b"\x08\x01" * 5),
            Attack(f"{p} huge varint length", p, encode_uvarint(2**63 - 1) + b"x" * 1024),
            Attack(f"{p} overlong varint", p, b"\xff" * 12 + b"x" * 64),
        ]
    elif p == PING_PROTOCOL:  # 32-byte pings, echoed
        attacks += [
            Attack(f"{p} truncated ping", p, os.urandom(20)),
            Attack(f"{p} 33 bytes", p, os.urandom(33)),
            Attack(f"{p} 64 KiB at once", p, os.urandom(1 << 16)),
        ]
    elif p == IDENTIFY_PROTOCOL:  # the node speaks, we should only listen
        attacks += [Attack(f"{p} talking back", p, varint_framed(os.urandom(300)))]
    return attacks


def flood_attacks(protocol: str, streams: int = FLOOD_STREAMS) -> list[Attack]:
    """Many stalled streams at once: a peer may take its own share of a node's
    streams, never everyone's (py-libp2p's DHT served 12 inbound streams node-wide)."""
    return [Attack(f"{protocol} flood {i}", protocol, stall_payload(protocol), stall=True) for i in range(streams)]


def shaped_attacks(model_id: str, key_pair) -> list[Attack]:
    """Well-formed encodings (msgpack, protobuf) with contents of the wrong shape."""
    hello = {"type": "hello", "model": model_id}
    train_session = os.urandom(16)
    bogus_id = b"\x12\x20" + os.urandom(32)  # a sha256 peer id: no key embedded in it
    topic = ad_topic(model_id)
    unsigned = rpc_pb2.Message(from_id=bogus_id, data=b"\xc1", seqno=b"1", topicIDs=[topic],
                               signature=b"x" * 64, key=b"not a key")
    no_key = rpc_pb2.Message(from_id=bogus_id, data=b"\xc1", seqno=b"2", topicIDs=[topic],
                             signature=b"x" * 64)
    control = rpc_pb2.ControlMessage(
        ihave=[rpc_pb2.ControlIHave(topicID=topic, messageIDs=[os.urandom(20) for _ in range(2000)])],
        iwant=[rpc_pb2.ControlIWant(messageIDs=[os.urandom(20) for _ in range(2000)])],
        graft=[rpc_pb2.ControlGraft(topicID=topic), rpc_pb2.ControlGraft(topicID="no such topic")],
        prune=[rpc_pb2.ControlPrune(topicID=topic, backoff=2**63,
                                    peers=[rpc_pb2.PeerInfo(peerID=b"junk", signedPeerRecord=b"junk")])],
    )
    kad_record = KadMessage(type=KadMessage.MessageType.PUT_VALUE, key=b"/csserver/x/y")
    kad_record.record.key, kad_record.record.value = b"/csserver/x/y", b"\xc1 not a record"
    foreign = KadMessage(type=KadMessage.MessageType.PUT_VALUE, key=b"/evil/key")
    foreign.record.key, foreign.record.value = b"/evil/key", b"value"
    providers = KadMessage(type=KadMessage.MessageType.ADD_PROVIDER, key=hashlib.sha256(b"x").digest())
    providers.providerPeers.add(id=b"junk", addrs=[b"\xff\xfe\xfd"])
    return [
        Attack(f"{INFER_PROTOCOL} wrong shapes", INFER_PROTOCOL, framed(
            [1, 2, 3], {"type": 7}, {1: "int key", "type": "open"},
            {"type": "open", "session": os.urandom(16), "model": {"a": 1}, "start": "0", "end": [],
             "max_tokens": 2**64 - 1},
            {"type": "step", "session": os.urandom(16), "position": -1, "hidden": "no"},
            {"type": "step", "session": os.urandom(16), "position": 0, "chunks": [0],
             "hidden": {"dtype": "float32", "shape": [1, 2**40, 64], "data": b""}},
            {"type": "truncate", "session": b"short", "position": 2**63},
            deep_msgpack(100_000),
        )),
        Attack(f"{PRIVATE_PROTOCOL} wrong shapes", PRIVATE_PROTOCOL, framed(
            {"type": "project", "layer": 0, "group": "qkv", "cts": [b"x"]},  # before any open
            {"type": "open", "model_id": {"a": 1}, "start": "0", "end": [], "params": 5})),
        Attack(f"{PRIVATE_PROTOCOL} keys bigger than announced", PRIVATE_PROTOCOL, framed(
            {"type": "open", "model_id": model_id, "start": 0, "end": 1, "params": "ckks-8192-60-40-60",
             "keys_digest": "ab" * 32, "keys_size": 10},
            {"type": "keys", "data": os.urandom(4096)})),
        Attack(f"{PRIVATE_PROTOCOL} junk keys and ciphertexts", PRIVATE_PROTOCOL, framed(
            {"type": "open", "model_id": model_id, "start": 0, "end": 1, "params": "ckks-8192-60-40-60",
             "keys_digest": hashlib.sha256(b"\x5e\xa1" * 512).hexdigest(), "keys_size": 1024},
            {"type": "keys", "data": b"\x5e\xa1" * 512},
            {"type": "project", "layer": 0, "group": "qkv", "cts": [os.urandom(1000)] * 16})),
        Attack(f"{PRIVATE_PROTOCOL} 2^40 bytes of keys announced", PRIVATE_PROTOCOL, framed(
            {"type": "open", "model_id": model_id, "start": 0, "end": 1, "params": "ckks-8192-60-40-60",
             "keys_digest": "ab" * 32, "keys_size": 1 << 40})),
        Attack(f"{TRAIN_PROTOCOL} wrong shapes", TRAIN_PROTOCOL, framed(
            {"type": "forward", "id": 1, "session": os.urandom(16), "hidden": "no"},  # before any open
            {"type": "open", "id": -1, "session": b"short", "model": {"a": 1}, "start": "0", "end": []},
            {"type": "open", "id": 2, "session": train_session, "model": model_id, "start": 0, "end": 1},
            {"type": "backward", "id": 3, "session": train_session,
             "hidden": {"dtype": "float32", "shape": [64, 2**20, 64], "data": b""},
             "grad": {"dtype": "float32", "shape": [1, 1, 64], "data": bytes(256)}},
            {"type": "forward", "id": 4, "session": train_session,
             "hidden": {"dtype": "float32", "shape": [1, 1, 64], "data": bytes(256)},
             "adapter": {"digest": os.urandom(32), "spec": {"rank": 2**40, "alpha": -1, "targets": ["x"],
                                                           "rslora": 0}, "tensors": {"evil": [1]}}},
            {"type": "forward", "id": 5, "session": train_session,
             "hidden": {"dtype": "float32", "shape": [1, 1, 64], "data": bytes(256)},
             "adapter": {"digest": os.urandom(32), "spec": {"rank": 2, "alpha": 4.0, "targets": ["q_proj"],
                                                           "rslora": False}}},  # unknown digest
            deep_msgpack(100_000),
        )),
        Attack(f"{PIECES_PROTOCOL} request before hello", PIECES_PROTOCOL, framed({"type": "request", "index": 0})),
        Attack(f"{PIECES_PROTOCOL} hello of the wrong shape", PIECES_PROTOCOL,
               framed({"type": "hello", "model": 5, "x": [1]})),
        Attack(f"{PIECES_PROTOCOL} wrong shapes after hello", PIECES_PROTOCOL, framed(
            hello, {"type": "request", "index": "0"}, {"type": "request", "index": 2**63},
            {"type": "cancel"}, {"type": "manifest", "x": 1}, hello)),
        Attack(f"{VIEW_PROTOCOL} wrong shapes", VIEW_PROTOCOL, framed({"type": ["view"]}, [1, 2])),
        Attack(f"{VIEW_PROTOCOL} deep msgpack", VIEW_PROTOCOL, framed(deep_msgpack(4000))),
        Attack(f"{KAD_PROTOCOL} bad records and keys", KAD_PROTOCOL, varint_framed(
            KadMessage(type=KadMessage.MessageType.GET_PROVIDERS, key=b"").SerializeToString(),
        )),
        Attack(f"{KAD_PROTOCOL} garbage server record", KAD_PROTOCOL, varint_framed(kad_record.SerializeToString())),
        Attack(f"{KAD_PROTOCOL} foreign namespace", KAD_PROTOCOL, varint_framed(foreign.SerializeToString())),
        Attack(f"{KAD_PROTOCOL} junk provider", KAD_PROTOCOL, varint_framed(providers.SerializeToString())),
        Attack(f"{KAD_PROTOCOL} huge FIND_NODE key", KAD_PROTOCOL, varint_framed(
            KadMessage(type=KadMessage.MessageType.FIND_NODE, key=os.urandom(1 << 20)).SerializeToString())),
        Attack(f"{KAD_PROTOCOL} a pubsub RPC", KAD_PROTOCOL, varint_framed(
            rpc_pb2.RPC(subscriptions=[rpc_pb2.RPC.SubOpts(subscribe=True, topicid="x")]).SerializeToString())),
        Attack(f"{GOSSIP_PROTOCOL} subscribe and publish junk", GOSSIP_PROTOCOL, varint_framed(
            rpc_pb2.RPC(subscriptions=[rpc_pb2.RPC.SubOpts(subscribe=True, topicid=topic)]).SerializeToString(),
            rpc_pb2.RPC(publish=[unsigned]).SerializeToString(),
            rpc_pb2.RPC(publish=[no_key]).SerializeToString(),
            rpc_pb2.RPC(publish=[signed_pubsub_message(key_pair, b"\xc1 not an ad", topic),
                                 signed_pubsub_message(key_pair, msgpack.packb({"body": b"x", "sig": b"y"}), topic)]
                        ).SerializeToString(),
        )),
        Attack(f"{GOSSIP_PROTOCOL} control flood", GOSSIP_PROTOCOL,
               varint_framed(rpc_pb2.RPC(control=control).SerializeToString())),
        Attack(f"{GOSSIP_PROTOCOL} many topics", GOSSIP_PROTOCOL, varint_framed(rpc_pb2.RPC(subscriptions=[
            rpc_pb2.RPC.SubOpts(subscribe=True, topicid=f"t{i}") for i in range(5000)]).SerializeToString())),
        Attack(f"{GOSSIP_PROTOCOL} a DHT message", GOSSIP_PROTOCOL, varint_framed(
            KadMessage(type=KadMessage.MessageType.PING).SerializeToString() + b"\xff")),
        Attack(f"{IDENTIFY_PUSH_PROTOCOL} junk identify", IDENTIFY_PUSH_PROTOCOL, varint_framed(Identify(
            public_key=b"junk", listen_addrs=[b"\xff\xfe", os.urandom(40)], observed_addr=b"\x00",
            protocols=["x" * 1000] * 50, signedPeerRecord=b"junk").SerializeToString())),
        Attack("multistream random bytes", MULTISTREAM, os.urandom(2048)),
        Attack("multistream huge line", MULTISTREAM, encode_uvarint(2**40) + b"/" * 1024),
        Attack("multistream 64 KiB protocol name", MULTISTREAM,
               varint_framed(b"/multistream/1.0.0\n", b"/" + b"x" * 65536 + b"\n")),
        Attack("multistream stalled", MULTISTREAM, stall_payload(MULTISTREAM), stall=True),
    ]


async def open_attack_stream(host, peer: ID, protocol: str):
    if protocol != MULTISTREAM:
        return await host.new_stream(peer, [protocol])
    # A raw muxed stream: whatever we write is what the node's negotiation reads.
    conn = host.get_network().get_connections(peer)[0]
    return await conn.new_stream()


async def run_attack(host, peer: ID, attack: Attack, outcomes: dict, release: trio.Event,
                     held: list | None = None) -> None:
    """Run one attack and record what the node did; the node resetting the stream, or
    anything else failing on our side, is an outcome too."""
    replies = bytearray()
    began = trio.current_time()
    try:
        with trio.fail_after(OPEN_TIMEOUT_S):
            stream = await open_attack_stream(host, peer, attack.protocol)
    except Exception as exc:  # the node refused the stream: fine
        outcomes[attack.name] = f"refused ({type(exc).__name__})"
        return

    async def read_to_end() -> str:
        try:
            while data := await stream.read(1 << 16):
                replies.extend(data)
            return f"closed by the node after {trio.current_time() - began:.1f} s"
        except Exception as exc:
            return f"{type(exc).__name__} after {trio.current_time() - began:.1f} s"

    outcome = "timed out (ours)"
    try:
        with trio.move_on_after(HOLD_LIMIT_S if attack.stall else ATTACK_TIMEOUT_S):
            await stream.write(attack.payload)
            if attack.stall:  # say no more; read whatever comes until the node ends it or we do
                outcome = "held until released"
                if held is not None:
                    held.append(attack.name)
                async with trio.open_nursery() as nursery:
                    async def watch() -> None:
                        nonlocal outcome
                        outcome = await read_to_end()
                        nursery.cancel_scope.cancel()
                    nursery.start_soon(watch)
                    await release.wait()
                    nursery.cancel_scope.cancel()
            else:
                await stream.close_write()  # a truncated frame ends here
                outcome = await read_to_end()
    except Exception as exc:  # e.g. the write failed: the node reset the stream already
        outcome = f"{type(exc).__name__} while writing"
    finally:
        with contextlib.suppress(Exception), trio.move_on_after(2):
            await stream.reset()
    outcomes[attack.name] = f"{outcome}; {_describe(attack.protocol, bytes(replies))}"


def _describe(protocol: str, replies: bytes) -> str:
    if protocol not in FRAMED or not replies:
        return f"{len(replies)} bytes back"
    decoder, codes = FrameDecoder(1 << 26), []
    decoder.feed(replies)
    with contextlib.suppress(FrameError):
        while (message := decoder.next_message()) is not None:
            codes.append(message.get("code", message["type"]))
    return f"replies {codes}"


async def honest_generation(client_dir, bootstrap) -> list[int]:
    with trio.fail_after(GENERATION_TIMEOUT_S):
        outcome = await run_prompt(client_dir, tuple(bootstrap), RunRequest(
            model="tiny", prompt=PROMPT, params=SamplingParams(max_new_tokens=NEW_TOKENS, stop_at_eos=False)))
    return outcome.tokens


@pytest.fixture
def swarm(processes, tiny_model):
    procs, states = {}, {}
    procs["a"], states["a"] = processes.node("a", tiny_model, "0:2")
    procs["b"], states["b"] = processes.node("b", tiny_model, "2:4", bootstrap=states["a"]["addrs"][:1])
    return procs, states


def node_logs(processes, names) -> str:
    return "\n".join(f"--- {name}\n" + (processes.root / name / "node.log").read_text(errors="replace")[-3000:]
                     for name in names)


async def attack_node(host, peer: ID, attacks: list[Attack], outcomes: dict, release: trio.Event,
                      held: list) -> None:
    """Every protocol at once; within one protocol the stalled streams are held while
    the other attacks run one after another (some protocols allow a peer 2 streams)."""
    by_protocol: dict[str, list[Attack]] = {}
    for attack in attacks:
        by_protocol.setdefault(attack.protocol, []).append(attack)

    async def one_protocol(protocol_attacks: list[Attack]) -> None:
        async with trio.open_nursery() as nursery:
            for attack in protocol_attacks:
                if attack.stall:
                    nursery.start_soon(run_attack, host, peer, attack, outcomes, release, held)
            await trio.sleep(0.2)
            for attack in protocol_attacks:
                if not attack.stall:
                    await run_attack(host, peer, attack, outcomes, release)

    async with trio.open_nursery() as nursery:
        for protocol_attacks in by_protocol.values():
            nursery.start_soon(one_protocol, protocol_attacks)


async def test_hostile_peers_on_every_protocol_while_an_honest_generation_runs(swarm, processes, tiny_model,
                                                                                tmp_path):
    procs, states = swarm
    bootstrap = states["a"]["addrs"][:1]
    client_dir = tmp_path / "client"
    import_path(tiny_model, client_dir, alias="tiny")
    expected = reference_greedy(tiny_model, PROMPT, NEW_TOKENS)
    key_pair = create_new_key_pair()
    # The attacker, and a second identity that floods every protocol with stalled
    # streams (per-peer stream caps would otherwise turn the attacker's own attacks away).
    async with open_host(key_pair, ["/ip4/127.0.0.1/tcp/0"]) as host, \
            open_host(create_new_key_pair(), ["/ip4/127.0.0.1/tcp/0"]) as flooder:
        peers = {}
        for name, state in states.items():
            info = parse_peer_addr(state["addrs"][0])
            with trio.fail_after(10):
                await host.connect(info)
                await flooder.connect(info)
            peers[name] = info.peer_id

        # The node's protocols, as it announces them over identify: each one is attacked.
        with trio.move_on_after(10):
            while not EVERY_PROTOCOL <= set(host.get_peerstore().get_protocols(peers["a"]) or ()):
                await trio.sleep(0.1)
        announced = set(host.get_peerstore().get_protocols(peers["a"]) or ())
        assert announced == EVERY_PROTOCOL, f"not attacked: {announced - EVERY_PROTOCOL}"

        attacks = [a for p in sorted(EVERY_PROTOCOL) for a in generic_attacks(p)]
        attacks += shaped_attacks(states["a"]["model_id"], key_pair)
        floods = [a for p in sorted(EVERY_PROTOCOL | {MULTISTREAM}) for a in flood_attacks(p)]
        stalls = sum(a.stall for a in attacks + floods) * len(peers)
        outcomes = {name: {} for name in peers}
        flood_outcomes = {name: {} for name in peers}
        release, held = trio.Event(), []

        tokens = failure = None
        async with trio.open_nursery() as nursery:
            for name, peer in peers.items():
                nursery.start_soon(attack_node, host, peer, attacks, outcomes[name], release, held)
                nursery.start_soon(attack_node, flooder, peer, floods, flood_outcomes[name], release, held)
            try:
                with trio.move_on_after(30):  # every stalled stream open (or refused) before we start
                    while len(held) + sum(o.startswith("refused") for d in (*outcomes.values(),
                                          *flood_outcomes.values()) for o in d.values()) < stalls:
                        await trio.sleep(0.1)
                tokens = await honest_generation(client_dir, bootstrap)
            except Exception as exc:  # reported below, after the state of the nodes
                failure = exc
            finally:
                release.set()

    for name in peers:
        print(f"node {name}:")
        for attack, outcome in (outcomes[name] | flood_outcomes[name]).items():
            print(f"  {attack}: {outcome}")
    dead = [name for name, proc in procs.items() if proc.poll() is not None]
    assert not dead, f"nodes {dead} died:\n{node_logs(processes, dead)}"
    assert failure is None, f"the honest generation failed under attack: {failure!r}"
    assert tokens == expected
    for name in peers:  # every attack ran to an outcome, and the node ended every hostile stream itself
        assert len(outcomes[name]) == len(attacks) and len(flood_outcomes[name]) == len(floods)
        lingering = [a.name for a in attacks if not a.stall and outcomes[name][a.name].startswith("timed out")]
        assert not lingering, f"node {name} left these streams open: {lingering}"

    # Still serving once the attackers are gone.
    assert await honest_generation(client_dir, bootstrap) == expected
    assert all(proc.poll() is None for proc in procs.values()), node_logs(processes, procs)
