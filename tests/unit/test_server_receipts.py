"""The server countersigns a consumer's receipt only if it tells the truth about the
session: its consumer, span and seq, no more tokens or compute than were run since
the last receipt, compute within the consumer's wall time (karma's first line)."""

import os
import time

import pytest
import torch
import trio

from compushare.config import ServerLimits
from compushare.karma.ledger import Ledger, ReceiptBook
from compushare.karma.receipts import Receipt, parse_receipt, sign_receipt
from compushare.model.blocks import SpanRunner
from compushare.net.tensors import encode_tensor
from compushare.pipeline.server.inference import InferenceServer
from libp2p.crypto.ed25519 import create_new_key_pair
from libp2p.peer.id import ID

SERVER, CONSUMER, OTHER = (create_new_key_pair() for _ in range(3))


def pid(key_pair) -> str:
    return ID.from_pubkey(key_pair.public_key).to_base58()


@pytest.fixture
def served(tiny_model, tmp_path):
    """A server with a ledger, one session of CONSUMER with 3 tokens computed."""
    book = ReceiptBook(SERVER, tmp_path)
    server = InferenceServer(SpanRunner.load(tiny_model, 0, 2), "model-x", ServerLimits(), key_pair=SERVER, karma=book)
    session = os.urandom(16)

    async def setup():
        await server.handle({"type": "open", "session": session, "model": "model-x", "start": 0, "end": 2,
                             "max_tokens": 16}, pid(CONSUMER))
        reply = await server.handle({"type": "step", "session": session, "position": 0,
                                     "hidden": encode_tensor(torch.randn(1, 3, 64))}, pid(CONSUMER))
        return reply["compute_ms"]

    compute_ms = trio.run(setup)
    return server, book, session, compute_ms


def _ask(inference, session, peer=CONSUMER, signer=None, **fields):
    values = dict(server=pid(SERVER), consumer=pid(peer), model_id="model-x", start=0, end=2, session=session, seq=0,
                  tokens=3, compute_ms=1.0, wall_ms=50.0, time=time.time())
    values.update(fields)
    wire = sign_receipt(Receipt(**values), (signer or peer).private_key)
    return trio.run(inference.handle, {"type": "receipt", "session": session, "receipt": wire}, pid(peer))


def test_karma_server_countersigns_a_truthful_receipt_once(served, tmp_path):
    server, book, session, compute_ms = served
    reply = _ask(server, session, compute_ms=compute_ms, wall_ms=compute_ms + 5)
    assert reply["type"] == "receipted"
    signed = parse_receipt(reply["receipt"])  # both signatures
    assert (signed.server, signed.consumer, signed.tokens) == (pid(SERVER), pid(CONSUMER), 3)
    assert Ledger(tmp_path).entries == [reply["receipt"]]
    assert book.tally().compute_ms == pytest.approx(compute_ms)
    # The same steps cannot be receipted twice: seq 0 is spent, and nothing ran since.
    again = _ask(server, session, compute_ms=compute_ms, wall_ms=compute_ms + 5)
    assert again["code"] == "bad_receipt" and "seq" in again["message"]
    again = _ask(server, session, seq=1, tokens=1, compute_ms=0.0)
    assert again["code"] == "bad_receipt" and "tokens" in again["message"]


@pytest.mark.parametrize("change, words", [
    ({"tokens": 4}, "tokens"),
    ({"compute_ms": 1e6, "wall_ms": 2e6}, "compute"),
    ({"wall_ms": 1e-6}, "wall time"),
    ({"start": 1}, "start"),
    ({"model_id": "model-y"}, "model_id"),
    ({"server": "12D3KooWSomeoneElse"}, "server"),
    ({"time": time.time() - 7200}, "clock"),
])
def test_karma_server_refuses_an_untruthful_receipt(served, change, words):
    server, book, session, compute_ms = served
    # A truthful receipt with one field changed: the rest must not depend on how fast
    # this machine ran the step (a fixed 1 ms claim was refused for compute on a fast one).
    reply = _ask(server, session, **{"compute_ms": compute_ms, "wall_ms": compute_ms + 5, **change})
    assert reply["type"] == "error" and reply["code"] == "bad_receipt" and words in reply["message"]
    assert len(book.ledger) == 0


def test_karma_server_refuses_a_receipt_signed_or_sent_by_another_peer(served):
    server, book, session, _ = served
    forged = _ask(server, session, signer=OTHER)  # names CONSUMER, signed by OTHER
    assert forged["code"] == "bad_receipt" and "signed" in forged["message"]
    stranger = _ask(server, session, peer=OTHER)  # OTHER's own receipt for CONSUMER's session
    assert stranger["code"] == "bad_receipt" and "consumer that opened" in stranger["message"]
    assert len(book.ledger) == 0


def test_karma_receipt_without_a_ledger_or_session_gets_a_clear_error(tiny_model):
    server = InferenceServer(SpanRunner.load(tiny_model, 0, 2), "model-x", ServerLimits(), key_pair=SERVER)
    reply = _ask(server, os.urandom(16))
    assert reply["code"] == "bad_request" and "karma" in reply["message"]
