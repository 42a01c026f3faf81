"""proofs/private.py: a provider's signed private products and the failure report two
conflicting ones make. The statement's digests, signing, the report's strict wire
form and its check (hypothesis: round trips, every single field changed, anything
from the wire), karma taking it like a plaintext report, the consumer refusing a
reply whose signature is missing or forged, and what all of it rests on: two
providers answer one encrypted request with the very same bytes."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import subprocess
import sys

import msgpack
import numpy as np
import pytest
import trio
from hypothesis import given, settings
from hypothesis import strategies as st
from libp2p.crypto.ed25519 import create_new_key_pair
from libp2p.peer.id import ID

from compushare.errors import PeerMisbehaved
from compushare.karma.ledger import ReportStore
from compushare.karma.rules import verified_reports
from compushare.pipeline.client.private_reports import Signed, mismatch_report, signed_reply
from compushare.pipeline.private_wire import PrivateProtocolError
from compushare.proofs.private import (LAYOUT, MAX_PRIVATE_REPORT_BYTES, PRIVATE_REPORT_FORMAT, PrivateClaim,
                                       PrivateFailureReport, PrivateStatement, input_digest, output_digest)
from compushare.proofs.inference import STEP_DOMAIN
from compushare.proofs.reports import parse_report

pytestmark = pytest.mark.unit

KEYS = [create_new_key_pair(bytes([i + 40]) * 32) for i in range(3)]
PEERS = [ID.from_pubkey(kp.public_key).to_base58() for kp in KEYS]
MODEL, PARAMS, KEYS_DIGEST = "a" * 64, "ckks-8192-60-40-60", hashlib.sha256(b"galois keys").hexdigest()
CTS = [b"input ciphertext %d" % i for i in range(3)]
TRUE = [[b"output %d.%d" % (t, o) for o in range(2)] for t in range(3)]
WRONG = [TRUE[0], [TRUE[1][0], TRUE[1][1] + b"!"], TRUE[2]]
SESSION = (MODEL, PARAMS, KEYS_DIGEST)


def statement(outs=TRUE, **overrides) -> PrivateStatement:
    base = PrivateStatement.of(MODEL, PARAMS, KEYS_DIGEST, 4, "down", len(CTS), CTS, outs)
    return dataclasses.replace(base, **overrides)


def signed(index: int, outs, *, signer: int | None = None) -> Signed:
    """Provider `index`'s signed reply (signed with `signer`'s key if given: a forgery)."""
    s = statement(outs)
    return Signed(s, PrivateClaim(PEERS[index], s.output_digest, s.sign(KEYS[index if signer is None else signer])))


def report(accused: Signed, witness: Signed, **overrides) -> PrivateFailureReport:
    return dataclasses.replace(PrivateFailureReport.of(accused.statement, accused.claim, witness.claim), **overrides)


VALID = report(signed(0, WRONG), signed(1, TRUE))


# ---------------------------------------------------------------- statement and digests


def test_digests_follow_the_order_and_the_grouping_of_the_ciphertexts():
    assert input_digest(CTS) == hashlib.sha256(b"".join(hashlib.sha256(c).digest() for c in CTS)).digest()
    assert input_digest(CTS) != input_digest(CTS[::-1]) and input_digest(CTS) != input_digest(CTS[:2])
    a, b, c = b"a", b"b", b"c"
    assert output_digest([[a, b], [c]]) != output_digest([[a], [b, c]])  # the same bytes, other tokens
    assert output_digest([[a, b]]) != output_digest([[b, a]])
    assert output_digest(TRUE) != output_digest(WRONG)


def test_a_signed_statement_verifies_for_its_signer_only_and_on_every_field():
    s = statement()
    sig = s.sign(KEYS[0])
    assert s.verify(PEERS[0], sig) and not s.verify(PEERS[1], sig)
    assert s.layout == LAYOUT and s.tokens == len(CTS)
    assert msgpack.unpackb(s.encode())[0] == "compushare/private-proof/v1" != STEP_DOMAIN
    for field, other in [("model_id", "b" * 64), ("params", "other"), ("layout", "3"), ("keys_digest", "0" * 64),
                         ("layer", 5), ("group", "qkv"), ("tokens", 2), ("input_digest", bytes(32)),
                         ("output_digest", bytes(32))]:
        assert not dataclasses.replace(s, **{field: other}).verify(PEERS[0], sig), field


@pytest.mark.parametrize("sig", [None, b"", 64, "text", b"x" * 64, b"x" * 2000])
def test_a_claim_needs_the_providers_own_signature(sig):
    with pytest.raises(PeerMisbehaved):
        statement().claim(PEERS[0], sig)


# ---------------------------------------------------------------- the consumer's side


def test_the_consumer_takes_a_signed_reply_and_refuses_a_missing_or_forged_signature():
    good = statement().sign(KEYS[0])
    taken = signed_reply(PEERS[0], SESSION, 4, "down", len(CTS), CTS, TRUE, good)
    assert taken.claim == PrivateClaim(PEERS[0], output_digest(TRUE), good)
    for peer, outs, sig in [(PEERS[0], TRUE, None),  # no signature
                            (PEERS[0], TRUE, statement().sign(KEYS[1])),  # another provider's key
                            (PEERS[1], TRUE, good),  # another provider's signature, passed off
                            (PEERS[0], WRONG, good),  # a signature of other outputs
                            (PEERS[0], TRUE, statement(layer=5).sign(KEYS[0]))]:  # of another request
        with pytest.raises(PrivateProtocolError):
            signed_reply(peer, SESSION, 4, "down", len(CTS), CTS, outs, sig)


class _Framed:
    def __init__(self, reply) -> None:
        self.reply, self.sent = reply, []

    async def send(self, message) -> None:
        self.sent.append(message)

    async def receive(self):
        return self.reply


@pytest.mark.parametrize("sig", ["missing", "forged", "good"])
def test_a_private_session_refuses_a_reply_without_its_providers_signature(sig):
    """PrivateSession.project: a bad signature is a bad reply (PrivateProtocolError,
    which the chain fails over like a malformed one)."""
    from compushare.pipeline.client.private_session import PrivateSession, Request  # noqa: PLC0415

    hop = type("H", (), {"peer_id": PEERS[0]})()
    plan = type("P", (), {"groups": lambda self, tokens: len(TRUE)})()  # one group a token
    reply = {"type": "projected", "cts": TRUE, "compute_s": 0.1}
    if sig != "missing":
        reply["sig"] = statement().sign(KEYS[0 if sig == "good" else 2])
    session = PrivateSession(hop, _Framed(reply), SESSION)

    async def ask():
        return await session.project(4, "down", Request(len(CTS), plan, tuple(CTS)))

    if sig == "good":
        outs, compute_s, claim = trio.run(ask)
        assert outs == TRUE and claim.claim.peer_id == PEERS[0] and claim.statement == statement()
    else:
        with pytest.raises(PrivateProtocolError, match="sign"):
            trio.run(ask)


def test_a_mismatch_report_accuses_the_one_found_wrong_and_needs_one_request():
    ours, theirs = signed(0, WRONG), signed(1, TRUE)
    (against_ours,) = mismatch_report(ours, theirs, ours_wrong=True)
    assert (against_ours.accused.peer_id, against_ours.witness.peer_id) == (PEERS[0], PEERS[1])
    (against_theirs,) = mismatch_report(ours, theirs, ours_wrong=False)
    assert (against_theirs.accused.peer_id, against_theirs.witness.peer_id) == (PEERS[1], PEERS[0])
    other_request = Signed(statement(TRUE, layer=5), theirs.claim)
    assert mismatch_report(ours, other_request, ours_wrong=True) == []
    assert mismatch_report(ours, signed(1, WRONG), ours_wrong=True) == []  # the same bytes: nothing to report


# ---------------------------------------------------------------- the report


def test_a_report_of_two_different_signed_answers_checks_and_round_trips():
    VALID.check()
    wire = VALID.to_wire()
    assert len(wire) < 1024  # digests, not ciphertexts
    back = PrivateFailureReport.from_wire(wire)
    assert back == VALID and back.to_wire() == wire and back.digest == VALID.digest
    assert parse_report(wire) == VALID  # the karma readers' one parser
    back.check()


def test_a_report_is_refused_for_one_peer_the_same_answer_or_a_forgery():
    with pytest.raises(PeerMisbehaved, match="two different"):
        report(signed(0, WRONG), Signed(statement(), PrivateClaim(PEERS[0], *_digest_sig(TRUE, 0)))).check()
    with pytest.raises(PeerMisbehaved, match="the same"):
        report(signed(0, TRUE), signed(1, TRUE)).check()
    with pytest.raises(PeerMisbehaved, match="not signed"):
        report(signed(0, WRONG, signer=2), signed(1, TRUE)).check()  # "signed" for the accused by another key
    with pytest.raises(PeerMisbehaved, match="not signed"):
        report(signed(0, WRONG), signed(1, TRUE), layer=5).check()  # another request than they answered


def _digest_sig(outs, index):
    s = statement(outs)
    return s.output_digest, s.sign(KEYS[index])


def _body(r: PrivateFailureReport = VALID) -> dict:
    return msgpack.unpackb(r.to_wire(), raw=False)


def _changed(value, draw):
    if isinstance(value, int):
        return value + draw(st.sampled_from([-1, 1, 2]))
    if isinstance(value, bytes):
        index = draw(st.integers(0, len(value) - 1))
        return value[:index] + bytes([value[index] ^ draw(st.integers(1, 255))]) + value[index + 1:]
    return draw(st.sampled_from([value + "x", value[:-1], "1" if value != "1" else "2", PEERS[2], value.upper()])
                .filter(lambda v: v != value))


FIELDS = [(k,) for k, v in _body().items() if k != "format" and not isinstance(v, dict)] + \
    [(who, k) for who in ("accused", "witness") for k in ("peer", "output_digest", "sig")]


@settings(max_examples=200)
@given(st.sampled_from(FIELDS), st.data())
def test_every_single_field_change_to_a_valid_report_is_rejected(path, data):
    body = _body()
    target = body
    for key in path[:-1]:
        target = target[key]
    target[path[-1]] = _changed(target[path[-1]], data.draw)
    with pytest.raises(PeerMisbehaved):
        PrivateFailureReport.from_wire(msgpack.packb(body, use_bin_type=True)).check()


texts = st.text(min_size=1, max_size=16)


@settings(max_examples=100)
@given(st.builds(PrivateFailureReport, texts, texts, texts, st.text("0123456789abcdef", min_size=64, max_size=64),
                 st.integers(0, 1 << 16), texts, st.integers(1, 1 << 16), st.binary(min_size=32, max_size=32),
                 *[st.builds(PrivateClaim, st.sampled_from(PEERS), st.binary(min_size=32, max_size=32),
                             st.binary(min_size=1, max_size=128)) for _ in range(2)]))
def test_from_wire_round_trips_any_well_formed_report(r):
    wire = r.to_wire()
    assert PrivateFailureReport.from_wire(wire) == r == parse_report(wire)
    assert PrivateFailureReport.from_wire(wire).to_wire() == wire


_DELETE = object()


@pytest.mark.parametrize(("path", "value"), [
    (("format",), "compushare/private-failure-report/v0"), (("extra",), 1), (("model",), _DELETE), (("model",), ""),
    (("model",), "m" * 129), (("params",), 3), (("layout",), None), (("keys_digest",), "A" * 64),
    (("keys_digest",), "a" * 63), (("keys_digest",), "a" * 64 + "\n"), (("layer",), -1), (("layer",), True),
    (("group",), b"down"), (("tokens",), 0), (("tokens",), 1.0), (("input_digest",), bytes(31)),
    (("accused",), None), (("accused", "extra"), 1), (("witness", "peer"), b"x"), (("witness", "peer"), ""),
    (("witness", "output_digest"), bytes(33)), (("accused", "sig"), b""), (("accused", "sig"), b"s" * 1025),
    (("witness", "sig"), _DELETE),
])
def test_from_wire_rejects_malformed_fields(path, value):
    body = _body()
    target = body
    for key in path[:-1]:
        target = target[key]
    if value is _DELETE:
        del target[path[-1]]
    else:
        target[path[-1]] = value
    with pytest.raises(PeerMisbehaved):
        PrivateFailureReport.from_wire(msgpack.packb(body, use_bin_type=True))


def test_from_wire_refuses_what_is_not_a_small_report():
    for data in (b"", b"\xc1", msgpack.packb([]), msgpack.packb({"format": PRIVATE_REPORT_FORMAT}), None, "text",
                 VALID.to_wire()[:-1], msgpack.packb(_body() | {"pad": bytes(MAX_PRIVATE_REPORT_BYTES)})):
        with pytest.raises(PeerMisbehaved):
            PrivateFailureReport.from_wire(data)
    with pytest.raises(PeerMisbehaved):  # parse_report: too large for a private report
        parse_report(msgpack.packb(_body() | {"pad": bytes(MAX_PRIVATE_REPORT_BYTES)}))


msgpack_values = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(-(2**63), 2**64 - 1), st.floats(), st.text(max_size=8),
              st.binary(max_size=40), st.sampled_from([PRIVATE_REPORT_FORMAT, PEERS[0], KEYS_DIGEST])),
    lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=8), inner, max_size=4)),
    max_leaves=12)


@given(st.lists(st.tuples(st.sampled_from(FIELDS + [("format",), ("accused",), ("witness",)]), msgpack_values),
                min_size=1, max_size=4))
def test_from_wire_on_a_mangled_report_raises_only_peer_misbehaved(changes):
    body = _body()
    for path, value in changes:
        try:
            target = body
            for key in path[:-1]:
                target = target[key]
            target[path[-1]] = value
        except (KeyError, TypeError):
            continue
    try:
        parse_report(msgpack.packb(body, use_bin_type=True)).check()
    except PeerMisbehaved:
        pass


# ---------------------------------------------------------------- karma takes it like a plaintext report


def test_karma_counts_a_private_report_once_per_witness_and_stores_it(tmp_path):
    wires = [VALID.to_wire(), report(signed(0, WRONG), signed(2, TRUE)).to_wire(),
             report(signed(0, WRONG, signer=1), signed(2, TRUE)).to_wire(),  # forged: not counted
             report(signed(1, TRUE), signed(0, WRONG)).to_wire()]  # against someone else
    found = verified_reports(wires, PEERS[0])
    assert sorted(r.witness.peer_id for r in found) == sorted(PEERS[1:])
    assert all(isinstance(r, PrivateFailureReport) for r in found)
    store = ReportStore(tmp_path)
    assert store.add(VALID) and not store.add(VALID)
    assert store.against(PEERS[0]) == [VALID.to_wire()]
    assert ReportStore(tmp_path).accused() == {PEERS[0]}  # read back from disk


def test_the_karma_service_keeps_a_private_report_it_witnessed(tmp_path):
    from compushare.karma.record import karma_validators  # noqa: PLC0415
    from compushare.karma.service import KarmaService  # noqa: PLC0415
    from compushare.net.dht import open_dht  # noqa: PLC0415
    from compushare.net.host import open_host  # noqa: PLC0415

    async def main():
        async with open_host(KEYS[1], []) as host, open_dht(host, server=False, validators=karma_validators()) as dht:
            service = KarmaService(host, dht, KEYS[1], tmp_path)
            kept = await service._answer({"type": "report", "report": VALID.to_wire()})
            assert kept == {"type": "kept", "new": True}
            with pytest.raises(PeerMisbehaved, match="witness"):
                await service._answer({"type": "report",
                                       "report": report(signed(0, WRONG), signed(2, TRUE)).to_wire()})
            assert (await service._answer({"type": "reports", "peer": PEERS[0]}))["items"] == [VALID.to_wire()]

    trio.run(main)


# ---------------------------------------------------------------- determinism: what a report rests on

PROJECT = """
import hashlib, json, sys
import msgpack
from compushare.pipeline.server.private_worker import WorkerState
load, keys, requests = msgpack.unpackb(sys.stdin.buffer.read(), raw=False)
state = WorkerState()
state.handle(load)
state.handle(keys)
outs = [[[data for _, data in group] for group in state.handle(r)["parts"]] for r in requests]
print(json.dumps([hashlib.sha256(msgpack.packb(o)).hexdigest() for o in outs]))
"""


def joined(reply: dict) -> list[list[bytes]]:
    """A single worker's reply as the wire's `cts`: per group, its outputs in order."""
    return [[data for _, data in group] for group in reply["parts"]]


def test_two_providers_answer_one_encrypted_request_with_the_same_bytes(tiny_model):
    """Two workers (one pre-encoding its weights, one encoding per request; one in
    another process) give byte-identical products for the same ciphertexts and keys:
    honest providers sign the same output digest, so different ones prove a lie."""
    from compushare.he.ckks import SecretContext, keys_digest  # noqa: PLC0415
    from compushare.he.groups import GROUPS, group_shapes, required_steps  # noqa: PLC0415
    from compushare.he.plan import choose  # noqa: PLC0415
    from compushare.model.arch import load_config  # noqa: PLC0415
    from compushare.pipeline.server.private_worker import WorkerState  # noqa: PLC0415

    params = "ckks-8192-60-40-60"
    config, secret = load_config(tiny_model), SecretContext(params)
    keys = secret.galois_keys(required_steps(config, secret.slots))
    keys_request = {"op": "keys", "digest": keys_digest(keys), "data": keys}
    rng = np.random.default_rng(3)
    requests = []
    for layer, group in [(0, g) for g in sorted(GROUPS)] + [(1, "down")]:
        rows, cols = group_shapes(config)[group]
        plan = choose(rows, cols, secret.slots, 2)
        x = 10 * rng.normal(0, 1, (2, cols))
        cts = [secret.encrypt(slots) for start in range(0, 2, plan.tokens)
               for slots in plan.input_slots(x[start:start + plan.tokens])]
        requests.append({"op": "project", "digest": keys_digest(keys), "layer": layer, "group": group, "tokens": 2,
                         "cts": cts})
    answers = []
    for preencode in (True, False):
        state = WorkerState()
        state.handle({"op": "load", "model_dir": str(tiny_model), "start": 0, "end": 2, "params": params,
                      "preencode": preencode})
        state.handle(keys_request)
        answers.append([joined(state.handle(r)) for r in requests])
    assert answers[0] == answers[1]
    digests = [output_digest(outs) for outs in answers[0]]
    assert len(set(digests)) == len(digests)
    load = {"op": "load", "model_dir": str(tiny_model), "start": 0, "end": 2, "params": params}
    other = subprocess.run([sys.executable, "-c", PROJECT], input=msgpack.packb([load, keys_request, requests]),
                           capture_output=True, timeout=120, check=True)
    assert json.loads(other.stdout) == [hashlib.sha256(msgpack.packb(outs)).hexdigest() for outs in answers[0]]
    # A liar's noise (--debug-noise) changes the bytes, so its signed digest differs.
    liar = WorkerState()
    liar.handle(load | {"noise": 0.01})
    liar.handle(keys_request)
    assert output_digest(joined(liar.handle(requests[0]))) != digests[0]
