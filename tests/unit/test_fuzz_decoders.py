"""Property tests for every decoder that takes a peer's bytes: whatever arrives, each
raises only its module's documented error (FrameError, PeerMisbehaved, ValueError for
Hardware) or returns a valid object.

What test_codec, test_manifest and test_ads cover already (FrameDecoder and
decode_payload on short garbage, decode_tensor on arbitrary objects, byte-level
manifest mutations, arbitrary ad bytes and flat signed bodies, flat torrent
messages) is not repeated; this file adds the buffering bound, structure-aware
mutations of valid manifests, ads, records and failure reports, and the decoders
that had no property test at all.
"""

from __future__ import annotations

import copy
import hashlib
import itertools
import json
import math

import msgpack
import numpy as np
import pytest
import torch
import trio
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from libp2p.crypto.ed25519 import create_new_key_pair
from libp2p.network.stream.exceptions import StreamEOF
from libp2p.peer.id import ID

from compushare.errors import FrameError, PeerMisbehaved
from compushare.hardware import Hardware
from compushare.karma.receipts import Receipt, countersign, parse_receipt, sign_receipt
from compushare.karma.record import check_evidence, karma_key, make_record, parse_karma_record
from compushare.model.layout import lay_out
from compushare.net.ads import Serving, make_ad, parse_ad
from compushare.net.codec import LENGTH, FrameDecoder, encode_frame
from compushare.net.framing import FramedStream
from compushare.net.records import ServerRecord, parse_record, record_key
from compushare.net.signed import open_sealed, signer_of
from compushare.net.tensors import WIRE_DTYPES, decode_tensor
from compushare.proofs.inference import GENESIS, FailureReport
from helpers import signed_claim
from compushare.model.manifest import parse
from compushare.torrent.protocol import decode_bitfield, parse_reply, parse_request

NOW = 1_700_000_000.0
MODEL = "ab" * 32
H = 8


def keypair(n: int):
    return create_new_key_pair(bytes([n]) * 32)


def peer_of(kp) -> str:
    return ID.from_pubkey(kp.public_key).to_base58()


ALICE, BOB = keypair(1), keypair(2)

# ---------------------------------------------------------------- strategies

# Every kind of value msgpack (and, without bytes, JSON) can carry, edge cases included.
INTS = st.one_of(st.integers(-3, 300), st.integers(-(2**63), 2**64 - 1))
scalars = st.one_of(st.none(), st.booleans(), INTS, st.floats(), st.text(max_size=12), st.binary(max_size=24))
msgpack_values = st.recursive(
    scalars,
    lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=8), inner, max_size=4)),
    max_leaves=10,
)
json_values = st.recursive(
    st.one_of(st.none(), st.booleans(), INTS, st.floats(), st.text(max_size=12)),
    lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=8), inner, max_size=4)),
    max_leaves=10,
)


def _paths(tree, prefix=()):
    """Every position in a tree of dicts and lists, the root included."""
    yield prefix
    if isinstance(tree, dict):
        for key, value in tree.items():
            yield from _paths(value, (*prefix, key))
    elif isinstance(tree, list):
        for index, value in enumerate(tree):
            yield from _paths(value, (*prefix, index))


def mutate(data, tree, values, rounds: int = 3):
    """Replace, delete or add values anywhere in a copy of `tree` (drawn from `data`)."""
    tree = copy.deepcopy(tree)
    for _ in range(data.draw(st.integers(1, rounds))):
        path = data.draw(st.sampled_from(list(_paths(tree))))
        if not path:
            tree = data.draw(values)
            continue
        parent = tree
        for step in path[:-1]:
            parent = parent[step]
        op = data.draw(st.sampled_from(["replace", "delete", "add"]))
        if op == "replace":
            parent[path[-1]] = data.draw(values)
        elif op == "delete":
            del parent[path[-1]]
        elif isinstance(parent, dict):
            parent[data.draw(st.text(max_size=8))] = data.draw(values)
        else:
            parent.insert(path[-1], data.draw(values))
    return tree


def seal(kp, body) -> bytes:
    raw = msgpack.packb(body, use_bin_type=True)
    return msgpack.packb({"body": raw, "sig": kp.private_key.sign(raw)}, use_bin_type=True)


def body_of(value: bytes):
    return msgpack.unpackb(msgpack.unpackb(value)["body"])


def chunks(data: bytes, cuts: list[int]) -> list[bytes]:
    points = sorted({c % (len(data) + 1) for c in cuts} | {0, len(data)})
    return [data[a:b] for a, b in itertools.pairwise(points)]


# ---------------------------------------------------------------- net/codec.py: frames

frame_streams = st.lists(
    st.one_of(
        st.binary(max_size=64),  # garbage
        st.builds(lambda m: encode_frame(m), st.fixed_dictionaries({"type": st.text(max_size=8)},
                                                                      optional={"x": msgpack_values})),
        st.builds(lambda v: LENGTH.pack(len(v)) + v,  # well framed, any msgpack (or none) inside
                  st.one_of(msgpack_values.map(lambda v: msgpack.packb(v, use_bin_type=True)), st.binary(max_size=40))),
        st.integers(0, 2**32 - 1).map(LENGTH.pack),  # a bare length prefix, often far over the limit
    ),
    max_size=8,
).map(b"".join)


@settings(max_examples=200)
@given(frame_streams, st.lists(st.integers(min_value=0), max_size=12), st.integers(0, 300))
def test_frame_decoder_never_buffers_a_frame_over_its_limit(stream, cuts, max_frame):
    """Fed as FramedStream feeds it (needed() before every read), the decoder raises
    nothing but FrameError, and what it keeps between reads is never more than one
    incomplete frame within the limit."""
    decoder = FrameDecoder(max_frame_bytes=max_frame)
    try:
        for chunk in chunks(stream, cuts):
            while (message := decoder.next_message()) is not None:
                assert isinstance(message, dict) and isinstance(message["type"], str)
                assert decoder.last_frame_bytes <= LENGTH.size + max_frame
            assert decoder.buffered_bytes < LENGTH.size + max_frame
            assert decoder.needed() >= 1
            decoder.feed(chunk)
        while decoder.next_message() is not None:
            assert decoder.last_frame_bytes <= LENGTH.size + max_frame
    except FrameError as exc:
        assert exc.code in {"bad_frame", "frame_too_large"}


class _Chunks:
    """A stand-in for a libp2p stream: hands out given chunks, then EOF."""

    def __init__(self, parts: list[bytes]) -> None:
        self.parts = list(parts)

    async def read(self, n: int | None = None) -> bytes:
        if not self.parts:
            raise StreamEOF()
        return self.parts.pop(0)


@settings(max_examples=150)
@given(frame_streams, st.lists(st.integers(min_value=0), max_size=8), st.integers(1, 200))
def test_framed_stream_receive_raises_only_frame_errors(stream, cuts, max_frame):
    async def drain() -> list:
        framed = FramedStream(_Chunks(chunks(stream, cuts)), max_frame)
        received = []
        while True:
            try:
                message = await framed.receive()
            except FrameError as exc:
                assert exc.code in {"bad_frame", "frame_too_large"}
                if exc.code == "frame_too_large":
                    return received  # the server closes such a stream
                continue
            if message is None:
                return received
            received.append(message)

    for message in trio.run(drain):
        assert isinstance(message, dict) and isinstance(message["type"], str)


# ---------------------------------------------------------------- net/tensors.py

@settings(max_examples=200)
@given(st.sampled_from(sorted(WIRE_DTYPES)), st.integers(1, 3), st.data())
def test_decode_tensor_on_well_formed_tensors_with_any_bit_patterns(dtype, tokens, data):
    """Right structure, shape and length, arbitrary bits (NaN, infinities, subnormals):
    a finite tensor of that shape, or FrameError("non_finite")."""
    itemsize = WIRE_DTYPES[dtype][1].itemsize
    raw = data.draw(st.binary(min_size=tokens * H * itemsize, max_size=tokens * H * itemsize))
    try:
        out = decode_tensor({"dtype": dtype, "shape": [1, tokens, H], "data": raw}, hidden_size=H, max_tokens=3)
    except FrameError as exc:
        assert exc.code == "non_finite"
        return
    assert out.shape == (1, tokens, H) and out.dtype == WIRE_DTYPES[dtype][0]
    assert torch.isfinite(out).all()


@settings(max_examples=200)
@given(st.dictionaries(st.sampled_from(["dtype", "shape", "data", "extra"]), msgpack_values, max_size=4) |
       st.fixed_dictionaries({"dtype": st.sampled_from(sorted(WIRE_DTYPES)),
                              "shape": st.lists(INTS, min_size=3, max_size=3),
                              "data": st.binary(max_size=64)}))
def test_decode_tensor_on_arbitrary_dicts(obj):
    try:
        out = decode_tensor(obj, hidden_size=H, max_tokens=4)
    except FrameError as exc:
        assert exc.code in {"bad_tensor", "bad_dtype", "bad_shape", "non_finite"}
        return
    assert out.shape[0] == 1 and out.shape[2] == H and torch.isfinite(out).all()


# ---------------------------------------------------------------- torrent/manifest.py

@pytest.fixture(scope="module")
def manifest(tiny_model, tmp_path_factory):
    return lay_out(tiny_model, tmp_path_factory.mktemp("laid") / "m")


@settings(max_examples=200)
@given(st.one_of(st.binary(max_size=400), json_values.map(lambda v: json.dumps(v).encode())))
@example(b"[" * 5000)  # nesting deeper than the JSON parser's recursion limit
@example(b'{"a":' * 5000)
@example(b'{"format":' + b"[" * 5000)
def test_manifest_parse_on_arbitrary_bytes(raw):
    with pytest.raises(FrameError) as info:  # nothing arbitrary is a whole manifest
        parse(raw)
    assert info.value.code == "bad_manifest"


def _check_manifest(parsed) -> None:
    assert parsed.num_blocks >= 1
    assert len(parsed.pieces) == sum(len(f.pieces) for f in parsed.files)
    assert sum(f.role == "head" for f in parsed.files) == 1
    for f in parsed.files:
        assert len(f.pieces) == math.ceil(f.size / parsed.piece_size)
        for t in f.tensors.values():
            assert 0 <= t.begin <= t.end <= f.size


@settings(max_examples=200, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(st.data())
def test_structurally_mutated_manifests_raise_frame_error_or_parse(manifest, data):
    """Any value anywhere in a valid manifest replaced, removed or added (a list where
    a string was, a huge number, a map as a dtype ...): FrameError or a valid manifest."""
    doc = mutate(data, json.loads(manifest.raw), json_values)
    raw = json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()
    try:
        parsed = parse(raw)
    except FrameError as exc:
        assert exc.code == "bad_manifest"
        return
    _check_manifest(parsed)


@pytest.mark.parametrize("where", ["dtype", "role", "format", "name"])
@pytest.mark.parametrize("value", [[], {}, ["F32"], {"F32": 1}])
def test_unhashable_values_in_a_manifest_are_frame_errors(manifest, where, value):
    doc = json.loads(manifest.raw)
    if where == "dtype":
        next(iter(doc["files"][1]["tensors"].values()))["dtype"] = value
    elif where == "format":
        doc["format"] = value
    else:
        doc["files"][1][where] = value
    with pytest.raises(FrameError):
        parse(json.dumps(doc).encode())


# ---------------------------------------------------------------- net/signed.py

signers = st.one_of(st.just(peer_of(ALICE)), st.just(peer_of(BOB)), st.text(max_size=60),
                    st.binary(min_size=1, max_size=40).map(lambda b: ID(b).to_base58()))


@settings(max_examples=200)
@given(st.one_of(st.binary(max_size=200), msgpack_values.map(lambda v: msgpack.packb(v, use_bin_type=True)),
                 st.builds(lambda body, sig: msgpack.packb({"body": body, "sig": sig}, use_bin_type=True),
                           st.one_of(st.binary(max_size=40), msgpack_values), st.one_of(st.binary(max_size=80),
                                                                                       msgpack_values)),
                 msgpack_values.map(lambda body: seal(ALICE, body))),
       signers, st.integers(0, 300))
def test_open_sealed_raises_only_peer_misbehaved(value, signer, max_bytes):
    try:
        body = open_sealed(value, signer, max_bytes=max_bytes, what="thing")
    except PeerMisbehaved:
        pass
    else:
        assert isinstance(body, dict) and signer == peer_of(ALICE)  # only Alice signed anything here
    claimed = signer_of(value)
    assert claimed is None or isinstance(claimed, str)


@given(st.one_of(msgpack_values, st.text(), st.integers()), signers)
def test_open_sealed_refuses_what_is_not_bytes(value, signer):
    if isinstance(value, bytes):
        return
    with pytest.raises(PeerMisbehaved):
        open_sealed(value, signer, max_bytes=4096, what="thing")


# ---------------------------------------------------------------- net/records.py

RECORD = ServerRecord(peer_id=peer_of(ALICE), model_id=MODEL, start=0, end=4, dtype="float32",
                      addrs=("/ip4/127.0.0.1/tcp/4001",), expires=NOW + 60, seq=1, throughput=12.5)
RECORD_KEY = record_key(MODEL, peer_of(ALICE))
keys = st.one_of(st.just(RECORD_KEY), st.text(max_size=80),
                 st.builds(lambda m, p: f"/csserver/{m}/{p}", st.text(max_size=70), signers))


def _check_record(record: ServerRecord, key: str) -> None:
    assert key == record_key(record.model_id, record.peer_id)
    assert 0 <= record.start < record.end and record.dtype in ("float32", "float16", "bfloat16")
    assert math.isfinite(record.throughput) and record.throughput >= 0 and math.isfinite(record.expires)
    assert len(record.addrs) <= 8 and all(isinstance(a, str) for a in record.addrs)
    assert isinstance(record.seq, int) and not isinstance(record.seq, bool)


@settings(max_examples=200)
@given(keys, st.one_of(st.binary(max_size=300), msgpack_values.map(lambda body: seal(ALICE, body))))
def test_parse_record_on_arbitrary_keys_and_values(key, value):
    try:
        record = parse_record(key, value, now=NOW)
    except PeerMisbehaved:
        return
    _check_record(record, key)


@settings(max_examples=200)
@given(st.data(), st.booleans())
def test_structurally_mutated_records_raise_peer_misbehaved_or_parse(data, envelope_level):
    if envelope_level:  # the envelope around a valid body
        value = msgpack.packb(mutate(data, msgpack.unpackb(RECORD.sign(ALICE)), msgpack_values), use_bin_type=True)
    else:  # the body, signed again by its owner
        value = seal(ALICE, mutate(data, body_of(RECORD.sign(ALICE)), msgpack_values))
    try:
        record = parse_record(RECORD_KEY, value, now=NOW, allow_expired=data.draw(st.booleans()))
    except PeerMisbehaved:
        return
    _check_record(record, RECORD_KEY)


# ---------------------------------------------------------------- net/ads.py and hardware

HW = Hardware(cpu_cores=2, ram_mb=24000, ram_free_mb=20000, gpu=None, gpu_mb=0)
AD = make_ad(ALICE, peer_of(ALICE), ["/ip4/127.0.0.1/tcp/4001"], HW,
             [Serving(MODEL, 0, 10, "float32", free_tokens=8192, load=0.25, block_rate=40.0)], "0.1.0", now=NOW)


@settings(max_examples=200)
@given(st.data(), st.sampled_from(["body", "envelope", "relayed"]))
def test_structurally_mutated_ads_raise_peer_misbehaved_or_parse(data, how):
    """Nested fields too (hardware, each served span): PeerMisbehaved or a valid ad."""
    if how == "envelope":
        value = msgpack.packb(mutate(data, msgpack.unpackb(AD.raw), msgpack_values), use_bin_type=True)
    else:
        value = seal(ALICE, mutate(data, body_of(AD.raw), msgpack_values))
    try:
        ad = parse_ad(value, sender=None if how == "relayed" else peer_of(ALICE), now=NOW + 1)
    except PeerMisbehaved:
        return
    assert ad.peer_id == peer_of(ALICE) and ad.is_live(NOW + 1) and ad.sent < ad.expires
    assert len(ad.serving) <= 8 and len(ad.addrs) <= 8 and ad.hardware.cpu_cores >= 1
    for serving in ad.serving:
        assert 0 <= serving.start < serving.end and 0 <= serving.load <= 1
        assert math.isfinite(serving.block_rate) and 0 <= serving.free_tokens < 2**31


@settings(max_examples=200)
@given(st.one_of(msgpack_values,
                 st.fixed_dictionaries({k: msgpack_values for k in ("cpu", "ram_mb", "free_mb", "gpu", "gpu_mb")})))
def test_hardware_from_wire_raises_only_value_error(obj):
    try:
        hardware = Hardware.from_wire(obj)
    except ValueError:
        return
    assert hardware.cpu_cores >= 1 and 0 <= hardware.ram_free_mb <= hardware.ram_mb


# ---------------------------------------------------------------- torrent/protocol.py

@settings(max_examples=200)
@given(st.one_of(st.binary(max_size=40), msgpack_values), st.integers(0, 300))
def test_decode_bitfield_on_arbitrary_input(field, num_pieces):
    try:
        have = decode_bitfield(field, num_pieces)
    except FrameError as exc:
        assert exc.code == "bad_message"
        return
    assert have <= set(range(num_pieces))


torrent_messages = st.fixed_dictionaries(
    {"type": st.sampled_from(["hello", "manifest", "request", "cancel", "error", "bitfield", "have", "piece",
                              "reject", "surprise"])},
    optional={k: msgpack_values for k in ("model", "index", "data", "code", "message", "pieces", "have")},
)


@settings(max_examples=200)
@given(torrent_messages, st.one_of(st.none(), st.integers(0, 100)))
def test_torrent_messages_with_nested_values_parse_or_raise_frame_error(message, num_pieces):
    for parser in (parse_request, parse_reply):
        try:
            kind, _value = parser(message, num_pieces)
        except FrameError as exc:
            assert exc.code == "bad_message"
            continue
        assert kind == message["type"]


# ---------------------------------------------------------------- proofs/inference.py: failure reports

def _report() -> FailureReport:
    digest = hashlib.sha256(b"inputs").digest()
    claims = []
    for kp, scale in ((ALICE, 1.0), (BOB, 2.0)):
        output = (np.arange(H, dtype="<f4") * scale).tobytes()
        claims.append(signed_claim(kp, output, model=MODEL, start=0, end=4, position=7, tokens=1,
                                   input_digest=digest))
    return FailureReport("fp32", MODEL, 0, 4, 7, 1, GENESIS, digest, claims[0], claims[1])


REPORT = _report()


def test_the_unmutated_report_checks():
    FailureReport.from_wire(REPORT.to_wire()).check()


@settings(max_examples=200)
@given(st.data())
def test_mutated_failure_reports_raise_peer_misbehaved_or_check(data):
    wire = mutate(data, msgpack.unpackb(REPORT.to_wire()), msgpack_values)
    try:
        report = FailureReport.from_wire(msgpack.packb(wire, use_bin_type=True))
        report.check()
    except PeerMisbehaved:
        return
    assert report.accused.peer_id != report.witness.peer_id and report.error() > report.tolerance


@given(st.binary(max_size=300))
def test_failure_report_from_arbitrary_bytes(raw):
    with pytest.raises(PeerMisbehaved):
        FailureReport.from_wire(raw).check()


# ---------------------------------------------------------------- karma: receipts and records

RECEIPT = countersign(sign_receipt(Receipt(peer_of(BOB), peer_of(ALICE), MODEL, 0, 4, b"s" * 16, 0, 3, 12.5, 20.0,
                                           NOW), ALICE.private_key), BOB.private_key)
KARMA = make_record(peer_of(BOB), [RECEIPT], seq=1, now=NOW, ttl_s=3600, addrs=("/ip4/127.0.0.1/tcp/1",))


def test_the_unmutated_receipt_and_karma_record_parse():
    parse_receipt(RECEIPT)
    check_evidence(parse_karma_record(karma_key(peer_of(BOB)), KARMA.sign(BOB), now=NOW), [RECEIPT])


@settings(max_examples=200)
@given(st.data(), st.sampled_from(["envelope", "body"]))
def test_mutated_receipts_raise_peer_misbehaved_or_parse_with_both_signatures(data, level):
    envelope = msgpack.unpackb(RECEIPT)
    if level == "envelope":
        wire = msgpack.packb(mutate(data, envelope, msgpack_values), use_bin_type=True)
    else:  # a changed body keeps the old signatures: never valid unless the change was a no-op
        envelope["body"] = msgpack.packb(mutate(data, msgpack.unpackb(envelope["body"]), msgpack_values),
                                         use_bin_type=True)
        wire = msgpack.packb(envelope, use_bin_type=True)
    try:
        receipt = parse_receipt(wire)
    except PeerMisbehaved:
        return
    assert receipt == parse_receipt(RECEIPT)  # only what the two peers signed parses


@given(st.one_of(st.binary(max_size=300), msgpack_values.map(lambda v: msgpack.packb(v, use_bin_type=True))))
def test_receipt_from_arbitrary_bytes_raises_peer_misbehaved(raw):
    with pytest.raises(PeerMisbehaved):
        parse_receipt(raw)


@settings(max_examples=200)
@given(st.data(), st.booleans())
def test_mutated_karma_records_raise_peer_misbehaved_or_parse(data, envelope_level):
    key = karma_key(peer_of(BOB))
    if envelope_level:
        value = msgpack.packb(mutate(data, msgpack.unpackb(KARMA.sign(BOB)), msgpack_values), use_bin_type=True)
    else:  # the body, signed again by its owner: the schema alone must hold the line
        value = seal(BOB, mutate(data, body_of(KARMA.sign(BOB)), msgpack_values))
    try:
        record = parse_karma_record(key, value, now=NOW, allow_expired=data.draw(st.booleans()))
    except PeerMisbehaved:
        return
    assert record.peer_id == peer_of(BOB) and len(record.root) == 32 and record.count >= 0
    assert math.isfinite(record.score) and record.compute_ms >= 0 and len(record.addrs) <= 8
