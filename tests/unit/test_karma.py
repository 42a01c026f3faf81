"""Karma's pure core: receipts, the counting rules, the score, records against their
evidence, failure reports, the Merkle commitment, and the ledger on disk."""

import hashlib
import math
import os

import msgpack
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from compushare.errors import PeerMisbehaved
from compushare.karma import merkle
from compushare.karma.ledger import Ledger, ReportStore
from compushare.karma.receipts import Receipt, countersign, parse_receipt, sign_receipt
from compushare.karma.record import (MAX_KARMA_RECORD_BYTES, KarmaRecord, check_evidence, karma_key, make_record,
                                     newest_karma_index, parse_karma_record)
from compushare.karma.rules import DAILY_CAP_MS, REPORT_FACTOR, base_score, score, tally, verified_reports
from compushare.proofs.inference import GENESIS, FailureReport, StepClaim
from helpers import signed_claim
from libp2p.crypto.ed25519 import create_new_key_pair
from libp2p.peer.id import ID

SERVER, CONSUMER, OTHER = (create_new_key_pair() for _ in range(3))
NOW = 1_790_000_000.0  # a fixed "now", mid-day UTC


def pid(key_pair) -> str:
    return ID.from_pubkey(key_pair.public_key).to_base58()


def receipt(*, server=SERVER, consumer=CONSUMER, session=b"s" * 16, seq=0, compute_ms=100.0, wall_ms=120.0,
            time=NOW - 60, tokens=8, sign_with=None, countersign_with=None) -> bytes:
    body = Receipt(pid(server), pid(consumer), "model-x", 0, 2, session, seq, tokens, compute_ms, wall_ms, time)
    wire = sign_receipt(body, (sign_with or consumer).private_key)
    return countersign(wire, (countersign_with or server).private_key)


# ---------------------------------------------------------------- receipts and the rules


def test_karma_receipt_round_trip_and_both_signatures_are_checked():
    parsed = parse_receipt(receipt())
    assert (parsed.server, parsed.consumer, parsed.tokens, parsed.compute_ms) == (pid(SERVER), pid(CONSUMER), 8,
                                                                                   100.0)
    with pytest.raises(PeerMisbehaved, match="consumer"):
        parse_receipt(receipt(sign_with=OTHER))  # someone else signed for the consumer
    with pytest.raises(PeerMisbehaved, match="countersigned"):
        parse_receipt(receipt(countersign_with=OTHER))
    half = sign_receipt(Receipt(pid(SERVER), pid(CONSUMER), "m", 0, 2, b"s" * 16, 0, 1, 1.0, 2.0, NOW),
                        CONSUMER.private_key)
    parse_receipt(half, countersigned=False)  # what a server checks before countersigning
    with pytest.raises(PeerMisbehaved):
        parse_receipt(half)


def test_karma_receipt_with_a_bad_signature_counts_nothing():
    envelope = msgpack.unpackb(receipt())
    body = msgpack.unpackb(envelope["body"])
    body["compute_ms"] = 10_000.0  # inflated after signing
    envelope["body"] = msgpack.packb(body)
    forged = msgpack.packb(envelope)
    result = tally([forged, receipt(countersign_with=OTHER)], pid(SERVER), as_of=NOW)
    assert result.compute_ms == 0 and result.counted == 0
    assert result.rejected["bad_signature_or_malformed"] == 2


def test_karma_self_signed_receipt_counts_nothing():
    own = receipt(consumer=SERVER)  # the server as its own consumer, both signatures valid
    parse_receipt(own)
    result = tally([own], pid(SERVER), as_of=NOW)
    assert result.compute_ms == 0 and result.rejected["self_signed"] == 1


def test_karma_replayed_receipt_counts_once():
    one = receipt()
    same_slot = receipt(compute_ms=50.0)  # another receipt for the same session and seq
    result = tally([one, one, same_slot, receipt(seq=1)], pid(SERVER), as_of=NOW)
    assert result.counted == 2 and result.compute_ms == 200.0
    assert result.rejected["replayed"] == 2


def test_karma_receipt_for_another_server_or_from_the_future_counts_nothing():
    result = tally([receipt(server=OTHER), receipt(time=NOW + 3600)], pid(SERVER), as_of=NOW)
    assert result.compute_ms == 0
    assert result.rejected == {"for_another_server": 1, "from_the_future": 1}


def test_karma_compute_beyond_observed_wall_time_is_rejected():
    result = tally([receipt(compute_ms=500.0, wall_ms=400.0), receipt(seq=1, compute_ms=400.0, wall_ms=400.0)],
                   pid(SERVER), as_of=NOW)
    assert result.compute_ms == 400.0 and result.rejected["beyond_wall_time"] == 1


def test_karma_receipts_over_the_daily_cap_are_capped_per_consumer_and_day():
    hour = 3_600_000.0
    day0 = NOW - 3600
    wires = [receipt(seq=9, compute_ms=hour / 2, wall_ms=hour / 2, time=day0 - 86_400)]  # the day before
    wires += [receipt(seq=i, compute_ms=hour / 2, wall_ms=hour / 2, time=day0) for i in range(3)]  # 1.5 h
    wires.append(receipt(consumer=OTHER, compute_ms=hour / 2, wall_ms=hour / 2, time=day0))  # another consumer
    result = tally(wires, pid(SERVER), as_of=NOW)
    assert DAILY_CAP_MS == hour
    assert result.compute_ms == hour + hour / 2 + hour / 2
    assert result.capped_ms == hour / 2
    assert result.counted == 4  # the third receipt of the day counts for nothing; the first two in full


def test_karma_score_formula():
    assert score(0) == 1.0 == base_score(0)  # a newcomer
    assert score(1000.0) == pytest.approx(1 + math.log(1001))
    assert score(1000.0, 2) == pytest.approx((1 + math.log(1001)) * REPORT_FACTOR ** 2)
    assert score(-5) == 1.0


@given(st.lists(st.tuples(st.integers(0, 3), st.integers(0, 5), st.floats(0, 5e6), st.floats(0, 5e6),
                          st.integers(-3, 1)), max_size=12))
def test_karma_tally_is_bounded_and_order_independent_in_total(specs):
    """In time order (as a ledger grows) no receipt is backdated, and any order of
    the receipts of one instant counts the same total."""
    consumers = [CONSUMER, OTHER, SERVER, create_new_key_pair()]
    specs = sorted(specs, key=lambda spec: spec[4])
    wires = [receipt(consumer=consumers[c], seq=seq, compute_ms=comp, wall_ms=wall, time=NOW + day * 86_400)
             for c, seq, comp, wall, day in specs]
    forward = tally(wires, pid(SERVER), as_of=NOW + 86_400)
    assert "backdated" not in forward.rejected
    assert forward.compute_ms <= sum(min(comp, wall) for _, _, comp, wall, _ in specs) + 1e-6
    days = {(c, d) for c, _, _, _, d in specs}
    assert forward.compute_ms <= DAILY_CAP_MS * len(days) + 1e-6
    if len({(c, s) for c, s, *_ in specs}) == len(specs):  # no replays: within a day, order cannot matter
        shuffled = sorted(wires, key=lambda w: (parse_receipt(w).time, hashlib.sha256(w).digest()))
        assert forward.compute_ms == pytest.approx(tally(shuffled, pid(SERVER), as_of=NOW + 86_400).compute_ms)


# ---------------------------------------------------------------- records against their evidence


def test_karma_record_matching_its_evidence_is_accepted():
    wires = [receipt(seq=i) for i in range(3)]
    record = make_record(pid(SERVER), wires, seq=1, now=NOW, ttl_s=3600)
    value = record.sign(SERVER)
    assert len(value) < MAX_KARMA_RECORD_BYTES
    parsed = parse_karma_record(karma_key(pid(SERVER)), value, now=NOW)
    assert parsed == record
    assert check_evidence(parsed, wires).compute_ms == 300.0
    assert parsed.score == pytest.approx(base_score(300.0))


def test_karma_record_whose_score_does_not_match_its_evidence_is_rejected():
    wires = [receipt(seq=i) for i in range(3)]
    key = karma_key(pid(SERVER))
    honest = make_record(pid(SERVER), wires, seq=1, now=NOW, ttl_s=3600)
    # Claims more compute than its receipts count for (score consistent with the claim).
    inflated = KarmaRecord(honest.peer_id, 2, NOW, NOW + 3600, 3, honest.root, 9e6, base_score(9e6))
    parsed = parse_karma_record(key, inflated.sign(SERVER), now=NOW)
    with pytest.raises(PeerMisbehaved, match="claims"):
        check_evidence(parsed, wires)
    # A score that does not follow from its own compute figure: refused at parse time.
    lying = KarmaRecord(honest.peer_id, 3, NOW, NOW + 3600, 3, honest.root, 300.0, 42.0)
    with pytest.raises(PeerMisbehaved, match="score"):
        parse_karma_record(key, lying.sign(SERVER), now=NOW)
    # Evidence that is not what the record committed to: one receipt swapped, or missing.
    with pytest.raises(PeerMisbehaved, match="Merkle"):
        check_evidence(honest, wires[:2] + [receipt(seq=7)])
    with pytest.raises(PeerMisbehaved, match="Merkle"):
        check_evidence(honest, wires[:2])
    # The record must count its receipts as the rules do: a self-signed one inflates nothing.
    padded = wires + [receipt(consumer=SERVER, seq=5, compute_ms=1e6, wall_ms=1e6)]
    assert make_record(pid(SERVER), padded, seq=4, now=NOW, ttl_s=60).compute_ms == 300.0


def test_karma_record_signed_by_another_key_expired_or_misplaced_is_rejected():
    record = make_record(pid(SERVER), [], seq=1, now=NOW, ttl_s=3600)
    key = karma_key(pid(SERVER))
    with pytest.raises(PeerMisbehaved, match="signature"):
        parse_karma_record(key, record.sign(OTHER), now=NOW)
    with pytest.raises(PeerMisbehaved, match="expired"):
        parse_karma_record(key, record.sign(SERVER), now=NOW + 7200)
    with pytest.raises(PeerMisbehaved):
        parse_karma_record(karma_key(pid(OTHER)), record.sign(SERVER), now=NOW)
    with pytest.raises(PeerMisbehaved):
        parse_karma_record(key, b"\x00" * (MAX_KARMA_RECORD_BYTES + 1), now=NOW)


def test_karma_dht_select_keeps_the_newest_valid_record():
    key = karma_key(pid(SERVER))
    values = [make_record(pid(SERVER), [], seq=s, now=NOW, ttl_s=60).sign(SERVER) for s in (5, 9, 7)]
    forged = make_record(pid(SERVER), [], seq=99, now=NOW, ttl_s=60).sign(OTHER)
    assert newest_karma_index(key, values + [forged]) == 1


# ---------------------------------------------------------------- failure reports


def _claim(key_pair, output: np.ndarray, digest: bytes, position=5) -> StepClaim:
    data = output.astype("<f4").tobytes()
    return signed_claim(key_pair, data, model="model-x", start=0, end=2, position=position, tokens=1,
                        input_digest=digest)


def _report(accused, witness, *, position=5, forge_with=None) -> bytes:
    digest = hashlib.sha256(os.urandom(8)).digest()
    good = np.ones(64, dtype=np.float32)
    bad = good + 0.5
    claim = _claim(forge_with or accused, bad, digest, position)
    claim = StepClaim(pid(accused), claim.dtype, claim.output, claim.signature)
    return FailureReport("fp32", "model-x", 0, 2, position, 1, GENESIS, digest, claim, _claim(witness, good, digest, position)).to_wire()


def test_karma_failure_report_with_a_forged_signature_is_ignored():
    accused, witness = SERVER, OTHER
    assert len(verified_reports([_report(accused, witness)], pid(accused))) == 1
    forged = _report(accused, witness, forge_with=CONSUMER)  # "signed" for the accused by someone else
    assert verified_reports([forged], pid(accused)) == []
    assert verified_reports([b"garbage", msgpack.packb({"format": 1})], pid(accused)) == []


def test_karma_reports_count_once_per_witness_and_only_against_the_accused():
    accused, witness, third = SERVER, OTHER, CONSUMER
    wires = [_report(accused, witness, position=p) for p in (1, 2, 3)]  # one witness, three reports
    wires.append(_report(accused, third))
    wires.append(_report(witness, accused))  # against someone else
    found = verified_reports(wires, pid(accused))
    assert sorted(r.witness.peer_id for r in found) == sorted([pid(witness), pid(third)])
    # Everyone picks the same report per witness, whatever the order they hold them in.
    again = verified_reports(list(reversed(wires)), pid(accused))
    assert [r.digest for r in found] == [r.digest for r in again]


# ---------------------------------------------------------------- Merkle commitment


@given(st.lists(st.binary(max_size=40), min_size=1, max_size=40), st.data())
def test_karma_merkle_proofs_verify_and_tampering_fails(leaves, data):
    root = merkle.merkle_root(leaves)
    index = data.draw(st.integers(0, len(leaves) - 1))
    path = merkle.proof(leaves, index)
    assert merkle.verify(leaves[index], index, len(leaves), path, root)
    assert not merkle.verify(leaves[index] + b"x", index, len(leaves), path, root)
    if len(leaves) > 1:
        other = (index + 1) % len(leaves)
        assert not merkle.verify(leaves[index], other, len(leaves), path, root) or leaves[other] == leaves[index]
    changed = list(leaves)
    changed[index] = leaves[index] + b"!"
    assert merkle.merkle_root(changed) != root
    assert merkle.merkle_root(leaves + [b""]) != root  # a longer ledger is another commitment


def test_karma_merkle_root_of_nothing_is_fixed():
    assert merkle.merkle_root([]) == hashlib.sha256(b"").digest()


# ---------------------------------------------------------------- the ledger on disk


def test_karma_ledger_survives_restarts_and_a_torn_last_entry(tmp_path):
    ledger = Ledger(tmp_path)
    wires = [receipt(seq=i) for i in range(3)]
    for wire in wires:
        ledger.append(wire, parse_receipt(wire))
    with open(ledger.path, "ab") as handle:  # a crash mid-append
        handle.write(b"\x00\x00\x01\x00partial")
    again = Ledger(tmp_path)
    assert again.entries == wires
    assert parse_receipt(wires[1]).slot in again.slots
    assert ledger.path.stat().st_size == sum(4 + len(w) for w in wires)  # the torn tail is cut off
    extra = receipt(seq=3)
    again.append(extra, parse_receipt(extra))
    assert Ledger(tmp_path).entries == wires + [extra]


def test_karma_report_store_keeps_each_report_once(tmp_path):
    store = ReportStore(tmp_path)
    report = FailureReport.from_wire(_report(SERVER, OTHER))
    assert store.add(report) and not store.add(report)
    assert store.against(pid(SERVER)) == [report.to_wire()]
    assert store.against(pid(OTHER)) == [] and store.accused() == {pid(SERVER)}


def test_karma_backdated_or_lapsed_receipts_count_nothing():
    recent = receipt(seq=0, time=NOW - 60)
    backdated = receipt(seq=1, time=NOW - 5 * 86_400)  # written after a recent one, dated days before
    jitter = receipt(seq=2, time=NOW - 60 - 400)  # honest clocks disagree by up to 2 x 300 s
    result = tally([recent, backdated, jitter], pid(SERVER), as_of=NOW)
    assert result.counted == 2 and result.rejected == {"backdated": 1}
    old = receipt(seq=3, time=NOW - 31 * 86_400)  # karma is the last 30 days' compute
    assert tally([old], pid(SERVER), as_of=NOW).rejected == {"older_than_window": 1}


def test_karma_receipt_with_fields_beyond_the_schema_is_rejected():
    envelope = msgpack.unpackb(sign_receipt(Receipt(pid(SERVER), pid(CONSUMER), "m", 0, 2, b"s" * 16, 0, 1, 1.0, 2.0,
                                                    NOW), CONSUMER.private_key))
    body = msgpack.unpackb(envelope["body"])
    body["padding"] = b"x" * 1500  # would push the countersigned receipt over its size limit
    envelope["body"] = msgpack.packb(body)
    envelope["csig"] = CONSUMER.private_key.sign(msgpack.packb(["compushare/receipt/consumer/v1", envelope["body"]]))
    with pytest.raises(PeerMisbehaved, match="exactly"):
        parse_receipt(msgpack.packb(envelope), countersigned=False)


def test_karma_record_issued_in_the_future_or_living_too_long_is_rejected():
    key = karma_key(pid(SERVER))
    ahead = make_record(pid(SERVER), [], seq=1, now=NOW + 3600, ttl_s=60)
    with pytest.raises(PeerMisbehaved, match="future"):
        parse_karma_record(key, ahead.sign(SERVER), now=NOW)
    forever = make_record(pid(SERVER), [], seq=1, now=NOW, ttl_s=10 * 86_400)
    with pytest.raises(PeerMisbehaved, match="too long"):
        parse_karma_record(key, forever.sign(SERVER), now=NOW)


def test_karma_ledger_refuses_a_taken_slot_or_an_oversized_entry(tmp_path):
    ledger = Ledger(tmp_path)
    wire = receipt()
    ledger.append(wire, parse_receipt(wire))
    with pytest.raises(PeerMisbehaved, match="already"):
        ledger.append(receipt(compute_ms=1.0), parse_receipt(wire))  # same session and seq
    with pytest.raises(PeerMisbehaved, match="at most"):
        ledger.append(b"x" * 4096, parse_receipt(receipt(seq=1)))
    assert Ledger(tmp_path).entries == [wire]


def test_karma_report_store_keeps_one_per_pair_and_a_bounded_number(tmp_path, monkeypatch):
    store = ReportStore(tmp_path)
    assert store.add(FailureReport.from_wire(_report(SERVER, OTHER, position=1)))
    assert not store.add(FailureReport.from_wire(_report(SERVER, OTHER, position=2)))  # same pair
    monkeypatch.setattr(ReportStore, "MAX_REPORTS", 2)
    assert store.add(FailureReport.from_wire(_report(CONSUMER, OTHER)))
    assert not store.add(FailureReport.from_wire(_report(OTHER, SERVER)))  # full
    assert ReportStore(tmp_path).accused() == {pid(SERVER), pid(CONSUMER)}  # the index is rebuilt from disk
