"""The karma protocol's answers (KarmaService._answer on a real, unconnected host):
receipts paged within a byte budget, the owner's record, reports it witnessed only."""

import hashlib
import os

import numpy as np
import pytest
import trio
import trio.testing

from compushare.errors import PeerMisbehaved
from compushare.karma.receipts import Receipt, countersign, sign_receipt
from compushare.karma.record import karma_validators
from compushare.karma.service import (
    PAGE, REPLY_BYTES, RETRY_S, KarmaBook, KarmaService, retry_wait,
)
from compushare.net.dht import open_dht
from compushare.net.host import open_host
from compushare.proofs.inference import GENESIS, FailureReport
from helpers import signed_claim
from libp2p.crypto.ed25519 import create_new_key_pair
from libp2p.peer.id import ID

NODE, CONSUMER, OTHER = (create_new_key_pair() for _ in range(3))


def pid(key_pair) -> str:
    return ID.from_pubkey(key_pair.public_key).to_base58()


def _report(accused, witness) -> FailureReport:
    digest = hashlib.sha256(os.urandom(8)).digest()
    claims = []
    for key_pair, value in ((accused, 1.5), (witness, 1.0)):
        data = np.full(64, value, dtype="<f4").tobytes()
        claims.append(signed_claim(key_pair, data, model="m", start=0, end=2, position=3, tokens=1,
                                   input_digest=digest))
    return FailureReport("fp32", "m", 0, 2, 3, 1, GENESIS, digest, claims[0], claims[1])


def test_karma_service_pages_receipts_reports_and_refuses_reports_it_did_not_witness(tmp_path):
    async def main():
        async with open_host(NODE, []) as host, open_dht(host, server=False, validators=karma_validators()) as dht:
            service = KarmaService(host, dht, NODE, tmp_path)
            for seq in range(PAGE + 10):
                body = Receipt(pid(NODE), pid(CONSUMER), "m", 0, 2, b"s" * 16, seq, 1, 1.0, 2.0, 1.7e9)
                wire = countersign(sign_receipt(body, CONSUMER.private_key), NODE.private_key)
                service.receipts.ledger.append(wire, body)
            entries = service.receipts.ledger.entries
            page = await service._answer({"type": "receipts", "count": len(entries), "offset": 0, "limit": 10_000})
            assert page["total"] == PAGE + 10 and page["items"] == entries[:len(page["items"])]
            assert 0 < len(page["items"]) <= PAGE and sum(len(i) for i in page["items"]) <= REPLY_BYTES
            prefix = await service._answer({"type": "receipts", "count": 3, "offset": 1, "limit": 10})
            assert prefix == {"type": "receipts", "total": 3, "items": entries[1:3]}  # a record's prefix only
            with pytest.raises(PeerMisbehaved):
                await service._answer({"type": "receipts", "count": -1, "offset": 0, "limit": 1})

            assert (await service._answer({"type": "record"}))["value"] is None  # nothing published yet

            witnessed = _report(OTHER, NODE)
            assert await service._answer({"type": "report", "report": witnessed.to_wire()}) == {"type": "kept",
                                                                                                "new": True}
            with pytest.raises(PeerMisbehaved, match="witness"):
                await service._answer({"type": "report", "report": _report(OTHER, CONSUMER).to_wire()})
            reports = await service._answer({"type": "reports", "peer": pid(OTHER)})
            assert reports["items"] == [witnessed.to_wire()]
            with pytest.raises(PeerMisbehaved):
                await service._answer({"type": "bogus"})

    trio.run(main)


def test_karma_book_checks_new_peers_at_once_rechecks_old_ones_and_backs_off_failures():
    book = KarmaBook()
    assert book.due(["a", "b"], now=100.0) == ["a", "b"]  # never checked: due at once
    book.checked("a", 1.5, now=100.0)
    book.checked("b", None, now=100.0)  # b showed no evidence
    assert book.known("a") == 1.5 and book.known("b") is None and book.get("b") == 1.0
    assert book.due(["a", "b", "c"], now=101.0) == ["c"]  # a is fresh; b is not retried at once
    assert book.due(["a", "b"], now=100.0 + KarmaBook.RETRY_S) == ["b"]
    assert book.due(["a", "b"], now=100.0 + KarmaBook.MAX_AGE_S) == ["a", "b"]
    book.checked("b", 0.7, now=200.0)
    assert book.known("b") == 0.7 and book.due(["b"], now=201.0) == []


def test_karma_book_stays_bounded_under_a_stream_of_fresh_identities():
    book = KarmaBook()
    book.checked("honest", 2.0, now=0.0)
    for i in range(3 * KarmaBook.MAX_PEERS):  # a Sybil every 10 ms, each failing its check
        book.checked(f"sybil-{i}", None, now=1.0 + i / 100)
        if i % 1000 == 0:  # an honest peer in view is rechecked every so often
            book.checked("honest", 2.0, now=1.0 + i / 100)
        assert len(book._scores) + len(book._failed) <= KarmaBook.MAX_PEERS
    assert book.known("honest") == 2.0  # checked within the last minute: kept
    assert f"sybil-{3 * KarmaBook.MAX_PEERS - 1}" in book._failed  # the newest failures are remembered


class _ScriptedDht:
    """A DHT whose puts and provides succeed or fail as scripted; it notes when each was tried."""

    def __init__(self, outcomes: list[bool]) -> None:
        self.outcomes, self.tried = outcomes, []
        self.changed = trio.Event()

    def _next(self) -> bool:
        self.tried.append(trio.current_time())
        self.changed.set()
        return self.outcomes.pop(0) if self.outcomes else True

    async def tried_times(self, n: int) -> None:
        while len(self.tried) < n:
            self.changed = trio.Event()
            await self.changed.wait()

    async def provide(self, _key: str) -> bool:
        return self._next()  # py-libp2p answers False when no peer took the provider record

    async def put_value(self, _key: str, _value: bytes) -> None:
        if not self._next():
            raise RuntimeError("no peer stored the value")


class _UnlistenedHost:
    def get_id(self) -> ID:
        return ID.from_pubkey(NODE.public_key)

    def get_addrs(self) -> list:
        return []


def test_retry_wait_doubles_from_retry_s_after_failures_and_is_the_period_after_a_success():
    assert [retry_wait(n, 600.0) for n in range(9)] == [600.0, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0, 600.0]
    assert RETRY_S == 5.0


@pytest.mark.parametrize("loop", ["provide_reports_loop", "publish_loop"])
def test_a_failed_advertisement_is_retried_soon_not_after_the_full_period(tmp_path, loop, monkeypatch):
    # Before: a provide that reached no peer (a loaded swarm) left the report unfindable
    # for PROVIDE_REPORTS_S (10 min); a failed put left the record stale as long.
    monkeypatch.setattr("compushare.karma.service.RETRY_S", 0.01)
    monkeypatch.setattr("compushare.karma.service.DEBOUNCE_S", 0.0)

    async def main():
        dht = _ScriptedDht([False, False, False])
        service = KarmaService(_UnlistenedHost(), dht, NODE, tmp_path)
        service.keep_report(_report(OTHER, NODE))
        async with trio.open_nursery() as nursery:
            nursery.start_soon(getattr(service, loop))
            with trio.fail_after(60):  # three short retries, then the success
                await dht.tried_times(4)
            await trio.testing.wait_all_tasks_blocked()  # the loop now waits out its period
            assert len(dht.tried) == 4  # after the success: the full period (minutes) before the next
            nursery.cancel_scope.cancel()

    trio.run(main)
