"""net/records.py: signed server records, checked against the peer id in the DHT key."""

from __future__ import annotations

import dataclasses

import msgpack
import pytest
from libp2p.crypto.ed25519 import create_new_key_pair
from libp2p.crypto.rsa import create_new_key_pair as create_rsa_key_pair
from libp2p.peer.id import ID

from compushare.errors import PeerMisbehaved
from compushare.net.records import (
    MAX_ADDRS,
    MAX_BLOCKS,
    MAX_RECORD_BYTES,
    ServerRecord,
    newest_index,
    parse_record,
    record_key,
)

MODEL = "ab" * 32
NOW = 1_700_000_000.0


def keypair(n: int):
    return create_new_key_pair(bytes([n]) * 32)


def peer_of(kp) -> str:
    return ID.from_pubkey(kp.public_key).to_base58()


ALICE, BOB = keypair(1), keypair(2)


def make(kp=ALICE, **changes) -> ServerRecord:
    fields = dict(peer_id=peer_of(kp), model_id=MODEL, start=0, end=4, dtype="float32",
                  addrs=("/ip4/127.0.0.1/tcp/4001",), expires=NOW + 60, seq=1, throughput=12.5)
    return ServerRecord(**(fields | changes))


def key_for(record: ServerRecord) -> str:
    return record_key(record.model_id, record.peer_id)


def body_of(record: ServerRecord) -> dict:
    return msgpack.unpackb(msgpack.unpackb(record.sign(ALICE))["body"])


def sign_body(kp, body: dict) -> bytes:
    raw = msgpack.packb(body, use_bin_type=True)
    return msgpack.packb({"body": raw, "sig": kp.private_key.sign(raw)}, use_bin_type=True)


def rejected(key: str, value: bytes, **kwargs) -> str:
    with pytest.raises(PeerMisbehaved) as info:
        parse_record(key, value, now=NOW, **kwargs)
    return str(info.value)


# ---------------------------------------------------------------- valid


def test_round_trip():
    record = make()
    value = record.sign(ALICE)
    assert len(value) < MAX_RECORD_BYTES
    parsed = parse_record(key_for(record), value, now=NOW)
    assert parsed == record
    assert parsed.covers(0) and parsed.covers(3) and not parsed.covers(4)


def test_key_format():
    assert record_key("m", "p") == "/csserver/m/p"


def test_wire_shape():
    envelope = msgpack.unpackb(make().sign(ALICE))
    assert set(envelope) == {"body", "sig"}
    assert len(envelope["sig"]) == 64
    body = msgpack.unpackb(envelope["body"])
    assert body["v"] == 1 and body["peer"] == peer_of(ALICE) and body["tps"] == 12.5
    assert ALICE.public_key.verify(envelope["body"], envelope["sig"])


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_every_allowed_dtype(dtype):
    record = make(dtype=dtype, start=MAX_BLOCKS - 1, end=MAX_BLOCKS, addrs=tuple(f"/a/{i}" for i in range(MAX_ADDRS)))
    assert parse_record(key_for(record), record.sign(ALICE), now=NOW) == record


def test_integer_expiry_and_throughput_are_accepted_as_floats():
    body = body_of(make()) | {"expires": int(NOW) + 10, "tps": 3}
    parsed = parse_record(key_for(make()), sign_body(ALICE, body), now=NOW)
    assert parsed.expires == int(NOW) + 10 and isinstance(parsed.expires, float)
    assert parsed.throughput == 3.0 and isinstance(parsed.throughput, float)


def test_unknown_body_fields_are_ignored():
    body = body_of(make()) | {"future": [1, 2, 3]}
    assert parse_record(key_for(make()), sign_body(ALICE, body), now=NOW) == make()


# ---------------------------------------------------------------- signature


def test_signed_by_the_wrong_key_is_rejected():
    record = make(ALICE)  # claims to be Alice's ...
    message = rejected(key_for(record), record.sign(BOB))  # ... but Bob signed it
    assert "signature" in message


def test_tampered_body_is_rejected():
    record = make()
    envelope = msgpack.unpackb(record.sign(ALICE))
    forged = msgpack.packb(body_of(record) | {"end": 30}, use_bin_type=True)
    value = msgpack.packb({"body": forged, "sig": envelope["sig"]}, use_bin_type=True)
    assert "signature" in rejected(key_for(record), value)


def test_tampered_signature_is_rejected():
    envelope = msgpack.unpackb(make().sign(ALICE))
    sig = bytearray(envelope["sig"])
    sig[10] ^= 0x01
    value = msgpack.packb({"body": envelope["body"], "sig": bytes(sig)}, use_bin_type=True)
    assert "signature" in rejected(key_for(make()), value)


@pytest.mark.parametrize("sig", [b"", b"\x00" * 63, b"\x00" * 65, b"\x00" * 64])
def test_malformed_signature_is_rejected(sig):
    envelope = msgpack.unpackb(make().sign(ALICE))
    rejected(key_for(make()), msgpack.packb({"body": envelope["body"], "sig": sig}, use_bin_type=True))


def test_valid_signature_over_a_key_of_another_peer_is_rejected():
    """Bob signs a body naming himself, but it is stored under Alice's key."""
    bobs = make(BOB)
    rejected(record_key(MODEL, peer_of(ALICE)), bobs.sign(BOB))


def test_peer_id_without_embedded_key_is_rejected():
    # RSA public keys are too long to inline: such a peer id is a sha256 hash, not the key itself.
    kp = create_rsa_key_pair(1024)
    pid = ID.from_pubkey(kp.public_key).to_base58()
    record = make(peer_id=pid)
    assert "embed" in rejected(key_for(record), record.sign(kp))


# ---------------------------------------------------------------- body vs key


def test_body_peer_disagrees_with_key():
    # Bob validly signs a body that names Alice, under Bob's own key.
    record = make(BOB, peer_id=peer_of(ALICE))
    message = rejected(record_key(MODEL, peer_of(BOB)), record.sign(BOB))
    assert "disagrees" in message


def test_body_model_disagrees_with_key():
    record = make()
    message = rejected(record_key("cd" * 32, record.peer_id), record.sign(ALICE))
    assert "disagrees" in message


@pytest.mark.parametrize(
    "key",
    [
        "",
        "csserver/m/p",
        f"/csserver/{MODEL}",
        f"/csserver/{MODEL}/{peer_of(ALICE)}/extra",
        f"/pk/{MODEL}/{peer_of(ALICE)}",
        f"/csserver/{MODEL}/not-base58-0OIl",
        f"/csserver/{MODEL}/",
    ],
)
def test_bad_keys(key):
    rejected(key, make().sign(ALICE))


# ---------------------------------------------------------------- expiry


def test_expired_rejected_and_accepted_with_allow_expired():
    record = make(expires=NOW - 1)
    value = record.sign(ALICE)
    assert "expired" in rejected(key_for(record), value)
    assert parse_record(key_for(record), value, now=NOW, allow_expired=True) == record


def test_expiry_boundary():
    record = make(expires=NOW)
    value = record.sign(ALICE)
    rejected(key_for(record), value)  # expires is the first instant it is dead
    assert parse_record(key_for(record), value, now=NOW - 0.001) == record
    assert record.is_live(NOW - 0.001) and not record.is_live(NOW)


def test_expiry_defaults_to_wall_clock():
    import time

    live = make(expires=time.time() + 60)
    dead = make(expires=time.time() - 60)
    assert parse_record(key_for(live), live.sign(ALICE)) == live
    with pytest.raises(PeerMisbehaved):
        parse_record(key_for(dead), dead.sign(ALICE))


# ---------------------------------------------------------------- size and schema


def test_oversized_rejected():
    base = body_of(make())

    def padded(n: int) -> bytes:
        return sign_body(ALICE, base | {"pad": b"x" * n})

    overhead = len(padded(1000)) - 1000
    at_limit = padded(MAX_RECORD_BYTES - overhead)
    assert len(at_limit) == MAX_RECORD_BYTES
    assert parse_record(key_for(make()), at_limit, now=NOW) == make()  # exactly the limit: fine
    over = padded(MAX_RECORD_BYTES - overhead + 1)
    assert len(over) == MAX_RECORD_BYTES + 1
    assert "exceeds" in rejected(key_for(make()), over)


def test_size_limit_is_checked_before_parsing():
    assert "exceeds" in rejected(key_for(make()), b"\xc1" * (MAX_RECORD_BYTES + 1))


@pytest.mark.parametrize(
    "changes",
    [
        {"v": 2},
        {"v": None},
        {"start": "0"},
        {"start": 1.0},
        {"start": True},
        {"end": False},
        {"start": -1},
        {"start": 4, "end": 4},
        {"start": 5, "end": 4},
        {"end": MAX_BLOCKS + 1},
        {"dtype": "int8"},
        {"dtype": 1},
        {"addrs": "/ip4/1.2.3.4/tcp/1"},
        {"addrs": [f"/a/{i}" for i in range(MAX_ADDRS + 1)]},
        {"addrs": ["/a/" + "x" * 300]},
        {"addrs": [5]},
        {"expires": "soon"},
        {"expires": True},
        {"seq": 1.5},
        {"seq": None},
        {"tps": "fast"},
        {"peer": 5},
        {"model": None},
    ],
)
def test_schema_violations_rejected(changes):
    body = body_of(make()) | changes
    rejected(key_for(make()), sign_body(ALICE, body))


@pytest.mark.parametrize("field", ["v", "peer", "model", "start", "end", "dtype", "addrs", "expires", "seq", "tps"])
def test_missing_field_rejected(field):
    body = body_of(make())
    del body[field]
    rejected(key_for(make()), sign_body(ALICE, body))


@pytest.mark.parametrize(
    "value",
    [
        b"",
        b"\x00",
        msgpack.packb([1, 2]),
        msgpack.packb({"body": "text", "sig": b"x" * 64}),
        msgpack.packb({"body": b"x", "sig": "text"}),
        msgpack.packb({"sig": b"x" * 64}),
        msgpack.packb({1: b"x"}),
    ],
)
def test_malformed_envelope_rejected(value):
    rejected(key_for(make()), value)


def test_signed_non_map_body_rejected():
    raw = msgpack.packb([1, 2, 3])
    value = msgpack.packb({"body": raw, "sig": ALICE.private_key.sign(raw)}, use_bin_type=True)
    rejected(key_for(make()), value)


def test_signed_garbage_body_rejected():
    raw = b"\xc1\xc1"
    value = msgpack.packb({"body": raw, "sig": ALICE.private_key.sign(raw)}, use_bin_type=True)
    rejected(key_for(make()), value)


# ---------------------------------------------------------------- select


def test_newest_index_picks_highest_seq():
    key = key_for(make())
    values = [make(seq=s).sign(ALICE) for s in (3, 7, 5)]
    assert newest_index(key, values) == 1
    assert newest_index(key, values[::-1]) == 1
    assert newest_index(key, [values[0]]) == 0


def test_newest_index_considers_expired_records():
    key = key_for(make())
    values = [make(seq=2).sign(ALICE), make(seq=9, expires=1.0).sign(ALICE)]
    assert newest_index(key, values) == 1


def test_newest_index_skips_invalid_values():
    key = key_for(make())
    good = make(seq=5).sign(ALICE)
    forged_by_bob = make(seq=100).sign(BOB)
    tampered = msgpack.packb(
        {"body": msgpack.packb(body_of(make(seq=200)), use_bin_type=True),
         "sig": msgpack.unpackb(make(seq=1).sign(ALICE))["sig"]},
        use_bin_type=True,
    )
    wrong_model = make(seq=300, model_id="cd" * 32).sign(ALICE)
    bad_schema = sign_body(ALICE, body_of(make(seq=400)) | {"dtype": "int8"})
    values = [b"garbage", forged_by_bob, tampered, good, wrong_model, bad_schema, b""]
    assert newest_index(key, values) == 3


def test_newest_index_first_valid_beats_leading_garbage():
    key = key_for(make())
    assert newest_index(key, [b"junk", make(seq=0).sign(ALICE)]) == 1


def test_newest_index_tie_keeps_the_first():
    key = key_for(make())
    values = [make(seq=4, throughput=1.0).sign(ALICE), make(seq=4, throughput=2.0).sign(ALICE)]
    assert newest_index(key, values) == 0


def test_newest_index_all_invalid_is_zero():
    assert newest_index(key_for(make()), [b"a", b"b"]) == 0


def test_newest_index_with_negative_seq_still_prefers_a_valid_record():
    key = key_for(make())
    assert newest_index(key, [b"junk", make(seq=-1).sign(ALICE)]) == 1


def test_records_are_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        make().seq = 2  # type: ignore[misc]


@pytest.mark.parametrize("tps", [float("nan"), float("inf"), -1.0])
def test_non_finite_or_negative_throughput_rejected(tps):
    record = make(throughput=tps)
    rejected(key_for(record), record.sign(ALICE))
