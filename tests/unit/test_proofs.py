"""pipeline/proofs.py: signed step claims, chunking-independent input digests, failure reports
that anyone can check and that no input can turn into anything but PeerMisbehaved."""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import os

import msgpack
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from libp2p.crypto.ed25519 import create_new_key_pair
from libp2p.crypto.secp256k1 import create_new_key_pair as create_secp256k1_key_pair
from libp2p.peer.id import ID

from compushare.errors import PeerMisbehaved
from compushare.proofs import (
    DEFAULT_TOLERANCE,
    MAX_REPORT_BYTES,
    REPORT_FORMAT,
    FailureReport,
    InputDigest,
    StepClaim,
    sign_step,
    verify_step,
)

KEYS = [create_new_key_pair(bytes([i]) * 32) for i in range(3)]
PEERS = [ID.from_pubkey(kp.public_key).to_base58() for kp in KEYS]
MODEL, START, END, POSITION, TOKENS = "model-x", 2, 5, 7, 2
INPUT = hashlib.sha256(b"the session's inputs so far").digest()
OUTPUT = hashlib.sha256(b"the step's output").digest()
STEP = (MODEL, START, END, POSITION, TOKENS, INPUT, OUTPUT)


# ---------------------------------------------------------------- sign / verify


def test_sign_verify_round_trip():
    signature = sign_step(KEYS[0], *STEP)
    assert verify_step(PEERS[0], signature, *STEP)
    assert not verify_step(PEERS[1], signature, *STEP)  # another peer did not sign it


@pytest.mark.parametrize(("index", "other"), [
    (0, "model-y"), (1, START + 1), (2, END + 1), (3, POSITION + 1), (4, TOKENS + 1),
    (5, hashlib.sha256(b"another history").digest()), (6, hashlib.sha256(b"another output").digest()),
])
def test_any_changed_field_fails_verification(index, other):
    signature = sign_step(KEYS[0], *STEP)
    changed = list(STEP)
    changed[index] = other
    assert not verify_step(PEERS[0], signature, *changed)


def test_fields_do_not_run_together():
    """The statement is structured, not concatenated: (2, 15) and (21, 5) differ."""
    signature = sign_step(KEYS[0], MODEL, 2, 15, POSITION, TOKENS, INPUT, OUTPUT)
    assert not verify_step(PEERS[0], signature, MODEL, 21, 5, POSITION, TOKENS, INPUT, OUTPUT)


@pytest.mark.parametrize("peer", [
    "", "not a peer id", "0OIl", PEERS[0][:-3], PEERS[0] + "x",
    ID(b"\x12\x20" + bytes(32)).to_base58(),  # a sha256 peer id: no public key inside
    ID.from_pubkey(create_secp256k1_key_pair().public_key).to_base58(),  # signed with another key type
])
def test_garbage_peer_id_is_not_valid_and_does_not_raise(peer):
    assert verify_step(peer, sign_step(KEYS[0], *STEP), *STEP) is False


@pytest.mark.parametrize("signature", [b"", b"\x00" * 64, b"\xff" * 63, b"\x01" * 65, os.urandom(64), "text", None])
def test_garbage_signature_is_not_valid_and_does_not_raise(signature):
    assert verify_step(PEERS[0], signature, *STEP) is False


# ---------------------------------------------------------------- input digest


@given(st.binary(max_size=2000), st.lists(st.integers(0, 2000), max_size=8))
def test_input_digest_is_independent_of_chunking(data, cuts):
    """A replayed history sent in other chunks proves the same input stream."""
    bounds = [0, *sorted(min(c, len(data)) for c in cuts), len(data)]
    digest = InputDigest()
    for lo, hi in itertools.pairwise(bounds):
        digest.update(memoryview(data)[lo:hi] if lo % 2 else data[lo:hi])
    assert digest.digest() == hashlib.sha256(data).digest()


def test_input_digest_reading_does_not_end_it():
    digest = InputDigest()
    digest.update(b"ab")
    assert digest.digest() == digest.digest() == hashlib.sha256(b"ab").digest()
    digest.update(b"c")
    assert digest.digest() == hashlib.sha256(b"abc").digest()
    assert InputDigest().digest() == hashlib.sha256().digest()


# ---------------------------------------------------------------- failure reports


def claim(index: int, output: np.ndarray, *, dtype: str = "float32", signer: int | None = None,
          input_digest: bytes = INPUT) -> StepClaim:
    """Peer `index`'s signed claim (signed by `signer`'s key if given: a forgery)."""
    data = output.astype("<f4" if dtype == "float32" else "<f2").tobytes()
    key = KEYS[index if signer is None else signer]
    signature = sign_step(key, MODEL, START, END, POSITION, TOKENS, input_digest, hashlib.sha256(data).digest())
    return StepClaim(PEERS[index], dtype, data, signature)


TRUE = np.random.default_rng(0).standard_normal(TOKENS * 64).astype(np.float32)
WRONG = TRUE * np.float32(1.05)  # 5% off: far beyond the tolerance
ROUNDED = TRUE * np.float32(1 + 1e-6)  # float rounding: within it


def report(accused: StepClaim, witness: StepClaim, **overrides) -> FailureReport:
    return dataclasses.replace(FailureReport(MODEL, START, END, POSITION, TOKENS, INPUT, accused, witness),
                               **overrides)


def test_report_of_two_conflicting_signed_claims_checks_and_round_trips():
    r = report(claim(0, WRONG), claim(1, TRUE))
    r.check()
    assert r.error() == pytest.approx(0.05, rel=1e-4) and r.tolerance == DEFAULT_TOLERANCE
    wire = r.to_wire()
    back = FailureReport.from_wire(wire)
    assert back == r and back.to_wire() == wire and back.digest == r.digest
    back.check()
    assert np.array_equal(back.accused.array(), WRONG)


def test_float16_claims_check_too():
    report(claim(0, WRONG, dtype="float16"), claim(1, TRUE, dtype="float16")).check()


def test_forged_signature_is_rejected():
    """A reporter cannot frame a peer with a claim it signed itself."""
    with pytest.raises(PeerMisbehaved, match="not signed"):
        report(claim(0, WRONG, signer=2), claim(1, TRUE)).check()
    with pytest.raises(PeerMisbehaved, match="not signed"):
        report(claim(0, WRONG), claim(1, TRUE, signer=2)).check()


def test_a_tampered_output_is_rejected():
    honest = claim(1, TRUE)
    tampered = dataclasses.replace(honest, output=WRONG.tobytes())
    with pytest.raises(PeerMisbehaved, match="not signed"):
        report(claim(0, TRUE), tampered).check()


def test_both_claims_from_the_same_peer_are_rejected():
    with pytest.raises(PeerMisbehaved, match="two different servers"):
        report(claim(0, WRONG), claim(0, TRUE)).check()


@pytest.mark.parametrize("output", [TRUE, ROUNDED])
def test_agreeing_outputs_are_nothing_to_report(output):
    with pytest.raises(PeerMisbehaved, match="agree within the tolerance"):
        report(claim(0, output), claim(1, TRUE)).check()


def test_bfloat16_outputs_are_rejected():
    accused = claim(0, WRONG)
    bf16 = StepClaim(accused.peer_id, "bfloat16", accused.output, accused.signature)
    with pytest.raises(PeerMisbehaved, match="bfloat16"):
        report(bf16, claim(1, TRUE)).check()
    with pytest.raises(PeerMisbehaved):
        report(claim(1, TRUE), bf16).check()
    assert report(bf16, claim(1, TRUE)).error() == float("inf")


def test_unknown_dtype_and_ragged_output_are_rejected():
    accused = claim(0, WRONG)
    with pytest.raises(PeerMisbehaved, match="dtype"):
        report(dataclasses.replace(accused, dtype="int8"), claim(1, TRUE)).check()
    with pytest.raises(PeerMisbehaved, match="whole number"):
        report(dataclasses.replace(accused, output=accused.output + b"\x00"), claim(1, TRUE)).check()


def test_input_digest_other_than_the_signed_one_is_rejected():
    """Claims about different histories do not conflict: the report must name the
    input digest both servers signed."""
    other = hashlib.sha256(b"another history").digest()
    with pytest.raises(PeerMisbehaved, match="not signed"):
        report(claim(0, WRONG), claim(1, TRUE), input_digest=other).check()
    with pytest.raises(PeerMisbehaved, match="not signed"):  # each signed a different history
        report(claim(0, WRONG, input_digest=other), claim(1, TRUE)).check()


@pytest.mark.parametrize(("field", "changed"), [("model_id", "model-y"), ("start", START - 1), ("end", END + 1),
                                               ("position", POSITION + 1), ("tokens", TOKENS + 1)])
def test_report_fields_other_than_the_signed_ones_are_rejected(field, changed):
    with pytest.raises(PeerMisbehaved, match="not signed"):
        report(claim(0, WRONG), claim(1, TRUE), **{field: changed}).check()


# ---------------------------------------------------------------- from_wire on anything


def good_body() -> dict:
    return msgpack.unpackb(report(claim(0, WRONG), claim(1, TRUE)).to_wire(), raw=False)


def pack(body) -> bytes:
    return msgpack.packb(body, use_bin_type=True)


def with_(body: dict, path: tuple, value) -> dict:
    target = body
    for key in path[:-1]:
        target = target[key]
    if value is _DELETE:
        del target[path[-1]]
    else:
        target[path[-1]] = value
    return body


_DELETE = object()
BAD_FIELDS = [
    (("format",), "compushare/failure-report/v0"), (("format",), _DELETE), (("model",), 3),
    (("start",), True), (("start",), "2"), (("start",), -1), (("end",), START), (("position",), -1),
    (("tokens",), 0), (("tokens",), 1.0), (("input_digest",), INPUT[:31]), (("input_digest",), INPUT.hex()),
    (("tolerance",), 0), (("tolerance",), 1.0), (("tolerance",), -0.5), (("tolerance",), "0.001"),
    (("tolerance",), float("nan")), (("accused",), None), (("accused",), [1, 2]), (("witness", "peer"), b"x"),
    (("witness", "output"), "text"), (("witness", "sig"), _DELETE), (("accused", "dtype"), None),
]


@pytest.mark.parametrize(("path", "value"), BAD_FIELDS)
def test_from_wire_rejects_malformed_fields(path, value):
    with pytest.raises(PeerMisbehaved):
        FailureReport.from_wire(pack(with_(good_body(), path, value)))


@pytest.mark.parametrize("data", [
    b"", b"\xc1", b"\x92\x01\x02", pack([]), pack(None), pack("text"), pack({1: 2}), pack({"format": REPORT_FORMAT}),
    pack(good_body())[:-1], pack(good_body()) + b"\x00", "a str, not bytes", None, bytes(MAX_REPORT_BYTES + 1),
])
def test_from_wire_rejects_garbage(data):
    with pytest.raises(PeerMisbehaved):
        FailureReport.from_wire(data)


def test_from_wire_accepts_bytearray():
    assert FailureReport.from_wire(bytearray(pack(good_body()))) == FailureReport.from_wire(pack(good_body()))


def parse(data):
    """from_wire's contract: a report or PeerMisbehaved, never anything else."""
    try:
        FailureReport.from_wire(data)
    except PeerMisbehaved:
        pass


@given(st.binary(max_size=512))
def test_from_wire_on_any_bytes_raises_only_peer_misbehaved(data):
    parse(data)


msgpack_values = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(-(2**63), 2**64 - 1), st.floats(), st.text(max_size=8),
              st.binary(max_size=40), st.sampled_from([REPORT_FORMAT, INPUT, PEERS[0], "float32", "bfloat16"])),
    lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=8), inner, max_size=4)),
    max_leaves=12,
)
paths = st.sampled_from([("format",), ("model",), ("start",), ("end",), ("position",), ("tokens",),
                         ("input_digest",), ("tolerance",), ("accused",), ("witness",)]
                        + [(who, key) for who in ("accused", "witness") for key in ("peer", "dtype", "output", "sig")])


@given(st.dictionaries(st.text(max_size=12), msgpack_values, max_size=12))
def test_from_wire_on_any_map_raises_only_peer_misbehaved(body):
    parse(pack(body))


@given(st.lists(st.tuples(paths, st.one_of(msgpack_values, st.just(_DELETE))), min_size=1, max_size=4))
def test_from_wire_on_a_mangled_report_raises_only_peer_misbehaved(changes):
    """Near-valid reports reach every check, not just the first."""
    body = good_body()
    for path, value in changes:
        try:
            with_(body, path, value)
        except (KeyError, TypeError):
            continue  # a claim already replaced by a non-map, or a key already deleted
    parse(pack(body))
