"""pipeline/client/chain_plan.build_report: the failure report a chain files when a
third opinion blames a server, built from the two replies' typed step proofs."""

from __future__ import annotations

import hashlib
import math

import numpy as np
import pytest
from libp2p.crypto.ed25519 import create_new_key_pair
from libp2p.peer.id import ID

from compushare.net.records import ServerRecord
from compushare.pipeline.client.chain_events import FileReport, HopReply, HopSession
from compushare.pipeline.client.chain_plan import build_report
from compushare.pipeline.client.routing import Hop
from compushare.pipeline.messages import Proof
from compushare.proofs.inference import DEFAULT_MODE, GENESIS, FailureReport, step_digest
from helpers import signed_claim

KEYS = [create_new_key_pair(bytes([i + 1]) * 32) for i in range(2)]
PEERS = [ID.from_pubkey(kp.public_key).to_base58() for kp in KEYS]
MODEL, START, END, POSITION, TOKENS = "model-x", 0, 3, 5, 1
INPUT = hashlib.sha256(b"every input of the session").digest()
TRUE = np.random.default_rng(1).standard_normal(8).astype(np.float32)


def session(index: int) -> HopSession:
    return HopSession(Hop(ServerRecord(PEERS[index], MODEL, START, END, "float32", (), math.inf, 0), START, END))


def reply(index: int, output: np.ndarray, *, input_digest: bytes = INPUT, signed: bool = True) -> HopReply:
    data = output.astype("<f4").tobytes()
    proof = None
    if signed:
        claim = signed_claim(KEYS[index], data, model=MODEL, start=START, end=END, position=POSITION,
                             tokens=TOKENS, input_digest=input_digest)
        proof = Proof(POSITION, TOKENS, DEFAULT_MODE, GENESIS, input_digest, step_digest("float32", data, TOKENS),
                      claim.signature)
    return HopReply(output, data, "float32", proof)


def filed(accused: HopReply, witness: HopReply) -> FileReport:
    return FileReport(session(0), session(1), POSITION, TOKENS, accused, witness)


def test_two_signed_conflicting_answers_make_a_report_anyone_can_check():
    report = build_report(MODEL, filed(reply(0, TRUE * np.float32(1.05)), reply(1, TRUE)))
    assert isinstance(report, FailureReport)
    assert (report.accused.peer_id, report.witness.peer_id) == (PEERS[0], PEERS[1])
    assert (report.start, report.end, report.position, report.tokens) == (START, END, POSITION, TOKENS)
    FailureReport.from_wire(report.to_wire()).check()


@pytest.mark.parametrize("accused, witness", [
    (reply(0, TRUE * np.float32(1.05), signed=False), reply(1, TRUE)),  # no proof: nothing to convict with
    (reply(0, TRUE * np.float32(1.05)), reply(1, TRUE, input_digest=b"\0" * 32)),  # not the same input
    (reply(0, TRUE * np.float32(1 + 1e-6)), reply(1, TRUE)),  # within the tolerance: no conflict
])
def test_no_report_without_matching_proofs_of_a_real_conflict(accused, witness):
    assert build_report(MODEL, filed(accused, witness)) is None
