"""proofs/diloco.py: a participant's signed DiLoCo contribution, a witness's signed
recomputation and the failure report the two make. The part format and its digest,
signing, the strict wire forms and the report's check (hypothesis: every single field
changed, anything from the wire), the tolerance (honest recomputations pass, lies do
not), and karma taking the report like the other kinds."""

from __future__ import annotations

import dataclasses
import hashlib

import msgpack
import numpy as np
import pytest
import trio
from hypothesis import given, settings
from hypothesis import strategies as st
from libp2p.crypto.ed25519 import create_new_key_pair
from libp2p.peer.id import ID

from compushare.proofs.diloco import (CHUNK, CONTRIBUTION_DOMAIN, DILOCO_REPORT_FORMAT, MAX_DILOCO_REPORT_BYTES,
                                      MAX_PART_ELEMENTS, TOLERANCE, Contribution, DilocoClaim, DilocoFailureReport,
                                      Recomputation, check_part, dequantize, part_digest, part_error, scales_bytes)
from compushare.errors import FrameError, PeerMisbehaved
from compushare.karma.ledger import ReportStore
from compushare.karma.rules import verified_reports
from compushare.proofs.fields import MAX_REPORT_BYTES
from compushare.proofs.reports import parse_report

pytestmark = pytest.mark.unit

KEYS = [create_new_key_pair(bytes([i + 70]) * 32) for i in range(3)]
PEERS = [ID.from_pubkey(kp.public_key).to_base58() for kp in KEYS]
RUN, BASE, GROUP = "ab" * 32, hashlib.sha256(b"outer weights").digest(), hashlib.sha256(b"a group").digest()


def quantize(x: np.ndarray) -> tuple[bytes, bytes]:
    """The part format: int8 values, one fp32 absmax/127 scale per CHUNK values."""
    n = x.size
    padded = np.zeros(-(-n // CHUNK) * CHUNK, np.float32)
    padded[:n] = x
    chunks = padded.reshape(-1, CHUNK)
    scales = np.abs(chunks).max(axis=1) / 127
    scales[scales == 0] = 1
    q = np.clip(np.round(chunks / scales[:, None]), -127, 127).astype(np.int8).ravel()[:n]
    return q.tobytes(), scales.astype("<f4").tobytes()


RNG = np.random.default_rng(7)
VALUES = RNG.standard_normal(600).astype(np.float32)  # 3 chunks, the last one short
TRUE = quantize(VALUES)
HONEST = quantize(VALUES * (1 + 1e-3 * RNG.standard_normal(600)).astype(np.float32))  # another CPU's recomputation
LIE = quantize(RNG.standard_normal(600).astype(np.float32))  # not what the round gives


def contribution(part=TRUE, peer: int = 0, **overrides) -> Contribution:
    c = Contribution.of(RUN, 3, BASE, PEERS[peer], GROUP, 1, 3, 4096, *part)
    return dataclasses.replace(c, **overrides)


def claim(part=TRUE, peer: int = 0, *, signer: int | None = None, **overrides) -> DilocoClaim:
    c = contribution(part, peer, **overrides)
    return DilocoClaim(PEERS[peer], *part, c.sign(KEYS[peer if signer is None else signer]))


def report(accused=LIE, witness=TRUE, *, witness_peer: int = 1) -> DilocoFailureReport:
    c = contribution(accused)
    return DilocoFailureReport.witnessed(KEYS[witness_peer], c, c.claim(c.sign(KEYS[0]), *accused), *witness)


VALID = report()


# ---------------------------------------------------------------- the part and the contribution


def test_a_part_is_int8_values_times_one_fp32_scale_per_chunk():
    q = bytes([1, 2, 255]) + bytes(CHUNK - 3) + bytes([3])  # CHUNK + 1 values: 2 scales
    scales = np.array([0.5, -2.0], "<f4").tobytes()
    assert scales_bytes(CHUNK + 1) == 8 and scales_bytes(CHUNK) == 4 and scales_bytes(1) == 4
    values = dequantize(q, scales)
    assert values.dtype == np.float64 and values.size == CHUNK + 1
    assert list(values[:3]) == [0.5, 1.0, -0.5] and values[CHUNK] == -6.0
    assert part_digest(q, scales) == hashlib.sha256(q + scales).digest()
    check_part(q, scales)
    for bad_q, bad_scales in [(b"", b""), (q, scales[:4]), (q, scales + bytes(4)), (q[:CHUNK], scales),
                              (bytes(MAX_PART_ELEMENTS + 1), bytes(scales_bytes(MAX_PART_ELEMENTS + 1))),
                              ("text", scales), (q, None)]:
        with pytest.raises(PeerMisbehaved):
            check_part(bad_q, bad_scales)


def test_a_signed_contribution_verifies_for_its_signer_only_and_on_every_field():
    c = contribution()
    sig = c.sign(KEYS[0])
    assert c.verify(sig) and not dataclasses.replace(c, peer=PEERS[1]).verify(sig)
    assert not c.verify(contribution(peer=1).sign(KEYS[1])) and not c.verify(b"x" * 64)
    assert msgpack.unpackb(c.encode())[0] == CONTRIBUTION_DOMAIN
    for field, other in [("run", "cd" * 32), ("round", 4), ("base", bytes(32)), ("group", bytes(32)), ("index", 0),
                         ("parts", 4), ("tokens", 4095), ("part", part_digest(*LIE))]:
        assert not dataclasses.replace(c, **{field: other}).verify(sig), field
    # a witness's recomputation is not a contribution, nor the reverse (their own domains)
    recomputation = Recomputation(c.digest, PEERS[0], c.part)
    assert not c.verify(recomputation.sign(KEYS[0])) and not recomputation.verify(sig)


def test_a_received_part_must_be_the_signed_one():
    c = contribution()
    sig = c.sign(KEYS[0])
    assert c.claim(sig, *TRUE) == DilocoClaim(PEERS[0], *TRUE, sig)
    for bad_sig, part in [(sig, LIE), (sig, (TRUE[0], TRUE[1][:-4])), (None, TRUE), (b"", TRUE), ("sig", TRUE),
                          (contribution().sign(KEYS[1]), TRUE), (b"x" * 2000, TRUE)]:
        with pytest.raises(PeerMisbehaved):
            c.claim(bad_sig, *part)


def test_a_contribution_round_trips_and_its_wire_form_is_strict():
    c = contribution()
    body = msgpack.unpackb(msgpack.packb(c.to_wire(), use_bin_type=True), raw=False)
    assert Contribution.from_wire(body) == c
    for key, value in [("run", "AB" * 32), ("run", "ab" * 31), ("round", -1), ("round", True), ("base", bytes(31)),
                       ("group", "g"), ("peer", ""), ("peer", "p" * 129), ("index", 3), ("index", -1),
                       ("parts", 0), ("parts", 1 << 13), ("tokens", -1), ("tokens", 1.5), ("part", bytes(33)),
                       ("extra", 1)]:
        with pytest.raises(PeerMisbehaved):
            Contribution.from_wire(body | {key: value})
    for junk in [None, [], "x", {k: v for k, v in body.items() if k != "tokens"}]:
        with pytest.raises(PeerMisbehaved):
            Contribution.from_wire(junk)


ints = st.integers(-(1 << 63), (1 << 64) - 1)  # what msgpack holds
values = st.one_of(st.none(), st.booleans(), ints, st.binary(max_size=40), st.text(max_size=70),
                   st.lists(ints, max_size=3))


@settings(max_examples=200)
@given(st.fixed_dictionaries({k: values for k in contribution().to_wire()}))
def test_contribution_from_wire_on_anything_raises_only_peer_misbehaved(body):
    try:
        Contribution.from_wire(body)
    except PeerMisbehaved:
        pass


# ---------------------------------------------------------------- the report


def test_the_tolerance_passes_honest_recomputations_and_catches_lies():
    assert part_error(*HONEST, *TRUE) < TOLERANCE / 5
    assert part_error(*LIE, *TRUE) > 1
    assert part_error(*quantize(np.zeros(600, np.float32)), *TRUE) == pytest.approx(1)
    assert part_error(*quantize(VALUES * 0.85), *TRUE) > TOLERANCE > part_error(*quantize(VALUES * 0.95), *TRUE)


def test_a_report_of_a_lie_checks_and_round_trips_through_parse_report():
    VALID.check()
    assert (VALID.accused.peer_id, VALID.witness.peer_id) == (PEERS[0], PEERS[1]) and VALID.error() > 1
    wire = VALID.to_wire()
    assert msgpack.unpackb(wire)["format"] == DILOCO_REPORT_FORMAT
    back = DilocoFailureReport.from_wire(wire)
    assert back == VALID and back.to_wire() == wire and back.digest == VALID.digest == hashlib.sha256(wire).hexdigest()
    assert parse_report(wire) == VALID  # the karma readers' one parser
    back.check()
    assert back.contribution() == contribution(LIE)
    assert back.recomputation() == Recomputation(contribution(LIE).digest, PEERS[1], part_digest(*TRUE))


def test_a_report_within_the_tolerance_is_refused():
    for accused, witness in [(TRUE, TRUE), (TRUE, HONEST), (HONEST, TRUE)]:
        with pytest.raises(PeerMisbehaved, match="within the tolerance"):
            report(accused, witness).check()


def _forge(r: DilocoFailureReport, who: str, **changes) -> DilocoFailureReport:
    return dataclasses.replace(r, **{who: dataclasses.replace(getattr(r, who), **changes)})


def test_a_report_is_refused_for_forgeries_other_bytes_or_another_statement():
    c = contribution(LIE)
    other = Recomputation(contribution(LIE, round=4).digest, PEERS[1], part_digest(*TRUE))  # another round's
    for bad, match in [
        (_forge(VALID, "accused", signature=c.sign(KEYS[2])), "contribution of"),  # another key's signature
        (_forge(VALID, "accused", signature=b"x" * 64), "contribution of"),
        (_forge(VALID, "accused", q=TRUE[0], scales=TRUE[1]), "contribution of"),  # not the bytes it signed
        (_forge(VALID, "accused", q=bytes([VALID.accused.q[0] ^ 1]) + VALID.accused.q[1:]), "contribution of"),
        (_forge(VALID, "witness", signature=Recomputation(c.digest, PEERS[1], part_digest(*TRUE)).sign(KEYS[2])),
         "recomputation of"),
        (_forge(VALID, "witness", signature=other.sign(KEYS[1])), "recomputation of"),  # of another statement
        (_forge(VALID, "witness", signature=contribution(TRUE, 1).sign(KEYS[1])), "recomputation of"),
        (_forge(VALID, "witness", q=HONEST[0], scales=HONEST[1]), "recomputation of"),  # not the bytes it signed
        (dataclasses.replace(VALID, round=4), "contribution of"),  # the report moved to another statement
        (dataclasses.replace(VALID, index=0), "contribution of"),
        (dataclasses.replace(VALID, group=bytes(32)), "contribution of"),
        (dataclasses.replace(VALID, tokens=1), "contribution of"),
    ]:
        with pytest.raises(PeerMisbehaved, match=match):
            bad.check()


def test_a_report_is_refused_for_one_peer_or_parts_of_other_sizes():
    with pytest.raises(PeerMisbehaved, match="two different"):
        report(witness_peer=0).check()
    short = quantize(VALUES[:500])
    with pytest.raises(PeerMisbehaved, match="different sizes"):
        report(LIE, short).check()  # signed by the witness, but not the part's size
    with pytest.raises(PeerMisbehaved):
        _forge(VALID, "witness", scales=VALID.witness.scales[:-4]).check()


def test_a_non_finite_part_is_a_lie_but_no_reference():
    nan_scales = np.frombuffer(TRUE[1], "<f4").copy()
    nan_scales[1] = np.nan
    poisoned = (TRUE[0], nan_scales.tobytes())
    assert part_error(*poisoned, *TRUE) == float("inf")
    report(poisoned, TRUE).check()
    with pytest.raises(PeerMisbehaved, match="not finite"):
        report(TRUE, poisoned).check()


def test_the_largest_parts_make_a_report_parse_report_takes():
    big = quantize(np.random.default_rng(1).standard_normal(MAX_PART_ELEMENTS).astype(np.float32))
    r = report(quantize(np.zeros(MAX_PART_ELEMENTS, np.float32)), big)
    wire = r.to_wire()
    assert len(wire) <= MAX_DILOCO_REPORT_BYTES <= MAX_REPORT_BYTES
    parsed = parse_report(wire)
    assert isinstance(parsed, DilocoFailureReport)
    parsed.check()
    with pytest.raises(PeerMisbehaved, match="at most"):
        DilocoFailureReport.from_wire(wire + bytes(MAX_DILOCO_REPORT_BYTES))


def _body(r: DilocoFailureReport = VALID) -> dict:
    return msgpack.unpackb(r.to_wire(), raw=False)


def _changed(value, draw):
    if isinstance(value, int):
        return value + draw(st.sampled_from([-1, 1, 2]))
    if isinstance(value, bytes):
        index = draw(st.integers(0, len(value) - 1))
        return value[:index] + bytes([value[index] ^ draw(st.integers(1, 255))]) + value[index + 1:]
    return draw(st.sampled_from([value + "x", value[:-1], "1", PEERS[2], value.upper()]).filter(lambda v: v != value))


FIELDS = [(k,) for k, v in _body().items() if k != "format" and not isinstance(v, dict)] + \
    [(who, k) for who in ("accused", "witness") for k in ("peer", "q", "scales", "sig")]


@settings(max_examples=200)
@given(st.sampled_from(FIELDS), st.data())
def test_every_single_field_change_to_a_valid_report_is_rejected(path, data):
    body = _body()
    target = body
    for key in path[:-1]:
        target = target[key]
    target[path[-1]] = _changed(target[path[-1]], data.draw)
    with pytest.raises(PeerMisbehaved):
        parse_report(msgpack.packb(body, use_bin_type=True)).check()


@settings(max_examples=300)
@given(st.binary(max_size=300))
def test_junk_bytes_raise_only_peer_misbehaved(data):
    for parse in (parse_report, DilocoFailureReport.from_wire):
        try:
            parse(data).check()
        except (PeerMisbehaved, FrameError):
            pass


@settings(max_examples=200)
@given(st.lists(st.tuples(st.sampled_from(FIELDS), values), min_size=1, max_size=4))
def test_a_mangled_report_raises_only_peer_misbehaved(changes):
    body = _body()
    for path, value in changes:
        target = body
        for key in path[:-1]:
            target = target[key]
        target[path[-1]] = value
    try:
        parse_report(msgpack.packb(body, use_bin_type=True)).check()
    except PeerMisbehaved:
        pass


# ---------------------------------------------------------------- karma takes it like the other kinds


def test_karma_counts_a_diloco_report_once_per_witness_and_stores_it(tmp_path):
    forged = _forge(report(witness_peer=2), "accused", signature=contribution(LIE).sign(KEYS[1]))
    wires = [VALID.to_wire(), report(witness_peer=2).to_wire(), report(LIE, HONEST).to_wire(),  # PEERS[1] again
             forged.to_wire(),  # not counted
             report(TRUE, HONEST).to_wire()]  # within the tolerance: not counted
    found = verified_reports(wires, PEERS[0])
    assert sorted(r.witness.peer_id for r in found) == sorted(PEERS[1:])
    assert all(isinstance(r, DilocoFailureReport) for r in found)
    assert verified_reports(wires, PEERS[1]) == []
    store = ReportStore(tmp_path)
    assert store.add(VALID) and not store.add(VALID) and not store.add(report(LIE, HONEST))  # one per pair
    assert store.against(PEERS[0]) == [VALID.to_wire()]
    assert ReportStore(tmp_path).accused() == {PEERS[0]}  # read back from disk


def test_the_karma_service_keeps_a_diloco_report_it_witnessed(tmp_path):
    from compushare.karma.record import karma_validators  # noqa: PLC0415
    from compushare.karma.service import KarmaService  # noqa: PLC0415
    from compushare.net.dht import open_dht  # noqa: PLC0415
    from compushare.net.host import open_host  # noqa: PLC0415

    async def main():
        async with open_host(KEYS[1], []) as host, open_dht(host, server=False, validators=karma_validators()) as dht:
            service = KarmaService(host, dht, KEYS[1], tmp_path)
            assert await service._answer({"type": "report", "report": VALID.to_wire()}) == {"type": "kept",
                                                                                             "new": True}
            with pytest.raises(PeerMisbehaved, match="witness"):
                await service._answer({"type": "report", "report": report(witness_peer=2).to_wire()})
            with pytest.raises(PeerMisbehaved, match="tolerance"):
                await service._answer({"type": "report", "report": report(TRUE, HONEST).to_wire()})
            assert (await service._answer({"type": "reports", "peer": PEERS[0]}))["items"] == [VALID.to_wire()]

    trio.run(main)
